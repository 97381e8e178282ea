"""Held-out evaluation (train.py before and after RL), sharded over ranks; the check that
speculation changes no token; the stale-drafter figures at the end of a run.

The check counts the held-out responses in which speculative decoding differs from plain decoding,
greedy and sampled with exact-token sampling. In float64 that count is 0 by construction; in
float32 a pass of k + 1 tokens may round differently from k + 1 one-token passes and flip a
near-tie, so it is counted rather than asserted.

Test: python -m pytest tests/test_train.py   (a run prints both checks)
"""
import copy
import json

import torch

from drafter import Drafter
from rl import Seed, derive_seed
from harness.distributed import all_sum, gather_ranks, print0
from harness.instrument import DecodeStats, liveness_observer, observers
from harness.liveness import beat, wait_for_all
from harness.model_free import LEARNED
from speculative import autoregressive_generate, speculative_generate


@torch.no_grad()
def evaluate(model, task, problems, rank=0, world_size=1, drafter=None, temperature=0.0, seed=0,
             sampler="gumbel", k=4, stats=None):
    """Held-out accuracy (Task.correct's share) by problem size and the mean reward, and every
    response (token ids), all ranks together. Greedy by default; with a drafter, speculative
    (drafts of k). Problem j's key comes from (seed, j): with sampler "gumbel" the tokens do not
    depend on the ranks or the drafter; "rejection" is seeded per rank. stats: an
    instrument.DecodeStats that counts this rank's decoding."""
    gen = torch.Generator(device=model.wte.weight.device).manual_seed(derive_seed(seed, rank, 0, Seed.EVAL))
    mine = list(range(rank, len(problems), world_size))
    outputs = [None] * len(problems)
    for i in range(0, len(mine), 64):  # 64 problems a batch
        idx = mine[i:i + 64]
        prompts = [task.prompt_ids(problems[j]) for j in idx]
        max_new = task.response_len(max(problems[j].size for j in idx))
        how = dict(temperature=temperature, eos_id=task.eos_id, generator=gen, sampler=sampler,
                   observer=observers(stats, liveness_observer(beat)),
                   keys=[derive_seed(seed, j, 0, Seed.EVAL_KEYS) for j in idx])
        if drafter is None:
            outs, _ = autoregressive_generate(model, prompts, max_new, **how)
        else:
            outs, _ = speculative_generate(model, drafter, prompts, max_new, k=k, **how)
        for j, o in zip(idx, outs):
            outputs[j] = o
    wait_for_all()  # the shards' lengths differ, so the ranks finish far apart: each beat at every decoding step
    for part in gather_ranks(outputs):  # each rank filled its own indices
        outputs = [o if o is not None else p for o, p in zip(outputs, part)]
    rewards = [task.reward(p, o) for p, o in zip(problems, outputs)]
    return {"accuracy": task.mean_by_size(problems, [task.correct(p, o) for p, o in zip(problems, outputs)]),
            "mean reward": sum(rewards) / max(len(rewards), 1)}, outputs


def evaluate_both(model, drafter, problems, args, task, rank, world_size, when, check=False):
    """Greedy and sampled (--temperature, --eval-samples per problem) held-out accuracy; with --tlt
    on the sampling decodes speculatively: lossless, and faster, which pays for more samples. With
    check, also the check (one sample per problem). Speculation drafts k = max(--draft-ks) tokens,
    the longest draft the run may use (--block-size was checked against it); with --draft-ks 0 the
    run never speculates, nor does this."""
    if not problems:
        return {}
    k = max(args.draft_ks)
    drafter = drafter if k > 0 else None
    greedy, plain_out = evaluate(model, task, problems, rank, world_size)
    sampled, outs = evaluate(model, task, problems * args.eval_samples, rank, world_size, drafter=drafter if args.tlt else None,
                             temperature=args.temperature, seed=args.seed, sampler=args.sampler, k=k)
    length = task.mean_by_size(problems * args.eval_samples, [len(o) for o in outs])
    print0(f"held-out accuracy {when} ({len(problems)} problems), greedy:  {format_accuracy(greedy)}")
    print0(f"held-out accuracy {when}, sampled at T={args.temperature:g}: {format_accuracy(sampled)}")
    print0(f"held-out response length {when}, sampled (tokens): {format_lengths(length)}")
    if check and drafter is not None:
        _, sd_greedy = evaluate(model, task, problems, rank, world_size, drafter=drafter, k=k)
        how = dict(temperature=args.temperature, seed=args.seed + 1, sampler="gumbel", k=k)
        _, plain_sampled = evaluate(model, task, problems, rank, world_size, **how)
        _, sd_sampled = evaluate(model, task, problems, rank, world_size, drafter=drafter, **how)
        for name, a, b in (("greedy", plain_out, sd_greedy), (f"sampled at T={args.temperature:g}", plain_sampled, sd_sampled)):
            print0(f"speculative vs plain decoding, {name}: {sum(x != y for x, y in zip(a, b))} of {len(a)} "
                   f"held-out responses differ")
    return {"greedy": greedy, "sampled": sampled, "length": length}


