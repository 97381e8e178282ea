"""train.py end to end on a tiny config: metrics, resume, refused files, bad input, non-finite
updates (a killed rank restarted by torchrun: tests/test_faults.py). Runs real processes, so each
test takes seconds."""
import hashlib
import json
import os
import shutil
import subprocess
import sys
import types

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from harness import checkpoint  # noqa: E402
from tasks import running_sum  # noqa: E402
from model import GPT, GPTConfig  # noqa: E402
from harness import config  # noqa: E402
import train  # noqa: E402
from harness import warmup  # noqa: E402
from harness.instrument import checksum  # noqa: E402
from conftest import run_ranks  # noqa: E402

TINY = ["--task", "running_sum", "--max-n", "4", "--block-size", "56", "--n-layer", "1", "--n-head", "2", "--n-embd", "16",
        "--warmup-steps", "10", "--warmup-tokens", "256", "--drafter-warmup-seqs", "16", "--drafter-warmup-steps", "5",
        "--drafter-batch", "4", "--prompts-per-step", "4", "--group-size", "2", "--eval-per-bucket", "2",
        "--ckpt-every", "1", "--timeline-every", "0"]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
STEP_KEYS = {"step", "step_time", "rollout_time", "update_time", "reward", "accept_len", "sd_token_frac",
             "drafter_checksum", "ranks", "response_lens", "rank_spread",
             "rollout_by_batch", "timeline", "sd_steps_by_k"}
RANK_KEYS = {"rank", "rollout_time", "idle_time", "drafter_steps", "tokens", "drafter_checksum"}


def run_train(args, timeout=240):
    """train.py in a process of its own, on the CPU unless args say otherwise (--device cpu: also on a
    machine with a GPU)."""
    return subprocess.run([sys.executable, "train.py", "--device", "cpu", *args], cwd=ROOT, env=ENV, capture_output=True,
                          text=True, timeout=timeout)


