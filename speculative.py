"""Lossless speculative decoding, batched, in plain PyTorch.

One speculative step, for every running row at once:

1. draft: the drafter proposes k tokens (`drafter.propose(batch, k)`, the one method every drafter
   offers) and, for rejection sampling, their distributions q;
2. verify: the target reads [pending token, d_1 .. d_k] in one forward pass (k + 1 positions);
3. accept: each row keeps its own number of drafts (ragged acceptance) and one target token after
   them. Rolling the rejected drafts back is assigning the cache lengths.

The batch's sampler, chosen once per batch, picks every token and verifies the drafts, so no step
branches on the rule. Both rules keep the emitted tokens distributed exactly as the target's own:
- "rejection" (`verify`): draft d_i is kept with probability min(1, p(d_i) / q(d_i)); at the first
  rejection the next token comes from normalise(max(p - q, 0)) (Leviathan et al.; Chen et al. 2023).
- "gumbel" (`verify_gumbel`), exact-token: the token at position t is argmax(logits / T + g), with
  Gumbel noise g hashed from (row key, t, token id): a sample of softmax(logits / T) fixed by where
  the token is. A draft is accepted iff it equals the target's noisy argmax there. So plain and
  speculative decoding, in any batch order and on any rank, emit the same tokens wherever their
  passes of different widths round alike; where they do not (bf16 often, float32 rarely), a
  near-tie can go the other way.

`RunningBatch` holds the running rows. Finished rows leave it (`compact`), so the batch really
shrinks. The host keeps bounds instead of reading the device, so a step reads it once, in `compact`.

Test: python -m pytest tests/test_speculative.py
"""
import functools
from collections import defaultdict
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F


class FinishedRow(NamedTuple):
    """A row that left the running batch."""
    response: list  # generated ids (ending with <|eos|> when it stopped on one); read by `results`
    tokens: torch.Tensor  # (N,) prompt + response
    hidden: torch.Tensor  # (N - 1, C): hidden[j], the target's final state after reading tokens[j]
    prompt_len: int


