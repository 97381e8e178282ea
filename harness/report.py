"""python -m harness.report RUN [RUN ...], and step 7 of the run: the step's record (a line of
metrics.jsonl), its log line, the ranks' timeline every --timeline-every steps, and the summary.

    python -m harness.report out              # a run's --out-dir, or the path of its metrics.jsonl
    python -m harness.report out out-off      # two or more runs of the same steps, compared

The summary gives the first tenth of the run against the last (a step's figures swing with its
prompt mix), and compares runs the same way. Where runs wrote the same responses at every step
(`responses_digest`), it also prints the median of the per-step time ratios.

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
from harness.evaluate import format_accuracy, format_lengths
from harness.instrument import checksum
from harness.warmup import expected_accepted

TIMELINE_CHARS = {"plain": "#", "spec": "S", "train": "t", "wait": "."}
LETTERS = "ABCDEFGHIJKLMNOPQRSTUVWXYZ"  # the compared runs' names

# what the summary reads from each record (the CLI checks them before it reads on)
NEEDED = ("step", "step_time", "rollout_time", "update_time", "rollout_share", "slowest_wait",
          "tail_share", "reward", "accept_len", "accept_rate", "sd_token_frac", "drafted_at",
          "drafter_acceptance", "accepted_at", "bandit_best", "response_len", "choice_share",
          "skipped_update", "drafter_skipped", "drafter_steps", "ranks", "rank_spread",
          "rollout_by_batch", "response_lens")


# -----------------------------------------------------------------------------
# the step's record

def step_record(s, step, result, stats):
    """The step's metrics.jsonl record, and every rank's part (the timeline draws their segments).
    s: train.RunState; result: train.StepResult; stats: the instrument.RolloutStats that observed
    the step's rollout, made just before the step: the timeline's segments are on its clock."""
    problems, finished, idle, (kept, positions), update, times = result
    t_start, t_rollout, t_idle, t_update, t_end = times
    all_rewards, responses, (loss, clip, skipped) = update
    stats.finish(len(finished), end=t_rollout)
    idle_start, update_start = t_idle - stats.started, t_update - stats.started  # stats' clock
    busy = idle["busy"]
    segments = stats.segments + ([["train", idle_start + busy[0], idle_start + busy[1]]]
                                 if busy else [])
    segments.append(["wait", segments[-1][2] if segments else idle_start,
                     idle_start + idle["seconds"]])
    draft_time = s.rollout_drafter.lap() if s.rollout_drafter else 0.0  # a TimedDrafter's
    local = {"rank": s.rank, "rollout_time": stats.time, "draft_time": draft_time,
             "idle_time": idle["seconds"], "drafter_steps": idle["steps"],
             "wait_to_update": update_start - stats.time, "drafter_skipped": idle["skipped"],
             "tokens": stats.tokens, "drafter_checksum": checksum(s.drafter),
             "tail_share": stats.tail_share, "buffer_tokens": s.buffer.tokens,
             "segments": segments, "by_batch": stats.by_batch}
    counts = {"tokens": stats.tokens, "sd_tokens": stats.sd_tokens,
              "sd_row_steps": stats.sd_row_steps, "accepted": stats.accepted,
              "drafted": stats.drafted, "response_tokens": sum(len(r.response) for r in finished),
              "choice": sum(s.task.choice_share(p, r.response) for p, r in zip(problems, finished)),
              "correct": sum(s.task.correct(p, r.response) for p, r in zip(problems, finished)),
              **position_counts(stats, max(s.args.draft_ks))}
    # the acceptance was summed over ranks by the drafter sync (scheduler.start_drafter_sync)
    total = {**all_sum(counts, s.device), "scored_kept": kept, "scored_positions": positions}
    rec, ranks = rank_record(step, local, total, all_rewards, responses, t_end - t_start,
                             t_end - t_update, timeline=timeline_due(step, s.args))
    rec.update(loss=loss, clip_frac=clip, skipped_update=skipped, bandit_best=best_arms(s.bandit))
    return rec, ranks


def rank_record(step, local, total, all_rewards, responses, step_time, update_time, timeline=False):
    """The record from this rank's `local` part and the sums over ranks, and every rank's part.
    responses: every response's token ids in global row order; timeline: whether the record keeps
    every rank's timeline segments (they are long: only on the steps whose timeline is printed)."""
    ranks = gather_ranks(local)
    if len({r["drafter_checksum"] for r in ranks}) > 1:
        warnings.warn(f"step {step}: the ranks' drafters differ after the sync "
                      f"({[r['drafter_checksum'] for r in ranks]})")
    slowest = max(ranks, key=lambda r: r["rollout_time"])
    rollout_max, by_batch = slowest["rollout_time"], slowest["by_batch"]
    n_rows = all_rewards.numel()
    rates = lambda a, b: total[a] / total[b] if total[b] else None  # noqa: E731
    per_position = lambda name: [int(v) for k, v in total.items() if k.startswith(name)]  # noqa
    return {
        "step": step, "step_time": step_time, "rollout_time": rollout_max,
        "update_time": update_time, "tail_share": slowest["tail_share"],
        "rollout_share": rollout_max / step_time,
        # one hash of every response of the step in global row order: two runs, on any numbers of
        # ranks, can be compared token for token
        "responses_digest": hashlib.sha256(json.dumps(responses).encode()).hexdigest()[:16],
        "draft_time": slowest["draft_time"],  # of the slowest rank's rollout, in the drafter
        # from the slowest rank's rollout's end to its update: rewards, the barrier, a drafter step
        # still in flight on another rank (idle training is free only if this stays near 0)
        "slowest_wait": slowest["wait_to_update"],
        # the share of right answers (Task.correct) and the mean reward (which may give credit)
        "accuracy": total["correct"] / n_rows, "reward": float(all_rewards.mean()),
        "accept_len": rates("sd_tokens", "sd_row_steps"),
        "accept_rate": rates("accepted", "drafted"),
        "drafter_acceptance": rates("scored_kept", "scored_positions"),  # drafter.acceptance
        # per draft position: drafts decided there (the earlier ones accepted) and accepted
        "drafted_at": per_position("drafted_at"), "accepted_at": per_position("accepted_at"),
        # the speculative steps that drafted k tokens a row, k = 0 .. max k (0: none), all ranks
        "sd_steps_by_k": per_position("steps_k"),
        # what the target writes: its mean length and the share of the task's choice
        "response_len": total["response_tokens"] / n_rows, "choice_share": total["choice"] / n_rows,
        # the long tail: every response's length (global row order)
        "response_lens": [len(r) for r in responses],
        # how much earlier the fastest rank finished its rollout than the slowest: idle time
        "rank_spread": 1 - min(r["rollout_time"] for r in ranks) / rollout_max
        if rollout_max > 0 else 0.0,
        # the slowest rank's rollout seconds by running-batch size (the bandit's buckets)
        "rollout_by_batch": {"buckets": [bucket_sizes(i) for i in range(len(by_batch["plain"]))],
                             **by_batch},
        # every rank's [kind, start, end] segments to 0.1 ms, on the steps whose timeline is printed
        "timeline": [[[kind, round(a, 4), round(b, 4)] for kind, a, b in r["segments"]]
                     for r in ranks] if timeline else None,
        "sd_token_frac": total["sd_tokens"] / max(total["tokens"], 1),
        "tok_s": total["tokens"] / max(rollout_max, 1e-9),
        "idle_time": max(r["idle_time"] for r in ranks),
        "drafter_steps": sum(r["drafter_steps"] for r in ranks),
        "drafter_skipped": sum(r["drafter_skipped"] for r in ranks),
        "drafter_checksum": local["drafter_checksum"],
        "ranks": [{k: v for k, v in r.items() if k not in ("segments", "by_batch")} for r in ranks],
    }, ranks


