"""Lossless speculative decoding, batched, in plain PyTorch.

The pieces, in the order one speculative step uses them:

1. `probs(logits, temperature)`: softmax at a temperature; temperature 0 is greedy (one-hot).
2. Drafting: the drafter proposes k tokens per row (`propose(batch, k)`, the one method every
   drafter offers). The learned drafter (`RunningBatch.draft`) first catches up on the target
   hidden states it has not read yet (a ragged number per row), then proposes k tokens, feeding
   its own predicted hidden state back; the model-free drafters look them up in the row's own text
   (n-gram) or in its GRPO siblings' (drafter.GroupTexts: the rows with the same prompt).
3. Verification: the target reads [pending token, d_1..d_k] in one forward pass (T = k + 1).
4. The verify rule, one of two samplers (both lossless; greedy decoding is the same in both):
   - "rejection", `verify`: exact rejection sampling (Leviathan et al. 2023, Chen et al. 2023).
     Draft d_i is kept with probability min(1, p(d_i) / q(d_i)); at the first rejection the next
     token is drawn from normalise(max(p - q, 0)); if all k are kept, from p at position k+1.
     The emitted tokens are then distributed exactly as the target's own samples.
   - "gumbel", `verify_gumbel`: exact-token sampling. Every row has a 64-bit key, and the token at
     position t is argmax(logits_t / T + g(key, t)), where g is a vector of Gumbel(0, 1) noise,
     one value per token id, computed from (key, t, token id) by a counter-based hash
     (`gumbel_seeds` per (key, t); `gumbel_noise` per token). By the Gumbel-max trick that argmax
     is a sample of softmax(logits_t / T). The noise depends on where a token is,
     not on how it was computed, so plain decoding, a speculative step, a different batch order
     or another rank all pick the same token from the same logits. The drafter drafts with the
     same noise on its own logits; a draft is accepted iff it equals the target's noisy argmax at
     its position, and the target's token is emitted at the first mismatch (or after all k).
     The emitted sequence is the one plain decoding would have sampled, token for token: exactly
     so in float64; in float32 a pass of k + 1 tokens may round differently from one-token passes
     and flip a near-tie, which evaluate.py counts at the end of every run.
     The price: a draft is accepted only if both argmaxes agree, a little less often than the
     sum_x min(p(x), q(x)) of rejection sampling (the maximal coupling; Gumbel's is close).
5. Ragged acceptance: every row keeps its own number of tokens. Rolling back is assigning the
   cache lengths; no row waits for the slowest, no row is cut to the minimum.

The library functions default to "rejection", the textbook rule; train.py and bench.py pass "gumbel".

`RunningBatch` holds the running batch (tokens, target hidden states, both caches); its
`plain_step` and `speculative_step` are the two kinds of step, and `compact` drops finished rows
from every tensor and cache. `autoregressive_generate` and `speculative_generate` each use one
kind of step throughout; rollout.py mixes them by batch size. `DecodeStats` counts what they did
(tokens, speculative row-steps, drafts proposed and accepted), returned as a dict.

Host-device traffic (reads marked "sync:", a stall of a GPU's queue; copies from host lists). A
step makes none: every size it needs is a bound the host keeps (`RunningBatch.longest`, `unread`),
DecodeStats keeps its counts on the device, and compaction builds its index tensors there. What
remains per step is one read in `compact`: which rows finished (the host must know, to shrink the
batch: the price of a truly shrinking batch), with every row's length. The prefill copies a few
host lists; the responses are read once, at the end (`results`). rollout.HostTraffic counts it all.

Test: python -m pytest tests/test_speculative.py
"""
import functools
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from typing import NamedTuple

import torch
import torch.nn.functional as F

import common
from common import Stopwatch, check
from drafter import GroupTexts



def probs(logits, temperature):
    """(..., V) logits -> (..., V) float32 probabilities; temperature 0 gives one-hot argmax."""
    if temperature == 0:
        return torch.zeros_like(logits, dtype=torch.float32).scatter_(-1, logits.argmax(-1, keepdim=True), 1.0)
    return F.softmax(logits.float() if temperature == 1 else logits.float() / temperature, dim=-1)


