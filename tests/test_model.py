"""Tests for model.py: GPTConfig validation, the (logits, hidden) contract, and the ragged KV cache.

Every cache test compares against the one thing that is unambiguous: a plain forward pass
(no cache) over the row's whole sequence. They run in float64 so that any disagreement beyond
rounding (a wrong position, a stale key read, a wrong row after compaction) shows up as an
error many orders of magnitude above the 1e-9 tolerance. The weights are scaled up so that
attention is far from uniform (at init scale it is nearly uniform and some mistakes would
only move the output a little).
"""
import pytest
import torch

from model import GPT, GPTConfig, KVCache

TOL = 1e-9
V, C = 50, 16


def tiny_config(**kw):
    base = dict(vocab_size=V, block_size=64, n_layer=2, n_head=2, n_embd=C)
    base.update(kw)
    return GPTConfig(**base)


@pytest.fixture(scope="module")
def gpt64():
    torch.manual_seed(0)
    m = GPT(tiny_config()).double().eval()
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() > 1:
                p.mul_(20.0)
    return m


def full(m, ids):
    """Plain forward of one row (a list or 1-D tensor) -> logits (T, V), hidden (T, C)."""
    with torch.no_grad():
        logits, hidden = m(torch.as_tensor(ids, dtype=torch.long)[None])
    return logits[0], hidden[0]


def assert_close(a, b, what):
    assert a.shape == b.shape, f"{what}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    err = (a - b).abs().max().item()
    assert err <= TOL, f"{what}: max abs error {err:.3e} > {TOL}"


def rand_ids(gen, *shape):
    return torch.randint(0, V, shape, generator=gen)


# ----------------------------------------------------------------------------- config


@pytest.mark.parametrize("field", ["vocab_size", "block_size", "n_layer", "n_head", "n_embd"])
@pytest.mark.parametrize("bad", [0, -1])
def test_config_rejects_non_positive_sizes(field, bad):
    with pytest.raises(ValueError):
        tiny_config(**{field: bad})


@pytest.mark.parametrize("n_embd,n_head", [(15, 2), (16, 3), (18, 6), (10, 10), (12, 4)])
def test_config_rejects_heads_that_do_not_split_evenly(n_embd, n_head):
    # 15/2, 16/3: not divisible; 18/6 -> 3, 10/10 -> 1, 12/4 -> 3: odd head size (RoPE rotates pairs)
    with pytest.raises(ValueError):
        tiny_config(n_embd=n_embd, n_head=n_head)


@pytest.mark.parametrize("n_embd,n_head", [(16, 2), (12, 3), (16, 8), (16, 1)])
def test_config_accepts_valid_heads(n_embd, n_head):
    cfg = tiny_config(n_embd=n_embd, n_head=n_head)
    torch.manual_seed(0)
    logits, hidden = GPT(cfg)(torch.zeros(1, 3, dtype=torch.long))
    assert logits.shape == (1, 3, cfg.vocab_size) and hidden.shape == (1, 3, n_embd)


def test_forward_rejects_sequences_past_block_size():
    torch.manual_seed(0)
    m = GPT(tiny_config(block_size=16)).eval()
    z = lambda B, T: torch.zeros(B, T, dtype=torch.long)
    with torch.no_grad():
        m(z(2, 16))  # exactly block_size is fine
        with pytest.raises(ValueError):
            m(z(2, 17))
        # with a cache: new positions that would reach block_size
        cache = m.new_cache(2)
        m(z(2, 10), cache)
        m(z(2, 6), cache)  # positions 10..15: still fine
        with pytest.raises(ValueError):
            m(z(2, 1), cache)  # position 16
        # one long row is enough to overflow, even when the other row is short
        cache = m.new_cache(2)
        m(z(2, 4), cache)
        cache.lengths = torch.tensor([15, 2])
        with pytest.raises(ValueError):
            m(z(2, 2), cache)
        # a cache shorter than block_size is respected too
        small = m.new_cache(1, max_len=8)
        m(z(1, 8), small)
        with pytest.raises(ValueError):
            m(z(1, 1), small)


# ----------------------------------------------------------------------------- forward contract