def position_counts(stats, k_max):
    """A rollout's drafts decided and accepted at each draft position 1..k_max, and its
    speculative steps by k, as {name: count} (distributed.all_sum's form)."""
    pad = lambda v, n=k_max: v + [0] * (n - len(v))  # noqa: E731
    return {**{f"drafted_at{i}": v for i, v in enumerate(pad(stats.drafted_at))},
            **{f"accepted_at{i}": v for i, v in enumerate(pad(stats.accepted_at))},
            **{f"steps_k{k}": v for k, v in enumerate(pad(stats.steps_by_k, k_max + 1))}}


def best_arms(bandit):
    """{bucket: best arm} over a rollout.Bandit's scored arms."""
    scored = sorted({b for (b, a) in bandit.plays if bandit.score(b, a) is not None})
    return {b: max((a for a in bandit.arms if bandit.score(b, a) is not None),
                   key=lambda a: bandit.score(b, a)) for b in scored}


def bucket_sizes(bucket):
    """The batch sizes a bandit bucket holds: 0 -> "1", 1 -> "2", 2 -> "3-4", ..."""
    return str(2 ** bucket) if bucket < 2 else f"{2 ** (bucket - 1) + 1}-{2 ** bucket}"


# -----------------------------------------------------------------------------
# the step's line, the ranks' timeline, the lines before and after the run

