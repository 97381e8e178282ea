"""Lossless speculative decoding, batched, in plain PyTorch.

One speculative step, for every running row at once:

1. draft: the drafter proposes k tokens (`drafter.propose(batch, k, noise)`, the one method every
   drafter offers) and, for rejection sampling, their distributions q;
2. verify: the target reads [pending token, d_1 .. d_k] in one forward pass (k + 1 positions);
3. accept: each row keeps its own number of drafts (ragged acceptance) and one target token after
   them. Rolling the rejected drafts back is assigning the cache lengths.

In reading order: the running batch and its two steps; the decoding loop (`decode`); exact-token
sampling (train.py's default), its noise, and `Sampling` (a batch's sampler, from the flags); then,
beside that, the reference rule and the generate functions for the evaluation, bench and tests.

The batch's sampler, chosen once per batch, picks every token and verifies the drafts, so no step
branches on the rule. Both rules keep the emitted tokens distributed exactly as the target's own:
- "rejection" (`verify`): draft d_i is kept with probability min(1, p(d_i) / q(d_i)); at the first
  rejection the next token comes from normalise(max(p - q, 0)) (Leviathan et al.; Chen et al. 2023).
- "gumbel" (`verify_gumbel`), exact-token: the token at position t is argmax(logits / T + g), with
  Gumbel noise g hashed from (row key, t, token id): a sample of softmax(logits / T) fixed by where
  the token is. The verify pass computes the target's own token at every drafted position, and a row
  emits those up to and including the first that differs from its draft (none differing: all k + 1).
  The tokens are the target's, so plain and speculative decoding, in any batch order and on any
  rank, emit the same ones (where passes of different widths round alike: a near-tie can flip). The
  drafter draws its drafts with the same noise, which only raises acceptance: a drafter that has
  learned the target's distribution at a choice draws the target's sample there.

Test: python -m pytest tests/test_speculative.py tests/test_verify.py
"""
import functools
import time
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F


class FinishedRow(NamedTuple):  # a row that left the running batch
    response: list  # generated ids (ending with <|eos|> when it stopped on one)
    tokens: torch.Tensor  # (N,) prompt + response
    hidden: torch.Tensor  # (N - 1, C): hidden[j], the target's final state after reading tokens[j]
    prompt_len: int


