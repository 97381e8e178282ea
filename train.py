"""Warm up a small GPT on the running-sum task, then improve it with GRPO and TLT rollouts.

    python train.py                                    # one process, CPU or one GPU
    torchrun --standalone --nproc_per_node=2 train.py  # several ranks (gloo; NCCL when each has its own GPU)

(1) Supervised warm-up of the target on reference traces; (2) warm-up of the drafter on the
target's own samples; both cached in --warmup-dir (default: --out-dir) and reused when their settings match.
(3) --rl-steps of GRPO. Each step: every rank rolls out its shard (speculative decoding in the
long tail with --tlt on), ranks that finish early train the drafter until the last one finishes
(--drafter-updates on), the drafters are synced, then one GRPO update of the target under DDP.
Rank 0 logs one line per step and appends a record to <out-dir>/metrics.jsonl; a checkpoint with
everything needed to continue is written atomically every --ckpt-every steps, and rerunning the
same command resumes from it.
"""
import argparse
import copy
import hashlib
import json
import math
import os
import random
import statistics
import sys
import time
import warnings

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import rl
import task
from drafter import (DEPTH, DRAFTER_BATCH, IDLE_STEP_TOKENS, DrafterBuffer, NgramDrafter, SiblingDrafter, SiblingOrLearned,
                     agreement_chores, make_optimizer)
from model import GPTConfig
from evaluate import evaluate_both, format_accuracy
from checkpoint import load_on_rank0, save_on_rank0
from common import OneLineParser, check_out_dir, derive_seed, machine, on_off, sync
from distributed import COLLECTIVE_TIMEOUT_S, all_sum, compute_init, print0
from liveness import IO_DEADLINE_S, Liveness
from rollout import ARMS, Bandit, rollout
from scheduler import gather_ranks, idle_train, render_timeline, start_drafter_sync
from speculative import SAMPLERS
from warmup import drafter_meta, prepare_models

DRAFTERS = ("learned", "ngram", "sibling", "sibling+learned")  # --drafter: what drafts in the tail
LEARNED = ("learned", "sibling+learned")  # the drafters whose learned part idle ranks train


def task_config(args, warmup=False):
    """The task as the flags define it; warmup=True: with the warm-up's problem-size exponent."""
    return task.TaskConfig(max_n=args.max_n, alpha=args.warmup_alpha if warmup else args.alpha,
                           recheck=args.recheck, max_passes=args.max_passes, noise=args.noise, careful=args.careful)


