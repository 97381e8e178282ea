"""report.py and summary.py on hand-made metrics.jsonl records: the step line, the timeline and the
summary keep the text train.py prints; a step's record holds the long tail (every response's length,
how far apart the ranks finished, the slowest rank's rollout time by batch size, the timeline on the
steps it is printed) and the summary's lines read it, with numbers worked out by hand; the picture
shows a run's trends, the acceptance by position from summed counts, and says so when a run never
speculated; records written before a figure existed still load; the CLI reads a run directory and
fails with one error line; two runs are compared by bins, and step by step where they wrote the
same responses; the SVG holds each run's series, a single run's length distribution and timelines.
No model runs; the CLI's processes take most of its time."""
import json
import os
import subprocess
import sys
import types
import xml.etree.ElementTree as ET

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from harness import report, summary  # noqa: E402
from harness.instrument import RolloutStats, seconds_by_batch  # noqa: E402
from tasks.running_sum import RunningSum  # noqa: E402

TASK = RunningSum()

SEGMENTS = [{"rank": 0, "rollout_time": 1.0, "idle_time": 0.2, "drafter_steps": 3,
             "segments": [["plain", 0, 0.5], ["spec", 0.5, 1.0], ["train", 1.0, 1.2]]},
            {"rank": 1, "rollout_time": 1.2, "idle_time": 0.0, "drafter_steps": 0,
             "segments": [["plain", 0, 0.9], ["spec", 0.9, 1.2]]}]


# a record's long tail: every response's length and the step's median and longest, how much earlier
# the fastest rank finished, the slowest rank's rollout seconds by batch size; its timeline (on some steps)
LONG_TAIL = {"response_lens": [30, 40, 50], "response_median": 40, "response_max": 50, "rank_spread": 0.0,
             "rollout_by_batch": {"buckets": ["1", "2", "3-4"], "plain": [0.1, 0.2, 1.0], "spec": [0.3, 0.1, 0.0]},
             "timeline": None}


def old_record(step, **over):
    """A record as train.py wrote it before the long tail was recorded."""
    return {k: v for k, v in record(step, **over).items() if k not in LONG_TAIL}


def record(step, **over):
    """A metrics.jsonl record as train.py writes it (the keys report.py reads), with `over` set."""
    rec = {"step": step, "step_time": 2.0, "rollout_time": 1.7, "update_time": 0.3,
           "rollout_share": 0.85, "tail_share": 0.4, "slowest_wait": 0.002, "reward": 0.5,
           "accept_len": 2.5, "accept_rate": 0.6, "sd_token_frac": 0.3, "drafter_top1": 0.7,
           "drafted_at": [10, 6], "accepted_at": [8, 3], "bandit_best": {"0": 4, "2": 0},
           "response_len": 40.0, "choice_share": 0.0, "skipped_update": False,
           "drafter_skipped": 0, "tok_s": 1234.5, "idle_time": 0.25, "drafter_steps": 7,
           "ranks": [{"rank": 0, "rollout_time": 1.7, "idle_time": 0.0, "drafter_steps": 7,
                      "tokens": 100, "drafter_checksum": "abc"}], **LONG_TAIL}
    rec.update(over)
    return rec


def row(lines, label):
    """The picture's row for a figure (its label starts the line)."""
    found = [ln for ln in lines if ln.startswith(f"  {label:16s}")]
    assert len(found) == 1, lines
    return found[0]


def cells(line, bins=10):
    """A sparkline row's bins, one block character each (a blank bin is ' ')."""
    return [line[18 + 3 * i] for i in range(bins)]


def run_cli(*args):
    return subprocess.run([sys.executable, "-m", "harness.report", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=60, env={**os.environ, "OMP_NUM_THREADS": "1"})


# -----------------------------------------------------------------------------
# the text train.py prints, unchanged: a change to it is a change every reader of a log sees

def test_timeline_and_positions_keep_their_text():
    assert report.render_timeline(SEGMENTS, width=24) == (
        "rank  0 |##########SSSSSSSSSStttt| 1.00s rollout, 0.20s idle, 3 drafter steps\n"
        "rank  1 |##################SSSSSS| 1.20s rollout, 0.00s idle, 0 drafter steps\n"
        "        # plain  S spec  t train  . wait   (full width = 1.20s)")
    assert summary.format_positions([0.5, None, 1.0, 0.123]) == "50.0   -   100.0 12.3"
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
                      "| tok/s 1,234 | accept 0.00 (0% of drafts) | sd tok 30% | drafter top-1 "
                      "70.0% | idle 0.25s | drafter steps 7 (2 non-finite, skipped) | SKIPPED "
                      "non-finite update")
    assert out[1:] == report.render_timeline(SEGMENTS).splitlines()  # step 3 of every 3rd


