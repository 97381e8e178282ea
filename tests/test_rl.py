"""GRPO pieces: group advantages, masks, the clipped loss, and that an update moves the policy
towards rewarded responses."""
import math

import pytest
import torch

import rl
from conftest import run_ranks
from model import GPT, GPTConfig


def test_group_advantages_normalise_per_group():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 5.0, 5.0, 5.0, 5.0, 0.0, 0.0, 0.0, 3.0])
    adv = rl.group_advantages(r, 4)
    g = adv.view(3, 4)
    assert torch.allclose(g[0], torch.tensor([1.0, -1.0, -1.0, 1.0]), atol=1e-4)  # mean 0.5, std 0.5
    assert torch.equal(g[1], torch.zeros(4))  # all-equal group: no signal, no NaN
    assert torch.allclose(g[2].mean(), torch.tensor(0.0), atol=1e-6)
    assert torch.allclose(g[2].std(unbiased=False), torch.tensor(1.0), atol=1e-4)
    assert torch.isfinite(adv).all()


def test_group_advantages_reject_ragged_groups():
    with pytest.raises(ValueError):
        rl.group_advantages(torch.zeros(5), 4)


def test_group_advantages_divide_by_the_population_std():
    """A choice, pinned: the divisor is the population std (divide by G), not the sample std
    (G - 1) that TRL uses, so every advantage is sqrt(G / (G - 1)) times TRL's (1.069 at G = 8)."""
    G = 8
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.0])
    adv = rl.group_advantages(r, G)
    population = (r - r.mean()) / (r.std(unbiased=False) + 1e-6)
    sample = (r - r.mean()) / (r.std(unbiased=True) + 1e-6)
    assert torch.allclose(adv, population, atol=1e-6)
    assert torch.allclose(adv, sample * math.sqrt(G / (G - 1)), atol=1e-5)
    assert math.sqrt(G / (G - 1)) == pytest.approx(1.069, abs=1e-3)


def test_collate_masks_only_response_tokens():
    tokens, mask = rl.collate([[1, 2, 3, 4, 5], [6, 7, 8]], [2, 1], pad_id=0)
    assert tokens.tolist() == [[1, 2, 3, 4, 5], [6, 7, 8, 0, 0]]
    # mask[b, t] marks token t+1 as a response token
    assert mask.tolist() == [[False, True, True, True], [True, True, False, False]]


def test_token_logprobs_match_manual():
    torch.manual_seed(0)
    m = GPT(GPTConfig(vocab_size=11, block_size=16, n_layer=1, n_head=2, n_embd=8)).double()
    tokens = torch.randint(0, 11, (2, 6))
    lp = rl.token_logprobs(m, tokens)
    logits, _ = m(tokens)
    for b in range(2):
        for t in range(5):
            expect = torch.log_softmax(logits[b, t], -1)[tokens[b, t + 1]]
            assert math.isclose(lp[b, t].item(), expect.item(), rel_tol=1e-9)


def test_token_logprobs_score_at_the_sampling_temperature():
    """The rollout samples from softmax(z / T); the update must score the same distribution."""
    torch.manual_seed(0)
    m = GPT(GPTConfig(vocab_size=11, block_size=16, n_layer=1, n_head=2, n_embd=8)).double()
    tokens = torch.randint(0, 11, (2, 6))
    logits, _ = m(tokens[:, :-1])
    expect = torch.log_softmax(logits / 0.7, -1).gather(2, tokens[:, 1:, None]).squeeze(-1)
    assert torch.allclose(rl.token_logprobs(m, tokens, temperature=0.7), expect, rtol=0, atol=1e-12)
    assert not torch.allclose(rl.token_logprobs(m, tokens), expect, atol=1e-3)  # T matters here
    with pytest.raises(ValueError):
        rl.token_logprobs(m, tokens, temperature=0.0)  # greedy has no log-probs to train on


