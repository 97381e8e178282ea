"""The drafter: one transformer layer that reads the target's hidden states (EAGLE style).

Input at position t: the target's final hidden state h_t (the LM head's input) fused, by a linear
layer over the concatenation, with the embedding of the next token x_{t+1}. Output: a prediction
of h_{t+1}, which the target's own LM head turns into logits for x_{t+2}. While drafting several
tokens the drafter feeds its predicted hidden state back in place of the target's.

    (h_0, x_1) (h_1, x_2) ... (h_t, x_{t+1})  ->  fuse -> 1 block -> norm -> h~_{t+1} -> lm_head -> x_{t+2}

The embedding and LM head are the target's. They are read through a plain attribute (not a
registered submodule) and detached, so they are neither trained nor saved here: the drafter's
state_dict is the fuse layer, one block and a norm. The drafter has its own KVCache (one layer)
with the target's roll-back rule; its position t is the position of h_t in the sequence.

Loss: smooth-L1 regression of h_{t+1} (weight 1.0) plus a soft cross-entropy against the target's
distribution for x_{t+2} (weight 0.1), the EAGLE weights: the regression carries most of the
signal (a whole vector per position, not one token), the cross-entropy aligns the part that
decides acceptance. Only positions that predict a response token after the first count (the prompt is
conditioning), and each padded row holds one sequence with padding at its end, so nothing
attends across sequences or into padding.

Training-time test: drafting feeds h~ back in, but teacher forcing only ever shows the drafter
the target's real h, so a drafter trained that way alone is good for one token and guesses after
it. So a training step runs the drafter as it drafts, DEPTH drafts deep from every position at
once (`chained_states`, EAGLE-3's idea): pass d reads its own pass d - 1 predictions and attends,
through a mask, to exactly what the drafter's cache holds when it drafts there (the real pairs up
to the chain's start, then the chain's own entries); each pass adds its loss. Measured here
(RESULTS.md): one self-fed pass with plain causal attention, the previous recipe, left a drafter
whose fifth draft failed 40% of the time on one machine; three chained passes make the acceptance
of all eight draft positions about the same, and deeper ones cost more without doing better. A
cold start (train.py --drafter-warmup-steps 0) trains teacher-forced alone (depth 1): idle time is
all it has, and a step at a fraction of the cost gives it more steps, which it needs more.

The buffer keeps (tokens, hidden states, prompt length) per sequence, tagged with the RL step it
came from, for the last `keep_steps` steps and at most `keep_tokens` tokens (the oldest go first),
hidden states in the run's dtype. `train_step` serves the warm-up and online training.

bf16 (autocast): as in the target (model.py), only the matrix products and attention run in bf16;
the residual stream that starts at `fuse`, the norms and the predicted state h~ stay float32, the
same on a CPU as on a GPU, so drafting feeds back the same float32 state on both.

Three more drafters close the file, each with the one method the speculative step calls,
`propose(batch, k)`: `NgramDrafter` (TLT-Base: the row's own text), `SiblingDrafter` (the texts of
the row's GRPO group, which RunningBatch keeps in a `GroupTexts`) and `SiblingOrLearned` (the learned
drafter until every running row is the last of its group, then siblings).

Test: python -m pytest tests/test_drafter.py
"""
import bisect
import hashlib
import math
from collections import OrderedDict, deque

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import common
from common import check, group_by_length
from model import KVCache, LayerNorm, RotaryStack

HIDDEN_WEIGHT = 1.0
CE_WEIGHT = 0.1
DRAFTER_BATCH = 8  # sequences per training step
DEPTH = 3  # chained passes per training step (drafts of every depth then do about as well: RESULTS.md)
IDLE_STEP_TOKENS = 256  # padded positions per idle-time step at most: the last rank waits for a piece of one such step


