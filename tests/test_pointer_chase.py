"""Tests for tasks/pointer_chase.py: the in-process tokenizer and its link tokens, the lengths and
their bounds, the reward, the distractors, the warm-up traces, choice_share, parse, the long tail
and the settings' validation."""
import math
import random
from collections import Counter

import numpy as np
import pytest

from tasks import TASKS
from tasks import pointer_chase as pc
from tasks.pointer_chase import MAX_N, PointerChase, Problem

DEFAULT = PointerChase()
ALL_SIZES = PointerChase(max_n=MAX_N)


def by_size(task, per_size, seed):
    rng = random.Random(seed)
    return [task.problem(rng, n) for n in range(1, task.max_n + 1) for _ in range(per_size)]


def ids_of(text):
    return pc.encode(text) + [pc.EOS_ID]


def ends(problem):
    """The letters no link leaves: one per chain."""
    starts = {a.lower() for a, _ in problem.links}
    return {b for _, b in problem.links if b not in starts}


def walk(problem, response):
    """A trace -> the choice made at each step with hops left ("-", "=" or ">"), checking that
    every letter it writes is the right one."""
    chain, i, choices = problem.chain, 0, []
    steps = response.split(" ")
    for j, step in enumerate(steps):
        kind, letter = step[0], step[-1]
        if kind in "-=":  # it writes the letter it stands on, then where it goes
            assert len(step) == 3 and step[1] == chain[i], response
        if i < problem.size:
            choices.append(kind)
        if kind == ">":
            assert letter == problem.answer and j == len(steps) - 1, response
            return choices
        assert i < problem.size and kind in "-=", response
        i = min(i + (1 if kind == "-" else 2), problem.size)
        assert letter == chain[i], response
    raise AssertionError(f"no answer in {response!r}")


# ----------------------------------------------------------------------------- tokenizer


def test_build_tokenizer_is_in_process(no_network):
    enc = pc.build_tokenizer()
    text = "Eh Qd Yt Wa Zm Ce Uy Dz Ho Ak:q-qd -dz -zm >m"
    assert enc.decode(enc.encode(text)) == text
    assert enc.encode(text) == pc.encode(text)  # a fresh build gives the module's ids
    assert enc.n_vocab == DEFAULT.vocab_size == 256 + len(pc.PAIRS) + 2
    assert enc.encode_single_token("<|eos|>") == DEFAULT.eos_id == pc.EOS_ID
    assert enc.encode_single_token("<|pad|>") == DEFAULT.pad_id != DEFAULT.eos_id


def test_every_link_is_one_token_in_the_prompt():
    one = pc.ENC.encode_single_token
    for pair in pc.PAIRS:
        assert pc.encode(f"{pair} {pair}:a") == [one(pair), one(" "), one(pair), one(":"), one("a")]
    for p in by_size(ALL_SIZES, per_size=5, seed=1):
        ids = DEFAULT.prompt_ids(p)
        assert len(ids) == 2 * len(p.links) + 1
        assert [pc.ENC.decode([i]) for i in ids[0:-2:2]] == list(p.links)


def test_merges_pair_each_link_with_its_letters():
    merges = DEFAULT.merges()
    assert len({m for m, _ in merges}) == len(merges) == 26 * 25
    for merged, (a, b) in merges:
        assert pc.ENC.decode([merged]) == pc.ENC.decode([a]) + pc.ENC.decode([b])
        assert len(pc.ENC.decode([a])) == len(pc.ENC.decode([b])) == 1


def test_round_trips():
    rng = random.Random(2)
    texts = ["", " ", "ab  cd:e", "héllo ✓ 数字", "<|eos|>", "<|pad|>qd:q", "-d =m >m"]
    texts += ["".join(chr(rng.randrange(32, 127)) for _ in range(rng.randrange(1, 60)))
              for _ in range(200)]
    for p in by_size(ALL_SIZES, per_size=10, seed=3):
        prompt, response = p.prompt(), p.response(rng, (0.4, 0.4, 0.2))
        assert pc.encode(prompt + response) == pc.encode(prompt) + pc.encode(response)
        texts += [prompt, response, p.response()]
    for text in texts:
        assert DEFAULT.decode(pc.encode(text)) == text, repr(text)
    assert pc.EOS_ID not in pc.encode("<|eos|>")  # special-token text in data stays bytes