SUMMARY = """
summary
  RL steps              3
  mean step time        2.000s (rollout 1.700s, update 0.300s, rollout share 85%)
  slowest rank's wait   2.0 ms mean, from its rollout's end to its update's start (max 2.0 ms)
  tail share            40% median (the slowest rank's rollout time after 90% of its rows had finished)
  rollout by batch size 3-4 59% | 2 18% (spec 6%) | 1 24% (spec 18%) (shares of the slowest rank's rollout time, summed over the run; spec: in speculative steps)
  drafter top-1         70.0% -> 80.0% (teacher-forced agreement with the target on each step's fresh rows, before training on them; first and last 1 steps)
  mean accept length    2.50 tokens per verify step, 60% of drafted tokens accepted, SD token share 30%
  accepted by position  80.0 50.0 % (draft 1..2, given the earlier ones were; 48 drafts decided)
  idle-time training    drafter trained on idle ranks in 3 of 3 steps (100%), 21 drafter steps in all
  bandit's k per batch  1: 4, 3-4: 0 (rank 0, after step 0)
  bandit's k per batch  1: 4, 3-4: 0 (rank 0, end of run)
  accuracy              0.0% -> 10.0%, mean reward 0.000 -> 0.200 (means of the first and the last 1 steps)
  response length       40.0 -> 42.0 tokens, single steps 0% -> 10% (first and last 1 steps)
  response lengths      first 1 steps:  median 40, p90 50, max 50 tokens; the longest 5% of the responses hold 42% of the tokens
                        last 1 steps:   median 40, p90 50, max 50 tokens; the longest 5% of the responses hold 42% of the tokens
                        all 3 steps:    median 40, p90 50, max 50 tokens; the longest 5% of the responses hold 14% of the tokens
  longest / median      1.25 (a step's longest response over its median, median over 3 steps)
  greedy  before RL     overall  50.0% | 1-2  75.0%
  greedy  after RL      overall  50.0% | 1-2  75.0%
  sampled before RL     overall  25.0% | 1-2  50.0%; mean reward 0.400
  sampled after RL      overall  25.0% | 1-2  50.0%; mean reward 0.400
  length  before RL     overall  12.0 | 1-2   8.5 tokens (sampled)
  length  after RL      overall  12.0 | 1-2   8.5 tokens (sampled)
  skipped updates       0 of the target, 3 drafter steps (non-finite loss or gradient)
  wall time             61s
"""  # noqa: E501


def test_the_bandits_line_gives_the_tokens_a_step_of_each_buckets_k():
    """The rollout's own figure beside the bandit's k: the tokens its recent steps emitted (at batch
    1 the last row is near its end). A record written before the figure was kept prints without it."""
    from rollout import Bandit
    bandit = Bandit(arms=(2, 8), epsilon=0.0)
    for k, tokens in ((2, [3, 3, 1]), (8, [9, 2, 1])):  # the first play of an arm only marks it tried
        for n in tokens:
            bandit.update(1, k, n, 1.0)
    assert report.best_arms(bandit) == {0: 2} and report.arm_tokens(bandit, report.best_arms(bandit)) == {0: 2.0}
    history = [record(s, bandit_tokens={"0": 2.25, "2": 1.0}) for s in range(3)]
    lines = summary.record_lines(history, TASK)
    assert "  bandit's k per batch  1: 4 (2.2), 3-4: 0 (1.0) (rank 0, end of run; in brackets, tokens a step)" in lines


def test_summary_keeps_its_lines_then_draws_the_picture(capsys):
    """A partial-credit reward (planted: 0.5 for a wrong answer) moves the mean reward, not the accuracy,
    the share of right answers; a 0/1 reward's mean is its accuracy and is not repeated."""
    history = [record(s, reward=0.1 * s, accuracy=0.05 * s, response_len=40.0 + s, choice_share=0.05 * s,
                      drafter_skipped=s, drafter_top1=None if s == 0 else 0.6 + 0.1 * s)
               for s in range(3)]
    acc = {"greedy": {"accuracy": {"overall": 0.5, "1-2": 0.75}, "mean reward": 0.5},
           "sampled": {"accuracy": {"overall": 0.25, "1-2": 0.5}, "mean reward": 0.4},
           "length": {"overall": 12.0, "1-2": 8.5}}
    summary.summary(history, acc, acc, 61.2, TASK)
    out = capsys.readouterr().out
    assert out.startswith(SUMMARY)
    assert out[len(SUMMARY):].splitlines() == summary.picture(history, TASK)
    old = [{k: v for k, v in h.items() if k != "accuracy"} for h in history]  # records from before accuracy
    assert "  mean reward           0.000 -> 0.200 (means of the first and the last 1 steps)" in summary.record_lines(old, TASK)
    summary.summary(history, {}, {}, 61.2, TASK)
    out = capsys.readouterr().out
    assert "  held-out accuracy     not evaluated (--eval-per-bucket 0)\n" in out


# -----------------------------------------------------------------------------
# the picture

