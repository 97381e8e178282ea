"""The drafter: one transformer layer (by default) on the target's hidden states (EAGLE style).

At position t it fuses the target's final hidden state h_t (the LM head's input) with the
embedding of the next token x_{t+1}, and predicts h_{t+1}, which the target's own LM head turns into
logits for x_{t+2}. Drafting several tokens, it feeds its predicted state back in place of the
target's:

    (h_t, x_{t+1}) -> in_proj -> 1 block -> norm -> h~_{t+1} -> lm_head -> x_{t+2}

The embedding and LM head are the target's, read through a plain attribute and detached: neither
trained nor saved here. The loss is EAGLE's: smooth-L1 on h_{t+1} (weight 1.0: a whole vector of
signal per position) plus a soft cross-entropy against the target's distribution (0.1: the part
that decides acceptance), counted on response positions only; each padded row holds one sequence.

Training as it drafts: teacher forcing alone shows the drafter only real states, and a drafter
trained so is good for one token and guesses after it. So a step runs the drafter DEPTH drafts deep
from every position at once (`chained_states`, EAGLE-3's training-time test), each pass reading the
previous pass's predictions and attending to exactly what its cache holds when it drafts there.

The buffer keeps the last steps' (tokens, hidden states) within a token bound; `train_step` serves
the warm-up and the idle ranks alike.

Test: python -m pytest tests/test_drafter.py
"""
import bisect
import math
from collections import OrderedDict, deque

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from model import KVCache, LayerNorm, RotaryStack

HIDDEN_WEIGHT = 1.0
CE_WEIGHT = 0.1
DEPTH = 3  # chained passes per training step


class Drafter(nn.Module):
    def __init__(self, target, n_layer=1):
        super().__init__()
        self.config, self.n_layer = target.config, n_layer
        C = self.config.n_embd
        self.__dict__["target"] = target  # shared, frozen, out of state_dict() and parameters()
        self.in_proj = nn.Linear(2 * C, C, bias=False)
        self.stack = RotaryStack(self.config, n_layer)
        self.norm = LayerNorm(C)
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, mean=0.0, std=0.02)

    def forward(self, hidden, next_tokens, cache=None):
        """hidden (B, T, C) = h_t, next_tokens (B, T) = x_{t+1}
        -> logits (B, T, V), h~_{t+1} (B, T, C)."""
        emb = F.embedding(next_tokens, self.target.wte.weight.detach())  # (B, T, C)
        h_pred = self.norm(self.stack(self.project_in(hidden, emb), cache))
        return F.linear(h_pred, self.target.lm_head.weight.detach()), h_pred

    def project_in(self, hidden, emb):
        """The residual stream's start, in the weights' dtype (float32 under bf16 autocast)."""
        return self.in_proj(torch.cat([hidden, emb], dim=-1)).to(self.in_proj.weight.dtype)

    def propose(self, batch, k):
        """k drafts per row of a speculative.RunningBatch (B, k) and, with rejection sampling, their
        distributions q (B, k, V). It first catches up on the target states it has not read, then
        drafts, feeding back its own predicted state; draft i is the batch sampler's choice at
        position L + 1 + i. Its cache lives on the batch, which moves it with the rows."""
        B, L = batch.batch_size, batch.n_tokens - 1  # L (B,): the target cache's length
        if batch.draft_cache is None:  # the switch to SD: no recorded state read yet
            batch.draft_cache = self.new_cache(B, batch.cache.max_len, dtype=batch.cache.kv.dtype)
            batch.unread_states_bound = batch.n_tokens_bound
        cache = batch.draft_cache
        # catch up: each row re-reads its last T pairs (h_j, x_{j+1}), j < L, T a bound on those it
        # has not read; a row with L < T also reads padding past L: dead entries, rolled back below
        T = min(batch.unread_states_bound, batch.n_tokens_bound - 1)
        start = (L - T).clamp_(min=0)  # (B,)
        j = start[:, None] + batch.cache.offsets[:T]  # (B, T)
        cache.lengths, cache.read_len = start, batch.n_tokens_bound - 1
        rows = batch.cache.slots[:, None]
        logits, h = self(batch.hidden[rows, j], batch.tokens.gather(1, j + 1), cache)
        last = (L - 1 - start)[:, None, None]  # (B, 1, 1): the column of pair L - 1
        logits = logits.gather(1, last.expand(B, 1, logits.shape[-1]))  # (B, 1, V)
        h = h.gather(1, last.expand(B, 1, h.shape[-1]))  # (B, 1, C)
        cache.lengths = L
        drafts, qs = [], []
        for i in range(k):  # draft k tokens, feeding back its own state
            d, q = batch.sampler.choose(logits, slice(i, i + 1))  # (B, 1), (B, 1, V) or None
            drafts.append(d)
            qs.append(q)
            if i + 1 < k:
                cache.read_len = batch.n_tokens_bound + i
                logits, h = self(h, d, cache)  # (B, 1, V), (B, 1, C)
        cache.lengths = L  # entries built on guessed states are redone next step
        batch.unread_states_bound = 0  # the step that drafted adds its own tokens
        return torch.cat(drafts, 1), None if qs[0] is None else torch.cat(qs, 1)

    def new_cache(self, batch_size, max_len=None, device=None, dtype=None):
        p = self.in_proj.weight
        return KVCache(self.config, batch_size, max_len or self.config.block_size,
                       device=device or p.device, dtype=dtype or p.dtype, n_layer=self.n_layer)


