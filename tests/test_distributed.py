"""Two torchrun agents on one machine stand for two nodes (harness/distributed.py, and common.py's
folder check): the README's several-machines command writes the run that one agent of the same
world size writes, bit for bit; a folder that is not one for every node, a write test that two nodes
could share and a gloo group that cannot connect each end in one clear line. Real processes: seconds."""
import contextlib
import datetime
import io
import json
import os
import socket
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from harness import common  # noqa: E402
from conftest import run_ranks  # noqa: E402
from test_train import ENV  # noqa: E402

# the quick try's sizes (README, "Fork it") on the running sum, with fewer warm-up and RL steps
QUICK = ["--task", "running_sum", "--max-n", "4", "--block-size", "64", "--n-layer", "2", "--n-embd", "32", "--warmup-steps", "30",
         "--drafter-warmup-steps", "0", "--eval-per-bucket", "0", "--rl-steps", "4", "--ckpt-every", "100"]


def torchrun(where, args, out):
    cmd = [sys.executable, "-m", "torch.distributed.run", *where, "train.py", "--device", "cpu", *args, "--out-dir", out]
    return subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def two_nodes(args, outs):
    """The README's several-machines command, one rank a node, as two agents on this machine."""
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    return [torchrun(["--nnodes=2", "--nproc_per_node=1", "--rdzv_backend=c10d", f"--rdzv_endpoint=localhost:{port}"],
                     args, out) for out in outs]


def finish(agents, timeout=300):
    """-> each agent's (exit code, output)."""
    return [(a.communicate(timeout=timeout)[0], a.returncode)[::-1] for a in agents]


def test_two_nodes_write_the_run_that_one_node_of_two_ranks_writes(tmp_path):
    """The same responses at every step and the same final target, bit for bit, whether two ranks
    are one machine's or one on each of two."""
    warm = ["--warmup-dir", str(tmp_path / "warm")]
    runs = {"one": ["--standalone", "--nproc_per_node=2"], "two": None}
    for name, where in runs.items():
        out = str(tmp_path / name)
        agents = [torchrun(where, QUICK + warm, out)] if where else two_nodes(QUICK + warm, [out, out])
        for rc, log in finish(agents):
            assert rc == 0, log[-3000:]
        runs[name] = ([json.loads(line)["responses_digest"] for line in open(os.path.join(out, "metrics.jsonl"))],
                      torch.load(os.path.join(out, "ckpt.pt"), map_location="cpu", weights_only=True)["model"])
    (digests, model), (digests2, model2) = runs.values()
    assert len(digests) == 4 and digests2 == digests
    assert model.keys() == model2.keys() and all(torch.equal(model[k], model2[k]) for k in model)


def _first_ranks_of_two_machines(rank, port, tmp):
    """Two ranks, each the first of a machine of its own (LOCAL_RANK 0). check_out_dir with one folder
    for both, then with a folder each; then rank 0 makes the Liveness's gloo group, which rank 1, standing
    for a rank that gloo cannot reach, never joins. What each said -> tmp/said.<rank>."""
    from harness.liveness import Liveness
    os.environ.update(RANK=str(rank), LOCAL_RANK="0", WORLD_SIZE="2")
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=30))
    said = {}
    for trial, folder in (("shared", "both"), ("not shared", f"node{rank}")):
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                common.check_out_dir(os.path.join(tmp, folder), store=dist.PrefixStore(trial, store))
            said[trial] = ""
        except SystemExit as e:
            said[trial] = err.getvalue().strip() or str(e.code)
    dist.init_process_group("gloo", store=dist.PrefixStore("group", store), rank=rank, world_size=2)
    t0 = time.time()
    if rank == 0:
        try:
            Liveness(store, 0, 2, timeout_s=2.0)
            said["gloo"] = "connected"
        except SystemExit as e:
            said["gloo"] = str(e.code)
        store.set("done", "")
    store.get("done")  # rank 1 never joins the group, and ends after rank 0
    with open(os.path.join(tmp, f"said.{rank}"), "w") as f:
        json.dump({**said, "seconds": time.time() - t0}, f)


@pytest.fixture(scope="module")
def first_ranks_said(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("two_machines")
    store = dist.TCPStore("127.0.0.1", 0, None, True, wait_for_workers=False)  # held here: see conftest.run_ranks
    run_ranks(_first_ranks_of_two_machines, 2, store.port, str(tmp), group=False, timeout_s=60)
    return tmp, [json.load(open(tmp / f"said.{r}")) for r in range(2)]


def test_an_out_dir_that_is_not_one_folder_for_every_machine_is_said_once(first_ranks_said):
    """The second machine's --out-dir is another folder (a local disk): rank 0 says so, the other rank
    nothing; one folder for both passes, and no test file is left."""
    tmp, (said0, said1) = first_ranks_said
    assert said0["shared"] == said1["shared"] == "" and said1["not shared"] == "1"
    error = said0["not shared"]
    assert error.startswith("error: --out-dir") and "node1' is not one folder for every machine" in error, error
    assert "rank 1 on" in error and "filesystem that every machine shares" in error, error
    assert os.listdir(tmp / "both") == os.listdir(tmp / "node0") == []


def test_the_write_test_files_of_two_nodes_do_not_collide(tmp_path, monkeypatch):
    """A rank on another machine, with the same pid (containers), runs its write test while this
    rank's test file is there: each removes only its own, and neither fails."""
    remove, still_there = os.remove, []

    def remove_after_the_other_node(path):
        if not still_there:  # the other node writes and removes its test file now, then this rank goes on
            with monkeypatch.context() as m:
                m.setattr(os, "remove", remove)
                m.setattr(socket, "gethostname", lambda: "node-b")
                m.setenv("RANK", "1")
                common.check_out_dir(str(tmp_path))
            still_there.append(os.path.exists(path))
        remove(path)
    monkeypatch.setattr(os, "remove", remove_after_the_other_node)
    monkeypatch.setattr(socket, "gethostname", lambda: "node-a")
    monkeypatch.setenv("RANK", "0")
    common.check_out_dir(str(tmp_path))
    assert still_there == [True] and os.listdir(tmp_path) == []


def test_a_gloo_group_that_cannot_connect_fails_in_bounded_time_naming_gloo_socket_ifname(first_ranks_said):
    """Under NCCL the waits' gloo group is the only gloo one: had it the waits' timeout of days when it
    connects, a rank that gloo cannot reach would hang the start for days. It fails within its
    timeout (2 s here, TLT_COLLECTIVE_TIMEOUT in a run), in one line."""
    message, seconds = first_ranks_said[1][0]["gloo"], first_ranks_said[1][0]["seconds"]
    assert message.startswith("error:") and "GLOO_SOCKET_IFNAME" in message and "\n" not in message, message
    assert seconds < 10
