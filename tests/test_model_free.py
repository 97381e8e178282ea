"""Tests for model_free.py: the n-gram and sibling lookups on hand-made batches, the sibling
drafter's texts of a running batch's GRPO groups, and every drafter's losslessness.

Greedy and exact-token runs are float64 on a tiny random target (as in tests/test_speculative.py),
so a token-level disagreement between speculative and plain decoding is a real bug.
"""
from types import SimpleNamespace

import pytest
import torch

from harness.instrument import DecodeStats
from conftest import N_NEW, every_drafter, make_greedy_setup
from harness.model_free import NgramDrafter, SiblingDrafter
from speculative import RunningBatch, autoregressive_generate, speculative_generate


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """These models are tiny: on a busy 2-core machine, intra-op threads only spin and wait."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def greedy_setup():
    """See conftest.make_greedy_setup."""
    return make_greedy_setup()


class Batch(SimpleNamespace):
    """A hand-made running batch (a class of its own: SiblingDrafter keeps a weak reference)."""


def sibling_batch():
    """A hand-made batch for SiblingDrafter.lookup (W = 13): texts 0, 1 running, 2 their finished
    sibling, 3 another group's, 4 running alone; running rows 0, 1 and 4. `groups` holds those texts
    as lookup reads them; ids, prompts and results are what a RunningBatch exposes for them (a group
    is the rows of one prompt: rows 0, 1 and 2 share one, rows 3 and 4 have their own)."""
    W = 13
    texts = torch.zeros(5, W, dtype=torch.long)
    rows = {0: [1, 2, 3, 4, 5], 1: [1, 2, 3, 4, 5, 6, 7],
            2: [8, 3, 4, 5, 9, 9, 6, 7, 1, 5, 6, 7, 2], 3: [7, 7, 3, 1, 1], 4: [7, 7, 3]}
    for i, t in rows.items():
        texts[i, :len(t)] = torch.tensor(t)
    lens = torch.tensor([len(rows[i]) for i in range(5)])
    running = [0, 1, 4]
    tokens = texts[running].clone()
    tokens[1, 7:] = 99  # what a running sibling holds past its length is never read
    texts[1, 7:] = 99
    groups = SimpleNamespace(siblings=torch.tensor([[1, 2], [0, 2], [-1, -1], [-1, -1], [-1, -1]]),
                             texts=texts, lens=lens)
    groups.now = lambda *_: (groups.texts, groups.lens)
    finished = [None, None, SimpleNamespace(tokens=texts[2].clone()),
                SimpleNamespace(tokens=texts[3, :5].clone()), None]
    return Batch(tokens=tokens, n_tokens=lens[running], ids=running, groups=groups,
                 prompts=[[1], [1], [1], [7], [8]], results=finished)


def test_sibling_drafter_takes_the_longest_match_then_the_closest_from_siblings_only():
    """SiblingDrafter.lookup on a hand-made batch (M = 3): a row drafts from its own group's texts
    only, a running sibling up to where it is, the longest match first and among equal ones the
    place closest to the row's own position; no match proposes the last token again. propose,
    with the texts it builds from the batch's groups and finished rows, drafts the same."""
    batch = sibling_batch()
    drafts, length = SiblingDrafter(max_match=3).lookup(batch, 3, batch.groups)
    # row 0 ends "3 4 5": in row 1 followed by 6 at its own position 5, in text 2 by 9 at 4: the
    # closer; then row 1's last token, not what lies past it
    assert drafts[0].tolist() == [6, 7, 7] and length[0] == 3
    # row 1 ends "5 6 7": "6 7" is followed at 8 (one from its position), "5 6 7" at 12: the longer
    assert drafts[1].tolist() == [2, 2, 2] and length[1] == 3
    # row 4 has no sibling: text 3 (another group's) would match "7 7 3", but is never read
    assert drafts[2].tolist() == [3, 3, 3] and length[2] == 0
    proposed, q = SiblingDrafter(max_match=3).propose(batch, 3)
    assert q is None  # deterministic proposals: a one-hot q
    assert torch.equal(proposed, drafts)


