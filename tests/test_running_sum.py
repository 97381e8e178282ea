"""Tests for tasks/running_sum.py: the in-process tokenizer, the reward, decode, the long-tailed size
distribution, the stratified eval set, the settings' validation and training examples."""
import random
from collections import Counter

import numpy as np
import pytest

from tasks import running_sum as task
from tasks.running_sum import RunningSum

ALL_SIZES = RunningSum(max_n=len(task.LABELS))
TASK = RunningSum()


def sample_by_size(cfg, per_size, seed):
    rng = random.Random(seed)
    return [cfg.sample(rng, n) for n in range(1, cfg.max_n + 1) for _ in range(per_size)]


def roundtrip(text):
    return TASK.decode(task.encode(text))


# ----------------------------------------------------------------------------- tokenizer


def test_build_tokenizer_is_in_process(no_network):
    enc = task.build_tokenizer()
    text = task.Problem((3, 7, 1)).prompt()
    assert enc.decode(enc.encode(text)) == text
    assert enc.n_vocab == task.VOCAB_SIZE
    assert enc.encode_single_token(task.EOS) == task.EOS_ID
    assert enc.encode_single_token(task.PAD) == task.PAD_ID
    assert task.EOS_ID != task.PAD_ID and max(task.EOS_ID, task.PAD_ID) < task.VOCAB_SIZE
    # a fresh build gives the same ids as the module's encoding
    assert enc.encode(text) == task.encode(text)


@pytest.mark.parametrize("cfg", [RunningSum(), ALL_SIZES], ids=["default", "max_n=52"])
def test_tokenizer_round_trips_prompts_and_responses(cfg):
    problems = sample_by_size(cfg, per_size=25, seed=11)
    assert {p.size for p in problems} == set(range(1, cfg.max_n + 1))
    for p in problems:
        prompt, response = p.prompt(), p.response()
        for text in (prompt, response, prompt + response, prompt + " " + response):
            assert roundtrip(text) == text, repr(text)
        # the merges are in place: one token per labelled digit in the prompt, so 2n tokens
        assert len(task.encode(prompt)) == 2 * p.size, prompt
        assert len(task.encode(prompt)) <= cfg.max_prompt_len
        assert len(task.encode(response)) + 1 <= cfg.max_response_len


def test_tokenizer_round_trips_other_text():
    rng = random.Random(12)
    texts = ["", " ", "\n\n", "a3=3 >1", "héllo wörld ✓ 数字 🙂", task.EOS + "a3", "<|pad|>"]
    texts += ["".join(chr(rng.randrange(32, 127)) for _ in range(rng.randrange(1, 60))) for _ in range(200)]
    for text in texts:
        assert roundtrip(text) == text, repr(text)
    # special-token text inside data stays plain bytes: it neither stops decoding nor becomes EOS
    assert task.EOS_ID not in task.encode(task.EOS)


# ----------------------------------------------------------------------------- decode


def test_decode_stops_at_eos():
    head, tail = task.encode("a3 b7:"), task.encode(" junk >5")
    assert TASK.decode(head + [task.EOS_ID] + tail) == "a3 b7:"
    assert TASK.decode(head + [task.EOS_ID, task.EOS_ID]) == "a3 b7:"
    assert TASK.decode([task.EOS_ID] + tail) == ""
    assert TASK.decode(head + [task.PAD_ID] + tail) == "a3 b7:" + " junk >5"  # padding is not text
    assert TASK.decode(iter(head)) == "a3 b7:"  # any iterable of ids


def test_decode_never_raises_on_arbitrary_ids():
    rng = random.Random(13)
    for _ in range(2000):
        ids = [rng.randrange(task.VOCAB_SIZE) for _ in range(rng.randrange(0, 80))]
        out = TASK.decode(ids)
        assert isinstance(out, str)
        if task.EOS_ID in ids:  # nothing after the first EOS can show up
            assert out == TASK.decode(ids[: ids.index(task.EOS_ID)])
    # lone continuation bytes and truncated multi-byte sequences become U+FFFD, not errors
    assert TASK.decode([0x80, 0xFF, 0xE2, 0x82]).count("\ufffd") >= 1
    # ids out of the vocabulary are ignored (the docstring promises "never raises")
    assert isinstance(TASK.decode([-1, task.VOCAB_SIZE, 10 ** 9] + task.encode("ok")), str)