def log_step(rec, ranks, args):
    """Rank 0's line for the step, and every --timeline-every steps the ranks' timeline."""
    scored = "n/a" if rec["drafter_acceptance"] is None else f"{rec['drafter_acceptance']:.1%}"
    print0(f"step {rec['step']:04d}/{args.rl_steps} | reward {rec['reward']:.3f} | "
           f"step {rec['step_time']:.2f}s | rollout {rec['rollout_time']:.2f}s "
           f"({100 * rec['rollout_share']:.0f}%, tail {100 * rec['tail_share']:.0f}%) | "
           f"tok/s {rec['tok_s']:,.0f} | accept {rec['accept_len'] or 0:.2f} "
           f"({100 * (rec['accept_rate'] or 0):.0f}% of drafts) | "
           f"sd tok {100 * rec['sd_token_frac']:.0f}% | drafter acceptance {scored} | "
           f"idle {rec['idle_time']:.2f}s | drafter steps {rec['drafter_steps']}"
           + (f" ({rec['drafter_skipped']} non-finite, skipped)" if rec["drafter_skipped"] else "")
           + (" | SKIPPED non-finite update" if rec["skipped_update"] else ""))
    if timeline_due(rec["step"], args):
        print0(render_timeline(ranks))


def timeline_due(step, args):
    """Whether a step's timeline is printed (and kept): every --timeline-every steps, the last."""
    return bool(args.timeline_every) and (step % args.timeline_every == 0
                                          or step == args.rl_steps - 1)


def render_timeline(records, width=64):
    """One text row per rank: '#' plain decoding, 'S' speculative, 't' training, '.' waiting."""
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
    return (f"RL: {args.rl_steps} steps x {args.prompts_per_step} prompts x {args.group_size} "
            f"samples on {world_size} rank(s) ({per_rank} rows each) | tlt "
            f"{'on' if args.tlt else 'off'} | drafter updates {updates} | sd threshold "
            f"{args.sd_threshold}")


# the flags next_lines sets itself
RESET_FLAGS = ("--out-dir", "--warmup-dir", "--rl-steps", "--eval-per-bucket", "--drafter-updates",
               "--tlt", "--drafter-warmup-steps")


def next_lines(args, world_size=2):
    """The run's last lines: the commands that show what TLT buys, each pair from the same
    warm-ups. The same RL with --tlt off writes the same responses at every step, so the report
    pairs the two runs step by step: the headline. Whether a drafter goes stale needs one that was
    good when RL began: a drafter warmed up first, trained on idle ranks against frozen (a run that
    warmed its drafter up is itself the first of the two). The commands carry every other flag
    this run was given (--task and its settings included): they train on the same workload."""
    if not (args.tlt and args.drafter_updates):
        return []
    out = args.out_dir.rstrip("/")
    given = "".join(f" {shlex.quote(a)}" for a in other_flags(args.argv, RESET_FLAGS))
    run = (f"  torchrun --standalone --nproc_per_node={world_size} train.py{given} "
           f"--warmup-dir {args.warmup_dir} --rl-steps {args.rl_steps} --eval-per-bucket 0")
    lines = ["", "what TLT buys: the same RL without it, the same tokens at every step, "
             "side by side:",
             f"{run} --out-dir {out}-off --tlt off",
             f"  python -m harness.report {args.out_dir} {out}-off", "",
             "whether a drafter goes stale: one warmed up before RL, trained on idle ranks and "
             "frozen, side by side:"]
    warm = args.drafter_warmup_steps or WARM_DRAFTER_STEPS
    adaptive = args.out_dir if args.drafter_warmup_steps else f"{out}-warm"
    if not args.drafter_warmup_steps:
        lines.append(f"{run} --drafter-warmup-steps {warm} --out-dir {adaptive}")
    return lines + [f"{run} --drafter-warmup-steps {warm} --out-dir {out}-frozen "
                    f"--drafter-updates off", f"  python -m harness.report {adaptive} {out}-frozen"]


