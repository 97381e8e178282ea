"""Ranks and the drafter: idle ranks train it until the last rank finishes; then one drafter again.

Under torchrun every rank rolls out its own rows. Response lengths have a long tail, so the ranks
finish far apart. A rank that is done enters an asynchronous barrier. Until the barrier completes,
it works for the drafter, one short piece at a time:

    arrived = dist.barrier(async_op=True)   # completes when the LAST rank arrives
    wait for it a moment (grace_s)          # so the last rank mostly finds it complete
    while not arrived.is_completed():       # preemption: the last rank's arrival
        one piece of drafter work

That is idle time turned into drafter training with torch.distributed alone (the run's,
`harness.liveness.watched_barrier`, is on a group of its own and also watches for dead ranks). A
piece is short (scoring a few fresh rows, or one drafter step that can stop between its passes): the
last rank waits for the piece in flight. The last rank itself mostly does none: it finds the barrier
complete within the grace; when the round trip takes longer, it may run a piece before it leaves.

Then every rank holds the same drafter again. The weights are averaged, weighted by each rank's
local drafter steps, in one all-reduce that overlaps the target's update. Each rank's AdamW moments
stay its own. A single process has no idle time: it never trains the drafter online (that is the
technique, not a bug), but it scores it, since nobody waits for it.

How hard the idle ranks train follows one rule, the same for a drafter built from nothing and for
one warmed up before RL: the lower the drafter's recent acceptance on fresh rows
(`RecentAcceptance`), the higher its learning rate and the shallower its chained passes
(`drafter_schedule`), hardest only far below a warm drafter's plateau.

Test: python -m pytest tests/test_scheduler.py   (gloo processes with skewed loads)
"""
import time
from collections import deque
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from drafter import acceptance, pair_batch, train_step
from rl import group_by_length


@dataclass
class IdleWork:
    """What an idle rank does for the drafter in one RL step."""
    train: bool = True  # train it (--drafter-updates); else only the scoring
    batch_size: int = 8  # sequences per drafter step
    depth: int = 3  # chained passes per drafter step
    idle_tokens: int = 128  # padded positions in one drafter step, at most


def idle_train(drafter, optimizer, buffer, rng, work, scoring=(), barrier=None, grace_s=0.005):
    """The idle loop, from this rank's arrival until the last rank's -> (drafter steps, skipped
    steps, idle seconds, busy: [start, end] of the turns that did work, or None).
    scoring: pieces that score the drafter on fresh rows, one a turn before any training; those
    left when the last rank arrives are dropped. barrier: makes the async barrier (the harness's
    also checks that slow ranks are alive). grace_s is short: a barrier's round trip takes well
    under a millisecond, and every millisecond of grace is idle time that trains nothing."""
    t0 = time.perf_counter()
    if not dist.is_initialized() or dist.get_world_size() == 1:  # no idle time, nobody to delay
        while scoring:
            scoring.popleft()()
        return 0, 0, 0.0, None
    steps, skipped, busy = 0, 0, None
    arrived = barrier() if barrier else dist.barrier(async_op=True)
    while not arrived.is_completed() and time.perf_counter() - t0 < grace_s:
        time.sleep(0.0005)  # the last rank mostly sees it complete here, before any piece
    while not arrived.is_completed():
        start = time.perf_counter() - t0
        if scoring:
            scoring.popleft()()
        elif work.train and buffer.items:
            batch = buffer.sample(work.batch_size, rng, drafter.in_proj.weight.device,
                                  work.idle_tokens)  # at most idle_tokens padded positions
            loss, applied = train_step(drafter, optimizer, batch, work.depth,
                                       preempted=arrived.is_completed)
            steps += applied
            skipped += loss is not None and not applied  # abandoned midway is not a skip
        else:
            time.sleep(0.001)
            continue
        busy = [busy[0] if busy else start, time.perf_counter() - t0]
    arrived.wait()  # a failed barrier (a peer gone) raises here
    return steps, skipped, time.perf_counter() - t0, busy


def acceptance_pieces(drafter, rows, into, idle_tokens, temperature):
    """Idle pieces that add the drafter's acceptance on a rollout's FinishedRows to `into` (kept,
    positions): rows of similar lengths, about idle_tokens padded positions (one row, if longer)."""
    def score(piece):
        batch = pair_batch([(r.tokens, r.hidden, r.prompt_len) for r in piece],
                           drafter.in_proj.weight.device)
        kept, n = acceptance(drafter, *batch, temperature)
        into[0] += kept
        into[1] += n
    pieces = group_by_length(rows, lambda r: r.tokens.shape[0], idle_tokens)
    return deque(lambda piece=piece: score(piece) for piece in pieces if piece)


@torch.no_grad()
def start_drafter_sync(drafter, local_steps, scored=(0, 0)):
    """Start averaging the drafter's weights over ranks, weighted by local drafter steps: one
    all-reduce of [steps * weights, steps, acceptance sums] in the background. `finish()` waits,
    writes the average in (unchanged if nobody trained; bit-identical on every rank) and returns the
    acceptance sums (kept, positions) over ranks."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return lambda: tuple(scored)
    params = list(drafter.parameters())
    sums = torch.tensor([float(local_steps), *scored], dtype=torch.float64, device=params[0].device)
    flat = torch.cat([parameters_to_vector(params).double() * local_steps, sums])
    pending = dist.all_reduce(flat, async_op=True)

    @torch.no_grad()
    def finish():
        pending.wait()
        total, kept, positions = flat[-3:].tolist()  # sync: the summed steps and acceptance
        if total > 0:
            vector_to_parameters((flat[:-3] / total).to(params[0].dtype), params)
        return kept, int(positions)
    return finish


# -----------------------------------------------------------------------------
# how hard the idle ranks train the drafter: one rule, read from its recent acceptance

ACCEPT_HARDEST = 0.85  # recent acceptance at or below which idle ranks train the drafter hardest
ACCEPT_GENTLE = 0.995  # and at or above which they train it gentlest
RECENT_STEPS = 5  # RL steps whose sums make the recent acceptance


class RecentAcceptance:
    """The drafter's acceptance over the last RECENT_STEPS steps that scored rows: each rank scores
    its fresh rows on idle time before training (the slowest's mostly not); the sync sums them."""

    def __init__(self):
        self.recent = []  # [kept, positions] per RL step, summed over ranks

    def add(self, kept, positions):
        if positions:  # a step with nothing scored adds nothing
            self.recent = (self.recent + [[kept, positions]])[-RECENT_STEPS:]

    def mean(self):
        """The recent figure, or None before any step was scored."""
        n = sum(p for _, p in self.recent)
        return sum(a for a, _ in self.recent) / n if n else None


def drafter_schedule(acceptance, online_lr, cold_lr, max_depth):
    """The rule: the further the drafter's recent acceptance falls below ACCEPT_GENTLE, the harder
    the idle ranks train it -> (learning rate, chained passes). At ACCEPT_GENTLE and above (or not
    yet scored): online_lr, max_depth passes; at ACCEPT_HARDEST and below: cold_lr, teacher-forced
    (a drafter missing the first token learns that first); geometric and linear in between. Once
    scored (step 0 is not), a cold drafter starts at the hard end; a warm one at 98%, a tenth in."""
    span = ACCEPT_GENTLE - ACCEPT_HARDEST
    hard = 0.0 if acceptance is None else min(1.0, max(0.0, (ACCEPT_GENTLE - acceptance) / span))
    return online_lr * (cold_lr / online_lr) ** hard, 1 + round((max_depth - 1) * (1 - hard))
