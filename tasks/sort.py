"""The second task: sort digits by adjacent swaps and count the swaps, written as passes of
odd-even transposition sort.

    prompt:    a3b7c1d5e2:
    response:  +a3b7c1d5e2=0-a3B1C7D2E5=2+A1B3C2D7e5=4-a1B2C3D5E7=6>6<|eos|>

The answer is the number of adjacent swaps that sort the list (its inversions: 3>1, 3>2, 7>1, 7>5,
7>2, 5>2), modulo 10. A pass swaps the adjacent pairs that are out of order, "+" pairing (a b)
(c d) ..., "-" pairing (b c) (d e) ..., the two alternating; it writes the whole list after it, a
moved digit's label in capitals, then the count so far ("=4"). Each labelled digit it writes is the
smaller or the larger of two digits of the list before it: two attention look-ups (the latest
tokens with those labels; one merged token per labelled digit) and a comparison; the count adds
half the capitals just written to the count before. The passes end when the list is sorted, at
most n of them, and ">" copies the last count. The answer outright (">" before the list is sorted)
must count the inversions left in one forward pass, which the target gets right about as often as
a guess, except on short or nearly sorted lists. (Where the answer was the sorted list itself, the
warm-up learned to answer outright: 92.6% of held-out problems sampled right before RL, nothing left
for RL to gain.) The warm-up traces choose after every unsorted list: another pass, or the answer
outright (`strides`), so that a trace of a long list usually stops early, as base models answer
quickly. Rewarded only for the final answer, RL should shift the choice toward writing the passes,
and the responses grow longest on the longest lists. The choice is one token ("+"/"-" or ">"), so
RL moves the target there while the passes stay what they were.

The long tail: the passes needed grow about as n, each n + 2 tokens, so a response grows as n^2
(the longest, n passes, n^2 + 2n + 3 tokens) where the running sum's grows as n; n follows
P(n) ~ n^-0.5 on 2..12, so that the RL mix holds enough long lists to learn from: responses of all
the passes have a median of 35 tokens, a p90 of 111 and a longest of 171. Simplified on purpose:
digits only (repeats allowed), lists of at most 26 (a label a letter), the count modulo 10, and a
tiktoken Encoding built in-process (no download) with one merge per labelled digit and per count,
so that reading a digit of the list before, or the count before, is a single attention look-up.

Measured (a 2-core AMD EPYC VM, one process, one thread; `OMP_NUM_THREADS=1 python train.py --task
sort --warmup-tokens 2048 --rl-steps 200`, the defaults of its day otherwise): RL moves the choice as expected (passes
written 85% -> 97% of those needed, held-out responses 35.8 -> 55.0 tokens sampled, 73.9 -> 118.8
on 10-12 digits), but held-out accuracy falls, 79.4% -> 57.5% greedy, 53.8% -> 49.1% sampled: the
passes get worse under RL. Not yet a task on which RL gains; the runs tried are in RESULTS.md.

Test: python -m pytest tests/test_sort.py
"""
import re
from dataclasses import dataclass, field

import tasks
from tasks import EOS, Task

LABELS = "abcdefghijklmnopqrstuvwxyz"  # a digit that a pass moved is written with its label in capitals
MARKS = "+-"  # a pass that pairs (a b) (c d) ..., and one that pairs (b c) (d e) ...
SIZE_BUCKETS = ((2, 3), (4, 6), (7, 9), (10, 12), (13, 26))  # inclusive ranges of n

MERGED = [label + d for label in LABELS + LABELS.upper() + "=" for d in "0123456789"]  # "b7", "B7", "=7": one token each
ENC = tasks.make_encoding("sort", MERGED, pat_str=r"[a-zA-Z=][0-9]|\S|\s+")
EOS_ID = ENC.encode_single_token(EOS)


def encode(text):
    return tasks.encode(ENC, text)


def transpose(digits, parity):
    """One pass of odd-even transposition sort: each pair (i, i + 1) with i % 2 == parity in order."""
    out = list(digits)
    for i in range(parity, len(out) - 1, 2):
        if out[i] > out[i + 1]:
            out[i], out[i + 1] = out[i + 1], out[i]
    return tuple(out)


def written(digits, before=None):
    """The list as labelled digits, a digit that moved from `before` with its label in capitals."""
    moved = [before is not None and d != b for d, b in zip(digits, before or digits)]
    return "".join(f"{LABELS[i].upper() if m else LABELS[i]}{d}" for i, (d, m) in enumerate(zip(digits, moved)))


