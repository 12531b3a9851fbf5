"""Every measurement the benchmarks make, each defined once; `benchmarks/throughput.py` is the driver that uses them.

Definitions
- Steady agent steps/s (`steady_rate`): from (wall time, global step) points a run logged, in this order of sources:
  its TensorBoard `charts/SPS` events (x = global agent steps), a CSV log with a time and a step column (TorchBeast's
  `logs.csv`), or its console lines `global_step=N ...` timed on arrival. The points logged in the first `warmup`
  share of the logged wall span are dropped (start-up, the first updates); the rate is (last step - step at the first
  kept point) / (their wall-time difference). At least 3 points are needed.
- Ceiling (`ceiling`), CONVENTIONS.md: 1 / (1/env + 1/infer + 1/train) from three pieces measured with the script's
  env count, network, batch sizes and threads (`Pieces`): `env` = agent steps/s of the vector env alone with random
  actions, `infer` = observations/s of the acting forward pass and action choice alone, `train` = agent steps/s of the
  learner's update alone (its forward/backward passes, epochs and minibatches, optimizer step; a log-sum-exp plus
  squared-value loss stands in for the script's, whose terms cost well under 1% of a CNN's passes). Pieces that run in
  several processes at once in the script (A3C workers, GALA learners, actors) run that way here, rates summed. A
  script whose learner is held back (Ape-X, see throughput.py) has no train term.
- CPU bound (`cpu_bound`): agent steps/s <= cores / (CPU-seconds per agent step of env + infer + train). Each piece's
  CPU-seconds (process time, all its threads) are measured alone in one process with one torch and one env thread,
  the least CPU any thread count spends on the same work: more threads add OpenMP spin-waits and serial sections
  counted on every thread. Taken on a loaded machine it comes out too low (cache and core sharing inflate CPU time), so
  take the best round (`--rounds`) of an idle machine.
- Memory (`tree_pss_mib`, `pss_growth`): PSS (proportional set size: a shared page is split between the processes
  that map it, so shared rollout buffers count once) summed over the run's whole process tree from
  /proc/PID/smaps_rollup every few seconds. Growth: mean PSS over the last `window` seconds minus the mean over the
  `window` seconds after `warmup` seconds, in percent of the latter; the least-squares slope after warm-up (MiB per
  minute) beside it, since two endpoints can hide a steady creep or show noise as one. throughput.py takes the
  warm-up as the `--warmup` share of the run after its first logged point, and a tenth of the run as the window.
- Time to stop (`time_to_stop`): seconds from SIGINT or SIGTERM to the main process, or SIGKILL to one of its worker
  processes, sent once training is under way (its first console line with a step above 0), to the main process's
  exit; processes of its group still alive 1 s later are left behind.

JSON written by throughput.py (`write_json`): {"meta": {...}, "rows": [...]}, floats to 4 significant digits, a value
that could not be measured as null.
- meta: command, date (ISO 8601 with offset), cpu_model, cores (os.cpu_count), gpu (nvidia-smi's names or null),
  usable_cores (affinity), python, torch, platform, load_average_start, load_average_end (1, 5, 15 min), mode
  (table | memory | straggler | env | stop_times), args.
- rows, modes table / memory / straggler: one per configuration, external commands last:
  label, external, command (a runnable command line), env_id, num_envs (in total), workers;
  medians over rounds: sps, env, infer, train, ceiling, efficiency (sps / the same round's ceiling), pss_growth_pct,
  policy_lag_mean; maxima over rounds: pss_peak_mib, bound (with --bound); exceeds_bound (some round's sps above the
  bound: re-measure the bound on an idle machine); speedup_vs_baseline (sps / sps of the label's baseline mode, such
  as its `--sync`, when both ran with the same envs, workers and std);
  straggler mode: mean_ms, std_ms, eq7_async_sps (Eq. 7's asynchronous bound for these n, mean, std),
  runtime_vs_async (eq7_async_sps / sps), and for HTS-RL eq7_alpha, eq7_speedup (Eq. 7's predicted speedup of alpha
  over lockstep), speedup_target_5x_met, runtime_within_1.25x_async_met (Sec. 5's targets);
  rounds: one record per round: round, sps, rate_source (tensorboard | csv | console), agent_steps (last logged),
  steps_measured, seconds (launch to exit), startup_seconds (launch to the first logged point: the run's clock starts
  there), exit_code, pss_peak_mib, pss_baseline_mib, pss_end_mib, pss_growth_pct, pss_slope_mib_per_min,
  policy_lag_mean, policy_lag_max, scalars (means of the `timing/*` and `gossip/*` tags over the steady part); with
  pieces env, infer, train, ceiling, efficiency; with --bound cpu_us_per_step {env, infer, train} and bound; in
  memory mode pss_samples [[seconds since launch, MiB], ...].
- rows, env mode: env, num_envs, num_threads, batch, agent_steps_per_s, frames_per_s.
- rows, stop_times mode: one per label and kind (sigint | sigterm | killed_worker): label, script, kind, command,
  env_id, timeout (seconds before a try counts as hung), victim (the worker killed) or not_applicable (why no worker
  can be killed); tries: round, startup_seconds, seconds (null when hung or never signalled), exit_code, hung,
  workers (worker processes found), left_behind (their pids), error, last_lines; over the tries that exited: seconds,
  median, worst, exit_codes; hung and errors (counts), left_behind (processes, summed).

HTS-RL's straggler env also lives here (`Straggler-v0`, id `benchmarks.measure:Straggler-v0`), with Eq. 7.
"""

