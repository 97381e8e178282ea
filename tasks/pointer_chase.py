"""The second task: pointer chasing, following a chain of links to its end, written in hops.

    prompt:    Eh Qd Yt Wa Zm Ce Uy Dz Ho Ak:q
    response:  -qd -dz -zm >m<|eos|>

The prompt lists links ("Qd": q links to d), shuffled, then the start. The real chain runs from the
start (q d z m); three distractor chains of 2 or 3 links each (w a k, c e h o, u y t) end elsewhere,
and no end is ruled out by one look-up back, so the real end cannot be told from the other three
without following the chain: answered outright, it is a guess among four ends. A single hop
("-dz") writes its kind, the letter it stands on and where that letter's link leads: the last token
is one attention look-up from the one before it, "d" looking for the link "Dz" (a link's start is
in capitals, so that "qd" and "dz" do not both match a look-up of "d"). A jump ("=dm") writes the
letter two hops ahead, two look-ups in one forward pass; the answer outright (">m") skips the rest.
Written steps should buy computation that one forward pass cannot do, as in the running sum, but
not yet here: the default target's warm-up does not learn the look-up (held-out accuracy 4-6% at
every size, below the 25% of a guess among the chain ends; four formats tried, RESULTS.md). The
task is here as the interface's second user: it trains, and TLT writes its tokens exactly.
The warm-up traces choose at every step, mostly jumps (as base models answer quickly), with single
hops common enough for RL to find them; rewarded only for the final answer, RL should shift the
choice toward single hops. The choice is one token
("-", "=" or ">"), so RL moves the target at those tokens while the look-up that follows stays what
it was. The long tail: n follows P(n) ~ n^-alpha, a single-hop response is 4n + 3 tokens (median 19,
p90 39 at the defaults), and one prompt's samples differ in length by their choices. Simplified on
purpose: 26 letters only, so a problem holds at most 26 of them and max_n is at most 13;
distractors have 2 or 3 links whatever n is (telling the real chain by its length takes following
it too); a tiktoken Encoding built in-process (no download), one merge per ordered pair of distinct
letters, so that finding the link from a letter is a single attention look-up.

Test: python -m pytest tests/test_pointer_chase.py
"""
import re
from dataclasses import dataclass, field

import tasks
from tasks import Task

LETTERS = "abcdefghijklmnopqrstuvwxyz"
PAIRS = [a.upper() + b for a in LETTERS for b in LETTERS if a != b]  # every possible link, "Qd"
DISTRACTORS = 3             # distractor chains per problem: four chain ends to guess among
DISTRACTOR_LINKS = (2, 3)   # links per distractor chain: at least 2, so no end gives itself away
# the letters left for the real chain once the longest distractors have theirs
MAX_N = len(LETTERS) - 1 - DISTRACTORS * (max(DISTRACTOR_LINKS) + 1)
SIZE_BUCKETS = ((1, 2), (3, 5), (6, 10), (11, MAX_N))  # inclusive ranges of n


def build_tokenizer():
    """Byte-level ranks plus one merge per link ("Qd"), made in-process (no download); the pattern
    merges "Qd" only in the prompt's list, where a space or the colon follows it."""
    return tasks.make_encoding("pointer_chase", PAIRS, pat_str=r"[A-Z][a-z](?=[ :])|\S|\s+")


ENC = build_tokenizer()
EOS_ID = ENC.encode_single_token(tasks.EOS)


def encode(text):
    return tasks.encode(ENC, text)


@dataclass(frozen=True)
class Problem:
    links: tuple  # "Qd": q links to d, in the prompt's order
    start: str

    @property
    def chain(self):
        """The letters from the start to its chain's end. At most one hop per link, so that a
        cycle (only in a hand-made problem; parse_prompt rejects them) ends the walk too."""
        after = {a.lower(): b for a, b in self.links}
        chain = [self.start]
        while chain[-1] in after and len(chain) <= len(self.links):
            chain.append(after[chain[-1]])
        return chain

    @property
    def size(self):
        return len(self.chain) - 1

    @property
    def answer(self):
        return self.chain[-1]

    def prompt(self):
        return " ".join(self.links) + ":" + self.start

    def response(self, rng=None, strides=(1.0, 0.0, 0.0)):
        """The walk in steps whose kind is drawn at every step from `strides`: P(single hop),
        P(jump of two hops), P(the answer outright). No rng: single hops only."""
        chain, steps, i = self.chain, [], 0
        while i < self.size:
            k = rng.choices(range(3), weights=strides)[0] if rng else 0
            if k == 2:  # the answer outright
                break
            here, i = chain[i], min(i + k + 1, self.size)  # a jump with one hop left: the end
            steps.append("-="[k] + here + chain[i])
        return " ".join(steps + [">" + self.answer])


