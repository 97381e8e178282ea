"""Tests for speculative.py's running batch: greedy and exact-token losslessness, the decoding stats,
compaction, the recorded hidden states, and the ops a gumbel step runs. The verify rules and the
samplers themselves are tested in tests/test_verify.py.

Greedy tests run in float64, so a token-level disagreement between speculative and plain decoding is
a real bug (a near-tie flipped by rounding is astronomically unlikely there). The target's weights
are re-drawn with a large std so that greedy outputs are not one repeated token, and the drafter is
briefly trained on the target's rollouts so that verify steps both accept and reject drafts
(checked through the accept histogram).
"""
import itertools
import types

import pytest
import torch

from torch.utils._python_dispatch import TorchDispatchMode

from drafter import Drafter
from conftest import N_NEW, V_G, every_drafter, randomize, tiny
from harness.instrument import DecodeStats
from speculative import DecodeStep, GumbelSampler, RunningBatch, autoregressive_generate, speculative_generate

pytestmark = pytest.mark.usefixtures("one_thread")


def truncate_at(o, eos):
    return o[:o.index(eos) + 1] if eos in o else o


def random_drafter(target, seed):
    torch.manual_seed(seed)
    return randomize(Drafter(target), seed, std=0.3).double()


# ----------------------------------------------------------------------------- greedy lossless + stats


@pytest.mark.parametrize("B", [1, 3, 8])
@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_greedy_speculative_equals_autoregressive(greedy_setup, B, k):
    target, drafter, pool, free, eos = greedy_setup
    prompts = pool[:B]
    ar, ar_core = autoregressive_generate(target, prompts, N_NEW, temperature=0, eos_id=eos,
                                          observer=(ar_stats := DecodeStats()))
    ar_stats.settle()
    # the reference itself: greedy with eos is greedy without eos cut after the first eos
    assert ar == [truncate_at(o, eos) for o in free[:B]]
    assert any(o[-1] == eos and len(o) < N_NEW for o in ar), "eos never stops a row early"
    if B > 1:
        assert any(len(o) == N_NEW and eos not in o for o in ar), "no row runs to max_new_tokens"

    sd, core = speculative_generate(target, drafter, prompts, N_NEW, k=k, temperature=0, eos_id=eos,
                                    observer=(stats := DecodeStats()))
    assert sd == ar
    stats.settle()
    assert core["accept_len"] == pytest.approx(stats.accept_len)  # counted by the core, and outside

    # stats: accept_len is tokens emitted per (row, verify step); the first token of every row
    # comes from the prefill, every other one from a verify step
    assert stats.sd_row_steps > 0
    assert stats.accept_len == pytest.approx(stats.sd_tokens / stats.sd_row_steps)
    assert 1.0 <= stats.accept_len <= k + 1
    assert stats.sd_tokens == stats.tokens == sum(len(o) for o in sd) - B
    hist = stats.accept_hist
    assert set(hist) <= set(range(k + 1)), hist
    assert sum(hist.values()) == stats.sd_row_steps
    assert stats.sd_tokens <= sum((a + 1) * c for a, c in hist.items())  # truncation only removes
    if B > 1:
        assert len(hist) > 1, f"drafts were all accepted or all rejected: {hist}"
    # by position: every row-step decides its first draft; each kept token past it is an accepted draft
    # or the one target token of a step whose drafts were all decided
    drafted, accepted = stats.drafted_at, stats.accepted_at
    assert len(drafted) == k and drafted[0] == stats.sd_row_steps
    assert all(a <= d for a, d in zip(accepted, drafted)) and all(b <= a for a, b in zip(accepted, drafted[1:]))
    assert stats.sd_tokens - stats.sd_row_steps <= sum(accepted) <= stats.sd_tokens
    # plain decoding: one token per row per step, no SD stats
    assert ar_stats.tokens == sum(len(o) for o in ar) - B
    assert ar_stats.accept_len is None and ar_core["accept_len"] is None


def test_acceptance_by_position_counts_decided_drafts_only():
    """DecodeStats by draft position on a hand-made step (k = 4): a draft is decided when every earlier
    one of its row's step was accepted and the row had not ended (<|eos|> or its limit) on one."""
    st = DecodeStats()
    n_acc = torch.tensor([3, 0, 2, 4, 3])
    n_emitted = torch.tensor([4, 1, 2, 5, 1])  # rows 2 and 4 end on their 2nd and 1st accepted draft
    st(None, DecodeStep(5, 4, n_emitted, n_acc))
    st.settle()  # the counts are read from the device at once
    assert st.drafted_at == [5, 3, 2, 2] and st.accepted_at == [4, 3, 2, 1]
    assert [a / d for a, d in zip(st.accepted_at, st.drafted_at)] == [0.8, 1.0, 1.0, 0.5]
    st(None, DecodeStep(1, 6, torch.tensor([1]), torch.tensor([0])))  # a longer k grows the lists
    assert st.settle().drafted_at == [6, 3, 2, 2, 0, 0] and st.accepted_at[4:] == [0, 0]


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
    assert [r.response for r in gen.results] == ar


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


