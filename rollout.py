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

Test: python -m pytest tests/test_rollout.py
"""
import random
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from common import add_segment, sync
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
    progress, when given, is called after every decoding step (liveness.beat: this rank
    is slow, not dead)."""
    device = target.wte.weight.device
    stats = RolloutStats()
    if not prompts:
        return [], stats
    use_sd = tlt and drafter is not None
    bandit = bandit if bandit is not None else Bandit()
    t_start = time.perf_counter()
    batch = RunningBatch(target, prompts, max_new_tokens, temperature=temperature, eos_id=eos_id, generator=generator,
                         max_draft=max(bandit.arms) if use_sd else 0, sampler=sampler, keys=keys)
    sync(device)
    stats.prefill_time = time.perf_counter() - t_start
    stats.segments.append(["plain", 0.0, stats.prefill_time])  # the prefill is drawn as plain decoding
    while batch.compact() > 0:
        B = batch.batch_size
        k = bandit.choose(B) if use_sd and B <= sd_threshold else 0
        t0 = time.perf_counter()
        if k == 0:
            n_emitted = batch.plain_step()
        else:
            n_emitted, n_acc = batch.speculative_step(drafter, k)
            stats.add_speculative(n_emitted, n_acc, k)
        sync(device)
        t1 = time.perf_counter()
        if progress:
            progress()
        if use_sd and B <= sd_threshold:  # sync: the bandit scores k by this step's tokens per second, on the host
            bandit.update(B, k, int(n_emitted.sum()), t1 - t0)
        stats.add_step(n_emitted)
        stats.batch_sizes.append(B)
        stats.step_times.append(t1 - t0)
        if k:
            stats.spec_time += t1 - t0
        else:
            stats.plain_time += t1 - t0
        add_segment(stats.segments, "spec" if k else "plain", t0 - t_start, t1 - t_start)
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
