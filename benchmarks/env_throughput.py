"""Raw environment throughput with random actions: the ceiling every script's steps/s is compared against.

Measures, for one game:
- `common.atari.make_vector_env` (ale-py's C++ AtariVectorEnv plus our episode-statistics wrapper) over several
  `num_envs` x `num_threads`, in sync mode and in async `batch_size` mode;
- ale-py's AtariVectorEnv alone (no wrapper) at one setting, to show what the wrapper costs;
- gymnasium's AsyncVectorEnv over Python-wrapped single ALE envs, and one plain single env stepped in a loop.

Agent steps/s count one action in one env; frames/s = agent steps/s x 4 (frame skip). Writes JSON and prints a table.

    python benchmarks/env_throughput.py
    python benchmarks/env_throughput.py --env-id ALE/Pong-v5 --seconds 5 --out benchmarks/results/pong_env.json
"""

from __future__ import annotations

import itertools
import json
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import gymnasium as gym
import numpy as np
import tyro

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common.atari import ale_game, make_vector_env

FRAME_SKIP = 4


@dataclass
class Args:
    env_id: str = "ALE/Breakout-v5"
    """ALE game to step"""
    seconds: float = 3.0
    """stepping time per configuration (after a warm-up)"""
    num_envs: list[int] = field(default_factory=lambda: [1, 8, 16, 32, 64])
    """sub-environment counts of the ALE vector env"""
    num_threads: list[int] = field(default_factory=lambda: [1, 2])
    """stepping-thread counts of the ALE vector env"""
    gym_num_envs: int = 8
    """sub-environments of gymnasium's AsyncVectorEnv (one process each)"""
    out: str = "benchmarks/results/env_throughput.json"
    """where the JSON results go"""


def time_steps(step, batch: int, seconds: float) -> float:
    """Agent steps/s of `step()` (which acts in `batch` envs) over about `seconds`, after a warm-up."""
    for _ in range(20):
        step()
    n, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < seconds:
        for _ in range(10):
            step()
        n += 10
    return n * batch / elapsed


def bench_random_actions(envs, batch: int, seconds: float, async_batches: bool = False) -> float:
    """Agent steps/s of a reset vector env stepped with random actions (send/recv in ale-py's async mode)."""
    actions = itertools.cycle(np.random.default_rng(0).integers(0, envs.single_action_space.n, (64, batch)))

    def step():
        if async_batches:
            envs.send(next(actions))
            envs.recv()
        else:
            envs.step(next(actions))

    sps = time_steps(step, batch, seconds)
    envs.close()
    return sps


def bench_vector(env_id, num_envs, threads, seconds, batch_size=0):
    envs = make_vector_env(env_id, num_envs, seed=0, num_threads=threads, batch_size=batch_size)
    envs.reset()
    return bench_random_actions(envs, batch_size or num_envs, seconds, async_batches=bool(batch_size))


def bench_raw_ale(game, num_envs, threads, seconds):
    from ale_py.vector_env import AtariVectorEnv

    envs = AtariVectorEnv(game, num_envs, num_threads=threads, autoreset_mode="SameStep")
    envs.reset(seed=0)
    return bench_random_actions(envs, num_envs, seconds)


def python_wrapped_env(env_id):
    """The classic Python pipeline: gymnasium's AtariPreprocessing (84x84, needs opencv) or, without opencv,
    grayscale full frames, then a 4-frame stack."""
    try:
        env = gym.make(env_id, frameskip=1, repeat_action_probability=0.0)
        env = gym.wrappers.AtariPreprocessing(env, noop_max=30, frame_skip=FRAME_SKIP, screen_size=84)
        label = "AtariPreprocessing 84x84"
    except gym.error.DependencyNotInstalled:
        env = gym.make(env_id, frameskip=FRAME_SKIP, repeat_action_probability=0.0, obs_type="grayscale")
        label = "grayscale 210x160, no resize (opencv not installed)"
    return gym.wrappers.FrameStackObservation(env, 4), label


def bench_gym_async(env_id, num_envs, seconds):
    import ale_py

    gym.register_envs(ale_py)
    label = python_wrapped_env(env_id)[1]
    envs = gym.vector.AsyncVectorEnv(
        [lambda: python_wrapped_env(env_id)[0]] * num_envs, autoreset_mode=gym.vector.AutoresetMode.SAME_STEP
    )
    envs.reset(seed=0)
    return bench_random_actions(envs, num_envs, seconds), label


def bench_single(env_id, seconds):
    env, label = python_wrapped_env(env_id)
    env.reset(seed=0)
    rng = np.random.default_rng(0)

    def step():
        _, _, term, trunc, _ = env.step(int(rng.integers(env.action_space.n)))
        if term or trunc:
            env.reset()

    sps = time_steps(step, 1, seconds)
    env.close()
    return sps, label


def main(args: Args) -> list[dict]:
    game = ale_game(args.env_id)
    if game is None:
        print(f"error: --env-id must be an ALE id, got {args.env_id!r}", file=sys.stderr)
        raise SystemExit(2)
    rows = []

    def record(name, num_envs, threads, batch, sps):
        rows.append(
            dict(
                env=name,
                num_envs=num_envs,
                num_threads=threads,
                batch=batch,
                agent_steps_per_s=round(sps, 1),
                frames_per_s=round(sps * FRAME_SKIP, 1),
            )
        )
        r = rows[-1]
        print(
            f"{name:<58} {num_envs:>5} {threads!s:>7} {batch:>5} {r['agent_steps_per_s']:>12,.0f} "
            f"{r['frames_per_s']:>12,.0f}",
            flush=True,
        )

    print(f"{args.env_id}, {args.seconds:.0f} s per row, {os.cpu_count()} CPUs")
    print(f"{'env':<58} {'envs':>5} {'threads':>7} {'batch':>5} {'steps/s':>12} {'frames/s':>12}")
    for n in args.num_envs:
        for t in args.num_threads:
            if t <= n:
                record(
                    "make_vector_env (ale-py C++ vector env)", n, t, n, bench_vector(args.env_id, n, t, args.seconds)
                )
    for n in (n for n in args.num_envs if n >= 16):
        t = max(args.num_threads)
        record(
            "make_vector_env async batch_size=num_envs/2",
            n,
            t,
            n // 2,
            bench_vector(args.env_id, n, t, args.seconds, batch_size=n // 2),
        )
    n, t = 16, max(args.num_threads)
    record("ale-py AtariVectorEnv alone (no wrapper)", n, t, n, bench_raw_ale(game, n, t, args.seconds))
    sps, label = bench_gym_async(args.env_id, args.gym_num_envs, args.seconds)
    record(f"gymnasium AsyncVectorEnv, {label}", args.gym_num_envs, "procs", args.gym_num_envs, sps)
    sps, label = bench_single(args.env_id, args.seconds)
    record(f"one env, {label}", 1, "-", 1, sps)

    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = dict(
        env_id=args.env_id,
        cpus=os.cpu_count(),
        machine=platform.machine(),
        python=platform.python_version(),
        time=time.strftime("%Y-%m-%d %H:%M:%S"),
        args=asdict(args),
    )
    out.write_text(json.dumps(dict(meta=meta, rows=rows), indent=2) + "\n")
    print(f"wrote {out}")
    return rows


if __name__ == "__main__":
    main(tyro.cli(Args))
