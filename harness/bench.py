"""Side-by-side measurements: what speculative decoding and TLT buy, in one run on one machine.

    python -m harness.bench            # decoding: plain vs speculative for batch sizes 1..64 and k in 1..8
    python -m harness.bench --e2e      # RL steps: --tlt off, on, on with a frozen drafter, on with each model-free drafter
    python -m harness.bench --drift    # a target moved away from the drafter: frozen vs online-trained drafter
    python -m harness.bench --drafters out   # after a train.py run: its online-trained drafter vs the warm-up one
    python -m harness.bench --vocab    # the exact-token sampler at vocabularies of 50k and 152k tokens (random weights)

All but --vocab load the warmed-up target and drafter from --out-dir (warming them up first if absent, with
train.py's defaults plus --train-args), on the GPU when there is one, print a table, and end with
one JSON line holding every figure. Checkpoints made with other flags need the same flags here, e.g.
    python -m harness.bench --out-dir out_4x128 --train-args "--n-layer 4 --n-embd 128 --warmup-lr 3e-3 --warmup-steps 900"
--train-args "--dtype bfloat16" runs every forward under bf16 autocast, as train.py does; its
warm-ups are bf16 ones, so it needs a --out-dir of its own.

Decoding bench. Fresh prompts (not the training ones) whose responses, sampled with each row's key,
are longer than --max-new tokens, as a rollout's tail rows are: every row decodes exactly --max-new
tokens of its response (no row leaves early, none decodes past its end, and the batch size is what
the table says). The rejection sampler draws its own tokens on the same prompts, so its rows may
run past their end. Temperature 1.0, as in the RL rollouts. Each cell is the median of --repeats rounds
in which plain decoding and every k take turns, so a slow spell of a shared machine hits them alike.
The cost ratio c is the drafter's time per one-token forward over the target's, at batch 1. The
standard formula predicts a speedup of accept_len / (1 + k c), assuming a verify pass of k+1
tokens costs what a one-token pass costs; that holds on a GPU at small batch but not on a CPU,
so the bench also measures that cost and reports accept_len / (verify + k c).

Exact tokens at a real vocabulary (`vocab_noise`, also alone with --vocab, which needs no checkpoints):
a plain decoding step of a random-weight GPT of the default target shape with GPT-2's and Qwen2's
vocabularies, sampling by the "gumbel" sampler or by torch.multinomial, with the aten ops each runs.
It ends with the host-device traffic of one rollout like train.py's (32 rows, speculating from 8 on):
reads and copies per decoding step as a GPU would pay them (instrument.host_traffic, any device).

--e2e, --drift and --drafters run the comparisons of bench_e2e.py, which says what each measures.
"""
import argparse
import json
import os
import random
import shlex
import statistics
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from harness import config
from harness import warmup
from harness.bench_e2e import drafters_bench, drift_bench, e2e_bench, tail_workload
from harness.common import OneLineParser, check_out_dir, machine, sync, wants_cuda
from model import GPT, GPTConfig
from harness.model_free import SiblingDrafter
from harness.instrument import DecodeStats, count_syncs, host_traffic
from rl import step_rows
from rollout import Bandit
from speculative import SAMPLERS, GumbelSampler
from speculative import autoregressive_generate, speculative_generate


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
    mode.add_argument("--vocab", action="store_true", help="only the exact-token sampler at real vocabulary sizes "
                      "(random weights, no checkpoints)")
    mode.add_argument("--drafters", metavar="RUN_DIR", help="compare the drafter a train.py run left in RUN_DIR/ckpt.pt "
                   "with the warm-up drafter, on that run's final target")
    p.add_argument("--e2e-steps", type=int, default=30, help="RL steps per end-to-end run")
    p.add_argument("--train-args", default="", help="train.py flags for the checkpoints' config, the long-tail workload "
                   "and every --e2e run, e.g. --train-args='--rl-lr 2e-4'")
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
    # the bench measures a drafter warmed up first (train.py's default builds its drafter during RL); a
    # --drafter-warmup-steps in --train-args comes later and wins
    args.train_flags = ["--drafter-warmup-steps", str(config.WARM_DRAFTER_STEPS), *args.train_flags]
    if args.sampler:  # the e2e runs and every train.py setting the bench reads take it too
        args.train_flags += ["--sampler", args.sampler]
    args.targs = config.parse_args([*args.train_flags, "--out-dir", args.out_dir])  # the checkpoints' settings, parsed once
    args.sampler = args.targs.sampler
    if min_size(args.max_new, config.task_of(args.targs)) > config.task_of(args.targs).max_n:
        p.error(f"--max-new {args.max_new} is longer than the task's longest response")
    return args


