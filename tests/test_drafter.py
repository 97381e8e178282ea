"""Tests for drafter.py: what the drafter owns, EAGLE pairing, isolation of padded rows, its own
KV cache, the buffer, and that training does something (and only to the drafter).

Exactness checks run in float64 with a 1e-10 tolerance: a real mistake (a wrong position, a key
read across rows or from padding, a stale cache entry) moves outputs by orders of magnitude more.
Models are tiny and their weights re-drawn at a large scale so that attention is far from uniform
(at init scale some mistakes would barely move the output).
"""
import random

import pytest
import torch
import torch.nn.functional as F

from drafter import (Drafter, DrafterBuffer, acceptance, chain_loss_masks, chained_states, drafter_loss, make_optimizer,
                     pair_batch, train_step)
from conftest import decode_plainly, randomize, tiny
from harness.instrument import checksum
from speculative import FinishedRow as Sample
from speculative import RunningBatch, speculative_generate

V, C = 16, 16
TOL = 1e-10
pytestmark = pytest.mark.usefixtures("one_thread")


def make_drafter(target, seed):
    torch.manual_seed(seed)
    return Drafter(target)


def float64_pair(seed, std=0.5):
    """A target and a drafter far from their init (weights drawn at `std`), in float64."""
    target = tiny(V, seed, std).double()  # n_embd 16 = C
    return target, randomize(make_drafter(target, seed + 1), seed + 2, std).double()


def rollout_buffer(target, seed, n_prompts=32, max_new=30, step=0, buf=None):
    """Sampled rollouts of the target, recorded by speculative.RunningBatch, into a DrafterBuffer."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, V, (int(n),), generator=g).tolist()
               for n in torch.randint(1, 8, (n_prompts,), generator=g)]
    rows = decode_plainly(RunningBatch(target, prompts, max_new, temperature=1.0, generator=g))
    buf = DrafterBuffer(keep_steps=2) if buf is None else buf
    for _, tokens, hidden, plen in rows:
        buf.add(step, tokens, hidden, plen)
    return buf, prompts


@pytest.fixture(scope="module")
def target():
    return tiny(V, seed=1)


@pytest.fixture(scope="module")
def buffers(target):
    train_buf, _ = rollout_buffer(target, seed=10)
    held_out, prompts = rollout_buffer(target, seed=11, n_prompts=16)
    return train_buf, held_out, prompts


def snapshot(module):
    return {n: p.detach().clone() for n, p in module.named_parameters()}


# ----------------------------------------------------------------------------- ownership


def test_state_dict_and_parameters_exclude_the_target(target):
    drafter = make_drafter(target, seed=0)
    keys = list(drafter.state_dict())
    assert keys, "the drafter has no weights of its own"
    assert any(k.startswith("in_proj") for k in keys)
    assert not [k for k in keys if "wte" in k or "lm_head" in k or "target" in k], keys
    mine = {id(p) for p in drafter.parameters()}
    theirs = {id(p) for p in target.parameters()}
    assert mine and not (mine & theirs)
    assert not any("wte" in n or "lm_head" in n for n, _ in drafter.named_parameters())
    # one layer, not the target's depth
    assert len(drafter.stack.blocks) == 1 < target.config.n_layer


def test_drafter_reads_the_targets_embedding_and_head_live():
    """Shared, not copied: the logits are the target's LM head applied to the drafter's hidden
    state, and an update of the target's embedding is seen by the drafter at once."""
    tgt = tiny(V, seed=3).double()
    drafter = make_drafter(tgt, seed=4).double()
    g = torch.Generator().manual_seed(5)
    h = torch.randn(2, 6, C, generator=g, dtype=torch.float64)
    x = torch.randint(0, V, (2, 6), generator=g)
    with torch.no_grad():
        logits, h_pred = drafter(h, x)
        assert (logits - F.linear(h_pred, tgt.lm_head.weight)).abs().max().item() < TOL
        tgt.wte.weight.mul_(1.5)
        logits2, h_pred2 = drafter(h, x)
    assert (h_pred2 - h_pred).abs().max().item() > 1e-3  # the token embedding feeds the fuse layer
    assert (logits2 - F.linear(h_pred2, tgt.lm_head.weight)).abs().max().item() < TOL


def test_training_changes_the_drafter_and_never_the_target(target, buffers):
    train_buf, _, _ = buffers
    drafter = make_drafter(target, seed=0)
    before_t, before_d = snapshot(target), snapshot(drafter)
    opt = make_optimizer(drafter)
    rng = random.Random(0)
    for _ in range(3):
        loss, applied = train_step(drafter, opt, train_buf.sample(8, rng))
        assert applied and isinstance(loss, float) and loss == loss and loss > 0
    for n, p in target.named_parameters():
        assert torch.equal(p, before_t[n]), f"target parameter {n} changed"
        assert p.grad is None, f"target parameter {n} received a gradient"
    unchanged = [n for n, p in drafter.named_parameters() if torch.equal(p, before_d[n])]
    assert not unchanged, f"drafter parameters not trained: {unchanged}"
    assert set(drafter.state_dict()) == set(before_d)  # every saved tensor is a trained parameter