def test_groups_are_the_rows_of_one_prompt_and_their_texts_outlive_them(greedy_setup):
    """What a SiblingDrafter reads of a running batch's GRPO groups: the other rows with its prompt,
    never the row itself; a finished row's text stays as it ended, a running row's is read as it
    is now."""
    target, _, pool, _, eos = greedy_setup
    a, b = pool[0], pool[1]
    prompts = [a, b, a, b, a]
    drafter = SiblingDrafter()
    gen = RunningBatch(target, prompts, N_NEW, temperature=1.0, eos_id=eos, sampler="gumbel",
                       keys=[5, 6, 7, 8, 9])
    groups = drafter.groups(gen)
    assert groups.siblings.tolist() == [[2, 4], [3, -1], [0, 4], [1, -1], [0, 2]]
    seen = set()
    while gen.compact() > 0:
        running = gen.ids
        seen.add(len(running))
        assert drafter.groups(gen) is groups  # made once per batch
        texts, lens = groups.now(torch.tensor(running), gen.tokens, gen.n_tokens)
        for i in range(5):  # every text is the row's tokens: as they are now, or as the row ended
            if i in running:
                now = gen.tokens[running.index(i), :gen.n_tokens[running.index(i)]]
            else:
                now = gen.results[i].tokens
            assert texts[i, :lens[i]].tolist() == now.tolist()
        gen.plain_step()
    assert len(seen) > 1  # the rows finish at different times
    alone = RunningBatch(target, [a, b], N_NEW, temperature=1.0, eos_id=eos, sampler="gumbel",
                         keys=[1, 2])
    assert drafter.groups(alone) is not groups  # a new batch: new texts
    assert drafter.groups(alone).siblings.tolist() == [[-1], [-1]]


def test_ngram_drafter_proposes_what_followed_the_last_match():
    tokens = torch.tensor([[5, 6, 7, 8, 5, 6, 0, 0], [1, 2, 3, 4, 9, 9, 9, 9],
                           [3, 3, 3, 3, 3, 0, 0, 0]])
    n_tokens = torch.tensor([6, 4, 5])
    drafts, q = NgramDrafter(n=2).propose(SimpleNamespace(tokens=tokens, n_tokens=n_tokens), 3)
    assert q is None  # deterministic proposals: a one-hot q
    assert drafts[0].tolist() == [7, 8, 5]  # "5 6" was followed by "7 8 5"; reads stay in the row
    assert drafts[1].tolist() == [4, 4, 4]  # "3 4" never occurred before: the last token, again
    assert drafts[2].tolist() == [3, 3, 3]  # the latest earlier "3 3" (at 2): 3, 3 (clamped)


@pytest.mark.parametrize("name", ["learned", "ngram", "sibling"])
@pytest.mark.parametrize("sampler,temperature",
                         [("gumbel", 1.0), ("gumbel", 0.0), ("rejection", 0.0)])
def test_every_drafter_is_lossless(greedy_setup, name, sampler, temperature):
    """Every drafter, learned or model-free, through the one propose(batch, k): the tokens are
    plain decoding's (exact-token sampling and greedy), in groups of three rows with a prompt, and
    some drafts are accepted, some rejected. Rejection sampling at T > 0: tests/test_speculative.py's
    test_sequence_distribution_is_the_targets."""
    target, learned, pool, _, eos = greedy_setup
    prompts = [p * 3 for p in pool for _ in range(3)]  # repeats: the n-gram lookup finds some
    keys = list(range(100, 100 + len(prompts)))
    how = dict(temperature=temperature, eos_id=eos, sampler=sampler)
    plain, _ = autoregressive_generate(target, prompts, N_NEW, keys=keys, **how)
    drafter = every_drafter(learned)[name]
    st = DecodeStats()
    out, _ = speculative_generate(target, drafter, prompts, N_NEW, k=3, keys=keys, observer=st, **how)
    st.settle()
    assert out == plain
    assert st.accepted > 0
    if not (name == "sibling" and temperature == 0):  # greedy siblings are copies: all drafts right
        assert st.accepted < st.drafted