def draw(p, generator=None):
    """(B, V) probabilities, or any non-negative weights -> (B,) token ids, one independent draw
    per row, by an exponential race: token v wins with probability p_v / sum(p), since
    E_v / p_v is exponential with rate p_v and the smallest of independent exponentials is v's
    with exactly that probability. One elementwise pass and an argmax, the same kernels on every
    device, and a zero-weight token scores 0 and never wins (an inverse-CDF search over a cumsum
    can land on one where a parallel scan rounds, as CUDA's one-row scan can)."""
    e = torch.empty_like(p, dtype=torch.float32).exponential_(generator=generator)  # (B, V)
    return (p / e.clamp_(min=torch.finfo(torch.float32).tiny)).argmax(dim=-1)


SAMPLERS = ("gumbel", "rejection")
MASK32 = 0xFFFFFFFF


def _mix32_(x):
    """A 32-bit integer hash (Wellons' "lowbias32"), in place, on an int64 tensor holding 32-bit
    values. Every product stays below 2^63 in size, so nothing relies on integer overflow. The
    shifts reuse one buffer: hashing holds two copies of x, and allocates once."""
    s = torch.empty_like(x)
    x ^= torch.bitwise_right_shift(x, 16, out=s)
    x.mul_(0x7FEB352D).bitwise_and_(MASK32)
    x ^= torch.bitwise_right_shift(x, 15, out=s)
    x.mul_(-0x7B935975).bitwise_and_(MASK32)  # times 0x846CA68B mod 2^32, whose product could reach 2^64
    x ^= torch.bitwise_right_shift(x, 16, out=s)
    return x


@functools.lru_cache(maxsize=8)
def _token_hashes(vocab_size, device):
    return _mix32_(torch.arange(vocab_size, device=device) + 0x9E3779B9)  # (V,), distinct: the hash is a bijection


def gumbel_seeds(keys, positions):
    """keys (B,) int64 >= 0 and positions (B, T) int64 in 0 .. 2^31 -> (B, T) the 32-bit seeds of
    the "gumbel" sampler's noise: the position's hash, then the key's low 32 bits mixed in (one
    round of the 32-bit mixer), then its high 32 bits (a second round). So the whole 64-bit key
    reaches every seed and the position enters only through its hash: there is no shift structure.
    (32-bit streams stepping by a constant per position give rows m steps apart the same noise m
    positions apart, and two rows in 65k the same stream.)"""
    seed = _mix32_(positions + 0x632BE5AB)  # (B, T) the position's hash
    seed = _mix32_(seed ^ (keys & MASK32)[:, None])  # round 1: the key's low half
    return _mix32_(seed ^ (keys >> 32)[:, None])  # round 2: its high half


def gumbel_noise(seeds, vocab_size):
    """seeds (...) from `gumbel_seeds` -> (..., V) float32 Gumbel(0, 1) noise for every token id: a
    pure function of (key, position, token id), the counter-based generator of the "gumbel"
    sampler. Each seed is hashed with each token's own hash; the top 23 bits make a uniform in
    (0, 1), so the noise lies in [-2.8, 16.7] and a token less likely than about 4e-9 times the
    most likely one is never drawn: float32 resolution, like torch.rand's. 19 kernels at any V."""
    bits = seeds[..., None] ^ _token_hashes(vocab_size, seeds.device)  # (..., V)
    _mix32_(bits)
    u = bits.bitwise_right_shift_(9).float().add_(0.5).mul_(2.0 ** -23)  # in (0, 1): never 0 or 1
    return u.log_().neg_().log_().neg_()  # -log(-log(u))


NOISE_ELEMENTS = defaultdict(lambda: 2 ** 24, cpu=2 ** 20)  # by device type: noise values one pass makes at most


