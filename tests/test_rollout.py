"""The rollout engine: TLT greedy rollouts equal plain ones, hidden states are aligned with
tokens, the batch shrinks, and the bandit finds the best k per bucket."""
import random
import statistics

import pytest
import torch

from drafter import Drafter
from model import GPT, GPTConfig
from harness.checkpoint import bandit_state, load_bandit
from harness.instrument import RolloutStats, TimedDrafter, observers, tail_share
from harness.report import best_arms
from harness.report import bucket_sizes
from rollout import ARMS, Bandit, TailPolicy, rollout

EOS = 3


def tiny_models(seed=0):
    torch.manual_seed(seed)
    target = GPT(GPTConfig(vocab_size=12, block_size=80, n_layer=2, n_head=2, n_embd=16)).double()
    for p in target.parameters():  # large weights: varied, non-repeating greedy outputs
        if p.dim() == 2:
            torch.nn.init.normal_(p, std=0.6)
    drafter = Drafter(target).double()
    for p in drafter.parameters():
        if p.dim() == 2:
            torch.nn.init.normal_(p, std=0.3)
    return target.eval(), drafter.eval()


def observed(*args, n_rows=None, **kwargs):
    """rollout(*args, **kwargs) with a RolloutStats observing it -> (results, the stats)."""
    stats = RolloutStats()
    results = rollout(*args, observer=observers(stats, kwargs.pop("observer", None)), **kwargs)
    return results, stats.finish(len(args[2]))


def prompts(n, seed=1):
    rng = random.Random(seed)
    return [[rng.randrange(4, 12) for _ in range(rng.randint(1, 6))] for _ in range(n)]


@pytest.mark.parametrize("threshold", [0, 6, 100])
def test_tlt_greedy_rollout_equals_plain(threshold):
    target, drafter = tiny_models()
    ps = prompts(12)
    plain, st_plain = observed(target, None, ps, 40, temperature=0, eos_id=EOS)
    timed = TimedDrafter(drafter, torch.device("cpu"))
    tlt, st_tlt = observed(target, timed, ps, 40, temperature=0, eos_id=EOS, sd_threshold=threshold,
                          bandit=Bandit(seed=3))
    assert [r[0] for r in tlt] == [r[0] for r in plain]
    assert len({tuple(r[0]) for r in plain}) > 3  # outputs are not trivial
    assert any(r[0][-1] == EOS for r in plain) and any(len(r[0]) == 40 for r in plain)
    if threshold == 100:  # from the first step; drafting is part of the speculative steps' time
        assert st_tlt.sd_row_steps > 0 and 0 < timed.seconds() < st_tlt.time
    if threshold == 0:
        assert st_tlt.sd_row_steps == 0
    assert st_plain.sd_row_steps == 0 and st_plain.accept_len is None
    if threshold == 0:
        assert timed.seconds() == 0


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_gumbel_rollout_is_token_identical_to_plain_for_any_threshold(temperature):
    """Exact-token sampling through the engine: plain decoding, speculation from the first step,
    and a switch mid-rollout with the bandit choosing k (0 included) give the same tokens."""
    target, drafter = tiny_models(3)
    ps = prompts(12, seed=4)
    keys = [1000 + 7 * i for i in range(len(ps))]
    how = dict(temperature=temperature, eos_id=EOS, sampler="gumbel", keys=keys)
    plain = rollout(target, None, ps, 40, **how)
    assert len({tuple(r[0]) for r in plain}) == len(ps)  # sampled, varied outputs
    for threshold in (7, 100):  # a switch mid-rollout, and speculation from the first step
        bandit = Bandit(arms=(3, 0, 1, 6), seed=threshold)  # speculates first, then tries plain steps too
        tlt, st = observed(target, drafter, ps, 40, sd_threshold=threshold, bandit=bandit, **how)
        assert st.sd_row_steps > 0 and st.accept_hist.get(0, 0) > 0  # speculated, and rejected some drafts
        assert [r[0] for r in tlt] == [r[0] for r in plain]


