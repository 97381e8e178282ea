"""bench.py's measuring pieces: runs take turns, the controlled drafter comparison shares its
prompts and random stream, and bad flags are refused. The timings themselves are reported by
bench.py, never asserted."""
import json
import os
import sys
from types import SimpleNamespace

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
import bench  # noqa: E402
import speculative  # noqa: E402
import task  # noqa: E402
import config  # noqa: E402
from drafter import Drafter  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402
from conftest import randomize  # noqa: E402


def test_interleaved_runs_take_turns_and_report_medians():
    calls = []
    runs = {name: (lambda name=name: calls.append(name) or name.upper()) for name in ("a", "b", "c")}
    times, outs = bench.interleaved(runs, repeats=3)
    assert calls == ["a", "b", "c"] * 3  # round by round, not all of one run first
    assert outs == {"a": "A", "b": "B", "c": "C"}
    assert set(times) == {"a", "b", "c"} and all(t >= 0 for t in times.values())


def tiny_pair(seed):
    torch.manual_seed(seed)
    target = GPT(GPTConfig(vocab_size=task.VOCAB_SIZE, block_size=40, n_layer=1, n_head=2, n_embd=16)).eval()
    return target, Drafter(target).eval()


def test_drafter_comparison_shares_prompts_and_random_stream(tmp_path):
    task_cfg = task.TaskConfig(max_n=4, max_passes=1)  # fits the tiny block
    target, drafter = tiny_pair(0)
    randomize(target, 0, std=0.3)  # near their uniform init, the noise alone would pick every token
    torch.save({"model": target.state_dict(), "drafter": drafter.state_dict()}, tmp_path / "ckpt.pt")
    warm_target, _ = tiny_pair(1)  # another target: the comparison must use the checkpoint's
    same = bench.drafter_vs_target(task_cfg, warm_target, drafter, str(tmp_path), n_prompts=16)
    assert same["adaptive"] == same["frozen"]  # one drafter twice: identical decoding, identical figure
    _, other = tiny_pair(2)
    randomize(other, 2, std=0.3)
    diff = bench.drafter_vs_target(task_cfg, warm_target, other, str(tmp_path), n_prompts=16)
    assert diff["adaptive"] == same["adaptive"]  # the checkpoint's side does not depend on the warm-up drafter
    assert diff["frozen"] != diff["adaptive"]
    assert all(1.0 <= v <= 5.0 for v in (*same.values(), *diff.values()))  # k = 4: 1 to 5 tokens per verify step


def test_drift_moves_a_copy_of_the_target_and_trains_a_copy_of_the_drafter():
    task_cfg = task.TaskConfig(max_n=4, max_passes=1)  # fits the tiny block
    target, drafter = tiny_pair(0)
    randomize(target, 0, std=0.3)  # far from the near-uniform init, where every draft is accepted before and after
    before = {k: v.clone() for k, v in target.state_dict().items()}
    d_before = {k: v.clone() for k, v in drafter.state_dict().items()}
    targs = config.parse_args(["--device", "cpu", "--max-n", "4", "--max-passes", "1", "--block-size", "40", "--warmup-tokens", "256",
                              "--drafter-batch", "4"])
    out = bench.drift_bench(targs, task_cfg, target, drafter, sft_steps=3, n_seqs=64, online_steps=3, n_prompts=8,
                            seeds=(0, 1))["drift"]
    # the originals are untouched: the move and the online training happen on copies
    assert all(torch.equal(v, target.state_dict()[k]) for k, v in before.items())
    assert all(torch.equal(v, drafter.state_dict()[k]) for k, v in d_before.items())
    assert all(len(v) == 2 and all(1.0 <= a <= 5.0 for a in v) for v in out.values())  # k = 4: 1 to 5 per verify
    assert out["moved, frozen drafter"] != out["before the move"]  # the target really moved


@pytest.mark.parametrize("bad", [["--train-args", '"unclosed'], ["--train-args=--bogus"], ["--train-args=--n-layer 0"],
                                 ["--batches", "1,x"], ["--repeats", "0"],
                                 ["--drafters", "/nonexistent/run"], ["--e2e", "--drift"]])
def test_bad_flags_exit_with_usage_error(bad, capsys):
    with pytest.raises(SystemExit) as e:
        bench.parse_args(bad)
    assert e.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_expected_steps_counts_verify_steps_to_emit_a_row():
    """The prediction's step count: drafts always accepted emit k + 1 tokens a step (the last step cut
    at the row's end), never accepted one; in between, the expectation over the emitted counts."""
    assert bench.expected_steps([1.0] * 8, 43) == 5.0  # 9 + 9 + 9 + 9 + 7
    assert bench.expected_steps([0.0] * 4, 10) == 10.0
    # k = 1 at acceptance 1/2: a step emits 1 or 2 tokens alike; 2 tokens take 1 + 1/2 steps
    assert bench.expected_steps([0.5], 2) == pytest.approx(1.5)


def test_host_traffic_report_of_a_rollout_like_train_py(capsys, monkeypatch):
    """The report python bench.py prints: a rollout of train.py's rows for step 0 on one rank, one
    read per decoding step and no copy from the host, as a JSON-ready figure."""
    monkeypatch.setattr(speculative, "DEBUG", False)  # TLT_DEBUG's checks read the device on purpose
    targs = train.parse_args(["--device", "cpu", "--max-n", "4", "--max-passes", "1", "--block-size", "40",
                              "--draft-ks", "0,2,3"])
    target, drafter = tiny_pair(0)
    randomize(target, 0, std=0.3)
    out = bench.rollout_host_traffic(SimpleNamespace(targs=targs, sampler=targs.sampler),
                                     task.TaskConfig(max_n=4, max_passes=1), target, drafter)
    assert out["steps"] > 0 and out["reads_per_step"] == 1 and out["max_reads_in_a_step"] == 1
    assert out["copies_in_steps"] == 0 and out["prefill"]["reads"] == 0
    assert json.loads(json.dumps(out)) == out and "reads per decoding step" in capsys.readouterr().out
