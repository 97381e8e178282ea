"""What every file shares that is neither distributed nor checkpoints: seeds, timing, batching, command lines.

nanochat keeps such helpers in one small common module; so does this project, so that each concept
file holds its concept and nothing else. Nothing here knows about models or the technique, and a
reader learning TLT may skip this file (and distributed.py, liveness.py, checkpoint.py with it).

    derive_seed                            one random stream per purpose, rank and step (the purposes: task.Seed)
    sync, Stopwatch, add_segment, machine  timing: the clock must see a GPU's queued work; timelines; the hardware
    group_by_length                        length-grouped batches for long-tailed data
    OneLineParser, on_off, check_out_dir,  command lines: one clear error line; --device
    wants_cuda
    DEBUG, check                           TLT_DEBUG=1: the invariants the running batch and the sibling lookup state

Test: python -m pytest tests/test_train.py   (a run uses every one of them)
"""
import argparse
import contextlib
import os
import platform
import time

import torch

DEBUG = os.environ.get("TLT_DEBUG") == "1"  # check the invariants speculative.RunningBatch and drafter.SiblingDrafter state


def check(ok, what):
    """An invariant check, made where `DEBUG` is on (callers test `common.DEBUG` first, so off it
    costs nothing): ok, a bool or a bool tensor, must hold everywhere. Reading a tensor is a sync:
    debug runs only."""
    if not bool(torch.as_tensor(ok).all()):
        raise AssertionError(f"invariant broken: {what}")


def derive_seed(*parts):
    """A seed for (base seed, rank or row, step, purpose), or any tuple of integers: each random
    stream gets its own seed, and nothing reseeds the global generator inside a loop."""
    h = 0
    for x in parts:
        h = (h * 1_000_003 + int(x)) % (2 ** 61 - 1)
    return h


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


def wants_cuda(device_arg):
    """--device auto|cpu|cuda -> whether to run on CUDA."""
    return torch.cuda.is_available() if device_arg == "auto" else device_arg == "cuda"


def check_out_dir(out_dir):
    try:
        os.makedirs(out_dir, exist_ok=True)
        probe = os.path.join(out_dir, f".write_test.{os.getpid()}")
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as e:
        raise SystemExit(f"error: cannot write to --out-dir {out_dir!r}: {e.strerror}")
