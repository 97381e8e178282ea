"""The drafter: one transformer layer (by default) on the target's hidden states (EAGLE style).

At position t it reads the target's final hidden state h_t (the LM head's input) and the embedding
of the next token x_{t+1}, and predicts h_{t+1}; the target's own LM head turns that into logits
for x_{t+2}. To draft several tokens it feeds its predicted state back in place of the target's:

    (h_t, x_{t+1}) -> in_proj -> 1 block -> norm -> h~_{t+1} -> lm_head -> x_{t+2}

The embedding and LM head are the target's, read through a plain attribute and detached: this
module neither trains nor saves them (GRPO trains them; the drafter reads the target's latest).
The loss is EAGLE's: smooth-L1 on h_{t+1} (weight 1.0: a whole vector of signal per position)
plus a soft cross-entropy against the target's distribution at T = 1 (0.1: the part that decides
acceptance), on response positions only, one sequence per padded row.

Teacher forcing alone shows the drafter only real states: it would be good for one token and guess
after it. So a training step runs it as it drafts, several passes deep from every position at once
(`chained_states`, EAGLE-3's training-time test; on idle ranks the rule in scheduler.py sets how
many). A *chain* is the drafts made one after another from one real pair; each pass attends to
exactly what the drafter's cache holds there.

Test: python -m pytest tests/test_drafter.py
"""
from collections import deque

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from model import Blocks, KVCache
from speculative import probs

HIDDEN_WEIGHT = 1.0
CE_WEIGHT = 0.1
DEPTH = 3  # chained passes per training step


class Drafter(nn.Module):
    def __init__(self, target, n_layer=1):
        super().__init__()
        self.config, self.n_layer = target.config, n_layer
        C = self.config.n_embd
        self.__dict__["target"] = target  # shared, out of parameters() and state_dict()
        self.in_proj = nn.Linear(2 * C, C, bias=False)
        self.stack = Blocks(self.config, n_layer)
        self.norm = nn.LayerNorm(C, bias=False)
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, mean=0.0, std=0.02)

    def forward(self, hidden, next_tokens, cache=None):
        """h_t (B, T, C), x_{t+1} (B, T) -> logits for x_{t+2} (B, T, V), h~_{t+1} (B, T, C)."""
        emb = F.embedding(next_tokens, self.target.wte.weight.detach())  # (B, T, C)
        h_pred = self.norm(self.stack(self.project_in(hidden, emb), cache))
        return F.linear(h_pred, self.target.lm_head.weight.detach()), h_pred

    def project_in(self, hidden, emb):
        """The residual stream's start, in the weights' dtype (float32 under bf16 autocast)."""
        return self.in_proj(torch.cat([hidden, emb], dim=-1)).to(self.in_proj.weight.dtype)

    def propose(self, batch, k, noise=None):
        """Draft k tokens per row of a speculative.RunningBatch -> drafts (B, k), q (B, k, V) or
        None. noise (B, k+1, V) or None: the step's, which draft i reads at column i. It reads the
        batch's tokens, hidden states and n_tokens, draws with the batch's sampler and keeps its KV
        cache in batch.draft_cache. Each row first catches up on the pairs (h_j, x_{j+1}) recorded
        since it last drafted, in one pass; then drafts from its own states."""
        B, pending_at = batch.batch_size, batch.n_tokens - 1  # (B,): the pairs before it recorded
        if batch.draft_cache is None:  # the switch to speculation: no recorded state read yet
            batch.draft_cache = self.new_cache(B, batch.cache.max_len, dtype=batch.cache.kv.dtype)
        cache, b = batch.draft_cache, torch.arange(B, device=pending_at.device)[:, None]  # (B, 1)
        start = cache.lengths  # (B,) the first pair each row has not read
        unread = int((pending_at - start).max())  # sync: the longest run of unread pairs
        j = start[:, None] + torch.arange(unread, device=pending_at.device)  # (B, unread)
        # a shorter run reads junk past its row's end (dropped below), still inside the tensors:
        # the first catch-up starts every row at 0, later runs differ by at most the last k
        logits, h = self(batch.hidden[b, j], batch.tokens[b, j + 1], cache)
        latest = (pending_at - 1 - start)[:, None]  # (B, 1): the column of the latest pair
        logits, h = logits[b, latest], h[b, latest]  # (B, 1, V), (B, 1, C)
        cache.lengths = pending_at  # drops the junk
        drafts, qs = [], []
        for i in range(k):  # draft k tokens, feeding back its own state
            noise_i = None if noise is None else noise[:, i:i + 1]  # (B, 1, V)
            d, q = batch.sampler.choose(logits, noise_i)  # (B, 1), q (B, 1, V) or None
            drafts.append(d)
            qs.append(q)
            if i + 1 < k:
                logits, h = self(h, d, cache)  # (B, 1, V), (B, 1, C)
        cache.lengths = pending_at  # entries built on its own guesses are redone next step
        return torch.cat(drafts, 1), None if qs[0] is None else torch.cat(qs, 1)

    def new_cache(self, batch_size, max_len=None, device=None, dtype=None):
        p = self.in_proj.weight
        return KVCache(self.config, batch_size, max_len or self.config.block_size,
                       device=device or p.device, dtype=dtype or p.dtype, n_layer=self.n_layer)


