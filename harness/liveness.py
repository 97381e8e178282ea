"""Every wait of a multi-rank run where ranks arrive far apart: slow is not dead, judged by progress,
not by a fixed time. Plumbing a learner may skip.

Liveness: every rank beats in the rendezvous store while it works, a waiting rank watches the
counters and fails fast, naming a rank that is dead or hung. until_all_arrive and watched_barrier
(the idle loop's barrier), wait_for_all (asleep, before a collective), beat and beating (progress
from a loop, or from a thread for one long call), from_rank0 (a decision taken once).

Test: python -m pytest tests/test_liveness.py tests/test_scheduler.py
"""
import contextlib
import datetime
import math
import os
import pickle
import threading
import time

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _set_pg_timeout

from harness.distributed import COLLECTIVE_TIMEOUT_S, connected, multi_rank

# seconds: the longest that `beating` vouches for one call that cannot beat from inside (rank 0's
# checkpoint I/O, a first CUDA step); past it the call counts as hung (train.py's --io-deadline)
IO_DEADLINE_S = float(os.environ.get("TLT_IO_DEADLINE", 1800))


class Liveness:
    """Tells a slow rank from a dead one: a long-tail rollout, an evaluation shard or rank 0's
    checkpoint can take minutes on a real model, so a waiting rank gives up when a peer stops making
    progress, not after a fixed time. Every rank bumps its counter in the rendezvous store while it
    works (`beat`, at most once every `every_s`); a waiting rank reads counters (`check`) and raises,
    naming the rank, when one has not moved for `timeout_s` s. Rank 0 watches every peer, the others
    rank 0 alone; rank 0 posts its verdict in the store, so every rank's log names the silent rank.

    The waits run in a gloo group of their own (under NCCL too), with a timeout of days once it has
    connected (within timeout_s), since liveness is judged here; other collectives keep the default
    group's short timeout. A killed rank fails the wait at once; a hung one stops beating.
    io_deadline_s: how long `beating` beats for one call. The last Liveness made is
    `Liveness.current`, which `wait_for_all`, `beat`, `beating` and `from_rank0` use."""

    current = None

    def __init__(self, store, rank, world_size, timeout_s, every_s=1.0, io_deadline_s=IO_DEADLINE_S):
        self.store, self.rank, self.world_size = store, rank, world_size
        self.timeout_s, self.every_s, self.io_deadline_s = timeout_s, every_s, io_deadline_s
        self.group = connected(lambda: dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s)))
        _set_pg_timeout(datetime.timedelta(days=7), self.group)
        self._last_beat = self._last_check = -math.inf
        self._seen = {}  # watched rank -> (its counter, when this rank saw it change)
        Liveness.current = self

    def beat(self):
        now = time.monotonic()
        if now - self._last_beat >= self.every_s:
            self.store.add(f"alive/{self.rank}", 1)
            self._last_beat = now

    def start_wait(self):
        """A new wait: a peer's silence is counted from now (between waits nobody needs to beat)."""
        self._seen, self._last_check = {}, -math.inf

    def verdict(self):
        """Rank 0's message about a silent rank, once it has found one; else None."""
        return self.store.get("verdict").decode() if self.store.check(["verdict"]) else None

    def post_doing(self, what):
        """What this rank is busy with ("" once done): the ranks that fail on its silence say it."""
        self.store.set(f"doing/{self.rank}", what)

    def check(self):
        now = time.monotonic()
        if now - self._last_check < self.every_s:
            return
        self._last_check = now
        verdict = self.verdict() if self.rank > 0 else None
        if verdict:
            raise RuntimeError(verdict)
        for r in range(1, self.world_size) if self.rank == 0 else [0]:
            count = self.store.add(f"alive/{r}", 0)  # adding 0 reads the counter
            if r not in self._seen or self._seen[r][0] != count:
                self._seen[r] = (count, now)
            elif now - self._seen[r][1] > self.timeout_s:
                doing = self.store.get(f"doing/{r}").decode() if self.store.check([f"doing/{r}"]) else ""
                message = (f"rank {r} has made no progress for {now - self._seen[r][1]:.0f}s (limit {self.timeout_s:.0f}s, "
                           f"TLT_COLLECTIVE_TIMEOUT): it is dead or hung{f'; it was {doing}' if doing else ''}")
                if self.rank == 0:
                    self.store.set("verdict", f"{message} (found by rank 0)")
                raise RuntimeError(message)


