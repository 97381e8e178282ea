"""bench_e2e.py's drift bench on tiny models: it moves copies, never the models it is given. The
end-to-end runs themselves (train.py under torchrun) are left to `python -m harness.bench --e2e`."""
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


def test_drift_moves_a_copy_of_the_target_and_trains_a_copy_of_the_drafter():
    task_cfg = task.RunningSum(max_n=4)  # fits the tiny block
    target, drafter = tiny_pair(0)
    randomize(target, 0, std=0.3)  # far from the near-uniform init, where every draft is accepted before and after
    before = {k: v.clone() for k, v in target.state_dict().items()}
    d_before = {k: v.clone() for k, v in drafter.state_dict().items()}
    targs = config.parse_args(["--device", "cpu", "--task", "running_sum", "--max-n", "4", "--block-size", "56", "--warmup-tokens", "256",
                              "--drafter-batch", "4"])
    out = bench_e2e.drift_bench(targs, task_cfg, target, drafter, sft_steps=3, n_seqs=64, online_steps=3, n_prompts=8,
                            seeds=(0, 1))["drift"]
    # the originals are untouched: the move and the online training happen on copies
    assert all(torch.equal(v, target.state_dict()[k]) for k, v in before.items())
    assert all(torch.equal(v, drafter.state_dict()[k]) for k, v in d_before.items())
    assert all(len(v) == 2 and all(1.0 <= a <= 5.0 for a in v) for v in out.values())  # k = 4: 1 to 5 per verify
    assert out["moved, frozen drafter"] != out["before the move"]  # the target really moved
