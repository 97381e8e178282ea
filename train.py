"""Warm up a small GPT on the running-sum task, then improve it with GRPO, with TLT rollouts.

    python train.py                                   # one process, CPU or one GPU
    torchrun --standalone --nproc_per_node=2 train.py # several ranks (gloo on CPU, nccl on CUDA)

Steps: (1) supervised warm-up of the target on reference traces, cached in --out-dir;
(2) warm-up of the drafter on the target's own samples, cached likewise; (3) --rl-steps of GRPO
whose rollouts use speculative decoding in the long tail (--tlt on) and whose idle ranks train
the drafter (--drafter-updates on). See README.md for what each flag buys.
"""
import argparse
import json
import math
import os
import random
import sys
import time
import warnings
from contextlib import nullcontext
from dataclasses import asdict

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

import task
from model import GPT, GPTConfig
from speculative import autoregressive_generate


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # run
    p.add_argument("--out-dir", default="out", help="where checkpoints and metrics.jsonl go")
    p.add_argument("--seed", type=int, default=1337, help="base seed; per-rank, per-step seeds derive from it")
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    # task
    p.add_argument("--max-n", type=int, default=26, help="largest problem size (digits to sum)")
    p.add_argument("--alpha", type=float, default=1.5, help="tail exponent of the problem-size distribution")
    # model
    p.add_argument("--n-layer", type=int, default=4, help="target transformer layers")
    p.add_argument("--n-head", type=int, default=4, help="attention heads")
    p.add_argument("--n-embd", type=int, default=128, help="model width")
    p.add_argument("--block-size", type=int, default=200, help="longest sequence the model holds")
    # target warm-up
    p.add_argument("--warmup-steps", type=int, default=500, help="supervised optimizer steps for the target")
    p.add_argument("--warmup-tokens", type=int, default=4096, help="padded tokens per warm-up batch, all ranks together")
    p.add_argument("--warmup-lr", type=float, default=3e-3, help="peak learning rate of the warm-up")
    p.add_argument("--eval-per-bucket", type=int, default=40, help="held-out problems per size bucket")
    args = p.parse_args(argv)
    for name in ("max_n", "n_layer", "n_head", "n_embd", "block_size", "warmup_steps", "warmup_tokens", "eval_per_bucket"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if args.warmup_lr <= 0:
        p.error("--warmup-lr must be positive")
    return args


# -----------------------------------------------------------------------------
# distributed helpers

def compute_init(device_arg="auto"):
    """-> (ddp, rank, local_rank, world_size, device). Under torchrun (RANK set) this joins the
    process group: nccl on CUDA, gloo on CPU. Without torchrun it is rank 0 of 1, same code path."""
    ddp = "RANK" in os.environ
    rank = int(os.environ.get("RANK", 0))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    use_cuda = torch.cuda.is_available() if device_arg == "auto" else device_arg == "cuda"
    if use_cuda and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda but CUDA is not available")
    device = torch.device(f"cuda:{local_rank}" if use_cuda else "cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    else:  # ranks sharing a CPU: one thread each, or they fight over cores
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
        cores = os.cpu_count() or 1
        torch.set_num_threads(max(1, cores // local_world))
        if local_world > cores and rank == 0:
            warnings.warn(f"{local_world} ranks share {cores} CPU cores: expect slow, oversubscribed steps")
    if ddp:
        dist.init_process_group("nccl" if use_cuda else "gloo", timeout=COLLECTIVE_TIMEOUT)
    return ddp, rank, local_rank, world_size, device


def print0(*a, **kw):
    if int(os.environ.get("RANK", 0)) == 0:
        print(*a, **kw, flush=True)


# a rank that dies makes its peers fail in a collective after at most this long
import datetime  # noqa: E402
COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=int(os.environ.get("TLT_COLLECTIVE_TIMEOUT", 120)))


# -----------------------------------------------------------------------------
# checkpoints: atomic writes, safe loads, config checked

def save_atomic(obj, path):
    tmp = f"{path}.tmp.{os.getpid()}"
    torch.save(obj, tmp)
    os.replace(tmp, path)  # a kill before this line leaves the old file intact


def load_checked(path, expected_meta):
    """Load a checkpoint saved with meta=expected_meta; exit with one clear line otherwise."""
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # truncated or not a checkpoint at all
        raise SystemExit(f"error: cannot read checkpoint {path} ({type(e).__name__}); delete it or use another --out-dir")
    if not isinstance(ckpt, dict) or ckpt.get("meta") != expected_meta:
        got = ckpt.get("meta") if isinstance(ckpt, dict) else None
        diff = sorted(k for k in set(expected_meta) | set(got or {}) if (got or {}).get(k) != expected_meta.get(k))
        raise SystemExit(f"error: checkpoint {path} was made with a different config (differs in: {', '.join(diff)}); "
                         "delete it or use another --out-dir")
    return ckpt


# -----------------------------------------------------------------------------
# target warm-up: supervised training on reference traces

def length_grouped_batches(rng, task_cfg, n_batches, token_budget):
    """Sample problems, sort by length, cut into batches of about `token_budget` padded tokens.
    Grouping similar lengths keeps padding small on a long-tailed length distribution."""
    pool = [task.training_example(task.sample_problem(rng, task_cfg)) for _ in range(n_batches * 64)]
    pool.sort(key=lambda e: len(e[0]))
    batches, cur = [], []
    for ex in pool:
        if cur and (len(cur) + 1) * len(ex[0]) > token_budget:
            batches.append(cur)
            cur = []
        cur.append(ex)
    batches.append(cur)
    rng.shuffle(batches)
    return batches[:n_batches]


def collate(examples, device):
    """-> input ids (B, T), target ids (B, T) with -100 outside the response, for next-token loss."""
    T = max(len(ids) for ids, _ in examples) - 1
    x = torch.full((len(examples), T), task.PAD_ID, dtype=torch.long)
    y = torch.full((len(examples), T), -100, dtype=torch.long)
    for b, (ids, plen) in enumerate(examples):
        t = torch.tensor(ids)
        x[b, :len(ids) - 1] = t[:-1]
        y[b, plen - 1:len(ids) - 1] = t[plen:]  # loss only on response tokens (the prompt is random)
    return x.to(device), y.to(device)


def lr_at(step, total, peak):
    warm = max(1, total // 20)
    if step < warm:
        return peak * (step + 1) / warm
    frac = (step - warm) / max(1, total - warm)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))  # cosine down to 10% of peak


def warmup_target(model, args, task_cfg, ddp, rank, world_size, device):
    model.train()
    net = DDP(model) if ddp else model
    opt = torch.optim.AdamW(model.parameters(), lr=args.warmup_lr, betas=(0.9, 0.95), weight_decay=0.1)
    rng = random.Random(args.seed * 1000 + rank)
    budget = max(1, args.warmup_tokens // world_size)
    t0, tokens_seen, batches = time.time(), 0, []
    for step in range(args.warmup_steps):
        if not batches:
            batches = length_grouped_batches(rng, task_cfg, 16, budget)
        x, y = collate(batches.pop(), device)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args.warmup_steps, args.warmup_lr)
        logits, _ = net(x)
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        tokens_seen += x.numel() * world_size
        if step % 20 == 0 or step == args.warmup_steps - 1:
            el = time.time() - t0
            eta = el / (step + 1) * (args.warmup_steps - step - 1)
            print0(f"warmup {step:05d}/{args.warmup_steps} ({100 * (step + 1) / args.warmup_steps:.1f}%) | "
                   f"loss {loss.item():.4f} | tok/s {tokens_seen / el:,.0f} | elapsed {el:.0f}s | eta {eta:.0f}s")
    model.eval()


# -----------------------------------------------------------------------------
# evaluation

@torch.no_grad()
def evaluate(model, problems, temperature=0.0, generator=None, batch_size=64):
    """Held-out accuracy: generate for every problem, score with the task's reward."""
    rewards = []
    for i in range(0, len(problems), batch_size):
        chunk = problems[i:i + batch_size]
        prompts = [task.encode(p.prompt()) for p in chunk]
        max_new = task.TaskConfig(max_n=max(p.size for p in chunk)).max_response_len
        outs, _ = autoregressive_generate(model, prompts, max_new, temperature=temperature,
                                          eos_id=task.EOS_ID, generator=generator)
        rewards += [task.reward(p.prompt(), task.decode(o)) for p, o in zip(chunk, outs)]
    return task.accuracy_by_size(problems, rewards)


def format_accuracy(acc):
    return " | ".join(f"{k} {100 * v:5.1f}%" for k, v in acc.items())


def main(argv=None):
    args = parse_args(argv)
    task_cfg = task.TaskConfig(max_n=args.max_n, alpha=args.alpha) if args.max_n <= len(task.LABELS) else None
    if task_cfg is None:
        raise SystemExit(f"error: --max-n must be at most {len(task.LABELS)}")
    need = task_cfg.max_seq_len + 8
    if args.block_size < need:
        raise SystemExit(f"error: --block-size {args.block_size} is too small for --max-n {args.max_n}: "
                         f"the longest prompt + response + 8 draft tokens needs {need}")
    ddp, rank, local_rank, world_size, device = compute_init(args.device)
    torch.manual_seed(args.seed + rank)
    os.makedirs(args.out_dir, exist_ok=True)
    config = GPTConfig(vocab_size=task.VOCAB_SIZE, block_size=args.block_size, n_layer=args.n_layer,
                       n_head=args.n_head, n_embd=args.n_embd)
    model = GPT(config).to(device)
    print0(f"target: {model.num_params():,} parameters, {config}")
    meta = {"model": config.to_dict(), "task": asdict(task_cfg), "warmup_steps": args.warmup_steps,
            "warmup_tokens": args.warmup_tokens, "warmup_lr": args.warmup_lr, "seed": args.seed}
    path = os.path.join(args.out_dir, "target_warmup.pt")
    if os.path.exists(path):
        model.load_state_dict(load_checked(path, meta)["model"])
        print0(f"reusing warmed-up target from {path}")
    else:
        warmup_target(model, args, task_cfg, ddp, rank, world_size, device)
        if rank == 0:
            save_atomic({"meta": meta, "model": model.state_dict()}, path)
    model.eval()
    problems = task.eval_set(task_cfg, args.eval_per_bucket)
    t0 = time.time()
    acc = evaluate(model, problems)
    print0(f"held-out greedy accuracy ({len(problems)} problems, {time.time() - t0:.1f}s): {format_accuracy(acc)}")
    if ddp:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
