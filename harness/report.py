"""What a run shows: the step's record and line, the timeline, the comparison of runs and the SVG.

train.py prints one line per RL step (`log_step`), every --timeline-every steps the ranks'
timeline (`render_timeline`, kept in that step's record too), and at the end the summary and its
picture (harness/summary.py). A step's record (`step_record`, one JSON line of metrics.jsonl)
holds its times and shares, the drafter's figures, every response's length, how far apart the
ranks finished their rollouts and where the slowest rank's rollout time went by running-batch size.

Everything here reads records only, so any finished run can be looked at again:

    python -m harness.report out              # a run's --out-dir, or the path of its metrics.jsonl
    python -m harness.report out --bins 5
    python -m harness.report out out-frozen   # two or more runs of the same steps, compared
    python -m harness.report out --svg none   # --svg PATH: where the SVG goes; none: no SVG

prints the summary lines that the records hold (not the held-out accuracies, not the wall time)
and the picture (harness/summary.py says what they show).

Two or more runs (A, B, ...) are compared over the same bins instead: per figure a sparkline per
run on one scale, then each later run's ratio to A per bin. Where the runs wrote the same
responses at every step (equal `responses_digest`), each step did the same work in both, so a
step's time ratio compares the methods free of the prompt mix that moves a step's time far more:
the report then pairs them step by step and prints the median of the per-step ratios.

Beside the text it writes an SVG file (harness/svg.py) that a browser opens: report.svg beside a
single run's metrics.jsonl (the binned curves, the response lengths' median, p90 and max per bin,
and a few steps' timelines rank by rank), compare.svg beside the first run's (the binned curves).

Test: python -m pytest tests/test_report.py
"""
import hashlib
import json
import os
import shlex
import statistics
import warnings

import tasks
from harness.common import OneLineParser
from harness.config import WARM_DRAFTER_STEPS
from harness.distributed import all_sum, gather_ranks, print0
from harness.instrument import checksum
from harness.summary import (PICTURE_ROWS, bin_edges, bin_means, binning, bucket_sizes, by_step,
                             length_distribution, picture, record_lines, seconds, skipped_line, sparkline)
from harness.svg import small_multiples

TIMELINE_CHARS = {"plain": "#", "spec": "S", "train": "t", "wait": "."}

# what the summary and the picture read from each record (the CLI checks them before it draws)
NEEDED = ("step", "step_time", "rollout_time", "update_time", "rollout_share", "slowest_wait",
          "tail_share", "reward", "accept_len", "accept_rate", "sd_token_frac", "drafter_top1",
          "drafted_at", "accepted_at", "bandit_best", "response_len", "choice_share",
          "skipped_update", "drafter_skipped")
# the SVG's panels, each a PICTURE_ROWS row by its key (or the rollout time's); a comparison's text
# draws all but the response length (its ratio is no cost), and pairs steps on the times
ROLLOUT_ROW = ("rollout_time", "rollout time", seconds, "s", "no figure")
FIGURE_ROWS = {r[0]: r for r in PICTURE_ROWS + (ROLLOUT_ROW,)}
SVG_FIGURES = ("response_len", "accept_len", "rollout_time", "step_time")
PAIRED = ("rollout_time", "step_time")
LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"  # the compared runs' names in the text


# -----------------------------------------------------------------------------
# the step's record

