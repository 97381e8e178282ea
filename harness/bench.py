"""python -m harness.bench: what speculative decoding and TLT buy, side by side on one machine.

    python -m harness.bench          # plain vs speculative decoding by batch size
    python -m harness.bench --e2e    # RL steps: --tlt off, on, frozen drafter, model-free drafters
    python -m harness.bench --drift  # a target moved away from the drafter: frozen vs trained

Each loads the warm-ups from --out-dir (made first if absent), prints a table and ends with one
JSON line. Decoding: fresh prompts longer than --max-new tokens, so the batch size is the table's;
each cell the median of --repeats rounds in which every k takes turns. c: the drafter's time per
one-token forward over the target's. --e2e and --drift: bench_e2e.py.
"""
import argparse
import json
import random
import shlex
import statistics
import time

import torch

from harness import config
from harness import warmup
from harness.bench_e2e import drift_bench, e2e_bench, generator
from harness.common import OneLineParser, check_out_dir, machine, sync, wants_cuda
from speculative import autoregressive_generate, speculative_generate


def parse_args(argv=None):
    p = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", default="out", help="where the warm-ups are (or will be made)")
    p.add_argument("--batches", default="1,2,4,8,16,32,64", help="comma-separated batch sizes")
    p.add_argument("--ks", default="1,2,3,4,6,8", help="comma-separated draft lengths")
    p.add_argument("--max-new", type=int, default=44, help="tokens decoded per row")
    p.add_argument("--repeats", type=int, default=5, help="runs per cell; the median is reported")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--e2e", action="store_true", help="the end-to-end RL comparison instead")
    mode.add_argument("--drift", action="store_true", help="the moved-target comparison instead")
    p.add_argument("--e2e-steps", type=int, default=30, help="RL steps per end-to-end run")
    p.add_argument("--train-args", default="", help="train.py flags for the warm-ups and every "
                   "--e2e run, e.g. --train-args='--rl-lr 2e-4'")
    p.add_argument("--nproc", type=int, default=2, help="ranks per end-to-end run")
    args = p.parse_args(argv)
    try:
        args.batches = [int(x) for x in args.batches.split(",")]
        args.ks = [int(x) for x in args.ks.split(",")]
    except ValueError:
        p.error("--batches and --ks take comma-separated integers")
    try:
        args.train_flags = shlex.split(args.train_args)
    except ValueError as e:  # an unclosed quote
        p.error(f"--train-args: {e}")
    if min(args.batches) <= 0 or min(args.ks) <= 0 or args.max_new <= 0 or args.repeats <= 0:
        p.error("batch sizes, k, --max-new and --repeats must be positive")
    # the bench measures a drafter warmed up first (train.py's default builds its drafter during
    # RL); a --drafter-warmup-steps in --train-args comes later and wins
    args.train_flags = ["--drafter-warmup-steps", str(config.WARM_DRAFTER_STEPS), *args.train_flags]
    args.targs = config.parse_args([*args.train_flags, "--out-dir", args.out_dir])
    args.sampler = args.targs.sampler
    task = config.task_of(args.targs)
    if not (args.e2e or args.drift) and min_size(args.max_new, task) > task.max_n:
        p.error(f"--max-new {args.max_new} is longer than the task's longest response")
    return args


def min_size(max_new, task):
    """Smallest problem whose longest response (task.response_len) is longer than max_new tokens."""
    sizes = range(1, task.max_n + 1)
    return next((n for n in sizes if task.response_len(n) > max_new), task.max_n + 1)


def load_models(targs):
    check_out_dir(targs.out_dir)
    task, warmup_task = config.task_of(targs), config.task_of(targs, warmup=True)
    device = torch.device("cuda" if wants_cuda(targs.device) else "cpu")
    with config.autocast(targs, device):  # a warm-up made here is made as train.py would make it
        model, drafter = warmup.prepare_models(targs, task, warmup_task, False, 0, 1, device)
    return task, model.eval(), drafter.eval()


def interleaved(runs, repeats, device=torch.device("cpu")):
    """Median wall time of each run over `repeats` rounds, the runs taking turns within a round,
    so that a slow spell of a shared machine hits all of them alike. Returns ({name: seconds},
    {name: last output}). Timers wait for queued work on `device`."""
    times, outs = {name: [] for name in runs}, {}
    for _ in range(repeats):
        for name, fn in runs.items():
            sync(device)
            t0 = time.perf_counter()
            outs[name] = fn()
            sync(device)
            times[name].append(time.perf_counter() - t0)
    return {name: statistics.median(t) for name, t in times.items()}, outs