class DrafterBuffer:
    """The (tokens, target hidden states) of the last `keep_steps` RL steps, at most `keep_tokens`
    tokens in all (None: no bound); the oldest go first, the newest always stays. The hidden states
    are kept on the host in `dtype`.

    An approximation: a row keeps the hidden states of the step that sampled it, up to keep_steps
    RL steps ago, while the loss reads them through today's LM head. Recomputing them would cost a
    target forward per row. Each RL step moves the target by one small optimizer step, and the
    window trades fresh rows against more of them."""

    def __init__(self, keep_steps=32, keep_tokens=None, dtype=torch.float32):
        self.keep_steps, self.keep_tokens, self.dtype = keep_steps, keep_tokens, dtype
        self.items = deque()  # (step, tokens (N,), hidden (N-1, C), prompt_len), oldest first
        self.tokens = 0

    def add(self, step, tokens, hidden, prompt_len):
        """Store one sequence; hidden[j] is the target's state after reading tokens[j]."""
        if hidden.shape[0] != tokens.shape[0] - 1:
            raise ValueError(f"need one hidden state per token but the last: {tokens.shape[0]} "
                             f"tokens, {hidden.shape[0]} states")
        self.items.append((step, tokens.cpu(), hidden.detach().to(self.dtype).cpu(), prompt_len))
        self.tokens += tokens.shape[0]
        while len(self.items) > 1 and (self.items[0][0] <= step - self.keep_steps or (
                self.keep_tokens is not None and self.tokens > self.keep_tokens)):
            self.tokens -= self.items.popleft()[1].shape[0]

    def add_rows(self, step, rows):
        for r in rows:  # a rollout's speculative.FinishedRow
            self.add(step, r.tokens, r.hidden, r.prompt_len)

    def sample(self, batch_size, rng, device="cpu", max_tokens=None):
        """A padded batch (`pair_batch`) of up to batch_size sequences drawn at random, with
        max_tokens at most that many padded positions: each cut to a window (`crop`), then fewer."""
        n = len(self.items)
        seqs = [self.items[i][1:] for i in rng.sample(range(n), min(batch_size, n))]
        if max_tokens is not None:
            seqs = [crop(s, max_tokens, rng) for s in seqs]
            while len(seqs) * max(len(tokens) for tokens, _, _ in seqs) > max_tokens:
                seqs.pop()
        return pair_batch(seqs, device)


def crop(seq, n, rng):
    """(tokens (N,), hidden (N-1, C), prompt_len) -> the same for a random window of at most n
    tokens; a window that starts in the response keeps a prompt length of 0."""
    tokens, hidden, prompt_len = seq
    start = rng.randrange(max(len(tokens) - n, 0) + 1)
    return tokens[start:start + n], hidden[start:start + n - 1], max(prompt_len - start, 0)


