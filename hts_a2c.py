"""HTS-RL with A2C: High-Throughput Synchronous Deep RL (Liu, Yeh & Schwing, NeurIPS 2020), Section 4.

Who runs where (Fig. 1e, Fig. 2d): the learner (main process), E executors and A actors (processes), N envs.

  executor e (N/E envs): obs + uniforms -> state buffer (shared memory), e -> `requests` queue, waits on pipe e
  actor (whichever is free): e <- `requests`, forwards the published policy on e's obs, samples with e's uniforms
      (inverse CDF) -> action buffer + policy version, wakes pipe e
  executor e: steps its envs, (obs, action, reward, done, version) -> storage j % 2; after alpha = sync_interval
      steps CollectionDone(j) -> `results` queue, then waits for j + 1 on `commands[e]`
  learner: waits for every executor's CollectionDone(j) (batch synchronization), publishes theta_j, sends
      j + 1 (collect into storage (j + 1) % 2) and learns from storage j % 2 meanwhile.

Delayed gradient (Eq. 6): theta_{j+1} = theta_j + eta * grad J(theta_{j-1}, D^{theta_{j-1}}): RMSprop steps on a copy
of the behavior parameters theta_{j-1} that collected the data, and the displacement is added to theta_j. `--sync` is
the synchronous A2C baseline (Fig. 2a) on the same processes: executors step in lockstep (alpha = 1 in Eq. 7), the
learner updates the current parameters and the executors wait for them.
Policy lag: exactly 1 update (0 for the first after start or resume), 0 with `--sync`, measured from the policy
versions the actors stamp on every transition (`charts/policy_lag`).
Determinism: sampling randomness comes from per-env generators in the executors, and an actor forwards one executor's
observations per pass (oneDNN results depend on the batch composition): a run is bitwise reproducible for a given
seed, num_envs, num_executors, sync_interval and --sync, whatever num_actors and the OS scheduling.

    python hts_a2c.py --env-id ALE/Breakout-v5
    python hts_a2c.py --env-id CartPole-v1 --num-envs 8 --num-executors 8 --num-actors 2 --total-timesteps 200000
    python hts_a2c.py --env-id ALE/Breakout-v5 --sync  # the synchronous A2C baseline
    python hts_a2c.py --eval-only runs/<run>/model.pt --eval-episodes 10 --capture-video
"""

from __future__ import annotations

import os
import signal
import sys

if __name__ == "__main__":  # Ctrl+C while the imports below load: exit 130 at once, without a traceback (os._exit:
    # no exception, which a finalizer running at that moment would print and swallow)
    signal.signal(signal.SIGINT, lambda signum, frame: os._exit(128 + signum))
    # torch's OpenMP threads sleep while they wait for work, not spin: a learner shares the cores with actors, envs and
    # other jobs, and a spinning thread holds the core a peer needs (2-3x slower updates beside one busy core)
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import atexit
import contextlib
import copy
import ctypes
import errno
import fcntl
import functools
import hashlib
import io
import itertools
import json
import math
import multiprocessing.connection
import queue
import shlex
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, fields, replace
from multiprocessing.connection import Connection
from multiprocessing.queues import Queue, SimpleQueue
from multiprocessing.synchronize import Barrier
from pathlib import Path
from typing import Literal, NamedTuple, NoReturn

import gymnasium as gym
import numpy as np
import torch
import torch.multiprocessing as mp
import tyro
from torch import nn

from common.atari import EnvError, check_video, finished_episodes, make_env, make_vector_env
from common.models import make_model

# ---- Args ------------------------------------------------------------------------------------------------------------


@dataclass
class Args:
    exp_name: str = Path(__file__).stem
    """name of this experiment (part of the run directory)"""
    seed: int = 1
    """seed of the run: envs, per-env sampling generators, network init"""
    torch_deterministic: bool = True
    """set `torch.backends.cudnn.deterministic`"""
    cuda: bool = True
    """learn and infer on the GPU when one is present"""
    env_id: str = "ALE/Breakout-v5"
    """gymnasium env id (ALE ids go through common.atari; `module:EnvId` imports `module` first)"""
    atari_protocol: Literal["deepmind", "machado"] = "deepmind"
    """ALE preprocessing protocol"""
    network: Literal["auto", "nature", "impala", "mlp"] = "auto"
    """auto: nature for frames, mlp for vectors"""
    total_timesteps: int = 10_000_000
    """agent steps summed over all envs"""
    log_dir: str = "runs"
    """root of the run directories"""
    save_model: bool = False
    """write the final model's state_dict to {run_dir}/model.pt"""
    checkpoint_interval: float = 600.0
    """seconds between checkpoints to {run_dir}/checkpoint.pt, also written at the end and at Ctrl+C (0 = none)"""
    resume: str | None = None
    """a checkpoint.pt to continue: its parameters, optimizer, run directory and step count (envs start new episodes)"""
    eval_episodes: int = 0
    """episodes played by the final policy after training, logged as eval/episodic_return (--eval-only: 0 plays 10)"""
    eval_greedy: bool = False
    """evaluate with argmax actions; by default they are sampled, as in training (the returns HTS-RL reports)"""
    eval_only: str | None = None
    """evaluate a model.pt or checkpoint.pt of this script instead of training, with its run's env and network"""
    capture_video: bool = False
    """record the evaluation episodes to {run_dir}/videos (--eval-only: {model dir}/videos-eval-{unix time})"""
    track: bool = False
    """log the run to Weights & Biases (TensorBoard, Args, videos); needs `pip install -e ".[track]"`"""
    wandb_project_name: str = "actorlearners"
    """Weights & Biases project of --track"""
    wandb_entity: str | None = None
    """Weights & Biases entity (team or user) of --track; None: your default entity"""
    log_interval: float = 10.0
    """seconds between console lines"""
    log_frequency: int = 10
    """updates per TensorBoard point of the losses, timings, policy lag, learning rate and SPS (each point the mean
    over those updates)"""
    torch_threads: int = 0
    """torch intra-op threads of the learner (0 = the cores not taken by executors and actors, at least 1)"""

    # HTS-RL / A2C settings: Table A3 ("A2C/Ours") and Kostrikov's A2C defaults it refers to
    num_envs: int = 16
    """parallel environments (Sec. 5: 16 on one machine)"""
    num_executors: int = 4
    """executor processes, each stepping num_envs / num_executors envs as one inference batch (the paper: one env)"""
    num_actors: int = 4
    """actor processes doing inference (Table A3: 4)"""
    sync_interval: int = 5
    """alpha: steps per env between synchronizations = rollout length of one update (Table A3 unroll length: 5)"""
    sync: bool = False
    """run plain synchronous A2C instead (lockstep env steps, learn with the current parameters, policy lag 0)"""
    gamma: float = 0.99
    """discount factor (Table A3)"""
    learning_rate: float = 7e-4
    """RMSprop learning rate (Table A3)"""
    anneal_lr: bool = False
    """decay the learning rate linearly to 0 over the run"""
    rmsprop_alpha: float = 0.99
    """RMSprop smoothing constant (Kostrikov's A2C)"""
    rmsprop_eps: float = 1e-5
    """RMSprop epsilon (Table A3)"""
    vf_coef: float = 0.5
    """value loss coefficient (Table A3)"""
    ent_coef: float = 0.01
    """entropy bonus coefficient (Table A3)"""
    max_grad_norm: float = 0.5
    """gradient norm clip (Kostrikov's A2C)"""


# ---- Algorithm -------------------------------------------------------------------------------------------------------


def n_step_returns(rewards: torch.Tensor, dones: torch.Tensor, bootstrap: torch.Tensor, gamma: float) -> torch.Tensor:
    """n-step returns R_t = r_t + gamma (1 - d_t) R_{t+1}, R_T = V(s_T): each step's discounted rewards up to the end
    of the rollout plus the discounted value of the observation after it, cut at episode ends (Mnih et al. 2016,
    Algorithm S3).

    rewards, dones: [T, B], dones[t] says the episode ended with transition t (nothing is bootstrapped past it);
    bootstrap: [B], V of the observation after the last step. Returns [T, B].
    """
    returns = torch.zeros_like(rewards)
    running = bootstrap
    not_done = 1.0 - dones.to(rewards.dtype)
    for t in reversed(range(rewards.shape[0])):
        running = rewards[t] + gamma * not_done[t] * running
        returns[t] = running
    return returns


def a2c_loss(logits: torch.Tensor, values: torch.Tensor, actions: torch.Tensor, returns: torch.Tensor, vf_coef: float,
             ent_coef: float) -> dict[str, torch.Tensor]:  # fmt: skip
    """The A2C/A3C loss on a batch of M samples (Mnih et al. 2016, Algorithm S3, batched as A2C): logits [M, A],
    values/actions/returns [M] -> scalars. The policy gradient's -log pi(a|s) (R - V) with the advantage held fixed,
    the value loss (R - V)^2 (the mean squared error, as baselines' and Kostrikov's A2C) and the entropy of pi, each a
    mean over M; total = policy + vf_coef value - ent_coef entropy."""
    log_probs = torch.log_softmax(logits, dim=-1)  # [M, A]
    action_log_probs = log_probs.gather(1, actions.long().unsqueeze(1)).squeeze(1)  # [M]
    advantages = returns - values  # [M]
    value_loss = advantages.pow(2).mean()
    policy_loss = -(advantages.detach() * action_log_probs).mean()
    entropy = -(log_probs.exp() * log_probs).sum(-1).mean()
    total_loss = policy_loss + vf_coef * value_loss - ent_coef * entropy
    return {"policy_loss": policy_loss, "value_loss": value_loss, "entropy": entropy, "total_loss": total_loss}


