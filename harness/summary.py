"""The end of a run in words and in a picture, from its metrics.jsonl records.

train.py prints the summary when a run ends (`summary`); `python -m harness.report out` prints it
again from the records alone (`record_lines`, `skipped_line`, `picture`). Its lines: what a step
costs and where the time goes (the rollout's share, the tail, how far apart the ranks finish, the
slowest rank's rollout time by running-batch size), how the drafter fares (top-1, accept length,
acceptance by position, the steps it trained on idle ranks), the bandit's choices, the accuracy (the
share of right answers) and the mean reward, and what the target writes: the mean response length
and its long tail (median, p90, max and the share of the tokens that the longest 5% of the responses
hold), first tenth of the run against the last, since a step's figures swing with its prompt mix and
tenths show the trend.

The picture answers the question the adaptive drafter exists for: does the drafter hold as the
target moves? Over bins of consecutive RL steps it draws what the target writes (mean, median and
longest response), how the drafter fares (teacher-forced top-1, accept length) and what the step
costs (step time, rollout share); then the acceptance at each draft position in the first tenth of
the run against the last tenth, since an average accept length alone hides a drafter that is good
for one token and guesses after it. The picture is text, at most 100 columns wide: per figure a
sparkline of the blocks in BLOCKS, scaled from the figure's minimum to its maximum (both printed
beside it, so a small change is not mistaken for a large one); a bin where the figure is null or
absent in every record (no speculative step in it; a record written before the figure existed) is
left blank.

Lines about figures that older records lack say nothing; such records still load.

Test: python -m pytest tests/test_report.py
"""
import statistics

from harness.distributed import print0
from harness.evaluate import format_accuracy, format_lengths

BLOCKS = " ▁▂▃▄▅▆▇█"  # a sparkline's levels; " " is a bin without a figure
EIGHTHS = " ▏▎▍▌▋▊▉"  # a bar's last, partial cell
BAR_WIDTH = 40  # cells of a bar at 100%


def seconds(v):
    """A step time for the picture: milliseconds shown for short steps, whole seconds for long."""
    return f"{v:.3f}" if v < 10 else f"{v:.1f}" if v < 1000 else f"{v:.0f}"


# the picture's rows: (record key, label, how a value prints, unit, what a row without any figure
# says): what the target writes, how the drafter fares, what the step costs
NO_SD = "no speculative steps (accept_len is null in every record: --tlt off, or no SD step ran)"
PICTURE_ROWS = (("response_len", "response length", "{:.1f}".format, "tokens", "no figure"),
                ("response_median", "response median", "{:.1f}".format, "tokens", "no figure"),
                ("response_max", "response max", "{:.1f}".format, "tokens", "no figure"),
                ("drafter_top1", "drafter top-1", "{:.1%}".format, "", "not scored in any step"),
                ("accept_len", "accept length", "{:.2f}".format, "tokens/verify", NO_SD),
                ("step_time", "step time", seconds, "s", "no figure"),
                ("rollout_share", "rollout share", "{:.0%}".format, "", "no figure"))


# -----------------------------------------------------------------------------
# the summary

def summary(history, acc0, acc1, total_time, task, stale=None):
    """The end of a run: what its records show, the held-out accuracies before and after RL
    (acc0, acc1: evaluate_both's; empty when not evaluated), the stale drafter (stale: evaluate's
    stale_drafter, or None), the wall time, then the picture."""
    print0("\nsummary")
    for line in record_lines(history, task):
        print0(line)
    if not acc0:
        print0("  held-out accuracy     not evaluated (--eval-per-bucket 0)")
    else:
        for kind in ("greedy", "sampled"):
            for name, acc in (("before RL", acc0), ("after RL", acc1)):
                print0(f"  {kind:7s} {name:9s}     {format_accuracy(acc[kind])}")
        for name, acc in (("before RL", acc0), ("after RL", acc1)):
            print0(f"  length  {name:9s}     {format_lengths(acc['length'])} tokens (sampled)")
    for line in stale_lines(stale):
        print0(line)
    print0(skipped_line(history))
    print0(f"  wall time             {total_time:.0f}s")
    for line in picture(history, task) + stale_bars(stale):
        print0(line)


