"""The task interface (tasks/__init__.py), checked on every registered task: what the rest of the
project relies on, whatever the task. Each task's own format has its own file of tests."""
import dataclasses
import random

import numpy as np
import pytest

import tasks

ALL = [cls() for cls in tasks.TASKS.values()]
IDS = [t.name for t in ALL]


@pytest.mark.parametrize("task", ALL, ids=IDS)
def test_problems_fit_the_bounds_the_model_is_sized_by(task):
    rng = random.Random(0)
    for _ in range(500):
        p = task.sample(rng)
        assert 1 <= p.size <= task.max_n
        prompt = task.prompt_ids(p)
        assert 0 < len(prompt) <= task.max_prompt_len
        ids, plen = task.warmup_example(p, rng)
        assert ids[:plen] == prompt and ids[-1] == task.eos_id and ids.count(task.eos_id) == 1
        assert len(ids) - plen <= task.response_len(p.size) <= task.max_response_len
        assert task.pad_id not in ids and max(ids) < task.vocab_size
        assert task.reward(p, ids[plen:]) in (0.0, 1.0)


@pytest.mark.parametrize("task", ALL, ids=IDS)
def test_the_longest_responses_are_long_tailed(task):
    """p90 of the longest response at the sizes drawn is at least twice the median (fixed seed,
    20,000 draws: the quantiles of a discrete size move by less than one size between seeds)."""
    rng = random.Random(1)
    lengths = np.array([task.response_len(task.sample(rng).size) for _ in range(20_000)])
    assert np.percentile(lengths, 90) >= 2 * np.median(lengths)


@pytest.mark.parametrize("task", ALL, ids=IDS)
def test_reward_and_decode_never_raise_on_random_ids(task):
    rng = random.Random(2)
    p = task.sample(rng)
    for _ in range(300):
        ids = [rng.randrange(-2, task.vocab_size + 2) for _ in range(rng.randrange(0, 40))]
        assert task.reward(p, ids) in (0.0, 1.0)
        assert isinstance(task.decode(ids), str) and 0.0 <= task.choice_share(p, ids) <= 1.0
    assert task.decode(task.prompt_ids(p) + [task.eos_id] + task.prompt_ids(p)) == task.decode(task.prompt_ids(p))


@pytest.mark.parametrize("task", ALL, ids=IDS)
def test_the_held_out_set_is_fixed_and_covers_every_bucket(task):
    a, b = task.eval_set(per_bucket=3), task.eval_set(per_bucket=3)
    assert a == b and len(a) == 3 * len(task.buckets())
    assert {task.bucket_of(p.size) for p in a} == {f"{lo}-{hi}" for lo, hi in task.size_buckets if lo <= task.max_n}


@pytest.mark.parametrize("task", ALL, ids=IDS)
def test_a_parsed_prompt_is_the_problem(task):
    for p in task.eval_set(per_bucket=2):
        assert task.parse(task.decode(task.prompt_ids(p))) == p
    assert task.parse("") is None and task.parse("not a problem at all") is None


@pytest.mark.parametrize("task", ALL, ids=IDS)
def test_merges_start_from_parts_that_spell_them(task):
    for merged, parts in task.merges():
        assert task.decode([merged]) == "".join(task.decode([i]) for i in parts)


@pytest.mark.parametrize("task", ALL, ids=IDS)
def test_meta_makes_the_task_again_and_digests_its_traces(task):
    other = dataclasses.replace(task, alpha=task.alpha + 0.25)
    assert tasks.from_meta(task.meta()) == task and tasks.from_meta(other.meta()) == other
    assert task.meta()["name"] == task.name and len(task.meta()["traces"]) == 16
    assert task.meta() != other.meta()


def test_the_warmup_key_follows_what_the_warmups_read_not_the_rest_of_the_code(monkeypatch):
    """Task.meta keys the cached warm-ups: an edit of the reward or a docstring (planted on the class)
    keeps it; an edit of the warm-up traces, of the prompts or of the merges changes it."""
    cls = type(ALL[0])
    before = cls().meta()
    assert cls().meta() == before  # drawn with a fixed seed
    monkeypatch.setattr(cls, "reward", lambda self, problem, ids: 0.0)
    monkeypatch.setattr(cls, "__doc__", "an edited docstring")
    assert cls().meta() == before
    edits = {"warmup_example": lambda self, problem, rng: ([1, 2, 3], 1),
             "prompt_ids": lambda self, problem: [0],
             "merges": lambda self: []}
    for name, edit in edits.items():
        with monkeypatch.context() as m:
            m.setattr(cls, name, edit)
            assert cls().meta()["traces"] != before["traces"], name
    real = cls.warmup_example  # a trace edited only on the largest problems still shows
    with monkeypatch.context() as m:
        m.setattr(cls, "warmup_example", lambda self, problem, rng: (
            real(self, problem, rng) if problem.size < self.max_n else ([7], 0)))
        assert cls().meta()["traces"] != before["traces"]


