"""Side-by-side measurements: what speculative decoding and TLT buy, in one run on one machine.

    python bench.py            # decoding: plain vs speculative for batch sizes 1..64 and k in 1..8
    python bench.py --e2e      # RL steps: --tlt off, on, on with a frozen drafter, on with each model-free drafter
    python bench.py --drift    # a target moved away from the drafter: frozen vs online-trained drafter
    python bench.py --drafters out   # after a train.py run: its online-trained drafter vs the warm-up one

All load the warmed-up target and drafter from --out-dir (warming them up first if absent, with
train.py's defaults plus --train-args), on the GPU when there is one, print a table, and end with
one JSON line holding every figure. Checkpoints made with other flags need the same flags here, e.g.
    python bench.py --out-dir out_4x128 --train-args "--n-layer 4 --n-embd 128 --warmup-lr 3e-3 --warmup-steps 900"
--train-args "--dtype bfloat16" runs every forward under bf16 autocast, as train.py does; its
warm-ups are bf16 ones, so it needs a --out-dir of its own.

Decoding bench. Fresh prompts (not the training ones) whose reference responses are longer than
--max-new tokens, so every row decodes exactly --max-new tokens (no row leaves early and the batch
size is what the table says). Temperature 1.0, as in the RL rollouts. Each cell is the median of --repeats rounds
in which plain decoding and every k take turns, so a slow spell of a shared machine hits them alike.
The cost ratio c is the drafter's time per one-token forward over the target's, at batch 1. The
standard formula predicts a speedup of accept_len / (1 + k c), assuming a verify pass of k+1
tokens costs what a one-token pass costs; that holds on a GPU at small batch but not on a CPU,
so the bench also measures that cost and reports accept_len / (verify + k c).

End-to-end bench. train.py runs from the same warm-ups and seed, each its own torchrun group
(E2E_VARIANTS): --tlt off, on, on with a frozen drafter, on with the n-gram drafter (TLT-Base), with
sibling drafts, and with the learned drafter until every running row is the last of its group.
Means and medians skip step 0 (first allocations). With exact-token sampling the runs generate
the same tokens at every step, so step i of two runs is a pair, and the median of the per-step
ratios compares the modes on the same work. Two more runs fix k = 4 to compare the adaptive and
the frozen drafter step by step, and the bench ends on one target (drafter_vs_target).
"""
import argparse
import copy
import dataclasses
import json
import os
import random
import shlex
import statistics
import subprocess
import sys
import time

import torch

import task
import train
import warmup
from drafter import Drafter, DrafterBuffer, SiblingDrafter, make_optimizer, train_step
from common import OneLineParser, check_out_dir, machine, sync, wants_cuda
from rollout import Bandit, rollout
from speculative import SAMPLERS, autoregressive_generate, speculative_generate


def parse_args(argv=None):
    p = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", default="out", help="where the warmed-up checkpoints are (or will be made)")
    p.add_argument("--batches", default="1,2,4,8,16,32,64", help="comma-separated batch sizes")
    p.add_argument("--ks", default="1,2,3,4,6,8", help="comma-separated draft lengths")
    p.add_argument("--max-new", type=int, default=44, help="tokens decoded per row in the decoding bench")
    p.add_argument("--repeats", type=int, default=5, help="runs per cell; the median is reported")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: all cores)")
    p.add_argument("--sampler", choices=SAMPLERS, default=None, help="gumbel (exact tokens) or rejection sampling, for "
                   "every part of the bench (default: train.py's default)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--e2e", action="store_true", help="run the end-to-end RL comparison instead")
    mode.add_argument("--drift", action="store_true", help="run the moved-target drafter comparison instead")
    mode.add_argument("--drafters", metavar="RUN_DIR", help="compare the drafter a train.py run left in RUN_DIR/ckpt.pt "
                   "with the warm-up drafter, on that run's final target")
    p.add_argument("--e2e-steps", type=int, default=30, help="RL steps per end-to-end run")
    p.add_argument("--train-args", default="", help="train.py flags for the checkpoints' config, the long-tail workload "
                   "and every --e2e run, e.g. --train-args='--rl-lr 3e-4'")
    p.add_argument("--nproc", type=int, default=2, help="ranks per end-to-end run")
    args = p.parse_args(argv)
    try:
        args.batches = [int(x) for x in args.batches.split(",")]
        args.ks = [int(x) for x in args.ks.split(",")]
    except ValueError:
        p.error("--batches and --ks take comma-separated integers")
    if min(args.batches) <= 0 or min(args.ks) <= 0 or args.max_new <= 0 or args.repeats <= 0:
        p.error("batch sizes, k, --max-new and --repeats must be positive")
    if args.drafters and not os.path.exists(os.path.join(args.drafters, "ckpt.pt")):
        p.error(f"--drafters: no ckpt.pt in {args.drafters!r} (a train.py --out-dir)")
    try:
        args.train_flags = shlex.split(args.train_args)
    except ValueError as e:  # e.g. an unclosed quote
        p.error(f"--train-args: {e}")
    if args.sampler:  # the e2e runs and every train.py setting the bench reads take it too
        args.train_flags += ["--sampler", args.sampler]
    args.targs = train.parse_args([*args.train_flags, "--out-dir", args.out_dir])  # the checkpoints' settings, parsed once
    args.sampler = args.targs.sampler
    if min_size(args.max_new, train.task_config(args.targs)) > args.targs.max_n:
        p.error(f"--max-new {args.max_new} is longer than the task's longest response")
    return args


