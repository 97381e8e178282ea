"""Ranks: idle-rank drafter training, preemption by the last rank, drafter sync, timelines.

Under torchrun every rank rolls out its own shard, and long-tailed lengths make them finish at
very different times. A rank that is done enters an asynchronous barrier and, while it has not
completed, trains the drafter on its local buffer one short step at a time:

    work = dist.barrier(async_op=True)       # completes when the LAST rank arrives
    while not work.is_completed():           # preemption: between turns, and inside a step
        drafter train_step(..., preempted=work.is_completed)

So idle time becomes drafter training with torch.distributed alone: no scheduler process, no
RPC. Preemption comes from the last rank finishing its rollout, never from the trainer's own
progress. A turn must be short, since the slowest rank waits for the others' turns in flight: a
step asks the barrier between its pieces (each chained pass, the backward) and is abandoned there.
Whatever else the drafter needs from the step (its health figure on the fresh rows, storing the
staged rows on the host) is done in the same loop, in pieces of at most --drafter-idle-tokens
positions, before training; the last rank to arrive does none of it, so between its rollout and
its update there is only what the update needs.

Then every rank must hold the same drafter again: parameters are averaged, weighted by each
rank's number of local steps (a rank that trained 0 steps contributes nothing; if nobody trained,
nothing changes), in one all-reduce that runs while the target updates. All-reduce gives every
rank bit-identical sums, so the checksums match, and train.py warns if they ever do not. Only the weights are synced: each rank's AdamW moments stay
its own, built from its own steps, which is harmless (they only scale that rank's next updates,
whose result is averaged again). A checkpoint holds rank 0's optimizer state, and after a resume
every rank starts from it; the drafter buffer is not saved and refills from the next steps.

Slow is not dead: a rank's rollout may run for minutes on a real model, so the barrier does not
time out; `liveness.Liveness` tells a slow rank (still beating) from a dead or hung one (silent), and the
waiting ranks fail, naming the rank, once a peer has been silent for TLT_COLLECTIVE_TIMEOUT seconds.

A single process has no idle time and therefore never trains the drafter online; that is the
technique, not a bug: the training is free only because it fills time otherwise wasted.

Test: python -m pytest tests/test_scheduler.py   (4 gloo processes with skewed loads)
"""
import math
import time
from collections import deque

import torch
import torch.distributed as dist
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from common import add_segment
from distributed import multi_rank
from liveness import until_all_arrive
from drafter import DEPTH, DRAFTER_BATCH, IDLE_STEP_TOKENS, train_step

TIMELINE_CHARS = {"plain": "#", "spec": "S", "train": "t", "wait": "."}


def idle_train(drafter, optimizer, buffer, rng, *, chores=(), enabled=True, batch_size=DRAFTER_BATCH, depth=DEPTH,
               step_tokens=IDLE_STEP_TOKENS, device="cpu", liveness=None, timeout_s=300.0, grace_s=0.02):
    """Train the drafter until every rank has reached this point: the technique's idle loop,

        work = dist.barrier(async_op=True)      # completes when the LAST rank arrives
        while not work.is_completed():
            next chore, or one drafter train_step

    `chores` are what the drafter needs from this step before it trains on it (its health figure on
    the fresh rows, one chunk per chore), run one per turn. The ones still waiting when the last
    rank arrives are dropped: they never delay it. A single process has no idle time and nobody
    to delay, so it runs them all and trains nothing. Returns (steps, skipped steps, idle seconds,
    segments) with segments as [kind, start, end] relative to the call.

    Preemption bound: the loop looks at the barrier between turns, and a drafter step looks at it
    between its pieces (each chained pass, the backward), so a rank that is busy when the last rank
    arrives stops within one chore, one piece of stored rows or one piece of a drafter step, each of
    at most `step_tokens` padded positions (up to batch_size sequences), a few milliseconds here;
    `metrics.jsonl`'s `slowest_wait` shows what the slowest rank paid for it.
    The barrier's grace period, liveness and errors: liveness.until_all_arrive."""
    t0 = time.perf_counter()
    chores = deque(chores)
    if not multi_rank():
        while chores:
            chores.popleft()()
        return 0, 0, 0.0, []
    steps, skipped, segments = 0, 0, []
    for arrived in until_all_arrive(liveness, grace_s=grace_s, timeout_s=timeout_s):  # the async barrier, turn by turn
        s = time.perf_counter() - t0
        if chores:
            chores.popleft()()
        elif enabled and buffer.staged:  # the step's rows to the host, a piece a turn: never on the last rank
            buffer.store_staged(step_tokens)
        elif enabled and len(buffer):
            loss, applied = train_step(drafter, optimizer, buffer, rng, batch_size=batch_size, device=device, depth=depth,
                                       max_tokens=step_tokens, preempted=arrived)
            steps += applied
            skipped += loss is not None and not applied  # a step abandoned when the last rank arrived is not a skip
        else:
            time.sleep(0.001)
            continue
        add_segment(segments, "train", s, time.perf_counter() - t0)
    idle = time.perf_counter() - t0
    add_segment(segments, "wait", segments[-1][2] if segments else 0.0, idle)
    return steps, skipped, idle, segments


