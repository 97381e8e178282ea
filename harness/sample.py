"""python -m harness.sample: serve a finished run, its target drafted by the drafter idle ranks trained.

    python -m harness.sample --out-dir out "aAB bBC cAC *?" "aBC *?"   # these (the default task's)
    python -m harness.sample --out-dir out                             # 16 held-out prompts

Each response and whether it is right, then plain and speculative decoding of the same prompts
timed in turns (with exact-token sampling both write the same tokens, which it counts).

Test: python -m pytest tests/test_sample.py
"""
import argparse
import os
import random

import torch

import tasks
from harness.bench import interleaved
from harness.common import OneLineParser, machine
from drafter import Drafter
from model import GPT, GPTConfig
from speculative import SAMPLERS, autoregressive_generate, speculative_generate


def parse_args(argv=None):
    p = OneLineParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("prompts", nargs="*", help="problems of the run's task (default: --n held-out)")
    p.add_argument("--out-dir", default="out", help="the train.py run to serve (its ckpt.pt)")
    p.add_argument("--n", type=int, default=16, help="held-out prompts to answer when none given")
    p.add_argument("--k", type=int, default=6, help="draft length")
    p.add_argument("--temperature", type=float, default=1.0, help="0: greedy")
    p.add_argument("--sampler", default="gumbel", choices=SAMPLERS, help="gumbel: the same tokens "
                   "with and without speculation; rejection: the same distribution")
    p.add_argument("--seed", type=int, default=0, help="the responses' keys or random stream")
    p.add_argument("--repeats", type=int, default=3, help="timed rounds; the median is reported")
    args = p.parse_args(argv)
    if args.n <= 0 or args.k <= 0 or args.repeats <= 0 or not args.temperature >= 0:
        p.error("--n, --k and --repeats must be positive, --temperature non-negative")
    ckpt = os.path.join(args.out_dir, "ckpt.pt")
    if not os.path.exists(ckpt):
        p.error(f"no checkpoint at {ckpt}: run train.py --out-dir {args.out_dir} first")
    args.ckpt = torch.load(ckpt, map_location="cpu", weights_only=True)
    config = GPTConfig(**args.ckpt["meta"]["model"])
    task = tasks.from_meta(args.ckpt["meta"]["rl_task"])
    args.problems = []
    for text in args.prompts:
        problem = task.parse(text)
        if problem is None:
            example = task.sample(random.Random(0), min(3, task.max_n))
            p.error(f"{text!r} is not a problem of this task ({task.name}), such as "
                    f"{task.decode(task.prompt_ids(example))!r}")
        need = len(task.prompt_ids(problem)) + task.response_len(problem.size) + args.k
        if need > config.block_size:
            p.error(f"{text!r} is too long for the model: size {problem.size} needs {need} "
                    f"positions with k = {args.k}, it holds {config.block_size}")
        args.problems.append(problem)
    if not args.problems:  # the held-out set's problems that fit
        fits = [q for q in task.eval_set()
                if len(task.prompt_ids(q)) + task.max_response_len + args.k <= config.block_size]
        args.problems = fits[::max(1, len(fits) // args.n)][:args.n]
    return args, config, task


@torch.no_grad()
def main(argv=None):
    args, config, task = parse_args(argv)
    torch.manual_seed(args.seed)
    target = GPT(config).eval()
    target.load_state_dict(args.ckpt["model"])
    drafter = Drafter(target, args.ckpt["meta"]["drafter_layers"]).eval()
    drafter.load_state_dict(args.ckpt["drafter"])
    prompts = [task.prompt_ids(q) for q in args.problems]
    max_new = task.response_len(max(q.size for q in args.problems))
    how = dict(temperature=args.temperature, eos_id=task.eos_id, sampler=args.sampler,
               keys=[args.seed * 100_000 + i for i in range(len(prompts))])
    gen = lambda: torch.Generator().manual_seed(args.seed)  # noqa: E731  (rejection's stream)
    runs = {"plain decoding": lambda: autoregressive_generate(
                target, prompts, max_new, generator=gen(), **how),
            "speculative": lambda: speculative_generate(
                target, drafter, prompts, max_new, k=args.k, generator=gen(), **how)}
    print(f"serving {args.out_dir}/ckpt.pt (RL step {args.ckpt['step'] + 1}) "
          f"on {machine(torch.device('cpu'))}")
    times, outs = interleaved(runs, args.repeats)  # medians; the modes take turns
    responses = outs["plain decoding"][0]
    for prompt, q, r in zip(prompts, args.problems, responses):
        verdict = "right" if task.correct(q, r) else "WRONG"
        print(f"{task.decode(prompt)} {task.decode(r)}   [{verdict}]")
    n_tokens = sum(len(r) for r in responses)
    print(f"\n{len(prompts)} prompts, {n_tokens} tokens, all at once, temperature "
          f"{args.temperature}, {args.sampler}, median of {args.repeats}:")
    base = n_tokens / times["plain decoding"]
    for name, (out, st) in outs.items():
        tok_s = sum(len(r) for r in out) / times[name]
        same = sum(a == b for a, b in zip(out, responses))
        accept = (f", {st['accept_len']:.2f} tokens per verify step (k = {args.k})"
                  if st.get("accept_len") else "")
        print(f"  {name:15s} {tok_s:8,.0f} tokens/s  {tok_s / base:.2f}x{accept}; {same} of "
              f"{len(out)} responses the same as plain decoding's")


if __name__ == "__main__":
    main()