def min_size(max_new, task_cfg):
    """Smallest problem whose reference response, a single pass, is longer than max_new tokens."""
    return next((n for n in range(1, task_cfg.max_n + 1) if task_cfg.response_len(n) > max_new), task_cfg.max_n + 1)


def load_models(targs):
    check_out_dir(targs.out_dir)
    task_cfg = train.task_config(targs)
    device = torch.device("cuda" if wants_cuda(targs.device) else "cpu")
    with train.autocast(targs, device):  # a warm-up made here is made as train.py would make it
        _, model, drafter = warmup.prepare_models(targs, task_cfg, train.task_config(targs, warmup=True), False, 0, 1, device)
    return targs, task_cfg, model.eval(), drafter.eval()


def generator(model, seed):
    return torch.Generator(device=model.wte.weight.device).manual_seed(seed)


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
def forward_time(model, T, drafter=None, repeats=200):
    """Best-of-5 time of one forward with a cache at batch 1: T tokens for the target, or one
    (hidden, token) pair for the drafter."""
    device = model.wte.weight.device
    x = torch.zeros(1, T, dtype=torch.long, device=device)
    h = torch.zeros(1, T, model.config.n_embd, device=device)
    fn, cache = (lambda c: drafter(h, x, c), drafter.new_cache(1)) if drafter else (lambda c: model(x, c), model.new_cache(1))
    best = float("inf")
    for _ in range(5):
        sync(device)
        t0 = time.perf_counter()
        for _ in range(repeats):
            cache.lengths.fill_(20)
            fn(cache)
        sync(device)
        best = min(best, time.perf_counter() - t0)
    return best / repeats


@torch.no_grad()
def count_syncs(model, drafter, batch_size=1, k=4, steps=8, sampler="gumbel"):
    """Host-device round trips per speculative step and per compaction, counted on a GPU by
    torch.cuda.set_sync_debug_mode("warn"), which warns once per synchronizing call. The rows run
    to the length limit (no <|eos|>), after one unmeasured step that fills the drafter's cache.
    Prints the counts and returns {"step": syncs per speculative step, "compact": per compact()};
    on a CPU prints "n/a on CPU" and returns None. speculative.py says which remain and why."""
    import warnings
    from speculative import RunningBatch
    if model.wte.weight.device.type != "cuda":
        print("host-device syncs per speculative step: n/a on CPU")
        return None
    prompts = [[1 + b % 7, 2, 3, 4, 5] for b in range(batch_size)]
    max_new = min((steps + 1) * (k + 1), model.config.block_size - 5 - k)
    batch = RunningBatch(model, prompts, max_new, max_draft=k, sampler=sampler, generator=generator(model, 0))
    batch.compact()
    batch.speculative_step(drafter, k)
    batch.compact()
    torch.cuda.synchronize()
    counts, n = {"step": 0, "compact": 0}, 0
    before = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            while n < steps and batch.batch_size:
                for name, fn in (("step", lambda: batch.speculative_step(drafter, k)), ("compact", batch.compact)):
                    seen = len(caught)
                    fn()
                    counts[name] += len(caught) - seen
                n += 1
        finally:
            torch.cuda.set_sync_debug_mode(before)
    out = {name: c / max(n, 1) for name, c in counts.items()}
    print(f"host-device syncs at batch {batch_size}, k = {k} ({sampler}), over {n} steps: "
          f"{out['step']:.1f} per speculative step, {out['compact']:.1f} per compaction")
    return out


def decode_row(args, model, drafter, prompts, sampler, siblings=None):
    """Plain decoding and speculative decoding at every k of args.ks on `prompts` (with their groups'
    finished `siblings`, for a drafter that reads them), interleaved; -> the table row for this batch size."""
    gen = generator(model, 0)
    runs = {0: lambda: autoregressive_generate(model, prompts, args.max_new, generator=gen, sampler=sampler)}
    for k in args.ks:
        runs[k] = lambda k=k: speculative_generate(model, drafter, prompts, args.max_new, k=k, generator=gen,
                                                   sampler=sampler, siblings=siblings)
    times, outs = interleaved(runs, args.repeats, model.wte.weight.device)
    ar = sum(len(o) for o in outs[0][0]) / times[0]
    per_k = {k: (sum(len(o) for o in outs[k][0]) / times[k], outs[k][1]["accept_len"]) for k in args.ks}
    best = max(per_k, key=lambda k: per_k[k][0])
    sd, acc = per_k[best]
    return {"batch": len(prompts), "ar_tok_s": ar, "sd_tok_s": sd, "best_k": best, "speedup": sd / ar, "accept_len": acc,
            "per_k": {str(k): {"tok_s": v[0], "accept_len": v[1], "speedup": v[0] / ar} for k, v in per_k.items()}}