def step_record(s, step, result, stats):
    """The step's metrics.jsonl record, from this rank's part and every rank's (summed, gathered),
    and every rank's part (the timeline draws their segments). Built by train.run after the step,
    from what the step handed back. s: train.RunState; result: train.StepResult; stats: the
    instrument.RolloutStats that observed the step's rollout, made just before the step: the
    timeline's segments are on its clock."""
    problems, rows, idle, (agree, positions), update, times = result
    t_start, t_rollout, t_idle, t_update, t_end = times
    all_rewards, responses, (loss, clip, skipped) = update
    stats.finish(len(rows), end=t_rollout)
    stats.draft_time = s.rollout_drafter.lap() if s.rollout_drafter else 0.0
    idle_start, update_start = t_idle - stats.started, t_update - stats.started  # on stats' clock
    busy = idle["busy"]
    segments = stats.segments + ([["train", idle_start + busy[0], idle_start + busy[1]]] if busy else [])
    segments.append(["wait", segments[-1][2] if segments else idle_start, idle_start + idle["seconds"]])
    local = {"rank": s.rank, "rollout_time": stats.time, "draft_time": stats.draft_time,
             "idle_time": idle["seconds"], "drafter_steps": idle["steps"],
             "wait_to_update": update_start - stats.time, "drafter_skipped": idle["skipped"],
             "tokens": stats.tokens, "drafter_checksum": checksum(s.drafter), "rows": len(rows),
             "tail_share": stats.tail_share, "buffer_tokens": s.buffer.tokens, "segments": segments,
             "by_batch": stats.by_batch}
    counts = {"tokens": stats.tokens, "sd_tokens": stats.sd_tokens, "sd_row_steps": stats.sd_row_steps,
              "accepted": stats.accepted, "drafted": stats.drafted,
              "choice": sum(s.task.choice_share(p, r.response) for p, r in zip(problems, rows)),
              "correct": sum(s.task.correct(p, r.response) for p, r in zip(problems, rows)),
              "response_tokens": sum(len(r.response) for r in rows),
              **position_counts(stats, max(s.args.draft_ks)), **size_counts(stats, [p.size for p in problems], s.task)}
    # the top-1 counts were summed over ranks by the drafter sync (scheduler.start_drafter_sync)
    total = {**all_sum(counts, s.device), "top1_agree": agree, "top1_positions": positions}
    rec, ranks = rank_record(step, local, total, all_rewards, responses, t_end - t_start,
                             t_end - t_update, timeline=timeline_due(step, s.args))
    rec.update(loss=loss, clip_frac=clip, skipped_update=skipped, drafter_lr=idle["lr"],
               drafter_depth=idle["depth"], recent_top1=idle["recent_top1"],
               bandit_best=(best := best_arms(s.bandit)), bandit_tokens=arm_tokens(s.bandit, best))
    return rec, ranks