def _grpo_grads(model, seqs, plens, adv, temperature):
    """The gradient one GRPO update applies, read off before the optimizer step."""
    class Capture(torch.optim.SGD):
        def step(self):
            self.grads = [p.grad.clone() for p in model.parameters()]
    opt = Capture(model.parameters(), lr=0.0)
    cfg = rl.GRPOConfig(pad_id=0, update_tokens=1000, temperature=temperature)
    rl.grpo_update(model, opt, seqs, plens, adv, cfg, sum(len(s) - p for s, p in zip(seqs, plens)))
    return torch.cat([g.reshape(-1) for g in opt.grads])


def _reinforce_grads(model, seqs, plens, adv, temperature):
    """By hand: the gradient of -(1/N) sum_i A_i sum_t log softmax(z_t / T)[x_t+1] over response
    tokens, N the number of response tokens, i.e. REINFORCE under the policy that sampled."""
    model.zero_grad()
    n = sum(len(s) - p for s, p in zip(seqs, plens))
    total = 0.0
    for s, p, a in zip(seqs, plens, adv):
        x = torch.tensor([s])
        logits, _ = model(x[:, :-1])
        logp = torch.log_softmax(logits[0] / temperature, -1)  # (T-1, V)
        for t in range(p - 1, len(s) - 1):  # predicting response token t + 1
            total = total - a * logp[t, s[t + 1]]
    (total / n).backward()
    return torch.cat([q.grad.reshape(-1) for q in model.parameters()])


def test_grpo_gradient_is_reinforce_under_the_tempered_policy():
    """At T = 0.7 the update's gradient is REINFORCE's under softmax(z / T), the distribution the
    rollout sampled from, and not the one under softmax(z) (scoring at T = 1 trains the wrong
    policy). Small advantages keep the gradient under the clip norm of 1."""
    torch.manual_seed(0)
    m = GPT(GPTConfig(vocab_size=7, block_size=16, n_layer=1, n_head=2, n_embd=16)).double()
    seqs, plens = [[1, 2, 3, 4, 5], [1, 2, 6, 6], [3, 1, 2], [4, 4, 5, 6, 1]], [2, 2, 1, 3]
    adv = torch.tensor([0.02, -0.01, 0.015, -0.025], dtype=torch.float64)
    grpo = _grpo_grads(m, seqs, plens, adv, 0.7)
    want = _reinforce_grads(m, seqs, plens, adv.tolist(), 0.7)
    at_one = _reinforce_grads(m, seqs, plens, adv.tolist(), 1.0)
    assert want.norm() < 1.0  # no clipping: the comparison is exact
    assert torch.allclose(grpo, want, rtol=1e-9, atol=1e-14), float((grpo - want).norm() / want.norm())
    assert (want - at_one).norm() > 0.05 * want.norm()  # the temperature changes the gradient
    assert torch.allclose(_grpo_grads(m, seqs, plens, adv, 1.0), at_one, rtol=1e-9, atol=1e-14)


def test_grpo_update_rejects_temperature_zero():
    m = GPT(GPTConfig(vocab_size=7, block_size=16, n_layer=1, n_head=2, n_embd=16))
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with pytest.raises(ValueError):
        rl.grpo_update(m, opt, [[1, 2, 3]], [1], torch.tensor([1.0]),
                       rl.GRPOConfig(pad_id=0, update_tokens=100, temperature=0.0), 2)


def test_loss_is_token_mean_and_ignores_masked_positions():
    logp = torch.zeros(2, 3, requires_grad=True)
    adv = torch.tensor([1.0, -2.0])
    mask = torch.tensor([[True, True, False], [True, False, False]])
    loss, _ = rl.grpo_loss(logp, logp.detach(), adv, mask)
    assert math.isclose(loss.item(), -(1 + 1 - 2) / 3, abs_tol=1e-7)  # ratio 1: -mean(A) over 3 tokens
    loss.backward()
    assert logp.grad[0, 2] == 0 and logp.grad[1, 1] == 0 and logp.grad[1, 2] == 0
    assert logp.grad[0, 0] == pytest.approx(-1 / 3) and logp.grad[1, 0] == pytest.approx(2 / 3)


