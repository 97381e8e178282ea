"""GRPO: group-normalised advantages, the clipped policy-gradient loss, and the update.

Each prompt is sampled G times (a group). A response's advantage is its reward minus the group's
mean, over the group's std (0 when all are equal: no signal). The loss is PPO's clipped surrogate
on per-token ratios, a mean over the response tokens of all ranks together. Log-probs are taken at
the rollout's temperature T, log softmax(z / T), so the policy that sampled is the one trained:

    ratio_t = exp(logp_t - logp_old_t)
    loss    = -mean_t min(ratio_t * A, clip(ratio_t, 1 - eps, 1 + eps) * A)   [+ beta * KL_t]

One step per rollout (the default) makes the ratio 1: REINFORCE with a group-normalised advantage.
KL to a frozen reference (the k3 estimator) is off by default: the exact reward cannot be hacked.

Test: python -m pytest tests/test_rl.py
"""
import enum
import random
from contextlib import nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F


def group_advantages(rewards, group_size, eps=1e-6):
    """rewards (N,) in groups of `group_size` consecutive rows -> advantages (N,). Divided by the
    population std (a choice): sqrt(G / (G - 1)) times TRL's (1.155 at the default G = 4)."""
    if rewards.numel() % group_size:
        raise ValueError(f"{rewards.numel()} rewards do not split into groups of {group_size}")
    r = rewards.float().view(-1, group_size)  # (groups, G)
    std = r.std(dim=1, keepdim=True, unbiased=False)
    adv = (r - r.mean(dim=1, keepdim=True)) / (std + eps)
    return torch.where(std > eps, adv, torch.zeros_like(adv)).view(-1)  # all equal: no signal


def grpo_loss(logp, logp_old, advantages, mask, clip_eps=0.2, kl_coef=0.0, logp_ref=None):
    """Clipped surrogate, token-level mean over masked positions. logp, logp_old, logp_ref
    (B, T-1); advantages (B,); mask (B, T-1) bool. Returns (loss, stats)."""
    m = mask.float()
    ratio = torch.exp(logp - logp_old)
    adv = advantages[:, None]  # one advantage for every token of a response
    per_token = -torch.minimum(ratio * adv, ratio.clamp(1 - clip_eps, 1 + clip_eps) * adv)
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


@dataclass(frozen=True)
class GRPOConfig:
    pad_id: int
    update_tokens: int        # padded tokens per micro-batch
    epochs: int = 1           # optimizer steps on one rollout
    clip_eps: float = 0.2
    kl_coef: float = 0.0      # > 0 needs a reference model
    temperature: float = 1.0  # the rollout's, > 0: the log-probs are scored at it


def grpo_update(net, opt, sequences, prompt_lens, advantages, cfg, n_total, ref_model=None):
    """One GRPO update on this rank's rows -> (loss, clip fraction, skipped). net: the model or its
    DDP wrapper; n_total: the global batch's response tokens; ref_model: for kl_coef > 0. One
    optimizer step per epoch over length-grouped micro-batches, skipped if it is not finite."""
    device = next(net.parameters()).device
    n_local = sum(len(s) - p for s, p in zip(sequences, prompt_lens))
    # W / N: a rank's summed loss times it, averaged over W ranks by DDP, is the global token mean
    scale = (dist.get_world_size() if dist.is_initialized() else 1) / max(n_total, 1)
    # rows with advantage 0 add exactly 0 to the loss and its gradient (not so with a KL term)
    active = [i for i in range(len(sequences)) if cfg.kl_coef > 0 or advantages[i] != 0]
    if not active:  # a one-token dummy with an empty mask: this rank still joins the collectives
        sequences, prompt_lens, advantages, active = [[0, 0]], [2], torch.zeros(1), [0]
    micro = group_by_length(active, lambda i: len(sequences[i]), cfg.update_tokens)
    total_loss, clip, skipped, old = 0.0, 0.0, False, {}
    no_sync = getattr(net, "no_sync", nullcontext)  # DDP: all-reduce after the last micro-batch
    for epoch in range(cfg.epochs):
        opt.zero_grad(set_to_none=True)
        for m_i, seq_ids in enumerate(micro):  # a micro-batch: indices into sequences
            tokens, mask = collate([sequences[i] for i in seq_ids],  # (B, T), (B, T-1)
                                   [prompt_lens[i] for i in seq_ids], cfg.pad_id, device)
            adv = advantages[seq_ids].to(device)  # (B,)
            with no_sync() if m_i < len(micro) - 1 else nullcontext():
                logp = token_logprobs(net, tokens, cfg.temperature)
                # the rollout came from the weights of epoch 0: their log-probs are the "old" ones
                logp_old = old.setdefault(m_i, logp.detach())
                with torch.no_grad():  # the frozen reference's, for the KL term
                    kl_on = cfg.kl_coef > 0
                    logp_ref = token_logprobs(ref_model, tokens, cfg.temperature) if kl_on else None
                loss, st = grpo_loss(logp, logp_old, adv, mask, cfg.clip_eps, cfg.kl_coef, logp_ref)
                # mean x tokens = this micro-batch's sum; x scale = its share of the global mean
                (loss * mask.sum() * scale).backward()
            n_mask, n_mine = float(mask.sum()), max(n_local, 1)  # this rank's means, for the log
            total_loss += float(loss.detach()) * n_mask / n_mine
            clip += st["clip_frac"] * n_mask / n_mine
        grad_norm = torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        ok = torch.isfinite(grad_norm).float().reshape(1)  # (1,): 1.0 where finite, no sync
        if dist.is_initialized():
            dist.all_reduce(ok, op=dist.ReduceOp.MIN)  # every rank skips together, or none does
        if ok.item() < 1:  # sync: the update's one read of the gradient's health
            opt.zero_grad(set_to_none=True)
            skipped = True
            continue
        opt.step()
    return total_loss / cfg.epochs, clip / cfg.epochs, skipped


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


