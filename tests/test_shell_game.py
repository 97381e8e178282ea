"""Tests for tasks/shell_game.py: the format and its merged tokens, the swaps, the reward, parse, the
bound on the response length, the warm-up traces' choices and the settings' validation."""
import random
import re
from collections import Counter

import numpy as np
import pytest

import tasks
from tasks import TASKS
from tasks import shell_game as task
from tasks.shell_game import CUPS, START, Problem, ShellGame, ShellRounds, swap

DEFAULT = ShellGame()
ALL_SIZES = ShellGame(max_n=len(task.LABELS))


def by_size(cfg, per_size, seed):
    rng = random.Random(seed)
    return [cfg.sample(rng, n) for n in range(cfg.min_n, cfg.max_n + 1) for _ in range(per_size)]


def ids_of(text):
    return task.encode(text)


# ----------------------------------------------------------------------------- format, tokens


def test_the_format_on_an_example():
    p = Problem(("AB", "BC", "AC", "AB", "BC"))  # the ball: A -> B -> C -> A -> B -> C
    assert p.prompt() == "aAB bBC cAC dAB eBC?" and p.answer == "C"
    assert p.balls == ["B", "C", "A", "B", "C"]
    assert p.response() == "aAB=B bBC=C cAC=A dAB=B eBC=C >C"
    assert p.response(random.Random(0), outright=1.0) == ">C"  # a warm-up trace that answers outright at once
    assert Problem(("BC",)).response() == "aBC=A >A"  # a swap without the ball leaves it
    assert TASKS["shell_game"] is ShellGame and DEFAULT.choice == "swaps written"
    assert ShellGame(rounds="growing").choice == "rounds written"


def test_in_growing_rounds_round_r_follows_the_first_r_swaps_marking_each_round():
    p = Problem(("AB", "BC", "AC"), rounds=True)  # the ball: A -> B | -> A -> A | -> B -> C -> A
    assert p.prompt() == "aAB bBC cAC *?" and p.balls == ["B", "A", "A", "B", "C", "A"]
    assert p.response() == "1:aAB=B 2:aAB=A bBC=A 3:aAB=B bBC=C cAC=A >A" and p.answer == "A"
    assert ShellGame(rounds="growing").problem(random.Random(0), 3).rounds
    assert not DEFAULT.problem(random.Random(0), 3).rounds  # the default: once, no "*"


def test_the_encoding_is_in_process_and_merges_every_labelled_swap_of_the_prompt(no_network):
    for p in by_size(ALL_SIZES, per_size=3, seed=1):
        prompt, response = p.prompt(), p.response()
        assert len(ids_of(prompt)) == 2 * p.size  # a merged swap, then " " (the last: "?")
        assert len(ids_of(response)) == 6 * p.size + 2  # nothing merged in the response: "bBC=C " is 6
        assert DEFAULT.decode(ids_of(prompt + response)) == prompt + response
    assert task.EOS_ID not in ids_of("<|eos|>") and DEFAULT.decode(ids_of("é ✓ <|pad|>")) == "é ✓ <|pad|>"


def test_the_tokens_do_not_depend_on_a_seed():
    """The same problem, prompt and trace give the same ids, whatever rng drew the problem: the
    encoding is fixed, made once in-process."""
    a = task.ENC
    b = tasks.make_encoding("shell_game", [c + pair for c in task.LABELS for pair in task.PAIRS],
                            pat_str=r"[a-z][A-C]{2}(?=[ ?])|\S|\s+")
    for p in by_size(DEFAULT, per_size=5, seed=2):
        text = p.prompt() + p.response()
        assert a.encode(text) == b.encode(text)
    assert DEFAULT.prompt_ids(Problem(("AB", "BC"))) == [task.ENC.encode_single_token("aAB"), ord(" "),
                                                        task.ENC.encode_single_token("bBC"), ord("?")]


