"""The adaptive rollout engine: plain decoding while the batch is big, speculative in the tail.

One rollout generates every row of a rank's shard in one running batch:

    prefill all rows -> while rows remain:
        running batch > threshold  -> plain step (one token per row)
        running batch <= threshold -> the bandit picks k for this batch size; k = 0 is a plain step,
                                      k > 0 a speculative step with k drafts
        drop the rows that finished (compaction: the batch and both caches really shrink)

Why a threshold and a bandit. A speculative step verifies k+1 tokens per row, so it multiplies
the target's work by about k+1 and pays only where decoding is bound by fixed per-step costs
(kernel launches, weight reads), i.e. when the running batch is small. Where exactly it stops
paying depends on the hardware, on the drafter's current acceptance and on the batch size, so
the engine measures instead of guessing: a bucketed epsilon-greedy bandit with arms
k in {0, 1, 2, 3, 4, 6, 8}, one bucket per power-of-two batch size, unscored arms first. Each step
reports the tokens it emitted and the seconds it took; an arm's score is the throughput over its
sliding window, sum(tokens) / sum(seconds). Not the median of per-step tokens/s: at small batch a
speculative step emits a small random number of tokens (1 to k+1 per row), and the median of such
a count is biased, so it can rank arms unlike their throughput (a short draft that often emits
its few tokens can beat, on the median, a long one that emits more on average). Its state
persists across RL steps and is saved in checkpoints.

The switch to speculative decoding fills the drafter's cache from the target hidden states that
RunningBatch has recorded for every token (see speculative.py): no second target pass. Those same
states, exactly aligned with the tokens in both kinds of step, go to the drafter buffer.

The hot loop's budget: one read of the device per step, compaction's (which rows finished), and no
copy from the host. The bandit's clock and token count ride on that read (the host clock at a read
that waited for the step; the rows' lengths it brings), so timing adds no sync. `HostTraffic`
counts reads and copies as a GPU would pay them, on any device; `host_traffic` reports them for a
rollout (bench.py prints it), `count_syncs` what a GPU itself reports.

Test: python -m pytest tests/test_rollout.py
"""
import random
import time
import warnings
from collections import deque
from dataclasses import dataclass, field

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from common import add_segment
from speculative import DecodeStats, RunningBatch

ARMS = (0, 1, 2, 3, 4, 6, 8)


class Bandit:
    """Bucketed epsilon-greedy choice of the draft length k.

    An arm's first play in a bucket only marks it tried: it pays for first-time costs (allocations,
    CUDA's lazy initialisation) that would weigh on the arm's score for a whole window. The window
    is short (8 plays) because the best arm moves: a drafter that improves during RL makes long
    drafts pay where they did not, and exploration (epsilon) is what refreshes an arm not played."""

    def __init__(self, arms=ARMS, epsilon=0.1, window=8, seed=0):
        self.arms, self.epsilon, self.window = tuple(arms), epsilon, window
        self.rng = random.Random(seed)
        self.plays = {}  # (bucket, arm) -> deque of recent (tokens, seconds); empty after the first play

    @staticmethod
    def bucket(batch_size):
        return max(batch_size - 1, 0).bit_length()  # 1 -> 0, 2 -> 1, 3..4 -> 2, 5..8 -> 3, ...

    @staticmethod
    def bucket_sizes(bucket):
        """The batch sizes a bucket holds, for logs: 0 -> "1", 1 -> "2", 2 -> "3-4", 3 -> "5-8", ..."""
        return str(2 ** bucket) if bucket < 2 else f"{2 ** (bucket - 1) + 1}-{2 ** bucket}"

    def score(self, bucket, arm):
        r = self.plays.get((bucket, arm))
        return sum(n for n, _ in r) / sum(t for _, t in r) if r else None  # tokens per second

    def choose(self, batch_size):
        b = self.bucket(batch_size)
        unscored = [a for a in self.arms if self.score(b, a) is None]
        if unscored:
            return unscored[0]
        if self.rng.random() < self.epsilon:
            return self.rng.choice(self.arms)
        return max(self.arms, key=lambda a: self.score(b, a))

    def update(self, batch_size, arm, tokens, seconds):
        key = (self.bucket(batch_size), arm)
        if key not in self.plays:  # the first play: tried, not scored
            self.plays[key] = deque(maxlen=self.window)
        else:
            self.plays[key].append((float(tokens), max(float(seconds), 1e-9)))

    def best(self):
        """{bucket: best arm} for the log, over the scored arms."""
        buckets = sorted({b for (b, a) in self.plays if self.score(b, a) is not None})
        return {b: max((a for a in self.arms if self.score(b, a) is not None), key=lambda a: self.score(b, a))
                for b in buckets}

    def state_dict(self):
        return {"plays": [[b, a, list(r)] for (b, a), r in self.plays.items()],
                "rng": list(self.rng.getstate()[1]), "rng_version": self.rng.getstate()[0]}

    def load_state_dict(self, state):
        self.plays = {(b, a): deque(map(tuple, r), maxlen=self.window) for b, a, r in state["plays"]}
        self.rng.setstate((state["rng_version"], tuple(state["rng"]), None))


@dataclass
class RolloutStats(DecodeStats):
    """A rollout's DecodeStats plus its timing: seconds per phase, the running batch size and the
    seconds of every step, the tail share, and the timeline segments [kind, start, end]."""
    time: float = 0.0
    prefill_time: float = 0.0
    plain_time: float = 0.0
    spec_time: float = 0.0
    draft_time: float = 0.0  # of spec_time, in the drafter
    tail_share: float = 0.0
    batch_sizes: list = field(default_factory=list)
    step_times: list = field(default_factory=list)
    segments: list = field(default_factory=list)


