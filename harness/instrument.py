"""Every step of train.py's run, evaluation and the bench: what counts and times the core.

checksum (the ranks' drafters are identical), observers, DecodeStats and RolloutStats (what a
generate call or a rollout decoded, by draft position; a rollout's time, tail share, seconds by
batch size, timeline), liveness_observer, TimedDrafter. They reach the core only through what it
offers: the observer called after every decoding step, and a drafter with `propose`.

Test: python -m pytest tests/test_rollout.py tests/test_speculative.py
"""
import hashlib
import time
from dataclasses import dataclass, field

import torch

from rollout import Bandit


def checksum(module):
    """A short hash of every weight's bytes, read as uint8 in any dtype: equal across ranks means
    bit-identical weights (the drafters after their sync)."""
    h = hashlib.sha256()
    for p in module.parameters():
        h.update(p.detach().cpu().contiguous().flatten().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


def observers(*callbacks):
    """One observer (batch, step) that calls each of `callbacks` that is not None, in order."""
    callbacks = [c for c in callbacks if c is not None]

    def observe(batch, step):
        for c in callbacks:
            c(batch, step)
    return observe


def liveness_observer(beat):
    """The observer a run hands the core so that a long rollout still beats (liveness: slow, not
    dead)."""
    return lambda batch, step: beat()


@dataclass
class DecodeStats:
    """An observer that counts what a generate call or a rollout decoded (speculative.DecodeStep).
    The step's counts stay on the device until `settle()` reads them all at once, so counting adds
    no read to a decoding step. By draft position, as EAGLE-style papers report it:
    accepted_at[i] / drafted_at[i] is the chance that draft i + 1 is accepted given that the ones
    before it were."""
    steps: int = 0  # decoding steps (plain or speculative)
    tokens: int = 0  # tokens emitted by decoding steps, all rows
    sd_row_steps: int = 0  # (row, speculative step) pairs
    sd_tokens: int = 0  # tokens emitted by speculative steps
    drafted: int = 0  # draft tokens proposed
    accepted: int = 0  # draft tokens accepted
    accept_hist: dict = field(default_factory=dict)  # drafts accepted in one row-step -> count
    drafted_at: list = field(default_factory=list)  # per draft position: drafts decided there
    accepted_at: list = field(default_factory=list)  # per draft position: drafts accepted there
    steps_by_k: list = field(default_factory=list)  # per k: speculative steps that drafted k

    def __post_init__(self):
        self._pending = []  # steps whose device counts are not read yet

    def __call__(self, batch, step):
        if step is not None:  # None: the prefill
            self.steps += 1
            if step.k:
                self.sd_row_steps += step.batch_size
                self.drafted += step.k * step.batch_size
                self.steps_by_k += [0] * (step.k + 1 - len(self.steps_by_k))
                self.steps_by_k[step.k] += 1
            self._pending.append(step)

    def settle(self):
        """Read the pending device counts into the fields (one read); returns self."""
        if not self._pending:
            return self
        flat = [t for s in self._pending for t in (s.n_emitted, s.n_accepted) if t is not None]
        values, i = torch.cat(flat).tolist(), 0  # sync: one read for all the steps
        for s in self._pending:
            n_emitted, i = values[i:i + s.batch_size], i + s.batch_size
            self.tokens += sum(n_emitted)
            if not s.k:
                continue
            n_acc, i = values[i:i + s.batch_size], i + s.batch_size
            self.sd_tokens += sum(n_emitted)
            self.accepted += sum(n_acc)
            for a in n_acc:
                self.accept_hist[a] = self.accept_hist.get(a, 0) + 1
            self._count_positions(n_emitted, n_acc, s.k)
        self._pending = []
        return self

    def _count_positions(self, n_emitted, n_acc, k):
        """A row keeps its accepted drafts, then the target's token; where it ended on an accepted
        draft (n_emitted <= n_acc) the drafts after it were never decided."""
        grow = k - len(self.drafted_at)
        self.drafted_at += [0] * grow
        self.accepted_at += [0] * grow
        for emitted, acc in zip(n_emitted, n_acc):
            used = min(acc, emitted)
            for i in range(used):
                self.drafted_at[i] += 1
                self.accepted_at[i] += 1
            if emitted > acc and used < k:  # its first rejection was decided too
                self.drafted_at[used] += 1

    @property
    def accept_len(self):  # tokens per row per verify step: accepted drafts plus the target's
        self.settle()
        return self.sd_tokens / self.sd_row_steps if self.sd_row_steps else None


@dataclass
class RolloutStats(DecodeStats):
    """A rollout's DecodeStats plus its timing, on a clock started when it is made (make it just
    before the rollout): every step's batch size, seconds and whether it was speculative, and the
    timeline's [kind, start, end] segments. `finish(n_rows)` stops the clock and sets the tail
    share and the seconds by batch size."""
    time: float = 0.0
    prefill_time: float = 0.0
    tail_share: float = 0.0
    batch_sizes: list = field(default_factory=list)
    step_times: list = field(default_factory=list)
    spec_steps: list = field(default_factory=list)  # per step: whether it was speculative
    segments: list = field(default_factory=list)
    by_batch: dict = field(default_factory=dict)  # set by finish: seconds_by_batch's

    def __post_init__(self):
        super().__post_init__()
        self.started = self._last = time.perf_counter()

    def __call__(self, batch, step):
        super().__call__(batch, step)
        now = time.perf_counter()
        start, end, self._last = self._last - self.started, now - self.started, now
        if step is None:  # the prefill: drawn as plain decoding
            self.prefill_time = end
            self.segments.append(["plain", 0.0, end])
            return
        self.batch_sizes.append(step.batch_size)
        self.step_times.append(end - start)
        self.spec_steps.append(bool(step.k))
        kind = "spec" if step.k else "plain"
        if self.segments and self.segments[-1][0] == kind:
            self.segments[-1][2] = end
        else:
            self.segments.append([kind, start, end])

    def finish(self, n_rows, end=None):
        """The rollout of n_rows rows returned at time.perf_counter() `end` (default now): set its
        time, tail share and seconds by batch size (the prefill's at n_rows); returns self."""
        self.settle()
        self.time = (end or time.perf_counter()) - self.started
        self.tail_share = tail_share(self.batch_sizes, self.step_times, self.time, n_rows)
        prefill = [(n_rows, self.prefill_time, False)] if n_rows else []
        steps = zip(self.batch_sizes, self.step_times, self.spec_steps)
        self.by_batch = seconds_by_batch(prefill + list(steps))
        return self


def seconds_by_batch(steps):
    """A rollout's seconds by running-batch size in the bandit's buckets (1, 2, 3-4, 5-8, ...),
    plain and speculative steps apart -> {"plain": [...], "spec": [...]}, one entry per bucket up
    to the largest batch's. steps: [(batch size, seconds, speculative)]."""
    n = max((Bandit.bucket(b) + 1 for b, _, _ in steps), default=0)
    out = {"plain": [0.0] * n, "spec": [0.0] * n}
    for b, t, spec in steps:
        out["spec" if spec else "plain"][Bandit.bucket(b)] += t
    return out


def tail_share(batch_sizes, step_times, total_time, n_rows, done_frac=0.9):
    """The share of a rollout's time spent after `done_frac` of its rows had finished (the tail, as
    Seer measures it): a step that starts with at most (1 - done_frac) * n_rows rows is in it."""
    running_max = n_rows * (1 - done_frac) + 1e-9
    tail = sum(t for b, t in zip(batch_sizes, step_times) if b <= running_max)
    return tail / total_time if total_time > 0 else 0.0


class TimedDrafter:
    """A drafter that times its proposals without a sync per proposal: CUDA events on a GPU, read
    once by `seconds()`; the host clock on a CPU. `lap()`: the seconds since the last lap (a run
    reads it once per RL step)."""

    def __init__(self, drafter, device):
        self.drafter, self.cuda = drafter, device.type == "cuda"
        self.events, self.total, self.lapped = [], 0.0, 0.0

    def propose(self, batch, k, noise=None):
        if not self.cuda:
            t0 = time.perf_counter()
            out = self.drafter.propose(batch, k, noise)
            self.total += time.perf_counter() - t0
            return out
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        out = self.drafter.propose(batch, k, noise)
        end.record()
        self.events.append((start, end))
        return out

    def seconds(self):
        if self.events:
            self.events[-1][1].synchronize()  # sync: once, for every proposal's events
            self.total += sum(a.elapsed_time(b) for a, b in self.events) / 1000
            self.events = []
        return self.total

    def lap(self):
        before, self.lapped = self.lapped, self.seconds()
        return self.lapped - before
