"""GRPO: group-normalised advantages and the clipped policy-gradient loss.

For each prompt the rollout draws G responses (a group). A response's advantage is its reward
minus the group's mean, divided by the group's standard deviation; a group whose rewards are all
equal carries no signal and gets advantage 0 (not a division by zero). The loss is PPO's clipped
surrogate on per-token importance ratios, averaged over every response token of the global batch
(the token-level mean: long responses are not down-weighted per token), all ranks together: each
rank scales its summed loss by W / N with N the all-reduced token count (`global_mean_scale`), so
the update is the same on 1, 2 or 8 ranks.

    ratio_t = exp(logp_t - logp_old_t)
    loss    = -mean_t min(ratio_t * A, clip(ratio_t, 1 - eps, 1 + eps) * A)   [+ beta * KL_t]

With one optimizer step per rollout (the default) logp_old equals logp detached, the ratio is 1
and the loss is plain REINFORCE with a group baseline; clipping matters once the same rollout is
reused for several epochs (--rl-epochs). KL to a frozen reference is off by default (beta = 0):
our reward is exact and cannot be hacked, and a reference copy would cost one more forward pass per update,
which on a CPU is time taken from the rollouts this project is about. When on, it is the k3
estimator exp(ref - logp) - (ref - logp) - 1, which is non-negative and unbiased.

Test: python -m pytest tests/test_rl.py
"""
from contextlib import nullcontext

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

from common import group_by_length


def group_advantages(rewards, group_size, eps=1e-6):
    """rewards (N,) in groups of `group_size` consecutive rows -> advantages (N,)."""
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    r = rewards.float().view(-1, group_size)  # (groups, G)
    std = r.std(dim=1, keepdim=True, unbiased=False)
    adv = (r - r.mean(dim=1, keepdim=True)) / (std + eps)
    return torch.where(std > eps, adv, torch.zeros_like(adv)).view(-1)  # all-equal group: no signal


def collate(sequences, prompt_lens, pad_id, device="cpu"):
    """Token lists -> tokens (B, T) right-padded, and mask (B, T-1) over response positions:
    mask[b, t] says token t+1 of row b is a response token, so its log-prob counts."""
    T = max(len(s) for s in sequences)
    tokens = torch.full((len(sequences), T), pad_id, dtype=torch.long)
    mask = torch.zeros(len(sequences), T - 1, dtype=torch.bool)
    for b, (s, plen) in enumerate(zip(sequences, prompt_lens)):
        tokens[b, :len(s)] = torch.tensor(s)
        mask[b, plen - 1:len(s) - 1] = True
    return tokens.to(device), mask.to(device)


def token_logprobs(model, tokens):
    """log p(tokens[:, t+1] | tokens[:, :t+1]) for every t: (B, T-1)."""
    logits, _ = model(tokens[:, :-1])  # (B, T-1, V)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))  # bf16 autocast -> fp32 softmax
    return torch.gather(F.log_softmax(logits, dim=-1), 2, tokens[:, 1:, None]).squeeze(-1)


def grpo_loss(logp, logp_old, advantages, mask, clip_eps=0.2, kl_coef=0.0, logp_ref=None):
    """Clipped surrogate, token-level mean over masked positions.
    logp, logp_old, logp_ref (B, T-1); advantages (B,); mask (B, T-1) bool. Returns (loss, stats)."""
    m = mask.float()
    ratio = torch.exp(logp - logp_old)
    adv = advantages[:, None]  # one advantage for every token of a response
    surrogate = torch.minimum(ratio * adv, ratio.clamp(1 - clip_eps, 1 + clip_eps) * adv)
    per_token = -surrogate
    kl = torch.zeros_like(logp)
    if kl_coef > 0:
        d = logp_ref - logp
        kl = torch.exp(d) - d - 1
        per_token = per_token + kl_coef * kl
    n = m.sum().clamp(min=1.0)
    loss = (per_token * m).sum() / n
    with torch.no_grad():
        clipped = ((ratio - 1).abs() > clip_eps).float()
        stats = {"clip_frac": float((clipped * m).sum() / n), "kl": float((kl * m).sum() / n)}
    return loss, stats


def global_mean_scale(n_local, device="cpu"):
    """W / N for a token-level mean over every rank: N is the all-reduced count of the tokens the
    loss sums (n_local on this rank), W the world size. A rank that scales its summed loss by it
    and lets DDP average the gradients (divide by W) gets sum_t g_t / N, the gradient of the mean
    over the global batch, whatever the number of ranks and however the tokens are dealt. Dividing
    by each rank's own count instead gives (1/W) sum_r (1/n_r) sum_t g_t: the tokens of a rank of
    short responses would weigh more, and the update would change with the world size."""
    n = torch.tensor(float(n_local), dtype=torch.float64, device=device)
    world = 1
    if dist.is_initialized():
        dist.all_reduce(n)  # sync: one small all-reduce per update
        world = dist.get_world_size()
    return world / max(n.item(), 1.0)