# ----------------------------------------------------------------------------- EAGLE pairing


def test_buffer_sample_pairs_eagle_way():
    """Pair t is (h_t, x_{t+1}) -> h_{t+1}; the loss counts pairs from prompt_len - 1 (the first
    pair whose prediction, x_{t+2}, is a drafted response token) to the last pair that has a
    target state; padding never counts."""
    C4 = 4
    seqs = {}  # id -> (tokens, hidden, plen)
    for sid, (n_tokens, plen) in enumerate([(7, 3), (11, 1), (9, 5)]):
        tokens = torch.arange(n_tokens) + 20 * sid
        j = torch.arange(n_tokens - 1, dtype=torch.float32)[:, None]
        hidden = 100.0 * sid + j + 0.01 * torch.arange(C4)  # row j identifies (sequence, position)
        seqs[sid] = (tokens, hidden, plen)
    buf = DrafterBuffer(keep_steps=2)
    for sid, (tokens, hidden, plen) in seqs.items():
        buf.add(0, tokens, hidden, plen)
    T_max = max(h.shape[0] for _, h, _ in seqs.values()) - 1
    seen = set()
    for batch_size, seed in [(24, 0), (2, 1), (2, 2), (2, 3), (2, 4), (1, 5), (1, 6), (1, 7), (1, 8)]:
        h_in, x_next, h_tgt, mask = buf.sample(batch_size, random.Random(seed))
        B, T = mask.shape  # a sampler may return fewer rows than asked (e.g. no repeats)
        assert 1 <= B <= batch_size and T <= T_max
        assert h_in.shape == h_tgt.shape == (B, T, C4)
        assert x_next.shape == (B, T) and mask.dtype == torch.bool
        for b in range(B):
            sid = int(h_in[b, 0, 0].item() // 100)
            seen.add(sid)
            tokens, hidden, plen = seqs[sid]
            n = hidden.shape[0] - 1  # pairs with a target
            assert T >= n
            assert torch.equal(h_in[b, :n], hidden[:n])  # h_in[t] = hidden[t]
            assert torch.equal(x_next[b, :n], tokens[1:n + 1])  # x_next[t] = tokens[t+1]
            assert torch.equal(h_tgt[b, :n], hidden[1:n + 1])  # h_tgt[t] = hidden[t+1]
            expected = torch.zeros(T, dtype=torch.bool)
            expected[max(plen - 1, 0):n] = True
            assert torch.equal(mask[b], expected), (sid, mask[b], expected)
            assert not bool(mask[b, n:].any())  # padding
        if batch_size >= len(seqs):
            assert B > 1 and len({int(v) for v in mask.sum(1)}) > 1  # a padded batch was checked
    assert seen == set(seqs), "sampling never picked some sequences"


def test_buffer_sample_draws_every_sequence_equally_often():
    """A batch is a uniform sample without replacement: each of 20 sequences, short or long, old or
    new, is in a batch of 8 with p = 8 / 20. 5,000 draws: a count's binomial SD is 34.6, and 5 SD
    (175) fails a correct sampler with odds below 1e-6 per sequence."""
    buf = DrafterBuffer()
    for n in range(20):  # sequence n holds n + 3 tokens, each of them n
        buf.add(0, torch.full((n + 3,), n, dtype=torch.long), torch.zeros(n + 2, 4), prompt_len=1)
    rng, counts, draws = random.Random(0), [0] * 20, 5_000
    for _ in range(draws):
        ids = buf.sample(8, rng)[1][:, 0].tolist()
        assert len(set(ids)) == len(ids) == 8  # without replacement
        for n in ids:
            counts[n] += 1
    expected = draws * 8 / 20
    assert all(abs(c - expected) < 175 for c in counts), (expected, counts)


def test_buffer_sample_with_a_token_budget_never_exceeds_it_and_crops_long_sequences():
    """max_tokens bounds a batch's padded positions (its rows times its longest sequence: what an
    idle step costs), sequences longer than the budget included. Such a sequence is cut to a random
    window of max_tokens tokens, its tokens, hidden states and loss mask still aligned (the mask on
    its response positions only), and sequences are dropped until the rest fit."""
    M, seqs = 64, {}
    buf = DrafterBuffer()
    lengths = [3 + i % 10 for i in range(18)] + [80, 100]  # the last two are longer than the budget
    for i, n in enumerate(lengths):
        j = torch.arange(n)
        plen = 1 + i % 7
        # token j of sequence i is 1000 i + j, and so is the state after reading it
        buf.add(0, 1000 * i + j, (1000.0 * i + j[:-1, None]).expand(n - 1, 4).clone(), prompt_len=plen)
        seqs[i] = (n, plen)
    rng, seen, starts, packed = random.Random(0), set(), set(), False
    for _ in range(300):
        h_in, x_next, h_tgt, mask = buf.sample(8, rng, max_tokens=M)
        B, T = mask.shape
        assert B * (T + 2) <= M  # B rows of at most T + 2 tokens
        packed |= B > 1
        for b in range(B):
            i, first = divmod(int(h_in[b, 0, 0]), 1000)  # the sequence, and where its window starts
            n, plen = seqs[i]
            pairs = min(n, M) - 2  # a window of min(n, M) tokens
            assert first + min(n, M) <= n and (first == 0 or n > M)  # only a long sequence is cut
            at = 1000 * i + first + torch.arange(pairs)  # pair t: (h_j, x_{j+1}) -> h_{j+1}, j = first + t
            assert torch.equal(h_in[b, :pairs, 0], at.float())
            assert torch.equal(x_next[b, :pairs], at + 1) and torch.equal(h_tgt[b, :pairs, 0], at.float() + 1)
            t = torch.arange(T)
            assert torch.equal(mask[b], (first + t >= plen - 1) & (t < pairs)), (i, first, mask[b])
            seen.add(i)
            if n > M:
                starts.add((i, first))
    assert seen == set(range(20)) and packed
    assert len({first for i, first in starts if i == 19}) > 5  # the window's start is random
    h_in, _, _, mask = buf.sample(8, random.Random(1), max_tokens=5)  # every sequence at least 3 tokens
    assert mask.shape[0] == 1 and mask.shape[1] + 2 <= 5  # one row, cut to 5 tokens at most


# ----------------------------------------------------------------------------- isolation of rows


def test_no_attention_across_rows_or_into_padding():
    tgt, drafter = float64_pair(6, std=1.0)
    g = torch.Generator().manual_seed(9)
    lens = [5, 9]
    T = max(lens)
    h = torch.randn(2, T, C, generator=g, dtype=torch.float64)
    x = torch.randint(0, V, (2, T), generator=g)
    with torch.no_grad():
        logits, h_pred = drafter(h, x)
        alone0 = drafter(h[:1, :lens[0]], x[:1, :lens[0]])
        alone1 = drafter(h[1:], x[1:])
        # other row's content and this row's padding replaced by something else entirely
        h2, x2 = h.clone(), x.clone()
        h2[1] = 5 * torch.randn(T, C, generator=g, dtype=torch.float64)
        x2[1] = torch.randint(0, V, (T,), generator=g)
        h2[0, lens[0]:] = 5 * torch.randn(T - lens[0], C, generator=g, dtype=torch.float64)
        x2[0, lens[0]:] = (x[0, lens[0]:] + 1) % V
        logits2, h_pred2 = drafter(h2, x2)
    n0 = lens[0]
    for got, ref in [(logits[0, :n0], alone0[0][0]), (h_pred[0, :n0], alone0[1][0]),
                     (logits2[0, :n0], alone0[0][0]), (h_pred2[0, :n0], alone0[1][0]),
                     (logits[1], alone1[0][0]), (h_pred[1], alone1[1][0])]:
        assert (got - ref).abs().max().item() < TOL
    # the change was big enough to matter where it is allowed to (the padding positions)
    assert (h_pred2[0, n0:] - h_pred[0, n0:]).abs().max().item() > 1e-3


def test_loss_ignores_padding_and_other_rows():
    """drafter_loss of a padded batch is the mask-weighted mean of each row's own loss, and does
    not change when the padding holds something else (second pass included)."""
    tgt, drafter = float64_pair(12, std=0.5)
    g = torch.Generator().manual_seed(15)
    lens, plens = [6, 10], [2, 4]
    T = max(lens)
    h_in = torch.randn(2, T, C, generator=g, dtype=torch.float64)
    h_tgt = torch.randn(2, T, C, generator=g, dtype=torch.float64)
    x = torch.randint(0, V, (2, T), generator=g)
    mask = torch.zeros(2, T, dtype=torch.bool)
    for b in range(2):
        mask[b, plens[b] - 1:lens[b]] = True
    with torch.no_grad():
        batch = drafter_loss(drafter, h_in, x, h_tgt, mask).item()
        rows = [drafter_loss(drafter, h_in[b:b + 1, :lens[b]], x[b:b + 1, :lens[b]],
                             h_tgt[b:b + 1, :lens[b]], mask[b:b + 1, :lens[b]]).item() for b in range(2)]
        h_in2, x2, h_tgt2 = h_in.clone(), x.clone(), h_tgt.clone()
        n0 = lens[0]
        h_in2[0, n0:] = 7.0
        h_tgt2[0, n0:] = -3.0
        x2[0, n0:] = (x[0, n0:] + 3) % V
        padded_other = drafter_loss(drafter, h_in2, x2, h_tgt2, mask).item()
    m = mask.sum(1).double()
    expected = float((m[0] * rows[0] + m[1] * rows[1]) / m.sum())
    assert abs(batch - expected) < TOL
    assert abs(padded_other - batch) < TOL


# ----------------------------------------------------------------------------- the drafter's cache


def test_drafter_cache_matches_full_forward_with_rollbacks():
    tgt, drafter = float64_pair(16, std=1.0)
    g = torch.Generator().manual_seed(19)
    B, T = 2, 12
    h = torch.randn(B, T, C, generator=g, dtype=torch.float64)
    x = torch.randint(0, V, (B, T), generator=g)

    def close(a, b):
        return (a - b).abs().max().item() < TOL

    with torch.no_grad():
        full_logits, full_h = drafter(h, x)
        cache = drafter.new_cache(B, max_len=16)
        assert cache.kv.shape[0] == 1 and cache.kv.dtype == torch.float64  # one layer, drafter's dtype
        # prefill several pairs, then one at a time
        lg, hp = drafter(h[:, :4], x[:, :4], cache)
        assert close(lg, full_logits[:, :4]) and close(hp, full_h[:, :4])
        for t in range(4, 8):
            lg, hp = drafter(h[:, t:t + 1], x[:, t:t + 1], cache)
            assert close(lg[:, 0], full_logits[:, t]) and close(hp[:, 0], full_h[:, t])
        assert cache.lengths.tolist() == [8, 8]
        # roll back to ragged lengths, write garbage (as drafting on guessed states does), roll back
        cache.lengths = torch.tensor([6, 3])
        drafter(torch.randn(B, 3, C, generator=g, dtype=torch.float64) * 4,
                torch.randint(0, V, (B, 3), generator=g), cache)
        cache.lengths = torch.tensor([6, 3])
        # re-extend by 3 ragged pairs per row, then one at a time
        for width in (3, 1, 1):
            idx = cache.lengths[:, None] + torch.arange(width)  # (B, width)
            rows = torch.arange(B)[:, None]
            lg, hp = drafter(h[rows, idx], x.gather(1, idx), cache)
            assert close(lg, full_logits[rows, idx]) and close(hp, full_h[rows, idx]), idx
        assert cache.lengths.tolist() == [11, 8]


# ----------------------------------------------------------------------------- the buffer


def _item(n_tokens, step_tag):
    return torch.full((n_tokens,), step_tag, dtype=torch.long), torch.full((n_tokens - 1, 4), float(step_tag))


def test_buffer_keeps_only_the_last_steps():
    buf = DrafterBuffer(keep_steps=2)
    sizes = {0: [5, 6], 1: [7], 2: [4, 9], 3: [8]}
    kept_after = {0: {0}, 1: {0, 1}, 2: {1, 2}, 3: {2, 3}}
    for step, ns in sizes.items():
        for n in ns:
            tokens, hidden = _item(n, step)
            buf.add(step, tokens, hidden, prompt_len=2)
        steps = {s for s, *_ in buf.items}
        assert steps == kept_after[step], (step, steps)
        assert len(buf.items) == sum(len(sizes[s]) for s in steps)
        assert buf.tokens == sum(sum(sizes[s]) for s in steps)
    # what sample() returns comes only from kept steps
    h_in, x_next, _, _ = buf.sample(32, random.Random(1))
    assert set(x_next[:, 0].tolist()) <= {2, 3}
    one = DrafterBuffer(keep_steps=1)
    for step in range(3):
        one.add(step, *_item(5, step), prompt_len=1)
        assert {s for s, *_ in one.items} == {step}


def test_a_rollouts_rows_are_stored_within_the_bounds():
    """add_rows stores a rollout's finished rows at once, under both bounds: over 50 steps what the
    buffer holds stays within keep_tokens and within the last keep_steps steps, the oldest rows
    dropped first, the newest kept, and `tokens` counts what it holds."""
    buf = DrafterBuffer(keep_steps=3, keep_tokens=300)
    buf.add(0, *_item(40, 0), prompt_len=2)
    for step in range(1, 51):
        rows = [Sample([], *_item(30 + 5 * (i + step % 3), step), 2) for i in range(4)]  # 130 to 180 tokens a step
        buf.add_rows(step, rows)
        assert sum(t.shape[0] for _, t, _, _ in buf.items) == buf.tokens <= 300, step
        assert torch.equal(buf.items[-1][1], rows[-1].tokens)  # the newest row always stays
        assert [it[0] for it in buf.items][-4:] == [step] * 4  # stored at once: this step's rows all fit
        assert all(it[0] > step - 3 for it in buf.items)


def test_one_idle_turn_handles_at_most_idle_tokens_positions(target, monkeypatch):
    """The idle loop's turns each touch at most max_tokens positions, however much the buffer holds:
    the health figure scores a piece a chore, a training batch is cut to max_tokens padded
    positions; and drawing a batch sorts nothing."""
    import drafter as drafter_module
    g = torch.Generator().manual_seed(0)
    C, max_tokens = target.config.n_embd, 64
    lengths = torch.randint(4, 40, (200,), generator=g).tolist()
    rows = [Sample([], torch.randint(0, 10, (n,), generator=g), torch.randn(n - 1, C, generator=g), 2) for n in lengths]
    buf = DrafterBuffer(keep_steps=4, keep_tokens=100_000)
    buf.add_rows(0, rows)
    assert buf.tokens == sum(lengths) > max_tokens
    scored = []
    import scheduler
    real = scheduler.acceptance
    monkeypatch.setattr(scheduler, "acceptance", lambda d, h_in, *rest: scored.append(h_in.shape[0] * (h_in.shape[1] + 2)) or real(d, h_in, *rest))
    into = [0, 0]
    for piece in scheduler.acceptance_pieces(make_drafter(target, seed=0), rows, into, max_tokens, 1.0):
        piece()
    assert max(scored) <= max_tokens and into[1] == sum(n - 1 - 2 for n in lengths)
    monkeypatch.setattr(drafter_module, "sorted", lambda *a, **k: pytest.fail("sample() sorted the buffer"), raising=False)
    for seed in range(20):
        h_in, *_ = buf.sample(8, random.Random(seed), max_tokens=max_tokens)
        assert h_in.shape[0] * (h_in.shape[1] + 2) <= max_tokens


def test_buffer_add_rejects_mismatched_lengths():
    buf = DrafterBuffer()
    buf.add(0, *_item(6, 0), prompt_len=2)
    for n_hidden in (6, 4, 0):
        with pytest.raises(ValueError):
            buf.add(0, torch.zeros(6, dtype=torch.long), torch.zeros(n_hidden, 4), prompt_len=2)
    assert len(buf.items) == 1 and buf.tokens == 6


def test_buffer_keeps_at_most_keep_tokens_dropping_the_oldest():
    """After every add the buffer holds at most keep_tokens tokens, and what it holds is the longest
    run of the newest sequences that fits: the oldest go first, never a newer one. The step bound
    still applies on top."""
    lengths = [5, 9, 3, 12, 7, 4, 10, 6, 8, 11]
    buf = DrafterBuffer(keep_steps=4, keep_tokens=20)
    added = []
    for i, n in enumerate(lengths):
        step = i // 2  # two sequences per step
        buf.add(step, torch.full((n,), i, dtype=torch.long), torch.zeros(n - 1, 4), prompt_len=1)
        added.append((i, n, step))
        kept = [int(t[0]) for _, t, _, _ in buf.items]
        expected, total = [], 0
        for j, m, s in reversed(added):
            if s <= step - 4 or total + m > 20:
                break
            expected.insert(0, j)
            total += m
        assert kept == expected, (i, kept, expected)
        assert buf.tokens == total <= 20
    assert len(buf.items) < len(lengths)  # the bound did drop sequences
    unbounded = DrafterBuffer(keep_steps=100)
    for i, n in enumerate(lengths):
        unbounded.add(0, torch.full((n,), i, dtype=torch.long), torch.zeros(n - 1, 4), prompt_len=1)
    assert unbounded.tokens == sum(lengths)


def test_buffer_stores_hidden_states_in_its_dtype_and_batches_in_float32():
    """A bf16 run keeps the hidden states in bf16 (half the memory); its batches are float32, the
    bf16 values exactly."""
    g = torch.Generator().manual_seed(3)
    hidden = torch.randn(6, 4, generator=g)
    buf = DrafterBuffer(dtype=torch.bfloat16)
    buf.add(0, torch.arange(7), hidden, prompt_len=2)
    assert buf.items[0][2].dtype == torch.bfloat16
    h_in, _, h_tgt, _ = buf.sample(1, random.Random(0))
    assert h_in.dtype == h_tgt.dtype == torch.float32
    assert torch.equal(h_in[0], hidden.bfloat16().float()[:-1]) and not torch.equal(h_in[0], hidden[:-1])


# ----------------------------------------------------------------------------- training works


def test_short_training_lowers_loss_and_raises_acceptance(target, buffers):
    train_buf, held_out, prompts = buffers
    drafter = make_drafter(target, seed=0)
    opt = make_optimizer(drafter, lr=1e-2)
    eval_batch = held_out.sample(64, random.Random(123))  # held-out rollouts, same batch both times

    def measure():
        with torch.no_grad():
            loss = drafter_loss(drafter, *eval_batch).item()
        agree, n = acceptance(drafter, *held_out.sample(64, random.Random(7)), temperature=0)
        proxy = agree / n
        _, st = speculative_generate(target, drafter, prompts, 20, k=3, temperature=0)
        return loss, proxy, st["accept_len"]  # the core's own count

    loss0, proxy0, alen0 = measure()
    c0 = checksum(drafter)
    rng = random.Random(0)
    train_losses = [train_step(drafter, opt, train_buf.sample(16, rng))[0] for _ in range(100)]
    loss1, proxy1, alen1 = measure()
    assert checksum(drafter) != c0
    # measured with these seeds: loss ~1.1 -> ~0.35, proxy ~0.2 -> ~0.55
    assert loss1 < 0.7 * loss0, (loss0, loss1)
    assert proxy1 > proxy0 + 0.15, (proxy0, proxy1)
    assert sum(train_losses[-10:]) < 0.7 * sum(train_losses[:10])
    # the new weights reach decoding: greedy speculative decoding accepts more drafts
    assert alen1 > alen0 + 0.1, (alen0, alen1)


def test_a_step_preempted_midway_changes_nothing(target, buffers):
    """The last rank's arrival stops a drafter step at its next piece (between chained passes,
    before the backward, before the optimizer step): wherever it stops, nothing is applied and the
    optimizer has not moved; asked and never preempted, the step is the plain one."""
    train_buf, _, _ = buffers
    for stop_at in range(1, 6):  # 3 passes, then before the backward, then before the step
        drafter = make_drafter(target, seed=0)
        opt = make_optimizer(drafter, lr=1e-2)
        before = {n: p.detach().clone() for n, p in drafter.named_parameters()}
        asked = []
        loss, applied = train_step(drafter, opt, train_buf.sample(8, random.Random(0)), depth=3,
                                   preempted=lambda: asked.append(1) or len(asked) >= stop_at)
        assert loss is None and not applied and len(asked) == stop_at
        assert all(torch.equal(p, before[n]) for n, p in drafter.named_parameters()) and not opt.state
    asked = []
    loss, applied = train_step(drafter, opt, train_buf.sample(8, random.Random(0)), depth=3,
                               preempted=lambda: asked.append(1) and False)
    assert applied and len(asked) == 5 and not all(torch.equal(p, before[n]) for n, p in drafter.named_parameters())


def test_non_finite_step_is_not_applied(target, buffers):
    train_buf, _, _ = buffers
    drafter = make_drafter(target, seed=0)
    opt = make_optimizer(drafter)
    with torch.no_grad():
        drafter.in_proj.weight[0, 0] = float("inf")  # every loss and gradient through it is non-finite
    before = snapshot(drafter)
    loss, applied = train_step(drafter, opt, train_buf.sample(4, random.Random(0)))
    assert not applied
    assert all(torch.equal(p, before[n]) for n, p in drafter.named_parameters())


def test_acceptance_pieces_count_the_drafted_positions(target, buffers):
    """Over a rollout's rows, scheduler.acceptance_pieces sum drafter.acceptance over each chunk's
    pairs from prompt_len - 1 on: the same figure as one padded batch of the same sequences (up to
    float rounding); a piece not run leaves its chunk out."""
    train_buf, _, _ = buffers
    drafter = make_drafter(target, seed=0)
    gen = torch.Generator().manual_seed(0)
    prompts = [[1 + i % 7, 2 + i % 5] for i in range(10)]
    samples = decode_plainly(RunningBatch(target, prompts, 12, generator=gen))
    into = [0, 0]
    from scheduler import acceptance_pieces
    scoring = acceptance_pieces(drafter, samples, into, 40, 1.0)
    assert len(scoring) > 2  # 10 samples of up to 14 tokens, in pieces of at most 40 padded positions
    scoring.popleft()()
    assert 0 < into[1] < sum(s.tokens.shape[0] - 1 - s.prompt_len for s in samples)
    while scoring:
        scoring.popleft()()
    kept, n = into
    assert n == sum(s.tokens.shape[0] - 1 - s.prompt_len for s in samples)  # pairs t = plen-1 .. N-3
    whole = acceptance(drafter, *pair_batch([(s.tokens, s.hidden, s.prompt_len) for s in samples]))
    assert (kept, n) == (pytest.approx(whole[0], rel=1e-5), whole[1])


class GivenLogits(torch.nn.Module):
    """A stand-in drafter whose logits are given, over a target whose head reads its logits off h."""

    def __init__(self, logits):
        super().__init__()
        self.logits = logits
        self.target = torch.nn.Module()
        self.target.lm_head = torch.nn.Linear(logits.shape[-1], logits.shape[-1], bias=False)
        torch.nn.init.eye_(self.target.lm_head.weight)

    def forward(self, h_in, x_next):
        return self.logits, None


def acceptance_of(p_logits, q_logits, temperature):
    """drafter.acceptance per position, for the target's and the drafter's logits (1, T, V)."""
    mask = torch.ones(p_logits.shape[:2], dtype=torch.bool)
    kept, n = acceptance(GivenLogits(q_logits), None, None, p_logits, mask, temperature)
    return kept / n


def test_acceptance_is_the_share_that_sampling_keeps_not_top1():
    """drafter.acceptance is sum_x min(p, q) at the sampling temperature: what rejection sampling
    (speculative.verify) keeps of a draft drawn from q, measured over 20,000 draws (tolerance 0.015,
    4 standard errors), and an upper bound on what exact-token sampling keeps (the draft and the
    target on the same speculative.gumbel_noise, the same tolerance). At temperature 0 it is the top-1 agreement. Where the target draws at random
    among near-ties, a drafter that draws the same way is kept nearly always, though its top-1
    agrees only about a third of the time."""
    p, q = torch.tensor([0.6, 0.3, 0.1]), torch.tensor([0.2, 0.5, 0.3])
    assert acceptance_of(p.log()[None, None], q.log()[None, None], 1.0) == pytest.approx(0.6)  # .2+.3+.1
    hot = F.softmax(torch.stack([p, q]).log() / 2.0, -1)  # at temperature 2
    assert acceptance_of(p.log()[None, None], q.log()[None, None], 2.0) == pytest.approx(float(torch.minimum(*hot).sum()))
    assert acceptance_of(p.log()[None, None], q.log()[None, None], 0) == 0.0  # argmaxes 0 and 1
    n, gen = 20_000, torch.Generator().manual_seed(0)
    drafts = torch.multinomial(q.expand(n, 3), 1, generator=gen)  # (n, 1), drawn from q
    from speculative import verify
    n_acc, _ = verify(drafts, q.expand(n, 1, 3), p.expand(n, 2, 3), gen)
    assert float(n_acc.float().mean()) == pytest.approx(0.6, abs=0.015)
    from speculative import gumbel_noise, verify_gumbel
    g = gumbel_noise(torch.randint(0, 2**32, (n, 1), generator=gen), 3)  # (n, 1, 3): one noise for both
    kept = verify_gumbel((q.log() + g).argmax(-1), (p.log() + g).argmax(-1))  # (n,): 0 or 1
    assert 0.6 - 0.1 < float(kept.float().mean()) < 0.6 + 0.015
    ties = 1e-3 * torch.randn(2, 1, 3000, 3, generator=gen)  # three near-equal tokens, 3000 positions
    assert acceptance_of(ties[0], ties[1], 1.0) > 0.99
    assert acceptance_of(ties[0], ties[1], 0) == pytest.approx(1 / 3, abs=0.03)


def test_checksum_tracks_weights(target, buffers):
    train_buf, _, _ = buffers
    a, b = make_drafter(target, seed=0), make_drafter(target, seed=0)
    other = make_drafter(target, seed=1)
    assert checksum(a) == checksum(b) != checksum(other)
    other.load_state_dict(a.state_dict())
    assert checksum(other) == checksum(a)
    before = checksum(a)
    train_step(a, make_optimizer(a), train_buf.sample(4, random.Random(0)))
    assert checksum(a) != before
    b.load_state_dict(a.state_dict())
    assert checksum(b) == checksum(a)
    # one element of one tensor, nudged by one float32 step, is visible
    with torch.no_grad():
        p = b.stack.blocks[0].attn.qkv.weight
        p[3, 5] = torch.nextafter(p[3, 5], torch.tensor(1e9))
    assert checksum(b) != checksum(a)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float64])