def sample_actions_from_uniforms(logits: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling from softmax(logits) [B, A] with executor-supplied uniforms [B] in [0, 1) -> [B].

    Sec. 4.1: randomness is deferred to the executors, so the action does not depend on which actor served it.
    """
    cdf = torch.softmax(logits.double(), dim=-1).cumsum(-1)  # [B, A]
    actions = torch.searchsorted(cdf, uniforms.double().unsqueeze(1)).squeeze(1)
    return actions.clamp_(max=logits.shape[-1] - 1)  # cdf[-1] can round to just below 1


def delayed_update(target: nn.Module, behavior: nn.Module, step: Callable[[], dict]) -> dict:
    """Eq. 6: run `step()` (an optimizer update of `behavior`, i.e. at theta_{j-1} on D^{theta_{j-1}}) and add the
    displacement it made to `target` (theta_j). Returns what `step` returned."""
    start = [p.detach().clone() for p in behavior.parameters()]
    stats = step()
    with torch.no_grad():
        for p_target, p_behavior, p_start in zip(target.parameters(), behavior.parameters(), start, strict=True):
            p_target.add_(p_behavior - p_start)
    return stats


def rollout_losses(behavior: nn.Module, batch: Rollout, args: Args) -> dict[str, torch.Tensor]:
    """The A2C losses of `behavior` on a rollout: obs [T+1, B, ...], actions/rewards/dones [T, B]."""
    T, B = batch.actions.shape
    logits, values = behavior(batch.obs.reshape(-1, *batch.obs.shape[2:]))  # [(T+1) B, A], [(T+1) B]
    values = values.reshape(T + 1, B)
    returns = n_step_returns(batch.rewards, batch.dones, values[T].detach(), args.gamma)  # [T, B]
    return a2c_loss(logits[: T * B], values[:T].reshape(-1), batch.actions.reshape(-1), returns.reshape(-1),
                    args.vf_coef, args.ent_coef)  # fmt: skip


def gradient_step(model: nn.Module, optimizer: torch.optim.Optimizer, loss: torch.Tensor, max_grad_norm: float):
    """One optimizer step on `loss`, its gradient clipped to norm max_grad_norm; returns the norm before clipping."""
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    grad_norm = nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    optimizer.step()
    return grad_norm


def make_optimizer(model: nn.Module, args: Args) -> torch.optim.Optimizer:
    return torch.optim.RMSprop(model.parameters(), args.learning_rate, alpha=args.rmsprop_alpha, eps=args.rmsprop_eps)


# ---- Storage and messages --------------------------------------------------------------------------------------------


class Rollout(NamedTuple):
    """One storage as the learner's batch: obs [T+1, B, ...] (obs[T] bootstraps), actions/rewards/dones [T, B]."""

    obs: torch.Tensor
    actions: torch.Tensor
    rewards: torch.Tensor
    dones: torch.Tensor  # dones[t]: the episode ended with transition t


class Episode(NamedTuple):
    step: int  # global step at which it ended
    episodic_return: float
    length: int


class CollectionDone(NamedTuple):
    """Executor -> learner (`results` queue): one collection written, its finished episodes, seconds waited."""

    episodes: list[Episode]
    wait_actors: float
    wait_learner: float
    wait_lockstep: float


class Shared:
    """The shared memory of all processes (Fig. 1e): the published policy, the state buffer (latest obs and the
    executors' uniforms), the action buffer, and two storages of one rollout each."""

    def __init__(self, args: Args, observation_space: gym.Space, policy: nn.Module, version: int) -> None:
        N, T = args.num_envs, args.sync_interval
        obs_shape, obs_dtype = observation_space.shape, torch.from_numpy(np.zeros(1, observation_space.dtype)).dtype
        self.policy = copy.deepcopy(policy).cpu().share_memory()  # theta_j as the actors run it
        self.policy_version = torch.full((1,), version, dtype=torch.int64)  # updates applied to `policy`
        self.state_obs = torch.zeros((N, *obs_shape), dtype=obs_dtype)
        self.state_uniforms = torch.zeros(N, dtype=torch.float64)  # one per env and step, for the actors' sampling
        self.actions = torch.zeros(N, dtype=torch.int64)  # the action buffer
        self.action_versions = torch.zeros(N, dtype=torch.int64)  # policy version that chose each action
        self.actor_wait = torch.zeros(args.num_actors, dtype=torch.float64)  # seconds each actor waited on requests
        self.storage_obs = torch.zeros((2, T + 1, N, *obs_shape), dtype=obs_dtype)
        self.storage_actions = torch.zeros((2, T, N), dtype=torch.int64)
        self.storage_rewards = torch.zeros((2, T, N))
        self.storage_dones = torch.zeros((2, T, N))
        self.storage_versions = torch.full((2, T, N), -1, dtype=torch.int64)  # policy version that chose each action
        self.storage_collections = torch.full((2, T, N), -1, dtype=torch.int64)  # collection that wrote each one
        for value in vars(self).values():
            if isinstance(value, torch.Tensor):
                value.share_memory_()

    def publish(self, model: nn.Module, version: int) -> None:
        """Make `model` the actors' policy; called between collections, when no actor is forwarding."""
        self.policy.load_state_dict(model.state_dict())
        self.policy_version[0] = version

    def rollout(self, j: int, device: torch.device) -> tuple[Rollout, int]:
        """Storage j % 2 as the learner's batch, and the policy version that collected it: the published one, checked
        against the stamps of every transition."""
        s, version = j % 2, int(self.policy_version.item())
        if not (bool((self.storage_collections[s] == j).all()) and bool((self.storage_versions[s] == version).all())):
            raise RuntimeError(f"storage {s} is not entirely collection {j} by policy version {version}")
        batch = Rollout(obs=self.storage_obs[s].to(device), actions=self.storage_actions[s].to(device),
                        rewards=self.storage_rewards[s].to(device), dones=self.storage_dones[s].to(device))  # fmt: skip
        return batch, version


# ---- Workers ---------------------------------------------------------------------------------------------------------


def executor(eid: int, args: Args, shared: Shared, commands: SimpleQueue, requests: SimpleQueue,
             action_conn: Connection, lockstep: Barrier | None, results: Queue) -> None:  # fmt: skip
    """Step this executor's envs for `sync_interval` steps per collection j from `commands`, into storage j % 2.
    `lockstep` (a barrier of all executors, `--sync` only) makes every env step wait for the slowest one (alpha = 1)."""
    torch.set_num_threads(1)
    k = args.num_envs // args.num_executors
    lo, hi = eid * k, (eid + 1) * k
    envs = make_vector_env(args.env_id, k, args.seed + lo, protocol=args.atari_protocol, num_threads=1)
    obs, _ = envs.reset()
    shared.storage_obs[:, :, lo:hi].zero_()  # map our slices of both storages now: RSS is flat after start-up
    rngs = None
    while True:
        start = time.perf_counter()
        j = commands.get()  # the batch-synchronization point: wait for the learner's go
        wait_learner = time.perf_counter() - start
        if j is None:
            break
        s = j % 2
        if rngs is None:  # per-env generators: sampling does not depend on how envs are split among executors
            rngs = [np.random.default_rng([args.seed, i, j]) for i in range(lo, hi)]
        episodes, wait_actors, wait_lockstep = [], 0.0, 0.0
        for t in range(args.sync_interval):
            obs_t = torch.from_numpy(obs)
            shared.state_obs[lo:hi] = obs_t
            shared.state_uniforms[lo:hi] = torch.from_numpy(np.array([g.random() for g in rngs]))
            shared.storage_obs[s, t, lo:hi] = obs_t
            start = time.perf_counter()
            requests.put(eid)
            action_conn.recv_bytes()  # an actor wrote our actions
            wait_actors += time.perf_counter() - start
            actions = shared.actions[lo:hi]
            obs, reward, terminated, truncated, info = envs.step(actions.numpy())
            shared.storage_actions[s, t, lo:hi] = actions
            shared.storage_versions[s, t, lo:hi] = shared.action_versions[lo:hi]
            shared.storage_collections[s, t, lo:hi] = j
            shared.storage_rewards[s, t, lo:hi] = torch.from_numpy(reward)
            shared.storage_dones[s, t, lo:hi] = torch.from_numpy((terminated | truncated).astype(np.float32))
            step = (j * args.sync_interval + t + 1) * args.num_envs  # every update is one collection of all envs
            episodes += [Episode(step, r, n) for r, n in finished_episodes(info)]
            if lockstep is not None:
                start = time.perf_counter()
                lockstep.wait()
                wait_lockstep += time.perf_counter() - start
        shared.storage_obs[s, args.sync_interval, lo:hi] = torch.from_numpy(obs)
        results.put(CollectionDone(episodes, wait_actors, wait_learner, wait_lockstep))
    envs.close()


def actor(aid: int, args: Args, shared: Shared, requests: SimpleQueue, action_conns: list[Connection]) -> None:
    """Serve executors as their requests arrive: forward, sample with their uniforms, answer through their pipe."""
    torch.set_num_threads(1)
    device = torch.device("cuda" if args.cuda and torch.cuda.is_available() else "cpu")
    on_gpu = device.type == "cuda"
    policy, policy_version = (copy.deepcopy(shared.policy).to(device), -1) if on_gpu else (shared.policy, None)
    k = args.num_envs // args.num_executors
    while True:
        start = time.perf_counter()
        eid = requests.get()
        shared.actor_wait[aid] += time.perf_counter() - start
        if eid is None:
            return
        version = int(shared.policy_version.item())  # stable during a collection: published only between them
        if on_gpu and policy_version != version:
            policy.load_state_dict(shared.policy.state_dict())
            policy_version = version
        lo, hi = eid * k, (eid + 1) * k
        with torch.no_grad():  # one executor's batch per forward: same shapes whatever the timing (determinism)
            logits, _ = policy(shared.state_obs[lo:hi].to(device))
            actions = sample_actions_from_uniforms(logits.cpu(), shared.state_uniforms[lo:hi])
        shared.actions[lo:hi] = actions
        shared.action_versions[lo:hi] = version
        action_conns[eid].send_bytes(b"")


class Workers:
    """The executor and actor processes and the queues between them and the learner (stop_workers ends them)."""

    def __init__(self, args: Args, shared: Shared, start_method: str, num_collections: int) -> None:
        ctx = mp.get_context(start_method)
        E, self.num_actors, self.num_collections = args.num_executors, args.num_actors, num_collections
        self.results: Queue = ctx.Queue()  # CollectionDone messages
        self.errors: Queue = ctx.Queue()  # the error line of a worker that fails (worker_body)
        self.requests: SimpleQueue = ctx.SimpleQueue()  # ids of executors waiting for actions; None stops an actor
        self.commands: list[SimpleQueue] = [ctx.SimpleQueue() for _ in range(E)]  # collections j; None stops
        # kept for the run, not only passed on: a spawned child rebuilds the barrier's semaphore from its name, which
        # is gone once the parent drops it
        self.pipes = [ctx.Pipe(duplex=False) for _ in range(E)]  # (executor end, actor end): "your actions are ready"
        self.lockstep: Barrier | None = ctx.Barrier(E) if args.sync else None  # --sync: every env step waits for all
        self.processes = Processes(ctx)
        for e in range(E):
            self.processes.start(f"executor {e}", worker_body, executor, self.errors, e, args, shared, self.commands[e],
                                 self.requests, self.pipes[e][0], self.lockstep, self.results)  # fmt: skip
        action_conns = [p[1] for p in self.pipes]
        for a in range(args.num_actors):
            self.processes.start(f"actor {a}", worker_body, actor, self.errors, a, args, shared, self.requests,
                                 action_conns)  # fmt: skip

    def start_collection(self, j: int) -> None:
        """Start collection j into storage j % 2, if the run has one."""
        if j < self.num_collections:
            for q in self.commands:
                q.put(j)

    def wait_collection(self, j: int, stop: threading.Event) -> tuple[list[Episode], dict[str, float]]:
        """Block until every executor finished collection j (the batch synchronization): its episodes in step order (not
        the executors' timing-dependent one) and timing/ scalars. Stop on a signal; Stop(error line): a worker died."""
        E, start, done = len(self.commands), time.perf_counter(), []
        while len(done) < E:
            if stop.is_set():
                raise Stop
            message = None
            with contextlib.suppress(queue.Empty):
                message = self.results.get(timeout=0.5)
            if failure := worker_failure(self.processes, self.errors):  # a killed actor leaves the others running
                raise Stop(failure)
            if message is not None:  # Shared.rollout checks that every transition is of collection j
                done.append(message)
        timings = {  # the executors' means, and the learner's wait for them
            "timing/executor_wait_actors": sum(m.wait_actors for m in done) / E,
            "timing/executor_wait_learner": sum(m.wait_learner for m in done) / E,
            "timing/executor_wait_lockstep": sum(m.wait_lockstep for m in done) / E,
            "timing/learner_wait_executors": time.perf_counter() - start,
        }
        return sorted(e for m in done for e in m.episodes), timings


# ---- Learner ---------------------------------------------------------------------------------------------------------


class Learner:
    """The main process's parameters, optimizer and counters: what a checkpoint holds besides args and RNG state."""

    def __init__(self, args: Args, spaces: tuple[gym.Space, gym.Space], device: torch.device, checkpoint: dict | None):
        self.target = make_model(*spaces, args.network).to(device)  # theta_j: the policy updated and published
        self.behavior = copy.deepcopy(self.target)  # theta_{j-1}, which collected the data: the optimizer steps here
        self.optimizer = make_optimizer(self.behavior, args)
        self.global_step, self.update = 0, 0  # update: updates applied = version of `target` = next collection
        if checkpoint is not None:
            self.target.load_state_dict(checkpoint["model"])
            self.behavior.load_state_dict(checkpoint["model"])
            self.optimizer.load_state_dict(checkpoint["optimizer"])
            self.global_step, self.update = checkpoint["global_step"], checkpoint["update"]
            torch.set_rng_state(checkpoint["rng"]["torch"])

    def step(self, batch: Rollout, lr: float, args: Args) -> dict[str, float]:
        """Learn from `batch`, collected by the parameters in `behavior`: a delayed update of `target` (Eq. 6), or with
        --sync (behavior == target) a plain update of the current parameters."""
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        if not args.sync:
            return delayed_update(self.target, self.behavior, lambda: self.learn(batch, args))
        stats = self.learn(batch, args)
        self.target.load_state_dict(self.behavior.state_dict())
        return stats

    def learn(self, batch: Rollout, args: Args) -> dict[str, float]:
        """One A2C step of `behavior`; a non-finite loss stops the run before the step: the parameters stay finite."""
        losses = rollout_losses(self.behavior, batch, args)
        if not torch.isfinite(losses["total_loss"]):
            raise NonFiniteLoss(f"non-finite loss {losses['total_loss'].item()}")
        grad_norm = gradient_step(self.behavior, self.optimizer, losses["total_loss"], args.max_grad_norm)
        return {k: v.item() for k, v in losses.items()} | {"grad_norm": grad_norm.item()}


# ---- Main ------------------------------------------------------------------------------------------------------------


def main(args: Args) -> None:
    if (run := open_run(args)) is None:  # resume, validation, run directory, args.json, seed, threads, device
        return  # --eval-only played the saved agent
    args, device, signals = run.args, run.device, run.stop_on_signals(threading.Event())
    learner = Learner(args, run.spaces, device, run.checkpoint)
    shared = Shared(args, run.spaces[0], learner.target, learner.update)
    workers = Workers(args, shared, "spawn" if device.type == "cuda" else "fork", run.num_updates)  # CUDA: no fork
    with run.training(f"{args.num_executors} executors and {args.num_actors} actors", lambda: learner.global_step,
                      lambda graceful: stop_workers(workers, graceful), final_model=lambda: learner.target,
                      checkpoint=lambda: write_checkpoint(learner, run)) as record:  # fmt: skip
        workers.start_collection(learner.update)
        while learner.update < run.num_updates:
            j = learner.update
            episodes, timing = workers.wait_collection(j, signals.stop)
            record.games(episodes)
            # Storage j % 2 holds D_j, collected by the published parameters: they become the behavior copy.
            batch, behavior_version = shared.rollout(j, device)  # policy lag: updates since behavior_version
            learner.behavior.load_state_dict(shared.policy.state_dict())
            if not args.sync:  # HTS-RL: publish theta_j, executors fill the other storage while we learn from this one
                shared.publish(learner.target, learner.update)
                workers.start_collection(j + 1)
            lr = args.learning_rate * (1.0 - j / run.num_updates if args.anneal_lr else 1.0)
            with timer(record, "timing/learner_update"):
                losses = learner.step(batch, lr, args)
            record.add({"charts/policy_lag": learner.update - behavior_version, "charts/learning_rate": lr})
            learner.update += 1
            learner.global_step += run.steps_per_update
            if args.sync:  # the executors waited for the new parameters
                shared.publish(learner.target, learner.update)
                workers.start_collection(j + 1)
            record.add({"losses/policy_loss": losses["policy_loss"], "losses/value_loss": losses["value_loss"],
                        "losses/entropy": losses["entropy"], "losses/total_loss": losses["total_loss"],
                        "losses/grad_norm": losses["grad_norm"]})  # fmt: skip
            record.add(timing | {"timing/actor_wait_requests": shared.actor_wait.mean().item()})
            done = learner.update == run.num_updates
            if learner.update % args.log_frequency == 0 or done:
                record.point(learner.global_step)
            record.line(learner.global_step, f"update={learner.update}/{run.num_updates}", now=done)
            run.checkpoint_if_due()


# ---- run plumbing ------------------------------------------------------------------------------------------------
# Validation, run directory, tracking, checkpoints, --eval-only, signals, supervision and error lines: nothing here is
# needed to read or change the algorithm above. A function that several scripts have here is the same text in all of
# them (tests/test_plumbing.py names any that drift): change it in every script. Script-specific functions come last.


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)  # Ctrl+C, kill, a closed terminal