def gumbel_choose(logits, temperature, seeds, noise=None, max_elements=None):
    """The "gumbel" sampler's tokens: logits (B, T, V) of the tokens whose positions have `seeds`
    (B, T) -> (B, T), argmax(logits / T + gumbel_noise(seeds, V)), a sample of softmax(logits / T)
    fixed by the noise; temperature 0 is plain argmax (no noise). In float32 whatever the logits'
    dtype: bf16 would coarsen the noise, and the token would no longer be an exact sample.

    noise: that (B, T, V) noise, when the caller made it already (a speculative step makes it once
    for its drafts and its verify pass, where it fits one pass). Otherwise it is made here for the
    whole vocabulary at once: 21 kernels at any vocabulary size (8192-token chunks took 19 times as
    many at 152k). Memory is bounded over rows instead: a pass makes the noise of max_elements
    (row, token) pairs at most, more rows take more passes. A GPU's default bound is memory alone
    (2^24, 336 MB: past 110 rows at a 152k vocabulary, whose kernels read millions of values each,
    so launches cost little); a CPU's keeps a pass in its caches (2^20: 2x faster than 2^24 at a
    152k vocabulary and batch 64). The same tokens in any case: argmax picks the first maximum."""
    if temperature == 0:
        return logits.argmax(-1)
    x = logits.float() if temperature == 1 else logits.float() / temperature
    if noise is not None:
        return (x + noise).argmax(-1)
    x, s = x.flatten(0, -2), seeds.reshape(-1)  # (R, V), (R,): every position a row
    rows = max(1, (max_elements or NOISE_ELEMENTS[x.device.type]) // x.shape[1])  # rows per pass
    picks = [gumbel_noise(s[r:r + rows], x.shape[1]).add_(x[r:r + rows]).argmax(-1) for r in range(0, s.shape[0], rows)]
    return (picks[0] if len(picks) == 1 else torch.cat(picks)).view(seeds.shape)


def verify(draft_tokens, q, p, generator=None):
    """Exact rejection sampling over a batch.

    draft_tokens (B, k) drawn from q (B, k, V); p (B, k+1, V) the target's distributions.
    Returns n_accepted (B,), the length of each row's accepted prefix, and next_token (B,), the
    token emitted after it: from the residual at the first rejection, or from p[:, k]."""
    B, k = draft_tokens.shape
    p_d = p[:, :k].gather(-1, draft_tokens[..., None]).squeeze(-1)  # (B, k)
    q_d = q.gather(-1, draft_tokens[..., None]).squeeze(-1)  # (B, k)
    u = torch.rand(B, k, generator=generator, device=p.device)
    accept = u * q_d < p_d  # u < p/q without dividing; p >= q always accepts since u < 1
    n_accepted = accept.cummin(dim=1).values.sum(dim=1)  # (B,) length of the accepted prefix
    # residual at the first rejection; at n_accepted == k, q is zero there so residual = p[:, k]
    q_pad = torch.cat([q, torch.zeros_like(q[:, :1])], dim=1)  # (B, k+1, V)
    at = n_accepted[:, None, None].expand(B, 1, p.shape[-1])
    p_at = p.gather(1, at).squeeze(1)  # (B, V)
    residual = (p_at - q_pad.gather(1, at).squeeze(1)).clamp(min=0)  # draw() normalises
    # the residual is all zero only where p == q, which rejects with probability 0; guard against rounding
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p_at)
    return n_accepted, draw(residual, generator)


def verify_gumbel(draft_tokens, target_tokens):
    """The "gumbel" sampler's rule: draft_tokens (B, k), target_tokens (B, k+1) (the target's
    noisy argmax at the same positions and one more) -> n_accepted (B,). Row b keeps its drafts up
    to the first that differs from the target's token, then emits the target's token there; so it
    emits target_tokens[b, :n_accepted[b] + 1], exactly the tokens plain decoding would have produced."""
    k = draft_tokens.shape[1]
    return (draft_tokens == target_tokens[:, :k]).cummin(dim=1).values.sum(dim=1)  # (B,)


class Sample(NamedTuple):
    """One finished row."""
    response: list        # the generated token ids (ending with <|eos|> when the row stopped on it)
    tokens: torch.Tensor  # (N,) prompt + response
    hidden: torch.Tensor  # (N - 1, C): hidden[j] is the target's final hidden state after reading tokens[j]
    prompt_len: int