def rank_record(step, local, total, all_rewards, responses, step_time, update_time, timeline=False):
    """The record from this rank's `local` part and the sums over ranks, and every rank's part.
    responses: every response's token ids in global row order; timeline: whether the record keeps
    every rank's timeline segments (they are long: only on the steps whose timeline is printed)."""
    ranks = gather_ranks(local)
    if len({r["drafter_checksum"] for r in ranks}) > 1:
        warnings.warn(f"step {step}: the ranks' drafters differ after the sync ({[r['drafter_checksum'] for r in ranks]})")
    slowest = max(ranks, key=lambda r: r["rollout_time"])
    rollout_max, n_rows = slowest["rollout_time"], all_rewards.numel()
    lens, by_batch = [len(r) for r in responses], slowest["by_batch"]
    # one hash of every response of the step in global row order: two runs, on any numbers of ranks,
    # can be compared token for token
    digest = hashlib.sha256(json.dumps(responses).encode()).hexdigest()[:16]
    return {
        "step": step, "step_time": step_time, "rollout_time": rollout_max, "update_time": update_time,
        "tail_share": slowest["tail_share"], "rollout_share": rollout_max / step_time, "responses_digest": digest,
        "draft_time": slowest["draft_time"],  # of the slowest rank's rollout, in the drafter
        # what stood between the slowest rank's rollout and its update: rewards, the barrier, a drafter
        # step still in flight on another rank (idle training is free only if this stays near 0)
        "slowest_wait": slowest["wait_to_update"],
        "reward": float(all_rewards.mean()), "accuracy": total["correct"] / n_rows,  # mean reward; share right
        "accept_len": total["sd_tokens"] / total["sd_row_steps"] if total["sd_row_steps"] else None,
        "accept_rate": total["accepted"] / total["drafted"] if total["drafted"] else None,
        "drafter_top1": total["top1_agree"] / total["top1_positions"] if total["top1_positions"] else None,
        # per draft position: drafts decided there (the earlier ones accepted) and accepted
        "drafted_at": [int(v) for k, v in total.items() if k.startswith("drafted_at")],
        "accepted_at": [int(v) for k, v in total.items() if k.startswith("accepted_at")],
        # the speculative steps that drafted k tokens a row, k = 0 .. max k (0: none), all ranks
        "sd_steps_by_k": [int(v) for k, v in total.items() if k.startswith("steps_k")],
        # per problem-size bucket (the task's, up to max_n): drafts decided and accepted
        "drafted_by_size": [int(v) for k, v in total.items() if k.startswith("drafted_size")],
        "accepted_by_size": [int(v) for k, v in total.items() if k.startswith("accepted_size")],
        # scored on idle time; the slowest rank's rows on its next idle turn, so they count a step late
        "drafter_top1_positions": int(total["top1_positions"]),
        # what the target writes: mean response length and the share of the task's choice
        # (Task.choice_share) among its choices
        "response_len": total["response_tokens"] / n_rows, "choice_share": total["choice"] / n_rows,
        # its long tail: every response's length (global row order), the step's median and longest
        "response_lens": lens, "response_median": statistics.median(lens), "response_max": max(lens),
        # how much earlier the fastest rank finished its rollout than the slowest: the idle time to train on
        "rank_spread": 1 - min(r["rollout_time"] for r in ranks) / rollout_max if rollout_max > 0 else 0.0,
        # the slowest rank's rollout seconds by running-batch size (the bandit's buckets), plain and speculative
        "rollout_by_batch": {"buckets": [bucket_sizes(i) for i in range(len(by_batch["plain"]))], **by_batch},
        # every rank's [kind, start, end] segments to 0.1 ms, kept on the steps whose timeline is printed
        "timeline": [[[kind, round(a, 4), round(b, 4)] for kind, a, b in r["segments"]] for r in ranks]
        if timeline else None,
        "sd_token_frac": total["sd_tokens"] / max(total["tokens"], 1), "tok_s": total["tokens"] / max(rollout_max, 1e-9),
        "idle_time": max(r["idle_time"] for r in ranks), "drafter_steps": sum(r["drafter_steps"] for r in ranks),
        "drafter_skipped": sum(r["drafter_skipped"] for r in ranks), "drafter_checksum": local["drafter_checksum"],
        "ranks": [{k: v for k, v in r.items() if k not in ("segments", "by_batch")} for r in ranks],
    }, ranks


# -----------------------------------------------------------------------------
# acceptance by draft position, summed over ranks and over steps; the bandit's choices

def position_counts(stats, k_max):
    """A rollout's drafts decided and accepted at each draft position 1..k_max, and its speculative
    steps by k, as {name: count} (distributed.all_sum's form; instrument.DecodeStats has the
    meaning)."""
    pad = lambda v, n=k_max: v + [0] * (n - len(v))  # noqa: E731
    return {**{f"drafted_at{i}": v for i, v in enumerate(pad(stats.drafted_at))},
            **{f"accepted_at{i}": v for i, v in enumerate(pad(stats.accepted_at))},
            **{f"steps_k{k}": v for k, v in enumerate(pad(stats.steps_by_k, k_max + 1))}}


def size_counts(stats, sizes, task):
    """A rollout's drafts decided and accepted by the task's problem-size bucket, as {name: count};
    sizes: each row's problem size."""
    out = {}
    for i, (lo, hi) in enumerate(task.buckets()):
        rows = [v for row, v in stats.by_row.items() if lo <= sizes[row] <= hi]
        out[f"drafted_size{i}"] = sum(v[0] for v in rows)
        out[f"accepted_size{i}"] = sum(v[1] for v in rows)
    return out


def best_arms(bandit):
    """{bucket: best arm} over a rollout.Bandit's scored arms, for the log."""
    scored = sorted({b for (b, a) in bandit.plays if bandit.score(b, a) is not None})
    return {b: max((a for a in bandit.arms if bandit.score(b, a) is not None),
                   key=lambda a: bandit.score(b, a)) for b in scored}