def test_hidden_is_the_lm_head_input(gpt64):
    gen = torch.Generator().manual_seed(1)
    idx = rand_ids(gen, 3, 11)
    seen = []
    handle = gpt64.norm.register_forward_hook(lambda mod, inp, out: seen.append(out))
    try:
        with torch.no_grad():
            logits, hidden = gpt64(idx)
            assert logits.shape == (3, 11, V) and hidden.shape == (3, 11, C)
            assert_close(logits, gpt64.lm_head(hidden), "logits vs lm_head(hidden)")
            # the same holds on the cached path
            cache = gpt64.new_cache(3, 32, dtype=torch.float64)
            logits_c, hidden_c = gpt64(idx, cache)
            assert_close(logits_c, gpt64.lm_head(hidden_c), "cached logits vs lm_head(hidden)")
    finally:
        handle.remove()
    # "after the final norm": hidden is exactly what the final norm outputs
    assert len(seen) == 2 and torch.equal(seen[0], hidden) and torch.equal(seen[1], hidden_c)


def test_plain_forward_is_causal_and_rows_independent(gpt64):
    gen = torch.Generator().manual_seed(2)
    idx = rand_ids(gen, 2, 20)
    with torch.no_grad():
        logits, hidden = gpt64(idx)
    for b in range(2):
        for T in (1, 7, 20):  # a prefix's own forward equals the first T positions of the whole
            lp, hp = full(gpt64, idx[b, :T])
            assert_close(lp, logits[b, :T], f"row {b} prefix {T} logits")
            assert_close(hp, hidden[b, :T], f"row {b} prefix {T} hidden")


# ----------------------------------------------------------------------------- KV cache


@pytest.mark.parametrize("make_cache", ["new_cache", "KVCache"])
def test_incremental_decoding_equals_full_forward(gpt64, make_cache):
    gen = torch.Generator().manual_seed(3)
    B, prefix, steps, append = 3, 7, 5, 6
    seq = rand_ids(gen, B, prefix + steps + append)
    with torch.no_grad():
        ref_logits, ref_hidden = gpt64(seq)
    if make_cache == "new_cache":
        cache = gpt64.new_cache(B, 40, dtype=torch.float64)
    else:
        cache = KVCache(gpt64.config, B, 40, dtype=torch.float64)
    assert cache.lengths.dtype == torch.long and cache.lengths.tolist() == [0] * B
    got_l, got_h = [], []
    with torch.no_grad():
        l, h = gpt64(seq[:, :prefix], cache)                       # prefill
        got_l.append(l), got_h.append(h)
        assert cache.lengths.tolist() == [prefix] * B
        for t in range(prefix, prefix + steps):                    # one token at a time
            l, h = gpt64(seq[:, t:t + 1], cache)
            assert l.shape == (B, 1, V) and h.shape == (B, 1, C)
            got_l.append(l), got_h.append(h)
        assert cache.lengths.tolist() == [prefix + steps] * B
        l, h = gpt64(seq[:, prefix + steps:], cache)               # multi-token append
        got_l.append(l), got_h.append(h)
        assert cache.lengths.tolist() == [prefix + steps + append] * B
    assert_close(torch.cat(got_l, 1), ref_logits, "incremental logits")
    assert_close(torch.cat(got_h, 1), ref_hidden, "incremental hidden")


def test_ragged_rows_right_padding(gpt64):
    gen = torch.Generator().manual_seed(4)
    lens = [5, 9, 2, 7]
    B, Tp = len(lens), max(lens)
    rows = [rand_ids(gen, n).tolist() for n in lens]
    padded = torch.stack([torch.tensor(r + rand_ids(gen, Tp - len(r)).tolist()) for r in rows])  # junk padding
    cache = gpt64.new_cache(B, 48, dtype=torch.float64)
    seqs = [list(r) for r in rows]
    outs = [[] for _ in range(B)]
    with torch.no_grad():
        l, h = gpt64(padded, cache)
        for b, n in enumerate(lens):  # the real prompt positions already match
            rl, rh = full(gpt64, rows[b])
            assert_close(l[b, :n], rl, f"prefill row {b} logits")
            assert_close(h[b, :n], rh, f"prefill row {b} hidden")
        cache.lengths = torch.tensor(lens)
        for T in (1, 1, 3, 1, 4):  # single tokens and multi-token appends, every row its own tokens
            new = rand_ids(gen, B, T)
            l, h = gpt64(new, cache)
            for b in range(B):
                seqs[b] += new[b].tolist()
                outs[b].append((l[b], h[b]))
    assert cache.lengths.tolist() == [len(s) for s in seqs]
    for b in range(B):
        rl, rh = full(gpt64, seqs[b])
        n = lens[b]
        assert_close(torch.cat([o[0] for o in outs[b]]), rl[n:], f"row {b} logits")
        assert_close(torch.cat([o[1] for o in outs[b]]), rh[n:], f"row {b} hidden")


