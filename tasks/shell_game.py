"""The second task: the shell game. A ball starts under cup A of three cups, A, B and C; the
prompt lists swaps of two cups; where is the ball at the end?

    prompt:    aAB bBC cAC dAB eBC?
    response:  aAB=B bBC=C dAB=B eBC=C >C<|eos|>

Every step writes a swap's label, copies the swap's two cups from the prompt and writes where the
ball is after it. A single swap ("bBC=C", the label after the one before) is one attention look-up
(the label "b" finds the prompt's merged token "bBC"), then a three-way rule on the ball's cup
written just before (under one of the two cups, it moves to the other; elsewhere it stays). A jump
("dAB=B", after "bBC=C") skips labels: it follows several swaps at once (here c and d) and writes
where the ball is after the last of them; the answer outright (">C") skips the rest.
A jump must compose several swaps in one forward pass, and with swaps drawn at random the ball is
under each cup with probability 1/3 after any one of them, so a jump that is not computed is a
guess, right one time in three. The warm-up traces choose at every step, mostly jumps of three
swaps (as base models answer quickly), with single swaps common enough for RL to find them.
Rewarded only for the final answer, RL should shift the choice toward single swaps, so that the
responses lengthen, most on the longest problems. The choice is one token (the next label, a
label further on, or ">"), so RL moves the target at that token while the swaps written after it
stay what they were.

Beside the running sum (tasks/running_sum.py), the same lesson in another dress: state tracking
rather than arithmetic (the ball's cup is a permutation of three cups applied one swap at a time,
which a transformer cannot compose over many swaps in one forward pass), letters rather than digits,
three characters merged per prompt item rather than two, and a question mark that ends the prompt.

The long tail: n follows a power law P(n) ~ n^-alpha on 1..20, so most problems are a few swaps
and a few are long: a step's longest response is several times its median, and one prompt's
samples differ in length by their choices. Simplified on purpose: three cups (so that a guess is
right a third of the time at any length), swaps drawn uniformly from the three pairs, at most 26
swaps (a label a lower-case letter), a tiktoken Encoding built in-process (no download) with one
merged token per labelled swap ("bBC"), so that finding swap b is a single attention look-up.

Test: python -m pytest tests/test_shell_game.py
"""
import re
from dataclasses import dataclass, field

import tasks
from tasks import EOS, Task

LABELS = "abcdefghijklmnopqrstuvwxyz"
CUPS = "ABC"
PAIRS = ("AB", "AC", "BC")  # a swap of two cups, written in alphabetical order
START = "A"  # the ball's cup before the first swap
SIZE_BUCKETS = ((1, 2), (3, 5), (6, 8), (9, 12), (13, 26))  # inclusive ranges of n

MERGED = [label + pair for label in LABELS for pair in PAIRS]  # "bBC": one token each
# the pattern merges "bBC" only in the prompt, where a space or "?" follows it; the response's
# "bBC=" stays three tokens, so that it copies the swap's cups one at a time
ENC = tasks.make_encoding("shell_game", MERGED, pat_str=r"[a-z][A-C]{2}(?=[ ?])|\S|\s+")
EOS_ID = ENC.encode_single_token(EOS)


def encode(text):
    return tasks.encode(ENC, text)


def swap(ball, pair):
    """Where the ball is after swapping the two cups of `pair`."""
    return pair[1] if ball == pair[0] else pair[0] if ball == pair[1] else ball


@dataclass(frozen=True)
class Problem:
    swaps: tuple  # e.g. ("AB", "BC"): the cups each swap exchanges

    @property
    def size(self):
        return len(self.swaps)

    @property
    def balls(self):
        """Where the ball is after each swap."""
        out, ball = [], START
        for pair in self.swaps:
            ball = swap(ball, pair)
            out.append(ball)
        return out

    @property
    def answer(self):
        return self.balls[-1] if self.swaps else START

    def prompt(self):
        return " ".join(LABELS[i] + pair for i, pair in enumerate(self.swaps)) + "?"

    def response(self, rng=None, strides=(1.0,)):
        """The swaps followed in steps whose size is drawn at every step from `strides`: P(single
        swap), P(jump of 2), P(jump of 3), ..., and last P(the answer outright). No rng: single
        swaps only."""
        steps, i = [], 0
        while i < self.size:
            k = rng.choices(range(len(strides)), weights=strides)[0] if rng else 0
            if k == len(strides) - 1 and k > 0:  # the answer outright
                break
            j = min(i + k, self.size - 1)  # the last swap this step follows
            steps.append(f"{LABELS[j]}{self.swaps[j]}={self.balls[j]}")
            i = j + 1
        return " ".join(steps + [f">{self.answer}"])