def decode_bench(args, task_cfg, model, drafter):
    rng = random.Random(4321)
    min_n = min_size(args.max_new, task_cfg)
    pool = [task.encode(task.sample_problem(rng, task_cfg, rng.randint(min_n, task_cfg.max_n)).prompt())
            for _ in range(max(max(args.batches), 64))]
    t1 = forward_time(model, 1)
    c = forward_time(model, 1, drafter) / t1
    print(f"sampler {args.sampler}, temperature 1.0, {args.max_new} tokens per row")
    rows = decode_table(args, model, drafter, pool)
    print("cells: speculative tok/s (accept length = tokens per verify step)")
    # the crossover: the first batch size at which speculation is no faster than plain decoding
    crossover = next((r["batch"] for r in rows if r["speedup"] <= 1), None)
    if crossover is None:
        print(f"crossover: speculation pays at every batch size measured (1 to {rows[-1]['batch']})")
    else:
        print(f"crossover: speculation stops paying at batch {crossover}")
    price = sampler_price(args, model, drafter, pool, rows)
    acceptance = acceptance_table(args, task_cfg, model, drafter)
    b1 = rows[0]
    k1 = b1["best_k"]
    verify = forward_time(model, k1 + 1) / t1  # a (k+1)-token pass is not free on a CPU
    # tokens per verify step the acceptance by position predicts for rows of max_new - 1 tokens after the prefill's
    expected = (args.max_new - 1) / expected_steps(acceptance[k1]["by_position"], args.max_new - 1)
    ideal = expected / (1 + k1 * c)
    predicted = expected / (verify + k1 * c)
    print(f"draft/target cost ratio c = {c:.3f}; a {k1 + 1}-token verify pass costs {verify:.2f} one-token passes")
    print(f"batch {b1['batch']}, k = {k1}: the acceptance by position above predicts {expected:.2f} tokens per verify step "
          f"on these {args.max_new}-token rows (measured {b1['accept_len']:.2f}); "
          f"standard formula accept_len / (1 + k c) = {ideal:.2f}x; with the measured verify cost accept_len / (verify + k c) "
          f"= {predicted:.2f}x; measured {b1['speedup']:.2f}x (the rest is sampling and bookkeeping per step): "
          f"{100 * b1['speedup'] / predicted:.0f}% of the prediction")
    syncs = count_syncs(model, drafter, k=k1, sampler=args.sampler)
    tail = tail_workload(args, task_cfg, model, drafter)
    sibling_rows = sibling_table(args, task_cfg, model, pool, rows)
    return {"decode": rows, "acceptance": {str(k): v for k, v in acceptance.items()}, "sibling_decode": sibling_rows,
            "cost_ratio": c, "verify_cost_ratio": verify, "formula_speedup_b1": ideal, "predicted_speedup_b1": predicted, "temperature": 1.0, "sampler": args.sampler, "crossover": crossover,
            "samplers": price, "max_new": args.max_new, "rollout": tail, "syncs_per_step": syncs}


def decode_table(args, model, drafter, pool, siblings=None):
    """decode_row for every batch size of args.batches, printed as it goes."""
    rows = []
    print(f"{'batch':>5} {'plain tok/s':>11} " + " ".join(f"{'k=' + str(k):>13}" for k in args.ks) + f" {'best':>6} {'speedup':>7}")
    for B in args.batches:
        rows.append(decode_row(args, model, drafter, pool[:B], args.sampler, siblings and siblings[:B]))
        r = rows[-1]
        cells = " ".join(f"{v['tok_s']:7.0f} ({v['accept_len']:.2f})" for v in r["per_k"].values())
        print(f"{B:5d} {r['ar_tok_s']:11.0f} {cells} {r['best_k']:6d} {r['speedup']:6.2f}x", flush=True)
    return rows


def sibling_table(args, task_cfg, model, pool, learned_rows, group=8):
    """The decoding table again with sibling drafts, as in the tail of a GRPO rollout: each row is the
    last of its group, whose other group - 1 responses (sampled by the target, other keys) have
    finished. Beside it, the learned drafter's best speedup per batch size from the first table."""
    n = max(args.batches)
    keys = [10 ** 9 + i for i in range((group - 1) * n)]
    done, _ = autoregressive_generate(model, [p for p in pool[:n] for _ in range(group - 1)], task_cfg.max_response_len,
                                      eos_id=task.EOS_ID, sampler=args.sampler, keys=keys)
    siblings = [done[i * (group - 1):(i + 1) * (group - 1)] for i in range(n)]
    print(f"\nsibling drafts (SiblingDrafter), each row the last of a group of {group} whose {group - 1} other responses "
          f"have finished, {args.max_new} tokens per row:")
    rows = decode_table(args, model, SiblingDrafter(), pool, siblings)
    print("best speedup per batch size, learned drafter / sibling drafts: " + ", ".join(
        f"{a['batch']}: {a['speedup']:.2f}x / {b['speedup']:.2f}x" for a, b in zip(learned_rows, rows)))
    return rows