class RunningBatch:
    """The running rows of one generate or rollout call.

    Row b holds tokens[b, :n_tokens[b]], prompt then response. Its last token is *pending*: sampled
    but not yet read by the target, so the target's cache holds n_tokens - 1 positions. hidden[b, j]
    is the target's state after reading tokens[b, j]. A *slot* is a place in the batch's tensors, a
    *row* a prompt's place in `prompts`. A row keeps its slot until compaction moves it;
    `row_of_slot` (`device_row_of_slot` on the device) says which row each slot holds."""

    def __init__(self, target, prompts, max_new_tokens, *, max_draft=0, **sampling):
        s = Sampling(**sampling)
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
        dev, B, width = target.wte.weight.device, len(prompts), need + 1
        self.target, self.eos_id, self.prompts = target, s.eos_id, prompts
        self.row_of_slot, self.prompt_lens = list(range(B)), [len(p) for p in prompts]  # host only
        self.max_row_tokens = longest_prompt + max_new_tokens  # no row grows past it
        self.n_generated, self._n_tokens_live = 0, sum(self.prompt_lens)  # see `compact`
        # Upper bounds kept on the host, so a step sizes its passes without a device read (on a GPU
        # each stalls the launch queue): on every n_tokens, and on the drafter's unread states.
        self.longest_row_bound, self.drafter_lag_bound = longest_prompt + 1, None
        self.tokens = torch.tensor([p + [0] * (width - len(p)) for p in prompts], device=dev)
        self.hidden = torch.zeros(B, width, target.config.n_embd, device=dev,
                                  dtype=target.wte.weight.dtype)  # (B, width, C)
        self.device_row_of_slot = torch.arange(B, device=dev)  # the device's `row_of_slot`
        self.sampler = s.new_sampler(B, width, target.config.vocab_size, dev)
        self.cache = target.new_cache(B, max_len=need)
        self.draft_cache = None  # a learned drafter's, once it drafts
        self.finished, self._unread_responses = [None] * B, []  # see `results`
        self._prefill(longest_prompt, max_new_tokens)

    def _prefill(self, longest_prompt, max_new_tokens):
        """Prefill each distinct prompt once, in one padded pass, and copy its cache entries to the
        rows that share it. A GRPO group repeats its prompt G times, so this saves G - 1 of every G
        prefill rows. Then each row samples its first token."""
        dev = self.tokens.device
        distinct = {}  # prompt -> its index among the U distinct prompts
        self.group = [distinct.setdefault(tuple(p), len(distinct)) for p in self.prompts]  # by row
        first_rows = torch.tensor([self.group.index(u) for u in range(len(distinct))], device=dev)
        group_of_row = torch.tensor(self.group, device=dev)  # (B,)
        prompt_len = torch.tensor(self.prompt_lens, device=dev)  # (B,)
        prompt_cache = self.target.new_cache(len(distinct), max_len=longest_prompt)
        prompt_cache.keys_to_read = longest_prompt
        logits, hidden = self.target(self.tokens[first_rows, :longest_prompt], prompt_cache)
        self.cache.kv[..., :longest_prompt, :] = prompt_cache.kv[:, :, group_of_row]
        self.cache.lengths = prompt_len  # the padding's entries are never read
        self.hidden[:, :longest_prompt] = hidden[group_of_row]
        self.end = prompt_len + max_new_tokens  # (B,) a row is done at this many tokens
        self.n_tokens = prompt_len.clone()
        self.done = torch.zeros(len(self.prompts), dtype=torch.bool, device=dev)
        self.sampler.start_step(prompt_len[:, None])
        first, _ = self.sampler.choose(logits[group_of_row, prompt_len - 1][:, None])  # (B, 1)
        self._append(first)

    @property
    def batch_size(self):
        return self.device_row_of_slot.shape[0]

    def _append(self, new, n_new=None):
        """Write new (B, W) tokens after each row's end; row b keeps its first n_new[b] (default
        all). A row is cut after its first kept <|eos|> and at max_new_tokens, and marked done.
        Returns the tokens kept per row (B,)."""
        W = new.shape[1]
        # writes past what is kept land beyond the row's end, where nothing reads them
        self.tokens.scatter_(1, self.n_tokens[:, None] + self.cache.position_ids[:W], new)
        budget = self.end - self.n_tokens  # (B,)
        n_kept = budget.clamp_(max=W) if n_new is None else torch.minimum(n_new, budget)
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
        L = self.n_tokens - 1  # (B,) the target cache's length; tokens[L] is pending
        self.cache.keys_to_read = self.longest_row_bound  # the longest row after the append
        logits, hidden = self.target(self.tokens.gather(1, L[:, None]), self.cache)  # (B, 1, .)
        self.hidden[self.cache.slot_ids, L] = hidden[:, 0]
        self.sampler.start_step(self.n_tokens[:, None])
        nxt, _ = self.sampler.choose(logits)  # (B, 1)
        self.longest_row_bound = min(self.longest_row_bound + 1, self.max_row_tokens)
        if self.drafter_lag_bound is not None:
            self.drafter_lag_bound += 1
        return self._append(nxt)

    @torch.no_grad()
    def speculative_step(self, drafter, k):
        """Draft k tokens per row, verify them in one target pass, keep a ragged number per row.
        Returns (tokens emitted per row, drafts accepted per row)."""
        L = self.n_tokens - 1  # (B,) the target cache's length; tokens[L] is pending
        positions = self.n_tokens[:, None] + self.cache.position_ids[:k + 1]  # (B, k+1)
        self.sampler.start_step(positions)
        # 1. draft: k tokens per row, and q (B, k, V) or None (deterministic proposals)
        draft, q = drafter.propose(self, k)  # (B, k)
        # 2. verify: the target reads the pending token and the k drafts in one pass
        self.cache.keys_to_read = self.longest_row_bound + k
        pending = self.tokens.gather(1, L[:, None])  # (B, 1)
        logits, hidden = self.target(torch.cat([pending, draft], 1), self.cache)  # (B, k+1, .)
        self.hidden[self.cache.slot_ids[:, None], positions - 1] = hidden  # rejected: never read
        # 3. accept: row b keeps its first n_acc[b] drafts and one token of the target's
        n_acc, out = self.sampler.verify(draft, q, logits)  # (B,), (B, k+1)
        n_emitted = self._append(out, n_acc + 1)
        self.cache.lengths = self.n_tokens - 1  # roll the rejected drafts back
        self.longest_row_bound = min(self.longest_row_bound + k + 1, self.max_row_tokens)
        if self.drafter_lag_bound is not None:  # whoever drafted, the learned drafter has not
            self.drafter_lag_bound += k + 1  # read these states
        return n_emitted, n_acc

    def compact(self):
        """Move finished rows to `finished` and out of every tensor and cache. Returns the number of
        rows still running; adds the tokens written since the last compact to `n_generated`. Only
        the live rows past the new end move, into the holes finished rows leave before it: that
        saves copying every live row's tensors and cache each time a row finishes."""
        B = self.batch_size
        if B == 0:
            return 0
        # sync: the step's one read: which rows finished, with every row's length
        done, n_tokens = torch.stack((self.done, self.n_tokens)).tolist()
        live = [b for b in range(B) if not done[b]]
        self.n_generated += sum(n_tokens) - self._n_tokens_live
        self._n_tokens_live = sum(n_tokens[b] for b in live)
        self.longest_row_bound, n = max((n_tokens[b] for b in live), default=0), len(live)
        if n == B:
            return B
        for b in (b for b in range(B) if done[b]):  # responses are read later, together
            row = self.row_of_slot[b]
            self.finished[row] = FinishedRow(None, self.tokens[b, :n_tokens[b]].clone(),
                                             self.hidden[b, :n_tokens[b] - 1].clone(),
                                             self.prompt_lens[row])
            self._unread_responses.append(row)
        holes = [b for b in range(n) if done[b]]  # finished slots before the new end
        movers = [b for b in live if b >= n]  # live slots past it: movers[i] fills holes[i]
        mover_of = dict(zip(holes, movers))  # row_of_slot is made anew: observers keep the old
        self.row_of_slot = [self.row_of_slot[mover_of.get(b, b)] for b in range(n)]
        # The same moves on the device, from the done mask, so no index is copied from the host:
        # sorted, live slots come first, then finished ones (uint8: CUDA sorts no bool before 2.6).
        order = torch.argsort(self.done.to(torch.uint8), stable=True)  # (B,)
        device_holes, device_movers = order[n:n + len(holes)], order[n - len(holes):n]
        for name in ("tokens", "hidden", "end", "device_row_of_slot", "n_tokens", "done"):
            t = getattr(self, name)
            t[device_holes] = t[device_movers]  # the right side is a copy: safe in any order
            setattr(self, name, t[:n])
        for per_slot in (self.cache, self.draft_cache, self.sampler):  # all hold a row per slot
            if per_slot is not None:
                per_slot.compact(n, device_holes, device_movers)
        return n

    @property
    def results(self):
        """Per original row, its FinishedRow once finished, else None. The responses finished since
        the last look are read here, in one read: a rollout reads them once, at the end."""
        rows, self._unread_responses = self._unread_responses, []
        if rows:  # sync: one read
            f = self.finished
            ids = torch.cat([f[r].tokens[f[r].prompt_len:] for r in rows]).tolist()
            for r in rows:
                n = len(f[r].tokens) - f[r].prompt_len
                f[r], ids = f[r]._replace(response=ids[:n]), ids[n:]
        return self.finished

    def outputs(self):
        return [r.response for r in self.results]


