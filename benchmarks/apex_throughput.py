"""apex_dqn.py actor-side throughput: agent steps/s against the number of actors, beside this machine's env ceiling.

For every env id and actor count it measures, in the same benchmark run:
- `env`: agent steps/s of `actors` processes each stepping its own 1-env vector env with random actions (1 torch
  thread, 1 env thread each, as the script's actors run), summed;
- `infer`: samples/s of the actors' 1-observation forward pass of the dueling Q-network alone, in `actors` processes;
- the script itself for `--seconds` with the learner held back (`--learning-starts` = `--buffer-size`, so actors run
  the whole Ape-X actor loop: act, n-step transitions, batched priorities with the local network, append under the
  buffer's lock, parameter pulls), stopped with SIGTERM: agent steps/s after `--warmup`, from its console lines.
ceiling = 1 / (1/env + 1/infer); efficiency = script / ceiling. The machine's load average is recorded: other jobs
share it, so compare rows of one run only.

    python benchmarks/apex_throughput.py                                    # CartPole and Breakout, 1/2/4 actors
    python benchmarks/apex_throughput.py --env-ids CartPole-v1 --actors 1 2 --seconds 10
"""

from __future__ import annotations

import json
import multiprocessing
import os
import platform
import re
import signal
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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from common.atari import make_vector_env  # noqa: E402
from common.models import make_q_network  # noqa: E402


@dataclass
class Args:
    env_ids: list[str] = field(default_factory=lambda: ["CartPole-v1", "ALE/Breakout-v5"])
    """envs to measure"""
    actors: list[int] = field(default_factory=lambda: [1, 2, 4])
    """actor-process counts"""
    seconds: float = 20.0
    """run time of each script run (after its start-up)"""
    warmup: float = 5.0
    """seconds of each run excluded from its steps/s"""
    piece_seconds: float = 3.0
    """measuring time of each ceiling piece"""
    out: str = "benchmarks/results/apex_throughput.json"
    """where the JSON results go"""


def _piece(kind: str, env_id: str, seconds: float, barrier, out, rank: int) -> None:
    torch.set_num_threads(1)
    envs = make_vector_env(env_id, 1, rank, num_threads=1)
    obs, _ = envs.reset()
    model = make_q_network(envs.single_observation_space, envs.single_action_space, channels_last=False)
    x = torch.as_tensor(obs)

    def step():
        if kind == "env":
            envs.step(envs.action_space.sample())
        else:
            with torch.inference_mode():
                model(x)

    for _ in range(3):
        step()
    barrier.wait()
    n, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        step()
        n += 1
    out.put(n / elapsed)
    envs.close()


def piece(kind: str, env_id: str, actors: int, seconds: float) -> float:
    """Summed rate of `actors` processes running the piece at once."""
    ctx = multiprocessing.get_context("fork")
    barrier, out = ctx.Barrier(actors), ctx.Queue()
    procs = [ctx.Process(target=_piece, args=(kind, env_id, seconds, barrier, out, r)) for r in range(actors)]
    for p in procs:
        p.start()
    rates = [out.get(timeout=120) for _ in procs]
    for p in procs:
        p.join()
    return float(sum(rates))


def script_sps(env_id: str, actors: int, seconds: float, warmup: float) -> float:
    """Agent steps/s of apex_dqn.py's actors after the warm-up (learner held back), from its console lines."""
    buffer = 1_000_000 if env_id == "CartPole-v1" else 20_000
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as log_dir:
        cmd = [sys.executable, "apex_dqn.py", "--env-id", env_id, "--num-actors", str(actors), "--log-dir", log_dir,
               "--total-timesteps", "1000000000", "--buffer-size", str(buffer), "--learning-starts", str(buffer),
               "--eval-interval", "0", "--log-interval", "1"]  # fmt: skip
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env)
        points: list[tuple[float, int]] = []

        def read():
            for line in proc.stdout:
                if m := re.match(r"global_step=(\d+) ", line):
                    points.append((time.time(), int(m.group(1))))

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        while not points:  # start-up done when the first console line arrives
            time.sleep(0.2)
            if proc.poll() is not None:
                raise RuntimeError(f"apex_dqn.py exited with {proc.returncode}")
        t0 = points[0][0]
        time.sleep(seconds)
        proc.send_signal(signal.SIGTERM)  # like Ctrl+C, and not ignored when this runs in a background job
        proc.wait(timeout=60)
        reader.join(timeout=5)
    after = [(t, s) for t, s in points if t - t0 >= warmup]
    return (after[-1][1] - after[0][1]) / max(1e-9, after[-1][0] - after[0][0]) if len(after) >= 2 else float("nan")


def main(args: Args) -> None:
    rows = []
    for env_id in args.env_ids:
        for actors in args.actors:
            env_rate = piece("env", env_id, actors, args.piece_seconds)
            infer_rate = piece("infer", env_id, actors, args.piece_seconds)
            ceiling = 1.0 / (1.0 / env_rate + 1.0 / infer_rate)
            sps = script_sps(env_id, actors, args.seconds, args.warmup)
            row = dict(env_id=env_id, actors=actors, env=round(env_rate, 1), infer=round(infer_rate, 1),
                       ceiling=round(ceiling, 1), script_sps=round(sps, 1), efficiency=round(sps / ceiling, 3),
                       load_average=[round(x, 2) for x in os.getloadavg()])  # fmt: skip
            print(json.dumps(row), flush=True)
            rows.append(row)
    meta = dict(cpus=os.cpu_count(), machine=platform.machine(), python=platform.python_version(),
                torch=torch.__version__, time=time.strftime("%Y-%m-%d %H:%M:%S"), args=asdict(args),
                numpy=np.__version__)  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(dict(meta=meta, rows=rows), indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main(tyro.cli(Args))
