"""Lossless speculative decoding, batched, in plain PyTorch.

The pieces, in the order one speculative step uses them:

1. `probs(logits, temperature)`: softmax at a temperature; temperature 0 is greedy (one-hot).
2. Drafting: the drafter first catches up on the target hidden states it has not read yet (a
   ragged number per row), then proposes k tokens, feeding its own predicted hidden state back.
3. Verification: the target reads [pending token, d_1..d_k] in one forward pass (T = k + 1).
4. The verify rule, one of two samplers (both lossless; greedy decoding is the same in both):
   - "rejection", `verify`: exact rejection sampling (Leviathan et al. 2023, Chen et al. 2023).
     Draft d_i is kept with probability min(1, p(d_i) / q(d_i)); at the first rejection the next
     token is drawn from normalise(max(p - q, 0)); if all k are kept, from p at position k+1.
     The emitted tokens are then distributed exactly as the target's own samples.
   - "gumbel", `verify_gumbel`: exact-token sampling. Every row has a key, and the token at
     position t is argmax(logits_t / T + g(key, t)), where g is a vector of Gumbel(0, 1) noise,
     one value per token id, computed from (key, t, token id) by a counter-based hash
     (`gumbel_noise`). By the Gumbel-max trick that argmax is a sample of softmax(logits_t / T),
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

Host-device syncs are marked "sync:". On a CPU they are free; on a GPU there are a few per step
(finding finished rows and the attention window), which is the price of a truly shrinking batch.

Test: python -m pytest tests/test_speculative.py
"""
import functools
from dataclasses import asdict, dataclass, field
from typing import NamedTuple

import torch
import torch.nn.functional as F

from drafter import NgramDrafter


def probs(logits, temperature):
    """(..., V) logits -> (..., V) float32 probabilities; temperature 0 gives one-hot argmax."""
    if temperature == 0:
        return F.one_hot(logits.argmax(-1), logits.shape[-1]).float()
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


def row_streams(keys):
    """keys (B,) int64 >= 0 -> (B,) where each row's noise stream starts: a hash of its 64-bit key.
    A RunningBatch computes it once per row, not once per decoding step."""
    return _mix32_(_mix32_(keys >> 32) ^ (keys & MASK32))


def gumbel_noise(keys, positions, vocab_size):
    """keys (B,) int64 >= 0 and positions (B, T) int64 -> (B, T, V) float32 Gumbel(0, 1) noise, a
    pure function of (key, position, token id): the counter-based generator of the "gumbel" sampler."""
    return stream_noise(row_streams(keys), positions, vocab_size)


def stream_noise(streams, positions, vocab_size, lo=0, hi=None):
    """`gumbel_noise` from the rows' `row_streams`, for token ids lo..hi-1 (default: all). A row's
    stream steps by a constant per position (SplitMix's construction); each (row, position) seed
    is then hashed with each token's own hash. The top 23 bits make a uniform in (0, 1), so the
    noise lies in [-2.8, 16.7] and a token less likely than about 4e-9 times the most likely one
    is never drawn: float32 resolution, like torch.rand's."""
    seed = _mix32_((streams[:, None] + positions * 0x9E3779B9) & MASK32)  # (B, T)
    bits = _mix32_(seed[..., None] ^ _token_hashes(vocab_size, streams.device)[lo:hi])  # (B, T, hi - lo)
    u = ((bits >> 9).float() + 0.5).mul_(2.0 ** -23)  # in (0, 1): never 0 or 1
    return u.log_().neg_().log_().neg_()  # -log(-log(u))


def gumbel_argmax(logits, temperature, noise):
    """(..., V) logits and their (..., V) `gumbel_noise` -> (...) tokens: argmax(logits / T + noise),
    a sample of softmax(logits / T) fixed by the noise; temperature 0 is plain argmax (noise unused).
    In float32 whatever the logits' dtype: bf16 would coarsen the noise, and the token would no
    longer be an exact sample."""
    if temperature == 0:
        return logits.argmax(-1)
    return (logits.float() / temperature + noise).argmax(-1)


NOISE_CHUNK = 8192  # token ids per chunk: at most B * T * 8192 noise values (int64 while hashed) at once


