"""train.py's flags (and bench.py's, which rebuilds a run's models from them): every flag in its
group, their checks, and what they decide for the other files (the task, the forwards' precision).
A task's settings are its dataclass fields (tasks/__init__.py): each becomes a flag here, so a new
task needs no edit. Argparse with dashes and one help string per flag, grouped as --help shows them.

Test: python -m pytest tests/test_train.py -k flags
"""
import argparse
import dataclasses
import os
import sys

import torch

import tasks
from harness.common import OneLineParser, on_off
from harness.liveness import IO_DEADLINE_S
from model import GPTConfig
from harness.model_free import DRAFTERS
from speculative import SAMPLERS


WARM_DRAFTER_STEPS = 6000  # --drafter-warmup-steps where a drafter good from the start is needed: the cap,
# which the warm-up's plateau comes well before (the bench, the stale-drafter comparison)


def task_of(args, warmup=False):
    """The task as the flags define it (--task and its fields' flags); warmup=True: with the target
    warm-up's first problem-size exponent, --warmup-alpha."""
    cls = tasks.TASKS[args.task]
    settings = {f.name: getattr(args, f.name) for f in dataclasses.fields(cls)
                if getattr(args, f.name) is not None}  # a flag not given: the task's default
    return cls(**{**settings, **({"alpha": args.warmup_alpha} if warmup else {})})


def task_fields():
    """Every registered task's settings by name -> {the task that has it: its field}, a flag each."""
    out = {}
    for cls in tasks.TASKS.values():
        for f in dataclasses.fields(cls):
            out.setdefault(f.name, {})[cls] = f
    return out


def model_config(args, task):
    """The target's shape, from the flags and the task's vocabulary."""
    return GPTConfig(vocab_size=task.vocab_size, block_size=args.block_size, n_layer=args.n_layer,
                     n_head=args.n_head, n_embd=args.n_embd)


def autocast(args, device):
    """The forwards' precision. --dtype bfloat16: torch.autocast in bf16 on `device` (weights,
    gradients and optimizer state stay float32); float32: a context that does nothing. Its weight
    cache is off: the optimizer steps taken inside one context (warm-ups, idle training, the GRPO
    update) change the weights in place, and later forwards would read a stale bf16 copy."""
    return torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.dtype == "bfloat16", cache_enabled=False)


# -----------------------------------------------------------------------------
# flags: one function per group, in --help's order, then their checks

def parse_args(argv=None, description=None):
    """The command line -> args: every group's flags, checked, and the defaults taken from other flags."""
    p = OneLineParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    for add_flags in (run_flags, task_flags, model_flags, drafter_flags, rl_flags, tlt_flags, logging_flags):
        add_flags(p)
    args = p.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # as given: the run's last lines repeat them
    for name in ("warmup_steps", "rl_lr"):  # not given: what the task needs (tasks.Task)
        if getattr(args, name) is None:
            setattr(args, name, getattr(tasks.TASKS[args.task], name))
    check_args(p, args)
    args.warmup_dir = args.warmup_dir or args.out_dir
    args.rl_seed = args.seed if args.rl_seed is None else args.rl_seed
    args.drafter_seed = args.seed if args.drafter_seed is None else args.drafter_seed
    return args


def run_flags(p):
    """Where the run writes, its seeds, its device and its precision."""
    p.add_argument("--out-dir", default="out", help="where checkpoints and metrics.jsonl go")
    p.add_argument("--warmup-dir", default=None, help="where the warm-up checkpoints are cached (default: --out-dir)")
    p.add_argument("--seed", type=int, default=1337, help="base seed; per-rank, per-step seeds derive from it")
    p.add_argument("--rl-seed", type=int, default=None, help="seed of the RL phase only (default: --seed), for noise estimates")
    p.add_argument("--drafter-seed", type=int, default=None, help="seed of the drafter warm-up only (its initial weights, "
                   "samples and batches; default: --seed), for its spread")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="where to run")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="bfloat16: every forward (warm-ups, "
                   "rollouts, GRPO update, evaluation) under bf16 autocast, weights and optimizer state kept in float32")