def min_size(max_new, task):
    """Smallest problem whose longest response (task.response_len) is longer than max_new tokens."""
    return next((n for n in range(1, task.max_n + 1) if task.response_len(n) > max_new), task.max_n + 1)


def load_models(targs):
    check_out_dir(targs.out_dir)
    task = config.task_of(targs)
    device = torch.device("cuda" if wants_cuda(targs.device) else "cpu")
    with config.autocast(targs, device):  # a warm-up made here is made as train.py would make it
        model, drafter = warmup.prepare_models(targs, task, config.task_of(targs, warmup=True), False, 0, 1, device)
    return targs, task, model.eval(), drafter.eval()


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


class _OpCounter(TorchDispatchMode):
    n = 0  # ops seen

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # allocations launch nothing, views neither
        self.n += not (func.is_view or func.overloadpacket.__name__ in ("empty", "empty_like", "empty_strided"))
        return func(*args, **(kwargs or {}))


def count_ops(fn):
    """The aten ops that fn() runs, views and allocations left out: about the kernels it launches
    on a GPU (a few ops launch more than one), counted on any device by a TorchDispatchMode."""
    with _OpCounter() as counter:
        fn()
    return counter.n


@torch.no_grad()
def vocab_noise(device, vocabs=(50_257, 151_936), batches=(1, 64), repeats=5, shape=None):
    """What exact tokens cost at a real vocabulary (GPT-2's, Qwen2's): a plain decoding step, one token
    per row through a random-weight GPT (the default target's shape unless `shape` gives GPTConfig
    fields) with a KV cache, then sampling by "gumbel" or by torch.multinomial of the softmax, taking
    turns (median of `repeats`); with the aten ops a step runs (count_ops)."""
    print(f"\nexact tokens at a real vocabulary: a plain decoding step of a random-weight GPT (median of {repeats} rounds) "
          f"and its aten ops\n{'vocab':>7} {'batch':>5} {'multinomial ms':>14} {'gumbel ms':>9} {'ratio':>6} "
          f"{'ops: multinomial':>16} {'gumbel':>6}")
    rows = []
    for V in vocabs:
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=V, block_size=32, **(shape or {}))).to(device).eval()
        for B in batches:
            cache, x, gen = model.new_cache(B), torch.zeros(B, 1, dtype=torch.long, device=device), generator(model, 0)
            gumbel, at = GumbelSampler(1.0, torch.arange(B, device=device), V, 21), torch.full((B, 1), 20, device=device)

            def step(sampler):  # a forward at 20 cached positions, logits (B, 1, V) -> tokens (B, 1)
                cache.lengths.fill_(20)
                logits = model(x, cache)[0]
                if sampler == "gumbel":
                    return gumbel.choose(logits, gumbel.noise(at))[0]
                return torch.multinomial(torch.softmax(logits[:, -1].float(), -1), 1, generator=gen)
            runs = {name: lambda name=name: step(name) for name in ("multinomial", "gumbel")}
            t, _ = interleaved(runs, repeats, device)
            rows.append({"vocab": V, "batch": B, "multinomial_ms": 1e3 * t["multinomial"], "gumbel_ms": 1e3 * t["gumbel"],
                         "ratio": t["gumbel"] / t["multinomial"], "multinomial_ops": count_ops(runs["multinomial"]),
                         "gumbel_ops": count_ops(runs["gumbel"])})
            print("{vocab:7d} {batch:5d} {multinomial_ms:14.2f} {gumbel_ms:9.2f} {ratio:5.2f}x {multinomial_ops:16d} "
                  "{gumbel_ops:6d}".format(**rows[-1]), flush=True)
    return rows


def rollout_host_traffic(args, task, model, drafter):
    """instrument.host_traffic of a rollout like train.py's: step 0's rows on one rank, speculating from 8 rows on."""
    rows, keys, _ = step_rows(args.targs, task, 0, 0, 1)
    return host_traffic(model, drafter, [task.prompt_ids(p) for p in rows], task.max_response_len,
                        eos_id=task.eos_id, generator=generator(model, 0), sd_threshold=8,
                        bandit=Bandit(args.targs.draft_ks), sampler=args.sampler, keys=keys)


