"""Lossless speculative decoding, batched, in plain PyTorch.

The pieces, in the order one speculative step uses them:

1. `probs(logits, temperature)`: softmax at a temperature; temperature 0 is greedy (one-hot).
2. Drafting: the drafter proposes k tokens per row (`propose(batch, k)`, the one method every
   drafter offers). The learned drafter (`RunningBatch.draft`) first catches up on the target
   hidden states it has not read yet (a ragged number per row), then proposes k tokens, feeding
   its own predicted hidden state back; the model-free drafters look them up in the row's own text
   (n-gram) or in its GRPO siblings' (`texts`, `siblings`: the rows with the same prompt).
3. Verification: the target reads [pending token, d_1..d_k] in one forward pass (T = k + 1).
4. The verify rule, one of two samplers (both lossless; greedy decoding is the same in both):
   - "rejection", `verify`: exact rejection sampling (Leviathan et al. 2023, Chen et al. 2023).
     Draft d_i is kept with probability min(1, p(d_i) / q(d_i)); at the first rejection the next
     token is drawn from normalise(max(p - q, 0)); if all k are kept, from p at position k+1.
     The emitted tokens are then distributed exactly as the target's own samples.
   - "gumbel", `verify_gumbel`: exact-token sampling. Every row has a 64-bit key, and the token at
     position t is argmax(logits_t / T + g(key, t)), where g is a vector of Gumbel(0, 1) noise,
     one value per token id, computed from (key, t, token id) by a counter-based hash
     (`gumbel_seeds` per (key, t), made once per batch for every position; `gumbel_noise` per token). By the Gumbel-max trick that argmax is a sample of softmax(logits_t / T),
     so each token's marginal is exactly the target's. The noise depends on where a token is,
     not on how it was computed, so plain decoding, a speculative step, a different batch order
     or another rank all pick the same token from the same logits. The drafter drafts with the
     same noise on its own logits; a draft is accepted iff it equals the target's noisy argmax at
     its position, and the target's token is emitted at the first mismatch (or after all k).
     The emitted sequence is the one plain decoding would have sampled, token for token: exactly
     so in float64; in float32 a pass of k + 1 tokens may round differently from one-token passes
     and flip a near-tie, which evaluate.py counts at the end of every run.
     The price: a draft is accepted only if both argmaxes agree, which happens with probability
     somewhat below sum_x min(p(x), q(x)), the rate rejection sampling achieves (the maximal
     coupling of p and q; the Gumbel coupling is close but not maximal).
5. Ragged acceptance: every row keeps its own number of tokens. Rolling back is assigning the
   cache lengths; no row waits for the slowest, no row is cut to the minimum.

The library functions (and rollout.py) default to "rejection", the textbook rule, which the drafter
warm-up's sampling also uses; train.py, evaluate.py and bench.py pass "gumbel".

`RunningBatch` holds the running batch (tokens, target hidden states, both caches); its
`plain_step` and `speculative_step` are the two kinds of step, and `compact` drops finished rows
from every tensor and cache. `autoregressive_generate` and `speculative_generate` each use one
kind of step throughout; rollout.py mixes the two kinds of step by batch size. `DecodeStats`
counts what they did (tokens, speculative row-steps, drafts proposed and accepted); the generate
functions return it as a dict, the interface their callers and tests rely on.

Host-device round trips (marked "sync:"; free on a CPU, a stall of the GPU's queue on a GPU). A
speculative step (drafting, verify, bookkeeping) makes none: every size it needs is a bound the
host keeps (`RunningBatch.longest`: the attention windows; `unread`: the drafter's catch-up width),
handed to each forward through `cache.window`, and DecodeStats keeps the step's counts on the
device until the end. What remains per step is one read in `compact`: which rows finished (the
host must know, to shrink the batch and hand results back: the price of a truly shrinking batch),
read together with every row's length, which makes the next step's windows exact. A step in which
rows finish reads their tokens too. rollout.py adds the bandit's read of the step's tokens and the
clock's torch.cuda.synchronize (it scores k by measured tokens per second). Once per batch: the
prefill's distinct prompts (torch.unique), which rows share one (the GRPO groups) and, with
"gumbel" and no keys, the base key. The drafting clock (`drafting`) records CUDA events, read once.
`bench.count_syncs` counts them on a GPU.

Test: python -m pytest tests/test_speculative.py
"""
import bisect
import functools
from dataclasses import asdict, dataclass, field
from typing import NamedTuple

