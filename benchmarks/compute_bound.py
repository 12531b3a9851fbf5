"""How fast can PPO / IMPALA / A2C on Atari possibly run on this machine? A compute bound from counted FLOPs.

Every actor-learner script does the same arithmetic per agent step whatever its architecture: the actor's forward
pass, and the learner's forward/backward passes over the sample (PPO: one forward for the values and log-probs of
the rollout, then `epochs` forward/backward passes; IMPALA: one forward/backward; A2C: one forward/backward over the
T+1 observations of each T-step rollout). Overlapping acting and learning can hide waiting, never arithmetic. So,
counting CPU-seconds on all cores together:

    agent steps/s  <=  cores / (FLOP per agent step / learner FLOP per CPU-second  +  env CPU-seconds per step)

FLOP per agent step is counted with torch's FlopCounterMode on the real networks of `common/models.py`; the learner's
FLOP per CPU-second is measured here on the learner's own work (forward + backward + optimizer step at the
algorithm's minibatch size, all threads; the actor's small-batch forwards are charged at that same, better, rate);
the env's CPU-seconds per step come from `make_vector_env` with random actions (process time covers its C++
threads). The bound assumes perfect overlap and no other cost, so no architecture can beat it without doing the
arithmetic itself faster. The sgemm rate is printed beside it as the machine's practical peak. `--targets` turns
the bound into a verdict for a given agent-steps/s target (e.g. an issue's "2x TorchBeast").

    python benchmarks/compute_bound.py
    python benchmarks/compute_bound.py --targets ppo=621 impala=1460 --out benchmarks/results/compute_bound.json
"""

from __future__ import annotations

import json
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import gymnasium as gym
import numpy as np
import torch
import tyro
from torch.utils.flop_counter import FlopCounterMode

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from common.atari import make_vector_env  # noqa: E402
from common.models import make_model  # noqa: E402

# algorithm -> (network, learner minibatch, forward/backward passes per sample, extra learner forwards per sample,
#               observations the learner's forward/backward takes per sample)
ALGOS = {
    "ppo": ("nature", 256, 4, 1, 1.0),  # CleanRL/Cleanba PPO: 8 envs x 128 steps, 4 minibatches, 4 epochs, value pass
    "impala": ("nature", 640, 1, 0, 1.0),  # TorchBeast MonoBeast: batch 8 x unroll 80, shallow (Nature-like) network
    "a2c": ("nature", 96, 1, 0, 6 / 5),  # GALA/A3C/HTS A2C: 16 envs x (5 + 1 bootstrap) observations per 5 samples
    "impala_resnet": ("impala", 160, 1, 0, 1.0),  # Cleanba IMPALA: 8 envs x 20 steps, IMPALA ResNet
}


@dataclass
class Args:
    algos: list[str] = field(default_factory=lambda: list(ALGOS))
    """algorithms to bound"""
    targets: list[str] = field(default_factory=list)
    """ALGO=STEPS_PER_S pairs to judge against the bound"""
    env_id: str = "ALE/Breakout-v5"
    """env for the env-rate term"""
    num_envs: int = 16
    """envs of the env-rate measurement"""
    seconds: float = 5.0
    """seconds per rate measurement"""
    out: str | None = None
    """where the JSON goes (optional)"""


def rate(fn, seconds: float) -> tuple[float, float]:
    """(calls per wall second, CPU-seconds per call over all threads) of fn, after two warm-up calls."""
    fn(), fn()
    n, t0, c0 = 0, time.perf_counter(), time.process_time()
    while time.perf_counter() - t0 < seconds:
        fn()
        n += 1
    return n / (time.perf_counter() - t0), (time.process_time() - c0) / n


def flops(fn) -> int:
    with FlopCounterMode(display=False) as counter:
        fn()
    return counter.get_total_flops()


