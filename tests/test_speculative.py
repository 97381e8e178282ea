"""Tests for speculative.py (the running batch, the samplers and their verify rules): the verify rules, greedy and sampled losslessness, stats, compaction.

How they can fail, and why they are not weak:

* Greedy tests run in float64, so a token-level disagreement between speculative and plain
  decoding is a real bug (a near-tie flipped by rounding is astronomically unlikely there).
  The target's weights are re-drawn with a large std so that greedy outputs are not one
  repeated token, and the drafter is briefly trained on the target's rollouts so that
  verify steps both accept and reject drafts (checked through the accept histogram).
* Statistical tests compare empirical distributions with exact ones by total variation (TV).
  For K categories and N independent draws, E[TV] <= 0.5 * sqrt(K / N) (Cauchy-Schwarz on
  sum_i E|p^_i - p_i| <= sum_i sqrt(p_i (1 - p_i) / N)). TV of an empirical distribution changes
  by at most 1/N when one draw changes, so McDiarmid gives
  P(TV >= E[TV] + t) <= exp(-2 N t^2). Every TV tolerance below is 4 * 0.5 * sqrt(K / N), i.e.
  t >= 3 * 0.5 * sqrt(K / N), so a correct implementation fails with probability at most
  exp(-4.5 K) per check (K >= 4: below 1.6e-8). Rates (fractions of N Bernoulli draws) use
  Hoeffding: P(|mean - mu| >= t) <= 2 exp(-2 N t^2).
  Everything is seeded, so a run is deterministic; the odds say how unlucky a seed would
  have to be for a correct implementation to fail.
"""
import itertools
import math
import random
import types

import pytest
import torch

from harness import instrument
from drafter import Drafter
from conftest import N_NEW, V_G, make_greedy_setup, randomize, tiny
from harness.instrument import DecodeStats, HostTraffic
from speculative import _mix32_, draw, gumbel_choose, gumbel_noise, gumbel_seeds, probs, verify, verify_gumbel
from speculative import RunningBatch, Step, autoregressive_generate, speculative_generate


def gumbel_argmax(logits, temperature, noise):
    """The Gumbel-max token with the whole noise given: what gumbel_choose must equal."""
    return (logits.float() / temperature + noise).argmax(-1)


def noise_of(keys, positions, V):
    """The "gumbel" sampler's noise (B, T, V) of rows with keys (B,) at positions (B, T)."""
    return gumbel_noise(gumbel_seeds(torch.as_tensor(keys), torch.as_tensor(positions)), V)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """These models are tiny: on a busy 2-core machine, intra-op threads only spin and wait
    (measured: about 100x slower with 2 threads than with 1). Restored afterwards."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def tv_tolerance(K, N):
    """4x the bound on the expected TV of N draws over K categories (see the module docstring)."""
    return 4 * 0.5 * math.sqrt(K / N)


def tv(a, b):
    return 0.5 * float((a.double() - b.double()).abs().sum())






# ----------------------------------------------------------------------------- greedy setup

@pytest.fixture(scope="module")
def greedy_setup():
    """See conftest.make_greedy_setup."""
    return make_greedy_setup()


def truncate_at(o, eos):
    return o[:o.index(eos) + 1] if eos in o else o


# ----------------------------------------------------------------------------- greedy lossless + stats


@pytest.mark.parametrize("B", [1, 3, 8])
@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_greedy_speculative_equals_autoregressive(greedy_setup, B, k):
    target, drafter, pool, free, eos = greedy_setup
    prompts = pool[:B]
    ar, ar_core = autoregressive_generate(target, prompts, N_NEW, temperature=0, eos_id=eos,
                                          observer=(ar_stats := DecodeStats()))
    ar_stats = ar_stats.as_dict()
    # the reference itself: greedy with eos is greedy without eos cut after the first eos
    assert ar == [truncate_at(o, eos) for o in free[:B]]
    assert any(o[-1] == eos and len(o) < N_NEW for o in ar), "eos never stops a row early"
    if B > 1:
        assert any(len(o) == N_NEW and eos not in o for o in ar), "no row runs to max_new_tokens"

    sd, core = speculative_generate(target, drafter, prompts, N_NEW, k=k, temperature=0, eos_id=eos,
                                    observer=(stats := DecodeStats()))
    assert sd == ar
    stats = stats.as_dict()
    assert core["accept_len"] == pytest.approx(stats["accept_len"])  # counted by the core, and outside

    # stats: accept_len is tokens emitted per (row, verify step); the first token of every row
    # comes from the prefill, every other one from a verify step
    assert stats["sd_row_steps"] > 0
    assert stats["accept_len"] == pytest.approx(stats["sd_tokens"] / stats["sd_row_steps"])
    assert 1.0 <= stats["accept_len"] <= k + 1
    assert stats["sd_tokens"] == stats["tokens"] == sum(len(o) for o in sd) - B
    hist = stats["accept_hist"]
    assert set(hist) <= set(range(k + 1)), hist
    assert sum(hist.values()) == stats["sd_row_steps"]
    assert stats["sd_tokens"] <= sum((a + 1) * c for a, c in hist.items())  # truncation only removes
    if B > 1:
        assert len(hist) > 1, f"drafts were all accepted or all rejected: {hist}"
    # by position: every row-step decides its first draft; each kept token past it is an accepted draft
    # or the one target token of a step whose drafts were all decided
    drafted, accepted = stats["drafted_at"], stats["accepted_at"]
    assert len(drafted) == k and drafted[0] == stats["sd_row_steps"]
    assert all(a <= d for a, d in zip(accepted, drafted)) and all(b <= a for a, b in zip(accepted, drafted[1:]))
    assert stats["sd_tokens"] - stats["sd_row_steps"] <= sum(accepted) <= stats["sd_tokens"]
    # plain decoding: one token per row per step, no SD stats
    assert ar_stats["tokens"] == sum(len(o) for o in ar) - B
    assert ar_stats["accept_len"] is None and ar_core["accept_len"] is None


def test_acceptance_by_position_counts_decided_drafts_only():
    """DecodeStats by draft position on a hand-made step (k = 4): a draft is decided when every earlier
    one of its row's step was accepted and the row had not ended (<|eos|> or its limit) on one."""
    st = DecodeStats()
    n_acc = torch.tensor([3, 0, 2, 4, 3])
    n_emitted = torch.tensor([4, 1, 2, 5, 1])  # rows 2 and 4 end on their 2nd and 1st accepted draft
    st(None, Step(5, 4, n_emitted, n_acc))
    st.settle()  # the counts are read from the device at once
    assert st.drafted_at == [5, 3, 2, 2] and st.accepted_at == [4, 3, 2, 1]
    assert st.accept_by_position == [0.8, 1.0, 1.0, 0.5]
    st(None, Step(1, 6, torch.tensor([1]), torch.tensor([0])))  # a longer k grows the lists
    assert st.as_dict()["drafted_at"] == [6, 3, 2, 2, 0, 0] and st.accept_by_position[4] is None


