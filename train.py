"""Warm up a small GPT on a task (--task, the shell game in rounds by default), then improve it
with GRPO and TLT rollouts.

    python train.py                                    # one process, CPU or one GPU
    torchrun --standalone --nproc_per_node=2 train.py  # several ranks

The step first: after the two records it uses (`RunState`, `StepResult`), `rl_step` and the three
functions under it are one RL step on one rank, in the README's seven steps. Below them, the run
around the step, which a learner may skip: the flags, the cached warm-ups (harness/warmup.py),
--rl-steps of `rl_step`, each step's record (rank 0 logs a line and appends it to
<out-dir>/metrics.jsonl), a checkpoint every --ckpt-every steps (rerunning resumes), the summary.
"""
import copy
import json
import os
import random
import sys
import time
from collections import deque
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist

import rl
from harness.checkpoint import (bandit_state, keep_records, load_bandit, load_on_rank0,
                               save_on_rank0)
from harness.common import check_out_dir, machine, stop
from harness.config import autocast, model_config, parse_args, task_of
from harness.distributed import COLLECTIVE_TIMEOUT_S, compute_init, gather_ranks, print0, wrap_ddp
from drafter import DrafterBuffer, make_optimizer
from harness.evaluate import early_step, evaluate_both, snapshot, stale_drafter
from harness.instrument import RolloutStats, TimedDrafter, observers, liveness_observer
from harness.liveness import Liveness, beat, watched_barrier
from harness.model_free import LEARNED, proposer
from harness.report import log_step, next_lines, plan_line, step_record, summary
from rollout import Bandit, rollout
from scheduler import (IdleWork, RecentAcceptance, acceptance_pieces, drafter_schedule, idle_train,
                       start_drafter_sync)
from harness.warmup import drafter_meta, prepare_models


@dataclass
class RunState:
    """What a rank holds across RL steps."""
    args: object  # the parsed flags
    task: object  # the task (tasks.Task): its problems, tokens and reward
    model: torch.nn.Module  # the target
    net: torch.nn.Module  # the target, or its DDP wrapper
    opt: torch.optim.Optimizer
    drafter: torch.nn.Module
    d_opt: torch.optim.Optimizer
    bandit: Bandit
    buffer: DrafterBuffer
    rank: int
    world_size: int
    device: torch.device
    # what the rollout drafts with: `drafter` (or --drafter's model-free one), its proposals timed
    # by the harness; None: plain decoding only (--tlt off)
    rollout_drafter: object
    # makes the idle loop's async barrier: dist.barrier(async_op=True), which the harness also
    # watches for a rank that has died
    barrier: object
    acceptance: RecentAcceptance  # the drafter's acceptance on fresh rows, lately
    ref_model: torch.nn.Module = None  # the frozen warm-up target, for --kl-coef
    early: dict = None  # the models at evaluate.early_step, for the stale drafter


class StepResult(NamedTuple):
    """What one RL step hands back to `run`, which makes the step's record from it."""
    problems: list  # this rank's problems
    finished: list  # their finished rows (speculative.FinishedRow), one per row
    idle: dict  # what this rank's idle time did
    acceptance: tuple  # the drafter's acceptance sums (kept, positions) over ranks
    update: tuple  # (every reward, every response, (loss, clip fraction, skipped))
    times: tuple  # (start, rollout end, idle start, update start, end): time.perf_counter()


