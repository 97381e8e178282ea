"""The shell game, the default task in rounds (`ShellRounds`, below). A ball starts under cup A of
three cups, A, B and C; the prompt lists swaps of two cups; under which cup is the ball at the end?

    prompt:    aAB bBC cAC dAB eBC?
    response:  aAB=B bBC=C cAC=A >C<|eos|>

A step follows one swap: it writes the swap's label, copies the swap's two cups from the prompt and
writes where the ball is after it ("bBC=C": the ball was under B, cups B and C swap, now it is
under C). That is one attention look-up (the label "b" finds the prompt's merged token "bBC") and a
three-way rule on the ball's cup written just before (under one of the two cups, it moves to the
other; elsewhere it stays). The answer outright (">C", here after three of the five swaps) must
compose the swaps left in one forward pass: the order of the swaps matters (they are permutations,
and AB then BC is not BC then AB), and with swaps drawn at random the ball is under each cup with
probability 1/3 after any one of them, so an answer not computed is right one time in three.

The warm-up traces choose before every swap: the swap, or the answer outright (probability
`outright`), so that a trace of many swaps usually stops early, as base models answer quickly.
Rewarded only for the final answer, RL should shift the choice toward following every swap, so
that the responses lengthen, most on the longest problems. The choice is one token (the next label,
or ">"; in rounds, the round's number or ">"), so RL moves the target at that token while the steps
after it stay what they were.

Beside the running sum (tasks/running_sum.py), the same lesson in another dress: state tracking
rather than arithmetic, letters rather than digits, three characters merged per prompt item rather
than two, a flag of its own (--outright) for the warm-up's choice, and no jumps. (The running sum's
warm-up traces also jump over several items at once. Here a jump, "dAB=B" right after "bBC=C",
would be written as a step is, and RL's updates on its guessed cup spoiled the steps written the
same way: RESULTS.md.)

In rounds (--rounds growing), the swaps are followed again and again, round r following the first
r swaps, so a response grows with the square of the problem's size:

    prompt:    aAB bBC cAC *?
    response:  1:aAB=B 2:aAB=A bBC=A 3:aAB=B bBC=C cAC=A >A<|eos|>

A warm-up trace, with probability `outright`, answers outright before one of its rounds drawn
uniformly (before the first: at once); else it follows every round. So the traces keep many of the
long responses the target must learn to write, and RL moves the choice at a round's first token. (A
choice before each round, as before each swap, left too few long traces: the target copied late
swaps' cups wrong, and RL learned to answer early. And n rounds of all n swaps would give the answer
away: the n swaps make one permutation of three cups, which done n times over is itself, its
inverse or no move at all; for odd n itself (an odd number of swaps is a swap, of order 2), so the
ball ends where the first round left it. Trials of both are in RESULTS.md.)

Shortcuts (--shortcut s; 0, none, by default): a warm-up trace writes each step, with probability
s, as "b=C": a cup guessed uniformly, the swap's two cups not copied, which the steps after it go
on from. Rewarded for the answer, RL should learn to copy the cups instead, moving a token in every
step (the one after the label: "B" for "="), not one a trace or a round. A drafter warmed up and
frozen before RL drafts the copy there about as often as the traces wrote one (1 - s, with
exact-token sampling): with --shortcut 0.7 --rl-lr 3e-4 --drafter-warmup-steps 6000, it ends 21%
below one trained on idle ranks, at k = 4 on two RL seeds, while RL gains 21 and 27 points. RL pays
for it: a response that follows every swap is right beyond chance only if it guesses no step
(RESULTS.md).

Step credit (--step-credit c; 0, none, by default): the reward is (1 - c) for the answer and c
times the share of the problem's steps written, in order, with the ball's true cup; accuracy still
counts the answer alone. A guessed cup then costs RL at the step, not only through an answer that
a single guess can spoil, so RL can learn to copy even in rounds, where a response holds n(n+1)/2
steps (RESULTS.md).

The long tail: n follows a power law P(n) ~ n^-1 on 1..12, so most problems are a few swaps and a
few are many: a step's longest response is about three times its median (2.9, the median over the
steps of a `--task shell_game` run), and one prompt's samples differ in length by their choices.
Simplified on purpose: three cups (a guess is right a third of the time at any length), swaps drawn
uniformly from the three pairs, at most 26 swaps (a label a lower-case letter), and a tiktoken
Encoding built in-process (no download) with one merged token per labelled swap ("bBC"), so that
finding swap b is a single attention look-up.

Measured (the 2-core AMD EPYC VM; `OMP_NUM_THREADS=1 torchrun --standalone --nproc_per_node=2
train.py --task shell_game`, 800 RL steps, then `--rl-seed 2`): the warm-up target writes the ball's
cup right at every size (teacher-forced) and answers outright about as well as a guess beyond a few
swaps; RL moves the choice as designed (swaps written 85% -> 97% and 84% -> 99% of those needed),
held-out responses grow from 22.0 to 33.4 and 36.4 tokens sampled, and held-out accuracy sampled at
T=1 rises from 60.4% to 76.3% and 79.2% (3-5 swaps: 64.7% -> 98.8% and 97.2%). It gains least on
9-12 swaps (31.9% -> 37.2% and 46.9%), where the look-up of a swap's cups still slips. The designs
tried before this one, and why they failed, are in RESULTS.md.

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
    rounds: bool = False  # in rounds: round r follows the first r swaps; the prompt ends " *?"

    @property
    def size(self):
        return len(self.swaps)

    @property
    def steps(self):
        """Every swap in the order it is done: (round marker or "", label, cups)."""
        if not self.rounds:
            return [("", LABELS[i], pair) for i, pair in enumerate(self.swaps)]
        return [(f"{r}:" if i == 0 else "", LABELS[i], self.swaps[i])
                for r in range(1, self.size + 1) for i in range(r)]

    @property
    def balls(self):
        """Where the ball is after each step."""
        out, ball = [], START
        for _, _, pair in self.steps:
            ball = swap(ball, pair)
            out.append(ball)
        return out

    @property
    def answer(self):
        return self.balls[-1] if self.swaps else START

    def prompt(self):
        swaps = " ".join(LABELS[i] + pair for i, pair in enumerate(self.swaps))
        return swaps + (" *" if self.rounds else "") + "?"

    def response(self, rng=None, outright=0.0, shortcut=0.0):
        """The swaps followed one at a time, then the answer. Given an rng, a warm-up trace: before
        each swap, the answer outright instead with probability `outright`; in rounds, with
        probability `outright` the answer outright before a round drawn uniformly. And each step,
        with probability `shortcut`, a shortcut ("b=C"): a cup guessed uniformly, the swap's cups
        not copied, that the steps after it go on from. An answer outright is the true one; after
        the last step the answer is the last cup written, wrong if a guess made it so."""
        stop = rng.randint(1, self.size) if rng and self.rounds and rng.random() < outright else None
        steps, ball = [], START
        for marker, label, pair in self.steps:
            if marker == f"{stop}:" or (rng and not self.rounds and rng.random() < outright):
                return " ".join(steps + [f">{self.answer}"])
            if rng and shortcut and rng.random() < shortcut:
                ball = rng.choice(CUPS)
                steps.append(f"{marker}{label}={ball}")
            else:
                ball = swap(ball, pair)
                steps.append(f"{marker}{label}{pair}={ball}")
        return " ".join(steps + [f">{ball}"])


@dataclass(frozen=True)
class ShellGame(Task):
    """The shell game as a `Task` (tasks/__init__.py): its settings, each a train.py flag."""
    max_n: int = field(default=12, metadata={"help": f"largest problem (swaps), at most {len(LABELS)}"})
    alpha: float = field(default=1.0, metadata={
        "help": "tail exponent of the problem sizes, P(n) ~ n^-alpha (smaller: a heavier tail)"})
    outright: float = field(default=0.15, metadata={
        "help": "warm-up traces: the probability, before every swap, of the answer outright (>C) "
                "instead of the swap (bBC=C); in rounds, of the answer outright before a round drawn "
                "at random"})
    shortcut: float = field(default=0.0, metadata={
        "help": "warm-up traces: the probability, at every step, of a shortcut (b=C): a cup "
                "guessed uniformly, the swap's cups not copied, which the later steps go on from"})
    step_credit: float = field(default=0.0, metadata={
        "help": "the reward's weight on the steps: the share of the problem's steps written with "
                "the ball's true cup (the rest of the reward is the answer's)"})
    rounds: str = field(default="once", metadata={
        "help": 'the swaps followed once, or "growing": in rounds, round r following the first r '
                'swaps (n(n+1)/2 steps written: a response quadratic in the problem\'s size)'})

    name = "shell_game"
    size_buckets = SIZE_BUCKETS
    encoding = ENC

    def __post_init__(self):  # NaN fails every rule
        super().__post_init__()
        self.check(("max_n", 1 <= self.max_n <= len(LABELS), f"in 1..{len(LABELS)}"),
                   ("outright", 0 <= self.outright < 1, "in [0, 1)"),
                   ("shortcut", 0 <= self.shortcut < 1, "in [0, 1)"),
                   ("step_credit", 0 <= self.step_credit < 1, "in [0, 1)"),
                   ("rounds", self.rounds in ("once", "growing"), 'once or growing'))

    def problem(self, rng, size):
        return Problem(tuple(rng.choice(PAIRS) for _ in range(size)), self.rounds == "growing")

    def prompt_ids(self, problem):
        return encode(problem.prompt())

    def reward(self, problem, response_ids):
        """1.0 when the cup after the last '>' is the ball's, even after wrong steps (as with
        verifiable rewards), else 0.0; with --step-credit c, (1 - c) of that plus c times the share
        of the problem's steps written, in order, with the ball's true cup. Never raises."""
        try:
            text = self.decode(response_ids)
            right = float(answered(problem, text))
            if not self.step_credit:
                return right
            written = re.findall(r"([a-z])(?:[A-C]{2})?=([A-C])", text)
            true = [(label, ball) for (_, label, _), ball in zip(problem.steps, problem.balls)]
            steps = sum(w == t for w, t in zip(written, true)) / max(1, len(true))
            return (1 - self.step_credit) * right + self.step_credit * steps
        except Exception:  # the contract is "never raises"; a broken input is simply wrong
            return 0.0

    def correct(self, problem, response_ids):
        """Whether the cup after the last '>' is the ball's: the answer's part of the reward."""
        try:
            return answered(problem, self.decode(response_ids))
        except Exception:
            return False

    def warmup_example(self, problem, rng):
        response = problem.response(rng, self.outright, self.shortcut)
        p, r = encode(problem.prompt()), encode(response) + [EOS_ID]
        return p + r, len(p)

    def response_len(self, n):  # the longest response (every swap followed), <|eos|> included
        if self.rounds == "once":
            return 6 * n + 3  # every swap: "bBC=C " is 6 tokens, ">C" 2, then <|eos|>
        return 3 * n * (n + 1) + sum(len(str(r)) + 1 for r in range(1, n + 1)) + 3  # "12:" a round

    @property
    def max_prompt_len(self):  # a merged swap and a space (the last: "?") each; in rounds " *"
        return 2 * self.max_n + (0 if self.rounds == "once" else 2)

    @property
    def choice(self):
        return "rounds written" if self.rounds == "growing" else "swaps written"

    def choice_share(self, problem, response_ids):
        """The share of the problem's swaps (in rounds: of its rounds) that the response followed
        before its answer."""
        text = self.decode(response_ids)
        written = len(re.findall(r"\d+:" if problem.rounds else r"[a-z][A-C]{2}=", text))
        return min(1.0, written / problem.size)

    def parse(self, text):
        """A prompt of this task's kind (in rounds or once, as --rounds says), or None."""
        problem = parse_prompt(text)
        return problem if problem and problem.rounds == (self.rounds == "growing") else None

    def merges(self):
        """Each labelled swap "bBC" and its parts "b", "B" and "C": see harness.warmup's --merge-init."""
        one = ENC.encode_single_token
        return [(one(m), tuple(one(c) for c in m)) for m in MERGED]