@pytest.mark.parametrize("tlt", [False, True])
def test_hidden_states_align_with_tokens(tlt):
    """hidden[j] must be the target's state after reading tokens[j], in plain and SD steps."""
    target, drafter = tiny_models(1)
    ps = prompts(6, seed=2)
    gen = torch.Generator().manual_seed(0)
    results, st = observed(target, drafter if tlt else None, ps, 30, temperature=1.0, eos_id=EOS, generator=gen,
                          sd_threshold=4, bandit=Bandit(seed=0))
    if tlt:
        assert st.sd_row_steps > 0
    for (gen_ids, tokens, hidden, plen), p in zip(results, ps):
        assert tokens.tolist() == p + gen_ids and plen == len(p)
        assert hidden.shape[0] == tokens.shape[0] - 1
        with torch.no_grad():
            _, full = target(tokens[None, :-1])
        torch.testing.assert_close(hidden, full[0], atol=1e-9, rtol=0)


@pytest.mark.parametrize("sampler", ["gumbel", "rejection"])
def test_the_bandit_is_scored_with_every_steps_tokens(sampler):
    """In the tail every decoding step, plain (k = 0) or speculative, scores the bandit's arm with
    the tokens it emitted, while rows finish mid-run."""
    target, drafter = tiny_models(3)
    ps = [p for p in prompts(6, seed=8) for _ in range(4)]  # 6 GRPO groups of 4
    scored = []

    class Spy(Bandit):
        def update(self, batch_size, arm, tokens, seconds):
            scored.append(tokens)
            super().update(batch_size, arm, tokens, seconds)
    results, st = observed(target, drafter, ps, 40, temperature=1.0, eos_id=EOS, sampler=sampler, sd_threshold=100,
                           bandit=Spy(arms=(0, 2, 3), seed=1), generator=torch.Generator().manual_seed(0),
                           keys=list(range(len(ps))))
    sizes = st.batch_sizes
    assert st.sd_row_steps > 0 and st.accept_hist.get(0, 0) > 0 and st.sd_row_steps < sum(sizes)  # plain steps too
    assert any(0 < b < a for a, b in zip(sizes, sizes[1:]))  # rows finished mid-run: compactions in the loop
    assert len(scored) == st.steps and sum(scored) == st.tokens  # the bandit saw every step's tokens
    assert all(r.response and len(r.tokens) == r.prompt_len + len(r.response) for r in results)


def test_tail_policy_decodes_plainly_above_the_threshold_and_asks_the_bandit_at_or_below():
    """rollout.TailPolicy, which speculative.decode asks for each step's k: above the threshold a
    plain step (k = 0) that the bandit does not score; at or below it the bandit's k, scored with
    the step's tokens per second."""
    bandit = Bandit(arms=(2, 4), seed=0)
    policy = TailPolicy(bandit, threshold=4)
    assert policy.choose(5) == 0
    policy.update(5, 0, 10, 1.0)
    assert not bandit.plays  # a big batch's step scores nothing
    k = policy.choose(4)
    assert k in (2, 4)
    policy.update(4, k, 6, 1.0)  # an arm's first play only marks it tried
    policy.update(4, k, 6, 2.0)
    assert bandit.score(Bandit.bucket(4), k) == 3.0


def test_batch_shrinks_as_rows_finish():
    target, drafter = tiny_models(2)
    _, st = observed(target, None, prompts(10, seed=5), 40, temperature=0, eos_id=EOS)
    sizes = st.batch_sizes
    assert sizes[0] <= 10 and sizes[-1] >= 1
    assert all(a >= b for a, b in zip(sizes, sizes[1:]))
    assert sizes[-1] < sizes[0]  # rows really left the batch
    assert st.tail_share == tail_share(sizes, st.step_times, st.time, 10)


def test_tail_share_counts_the_time_after_90_percent_of_rows_finished():
    # 20 rows: the tail starts when at most 2 are still running
    sizes, times = [20, 20, 10, 3, 2, 2, 1], [1.0, 1.0, 1.0, 1.0, 2.0, 2.0, 1.0]
    assert tail_share(sizes, times, total_time=10.0, n_rows=20) == pytest.approx(0.5)
    assert tail_share(sizes, times, total_time=10.0, n_rows=20, done_frac=0.5) == pytest.approx(0.7)
    assert tail_share([], [], total_time=0.0, n_rows=0) == 0.0


def test_empty_rollout():
    target, drafter = tiny_models()
    results, st = observed(target, drafter, [], 10)
    assert results == [] and st.tokens == 0 and st.steps == 0


