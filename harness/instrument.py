"""Instruments: what checks, counts or times the core from outside it. A learner may skip this file.

    checksum                   a hash of a module's weights: the ranks' drafters are identical
    DecodeStats, RolloutStats  what a generate call or a rollout decoded, by draft position, and
                               (a rollout) its timing, tail share, seconds by batch size and
                               timeline: observers
    HostTraffic, host_traffic  the reads and copies a GPU would pay, counted on any device
    count_syncs                the syncs a GPU itself reports per speculative step
    Stopwatch, TimedDrafter    time spent in one region (drafting) without a sync per visit
    DEBUG, BatchChecker        TLT_DEBUG=1: the invariants the running batch relies on, every step
    check                      one such invariant (the sibling lookup states its own)

They reach the core through what it offers: a dispatch mode around a rollout, the observer that
the generate functions and the rollout call after every step, a drafter with `propose`.

Test: python -m pytest tests/test_rollout.py tests/test_speculative.py
"""
import contextlib
import hashlib
import os
import time
import warnings
from dataclasses import asdict, dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from rollout import Bandit, rollout
from speculative import RunningBatch

DEBUG = os.environ.get("TLT_DEBUG") == "1"


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
    return lambda batch, step: [c(batch, step) for c in callbacks] and None


@dataclass
class DecodeStats:
    """An observer that counts what a generate call or a rollout decoded, summed over its steps
    (speculative.DecodeStep). The device's counts stay there until `settle()` reads them all at once. By
    draft position, as EAGLE-style papers report it: accepted_at[i] / drafted_at[i] is the chance
    that draft i + 1 is accepted given the ones before it were."""
    steps: int = 0  # decoding steps (plain or speculative)
    tokens: int = 0  # tokens emitted by decoding steps, all rows
    sd_row_steps: int = 0  # (row, speculative step) pairs
    sd_tokens: int = 0  # tokens emitted by speculative steps
    drafted: int = 0  # draft tokens proposed
    accepted: int = 0  # draft tokens accepted
    accept_hist: dict = field(default_factory=dict)  # drafts accepted in one row-step -> count
    drafted_at: list = field(default_factory=list)  # per draft position: drafts decided there
    accepted_at: list = field(default_factory=list)  # per draft position: drafts accepted there
    by_row: dict = field(default_factory=dict)  # a row (its index in the prompts) -> [decided, accepted]
    steps_by_k: list = field(default_factory=list)  # per k: the speculative steps that drafted k a row

    def __post_init__(self):
        self._pending = []  # the steps whose device counts are not read yet, each with its rows
        self._rows = None  # the original row of each slot, as the next step finds them

    def __call__(self, batch, step):
        if step is not None:  # not the prefill
            self.steps += 1
            if step.k:
                self.sd_row_steps += step.batch_size
                self.drafted += step.k * step.batch_size
                self.steps_by_k += [0] * (step.k + 1 - len(self.steps_by_k))
                self.steps_by_k[step.k] += 1
            self._pending.append((step, self._rows))
        # references only, read in `settle`: compact replaces `running` rather than changing it
        self._rows = None if batch is None else batch.ids

    def settle(self):
        """Read the pending device counts into the fields (one read); returns self."""
        if not self._pending:
            return self
        flat = [t for s, _ in self._pending for t in (s.n_emitted, s.n_accepted) if t is not None]
        values, i = torch.cat(flat).tolist(), 0  # sync: one read
        for s, rows in self._pending:
            n_emitted, i = values[i:i + s.batch_size], i + s.batch_size
            self.tokens += sum(n_emitted)
            if not s.k:
                continue
            n_acc, i = values[i:i + s.batch_size], i + s.batch_size
            self.sd_tokens += sum(n_emitted)
            self.accepted += sum(n_acc)
            for a in n_acc:
                self.accept_hist[a] = self.accept_hist.get(a, 0) + 1
            self._count_positions(n_emitted, n_acc, s.k, rows or [])
        self._pending = []
        return self

    def _count_positions(self, n_emitted, n_acc, k, rows):
        """A row keeps its accepted drafts, then the target's token; where it ended on an accepted
        draft (n_emitted <= n_acc) the drafts after it were never decided. rows: each slot's original
        row (empty when the batch was not given)."""
        grow = k - len(self.drafted_at)
        if grow > 0:
            self.drafted_at += [0] * grow
            self.accepted_at += [0] * grow
        for b, (emitted, acc) in enumerate(zip(n_emitted, n_acc)):
            used = min(acc, emitted)
            for i in range(used):
                self.drafted_at[i] += 1
                self.accepted_at[i] += 1
            decided = used + (emitted > acc and used < k)  # went on: its first rejection was decided
            if decided > used:
                self.drafted_at[used] += 1
            if rows:
                counts = self.by_row.setdefault(rows[b], [0, 0])
                counts[0] += decided
                counts[1] += used

    @property
    def accept_len(self):  # tokens per row per verify step: accepted drafts plus the target's
        self.settle()
        return self.sd_tokens / self.sd_row_steps if self.sd_row_steps else None

    @property
    def accept_rate(self):  # accepted drafts per drafted token
        self.settle()
        return self.accepted / self.drafted if self.drafted else None

    @property
    def accept_by_position(self):  # per draft position: accepted given the earlier ones were
        self.settle()
        return [a / d if d else None for a, d in zip(self.accepted_at, self.drafted_at)]

    def as_dict(self):
        self.settle()
        return {**asdict(self), "accept_hist": dict(sorted(self.accept_hist.items())),
                "accept_len": self.accept_len, "accept_rate": self.accept_rate,
                "accept_by_position": self.accept_by_position}


