"""The README's path of one RL step, made from the code: every function and method that one default
RL step reaches, the harness's included and marked, in rows, with the line count of each and their
total.

A newcomer reads the core along one RL step, and the README's table is that path. Its line counts
and its total go stale with any edit, so this command writes them: the rows (which functions go
together, and the words that say what they do) are written by hand in ROWS below; which functions
the step reaches, their order, their lengths and the total are read from the code.

    python -m harness.reading_path            # print the section: its sentence and its table
    python -m harness.reading_path --write    # rewrite that section of README.md, nothing else
    python -m harness.reading_path --check    # exit 1 if README.md's section is not this one
    torchrun --nproc_per_node=2 -m harness.reading_path --trace [train.py's flags]
                                              # what real steps called: <out-dir>/reached.<rank>.json

The walk starts at train.rl_step and follows calls, mechanically, through the core files and
train.py, and through the harness files that make what train.run hands the step (SEAMS); a task's
own functions (tasks/) are left out, as the task is not the technique.
- By name: a call `f(...)` or `x.f(...)` in the core reaches every core function or method named f,
  and a call of a class reaches its __init__; in the harness, the harness's too. A call of a seam's
  name in the core (`observer(...)`, `barrier()`, `.propose(...)`) also reaches what train.run hands
  in there (a lambda counts as the function that makes it). A method called on `super()` is the
  parent class's (torch's for the core's modules: not followed); one called on the task (`task.f`,
  `s.task.f`) is the task's: not followed. What runs only under a setting the default run leaves off
  (TLT_DEBUG=1, --sampler rejection) is not walked: NOT_IN_A_DEFAULT_STEP names it.
- Module calls: a call of an expression that holds a core module reaches that class's forward
  (nn.Module.__call__ runs it), and one that holds a harness object its __call__; reading a
  property of it runs the property, and len(x) a __len__. What an expression holds is read from
  names, not types: `self` holds its own class; a variable holds the class it is named after, in
  lower case (`block`, `drafter`); `target`, `model` and `net` hold GPT and `batch` a RunningBatch
  (the core's names for them); `x.a` holds what the __init__ of x's class assigns to `self.a`, a
  module, a list of them, or a variable (`self.attn = Attention(config)`,
  `self.blocks = nn.ModuleList(Block(config) ...)`, `self.target = target`). So `self.target(...)`
  reaches GPT.forward, `torch.stack(...)` nothing.
The walk is depth first, a function's calls in the order they are written, so the rows read as the
step runs: a row's place is where the walk first reaches its first function, except the helper
rows (the noise's hashing), which the step reaches through the prefill but which are read after the
steps that use them: they come last. The command fails, naming the function, if the walk reaches
one that no row names, or a row names one that the walk does not reach.

Test: python -m pytest tests/test_readme.py
"""
import argparse
import ast
import os
import re
import sys
from typing import NamedTuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README = os.path.join(ROOT, "README.md")
CORE = ("model", "drafter", "speculative", "rollout", "scheduler", "rl", "train")
HARNESS = ("instrument", "liveness")  # what train.run hands the step is made here
START = "train.rl_step"
# what train.run hands the step: a call in the core of one of these names also reaches these
# harness functions (the rollout's observer, the idle loop's barrier, the timed drafter's propose)
SEAMS = {"observer": ["instrument.observers", "RolloutStats.__call__", "instrument.liveness_observer"],
         "barrier": ["liveness.watched_barrier"], "is_completed": ["Watched.is_completed"],
         "wait": ["Watched.wait"], "propose": ["TimedDrafter.propose"]}
# reached by name, but run only under a setting the default run leaves off: not walked
NOT_IN_A_DEFAULT_STEP = {
    **dict.fromkeys(["BatchChecker.__init__", "instrument.check"], "TLT_DEBUG=1"),
    **dict.fromkeys(["FixedK.__init__", "FixedK.choose", "FixedK.update"], "the generate functions"),
    **dict.fromkeys(["RejectionSampler.__init__", "RejectionSampler.noise", "RejectionSampler.choose",
                     "RejectionSampler.verify", "RejectionSampler.compact", "speculative.probs",
                     "speculative.draw", "speculative.verify"], "--sampler rejection")}
