"""Ranks and the drafter: idle ranks train it until the last rank finishes; then one drafter again.

Under torchrun every rank rolls out its own rows, and long-tailed lengths make them finish far
apart. A rank that is done enters an asynchronous barrier and, until it completes, works for the
drafter one short piece at a time:

    work = dist.barrier(async_op=True)   # completes when the LAST rank arrives
    wait for it a moment (grace_s)       # the last rank finds it complete: it starts nothing
    while not work.is_completed():       # preemption: the last rank's arrival
        one piece of drafter work

So idle time becomes drafter training with torch.distributed alone. A piece is short (its top-1
figure on a few fresh rows, storing a few staged rows, or one drafter step that also stops between
its passes), since the last rank waits for the pieces in flight; the last rank itself does none.

Then every rank holds the same drafter again: the weights are averaged, weighted by each rank's
local steps, in one all-reduce that overlaps the target's update. Each rank's AdamW moments stay
its own. A single process has no idle time, so it never trains the drafter online: that is the
technique, not a bug (it still scores the drafter's top-1, on its own path: nobody waits for it).
How hard idle ranks train is set by the drafter's recent top-1 agreement with the target on fresh
rows (`drafter_schedule`).

Test: python -m pytest tests/test_scheduler.py   (gloo processes with skewed loads)
"""
import math
import time
from collections import deque
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from drafter import pair_batch, top1_agreement, train_step
from rl import group_by_length


@dataclass
class IdleWork:
    """What an idle rank does for the drafter in one RL step."""
    train: bool = True  # train it (--drafter-updates); else only the scoring
    batch_size: int = 8  # sequences per drafter step
    depth: int = 3  # chained passes per drafter step
    piece_tokens: int = 128  # padded positions in one piece of idle work, at most


def many_ranks():
    return dist.is_initialized() and dist.get_world_size() > 1


def idle_train(drafter, optimizer, buffer, rng, work, scoring=(), barrier=None, grace_s=0.005):
    """The idle loop. scoring: pieces of work that score the drafter on this step's rows (its top-1
    figure), one per turn, before it trains on them, dropped when the last rank arrives. barrier:
    makes the async barrier (default dist.barrier(async_op=True)); the harness passes one that
    also watches that slow ranks are alive. -> (steps, skipped steps, idle seconds, busy), busy the
    [start, end] seconds of the turns that worked (None: none did). grace_s is short: a barrier's
    round trip between ranks takes well under a millisecond, and every millisecond of grace is idle
    time that trains nothing."""
    t0 = time.perf_counter()
    scoring = deque(scoring)
    if not many_ranks():  # no idle time, and nobody to delay
        while scoring:
            scoring.popleft()()
        return 0, 0, 0.0, None
    steps, skipped, busy = 0, 0, None
    arrived = barrier() if barrier else dist.barrier(async_op=True)
    while not arrived.is_completed() and time.perf_counter() - t0 < grace_s:
        time.sleep(0.0005)  # the last rank sees it complete at once: it starts nothing
    while not arrived.is_completed():
        start = time.perf_counter() - t0
        if scoring:
            scoring.popleft()()
        elif work.train and buffer.staged:  # the step's rows to the host, a piece a turn
            buffer.store_staged(work.piece_tokens)
        elif work.train and len(buffer):
            batch = buffer.sample(work.batch_size, rng, drafter.in_proj.weight.device,
                                  work.piece_tokens)  # at most piece_tokens padded positions
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


def top1_pieces(drafter, rows, into, piece_tokens):
    """Pieces of idle work that score the drafter's teacher-forced top-1 agreement on a rollout's
    finished rows (speculative.FinishedRow), rows of similar lengths at a time, adding (agreeing
    positions, positions) to `into`. They run before the drafter trains on these rows."""
    def score(piece):
        batch = pair_batch([(r.tokens, r.hidden, r.prompt_len) for r in piece],
                           drafter.in_proj.weight.device)
        agree, n = top1_agreement(drafter, *batch)
        into[0] += agree
        into[1] += n
    pieces = group_by_length(rows, lambda r: r.tokens.shape[0], piece_tokens)
    return [lambda piece=piece: score(piece) for piece in pieces if piece]


@torch.no_grad()
def start_drafter_sync(drafter, local_steps):
    """Average the drafter's weights over ranks, weighted by local steps, in the background: one
    all-reduce of [steps * weights, steps] starts here, and the returned `finish()` waits for it
    and writes the average in. A rank that trained 0 steps adds nothing; if nobody trained,
    nothing changes. Every rank gets bit-identical sums, so identical weights."""
    if not many_ranks():
        return lambda: None
    params = list(drafter.parameters())
    steps = torch.tensor([float(local_steps)], dtype=torch.float64, device=params[0].device)
    flat = torch.cat([parameters_to_vector(params).double() * local_steps, steps])
    work = dist.all_reduce(flat, async_op=True)

    @torch.no_grad()
    def finish():
        work.wait()
        total = flat[-1].item()  # sync: the summed step count
        if total > 0:
            vector_to_parameters((flat[:-1] / total).to(params[0].dtype), params)
    return finish


# -----------------------------------------------------------------------------
# how hard the idle ranks train the drafter: its recent top-1 agreement decides

TOP1_GENTLE = 0.98  # recent top-1 at or above which the idle ranks train the drafter gentlest
TOP1_HARDEST = 0.85  # and at or below which they train it hardest
TOP1_STEPS = 5  # RL steps whose figures make the recent top-1


def mean_top1(recent):
    """Top-1 agreement on the fresh rows of the last TOP1_STEPS steps (`recent`: [agreeing,
    positions] per step, summed over ranks); None before any."""
    n = sum(p for _, p in recent)
    return sum(a for a, _ in recent) / n if n else None


def add_top1(recent, top1, positions):
    """`recent` with one more step's figure; a step with no position scored adds nothing."""
    return (recent + [[top1 * positions, positions]])[-TOP1_STEPS:] if positions else recent


def drafter_schedule(args, step, top1):
    """The idle ranks' drafter learning rate and depth at RL step `step`. A cold start
    (--drafter-warmup-steps 0) trains teacher-forced on a cosine from --drafter-cold-lr down to a
    twentieth. A warmed-up drafter gets --drafter-online-lr while its recent top-1 is at least
    TOP1_GENTLE, rising geometrically to --drafter-cold-lr at TOP1_HARDEST and below, on
    --drafter-depth chained passes."""
    if args.drafter_warmup_steps == 0:
        frac, peak = step / max(1, args.rl_steps - 1), args.drafter_cold_lr
        return peak / 20 + (peak - peak / 20) * 0.5 * (1 + math.cos(math.pi * frac)), 1
    if top1 is None:
        return args.drafter_online_lr, args.drafter_depth
    hard = min(1.0, max(0.0, (TOP1_GENTLE - top1) / (TOP1_GENTLE - TOP1_HARDEST)))
    lr = args.drafter_online_lr * (args.drafter_cold_lr / args.drafter_online_lr) ** hard
    return lr, args.drafter_depth
