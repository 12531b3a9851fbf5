"""Learning benchmark: run every script on a suite with several seeds, then plot and tabulate the results.

Suites
- `cartpole`: CartPole-v1 for every script and mode. The bar: mean episodic return >= 475 over the last 20 episodes
  within the step budget stated per entry below (budgets are equal where the algorithms allow).
- `pendulum`: Pendulum-v1 for the continuous-control script (Ape-X DDPG); the bar: mean greedy return >= -200.
- `atari-smoke`: Pong (deepmind protocol) for the PPO/A2C-family and IMPALA scripts, a few million frames on a CPU
  machine: the curve must rise clearly from -21.
- `pong-gate`: the Pong gate, a last-20-games mean of +18 within 5M agent steps (20M frames), each script at its
  atari-smoke settings (a run may be stopped at its first crossing).
- `a3c-eps`: the RMSprop eps sweep behind A3C's default eps (hogwild 1, 2, 4 workers, the gradient server).
- `atari-paper`: the seeds' papers' Atari settings (GALA's six games, HTS-RL's Atari table, Cleanba's 200M-frame
  protocol) as commands for a GPU machine, read from `benchmarks/atari_paper.json` with the papers' numbers beside
  them. Printed by default (`--run` runs them).

Each run is `python SCRIPT --env-id ENV --seed S --total-timesteps N --exp-name LABEL --log-dir OUT ARGS`, so its
TensorBoard directory is `OUT/{env}__{label}__{seed}__{time}`; `OUT/logs/` holds the console output, and
`OUT/manifest.json` every command with its exit status and wall time. Runs go `--jobs` at a time (the scripts are
themselves multi-process, so on a 2-core machine one job at a time gives the honest wall-clock curve). At the end
`benchmarks/plot.py` draws the curves and prints the table. The atari-smoke runs write a checkpoint every 10 minutes
(and on a stop), so a long CPU run can be taken in pieces: `--resume` continues each from its newest checkpoint, and
plot.py leaves the time between the pieces out of the wall-clock axis.

Examples:
  python benchmarks/learn.py --suite cartpole --seeds 1 2 3 --out runs/learn/cartpole
  python benchmarks/learn.py --suite cartpole --only hts_a2c cleanba_ppo --seeds 1      # a subset
  python benchmarks/learn.py --suite atari-smoke --seeds 1 --out runs/learn/pong
  python benchmarks/learn.py --suite atari-smoke --seeds 1 --out runs/learn/pong --resume  # continue it later
  python benchmarks/learn.py --suite atari-paper                                      # print the GPU commands
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass
class Entry:
    label: str  # becomes --exp-name: one colour per label in the plots
    script: str
    env_id: str
    total_timesteps: int  # agent steps (frames / 4 on Atari)
    args: list[str] = field(default_factory=list)
    tag: str = "charts/episodic_return"  # the return the bar is checked on
    note: str = ""


# CartPole: one budget for every script (500k agent steps, as CleanRL). Hyperparameters are the scripts' defaults
# except the Atari-specific ones, replaced by the classic-control values CleanRL and OpenAI baselines use: PPO clip
# 0.2, 4-8 envs, and RMSprop eps 1e-5 for A3C (GALA's default; A3C's 1e-3 is its hogwild Pong setting). One torch
# thread: for an MLP, intra-op threads only add OpenMP hand-offs (and stall badly on an oversubscribed machine).
# Mode variants (all-reduce, gradient server) come last in each seed's round.
CARTPOLE_STEPS = 500_000
A3C_CARTPOLE_EPS = ["--rmsprop-eps", "1e-5"]
# Ape-X DQN (apex_dqn.py): priority eps 1e-3, which reaches the bar in more seeds than the default 1e-6 (README,
# Results). Both the CartPole and the Pendulum (apex_ddpg.py) settings anneal the importance-sampling exponent to 1
# (Schaul et al.), as they were measured; Ape-X's fixed 0.4 is the scripts' default.
APEX_CARTPOLE = ["--num-actors", "4", "--buffer-size", "100000", "--learning-starts", "1000", "--batch-size", "64",
                 "--optimizer", "adam", "--learning-rate", "1e-3", "--target-network-frequency", "250",
                 "--actor-update-interval", "50", "--replay-ratio", "32", "--eval-interval", "5000",
                 "--priority-eps", "1e-3", "--anneal-beta"]  # fmt: skip
# impala_monobeast.py takes one RMSprop step per learner batch; cleanba_ppo_impala.py takes 4 minibatch steps per 8 x 20
# rollout (2 envs x 20 steps = 40 samples each). Both sum the loss over the samples (TorchBeast, Cleanba), so batches
# of 2 unrolls of 20 at Cleanba's lr, RMSprop eps 0.01 and clip 40 (MonoBeast's eps and clip too) take the same updates
# as the cleanba_impala entry. The network gets TorchBeast's inputs (the script's default).
IMPALA_CARTPOLE = ["--num-actors", "4", "--unroll-length", "20", "--batch-size", "2", "--learning-rate", "6e-4",
                   "--ent-coef", "0.01"]  # fmt: skip


def cartpole(label: str, script: str, args: list[str], **kw) -> Entry:
    return Entry(label, script, "CartPole-v1", CARTPOLE_STEPS, args, **kw)


CARTPOLE = [
    cartpole("cleanba_ppo", "cleanba_ppo_impala.py",
             ["--num-envs", "4", "--num-actor-threads", "1", "--clip-coef", "0.2", "--torch-threads", "1"]),
    # Cleanba's IMPALA settings as they are (lr 6e-4, RMSprop eps 0.01, clip 40): its loss is summed over each
    # minibatch of 2 envs x 20 steps, so eps stays small beside the gradients without the classic-control eps.
    cartpole("cleanba_impala", "cleanba_ppo_impala.py",
             ["--algo", "impala", "--num-envs", "8", "--num-actor-threads", "1", "--torch-threads", "1"]),
    cartpole("hts_a2c", "hts_a2c.py", ["--num-envs", "8", "--num-executors", "8", "--num-actors", "2"]),
    cartpole("hts_ppo", "hts_ppo.py",
             ["--num-envs", "4", "--num-executors", "4", "--num-actors", "2", "--clip-coef", "0.2"]),
    cartpole("impala_batched", "impala_monobeast.py", IMPALA_CARTPOLE,
             note="cleanba_impala's updates: minibatches of 2 x 20, summed loss, eps 0.01, clip 40"),
    cartpole("gala_gossip", "gala_a2c.py", ["--num-learners", "2", "--num-envs", "8"]),
    cartpole("a3c_hogwild", "a3c_large_batch.py",
             ["--num-workers", "2", "--num-envs-per-worker", "8", *A3C_CARTPOLE_EPS]),
    # Ape-X's exploring actors (eps up to 0.4) never score 500: its bar is checked on the greedy evaluator's returns.
    # Off-policy with replay: 100k steps (the learner replays each transition about 32 times, `--replay-ratio 32`).
    Entry("apex_dqn", "apex_dqn.py", "CartPole-v1", 100_000, APEX_CARTPOLE, tag="eval/episodic_return",
          note="greedy evaluation every 5k agent steps"),
    # mode variants
    cartpole("gala_allreduce", "gala_a2c.py", ["--num-learners", "2", "--num-envs", "8", "--mode", "allreduce"]),
    cartpole("a3c_server", "a3c_large_batch.py",
             ["--num-workers", "2", "--num-envs-per-worker", "8", "--update", "server", *A3C_CARTPOLE_EPS]),
]  # fmt: skip

# Pong, deepmind protocol: the PPO/A2C family at its Atari defaults (Nature CNN), budgeted at 10M frames and meant to
# be cut by `--time-limit` (2M frames showed no rise for any of them). GALA and A3C run at their default RMSprop eps,
# 1e-5 and 1e-3, not Table 2's 0.01 (their `--rmsprop-eps` help and Results' Differences from the papers say whose).
# HTS-PPO takes CleanRL ppo_atari's (and the Cleanba entry's) 8 envs x 128 steps: twice the updates per sample of its
# 16-env default, whose H100 run was still at -19.2 after 1.08M agent steps. And 2 learner threads: the default rule
# (cores left by 4 executors and 4 actors, at least 1) leaves one thread for a learner-bound run; 2 ran 199 steps/s
# against 134 (Pong, this 2-core machine, 75-second runs).
PONG_STEPS = 2_500_000
DEEPMIND = ["--atari-protocol", "deepmind", "--checkpoint-interval", "600"]  # resumable: `learn.py ... --resume`
# cleanba_ppo_impala.py at CleanRL ppo_atari's size (Nature CNN, 8 envs in one actor thread), not Cleanba's 2 x 64
# envs and IMPALA ResNet, which a 2-core machine steps too slowly to see learning
CLEANRL_SIZED = ["--network", "nature", "--num-envs", "8", "--num-actor-threads", "1"]


def pong(label: str, script: str, args: list[str]) -> Entry:
    return Entry(label, script, "ALE/Pong-v5", PONG_STEPS, args)


ATARI_SMOKE = [
    pong("a3c_hogwild", "a3c_large_batch.py", [*DEEPMIND, "--num-workers", "2"]),
    # the H100 runs pinned --torch-threads 1 (5 jobs side by side; manifest)
    pong("cleanba_ppo", "cleanba_ppo_impala.py", [*DEEPMIND, *CLEANRL_SIZED]),
    pong("hts_a2c", "hts_a2c.py", DEEPMIND),
    pong("gala_gossip", "gala_a2c.py", [*DEEPMIND, "--num-learners", "2"]),
    # why 8 envs and 2 threads: above PONG_STEPS; the paper's Eq. 6 update (hts_ppo_released: the script's default)
    pong("hts_ppo", "hts_ppo.py", [*DEEPMIND, "--num-envs", "8", "--torch-threads", "2", "--delayed-update", "eq6"]),
    # IMPALA at its references' updates: Cleanba's (20 steps, 4 minibatches, ResNet; 8 envs in one thread, not 2 x 64)
    # and TorchBeast's (4 actors, unroll 80, batch 8, AtariNet inputs).
    pong(
        "cleanba_impala",
        "cleanba_ppo_impala.py",
        [*DEEPMIND, "--algo", "impala", "--num-envs", "8", "--num-actor-threads", "1"],
    ),
    pong("impala_batched", "impala_monobeast.py", DEEPMIND),
]

# IMPALA on Pong within a 2-core CPU budget: the reference settings above take too few updates per sample to leave
# the floor in the ~1M agent steps an hour or two buys here (MonoBeast's batch of 8 x 80 takes one RMSprop step per
# 640 samples). Both scripts take Cleanba's updates instead (minibatches of 2 unrolls x 20 steps, lr 6e-4, entropy
# 0.01, summed loss, RMSprop eps 0.01, clip 40), as their CartPole entries do, and the Nature CNN.
PONG_CPU_IMPALA = [
    pong("cleanba_impala_nature", "cleanba_ppo_impala.py", [*DEEPMIND, "--algo", "impala", *CLEANRL_SIZED]),
    pong("impala_batched_small", "impala_monobeast.py", [*DEEPMIND, *IMPALA_CARTPOLE]),
]

# The Pong gate (every seed system: a last-20-games mean of +18 within 5M agent steps, 20M frames): each script at its
# atari-smoke settings with the budget doubled, so a learning-rate schedule, where a script has one, anneals over the
# gate's budget. A run may be stopped at its first crossing of +18.
GATE_STEPS = 5_000_000
# IMPALA (MonoBeast, batched inference) at Cleanba IMPALA's updates (the pong-cpu-impala suite's settings, +1.7 at 2.5M
# agent steps where its learning rate had annealed to 0 over that budget; TorchBeast's own settings stayed at -20.4).
# Cleanba IMPALA at CleanRL's size with the Nature CNN (cleanba_impala_nature, -3.6 at 2.5M on older code): Cleanba's
# own IMPALA ResNet and 2 x 64 envs step too slowly on 2 cores to learn within the budget.
# A3C hogwild (a3c_hogwild) at the atari-smoke entry's 2 workers of 16 envs (one per core) and the script's RMSprop eps
# 1e-3 (-6.0 at 2.5M agent steps, still climbing); its learning rate is constant (the script's default), so no schedule
# to fit. a3c_hogwild_eps1e-5 is the same at GALA's released code's eps 1e-5, which the a3c-eps suite had found safe at
# 2 workers (+7.5 at 2.5M): its seed-1 gate run kept the value loss at the constant-value level, the policy uniform,
# to 2.06M agent steps (RESULTS, the A3C eps study), and was stopped there.
# Ape-X DQN (apex_dqn.py) on a 2-core CPU, where the learner, not the actors, sets the pace (about 1 ms of one core
# per sampled transition for the Nature dueling network), so the learner is rate-limited. RLlib's tuned Ape-X Pong
# example (rllib/tuned_examples/dqn/pong-apex.yaml: about +19 within 3M agent steps on 4 GPUs) trains batches of 64
# with Adam, syncs its target network every 20,000 agent steps and samples 16 transitions per agent step
# (training_intensity). The gate takes its batch of 64 and its target period (1,250 updates of 64 at the ratio
# below), a quarter of its ratio (--replay-ratio 4: 20M sampled transitions over the 5M budget, about 6 hours of one
# core) and, for the fewer updates, the lr of CleanRL's dqn_atari.py and RL Zoo's DQN on Atari, 1e-4 (RLlib: 5e-5).
# 4 actors of 4 envs spread Ape-X's epsilons (0.4 to 0.4^8) over four ladders instead of two. The rest is the
# script's (Ape-X's): learning starts at 50k transitions, n-step 3, alpha 0.6, beta 0.4, clip 40, and the raw-frame
# replay of 100k transitions (Ape-X: 2M compressed). The learner takes 2 torch threads: the rate-limited actors leave
# it most of both cores (24k agent steps, learning from 4k, 4 runs alternated: 76 and 79 s against 92 and 93 s at the
# script's 1). The gate is read on the evaluator's games: the exploring actors (epsilon up to 0.4) play worse than
# the policy they learn.
APEX_PONG = [*DEEPMIND, "--num-actors", "4", "--num-envs-per-actor", "4", "--batch-size", "64", "--optimizer", "adam",
             "--learning-rate", "1e-4", "--target-network-frequency", "1250", "--replay-ratio", "4",
             "--torch-threads", "2", "--eval-interval", "50000", "--eval-interval-episodes", "5"]  # fmt: skip
GATED = {"gala_gossip", "impala_batched_small", "cleanba_impala_nature", "a3c_hogwild"}
PONG_GATE = [Entry(e.label, e.script, e.env_id, GATE_STEPS, e.args) for e in ATARI_SMOKE + PONG_CPU_IMPALA
             if e.label in GATED] + [
    Entry("a3c_hogwild_eps1e-5", "a3c_large_batch.py", "ALE/Pong-v5", GATE_STEPS,
          [*DEEPMIND, "--num-workers", "2", "--rmsprop-eps", "1e-5"]),
    Entry("apex_dqn", "apex_dqn.py", "ALE/Pong-v5", GATE_STEPS, APEX_PONG, tag="eval/episodic_return",
          note="the evaluator's games (epsilon 0.001), 5 every 50k agent steps"),
]  # fmt: skip

# Pong on a GPU machine (16 cores, `benchmarks/gpu_pong.sh`): PPO at the 32 envs of the GPU throughput table, whose
# ~7,000 agent steps/s reach the 2.5M-step budget inside one device call. Besides the envs it keeps the cleanba_ppo
# entry's settings, so a rollout holds 4x the samples (32 x 128) for the same 4 epochs x 4 minibatches.
PONG_GPU = [
    pong(
        "cleanba_ppo_32envs",
        "cleanba_ppo_impala.py",
        [*DEEPMIND, "--network", "nature", "--num-envs", "32", "--num-actor-threads", "1"],
    )
]

# The A2C side of the A2C reference (RESULTS, Pong beside the references): plain synchronous A2C (hts_a2c.py --sync) at
# Stable-Baselines3 A2C's settings as RL Zoo runs it on Atari. hts_a2c.py's defaults already are 16 envs x 5 steps, lr
# 7e-4 constant, RMSprop alpha 0.99 eps 1e-5, entropy 0.01, gradient clip 0.5; SB3's value loss is vf_coef 0.25 times
# the mean squared error, ours vf_coef times the same mean, so --vf-coef 0.25. Where they cannot match: SB3's
# RMSpropTFLike puts eps inside the square root and starts its average at 1 (torch's RMSprop here: outside, at 0).
PONG_A2C_REFERENCE = [pong("hts_a2c_sync_sb3", "hts_a2c.py", [*DEEPMIND, "--sync", "--vf-coef", "0.25"])]

# HTS-PPO's one-step-delayed gradient (Eq. 6) against none: the atari-smoke entry `hts_ppo` with `--sync`, synchronous
# PPO on the same processes (policy lag 0, the executors wait for each update). The pair shows what the delay costs
# per frame at CleanRL ppo_atari's settings (RESULTS, Pong beside the references).
PONG_PPO_SYNC = [pong("hts_ppo_sync", "hts_ppo.py", [*DEEPMIND, "--num-envs", "8", "--torch-threads", "2", "--sync"])]
# ... and HTS-RL's released update (`--delayed-update released`, the script's default: the current parameters trained
# on the lagged data, the ratio clipped against the policy that acted; IouJenLiu/HTS-RL learner.py, algo/ppo_aug.py)
# at the same settings (why it is the default: RESULTS, Differences from the papers).
PONG_PPO_RELEASED = [
    pong("hts_ppo_released", "hts_ppo.py",
         [*DEEPMIND, "--num-envs", "8", "--torch-threads", "2", "--delayed-update", "released"])
]  # fmt: skip

# The A3C eps diagnosis on Pong (README, Results): hogwild at 1, 2 and 4 workers and the gradient server, RMSprop
# eps 1e-5 against 1e-4 and 1e-3, CPU workers; a few hundred thousand steps show whether the value loss falls from
# its constant-value level (about 0.065) or stays there. Each run's checkpoint holds its final model.
A3C_DIAG = ["--atari-protocol", "deepmind", "--no-cuda", "--checkpoint-interval", "100000"]
A3C_LAYOUTS = {
    "1x16": ["--num-workers", "1"],
    "2x16": ["--num-workers", "2"],
    "server_2x16": ["--num-workers", "2", "--update", "server"],
    "4x8": ["--num-workers", "4", "--num-envs-per-worker", "8"],
}
A3C_EPS_SWEEP = [
    pong(f"a3c_{layout}_eps{eps}", "a3c_large_batch.py", [*A3C_DIAG, *A3C_LAYOUTS[layout], "--rmsprop-eps", eps])
    for layout, eps in [("1x16", "1e-5"), ("2x16", "1e-5"), ("server_2x16", "1e-5"), ("4x8", "1e-5"), ("4x8", "1e-4"),
                        ("4x8", "1e-3"), ("2x16", "1e-3")]
]  # fmt: skip

# Pendulum-v1 (continuous actions): Ape-X DDPG, greedy evaluation; the bar is a mean return of -200.
APEX_PENDULUM = ["--num-actors", "2", "--buffer-size", "40000", "--learning-starts", "2000", "--batch-size", "128",
                 "--critic-learning-rate", "1e-3", "--actor-learning-rate", "1e-3", "--actor-update-interval", "50",
                 "--replay-ratio", "64", "--eval-interval", "4000", "--n-step", "3", "--anneal-beta"]  # fmt: skip
PENDULUM = [Entry("apex_ddpg", "apex_ddpg.py", "Pendulum-v1", 40_000, APEX_PENDULUM, tag="eval/episodic_return")]


def atari_paper() -> list[Entry]:
    data = json.loads((ROOT / "benchmarks" / "atari_paper.json").read_text())
    entries = []
    for g in data["games"]:
        st = data["settings"][g["label"]]
        score = "no per-game number" if g["paper_score"] is None else f"{g['paper_score']}"
        if g.get("paper_score_error") is not None:
            score += f" +- {g['paper_score_error']}"
        note = f"{st['paper']}: {score} ({st['paper_score_note']})"
        for key, value in st.items():  # `paper_<flag>`: the paper's value where the flag departs from it
            flag = "--" + key.removeprefix("paper_").replace("_", "-")
            if key.startswith("paper_") and flag in st["args"]:
                ours = st["args"][st["args"].index(flag) + 1]
                note += f"; {flag} {ours}, not the paper's {value} (why: {key.removeprefix('paper_')}_note in the json)"
        entries.append(Entry(g["label"], st["script"], g["game"], st["frames"] // 4, st["args"], note=note))
    return entries


# Every suite once: (what lists its runs, the return whose crossing its table times; None: no bar).
SUITES = {
    "cartpole": (lambda: CARTPOLE, 475.0),
    "pendulum": (lambda: PENDULUM, -200.0),
    "atari-smoke": (lambda: ATARI_SMOKE, None),
    "pong-cpu-impala": (lambda: PONG_CPU_IMPALA, None),
    "pong-gpu": (lambda: PONG_GPU, None),
    "pong-a2c-reference": (lambda: PONG_A2C_REFERENCE, None),
    "pong-ppo-sync": (lambda: PONG_PPO_SYNC, None),
    "pong-ppo-released": (lambda: PONG_PPO_RELEASED, None),
    "pong-gate": (lambda: PONG_GATE, 18.0),
    "a3c-eps": (lambda: A3C_EPS_SWEEP, None),
    "atari-paper": (atari_paper, None),
}


def suite(name: str) -> list[Entry]:
    return SUITES[name][0]()


def latest_checkpoint(e: Entry, seed: int, out: Path) -> Path | None:
    """The newest `checkpoint.pt` of an earlier run of (entry, seed) under `out`: what `--resume` continues."""
    pattern = f"{glob.escape(e.env_id.replace('/', '_'))}__{glob.escape(e.label)}__{seed}__*/checkpoint.pt"
    found = sorted(out.glob(pattern), key=lambda p: p.stat().st_mtime)
    return found[-1] if found else None


def command(e: Entry, seed: int, out: Path, resume: Path | None = None) -> list[str]:
    return [sys.executable, e.script, "--env-id", e.env_id, "--seed", str(seed), "--total-timesteps",
            str(e.total_timesteps), "--exp-name", e.label, "--log-dir", str(out), *e.args,
            *(["--resume", str(resume)] if resume else [])]  # fmt: skip


def run_all(
    jobs: list[tuple[Entry, int]],
    out: Path,
    parallel: int,
    done: list[dict],
    time_limit: float | None = None,
    resume: bool = False,
) -> None:
    """Run (entry, seed) pairs `parallel` at a time, appending a record to `done` as each ends. Ctrl+C / SIGTERM
    interrupt the running ones (each script then shuts down cleanly and flushes TensorBoard) and stop the queue.
    A run still going after `time_limit` seconds gets SIGINT: it stops as after Ctrl+C (exit 130) and counts as done,
    its curve cut at the wall-clock budget. With `resume`, a pair whose earlier run left a checkpoint continues it
    (same run directory and step count; its console log is appended to)."""
    (out / "logs").mkdir(parents=True, exist_ok=True)
    pending, running, stopped = list(jobs), [], set()  # stopped: pids that the time limit sent SIGINT
    try:
        while pending or running:
            while pending and len(running) < parallel:
                e, seed = pending.pop(0)
                checkpoint = latest_checkpoint(e, seed, out) if resume else None
                cmd = command(e, seed, out, checkpoint)
                log = out / "logs" / f"{e.env_id.replace('/', '-')}__{e.label}__{seed}.log"
                print(f"[learn] start {e.label} seed {seed}: {' '.join(cmd[1:])}", flush=True)
                with log.open("a" if checkpoint else "w") as stdout:  # the child keeps its own descriptor
                    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=stdout, stderr=subprocess.STDOUT)
                running.append((proc, e, seed, cmd, log, time.time()))
            time.sleep(1.0)
            for proc, *_, t0 in running:
                if time_limit and time.time() - t0 > time_limit and proc.pid not in stopped:
                    proc.send_signal(signal.SIGINT)
                    stopped.add(proc.pid)
            for item in [r for r in running if r[0].poll() is not None]:
                running.remove(item)
                done.append(rec := run_record(item, stopped))
                print(f"[learn] done  {rec['label']} seed {rec['seed']}: exit {rec['returncode']} in "
                      f"{rec['wall_seconds']} s")  # fmt: skip
    except KeyboardInterrupt:  # a piece of a long run ends here: its record goes in the manifest too (exit 130)
        print("[learn] interrupted: stopping the running scripts", flush=True)
        for proc, *_ in running:
            proc.send_signal(signal.SIGINT)
        for item in running:
            item[0].wait(timeout=30)
            done.append(run_record(item, stopped))
        raise


def run_record(item: tuple, stopped: set[int]) -> dict:
    """The manifest's record of an ended run: `item` is run_all's (process, entry, seed, command, log, start time)."""
    proc, e, seed, cmd, log, t0 = item
    return dict(label=e.label, seed=seed, env_id=e.env_id, command=cmd[1:], log=str(log), returncode=proc.returncode,
                wall_seconds=round(time.time() - t0, 1), stopped_at_time_limit=proc.pid in stopped)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--suite", choices=sorted(SUITES), default="cartpole")
    p.add_argument("--only", nargs="*", default=None, help="labels to run (default: the whole suite)")
    p.add_argument("--games", nargs="*", default=None, help="env ids to keep, e.g. ALE/Pong-v5 (default: all)")
    p.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3])
    p.add_argument("--out", default=None, help="run directory root (default runs/learn/<suite>)")
    p.add_argument("--jobs", type=int, default=max(1, (os.cpu_count() or 2) // 2), help="runs at the same time")
    p.add_argument("--steps-scale", type=float, default=1.0, help="multiply every budget (quick checks)")
    p.add_argument("--time-limit", type=float, default=None, help="stop each run (SIGINT) after this many seconds")
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue each run from the newest checkpoint.pt of an earlier run of it under --out (runs made with "
        "--checkpoint-interval, as the atari-smoke suite's); a run without one starts afresh",
    )
    p.add_argument("--dry-run", action="store_true", help="print the commands and stop")
    p.add_argument("--run", action="store_true", help="atari-paper: run the commands instead of printing them")
    a = p.parse_args(argv)

    entries = suite(a.suite)
    labels = {e.label for e in entries}
    if a.only is not None:
        if unknown := sorted(set(a.only) - labels):
            print(f"error: unknown label(s) {unknown}; the suite has {sorted(labels)}", file=sys.stderr)
            return 2
        entries = [e for e in entries if e.label in a.only]
    if a.games is not None:
        entries = [e for e in entries if e.env_id in a.games]
    if a.steps_scale != 1.0:
        for e in entries:
            e.total_timesteps = max(1, int(e.total_timesteps * a.steps_scale))
    out = Path(a.out or f"runs/learn/{a.suite}")
    jobs = [(e, s) for s in a.seeds for e in entries]  # seed-major: a cut-short run still covers every label
    if a.dry_run or (a.suite == "atari-paper" and not a.run):
        for e, s in jobs:
            cmd = command(e, s, out, latest_checkpoint(e, s, out) if a.resume else None)
            print(" ".join(["python", *cmd[1:]]) + (f"    # {e.note}" if e.note else ""))
        return 0
    out = out.resolve()  # the scripts run from the repository root

    # SIGTERM (and SIGINT, which a shell ignores in background jobs) stop the queue like Ctrl+C does
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    t0, records = time.time(), []
    try:
        run_all(jobs, out, a.jobs, records, a.time_limit, a.resume)
    except KeyboardInterrupt:
        return 130
    finally:  # the finished runs are recorded even when the queue is interrupted (interrupted ones: exit 130)
        manifest = out / "manifest.json"
        old = json.loads(manifest.read_text())["runs"] if manifest.exists() else []
        info = dict(suite=a.suite, machine=f"{os.cpu_count()} CPU cores", wall_seconds=round(time.time() - t0, 1))
        manifest.write_text(json.dumps(dict(info, runs=old + records), indent=1))
    # a run cut by --time-limit exits 130 like any interrupted run: that is its normal end
    cut = [r for r in records if r["stopped_at_time_limit"] and r["returncode"] == 130]
    failed = [r for r in records if r["returncode"] != 0 and r not in cut]
    for r in failed:
        print(f"[learn] FAILED {r['label']} seed {r['seed']} (exit {r['returncode']}), see {r['log']}")

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import plot

    plot_args = [str(out), "--out", str(out / "learning")]
    threshold = SUITES[a.suite][1]
    if threshold is not None:
        plot_args += ["--threshold", str(threshold)]
    for e in entries:
        if e.tag != "charts/episodic_return":
            plot_args += ["--tag-for", f"{e.label}={e.tag}"]
    plot.main(plot_args)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
