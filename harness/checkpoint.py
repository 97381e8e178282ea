"""The run's checkpoints and the warm-ups' caches: written atomically and only when finite, read back
with their contents and settings checked. Plumbing a learner may skip.

save_atomic / load_checked: a kill mid-write leaves the previous file; a torn or damaged file (its
contents' digest) or one made with other settings is refused in one line. save_on_rank0 /
load_on_rank0: only rank 0 touches the file, the others wait by liveness and follow its answer.
bandit_state / load_bandit: a Bandit in a checkpoint. keep_records: a resumed run's records.

Test: python -m pytest tests/test_train.py tests/test_faults.py
"""
import hashlib
import json
import os
from collections import deque

import torch
import torch.distributed as dist

from harness.common import stop
from harness.distributed import print0
from harness.liveness import beating, from_rank0, wait_for_all


def save_atomic(obj, path):
    """torch.save to a temporary file, on disk (fsync), then rename: the previous file stays until the
    new one is whole. The file holds a digest of its contents: a block zeroed by a crash or a disk
    still loads with torch.load, as zero weights, and only the digest tells (`load_checked`)."""
    for name, t in _leaves(obj):  # never let NaN weights replace good ones
        if isinstance(t, torch.Tensor) and t.is_floating_point() and not torch.isfinite(t).all():
            raise RuntimeError(f"refusing to write {path}: {name} is not finite")
    tmp = f"{path}.tmp"
    with open(tmp, "wb") as f:
        torch.save({**obj, "digest": contents_digest(obj)}, f)
        f.flush()
        os.fsync(f.fileno())  # the bytes on disk before the name points at them
    os.replace(tmp, path)  # a kill before this line leaves the previous file intact
    directory = os.open(os.path.dirname(path) or ".", os.O_RDONLY)
    try:
        os.fsync(directory)  # and the rename itself
    finally:
        os.close(directory)


def contents_digest(obj):
    """sha256 of every tensor's bytes and every other value of a checkpoint, in order, by name."""
    h = hashlib.sha256()
    for name, v in _leaves(obj):
        h.update(name.encode())
        if isinstance(v, torch.Tensor):
            t = v.detach().cpu().contiguous()
            h.update(f"{t.dtype}{tuple(t.shape)}".encode())
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        else:
            h.update(repr(v).encode())
    return h.hexdigest()


def save_on_rank0(obj, path):
    """Rank 0 writes the checkpoint (only rank 0 writes files), beating while it does; the others
    wait for it by liveness, so a write that takes minutes fails nobody's next collective."""
    if (dist.get_rank() if dist.is_initialized() else 0) == 0:
        with beating(f"writing {path}"):
            save_atomic(obj, path)
    wait_for_all()


def _leaves(obj, prefix=""):
    """(name, value) of every tensor and every other value that is no dict, list or tuple."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _leaves(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _leaves(v, f"{prefix}[{i}]")
    else:
        yield prefix, obj


class Mismatch(SystemExit):
    """A checkpoint made with other settings; `diff` names the differences in one line."""

    def __init__(self, path, diff):
        super().__init__(f"error: checkpoint {path} was made with a different config ({diff}); "
                         f"delete it or use another --out-dir")
        self.diff = diff


def load_checked(path, expected_meta, folder="--out-dir"):
    """Load a checkpoint saved with meta=expected_meta; exit with one clear line otherwise: a file
    that cannot be read (torn, zeroed, not a checkpoint), whose contents are not what was written
    (its digest), or that was made with other settings (`Mismatch`)."""
    what = f"delete it or use another {folder}"
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # truncated, zeroed, or not a checkpoint
        raise SystemExit(f"error: cannot read checkpoint {path} ({type(e).__name__}); {what}")
    digest = ckpt.pop("digest", None) if isinstance(ckpt, dict) else None
    if digest != contents_digest(ckpt):
        raise SystemExit(f"error: checkpoint {path} is damaged (its contents do not match the digest "
                         f"written with them); {what}")
    got = ckpt.get("meta") if isinstance(ckpt, dict) else None
    if got != expected_meta:
        want = dict(_leaves(expected_meta))
        have = dict(_leaves(got if isinstance(got, dict) else {}))
        diff = [f"{k} {have.get(k)} there, {want.get(k)} here" for k in sorted(set(want) | set(have))
                if want.get(k) != have.get(k)]
        raise Mismatch(path, "; ".join(diff[:4]) + ("; ..." if len(diff) > 4 else ""))
    return ckpt


def load_on_rank0(path, expected_meta, cache=False):
    """`load_checked` on rank 0, its answer on every rank: the checkpoint, or None when there is none.
    Whether to load or to warm up (or resume) is one decision for all ranks (`from_rank0`),
    so only rank 0 needs to see the file. A refused file stops every rank, and rank 0 says why (`stop`).
    With cache=True (the warm-ups) a file made with other settings is not reused: rank 0 says why in
    one line and the answer is None, so the caller makes it afresh and writes it over that file."""
    found = None
    if (dist.get_rank() if dist.is_initialized() else 0) == 0 and os.path.exists(path):
        try:
            with beating(f"reading {path}"):  # the others wait for it by liveness, in from_rank0
                found = load_checked(path, expected_meta, "--warmup-dir" if cache else "--out-dir")
        except Mismatch as e:  # a cache: made afresh; a run's checkpoint: refused
            if cache:
                print0(f"not reusing {path}: it was made from other traces or settings ({e.diff}); "
                       f"making it afresh")
            else:
                found = str(e)
        except SystemExit as e:
            found = str(e)
    found = from_rank0(found)
    if isinstance(found, str):
        stop(found)
    return found


def bandit_state(bandit):
    """A rollout.Bandit's scores and random state, as plain lists (a checkpoint's "bandits")."""
    return {"plays": [[b, a, list(r)] for (b, a), r in bandit.plays.items()],
            "rng": list(bandit.rng.getstate()[1]), "rng_version": bandit.rng.getstate()[0]}


def load_bandit(bandit, state):
    bandit.plays = {(b, a): deque(map(tuple, r), maxlen=bandit.window) for b, a, r in state["plays"]}
    bandit.rng.setstate((state["rng_version"], tuple(state["rng"]), None))


def keep_records(path, start):
    """Keep the records of the steps before `start`; a line that a kill cut short has no newline."""
    with open(path, "a+") as f:  # made if missing
        f.seek(0)
        lines = [ln for ln in f if ln.endswith("\n") and json.loads(ln)["step"] < start]
    with open(path, "w") as f:
        f.writelines(lines)
