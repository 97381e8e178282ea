"""How a token is chosen, and how drafts are verified: two exact samplers, one per batch.

Both keep what speculative decoding emits distributed exactly as the target's own samples:
- "rejection" (`verify`): draft d_i is kept with probability min(1, p(d_i) / q(d_i)); at the first
  rejection the next token is drawn from normalise(max(p - q, 0)) (Leviathan et al. 2023, Chen et
  al. 2023).
- "gumbel" (`verify_gumbel`), exact-token: the token at position t is argmax(logits / T + g), with
  Gumbel noise g hashed from (row key, t, token id). That is a sample of softmax(logits / T)
  fixed by where the token is, so plain and speculative decoding, any batch order and any rank
  emit the same tokens. A draft is accepted iff it equals the target's noisy argmax at its position.

A RunningBatch (speculative.py) holds one sampler object, chosen once, and every step and every
drafter calls its `choose` and `verify`: no step branches on the rule.

Test: python -m pytest tests/test_speculative.py
"""
import functools
from collections import defaultdict
from dataclasses import dataclass

import torch
import torch.nn.functional as F

SAMPLERS = ("gumbel", "rejection")
MASK32 = 0xFFFFFFFF


def probs(logits, temperature):
    """(..., V) logits -> (..., V) float32 probabilities; temperature 0 gives one-hot argmax."""
    if temperature == 0:
        one = logits.argmax(-1, keepdim=True)
        return torch.zeros_like(logits, dtype=torch.float32).scatter_(-1, one, 1.0)
    return F.softmax(logits.float() if temperature == 1 else logits.float() / temperature, dim=-1)


def draw(p, generator=None):
    """(B, V) non-negative weights -> (B,) one draw per row, by an exponential race: E_v / p_v is
    exponential with rate p_v, and the smallest is v's with probability p_v / sum(p). The same
    kernels on every device, and a zero-weight token never wins."""
    e = torch.empty_like(p, dtype=torch.float32).exponential_(generator=generator)  # (B, V)
    return (p / e.clamp_(min=torch.finfo(torch.float32).tiny)).argmax(dim=-1)


# -----------------------------------------------------------------------------
# exact-token noise: a pure function of (row key, position, token id)

def _mix32_(x):
    """Wellons' 32-bit "lowbias32" hash, in place, on int64 holding 32-bit values (no product
    overflows 2^63)."""
    s = torch.empty_like(x)
    x ^= torch.bitwise_right_shift(x, 16, out=s)
    x.mul_(0x7FEB352D).bitwise_and_(MASK32)
    x ^= torch.bitwise_right_shift(x, 15, out=s)
    x.mul_(-0x7B935975).bitwise_and_(MASK32)  # times 0x846CA68B mod 2^32
    x ^= torch.bitwise_right_shift(x, 16, out=s)
    return x


@functools.lru_cache(maxsize=8)
def _token_hashes(vocab_size, device):
    return _mix32_(torch.arange(vocab_size, device=device) + 0x9E3779B9)  # (V,), distinct


def gumbel_seeds(keys, positions):
    """keys (B,) int64 >= 0, positions (B, T) -> (B, T) 32-bit seeds: the position's hash, then the
    key's low and high halves mixed in, one round each. Every bit of the 64-bit key reaches every
    seed, and rows a few positions apart never share a shifted stream."""
    seed = _mix32_(positions + 0x632BE5AB)  # (B, T)
    seed = _mix32_(seed ^ (keys & MASK32)[:, None])
    return _mix32_(seed ^ (keys >> 32)[:, None])


def gumbel_noise(seeds, vocab_size):
    """seeds (...) -> (..., V) float32 Gumbel(0, 1) noise, one value per token id: each seed hashed
    with the token's hash, the top 23 bits a uniform in (0, 1), then -log(-log(u))."""
    bits = seeds[..., None] ^ _token_hashes(vocab_size, seeds.device)  # (..., V)
    _mix32_(bits)
    u = bits.bitwise_right_shift_(9).float().add_(0.5).mul_(2.0 ** -23)  # never 0 or 1
    return u.log_().neg_().log_().neg_()


# noise values one pass makes at most: a CPU's pass stays in its caches, a GPU's is bound by memory
NOISE_ELEMENTS = defaultdict(lambda: 2 ** 24, cpu=2 ** 20)


def gumbel_choose(logits, temperature, seeds, noise=None, max_elements=None):
    """logits (B, T, V) at the positions whose seeds are (B, T) -> tokens (B, T), the argmax of
    logits / T + noise in float32 (temperature 0: plain argmax). `noise`: made already by the
    caller; else made here over the whole vocabulary, a bounded number of rows per pass."""
    if temperature == 0:
        return logits.argmax(-1)
    x = logits.float() if temperature == 1 else logits.float() / temperature
    if noise is not None:
        return (x + noise).argmax(-1)
    x, s = x.flatten(0, -2), seeds.reshape(-1)  # (R, V), (R,): every position a row
    rows = max(1, (max_elements or NOISE_ELEMENTS[x.device.type]) // x.shape[1])  # rows per pass
    picks = [gumbel_noise(s[r:r + rows], x.shape[1]).add_(x[r:r + rows]).argmax(-1)
             for r in range(0, s.shape[0], rows)]
    return (picks[0] if len(picks) == 1 else torch.cat(picks)).view(seeds.shape)


# -----------------------------------------------------------------------------
# the verify rules

def verify(draft_tokens, q, p, generator=None):
    """Exact rejection sampling. draft_tokens (B, k) drawn from q (B, k, V); p (B, k+1, V) the
    target's distributions. -> n_accepted (B,), each row's accepted prefix, and next_token (B,):
    from the residual max(p - q, 0) at the first rejection, or from p[:, k] when all k pass."""
    B, k = draft_tokens.shape
    p_d = p[:, :k].gather(-1, draft_tokens[..., None]).squeeze(-1)  # (B, k)
    q_d = q.gather(-1, draft_tokens[..., None]).squeeze(-1)  # (B, k)
    u = torch.rand(B, k, generator=generator, device=p.device)
    accept = u * q_d < p_d  # u < p / q without dividing; p >= q always accepts
    n_accepted = accept.cummin(dim=1).values.sum(dim=1)  # (B,)
    # at n_accepted == k, q is zero there, so the residual is p[:, k]
    q_pad = torch.cat([q, q.new_zeros(B, 1, q.shape[-1])], dim=1)  # (B, k+1, V)
    at = n_accepted[:, None, None].expand(B, 1, p.shape[-1])
    p_at = p.gather(1, at).squeeze(1)  # (B, V)
    residual = (p_at - q_pad.gather(1, at).squeeze(1)).clamp(min=0)  # draw() normalises
    # all zero only where p == q, which rejects with probability 0: a guard against rounding
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_at)
    return n_accepted, draw(residual, generator)