from __future__ import annotations

import collections
import contextlib
import csv
import datetime
import itertools
import json
import math
import multiprocessing
import os
import platform
import queue
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

import gymnasium as gym
import numpy as np
from gymnasium.envs.classic_control.cartpole import CartPoleEnv

ROOT = Path(__file__).resolve().parents[1]
CONSOLE_STEP = re.compile(r"\bglobal_step=(\d+)")
CSV_TIME_COLUMNS = ("_time", "wall_time", "time", "timestamp")  # TorchBeast's FileWriter writes `_time`
CSV_STEP_COLUMNS = ("global_step", "step", "agent_steps")

# ----------------------------------------------------------------------------------------------------------------
# Steady rate
# ----------------------------------------------------------------------------------------------------------------


def steady_rate(walls, steps, warmup: float = 0.25) -> tuple[float, int]:
    """(agent steps/s, agent steps counted) over the points after the first `warmup` share of the logged wall span;
    (nan, 0) with fewer than 3 points or no time between the kept ones."""
    walls, steps = np.asarray(walls, dtype=float), np.asarray(steps, dtype=float)
    if len(walls) < 3:
        return float("nan"), 0
    k = int(np.searchsorted(walls, walls[0] + warmup * (walls[-1] - walls[0])))
    k = min(k, len(walls) - 2)
    span = walls[-1] - walls[k]
    if span <= 0:
        return float("nan"), 0
    return float((steps[-1] - steps[k]) / span), int(steps[-1] - steps[k])