def test_merges_start_from_their_parts():
    merges = DEFAULT.merges()
    assert len(merges) == len(task.LABELS) * len(task.PAIRS)
    for merged, parts in merges:
        assert len(parts) == 3
        assert DEFAULT.decode([merged]) == "".join(DEFAULT.decode([i]) for i in parts)


# ----------------------------------------------------------------------------- swaps


def test_each_step_follows_one_swap_and_the_last_is_the_answer():
    assert task.swap("A", "AB") == "B" and task.swap("B", "AB") == "A" and task.swap("C", "AB") == "C"
    for p in by_size(ALL_SIZES, per_size=10, seed=3):
        ball = task.START
        steps = p.response().split(" ")
        assert len(steps) == p.size + 1 and steps[-1] == ">" + p.answer
        for i, (pair, step) in enumerate(zip(p.swaps, steps)):
            ball = pair[1] if ball == pair[0] else pair[0] if ball == pair[1] else ball
            assert step == f"{task.LABELS[i]}{pair}={ball}"
        assert ball == p.answer


def test_after_any_swap_the_ball_is_under_each_cup_a_third_of_the_time():
    """Why a guess is right one time in three at every size, and so why a jump not computed is a
    guess: 30,000 problems, about 3 sigma."""
    rng = random.Random(4)
    for n in (1, 2, 7):
        seen = Counter(ShellGame().problem(rng, n).answer for _ in range(30_000))
        assert all(abs(seen[c] / 30_000 - 1 / 3) < 0.01 for c in task.CUPS), (n, seen)


# ----------------------------------------------------------------------------- reward


def test_reward_is_right_on_the_examples():
    p = Problem(("AB", "BC", "AC", "AB", "BC"))  # answer C
    assert DEFAULT.reward(p, ids_of(p.response())) == 1.0
    assert DEFAULT.reward(p, ids_of(">C")) == 1.0  # the answer outright counts
    assert DEFAULT.reward(p, ids_of("aAB=A >C")) == 1.0  # only the final answer counts
    assert DEFAULT.reward(p, ids_of(">C") + [task.EOS_ID] + ids_of("junk")) == 1.0
    for wrong in (">A", ">B", ">c", ">CC", "C", ">C>A", "", ">", "eBC:B=C", ">C=C", ">3", "eBC=C"):
        assert DEFAULT.reward(p, ids_of(wrong)) == 0.0, wrong
    for q in by_size(ALL_SIZES, per_size=5, seed=5):
        ids, plen = DEFAULT.warmup_example(q, random.Random(5))
        assert DEFAULT.reward(q, ids[plen:]) == 1.0  # a trace is never wrong: every error is the model's


def test_step_credit_pays_for_each_step_written_with_the_true_cup():
    """--step-credit c: (1 - c) for the answer, c times the share of the problem's steps written, in
    order, with the ball's true cup (a shortcut's guess counts where it is right); accuracy counts
    the answer alone; at 0 the reward is the answer's."""
    cfg = ShellGame(step_credit=0.5)
    p = Problem(("AB", "BC", "AC", "AB", "BC"))  # the ball: B, C, A, B, C
    assert cfg.reward(p, ids_of(p.response())) == 1.0
    assert cfg.reward(p, ids_of(">C")) == 0.5 and cfg.correct(p, ids_of(">C"))
    assert cfg.reward(p, ids_of("aAB=B bBC=C >A")) == pytest.approx(0.5 * 2 / 5)
    assert not cfg.correct(p, ids_of("aAB=B bBC=C >A"))
    assert cfg.reward(p, ids_of("aAB=A b=C cAC=A >C")) == pytest.approx(0.5 + 0.5 * 2 / 5)
    assert cfg.reward(p, ids_of("bBC=C aAB=B >C")) == 0.5  # out of order: no step counts
    assert DEFAULT.reward(p, ids_of("aAB=B bBC=C >A")) == 0.0
    rounds = Problem(("AB", "BC"), rounds=True)  # 1:aAB=B 2:aAB=A bBC=A
    assert cfg.reward(rounds, ids_of("1:aAB=B >A")) == pytest.approx(0.5 + 0.5 / 3)
    assert cfg.reward(rounds, ids_of(rounds.response())) == 1.0
    assert cfg.reward(p, None) == 0.0 and not cfg.correct(p, None)


