"""The target model: a small causal transformer with a ragged, preallocated KV cache.

GPT.forward(idx, cache=None) returns (logits, hidden), where `hidden` is the final hidden state
after the final norm, i.e. exactly the LM head's input. The drafter reads it (EAGLE style).

The KV cache is one static tensor per run, allocated once, with a length pointer per row:

    cache.kv           (n_layer, 2, B, n_head, max_len, head_dim)   keys and values
    cache.lengths      (B,) long

Appending T tokens writes row b's keys at positions lengths[b] .. lengths[b]+T-1 and then adds T
to every length. Rolling a row back (a rejected draft, or the padding of a short prompt) is just
assigning a smaller length: the stale entries past it are never read, because a query at position
p only attends to keys at positions <= p, and they are overwritten by the next append.

Ragged prompts: right padding plus per-row lengths. Prefill the padded (B, T) batch with every
length at 0, then assign the true prompt lengths; the padding's cache entries are dead. Rows that
finish leave the batch with `cache.keep` (compaction), so a shrinking batch really costs less.

Shape: 12 layers of width 48 (0.37 M parameters), deep and narrow on purpose. On a CPU at small
batch a decoding step costs its kernel launches, about 20 per layer, far more than its FLOPs, so
the one-layer drafter costs about one layer's share of the target. Twelve layers make that share
small, near what a one-layer drafter costs against a large target on a GPU, so speculative
decoding pays here for the reasons it pays there; a shallow, wide target that learns the task as
well makes the drafter's share large, and speculation then barely pays (RESULTS.md has both).

Simplifications on purpose: rotary position embeddings (positions are per row, so RoPE is a
gather, not a slice, and one complex multiply), LayerNorm without bias and GPT-2's tanh GELU (on a
CPU at batch 1 every kernel launch counts, and LayerNorm is one fused kernel where RMSNorm is a few),
tied embedding and LM head, no dropout.

No host-device sync in a forward with a cache: the attention window (how many key positions the
new tokens may see) is `cache.window`, an upper bound on the longest row after the append that the
caller knows on the host and sets before the forward (speculative.RunningBatch does; on the cache,
so it reaches the drafter's forward too, which shares RotaryStack). Keys past a row's own position
are masked anyway, so a loose bound only wastes attention. Without it the forward reads the
lengths to learn the window (a sync), which is fine outside a decoding loop.

bf16: weights in float32 under torch.autocast (CPU or CUDA) is the supported way. Under autocast
the matrix products and attention run in bf16, and the residual stream, the norms and `hidden` stay
in the weights' dtype (float32), by construction rather than by autocast's per-device op lists
(CUDA's runs layer_norm in float32, the CPU's in its input's dtype): the stream starts in the
weights' dtype (the embedding's rows; the drafter casts its first layer's output, Drafter.fused),
each residual add keeps it by type promotion (float32 + bf16 is float32 on every device), and
`LayerNorm` runs with autocast off on that dtype. So a CPU and a GPU compute in the same dtypes,
down to the state the drafter feeds back while drafting. The rotary multiply is done in float32
(there is no bf16 complex type) and cast back, and the rotary table stays float32 even after
model.bfloat16(). The KV cache is made in the autocast dtype (`new_cache`: half the memory, and
what SDPA reads under autocast, so it casts nothing per layer) and the attention mask in that
dtype too. SDPA's softmax accumulates in float32.

Test: python -m pytest tests/test_model.py
"""
from dataclasses import dataclass, asdict

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class GPTConfig:
    vocab_size: int = 778   # task.VOCAB_SIZE
    block_size: int = 256   # longest prompt + response (+ draft) the model and its cache hold
    n_layer: int = 12
    n_head: int = 4
    n_embd: int = 48
    rope_base: float = 10000.0

    def __post_init__(self):
        for name in ("vocab_size", "block_size", "n_layer", "n_head", "n_embd"):
            if getattr(self, name) <= 0:
                raise ValueError(f"GPTConfig.{name} must be positive, got {getattr(self, name)}")
        if self.n_embd % self.n_head or (self.n_embd // self.n_head) % 2:
            raise ValueError(f"n_embd={self.n_embd} must split into n_head={self.n_head} heads of even size")

    def to_dict(self):
        return asdict(self)


class KVCache:
    """Preallocated keys and values for every layer, with one length per row."""

    def __init__(self, config, batch_size, max_len, device="cpu", dtype=torch.float32, n_layer=None):
        n_layer = config.n_layer if n_layer is None else n_layer  # the drafter has one layer
        hd = config.n_embd // config.n_head
        # keys and values side by side, so one indexed write per layer stores both
        self.kv = torch.zeros((n_layer, 2, batch_size, config.n_head, max_len, hd), device=device, dtype=dtype)
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.max_len = max_len
        # the attention window of the next forward with this cache, set by a caller that knows it on
        # the host: an upper bound on max(lengths) + T after that append; the forward consumes it
        # (None: it reads the lengths, a sync). See RotaryStack.forward.
        self.window = None
        # 0 .. max_len-1 and 0 .. B-1, made once: slicing them is free, a fresh arange is a kernel
        self.offsets = torch.arange(max_len, device=device)
        self.rows = torch.arange(batch_size, device=device)

    @property
    def k(self):
        return self.kv[:, 0]  # (n_layer, B, n_head, max_len, head_dim)

    @property
    def v(self):
        return self.kv[:, 1]

    @property
    def batch_size(self):
        return self.lengths.shape[0]

    def keep(self, n, slots=None, rows=None):
        """Compaction: slots `slots` get rows `rows` (long tensors on the cache's device), then the
        cache is its first n slots. RunningBatch.compact moves the few live rows past the new end
        into the holes that finished rows leave before it, so a compaction copies a few rows instead
        of the whole cache (tens of MB at batch 64 with 12 layers). Index tensors, not lists: a list
        is copied from the host, which waits for a GPU's queue."""
        if slots is not None:  # the right side is a copy: safe in any order
            self.kv[:, :, slots] = self.kv[:, :, rows]
            self.lengths = self.lengths.index_copy(0, slots, self.lengths[rows])
        self.kv, self.lengths, self.rows = self.kv[:, :, :n], self.lengths[:n], self.rows[:n]


def rope_table(head_dim, max_len, base, device=None):
    """(max_len, head_dim/2, 2) float32: cos and sin of every position's angle per channel pair,
    computed in float64 (bf16 angles would be off by whole radians at position 200)."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float64) / head_dim))
    angles = torch.outer(torch.arange(max_len, device=device, dtype=torch.float64), inv_freq)  # (L, hd/2)
    return torch.stack((angles.cos(), angles.sin()), dim=-1).float()


def apply_rope(x, rot):
    # x (..., T, hd) real; rot (..., T, hd/2) complex, e^(i angle). Each pair of channels is one complex
    # number, and rotating it by its position's angle is one complex multiply: a single kernel. In at
    # least float32 (there is no bf16 complex type), back in x's dtype after; for float32 and float64
    # both casts are no-ops.
    wide = x.dtype if x.dtype in (torch.float32, torch.float64) else torch.float32
    return torch.view_as_real(torch.view_as_complex(x.to(wide).unflatten(-1, (-1, 2))) * rot).flatten(-2).to(x.dtype)


class LayerNorm(nn.LayerNorm):
    """LayerNorm without bias, computed in its weight's dtype whatever autocast does: float32 on every
    device under autocast (whose own rule differs: CUDA's computes it in float32, the CPU's in the
    input's dtype). Autocast is turned off by hand, which is what `with torch.autocast(dev,
    enabled=False)` does, at less than half its overhead (measured: 2 against 5 microseconds a call,
    25 calls a forward); float32 runs skip it."""

    def __init__(self, n_embd):
        super().__init__(n_embd, bias=False)

    def forward(self, x):
        dev = x.device.type
        if not torch.is_autocast_enabled(dev):
            return super().forward(x)
        torch.set_autocast_enabled(dev, False)
        try:  # the residual stream is in the weight's dtype already: the cast is for any other input
            return super().forward(x.to(self.weight.dtype))
        finally:
            torch.set_autocast_enabled(dev, True)


class Attention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.n_head = config.n_head
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd, bias=False)
        self.proj = nn.Linear(config.n_embd, config.n_embd, bias=False)

    def forward(self, x, rot, kv=None, where=None, mask=None, past=None):
        B, T, C = x.shape
        qkv = self.qkv(x).view(B, T, 3, self.n_head, C // self.n_head).permute(2, 0, 3, 1, 4)  # (3, B, H, T, hd)
        # rot turns queries and keys and multiplies values by 1: one multiply, and keys and values
        # come out side by side, as the cache holds them
        qkv = apply_rope(qkv, rot)  # (3, B, H, T, hd)
        q, k, v = qkv
        if past is not None:  # the drafter's chained passes: the keys and values of every pass so far
            past.append(qkv[1:])
            keys = torch.cat(past, dim=3)  # (2, B, H, passes * T, hd); mask (T, passes * T) bool, True: attend
            y = F.scaled_dot_product_attention(q, keys[0], keys[1], attn_mask=mask)
        elif kv is None:  # plain causal pass, positions 0..T-1
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:  # kv: this layer's (2, B, H, max_len, hd) slice of the cache; where = (rows, positions)
            # row b's T entries at its positions (the cast is a no-op unless the cache was made outside autocast)
            kv[:, where[0], :, where[1]] = qkv[1:].permute(1, 3, 0, 2, 4).to(kv.dtype)
            n_keys = mask.shape[-1]
            y = F.scaled_dot_product_attention(q, kv[0, :, :, :n_keys], kv[1, :, :, :n_keys], attn_mask=mask)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.norm1 = LayerNorm(config.n_embd)
        self.attn = Attention(config)
        self.norm2 = LayerNorm(config.n_embd)
        self.fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=False)
        self.out = nn.Linear(4 * config.n_embd, config.n_embd, bias=False)

    def forward(self, x, rot, kv=None, where=None, mask=None, past=None):
        # x, the residual stream, is in the weights' dtype; the branches come out of a linear layer, in
        # bf16 under autocast, and each add promotes them to x's dtype, so the stream stays float32
        x = x + self.attn(self.norm1(x), rot, kv, where, mask, past)
        return x + self.out(F.gelu(self.fc(self.norm2(x)), approximate="tanh"))


class RotaryStack(nn.Module):
    """Transformer blocks plus the bookkeeping shared by the target and the drafter: positions,
    rotary angles, cache writes and the length update."""

    def __init__(self, config, n_layer):
        super().__init__()
        self.config = config
        self.blocks = nn.ModuleList(Block(config) for _ in range(n_layer))
        self.register_buffer("rope", self._rope_table("cpu"), persistent=False)  # (block_size, 3, hd/2, 2)

    def _rope_table(self, device):
        """Per position: the rotation of queries, of keys, and 1 (+0i) for values (see Attention)."""
        c = self.config
        turn = rope_table(c.n_embd // c.n_head, c.block_size, c.rope_base, device)  # (L, hd/2, 2)
        one = torch.zeros_like(turn)
        one[..., 0] = 1.0
        return torch.stack((turn, turn, one), dim=1)

    def _apply(self, fn, recurse=True):
        # .to(), .double(), .bfloat16() reach buffers through here: a table pushed below float32 is
        # made again in float32 on its new device (float64, from .double(), is kept)
        super()._apply(fn, recurse)
        if self.rope.dtype not in (torch.float32, torch.float64):
            self.rope = self._rope_table(self.rope.device)
        return self

    def forward(self, x, cache=None, chain=None):
        """x (B, T, C), the residual stream, in the weights' dtype (see bf16 in the module docstring)
        -> (B, T, C). With a cache, the attention window is cache.window, an upper bound on
        max(cache.lengths) + T that the caller knows on the host (keys past a row's own position are
        masked anyway), used once; without it the forward reads the lengths, a sync.
        chain: (a list per block of the earlier passes' keys and values, a bool mask over them),
        positions 0..T-1, for the drafter's chained training passes (drafter.chained_states)."""
        B, T, _ = x.shape
        if cache is None:
            pos = torch.arange(T, device=x.device).expand(B, T)
            window, limit = T, self.config.block_size
        else:
            pos = cache.lengths[:, None] + cache.offsets[:T]  # (B, T)
            window, cache.window = cache.window, None
            if window is None:
                window = int(cache.lengths.max()) + T  # sync: no window given, so read the longest row
            limit = min(cache.max_len, self.config.block_size)
        if window > limit:
            raise ValueError(f"position {window - 1} is past the model's {limit} positions")
        rot = torch.view_as_complex(self.rope[pos]).permute(2, 0, 1, 3)[:, :, None]  # (3, B, 1, T, hd/2): q, k, v
        where = mask = None
        if cache is not None:  # a query at position p sees keys 0..p of its own row, never stale entries past p
            where = (cache.rows[:, None], pos)
            # in the dtype SDPA computes in (the autocast one, if on), so it casts nothing per layer
            dtype = torch.get_autocast_dtype(x.device.type) if torch.is_autocast_enabled(x.device.type) else x.dtype
            unseen = cache.offsets[:window] > pos[:, None, :, None]  # (B, 1, T, window)
            mask = torch.zeros(unseen.shape, dtype=dtype, device=x.device).masked_fill_(unseen, float("-inf"))
        if chain is not None:
            chained, mask = chain
        for i, block in enumerate(self.blocks):
            # block i's slice of the cache, taken here (one taken before block i - 1 writes breaks
            # autograd's view tracking); with a chain, block i's list of the passes' keys and values
            x = block(x, rot, None if cache is None else cache.kv[i], where, mask, None if chain is None else chained[i])
        if cache is not None:
            cache.lengths = cache.lengths + T
        return x


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.stack = RotaryStack(config, config.n_layer)
        self.norm = LayerNorm(config.n_embd)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied: the drafter shares both through the target
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight") or name.endswith("out.weight"):  # GPT-2 residual scaling
                nn.init.normal_(p, mean=0.0, std=0.02 / (2 * config.n_layer) ** 0.5)

    @staticmethod
    def _init_weights(module):
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx, cache=None):
        """idx (B, T) -> logits (B, T, V), hidden (B, T, C). See the module docstring for the cache."""
        hidden = self.norm(self.stack(self.wte(idx), cache))  # (B, T, C)
        return self.lm_head(hidden), hidden

    def new_cache(self, batch_size, max_len=None, device=None, dtype=None):
        """A KVCache on the model's device, in the dtype attention computes in: the autocast dtype
        when made under autocast, else the weights' dtype."""
        p = self.wte.weight
        device = torch.device(device or p.device)
        if dtype is None:
            dtype = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else p.dtype
        return KVCache(self.config, batch_size, max_len or self.config.block_size, device=device, dtype=dtype)

    def num_params(self):
        return sum(p.numel() for p in self.parameters())