class Stop(Exception):
    """The run is stopping (a signal, a dead worker, the budget spent): leaves a wait or a loop early."""


class Interrupted(BaseException):
    """A signal during the end-of-run evaluation: a BaseException, so no `except Exception` in an env can swallow it."""


class NonFiniteLoss(Exception):
    """A loss or gradient norm that is NaN or infinite: the run stops and the last good checkpoint is kept."""


class WriteError(Exception):
    """A checkpoint, model or TensorBoard write that failed (a full disk): the message is the run's error line."""


class Console:
    """sys.stdout or sys.stderr of a run's process, silent once its reader has gone (`| head -2`, a closed terminal):
    the run goes on to its budget, its checkpoints and TensorBoard written as ever. A forked child inherits it."""

    def __init__(self, stream) -> None:
        self.stream = stream

    @classmethod
    def install(cls) -> None:
        """Wrap stdout and stderr, unless they are wrapped or redirected already (a test's capture)."""
        for name in ("stdout", "stderr"):
            if (stream := getattr(sys, name)) is not None and stream is getattr(sys, f"__{name}__"):
                setattr(sys, name, cls(stream))

    def write(self, text: str) -> int:
        try:
            return self.stream.write(text)
        except BrokenPipeError:
            self.drop()
            return len(text)

    def flush(self) -> None:
        try:
            self.stream.flush()
        except BrokenPipeError:
            self.drop()

    def drop(self) -> None:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, self.stream.fileno())
        os.close(devnull)

    def __getattr__(self, name: str):  # fileno, isatty, encoding, ...: the stream's own
        return getattr(self.stream, name)


