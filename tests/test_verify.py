"""Tests for speculative.py's samplers and verify rules: exact in distribution, token by token and
over whole sequences, and the exact-token noise, a pure function of (row key, position, token id).

Statistical tests compare empirical distributions with exact ones by total variation (TV). For K
categories and N independent draws, E[TV] <= 0.5 * sqrt(K / N) (Cauchy-Schwarz on
sum_i E|p^_i - p_i| <= sum_i sqrt(p_i (1 - p_i) / N)). TV of an empirical distribution changes by at
most 1/N when one draw changes, so McDiarmid gives P(TV >= E[TV] + t) <= exp(-2 N t^2). Every TV
tolerance below is 4 * 0.5 * sqrt(K / N), i.e. t >= 3 * 0.5 * sqrt(K / N), so a correct
implementation fails with probability at most exp(-4.5 K) per check (K >= 4: below 1.6e-8). Rates
(fractions of N Bernoulli draws) use Hoeffding: P(|mean - mu| >= t) <= 2 exp(-2 N t^2). Everything
is seeded, so a run is deterministic; the odds say how unlucky a seed would have to be for a correct
implementation to fail.
"""
import itertools
import math
import random

import pytest
import torch

from drafter import Drafter
from conftest import every_drafter, randomize, tiny
from harness.instrument import DecodeStats
from speculative import GumbelSampler, draw, gumbel_noise, gumbel_seeds, mix32, probs, verify, verify_gumbel
from speculative import autoregressive_generate, speculative_generate

pytestmark = pytest.mark.usefixtures("one_thread")


def gumbel_argmax(logits, temperature, noise):
    """The Gumbel-max token with the whole noise given: what GumbelSampler.choose must equal."""
    return (logits.float() / temperature + noise).argmax(-1)


def noise_of(keys, positions, V):
    """The "gumbel" sampler's noise (B, T, V) of rows with keys (B,) at positions (B, T)."""
    return gumbel_noise(gumbel_seeds(torch.as_tensor(keys), torch.as_tensor(positions)), V)


def tv_tolerance(K, N):
    """4x the bound on the expected TV of N draws over K categories (see the module docstring)."""
    return 4 * 0.5 * math.sqrt(K / N)


def tv(a, b):
    return 0.5 * float((a.double() - b.double()).abs().sum())


# ----------------------------------------------------------------------------- verify, statistically

N_VERIFY = 40000
V_V = 5


def random_dists(g, shape, scale=1.5):
    return torch.softmax(torch.randn(shape, generator=g) * scale, dim=-1)


def make_pq(case, k, g, dtype=torch.float32):
    """Target and drafter distributions p (k+1, V), q (k, V); with dtype bfloat16 they are what
    `probs` makes of bf16 logits (the logits a bf16 forward gives), zeros kept."""
    p = random_dists(g, (k + 1, V_V))
    q = random_dists(g, (k, V_V))
    if case == "q_zero":  # the drafter never proposes tokens 0 and 1, the target likes them
        q[:, :2] = 0
        p[:, :2] += 0.3
    elif case == "p_zero":  # the target never emits token 4 (nor 3 at even positions)
        p[:, 4] = 0
        p[0::2, 3] = 0
        q[:, 3:] += 0.3
    p = p / p.sum(-1, keepdim=True)
    q = q / q.sum(-1, keepdim=True)
    if dtype != torch.float32:
        p, q = probs(p.log().to(dtype), 1.0), probs(q.log().to(dtype), 1.0)
    return p, q


def run_verify(p, q, N, g):
    """N independent verify calls on the same (p, q): draft from q, then verify."""
    k = q.shape[0]
    P = p[None].expand(N, -1, -1).contiguous()
    Q = q[None].expand(N, -1, -1).contiguous()
    drafts = torch.multinomial(Q.reshape(N * k, -1), 1, replacement=True, generator=g).view(N, k)
    n_acc, nxt = verify(drafts, Q, P, generator=g)
    return drafts, n_acc, nxt


def first_emitted(drafts, n_acc, nxt):
    return torch.where(n_acc >= 1, drafts[:, 0], nxt)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [1, 2, 3])