def test_acceptance_by_row_follows_each_row_through_compaction():
    """A step's counts belong to the rows the batch held before that step's compaction: four rows,
    then rows 0 and 2 finish and rows 3 and 1 hold the two slots."""
    st = DecodeStats()
    st(types.SimpleNamespace(row_of_slot=[0, 1, 2, 3]), None)  # the prefill
    after = types.SimpleNamespace(row_of_slot=[3, 1])
    st(after, Step(4, 4, torch.tensor([4, 1, 2, 5]), torch.tensor([3, 0, 2, 4])))
    st(after, Step(2, 4, torch.tensor([2, 3]), torch.tensor([1, 2])))
    st.settle()
    assert st.by_row == {0: [4, 3], 1: [4, 2], 2: [2, 2], 3: [6, 5]}  # [drafts decided, accepted]
    assert sum(v[0] for v in st.by_row.values()) == sum(st.drafted_at)
    assert sum(v[1] for v in st.by_row.values()) == sum(st.accepted_at)


def test_mixed_plain_and_speculative_steps_are_lossless(greedy_setup):
    """rollout.py switches from plain to speculative steps mid-generation: the drafter must catch
    up on every hidden state recorded by plain steps (a ragged, longer-than-k+1 catch-up)."""
    target, drafter, pool, free, eos = greedy_setup
    ar, _ = autoregressive_generate(target, pool, N_NEW, temperature=0, eos_id=eos)
    gen = RunningBatch(target, pool, N_NEW, temperature=0, eos_id=eos, max_draft=3)
    schedule = itertools.cycle([None, None, 3, None, 1, 2, 2])
    kinds = set()
    while gen.compact() > 0:
        k = next(schedule)
        kinds.add(k)
        if k is None:
            gen.plain_step()
        else:
            gen.speculative_step(drafter, k)
    assert len(kinds) > 2
    assert gen.outputs() == ar


def test_drafts_come_from_the_drafter_on_the_recorded_history(greedy_setup, monkeypatch):
    """Losslessness holds for any drafter, so the tests above cannot see a drafter that is fed the
    wrong inputs (an off-by-one pairing, a stale cache after a rollback or a compaction): it only
    lowers acceptance. Check the drafter's proposals directly. At every speculative step, for every
    row with L states read, q_1 must be the drafter's distribution after a plain (cache-free)
    forward over the pairs (h_j, x_{j+1}), j < L, and q_i (i > 1) the one after appending
    (h~, d_{i-1}) with h~ the drafter's own previous prediction; speculative steps of a model-free
    drafter in between (rollout.py's combination) leave it states to catch up on like plain steps."""
    import speculative as sampling
    from harness.model_free import SiblingDrafter

    target, drafter, pool, free, eos = greedy_setup
    seen = []
    real_verify = sampling.verify

    def spy(draft_tokens, q, p, generator=None):
        seen.append((draft_tokens.clone(), q.clone()))
        return real_verify(draft_tokens, q, p, generator)

    monkeypatch.setattr(sampling, "verify", spy)
    g = torch.Generator().manual_seed(6)
    temperature = 0.7  # the drafter samples at the generation's temperature too
    gen = RunningBatch(target, pool * 2, N_NEW, temperature=temperature, eos_id=eos, generator=g, max_draft=3)
    schedule = itertools.cycle([3, None, 1, 2, None, "sibling", None, 3, "sibling", "sibling", 2])
    checked = 0
    while gen.compact() > 0:
        k = next(schedule)
        if k is None:
            gen.plain_step()
            continue
        if k == "sibling":  # a model-free step: the learned drafter must catch up on its tokens later
            gen.speculative_step(SiblingDrafter(), 3)
            seen.pop()
            continue
        hidden, tokens, L = gen.hidden.clone(), gen.tokens.clone(), (gen.n_tokens - 1).tolist()
        gen.speculative_step(drafter, k)
        drafts, q = seen.pop()
        for b in range(len(L)):
            hs, xs = hidden[b, :L[b]], tokens[b, 1:L[b] + 1]
            for i in range(k):
                with torch.no_grad():
                    logits, h_pred = drafter(hs[None], xs[None])
                ref = torch.softmax(logits[0, -1].float() / temperature, dim=-1)
                assert (q[b, i] - ref).abs().max().item() < 1e-6, (b, i, L[b])
                hs = torch.cat([hs, h_pred[0, -1:]])
                xs = torch.cat([xs, drafts[b, i:i + 1]])
                checked += 1
    assert checked > 50


