"""What every file shares: distributed init, rank-0 printing, seeds, timing, checkpoints, batching.

nanochat keeps such helpers in one small common module; so does this project, so that each concept
file holds its concept and nothing else. Nothing here knows about models or the technique.

    compute_init, print0, multi_rank, from_rank0   torchrun or a single process, the same code path
    agree_prefix                                    a restarted group never reads a dead group's keys
    Liveness, until_all_arrive, wait_for_all,       slow is not dead: waits judged by progress, not a fixed time
    beat, beating
    all_sum                                         per-step figures summed over ranks
    OneLineParser, on_off, check_out_dir            command lines: one clear error line
    Seed, derive_seed                               one random stream per purpose, rank and step
    sync, add_segment                               timing: the clock must see a GPU's queued work; timelines
    save_atomic, save_on_rank0, load_checked,       checkpoints: atomic, finite, settings checked; rank 0's
    load_on_rank0                                   reads and writes waited for by liveness
    group_by_length                                 length-grouped batches for long-tailed data

Test: python -m pytest tests/test_train.py tests/test_scheduler.py   (liveness, waits, the store prefix)
"""
import argparse
import contextlib
import datetime
import enum
import math
import os
import platform
import socket
import threading
import time
import uuid
import warnings

import torch
import torch.distributed as dist
from torch.distributed.rendezvous import rendezvous

# seconds: how long a rank may go without a sign of progress while its peers wait for it (Liveness:
# they then fail, naming it), and how long a collective that the ranks reach together may take
COLLECTIVE_TIMEOUT_S = int(os.environ.get("TLT_COLLECTIVE_TIMEOUT", 120))


def wants_cuda(device_arg):
    """--device auto|cpu|cuda -> whether to run on CUDA."""
    return torch.cuda.is_available() if device_arg == "auto" else device_arg == "cuda"


