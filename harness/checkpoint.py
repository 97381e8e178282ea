"""Checkpoints: written atomically and only when finite, read back with their settings checked, and
rank 0's reads and writes waited for by liveness.

A reader learning TLT may skip this file: it is plumbing, nothing in it knows about the technique.

    save_atomic, load_checked       one process: a kill mid-write leaves the previous file; a file made
                                    with other settings is refused with one line naming the differences
    save_on_rank0, load_on_rank0    several ranks: only rank 0 touches the file; the others wait for it
                                    by liveness (rank 0 beats meanwhile, up to --io-deadline) and follow
                                    its answer

Test: python -m pytest tests/test_train.py tests/test_scheduler.py -k "checkpoint or finite or resume"
"""
import os

import torch
import torch.distributed as dist

from harness.distributed import print0
from harness.liveness import beating, from_rank0, wait_for_all


def save_atomic(obj, path):
    """torch.save to a temporary file, then rename: the previous file stays until the new one is whole."""
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
        with beating(f"writing {path}"):
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


class Mismatch(SystemExit):
    """A checkpoint made with other settings; `diff` names the differences in one line."""

    def __init__(self, path, diff):
        super().__init__(f"error: checkpoint {path} was made with a different config ({diff}); "
                         f"delete it or use another --out-dir")
        self.diff = diff


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
        raise Mismatch(path, "; ".join(diff[:4]) + ("; ..." if len(diff) > 4 else ""))
    return ckpt


def load_on_rank0(path, expected_meta, stale="error"):
    """`load_checked` on rank 0, its answer on every rank: the checkpoint, or None when there is none.
    Whether to load or to warm up (or resume) is one decision for all ranks (`from_rank0`),
    so only rank 0 needs to see the file. A refused file stops every rank with rank 0's message;
    with stale="redo" (a cache: the warm-ups) a file made with other settings is passed over
    instead, with one line that names the differences, and the caller makes it afresh."""
    found = None
    if (dist.get_rank() if dist.is_initialized() else 0) == 0 and os.path.exists(path):
        try:
            with beating(f"reading {path}"):  # the others wait for it by liveness, in from_rank0
                found = load_checked(path, expected_meta)
        except Mismatch as e:
            found = ("stale", e.diff) if stale == "redo" else str(e)
        except SystemExit as e:
            found = str(e)
    found = from_rank0(found)
    if isinstance(found, tuple):
        print0(f"not reusing {path}: it was made by other code or settings ({found[1]}); making it afresh")
        return None
    if isinstance(found, str):
        raise SystemExit(found)
    return found