class StopSignals:
    """Ctrl+C, SIGTERM and SIGHUP set `stop` and keep the first signal for the exit status 128 + signum: the run stops
    at its own pace, writes its final checkpoint, and a second signal cannot cut that short. After `interruptible()`
    (an evaluation) they raise Interrupted."""

    def __init__(self, stop):
        self.stop, self.signum, self.raise_stop = stop, 0, False
        self.previous = {s: signal.signal(s, self.handler) for s in STOP_SIGNALS}

    def handler(self, signum: int, frame) -> None:
        self.signum = self.signum or signum
        # from another thread: the main thread may hold the event's own lock here, and a set() would wait forever
        threading.Thread(target=self.stop.set, daemon=True).start()
        if self.raise_stop:
            raise Interrupted(signum)

    def interruptible(self) -> None:
        self.raise_stop = True
        if self.signum:
            raise Interrupted(self.signum)

    def restore(self) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)

    def exit_on_signal(self, code: int) -> None:
        """Everything is written: a signal from here ends the process at once, with the run's status, no traceback."""
        for signum in STOP_SIGNALS:
            signal.signal(signum, lambda *_: os._exit(code))


def error_line(e: BaseException, step: int, signum: int, who: str = "the learner", rank: int = 0,
               ranks: int = 1) -> tuple[int, str | None]:  # fmt: skip
    """The exit status and error line of the exception that ended training, called in its `except` block: a Stop (a
    signal: 128 + signum; a worker's line; neither: status 0), a failed write, a non-finite loss, a lost torchrun rank
    (of two, the other one), or a bug (its traceback). `who` names the process."""
    if isinstance(e, Stop) and signum and not e.args:
        return 128 + signum, f"stopped by {signal.Signals(signum).name} at global step {step}"
    if isinstance(e, Stop):  # a message: a worker's error line (worker_failure); none: the budget was spent
        return (1, str(e)) if e.args else (0, None)
    if isinstance(e, WriteError):
        return 1, f"{e}; stopping (the last good checkpoint is kept)"
    if isinstance(e, NonFiniteLoss):
        return 1, f"error: {e} in {who} at global step {step}; stopping (the last good checkpoint, if any, is kept)"
    if isinstance(e, OSError) and any("tensorboard" in f.filename for f in traceback.extract_tb(e.__traceback__)):
        return 1, f"{write_error(e, 'the TensorBoard events')}; stopping"
    text, kinds = str(e), {c.__name__ for c in type(e).__mro__}
    if ranks > 1 and "RankLost" in kinds:  # the torchrun scripts' own: the message names the ranks
        return 1, f"error: {e}; stopping"
    signs = ("Connection closed by peer", "Connection reset", "Broken pipe", "Timed out", "timed out", "gossip thread")
    if ranks > 1 and ("DistError" in kinds or any(s in text for s in signs)):
        other = f"rank {1 - rank}" if ranks == 2 else "another rank"
        reason = (text.strip().splitlines() or [""])[0][:160]
        return 1, f"error: {who}: lost contact with {other}, which died or lost its connection ({reason})"
    return 1, f"error: {who} died:\n{traceback.format_exc()}"


@dataclass
class Run:
    """The run envelope around `main`: `open_run` is its opening (all before a worker starts), `with run.training(...)`
    its closing around the loop that drives training. `run_dir` is None on a torchrun rank other than 0."""

    args: Args
    spaces: tuple[gym.Space, gym.Space]
    meta: dict
    checkpoint: dict | None  # --resume's, else None
    run_dir: Path | None
    device: torch.device
    world_size: int
    rank: int
    steps_per_update: int
    num_updates: int  # of the whole budget, the updates a resumed checkpoint did included
    plan: str
    signals: StopSignals
    save: Callable[[], None] | None = None
    checkpoint_due: float = math.inf

    @property
    def checkpoint_path(self) -> Path:
        return self.run_dir / "checkpoint.pt"

    def stop_on_signals(self, stop) -> StopSignals:
        """From here a signal sets `stop`, the stop the workers share (at once, if one came during the start)."""
        self.signals.stop = stop
        if self.signals.signum:
            stop.set()
        return self.signals

    @contextlib.contextmanager
    def training(self, roles: str, step: Callable[[], int], stop: Callable[[bool], str | None], *,
                 checkpoint: Callable[[], None] | None = None, save: Callable[[], None] | None = None,
                 final_model: Callable[[], nn.Module] | None = None, last_point: Callable[[], None] | None = None,
                 who: str = "the learner", window: int = 100, threads: list = (), teardown: bool = True):  # fmt: skip
        """Main's loop runs inside, with the Recorder (None off rank 0; `roles` goes into the start line). Whatever ends
        it, `stop(graceful)` stops the workers (a string back: a worker's error line); then the final `checkpoint()`
        unless the run failed, `last_point()`, a finished run's `final_model()` saved and played, the writer and W&B
        closed, the error line, the summary, the exit. `checkpoint_if_due()` calls `save()` (default `checkpoint()`)."""
        args, run_dir, record, tracker, progress = self.args, self.run_dir, None, None, None
        code, message, good = 0, None, True
        try:
            if run_dir is not None:
                total = self.num_updates * self.steps_per_update
                progress = Progress(run_dir, total, f"{self.plan}, {roles}, {self.device}")
                tracker = start_tracking(args, run_dir)  # after the forks: no worker inherits wandb's
                record = Recorder(make_writer(run_dir, args), progress, args, step(), window)
            self.save, self.checkpoint_due = save or checkpoint, time.time() + args.checkpoint_interval
            yield record
            if self.signals.signum:  # the workers saw the signal's stop and ended the loop before main did
                raise Stop
        except Exception as e:  # a signal, a dead worker, a failed write, a non-finite loss, a bug
            code, message = error_line(e, step(), self.signals.signum, who, self.rank, self.world_size)
            good = code != 1 or getattr(e, "checkpoint_is_good", False)
        finally:  # whatever ended the loop (a BaseException too), no worker outlives it
            failure = stop(code == 0)
        end, writer = step(), record and record.writer  # writer None: it could not be made, or this rank has none
        if failure and code != 1:
            code, message, good = 1, failure, False
        elif code > 128:  # a signal: the step the workers reached as they stopped
            message = error_line(Stop(), end, self.signals.signum)[1]
        try:
            if good and checkpoint is not None and args.checkpoint_interval > 0 and checkpoint() is not False:
                message = message and f"{message}; checkpoint written to {self.checkpoint_path}"  # False: none due
            if last_point is not None:  # the run's last TensorBoard point and console line
                last_point()
            model = final_model() if code == 0 and final_model and (args.save_model or args.eval_episodes) else None
            if model is not None and args.save_model:
                atomic_save(model.state_dict(), run_dir / "model.pt")
            if model is not None and args.eval_episodes > 0:
                code, message = final_evaluation(model, args, run_dir, end, self.signals, writer, self.device)
        except WriteError as e:
            code, message = 1, f"{e}; stopping (the last good checkpoint is kept)"
        except OSError as e:  # the TensorBoard events file
            code, message = 1, write_error(e, f"the TensorBoard events in {run_dir}")
        try:
            if writer is not None:
                writer.close()
        except OSError as e:  # the events file could not be flushed: the error above, or this one
            message, code = message or write_error(e, f"the TensorBoard events in {run_dir}"), code or 1
        finish_tracking(tracker, run_dir, code)
        if message:
            print(message, file=sys.stderr, flush=True)
        if progress is not None:
            progress.summary(end, code)
        atexit.register(self.signals.exit_on_signal, code)  # the interpreter's exit handlers run after ours
        leave(code, threads, teardown)

    def checkpoint_if_due(self, lock=None) -> None:
        """`save()` once --checkpoint-interval seconds have passed, holding `lock` (impala: between two updates)."""
        if self.save is not None and self.args.checkpoint_interval > 0 and time.time() >= self.checkpoint_due:
            with lock or contextlib.nullcontext():
                self.save()
            self.checkpoint_due = time.time() + self.args.checkpoint_interval


def open_run(args: Args) -> Run | None:
    """The run's opening: a --resume's flags, validation, --eval-only (None), warnings, the checkpoint, the run
    directory and args.json (rank 0), `init_torch`; a signal from here on stops the run with its line."""
    world_size, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    args = settled_args(resumed_args(args) if args.resume else args)
    if error := validate(args, world_size):
        fail(error)
    if args.eval_only:
        main_eval_only(args)
        return None
    signals = StopSignals(threading.Event())
    flag_warnings(args)
    spaces = env_spaces(args)
    meta = checkpoint_meta(args, *spaces, world_size)
    steps = steps_per_update(args, world_size)
    checkpoint = load_checkpoint(args.resume, meta, args, steps) if args.resume else None
    run_dir = (Path(args.resume).resolve().parent if args.resume else new_run_dir(args)) if rank == 0 else None
    if run_dir is not None:
        write_run_args(run_dir, args, meta)
    device = init_torch(args, spaces, rank, world_size)
    stop_if_signalled(signals, run_dir, resumed=checkpoint is not None)
    return Run(args, spaces, meta, checkpoint, run_dir, device, world_size, rank, steps,
               *planned_updates(args.total_timesteps, steps), signals)  # fmt: skip


