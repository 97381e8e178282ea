"""Idle-rank drafter training across gloo processes: skewed loads, preemption by the last rank,
identical drafters after the sync, no hang for 1, 2 or 4 ranks or a rank without prompts. Slow is
not dead (liveness.Liveness), in every wait where ranks arrive far apart (the idle barrier, the
drafter warm-up, evaluation, rank 0's checkpoint I/O and broadcasts): slow ranks are waited for,
hung or killed ones, or rank 0 past its I/O deadline, fail the others with a message naming them; a
barrier without Liveness keeps its own timeout. Successive groups on one store agree on fresh
prefixes, a dead group's stale hello notwithstanding."""
import json
import os
import random
import signal
import socket
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.nn.parallel import DistributedDataParallel
from torch.nn.utils import parameters_to_vector

from drafter import Drafter, DrafterBuffer, make_optimizer
from harness.instrument import checksum
from model import GPT, GPTConfig
from rollout import rollout
from harness.distributed import gather_ranks
from harness.liveness import watched_barrier
from harness.report import render_timeline
from scheduler import IdleWork, idle_train, start_drafter_sync

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
    finish = start_drafter_sync(drafter, steps)
    # the target's update runs between the sync's start and its finish, its all-reduces beside the sync's
    loss = net(torch.tensor([[1, 2, 3]]))[0].float().pow(2).mean()
    loss.backward()
    target_opt.step()
    finish()
    # the weighted mean by hand, from every rank's trained weights and steps
    everyone = gather_ranks((trained.tolist(), steps))
    total = sum(n for _, n in everyone)
    weighted = (sum(torch.tensor(w, dtype=torch.float64) * n for w, n in everyone) / total if total else trained)
    unweighted = sum(torch.tensor(w, dtype=torch.float64) for w, _ in everyone) / len(everyone)
    synced = parameters_to_vector(drafter.parameters()).double()
    recs = gather_ranks({"rank": rank, "rollout_time": rollout_time, "idle_time": idle, "drafter_steps": steps,
                         "checksum": checksum(drafter), "before": before,
                         "off_weighted": float((synced - weighted).abs().max()),
                         "unweighted_gap": float((unweighted - weighted).abs().max()),
                         "rank0_gap": float((torch.tensor(everyone[0][0], dtype=torch.float64) - weighted).abs().max()),
                         "segments": [["plain", 0.0, rollout_time]]
                         + ([["train", busy[0] + rollout_time, busy[1] + rollout_time]] if busy else [])
                         + [["wait", (busy[1] if busy else 0.0) + rollout_time, idle + rollout_time]]})
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


def _always_last_worker(rank, world, port, out_path):
    """Rank 1 finishes every step's rollout last, so it never has idle time: it stages each step's
    rows and never stores them. Both ranks record what their buffers hold after each step."""
    from speculative import FinishedRow as Sample
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    target, drafter = _models()
    opt, buffer = make_optimizer(drafter), DrafterBuffer(keep_steps=3, keep_tokens=100)
    gen = torch.Generator().manual_seed(rank)
    held, steps = [], 0
    for step in range(10):
        rows = rollout(target, None, [[1 + (i + step) % 9] for i in range(4)], 20, generator=gen)
        time.sleep(0.05 + 0.15 * rank)  # rank 1's rollout is always the long one
        buffer.add_rows(step, [Sample([], tokens, hidden, plen) for _, tokens, hidden, plen in rows])
        steps += idle_train(drafter, opt, buffer, random.Random(step), IdleWork(batch_size=4, piece_tokens=40))[0]
        held.append([buffer.held_tokens(), len(buffer.staged), sum(t.shape[0] for _, t, _, _ in buffer.items)
                     + sum(s.tokens.shape[0] for _, s in buffer.staged)])
        start_drafter_sync(drafter, steps)()
    recs = gather_ranks({"rank": rank, "held": held, "steps": steps})
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(recs, f)
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