@torch.no_grad()
def sampler_price(args, model, drafter, pool, rows, k=4, n_prompts=64):
    """What exact tokens cost: the accept length at k = 4 and temperature 1 of both samplers on the
    same 64 prompts, and each sampler's best-k speedup at batch 1 (from the table for this
    sampler, measured the same way for the other)."""
    out = {}
    for sampler in SAMPLERS:
        _, st = speculative_generate(model, drafter, pool[:n_prompts], args.max_new, k=k, generator=generator(model, 1),
                                     sampler=sampler)
        b1 = rows[0] if rows[0]["batch"] == 1 and sampler == args.sampler else decode_row(args, model, drafter, pool[:1], sampler)
        out[sampler] = {"accept_len_k4": st["accept_len"], "accept_rate_k4": st["accept_rate"],
                        "best_k_b1": b1["best_k"], "speedup_b1": b1["speedup"]}
    print(f"the samplers' price at temperature 1.0 (accept length at k = {k} on the same {n_prompts} prompts; best speedup at batch 1):")
    for name, v in out.items():
        print(f"  {name:9} accept length {v['accept_len_k4']:.3f} ({100 * v['accept_rate_k4']:.1f}% of drafts accepted), "
              f"batch 1: {v['speedup_b1']:.2f}x at k = {v['best_k_b1']}")
    return out


def expected_steps(rates, n):
    """Expected verify steps to emit n tokens when the draft at position i + 1 is accepted with
    probability rates[i] given the earlier ones were (k = len(rates)): a step emits j tokens, its
    j - 1 accepted drafts and the target's one, or fewer where the row ends."""
    emit, reach = [], 1.0  # P(a step emits j tokens), j = 1 .. k + 1
    for r in rates:
        emit.append(reach * (1 - (r or 0.0)))
        reach *= r or 0.0
    emit.append(reach)
    steps = [0.0] * (n + 1)
    for m in range(1, n + 1):
        steps[m] = 1 + sum(p * steps[max(m - j, 0)] for j, p in enumerate(emit, start=1))
    return steps[n]


@torch.no_grad()
def acceptance_table(args, task_cfg, model, drafter, n_prompts=256):
    """The share of drafts accepted at each draft position 1..k (given that the earlier ones were),
    for every k of args.ks, on n_prompts fresh prompts of the RL mix decoded at temperature 1 to
    <|eos|>: rows end where they end, so no k is favoured by where a step of the trace falls (the
    speed table's rows are all --max-new tokens long). -> {k: {"by_position", "drafted_at", "accept_len"}}."""
    rng = random.Random(2468)
    prompts = [task.encode(task.sample_problem(rng, task_cfg).prompt()) for _ in range(n_prompts)]
    out = {}
    print(f"\nacceptance by draft position, {n_prompts} prompts decoded to <|eos|> at temperature 1.0 ({args.sampler}): "
          f"% of the drafts at each position accepted, given the earlier ones were; in brackets, the drafts decided there")
    for k in args.ks:
        _, st = speculative_generate(model, drafter, prompts, task_cfg.max_response_len, k=k, eos_id=task.EOS_ID,
                                     sampler=args.sampler, keys=[777_000 + i for i in range(n_prompts)])
        out[k] = {"by_position": st["accept_by_position"], "drafted_at": st["drafted_at"], "accept_len": st["accept_len"]}
        cells = " ".join(f"{100 * (r or 0):5.1f} ({d})" for r, d in zip(st["accept_by_position"], st["drafted_at"]))
        print(f"  k = {k}: {st['accept_len']:.2f} tokens per verify step | {cells}", flush=True)
    return out