@pytest.mark.parametrize("case", ["random", "q_zero", "p_zero"])
def test_verify_first_token_is_distributed_as_target(case, k, dtype):
    g = torch.Generator().manual_seed(100 * k + len(case))
    p, q = make_pq(case, k, g, dtype)
    drafts, n_acc, nxt = run_verify(p, q, N_VERIFY, g)
    assert n_acc.shape == nxt.shape == (N_VERIFY,)
    assert int(n_acc.min()) >= 0 and int(n_acc.max()) <= k
    first = first_emitted(drafts, n_acc, nxt)
    emp = torch.bincount(first, minlength=V_V).double() / N_VERIFY
    # K = 5, N = 40000: tolerance 0.0224; false failure <= exp(-22.5) ~ 1.7e-10
    tol = tv_tolerance(V_V, N_VERIFY)
    assert tv(emp, p[0]) <= tol, (emp, p[0])
    # tokens the target gives zero mass never come out, at any position
    zero = p[0] == 0
    assert not bool(zero[first].any())
    # acceptance is exactly as efficient as rejection sampling allows: the drafts are independent
    # here (p does not depend on them), so P(n_acc >= i) = prod_{j < i} sum_x min(p_j, q_j).
    # Hoeffding with t = 0.02, N = 40000: false failure <= 2 exp(-32) ~ 2.5e-14 per rate.
    # (This rules out a "lossless" verify that always rejects and resamples from p.)
    alpha = torch.minimum(p[:k], q).sum(-1)
    for i in range(1, k + 1):
        expected = float(alpha[:i].prod())
        got = float((n_acc >= i).double().mean())
        assert abs(got - expected) <= 0.02, (i, got, expected)
    # every accepted draft has positive target probability
    accepted = torch.arange(k)[None] < n_acc[:, None]
    p_of_draft = p[:k].gather(-1, drafts.T).T  # (N, k)
    assert bool((p_of_draft[accepted] > 0).all())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k", [2, 3])
@pytest.mark.parametrize("case", ["random", "q_zero", "p_zero"])
def test_verify_first_two_tokens_jointly_distributed_as_target(case, k, dtype):
    """The first two emitted tokens have joint p_0 x p_1. A row that emits only one token this
    step (n_accepted = 0) gets its second token from the next verify step, which drafts from
    q_1.. and verifies against p_1.., exactly what speculative decoding would do next."""
    g = torch.Generator().manual_seed(7 + 10 * k + len(case))
    p, q = make_pq(case, k, g, dtype)
    assert tv(p[0], p[1]) > 0.1  # the two positions differ, so a swapped position would show
    drafts, n_acc, nxt = run_verify(p, q, N_VERIFY, g)
    first = first_emitted(drafts, n_acc, nxt)
    d2, n2, x2 = run_verify(p[1:], q[1:], N_VERIFY, g)
    second = torch.where(n_acc >= 2, drafts[:, 1], torch.where(n_acc == 1, nxt, first_emitted(d2, n2, x2)))
    emp = torch.bincount(first * V_V + second, minlength=V_V * V_V).double() / N_VERIFY
    exact = (p[0][:, None] * p[1][None, :]).reshape(-1)
    # K = 25, N = 40000: tolerance 0.05; false failure <= exp(-112.5)
    assert tv(emp, exact) <= tv_tolerance(V_V * V_V, N_VERIFY), (emp, exact)


def test_verify_identical_p_q_accepts_everything_and_disjoint_rejects_everything():
    g = torch.Generator().manual_seed(11)
    k, N = 3, 20000
    p = random_dists(g, (k + 1, V_V))
    drafts, n_acc, nxt = run_verify(p, p[:k].clone(), N, g)
    assert bool((n_acc == k).all())
    emp = torch.bincount(nxt, minlength=V_V).double() / N
    assert tv(emp, p[k]) <= tv_tolerance(V_V, N)  # the bonus token comes from p_k
    # disjoint supports: q only on {0, 1}, p only on {2, 3, 4}
    q = torch.zeros(k, V_V)
    q[:, :2] = 0.5
    p2 = torch.zeros(k + 1, V_V)
    p2[:, 2:] = random_dists(g, (k + 1, 3))
    drafts, n_acc, nxt = run_verify(p2, q, N, g)
    assert bool((n_acc == 0).all())
    emp = torch.bincount(nxt, minlength=V_V).double() / N
    assert tv(emp, p2[0]) <= tv_tolerance(V_V, N)


def test_verify_greedy_one_hot():
    """Greedy: accept iff the draft is the target's argmax; the next token is the target's argmax
    at the first mismatch (or at position k when every draft matched)."""
    g = torch.Generator().manual_seed(12)
    B, k, V = 3000, 4, 3
    p = probs(torch.randn(B, k + 1, V, generator=g), 0)
    q = probs(torch.randn(B, k, V, generator=g), 0)
    assert bool((p.sum(-1) == 1).all()) and bool((p.max(-1).values == 1).all())
    drafts = q.argmax(-1)
    n_acc, nxt = verify(drafts, q, p, generator=g)
    match = drafts == p[:, :k].argmax(-1)
    expected_n = match.long().cumprod(1).sum(1)
    assert torch.equal(n_acc, expected_n)
    assert torch.equal(nxt, p.argmax(-1).gather(1, expected_n[:, None])[:, 0])
    assert set(n_acc.tolist()) == set(range(k + 1))  # every outcome occurred: the check is not vacuous
    # no generator: same answer, greedy is deterministic
    n_acc2, nxt2 = verify(drafts, q, p)
    assert torch.equal(n_acc2, n_acc) and torch.equal(nxt2, nxt)


