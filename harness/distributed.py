"""Every step of a run under torchrun (or one process, on the same code path): the start and the
collectives every rank uses. Plumbing a learner may skip.

compute_init joins the group (NCCL or gloo; `connected`: a group that cannot connect fails in one
line naming GLOO_SOCKET_IFNAME) or runs as rank 0 of 1; agree_prefix keeps a restarted group off a
dead group's keys; all_sum, gather_ranks; wrap_ddp puts the target's gradient buckets in their final
order at once; print0. Waits where ranks arrive far apart (COLLECTIVE_TIMEOUT_S,
TLT_COLLECTIVE_TIMEOUT) are liveness.py's.

Test: python -m pytest tests/test_scheduler.py tests/test_distributed.py
"""
import datetime
import os
import socket
import time
import uuid
import warnings

import torch
import torch.distributed as dist
from torch.distributed.rendezvous import rendezvous

from harness.common import wants_cuda

# seconds: how long a rank may go without a sign of progress while its peers wait for it (Liveness:
# they then fail, naming it), and how long a collective that the ranks reach together may take
COLLECTIVE_TIMEOUT_S = int(os.environ.get("TLT_COLLECTIVE_TIMEOUT", 120))


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
        connected(lambda: dist.init_process_group("nccl" if nccl else "gloo", store=store, rank=rank,
                                                  world_size=world_size, timeout=timeout, device_id=device if nccl else None))
    return ddp, rank, local_rank, world_size, device, store


def connected(make_group):
    """make_group() -> its group, or one error line from each machine's first rank. Gloo (and NCCL's
    bootstrap) binds to the address that the machine's hostname resolves to, which on a cluster may be
    127.0.1.1 or a network the other machines cannot reach: the ranks then fail to connect, within
    the group's timeout (TLT_COLLECTIVE_TIMEOUT)."""
    try:
        return make_group()
    except RuntimeError as e:  # torch.distributed.DistError: a connection refused, or no peer within the timeout
        raise SystemExit(f"error: the ranks could not connect ({str(e).splitlines()[0][:160]}); on several machines "
                         f"set GLOO_SOCKET_IFNAME (and NCCL_SOCKET_IFNAME) to the network interface they share"
                         if int(os.environ.get("LOCAL_RANK", 0)) == 0 else 1) from e


def agree_prefix(store, rank, world_size, poll_s=0.05):
    """A store prefix that every rank of this group agrees on and that no earlier group used: after
    an elastic restart the store still holds the dead group's keys (addresses, liveness counters), and
    TORCHELASTIC_RESTART_COUNT cannot name the group (not bumped for nodes joining or leaving). So rank
    0 draws a fresh token and hands it over by a handshake stale keys cannot fool: rank r > 0 posts a
    fresh nonce at hello/r, waits for welcome/<nonce>, confirms at <token>/here/r; rank 0 answers every
    nonce until each rank has confirmed under its token. Each waits at most COLLECTIVE_TIMEOUT_S."""
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


def gather_ranks(record):
    """All ranks' records (any picklable object), in rank order, on every rank."""
    if not multi_rank():
        return [record]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, record)
    return out


def multi_rank():
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def print0(*a, **kw):
    """print on rank 0 only (the RANK that torchrun sets; a single process is rank 0)."""
    if int(os.environ.get("RANK", 0)) == 0:
        print(*a, **kw, flush=True)



def wrap_ddp(model):
    """`model` under DistributedDataParallel, its gradient buckets already rebuilt: DDP reorders them
    after the first backward, and on more than two ranks the layout decides each element's summation
    order, so a resumed run's first update differed in the last bit. One zero-loss backward here
    records the order, and the next forward rebuilds the buckets by it, in every run."""
    net = torch.nn.parallel.DistributedDataParallel(model, forward_sync_buffers=False)  # rotary tables: fixed
    device = next(model.parameters()).device
    (net(torch.zeros(1, 1, dtype=torch.long, device=device))[0].sum() * 0).backward()
    model.zero_grad(set_to_none=True)
    return net