def tail_workload(args, task_cfg, model, drafter, n_steps=4):
    """Rollouts of rank 0's prompts (2-rank sharding) of the run's first RL steps, plain vs TLT, the
    same prompts and keys (the bench's own), alternating on one machine. The bandit learns during
    one unmeasured TLT pass first, as it would have during earlier RL steps."""
    targs = args.targs
    shards = []
    for step in range(n_steps):
        rows = train.step_rows(targs, task_cfg, step, 0, 2)[0]
        shards.append((rows, [task.encode(p.prompt()) for p in rows]))
    bandit = Bandit(targs.draft_ks)

    def run(tlt, shard, seed):
        rows, prompts = shard
        out, st = rollout(model, drafter, prompts, task_cfg.max_response_len, generator=generator(model, seed),
                          tlt=tlt, sd_threshold=targs.sd_threshold, bandit=bandit, eos_id=task.EOS_ID,
                          sampler=targs.sampler, keys=[seed * 10_000 + i for i in range(len(prompts))])
        reward = statistics.mean(task.reward(p.prompt(), task.decode(o.response)) for p, o in zip(rows, out))
        return st, reward, [o.response for o in out]
    for i, shard in enumerate(shards):  # bandit warm-up
        run(True, shard, 100 + i)
    plain, tlt = [], []
    for r in range(args.repeats):
        for i, shard in enumerate(shards):
            plain.append(run(False, shard, 10 * r + i))
            tlt.append(run(True, shard, 10 * r + i))
    t_plain = statistics.median([sum(s.time for s, _, _ in plain[r * n_steps:(r + 1) * n_steps]) for r in range(args.repeats)])
    t_tlt = statistics.median([sum(s.time for s, _, _ in tlt[r * n_steps:(r + 1) * n_steps]) for r in range(args.repeats)])
    share = statistics.median(s.tail_share for s, _, _ in plain)
    sd_row_steps = sum(s.sd_row_steps for s, _, _ in tlt)
    accept = sum(s.sd_tokens for s, _, _ in tlt) / sd_row_steps if sd_row_steps else None
    print(f"\nlong-tail rollouts (rank 0's shards of the default run's first {n_steps} steps, {len(shards[0][0])} rows each, "
          f"sd threshold {targs.sd_threshold}): plain {t_plain:.2f}s, TLT {t_tlt:.2f}s, speedup {t_plain / t_tlt:.2f}x; "
          f"TLT accept length {accept or 0:.2f}; tail share of the plain rollouts {100 * share:.0f}% (median; time after "
          f"90% of the rows had finished)")
    # lossless: the same prompts and keys give the same responses with "gumbel" (up to float32 near-ties),
    # rewards equal in distribution with "rejection"
    r_plain, r_tlt = statistics.mean(r for _, r, _ in plain), statistics.mean(r for _, r, _ in tlt)
    n = sum(len(resp) for _, _, resp in plain)
    same = sum(a == b for p, t in zip(plain, tlt) for a, b in zip(p[2], t[2]))
    print(f"those rollouts ({n} samples each, sampler {targs.sampler}): mean reward plain {r_plain:.3f}, TLT {r_tlt:.3f}; "
          f"{same} of {n} responses token-identical")
    print("bandit's best k per batch size: " + ", ".join(f"{Bandit.bucket_sizes(b)}: {k}" for b, k in bandit.best().items()))
    return {"steps": n_steps, "rows": len(shards[0][0]), "plain_time": t_plain, "tlt_time": t_tlt,
            "speedup": t_plain / t_tlt, "accept_len": accept, "tail_share": share, "reward_plain": r_plain, "reward_tlt": r_tlt,
            "identical_responses": same, "responses": n, "bandit_best": {str(k): v for k, v in bandit.best().items()}}


def held_out_prompts(task_cfg, n):
    """n prompts of the held-out evaluation set, always the same ones."""
    problems = task.eval_set(task_cfg)
    return [task.encode(p.prompt()) for p in random.Random(5).sample(problems, min(n, len(problems)))]


def drafter_on(target, state):
    """A drafter for `target` with the weights `state`, in eval mode."""
    d = Drafter(target).to(target.wte.weight.device).eval()
    d.load_state_dict(state)
    return d


@torch.no_grad()
def drafter_vs_target(task_cfg, model, warm_drafter, run_dir, n_prompts=64, k=4, sampler="gumbel"):
    """The controlled comparison: the target as a --tlt on run left it, decoded with k = 4 at
    temperature 1.0 on held-out prompts, once with that run's drafter (trained on idle ranks)
    and once with the warm-up drafter (what --drafter-updates off keeps); same prompts, same
    random stream. Returns {name: accept length}."""
    ck = torch.load(os.path.join(run_dir, "ckpt.pt"), map_location="cpu", weights_only=True)
    target = copy.deepcopy(model)
    target.load_state_dict(ck["model"])
    adaptive, frozen = drafter_on(target, ck["drafter"]), drafter_on(target, warm_drafter.state_dict())
    prompts = held_out_prompts(task_cfg, n_prompts)
    out = {}
    for name, d in (("adaptive", adaptive), ("frozen", frozen)):
        _, st = speculative_generate(target.eval(), d, prompts, task_cfg.max_response_len, k=k, eos_id=task.EOS_ID, sampler=sampler,
                                     generator=generator(target, 0))
        out[name] = st["accept_len"]
    return out


