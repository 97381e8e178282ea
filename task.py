"""The synthetic reasoning task: a running sum modulo 10, worked step by step.

    prompt:    a3 b7 c1:
    response:  a3=3 b7=0 c1=1 >1<|eos|>

Each step looks a digit up by its label and adds it, so one wrong step spoils the answer, and most
tokens follow from what came before, so a drafter can guess ahead. The long tail: n follows a
power law P(n) ~ n^-alpha, and a trace goes over the sum again (" | ") with probability `recheck`,
so one prompt's samples differ in length. Warm-up traces err per step with probability `noise`:
room for RL. Simplified on purpose: a tiktoken Encoding built in-process (no download), one merge
per labelled digit, so that finding digit b in the prompt is a single attention look-up.

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

    def response(self, rng=None, noise=0.0, careful=0.0):
        """One pass: the running sum step by step, then the answer. A step is written wrong with
        probability noise (the sum goes on from the written value, as a careless solver's would),
        in full ("b7=3+7=0") with probability careful, and then errs with a quarter of the noise."""
        steps, s = [], 0
        for i, d in enumerate(self.digits):
            prev, s = s, (s + d) % 10
            slow = careful and rng.random() < careful  # careful = 0 draws nothing
            if noise and rng.random() < (noise / 4 if slow else noise):
                s = (s + rng.randrange(1, 10)) % 10
            steps.append(f"{LABELS[i]}{d}={prev}+{d}={s}" if slow else f"{LABELS[i]}{d}={s}")
        return " ".join(steps) + f" >{s}"


def reference_response(problem, cfg, rng):
    """A training trace: passes (" | " between), one more with probability cfg.recheck."""
    passes = [problem.response(rng, cfg.noise, cfg.careful)]
    while len(passes) < cfg.max_passes and rng.random() < cfg.recheck:
        passes.append(problem.response(rng, cfg.noise, cfg.careful))
    return " | ".join(passes)


@dataclass(frozen=True)
class TaskConfig:
    max_n: int = 10       # largest problem; at most len(LABELS)
    alpha: float = 0.5    # tail exponent of P(n) ~ n^-alpha (smaller: heavier tail)
    recheck: float = 0.4  # reference traces: probability of one more re-check pass after an answer
    max_passes: int = 4   # reference traces: at most this many passes (the first plus re-checks)
    noise: float = 0.12   # reference traces: probability that a running-sum step is written wrong
    careful: float = 0.0  # reference traces: probability that a step is written out in full

    def __post_init__(self):  # NaN fails every rule
        for name, ok, rule in (("max_n", 1 <= self.max_n <= len(LABELS), f"in 1..{len(LABELS)}"),
                               ("alpha", self.alpha >= 0, ">= 0"),
                               ("recheck", 0 <= self.recheck < 1, "in [0, 1)"),
                               ("max_passes", self.max_passes >= 1, ">= 1"),
                               ("noise", 0 <= self.noise < 1, "in [0, 1)"),
                               ("careful", 0 <= self.careful <= 1, "in [0, 1]")):
            if not ok:
                raise ValueError(f"{name} must be {rule}, got {getattr(self, name)}")

    @property
    def max_prompt_len(self):
        return 2 * self.max_n

    def response_len(self, n, passes=1):  # the longest reference response, <|eos|> included
        step = 9 if self.careful else 5  # "b7=0 " or "b7=3+7=0 "
        return passes * (step * n + 5) - 2  # a pass: step * n + 2 tokens; " | " between; <|eos|>

    @property
    def max_response_len(self):  # tokens, <|eos|> included
        return self.response_len(self.max_n, self.max_passes)

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


def careful_share(response):
    """The share of a response's running-sum steps written out carefully ("b7=3+7=0")."""
    careful = len(re.findall(r"[a-zA-Z][0-9]=[0-9]\+[0-9]=[0-9]", response))
    terse = len(re.findall(r"[a-zA-Z][0-9]=[0-9](?![+0-9])", response))
    return careful / (careful + terse) if careful + terse else 0.0


def reward(prompt, response, careful_bonus=0.0):
    """1.0 when the final answer (after the last '>') is right, even after a wrong scratchpad (as
    with verifiable rewards), else 0.0; a right one earns careful_bonus times its share of careful
    steps on top, a format reward that makes RL change how the model writes. Never raises."""
    try:
        problem = parse_prompt(prompt)
        m = re.search(r">([0-9]+)\s*$", response)
        right = problem is not None and m is not None and int(m.group(1)) == problem.answer
        return float(right) * (1.0 + careful_bonus * careful_share(response))
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


def accuracy_by_size(problems, rewards):
    """-> {"overall": acc, "1-2": acc, ...} over the buckets present."""
    table = {"overall": list(rewards)}
    for p, r in zip(problems, rewards):
        table.setdefault(bucket_of(p.size), []).append(r)
    return {k: sum(v) / max(len(v), 1) for k, v in table.items()}


def training_example(problem, cfg=None, rng=None):
    """Token ids of prompt + response + <|eos|>, and where the response starts. Given a config and
    an rng, the response is a reference trace with its re-checks and noise; else the clean pass."""
    response = problem.response() if cfg is None else reference_response(problem, cfg, rng)
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
    TARGET_DATA = 1        # the target warm-up's reference traces
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