def main(args: Args) -> None:
    unknown = sorted(set(args.algos) - set(ALGOS))
    if unknown:
        sys.exit(f"error: unknown algo(s) {unknown}; known: {sorted(ALGOS)}")
    targets = {k: float(v) for k, v in (t.split("=") for t in args.targets)}
    threads = torch.get_num_threads()
    obs_space, act_space = gym.spaces.Box(0, 255, (4, 84, 84), np.uint8), gym.spaces.Discrete(4)

    a, b = torch.randn(2048, 2048), torch.randn(2048, 2048)
    sgemm = 2 * 2048**3 * rate(lambda: a @ b, args.seconds)[0] / 1e9
    cores = len(os.sched_getaffinity(0))
    envs = make_vector_env(args.env_id, args.num_envs, seed=0, protocol="deepmind")
    envs.reset(seed=0)
    rng = np.random.default_rng(0)
    calls, env_cpu = rate(lambda: envs.step(rng.integers(0, 4, size=args.num_envs)), args.seconds)
    env_sps, env_cpu_per_step = args.num_envs * calls, env_cpu / args.num_envs
    envs.close()
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores, torch {torch.__version__}, "
          f"{threads} threads; sgemm 2048^3: {sgemm:.0f} GFLOP/s; env ({args.env_id}, {args.num_envs} envs, random "
          f"actions): {env_sps:,.0f} agent steps/s, {1e6 * env_cpu_per_step:.0f} CPU-us each")  # fmt: skip

    rows = []
    for algo in args.algos:
        network, batch, fwd_bwd, extra_fwd, obs_per_sample = ALGOS[algo]
        model = make_model(obs_space, act_space, network)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-4)
        x = torch.randint(0, 255, (batch, 4, 84, 84), dtype=torch.uint8)
        x1 = x[:1]

        def train_step(model=model, optimizer=optimizer, x=x):
            logits, values = model(x)
            optimizer.zero_grad()
            (logits.logsumexp(-1).mean() + values.square().mean()).backward()
            optimizer.step()

        def forward1(model=model, x1=x1):
            with torch.inference_mode():
                model(x1)

        def fwd_bwd1(model=model, x1=x1):
            logits, values = model(x1)
            (logits.sum() + values.sum()).backward()

        f_fwd, f_fwd_bwd = flops(forward1), flops(fwd_bwd1)
        per_step = f_fwd * (1 + extra_fwd) + f_fwd_bwd * fwd_bwd * obs_per_sample
        calls, cpu_per_call = rate(train_step, args.seconds)
        learner_gflops = f_fwd_bwd * batch * calls / 1e9  # per wall second, all threads
        flop_per_cpu_s = f_fwd_bwd * batch / cpu_per_call
        bound = cores / (per_step / flop_per_cpu_s + env_cpu_per_step)
        row = dict(algo=algo, network=network, minibatch=batch, mflop_forward=f_fwd / 1e6,
                   mflop_forward_backward=f_fwd_bwd / 1e6, mflop_per_agent_step=per_step / 1e6,
                   learner_gflops=learner_gflops, learner_fraction_of_sgemm=learner_gflops / sgemm,
                   learner_gflop_per_cpu_s=flop_per_cpu_s / 1e9, bound_agent_steps_per_s=bound)  # fmt: skip
        if algo in targets:
            # CPU-seconds left for arithmetic per agent step at the target rate, after the env's share
            left = cores / targets[algo] - env_cpu_per_step
            need = per_step / left / 1e9 if left > 0 else None  # GFLOP per CPU-second the learner would need
            row.update(target=targets[algo], target_needs_gflop_per_cpu_s=need)
            row.update(target_within_bound=targets[algo] <= bound)
        rows.append(row)
        print(f"{algo:14s} {per_step / 1e6:6.1f} MFLOP/agent step  learner {learner_gflops:5.1f} GFLOP/s "
              f"({learner_gflops / sgemm:.0%} of sgemm)  bound {bound:,.0f} agent steps/s", end="")  # fmt: skip
        if algo in targets:
            need = row["target_needs_gflop_per_cpu_s"]
            print(f"  | target {targets[algo]:,.0f}: needs "
                  + (f"{need:.0f} GFLOP per CPU-s ({need / row['learner_gflop_per_cpu_s']:.2f}x measured)" if need
                     else "more CPU than the env alone leaves")
                  + (" -> within the bound" if row["target_within_bound"] else " -> beyond the bound"))  # fmt: skip
        else:
            print()
    if args.out:
        result = dict(machine=f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
                      torch=torch.__version__, threads=threads, cores=cores, sgemm_gflops=sgemm,
                      env_agent_steps_per_s=env_sps, env_cpu_seconds_per_step=env_cpu_per_step,
                      args=asdict(args), rows=rows)  # fmt: skip
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main(tyro.cli(Args))