def test_compact_drops_finished_rows_and_keeps_each_rows_own_tokens(greedy_setup):
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
            assert sorted(gen.ids) == running  # every running row once
            for b, i in enumerate(gen.ids):  # each with its own prompt
                assert gen.tokens[b, :len(pool[i])].tolist() == pool[i]
            assert not bool(gen.done.any())
            assert gen.tokens.shape[0] == gen.hidden.shape[0] == gen.n_tokens.shape[0] == n
            assert gen.cache.lengths.shape[0] == gen.cache.kv.shape[2] == n
            assert torch.equal(gen.cache.lengths, gen.n_tokens - 1)
            if gen.draft_cache is not None:
                assert gen.draft_cache.lengths.shape[0] == gen.draft_cache.kv.shape[2] == n
            if n == 0:
                break
            if k == 0:
                gen.plain_step()
            else:
                gen.speculative_step(drafter, k)
        assert sizes[-1] == 0
        assert any(0 < s < len(pool) for s in sizes), f"batch never shrank partially: {sizes}"
        assert [r.response for r in gen.results] == alone  # each result in its prompt's place
        for i, (ids, tokens, hidden, plen) in enumerate(gen.results):
            assert plen == len(pool[i])
            assert tokens.tolist() == pool[i] + ids


def test_compact_moves_marked_rows_to_results():
    target = tiny(V_G, seed=4).double()
    prompts = [[1, 2, 3], [4], [5, 6], [7, 8, 9, 10]]
    gen = RunningBatch(target, prompts, 5, temperature=0)
    before_tokens = gen.tokens.clone()
    before_kv = gen.cache.kv.clone()
    before_len = gen.cache.lengths.clone()
    storage = gen.cache.kv.data_ptr()
    gen.done = torch.tensor([True, False, True, False])
    assert gen.compact() == 2
    # rows 1 and 3 stay, each with its own tokens and cache entries: row 1 in its place, row 3
    # moved into the place row 0 left, in the cache's own storage
    assert gen.ids == [3, 1]
    assert torch.equal(gen.tokens, before_tokens[[3, 1]])
    assert torch.equal(gen.cache.kv, before_kv[:, :, [3, 1]])
    assert torch.equal(gen.cache.lengths, before_len[[3, 1]])
    assert gen.cache.kv.data_ptr() == storage
    assert gen.results[1] is None and gen.results[3] is None
    for b in (0, 2):
        ids, tokens, hidden, plen = gen.results[b]
        assert plen == len(prompts[b])
        assert ids == [int(before_tokens[b, plen])]
        assert tokens.tolist() == prompts[b] + ids
        assert hidden.shape == (plen, target.config.n_embd)


# ----------------------------------------------------------------------------- recorded hidden states


@pytest.mark.parametrize("k", [0, 3])
@pytest.mark.parametrize("copies", [1, 3])
def test_recorded_hidden_states_match_a_full_forward(greedy_setup, k, copies):
    """The drafter buffer trusts results[b] = (ids, tokens, hidden, plen) with hidden[j] the target's
    state after reading tokens[j]; check it against one plain forward over the row. With copies > 1
    every prompt appears several times (a GRPO group)."""
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


# ----------------------------------------------------------------------------- exact-token sampling ("gumbel")


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


class OpCounter(TorchDispatchMode):
    """The aten ops run while active, views and allocations left out: about the kernels a GPU
    would launch, counted on any device."""
    n = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += not (func.is_view or func.overloadpacket.__name__.startswith("empty"))
        return func(*args, **(kwargs or {}))


def count_ops(fn):
    with OpCounter() as counter:
        fn()
    return counter.n


def test_a_gumbel_step_runs_the_same_ops_at_any_vocabulary_size():
    """A plain step, a speculative step and a choice made apart run the same aten ops (count_ops)
    at a vocabulary of 1000 and of 40000: the noise is made over the whole vocabulary at once,
    never in a loop over vocabulary chunks."""
    counts = {}
    for V in (1000, 40000):
        target = tiny(V, seed=0)
        drafter = random_drafter(target, 1).float()
        batch = RunningBatch(target, [[1, 2, 3], [4, 5]], 20, max_draft=3, sampler="gumbel", keys=[7, 8])
        batch.compact()
        logits = torch.randn(2, 4, V)
        sampler, positions = GumbelSampler(0.8, torch.tensor([7, 8]), V, 4), torch.arange(4).expand(2, 4)
        counts[V] = [count_ops(batch.plain_step), count_ops(lambda: batch.speculative_step(drafter, 3)),
                     count_ops(lambda: batch.speculative_step(drafter, 3)),
                     count_ops(lambda: sampler.choose(logits, sampler.noise(positions)))]
    assert counts[1000] == counts[40000]


@pytest.mark.parametrize("sampler,temperature", [("gumbel", 1.0), ("gumbel", 0.0), ("rejection", 0.0)])
def test_every_drafter_taking_turns_on_one_batch_is_lossless(greedy_setup, sampler, temperature):
    """Plain steps and speculative steps of every drafter (the learned drafter's first catch-up
    included) take turns on one batch whose rows leave mid-run: the tokens are plain decoding's."""
    target, drafter, pool, _, eos = greedy_setup
    how = dict(temperature=temperature, eos_id=eos, sampler=sampler, keys=list(range(2 * len(pool))))
    plain, _ = autoregressive_generate(target, pool * 2, N_NEW, **how)
    gen = RunningBatch(target, pool * 2, N_NEW, max_draft=4, **how)
    drafters = every_drafter(drafter)
    schedule = itertools.cycle([None, ("learned", 4), None, ("learned", 2), ("ngram", 3), ("learned", 3), ("sibling", 2),
                                ("learned", 1), ("sibling", 3)])
    sizes = []
    while gen.compact() > 0:
        sizes.append(gen.batch_size)
        step = next(schedule)
        if step is None:
            gen.plain_step()
        else:
            gen.speculative_step(drafters[step[0]], step[1])
    assert len(sizes) >= 9 and any(0 < b < a for a, b in zip(sizes, sizes[1:]))  # rows left mid-run
    assert [r.response for r in gen.results] == plain


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