def test_picture_shows_the_accept_length_trend():
    # 20 steps in 10 bins of 2: accept length falls 3.0 -> 1.1, the step time rises 1.0 -> 2.9
    history = [record(s, accept_len=3.0 - 0.1 * s, step_time=1.0 + 0.1 * s) for s in range(20)]
    lines = summary.picture(history, TASK)
    accept, step_time = row(lines, "accept length"), row(lines, "step time")
    assert "2.95 -> 1.15, range 1.15..2.95 tokens/verify" in accept
    assert cells(accept) == list("█▇▆▆▅▄▃▃▂▁")  # from the maximum down to the minimum
    assert cells(step_time) == list("▁▂▃▃▄▅▆▆▇█")
    assert "1.050 -> 2.850" in step_time
    assert row(lines, "response length").endswith("40.0 -> 40.0, range 40.0..40.0 tokens")
    # records out of order draw the same picture: bins are of consecutive steps
    assert summary.picture(history[::-1], TASK) == lines


def test_picture_bins_fewer_steps_and_leaves_bins_without_speculation_blank():
    history = [record(s, accept_len=None if s < 2 else 2.0 + s) for s in range(4)]
    lines = summary.picture(history, TASK, bins=10)
    assert "in 4 bins of 1 step(s)" in lines[2]
    assert cells(row(lines, "accept length"), 4) == [" ", " ", "▁", "█"]
    assert "4.00 -> 5.00" in row(lines, "accept length")


def test_positions_are_drawn_from_counts_summed_over_the_first_and_last_tenth():
    # 20 steps: the first tenth is steps 0-1, the last steps 18-19; rates come from the summed
    # counts, (8+6)/(10+30) = 35%, not from the mean of the steps' rates (80% and 20%: 50%)
    history = [record(s) for s in range(20)]
    history[0].update(drafted_at=[10, 4], accepted_at=[8, 1])
    history[1].update(drafted_at=[30, 0], accepted_at=[6, 0])
    history[18].update(drafted_at=[30, 21], accepted_at=[3, 3])
    history[19].update(drafted_at=[10, 0], accepted_at=[1, 0])
    lines = summary.picture(history, TASK)
    start = lines.index("  accepted by position (% of the drafts decided there; "
                        "first and last 2 steps)")
    first1, last1, first2, last2 = lines[start + 1:start + 5]
    assert first1.startswith("    draft 1  first 2  |" + "█" * 14 + " " * 26 + "|")
    assert first1.endswith(" 35.0% of 40")
    assert last1.startswith("             last 2   |" + "████" + " " * 36 + "|")  # 10% of 40 cells
    assert last1.endswith(" 10.0% of 40")
    assert first2.endswith(" 25.0% of 4") and last2.endswith(" 14.3% of 21")
    assert last2.startswith("             last 2   |█████▊ ")  # 3/21 of 40 cells: 5 and 6 eighths
    assert len(lines) == start + 5


def test_a_run_without_speculation_says_so():
    history = [record(s, accept_len=None, accept_rate=None, drafter_top1=None, drafted_at=[],
                      accepted_at=[], sd_token_frac=0.0) for s in range(12)]
    lines = summary.picture(history, TASK)
    assert row(lines, "accept length") == f"  {'accept length':16s}{summary.NO_SD}"
    assert "no speculative steps" in summary.NO_SD
    assert row(lines, "drafter top-1").endswith("not scored in any step")
    assert lines[-1] == "  accepted by position  no drafts decided in the first or the last 1 step"
    assert cells(row(lines, "step time")) == ["▅"] * 10  # the other rows are drawn (flat)


def test_picture_fits_a_100_column_terminal():
    history = [record(10_000 + s, step_time=1234.567 * (1 + s), response_len=12_345.6 - s,
                      accept_len=8.99, drafted_at=[1_000_000] * 8, accepted_at=[999_999] * 8)
               for s in range(100)]
    lines = summary.picture(history, TASK)
    assert max(len(ln) for ln in lines) <= 100
    assert len([ln for ln in lines if "|" in ln]) == 16  # 8 positions, first and last tenth


# -----------------------------------------------------------------------------
# the long tail: the record's figures, the summary's lines, the picture's rows

def rank_part(rank, rollout_time, segments, by_batch):
    """One rank's `local` part of a step's record (step_record's)."""
    return {"rank": rank, "rollout_time": rollout_time, "draft_time": 0.1, "idle_time": 0.0, "drafter_steps": 2,
            "wait_to_update": 0.01, "drafter_skipped": 0, "tokens": 10, "drafter_checksum": "abc", "rows": 2,
            "tail_share": 0.5, "segments": segments, "by_batch": by_batch}


TOTAL = {"tokens": 20, "sd_tokens": 6, "sd_row_steps": 3, "accepted": 2, "drafted": 4, "top1_agree": 0,
         "top1_positions": 0, "choice": 0, "response_tokens": 16, "correct": 1}


