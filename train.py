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
import copy
import hashlib
import json
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
from checkpoint import load_on_rank0, save_on_rank0
from common import check_out_dir, derive_seed, machine, sync
from distributed import COLLECTIVE_TIMEOUT_S, all_sum, compute_init, print0
from liveness import Liveness
from config import LEARNED, autocast, parse_args, proposer, task_config
from drafter import DrafterBuffer, agreement_chores, make_optimizer
from evaluate import evaluate_both, format_accuracy
from rollout import Bandit, by_position, format_positions, position_counts, rollout
from scheduler import add_health, drafter_health, drafter_schedule, gather_ranks, idle_train, render_timeline, start_drafter_sync
from warmup import drafter_meta, prepare_models


# -----------------------------------------------------------------------------
# main

def rl_meta(args, config, task_cfg):
    """What an RL checkpoint depends on: the warm-ups it started from and every RL setting."""
    keys = ("rl_seed", "careful_bonus", "drafter", "drafter_cold_lr", "drafter_online_lr", "prompts_per_step", "group_size", "rl_lr", "rl_epochs", "clip_eps", "kl_coef", "tlt", "drafter_updates",
            "sd_threshold", "drafter_keep", "drafter_keep_tokens", "drafter_idle_tokens", "update_tokens", "sampler")
    return {**drafter_meta(args, config, task_cfg, task_config(args, warmup=True)), **{k: getattr(args, k) for k in keys}, "draft_ks": list(args.draft_ks)}


def main(argv=None):
    args = parse_args(argv, __doc__)
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
    for step in range(start, args.rl_steps):
        with autocast(args, device):  # rollout, drafter training, GRPO update
            rec, ranks = rl_step(step, args, task_cfg, model, net, drafter, opt, d_opt, bandit, buffer, rank, world_size,
                                 device, ref_model, liveness, drafter_health(recent))
        recent = add_health(recent, rec["drafter_top1"], rec["drafter_top1_positions"])  # the drafter's health, next step's
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
    if rank == 0 and start < args.rl_steps:  # the run's records read back: none is held in memory while it runs
        with open(metrics_path) as f:
            summary([r for r in map(json.loads, f) if r["step"] >= start], acc0, acc1, time.time() - t_run)


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
    rows, keys, _ = step_rows(args, task_cfg, step, rank, world_size)
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
        drafter, d_opt, buffer, drng, chores=agreement_chores(drafter, samples, top1, args.drafter_idle_tokens, device) if learned else (),
        enabled=train_drafter, batch_size=args.drafter_batch, depth=d_depth, step_tokens=args.drafter_idle_tokens,
        device=device, liveness=liveness)
    # 5. every rank ends with the same drafter: the weighted average overlaps the update
    finish_sync = start_drafter_sync(drafter, d_steps if train_drafter else 0)
    # 6. every rank's rewards and rows, group-normalised advantages over the global batch, one GRPO update
    # of the target under DDP
    t_update, all_rewards, responses, (loss, clip, skipped) = update_target(
        args, model, net, opt, samples, rewards, rank, world_size, device, ref_model)
    finish_sync()
    sync(device)  # the optimizer step may still be queued on a GPU
    t1 = time.perf_counter()
    # 7. the step's record (rank 0 logs it): this rank's part, then every rank's
    local = {"rank": rank, "rollout_time": rollout_time, "draft_time": st.draft_time, "idle_time": idle, "drafter_steps": d_steps,
             "wait_to_update": t_update - t0 - rollout_time,
             "drafter_skipped": d_skipped, "tokens": st.tokens, "drafter_checksum": drafter.checksum(),
             "rows": len(rows), "tail_share": st.tail_share, "buffer_tokens": buffer.held_tokens(),
             "segments": st.segments + [[k, a + t_idle, b + t_idle] for k, a, b in idle_segs]}
    counts = {"tokens": st.tokens, "sd_tokens": st.sd_tokens, "sd_row_steps": st.sd_row_steps,
              "accepted": st.accepted, "drafted": st.drafted, "top1_agree": top1[0], "top1_positions": top1[1],
              "careful": sum(map(task.careful_share, texts)), "response_tokens": sum(len(s.response) for s in samples),
              **position_counts(st, max(args.draft_ks))}
    rec, ranks = step_record(step, local, all_sum(counts, device), all_rewards, responses, t1 - t0, t1 - t_update)
    rec.update(loss=loss, clip_frac=clip, skipped_update=skipped, drafter_lr=d_lr, drafter_depth=d_depth, drafter_health=health,
               bandit_best=bandit.best())
    return rec, ranks


def update_target(args, model, net, opt, samples, rewards, rank, world_size, device, ref_model=None):
    """Step 6: every rank's rewards and sequences (a group may span ranks), group-normalised advantages
    over the global batch, and one GRPO update of the target under DDP, on the rows that carry a
    gradient, re-dealt so that every rank updates about as many tokens; its token-level mean is over
    the global batch. -> (when the update began, every reward and every response in global row order,
    (loss, clip fraction, skipped))."""
    everyone = gather_ranks((rewards.tolist(), [s.tokens.tolist() for s in samples], [s.prompt_len for s in samples]))
    t_update = time.perf_counter()  # the update's first collective is done: every rank is here
    all_rewards = torch.tensor([r for part in everyone for r in part[0]], dtype=torch.float64)
    seqs, plens = [x for part in everyone for x in part[1]], [x for part in everyone for x in part[2]]
    adv = rl.group_advantages(all_rewards, args.group_size)
    active = [i for i in range(len(seqs)) if args.kl_coef > 0 or adv[i] != 0]  # a zero advantage adds a zero gradient
    ours = [active[j] for j in rl.deal_by_tokens([len(seqs[i]) for i in active], world_size)[rank]]
    model.train()
    update = rl.grpo_update(model, net, opt, [seqs[i] for i in ours], [plens[i] for i in ours], adv[ours],
                            pad_id=task.PAD_ID, update_tokens=args.update_tokens, epochs=args.rl_epochs,
                            clip_eps=args.clip_eps, kl_coef=args.kl_coef, ref_model=ref_model, device=device,
                            n_total=sum(len(s) - p for s, p in zip(seqs, plens)))
    model.eval()
    return t_update, all_rewards, [s[p:] for s, p in zip(seqs, plens)], update


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
        print0("  bandit's k per batch  " + ", ".join(f"{Bandit.bucket_sizes(int(b))}: {k}" for b, k in best.items())
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