def pair_batch(seqs, device="cpu"):
    """A batch of the training pairs of whole sequences, one per row, right-padded. seqs: (tokens
    (N,), hidden (N-1, C), prompt_len). Row b, position t holds (h_t, x_{t+1}) with target h_{t+1}:

        tokens   x_0  x_1  x_2 ... x_{N-1}         (x_{N-1}, the last, is never read)
        hidden   h_0  h_1  h_2 ... h_{N-2}
        pair t   (h_t, x_{t+1}) -> h_{t+1}, and so x_{t+2},  t = 0 .. N-3

    mask[b, t] holds from t = prompt_len - 1 on, where x_{t+2} is a response token after the first
    (what a drafter drafts). -> h_in (B, T, C), x_next (B, T), h_tgt (B, T, C), mask (B, T) bool."""
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
    """Chained pass d's attention mask over the keys of passes 0..d side by side, (T, (d+1) T) bool.
    Pass d at t drafts for the chain that starts at the real pair s = t - d; drafting there, the
    cache holds the real pairs 0..s (pass 0's keys) and pass j's key at s + j, j = 1..d."""
    t = torch.arange(T, device=device)[:, None]  # (T, 1) query positions
    u = torch.arange(T, device=device)[None, :]  # (1, T) key positions
    s = t - d  # (T, 1) where each query's chain starts
    return torch.cat([u <= s] + [u == s + j for j in range(1, d + 1)], dim=1)


def chained_states(drafter, h_in, x_next, depth):
    """The drafter run as it drafts, `depth` deep from every position at once. A generator, so a
    caller may stop between passes, it yields each pass's predicted states h~ (B, T, C). Pass 0
    reads the target's states; pass d reads at t what pass d - 1 predicted at t - 1."""
    emb = F.embedding(x_next, drafter.target.wte.weight.detach())  # (B, T, C)
    T = h_in.shape[1]
    past = [[] for _ in drafter.stack.blocks]  # every pass's keys and values, per block
    h_feed = h_in
    for d in range(depth):
        x = drafter.project_in(h_feed, emb)
        mask = chain_attention_mask(T, d, h_in.device)
        state = drafter.norm(drafter.stack(x, past=past, past_mask=mask))
        yield state
        # the next pass sees, at position t, this pass's guess of h_t (made at t - 1)
        h_feed = torch.cat([h_in[:, :1], state[:, :-1].detach()], dim=1)


def chain_loss_masks(mask, depth):
    """The positions each pass's loss counts -> `depth` masks (B, T) bool. Pass d counts t where
    mask[t] and mask[t - d]: its chain starts at s = t - d, a pair the drafter drafts from."""
    masks = [mask]
    for d in range(1, depth):
        counted = torch.zeros_like(mask)  # the first d positions start no chain
        counted[:, d:] = mask[:, d:] & mask[:, :-d]  # at t: mask[t] and mask[t - d]
        masks.append(counted)
    return masks


def drafter_loss(drafter, h_in, x_next, h_tgt, mask, n_positions=None, depth=DEPTH,
                 preempted=None):
    """The loss of `depth` chained passes: summed over each pass's positions, divided by depth x
    n_positions (default: this batch's count). `preempted` is asked between passes; once it says
    True, the loss is abandoned (None)."""
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
    """One optimizer step on a batch from `DrafterBuffer.sample` -> (loss, applied). `preempted` is
    asked between passes and before the backward and the optimizer step; True abandons the step
    (None, False). With sync_grads every rank trains together (the warm-up), on the mean over all
    their positions. A step whose gradient is not finite is not applied."""
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
def acceptance(drafter, h_in, x_next, h_tgt, mask, temperature=1.0):
    """Teacher-forced -> (kept, positions): per masked position sum min(p, q) at the temperature,
    what rejection sampling keeps of a draft (exact-token sampling at most that; top-1 at 0)."""
    logits, _ = drafter(h_in, x_next)
    target = F.linear(h_tgt[mask], drafter.target.lm_head.weight)  # (positions, V)
    kept = torch.minimum(probs(target, temperature), probs(logits[mask], temperature)).sum()
    return float(kept), int(mask.sum())  # sync: two figures


def make_optimizer(drafter, lr=3e-3):
    return torch.optim.AdamW(drafter.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.95))