def other_flags(argv, drop):
    """The command line `argv` without the flags in `drop` and their values (given either way)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in drop:
            skip = True
        elif a.split("=", 1)[0] not in drop:
            out.append(a)
    return out


# -----------------------------------------------------------------------------
# the summary: first tenth of the run against the last

def trend(history, key, fmt):
    """A figure's mean over the first tenth of the steps -> over the last (where it is not null);
    "n/a" where a tenth lacks it."""
    n, means = max(1, len(history) // 10), []
    for part in (history[:n], history[-n:]):
        vals = [h[key] for h in part if h.get(key) is not None]
        if not vals:
            return "n/a"
        means.append(sum(vals) / len(vals))
    return f"{fmt(means[0])} -> {fmt(means[1])}"


def summary(history, acc0, acc1, total_time, task, stale=None):
    """The end of a run: what its records show, the held-out accuracies before and after RL
    (acc0, acc1: evaluate_both's; empty when not evaluated), the stale drafter (evaluate's
    stale_drafter, or None) and the wall time."""
    lines = ["", "summary"] + record_lines(history, task)
    if not acc0:
        lines.append("  held-out accuracy     not evaluated (--eval-per-bucket 0)")
    else:
        for kind in ("greedy", "sampled"):
            for name, acc in (("before RL", acc0), ("after RL", acc1)):
                lines.append(f"  {kind:7s} {name:9s}     {format_accuracy(acc[kind])}")
        for name, acc in (("before RL", acc0), ("after RL", acc1)):
            lengths = format_lengths(acc["length"])
            lines.append(f"  length  {name:9s}     {lengths} tokens (sampled)")
    lines += stale_lines(stale) + [f"  wall time             {total_time:.0f}s"]
    for line in lines:
        print0(line)


def record_lines(history, task):
    """The summary's lines that the records alone hold: times and shares, the ranks, the drafter,
    the bandit, what the target writes."""
    history = sorted(history, key=lambda h: h["step"])
    n = max(1, len(history) // 10)
    mean = lambda key: statistics.mean(h[key] for h in history)  # noqa: E731
    return [f"  RL steps              {len(history)} (A -> B: the first {n} steps' mean -> the "
             f"last {n} steps')",
             f"  mean step time        {mean('step_time'):.3f}s (rollout "
             f"{mean('rollout_time'):.3f}s, update {mean('update_time'):.3f}s, "
             f"rollout share {mean('rollout_share'):.0%})",
             f"  slowest rank's wait   {1000 * mean('slowest_wait'):.1f} ms mean, from its "
             f"rollout's end to its update's start",
             f"  tail share            {statistics.median(h['tail_share'] for h in history):.0%} "
             f"median (the slowest rank's rollout time after 90% of its rows had finished)",
             *long_tail_lines(history),
             f"  drafter acceptance    {trend(history, 'drafter_acceptance', '{:.1%}'.format)} "
             f"(teacher-forced, on each step's fresh rows before training on them)",
             f"  accept length         {trend(history, 'accept_len', '{:.2f}'.format)} tokens per "
             f"verify step, as the bandit played k",
             f"  at k = 4              {k4_trend(history)} tokens per verify step, from the "
             f"acceptance by position",
             f"  accepted by position  {positions_line(history)}",
             f"  bandit's k per batch  {bandit_line(history[-1])} (rank 0, the end of the run)",
             f"  accuracy              {trend(history, 'accuracy', '{:.1%}'.format)} (right "
             f"answers), mean reward {trend(history, 'reward', '{:.3f}'.format)}",
             length_line(history, task.choice if task else None),
             f"  skipped updates       {sum(h['skipped_update'] for h in history)} of the target, "
             f"{sum(h['drafter_skipped'] for h in history)} drafter steps (not finite)"]


def length_line(history, choice):
    """The mean response length, and the share of the task's choice where it names one."""
    line = f"  response length       {trend(history, 'response_len', '{:.1f}'.format)} tokens"
    return line + (f", {choice} {trend(history, 'choice_share', '{:.0%}'.format)}" if choice else "")