class RunningBatch:
    """The running rows of one generate or rollout call.

    Row b is prompt ids[b]. It holds tokens[b, :n_tokens[b]], prompt then response; its last token
    is *pending*: sampled but not yet read by the target, so the target's cache holds n_tokens - 1
    positions. hidden[b, j] is the target's state after reading tokens[b, j]. When a row finishes
    it leaves every tensor and cache (`compact`), so each step's work shrinks, and its FinishedRow
    goes to results[ids[b]].

    A drafter's contract with the batch: `propose` reads tokens, hidden, n_tokens and the target's
    cache's size and dtype (and ids, prompts and results), draws its drafts with the batch's
    `sampler` (under "rejection", from its generator) and the step's noise, and writes only
    `draft_cache`, its own per-row state, which `compact` keeps in step with the rows."""

    def __init__(self, target, prompts, max_new_tokens, *, max_draft=0, **sampling):
        sampling = Sampling(**sampling)
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("prompts must be a non-empty list of non-empty token lists")
        if max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be positive, got {max_new_tokens}")
        longest_prompt = max(len(p) for p in prompts)
        need = longest_prompt + max_new_tokens + max_draft  # a verify pass writes k past the end
        if need > target.config.block_size:
            raise ValueError(f"prompt ({longest_prompt}) + max_new_tokens ({max_new_tokens}) + "
                             f"draft ({max_draft}) = {need} exceeds block_size "
                             f"{target.config.block_size}")
        dev, B = target.wte.weight.device, len(prompts)
        self.target, self.eos_id, self.prompts = target, sampling.eos_id, prompts
        self.ids, self.results = list(range(B)), [None] * B
        self.tokens = torch.tensor([p + [0] * (need + 1 - len(p)) for p in prompts], device=dev)
        self.hidden = torch.zeros(B, need + 1, target.config.n_embd, device=dev,
                                  dtype=target.wte.weight.dtype)  # (B, need + 1, C)
        self.sampler = sampling.new_sampler(B, target.config.vocab_size, need + 1, dev)
        self.cache = target.new_cache(B, max_len=need)
        self.draft_cache = None  # the drafter's, made at its first proposal
        # prefill: each distinct prompt once (a GRPO group repeats it) in one padded pass, copied to
        # the rows that share it (for speed)
        distinct = {}  # a prompt -> its place among the distinct ones
        distinct_id = [distinct.setdefault(tuple(p), len(distinct)) for p in prompts]  # per row
        first = [distinct_id.index(u) for u in range(len(distinct))]  # a row of each
        prompt_cache = target.new_cache(len(distinct), max_len=longest_prompt)
        logits, hidden = target(self.tokens[first, :longest_prompt], prompt_cache)
        self.cache.kv[..., :longest_prompt, :] = prompt_cache.kv[:, :, distinct_id]
        logits, self.hidden[:, :longest_prompt] = logits[distinct_id], hidden[distinct_id]
        prompt_len = torch.tensor([len(p) for p in prompts], device=dev)  # (B,)
        self.cache.lengths = prompt_len
        self.n_tokens, self.end = prompt_len.clone(), prompt_len + max_new_tokens  # (B,), (B,)
        self.done = torch.zeros(B, dtype=torch.bool, device=dev)
        last = logits[torch.arange(B, device=dev), prompt_len - 1][:, None]  # (B, 1, V)
        self._append(self.sampler.choose(last, self.sampler.noise(prompt_len[:, None]))[0])

    @property
    def batch_size(self):
        return self.n_tokens.shape[0]

    def _append(self, new, n_new=None):
        """Write new (B, W) tokens after each row's end -> tokens kept per row (B,): row b keeps its
        first n_new[b] (default all), cut after an <|eos|> and at max_new_tokens (then done)."""
        W = new.shape[1]
        # writes past what is kept land beyond the row's end, where nothing reads them
        at = self.n_tokens[:, None] + torch.arange(W, device=new.device)  # (B, W)
        self.tokens.scatter_(1, at, new)
        budget = self.end - self.n_tokens  # (B,)
        n_kept = budget.clamp(max=W) if n_new is None else torch.minimum(n_new, budget)
        if self.eos_id is not None:
            # "not eos" after cummin is 1 only before the first <|eos|>: its sum counts those
            n_before_eos = (new != self.eos_id).cummin(1).values.sum(1)  # (B,)
            self.done |= n_before_eos < n_kept  # the <|eos|> is among the kept tokens
            n_kept = torch.minimum(n_kept, n_before_eos + 1)
        self.n_tokens = self.n_tokens + n_kept
        self.done |= self.n_tokens >= self.end
        return n_kept

    @torch.no_grad()
    def plain_step(self):
        """One token for every running row. Returns the tokens emitted per row (B,)."""
        pending_at = self.n_tokens - 1  # (B,) the pending token's position: the cache's length
        pending = self.tokens.gather(1, pending_at[:, None])  # (B, 1)
        logits, hidden = self.target(pending, self.cache)  # (B, 1, .)
        self.hidden[torch.arange(self.batch_size, device=pending.device), pending_at] = hidden[:, 0]
        noise = self.sampler.noise(self.n_tokens[:, None])  # at the new token's position
        return self._append(self.sampler.choose(logits, noise)[0])

    @torch.no_grad()
    def speculative_step(self, drafter, k):
        """Draft k a row, verify in one target pass, keep a ragged number -> (emitted, accepted)."""
        pending_at = self.n_tokens - 1  # (B,) the pending token's position: the cache's length
        positions = self.n_tokens[:, None] + torch.arange(k + 1, device=pending_at.device)
        # one noise for the step: draft i and the target at position i read the same (gumbel)
        noise = self.sampler.noise(positions)  # (B, k+1, V), or None
        # 1. draft: k tokens per row, at positions[:, :k], and q (B, k, V) or None (deterministic)
        draft, q = drafter.propose(self, k, noise)  # (B, k)
        # 2. verify: the target reads the pending token and the k drafts in one pass
        pending = self.tokens.gather(1, pending_at[:, None])  # (B, 1)
        logits, hidden = self.target(torch.cat([pending, draft], 1), self.cache)  # (B, k+1, .)
        b = torch.arange(self.batch_size, device=pending_at.device)[:, None]  # (B, 1)
        self.hidden[b, positions - 1] = hidden  # the rejected drafts' states: never read
        # 3. accept: row b keeps its first n_acc[b] drafts and one token of the target's
        n_acc, out = self.sampler.verify(draft, q, logits, noise)  # (B,), (B, k+1)
        n_emitted = self._append(out, n_acc + 1)
        self.cache.lengths = self.n_tokens - 1  # roll the rejected drafts back
        return n_emitted, n_acc

    def compact(self):
        """Finished rows to `results` and out of every tensor and cache -> rows still running."""
        done, n_tokens = torch.stack((self.done, self.n_tokens)).tolist()  # sync: the step's read
        n = len(done) - sum(done)  # rows still running
        if n == len(done):
            return n
        for b in (b for b in range(len(done)) if done[b]):
            prompt_len, end = len(self.prompts[self.ids[b]]), n_tokens[b]
            self.results[self.ids[b]] = FinishedRow(self.tokens[b, prompt_len:end].tolist(),
                                                    self.tokens[b, :end].clone(),
                                                    self.hidden[b, :end - 1].clone(), prompt_len)
        # the last running rows take the places finished ones leave among the first n, so the
        # caches copy only those rows (for speed; KVCache.compact)
        movers = iter([b for b in range(n, len(done)) if not done[b]])
        source = [next(movers) if done[b] else b for b in range(n)]  # row i was row source[i]
        self.ids = [self.ids[b] for b in source]
        for name in ("tokens", "hidden", "n_tokens", "end", "done"):  # t = t[source], per tensor
            setattr(self, name, getattr(self, name)[source])
        for per_row in (self.cache, self.draft_cache, self.sampler):
            if per_row is not None:
                per_row.compact(source)
        return n