def test_clipping_stops_gradient_past_the_trust_region():
    logp_old = torch.zeros(1, 2)
    logp = torch.tensor([[math.log(1.5), math.log(1.1)]], requires_grad=True)  # ratios 1.5 and 1.1
    loss, st = rl.grpo_loss(logp, logp_old, torch.tensor([1.0]), torch.ones(1, 2, dtype=torch.bool), clip_eps=0.2)
    loss.backward()
    assert logp.grad[0, 0] == 0  # clipped: positive advantage, ratio above 1 + eps
    assert logp.grad[0, 1] != 0
    assert st["clip_frac"] == pytest.approx(0.5)


def test_kl_penalty_is_zero_at_reference_and_positive_elsewhere():
    logp = torch.log(torch.tensor([[0.5, 0.2]]))
    mask = torch.ones(1, 2, dtype=torch.bool)
    zero, st0 = rl.grpo_loss(logp, logp, torch.zeros(1), mask, kl_coef=1.0, logp_ref=logp)
    assert zero.item() == pytest.approx(0.0) and st0["kl"] == pytest.approx(0.0)
    pos, st1 = rl.grpo_loss(logp, logp, torch.zeros(1), mask, kl_coef=1.0, logp_ref=logp - 0.3)
    assert pos.item() > 0 and st1["kl"] > 0


def test_update_raises_probability_of_rewarded_response():
    """Two responses to the same prompt, one rewarded: a few GRPO steps make it more likely."""
    torch.manual_seed(0)
    m = GPT(GPTConfig(vocab_size=7, block_size=16, n_layer=1, n_head=2, n_embd=16))
    opt = torch.optim.SGD(m.parameters(), lr=0.5)
    seqs, plens = [[1, 2, 3, 4], [1, 2, 5, 6]], [2, 2]
    tokens, mask = rl.collate(seqs, plens, pad_id=0)
    adv = rl.group_advantages(torch.tensor([1.0, 0.0]), 2)
    with torch.no_grad():
        before = (rl.token_logprobs(m, tokens) * mask).sum(1)
    for _ in range(5):
        logp = rl.token_logprobs(m, tokens)
        loss, _ = rl.grpo_loss(logp, logp.detach(), adv, mask)
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        after = (rl.token_logprobs(m, tokens) * mask).sum(1)
    assert after[0] > before[0] + 0.1
    assert after[1] < before[1]


# ----------------------------------------------------------------------------- the same update on any number of ranks

# one global batch (prompt + response token lists, prompt lengths, advantages), dealt unevenly:
# (ranks, which rows each rank holds). Rank 1 holds a single response token, then none at all.
SEQS = [[1, 2, 3, 4, 5, 6, 1, 2], [1, 2, 5], [3, 4, 6, 6, 1, 2, 3, 4, 5, 6], [2, 2, 2, 3], [1, 3, 5]]
PLENS = [2, 2, 3, 1, 2]
ADV = [1.0, -0.5, 0.8, -1.3, 0.4]
DEALS = {"one_token": [[0, 2, 3, 4], [1]], "empty": [[0, 1, 2, 3, 4], []]}
N_TOTAL = sum(len(s) - p for s, p in zip(SEQS, PLENS))  # the global batch's response tokens


def _model():
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=7, block_size=16, n_layer=1, n_head=2, n_embd=16)).double()


def _update(model, net, rows, update_tokens=12):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    rl.grpo_update(net if net is not None else model, opt, [SEQS[i] for i in rows], [PLENS[i] for i in rows],
                   torch.tensor([ADV[i] for i in rows], dtype=torch.float64),
                   rl.GRPOConfig(pad_id=0, update_tokens=update_tokens), N_TOTAL)
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _update_worker(rank, deal, out):
    from torch.nn.parallel import DistributedDataParallel
    model = _model()
    w = _update(model, DistributedDataParallel(model), DEALS[deal][rank])
    if rank == 0:
        torch.save(w, out)