def rl_step(step, state, observer=None):
    """One RL step on this rank, in the README's seven steps -> StepResult. observer: the
    harness's, called after every decoding step."""
    args, t0 = state.args, time.perf_counter()
    # 1. this rank's rows of the step's global batch, each with its key
    problems, keys, _ = rl.step_rows(args, state.task, step, state.rank, state.world_size)
    # 2. roll out: each decoding step plain or speculative, the bandit choosing k per batch size
    finished = roll_out(state, step, problems, keys, observer)
    t_rollout = time.perf_counter()
    rewards = torch.tensor([state.task.reward(p, r.response)
                            for p, r in zip(problems, finished)]).tolist()  # float32, as logged
    # 3-5. the rows to the drafter; idle time for it until the last rank arrives; the drafter sync
    t_idle = time.perf_counter()
    idle, finish_sync = idle_phase(state, step, finished)
    # 6. advantages over the global batch, one GRPO update of the target under DDP
    t_update, update = update_target(state, finished, rewards)
    acceptance = finish_sync()  # the averaged drafter is in; the acceptance sums over ranks
    state.acceptance.add(*acceptance)
    if state.device.type == "cuda":
        torch.cuda.synchronize()  # sync: the optimizer step may still be queued
    # 7. (in `run`) the step's record, logged by rank 0
    times = (t0, t_rollout, t_idle, t_update, time.perf_counter())
    return StepResult(problems, finished, idle, acceptance, update, times)


def roll_out(state, step, problems, keys, observer):
    """Step 2: this rank's rollout -> its finished rows (speculative.FinishedRow)."""
    args = state.args
    seed = rl.derive_seed(args.rl_seed, state.rank, step, rl.Seed.ROLLOUT)
    gen = torch.Generator(device=state.device).manual_seed(seed)
    prompts = [state.task.prompt_ids(p) for p in problems]
    return rollout(state.model, state.rollout_drafter, prompts, state.task.max_response_len,
                   sd_threshold=args.sd_threshold, bandit=state.bandit, observer=observer,
                   temperature=args.temperature, eos_id=state.task.eos_id, generator=gen,
                   sampler=args.sampler, keys=keys)


def idle_phase(state, step, finished):
    """Steps 3-5: the finished rows into the drafter buffer; on idle time, until the last rank
    arrives, the drafter scored on them, then trained; the weighted sync started -> (idle stats,
    its finish)."""
    args = state.args
    learned = args.tlt and args.drafter in LEARNED
    train_drafter = learned and args.drafter_updates
    if train_drafter:
        state.buffer.add_rows(step, finished)
    recent, scored = state.acceptance.mean(), [0, 0]  # this rank's acceptance sums: kept, positions
    lr, depth = drafter_schedule(recent, args.drafter_online_lr, args.drafter_cold_lr,
                                 args.drafter_depth)
    for g in state.d_opt.param_groups:
        g["lr"] = lr
    scoring = deque()  # pieces of acceptance scoring on the fresh rows, before any training
    if learned:
        scoring = acceptance_pieces(state.drafter, finished, scored, args.drafter_idle_tokens,
                                    args.temperature)
    work = IdleWork(train_drafter, args.drafter_batch, depth, args.drafter_idle_tokens)
    rng = random.Random(rl.derive_seed(args.rl_seed, state.rank, step, rl.Seed.DRAFTER_TRAINING))
    steps, skipped, seconds, busy = idle_train(state.drafter, state.d_opt, state.buffer, rng, work,
                                               scoring, barrier=state.barrier)
    finish_sync = start_drafter_sync(state.drafter, steps if train_drafter else 0, scored)
    return dict(steps=steps, skipped=skipped, seconds=seconds, busy=busy, lr=lr, depth=depth,
                recent_acceptance=recent), finish_sync