# ----------------------------------------------------------------------------- compaction


def test_compact_drops_finished_rows_keeps_original_order(greedy_setup):
    target, drafter, pool, free, eos = greedy_setup
    alone = [autoregressive_generate(target, [p], N_NEW, temperature=0, eos_id=eos)[0][0] for p in pool]
    for k in (0, 2):  # plain steps, then speculative steps
        gen = RunningBatch(target, pool, N_NEW, temperature=0, eos_id=eos, max_draft=k)
        sizes = []
        while True:
            n = gen.compact()
            sizes.append(n)
            running = [i for i, r in enumerate(gen.results) if r is None]
            assert n == gen.batch_size == len(running)
            assert sorted(gen.device_row_of_slot.tolist()) == running
            assert not bool(gen.done.any())
            assert gen.tokens.shape[0] == gen.hidden.shape[0] == gen.n_tokens.shape[0] == n
            assert gen.cache.batch_size == n
            assert torch.equal(gen.cache.lengths, gen.n_tokens - 1)
            if gen.draft_cache is not None:
                assert gen.draft_cache.batch_size == n
            if n == 0:
                break
            if k == 0:
                gen.plain_step()
            else:
                gen.speculative_step(drafter, k)
        assert sizes[-1] == 0
        assert any(0 < s < len(pool) for s in sizes), f"batch never shrank partially: {sizes}"
        assert gen.outputs() == alone  # each result in its prompt's slot
        for i, (ids, tokens, hidden, plen) in enumerate(gen.results):
            assert plen == len(pool[i])
            assert tokens.tolist() == pool[i] + ids


def test_compact_moves_marked_rows_to_results():
    target = tiny(V_G, seed=4).double()
    prompts = [[1, 2, 3], [4], [5, 6], [7, 8, 9, 10]]
    gen = RunningBatch(target, prompts, 5, temperature=0)
    before_tokens = gen.tokens.clone()
    before_k = gen.cache.k.clone()
    before_len = gen.cache.lengths.clone()
    gen.done = torch.tensor([True, False, True, False])
    assert gen.compact() == 2
    # row 1 stays in its slot and row 3 fills the hole left by row 0, so the cache copies one row
    assert gen.device_row_of_slot.tolist() == [3, 1]
    assert torch.equal(gen.tokens, before_tokens[[3, 1]])
    assert torch.equal(gen.cache.k, before_k[:, [3, 1]])
    assert torch.equal(gen.cache.lengths, before_len[[3, 1]])
    assert gen.results[1] is None and gen.results[3] is None
    for b in (0, 2):
        ids, tokens, hidden, plen = gen.results[b]
        assert plen == len(prompts[b])
        assert ids == [int(before_tokens[b, plen])]
        assert tokens.tolist() == prompts[b] + ids
        assert hidden.shape == (plen, target.config.n_embd)


# ----------------------------------------------------------------------------- recorded hidden states


def test_debug_checks_catch_a_broken_invariant(greedy_setup, monkeypatch):
    """instrument.BatchChecker (the observer under TLT_DEBUG=1): a whole run passes its
    checks, and each invariant that the steps rely on, broken by hand, is caught at the next check."""
    from model import KVCache
    target, drafter, pool, free, eos = greedy_setup
    checked = []
    checker = instrument.BatchChecker(then=lambda batch, step: checked.append(step))
    assert speculative_generate(target, drafter, pool, N_NEW, k=3, temperature=0, observer=checker)[0] == free
    assert len(checked) > 3  # no false alarm, at every step
    monkeypatch.setattr(instrument, "DEBUG", True)
    assert isinstance(instrument.liveness_observer(), instrument.BatchChecker)  # TLT_DEBUG=1 turns it on
    breaks = {"n_tokens - 1 positions": lambda g: setattr(g.cache, "lengths", g.cache.lengths + 1),
              "n_tokens_bound bounds": lambda g: setattr(g, "n_tokens_bound", g.n_tokens_bound - 1),
              "unread_states_bound bounds": lambda g: setattr(g, "unread_states_bound", 0),
              "host's rows": lambda g: g.row_of_slot.reverse(),
              "keys with its tokens": lambda g: monkeypatch.setattr(g.cache, "compact", lambda n, *_: KVCache.compact(g.cache, n))}
    for what, brake in breaks.items():
        gen, check = RunningBatch(target, pool, N_NEW, temperature=0, max_draft=3), instrument.BatchChecker()
        gen.compact()
        gen.speculative_step(drafter, 3)  # the drafter's cache exists
        gen.compact()
        gen.plain_step()  # a state the drafter has not read
        check(gen)
        gen.compact()
        brake(gen)
        with pytest.raises(AssertionError, match=what):
            if what == "keys with its tokens":
                gen.done = gen.cache.slots == 0  # a hole at slot 0, for the last row to fill
                gen.compact()
            check(gen)


