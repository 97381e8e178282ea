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
finish leave the batch with `cache.keep(rows)` (compaction), so a shrinking batch really costs less.

Shape: 12 layers of width 48 (0.37 M parameters), deep and narrow on purpose. On a CPU at small
batch a decoding step costs its kernel launches, about 20 per layer, far more than its FLOPs, so
the one-layer drafter costs about one layer's share of the target. Twelve layers make that share
small, near what a one-layer drafter costs against a large target on a GPU, so speculative
decoding pays here for the reasons it pays there; a shallow, wide target that learns the task as
well makes the drafter's share large, and speculation then barely pays (RESULTS.md has both).

Simplifications on purpose: rotary position embeddings (positions are per row, so RoPE is a
gather, not a slice, and one complex multiply), LayerNorm without bias and GPT-2's tanh GELU (on a
CPU at batch 1 every kernel launch counts, and LayerNorm is one fused kernel where RMSNorm is a few), tied embedding and LM head, no dropout. float32 everywhere; bf16 on CUDA
would need the rotary multiply kept in float32 (there is no bf16 complex type), untested here for
want of a GPU.

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

    @property
    def k(self):
        return self.kv[:, 0]  # (n_layer, B, n_head, max_len, head_dim)

    @property
    def v(self):
        return self.kv[:, 1]

    @property
    def batch_size(self):
        return self.lengths.shape[0]

    def keep(self, rows):
        """Compaction: keep only `rows` (a long tensor of row indices), in that order: slot i gets
        row rows[i]. Only the slots whose row changes are copied, and the cache becomes a view of
        its first len(rows) slots. RunningBatch.compact moves the few live rows past the new end
        into the holes that finished rows leave, so a compaction copies a few rows instead of the
        whole cache (tens of MB at batch 64 with 12 layers)."""
        n = rows.shape[0]
        moved = (rows != torch.arange(n, device=rows.device)).nonzero()[:, 0]
        if moved.numel():
            self.kv[:, :, moved] = self.kv[:, :, rows[moved]]  # the right side is a copy: safe for any order
        self.kv = self.kv[:, :, :n]
        self.lengths = self.lengths[rows]


def rope_tables(head_dim, max_len, base, device):
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float64) / head_dim))
    angles = torch.outer(torch.arange(max_len, device=device, dtype=torch.float64), inv_freq)  # (L, hd/2)
    return angles.cos(), angles.sin()


def apply_rope(x, rot):
    # x (..., T, hd) real; rot (B, 1, T, hd/2) complex, e^(i angle). Each pair of channels is one complex
    # number, and rotating it by its position's angle is one complex multiply: a single kernel.
    return torch.view_as_real(torch.view_as_complex(x.unflatten(-1, (-1, 2))) * rot).flatten(-2)


class Attention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.n_head = config.n_head
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd, bias=False)
        self.proj = nn.Linear(config.n_embd, config.n_embd, bias=False)

    def forward(self, x, rot, kv=None, where=None, mask=None):
        B, T, C = x.shape
        qkv = self.qkv(x).view(B, T, 3, self.n_head, C // self.n_head).permute(2, 0, 3, 1, 4)  # (3, B, H, T, hd)
        qk = apply_rope(qkv[:2], rot)  # queries and keys rotated in one go
        q, k, v = qk[0], qk[1], qkv[2]
        if kv is None:  # plain causal pass, positions 0..T-1
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:  # kv: this layer's (2, B, H, max_len, hd) slice of the cache; where = (rows, positions)
            kv[:, where[0], :, where[1]] = torch.stack((k, v)).permute(1, 3, 0, 2, 4)  # row b's T entries at its positions
            n_keys = mask.shape[-1]
            y = F.scaled_dot_product_attention(q, kv[0, :, :, :n_keys], kv[1, :, :, :n_keys], attn_mask=mask)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.norm1 = nn.LayerNorm(config.n_embd, bias=False)
        self.attn = Attention(config)
        self.norm2 = nn.LayerNorm(config.n_embd, bias=False)
        self.fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=False)
        self.out = nn.Linear(4 * config.n_embd, config.n_embd, bias=False)

    def forward(self, x, rot, kv=None, where=None, mask=None):
        x = x + self.attn(self.norm1(x), rot, kv, where, mask)
        return x + self.out(F.gelu(self.fc(self.norm2(x)), approximate="tanh"))


class RotaryStack(nn.Module):
    """Transformer blocks plus the bookkeeping shared by the target and the drafter: positions,
    rotary angles, cache writes and the length update."""

    def __init__(self, config, n_layer):
        super().__init__()
        self.config = config
        self.blocks = nn.ModuleList(Block(config) for _ in range(n_layer))
        cos, sin = rope_tables(config.n_embd // config.n_head, config.block_size, config.rope_base, "cpu")
        self.register_buffer("rope_cos", cos.float(), persistent=False)
        self.register_buffer("rope_sin", sin.float(), persistent=False)

    def forward(self, x, cache=None):
        B, T, _ = x.shape
        if cache is None:
            pos = torch.arange(T, device=x.device).expand(B, T)
        else:
            pos = cache.lengths[:, None] + torch.arange(T, device=x.device)  # (B, T)
        # host-device sync: the attention window is the longest row after the append
        n_keys = int(pos[:, -1].max()) + 1
        limit = self.config.block_size if cache is None else min(cache.max_len, self.config.block_size)
        if n_keys > limit:
            raise ValueError(f"position {n_keys - 1} is past the model's {limit} positions")
        rot = torch.complex(self.rope_cos[pos], self.rope_sin[pos])[:, None]  # (B, 1, T, hd/2)
        where = mask = None
        if cache is not None:  # a query at position p sees keys 0..p of its own row, never stale entries past p
            where = (torch.arange(B, device=x.device)[:, None], pos)
            seen = torch.arange(n_keys, device=x.device) <= pos[:, None, :, None]  # (B, 1, T, n_keys)
            mask = torch.zeros(seen.shape, dtype=x.dtype, device=x.device).masked_fill_(~seen, float("-inf"))
        for i, block in enumerate(self.blocks):
            x = block(x, rot, None if cache is None else cache.kv[i], where, mask)
        if cache is not None:
            cache.lengths = cache.lengths + T
        return x


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.stack = RotaryStack(config, config.n_layer)
        self.norm = nn.LayerNorm(config.n_embd, bias=False)
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
        p = self.wte.weight
        return KVCache(self.config, batch_size, max_len or self.config.block_size,
                       device=device or p.device, dtype=dtype or p.dtype)

    def num_params(self):
        return sum(p.numel() for p in self.parameters())