def add_segment(segments, kind, start, end):
    """Timelines: one more [kind, start, end] segment, or the last one stretched to `end`."""
    if segments and segments[-1][0] == kind:
        segments[-1][2] = end
    else:
        segments.append([kind, start, end])


@dataclass
class RolloutStats(DecodeStats):
    """A rollout's DecodeStats plus its timing, from the observer's own clock, started when it is
    made (make it just before the rollout; the steps' ends are after compaction's read, so the
    clock waits for the device): seconds per phase, every step's batch size, seconds and whether it
    was speculative, and the timeline's [kind, start, end] segments. `finish(n_rows)` ends the clock
    and sets the tail share and the seconds by batch size."""
    time: float = 0.0
    prefill_time: float = 0.0
    plain_time: float = 0.0
    spec_time: float = 0.0
    tail_share: float = 0.0
    draft_time: float = 0.0  # spent drafting, set by its caller (a TimedDrafter's seconds)
    batch_sizes: list = field(default_factory=list)
    step_times: list = field(default_factory=list)
    spec_steps: list = field(default_factory=list)  # per step: whether it was speculative
    segments: list = field(default_factory=list)
    by_batch: dict = field(default_factory=dict)  # set by finish: seconds_by_batch's

    def __post_init__(self):
        super().__post_init__()
        self.started = self._last = time.perf_counter()  # the clock's zero

    def __call__(self, batch, step):
        super().__call__(batch, step)
        now = time.perf_counter()
        start, end, self._last = self._last - self.started, now - self.started, now
        if step is None:  # the prefill's first tokens are in; drawn as plain decoding
            self.prefill_time = end
            self.segments.append(["plain", 0.0, end])
            return
        self.batch_sizes.append(step.batch_size)
        self.step_times.append(end - start)
        self.spec_steps.append(bool(step.k))
        if step.k:
            self.spec_time += end - start
        else:
            self.plain_time += end - start
        add_segment(self.segments, "spec" if step.k else "plain", start, end)

    def finish(self, n_rows, end=None):
        """The rollout has returned (at time.perf_counter() `end`, default now): its time, its tail
        share over its n_rows rows, its seconds by batch size (the prefill's at all n_rows); returns
        self."""
        self.settle()  # sync: the counts the steps left on the device, read once
        self.time = (end or time.perf_counter()) - self.started
        self.tail_share = tail_share(self.batch_sizes, self.step_times, self.time, n_rows)
        prefill = [(n_rows, self.prefill_time, False)] if n_rows else []  # plain, at the full batch size
        self.by_batch = seconds_by_batch(prefill + list(zip(self.batch_sizes, self.step_times, self.spec_steps)))
        return self


def seconds_by_batch(steps):
    """A rollout's seconds by running-batch size, in the bandit's buckets (rollout.Bandit.bucket: 1,
    2, 3-4, 5-8, ...), plain and speculative steps apart -> {"plain": [...], "spec": [...]}, one
    entry per bucket up to the largest batch's: where the time goes as the batch drains.
    steps: [(batch size, seconds, speculative)]."""
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


def check(ok, what):
    """An invariant check, made where `DEBUG` is on (callers test `instrument.DEBUG` first, so off
    it costs nothing): ok, a bool or a bool tensor, must hold everywhere. Reading a tensor is a
    sync: debug runs only."""
    if not bool(torch.as_tensor(ok).all()):
        raise AssertionError(f"invariant broken: {what}")


