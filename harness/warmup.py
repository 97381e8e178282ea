"""train.py's first step, before RL (and the bench's): the warm-ups, cached in --warmup-dir.

The target trains on the task's warm-up traces (next-token loss), its merged tokens' embeddings
started as the sums of their parts, its problems moving from small ones to the RL mix. The drafter,
when --drafter-warmup-steps asks for one, trains on the target's samples until its plateau on
held-out samples, not to a step count. Each is saved with what made it (its "meta") and reused by a
run whose meta matches; one made by other settings is made afresh, with a line saying why.

Test: python -m pytest tests/test_train.py tests/test_drafter.py
"""
import copy
import dataclasses
import math
import os
import random
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import rl
from drafter import Drafter, DrafterBuffer, chain_loss_masks, chained_states, make_optimizer
from drafter import pair_batch, train_step
from model import GPT
from rollout import ARMS, rollout
from harness.instrument import liveness_observer
from harness.config import model_config
from harness.checkpoint import load_on_rank0, save_on_rank0
from harness.distributed import multi_rank, print0
from harness.liveness import beat, beating, wait_for_all


# -----------------------------------------------------------------------------
# target warm-up: supervised training on warm-up traces

def sft_batches(rng, task, n_batches, token_budget):
    """n_batches length-grouped batches of warm-up traces (token ids, prompt length), shuffled."""
    pool = [task.warmup_example(task.sample(rng), rng) for _ in range(n_batches * 64)]
    batches = rl.group_by_length(pool, lambda e: len(e[0]), token_budget)
    rng.shuffle(batches)
    return batches[:n_batches]


def lr_at(step, total, peak):
    """A linear warm-up over the first 5% of the steps, then a cosine down to 10% of peak."""
    warm = max(1, total // 20)
    if step < warm:
        return peak * (step + 1) / warm
    frac = (step - warm) / max(1, total - warm)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))


def global_mean_scale(n_local, device):
    """W / N, with W the world size and N the loss's tokens on all ranks (n_local all-reduced): a
    rank's summed loss times it, averaged by DDP, is the mean over every rank's tokens."""
    n = torch.tensor(float(n_local), dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(n)
    world = dist.get_world_size() if dist.is_initialized() else 1
    return world / max(n.item(), 1.0)  # sync: one read


def sft_step(model, net, opt, batch, pad_id, device):
    """One supervised step on a batch of (token ids, prompt length): next-token loss on response
    tokens only (the prompt's digits are random), the mean over every rank's response tokens, so
    the step does not depend on how the tokens fall on the ranks. -> (loss, padded tokens read)."""
    ids, plens = zip(*batch)
    tokens, mask = rl.collate(ids, plens, pad_id, device)
    x, y = tokens[:, :-1], tokens[:, 1:].masked_fill(~mask, -100)
    logits, _ = net(x)
    loss_sum = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1),
                               ignore_index=-100, reduction="sum")
    loss = loss_sum * global_mean_scale(mask.sum(), device)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return loss_sum.detach() / mask.sum().clamp(min=1), x.numel()  # this rank's mean, for the log


@torch.no_grad()
def init_merged_embeddings(model, task):
    """Each merged token's embedding := the sum of its parts' / sqrt(parts), for the task's merges
    (the running sum: "b7" from "b" and "7"). The task's hard skill is a look-up (write "b", copy
    the digit of the prompt's "b7"); from random embeddings the target sits on a loss plateau for a
    seed-dependent time until it finds that "b7" shares a label and a digit with "b" and "7".
    Started as sums, "b" already matches "b7" in attention and "b7" carries the "7"."""
    wte = model.wte.weight
    for merged, parts in task.merges():
        wte[merged] = sum(wte[i] for i in parts) / math.sqrt(len(parts))


