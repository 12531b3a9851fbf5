"""Throughput of hts_a2c.py / hts_ppo.py, HTS-RL and their `--sync` mode, on an ALE game against this machine's
ceiling (CONVENTIONS: Tests and benchmarks), with peak memory and its growth.

For each script, with the same env count, network and batch sizes as the run:
- `env`: agent steps/s of `make_vector_env(num_envs, num_threads=num_executors)` with random actions;
- `infer`: samples/s of one actor's forward pass + sampling at its batch (num_envs / num_executors), 1 thread;
- `train`: samples/s of the learner's update on a [sync_interval, num_envs] rollout (delayed for HTS-RL, plain for
  --sync), at the learner's threads;
- ceiling = 1 / (1/env + 1/infer + 1/train); efficiency = the script's steady agent steps/s / ceiling.
The script runs for `--seconds`, is stopped with SIGINT, and its steps/s is taken from TensorBoard wall times after
start-up. Memory is sampled every 0.5 s over its process tree: RSS (summed; shared-memory storages count once per
process that maps them) and PSS (shared pages split between their users: the real footprint); growth is the mean
of the last 10% of samples minus the mean of the 10% after the first quarter (samples fall anywhere in an update,
whose transient allocations come and go, so single samples are noisy).

    python benchmarks/hts_throughput.py
    python benchmarks/hts_throughput.py --scripts hts_a2c.py --modes hts --num-envs 32 --num-executors 2 --seconds 60
"""

from __future__ import annotations

import copy
import importlib
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
from common.atari import make_vector_env  # noqa: E402
from common.models import make_model  # noqa: E402


@dataclass
class Args:
    env_id: str = "ALE/Breakout-v5"
    """ALE game"""
    scripts: list[str] = field(default_factory=lambda: ["hts_a2c.py", "hts_ppo.py"])
    """scripts to measure"""
    modes: list[str] = field(default_factory=lambda: ["hts", "sync"])
    """hts (HTS-RL) and/or sync (the script's --sync mode)"""
    num_envs: int = 16
    """environments (Sec. 5: 16)"""
    num_executors: int = 1
    """executor processes (one C++ vector env of num_envs / num_executors envs each)"""
    num_actors: int = 1
    """actor processes"""
    seconds: float = 45.0
    """run time of each script"""
    component_seconds: float = 3.0
    """measuring time of each ceiling component"""
    out: str = "benchmarks/results/hts_throughput.json"
    """where the JSON results go"""


def rate(fn, items: int, seconds: float) -> float:
    """items/s of fn() over about `seconds`, after a warm-up call."""
    fn()
    n, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        fn()
        n += 1
    return n * items / elapsed


def ceiling(args: Args, script: str, mode: str) -> dict:
    module = importlib.import_module(Path(script).stem)
    script_args = module.Args(env_id=args.env_id, num_envs=args.num_envs, num_executors=args.num_executors,
                              num_actors=args.num_actors)  # fmt: skip
    N, T, k = args.num_envs, script_args.sync_interval, args.num_envs // args.num_executors
    envs = make_vector_env(args.env_id, N, 0, num_threads=args.num_executors)
    obs, _ = envs.reset()
    actions = np.random.default_rng(0).integers(0, envs.single_action_space.n, (64, N))
    i = iter(range(10**9))
    env_sps = rate(lambda: envs.step(actions[next(i) % 64]), N, args.component_seconds)
    model = make_model(envs.single_observation_space, envs.single_action_space)
    envs.close()

    torch.set_num_threads(1)  # as an actor
    frames = torch.from_numpy(np.repeat(obs[:1], k, axis=0))
    uniforms = torch.rand(k, dtype=torch.float64)

    def infer():
        with torch.no_grad():
            module.sample_actions(model(frames)[0], uniforms)

    infer_sps = rate(infer, k, args.component_seconds)

    torch.set_num_threads(max(1, (os.cpu_count() or 1) - args.num_executors - args.num_actors))  # as the learner
    behavior = copy.deepcopy(model)
    optimizer = module.make_optimizer(behavior, script_args)
    batch = {
        "obs": torch.from_numpy(np.repeat(obs[None, :1], T + 1, axis=0).repeat(N, axis=1)),
        "actions": torch.randint(0, int(model.num_actions), (T, N)),
        "rewards": torch.randn(T, N),
        "dones": (torch.rand(T, N) < 0.01).float(),
    }
    if mode == "sync":
        train_sps = rate(lambda: module.learn(behavior, optimizer, batch, script_args), T * N, args.component_seconds)
    else:
        train_sps = rate(lambda: module.delayed_update(model, behavior, lambda: module.learn(behavior, optimizer, batch,
                                                                                             script_args)),
                         T * N, args.component_seconds)  # fmt: skip
    total = 1.0 / (1.0 / env_sps + 1.0 / infer_sps + 1.0 / train_sps)
    return {"env": env_sps, "infer": infer_sps, "train": train_sps, "ceiling": total}


