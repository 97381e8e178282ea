"""The README's reading table is true: it names every function and method that one RL step reaches,
with the line count of each, and its rows sum to the total it states.

"Reaches" is decided mechanically, by name: starting from train.rl_step, a call `f(...)` or
`x.f(...)` reaches every function or method named f in the core files and train.py, and a call of a
class reaches its __init__; the task's own functions (task.py) are left out of the table. Calls of a
module object (`self.target(...)`) are not followed by name, so the table may name more than the
walk reaches (the forwards), but never less.
"""
import ast
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORE = ("task", "model", "drafter", "sampling", "speculative", "rollout", "scheduler", "rl", "train")


def definitions():
    """{qualified name: (file, ast node)}, qualified as `module.f` or `Class.method`, and
    {name: [qualified names]} for the walk."""
    defs, by_name = {}, {}
    for module in CORE:
        tree = ast.parse(open(os.path.join(ROOT, f"{module}.py")).read())
        for node in tree.body:
            members = [(f"{module}.{node.name}", node)] if isinstance(node, ast.FunctionDef) else []
            if isinstance(node, ast.ClassDef):
                members = [(f"{node.name}.{m.name}", m) for m in node.body if isinstance(m, ast.FunctionDef)]
            for qual, fn in members:
                defs[qual] = (module, fn)
                by_name.setdefault(fn.name, []).append(qual)
            if isinstance(node, ast.ClassDef) and f"{node.name}.__init__" in defs:
                by_name.setdefault(node.name, []).append(f"{node.name}.__init__")
    return defs, by_name


def reached(defs, by_name, start="train.rl_step"):
    """Every definition the walk reaches from `start`, in the order it reaches them."""
    order, todo = [], [start]
    while todo:
        qual = todo.pop(0)
        if qual in order:
            continue
        order.append(qual)
        for call in (n for n in ast.walk(defs[qual][1]) if isinstance(n, ast.Call)):
            f = call.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
            todo += by_name.get(name, [])
    return order


def n_lines(node):
    return node.end_lineno - node.lineno + 1  # from its `def` to its last line


def reading_table():
    """The README's table of the path: [(names, counts)] per row, and the total it states."""
    text = open(os.path.join(ROOT, "README.md")).read()
    total = int(re.search(r"\*\*The path of one RL step\*\*.*?\(([\d,]+) lines", text, re.S).group(1).replace(",", ""))
    lines = text[text.index("**The path of one RL step**"):].splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("|")) + 2  # past the header
    rows = []
    for line in lines[first:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        names, cls = [], None
        for name in re.findall(r"`([\w.]+)`", cells[1]):
            if name.startswith("."):  # a method of the class named before it
                name = cls + name
            cls = name.split(".")[0]
            names.append(name)
        rows.append((names, [int(n) for n in re.findall(r"\d+", cells[2])]))
    return rows, total


def test_the_reading_table_names_every_function_the_step_reaches_with_its_true_length():
    defs, by_name = definitions()
    rows, total = reading_table()
    listed = [name for names, _ in rows for name in names]
    assert len(listed) == len(set(listed)), "a function is listed twice"
    missing = [q for q in reached(defs, by_name) if defs[q][0] != "task" and q not in listed]
    assert not missing, f"the step reaches these, the table does not name them: {missing}"
    for names, counts in rows:
        assert len(names) == len(counts), (names, counts)
        for name, count in zip(names, counts):
            assert name in defs, f"{name} is not a core function"
            assert count == n_lines(defs[name][1]), f"{name}: the table says {count} lines, the code has {n_lines(defs[name][1])}"
    assert sum(c for _, counts in rows for c in counts) == total


def test_the_walk_follows_calls_by_name_and_leaves_out_what_no_call_reaches():
    """The walk itself: rl_step reaches the rollout and, through the RunningBatch's steps, both
    samplers' methods of the names it calls; it does not reach code that only a harness calls."""
    defs, by_name = definitions()
    order = reached(defs, by_name)
    assert order[0] == "train.rl_step"
    assert {"rollout.rollout", "RunningBatch.__init__", "RunningBatch.compact", "GumbelSampler.verify",
            "RejectionSampler.verify", "sampling.verify", "Drafter.propose"} <= set(order)
    assert "Bandit.state_dict" not in order and "speculative.autoregressive_generate" not in order