def arm_tokens(bandit, best):
    """{bucket: tokens a step} of each bucket's best arm (`best`, from best_arms) over its recent
    steps, for the summary: the rollout's own figure of what a draft length buys there (at batch 1
    the last row is often near its end, and drafts past its <|eos|> buy nothing)."""
    return {b: statistics.mean(n for n, _ in bandit.plays[(b, k)]) for b, k in best.items()}


# -----------------------------------------------------------------------------
# the step line and the ranks' timeline

def render_timeline(records, width=64):
    """One text row per rank: '#' plain decoding, 'S' speculative, 't' drafter training,
    '.' waiting."""
    total = max((seg[2] for r in records for seg in r["segments"]), default=0.0) or 1.0
    lines = []
    for r in records:
        row = [" "] * width
        for kind, a, b in r["segments"]:
            lo = int(a / total * width)
            hi = max(lo + 1, int(round(b / total * width)))
            for i in range(lo, min(hi, width)):
                row[i] = TIMELINE_CHARS[kind]
        lines.append(f"rank {r['rank']:2d} |{''.join(row)}| {r['rollout_time']:.2f}s rollout, "
                     f"{r['idle_time']:.2f}s idle, {r['drafter_steps']} drafter steps")
    legend = "  ".join(f"{c} {k}" for k, c in TIMELINE_CHARS.items())
    return "\n".join(lines + [f"        {legend}   (full width = {total:.2f}s)"])


def plan_line(args, world_size):
    """The line before the first RL step: the step's shape and what TLT does in this run."""
    n_rows = args.prompts_per_step * args.group_size
    per_rank = f"{n_rows // world_size}{'+' if n_rows % world_size else ''}"
    updates = "on" if args.drafter_updates and args.tlt else "off"
    return (f"RL: {args.rl_steps} steps x {args.prompts_per_step} prompts x {args.group_size} samples on "
            f"{world_size} rank(s) ({per_rank} rows each) | tlt {'on' if args.tlt else 'off'} | drafter "
            f"updates {updates} | sd threshold {args.sd_threshold}")


def next_lines(args, world_size=2):
    """The run's last lines: the commands that show what TLT buys, each pair from the same warm-ups.
    The same RL with --tlt off writes the same responses at every step, so the report pairs the two
    runs step by step: the headline. Whether a drafter goes stale needs one that was good when RL
    began: a drafter warmed up first (--drafter-warmup-steps), trained on idle ranks against frozen
    (a run that warmed its drafter up is itself the first of the two). The commands are whole: they
    carry every other flag this run was given (--task and its settings included), so that pasting
    them trains on the same workload."""
    if not (args.tlt and args.drafter_updates):
        return []
    out = args.out_dir.rstrip("/")
    given = "".join(f" {shlex.quote(a)}" for a in other_flags(args.argv, RESET_FLAGS))
    run = (f"  torchrun --standalone --nproc_per_node={world_size} train.py{given} --warmup-dir {args.warmup_dir} "
           f"--rl-steps {args.rl_steps} --eval-per-bucket 0")
    lines = ["", "what TLT buys: the same RL without it, the same tokens at every step, side by side:",
             f"{run} --out-dir {out}-off --tlt off", f"  python -m harness.report {args.out_dir} {out}-off",
             "", "whether a drafter goes stale: one warmed up before RL, trained on idle ranks and frozen, side by side:"]
    warm = args.drafter_warmup_steps or WARM_DRAFTER_STEPS
    if args.drafter_warmup_steps:
        adaptive = args.out_dir
    else:
        adaptive = f"{out}-warm"
        lines.append(f"{run} --drafter-warmup-steps {warm} --out-dir {adaptive}")
    return lines + [f"{run} --drafter-warmup-steps {warm} --out-dir {out}-frozen --drafter-updates off",
                    f"  python -m harness.report {adaptive} {out}-frozen"]


# the flags next_lines sets itself
RESET_FLAGS = ("--out-dir", "--warmup-dir", "--rl-steps", "--eval-per-bucket", "--drafter-updates", "--tlt",
               "--drafter-warmup-steps")


