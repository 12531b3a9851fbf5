"""Agent steps/s of every script and mode at one comparable configuration, and the straggler sweep for all of them.

1. Breakout table: every script/mode on `ALE/Breakout-v5` (deepmind protocol, Nature CNN) with 16 environments in
   total (split over its workers as listed in `CONFIGS`), run for `--seconds` and stopped with SIGINT. Its steps/s
   is the steady rate from the TensorBoard wall times of `charts/SPS` (the first `--warmup` fraction of the logged
   span dropped: start-up, compilation of the first update). Beside it: the raw env ceiling, `make_vector_env` with
   16 envs and random actions, measured in the same run (what `benchmarks/env_throughput.py` measures).
2. Straggler sweep (the HTS-RL paper's Fig. 4 left, extended to every architecture): the same scripts/modes on
   `benchmarks.straggler:Straggler-v0`, whose every step sleeps for a Gamma-distributed time of mean `--mean-ms` and
   standard deviation from `--stds-ms`, with 8 envs in total and an MLP; steps/s against the step-time std. A
   synchronous design waits for the slowest env at every step, so its rate falls as the variance grows.
Scripts run one at a time (they measure CPU throughput; never run this beside other jobs). Writes JSON, prints tables.

    python benchmarks/throughput.py
    python benchmarks/throughput.py --only hts_a2c a3c_hogwild --seconds 30 --no-straggler
"""

from __future__ import annotations

import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import tyro
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from common.atari import make_vector_env  # noqa: E402

STRAGGLER = "benchmarks.straggler:Straggler-v0"

# label -> (script, flags giving N envs in total). `{n}`, `{half}` and `{quarter}` are N, N/2 and N/4.
CONFIGS: dict[str, tuple[str, list[str]]] = {
    "cleanba_ppo": ("cleanba_ppo_impala.py", ["--num-envs", "{n}"]),
    "cleanba_ppo_sync": ("cleanba_ppo_impala.py", ["--num-envs", "{n}", "--sync"]),
    "cleanba_impala": ("cleanba_ppo_impala.py", ["--algo", "impala", "--num-envs", "{n}"]),
    "hts_a2c": ("hts_a2c.py", ["--num-envs", "{n}"]),
    "hts_a2c_sync": ("hts_a2c.py", ["--num-envs", "{n}", "--sync"]),
    "hts_ppo": ("hts_ppo.py", ["--num-envs", "{n}"]),
    "impala_actor": (
        "impala_monobeast.py",
        ["--inference", "actor", "--num-actors", "4", "--num-envs-per-actor", "{quarter}"],
    ),
    "impala_batched": ("impala_monobeast.py", ["--num-actors", "4", "--num-envs-per-actor", "{quarter}"]),
    "gala_gossip": ("gala_a2c.py", ["--num-learners", "2", "--num-envs", "{half}"]),
    "gala_allreduce": ("gala_a2c.py", ["--num-learners", "2", "--num-envs", "{half}", "--mode", "allreduce"]),
    "a3c_hogwild": ("a3c_large_batch.py", ["--num-workers", "2", "--num-envs-per-worker", "{half}"]),
    "a3c_server": (
        "a3c_large_batch.py",
        ["--num-workers", "2", "--num-envs-per-worker", "{half}", "--update", "server"],
    ),
    # Ape-X: actor-side agent steps/s (the learner samples the replay at its own pace); a small replay for a short run
    "apex_dqn": (
        "apex_dqn.py",
        [
            "--num-actors",
            "2",
            "--num-envs-per-actor",
            "{half}",
            "--buffer-size",
            "20000",
            "--learning-starts",
            "2000",
            "--eval-interval",
            "0",
        ],
    ),
}


@dataclass
class Args:
    only: list[str] = field(default_factory=lambda: list(CONFIGS))
    """labels to measure (default: all of CONFIGS)"""
    seconds: float = 45.0
    """wall time of each Breakout run"""
    warmup: float = 0.25
    """fraction of the logged span dropped before the steady rate is taken"""
    num_envs: int = 16
    """environments in total for the Breakout table"""
    breakout: bool = True
    """run the Breakout table"""
    straggler: bool = True
    """run the straggler sweep"""
    straggler_envs: int = 8
    """environments in total for the straggler sweep"""
    mean_ms: float = 10.0
    """straggler mean step time (ms)"""
    stds_ms: list[float] = field(default_factory=lambda: [0.0, 10.0, 40.0])
    """straggler step-time standard deviations (ms)"""
    straggler_seconds: float = 25.0
    """wall time of each straggler run"""
    out: str = "benchmarks/results/throughput.json"
    """where the JSON goes"""