def format_accuracy(acc):
    """Right answers (Task.correct) by problem size; the mean reward too where it differs (partial credit)."""
    line = " | ".join(f"{k} {100 * v:5.1f}%" for k, v in acc["accuracy"].items())
    return line + (f"; mean reward {acc['mean reward']:.3f}" if acc["mean reward"] != acc["accuracy"]["overall"] else "")


def format_lengths(length):
    return " | ".join(f"{k} {v:5.1f}" for k, v in length.items())


# -----------------------------------------------------------------------------
# the stale drafter: a drafter kept from early in RL, drafting for the target RL made since

def early_step(args):
    """The RL step whose target and drafter the stale-drafter figures keep: a tenth into RL."""
    return args.rl_steps // 10


def snapshot(model, drafter, step):
    """Host copies of the target's and the drafter's weights as they are at the start of `step`."""
    host = [{name: t.detach().cpu().clone() for name, t in m.state_dict().items()}
            for m in (model, drafter)]
    return {"step": step, "model": host[0], "drafter": host[1]}


def most_played_k(metrics_path):
    """The k of most speculative steps over the run's records (metrics.jsonl), or None. Each record
    counts the steps of every k up to max(--draft-ks), which a resumed run cannot change."""
    with open(metrics_path) as f:
        counts = [r["sd_steps_by_k"] for r in map(json.loads, f)]
    totals = [sum(column) for column in zip(*counts)]  # per k
    return max(range(1, len(totals)), key=totals.__getitem__) if sum(totals) else None


def stale_drafter(s, problems, metrics_path):
    """What a drafter frozen early in RL costs by the end: tokens per verify step at the k the
    bandit played most, on the held-out problems (one exact-token sample each), for (1) the drafter
    of s.early["step"] drafting for that step's target, (2) the same drafter for the final target,
    (3) the final drafter for the final target: (1) -> (2) the target's move, (2) -> (3) what idle
    training won back. -> {"step", "k", "figures": [(1), (2), (3)]}, or None (nothing to measure)."""
    args, early = s.args, s.early
    if not (args.tlt and args.drafter in LEARNED) or early is None or not problems:
        return None
    k = gather_ranks(most_played_k(metrics_path) if s.rank == 0 else None)[0]  # rank 0's file
    if k is None:
        return None
    then = copy.deepcopy(s.model)
    then.load_state_dict(early["model"])
    kept = [drafter_on(t, early["drafter"], s.drafter.n_layer) for t in (then, s.model)]
    pairs = ((then, kept[0]), (s.model, kept[1]), (s.model, s.drafter))
    return {"step": early["step"], "k": k,
            "figures": [tokens_per_verify(s, target, d, problems, k) for target, d in pairs]}


def drafter_on(target, state, n_layer=1):
    """A drafter with the weights `state` on `target`'s embedding and head, in eval mode."""
    d = Drafter(target, n_layer).to(target.wte.weight.device).eval()
    d.load_state_dict(state)
    return d


def tokens_per_verify(s, target, drafter, problems, k):
    """Tokens per verify step of `drafter` drafting k for `target` on the held-out problems, sampled
    as the rollouts are (one sample each), all ranks together."""
    stats = DecodeStats()
    evaluate(target, s.task, problems, s.rank, s.world_size, drafter=drafter, k=k,
             temperature=s.args.temperature, seed=s.args.seed + 2, stats=stats)
    stats.settle()  # sync: its counts
    total = all_sum({"tokens": stats.sd_tokens, "steps": stats.sd_row_steps}, target.wte.weight.device)
    return total["tokens"] / max(total["steps"], 1)
