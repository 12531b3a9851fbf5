"""Throughput of impala_monobeast.py, `--inference actor` (MonoBeast) vs `--inference batched`, at several actor
counts, against this machine's ceiling (CONVENTIONS: Tests and benchmarks), with policy lag, peak RSS and RSS growth.

For each (mode, actors), with the script's network, batch and unroll (TorchBeast's defaults: nature, 8, 80):
- `env`: agent steps/s of `make_vector_env(actors x envs_per_actor)` with random actions, one stepping thread per
  actor up to the machine's cores (MonoBeast: one env thread per actor process);
- `infer`: samples/s of the acting forward pass + sampling: `actor` = one actor's CPU copy at batch envs_per_actor,
  1 thread; `batched` = the inference thread's pass at batch actors x envs_per_actor, at the main process's threads;
- `train`: samples/s (T x batch_size x envs_per_actor per update) of the script's `learn()`, main process's threads;
- ceiling = 1 / (1/env + 1/infer + 1/train); efficiency = the script's steady agent steps/s / ceiling.
The script runs `--seconds`, is stopped with SIGINT; its steps/s comes from TensorBoard wall times after the first
quarter of the run, the policy lag is the mean of `charts/policy_lag` over the same part; RSS (PSS, so shared
buffers count once) is summed over its process tree every 0.5 s (growth: last sample minus the one at the start of
that steady part, also as % of it).
This machine is shared with other jobs: numbers are noisy, compare rows of the same run only.

    python benchmarks/impala_throughput.py                               # 2, 4, 8 actors x both modes, 30 s each
    python benchmarks/impala_throughput.py --actors 4 --modes batched --seconds 600 \\
        --out benchmarks/results/impala_rss.json
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
import torch
import tyro
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import impala_monobeast as im  # noqa: E402
from common.atari import make_vector_env  # noqa: E402
from common.models import make_model  # noqa: E402


@dataclass
class Args:
    env_id: str = "ALE/Breakout-v5"
    """ALE game"""
    actors: list[int] = field(default_factory=lambda: [2, 4, 8])
    """actor counts to measure"""
    modes: list[str] = field(default_factory=lambda: ["actor", "batched"])
    """inference modes to measure"""
    network: str = "nature"
    """network (TorchBeast's default: the shallow nature net)"""
    batch_size: int = 8
    """learner batch (TorchBeast: 8)"""
    unroll_length: int = 80
    """unroll (TorchBeast: 80)"""
    num_envs_per_actor: int = 1
    """envs per actor (MonoBeast: 1)"""
    seconds: float = 30.0
    """run time of each configuration"""
    component_seconds: float = 2.0
    """measuring time of each ceiling component"""
    out: str = "benchmarks/results/impala_throughput.json"
    """where the JSON results go"""


def rate(fn, items: int, seconds: float) -> float:
    """items/s of fn() over about `seconds`, after a warm-up call."""
    fn()
    n, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        fn()
        n += 1
    return n * items / elapsed


def ceiling(args: Args, mode: str, actors: int) -> dict:
    cores = os.cpu_count() or 1
    N, T, B = args.num_envs_per_actor, args.unroll_length, args.batch_size
    envs = make_vector_env(args.env_id, actors * N, 0, num_threads=min(actors, cores))
    obs, _ = envs.reset()
    actions = np.random.default_rng(0).integers(0, envs.single_action_space.n, (64, actors * N))
    i = iter(range(10**9))
    env_sps = rate(lambda: envs.step(actions[next(i) % 64]), actors * N, args.component_seconds)
    obs_space, act_space = envs.single_observation_space, envs.single_action_space
    envs.close()

    main_threads = max(1, cores - actors)  # impala_monobeast's default --torch-threads
    script_args = im.Args(env_id=args.env_id, batch_size=B, unroll_length=T, num_envs_per_actor=N)
    options = im.model_options(script_args)
    acting = make_model(obs_space, act_space, args.network, **options, channels_last=args.network != "nature")
    k = N if mode == "actor" else actors * N
    torch.set_num_threads(1 if mode == "actor" else main_threads)
    frames = torch.from_numpy(np.repeat(obs[:1], k, axis=0))
    done, last_action, reward = torch.zeros(k, dtype=torch.bool), torch.zeros(k, dtype=torch.int64), torch.zeros(k)

    def infer():
        with torch.inference_mode():
            im.policy_step(acting, frames, done, last_action, reward, None)

    infer_sps = rate(infer, k, args.component_seconds)

    torch.set_num_threads(main_threads)
    model = make_model(obs_space, act_space, args.network, **options)
    optimizer = torch.optim.RMSprop(model.parameters(), lr=4.8e-4, alpha=0.99, eps=0.01)
    BN, A = B * N, int(act_space.n)
    rows, zeros = (T + 1, BN), torch.zeros(B)
    batch = im.Rollouts(
        obs=torch.from_numpy(np.repeat(obs[None, :1], T + 1, axis=0).repeat(BN, axis=1)),
        reward=torch.randn(rows),
        done=torch.rand(rows) < 0.01,
        last_action=torch.randint(0, A, rows),
        episode_end=torch.zeros(rows, dtype=torch.bool),
        episode_return=torch.zeros(rows),
        episode_length=torch.zeros(rows, dtype=torch.int64),
        logits=torch.randn(*rows, A),
        baseline=torch.zeros(rows),
        action=torch.randint(0, A, rows),
        version=torch.zeros(rows, dtype=torch.int64),
        initial_h=torch.zeros(1, BN, 1),
        initial_c=torch.zeros(1, BN, 1),
        actor_id=zeros,
        rollout=zeros,
        free_wait=zeros,
        inference_wait=zeros,
    )
    train_sps = rate(lambda: im.learn(model, optimizer, batch, script_args, torch.device("cpu")), T * BN,
                     args.component_seconds)  # fmt: skip
    total = 1.0 / (1.0 / env_sps + 1.0 / infer_sps + 1.0 / train_sps)
    return {"env": env_sps, "infer": infer_sps, "train": train_sps, "ceiling": total}


def tree_rss_mb(pid: int) -> float:
    """Proportional resident memory (PSS: shared pages split between their users, so the shared-memory buffers count
    once) of `pid` and its children (one level: the actors), in MiB."""
    pids = [pid]
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    pids.append(int(d.name))
            except (OSError, ValueError, IndexError):
                pass
    total = 0
    for p in pids:
        try:
            for line in (Path("/proc") / str(p) / "smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1])
        except OSError:
            pass
    return total / 1024


def run_script(args: Args, mode: str, actors: int) -> dict:
    with tempfile.TemporaryDirectory() as log_dir:
        cmd = [sys.executable, "impala_monobeast.py", "--env-id", args.env_id, "--inference", mode, "--num-actors",
               str(actors), "--num-envs-per-actor", str(args.num_envs_per_actor), "--batch-size", str(args.batch_size),
               "--unroll-length", str(args.unroll_length), "--network", args.network, "--total-timesteps",
               "10000000000", "--log-dir", log_dir, "--log-interval", "10"]  # fmt: skip
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        rss, start = [], time.time()
        while time.time() - start < args.seconds and proc.poll() is None:
            rss.append((time.time(), tree_rss_mb(proc.pid)))
            time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
        if proc.returncode != 130:
            raise RuntimeError(f"{mode}/{actors} exited with {proc.returncode}: {err}")
        acc = EventAccumulator(str(next(Path(log_dir).iterdir())), size_guidance={"scalars": 0})
        acc.Reload()
        events, lags = acc.Scalars("charts/SPS"), acc.Scalars("charts/policy_lag")
    q = len(events) // 4  # after start-up
    sps = (events[-1].step - events[q].step) / (events[-1].wall_time - events[q].wall_time)
    base = next((m for t, m in rss if t >= events[q].wall_time), rss[-1][1])  # at the start of the steady part
    rss = [m for _, m in rss]
    return {
        "sps": sps,
        "policy_lag": float(np.mean([e.value for e in lags[q:]])),
        "peak_rss_mb": max(rss),
        "rss_growth_mb": rss[-1] - base,
        "rss_growth_pct": 100.0 * (rss[-1] - base) / base,
        "updates": len(events),
    }


def main(args: Args) -> None:
    rows = []
    for actors in args.actors:
        for mode in args.modes:
            row = {"mode": mode, "actors": actors, **{k: round(v, 1) for k, v in ceiling(args, mode, actors).items()}}
            row |= {k: round(v, 2) for k, v in run_script(args, mode, actors).items()}
            row["efficiency"] = round(row["sps"] / row["ceiling"], 3)
            rows.append(row)
            print(row, flush=True)
    meta = {"env_id": args.env_id, "cpus": os.cpu_count(), "machine": platform.machine(),
            "python": platform.python_version(), "torch": torch.__version__, "time": time.strftime("%Y-%m-%d %H:%M:%S"),
            "load_average": os.getloadavg(), "args": asdict(args)}  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(args.out + ".tmp")
    tmp.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    os.replace(tmp, args.out)
    print(f"\n{args.env_id}, {args.network} network, batch {args.batch_size}, unroll {args.unroll_length}, "
          f"{args.num_envs_per_actor} env(s)/actor; samples/s; load average {os.getloadavg()[0]:.1f}")  # fmt: skip
    print(f"{'mode':<8} {'actors':>6} {'env':>7} {'infer':>7} {'train':>7} {'ceiling':>8} {'SPS':>6} {'eff.':>5} "
          f"{'lag':>5} {'peak RSS MiB':>12} {'RSS growth':>10}")  # fmt: skip
    for r in rows:
        print(
            f"{r['mode']:<8} {r['actors']:>6} {r['env']:>7.0f} {r['infer']:>7.0f} {r['train']:>7.0f} "
            f"{r['ceiling']:>8.0f} {r['sps']:>6.0f} {r['efficiency']:>5.2f} {r['policy_lag']:>5.1f} "
            f"{r['peak_rss_mb']:>12.0f} {r['rss_growth_pct']:>9.1f}%"
        )


if __name__ == "__main__":
    main(tyro.cli(Args))
