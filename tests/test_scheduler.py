"""Idle-rank drafter training across gloo processes: skewed loads, preemption by the last rank,
identical drafters after the sync (the acceptance sums summed in it), no hang for 1, 2 or 4 ranks or a
rank without prompts, a dead peer failing the idle barrier; the drafter's rate from its recent acceptance.
Slow is not dead: tests/test_liveness.py."""
import json
import random
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel
from torch.nn.utils import parameters_to_vector

from conftest import join_group, run_ranks
from drafter import Drafter, DrafterBuffer, make_optimizer
from harness.instrument import checksum
from model import GPT, GPTConfig
from rollout import rollout
from harness.distributed import gather_ranks
from harness.liveness import watched_barrier
from harness.report import render_timeline
from scheduler import IdleWork, idle_train, start_drafter_sync

DEADLINE_S = 120  # a hang fails the test instead of blocking CI


def _models():
    torch.manual_seed(0)  # identical initial weights on every rank
    target = GPT(GPTConfig(vocab_size=10, block_size=48, n_layer=1, n_head=2, n_embd=16)).eval()
    return target, Drafter(target)


def _worker(rank, loads, out_path):
    target, drafter = _models()
    net = DistributedDataParallel(target)
    target_opt = torch.optim.SGD(target.parameters(), lr=0.1)
    before = checksum(drafter)
    opt = make_optimizer(drafter)
    buffer = DrafterBuffer()
    load = loads[rank]
    prompts = [[1 + (i + rank) % 9] for i in range(4)] if load is not None else []
    gen = torch.Generator().manual_seed(rank)
    results = rollout(target, None, prompts, 20, generator=gen)
    for _, tokens, hidden, plen in results:
        buffer.add(0, tokens, hidden, plen)
    dist.barrier()  # everyone starts the simulated rollout together
    t0 = time.perf_counter()
    time.sleep(load or 0.0)  # the rollout of a skewed load
    rollout_time = time.perf_counter() - t0
    steps, _, idle, busy = idle_train(drafter, opt, buffer, random.Random(rank), IdleWork(batch_size=4))
    trained = parameters_to_vector(drafter.parameters()).double()
    finish = start_drafter_sync(drafter, steps, scored=(rank + 0.125, 10 * (rank + 1)))
    # the target's update runs between the sync's start and its finish, its all-reduces beside the sync's
    loss = net(torch.tensor([[1, 2, 3]]))[0].float().pow(2).mean()
    loss.backward()
    target_opt.step()
    scored = finish()  # the acceptance sums ride in the sync's all-reduce
    # the weighted mean by hand, from every rank's trained weights and steps
    everyone = gather_ranks((trained.tolist(), steps))
    total = sum(n for _, n in everyone)
    weighted = (sum(torch.tensor(w, dtype=torch.float64) * n for w, n in everyone) / total if total else trained)
    unweighted = sum(torch.tensor(w, dtype=torch.float64) for w, _ in everyone) / len(everyone)
    synced = parameters_to_vector(drafter.parameters()).double()
    recs = gather_ranks({"rank": rank, "rollout_time": rollout_time, "idle_time": idle, "drafter_steps": steps,
                         "checksum": checksum(drafter), "before": before, "scored": list(scored),
                         "off_weighted": float((synced - weighted).abs().max()),
                         "unweighted_gap": float((unweighted - weighted).abs().max()),
                         "rank0_gap": float((torch.tensor(everyone[0][0], dtype=torch.float64) - weighted).abs().max()),
                         "segments": [["plain", 0.0, rollout_time]]
                         + ([["train", busy[0] + rollout_time, busy[1] + rollout_time]] if busy else [])
                         + [["wait", (busy[1] if busy else 0.0) + rollout_time, idle + rollout_time]]})
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"records": recs, "timeline": render_timeline(recs)}, f)


def _run(world, loads, tmp_path):
    out = str(tmp_path / "records.json")
    run_ranks(_worker, world, loads, out, timeout_s=DEADLINE_S)
    with open(out) as f:
        return json.load(f)


