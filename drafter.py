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
decides acceptance. Only positions that predict a response token count (the prompt is
conditioning), and each padded row holds one sequence with padding at its end, so nothing
attends across sequences or into padding.

Training-time test: drafting feeds h~ back in, but teacher forcing only ever shows the drafter
the target's real h. So every training step runs a second pass whose inputs are the first pass's
own predictions (h~_t in place of h_t) with the same targets, and adds its loss. That is the
cheap part of EAGLE-3's idea, meant to keep the 2nd..k-th drafted tokens good.

The buffer keeps (tokens, hidden states, prompt length) per sequence, tagged with the RL step it
came from, for the last `keep_steps` steps. `train_step` serves the warm-up and online training.

Test: python -m pytest tests/test_drafter.py
"""
import hashlib

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from model import KVCache, RotaryStack

HIDDEN_WEIGHT = 1.0
CE_WEIGHT = 0.1
DRAFTER_BATCH = 8  # sequences per training step: short steps, so an idle rank is preempted within one


class Drafter(nn.Module):
    def __init__(self, target):
        super().__init__()
        self.config = target.config
        C = self.config.n_embd
        self.__dict__["target"] = target  # shared, frozen, and kept out of state_dict()/parameters()
        self.fuse = nn.Linear(2 * C, C, bias=False)
        self.stack = RotaryStack(self.config, n_layer=1)
        self.norm = nn.LayerNorm(C, bias=False)
        for p in self.parameters():
            if p.dim() == 2:
                nn.init.normal_(p, mean=0.0, std=0.02)

    def forward(self, hidden, next_tokens, cache=None):
        """hidden (B, T, C) = h_t, next_tokens (B, T) = x_{t+1} -> logits (B, T, V), h~_{t+1} (B, T, C)."""
        emb = F.embedding(next_tokens, self.target.wte.weight.detach())  # (B, T, C)
        x = self.fuse(torch.cat([hidden, emb], dim=-1))
        h_pred = self.norm(self.stack(x, cache))
        return F.linear(h_pred, self.target.lm_head.weight.detach()), h_pred

    def new_cache(self, batch_size, max_len=None, device=None, dtype=None):
        p = self.fuse.weight
        return KVCache(self.config, batch_size, max_len or self.config.block_size,
                       device=device or p.device, dtype=dtype or p.dtype, n_layer=1)

    def checksum(self):
        """A short hash of every weight's bytes: equal across ranks means bit-identical drafters."""
        h = hashlib.sha256()
        for p in self.parameters():
            h.update(p.detach().cpu().contiguous().numpy().tobytes())
        return h.hexdigest()[:16]


class DrafterBuffer:
    """Sequences (token ids, target hidden states) from the last `keep_steps` RL steps."""

    def __init__(self, keep_steps=32):
        self.keep_steps = keep_steps
        self.items = []  # (step, tokens (N,) long, hidden (N-1, C) float, prompt_len)

    def add(self, step, tokens, hidden, prompt_len):
        # hidden[j] is the target's state after reading tokens[j]; the last token is never read
        if hidden.shape[0] != tokens.shape[0] - 1:
            raise ValueError(f"need one hidden state per token but the last: {tokens.shape[0]} tokens, {hidden.shape[0]} states")
        self.items.append((step, tokens.cpu(), hidden.detach().float().cpu(), int(prompt_len)))
        newest = max(s for s, *_ in self.items)
        self.items = [it for it in self.items if it[0] > newest - self.keep_steps]

    def __len__(self):
        return len(self.items)

    def num_tokens(self):
        return sum(t.shape[0] for _, t, _, _ in self.items)

    def sample(self, batch_size, rng, device="cpu"):
        """A padded batch of whole sequences: inputs (h_t, x_{t+1}), targets h_{t+1}, loss mask."""
        # similar lengths together (a random window of the length-sorted buffer): on long-tailed
        # lengths, a uniform batch would be mostly padding
        by_len = sorted(self.items, key=lambda it: it[1].shape[0])
        start = rng.randrange(max(1, len(by_len) - batch_size + 1))
        chosen = by_len[start:start + batch_size]
        T = max(h.shape[0] for _, _, h, _ in chosen) - 1  # pairs per sequence: one fewer than states
        C, batch_size = chosen[0][2].shape[1], len(chosen)
        h_in = torch.zeros(batch_size, T, C)
        x_next = torch.zeros(batch_size, T, dtype=torch.long)
        h_tgt = torch.zeros(batch_size, T, C)
        mask = torch.zeros(batch_size, T, dtype=torch.bool)
        for b, (_, tokens, hidden, plen) in enumerate(chosen):
            n = hidden.shape[0] - 1
            h_in[b, :n] = hidden[:-1]
            x_next[b, :n] = tokens[1:n + 1]
            h_tgt[b, :n] = hidden[1:]
            mask[b, max(plen - 1, 0):n] = True  # position t predicts x_{t+2}: count it when that is a drafted response token
        return h_in.to(device), x_next.to(device), h_tgt.to(device), mask.to(device)