@dataclass(frozen=True)
class PointerChase(Task):
    """Pointer chasing as a `Task` (tasks/__init__.py): its settings, each a train.py flag."""
    max_n: int = field(default=10, metadata={
        "help": f"largest problem (links to follow), at most {MAX_N}"})
    # warm-up traces: P(single hop), P(jump of two hops), P(the answer outright)
    strides: tuple = field(default=(0.40, 0.55, 0.05), metadata={
        "help": "warm-up traces: the probability, at every step, of a single hop (-dz), a jump "
                "of two hops (=dm), and of the answer outright (>m)"})

    name = "pointer_chase"
    choice = "single hops"
    size_buckets = SIZE_BUCKETS
    encoding = ENC

    def __post_init__(self):  # NaN fails every rule
        super().__post_init__()
        s = self.strides
        for name, ok, rule in (("max_n", 1 <= self.max_n <= MAX_N, f"in 1..{MAX_N}"),
                               ("strides", len(s) == 3 and s[0] > 0 and all(p >= 0 for p in s),
                                "three: P(single) > 0, P(jump) >= 0, P(outright) >= 0")):
            if not ok:
                raise ValueError(f"{name} must be {rule}, got {getattr(self, name)}")

    def problem(self, rng, size):
        """The real chain of `size` links and the distractors, on distinct random letters."""
        lengths = [size] + [rng.choice(DISTRACTOR_LINKS) for _ in range(DISTRACTORS)]
        letters = iter(rng.sample(LETTERS, sum(n + 1 for n in lengths)))
        chains = [[next(letters) for _ in range(n + 1)] for n in lengths]
        links = [a.upper() + b for c in chains for a, b in zip(c, c[1:])]
        rng.shuffle(links)  # in chain order, the end would be where the first chain stops
        return Problem(tuple(links), chains[0][0])

    def prompt_ids(self, problem):
        return encode(problem.prompt())

    def reward(self, problem, response_ids):
        """1.0 when the final answer (the letter after the last '>') ends the real chain, even
        after a wrong walk (as with verifiable rewards), else 0.0. Never raises."""
        try:
            m = re.search(r">([a-z])\s*$", self.decode(response_ids))
            return float(m is not None and m.group(1) == problem.answer)
        except Exception:  # the contract is "never raises"; a broken input is simply wrong
            return 0.0

    def warmup_example(self, problem, rng):
        p, r = encode(problem.prompt()), encode(problem.response(rng, self.strides)) + [EOS_ID]
        return p + r, len(p)

    @staticmethod
    def response_len(n):  # the longest response (single hops only), <|eos|> included
        return 4 * n + 3  # "-dz " is 4 tokens, ">m" 2, then <|eos|>

    @property
    def max_prompt_len(self):  # each link and the space or colon after it, then the start
        return 2 * (self.max_n + DISTRACTORS * max(DISTRACTOR_LINKS)) + 1

    def choice_share(self, problem, response_ids):
        return hop_share(self.decode(response_ids))

    def parse(self, text):
        return parse_prompt(text)

    def merges(self):
        """Each link "Qd" and its parts "Q" and "d": see harness.warmup's --merge-init."""
        one = ENC.encode_single_token
        return [(one(pair), (one(pair[0]), one(pair[1]))) for pair in PAIRS]


def parse_prompt(prompt):
    """Prompt text -> Problem, or None when it is not a well-formed prompt: links of two distinct
    letters, none starting where another starts, and a walk from the start that ends after one
    hop or more. Never raises."""
    m = isinstance(prompt, str) and re.fullmatch(r"((?:[A-Z][a-z] )*[A-Z][a-z]):([a-z])", prompt)
    if not m:
        return None
    links = tuple(m.group(1).split(" "))
    starts = {a.lower() for a, _ in links}
    if len(starts) < len(links) or any(a.lower() == b for a, b in links):
        return None
    problem = Problem(links, m.group(2))
    return problem if problem.size >= 1 and problem.answer not in starts else None


def hop_share(response):
    """The share of a response's written steps that are single hops ("-dz", not "=dm"; the answer
    ">m" is no step)."""
    steps = re.findall(r"([-=])[a-z]{2}", response)
    return steps.count("-") / len(steps) if steps else 0.0