def test_the_record_holds_the_long_tail_and_the_slowest_ranks_time_by_batch_size(monkeypatch):
    fast = rank_part(0, 1.5, [["plain", 0.0, 0.12344], ["wait", 0.12344, 2.0]], {"plain": [0.5], "spec": [1.0]})
    slow = rank_part(1, 2.0, [["plain", 0.0, 1.99996]], {"plain": [0.25, 0.0, 1.5], "spec": [0.25, 0.0, 0.0]})
    monkeypatch.setattr(report, "gather_ranks", lambda local: [fast, slow])
    # global row order; partial credit: one right answer of four, the mean reward 0.5
    responses, rewards = [[5] * 3, [5] * 9, [5], [5] * 3], torch.tensor([1.0, 0.5, 0.0, 0.5])
    rec, ranks = report.rank_record(4, fast, TOTAL, rewards, responses, 3.0, 0.5, timeline=True)
    assert rec["accuracy"] == 0.25 and rec["reward"] == 0.5
    assert rec["response_lens"] == [3, 9, 1, 3] and rec["response_len"] == 4.0
    assert rec["response_median"] == 3 and rec["response_max"] == 9
    assert rec["rank_spread"] == pytest.approx(0.25)  # 1 - 1.5 / 2.0
    assert rec["rollout_by_batch"] == {"buckets": ["1", "2", "3-4"], **slow["by_batch"]}
    assert rec["timeline"] == [[["plain", 0.0, 0.1234], ["wait", 0.1234, 2.0]], [["plain", 0.0, 2.0]]]  # to 0.1 ms
    assert all("segments" not in r and "by_batch" not in r for r in rec["ranks"]) and ranks == [fast, slow]
    assert report.rank_record(5, fast, TOTAL, rewards, responses, 3.0, 0.5)[0]["timeline"] is None
    monkeypatch.setattr(report, "gather_ranks", lambda local: [local])  # one rank: no spread
    assert report.rank_record(5, slow, TOTAL, rewards, responses, 3.0, 0.5)[0]["rank_spread"] == 0.0


def test_the_timeline_is_kept_on_the_steps_it_is_printed():
    every3 = types.SimpleNamespace(timeline_every=3, rl_steps=8)
    assert [s for s in range(8) if report.timeline_due(s, every3)] == [0, 3, 6, 7]  # and the last
    assert not any(report.timeline_due(s, types.SimpleNamespace(timeline_every=0, rl_steps=8)) for s in range(8))


def test_rollout_seconds_by_batch_size_keep_plain_and_speculative_apart():
    steps = [(8, 0.5, False), (6, 0.25, False), (3, 0.125, True), (2, 0.0625, True), (1, 1.0, False), (1, 2.0, True)]
    assert seconds_by_batch(steps) == {"plain": [1.0, 0.0, 0.0, 0.75], "spec": [2.0, 0.0625, 0.125, 0.0]}
    assert seconds_by_batch([]) == {"plain": [], "spec": []}
    # a rollout's: its prefill is plain at the full batch (8 rows), then its steps
    stats = RolloutStats(prefill_time=0.5, batch_sizes=[8, 3], step_times=[0.25, 0.125], spec_steps=[False, True])
    assert stats.finish(8).by_batch == {"plain": [0.0, 0.0, 0.0, 0.75], "spec": [0.0, 0.0, 0.125, 0.0]}
    assert RolloutStats().finish(0).by_batch == {"plain": [], "spec": []}


def test_length_distribution_by_hand():
    # 1..21: the median is the 11th, p90 the 19th (nearest rank: ceil(0.9 * 21)), the longest 5% are two
    # responses (ceil(21 / 20)) holding 20 + 21 of the 231 tokens
    assert summary.length_distribution(list(range(21, 0, -1))) == {"median": 11, "p90": 19, "max": 21,
                                                                   "top5_share": 41 / 231}
    assert summary.length_distribution([10] * 19 + [110]) == {"median": 10, "p90": 10, "max": 110,
                                                             "top5_share": 110 / 300}
    assert summary.length_distribution([3, 1, 10, 2]) == {"median": 2.5, "p90": 10, "max": 10, "top5_share": 10 / 16}
    assert summary.length_distribution([7]) == {"median": 7, "p90": 7, "max": 7, "top5_share": 1.0}
    assert summary.length_distribution([0, 0])["top5_share"] == 0.0


def test_length_lines_show_the_first_tenth_the_last_and_the_whole_run():
    lens = [[10] * 10] * 2 + [[20] * 10] * 16 + [[10] * 9 + [100]] * 2
    lines = summary.length_lines([record(s, response_lens=lens[s]) for s in range(20)])
    hold = "tokens; the longest 5% of the responses hold"
    assert lines[:3] == [f"  response lengths      first 2 steps:  median 10, p90 10, max 10 {hold} 5% of the tokens",
                         f"                        last 2 steps:   median 10, p90 10, max 100 {hold} 26% of the tokens",
                         f"                        all 20 steps:   median 20, p90 20, max 100 {hold} 10% of the tokens"]
    pairs = [(10, 30), (20, 30), (0, 5), (10, 50)]  # (median, longest): 3, 1.5, none (median 0), 5
    history = [record(s, response_median=m, response_max=x) for s, (m, x) in enumerate(pairs)]
    assert summary.length_lines(history)[-1] == ("  longest / median      3.00 (a step's longest response over its "
                                                 "median, median over 3 steps)")
    assert summary.length_lines([old_record(s) for s in range(5)]) == []