def autocast(args, device):
    """The forwards' precision. --dtype bfloat16: torch.autocast in bf16 on `device` (matrix products
    and attention in bf16; weights, gradients and optimizer state stay float32, the master copy);
    float32: a context that does nothing. The files that own them keep the rotation, the softmaxes,
    the Gumbel noise and the checksums in float32. Backward passes run inside it too, which changes
    nothing (each backward op runs in its forward op's dtype, inside the context or not).
    Autocast's weight cache is off: it keeps one bf16 copy of each weight until the outermost context
    exits, and the optimizer steps taken inside one (warm-ups, idle training, the GRPO update) change
    the weights in place, so later forwards would read the stale copy (measured: they do). The price
    is one cast per weight per forward."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.dtype == "bfloat16", cache_enabled=False)


def parse_args(argv=None):
    p = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # run
    p.add_argument("--out-dir", default="out", help="where checkpoints and metrics.jsonl go")
    p.add_argument("--warmup-dir", default=None, help="where the warm-up checkpoints are cached (default: --out-dir)")
    p.add_argument("--seed", type=int, default=1337, help="base seed; per-rank, per-step seeds derive from it")
    p.add_argument("--rl-seed", type=int, default=None, help="seed of the RL phase only (default: --seed), for noise estimates")
    p.add_argument("--drafter-seed", type=int, default=None, help="seed of the drafter warm-up only (its initial weights, "
                   "samples and batches; default: --seed), for its spread")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="where to run")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="bfloat16: every forward (warm-ups, "
                   "rollouts, GRPO update, evaluation) under bf16 autocast, weights and optimizer state kept in float32")
    # task
    p.add_argument("--max-n", type=int, default=task.TaskConfig.max_n, help="largest problem size (digits to sum)")
    p.add_argument("--alpha", type=float, default=task.TaskConfig.alpha, help="tail exponent of the problem-size distribution")
    p.add_argument("--recheck", type=float, default=task.TaskConfig.recheck, help="reference traces: probability of one more re-check "
                   "pass after each answer (lengths then vary between samples of one prompt)")
    p.add_argument("--max-passes", type=int, default=task.TaskConfig.max_passes, help="reference traces: at most this many passes")
    p.add_argument("--noise", type=float, default=task.TaskConfig.noise, help="reference traces: probability that a running-sum step "
                   "is written wrong (the warmed-up target then errs at about this rate when sampling)")
    p.add_argument("--careful", type=float, default=task.TaskConfig.careful, help="reference traces: probability that a step "
                   "is written out carefully, b7=3+7=0 instead of b7=0, with a quarter of the noise (0: never)")
    p.add_argument("--careful-bonus", type=float, default=0.0, help="RL reward: a correct answer earns this times its share of "
                   "careful steps on top of 1 (a format reward: RL then changes how the target writes)")
    p.add_argument("--warmup-alpha", type=float, default=2.0, help="tail exponent of the problem sizes at the start "
                   "of the target warm-up: mostly small problems, where the look-up is learned")
    p.add_argument("--warmup-alpha-end", type=float, default=0.5, help="the exponent moves linearly from "
                   "--warmup-alpha to this over the warm-up, a curriculum toward long problems (equal: none)")
    # model
    p.add_argument("--n-layer", type=int, default=12, help="target transformer layers")
    p.add_argument("--n-head", type=int, default=4, help="attention heads")
    p.add_argument("--n-embd", type=int, default=48, help="model width")
    p.add_argument("--block-size", type=int, default=256, help="longest sequence the model holds")
    # target warm-up
    p.add_argument("--warmup-steps", type=int, default=2400, help="supervised optimizer steps for the target")
    p.add_argument("--warmup-tokens", type=int, default=2048, help="padded tokens per warm-up batch, all ranks together")
    p.add_argument("--warmup-lr", type=float, default=6e-3, help="peak learning rate of the target warm-up")
    p.add_argument("--merge-init", type=on_off, default=True, metavar="on|off", help="start each labelled-digit "
                   "token's embedding as (label + digit) / sqrt(2) (off: random, as every other token)")
    # drafter
    p.add_argument("--drafter-warmup-seqs", type=int, default=2048, help="target samples the drafter warms up on")
    p.add_argument("--drafter-warmup-steps", type=int, default=6000, help="at most this many drafter optimizer steps in its "
                   "warm-up, which ends at its plateau on held-out samples (warmup.py), usually well before (0: a cold "
                   "start, no warm-up and no sampling for one: the idle ranks build the drafter during RL)")
    p.add_argument("--drafter-lr", type=float, default=2e-3, help="peak drafter learning rate of the warm-up")
    p.add_argument("--drafter-cold-lr", type=float, default=4e-3, help="a cold start's drafter learning rate on idle ranks: "
                   "it decays on a cosine from this to a twentieth of it over the RL steps")
    p.add_argument("--drafter-online-lr", type=float, default=5e-5, help="drafter learning rate on idle ranks during RL")
    p.add_argument("--drafter-batch", type=int, default=DRAFTER_BATCH, help="sequences per drafter training step")
    p.add_argument("--drafter-depth", type=int, default=DEPTH, help="chained passes per drafter training step: the drafter "
                   "trains on its own predictions this many drafts deep (1: teacher forcing alone)")
    p.add_argument("--drafter-idle-tokens", type=int, default=IDLE_STEP_TOKENS, help="padded positions per drafter step on "
                   "idle ranks at most (fewer sequences when they are long): how long the last rank can wait for one")
    p.add_argument("--drafter-keep", type=int, default=32, help="RL steps of hidden states the drafter buffer keeps")
    p.add_argument("--drafter-keep-tokens", type=int, default=1_000_000, help="and at most this many tokens, the oldest "
                   "sequences dropped first (bounded memory; at least --block-size)")
    # RL
    p.add_argument("--rl-steps", type=int, default=200, help="GRPO steps")
    p.add_argument("--prompts-per-step", type=int, default=4, help="prompts per RL step, all ranks together")
    p.add_argument("--group-size", type=int, default=8, help="responses per prompt (the GRPO group)")
    p.add_argument("--rl-lr", type=float, default=1e-4, help="learning rate of the GRPO updates")
    p.add_argument("--rl-epochs", type=int, default=1, help="optimizer passes over each rollout")
    p.add_argument("--clip-eps", type=float, default=0.2, help="PPO clip range")
    p.add_argument("--kl-coef", type=float, default=0.0, help="weight of the KL to the warmed-up target (0: off)")
    p.add_argument("--temperature", type=float, default=1.0, help="rollout sampling temperature")
    p.add_argument("--sampler", default="gumbel", choices=SAMPLERS, help="gumbel: every token fixed by (sequence key, "
                   "position), so plain and speculative rollouts give the same tokens; rejection: classic "
                   "speculative sampling, the same distribution but other samples")
    p.add_argument("--update-tokens", type=int, default=1024, help="padded tokens per GRPO micro-batch")
    # TLT
    p.add_argument("--tlt", type=on_off, default=True, metavar="on|off", help="speculative decoding in the tail (off: plain baseline)")
    p.add_argument("--drafter-updates", type=on_off, default=True, metavar="on|off", help="train the drafter on idle ranks (off: frozen)")
    p.add_argument("--drafter", default="learned", choices=DRAFTERS, help="what drafts in the tail: the learned "
                   "EAGLE-style drafter (TLT); TLT-Base's model-free n-gram lookup in the row's own tokens; the model-free "
                   "lookup in the row's GRPO siblings; or the learned drafter until every running row is the last of its group, "
                   "then the siblings")
    p.add_argument("--sd-threshold", type=int, default=64, help="speculative steps only when the running batch is at most this")
    p.add_argument("--draft-ks", default=",".join(map(str, ARMS)), help="draft lengths the bandit picks from (0: a plain "
                   "step); one value fixes k, e.g. to compare two drafters at the same k")
    # logging, evaluation, checkpoints
    p.add_argument("--eval-per-bucket", type=int, default=40, help="held-out problems per size bucket (0: no evaluation)")
    p.add_argument("--eval-samples", type=int, default=8, help="samples per held-out problem for the sampled accuracy")
    p.add_argument("--timeline-every", type=int, default=10, help="print the per-rank timeline every N steps (0: never)")
    p.add_argument("--ckpt-every", type=int, default=10, help="write the RL checkpoint every N steps")
    p.add_argument("--io-deadline", type=float, default=IO_DEADLINE_S, help="seconds rank 0 may spend in one checkpoint "
                   "read or write (or a rank in its first CUDA step) before the others fail, naming it (default: "
                   "TLT_IO_DEADLINE or 1800)")
    args = p.parse_args(argv)
    positive = ("warmup_steps", "warmup_tokens", "warmup_lr", "drafter_warmup_seqs", "drafter_batch", "drafter_depth", "drafter_idle_tokens",
                "drafter_keep", "drafter_keep_tokens", "drafter_lr", "drafter_cold_lr", "drafter_online_lr", "prompts_per_step", "group_size", "rl_epochs", "rl_lr",
                "clip_eps", "update_tokens", "ckpt_every", "eval_samples", "io_deadline")
    non_negative = ("rl_steps", "drafter_warmup_steps", "careful_bonus", "kl_coef", "temperature", "sd_threshold", "timeline_every", "eval_per_bucket")
    for names, ok, what in ((positive, lambda v: v > 0, "positive"), (non_negative, lambda v: v >= 0, "non-negative")):
        for name in names:
            if not ok(getattr(args, name)):  # written so that NaN fails too
                p.error(f"--{name.replace('_', '-')} must be {what}, got {getattr(args, name)}")
    try:
        args.draft_ks = tuple(int(k) for k in args.draft_ks.split(","))
    except ValueError:
        p.error(f"--draft-ks takes comma-separated integers, got {args.draft_ks!r}")
    if min(args.draft_ks) < 0 or len(set(args.draft_ks)) != len(args.draft_ks):
        p.error(f"--draft-ks must be distinct non-negative integers, got {args.draft_ks}")
    try:  # the task and model configs check their own fields; a bad one is a flag error here
        task_config(args), task_config(args, warmup=True)
        task.TaskConfig(alpha=args.warmup_alpha_end)
        GPTConfig(vocab_size=task.VOCAB_SIZE, block_size=args.block_size, n_layer=args.n_layer, n_head=args.n_head,
                  n_embd=args.n_embd)
    except ValueError as e:
        p.error(str(e))
    need = task_config(args).max_seq_len + max(args.draft_ks)
    if args.block_size < need:
        p.error(f"--block-size {args.block_size} is too small for --max-n {args.max_n}: the longest prompt + "
                f"response + {max(args.draft_ks)} draft tokens needs {need}")
    if args.drafter_keep_tokens < args.block_size:  # so the newest sequence always fits
        p.error(f"--drafter-keep-tokens {args.drafter_keep_tokens} must be at least --block-size {args.block_size}")
    world_size = int(os.environ.get("WORLD_SIZE", 1))  # torchrun's; 1 for a single process
    if args.prompts_per_step * args.group_size < world_size:
        p.error(f"--prompts-per-step {args.prompts_per_step} x --group-size {args.group_size} = "
                f"{args.prompts_per_step * args.group_size} rows per step leave some of the {world_size} ranks without "
                f"work; raise --prompts-per-step")
    args.warmup_dir = args.warmup_dir or args.out_dir
    args.rl_seed = args.seed if args.rl_seed is None else args.rl_seed
    args.drafter_seed = args.seed if args.drafter_seed is None else args.drafter_seed
    return args


# -----------------------------------------------------------------------------
# main

def rl_meta(args, config, task_cfg):
    """What an RL checkpoint depends on: the warm-ups it started from and every RL setting."""
    keys = ("rl_seed", "careful_bonus", "drafter", "drafter_cold_lr", "drafter_online_lr", "prompts_per_step", "group_size", "rl_lr", "rl_epochs", "clip_eps", "kl_coef", "tlt", "drafter_updates",
            "sd_threshold", "drafter_keep", "drafter_keep_tokens", "drafter_idle_tokens", "update_tokens", "sampler")
    return {**drafter_meta(args, config, task_cfg, task_config(args, warmup=True)), **{k: getattr(args, k) for k in keys}, "draft_ks": list(args.draft_ks)}


def main(argv=None):
    args = parse_args(argv)
    check_out_dir(args.out_dir)
    check_out_dir(args.warmup_dir)
    task_cfg = task_config(args)
    ddp, rank, local_rank, world_size, device, store = compute_init(args.device)
    liveness = Liveness(store, rank, world_size, COLLECTIVE_TIMEOUT_S, io_deadline_s=args.io_deadline) if ddp else None
    try:
        run(args, task_cfg, ddp, rank, world_size, device, liveness)
        if ddp:
            dist.barrier()  # tearing gloo down while a peer still talks to it can abort the process
    finally:
        if ddp and dist.is_initialized():
            dist.destroy_process_group()
    if ddp:
        # Even after a clean teardown, about one 2-rank gloo run in 15 aborted in C++ static
        # destructors at interpreter exit ("terminate called without an active exception"),
        # turning a finished run into a failed one. Everything is written and flushed by now.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def run(args, task_cfg, ddp, rank, world_size, device, liveness=None):
    t_run = time.time()
    print0(f"{world_size} rank(s) on {machine(device)}")
    with autocast(args, device):  # the warm-ups' forwards too: a bf16 run is bf16 end to end
        config, model, drafter = prepare_models(args, task_cfg, task_config(args, warmup=True), ddp, rank, world_size, device)
    problems = task.eval_set(task_cfg, args.eval_per_bucket) if args.eval_per_bucket else []
    with autocast(args, device):
        acc0 = evaluate_both(model, drafter, problems, args, task_cfg, rank, world_size, "before RL")

    ref_model = copy.deepcopy(model).requires_grad_(False) if args.kl_coef > 0 else None  # frozen warm-up target
    net = DistributedDataParallel(model, forward_sync_buffers=False) if ddp else model  # the rotary tables never change
    opt = torch.optim.AdamW(model.parameters(), lr=args.rl_lr, betas=(0.9, 0.95), weight_decay=0.0)
    d_opt = make_optimizer(drafter, args.drafter_online_lr)
    bandit = Bandit(args.draft_ks, seed=derive_seed(args.rl_seed, rank, 0, task.Seed.BANDIT))
    buffer = DrafterBuffer(keep_steps=args.drafter_keep, keep_tokens=args.drafter_keep_tokens, dtype=getattr(torch, args.dtype))
    ckpt_path = os.path.join(args.out_dir, "ckpt.pt")
    metrics_path = os.path.join(args.out_dir, "metrics.jsonl")
    meta = rl_meta(args, config, task_cfg)
    start, recent = resume(ckpt_path, meta, model, drafter, opt, d_opt, bandit, rank)
    if rank == 0:  # every step appears once: drop records past the checkpoint (a crash after logging)
        lines = []
        if os.path.exists(metrics_path):
            with open(metrics_path) as f:
                lines = [ln for ln in f if ln.strip() and json.loads(ln)["step"] < start]
        with open(metrics_path, "w") as f:
            f.writelines(lines)

    n_rows = args.prompts_per_step * args.group_size
    print0(f"RL: {args.rl_steps} steps x {args.prompts_per_step} prompts x {args.group_size} samples on {world_size} "
           f"rank(s) ({n_rows // world_size}{'+' if n_rows % world_size else ''} rows each) | tlt {'on' if args.tlt else 'off'} | drafter updates "
           f"{'on' if args.drafter_updates and args.tlt else 'off'} | sd threshold {args.sd_threshold}")
    history = []
    for step in range(start, args.rl_steps):
        with autocast(args, device):  # rollout, drafter training, GRPO update
            rec, ranks = rl_step(step, args, task_cfg, model, net, drafter, opt, d_opt, bandit, buffer, rank, world_size,
                                 device, ref_model, liveness, drafter_health(recent))
        if rec["drafter_top1_positions"]:  # the drafter's health: the last steps' figures, one step's rows being few
            n = rec["drafter_top1_positions"]
            recent = (recent + [[rec["drafter_top1"] * n, n]])[-HEALTH_STEPS:]
        history.append(rec)
        if rank == 0:
            with open(metrics_path, "a") as f:
                f.write(json.dumps(rec) + "\n")
        log_step(rec, ranks, args)
        if (step + 1) % args.ckpt_every == 0 or step == args.rl_steps - 1:
            bandits = gather_ranks(bandit.state_dict())
            save_on_rank0({"meta": meta, "step": step, "model": model.state_dict(), "drafter": drafter.state_dict(),
                           "opt": opt.state_dict(), "d_opt": d_opt.state_dict(), "bandits": bandits, "drafter_health": recent}, ckpt_path)

    with autocast(args, device):
        acc1 = evaluate_both(model, drafter, problems, args, task_cfg, rank, world_size, "after RL", check=True)
    if history:
        summary(history, acc0, acc1, time.time() - t_run)


def resume(ckpt_path, meta, model, drafter, opt, d_opt, bandit, rank):
    """Load the RL checkpoint if rank 0 finds one (every rank follows its decision); -> the first step
    to run and the drafter's recent health figures (`drafter_health`). A checkpoint from another
    number of ranks resumes too: ranks it did not have start their bandits fresh."""
    ck = load_on_rank0(ckpt_path, meta)
    if not ck:
        return 0, []
    try:
        model.load_state_dict(ck["model"])
        drafter.load_state_dict(ck["drafter"])
        opt.load_state_dict(ck["opt"])
        d_opt.load_state_dict(ck["d_opt"])
        if rank < len(ck["bandits"]):
            bandit.load_state_dict(ck["bandits"][rank])
        recent = ck["drafter_health"]
    except (KeyError, TypeError, ValueError, RuntimeError) as e:  # same config, older layout of the state
        raise SystemExit(f"error: checkpoint {ckpt_path} does not fit this version of the code "
                         f"({type(e).__name__}: {e}); delete it or use another --out-dir")
    print0(f"resuming from {ckpt_path} at RL step {ck['step'] + 1}")
    return ck["step"] + 1, recent


def rl_prompts(args, task_cfg, step):
    """The step's prompts, the same on every rank and for any number of ranks."""
    prng = random.Random(derive_seed(args.rl_seed, 0, step, task.Seed.RL_PROMPTS))
    return [task.sample_problem(prng, task_cfg) for _ in range(args.prompts_per_step)]