def test_roll_back_then_extend_with_different_tokens(gpt64):
    gen = torch.Generator().manual_seed(5)
    B, T0 = 3, 14
    seq = rand_ids(gen, B, T0)
    back = [0, 5, 2]  # row 1 rejects its last 5 tokens, row 2 its last 2, row 0 keeps everything
    cache = gpt64.new_cache(B, 48, dtype=torch.float64)
    seqs = [seq[b, : T0 - back[b]].tolist() for b in range(B)]
    starts = [len(s) for s in seqs]
    outs = [[] for _ in range(B)]

    def step(new):
        l, h = gpt64(new, cache)
        for b in range(B):
            seqs[b] += new[b].tolist()
            outs[b].append((l[b], h[b]))

    with torch.no_grad():
        gpt64(seq, cache)
        cache.lengths = torch.tensor(starts)
        # extend by fewer tokens than row 1 rolled back, so stale entries stay inside the batch's
        # attention window (row 0 is longer) and must be masked; then go on past them
        for T in (3, 1, 4):
            new = rand_ids(gen, B, T)
            if T == 3:  # the replacement really differs from what was rolled back
                for b in range(B):
                    if back[b]:
                        new[b, 0] = (seq[b, T0 - back[b]] + 1) % V
            step(new)
        # a second roll back, of row 0, in the middle of decoding, then one more append
        cache.lengths[0] -= 3
        seqs[0] = seqs[0][:-3]
        l0, h0 = torch.cat([o[0] for o in outs[0]]), torch.cat([o[1] for o in outs[0]])
        outs[0] = [(l0[:-3], h0[:-3])]
        step(rand_ids(gen, B, 2))
    assert cache.lengths.tolist() == [len(s) for s in seqs]
    for b in range(B):
        rl, rh = full(gpt64, seqs[b])
        assert_close(torch.cat([o[0] for o in outs[b]]), rl[starts[b]:], f"row {b} logits after roll back")
        assert_close(torch.cat([o[1] for o in outs[b]]), rh[starts[b]:], f"row {b} hidden after roll back")


def test_keep_compacts_rows_and_decoding_continues(gpt64):
    gen = torch.Generator().manual_seed(6)
    lens = [6, 3, 8, 5]
    B, Tp = len(lens), max(lens)
    rows = [rand_ids(gen, n).tolist() for n in lens]
    padded = torch.stack([torch.tensor(r + [0] * (Tp - len(r))) for r in rows])
    cache = gpt64.new_cache(B, 48, dtype=torch.float64)
    live = list(range(B))  # original row id of each cache row
    seqs = [list(r) for r in rows]
    with torch.no_grad():
        gpt64(padded, cache)
        cache.lengths = torch.tensor(lens)
        for step in range(7):
            keep = {2: [0, 2, 3],  # drop row 1
                    4: [1, 2]}.get(step)  # drop (original) row 0, the first: the others move up
            if keep is not None:  # the kept rows, in order
                cache.compact(keep)
                live = [live[i] for i in keep]
                assert cache.lengths.shape[0] == cache.kv.shape[2] == len(live)
                assert cache.lengths.tolist() == [len(seqs[r]) for r in live]
            new = rand_ids(gen, len(live), 1 + step % 2)
            l, h = gpt64(new, cache)
            T = new.shape[1]
            for i, r in enumerate(live):
                seqs[r] += new[i].tolist()
                rl, rh = full(gpt64, seqs[r])
                assert_close(l[i], rl[-T:], f"step {step} row {r} logits")
                assert_close(h[i], rh[-T:], f"step {step} row {r} hidden")
    assert live == [2, 3]


