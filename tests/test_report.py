"""report.py on hand-made metrics.jsonl records: the step line, the timeline and the summary keep
the text train.py prints; the picture shows a run's trends, the acceptance by position from
summed counts, and says so when a run never speculated; the CLI reads a run directory and fails
with one error line; two runs are compared by bins, and step by step where they wrote the same
responses; the SVG holds each run's series. No model runs; the CLI's processes take most of its time."""
import json
import os
import subprocess
import sys
import types
import xml.etree.ElementTree as ET

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
from harness import report  # noqa: E402
from tasks.running_sum import RunningSum  # noqa: E402

TASK = RunningSum()

SEGMENTS = [{"rank": 0, "rollout_time": 1.0, "idle_time": 0.2, "drafter_steps": 3,
             "segments": [["plain", 0, 0.5], ["spec", 0.5, 1.0], ["train", 1.0, 1.2]]},
            {"rank": 1, "rollout_time": 1.2, "idle_time": 0.0, "drafter_steps": 0,
             "segments": [["plain", 0, 0.9], ["spec", 0.9, 1.2]]}]


def record(step, **over):
    """A metrics.jsonl record as train.py writes it (the keys report.py reads), with `over` set."""
    rec = {"step": step, "step_time": 2.0, "rollout_time": 1.7, "update_time": 0.3,
           "rollout_share": 0.85, "tail_share": 0.4, "slowest_wait": 0.002, "reward": 0.5,
           "accept_len": 2.5, "accept_rate": 0.6, "sd_token_frac": 0.3, "drafter_top1": 0.7,
           "drafted_at": [10, 6], "accepted_at": [8, 3], "bandit_best": {"0": 4, "2": 0},
           "response_len": 40.0, "single_share": 0.0, "skipped_update": False,
           "drafter_skipped": 0, "tok_s": 1234.5, "idle_time": 0.25, "drafter_steps": 7,
           "ranks": [{"rank": 0, "rollout_time": 1.7, "idle_time": 0.0, "drafter_steps": 7,
                      "tokens": 100, "drafter_checksum": "abc"}]}
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
    assert report.format_positions([0.5, None, 1.0, 0.123]) == "50.0   -   100.0 12.3"
    stats = types.SimpleNamespace(drafted_at=[5, 3], accepted_at=[4, 1])
    assert report.position_counts(stats, 3) == {
        "drafted_at0": 5, "drafted_at1": 3, "drafted_at2": 0,
        "accepted_at0": 4, "accepted_at1": 1, "accepted_at2": 0}


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
  drafter top-1         70.0% -> 80.0% (teacher-forced agreement with the target on each step's fresh rows, before training on them; first and last 1 steps)
  mean accept length    2.50 tokens per verify step, 60% of drafted tokens accepted, SD token share 30%
  accepted by position  80.0 50.0 % (draft 1..2, given the earlier ones were; 48 drafts decided)
  bandit's k per batch  1: 4, 3-4: 0 (rank 0, after step 0)
  bandit's k per batch  1: 4, 3-4: 0 (rank 0, end of run)
  reward                0.000 -> 0.200 (means of the first and the last 1 steps)
  response length       40.0 -> 42.0 tokens, single steps 0% -> 10% (first and last 1 steps)
  greedy  before RL     overall  50.0% | 1-2  75.0%
  greedy  after RL      overall  50.0% | 1-2  75.0%
  sampled before RL     overall  25.0% | 1-2  50.0%
  sampled after RL      overall  25.0% | 1-2  50.0%
  length  before RL     overall  12.0 | 1-2   8.5 tokens (sampled)
  length  after RL      overall  12.0 | 1-2   8.5 tokens (sampled)
  skipped updates       0 of the target, 3 drafter steps (non-finite loss or gradient)
  wall time             61s
"""  # noqa: E501


def test_summary_keeps_its_lines_then_draws_the_picture(capsys):
    history = [record(s, reward=0.1 * s, response_len=40.0 + s, single_share=0.05 * s,
                      drafter_skipped=s, drafter_top1=None if s == 0 else 0.6 + 0.1 * s)
               for s in range(3)]
    acc = {"greedy": {"overall": 0.5, "1-2": 0.75}, "sampled": {"overall": 0.25, "1-2": 0.5},
           "length": {"overall": 12.0, "1-2": 8.5}}
    report.summary(history, acc, acc, 61.2, TASK)
    out = capsys.readouterr().out
    assert out.startswith(SUMMARY)
    assert out[len(SUMMARY):].splitlines() == report.picture(history, TASK)
    report.summary(history, {}, {}, 61.2, TASK)
    out = capsys.readouterr().out
    assert "  held-out accuracy     not evaluated (--eval-per-bucket 0)\n" in out


# -----------------------------------------------------------------------------
# the picture

def test_picture_shows_the_accept_length_trend():
    # 20 steps in 10 bins of 2: accept length falls 3.0 -> 1.1, the step time rises 1.0 -> 2.9
    history = [record(s, accept_len=3.0 - 0.1 * s, step_time=1.0 + 0.1 * s) for s in range(20)]
    lines = report.picture(history, TASK)
    accept, step_time = row(lines, "accept length"), row(lines, "step time")
    assert "2.95 -> 1.15, range 1.15..2.95 tokens/verify" in accept
    assert cells(accept) == list("█▇▆▆▅▄▃▃▂▁")  # from the maximum down to the minimum
    assert cells(step_time) == list("▁▂▃▃▄▅▆▆▇█")
    assert "1.050 -> 2.850" in step_time
    assert row(lines, "response length").endswith("40.0 -> 40.0, range 40.0..40.0 tokens")
    # records out of order draw the same picture: bins are of consecutive steps
    assert report.picture(history[::-1], TASK) == lines


def test_picture_bins_fewer_steps_and_leaves_bins_without_speculation_blank():
    history = [record(s, accept_len=None if s < 2 else 2.0 + s) for s in range(4)]
    lines = report.picture(history, TASK, bins=10)
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
    lines = report.picture(history, TASK)
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
    lines = report.picture(history, TASK)
    assert row(lines, "accept length") == f"  {'accept length':16s}{report.NO_SD}"
    assert "no speculative steps" in report.NO_SD
    assert row(lines, "drafter top-1").endswith("not scored in any step")
    assert lines[-1] == "  accepted by position  no drafts decided in the first or the last 1 step"
    assert cells(row(lines, "step time")) == ["▅"] * 10  # the other rows are drawn (flat)


def test_picture_fits_a_100_column_terminal():
    history = [record(10_000 + s, step_time=1234.567 * (1 + s), response_len=12_345.6 - s,
                      accept_len=8.99, drafted_at=[1_000_000] * 8, accepted_at=[999_999] * 8)
               for s in range(100)]
    lines = report.picture(history, TASK)
    assert max(len(ln) for ln in lines) <= 100
    assert len([ln for ln in lines if "|" in ln]) == 16  # 8 positions, first and last tenth


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
    assert report.accept_len_at([0.5, 0.5, 0.5, 0.5, 0.1]) == pytest.approx(1 + 0.5 + 0.25 + 0.125 + 0.0625)
    assert report.accept_len_at([1.0, 1.0, 1.0, 1.0]) == 5.0
    assert report.accept_len_at([0.9, 0.8, 0.7]) is None and report.accept_len_at([0.9, None, 0.7, 0.5]) is None
    # the picture's line: first tenth at a1..a4 = 1.0, last tenth at 0.5
    history = [record(s, drafted_at=[10] * 4, accepted_at=[10 if s < 10 else 5] * 4) for s in range(100)]
    assert "at k = 4 these give 5.00 -> 1.94 tokens per verify step" in "\n".join(report.picture(history, TASK))


def test_the_picture_shows_acceptance_by_problem_size_first_and_last():
    early = {"drafted_by_size": [10, 20, 0], "accepted_by_size": [10, 19, 0]}
    late = {"drafted_by_size": [10, 40, 30], "accepted_by_size": [9, 30, 15]}
    history = [record(s, **(early if s < 10 else late)) for s in range(100)]
    line = row(report.picture(history, TASK), "accepted by size")
    assert line == "  accepted by size      1-2 100.0% -> 90.0% | 3-5 95.0% -> 75.0% | 6-10 - -> 50.0%"
    assert not any("accepted by size" in x for x in report.picture([record(s) for s in range(20)], TASK))  # older records


# -----------------------------------------------------------------------------
# python -m harness.report run-a run-b: two runs side by side; the SVG

SVG = "{http://www.w3.org/2000/svg}"


def svg_series(path):
    """{(run, figure): number of points} of each series (a polyline) in an SVG file."""
    root = ET.parse(path).getroot()
    return {(pl.get("data-run"), pl.get("data-figure")): len(pl.get("points").split())
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
    text = (["summary"] + report.record_lines(records, TASK) + [report.skipped_line(records)]
            + report.picture(records, TASK))
    svg_path = os.path.join(run, "report.svg")
    assert r.stdout.splitlines() == text + [f"svg picture: {svg_path} (open it in a browser)"]
    assert svg_series(svg_path) == {("run", f): 10
                                    for f in ("response_len", "accept_len", "rollout_time", "step_time")}
    os.remove(svg_path)
    r = run_cli(run, "--svg", "none")
    assert r.stdout.splitlines() == text and not os.path.exists(svg_path)


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


def test_a_run_ends_naming_its_frozen_twin_and_the_comparison():
    """The default run's last lines: this run resumed to 600 steps, the same with a frozen drafter
    from the same warm-ups, then the report of both; a run that does not train its drafter has no
    such twin, and one of 600 steps or more needs no resuming."""
    from harness import config
    lines = report.next_lines(config.parse_args(["--out-dir", "runs/a/"]))
    assert "--warmup-dir runs/a/ --rl-steps 600 --out-dir runs/a/ --eval-per-bucket 0" in lines[2]
    assert "--rl-steps 600 --out-dir runs/a-frozen --drafter-updates off" in lines[3]
    assert lines[4].strip() == "python -m harness.report runs/a/ runs/a-frozen"
    longer = report.next_lines(config.parse_args(["--rl-steps", "800"]))
    assert len(longer) == 4 and "--rl-steps 800 --out-dir out-frozen" in longer[2]
    for flags in (["--tlt", "off"], ["--drafter-updates", "off"]):
        assert report.next_lines(config.parse_args(flags)) == []