@pytest.mark.parametrize("k", [0, 3])
@pytest.mark.parametrize("copies", [1, 3])
def test_recorded_hidden_states_match_a_full_forward(greedy_setup, k, copies):
    """The drafter buffer trusts results[b] = (ids, tokens, hidden, plen) with hidden[j] the target's
    state after reading tokens[j]; check it against one plain forward over the row. With copies > 1
    every prompt appears several times (a GRPO group): prefilled once, its cache shared by copy."""
    target, drafter, pool, free, eos = greedy_setup
    g = torch.Generator().manual_seed(5)
    prompts = [p for p in pool for _ in range(copies)]
    gen = RunningBatch(target, prompts, N_NEW, temperature=1.0, eos_id=eos, generator=g, max_draft=k)
    while gen.compact() > 0:
        gen.plain_step() if k == 0 else gen.speculative_step(drafter, k)
    for ids, tokens, hidden, plen in gen.results:
        assert hidden.shape[0] == tokens.shape[0] - 1
        with torch.no_grad():
            _, ref = target(tokens[None, :-1])
        assert (hidden - ref[0]).abs().max().item() < 1e-9
    if copies > 1:  # copies of a prompt sample their own responses
        assert len({tuple(gen.results[i][0]) for i in range(copies)}) > 1


# ----------------------------------------------------------------------------- verify, statistically

N_VERIFY = 40000
V_V = 5


def random_dists(g, shape, scale=1.5):
    return torch.softmax(torch.randn(shape, generator=g) * scale, dim=-1)


def make_pq(case, k, g, dtype=torch.float32):
    """Target and drafter distributions p (k+1, V), q (k, V); with dtype bfloat16 they are what
    `probs` makes of bf16 logits (the logits a bf16 forward gives), zeros kept."""
    p = random_dists(g, (k + 1, V_V))
    q = random_dists(g, (k, V_V))
    if case == "q_zero":  # the drafter never proposes tokens 0 and 1, the target likes them
        q[:, :2] = 0
        p[:, :2] += 0.3
    elif case == "p_zero":  # the target never emits token 4 (nor 3 at even positions)
        p[:, 4] = 0
        p[0::2, 3] = 0
        q[:, 3:] += 0.3
    p = p / p.sum(-1, keepdim=True)
    q = q / q.sum(-1, keepdim=True)
    if dtype != torch.float32:
        p, q = probs(p.log().to(dtype), 1.0), probs(q.log().to(dtype), 1.0)
    return p, q


def run_verify(p, q, N, g):
    """N independent verify calls on the same (p, q): draft from q, then verify."""
    k = q.shape[0]
    P = p[None].expand(N, -1, -1).contiguous()
    Q = q[None].expand(N, -1, -1).contiguous()
    drafts = torch.multinomial(Q.reshape(N * k, -1), 1, replacement=True, generator=g).view(N, k)
    n_acc, nxt = verify(drafts, Q, P, generator=g)
    return drafts, n_acc, nxt


def first_emitted(drafts, n_acc, nxt):
    return torch.where(n_acc >= 1, drafts[:, 0], nxt)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("case", ["random", "q_zero", "p_zero"])
def test_verify_first_token_is_distributed_as_target(case, k, dtype):
    g = torch.Generator().manual_seed(100 * k + len(case))
    p, q = make_pq(case, k, g, dtype)
    drafts, n_acc, nxt = run_verify(p, q, N_VERIFY, g)
    assert n_acc.shape == nxt.shape == (N_VERIFY,)
    assert int(n_acc.min()) >= 0 and int(n_acc.max()) <= k
    first = first_emitted(drafts, n_acc, nxt)
    emp = torch.bincount(first, minlength=V_V).double() / N_VERIFY
    # K = 5, N = 40000: tolerance 0.0224; false failure <= exp(-22.5) ~ 1.7e-10
    tol = tv_tolerance(V_V, N_VERIFY)
    assert tv(emp, p[0]) <= tol, (emp, p[0])
    # tokens the target gives zero mass never come out, at any position
    zero = p[0] == 0
    assert not bool(zero[first].any())
    # acceptance is exactly as efficient as rejection sampling allows: the drafts are independent
    # here (p does not depend on them), so P(n_acc >= i) = prod_{j < i} sum_x min(p_j, q_j).
    # Hoeffding with t = 0.02, N = 40000: false failure <= 2 exp(-32) ~ 2.5e-14 per rate.
    # (This rules out a "lossless" verify that always rejects and resamples from p.)
    alpha = torch.minimum(p[:k], q).sum(-1)
    for i in range(1, k + 1):
        expected = float(alpha[:i].prod())
        got = float((n_acc >= i).double().mean())
        assert abs(got - expected) <= 0.02, (i, got, expected)
    # every accepted draft has positive target probability
    accepted = torch.arange(k)[None] < n_acc[:, None]
    p_of_draft = p[:k].gather(-1, drafts.T).T  # (N, k)
    assert bool((p_of_draft[accepted] > 0).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [2, 3])
@pytest.mark.parametrize("case", ["random", "q_zero", "p_zero"])
def test_verify_first_two_tokens_jointly_distributed_as_target(case, k, dtype):
    """The first two emitted tokens have joint p_0 x p_1. A row that emits only one token this
    step (n_accepted = 0) gets its second token from the next verify step, which drafts from
    q_1.. and verifies against p_1.., exactly what speculative decoding would do next."""
    g = torch.Generator().manual_seed(7 + 10 * k + len(case))
    p, q = make_pq(case, k, g, dtype)
    assert tv(p[0], p[1]) > 0.1  # the two positions differ, so a swapped position would show
    drafts, n_acc, nxt = run_verify(p, q, N_VERIFY, g)
    first = first_emitted(drafts, n_acc, nxt)
    d2, n2, x2 = run_verify(p[1:], q[1:], N_VERIFY, g)
    second = torch.where(n_acc >= 2, drafts[:, 1], torch.where(n_acc == 1, nxt, first_emitted(d2, n2, x2)))
    emp = torch.bincount(first * V_V + second, minlength=V_V * V_V).double() / N_VERIFY
    exact = (p[0][:, None] * p[1][None, :]).reshape(-1)
    # K = 25, N = 40000: tolerance 0.05; false failure <= exp(-112.5)
    assert tv(emp, exact) <= tv_tolerance(V_V * V_V, N_VERIFY), (emp, exact)