def compute_init(device_arg="auto"):
    """-> (ddp, rank, local_rank, world_size, device, store). Under torchrun (RANK set) this joins
    the process group: NCCL when every rank has a GPU of its own, else gloo (which also reduces CUDA
    tensors, so it serves ranks that share GPUs); `store` is the rendezvous store (the idle
    barrier's liveness check uses it). Without torchrun it is rank 0 of 1, same code path, store None."""
    ddp = "RANK" in os.environ
    rank = int(os.environ.get("RANK", 0))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    store = None
    use_cuda = wants_cuda(device_arg)
    if use_cuda and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda but CUDA is not available")
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    n_gpus = torch.cuda.device_count() if use_cuda else 0
    device = torch.device(f"cuda:{local_rank % n_gpus}" if use_cuda else "cpu")
    if use_cuda:  # more ranks than GPUs: they share them round-robin
        torch.cuda.set_device(device)
    else:  # ranks sharing a CPU: split the cores (unless OMP_NUM_THREADS says how many), or they fight over them
        cores = os.cpu_count() or 1
        if "OMP_NUM_THREADS" not in os.environ:  # torchrun sets it to 1 when it starts several ranks
            torch.set_num_threads(max(1, cores // local_world))
        if local_world > cores and rank == 0:
            warnings.warn(f"{local_world} ranks share {cores} CPU cores: steps will be slow and timings noisy")
    if ddp:
        timeout = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
        store, _, _ = next(rendezvous("env://", rank, world_size, timeout=timeout))
        store = dist.PrefixStore(agree_prefix(store, rank, world_size), store)  # this group's keys only
        # NCCL needs a GPU of its own per rank. Whether the GPUs are distinct is a fact about the
        # machines, not about the GPUs one rank sees (a scheduler may show each rank only its own):
        # every rank posts its (host, GPU uuid) and all compare
        nccl = False
        if use_cuda:
            store.set(f"gpu/{rank}", f"{socket.gethostname()}/{torch.cuda.get_device_properties(device).uuid}")
            owners = {store.get(f"gpu/{r}") for r in range(world_size)}  # get() waits for the key
            nccl = len(owners) == world_size
            if not nccl and rank == 0:
                warnings.warn(f"{world_size} ranks share {len(owners)} GPU(s): collectives go through gloo, not NCCL")
        dist.init_process_group("nccl" if nccl else "gloo", store=store, rank=rank, world_size=world_size,
                                timeout=timeout, device_id=device if nccl else None)
    return ddp, rank, local_rank, world_size, device, store


def agree_prefix(store, rank, world_size, poll_s=0.05):
    """A store prefix that every rank of this group agrees on and that no earlier group used.

    After an elastic agent restarts the workers, the store still holds the dead group's keys (its
    ranks' addresses, their liveness counters); a new group that read them would dial dead ranks.
    TORCHELASTIC_RESTART_COUNT cannot name the group: the agent does not bump it when it restarts
    the workers for nodes joining or leaving, and a node that joins counts its own restarts. So rank
    0 draws a fresh token and hands it to each rank by a handshake that stale keys cannot fool:

        rank r > 0:  posts a fresh nonce at hello/r, waits for welcome/<nonce>, confirms at <token>/here/r
        rank 0:      answers every nonce it finds at hello/r, until each rank has confirmed under the token

    Only the live rank r knows its nonce, so only the live rank 0 can answer it; rank 0 may answer a
    dead rank's stale nonce too, which is harmless, and stops only on a confirmation under its own
    fresh token. Each waits at most COLLECTIVE_TIMEOUT_S (the rendezvous timeout) for the other."""
    if rank > 0:
        nonce = uuid.uuid4().hex
        store.set(f"tlt/hello/{rank}", nonce)
        token = store.get(f"tlt/welcome/{nonce}").decode()  # get() waits for the key
        store.set(f"tlt/{token}/here/{rank}", "")
        return f"tlt/{token}/"
    token, answered, waiting = uuid.uuid4().hex, {}, set(range(1, world_size))
    deadline = time.monotonic() + COLLECTIVE_TIMEOUT_S
    while waiting:
        for r in sorted(waiting):
            hello = store.get(f"tlt/hello/{r}")  # get() waits for the key
            if hello != answered.get(r):  # not answered yet: the live rank's nonce, or a dead one's
                store.set(f"tlt/welcome/{hello.decode()}", token)
                answered[r] = hello
            elif store.check([f"tlt/{token}/here/{r}"]):
                waiting.discard(r)
        if waiting and time.monotonic() > deadline:
            raise RuntimeError(f"rank(s) {sorted(waiting)} did not join within {COLLECTIVE_TIMEOUT_S}s (TLT_COLLECTIVE_TIMEOUT)")
        time.sleep(poll_s if waiting else 0)
    return f"tlt/{token}/"


def all_sum(values, device):
    """{name: number} -> the same names, each summed over ranks."""
    t = torch.tensor(list(values.values()), dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(t)
    return dict(zip(values, t.tolist()))


def multi_rank():
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def from_rank0(obj):
    """Rank 0's `obj` on every rank. Decisions that must agree (load or warm up, resume) are taken
    once, on rank 0, and followed by all: a file that one rank sees and another does not (no shared
    filesystem, a copy still being written) cannot send the ranks down different paths."""
    if not multi_rank():
        return obj
    wait_for_all()  # rank 0 may come late (it read a checkpoint): wait by liveness, not by a fixed timeout
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


# -----------------------------------------------------------------------------
# slow is not dead: waits judged by progress


class Liveness:
    """Tells a slow rank from a dead one. A long-tail rollout, an evaluation shard, a checkpoint
    written by rank 0 can take minutes on a real model, so a rank that waits for the others must not
    give up after a fixed time; it gives up when a peer stops making progress. Every rank bumps its
    own counter in the rendezvous store while it works (`beat`: each decoding step, each idle step;
    at most once every `every_s`), and a waiting rank reads counters (`check`, as often) and raises,
    naming the rank, when one has not moved for `timeout_s` seconds by the waiting rank's own clock.

    Reads that do not grow as W^2: rank 0 watches every peer, the others watch rank 0 alone. When
    rank 0 finds a silent peer it posts its verdict in the store before it fails, and the others fail
    with the same message at their next check (or at once, when rank 0's exit breaks the barrier), so
    every rank's log names the silent rank. A silent rank 0 is caught by all the others.

    The waits (`until_all_arrive`) are barriers in a process group of their own with a timeout of
    days, since liveness is judged here; every other collective keeps the short timeout of the
    default group, as ranks reach those together, right after such a wait. A killed rank closes its
    connections and fails the barrier at once; a hung one (stopped, deadlocked) stops beating.

    A process has one rendezvous store, so one Liveness: the last one made is `Liveness.current`,
    which `wait_for_all`, `beat` and `beating` use, so that no file has to pass it around."""

    current = None

    def __init__(self, store, rank, world_size, timeout_s, every_s=1.0):
        self.store, self.rank, self.world_size = store, rank, world_size
        self.timeout_s, self.every_s = timeout_s, every_s
        self.group = dist.new_group(backend="gloo", timeout=datetime.timedelta(days=7))  # collective: every rank
        self._last_beat = self._last_check = -math.inf
        self._seen = {}  # watched rank -> (its counter, when this rank saw it change)
        Liveness.current = self

    def beat(self):
        now = time.monotonic()
        if now - self._last_beat >= self.every_s:
            self.store.add(f"alive/{self.rank}", 1)
            self._last_beat = now

    def start_wait(self):
        """A new wait: a peer's silence is counted from now (between waits nobody needs to beat)."""
        self._seen, self._last_check = {}, -math.inf

    def verdict(self):
        """Rank 0's message about a silent rank, once it has found one; else None."""
        return self.store.get("verdict").decode() if self.store.check(["verdict"]) else None

    def check(self):
        now = time.monotonic()
        if now - self._last_check < self.every_s:
            return
        self._last_check = now
        verdict = self.verdict() if self.rank > 0 else None
        if verdict:
            raise RuntimeError(verdict)
        for r in range(1, self.world_size) if self.rank == 0 else [0]:
            count = self.store.add(f"alive/{r}", 0)  # adding 0 reads the counter
            if r not in self._seen or self._seen[r][0] != count:
                self._seen[r] = (count, now)
            elif now - self._seen[r][1] > self.timeout_s:
                message = (f"rank {r} has made no progress for {now - self._seen[r][1]:.0f}s "
                           f"(limit {self.timeout_s:.0f}s, TLT_COLLECTIVE_TIMEOUT): it is dead or hung")
                if self.rank == 0:
                    self.store.set("verdict", f"{message} (found by rank 0)")
                raise RuntimeError(message)


def until_all_arrive(liveness=None, grace_s=0.0, timeout_s=COLLECTIVE_TIMEOUT_S):
    """Wait until every rank has got here, however long that takes while they make progress; yields
    once per turn while some have not, so that the caller can use the time (the idle barrier trains
    the drafter, `wait_for_all` sleeps); what it yields, called, says whether they all have now,
    for a turn that can stop midway. A single process returns at once.

    With a Liveness (`liveness`, else `Liveness.current`) this rank beats and checks every turn, and
    fails once a watched rank has been silent for its timeout; without one (ranks joined without the
    rendezvous store), after timeout_s. grace_s: first wait this long without a turn, so that the
    last rank to arrive, which sees the barrier complete within moments, starts nothing that the
    others would wait for. A broken barrier (a peer killed) raises with rank 0's verdict if it has one."""
    if not multi_rank():
        return
    liveness = liveness or Liveness.current
    work = dist.barrier(group=liveness.group if liveness else None, async_op=True)
    t0 = time.perf_counter()
    if liveness:
        liveness.start_wait()
    while not work.is_completed() and time.perf_counter() - t0 < grace_s:
        time.sleep(0.0005)
    while not work.is_completed():
        if liveness:
            liveness.beat()
            liveness.check()
        elif time.perf_counter() - t0 > timeout_s:  # a peer died or hangs: fail loudly, don't wait forever
            raise RuntimeError(f"barrier not completed after {timeout_s:.0f}s: a rank is dead or stuck")
        yield work.is_completed
    try:
        work.wait()  # surfaces an error if the barrier failed
    except RuntimeError as e:  # a peer closed its connections: it crashed, was killed, or rank 0 failed on a silent one
        verdict = liveness.verdict() if liveness else None
        raise RuntimeError(verdict or f"a barrier failed: a peer is gone (torchrun's summary names the rank that "
                                      f"failed first; its log says why): {e}") from e


def wait_for_all():
    """Block until every rank is here, judged by liveness. Call it before a collective that ranks may
    reach far apart (after sampling, an evaluation shard, rank 0's checkpoint I/O): the collective
    itself then starts with every rank present, and its fixed timeout only bounds its own work."""
    for _ in until_all_arrive():
        time.sleep(0.001)


def beat():
    """A sign of progress from this rank (nothing without a Liveness): `progress=beat` for long loops."""
    if Liveness.current:
        Liveness.current.beat()


@contextlib.contextmanager
def beating():
    """Beat from a background thread while the block runs: for one long call that cannot beat from
    inside (rank 0's torch.save or torch.load of a big checkpoint, a first CUDA step). The price: a
    rank that hangs inside the block still looks alive, so this wraps only calls that end (file I/O,
    one step), never a loop that waits on others; a rank that dies or is stopped stops beating all
    the same, its thread with it."""
    live, stop = Liveness.current, threading.Event()

    def keep_beating():
        while live and not stop.wait(live.every_s / 2):
            live.beat()
    thread = threading.Thread(target=keep_beating, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


class Seed(enum.IntEnum):
    """What a derived seed is for: each purpose its own random stream (the numbers only keep them apart)."""
    TARGET_DATA = 1        # the target warm-up's reference traces
    DRAFTER_DATA = 2       # the drafter warm-up's prompts and batches
    DRAFTER_SAMPLES = 3    # the target's samples the drafter warms up on
    INIT = 4               # initial weights, the same on every rank
    BANDIT = 5             # the bandit's exploration
    RL_PROMPTS = 6         # each RL step's prompts, the same on every rank
    ROLLOUT = 7            # rollout sampling with --sampler rejection
    DRAFTER_TRAINING = 8   # idle-rank drafter batches
    EVAL = 9               # evaluation sampling with --sampler rejection
    ROLLOUT_KEYS = 10      # each rollout row's key with --sampler gumbel
    EVAL_KEYS = 11         # each evaluation row's key with --sampler gumbel


def derive_seed(*parts):
    """A seed for (base seed, rank or row, step, purpose), or any tuple of integers: each random
    stream gets its own seed, and nothing reseeds the global generator inside a loop."""
    h = 0
    for x in parts:
        h = (h * 1_000_003 + int(x)) % (2 ** 61 - 1)
    return h


def print0(*a, **kw):
    """print on rank 0 only (the RANK that torchrun sets; a single process is rank 0)."""
    if int(os.environ.get("RANK", 0)) == 0:
        print(*a, **kw, flush=True)


def machine(device):
    """What a figure was measured on, for the first lines of train.py and bench.py: the GPU's name,
    or the CPU's model, its cores and this process's torch threads. Speed ratios move with it."""
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}"
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:  # not Linux
        pass
    return f"{cpu}, {os.cpu_count()} cores, {torch.get_num_threads()} torch thread(s) per rank, torch {torch.__version__}"


def add_segment(segments, kind, start, end):
    """Timelines: [kind, start, end] segments, one more segment or the last one stretched to `end`."""
    if segments and segments[-1][0] == kind:
        segments[-1][2] = end
    else:
        segments.append([kind, start, end])


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()  # sync: the clock must see the GPU's work


class Stopwatch:
    """The time spent in one region of code, summed over its visits, without a sync per visit: CUDA
    events on a GPU, read once by `seconds()`; the host clock on a CPU, where each op is done when
    the call returns."""

    def __init__(self, device):
        self.cuda, self.spans, self.total = device.type == "cuda", [], 0.0

    @contextlib.contextmanager
    def __call__(self):
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
            self.spans.append((start, end))
        else:
            t0 = time.perf_counter()
            yield
            self.total += time.perf_counter() - t0

    def seconds(self):
        if self.spans:
            self.spans[-1][1].synchronize()  # sync: once, for every visit's events
            self.total += sum(a.elapsed_time(b) for a, b in self.spans) / 1000
            self.spans = []
        return self.total


def save_atomic(obj, path):
    for name, t in _tensors(obj):
        if t.is_floating_point() and not torch.isfinite(t).all():  # never let NaN weights replace good ones
            raise RuntimeError(f"refusing to write {path}: {name} is not finite")
    tmp = f"{path}.tmp"
    torch.save(obj, tmp)
    os.replace(tmp, path)  # a kill before this line leaves the previous file intact


def save_on_rank0(obj, path):
    """Rank 0 writes the checkpoint (only rank 0 writes files), beating while it does; the others
    wait for it by liveness, so a write that takes minutes fails nobody's next collective."""
    if (dist.get_rank() if dist.is_initialized() else 0) == 0:
        with beating():
            save_atomic(obj, path)
    wait_for_all()


def _tensors(obj, prefix=""):
    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _tensors(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _tensors(v, f"{prefix}[{i}]")


def _flatten(d, prefix=""):
    out = {}
    for k, v in d.items():
        out.update(_flatten(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def load_checked(path, expected_meta):
    """Load a checkpoint saved with meta=expected_meta; exit with one clear line otherwise."""
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # truncated, corrupt, or not a checkpoint
        raise SystemExit(f"error: cannot read checkpoint {path} ({type(e).__name__}); delete it or use another --out-dir")
    got = ckpt.get("meta") if isinstance(ckpt, dict) else None
    if got != expected_meta:
        want, have = _flatten(expected_meta), _flatten(got if isinstance(got, dict) else {})
        diff = [f"{k} {have.get(k)} there, {want.get(k)} here" for k in sorted(set(want) | set(have))
                if want.get(k) != have.get(k)]
        raise SystemExit(f"error: checkpoint {path} was made with a different config ({'; '.join(diff[:4])}"
                         f"{'; ...' if len(diff) > 4 else ''}); delete it or use another --out-dir")
    return ckpt


def load_on_rank0(path, expected_meta):
    """`load_checked` on rank 0, its answer on every rank: the checkpoint, or None when there is none.
    Whether to load or to warm up (or resume) is one decision for all ranks (`from_rank0`),
    so only rank 0 needs to see the file; a refused file stops every rank with rank 0's message."""
    found = None
    if (dist.get_rank() if dist.is_initialized() else 0) == 0 and os.path.exists(path):
        try:
            with beating():  # the others wait for it by liveness, in from_rank0
                found = load_checked(path, expected_meta)
        except SystemExit as e:
            found = str(e)
    found = from_rank0(found)
    if isinstance(found, str):
        raise SystemExit(found)
    return found


def group_by_length(items, length, token_budget):
    """Sort by length and cut into batches of about `token_budget` padded tokens (a batch is padded
    to its longest item). On long-tailed lengths this keeps padding small; it batches the warm-up
    data and the GRPO micro-batches alike. Always returns at least one (possibly empty) batch."""
    batches, cur = [], []
    for it in sorted(items, key=length):
        if cur and (len(cur) + 1) * length(it) > token_budget:
            batches.append(cur)
            cur = []
        cur.append(it)
    batches.append(cur)
    return batches


def on_off(v):
    if v not in ("on", "off"):
        raise argparse.ArgumentTypeError(f"expected on or off, got {v!r}")
    return v == "on"


class OneLineParser(argparse.ArgumentParser):
    """Bad input: one clear line on stderr and exit code 2 (argparse's default prints the usage too)."""

    def error(self, message):
        self.exit(2, f"error: {message} (see --help)\n")


def check_out_dir(out_dir):
    try:
        os.makedirs(out_dir, exist_ok=True)
        probe = os.path.join(out_dir, f".write_test.{os.getpid()}")
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as e:
        raise SystemExit(f"error: cannot write to --out-dir {out_dir!r}: {e.strerror}")