class BatchChecker:
    """An observer that checks, after every step, what a RunningBatch's steps rely on:
    1. every row's tokens and cached keys stay with it from one call to the next (compaction moves
       a row's keys with its tokens);
    2. the target cache holds every row's tokens but the pending one: lengths == n_tokens - 1;
    3. the drafter's cache has read no state the target has not recorded: lengths <= n_tokens - 1.
    Each check reads the device: debug runs only."""

    def __init__(self, then=None):
        self.then, self.batch = then, None  # then: a callback to run after (liveness's beat)

    def __call__(self, batch, step=None):
        if batch is not self.batch:  # a new batch: its rows are new
            self.batch, self.seen = batch, {}
        n = batch.n_tokens
        keys = batch.cache.kv[0, 0, :, 0, :, 0]  # (B, max_len): layer 0, keys, head 0, channel 0
        for b, row in enumerate(batch.ids):
            if row in self.seen:
                tokens, k = self.seen[row]
                check(torch.equal(batch.tokens[b, :len(tokens)], tokens)
                      and torch.equal(keys[b, :len(k)], k), "compaction moves every row's cache keys with its tokens")
            L = int(n[b]) - 1
            self.seen[row] = batch.tokens[b, :L + 1].clone(), keys[b, :L].clone()
        check(torch.equal(batch.cache.lengths, n - 1), "the target cache holds n_tokens - 1 positions")
        check(batch.draft_cache is None or bool((batch.draft_cache.lengths <= n - 1).all()),
              "the drafter has read only recorded states")
        if self.then:
            self.then(batch, step)


def liveness_observer(beat=None):
    """The observer a run gives the core: liveness's beat (slow, not dead), and under TLT_DEBUG=1
    the running batch's invariants after every step."""
    step = (lambda batch, step: beat()) if beat else None
    return BatchChecker(then=step) if DEBUG else step


class Stopwatch:
    """The time spent in one region of code, summed over its visits, without a sync per visit:
    CUDA events on a GPU, read once by `seconds()`; the host clock on a CPU."""

    def __init__(self, device):
        self.cuda, self.spans, self.total = device.type == "cuda", [], 0.0

    @contextlib.contextmanager
    def __call__(self):
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self.spans.append((start, end))
        else:
            t0 = time.perf_counter()
            yield
            self.total += time.perf_counter() - t0

    def seconds(self):
        if self.spans:
            self.spans[-1][1].synchronize()  # sync: once, for every visit's events
            self.total += sum(a.elapsed_time(b) for a, b in self.spans) / 1000
            self.spans = []
        return self.total


class TimedDrafter:
    """A drafter that times its proposals: what it has spent drafting (`seconds()`), and since the
    last lap (`lap()`: a run makes one and reads it once per RL step)."""

    def __init__(self, drafter, device):
        self.drafter, self.watch, self.lapped = drafter, Stopwatch(device), 0.0

    def propose(self, batch, k, noise=None):
        with self.watch():
            return self.drafter.propose(batch, k, noise)

    def seconds(self):
        return self.watch.seconds()

    def lap(self):
        before, self.lapped = self.lapped, self.seconds()
        return self.lapped - before


class HostTraffic(TorchDispatchMode):
    """Counts, while active, what makes the host wait for a GPU (reads) and what copies host data to
    it (copies), in segments: `mark()` ends one and starts the next (as the rollout's observer, it
    marks the prefill and every decoding step, each with its compaction). It counts operations by what they mean, not by what the
    device at hand does, so a run on a CPU, where host and device are one, counts what the same run
    would pay on a GPU.

    reads (device -> host: the host waits for every kernel queued before it):
      aten._local_scalar_dense (item(), int(t), float(t), bool(t), `if t:`), aten.equal (torch.equal
      returns a Python bool); ops whose output size depends on values (nonzero, unique, masked_select,
      indexing with a boolean mask); Tensor.tolist, .cpu and .numpy, counted where they are called (on
      a CPU they dispatch nothing), whatever they dispatch inside not counted again.
    copies (host -> device):
      aten.lift_fresh, a tensor made from Python data (torch.tensor(list), torch.as_tensor(list),
      indexing with a Python list), unless it is a 0-d CPU tensor (a Python scalar, which a kernel takes
      as an argument); aten._to_copy of a CPU tensor to another device (a GPU run only).
    Not seen on a CPU: .to(device) of a CPU tensor (nothing is dispatched; on a GPU run it is the
    _to_copy above). torch.cuda.synchronize is not an op: rollout() calls none; `count_syncs` counts
    what a GPU itself reports."""
    READS = {"_local_scalar_dense", "equal", "nonzero", "_unique2", "unique_dim", "unique_consecutive", "masked_select"}
    HOST_CALLS = ("tolist", "cpu", "numpy")

    def __init__(self):
        super().__init__()
        self.segments = [[]]  # per segment, the (kind, op) of every read and copy, in order
        self._inside = 0  # > 0 inside a counted Tensor.tolist/cpu/numpy

    def mark(self):
        self.segments.append([])

    def counts(self, kind):
        """How many reads ("read") or copies ("copy") each segment made."""
        return [sum(k == kind for k, _ in seg) for seg in self.segments]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not self._inside:
            t = args[0] if args and torch.is_tensor(args[0]) else None
            if name in self.READS or (name in ("index", "index_put", "index_put_") and any(
                    i is not None and i.dtype == torch.bool for i in args[1])):
                self.segments[-1].append(("read", name))
            elif name == "lift_fresh" and (t.dim() > 0 or t.device.type != "cpu"):
                self.segments[-1].append(("copy", name))
            elif name == "_to_copy" and t.device.type == "cpu" and (kwargs.get("device") or t.device).type != "cpu":
                self.segments[-1].append(("copy", name))
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        self._real = {name: getattr(torch.Tensor, name) for name in self.HOST_CALLS}
        for name, real in self._real.items():
            setattr(torch.Tensor, name, self._counted(name, real))
        return super().__enter__()

    def __exit__(self, *exc):
        for name, real in self._real.items():
            setattr(torch.Tensor, name, real)
        return super().__exit__(*exc)

    def _counted(self, name, real):
        def call(t, *args, **kwargs):
            if not self._inside:
                self.segments[-1].append(("read", name))
            self._inside += 1
            try:
                return real(t, *args, **kwargs)
            finally:
                self._inside -= 1
        return call


