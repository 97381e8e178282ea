"""RL-level comparisons: what TLT buys over whole rollouts and RL steps, and how the drafter holds up
when the target moves. Run through bench.py, which parses the flags and loads the warmed-up models:

    python -m harness.bench --e2e      # RL steps: --tlt off, on, on with a frozen drafter, on with each model-free drafter
    python -m harness.bench --drift    # a target moved away from the drafter: frozen vs online-trained drafter
    python -m harness.bench --drafters out   # after a train.py run: its online-trained drafter vs the warm-up one

End-to-end bench (`e2e_bench`). train.py runs from the same warm-ups and seed, each its own torchrun
group (E2E_VARIANTS): --tlt off, on, on with a frozen drafter, on with the n-gram drafter (TLT-Base),
with sibling drafts, and with the learned drafter until every running row is the last of its group.
Means and medians skip step 0 (first allocations). With exact-token sampling the runs generate
the same tokens at every step, so step i of two runs is a pair, and the median of the per-step
ratios compares the modes on the same work. Two more runs fix k = 4 to compare the adaptive and
the frozen drafter step by step, and the bench ends on one target (drafter_vs_target).

Long-tail rollouts (`tail_workload`, in bench.py's default run): rank 0's prompts of the default run's
first RL steps, rolled out plain and with TLT, the same prompts and keys, taking turns.

Drift bench (`drift_bench`): a copy of the target fine-tuned a little on other data, decoded with the
warm-up drafter frozen and with a copy trained online on the moved target's rollouts. Drafters bench
(`drafters_bench`): a train.py run's drafter against the warm-up one, on that run's final target.

Test: python -m pytest tests/test_bench_e2e.py
"""
import copy
import dataclasses
import json
import os
import random
import statistics
import subprocess
import sys
import time

import torch

from harness import config
from harness import warmup
from drafter import Drafter, DrafterBuffer, make_optimizer, train_step
from harness.instrument import RolloutStats
from harness.report import best_arms
from harness.report import bucket_sizes, by_position
from rl import step_rows
from rollout import Bandit, rollout
from speculative import speculative_generate


def generator(model, seed):
    return torch.Generator(device=model.wte.weight.device).manual_seed(seed)


def tail_workload(args, task, model, drafter, n_steps=4):
    """Rollouts of rank 0's prompts (2-rank sharding) of the run's first RL steps, plain vs TLT, the
    same prompts and keys (the bench's own), alternating on one machine. The bandit learns during
    one unmeasured TLT pass first, as it would have during earlier RL steps."""
    targs = args.targs
    shards = []
    for step in range(n_steps):
        rows = step_rows(targs, task, step, 0, 2)[0]
        shards.append((rows, [task.prompt_ids(p) for p in rows]))
    bandit = Bandit(targs.draft_ks)

    def run(tlt, shard, seed):
        rows, prompts = shard
        st = RolloutStats()
        out = rollout(model, drafter if tlt else None, prompts, task.max_response_len,
                      generator=generator(model, seed), sd_threshold=targs.sd_threshold, bandit=bandit, eos_id=task.eos_id,
                      sampler=targs.sampler, keys=[seed * 10_000 + i for i in range(len(prompts))], observer=st)
        st.finish(len(prompts))
        reward = statistics.mean(task.reward(p, o.response) for p, o in zip(rows, out))
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
    print("bandit's best k per batch size: " + ", ".join(f"{bucket_sizes(b)}: {k}" for b, k in best_arms(bandit).items()))
    return {"steps": n_steps, "rows": len(shards[0][0]), "plain_time": t_plain, "tlt_time": t_tlt,
            "speedup": t_plain / t_tlt, "accept_len": accept, "tail_share": share, "reward_plain": r_plain, "reward_tlt": r_tlt,
            "identical_responses": same, "responses": n, "bandit_best": {str(k): v for k, v in best_arms(bandit).items()}}


def held_out_prompts(task, n):
    """n prompts of the held-out evaluation set, always the same ones."""
    problems = task.eval_set()
    return [task.prompt_ids(p) for p in random.Random(5).sample(problems, min(n, len(problems)))]