def test_checksum_works_in_any_dtype(target, dtype):
    """numpy has no bfloat16: the checksum reads every dtype's bytes, and a one-step nudge of one
    element is visible in each."""
    a, b = make_drafter(target, seed=0).to(dtype), make_drafter(target, seed=0).to(dtype)
    assert checksum(a) == checksum(b) != checksum(make_drafter(target, seed=0))
    with torch.no_grad():
        p = b.stack.blocks[0].attn.qkv.weight
        p[3, 5] = torch.nextafter(p[3, 5], torch.tensor(1e9, dtype=dtype))
    assert checksum(b) != checksum(a)


def test_chained_passes_are_the_drafter_drafting():
    """chained_states is the drafter drafting, from every position at once: pass d at position t is
    what the drafter computes for its (d + 1)-th draft after catching up on the real pairs up to
    t - d through its cache and feeding its own states back (the drafts being the teacher's tokens).
    A mask that let a pass see other chains' entries, or the same chain one position off, fails."""
    tgt, drafter = float64_pair(21, std=0.5)
    g = torch.Generator().manual_seed(24)
    T, depth = 14, 5
    h = torch.randn(1, T, C, generator=g, dtype=torch.float64)
    x = torch.randint(0, V, (1, T), generator=g)
    with torch.no_grad():
        states = list(chained_states(drafter, h, x, depth))
        for s in (0, 3, T - depth):
            cache = drafter.new_cache(1, dtype=torch.float64)
            _, h_pred = drafter(h[:, :s + 1], x[:, :s + 1], cache)  # the real pairs 0..s
            h_pred = h_pred[:, -1:]
            for d in range(depth):
                assert (h_pred[0, 0] - states[d][0, s + d]).abs().max().item() < TOL
                if d + 1 < depth:
                    _, h_pred = drafter(h_pred, x[:, s + d + 1:s + d + 2], cache)