def decode_row(args, model, drafter, prompts, sampler, keys):
    """Plain decoding and speculative decoding at every k of args.ks on `prompts` (their rows' keys
    for exact-token sampling), interleaved; -> the table row for this batch size."""
    gen = generator(model, 0)
    runs = {0: lambda: autoregressive_generate(model, prompts, args.max_new, generator=gen, sampler=sampler, keys=keys)}
    for k in args.ks:
        runs[k] = lambda k=k: speculative_generate(model, drafter, prompts, args.max_new, k=k, generator=gen,
                                                   sampler=sampler, keys=keys)
    times, outs = interleaved(runs, args.repeats, model.wte.weight.device)
    ar = sum(len(o) for o in outs[0][0]) / times[0]
    per_k = {k: (sum(len(o) for o in outs[k][0]) / times[k], outs[k][1]["accept_len"]) for k in args.ks}
    best = max(per_k, key=lambda k: per_k[k][0])
    sd, acc = per_k[best]
    return {"batch": len(prompts), "ar_tok_s": ar, "sd_tok_s": sd, "best_k": best, "speedup": sd / ar, "accept_len": acc,
            "per_k": {str(k): {"tok_s": v[0], "accept_len": v[1], "speedup": v[0] / ar} for k, v in per_k.items()}}


def long_rows(args, task, model, n):
    """n rows as a rollout's tail holds them: prompts whose response (exact-token sampling, with the
    row's key) is longer than --max-new tokens, so that no row of the tables decodes past its
    <|eos|>, where the target writes what no drafter learned. -> (prompts, keys)."""
    rng, prompts, keys = random.Random(4321), [], []
    min_n = min_size(args.max_new, task)
    for start in range(0, 64 * n, 64):  # about 1 in 6 rows is long enough here; give up after 64 n
        batch = [task.prompt_ids(task.sample(rng, rng.randint(min_n, task.max_n)))
                 for _ in range(64)]
        done, _ = autoregressive_generate(model, batch, args.max_new + 1, eos_id=task.eos_id, sampler="gumbel",
                                          keys=list(range(start, start + 64)))
        long = [i for i, d in enumerate(done) if task.eos_id not in d][:n - len(prompts)]
        prompts += [batch[i] for i in long]
        keys += [start + i for i in long]
        if len(prompts) == n:
            return prompts, keys
    raise SystemExit(f"error: fewer than {n} of {64 * n} prompts have responses longer than --max-new {args.max_new}")


def decode_bench(args, task, model, drafter):
    pool, keys = long_rows(args, task, model, max(max(args.batches), 64))
    t1 = forward_time(model, 1)
    c = forward_time(model, 1, drafter) / t1
    print(f"sampler {args.sampler}, temperature 1.0, {args.max_new} tokens per row")
    rows = decode_table(args, model, drafter, pool, keys)
    print("cells: speculative tok/s (accept length = tokens per verify step)")
    # the crossover: the first batch size at which speculation is no faster than plain decoding
    crossover = next((r["batch"] for r in rows if r["speedup"] <= 1), None)
    if crossover is None:
        print(f"crossover: speculation pays at every batch size measured (1 to {rows[-1]['batch']})")
    else:
        print(f"crossover: speculation stops paying at batch {crossover}")
    price = sampler_price(args, model, drafter, pool, keys, rows)
    acceptance = acceptance_table(args, task, model, drafter)
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
    tail = tail_workload(args, task, model, drafter)
    sibling_rows = sibling_table(args, task, model, pool, keys, rows)
    return {"decode": rows, "acceptance": {str(k): v for k, v in acceptance.items()}, "sibling_decode": sibling_rows,
            "cost_ratio": c, "verify_cost_ratio": verify, "formula_speedup_b1": ideal, "predicted_speedup_b1": predicted, "temperature": 1.0, "sampler": args.sampler, "crossover": crossover,
            "samplers": price, "max_new": args.max_new, "rollout": tail, "syncs_per_step": syncs}


def decode_table(args, model, drafter, pool, keys, siblings=None):
    """decode_row for every batch size of args.batches, printed as it goes. With `siblings` (per
    prompt of the pool, its group's finished responses) it drafts with a SiblingDrafter of them."""
    rows = []
    print(f"{'batch':>5} {'plain tok/s':>11} " + " ".join(f"{'k=' + str(k):>13}" for k in args.ks) + f" {'best':>6} {'speedup':>7}")
    for B in args.batches:
        at_b = SiblingDrafter(finished=siblings[:B]) if siblings else drafter
        rows.append(decode_row(args, model, at_b, pool[:B], args.sampler, keys[:B]))
        r = rows[-1]
        cells = " ".join(f"{v['tok_s']:7.0f} ({v['accept_len']:.2f})" for v in r["per_k"].values())
        print(f"{B:5d} {r['ar_tok_s']:11.0f} {cells} {r['best_k']:6d} {r['speedup']:6.2f}x", flush=True)
    return rows