def drafter_on(target, state):
    """A drafter for `target` with the weights `state`, in eval mode."""
    d = Drafter(target).to(target.wte.weight.device).eval()
    d.load_state_dict(state)
    return d


@torch.no_grad()
def drafter_vs_target(task, model, warm_drafter, run_dir, n_prompts=64, k=4, sampler="gumbel"):
    """The controlled comparison: the target as a --tlt on run left it, decoded with k = 4 at
    temperature 1.0 on held-out prompts, once with that run's drafter (trained on idle ranks)
    and once with the warm-up drafter (what --drafter-updates off keeps); same prompts, same
    random stream. Returns {name: accept length}."""
    ck = torch.load(os.path.join(run_dir, "ckpt.pt"), map_location="cpu", weights_only=True)
    target = copy.deepcopy(model)
    target.load_state_dict(ck["model"])
    adaptive, frozen = drafter_on(target, ck["drafter"]), drafter_on(target, warm_drafter.state_dict())
    prompts = held_out_prompts(task, n_prompts)
    out = {}
    for name, d in (("adaptive", adaptive), ("frozen", frozen)):
        _, st = speculative_generate(target.eval(), d, prompts, task.max_response_len, k=k, eos_id=task.eos_id, sampler=sampler,
                                     generator=generator(target, 0))
        out[name] = st["accept_len"]
    return out