def warmup_target(model, args, warmup_task, ddp, rank, world_size, device):
    """Supervised training on the task's warm-up traces, all ranks under DDP; the problem-size
    exponent moves from warmup_task's alpha to --warmup-alpha-end over the warm-up."""
    if args.merge_init:
        init_merged_embeddings(model, warmup_task)  # deterministic: the same on every rank
    model.train()
    net = DDP(model, forward_sync_buffers=False) if ddp else model  # the rotary tables never change
    opt = torch.optim.AdamW(model.parameters(), lr=args.warmup_lr, betas=(0.9, 0.95),
                            weight_decay=0.1)
    rng = random.Random(rl.derive_seed(args.seed, rank, 0, rl.Seed.TARGET_DATA))
    budget, steps = max(1, args.warmup_tokens // world_size), args.warmup_steps
    t0, tokens_seen, batches = time.time(), 0, []
    for step in range(steps):
        if not batches:
            alpha = warmup_task.alpha + (args.warmup_alpha_end - warmup_task.alpha) * step / steps
            batches = sft_batches(rng, dataclasses.replace(warmup_task, alpha=alpha), 16, budget)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, steps, args.warmup_lr)
        loss, n_tokens = sft_step(model, net, opt, batches.pop(), warmup_task.pad_id, device)
        tokens_seen += n_tokens * world_size
        if step % 50 == 0 or step == steps - 1:
            el = time.time() - t0
            eta = el / (step + 1) * (steps - step - 1)
            print0(f"target warmup {step:05d}/{steps} ({100 * (step + 1) / steps:.1f}%) | "
                   f"loss {loss.item():.4f} | tok/s {tokens_seen / el:,.0f} | elapsed {el:.0f}s | "
                   f"eta {eta:.0f}s")
    model.eval()


# -----------------------------------------------------------------------------
# drafter warm-up: the target's own samples, hidden states kept, trained to a plateau

HELD_OUT_SEQS = 256  # target samples the warm-up scores the drafter on, never trains on (all ranks)
EVAL_EVERY = 100  # drafter steps between two scorings
MIN_GAIN = 0.02  # drafts accepted per chain of SCORE_DEPTH: a smaller gain is no progress
PATIENCE = 3  # scorings whose best gains less than MIN_GAIN over the best before them: a stall
LR_DROP = 0.3  # the factor the rate drops by at a stall; after DROPS drops, the next stall ends it
DROPS = 2
DEEP_FROM = 0.9  # held-out top-1 from which it trains on chained passes (teacher forcing before)
SCORE_DEPTH = max(ARMS)  # the figures score chains as deep as the longest draft


def sample_drafter_data(model, args, task, rank, world_size, device):
    """The target's samples of RL prompts with their hidden states: this rank's share of
    --drafter-warmup-seqs to train on and of HELD_OUT_SEQS to score on. Each rank beats while it
    samples (the ranks' lengths differ). -> (train buffer, held-out buffer, rng)."""
    seed = args.drafter_seed
    rng = random.Random(rl.derive_seed(seed, rank, 0, rl.Seed.DRAFTER_DATA))
    gen = torch.Generator(device=device).manual_seed(
        rl.derive_seed(seed, rank, 0, rl.Seed.DRAFTER_SAMPLES))
    dtype = getattr(torch, args.dtype)
    train = DrafterBuffer(keep_steps=1, dtype=dtype)  # no token bound
    held = DrafterBuffer(keep_steps=1, dtype=dtype)
    n_held = len(range(rank, HELD_OUT_SEQS, world_size))
    n_local = n_held + len(range(rank, args.drafter_warmup_seqs, world_size))
    for i in range(0, n_local, 64):
        problems = [task.sample(rng) for _ in range(min(64, n_local - i))]
        results = rollout(model, None, [task.prompt_ids(p) for p in problems],
                          task.max_response_len, temperature=args.temperature, eos_id=task.eos_id,
                          generator=gen, observer=liveness_observer(beat))
        for j, s in enumerate(results):
            (held if i + j < n_held else train).add(0, s.tokens, s.hidden, s.prompt_len)
    return train, held, rng


@torch.no_grad()
def chain_figures(drafter, h_in, x_next, h_tgt, mask, depth):
    """What the drafter's chains would get, per draft position 1..depth, on sequences the target
    sampled: (top-1 agreements, summed acceptance, positions), each (depth,). Top-1: the drafter's
    argmax is the target's. Acceptance: sum_x min(p, q), the chance that rejection sampling at
    temperature 1 accepts the draft; both given that the earlier drafts were accepted."""
    target = F.linear(h_tgt, drafter.target.lm_head.weight)  # (B, T, V)
    p = F.softmax(target.float(), dim=-1)
    agree, accept, n = [], [], []
    chains = zip(chained_states(drafter, h_in, x_next, depth), chain_loss_masks(mask, depth))
    for h_pred, m in chains:
        logits = F.linear(h_pred, drafter.target.lm_head.weight)
        q = F.softmax(logits.float(), dim=-1)
        agree.append(((logits.argmax(-1) == target.argmax(-1)) & m).sum())
        accept.append((torch.minimum(p, q).sum(-1) * m).sum())
        n.append(m.sum())
    return torch.stack(agree).double(), torch.stack(accept).double(), torch.stack(n).double()


