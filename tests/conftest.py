"""Shared by the tests: the repository root on sys.path, helpers to randomise tiny models, the greedy
setup of the decoding tests, fixtures that fail any use of the network or run on one thread, and
run_ranks, which runs a function on gloo processes."""
import datetime
import os
import random
import socket
import sys
import time

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from drafter import Drafter, DrafterBuffer, make_optimizer, train_step  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402
from speculative import RunningBatch, autoregressive_generate  # noqa: E402


@pytest.fixture
def no_network(monkeypatch):
    """Every way out to the network fails the test: a tokenizer must be built in-process."""
    def refuse(*a, **k):
        raise AssertionError("touched the network")

    for name in ("socket", "create_connection", "getaddrinfo"):
        monkeypatch.setattr(socket, name, refuse)


@pytest.fixture(scope="module")
def one_thread():
    """For a module of tiny models (`pytestmark = pytest.mark.usefixtures("one_thread")`): on a busy
    2-core machine intra-op threads only spin and wait (measured: about 100x slower with 2 threads
    than with 1). Restored after the module."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def randomize(module, seed, std):
    """Re-draw every matrix with N(0, std^2) and every vector (norm gains) around 1, so that the
    model is far from its near-uniform init and greedy outputs vary."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * std)
            else:
                p.copy_(1.0 + 0.5 * torch.randn(p.shape, generator=g, dtype=p.dtype))
    return module


def tiny(V, seed, std=0.5):
    torch.manual_seed(seed)
    return randomize(GPT(GPTConfig(vocab_size=V, block_size=64, n_layer=2, n_head=2, n_embd=16)).eval(),
                     seed, std)


def decode_plainly(batch):
    """Plain steps until every row of a RunningBatch has finished -> its results."""
    while batch.compact() > 0:
        batch.plain_step()
    return batch.results


# the greedy setup that the decoding tests share
V_G = 16
N_NEW = 20
PROMPT_LENS = [1, 3, 5, 2, 7, 4, 6, 2]


def make_greedy_setup():
    """A float64 target, a drafter that agrees with it some of the time, a pool of ragged
    prompts, and an <|eos|> id chosen so that some rows stop on it and others run to the end."""
    target = tiny(V_G, seed=1)
    g = torch.Generator().manual_seed(2)
    # briefly train the drafter on sampled rollouts: an untrained drafter is almost always rejected
    torch.manual_seed(3)
    drafter = Drafter(target)
    train_prompts = [torch.randint(0, V_G, (n,), generator=g).tolist() for n in PROMPT_LENS * 4]
    buf = DrafterBuffer(keep_steps=1)
    for _, tokens, hidden, plen in decode_plainly(RunningBatch(target, train_prompts, 30, temperature=1.0, generator=g)):
        buf.add(0, tokens, hidden, plen)
    opt = make_optimizer(drafter, lr=1e-2)
    rng = random.Random(0)
    for _ in range(60):
        train_step(drafter, opt, buf.sample(16, rng))
    target.double()
    drafter.double()

    pool = [torch.randint(0, V_G, (n,), generator=g).tolist() for n in PROMPT_LENS]
    free, _ = autoregressive_generate(target, pool, N_NEW, temperature=0)
    # outputs must not be trivial: several distinct tokens overall and within rows
    assert len({t for o in free for t in o}) >= 4, free
    assert sum(len(set(o)) >= 3 for o in free) >= 4, free
    # eos: a token that ends some rows early (first seen before the last position) and is absent
    # from other rows (they run to max_new_tokens); the most balanced such token
    best = None
    for v in range(V_G):
        early = [i for i, o in enumerate(free) if v in o[1:-1] and o[0] != v]  # stops after >= 1 SD step
        absent = [i for i, o in enumerate(free) if v not in o]
        if early and absent and (best is None or min(len(early), len(absent)) > best[0]):
            best = (min(len(early), len(absent)), v, early, absent)
    assert best is not None, "no token ends some rows early and is absent from others"
    _, eos, early, absent = best
    # order the pool so that B=1 stops on eos and B=3 has both kinds of row
    order = [early[0], absent[0]] + [i for i in range(len(pool)) if i not in (early[0], absent[0])]
    pool = [pool[i] for i in order]
    free = [free[i] for i in order]
    return target, drafter, pool, free, eos


@pytest.fixture(scope="module")
def greedy_setup():
    """See make_greedy_setup."""
    return make_greedy_setup()


def every_drafter(learned):
    """Each kind of drafter the speculative step takes, by its --drafter name."""
    from harness.model_free import NgramDrafter, SiblingDrafter
    return {"learned": learned, "ngram": NgramDrafter(n=1), "sibling": SiblingDrafter(max_match=4)}


# ----------------------------------------------------------------------------- gloo processes

def run_ranks(fn, world, *args, group=True, timeout_s=120):
    """fn(rank, *args) on `world` spawned processes joined in one gloo group (group=False: none, a
    single process as train.py runs without torchrun). A rank that raises fails the test with its
    traceback; ranks still running after timeout_s fail it as hung. The group meets at a store this
    process opens on port 0 and holds until the ranks are done: a port picked free and closed
    again could be taken by another socket before rank 0 binds it."""
    import torch.distributed as dist
    import torch.multiprocessing as mp
    store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)
    ctx = mp.start_processes(_rank_main, args=(fn, world, store.port, group, args), nprocs=world, join=False,
                             start_method="spawn")
    deadline = time.time() + timeout_s
    try:
        while not ctx.join(timeout=1):  # raises, with the rank's traceback, if a rank failed
            if time.time() > deadline:
                pytest.fail(f"{world} rank(s) hung for {timeout_s}s")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
            p.join()


def join_group(rank, world, port, timeout_s=None):
    """Join the gloo group of `world` ranks whose store a test holds on `port`."""
    import torch.distributed as dist
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=60))
    kw = {"timeout": datetime.timedelta(seconds=timeout_s)} if timeout_s else {}
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, **kw)


def _rank_main(rank, fn, world, port, group, args):
    """One rank of run_ranks. It ends as train.main does: a barrier (nobody tears gloo down while a
    peer still talks to it), then without the C++ static destructors, which now and then abort the
    process after gloo ("terminate called without an active exception", SIGABRT)."""
    import torch.distributed as dist
    torch.set_num_threads(1)  # ranks share the cores
    if group:
        join_group(rank, world, port)
    fn(rank, *args)  # an exception leaves through torch's spawn wrapper, which hands its traceback to run_ranks
    if group:
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
