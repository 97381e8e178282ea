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
responses are short and a few are very long; with re-checks (below), the default reference
responses have median 33 tokens, p90 98, p99 about 190, max 218.

Re-checks (TaskConfig.recheck, max_passes). A reference trace may, after its answer, go over the
whole sum again (" | " then a second pass and its answer), with probability `recheck` each time, up
to `max_passes` passes: "a3=3 b7=0 c1=1 >1 | a3=3 b7=0 c1=1 >1<|eos|>". A target trained on such
traces samples the stop-or-check-again choice itself, so the samples of one prompt differ in length
(1, 2, 3... passes, a geometric tail) as sampled reasoning does, and a batch thins out row by row,
not group by group. The reward still reads only the answer after the last '>'.

Noise (TaskConfig.noise). Each running-sum step of a reference trace is written wrong with this
probability (a random wrong digit; the sum goes on from the written value, so the answer is then
usually wrong). Cross-entropy teaches the target to err at about this rate per step when sampling
at temperature 1 while its greedy choice stays right: sampled accuracy is about (1 - noise)^n,
which leaves RL something to fix. Only the warm-up's traces are noisy: the held-out set and the
reward use the true answer.

Tokenizer. A tiktoken Encoding built in-process: byte-level ranks, one merge per labelled digit
("b7" is one token in the prompt; the response spells "b" "7" apart), and two special tokens, <|eos|> and <|pad|>. Nothing is downloaded. The
merges matter: with "b7" as one token, finding digit b is a single attention look-up (match the
label in the key), which a small model learns in minutes; with "b" and "7" apart it needs an
induction circuit across two layers, which took far longer than our CPU budget in trials.

Evaluation. A fixed held-out set, stratified by problem size (equal counts per size bucket), drawn
from its own seed; accuracy is reported per bucket and overall (the plain mean over the set).
Small problems have few distinct instances, so the set necessarily overlaps the training
distribution there; the large ones are practically never seen in training.

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

    def response(self, rng=None, noise=0.0, careful=0.0):
        """One pass: the running sum step by step, then the answer. With noise > 0, each step is
        written wrong with that probability (a uniformly drawn wrong digit) and the sum goes on
        from the written value, as a careless solver's would; the answer is the last written sum.
        With careful > 0, each step is written out with that probability ("b7=3+7=0": the previous
        sum, the digit, the new sum), and a careful step errs with a quarter of the noise."""
        steps, s = [], 0
        for i, d in enumerate(self.digits):
            prev, s = s, (s + d) % 10
            slow = careful and rng.random() < careful  # no draw at careful = 0: the default traces are unchanged
            if noise and rng.random() < (noise / 4 if slow else noise):
                s = (s + rng.randrange(1, 10)) % 10
            steps.append(f"{LABELS[i]}{d}={prev}+{d}={s}" if slow else f"{LABELS[i]}{d}={s}")
        return " ".join(steps) + f" >{s}"


def reference_response(problem, cfg, rng):
    """A training trace: the first pass, then with probability cfg.recheck one more full pass
    (" | " between passes), again and again up to cfg.max_passes; every pass recomputes from the
    prompt and carries its own cfg.noise."""
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
    careful: float = 0.0  # reference traces: probability that a step is written out carefully (a quarter of the noise)

    def __post_init__(self):
        if not 1 <= self.max_n <= len(LABELS):
            raise ValueError(f"max_n must be in 1..{len(LABELS)}, got {self.max_n}")
        if not self.alpha >= 0:  # NaN fails too
            raise ValueError(f"alpha must be >= 0, got {self.alpha}")
        if not 0 <= self.recheck < 1:
            raise ValueError(f"recheck must be in [0, 1), got {self.recheck}")
        if self.max_passes < 1:
            raise ValueError(f"max_passes must be >= 1, got {self.max_passes}")
        if not 0 <= self.noise < 1:
            raise ValueError(f"noise must be in [0, 1), got {self.noise}")
        if not 0 <= self.careful <= 1:
            raise ValueError(f"careful must be in [0, 1], got {self.careful}")

    @property
    def max_prompt_len(self):
        return 2 * self.max_n

    def response_len(self, n, passes=1):  # tokens of the longest reference response, <|eos|> included
        step = 9 if self.careful else 5  # "b7=0 " or "b7=3+7=0 "
        return passes * (step * n + 5) - 2  # each pass step * n + 2 tokens, " | " between passes, <|eos|>

    @property
    def max_response_len(self):  # tokens, <|eos|> included
        return self.response_len(self.max_n, self.max_passes)

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


def careful_share(response):
    """The share of a response's running-sum steps written out carefully ("b7=3+7=0")."""
    careful = len(re.findall(r"[a-zA-Z][0-9]=[0-9]\+[0-9]=[0-9]", response))
    terse = len(re.findall(r"[a-zA-Z][0-9]=[0-9](?![+0-9])", response))
    return careful / (careful + terse) if careful + terse else 0.0


def reward(prompt, response, careful_bonus=0.0):
    """1.0 when the response's final answer (after the last '>') is correct, else 0.0; a correct
    answer earns careful_bonus times the share of careful steps on top (a format reward, as
    R1-style RL pays for its format: it makes RL change how the model writes).

    Only the final answer counts, as with verifiable rewards in reasoning RL: a wrong
    scratchpad with a lucky answer still scores. Garbage of any kind scores 0, never raises."""
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


def training_example(problem, cfg=None, rng=None):
    """Token ids of prompt + response + <|eos|>, and where the response starts. Given a config and
    an rng, the response is a reference trace with its re-checks and noise; else the clean pass."""
    response = problem.response() if cfg is None else reference_response(problem, cfg, rng)
    p, r = encode(problem.prompt()), encode(response) + [EOS_ID]
    return p + r, len(p)


class Seed(enum.IntEnum):
    """What a derived seed is for (common.derive_seed(seed, rank or row, step, Seed.X)): each purpose of
    a run its own random stream; the numbers only keep them apart, so they are listed in one place.
    They live here because every part of a run that draws random numbers (the warm-ups, the RL steps,
    evaluation) imports this file, and most of what they draw is this task's data."""
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
