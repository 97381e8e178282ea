"""What the harness shares that is neither distributed nor checkpoints: timing, command lines.

nanochat keeps such helpers in one small common module; so does this project, so that each concept
file holds its concept and nothing else. Nothing here knows about models or the technique, and a
reader learning TLT may skip this file (and distributed.py, liveness.py, checkpoint.py with it).

    sync, machine                          timing: the clock must see a GPU's queued work; the hardware
    OneLineParser, on_off, check_out_dir,  command lines: one clear error line; --device
    wants_cuda

Test: python -m pytest tests/test_train.py   (a run uses every one of them)
"""
import argparse
import os
import platform

import torch


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


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()  # sync: the clock must see the GPU's work


def on_off(v):
    if v not in ("on", "off"):
        raise argparse.ArgumentTypeError(f"expected on or off, got {v!r}")
    return v == "on"


class OneLineParser(argparse.ArgumentParser):
    """Bad input: one clear line on stderr and exit code 2 (argparse's default prints the usage too),
    from rank 0 only under torchrun: every rank parses the same flags."""

    def error(self, message):
        self.exit(2, f"error: {message} (see --help)\n" if int(os.environ.get("RANK", 0)) == 0 else None)


def wants_cuda(device_arg):
    """--device auto|cpu|cuda -> whether to run on CUDA."""
    return torch.cuda.is_available() if device_arg == "auto" else device_arg == "cuda"


def check_out_dir(*folders):
    """Each folder (--out-dir, then --warmup-dir) made if missing and written to; else one error
    line naming its flag, from each machine's first rank only, and exit code 1."""
    for folder, flag in zip(folders, ("--out-dir", "--warmup-dir")):
        if os.path.isfile(folder):  # in its own words; makedirs would say "File exists"
            raise SystemExit(f"error: {flag} {folder!r} is a file, not a folder"
                             if int(os.environ.get("LOCAL_RANK", 0)) == 0 else 1)
        try:
            os.makedirs(folder, exist_ok=True)
            probe = os.path.join(folder, f".write_test.{os.getpid()}")
            with open(probe, "w") as f:
                f.write("ok")
            os.remove(probe)
        except OSError as e:
            # once a machine: its ranks see the same folder (another machine's may differ)
            raise SystemExit(f"error: cannot write to {flag} {folder!r}: {e.strerror}"
                             if int(os.environ.get("LOCAL_RANK", 0)) == 0 else 1)
