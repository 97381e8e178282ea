"""bench.py's measuring pieces: runs take turns, a table row has the figures the JSON line
promises, and bad flags are refused. The timings themselves are reported by bench.py, never
asserted. bench_e2e.py's: tests/test_bench_e2e.py."""
import os
import sys
from types import SimpleNamespace

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


@pytest.mark.parametrize("bad", [["--train-args", '"unclosed'], ["--train-args=--bogus"],
                                 ["--train-args=--n-layer 0"], ["--batches", "1,x"],
                                 ["--repeats", "0"], ["--e2e", "--drift"]])
def test_bad_flags_exit_with_usage_error(bad, capsys):
    with pytest.raises(SystemExit) as e:
        bench.parse_args(bad)
    assert e.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_a_decoding_row_has_the_figures_of_the_json_line():
    """decode_row on a tiny model: the keys `"decode"` promises, the best k the fastest of args.ks,
    and an accept length per k (tokens per verify step, 1 to k + 1)."""
    from conftest import randomize
    from drafter import Drafter
    from model import GPT, GPTConfig
    torch.manual_seed(0)
    target = randomize(GPT(GPTConfig(vocab_size=20, block_size=48, n_layer=1, n_head=2,
                                     n_embd=16)).eval(), 0, std=0.3)
    drafter = Drafter(target).eval()
    args = SimpleNamespace(ks=[1, 3], max_new=8, repeats=1, sampler="gumbel")
    row = bench.decode_row(args, target, drafter, [[1, 2, 3], [4, 5]], [0, 1])
    assert {"batch", "ar_tok_s", "sd_tok_s", "best_k", "speedup", "accept_len"} <= set(row)
    assert row["batch"] == 2 and row["best_k"] in (1, 3)
    assert row["sd_tok_s"] == max(v["tok_s"] for v in row["per_k"].values())
    assert all(1.0 <= row["per_k"][str(k)]["accept_len"] <= k + 1 for k in (1, 3))