@dataclass(frozen=True)
class ShellGame(Task):
    """The shell game as a `Task` (tasks/__init__.py): its settings, each a train.py flag."""
    max_n: int = field(default=12, metadata={"help": f"largest problem (swaps), at most {len(LABELS)}"})
    alpha: float = field(default=1.0, metadata={
        "help": "tail exponent of the problem sizes, P(n) ~ n^-alpha (smaller: a heavier tail)"})
    # warm-up traces: P(single swap), P(jump of 2), P(jump of 3), P(the answer outright)
    strides: tuple = field(default=(0.60, 0.0, 0.35, 0.05), metadata={
        "help": "warm-up traces: the probability, at every step, of a single swap (bBC=C), a jump "
                "over 2 swaps (cAC=A), over 3 (dAB=B), ..., and last of the answer outright (>C)"})

    name = "shell_game"
    choice = "single swaps"
    size_buckets = SIZE_BUCKETS
    encoding = ENC

    def __post_init__(self):  # NaN fails every rule
        super().__post_init__()
        for name, ok, rule in (("max_n", 1 <= self.max_n <= len(LABELS), f"in 1..{len(LABELS)}"),
                               ("strides", bool(self.strides) and self.strides[0] > 0
                                and all(p >= 0 for p in self.strides), "P(single) > 0, rest >= 0")):
            if not ok:
                raise ValueError(f"{name} must be {rule}, got {getattr(self, name)}")

    def problem(self, rng, size):
        return Problem(tuple(rng.choice(PAIRS) for _ in range(size)))

    def prompt_ids(self, problem):
        return encode(problem.prompt())

    def reward(self, problem, response_ids):
        """1.0 when the cup after the last '>' is the ball's, even after wrong steps (as with
        verifiable rewards), else 0.0. Never raises."""
        try:
            m = re.search(r">([A-C])\s*$", self.decode(response_ids))
            return float(m is not None and m.group(1) == problem.answer)
        except Exception:  # the contract is "never raises"; a broken input is simply wrong
            return 0.0

    def warmup_example(self, problem, rng):
        p, r = encode(problem.prompt()), encode(problem.response(rng, self.strides)) + [EOS_ID]
        return p + r, len(p)

    @staticmethod
    def response_len(n):  # the longest response (single swaps only), <|eos|> included
        return 6 * n + 3  # "bBC=C " is 6 tokens, ">C" 2, then <|eos|>

    @property
    def max_prompt_len(self):
        return 2 * self.max_n  # a merged swap and a space (the last: "?") each

    def choice_share(self, problem, response_ids):
        return single_share(self.decode(response_ids))

    def parse(self, text):
        return parse_prompt(text)

    def merges(self):
        """Each labelled swap "bBC" and its parts "b", "B" and "C": see harness.warmup's --merge-init."""
        one = ENC.encode_single_token
        return [(one(m), tuple(one(c) for c in m)) for m in MERGED]


def single_share(response):
    """The share of a response's steps that are single swaps: a step whose label follows the one
    before ("aAB=B bBC=C", not "dAB=B" after "bBC=C", nor a first step other than "a")."""
    labels = [LABELS.index(x) for x in re.findall(r"([a-z])[A-C]{2}=", response)]
    singles = sum(now == before + 1 for before, now in zip([-1] + labels, labels))
    return singles / len(labels) if labels else 0.0


def parse_prompt(prompt):
    """Prompt text ("aAB bBC?", labels a, b, c, ... in order) -> Problem, or None. Never raises."""
    m = isinstance(prompt, str) and re.fullmatch(r"[a-z](AB|AC|BC)(?: [a-z](?:AB|AC|BC))*\?", prompt)
    if not m:
        return None
    pairs = tuple(re.findall(r"[a-z](AB|AC|BC)", prompt))
    problem = Problem(pairs) if len(pairs) <= len(LABELS) else None
    return problem if problem is not None and problem.prompt() == prompt else None
