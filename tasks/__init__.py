"""The tasks, and the one interface through which the rest of the project knows a task.

A task is the workload RL trains on: problems of a long-tailed size, their prompt and response
format, an in-process tokenizer (tiktoken, no download), a reward and a held-out set. Nothing
outside this folder knows a prompt's format, its tokens or its words: train.py builds the task
named by --task and hands the object to the rollout, the GRPO step, the warm-ups and the report.

A task is a frozen dataclass that subclasses `Task`. Its fields are its settings, and each field
is a train.py flag of the same name (`max_n` is --max-n), with its own help (`metadata={"help":
...}`) and default: two tasks that share a name each keep theirs. `__post_init__` checks them with
`self.check((name, ok, rule), ...)`, whose error names the flag (`--max-n must be in 1..26, got
30`), the one line train.py prints. What a task writes:

    name                        the --task name
    size_buckets                the held-out set's and the report's problem-size ranges
    encoding                    its tiktoken.Encoding, built in-process, with `<|eos|>`, `<|pad|>`
    problem(rng, size)          a random problem of `size`, an object with a `.size`
    prompt_ids(problem)         its prompt as token ids
    reward(problem, ids)        a float for a response's token ids, 1.0 right; partial credit is
                                fine (it moves the mean reward, not the accuracy); never raises
    warmup_example(problem, rng)    (token ids of prompt + response + <|eos|>, prompt length): a
                                    supervised warm-up trace
    response_len(size)          the longest response of a problem of `size`, <|eos|> included
    max_prompt_len              the longest prompt at max_n; with the longest response and draft,
                                the target's block (see the rules)
    parse(text)                 a user's prompt text -> a problem, or None (harness.sample)

Optional, with defaults here:

    correct(problem, ids)       whether a response is right: the share of right answers is what the
                                summary, the report and the evaluation call accuracy (default:
                                reward 1.0); the mean reward is reported as the mean reward

    choice, choice_share(problem, ids)   what RL is expected to move a response's choices toward, in
                                the summary's words, and its share among a response's choices (the
                                summary prints it first and last; None and 0.0: no such line)
    merges()                    (merged token, its parts) pairs, whose embeddings start as the parts'
                                (harness.warmup; see --merge-init)
    warmup_steps, rl_lr         what the task needs of the recipe: the target warm-up's steps and
                                the GRPO learning rate, the defaults of --warmup-steps and --rl-lr

`Task` gives every task the rest: problem sizes from a power law P(n) ~ n^-alpha on min_n..max_n
(the long tail), `sample`, `eval_set`, `decode`, `mean_by_size`, and the token ids. This module
gives the tokenizer: `make_encoding(name, merges, pat_str)` (byte-level ranks, the task's merged
strings, `<|eos|>` and `<|pad|>`) and `encode(enc, text)`.

Adding a task: one file in this folder with a `Task` subclass that has a `name`. The package
imports every module in this folder, and each such subclass registers itself in `TASKS`. The
rules a task meets (tests/test_tasks.py and the tiny run of every task in tests/test_train.py
check them):

    merged tokens   `pat_str` cuts text into pieces, and no merge crosses a piece. A piece that is a
                    merged string is that one token; inside a longer piece, BPE builds a merged
                    string only from merged parts of it listed before it ("=12" within "=123"
                    needs "=1" or "12").
    merges()        (merged id, [part ids]) pairs, any number of parts, whose texts spell the merged
                    token's; its embedding starts as their sum over sqrt(len(parts)).
    the long tail   over sampled sizes, the 90th percentile of `response_len` at least twice the
                    median: the rollout's tail comes from the problems.
    the block       the task's own: max_prompt_len + response_len(max_n) + the longest draft
                    (max of --draft-ks, 8), rounded up to a multiple of 64, is the target's block
                    (the running sum's 231 -> 256; at --max-n 4, 64); --block-size overrides it, and
                    one too small for that sum is a one-line error.
    the warm-up key `meta()`'s `traces`: a digest of prompts and warm-up traces drawn with a fixed
                    seed (8 problems of every size). Edit the reward, a docstring or a comment and
                    the cached warm-ups are reused (an RL checkpoint is not: `code`); edit what a
                    trace is and they are made afresh, the old kept under their own key.

Test: python -m pytest tests/test_tasks.py
"""
import hashlib
import importlib
import inspect
import pkgutil
import random
from dataclasses import asdict, dataclass, field, fields
from functools import cached_property
from typing import ClassVar

