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

Slow is not dead: a rank's rollout may run for minutes on a real model, so the barrier does not
time out; `Liveness` tells a slow rank (still beating) from a dead or hung one (silent), and the
waiting ranks fail, naming the rank, once a peer has been silent for TLT_COLLECTIVE_TIMEOUT seconds.

A single process has no idle time and therefore never trains the drafter online; that is the
technique, not a bug: the training is free only because it fills time otherwise wasted.

Test: python -m pytest tests/test_scheduler.py   (4 gloo processes with skewed loads)
"""
import datetime
import math
import time

import torch
import torch.distributed as dist
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from common import add_segment, multi_rank
from drafter import DRAFTER_BATCH, train_step

TIMELINE_CHARS = {"plain": "#", "spec": "S", "train": "t", "wait": "."}


class Liveness:
    """Tells a slow rank from a dead one. A long-tail rollout can take minutes on a real model, so
    a rank that waits for the others must not give up after a fixed time; it gives up when a peer
    stops making progress. Every rank bumps its own counter in the rendezvous store while it works
    (`beat`: each decoding step, each idle step; at most once a second), and a waiting rank reads
    the others' counters (`check`: at most once a second) and raises, naming the rank, when one has
    not moved for `timeout_s` seconds by the waiting rank's own clock.

    The idle barrier runs in a process group of its own with a timeout of days, since liveness is
    judged here; every other collective keeps the short timeout of the default group, as ranks
    reach those together. A killed rank closes its connections and fails the barrier at once;
    a hung one (stopped, deadlocked) stops beating and is caught by `check`."""

    def __init__(self, store, rank, world_size, timeout_s, every_s=1.0):
        self.store, self.rank, self.world_size = store, rank, world_size
        self.timeout_s, self.every_s = timeout_s, every_s
        self.group = dist.new_group(backend="gloo", timeout=datetime.timedelta(days=7))  # collective: every rank
        self._last_beat = self._last_check = -math.inf
        self._seen = {}  # peer -> (its counter, when this rank saw it change)

    def beat(self):
        now = time.monotonic()
        if now - self._last_beat >= self.every_s:
            self.store.add(f"alive/{self.rank}", 1)
            self._last_beat = now

    def start_wait(self):
        """A new wait: a peer's silence is counted from now (between waits nobody needs to beat)."""
        self._seen, self._last_check = {}, -math.inf

    def check(self):
        now = time.monotonic()
        if now - self._last_check < self.every_s:
            return
        self._last_check = now
        for r in range(self.world_size):
            if r != self.rank:
                count = self.store.add(f"alive/{r}", 0)  # adding 0 reads the counter
                if r not in self._seen or self._seen[r][0] != count:
                    self._seen[r] = (count, now)
                elif now - self._seen[r][1] > self.timeout_s:
                    raise RuntimeError(f"rank {r} has made no progress for {now - self._seen[r][1]:.0f}s "
                                       f"(limit {self.timeout_s:.0f}s, TLT_COLLECTIVE_TIMEOUT): it is dead or hung")


def idle_train(drafter, optimizer, buffer, rng, *, enabled=True, batch_size=DRAFTER_BATCH, passes=2, device="cpu",
               liveness=None, timeout_s=300.0, grace_s=0.02):
    """Train the drafter until every rank has reached this point. Returns (steps, skipped steps,
    idle seconds, segments) with segments as [kind, start, end] relative to the call. With a
    `Liveness`, waits as long as every peer makes progress; without one, at most timeout_s."""
    t0 = time.perf_counter()
    if not multi_rank():
        return 0, 0, 0.0, []
    work = dist.barrier(group=liveness.group if liveness else None, async_op=True)
    if liveness:
        liveness.start_wait()
    steps, skipped, segments = 0, 0, []
    can_train = enabled and len(buffer) > 0
    # grace period: the last rank to arrive sees the barrier complete within moments and must not
    # start a drafter step that everyone would then wait for
    while not work.is_completed() and time.perf_counter() - t0 < grace_s:
        time.sleep(0.0005)
    while not work.is_completed():
        if liveness:
            liveness.beat()
            liveness.check()
        elif time.perf_counter() - t0 > timeout_s:  # a peer died or hangs: fail loudly, don't wait forever
            raise RuntimeError(f"idle-rank barrier not completed after {timeout_s:.0f}s: a rank is dead or stuck")
        if can_train:
            s = time.perf_counter() - t0
            _, applied = train_step(drafter, optimizer, buffer, rng, batch_size=batch_size, device=device, passes=passes)
            steps += applied
            skipped += not applied
            add_segment(segments, "train", s, time.perf_counter() - t0)
        else:
            time.sleep(0.001)
    try:
        work.wait()  # surfaces an error if the barrier failed
    except RuntimeError as e:  # a peer closed its connections: it crashed or was killed
        raise RuntimeError(f"the idle barrier failed: a peer is gone (torchrun's summary names the rank that "
                           f"failed first; its log says why): {e}") from e
    idle = time.perf_counter() - t0
    add_segment(segments, "wait", segments[-1][2] if segments else 0.0, idle)
    return steps, skipped, idle, segments


@torch.no_grad()
def sync_drafter(drafter, local_steps):
    """Average drafter weights over ranks, weighted by local training steps (a non-finite step is
    never applied, drafter.train_step, so every rank's weights are finite)."""
    if not multi_rank():
        return
    flat = parameters_to_vector(drafter.parameters()).double()
    w = torch.tensor([float(local_steps)], dtype=torch.float64, device=flat.device)
    dist.all_reduce(w)
    if w.item() == 0:  # nobody trained: weights are already identical
        return
    flat *= local_steps
    dist.all_reduce(flat)
    vector_to_parameters((flat / w).to(next(drafter.parameters()).dtype), drafter.parameters())


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