# ----------------------------------------------------------------------------- lengths


@pytest.mark.parametrize("task", [DEFAULT, ALL_SIZES], ids=["default", f"max_n={MAX_N}"])
def test_lengths_stay_within_their_bounds_at_every_size(task):
    rng = random.Random(4)
    for n in range(1, task.max_n + 1):
        problems = [task.problem(rng, n) for _ in range(40)]
        assert {p.size for p in problems} == {n}
        prompts = [len(task.prompt_ids(p)) for p in problems]
        assert max(prompts) <= task.max_prompt_len
        for p in problems:
            assert len(ids_of(p.response())) == task.response_len(n)  # single hops: the longest
            ids, plen = task.warmup_example(p, rng)
            assert len(ids) - plen <= task.response_len(n)
    assert max(prompts) == task.max_prompt_len  # the bound is met at max_n: it is tight
    assert task.max_seq_len == task.max_prompt_len + task.max_response_len
    assert DEFAULT.max_seq_len <= 200  # room in a block of 256 for 8 drafted positions and more


# ----------------------------------------------------------------------------- reward


def test_reward_is_one_for_the_reference_and_a_right_outright_answer():
    for p in by_size(ALL_SIZES, per_size=10, seed=5):
        ref = p.response()
        assert DEFAULT.reward(p, ids_of(ref)) == 1.0, (p.prompt(), ref)
        assert DEFAULT.reward(p, ids_of(f">{p.answer}")) == 1.0
        assert DEFAULT.reward(p, ids_of(f">{p.answer}")[:-1]) == 1.0  # cut at the budget
        head = ref[: ref.rindex(">") + 1]
        for wrong in pc.LETTERS.replace(p.answer, ""):
            assert DEFAULT.reward(p, ids_of(head + wrong)) == 0.0, (p.prompt(), head + wrong)
        assert DEFAULT.reward(p, ids_of(ref[: ref.rindex(">")])) == 0.0  # no final answer
        assert DEFAULT.reward(p, ids_of(ref + "x")) == 0.0
        assert DEFAULT.reward(p, ids_of(ref + ">" + ref[-1])) == 1.0  # the last '>' counts


def test_reward_is_zero_for_garbage_and_never_raises():
    rng = random.Random(6)
    p = DEFAULT.parse("Eh Qd Yt Wa Zm Ce Uy Dz Ho Ak:q")  # its end: m
    garbage = ["", " ", ">", ">>", "> m", ">mm", ">M", ">m>", "m", "-m", "=m", ">ｍ", ">\u200bm",
               ">m" + "\u200b", "<|eos|>", "<|pad|>", ">" + "m" * 5000]
    garbage += [bytes(rng.randrange(256) for _ in range(rng.randrange(1, 60))).decode(
        "utf-8", "replace") for _ in range(200)]
    for text in garbage:
        assert DEFAULT.reward(p, ids_of(text)) == 0.0, repr(text[:60])
    for ids in (None, [None], ["m"], [1.5], 7, [-1, 10 ** 9] + ids_of(">k"),
                [pc.EOS_ID] + ids_of(">m")):
        assert DEFAULT.reward(p, ids) == 0.0, ids
    assert DEFAULT.reward(None, ids_of(">m")) == 0.0 and DEFAULT.reward("m", ids_of(">m")) == 0.0
    assert DEFAULT.reward(p, [-1, 10 ** 9, DEFAULT.pad_id] + ids_of(">m")) == 1.0  # skipped ids