# ----------------------------------------------------------------------------- sequence-level lossless

V_S = 4
LEN_S = 3
PROMPT_S = [1]


@pytest.fixture(scope="module")
def sampling_setup():
    target = tiny(V_S, seed=21, std=0.25)  # larger weights make the target nearly deterministic
    drafter = randomize(Drafter(target), seed=22, std=1.0)
    return target, drafter


def exact_sequence_dist(target, temperature):
    """P(x_1 x_2 x_3 | prompt) for all V^3 sequences, by enumeration; index = base-V code."""
    seqs = torch.tensor(list(itertools.product(range(V_S), repeat=LEN_S)))  # (V^3, 3), code order
    idx = torch.cat([torch.tensor(PROMPT_S).expand(len(seqs), -1), seqs[:, :-1]], dim=1)
    with torch.no_grad():
        logits, _ = target(idx)
    logp = torch.log_softmax(logits.double()[:, len(PROMPT_S) - 1:] / temperature, dim=-1)
    return logp.gather(-1, seqs[..., None])[..., 0].sum(-1).exp()


def empirical(outputs):
    codes = torch.tensor([sum(t * V_S ** (LEN_S - 1 - i) for i, t in enumerate(o)) for o in outputs])
    assert all(len(o) == LEN_S for o in outputs)
    return torch.bincount(codes, minlength=V_S ** LEN_S).double() / len(outputs)


ROWS, CALLS = 8000, 4  # N = 32000 sequences per method


@pytest.mark.parametrize("method,k,temperature,sampler", [
    ("speculative", 2, 1.0, "rejection"),
    ("speculative", 1, 1.0, "rejection"),
    ("speculative", 3, 0.7, "rejection"),
    ("autoregressive", 0, 1.0, "rejection"),
    ("sibling", 2, 1.0, "rejection"),
    ("speculative", 2, 1.0, "gumbel"),
    ("speculative", 3, 0.7, "gumbel"),
    ("autoregressive", 0, 1.0, "gumbel"),
])
def test_sequence_distribution_is_the_targets(sampling_setup, method, k, temperature, sampler):
    target, drafter = sampling_setup
    exact = exact_sequence_dist(target, temperature)
    assert float(exact.sum()) == pytest.approx(1.0)
    assert float(exact.max()) < 0.5  # a spread-out target: the test has something to detect
    g = torch.Generator().manual_seed(1000 + k)
    outputs, hist = [], {}
    for _ in range(CALLS):
        if method != "autoregressive":  # one GRPO group of 8000 rows: each row drafts from 15 of its siblings
            stats = DecodeStats()
            out, _ = speculative_generate(target, every_drafter(drafter).get(method, drafter), [PROMPT_S] * ROWS, LEN_S,
                                          k=k, temperature=temperature, generator=g, sampler=sampler, observer=stats)
            for a, c in stats.settle().accept_hist.items():
                hist[a] = hist.get(a, 0) + c
        else:
            out, _ = autoregressive_generate(target, [PROMPT_S] * ROWS, LEN_S, temperature=temperature,
                                             generator=g, sampler=sampler)
        outputs += out
    N = len(outputs)
    if method != "autoregressive":
        assert len(hist) > 1, hist  # drafts were both accepted and rejected
    emp = empirical(outputs)
    # K = 64, N = 32000: tolerance 0.0894; false failure <= exp(-288)
    assert tv(emp, exact) <= tv_tolerance(V_S ** LEN_S, N), tv(emp, exact)
    # the per-position marginals are a sharper test of a bias at one position:
    # K = 4, N = 32000: tolerance 0.0224 each; false failure <= exp(-18) ~ 1.5e-8 each
    e3 = emp.view(V_S, V_S, V_S)
    x3 = exact.view(V_S, V_S, V_S)
    for dims in [(1, 2), (0, 2), (0, 1)]:
        assert tv(e3.sum(dims), x3.sum(dims)) <= tv_tolerance(V_S, N), dims
    # and the conditional of x_3 given the most likely (x_1, x_2), where SD's verify acts last
    a, b = divmod(int(x3.sum(2).argmax()), V_S)
    n_ab = int(round(float(e3[a, b].sum()) * N))
    assert n_ab > 3000
    assert tv(e3[a, b] / e3[a, b].sum(), x3[a, b] / x3[a, b].sum()) <= tv_tolerance(V_S, n_ab)


