"""The adaptive rollout engine: plain decoding while the batch is big, speculative in the tail.

One rollout generates every row of a rank's shard in one running batch:

    prefill all rows -> while rows remain:
        running batch > threshold  -> plain step (one token per row)
        running batch <= threshold -> the bandit picks k for this batch size;
                                      k = 0 is a plain step, k > 0 a speculative one
        drop the rows that finished (compaction: the batch and both caches shrink)

A speculative step verifies k + 1 tokens per row, so it pays only where a decoding step costs its
fixed overheads (kernel launches, weight reads), i.e. when the running batch is small. Where it
stops paying depends on the hardware, the drafter's acceptance and the batch size, so the engine
measures instead of guessing: an epsilon-greedy bandit per power-of-two batch size scores each k
by the tokens per second it delivered. The switch to speculation costs no second target pass: the
drafter catches up from the hidden states that the running batch records for every token, and
the same states go to the drafter's buffer.

The hot loop reads the device once per step (compaction's: which rows finished); the bandit's clock
and token count ride on that read.

Test: python -m pytest tests/test_rollout.py
"""
import random
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from speculative import DecodeStats, RunningBatch

ARMS = (0, 1, 2, 3, 4, 6, 8)


class Bandit:
    """Bucketed epsilon-greedy choice of the draft length k. An arm's score is its throughput over
    a short window, sum(tokens) / sum(seconds) (not a median of per-step rates: a step emits a small
    random count, whose median is biased). The window is short because the best arm moves as the
    drafter improves; an arm's first play only marks it tried, as it pays one-time costs."""

    def __init__(self, arms=ARMS, epsilon=0.1, window=8, seed=0):
        self.arms, self.epsilon, self.window = tuple(arms), epsilon, window
        self.rng = random.Random(seed)
        self.plays = {}  # (bucket, arm) -> deque of recent (tokens, seconds)

    @staticmethod
    def bucket(batch_size):
        return max(batch_size - 1, 0).bit_length()  # 1 -> 0, 2 -> 1, 3..4 -> 2, 5..8 -> 3, ...

    @staticmethod
    def bucket_sizes(bucket):
        """The batch sizes a bucket holds, for logs: 0 -> "1", 1 -> "2", 2 -> "3-4", ..."""
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
        """{bucket: best arm} over the scored arms, for the log."""
        scored = sorted({b for (b, a) in self.plays if self.score(b, a) is not None})
        return {b: max((a for a in self.arms if self.score(b, a) is not None),
                       key=lambda a: self.score(b, a)) for b in scored}

    def state_dict(self):
        return {"plays": [[b, a, list(r)] for (b, a), r in self.plays.items()],
                "rng": list(self.rng.getstate()[1]), "rng_version": self.rng.getstate()[0]}

    def load_state_dict(self, state):
        self.plays = {(b, a): deque(map(tuple, r), maxlen=self.window)
                      for b, a, r in state["plays"]}
        self.rng.setstate((state["rng_version"], tuple(state["rng"]), None))


def add_segment(segments, kind, start, end):
    """Timelines: one more [kind, start, end] segment, or the last one stretched to `end`."""
    if segments and segments[-1][0] == kind:
        segments[-1][2] = end
    else:
        segments.append([kind, start, end])


@dataclass
class RolloutStats(DecodeStats):
    """A rollout's DecodeStats plus its timing: seconds per phase, every step's batch size and
    seconds, the tail share, and the timeline's [kind, start, end] segments."""
    time: float = 0.0
    prefill_time: float = 0.0
    plain_time: float = 0.0
    spec_time: float = 0.0
    tail_share: float = 0.0
    batch_sizes: list = field(default_factory=list)
    step_times: list = field(default_factory=list)
    segments: list = field(default_factory=list)

    def end_step(self, step, now):
        """The step in flight, (batch size, k, start), ended at `now` (None: the prefill)."""
        if step is None:  # the prefill's first tokens are in; drawn as plain decoding
            self.prefill_time = now
            self.segments.append(["plain", 0.0, now])
            return
        batch_size, k, t0 = step
        self.batch_sizes.append(batch_size)
        self.step_times.append(now - t0)
        if k:
            self.spec_time += now - t0
        else:
            self.plain_time += now - t0
        add_segment(self.segments, "spec" if k else "plain", t0, now)


@torch.no_grad()
def rollout(target, drafter, prompts, max_new_tokens, *, sd_threshold=64, bandit=None,
            progress=None, **sampling):
    """Generate for every prompt -> (results, stats): results[i], row i's speculative.FinishedRow
    (tokens, hidden states, response), stats a RolloutStats. drafter None: plain decoding only.
    sampling: speculative.Sampling's fields by name; with "gumbel" the tokens depend on neither
    the drafter, the threshold nor the bandit. progress(batch): after the prefill and every step."""
    stats = RolloutStats()
    if not prompts:
        return [], stats
    bandit = bandit if bandit is not None else Bandit()
    max_draft = max(bandit.arms) if drafter is not None else 0
    t_start = time.perf_counter()
    batch = RunningBatch(target, prompts, max_new_tokens, max_draft=max_draft, **sampling)
    if progress:
        progress(batch)
    step = None  # the step in flight: (batch size, k, start)
    while True:
        B = batch.compact()  # sync: the step's one read, which waits for the step's kernels
        now = time.perf_counter() - t_start
        stats.end_step(step, now)
        if step is not None and step[1] is not None:  # score k on its tokens per second
            bandit.update(step[0], step[1], batch.written, now - step[2])
        if B == 0:
            break
        k = bandit.choose(B) if drafter is not None and B <= sd_threshold else None
        step = (B, k, now)
        if not k:  # above the threshold, or the bandit's k = 0
            n_emitted = batch.plain_step()
        else:
            n_emitted, n_acc = batch.speculative_step(drafter, k)
            stats.add_speculative(n_emitted, n_acc, k)
        stats.add_step(n_emitted)
        if progress:
            progress(batch)
    stats.settle()  # sync: the counts the steps left on the device, read once
    stats.time = time.perf_counter() - t_start
    stats.tail_share = tail_share(stats.batch_sizes, stats.step_times, stats.time, len(prompts))
    return batch.results, stats


def tail_share(batch_sizes, step_times, total_time, n_rows, done_frac=0.9):
    """The share of a rollout's time spent after `done_frac` of its rows had finished (the tail, as
    Seer measures it): a step that starts with at most (1 - done_frac) * n_rows rows is in it."""
    running_max = n_rows * (1 - done_frac) + 1e-9
    tail = sum(t for b, t in zip(batch_sizes, step_times) if b <= running_max)
    return tail / total_time if total_time > 0 else 0.0