# ----------------------------------------------------------------------------- reward


def test_reward_reference_is_one_and_wrong_answer_is_zero():
    for p in sample_by_size(ALL_SIZES, per_size=10, seed=14):
        prompt, ref = p.prompt(), p.response()
        assert task.reward(prompt, ref) == 1.0, (prompt, ref)
        assert task.reward(prompt, TASK.decode(task.training_example(p)[0][len(task.encode(prompt)):])) == 1.0
        head = ref[: ref.rindex(">") + 1]
        for wrong in range(10):
            if wrong != p.answer:
                assert task.reward(prompt, head + str(wrong)) == 0.0, (prompt, head + str(wrong))
        assert task.reward(prompt, head + str(p.answer + 10)) == 0.0  # not reduced modulo 10
        assert task.reward(prompt, ref[: ref.rindex(">")]) == 0.0  # no final answer
        # only the final answer counts (documented): a bare correct answer scores
        assert task.reward(prompt, f">{p.answer}") == 1.0


def test_reward_is_zero_for_garbage_and_never_raises():
    rng = random.Random(16)
    good = task.Problem((3, 7, 1))  # answer 1
    prompt = good.prompt()
    responses = ["", " ", "\n", ">", ">>", "> ", ">-1", ">+1", ">1.0", ">1e0", ">0x1", ">one", "None", "null",
                 "NaN", ">nan", ">inf", "undefined", "\x00", "\x00>1\x00", ">" + "9" * 100_000,
                 ">" + "1" + "0" * 5000, ">" + "2" * 4000, ">1 junk", ">1>", "a3=3 >1 b", ">¹",
                 "ünïcødé ✓ 数字 🙂", "\ufffd" * 50, task.EOS, "<|pad|>>1<|eos|>", ">1" + "\u200b"]
    responses += [bytes(rng.randrange(256) for _ in range(rng.randrange(1, 100))).decode("utf-8", "replace")
                  for _ in range(300)]
    for r in responses:
        assert task.reward(prompt, r) == 0.0, repr(r[:80])
    prompts = ["", " ", ":", "a3 b7", "a3 b7::", "3a:", "aa:", "a33:", "a3  b7:", " a3:", "a3 :", "a-3:",
               "None", "\x00", "a3 b7 c1:\n", "ä3:", "数字:", "a3" * 10_000 + ":x"]
    prompts += [bytes(rng.randrange(256) for _ in range(rng.randrange(1, 100))).decode("utf-8", "replace")
                for _ in range(100)]
    for p in prompts:
        for r in (">1", ">0", good.response(), ""):
            assert task.reward(p, r) == 0.0, (repr(p[:80]), r)
    # not strings at all
    for p, r in [(None, None), (None, ">1"), (prompt, None), (123, 456), (b"a3:", b">3"), ([], {}),
                 (prompt, 1), (prompt, b">1"), (float("nan"), ">1")]:
        assert task.reward(p, r) == 0.0, (p, r)


def test_reward_accepts_only_ascii_digits():
    # prompts and responses are ASCII; Python's \d also matches other Unicode decimal digits
    # (fullwidth "１", Arabic-Indic "١", Devanagari "१"), which the byte-level model can emit.
    # Such text is not the task's format and must score 0, like any other garbage.
    prompt = task.Problem((3, 7, 1)).prompt()  # answer 1
    for r in (">\uff11", ">\u0661", ">\u0967", "a3=3 b7=0 c1=1 >\uff11"):
        assert task.reward(prompt, r) == 0.0, repr(r)
    for bad_prompt in ("a\u0663 b7 c1:", "a3 b\uff17 c1:"):
        assert task.reward(bad_prompt, ">1") == 0.0, repr(bad_prompt)