def deal_by_tokens(lengths, world_size):
    """Row indices -> the rows each rank updates: {rank: [rows]}, with about the same number of
    tokens per rank (longest row first, each to the rank with the fewest tokens so far). The
    rollout deals rows to ranks as they come; after it, the rows that carry a gradient are what
    the update costs, and they are spread unevenly (a group whose rewards are all equal has none),
    so a rank with more of them would keep the others waiting at DDP's all-reduce. Every rank
    computes the same deal from the same lengths."""
    load, deal = [0] * world_size, {r: [] for r in range(world_size)}
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        r = min(range(world_size), key=lambda r: (load[r], r))
        deal[r].append(i)
        load[r] += lengths[i]
    return deal


def grpo_update(model, net, opt, sequences, prompt_lens, advantages, *, pad_id, update_tokens, epochs=1, clip_eps=0.2,
                kl_coef=0.0, ref_model=None, device="cpu", n_total=None):
    """One GRPO update on this rank's rollouts: `sequences` (token lists, prompt + response) with
    their prompt lengths and advantages. `net` is `model`, or its DDP wrapper under torchrun.
    Length-grouped micro-batches of about `update_tokens` padded tokens, gradients accumulated, one
    all-reduce (DDP), one optimizer step per epoch. A rank with no rows still takes part with a
    zero loss, so collectives line up. Returns (loss, clip fraction, skipped) where skipped means
    a non-finite loss or gradient, skipped on every rank. n_total: the response tokens of the whole
    global batch, when the caller knows it (train.update_target, which re-deals the rows); else it is
    all-reduced from every rank's own (`global_mean_scale`)."""
    n_local = sum(len(s) - p for s, p in zip(sequences, prompt_lens))
    # the token-level mean is over every rank's tokens
    if n_total is None:
        scale = global_mean_scale(n_local, device)
    else:
        scale = (dist.get_world_size() if dist.is_initialized() else 1) / max(n_total, 1)
    # rows with advantage 0 (groups whose rewards are all equal) add exactly 0 to the loss and its
    # gradient, so skipping them changes nothing but the time (not so with a KL term)
    active = [i for i in range(len(sequences)) if kl_coef > 0 or advantages[i] != 0]
    micro = group_by_length(active, lambda i: len(sequences[i]), update_tokens)
    total_loss, clip, skipped, old = 0.0, 0.0, False, {}
    for epoch in range(epochs):
        opt.zero_grad(set_to_none=True)
        for m_i, rows in enumerate(micro):
            if rows:
                tokens, mask = collate([sequences[i] for i in rows], [prompt_lens[i] for i in rows], pad_id, device)
                adv = advantages[rows].to(device)
            else:  # no rows on this rank: a one-token dummy with an empty mask
                tokens, mask = torch.zeros(1, 2, dtype=torch.long, device=device), torch.zeros(1, 1, dtype=torch.bool, device=device)
                adv = torch.zeros(1, device=device)
            last = m_i == len(micro) - 1
            ctx = net.no_sync() if (isinstance(net, DistributedDataParallel) and not last) else nullcontext()
            with ctx:
                logp = token_logprobs(net, tokens)
                # the rollout came from the weights of epoch 0: their log-probs are the "old" ones
                logp_old = old.setdefault(m_i, logp.detach())
                logp_ref = None
                if kl_coef > 0:
                    with torch.no_grad():
                        logp_ref = token_logprobs(ref_model, tokens)
                loss, st = grpo_loss(logp, logp_old, adv, mask, clip_eps, kl_coef, logp_ref)
                # token-level mean over the global batch, not per micro-batch or per rank
                (loss * mask.sum() * scale).backward()
            total_loss += float(loss.detach()) * float(mask.sum()) / max(n_local, 1)  # this rank's mean, for the log
            clip += st["clip_frac"] * float(mask.sum()) / max(n_local, 1)
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        ok = torch.tensor([float(torch.isfinite(grad_norm))], device=device)
        if dist.is_initialized():
            dist.all_reduce(ok, op=dist.ReduceOp.MIN)  # every rank skips together, or none does
        if ok.item() < 1:
            opt.zero_grad(set_to_none=True)
            skipped = True
            continue
        opt.step()
    return total_loss / epochs, clip / epochs, skipped