def expected_accepted(rates):
    """Drafts accepted per chain of len(rates) drafts, from the acceptance at each draft position
    given the earlier ones (None: never decided, counted as 0)."""
    total, run = 0.0, 1.0
    for r in rates:
        run *= r or 0.0
        total += run
    return total


def held_out_figures(drafter, held, device, chunk=32):
    """chain_figures on every rank's held-out sequences, summed: (3, SCORE_DEPTH) float64, the
    same on every rank."""
    items = sorted(held.items, key=lambda it: it[1].shape[0])  # similar lengths: little padding
    total = torch.zeros(3, SCORE_DEPTH, dtype=torch.float64, device=device)
    for i in range(0, len(items), chunk):
        batch = pair_batch([it[1:] for it in items[i:i + chunk]], device)
        total += torch.stack(chain_figures(drafter, *batch, SCORE_DEPTH))
    if multi_rank():
        dist.all_reduce(total)
    return total


def describe(figures):
    """One line of the held-out figures: top-1, acceptance by draft position, drafts accepted."""
    agree, accept, n = figures
    rates = accept / n.clamp(min=1)
    return (f"top-1 {agree[0] / n[0].clamp(min=1):.3f} | acceptance by draft position "
            + " ".join(f"{r:.3f}" for r in rates.tolist())
            + f" | {expected_accepted(rates.tolist()):.2f} of {SCORE_DEPTH} accepted")


def warmup_drafter(drafter, model, args, task, ddp, rank, world_size, device):
    """The target samples RL prompts; the drafter trains on them to its plateau."""
    t0 = time.time()
    buffer, held, rng = sample_drafter_data(model, args, task, rank, world_size, device)
    wait_for_all()
    print0(f"drafter warmup: {buffer.tokens:,} tokens of target samples per rank to train on, "
           f"{HELD_OUT_SEQS} held-out samples to score on, in {time.time() - t0:.1f}s")
    return train_to_plateau(drafter, buffer, held, rng, args, ddp, device)


def length_window(buffer, order, batch_size, rng, device):
    """A batch (drafter.pair_batch) of a window of the buffer's sequences in length order (`order`):
    long-tailed lengths batched at random would be mostly padding. The window's start is uniform
    over -(batch_size - 1) .. len - 1, so the shortest and the longest are drawn too."""
    start = rng.randrange(-(batch_size - 1), len(order))
    window = order[max(start, 0):start + batch_size]
    return pair_batch([buffer.items[i][1:] for i in window], device)


