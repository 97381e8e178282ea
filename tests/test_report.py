"""report.py on hand-made metrics.jsonl records: the step line and the timeline keep the text
train.py prints; a step's record holds the long tail (every response's length, how far apart the
ranks finished, the slowest rank's rollout time by batch size, the timeline on the steps it is
printed); the summary's lines read it, with numbers worked out by hand; the CLI reads a run
directory and fails with one error line; two runs are compared by tenths, and step by step where
they wrote the same responses. No model runs."""
import json
import os
import subprocess
import sys
import types

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from harness import report  # noqa: E402
from harness.instrument import RolloutStats, seconds_by_batch  # noqa: E402
from tasks.running_sum import RunningSum  # noqa: E402

TASK = RunningSum()

SEGMENTS = [{"rank": 0, "rollout_time": 1.0, "idle_time": 0.2, "drafter_steps": 3,
             "segments": [["plain", 0, 0.5], ["spec", 0.5, 1.0], ["train", 1.0, 1.2]]},
            {"rank": 1, "rollout_time": 1.2, "idle_time": 0.0, "drafter_steps": 0,
             "segments": [["plain", 0, 0.9], ["spec", 0.9, 1.2]]}]

# a record's long tail: every response's length, how much earlier
# the fastest rank finished, the slowest rank's rollout seconds by batch size, its timeline
LONG_TAIL = {"response_lens": [30, 40, 50], "rank_spread": 0.0, "timeline": None,
             "rollout_by_batch": {"buckets": ["1", "2", "3-4"], "plain": [0.1, 0.2, 1.0],
                                  "spec": [0.3, 0.1, 0.0]}}


def record(step, **over):
    """A metrics.jsonl record as train.py writes it (the keys report.py reads), with `over` set."""
    rec = {"step": step, "step_time": 2.0, "rollout_time": 1.7, "update_time": 0.3,
           "rollout_share": 0.85, "tail_share": 0.4, "slowest_wait": 0.002, "reward": 0.5,
           "accept_len": 2.5, "accept_rate": 0.6, "sd_token_frac": 0.3, "drafter_acceptance": 0.7,
           "drafted_at": [10, 6], "accepted_at": [8, 3], "bandit_best": {"0": 4, "2": 0},
           "response_len": 40.0, "choice_share": 0.0, "skipped_update": False,
           "drafter_skipped": 0, "tok_s": 1234.5, "idle_time": 0.25, "drafter_steps": 7,
           "ranks": [{"rank": 0, "rollout_time": 1.7, "idle_time": 0.0, "drafter_steps": 7,
                      "tokens": 100, "drafter_checksum": "abc"}], **LONG_TAIL}
    rec.update(over)
    return rec


def write_run(path, records):
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    return str(path)


# -----------------------------------------------------------------------------
# the text train.py prints, unchanged: a change to it is a change every reader of a log sees

def test_the_timeline_and_the_position_counts_keep_their_text():
    assert report.render_timeline(SEGMENTS, width=24) == (
        "rank  0 |##########SSSSSSSSSStttt| 1.00s rollout, 0.20s idle, 3 drafter steps\n"
        "rank  1 |##################SSSSSS| 1.20s rollout, 0.00s idle, 0 drafter steps\n"
        "        # plain  S spec  t train  . wait   (full width = 1.20s)")
    stats = types.SimpleNamespace(drafted_at=[5, 3], accepted_at=[4, 1], steps_by_k=[0, 2, 7])
    assert report.position_counts(stats, 3) == {
        "drafted_at0": 5, "drafted_at1": 3, "drafted_at2": 0,
        "accepted_at0": 4, "accepted_at1": 1, "accepted_at2": 0,
        "steps_k0": 0, "steps_k1": 2, "steps_k2": 7, "steps_k3": 0}