HEALTHY, SICK = 0.98, 0.85  # the drafter's health (teacher-forced top-1) where online training is gentlest and hardest
HEALTH_STEPS = 5  # RL steps whose figures make the health


def drafter_health(recent):
    """The drafter's health: its teacher-forced top-1 agreement on the fresh rows of the last
    HEALTH_STEPS RL steps (`recent`: [agreeing positions, positions] per step; None before any).
    The same on every rank: each step's figure is summed over ranks."""
    n = sum(p for _, p in recent)
    return sum(a for a, _ in recent) / n if n else None


def drafter_schedule(args, step, health):
    """The idle ranks' drafter learning rate and training depth (chained passes) at RL step `step`,
    given the drafter's `health`. A cold start builds the drafter from nothing, as a warm-up would,
    teacher-forced, with a cosine from --drafter-cold-lr down to a twentieth of it over the RL steps.
    A warmed-up drafter follows its health: --drafter-online-lr while it is at least HEALTHY (a
    drafter at its plateau only follows the target, and a large rate would only shake it), rising
    geometrically to --drafter-cold-lr at SICK and below, where a weak drafter (stopped early, or
    left behind by the target) is trained as hard as a cold start is; always on --drafter-depth
    chained passes, which cost more per step than teacher forcing alone but keep every draft
    position good (trained teacher-forced it gained more top-1 and fewer accepted tokens).
    RESULTS.md has the schedules tried, with their figures."""
    if args.drafter_warmup_steps == 0:
        frac, peak = step / max(1, args.rl_steps - 1), args.drafter_cold_lr
        return peak / 20 + (peak - peak / 20) * 0.5 * (1 + math.cos(math.pi * frac)), 1
    if health is None:
        return args.drafter_online_lr, args.drafter_depth
    sick = min(1.0, max(0.0, (HEALTHY - health) / (HEALTHY - SICK)))
    return args.drafter_online_lr * (args.drafter_cold_lr / args.drafter_online_lr) ** sick, args.drafter_depth