def test_verify_identical_p_q_accepts_everything_and_disjoint_rejects_everything():
    g = torch.Generator().manual_seed(11)
    k, N = 3, 20000
    p = random_dists(g, (k + 1, V_V))
    drafts, n_acc, nxt = run_verify(p, p[:k].clone(), N, g)
    assert bool((n_acc == k).all())
    emp = torch.bincount(nxt, minlength=V_V).double() / N
    assert tv(emp, p[k]) <= tv_tolerance(V_V, N)  # the bonus token comes from p_k
    # disjoint supports: q only on {0, 1}, p only on {2, 3, 4}
    q = torch.zeros(k, V_V)
    q[:, :2] = 0.5
    p2 = torch.zeros(k + 1, V_V)
    p2[:, 2:] = random_dists(g, (k + 1, 3))
    drafts, n_acc, nxt = run_verify(p2, q, N, g)
    assert bool((n_acc == 0).all())
    emp = torch.bincount(nxt, minlength=V_V).double() / N
    assert tv(emp, p2[0]) <= tv_tolerance(V_V, N)


def test_verify_greedy_one_hot():
    """Greedy: accept iff the draft is the target's argmax; the next token is the target's argmax
    at the first mismatch (or at position k when every draft matched)."""
    g = torch.Generator().manual_seed(12)
    B, k, V = 3000, 4, 3
    p = probs(torch.randn(B, k + 1, V, generator=g), 0)
    q = probs(torch.randn(B, k, V, generator=g), 0)
    assert bool((p.sum(-1) == 1).all()) and bool((p.max(-1).values == 1).all())
    drafts = q.argmax(-1)
    n_acc, nxt = verify(drafts, q, p, generator=g)
    match = drafts == p[:, :k].argmax(-1)
    expected_n = match.long().cumprod(1).sum(1)
    assert torch.equal(n_acc, expected_n)
    assert torch.equal(nxt, p.argmax(-1).gather(1, expected_n[:, None])[:, 0])
    assert set(n_acc.tolist()) == set(range(k + 1))  # every outcome occurred: the check is not vacuous
    # no generator: same answer, greedy is deterministic
    n_acc2, nxt2 = verify(drafts, q, p)
    assert torch.equal(n_acc2, n_acc) and torch.equal(nxt2, nxt)


# ----------------------------------------------------------------------------- sequence-level lossless

V_S = 4
LEN_S = 3
PROMPT_S = [1]


@pytest.fixture(scope="module")
def sampling_setup():
    target = tiny(V_S, seed=21, std=0.25)  # larger weights make the target nearly deterministic
    drafter = randomize(Drafter(target), seed=22, std=1.0)
    return target, drafter


def exact_sequence_dist(target, temperature):
    """P(x_1 x_2 x_3 | prompt) for all V^3 sequences, by enumeration; index = base-V code."""
    seqs = torch.tensor(list(itertools.product(range(V_S), repeat=LEN_S)))  # (V^3, 3), code order
    idx = torch.cat([torch.tensor(PROMPT_S).expand(len(seqs), -1), seqs[:, :-1]], dim=1)
    with torch.no_grad():
        logits, _ = target(idx)
    logp = torch.log_softmax(logits.double()[:, len(PROMPT_S) - 1:] / temperature, dim=-1)
    return logp.gather(-1, seqs[..., None])[..., 0].sum(-1).exp()


def empirical(outputs):
    codes = torch.tensor([sum(t * V_S ** (LEN_S - 1 - i) for i, t in enumerate(o)) for o in outputs])
    assert all(len(o) == LEN_S for o in outputs)
    return torch.bincount(codes, minlength=V_S ** LEN_S).double() / len(outputs)


ROWS, CALLS = 8000, 4  # N = 32000 sequences per method


@pytest.mark.parametrize("method,k,temperature,sampler", [
    ("speculative", 2, 1.0, "rejection"),
    ("speculative", 1, 1.0, "rejection"),
    ("speculative", 3, 0.7, "rejection"),
    ("autoregressive", 0, 1.0, "rejection"),
    ("sibling", 2, 1.0, "rejection"),
    ("speculative", 2, 1.0, "gumbel"),
    ("speculative", 3, 0.7, "gumbel"),
    ("autoregressive", 0, 1.0, "gumbel"),
])
def test_sequence_distribution_is_the_targets(sampling_setup, method, k, temperature, sampler):
    target, drafter = sampling_setup
    exact = exact_sequence_dist(target, temperature)
    assert float(exact.sum()) == pytest.approx(1.0)
    assert float(exact.max()) < 0.5  # a spread-out target: the test has something to detect
    g = torch.Generator().manual_seed(1000 + k)
    outputs, hist = [], {}
    for _ in range(CALLS):
        if method != "autoregressive":  # one GRPO group of 8000 rows: each row drafts from its 15 nearest siblings
            stats = DecodeStats()
            out, _ = speculative_generate(target, every_drafter(drafter).get(method, drafter), [PROMPT_S] * ROWS, LEN_S,
                                          k=k, temperature=temperature, generator=g, sampler=sampler, observer=stats)
            for a, c in stats.settle().accept_hist.items():
                hist[a] = hist.get(a, 0) + c
        else:
            out, _ = autoregressive_generate(target, [PROMPT_S] * ROWS, LEN_S, temperature=temperature,
                                             generator=g, sampler=sampler)
        outputs += out
    N = len(outputs)
    if method != "autoregressive":
        assert len(hist) > 1, hist  # drafts were both accepted and rejected
    emp = empirical(outputs)
    # K = 64, N = 32000: tolerance 0.0894; false failure <= exp(-288)
    assert tv(emp, exact) <= tv_tolerance(V_S ** LEN_S, N), tv(emp, exact)
    # the per-position marginals are a sharper test of a bias at one position:
    # K = 4, N = 32000: tolerance 0.0224 each; false failure <= exp(-18) ~ 1.5e-8 each
    e3 = emp.view(V_S, V_S, V_S)
    x3 = exact.view(V_S, V_S, V_S)
    for dims in [(1, 2), (0, 2), (0, 1)]:
        assert tv(e3.sum(dims), x3.sum(dims)) <= tv_tolerance(V_S, N), dims
    # and the conditional of x_3 given the most likely (x_1, x_2), where SD's verify acts last
    a, b = divmod(int(x3.sum(2).argmax()), V_S)
    n_ab = int(round(float(e3[a, b].sum()) * N))
    assert n_ab > 3000
    assert tv(e3[a, b] / e3[a, b].sum(), x3[a, b] / x3[a, b].sum()) <= tv_tolerance(V_S, n_ab)