class RunningBatch:
    """The running batch of one generate or rollout call: rows leave it when they finish.

    Per row: tokens[b, :n_tokens[b]] are prompt + generated tokens, the last one "pending" (sampled
    but not yet read by the target), so the target cache holds n_tokens - 1 positions and
    hidden[b, j] is the target's final hidden state after reading tokens[b, j].

    The host keeps what it must know instead of reading the device: `running`, the row in each slot;
    `longest` >= every row's n_tokens (exact after each compact, then grown by the most a step can
    add), which sizes every attention window; `unread` >= how many recorded states the drafter has
    not read, its catch-up width. `_check` states the invariants the steps rely on.

    sampler "rejection" draws from `generator`; sampler "gumbel" picks every token from the row's
    key (keys[b], any int64 >= 0) and the token's position, and draws nothing from `generator`
    except, when keys is None, one base key for rows base, base + 1, ..."""

    def __init__(self, target, prompts, max_new_tokens, *, temperature=1.0, eos_id=None,
                 generator=None, max_draft=0, sampler="rejection", keys=None, siblings=None):
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("prompts must be a non-empty list of non-empty token lists")
        if sampler not in SAMPLERS:
            raise ValueError(f"sampler must be one of {SAMPLERS}, got {sampler!r}")
        if keys is not None and (len(keys) != len(prompts) or min(keys) < 0):
            raise ValueError(f"keys must be {len(prompts)} non-negative integers, one per prompt")
        if max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be positive, got {max_new_tokens}")
        longest = max(len(p) for p in prompts)
        need = longest + max_new_tokens + max_draft  # the verify pass writes k positions past the end
        if need > target.config.block_size:
            raise ValueError(f"prompt ({longest}) + max_new_tokens ({max_new_tokens}) + draft ({max_draft}) "
                             f"= {need} exceeds block_size {target.config.block_size}")
        self.target, self.temperature, self.eos_id, self.generator, self.sampler = target, temperature, eos_id, generator, sampler
        dev = target.wte.weight.device
        B, width = len(prompts), need + 1
        # on the host, never read back: which row is in each slot, the prompts' lengths by row
        self.running, self.prompt_lens = list(range(B)), [len(p) for p in prompts]
        self.cap = longest + max_new_tokens  # no row grows past it
        self.counted = sum(self.prompt_lens)  # the tokens of the running rows at the last compact (see compact)
        # on the device, per row; each made from host data in one copy, once per batch
        self.tokens = torch.tensor([p + [0] * (width - len(p)) for p in prompts], device=dev)  # (B, width)
        prompt_len = torch.tensor(self.prompt_lens, device=dev)  # (B,)
        self.end = prompt_len + max_new_tokens  # (B,) a row is done at this many tokens
        self.hidden = torch.zeros(B, width, target.config.n_embd, device=dev, dtype=target.wte.weight.dtype)
        self.row_id = torch.arange(B, device=dev)  # the device's `running`
        self.seeds = None  # "gumbel": every position's noise seed, hashed once per batch (8 bytes a position)
        if sampler == "gumbel":
            keys = (torch.arange(B, device=dev) + torch.randint(2 ** 62, (1,), generator=generator, device=dev)
                    if keys is None else torch.as_tensor(keys, dtype=torch.long, device=dev))
            self.seeds = gumbel_seeds(keys, torch.arange(width, device=dev).expand(B, width))  # (B, width)
        self.cache = target.new_cache(B, max_len=need)
        self.dcache = self.unread = None  # the drafter's cache and catch-up width, from the first draft
        self.drafting = Stopwatch(dev)  # the time spent drafting
        self._results, self._unread_responses = [None] * B, []  # see `results`
        # prefill: each distinct prompt once (a GRPO group repeats its prompt G times), padded, in
        # one pass; then copy its cache entries to the rows that share it and roll each row back
        # to its true length. Every row then samples its own first token.
        index = {}  # distinct prompt -> its index
        group = [index.setdefault(tuple(p), len(index)) for p in prompts]  # each row's distinct prompt: its GRPO group
        firsts, inverse = (torch.tensor(x, device=dev) for x in ([group.index(u) for u in range(len(index))], group))
        once = target.new_cache(len(index), max_len=longest)
        once.window = longest
        logits, hidden = target(self.tokens[firsts, :longest], once)  # (U, T, V), (U, T, C)
        self.cache.kv[..., :longest, :] = once.kv[:, :, inverse]
        self.cache.lengths = prompt_len
        self.hidden[:, :longest] = hidden[inverse]
        self.n_tokens = prompt_len.clone()
        self.done = torch.zeros(B, dtype=torch.bool, device=dev)
        self._at(prompt_len[:, None])
        first, _ = self._choose(logits[inverse, prompt_len - 1][:, None])  # (B, 1)
        self._append(first)
        self.longest = longest + 1
        self.groups = GroupTexts(group, siblings, prompts, width, dev)  # what model-free drafters read
        if common.DEBUG:
            self._check()

    def _check(self):
        """The invariants the steps rely on, checked when DEBUG is on (each check reads the device):
        1. the target cache holds every row's tokens but the pending one: lengths == n_tokens - 1;
        2. n_tokens <= longest <= cap: the windows sized from `longest` cover every row's cache;
        3. n_tokens - 1 - dcache.lengths <= unread: the drafter's catch-up reaches every unread state;
        4. the host's `running` is the device's row_id: results go to the right rows."""
        n = self.n_tokens
        check(torch.equal(self.cache.lengths, n - 1), "the target cache holds n_tokens - 1 positions")
        check(not n.numel() or int(n.max()) <= self.longest <= self.cap, "longest bounds every row")
        check(self.dcache is None or bool((n - 1 - self.dcache.lengths <= self.unread).all()),
              "unread bounds the drafter's unread states")
        check(self.row_id.tolist() == self.running, "the host's rows are the device's")

    @property
    def batch_size(self):
        return self.row_id.shape[0]

    def _at(self, positions):
        """This step picks tokens at positions (B, T): with "gumbel", keep their seeds and, in a speculative
        step whose noise fits one pass, make it now, once for all its choices (drafts, verify pass)."""
        self.step_seeds = self.noise = None
        if self.sampler == "gumbel" and self.temperature > 0:
            self.step_seeds = self.seeds.gather(1, positions)  # (B, T)
            if positions.shape[1] > 1 and positions.numel() * self.target.config.vocab_size <= NOISE_ELEMENTS[positions.device.type]:
                self.noise = gumbel_noise(self.step_seeds, self.target.config.vocab_size)  # (B, T, V)

    def _choose(self, logits, at=slice(None)):
        """The one place a token is picked: logits (B, T, V) of the tokens at the step's positions
        [:, at] (see `_at`) -> tokens (B, T) and, with "rejection", their distributions (B, T, V)
        (None with "gumbel")."""
        if self.sampler == "rejection":
            p = probs(logits, self.temperature)
            return draw(p.flatten(0, 1), self.generator).view(p.shape[:-1]), p
        if self.temperature == 0:
            return logits.argmax(-1), None
        noise = None if self.noise is None else self.noise[:, at]
        return gumbel_choose(logits, self.temperature, self.step_seeds[:, at], noise), None

    def _append(self, new, n_new=None):
        """Write new (B, W) tokens, of which row b keeps its first n_new[b] (default: all W), after
        each row's end; cut after the first <|eos|> and at max_new_tokens, and mark those rows done.
        Returns the tokens kept per row (B,)."""
        W = new.shape[1]
        offs = self.cache.offsets[:W]
        self.tokens.scatter_(1, self.n_tokens[:, None] + offs, new)  # writes past what is kept land beyond the row's end: dead
        budget = self.end - self.n_tokens  # (B,)
        n_kept = budget.clamp_(max=W) if n_new is None else torch.minimum(n_new, budget)
        if self.eos_id is not None:  # keep up to the first <|eos|> among the kept tokens
            before = (new != self.eos_id).cummin(1).values.sum(1)  # (B,) tokens before the first <|eos|>
            self.done |= before < n_kept  # it is among the kept ones: the row ends on it
            n_kept = torch.minimum(n_kept, before + 1)
        self.n_tokens = self.n_tokens + n_kept
        self.done |= self.n_tokens >= self.end
        return n_kept

    @torch.no_grad()
    def plain_step(self):
        """One token for every running row. Returns the number of tokens emitted per row."""
        if common.DEBUG:
            self._check()
        L = self.n_tokens - 1  # (B,) target cache length; tokens[L] is pending
        self.cache.window = self.longest  # the longest row after the append: the forward reads nothing
        logits, hidden = self.target(self.tokens.gather(1, L[:, None]), self.cache)  # (B, 1, V), (B, 1, C)
        self.hidden[self.cache.rows, L] = hidden[:, 0]
        self._at(self.n_tokens[:, None])
        nxt, _ = self._choose(logits)  # (B, 1)
        self.longest = min(self.longest + 1, self.cap)
        if self.unread is not None:
            self.unread += 1
        return self._append(nxt)

    def draft(self, drafter, k):
        """The learned drafter's proposal (drafter.Drafter): k tokens per row (B, k) and, with
        "rejection", their distributions q (B, k, V) (None with "gumbel"). It first catches up on the
        target hidden states it has not read, then drafts, feeding its own predicted hidden state
        back; draft i is the sampler's choice at position L + 1 + i, with the step's noise there.
        It relies on invariants 2 and 3 (`_check`; speculative_step checks them under DEBUG)."""
        B, L = self.batch_size, self.n_tokens - 1  # L (B,): the target cache length
        if self.dcache is None:  # the switch to SD: the drafter has read no recorded hidden state
            self.dcache = drafter.new_cache(B, max_len=self.cache.max_len, dtype=self.cache.kv.dtype)
            self.unread = self.longest
        # catch up: each row re-reads its last T pairs (h_j, x_{j+1}), j < L, T a bound on how many it
        # has not read (pairs it had read are rewritten with the values they had); a row with L < T
        # also reads padding past L: dead entries, rolled back below
        T = min(self.unread, self.longest - 1)
        start = (L - T).clamp_(min=0)  # (B,)
        j = start[:, None] + self.cache.offsets[:T]  # (B, T)
        self.dcache.lengths, self.dcache.window = start, self.longest - 1
        logits, h = drafter(self.hidden[self.cache.rows[:, None], j], self.tokens.gather(1, j + 1), self.dcache)
        last = (L - 1 - start)[:, None, None]  # (B, 1, 1): the column of pair L - 1
        logits = logits.gather(1, last.expand(B, 1, logits.shape[-1]))  # (B, 1, V)
        h = h.gather(1, last.expand(B, 1, h.shape[-1]))  # (B, 1, C)
        self.dcache.lengths = L
        # draft k tokens, feeding the drafter its own hidden state
        drafts, qs = [], []
        for i in range(k):
            d, q = self._choose(logits, slice(i, i + 1))  # (B, 1), (B, 1, V) or None
            drafts.append(d)
            qs.append(q)
            if i + 1 < k:
                self.dcache.window = self.longest + i
                logits, h = drafter(h, d, self.dcache)  # (B, 1, V), (B, 1, C)
        self.dcache.lengths = L  # entries built on guessed states are redone next step
        self.unread = 0  # the step that drafted adds the rest (speculative_step)
        return torch.cat(drafts, 1), None if qs[0] is None else torch.cat(qs, 1)

    @torch.no_grad()
    def speculative_step(self, drafter, k):
        """Draft k tokens per row, verify them in one target pass, keep a ragged number per row.
        `drafter`: anything with propose(batch, k) -> (drafts (B, k), q (B, k, V) or None, None
        meaning deterministic proposals, a one-hot q): drafter.Drafter (whose proposal is `draft`)
        or drafter.NgramDrafter. Returns (tokens emitted per row, drafts accepted per row)."""
        if common.DEBUG:
            self._check()
        V = self.target.config.vocab_size
        L = self.n_tokens - 1  # (B,) target cache length; tokens[L] is pending
        positions = self.n_tokens[:, None] + self.cache.offsets[:k + 1]  # (B, k+1): the drafts', then the bonus token's
        self._at(positions)
        # 1. draft k tokens per row
        with self.drafting():
            draft, q = drafter.propose(self, k)  # (B, k), and q (B, k, V) or None
        # 2. verify: the target reads the pending token and the k drafts in one pass
        self.cache.window = self.longest + k  # the longest row after the append: the forward reads nothing
        t_logits, t_hidden = self.target(torch.cat([self.tokens.gather(1, L[:, None]), draft], 1), self.cache)  # (B, k+1, .)
        # all k+1 states are written; those of rejected drafts are dead (past the row's end, overwritten later)
        self.hidden[self.cache.rows[:, None], positions - 1] = t_hidden
        # 3. keep a ragged number per row: emitted (B, k+1), of which row b keeps its first n_acc[b] + 1
        if self.sampler == "rejection":
            if q is None:  # deterministic proposals: a one-hot q (scatter, as F.one_hot reads the ids' range on a CPU)
                q = torch.zeros(*draft.shape, V, device=draft.device).scatter_(-1, draft[..., None], 1.0)  # (B, k, V)
            n_acc, nxt = verify(draft, q, probs(t_logits, self.temperature), self.generator)
            emitted = torch.cat([draft, nxt[:, None]], 1).scatter_(1, n_acc[:, None], nxt[:, None])  # accepted drafts, then nxt
        else:  # the target's own tokens: up to the first mismatch they are the drafts
            emitted, _ = self._choose(t_logits)
            n_acc = verify_gumbel(draft, emitted)
        n_emitted = self._append(emitted, n_acc + 1)
        self.cache.lengths = self.n_tokens - 1  # roll the rejected drafts back
        self.longest = min(self.longest + k + 1, self.cap)
        if self.unread is not None:  # whichever drafter drafted: the learned one has not read these
            self.unread += k + 1
        return n_emitted, n_acc

    def compact(self):
        """Move finished rows to `results` and drop them from every tensor and cache: the live rows
        past the new end fill the holes that finished rows leave before it, so a few rows move, not
        the whole cache. Returns the number of rows still running, and sets `emitted`, the tokens
        written since the last compact (the prefill's, then a step's), which the bandit scores."""
        B = self.batch_size
        if B == 0:
            return 0
        # sync: the one read of every step: which rows finished (the host must know, to shrink the
        # batch), with every row's length (the longest makes the next windows exact; their sum, less
        # the last compact's, counts the step's tokens)
        done, n_tokens = torch.stack((self.done, self.n_tokens)).tolist()
        live = [b for b in range(B) if not done[b]]
        self.emitted, self.counted = sum(n_tokens) - self.counted, sum(n_tokens[b] for b in live)
        self.longest, n = max((n_tokens[b] for b in live), default=0), len(live)
        if n == B:  # none finished
            return B
        if common.DEBUG:  # every slot's tokens and first keys, to check that each row's keys move with its tokens
            before = self.tokens.clone(), self.cache.k[0, :, 0, :, 0].clone()  # (B, width), (B, max_len)
        for b in (b for b in range(B) if done[b]):  # a result; its response is read with the others' (`results`)
            row = self.running[b]
            self._results[row] = Sample(None, self.tokens[b, :n_tokens[b]].clone(),
                                        self.hidden[b, :n_tokens[b] - 1].clone(), self.prompt_lens[row])
            self._unread_responses.append(row)
        # on the host: slot b < n keeps its row if it runs, else takes the next live row past n
        movers = iter([b for b in live if b >= n])
        keep = [b if not done[b] else next(movers) for b in range(n)]
        self.running = [self.running[b] for b in keep]
        # on the device, the same moves found in the done mask, so no index crosses from the host:
        # the live slots in order, then the finished ones, by a stable sort (nonzero would read how
        # many there are, which the host knows; uint8: CUDA sorts no bool before torch 2.6)
        order = torch.argsort(self.done.to(torch.uint8), stable=True)  # (B,)
        self.groups.finish(self.row_id[order[n:]], self.tokens[order[n:]], self.n_tokens[order[n:]])
        holes = sum(done[:n])  # finished slots before the new end = live slots past it
        slots, rows = order[n:n + holes], order[n - holes:n]  # slots[i] gets the row in slot rows[i]
        for name in ("tokens", "hidden", "end", "row_id", "n_tokens", "done", "seeds"):
            t = getattr(self, name)
            if t is not None:
                t[slots] = t[rows]  # the right side is a copy: safe in any order
                setattr(self, name, t[:n])
        for cache in (self.cache, self.dcache):
            if cache is not None:
                cache.keep(n, slots, rows)
        if common.DEBUG:
            check(torch.equal(self.tokens, before[0][keep]) and torch.equal(self.cache.k[0, :, 0, :, 0], before[1][keep]),
                  "compaction moves every row's cache keys with its tokens")
            self._check()
        return self.batch_size

    @property
    def results(self):
        """Per original row, its Sample once it has finished, else None. The responses of the rows
        finished since the last look are read here, together: a rollout reads them once, at the end."""
        rows, self._unread_responses = self._unread_responses, []
        if rows:  # sync: the responses of the rows finished since the last look, in one read
            ids = torch.cat([self._results[r].tokens[self._results[r].prompt_len:] for r in rows]).tolist()
            for r in rows:
                n = len(self._results[r].tokens) - self._results[r].prompt_len
                self._results[r], ids = self._results[r]._replace(response=ids[:n]), ids[n:]
        return self._results

    def outputs(self):
        return [r.response for r in self.results]