def test_step_line_keeps_its_text(capsys):
    rec = record(3, drafter_skipped=2, skipped_update=True, accept_len=None, accept_rate=None)
    report.log_step(rec, SEGMENTS, types.SimpleNamespace(rl_steps=10, timeline_every=3))
    out = capsys.readouterr().out.splitlines()
    assert out[0] == ("step 0003/10 | reward 0.500 | step 2.00s | rollout 1.70s (85%, tail 40%) "
                      "| tok/s 1,234 | accept 0.00 (0% of drafts) | sd tok 30% | drafter acceptance "
                      "70.0% | idle 0.25s | drafter steps 7 (2 non-finite, skipped) | SKIPPED "
                      "non-finite update")
    assert out[1:] == report.render_timeline(SEGMENTS).splitlines()  # step 3 of every 3rd


# -----------------------------------------------------------------------------
# the summary, worked out by hand

SUMMARY = """
summary
  RL steps              20 (A -> B: the first 2 steps' mean -> the last 2 steps')
  mean step time        2.000s (rollout 1.700s, update 0.300s, rollout share 85%)
  slowest rank's wait   2.0 ms mean, from its rollout's end to its update's start
  tail share            40% median (the slowest rank's rollout time after 90% of its rows had finished)
  rank spread           the fastest rank finished its rollout 10% before the slowest (median over steps)
  idle-time training    in 10 of 20 steps (50%), 70 drafter steps in all
  rollout by batch size 3-4 59% | 2 18% (spec 6%) | 1 24% (spec 18%) (of the slowest rank's time)
  response lengths      median 40, p90 50, max 50 tokens; the longest 5% hold 6% of the tokens
  longest / median      1.25 (a step's longest response over its median, median over steps)
  drafter acceptance    n/a (teacher-forced, on each step's fresh rows before training on them)
  accept length         2.50 -> 2.50 tokens per verify step, as the bandit played k
  at k = 4              n/a tokens per verify step, from the acceptance by position
  accepted by position  80% -> 80% | 50% -> 50% (draft 1, 2, ...)
  bandit's k per batch  1: 4, 3-4: 0 (rank 0, the end of the run)
  accuracy              2.5% -> 92.5% (right answers), mean reward 0.400 -> 0.400
  response length       40.5 -> 58.5 tokens, single steps 0% -> 10%
  skipped updates       0 of the target, 3 drafter steps (not finite)
  greedy  before RL     overall  50.0% | 1-2  75.0%
  greedy  after RL      overall  50.0% | 1-2  75.0%
  sampled before RL     overall  25.0% | 1-2  50.0%; mean reward 0.400
  sampled after RL      overall  25.0% | 1-2  50.0%; mean reward 0.400
  length  before RL     overall  12.0 | 1-2   8.5 tokens (sampled)
  length  after RL      overall  12.0 | 1-2   8.5 tokens (sampled)
  wall time             61s
"""  # noqa: E501


def test_summary_lines_by_hand(capsys):
    """20 steps: the tenths are steps 0-1 and 18-19; two ranks;
    every other step trained the drafter; the acceptance is unscored in the first tenth. The fastest
    rank is 30% ahead in 7 steps (0, 3, ..., 18), 10% in 13: the median is 10%. 60 responses
    of 30, 40 and 50 tokens: the longest 5% are three of 50, 150 of 2,400 tokens (6%). A
    partial-credit reward (planted: a flat 0.4) moves the mean reward, never the accuracy."""
    history = [record(s, accuracy=0.05 * s if s < 19 else 0.95, reward=0.4, response_len=40.0 + s,
                      choice_share=0.0 if s < 18 else 0.1, drafter_skipped=int(s == 5) * 3,
                      drafter_steps=7 * (s % 2), rank_spread=0.3 if s % 3 == 0 else 0.1,
                      ranks=[{"rank": 0}, {"rank": 1}], drafter_acceptance=None if s < 2 else 0.9)
               for s in range(20)]
    acc = {"greedy": {"accuracy": {"overall": 0.5, "1-2": 0.75}, "mean reward": 0.5},
           "sampled": {"accuracy": {"overall": 0.25, "1-2": 0.5}, "mean reward": 0.4},
           "length": {"overall": 12.0, "1-2": 8.5}}
    report.summary(history[::-1], acc, acc, 61.2, TASK)  # records out of order: sorted by step
    out = capsys.readouterr().out
    assert out == SUMMARY
    report.summary(history, {}, {}, 61.2, TASK)
    assert "  held-out accuracy     not evaluated (--eval-per-bucket 0)\n" in capsys.readouterr().out


