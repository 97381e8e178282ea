"""bench.py's measuring pieces: runs take turns, ops are counted as a GPU would launch them, the
vocabulary table runs the same ops at any vocabulary, and bad flags are refused. The timings
themselves are reported by bench.py, never asserted. bench_e2e.py's: tests/test_bench_e2e.py."""
import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from harness import bench  # noqa: E402


def test_interleaved_runs_take_turns_and_report_medians():
    calls = []
    runs = {name: (lambda name=name: calls.append(name) or name.upper()) for name in ("a", "b", "c")}
    times, outs = bench.interleaved(runs, repeats=3)
    assert calls == ["a", "b", "c"] * 3  # round by round, not all of one run first
    assert outs == {"a": "A", "b": "B", "c": "C"}
    assert set(times) == {"a", "b", "c"} and all(t >= 0 for t in times.values())


@pytest.mark.parametrize("bad", [["--train-args", '"unclosed'], ["--train-args=--bogus"], ["--train-args=--n-layer 0"],
                                 ["--batches", "1,x"], ["--repeats", "0"],
                                 ["--drafters", "/nonexistent/run"], ["--e2e", "--drift"], ["--vocab", "--e2e"]])
def test_bad_flags_exit_with_usage_error(bad, capsys):
    with pytest.raises(SystemExit) as e:
        bench.parse_args(bad)
    assert e.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_count_ops_counts_kernels_not_views_or_allocations():
    x = torch.randn(4, 6)
    assert bench.count_ops(lambda: x + 1) == 1
    assert bench.count_ops(lambda: (x * 2).sum(0)) == 2
    assert bench.count_ops(lambda: (x[1:].view(-1), x.t(), torch.empty_like(x))) == 0


def test_vocab_table_runs_the_same_gumbel_ops_at_both_vocabularies():
    """The gumbel step's ops and the multinomial step's do not depend on the vocabulary; the gumbel
    step runs more (the noise)."""
    rows = bench.vocab_noise(torch.device("cpu"), vocabs=(500, 20000), batches=(1, 3), repeats=1,
                             shape=dict(n_layer=1, n_head=2, n_embd=16))
    assert [(r["vocab"], r["batch"]) for r in rows] == [(500, 1), (500, 3), (20000, 1), (20000, 3)]
    for a, b in zip(rows[:2], rows[2:]):
        assert [a[k] for k in ("multinomial_ops", "gumbel_ops")] == [b[k] for k in ("multinomial_ops", "gumbel_ops")]
        assert a["gumbel_ops"] > a["multinomial_ops"]


def test_expected_steps_counts_verify_steps_to_emit_a_row():
    """The prediction's step count: drafts always accepted emit k + 1 tokens a step (the last step cut
    at the row's end), never accepted one; in between, the expectation over the emitted counts."""
    assert bench.expected_steps([1.0] * 8, 43) == 5.0  # 9 + 9 + 9 + 9 + 7
    assert bench.expected_steps([0.0] * 4, 10) == 10.0
    # k = 1 at acceptance 1/2: a step emits 1 or 2 tokens alike; 2 tokens take 1 + 1/2 steps
    assert bench.expected_steps([0.5], 2) == pytest.approx(1.5)


def test_host_traffic_report_of_a_rollout_like_train_py(capsys, monkeypatch):
    """The report `python -m harness.bench` prints: a rollout of train.py's rows for step 0 on one rank,
    with the reads and copies from the host per decoding step (at least one read: its compaction's),
    as a JSON-ready figure."""
    import json
    from types import SimpleNamespace

    from harness import config
    from tasks import running_sum as task
    from conftest import randomize
    from drafter import Drafter
    from model import GPT, GPTConfig
    targs = config.parse_args(["--device", "cpu", "--max-n", "4", "--block-size", "56",
                               "--draft-ks", "0,2,3"])
    torch.manual_seed(0)
    target = GPT(GPTConfig(vocab_size=task.VOCAB_SIZE, block_size=56, n_layer=1, n_head=2, n_embd=16)).eval()
    drafter = Drafter(target).eval()
    randomize(target, 0, std=0.3)
    out = bench.rollout_host_traffic(SimpleNamespace(targs=targs, sampler=targs.sampler),
                                     task.RunningSum(max_n=4), target, drafter)
    assert out["steps"] > 0
    assert 1 <= out["reads_per_step"] <= out["max_reads_in_a_step"] and out["prefill"]["reads"] >= 1
    assert json.loads(json.dumps(out)) == out and "reads per decoding step" in capsys.readouterr().out
