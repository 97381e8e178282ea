"""Ranks: idle-rank drafter training, preemption by the last rank, drafter sync, timelines.

Under torchrun every rank rolls out its own shard, and long-tailed lengths make them finish at
very different times. A rank that is done enters an asynchronous barrier and, while it has not
completed, trains the drafter on its local buffer one short step at a time:

    work = dist.barrier(async_op=True)       # completes when the LAST rank arrives
    while not work.is_completed():           # the only preemption point
        drafter train_step(...)

So idle time becomes drafter training with torch.distributed alone: no scheduler process, no
RPC. Preemption comes from the last rank finishing its rollout, never from the trainer's own
progress. A step must be short, since the slowest rank waits at most one step for the others.

Then every rank must hold the same drafter again: parameters are averaged, weighted by each
rank's number of local steps (a rank that trained 0 steps contributes nothing; if nobody trained,
nothing changes). All-reduce gives every rank bit-identical sums, so the checksums match, and
train.py warns if they ever do not. Only the weights are synced: each rank's AdamW moments stay
its own, built from its own steps, which is harmless (they only scale that rank's next updates,
whose result is averaged again). A checkpoint holds rank 0's optimizer state, and after a resume
every rank starts from it; the drafter buffer is not saved and refills from the next steps.

A single process has no idle time and therefore never trains the drafter online; that is the
technique, not a bug: the training is free only because it fills time otherwise wasted.

Also here, because they concern ranks: `derive_seed` (a seed per rank or row, step and purpose)
and `print0` (only rank 0 prints).

Test: python -m pytest tests/test_scheduler.py   (4 gloo processes with skewed loads)
"""
import enum
import os
import time

import torch
import torch.distributed as dist

from drafter import DRAFTER_BATCH, train_step

class Seed(enum.IntEnum):
    """What a derived seed is for: each purpose its own random stream (the numbers only keep them apart)."""
    TARGET_DATA = 1        # the target warm-up's reference traces
    DRAFTER_DATA = 2       # the drafter warm-up's prompts and batches
    DRAFTER_SAMPLES = 3    # the target's samples the drafter warms up on
    INIT = 4               # initial weights, the same on every rank
    BANDIT = 5             # the bandit's exploration
    RL_PROMPTS = 6         # each RL step's prompts, the same on every rank
    ROLLOUT = 7            # rollout sampling with --sampler rejection
    DRAFTER_TRAINING = 8   # idle-rank drafter batches
    EVAL = 9               # evaluation sampling with --sampler rejection
    ROLLOUT_KEYS = 10      # each rollout row's key with --sampler gumbel
    EVAL_KEYS = 11         # each evaluation row's key with --sampler gumbel


def derive_seed(*parts):
    """A seed for (base seed, rank or row, step, purpose), or any tuple of integers: each random
    stream gets its own seed, and nothing reseeds the global generator inside a loop."""
    h = 0
    for x in parts:
        h = (h * 1_000_003 + int(x)) % (2 ** 61 - 1)
    return h


def print0(*a, **kw):
    """print on rank 0 only (the RANK that torchrun sets; a single process is rank 0)."""
    if int(os.environ.get("RANK", 0)) == 0:
        print(*a, **kw, flush=True)


TIMELINE_CHARS = {"plain": "#", "spec": "S", "train": "t", "wait": "."}


def idle_train(drafter, optimizer, buffer, rng, *, enabled=True, batch_size=DRAFTER_BATCH, device="cpu",
               timeout_s=300.0, grace_s=0.02):
    """Train the drafter until every rank has reached this point. Returns (steps, idle seconds,
    segments) with segments as [kind, start, end] relative to the call."""
    t0 = time.perf_counter()
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return 0, 0.0, []
    work = dist.barrier(async_op=True)
    steps, segments = 0, []
    can_train = enabled and len(buffer) > 0
    # grace period: the last rank to arrive sees the barrier complete within moments and must not
    # start a drafter step that everyone would then wait for
    while not work.is_completed() and time.perf_counter() - t0 < grace_s:
        time.sleep(0.0005)
    while not work.is_completed():
        if time.perf_counter() - t0 > timeout_s:  # a peer died or hangs: fail loudly, don't wait forever
            raise RuntimeError(f"idle-rank barrier not completed after {timeout_s:.0f}s: a rank is dead or stuck")
        if can_train:
            s = time.perf_counter() - t0
            train_step(drafter, optimizer, buffer, rng, batch_size=batch_size, device=device)
            steps += 1
            _extend(segments, "train", s, time.perf_counter() - t0)
        else:
            time.sleep(0.001)
    work.wait()  # surfaces an error if the barrier failed
    idle = time.perf_counter() - t0
    _extend(segments, "wait", segments[-1][2] if segments else 0.0, idle)
    return steps, idle, segments


def _extend(segments, kind, start, end):
    if segments and segments[-1][0] == kind:
        segments[-1][2] = end
    else:
        segments.append([kind, start, end])


@torch.no_grad()
def sync_drafter(drafter, local_steps):
    """Average drafter weights over ranks, weighted by local training steps."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    params = list(drafter.parameters())
    flat = torch.cat([p.detach().reshape(-1).double() for p in params])
    w = torch.tensor([float(local_steps)], dtype=torch.float64, device=flat.device)
    dist.all_reduce(w)
    if w.item() == 0:  # nobody trained: weights are already identical
        return
    flat *= local_steps
    dist.all_reduce(flat)
    flat /= w
    i = 0
    for p in params:
        p.copy_(flat[i:i + p.numel()].view_as(p).to(p.dtype))
        i += p.numel()


def gather_ranks(record):
    """All ranks' records (dicts), in rank order, on every rank."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
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