def test_reward_never_raises():
    rng = random.Random(6)
    p = Problem(("AB", "BC"))  # answer C
    for _ in range(500):
        ids = [rng.randrange(-3, DEFAULT.vocab_size + 3) for _ in range(rng.randrange(0, 60))]
        assert DEFAULT.reward(p, ids) in (0.0, 1.0)
        assert 0.0 <= DEFAULT.choice_share(p, ids) <= 1.0
    for bad in (None, 1, "x", [None]):
        assert DEFAULT.reward(p, bad) == 0.0
    assert DEFAULT.reward(p, ids_of(">\uff23")) == 0.0  # a fullwidth C is no cup
    assert DEFAULT.reward(p, ids_of(">C")) == 1.0


def test_choice_share_is_the_share_of_the_swaps_followed():
    p = Problem(("AB", "BC", "AC", "AB", "BC"))
    share = lambda text: DEFAULT.choice_share(p, ids_of(text))  # noqa: E731
    assert share(p.response()) == 1.0 and share(">C") == 0.0 and share("") == 0.0
    assert share("aAB=B bBC=C >C") == pytest.approx(2 / 5)
    assert share(p.response().split(">")[0] + "fAB=A >C") == 1.0  # never above 1
    q, growing = Problem(("AB", "BC", "AC"), rounds=True), ShellGame(rounds="growing")  # in rounds: rounds
    assert growing.choice_share(q, ids_of("1:aAB=B 2:aAB=A bBC=A >C")) == pytest.approx(2 / 3)  # 3 swaps
    assert growing.choice_share(q, ids_of(q.response())) == 1.0 and growing.choice_share(q, ids_of(">C")) == 0.0


# ----------------------------------------------------------------------------- parse


def test_parse_round_trips_and_rejects_what_is_no_problem():
    for p in by_size(ALL_SIZES, per_size=5, seed=7):
        assert DEFAULT.parse(p.prompt()) == p
    for text in ("", "?", "aAB", "aAB bBC", "aAB bBC??", "bAB aBC?", "aAB cBC?", "aAB  bBC?", "aBA?", "aAA?",
                 "aAD?", "AAB?", "aAB bBC?\n", " aAB?", "aAB\uff1f", None, 1, b"aAB?",
                 " ".join(f"{c}AB" for c in task.LABELS) + " aAB?"):
        assert DEFAULT.parse(text) is None, repr(text)
    assert DEFAULT.parse("aAB bBC cAC?") == Problem(("AB", "BC", "AC"))
    growing = ShellGame(rounds="growing", max_n=26)
    for p in by_size(growing, per_size=5, seed=7):
        assert growing.parse(p.prompt()) == p
    assert growing.parse("aAB bBC *?") == Problem(("AB", "BC"), True)
    assert DEFAULT.parse("aAB bBC *?") is None and growing.parse("aAB bBC?") is None  # the task's kind
    for text in ("aAB *2?", "aAB*?", "aAB **?", "*?", "aAB * bBC?"):
        assert growing.parse(text) is None, repr(text)


# ----------------------------------------------------------------------------- lengths


def test_response_len_bounds_every_trace_and_following_every_swap_reaches_it():
    rng = random.Random(8)
    for p in by_size(ALL_SIZES, per_size=10, seed=8):
        assert len(ids_of(p.response())) + 1 == ALL_SIZES.response_len(p.size)
        assert len(ids_of(p.response(rng, ALL_SIZES.outright))) + 1 <= ALL_SIZES.response_len(p.size)
    assert len(ids_of(Problem(("AB",) * DEFAULT.max_n).prompt())) == DEFAULT.max_prompt_len
    assert DEFAULT.max_seq_len + 8 <= 256  # the default --block-size, with the longest draft