def token_logprobs(model, tokens, temperature=1.0):
    """log p(tokens[:, t+1] | tokens[:, :t+1]) under softmax(logits / temperature), the
    distribution the rollout sampled from, for every t: (B, T-1)."""
    if not temperature > 0:
        raise ValueError(f"log-probs need a temperature > 0 (0 is greedy), got {temperature}")
    logits, _ = model(tokens[:, :-1])  # (B, T-1, V)
    # bf16 autocast -> fp32 softmax; dividing by 1.0 changes no bit
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32)) / temperature
    return torch.gather(F.log_softmax(logits, dim=-1), 2, tokens[:, 1:, None]).squeeze(-1)


# -----------------------------------------------------------------------------
# the step's rows and the seeds, the same on every rank; dealing rows for the update

def step_rows(args, task, step, rank, world_size):
    """This rank's slice of the global batch's rows (problems x G; a group may span ranks), their
    keys and the row count. Keys follow global places, so "gumbel" tokens match on any ranks."""
    prng = random.Random(derive_seed(args.rl_seed, 0, step, Seed.RL_PROMPTS))  # on every rank
    problems = [task.sample(prng) for _ in range(args.prompts_per_step)]  # the step's
    n_rows = len(problems) * args.group_size
    mine = range(rank * n_rows // world_size, (rank + 1) * n_rows // world_size)
    my_problems = [problems[i // args.group_size] for i in mine]  # a problem per row
    keys = [derive_seed(args.rl_seed, step, i, Seed.ROLLOUT_KEYS) for i in mine]
    return my_problems, keys, n_rows


def derive_seed(*parts):
    """A seed for any tuple of integers, such as (base seed, rank, step, purpose): each random
    stream gets its own (`Seed` says its order), so nothing reseeds the global generator."""
    h = 0
    for x in parts:
        h = (h * 1_000_003 + int(x)) % (2 ** 61 - 1)
    return h


class Seed(enum.IntEnum):
    """What a derived seed is for, one stream each: most are derive_seed(seed, rank, step, Seed.X),
    row keys derive_seed(seed, step, row, Seed.ROLLOUT_KEYS) or (seed, row, 0, Seed.EVAL_KEYS)."""
    TARGET_DATA = 1        # the target warm-up's warm-up traces
    DRAFTER_DATA = 2       # the drafter warm-up's prompts and batches
    DRAFTER_SAMPLES = 3    # the target's samples the drafter warms up on
    INIT = 4               # initial weights, the same on every rank
    BANDIT = 5             # the bandit's exploration
    RL_PROMPTS = 6         # each RL step's prompts, the same on every rank
    ROLLOUT = 7            # rollout sampling with --sampler rejection
    DRAFTER_TRAINING = 8   # idle-rank drafter batches
    EVAL = 9               # evaluation sampling with --sampler rejection
    ROLLOUT_KEYS = 10      # each rollout row's key with --sampler gumbel
    EVAL_KEYS = 11         # each evaluation row's key with --sampler gumbel


def deal_by_tokens(lengths, world_size):
    """Row lengths -> {rank: [rows]} with about as many tokens per rank, so that no rank keeps the
    others waiting at DDP's all-reduce: the longest row first, each to the rank with fewest."""
    load, deal = [0] * world_size, {r: [] for r in range(world_size)}
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        r = min(range(world_size), key=lambda r: (load[r], r))
        deal[r].append(i)
        load[r] += lengths[i]
    return deal


def group_by_length(items, length, token_budget):
    """Sort by length and cut into batches of about `token_budget` padded tokens (each padded to its
    longest item), so long-tailed lengths waste little padding. At least one (maybe empty) batch."""
    batches, cur = [], []
    for it in sorted(items, key=length):
        if cur and (len(cur) + 1) * length(it) > token_budget:
            batches.append(cur)
            cur = []
        cur.append(it)
    batches.append(cur)
    return batches
