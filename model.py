"""The target model: a small causal transformer with a preallocated KV cache, one length per row.

GPT.forward(idx, cache=None) returns (logits, hidden), `hidden` the LM head's input, which the
drafter reads. Appending T tokens writes row b at positions lengths[b] .. lengths[b] + T - 1.
Rolling a row back (a rejected draft) is assigning a smaller length: a query at p reads keys <= p.

Simplified on purpose: rotary positions (a gather: each row has its own), LayerNorm without bias,
tanh GELU, a tied LM head, no dropout. Deep and narrow (12 x 48): a CPU step costs its kernel
launches, so one drafter layer is a small share of it, as on a GPU. Under bf16 autocast the weights,
residual stream, norms, rotary multiply and `hidden` stay float32; the cache is in autocast's dtype.

Test: python -m pytest tests/test_model.py
"""
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass
class GPTConfig:
    vocab_size: int = 778   # the run sets the task's (harness.config.model_config)
    block_size: int = 256   # longest prompt + response (+ draft) the model and its cache hold
    n_layer: int = 12
    n_head: int = 4
    n_embd: int = 48
    rope_base: float = 10000.0

    def __post_init__(self):
        if min(self.vocab_size, self.block_size, self.n_layer, self.n_head, self.n_embd) <= 0:
            raise ValueError(f"every size must be positive: {self}")
        if self.n_embd % self.n_head or (self.n_embd // self.n_head) % 2:
            raise ValueError(f"n_embd {self.n_embd} must split into {self.n_head} even heads")


class KVCache:
    """Preallocated keys and values for every layer, with one length per row."""

    def __init__(self, config, batch_size, max_len, device="cpu", dtype=torch.float, n_layer=None):
        n_layer = config.n_layer if n_layer is None else n_layer  # the drafter has its own
        shape = (n_layer, 2, batch_size, config.n_head, max_len, config.n_embd // config.n_head)
        self.kv = torch.zeros(shape, device=device, dtype=dtype)  # k, v side by side: one write
        self.lengths = torch.zeros(batch_size, dtype=torch.long, device=device)
        self.max_len = max_len

    def compact(self, source):
        """Row i becomes old row source[i]. Only rows that change place are copied, in the cache's
        own storage (a fresh copy of every kept row cost the --tlt on step 3-8%)."""
        moved = [i for i, b in enumerate(source) if i != b]
        self.kv[:, :, moved] = self.kv[:, :, [source[i] for i in moved]]  # the right side: a copy
        self.kv, self.lengths = self.kv[:, :, :len(source)], self.lengths[source]


class Attention(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.n_head = config.n_head
        self.qkv = nn.Linear(config.n_embd, 3 * config.n_embd, bias=False)
        self.proj = nn.Linear(config.n_embd, config.n_embd, bias=False)

    def forward(self, x, rot, kv=None, write_at=None, mask=None, past=None):
        B, T, C = x.shape
        qkv = self.qkv(x).view(B, T, 3, self.n_head, C // self.n_head).permute(2, 0, 3, 1, 4)
        # rotary: channel pairs as complex numbers times rot (3, B, 1, T, hd/2), in >= float32
        wide = qkv.dtype if qkv.dtype in (torch.float32, torch.float64) else torch.float32
        pairs = torch.view_as_complex(qkv.to(wide).unflatten(-1, (-1, 2)))  # (3, B, H, T, hd/2)
        qkv = torch.view_as_real(pairs * rot).flatten(-2).to(qkv.dtype)  # (3, B, H, T, hd)
        q, k, v = qkv
        if past is not None:  # the drafter's chained passes; mask (T, passes * T) bool
            past.append(qkv[1:])
            keys = torch.cat(past, dim=3)  # (2, B, H, passes * T, hd): every pass's so far
            y = F.scaled_dot_product_attention(q, keys[0], keys[1], attn_mask=mask)
        elif kv is None:  # plain causal pass, positions 0..T-1
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:  # kv: this layer's (2, B, H, max_len, hd) cache; row b's T entries go at write_at
            kv[:, write_at[0], :, write_at[1]] = qkv[1:].permute(1, 3, 0, 2, 4).to(kv.dtype)
            keys = kv[:, :, :, :mask.shape[-1]]  # (2, B, H, n_keys, hd)
            y = F.scaled_dot_product_attention(q, keys[0], keys[1], attn_mask=mask)
        return self.proj(y.transpose(1, 2).reshape(B, T, C))


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.norm1 = nn.LayerNorm(config.n_embd, bias=False)
        self.attn = Attention(config)
        self.norm2 = nn.LayerNorm(config.n_embd, bias=False)
        self.fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=False)
        self.out = nn.Linear(4 * config.n_embd, config.n_embd, bias=False)

    def forward(self, x, rot, kv=None, write_at=None, mask=None, past=None):
        # x stays in the weights' dtype: an add promotes a branch's bf16 (autocast) to it
        x = x + self.attn(self.norm1(x), rot, kv, write_at, mask, past)
        return x + self.out(F.gelu(self.fc(self.norm2(x)), approximate="tanh"))


class Blocks(nn.Module):
    """The blocks, and what target and drafter share: positions, rotary, cache writes, the mask."""

    def __init__(self, config, n_layer):
        super().__init__()
        self.config = config
        self.blocks = nn.ModuleList(Block(config) for _ in range(n_layer))
        self.register_buffer("rope", self._rope_table("cpu"), persistent=False)

    def _rope_table(self, device):
        """(block_size, 3, hd/2, 2) float32: per position, cos and sin of each channel pair's angle
        for queries and keys, and 1 (+0i) for values; in float64 first (bf16 angles drift)."""
        c, hd = self.config, self.config.n_embd // self.config.n_head
        f64 = dict(device=device, dtype=torch.float64)
        inv_freq = 1.0 / (c.rope_base ** (torch.arange(0, hd, 2, **f64) / hd))
        angles = torch.outer(torch.arange(c.block_size, **f64), inv_freq)  # (L, hd/2)
        turn = torch.stack((angles.cos(), angles.sin()), dim=-1).float()  # (L, hd/2, 2)
        one = torch.tensor([1.0, 0.0], device=device).expand_as(turn)  # 1 + 0i: values stay
        return torch.stack((turn, turn, one), dim=1)

    def forward(self, x, cache=None, past=None, past_mask=None):
        """x (B, T, C) -> (B, T, C). With a cache, row b's tokens follow its cached ones. The
        drafter's chained training passes give `past` (per block, earlier passes' keys, values)."""
        B, T, _ = x.shape
        if cache is None:
            pos = torch.arange(T, device=x.device).expand(B, T)
            n_keys, limit = T, self.config.block_size
        else:
            pos = cache.lengths[:, None] + torch.arange(T, device=x.device)  # (B, T)
            n_keys = int(cache.lengths.max()) + T  # sync: attention reads up to the longest row
            limit = min(cache.max_len, self.config.block_size)
        if n_keys > limit:
            raise ValueError(f"position {n_keys - 1} is past the model's {limit} positions")
        # (3, B, 1, T, hd/2): the rotation of each row's queries, keys and values at its positions
        rot = torch.view_as_complex(self.rope[pos]).permute(2, 0, 1, 3)[:, :, None]
        write_at, mask = None, past_mask
        if cache is not None:  # a query at position p sees keys 0..p of its own row, nothing stale
            write_at = (torch.arange(B, device=x.device)[:, None], pos)  # row b's go at pos[b]
            unseen = torch.arange(n_keys, device=x.device) > pos[:, None, :, None]  # (B,1,T,keys)
            # additive, in the dtype attention runs in: a bool mask is cast in every layer
            dev = x.device.type
            dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype
            mask = unseen.new_zeros(unseen.shape, dtype=dtype).masked_fill_(unseen, float("-inf"))
        past = past if past is not None else [None] * len(self.blocks)
        for i, block in enumerate(self.blocks):
            # block i's cache slice, taken here: taken before block i - 1 writes, it breaks autograd
            kv = None if cache is None else cache.kv[i]
            x = block(x, rot, kv, write_at, mask, past[i])
        if cache is not None:
            cache.lengths = cache.lengths + T
        return x


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)
        self.stack = Blocks(config, config.n_layer)
        self.norm = nn.LayerNorm(config.n_embd, bias=False)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied: the drafter shares both through the target
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, mean=0.0, std=0.02)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight") or name.endswith("out.weight"):  # GPT-2's scaling
                nn.init.normal_(p, mean=0.0, std=0.02 / (2 * config.n_layer) ** 0.5)

    def forward(self, idx, cache=None):
        """idx (B, T) -> logits (B, T, V), hidden (B, T, C); see the module docstring."""
        hidden = self.norm(self.stack(self.wte(idx), cache))  # (B, T, C)
        return self.lm_head(hidden), hidden

    def new_cache(self, batch_size, max_len=None, device=None, dtype=None):
        """A KVCache on the model's device, in the dtype attention runs in (autocast's, if on)."""
        p = self.wte.weight
        device = torch.device(device or p.device)
        autocast = torch.is_autocast_enabled(device.type)
        dtype = dtype or (torch.get_autocast_dtype(device.type) if autocast else p.dtype)
        return KVCache(self.config, batch_size, max_len or self.config.block_size, device, dtype)