def test_the_ranks_spread_idle_training_and_rollout_time_by_batch_size_lines():
    history = [record(s, ranks=[{"rank": 0}, {"rank": 1}], rank_spread=v) for s, v in enumerate([0.1, 0.5, 0.2])]
    assert summary.spread_lines(history) == ["  rank spread           the fastest rank finished its rollout 20% before "
                                             "the slowest (median over steps of 1 - fastest/slowest)"]
    assert summary.spread_lines([record(s) for s in range(3)]) == []  # one rank
    history = [record(s, drafter_steps=n) for s, n in enumerate([0, 3, 0, 5])]
    assert summary.idle_lines(history) == ["  idle-time training    drafter trained on idle ranks in 2 of 4 steps "
                                           "(50%), 8 drafter steps in all"]
    # 5 s of the slowest rank's rollouts over two steps (the second's last second after its last step; one
    # older record): shares of the 5 s, largest batches first
    short = {"buckets": ["1", "2"], "plain": [0.0, 0.5], "spec": [0.5, 0.0]}
    long = {"buckets": ["1", "2", "3-4", "5-8"], "plain": [0.25, 0.0, 0.0, 2.0], "spec": [0.5, 0.25, 0.0, 0.0]}
    history = [record(0, rollout_time=1.0, rollout_by_batch=short), record(1, rollout_time=4.0, rollout_by_batch=long),
               old_record(2)]
    assert summary.batch_lines(history) == ["  rollout by batch size 5-8 40% | 2 15% (spec 5%) | 1 25% (spec 20%) "
                                            "(shares of the slowest rank's rollout time, summed over the run; "
                                            "spec: in speculative steps)"]
    assert summary.padded_sums([[1, 2], [3], []]) == [4, 2] and summary.padded_sums([]) == []
    assert summary.batch_lines([old_record(s) for s in range(3)]) == summary.spread_lines([old_record(0)]) == []


def test_the_picture_draws_the_median_and_the_longest_response_or_no_figure_for_older_records():
    lines = summary.picture([record(s, response_median=10 + s, response_max=50 + 2 * s) for s in range(20)], TASK)
    assert row(lines, "response median").endswith("10.5 -> 28.5, range 10.5..28.5 tokens")
    assert row(lines, "response max").endswith("51.0 -> 87.0, range 51.0..87.0 tokens")
    lines = summary.picture([old_record(s) for s in range(20)], TASK)
    assert row(lines, "response median") == f"  {'response median':16s}no figure"
    assert row(lines, "response max") == f"  {'response max':16s}no figure"


# -----------------------------------------------------------------------------
# python -m harness.report <run dir or metrics.jsonl>

def write_run(path, records):
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    return str(path)


def test_cli_draws_a_finished_run(tmp_path, capsys):
    run = write_run(tmp_path / "run", [record(s, accept_len=3.0 - 0.1 * s) for s in range(20)])
    for target in (run, os.path.join(run, "metrics.jsonl")):
        r = run_cli(target)
        assert r.returncode == 0, r.stderr
        out = r.stdout.splitlines()
        assert out[0] == "summary" and "  RL steps              20" in out
        assert "picture of the run: does the drafter hold as the target moves?" in out
        assert "2.95 -> 1.15" in row(out, "accept length")
        assert "wall time" not in r.stdout and "held-out" not in r.stdout  # not in the records
    report.main([run, "--bins", "5"])
    assert "in 5 bins of 4 step(s)" in capsys.readouterr().out


def test_cli_on_a_missing_directory_prints_one_error_line(tmp_path):
    r = run_cli(str(tmp_path / "nothing here"))
    assert r.returncode == 2 and r.stdout == ""
    assert len(r.stderr.splitlines()) == 1 and r.stderr.startswith("error:"), r.stderr


@pytest.mark.parametrize("content", ["", "\n\n", "{not json\n", "[1, 2]\n",
                                     json.dumps({"step": 0}) + "\n", None])
def test_cli_on_a_bad_metrics_file_prints_one_error_line(tmp_path, capsys, content):
    # in this process (main is what the CLI runs): the same checks, without starting a Python
    run = tmp_path / "run"
    os.makedirs(run)
    if content is not None:  # None: a directory without metrics.jsonl
        (run / "metrics.jsonl").write_text(content)
    with pytest.raises(SystemExit) as e:
        report.main([str(run)])
    out, err = capsys.readouterr()
    assert e.value.code == 2 and out == ""
    assert len(err.splitlines()) == 1 and err.startswith("error:"), err