TARGET_NAMES = ("target", "model", "net")  # the names the core gives the target (a GPT)
BATCH_NAMES = ("batch",)  # and a running batch (a RunningBatch), where it is one
WRITE = "python -m harness.reading_path --write"
SENTENCE = """\
**The path of one RL step**: every function and method that one default step reaches ({total} lines
in all), helpers and the model's forwards included, the task's own functions aside. Rows marked
harness are what `train.run` hands the step (the rollout's observer, the timed drafter, the idle
loop's barrier): a learner may skip them. The rows are in the order a depth-first walk of the calls
from `train.rl_step` first reaches them (by name, and through a module call to its `forward`), the
noise's hashing last; the counts are the code's.
`python -m harness.reading_path --write` writes this table, `tests/test_readme.py` checks it:"""
HEAD = SENTENCE.partition(":")[0]  # how --write finds the section: a line that starts so

# the rows: title -> (the functions it holds, in reading order; what they do). By hand: the walk
# decides where a row goes, these decide what it holds and say why it is there.
ROWS = {
    "the step": (
        ["train.rl_step"],
        "one RL step on one rank, in seven steps"),
    "the rows": (
        ["rl.step_rows", "rl.rl_problems", "rl.derive_seed"],
        "this rank's rows of the global batch, each with its key; a seed per stream"),
    "the rollout": (
        ["train.roll_out", "rollout.rollout", "TailPolicy.__init__", "speculative.decode",
         "RunningBatch.batch_size", "TailPolicy.choose", "TailPolicy.update"],
        "the decoding loop; plain steps above `--sd-threshold`, the bandit's k at or below it"),
    "idle time": (
        ["train.idle_phase", "RecentTop1.mean", "scheduler.drafter_schedule", "scheduler.top1_pieces",
         "drafter.top1_agreement"],
        "the rule: the lower its recent top-1, the harder it trains; scoring fresh rows first"),
    "the idle loop": (
        ["scheduler.idle_train"],
        "the async barrier's loop, a piece of work a turn, until the last rank arrives"),
    "the sync": (
        ["scheduler.start_drafter_sync", "RecentTop1.add"],
        "the weighted average, overlapping the update; the top-1 counts summed in the same all-reduce"),
    "the observer (harness)": (
        ["instrument.observers", "RolloutStats.__call__", "DecodeStats.__call__",
         "instrument.add_segment", "instrument.liveness_observer", "liveness.beat", "Liveness.beat"],
        "harness, handed in by `run`: counts and times every decoding step; beats: slow, not dead"),
    "the timed drafter (harness)": (
        ["TimedDrafter.propose", "Stopwatch.__call__"],
        "harness, handed in by `run`: the drafter, timed without a sync per proposal"),
    "the watched barrier (harness)": (
        ["liveness.watched_barrier", "Watched.__init__", "Liveness.start_wait",
         "Watched.is_completed", "Liveness.check", "Liveness.verdict", "Watched.wait"],
        "harness, handed in by `run`: the idle loop's async barrier; a silent rank fails it"),
    "the update's rows": (
        ["train.update_target", "rl.group_advantages", "rl.deal_by_tokens"],
        "every rank's rows, advantages, rows re-dealt by tokens"),
    "the update": (
        ["rl.grpo_update", "rl.group_by_length", "rl.collate",
         "rl.token_logprobs", "rl.grpo_loss"],
        "the masked clipped loss, its token mean over the global batch"),
    "the drafter buffer": (
        ["DrafterBuffer.add_rows", "DrafterBuffer.add",
         "DrafterBuffer.sample", "drafter.crop", "drafter.pair_batch"],
        "the recent rows, bounded; random batches of at most a piece's positions"),
    "the prefill and cache": (
        ["RunningBatch.__init__", "Sampling.new_sampler", "GPT.new_cache", "KVCache.__init__"],
        "one sampler for the batch; each distinct prompt prefilled once into a cache with a "
        "length per row"),
    "compaction": (
        ["RunningBatch.compact", "KVCache.compact"],
        "which rows finished, read from the device; they leave every tensor and cache"),
    "the bandit": (
        ["Bandit.__init__", "Bandit.choose", "Bandit.bucket", "Bandit.score", "Bandit.update"],
        "k per batch-size bucket, scored by tokens per second"),
    "the plain step": (
        ["RunningBatch.plain_step", "RunningBatch._append"],
        "one token a row; the kept tokens, cut at `<|eos|>`"),
    "the speculative step": (
        ["RunningBatch.speculative_step", "RunningBatch.choose_draft"],
        "the step's noise made once; draft, verify in one target pass, keep a ragged number per "
        "row"),
    "the gumbel sampler": (
        ["GumbelSampler.__init__", "GumbelSampler.noise", "GumbelSampler.choose", "GumbelSampler.verify",
         "GumbelSampler.compact", "speculative.verify_gumbel"],
        "exact-token sampling (the default): a token is the argmax of logits / T + noise"),
    "the noise": (
        ["speculative.gumbel_seeds", "speculative.gumbel_noise", "speculative.token_hashes",
         "speculative.mix32"],
        "the gumbel noise, hashed from (row key, position, token)"),
    "the drafter's propose": (
        ["Drafter.propose", "Drafter.new_cache", "Drafter.forward", "Drafter.project_in"],
        "catch up on unread target states, then draft k, feeding back its own state"),
    "the target's forward": (
        ["GPT.forward", "Blocks.forward", "Block.forward", "Attention.forward"],
        "logits and hidden states: positions, rotary, cache writes, the blocks (the drafter's "
        "too)"),
    "drafter training": (
        ["drafter.train_step", "drafter.drafter_loss", "drafter.chained_states",
         "drafter.chain_attention_mask", "drafter.chain_loss_masks"],
        "one step, as deep as the rule says, stoppable between passes"),
}