class DecodeStep(NamedTuple):  # one decoding step, as `decode` tells an observer of it
    batch_size: int  # running rows before the step
    k: int  # drafts per row; 0: a plain step
    n_emitted: torch.Tensor  # (batch_size,) tokens each row kept
    n_accepted: torch.Tensor  # (batch_size,) drafts each row accepted; None for a plain step


@torch.no_grad()
def decode(batch, policy, drafter=None, observer=None):
    """Run a RunningBatch until every row has finished -> its results (a FinishedRow per prompt).
    Each step policy.choose(rows) gives k (0: a plain step) and policy.update(rows, k, tokens,
    seconds) hears how it went; observer(batch, step) runs after the prefill and every step."""
    running = batch.compact()  # a row can end on its first token
    if observer:
        observer(batch, None)
    while running:
        B, t0 = batch.batch_size, time.perf_counter()
        k = policy.choose(B)
        n_emitted, n_acc = batch.speculative_step(drafter, k) if k else (batch.plain_step(), None)
        running = batch.compact()  # which rows finished; the read waits for the step's kernels
        policy.update(B, k, int(n_emitted.sum()), time.perf_counter() - t0)
        if observer:
            observer(batch, DecodeStep(B, k, n_emitted, n_acc))
    return batch.results


# -----------------------------------------------------------------------------
# exact-token sampling (the default): the target's own tokens, whatever drafted them

class GumbelSampler:
    """Exact-token sampling: a row's token at t is argmax(logits / T + noise(row key, t, token))."""

    def __init__(self, temperature, keys, vocab_size, width):
        positions = torch.arange(width, device=keys.device).expand(keys.shape[0], width)
        self.seeds = gumbel_seeds(keys, positions)  # (B, width): hashed once a batch, not a step
        self.temperature, self.vocab_size = temperature, vocab_size

    def compact(self, source):
        self.seeds = self.seeds[source]

    def noise(self, positions):
        """The noise at positions (B, T) -> (B, T, V), or None at temperature 0 (plain argmax)."""
        if self.temperature == 0:
            return None
        return gumbel_noise(self.seeds.gather(1, positions), self.vocab_size)

    def choose(self, logits, noise):
        """logits (B, T, V) and their positions' noise -> tokens (B, T), and None for q."""
        if noise is None:
            return logits.argmax(-1), None
        return (logits.float() / self.temperature + noise).argmax(-1), None

    def verify(self, draft, q, logits, noise):
        out, _ = self.choose(logits, noise)  # the target's tokens: up to a mismatch, the drafts
        return verify_gumbel(draft, out), out


def verify_gumbel(draft_tokens, target_tokens):
    """draft_tokens (B, k), target_tokens (B, k+1), the target's noisy argmax at the same positions
    and one more -> n_accepted (B,): drafts up to the first that differs; the row then emits
    target_tokens[b, :n_accepted[b] + 1], exactly what plain decoding would have."""
    k = draft_tokens.shape[1]
    return (draft_tokens == target_tokens[:, :k]).cummin(dim=1).values.sum(dim=1)  # (B,)


MASK32 = 0xFFFFFFFF


def mix32(x):  # Wellons' 32-bit "lowbias32" hash, on int64 tensors holding 32-bit values
    x = x ^ (x >> 16)
    x = (x * 0x7FEB352D) & MASK32
    x = x ^ (x >> 15)
    x = (x * -0x7B935975) & MASK32  # times 0x846CA68B mod 2^32, with no product past 2^63
    return x ^ (x >> 16)