import tiktoken

EOS = "<|eos|>"
PAD = "<|pad|>"
TASKS = {}  # name -> Task subclass, filled as each task's class is defined (Task.__init_subclass__)


def make_encoding(name, merges=(), pat_str=r"\S|\s+"):
    """A tiktoken Encoding made in-process (no download): the 256 bytes, then each string of
    `merges` as one token (in order; `pat_str` decides where text may merge), then `<|eos|>` and
    `<|pad|>`."""
    ranks = {bytes([i]): i for i in range(256)}
    for merged in merges:
        ranks[merged.encode()] = len(ranks)
    return tiktoken.Encoding(name=name, pat_str=pat_str, mergeable_ranks=ranks,
                             special_tokens={EOS: len(ranks), PAD: len(ranks) + 1})


def encode(enc, text):
    return enc.encode(text, disallowed_special=())  # "<|eos|>" in user text stays plain bytes


@dataclass(frozen=True)
class Task:
    min_n: int = field(default=1, metadata={"help": "smallest problem size"})
    max_n: int = field(default=10, metadata={"help": "largest problem size"})
    alpha: float = field(default=0.5, metadata={
        "help": "tail exponent of the problem sizes, P(n) ~ n^-alpha (smaller: a heavier tail)"})

    name: ClassVar[str]
    choice: ClassVar[str] = None
    warmup_steps: ClassVar[int] = 2400  # --warmup-steps: supervised steps the target warm-up takes
    rl_lr: ClassVar[float] = 4e-4  # --rl-lr: the GRPO updates' learning rate
    size_buckets: ClassVar[tuple]  # inclusive ranges of problem size

    def __init_subclass__(cls, **kwargs):
        """A subclass that names itself is registered: `--task NAME` then trains on it."""
        super().__init_subclass__(**kwargs)
        if "name" in cls.__dict__:
            TASKS[cls.name] = cls

    def __post_init__(self):  # a NaN fails every rule
        self.check(("min_n", 1 <= self.min_n <= self.max_n, f"in 1..{self.max_n} (--max-n)"),
                   ("alpha", self.alpha >= 0, ">= 0"))

    def check(self, *rules):
        """(setting, ok, rule) triples: the first not ok raises ValueError naming the setting as its
        flag (`--max-n must be in 1..26, got 30`), the one line train.py prints for a bad flag."""
        for name, ok, rule in rules:
            if not ok:
                raise ValueError(f"--{name.replace('_', '-')} must be {rule}, got {getattr(self, name)}")

    # ------------------------------------------------------------------ tokens
    @cached_property
    def eos_id(self):
        return self.encoding.encode_single_token("<|eos|>")

    @cached_property
    def pad_id(self):
        return self.encoding.encode_single_token("<|pad|>")

    @property
    def vocab_size(self):
        return self.encoding.n_vocab

    def decode(self, ids):
        """Token ids -> text; stops at <|eos|>; never raises (bad bytes become U+FFFD)."""
        ids = list(ids) + [self.eos_id]  # a sentinel: cut at the first <|eos|>
        return self.encoding.decode([i for i in ids[: ids.index(self.eos_id)]
                                     if 0 <= i < self.vocab_size and i != self.pad_id])

    def merges(self):
        return []

    def choice_share(self, problem, response_ids):
        return 0.0

    def correct(self, problem, response_ids):
        """Whether the response is right: what accuracy counts. A reward that gives partial credit
        moves the mean reward, never this (override it where reward 1 is not the only right)."""
        return self.reward(problem, response_ids) == 1.0

    # ------------------------------------------------------------------ problems
    def sample(self, rng, size=None):
        """A problem of `size`, or of a size drawn from P(n) ~ n^-alpha on min_n..max_n (the tail)."""
        if size is None:
            sizes = range(self.min_n, self.max_n + 1)
            size = rng.choices(sizes, weights=[n ** -self.alpha for n in sizes])[0]
        return self.problem(rng, size)

    @property
    def max_response_len(self):
        return self.response_len(self.max_n)

    @property
    def max_seq_len(self):
        return self.max_prompt_len + self.max_response_len

    def buckets(self):
        """The size buckets within min_n..max_n, the first and the last cut there."""
        return [(max(lo, self.min_n), min(hi, self.max_n)) for lo, hi in self.size_buckets
                if lo <= self.max_n and hi >= self.min_n]

    def eval_set(self, per_bucket=40, seed=1234):
        """The fixed held-out set: `per_bucket` problems for each size bucket within max_n."""
        rng = random.Random(seed)
        return [self.sample(rng, rng.randint(lo, hi))
                for lo, hi in self.buckets() for _ in range(per_bucket)]

    def bucket_of(self, n):
        inside = (f"{lo}-{hi}" for lo, hi in self.size_buckets if lo <= n <= hi)
        return next(inside, f">{self.size_buckets[-1][1]}")

    def mean_by_size(self, problems, values):
        """-> {"overall": mean, "1-2": mean, ...} over the buckets present (of `correct`: accuracy)"""
        table = {"overall": list(values)}
        for p, v in zip(problems, values):
            table.setdefault(self.bucket_of(p.size), []).append(v)
        return {k: sum(v) / max(len(v), 1) for k, v in table.items()}

    def meta(self):
        """What this task's warm-ups read, as the warm-up cache's key (harness.warmup): its name, its
        settings and `traces`, a digest of the warm-up traces and RL prompts it writes. An edit of
        the reward, a docstring or a comment leaves the key as it is, and the cached warm-ups are
        reused; an edit that changes a trace, a prompt or a token is a fresh warm-up. `from_meta`
        makes the task again from it (harness.report)."""
        return {"name": self.name, **asdict(self), "traces": self.traces}

    @property
    def code(self):
        """sha256 of this task's module and of `Task`: what an RL run depends on beyond its traces
        (the reward), so that train.py never resumes a run after the task's code changed."""
        code = inspect.getsource(inspect.getmodule(type(self))) + inspect.getsource(Task)
        return hashlib.sha256(code.encode()).hexdigest()[:16]

    @cached_property
    def traces(self):
        """sha256 of what the warm-ups read, drawn with a fixed seed: 8 problems of every size, each
        one's prompt and a warm-up trace; 256 sizes as `sample` draws them; the merges, the special
        tokens and the longest response."""
        rng, h = random.Random(0), hashlib.sha256()
        for size in range(self.min_n, self.max_n + 1):
            for _ in range(8):
                problem = self.problem(rng, size)
                h.update(repr((self.prompt_ids(problem), self.warmup_example(problem, rng))).encode())
        h.update(repr([self.sample(rng).size for _ in range(256)]).encode())
        h.update(repr((self.merges(), self.eos_id, self.pad_id, self.vocab_size, self.max_response_len)).encode())
        return h.hexdigest()[:16]


# the registry: every module in this folder, imported; each Task subclass with a name registers itself
for module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{module.name}")


def from_meta(meta):
    """The task that `Task.meta` describes: its settings (its code is today's)."""
    if meta["name"] not in TASKS:
        raise ValueError(f"unknown task {meta['name']!r}; registered: {', '.join(TASKS)}")
    cls = TASKS[meta["name"]]
    return cls(**{f.name: tuple(v) if isinstance(v, list) else v
                  for f in fields(cls) if (v := meta.get(f.name)) is not None})