def host_traffic(target, drafter, prompts, max_new_tokens, **kwargs):
    """One rollout(target, drafter, prompts, max_new_tokens, **kwargs) under a HostTraffic, a segment
    per decoding step, the prefill and the end apart. Prints a line; returns its reads and copies."""
    counter, stats = HostTraffic(), DecodeStats()
    with counter:
        rollout(target, drafter, prompts, max_new_tokens,
                observer=observers(stats, lambda batch, step: counter.mark()), **kwargs)
    (r0, *reads, r_end), (c0, *copies, c_end) = counter.counts("read"), counter.counts("copy")
    out = {"steps": len(reads), "sd_row_steps": stats.sd_row_steps, "reads_per_step":
           sum(reads) / len(reads), "max_reads_in_a_step": max(reads), "copies_in_steps": sum(copies),
           "prefill": {"reads": r0, "copies": c0}, "end": {"reads": r_end, "copies": c_end}}
    print(f"host-device traffic of a {len(prompts)}-row rollout, as a GPU would pay it (rollout.HostTraffic): "
          f"{out['reads_per_step']:.2f} reads per decoding step (at most {max(reads)}), {sum(copies)} copies from the "
          f"host over its {len(reads)} steps; the prefill {r0} reads, {c0} copies; the end {r_end} reads")
    return out


@torch.no_grad()
def count_syncs(model, drafter, batch_size=1, k=4, steps=8, sampler="gumbel"):
    """Host-device round trips per speculative step and per compaction, counted on a GPU by
    torch.cuda.set_sync_debug_mode("warn"), which warns once per synchronizing call. The rows run
    to the length limit (no <|eos|>), after one unmeasured step that fills the drafter's cache.
    Prints the counts and returns {"step": syncs per speculative step, "compact": per compact()};
    on a CPU prints "n/a on CPU" and returns None (HostTraffic counts what they would be)."""
    if model.wte.weight.device.type != "cuda":
        print("host-device syncs per speculative step: n/a on CPU")
        return None
    prompts = [[1 + b % 7, 2, 3, 4, 5] for b in range(batch_size)]
    max_new = min((steps + 1) * (k + 1), model.config.block_size - 5 - k)
    batch = RunningBatch(model, prompts, max_new, max_draft=k, sampler=sampler,
                         generator=torch.Generator(device=model.wte.weight.device).manual_seed(0))
    batch.compact()
    batch.speculative_step(drafter, k)
    batch.compact()
    torch.cuda.synchronize()
    counts, n = {"step": 0, "compact": 0}, 0
    before = torch.cuda.get_sync_debug_mode()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            while n < steps and batch.batch_size:
                for name, fn in (("step", lambda: batch.speculative_step(drafter, k)), ("compact", batch.compact)):
                    seen = len(caught)
                    fn()
                    counts[name] += len(caught) - seen
                n += 1
        finally:
            torch.cuda.set_sync_debug_mode(before)
    out = {name: c / max(n, 1) for name, c in counts.items()}
    print(f"host-device syncs at batch {batch_size}, k = {k} ({sampler}), over {n} steps: "
          f"{out['step']:.1f} per speculative step, {out['compact']:.1f} per compaction")
    return out