def torchrun(args, nproc=2, extra=()):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}", *extra,
           "train.py", "--device", "cpu", *args]
    return subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def metrics(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def digest(path):
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def test_single_process_run_then_resume(tmp_path):
    out = str(tmp_path / "run")
    r = run_train(TINY + ["--out-dir", out, "--rl-steps", "3"])
    assert r.returncode == 0, r.stderr[-2000:]
    recs = metrics(out)
    assert [m["step"] for m in recs] == [0, 1, 2]
    for m in recs:
        assert STEP_KEYS <= set(m)
        assert len(m["ranks"]) == 1 and RANK_KEYS <= set(m["ranks"][0])
        assert m["step_time"] >= m["rollout_time"] > 0
        # the long tail: every row's length (4 prompts x 2), one rank (no spread, no timeline: --timeline-every 0),
        # its rollout's seconds by batch size, the prefill's at all 8 rows
        assert len(m["response_lens"]) == 8 and sum(m["response_lens"]) / 8 == pytest.approx(m["response_len"])
        assert m["rank_spread"] == 0.0 and m["timeline"] is None
        by_batch = m["rollout_by_batch"]
        assert by_batch["buckets"] == ["1", "2", "3-4", "5-8"] and by_batch["plain"][3] > 0
        assert 0 < sum(by_batch["plain"]) + sum(by_batch["spec"]) <= m["rollout_time"]
        # speculative steps by k: one count per k in 0..max k, none at k = 0 (a plain step)
        assert len(m["sd_steps_by_k"]) == 9 and m["sd_steps_by_k"][0] == 0
    assert sum(sum(m["sd_steps_by_k"]) for m in recs) > 0
    assert "1 rank(s) on " in r.stdout and "held-out accuracy after RL" in r.stdout and "summary" in r.stdout
    assert "speculative vs plain decoding, greedy: 0 of 4 held-out responses differ" in r.stdout
    assert "speculative vs plain decoding, sampled at T=1: " in r.stdout
    assert "tail share" in r.stdout and "  stale drafter         " in r.stdout
    # the same command again finds everything done; a longer run continues from the checkpoint
    r = run_train(TINY + ["--out-dir", out, "--rl-steps", "5"])
    assert r.returncode == 0, r.stderr[-2000:]
    assert "reusing the warmed-up target" in r.stdout and "resuming from" in r.stdout
    assert [m["step"] for m in metrics(out)] == [0, 1, 2, 3, 4]
    # the stale drafter's step-0 models came back with the checkpoint
    assert "  stale drafter         " in r.stdout and "step 0's drafter for step 0's target" in r.stdout


def test_exact_tokens_make_rewards_equal_across_resume_and_tlt(tmp_path):
    """With --sampler gumbel (the default) every token is fixed by (sequence key, position): a run
    that was stopped and resumed, one that ran straight through, one without speculation and one
    drafting from GRPO siblings sample the same responses and so get the same rewards and make the same updates. Problems of
    one or two digits and a longer warm-up give a target that is sometimes right, so the rewards
    vary and the target really moves."""
    base = TINY + ["--max-n", "2", "--n-embd", "32", "--warmup-steps", "150", "--warmup-tokens", "512",
                   "--warmup-lr", "1e-2", "--group-size", "4", "--eval-per-bucket", "0", "--rl-steps", "6",
                   "--rl-lr", "3e-3"]
    straight, resumed, plain, sibling = (str(tmp_path / name) for name in ("straight", "resumed", "plain", "sib"))
    assert run_train(base + ["--out-dir", straight]).returncode == 0
    for out, extra in ((resumed, ["--rl-steps", "3"]), (resumed, []), (plain, ["--tlt", "off"]),
                       (sibling, ["--drafter", "sibling"])):
        r = run_train(base + ["--out-dir", out, "--warmup-dir", straight] + extra)
        assert r.returncode == 0, r.stderr[-2000:]
    runs = {out: metrics(out) for out in (straight, resumed, plain, sibling)}
    assert len({m["reward"] for m in runs[straight]}) > 1  # the rewards vary: updates are not all zero
    for key in ("reward", "responses_digest"):
        assert len({tuple(m[key] for m in run) for run in runs.values()}) == 1, key
    assert not any(m["accept_len"] for m in runs[plain])
    assert all(any(m["accept_len"] for m in runs[out]) for out in (straight, sibling))
    assert runs[sibling][0]["drafter_acceptance"] is None and runs[straight][0]["drafter_acceptance"] is not None  # who trains a drafter


@pytest.mark.parametrize("bad", [["--bogus-flag"], ["--drafter-keep-tokens", "39"]])
def test_bad_flags_one_line_nonzero_nothing_written(bad, tmp_path):
    out = tmp_path / "never"
    r = run_train(TINY + ["--out-dir", str(out)] + bad)
    assert r.returncode != 0
    assert len(r.stderr.strip().splitlines()) == 1 and r.stderr.startswith("error:"), r.stderr
    assert not out.exists()


@pytest.mark.parametrize("bad", [["--rl-steps", "-1"], ["--n-embd", "0"], ["--group-size", "0"], ["--block-size", "20"],
                                 ["--tlt", "maybe"], ["--rl-lr", "0"], ["--draft-ks", "4,x"], ["--draft-ks", "4,4"],
                                 ["--draft-ks", "-1"], ["--eval-samples", "0"], ["--dtype", "float16"]])
def test_every_bad_flag_is_one_error_line(bad, capsys):
    """The same check as above, in this process (train.py parses its flags before it writes anything)."""
    with pytest.raises(SystemExit) as e:
        config.parse_args(TINY + bad)
    err = capsys.readouterr().err
    assert e.value.code == 2 and len(err.strip().splitlines()) == 1 and err.startswith("error:"), err


def test_draft_ks_fixes_the_arms_and_sizes_the_block():
    args = config.parse_args(TINY + ["--draft-ks", "3"])
    bandit = train.Bandit(args.draft_ks)
    assert args.draft_ks == (3,) and {bandit.choose(b) for b in (1, 2, 5, 64) for _ in range(20)} == {3}
    # max-n 4 needs 47 positions plus the longest draft: 56 holds k = 8, 50 only k <= 3
    with pytest.raises(SystemExit):
        config.parse_args(TINY + ["--block-size", "50"])
    assert config.parse_args(TINY + ["--block-size", "50", "--draft-ks", "0,1,3"]).draft_ks == (0, 1, 3)


def test_rl_prompts_are_a_function_of_seed_and_step():
    """Every rank draws the step's whole list and takes its shard: the ranks must draw the same
    list."""
    args = config.parse_args(TINY)
    cfg = config.task_of(args)
    G = args.group_size

    def problems(a, step):
        return train.rl.step_rows(a, cfg, step, 0, 1)[0][::G]  # each problem G times in a row
    prompts = problems(args, 3)
    assert prompts == problems(args, 3) and len(prompts) == args.prompts_per_step
    assert prompts != problems(args, 4)
    assert prompts != problems(config.parse_args(TINY + ["--rl-seed", "7"]), 3)


def test_mismatched_or_corrupt_checkpoint_is_refused_and_left_alone(tmp_path):
    out = str(tmp_path / "run")
    assert run_train(TINY + ["--out-dir", out, "--rl-steps", "1"]).returncode == 0
    target = os.path.join(out, "target_warmup.pt")
    before = digest(target)
    r = run_train(TINY + ["--out-dir", out, "--rl-steps", "1", "--n-embd", "32"])  # another model shape
    assert r.returncode != 0 and "different config" in r.stderr and "model.n_embd 16 there, 32 here" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    assert digest(target) == before
    ckpt = os.path.join(out, "ckpt.pt")
    ck = torch.load(ckpt, map_location="cpu", weights_only=True)  # same config, but the bandit state of an older version
    ck["bandits"][0]["plays"] = [[b, a, [float(n) for n, _ in r]] for b, a, r in ck["bandits"][0]["plays"]]
    assert any(r for _, _, r in ck["bandits"][0]["plays"]), "the 1-step run must have scored some bandit plays"
    ck.pop("digest")
    checkpoint.save_atomic(ck, ckpt)
    old = digest(ckpt)
    r = run_train(TINY + ["--out-dir", out, "--rl-steps", "2"])
    assert r.returncode != 0 and "does not fit this version" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    assert digest(ckpt) == old
    with open(ckpt, "r+b") as f:  # truncate the RL checkpoint mid-file
        f.truncate(os.path.getsize(ckpt) // 2)
    cut = digest(ckpt)
    r = run_train(TINY + ["--out-dir", out, "--rl-steps", "2"])
    assert r.returncode != 0 and "cannot read checkpoint" in r.stderr
    assert digest(ckpt) == cut


def test_a_block_zeroed_inside_a_checkpoint_is_refused_by_its_digest(tmp_path):
    """torch.load reads a file whose tensor bytes a crash zeroed as zero weights; the digest that
    save_atomic writes with the file refuses it."""
    path = str(tmp_path / "ckpt.pt")
    meta = {"seed": 1}
    checkpoint.save_atomic({"meta": meta, "w": torch.randn(100_000)}, path)
    assert torch.equal(checkpoint.load_checked(path, meta)["w"], torch.load(path, map_location="cpu", weights_only=True)["w"])
    with open(path, "r+b") as f:
        f.seek(os.path.getsize(path) // 2)
        f.write(bytes(4096))
    assert (torch.load(path, map_location="cpu", weights_only=True)["w"] == 0).sum() > 1000  # it loads, wrong
    with pytest.raises(SystemExit, match="is damaged"):
        checkpoint.load_checked(path, meta)


def _damage(path, how):
    if how == "truncated":
        os.truncate(path, os.path.getsize(path) // 2)
    elif how == "zeroed":  # a block of the second half that is not zero already (AdamW's moments of unused tokens are)
        data = open(path, "rb").read()
        at = next(i for i in range(len(data) // 2, len(data), 1024) if data[i:i + 4096].count(0) < 1000)
        with open(path, "r+b") as f:
            f.seek(at)
            f.write(bytes(4096))
    else:  # written whole, by a version of the code whose bandit state had another layout
        ck = torch.load(path, map_location="cpu", weights_only=True)
        ck.pop("digest")
        ck["bandits"][0]["plays"] = [[b, a, [float(n) for n, _ in r]] for b, a, r in ck["bandits"][0]["plays"]]
        checkpoint.save_atomic(ck, path)


def test_a_record_a_kill_cut_short_is_dropped_on_resume(tmp_path):
    """A rank killed while rank 0 appends a record leaves a last line without its newline; the
    resumed run drops it with the records past its checkpoint (and does not fail parsing it)."""
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 0}\n{"step": 1}\n{"step": 2}\n{"step": 3, "rew')
    checkpoint.keep_records(str(path), 2)
    assert path.read_text() == '{"step": 0}\n{"step": 1}\n'


@pytest.fixture(scope="module")
def one_step_run(tmp_path_factory):
    """A one-step run's folder: its warm-ups, ckpt.pt and records."""
    out = str(tmp_path_factory.mktemp("one_step") / "run")
    assert run_train(TINY + ["--out-dir", out, "--rl-steps", "1"]).returncode == 0
    return out


@pytest.mark.parametrize("name,how", [("ckpt.pt", "truncated"), ("ckpt.pt", "foreign"),
                                      ("target_warmup.pt", "zeroed"), ("an out-dir under a file", None)])
def test_a_refused_file_or_folder_stops_two_ranks_with_one_line_from_rank_0(tmp_path, name, how, one_step_run):
    """On two ranks a torn, zeroed or foreign checkpoint or warm-up cache, or an --out-dir that cannot
    be written, stops the job: a non-zero exit, one `error:` line naming it and what to do, no
    traceback from a rank (torchrun's own report of the failed job follows), the file left as it was."""
    out = str(tmp_path / "run")
    shutil.copytree(one_step_run, out)
    if how is None:
        open(tmp_path / "a-file", "w").close()
        out, path = str(tmp_path / "a-file" / "run"), None
    else:
        path = os.path.join(out, name)
        _damage(path, how)
        before = digest(path)
    proc = torchrun(TINY + ["--out-dir", out, "--rl-steps", "2"])
    stdout, _ = proc.communicate(timeout=120)
    assert proc.returncode != 0
    errors = [line for line in stdout.splitlines() if line.startswith("error:")]
    assert len(errors) == 1, stdout[-3000:]
    assert (path or out) in errors[0] and ("delete it" in errors[0] or "cannot write to --out-dir" in errors[0])
    assert ("--warmup-dir" in errors[0]) == (name == "target_warmup.pt")
    assert "train.py\", line" not in stdout and "/harness/" not in stdout, stdout[-3000:]  # no rank's traceback
    assert path is None or digest(path) == before


def test_bf16_warmups_and_rl_steps_on_one_and_two_ranks(tmp_path):
    """--dtype bfloat16 end to end: both warm-ups, two RL steps and the evaluations on one process,
    and the same on 2 ranks (run side by side), finish; the ranks' drafters agree after each sync;
    the warm-ups and the RL checkpoint record that they were made in bf16."""
    one, two = str(tmp_path / "one"), str(tmp_path / "two")
    bf16 = TINY + ["--dtype", "bfloat16", "--rl-steps", "2"]
    proc = torchrun(bf16 + ["--out-dir", two, "--eval-per-bucket", "0"])
    r = run_train(bf16 + ["--out-dir", one])
    stdout, _ = proc.communicate(timeout=180)
    assert r.returncode == 0, r.stderr[-2000:]
    assert proc.returncode == 0, stdout[-3000:]
    assert "held-out accuracy after RL" in r.stdout and "speculative vs plain decoding, greedy" in r.stdout
    for out, n_ranks in ((one, 1), (two, 2)):
        recs = metrics(out)
        assert [m["step"] for m in recs] == [0, 1] and all(len(m["ranks"]) == n_ranks for m in recs)
        assert all(len({r["drafter_checksum"] for r in m["ranks"]}) == 1 for m in recs)
        for name in ("target_warmup.pt", "drafter_warmup.pt", "ckpt.pt"):
            meta = torch.load(os.path.join(out, name), map_location="cpu", weights_only=True)["meta"]
            assert meta["dtype"] == "bfloat16", name


def test_dtype_flag_turns_bf16_autocast_on_and_float32_leaves_it_off():
    """What every forward of a run goes through (config.autocast): with --dtype bfloat16 a linear
    layer's output is bf16 while the final hidden state stays float32; with float32 both are float32.
    The end-to-end run above only sees the flag copied into its meta, so this is what catches a
    bf16 run silently computing in float32."""
    from model import GPT, GPTConfig
    model = GPT(GPTConfig(vocab_size=running_sum.VOCAB_SIZE, block_size=40, n_layer=1, n_head=2, n_embd=16))
    idx = torch.zeros(1, 3, dtype=torch.long)
    for flags, want in (([], torch.float32), (["--dtype", "bfloat16"], torch.bfloat16)):
        with torch.no_grad(), config.autocast(config.parse_args(TINY + flags), torch.device("cpu")):
            logits, hidden = model(idx)
        assert logits.dtype == want and hidden.dtype == torch.float32, flags


def test_dtype_keys_the_warmups():
    """A bf16 warm-up is another warm-up: its meta differs in the dtype alone."""
    f32, bf16 = config.parse_args(TINY), config.parse_args(TINY + ["--dtype", "bfloat16"])
    shape = GPTConfig(vocab_size=running_sum.VOCAB_SIZE, block_size=40, n_layer=1, n_head=2, n_embd=16)
    metas = [warmup.model_meta(a, shape, config.task_of(a, warmup=True)) for a in (f32, bf16)]
    assert metas[0]["dtype"] == "float32" and metas[1] == {**metas[0], "dtype": "bfloat16"}


def test_a_block_that_fits_the_longest_draft_fits_the_evaluation(tmp_path):
    """--block-size 50 holds max-n 4's 47 positions plus --draft-ks 0,1,3's longest draft. The
    evaluations draft that many tokens, not a fixed 4 (which needs 51 and failed before RL)."""
    r = run_train(TINY + ["--out-dir", str(tmp_path), "--rl-steps", "1", "--block-size", "50", "--draft-ks", "0,1,3"])
    assert r.returncode == 0, r.stderr[-2000:]
    assert "held-out accuracy after RL" in r.stdout and "speculative vs plain decoding, greedy" in r.stdout


def test_evaluation_without_drafts_decodes_plainly():
    """--draft-ks 0 never speculates: the evaluation decodes plainly and skips the speculative check."""
    args = config.parse_args(TINY + ["--draft-ks", "0", "--block-size", "47", "--eval-samples", "1"])
    model, drafter = _tiny_models(args)
    task_cfg = config.task_of(args)
    acc = train.evaluate_both(model, drafter, task_cfg.eval_set(1), args, task_cfg, 0, 1, "now", check=True)
    assert set(acc) == {"greedy", "sampled", "length"}


def test_unwritable_out_dir(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    r = run_train(TINY + ["--out-dir", str(blocker / "sub")])
    assert r.returncode != 0 and "cannot write to --out-dir" in r.stderr
    r = run_train(TINY + ["--out-dir", str(blocker)])  # the file itself: what happened, in one line
    assert r.stderr == f"error: --out-dir {str(blocker)!r} is a file, not a folder\n" and r.returncode == 1


OWN_TASK = '''from dataclasses import dataclass

import train
from tasks.running_sum import RunningSum


@dataclass(frozen=True)
class Own(RunningSum):
    """A task of one's own: responses of up to 304 tokens at --max-n 4 (prompt 8 + 304 + a draft of 8:
    320 positions), and partial credit, 0.5 for a wrong answer."""
    name = "own"

    @staticmethod
    def response_len(n):
        return 9 * n + 268

    def reward(self, problem, response_ids):
        return 1.0 if super().reward(problem, response_ids) == 1.0 else 0.5


train.main()
'''


def test_a_task_of_ones_own_sets_its_block_and_its_reward_leaves_accuracy_alone(tmp_path):
    """A planted task (one file, run as the script that defines it) that needs 320 positions runs with
    no --block-size: the target's block is the task's. Its partial credit moves the mean reward, never
    the accuracy, the share of right answers: in every step's record and in the held-out figures."""
    (tmp_path / "own.py").write_text(OWN_TASK)
    out = str(tmp_path / "run")
    flags = [a for a in TINY if a not in ("--block-size", "56")] + ["--task", "own", "--rl-steps", "1", "--out-dir", out,
                                                                   "--drafter-warmup-steps", "0", "--eval-per-bucket", "1",
                                                                   "--eval-samples", "2"]
    r = subprocess.run([sys.executable, str(tmp_path / "own.py"), "--device", "cpu", *flags], cwd=ROOT, text=True,
                       env={**ENV, "PYTHONPATH": ROOT}, capture_output=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    meta = torch.load(os.path.join(out, "target_warmup.pt"), map_location="cpu", weights_only=True)["meta"]
    assert meta["model"]["block_size"] == 320
    assert all(m["reward"] == pytest.approx(0.5 + 0.5 * m["accuracy"]) for m in metrics(out))
    held_out = [line for line in r.stdout.splitlines() if line.startswith("held-out accuracy")]
    assert len(held_out) == 4, r.stdout
    for line in held_out:  # "overall  a% | 1-2 ...; mean reward b": b = 0.5 + 0.5 a
        accuracy, reward = float(line.split("overall")[1].split("%")[0]), float(line.split("mean reward ")[1])
        assert reward == pytest.approx(0.5 + accuracy / 200, abs=1e-3), line
    assert "  accuracy              " in r.stdout and ", mean reward " in r.stdout


def test_uneven_shards_and_an_empty_rank(tmp_path):
    """3 prompts over 2 ranks (2 + 1), then 1 prompt (rank 1 has none): both finish."""
    for n, out in ((3, "three"), (1, "one")):
        proc = torchrun(TINY + ["--out-dir", str(tmp_path / out), "--rl-steps", "2", "--prompts-per-step", str(n),
                                "--eval-per-bucket", "0"])
        stdout, _ = proc.communicate(timeout=180)
        assert proc.returncode == 0, stdout[-3000:]
        recs = metrics(str(tmp_path / out))
        assert [len(m["ranks"]) for m in recs] == [2, 2]
        for m in recs:  # identical drafters on every rank after each step's sync
            assert len({r["drafter_checksum"] for r in m["ranks"]}) == 1


def test_non_finite_update_is_skipped_and_never_saved(tmp_path):
    from model import GPT, GPTConfig
    args = config.parse_args(TINY)
    model = GPT(GPTConfig(vocab_size=20, block_size=40, n_layer=1, n_head=2, n_embd=16))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    before = [p.detach().clone() for p in model.parameters()]
    seqs, plens = [[1, 2, 3, 4], [1, 2, 5, 6]], [2, 2]
    adv = torch.tensor([float("nan"), 1.0])
    cfg = train.rl.GRPOConfig(pad_id=0, update_tokens=args.update_tokens)
    loss, _, skipped = train.rl.grpo_update(model, opt, seqs, plens, adv, cfg, 4)
    assert skipped
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    loss, _, skipped = train.rl.grpo_update(model, opt, seqs, plens, torch.tensor([1.0, -1.0]), cfg, 4)
    assert not skipped and not all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    path = tmp_path / "x.pt"
    checkpoint.save_atomic({"model": model.state_dict()}, str(path))
    good = digest(path)
    with torch.no_grad():
        next(model.parameters())[0, 0] = float("nan")
    with pytest.raises(RuntimeError, match="not finite"):
        checkpoint.save_atomic({"model": model.state_dict()}, str(path))
    assert digest(path) == good


def test_merged_embeddings_start_as_label_plus_digit():
    args = config.parse_args(TINY)
    model = GPT(GPTConfig(vocab_size=running_sum.VOCAB_SIZE, block_size=args.block_size,
                                        n_layer=1, n_head=2, n_embd=16))
    warmup.init_merged_embeddings(model, config.task_of(args))
    w = model.wte.weight
    b7 = running_sum.ENC.encode_single_token("b7")
    assert torch.allclose(w[b7], (w[ord("b")] + w[ord("7")]) / 2 ** 0.5)


def test_task_flags_reach_the_task_config():
    args = config.parse_args(TINY + ["--strides", "0.5,0.3,0.2", "--warmup-alpha", "0.25"])
    cfg, wcfg = config.task_of(args), config.task_of(args, warmup=True)
    default_alpha = __import__("tasks").TASKS["running_sum"]().alpha  # not given: the task's own default
    assert (cfg.strides, wcfg.strides, cfg.alpha, wcfg.alpha) == ((0.5, 0.3, 0.2), (0.5, 0.3, 0.2), default_alpha, 0.25)
    assert config.task_of(config.parse_args(TINY + ["--alpha", "0.7"])).alpha == 0.7
    for bad in (["--strides", "0.5,x"], ["--strides", "0,1"], ["--max-n", "5"]):  # 5 digits do not fit the tiny block
        with pytest.raises(SystemExit):
            config.parse_args(TINY + bad)


def test_the_recipe_flags_not_given_are_the_tasks_own():
    """--warmup-steps and --rl-lr default to what the task needs (Task.warmup_steps, Task.rl_lr): the
    default task, the shell game in rounds, 3600 and 2e-4; the running sum 2400 and 4e-4; given, the
    flag's."""
    import tasks
    for flags, want in (([], (3600, 2e-4)), (["--task", "running_sum"], (2400, 4e-4)),
                        (["--warmup-steps", "7", "--rl-lr", "1e-3"], (7, 1e-3))):
        args = config.parse_args(flags)
        assert (args.warmup_steps, args.rl_lr) == want, flags
    assert config.parse_args([]).task == "shell_rounds" and tasks.TASKS["running_sum"].warmup_steps == 2400
    with pytest.raises(SystemExit):
        config.parse_args(["--rl-lr", "0"])


def test_a_setting_two_tasks_share_keeps_each_tasks_words_and_a_bad_one_names_its_flag(capsys):
    """--max-n is both tasks' setting: --help gives each task's own help and default; a task's own
    check of a setting names its flag (Task.check), as argparse's errors do."""
    with pytest.raises(SystemExit):
        config.parse_args(["--help"])
    words = " ".join(capsys.readouterr().out.split())
    assert "largest problem (digits to sum), at most 52 (running_sum: 20)" in words
    assert "largest problem (swaps), at most 26 (shell_game: 12, shell_rounds: 6)" in words
    for bad, said in ((["--task", "shell_game", "--outright", "1.5"], "--outright must be in [0, 1), got 1.5"),
                      (["--min-n", "5"], "--min-n must be in 1..4 (--max-n), got 5")):
        with pytest.raises(SystemExit):
            config.parse_args(TINY + bad)
        assert capsys.readouterr().err == f"error: {said} (see --help)\n"


def test_warmup_curriculum_keys_the_cache():
    curriculum, plain = config.parse_args(TINY), config.parse_args(TINY + ["--warmup-alpha-end", "2.0"])
    assert curriculum.warmup_alpha_end != curriculum.warmup_alpha and plain.warmup_alpha_end == plain.warmup_alpha
    shape = GPTConfig(vocab_size=running_sum.VOCAB_SIZE, block_size=40, n_layer=1, n_head=2, n_embd=16)
    metas = [warmup.model_meta(a, shape, config.task_of(a, warmup=True)) for a in (plain, curriculum)]
    assert metas[0] != metas[1]  # a warm-up cached with another curriculum is refused, not reused


# ----------------------------------------------------------------------------- any number of ranks

def _tiny_models(args):
    from drafter import Drafter
    from model import GPT, GPTConfig
    torch.manual_seed(0)
    model = GPT(GPTConfig(vocab_size=running_sum.VOCAB_SIZE, block_size=args.block_size, n_layer=args.n_layer,
                          n_head=args.n_head, n_embd=args.n_embd)).eval()
    return model, Drafter(model)


SOMETIMES_RIGHT = TINY + ["--max-n", "1", "--n-embd", "32", "--warmup-steps", "150", "--warmup-tokens", "512",
                          "--warmup-lr", "1e-2", "--eval-per-bucket", "0"]  # a target whose rewards vary


def _rl_steps_worker(rank, world, out, n_steps, warm):
    """n_steps of train.rl_step on `world` gloo ranks (world 1: no process group) from the target
    in `warm`; rank 0 saves the step digests and rewards and the target's weights."""
    from harness.instrument import RolloutStats
    from harness.report import step_record
    args = config.parse_args(SOMETIMES_RIGHT + ["--prompts-per-step", "3", "--group-size", "3", "--rl-lr", "3e-3"])
    model, drafter = _tiny_models(args)
    model.load_state_dict(torch.load(warm, map_location="cpu")["model"])
    s = train.new_state(args, config.task_of(args), model, drafter, rank, world, torch.device("cpu"))
    recs = []
    for step in range(n_steps):  # as train.run does it: the step, then its record
        stats = RolloutStats()
        recs.append(step_record(s, step, train.rl_step(step, s, stats), stats)[0])
    if rank == 0:
        torch.save({"digests": [r["responses_digest"] for r in recs], "rewards": [r["reward"] for r in recs],
                    "weights": torch.cat([p.detach().reshape(-1) for p in model.parameters()])}, out)


def _rl_steps(world, tmp_path, warm, n_steps=3):
    out = str(tmp_path / f"w{world}.pt")
    run_ranks(_rl_steps_worker, world, world, out, n_steps, warm, group=world > 1, timeout_s=240)
    return torch.load(out, map_location="cpu")


def test_rl_steps_do_not_depend_on_the_number_of_ranks(tmp_path):
    """The same steps on 1 and on 2 gloo processes: 9 rows per step dealt 4 + 5, a GRPO group
    split across the ranks. Each row's key is its place in the global batch, so the responses
    are the same (a key from a row's place on its rank would change them); the advantages come
    from every rank's rewards and the token-level mean is global, so the targets after 3 updates
    agree to float32 rounding (a per-rank mean would differ by far more than the tolerance)."""
    r = run_train(SOMETIMES_RIGHT + ["--out-dir", str(tmp_path), "--rl-steps", "0"])
    assert r.returncode == 0, r.stderr[-2000:]
    warm = str(tmp_path / "target_warmup.pt")
    one, two = _rl_steps(1, tmp_path, warm), _rl_steps(2, tmp_path, warm)
    assert one["digests"] == two["digests"] and one["rewards"] == two["rewards"]
    assert 0 < sum(one["rewards"]) < len(one["rewards"])  # rewards vary, so the target is updated
    start, _ = _tiny_models(config.parse_args(SOMETIMES_RIGHT))
    start.load_state_dict(torch.load(warm, map_location="cpu")["model"])
    w0 = torch.cat([p.detach().reshape(-1) for p in start.parameters()])
    update = (one["weights"] - w0).norm()
    assert update > 0
    assert (one["weights"] - two["weights"]).norm() < 1e-3 * update, float((one["weights"] - two["weights"]).norm() / update)


def test_too_few_rows_for_the_ranks_is_a_clear_error(tmp_path):
    proc = torchrun(TINY + ["--out-dir", str(tmp_path / "x"), "--prompts-per-step", "1", "--group-size", "1"])
    stdout, _ = proc.communicate(timeout=120)
    assert proc.returncode != 0 and "leave some of the 2 ranks without work" in stdout


def _cache_worker(rank, warmup_dir, out):
    """prepare_models on 2 ranks where only rank 0 can see the warm-up caches."""
    if rank == 1:
        real = os.path.exists
        os.path.exists = lambda p: False if str(p).startswith(warmup_dir) else real(p)
    args = config.parse_args(TINY + ["--warmup-dir", warmup_dir])
    model, drafter = warmup.prepare_models(args, config.task_of(args), config.task_of(args, warmup=True),
                                              True, rank, 2, torch.device("cpu"))
    torch.save({"model": model.state_dict(), "drafter": checksum(drafter)}, f"{out}.{rank}")


def test_a_cache_only_rank_0_sees_is_used_by_every_rank(tmp_path):
    """Rank 0 decides whether to load or to warm up and every rank follows: a rank that cannot see
    the cache does not warm up on its own (its collectives would then never match rank 0's)."""
    warmup_dir = str(tmp_path / "warm")
    r = run_train(TINY + ["--out-dir", warmup_dir, "--rl-steps", "0", "--eval-per-bucket", "0"])
    assert r.returncode == 0, r.stderr[-2000:]
    cached = torch.load(os.path.join(warmup_dir, "target_warmup.pt"), map_location="cpu")["model"]
    out = str(tmp_path / "got")
    run_ranks(_cache_worker, 2, warmup_dir, out)
    got = [torch.load(f"{out}.{r}", map_location="cpu") for r in range(2)]
    for g in got:
        assert all(torch.equal(g["model"][k], cached[k]) for k in cached)
    assert got[0]["drafter"] == got[1]["drafter"]


@pytest.mark.parametrize("flags", [[], ["--drafter-updates", "off"], ["--tlt", "off"]])
def test_one_process_holds_at_most_keep_tokens_in_every_configuration(flags, tmp_path):
    """A single process never has idle time, so nothing it gives the drafter buffer is ever trained
    on; over 8 steps with a small bound, what it holds stays within
    --drafter-keep-tokens, and a run that never trains the drafter holds nothing."""
    out = str(tmp_path / "run")
    r = run_train(TINY + flags + ["--out-dir", out, "--rl-steps", "8", "--eval-per-bucket", "0", "--ckpt-every", "8",
                                  "--drafter-keep", "2", "--drafter-keep-tokens", "56"])
    assert r.returncode == 0, r.stderr[-2000:]
    held = [m["ranks"][0]["buffer_tokens"] for m in metrics(out)]
    assert len(held) == 8 and max(held) <= 56, held
    assert (min(held) > 0) if not flags else (max(held) == 0), held


# ----------------------------------------------------------------------------- the warm-up cache's key

PLANTED = '''from dataclasses import dataclass

from tasks import running_sum
from tasks.running_sum import RunningSum


@dataclass(frozen=True)
class Planted(RunningSum):
    name = "planted"
'''


def _planted_task(path, source, monkeypatch):
    """A task whose module is `source`, written to `path` and (re)imported, registered as "planted"."""
    import importlib
    import linecache
    import tasks
    path.write_text(source)
    linecache.checkcache(str(path))  # the digest reads the source as it is now
    monkeypatch.syspath_prepend(str(path.parent))
    module = importlib.reload(sys.modules["planted"]) if "planted" in sys.modules else importlib.import_module("planted")
    monkeypatch.setitem(tasks.TASKS, "planted", module.Planted)


def _prepare(argv):
    args = config.parse_args(TINY + argv)
    return warmup.prepare_models(args, config.task_of(args), config.task_of(args, warmup=True), False, 0, 1,
                                 torch.device("cpu"))


def test_a_warmup_made_from_other_traces_or_another_drafter_shape_is_made_afresh(tmp_path, monkeypatch, capsys):
    """The cache is keyed on what the warm-ups read: after a planted edit of the task's module that
    they do not read (a comment, the reward) both are reused; after one that changes the warm-up
    traces the target is warmed up afresh, with one line naming the difference; a drafter of
    another depth gets a fresh drafter warm-up, not a missing-keys crash. Each fresh warm-up is
    written over the one it replaces: nothing else is kept."""
    module = tmp_path / "code" / "planted.py"
    module.parent.mkdir()
    _planted_task(module, PLANTED, monkeypatch)
    (tmp_path / "warm").mkdir()
    flags = ["--task", "planted", "--warmup-dir", str(tmp_path / "warm")]
    _prepare(flags)
    first = capsys.readouterr().out
    assert "target warmup" in first and "reusing" not in first
    for edit in ("    # a comment\n", "    def reward(self, problem, ids):\n        return 0.0\n"):
        _planted_task(module, PLANTED + edit, monkeypatch)
        _prepare(flags)
        out = capsys.readouterr().out
        assert "reusing the warmed-up target" in out and "reusing the warmed-up drafter" in out, edit
    _planted_task(module, PLANTED + "    def warmup_example(self, problem, rng):  # single steps only\n"
                  "        return running_sum.training_example(problem)\n", monkeypatch)
    _prepare(flags)
    out = capsys.readouterr().out
    assert "not reusing" in out and "task.traces" in out and "target warmup" in out
    assert "reusing the warmed-up target" not in out
    _, drafter = _prepare(flags + ["--drafter-layers", "2"])
    out = capsys.readouterr().out
    assert "reusing the warmed-up target" in out and "drafter_layers 1 there, 2 here" in out
    assert len(drafter.stack.blocks) == 2 and "drafter warmup" in out
    assert sorted(os.listdir(tmp_path / "warm")) == ["drafter_warmup.pt", "target_warmup.pt"]


@pytest.mark.parametrize("name", sorted(__import__("tasks").TASKS))
def test_every_registered_task_trains_and_speculates_without_changing_a_token(tmp_path, name):
    """A tiny run of each task: warm-ups, two RL steps with TLT, the held-out checks (speculative
    and plain decoding write the same responses), and the task.json the report reads. Each at its
    own block (the rounds' longest response at --max-n 4 does not fit TINY's)."""
    import tasks
    out, tiny = str(tmp_path / name), [a for a in TINY if a not in ("--block-size", "56")] + ["--task", name]
    r = run_train(tiny + ["--out-dir", out, "--rl-steps", "2"])
    assert r.returncode == 0, r.stderr[-2000:]
    with open(os.path.join(out, "metrics.jsonl")) as f:
        assert [json.loads(line)["step"] for line in f] == [0, 1]
    assert "greedy: 0 of" in r.stdout and "sampled at T=1: 0 of" in r.stdout
    assert f"task {name};" in r.stdout
    with open(os.path.join(out, "task.json")) as f:
        assert tasks.from_meta(json.load(f)) == config.task_of(config.parse_args(tiny))


def test_the_stale_drafter_figures_pair_each_drafter_with_its_own_target(tmp_path):
    """evaluate.stale_drafter: (1) the early drafter for the early target, (2) the same drafter for
    the final target, (3) the final drafter for the final target, at the k most speculative steps
    drafted (from metrics.jsonl). Moving the target after the snapshot moves (2) and (3), never
    (1); moving the drafter moves (3) alone. T = 3 flattens the tiny models' distributions, so the
    shared noise makes drafts land often enough to tell the figures apart."""
    from conftest import randomize
    from harness.evaluate import most_played_k, snapshot, stale_drafter
    args = config.parse_args(TINY + ["--temperature", "3"])
    model, drafter = _tiny_models(args)
    randomize(model, 1, 0.3)
    task_cfg = config.task_of(args)
    path = tmp_path / "metrics.jsonl"
    path.write_text("\n".join(json.dumps({"step": i, "sd_steps_by_k": c})
                              for i, c in enumerate([[0, 5, 1], [0, 0, 9], [0, 2, 0]])) + "\n")
    assert most_played_k(str(path)) == 2  # 10 steps at k = 2 against 7 at k = 1
    early = snapshot(model, drafter, 3)
    problems = task_cfg.eval_set(4)

    run = types.SimpleNamespace(args=args, task=task_cfg, model=model, drafter=drafter, early=early,
                                rank=0, world_size=1)  # a train.RunState's fields that it reads

    def figures():
        out = stale_drafter(run, problems, str(path))
        assert out["step"] == 3 and out["k"] == 2
        return out["figures"]
    same = figures()
    assert same[0] == same[1] == same[2] and 1.0 < same[0] < 3.0
    randomize(model, 2, 0.3)  # RL moved the target
    moved = figures()
    assert moved[0] == same[0] and moved[1] != same[1] and moved[2] == moved[1]
    randomize(drafter, 3, 0.3)  # and the adaptive drafter followed it
    followed = figures()
    assert followed[:2] == moved[:2] and followed[2] != moved[2]
    args.eval_per_bucket, args.tlt = 0, False
    assert stale_drafter(run, problems, str(path)) is None