def test_reward_on_decoded_random_ids_never_raises():
    rng = random.Random(17)
    problems = sample_by_size(RunningSum(), per_size=4, seed=17)
    hits = 0
    for i in range(1000):
        p = problems[i % len(problems)]
        ids = [rng.randrange(task.VOCAB_SIZE) for _ in range(rng.randrange(0, 120))]
        r = task.reward(p.prompt(), TASK.decode(ids))
        assert r in (0.0, 1.0)
        hits += r
    assert hits < 50  # random ids essentially never end in the right answer


# ----------------------------------------------------------------------------- long tail


def test_default_response_lengths_are_long_tailed():
    cfg = RunningSum()
    rng = random.Random(0)
    lengths = np.array([len(task.encode(cfg.sample(rng).response(rng, cfg.strides))) + 1
                        for _ in range(20000)])
    med, p90, p99 = np.percentile(lengths, [50, 90, 99])
    print(f"\nwarm-up trace tokens (eos included), default TaskConfig, n=20000: "
          f"median {med:.0f}, p90 {p90:.0f}, p99 {p99:.0f}, max {lengths.max()}")
    assert p90 >= 2 * med and p99 >= 3 * med, (med, p90, p99)  # measured: 12, 31, 67
    assert lengths.max() <= cfg.max_response_len
    assert lengths.min() >= 1


# ----------------------------------------------------------------------------- eval set


@pytest.mark.parametrize("max_n", [1, 4, 12, 26, 52])
def test_eval_set_is_fixed_and_stratified(max_n):
    cfg = RunningSum(max_n=max_n)
    per_bucket = 7
    a, b = cfg.eval_set(per_bucket=per_bucket), cfg.eval_set(per_bucket=per_bucket)
    assert a == b
    assert a != cfg.eval_set(per_bucket=per_bucket, seed=99)
    expected = {f"{lo}-{hi}": per_bucket for lo, hi in task.SIZE_BUCKETS if lo <= max_n}
    assert Counter(cfg.bucket_of(p.size) for p in a) == expected
    for p in a:
        assert 1 <= p.size <= max_n
        assert all(0 <= d < 10 for d in p.digits)
    # the default set: per_bucket problems in every bucket
    default = cfg.eval_set()
    assert default == cfg.eval_set()
    assert set(Counter(cfg.bucket_of(p.size) for p in default).values()) == {40}


def test_mean_by_size_returns_per_bucket_means():
    cfg = RunningSum(max_n=26)
    problems = cfg.eval_set(per_bucket=5)
    buckets = [cfg.bucket_of(p.size) for p in problems]
    names = list(dict.fromkeys(buckets))
    assert len(names) == 5
    # bucket i gets i correct answers out of 5 (in scrambled order within the set)
    seen = Counter()
    rewards = []
    for bk in buckets:
        rewards.append(1.0 if seen[bk] < names.index(bk) else 0.0)
        seen[bk] += 1
    rng = random.Random(18)
    order = list(range(len(problems)))
    rng.shuffle(order)
    acc = TASK.mean_by_size([problems[i] for i in order], [rewards[i] for i in order])
    assert set(acc) == {"overall"} | set(names)
    for i, name in enumerate(names):
        assert acc[name] == pytest.approx(i / 5), name
    assert acc["overall"] == pytest.approx(sum(rewards) / len(rewards))
    assert acc["overall"] == pytest.approx(sum(range(5)) / 25)


# ----------------------------------------------------------------------------- config, examples


@pytest.mark.parametrize("max_n", [0, -1, len(task.LABELS) + 1, 1000])
def test_task_config_rejects_max_n_out_of_range(max_n):
    with pytest.raises(ValueError):
        RunningSum(max_n=max_n)


@pytest.mark.parametrize("max_n", [1, len(task.LABELS)])
def test_task_config_accepts_max_n_in_range(max_n):
    assert RunningSum(max_n=max_n).max_n == max_n