def test_acceptance_at_k4_from_the_positions_first_tenth_and_last():
    """Rates from the summed counts, (8+6)/(10+30) = 35%, not the mean of the steps' (80%, 20%)."""
    assert report.accept_len_at([0.5, 0.5, 0.5, 0.5, 0.1]) == pytest.approx(1.9375)
    assert report.accept_len_at([1.0, 1.0, 1.0, 1.0]) == 5.0
    assert report.accept_len_at([0.9, 0.8, 0.7]) is None
    assert report.accept_len_at([0.9, None, 0.7, 0.5]) is None
    history = [record(s, drafted_at=[10] * 4, accepted_at=[10 if s < 10 else 5] * 4)
               for s in range(100)]
    lines = report.record_lines(history, TASK)
    assert "  at k = 4              5.00 -> 1.94 tokens per verify step, from the acceptance " \
           "by position" in lines
    history = [record(s) for s in range(20)]
    history[0].update(drafted_at=[10, 4], accepted_at=[8, 1])
    history[1].update(drafted_at=[30, 0], accepted_at=[6, 0])
    history[18].update(drafted_at=[30, 21], accepted_at=[3, 3])
    history[19].update(drafted_at=[10, 0], accepted_at=[1, 0])
    assert report.positions_line(history) == "35% -> 10% | 25% -> 14% (draft 1, 2, ...)"
    assert report.positions_line([record(0, drafted_at=[], accepted_at=[])]) == "no drafts"


def test_length_distribution_by_hand():
    # 1..21: the median is the 11th, p90 the 19th (nearest rank: ceil(0.9 * 21)), the longest 5%
    # are two responses (ceil(21 / 20)) holding 20 + 21 of the 231 tokens
    assert report.length_distribution(list(range(21, 0, -1))) == {
        "median": 11, "p90": 19, "max": 21, "top5_share": 41 / 231}
    assert report.length_distribution([10] * 19 + [110]) == {
        "median": 10, "p90": 10, "max": 110, "top5_share": 110 / 300}
    assert report.length_distribution([3, 1, 10, 2]) == {
        "median": 2.5, "p90": 10, "max": 10, "top5_share": 10 / 16}
    assert report.length_distribution([7]) == {"median": 7, "p90": 7, "max": 7, "top5_share": 1.0}
    assert report.length_distribution([0, 0])["top5_share"] == 0.0


def test_rollout_time_by_batch_size_sums_the_run_largest_batches_first():
    short = {"buckets": ["1", "2"], "plain": [0.0, 0.5], "spec": [0.5, 0.0]}
    long = {"buckets": ["1", "2", "3-4", "5-8"], "plain": [0.25, 0.0, 0.0, 2.0],
            "spec": [0.5, 0.25, 0.0, 0.0]}
    history = [record(0, rollout_time=1.0, rollout_by_batch=short),
               record(1, rollout_time=4.0, rollout_by_batch=long)]
    assert report.batch_shares(history) == "5-8 40% | 2 15% (spec 5%) | 1 25% (spec 20%)"


def test_the_stale_drafter_line():
    stale = {"step": 80, "k": 3, "figures": [3.0, 2.7, 3.6]}
    line = report.stale_lines(stale)
    assert line[0].startswith("  stale drafter         3.00 -> 2.70 (-10.0%) -> 3.60 (+20.0%) "
                              "tokens per verify step at k = 3")
    assert "step 80's drafter for step 80's target" in line[1]
    assert report.stale_lines(None) == []