def test_float32_cache_matches_float32_forward():
    # the default dtype path (what the rollout uses on the CPU), at a float32 tolerance
    torch.manual_seed(7)
    m = GPT(tiny_config()).eval()
    gen = torch.Generator().manual_seed(7)
    seq = rand_ids(gen, 2, 12)
    cache = m.new_cache(2, 32)
    assert cache.kv.dtype == torch.float32
    with torch.no_grad():
        ref, _ = m(seq)
        a, _ = m(seq[:, :8], cache)
        b = torch.cat([m(seq[:, t:t + 1], cache)[0] for t in range(8, 12)], 1)
    torch.testing.assert_close(torch.cat([a, b], 1), ref, atol=1e-5, rtol=1e-4)


# ----------------------------------------------------------------------------- bf16


BF16_TOL = 0.02  # of the largest |logit|. bf16 keeps 8 significant bits (a rounding is <= 2^-9 relative);
# over 4 seeds of this model its logits moved by at most 0.7% of that from float32's and the cached
# ones by 0 from the uncached ones: 0.02 is about 3x the worst seen.


def test_bf16_autocast_cached_ragged_forward_matches_uncached_and_float32():
    """Under torch.autocast("cpu", bfloat16) with float32 weights (how a bf16 run works): the cache
    is made in bf16, hidden stays float32, logits come out in bf16; a ragged cached forward (right
    padding, per-row lengths, appends of 2 and 4 tokens) matches each row's uncached forward, and
    both are close to float32's but not equal to them (bf16 did run)."""
    torch.manual_seed(9)
    m = GPT(tiny_config()).eval()
    with torch.no_grad():
        for p in m.parameters():
            if p.dim() > 1:
                p.mul_(5.0)  # attention far from uniform
    gen = torch.Generator().manual_seed(9)
    lens = [5, 9, 2, 7]
    rows = [rand_ids(gen, n + 6) for n in lens]
    padded = torch.stack([torch.cat([r[:n], rand_ids(gen, max(lens) - n)]) for r, n in zip(rows, lens)])
    with torch.no_grad():
        f32 = torch.stack([m(r[None])[0][0, n:] for r, n in zip(rows, lens)])  # (B, 6, V)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            cache = m.new_cache(len(lens), 32)
            m(padded, cache)
            cache.lengths = torch.tensor(lens)
            a, h = m(torch.stack([r[n:n + 2] for r, n in zip(rows, lens)]), cache)
            b, _ = m(torch.stack([r[n + 2:] for r, n in zip(rows, lens)]), cache)
            full = torch.stack([m(r[None])[0][0, n:] for r, n in zip(rows, lens)])
    assert cache.kv.dtype == torch.bfloat16 and a.dtype == torch.bfloat16 and h.dtype == torch.float32
    scale = f32.abs().max().item()
    cached = torch.cat([a, b], 1).float()
    assert (cached - full.float()).abs().max().item() <= BF16_TOL * scale, "cached vs uncached under bf16"
    err = (full.float() - f32).abs().max().item()
    assert 0 < err <= BF16_TOL * scale, f"bf16 vs float32: {err / scale:.4f} of the largest logit"


def test_bf16_plain_and_speculative_generate_run():
    """Under autocast, plain and speculative decoding with exact-token sampling run, with bf16 caches
    for the target and the drafter and float32 hidden states; the first token of every row (from the
    same prefill in both) is the same. Later tokens may differ: in bf16 a pass of k + 1 tokens
    rounds differently from one-token passes, so only the distribution is exact, not every token."""
    from conftest import randomize
    from drafter import Drafter
    from harness.instrument import DecodeStats
    from speculative import RunningBatch, autoregressive_generate, speculative_generate
    torch.manual_seed(11)
    m = randomize(GPT(tiny_config()).eval(), 11, 0.5)
    d = randomize(Drafter(m).eval(), 12, 0.3)
    gen = torch.Generator().manual_seed(11)
    prompts = [rand_ids(gen, n).tolist() for n in (1, 4, 7, 3)]
    keys = [1000 + i for i in range(len(prompts))]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        batch = RunningBatch(m, prompts, 12, sampler="gumbel", keys=keys, max_draft=3)
        batch.compact()
        batch.speculative_step(d, 3)
        assert batch.cache.kv.dtype == torch.bfloat16 and batch.draft_cache.kv.dtype == torch.bfloat16
        assert batch.hidden.dtype == torch.float32
        plain, _ = autoregressive_generate(m, prompts, 12, sampler="gumbel", keys=keys)
        st = DecodeStats()
        sd, _ = speculative_generate(m, d, prompts, 12, k=3, sampler="gumbel", keys=keys, observer=st)
    assert [len(o) for o in plain] == [len(o) for o in sd] == [12] * len(prompts)
    assert all(0 <= t < V for o in sd for t in o)
    assert [o[0] for o in sd] == [o[0] for o in plain]
    assert 1 <= st.accept_len <= 4 and st.sd_row_steps > 0


