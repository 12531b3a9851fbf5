"""a3c_large_batch.py throughput, policy lag and memory against this machine's ceiling (CONVENTIONS.md).

For every (workers, envs per worker) configuration it measures, in the same benchmark run:
- the ceiling pieces, each run in `workers` processes at once (1 torch thread, 1 env thread each, as the script's
  workers run) and summed over them: `env` = agent steps/s of the vector env alone (random actions), `infer` =
  samples/s of the batched forward pass alone ([envs] observations), `train` = samples/s of the worker's update alone
  (forward + backward over the (N + 1) x envs observations, clip, RMSprop apply; N x envs samples per update);
  ceiling = 1 / (1/env + 1/infer + 1/train);
- the script itself in each `--update` mode for `--seconds`, stopped with SIGINT: agent steps/s after a warm-up
  (from its console lines), policy lag (mean and max of `charts/policy_lag` in TensorBoard), peak PSS of all its
  processes, and PSS growth from the end of the warm-up to the end of the run.

A shared VM's speed drifts from one minute to the next by as much as the effect measured (on the 2-core development
VM the env piece alone moved 36% between rounds, `benchmarks/results/a3c_throughput_rounds.json`). So pieces and runs
alternate for `--rounds` rounds, each run's efficiency is taken against the ceiling measured just before it, and the
table gives the median over rounds (the JSON keeps every round).

    python benchmarks/a3c_throughput.py                        # Breakout, 2 and 4 workers, 1 and 16 envs, both modes
    python benchmarks/a3c_throughput.py --workers 2 --envs 16 --updates hogwild --seconds 600 --rounds 1   # memory
"""

from __future__ import annotations

import contextlib
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
from a3c_large_batch import SharedRMSprop, a2c_loss, n_step_returns  # noqa: E402
from common.atari import make_vector_env  # noqa: E402
from common.models import make_model  # noqa: E402


@dataclass
class Args:
    env_id: str = "ALE/Breakout-v5"
    """game to train on"""
    workers: list[int] = field(default_factory=lambda: [2, 4])
    """worker-process counts"""
    envs: list[int] = field(default_factory=lambda: [16, 1])
    """envs per worker (16: large-batch A3C; 1: original A3C)"""
    updates: list[str] = field(default_factory=lambda: ["hogwild", "server"])
    """update modes"""
    seconds: float = 30.0
    """run time of each script run (after its start-up)"""
    warmup: float = 8.0
    """seconds of each run excluded from its steps/s and taken as the memory baseline"""
    piece_seconds: float = 3.0
    """measuring time of each ceiling piece"""
    num_steps: int = 5
    """horizon N (GALA Table 2)"""
    rounds: int = 3
    """pieces-then-runs rounds per configuration (the table reports medians)"""
    out: str = "benchmarks/results/a3c_throughput.json"
    """where the JSON results go"""


# ------------------------------------------------------------------ ceiling pieces


def _timed(fn, per_call: int, seconds: float) -> float:
    for _ in range(3):
        fn()
    n, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        fn()
        n += 1
    return n * per_call / elapsed


def _piece(kind: str, env_id: str, num_envs: int, T: int, seconds: float, barrier, out, rank: int) -> None:
    torch.set_num_threads(1)
    envs = make_vector_env(env_id, num_envs, seed=rank, num_threads=1)
    model = make_model(envs.single_observation_space, envs.single_action_space)
    obs, _ = envs.reset()
    rng = np.random.default_rng(rank)
    if kind == "env":
        actions = rng.integers(0, envs.single_action_space.n, (64, num_envs))
        i = [0]

        def fn():
            i[0] += 1
            envs.step(actions[i[0] % 64])

        per_call = num_envs
    elif kind == "infer":
        x = torch.from_numpy(obs)

        def fn():
            with torch.inference_mode():
                model(x)

        per_call = num_envs
    else:
        x = torch.from_numpy(np.repeat(obs[None], T + 1, axis=0).reshape(-1, *obs.shape[1:]))
        actions = torch.from_numpy(rng.integers(0, envs.single_action_space.n, T * num_envs))
        rewards, dones = torch.zeros(T, num_envs), torch.zeros(T, num_envs)
        params = list(model.parameters())
        optimizer = SharedRMSprop([p.detach().clone() for p in params])

        def fn():
            logits, values = model(x)
            values = values.reshape(T + 1, num_envs)
            returns = n_step_returns(rewards, dones, values[T].detach(), 0.99)
            loss = a2c_loss(logits[: T * num_envs], values[:T].reshape(-1), actions, returns.reshape(-1), 0.01, 0.5)
            model.zero_grad()
            loss["total_loss"].backward()
            torch.nn.utils.clip_grad_norm_(params, 0.5)
            optimizer.step([p.grad for p in params], 7e-4)

        per_call = T * num_envs
    barrier.wait()
    out.put(_timed(fn, per_call, seconds))
    envs.close()


