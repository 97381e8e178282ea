"""The adaptive rollout engine: speculative decoding where it pays, in the tail of small batches.

One rollout generates every row of a rank's shard in one running batch:

    prefill each distinct prompt once, copy it to its rows -> while rows remain:
        running batch > threshold  -> plain step (none at train.py's default, above a rank's rows)
        running batch <= threshold -> the bandit picks k for this batch size;
                                      k = 0 is a plain step, k > 0 a speculative one
        drop the rows that finished (compaction: the batch and both caches shrink)

A speculative step verifies k + 1 tokens per row, so it pays only where a decoding step costs mostly
its fixed overheads (kernel launches, weight reads): when the running batch is small. Where it stops
paying depends on the hardware, the drafter's acceptance and the batch size, so the engine measures
instead of guessing. An epsilon-greedy bandit per power-of-two batch size scores each k by the
tokens per second it delivered. The switch to speculation costs no second target pass: the drafter
catches up from the hidden states the running batch records for every token, and the same states go
to the drafter's buffer.

The decoding loop is `speculative.decode`; the engine is the policy it asks for k each step
(`TailPolicy`). The harness counts and times a rollout with the observer the loop calls each step.

Test: python -m pytest tests/test_rollout.py
"""
import random
import statistics
from collections import deque

import torch

from speculative import FixedK, RunningBatch, decode

ARMS = (0, 1, 2, 3, 4, 6, 8)


class Bandit:
    """Bucketed epsilon-greedy choice of the draft length k. An arm's score is its throughput over
    a short window: the mean tokens of a step over the median seconds of one. (A median of per-step
    rates would be biased: a step emits a small random count. A mean of the seconds would let one
    step stalled by the machine, many times its usual length, sink an arm's score until the arm
    is played again, which an arm that looks bad rarely is.) The window is short because the best
    arm moves as the drafter improves. An arm's first play only marks it tried, as it pays one-time
    costs: in each bucket every arm is played twice before arms are compared."""

    def __init__(self, arms=ARMS, epsilon=0.1, window=8, seed=0):
        self.arms, self.epsilon, self.window = tuple(arms), epsilon, window
        self.rng = random.Random(seed)
        self.plays = {}  # (bucket, arm) -> deque of recent (tokens, seconds)

    @staticmethod
    def bucket(batch_size):
        return max(batch_size - 1, 0).bit_length()  # 1 -> 0, 2 -> 1, 3..4 -> 2, 5..8 -> 3, ...

    def score(self, bucket, arm):
        r = self.plays.get((bucket, arm))
        if not r:
            return None
        return statistics.mean(n for n, _ in r) / statistics.median(t for _, t in r)  # tokens/s

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


class TailPolicy:
    """The engine's k for `speculative.decode`: 0 (a plain step) while the running batch is larger
    than `threshold`, the bandit's at or below it, where each step's throughput scores its k."""

    def __init__(self, bandit, threshold):
        self.bandit, self.threshold = bandit, threshold

    def choose(self, batch_size):
        return self.bandit.choose(batch_size) if batch_size <= self.threshold else 0

    def update(self, batch_size, k, tokens, seconds):
        if batch_size <= self.threshold:  # score k by the tokens per second it delivered
            self.bandit.update(batch_size, k, tokens, seconds)


@torch.no_grad()
def rollout(target, drafter, prompts, max_new_tokens, *, sd_threshold=64, bandit=None,
            observer=None, **sampling):
    """Generate for every prompt -> results[i], row i's speculative.FinishedRow (tokens, hidden
    states, response); drafter None: plain decoding. `sampling`: speculative.Sampling's fields by
    name; with "gumbel" the tokens depend on neither the drafter, the threshold nor the bandit (but
    for a near-tie). observer(batch, step) runs after the prefill (step None) and each step."""
    if not prompts:
        return []
    bandit = bandit if bandit is not None else Bandit()
    max_draft = max(bandit.arms) if drafter is not None else 0
    batch = RunningBatch(target, prompts, max_new_tokens, max_draft=max_draft, **sampling)
    policy = TailPolicy(bandit, sd_threshold) if drafter is not None else FixedK(0)
    return decode(batch, policy, drafter, observer)