# -----------------------------------------------------------------------------
# the step's record: the long tail

def rank_part(rank, rollout_time, segments, by_batch):
    """One rank's `local` part of a step's record (step_record's)."""
    return {"rank": rank, "rollout_time": rollout_time, "draft_time": 0.1, "idle_time": 0.0,
            "drafter_steps": 2, "wait_to_update": 0.01, "drafter_skipped": 0, "tokens": 10,
            "drafter_checksum": "abc", "rows": 2, "tail_share": 0.5, "segments": segments,
            "by_batch": by_batch}


TOTAL = {"tokens": 20, "sd_tokens": 6, "sd_row_steps": 3, "accepted": 2, "drafted": 4,
         "scored_kept": 0, "scored_positions": 0, "choice": 0, "response_tokens": 16, "correct": 1}


def test_the_record_holds_the_long_tail_and_the_slowest_ranks_time_by_batch_size(monkeypatch):
    fast = rank_part(0, 1.5, [["plain", 0.0, 0.12344], ["wait", 0.12344, 2.0]],
                     {"plain": [0.5], "spec": [1.0]})
    slow = rank_part(1, 2.0, [["plain", 0.0, 1.99996]],
                     {"plain": [0.25, 0.0, 1.5], "spec": [0.25, 0.0, 0.0]})
    monkeypatch.setattr(report, "gather_ranks", lambda local: [fast, slow])
    responses = [[5] * 3, [5] * 9, [5], [5] * 3]  # global row order
    rewards = torch.tensor([1.0, 0.5, 0.0, 0.5])  # partial credit: one right answer of four
    rec, ranks = report.rank_record(4, fast, TOTAL, rewards, responses, 3.0, 0.5, timeline=True)
    assert rec["accuracy"] == 0.25 and rec["reward"] == 0.5
    assert rec["response_lens"] == [3, 9, 1, 3] and rec["response_len"] == 4.0
    assert rec["rank_spread"] == pytest.approx(0.25)  # 1 - 1.5 / 2.0
    assert rec["rollout_by_batch"] == {"buckets": ["1", "2", "3-4"], **slow["by_batch"]}
    assert rec["timeline"] == [[["plain", 0.0, 0.1234], ["wait", 0.1234, 2.0]],
                               [["plain", 0.0, 2.0]]]  # to 0.1 ms
    assert rec["accept_len"] == 2.0 and rec["accept_rate"] == 0.5 and rec["drafter_acceptance"] is None
    assert all("segments" not in r and "by_batch" not in r for r in rec["ranks"])
    assert ranks == [fast, slow]
    assert report.rank_record(5, fast, TOTAL, rewards, responses, 3.0, 0.5)[0]["timeline"] is None
    monkeypatch.setattr(report, "gather_ranks", lambda local: [local])  # one rank: no spread
    assert report.rank_record(5, slow, TOTAL, rewards, responses, 3.0, 0.5)[0]["rank_spread"] == 0.0


def test_the_timeline_is_kept_on_the_steps_it_is_printed():
    every3 = types.SimpleNamespace(timeline_every=3, rl_steps=8)
    assert [s for s in range(8) if report.timeline_due(s, every3)] == [0, 3, 6, 7]  # and the last
    never = types.SimpleNamespace(timeline_every=0, rl_steps=8)
    assert not any(report.timeline_due(s, never) for s in range(8))


def test_rollout_seconds_by_batch_size_keep_plain_and_speculative_apart():
    steps = [(8, 0.5, False), (6, 0.25, False), (3, 0.125, True), (2, 0.0625, True),
             (1, 1.0, False), (1, 2.0, True)]
    assert seconds_by_batch(steps) == {"plain": [1.0, 0.0, 0.0, 0.75],
                                       "spec": [2.0, 0.0625, 0.125, 0.0]}
    assert seconds_by_batch([]) == {"plain": [], "spec": []}
    # a rollout's: its prefill is plain at the full batch (8 rows), then its steps
    stats = RolloutStats(prefill_time=0.5, batch_sizes=[8, 3], step_times=[0.25, 0.125],
                         spec_steps=[False, True])
    assert stats.finish(8).by_batch == {"plain": [0.0, 0.0, 0.0, 0.75],
                                        "spec": [0.0, 0.0, 0.125, 0.0]}
    assert RolloutStats().finish(0).by_batch == {"plain": [], "spec": []}