def train_to_plateau(drafter, buffer, held, rng, args, ddp, device):
    """Train the drafter until its held-out figure stops improving. Every EVAL_EVERY steps it is
    scored (drafts accepted per chain of SCORE_DEPTH, `held_out_figures`); the rate warms up to
    --drafter-lr and stays while the score improves; a stall (the best of the last PATIENCE
    scorings not MIN_GAIN above the best before them) drops it by LR_DROP, and the stall after
    DROPS drops ends the warm-up. It trains teacher-forced until its top-1 reaches DEEP_FROM, then
    on --drafter-depth chained passes. The best-scoring weights are kept. --drafter-warmup-steps
    caps it. -> {"steps", "plateau" (False: stopped by the cap), "figures" (the kept ones)}."""
    opt = make_optimizer(drafter, args.drafter_lr)
    t0, warm = time.time(), min(100, max(1, args.drafter_warmup_steps // 20))
    best, best_state, scores, drops, step = -1.0, None, [], 0, 0
    deep = args.drafter_depth == 1  # chained passes yet?
    order = sorted(range(len(buffer.items)), key=lambda i: (buffer.items[i][1].shape[0], i))
    for step in range(args.drafter_warmup_steps):
        for g in opt.param_groups:
            g["lr"] = args.drafter_lr * min(1.0, (step + 1) / warm) * LR_DROP ** drops
        batch = length_window(buffer, order, args.drafter_batch, rng, device)
        depth = args.drafter_depth if deep else 1
        loss, _ = train_step(drafter, opt, batch, depth=depth, sync_grads=ddp)
        if (step + 1) % EVAL_EVERY and step + 1 < args.drafter_warmup_steps:
            continue
        figures = held_out_figures(drafter, held, device)
        score = expected_accepted((figures[1] / figures[2].clamp(min=1)).tolist())
        if score > best:  # the best weights are kept, however small the gain
            best, best_state, best_figures = score, copy.deepcopy(drafter.state_dict()), figures
        scores.append(score)
        print0(f"drafter warmup {step + 1:05d} | loss {loss:.4f} | "
               f"lr {opt.param_groups[0]['lr']:.1e} | {describe(figures)} | best {best:.2f} | "
               f"elapsed {time.time() - t0:.0f}s")
        if not deep and figures[0][0] >= DEEP_FROM * figures[2][0]:  # now train the chains
            deep, scores = True, []
        # a window of PATIENCE scorings, so that one lucky scoring neither starts nor ends a stall
        if deep and len(scores) > PATIENCE and \
                max(scores[-PATIENCE:]) < max(scores[:-PATIENCE]) + MIN_GAIN:
            drops, scores = drops + 1, scores[-1:]
            if drops > DROPS:
                break
    drafter.load_state_dict(best_state)
    plateau = drops > DROPS
    how = ("reached its plateau" if plateau
           else "stopped by --drafter-warmup-steps, SHORT of its plateau")
    print0(f"drafter warmup {how} after {step + 1} steps ({time.time() - t0:.0f}s); kept the best, "
           f"on {HELD_OUT_SEQS} held-out samples: {describe(best_figures)}")
    return {"steps": step + 1, "plateau": plateau, "figures": best_figures.tolist()}


# -----------------------------------------------------------------------------
# both, cached

TARGET_FLAGS = ("warmup_steps", "warmup_tokens", "warmup_lr", "warmup_alpha_end", "merge_init",
                "seed", "dtype")  # the recipe and seed (bf16 trains other weights)
DRAFTER_FLAGS = ("drafter_layers", "drafter_seed", "drafter_warmup_seqs", "drafter_warmup_steps",
                 "drafter_lr", "drafter_batch", "drafter_depth", "temperature")


def model_meta(args, config, warmup_task):
    """What the target warm-up depends on: the task (its warm-up traces), shape, recipe, seed."""
    return {"model": dataclasses.asdict(config), "task": warmup_task.meta(),
            **{k: getattr(args, k) for k in TARGET_FLAGS}}


def drafter_meta(args, config, task, warmup_task):
    """The drafter warm-up also depends on the RL task (it learns from the target's samples of RL
    prompts) and on the drafter's own shape and recipe."""
    return {**model_meta(args, config, warmup_task), "rl_task": task.meta(),
            **{k: getattr(args, k) for k in DRAFTER_FLAGS}}


def prepare_models(args, task, warmup_task, ddp, rank, world_size, device):
    """Build target and drafter; warm each up, or reuse its cached warm-up. task is the RL task,
    warmup_task the target warm-up's (the same task, starting with more small problems)."""
    config = model_config(args, task)
    torch.manual_seed(rl.derive_seed(args.seed, 0, 0, rl.Seed.INIT))  # the same on every rank
    model = GPT(config).to(device)
    torch.manual_seed(rl.derive_seed(args.drafter_seed, 0, 0, rl.Seed.INIT))  # the drafter's own
    drafter = Drafter(model, args.drafter_layers).to(device)
    n_target, n_drafter = (sum(p.numel() for p in m.parameters()) for m in (model, drafter))
    print0(f"task {task.name}; target: {n_target:,} parameters; drafter: {args.drafter_layers} "
           f"layer(s), {n_drafter:,} (+ the target's embedding and head, shared); {config}")
    # a first CUDA step (kernels loaded on first use) can take long, each rank at its own pace:
    # take it here, outside any collective; the next one (load_on_rank0) waits by liveness
    with beating("in its first forward and backward pass"):
        model(torch.zeros(1, 1, dtype=torch.long, device=device))[0].sum().backward()
    model.zero_grad(set_to_none=True)
    path = os.path.join(args.warmup_dir, "target_warmup.pt")
    meta = model_meta(args, config, warmup_task)
    cached = load_on_rank0(path, meta, cache=True)
    if cached:
        model.load_state_dict(cached["model"])
        print0(f"reusing the warmed-up target from {path}")
    else:
        warmup_target(model, args, warmup_task, ddp, rank, world_size, device)
        save_on_rank0({"meta": meta, "model": model.state_dict()}, path)
    model.eval()
    if args.drafter_warmup_steps == 0:
        print0("cold start: no drafter warm-up; the drafter is built from nothing on idle "
               "ranks during RL")
        return model, drafter
    path = os.path.join(args.warmup_dir, "drafter_warmup.pt")
    meta = drafter_meta(args, config, task, warmup_task)
    cached = load_on_rank0(path, meta, cache=True)
    if cached:
        drafter.load_state_dict(cached["drafter"])
        print0(f"reusing the warmed-up drafter from {path}")
    else:
        warmup_drafter(drafter, model, args, task, ddp, rank, world_size, device)
        save_on_rank0({"meta": meta, "drafter": drafter.state_dict()}, path)
    return model, drafter