def test_depth_one_loss_is_teacher_forcing_and_deeper_passes_count_their_chains(target, buffers):
    """depth=1 (a cold start's training) is the teacher-forced loss alone; a deeper loss adds one
    pass per depth, and pass d counts the positions whose chain starts inside the mask."""
    train_buf, _, _ = buffers
    drafter = make_drafter(target, seed=0)
    h_in, x_next, h_tgt, mask = train_buf.sample(8, random.Random(0))
    masks = chain_loss_masks(mask, 3)
    assert torch.equal(masks[0], mask)
    for d in (1, 2):
        assert masks[d].sum() == (mask[:, d:] & mask[:, :-d]).sum() and not masks[d][:, :d].any()
    with torch.no_grad():
        one = drafter_loss(drafter, h_in, x_next, h_tgt, mask, depth=1)
        logits, h_pred = drafter(h_in, x_next)
        p = F.softmax(F.linear(h_tgt, target.lm_head.weight), -1)
        per = F.smooth_l1_loss(h_pred, h_tgt, reduction="none").mean(-1) - 0.1 * (p * F.log_softmax(logits, -1)).sum(-1)
        assert torch.allclose(one, (per * mask).sum() / mask.sum(), atol=1e-6)
        assert not torch.allclose(one, drafter_loss(drafter, h_in, x_next, h_tgt, mask, depth=3))
    loss, applied = train_step(drafter, make_optimizer(drafter), train_buf.sample(4, random.Random(1)), depth=1)
    assert applied and loss > 0