@dataclass(frozen=True)
class Problem:
    digits: tuple

    @property
    def size(self):
        return len(self.digits)

    @property
    def answer(self):
        """The number of adjacent swaps that sort the list (its inversions), modulo 10."""
        n = self.size
        return str(sum(self.digits[i] > self.digits[j] for i in range(n) for j in range(i + 1, n)) % 10)

    @property
    def passes(self):
        """The lists after each pass, until the list is sorted (none when it already is)."""
        lists, now = [], self.digits
        while list(now) != sorted(now):
            now = transpose(now, len(lists) % 2)
            lists.append(now)
        return lists

    def prompt(self):
        return written(self.digits) + ":"

    def response(self, rng=None, strides=(1.0, 0.0)):
        """The passes, with the choice after every unsorted list drawn from `strides`: P(another pass),
        P(the answer outright). No rng: every pass."""
        steps, before, swaps = [], self.digits, 0
        for t, now in enumerate(self.passes):
            if rng and rng.choices((0, 1), weights=strides)[0] == 1:
                break
            swaps += sum(a != b for a, b in zip(now, before)) // 2
            steps.append(f"{MARKS[t % 2]}{written(now, before)}={swaps % 10}")
            before = now
        return "".join(steps) + ">" + self.answer


@dataclass(frozen=True)
class Sort(Task):
    """Sorting as a `Task` (tasks/__init__.py): its settings, each a train.py flag."""
    min_n: int = field(default=2, metadata={"help": "smallest problem size"})
    max_n: int = field(default=12, metadata={"help": f"largest problem (digits to sort), at most {len(LABELS)}"})
    alpha: float = field(default=0.5, metadata={
        "help": "tail exponent of the problem sizes, P(n) ~ n^-alpha (smaller: a heavier tail)"})
    strides: tuple = field(default=(0.9, 0.1), metadata={
        "help": "warm-up traces: after every unsorted list, the probability of another pass (+A1B3c7=1) "
                "and of the answer outright (>1)"})

    name = "sort"
    choice = "passes written"
    size_buckets = SIZE_BUCKETS
    encoding = ENC

    def __post_init__(self):  # NaN fails every rule
        super().__post_init__()
        s = self.strides
        for name, ok, rule in (("max_n", 1 <= self.max_n <= len(LABELS), f"in 1..{len(LABELS)}"),
                               ("strides", len(s) == 2 and s[0] > 0 and s[1] >= 0,
                                "two: P(another pass) > 0, P(the answer outright) >= 0")):
            if not ok:
                raise ValueError(f"{name} must be {rule}, got {getattr(self, name)}")

    def problem(self, rng, size):
        return Problem(tuple(rng.randrange(10) for _ in range(size)))

    def prompt_ids(self, problem):
        return encode(problem.prompt())

    def reward(self, problem, response_ids):
        """1.0 when the digit after the last '>' is the number of swaps modulo 10, even after wrong
        passes (as with verifiable rewards), else 0.0. Never raises."""
        try:
            m = re.search(r">([0-9]+)\s*$", self.decode(response_ids))
            return float(m is not None and m.group(1) == problem.answer)
        except Exception:  # the contract is "never raises"; a broken input is simply wrong
            return 0.0

    def warmup_example(self, problem, rng):
        p, r = encode(problem.prompt()), encode(problem.response(rng, self.strides)) + [EOS_ID]
        return p + r, len(p)

    @staticmethod
    def response_len(n):  # the longest response (n passes), <|eos|> included
        return n * (n + 2) + 3  # a pass is its mark, n labelled digits and "=6"; then ">", the count, <|eos|>

    @property
    def max_prompt_len(self):
        return self.max_n + 1

    def choice_share(self, problem, response_ids):
        """The share of the problem's passes that the response wrote (1.0 when none were needed)."""
        needed = len(problem.passes)
        text = self.decode(response_ids)
        return min(1.0, len(re.findall(r"[-+]", text.split(">")[0])) / needed) if needed else 1.0

    def parse(self, text):
        return parse_prompt(text)

    def merges(self):
        """Each labelled digit "b7" ("B7", "=7") and its parts "b" and "7": see harness.warmup's --merge-init."""
        one = ENC.encode_single_token
        return [(one(merged), (one(merged[0]), one(merged[1]))) for merged in MERGED]


def parse_prompt(prompt):
    """Prompt text ("a3b7c1:", lower-case labels in order) -> Problem, or None. Never raises."""
    m = isinstance(prompt, str) and re.fullmatch(r"((?:[a-z][0-9]){1,26}):", prompt)
    if not m:
        return None
    problem = Problem(tuple(int(d) for d in m.group(1)[1::2]))
    return problem if problem.prompt() == prompt else None