def tree_memory_mb(pid: int) -> tuple[float, float]:
    """(RSS, PSS) of `pid` and its children (one level: the workers), in MiB."""
    pids = [pid]
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    pids.append(int(d.name))
            except (OSError, ValueError, IndexError):
                pass
    rss = pss = 0
    for p in pids:
        try:
            for line in (Path("/proc") / str(p) / "status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    rss += int(line.split()[1])
            for line in (Path("/proc") / str(p) / "smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    pss += int(line.split()[1])
        except OSError:
            pass
    return rss / 1024, pss / 1024


def growth(samples: list[float]) -> float:
    """Mean of the last 10% of the samples minus the mean of the 10% that follow the first quarter (warm-up)."""
    k = max(1, len(samples) // 10)
    start = len(samples) // 4
    return float(np.mean(samples[-k:]) - np.mean(samples[start : start + k]))


def run_script(args: Args, script: str, mode: str) -> dict:
    with tempfile.TemporaryDirectory() as log_dir:
        cmd = [sys.executable, script, "--env-id", args.env_id, "--num-envs", str(args.num_envs), "--num-executors",
               str(args.num_executors), "--num-actors", str(args.num_actors), "--total-timesteps", "10000000000",
               "--log-dir", log_dir, "--log-interval", "10", *(["--sync"] if mode == "sync" else [])]  # fmt: skip
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        rss, pss, start = [], [], time.time()
        while time.time() - start < args.seconds and proc.poll() is None:
            r, p = tree_memory_mb(proc.pid)
            rss.append(r)
            pss.append(p)
            time.sleep(0.5)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
        if proc.returncode != 128 + signal.SIGINT:
            raise RuntimeError(f"{script} exited with {proc.returncode}: {err}")
        acc = EventAccumulator(str(next(Path(log_dir).iterdir())), size_guidance={"scalars": 0})
        acc.Reload()
        events = acc.Scalars("charts/SPS")
    first = events[len(events) // 4]  # after start-up
    sps = (events[-1].step - first.step) / (events[-1].wall_time - first.wall_time)
    return {
        "sps": sps,
        "peak_rss_mb": max(rss),
        "rss_growth_mb": growth(rss),
        "peak_pss_mb": max(pss),
        "pss_growth_mb": growth(pss),
        "sps_points": len(events),
    }


def main(args: Args) -> None:
    rows = []
    for script in args.scripts:
        for mode in args.modes:
            row = {"script": script, "mode": mode, **{k: round(v, 1) for k, v in ceiling(args, script, mode).items()}}
            row |= {k: round(v, 1) for k, v in run_script(args, script, mode).items()}
            row["efficiency"] = round(row["sps"] / row["ceiling"], 3)
            rows.append(row)
            print(row, flush=True)
    meta = {"env_id": args.env_id, "cpus": os.cpu_count(), "machine": platform.machine(),
            "python": platform.python_version(), "torch": torch.__version__, "time": time.strftime("%Y-%m-%d %H:%M:%S"),
            "args": asdict(args)}  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(args.out + ".tmp")
    tmp.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    os.replace(tmp, args.out)
    print(f"\n{args.env_id}, {args.num_envs} envs, {args.num_executors} executor(s), {args.num_actors} actor(s); "
          "samples/s")  # fmt: skip
    print(f"{'script':<11} {'mode':<5} {'env':>7} {'infer':>7} {'train':>7} {'ceiling':>8} {'SPS':>6} {'eff.':>5} "
          f"{'peak RSS':>8} {'RSS +':>6} {'peak PSS':>8} {'PSS +':>6} (MiB)")  # fmt: skip
    for r in rows:
        print(
            f"{r['script']:<11} {r['mode']:<5} {r['env']:>7.0f} {r['infer']:>7.0f} {r['train']:>7.0f} "
            f"{r['ceiling']:>8.0f} {r['sps']:>6.0f} {r['efficiency']:>5.2f} {r['peak_rss_mb']:>8.0f} "
            f"{r['rss_growth_mb']:>6.1f} {r['peak_pss_mb']:>8.0f} {r['pss_growth_mb']:>6.1f}"
        )


if __name__ == "__main__":
    main(tyro.cli(Args))