@dataclass
class DecodeStats:
    """What a generate call or a rollout measured, summed over its steps. The counts the device holds
    (tokens emitted, drafts accepted) stay there until `settle()` reads them all at once (as_dict,
    accept_len and accept_rate call it), so counting costs no sync per step. By draft position, as
    EAGLE-style papers report it: accepted_at[i] / drafted_at[i] is the chance that draft i + 1 is
    accepted given that the ones before it were (`_count_positions` says which drafts count)."""
    steps: int = 0          # decoding steps (plain or speculative)
    tokens: int = 0         # tokens emitted, all rows
    sd_row_steps: int = 0   # (row, speculative step) pairs
    sd_tokens: int = 0      # tokens emitted by speculative steps
    drafted: int = 0        # draft tokens proposed
    accepted: int = 0       # draft tokens accepted
    accept_hist: dict = field(default_factory=dict)  # drafts accepted by one row in one step -> how often
    drafted_at: list = field(default_factory=list)   # per draft position: drafts decided there
    accepted_at: list = field(default_factory=list)  # per draft position: drafts accepted there

    def __post_init__(self):
        self._pending = []  # (n_emitted (B,), n_acc (B,) or None for a step's token count alone, k) not yet read

    def add_step(self, n_emitted):
        self.steps += 1
        self._pending.append((n_emitted, None, 0))

    def add_speculative(self, n_emitted, n_acc, k):
        self.sd_row_steps += n_emitted.numel()
        self.drafted += k * n_acc.numel()
        self._pending.append((n_emitted, n_acc, k))

    def settle(self):
        """Read the pending device counts into the fields; returns self."""
        if not self._pending:
            return self
        values = torch.cat([t for e, a, _ in self._pending for t in (e, a) if t is not None]).tolist()  # sync: one read
        i = 0
        for emitted, acc, k in self._pending:
            n_emitted, i = values[i:i + emitted.numel()], i + emitted.numel()
            if acc is None:
                self.tokens += sum(n_emitted)
                continue
            n_acc, i = values[i:i + acc.numel()], i + acc.numel()
            self.sd_tokens += sum(n_emitted)
            self.accepted += sum(n_acc)
            for a in n_acc:
                self.accept_hist[a] = self.accept_hist.get(a, 0) + 1
            self._count_positions(n_emitted, n_acc, k)
        self._pending = []
        return self

    def _count_positions(self, n_emitted, n_acc, k):
        """A speculative step's drafts by position. A row keeps n_emitted tokens, its accepted drafts
        then the target's token; where it ended (<|eos|> or its length limit) on an accepted draft,
        n_emitted <= n_acc and the drafts after it were never decided."""
        grow = k - len(self.drafted_at)
        if grow > 0:
            self.drafted_at += [0] * grow
            self.accepted_at += [0] * grow
        for emitted, acc in zip(n_emitted, n_acc):
            used = min(acc, emitted)
            for i in range(used):
                self.drafted_at[i] += 1
                self.accepted_at[i] += 1
            if emitted > acc and used < k:  # the row went on: the first rejected draft was decided too
                self.drafted_at[used] += 1

    @property
    def accept_len(self):  # tokens per row per verify step: accepted drafts plus the target's own
        self.settle()
        return self.sd_tokens / self.sd_row_steps if self.sd_row_steps else None

    @property
    def accept_rate(self):  # accepted drafts per drafted token
        self.settle()
        return self.accepted / self.drafted if self.drafted else None

    @property
    def accept_by_position(self):  # per draft position: accepted given that the earlier ones were
        self.settle()
        return [a / d if d else None for a, d in zip(self.accepted_at, self.drafted_at)]

    def as_dict(self):
        """The generate functions' `stats`: every field, accept_len, accept_rate, accept_by_position."""
        self.settle()
        return {**asdict(self), "accept_hist": dict(sorted(self.accept_hist.items())), "accept_len": self.accept_len,
                "accept_rate": self.accept_rate, "accept_by_position": self.accept_by_position}