def gumbel_choose(logits, temperature, streams, positions, chunk=NOISE_CHUNK):
    """logits (B, T, V) of the tokens at positions (B, T) of rows with `row_streams` -> (B, T):
    `gumbel_argmax` with the noise made chunk by chunk over the vocabulary, a running max across
    chunks, so a step never holds (B, T, V) noise at once (0.7 GB in int64 at V = 150k, B = 64,
    T = 9). The same tokens: within a chunk and across chunks the first maximum wins."""
    if temperature == 0:
        return logits.argmax(-1)
    V = logits.shape[-1]
    best_val = best_idx = None
    for lo in range(0, V, chunk):
        hi = min(lo + chunk, V)
        val, idx = (logits[..., lo:hi].float() / temperature + stream_noise(streams, positions, V, lo, hi)).max(-1)
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
    n_accepted = accept.long().cumprod(dim=1).sum(dim=1)  # (B,) length of the accepted prefix
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
    noisy argmax at the same positions and one more) -> n_accepted (B,), next_token (B,). Row b
    keeps its drafts up to the first that differs from the target's token, then emits the
    target's token there: exactly the tokens plain decoding would have produced."""
    k = draft_tokens.shape[1]
    n_accepted = (draft_tokens == target_tokens[:, :k]).long().cumprod(dim=1).sum(dim=1)  # (B,)
    return n_accepted, target_tokens.gather(1, n_accepted[:, None])[:, 0]


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

    sampler "rejection" draws from `generator`; sampler "gumbel" picks every token from the row's
    key (keys[b], any int64 >= 0) and the token's position, and draws nothing from `generator`
    except, when keys is None, one base key for rows base, base + 1, ..."""

    def __init__(self, target, prompts, max_new_tokens, *, temperature=1.0, eos_id=None,
                 generator=None, max_draft=0, sampler="rejection", keys=None):
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("prompts must be a non-empty list of non-empty token lists")
        if sampler not in SAMPLERS:
            raise ValueError(f"sampler must be one of {SAMPLERS}, got {sampler!r}")
        if keys is not None and len(keys) != len(prompts):
            raise ValueError(f"{len(keys)} keys for {len(prompts)} prompts")
        if max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be positive, got {max_new_tokens}")
        longest = max(len(p) for p in prompts)
        need = longest + max_new_tokens + max_draft  # the verify pass writes k positions past the end
        if need > target.config.block_size:
            raise ValueError(f"prompt ({longest}) + max_new_tokens ({max_new_tokens}) + draft ({max_draft}) "
                             f"= {need} exceeds block_size {target.config.block_size}")
        self.target, self.temperature, self.eos_id, self.generator = target, temperature, eos_id, generator
        self.max_new_tokens = max_new_tokens
        dev = target.wte.weight.device
        B, width = len(prompts), need + 1
        self.tokens = torch.zeros(B, width, dtype=torch.long, device=dev)
        for b, p in enumerate(prompts):
            self.tokens[b, :len(p)] = torch.tensor(p, device=dev)
        self.prompt_len = torch.tensor([len(p) for p in prompts], device=dev)
        self.hidden = torch.zeros(B, width, target.config.n_embd, device=dev, dtype=target.wte.weight.dtype)
        self.row_id = torch.arange(B, device=dev)
        self.sampler = sampler
        if keys is None:  # "rejection" never reads them, so it draws nothing for them
            keys = torch.arange(B) + (int(torch.randint(2 ** 62, (1,), generator=generator, device=dev))
                                      if sampler == "gumbel" else 0)
        elif min(keys) < 0:
            raise ValueError("keys must be non-negative")
        self.streams = row_streams(torch.as_tensor(keys, dtype=torch.long).to(dev))  # (B,), one per row
        self.cache = target.new_cache(B, max_len=need)
        self.dcache = None  # the drafter's cache, made on the first speculative step
        self.results = [None] * B  # per original row, a Sample once it has finished
        # prefill: each distinct prompt once (a GRPO group repeats its prompt G times), padded, in
        # one pass; then copy its cache entries to the rows that share it and roll each row back
        # to its true length. Every row then samples its own first token.
        distinct, inverse = torch.unique(torch.cat([self.prompt_len[:, None], self.tokens[:, :longest]], 1), dim=0,
                                         return_inverse=True)  # (U, 1 + longest): length, then the padded prompt
        once = target.new_cache(distinct.shape[0], max_len=longest)
        logits, hidden = target(distinct[:, 1:], once)  # (U, T, V), (U, T, C)
        self.cache.kv[..., :longest, :] = once.kv[:, :, inverse]
        self.cache.lengths = self.prompt_len.clone()
        self.hidden[:, :longest] = hidden[inverse]
        last = logits[inverse, self.prompt_len - 1]  # (B, V)
        first = self._choose(last[:, None], self.prompt_len[:, None])[:, 0]
        self.n_tokens = self.prompt_len.clone()
        self.done = torch.zeros(B, dtype=torch.bool, device=dev)
        self._append(first[:, None], torch.ones_like(first))

    @property
    def batch_size(self):
        return self.row_id.shape[0]

    def _noise(self, positions):
        """The "gumbel" sampler's noise (B, T, V) for the tokens at positions (B, T); a speculative
        step makes it once for its drafts and its verify pass. None for rejection sampling, greedy
        decoding, or a vocabulary past NOISE_CHUNK (then each choice is made chunk by chunk)."""
        V = self.target.config.vocab_size
        if self.sampler != "gumbel" or self.temperature == 0 or V > NOISE_CHUNK:
            return None
        return stream_noise(self.streams, positions, V)

    def _choose(self, logits, positions, noise=None):
        """The target's tokens: logits (B, T, V) for the tokens at positions (B, T) -> (B, T).
        noise: `_noise(positions)`, when the caller made it already."""
        if self.sampler == "rejection":
            return draw(probs(logits.flatten(0, 1), self.temperature), self.generator).view(logits.shape[:2])
        noise = self._noise(positions) if noise is None else noise
        if noise is None and self.temperature > 0:  # a vocabulary too large to hold the noise at once
            return gumbel_choose(logits, self.temperature, self.streams, positions)
        return gumbel_argmax(logits, self.temperature, noise)

    def _append(self, new, n_new):
        """Write new (B, W) tokens, of which row b keeps its first n_new[b], after each row's end;
        truncate at <|eos|> and at max_new_tokens and mark those rows done."""
        B, W = new.shape
        offs = torch.arange(W, device=new.device)
        pos = self.n_tokens[:, None] + offs  # (B, W)
        self.tokens.scatter_(1, pos, new)  # writes past n_new land beyond the row's end: dead
        keep = offs[None] < n_new[:, None]
        if self.eos_id is not None:  # cut after the first <|eos|>
            is_eos = keep & (new == self.eos_id)
            first_eos = torch.where(is_eos.any(1), is_eos.float().argmax(1), W)
            keep &= offs[None] <= first_eos[:, None]
            self.done |= is_eos.any(1)
        budget = self.prompt_len + self.max_new_tokens - self.n_tokens
        n_kept = torch.minimum(keep.sum(1), budget)
        self.n_tokens = self.n_tokens + n_kept
        self.done |= self.n_tokens >= self.prompt_len + self.max_new_tokens
        return n_kept

    @torch.no_grad()
    def plain_step(self):
        """One token for every running row. Returns the number of tokens emitted."""
        pending = self.tokens.gather(1, (self.n_tokens - 1)[:, None])  # (B, 1)
        logits, hidden = self.target(pending, self.cache)  # (B, 1, V), (B, 1, C)
        self.hidden[torch.arange(self.batch_size, device=hidden.device), self.n_tokens - 1] = hidden[:, 0]
        nxt = self._choose(logits, self.n_tokens[:, None])  # (B, 1)
        return self._append(nxt, torch.ones_like(nxt[:, 0]))

    def _draft(self, drafter, k, L, positions, noise):
        """The learned drafter's k tokens per row (B, k), and with "rejection" their distributions
        q (B, k, V) (None with "gumbel"). It first catches up on the target hidden states it has
        not read, then drafts, feeding its own predicted hidden state back."""
        B, dev = self.batch_size, self.tokens.device
        rows = torch.arange(B, device=dev)
        if self.dcache is None:  # switch to SD: fill the drafter cache from recorded hidden states
            self.dcache = drafter.new_cache(B, max_len=self.cache.max_len)
        # catch up: pairs (h_j, x_{j+1}) for j = dcache.lengths .. L-1, a ragged count per row
        start = self.dcache.lengths
        n_new = L - start  # (B,) >= 1
        T = int(n_new.max())  # sync: the padded width of the catch-up
        j = start[:, None] + torch.arange(T, device=dev)  # (B, T)
        j = torch.minimum(j, L[:, None])  # padding reads position L: dead entries, rolled back below
        logits, h_pred = drafter(self.hidden[rows[:, None], j], self.tokens.gather(1, j + 1), self.dcache)
        self.dcache.lengths = L.clone()  # roll the padding back
        last = (n_new - 1)[:, None, None]
        q_logits = logits.gather(1, last.expand(B, 1, logits.shape[-1]))[:, 0]  # (B, V)
        h = h_pred.gather(1, last.expand(B, 1, h_pred.shape[-1]))  # (B, 1, C)
        # draft k tokens, feeding the drafter its own hidden state; draft i goes to position L + 1 + i
        drafts, qs = [], []
        for i in range(k):
            if self.sampler == "rejection":
                q = probs(q_logits, self.temperature)
                d = draw(q, self.generator)
                qs.append(q)
            else:  # the noise the target will see at that position, on the drafter's logits
                at = slice(i, i + 1)
                d = self._choose(q_logits[:, None], positions[:, at], None if noise is None else noise[:, at])[:, 0]
            drafts.append(d)
            if i + 1 < k:
                q_logits, h = drafter(h, d[:, None], self.dcache)
                q_logits = q_logits[:, 0]
        self.dcache.lengths = L.clone()  # entries built on guessed states are redone next step
        return torch.stack(drafts, dim=1), torch.stack(qs, dim=1) if qs else None

    @torch.no_grad()
    def speculative_step(self, drafter, k):
        """Draft k tokens per row, verify them in one target pass, keep a ragged number per row.
        `drafter` is a learned drafter.Drafter, or a drafter.NgramDrafter (no model: its drafts
        are one-hot proposals). Returns (tokens emitted per row, drafts accepted per row)."""
        B, dev = self.batch_size, self.tokens.device
        rows = torch.arange(B, device=dev)
        L = self.n_tokens - 1  # target cache length; tokens[L] is pending
        positions = L[:, None] + 1 + torch.arange(k + 1, device=dev)  # (B, k+1): the drafts', then the bonus token's
        noise = self._noise(positions)
        # 1. draft k tokens per row
        if isinstance(drafter, NgramDrafter):  # model-free: look the drafts up in the row's own tokens
            draft = drafter.propose(self.tokens, self.n_tokens, k)  # (B, k)
            q = F.one_hot(draft, self.target.config.vocab_size).float() if self.sampler == "rejection" else None
        else:
            draft, q = self._draft(drafter, k, L, positions, noise)
        # 2. verify: the target reads the pending token and the k drafts in one pass
        pending = self.tokens.gather(1, L[:, None])  # (B, 1)
        t_logits, t_hidden = self.target(torch.cat([pending, draft], dim=1), self.cache)  # (B, k+1, .)
        if self.sampler == "rejection":
            n_acc, nxt = verify(draft, q, probs(t_logits, self.temperature), self.generator)
        else:
            n_acc, nxt = verify_gumbel(draft, self._choose(t_logits, positions, noise))
        # 3. keep a ragged number per row: the tokens accepted + next; all k+1 states are written, and those of
        # rejected drafts are dead (past the row's end, overwritten later)
        self.hidden[rows[:, None], L[:, None] + torch.arange(k + 1, device=dev)] = t_hidden
        emitted = torch.cat([draft, torch.zeros_like(nxt)[:, None]], dim=1)
        emitted.scatter_(1, n_acc[:, None], nxt[:, None])
        n_emitted = self._append(emitted, n_acc + 1)
        self.cache.lengths = self.n_tokens - 1  # roll the rejected drafts back
        return n_emitted, n_acc

    def compact(self):
        """Move finished rows to `results` and drop them from every tensor and cache.
        Returns the number of rows still running."""
        if not bool(self.done.any()):  # sync: which rows finished
            return self.batch_size
        for b in self.done.nonzero()[:, 0].tolist():
            n, plen = int(self.n_tokens[b]), int(self.prompt_len[b])
            self.results[int(self.row_id[b])] = Sample(self.tokens[b, plen:n].tolist(), self.tokens[b, :n].clone(),
                                                       self.hidden[b, :n - 1].clone(), plen)
        # the live rows past the new end fill the holes that finished rows leave before it, so the
        # caches copy a few rows instead of all of them (KVCache.keep); row_id keeps the order
        live = (~self.done).nonzero()[:, 0]
        keep = torch.arange(live.shape[0], device=live.device)
        keep[self.done[:keep.shape[0]]] = live[live >= keep.shape[0]]
        for name in ("tokens", "hidden", "prompt_len", "row_id", "n_tokens", "done", "streams"):
            setattr(self, name, getattr(self, name)[keep])
        self.cache.keep(keep)
        if self.dcache is not None:
            self.dcache.keep(keep)
        return self.batch_size

    def outputs(self):
        return [r.response for r in self.results]


@dataclass
class DecodeStats:
    """What a generate call or a rollout measured, summed over its steps."""
    steps: int = 0          # decoding steps (plain or speculative)
    tokens: int = 0         # tokens emitted, all rows
    sd_row_steps: int = 0   # (row, speculative step) pairs
    sd_tokens: int = 0      # tokens emitted by speculative steps
    drafted: int = 0        # draft tokens proposed
    accepted: int = 0       # draft tokens accepted
    accept_hist: dict = field(default_factory=dict)  # drafts accepted by one row in one step -> how often

    def add_step(self, n_emitted):
        self.steps += 1
        self.tokens += int(n_emitted.sum())

    def add_speculative(self, n_emitted, n_acc, k):
        self.sd_row_steps += int(n_emitted.numel())
        self.sd_tokens += int(n_emitted.sum())
        self.drafted += k * int(n_acc.numel())
        self.accepted += int(n_acc.sum())
        for a in n_acc.tolist():
            self.accept_hist[a] = self.accept_hist.get(a, 0) + 1

    @property
    def accept_len(self):  # tokens per row per verify step: accepted drafts plus the target's own
        return self.sd_tokens / self.sd_row_steps if self.sd_row_steps else None

    @property
    def accept_rate(self):  # accepted drafts per drafted token
        return self.accepted / self.drafted if self.drafted else None

    def as_dict(self):
        """The generate functions' `stats`: every field, accept_len and accept_rate."""
        return {**asdict(self), "accept_hist": dict(sorted(self.accept_hist.items())), "accept_len": self.accept_len,
                "accept_rate": self.accept_rate}