@torch.no_grad()
def rollout(target, drafter, prompts, max_new_tokens, *, temperature=1.0, eos_id=None, generator=None,
            tlt=True, sd_threshold=64, bandit=None, sampler="rejection", keys=None, progress=None):
    """Generate for every prompt. Returns (results, stats) where results[i] is a speculative.Sample
    (response ids, tokens (N,), hidden states (N-1, C), prompt_len) and stats a RolloutStats
    (timeline segments relative to the call; the tail share: see `tail_share`).
    sampler and keys: see speculative.RunningBatch; with "gumbel", the tokens do not depend on
    tlt, the threshold or the bandit's choices (up to float32 rounding: see speculative.py).
    progress, when given, is called after the prefill and after every decoding step (liveness.beat:
    this rank is slow, not dead).

    One read of the device per step, compact's (which rows finished): it waits for everything queued
    before it, so the host clock at that read ends the step before it (compaction included), and the
    bandit's tokens come with it (RunningBatch.emitted): timing adds no sync and no read."""
    stats = RolloutStats()
    if not prompts:
        return [], stats
    use_sd = tlt and drafter is not None
    bandit = bandit if bandit is not None else Bandit()
    t_start = time.perf_counter()
    batch = RunningBatch(target, prompts, max_new_tokens, temperature=temperature, eos_id=eos_id, generator=generator,
                         max_draft=max(bandit.arms) if use_sd else 0, sampler=sampler, keys=keys)
    if progress:
        progress()
    step = None  # the step in flight: (batch size, k, start)
    while True:
        B = batch.compact()  # sync: the step's one read
        now = time.perf_counter() - t_start
        if step is None:  # the prefill's first tokens are in; it is drawn as plain decoding
            stats.prefill_time = now
            stats.segments.append(["plain", 0.0, now])
        else:  # the step before this read is over: time it, and score its k on its tokens per second
            B_step, k, t0 = step
            if use_sd and B_step <= sd_threshold:
                bandit.update(B_step, k, batch.emitted, now - t0)
            stats.batch_sizes.append(B_step)
            stats.step_times.append(now - t0)
            if k:
                stats.spec_time += now - t0
            else:
                stats.plain_time += now - t0
            add_segment(stats.segments, "spec" if k else "plain", t0, now)
        if B == 0:
            break
        k = bandit.choose(B) if use_sd and B <= sd_threshold else 0
        step = (B, k, now)
        if k == 0:
            n_emitted = batch.plain_step()
        else:
            n_emitted, n_acc = batch.speculative_step(drafter, k)
            stats.add_speculative(n_emitted, n_acc, k)
        stats.add_step(n_emitted)
        if progress:
            progress()
    stats.settle()  # sync: the counts the steps left on the device, read once
    stats.draft_time = batch.drafting.seconds()
    stats.time = time.perf_counter() - t_start
    stats.tail_share = tail_share(stats.batch_sizes, stats.step_times, stats.time, len(prompts))
    return batch.results, stats


def tail_share(batch_sizes, step_times, total_time, n_rows, done_frac=0.9):
    """The share of a rollout's time spent after `done_frac` of its rows had finished (the tail,
    as Seer measures it): with long-tailed lengths a few rows keep the whole rank busy. A step
    that starts with at most (1 - done_frac) * n_rows rows still running is in the tail."""
    running_max = n_rows * (1 - done_frac) + 1e-9
    tail = sum(t for b, t in zip(batch_sizes, step_times) if b <= running_max)
    return tail / total_time if total_time > 0 else 0.0


# -----------------------------------------------------------------------------
# acceptance by draft position, summed over ranks and over steps

def position_counts(stats, k_max):
    """A rollout's drafts decided and accepted at each draft position 1..k_max, as {name: count}
    (distributed.all_sum's form; DecodeStats has the meaning)."""
    pad = lambda v: v + [0] * (k_max - len(v))  # noqa: E731
    return {**{f"drafted_at{i}": v for i, v in enumerate(pad(stats.drafted_at))},
            **{f"accepted_at{i}": v for i, v in enumerate(pad(stats.accepted_at))}}


def by_position(records):
    """Acceptance at each draft position summed over records (metrics.jsonl's, with their
    `drafted_at` and `accepted_at`) -> ([rates or None], [drafts decided])."""
    drafted = [sum(c) for c in zip(*(r["drafted_at"] for r in records))]
    accepted = [sum(c) for c in zip(*(r["accepted_at"] for r in records))]
    return [a / d if d else None for a, d in zip(accepted, drafted)], drafted


def format_positions(rates):
    """Rates by position as percentages for a log line; '-' where no draft was decided."""
    return " ".join("  -  " if r is None else f"{100 * r:4.1f}" for r in rates)


# -----------------------------------------------------------------------------
# host-device traffic, counted as a GPU would pay it

class HostTraffic(TorchDispatchMode):
    """Counts, while active, what makes the host wait for a GPU (reads) and what copies host data to
    it (copies), in segments: `mark()` ends one and starts the next (rollout's `progress` hook marks
    the prefill and every decoding step). It counts operations by what they mean, not by what the
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
    counter = HostTraffic()
    with counter:
        _, stats = rollout(target, drafter, prompts, max_new_tokens, progress=counter.mark, **kwargs)
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
