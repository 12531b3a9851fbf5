"""HTS-RL vs its own `--sync` mode on an env whose step time varies (HTS-RL Fig. 4 left, Claim 1 / Eq. 7).

Both runs are `hts_a2c.py` on `benchmarks.straggler:Straggler-v0` (one executor per env), whose steps sleep for a
Gamma-distributed time of mean `--mean-ms` and standard deviation `--stds-ms` (sleep uses no CPU, so the 2-core
machine is not the bottleneck as long as the asynchronous bound stays well below the scripts' CPU-bound step rate):
- `--sync`: synchronous A2C: every env step waits for the slowest env (lockstep, alpha = 1 in Eq. 7), learning
  waits for the rollout and the rollout for learning. Its env time per step does not depend on the rollout length,
  so it runs with `--sync-rollout` steps per update (a shorter measurement; learning is < 1% of a rollout here);
- HTS-RL: `--sync-interval alpha`: executors synchronize every alpha steps and learning overlaps the rollout.
Agent steps/s come from TensorBoard wall times of `charts/SPS` between the first and the last update (start-up and
the first rollout excluded). Eq. 7 is evaluated for Gamma step times of shape k = (mean/std)^2 (the sum of alpha
steps is Gamma(alpha k), the paper's exponential case is k = 1) with actor compute c = 0: `eq7 x` is its predicted
speedup E[T](alpha=1) / E[T](alpha), and `vs async` is HTS-RL's measured runtime over Eq. 7's asynchronous bound
(alpha >= K/n, K = the agent steps measured). Targets (paper, Sec. 5): >= 5x at the highest variance of the sweep,
runtime within 1.25x of the asynchronous bound.

    python benchmarks/hts_straggler.py
    python benchmarks/hts_straggler.py --num-envs 8 --mean-ms 10 --stds-ms 0 10 20 40 --alpha 512
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import tyro
from scipy.stats import gamma as gamma_dist
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

ROOT = Path(__file__).resolve().parents[1]
ENV_ID = "benchmarks.straggler:Straggler-v0"


@dataclass
class Args:
    num_envs: int = 8
    """parallel envs n (one executor each)"""
    mean_ms: float = 10.0
    """mean env step time in milliseconds"""
    stds_ms: list[float] = field(default_factory=lambda: [0.0, 10.0, 20.0, 40.0])
    """step-time standard deviations to sweep (std = mean: the exponential step times of Fig. 3)"""
    alpha: int = 512
    """HTS-RL synchronization interval --sync-interval"""
    hts_rollouts: int = 3
    """rollouts of HTS-RL measured after the first one"""
    sync_rollout: int = 64
    """--sync-interval of the --sync runs (rollout length; lockstep makes their step time independent of it)"""
    sync_rollouts: int = 4
    """rollouts of --sync measured after the first one"""
    num_actors: int = 2
    """actor processes"""
    out: str = "benchmarks/results/hts_straggler.json"
    """where the JSON results go"""


def eq7_time(n: int, K: float, alpha: float, mean_s: float, std_s: float, c: float = 0.0) -> float:
    """Eq. 7: expected time for n envs to collect K states, synchronizing every alpha steps. Step times are Gamma of
    shape k = (mean/std)^2 and rate beta = k/mean, so alpha steps sum to Gamma(alpha k, beta) (k = 1: the paper)."""
    if std_s == 0:
        return K / n * mean_s + K * c / n
    k = (mean_s / std_s) ** 2
    if alpha * k < 1:  # the approximation (derived for exponential steps, shape >= 1) breaks down below shape 1
        return float("nan")
    beta = k / mean_s
    f_inv = gamma_dist.ppf(1.0 - 1.0 / n, alpha * k, scale=1.0 / beta)
    expected_max = np.euler_gamma / beta * (1 + (alpha * k - 1) / (beta * f_inv)) + f_inv
    return K / (n * alpha) * expected_max + K * c / n


def measure(args: Args, std_ms: float, sync: bool) -> dict:
    """Steady-state agent steps/s of hts_a2c.py (between its first and last charts/SPS point), and its learner time."""
    alpha, rollouts = (args.sync_rollout, args.sync_rollouts) if sync else (args.alpha, args.hts_rollouts)
    env = os.environ | {"STRAGGLER_MEAN_MS": str(args.mean_ms), "STRAGGLER_STD_MS": str(std_ms)}
    with tempfile.TemporaryDirectory() as log_dir:
        cmd = [sys.executable, "hts_a2c.py", "--env-id", ENV_ID, "--num-envs", str(args.num_envs), "--num-executors",
               str(args.num_envs), "--num-actors", str(args.num_actors), "--sync-interval", str(alpha),
               "--total-timesteps", str(args.num_envs * alpha * (rollouts + 1)), "--log-frequency", "1",
               "--log-dir", log_dir, *(["--sync"] if sync else [])]  # fmt: skip
        subprocess.run(cmd, cwd=ROOT, check=True, env=env, capture_output=True, timeout=600)
        acc = EventAccumulator(str(next(Path(log_dir).iterdir())), size_guidance={"scalars": 0})
        acc.Reload()
        events = acc.Scalars("charts/SPS")
        learn = [e.value for e in acc.Scalars("timing/learner_update")]
    first, last = events[0], events[-1]
    seconds = last.wall_time - first.wall_time
    return {"sps": (last.step - first.step) / seconds, "steps": last.step - first.step, "seconds": seconds,
            "learn_fraction": sum(learn[1:]) / seconds}  # fmt: skip


def main(args: Args) -> None:
    rows = []
    n, mean_s = args.num_envs, args.mean_ms / 1000
    for std_ms in args.stds_ms:
        sync, hts = measure(args, std_ms, sync=True), measure(args, std_ms, sync=False)
        std_s, K = std_ms / 1000, hts["steps"]
        async_sps = K / eq7_time(n, K, K / n, mean_s, std_s)
        row = {
            "std_ms": std_ms,
            "cv": round(std_ms / args.mean_ms, 2),
            "sync_sps": round(sync["sps"], 1),
            "hts_sps": round(hts["sps"], 1),
            "speedup": round(hts["sps"] / sync["sps"], 2),
            "eq7_speedup": round(eq7_time(n, K, 1, mean_s, std_s) / eq7_time(n, K, args.alpha, mean_s, std_s), 2),
            "eq7_async_sps": round(async_sps, 1),
            "hts_runtime_vs_async": round(async_sps / hts["sps"], 3),
            "sync_learn_fraction": round(sync["learn_fraction"], 4),
            "hts_steps_measured": K,
            "sync_steps_measured": sync["steps"],
        }
        rows.append(row)
        print(row, flush=True)
    top = rows[-1]
    verdict = {
        "speedup_at_highest_variance": top["speedup"],
        "speedup_target_5x_met": top["speedup"] >= 5.0,
        "worst_runtime_vs_async": max(r["hts_runtime_vs_async"] for r in rows),
        "runtime_within_1.25x_async_met": all(r["hts_runtime_vs_async"] <= 1.25 for r in rows),
    }
    meta = {"cpus": os.cpu_count(), "machine": platform.machine(), "python": platform.python_version(),
            "time": time.strftime("%Y-%m-%d %H:%M:%S"), "args": asdict(args)}  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(args.out + ".tmp")
    tmp.write_text(json.dumps({"meta": meta, "rows": rows, "verdict": verdict}, indent=2))
    os.replace(tmp, args.out)
    print(f"\nhts_a2c.py, {n} envs, step time mean {args.mean_ms} ms, HTS-RL alpha {args.alpha}; agent steps/s")
    print(f"{'std ms':>7} {'cv':>5} {'--sync':>7} {'HTS-RL':>7} {'speedup':>8} {'eq7 x':>6} {'async':>6} "
          f"{'vs async':>8}")  # fmt: skip
    for r in rows:
        print(f"{r['std_ms']:>7.1f} {r['cv']:>5.2f} {r['sync_sps']:>7.0f} {r['hts_sps']:>7.0f} {r['speedup']:>8.2f} "
              f"{r['eq7_speedup']:>6.2f} {r['eq7_async_sps']:>6.0f} {r['hts_runtime_vs_async']:>8.2f}")  # fmt: skip
    print(verdict)


if __name__ == "__main__":
    main(tyro.cli(Args))
