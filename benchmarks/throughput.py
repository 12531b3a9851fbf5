"""The benchmark driver: agent steps/s of every script against this machine's ceiling, memory over long runs, HTS-RL's
straggler sweep, the env alone, and any peer's command side by side, all measured the way `benchmarks/measure.py`
defines (steady rate, ceiling, CPU bound, PSS growth; the JSON it writes is documented there).

Each script has a small adapter (`ADAPTERS`): the flags that launch one of its modes with N envs in total over W
workers, and the pieces of its ceiling, read from those same flags. Every configuration runs for `--seconds` and is
stopped with SIGINT; scripts run one at a time (they measure CPU throughput: never run this beside other jobs).
`--rounds R` alternates pieces and runs (pieces A, run A, pieces B, run B, ..., then the externals; R times): a shared
VM's speed drifts from one minute to the next, so each run is taken against the ceiling measured just before it,
and the JSON keeps every round beside the medians.

Modes (one per call):
- default: every label on `--env-id` (Breakout, deepmind protocol, Nature CNN) with its ceiling and efficiency;
  `--bound` adds the CPU bound from the same pieces at one thread (any round's sps above it is flagged).
- `--memory`: long runs (600 s unless `--seconds`), no pieces; PSS samples go into the JSON.
- `--straggler`: HTS-RL's Fig. 4 (left) for any label: runs on `benchmarks.measure:Straggler-v0`, whose steps sleep
  for a Gamma time of mean `--mean-ms` and std `--stds-ms`, with Eq. 7's asynchronous bound and predicted speedup.
- `--env-table`: the vector env alone over `--num-envs` x `--env-threads`, its async batch mode, ale-py without our
  wrapper, gymnasium's AsyncVectorEnv over Python-wrapped envs (opencv) and one plain env.
- `--stop-times`: seconds from Ctrl+C (SIGINT), SIGTERM and a killed worker (SIGKILL) to each script's exit, in its
  default mode on a tiny CartPole run (Pendulum for Ape-X DDPG) with 2 workers and checkpointing on (`STOP_RUNS`),
  signalled once training is under way; `--rounds` tries of each kind, alternating between scripts and kinds. With
  `--stop-atari`, each script at its defaults on Breakout instead, where a stop may wait for an update in progress.
- `--train-pieces`: the train pieces alone, one update at a time alternating between the labels in this process
  (`--rounds` updates each): two learners' updates compared where a drift of the machine's speed hits both alike.
`--external NAME=COMMAND` runs a user's installed command (a peer such as CleanRL's ppo_atari.py or TorchBeast's
monobeast.py) in the same rounds and the same way: started in a fresh directory (`{log_dir}` in COMMAND names it),
stopped with SIGINT to its process group, its rate read from its TensorBoard events, CSV log or console lines.

    python benchmarks/throughput.py                                         # every label, Breakout, 16 envs
    python benchmarks/throughput.py --only cleanba_ppo cleanba_ppo_sync --num-envs 8 --rounds 3 --bound
    python benchmarks/throughput.py --only a3c_hogwild a3c_server --workers 2 4 --num-envs 16 1 --per-worker
    python benchmarks/throughput.py --only cleanba_ppo --num-envs 8 --rounds 4 --seconds 90 \\
        --external "cleanrl_ppo=python $HOME/cleanrl/cleanrl/ppo_atari.py --env-id BreakoutNoFrameskip-v4"
    python benchmarks/throughput.py --memory --only cleanba_ppo impala_batched gala_gossip a3c_hogwild
    python benchmarks/throughput.py --straggler --only hts_a2c hts_a2c_sync --num-envs 8
    python benchmarks/throughput.py --env-table --num-envs 1 8 16 32 64
    python benchmarks/throughput.py --stop-times --rounds 5
    python benchmarks/throughput.py --stop-times --stop-atari --stop-kinds sigint --rounds 3
    python benchmarks/throughput.py --train-pieces --only hts_ppo cleanba_ppo --num-envs 8 --rounds 20
"""

from __future__ import annotations

import itertools
import shlex
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Literal, get_args

import gymnasium as gym
import measure
import numpy as np
import tyro
from measure import Pieces

ROOT = measure.ROOT
sys.path.insert(0, str(ROOT))
from common.atari import EnvError, ale_game, make_vector_env  # noqa: E402

STRAGGLER = "benchmarks.measure:Straggler-v0"


Label = Literal["a3c_hogwild", "a3c_server", "apex_ddpg", "apex_dqn", "cleanba_impala", "cleanba_impala_sync",
                "cleanba_ppo", "cleanba_ppo_sync", "gala_allreduce", "gala_gossip", "hts_a2c", "hts_a2c_sync",
                "hts_ppo", "hts_ppo_sync", "impala_actor", "impala_batched"]  # fmt: skip


