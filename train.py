"""Warm up a small GPT on the running-sum task, then improve it with GRPO and TLT rollouts.

    python train.py                                    # one process, CPU or one GPU
    torchrun --standalone --nproc_per_node=2 train.py  # several ranks (gloo on CPU, nccl on CUDA)

(1) Supervised warm-up of the target on reference traces; (2) warm-up of the drafter on the
target's own samples; both cached in --out-dir and reused when their config matches.
(3) --rl-steps of GRPO. Each step: every rank rolls out its shard (speculative decoding in the
long tail with --tlt on), ranks that finish early train the drafter until the last one finishes
(--drafter-updates on), the drafters are synced, then one GRPO update of the target under DDP.
Rank 0 logs one line per step and appends a record to <out-dir>/metrics.jsonl; a checkpoint with
everything needed to continue is written atomically every --ckpt-every steps, and rerunning the
same command resumes from it.
"""
import argparse
import copy
import datetime
import hashlib
import json
import math
import os
import random
import sys
import time
import warnings
from contextlib import nullcontext
from dataclasses import asdict

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.rendezvous import rendezvous
from torch.nn.parallel import DistributedDataParallel as DDP

import rl
import task
from drafter import Drafter, DrafterBuffer, acceptance_proxy, make_optimizer, train_step
from model import GPT, GPTConfig
from rollout import ARMS, Bandit, rollout, sync
from scheduler import gather_ranks, idle_train, render_timeline, sync_drafter
from speculative import SAMPLERS, autoregressive_generate, speculative_generate

# a rank that dies makes its peers fail in a collective after at most this long (seconds)
COLLECTIVE_TIMEOUT_S = int(os.environ.get("TLT_COLLECTIVE_TIMEOUT", 120))


def on_off(v):
    if v not in ("on", "off"):
        raise argparse.ArgumentTypeError(f"expected on or off, got {v!r}")
    return v == "on"


class OneLineParser(argparse.ArgumentParser):
    """Bad input: one clear line on stderr and exit code 2 (argparse's default prints the usage too)."""

    def error(self, message):
        self.exit(2, f"error: {message} (see --help)\n")


def task_config(args, warmup=False):
    """The task as the flags define it; warmup=True: with the warm-up's problem-size exponent."""
    return task.TaskConfig(max_n=args.max_n, alpha=args.warmup_alpha if warmup else args.alpha,
                           recheck=args.recheck, max_passes=args.max_passes, noise=args.noise)