@torch.no_grad()
def autoregressive_generate(target, prompts, max_new_tokens, *, temperature=1.0, eos_id=None, generator=None,
                            sampler="rejection", keys=None):
    """Plain decoding, one token per row per target pass; finished rows leave the batch.
    sampler and keys: see RunningBatch."""
    batch = RunningBatch(target, prompts, max_new_tokens, temperature=temperature, eos_id=eos_id, generator=generator,
                     sampler=sampler, keys=keys)
    stats = DecodeStats()
    while batch.compact() > 0:
        stats.add_step(batch.plain_step())
    return batch.outputs(), stats.as_dict()


@torch.no_grad()
def speculative_generate(target, drafter, prompts, max_new_tokens, *, k=4, temperature=1.0, eos_id=None,
                         generator=None, sampler="rejection", keys=None):
    """Speculative decoding with a fixed k for every row and every step. With sampler "gumbel"
    and the same keys (or the same generator seed) it emits exactly autoregressive_generate's tokens."""
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    batch = RunningBatch(target, prompts, max_new_tokens, temperature=temperature, eos_id=eos_id,
                     generator=generator, max_draft=k, sampler=sampler, keys=keys)
    stats = DecodeStats()
    while batch.compact() > 0:
        n_emitted, n_acc = batch.speculative_step(drafter, k)
        stats.add_step(n_emitted)
        stats.add_speculative(n_emitted, n_acc, k)
    return batch.outputs(), stats.as_dict()
