"""python -m harness.faults: kill a rank anywhere, and check that the resumed run is the run it would
have been (with exact-token sampling the tokens depend only on the weights and the seeds).

    python -m harness.faults                        # 24 trials on 2 ranks, each phase 3 times
    python -m harness.faults --nproc 4 --trials 8   # on 4 ranks, each phase once
    python -m harness.faults --nnodes 2 --trials 16 # 2 agents (nodes), 1 rank each: a rank, a node
    python -m harness.faults --phases update,checkpoint-write --trials 4 -- --rl-steps 10 ...

It runs train.py once without a fault (the reference; the quick try's sizes, or the flags after
`--`), then each trial under `torchrun --max-restarts=1`: one rank SIGKILLs itself at a random
moment of a phase (a random call of the phase's function, PHASES, after a random part of up to 80%
of that call's reference length). With --nnodes 2, two torchrun agents on this machine: the victim
is a rank of the second node, or, each phase's second turn, that node's agent, started again as a
scheduler replaces a node (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, else torch 2.13's new agent never
joins). Checks: the job finished; every RL step logged once; the reference's responses at every
step; its final target and warm-up caches bit for bit. A trial not about a warm-up starts from
copies of the reference's caches. The table goes to stdout and <out-dir>/trials.jsonl; exit 1 if
any check failed. torchrun runs this module on every rank with the trial's plan in TLT_FAULT: it
wraps the phases' functions, records each call's length and runs train.main; only the first
attempt (TORCHELASTIC_RESTART_COUNT 0) is killed.

Test: python -m pytest tests/test_faults.py
"""
import argparse
import contextlib
import ctypes
import importlib
import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time

import torch

from harness.checkpoint import load_checked
from harness.common import OneLineParser

PLAN = "TLT_FAULT"  # the environment variable that holds a rank's plan
PHASES = {  # phase -> (module, function)
    "target-warmup": ("harness.warmup", "warmup_target"),
    "drafter-warmup": ("harness.warmup", "warmup_drafter"),
    "evaluation": ("train", "evaluate_both"),
    "rollout": ("train", "roll_out"),
    "idle-loop": ("train", "idle_train"),
    "drafter-sync": ("train", "start_drafter_sync"),
    "update": ("train", "update_target"),
    "checkpoint-write": ("harness.checkpoint", "save_atomic"),
}
WARMUPS = ("target_warmup.pt", "drafter_warmup.pt")
RUN = ["--rl-steps", "20", "--max-n", "4", "--n-layer", "2", "--n-embd", "32",
       "--warmup-steps", "300", "--drafter-warmup-steps", "300", "--eval-per-bucket", "5",
       "--ckpt-every", "5"]  # the README's smoke run, with more checkpoints


# -----------------------------------------------------------------------------
# in each rank: the phases' functions wrapped, the plan carried out

class Phases:
    """Wraps every phase's function. Each call is named by (phase, where, n): where the run is
    ("before RL", "step 7": after this process's 8th rollout, "after RL") and n, its count there
    from 0. A call's length is appended to <out-dir>/phases.rank<r>.jsonl; the call the plan names
    arms a SIGKILL."""

    def __init__(self, plan, rank, first_attempt):
        self.plan = plan if first_attempt and plan.get("rank") == rank else None
        self.log = os.path.join(plan["out_dir"], f"phases.rank{rank}.jsonl")
        self.rollouts, self.seen, self.lock = 0, {}, threading.Lock()

    def install(self):
        for phase, (module, name) in PHASES.items():
            mod = importlib.import_module(module)
            setattr(mod, name, self.wrap(phase, getattr(mod, name)))

    def wrap(self, phase, fn):
        def wrapped(*args, **kwargs):
            call = self.enter(phase)
            if phase != "drafter-sync":
                try:
                    return fn(*args, **kwargs)
                finally:
                    self.leave(call)
            finish = fn(*args, **kwargs)

            def finish_and_leave():  # the sync ends when its finish returns
                try:
                    return finish()
                finally:
                    self.leave(call)
            return finish_and_leave
        return wrapped

    def enter(self, phase):
        if phase == "rollout":
            self.rollouts += 1
        where = "before RL" if not self.rollouts else (
            "after RL" if phase == "evaluation" else f"step {self.rollouts - 1}")
        n = self.seen[(phase, where)] = self.seen.get((phase, where), -1) + 1
        call = {"phase": phase, "where": where, "n": n, "t0": time.perf_counter(), "timer": None}
        p = self.plan
        if p and (p["phase"], p["where"], p["n"]) == (phase, where, n):
            call["timer"] = threading.Timer(p["after_s"], self.kill, ("inside",))
            call["timer"].start()
        return call

    def leave(self, call):
        seconds = time.perf_counter() - call["t0"]
        if call["timer"] is not None:
            call["timer"].cancel()
            self.kill("at its end")  # this call was quicker than the reference's moment
        with open(self.log, "a") as f:
            f.write(json.dumps({k: call[k] for k in ("phase", "where", "n")} | {"seconds": seconds}) + "\n")

    def kill(self, when):
        """SIGKILL the plan's victim (this rank or another, by its pid file); with "node" its agent
        first, whose ranks die with it (rank_main): the victim's machine lost."""
        with self.lock:  # the timer and the call's end may both get here: only one writes and kills
            with open(os.path.join(self.plan["out_dir"], "killed.json"), "w") as f:
                json.dump({**self.plan, "when": when}, f)
                f.flush()
                os.fsync(f.fileno())
            with open(os.path.join(self.plan["out_dir"], f"pid.rank{self.plan.get('victim', self.plan['rank'])}")) as f:
                pid, agent = map(int, f.read().split())
            for victim in (agent, pid) if self.plan.get("node") else (pid,):
                os.kill(victim, signal.SIGKILL)