def test_a_rank_always_last_holds_at_most_keep_tokens(tmp_path):
    """The buffer's bounds hold when rows are given, not when an idle turn reads them: the rank that
    is always last, which never stores a row, holds at most keep_tokens all the same."""
    out = str(tmp_path / "held.json")
    ctx = mp.start_processes(_always_last_worker, args=(2, _free_port(), out), nprocs=2, join=False, start_method="spawn")
    deadline = time.time() + DEADLINE_S
    while not ctx.join(timeout=1):
        assert time.time() < deadline, "hung"
    with open(out) as f:
        first, last = json.load(f)
    assert first["steps"] > 0  # the idle rank trained
    assert max(h for h, _, _ in last["held"]) <= 100 and max(n for _, n, _ in last["held"]) > 0  # rows staged, bounded
    for h, _, counted in first["held"] + last["held"]:
        assert h == counted <= 100  # the running count is what is held


def _failing_worker(rank, world, port, q):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=__import__("datetime").timedelta(seconds=20))
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
    port = _free_port()
    procs = _start_and_join(ctx, _failing_worker, [(r, 2, port, q) for r in range(2)], "a rank hung on a dead peer")
    assert all(p.exitcode != 0 for p in procs)
    outcome, waited = q.get(timeout=5)
    assert outcome != "returned" and waited <= 30


# ----------------------------------------------------------------------------- slow is not dead

LIVENESS_S = 3.0  # the tests' TLT_COLLECTIVE_TIMEOUT: also the default group's collective timeout


def _late_work(fault, progress):
    """The late rank's long work, 3 x LIVENESS_S: making progress ("slow"), silent ("hung"), or it dies ("killed")."""
    t0 = time.time()
    while time.time() - t0 < 3 * LIVENESS_S:
        if fault == "slow":
            progress()
        elif fault == "killed":
            os._exit(1)
        time.sleep(0.05)


def _idle(rank, world, fault):
    """The idle barrier: the last rank rolls out late, the others train (or wait) meanwhile."""
    from harness.liveness import Liveness, beat
    target, drafter = _models()
    if rank == world - 1:
        _late_work(fault, beat)  # beat: what rollout()'s observer calls
    idle_train(drafter, make_optimizer(drafter), DrafterBuffer(), random.Random(0), IdleWork(),
               barrier=lambda: watched_barrier(Liveness.current))


def _wait(rank, world, fault):
    """liveness.wait_for_all, the wait before every collective that ranks may reach far apart."""
    from harness.liveness import beat, wait_for_all
    if rank == world - 1:
        _late_work(fault, beat)
    wait_for_all()


def _drafter_warmup(rank, world, fault):
    """warmup.warmup_drafter: the last rank samples late (a delay injected into its rollout), then
    every rank trains the drafter with gradients all-reduced."""
    from tasks import running_sum as task
    from harness import config
    from harness import warmup
    if rank == world - 1:
        real = warmup.rollout

        def late_rollout(*a, observer=None, **kw):
            _late_work(fault, lambda: observer(None, None))  # fails if warmup_drafter passes no observer
            return real(*a, observer=observer, **kw)
        warmup.rollout = late_rollout
    torch.manual_seed(0)
    target = GPT(GPTConfig(vocab_size=task.VOCAB_SIZE, block_size=48, n_layer=1, n_head=2, n_embd=16)).eval()
    args = config.parse_args(["--drafter-warmup-seqs", "4", "--drafter-warmup-steps", "2", "--drafter-batch", "2"])
    warmup.warmup_drafter(Drafter(target), target, args, task.RunningSum(max_n=3), True, rank, world,
                          torch.device("cpu"))


def _checkpoint(rank, world, fault, path):
    """checkpoint.save_on_rank0: rank 0's write is slow (the file system), or rank 0 stops in it."""
    from harness import checkpoint
    if rank == 0:
        real = torch.save

        def late_save(*a, **kw):
            if fault == "hung":
                os.kill(os.getpid(), signal.SIGSTOP)  # the whole process stops, its beating thread too
            time.sleep(3 * LIVENESS_S)  # one long call that cannot beat from inside
            return real(*a, **kw)
        torch.save = late_save
    checkpoint.save_on_rank0({"w": torch.ones(3)}, path)
    if not os.path.exists(path):
        raise RuntimeError("save_on_rank0 returned before rank 0 had written the file")