class DrafterBuffer:
    """(tokens, target hidden states) of the last `keep_steps` RL steps, at most `keep_tokens`
    tokens in all (None: no bound), the oldest dropped first. A rollout's rows are only staged on
    the critical path (`add_rows`, no copy); idle turns store them on the host in pieces
    (`store_staged`, in `dtype`). Both bounds count staged and stored rows together, at once, so a
    rank that never idles holds no more. Stored sequences are kept in length order (`by_len`).

    An approximation: a stored row's hidden states are the target's of the step that sampled it, up
    to keep_steps RL steps ago, while the loss reads them through today's LM head (shared with the
    target). Recomputing them would cost a target forward per stored row; each RL step moves the
    target by one small optimizer step, and the window trades fresh rows against more of them."""

    def __init__(self, keep_steps=32, keep_tokens=None, dtype=torch.float32):
        self.keep_steps, self.keep_tokens, self.dtype = keep_steps, keep_tokens, dtype
        self.stored = OrderedDict()  # serial -> (step, tokens (N,), hidden (N-1, C), prompt_len)
        self.by_len = []  # sorted (N, serial) of the stored sequences
        self.staged = deque()  # (step, FinishedRow) not yet stored, oldest first
        self.stored_tokens = self.staged_tokens = 0
        self.newest, self.serial = -math.inf, 0

    @property
    def items(self):
        """The stored sequences, oldest first (a copy of the list)."""
        return list(self.stored.values())

    def held_tokens(self):
        return self.stored_tokens + self.staged_tokens

    def add(self, step, tokens, hidden, prompt_len):
        """Store one sequence now; hidden[j] is the target's state after reading tokens[j]."""
        if hidden.shape[0] != tokens.shape[0] - 1:
            raise ValueError(f"need one hidden state per token but the last: {tokens.shape[0]} "
                             f"tokens, {hidden.shape[0]} states")
        n = tokens.shape[0]
        hidden = hidden.detach().to(self.dtype).cpu()
        self.stored[self.serial] = (step, tokens.cpu(), hidden, int(prompt_len))
        bisect.insort(self.by_len, (n, self.serial))
        self.serial += 1
        self.stored_tokens += n
        self._bound(step)

    def add_rows(self, step, rows):
        """A rollout's finished rows (speculative.FinishedRow), staged without a copy."""
        for r in rows:
            self.staged.append((step, r))
            self.staged_tokens += r.tokens.shape[0]
        self._bound(step)

    def store_staged(self, max_tokens=None):
        """Store staged rows, oldest first, about max_tokens tokens of them (at least one row):
        one idle piece. Returns the tokens stored."""
        done = 0
        while self.staged and (done == 0 or max_tokens is None
                               or done + self.staged[0][1].tokens.shape[0] <= max_tokens):
            step, r = self.staged.popleft()
            self.staged_tokens -= r.tokens.shape[0]
            done += r.tokens.shape[0]
            self.add(step, r.tokens, r.hidden, r.prompt_len)
        return done

    def _bound(self, step):
        """Drop the oldest sequences, stored ones first, while one is older than the last
        keep_steps steps or the held tokens exceed keep_tokens; the newest always stays."""
        self.newest = max(self.newest, step)

        def too_much(oldest_step):
            over = self.keep_tokens is not None and self.held_tokens() > self.keep_tokens
            return oldest_step <= self.newest - self.keep_steps or (
                over and len(self.stored) + len(self.staged) > 1)
        while self.stored and too_much(next(iter(self.stored.values()))[0]):
            serial, (_, tokens, _, _) = self.stored.popitem(last=False)
            del self.by_len[bisect.bisect_left(self.by_len, (tokens.shape[0], serial))]
            self.stored_tokens -= tokens.shape[0]
        while not self.stored and self.staged and too_much(self.staged[0][0]):
            self.staged_tokens -= self.staged.popleft()[1].tokens.shape[0]

    def __len__(self):
        return len(self.stored)

    def num_tokens(self):
        return self.stored_tokens

    def sample(self, batch_size, rng, device="cpu", max_tokens=None):
        """A padded batch (`pair_batch`) of a window of the length-ordered sequences: long-tailed
        lengths batched uniformly would be mostly padding. The window's start is uniform over
        -(batch_size - 1) .. len - 1, so every sequence, the longest too, is drawn equally often.
        max_tokens: only the window's longest that fit in that many padded positions (>= 1)."""
        start = rng.randrange(-(batch_size - 1), len(self.by_len))
        window = self.by_len[max(start, 0):start + batch_size]
        chosen = [self.stored[serial] for _, serial in window]
        if max_tokens is not None:
            chosen = chosen[-max(1, max_tokens // chosen[-1][1].shape[0]):]
        return pair_batch([(tokens, hidden, plen) for _, tokens, hidden, plen in chosen], device)


def pair_batch(seqs, device="cpu"):
    """A batch of the training pairs of whole sequences, one per row, right-padded. seqs: (tokens
    (N,), hidden (N-1, C), prompt_len). Row b, position t holds (h_t, x_{t+1}) with target h_{t+1}:

        tokens   x_0  x_1  x_2 ... x_{N-1}         (x_{N-1}, the last, is never read)
        hidden   h_0  h_1  h_2 ... h_{N-2}
        pair t   (h_t, x_{t+1}) -> h_{t+1}, and so x_{t+2},  t = 0 .. N-3

    mask[b, t] from t = prompt_len - 1 on: x_{t+2} is a response token after the first, what the
    drafter drafts. -> h_in (B, T, C), x_next (B, T), h_tgt (B, T, C), mask (B, T) bool."""
    T = max(h.shape[0] for _, h, _ in seqs) - 1  # pairs per sequence: one fewer than states
    B, C = len(seqs), seqs[0][1].shape[1]
    h_in, h_tgt = torch.zeros(B, T, C), torch.zeros(B, T, C)
    x_next = torch.zeros(B, T, dtype=torch.long)
    mask = torch.zeros(B, T, dtype=torch.bool)
    for b, (tokens, hidden, plen) in enumerate(seqs):
        n = hidden.shape[0] - 1
        h_in[b, :n] = hidden[:-1]
        x_next[b, :n] = tokens[1:n + 1]
        h_tgt[b, :n] = hidden[1:]
        mask[b, max(plen - 1, 0):n] = True
    return h_in.to(device), x_next.to(device), h_tgt.to(device), mask.to(device)


def chain_attention_mask(T, d, device=None):
    """Chained pass d's attention mask over the keys of passes 0..d, (T, (d + 1) T) bool: its
    entry at t is the d-th draft after the real pair at s = t - d, when the drafter's cache holds
    the real pairs up to s and this chain's own entries at s + 1 .. t."""
    t = torch.arange(T, device=device)[:, None]  # (T, 1) query positions
    u = torch.arange(T, device=device)[None, :]  # (1, T) key positions
    return torch.cat([u <= t - d] + [u == t - d + j for j in range(1, d + 1)], dim=1)


def chained_states(drafter, h_in, x_next, depth):
    """The drafter run as it drafts, `depth` deep from every position at once, one pass at a time
    (a generator: a caller may stop between passes). Pass 0 reads the target's states; pass d reads
    at t what pass d - 1 predicted at t - 1. Yields each pass's predicted states h~ (B, T, C)."""
    emb = F.embedding(x_next, drafter.target.wte.weight.detach())  # (B, T, C)
    T = h_in.shape[1]
    past = [[] for _ in drafter.stack.blocks]  # every pass's keys and values, per block
    h_feed = h_in
    for d in range(depth):
        x = drafter.project_in(h_feed, emb)
        mask = chain_attention_mask(T, d, h_in.device)
        state = drafter.norm(drafter.stack(x, chain=(past, mask)))
        yield state
        # the next pass sees, at position t, this pass's guess of h_t (made at t - 1)
        h_feed = torch.cat([h_in[:, :1], state[:, :-1].detach()], dim=1)


def chain_loss_masks(mask, depth):
    """The positions pass d counts: mask[t] and mask[t - d] (its chain starts at a pair the drafter
    drafts from). -> list of `depth` (B, T) bool."""
    masks = [mask]
    for d in range(1, depth):
        masks.append(torch.zeros_like(mask))
        masks[d][:, d:] = mask[:, d:] & mask[:, :-d]  # none where a row is d or fewer pairs long
    return masks


def drafter_loss(drafter, h_in, x_next, h_tgt, mask, n_positions=None, depth=DEPTH,
                 preempted=None):
    """The loss of `depth` chained passes, summed over each pass's positions and divided by
    depth x n_positions (default: this batch's count). preempted: asked between passes; once True,
    the loss is abandoned (None)."""
    with torch.no_grad():  # both softmaxes in float32
        p_target = F.softmax(F.linear(h_tgt, drafter.target.lm_head.weight).float(), dim=-1)
    n = mask.sum() if n_positions is None else torch.as_tensor(float(n_positions))
    total = 0.0
    passes = chained_states(drafter, h_in, x_next, depth)
    for h_pred, m in zip(passes, chain_loss_masks(mask, depth)):
        if preempted and preempted():
            return None
        logits = F.linear(h_pred, drafter.target.lm_head.weight.detach())
        reg = F.smooth_l1_loss(h_pred, h_tgt, reduction="none").mean(-1)  # (B, T)
        ce = -(p_target * F.log_softmax(logits.float(), dim=-1)).sum(-1)  # (B, T)
        total = total + ((HIDDEN_WEIGHT * reg + CE_WEIGHT * ce) * m).sum()
    return total / (depth * n.clamp(min=1.0))


def train_step(drafter, optimizer, batch, depth=DEPTH, sync_grads=False, preempted=None):
    """One optimizer step on a batch (`DrafterBuffer.sample`) -> (loss, applied). `preempted`,
    asked between passes and before the backward and the optimizer step, abandons it (None, False).
    sync_grads: every rank trains together (the warm-up) on the mean over all their positions.
    A step whose gradient is not finite is not applied."""
    n_local = batch[3].sum().double()  # the positions the loss counts here
    # under sync_grads the loss is a sum, divided after one all-reduce of [grads, positions]
    loss = drafter_loss(drafter, *batch, n_positions=1.0 if sync_grads else None, depth=depth,
                        preempted=preempted)
    if loss is None or (preempted and preempted()):
        return None, False
    logged = loss.item() / max(float(n_local), 1.0) if sync_grads else loss.item()
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    if preempted and preempted():
        return None, False
    if sync_grads:
        params = list(drafter.parameters())
        flat = torch.cat([p.grad.flatten().double() for p in params] + [n_local.view(1)])
        dist.all_reduce(flat)
        grads = flat[:-1] / flat[-1].clamp(min=1.0)
        for p, g in zip(params, grads.split([p.numel() for p in params])):
            p.grad.copy_(g.view_as(p))
    grad_norm = torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
    applied = bool(torch.isfinite(grad_norm))  # sync: one flag per step
    if applied:
        optimizer.step()
    return logged, applied


@torch.no_grad()
def top1_agreement(drafter, h_in, x_next, h_tgt, mask):
    """Teacher-forced top-1 agreement (it sets the drafter's online rate): over the masked
    positions, how often its argmax for x_{t+2} is the target's.
    -> (agreeing positions, positions)."""
    logits, _ = drafter(h_in, x_next)
    target = F.linear(h_tgt[mask], drafter.target.lm_head.weight)  # (positions, V)
    agree = (logits[mask].argmax(-1) == target.argmax(-1)).sum()
    return int(agree), int(mask.sum())  # sync: two counts


def make_optimizer(drafter, lr=3e-3):
    return torch.optim.AdamW(drafter.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.95))