@torch.no_grad()
def start_drafter_sync(drafter, local_steps):
    """Average the drafter weights over ranks, weighted by each rank's local training steps, in the
    background: one all-reduce of [steps * weights, steps] is started here, so it overlaps the
    target's update, and the returned `finish()` (called after the update, before the next rollout)
    waits for it and writes the average in. A rank that trained 0 steps adds nothing: the slowest
    rank, which never trains, must not pull the others back. If nobody trained, nothing changes.
    Every rank gets bit-identical sums, so identical weights (a non-finite step is never applied,
    drafter.train_step, so every rank's weights are finite)."""
    if not multi_rank():
        return lambda: None
    params = list(drafter.parameters())
    flat = torch.cat([parameters_to_vector(params).double() * local_steps,
                      torch.tensor([float(local_steps)], dtype=torch.float64, device=params[0].device)])
    work = dist.all_reduce(flat, async_op=True)

    @torch.no_grad()
    def finish():
        work.wait()
        total = flat[-1].item()  # sync: the summed step count
        if total > 0:
            vector_to_parameters((flat[:-1] / total).to(params[0].dtype), params)
    return finish


def gather_ranks(record):
    """All ranks' records (dicts), in rank order, on every rank."""
    if not multi_rank():
        return [record]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, record)
    return out


def render_timeline(records, width=64):
    """One text row per rank: '#' plain decoding, 'S' speculative, 't' drafter training, '.' waiting."""
    total = max((seg[2] for r in records for seg in r["segments"]), default=0.0) or 1.0
    lines = []
    for r in records:
        row = [" "] * width
        for kind, a, b in r["segments"]:
            lo, hi = int(a / total * width), max(int(a / total * width) + 1, int(round(b / total * width)))
            for i in range(lo, min(hi, width)):
                row[i] = TIMELINE_CHARS[kind]
        lines.append(f"rank {r['rank']:2d} |{''.join(row)}| {r['rollout_time']:.2f}s rollout, "
                     f"{r['idle_time']:.2f}s idle, {r['drafter_steps']} drafter steps")
    legend = "  ".join(f"{c} {k}" for k, c in TIMELINE_CHARS.items())
    return "\n".join(lines + [f"        {legend}   (full width = {total:.2f}s)"])


# -----------------------------------------------------------------------------
# how hard the idle ranks train the drafter: its health decides

HEALTHY, SICK = 0.98, 0.85  # the drafter's health (teacher-forced top-1) where online training is gentlest and hardest
HEALTH_STEPS = 5  # RL steps whose figures make the health


def drafter_health(recent):
    """The drafter's health: its teacher-forced top-1 agreement on the fresh rows of the last
    HEALTH_STEPS RL steps (`recent`: [agreeing positions, positions] per step; None before any).
    The same on every rank: each step's figure is summed over ranks."""
    n = sum(p for _, p in recent)
    return sum(a for a, _ in recent) / n if n else None


def add_health(recent, top1, positions):
    """`recent` with one more step's figure (its top-1 agreement over `positions` scored positions),
    the last HEALTH_STEPS steps' kept: one step's rows are few. A step with none scored adds nothing."""
    return (recent + [[top1 * positions, positions]])[-HEALTH_STEPS:] if positions else recent


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