def stale_lines(stale):
    """A drafter kept from early in RL, for the target of its step and for the final target, and
    the adaptive drafter for the final target: does a static drafter go stale?"""
    if not stale:
        return []
    (then, now, adaptive), n = stale["figures"], stale["step"]
    return [f"  stale drafter         {then:.2f} -> {now:.2f} ({now / then - 1:+.1%}) -> {adaptive:.2f} "
            f"({adaptive / then - 1:+.1%}) tokens per verify step at k = {stale['k']}, held-out problems:",
            f"                        step {n}'s drafter for step {n}'s target -> the same drafter for the "
            f"final target -> the run's final drafter for it"]


def record_lines(history, task):
    """The summary's lines that the records alone hold, up to the held-out accuracies: times,
    shares and the ranks, the drafter, the bandit, reward and lengths."""
    def mean(key):
        vals = [h[key] for h in history if h[key] is not None]
        return sum(vals) / len(vals) if vals else float("nan")
    wait_max = max(h["slowest_wait"] for h in history)
    tail = statistics.median(h["tail_share"] for h in history)
    lines = [f"  RL steps              {len(history)}",
             f"  mean step time        {mean('step_time'):.3f}s (rollout "
             f"{mean('rollout_time'):.3f}s, update {mean('update_time'):.3f}s, "
             f"rollout share {100 * mean('rollout_share'):.0f}%)",
             f"  slowest rank's wait   {1000 * mean('slowest_wait'):.1f} ms mean, from its "
             f"rollout's end to its update's start (max {1000 * wait_max:.1f} ms)",
             f"  tail share            {100 * tail:.0f}% median (the slowest rank's rollout time "
             f"after 90% of its rows had finished)"]
    lines += spread_lines(history) + batch_lines(history)
    top1 = [h["drafter_top1"] for h in history if h["drafter_top1"] is not None]
    if top1:
        n = max(1, len(top1) // 10)
        lines.append(f"  drafter top-1         {100 * sum(top1[:n]) / n:.1f}% -> "
                     f"{100 * sum(top1[-n:]) / n:.1f}% (teacher-forced agreement with the target "
                     f"on each step's fresh rows, before training on them; "
                     f"first and last {n} steps)")
    lines.append(f"  mean accept length    {mean('accept_len'):.2f} tokens per verify step, "
                 f"{100 * mean('accept_rate'):.0f}% of drafted tokens accepted, "
                 f"SD token share {100 * mean('sd_token_frac'):.0f}%")
    rates, drafted = by_position(history)
    if any(drafted):
        lines.append(f"  accepted by position  {format_positions(rates)} % (draft 1..{len(rates)}, "
                     f"given the earlier ones were; {sum(drafted):,} drafts decided)")
    lines += idle_lines(history)
    n = max(1, len(history) // 10)
    for when, rec in ((f"after step {history[n - 1]['step']}", history[n - 1]), ("end of run", history[-1])):
        if rec["bandit_best"]:
            tokens = rec.get("bandit_tokens") or {}  # records before it was kept have none
            ks = ", ".join(f"{bucket_sizes(int(b))}: {k}" + (f" ({tokens[b]:.1f})" if b in tokens else "")
                           for b, k in rec["bandit_best"].items())
            lines.append(f"  bandit's k per batch  {ks} (rank 0, {when}{'; in brackets, tokens a step' if tokens else ''})")
    return lines + trend_lines(history, task.choice if task else None) + length_lines(history)


def trend_lines(history, choice):
    """The rollouts' accuracy, their mean reward and what the target writes, first tenth of the run
    against the last: a step's reward swings with its prompt mix, tenths of the run show the trend."""
    n = max(1, len(history) // 10)

    def tenths(key):
        return sum(h[key] for h in history[:n]) / n, sum(h[key] for h in history[-n:]) / n
    reward = "  mean reward           {:.3f} -> {:.3f}".format(*tenths("reward"))
    if all("accuracy" in h for h in history):  # the share of right answers (Task.correct); older records lack it
        reward = "  accuracy              {:.1%} -> {:.1%}, mean reward {:.3f} -> {:.3f}".format(
            *tenths("accuracy"), *tenths("reward"))
    length = "  response length       {:.1f} -> {:.1f} tokens".format(*tenths("response_len"))
    if choice and any(h["choice_share"] for h in history):
        length += f", {choice} " + "{:.0%} -> {:.0%}".format(*tenths("choice_share"))
    return [reward + f" (means of the first and the last {n} steps)",
            length + f" (first and last {n} steps)"]


def skipped_line(history):
    """The summary's count of the updates skipped for a non-finite loss or gradient."""
    return (f"  skipped updates       {sum(h['skipped_update'] for h in history)} of the target, "
            f"{sum(h['drafter_skipped'] for h in history)} drafter steps "
            f"(non-finite loss or gradient)")


# -----------------------------------------------------------------------------
# the long tail: response lengths, the ranks' spread, idle-time training, rollout time by batch size

def length_distribution(lengths):
    """Where a set of response lengths sits and how long its tail is -> {median, p90, max,
    top5_share}: p90 by nearest rank (the shortest length that at least 90% of the responses do not
    exceed), top5_share the share of all their tokens that the longest 5% of the responses hold (at
    least one response). A long tail shows as a max far above the p90 and a large top-5% share."""
    ordered, n = sorted(lengths), len(lengths)
    total, top = sum(ordered), -(-n // 20)  # ceil(n / 20) responses
    return {"median": statistics.median(ordered), "p90": ordered[-(-9 * n // 10) - 1], "max": ordered[-1],
            "top5_share": sum(ordered[-top:]) / total if total else 0.0}


def length_lines(history):
    """The distribution of the response lengths (length_distribution) over the first tenth of the
    run, the last tenth and the whole run, then a step's longest response over its median."""
    have = [h for h in history if "response_lens" in h]
    if not have:
        return []
    n, lines = max(1, len(have) // 10), []
    for i, (name, part) in enumerate(((f"first {n} steps", have[:n]), (f"last {n} steps", have[-n:]),
                                      (f"all {len(have)} steps", have))):
        d = length_distribution([x for h in part for x in h["response_lens"]])
        lines.append(f"  {'response lengths' if i == 0 else '':22s}{name + ':':16s}median {d['median']:g}, "
                     f"p90 {d['p90']}, max {d['max']} tokens; the longest 5% of the responses hold "
                     f"{d['top5_share']:.0%} of the tokens")
    ratios = [h["response_max"] / h["response_median"] for h in have if h["response_median"]]
    if ratios:
        lines.append(f"  longest / median      {statistics.median(ratios):.2f} (a step's longest response "
                     f"over its median, median over {len(ratios)} steps)")
    return lines


def spread_lines(history):
    """How much earlier the fastest rank finished its rollout than the slowest: the idle time that
    the drafter trains on. Only for a run of two or more ranks."""
    spreads = [h["rank_spread"] for h in history if "rank_spread" in h and len(h.get("ranks", ())) > 1]
    if not spreads:
        return []
    return [f"  rank spread           the fastest rank finished its rollout {statistics.median(spreads):.0%} "
            f"before the slowest (median over steps of 1 - fastest/slowest)"]


def idle_lines(history):
    """In how many steps the drafter trained on idle ranks, and how many steps it took in all."""
    steps = [h["drafter_steps"] for h in history if "drafter_steps" in h]
    if not steps:
        return []
    trained = sum(n > 0 for n in steps)
    return [f"  idle-time training    drafter trained on idle ranks in {trained} of {len(steps)} steps "
            f"({trained / len(steps):.0%}), {sum(steps)} drafter steps in all"]


def batch_lines(history):
    """Where the slowest rank's rollout time went by running-batch size (the bandit's buckets,
    `rollout_by_batch`), as shares of its rollout time summed over the run, largest batches first
    (a rollout's order), each with the share of it spent in speculative steps."""
    have = [h for h in history if h.get("rollout_by_batch")]
    total = sum(h["rollout_time"] for h in have)
    if not total:
        return []
    plain, spec = (padded_sums([h["rollout_by_batch"][kind] for h in have]) for kind in ("plain", "spec"))
    cells = [f"{bucket_sizes(i)} {(p + s) / total:.0%}" + (f" (spec {s / total:.0%})" if s else "")
             for i, (p, s) in reversed(list(enumerate(zip(plain, spec)))) if p + s]
    return [f"  rollout by batch size {' | '.join(cells)} (shares of the slowest rank's rollout time, summed over "
            f"the run; spec: in speculative steps)"]


# -----------------------------------------------------------------------------
# acceptance by draft position and the bandit's buckets, as the summary and the logs print them

def by_position(records):
    """Acceptance at each draft position summed over records (metrics.jsonl's, with their
    `drafted_at` and `accepted_at`) -> ([rates or None], [drafts decided])."""
    drafted, accepted = column_sums(records, "drafted_at"), column_sums(records, "accepted_at")
    return [a / d if d else None for a, d in zip(accepted, drafted)], drafted


def column_sums(records, key):
    """The sum over records of a per-position (or per-bucket) list, position by position."""
    return [sum(c) for c in zip(*(r[key] for r in records))]


def format_positions(rates):
    """Rates by position as percentages for a log line; '-' where no draft was decided."""
    return " ".join("  -  " if r is None else f"{100 * r:4.1f}" for r in rates)


def bucket_sizes(bucket):
    """The batch sizes a bandit bucket holds, for logs: 0 -> "1", 1 -> "2", 2 -> "3-4", ..."""
    return str(2 ** bucket) if bucket < 2 else f"{2 ** (bucket - 1) + 1}-{2 ** bucket}"


def padded_sums(lists):
    """Position by position, the sums of lists of any lengths (past its end a list adds nothing)."""
    return [sum(v[i] for v in lists if i < len(v)) for i in range(max(map(len, lists), default=0))]


# -----------------------------------------------------------------------------
# the picture: does the drafter hold as the target moves?

def picture(history, task, bins=10):
    """The run drawn in text lines of at most 100 characters: each PICTURE_ROWS figure as a
    sparkline over at most `bins` bins of consecutive steps, then the acceptance at each draft
    position, first tenth of the run against the last."""
    history = by_step(history)
    edges = bin_edges(len(history), bins)
    lines = ["", "picture of the run: does the drafter hold as the target moves?",
             f"  {binning(history, edges)}; each row: first bin -> last bin, then its range"]
    for key, label, fmt, unit, empty in PICTURE_ROWS:
        means = bin_means(history, key, edges)
        known = [m for m in means if m is not None]
        if not known:
            lines.append(f"  {label:16s}{empty}")
            continue
        lines.append(f"  {label:16s}{sparkline(means)}  {fmt(known[0])} -> {fmt(known[-1])}, "
                     f"range {fmt(min(known))}..{fmt(max(known))} {unit}".rstrip())
    return lines + position_bars(history, task)


def by_step(records):
    """Records in step order: bins are of consecutive steps, whatever order the file holds."""
    return sorted(records, key=lambda h: h["step"])


def bin_edges(n, bins):
    """Edges of at most `bins` bins of consecutive records out of n, whose sizes differ by at
    most one."""
    bins = max(1, min(bins, n))
    return [i * n // bins for i in range(bins + 1)]


def binning(history, edges):
    """What the bins of a run's sorted records hold, for a picture's head line."""
    sizes = " or ".join(str(s) for s in sorted({hi - lo for lo, hi in zip(edges, edges[1:])}))
    return f"steps {history[0]['step']}..{history[-1]['step']} in {len(edges) - 1} bins of {sizes} step(s)"


def bin_means(history, key, edges):
    """Per bin, the mean of a figure over its records where it is not null; None where it is
    null or absent (a record written before it existed) in all of them."""
    out = []
    for lo, hi in zip(edges, edges[1:]):
        vals = [h[key] for h in history[lo:hi] if h.get(key) is not None]
        out.append(sum(vals) / len(vals) if vals else None)
    return out


def sparkline(values, cell=2, scale=None):
    """Values as blocks of `cell` characters, from ▁ at their minimum to █ at their maximum (or at
    scale's (lo, hi): runs compared on one scale); blanks for None. A flat figure draws at mid-height."""
    known = [v for v in values if v is not None]
    lo, hi = scale or (min(known), max(known))

    def level(v):
        if v is None:
            return 0
        return 1 + (round(7 * (v - lo) / (hi - lo)) if hi > lo else 4)
    return " ".join(BLOCKS[level(v)] * cell for v in values)


def bar(frac, width=BAR_WIDTH):
    """A horizontal bar of `width` cells for a fraction in [0, 1], in eighths of a cell."""
    full, part = divmod(round(max(0.0, min(1.0, frac)) * width * 8), 8)
    return ("█" * full + (EIGHTHS[part] if part else "")).ljust(width)


def position_bars(history, task):
    """Acceptance at each draft position (given the earlier ones were accepted), summed over the
    first tenth of the run and over the last tenth, one bar each: a drafter going stale as the
    target moves loses its later positions first."""
    n = max(1, len(history) // 10)
    parts = [(f"first {n}", by_position(history[:n])), (f"last {n}", by_position(history[-n:]))]
    steps = f"{n} step{'s' if n > 1 else ''}"
    if not any(any(drafted) for _, (_, drafted) in parts):
        return [f"  accepted by position  no drafts decided in the first or the last {steps}"]
    lines = [f"  accepted by position (% of the drafts decided there; first and last {steps})"]
    for i in range(max(len(rates) for _, (rates, _) in parts)):
        for j, (name, (rates, drafted)) in enumerate(parts):
            head = f"    draft {i + 1:<2d} {name:9s}" if j == 0 else f"{'':13s}{name:9s}"
            rate = rates[i] if i < len(rates) else None
            if rate is None:
                lines.append(f"{head}|{' ' * BAR_WIDTH}|   -   no drafts")
            else:
                lines.append(f"{head}|{bar(rate)}| {100 * rate:5.1f}% of {drafted[i]:,}")
    implied = [accept_len_at(rates) for _, (rates, _) in parts]
    if None not in implied:
        lines.append(f"  at k = 4 these give {implied[0]:.2f} -> {implied[1]:.2f} tokens per verify step "
                     f"(1 + a1 + a1 a2 + ...)")
    return lines + size_line(history[:n], history[-n:], task)


def size_line(first, last, task):
    """Drafts accepted by problem-size bucket, first records against last; none for records
    written before the counts existed, or without the task (None) that names the buckets."""
    if task is None or any("drafted_by_size" not in r for r in first + last):
        return []
    names = [f"{lo}-{hi}" for lo, hi in task.size_buckets]
    sums = [column_sums(part, key) for part in (first, last) for key in ("drafted_by_size", "accepted_by_size")]
    cells = [f"{name} {percent(a0, d0)} -> {percent(a1, d1)}"
             for name, d0, a0, d1, a1 in zip(names, *sums) if d0 or d1]
    return [f"  accepted by size      {' | '.join(cells)}"] if cells else []


def percent(accepted, drafted):
    return f"{100 * accepted / drafted:.1f}%" if drafted else "-"


def accept_len_at(rates, k=4):
    """The tokens per verify step that drafts of k tokens would give at these acceptance rates by
    position: 1 + a1 + a1 a2 + ... + a1 ... ak. None without a rate at each of the k positions."""
    if len(rates) < k or None in rates[:k]:
        return None
    out, kept = 1.0, 1.0
    for a in rates[:k]:
        kept *= a
        out += kept
    return out




def stale_bars(stale):
    """The stale-drafter figures as bars, a full bar k + 1 tokens per verify step."""
    if not stale:
        return []
    n, k = stale["step"], stale["k"]
    names = (f"step {n}'s drafter, step {n}'s target", f"step {n}'s drafter, final target",
             "final drafter, final target")
    return [f"  stale drafter (tokens per verify step at k = {k}, held-out problems; a full bar: {k + 1})"] + [
        f"    {name:36s}|{bar(v / (k + 1))}| {v:.2f}" for name, v in zip(names, stale["figures"])]