def test_reward_on_random_ids_never_raises():
    rng = random.Random(7)
    problems = by_size(DEFAULT, per_size=4, seed=7)
    rewards = Counter()
    for i in range(1000):
        ids = [rng.randrange(DEFAULT.vocab_size) for _ in range(rng.randrange(0, 80))]
        rewards[DEFAULT.reward(problems[i % len(problems)], ids)] += 1
    assert set(rewards) <= {0.0, 1.0} and rewards[1.0] < 20  # random ids almost never answer


# ----------------------------------------------------------------------------- distractors


def test_every_prompt_has_several_chain_ends_none_given_away():
    for p in by_size(ALL_SIZES, per_size=30, seed=8):
        letters = [c.lower() for link in p.links for c in link]
        assert all(a.lower() != b for a, b in p.links) and p.start not in {b for _, b in p.links}
        assert len(set(letters)) == len(p.links) + 4  # distinct letters in 4 chains
        assert p.answer in ends(p) and len(ends(p)) == 4  # the docstring's "four ends"
        before = {b: a.lower() for a, b in p.links}
        if p.size >= 2:  # one look-up back from any end never reaches a chain start
            assert all(before[e] in before for e in ends(p)), p.prompt()


def test_a_guess_without_following_is_right_about_once_in_four():
    rng = random.Random(9)
    problems = [DEFAULT.sample(rng) for _ in range(4000)]
    into = [{b: i for i, (_, b) in enumerate(p.links)} for p in problems]  # where each end is
    guesses = {"first in the prompt": [min(ends(p), key=w.get) for p, w in zip(problems, into)],
               "last in the prompt": [max(ends(p), key=w.get) for p, w in zip(problems, into)],
               "first in the alphabet": [min(ends(p)) for p in problems]}
    for name, guess in guesses.items():
        hits = sum(g == p.answer for g, p in zip(guess, problems)) / len(problems)
        assert abs(hits - 1 / 4) < 0.03, (name, hits)  # chance among 4 ends; 4,000: 4 sigma


# ----------------------------------------------------------------------------- warm-up traces


@pytest.mark.parametrize("strides", [DEFAULT.strides, (0.3, 0.5, 0.2)])
def test_warm_up_traces_choose_at_every_step_and_write_the_right_letters(strides):
    task = PointerChase(strides=strides)
    rng = random.Random(10)
    seen, mixed = Counter(), 0
    for _ in range(3000):
        p = task.sample(rng)
        ids, plen = task.warmup_example(p, rng)
        assert ids[:plen] == task.prompt_ids(p) and ids.index(pc.EOS_ID) == len(ids) - 1
        choices = walk(p, task.decode(ids[plen:]))
        seen.update(choices)
        mixed += {"-", "="} <= set(choices)
        assert task.reward(p, ids[plen:]) == 1.0  # every error is the model's
    total = sum(seen.values())
    for kind, want in zip("-=>", strides):
        sigma = math.sqrt(want * (1 - want) / total)
        assert abs(seen[kind] / total - want) < 4 * sigma, (kind, seen)
    assert mixed > 300  # drawn at every step, not once a trace: one response mixes them


def test_single_hops_only_without_an_rng():
    for p in by_size(ALL_SIZES, per_size=3, seed=11):
        assert walk(p, p.response()) == ["-"] * p.size
        assert DEFAULT.choice_share(p, ids_of(p.response())) == 1.0
    p = DEFAULT.parse("Eh Qd Yt Wa Zm Ce Uy Dz Ho Ak:q")
    assert p.response() == "-qd -dz -zm >m"  # the module docstring's example
    assert p.response(random.Random(0), (0.0, 1.0, 0.0)) == "=qz =zm >m"  # the last jump: 1 hop


def test_choice_share_counts_the_single_hops_among_the_written_steps():
    share = lambda ids: DEFAULT.choice_share(None, ids)  # noqa: E731  (the response alone decides it)
    assert share(ids_of("-qd =dm >m")) == 0.5 and share(ids_of("-qd -dz =zm >m")) == pytest.approx(2 / 3)
    assert share(ids_of("=qz =zm >m")) == 0.0 and share(ids_of("-qd -dz -zm >m")) == 1.0
    assert share(ids_of(">m")) == 0.0 and share(ids_of("")) == 0.0
    assert share(ids_of("-qd =dz") + ids_of("-zm -mk")) == 0.5  # nothing after <|eos|> counts


