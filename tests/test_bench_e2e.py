"""bench_e2e.py's comparisons on tiny models: the controlled drafter comparison shares its prompts and
random stream, and the drift bench moves copies, never the models it is given. The end-to-end runs
themselves (train.py under torchrun) are left to `python -m harness.bench --e2e`."""
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from harness import bench_e2e  # noqa: E402
from tasks import running_sum as task  # noqa: E402
from harness import config  # noqa: E402
from drafter import Drafter  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402
from conftest import randomize  # noqa: E402


def tiny_pair(seed):
    torch.manual_seed(seed)
    target = GPT(GPTConfig(vocab_size=task.VOCAB_SIZE, block_size=56, n_layer=1, n_head=2, n_embd=16)).eval()
    return target, Drafter(target).eval()


def test_drafter_comparison_shares_prompts_and_random_stream(tmp_path):
    task_cfg = task.RunningSum(max_n=4)  # fits the tiny block
    target, drafter = tiny_pair(0)
    randomize(target, 0, std=0.3)  # near their uniform init, the noise alone would pick every token
    torch.save({"model": target.state_dict(), "drafter": drafter.state_dict()}, tmp_path / "ckpt.pt")
    warm_target, _ = tiny_pair(1)  # another target: the comparison must use the checkpoint's
    same = bench_e2e.drafter_vs_target(task_cfg, warm_target, drafter, str(tmp_path), n_prompts=16)
    assert same["adaptive"] == same["frozen"]  # one drafter twice: identical decoding, identical figure
    _, other = tiny_pair(2)
    randomize(other, 2, std=0.3)
    diff = bench_e2e.drafter_vs_target(task_cfg, warm_target, other, str(tmp_path), n_prompts=16)
    assert diff["adaptive"] == same["adaptive"]  # the checkpoint's side does not depend on the warm-up drafter
    assert diff["frozen"] != diff["adaptive"]
    assert all(1.0 <= v <= 5.0 for v in (*same.values(), *diff.values()))  # k = 4: 1 to 5 tokens per verify step


def test_drift_moves_a_copy_of_the_target_and_trains_a_copy_of_the_drafter():
    task_cfg = task.RunningSum(max_n=4)  # fits the tiny block
    target, drafter = tiny_pair(0)
    randomize(target, 0, std=0.3)  # far from the near-uniform init, where every draft is accepted before and after
    before = {k: v.clone() for k, v in target.state_dict().items()}
    d_before = {k: v.clone() for k, v in drafter.state_dict().items()}
    targs = config.parse_args(["--device", "cpu", "--max-n", "4", "--block-size", "56", "--warmup-tokens", "256",
                              "--drafter-batch", "4"])
    out = bench_e2e.drift_bench(targs, task_cfg, target, drafter, sft_steps=3, n_seqs=64, online_steps=3, n_prompts=8,
                            seeds=(0, 1))["drift"]
    # the originals are untouched: the move and the online training happen on copies
    assert all(torch.equal(v, target.state_dict()[k]) for k, v in before.items())
    assert all(torch.equal(v, drafter.state_dict()[k]) for k, v in d_before.items())
    assert all(len(v) == 2 and all(1.0 <= a <= 5.0 for a in v) for v in out.values())  # k = 4: 1 to 5 per verify
    assert out["moved, frozen drafter"] != out["before the move"]  # the target really moved


def test_fixed_k_table_prints_a_dash_where_no_idle_rank_scored_the_drafter(capsys):
    """A step whose record holds no top-1 (no rank idled to score it) shows "-", not a 0.000 figure."""
    rec = lambda top1: {"step": 0, "accept_len": 4.0, "drafter_top1": top1, "reward": 0.5}  # noqa: E731
    bench_e2e.fixed_k_table({"on_k4": [rec(None)], "frozen_k4": [rec(0.9876)], "off": [rec(None)], "on": [rec(None)]})
    row = capsys.readouterr().out.strip().splitlines()[-1].split()
    assert row[4:6] == ["-", "0.988"]
