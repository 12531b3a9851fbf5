"""Throughput of cleanba_ppo_impala.py on Breakout: `--sync` vs Cleanba mode, PPO and IMPALA, against the ceiling.

For each algorithm, in one run of this benchmark and with the script's own settings (same envs, network, batch):
  env    = agent steps/s of the vector env alone (random actions)
  infer  = samples/s of the actor's forward pass + sampling alone (batch = envs per actor thread)
  train  = rollout samples/s of the learner's update alone (PPO: value pass + epochs x minibatches; IMPALA: one pass)
  ceiling = 1 / (1/env + 1/infer + 1/train)        (../shared/CONVENTIONS.md)
then runs the script itself in both modes and reports steady-state agent steps/s (from the TensorBoard event times,
after a warm-up share of the run), efficiency = SPS / ceiling, the share of the learner's time blocked on
`rollout_Q.get` and of the actor's on `param_Q.get` (Cleanba's bottleneck diagnosis), peak RSS and RSS growth.

    python benchmarks/cleanba_throughput.py                       # both algorithms, both modes
    python benchmarks/cleanba_throughput.py --algos ppo -- --torch-threads 1    # flags after -- go to the script
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import tyro
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
import cleanba_ppo_impala as cleanba  # noqa: E402
from common.atari import make_vector_env  # noqa: E402
from common.models import make_model  # noqa: E402


@dataclass
class Args:
    env_id: str = "ALE/Breakout-v5"
    """ALE game"""
    algos: list[str] = field(default_factory=lambda: ["ppo", "impala"])
    """algorithms to measure"""
    modes: list[str] = field(default_factory=lambda: ["sync", "cleanba"])
    """architectures to run: `sync` (--sync) and/or `cleanba`"""
    updates: int = 30
    """learner updates per script run (the first `warmup` share is not counted)"""
    warmup: float = 0.25
    """share of the run's updates skipped before measuring steady-state steps/s"""
    component_seconds: float = 5.0
    """seconds spent measuring each ceiling component"""
    out: str = "benchmarks/results/cleanba_throughput.json"
    """where the JSON results go"""


def timed_rate(fn, samples_per_call: int, seconds: float) -> float:
    fn()  # warm-up
    n, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        fn()
        n += 1
    return n * samples_per_call / elapsed


def script_args(algo: str, extra: list[str]) -> cleanba.Args:
    args = tyro.cli(cleanba.Args, args=["--algo", algo, *extra])
    return cleanba.resolve_defaults(args)