def test_in_growing_rounds_the_length_is_quadratic_and_a_twentieth_of_the_responses_hold_a_quarter():
    """n swaps in n growing rounds: response_len bounds every trace and the full response reaches it;
    over 20,000 sampled sizes at --max-n 8 --alpha 1.5, the longest 5% of the full responses hold
    at least a quarter of their tokens (measured: 0.26)."""
    cfg, rng = ShellGame(rounds="growing", max_n=12), random.Random(12)
    for p in by_size(cfg, per_size=3, seed=12):
        assert len(ids_of(p.response())) + 1 == cfg.response_len(p.size)
        assert len(ids_of(p.response(rng, cfg.outright))) + 1 <= cfg.response_len(p.size)
    assert len(ids_of(Problem(("AB",) * 12, True).prompt())) == cfg.max_prompt_len
    assert [cfg.response_len(n) for n in (1, 2, 3)] == [11, 25, 45]  # 3 n (n + 1) + 2 n + 3 to n = 9
    small = ShellGame(rounds="growing", max_n=8, alpha=1.5)
    lengths = np.sort([small.response_len(small.sample(rng).size) for _ in range(20_000)])[::-1]
    assert lengths[:1000].sum() / lengths.sum() >= 0.25


def test_the_default_task_is_the_shell_game_in_rounds_at_its_own_settings():
    """shell_rounds (the default --task) is ShellGame with other defaults only: the same traces,
    prompts and rewards as the shell game given its settings as flags; its help is ShellGame's."""
    rounds = ShellRounds()
    assert TASKS["shell_rounds"] is ShellRounds and rounds.name == "shell_rounds"
    same = ShellGame(rounds="growing", max_n=6, alpha=1.5, outright=0.8)
    assert rounds.traces == same.traces and rounds.traces != ShellGame().traces
    assert (rounds.warmup_steps, rounds.rl_lr) == (3600, 2e-4) and ShellGame.rl_lr == 4e-4
    p = rounds.sample(random.Random(3), 6)
    assert p.rounds and rounds.reward(p, ids_of(p.response())) == 1.0 == same.reward(p, ids_of(p.response()))
    assert ShellRounds.__dataclass_fields__["outright"].metadata == ShellGame.__dataclass_fields__["outright"].metadata


def test_default_warm_up_traces_are_long_tailed():
    rng = random.Random(9)
    lengths = np.array([len(ids_of(DEFAULT.sample(rng).response(rng, DEFAULT.outright))) + 1 for _ in range(20_000)])
    med, p90, p99 = np.percentile(lengths, [50, 90, 99])
    assert p90 >= 2 * med and p99 >= 3 * med, (med, p90, p99)  # measured: 9, 39, 63


# ----------------------------------------------------------------------------- warm-up traces, settings


def test_warm_up_traces_follow_the_first_swaps_then_answer():
    """Each trace is the first swaps of the full response, then the answer; before each swap it
    answers outright with probability `outright` (a geometric number of swaps followed)."""
    cfg = ShellGame(outright=0.3)
    rng = random.Random(10)
    seen = Counter()
    for _ in range(3000):
        p = cfg.sample(rng)
        r = p.response(rng, cfg.outright)
        full = p.response().split(" ")
        steps = r.split(" ")[:-1]
        assert steps == full[:len(steps)] and r.split(" ")[-1] == ">" + p.answer
        seen["swap"] += len(steps)
        seen["outright"] += len(steps) < p.size
    share = seen["outright"] / (seen["swap"] + seen["outright"])
    assert abs(share - 0.3) < 0.02, seen  # thousands of choices: about 3 sigma
    ids, plen = cfg.warmup_example(Problem(("AB", "BC")), random.Random(11))
    assert ids[:plen] == DEFAULT.prompt_ids(Problem(("AB", "BC"))) and ids[-1] == task.EOS_ID


