"""The synthetic reasoning task: a running sum modulo 10, written in steps of a chosen size.

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
arithmetic that follows stays what it was. No jumps over two digits by default: RL learns to make
those right instead of writing more (RESULTS.md). The long tail: n follows a power law
P(n) ~ n^-alpha, and one prompt's samples differ in length by their choices. Simplified on purpose:
a tiktoken Encoding built in-process (no download), one merge per labelled digit, so that finding
digit b in the prompt is a single attention look-up.

Test: python -m pytest tests/test_task.py
"""
import enum
import random
import re
from dataclasses import dataclass

import tiktoken

LABELS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
EOS = "<|eos|>"
PAD = "<|pad|>"
SIZE_BUCKETS = ((1, 2), (3, 5), (6, 10), (11, 16), (17, 26), (27, 52))  # inclusive ranges of n


def build_tokenizer():
    """Byte-level ranks plus one merge per labelled digit, made in-process (no download)."""
    ranks = {bytes([i]): i for i in range(256)}
    for label in LABELS:
        for d in "0123456789":
            ranks[(label + d).encode()] = len(ranks)
    # the pattern merges "b7" only in the prompt's list
    return tiktoken.Encoding(name="runsum", pat_str=r"[a-zA-Z][0-9](?=[ :])|\S|\s+",
                             mergeable_ranks=ranks,
                             special_tokens={EOS: len(ranks), PAD: len(ranks) + 1})


ENC = build_tokenizer()
EOS_ID = ENC.encode_single_token(EOS)
PAD_ID = ENC.encode_single_token(PAD)
VOCAB_SIZE = ENC.n_vocab


def encode(text):
    return ENC.encode(text, disallowed_special=())  # "<|eos|>" in user text stays plain bytes


def decode(ids):
    """Token ids -> text; stops at <|eos|>; never raises (bad bytes become U+FFFD)."""
    ids = list(ids) + [EOS_ID]  # a sentinel: cut at the first <|eos|>
    return ENC.decode([i for i in ids[: ids.index(EOS_ID)] if 0 <= i < EOS_ID])


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
class TaskConfig:
    max_n: int = 10       # largest problem; at most len(LABELS)
    alpha: float = 0.5    # tail exponent of P(n) ~ n^-alpha (smaller: heavier tail)
    # warm-up traces: P(single step), P(jump of 2), P(jump of 3), P(the answer outright)
    strides: tuple = (0.40, 0.0, 0.55, 0.05)

    def __post_init__(self):  # NaN fails every rule
        for name, ok, rule in (("max_n", 1 <= self.max_n <= len(LABELS), f"in 1..{len(LABELS)}"),
                               ("alpha", self.alpha >= 0, ">= 0"),
                               ("strides", bool(self.strides) and self.strides[0] > 0
                                and all(p >= 0 for p in self.strides), "P(single) > 0, rest >= 0")):
            if not ok:
                raise ValueError(f"{name} must be {rule}, got {getattr(self, name)}")

    @property
    def max_prompt_len(self):
        return 2 * self.max_n

    @staticmethod
    def response_len(n):  # the longest response (single steps only), <|eos|> included
        return 9 * n + 3  # "b7=3+7=0 " is 9 tokens, ">1" 2, then <|eos|>

    @property
    def max_response_len(self):
        return self.response_len(self.max_n)

    @property
    def max_seq_len(self):
        return self.max_prompt_len + self.max_response_len


def sample_problem(rng, cfg, size=None):
    """A problem of `size` digits, or of a size drawn from P(n) ~ n^-alpha on 1..max_n."""
    if size is None:
        sizes = range(1, cfg.max_n + 1)
        size = rng.choices(sizes, weights=[n ** -cfg.alpha for n in sizes])[0]
    return Problem(tuple(rng.randrange(10) for _ in range(size)))


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


def eval_set(cfg, per_bucket=40, seed=1234):
    """The fixed held-out set: `per_bucket` problems for each size bucket within max_n."""
    rng = random.Random(seed)
    buckets = [(lo, min(hi, cfg.max_n)) for lo, hi in SIZE_BUCKETS if lo <= cfg.max_n]
    return [sample_problem(rng, cfg, rng.randint(lo, hi))
            for lo, hi in buckets for _ in range(per_bucket)]


def bucket_of(n):
    inside = (f"{lo}-{hi}" for lo, hi in SIZE_BUCKETS if lo <= n <= hi)
    return next(inside, f">{SIZE_BUCKETS[-1][1]}")


def mean_by_size(problems, values):
    """-> {"overall": mean, "1-2": mean, ...} over the buckets present (of rewards: accuracy)."""
    table = {"overall": list(values)}
    for p, v in zip(problems, values):
        table.setdefault(bucket_of(p.size), []).append(v)
    return {k: sum(v) / max(len(v), 1) for k, v in table.items()}


def training_example(problem, cfg=None, rng=None):
    """Token ids of prompt + response + <|eos|>, and where the response starts. Given a config and
    an rng, the response is a warm-up trace with its strides drawn; else single steps only."""
    response = problem.response() if cfg is None else problem.response(rng, cfg.strides)
    p, r = encode(problem.prompt()), encode(response) + [EOS_ID]
    return p + r, len(p)


def derive_seed(*parts):
    """A seed for any tuple of integers, such as (base seed, rank, step, purpose) (`Seed` says which
    order each stream uses): each random stream gets its own seed, and nothing reseeds the global
    generator inside a loop."""
    h = 0
    for x in parts:
        h = (h * 1_000_003 + int(x)) % (2 ** 61 - 1)
    return h


class Seed(enum.IntEnum):
    """What a derived seed is for: one stream each. Most are derive_seed(seed, rank, step, Seed.X);
    a row's key is derive_seed(seed, step, row, Seed.ROLLOUT_KEYS) or (seed, row, 0,
    Seed.EVAL_KEYS)."""
    TARGET_DATA = 1        # the target warm-up's warm-up traces
    DRAFTER_DATA = 2       # the drafter warm-up's prompts and batches
    DRAFTER_SAMPLES = 3    # the target's samples the drafter warms up on
    INIT = 4               # initial weights, the same on every rank
    BANDIT = 5             # the bandit's exploration
    RL_PROMPTS = 6         # each RL step's prompts, the same on every rank
    ROLLOUT = 7            # rollout sampling with --sampler rejection
    DRAFTER_TRAINING = 8   # idle-rank drafter batches
    EVAL = 9               # evaluation sampling with --sampler rejection
    ROLLOUT_KEYS = 10      # each rollout row's key with --sampler gumbel
    EVAL_KEYS = 11         # each evaluation row's key with --sampler gumbel