SHORT_S = 2.0  # the newer tests' limit (Liveness and collective timeout): they wait 3 x SHORT_S at most


def _evaluate(rank, world, fault):
    """evaluate.evaluate: the last rank's shard is one generate call of 18 decoding steps that take
    3 x SHORT_S in all; the other rank's is quick, so it waits for it in wait_for_all."""
    from harness import evaluate
    from tasks import running_sum as task
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=task.VOCAB_SIZE, block_size=48, n_layer=1, n_head=2, n_embd=16)).eval()
    cfg = task.RunningSum(max_n=3)
    problems = [cfg.sample(random.Random(i), size=3) for i in range(world)]
    if rank == world - 1:
        real, steps = model.forward, cfg.response_len(3)

        def slow_forward(*a, **kw):
            time.sleep(3 * SHORT_S / steps)
            return real(*a, **kw)
        model.forward = slow_forward
    evaluate.evaluate(model, cfg, problems, rank, world)


class _SlowToPickle:
    """Rank 0's object for from_rank0: pickling it takes 3 x SHORT_S ("slow"; a big checkpoint) or
    stops the process ("hung"); it arrives as a string."""

    def __init__(self, fault):
        self.fault = fault

    def __reduce__(self):
        if self.fault == "hung":
            os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(3 * SHORT_S)
        return str, ("rank 0's answer",)


def _broadcast(rank, world, fault):
    """liveness.from_rank0: rank 0's object takes longer to broadcast than the collective timeout."""
    from harness.liveness import from_rank0
    got = from_rank0(_SlowToPickle(fault) if rank == 0 else None)
    if rank > 0 and got != "rank 0's answer":
        raise RuntimeError(f"from_rank0 gave {got!r}")


SCENARIOS = {"idle": _idle, "wait": _wait, "drafter_warmup": _drafter_warmup, "checkpoint": _checkpoint,
             "evaluate": _evaluate, "broadcast": _broadcast}


def _liveness_worker(rank, world, port, scenario, fault, extra, q, limit_s, io_deadline_s):
    """One rank of a scenario, with a Liveness on a store that the test hosts (as torchrun's agent
    does, so a stopped rank does not take the store with it). Reports (rank, outcome, message, seconds).
    limit_s: both the Liveness timeout and the default group's collective timeout (TLT_COLLECTIVE_TIMEOUT)."""
    import datetime
    from harness.liveness import Liveness
    torch.set_num_threads(1)
    make_optimizer(_models()[1])  # the first call imports for seconds on a loaded machine: not part of the test
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=limit_s))
    Liveness(store, rank, world, limit_s, every_s=0.2, io_deadline_s=io_deadline_s)
    t0 = time.time()
    try:
        SCENARIOS[scenario](rank, world, fault, *extra)
        dist.all_reduce(torch.ones(1))  # the default group, limit_s timeout: the ranks reached it together
        q.put((rank, "returned", "", time.time() - t0))
        code = 0
    except Exception as e:
        q.put((rank, type(e).__name__, str(e), time.time() - t0))
        code = 1
    q.close()
    q.join_thread()  # flush the queue before leaving without cleanup
    if code == 0:
        dist.barrier()
        dist.destroy_process_group()
    os._exit(code)