def test_in_rounds_a_warm_up_trace_answers_outright_before_a_round_drawn_uniformly():
    """In growing rounds, with probability `outright` a trace answers outright where a round would
    begin ("2:"), the round drawn uniformly; else it follows every round."""
    cfg, rng, stopped = ShellGame(rounds="growing", outright=0.3), random.Random(13), []
    for _ in range(3000):
        p = cfg.problem(rng, 5)
        steps, answer = p.response(rng, cfg.outright).rsplit(">", 1)
        full, rounds = p.response(), steps.count(":")
        assert full.startswith(steps) and answer == p.answer
        assert full[len(steps):].startswith((f"{rounds + 1}:", ">"))  # a round's end, or the answer
        if rounds < p.size:
            stopped.append(rounds)
    assert abs(len(stopped) / 3000 - 0.3) < 0.025  # 3 sigma
    assert Counter(stopped).keys() == {0, 1, 2, 3, 4} and abs(np.mean(stopped) - 2) < 0.15  # 3 sigma


@pytest.mark.parametrize("rounds", ["once", "growing"])
def test_a_shortcut_writes_a_guessed_cup_that_the_steps_after_it_go_on_from(rounds):
    """With probability `shortcut` a step is written "b=C", its cup drawn uniformly; every other
    step follows its swap from the cup written before it; a trace followed to the end answers with
    the last cup it wrote (right or not), one stopped early with the true answer."""
    cfg, rng = ShellGame(rounds=rounds, outright=0.0, shortcut=0.4), random.Random(14)
    seen = Counter()
    for _ in range(2000):
        p = cfg.problem(rng, 5)
        steps = [s.split(":")[-1] for s in p.response(rng, cfg.outright, cfg.shortcut).split(" ")]
        ball = START
        for (_, label, pair), step in zip(p.steps, steps):
            if step[1] == "=":  # a shortcut
                assert step[0] == label
                seen["shortcut"] += 1
                seen[step[2]] += 1
                seen["right"] += step[2] == swap(ball, pair)  # a guess, not the swap followed
            else:
                assert step == f"{label}{pair}={swap(ball, pair)}"
                seen["swap"] += 1
            ball = step[-1]
        assert len(steps) == len(p.steps) + 1 and steps[-1] == ">" + ball
    # at least 10,000 steps, 4,000 of them guesses: each tolerance is 3 sigma
    assert abs(seen["shortcut"] / (seen["shortcut"] + seen["swap"]) - 0.4) < 0.015, seen
    assert all(abs(seen[c] / seen["shortcut"] - 1 / 3) < 0.025 for c in CUPS), seen  # uniform
    assert abs(seen["right"] / seen["shortcut"] - 1 / 3) < 0.025, seen  # right by chance alone
    ids, plen = cfg.warmup_example(cfg.problem(rng, 26), rng)  # the task's traces take the setting
    assert re.search(r"(^| |:)[a-z]=[A-C] ", cfg.decode(ids[plen:]))  # none in 26+ steps: p < 1e-5
    for _ in range(200):  # stopped early, a trace answers the truth, whatever it guessed before
        p = cfg.problem(rng, 5)
        r = p.response(rng, 0.3, cfg.shortcut)
        if r.count("=") < len(p.steps):
            assert r.endswith(">" + p.answer), r


@pytest.mark.parametrize("kwargs", [dict(max_n=0), dict(max_n=27), dict(outright=1.0), dict(outright=-0.1),
                                    dict(outright=float("nan")), dict(min_n=13), dict(rounds="n"),
                                    dict(shortcut=1.0), dict(shortcut=-0.5), dict(step_credit=1.0),
                                    dict(step_credit=-0.1)])
def test_bad_settings_are_refused(kwargs):
    with pytest.raises(ValueError):
        ShellGame(**kwargs)