HELPERS = ("the noise",)  # rows read after the steps that use them: last


class Code(NamedTuple):
    """What the walk reads from the core files, train.py and the harness files."""
    defs: dict  # qualified name (`module.f`, `Class.method`) -> (module, ast.FunctionDef)
    by_name: dict  # a name called in the core -> the core's qualified names a call of it reaches
    attrs: dict  # class -> {attribute: classes its __init__ assigns there}
    harness_by_name: dict  # a name called in the harness -> the qualified names, harness's too
    parents: dict  # class -> the names of its bases
    properties: dict  # a property's name -> the core's qualified names of that property


def members(module, node):
    """(qualified name, node) of the functions a top-level statement defines."""
    if isinstance(node, ast.FunctionDef):
        return [(f"{module}.{node.name}", node)]
    if isinstance(node, ast.ClassDef):
        return [(f"{node.name}.{m.name}", m) for m in node.body if isinstance(m, ast.FunctionDef)]
    return []


def named(name, classes):
    """The classes a variable of this name holds: its own in lower case, GPT for the target's."""
    held = {c for c in classes if c.lower() == name}
    return held | ({"GPT"} if name in TARGET_NAMES else set()) | (
        {"RunningBatch"} if name in BATCH_NAMES else set())


def last_name(expr):
    """`f` of `f` or `x.y.f`; None for anything else."""
    return expr.id if isinstance(expr, ast.Name) else getattr(expr, "attr", None)


def assigned(value, classes):
    """The classes an __init__'s assignment stores: those it makes (`Attention(config)`, `Block`
    in `nn.ModuleList(Block(config) ...)`) or a variable holds (`target`)."""
    made = {last_name(n.func) for n in ast.walk(value) if isinstance(n, ast.Call)}
    held = named(value.id, classes) if isinstance(value, ast.Name) else set()
    return (made & classes) | held


def pairs(node):
    """(target, value) of an assignment, `a, b = x, y` taken apart."""
    for t in node.targets:
        if isinstance(t, ast.Tuple) and isinstance(node.value, ast.Tuple):
            yield from zip(t.elts, node.value.elts)
        else:
            yield t, node.value


def init_attrs(init, classes):
    """{attribute: classes} from the `self.a = ...` statements of an __init__ (None: none)."""
    attrs = {}
    for node in (n for n in ast.walk(init) if isinstance(n, ast.Assign)) if init else ():
        for t, value in pairs(node):
            if isinstance(t, ast.Attribute) and last_name(t.value) == "self":
                attrs.setdefault(t.attr, set()).update(assigned(value, classes))
    return attrs


def read_code(root=ROOT):
    """The definitions of the core files, train.py and the harness files the step reaches, and
    what the walk needs to know of them."""
    defs, names, classes, parents, properties = {}, {"core": {}, "all": {}}, set(), {}, {}
    for module in CORE + HARNESS:
        with open(os.path.join(root, *([] if module in CORE else ["harness"]), f"{module}.py")) as f:
            tree = ast.parse(f.read())
        layers = [names["all"]] + ([names["core"]] if module in CORE else [])
        for node in tree.body:
            for qual, fn in members(module, node):
                defs[qual] = (module, fn)
                for by_name in layers:
                    by_name.setdefault(fn.name, []).append(qual)
                if module in CORE and any(last_name(d) == "property" for d in fn.decorator_list):
                    properties.setdefault(fn.name, []).append(qual)
            if isinstance(node, ast.ClassDef):
                classes.add(node.name)
                parents[node.name] = [b.id for b in node.bases if isinstance(b, ast.Name)]  # not nn.X
                if f"{node.name}.__init__" in defs:  # a call of a class reaches its __init__
                    for by_name in layers:
                        by_name.setdefault(node.name, []).append(f"{node.name}.__init__")
    attrs = {c: init_attrs(defs.get(f"{c}.__init__", (None, None))[1], classes) for c in classes}
    return Code(defs, names["core"], attrs, names["all"], parents, properties)