# ----------------------------------------------------------------------------- exact-token sampling ("gumbel")


def test_mix32_is_lowbias32():
    def lowbias32(x):
        x ^= x >> 16
        x = (x * 0x7FEB352D) & 0xFFFFFFFF
        x ^= x >> 15
        x = (x * 0x846CA68B) & 0xFFFFFFFF
        return x ^ (x >> 16)
    xs = [0, 1, 2, 0xFFFFFFFF, 0x80000000] + [random.Random(0).getrandbits(32) for _ in range(200)]
    t = torch.tensor(xs)
    assert mix32(t).tolist() == [lowbias32(x) for x in xs]
    assert t.tolist() == xs  # a new tensor: its input is left as it was


def test_gumbel_noise_is_a_function_of_key_position_and_token():
    keys, pos = torch.tensor([3, 2 ** 40 + 3, 3]), torch.tensor([[5, 6], [5, 6], [6, 5]])
    g = noise_of(keys, pos, 7)
    assert g.shape == (3, 2, 7) and g.dtype == torch.float32 and bool(torch.isfinite(g).all())
    assert torch.equal(g[0, 1], g[2, 0]) and torch.equal(g[0, 0], g[2, 1])  # same (key, position): same noise
    assert not torch.equal(g[0], g[1])  # keys that differ only in their high 32 bits: other noise
    assert torch.equal(noise_of(keys[:1], pos[:1, 1:], 7)[0, 0], g[0, 1])  # batch layout does not matter
    assert len(set(g[:2].flatten().tolist())) == 28  # otherwise all distinct


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("temperature", [1.0, 0.5, 2.0])
def test_gumbel_tokens_follow_softmax_at_temperature(temperature, dtype):
    """Tokens drawn as argmax(logits / T + g(key, t)) over N keys at one position, and over N
    positions of one key, follow softmax(logits / T). K = 5, N = 40000: TV tolerance 0.0224,
    false failure <= exp(-22.5) per check; pairs of adjacent positions of one key (K = 25, N = 20000,
    tolerance 0.0707, false failure <= exp(-112)) are independent. bf16 logits (a bf16 forward's)
    follow the softmax of their own values: the noise is added in float32."""
    g = torch.Generator().manual_seed(31)
    logits = (torch.randn(V_V, generator=g) * 1.5).to(dtype)
    exact = torch.softmax(logits.double() / temperature, -1)
    N = N_VERIFY
    by_key = gumbel_argmax(logits.expand(N, 1, V_V), temperature,
                           noise_of(torch.arange(N) * 7919 + 11, torch.full((N, 1), 42), V_V))[:, 0]
    by_pos = gumbel_argmax(logits.expand(1, N, V_V), temperature,
                           noise_of(torch.tensor([12345]), torch.arange(N)[None], V_V))[0]
    for tokens in (by_key, by_pos):
        assert tv(torch.bincount(tokens, minlength=V_V).double() / N, exact) <= tv_tolerance(V_V, N)
    pairs = by_pos.view(-1, 2)
    emp = torch.bincount(pairs[:, 0] * V_V + pairs[:, 1], minlength=V_V * V_V).double() / (N // 2)
    assert tv(emp, (exact[:, None] * exact[None, :]).reshape(-1)) <= tv_tolerance(V_V * V_V, N // 2)


def test_exponential_race_sample_is_exact_and_never_draws_zero_weight():
    g = torch.Generator().manual_seed(32)
    p = torch.tensor([0.5, 0.0, 0.2, 0.3, 0.0])
    draws = draw(p.expand(N_VERIFY, -1), generator=g)
    assert not bool(torch.isin(draws, torch.tensor([1, 4])).any())
    assert tv(torch.bincount(draws, minlength=5).double() / N_VERIFY, p) <= tv_tolerance(5, N_VERIFY)


def test_verify_gumbel_keeps_drafts_up_to_the_first_mismatch():
    draft = torch.tensor([[1, 2, 3], [1, 2, 3], [0, 2, 3], [1, 2, 3]])
    target = torch.tensor([[1, 2, 3, 4], [1, 5, 3, 4], [1, 2, 3, 4], [1, 2, 0, 4]])
    n_acc = verify_gumbel(draft, target)
    assert n_acc.tolist() == [3, 1, 0, 2]


def test_gumbel_sampler_choice_is_the_noisy_argmax_and_ignores_the_logits_dtype():
    """GumbelSampler.choose at positions (B, T) picks the tokens of one argmax over the whole noise of
    each row's key at each position (q None); bfloat16 logits give the tokens of the same logits in
    float32 (the noise is added in float32, never coarsened to bf16); temperature 0 is the argmax."""
    g = torch.Generator().manual_seed(0)
    B, T, V = 6, 3, 50
    logits = torch.randn(B, T, V, generator=g) * 2
    keys, pos = torch.arange(B) * 31 + 5, torch.arange(T).expand(B, T) + 7
    seeds = gumbel_seeds(keys, pos)
    whole = gumbel_argmax(logits, 1.0, gumbel_noise(seeds, V))
    assert len(set(whole.flatten().tolist())) > 5  # varied tokens: a row given another's noise would show
    sampler = GumbelSampler(1.0, keys, V, 16)
    tokens, q = sampler.choose(logits, sampler.noise(pos))
    assert q is None and torch.equal(tokens, whole)
    other = GumbelSampler(1.0, keys.flip(0), V, 16)
    assert not torch.equal(other.choose(logits, other.noise(pos))[0], whole)  # keys matter
    low = logits.bfloat16()
    exact = gumbel_argmax(low.float(), 0.7, gumbel_noise(seeds, V))
    cool, greedy = GumbelSampler(0.7, keys, V, 16), GumbelSampler(0.0, keys, V, 16)
    assert torch.equal(cool.choose(low, cool.noise(pos))[0], exact)
    assert greedy.noise(pos) is None and torch.equal(greedy.choose(logits, None)[0], logits.argmax(-1))


def test_rows_whose_old_32_bit_streams_were_a_shift_apart_get_unrelated_noise():
    """The old design gave a row a 32-bit stream s = mix(mix(key_hi) ^ key_lo) and position t the
    seed mix(s + t * 0x9E3779B9): two keys whose streams differ by m * 0x9E3779B9 shared all their
    noise m positions apart. Build such a pair (key_hi = 0, so s = mix(key_lo); the second key's low
    half by inverting the mixer) and check that the 64-bit seeds now share nothing at any shift."""
    G, M = 0x9E3779B9, 0xFFFFFFFF

    def mix(x):  # lowbias32
        x ^= x >> 16
        x = (x * 0x7FEB352D) & M
        x ^= x >> 15
        x = (x * 0x846CA68B) & M
        return x ^ (x >> 16)

    def unmix(x):  # its inverse (Wellons' hash-prospector)
        x ^= x >> 16
        x = (x * 0x43021123) & M
        x ^= (x >> 15) ^ (x >> 30)
        x = (x * 0x1D69E2A5) & M
        return x ^ (x >> 16)

    key1, m, N = 12345, 5, 40
    s2 = (mix(key1) + m * G) & M
    key2 = unmix(s2)
    assert mix(key2) == s2  # the construction holds: the old streams are m steps apart
    old_seed = lambda key, t: mix((mix(key) + t * G) & M)  # noqa: E731
    assert all(old_seed(key2, t) == old_seed(key1, t + m) for t in range(N))  # the old noise, shared
    pos = torch.arange(N)[None].expand(2, N)
    seeds = gumbel_seeds(torch.tensor([key1, key2]), pos)
    for shift in range(-N + 1, N):  # no position of one row has a seed of the other, at any shift
        a, b = seeds[0, max(shift, 0):N + min(shift, 0)], seeds[1, max(-shift, 0):N - max(shift, 0)]
        assert not bool((a == b).any()), shift
    noise = gumbel_noise(seeds, 16)  # (2, N, 16)
    assert not torch.equal(noise[0, m:], noise[1, :-m])


def test_verify_with_no_drafts_emits_the_targets_token():
    """k = 0 drafts: nothing to accept, and the token emitted is the target's own (a draw from
    p[:, 0]); both rules. One-hot p makes the draw certain."""
    B, V = 5, 9
    want = torch.tensor([3, 0, 8, 3, 1])
    p = torch.zeros(B, 1, V).scatter_(-1, want[:, None, None], 1.0)
    n_acc, nxt = verify(torch.zeros(B, 0, dtype=torch.long), torch.zeros(B, 0, V), p, torch.Generator().manual_seed(0))
    assert n_acc.tolist() == [0] * B and torch.equal(nxt, want)
    assert verify_gumbel(torch.zeros(B, 0, dtype=torch.long), want[:, None]).tolist() == [0] * B