def drift_bench(targs, task_cfg, model, drafter, sft_steps=300, sft_lr=2e-3, n_seqs=1024, online_steps=500,
                n_prompts=128, seeds=(0, 1, 2)):
    """Does online training recover acceptance on a target that moved away from the drafter?
    Controlled: fine-tune a copy of the target a little on different data (reference traces with
    problem sizes drawn uniformly, alpha = 0, instead of the tail-heavy default), roll it out on
    the usual training prompts as an RL step would, train a copy of the warm-up drafter on those
    samples with the idle ranks' train_step and --drafter-online-lr, and decode held-out prompts
    with the moved target (k = 4, temperature 1.0, the same random streams) with each drafter."""
    torch.manual_seed(0)
    moved = copy.deepcopy(model).train()
    opt = torch.optim.AdamW(moved.parameters(), lr=sft_lr, betas=(0.9, 0.95), weight_decay=0.0)
    rng = random.Random(7)
    batches = warmup.sft_batches(rng, dataclasses.replace(task_cfg, alpha=0.0), sft_steps, targs.warmup_tokens)
    for batch in batches:
        warmup.sft_step(moved, moved, opt, batch, moved.wte.weight.device)
    moved.eval()
    buffer, gen = DrafterBuffer(keep_steps=1), generator(model, 1)
    for _ in range(0, n_seqs, 64):
        prompts = [task.encode(task.sample_problem(rng, task_cfg).prompt()) for _ in range(64)]
        results, _ = rollout(moved, None, prompts, task_cfg.max_response_len, eos_id=task.EOS_ID, generator=gen, tlt=False)
        for s in results:
            buffer.add(0, s.tokens, s.hidden, s.prompt_len)
    frozen, adapted = drafter_on(moved, drafter.state_dict()), drafter_on(moved, drafter.state_dict()).train()
    d_opt = make_optimizer(adapted, targs.drafter_online_lr)
    for _ in range(online_steps):
        train_step(adapted, d_opt, buffer, rng, batch_size=targs.drafter_batch, device=moved.wte.weight.device)
    adapted.eval()
    prompts = held_out_prompts(task_cfg, n_prompts)
    out = {}
    with torch.no_grad():
        for name, t, d in (("before the move", model, drafter), ("moved, frozen drafter", moved, frozen),
                           ("moved, adapted drafter", moved, adapted)):
            out[name] = [speculative_generate(t, d, prompts, task_cfg.max_response_len, k=4, eos_id=task.EOS_ID, sampler=targs.sampler,
                                              generator=generator(t, seed))[1]["accept_len"] for seed in seeds]
            print(f"{name:24} accept length {statistics.mean(out[name]):.3f} (k = 4, {len(prompts)} held-out prompts; "
                  f"{min(out[name]):.3f} to {max(out[name]):.3f} over {len(seeds)} random streams)", flush=True)
    print(f"target fine-tuned {sft_steps} steps on uniform sizes at lr {sft_lr:g}; drafter trained {online_steps} "
          f"steps at lr {targs.drafter_online_lr:g} on {len(buffer)} samples of the moved target")
    return {"drift": out}


E2E_VARIANTS = {  # the first six compare step times; the last two compare the drafters step by step at one k
    "off": ["--tlt", "off"], "on": ["--tlt", "on"], "frozen": ["--tlt", "on", "--drafter-updates", "off"],
    "ngram": ["--tlt", "on", "--drafter", "ngram"],  # TLT-Base: the model-free drafter
    "sibling": ["--tlt", "on", "--drafter", "sibling"],  # model-free: the GRPO group's other responses
    "sib+lrn": ["--tlt", "on", "--drafter", "sibling+learned"],  # learned until each row is its group's last
    "on_k4": ["--tlt", "on", "--draft-ks", "4"], "frozen_k4": ["--tlt", "on", "--drafter-updates", "off", "--draft-ks", "4"]}


def e2e_runs(args, root):
    """One fresh train.py RL run per variant, from the shared warm-ups; -> {variant: its records}."""
    records = {}
    for name, flags in E2E_VARIANTS.items():
        out = os.path.join(root, name)
        os.makedirs(out, exist_ok=True)
        for f in ("ckpt.pt", "metrics.jsonl"):  # a fresh RL run every time; the warm-ups are shared
            if os.path.exists(os.path.join(out, f)):
                os.remove(os.path.join(out, f))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}", "train.py",
               *args.train_flags, "--out-dir", out, "--warmup-dir", args.out_dir, "--rl-steps", str(args.e2e_steps),
               "--eval-per-bucket", "0", "--timeline-every", "0", *flags]  # the bench's own flags win
        print(f"$ {' '.join(cmd[2:])}", flush=True)
        t0 = time.time()
        subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL)
        with open(os.path.join(out, "metrics.jsonl")) as f:
            records[name] = [json.loads(line) for line in f]
        print(f"  done in {time.time() - t0:.0f}s", flush=True)
    return records


