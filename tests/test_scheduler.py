"""Idle-rank drafter training across gloo processes: skewed loads, preemption by the last rank,
identical drafters after the sync, no hang for 1, 2 or 4 ranks or a rank without prompts."""
import json
import os
import random
import socket
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from drafter import Drafter, DrafterBuffer, make_optimizer
from model import GPT, GPTConfig
from rollout import rollout
from scheduler import gather_ranks, idle_train, render_timeline, sync_drafter

DEADLINE_S = 120  # a hang fails the test instead of blocking CI


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _models():
    torch.manual_seed(0)  # identical initial weights on every rank
    target = GPT(GPTConfig(vocab_size=10, block_size=48, n_layer=1, n_head=2, n_embd=16)).eval()
    return target, Drafter(target)


def _worker(rank, world, port, loads, out_path):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    target, drafter = _models()
    before = drafter.checksum()
    opt = make_optimizer(drafter)
    buffer = DrafterBuffer()
    load = loads[rank]
    prompts = [[1 + (i + rank) % 9] for i in range(4)] if load is not None else []
    gen = torch.Generator().manual_seed(rank)
    results, _ = rollout(target, None, prompts, 20, generator=gen, tlt=False)
    for _, tokens, hidden, plen in results:
        buffer.add(0, tokens, hidden, plen)
    dist.barrier()  # everyone starts the simulated rollout together
    t0 = time.perf_counter()
    time.sleep(load or 0.0)  # the rollout of a skewed load
    rollout_time = time.perf_counter() - t0
    steps, _, idle, segments = idle_train(drafter, opt, buffer, random.Random(rank), batch_size=4)
    sync_drafter(drafter, steps)
    recs = gather_ranks({"rank": rank, "rollout_time": rollout_time, "idle_time": idle, "drafter_steps": steps,
                         "checksum": drafter.checksum(), "before": before,
                         "segments": [["plain", 0.0, rollout_time]] + [[k, a + rollout_time, b + rollout_time]
                                                                         for k, a, b in segments]})
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"records": recs, "timeline": render_timeline(recs)}, f)
    dist.barrier()  # nobody tears down gloo while a peer still talks to it
    dist.destroy_process_group()
    os._exit(0)  # skip C++ static destructors, which now and then abort after gloo (see train.main)


def _run(world, loads, tmp_path):
    out = str(tmp_path / "records.json")
    ctx = mp.start_processes(_worker, args=(world, _free_port(), loads, out), nprocs=world, join=False,
                             start_method="spawn")
    deadline = time.time() + DEADLINE_S
    while not ctx.join(timeout=1):
        if time.time() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"world size {world} hung for {DEADLINE_S}s")
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
    assert "t" in data["timeline"] and "." in data["timeline"]


@pytest.mark.parametrize("world,loads", [(1, [0.1]), (2, [0.0, 0.3]), (4, [0.2, None, 0.0, None])])
def test_no_hang_and_empty_ranks(world, loads, tmp_path):
    recs = _run(world, loads, tmp_path)["records"]
    assert [r["rank"] for r in recs] == list(range(world))
    assert len({r["checksum"] for r in recs}) == 1
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


def _failing_worker(rank, world, port, q):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=__import__("datetime").timedelta(seconds=20))
    target, drafter = _models()
    if rank == 1:
        raise RuntimeError("rank 1 fails during its rollout")
    t0 = time.time()
    try:
        idle_train(drafter, make_optimizer(drafter), DrafterBuffer(), random.Random(0), timeout_s=20)
        q.put(("returned", time.time() - t0))
    except Exception as e:  # the point of the test: the survivor fails instead of waiting forever
        q.put((type(e).__name__, time.time() - t0))
        raise


def test_dead_peer_fails_the_idle_barrier_in_bounded_time():
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_failing_worker, args=(r, 2, port, q)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=60)
    alive = [p for p in procs if p.is_alive()]
    for p in alive:
        p.kill()
    assert not alive, "a rank hung on a dead peer"
    assert all(p.exitcode != 0 for p in procs)
    outcome, waited = q.get(timeout=5)
    assert outcome != "returned" and waited <= 30


# ----------------------------------------------------------------------------- slow is not dead

LIVENESS_S = 3.0  # the test's TLT_COLLECTIVE_TIMEOUT: also the default group's collective timeout


def _liveness_worker(rank, port, fault, q):
    """Rank 1 rolls out for 3 x LIVENESS_S: making progress ("slow"), silent ("hung"), or it dies
    ("killed"). Rank 0 finished at once and waits in the idle barrier."""
    import datetime
    from scheduler import Liveness
    torch.set_num_threads(1)
    timeout = datetime.timedelta(seconds=LIVENESS_S)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=datetime.timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timeout)
    liveness = Liveness(store, rank, 2, LIVENESS_S, every_s=0.2)
    target, drafter = _models()
    t0 = time.time()
    if rank == 1:
        while time.time() - t0 < 3 * LIVENESS_S:
            if fault == "slow":
                liveness.beat()  # what rollout() does after every decoding step
            elif fault == "killed":
                os._exit(1)
            time.sleep(0.05)
    try:
        idle_train(drafter, make_optimizer(drafter), DrafterBuffer(), random.Random(0), liveness=liveness)
        q.put((rank, "returned", "", time.time() - t0))
    except Exception as e:
        q.put((rank, type(e).__name__, str(e), time.time() - t0))
        q.close()
        q.join_thread()  # flush the queue before leaving without cleanup
        os._exit(1)
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


def _liveness_run(fault):
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_liveness_worker, args=(r, port, fault, q)) for r in range(2)]
    for p in procs:
        p.start()
    procs[0].join(timeout=60)
    for p in procs:
        p.join(timeout=3 * LIVENESS_S + 5)
        if p.is_alive():
            p.kill()
    outcomes = {}
    while not q.empty():
        rank, outcome, message, waited = q.get(timeout=5)
        outcomes[rank] = (outcome, message, waited)
    return outcomes, [p.exitcode for p in procs]


def test_a_slow_rank_that_makes_progress_is_waited_for():
    outcomes, codes = _liveness_run("slow")
    outcome, _, waited = outcomes[0]
    assert outcome == "returned" and waited > 2 * LIVENESS_S  # waited past the timeout, and returned
    assert codes == [0, 0]


@pytest.mark.parametrize("fault", ["hung", "killed"])
def test_a_hung_or_killed_rank_fails_its_peer_in_bounded_time_naming_it(fault):
    outcomes, codes = _liveness_run(fault)
    outcome, message, waited = outcomes[0]
    assert outcome == "RuntimeError" and codes[0] != 0
    assert waited < 2 * LIVENESS_S + 2  # silent for LIVENESS_S, checked once a fifth of a second
    if fault == "hung":
        assert "rank 1 has made no progress" in message