def record_dtypes(*models):
    """Forward hooks on every block (the residual stream going in and out), norm and linear layer
    of `models`: -> a dict {kind: set of (name, dtype) seen}, and a function that removes them."""
    from model import Block
    seen = {"residual": set(), "norm": set(), "linear": set()}
    handles = []
    for i, model in enumerate(models):
        for name, mod in model.named_modules():
            tag = f"{i}.{name}"
            if isinstance(mod, Block):
                handles.append(mod.register_forward_pre_hook(
                    lambda m, args, tag=tag: seen["residual"].add((tag + " in", args[0].dtype))))
                handles.append(mod.register_forward_hook(
                    lambda m, args, out, tag=tag: seen["residual"].add((tag + " out", out.dtype))))
            kind = "norm" if isinstance(mod, torch.nn.LayerNorm) else "linear" if isinstance(mod, torch.nn.Linear) else None
            if kind:
                handles.append(mod.register_forward_hook(
                    lambda m, args, out, tag=tag, kind=kind: seen[kind].add((tag, out.dtype))))
    return seen, lambda: [h.remove() for h in handles]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="no GPU"))])
def test_bf16_autocast_runs_the_matmuls_in_bf16_and_keeps_residuals_and_norms_float32(device):
    """One bf16 recipe on every device: under autocast every linear layer of the target and of the
    drafter gives bf16 (autocast is on), while the residual stream into and out of every block, every
    norm and both hidden states returned are float32, through a plain forward, a cached one, the
    drafter's cached forward (the state it feeds back while drafting) and its chained training passes."""
    from conftest import randomize
    from drafter import Drafter, chained_states
    torch.manual_seed(13)
    m = randomize(GPT(tiny_config()), 13, 0.5).to(device)
    d = randomize(Drafter(m), 14, 0.3).to(device)
    gen = torch.Generator().manual_seed(13)
    idx = rand_ids(gen, 2, 6).to(device)
    seen, remove = record_dtypes(m, d)
    with torch.autocast(device, dtype=torch.bfloat16, cache_enabled=False):
        logits, hidden = m(idx)
        cache = m.new_cache(2, 16)
        m(idx[:, :4], cache)
        dcache = d.new_cache(2, 16, dtype=cache.kv.dtype)
        d_logits, h = d(hidden[:, :3], idx[:, 1:4], dcache)
        d_logits, h = d(h[:, -1:], idx[:, 4:5], dcache)  # its own state fed back, as in drafting
        states = list(chained_states(d, hidden[:, :5], idx[:, 1:], depth=2))
        states[-1].float().sum().backward()
    remove()
    assert logits.dtype == d_logits.dtype == torch.bfloat16
    assert hidden.dtype == h.dtype == torch.float32 and {s.dtype for s in states} == {torch.float32}
    assert {dt for _, dt in seen["linear"]} == {torch.bfloat16}, seen["linear"]
    for kind in ("residual", "norm"):
        assert {dt for _, dt in seen[kind]} == {torch.float32}, sorted((n, str(dt)) for n, dt in seen[kind])
    # every layer was seen: the target's and the drafter's blocks, norms and linear layers
    assert {n for n, _ in seen["residual"]} >= {"1.stack.blocks.0 in", "0.stack.blocks.1 out"}
    assert {n for n, _ in seen["norm"]} >= {"0.norm", "1.norm", "1.stack.blocks.0.norm2"}
    assert {n for n, _ in seen["linear"]} >= {"0.lm_head", "1.in_proj", "0.stack.blocks.0.attn.qkv"}