def long_tail_lines(history):
    """How far apart the ranks finished, the steps with idle-time training, where the slowest
    rank's rollout time went by batch size, and the response lengths' long tail."""
    lines = []
    spreads = [h["rank_spread"] for h in history if len(h["ranks"]) > 1]
    if spreads:
        trained = sum(h["drafter_steps"] > 0 for h in history)
        lines += [f"  rank spread           the fastest rank finished its rollout "
                  f"{statistics.median(spreads):.0%} before the slowest (median over steps)",
                  f"  idle-time training    in {trained} of {len(history)} steps "
                  f"({trained / len(history):.0%}), {sum(h['drafter_steps'] for h in history)} "
                  f"drafter steps in all"]
    d = length_distribution([x for h in history for x in h["response_lens"]])
    ratio = statistics.median(max(h["response_lens"]) / statistics.median(h["response_lens"])
                              for h in history)
    return lines + [f"  rollout by batch size {batch_shares(history)} (of the slowest rank's time)",
                    f"  response lengths      median {d['median']:g}, p90 {d['p90']}, max "
                    f"{d['max']} tokens; the longest 5% hold {d['top5_share']:.0%} of the tokens",
                    f"  longest / median      {ratio:.2f} (a step's longest response over its "
                    f"median, median over steps)"]