def shell_game_field(name, default):
    """ShellGame's setting `name` (its flag's help) with another default."""
    return field(default=default, metadata=ShellGame.__dataclass_fields__[name].metadata)


@dataclass(frozen=True)
class ShellRounds(ShellGame):
    """The default task (--task shell_rounds): the shell game in growing rounds, at settings where
    its tail is a reasoning model's and RL still learns. A response is quadratic in the number of
    swaps: one swap is at most 11 tokens ("1:aAB=B >B"), six are at most 141 (21 steps). With sizes
    from P(n) ~ n^-1.5 on 1..6 most responses are short and a few long: the longest 5% hold about a
    quarter of RL's tokens, and a step's longest response is about 9x its median.
    - 3600 target warm-up steps: enough for the target to copy a swap's cups right through six
      rounds, so that RL can ask it to write them (at 2400 it is near chance at six swaps, and RL
      gains half as much); at eight swaps, 4800 did and 2400 did not.
    - outright 0.8: a warm-up trace answers outright before a round drawn at random 80% of the
      time, so RL has long responses to learn to write, most of them on the largest problems.
    - --rl-lr 2e-4: RL lengthens the responses over the whole run; at the running sum's 4e-4 it
      does so within about 50 steps.
    Measured in RESULTS.md."""
    max_n: int = shell_game_field("max_n", 6)
    alpha: float = shell_game_field("alpha", 1.5)
    outright: float = shell_game_field("outright", 0.8)
    rounds: str = shell_game_field("rounds", "growing")

    name = "shell_rounds"
    warmup_steps = 3600
    rl_lr = 2e-4


def answered(problem, text):
    """Whether the response text ends with the ball's cup after a '>'."""
    m = re.search(r">([A-C])\s*$", text)
    return m is not None and m.group(1) == problem.answer


def parse_prompt(prompt):
    """Prompt text ("aAB bBC?", labels a, b, c, ... in order; "aAB bBC *?": in rounds) -> Problem,
    or None. Never raises."""
    m = isinstance(prompt, str) and re.fullmatch(r"[a-z](AB|AC|BC)(?: [a-z](?:AB|AC|BC))*( \*)?\?", prompt)
    if not m:
        return None
    pairs = tuple(re.findall(r"[a-z](AB|AC|BC)", prompt))
    problem = Problem(pairs, m.group(2) is not None) if len(pairs) <= len(LABELS) else None
    return problem if problem is not None and problem.prompt() == prompt else None
