"""The synthetic reasoning task: a running sum modulo 10, worked step by step.

A problem is a list of n labelled digits; the answer is their sum modulo 10. The reference
response keeps a running sum, one step per digit, then states the answer (tokens shown by spaces below are real spaces):

    prompt:    a3 b7 c1:
    response:  a3=3 b7=0 c1=1 >1<|eos|>

Why this task. Every step is a small, checkable piece of reasoning (look a digit up by its label,
add it to the previous partial sum), so the scratchpad grows linearly with n (5 tokens a step) and
one wrong step spoils the answer: accuracy falls with problem size, as in real reasoning RL, and
a few minutes of CPU training leave room for RL to improve it. The labels make the look-up a
content match that a small model learns in minutes. Most tokens of a response are predictable
from what came before, which is also true of real reasoning traces and is what lets a drafter
guess several tokens ahead.

The long tail. n is drawn from a truncated power law P(n) ~ n^-alpha on 1..max_n, so most
responses are short and a few are very long (default: median 13 tokens, p90 58, p99 118, max 133).

Tokenizer. A tiktoken Encoding built in-process: byte-level ranks, one merge per labelled digit
("b7" is one token), and two special tokens, <|eos|> and <|pad|>. Nothing is downloaded. The
merges matter: with "b7" as one token, finding digit b is a single attention look-up (match the
label in the key), which a small model learns in minutes; with "b" and "7" apart it needs an
induction circuit across two layers, which took far longer than our CPU budget in trials.

Evaluation. A fixed held-out set, stratified by problem size (equal counts per size bucket), drawn
from its own seed; accuracy is reported per bucket and overall (the plain mean over the set).
Small problems have few distinct instances, so the set necessarily overlaps the training
distribution there; the large ones are practically never seen in training.

Test: python -m pytest tests/test_task.py
"""
import random
import re
from dataclasses import dataclass

import tiktoken

LABELS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ"
EOS = "<|eos|>"
PAD = "<|pad|>"
SIZE_BUCKETS = ((1, 2), (3, 5), (6, 10), (11, 16), (17, 26), (27, 52))  # inclusive ranges of n


def build_tokenizer():
    """Byte-level tiktoken Encoding plus one merge per labelled digit, made in-process (no download)."""
    ranks = {bytes([i]): i for i in range(256)}
    for label in LABELS:
        for d in "0123456789":
            ranks[(label + d).encode()] = len(ranks)
    return tiktoken.Encoding(
        name="runsum",
        pat_str=r"[a-zA-Z][0-9](?=[ :])|\S|\s+",  # merge "b7" only in the prompt's list
        mergeable_ranks=ranks,
        special_tokens={EOS: len(ranks), PAD: len(ranks) + 1},
    )


ENC = build_tokenizer()
EOS_ID = ENC.encode_single_token(EOS)
PAD_ID = ENC.encode_single_token(PAD)
VOCAB_SIZE = ENC.n_vocab


def encode(text):
    return ENC.encode(text, disallowed_special=())  # special-token text in user data stays plain bytes


def decode(ids):
    """Token ids -> text; stops at <|eos|>; never raises (bad bytes become U+FFFD)."""
    ids = list(ids)
    if EOS_ID in ids:
        ids = ids[: ids.index(EOS_ID)]
    return ENC.decode([i for i in ids if 0 <= i < EOS_ID])


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

    def response(self):
        steps, s = [], 0
        for i, d in enumerate(self.digits):
            s = (s + d) % 10
            steps.append(f"{LABELS[i]}{d}={s}")
        return " ".join(steps) + f" >{s}"


@dataclass(frozen=True)
class TaskConfig:
    max_n: int = 26       # largest problem; at most len(LABELS)
    alpha: float = 1.5    # tail exponent of P(n) ~ n^-alpha (smaller: heavier tail)

    def __post_init__(self):
        if not 1 <= self.max_n <= len(LABELS):
            raise ValueError(f"max_n must be in 1..{len(LABELS)}, got {self.max_n}")
        if self.alpha < 0:
            raise ValueError(f"alpha must be >= 0, got {self.alpha}")

    @property
    def max_prompt_len(self):
        return 2 * self.max_n

    @property
    def max_response_len(self):  # tokens, <|eos|> included
        return 5 * self.max_n + 3

    @property
    def max_seq_len(self):
        return self.max_prompt_len + self.max_response_len


def sample_size(rng, cfg):
    sizes = range(1, cfg.max_n + 1)
    return rng.choices(sizes, weights=[n ** -cfg.alpha for n in sizes])[0]


def sample_problem(rng, cfg, size=None):
    n = sample_size(rng, cfg) if size is None else size
    return Problem(tuple(rng.randrange(10) for _ in range(n)))


def parse_prompt(prompt):
    """Prompt text -> Problem, or None when it is not a well-formed prompt."""
    m = re.fullmatch(r"((?:[a-zA-Z][0-9] ?)+):", prompt)  # [0-9], not \d: ASCII digits only
    if m is None:
        return None
    return Problem(tuple(int(d) for d in re.findall(r"[a-zA-Z]([0-9])", m.group(1))))


def reward(prompt, response):
    """1.0 when the response's final answer (after the last '>') is correct, else 0.0.

    Only the final answer counts, as with verifiable rewards in reasoning RL: a wrong
    scratchpad with a lucky answer still scores. Garbage of any kind scores 0, never raises."""
    try:
        problem = parse_prompt(prompt)
        m = re.search(r">([0-9]+)\s*$", response)
        return float(problem is not None and m is not None and int(m.group(1)) == problem.answer)
    except Exception:  # the contract is "never raises"; a broken input is simply wrong
        return 0.0


def eval_set(cfg, per_bucket=40, seed=1234):
    """The fixed held-out set: `per_bucket` problems for each size bucket within max_n."""
    rng = random.Random(seed)
    problems = []
    for lo, hi in SIZE_BUCKETS:
        if lo > cfg.max_n:
            break
        problems += [sample_problem(rng, cfg, rng.randint(lo, min(hi, cfg.max_n))) for _ in range(per_bucket)]
    return problems


def bucket_of(n):
    for lo, hi in SIZE_BUCKETS:
        if lo <= n <= hi:
            return f"{lo}-{hi}"
    return f">{SIZE_BUCKETS[-1][1]}"


def accuracy_by_size(problems, rewards):
    """-> {"overall": acc, "1-2": acc, ...} over the buckets present."""
    table = {}
    for p, r in zip(problems, rewards):
        table.setdefault(bucket_of(p.size), []).append(r)
    out = {"overall": sum(rewards) / max(len(rewards), 1)}
    out.update({k: sum(v) / len(v) for k, v in table.items()})
    return out


def training_example(problem):
    """Token ids of prompt + response + <|eos|>, and where the response starts."""
    p, r = encode(problem.prompt()), encode(problem.response()) + [EOS_ID]
    return p + r, len(p)
