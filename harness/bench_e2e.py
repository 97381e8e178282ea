"""python -m harness.bench --e2e and --drift: what TLT buys over whole RL steps, and how the drafter
holds up when the target moves.

--e2e: train.py runs from the same warm-ups (VARIANTS), then the report's comparison: the runs write
the same tokens at every step, so the median of the per-step ratios compares the modes on the same
work. --drift: a copy of the target fine-tuned on other data, drafted for by the warm-up drafter
frozen and by a copy trained online on the moved target's rollouts.

Test: python -m pytest tests/test_bench_e2e.py
"""
import copy
import dataclasses
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import time

import torch

from harness import warmup
from drafter import DrafterBuffer, make_optimizer, train_step
from harness.evaluate import drafter_on
from harness.report import compare
from rollout import rollout
from speculative import speculative_generate

VARIANTS = {
    "off": ["--tlt", "off"], "on": ["--tlt", "on"],
    "frozen": ["--tlt", "on", "--drafter-updates", "off"],
    "ngram": ["--tlt", "on", "--drafter", "ngram"],  # TLT-Base: the model-free drafter
    "sibling": ["--tlt", "on", "--drafter", "sibling"],  # the GRPO group's other responses
}


def e2e_runs(args, root):
    """One fresh train.py RL run per variant, from the shared warm-ups -> {variant: its records}."""
    records = {}
    for name, flags in VARIANTS.items():
        out = os.path.join(root, name)
        shutil.rmtree(out, ignore_errors=True)  # a fresh RL run every time, in the bench's folder
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={args.nproc}", "train.py", *args.train_flags, "--out-dir", out,
               "--warmup-dir", args.out_dir, "--rl-steps", str(args.e2e_steps),
               "--eval-per-bucket", "0", "--timeline-every", "0", *flags]  # the variant's flags win
        print(f"$ {' '.join(cmd[2:])}", flush=True)
        t0 = time.time()
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
        with open(os.path.join(out, "metrics.jsonl")) as f:
            records[name] = [json.loads(line) for line in f]
        print(f"  done in {time.time() - t0:.0f}s", flush=True)
    return records


def e2e_bench(args):
    """The VARIANTS runs, from the warm-ups in args.out_dir: their table, then harness.report's
    comparison (A = --tlt off; step by step where the responses are the same) -> {"e2e": ...}."""
    records = e2e_runs(args, os.path.join(args.out_dir, "bench_e2e"))

    def mean(name, key):  # step 0 is left out: it pays for the first allocations
        vals = [r[key] for r in records[name][1:] if r[key] is not None]
        return sum(vals) / len(vals) if vals else None
    print(f"\n{'':8} {'step s':>7} {'rollout s':>9} {'draft s':>7} {'update s':>8} "
          f"{'rollout %':>9} {'accept len':>10} {'reward':>7}")
    for n in VARIANTS:
        print(f"{n:8} {mean(n, 'step_time'):7.3f} {mean(n, 'rollout_time'):9.3f} "
              f"{mean(n, 'draft_time'):7.3f} {mean(n, 'update_time'):8.3f} "
              f"{100 * mean(n, 'rollout_share'):8.0f}% {mean(n, 'accept_len') or 0:10.2f} "
              f"{mean(n, 'reward'):7.3f}")
    print("(means over steps 1..; draft s: the slowest rank's drafting)")
    print("\n".join(compare(list(records.values()), list(VARIANTS))))
    step = {n: mean(n, "step_time") for n in VARIANTS}
    return {"e2e": {
        "off_step_time": step["off"], "on_step_time": step["on"],
        "speedup": step["off"] / step["on"], "frozen_speedup": step["off"] / step["frozen"],
        "ngram_speedup": step["off"] / step["ngram"], "step_time": step,
        "rollout_time": {n: mean(n, "rollout_time") for n in VARIANTS},
        "off_rollout_share": mean("off", "rollout_share"), "steps": args.e2e_steps,
        "nproc": args.nproc, "sampler": args.sampler}}


def generator(model, seed):
    return torch.Generator(device=model.wte.weight.device).manual_seed(seed)


def moved_target(targs, task, model, sft_steps, sft_lr, rng):
    """A copy of the target fine-tuned sft_steps on reference traces of problem sizes drawn
    uniformly (alpha = 0) instead of the tail-heavy default."""
    torch.manual_seed(0)
    moved = copy.deepcopy(model).train()
    opt = torch.optim.AdamW(moved.parameters(), lr=sft_lr, betas=(0.9, 0.95), weight_decay=0.0)
    uniform = dataclasses.replace(task, alpha=0.0)
    for batch in warmup.sft_batches(rng, uniform, sft_steps, targs.warmup_tokens):
        warmup.sft_step(moved, moved, opt, batch, task.pad_id, moved.wte.weight.device)
    return moved.eval()


def drift_bench(targs, task, model, drafter, sft_steps=300, sft_lr=2e-3, n_seqs=1024,
                online_steps=500, n_prompts=128, seeds=(0, 1, 2)):
    """Does online training recover acceptance on a target that moved away from the drafter? Move a
    copy of the target (moved_target), roll it out on the usual training prompts as an RL step
    would, train a copy of the warm-up drafter on those samples with the idle ranks' train_step and
    --drafter-online-lr, and decode held-out prompts with the moved target (k = 4, temperature
    1.0, the same random streams) with each drafter."""
    rng = random.Random(7)
    moved = moved_target(targs, task, model, sft_steps, sft_lr, rng)
    buffer, gen = DrafterBuffer(keep_steps=1), generator(model, 1)
    for _ in range(0, n_seqs, 64):
        prompts = [task.prompt_ids(task.sample(rng)) for _ in range(64)]
        for s in rollout(moved, None, prompts, task.max_response_len, eos_id=task.eos_id,
                         generator=gen):
            buffer.add(0, s.tokens, s.hidden, s.prompt_len)
    frozen = drafter_on(moved, drafter.state_dict(), drafter.n_layer)
    adapted = drafter_on(moved, drafter.state_dict(), drafter.n_layer).train()
    opt = make_optimizer(adapted, targs.drafter_online_lr)
    for _ in range(online_steps):
        train_step(adapted, opt, buffer.sample(targs.drafter_batch, rng, moved.wte.weight.device))
    adapted.eval()
    held_out = random.Random(5).sample(task.eval_set(), min(n_prompts, len(task.eval_set())))
    prompts, out = [task.prompt_ids(p) for p in held_out], {}
    how = dict(k=4, eos_id=task.eos_id, sampler=targs.sampler)
    pairs = (("before the move", model, drafter), ("moved, frozen drafter", moved, frozen),
             ("moved, adapted drafter", moved, adapted))
    for name, t, d in pairs:
        with torch.no_grad():
            out[name] = [speculative_generate(t, d, prompts, task.max_response_len,
                                              generator=generator(t, seed), **how)[1]["accept_len"]
                         for seed in seeds]
        print(f"{name:24} accept length {statistics.mean(out[name]):.3f} (k = 4, {len(prompts)} "
              f"held-out prompts; {min(out[name]):.3f} to {max(out[name]):.3f} over {len(seeds)} "
              "random streams)", flush=True)
    print(f"target fine-tuned {sft_steps} steps on uniform sizes at lr {sft_lr:g}; drafter trained "
          f"{online_steps} steps at lr {targs.drafter_online_lr:g} on {len(buffer.items)} samples")
    return {"drift": out}