# ----------------------------------------------------------------------------- parse


def test_parse_round_trips_and_rejects_what_is_no_problem():
    task = TASKS["pointer_chase"]()
    for p in by_size(ALL_SIZES, per_size=10, seed=12):
        assert task.parse(p.prompt()) == p
    rejected = ["", ":", "Ab", "Ab:", "Ab:c", "Ab:b", "Ab Ba:a", "Ab Bc Ca:a", "Ab Ac:a", "Aa:a",
                "Ab  Bc:a", "Ab Bc:a\n", " Ab:a", "AB:a", "Ab:A", "Abc:a", "A-b:a", "Ab,Bc:a", "ab:a",
                "ab bc:a", None, 123, b"Ab:a", ["Ab:a"]]
    for text in rejected:
        assert task.parse(text) is None, repr(text)
    assert task.parse("Ac Bc:a") == Problem(("Ac", "Bc"), "a")  # two links into c: still one walk
    assert task.parse("Ab Bc Cd:b").size == 2
    rng = random.Random(13)
    for _ in range(500):
        text = "".join(rng.choice("aAbBcCz :-\n>") for _ in range(rng.randrange(0, 30)))
        p = task.parse(text)
        assert p is None or (p.size >= 1 and p.prompt() == text)


def test_a_hand_made_cycle_still_ends():
    p = Problem(("Ab", "Bc", "Ca"), "a")  # parse rejects it; the walk must stop anyway
    assert p.size <= 3 and DEFAULT.reward(p, ids_of(">a")) in (0.0, 1.0)


# ----------------------------------------------------------------------------- long tail


def test_single_hop_response_lengths_are_long_tailed():
    rng = random.Random(0)
    lengths = np.array([len(ids_of(DEFAULT.sample(rng).response())) for _ in range(2000)])
    med, p90, p99 = np.percentile(lengths, [50, 90, 99])
    print(f"\nsingle-hop response tokens (eos included), defaults, n=2000: "
          f"median {med:.0f}, p90 {p90:.0f}, p99 {p99:.0f}, max {lengths.max()}")
    assert p90 >= 2 * med, (med, p90)
    assert lengths.max() <= DEFAULT.max_response_len


# ----------------------------------------------------------------------------- settings


@pytest.mark.parametrize("max_n", [0, -1, MAX_N + 1, 100, float("nan")])
def test_max_n_out_of_range_is_rejected(max_n):
    with pytest.raises(ValueError, match="max_n"):
        PointerChase(max_n=max_n)


def test_max_n_at_the_limit_fits_the_alphabet():
    task = PointerChase(max_n=MAX_N)
    assert PointerChase(max_n=1).max_n == 1 and task.max_n == MAX_N
    assert all(task.problem(random.Random(s), MAX_N).size == MAX_N for s in range(200))
    with pytest.raises(ValueError):  # one more link does not always fit
        [task.problem(random.Random(s), MAX_N + 1) for s in range(200)]


@pytest.mark.parametrize("strides", [(), (0.4, 0.6), (0.4, 0.5, 0.05, 0.05), (0.0, 1.0, 0.0),
                                     (-0.1, 0.6, 0.5), (float("nan"), 0.5, 0.5),
                                     (0.5, float("nan"), 0.5)])
def test_bad_strides_are_rejected(strides):
    with pytest.raises(ValueError, match="strides"):
        PointerChase(strides=strides)


def test_eval_set_covers_the_buckets_within_max_n():
    for task in (DEFAULT, ALL_SIZES):
        problems = task.eval_set(per_bucket=5)
        assert Counter(task.bucket_of(p.size) for p in problems) == {
            f"{lo}-{hi}": 5 for lo, hi in task.size_buckets if lo <= task.max_n}
        assert all(1 <= p.size <= task.max_n for p in problems)