def stop_if_signalled(signals: StopSignals, run_dir: Path | None, resumed: bool) -> None:
    """Ctrl+C or SIGTERM during the start: exit before any worker starts, leaving no new run directory behind."""
    if signals.signum:  # set by the handler itself: the event is set a moment later, from a thread
        if run_dir is not None and not resumed:
            for name in (".lock", "args.json"):  # claim_run_dir's and write_run_args's: it held nothing else
                (run_dir / name).unlink(missing_ok=True)
            run_dir.rmdir()
        signals.restore()
        print(f"stopped by {signal.Signals(signals.signum).name} during the start", file=sys.stderr)
        raise SystemExit(128 + signals.signum)


class Evaluation:
    """An evaluation's games as they end: logged (at steps step, step + 1, ...), the first SHOWN printed, then a line
    at most every EVERY seconds with their mean: 4,000 CartPole games are not 4,000 lines."""

    SHOWN, EVERY = 10, 5.0

    def __init__(self, total: int, writer=None, step: int = 0) -> None:
        self.total, self.writer, self.step, self.returns, self.last = total, writer, step, [], time.monotonic()

    def play(self, games: Iterator[float], signals: StopSignals) -> bool:
        """Record each game as it ends: True, or False if a signal stopped it (the games played stay recorded)."""
        try:
            signals.interruptible()  # from here a signal raises Interrupted, wherever the game is
            for ret in games:
                signals.raise_stop = False  # a game is recorded whole
                self.add(ret)
                signals.interruptible()
        except Interrupted:
            return False
        finally:
            signals.raise_stop = False
        return True

    def add(self, ret: float) -> None:
        played, shown = len(self.returns), len(self.returns) < self.SHOWN
        if self.writer is not None:
            self.writer.add_scalar("eval/episodic_return", ret, self.step + played)
        self.returns.append(ret)
        if shown or time.monotonic() - self.last >= self.EVERY:
            each = f"eval episode {played}: return {ret:.2f}"
            print(each if shown else f"eval: {played + 1} of {self.total} games, mean return {self.mean():.2f}",
                  flush=True)  # fmt: skip
            self.last = time.monotonic()

    def mean(self) -> float:
        return float(np.mean(self.returns)) if self.returns else math.nan

    def stopped(self, signals: StopSignals, where: str) -> tuple[int, str]:
        """The exit status and error line of an evaluation a signal stopped."""
        name, games = signal.Signals(signals.signum).name, f"{len(self.returns)} of {self.total} games"
        return 128 + signals.signum, f"stopped by {name} in {where}, after {games}"


def final_evaluation(model: nn.Module, args, run_dir: Path, step: int, signals: StopSignals, writer,
                     device: torch.device) -> tuple[int, str | None]:  # fmt: skip
    """Play --eval-episodes games with the final policy (Evaluation); returns the run's (code, message)."""
    print(f"evaluating the final policy: {args.eval_episodes} episodes", flush=True)
    games = Evaluation(args.eval_episodes, writer, step)
    if not games.play(evaluate(model, args, run_dir / "videos", device), signals):
        return games.stopped(signals, "the final evaluation")
    print(f"mean return over {len(games.returns)} episodes: {games.mean():.2f}", flush=True)
    return 0, None


def leave(code: int, threads: list = (), teardown: bool = True) -> None:
    """Exit with `code`, skipping the interpreter's teardown if a worker thread is alive or `teardown` is False
    (torchrun: gloo's threads): a thread inside torch then makes C++ static destructors abort the process (SIGABRT)."""
    alive = [t.name for t in threads if t.is_alive()]
    if alive:
        print(f"warning: {', '.join(alive)} still running at exit; leaving without interpreter teardown",
              file=sys.stderr, flush=True)  # fmt: skip
    if alive or not teardown:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    if code:
        raise SystemExit(code)


def fail(message: str) -> NoReturn:
    """Bad input: one error line, exit status 2, before anything is started or written."""
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def flag(name: str) -> str:
    return f"--{name.replace('_', '-')}"


def flag_warnings(args) -> None:
    """A `warning:` line for a learning rate above 1: the weights blow up within a few updates while the losses can
    stay finite, so nothing would stop the run."""
    for f in fields(args):
        value = getattr(args, f.name)
        if f.name.endswith("learning_rate") and isinstance(value, float) and value > 1:
            print(f"warning: {flag(f.name)} {value:g} is above 1: the weights will diverge within a few updates, and "
                  f"no check stops the run while its losses stay finite", file=sys.stderr, flush=True)  # fmt: skip