def proposer(name, drafter):
    """What drafts for --drafter `name`; `drafter` is the learned one."""
    return {"learned": lambda: drafter, "ngram": NgramDrafter, "sibling": SiblingDrafter,
            "sibling+learned": lambda: SiblingOrLearned(drafter)}[name]()


def step_rows(args, task_cfg, step, rank, world_size):
    """This rank's rows of the step's global batch (prompts x G samples): their problems, their keys,
    and the number of rows in the global batch. Rows, not prompts, are dealt, in contiguous slices
    whose sizes differ by at most one, so a GRPO group may span ranks (its advantages come from every
    rank's rewards) and 8 ranks share 4 prompts. A row's key depends on the seed, the step and its
    place in the global batch, never on this rank's layout: with --sampler gumbel the tokens are the
    same on any number of ranks, with or without speculation."""
    problems = rl_prompts(args, task_cfg, step)
    n_rows = len(problems) * args.group_size
    mine = slice(rank * n_rows // world_size, (rank + 1) * n_rows // world_size)
    rows = [problems[i // args.group_size] for i in range(n_rows)][mine]
    keys = [derive_seed(args.rl_seed, step, i, task.Seed.ROLLOUT_KEYS) for i in range(n_rows)][mine]
    return rows, keys, n_rows


def rl_step(step, args, task_cfg, model, net, drafter, opt, d_opt, bandit, buffer, rank, world_size, device,
            ref_model=None, liveness=None, health=None):
    """One RL step on this rank, in the seven steps of the README. Returns the step's record and
    every rank's timeline segments."""
    t0 = time.perf_counter()
    # 1. this rank's rows of the step's global batch, each with its key
    rows, keys, n_rows = step_rows(args, task_cfg, step, rank, world_size)
    # 2. roll out: plain steps while the running batch is large, speculative ones in the tail; score
    gen = torch.Generator(device=device).manual_seed(derive_seed(args.rl_seed, rank, step, task.Seed.ROLLOUT))
    samples, st = rollout(model, proposer(args.drafter, drafter),
                          [task.encode(p.prompt()) for p in rows], task_cfg.max_response_len,
                          temperature=args.temperature, eos_id=task.EOS_ID, generator=gen, tlt=args.tlt,
                          sd_threshold=args.sd_threshold, bandit=bandit, sampler=args.sampler, keys=keys,
                          progress=liveness.beat if liveness else None)
    rollout_time = time.perf_counter() - t0
    texts = [task.decode(s.response) for s in samples]
    rewards = torch.tensor([task.reward(p.prompt(), t, args.careful_bonus) for p, t in zip(rows, texts)])
    # 3-4. idle time: the drafter's health on the fresh rows (teacher-forced top-1 agreement with the
    # target, before it trains on them), the rows into its buffer, then drafter training, until the
    # last rank has finished its rollout. The last rank does none of it: nothing the drafter needs
    # stands between its rollout and its update (what it would have scored is left out of the figure)
    learned = args.tlt and args.drafter in LEARNED
    train_drafter = learned and args.drafter_updates
    top1 = [0, 0]
    if train_drafter:
        buffer.add_rows(step, samples)  # no copy here: the buffer stores them on its next use, idle time
    d_lr, d_depth = drafter_schedule(args, step, health)
    for g in d_opt.param_groups:
        g["lr"] = d_lr
    drng = random.Random(derive_seed(args.rl_seed, rank, step, task.Seed.DRAFTER_TRAINING))
    t_idle = time.perf_counter() - t0
    d_steps, d_skipped, idle, idle_segs = idle_train(
        drafter, d_opt, buffer, drng, chores=agreement_chores(drafter, samples, top1, device=device) if learned else (),
        enabled=train_drafter, batch_size=args.drafter_batch, depth=d_depth, step_tokens=args.drafter_idle_tokens,
        device=device, liveness=liveness)
    # 5. every rank ends with the same drafter: the weighted average overlaps the update
    finish_sync = start_drafter_sync(drafter, d_steps if train_drafter else 0)
    # 6. every rank's rewards and sequences (a group may span ranks), group-normalised advantages over
    # the global batch, and one GRPO update of the target under DDP, on the rows that carry a gradient,
    # re-dealt so that every rank updates about as many tokens; its token-level mean is over the global batch
    everyone = gather_ranks((rewards.tolist(), [s.tokens.tolist() for s in samples], [s.prompt_len for s in samples]))
    t_update = time.perf_counter()  # the update's first collective is done: every rank is here
    all_rewards = torch.tensor([r for part in everyone for r in part[0]], dtype=torch.float64)
    seqs, plens = [x for part in everyone for x in part[1]], [x for part in everyone for x in part[2]]
    adv = rl.group_advantages(all_rewards, args.group_size)
    active = [i for i in range(n_rows) if args.kl_coef > 0 or adv[i] != 0]  # a zero advantage adds a zero gradient
    ours = [active[j] for j in rl.deal_by_tokens([len(seqs[i]) for i in active], world_size)[rank]]
    model.train()
    loss, clip, skipped = rl.grpo_update(model, net, opt, [seqs[i] for i in ours], [plens[i] for i in ours], adv[ours],
                                         pad_id=task.PAD_ID, update_tokens=args.update_tokens, epochs=args.rl_epochs,
                                         clip_eps=args.clip_eps, kl_coef=args.kl_coef, ref_model=ref_model, device=device,
                                         n_total=sum(len(s) - p for s, p in zip(seqs, plens)))
    finish_sync()
    model.eval()
    sync(device)  # the optimizer step may still be queued on a GPU
    t1 = time.perf_counter()
    # 7. the step's record (rank 0 logs it): this rank's part, then every rank's
    local = {"rank": rank, "rollout_time": rollout_time, "draft_time": st.draft_time, "idle_time": idle, "drafter_steps": d_steps,
             "wait_to_update": t_update - t0 - rollout_time,
             "drafter_skipped": d_skipped, "tokens": st.tokens, "drafter_checksum": drafter.checksum(),
             "rows": len(rows), "tail_share": st.tail_share,
             "segments": st.segments + [[k, a + t_idle, b + t_idle] for k, a, b in idle_segs]}
    counts = {"tokens": st.tokens, "sd_tokens": st.sd_tokens, "sd_row_steps": st.sd_row_steps,
              "accepted": st.accepted, "drafted": st.drafted, "top1_agree": top1[0], "top1_positions": top1[1],
              "careful": sum(map(task.careful_share, texts)), "response_tokens": sum(len(s.response) for s in samples),
              **position_counts(st, max(args.draft_ks))}
    responses = [s[p:] for s, p in zip(seqs, plens)]  # every rank's, in global row order
    rec, ranks = step_record(step, local, all_sum(counts, device), all_rewards, responses, t1 - t0, t1 - t_update)
    rec.update(loss=loss, clip_frac=clip, skipped_update=skipped, drafter_lr=d_lr, drafter_depth=d_depth, drafter_health=health,
               bandit_best=bandit.best())
    return rec, ranks


def position_counts(stats, k_max):
    """A rollout's drafts decided and accepted at each draft position 1..k_max, as {name: count}
    (all_sum's form; DecodeStats has the meaning)."""
    pad = lambda v: v + [0] * (k_max - len(v))  # noqa: E731
    return {**{f"drafted_at{i}": v for i, v in enumerate(pad(stats.drafted_at))},
            **{f"accepted_at{i}": v for i, v in enumerate(pad(stats.accepted_at))}}


def by_position(records):
    """Acceptance at each draft position summed over records -> ([rates or None], [drafts decided])."""
    drafted = [sum(c) for c in zip(*(r["drafted_at"] for r in records))]
    accepted = [sum(c) for c in zip(*(r["accepted_at"] for r in records))]
    return [a / d if d else None for a, d in zip(accepted, drafted)], drafted


def format_positions(rates):
    return " ".join("  -  " if r is None else f"{100 * r:4.1f}" for r in rates)


def step_record(step, local, total, all_rewards, responses, step_time, update_time):
    """The step's metrics.jsonl record from this rank's `local` part and the sums over ranks, and
    every rank's part (the timeline draws their segments)."""
    ranks = gather_ranks(local)
    if len({r["drafter_checksum"] for r in ranks}) > 1:
        warnings.warn(f"step {step}: the ranks' drafters differ after the sync ({[r['drafter_checksum'] for r in ranks]})")
    slowest = max(ranks, key=lambda r: r["rollout_time"])
    rollout_max, n_rows = slowest["rollout_time"], all_rewards.numel()
    # one hash of every response of the step in global row order: two runs, on any numbers of ranks,
    # can be compared token for token
    digest = hashlib.sha256(json.dumps(responses).encode()).hexdigest()[:16]
    return {
        "step": step, "step_time": step_time, "rollout_time": rollout_max, "update_time": update_time,
        "tail_share": slowest["tail_share"], "rollout_share": rollout_max / step_time, "responses_digest": digest,
        "draft_time": slowest["draft_time"],  # of the slowest rank's rollout, in the drafter
        # what stood between the slowest rank's rollout and its update: rewards, the barrier, a drafter
        # step still in flight on another rank (idle training is free only if this stays near 0)
        "slowest_wait": slowest["wait_to_update"],
        "reward": float(all_rewards.mean()),
        "accept_len": total["sd_tokens"] / total["sd_row_steps"] if total["sd_row_steps"] else None,
        "accept_rate": total["accepted"] / total["drafted"] if total["drafted"] else None,
        "drafter_top1": total["top1_agree"] / total["top1_positions"] if total["top1_positions"] else None,
        # per draft position: drafts decided there (the earlier ones accepted) and accepted
        "drafted_at": [int(v) for k, v in total.items() if k.startswith("drafted_at")],
        "accepted_at": [int(v) for k, v in total.items() if k.startswith("accepted_at")],
        "drafter_top1_positions": int(total["top1_positions"]),  # scored on idle time: the last rank's rows are left out
        # what the target writes: mean response length and share of careful steps
        "response_len": total["response_tokens"] / n_rows, "careful_share": total["careful"] / n_rows,
        "sd_token_frac": total["sd_tokens"] / max(total["tokens"], 1), "tok_s": total["tokens"] / max(rollout_max, 1e-9),
        "idle_time": max(r["idle_time"] for r in ranks), "drafter_steps": sum(r["drafter_steps"] for r in ranks),
        "drafter_skipped": sum(r["drafter_skipped"] for r in ranks), "drafter_checksum": local["drafter_checksum"],
        "ranks": [{k: v for k, v in r.items() if k != "segments"} for r in ranks],
    }, ranks


def log_step(rec, ranks, args):
    """Rank 0's line for the step, and every --timeline-every steps the ranks' timeline."""
    top1 = "n/a" if rec["drafter_top1"] is None else f"{100 * rec['drafter_top1']:.1f}%"  # n/a: no rank had time to score
    print0(f"step {rec['step']:04d}/{args.rl_steps} | reward {rec['reward']:.3f} | step {rec['step_time']:.2f}s | "
           f"rollout {rec['rollout_time']:.2f}s ({100 * rec['rollout_share']:.0f}%, tail {100 * rec['tail_share']:.0f}%) | "
           f"tok/s {rec['tok_s']:,.0f} | accept {rec['accept_len'] or 0:.2f} ({100 * (rec['accept_rate'] or 0):.0f}% of "
           f"drafts) | sd tok {100 * rec['sd_token_frac']:.0f}% | drafter top-1 {top1} | "
           f"idle {rec['idle_time']:.2f}s | drafter steps {rec['drafter_steps']}"
           + (f" ({rec['drafter_skipped']} non-finite, skipped)" if rec["drafter_skipped"] else "")
           + (" | SKIPPED non-finite update" if rec["skipped_update"] else ""))
    if args.timeline_every and (rec["step"] % args.timeline_every == 0 or rec["step"] == args.rl_steps - 1):
        print0(render_timeline(ranks))


def summary(history, acc0, acc1, total_time):
    def mean(key):
        vals = [h[key] for h in history if h[key] is not None]
        return sum(vals) / len(vals) if vals else float("nan")
    print0("\nsummary")
    print0(f"  RL steps              {len(history)}")
    print0(f"  mean step time        {mean('step_time'):.3f}s (rollout {mean('rollout_time'):.3f}s, "
           f"update {mean('update_time'):.3f}s, rollout share {100 * mean('rollout_share'):.0f}%)")
    print0(f"  slowest rank's wait   {1000 * mean('slowest_wait'):.1f} ms mean, from its rollout's end to its update's start "
           f"(max {1000 * max(h['slowest_wait'] for h in history):.1f} ms)")
    print0(f"  tail share            {100 * statistics.median(h['tail_share'] for h in history):.0f}% median (the slowest rank's rollout time after 90% "
           f"of its rows had finished)")
    top1 = [h["drafter_top1"] for h in history if h["drafter_top1"] is not None]
    if top1:
        n = max(1, len(top1) // 10)
        print0(f"  drafter top-1         {100 * sum(top1[:n]) / n:.1f}% -> {100 * sum(top1[-n:]) / n:.1f}% (teacher-forced "
               f"agreement with the target on each step's fresh rows, before training on them; first and last {n} steps)")
    print0(f"  mean accept length    {mean('accept_len'):.2f} tokens per verify step, {100 * mean('accept_rate'):.0f}% of "
           f"drafted tokens accepted, SD token share {100 * mean('sd_token_frac'):.0f}%")
    rates, drafted = by_position(history)
    if any(drafted):
        print0(f"  accepted by position  {format_positions(rates)} % (draft 1..{len(rates)}, given the earlier ones were; "
               f"{sum(drafted):,} drafts decided)")
    best = history[-1]["bandit_best"]
    if best:
        print0("  bandit's k per batch  " + ", ".join(f"{Bandit.bucket_sizes(b)}: {k}" for b, k in best.items())
               + " (rank 0, end of run)")
    n = max(1, len(history) // 10)  # a step's reward swings with its prompt mix; tenths of the run show the trend

    def tenths(key):
        return sum(h[key] for h in history[:n]) / n, sum(h[key] for h in history[-n:]) / n
    print0("  reward                {:.3f} -> {:.3f}".format(*tenths("reward")) + f" (means of the first and the last {n} steps)")
    line = "  response length       {:.1f} -> {:.1f} tokens".format(*tenths("response_len"))
    if any(h["careful_share"] for h in history):
        line += ", careful steps {:.0%} -> {:.0%}".format(*tenths("careful_share"))
    print0(line + f" (first and last {n} steps)")
    if not acc0:
        print0("  held-out accuracy     not evaluated (--eval-per-bucket 0)")
    else:
        for kind in ("greedy", "sampled"):
            for name, acc in (("before RL", acc0), ("after RL", acc1)):
                print0(f"  {kind:7s} {name:9s}     {format_accuracy(acc[kind])}")
    print0(f"  skipped updates       {sum(h['skipped_update'] for h in history)} of the target, "
           f"{sum(h['drafter_skipped'] for h in history)} drafter steps (non-finite loss or gradient)")
    print0(f"  wall time             {total_time:.0f}s")


if __name__ == "__main__":
    main()