def holds(expr, here, code):
    """The core classes that an expression holds an instance of; `here`: the class whose method
    it is in (None in a function)."""
    if isinstance(expr, ast.Name):
        return {here} if expr.id == "self" and here else named(expr.id, code.attrs)
    if isinstance(expr, ast.Attribute):
        inner = holds(expr.value, here, code)
        return set().union(*(code.attrs[c].get(expr.attr, set()) for c in inner))
    return set()


def on_super(expr):
    """Whether `expr` is `super().f`."""
    inner = getattr(expr, "value", None)
    return isinstance(inner, ast.Call) and last_name(inner.func) == "super"


def callees(code, qual):
    """What a definition's calls reach, in the order they are written (see the docstring)."""
    module, fn = code.defs[qual]
    here = qual.split(".")[0] if qual.split(".")[0] in code.attrs else None
    in_core = module in CORE
    nodes = sorted((n for n in ast.walk(fn) if isinstance(n, (ast.Call, ast.Attribute))),
                   key=lambda n: (n.lineno, n.col_offset))
    called = {id(n.func) for n in nodes if isinstance(n, ast.Call)}
    out = []
    for node in nodes:
        if isinstance(node, ast.Attribute):  # a property read (`batch.batch_size`) runs it
            held = holds(node.value, here, code) if id(node) not in called else ()
            out += [q for q in code.properties.get(node.attr, []) if q.split(".")[0] in held]
            continue
        call, name = node, last_name(node.func)
        if name == "len":  # len(x) runs x's __len__
            out += code.by_name.get("__len__", [])
        if on_super(call.func):  # the parent's: torch's for the core, a harness class's own
            out += [f"{p}.{name}" for p in code.parents.get(here, []) if f"{p}.{name}" in code.defs]
            continue
        if last_name(getattr(call.func, "value", None)) == "task":  # the task's (tasks/): not followed
            continue
        out += (code.by_name if in_core else code.harness_by_name).get(name, [])
        out += SEAMS.get(name, []) if in_core else []
        held = sorted(holds(call.func, here, code))  # a module's forward; a harness object's __call__
        out += [f for c in held for f in (f"{c}.forward", f"{c}.__call__") if f in code.defs]
    return [q for q in out if q not in NOT_IN_A_DEFAULT_STEP]


def reached(code, start=START):
    """Every definition the walk reaches from `start`, in the order it first reaches them."""
    order, todo, seen = [], [start], set()
    while todo:
        qual = todo.pop(0)
        if qual not in seen:
            seen.add(qual)
            order.append(qual)
            todo = callees(code, qual) + todo  # depth first: its callees before its next sibling
    return order


def n_lines(node):
    return node.end_lineno - node.lineno + 1  # from its `def` to its last line


def rows(code):
    """[(names, counts, words)] in the order the step reaches them; SystemExit, naming the
    function, if the walk and ROWS disagree."""
    order = reached(code)
    where = {q: i for i, q in enumerate(order)}
    listed = [q for names, _ in ROWS.values() for q in names]
    twice = sorted({q for q in listed if listed.count(q) > 1})
    unnamed = [q for q in order if q not in listed]
    unreached = [q for q in listed if q not in where]
    problems = [f"{problem}: {', '.join(names)}" for problem, names in (
        ("ROWS name these more than once", twice),
        ("the step reaches these, no row of ROWS names them", unnamed),
        ("ROWS name these, the step does not reach them", unreached)) if names]
    if problems:
        raise SystemExit("harness/reading_path.py: " + "; ".join(problems) + " (edit ROWS there)")
    ranked = sorted(ROWS.items(), key=lambda r: (r[0] in HELPERS, where[r[1][0][0]]))
    ranked = [row for _, row in ranked]
    return [(names, [n_lines(code.defs[q][1]) for q in names], words) for names, words in ranked]


