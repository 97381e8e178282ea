"""A synthetic reasoning task: a running sum modulo 10, written in steps of a chosen size.

    prompt:    a3 b7 c1 d5 e2:
    response:  a3=0+3=3 d5=6 e2=6+2=8 >8<|eos|>

A single step ("e2=6+2=8") copies a digit and the sum so far and adds them: one easy addition per
written step. A jump ("d5=6") adds three digits at once and writes only the last one; the answer
outright (">8") skips the rest. After its warm-up the target gets a single step right 98% of the
time, a jump 12% (about chance): written steps buy computation that one forward pass cannot do, as
in reasoning models. The warm-up traces choose at every step, mostly jumps (as base models answer
quickly), with single steps common enough for RL to find them. Rewarded only for the final answer,
RL shifts the choice toward single steps, and the responses grow longest on the largest problems.
The choice is one token (the label, or ">"), so RL moves the target at those tokens while the
arithmetic that follows stays what it was. The default mix has jumps of three digits and none of
two: RL learns to make two-digit jumps right instead of writing more (RESULTS.md). The long tail:
n follows a power law P(n) ~ n^-1.5 on 1..20, so half the problems are one or two digits and one
in twenty has 11 or more: a step's longest response is several times its median, the rank that
holds it rolls out long after the other, and one prompt's samples differ in length by their
choices. Simplified on purpose: a tiktoken Encoding built in-process (no download), one merge per
labelled digit, so that finding digit b in the prompt is a single attention look-up.

Test: python -m pytest tests/test_running_sum.py
"""
import re
from dataclasses import dataclass, field

import tasks
from tasks import EOS, PAD, Task

LABELS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
SIZE_BUCKETS = ((1, 2), (3, 5), (6, 10), (11, 16), (17, 26), (27, 52))  # inclusive ranges of n


def build_tokenizer():
    """Byte-level ranks plus one merge per labelled digit, made in-process (no download); the
    pattern merges "b7" only in the prompt's list."""
    return tasks.make_encoding("runsum", [label + d for label in LABELS for d in "0123456789"],
                               pat_str=r"[a-zA-Z][0-9](?=[ :])|\S|\s+")


ENC = build_tokenizer()
EOS_ID = ENC.encode_single_token(EOS)
PAD_ID = ENC.encode_single_token(PAD)
VOCAB_SIZE = ENC.n_vocab


def encode(text):
    return tasks.encode(ENC, text)


@dataclass(frozen=True)
class Problem:
    digits: tuple

    @property
    def size(self):
        return len(self.digits)

    @property
    def answer(self):
        return sum(self.digits) % 10

    def prompt(self):
        return " ".join(f"{LABELS[i]}{d}" for i, d in enumerate(self.digits)) + ":"

    def response(self, rng=None, strides=(1.0,)):
        """The running sum in steps whose size is drawn at every step from `strides`: P(single
        step), P(jump of 2), P(jump of 3), ..., and last P(the answer outright). No rng: single
        steps only."""
        steps, s, i = [], 0, 0
        while i < self.size:
            k = rng.choices(range(len(strides)), weights=strides)[0] if rng else 0
            if k == len(strides) - 1 and k > 0:  # the answer outright
                break
            j = min(i + k, self.size - 1)  # the last digit this step adds
            prev, s = s, (s + sum(self.digits[i:j + 1])) % 10
            d = self.digits[j]
            steps.append(f"{LABELS[j]}{d}={prev}+{d}={s}" if j == i else f"{LABELS[j]}{d}={s}")
            i = j + 1
        return " ".join(steps + [f">{self.answer}"])


@dataclass(frozen=True)
class RunningSum(Task):
    """The running sum as a `Task` (tasks/__init__.py): its settings, each a train.py flag."""
    max_n: int = field(default=20, metadata={
        "help": f"largest problem (digits to sum), at most {len(LABELS)}"})
    alpha: float = field(default=1.5, metadata={
        "help": "tail exponent of the problem sizes, P(n) ~ n^-alpha (smaller: a heavier tail)"})
    # warm-up traces: P(single step), P(jump of 2), P(jump of 3), P(the answer outright)
    strides: tuple = field(default=(0.40, 0.0, 0.55, 0.05), metadata={
        "help": "warm-up traces: the probability, at every step, of a single step (b7=3+7=0), "
                "a jump over 2 digits (c1=1), over 3 (d5=6), ..., and last of the answer outright "
                "(>8)"})

    name = "running_sum"
    choice = "single steps"
    size_buckets = SIZE_BUCKETS
    encoding = ENC

    def __post_init__(self):  # NaN fails every rule
        super().__post_init__()
        self.check(("max_n", 1 <= self.max_n <= len(LABELS), f"in 1..{len(LABELS)}"),
                   ("strides", bool(self.strides) and self.strides[0] > 0 and all(p >= 0 for p in self.strides),
                    "P(single) > 0, rest >= 0"))

    def problem(self, rng, size):
        return Problem(tuple(rng.randrange(10) for _ in range(size)))

    def prompt_ids(self, problem):
        return encode(problem.prompt())

    def reward(self, problem, response_ids):
        return reward(problem.prompt(), self.decode(response_ids))

    def warmup_example(self, problem, rng):
        return training_example(problem, self, rng)

    @staticmethod
    def response_len(n):  # the longest response (single steps only), <|eos|> included
        return 9 * n + 3  # "b7=3+7=0 " is 9 tokens, ">1" 2, then <|eos|>

    @property
    def max_prompt_len(self):
        return 2 * self.max_n

    def choice_share(self, problem, response_ids):
        return single_share(self.decode(response_ids))

    def parse(self, text):
        return parse_prompt(text)

    def merges(self):
        """Each labelled digit "b7" and its parts "b" and "7": see harness.warmup's --merge-init."""
        one = ENC.encode_single_token
        return [(one(label + d), (one(label), one(d))) for label in LABELS for d in "0123456789"]


def parse_prompt(prompt):
    """Prompt text -> Problem, or None when it is not a well-formed prompt."""
    m = re.fullmatch(r"((?:[a-zA-Z][0-9] ?)+):", prompt)  # [0-9], not \d: ASCII digits only
    if m is None:
        return None
    return Problem(tuple(int(d) for d in re.findall(r"[a-zA-Z]([0-9])", m.group(1))))


def single_share(response):
    """The share of a response's steps written as single steps ("b7=3+7=0", not "d5=5" or ">1")."""
    singles = len(re.findall(r"[a-zA-Z][0-9]=[0-9]\+", response))
    steps = singles + len(re.findall(r"[a-zA-Z][0-9]=[0-9](?![+0-9])", response))
    return singles / steps if steps else 0.0


def reward(prompt, response):
    """1.0 when the final answer (after the last '>') is right, even after a wrong scratchpad (as
    with verifiable rewards), else 0.0. Never raises."""
    try:
        problem = parse_prompt(prompt)
        m = re.search(r">([0-9]+)\s*$", response)
        return float(problem is not None and m is not None and int(m.group(1)) == problem.answer)
    except Exception:  # the contract is "never raises"; a broken input is simply wrong
        return 0.0


def training_example(problem, cfg=None, rng=None):
    """Token ids of prompt + response + <|eos|>, and where the response starts. Given a config and
    an rng, the response is a warm-up trace with its strides drawn; else single steps only."""
    response = problem.response() if cfg is None else problem.response(rng, cfg.strides)
    p, r = encode(problem.prompt()), encode(response) + [EOS_ID]
    return p + r, len(p)