import torch
import torch.nn.functional as F

from common import Stopwatch


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
    values. Every product stays below 2^63, so nothing relies on integer overflow."""
    x ^= x >> 16
    x.mul_(0x7FEB352D).bitwise_and_(MASK32)
    x ^= x >> 15
    x.mul_(0x7B935975).neg_().bitwise_and_(MASK32)  # times 0x846CA68B mod 2^32 (= 2^32 - 0x7B935975)
    x ^= x >> 16
    return x


@functools.lru_cache(maxsize=8)
def _token_hashes(vocab_size, device):
    return _mix32_(torch.arange(vocab_size, device=device) + 0x9E3779B9)  # (V,), distinct: the hash is a bijection


def gumbel_seeds(keys, positions):
    """keys (B,) int64 >= 0 and positions (B, T) int64 in 0 .. 2^31 -> (B, T) the 32-bit seeds of
    the "gumbel" sampler's noise: the position's hash, then the key's low 32 bits mixed in (one
    round of the 32-bit mixer), then its high 32 bits (a second round). So the whole 64-bit key
    reaches every seed and the position enters only through its hash: there is no shift structure.
    (A 32-bit stream per row that steps by a constant per position gives two rows whose streams are
    m steps apart the same noise m positions apart, and two rows in 65k the same stream.)"""
    seed = _mix32_(positions + 0x632BE5AB)  # (B, T) the position's hash
    seed = _mix32_(seed ^ (keys & MASK32)[:, None])  # round 1: the key's low half
    return _mix32_(seed ^ (keys >> 32)[:, None])  # round 2: its high half


def gumbel_noise(seeds, vocab_size, lo=0, hi=None):
    """seeds (B, T) from `gumbel_seeds` -> (B, T, hi - lo) float32 Gumbel(0, 1) noise for token ids
    lo .. hi-1 (default: all): a pure function of (key, position, token id), the counter-based
    generator of the "gumbel" sampler. Each seed is hashed with each token's own hash; the top 23
    bits make a uniform in (0, 1), so the noise lies in [-2.8, 16.7] and a token less likely than
    about 4e-9 times the most likely one is never drawn: float32 resolution, like torch.rand's."""
    bits = _mix32_(seeds[..., None] ^ _token_hashes(vocab_size, seeds.device)[lo:hi])  # (B, T, hi - lo)
    u = ((bits >> 9).float() + 0.5).mul_(2.0 ** -23)  # in (0, 1): never 0 or 1
    return u.log_().neg_().log_().neg_()  # -log(-log(u))


MAX_SIBLINGS = 15  # a row's siblings, at most: a GRPO group of 16 in full (bounds the lookup's work per row)
NOISE_CHUNK = 8192  # token ids per chunk: at most B * T * 8192 noise values (int64 while hashed) at once