def tensorboard_points(log_dir: Path, tag: str = "charts/SPS") -> dict:
    """The (wall, step) points of `tag` in the run directory under `log_dir` that logged most of them (any scalar tag
    with the most events when none has `tag`), with every scalar's values; {} when there are no events."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    best: dict = {}
    for run_dir in sorted({p.parent.resolve() for p in Path(log_dir).rglob("events.out.tfevents.*")}):
        acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
        acc.Reload()
        tags = acc.Tags()["scalars"]
        if not tags:
            continue
        chosen = tag if tag in tags else max(tags, key=lambda t: len(acc.Scalars(t)))
        events = acc.Scalars(chosen)
        if len(events) > len(best.get("walls", [])):
            best = dict(
                walls=[e.wall_time for e in events],
                steps=[e.step for e in events],
                scalars={t: [(e.wall_time, e.value) for e in acc.Scalars(t)] for t in tags},
            )
    return best


def read_csv_log(path: Path) -> tuple[list[float], list[float]]:
    """(times, steps) of a CSV log with a header row: a leading `# ` is allowed (TorchBeast's `logs.csv`), and a
    `fields.csv` beside it, when present, names the columns (TorchBeast adds fields after the first row)."""
    lines = [line for line in path.read_text().splitlines() if line.strip()]
    if not lines:
        return [], []
    header = next(csv.reader([lines[0].removeprefix("# ")]))
    fields = path.with_name("fields.csv")
    if fields.exists() and fields != path and (names := list(csv.reader(fields.read_text().splitlines()))):
        header = names[-1]
    time_col = next((header.index(c) for c in CSV_TIME_COLUMNS if c in header), None)
    step_col = next((header.index(c) for c in CSV_STEP_COLUMNS if c in header), None)
    times, steps = [], []
    if time_col is None or step_col is None:
        return times, steps
    for row in csv.reader(lines[1:]):
        with contextlib.suppress(ValueError, IndexError):
            t, s = float(row[time_col]), float(row[step_col])
            times.append(t)
            steps.append(s)
    return times, steps


def csv_points(log_dir: Path) -> dict:
    """The (time, step) points of the CSV log under `log_dir` with the most rows; {} when there is none."""
    best: dict = {}
    for path in sorted({p.resolve() for p in Path(log_dir).rglob("*.csv")}):
        times, steps = read_csv_log(path)
        if len(times) > len(best.get("walls", [])):
            best = dict(walls=times, steps=steps, scalars={})
    return best


def run_rate(log_dir: Path, console: list[tuple[float, int]], warmup: float) -> dict:
    """Steady rate of a finished run from its TensorBoard events, else its CSV log, else its console lines; with the
    policy lag and the means of its `timing/*` and `gossip/*` scalars over the steady part."""
    source, points = "console", dict(walls=[t for t, _ in console], steps=[s for _, s in console], scalars={})
    for name, found in (("tensorboard", tensorboard_points(log_dir)), ("csv", csv_points(log_dir))):
        if len(found.get("walls", [])) >= 3:
            source, points = name, found
            break
    sps, counted = steady_rate(points["walls"], points["steps"], warmup)
    walls = points["walls"]
    start = walls[0] + warmup * (walls[-1] - walls[0]) if walls else 0.0
    steady = {tag: [v for w, v in values if w >= start] for tag, values in points["scalars"].items()}
    lags = steady.get("charts/policy_lag", []) + steady.get("charts/policy_lag_max", [])
    return dict(
        sps=sps,
        rate_source=source,
        agent_steps=int(points["steps"][-1]) if points["steps"] else 0,
        steps_measured=counted,
        policy_lag_mean=float(np.mean(steady["charts/policy_lag"])) if steady.get("charts/policy_lag") else None,
        policy_lag_max=float(max(lags)) if lags else None,
        scalars={tag: float(np.mean(v)) for tag, v in steady.items() if tag.startswith(("timing/", "gossip/")) and v},
    )


# ----------------------------------------------------------------------------------------------------------------
# Ceiling and CPU bound
# ----------------------------------------------------------------------------------------------------------------


def ceiling(env: float, infer: float, train: float | None = None) -> float:
    """1 / (1/env + 1/infer + 1/train) agent steps/s; `train=None`: a script whose learner does not pace its actors."""
    return 1.0 / (1.0 / env + 1.0 / infer + (1.0 / train if train else 0.0))


def cpu_bound(cores: int, cpu_seconds_per_step: dict[str, float]) -> float:
    """Agent steps/s no run can exceed if each agent step needs these CPU-seconds and `cores` cores are all it has."""
    return cores / sum(cpu_seconds_per_step.values())


@dataclass(frozen=True)
class Pieces:
    """What one script does per agent step, in its own shapes (built by its adapter in throughput.py)."""

    env_id: str
    num_envs: int  # envs of one env-stepping process or thread
    actor_batch: int  # observations per acting forward pass
    protocol: str = "deepmind"
    network: str = "auto"
    model: Literal["actor_critic", "q", "ddpg"] = "actor_critic"
    env_threads: int = 1
    env_copies: int = 1  # env-stepping processes or threads running at once in the script
    infer_threads: int = 1
    infer_copies: int = 1
    learner_obs: int = 0  # observations of one update's forward/backward passes per epoch (0: no train piece)
    samples: int = 1  # agent steps one update consumes
    epochs: int = 1
    minibatches: int = 1
    extra_forward_obs: int = 0  # observations forwarded without gradient once per update (value or bootstrap pass)
    optimizer: Literal["adam", "rmsprop"] = "rmsprop"
    train_threads: int = 1
    train_copies: int = 1  # learners updating at once

    def single(self) -> Pieces:
        """The same work in one process with one torch and one env thread (the CPU bound's measurement)."""
        return replace(self, env_threads=1, env_copies=1, infer_threads=1, infer_copies=1, train_threads=1,
                       train_copies=1)  # fmt: skip

    def kinds(self) -> tuple[str, ...]:
        """The pieces measured: env, infer, and train unless there is no train piece (`learner_obs` 0)."""
        return ("env", "infer", "train") if self.learner_obs else ("env", "infer")


def timed(fn, items_per_call: int, seconds: float) -> tuple[float, float]:
    """(items per wall second, CPU-seconds of this process per item) of `fn` over about `seconds`, after 3 calls."""
    for _ in range(3):
        fn()
    n, t0, c0 = 0, time.perf_counter(), time.process_time()
    while (elapsed := time.perf_counter() - t0) < seconds:
        fn()
        n += 1
    return n * items_per_call / elapsed, (time.process_time() - c0) / (n * items_per_call)


def random_obs(space: gym.Space, n: int, rng: np.random.Generator):
    import torch

    if space.dtype == np.uint8:
        return torch.from_numpy(rng.integers(0, 256, (n, *space.shape), dtype=np.uint8))
    return torch.from_numpy(np.stack([space.sample() for _ in range(n)]).astype(np.float32))


def piece_fn(kind: str, p: Pieces, rng: np.random.Generator):
    """(fn, items per call, close) for one piece: `env` steps the vector env, `infer` acts on a batch, `train`
    updates."""
    import torch

    from common.atari import make_vector_env
    from common.models import make_ddpg_model, make_model, make_q_network

    n, threads = (p.num_envs, p.env_threads) if kind == "env" else (1, 1)
    envs = make_vector_env(p.env_id, n, 0, protocol=p.protocol, num_threads=threads)
    envs.reset(seed=0)
    obs_space, act_space = envs.single_observation_space, envs.single_action_space
    if kind == "env":
        actions = itertools.cycle([envs.action_space.sample() for _ in range(64)])
        return (lambda: envs.step(next(actions))), p.num_envs, envs.close
    envs.close()
    if p.model == "q":
        model = make_q_network(obs_space, act_space, p.network)
    elif p.model == "ddpg":
        model = make_ddpg_model(obs_space, act_space)
    else:
        model = make_model(obs_space, act_space, p.network)
    if kind == "infer":
        x = random_obs(obs_space, p.actor_batch, rng)

        def infer():
            with torch.inference_mode():
                out = model(x)
                if p.model == "actor_critic":
                    torch.multinomial(torch.softmax(out[0], -1), 1)
                elif p.model == "q":
                    out.argmax(-1)

        return infer, p.actor_batch, lambda: None
    mb = max(1, p.learner_obs // p.minibatches)
    x = random_obs(obs_space, mb * p.minibatches, rng).reshape(p.minibatches, mb, *obs_space.shape)
    extra = random_obs(obs_space, p.extra_forward_obs, rng) if p.extra_forward_obs else None
    if p.optimizer == "adam":
        optimizer = torch.optim.Adam(model.parameters(), lr=2.5e-4, eps=1e-5)
    else:
        optimizer = torch.optim.RMSprop(model.parameters(), lr=7e-4, alpha=0.99, eps=0.01)

    def train():
        if extra is not None:
            with torch.no_grad():
                for chunk in extra.split(mb):
                    model(chunk)
        for _ in range(p.epochs):
            for j in range(p.minibatches):
                logits, values = model(x[j])
                optimizer.zero_grad(set_to_none=True)
                (logits.logsumexp(-1).mean() + values.square().mean()).backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
                optimizer.step()

    return train, p.samples, lambda: None


def _timed_piece(kind: str, p: Pieces, threads: int, seconds: float, rank: int = 0, barrier=None, out=None):
    """Build one copy of a piece at `threads` torch threads and time it (after `barrier`, into `out`, when given)."""
    import torch

    sys.path.insert(0, str(ROOT))
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    fn, items, close = piece_fn(kind, p, np.random.default_rng(rank))
    try:
        fn()
        if barrier is not None:
            barrier.wait()
        result = timed(fn, items, seconds)
    finally:
        close()
        torch.set_num_threads(before)
    return out.put(result) if out is not None else result


def run_piece(kind: str, p: Pieces, seconds: float) -> tuple[float, float]:
    """(summed items/s, mean CPU-seconds per item) of `kind` run in its copies at once: one copy in this process,
    several each in its own process."""
    copies, threads = {"env": (p.env_copies, 1), "infer": (p.infer_copies, p.infer_threads),
                       "train": (p.train_copies, p.train_threads)}[kind]  # fmt: skip
    if copies == 1:
        return _timed_piece(kind, p, threads, seconds)
    # forked from a server that has imported torch but run nothing: no OpenMP pool inherited, no import per copy
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "measure"])
    barrier, out = ctx.Barrier(copies), ctx.Queue()
    procs = [ctx.Process(target=_timed_piece, args=(kind, p, threads, seconds, r, barrier, out), daemon=True)
             for r in range(copies)]  # fmt: skip
    for proc in procs:
        proc.start()
    results = []
    try:
        while len(results) < copies:
            with contextlib.suppress(queue.Empty):
                results.append(out.get(timeout=1.0))
                continue
            if any(proc.exitcode not in (None, 0) for proc in procs):
                raise RuntimeError(f"the {kind} piece failed in a child process (exit codes "
                                   f"{[proc.exitcode for proc in procs]}); its traceback is above")  # fmt: skip
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
    return float(sum(r for r, _ in results)), float(np.mean([c for _, c in results]))


def measure_pieces(p: Pieces, seconds: float) -> dict:
    """The ceiling's pieces and the ceiling, as the script runs them."""
    rates = {kind: run_piece(kind, p, seconds)[0] for kind in p.kinds()}
    return dict(**rates, ceiling=ceiling(rates["env"], rates["infer"], rates.get("train")))


def measure_bound(p: Pieces, seconds: float, cores: int) -> dict:
    """CPU-seconds per agent step of each piece alone at one thread, and the CPU bound they give."""
    cpu = {kind: run_piece(kind, p.single(), seconds)[1] for kind in p.kinds()}
    return dict(cpu_us_per_step={k: 1e6 * v for k, v in cpu.items()}, bound=cpu_bound(cores, cpu))


# ----------------------------------------------------------------------------------------------------------------
# Memory
# ----------------------------------------------------------------------------------------------------------------


def process_tree(pid: int) -> list[int]:
    """`pid` and all its descendants, from the parent ids in /proc/*/stat."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                children.setdefault(int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]), []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        out.append(todo.pop())
        todo.extend(children.get(out[-1], []))
    return out


def pss_kib(smaps_rollup: str) -> int:
    """The `Pss:` line of a /proc/PID/smaps_rollup text, in KiB (0 when absent)."""
    match = re.search(r"^Pss:\s+(\d+) kB", smaps_rollup, re.M)
    return int(match.group(1)) if match else 0


def tree_pss_mib(pid: int) -> float:
    """PSS of `pid` and its descendants in MiB (processes that are gone count 0)."""
    total = 0
    for p in process_tree(pid):
        with contextlib.suppress(OSError):
            total += pss_kib(Path(f"/proc/{p}/smaps_rollup").read_text())
    return total / 1024


def pss_growth(times, pss, warmup: float, window: float) -> dict:
    """Baseline (mean over [warmup, warmup + window)), end (mean over the last `window` seconds), peak, growth in %
    of the baseline and least-squares slope after warm-up in MiB/min, of PSS samples (seconds, MiB)."""
    t, m = np.asarray(times, dtype=float), np.asarray(pss, dtype=float)
    if len(t) == 0:
        return dict(pss_peak_mib=None, pss_baseline_mib=None, pss_end_mib=None, pss_growth_pct=None,
                    pss_slope_mib_per_min=None)  # fmt: skip
    start = (t >= warmup) & (t < warmup + window)
    if not start.any():  # a run shorter than its warm-up: its last sample is all there is
        start = t >= t[-1]
    end = t >= t[-1] - window
    after = t >= warmup
    base = float(m[start].mean())
    slope = float(np.polyfit(t[after] / 60.0, m[after], 1)[0]) if after.sum() >= 3 else None
    return dict(pss_peak_mib=float(m.max()), pss_baseline_mib=base, pss_end_mib=float(m[end].mean()),
                pss_growth_pct=100.0 * (float(m[end].mean()) - base) / base if base else None,
                pss_slope_mib_per_min=slope)  # fmt: skip


# ----------------------------------------------------------------------------------------------------------------
# Running a command
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class Run:
    exit_code: int | None
    seconds: float  # from its start to its end
    started: float | None = None  # seconds from its start to its first logged point (None: it logged none)
    console: list[tuple[float, int]] = field(default_factory=list)  # (arrival time, global step) of console lines
    pss: list[tuple[float, float]] = field(default_factory=list)  # (seconds since start, MiB)
    tail: list[str] = field(default_factory=list)  # the last lines of its output


def logged_any(log_dir: Path, console: list) -> bool:
    """Whether a run has logged its first point yet (a scalar, a CSV row or a console line with a step)."""
    return bool(console or tensorboard_points(log_dir) or csv_points(log_dir))


def run_command(
    cmd: list[str],
    seconds: float,
    *,
    cwd: Path,
    log_dir: Path,
    env: dict | None = None,
    interval: float = 2.0,
    whole_group: bool = False,
    startup: float = 300.0,
    grace: float = 60.0,
):
    """Run `cmd` until `seconds` after its first logged point under `log_dir` (start-up is not counted; at most
    `startup` s without one), sampling its process tree's PSS every `interval` s and timing its console lines, then
    stop it as Ctrl+C would: SIGINT to the process (`whole_group`: to its process group, for a user's command that
    may be a shell). After `grace` s it gets SIGKILL; what it leaves behind in its group too."""
    proc = subprocess.Popen(
        cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # not ignored, as in a background job
    )  # fmt: skip
    run, tail = Run(exit_code=None, seconds=0.0), collections.deque(maxlen=20)

    def read() -> None:
        for line in proc.stdout:
            tail.append(line.rstrip())
            if match := CONSOLE_STEP.search(line):
                run.console.append((time.time(), int(match.group(1))))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    t0 = time.time()
    while proc.poll() is None and (elapsed := time.time() - t0) < (
        startup if run.started is None else run.started + seconds
    ):
        run.pss.append((elapsed, tree_pss_mib(proc.pid)))
        if run.started is None and logged_any(log_dir, run.console):
            run.started = elapsed
        time.sleep(interval if run.started is None else min(interval, max(0.0, run.started + seconds - elapsed)))
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGINT) if whole_group else proc.send_signal(signal.SIGINT)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=grace)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # no orphans: workers the run left behind, or the run itself
    proc.wait()
    reader.join(timeout=10)
    run.exit_code, run.seconds, run.tail = proc.returncode, time.time() - t0, list(tail)
    return run


# ----------------------------------------------------------------------------------------------------------------
# Time to stop
# ----------------------------------------------------------------------------------------------------------------

StopKind = Literal["sigint", "sigterm", "killed_worker"]


def _stat(pid_dir: Path) -> list[str]:
    """The fields of /proc/PID/stat after the command name: state, ppid, pgrp, ..., starttime at index 19."""
    return (pid_dir / "stat").read_text().rsplit(")", 1)[1].split()


def workers_of(pid: int, script: str) -> list[int]:
    """The live children of `pid` whose command line names `script` (forked workers carry their parent's command line;
    multiprocessing's resource tracker and compile workers do not), in start order."""
    found = []
    for d in Path("/proc").iterdir():
        with contextlib.suppress(OSError, IndexError, ValueError):
            if d.name.isdigit() and int((fields := _stat(d))[1]) == pid and fields[0] != "Z":
                if script in (d / "cmdline").read_bytes().decode(errors="replace"):
                    found.append((int(fields[19]), int(d.name)))
    return [p for _, p in sorted(found)]


def group_alive(pgid: int) -> list[int]:
    """The processes of process group `pgid` that are alive (zombies count as gone)."""
    found = []
    for d in Path("/proc").iterdir():
        with contextlib.suppress(OSError, IndexError, ValueError):
            if d.name.isdigit() and int((fields := _stat(d))[2]) == pgid and fields[0] != "Z":
                found.append(int(d.name))
    return found


def time_to_stop(cmd: list[str], kind: StopKind, *, cwd: Path, script: str, victim: int | None = None,
                 startup: float = 300.0, timeout: float = 60.0) -> dict:  # fmt: skip
    """Start `cmd` in a process group of its own, wait until training is under way (its first console line
    `global_step=N ...` with N > 0), then stop it by `kind`: SIGINT or SIGTERM to its main process, or SIGKILL to its
    worker `victim` (an index into `workers_of(pid, script)`). Returns the seconds from the signal to its exit (None
    when it had not exited `timeout` s later: `hung`, it is then killed), its exit code, the processes of its group
    still alive 1 s after its exit (then killed with the group) and its last 3 output lines; `error` when it never got
    under way or had no such worker."""
    proc = subprocess.Popen(
        cmd, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # not ignored, as in a background job
    )  # fmt: skip
    under_way, tail = threading.Event(), collections.deque(maxlen=20)

    def read() -> None:
        for line in proc.stdout:
            tail.append(line.rstrip())
            if (match := CONSOLE_STEP.match(line)) and int(match.group(1)) > 0:
                under_way.set()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    t0 = time.monotonic()
    while not under_way.wait(0.1) and proc.poll() is None and time.monotonic() - t0 < startup:
        pass
    out = dict(startup_seconds=time.monotonic() - t0, seconds=None, exit_code=None, hung=False, workers=None,
               left_behind=[], error=None)  # fmt: skip
    target, signum = proc.pid, {"sigint": signal.SIGINT, "sigterm": signal.SIGTERM}.get(kind, signal.SIGKILL)
    if under_way.is_set() and kind == "killed_worker":
        workers = workers_of(proc.pid, script)
        out["workers"] = len(workers)
        if victim is None or not -len(workers) <= victim < len(workers):
            out["error"] = f"no worker {victim} among the {len(workers)} worker processes"
        else:
            target = workers[victim]
    if not under_way.is_set():
        out["error"] = f"not under way after {out['startup_seconds']:.0f} s (exit code {proc.poll()})"
    if out["error"] is None:
        os.kill(target, signum)
        sent = time.monotonic()
        try:
            proc.wait(timeout=timeout)
            out["seconds"], out["exit_code"] = time.monotonic() - sent, proc.returncode
        except subprocess.TimeoutExpired:
            out["hung"] = True
        deadline = time.monotonic() + 1.0
        while (left := group_alive(proc.pid)) and time.monotonic() < deadline:
            time.sleep(0.1)
        out["left_behind"] = left
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)  # the safety net: nothing outlives a try
    proc.wait()
    reader.join(timeout=10)
    out["last_lines"] = [line for line in tail if line.strip()][-3:]
    return out


# ----------------------------------------------------------------------------------------------------------------
# JSON with the machine's metadata
# ----------------------------------------------------------------------------------------------------------------


def cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def gpu_model() -> str | None:
    """The GPUs nvidia-smi lists (asked in a child process, so the driver never initialises CUDA), else None."""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30, check=True).stdout  # fmt: skip
        return ", ".join(line.strip() for line in out.splitlines() if line.strip()) or None
    return None