def update_target(state, finished, rewards):
    """Step 6: every rank's rewards and finished rows, advantages per group, one GRPO update on
    the rows with a gradient, re-dealt by tokens -> (its start, (rewards, responses, figures))."""
    args = state.args
    part = (rewards, [r.tokens.tolist() for r in finished], [r.prompt_len for r in finished])
    everyone = [part]  # every rank's part, in rank order
    if state.world_size > 1:
        everyone = [None] * state.world_size
        dist.all_gather_object(everyone, part)
    t_update = time.perf_counter()  # the update's first collective is done: every rank is here
    all_rewards = torch.tensor([r for theirs in everyone for r in theirs[0]], dtype=torch.float64)
    seqs = [x for theirs in everyone for x in theirs[1]]
    plens = [x for theirs in everyone for x in theirs[2]]
    adv = rl.group_advantages(all_rewards, args.group_size)
    active = [i for i in range(len(seqs)) if args.kl_coef > 0 or adv[i] != 0]  # zero adds zero
    deal = rl.deal_by_tokens([len(seqs[i]) for i in active], state.world_size)
    ours = [active[j] for j in deal[state.rank]]
    cfg = rl.GRPOConfig(state.task.pad_id, args.update_tokens, args.rl_epochs, args.clip_eps,
                        args.kl_coef, args.temperature)
    state.model.train()
    n_total = sum(len(q) - p for q, p in zip(seqs, plens))
    update = rl.grpo_update(state.net, state.opt, [seqs[i] for i in ours], [plens[i] for i in ours],
                            adv[ours], cfg, n_total, state.ref_model)
    state.model.eval()
    return t_update, (all_rewards, [q[p:] for q, p in zip(seqs, plens)], update)


# -----------------------------------------------------------------------------
# the run around the step: flags, warm-ups, the step's record and log, checkpoints, resume

def main(argv=None):
    args = parse_args(argv, __doc__)
    ddp, rank, _, world_size, device, store = compute_init(args.device)
    try:
        check_out_dir(args.out_dir, args.warmup_dir, store=store)  # one folder for every machine
        if ddp:
            Liveness(store, rank, world_size, COLLECTIVE_TIMEOUT_S, io_deadline_s=args.io_deadline)
        run(args, rank, world_size, device)
        if ddp:
            dist.barrier()  # tearing gloo down while a peer still talks to it can abort the process
    finally:
        if ddp and dist.is_initialized():
            dist.destroy_process_group()
    if ddp:  # gloo can abort in C++ static destructors at exit; everything is flushed by now
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def run(args, rank, world_size, device):
    t_run, task = time.time(), task_of(args)
    print0(f"{world_size} rank(s) on {machine(device)}")
    meta = rl_meta(args, model_config(args, task), task)
    ckpt_path, metrics_path = (os.path.join(args.out_dir, f) for f in ("ckpt.pt", "metrics.jsonl"))
    ck = load_on_rank0(ckpt_path, meta)  # refused: the run stops before it writes anything
    problems = task.eval_set(args.eval_per_bucket) if args.eval_per_bucket else []
    with autocast(args, device):  # the warm-ups' forwards too: a bf16 run is bf16 end to end
        model, drafter = prepare_models(args, task, task_of(args, warmup=True),
                                        dist.is_initialized(), rank, world_size, device)
        acc0 = evaluate_both(model, drafter, problems, args, task, rank, world_size, "before RL")
    state = new_state(args, task, model, drafter, rank, world_size, device)
    start = resume(ckpt_path, ck, state)
    if rank == 0:  # every step appears once: drop records past the checkpoint
        keep_records(metrics_path, start)
        with open(os.path.join(args.out_dir, "task.json"), "w") as f:  # harness.report reads it
            json.dump(task.meta(), f)
    print0(plan_line(args, world_size))
    for step in range(start, args.rl_steps):
        if step == early_step(args):
            state.early = snapshot(model, drafter, step)
        stats = RolloutStats()  # counts and times the rollout from outside; its clock starts here
        with autocast(args, device):  # rollout, drafter training, GRPO update
            result = rl_step(step, state, observers(stats, liveness_observer(beat)))
        rec, ranks = step_record(state, step, result, stats)
        del result  # its rows hold hidden states: not kept through the next rollout
        if rank == 0:
            with open(metrics_path, "a") as f:
                f.write(json.dumps(rec) + "\n")
        log_step(rec, ranks, args)
        if (step + 1) % args.ckpt_every == 0 or step == args.rl_steps - 1:
            save(ckpt_path, meta, step, state)
    with autocast(args, device):
        acc1 = evaluate_both(model, drafter, problems, args, task, rank, world_size, "after RL",
                             check=True)
        stale = stale_drafter(state, problems, metrics_path)
    if rank == 0 and start < args.rl_steps:  # the records read back: none is held while it runs
        with open(metrics_path) as f:
            records = [r for r in map(json.loads, f) if r["step"] >= start]
        summary(records, acc0, acc1, time.time() - t_run, task, stale)
        print0("\n".join(next_lines(args, world_size)))