def gumbel_choose(logits, temperature, seeds, noise=None, chunk=NOISE_CHUNK):
    """The "gumbel" sampler's tokens: logits (B, T, V) of the tokens whose positions have `seeds`
    (B, T) -> (B, T), argmax(logits / T + gumbel_noise(seeds, V)), a sample of softmax(logits / T)
    fixed by the noise; temperature 0 is plain argmax (no noise).

    noise: that (B, T, V) noise, when the caller made it already (a speculative step makes it once
    for its drafts and its verify pass; only where V <= chunk). Otherwise it is made here, chunk by
    chunk over the vocabulary, with a running max across chunks, so a step never holds (B, T, V)
    noise at once (0.7 GB in int64 at V = 150k, B = 64, T = 9); the same tokens: within a chunk and
    across chunks the first maximum wins. In float32 whatever the logits' dtype: bf16 would coarsen
    the noise, and the token would no longer be an exact sample."""
    if temperature == 0:
        return logits.argmax(-1)
    V = logits.shape[-1]
    best_val = best_idx = None
    for lo in range(0, V, chunk):
        hi = min(lo + chunk, V)
        x = logits[..., lo:hi].float()
        x = x if temperature == 1 else x / temperature
        val, idx = (x + (gumbel_noise(seeds, V, lo, hi) if noise is None else noise)).max(-1)
        if best_val is None:
            best_val, best_idx = val, idx
        else:
            better = val > best_val  # strictly: on a tie the earlier chunk's token stays
            best_val, best_idx = torch.where(better, val, best_val), torch.where(better, idx + lo, best_idx)
    return best_idx


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

    On the host it keeps bounds instead of reading the device: `longest` >= every row's n_tokens
    (exact after each compact, then grown by the most a step can add), which sizes every attention
    window, and `unread` >= how many recorded states the drafter has not read, its catch-up width.

    sampler "rejection" draws from `generator`; sampler "gumbel" picks every token from the row's
    key (keys[b], any int64 >= 0) and the token's position, and draws nothing from `generator`
    except, when keys is None, one base key for rows base, base + 1, ..."""

    def __init__(self, target, prompts, max_new_tokens, *, temperature=1.0, eos_id=None,
                 generator=None, max_draft=0, sampler="rejection", keys=None, siblings=None):
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("prompts must be a non-empty list of non-empty token lists")
        if sampler not in SAMPLERS:
            raise ValueError(f"sampler must be one of {SAMPLERS}, got {sampler!r}")
        if keys is not None and len(keys) != len(prompts):
            raise ValueError(f"{len(keys)} keys for {len(prompts)} prompts")
        if max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be positive, got {max_new_tokens}")
        if siblings is not None and len(siblings) != len(prompts):
            raise ValueError(f"{len(siblings)} lists of finished siblings for {len(prompts)} prompts")
        longest = max(len(p) for p in prompts)
        need = longest + max_new_tokens + max_draft  # the verify pass writes k positions past the end
        if need > target.config.block_size:
            raise ValueError(f"prompt ({longest}) + max_new_tokens ({max_new_tokens}) + draft ({max_draft}) "
                             f"= {need} exceeds block_size {target.config.block_size}")
        self.target, self.temperature, self.eos_id, self.generator = target, temperature, eos_id, generator
        dev = target.wte.weight.device
        B, width = len(prompts), need + 1
        self.tokens = torch.zeros(B, width, dtype=torch.long, device=dev)
        for b, p in enumerate(prompts):
            self.tokens[b, :len(p)] = torch.tensor(p, device=dev)
        self.prompt_len = torch.tensor([len(p) for p in prompts], device=dev)
        self.end = self.prompt_len + max_new_tokens  # (B,) a row is done at this many tokens
        self.hidden = torch.zeros(B, width, target.config.n_embd, device=dev, dtype=target.wte.weight.dtype)
        self.row_id = torch.arange(B, device=dev)
        self.sampler = sampler
        if keys is None:  # "rejection" never reads them, so it draws nothing for them
            keys = torch.arange(B) + (int(torch.randint(2 ** 62, (1,), generator=generator, device=dev))
                                      if sampler == "gumbel" else 0)
        elif min(keys) < 0:
            raise ValueError("keys must be non-negative")
        # every position's noise seed, hashed once per batch (8 bytes a position: nothing beside the KV cache)
        self.seeds = None if sampler != "gumbel" else gumbel_seeds(torch.as_tensor(keys, dtype=torch.long).to(dev),
                                                                   torch.arange(width, device=dev).expand(B, width))
        self.cache = target.new_cache(B, max_len=need)
        self.dcache = None  # the drafter's cache, made on the first speculative step
        self.drafting = Stopwatch(dev)  # the time spent drafting
        self.results = [None] * B  # per original row, a Sample once it has finished
        self.cap = longest + max_new_tokens  # no row grows past it
        self.unread = None  # no drafter cache yet
        # prefill: each distinct prompt once (a GRPO group repeats its prompt G times), padded, in
        # one pass; then copy its cache entries to the rows that share it and roll each row back
        # to its true length. Every row then samples its own first token.
        distinct, inverse = torch.unique(torch.cat([self.prompt_len[:, None], self.tokens[:, :longest]], 1), dim=0,
                                         return_inverse=True)  # (U, 1 + longest): length, then the padded prompt
        once = target.new_cache(distinct.shape[0], max_len=longest)
        once.window = longest
        logits, hidden = target(distinct[:, 1:], once)  # (U, T, V), (U, T, C)
        self.cache.kv[..., :longest, :] = once.kv[:, :, inverse]
        self.cache.lengths = self.prompt_len.clone()
        self.hidden[:, :longest] = hidden[inverse]
        self.n_tokens = self.prompt_len.clone()
        self.done = torch.zeros(B, dtype=torch.bool, device=dev)
        self._at(self.prompt_len[:, None])
        first, _ = self._choose(logits[inverse, self.prompt_len - 1][:, None])  # (B, 1)
        self._append(first)
        self.longest = longest + 1
        self._group(inverse.tolist(), siblings or [[] for _ in prompts], prompts)  # sync: once per batch

    def _group(self, group, finished, prompts):
        """What a model-free drafter may read besides a row's own tokens: its GRPO group, the rows
        with the same prompt (`group`, the prefill's grouping), plus the responses of its group that
        had finished before this batch began (`finished`, per row; a rollout has none, as it holds
        the whole group; bench.py's decoding table starts in the tail). `texts` (R, width): every
        row's tokens by original row, kept when it finishes, then those finished responses;
        `text_len` (R,); `siblings` (B, S): for each row, the texts of its group but its own, -1
        padding. A running row's entry in `texts` is refreshed by whoever reads it (`group_texts`)."""
        B, width = self.tokens.shape
        extra = [(b, (prompts[b] + list(r))[:width]) for b in range(B) for r in finished[b]]
        # a running row's entry is filled when it finishes (compact) and read through group_texts till then
        self.texts = torch.zeros(B + len(extra), width, dtype=torch.long, device=self.tokens.device)
        self.text_len = torch.tensor([0] * B + [len(t) for _, t in extra], dtype=torch.long, device=self.tokens.device)
        members = {}  # group -> its texts
        for i, g in enumerate(group + [group[b] for b, _ in extra]):
            members.setdefault(g, []).append(i)
        for i, (_, t) in enumerate(extra):
            self.texts[B + i, :len(t)] = torch.tensor(t, device=self.tokens.device)
        rows = []  # a row's siblings: the other members of its group, the MAX_SIBLINGS nearest in row order
        for b in range(B):
            m = members[group[b]]
            at = bisect.bisect_left(m, b)  # members are in row order
            lo = max(0, min(at - MAX_SIBLINGS // 2, len(m) - MAX_SIBLINGS - 1))
            rows.append([i for i in m[lo:lo + MAX_SIBLINGS + 1] if i != b][:MAX_SIBLINGS])
        self.group, self.n_siblings = group, [len(r) for r in rows]  # on the host, by original row
        self._siblings_done(range(B))
        S = max(1, max(map(len, rows)))
        self.siblings = torch.tensor([r + [-1] * (S - len(r)) for r in rows], dtype=torch.long, device=self.tokens.device)

    def _siblings_done(self, running):
        """siblings_done: every running row (original ids) has siblings and all of them have finished,
        i.e. no two running rows share a group. The host knows it from compact's read."""
        groups = [self.group[i] for i in running]
        self.siblings_done = len(set(groups)) == len(groups) and all(self.n_siblings[i] for i in running)

    def group_texts(self):
        """The texts of every row, running rows as they are now: (R, width) tokens, (R,) lengths."""
        return (self.texts.index_copy(0, self.row_id, self.tokens),
                self.text_len.index_copy(0, self.row_id, self.n_tokens))

    @property
    def batch_size(self):
        return self.row_id.shape[0]

    def _at(self, positions):
        """This step picks tokens at positions (B, T): with "gumbel", keep their seeds and, where the
        vocabulary fits one chunk, make their noise now, once for every choice the step makes there
        (a speculative step's drafts and its verify pass)."""
        self.step_seeds = self.noise = None
        if self.sampler == "gumbel" and self.temperature > 0:
            self.step_seeds = self.seeds.gather(1, positions)  # (B, T)
            if self.target.config.vocab_size <= NOISE_CHUNK:
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
        back; draft i is the sampler's choice at position L + 1 + i, with the step's noise there."""
        B = self.batch_size
        if self.dcache is None:  # the switch to SD: the drafter reads every recorded hidden state
            self.dcache = drafter.new_cache(B, max_len=self.cache.max_len, dtype=self.cache.kv.dtype)
            self.unread = self.longest
        # catch up: each row re-reads its last T pairs (h_j, x_{j+1}), j < L, T a bound on how many it
        # has not read (pairs it had read are rewritten with the values they had); a row with L < T
        # also reads padding past L: dead entries, rolled back below
        T = min(self.unread, self.longest - 1)
        L = self.n_tokens - 1  # (B,) the target cache length
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
        """Move finished rows to `results` and drop them from every tensor and cache.
        Returns the number of rows still running."""
        B = self.batch_size
        if B == 0:
            return 0
        # sync: the one read of every step: which rows finished (the host must know to shrink the
        # batch), with every row's length (the longest makes the next windows exact)
        done, n_tokens, prompt_len, row_id = torch.stack((self.done, self.n_tokens, self.prompt_len, self.row_id)).tolist()
        self.longest = max(n_tokens)
        finished = [b for b in range(B) if done[b]]
        if not finished:
            return B
        ids = self.row_id[finished]
        self.texts[ids], self.text_len[ids] = self.tokens[finished], self.n_tokens[finished]  # a sibling's text stays
        responses = self.tokens[finished].tolist()  # sync: the finished rows' tokens
        for b, row in zip(finished, responses):
            n, plen = n_tokens[b], prompt_len[b]
            self.results[row_id[b]] = Sample(row[plen:n], self.tokens[b, :n].clone(), self.hidden[b, :n - 1].clone(), plen)
        # the live rows past the new end fill the holes that finished rows leave before it, so the
        # caches copy a few rows instead of all of them (KVCache.keep); row_id keeps the order
        live = [b for b in range(B) if not done[b]]
        keep = list(range(len(live)))
        for hole, row in zip([b for b in finished if b < len(live)], [b for b in live if b >= len(live)]):
            keep[hole] = row
        rows = torch.tensor(keep, dtype=torch.long, device=self.tokens.device)
        for name in ("tokens", "hidden", "prompt_len", "end", "row_id", "n_tokens", "done", "seeds"):
            if getattr(self, name) is not None:
                setattr(self, name, getattr(self, name)[rows])
        self.cache.keep(keep)
        self._siblings_done([row_id[b] for b in keep])
        if self.dcache is not None:
            self.dcache.keep(keep)
        self.longest = max((n_tokens[b] for b in keep), default=0)
        return self.batch_size

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