def cell(names):
    """`Class.a`, `.b`, `module.c`: a name that shares the one before it's prefix drops it."""
    out, prefix = [], None
    for q in names:
        head, _, tail = q.rpartition(".")
        out.append(f"`.{tail}`" if head == prefix else f"`{q}`")
        prefix = head
    return ", ".join(out)


def section(code):
    """The README's section: the sentence with the total, a blank line, the table."""
    table = rows(code)
    total = sum(sum(counts) for _, counts, _ in table)
    lines = SENTENCE.format(total=total).splitlines() + [
        "",
        "| # | function | lines | what it does |",
        "| --- | --- | --- | --- |",
    ]
    for i, (names, counts, words) in enumerate(table, 1):
        lines.append(f"| {i} | {cell(names)} | {' + '.join(map(str, counts))} | {words} |")
    return "\n".join(lines) + "\n"


def split_readme(text):
    """README.md's text -> (before, section, after): the section is the paragraph that starts with
    HEAD at a line's start, through the last line of the table under it."""
    m = re.search(r"^" + re.escape(HEAD), text, re.M)
    if not m:
        raise SystemExit(f"README.md has no paragraph starting with {HEAD}")
    lines = text[m.start():].splitlines(keepends=True)
    i = next((i for i, line in enumerate(lines) if line.startswith("|")), len(lines))
    while i < len(lines) and lines[i].startswith("|"):
        i += 1
    end = m.start() + sum(len(line) for line in lines[:i])
    return text[:m.start()], text[m.start():end], text[end:]


def read_table(section_text):
    """A section's table as written -> ([(names, counts)] per row, the total its sentence states);
    `.b` after `Class.a` is `Class.b`."""
    found = re.search(r"\(([\d,]+) lines", section_text)
    total = int(found.group(1).replace(",", "")) if found else None
    table = [line for line in section_text.splitlines() if line.startswith("|")][2:]
    out = []
    for line in table:
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        names, prefix = [], None
        for name in re.findall(r"`([\w.]+)`", cells[1]):
            name = prefix + name if name.startswith(".") else name
            prefix = name.rpartition(".")[0]
            names.append(name)
        out.append((names, [int(n) for n in re.findall(r"\d+", cells[2])]))
    return out, total


def read_readme(path=README):
    with open(path) as f:
        return f.read()


def trace(train_argv):
    """Run train.py (train.main(train_argv)) with every RL step under a profiler, and write the
    functions of the core and the harness that the steps called, as the walk names them, to
    <out-dir>/reached.<rank>.json: what a real step reached, to check the walk against
    (tests/test_readme.py does, on two ranks). A function nested in another counts as its."""
    import json
    import train
    seen, root = set(), ROOT + os.sep

    def profile(frame, event, arg):
        file = frame.f_code.co_filename
        name = frame.f_code.co_qualname.split(".<locals>")[0]  # a nested function: the one around it
        if event == "call" and file.startswith(root) and not name.startswith("<"):
            module = os.path.splitext(os.path.basename(file))[0]
            if module in CORE + HARNESS:
                seen.add(name if "." in name else f"{module}.{name}")

    def step(*args, **kwargs):
        sys.setprofile(profile)
        try:
            return rl_step(*args, **kwargs)
        finally:
            sys.setprofile(None)
            out = os.path.join(args[1].args.out_dir, f"reached.{args[1].rank}.json")
            with open(out, "w") as f:
                json.dump(sorted(seen), f)
    rl_step, train.rl_step = train.rl_step, step
    train.main(train_argv)


def main(argv=None):
    p = argparse.ArgumentParser(description="The README's path of one RL step, from the code.")
    what = p.add_mutually_exclusive_group()
    what.add_argument("--write", action="store_true", help="rewrite README.md's section")
    what.add_argument("--check", action="store_true", help="exit 1 if README.md's differs")
    what.add_argument("--trace", nargs=argparse.REMAINDER, metavar="TRAIN_FLAGS",
                      help="run train.py with these flags; write what each rank's steps called")
    args = p.parse_args(argv)
    if args.trace is not None:
        return trace(args.trace)
    new = section(read_code())
    if not (args.write or args.check):
        print(new, end="")
        return
    before, old, after = split_readme(read_readme())
    if args.check and old != new:
        sys.exit(f"README.md's path of one RL step is not the code's: run `{WRITE}`")
    if args.write and old != new:
        with open(README, "w") as f:
            f.write(before + new + after)
    print(f"README.md's path of one RL step: {'rewritten' if old != new else 'up to date'}")


if __name__ == "__main__":
    main()