def ceiling_pieces(env_id: str, workers: int, num_envs: int, T: int, seconds: float) -> dict:
    """Each piece in `workers` processes at once, rates summed: what the machine gives `workers` such workers."""
    ctx = multiprocessing.get_context("fork")
    result = {}
    for kind in ("env", "infer", "train"):
        barrier, out = ctx.Barrier(workers), ctx.Queue()
        procs = [
            ctx.Process(target=_piece, args=(kind, env_id, num_envs, T, seconds, barrier, out, r))
            for r in range(workers)
        ]
        for p in procs:
            p.start()
        rates = [out.get(timeout=300) for _ in procs]
        for p in procs:
            p.join()
        result[kind] = round(sum(rates), 1)
    result["ceiling"] = round(1.0 / sum(1.0 / result[k] for k in ("env", "infer", "train")), 1)
    return result


# ------------------------------------------------------------------ the script


def pss_kb(pid: int) -> int:
    """Proportional set size (shared pages split between the processes that map them), so process sums are fair."""
    try:
        text = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return 0
    match = re.search(r"^Pss:\s+(\d+) kB", text, re.M)
    return int(match.group(1)) if match else 0


def tree(pid: int) -> list[int]:
    pids = [pid]
    try:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except FileNotFoundError:
        return pids
    for c in children:
        pids += tree(int(c))
    return pids