def amdahl_bound(mean, names):
    """What the rollout speedup allows (Amdahl's law): with a share f of --tlt off's step in the
    rollout and TLT's rollout s times faster, the step is 1 / ((1 - f) + f / s) faster if nothing
    else changes; what TLT's step spends outside its rollout (update, the slowest rank's wait,
    the rest), against --tlt off's, is what moves the measurement away from that figure.
    `mean(name, key)`: the mean of a run's records."""
    share = mean("off", "rollout_time") / mean("off", "step_time")
    s = mean("off", "rollout_time") / mean("on", "rollout_time")
    outside = {}
    for n in names:
        update, wait = mean(n, "update_time"), mean(n, "slowest_wait")
        outside[n] = {"update": update, "wait": wait, "other": mean(n, "step_time") - mean(n, "rollout_time") - update - wait}
    return {"share": share, "rollout_speedup": s, "bound": 1 / ((1 - share) + share / s), "outside": outside}


def e2e_bench(args, task_cfg, model, drafter):
    root = os.path.join(args.out_dir, "bench_e2e")
    records = e2e_runs(args, root)
    timed = ("off", "on", "frozen", "ngram", "sibling", "sib+lrn")

    def mean(name, key):  # step 0 is left out of means and medians: it pays for the first allocations
        vals = [r[key] for r in records[name][1:] if r[key] is not None]
        return sum(vals) / len(vals) if vals else None

    def median(name, key):
        return statistics.median(r[key] for r in records[name][1:])
    step = {n: mean(n, "step_time") for n in timed}
    print(f"\n{'':8} {'step s':>7} {'median':>7} {'rollout s':>9} {'draft s':>7} {'update s':>8} {'rollout %':>9} "
          f"{'tail %':>6} {'accept len':>10} {'accept rate':>11} {'reward':>7}")
    for n in timed:
        print(f"{n:8} {step[n]:7.3f} {median(n, 'step_time'):7.3f} {mean(n, 'rollout_time'):9.3f} {mean(n, 'draft_time'):7.3f} "
              f"{mean(n, 'update_time'):8.3f} {100 * mean(n, 'rollout_share'):8.0f}% {100 * median(n, 'tail_share'):5.0f}% "
              f"{mean(n, 'accept_len') or 0:10.2f} {mean(n, 'accept_rate') or 0:11.3f} {mean(n, 'reward'):7.3f}")
    print("(step s, rollout s, draft s, update s, rollout %, accept, reward: means over steps 1..; draft s: the slowest "
          "rank's drafting; median: the median step; tail %: median tail share)")
    by_pos = {n: train.by_position(records[n][1:]) for n in timed[1:] + ("on_k4", "frozen_k4")}
    print("\ndrafts accepted by draft position, % (given the earlier ones were accepted), and the drafts decided in all:")
    for n, (rates, drafted) in by_pos.items():
        print(f"{n:9} {train.format_positions(rates)}   ({sum(drafted):,} drafts)")
    # the runs generate the same tokens at every step, so step i of one run and step i of another are a pair
    paired = {n: sorted(a["step_time"] / b["step_time"] for a, b in zip(records["off"][1:], records[n][1:])) for n in timed[1:]}
    other = {n: sum(a["responses_digest"] != b["responses_digest"] for a, b in zip(records["off"], records[n])) for n in timed[1:]}
    print(f"\nstep-time speedup over --tlt off, mean step: TLT {step['off'] / step['on']:.2f}x, TLT with a frozen drafter "
          f"{step['off'] / step['frozen']:.2f}x, TLT-Base (n-gram drafter) {step['off'] / step['ngram']:.2f}x, sibling drafts "
          f"{step['off'] / step['sibling']:.2f}x, learned then sibling drafts {step['off'] / step['sib+lrn']:.2f}x; TLT's "
          f"rollout alone {mean('off', 'rollout_time') / mean('on', 'rollout_time'):.2f}x")
    for n in timed[1:]:
        print(f"  step by step, off / {n}: median {statistics.median(paired[n]):.2f}x, from {paired[n][0]:.2f}x to "
              f"{paired[n][-1]:.2f}x; {other[n]} of {len(records[n])} steps generated other responses (sampler {args.sampler})")
    print(f"--tlt off: rollout is {100 * median('off', 'rollout_time') / median('off', 'step_time'):.0f}% of the median step")
    amdahl = amdahl_bound(mean, timed)
    print(f"\nAmdahl: --tlt off spends {100 * amdahl['share']:.0f}% of a step in its rollout, and TLT's rollout is "
          f"{amdahl['rollout_speedup']:.2f}x faster: if the rest of TLT's step cost what --tlt off's does, TLT's step would be "
          f"{amdahl['bound']:.2f}x faster (measured {step['off'] / step['on']:.2f}x; at most {1 / (1 - amdahl['share']):.1f}x with "
          f"an infinitely fast rollout). What each run spends outside its rollout, ms per step:")
    print(f"{'':8} {'update':>7} {'wait':>7} {'other':>7}   (wait: the slowest rank, from its rollout's end to its update's start)")
    for n in timed:
        print(f"{n:8} " + " ".join(f"{1000 * amdahl['outside'][n][k]:7.1f}" for k in ("update", "wait", "other")))
    print("\nThose runs' bandits pick their own k, and accepted drafts per drafted token fall as k grows, so the")
    print("drafters are compared step by step in two more runs with k fixed at 4 (--draft-ks 4), same seeds:")
    print("step  accept length at k = 4: adaptive  frozen   gap   drafter top-1: adaptive  frozen   reward: off    on")
    for a, b, c, d in zip(records["on_k4"], records["frozen_k4"], records["off"], records["on"]):
        print(f"{a['step']:4d}                          {a['accept_len'] or 0:5.3f}   {b['accept_len'] or 0:5.3f} "
              f"{(a['accept_len'] or 0) - (b['accept_len'] or 0):+6.3f}                 {a['drafter_top1'] or 0:6.3f}  "
              f"{b['drafter_top1'] or 0:6.3f}         {c['reward']:5.3f} {d['reward']:5.3f}")
    final = drafter_vs_target(task_cfg, model, drafter, os.path.join(root, "on"), sampler=args.sampler)
    print(f"\nthe target after the --tlt on run's {args.e2e_steps} steps, k = 4, temperature 1.0, {min(64, len(task.eval_set(task_cfg)))} "
          f"held-out prompts: accept length {final['adaptive']:.3f} with the drafter trained on idle ranks, "
          f"{final['frozen']:.3f} with the warm-up drafter")
    series = lambda key, names: {n: [r[key] for r in records[n]] for n in names}  # noqa: E731
    return {"e2e": {"final_accept_len": final, "off_step_time": step["off"], "on_step_time": step["on"],
                    "frozen_step_time": step["frozen"], "ngram_step_time": step["ngram"], "speedup": step["off"] / step["on"],
                    "frozen_speedup": step["off"] / step["frozen"], "ngram_speedup": step["off"] / step["ngram"],
                    "step_time": step, "rollout_time": {n: mean(n, "rollout_time") for n in timed},
                    "draft_time": {n: mean(n, "draft_time") for n in timed},
                    "off_rollout_share": mean("off", "rollout_share"), "amdahl": amdahl,
                    "median_paired_speedup": {n: statistics.median(p) for n, p in paired.items()},
                    "tail_share": {n: median(n, "tail_share") for n in ("off", "on")}, "steps": args.e2e_steps,
                    "nproc": args.nproc, "accept_len": series("accept_len", timed[1:] + ("on_k4", "frozen_k4")),
                    "drafter_top1": series("drafter_top1", ("on_k4", "frozen_k4")),
                    "accept_rate": series("accept_rate", timed[1:] + ("on_k4", "frozen_k4")),
                    "accept_by_position": {n: {"rates": r, "drafted": d} for n, (r, d) in by_pos.items()},
                    "reward": series("reward", ("off", "on")), "steps_with_other_responses": other, "sampler": args.sampler}}