def drafter_loss(drafter, h_in, x_next, h_tgt, mask):
    """Loss of one teacher-forced pass plus one pass fed with its own predictions (see docstring)."""
    with torch.no_grad():
        p_target = F.softmax(F.linear(h_tgt, drafter.target.lm_head.weight), dim=-1)  # (B, T, V)
    m = mask.float()
    denom = m.sum().clamp(min=1.0)
    total = 0.0
    h_feed = h_in
    for _ in range(2):
        logits, h_pred = drafter(h_feed, x_next)
        reg = F.smooth_l1_loss(h_pred, h_tgt, reduction="none").mean(-1)  # (B, T)
        ce = -(p_target * F.log_softmax(logits, dim=-1)).sum(-1)  # (B, T)
        total = total + ((HIDDEN_WEIGHT * reg + CE_WEIGHT * ce) * m).sum() / denom
        # the next pass sees, at position t, the drafter's own guess of h_t (made at t-1)
        h_feed = torch.cat([h_in[:, :1], h_pred[:, :-1].detach()], dim=1)
    return total / 2


def train_step(drafter, optimizer, buffer, rng, batch_size=DRAFTER_BATCH, device="cpu", sync_grads=False):
    """One optimizer step on a batch from the buffer; returns the loss. Short on purpose: the
    idle-rank loop checks for preemption between steps. sync_grads averages gradients over ranks
    (the warm-up, where all ranks train together); idle-rank training is local, then synced."""
    batch = buffer.sample(batch_size, rng, device)
    loss = drafter_loss(drafter, *batch)
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    if sync_grads:
        grads = [p.grad for p in drafter.parameters()]
        flat = torch.cat([g.reshape(-1) for g in grads])
        dist.all_reduce(flat)
        flat /= dist.get_world_size()
        i = 0
        for g in grads:
            g.copy_(flat[i:i + g.numel()].view_as(g))
            i += g.numel()
    torch.nn.utils.clip_grad_norm_(drafter.parameters(), 1.0)
    optimizer.step()
    return loss.item()


@torch.no_grad()
def acceptance_proxy(drafter, buffer, rng, batch_size=32, device="cpu"):
    """Teacher-forced top-1 agreement of drafter and target on buffered sequences: a cheap
    health signal for logs (the real figure is the accept length measured while decoding)."""
    h_in, x_next, h_tgt, mask = buffer.sample(batch_size, rng, device)
    logits, _ = drafter(h_in, x_next)
    agree = logits.argmax(-1) == F.linear(h_tgt, drafter.target.lm_head.weight).argmax(-1)
    return float(agree[mask].float().mean()) if mask.any() else float("nan")


def make_optimizer(drafter, lr=3e-3):
    return torch.optim.AdamW(drafter.parameters(), lr=lr, weight_decay=0.0, betas=(0.9, 0.95))