def test_skewed_loads_four_ranks(tmp_path):
    data = _run(4, [0.2, 0.6, 1.0, 1.4], tmp_path)
    recs = data["records"]
    print(data["timeline"])
    slowest = max(r["rollout_time"] for r in recs)
    for r in recs:
        expected = slowest - r["rollout_time"]
        # idle = time from this rank's barrier entry to the last rank's arrival; the tolerance is
        # 10% of that plus 50 ms for the last drafter step in flight and process scheduling
        assert abs(r["idle_time"] - expected) <= 0.1 * expected + 0.05, (r, expected)
        if expected > 0.1:
            assert r["drafter_steps"] > 0
    assert len({r["checksum"] for r in recs}) == 1  # identical drafters after the sync
    assert recs[0]["checksum"] != recs[0]["before"]  # and the training reached them
    # the weighted mean, to float rounding; it is far from an unweighted mean and from rank 0's
    # weights, so a sync that computed either would fail here
    for r in recs:
        assert r["off_weighted"] < 1e-6 < 1e-4 < min(r["unweighted_gap"], r["rank0_gap"]), r
    assert "t" in data["timeline"] and "." in data["timeline"]


@pytest.mark.parametrize("world,loads", [(1, [0.1]), (2, [0.0, 0.3]), (4, [0.2, None, 0.0, None])])
def test_no_hang_and_empty_ranks(world, loads, tmp_path):
    recs = _run(world, loads, tmp_path)["records"]
    assert [r["rank"] for r in recs] == list(range(world))
    assert len({r["checksum"] for r in recs}) == 1
    n = world * (world + 1) // 2  # the kept sums are fractional: a sync that rounds them fails
    assert all(r["scored"] == [n - 0.875 * world, 10 * n] for r in recs)  # summed, on every rank
    for r in recs:  # the weighted mean: the ranks with nothing to train on (0 steps) add nothing
        assert r["off_weighted"] < 1e-6 and (world < 4 or r["unweighted_gap"] > 1e-4), r
    for r, load in zip(recs, loads):
        if load is None:
            assert r["drafter_steps"] == 0  # nothing to train on, so it only waits
    if world == 1:
        assert recs[0]["idle_time"] == 0 and recs[0]["drafter_steps"] == 0


def test_render_timeline_draws_each_phase():
    recs = [{"rank": 0, "rollout_time": 1.0, "idle_time": 1.0, "drafter_steps": 3,
             "segments": [["plain", 0.0, 0.5], ["spec", 0.5, 1.0], ["train", 1.0, 1.8], ["wait", 1.8, 2.0]]},
            {"rank": 1, "rollout_time": 2.0, "idle_time": 0.0, "drafter_steps": 0,
             "segments": [["plain", 0.0, 2.0]]}]
    text = render_timeline(recs, width=20)
    row0, row1 = text.splitlines()[:2]
    bar0 = row0.split("|")[1]
    assert bar0.startswith("#####") and "SSSSS" in bar0 and "tttt" in bar0 and bar0.rstrip().endswith(".")
    assert row1.split("|")[1] == "#" * 20


def _always_last_worker(rank, out_path):
    """Rank 1 finishes every step's rollout last, so it never has idle time: it stores each step's
    rows and never trains on them. Both ranks record what their buffers hold after each step."""
    from speculative import FinishedRow as Sample
    target, drafter = _models()
    opt, buffer = make_optimizer(drafter), DrafterBuffer(keep_steps=3, keep_tokens=100)
    gen = torch.Generator().manual_seed(rank)
    held, steps = [], 0
    for step in range(10):
        rows = rollout(target, None, [[1 + (i + step) % 9] for i in range(4)], 20, generator=gen)
        time.sleep(0.05 + 0.15 * rank)  # rank 1's rollout is always the long one
        buffer.add_rows(step, [Sample([], tokens, hidden, plen) for _, tokens, hidden, plen in rows])
        steps += idle_train(drafter, opt, buffer, random.Random(step), IdleWork(batch_size=4, idle_tokens=40))[0]
        held.append([buffer.tokens, len(buffer.items), sum(t.shape[0] for _, t, _, _ in buffer.items)])
        start_drafter_sync(drafter, steps)()
    recs = gather_ranks({"rank": rank, "held": held, "steps": steps})
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(recs, f)