def test_warmup_ends_at_its_third_stall_and_keeps_its_best(target, buffers, monkeypatch, capsys):
    """warmup.train_to_plateau: with a gain no scoring can make (MIN_GAIN huge) and chained passes
    from the first scoring on, every 3 scorings are a stall: the rate drops at scorings 5 and 8 and
    the warm-up ends at 11, reached its plateau; the drafter it leaves is its best-scoring one, not
    its last; a cap before that ends it short, and says so."""
    from harness import config
    from harness import warmup
    train_buf, held_out, _ = buffers
    monkeypatch.setattr(warmup, "EVAL_EVERY", 10)
    monkeypatch.setattr(warmup, "MIN_GAIN", 100.0)
    monkeypatch.setattr(warmup, "DEEP_FROM", 0.0)
    args = config.parse_args(["--drafter-warmup-steps", "1000", "--drafter-batch", "4", "--drafter-lr", "0.3"])
    drafter = make_drafter(target, seed=3)
    info = warmup.train_to_plateau(drafter, train_buf, held_out, random.Random(0), args, False, "cpu")
    assert info["steps"] == 110 and info["plateau"]
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("drafter warmup 0")]
    scores = [float(ln.split(" of 8 accepted")[0].split()[-1]) for ln in lines]
    assert len(scores) == 11 and [ln.split("| lr ")[1][:7] for ln in lines][-1] == f"{0.3 * 0.09:.1e}"
    kept = warmup.held_out_figures(drafter, held_out, "cpu")
    assert torch.allclose(kept, torch.tensor(info["figures"], dtype=torch.float64))
    assert warmup.expected_accepted((kept[1] / kept[2]).tolist()) == pytest.approx(max(scores), abs=0.006)  # printed to 2 places
    args = config.parse_args(["--drafter-warmup-steps", "30", "--drafter-batch", "4"])
    info = warmup.train_to_plateau(make_drafter(target, seed=3), train_buf, held_out, random.Random(0), args, False, "cpu")
    assert info["steps"] == 30 and not info["plateau"] and "SHORT of its plateau" in capsys.readouterr().out