def ceiling_components(env_id: str, algo: str, extra: list[str], seconds: float) -> dict:
    args = script_args(algo, extra)
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    n = args.num_envs // args.num_actor_threads
    threads = args.env_threads or max(1, (os.cpu_count() or 1) // args.num_actor_threads)
    envs = make_vector_env(env_id, n, 0, protocol=args.atari_protocol, num_threads=threads)
    obs, _ = envs.reset()
    actions = np.random.default_rng(0).integers(0, envs.single_action_space.n, (64, n))
    i = iter(range(10**9))
    env_sps = timed_rate(lambda: envs.step(actions[next(i) % 64]), n, seconds)

    network = cleanba.pick_network(args, envs.single_observation_space.shape)
    model = make_model(envs.single_observation_space, envs.single_action_space, network)
    gen = torch.Generator().manual_seed(0)
    obs_t = torch.from_numpy(obs)

    def infer():
        with torch.inference_mode():
            logits, _ = model(obs_t)
            cleanba.sample_actions(logits, gen)

    infer_sps = timed_rate(infer, n, seconds)

    T, N = args.num_steps, args.num_envs
    data = cleanba.Rollout(
        obs=torch.randint(0, 256, (T, N, *obs.shape[1:]), dtype=torch.uint8),
        actions=torch.randint(0, envs.single_action_space.n, (T, N)),
        logprobs=torch.full((T, N), -1.0),
        values=torch.zeros(T, N),
        rewards=torch.rand(T, N),
        dones=(torch.rand(T, N) < 0.01).float(),
        next_obs=torch.randint(0, 256, (N, *obs.shape[1:]), dtype=torch.uint8),
    )
    algorithm = cleanba.algorithm(args)
    optimizer = algorithm.optimizer(model.parameters())
    train_sps = timed_rate(
        lambda: algorithm.update(model, optimizer, data, args, gen, 1, threading.Event()), T * N, seconds
    )
    envs.close()
    ceiling = 1.0 / (1.0 / env_sps + 1.0 / infer_sps + 1.0 / train_sps)
    return dict(
        env=env_sps,
        infer=infer_sps,
        train=train_sps,
        ceiling=ceiling,
        num_envs=N,
        num_steps=T,
        network=network,
        actor_batch=n,
    )


def rss_sampler(pid: int, samples: list, stop: threading.Event) -> None:
    while not stop.wait(0.5):
        try:
            for line in Path(f"/proc/{pid}/status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    samples.append((time.time(), int(line.split()[1]) / 1024))  # MiB
        except FileNotFoundError:
            return


def run_script(env_id: str, algo: str, sync: bool, updates: int, warmup: float, extra: list[str]) -> dict:
    args = script_args(algo, extra)
    total = updates * args.num_envs * args.num_steps
    with tempfile.TemporaryDirectory() as log_dir:
        cmd = [
            sys.executable,
            "cleanba_ppo_impala.py",
            "--env-id",
            env_id,
            "--algo",
            algo,
            "--total-timesteps",
            str(total),
            "--log-dir",
            log_dir,
            "--log-interval",
            "30",
            *extra,
            *(["--sync"] if sync else []),
        ]
        start = time.time()
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        samples, stop = [], threading.Event()
        sampler = threading.Thread(target=rss_sampler, args=(proc.pid, samples, stop))
        sampler.start()
        out, err = proc.communicate()
        stop.set()
        sampler.join()
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{err}")
        (run_dir,) = Path(log_dir).iterdir()
        acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
        acc.Reload()
        sps_events = acc.Scalars("charts/SPS")
        first = sps_events[int(len(sps_events) * warmup)]
        last = sps_events[-1]
        steady_sps = (last.step - first.step) / (last.wall_time - first.wall_time)
        measured = [e for e in sps_events if e.step > first.step]

        def total_of(tag):
            return sum(e.value for e in acc.Scalars(tag) if e.step > first.step)

        span = last.wall_time - first.wall_time
        t_measure = first.wall_time
        rss_steady = [m for t, m in samples if t >= t_measure]
        rss_start = rss_steady[0] if rss_steady else float("nan")
    return dict(
        algo=algo,
        mode="sync" if sync else "cleanba",
        agent_steps=total,
        wall_s=round(time.time() - start, 1),
        sps=steady_sps,
        updates_measured=len(measured),
        learner_wait_rollout_share=total_of("timing/rollout_queue_get") / span,
        actor_wait_param_share=total_of("timing/param_queue_get") / span,
        learner_train_share=total_of("timing/train") / span,
        peak_rss_mib=max(m for _, m in samples),
        rss_growth=(rss_steady[-1] - rss_start) / rss_start if rss_steady else float("nan"),
    )


def main(args: Args, extra: list[str]) -> None:
    rows, components = [], {}
    print(f"{args.env_id}, {os.cpu_count()} CPUs, torch {torch.__version__}, extra flags: {extra}")
    for algo in args.algos:
        comp = ceiling_components(args.env_id, algo, extra, args.component_seconds)
        components[algo] = comp
        print(
            f"[{algo}] {comp['num_envs']} envs x {comp['num_steps']} steps, {comp['network']} network: "
            f"env {comp['env']:,.0f}/s  infer {comp['infer']:,.0f}/s  train {comp['train']:,.0f}/s  "
            f"-> ceiling {comp['ceiling']:,.0f} agent steps/s",
            flush=True,
        )
        for sync in [mode == "sync" for mode in args.modes]:
            row = run_script(args.env_id, algo, sync, args.updates, args.warmup, extra)
            row["ceiling"] = comp["ceiling"]
            row["efficiency"] = row["sps"] / comp["ceiling"]
            rows.append(row)
            print(
                f"  {row['mode']:<8} {row['sps']:>8,.0f} steps/s  efficiency {row['efficiency']:.2f}  "
                f"learner waits on rollout_Q {row['learner_wait_rollout_share']:.0%}  "
                f"actor waits on param_Q {row['actor_wait_param_share']:.0%}  "
                f"peak RSS {row['peak_rss_mib']:,.0f} MiB  RSS growth {row['rss_growth']:+.1%}",
                flush=True,
            )
        if len(args.modes) == 2:
            print(f"  cleanba / sync = {rows[-1]['sps'] / rows[-2]['sps']:.2f}x")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = dict(
        env_id=args.env_id,
        cpus=os.cpu_count(),
        machine=platform.machine(),
        torch=torch.__version__,
        time=time.strftime("%Y-%m-%d %H:%M:%S"),
        args=asdict(args),
    )
    out.write_text(json.dumps(dict(meta=meta, components=components, rows=rows), indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    main(tyro.cli(Args, args=argv[:split]), extra=argv[split + 1 :])