def floats(v):
    try:
        return tuple(float(x) for x in v.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {v!r}")


def task_flags(p):
    """The task (--task), its settings (each task's dataclass fields, by name) and the target
    warm-up's curriculum over problem sizes."""
    p.add_argument("--task", default="shell_rounds", choices=list(tasks.TASKS), help="the workload (tasks/)")
    for name, owners in task_fields().items():
        helps = {}  # each task's own words and default; tasks that say the same share them
        for cls, f in owners.items():  # the flag's type below: the last task's field's
            helps.setdefault(f.metadata.get("help", ""), []).append(f"{cls.name}: {getattr(cls, name)}")
        p.add_argument(f"--{name.replace('_', '-')}", type=floats if f.type is tuple else f.type, default=None,
                       help="; ".join(f"{words} ({', '.join(defaults)})" for words, defaults in helps.items()))
    p.add_argument("--warmup-alpha", type=float, default=2.0, help="tail exponent of the problem sizes at the start "
                   "of the target warm-up: mostly small problems, where a task's basic skill is learned first")
    p.add_argument("--warmup-alpha-end", type=float, default=0.5, help="the exponent moves linearly from "
                   "--warmup-alpha to this over the warm-up, a curriculum toward long problems (equal: none)")


def model_flags(p):
    """The target: its shape and its supervised warm-up."""
    p.add_argument("--n-layer", type=int, default=12, help="target transformer layers")
    p.add_argument("--n-head", type=int, default=4, help="attention heads")
    p.add_argument("--n-embd", type=int, default=48, help="model width")
    p.add_argument("--block-size", type=int, default=None, help="longest sequence the model holds (default: what the "
                   "task needs, its longest prompt + response + draft, rounded up to a multiple of 64)")
    p.add_argument("--warmup-steps", type=int, default=None, help="the target warm-up's optimizer steps (default: the task's)")
    p.add_argument("--warmup-tokens", type=int, default=1024, help="padded tokens per warm-up batch, all ranks together")
    p.add_argument("--warmup-lr", type=float, default=6e-3, help="peak learning rate of the target warm-up")
    p.add_argument("--merge-init", type=on_off, default=True, metavar="on|off", help="start each of the task's "
                   "merged tokens' embeddings from its parts' (Task.merges: a task without merges is unaffected; off: "
                   "random, as every other token)")


def drafter_flags(p):
    """The drafter: its warm-up, its training on idle ranks, its buffer."""
    p.add_argument("--drafter-layers", type=int, default=1, help="transformer layers of the drafter (EAGLE: one)")
    p.add_argument("--drafter-warmup-seqs", type=int, default=2048, help="target samples the drafter warms up on")
    p.add_argument("--drafter-warmup-steps", type=int, default=0, help="0: a cold start, no drafter warm-up and no "
                   "sampling for one: the idle ranks build the drafter from nothing during RL. N: first warm the drafter "
                   "up on the target's samples for at most N optimizer steps; it ends at its plateau on held-out samples "
                   f"(warmup.py), usually well before {WARM_DRAFTER_STEPS}")
    p.add_argument("--drafter-lr", type=float, default=2e-3, help="peak drafter learning rate of the warm-up")
    p.add_argument("--drafter-cold-lr", type=float, default=4e-3, help="the idle ranks' drafter learning rate when its "
                   "recent acceptance is low (scheduler.ACCEPT_HARDEST and below): built from nothing, or left behind")
    p.add_argument("--drafter-online-lr", type=float, default=3e-4, help="the idle ranks' drafter learning rate when its "
                   "recent acceptance is high (scheduler.ACCEPT_GENTLE and above); geometric in between")
    p.add_argument("--drafter-batch", type=int, default=8, help="sequences per drafter training step")
    p.add_argument("--drafter-depth", type=int, default=3, help="chained passes per drafter training step at a high "
                   "recent acceptance: the drafter trains on its own predictions this many drafts deep, down to 1 (teacher "
                   "forcing alone) at a low one")
    p.add_argument("--drafter-idle-tokens", type=int, default=128, help="padded positions per drafter step on "
                   "idle ranks at most (fewer sequences when they are long): how long the last rank can wait for one, "
                   "and how short an idle time can still finish one")
    p.add_argument("--drafter-keep", type=int, default=32, help="RL steps of hidden states the drafter buffer keeps")
    p.add_argument("--drafter-keep-tokens", type=int, default=1_000_000, help="and at most this many tokens, the oldest "
                   "sequences dropped first (bounded memory; at least --block-size)")


def rl_flags(p):
    """GRPO and the rollouts it learns from."""
    p.add_argument("--rl-steps", type=int, default=800, help="GRPO steps: enough for RL to lengthen the responses and for a "
                   "frozen drafter to fall behind")
    p.add_argument("--prompts-per-step", type=int, default=8, help="prompts per RL step, all ranks together: "
                   "more distinct problem sizes per rank, so a step's longest response further from its median")
    p.add_argument("--group-size", type=int, default=4, help="responses per prompt (the GRPO group)")
    p.add_argument("--rl-lr", type=float, default=None, help="learning rate of the GRPO updates (default: the task's)")
    p.add_argument("--rl-epochs", type=int, default=1, help="optimizer passes over each rollout")
    p.add_argument("--clip-eps", type=float, default=0.2, help="PPO clip range")
    p.add_argument("--kl-coef", type=float, default=0.0, help="weight of the KL to the warmed-up target (0: off)")
    p.add_argument("--temperature", type=float, default=1.0, help="rollout sampling temperature")
    p.add_argument("--sampler", default="gumbel", choices=SAMPLERS, help="gumbel: every token fixed by (sequence key, "
                   "position), so plain and speculative rollouts give the same tokens; rejection: classic "
                   "speculative sampling, the same distribution but other samples")
    p.add_argument("--update-tokens", type=int, default=1024, help="padded tokens per GRPO micro-batch")


def tlt_flags(p):
    """TLT itself: speculative decoding in the tail, what drafts there, the online drafter."""
    p.add_argument("--tlt", type=on_off, default=True, metavar="on|off", help="speculative decoding in the tail (off: plain baseline)")
    p.add_argument("--drafter-updates", type=on_off, default=True, metavar="on|off", help="train the drafter on idle ranks (off: frozen)")
    p.add_argument("--drafter", default="learned", choices=DRAFTERS, help="what drafts in the tail: the "
                   "learned EAGLE-style drafter (TLT); TLT-Base's model-free n-gram lookup in the row's "
                   "own tokens; or the model-free lookup in the row's GRPO siblings")
    p.add_argument("--sd-threshold", type=int, default=64, help="speculative steps only when the running batch is at most this")
    p.add_argument("--draft-ks", default="0,1,2,3,4,6,8", help="draft lengths the bandit picks from (0: a plain "
                   "step); one value fixes k, e.g. to compare two drafters at the same k")


def logging_flags(p):
    """Evaluation, logging and checkpoints."""
    p.add_argument("--eval-per-bucket", type=int, default=40, help="held-out problems per size bucket (0: no evaluation)")
    p.add_argument("--eval-samples", type=int, default=8, help="samples per held-out problem for the sampled accuracy")
    p.add_argument("--timeline-every", type=int, default=10, help="print the per-rank timeline every N steps (0: never)")
    p.add_argument("--ckpt-every", type=int, default=10, help="write the RL checkpoint every N steps")
    p.add_argument("--io-deadline", type=float, default=IO_DEADLINE_S, help="seconds rank 0 may spend in one checkpoint "
                   "read or write (or a rank in its first CUDA step) before the others fail, naming it (default: "
                   "TLT_IO_DEADLINE or 1800)")


def check_args(p, args):
    """Each flag's range, then the flags that must fit together: a bad one is a flag error (p.error),
    as argparse's own are. --draft-ks becomes a tuple of ints here."""
    positive = ("drafter_layers", "warmup_steps", "warmup_tokens", "warmup_lr", "drafter_warmup_seqs", "drafter_batch", "drafter_depth", "drafter_idle_tokens",
                "drafter_keep", "drafter_keep_tokens", "drafter_lr", "drafter_cold_lr", "drafter_online_lr", "prompts_per_step", "group_size", "rl_epochs", "rl_lr",
                "clip_eps", "update_tokens", "ckpt_every", "eval_samples", "io_deadline",
                "temperature")  # temperature: GRPO scores its samples at it; greedy rollouts teach nothing
    non_negative = ("rl_steps", "drafter_warmup_steps", "kl_coef", "sd_threshold", "timeline_every", "eval_per_bucket",
                    "warmup_alpha", "warmup_alpha_end")
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
    for name, owners in task_fields().items():
        if tasks.TASKS[args.task] not in owners and getattr(args, name) is not None:
            p.error(f"--{name.replace('_', '-')} is not a setting of --task {args.task}")
    try:  # the task and model configs check their own fields; a bad one is a flag error here
        task = task_of(args)
        task_of(args, warmup=True), dataclasses.replace(task, alpha=args.warmup_alpha_end)
        need = task.max_seq_len + max(args.draft_ks)
        if args.block_size is None:  # the task's own block (the default's: 163 -> 192)
            args.block_size = -(-need // 64) * 64
        model_config(args, task)
    except ValueError as e:
        p.error(str(e))
    if args.block_size < need:
        p.error(f"--block-size {args.block_size} is too small for --task {args.task} at --max-n {task.max_n}: the "
                f"longest prompt + response + {max(args.draft_ks)} draft tokens needs {need}")
    if args.drafter_keep_tokens < args.block_size:  # so the newest sequence always fits
        p.error(f"--drafter-keep-tokens {args.drafter_keep_tokens} must be at least --block-size {args.block_size}")
    world_size = int(os.environ.get("WORLD_SIZE", 1))  # torchrun's; 1 for a single process
    if args.prompts_per_step * args.group_size < world_size:
        p.error(f"--prompts-per-step {args.prompts_per_step} x --group-size {args.group_size} = "
                f"{args.prompts_per_step * args.group_size} rows per step leave some of the {world_size} ranks without "
                f"work; raise --prompts-per-step")