def test_training_example_layout():
    for p in sample_by_size(ALL_SIZES, per_size=5, seed=19):
        ids, plen = task.training_example(p)
        assert ids[:plen] == task.encode(p.prompt())
        assert ids[plen:-1] == task.encode(p.response())
        assert ids[-1] == task.EOS_ID and ids.count(task.EOS_ID) == 1
        assert task.PAD_ID not in ids
        assert all(0 <= i < task.VOCAB_SIZE for i in ids)
        assert TASK.decode(ids) == p.prompt() + p.response()
        assert len(ids) <= ALL_SIZES.max_seq_len


# ----------------------------------------------------------------------------- strides


def parse_steps(problem, response):
    """A trace -> the stride of each choice made with at least 3 digits left (1, 2, 3, or 0 for
    the answer outright), checking that every step adds its digits and writes the running sum."""
    s, i, strides = 0, 0, []
    for step in response.split(" "):
        left = problem.size - i
        if step.startswith(">"):
            assert step == f">{problem.answer}", response
            if left >= 3:
                strides.append(0)
            return strides
        label, written = step.split("=", 1)
        j = task.LABELS.index(label[0])
        assert i <= j <= i + 2, response  # a single step or a jump of 2 or 3 digits
        prev, s = s, (s + sum(problem.digits[i:j + 1])) % 10
        d = problem.digits[j]
        assert step == (f"{label[0]}{d}={prev}+{d}={s}" if j == i else f"{label[0]}{d}={s}"), response
        if left >= 3:
            strides.append(j - i + 1)
        i = j + 1
    raise AssertionError(f"no answer in {response!r}")


def test_warm_up_traces_draw_a_stride_at_every_step_and_are_right():
    cfg = RunningSum(max_n=12, strides=(0.40, 0.45, 0.10, 0.05))
    rng = random.Random(21)
    seen = Counter()
    for _ in range(3000):
        p = cfg.sample(rng)
        r = p.response(rng, cfg.strides)
        seen.update(parse_steps(p, r))
        assert task.reward(p.prompt(), r) == 1.0  # no step is written wrong: every error is the model's
        assert len(task.encode(r)) + 1 <= cfg.response_len(p.size) <= cfg.max_response_len
        ids, plen = task.training_example(p, cfg, random.Random(len(r)))
        assert ids[:plen] == task.encode(p.prompt()) and ids[-1] == task.EOS_ID
    total = sum(seen.values())
    for stride, want in zip((1, 2, 3, 0), cfg.strides):  # 0: the answer outright
        assert abs(seen[stride] / total - want) < 0.015, (stride, seen)  # about 9,000 choices: 3 sigma
    assert cfg.max_seq_len == cfg.max_prompt_len + cfg.max_response_len


def test_single_steps_only_without_an_rng_and_their_length_is_the_bound():
    for p in sample_by_size(ALL_SIZES, per_size=3, seed=22):
        r = p.response()
        assert parse_steps(p, r) == [1] * max(p.size - 2, 0)
        assert len(task.encode(r)) + 1 == ALL_SIZES.response_len(p.size)
        assert task.single_share(r) == 1.0
    assert task.Problem((1, 2)).response(random.Random(0), (1.0, 0.0, 0.0, 0.0)) == "a1=0+1=1 b2=1+2=3 >3"


def test_single_share_counts_the_single_steps_among_the_written_ones():
    assert task.single_share("a3=0+3=3 c1=1 d5=1+5=6 >8") == pytest.approx(2 / 3)
    assert task.single_share("b0=0 >4") == 0.0 and task.single_share("a3=0+3=3 >3") == 1.0
    assert task.single_share(">4") == 0.0 and task.single_share("") == 0.0


@pytest.mark.parametrize("strides", [(), (0.0, 1.0), (-0.1, 0.5, 0.6), (float("nan"), 1.0), (0.5, float("nan"))])
def test_task_config_rejects_bad_strides(strides):
    with pytest.raises(ValueError):
        RunningSum(strides=strides)