def new_state(args, task, model, drafter, rank, world_size, device):
    ddp = dist.is_initialized()
    return RunState(
        args, task, model,
        wrap_ddp(model) if ddp else model,
        torch.optim.AdamW(model.parameters(), lr=args.rl_lr, betas=(0.9, 0.95), weight_decay=0.0),
        drafter, make_optimizer(drafter, args.drafter_online_lr),
        Bandit(args.draft_ks, seed=rl.derive_seed(args.rl_seed, rank, 0, rl.Seed.BANDIT)),
        DrafterBuffer(args.drafter_keep, args.drafter_keep_tokens, getattr(torch, args.dtype)),
        rank, world_size, device,
        # the harness's: a drafter that times its proposals, a barrier that watches slow ranks
        TimedDrafter(proposer(args.drafter, drafter), device) if args.tlt else None,
        watched_barrier, RecentAcceptance(),
        copy.deepcopy(model).requires_grad_(False) if args.kl_coef > 0 else None)


def rl_meta(args, config, task):
    """What an RL checkpoint depends on: its warm-ups, every RL setting, the task's code."""
    keys = ("rl_seed", "drafter", "drafter_cold_lr", "drafter_online_lr", "prompts_per_step",
            "group_size", "rl_lr", "rl_epochs", "clip_eps", "kl_coef", "tlt", "drafter_updates",
            "sd_threshold", "drafter_keep", "drafter_keep_tokens", "drafter_idle_tokens",
            "update_tokens", "sampler")
    warm = drafter_meta(args, config, task, task_of(args, warmup=True))
    return {**warm, **{k: getattr(args, k) for k in keys}, "draft_ks": list(args.draft_ks),
            "task_code": task.code}


def save(path, meta, step, state):
    bandits = gather_ranks(bandit_state(state.bandit))
    save_on_rank0({"meta": meta, "step": step, "model": state.model.state_dict(),
                   "drafter": state.drafter.state_dict(), "opt": state.opt.state_dict(),
                   "d_opt": state.d_opt.state_dict(), "bandits": bandits,
                   "recent_acceptance": state.acceptance.recent, "early": state.early},
                  path)


def resume(path, ck, state):
    """Take up the RL checkpoint `ck` (None: none) -> the first step to run. Ranks a checkpoint
    from fewer ranks did not have start their bandits fresh."""
    if not ck:
        return 0
    refused = None
    try:
        state.model.load_state_dict(ck["model"])
        state.drafter.load_state_dict(ck["drafter"])
        state.opt.load_state_dict(ck["opt"])
        state.d_opt.load_state_dict(ck["d_opt"])
        if state.rank < len(ck["bandits"]):
            load_bandit(state.bandit, ck["bandits"][state.rank])
        state.acceptance.recent = ck["recent_acceptance"]
        state.early = ck.get("early")  # none in a checkpoint from before it was kept
    except (KeyError, TypeError, ValueError, RuntimeError) as e:  # an older layout of the state
        refused = (f"error: checkpoint {path} does not fit this version of the code "
                   f"({type(e).__name__}: {e}); delete it or use another --out-dir")
    refused = [r for r in gather_ranks(refused) if r]  # one rank's bandit may not fit: all stop
    if refused:
        stop(refused[0])
    print0(f"resuming from {path} at RL step {ck['step'] + 1}")
    return ck["step"] + 1


if __name__ == "__main__":
    main()