def drift_bench(targs, task, model, drafter, sft_steps=300, sft_lr=2e-3, n_seqs=1024, online_steps=500,
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
    batches = warmup.sft_batches(rng, dataclasses.replace(task, alpha=0.0), sft_steps, targs.warmup_tokens)
    for batch in batches:
        warmup.sft_step(moved, moved, opt, batch, task.pad_id, moved.wte.weight.device)
    moved.eval()
    buffer, gen = DrafterBuffer(keep_steps=1), generator(model, 1)
    for _ in range(0, n_seqs, 64):
        prompts = [task.prompt_ids(task.sample(rng)) for _ in range(64)]
        results = rollout(moved, None, prompts, task.max_response_len, eos_id=task.eos_id, generator=gen)
        for s in results:
            buffer.add(0, s.tokens, s.hidden, s.prompt_len)
    frozen, adapted = drafter_on(moved, drafter.state_dict()), drafter_on(moved, drafter.state_dict()).train()
    d_opt = make_optimizer(adapted, targs.drafter_online_lr)
    for _ in range(online_steps):
        train_step(adapted, d_opt, buffer.sample(targs.drafter_batch, rng, moved.wte.weight.device))
    adapted.eval()
    prompts = held_out_prompts(task, n_prompts)
    out = {}
    with torch.no_grad():
        for name, t, d in (("before the move", model, drafter), ("moved, frozen drafter", moved, frozen),
                           ("moved, adapted drafter", moved, adapted)):
            out[name] = [speculative_generate(t, d, prompts, task.max_response_len, k=4, eos_id=task.eos_id, sampler=targs.sampler,
                                              generator=generator(t, seed))[1]["accept_len"] for seed in seeds]
            print(f"{name:24} accept length {statistics.mean(out[name]):.3f} (k = 4, {len(prompts)} held-out prompts; "
                  f"{min(out[name]):.3f} to {max(out[name]):.3f} over {len(seeds)} random streams)", flush=True)
    print(f"target fine-tuned {sft_steps} steps on uniform sizes at lr {sft_lr:g}; drafter trained {online_steps} "
          f"steps at lr {targs.drafter_online_lr:g} on {len(buffer.items)} samples of the moved target")
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


def amdahl_table(amdahl, measured):
    """Prints amdahl_bound's figures beside the measured step speedup of TLT over --tlt off."""
    print(f"\nAmdahl: --tlt off spends {100 * amdahl['share']:.0f}% of a step in its rollout, and TLT's rollout is "
          f"{amdahl['rollout_speedup']:.2f}x faster: if the rest of TLT's step cost what --tlt off's does, TLT's step would be "
          f"{amdahl['bound']:.2f}x faster (measured {measured:.2f}x; at most {1 / (1 - amdahl['share']):.1f}x with "
          f"an infinitely fast rollout). What each run spends outside its rollout, ms per step:")
    print(f"{'':8} {'update':>7} {'wait':>7} {'other':>7}   (wait: the slowest rank, from its rollout's end to its update's start)")
    for n, outside in amdahl["outside"].items():
        print(f"{n:8} " + " ".join(f"{1000 * outside[k]:7.1f}" for k in ("update", "wait", "other")))


def fixed_k_table(records):
    """The adaptive and the frozen drafter step by step in the two runs at k = 4, beside the rewards of --tlt off and on."""
    print("\nThose runs' bandits pick their own k, and accepted drafts per drafted token fall as k grows, so the")
    print("drafters are compared step by step in two more runs with k fixed at 4 (--draft-ks 4), same seeds:")
    print("step  accept length at k = 4: adaptive  frozen   gap   drafter top-1: adaptive  frozen   reward: off    on")
    for a, b, c, d in zip(records["on_k4"], records["frozen_k4"], records["off"], records["on"]):
        print(f"{a['step']:4d}                          {a['accept_len'] or 0:5.3f}   {b['accept_len'] or 0:5.3f} "
              f"{(a['accept_len'] or 0) - (b['accept_len'] or 0):+6.3f}                 {top1(a):>6}  "
              f"{top1(b):>6}         {c['reward']:5.3f} {d['reward']:5.3f}")


def top1(record):
    """A step's drafter top-1, or "-" where no idle rank scored it (the record holds null)."""
    return "-" if record["drafter_top1"] is None else f"{record['drafter_top1']:.3f}"


def e2e_bench(args, task, model, drafter):
    """The E2E_VARIANTS runs (e2e_runs), their tables and the drafters on the final target -> {"e2e": figures}."""
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
    by_pos = {n: by_position(records[n][1:]) for n in timed[1:] + ("on_k4", "frozen_k4")}
    print("\ndrafts accepted by draft position, % (given the earlier ones were accepted), and the drafts decided in all:")
    for n, (rates, drafted) in by_pos.items():
        cells = " ".join("  -  " if r is None else f"{100 * r:4.1f}" for r in rates)
        print(f"{n:9} {cells}   ({sum(drafted):,} drafts)")
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
    amdahl_table(amdahl, step["off"] / step["on"])
    fixed_k_table(records)
    final = drafter_vs_target(task, model, drafter, os.path.join(root, "on"), sampler=args.sampler)
    print(f"\nthe target after the --tlt on run's {args.e2e_steps} steps, k = 4, temperature 1.0, {min(64, len(task.eval_set()))} "
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


def drafters_bench(args, targs, task, model, drafter):
    """The drafter a train.py run left in args.drafters/ckpt.pt against the warm-up drafter, on that
    run's final target. The run must have started from this target warm-up and RL task; its drafter
    may have had another warm-up, or none (a cold start), which is what the comparison is for."""
    meta = torch.load(os.path.join(args.drafters, "ckpt.pt"), map_location="cpu", weights_only=True)["meta"]
    want = {**warmup.model_meta(targs, model.config, config.task_of(targs, warmup=True)),
            "rl_task": task.meta()}
    differ = [k for k in want if meta.get(k) != want[k]]
    if differ:
        raise SystemExit(f"error: the run in {args.drafters} started from another target warm-up or task than "
                         f"{args.out_dir} ({', '.join(differ)} differ); pass that run's --out-dir and --train-args")
    n = min(200, len(task.eval_set()))
    result = drafter_vs_target(task, model, drafter, args.drafters, n_prompts=n, sampler=args.sampler)
    print(f"the target in {args.drafters}/ckpt.pt, k = 4, temperature 1.0, {n} held-out prompts: accept length "
          f"{result['adaptive']:.3f} with the run's drafter, {result['frozen']:.3f} with the warm-up drafter")
    return {"drafters": result}