@dataclass
class Args:
    only: list[Label] = field(default_factory=list)
    """labels to run (default: every label whose script suits the env's action space)"""
    env_id: str = "ALE/Breakout-v5"
    """env of the table and memory runs (ALE ids run with the deepmind protocol and the Nature CNN)"""
    num_envs: list[int] = field(default_factory=list)
    """environments in total per run, one configuration each (default 16; straggler 8)"""
    workers: list[int] = field(default_factory=list)
    """workers per run, one configuration each: actor threads, executors and actors, actors, learners or processes"""
    per_worker: bool = False
    """--num-envs counts envs per worker, not in total"""
    seconds: float | None = None
    """wall time of a run after its first logged point (default 45; memory 600; straggler 40; env table 3 per row)"""
    warmup: float = 0.25
    """share of the logged span left out of the steady rate, and of the run before the PSS baseline"""
    rounds: int = 1
    """rounds of (pieces, run) per configuration, alternating between configurations; the table gives medians
    (--stop-times: tries of each kind)"""
    piece_seconds: float = 3.0
    """measuring time of each ceiling piece"""
    bound: bool = False
    """also measure the CPU bound (each piece alone at one thread; measure on an idle machine)"""
    memory: bool = False
    """memory mode: long runs, no pieces, PSS samples kept"""
    parallel: bool = False
    """with --memory: run the configurations of a round at the same time (their speeds then share the cores)"""
    straggler: bool = False
    """straggler mode: runs on the straggler env over --stds-ms"""
    mean_ms: float = 10.0
    """straggler mean step time (ms)"""
    stds_ms: list[float] = field(default_factory=lambda: [0.0, 10.0, 20.0, 40.0])
    """straggler step-time standard deviations (ms); std = mean: exponential step times (HTS-RL Fig. 3)"""
    env_table: bool = False
    """env mode: the vector env alone and its baselines"""
    env_threads: list[int] = field(default_factory=lambda: [1, 2])
    """stepping threads of the env table"""
    stop_times: bool = False
    """stop-times mode: seconds from SIGINT, SIGTERM and a killed worker to each script's exit (--only picks among
    the labels of the scripts' default modes)"""
    stop_atari: bool = False
    """stop-times on ALE/Breakout-v5 at each script's defaults (only the env, an endless budget and a checkpoint at the
    end are given; Ape-X DDPG on its default env), where a stop may wait for an update in progress; JSON:
    throughput_stop_times_atari.json"""
    stop_kinds: list[str] = field(default_factory=lambda: list(get_args(measure.StopKind)))
    """stop-times: the kinds of stop to try (sigint, sigterm, killed_worker)"""
    stop_timeout: float = 60.0
    """stop-times: seconds after the signal before a run counts as hung (it is then killed)"""
    train_pieces: bool = False
    """train-pieces mode: each label's train piece, one update at a time, alternating between the labels (--rounds
    updates each) at its learner's threads"""
    external: list[str] = field(default_factory=list)
    """NAME=COMMAND: a user's installed command timed in the same rounds ({log_dir}: its fresh directory and cwd)"""
    extra: list[str] = field(default_factory=list)
    """LABEL=FLAGS: more flags for one label's script (they also shape its pieces), e.g. 'cleanba_ppo=--num-steps 64'"""
    interval: float = 2.0
    """seconds between PSS samples"""
    out: str | None = None
    """where the JSON goes (default benchmarks/results/throughput_{table,memory,straggler,env,stop_times}.json)"""


# ----------------------------------------------------------------------------------------------------------------
# Adapters: how to launch each script and what its pieces are
# ----------------------------------------------------------------------------------------------------------------


def opt(flags: list[str], name: str, default, cast=int):
    """The value of the last `name` in `flags` (the one the script's parser keeps), else `default`."""
    values = [flags[i + 1] for i, f in enumerate(flags[:-1]) if f == name]
    return cast(values[-1]) if values else default


def _env(flags: list[str], env_id: str) -> dict:
    return dict(env_id=env_id, protocol=opt(flags, "--atari-protocol", "deepmind", str),
                network=opt(flags, "--network", "auto", str))  # fmt: skip