def machine_meta() -> dict:
    import torch

    return dict(
        command=shlex.join(["python", *sys.argv]),
        date=datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        cpu_model=cpu_model(),
        cores=os.cpu_count(),
        gpu=gpu_model(),
        usable_cores=len(os.sched_getaffinity(0)),
        python=platform.python_version(),
        torch=torch.__version__,
        platform=platform.platform(),
        load_average_start=[round(x, 2) for x in os.getloadavg()],
    )


def rounded(obj, digits: int = 4):
    """Floats to `digits` significant digits, non-finite ones to None, numpy scalars to Python's, through dicts and
    lists."""
    if isinstance(obj, np.generic):
        obj = obj.item()
    if isinstance(obj, float):
        return float(f"{obj:.{digits}g}") if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: rounded(v, digits) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return [rounded(v, digits) for v in obj]
    return obj


def write_json(path: str | Path, meta: dict, rows: list[dict]) -> None:
    """{"meta": meta + load_average_end, "rows": rows}, rounded, written atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = {**meta, "load_average_end": [round(x, 2) for x in os.getloadavg()]}
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(rounded(dict(meta=meta, rows=rows)), indent=1) + "\n")
    os.replace(tmp, path)


# ----------------------------------------------------------------------------------------------------------------
# HTS-RL's straggler env and Eq. 7
# ----------------------------------------------------------------------------------------------------------------


class StragglerEnv(CartPoleEnv):
    """CartPole whose every step takes a Gamma(mean, std)-distributed wall-clock time (sleep, no CPU use).

    HTS-RL's Claim 1 (Eq. 7) and Fig. 4 are about envs whose step time varies: a synchronous A2C waits for the
    slowest env at every step, HTS-RL only every alpha steps. std 0 is a constant step time; std = mean the
    exponential step times of the paper's simulation. Scripts build envs by id alone, so the step time comes from
    STRAGGLER_MEAN_MS / STRAGGLER_STD_MS (read when the env is made; workers inherit them) or keyword arguments:

        STRAGGLER_MEAN_MS=5 STRAGGLER_STD_MS=5 python hts_a2c.py --env-id benchmarks.measure:Straggler-v0
    """

    def __init__(self, mean_ms: float | None = None, std_ms: float | None = None, render_mode: str | None = None):
        super().__init__(render_mode=render_mode)
        self.mean_s = float(os.environ.get("STRAGGLER_MEAN_MS", 2.0) if mean_ms is None else mean_ms) / 1000
        self.std_s = float(os.environ.get("STRAGGLER_STD_MS", 2.0) if std_ms is None else std_ms) / 1000
        if self.mean_s < 0 or self.std_s < 0:
            raise ValueError(f"step time mean and std must be >= 0 ms, got {self.mean_s * 1e3}, {self.std_s * 1e3}")
        self._timing_rng = np.random.default_rng()  # step times are timing only: they never touch the trajectory

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        if seed is not None:
            self._timing_rng = np.random.default_rng(seed + 1_000_003)
        return super().reset(seed=seed, options=options)

    def step_time(self) -> float:
        """One draw of the step time in seconds: Gamma with shape (mean/std)^2 and scale std^2/mean."""
        if self.std_s == 0 or self.mean_s == 0:
            return self.mean_s
        return float(self._timing_rng.gamma((self.mean_s / self.std_s) ** 2, self.std_s**2 / self.mean_s))

    def step(self, action):
        time.sleep(self.step_time())
        return super().step(action)


if "Straggler-v0" not in gym.registry:
    gym.register("Straggler-v0", entry_point=StragglerEnv, max_episode_steps=500)


def eq7_time(n: int, K: float, alpha: float, mean_s: float, std_s: float, c: float = 0.0) -> float:
    """HTS-RL Eq. 7: expected time for n envs to collect K states, synchronizing every alpha steps. Step times are
    Gamma of shape k = (mean/std)^2 and rate beta = k/mean, so alpha steps sum to Gamma(alpha k, beta) (the paper's
    exponential case is k = 1); c is the actors' compute per step. nan where the approximation (derived for shape >= 1)
    does not hold."""
    if std_s == 0:
        return K / n * mean_s + K * c / n
    from scipy.stats import gamma as gamma_dist

    k = (mean_s / std_s) ** 2
    if alpha * k < 1:
        return float("nan")
    beta = k / mean_s
    f_inv = gamma_dist.ppf(1.0 - 1.0 / n, alpha * k, scale=1.0 / beta)
    expected_max = np.euler_gamma / beta * (1 + (alpha * k - 1) / (beta * f_inv)) + f_inv
    return K / (n * alpha) * expected_max + K * c / n
