"""The README's reading table is true: each function or class it names is in the file it names,
with the line count it gives, and the rows sum to the total it states. (Which functions one step
reaches is the reader's to follow; the counts are the code's.)
"""
import ast
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def reading_section():
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    return text.split("## Reading order", 1)[1].split("\n## ", 1)[0]


def table_rows(section):
    """[(#, [(file, name)], [counts])] for each row of the table."""
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 4 or not cells[0].isdigit():
            continue
        names = []
        for part in cells[1].split(";"):
            file, listed = part.split(":", 1)
            names += [(file.strip(" `"), n.strip(" `")) for n in listed.split(",")]
        rows.append((int(cells[0]), names, [int(c) for c in cells[2].split("+")]))
    return rows


def definitions(path):
    """{name: lines} for a file's top-level functions and classes and its classes' methods."""
    with open(os.path.join(ROOT, path)) as f:
        tree = ast.parse(f.read())
    out = {}
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            out[node.name] = node.end_lineno - node.lineno + 1
        if isinstance(node, ast.ClassDef):
            for m in node.body:
                if isinstance(m, ast.FunctionDef):
                    out[f"{node.name}.{m.name}"] = m.end_lineno - m.lineno + 1
    return out


def test_the_reading_table_gives_each_named_definition_its_true_length_and_its_total():
    section = reading_section()
    rows = table_rows(section)
    assert len(rows) >= 10, "the README's reading table was not found"
    listed = [name for _, names, _ in rows for name in names]
    assert len(listed) == len(set(listed)), "a definition is listed twice"
    path_total = 0
    for number, names, counts in rows:
        assert len(names) == len(counts), f"row {number}: {len(names)} names, {len(counts)} counts"
        for (file, name), count in zip(names, counts):
            defs = definitions(file)
            assert name in defs, f"row {number}: {file} has no {name}"
            assert defs[name] == count, f"{file} {name}: the README says {count}, the code {defs[name]}"
        path_total += sum(counts)
    stated = re.search(r"\(([\d,]+) lines, docstrings and comments included\)", section)
    assert stated, "the reading section states no total"
    assert int(stated.group(1).replace(",", "")) == path_total


def test_the_readme_gives_each_core_file_its_true_length_and_the_core_its_total():
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    given = dict(re.findall(r"^\| `(\w+\.py)` \| (\d+) \|", text, flags=re.M))
    assert len(given) == 7, f"the README's table of the core and train.py: {sorted(given)}"
    for file, n in given.items():
        with open(os.path.join(ROOT, file)) as f:
            assert len(f.read().splitlines()) == int(n), f"{file}: the README says {n} lines"
    core = sum(int(n) for file, n in given.items() if file != "train.py")
    stated = re.search(r"six core files\s+\(([\d,]+) lines\)", text)
    assert stated and int(stated.group(1).replace(",", "")) == core