def steady_rate(run_dir: Path, warmup: float) -> tuple[float, int]:
    """Agent steps/s between the first event after `warmup` of the logged span and the last event of `charts/SPS`."""
    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    acc.Reload()
    events = acc.Scalars("charts/SPS") if "charts/SPS" in acc.Tags()["scalars"] else []
    if len(events) < 3:
        return float("nan"), events[-1].step if events else 0
    walls = np.array([e.wall_time for e in events])
    k = int(np.searchsorted(walls, walls[0] + warmup * (walls[-1] - walls[0])))
    k = min(k, len(events) - 2)
    return (events[-1].step - events[k].step) / (walls[-1] - walls[k]), events[-1].step


def run_script(label: str, env_id: str, n: int, extra: list[str], seconds: float, warmup: float, env=None) -> dict:
    script, flags = CONFIGS[label]
    flags = [f.format(n=n, half=n // 2, quarter=n // 4) for f in flags]
    with tempfile.TemporaryDirectory() as log_dir:
        cmd = [sys.executable, script, "--env-id", env_id, "--total-timesteps", "1000000000", "--log-dir", log_dir]
        cmd += ["--exp-name", label, *flags, *extra]
        t0 = time.time()
        proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env={**os.environ, **(env or {})},
        )
        try:
            proc.wait(timeout=seconds)
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGINT)
        output, _ = proc.communicate(timeout=60)
        runs = list(Path(log_dir).glob("*/events.out.tfevents.*"))
        sps, steps = steady_rate(runs[0].parent, warmup) if runs else (float("nan"), 0)
    if proc.returncode not in (0, -signal.SIGINT, 130):
        tail = "\n".join(output.splitlines()[-5:])
        print(f"  {label}: exit {proc.returncode}\n{tail}", flush=True)
    return dict(label=label, command=" ".join(cmd[1:3] + cmd[7:]), sps=sps, agent_steps=steps, wall=time.time() - t0)


def env_ceiling(env_id: str, num_envs: int, seconds: float = 5.0) -> float:
    envs = make_vector_env(env_id, num_envs, seed=0, protocol="deepmind")
    envs.reset(seed=0)
    rng = np.random.default_rng(0)
    steps, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        envs.step(rng.integers(0, envs.single_action_space.n, size=num_envs))
        steps += num_envs
    rate = steps / (time.perf_counter() - t0)
    envs.close()
    return rate


def main(args: Args) -> None:
    unknown = sorted(set(args.only) - set(CONFIGS))
    if unknown:
        sys.exit(f"error: unknown label(s) {unknown}; known: {sorted(CONFIGS)}")
    result = dict(
        machine=f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores", args=asdict(args)
    )
    ceiling = env_ceiling("ALE/Breakout-v5", args.num_envs)
    result["env_ceiling_sps"] = ceiling
    print(f"env ceiling (make_vector_env, {args.num_envs} envs, random actions): {ceiling:,.0f} agent steps/s")
    breakout = []
    nature = ["--atari-protocol", "deepmind", "--network", "nature"]
    for label in args.only if args.breakout else []:
        r = run_script(label, "ALE/Breakout-v5", args.num_envs, nature, args.seconds, args.warmup)
        r["fraction_of_env_ceiling"] = r["sps"] / ceiling
        breakout.append(r)
        print(f"  {label:16s} {r['sps']:8,.0f} steps/s  ({r['fraction_of_env_ceiling']:.2f} of env)", flush=True)
    result["breakout"] = breakout
    sweep = []
    if args.straggler:
        for label in args.only:
            row = dict(label=label)
            for std in args.stds_ms:
                env = {"STRAGGLER_MEAN_MS": str(args.mean_ms), "STRAGGLER_STD_MS": str(std)}
                r = run_script(
                    label,
                    STRAGGLER,
                    args.straggler_envs,
                    ["--network", "mlp"],
                    args.straggler_seconds,
                    args.warmup,
                    env,
                )
                row[f"std_{std:g}ms"] = r["sps"]
            sweep.append(row)
            print(f"  straggler {label:16s} " + "  ".join(f"{k}={v:,.0f}" for k, v in row.items() if k != "label"))
    result["straggler"] = sweep
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))

    print(f"\n| script / mode | Breakout agent steps/s ({args.num_envs} envs, Nature CNN) | fraction of env ceiling |")
    print("|---|---|---|")
    print(f"| env alone (random actions) | {ceiling:,.0f} | 1.00 |")
    for r in breakout:
        print(f"| {r['label']} | {r['sps']:,.0f} | {r['fraction_of_env_ceiling']:.2f} |")
    if sweep:
        cols = [f"std_{s:g}ms" for s in args.stds_ms]
        print(
            f"\n| script / mode ({args.straggler_envs} envs, mean step {args.mean_ms:g} ms) | "
            + " | ".join(cols)
            + " |"
        )
        print("|---|" + "---|" * len(cols))
        for row in sweep:
            print(f"| {row['label']} | " + " | ".join(f"{row[c]:,.0f}" for c in cols) + " |")


if __name__ == "__main__":
    main(tyro.cli(Args))