def length_distribution(lengths):
    """Where response lengths sit and how long their tail is -> {median, p90, max, top5_share}:
    p90 by nearest rank (the shortest length that at least 90% do not exceed), top5_share the share
    of all their tokens that the longest 5% of the responses hold (at least one response)."""
    ordered, n = sorted(lengths), len(lengths)
    total, top = sum(ordered), -(-n // 20)  # ceil(n / 20) responses
    return {"median": statistics.median(ordered), "p90": ordered[-(-9 * n // 10) - 1],
            "max": ordered[-1], "top5_share": sum(ordered[-top:]) / total if total else 0.0}


def batch_shares(history):
    """The slowest rank's rollout time by running-batch size, summed over the run, largest batches
    first (a rollout's order), each with its share in speculative steps."""
    total = sum(h["rollout_time"] for h in history) or 1.0
    sums = {}
    for h in history:
        by = h["rollout_by_batch"]
        for size, p, s in zip(by["buckets"], by["plain"], by["spec"]):
            sums[size] = [a + b for a, b in zip(sums.get(size, [0.0, 0.0]), (p, s))]
    return " | ".join(f"{size} {(p + s) / total:.0%}" + (f" (spec {s / total:.0%})" if s else "")
                      for size, (p, s) in reversed(sums.items()) if p + s)


def by_position(records):
    """Acceptance at each draft position summed over records -> [rate, or None where none]."""
    drafted = [sum(c) for c in zip(*(r["drafted_at"] for r in records))]
    accepted = [sum(c) for c in zip(*(r["accepted_at"] for r in records))]
    return [a / d if d else None for a, d in zip(accepted, drafted)]


def positions_line(history):
    """Acceptance at each draft position (given the earlier drafts were accepted), first tenth
    against last: a drafter going stale loses its later positions first."""
    n = max(1, len(history) // 10)
    first, last = by_position(history[:n]), by_position(history[-n:])
    cell = lambda r: "-" if r is None else f"{r:.0%}"  # noqa: E731
    cells = [f"{cell(a)} -> {cell(b)}" for a, b in zip(first, last)]
    return " | ".join(cells) + " (draft 1, 2, ...)" if cells else "no drafts"


def k4_trend(history):
    """Tokens per verify step at k = 4 from the acceptance by position, first tenth -> last."""
    n = max(1, len(history) // 10)
    k4 = [accept_len_at(by_position(part)) for part in (history[:n], history[-n:])]
    return "n/a" if None in k4 else f"{k4[0]:.2f} -> {k4[1]:.2f}"


def accept_len_at(rates, k=4):
    """The tokens per verify step that drafts of k tokens give at these acceptance rates by
    position: 1 + a1 + a1 a2 + ... + a1 ... ak. None without a rate at each of the k positions."""
    if len(rates) < k or None in rates[:k]:
        return None
    return 1 + expected_accepted(rates[:k])


def bandit_line(rec):
    best = rec["bandit_best"]
    return ", ".join(f"{bucket_sizes(int(b))}: {k}" for b, k in best.items()) if best else "none"


def stale_lines(stale):
    """A drafter kept from early in RL, for the target of its step and for the final target, and
    the adaptive drafter for the final target: does a static drafter go stale?"""
    if not stale:
        return []
    (then, now, adaptive), n = stale["figures"], stale["step"]
    return [f"  stale drafter         {then:.2f} -> {now:.2f} ({now / then - 1:+.1%}) -> "
            f"{adaptive:.2f} ({adaptive / then - 1:+.1%}) tokens per verify step at k = "
            f"{stale['k']}, held-out problems:",
            f"                        step {n}'s drafter for step {n}'s target -> the same drafter "
            f"for the final target -> the run's final drafter for it"]


# -----------------------------------------------------------------------------
# two or more runs of the same steps, side by side

COMPARED = (("accept_len", "accept length", "{:.2f}"),
            ("response_len", "response length", "{:.1f}"),
            ("rollout_time", "rollout time", "{:.3f}s"), ("step_time", "step time", "{:.3f}s"))


def compare(runs, names):
    """Runs (each its records, all of the same steps): per figure, each run's first tenth -> last
    tenth; then whether the runs are paired, and if so the medians of their per-step time ratios."""
    runs = [sorted(run, key=lambda h: h["step"]) for run in runs]
    n = max(1, len(runs[0]) // 10)
    lines = ["", "comparison: " + ", ".join(f"{c} = {name}" for c, name in zip(LETTERS, names)),
             f"  each: the first {n} steps' mean -> the last {n} steps'"]
    for key, label, fmt in COMPARED:
        lines += [f"  {label:16s}{c} {trend(run, key, fmt.format)}"
                  for c, run in zip(LETTERS, runs)]
    lines += [f"  at k = 4        {c} {k4_trend(run)} tokens per verify step"
              for c, run in zip(LETTERS, runs)]
    return lines + pairing_lines(runs)


def pairing_lines(runs):
    """Whether every run wrote run A's responses at every step (`responses_digest`) and, if so, the
    median of each later run's per-step time ratios to A, over the run and over its last tenth."""
    n, k = len(runs[0]), max(1, len(runs[0]) // 10)
    digests = [{r.get("responses_digest") for r in step} for step in zip(*runs)]
    differ = sum(len(d) > 1 or None in d for d in digests)
    if differ:
        return [f"  not paired: the runs' responses differ at {differ} of {n} steps "
                "(responses_digest): compare the tenths only"]
    lines = [f"  paired: the same responses at all {n} steps; median of the per-step ratios to A "
             f"(above 1: slower than A)"]
    for c, run in zip(LETTERS[1:], runs[1:]):
        for key in ("rollout_time", "step_time"):
            ratios = [b[key] / a[key] for a, b in zip(runs[0], run)]
            lines.append(f"    {c} / A  {key.replace('_', ' '):13s}"
                         f"{statistics.median(ratios):5.2f} over all {n} steps, "
                         f"{statistics.median(ratios[-k:]):.2f} over the last {k}")
    return lines


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
            lines = [line for line in f if line.strip()]
    except UnicodeDecodeError:  # a checkpoint given for a metrics file, say
        return None, f"{path} is not a text file"
    records = []
    for i, line in enumerate(lines, 1):
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            return None, f"{path} line {i} is not JSON ({e.msg})"
        missing = [k for k in NEEDED if k not in rec] if isinstance(rec, dict) else ["everything"]
        if missing:
            return None, f"{path} line {i} lacks {', '.join(missing)}"
        records.append(rec)
    return (records, None) if records else (None, f"{path} holds no records")


def run_task(path):
    """The task a run trained on, from the task.json train.py writes beside metrics.jsonl."""
    folder = path if os.path.isdir(path) else os.path.dirname(path)
    try:
        with open(os.path.join(folder, "task.json")) as f:
            return tasks.from_meta(json.load(f))
    except FileNotFoundError:
        return None


def main(argv=None):
    p = OneLineParser(description="The summary of a run from its metrics.jsonl; two or more runs "
                                  "of the same steps: compared.")
    p.add_argument("paths", nargs="+", metavar="path",
                   help="a run's --out-dir, or the path of its metrics.jsonl")
    args = p.parse_args(argv)
    if len(args.paths) > len(LETTERS):
        p.error(f"at most {len(LETTERS)} runs, got {len(args.paths)}")
    runs = []
    for path in args.paths:
        records, problem = load_records(path)
        if problem:
            p.exit(2, f"error: {problem}\n")
        runs.append(records)
    steps = [sorted(h["step"] for h in run) for run in runs]
    if any(s != steps[0] for s in steps):
        p.exit(2, "error: the runs are of different steps: compare runs of the same steps\n")
    if len(runs) == 1:
        lines = ["summary"] + record_lines(runs[0], run_task(args.paths[0]))
    else:
        lines = compare(runs, [os.path.normpath(path) for path in args.paths])
    for line in lines:
        print0(line)


if __name__ == "__main__":
    main()
