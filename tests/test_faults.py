"""A killed rank's run, restarted by torchrun, is the run it would have been: every step logged once,
the same responses at every step, the same target bit for bit, warm-up caches that load
(harness/faults.py). Real torchrun jobs on tiny configs, so each test takes seconds."""
import json
import os
import shutil
import subprocess
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from harness import faults  # noqa: E402
from harness.checkpoint import save_atomic  # noqa: E402
from test_train import TINY  # noqa: E402

# long enough that a stop after the checkpoint of step 1 has records past it: rewards vary, the target moves
FLAGS = TINY + ["--max-n", "2", "--n-embd", "32", "--warmup-steps", "150", "--warmup-tokens", "512",
                "--warmup-lr", "1e-2", "--group-size", "4", "--eval-per-bucket", "0", "--rl-steps", "6",
                "--rl-lr", "3e-3", "--ckpt-every", "2"]


def test_the_fault_command_kills_in_the_phases_asked_and_checks_each_trial(tmp_path):
    out = tmp_path / "faults"
    r = subprocess.run([sys.executable, "-m", "harness.faults", "--trials", "2", "--phases",
                        "checkpoint-write,idle-loop", "--out-dir", str(out), "--", *FLAGS],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    rows = [json.loads(line) for line in open(out / "trials.jsonl")]
    assert sorted(row["phase"] for row in rows) == ["checkpoint-write", "idle-loop"]
    for row in rows:
        assert row["killed"] in ("inside", "at its end") and faults.passed(row)
        assert row["phase"] != "checkpoint-write" or row["rank"] == 0  # only rank 0 writes
    assert "2 of 2 trials killed a rank and ended as the reference did" in r.stdout
    assert len({row["reward"] for row in faults.records(str(out / "reference"))}) > 1  # the target moves

    # each check fails on a run that differs from the reference in what it checks
    reference = str(out / "reference")
    assert faults.passed({"finished": True, **faults.compare(reference, reference, 6)})
    for defect in ("a step logged twice", "a response changed", "a weight changed", "a torn cache"):
        bad = str(tmp_path / "bad")
        shutil.rmtree(bad, ignore_errors=True)
        shutil.copytree(reference, bad)
        lines = open(os.path.join(bad, "metrics.jsonl")).readlines()
        if defect == "a step logged twice":
            lines.insert(3, lines[2])
        if defect == "a response changed":
            rec = json.loads(lines[4])
            lines[4] = json.dumps({**rec, "responses_digest": "0" * len(rec["responses_digest"])}) + "\n"
        open(os.path.join(bad, "metrics.jsonl"), "w").writelines(lines)
        if defect == "a weight changed":
            ck = torch.load(os.path.join(bad, "ckpt.pt"), map_location="cpu", weights_only=True)
            ck.pop("digest")
            w = next(iter(ck["model"].values()))
            w.view(-1)[0] = torch.nextafter(w.view(-1)[0], torch.tensor(1e9))  # one ulp
            save_atomic(ck, os.path.join(bad, "ckpt.pt"))
        if defect == "a torn cache":
            path = os.path.join(bad, "target_warmup.pt")
            os.truncate(path, os.path.getsize(path) // 2)
        checks = {"finished": True, **faults.compare(reference, bad, 6)}
        assert not faults.passed(checks), defect


def test_the_fault_command_never_deletes_a_folder_it_did_not_write(tmp_path):
    (tmp_path / "a run of mine.txt").write_text("keep")
    r = subprocess.run([sys.executable, "-m", "harness.faults", "--out-dir", str(tmp_path)], cwd=ROOT,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.startswith("error: --out-dir") and len(r.stderr.splitlines()) == 1
    assert (tmp_path / "a run of mine.txt").read_text() == "keep"


def _first_update_after_a_resume(rank, out):
    """Three updates under DDP, then the fourth twice: by the same DDP, and by a new one built from
    a copy of the model and the optimizer's state, as a resumed run builds it. Writes both."""
    import copy
    from harness.distributed import wrap_ddp
    from model import GPT, GPTConfig

    def update(net, opt, i):
        x = torch.randint(0, 50, (4, 12), generator=torch.Generator().manual_seed(100 * i + rank))
        opt.zero_grad()
        with net.no_sync():  # micro-batches, as rl.grpo_update accumulates them
            net(x[:2])[0].pow(2).mean().backward()
        net(x[2:])[0].pow(2).mean().backward()
        opt.step()

    def new(state=None):
        torch.manual_seed(0)
        model = GPT(GPTConfig(vocab_size=50, block_size=16, n_layer=2, n_head=2, n_embd=16))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        if state:
            model.load_state_dict(state[0])
            opt.load_state_dict(state[1])
        return model, wrap_ddp(model), opt

    model, net, opt = new()
    for i in range(3):
        update(net, opt, i)
    state = copy.deepcopy((model.state_dict(), opt.state_dict()))
    update(net, opt, 3)
    resumed, net2, opt2 = new(state)
    update(net2, opt2, 3)
    if rank == 0:
        torch.save((model.state_dict(), resumed.state_dict()), out)


def test_a_new_ddp_sums_each_gradient_in_the_order_of_the_one_it_replaces_on_4_ranks(tmp_path):
    """On more than two ranks a gradient's sum over ranks depends on its place in DDP's bucket, and
    DDP reorders its buckets after the first backward: a resumed run's new DDP must start from that
    order (harness.distributed.wrap_ddp), or its first update differs from the run it resumes in
    the last bit (a plain DDP here: 3.7e-9 apart)."""
    from conftest import run_ranks
    out = str(tmp_path / "models.pt")
    run_ranks(_first_update_after_a_resume, 4, out)
    straight, resumed = torch.load(out, map_location="cpu", weights_only=True)
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)