def gumbel_seeds(keys, positions):
    """keys (B,) int64 >= 0, positions (B, T) -> (B, T) 32-bit seeds: the position's hash, then the
    key's low and high halves mixed in, one round each. Every bit of the key (an int64 >= 0: 63
    bits) reaches every seed, and rows a few positions apart never share a shifted stream."""
    seed = mix32(positions + 0x632BE5AB)  # (B, T)
    seed = mix32(seed ^ (keys & MASK32)[:, None])
    return mix32(seed ^ (keys >> 32)[:, None])


@functools.lru_cache(maxsize=8)  # made once, not every step (for speed)
def token_hashes(vocab_size, device):
    return mix32(torch.arange(vocab_size, device=device) + 0x9E3779B9)  # (V,)


def gumbel_noise(seeds, vocab_size):
    """seeds (...) -> (..., V) float32 Gumbel(0, 1) noise, one value per token id: each seed hashed
    with the token's hash, the top 23 bits a uniform in (0, 1), then -log(-log(u))."""
    bits = mix32(seeds[..., None] ^ token_hashes(vocab_size, seeds.device))  # (..., V)
    u = ((bits >> 9).float() + 0.5) * 2.0 ** -23  # never 0 or 1
    return -torch.log(-torch.log(u))


SAMPLERS = ("gumbel", "rejection")  # the default above, or the reference rule below


@dataclass
class Sampling:
    """How a batch picks its tokens: the generate functions and the rollout take these by name."""
    temperature: float = 1.0
    eos_id: int = None
    sampler: str = "rejection"  # or "gumbel"
    keys: list = None  # "gumbel": one int64 >= 0 per row (None: random, from the generator)
    generator: torch.Generator = None

    def new_sampler(self, batch_size, vocab_size, width, device):
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
        return GumbelSampler(self.temperature, keys, vocab_size, width)


# -----------------------------------------------------------------------------
# beside the default step: the reference rule (rejection sampling), the generate functions

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


class RejectionSampler:
    """Tokens drawn from softmax(logits / T) with the batch's generator; `verify` verifies."""

    def __init__(self, temperature, generator):
        self.temperature, self.generator = temperature, generator

    def compact(self, source):
        pass  # no per-row state

    def noise(self, positions):
        return None  # draws from the generator instead

    def choose(self, logits, noise):
        """logits (B, T, V) -> tokens (B, T) and their distributions (B, T, V)."""
        p = probs(logits, self.temperature)
        return draw(p.flatten(0, 1), self.generator).view(p.shape[:-1]), p

    def verify(self, draft, q, logits, noise):
        """-> n_acc (B,) and the step's tokens (B, k+1), of which row b keeps n_acc[b] + 1."""
        if q is None:  # deterministic proposals: a one-hot q
            q = torch.zeros(*draft.shape, logits.shape[-1], device=draft.device)
            q.scatter_(-1, draft[..., None], 1.0)  # (B, k, V)
        n_acc, nxt = verify(draft, q, probs(logits, self.temperature), self.generator)
        out = torch.cat([draft, nxt[:, None]], 1)
        return n_acc, out.scatter_(1, n_acc[:, None], nxt[:, None])  # accepted drafts, then nxt


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


class FixedK:
    """`decode`'s k at every step (0: plain decoding); it counts tokens per row per step."""

    def __init__(self, k):
        self.k, self.tokens, self.row_steps = k, 0, 0

    def choose(self, batch_size):
        return self.k

    def update(self, batch_size, k, tokens, seconds):
        self.tokens, self.row_steps = self.tokens + tokens, self.row_steps + batch_size


def autoregressive_generate(target, prompts, max_new_tokens, *, observer=None, **sampling):
    """Plain decoding, one token per row per target pass; finished rows leave the batch.
    `sampling` takes `Sampling`'s fields by name; for `observer` see `decode`."""
    results = decode(RunningBatch(target, prompts, max_new_tokens, **sampling), FixedK(0),
                     observer=observer)
    return [r.response for r in results], {"accept_len": None}


def speculative_generate(target, drafter, prompts, max_new_tokens, *, k=4, observer=None,
                         **sampling):
    """Speculative decoding with the same k for every row and step. With sampler "gumbel" and the
    same keys it emits exactly autoregressive_generate's tokens."""
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    policy = FixedK(k)
    batch = RunningBatch(target, prompts, max_new_tokens, max_draft=k, **sampling)
    results = decode(batch, policy, drafter, observer)
    accept_len = policy.tokens / policy.row_steps if policy.row_steps else None
    return [r.response for r in results], {"accept_len": accept_len}