# ----------------------------------------------------------------------------- exact-token sampling ("gumbel")


def test_mix32_is_lowbias32():
    def lowbias32(x):
        x ^= x >> 16
        x = (x * 0x7FEB352D) & 0xFFFFFFFF
        x ^= x >> 15
        x = (x * 0x846CA68B) & 0xFFFFFFFF
        return x ^ (x >> 16)
    xs = [0, 1, 2, 0xFFFFFFFF, 0x80000000] + [random.Random(0).getrandbits(32) for _ in range(200)]
    assert _mix32_(torch.tensor(xs)).tolist() == [lowbias32(x) for x in xs]


def test_gumbel_noise_is_a_function_of_key_position_and_token():
    keys, pos = torch.tensor([3, 2 ** 40 + 3, 3]), torch.tensor([[5, 6], [5, 6], [6, 5]])
    g = noise_of(keys, pos, 7)
    assert g.shape == (3, 2, 7) and g.dtype == torch.float32 and bool(torch.isfinite(g).all())
    assert torch.equal(g[0, 1], g[2, 0]) and torch.equal(g[0, 0], g[2, 1])  # same (key, position): same noise
    assert not torch.equal(g[0], g[1])  # keys that differ only in their high 32 bits: other noise
    assert torch.equal(noise_of(keys[:1], pos[:1, 1:], 7)[0, 0], g[0, 1])  # batch layout does not matter
    assert len(set(g[:2].flatten().tolist())) == 28  # otherwise all distinct


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_gumbel_tokens_follow_softmax_at_temperature(temperature, dtype):
    """Tokens drawn as argmax(logits / T + g(key, t)) over N keys at one position, and over N
    positions of one key, follow softmax(logits / T). K = 5, N = 40000: TV tolerance 0.0224,
    false failure <= exp(-22.5) per check; pairs of adjacent positions of one key (K = 25, N = 20000,
    tolerance 0.0707, false failure <= exp(-112)) are independent. bf16 logits (a bf16 forward's)
    follow the softmax of their own values: the noise is added in float32."""
    g = torch.Generator().manual_seed(31)
    logits = (torch.randn(V_V, generator=g) * 1.5).to(dtype)
    exact = torch.softmax(logits.double() / temperature, -1)
    N = N_VERIFY
    by_key = gumbel_argmax(logits.expand(N, 1, V_V), temperature,
                           noise_of(torch.arange(N) * 7919 + 11, torch.full((N, 1), 42), V_V))[:, 0]
    by_pos = gumbel_argmax(logits.expand(1, N, V_V), temperature,
                           noise_of(torch.tensor([12345]), torch.arange(N)[None], V_V))[0]
    for tokens in (by_key, by_pos):
        assert tv(torch.bincount(tokens, minlength=V_V).double() / N, exact) <= tv_tolerance(V_V, N)
    pairs = by_pos.view(-1, 2)
    emp = torch.bincount(pairs[:, 0] * V_V + pairs[:, 1], minlength=V_V * V_V).double() / (N // 2)
    assert tv(emp, (exact[:, None] * exact[None, :]).reshape(-1)) <= tv_tolerance(V_V * V_V, N // 2)


def test_exponential_race_sample_is_exact_and_never_draws_zero_weight():
    g = torch.Generator().manual_seed(32)
    p = torch.tensor([0.5, 0.0, 0.2, 0.3, 0.0])
    draws = draw(p.expand(N_VERIFY, -1), generator=g)
    assert not bool(torch.isin(draws, torch.tensor([1, 4])).any())
    assert tv(torch.bincount(draws, minlength=5).double() / N_VERIFY, p) <= tv_tolerance(5, N_VERIFY)


def test_verify_gumbel_keeps_drafts_up_to_the_first_mismatch():
    draft = torch.tensor([[1, 2, 3], [1, 2, 3], [0, 2, 3], [1, 2, 3]])
    target = torch.tensor([[1, 2, 3, 4], [1, 5, 3, 4], [1, 2, 3, 4], [1, 2, 0, 4]])
    n_acc = verify_gumbel(draft, target)
    assert n_acc.tolist() == [3, 1, 0, 2]


def random_drafter(target, seed):
    torch.manual_seed(seed)
    return randomize(Drafter(target), seed, std=0.3).double()


@pytest.mark.parametrize("temperature", [1.0, 0.6])
@pytest.mark.parametrize("which", ["trained", "random"])
def test_gumbel_speculative_is_token_identical_to_plain(greedy_setup, which, temperature):
    """float64: the same keys give the same tokens with plain decoding and with speculation at
    every k in 1..8, for ragged prompts in a batch that shrinks (<|eos|> and the length limit),
    with the rows in another order, and with the rows split over two calls (two ranks)."""
    target, trained, pool, _, eos = greedy_setup
    drafter = trained if which == "trained" else random_drafter(target, 5)
    prompts = pool * 2
    keys = [10 ** 12 + 37 * i for i in range(len(prompts))]
    how = dict(temperature=temperature, eos_id=eos, sampler="gumbel")
    plain, _ = autoregressive_generate(target, prompts, N_NEW, keys=keys, **how)
    assert len({tuple(o) for o in plain}) == len(plain)  # sampled: every row its own response
    assert any(o[-1] == eos for o in plain) and any(len(o) == N_NEW for o in plain)  # the batch shrinks
    rejected = 0
    for k in range(1, 9):
        st = DecodeStats()
        out, _ = speculative_generate(target, drafter, prompts, N_NEW, k=k, keys=keys, observer=st, **how)
        assert out == plain, k
        rejected += sum(c for a, c in st.settle().accept_hist.items() if a < k)
    assert rejected > 0  # some drafts were rejected: the check is not vacuous
    order = list(reversed(range(len(prompts))))
    out, _ = speculative_generate(target, drafter, [prompts[i] for i in order], N_NEW, k=3,
                                  keys=[keys[i] for i in order], **how)
    assert out == [plain[i] for i in order]
    half = len(prompts) // 2
    first, _ = speculative_generate(target, drafter, prompts[:half], N_NEW, k=4, keys=keys[:half], **how)
    second, _ = autoregressive_generate(target, prompts[half:], N_NEW, keys=keys[half:], **how)
    assert first + second == plain


def test_gumbel_choice_in_row_passes_equals_one_argmax_and_ignores_the_logits_dtype():
    """gumbel_choose makes the noise of a bounded number of rows per pass (bounded memory) and picks
    the same tokens as one argmax over the whole noise, made there or given; bfloat16 logits give
    the tokens of the same logits in float32 (the noise is added in float32, never coarsened to bf16)."""
    g = torch.Generator().manual_seed(0)
    B, T, V = 6, 3, 50
    logits = torch.randn(B, T, V, generator=g) * 2
    keys, pos = torch.arange(B) * 31 + 5, torch.arange(T).expand(B, T) + 7
    seeds = gumbel_seeds(keys, pos)
    whole = gumbel_argmax(logits, 1.0, gumbel_noise(seeds, V))
    assert len(set(whole.flatten().tolist())) > 5  # varied tokens: a row given another's noise would show
    for max_elements in (7, 50, 120, 350, 900, None):  # 1, 1, 2, 7 and 18 rows per pass, then the default
        assert torch.equal(gumbel_choose(logits, 1.0, seeds, max_elements=max_elements), whole)
    assert torch.equal(gumbel_choose(logits, 1.0, seeds, noise=gumbel_noise(seeds, V)), whole)
    low = logits.bfloat16()
    exact = gumbel_argmax(low.float(), 0.7, gumbel_noise(seeds, V))
    assert torch.equal(gumbel_choose(low, 0.7, seeds, max_elements=100), exact)
    assert torch.equal(gumbel_choose(low, 0.7, seeds, noise=gumbel_noise(seeds, V)), exact)


def test_a_gumbel_step_runs_the_same_ops_at_any_vocabulary_size():
    """A plain step, a speculative step and a choice made apart run the same aten ops (bench.count_ops:
    about the kernels a GPU launches) at a vocabulary of 1000 and of 40000: the noise is made over
    the whole vocabulary at once, never in a loop over vocabulary chunks, and a speculative step
    makes it once for its drafts and its verify pass at both sizes."""
    from harness.bench import count_ops
    counts = {}
    for V in (1000, 40000):
        target = tiny(V, seed=0)
        drafter = random_drafter(target, 1).float()
        batch = RunningBatch(target, [[1, 2, 3], [4, 5]], 20, max_draft=3, sampler="gumbel", keys=[7, 8])
        batch.compact()
        logits = torch.randn(2, 4, V)
        seeds = gumbel_seeds(torch.tensor([7, 8]), torch.arange(4).expand(2, 4))
        counts[V] = [count_ops(batch.plain_step), count_ops(lambda: batch.speculative_step(drafter, 3)),
                     count_ops(lambda: batch.speculative_step(drafter, 3)), count_ops(lambda: gumbel_choose(logits, 0.8, seeds))]
    assert counts[1000] == counts[40000]
    assert counts[1000][3] < 30  # the choice alone: one pass of about 20 ops


def every_drafter(learned):
    """Each kind of drafter the speculative step takes, by its --drafter name."""
    from harness.model_free import NgramDrafter, SiblingDrafter, SiblingOrLearned
    return {"learned": learned, "ngram": NgramDrafter(n=1), "sibling": SiblingDrafter(max_match=4),
            "sibling+learned": SiblingOrLearned(learned, max_match=4)}


def test_rows_whose_old_32_bit_streams_were_a_shift_apart_get_unrelated_noise():
    """The old design gave a row a 32-bit stream s = mix(mix(key_hi) ^ key_lo) and position t the
    seed mix(s + t * 0x9E3779B9): two keys whose streams differ by m * 0x9E3779B9 shared all their
    noise m positions apart. Build such a pair (key_hi = 0, so s = mix(key_lo); the second key's low
    half by inverting the mixer) and check that the 64-bit seeds now share nothing at any shift."""
    G, M = 0x9E3779B9, 0xFFFFFFFF

    def mix(x):  # lowbias32
        x ^= x >> 16
        x = (x * 0x7FEB352D) & M
        x ^= x >> 15
        x = (x * 0x846CA68B) & M
        return x ^ (x >> 16)

    def unmix(x):  # its inverse (Wellons' hash-prospector)
        x ^= x >> 16
        x = (x * 0x43021123) & M
        x ^= (x >> 15) ^ (x >> 30)
        x = (x * 0x1D69E2A5) & M
        return x ^ (x >> 16)

    key1, m, N = 12345, 5, 40
    s2 = (mix(key1) + m * G) & M
    key2 = unmix(s2)
    assert mix(key2) == s2  # the construction holds: the old streams are m steps apart
    old_seed = lambda key, t: mix((mix(key) + t * G) & M)  # noqa: E731
    assert all(old_seed(key2, t) == old_seed(key1, t + m) for t in range(N))  # the old noise, shared
    pos = torch.arange(N)[None].expand(2, N)
    seeds = gumbel_seeds(torch.tensor([key1, key2]), pos)
    for shift in range(-N + 1, N):  # no position of one row has a seed of the other, at any shift
        a, b = seeds[0, max(shift, 0):N + min(shift, 0)], seeds[1, max(-shift, 0):N - max(shift, 0)]
        assert not bool((a == b).any()), shift
    noise = gumbel_noise(seeds, 16)  # (2, N, 16)
    assert not torch.equal(noise[0, m:], noise[1, :-m])


@pytest.mark.parametrize("sampler,temperature", [("gumbel", 1.0), ("rejection", 0.7), ("gumbel", 0.0), ("rejection", 0.0)])
def test_steps_read_nothing_from_the_device(greedy_setup, sampler, temperature, monkeypatch):
    """Plain and speculative steps (every drafter, the learned drafter's first catch-up included)
    size everything from the host's bounds: no read, no copy from the host. compact() reads the
    device once (which rows finished) and copies nothing, also when rows finish and live rows move
    into their slots (its index tensors are made on the device). instrument.HostTraffic says what counts."""
    target, drafter, pool, _, eos = greedy_setup
    gen = RunningBatch(target, pool * 2, N_NEW, temperature=temperature, eos_id=eos, sampler=sampler, max_draft=4,
                       generator=torch.Generator().manual_seed(3), keys=list(range(2 * len(pool))))
    drafters = every_drafter(drafter)
    drafters["sibling"].groups(gen)  # their texts are made once per batch, from host lists, as the
    drafters["sibling+learned"].siblings.groups(gen)  # batch's own tensors are: before its steps
    schedule = itertools.cycle([None, ("learned", 4), None, ("learned", 2), ("ngram", 3), ("learned", 3), ("sibling", 2),
                                ("learned", 1), ("sibling+learned", 3)])
    counter, sizes, moved = HostTraffic(), [], False
    with counter:  # segments: compact, step, compact, step, ..., the last compact
        while gen.compact() > 0:
            sizes.append(gen.batch_size)
            moved |= gen.row_of_slot != sorted(gen.row_of_slot)  # a row past the new end filled a hole
            counter.mark()
            step = next(schedule)
            if step is None:
                gen.plain_step()
            else:
                gen.speculative_step(drafters[step[0]], step[1])
            counter.mark()
    reads, copies = counter.counts("read"), counter.counts("copy")
    assert reads[0::2] == [1] * (len(sizes) + 1), counter.segments  # every compact: one read
    assert reads[1::2] == [0] * len(sizes), counter.segments  # every step: none
    assert copies == [0] * len(reads), counter.segments
    assert len(sizes) >= 9 and any(0 < b < a for a, b in zip(sizes, sizes[1:])) and moved  # rows left mid-run
    assert all(r is not None for r in gen.results)
    cache = target.new_cache(2, 16)  # the counter works: a forward given no window reads the lengths,
    with HostTraffic() as counter:  # a list index is a copy
        target(torch.zeros(2, 3, dtype=torch.long), cache)
        cache.lengths[[0, 1]]
    assert counter.segments == [[("read", "_local_scalar_dense"), ("copy", "lift_fresh")]]


def test_generate_functions_call_the_observer_every_decoding_step(greedy_setup):
    """The observer (liveness.beat in evaluation) is called after the prefill and after every
    decoding step, not once per call: a call longer than the liveness timeout must not look like a
    silent rank."""
    target, drafter, pool, _, eos = greedy_setup
    for generate in (lambda **kw: autoregressive_generate(target, pool[:3], N_NEW, temperature=0, eos_id=eos, **kw),
                     lambda **kw: speculative_generate(target, drafter, pool[:3], N_NEW, k=2, temperature=0, eos_id=eos, **kw)):
        calls, stats = [], DecodeStats()
        out, _ = generate(observer=lambda batch, step: calls.append(step) or stats(batch, step))
        assert calls[0] is None and len(calls) == stats.steps + 1 > 2
        assert generate()[0] == out  # and it changes nothing


def test_verify_with_no_drafts_emits_the_targets_token():
    """k = 0 drafts: nothing to accept, and the token emitted is the target's own (a draw from
    p[:, 0]); both rules. One-hot p makes the draw certain."""
    B, V = 5, 9
    want = torch.tensor([3, 0, 8, 3, 1])
    p = torch.zeros(B, 1, V).scatter_(-1, want[:, None, None], 1.0)
    n_acc, nxt = verify(torch.zeros(B, 0, dtype=torch.long), torch.zeros(B, 0, V), p, torch.Generator().manual_seed(0))
    assert n_acc.tolist() == [0] * B and torch.equal(nxt, want)
    assert verify_gumbel(torch.zeros(B, 0, dtype=torch.long), want[:, None]).tolist() == [0] * B