def other_flags(argv, drop):
    """The command line `argv` without the flags in `drop` and their values ("--flag value" or
    "--flag=value")."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in drop:
            skip = True
        elif a.split("=", 1)[0] not in drop:
            out.append(a)
    return out


def log_step(rec, ranks, args):
    """Rank 0's line for the step, and every --timeline-every steps the ranks' timeline."""
    # n/a: no rank had time to score
    top1 = "n/a" if rec["drafter_top1"] is None else f"{100 * rec['drafter_top1']:.1f}%"
    print0(f"step {rec['step']:04d}/{args.rl_steps} | reward {rec['reward']:.3f} | "
           f"step {rec['step_time']:.2f}s | rollout {rec['rollout_time']:.2f}s "
           f"({100 * rec['rollout_share']:.0f}%, tail {100 * rec['tail_share']:.0f}%) | "
           f"tok/s {rec['tok_s']:,.0f} | accept {rec['accept_len'] or 0:.2f} "
           f"({100 * (rec['accept_rate'] or 0):.0f}% of drafts) | "
           f"sd tok {100 * rec['sd_token_frac']:.0f}% | drafter top-1 {top1} | "
           f"idle {rec['idle_time']:.2f}s | drafter steps {rec['drafter_steps']}"
           + (f" ({rec['drafter_skipped']} non-finite, skipped)" if rec["drafter_skipped"] else "")
           + (" | SKIPPED non-finite update" if rec["skipped_update"] else ""))
    if timeline_due(rec["step"], args):
        print0(render_timeline(ranks))


def timeline_due(step, args):
    """Whether a step's timeline is printed (and kept in its record): every --timeline-every steps
    and the last."""
    return bool(args.timeline_every) and (step % args.timeline_every == 0 or step == args.rl_steps - 1)


# -----------------------------------------------------------------------------
# two or more runs of the same steps: the same bins side by side, step by step where they are paired

def compare(runs, names, bins=10):
    """Runs (each its records, all of the same steps) drawn in text lines: per figure a sparkline
    per run on one scale over the same bins, each later run's ratio to run A per bin; then whether
    the runs are paired, and if so the medians of their per-step ratios."""
    runs = [by_step(run) for run in runs]
    edges = bin_edges(len(runs[0]), bins)
    lines = ["", "comparison: " + ", ".join(f"{c} = {name}" for c, name in zip(LETTERS, names)),
             f"  {binning(runs[0], edges)}; each run's row: first bin -> last bin",
             "  ratio X / A: run X's bin mean over run A's (above 1: X's is the larger; "
             "for a time, X is slower)"]
    for key in SVG_FIGURES[1:]:
        lines += compare_rows(runs, names, FIGURE_ROWS[key], edges)
    return lines + pairing_lines(runs)


def compare_rows(runs, names, row, edges):
    """One figure's rows: a sparkline per run, all on one scale so that their heights compare, then
    the later runs' ratios to run A per bin (in columns under the bins) and over the whole run."""
    key, label, fmt, unit, empty = row
    means = [bin_means(run, key, edges) for run in runs]
    known = [m for run_means in means for m in run_means if m is not None]
    if not known:
        return [f"  {label:16s}{empty}"]
    scale = (min(known), max(known))
    lines = [f"  {label}, {unit}: one scale for all runs, {fmt(scale[0])}..{fmt(scale[1])}"]
    for c, name, run_means in zip(LETTERS, names, means):
        ends = [m for m in run_means if m is not None]
        trend = f"  {fmt(ends[0])} -> {fmt(ends[-1])}" if ends else ""
        lines.append(f"    {c + ' ' + name:14.14s}{sparkline(run_means, cell=5, scale=scale)}{trend}")
    whole_a = bin_means(runs[0], key, [0, len(runs[0])])[0]
    for c, run, run_means in zip(LETTERS[1:], runs[1:], means[1:]):
        ratios = [b / a if a and b is not None else None for a, b in zip(means[0], run_means)]
        whole = bin_means(run, key, [0, len(run)])[0]
        overall = f"  {whole / whole_a:.2f} overall" if whole_a and whole is not None else ""
        lines.append(f"    {c + ' / A':14s}" + " ".join("  -  " if r is None else f"{r:5.2f}" for r in ratios)
                     + overall)
    return lines