def test_an_rl_checkpoint_is_keyed_on_the_task_code_the_warmups_are_not(monkeypatch):
    """`code` digests the task's source (planted: the source read back with a reward edited): what an
    RL checkpoint depends on (train.rl_meta) beyond the traces that key the warm-ups."""
    import inspect
    import train
    from harness import config
    args = config.parse_args(["--task", "running_sum", "--max-n", "4", "--block-size", "64"])
    task = config.task_of(args)
    before, meta = task.code, train.rl_meta(args, config.model_config(args, task), task)
    assert len(before) == 16 and meta["task_code"] == before
    real = inspect.getsource
    monkeypatch.setattr(inspect, "getsource", lambda obj: real(obj).replace("def reward", "def reward "))
    assert task.code != before and task.meta() == meta["rl_task"]
    assert train.rl_meta(args, config.model_config(args, task), task) != meta


def test_an_unknown_task_is_named_with_the_registered_ones():
    with pytest.raises(ValueError, match="registered: " + ", ".join(tasks.TASKS)):
        tasks.from_meta({"name": "no_such_task"})


def test_a_task_may_start_its_sizes_above_1_and_leave_out_the_choice():
    """What a task of one's own needs no more than its interface: sizes from min_n (a pairwise task needs two
    items), and no `choice` (the summary then prints no choice share)."""
    from harness.report import length_line
    base = tasks.TASKS["running_sum"]
    task = dataclasses.replace(base(), min_n=3, max_n=7)
    rng = random.Random(3)
    assert {task.sample(rng).size for _ in range(2000)} == set(range(3, 8))
    assert task.buckets() == [(3, 5), (6, 7)]
    assert {p.size for p in task.eval_set(per_bucket=50)} == set(range(3, 8))
    with pytest.raises(ValueError, match="--min-n"):
        base(min_n=5, max_n=4)
    history = [{"reward": 0.5, "response_len": 10.0, "choice_share": 0.5}]
    assert length_line(history, "single steps").endswith(", single steps 50% -> 50%")
    assert length_line(history, tasks.Task.choice) == "  response length       10.0 -> 10.0 tokens"
    assert tasks.Task.choice_share(task, None, [1, 2]) == 0.0


def test_make_encoding_builds_bytes_merges_and_the_special_tokens(no_network):
    enc = tasks.make_encoding("t", ["ab", "cd"], pat_str=r"[a-z]{2}(?= )|\S|\s+")
    assert enc.n_vocab == 256 + 2 + 2
    assert enc.encode_single_token("ab") == 256 and enc.encode_single_token("cd") == 257
    assert enc.encode_single_token(tasks.EOS) == 258 and enc.encode_single_token(tasks.PAD) == 259
    assert tasks.encode(enc, "ab cd") == [256, ord(" "), ord("c"), ord("d")]  # the pattern decides the merge
    assert tasks.encode(enc, tasks.EOS) != [258] and enc.decode(tasks.encode(enc, "é ✓<|pad|>")) == "é ✓<|pad|>"


def test_a_task_in_a_new_module_of_the_folder_registers_itself(tmp_path):
    """Dropping a file with a named Task subclass into tasks/ is all it takes: the package imports
    every module in its folder (checked in a fresh interpreter, the module planted and removed),
    and an unnamed subclass (a base for others) is not registered."""
    import os
    import subprocess
    import sys
    path = os.path.join(os.path.dirname(tasks.__file__), "planted_registry_check.py")
    with open(path, "w") as f:
        f.write("from dataclasses import dataclass\nfrom tasks.running_sum import RunningSum\n\n\n"
                "@dataclass(frozen=True)\nclass Planted(RunningSum):\n    name = \"planted_registry_check\"\n")
    try:
        out = subprocess.run([sys.executable, "-c", "import tasks; print(sorted(tasks.TASKS))"], capture_output=True,
                             text=True, cwd=os.path.dirname(os.path.dirname(tasks.__file__)), check=True,
                             env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"}).stdout
    finally:
        os.remove(path)
    assert "planted_registry_check" in out and "running_sum" in out
    unnamed = dataclasses.make_dataclass("Unnamed", [], bases=(tasks.Task,), frozen=True)
    assert unnamed not in tasks.TASKS.values()
