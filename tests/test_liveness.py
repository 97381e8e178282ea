"""Slow is not dead (harness/liveness.py), in every wait where ranks arrive far apart (the idle
barrier, the drafter warm-up, evaluation, rank 0's checkpoint I/O and broadcasts): slow ranks are
waited for; hung or killed ones, or rank 0 past its I/O deadline, fail the others with a message
naming them; a barrier without Liveness keeps its own timeout, under any backend. Successive groups
on one store agree on fresh prefixes, a dead group's stale hello notwithstanding. Gloo processes, as
in test_scheduler.py, whose helpers these tests share."""
import os
import random
import signal
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from drafter import Drafter, DrafterBuffer, make_optimizer
from harness.liveness import Liveness, watched_barrier
from model import GPT, GPTConfig
from scheduler import IdleWork, idle_train
from test_scheduler import _models, _start_and_join

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
        real, calls = warmup.rollout, []

        def late_rollout(*a, observer=None, **kw):
            if not calls:  # the first of its rollouts (the training samples, then the held-out ones)
                _late_work(fault, lambda: observer(None, None))  # fails if warmup_drafter passes no observer
            calls.append(1)
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
    """Ranks joined without Liveness, in a default group that, like NCCL's, gives no CPU backend to
    ask for (its gloo still runs the barrier); rank 1 reaches the barrier late_s late. Rank 0 reports
    (outcome, message, seconds)."""
    import datetime
    from harness.liveness import until_all_arrive
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=30))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=datetime.timedelta(seconds=20))
    get_backend = dist.ProcessGroup._get_backend

    def no_cpu_backend(group, device):
        if torch.device(device).type == "cpu":
            raise RuntimeError("No backend type associated with device type cpu")
        return get_backend(group, device)
    dist.ProcessGroup._get_backend = no_cpu_backend
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
    """Without a Liveness the idle barrier runs in the default group, whatever its backend (under NCCL
    there is no CPU one to ask for its timeout), and fails after timeout_s (or the group's timeout,
    20 s here, the sooner): a rank 3 s late within a 6 s timeout_s is waited for; one that never
    comes fails the other at timeout_s, with the barrier's message rather than gloo's."""
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