def check_flags(args: Args) -> str | None:
    """The error line of a non-finite float, a FLAG_RULES breach, a path as --exp-name, or --track without wandb."""
    for f in fields(args):
        value = getattr(args, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            return f"{flag(f.name)} must be a finite number, got {value}"
    holds = {">= 1": lambda v: v >= 1, ">= 0": lambda v: v >= 0, "> 0": lambda v: v > 0,
             "in (0, 1]": lambda v: 0 < v <= 1, "in [0, 1]": lambda v: 0 <= v <= 1,
             "in [0, 1)": lambda v: 0 <= v < 1}  # fmt: skip
    for rule, name in ((rule, name) for rule, names in FLAG_RULES for name in names):
        if (value := getattr(args, name)) is not None and not holds[rule](value):
            return f"{flag(name)} must be {rule}, got {value}"
    if any(sep and sep in args.exp_name for sep in ("/", os.sep, os.altsep)):  # "../../x" would leave --log-dir
        return (f"--exp-name {args.exp_name} must be a name without '/': it is one part of the run directory's name "
                f"(ENV__NAME__SEED__TIME in --log-dir {args.log_dir})")  # fmt: skip
    if args.track:
        try:
            import wandb  # noqa: F401  optional: pip install -e ".[track]"
        except Exception as e:  # not installed, or broken: refused before any directory is made
            return f'--track needs wandb (pip install -e ".[track]"): {type(e).__name__}: {str(e)[:160]}'
    return None


def parse_args(argv: list[str]) -> Args:
    """tyro's parse, its boxed message and RENAMED_FLAGS turned into one error line and exit 2; `args.given` names the
    flags the command line gave (a resume or an evaluation takes the saved run's value of the others)."""
    Console.install()  # before the first line the run prints
    for arg in argv:
        if (name := arg.split("=")[0]) in RENAMED_FLAGS:
            fail(f"{name} {RENAMED_FLAGS[name]}")
    strings = getattr(tyro, "_strings", None)  # private: a tyro without the helper keeps its own --help wrapping
    join = getattr(strings, "remove_single_line_breaks", None)
    if isinstance(join, functools.partial) and join.func.__name__ == "help_paragraphs":  # this or another script's
        join = join.keywords["join"]
    if join is not None:
        strings.remove_single_line_breaks = functools.partial(help_paragraphs, join=join)
    box = io.StringIO()
    try:
        with contextlib.redirect_stderr(box):
            args = tyro.cli(Args, args=argv)
        names = {f.name for f in fields(Args)}
        words = {arg[2:].split("=")[0].replace("-", "_") for arg in argv if arg.startswith("--")}
        args.given = frozenset(names & (words | {w.removeprefix("no_") for w in words}))  # --no-cuda gives cuda
        return args
    except SystemExit as e:
        if e.code in (0, None):
            raise
        # the box: a title, its message over lines, a rule before the help (box characters, or dashes off a terminal)
        lines = [line.strip("\u2502\u256d\u2570\u256e\u256f ") for line in box.getvalue().splitlines()][1:]
        body = itertools.dropwhile(lambda line: not line.strip("\u2500-"), lines)
        message = " ".join(itertools.takewhile(lambda line: line.strip("\u2500-"), body))
        fail(f"{message or 'the command line cannot be parsed'} (see python {Path(__file__).name} --help)")


def help_paragraphs(text: str, join) -> str:
    """tyro's private `join`, given one line per paragraph: --help wraps whole sentences at the terminal's width."""
    paragraphs = "\n".join(line.strip() for line in text.split("\n")).split("\n\n")
    return join("\n\n".join(paragraph.replace("\n", " ") for paragraph in paragraphs))


def new_run_dir(args: Args) -> Path:
    """Make this run's directory, never one that exists (mkdir is atomic: the same name and second gets -2, -3...)."""
    base = Path(args.log_dir) / f"{args.env_id.replace('/', '_')}__{args.exp_name}__{args.seed}__{int(time.time())}"
    for n in itertools.count(1):
        run_dir = base if n == 1 else base.with_name(f"{base.name}-{n}")
        try:
            base.parent.mkdir(parents=True, exist_ok=True)
            run_dir.mkdir()
            claim_run_dir(run_dir)
            return run_dir
        except FileExistsError:
            if not base.parent.is_dir():
                fail(f"cannot create the run directory {base}: {base.parent} is not a directory")
        except OSError as e:
            fail(f"cannot create the run directory {run_dir}: {e.strerror or e}")


def write_run_args(run_dir: Path, args: Args, meta: dict) -> None:
    """{run_dir}/args.json (script, Args, meta): --eval-only rebuilds from it the env and model of a model.pt."""
    try:
        (run_dir / "args.json").write_text(json.dumps(dict(script=meta["script"], args=asdict(args), meta=meta)))
    except OSError as e:
        fail(f"cannot write {run_dir / 'args.json'}: {e.strerror or e}")


def start_tracking(args: Args, run_dir: Path):
    """--track: a W&B run named (and id'd, for --resume) like the run directory, TensorBoard synced: wandb, or None."""
    if not args.track:
        return None
    import wandb  # optional: pip install -e ".[track]"

    try:
        wandb.init(project=args.wandb_project_name, entity=args.wandb_entity, name=run_dir.name, config=asdict(args),
                   id=hashlib.sha1(run_dir.name.encode()).hexdigest(), resume="allow" if args.resume else None,
                   sync_tensorboard=True, save_code=True)  # fmt: skip
    except Exception as e:  # not logged in, no network, an unknown entity or project
        fail(f"--track: wandb.init failed: {(str(e).strip().splitlines() or [type(e).__name__])[0][:200]}")
    return wandb


def finish_tracking(tracker, run_dir: Path, exit_code: int) -> None:
    """--track: upload the evaluation's videos and end the W&B run with the exit status (after the writer closed)."""
    if tracker is None:
        return
    for video in sorted((run_dir / "videos").glob("*.mp4")):
        tracker.log({"videos": tracker.Video(str(video))})
    tracker.finish(exit_code=exit_code)


def make_writer(run_dir: Path, args: Args):
    """The run's TensorBoard writer, with the hyperparameter table and its writer thread's write errors kept quiet."""
    from torch.utils.tensorboard import SummaryWriter  # here, not at import: the writer starts a thread

    threading.excepthook = quiet_writer_thread
    writer = SummaryWriter(str(run_dir))
    table = "\n".join(f"|{k}|{v}|" for k, v in asdict(args).items())
    writer.add_text("hyperparameters", f"|param|value|\n|-|-|\n{table}")
    return writer


def quiet_writer_thread(hook) -> None:
    """threading.excepthook: TensorBoard's writer thread's write error is reported by the main thread's next write."""
    frames = traceback.extract_tb(hook.exc_traceback)
    if not (issubclass(hook.exc_type, OSError) and any("tensorboard" in f.filename for f in frames)):
        threading.__excepthook__(hook)


def write_error(e: OSError, what) -> str:
    """The error line of a write that failed: a full disk said plainly, anything else with the system's reason."""
    if e.errno == errno.ENOSPC:
        return f"error: no space left on device while writing {what}"
    return f"error: cannot write {what}: {e.strerror or e}"


def not_finite(obj) -> bool:
    """Whether a state (tensors in dicts, lists and tuples) has a floating-point tensor with a NaN or an infinity."""
    if isinstance(obj, torch.Tensor):
        return obj.is_floating_point() and not bool(torch.isfinite(obj).all())
    if isinstance(obj, dict):
        return any(not_finite(v) for v in obj.values())
    return isinstance(obj, (list, tuple)) and any(not_finite(v) for v in obj)


def atomic_save(obj, path: Path) -> None:
    """torch.save to a temporary file renamed over `path` (a crash or a full disk leaves the old file), keeping its
    mode; never a read-only file or weights with a NaN or an infinity (WriteError)."""
    if not_finite(obj):
        raise WriteError(f"error: not writing {path}: its weights hold NaN or infinity (a diverged update)")
    mode = None
    with contextlib.suppress(OSError):  # no file yet
        mode = os.stat(path).st_mode & 0o7777
    if mode is not None and not mode & 0o200:  # the mode bit, not os.access: root may write any file
        raise WriteError(f"error: not replacing {path}: it is read-only (chmod u+w {path} lets the run write it)")
    buffer = io.BytesIO()
    torch.save(obj, buffer)  # serialised in memory first: a full disk then shows as ENOSPC, not a zip-writer error
    tmp = path.with_suffix(".tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(buffer.getbuffer())
            f.flush()
            os.fsync(f.fileno())
        if mode is not None:
            os.chmod(tmp, mode)
        os.replace(tmp, path)
    except OSError as e:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        raise WriteError(write_error(e, path)) from None


def planned_updates(total_timesteps: int, steps_per_update: int) -> tuple[int, str]:
    """The updates a budget holds, and the start line's words for them (and for a budget that is not whole updates)."""
    n = total_timesteps // steps_per_update
    plan = f"{n:,} updates of {steps_per_update:,} agent steps"
    if n * steps_per_update != total_timesteps:
        plan += f" = {n * steps_per_update:,} agent steps: --total-timesteps {total_timesteps:,} is not whole updates"
    return n, plan


def duration(seconds: float) -> str:
    """A console time: 2h05m, 3m07s or 42s."""
    s = round(seconds)
    return f"{s // 3600}h{s % 3600 // 60:02d}m" if s >= 3600 else f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


class Progress:
    """The console: the run's plan, its progress and time left, and at its end the files and the next commands."""

    def __init__(self, run_dir: Path, total_steps: int, plan: str) -> None:
        self.run_dir, self.total, self.start, self.mean_return = run_dir, total_steps, time.time(), math.nan
        print(f"run directory: {run_dir}  ({plan})", flush=True)

    def line(self, step: int, sps: float, mean_return: float, details: str = "") -> None:
        """`global_step=N SPS=R mean_return=M` (read by tools and tests), the share done, time left, `details`."""
        self.mean_return = mean_return
        left = duration((self.total - step) / sps) if sps > 0 else "?"
        print(f"global_step={step} SPS={sps:.0f} mean_return={mean_return:.2f} done={100 * step / self.total:.1f}% "
              f"left={left} {details}".rstrip(), flush=True)  # fmt: skip

    def summary(self, step: int, exit_code: int) -> None:
        """After the error line, if any: steps, time, last mean return, the files written, and the next commands."""
        ended = "finished" if exit_code == 0 else f"stopped (exit status {exit_code})"
        print(f"{ended}: {step:,} of {self.total:,} agent steps in {duration(time.time() - self.start)}, last mean "
              f"return {self.mean_return:.2f}", flush=True)  # fmt: skip
        files = []
        with contextlib.suppress(OSError):  # the directory is gone: "nothing"
            kept = (p for p in self.run_dir.iterdir() if not p.name.endswith(".tmp") and p.name != ".lock")
            files = sorted(p.name + "/" * p.is_dir() for p in kept)
        print(f"wrote to {self.run_dir}: {', '.join(files) or 'nothing'}")
        script, checkpoint, model = Path(__file__).name, self.run_dir / "checkpoint.pt", self.run_dir / "model.pt"
        print(f"next: tensorboard --logdir {shlex.quote(str(self.run_dir))}")  # each line pastes into a shell as is
        if checkpoint.exists() and step < self.total:
            world, local = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
            launch = "python" if world == 1 else f"torchrun --nproc-per-node {local}"  # the ranks a resume needs
            launch += " --standalone" if world == local > 1 else f" --nnodes {world // local}" if world > 1 else ""
            where = "  # on every node, with its rendezvous flags" if world > local else ""
            print(f"      {launch} {script} --resume {shlex.quote(str(checkpoint))}{where}")
        if saved := [p for p in (model, checkpoint) if p.exists()]:  # the newer: a resumed run may leave an old model
            newer = max(saved, key=lambda p: p.stat().st_mtime)
            print(f"      python {script} --eval-only {shlex.quote(str(newer))}", flush=True)


class Recorder:
    """TensorBoard and console: each game as it ends, scalars by tag (a point is the mean since the last one) with
    charts/SPS, and the console line (mean_return over the last `window` games) every --log-interval seconds."""

    def __init__(self, writer, progress: Progress, args, step: int, window: int = 100) -> None:
        self.writer, self.progress, self.log_interval = writer, progress, args.log_interval
        self.start, self.last_line, self.returns = (time.time(), step), time.time(), deque(maxlen=window)
        self.values: dict[str, list[float]] = {}  # tag -> the values given since the last point

    def games(self, games) -> None:
        """(step, return, length) of each game that ended."""
        for step, ret, length in games:
            self.writer.add_scalar("charts/episodic_return", ret, step)
            self.writer.add_scalar("charts/episodic_length", length, step)
            self.returns.append(ret)

    def add(self, scalars: dict[str, float]) -> None:
        """Values by TensorBoard tag, each tag written out in full by the caller (it greps to the line recording it)."""
        for tag, value in scalars.items():
            self.values.setdefault(tag, []).append(value)

    def point(self, step: int) -> None:
        for tag, values in (self.values | {"charts/SPS": [self.sps(step)]}).items():
            self.writer.add_scalar(tag, sum(values) / len(values), step)
        self.values = {}

    def line(self, step: int, details: str = "", now: bool = False) -> None:
        if now or time.time() - self.last_line >= self.log_interval:
            mean_return = float(np.mean(self.returns)) if self.returns else math.nan
            self.progress.line(step, self.sps(step), mean_return, details)
            self.last_line = time.time()

    def sps(self, step: int) -> float:
        return (step - self.start[1]) / max(time.time() - self.start[0], 1e-9)


@contextlib.contextmanager
def timer(record: Recorder, tag: str):
    """The seconds the block takes, as a value of `tag` (the hts scripts' learner update)."""
    start = time.perf_counter()
    yield
    record.add({tag: time.perf_counter() - start})


def given_flags(args: Args) -> set[str]:
    """The flags a command line gave (`args.given`); for an Args built in code, those away from their defaults."""
    if (given := getattr(args, "given", None)) is not None:
        return set(given)
    default = asdict(Args())
    return {k for k, v in asdict(args).items() if v != default[k]}


def resumed_args(args: Args) -> Args:
    """--resume: the flags its checkpoint holds (args.json only for one without), but every flag this command line
    gives, even at its default: `--resume DIR/checkpoint.pt` alone continues the run as it was. DIR means its
    checkpoint.pt."""
    path, default, given = Path(args.resume), asdict(Args()), given_flags(args)
    if path.is_dir():
        if not (path / "checkpoint.pt").is_file():
            fail(f"--resume {path}: a directory without a checkpoint.pt; give a run's checkpoint, as in --resume "
                 f"{Path(args.log_dir) / 'RUN_DIR' / 'checkpoint.pt'}")  # fmt: skip
        path = path / "checkpoint.pt"
    elif not path.is_file():
        fail(f"--resume {path}: no such file")
    try:
        saved = torch.load(path, map_location="cpu", weights_only=False)["args"]
    except Exception:  # not a checkpoint (load_checkpoint says so), or one without its flags
        try:
            saved = json.loads((path.parent / "args.json").read_text())["args"]
        except (OSError, ValueError, KeyError, TypeError):
            saved = {}
    kept = {k: saved[k] for k in default if k in saved and k not in given and k not in ("resume", "eval_only")}
    kept = {k: tuple(v) if isinstance(default[k], tuple) else v for k, v in kept.items()}
    return replace(args, **kept, resume=str(path))


def claim_run_dir(run_dir: Path) -> None:
    """Lock {run_dir}/.lock until this process ends (even by kill -9), so no second run writes there at once, and
    remove a killed write's temporary files. Held elsewhere: exit 2. Rank 0 only, the rank that writes there."""
    if os.environ.get("RANK", "0") != "0":
        return
    try:
        fd = os.open(run_dir / ".lock", os.O_RDWR | os.O_CREAT, 0o644)  # never closed: closing it would drop the lock
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        if e.errno in (errno.EACCES, errno.EAGAIN):
            fail(f"another run is writing to {run_dir} (a second --resume of its checkpoint, or the run itself)")
        print(f"warning: cannot lock {run_dir} ({e.strerror or e}): nothing stops a second run writing there at once",
              file=sys.stderr)  # fmt: skip
    for tmp in run_dir.glob("*.tmp"):
        with contextlib.suppress(OSError):
            tmp.unlink()


def load_checkpoint(path: str, meta: dict, args: Args, steps_per_update: int) -> dict:
    """The checkpoint at `path` if this run can continue it (the same checkpoint_meta, finite, no RESUME_FIXED flag
    changed, an update left), else one error line and exit 2. Prints its step and the flags that differ."""
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # garbage, truncated, or pickled objects this interpreter cannot rebuild
        reason = (str(e).strip().splitlines() or [""])[0][:120]
        fail(f"cannot resume from {path}: not a checkpoint this script can read ({type(e).__name__}: {reason}); the "
             f"file is truncated (a copy or a write cut short), corrupt, or of another kind")  # fmt: skip
    theirs = checkpoint.get("meta") if isinstance(checkpoint, dict) else None
    if not isinstance(theirs, dict):
        fail(f'cannot resume from {path}: not a checkpoint this script can read (it has no "meta" entry)')
    theirs = {**checkpoint.get("args", {}), **theirs}  # an older checkpoint's meta lacks what its args hold
    if differ := [k for k in meta if theirs.get(k) != meta[k]]:
        ours, saved = (", ".join(f"{k} {m.get(k)}" for k in differ) for m in (meta, theirs))
        fail(f"cannot resume from {path}: it is a {theirs.get('script')} checkpoint ({saved}), this run is {ours}")
    if not_finite(checkpoint):  # no run writes one (atomic_save refuses): a copy damaged or edited since
        fail(f"cannot resume from {path}: its weights hold NaN or infinity; there is nothing to continue from them "
             f"(resume from a checkpoint of finite weights)")  # fmt: skip
    before, now = checkpoint.get("args", {}), asdict(args)
    changed = [k for k in now if k in before and now[k] != before[k] and k not in ("resume", "eval_only")]
    if fixed := [k for k in changed if k in RESUME_FIXED]:  # the run's shape: buffers, schedules, step arithmetic
        k = fixed[0]
        fail(f"cannot resume from {path} with {flag(k)} {now[k]}: its run has {before[k]} (these stay as they were "
             f"in a resumed run: {', '.join(flag(name) for name in RESUME_FIXED)})")  # fmt: skip
    step = checkpoint.get("global_step", 0)
    if (needed := (step // steps_per_update + 1) * steps_per_update) > args.total_timesteps:
        per = f" (whole updates of {steps_per_update})" if steps_per_update > 1 else ""
        fail(f"cannot resume from {path}: its run did {step} agent steps and --total-timesteps {args.total_timesteps}"
             f"{per} holds no more: the run would learn nothing; give at least {needed}")  # fmt: skip
    if not os.access(Path(path).parent, os.W_OK):
        fail(f"cannot write to the run directory {Path(path).parent} of --resume {path}")
    if args.checkpoint_interval > 0 and not os.stat(path).st_mode & 0o200:  # atomic_save keeps a read-only file
        fail(f"cannot resume from {path}: it is read-only, and the run would replace it with its checkpoints; make it "
             f"writable (chmod u+w {path}) or resume from a copy of its run directory")  # fmt: skip
    claim_run_dir(Path(path).resolve().parent)
    said = ", ".join(f"{flag(k)} {now[k]} (was {before[k]})" for k in changed) or "none"
    print(f"resuming {path} from step {checkpoint.get('global_step')}; flags that differ from its run: {said}")
    return checkpoint


def main_eval_only(args: Args) -> None:
    """--eval-only: a model.pt (beside its run's args.json) or checkpoint.pt played as the final evaluation plays it,
    with RUN_SETTINGS from its run; the returns go to {model dir}/eval-{unix time}.json. Nothing trains."""
    path, this, stamp = Path(args.eval_only), Path(__file__).name, int(time.time())
    try:
        saved = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # garbage, truncated, or pickled objects this interpreter cannot rebuild
        reason = (str(e).strip().splitlines() or [""])[0][:100]
        fail(f"--eval-only {path}: not a model.pt or checkpoint.pt ({type(e).__name__}: {reason}); the file is "
             f"truncated, corrupt, or of another kind")  # fmt: skip
    is_checkpoint = isinstance(saved, dict) and isinstance(saved.get("meta"), dict)
    if is_checkpoint:  # it carries its own args and meta
        run = dict(saved, script=saved["meta"].get("script"))
    else:
        try:
            run = json.loads((path.parent / "args.json").read_text())
        except (OSError, ValueError) as e:
            fail(f"--eval-only {path}: cannot read its run's args.json beside it (it names the env and network): {e}")
    if run.get("script") != this:
        fail(f"{path} was saved by {run.get('script')}, not {this}")
    settings = {k: run["meta"].get(k, run["args"][k]) for k in RUN_SETTINGS}  # meta: what `auto` resolved to
    given = given_flags(args)
    for name, value in settings.items():  # a flag given on the command line must be the saved run's, even its default
        ours = getattr(args, name)
        if name in given and json.loads(json.dumps(ours)) not in (value, run["args"][name]):
            fail(f"{flag(name)} {ours} contradicts {path}, saved by a run with {value}")
    eval_args = replace(args, **{k: run["args"][k] for k in RUN_SETTINGS}, eval_episodes=args.eval_episodes or 10)
    try:
        model = saved_model(eval_args, settings, saved["model"] if is_checkpoint else saved)
    except EnvError as e:  # the run's env is not installed here
        fail(f"--eval-only {path}: {e}")
    except Exception as e:  # not a state_dict, or one of another network
        fail(f"--eval-only {path}: not parameters of its run's network ({type(e).__name__})")
    if not_finite(model.state_dict()):
        fail(f"--eval-only {path}: its weights hold NaN or infinity (a diverged run); there is nothing to evaluate")
    device = torch.device("cuda" if args.cuda and torch.cuda.is_available() else "cpu")
    taken = " ".join(f"{k}={v}" for k, v in settings.items())
    how = "greedy" if eval_args.eval_greedy else "sampled"
    print(f"evaluating {path} ({eval_args.eval_episodes} episodes, {how} actions); from its run: {taken}", flush=True)
    games, signals, videos = Evaluation(eval_args.eval_episodes), StopSignals(threading.Event()), f"videos-eval-{stamp}"
    try:  # a signal stops the games, and those played are written as a whole evaluation's are
        played = games.play(evaluate(model.to(device), eval_args, path.parent / videos, device), signals)
    except (EnvError, gym.error.DependencyNotInstalled) as e:  # --capture-video without moviepy or a renderer
        fail(str(e))
    finally:
        signals.restore()
    report = dict(model=str(path), episodes=len(games.returns), greedy=eval_args.eval_greedy, returns=games.returns,
                  mean=games.mean(), settings=settings)  # fmt: skip
    out = path.parent / f"eval-{stamp}.json"
    if games.returns:
        try:
            out.write_text(json.dumps(report, indent=1))
        except OSError as e:
            fail(f"cannot write {out}: {e.strerror or e}")
        print(f"mean return over {len(games.returns)} episodes: {report['mean']:.2f} (written to {out})")
    if not played:
        code, message = games.stopped(signals, "the evaluation")
        print(message, file=sys.stderr, flush=True)
        raise SystemExit(code)


# -- supervision of local child processes (the scripts that start them) --


def fixed_mmap_threshold(nbytes: int = 4 << 20) -> None:
    """Serve allocations >= nbytes with mmap, freed to the OS: glibc's growing threshold lets RSS creep up."""
    with contextlib.suppress(OSError, AttributeError):  # not Linux's glibc
        ctypes.CDLL("libc.so.6").mallopt(-3, nbytes)  # M_MMAP_THRESHOLD; also turns off the dynamic threshold


def child_main(parent_pid: int, target, args: tuple) -> None:
    """A child's first call: the kernel kills it when the main process dies, even by kill -9 (already gone: exit at
    once). Signals are the main process's, which stops children through the run's stop: ignored here, then unblocked."""
    with contextlib.suppress(OSError, AttributeError):  # no prctl (not Linux)
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent_pid:
        os._exit(1)
    Console.install()  # a spawned child's own stdout and stderr (a forked one has its parent's Console)
    for signum in STOP_SIGNALS:
        signal.signal(signum, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    target(*args)


class Processes:
    """The run's child processes by name: started through child_main, watched by sentinel, SIGKILLed after a grace."""

    def __init__(self, ctx):
        self.ctx, self.procs = ctx, {}

    def start(self, name: str, target, *args) -> None:
        process = self.ctx.Process(target=child_main, name=name, args=(os.getpid(), target, args), daemon=True)
        # the child starts with the stop signals blocked (the mask survives fork and exec) until child_main ignores
        # them: a Ctrl+C sent to the whole process group cannot interrupt a spawned child while it imports
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
        try:
            process.start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
        self.procs[name] = process

    def failed(self) -> str | None:
        for name, p in self.procs.items():
            if p.exitcode is not None and p.exitcode != 0:
                how = f"killed by signal {-p.exitcode}" if p.exitcode < 0 else f"exit status {p.exitcode}"
                return f"{name} died ({how})"
        return None

    def stop(self, grace: float) -> list[str]:
        """Join every child within `grace` seconds in all (the stop is set), SIGKILL the rest; their names."""
        deadline = time.monotonic() + grace
        for p in self.procs.values():
            p.join(max(0.0, deadline - time.monotonic()))
        stuck = [name for name, p in self.procs.items() if p.is_alive()]
        for name in stuck:
            self.procs[name].kill()
            self.procs[name].join()
        return stuck


def worker_body(loop, error_q, *loop_args) -> None:
    """child_main's target: `loop(*loop_args)`; an exception but Stop goes to main on `error_q` as the error line."""
    name = multiprocessing.current_process().name
    try:
        with contextlib.suppress(Stop):
            loop(*loop_args)
    except (NonFiniteLoss, WriteError) as e:
        line = str(e) if isinstance(e, WriteError) else f"error: {e}"
        error_q.put(f"{line} ({name}); stopping (the last good checkpoint, if any, is kept)")
        raise SystemExit(1) from None
    except BaseException:
        error_q.put(f"error: {name} died:\n{traceback.format_exc()}")
        raise SystemExit(1) from None


def worker_failure(procs: Processes, error_q) -> str | None:
    """The error line of a dead process, or None; one killed by a signal first (others may be its lock's victims)."""
    for name, p in procs.procs.items():
        if p.exitcode is not None and p.exitcode < 0:
            return f"error: {name} died (killed by signal {-p.exitcode}); stopping the run"
    if failed := procs.failed():
        with contextlib.suppress(queue.Empty):
            return error_q.get(timeout=2.0)
        return f"error: {failed}; stopping the run"
    return None


# -- script-specific: FLAG_RULES, RUN_SETTINGS, validate, env_spaces, checkpoint_meta, saved_model, evaluate, ... --


FLAG_RULES = (
    (">= 1", ("num_envs", "num_executors", "num_actors", "sync_interval", "total_timesteps", "log_frequency")),
    (">= 0", ("seed", "torch_threads", "checkpoint_interval", "eval_episodes", "vf_coef", "ent_coef")),
    ("> 0", ("learning_rate", "rmsprop_eps", "max_grad_norm", "log_interval")),
    ("in [0, 1]", ("gamma",)), ("in [0, 1)", ("rmsprop_alpha",)),
)  # fmt: skip
RUN_SETTINGS = ("env_id", "atari_protocol", "network")
RESUME_FIXED = ("num_envs", "num_executors", "sync_interval", "sync")  # the storage layout and the update arithmetic
RENAMED_FLAGS = {
    "--rms-alpha": "is now --rmsprop-alpha (see --help)",
    "--rms-eps": "is now --rmsprop-eps (see --help)",
    "--console-interval": "is now --log-interval (see --help)",
}


def validate(args: Args, world_size: int = 1) -> str | None:
    """The one-line message of the first bad flag (env and network included), or None."""
    if error := check_flags(args):
        return error
    if world_size > 1:
        return f"{Path(__file__).name} runs on one machine: start it with python, not torchrun"
    if args.num_envs % args.num_executors:
        return f"--num-executors must divide --num-envs {args.num_envs}, got {args.num_executors}"
    if args.total_timesteps < (rollout := args.num_envs * args.sync_interval):
        return (f"--total-timesteps {args.total_timesteps} is below one update, {rollout} agent steps (--num-envs x "
                f"--sync-interval): the run would learn nothing; give at least {rollout}")  # fmt: skip
    if args.capture_video and args.eval_episodes == 0 and args.eval_only is None:
        return "--capture-video records the evaluation episodes; add --eval-episodes N (N >= 1)"
    for name in ("resume", "eval_only"):
        if (path := getattr(args, name)) is not None and not Path(path).is_file():
            return f"{flag(name)} {path}: no such file"
    if args.eval_only is not None:  # env, network and model are the saved run's: main_eval_only checks them
        return None
    try:
        observation_space, action_space = env_spaces(args)
        if args.capture_video:  # fail now, not at the final evaluation
            check_video(args.env_id, args.atari_protocol)
        if not isinstance(action_space, gym.spaces.Discrete):
            return f"{args.env_id} has a continuous action space ({action_space}); for it use apex_ddpg.py"
        make_model(observation_space, action_space, args.network)
    except (EnvError, ValueError) as e:
        return str(e).splitlines()[0] if str(e) else type(e).__name__
    return None


def env_spaces(args: Args) -> tuple[gym.Space, gym.Space]:
    envs = make_vector_env(args.env_id, 1, args.seed, protocol=args.atari_protocol, num_threads=1)
    envs.close()
    return envs.single_observation_space, envs.single_action_space


def checkpoint_meta(args: Args, obs_space: gym.Space, action_space: gym.Space, world_size: int = 1) -> dict:
    """What a checkpoint must match to be resumed by this run: script, env, Atari protocol, network and shapes (one
    machine)."""
    network = args.network if args.network != "auto" else ("nature" if len(obs_space.shape) == 3 else "mlp")
    return dict(script=Path(__file__).name, algo=None, env_id=args.env_id, atari_protocol=args.atari_protocol,
                network=network, obs_shape=list(obs_space.shape), action_shape_or_n=int(action_space.n))  # fmt: skip


def settled_args(args: Args) -> Args:
    """The flags as the run uses them: as given (no default here depends on another flag)."""
    return args


def steps_per_update(args: Args, world_size: int) -> int:
    """Agent steps of one update: a collection of every env's --sync-interval steps."""
    return args.num_envs * args.sync_interval


def init_torch(args: Args, spaces: tuple[gym.Space, gym.Space], rank: int, world_size: int) -> torch.device:
    """Seed and threads of the learner's process (the workers inherit them), and the learner's device."""
    torch.manual_seed(args.seed)
    torch.backends.cudnn.deterministic = args.torch_deterministic
    # the learner gets the cores the workers leave: intra-op threads beyond the free cores spin and slow its update
    torch.set_num_threads(args.torch_threads or max(1, (os.cpu_count() or 1) - args.num_executors - args.num_actors))
    fixed_mmap_threshold()  # inherited by the workers
    return torch.device("cuda" if args.cuda and torch.cuda.is_available() else "cpu")


def saved_model(eval_args: Args, settings: dict, state_dict: dict) -> nn.Module:
    model = make_model(*env_spaces(eval_args), settings["network"])
    model.load_state_dict(state_dict)
    return model


def evaluate(model: nn.Module, args: Args, video_dir: Path, device: torch.device) -> Iterator[float]:
    """Play `eval_episodes` full games with the final (or --eval-only's saved) policy, unclipped returns; sampled
    actions (seeded), argmax ones with --eval-greedy; videos to `video_dir` with --capture-video."""
    env = make_env(args.env_id, args.seed + 10_000, protocol=args.atari_protocol, capture_video=args.capture_video,
                   video_dir=str(video_dir))  # fmt: skip
    generator = torch.Generator().manual_seed(args.seed)
    played = 0
    obs, _ = env.reset()
    while played < args.eval_episodes:
        with torch.no_grad():
            logits, _ = model(torch.as_tensor(np.asarray(obs)).unsqueeze(0).to(device))
        uniforms = torch.rand(1, generator=generator)
        action = logits.argmax(dim=1) if args.eval_greedy else sample_actions_from_uniforms(logits.cpu(), uniforms)
        obs, _, terminated, truncated, info = env.step(int(action.item()))
        if terminated or truncated:
            played += 1
            yield float(info["episode"]["r"])
            if played < args.eval_episodes:  # no reset after the last game: it would record an empty video
                obs, _ = env.reset()
    env.close()


def write_checkpoint(learner: Learner, run: Run) -> None:
    """Write everything needed to continue the run (atomically); executors reseed per collection."""
    atomic_save({"model": learner.target.state_dict(), "optimizer": learner.optimizer.state_dict(),
                 "global_step": learner.global_step, "update": learner.update, "rng": {"torch": torch.get_rng_state()},
                 "args": asdict(run.args), "meta": run.meta}, run.checkpoint_path)  # fmt: skip


def stop_workers(workers: Workers, graceful: bool) -> None:
    """After a clean finish the workers are idle: the sentinels they wait for end them (SIGKILL after 3 s). After a
    signal or a failure they are killed at once: the learner holds all of the run's state, and a sentinel could wait
    forever on a queue's lock that a killed worker held."""
    if graceful:
        for q in workers.commands:
            q.put(None)
        for _ in range(workers.num_actors):
            workers.requests.put(None)
    workers.processes.stop(3.0 if graceful else 0.0)


if __name__ == "__main__":
    main(parse_args(sys.argv[1:]))