# -----------------------------------------------------------------------------
# python -m harness.report <run> [more runs]

def test_the_cli_prints_a_finished_runs_summary(tmp_path):
    records = [record(s, accept_len=3.0 - 0.1 * s) for s in range(20)]
    run = write_run(tmp_path / "run", records)
    with open(os.path.join(run, "task.json"), "w") as f:
        json.dump(RunningSum().meta(), f)
    for target in (run, os.path.join(run, "metrics.jsonl")):
        r = subprocess.run([sys.executable, "-m", "harness.report", target], cwd=ROOT,
                           capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stderr
        assert r.stdout.splitlines() == ["summary"] + report.record_lines(records, TASK)
        assert "2.95 -> 1.15" in r.stdout and "single steps" in r.stdout  # the task's words
        assert "wall time" not in r.stdout and "held-out" not in r.stdout  # not in the records


@pytest.mark.parametrize("content", ["", "\n\n", "{not json\n", "[1, 2]\n",
                                     json.dumps({"step": 0}) + "\n", None])
def test_the_cli_on_a_bad_metrics_file_prints_one_error_line(tmp_path, capsys, content):
    run = tmp_path / "run"
    os.makedirs(run)
    if content is not None:  # None: a directory without metrics.jsonl
        (run / "metrics.jsonl").write_text(content)
    with pytest.raises(SystemExit) as e:
        report.main([str(run)])
    out, err = capsys.readouterr()
    assert e.value.code == 2 and out == ""
    assert len(err.splitlines()) == 1 and err.startswith("error:"), err


def test_a_binary_file_for_a_run_prints_one_error_line(tmp_path, capsys):
    a = write_run(tmp_path / "a", [record(s) for s in range(5)])
    (tmp_path / "ckpt.pt").write_bytes(b"PK\x03\x04\x80\xff" * 10)
    with pytest.raises(SystemExit) as e:
        report.main([a, str(tmp_path / "ckpt.pt")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err == f"error: {tmp_path / 'ckpt.pt'} is not a text file\n"


def paired_runs(tmp_path, b_digest=lambda s: f"d{s}"):
    """Runs A and B of 20 steps: B's rollout takes 1.2 x A's at every step, B's step 1.5 x A's
    but 0.5 x on the last tenth (steps 18, 19); B's file is out of step order. b_digest: B's
    responses_digest at step s (A's is d<s>)."""
    a = [record(s, rollout_time=1.0 + 0.1 * s, step_time=2.0 + 0.1 * s, responses_digest=f"d{s}")
         for s in range(20)]
    b = [record(s, rollout_time=1.2 * (1.0 + 0.1 * s),
                step_time=(1.5 if s < 18 else 0.5) * (2.0 + 0.1 * s),
                responses_digest=b_digest(s)) for s in range(20)]
    return write_run(tmp_path / "fast", a), write_run(tmp_path / "slow", b[::-1])


def test_runs_with_the_same_responses_are_paired_step_by_step(tmp_path, capsys):
    a, b = paired_runs(tmp_path)
    report.main([a, b])
    out = capsys.readouterr().out.splitlines()
    assert out[1] == f"comparison: A = {a}, B = {b}"
    assert f"  rollout time    A 1.050s -> 2.850s" in out  # steps 0-1 and 18-19
    assert f"  rollout time    B 1.260s -> 3.420s" in out
    assert "  paired: the same responses at all 20 steps; median of the per-step ratios to A " \
           "(above 1: slower than A)" in out
    assert out[-2:] == ["    B / A  rollout time  1.20 over all 20 steps, 1.20 over the last 2",
                        "    B / A  step time     1.50 over all 20 steps, 0.50 over the last 2"]


def test_runs_with_different_responses_are_compared_by_tenths_only(tmp_path, capsys):
    a, b = paired_runs(tmp_path, b_digest=lambda s: "other" if s in (3, 7) else f"d{s}")
    report.main([a, b])
    out = capsys.readouterr().out.splitlines()
    assert out[-1] == ("  not paired: the runs' responses differ at 2 of 20 steps "
                       "(responses_digest): compare the tenths only")
    assert not any("over all" in ln for ln in out)
    # records written before the digest existed pair with nothing, not with each other
    runs = [[record(s) for s in range(20)]] * 2
    assert report.pairing_lines(runs)[0].startswith("  not paired: the runs' responses differ at 20")


@pytest.mark.parametrize("b_steps", [None, range(19), range(1, 21)])
def test_compare_on_bad_input_prints_one_error_line(tmp_path, capsys, b_steps):
    # None: B is a directory without metrics.jsonl; else B's steps differ from A's 0..19
    a = write_run(tmp_path / "a", [record(s) for s in range(20)])
    b = tmp_path / "b"
    os.makedirs(b)
    if b_steps is not None:
        write_run(b, [record(s) for s in b_steps])
    with pytest.raises(SystemExit) as e:
        report.main([a, str(b)])
    out, err = capsys.readouterr()
    assert e.value.code == 2 and out == ""
    assert len(err.splitlines()) == 1 and err.startswith("error:"), err
    assert ("no such file" if b_steps is None else "the runs are of different steps") in err


def test_a_run_ends_naming_its_baseline_and_its_stale_drafter_twins():
    """The default run's last lines: the same RL with --tlt off and the report of both; then, from a
    drafter warmed up first, the same RL trained on idle ranks and frozen, and their report. A run
    that warmed its drafter up is itself the trained one; a run that does not train its drafter
    names nothing."""
    from harness import config
    lines = report.next_lines(config.parse_args(["--out-dir", "runs/a/", "--rl-steps", "300"]))
    head = ("  torchrun --standalone --nproc_per_node=2 train.py --warmup-dir runs/a/ --rl-steps 300 "
            "--eval-per-bucket 0")
    assert lines[2] == head + " --out-dir runs/a-off --tlt off"  # no other flag was given
    assert lines[3].strip() == "python -m harness.report runs/a/ runs/a-off"
    assert lines[6] == head + " --drafter-warmup-steps 6000 --out-dir runs/a-warm"
    assert lines[7] == head + " --drafter-warmup-steps 6000 --out-dir runs/a-frozen --drafter-updates off"
    assert lines[8].strip() == "python -m harness.report runs/a-warm runs/a-frozen"
    warm = report.next_lines(config.parse_args(["--drafter-warmup-steps", "3000"]))
    assert len(warm) == 8 and "--drafter-warmup-steps 3000 --out-dir out-frozen" in warm[6]
    assert warm[7].strip() == "python -m harness.report out out-frozen"
    # every other flag the run was given, whole: the task and its settings are the workload
    given = ["--task", "shell_game", "--max-n=6", "--out-dir", "b", "--rl-steps", "50",
             "--eval-per-bucket", "3", "--tlt", "on"]
    lines = report.next_lines(config.parse_args(given), world_size=4)
    start = "  torchrun --standalone --nproc_per_node=4 train.py --task shell_game --max-n=6 "
    assert lines[2] == start + "--warmup-dir b --rl-steps 50 --eval-per-bucket 0 --out-dir b-off --tlt off"
    assert all(line.startswith(start) for line in lines[6:8])
    for flags in (["--tlt", "off"], ["--drafter-updates", "off"]):
        assert report.next_lines(config.parse_args(flags)) == []
