"""sample.py: a finished run's target answers prompts with its drafter, the same tokens as plain
decoding, and bad input gets one error line. Speeds are printed, never asserted."""
import os
import sys
from dataclasses import asdict

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from harness import sample  # noqa: E402
from tasks import running_sum as task  # noqa: E402
from conftest import randomize  # noqa: E402
from drafter import Drafter  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402

TASK = task.RunningSum(max_n=4)  # fits the tiny block


@pytest.fixture
def run_dir(tmp_path):
    """What train.py leaves: ckpt.pt (meta, step, target, drafter)."""
    torch.manual_seed(0)
    config = GPTConfig(vocab_size=task.VOCAB_SIZE, block_size=56, n_layer=1, n_head=2, n_embd=16)
    target = randomize(GPT(config).eval(), 0, std=0.3)
    run = randomize(Drafter(target), 1, std=0.3)
    meta = {"model": asdict(config), "rl_task": TASK.meta(), "drafter_layers": 1}
    torch.save({"meta": meta, "step": 9, "model": target.state_dict(), "drafter": run.state_dict()}, tmp_path / "ckpt.pt")
    return str(tmp_path)


def test_serves_prompts_with_the_runs_drafter_on_the_same_tokens(run_dir, capsys):
    sample.main(["--out-dir", run_dir, "--repeats", "1", "--k", "3", "a3 b7 c1:", "a9 b2:"])
    out = capsys.readouterr().out
    assert "a3 b7 c1: " in out and "a9 b2: " in out  # each prompt and its response
    for name in ("plain decoding", "speculative"):
        line = next(ln for ln in out.splitlines() if ln.strip().startswith(name))
        assert "2 of 2 responses the same as plain decoding's" in line, line
    assert "tokens per verify step (k = 3)" in out


def test_held_out_prompts_when_none_are_given(run_dir, capsys):
    sample.main(["--out-dir", run_dir, "--repeats", "1", "--n", "5"])
    out = capsys.readouterr().out
    assert "5 prompts" in out and out.count("[right]") + out.count("[WRONG]") == 5


@pytest.mark.parametrize("argv, says", [
    (["hello"], "is not a problem of this task"),
    (["a3 b7 c1"], "is not a problem of this task"),  # no colon
    (["a1 b2 c3 d4 e5 f6 g7 h8 i9 j0:"], "is too long for the model"),
    (["--k", "0"], "must be positive"),
])
def test_bad_input_is_one_error_line(run_dir, argv, says, capsys):
    with pytest.raises(SystemExit) as e:
        sample.main(["--out-dir", run_dir, *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and says in err and len(err.strip().splitlines()) == 1


def test_missing_checkpoint_is_one_error_line(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        sample.main(["--out-dir", str(tmp_path / "nothing"), "a3:"])
    assert e.value.code == 2 and "no checkpoint at" in capsys.readouterr().err
