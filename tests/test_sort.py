"""Tests for tasks/sort.py: the format and its merged tokens, the passes, the reward, parse, the bound
on the response length, the warm-up traces' choices and the settings' validation."""
import random
from collections import Counter

import numpy as np
import pytest

from tasks import TASKS
from tasks import sort as task
from tasks.sort import Problem, Sort

DEFAULT = Sort()
ALL_SIZES = Sort(min_n=1, max_n=len(task.LABELS))


def by_size(cfg, per_size, seed):
    rng = random.Random(seed)
    return [cfg.sample(rng, n) for n in range(cfg.min_n, cfg.max_n + 1) for _ in range(per_size)]


def ids_of(text):
    return task.encode(text)


# ----------------------------------------------------------------------------- format, tokens


def test_the_format_on_an_example():
    p = Problem((3, 7, 1, 5, 2))  # six inversions: 3>1, 3>2, 7>1, 7>5, 7>2, 5>2
    assert p.prompt() == "a3b7c1d5e2:" and p.answer == "6"
    assert p.response() == "+a3b7c1d5e2=0-a3B1C7D2E5=2+A1B3C2D7e5=4-a1B2C3D5E7=6>6"
    assert Problem((1, 2, 2)).response() == ">0"  # sorted already: no pass
    assert Problem((2, 1)).response() == "+A1B2=1>1"
    assert Problem(tuple(range(9, -1, -1))).answer == "5"  # 45 swaps, modulo 10
    assert TASKS["sort"] is Sort and DEFAULT.choice == "passes written"


def test_the_encoding_is_in_process_and_merges_every_labelled_digit(no_network):
    for p in by_size(ALL_SIZES, per_size=3, seed=1):
        prompt, response = p.prompt(), p.response()
        assert len(ids_of(prompt)) == p.size + 1  # one token a labelled digit, then ":"
        for passed in response.split(">")[0].replace("-", "+").split("+")[1:]:
            assert len(ids_of(passed)) == p.size + 1  # the labelled digits, then the count "=4"
        assert DEFAULT.decode(ids_of(prompt + response)) == prompt + response
    assert task.EOS_ID not in ids_of("<|eos|>") and DEFAULT.decode(ids_of("é ✓ <|pad|>")) == "é ✓ <|pad|>"


def test_the_tokens_do_not_depend_on_a_seed():
    """The same problem, prompt and trace give the same ids, whatever rng drew the problem: the
    encoding is fixed, made once in-process."""
    labels = task.LABELS + task.LABELS.upper() + "="
    a, b = task.ENC, __import__("tasks").make_encoding("sort", [c + d for c in labels for d in "0123456789"],
                                                        pat_str=r"[a-zA-Z=][0-9]|\S|\s+")
    for p in by_size(DEFAULT, per_size=5, seed=2):
        text = p.prompt() + p.response()
        assert a.encode(text) == b.encode(text)
    assert DEFAULT.prompt_ids(Problem((3, 7, 1))) == [ids_of("a3")[0], ids_of("b7")[0], ids_of("c1")[0], ord(":")]


def test_merges_start_from_their_parts():
    merges = DEFAULT.merges()
    assert len(merges) == 10 * (2 * len(task.LABELS) + 1)
    for merged, (label, digit) in merges:
        assert DEFAULT.decode([merged]) == DEFAULT.decode([label]) + DEFAULT.decode([digit])


# ----------------------------------------------------------------------------- passes


def test_the_passes_sort_in_at_most_n_and_each_is_one_transposition_round():
    """...and the count after the last pass is the answer: one adjacent swap undoes one inversion."""
    for p in by_size(ALL_SIZES, per_size=20, seed=3):
        lists = p.passes
        assert len(lists) <= p.size
        assert list(lists[-1] if lists else p.digits) == sorted(p.digits)
        before = p.digits
        for t, now in enumerate(lists):
            assert now == task.transpose(before, t % 2) and Counter(now) == Counter(p.digits)
            assert list(before) != sorted(before)  # no pass after the list is sorted
            before = now
        body = p.response().split(">")[0]
        assert body.endswith("=" + p.answer) if lists else body == ""


# ----------------------------------------------------------------------------- reward


def test_reward_is_right_on_the_examples():
    p = Problem((3, 7, 1, 5, 2))
    assert DEFAULT.reward(p, ids_of(p.response())) == 1.0
    assert DEFAULT.reward(p, ids_of(">6")) == 1.0  # the answer outright counts
    assert DEFAULT.reward(p, ids_of("+a9=1>6")) == 1.0  # only the final answer counts
    assert DEFAULT.reward(p, ids_of(">6") + [task.EOS_ID] + ids_of("junk")) == 1.0
    for wrong in (">5", ">16", ">06", ">12357", "6", ">6>1", "", ">", "+a1B2=6", ">6=6"):
        assert DEFAULT.reward(p, ids_of(wrong)) == 0.0, wrong
    for q in by_size(ALL_SIZES, per_size=5, seed=4):
        ids, plen = DEFAULT.warmup_example(q, random.Random(5))
        assert DEFAULT.reward(q, ids[plen:]) == 1.0  # a trace is never wrong: every error is the model's