@pytest.mark.parametrize("deal", sorted(DEALS))
def test_update_on_two_ranks_equals_one_process(deal, tmp_path):
    """The token-level mean is over the global batch: 2 gloo ranks holding uneven shares of the
    batch (one a single response token, or nothing) make the single-process update, to float64
    precision. Dividing by each rank's own token count would differ by about 30% of the update."""
    out = str(tmp_path / "w.pt")
    run_ranks(_update_worker, 2, deal, out)
    w0 = torch.cat([p.detach().reshape(-1) for p in _model().parameters()])
    one = _update(_model(), None, range(len(SEQS)), update_tokens=1000)  # one process, one micro-batch
    two = torch.load(out, map_location="cpu")
    assert (one - w0).norm() > 1e-3  # the update moved the weights
    assert (two - one).norm() <= 1e-12 * (one - w0).norm(), float((two - one).norm() / (one - w0).norm())


def test_deal_by_tokens_gives_every_row_once_and_balances_tokens():
    """Every row goes to exactly one rank, the same deal on every call, and the ranks' token counts
    differ by at most the longest row (the greedy deal's bound: a rank only gets a row while it
    has the fewest tokens)."""
    rng = torch.Generator().manual_seed(0)
    lengths = (torch.rand(37, generator=rng) ** 3 * 200 + 10).long().tolist()  # long-tailed
    for world in (1, 2, 3, 8):
        deal = rl.deal_by_tokens(lengths, world)
        assert sorted(i for rows in deal.values() for i in rows) == list(range(len(lengths)))
        assert deal == rl.deal_by_tokens(lengths, world)
        loads = [sum(lengths[i] for i in deal[r]) for r in range(world)]
        assert max(loads) - min(loads) <= max(lengths)
    assert rl.deal_by_tokens([], 2) == {0: [], 1: []}


# ----------------------------------------------------------------------------- the step's global batch and its micro-batches


def test_step_rows_deal_the_global_batch_in_slices_with_layout_free_keys():
    """The ranks' rows, in rank order, are the single rank's rows: every prompt G times, keys that
    depend on the row's global place only; the prompts depend on the seed and the step."""
    from types import SimpleNamespace
    from tasks import running_sum as task
    args = SimpleNamespace(rl_seed=3, prompts_per_step=5, group_size=4)
    cfg = task.RunningSum()
    rows, keys, n_rows = rl.step_rows(args, cfg, 2, 0, 1)
    problems = rows[::4]  # the step's five, each G = 4 times in a row
    assert n_rows == 20 and rows == [p for p in problems for _ in range(4)]
    assert len(set(keys)) == 20
    for world in (2, 3, 8):
        parts = [rl.step_rows(args, cfg, 2, r, world) for r in range(world)]
        assert [x for part in parts for x in part[0]] == rows
        assert [x for part in parts for x in part[1]] == keys
        assert max(len(p[0]) for p in parts) - min(len(p[0]) for p in parts) <= 1
    assert rl.step_rows(args, cfg, 3, 0, 1)[0][::4] != problems


def test_group_by_length_sorts_and_respects_the_token_budget():
    lengths = {i: n for i, n in enumerate([5, 90, 7, 30, 6, 31, 200])}
    batches = rl.group_by_length(list(lengths), lengths.get, 100)
    assert sorted(i for b in batches for i in b) == list(lengths)
    flat = [lengths[i] for b in batches for i in b]
    assert flat == sorted(flat)
    for b in batches:  # padded to its longest item; only a lone item may exceed the budget
        assert len(b) * max(lengths[i] for i in b) <= 100 or len(b) == 1
    assert rl.group_by_length([], len, 100) == [[]]