def _liveness_run(scenario, fault, world=2, watch=(0, 1), extra=(), limit_s=LIVENESS_S, io_deadline_s=1800):
    """Run a scenario on `world` processes; wait for the ranks in `watch`, then kill the others.
    -> ({rank: (outcome, message, seconds)}, exit codes)."""
    import queue
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    procs = [ctx.Process(target=_liveness_worker, args=(r, world, store.port, scenario, fault, extra, q, limit_s,
                                                        io_deadline_s)) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.time() + 60
    for r in watch:
        procs[r].join(timeout=max(0.0, deadline - time.time()))
    for p in procs:
        if p.is_alive():
            p.kill()  # SIGKILL also ends a stopped process
        p.join()
    outcomes = {}
    try:
        while True:
            rank, outcome, message, waited = q.get(timeout=0.5)
            outcomes[rank] = (outcome, message, waited)
    except queue.Empty:
        pass
    return outcomes, [p.exitcode for p in procs]


@pytest.mark.parametrize("scenario", ["idle", "drafter_warmup", "checkpoint"])
def test_a_slow_rank_that_makes_progress_is_waited_for(scenario, tmp_path):
    """Past the timeout: in the idle barrier (rolling out), in the drafter warm-up (sampling), and
    in rank 0's checkpoint write (one long torch.save, beaten from a background thread)."""
    outcomes, codes = _liveness_run(scenario, "slow", extra=(str(tmp_path / "ckpt.pt"),) if scenario == "checkpoint" else ())
    assert codes == [0, 0], outcomes
    waiting = 1 if scenario == "checkpoint" else 0
    outcome, _, waited = outcomes[waiting]
    assert outcome == "returned" and waited > 2 * LIVENESS_S  # waited past the timeout, and returned


@pytest.mark.parametrize("scenario,fault", [("idle", "hung"), ("idle", "killed"), ("drafter_warmup", "hung")])
def test_a_hung_or_killed_rank_fails_its_peer_in_bounded_time_naming_it(scenario, fault):
    outcomes, codes = _liveness_run(scenario, fault, watch=(0,))
    outcome, message, waited = outcomes[0]
    assert outcome == "RuntimeError" and codes[0] != 0
    assert waited < 2 * LIVENESS_S + 2  # silent for LIVENESS_S, checked once a fifth of a second
    if fault == "hung":
        assert "rank 1 has made no progress" in message


def test_rank_0_stopped_in_its_checkpoint_write_fails_the_others_naming_it(tmp_path):
    """A background beating thread does not hide a rank that stops: it stops with it."""
    outcomes, codes = _liveness_run("checkpoint", "hung", watch=(1,), extra=(str(tmp_path / "ckpt.pt"),))
    outcome, message, waited = outcomes[1]
    assert outcome == "RuntimeError" and codes[1] != 0
    assert "rank 0 has made no progress" in message and waited < 2 * LIVENESS_S + 2


@pytest.mark.parametrize("scenario", ["evaluate", "broadcast"])
def test_slow_past_the_collective_timeout_is_waited_for(scenario):
    """An evaluation shard that is one long generate call (it beats every decoding step, not once per
    call), and a from_rank0 whose broadcast outlasts the collective timeout (it runs under liveness,
    not in the default group): the waiting rank waits past SHORT_S, and both return."""
    outcomes, codes = _liveness_run(scenario, "slow", limit_s=SHORT_S)
    assert codes == [0, 0], outcomes
    outcome, _, waited = outcomes[1 if scenario == "broadcast" else 0]
    assert outcome == "returned" and waited > 2 * SHORT_S


def test_rank_0_stopped_in_a_broadcast_fails_the_others_naming_it():
    outcomes, codes = _liveness_run("broadcast", "hung", watch=(1,), limit_s=SHORT_S)
    outcome, message, _ = outcomes.get(1, ("hung", "", None))  # no outcome: rank 1 was still waiting when killed
    assert outcome == "RuntimeError" and codes[1] != 0
    assert "rank 0 has made no progress" in message and "pickling" in message, message


def test_rank_0_io_past_its_deadline_fails_the_others_naming_it(tmp_path):
    """beating vouches for rank 0's checkpoint write for --io-deadline seconds (here 1), no longer: a
    write that outlasts it (3 x LIVENESS_S here; a hung file system in life) fails the waiting rank,
    whose message names rank 0, what it was doing and the flag to raise if the write was only slow."""
    outcomes, codes = _liveness_run("checkpoint", "slow", watch=(1,), extra=(str(tmp_path / "ckpt.pt"),),
                                    limit_s=SHORT_S, io_deadline_s=1.0)
    outcome, message, _ = outcomes[1]
    assert outcome == "RuntimeError" and codes[1] != 0, outcomes
    assert "rank 0 has made no progress" in message and "writing" in message and "--io-deadline" in message, message


def _plain_barrier_worker(rank, port, late_s, timeout_s, q):
    """Ranks joined without Liveness, with a collective timeout of 1 s; rank 1 reaches the barrier
    late_s late. Rank 0 reports (outcome, message, seconds)."""
    import datetime
    from harness.liveness import until_all_arrive
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=1))
    if rank == 1:
        time.sleep(late_s)
    t0 = time.time()
    try:
        for _ in until_all_arrive(timeout_s=timeout_s):
            time.sleep(0.01)
        dist.all_reduce(torch.ones(1))  # and the default group works on
        outcome = ("returned", "")
    except RuntimeError as e:
        outcome = ("RuntimeError", str(e))
    if rank == 0:
        q.put((*outcome, time.time() - t0))
        q.close()
        q.join_thread()
    os._exit(0)