class Drafter(nn.Module):
    def __init__(self, target):
        super().__init__()
        self.config = target.config
        C = self.config.n_embd
        self.__dict__["target"] = target  # shared, frozen, and kept out of state_dict()/parameters()
        self.fuse = nn.Linear(2 * C, C, bias=False)
        self.stack = RotaryStack(self.config, n_layer=1)
        self.norm = LayerNorm(C)
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, mean=0.0, std=0.02)

    def forward(self, hidden, next_tokens, cache=None):
        """hidden (B, T, C) = h_t, next_tokens (B, T) = x_{t+1} -> logits (B, T, V), h~_{t+1} (B, T, C)."""
        emb = F.embedding(next_tokens, self.target.wte.weight.detach())  # (B, T, C)
        h_pred = self.norm(self.stack(self.fused(hidden, emb), cache))  # in the weights' dtype on every device
        return F.linear(h_pred, self.target.lm_head.weight.detach()), h_pred

    def fused(self, hidden, emb):
        """The start of the residual stream: fuse over (h_t, embedding of x_{t+1}), in the weights'
        dtype. Under autocast the linear layer gives bf16, and the stream stays float32 (model.py)."""
        return self.fuse(torch.cat([hidden, emb], dim=-1)).to(self.fuse.weight.dtype)

    def propose(self, batch, k):
        """What the speculative step asks of every drafter: k drafts per row of a
        speculative.RunningBatch (B, k) and, with rejection sampling, their distributions q (B, k, V).
        The learned drafter's drafting reads the batch's recorded hidden states and its own cache,
        which the batch holds, so the batch runs it (`RunningBatch.draft`)."""
        return batch.draft(self, k)

    def new_cache(self, batch_size, max_len=None, device=None, dtype=None):
        p = self.fuse.weight
        return KVCache(self.config, batch_size, max_len or self.config.block_size,
                       device=device or p.device, dtype=dtype or p.dtype, n_layer=1)

    def checksum(self):
        """A short hash of every weight's bytes: equal across ranks means bit-identical drafters.
        The bytes are read as uint8 (numpy has no bfloat16), so it works in any dtype and a float32
        drafter hashes exactly the bytes it holds."""
        h = hashlib.sha256()
        for p in self.parameters():
            h.update(p.detach().cpu().contiguous().flatten().view(torch.uint8).numpy().tobytes())
        return h.hexdigest()[:16]