def verify_gumbel(draft_tokens, target_tokens):
    """draft_tokens (B, k), target_tokens (B, k+1), the target's noisy argmax at the same positions
    and one more -> n_accepted (B,): drafts up to the first that differs; the row then emits
    target_tokens[b, :n_accepted[b] + 1], exactly what plain decoding would have."""
    k = draft_tokens.shape[1]
    return (draft_tokens == target_tokens[:, :k]).cummin(dim=1).values.sum(dim=1)  # (B,)


@dataclass
class Sampling:
    """How a batch picks its tokens: the generate functions and the rollout take these by name."""
    temperature: float = 1.0
    eos_id: int = None
    sampler: str = "rejection"  # or "gumbel"
    keys: list = None  # "gumbel": one int64 >= 0 per row (None: random, from the generator)
    generator: torch.Generator = None

    def new_sampler(self, batch_size, width, vocab_size, device):
        """The batch's one sampler, chosen here, once, for rows of up to `width` positions."""
        if self.sampler not in SAMPLERS:
            raise ValueError(f"sampler must be one of {SAMPLERS}, got {self.sampler!r}")
        if self.keys is not None and (len(self.keys) != batch_size or min(self.keys) < 0):
            raise ValueError(f"keys must be {batch_size} non-negative integers, one per prompt")
        if self.sampler == "rejection":
            return RejectionSampler(self.temperature, self.generator)
        if self.keys is None:
            keys = torch.arange(batch_size, device=device) + torch.randint(
                2 ** 62, (1,), generator=self.generator, device=device)
        else:
            keys = torch.as_tensor(self.keys, dtype=torch.long, device=device)
        return GumbelSampler(self.temperature, keys, width, vocab_size)


class RejectionSampler:
    """Tokens drawn from softmax(logits / T) with the batch's generator; `verify` verifies."""

    def __init__(self, temperature, generator):
        self.temperature, self.generator = temperature, generator

    def start_step(self, positions):
        pass  # nothing is fixed by position

    def compact(self, n, slots, rows):
        pass  # no per-row state

    def choose(self, logits, at=slice(None)):
        """logits (B, T, V) -> tokens (B, T) and their distributions (B, T, V)."""
        p = probs(logits, self.temperature)
        return draw(p.flatten(0, 1), self.generator).view(p.shape[:-1]), p

    def verify(self, draft, q, logits):
        """-> n_acc (B,) and the step's tokens (B, k+1), of which row b keeps n_acc[b] + 1."""
        if q is None:  # deterministic proposals: a one-hot q
            q = torch.zeros(*draft.shape, logits.shape[-1], device=draft.device)
            q.scatter_(-1, draft[..., None], 1.0)  # (B, k, V)
        n_acc, nxt = verify(draft, q, probs(logits, self.temperature), self.generator)
        out = torch.cat([draft, nxt[:, None]], 1)
        return n_acc, out.scatter_(1, n_acc[:, None], nxt[:, None])  # accepted drafts, then nxt


class GumbelSampler:
    """Exact-token sampling: every row's noise seed at every position is hashed once per batch."""

    def __init__(self, temperature, keys, width, vocab_size):
        positions = torch.arange(width, device=keys.device).expand(keys.shape[0], width)
        self.seeds = gumbel_seeds(keys, positions)  # (B, width)
        self.temperature, self.vocab_size = temperature, vocab_size

    def start_step(self, positions):
        """This step picks tokens at positions (B, T): keep their seeds and, where the noise of a
        speculative step fits one pass, make it once for the drafts and the verify pass."""
        self.step_seeds = self.noise = None
        if self.temperature > 0:
            self.step_seeds = self.seeds.gather(1, positions)  # (B, T)
            fits = positions.numel() * self.vocab_size <= NOISE_ELEMENTS[positions.device.type]
            if positions.shape[1] > 1 and fits:
                self.noise = gumbel_noise(self.step_seeds, self.vocab_size)  # (B, T, V)

    def compact(self, n, slots, rows):
        self.seeds[slots] = self.seeds[rows]  # as the batch's rows move
        self.seeds = self.seeds[:n]

    def choose(self, logits, at=slice(None)):
        """logits (B, T, V) at the step's positions [:, at] -> tokens (B, T), and None for q."""
        if self.temperature == 0:
            return logits.argmax(-1), None
        noise = None if self.noise is None else self.noise[:, at]
        return gumbel_choose(logits, self.temperature, self.step_seeds[:, at], noise), None

    def verify(self, draft, q, logits):
        out, _ = self.choose(logits)  # the target's own tokens: up to a mismatch, the drafts
        return verify_gumbel(draft, out), out