def cleanba_pieces(flags: list[str], env_id: str, cores: int) -> Pieces:
    """cleanba_ppo_impala.py: actor threads with N/A envs each, a learner thread (PPO: epochs x minibatches after a
    bootstrap pass over next_obs, the actors' stored values; IMPALA: one pass over minibatches of whole unrolls)."""
    n, a = opt(flags, "--num-envs", 128), opt(flags, "--num-actor-threads", 2)
    ppo = opt(flags, "--algo", "ppo", str) == "ppo"
    t = opt(flags, "--num-steps", 128 if ppo else 20)
    env = _env(flags, env_id)
    if env["network"] == "auto" and ale_game(env_id):
        env["network"] = "impala"  # the script's `auto` on frames: Cleanba's ResNet, for both algorithms
    sharers = a + ("--sync" not in flags)  # the script's default: a CPU learner beside the rollouts takes a share
    env_threads = opt(flags, "--env-threads", 0) or max(1, cores // sharers)
    shared = dict(num_envs=n // a, actor_batch=n // a, env_threads=env_threads,
                  env_copies=a, infer_copies=a, samples=t * n, minibatches=opt(flags, "--num-minibatches", 4),
                  train_threads=opt(flags, "--torch-threads", 0) or cores, **env)  # fmt: skip
    if ppo:
        return Pieces(**shared, learner_obs=t * n, epochs=opt(flags, "--update-epochs", 4), extra_forward_obs=n,
                      optimizer="adam")  # fmt: skip
    return Pieces(**shared, learner_obs=(t + 1) * n, optimizer="rmsprop")


def hts_pieces(flags: list[str], env_id: str, cores: int) -> Pieces:
    """hts_a2c.py / hts_ppo.py: E executors with N/E envs, A actors serving one executor's batch, the learner (A2C:
    one pass over T+1 observations per env; PPO: a value pass over T+1, then epochs x minibatches over T)."""
    ppo = flags[0] == "hts_ppo.py"
    n, e, a = opt(flags, "--num-envs", 16), opt(flags, "--num-executors", 4), opt(flags, "--num-actors", 4)
    t = opt(flags, "--sync-interval", 128 if ppo else 5)
    # the learner's threads: A2C's default leaves it the cores the workers do not take; PPO's on frames every core
    threads = opt(flags, "--torch-threads", 0) or (cores if ppo else max(1, cores - e - a))
    shared = dict(num_envs=n // e, actor_batch=n // e, env_copies=e, infer_copies=a, samples=t * n,
                  train_threads=threads, **_env(flags, env_id))  # fmt: skip
    if ppo:
        return Pieces(**shared, learner_obs=t * n, epochs=opt(flags, "--update-epochs", 4), optimizer="adam",
                      minibatches=opt(flags, "--num-minibatches", 4), extra_forward_obs=(t + 1) * n)  # fmt: skip
    return Pieces(**shared, learner_obs=(t + 1) * n, optimizer="rmsprop")


def impala_pieces(flags: list[str], env_id: str, cores: int) -> Pieces:
    """impala_monobeast.py: A actor processes with their envs; acting in one inference thread at batch A x envs on the
    main process's threads (`batched`) or in each actor at 1 thread (`actor`); the learner's V-trace update on B
    unrolls of T + 1 observations."""
    a, per = opt(flags, "--num-actors", 4), opt(flags, "--num-envs-per-actor", 1)
    t, b = opt(flags, "--unroll-length", 80), opt(flags, "--batch-size", 8)
    main_threads = opt(flags, "--torch-threads", 0) or max(1, cores - a)
    batched = opt(flags, "--inference", "batched", str) == "batched"
    return Pieces(num_envs=per, env_copies=a, actor_batch=a * per if batched else per,
                  infer_threads=main_threads if batched else 1, infer_copies=1 if batched else a,
                  learner_obs=(t + 1) * b * per, samples=t * b * per, optimizer="rmsprop", train_threads=main_threads,
                  **_env(flags, env_id))  # fmt: skip


def gala_pieces(flags: list[str], env_id: str, cores: int) -> Pieces:
    """gala_a2c.py: L learner processes, each stepping its envs, acting and updating in turn on its share of cores."""
    n, L, t = opt(flags, "--num-envs", 16), opt(flags, "--num-learners", 4), opt(flags, "--num-steps", 5)
    threads = opt(flags, "--torch-threads", 0) or max(1, cores // L)
    return Pieces(num_envs=n, actor_batch=n, env_threads=opt(flags, "--env-threads", 0) or max(1, cores // L),
                  env_copies=L, infer_threads=threads, infer_copies=L, learner_obs=(t + 1) * n, samples=t * n,
                  train_threads=threads, train_copies=L, **_env(flags, env_id))  # fmt: skip


def a3c_pieces(flags: list[str], env_id: str, cores: int) -> Pieces:
    """a3c_large_batch.py: W worker processes, each stepping its envs, acting and computing its gradient in turn."""
    w, n, t = opt(flags, "--num-workers", 4), opt(flags, "--num-envs-per-worker", 16), opt(flags, "--num-steps", 5)
    threads = opt(flags, "--torch-threads", 1)
    return Pieces(num_envs=n, actor_batch=n, env_copies=w, infer_threads=threads, infer_copies=w,
                  learner_obs=(t + 1) * n, samples=t * n, train_threads=threads, train_copies=w,
                  **_env(flags, env_id))  # fmt: skip


def apex_pieces(flags: list[str], env_id: str, cores: int) -> Pieces:
    """apex_dqn.py / apex_ddpg.py with the learner held back: A actors stepping and acting; the learner samples the
    replay at its own pace, so it has no train term."""
    a, per = opt(flags, "--num-actors", 4), opt(flags, "--num-envs-per-actor", 1)
    model = "ddpg" if flags[0] == "apex_ddpg.py" else "q"
    return Pieces(num_envs=per, env_copies=a, actor_batch=per, infer_threads=opt(flags, "--actor-torch-threads", 1),
                  infer_copies=a, model=model, **_env(flags, env_id))  # fmt: skip


@dataclass(frozen=True)
class Adapter:
    script: str
    flags: tuple[str, ...]  # {n}: envs in total, {w}: workers, {nw}: envs per worker, {replay}: Ape-X replay size
    pieces: Callable[[list[str], str, int], Pieces]
    workers: int = 1  # the default {w}
    straggler_flags: tuple[str, ...] | None = None  # on the straggler env (default: flags)
    baseline: str | None = None  # the label this mode is compared with (speedup_vs_baseline)
    eq7_alpha: bool = False  # HTS-RL: --sync-interval is Eq. 7's alpha
    continuous: bool = False  # needs a Box action space


def _mode(base: Adapter, flags: tuple[str, ...], straggler_flags: tuple[str, ...] | None = None) -> Adapter:
    """The baseline mode of a pair: `base` launched with other flags."""
    return replace(base, flags=flags, straggler_flags=straggler_flags, baseline=None, eq7_alpha=False)


CLEANBA = ("--num-envs", "{n}", "--num-actor-threads", "{w}")
HTS = ("--num-envs", "{n}", "--num-executors", "{w}", "--num-actors", "{w}")
# one executor per env (Sec. 5); a TensorBoard point per update, since an update takes alpha x mean step time
HTS_STRAGGLER = ("--num-envs", "{n}", "--num-executors", "{n}", "--num-actors", "2", "--log-frequency", "1")
IMPALA = ("--num-actors", "{w}", "--num-envs-per-actor", "{nw}", "--batch-size", "8", "--unroll-length", "80")
GALA = ("--num-learners", "{w}", "--num-envs", "{nw}")
GALA_STRAGGLER = (*GALA, "--torch-threads", "1", "--sync-interval", "20")
A3C = ("--num-workers", "{w}", "--num-envs-per-worker", "{nw}")
# Ape-X: actor-side agent steps/s with the learner held back until the replay is full (as Ape-X's actors run while
# the learner samples at its own pace); --log-interval 1: its console lines carry the rate until the learner logs
APEX = ("--num-actors", "{w}", "--num-envs-per-actor", "{nw}", "--buffer-size", "{replay}", "--learning-starts",
        "{replay}", "--eval-interval", "0", "--log-interval", "1")  # fmt: skip
_ADAPTERS = dict(
    cleanba_ppo=Adapter("cleanba_ppo_impala.py", ("--algo", "ppo", *CLEANBA), cleanba_pieces,
                        baseline="cleanba_ppo_sync"),
    cleanba_impala=Adapter("cleanba_ppo_impala.py", ("--algo", "impala", *CLEANBA), cleanba_pieces,
                           baseline="cleanba_impala_sync"),
    hts_a2c=Adapter("hts_a2c.py", HTS, hts_pieces, 4, (*HTS_STRAGGLER, "--sync-interval", "512"), "hts_a2c_sync", True),
    hts_ppo=Adapter("hts_ppo.py", HTS, hts_pieces, 4, (*HTS_STRAGGLER, "--sync-interval", "512"), "hts_ppo_sync", True),
    impala_batched=Adapter("impala_monobeast.py", ("--inference", "batched", *IMPALA), impala_pieces, 4,
                           baseline="impala_actor"),
    gala_gossip=Adapter("gala_a2c.py", ("--mode", "gossip", *GALA), gala_pieces, 2,
                        (*GALA_STRAGGLER, "--mode", "gossip"), "gala_allreduce"),
    a3c_hogwild=Adapter("a3c_large_batch.py", ("--update", "hogwild", *A3C), a3c_pieces, 2),
    apex_dqn=Adapter("apex_dqn.py", APEX, apex_pieces, 2),
    apex_ddpg=Adapter("apex_ddpg.py", APEX, apex_pieces, 2, continuous=True),
)  # fmt: skip
# the baseline modes: `--sync` (lockstep; HTS-RL's with a 64-step rollout), MonoBeast's actor-side inference, the
# all-reduce A2C, the gradient server
_ADAPTERS |= dict(
    cleanba_ppo_sync=_mode(_ADAPTERS["cleanba_ppo"], ("--algo", "ppo", *CLEANBA, "--sync")),
    cleanba_impala_sync=_mode(_ADAPTERS["cleanba_impala"], ("--algo", "impala", *CLEANBA, "--sync")),
    hts_a2c_sync=_mode(_ADAPTERS["hts_a2c"], (*HTS, "--sync"), (*HTS_STRAGGLER, "--sync", "--sync-interval", "64")),
    hts_ppo_sync=_mode(_ADAPTERS["hts_ppo"], (*HTS, "--sync"), (*HTS_STRAGGLER, "--sync", "--sync-interval", "64")),
    impala_actor=_mode(_ADAPTERS["impala_batched"], ("--inference", "actor", *IMPALA)),
    gala_allreduce=_mode(_ADAPTERS["gala_gossip"], ("--mode", "allreduce", *GALA),
                         (*GALA_STRAGGLER, "--mode", "allreduce")),
    a3c_server=_mode(_ADAPTERS["a3c_hogwild"], ("--update", "server", *A3C)),
)  # fmt: skip
ADAPTERS = dict(sorted(_ADAPTERS.items()))
assert list(ADAPTERS) == list(get_args(Label)), "Label lists every adapter"


@dataclass(frozen=True)
class StopRun:
    """--stop-times: a label's script in its default mode on a tiny budget (the flags its tests start it with), and
    the worker a try kills."""

    script: str
    flags: tuple[str, ...]
    victim: int | None  # index into its worker processes in start order (measure.workers_of); None: none to kill
    victim_name: str  # which worker that is, or why there is none


# endless budgets with a checkpoint only at the end, so that every stop includes the final checkpoint's write
ENDLESS = ("--total-timesteps", "100000000", "--checkpoint-interval", "3600")
CARTPOLE = ("--env-id", "CartPole-v1", *ENDLESS)
APEX_TINY = ("--num-actors", "2", "--learning-starts", "200", "--batch-size", "32", "--actor-batch", "20",
             "--actor-update-interval", "20", "--log-frequency", "5", "--log-interval", "0.5", "--hidden-sizes", "32",
             "32", "--eval-interval", "500", *ENDLESS)  # fmt: skip
STOP_RUNS = dict(
    a3c_hogwild=StopRun("a3c_large_batch.py", (*CARTPOLE, "--num-workers", "2", "--num-envs-per-worker", "4",
                        "--log-interval", "1", "--torch-threads", "1"), -1, "worker 1"),
    apex_ddpg=StopRun("apex_ddpg.py", ("--env-id", "Pendulum-v1", *APEX_TINY, "--critic-learning-rate", "1e-3"), 1,
                      "actor 1 (the evaluator starts last)"),
    apex_dqn=StopRun("apex_dqn.py", ("--env-id", "CartPole-v1", *APEX_TINY, "--target-network-frequency", "20",
                     "--optimizer", "adam", "--learning-rate", "1e-3"), 1, "actor 1 (the evaluator starts last)"),
    cleanba_ppo=StopRun("cleanba_ppo_impala.py", (*CARTPOLE, "--num-envs", "4", "--num-steps", "32",
                        "--num-actor-threads", "2", "--log-interval", "0", "--torch-threads", "1", "--env-threads",
                        "1"), None, "its actors are threads of the one process: there is no worker process to kill"),
    gala_gossip=StopRun("gala_a2c.py", (*CARTPOLE, "--num-learners", "2", "--num-envs", "4", "--log-interval", "1",
                        "--torch-threads", "1", "--env-threads", "1"), -1, "learner 1"),
    hts_a2c=StopRun("hts_a2c.py", (*CARTPOLE, "--num-envs", "4", "--num-executors", "2", "--num-actors", "2",
                    "--sync-interval", "8", "--log-interval", "0.2", "--torch-threads", "1"), -1,
                    "actor 1 (executors start first)"),
    hts_ppo=StopRun("hts_ppo.py", (*CARTPOLE, "--num-envs", "4", "--num-executors", "2", "--num-actors", "2",
                    "--sync-interval", "16", "--num-minibatches", "2", "--log-interval", "0.2", "--torch-threads",
                    "1"), -1, "actor 1 (executors start first)"),
    impala_batched=StopRun("impala_monobeast.py", (*CARTPOLE, "--unroll-length", "16", "--batch-size", "2",
                           "--num-actors", "2", "--log-interval", "0.1", "--torch-threads", "1"), 0, "actor 0"),
)  # fmt: skip
STOP_KINDS: tuple[measure.StopKind, ...] = get_args(measure.StopKind)
STOP_ATARI = ("--env-id", "ALE/Breakout-v5", *ENDLESS)  # --stop-atari: each script's defaults on an Atari game


def stop_runs(args: Args) -> dict[str, StopRun]:
    """The runs --stop-times starts: the tiny ones, or with --stop-atari each script at its defaults on Breakout (the
    same worker killed); Ape-X DDPG, which needs continuous actions, on its default env."""
    if not args.stop_atari:
        return STOP_RUNS
    flags = {label: ENDLESS if run.script == "apex_ddpg.py" else STOP_ATARI for label, run in STOP_RUNS.items()}
    return {label: StopRun(run.script, flags[label], run.victim, run.victim_name) for label, run in STOP_RUNS.items()}


# ----------------------------------------------------------------------------------------------------------------
# Configurations and runs
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class Config:
    label: str
    command: list[str]  # for our scripts: [script, *flags] without --log-dir; for externals: bash -c COMMAND
    env_id: str
    num_envs: int | None = None
    workers: int | None = None
    std_ms: float | None = None
    pieces: Pieces | None = None
    external: bool = False
    rounds: list[dict] = field(default_factory=list)


def our_configs(args: Args, labels: list[str], env_id: str, cores: int) -> list[Config]:
    configs = []
    stds = args.stds_ms if args.straggler else [None]
    for label, n, std in itertools.product(labels, args.num_envs, stds):
        adapter = ADAPTERS[label]
        template = adapter.straggler_flags if args.straggler and adapter.straggler_flags else adapter.flags
        uses_workers = any("{w}" in f or "{nw}" in f for f in template)
        for w in (args.workers or [adapter.workers]) if uses_workers else [None]:
            total = n * w if args.per_worker and w else n
            if "{nw}" in template and total % w:
                raise ValueError(f"{label}: --num-envs {n} does not split evenly over {w} workers")
            replay = "30000" if ale_game(env_id) else "1000000"
            flags = [f.format(n=total, w=w, nw=total // (w or 1), replay=replay) for f in template]
            flags = [adapter.script, "--env-id", env_id, "--total-timesteps", str(10**9), "--exp-name", label, *flags]
            if ale_game(env_id):
                flags += ["--atari-protocol", "deepmind"] + ([] if adapter.continuous else ["--network", "nature"])
            flags += [f for e in args.extra if e.split("=", 1)[0] == label for f in shlex.split(e.split("=", 1)[1])]
            pieces = None if args.memory or args.straggler else adapter.pieces(flags, env_id, cores)
            configs.append(Config(label, flags, env_id, total, w, std, pieces))
    return configs


def run_config(cfg: Config, args: Args, seconds: float) -> dict:
    """One run of `cfg`: steady rate, policy lag, timing means, PSS over the run."""
    with tempfile.TemporaryDirectory(prefix="throughput-") as log_dir:
        if cfg.external:
            cmd, cwd = ["bash", "-c", cfg.command[-1].replace("{log_dir}", log_dir)], Path(log_dir)
        else:
            cmd, cwd = [sys.executable, *cfg.command, "--log-dir", log_dir], ROOT
        env = {"STRAGGLER_MEAN_MS": str(args.mean_ms), "STRAGGLER_STD_MS": str(cfg.std_ms)} if args.straggler else None
        run = measure.run_command(cmd, seconds, cwd=cwd, log_dir=Path(log_dir), env=env, interval=args.interval,
                                  whole_group=cfg.external)  # fmt: skip
        record = measure.run_rate(Path(log_dir), run.console, args.warmup)
    t, pss, start = [s for s, _ in run.pss], [m for _, m in run.pss], run.started or 0.0
    record |= measure.pss_growth(t, pss, start + args.warmup * seconds, max(0.1 * seconds, 2 * args.interval))
    record |= dict(seconds=run.seconds, startup_seconds=run.started, exit_code=run.exit_code)
    if args.memory:
        record["pss_samples"] = [[round(s, 1), round(m, 1)] for s, m in run.pss]
    if not np.isfinite(record["sps"]) or run.exit_code not in (0, 130, -2):
        print(f"  {cfg.label}: exit {run.exit_code}, rate {record['sps']:.1f}; last output:\n    "
              + "\n    ".join(run.tail[-8:]), flush=True)  # fmt: skip
    return record


def measure_round(cfg: Config, args: Args, r: int, cores: int) -> None:
    """Round `r` of `cfg`: its pieces (and CPU bound) just before its run."""
    record = dict(round=r)
    if cfg.pieces is not None:
        record |= measure.measure_pieces(cfg.pieces, args.piece_seconds)
        if args.bound:
            record |= measure.measure_bound(cfg.pieces, args.piece_seconds, cores)
    record |= run_config(cfg, args, args.seconds)
    if "ceiling" in record:
        record["efficiency"] = record["sps"] / record["ceiling"]
    cfg.rounds.append(record)
    print(f"round {r} {cfg.label} ({cfg.workers or '-'} workers, {cfg.num_envs or '-'} envs"
          + (f", std {cfg.std_ms:g} ms" if cfg.std_ms is not None else "") + "): "
          + ", ".join(f"{k} {v:,.1f}" for k, v in record.items()
                      if k in ("sps", "env", "infer", "train", "ceiling", "bound", "pss_peak_mib") and v is not None),
          flush=True)  # fmt: skip


def median(values: list) -> float | None:
    values = [v for v in values if v is not None and np.isfinite(v)]
    return float(np.median(values)) if values else None


def summarise(cfg: Config, args: Args, by_key: dict) -> dict:
    """One JSON row: the configuration, medians (maxima for peaks and the bound) over rounds, comparisons."""
    rs = cfg.rounds
    command = cfg.command[-1] if cfg.external else shlex.join(["python", *cfg.command])
    row = dict(label=cfg.label, external=cfg.external, command=command, env_id=cfg.env_id,
               num_envs=cfg.num_envs, workers=cfg.workers)  # fmt: skip
    for key in ("sps", "env", "infer", "train", "ceiling", "efficiency", "pss_growth_pct", "policy_lag_mean"):
        if any(key in r for r in rs):
            row[key] = median([r.get(key) for r in rs])
    row["pss_peak_mib"] = max((r["pss_peak_mib"] for r in rs if r["pss_peak_mib"] is not None), default=None)
    if any("bound" in r for r in rs):
        row["bound"] = max(r["bound"] for r in rs)
        row["exceeds_bound"] = any((r["sps"] or 0) > row["bound"] for r in rs)
    adapter = None if cfg.external else ADAPTERS[cfg.label]
    base = by_key.get((adapter.baseline, cfg.num_envs, cfg.workers, cfg.std_ms)) if adapter else None
    if base and base.rounds and row["sps"] and (base_sps := median([r["sps"] for r in base.rounds])):
        row["speedup_vs_baseline"] = row["sps"] / base_sps
    if args.straggler:
        row |= straggler_fields(cfg, args, row)
    return row | dict(rounds=rs)


def straggler_fields(cfg: Config, args: Args, row: dict) -> dict:
    """Eq. 7 beside a straggler row: the asynchronous bound for its n envs, and for HTS-RL the predicted speedup of
    synchronizing every alpha steps over lockstep, with Sec. 5's targets."""
    n, mean_s, std_s = cfg.num_envs, args.mean_ms / 1000, cfg.std_ms / 1000
    K = median([r["steps_measured"] for r in cfg.rounds]) or float(n)
    out = dict(mean_ms=args.mean_ms, std_ms=cfg.std_ms, eq7_async_sps=K / measure.eq7_time(n, K, K / n, mean_s, std_s))
    if row["sps"]:
        out["runtime_vs_async"] = out["eq7_async_sps"] / row["sps"]
    if ADAPTERS[cfg.label].eq7_alpha:
        alpha = opt(cfg.command, "--sync-interval", 1)
        out |= dict(eq7_alpha=alpha, eq7_speedup=measure.eq7_time(n, K, 1, mean_s, std_s)
                    / measure.eq7_time(n, K, alpha, mean_s, std_s))  # fmt: skip
        if "speedup_vs_baseline" in row:
            out["speedup_target_5x_met"] = row["speedup_vs_baseline"] >= 5.0
        if "runtime_vs_async" in out:
            out["runtime_within_1.25x_async_met"] = out["runtime_vs_async"] <= 1.25
    return out


def fmt(value, spec: str = ",.0f") -> str:
    return "-" if value is None else format(value, spec)


def print_table(rows: list[dict], args: Args) -> None:
    cols = ["label", "workers", "envs"] + (["std ms"] if args.straggler else [])
    cols += ["steps/s"] + ([] if args.memory or args.straggler else ["env", "infer", "train", "ceiling", "eff."])
    cols += (["bound"] if args.bound else []) + ["vs base", "PSS peak MiB", "PSS growth", "lag"]
    cols += ["Eq. 7 async", "Eq. 7 x"] if args.straggler else []
    print("\n| " + " | ".join(cols) + " |\n|" + "---|" * len(cols))
    for r in rows:
        cells = [r["label"], fmt(r["workers"], "d"), fmt(r["num_envs"], "d")]
        cells += [fmt(r.get("std_ms"), "g")] if args.straggler else []
        cells += [fmt(r.get("sps"))]
        if not (args.memory or args.straggler):
            cells += [fmt(r.get(k)) for k in ("env", "infer", "train", "ceiling")] + [fmt(r.get("efficiency"), ".2f")]
        cells += [fmt(r.get("bound")) + (" (!)" if r.get("exceeds_bound") else "")] if args.bound else []
        cells += [fmt(r.get("speedup_vs_baseline"), ".2f"), fmt(r.get("pss_peak_mib")),
                  fmt(r.get("pss_growth_pct"), "+.2f"), fmt(r.get("policy_lag_mean"), ".2f")]  # fmt: skip
        cells += [fmt(r.get("eq7_async_sps")), fmt(r.get("eq7_speedup"), ".2f")] if args.straggler else []
        print("| " + " | ".join(cells) + " |")
    if any(r.get("exceeds_bound") for r in rows):
        print("(!) a run beat its CPU bound: the bound was measured on a loaded machine or its pieces miss what the "
              "script saves; re-measure it idle")  # fmt: skip


# ----------------------------------------------------------------------------------------------------------------
# The env table
# ----------------------------------------------------------------------------------------------------------------


def python_wrapped_env(env_id: str):
    """(env, label): the classic Python pipeline, gymnasium's AtariPreprocessing (84x84, opencv) or without opencv
    grayscale full frames, then a 4-frame stack."""
    try:
        env = gym.make(env_id, frameskip=1, repeat_action_probability=0.0)
        env = gym.wrappers.AtariPreprocessing(env, noop_max=30, frame_skip=4, screen_size=84)
        label = "AtariPreprocessing 84x84"
    except gym.error.DependencyNotInstalled:
        env = gym.make(env_id, frameskip=4, repeat_action_probability=0.0, obs_type="grayscale")
        label = "grayscale 210x160, no resize (no opencv)"
    return gym.wrappers.FrameStackObservation(env, 4), label


def env_table(args: Args) -> list[dict]:
    """Agent steps/s of the vector env alone (random actions) in its settings, and of the baselines it replaces."""

    def stepper(envs, n: int, async_batch: bool = False):
        actions = itertools.cycle(np.random.default_rng(0).integers(0, envs.single_action_space.n, (64, n)))
        if async_batch:
            return lambda: (envs.send(next(actions)), envs.recv())
        return lambda: envs.step(next(actions))

    def row(name: str, n: int, threads, batch: int, envs, fn) -> dict:
        sps = measure.timed(fn, batch, args.seconds)[0]
        envs.close()
        print(f"{name:<60} {n:>5} {threads!s:>7} {batch:>5} {sps:>12,.0f}", flush=True)
        return dict(env=name, num_envs=n, num_threads=threads, batch=batch, agent_steps_per_s=sps, frames_per_s=4 * sps)

    print(f"{'env':<60} {'envs':>5} {'threads':>7} {'batch':>5} {'steps/s':>12}")
    rows, top = [], max(args.env_threads)
    for n, t in itertools.product(args.num_envs, args.env_threads):
        if t <= n:
            envs = make_vector_env(args.env_id, n, 0, num_threads=t)
            envs.reset()
            rows.append(row("make_vector_env (ale-py C++ vector env)", n, t, n, envs, stepper(envs, n)))
    for n in (n for n in args.num_envs if n >= 16):
        envs = make_vector_env(args.env_id, n, 0, num_threads=top, batch_size=n // 2)
        envs.reset()
        rows.append(
            row("make_vector_env async, batch_size=num_envs/2", n, top, n // 2, envs, stepper(envs, n // 2, True))
        )
    from ale_py.vector_env import AtariVectorEnv

    n = max(args.num_envs)
    envs = AtariVectorEnv(ale_game(args.env_id), n, num_threads=top, autoreset_mode="SameStep")
    envs.reset(seed=0)
    rows.append(row("ale-py AtariVectorEnv alone (no wrapper)", n, top, n, envs, stepper(envs, n)))
    import ale_py

    gym.register_envs(ale_py)
    n = min(8, n)
    label = python_wrapped_env(args.env_id)[1]
    envs = gym.vector.AsyncVectorEnv([lambda: python_wrapped_env(args.env_id)[0]] * n,
                                     autoreset_mode=gym.vector.AutoresetMode.SAME_STEP)  # fmt: skip
    envs.reset(seed=0)
    rows.append(row(f"gymnasium AsyncVectorEnv, {label}", n, "procs", n, envs, stepper(envs, n)))
    env, label = python_wrapped_env(args.env_id)
    env.reset(seed=0)
    rng = np.random.default_rng(0)

    def single():
        if any(env.step(int(rng.integers(env.action_space.n)))[2:4]):
            env.reset()

    rows.append(row(f"one env, {label}", 1, "-", 1, env, single))
    return rows


# ----------------------------------------------------------------------------------------------------------------
# Time to stop
# ----------------------------------------------------------------------------------------------------------------


def stop_row(label: str, kind: measure.StopKind, args: Args) -> dict:
    """A --stop-times row before its tries: what runs, how it is stopped and, where it cannot be, why not."""
    run = stop_runs(args)[label]
    row = dict(label=label, script=run.script, kind=kind, command=shlex.join(["python", run.script, *run.flags]),
               env_id=opt(list(run.flags), "--env-id", "", str), timeout=args.stop_timeout)  # fmt: skip
    if kind == "killed_worker":
        row |= dict(victim=run.victim_name) if run.victim is not None else dict(not_applicable=run.victim_name)
    return row | dict(tries=[])


def stop_summary(row: dict) -> dict:
    """A --stop-times row with its tries summed up: the seconds of the tries that exited, their median and worst,
    the exit codes seen, the tries that hung or failed to start, and the processes left behind."""
    seconds = [t["seconds"] for t in row["tries"] if t["seconds"] is not None]
    return row | dict(seconds=seconds, median=median(seconds), worst=max(seconds, default=None),
                      exit_codes=sorted({t["exit_code"] for t in row["tries"] if t["exit_code"] is not None}),
                      hung=sum(t["hung"] for t in row["tries"]), errors=sum(bool(t["error"]) for t in row["tries"]),
                      left_behind=sum(len(t["left_behind"]) for t in row["tries"]))  # fmt: skip


def stop_times(args: Args) -> list[dict]:
    """--rounds tries of every kind of stop for each label, alternating between labels and kinds; one row each."""
    kinds = [kind for kind in STOP_KINDS if kind in args.stop_kinds]
    rows = [stop_row(label, kind, args) for label in args.only or list(STOP_RUNS) for kind in kinds]
    for r, row in itertools.product(range(1, args.rounds + 1), rows):
        if "not_applicable" in row:
            continue
        run = stop_runs(args)[row["label"]]
        with tempfile.TemporaryDirectory(prefix="stop-times-") as log_dir:
            cmd = [sys.executable, run.script, *run.flags, "--log-dir", log_dir]
            result = measure.time_to_stop(cmd, row["kind"], cwd=ROOT, script=run.script, victim=run.victim,
                                          timeout=args.stop_timeout)  # fmt: skip
        row["tries"].append(dict(round=r) | result)
        print(f"round {r} {row['label']} {row['kind']}: {fmt(result['seconds'], '.2f')} s, exit {result['exit_code']}"
              + (", hung" if result["hung"] else "") + (f", left behind {result['left_behind']}"
              if result["left_behind"] else "") + (f", {result['error']}" if result["error"] else "")
              + "; last lines: " + " / ".join(line[:100] for line in result["last_lines"]), flush=True)  # fmt: skip
    return [stop_summary(row) for row in rows]


def print_stop_table(rows: list[dict]) -> None:
    print("\n| label | kind | median s | worst s | tries | exit codes | hung | left behind |\n|" + "---|" * 8)
    for r in rows:
        print(f"| {r['label']} | {r['kind']} | {fmt(r['median'], '.2f')} | {fmt(r['worst'], '.2f')} | "
              f"{len(r['tries'])} | {r['exit_codes']} | {r['hung']} | {r['left_behind']} |"
              + (f" n/a: {r['not_applicable']}" if "not_applicable" in r else ""))  # fmt: skip


# ----------------------------------------------------------------------------------------------------------------
# main
# ----------------------------------------------------------------------------------------------------------------


def validate(args: Args) -> str | None:
    """The error line for bad flags, else None (and the defaults filled in)."""
    if sum([args.memory, args.straggler, args.env_table, args.stop_times, args.train_pieces]) > 1:
        return "--memory, --straggler, --env-table, --stop-times and --train-pieces are separate modes: pick one"
    if args.stop_times and (bad := [label for label in args.only if label not in STOP_RUNS]):
        return f"--stop-times measures each script's default mode: --only takes {sorted(STOP_RUNS)}, not {bad}"
    if args.train_pieces and args.external:
        return "--train-pieces times the scripts' own learners: no --external"
    if args.stop_times and (args.external or args.extra):
        return "--stop-times runs each script as its tests do: no --external or --extra"
    if (args.stop_atari or args.stop_kinds != list(STOP_KINDS)) and not args.stop_times:
        return "--stop-atari and --stop-kinds go with --stop-times"
    if bad := [kind for kind in args.stop_kinds if kind not in STOP_KINDS]:
        return f"--stop-kinds takes {list(STOP_KINDS)}, not {bad}"
    if args.stop_timeout <= 0:
        return f"--stop-timeout must be > 0 seconds, got {args.stop_timeout}"
    args.seconds = args.seconds or (
        3.0 if args.env_table else 600.0 if args.memory else 40.0 if args.straggler else 45.0
    )
    args.num_envs = args.num_envs or [8 if args.straggler else 16]
    if args.seconds <= 0 or args.piece_seconds <= 0 or args.interval <= 0 or args.rounds < 1:
        return "--seconds, --piece-seconds and --interval must be > 0 and --rounds >= 1"
    if not 0 <= args.warmup < 1:
        return f"--warmup is a share of the run in [0, 1), got {args.warmup}"
    if min(args.num_envs + args.workers + args.env_threads) < 1:
        return "--num-envs, --workers and --env-threads must be >= 1"
    try:
        game = ale_game(args.env_id)
    except EnvError as e:
        return f"--env-id: {e}"
    if args.env_table and game is None:
        return f"--env-table steps ALE envs: --env-id must be an ALE id, got {args.env_id!r}"
    items = [(e, "--external NAME=COMMAND") for e in args.external] + [(e, "--extra LABEL=FLAGS") for e in args.extra]
    for item, what in items:
        if "=" not in item or not item.split("=", 1)[0] or not item.split("=", 1)[1].strip():
            return f"{what} expected, got {item!r}"
    if args.parallel and not args.memory:
        return "--parallel runs share the cores, so it goes with --memory only"
    if args.external and (args.straggler or args.env_table):
        return "--external runs beside the table or --memory runs, not --straggler or --env-table"
    if bad := sorted({e.split("=", 1)[0] for e in args.extra} - set(ADAPTERS)):
        return f"--extra names unknown label(s) {bad}"
    return None


def train_pieces(configs: list[Config], rounds: int) -> list[dict]:
    """Each config's train piece built once, then one update of each in turn, `rounds` times: seconds per update and
    the median agent steps/s (its `samples` over the median seconds)."""
    import torch

    pieces = [measure.piece_fn("train", c.pieces, np.random.default_rng(0)) for c in configs]  # (fn, items, close)
    seconds, before = [[] for _ in configs], torch.get_num_threads()
    try:
        for _ in range(rounds + 1):  # the first round warms up and is left out
            for (fn, _, _), cfg, times in zip(pieces, configs, seconds, strict=True):
                torch.set_num_threads(cfg.pieces.train_threads)
                start = time.perf_counter()
                fn()
                times.append(time.perf_counter() - start)
    finally:
        for _, _, close in pieces:
            close()
        torch.set_num_threads(before)
    return [dict(label=c.label, num_envs=c.num_envs, pieces=asdict(c.pieces), seconds=times[1:],
                 train=c.pieces.samples / float(np.median(times[1:])))
            for c, times in zip(configs, seconds, strict=True)]  # fmt: skip


def continuous_env(env_id: str) -> bool:
    if env_id == STRAGGLER or ale_game(env_id):
        return False
    env = gym.make(env_id)
    env.close()
    return isinstance(env.action_space, gym.spaces.Box)


def main(args: Args) -> None:
    if error := validate(args):
        print(f"error: {error}", file=sys.stderr)
        raise SystemExit(2)
    mode = "env" if args.env_table else "memory" if args.memory else "straggler" if args.straggler else "table"
    mode = ("stop_times_atari" if args.stop_atari else "stop_times") if args.stop_times else mode
    mode = "train_pieces" if args.train_pieces else mode
    out = args.out or f"benchmarks/results/throughput_{mode}.json"
    meta = measure.machine_meta() | dict(mode=mode, args=asdict(args))
    if args.env_table:
        measure.write_json(out, meta, env_table(args))
        print(f"wrote {out}")
        return
    if args.stop_times:
        rows = stop_times(args)
        measure.write_json(out, meta, rows)
        print_stop_table(rows)
        print(f"wrote {out}")
        return
    env_id = STRAGGLER if args.straggler else args.env_id
    continuous = continuous_env(env_id)
    suits = [label for label, a in ADAPTERS.items() if a.continuous == continuous]
    labels = args.only or suits
    if bad := [label for label in labels if label not in suits]:
        print(f"error: {bad} need {'a Discrete' if continuous else 'a Box'} action space; {env_id} has the other",
              file=sys.stderr)  # fmt: skip
        raise SystemExit(2)
    cores = meta["usable_cores"]
    try:
        configs = our_configs(args, labels, env_id, meta["cores"])  # the scripts size their threads by cpu_count
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    if args.train_pieces:
        rows = train_pieces([c for c in configs if c.pieces.learner_obs], args.rounds)
        measure.write_json(out, meta, rows)
        for r in rows:
            print(f"{r['label']}: train piece {r['train']:.0f} agent steps/s (median of {len(r['seconds'])} updates)")
        print(f"wrote {out}")
        return
    configs += [
        Config(e.split("=", 1)[0], ["bash", "-c", e.split("=", 1)[1]], env_id, external=True) for e in args.external
    ]
    for r in range(1, args.rounds + 1):
        if args.parallel:  # memory only: all at once, sharing the cores
            threads = [threading.Thread(target=measure_round, args=(cfg, args, r, cores)) for cfg in configs]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
        for cfg in [] if args.parallel else configs:
            measure_round(cfg, args, r, cores)
    by_key = {(c.label, c.num_envs, c.workers, c.std_ms): c for c in configs}
    rows = [summarise(cfg, args, by_key) for cfg in configs]
    measure.write_json(out, meta, rows)
    print_table(rows, args)
    print(f"wrote {out}")


if __name__ == "__main__":
    main(tyro.cli(Args, description=__doc__))
