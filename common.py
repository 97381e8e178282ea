"""What every file shares: distributed init, rank-0 printing, seeds, timing, checkpoints, batching.

nanochat keeps such helpers in one small common module; so does this project, so that each concept
file holds its concept and nothing else. Nothing here knows about models or the technique.

    compute_init, print0, multi_rank, from_rank0   torchrun or a single process, the same code path
    all_sum                                         per-step figures summed over ranks
    OneLineParser, on_off, check_out_dir            command lines: one clear error line
    Seed, derive_seed                               one random stream per purpose, rank and step
    sync, add_segment                               timing: the clock must see a GPU's queued work; timelines
    save_atomic, load_checked, load_on_rank0        checkpoints: atomic, finite, settings checked
    group_by_length                                 length-grouped batches for long-tailed data

Test: python -m pytest tests/test_train.py
"""
import argparse
import datetime
import enum
import os
import socket
import warnings

import torch
import torch.distributed as dist
from torch.distributed.rendezvous import rendezvous

# seconds: how long a collective may wait, and how long a rank may go without a sign of progress
# while its peers wait for it at the idle barrier (scheduler.Liveness) before they fail
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
        # after torchrun restarts a failed group (--max-restarts), the agent's store still holds the
        # dead group's addresses; a prefix per attempt keeps the new group from dialling them
        store = dist.PrefixStore(f"tlt/attempt{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)
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
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


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


def add_segment(segments, kind, start, end):
    """Timelines: [kind, start, end] segments, one more segment or the last one stretched to `end`."""
    if segments and segments[-1][0] == kind:
        segments[-1][2] = end
    else:
        segments.append([kind, start, end])


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()  # sync: the clock must see the GPU's work


def save_atomic(obj, path):
    for name, t in _tensors(obj):
        if t.is_floating_point() and not torch.isfinite(t).all():  # never let NaN weights replace good ones
            raise RuntimeError(f"refusing to write {path}: {name} is not finite")
    tmp = f"{path}.tmp"
    torch.save(obj, tmp)
    os.replace(tmp, path)  # a kill before this line leaves the previous file intact


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