class DecodeStep(NamedTuple):
    """One decoding step, as the generate functions and the rollout tell an observer of it."""
    batch_size: int  # running rows before the step
    k: int  # drafts per row; 0: a plain step
    n_emitted: torch.Tensor  # (batch_size,) tokens each row kept
    n_accepted: torch.Tensor  # (batch_size,) drafts each row accepted; None for a plain step


@torch.no_grad()
def generate_batch(batch, drafter=None, k=0, observer=None):
    """Run a RunningBatch until every row has finished, with plain steps (k = 0) or speculative
    ones of k drafts -> (outputs, {"accept_len": tokens per row per verify step, from
    `n_generated`; None without speculative steps}). The harness counts in observer(batch, step),
    called after the prefill (step None) and after each step's compaction (a DecodeStep)."""
    running, row_steps = batch.compact(), 0  # sync: one read a step, in compact
    first = batch.n_generated  # the prefill's tokens
    if observer:
        observer(batch, None)
    while running:
        B = batch.batch_size
        n_emitted, n_acc = batch.speculative_step(drafter, k) if k else (batch.plain_step(), None)
        running, row_steps = batch.compact(), row_steps + B
        if observer:
            observer(batch, DecodeStep(B, k, n_emitted, n_acc))
    accept_len = (batch.n_generated - first) / row_steps if k and row_steps else None
    return batch.outputs(), {"accept_len": accept_len}


def autoregressive_generate(target, prompts, max_new_tokens, *, observer=None, **sampling):
    """Plain decoding, one token per row per target pass; finished rows leave the batch.
    `sampling` takes `Sampling`'s fields by name; for `observer` see `generate_batch`."""
    batch = RunningBatch(target, prompts, max_new_tokens, **sampling)
    return generate_batch(batch, observer=observer)


def speculative_generate(target, drafter, prompts, max_new_tokens, *, k=4, observer=None,
                         **sampling):
    """Speculative decoding with the same k for every row and step. With sampler "gumbel" and the
    same keys it emits exactly autoregressive_generate's tokens."""
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    batch = RunningBatch(target, prompts, max_new_tokens, max_draft=k, **sampling)
    return generate_batch(batch, drafter, k, observer)

# -----------------------------------------------------------------------------
# how a token is chosen, and how drafts are verified: two exact samplers, one per batch

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


# The most noise values one pass makes. Chunks of rows save memory (one pass over all rows would
# hold rows x V int64 hashes), and a CPU's chunk stays in its caches.
NOISE_ELEMENTS = defaultdict(lambda: 2 ** 24, cpu=2 ** 20)


def gumbel_choose(logits, temperature, seeds, noise=None, max_elements=None):
    """logits (B, T, V) at the positions whose seeds are (B, T) -> tokens (B, T), the argmax of
    logits / T + noise in float32 (temperature 0: plain argmax). `noise` may come made by the
    caller; else it is made here over the whole vocabulary, a bounded number of rows per pass."""
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

    def compact(self, n, holes, movers):
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

    def compact(self, n, holes, movers):
        self.seeds[holes] = self.seeds[movers]  # as the batch's rows move
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
