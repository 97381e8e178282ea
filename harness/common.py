"""train.py's and the commands' start: command lines, --device, the folders, the machine's name.
Plumbing a learner may skip.

OneLineParser, stop and on_off (bad input: one error line, from rank 0), wants_cuda
(--device), sync and machine (timing sees a GPU's queued work; what a figure was measured on),
check_out_dir (--out-dir and --warmup-dir written to, and one folder for every machine).

Test: python -m pytest tests/test_train.py tests/test_distributed.py
"""
import argparse
import contextlib
import os
import platform
import socket
import sys
import time
import uuid

import torch


def machine(device):
    """What a figure was measured on, for the first lines of train.py and bench.py: the GPU's name,
    or the CPU's model, its cores and this process's torch threads. Speed ratios move with it."""
    if device.type == "cuda":
        return f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}"
    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:  # no such file: not Linux
        cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    return f"{cpu}, {os.cpu_count()} cores, {torch.get_num_threads()} torch thread(s) per rank, torch {torch.__version__}"


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()  # sync: the clock must see the GPU's work


def on_off(v):
    if v not in ("on", "off"):
        raise argparse.ArgumentTypeError(f"expected on or off, got {v!r}")
    return v == "on"


def stop(message, code=1):
    """End this rank when every rank stops for the same reason (a refused flag, file or folder): rank
    0 prints `message`, the others nothing, so the job says it once, without a traceback. torchrun
    stops every rank once one exits with an error, so the others leave 30 s later: first, they could
    have rank 0 stopped before it had said why."""
    if int(os.environ.get("RANK", 0)) == 0:
        print(message, file=sys.stderr)
    elif "TORCHELASTIC_RUN_ID" in os.environ:  # set by torchrun
        time.sleep(30)  # torchrun stops this rank once rank 0 has left
    raise SystemExit(code)


class OneLineParser(argparse.ArgumentParser):
    """Bad input: one clear line on stderr and exit code 2 (argparse's default prints the usage too),
    from rank 0 only under torchrun: every rank parses the same flags."""

    def error(self, message):
        stop(f"error: {message} (see --help)", code=2)


def wants_cuda(device_arg):
    """--device auto|cpu|cuda -> whether to run on CUDA."""
    return torch.cuda.is_available() if device_arg == "auto" else device_arg == "cuda"


FOLDER_FLAGS = ("--out-dir", "--warmup-dir")


def check_out_dir(*folders, store=None):
    """Each folder (--out-dir, then --warmup-dir) made if missing and written to by every rank; under
    torchrun (`store`, the rendezvous store) also one folder for every machine, since rank 0 alone
    writes checkpoints and warm-ups and a restart may put it on another machine: rank 0's test file
    holds a token that each machine's first rank reads back. Else one error line from rank 0, exit 1."""
    rank, host, token, problem = int(os.environ.get("RANK", 0)), socket.gethostname(), uuid.uuid4().hex, ""
    probes = [os.path.join(folder, f".write_test.{host}.{rank}") for folder in folders]  # a pid repeats across machines
    for folder, flag, probe in zip(folders, FOLDER_FLAGS, probes):
        if os.path.isfile(folder):  # in its own words; makedirs would say "File exists"
            problem = problem or f"{flag} {folder!r} is a file, not a folder"
            continue
        try:
            os.makedirs(folder, exist_ok=True)
            with open(probe, "w") as f:
                f.write(token)
        except OSError as e:
            problem = problem or f"cannot write to {flag} {folder!r}: {e.strerror}"
    if store is not None:  # each machine's first rank reads rank 0's token; every rank learns every rank's problem
        if rank == 0:
            store.set("folders/rank0", f"{host} {'' if problem else token}")
        host0, token0 = store.get("folders/rank0").decode().split(" ")  # get() waits for the key
        for folder, flag in zip(folders, FOLDER_FLAGS) if os.environ.get("LOCAL_RANK") == "0" and token0 else []:
            seen = ""
            with contextlib.suppress(OSError), open(os.path.join(folder, f".write_test.{host0}.0")) as f:
                seen = f.read()
            problem = problem or ("" if seen == token0 else f"{flag} {folder!r} is not one folder for every machine: rank "
                                  f"{rank} on {host} does not see the file that rank 0 on {host0} wrote there; put it "
                                  f"on a filesystem that every machine shares")
        store.set(f"folders/{rank}", problem)
        problem = next(filter(None, (store.get(f"folders/{r}").decode() for r in range(int(os.environ["WORLD_SIZE"])))), "")
    for probe in probes:
        with contextlib.suppress(OSError):  # not written: the error says why
            os.remove(probe)
    if problem:
        stop(f"error: {problem}")