def test_a_rank_always_last_holds_at_most_keep_tokens(tmp_path):
    """The buffer's bounds hold when rows are given, not when an idle turn reads them: the rank that
    is always last, which never has an idle turn, holds at most keep_tokens all the same."""
    out = str(tmp_path / "held.json")
    run_ranks(_always_last_worker, 2, out, timeout_s=DEADLINE_S)
    with open(out) as f:
        first, last = json.load(f)
    assert first["steps"] > 0  # the idle rank trained
    assert max(h for h, _, _ in last["held"]) <= 100 and max(n for _, n, _ in last["held"]) > 0  # rows held, bounded
    for h, _, counted in first["held"] + last["held"]:
        assert h == counted <= 100  # the running count is what is held


def _failing_worker(rank, world, port, q):
    torch.set_num_threads(1)
    join_group(rank, world, port, timeout_s=20)
    target, drafter = _models()
    if rank == 1:
        raise RuntimeError("rank 1 fails during its rollout")
    t0 = time.time()
    try:
        idle_train(drafter, make_optimizer(drafter), DrafterBuffer(), random.Random(0), IdleWork(),
                   barrier=lambda: watched_barrier(timeout_s=20))
        q.put(("returned", time.time() - t0))
    except Exception as e:  # the point of the test: the survivor fails instead of waiting forever
        q.put((type(e).__name__, time.time() - t0))
        raise


def _start_and_join(ctx, target, args_per_rank, hung_message, timeout=60):
    """One process per args tuple; wait for them all, kill and fail on any still running."""
    procs = [ctx.Process(target=target, args=args) for args in args_per_rank]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=timeout)
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.kill()
    assert not alive, hung_message
    return procs


def test_dead_peer_fails_the_idle_barrier_in_bounded_time():
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)  # held here: see conftest.run_ranks
    procs = _start_and_join(ctx, _failing_worker, [(r, 2, store.port, q) for r in range(2)], "a rank hung on a dead peer")
    assert all(p.exitcode != 0 for p in procs)
    outcome, waited = q.get(timeout=5)
    assert outcome != "returned" and waited <= 30


def test_the_idle_ranks_train_the_drafter_as_hard_as_its_acceptance_asks():
    """scheduler.RecentAcceptance keeps the last RECENT_STEPS steps' figures and skips a step nobody
    scored; drafter_schedule, one rule for any drafter: the gentle rate and the full depth at
    ACCEPT_GENTLE and above (and before any figure), the hard rate teacher-forced (one pass) at
    ACCEPT_HARDEST and below, the rate geometric and the depth linear in between."""
    from scheduler import ACCEPT_GENTLE, ACCEPT_HARDEST, RECENT_STEPS, RecentAcceptance, drafter_schedule
    recent = RecentAcceptance()
    assert recent.mean() is None
    for i in range(RECENT_STEPS + 2):
        recent.add(5 if i < 2 else 10, 10)  # the two weak steps fall out of the window
    recent.add(0, 0)  # no rank had time to score: the figure is unchanged
    assert len(recent.recent) == RECENT_STEPS and recent.mean() == 1.0
    recent.recent = [[5.0, 10]]
    recent.add(30, 30)
    assert recent.mean() == 35 / 40  # weighted by positions scored
    gentle, hard = 1e-4, 1e-2
    assert drafter_schedule(None, gentle, hard, 3) == (gentle, 3)
    assert drafter_schedule(ACCEPT_GENTLE + 0.01, gentle, hard, 3) == (gentle, 3)
    assert drafter_schedule(ACCEPT_HARDEST - 0.1, gentle, hard, 3) == (pytest.approx(hard), 1)
    assert drafter_schedule(ACCEPT_HARDEST, gentle, hard, 5) == (pytest.approx(hard), 1)
    middle = (ACCEPT_GENTLE + ACCEPT_HARDEST) / 2
    assert drafter_schedule(middle, gentle, hard, 3) == (pytest.approx(1e-3), 2)  # the geometric mean
    assert drafter_schedule(middle, gentle, hard, 5) == (pytest.approx(1e-3), 3)
    from harness.config import parse_args
    args = parse_args([])  # the defaults, for a warm drafter at its plateau on the default task
    lr, depth = drafter_schedule(0.98, args.drafter_online_lr, args.drafter_cold_lr, args.drafter_depth)
    assert depth == args.drafter_depth and lr < 1.5 * args.drafter_online_lr  # gently, the full depth