@torch.no_grad()
def autoregressive_generate(target, prompts, max_new_tokens, *, temperature=1.0, eos_id=None, generator=None,
                            sampler="rejection", keys=None, progress=None):
    """Plain decoding, one token per row per target pass; finished rows leave the batch.
    sampler and keys: see RunningBatch; progress: see speculative_generate."""
    batch = RunningBatch(target, prompts, max_new_tokens, temperature=temperature, eos_id=eos_id, generator=generator,
                     sampler=sampler, keys=keys)
    stats = DecodeStats()
    while batch.compact() > 0:
        stats.add_step(batch.plain_step())
        if progress:
            progress()
    return batch.outputs(), stats.as_dict()


@torch.no_grad()
def speculative_generate(target, drafter, prompts, max_new_tokens, *, k=4, temperature=1.0, eos_id=None,
                         generator=None, sampler="rejection", keys=None, siblings=None, progress=None):
    """Speculative decoding with a fixed k for every row and every step. With sampler "gumbel" and the same keys (or the
    same generator seed) it emits exactly autoregressive_generate's tokens. siblings: per prompt, responses of its group
    that finished earlier (see RunningBatch._group). progress: called after every step (liveness.beat: slow, not dead)."""
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    batch = RunningBatch(target, prompts, max_new_tokens, temperature=temperature, eos_id=eos_id,
                         generator=generator, max_draft=k, sampler=sampler, keys=keys, siblings=siblings)
    stats = DecodeStats()
    while batch.compact() > 0:
        n_emitted, n_acc = batch.speculative_step(drafter, k)
        stats.add_step(n_emitted)
        stats.add_speculative(n_emitted, n_acc, k)
        if progress:
            progress()
    return batch.outputs(), stats.as_dict()