def rank_main():
    """A rank of a run under this module: the phases wrapped, then train.py's main."""
    plan, rank = json.loads(os.environ[PLAN]), int(os.environ.get("RANK", 0))
    sys.setswitchinterval(1e-4)  # the timer thread gets the interpreter within 0.1 ms, not 5: phases are short
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG (Linux): a rank dies with its agent, as with its machine
    with open(os.path.join(plan["out_dir"], f"pid.rank{rank}"), "w") as f:  # for a killer on another rank
        f.write(f"{os.getpid()} {os.getppid()}")
    Phases(plan, rank, os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0").install()
    import train
    train.main(sys.argv[1:])


# -----------------------------------------------------------------------------
# the command: the reference run, the trials, the checks

def launch(flags, out_dir, nproc, plan, log, nnodes=1):
    """train.py under torchrun --max-restarts=1, every rank running `rank_main` with `plan` -> exit code.
    nnodes > 1: as many agents on this machine, standing for nodes (c10d on localhost, hosted by the
    first), nproc ranks in all; the last agent, if the plan kills it, is started again, once and
    without the plan, as a scheduler replaces a lost node."""
    os.makedirs(out_dir, exist_ok=True)
    with socket.socket() as s:
        s.bind(("localhost", 0))
        port = s.getsockname()[1]
    where = ["--standalone"] if nnodes == 1 else [
        f"--nnodes={nnodes}", "--rdzv_backend=c10d", f"--rdzv_endpoint=localhost:{port}"]
    cmd = [sys.executable, "-m", "torch.distributed.run", *where, f"--nproc_per_node={nproc // nnodes}",
           "--max-restarts=1", "-m", "harness.faults", *flags, "--out-dir", out_dir, "--warmup-dir", out_dir]
    with open(log, "w") as f:
        def start(plan):
            env = {**os.environ, PLAN: json.dumps({**plan, "out_dir": out_dir}), "OMP_NUM_THREADS": "1",
                   **({"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"} if nnodes > 1 else {})}  # README: a new node joins
            return subprocess.Popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True)
        agents, lost, deadline = [start(plan)], None, time.time() + 1800
        while len(agents) < nnodes and agents[0].poll() is None:  # the others once the first hosts the rendezvous
            with contextlib.suppress(OSError), socket.create_connection(("localhost", port), timeout=1):
                agents += [start(plan) for _ in range(nnodes - 1)]
            time.sleep(0.1)
        while None in [a.poll() for a in agents] and time.time() < deadline:  # every agent's exit code, read
            if plan.get("node") and lost is None and agents[-1].returncode == -signal.SIGKILL:
                lost, agents[-1] = agents[-1], start({})  # the lost node's replacement
            time.sleep(0.1)
        for a in agents if time.time() >= deadline else []:
            with contextlib.suppress(OSError):
                os.killpg(a.pid, signal.SIGKILL)  # the agent; its ranks die with it (rank_main)
        return "hung" if time.time() >= deadline else next((a.returncode for a in agents if a.returncode), 0)