def run_script(args: Args, update: str, workers: int, num_envs: int, log_dir: str) -> dict:
    cmd = [
        sys.executable, "a3c_large_batch.py", "--env-id", args.env_id, "--update", update, "--num-workers",
        str(workers), "--num-envs-per-worker", str(num_envs), "--num-steps", str(args.num_steps),
        "--total-timesteps", "1000000000", "--log-interval", "1", "--log-dir", log_dir,
    ]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    points, memory = [], []  # (time, global step) from the console lines, (time, PSS kB)

    def read_steps():
        with contextlib.suppress(ValueError):  # `communicate` below closes stdout under this thread at the end
            for line in proc.stdout:
                if m := re.match(r"global_step=(\d+) ", line):
                    points.append((time.time(), int(m.group(1))))

    threading.Thread(target=read_steps, daemon=True).start()
    start = time.time()
    while proc.poll() is None:
        first_update = next(
            (t for t, step in points if step > 0), None
        )  # until `warmup + seconds` after the first update (or 2 minutes without one)
        if time.time() - (first_update or start) >= (args.warmup + args.seconds if first_update else 120):
            break
        time.sleep(0.5)
        memory.append((time.time(), sum(pss_kb(p) for p in tree(proc.pid))))
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    if first_update is None:
        raise RuntimeError(f"no training step within the run:\n{err}")
    t0 = first_update + args.warmup
    measured = [(t, s) for t, s in points if t >= t0]
    sps = (measured[-1][1] - measured[0][1]) / (measured[-1][0] - measured[0][0])
    base = [kb for t, kb in memory if t0 - 1 <= t <= t0 + 1] or [memory[0][1]]
    end = [kb for t, kb in memory[-4:]]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    (run_dir,) = list(Path(log_dir).iterdir())
    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    acc.Reload()
    lags = [e.value for e in acc.Scalars("charts/policy_lag")]
    lag_max = max(e.value for e in acc.Scalars("charts/policy_lag_max"))
    timing = {  # a worker's seconds per update in each phase, over the last half of the run (past the warm-up)
        tag.split("/")[1]: round(float(np.mean([e.value for e in events[len(events) // 2 :]])), 4)
        for tag in acc.Tags()["scalars"]
        if tag.startswith("timing/") and (events := acc.Scalars(tag))
    }
    return dict(
        agent_steps_per_s=round(sps, 1),
        measured_seconds=round(measured[-1][0] - measured[0][0], 1),
        policy_lag_mean=round(float(np.mean(lags)), 2),
        policy_lag_max=int(lag_max),
        peak_pss_mb=round(max(kb for _, kb in memory) / 1024, 1),
        pss_growth_pct=round(100 * (np.mean(end) - np.mean(base)) / np.mean(base), 2),
        seconds_per_update=timing,
    )


def measure(args: Args, workers: int, num_envs: int) -> list[dict]:
    """`args.rounds` rounds of (ceiling pieces, then a run of each update mode); one row per mode, medians of rounds."""
    rounds = {update: [] for update in args.updates}
    for _ in range(args.rounds):
        pieces = ceiling_pieces(args.env_id, workers, num_envs, args.num_steps, args.piece_seconds)
        for update in args.updates:
            with tempfile.TemporaryDirectory() as log_dir:
                result = run_script(args, update, workers, num_envs, log_dir)
            result["efficiency"] = round(result["agent_steps_per_s"] / pieces["ceiling"], 3)
            rounds[update].append({**pieces, **result})
            print(json.dumps(dict(update=update, workers=workers, envs_per_worker=num_envs, **rounds[update][-1])))
    rows = []
    for update, rs in rounds.items():
        medians = ("env", "infer", "train", "ceiling", "agent_steps_per_s", "efficiency", "policy_lag_mean")
        row = dict(update=update, workers=workers, envs_per_worker=num_envs)
        row.update({k: round(float(np.median([r[k] for r in rs])), 3) for k in (*medians, "pss_growth_pct")})
        row.update(
            policy_lag_max=max(r["policy_lag_max"] for r in rs),
            peak_pss_mb=max(r["peak_pss_mb"] for r in rs),
            efficiency_per_round=[r["efficiency"] for r in rs],
            rounds=rs,
        )
        rows.append(row)
    return rows


def main(args: Args) -> None:
    rows = []
    for workers in args.workers:
        for num_envs in args.envs:
            rows += measure(args, workers, num_envs)
    meta = dict(
        cpus=os.cpu_count(),
        machine=platform.machine(),
        python=platform.python_version(),
        torch=torch.__version__,
        load_average_at_end=os.getloadavg(),
        time=time.strftime("%Y-%m-%d %H:%M:%S"),
        args=asdict(args),
    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(dict(meta=meta, rows=rows), indent=2) + "\n")
    header = (
        f"{'update':8} {'W':>2} {'envs':>4} {'env/s':>8} {'infer/s':>8} {'train/s':>8} {'ceiling':>8} "
        f"{'steps/s':>8} {'eff':>6} {'lag':>6} {'lagmax':>6} {'PSS MB':>7} {'growth%':>7}  efficiency per round"
    )
    print(header)
    for r in rows:
        print(
            f"{r['update']:8} {r['workers']:>2} {r['envs_per_worker']:>4} {r['env']:>8.0f} {r['infer']:>8.0f} "
            f"{r['train']:>8.0f} {r['ceiling']:>8.0f} {r['agent_steps_per_s']:>8.0f} {r['efficiency']:>6.2f} "
            f"{r['policy_lag_mean']:>6.2f} {r['policy_lag_max']:>6} {r['peak_pss_mb']:>7.0f} "
            f"{r['pss_growth_pct']:>7.2f}  {' '.join(f'{e:.2f}' for e in r['efficiency_per_round'])}"
        )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main(tyro.cli(Args))