class DrafterBuffer:
    """Sequences (token ids, target hidden states) from the last `keep_steps` RL steps, and at most
    `keep_tokens` tokens in all (None: no bound): past it the oldest sequences go first, so memory
    stays bounded however long the responses get (a whole RL step of long ones may not fit).

    A rollout's rows arrive on the critical path and are only staged there (`add_rows`: a reference
    to the Sample, its hidden states still on the device, no copy); idle turns store them in pieces
    (`store_staged`: to the host, in the buffer's `dtype`, bfloat16 in a bf16 run) and train on the
    stored ones. Both bounds hold over staged and stored rows together, applied the moment rows are
    given: a process that never has idle time (one process, a rank always last) holds at most
    keep_tokens tokens all the same. Every operation costs what it touches, never the whole buffer:
    token counts are running sums, and the stored sequences are kept in length order as they arrive
    (`sample` draws similar lengths without sorting). Batches are made in float32 (`pairs`)."""

    def __init__(self, keep_steps=32, keep_tokens=None, dtype=torch.float32):
        self.keep_steps, self.keep_tokens, self.dtype = keep_steps, keep_tokens, dtype
        self.stored = OrderedDict()  # serial -> (step, tokens (N,) long, hidden (N-1, C) in dtype, prompt_len), oldest first
        self.by_len = []  # sorted (N, serial) of the stored sequences
        self.staged = deque()  # (step, Sample) given by add_rows and not yet stored, oldest first
        self.stored_tokens = self.staged_tokens = 0
        self.newest, self.serial = -math.inf, 0

    @property
    def items(self):
        """The stored sequences, oldest first (for inspection: a copy of the list)."""
        return list(self.stored.values())

    def held_tokens(self):
        return self.stored_tokens + self.staged_tokens

    def add(self, step, tokens, hidden, prompt_len):
        """Store one sequence now. hidden[j] is the target's state after reading tokens[j]; the
        last token is never read."""
        if hidden.shape[0] != tokens.shape[0] - 1:
            raise ValueError(f"need one hidden state per token but the last: {tokens.shape[0]} tokens, {hidden.shape[0]} states")
        n = tokens.shape[0]
        self.stored[self.serial] = (step, tokens.cpu(), hidden.detach().to(self.dtype).cpu(), int(prompt_len))
        bisect.insort(self.by_len, (n, self.serial))
        self.serial += 1
        self.stored_tokens += n
        self._bound(step)

    def add_rows(self, step, samples):
        """A rollout's samples (speculative.Sample), staged without a copy, the bounds applied at once."""
        for s in samples:
            self.staged.append((step, s))
            self.staged_tokens += s.tokens.shape[0]
        self._bound(step)

    def store_staged(self, max_tokens=None):
        """Store staged rows, oldest first, about max_tokens tokens of them (at least one row):
        one idle turn's piece. Returns the tokens stored."""
        done = 0
        while self.staged and (done == 0 or max_tokens is None or done + self.staged[0][1].tokens.shape[0] <= max_tokens):
            step, s = self.staged.popleft()
            self.staged_tokens -= s.tokens.shape[0]
            done += s.tokens.shape[0]
            self.add(step, s.tokens, s.hidden, s.prompt_len)
        return done

    def _bound(self, step):
        """Drop the oldest sequences, stored ones first (they are older than the staged), while one
        is older than the last keep_steps steps or the held tokens exceed keep_tokens, always
        keeping the newest."""
        self.newest = max(self.newest, step)

        def too_much(oldest_step):
            return oldest_step <= self.newest - self.keep_steps or (
                self.keep_tokens is not None and self.held_tokens() > self.keep_tokens and len(self.stored) + len(self.staged) > 1)
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
        """A padded batch of similar-length stored sequences: see `pairs` for what it holds.
        max_tokens: keep only as many of the window's longest sequences as fit in that many padded
        positions (at least one), which bounds what a step costs.

        Similar lengths go together (a window of the length-ordered buffer), since on long-tailed
        lengths a uniform batch would be mostly padding. The window's start is uniform over
        -(batch_size - 1) .. len - 1 and the window is cut to the buffer, so every sequence lies in
        exactly batch_size of the possible windows: the longest sequences, the tail that
        speculation serves, are drawn as often as the median ones (a window kept whole would draw
        the two ends batch_size times less often)."""
        start = rng.randrange(-(batch_size - 1), len(self.by_len))
        chosen = [self.stored[serial] for _, serial in self.by_len[max(start, 0):start + batch_size]]
        if max_tokens is not None:
            chosen = chosen[-max(1, max_tokens // chosen[-1][1].shape[0]):]
        return pairs([(tokens, hidden, plen) for _, tokens, hidden, plen in chosen], device)


def pairs(seqs, device="cpu"):
    """The drafter's training pairs of whole sequences, one per row, right-padded.

    seqs: (tokens (N,), hidden (N-1, C), prompt_len) with hidden[j] the target's state after
    reading tokens[j]. Row b, position t holds the pair (h_t, x_{t+1}), whose target is h_{t+1}:

        tokens   x_0  x_1  x_2 ... x_{N-1}
        hidden   h_0  h_1  h_2 ... h_{N-2}          (x_{N-1}, the last, is never read)
        pair t   (h_t, x_{t+1}) -> h_{t+1}, and so x_{t+2},  for t = 0 .. N-3

    mask[b, t] is True from t = prompt_len - 1 on: x_{t+2} is then a response token after the
    first, which is what the drafter drafts (the first response token comes from the prefill).
    Returns h_in (B, T, C), x_next (B, T), h_tgt (B, T, C),
    mask (B, T) bool."""
    T = max(h.shape[0] for _, h, _ in seqs) - 1  # pairs per sequence: one fewer than states
    B, C = len(seqs), seqs[0][1].shape[1]
    h_in = torch.zeros(B, T, C)
    x_next = torch.zeros(B, T, dtype=torch.long)
    h_tgt = torch.zeros(B, T, C)
    mask = torch.zeros(B, T, dtype=torch.bool)
    for b, (tokens, hidden, plen) in enumerate(seqs):
        n = hidden.shape[0] - 1
        h_in[b, :n] = hidden[:-1]
        x_next[b, :n] = tokens[1:n + 1]
        h_tgt[b, :n] = hidden[1:]
        mask[b, max(plen - 1, 0):n] = True
    return h_in.to(device), x_next.to(device), h_tgt.to(device), mask.to(device)


def chain_mask(T, d, device=None):
    """The attention mask of chained pass d (0 = teacher-forced) over the keys of passes 0..d,
    (T, (d + 1) T) bool, True where a query may look. Pass d's entry at position t is the d-th
    draft after the real pair at s = t - d: when drafting, the drafter's cache then holds the real
    pairs up to s and this chain's own entries at s + 1 .. t, one from each pass, and nothing else."""
    t = torch.arange(T, device=device)[:, None]  # (T, 1) query positions
    u = torch.arange(T, device=device)[None, :]  # (1, T) key positions
    return torch.cat([u <= t - d] + [u == t - d + j for j in range(1, d + 1)], dim=1)


def chained_states(drafter, h_in, x_next, depth):
    """The drafter run as it drafts, `depth` tokens deep from every position at once (EAGLE-3's
    training-time test): pass 0 reads the target's states (teacher forcing); pass d reads, at
    position t, what pass d - 1 predicted at t - 1, and attends to the real pairs up to t - d plus
    its own chain's entries (`chain_mask`), as the drafter's cache holds them while drafting.
    Returns a list of `depth` predicted states h~ (B, T, C); pass d's at t predicts h_{t+1}, the
    (d + 1)-th draft of a chain that started after the real pair at t - d."""
    return list(chained_passes(drafter, h_in, x_next, depth))


def chained_passes(drafter, h_in, x_next, depth):
    """`chained_states` one pass at a time (a generator), so that a caller can stop between passes."""
    emb = F.embedding(x_next, drafter.target.wte.weight.detach())  # (B, T, C)
    T = h_in.shape[1]
    past = [[] for _ in drafter.stack.blocks]  # every pass's keys and values, per block
    h_feed = h_in
    for d in range(depth):
        x = drafter.fused(h_feed, emb)
        state = drafter.norm(drafter.stack(x, chain=(past, chain_mask(T, d, h_in.device))))
        yield state
        # the next pass sees, at position t, this pass's guess of h_t (made at t - 1)
        h_feed = torch.cat([h_in[:, :1], state[:, :-1].detach()], dim=1)


def chain_masks(mask, depth):
    """The positions pass d counts: mask[t] and mask[t - d] (the chain's start is a pair the
    drafter drafts from). -> list of `depth` (B, T) bool."""
    masks = [mask]
    for d in range(1, depth):
        masks.append(torch.zeros_like(mask))
        masks[d][:, d:] = mask[:, d:] & mask[:, :-d]  # nothing where the rows are d or fewer pairs long
    return masks


def drafter_loss(drafter, h_in, x_next, h_tgt, mask, n_positions=None, depth=DEPTH, preempted=None):
    """Loss of `depth` chained passes (pass 0 teacher-forced, pass d fed with its own predictions:
    see `chained_states`), summed over each pass's positions and divided by depth x n_positions
    (default: this batch's count; when ranks train together, the count over all of them, so the
    mean is the global one). depth 1 is teacher forcing alone. preempted: asked between passes;
    once it says True the loss is abandoned (None)."""
    with torch.no_grad():  # both softmaxes in float32: under bf16 autocast the logits are bf16
        p_target = F.softmax(F.linear(h_tgt, drafter.target.lm_head.weight).float(), dim=-1)  # (B, T, V)
    n = mask.sum() if n_positions is None else torch.as_tensor(float(n_positions))
    total = 0.0
    for h_pred, m in zip(chained_passes(drafter, h_in, x_next, depth), chain_masks(mask, depth)):
        if preempted and preempted():
            return None
        logits = F.linear(h_pred, drafter.target.lm_head.weight.detach())
        reg = F.smooth_l1_loss(h_pred, h_tgt, reduction="none").mean(-1)  # (B, T)
        ce = -(p_target * F.log_softmax(logits.float(), dim=-1)).sum(-1)  # (B, T)
        total = total + ((HIDDEN_WEIGHT * reg + CE_WEIGHT * ce) * m).sum()
    return total / (depth * n.clamp(min=1.0))


@torch.no_grad()
def chain_figures(drafter, h_in, x_next, h_tgt, mask, depth):
    """What the drafter's chains would get, per draft position d = 1..depth, on sequences the target
    sampled: (top-1 agreements, summed acceptance, positions), each (depth,), to be summed over
    ranks and batches. Top-1: the drafter's argmax equals the target's. Acceptance: sum_x min(p, q),
    the chance that rejection sampling at temperature 1 accepts the draft; both given that the
    earlier drafts were the sampled tokens, i.e. that they were accepted. Position 1 is the
    teacher-forced figure (`top1_agreement`)."""
    target = F.linear(h_tgt, drafter.target.lm_head.weight)  # (B, T, V)
    p = F.softmax(target.float(), dim=-1)
    agree, accept, n = [], [], []
    for h_pred, m in zip(chained_states(drafter, h_in, x_next, depth), chain_masks(mask, depth)):
        logits = F.linear(h_pred, drafter.target.lm_head.weight)
        q = F.softmax(logits.float(), dim=-1)
        agree.append(((logits.argmax(-1) == target.argmax(-1)) & m).sum())
        accept.append((torch.minimum(p, q).sum(-1) * m).sum())
        n.append(m.sum())
    return torch.stack(agree).double(), torch.stack(accept).double(), torch.stack(n).double()


def expected_accepted(rates):
    """Drafts accepted per chain of len(rates) drafts, from the acceptance at each draft position
    given the earlier ones (None: never decided, counted as 0): sum over d of the product of the
    rates at positions 1..d."""
    total, run = 0.0, 1.0
    for r in rates:
        run *= r or 0.0
        total += run
    return total


def train_step(drafter, optimizer, buffer, rng, batch_size=DRAFTER_BATCH, device="cpu", sync_grads=False, depth=DEPTH,
               max_tokens=None, preempted=None):
    """One optimizer step on a batch from the buffer; returns (loss, applied). Short on purpose:
    the idle-rank loop checks for preemption between steps, and bounds a step with max_tokens
    (`DrafterBuffer.sample`) so that the last rank never waits long for one; `preempted`, asked
    between the chained passes and before the backward and the optimizer step, abandons a step
    midway (loss None, nothing applied), so that the last rank waits for a piece of a step, not all
    of it. sync_grads: all ranks train together
    (the warm-up) on the mean over every rank's positions, with gradients summed over ranks;
    idle-rank training is local, then synced. A step whose gradient is not finite is not applied
    (applied False); under sync_grads every rank sees the same summed gradient and skips with it."""
    batch = buffer.sample(batch_size, rng, device, max_tokens)
    n_local = batch[3].sum().double()  # the positions the loss counts here
    # under sync_grads the loss is a sum, and its gradient is divided by every rank's positions after
    # one all-reduce of [gradients, positions]: one collective a step, not one per weight plus a count
    loss = drafter_loss(drafter, *batch, n_positions=1.0 if sync_grads else None, depth=depth, preempted=preempted)
    if loss is None or (preempted and preempted()):
        return None, False
    logged = loss.item() / max(float(n_local), 1.0) if sync_grads else loss.item()  # this rank's mean, for the log
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
    """Teacher-forced top-1 agreement: over the masked positions, how often the drafter's argmax
    for x_{t+2} is the target's. Returns (agreeing positions, positions), to be summed over
    ranks. Independent of k and of sampling: the drafter's health, not an accept length.
    The target's logits are made at the masked positions only."""
    logits, _ = drafter(h_in, x_next)
    target = F.linear(h_tgt[mask], drafter.target.lm_head.weight)  # (positions, V)
    return int((logits[mask].argmax(-1) == target.argmax(-1)).sum()), int(mask.sum())  # sync: two counts


def agreement_chores(drafter, samples, into, max_tokens=IDLE_STEP_TOKENS, device="cpu"):
    """`top1_agreement` over a rollout's samples (speculative.Sample), as chores for the idle loop
    (scheduler.idle_train): each scores one piece of similar-length sequences of at most max_tokens
    padded positions (a longer sequence alone) and adds (agreeing positions, positions) to the list
    `into`. They run on idle time, before the drafter trains on these rows; the last rank to arrive
    runs none, so the figure leaves its rows out."""
    def score(part):
        a, n = top1_agreement(drafter, *pairs([(s.tokens, s.hidden, s.prompt_len) for s in part], device))
        into[0] += a
        into[1] += n
    pieces = group_by_length(samples, lambda s: s.tokens.shape[0], max_tokens)
    return [lambda part=part: score(part) for part in pieces if part]


class NgramDrafter:
    """TLT-Base: a model-free drafter, the baseline the learned drafter must beat (TLT falls back on
    one while its learned drafter is not ready; here it is an alternative, `--drafter ngram`).
    Prompt lookup: find the latest earlier place where the row's last n tokens occurred in its own
    prompt and response, and propose the k tokens that followed there; with no match, propose the last token again (it will most likely be rejected).
    It costs no forward pass and learns nothing, so it drafts well only where a response repeats
    itself, such as a re-check pass that goes over the sum again. The same verify rules apply:
    its proposal is a one-hot q, which rejection sampling accepts with probability p(d)."""

    def __init__(self, n=3):
        self.n = n

    def propose(self, batch, k):
        """A speculative.RunningBatch -> drafts (B, k) from its tokens (B, W), row b's first
        n_tokens[b] valid, and q = None: the proposals are deterministic (a one-hot q)."""
        tokens, n_tokens = batch.tokens, batch.n_tokens
        B, W = tokens.shape
        n = self.n
        offs = torch.arange(n, device=tokens.device)
        suffix = tokens.gather(1, (n_tokens[:, None] - n + offs).clamp(min=0))  # (B, n): the row's last n tokens
        match = (tokens.unfold(1, n, 1) == suffix[:, None]).all(-1)  # (B, W - n + 1): window at j equals the suffix
        j = torch.arange(W - n + 1, device=tokens.device)
        match &= j[None] < (n_tokens - n)[:, None]  # strictly earlier than the suffix itself
        start = torch.where(match, j[None], -1).max(1).values  # (B,) the latest match, -1 for none
        follow = (start + n)[:, None] + torch.arange(k, device=tokens.device)  # (B, k)
        follow = torch.where(start[:, None] >= 0, follow, n_tokens[:, None] - 1)  # no match: the last token
        return tokens.gather(1, torch.minimum(follow, n_tokens[:, None] - 1)), None


MAX_SIBLINGS = 15  # a row's siblings, at most: a GRPO group of 16 in full (bounds the lookup's work per row)


class GroupTexts:
    """What a model-free drafter may read besides a row's own tokens, kept by speculative.RunningBatch:
    its GRPO group, the rows with the same prompt (`group`, per row: the prefill's grouping), plus the
    responses of its group that had finished before the batch began (`finished`, per row; a rollout
    has none, as it holds the whole group; bench.py's decoding table starts in the tail).
    `texts` (R, width): every row's tokens by original row, stored when it finishes (`finish`), then
    those finished responses; `text_len` (R,); `siblings` (B, S): for each row, the texts of its
    group but its own, the MAX_SIBLINGS nearest in row order, -1 padding. A running row's text is
    read as it is now (`now`). Made once per batch from host lists, each in one copy."""

    def __init__(self, group, finished, prompts, width, device):
        B, finished = len(group), finished or [[]] * len(group)
        if len(finished) != B:
            raise ValueError(f"{len(finished)} lists of finished siblings for {B} prompts")
        extra = [(b, (prompts[b] + list(r))[:width]) for b in range(B) for r in finished[b]]
        self.texts = torch.cat([torch.zeros(B, width, dtype=torch.long, device=device),
                                torch.tensor([t + [0] * (width - len(t)) for _, t in extra], dtype=torch.long,
                                             device=device).view(-1, width)])  # (B + extra, width)
        self.text_len = torch.tensor([0] * B + [len(t) for _, t in extra], dtype=torch.long, device=device)
        members = {}  # group -> its texts, in row order
        for i, g in enumerate(group + [group[b] for b, _ in extra]):
            members.setdefault(g, []).append(i)
        rows = []  # a row's siblings: the other members of its group, the MAX_SIBLINGS nearest in row order
        for b in range(B):
            m = members[group[b]]
            at = bisect.bisect_left(m, b)
            lo = max(0, min(at - MAX_SIBLINGS // 2, len(m) - MAX_SIBLINGS - 1))
            rows.append([i for i in m[lo:lo + MAX_SIBLINGS + 1] if i != b][:MAX_SIBLINGS])
        self.group, self.n_siblings = group, [len(r) for r in rows]  # on the host, by original row
        S = max(1, max(map(len, rows)))
        self.siblings = torch.tensor([r + [-1] * (S - len(r)) for r in rows], dtype=torch.long, device=device)

    def finish(self, rows, tokens, n_tokens):
        """Rows `rows` (original ids, a device tensor) have finished: their texts stay as they ended."""
        self.texts[rows], self.text_len[rows] = tokens, n_tokens

    def all_finished(self, running):
        """Whether every running row (original ids, on the host) has siblings and all of them have
        finished, i.e. no two running rows share a group."""
        groups = [self.group[i] for i in running]
        return len(set(groups)) == len(groups) and all(self.n_siblings[i] for i in running)

    def now(self, row_id, tokens, n_tokens):
        """Every text, the running rows' (original ids row_id (B,)) as they are now: (R, width), (R,)."""
        return self.texts.index_copy(0, row_id, tokens), self.text_len.index_copy(0, row_id, n_tokens)


class SiblingDrafter:
    """Drafts from the row's GRPO group, a model-free drafter (`--drafter sibling`). GRPO samples G
    responses per prompt, and in the tail the rows still running are the last of their groups: their
    siblings have written the same problem out already. For each row, find in every sibling's text
    (a finished one in full, a running one up to where it is) the place whose preceding tokens match
    the row's own last tokens the longest, up to max_match, and propose the k tokens that follow
    there; among equally long matches, the place closest to the row's own position (near-copies line
    up). No match: the row's last token again, like NgramDrafter.

    Brute force on the device: every window of every sibling against the row's last max_match
    tokens, B S W max_match comparisons a step (B rows, S siblings, W positions), no index to keep
    and no host read. A suffix automaton per group would cost O(k) a step, but on the host, which
    would need every new token there each step. A group dealt over several ranks drafts from the
    siblings on its own rank only: nothing crosses ranks in the tail (train.py's layout keeps
    every group on one rank whenever the ranks divide the rows evenly into whole groups).
    Measured here (RESULTS.md): it beats the learned drafter at batch 1 with typical siblings, where
    the drafter's passes are most of a step, and loses elsewhere; the tail's rows are the atypical
    ones of their groups, which their siblings predict worst."""

    def __init__(self, max_match=16):
        self.max_match = max_match

    def propose(self, batch, k):
        """A speculative.RunningBatch -> drafts (B, k), and q = None: deterministic proposals."""
        return self.lookup(batch, k)[0], None

    def lookup(self, batch, k):
        """-> drafts (B, k) and each row's match length (B,), 0 where no sibling matched.

        Reads from the speculative.RunningBatch: tokens (B, W), of which row b holds its first
        n_tokens[b]; row_id (B,), the rows' original ids; groups.siblings (B0, S) by original id, -1
        padding; groups.now(...) -> texts (R, W) and their lengths (R,). It relies on these invariants, checked
        when TLT_DEBUG=1 (see `check`):
          1. k >= 1, and every running row holds 1 <= n_tokens <= W tokens (its last is read);
          2. a sibling is -1 (padding, matches nothing) or another row's text, 0 <= s < R, and a text
             holds at most W tokens;
          3. nothing past a text's length is read, the row's own or a sibling's: the row's last M
             tokens are read at n - M .. n - 1 (clamped at 0: copies of token 0, which capping a match
             at n tokens discounts), a match counts only where a token follows it within the sibling's
             text, and a draft past that text's end repeats its last token;
          4. with n_tokens <= W (1) every distance |follow - n| is below 2W, the score of one matched
             token, so the longest match wins and the closest breaks ties.
        Out: drafts (B, k), from a sibling where the length is positive, else the row's last token."""
        M, dev = self.max_match, batch.tokens.device
        B, W = batch.tokens.shape
        n = batch.n_tokens  # (B,) the row's next position; its last token is the pending one
        texts, lens = batch.groups.now(batch.row_id, batch.tokens, batch.n_tokens)  # (R, W), (R,)
        sib = batch.groups.siblings[batch.row_id]  # (B, S) the row's siblings' texts, -1 padding
        if common.DEBUG:
            check(k >= 1 and texts.shape[1] == W, f"k >= 1 (k = {k}) and texts as wide as the rows (1)")
            check((n >= 1) & (n <= W), "1 <= n_tokens <= W (1)")
            check((sib >= -1) & (sib < texts.shape[0]) & (sib != batch.row_id[:, None]),
                  "siblings are -1 or another row's text (2)")
            check(lens <= W, "texts hold at most W tokens (2)")
        cand = texts[sib.clamp(min=0)]  # (B, S, W)
        cand_len = torch.where(sib >= 0, lens[sib.clamp(min=0)], 0)  # (B, S); padding matches nothing
        S = cand.shape[1]
        at = (n[:, None] - M + torch.arange(M, device=dev)).clamp(min=0)  # (B, M)
        if common.DEBUG:
            check(at < n[:, None], "the row's tokens are read below n_tokens only (3)")
        suffix = batch.tokens.gather(1, at)  # (B, M) the row's last M tokens
        padded = F.pad(cand, (M - 1, 0), value=-1)  # (B, S, M - 1 + W): -1 matches no token
        windows = padded.unfold(2, M, 1)[:, :, :W - 1]  # (B, S, W - 1, M): window j ends at j, is followed by j + 1
        same = (windows == suffix[:, None, None]).flip(-1).to(torch.uint8)
        run = same.cumprod(-1).sum(-1)  # (B, S, W - 1): how many of the row's last tokens end at position j
        follow = torch.arange(1, W, device=dev)  # (W - 1,) the position after window j
        run = torch.where(follow < cand_len[..., None], run, 0)  # a token must follow, within the sibling (3)
        run = torch.minimum(run, n[:, None, None])  # a row shorter than M matches with its own tokens only
        score = run * 2 * W - (follow - n[:, None, None]).abs()  # (B, S, W - 1): longest first, then closest (4)
        best = score.flatten(1).argmax(1)  # (B,)
        length = run.flatten(1).gather(1, best[:, None])[:, 0]  # (B,)
        rows = torch.arange(B, device=dev)
        s, start = best // (W - 1), best % (W - 1) + 1  # (B,) the sibling, its first follower
        pos = torch.minimum(start[:, None] + torch.arange(k, device=dev), cand_len[rows, s][:, None] - 1).clamp_(min=0)  # (B, k)
        if common.DEBUG:
            read = (sib[rows, s] >= 0) & (pos < cand_len[rows, s][:, None]).all(1)  # (B,)
            check((length == 0) | read, "drafts read a real sibling within its text (3)")
            check(length <= torch.clamp(n, max=M), "a match is at most min(M, n_tokens) long (3)")
        drafts = cand[rows, s].gather(1, pos)  # past the sibling's end: its last token, most likely rejected
        last = batch.tokens.gather(1, n[:, None] - 1).expand(B, k)
        drafts = torch.where(length[:, None] > 0, drafts, last)
        if common.DEBUG:
            check(drafts.shape == (B, k) and length.shape == (B,), f"drafts {tuple(drafts.shape)} are (B, k) = ({B}, {k})")
        return drafts, length


class SiblingOrLearned:
    """The combination (`--drafter sibling+learned`): the learned drafter while any running row has a
    sibling still running (or none at all), the sibling drafter once every running row is the last
    of its group (`GroupTexts.all_finished`). Then every sibling is finished and sibling drafts
    cost no forward pass; before that a row's siblings are no further than it is and the learned
    drafter drafts better. The host knows which
    rows finished (`RunningBatch.compact`), so choosing reads nothing from the device, and the
    choice depends on which rows are running, never on a draw: both verify rules stay exact.
    Measured here: within the noise of the learned drafter alone, slower at the median (README)."""

    def __init__(self, learned, max_match=16):
        self.learned, self.siblings = learned, SiblingDrafter(max_match)

    def propose(self, batch, k):
        return (self.siblings if batch.groups.all_finished(batch.running) else self.learned).propose(batch, k)


def make_optimizer(drafter, lr=3e-3):
    return torch.optim.AdamW(drafter.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.95))