def calls(out_dir, nproc):
    """The reference run's calls: [(rank, phase, where, n, seconds)]."""
    found = []
    for rank in range(nproc):
        with open(os.path.join(out_dir, f"phases.rank{rank}.jsonl")) as f:
            found += [(rank, c["phase"], c["where"], c["n"], c["seconds"]) for c in map(json.loads, f)]
    return found


def plans(reference_calls, phases, trials, rng, nproc=1, nnodes=1):
    """Each trial's plan: the phases in turn (shuffled), a random call of it on any rank, a random
    moment inside the first 80% of that call's length in the reference run. nnodes > 1: the victim is
    a rank on the last node (its own call of the phase if it makes any), and every phase's second
    turn kills that node: its agent and its ranks."""
    order = [(phases[i % len(phases)], nnodes > 1 and i // len(phases) % 2 == 1) for i in range(trials)]
    rng.shuffle(order)
    out = []
    for phase, node in order:
        choices = [c for c in reference_calls if c[1] == phase]
        if not choices:
            raise SystemExit(f"error: the reference run never entered phase {phase}")
        victim = rng.randrange(nproc - nproc // nnodes, nproc) if nnodes > 1 else None
        rank, _, where, n, seconds = rng.choice([c for c in choices if c[0] == victim] or choices)
        out.append({"phase": phase, "rank": rank, "victim": rank if victim is None else victim, "node": node,
                    "where": where, "n": n, "after_s": round(rng.uniform(0, 0.8 * seconds), 6)})  # 0.8: it may be quicker
    return out


def records(out_dir):
    """A run's records; none if it wrote none, and not a last line that a kill cut short."""
    path = os.path.join(out_dir, "metrics.jsonl")
    if not os.path.exists(path):
        return []
    with open(path) as f:
        return [json.loads(line) for line in f if line.endswith("\n")]


def same_tensors(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def compare(reference, run, rl_steps):
    """The checks of a run against the reference run -> {check: True/False, "responses": "k/n"}."""
    out, logged = {}, records(run)
    out["steps once"] = [r["step"] for r in logged] == list(range(rl_steps))
    want = {r["step"]: r["responses_digest"] for r in records(reference)}
    got = {r["step"]: r["responses_digest"] for r in logged}
    equal = sum(got.get(s) == d for s, d in want.items())
    out["responses"] = f"{equal}/{len(want)}"
    def same(name, key):  # the run's file loads with the reference's settings and holds its weights
        ref = torch.load(os.path.join(reference, name), map_location="cpu", weights_only=True)
        try:
            theirs = load_checked(os.path.join(run, name), ref["meta"])
        except SystemExit:  # missing, torn, damaged or made otherwise
            return False
        return same_tensors(ref[key], theirs[key])

    out["target"] = same("ckpt.pt", "model")
    out["caches"] = all(same(name, "model" if name.startswith("target") else "drafter")
                        for name in WARMUPS if os.path.exists(os.path.join(reference, name)))
    return out


def passed(checks):
    k, n = checks["responses"].split("/")
    return k == n and all(checks[c] for c in ("finished", "steps once", "target", "caches"))


def rl_steps_of(flags):
    from harness.config import parse_args
    return parse_args(flags).rl_steps


def parse(argv):
    """-> (this command's flags, the phases, train.py's flags)."""
    ours, flags = (argv[:argv.index("--")], argv[argv.index("--") + 1:]) if "--" in argv else (argv, RUN)
    p = OneLineParser(prog="python -m harness.faults", description=__doc__,
                      formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trials", type=int, default=3 * len(PHASES), help="the phases take turns")
    p.add_argument("--nproc", type=int, default=2, help="ranks of each run, in all")
    p.add_argument("--nnodes", type=int, default=1, help="torchrun agents on this machine, standing for nodes (c10d); "
                   "the kills hit the last one: a rank, or (each phase's second turn) the node")
    p.add_argument("--phases", default="all", help=f"comma-separated, of: {', '.join(PHASES)}")
    p.add_argument("--seed", type=int, default=0, help="of the trials' phases, ranks, calls and moments")
    p.add_argument("--out-dir", default="faults", help="the reference run and each trial, a folder each "
                   "(an earlier run of this command there is replaced)")
    args = p.parse_args(ours)
    phases = list(PHASES) if args.phases == "all" else args.phases.split(",")
    if unknown := [ph for ph in phases if ph not in PHASES]:
        p.error(f"unknown phase(s) {', '.join(unknown)}; the phases: {', '.join(PHASES)}")
    if args.trials < 1 or args.nproc < 1 or args.nnodes < 1 or args.nproc % args.nnodes:
        p.error("--trials, --nproc and --nnodes must be at least 1, and --nproc a multiple of --nnodes")
    if os.path.exists(args.out_dir):  # every trial starts from nothing but the reference's warm-ups
        if os.listdir(args.out_dir) and not os.path.exists(os.path.join(args.out_dir, "reference.log")):
            p.error(f"--out-dir {args.out_dir} holds files this command did not write; choose another")
        shutil.rmtree(args.out_dir)
    return args, phases, flags


def trial(i, plan, reference, flags, args):
    """Trial i: its run under `plan`, checked against the reference -> its row, printed."""
    run = os.path.join(args.out_dir, f"trial{i:02d}")
    os.makedirs(run)
    fresh = plan["phase"].endswith("warmup") or (plan["phase"], plan["where"]) == ("checkpoint-write", "before RL")
    if not fresh:
        for name in WARMUPS:  # a trial about the RL loop starts from the reference's warm-ups
            if os.path.exists(os.path.join(reference, name)):
                shutil.copy(os.path.join(reference, name), run)
    t0 = time.time()
    rc = launch(flags, run, args.nproc, plan, os.path.join(run, "torchrun.log"), args.nnodes)
    killed = os.path.join(run, "killed.json")
    checks = {"finished": rc == 0, **compare(reference, run, rl_steps_of(flags))}
    row = {**plan, "killed": json.load(open(killed))["when"] if os.path.exists(killed) else "no",
           **checks, "seconds": round(time.time() - t0, 1)}
    yn = lambda v: "yes" if v else "NO"  # noqa: E731
    print(f"{i:>5}  {plan['phase']:<16} {'node' if plan['node'] else 'rank':<4} {plan['victim']:>4}  {plan['where']:<10} "
          f"{row['killed']:<11} {yn(checks['finished']):<8} {yn(checks['steps once']):<10} {checks['responses']:<9} "
          f"{yn(checks['target']):<6} {yn(checks['caches']):<6} {row['seconds']:>4.0f}s", flush=True)
    return row


def main(argv=None):
    args, phases, flags = parse(sys.argv[1:] if argv is None else argv)
    reference = os.path.join(args.out_dir, "reference")
    print(f"the reference run, {args.nproc} rank(s) on one node: {' '.join(flags)}", flush=True)
    t0 = time.time()
    rc = launch(flags, reference, args.nproc, {}, os.path.join(args.out_dir, "reference.log"))
    if rc != 0:
        raise SystemExit(f"error: the reference run failed (exit {rc}); see {args.out_dir}/reference.log")
    print(f"  done in {time.time() - t0:.0f}s; the trials on {args.nnodes} node(s)", flush=True)
    print(f"{'trial':>5}  {'phase':<16} {'kill':<4} {'rank':>4}  {'where':<10} {'killed':<11} {'finished':<8} "
          f"{'steps once':<10} {'responses':<9} {'target':<6} {'caches':<6} {'time':>5}")
    todo = plans(calls(reference, args.nproc), phases, args.trials, random.Random(args.seed), args.nproc, args.nnodes)
    rows = [trial(i, plan, reference, flags, args) for i, plan in enumerate(todo)]
    with open(os.path.join(args.out_dir, "trials.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    good = [r for r in rows if r["killed"] != "no" and passed(r)]
    hit = {ph: sum(r["phase"] == ph and r["killed"] != "no" for r in rows) for ph in phases}
    print(f"{len(good)} of {len(rows)} trials killed a rank and ended as the reference did (finished, every "
          f"step once, the same responses, the same target bit for bit, caches that load); kills by phase: "
          + ", ".join(f"{ph} {n}" for ph, n in hit.items()))
    if len(good) < len(rows):
        raise SystemExit(1)


if __name__ == "__main__":
    if PLAN in os.environ:
        rank_main()  # a rank, started by torchrun
    else:
        main()