def test_cli_rejects_bad_bins(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        report.main([write_run(tmp_path / "run", [record(0)]), "--bins", "0"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("error:") and len(err.splitlines()) == 1


def test_accept_length_at_k4_is_implied_by_the_acceptance_by_position():
    assert summary.accept_len_at([0.5, 0.5, 0.5, 0.5, 0.1]) == pytest.approx(1 + 0.5 + 0.25 + 0.125 + 0.0625)
    assert summary.accept_len_at([1.0, 1.0, 1.0, 1.0]) == 5.0
    assert summary.accept_len_at([0.9, 0.8, 0.7]) is None and summary.accept_len_at([0.9, None, 0.7, 0.5]) is None
    # the picture's line: first tenth at a1..a4 = 1.0, last tenth at 0.5
    history = [record(s, drafted_at=[10] * 4, accepted_at=[10 if s < 10 else 5] * 4) for s in range(100)]
    assert "at k = 4 these give 5.00 -> 1.94 tokens per verify step" in "\n".join(summary.picture(history, TASK))


def test_the_picture_shows_acceptance_by_problem_size_first_and_last():
    early = {"drafted_by_size": [10, 20, 0], "accepted_by_size": [10, 19, 0]}
    late = {"drafted_by_size": [10, 40, 30], "accepted_by_size": [9, 30, 15]}
    history = [record(s, **(early if s < 10 else late)) for s in range(100)]
    line = row(summary.picture(history, TASK), "accepted by size")
    assert line == "  accepted by size      1-2 100.0% -> 90.0% | 3-5 95.0% -> 75.0% | 6-10 - -> 50.0%"
    assert not any("accepted by size" in x for x in summary.picture([record(s) for s in range(20)], TASK))  # older


# -----------------------------------------------------------------------------
# python -m harness.report run-a run-b: two runs side by side; the SVG

SVG = "{http://www.w3.org/2000/svg}"


def svg_series(path):
    """{(run or a panel's own series, figure): number of points} of each series (a polyline) in an SVG file."""
    root = ET.parse(path).getroot()
    return {(pl.get("data-run") or pl.get("data-series"), pl.get("data-figure")): len(pl.get("points").split())
            for pl in root.iter(f"{SVG}polyline")}


def paired_runs(tmp_path, b_digest=lambda s: f"d{s}"):
    """Runs A and B of 20 steps: B's rollout takes 1.2 x A's at every step, B's step 1.5 x A's
    but 0.5 x on the last tenth (steps 18, 19); B's file is out of step order. b_digest: B's
    responses_digest at step s (A's is d<s>)."""
    a = [record(s, rollout_time=1.0 + 0.1 * s, step_time=2.0 + 0.1 * s, responses_digest=f"d{s}")
         for s in range(20)]
    b = [record(s, rollout_time=1.2 * (1.0 + 0.1 * s), step_time=(1.5 if s < 18 else 0.5) * (2.0 + 0.1 * s),
                responses_digest=b_digest(s)) for s in range(20)]
    return write_run(tmp_path / "fast", a), write_run(tmp_path / "slow", b[::-1])


def compared(capsys, *args):
    report.main(list(args))
    return capsys.readouterr().out.splitlines()


def test_runs_with_the_same_responses_are_paired_step_by_step(tmp_path, capsys):
    a, b = paired_runs(tmp_path)
    out = compared(capsys, a, b)
    assert out[1] == "comparison: A = fast, B = slow"
    assert "ratio X / A: run X's bin mean over run A's" in out[3]  # which way the ratio goes
    start = out.index("  rollout time, s: one scale for all runs, 1.050..3.420")  # bin means
    assert out[start + 1].startswith("    A fast        ") and out[start + 2].startswith("    B slow        ")
    assert out[start + 3] == "    B / A         " + " ".join([" 1.20"] * 10) + "  1.20 overall"
    assert "  paired: the runs wrote the same responses at all 20 steps (responses_digest);" in out
    assert out[-3:-1] == ["    B / A  rollout time  1.20 over all 20 steps, 1.20 over the last 2",
                          "    B / A  step time     1.50 over all 20 steps, 0.50 over the last 2"]
    assert out[-1] == f"svg picture: {os.path.join(a, 'compare.svg')} (open it in a browser)"
    assert max(len(ln) for ln in out[:-1]) <= 100


def test_runs_with_different_responses_are_compared_by_bins_only(tmp_path, capsys):
    a, b = paired_runs(tmp_path, b_digest=lambda s: "other" if s in (3, 7) else f"d{s}")
    out = compared(capsys, a, b, "--svg", "none")
    assert ("  not paired: the runs' responses differ at 2 of 20 steps (responses_digest, or none recorded),"
            in out)
    assert not any("paired: the runs wrote" in ln or "over all" in ln for ln in out)
    assert "    B / A         " + " ".join([" 1.20"] * 10) + "  1.20 overall" in out  # the bins still are
    # records written before the digest existed pair with nothing, not with each other
    runs = [[record(s) for s in range(20)]] * 2
    assert report.pairing_lines(runs)[0].startswith("  not paired: the runs' responses differ at 20 of 20")


def test_svg_holds_each_runs_series_with_a_point_per_bin_with_a_figure(tmp_path, capsys):
    # run A speculated from step 4 on: its accept length has no figure in the first 2 bins of 2 steps
    a = write_run(tmp_path / "A & <new>", [record(s, accept_len=None if s < 4 else 2.0) for s in range(20)])
    b = write_run(tmp_path / "B", [record(s, response_len=40.0 + s) for s in range(20)])
    svg_path = str(tmp_path / "pictures" / "c.svg")
    os.makedirs(os.path.dirname(svg_path))
    assert compared(capsys, a, b, "--svg", svg_path)[-1] == f"svg picture: {svg_path} (open it in a browser)"
    figures = ("response_len", "accept_len", "rollout_time", "step_time")
    expected = {(run, f): 8 if (run, f) == ("A & <new>", "accept_len") else 10
                for run in ("A & <new>", "B") for f in figures}
    assert svg_series(svg_path) == expected  # the run's name escaped, or the file would not parse
    texts = [t.text for t in ET.parse(svg_path).getroot().iter(f"{SVG}text")]
    assert {"A & <new>", "B", "accept length (tokens/verify)", "step time (s)", "0", "10"} <= set(texts)
    report.main([a, b, "--svg", svg_path, "--bins", "5"])
    assert set(svg_series(svg_path).values()) == {4, 5}


def test_a_single_run_prints_what_it_printed_then_the_svg_path(tmp_path):
    records = [record(s, accept_len=3.0 - 0.1 * s) for s in range(20)]
    run = write_run(tmp_path / "run", records)
    r = run_cli(run)
    assert r.returncode == 0, r.stderr
    text = (["summary"] + summary.record_lines(records, TASK) + [summary.skipped_line(records)]
            + summary.picture(records, TASK))
    svg_path = os.path.join(run, "report.svg")
    assert r.stdout.splitlines() == text + [f"svg picture: {svg_path} (open it in a browser)"]
    figures = ("response_len", "accept_len", "rollout_time", "step_time")
    assert svg_series(svg_path) == {**{("run", f): 10 for f in figures},
                                    **{(stat, "response_lengths"): 10 for stat in ("median", "p90", "max")}}
    os.remove(svg_path)
    r = run_cli(run, "--svg", "none")
    assert r.stdout.splitlines() == text and not os.path.exists(svg_path)


def test_a_single_runs_svg_draws_the_length_distribution_and_three_steps_timelines(tmp_path):
    timeline = [[["plain", 0.0, 0.5], ["spec", 0.5, 1.0], ["train", 1.0, 1.5]], [["plain", 0.0, 1.5]]]
    records = [record(s, response_lens=[s + 1] * 19 + [100], timeline=timeline if s % 5 == 0 or s == 19 else None)
               for s in range(20)]
    report.main([write_run(tmp_path / "run", records)])
    root = ET.parse(tmp_path / "run" / "report.svg").getroot()
    bars = [(r.get("data-step"), r.get("data-rank"), r.get("data-kind")) for r in root.iter(f"{SVG}rect")
            if r.get("data-kind")]
    # of the steps with a timeline (0, 5, 10, 15, 19): the first, the middle one and the last
    assert bars == [(str(step), str(rank), kind) for step in (0, 10, 19) for rank, segs in enumerate(timeline)
                    for kind, *_ in segs]
    assert [s for s, _ in report.timeline_steps(records[:5])] == [0] and report.timeline_steps(records[1:5]) == []
    lengths = [pl for pl in root.iter(f"{SVG}polyline") if pl.get("data-figure") == "response_lengths"]
    assert [(pl.get("data-series"), pl.get("data-run"), len(pl.get("points").split())) for pl in lengths] == [
        ("median", None, 10), ("p90", None, 10), ("max", None, 10)]  # the panel's own series, not runs
    # steps 0-1 pool 19 ones, 19 twos and two 100s; steps 18-19 19 nineteens, 19 twenties and two 100s
    assert report.length_series(records, [(0, 2), (18, 20)], ("median", "p90", "max")) == [
        [(0.5, 2), (18.5, 20)], [(0.5, 2), (18.5, 20)], [(0.5, 100), (18.5, 100)]]


def test_records_written_before_the_long_tail_still_load_and_draw(tmp_path, capsys):
    run = write_run(tmp_path / "old", [old_record(s) for s in range(20)])
    report.main([run])
    out = capsys.readouterr().out.splitlines()
    assert "  RL steps              20" in out
    new = ("  response lengths", "  longest / median", "  rank spread", "  rollout by batch")
    assert not any(ln.startswith(new) for ln in out)
    texts = [t.text for t in ET.parse(os.path.join(run, "report.svg")).getroot().iter(f"{SVG}text")]
    assert "no figure in any bin" in texts and any(t.startswith("no timeline in any record") for t in texts)


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
    assert not os.path.exists(os.path.join(a, "compare.svg"))


def test_a_binary_file_for_a_run_prints_one_error_line(tmp_path, capsys):
    a = write_run(tmp_path / "a", [record(s) for s in range(5)])
    (tmp_path / "ckpt.pt").write_bytes(b"PK\x03\x04\x80\xff" * 10)
    with pytest.raises(SystemExit) as e:
        report.main([a, str(tmp_path / "ckpt.pt")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err == f"error: {tmp_path / 'ckpt.pt'} is not a text file\n"


def test_an_unwritable_svg_path_prints_one_error_line(tmp_path):
    a = write_run(tmp_path / "a", [record(s) for s in range(5)])
    r = run_cli(a, a, "--svg", str(tmp_path / "no such dir" / "c.svg"))
    assert r.returncode == 2 and r.stdout == ""
    assert len(r.stderr.splitlines()) == 1 and r.stderr.startswith("error: cannot write the SVG"), r.stderr


def test_a_run_ends_naming_its_baseline_and_its_stale_drafter_twins():
    """The default run's last lines: the same RL with --tlt off and the report of both; then, from a
    drafter warmed up first, the same RL trained on idle ranks and frozen, and their report. A run
    that warmed its drafter up is itself the trained one; a run that does not train its drafter
    names nothing."""
    from harness import config
    lines = report.next_lines(config.parse_args(["--out-dir", "runs/a/", "--rl-steps", "300"]))
    head = "  torchrun --standalone --nproc_per_node=2 train.py --warmup-dir runs/a/ --rl-steps 300 --eval-per-bucket 0"
    assert lines[2] == head + " --out-dir runs/a-off --tlt off"  # no other flag was given
    assert lines[3].strip() == "python -m harness.report runs/a/ runs/a-off"
    assert lines[6] == head + " --drafter-warmup-steps 6000 --out-dir runs/a-warm"
    assert lines[7] == head + " --drafter-warmup-steps 6000 --out-dir runs/a-frozen --drafter-updates off"
    assert lines[8].strip() == "python -m harness.report runs/a-warm runs/a-frozen"
    warm = report.next_lines(config.parse_args(["--drafter-warmup-steps", "3000"]))
    assert len(warm) == 8 and "--drafter-warmup-steps 3000 --out-dir out-frozen" in warm[6]
    assert warm[7].strip() == "python -m harness.report out out-frozen"
    # every other flag the run was given, whole: the task and its settings are the workload
    given = ["--task", "shell_game", "--max-n=6", "--out-dir", "b", "--rl-steps", "50", "--eval-per-bucket", "3",
             "--tlt", "on"]
    lines = report.next_lines(config.parse_args(given), world_size=4)
    assert lines[2] == ("  torchrun --standalone --nproc_per_node=4 train.py --task shell_game --max-n=6 "
                        "--warmup-dir b --rl-steps 50 --eval-per-bucket 0 --out-dir b-off --tlt off")
    assert all(line.startswith("  torchrun --standalone --nproc_per_node=4 train.py --task shell_game --max-n=6 ")
               for line in lines[6:8])
    for flags in (["--tlt", "off"], ["--drafter-updates", "off"]):
        assert report.next_lines(config.parse_args(flags)) == []


def test_the_stale_drafter_line_and_bars():
    """The summary's `stale drafter` line: the three figures, the first two's change and the
    third's against the first; the picture's bars, a full bar k + 1; nothing without figures."""
    stale = {"step": 80, "k": 3, "figures": [3.0, 2.7, 3.6]}
    line = summary.stale_lines(stale)
    assert line[0].startswith("  stale drafter         3.00 -> 2.70 (-10.0%) -> 3.60 (+20.0%) tokens per verify step at k = 3")
    assert "step 80's drafter for step 80's target" in line[1]
    bars = summary.stale_bars(stale)
    assert len(bars) == 4 and "a full bar: 4" in bars[0]
    assert bars[1].endswith("| 3.00") and bars[3].count("█") == 36  # 3.6 of 4 tokens: 36 of 40 cells
    assert summary.stale_lines(None) == [] and summary.stale_bars(None) == []


def test_an_older_records_choice_share_and_a_run_without_its_task(tmp_path, capsys):
    """Records written before the choice share had a task-neutral name (`single_share`) still load;
    a run without task.json is reported without the lines in a task's words, none assumed."""
    recs = [{**{k: v for k, v in record(s).items() if k != "choice_share"}, "single_share": 0.5} for s in range(10)]
    run = write_run(tmp_path / "old", recs)
    report.main([run, "--svg", "none"])
    out = capsys.readouterr().out
    assert "  RL steps              10" in out and "response length" in out
    assert "single steps" not in out and "accepted by size" not in out
    with open(os.path.join(run, "task.json"), "w") as f:
        json.dump(RunningSum().meta(), f)
    report.main([run, "--svg", "none"])
    assert ", single steps 50% -> 50%" in capsys.readouterr().out