def test_bandit_converges_to_best_arm_per_bucket():
    """Synthetic reward table with noise: the greedy choice after exploration is each bucket's best arm."""
    table = {0: {0: 100, 1: 150, 2: 190, 3: 230, 4: 260, 6: 240, 8: 200},   # batch 1: long drafts pay
             3: {0: 800, 1: 900, 2: 1000, 3: 850, 4: 800, 6: 700, 8: 600},    # batch 5..8: short drafts
             5: {0: 3000, 1: 2500, 2: 2000, 3: 1800, 4: 1500, 6: 1200, 8: 900}}  # batch 17..32: plain
    batch_of = {0: 1, 3: 7, 5: 20}
    noise = random.Random(0)
    bandit = Bandit(epsilon=0.1, seed=0)
    picks = {b: [] for b in table}
    for _ in range(400):
        for b, bs in batch_of.items():
            k = bandit.choose(bs)
            picks[b].append(k)
            bandit.update(bs, k, table[b][k] * (1 + 0.1 * noise.gauss(0, 1)), 1.0)
    for b in table:
        best = max(table[b], key=table[b].get)
        assert best_arms(bandit)[b] == best
        late = picks[b][-200:]
        assert late.count(best) / len(late) > 0.8  # epsilon = 0.1 explores ~10% of the time


def test_bandit_scores_throughput_not_median_step():
    """Like a speculative step at batch 1: arm 4 emits 5 tokens 45% of the time, else 3, in 1.8 s
    (2.17 tokens/s; median step 1.67); arm 2 emits 3 tokens 70% of the time, else 1, in 1.4 s
    (1.71 tokens/s; median step 2.14). A median score would pick arm 2; throughput picks arm 4."""
    rng = random.Random(0)
    bandit = Bandit(arms=(2, 4), epsilon=0.0, window=1000, seed=0)
    steps = {2: [], 4: []}
    for _ in range(500):
        steps[4].append((5 if rng.random() < 0.45 else 3, 1.8))
        steps[2].append((3 if rng.random() < 0.7 else 1, 1.4))
        for k in (2, 4):
            bandit.update(1, k, *steps[k][-1])
    assert bandit.choose(1) == 4
    assert abs(bandit.score(0, 4) - 3.9 / 1.8) < 0.1  # 499 scored draws: standard error about 0.025 tokens/s
    median = {k: statistics.median(n / t for n, t in s) for k, s in steps.items()}
    assert max(median, key=median.get) == 2  # the case really separates the two scores


def test_one_stalled_step_does_not_sink_an_arms_score():
    """A step stalled by the machine (here 50 times its usual length) must not make the best arm
    look worst: the arm would then rarely be played again to mend its score."""
    bandit = Bandit(arms=(2, 4), epsilon=0.0, window=8, seed=0)
    for k, tokens in ((2, 3.0), (4, 5.0)):
        for seconds in [1.0] * 8 + ([50.0] if k == 4 else []):  # the first play only marks the arm tried
            bandit.update(1, k, tokens, seconds)
    assert bandit.score(0, 4) == 5.0 and bandit.choose(1) == 4


def test_bandit_tries_every_arm_first_and_round_trips_state():
    """Every arm is played twice before any is chosen on its score: the first play only marks it
    tried (its time carries first-time costs), the second is the first one scored."""
    bandit = Bandit(seed=0)
    first = []
    for _ in range(2 * len(ARMS)):
        k = bandit.choose(4)
        first.append(k)
        bandit.update(4, k, 1.0 + k, 100.0 if k not in first[:-1] else 0.5)  # first plays look very slow
    assert sorted(first) == sorted(2 * ARMS)
    assert all(bandit.score(Bandit.bucket(4), k) == (1.0 + k) / 0.5 for k in ARMS)  # the slow first plays do not count
    clone = Bandit(seed=99)
    load_bandit(clone, bandit_state(bandit))  # through a checkpoint's plain lists
    assert [clone.choose(4) for _ in range(50)] == [bandit.choose(4) for _ in range(50)]


def test_bucket_sizes_name_the_batch_sizes_of_each_bucket():
    for n in range(1, 130):
        label = bucket_sizes(Bandit.bucket(n))
        lo, hi = (int(x) for x in label.split("-")) if "-" in label else (int(label), int(label))
        assert lo <= n <= hi
    assert [bucket_sizes(b) for b in range(5)] == ["1", "2", "3-4", "5-8", "9-16"]