def drafters_bench(args, targs, task_cfg, model, drafter):
    """The drafter a train.py run left in args.drafters/ckpt.pt against the warm-up drafter, on that
    run's final target. The run must have started from this target warm-up and RL task; its drafter
    may have had another warm-up, or none (a cold start), which is what the comparison is for."""
    meta = torch.load(os.path.join(args.drafters, "ckpt.pt"), map_location="cpu", weights_only=True)["meta"]
    want = {**warmup.model_meta(targs, model.config, train.task_config(targs, warmup=True)),
            "rl_task": dataclasses.asdict(task_cfg)}
    differ = [k for k in want if meta.get(k) != want[k]]
    if differ:
        raise SystemExit(f"error: the run in {args.drafters} started from another target warm-up or task than "
                         f"{args.out_dir} ({', '.join(differ)} differ); pass that run's --out-dir and --train-args")
    n = min(200, len(task.eval_set(task_cfg)))
    result = drafter_vs_target(task_cfg, model, drafter, args.drafters, n_prompts=n, sampler=args.sampler)
    print(f"the target in {args.drafters}/ckpt.pt, k = 4, temperature 1.0, {n} held-out prompts: accept length "
          f"{result['adaptive']:.3f} with the run's drafter, {result['frozen']:.3f} with the warm-up drafter")
    return {"drafters": result}


def main(argv=None):
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    targs, task_cfg, model, drafter = load_models(args.targs)
    device = model.wte.weight.device
    print(f"bench on {machine(device)}, {targs.dtype}")
    with train.autocast(targs, device):  # --train-args "--dtype bfloat16": every forward under bf16 autocast
        if args.e2e:
            result = e2e_bench(args, task_cfg, model, drafter)
        elif args.drift:
            result = drift_bench(targs, task_cfg, model, drafter)
        elif args.drafters:
            result = drafters_bench(args, targs, task_cfg, model, drafter)
        else:
            result = decode_bench(args, task_cfg, model, drafter)
    print(json.dumps({**result, "dtype": targs.dtype, "machine": machine(device)}))


if __name__ == "__main__":
    main()
