"""The README's reading table is true: it names every function and method that one RL step reaches,
with the line count of each, and its rows sum to the total it states; and it is the table that
`python -m harness.reading_path --write` makes from the code, whose docstring gives the walk's
rules (by name from train.rl_step, and through a module call to its forward).
"""
from harness import reading_path as rp

FIX = "run `python -m harness.reading_path --write`"


def readme_table():
    """The README's table as written: [(names, counts)] per row, and the total it states."""
    _, section, _ = rp.split_readme(rp.read_readme())
    return rp.read_table(section)


def test_the_reading_table_names_every_function_the_step_reaches_with_its_true_length():
    code = rp.read_code()
    rows, total = readme_table()
    listed = [name for names, _ in rows for name in names]
    assert len(listed) == len(set(listed)), f"a function is listed twice: {FIX}"
    missing = [q for q in rp.reached(code) if q not in listed]
    assert not missing, f"the step reaches these, the README does not name them: {missing}: {FIX}"
    for names, counts in rows:
        assert len(names) == len(counts), f"{names}, {counts}: {FIX}"
        for name, count in zip(names, counts):
            assert name in code.defs, f"{name} is not a core function: {FIX}"
            true = rp.n_lines(code.defs[name][1])
            assert count == true, f"{name}: the README says {count} lines, the code {true}: {FIX}"
    stated = sum(c for _, counts in rows for c in counts)
    assert stated == total, f"the rows sum to {stated}, the README says {total}: {FIX}"


def test_the_readme_table_is_the_generated_one():
    """What --write would write: the rows' order, grouping and words too, not only the counts."""
    _, section, _ = rp.split_readme(rp.read_readme())
    assert section == rp.section(rp.read_code()), f"README.md's path of one RL step is stale: {FIX}"


def test_the_walk_follows_calls_by_name_and_leaves_out_what_no_call_reaches():
    """The walk itself: rl_step reaches the rollout and, through the RunningBatch's steps, the
    default sampler's methods of the names it calls, and what train.run hands the step (the
    harness's observer, timed drafter and barrier); not what only --sampler rejection or
    TLT_DEBUG=1 runs, and not code that only a harness command calls."""
    order = rp.reached(rp.read_code())
    assert order[0] == "train.rl_step"
    assert {"rollout.rollout", "RunningBatch.__init__", "RunningBatch.compact", "GumbelSampler.verify",
            "Drafter.propose", "RunningBatch.batch_size", "RunningBatch.choose_draft", "RolloutStats.__call__",
            "TimedDrafter.propose", "Watched.is_completed", "DecodeStats.__call__"} <= set(order)
    assert not {"RejectionSampler.verify", "speculative.verify", "instrument.check"} & set(order)
    assert "FixedK.choose" not in order and "speculative.autoregressive_generate" not in order


def test_the_walk_follows_a_module_call_to_its_forward():
    """`self.target(...)` reaches GPT.forward, and the forwards it calls theirs (`self.stack`,
    `block`, `self.attn`); `self(...)` in Drafter.propose reaches Drafter.forward.
    A call of a torch function of a module's attribute name (`torch.stack`) reaches nothing."""
    code = rp.read_code()
    forwards = {"GPT.forward", "Blocks.forward", "Block.forward", "Attention.forward",
                "Drafter.forward"}
    assert forwards <= set(rp.reached(code))
    assert set(rp.reached(code, "RunningBatch.plain_step")) >= forwards - {"Drafter.forward"}
    assert "Drafter.forward" in rp.callees(code, "Drafter.propose")
    assert not forwards & set(rp.reached(code, "RunningBatch.compact"))
    assert rp.callees(code, "Block.forward") == ["Attention.forward"]  # self.norm1: torch's


def test_the_rows_place_the_speculative_step_before_the_noise_it_uses():
    names = [names for names, _, _ in rp.rows(rp.read_code())]
    row_of = {q: i for i, row in enumerate(names) for q in row}
    assert row_of["train.rl_step"] == 0
    assert row_of["RunningBatch.speculative_step"] < row_of["speculative.gumbel_noise"]


def test_every_function_that_real_steps_call_is_one_the_walk_reaches(tmp_path):
    """Two ranks, three tiny RL steps under a profiler (`reading_path --trace`): every function of
    the core and the harness that they called is one the walk reaches, so the table names it. The
    walk is by name, so it may reach more (a default `Bandit()` that train.py never needs)."""
    import json
    import os
    import subprocess
    import sys
    flags = ["--device", "cpu", "--max-n", "4", "--block-size", "56", "--n-layer", "1", "--n-head", "2",
             "--n-embd", "16", "--warmup-steps", "10", "--warmup-tokens", "256", "--drafter-warmup-seqs", "16",
             "--drafter-warmup-steps", "5", "--drafter-batch", "4", "--prompts-per-step", "4", "--group-size", "2",
             "--eval-per-bucket", "0", "--timeline-every", "0", "--rl-steps", "3", "--out-dir", str(tmp_path)]
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
                        "-m", "harness.reading_path", "--trace", *flags], cwd=rp.ROOT, capture_output=True, text=True,
                       timeout=300, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    called = set()
    for rank in (0, 1):
        with open(tmp_path / f"reached.{rank}.json") as f:
            called |= set(json.load(f))
    # the steps ran the idle loop and each of what train.run hands the step
    assert {"scheduler.idle_train", "RolloutStats.__call__", "TimedDrafter.propose", "Watched.is_completed"} <= called
    missing = called - set(rp.reached(rp.read_code()))
    assert not missing, f"real steps called these, the walk does not reach them: {sorted(missing)}"


def test_the_core_table_and_the_pitch_give_each_file_its_true_length():
    """The README's table of the core (and train.py) gives each file its line count, and the pitch
    the six core files' sum."""
    import os
    import re
    readme = rp.read_readme()
    rows = dict(re.findall(r"^\| `(\w+\.py)` \| (\d+) \|", readme, flags=re.M))
    core = ("model.py", "speculative.py", "rollout.py", "drafter.py", "scheduler.py", "rl.py")
    assert set(core + ("train.py",)) <= set(rows), sorted(rows)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    true = {name: sum(1 for _ in open(os.path.join(root, name))) for name in rows}
    assert {n: int(c) for n, c in rows.items()} == true
    stated = re.search(r"six core files\s+\(([\d,]+) lines\)", readme)
    assert stated and int(stated.group(1).replace(",", "")) == sum(true[n] for n in core)