class Watched:
    """An async collective's work, judged by liveness: `is_completed()` beats and checks on every
    call (with a Liveness), or fails after timeout_s (without one); `wait()` surfaces a failed
    collective with rank 0's verdict if it has one. scheduler.idle_train polls it as it would
    dist.barrier(async_op=True)'s work."""

    def __init__(self, work, liveness, timeout_s):
        self.work, self.liveness, self.timeout_s = work, liveness, timeout_s
        self.t0 = time.perf_counter()
        if liveness:
            liveness.start_wait()

    def is_completed(self):
        if self.work.is_completed():
            return True
        if self.liveness:
            self.liveness.beat()
            self.liveness.check()
        elif time.perf_counter() - self.t0 > self.timeout_s:  # dead or stuck: fail, don't wait forever
            raise RuntimeError(f"barrier not completed after {self.timeout_s:.0f}s: a rank is dead or stuck")
        return False

    def wait(self):
        try:
            self.work.wait()
        except RuntimeError as e:  # a peer closed its connections: crashed, killed, or failed on a silent one
            verdict = self.liveness.verdict() if self.liveness else None
            raise RuntimeError(verdict or f"a barrier failed: a peer is gone (torchrun's summary names the rank that "
                                          f"failed first; its log says why): {e}") from e


def watched_barrier(liveness=None, timeout_s=COLLECTIVE_TIMEOUT_S):
    """An async barrier judged by liveness (`Watched`): what train.py gives the idle loop. With a
    Liveness (`liveness`, else `Liveness.current`) in its own group; without one, in the default
    group (gloo or NCCL), failing after timeout_s or the group's own timeout, the sooner."""
    liveness = liveness or Liveness.current
    return Watched(dist.barrier(group=liveness and liveness.group, async_op=True), liveness, timeout_s)


def until_all_arrive(liveness=None, grace_s=0.0, timeout_s=COLLECTIVE_TIMEOUT_S):
    """Wait until every rank has got here, however long, while they make progress; yields once a turn
    while some have not (the idle barrier trains the drafter, `wait_for_all` sleeps); what it yields,
    called, says whether they all have now. With a Liveness this rank beats and checks every turn;
    without one, it fails after timeout_s or the default group's timeout. grace_s: first wait this long
    without a turn, so that the last rank, which sees the barrier complete at once, starts nothing."""
    if not multi_rank():
        return
    t0 = time.perf_counter()
    work = watched_barrier(liveness, timeout_s)
    while not work.work.is_completed() and time.perf_counter() - t0 < grace_s:
        time.sleep(0.0005)
    while not work.is_completed():
        yield work.work.is_completed
    work.wait()


def wait_for_all():
    """Block until every rank is here, judged by liveness. Call it before a collective that ranks may
    reach far apart (after sampling, an evaluation shard, rank 0's checkpoint I/O): the collective
    itself then starts with every rank present, and its fixed timeout only bounds its own work."""
    for _ in until_all_arrive():
        time.sleep(0.001)


def beat():
    """A sign of progress from this rank (nothing without a Liveness): `progress=beat` for long loops."""
    if Liveness.current:
        Liveness.current.beat()


@contextlib.contextmanager
def beating(what="in one long call"):
    """Beat from a thread while the block runs, for at most --io-deadline: one long call that cannot
    beat from inside (rank 0's torch.save or load, a first CUDA step). Past the deadline it falls
    silent and the waiting ranks fail, naming it and `what` it was doing; a rank that dies stops
    beating at once. Wraps only calls that end, never a loop that waits on others."""
    live, stop = Liveness.current, threading.Event()
    if live is None:
        yield
        return
    live.post_doing(f"{what}, beaten for at most {live.io_deadline_s:g}s (--io-deadline, TLT_IO_DEADLINE: "
                    f"raise it if that call is only slow)")
    deadline = time.monotonic() + live.io_deadline_s

    def keep_beating():
        while not stop.wait(live.every_s / 2) and time.monotonic() < deadline:
            live.beat()
    thread = threading.Thread(target=keep_beating, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        live.post_doing("")


def _wait_watched(work):
    while not work.is_completed():
        time.sleep(0.001)
    work.wait()


def from_rank0(obj):
    """Rank 0's `obj` on every rank: decisions that must agree (load or warm up, resume) are taken once,
    so a file one rank sees and another does not cannot split them. The ranks wait for a late rank 0 by
    liveness, and with a Liveness the broadcast (maybe a whole checkpoint) runs in the waits' group,
    every rank beating and watching: slow fails nobody, a dead or hung peer is still caught."""
    if not multi_rank():
        return obj
    wait_for_all()
    live = Liveness.current
    if live is None:  # ranks joined without the rendezvous store: the default group and its timeout
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]
    rank0 = dist.get_rank() == 0
    if rank0:
        with beating("pickling the object it broadcasts (from_rank0)"):
            data = bytearray(pickle.dumps(obj))
    size = torch.tensor([len(data) if rank0 else 0])
    _wait_watched(Watched(dist.broadcast(size, 0, group=live.group, async_op=True), live, math.inf))
    buf = torch.frombuffer(data, dtype=torch.uint8) if rank0 else torch.empty(int(size), dtype=torch.uint8)
    _wait_watched(Watched(dist.broadcast(buf, 0, group=live.group, async_op=True), live, math.inf))
    return obj if rank0 else pickle.loads(buf.numpy().tobytes())