@torch.no_grad()
def forward_time(model, drafter=None, repeats=200):
    """Best-of-5 time of a one-token forward with a cache at batch 1, of the target or the drafter."""
    device = model.wte.weight.device
    x = torch.zeros(1, 1, dtype=torch.long, device=device)
    h = torch.zeros(1, 1, model.config.n_embd, device=device)
    cache, times = (drafter or model).new_cache(1), []
    for _ in range(5):
        sync(device)
        t0 = time.perf_counter()
        for _ in range(repeats):
            cache.lengths.fill_(20)
            drafter(h, x, cache) if drafter else model(x, cache)
        sync(device)
        times.append(time.perf_counter() - t0)
    return min(times) / repeats


def long_rows(args, task, model, n):
    """n rows as a rollout's tail holds them: prompts whose response (exact-token sampling, with the
    row's key) is longer than --max-new tokens, so that no row of the table decodes past its
    <|eos|>. -> (prompts, keys)."""
    rng, prompts, keys = random.Random(4321), [], []
    min_n = min_size(args.max_new, task)
    for start in range(0, 64 * n, 64):  # about 1 in 6 rows is long enough; give up after 64 n
        batch = [task.prompt_ids(task.sample(rng, rng.randint(min_n, task.max_n)))
                 for _ in range(64)]
        done, _ = autoregressive_generate(model, batch, args.max_new + 1, eos_id=task.eos_id,
                                          sampler="gumbel", keys=list(range(start, start + 64)))
        long = [i for i, d in enumerate(done) if task.eos_id not in d][:n - len(prompts)]
        prompts += [batch[i] for i in long]
        keys += [start + i for i in long]
        if len(prompts) == n:
            return prompts, keys
    raise SystemExit(f"error: fewer than {n} of {64 * n} prompts have responses longer than "
                     f"--max-new {args.max_new}")


def decode_row(args, model, drafter, prompts, keys):
    """Plain decoding and speculative decoding at every k of args.ks on `prompts`, taking turns;
    -> the table's row for this batch size."""
    gen, how = generator(model, 0), dict(sampler=args.sampler, keys=keys)
    runs = {0: lambda: autoregressive_generate(model, prompts, args.max_new, generator=gen, **how)}
    for k in args.ks:
        runs[k] = lambda k=k: speculative_generate(model, drafter, prompts, args.max_new, k=k,
                                                   generator=gen, **how)
    times, outs = interleaved(runs, args.repeats, model.wte.weight.device)
    tok_s = {k: sum(len(o) for o in outs[k][0]) / times[k] for k in runs}
    per_k = {str(k): {"tok_s": tok_s[k], "accept_len": outs[k][1]["accept_len"],
                      "speedup": tok_s[k] / tok_s[0]} for k in args.ks}
    best = max(args.ks, key=lambda k: tok_s[k])
    return {"batch": len(prompts), "ar_tok_s": tok_s[0], "sd_tok_s": tok_s[best], "best_k": best,
            "speedup": tok_s[best] / tok_s[0], "accept_len": outs[best][1]["accept_len"],
            "per_k": per_k}


def decode_bench(args, task, model, drafter):
    """The decoding table, one row per batch size, printed as it goes; the cost ratio c."""
    prompts, keys = long_rows(args, task, model, max(args.batches))
    c = forward_time(model, drafter) / forward_time(model)
    print(f"sampler {args.sampler}, temperature 1.0, {args.max_new} tokens per row; "
          "cells: speculative tok/s (accept length = tokens per verify step)")
    print(f"{'batch':>5} {'plain tok/s':>11} " + " ".join(f"{'k=' + str(k):>13}" for k in args.ks)
          + f" {'best':>6} {'speedup':>7}")
    rows = []
    for B in args.batches:
        r = decode_row(args, model, drafter, prompts[:B], keys[:B])
        cells = " ".join(f"{v['tok_s']:7.0f} ({v['accept_len']:.2f})" for v in r["per_k"].values())
        print(f"{B:5d} {r['ar_tok_s']:11.0f} {cells} {r['best_k']:6d} {r['speedup']:6.2f}x", flush=True)
        rows.append(r)
    crossover = next((r["batch"] for r in rows if r["speedup"] <= 1), None)
    print(f"crossover: speculation stops paying at batch {crossover}" if crossover else
          f"crossover: none, speculation pays at every batch size measured (1 to {B})")
    print(f"draft/target cost ratio c = {c:.3f}")
    return {"decode": rows, "cost_ratio": c, "crossover": crossover, "max_new": args.max_new,
            "sampler": args.sampler, "temperature": 1.0}


def main(argv=None):
    args = parse_args(argv)
    task, model, drafter = load_models(args.targs)
    device = model.wte.weight.device
    print(f"bench on {machine(device)}, {args.targs.dtype}")
    with config.autocast(args.targs, device):  # --dtype bfloat16: every forward under autocast
        if args.e2e:
            result = e2e_bench(args)
        elif args.drift:
            result = drift_bench(args.targs, task, model, drafter)
        else:
            result = decode_bench(args, task, model, drafter)
    print(json.dumps({**result, "dtype": args.targs.dtype, "machine": machine(device)}))


if __name__ == "__main__":
    main()