def parse_args(argv=None):
    p = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    # run
    p.add_argument("--out-dir", default="out", help="where checkpoints and metrics.jsonl go")
    p.add_argument("--warmup-dir", default=None, help="where the warm-up checkpoints are cached (default: --out-dir)")
    p.add_argument("--seed", type=int, default=1337, help="base seed; per-rank, per-step seeds derive from it")
    p.add_argument("--rl-seed", type=int, default=None, help="seed of the RL phase only (default: --seed), for noise estimates")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="where to run")
    # task
    p.add_argument("--max-n", type=int, default=task.TaskConfig.max_n, help="largest problem size (digits to sum)")
    p.add_argument("--alpha", type=float, default=task.TaskConfig.alpha, help="tail exponent of the problem-size distribution")
    p.add_argument("--recheck", type=float, default=task.TaskConfig.recheck, help="reference traces: probability of one more re-check "
                   "pass after each answer (lengths then vary between samples of one prompt)")
    p.add_argument("--max-passes", type=int, default=task.TaskConfig.max_passes, help="reference traces: at most this many passes")
    p.add_argument("--noise", type=float, default=task.TaskConfig.noise, help="reference traces: probability that a running-sum step "
                   "is written wrong (the warmed-up target then errs at about this rate when sampling)")
    p.add_argument("--warmup-alpha", type=float, default=1.5, help="tail exponent of the problem sizes in the "
                   "target warm-up: more small problems than in RL, where the look-up is learned")
    # model
    p.add_argument("--n-layer", type=int, default=12, help="target transformer layers")
    p.add_argument("--n-head", type=int, default=4, help="attention heads")
    p.add_argument("--n-embd", type=int, default=48, help="model width")
    p.add_argument("--block-size", type=int, default=256, help="longest sequence the model holds")
    # target warm-up
    p.add_argument("--warmup-steps", type=int, default=2600, help="supervised optimizer steps for the target")
    p.add_argument("--warmup-tokens", type=int, default=2048, help="padded tokens per warm-up batch, all ranks together")
    p.add_argument("--warmup-lr", type=float, default=6e-3, help="peak learning rate of the target warm-up")
    p.add_argument("--merge-init", type=on_off, default=True, metavar="on|off", help="start each labelled-digit "
                   "token's embedding as the sum of its label's and its digit's (off: random, as every other token)")
    # drafter
    p.add_argument("--drafter-warmup-seqs", type=int, default=4096, help="target samples the drafter warms up on")
    p.add_argument("--drafter-warmup-steps", type=int, default=4000, help="drafter optimizer steps in its warm-up")
    p.add_argument("--drafter-lr", type=float, default=2e-3, help="peak drafter learning rate of the warm-up")
    p.add_argument("--drafter-online-lr", type=float, default=5e-5, help="drafter learning rate on idle ranks during RL")
    p.add_argument("--drafter-batch", type=int, default=8, help="sequences per drafter training step")
    p.add_argument("--drafter-keep", type=int, default=32, help="RL steps of hidden states the drafter buffer keeps")
    # RL
    p.add_argument("--rl-steps", type=int, default=300, help="GRPO steps")
    p.add_argument("--prompts-per-step", type=int, default=4, help="prompts per RL step, all ranks together")
    p.add_argument("--group-size", type=int, default=8, help="responses per prompt (the GRPO group)")
    p.add_argument("--rl-lr", type=float, default=1e-4, help="learning rate of the GRPO updates")
    p.add_argument("--rl-epochs", type=int, default=1, help="optimizer passes over each rollout")
    p.add_argument("--clip-eps", type=float, default=0.2, help="PPO clip range")
    p.add_argument("--kl-coef", type=float, default=0.0, help="weight of the KL to the warmed-up target (0: off)")
    p.add_argument("--temperature", type=float, default=1.0, help="rollout sampling temperature")
    p.add_argument("--sampler", default="gumbel", choices=SAMPLERS, help="gumbel: every token fixed by (sequence key, "
                   "position), so plain and speculative rollouts give the same tokens; rejection: classic "
                   "speculative sampling, the same distribution but other samples")
    p.add_argument("--update-tokens", type=int, default=1024, help="padded tokens per GRPO micro-batch")
    # TLT
    p.add_argument("--tlt", type=on_off, default=True, metavar="on|off", help="speculative decoding in the tail (off: plain baseline)")
    p.add_argument("--drafter-updates", type=on_off, default=True, metavar="on|off", help="train the drafter on idle ranks (off: frozen)")
    p.add_argument("--sd-threshold", type=int, default=64, help="speculative steps only when the running batch is at most this")
    p.add_argument("--draft-ks", default=",".join(map(str, ARMS)), help="draft lengths the bandit picks from (0: a plain "
                   "step); one value fixes k, e.g. to compare two drafters at the same k")
    # logging, evaluation, checkpoints
    p.add_argument("--eval-per-bucket", type=int, default=40, help="held-out problems per size bucket (0: no evaluation)")
    p.add_argument("--eval-samples", type=int, default=16, help="samples per held-out problem for the sampled accuracy")
    p.add_argument("--timeline-every", type=int, default=10, help="print the per-rank timeline every N steps (0: never)")
    p.add_argument("--ckpt-every", type=int, default=10, help="write the RL checkpoint every N steps")
    args = p.parse_args(argv)
    positive = ("max_n", "max_passes", "n_layer", "n_head", "n_embd", "block_size", "warmup_steps", "warmup_tokens", "warmup_lr",
                "drafter_warmup_seqs", "drafter_warmup_steps", "drafter_batch", "drafter_keep", "drafter_lr", "drafter_online_lr",
                "prompts_per_step", "group_size", "rl_epochs", "rl_lr", "clip_eps", "update_tokens", "ckpt_every", "eval_samples")
    non_negative = ("recheck", "noise", "warmup_alpha", "rl_steps", "kl_coef", "temperature", "sd_threshold", "timeline_every", "alpha", "eval_per_bucket")
    for names, ok, what in ((positive, lambda v: v > 0, "positive"), (non_negative, lambda v: v >= 0, "non-negative")):
        for name in names:
            if not ok(getattr(args, name)):  # written so that NaN fails too
                p.error(f"--{name.replace('_', '-')} must be {what}, got {getattr(args, name)}")
    try:
        args.draft_ks = tuple(int(k) for k in args.draft_ks.split(","))
    except ValueError:
        p.error(f"--draft-ks takes comma-separated integers, got {args.draft_ks!r}")
    if min(args.draft_ks) < 0 or len(set(args.draft_ks)) != len(args.draft_ks):
        p.error(f"--draft-ks must be distinct non-negative integers, got {args.draft_ks}")
    if args.max_n > len(task.LABELS):
        p.error(f"--max-n must be at most {len(task.LABELS)}")
    if args.recheck >= 1 or args.noise >= 1:
        p.error("--recheck and --noise are probabilities below 1")
    need = task_config(args).max_seq_len + max(args.draft_ks)
    if args.block_size < need:
        p.error(f"--block-size {args.block_size} is too small for --max-n {args.max_n}: the longest prompt + "
                f"response + {max(args.draft_ks)} draft tokens needs {need}")
    if args.n_embd % args.n_head or (args.n_embd // args.n_head) % 2:
        p.error(f"--n-embd {args.n_embd} must split into --n-head {args.n_head} heads of even size")
    args.warmup_dir = args.warmup_dir or args.out_dir
    args.rl_seed = args.seed if args.rl_seed is None else args.rl_seed
    return args


# -----------------------------------------------------------------------------
# distributed helpers

def wants_cuda(device_arg):
    """--device auto|cpu|cuda -> whether to run on CUDA."""
    return torch.cuda.is_available() if device_arg == "auto" else device_arg == "cuda"


def compute_init(device_arg="auto"):
    """-> (ddp, rank, local_rank, world_size, device). Under torchrun (RANK set) this joins the
    process group: nccl on CUDA, gloo on CPU. Without torchrun it is rank 0 of 1, same code path."""
    ddp = "RANK" in os.environ
    rank = int(os.environ.get("RANK", 0))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    use_cuda = wants_cuda(device_arg)
    if use_cuda and not torch.cuda.is_available():
        raise SystemExit("error: --device cuda but CUDA is not available")
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    n_gpus = torch.cuda.device_count() if use_cuda else 0
    device = torch.device(f"cuda:{local_rank % n_gpus}" if use_cuda else "cpu")
    if use_cuda:  # more ranks than GPUs: they share them round-robin
        torch.cuda.set_device(device)
        if local_world > n_gpus and rank == 0:
            warnings.warn(f"{local_world} ranks share {n_gpus} GPU(s): collectives go through gloo, not NCCL")
    else:  # ranks sharing a CPU: split the cores (unless OMP_NUM_THREADS says how many), or they fight over them
        cores = os.cpu_count() or 1
        if "OMP_NUM_THREADS" not in os.environ:  # torchrun sets it to 1 when it starts several ranks
            torch.set_num_threads(max(1, cores // local_world))
        if local_world > cores and rank == 0:
            warnings.warn(f"{local_world} ranks share {cores} CPU cores: steps will be slow and timings noisy")
    if ddp:
        timeout = datetime.timedelta(seconds=COLLECTIVE_TIMEOUT_S)
        store, _, _ = next(rendezvous("env://", rank, world_size, timeout=timeout))
        # after torchrun restarts a failed group (--max-restarts), the agent's store still holds the
        # dead group's addresses; a prefix per attempt keeps the new group from dialling them
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        # NCCL needs a GPU of its own per rank; gloo also reduces CUDA tensors, so it serves shared GPUs
        nccl = use_cuda and local_world <= n_gpus
        dist.init_process_group("nccl" if nccl else "gloo", store=dist.PrefixStore(f"tlt/attempt{attempt}", store),
                                rank=rank, world_size=world_size, timeout=timeout, device_id=device if nccl else None)
    return ddp, rank, local_rank, world_size, device


def print0(*a, **kw):
    if int(os.environ.get("RANK", 0)) == 0:
        print(*a, **kw, flush=True)


def all_sum(values, device):
    """Sum a list of floats over ranks."""
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_initialized():
        dist.all_reduce(t)
    return t.tolist()


def derive_seed(*parts):
    """A seed for (base seed, rank, step, purpose): no global reseeding inside loops."""
    h = 0
    for x in parts:
        h = (h * 1_000_003 + int(x)) % (2 ** 61 - 1)
    return h


# -----------------------------------------------------------------------------
# checkpoints: atomic writes, safe loads, config checked

def save_atomic(obj, path):
    for name, t in _tensors(obj):
        if t.is_floating_point() and not torch.isfinite(t).all():  # never let NaN weights replace good ones
            raise RuntimeError(f"refusing to write {path}: {name} is not finite")
    tmp = f"{path}.tmp"
    torch.save(obj, tmp)
    os.replace(tmp, path)  # a kill before this line leaves the previous file intact


def _tensors(obj, prefix=""):
    if isinstance(obj, torch.Tensor):
        yield prefix, obj
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _tensors(v, f"{prefix}.{k}" if prefix else str(k))
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            yield from _tensors(v, f"{prefix}[{i}]")


def _flatten(d, prefix=""):
    out = {}
    for k, v in d.items():
        out.update(_flatten(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


def load_checked(path, expected_meta):
    """Load a checkpoint saved with meta=expected_meta; exit with one clear line otherwise."""
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # truncated, corrupt, or not a checkpoint
        raise SystemExit(f"error: cannot read checkpoint {path} ({type(e).__name__}); delete it or use another --out-dir")
    got = ckpt.get("meta") if isinstance(ckpt, dict) else None
    if got != expected_meta:
        want, have = _flatten(expected_meta), _flatten(got if isinstance(got, dict) else {})
        diff = [f"{k} {have.get(k)} there, {want.get(k)} here" for k in sorted(set(want) | set(have))
                if want.get(k) != have.get(k)]
        raise SystemExit(f"error: checkpoint {path} was made with a different config ({'; '.join(diff[:4])}"
                         f"{'; ...' if len(diff) > 4 else ''}); delete it or use another --out-dir")
    return ckpt


# -----------------------------------------------------------------------------
# target warm-up: supervised training on reference traces

def group_by_length(items, length, token_budget):
    """Sort by length and cut into batches of about `token_budget` padded tokens (a batch is padded
    to its longest item). On long-tailed lengths this keeps padding small; it batches the warm-up
    data and the GRPO micro-batches alike. Always returns at least one (possibly empty) batch."""
    batches, cur = [], []
    for it in sorted(items, key=length):
        if cur and (len(cur) + 1) * length(it) > token_budget:
            batches.append(cur)
            cur = []
        cur.append(it)
    batches.append(cur)
    return batches


def sft_batches(rng, task_cfg, n_batches, token_budget):
    """n_batches length-grouped batches of reference traces (token ids, prompt length), shuffled."""
    pool = [task.training_example(task.sample_problem(rng, task_cfg), task_cfg, rng) for _ in range(n_batches * 64)]
    batches = group_by_length(pool, lambda e: len(e[0]), token_budget)
    rng.shuffle(batches)
    return batches[:n_batches]


def lr_at(step, total, peak):
    warm = max(1, total // 20)
    if step < warm:
        return peak * (step + 1) / warm
    frac = (step - warm) / max(1, total - warm)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))  # cosine down to 10% of peak


def sft_step(model, net, opt, batch, device):
    """One supervised step on a batch of (token ids, prompt length): next-token loss on response
    tokens only (the prompt's digits are random). Returns (loss, padded tokens read)."""
    ids, plens = zip(*batch)
    tokens, mask = rl.collate(ids, plens, task.PAD_ID, device)
    x, y = tokens[:, :-1], tokens[:, 1:].masked_fill(~mask, -100)
    logits, _ = net(x)
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), ignore_index=-100)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return loss, x.numel()


@torch.no_grad()
def init_merged_embeddings(model):
    """Embedding of each labelled digit "b7" := (embedding of "b" + embedding of "7") / sqrt(2).

    The task's one hard skill is the look-up: the response writes the label "b" and must copy the
    digit of the prompt's token "b7". With random embeddings the model must first discover that the
    520 labelled-digit tokens share a label and a digit with the plain tokens; the deep narrow
    target sits on a loss plateau (digits at chance) until it does, for a seed-dependent time.
    Started as sums, "b" already matches "b7" in attention and "b7" already carries the "7" that the
    tied head reads out. Measured (max-n 12, 2000 steps, seed 1337): with it the warmed-up target
    copied the digits right on sizes up to 12 and erred in the sums; without it, it copied wrong
    digits from size 2 on."""
    wte = model.wte.weight
    for label in task.LABELS:
        for d in "0123456789":
            parts = [task.ENC.encode_single_token(c) for c in (label, d)]
            wte[task.ENC.encode_single_token(label + d)] = (wte[parts[0]] + wte[parts[1]]) / math.sqrt(2)


def warmup_target(model, args, task_cfg, ddp, rank, world_size, device):
    if args.merge_init:
        init_merged_embeddings(model)  # deterministic, so still the same weights on every rank
    model.train()
    net = DDP(model) if ddp else model
    opt = torch.optim.AdamW(model.parameters(), lr=args.warmup_lr, betas=(0.9, 0.95), weight_decay=0.1)
    rng = random.Random(derive_seed(args.seed, rank, 0, 1))
    task_cfg = task_config(args, warmup=True)
    budget = max(1, args.warmup_tokens // world_size)
    t0, tokens_seen, batches = time.time(), 0, []
    for step in range(args.warmup_steps):
        if not batches:
            batches = sft_batches(rng, task_cfg, 16, budget)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args.warmup_steps, args.warmup_lr)
        loss, n_tokens = sft_step(model, net, opt, batches.pop(), device)
        tokens_seen += n_tokens * world_size
        if step % 50 == 0 or step == args.warmup_steps - 1:
            el = time.time() - t0
            eta = el / (step + 1) * (args.warmup_steps - step - 1)
            print0(f"target warmup {step:05d}/{args.warmup_steps} ({100 * (step + 1) / args.warmup_steps:.1f}%) | "
                   f"loss {loss.item():.4f} | tok/s {tokens_seen / el:,.0f} | elapsed {el:.0f}s | eta {eta:.0f}s")
    model.eval()


# -----------------------------------------------------------------------------
# drafter warm-up: the target's own samples, hidden states kept

def warmup_drafter(drafter, model, args, task_cfg, ddp, rank, world_size, device):
    rng = random.Random(derive_seed(args.seed, rank, 0, 2))
    gen = torch.Generator(device=device).manual_seed(derive_seed(args.seed, rank, 0, 3))
    buffer = DrafterBuffer(keep_steps=1)
    n_local = len(range(rank, args.drafter_warmup_seqs, world_size))
    t0 = time.time()
    for i in range(0, n_local, 64):
        problems = [task.sample_problem(rng, task_cfg) for _ in range(min(64, n_local - i))]
        results, _ = rollout(model, None, [task.encode(p.prompt()) for p in problems], task_cfg.max_response_len,
                             temperature=args.temperature, eos_id=task.EOS_ID, generator=gen, tlt=False)
        for _, tokens, hidden, plen in results:
            buffer.add(0, tokens, hidden, plen)
    print0(f"drafter warmup: {buffer.num_tokens():,} tokens of target samples per rank in {time.time() - t0:.1f}s")
    opt = make_optimizer(drafter, args.drafter_lr)
    t0 = time.time()
    for step in range(args.drafter_warmup_steps):
        for g in opt.param_groups:
            g["lr"] = lr_at(step, args.drafter_warmup_steps, args.drafter_lr)
        loss = train_step(drafter, opt, buffer, rng, batch_size=args.drafter_batch, device=device, sync_grads=ddp)
        if step % 100 == 0 or step == args.drafter_warmup_steps - 1:
            el = time.time() - t0
            print0(f"drafter warmup {step:05d}/{args.drafter_warmup_steps} | loss {loss:.4f} | "
                   f"top-1 agreement {acceptance_proxy(drafter, buffer, rng, device=device):.3f} | elapsed {el:.0f}s | "
                   f"eta {el / (step + 1) * (args.drafter_warmup_steps - step - 1):.0f}s")


# -----------------------------------------------------------------------------
# evaluation: greedy, sharded over ranks

@torch.no_grad()
def evaluate(model, problems, rank=0, world_size=1, drafter=None, temperature=0.0, seed=0, batch_size=64,
             sampler="gumbel", task_cfg=task.TaskConfig()):
    """Held-out accuracy by problem size, and every generated response (token ids), all ranks
    together. Greedy by default; with a drafter, decoding is speculative, which at temperature 0
    must give exactly the same tokens. At temperature > 0 problem j's key is derived from (seed, j),
    so with sampler "gumbel" the tokens do not depend on the ranks or on the drafter; with
    "rejection" the sampling is seeded per rank."""
    gen = torch.Generator(device=model.wte.weight.device).manual_seed(derive_seed(seed, rank, 0, 9))
    mine = list(range(rank, len(problems), world_size))
    outputs = [None] * len(problems)
    for i in range(0, len(mine), batch_size):
        idx = mine[i:i + batch_size]
        prompts = [task.encode(problems[j].prompt()) for j in idx]
        max_new = task_cfg.response_len(max(problems[j].size for j in idx), task_cfg.max_passes)
        how = dict(temperature=temperature, eos_id=task.EOS_ID, generator=gen, sampler=sampler,
                   keys=[derive_seed(seed, j, 0, 11) for j in idx])
        if drafter is None:
            outs, _ = autoregressive_generate(model, prompts, max_new, **how)
        else:
            outs, _ = speculative_generate(model, drafter, prompts, max_new, k=4, **how)
        for j, o in zip(idx, outs):
            outputs[j] = o
    for part in gather_ranks(outputs):  # each rank filled its own indices
        outputs = [o if o is not None else p for o, p in zip(outputs, part)]
    rewards = [task.reward(p.prompt(), task.decode(o)) for p, o in zip(problems, outputs)]
    return task.accuracy_by_size(problems, rewards), outputs


def evaluate_both(model, drafter, problems, args, rank, world_size, when, check=False):
    """Greedy and sampled (temperature --temperature, as in the rollouts, --eval-samples per
    problem) held-out accuracy. With --tlt on the sampling decodes speculatively: lossless, and
    faster, which pays for more samples and so for less noise. With check, also counts the
    responses in which speculative decoding differs from plain decoding, greedy and sampled
    (exact-token sampling, one sample per problem)."""
    if not problems:
        return {}
    cfg = task_config(args)
    greedy, plain_out = evaluate(model, problems, rank, world_size, task_cfg=cfg)
    sampled, _ = evaluate(model, problems * args.eval_samples, rank, world_size, drafter=drafter if args.tlt else None,
                          temperature=args.temperature, seed=args.seed, sampler=args.sampler, task_cfg=cfg)
    print0(f"held-out accuracy {when} ({len(problems)} problems), greedy:  {format_accuracy(greedy)}")
    print0(f"held-out accuracy {when}, sampled at T={args.temperature:g}: {format_accuracy(sampled)}")
    if check:  # lossless in practice: speculative decoding gives the plain responses, token for token
        _, sd_greedy = evaluate(model, problems, rank, world_size, drafter=drafter, task_cfg=cfg)
        how = dict(temperature=args.temperature, seed=args.seed + 1, sampler="gumbel", task_cfg=cfg)
        _, plain_sampled = evaluate(model, problems, rank, world_size, **how)
        _, sd_sampled = evaluate(model, problems, rank, world_size, drafter=drafter, **how)
        # float32 passes of different shapes (1 token, k + 1 tokens) round differently, so a near-tie
        # argmax can flip and the response goes its own way from there: count rather than just say no
        for name, a, b in (("greedy", plain_out, sd_greedy), (f"sampled at T={args.temperature:g}", plain_sampled, sd_sampled)):
            print0(f"speculative vs plain decoding, {name}: {sum(x != y for x, y in zip(a, b))} of {len(a)} "
                   f"held-out responses differ")
    return {"greedy": greedy, "sampled": sampled}


def format_accuracy(acc):
    return " | ".join(f"{k} {100 * v:5.1f}%" for k, v in acc.items())


# -----------------------------------------------------------------------------
# one GRPO update on this rank's rollouts

def grpo_update(model, net, opt, sequences, prompt_lens, advantages, args, device, ref_model=None):
    """Length-grouped micro-batches, gradients accumulated, one all-reduce (DDP), one step per
    epoch. A rank with no rows still takes part with a zero loss, so collectives line up.
    Returns (loss, clip fraction, skipped) where skipped means a non-finite loss or gradient."""
    n_tokens = max(1, sum(len(s) - p for s, p in zip(sequences, prompt_lens)))
    # rows with advantage 0 (groups whose rewards are all equal) add exactly 0 to the loss and its
    # gradient, so skipping them changes nothing but the time (not so with a KL term)
    active = [i for i in range(len(sequences)) if args.kl_coef > 0 or advantages[i] != 0]
    micro = group_by_length(active, lambda i: len(sequences[i]), args.update_tokens)
    total_loss, clip, skipped, old = 0.0, 0.0, False, {}
    for epoch in range(args.rl_epochs):
        opt.zero_grad(set_to_none=True)
        for m_i, rows in enumerate(micro):
            if rows:
                tokens, mask = rl.collate([sequences[i] for i in rows], [prompt_lens[i] for i in rows], task.PAD_ID, device)
                adv = advantages[rows].to(device)
            else:  # no rows on this rank: a one-token dummy with an empty mask
                tokens, mask = torch.zeros(1, 2, dtype=torch.long, device=device), torch.zeros(1, 1, dtype=torch.bool, device=device)
                adv = torch.zeros(1, device=device)
            last = m_i == len(micro) - 1
            ctx = net.no_sync() if (isinstance(net, DDP) and not last) else nullcontext()
            with ctx:
                logp = rl.token_logprobs(net, tokens)
                # the rollout came from the weights of epoch 0: their log-probs are the "old" ones
                logp_old = old.setdefault(m_i, logp.detach())
                logp_ref = None
                if args.kl_coef > 0:
                    with torch.no_grad():
                        logp_ref = rl.token_logprobs(ref_model, tokens)
                loss, st = rl.grpo_loss(logp, logp_old, adv, mask, args.clip_eps, args.kl_coef, logp_ref)
                # token-level mean over the rank's whole batch, not per micro-batch
                (loss * mask.sum() / n_tokens).backward()
            total_loss += float(loss.detach()) * float(mask.sum()) / n_tokens
            clip += st["clip_frac"] * float(mask.sum()) / n_tokens
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        ok = torch.tensor([float(torch.isfinite(grad_norm))], device=device)
        if dist.is_initialized():
            dist.all_reduce(ok, op=dist.ReduceOp.MIN)  # every rank skips together, or none does
        if ok.item() < 1:
            opt.zero_grad(set_to_none=True)
            skipped = True
            continue
        opt.step()
    return total_loss / args.rl_epochs, clip / args.rl_epochs, skipped


# -----------------------------------------------------------------------------
# main

def model_meta(args, config):
    """What the target warm-up depends on: its traces (the warm-up's task config), shape, recipe, seed."""
    return {"model": config.to_dict(), "task": asdict(task_config(args, warmup=True)), "warmup_steps": args.warmup_steps,
            "warmup_tokens": args.warmup_tokens, "warmup_lr": args.warmup_lr, "merge_init": args.merge_init,
            "seed": args.seed}


def drafter_meta(args, config, task_cfg):
    """The drafter warm-up also depends on the RL task config: it learns from the target's samples of RL prompts."""
    return {**model_meta(args, config), "rl_task": asdict(task_cfg), "drafter_warmup_seqs": args.drafter_warmup_seqs,
            "drafter_warmup_steps": args.drafter_warmup_steps, "drafter_lr": args.drafter_lr,
            "drafter_batch": args.drafter_batch, "temperature": args.temperature}


def rl_meta(args, config, task_cfg):
    keys = ("rl_seed", "drafter_online_lr", "prompts_per_step", "group_size", "rl_lr", "rl_epochs", "clip_eps", "kl_coef", "tlt", "drafter_updates",
            "sd_threshold", "drafter_keep", "update_tokens", "sampler")
    return {**drafter_meta(args, config, task_cfg), **{k: getattr(args, k) for k in keys}, "draft_ks": list(args.draft_ks)}


def prepare_models(args, task_cfg, ddp, rank, world_size, device):
    """Build target and drafter; warm each up, or reuse its cached warm-up."""
    config = GPTConfig(vocab_size=task.VOCAB_SIZE, block_size=args.block_size, n_layer=args.n_layer,
                       n_head=args.n_head, n_embd=args.n_embd)
    torch.manual_seed(derive_seed(args.seed, 0, 0, 4))  # same initial weights on every rank
    model = GPT(config).to(device)
    drafter = Drafter(model).to(device)
    print0(f"target: {model.num_params():,} parameters; drafter: {sum(p.numel() for p in drafter.parameters()):,} "
           f"(+ the target's embedding and head, shared); {config}")
    path = os.path.join(args.warmup_dir, "target_warmup.pt")
    if os.path.exists(path):
        model.load_state_dict(load_checked(path, model_meta(args, config))["model"])
        print0(f"reusing the warmed-up target from {path}")
    else:
        warmup_target(model, args, task_cfg, ddp, rank, world_size, device)
        if rank == 0:
            save_atomic({"meta": model_meta(args, config), "model": model.state_dict()}, path)
    model.eval()
    path = os.path.join(args.warmup_dir, "drafter_warmup.pt")
    if os.path.exists(path):
        drafter.load_state_dict(load_checked(path, drafter_meta(args, config, task_cfg))["drafter"])
        print0(f"reusing the warmed-up drafter from {path}")
    else:
        warmup_drafter(drafter, model, args, task_cfg, ddp, rank, world_size, device)
        if rank == 0:
            save_atomic({"meta": drafter_meta(args, config, task_cfg), "drafter": drafter.state_dict()}, path)
    return config, model, drafter


def check_out_dir(out_dir):
    try:
        os.makedirs(out_dir, exist_ok=True)
        probe = os.path.join(out_dir, f".write_test.{os.getpid()}")
        with open(probe, "w") as f:
            f.write("ok")
        os.remove(probe)
    except OSError as e:
        raise SystemExit(f"error: cannot write to --out-dir {out_dir!r}: {e.strerror}")


def main(argv=None):
    args = parse_args(argv)
    check_out_dir(args.out_dir)
    check_out_dir(args.warmup_dir)
    task_cfg = task_config(args)
    ddp, rank, local_rank, world_size, device = compute_init(args.device)
    try:
        run(args, task_cfg, ddp, rank, world_size, device)
        if ddp:
            dist.barrier()  # tearing gloo down while a peer still talks to it can abort the process
    finally:
        if ddp and dist.is_initialized():
            dist.destroy_process_group()
    if ddp:
        # Even after a clean teardown, about one 2-rank gloo run in 15 aborted in C++ static
        # destructors at interpreter exit ("terminate called without an active exception"),
        # turning a finished run into a failed one. Everything is written and flushed by now.
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def run(args, task_cfg, ddp, rank, world_size, device):
    t_run = time.time()
    config, model, drafter = prepare_models(args, task_cfg, ddp, rank, world_size, device)
    problems = task.eval_set(task_cfg, args.eval_per_bucket) if args.eval_per_bucket else []
    acc0 = evaluate_both(model, drafter, problems, args, rank, world_size, "before RL")

    ref_model = copy.deepcopy(model).requires_grad_(False) if args.kl_coef > 0 else None  # frozen warm-up target
    net = DDP(model) if ddp else model
    opt = torch.optim.AdamW(model.parameters(), lr=args.rl_lr, betas=(0.9, 0.95), weight_decay=0.0)
    d_opt = make_optimizer(drafter, args.drafter_online_lr)
    bandit = Bandit(args.draft_ks, seed=derive_seed(args.rl_seed, rank, 0, 5))
    buffer = DrafterBuffer(keep_steps=args.drafter_keep)
    ckpt_path = os.path.join(args.out_dir, "ckpt.pt")
    metrics_path = os.path.join(args.out_dir, "metrics.jsonl")
    meta = rl_meta(args, config, task_cfg)
    start = 0
    if os.path.exists(ckpt_path):
        ck = load_checked(ckpt_path, meta)
        try:
            model.load_state_dict(ck["model"])
            drafter.load_state_dict(ck["drafter"])
            opt.load_state_dict(ck["opt"])
            d_opt.load_state_dict(ck["d_opt"])
            if rank < len(ck["bandits"]):
                bandit.load_state_dict(ck["bandits"][rank])
            start = ck["step"] + 1
        except (KeyError, TypeError, ValueError, RuntimeError) as e:  # same config, older layout of the state
            raise SystemExit(f"error: checkpoint {ckpt_path} does not fit this version of the code "
                             f"({type(e).__name__}: {e}); delete it or use another --out-dir")
        print0(f"resuming from {ckpt_path} at RL step {start}")
    if rank == 0:  # every step appears once: drop records past the checkpoint (a crash after logging)
        keep = []
        if os.path.exists(metrics_path):
            with open(metrics_path) as f:
                keep = [ln for ln in f if ln.strip() and json.loads(ln)["step"] < start]
        with open(metrics_path, "w") as f:
            f.writelines(keep)

    local_prompts = len(range(rank, args.prompts_per_step, world_size))
    print0(f"RL: {args.rl_steps} steps x {args.prompts_per_step} prompts x {args.group_size} samples on {world_size} "
           f"rank(s) ({local_prompts} prompts on rank 0) | tlt {'on' if args.tlt else 'off'} | drafter updates "
           f"{'on' if args.drafter_updates and args.tlt else 'off'} | sd threshold {args.sd_threshold}")
    history = []
    for step in range(start, args.rl_steps):
        rec = rl_step(step, args, task_cfg, model, net, drafter, opt, d_opt, bandit, buffer, rank, world_size, device,
                      ref_model)
        history.append(rec)
        if rank == 0:
            with open(metrics_path, "a") as f:
                f.write(json.dumps({k: v for k, v in rec.items() if k != "timeline"}) + "\n")
        print0(f"step {step:04d}/{args.rl_steps} | reward {rec['reward']:.3f} | step {rec['step_time']:.2f}s | "
               f"rollout {rec['rollout_time']:.2f}s ({100 * rec['rollout_share']:.0f}%, tail {100 * rec['tail_share']:.0f}%) | "
               f"tok/s {rec['tok_s']:,.0f} | "
               f"accept {rec['accept_len'] or 0:.2f} ({100 * (rec['accept_rate'] or 0):.0f}% of drafts) | "
               f"sd tok {100 * rec['sd_token_frac']:.0f}% | "
               f"idle {rec['idle_time']:.2f}s | drafter steps {rec['drafter_steps']}"
               + (" | SKIPPED non-finite update" if rec["skipped_update"] else ""))
        if args.timeline_every and (step % args.timeline_every == 0 or step == args.rl_steps - 1):
            print0(rec["timeline"])
        if (step + 1) % args.ckpt_every == 0 or step == args.rl_steps - 1:
            bandits = gather_ranks(bandit.state_dict())
            if rank == 0:
                save_atomic({"meta": meta, "step": step, "model": model.state_dict(), "drafter": drafter.state_dict(),
                             "opt": opt.state_dict(), "d_opt": d_opt.state_dict(), "bandits": bandits}, ckpt_path)

    acc1 = evaluate_both(model, drafter, problems, args, rank, world_size, "after RL", check=True)
    if history:
        summary(history, acc0, acc1, time.time() - t_run)


def rl_prompts(args, task_cfg, step):
    """The step's prompts, the same on every rank (each rank takes every world_size-th one)."""
    prng = random.Random(derive_seed(args.rl_seed, 0, step, 6))
    return [task.sample_problem(prng, task_cfg) for _ in range(args.prompts_per_step)]


def rl_step(step, args, task_cfg, model, net, drafter, opt, d_opt, bandit, buffer, rank, world_size, device,
            ref_model=None):
    t0 = time.perf_counter()
    problems = rl_prompts(args, task_cfg, step)[rank::world_size]
    rows = [p for p in problems for _ in range(args.group_size)]
    # a row's key is a function of the seed, the step and its index in the step's global batch (prompt
    # rank + i * world_size, sample j), never of this rank's layout: with --sampler gumbel the tokens
    # are the same for any number of ranks, with or without speculation
    keys = [derive_seed(args.rl_seed, step, (rank + i * world_size) * args.group_size + j, 10)
            for i in range(len(problems)) for j in range(args.group_size)]
    gen = torch.Generator(device=device).manual_seed(derive_seed(args.rl_seed, rank, step, 7))
    results, st = rollout(model, drafter, [task.encode(p.prompt()) for p in rows], task_cfg.max_response_len,
                          temperature=args.temperature, eos_id=task.EOS_ID, generator=gen, tlt=args.tlt,
                          sd_threshold=args.sd_threshold, bandit=bandit, sampler=args.sampler, keys=keys)
    rollout_time = time.perf_counter() - t0
    rewards = torch.tensor([task.reward(p.prompt(), task.decode(r[0])) for p, r in zip(rows, results)])
    # 3-5: hidden states to the buffer; idle ranks train the drafter until the last rank is done
    train_drafter = args.tlt and args.drafter_updates
    if train_drafter:
        for _, tokens, hidden, plen in results:
            buffer.add(step, tokens, hidden, plen)
    drng = random.Random(derive_seed(args.rl_seed, rank, step, 8))
    d_steps, idle, idle_segs = idle_train(drafter, d_opt, buffer, drng, enabled=train_drafter,
                                          batch_size=args.drafter_batch, device=device,
                                          timeout_s=COLLECTIVE_TIMEOUT_S)
    if train_drafter:
        sync_drafter(drafter, d_steps)
    t_roll_end = time.perf_counter()
    # 6: GRPO update
    adv = rl.group_advantages(rewards, args.group_size) if len(rows) else torch.zeros(0)
    model.train()
    loss, clip, skipped = grpo_update(model, net, opt, [r[1].tolist() for r in results], [r[3] for r in results],
                                      adv, args, device, ref_model)
    model.eval()
    sync(device)  # the optimizer step may still be queued on a GPU
    t1 = time.perf_counter()
    # 7: per-rank records and the step record
    checksum = drafter.checksum()
    mine = {"rank": rank, "rollout_time": rollout_time, "idle_time": idle, "drafter_steps": d_steps,
            "tokens": st["tokens"], "drafter_checksum": checksum, "rows": len(rows), "tail_share": st["tail_share"],
            "responses_digest": hashlib.sha256(json.dumps([r[0] for r in results]).encode()).hexdigest()[:16],
            "segments": st["segments"] + [[k, a + rollout_time, b + rollout_time] for k, a, b in idle_segs]}
    ranks = gather_ranks(mine)
    sums = all_sum([float(rewards.sum()), len(rows), st["sd_tokens"], st["sd_steps"], st["tokens"], st["accepted"],
                    st["drafted"]], device)
    step_time = t1 - t0
    slowest = max(ranks, key=lambda r: r["rollout_time"])
    rollout_max = slowest["rollout_time"]
    return {
        "step": step, "step_time": step_time, "rollout_time": rollout_max, "update_time": t1 - t_roll_end,
        "tail_share": slowest["tail_share"],
        # one hash of every response of the step, so two runs can be compared token for token
        "responses_digest": hashlib.sha256(" ".join(r["responses_digest"] for r in ranks).encode()).hexdigest()[:16],
        "rollout_share": rollout_max / step_time, "reward": sums[0] / max(sums[1], 1),
        "accept_len": sums[2] / sums[3] if sums[3] else None, "sd_token_frac": sums[2] / max(sums[4], 1),
        "accept_rate": sums[5] / sums[6] if sums[6] else None,
        "tok_s": sums[4] / max(rollout_max, 1e-9), "idle_time": max(r["idle_time"] for r in ranks),
        "drafter_steps": sum(r["drafter_steps"] for r in ranks), "drafter_checksum": checksum,
        "loss": loss, "clip_frac": clip, "skipped_update": skipped, "bandit_best": bandit.best(),
        "ranks": [{k: v for k, v in r.items() if k != "segments"} for r in ranks],
        "timeline": render_timeline(ranks),
    }


def summary(history, acc0, acc1, total_time):
    def mean(key):
        vals = [h[key] for h in history if h[key] is not None]
        return sum(vals) / len(vals) if vals else float("nan")
    print0("\nsummary")
    print0(f"  RL steps              {len(history)}")
    print0(f"  mean step time        {mean('step_time'):.3f}s (rollout {mean('rollout_time'):.3f}s, "
           f"update {mean('update_time'):.3f}s, rollout share {100 * mean('rollout_share'):.0f}%)")
    shares = sorted(h["tail_share"] for h in history)
    print0(f"  tail share            {100 * shares[len(shares) // 2]:.0f}% median (the slowest rank's rollout time after 90% "
           f"of its rows had finished)")
    print0(f"  mean accept length    {mean('accept_len'):.2f} tokens per verify step, {100 * mean('accept_rate'):.0f}% of "
           f"drafted tokens accepted, SD token share {100 * mean('sd_token_frac'):.0f}%")
    best = history[-1]["bandit_best"]
    if best:
        sizes = {b: str(2 ** b) if b < 2 else f"{2 ** (b - 1) + 1}-{2 ** b}" for b in best}  # the bucket's batch sizes
        print0("  bandit's k per batch  " + ", ".join(f"{sizes[b]}: {k}" for b, k in best.items()) + " (rank 0, end of run)")
    n = max(1, len(history) // 10)  # a step's reward swings with its prompt mix; tenths of the run show the trend
    print0(f"  reward                {sum(h['reward'] for h in history[:n]) / n:.3f} -> "
           f"{sum(h['reward'] for h in history[-n:]) / n:.3f} (means of the first and the last {n} steps)")
    if not acc0:
        print0("  held-out accuracy     not evaluated (--eval-per-bucket 0)")
    else:
        for kind in ("greedy", "sampled"):
            for name, acc in (("before RL", acc0), ("after RL", acc1)):
                print0(f"  {kind:7s} {name:9s}     {format_accuracy(acc[kind])}")
    print0(f"  skipped updates       {sum(h['skipped_update'] for h in history)} (non-finite loss or gradient)")
    print0(f"  wall time             {total_time:.0f}s")


if __name__ == "__main__":
    main()