def pairing_lines(runs):
    """Whether every run wrote run A's responses at every step (`responses_digest`) and, if so, the
    median of each later run's per-step time ratios to A, over the run and over its last tenth
    (a median: one step slowed by a shared machine moves it little)."""
    n, k = len(runs[0]), max(1, len(runs[0]) // 10)
    differ = sum(not same_responses(step) for step in zip(*runs))
    if differ:
        return [f"  not paired: the runs' responses differ at {differ} of {n} steps (responses_digest, "
                "or none recorded),",
                "  so their steps are not alike: the runs are compared by bins only"]
    lines = [f"  paired: the runs wrote the same responses at all {n} steps (responses_digest);",
             "  median of the per-step ratios to A (above 1: slower than A)"]
    for c, run in zip(LETTERS[1:], runs[1:]):
        for key in PAIRED:
            ratios = [b[key] / a[key] for a, b in zip(runs[0], run)]
            lines.append(f"    {c} / A  {FIGURE_ROWS[key][1]:13s}{statistics.median(ratios):5.2f} over all "
                         f"{n} steps, {statistics.median(ratios[-k:]):.2f} over the last {k}")
    return lines


def same_responses(records):
    """Whether the runs' records of one step hold one responses digest (a record written before
    the digest existed holds none: it pairs with nothing)."""
    digests = {r.get("responses_digest") for r in records}
    return len(digests) == 1 and None not in digests


def svg_picture(runs, names, bins=10):
    """The SVG of the runs' SVG_FIGURES over the same bins (each point at its bin's middle step); of
    a single run also its response lengths' median, p90 and max per bin, and a few steps' timelines."""
    runs = [by_step(run) for run in runs]
    edges = bin_edges(len(runs[0]), bins)
    spans = list(zip(edges, edges[1:]))
    panels = []
    for key in SVG_FIGURES:
        _, label, _, unit, _ = FIGURE_ROWS[key]
        series = [[(x, m) for x, m in zip(middles(run, spans), bin_means(run, key, edges)) if m is not None]
                  for run in runs]
        panels.append((key, f"{label} ({unit})", series, None))
    title = f"{' vs '.join(names)}: means of {binning(runs[0], edges)}"
    if len(runs) > 1:
        return small_multiples(title, names, panels)
    stats = ("median", "p90", "max")
    panels.append(("response_lengths", "response lengths (tokens)", length_series(runs[0], spans, stats), stats))
    return small_multiples(title, names, panels, timeline=timeline_steps(runs[0]))


def length_series(history, spans, stats):
    """The series of each of `stats` (length_distribution's) of the response lengths pooled over each
    bin, at the bin's middle step; bins of records written before the lengths were draw no point."""
    series = [[] for _ in stats]
    for x, (lo, hi) in zip(middles(history, spans), spans):
        lens = [n for h in history[lo:hi] for n in h.get("response_lens", ())]
        if lens:
            d = length_distribution(lens)
            for points, stat in zip(series, stats):
                points.append((x, d[stat]))
    return series


def middles(history, spans):
    """Each bin's middle step: where its point is drawn."""
    return [(history[lo]["step"] + history[hi - 1]["step"]) / 2 for lo, hi in spans]


def timeline_steps(history, most=3):
    """Up to `most` steps whose records hold the ranks' timeline, the first, the last and between
    them evenly -> [(step, [each rank's segments])]."""
    held = [h for h in history if h.get("timeline")]
    picks = sorted({i * (len(held) - 1) // max(most - 1, 1) for i in range(most)}) if held else []
    return [(held[i]["step"], held[i]["timeline"]) for i in picks]


# -----------------------------------------------------------------------------
# python -m harness.report <run dir or metrics.jsonl> [more runs, compared]

def load_records(path):
    """A run directory's or a file's metrics.jsonl -> (records, None), or (None, what is wrong,
    in one line)."""
    if os.path.isdir(path):
        path = os.path.join(path, "metrics.jsonl")
    if not os.path.isfile(path):
        return None, f"no such file: {path}"
    try:
        with open(path) as f:
            lines = f.readlines()
    except UnicodeDecodeError:  # a checkpoint given for a metrics file, say
        return None, f"{path} is not a text file"
    records = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            return None, f"{path} line {i} is not JSON ({e.msg})"
        if not isinstance(rec, dict):
            return None, f"{path} line {i} is not a JSON object"
        if "single_share" in rec:  # the choice share's name in records written before it had one
            rec.setdefault("choice_share", rec.pop("single_share"))
        missing = [k for k in NEEDED if k not in rec]
        if missing:
            return None, f"{path} line {i} lacks {', '.join(missing)}"
        records.append(rec)
    return (records, None) if records else (None, f"{path} holds no records")


def run_folder(path):
    """The folder of a run given as its directory or as its metrics.jsonl."""
    return path if os.path.isdir(path) else os.path.dirname(path)


def run_names(paths):
    """The runs' names for the comparison and the legend: their folders' names, or, where two share
    one (a/out, b/out), the paths."""
    names = [os.path.basename(os.path.abspath(run_folder(p))) for p in paths]
    return names if len(set(names)) == len(names) else [os.path.normpath(run_folder(p)) for p in paths]


def load_runs(paths, names):
    """Each path's records -> (runs, None), or (None, what is wrong, in one line): a path's
    load_records problem, or runs of different steps (there is nothing to put side by side)."""
    runs = []
    for path in paths:
        records, problem = load_records(path)
        if problem:
            return None, problem
        runs.append(records)
    steps = [sorted(h["step"] for h in run) for run in runs]
    if any(s != steps[0] for s in steps):
        held = "; ".join(f"{name} has {len(s)} steps, {s[0]}..{s[-1]}" for name, s in zip(names, steps))
        return None, f"the runs are of different steps ({held}): compare runs of the same steps"
    return runs, None


def run_task(path):
    """The task a run trained on, from the task.json that train.py writes beside metrics.jsonl; None
    for a run without one (the summary then leaves out the lines in the task's words)."""
    try:
        with open(os.path.join(run_folder(path), "task.json")) as f:
            return tasks.from_meta(json.load(f))
    except FileNotFoundError:
        return None


def main(argv=None):
    p = OneLineParser(description="The summary and the picture of a run, from its metrics.jsonl; "
                                  "two or more runs: compared.")
    p.add_argument("paths", nargs="+", metavar="path",
                   help="a run's --out-dir, or the path of its metrics.jsonl; two or more runs: compared")
    p.add_argument("--bins", type=int, default=10,
                   help="at most this many bins of consecutive steps in the picture")
    p.add_argument("--svg", help="where to write the SVG picture (default: report.svg, or compare.svg for "
                                 "several runs, beside the first run's metrics.jsonl); none: no SVG")
    args = p.parse_args(argv)
    if args.bins < 1:
        p.error(f"--bins must be at least 1, got {args.bins}")
    if len(args.paths) > len(LETTERS):
        p.error(f"at most {len(LETTERS)} runs, got {len(args.paths)}")
    names = run_names(args.paths)
    runs, problem = load_runs(args.paths, names)
    if problem:
        p.exit(2, f"error: {problem}\n")
    if len(runs) == 1:
        records, task = runs[0], run_task(args.paths[0])
        lines = (["summary"] + record_lines(records, task) + [skipped_line(records)]
                 + picture(records, task, args.bins))
    else:
        lines = compare(runs, names, args.bins)
    if args.svg != "none":
        default = "compare.svg" if len(runs) > 1 else "report.svg"
        path = args.svg or os.path.join(run_folder(args.paths[0]), default)
        try:  # before the text is printed: bad input prints one error line and nothing else
            with open(path, "w") as f:
                f.write(svg_picture(runs, names, args.bins))
        except OSError as e:
            p.exit(2, f"error: cannot write the SVG to {path}: {e.strerror}\n")
        lines.append(f"svg picture: {path} (open it in a browser)")
    for line in lines:
        print0(line)


if __name__ == "__main__":
    main()