@pytest.mark.parametrize("late_s,timeout_s", [(3.0, 6.0), (30.0, 3.0)])
def test_a_barrier_without_liveness_is_judged_by_its_timeout_s(late_s, timeout_s):
    """Without a Liveness the idle barrier waits timeout_s, not the default group's collective
    timeout (1 s here): a rank 3 s late within a 6 s timeout_s is waited for; one that never comes
    fails the other at timeout_s, with the barrier's message rather than gloo's."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    procs = [ctx.Process(target=_plain_barrier_worker, args=(r, store.port, late_s, timeout_s, q)) for r in range(2)]
    for p in procs:
        p.start()
    procs[0].join(timeout=60)
    for p in procs:
        p.kill()
        p.join()
    outcome, message, waited = q.get(timeout=5)
    if late_s < timeout_s:
        assert outcome == "returned", message
    else:
        assert outcome == "RuntimeError" and "barrier not completed after" in message, message
        assert timeout_s <= waited < timeout_s + 5


def test_three_ranks_one_hung_all_others_fail_naming_it():
    """Rank 0 watches every rank, the others watch rank 0 only (reads that grow as W, not W^2); rank 0
    names the silent rank 2, and rank 1, which never reads rank 2's counter, fails with rank 0's verdict."""
    outcomes, codes = _liveness_run("wait", "hung", world=3, watch=(0, 1))
    for rank in (0, 1):
        outcome, message, waited = outcomes[rank]
        assert outcome == "RuntimeError" and codes[rank] != 0
        assert "rank 2 has made no progress" in message, message
        assert waited < 3 * LIVENESS_S + 2
    assert "found by rank 0" in outcomes[1][1]


# ----------------------------------------------------------------------------- one store, successive groups

def _group_worker(rank, port, delay, q):
    """One rank of a 2-rank torchrun group: compute_init with the environment torchrun sets (the
    store hosted by its agent, here the test), and a restart count that does not change."""
    from harness import distributed
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port), TORCHELASTIC_USE_AGENT_STORE="True", TORCHELASTIC_RESTART_COUNT="0",
                      OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    agreed, real = [], distributed.agree_prefix

    def spy(*a, **kw):
        agreed.append(real(*a, **kw))
        return agreed[-1]
    distributed.agree_prefix = spy
    time.sleep(delay)
    distributed.compute_init("cpu")
    t = torch.full((1,), float(rank + 1))
    dist.all_reduce(t)
    q.put((rank, agreed[0], t.item()))
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


def _successive_groups(store, delays_per_group):
    """One 2-rank group after another on `store`, rank r of each starting delays[r] seconds late.
    -> per group {rank: (prefix, all-reduced total)}."""
    ctx = mp.get_context("spawn")
    groups = []
    for delays in delays_per_group:
        q = ctx.Queue()
        _start_and_join(ctx, _group_worker, [(r, store.port, delays[r], q) for r in range(2)], "a group hung")
        groups.append(dict((rank, (prefix, total)) for rank, prefix, total in (q.get(timeout=5) for _ in range(2))))
    for g in groups:
        assert g[0][0] == g[1][0]  # one prefix per group
        assert g[0][1] == g[1][1] == 3.0  # and the group works
    return groups


def test_successive_groups_on_one_store_agree_on_fresh_prefixes():
    """A second group on the store of a first (an elastic restart that keeps the restart count:
    nodes joined or left) must not read the first group's keys: rank 1 comes first and finds them
    all, rank 0 comes 1.5 s later. Each group agrees on one prefix, a new one, and works."""
    store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    groups = _successive_groups(store, ((0.0, 0.0), (1.5, 0.0)))
    assert groups[0][0][0] != groups[1][0][0]


def test_the_idle_ranks_train_the_drafter_as_hard_as_its_top1_asks():
    """scheduler.add_top1 keeps the last TOP1_STEPS steps' figures and skips a step nobody scored;
    drafter_schedule: --drafter-online-lr at TOP1_GENTLE and above, --drafter-cold-lr at TOP1_HARDEST and below,
    geometric in between, on --drafter-depth passes; a cold start follows a cosine from the cold rate
    down to a twentieth of it, teacher-forced (depth 1), whatever the top-1."""
    import math
    from types import SimpleNamespace
    from scheduler import TOP1_STEPS, TOP1_GENTLE, TOP1_HARDEST, add_top1, drafter_schedule, mean_top1
    recent = []
    for i in range(TOP1_STEPS + 2):
        recent = add_top1(recent, 0.5 if i < 2 else 1.0, 10)  # the two weak steps fall out of the window
    assert add_top1(recent, None, 0) == recent  # no rank had time to score: the figure is unchanged
    assert len(recent) == TOP1_STEPS and mean_top1(recent) == 1.0 and mean_top1([]) is None
    assert mean_top1(add_top1([[5.0, 10]], 1.0, 30)) == 35 / 40  # weighted by positions scored
    warm = SimpleNamespace(drafter_warmup_steps=100, drafter_online_lr=1e-4, drafter_cold_lr=1e-2, drafter_depth=3, rl_steps=11)
    assert drafter_schedule(warm, 5, None) == (1e-4, 3) and drafter_schedule(warm, 5, TOP1_GENTLE + 0.01) == (1e-4, 3)
    assert drafter_schedule(warm, 5, TOP1_HARDEST - 0.1) == (pytest.approx(1e-2), 3)
    assert drafter_schedule(warm, 5, (TOP1_GENTLE + TOP1_HARDEST) / 2) == (pytest.approx(1e-3), 3)  # the geometric mean
    cold = SimpleNamespace(**{**vars(warm), "drafter_warmup_steps": 0, "rl_steps": 5})
    assert drafter_schedule(cold, 0, 0.99) == (pytest.approx(1e-2), 1)
    quarter = 1e-2 / 20 + (1e-2 - 1e-2 / 20) * (1 + math.cos(math.pi / 4)) / 2  # a quarter of the way: a cosine, not a line
    assert drafter_schedule(cold, 1, None) == (pytest.approx(quarter), 1)
    assert drafter_schedule(cold, 4, None) == (pytest.approx(1e-2 / 20), 1)


def test_a_dead_groups_hello_is_answered_then_replaced_by_the_live_ranks():
    """Rank 0 of the second group comes first and finds the first group's rank 1 hello (a dead
    nonce) in the store: it answers it, harmlessly; 3 s later the live rank 1 replaces it with its
    own nonce mid-handshake, and rank 0 must answer that one too (answering each rank's first hello
    only would leave the live rank 1 waiting). The group agrees on a fresh prefix and works."""
    store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    first = _successive_groups(store, ((0.0, 0.0),))[0]
    dead_nonce = store.get("tlt/hello/1").decode()
    second = _successive_groups(store, ((0.0, 3.0),))[0]
    assert second[0][0] != first[0][0]
    assert store.get("tlt/hello/1").decode() != dead_nonce  # the live rank's hello replaced the dead one
    assert f"tlt/{store.get(f'tlt/welcome/{dead_nonce}').decode()}/" == second[0][0]  # which rank 0 had answered