def test_reward_never_raises():
    rng = random.Random(6)
    p = Problem((3, 7, 1))
    for _ in range(500):
        ids = [rng.randrange(-3, DEFAULT.vocab_size + 3) for _ in range(rng.randrange(0, 60))]
        assert DEFAULT.reward(p, ids) in (0.0, 1.0)
        assert 0.0 <= DEFAULT.choice_share(p, ids) <= 1.0
    for bad in (None, 1, "x", [None]):
        assert DEFAULT.reward(p, bad) == 0.0
    assert DEFAULT.reward(p, ids_of(">\uff12")) == 0.0  # fullwidth digits are no digits here (answer 2)
    assert DEFAULT.reward(p, ids_of(">2")) == 1.0


def test_choice_share_is_the_share_of_the_needed_passes_written():
    p = Problem((3, 7, 1, 5, 2))  # four passes needed
    share = lambda text: DEFAULT.choice_share(p, ids_of(text))  # noqa: E731
    assert share(p.response()) == 1.0 and share(">6") == 0.0
    assert share("+a3b7c1d5e2=0-a3B1C7D2E5=2>6") == 0.5
    assert share(p.response().split(">")[0] + "+a1b2c3d5e7=6>6") == 1.0  # never above 1
    assert DEFAULT.choice_share(Problem((1, 2)), ids_of(">0")) == 1.0  # nothing to write


# ----------------------------------------------------------------------------- parse


def test_parse_round_trips_and_rejects_what_is_no_problem():
    for p in by_size(ALL_SIZES, per_size=5, seed=7):
        assert DEFAULT.parse(p.prompt()) == p
    for text in ("", ":", "a3", "a3b7", "a3b7::", "b3a7:", "a3c7:", "a3 b7:", "a37:", "A3:", "a3b7:\n", " a3:",
                 "a\uff13:", None, 1, b"a3:", "".join(f"{c}1" for c in task.LABELS) + "a1:"):
        assert DEFAULT.parse(text) is None, repr(text)
    assert DEFAULT.parse("a3b7c1:") == Problem((3, 7, 1))


# ----------------------------------------------------------------------------- lengths


def test_response_len_bounds_the_longest_response_and_is_reached():
    reached = set()
    for p in by_size(ALL_SIZES, per_size=30, seed=8):
        n = len(ids_of(p.response())) + 1
        assert n <= ALL_SIZES.response_len(p.size)
        if n == ALL_SIZES.response_len(p.size):
            reached.add(p.size)
    assert len(reached) >= 10  # the bound is tight: n passes happen (30 random lists a size: 14 sizes)
    worst = Problem(tuple(range(9, -1, -1)))  # reversed: n passes
    assert len(ids_of(worst.response())) + 1 == DEFAULT.response_len(10)
    assert DEFAULT.max_seq_len + 8 <= 256  # the default --block-size, with the longest draft


def test_default_response_lengths_are_long_tailed():
    rng = random.Random(9)
    lengths = np.array([len(ids_of(DEFAULT.sample(rng).response())) + 1 for _ in range(5000)])
    med, p90 = np.percentile(lengths, [50, 90])
    assert p90 >= 2.5 * med, (med, p90)  # measured: 36, 111 (p99 157)


# ----------------------------------------------------------------------------- warm-up traces, settings


def test_warm_up_traces_draw_the_choice_after_every_unsorted_list():
    cfg = Sort(strides=(0.7, 0.3))
    rng = random.Random(10)
    seen = Counter()
    for _ in range(3000):
        p = cfg.sample(rng)
        r = p.response(rng, cfg.strides)
        body = r.split(">")[0]
        written = len(body.replace("-", "+").split("+")) - 1
        full = p.response().split(">")[0]  # every pass: the trace is its first passes, then the answer
        assert full.startswith(body) and full[len(body):len(body) + 1] in ("", *task.MARKS)
        assert r == body + ">" + p.answer
        seen["pass"] += written
        seen["outright"] += written < len(p.passes)
    share = seen["outright"] / (seen["pass"] + seen["outright"])
    assert abs(share - 0.3) < 0.02, seen  # thousands of choices: about 3 sigma


@pytest.mark.parametrize("kwargs", [dict(max_n=0), dict(max_n=27), dict(strides=(0.0, 1.0)), dict(strides=(1.0,)),
                                    dict(strides=(float("nan"), 0.5)), dict(strides=(0.5, -0.1)), dict(min_n=13)])
def test_bad_settings_are_refused(kwargs):
    with pytest.raises(ValueError):
        Sort(**kwargs)