def sibling_table(args, task, model, pool, keys, learned_rows, group=8):
    """The decoding table again with sibling drafts, as in the tail of a GRPO rollout: each row is the
    last of its group, whose other group - 1 responses (sampled by the target, other keys) have
    finished. Beside it, the learned drafter's best speedup per batch size from the first table."""
    n = max(args.batches)
    keys = [10 ** 9 + i for i in range((group - 1) * n)]
    done, _ = autoregressive_generate(model, [p for p in pool[:n] for _ in range(group - 1)], task.max_response_len,
                                      eos_id=task.eos_id, sampler=args.sampler, keys=keys)
    siblings = [done[i * (group - 1):(i + 1) * (group - 1)] for i in range(n)]
    print(f"\nsibling drafts (SiblingDrafter), each row the last of a group of {group} whose {group - 1} other responses "
          f"have finished, {args.max_new} tokens per row:")
    rows = decode_table(args, model, None, pool, keys, siblings)
    print("best speedup per batch size, learned drafter / sibling drafts: " + ", ".join(
        f"{a['batch']}: {a['speedup']:.2f}x / {b['speedup']:.2f}x" for a, b in zip(learned_rows, rows)))
    return rows


@torch.no_grad()
def sampler_price(args, model, drafter, pool, keys, rows, k=4, n_prompts=64):
    """What exact tokens cost: the accept length at k = 4 and temperature 1 of both samplers on the
    same 64 prompts, and each sampler's best-k speedup at batch 1 (from the table for this
    sampler, measured the same way for the other)."""
    out = {}
    for sampler in SAMPLERS:
        st = DecodeStats()
        speculative_generate(model, drafter, pool[:n_prompts], args.max_new, k=k, generator=generator(model, 1),
                             sampler=sampler, keys=keys[:n_prompts], observer=st)
        st = st.as_dict()
        b1 = rows[0] if rows[0]["batch"] == 1 and sampler == args.sampler else decode_row(args, model, drafter, pool[:1], sampler, keys[:1])
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
def acceptance_table(args, task, model, drafter, n_prompts=256):
    """The share of drafts accepted at each draft position 1..k (given that the earlier ones were),
    for every k of args.ks, on n_prompts fresh prompts of the RL mix decoded at temperature 1 to
    <|eos|>: rows end where they end, so no k is favoured by where a step of the trace falls (the
    speed table's rows are all --max-new tokens long). -> {k: {"by_position", "drafted_at", "accept_len"}}."""
    rng = random.Random(2468)
    prompts = [task.prompt_ids(task.sample(rng)) for _ in range(n_prompts)]
    out = {}
    print(f"\nacceptance by draft position, {n_prompts} prompts decoded to <|eos|> at temperature 1.0 ({args.sampler}): "
          f"% of the drafts at each position accepted, given the earlier ones were; in brackets, the drafts decided there")
    for k in args.ks:
        st = DecodeStats()
        speculative_generate(model, drafter, prompts, task.max_response_len, k=k, eos_id=task.eos_id,
                             sampler=args.sampler, keys=[777_000 + i for i in range(n_prompts)], observer=st)
        st = st.as_dict()
        out[k] = {"by_position": st["accept_by_position"], "drafted_at": st["drafted_at"], "accept_len": st["accept_len"]}
        cells = " ".join(f"{100 * (r or 0):5.1f} ({d})" for r, d in zip(st["accept_by_position"], st["drafted_at"]))
        print(f"  k = {k}: {st['accept_len']:.2f} tokens per verify step | {cells}", flush=True)
    return out


def main(argv=None):
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.vocab:  # random weights: no checkpoints to load or make
        device = torch.device("cuda" if wants_cuda(args.targs.device) else "cpu")
        print(f"bench on {machine(device)}")
        print(json.dumps({"vocab_noise": vocab_noise(device), "machine": machine(device)}))
        return
    targs, task, model, drafter = load_models(args.targs)
    device = model.wte.weight.device
    print(f"bench on {machine(device)}, {targs.dtype}")
    with config.autocast(targs, device):  # --train-args "--dtype bfloat16": every forward under bf16 autocast
        if args.e2e:
            result = e2e_bench(args, task, model, drafter)
        elif args.drift:
            result = drift_bench(targs, task, model, drafter)
        elif args.drafters:
            result = drafters_bench(args, targs, task, model, drafter)
        else:
            result = decode_bench(args, task, model, drafter)
            result["vocab_noise"] = vocab_noise(device)
            result["host_traffic"] = rollout_host_traffic(args, task, model, drafter)
    print(json.dumps({**result, "dtype": targs.dtype, "machine": machine(device)}))


if __name__ == "__main__":
    main()
