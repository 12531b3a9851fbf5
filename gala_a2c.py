"""GALA-A2C: Gossip-based Actor-Learner Architecture (Assran et al., "Gossip-based Actor-Learner Architectures for
Deep Reinforcement Learning", NeurIPS 2019; Algorithm 1, Propositions 1-2, Table 2, Appendix C), with the paper's
all-reduce A2C baseline in the same file (`--mode allreduce`).

Data flow: `--num-learners` n learner processes (or one per torchrun rank); the main process only logs and watches.
    learner i (Algorithm 1), one loop iteration:
      --num-envs simulators, one batched forward per step on its device -> N = --num-steps steps
      -> n-step returns and one RMSprop step on its own rollout
      -> publish x_i to out-peers i+1..i+k (k = --num-peers; --time-varying rotates the ring offsets each iteration)
      -> once every in-peer has a new message: x_i <- (x_i + sum_j m_j) / (1 + k); a learner blocks for its
         in-peers only after --max-staleness (tau) iterations without mixing
    one machine: learner i's send buffer B_i (Appendix B) is a preallocated row of shared (or CUDA) memory, overwritten
      under its lock with a version number; a newer message replaces an unread one, nothing queues; a blocked
      receiver waits on a Condition. Learners -> main: Record and State messages on `log_q`.
    torchrun: a sender thread `dist.send`s the newest snapshot, one receiver thread per in-peer `dist.recv`s it; every
      --sync-interval iterations the ranks meet in one all-reduce (global step, stop and checkpoint flags, consensus),
      so stops and checkpoints happen there and collectives always match; rank 0 writes charts and checkpoints.
    --mode allreduce: the learners all-reduce their gradients before every step (gloo on localhost, NCCL/gloo under
      torchrun), mathematically one A2C over all simulators.
Policy lag: every update uses the learner's own fresh rollout (on-policy). `charts/policy_lag` (the console's peer_lag)
  is the age of the peer parameters mixed in: this learner's iteration minus the sender's when it published the message
  (mean over the mixed messages; negative when the sender runs ahead). With --max-staleness 0 every iteration mixes,
  and on an n-learner 1-peer ring started fresh the lag stays in [-(n-1), 0]. `--mode allreduce`: 0 (one synchronous
  A2C).
Determinism: `--mode allreduce` keeps all learners bitwise identical; gossip is asynchronous, so which message a
  learner mixes depends on timing, and runs are not reproducible (one learner is).

Examples:
  python gala_a2c.py --env-id ALE/Breakout-v5 --num-learners 4                      # 4 x 16 envs, 1-peer ring
  python gala_a2c.py --env-id ALE/Breakout-v5 --num-learners 4 --mode allreduce     # the A2C baseline
  torchrun --nnodes 2 --node-rank $NODE_RANK --nproc-per-node 4 --rdzv-backend c10d \\
      --rdzv-endpoint $HEAD_NODE:29500 gala_a2c.py --env-id ALE/Breakout-v5         # 8 learners on two machines
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
import ctypes
import datetime
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
import signal
import socket
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, fields, replace
from multiprocessing.queues import Queue
from multiprocessing.sharedctypes import SynchronizedArray
from multiprocessing.synchronize import Condition, Lock
from pathlib import Path
from typing import Literal, NamedTuple, NoReturn

import gymnasium as gym
import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import tyro
from torch import nn

from common.atari import EnvError, check_video, finished_episodes, make_env, make_vector_env
from common.models import make_model

# ---- Args ----------------------------------------------------------------------------------------------------------


@dataclass
class Args:
    exp_name: str = Path(__file__).stem
    """name of this experiment (part of the run directory)"""
    seed: int = 1
    """seed of the experiment"""
    torch_deterministic: bool = True
    """use deterministic torch algorithms"""
    cuda: bool = True
    """use a GPU for the learners when one is present (they share it)"""
    env_id: str = "ALE/Breakout-v5"
    """gymnasium id; ALE ids run in ale-py's C++ vector env"""
    atari_protocol: Literal["deepmind", "machado"] = "deepmind"
    """ALE preprocessing: `deepmind` (the GALA paper's Table 2 setting) or `machado`"""
    total_timesteps: int = 10_000_000
    """agent steps summed over all envs of all learners"""
    log_dir: str = "runs"
    """where run directories go"""
    save_model: bool = False
    """write the final model (the average of the learners' parameters) to {run_dir}/model.pt"""
    checkpoint_interval: float = 600.0
    """seconds between checkpoints to {run_dir}/checkpoint.pt, also written at the end and at Ctrl+C (0 = none)"""
    resume: str | None = None
    """path of a checkpoint.pt to continue from (same run directory and step count)"""
    eval_episodes: int = 0
    """episodes to evaluate the final (averaged) policy on (logged as eval/episodic_return)"""
    eval_greedy: bool = True
    """evaluate with argmax actions (GALA Table 1's protocol); `--no-eval-greedy` samples from the policy instead"""
    eval_only: str | None = None
    """evaluate a model.pt or checkpoint.pt of this script instead of training (env, protocol and network from its run's
    args.json or checkpoint; --eval-episodes 0 plays 10 episodes)"""
    capture_video: bool = False
    """record videos of the evaluation episodes to {run_dir}/videos (--eval-only: {model dir}/videos-eval-{time})"""
    track: bool = False
    """log to Weights & Biases (TensorBoard synced, Args as config, videos uploaded; needs pip install -e ".[track]")"""
    wandb_project_name: str = "actorlearners"
    """Weights & Biases project of --track"""
    wandb_entity: str | None = None
    """Weights & Biases entity (team or user) of --track; None: your default entity"""
    network: Literal["auto", "nature", "impala", "mlp"] = "auto"
    """`nature` (GALA Appendix C.2), `impala`, `mlp`, or `auto` (nature for frames, mlp for flat observations)"""

    mode: Literal["gossip", "allreduce"] = "gossip"
    """`gossip` (GALA-A2C) or `allreduce` (the paper's A2C baseline: gradients averaged before every step)"""
    num_learners: int = 4
    """A2C agents, one process each (Appendix C: 4 learners x 16 envs = 64 simulators); torchrun: one per rank"""
    num_peers: int = 1
    """out-peers (= in-peers) of each learner in the directed ring (Appendix C: 1-peer ring)"""
    time_varying: bool = False
    """rotate each learner's peers through the ring every iteration (gossip on one machine, with fewer peers than the
    other learners)"""
    max_staleness: int = 10
    """tau: local iterations a learner may run without mixing before it blocks for its in-peers (the paper gives no
    value; GALA's code defaults to 0, always wait, and its README runs 1e8)"""
    sync_interval: int = 20
    """iterations between consensus-distance measurements (and, under torchrun, the ranks' stop/checkpoint meeting)"""
    num_envs: int = 16
    """simulators per learner, stepped together with batched inference (Table 2: B = 16)"""
    env_threads: int = 0
    """ale-py stepping threads per learner (0 = the machine's cores / learners)"""
    torch_threads: int = 0
    """torch intra-op threads per learner (0 = the machine's cores / learners)"""
    # GALA Table 2 (A2C, GALA-A2C and A3C)
    num_steps: int = 5
    """horizon N: steps per env between updates"""
    learning_rate: float = 7e-4
    """base learning rate alpha (Table 2)"""
    scale_lr: bool = True
    """multiply the learning rate by sqrt(number of learners) (Table 2's learning-rate scaling)"""
    anneal_lr: bool = False
    """linearly anneal the learning rate to 0 over the run (Table 2 lists no schedule)"""
    rmsprop_alpha: float = 0.99
    """RMSprop smoothing constant (momentum 0, Table 2)"""
    rmsprop_eps: float = 1e-5
    """RMSprop epsilon, added outside the square root as in torch.optim.RMSprop; 1e-5 is the default of GALA's released
    code (gala/arguments.py), not Table 2's 0.01"""
    max_grad_norm: float = 0.5
    """clip the global gradient norm (Table 2)"""
    ent_coef: float = 0.01
    """entropy bonus coefficient (Table 2)"""
    vf_coef: float = 0.5
    """value loss coefficient (Table 2)"""
    gamma: float = 0.99
    """discount factor (Table 2)"""
    log_frequency: int = 10
    """iterations per learner record sent to TensorBoard (losses and timings averaged over them); under torchrun a
    record is written at every sync point instead"""
    log_interval: float = 10.0
    """seconds between console lines"""
    rank_timeout: float = 120.0
    """torchrun: seconds a rank waits for the others at an all-reduce (or for an in-peer's gossip message) before it
    stops the run, naming the rank that did not join (stopped, hung, or out of step)"""


# ---- Algorithm -----------------------------------------------------------------------------------------------------


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


def sample_actions(logits: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Gumbel-max sampling from a seeded generator (thread-safe, reproducible): [B, A] logits -> [B] actions."""
    u = torch.rand(logits.shape, generator=generator, device=logits.device).clamp_(min=1e-20)
    return torch.argmax(logits - torch.log(-torch.log(u)), dim=1)


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


def make_optimizer(params: list[torch.Tensor], lr: float, args: Args) -> torch.optim.Optimizer:
    """RMSprop without momentum (Table 2), eps outside the square root."""
    return torch.optim.RMSprop(params, lr=lr, alpha=args.rmsprop_alpha, eps=args.rmsprop_eps)


def peer_offsets(n: int, num_peers: int, iteration: int = 0, time_varying: bool = False) -> list[int]:
    """Ring offsets s: learner i sends to (i + s) % n and receives from (i - s) % n. Static: 1..k; time-varying: k
    consecutive offsets out of 1..n-1, shifted by k every iteration (every learner uses the same offsets, so each has
    k in-peers and k out-peers and the mixing matrix stays doubly stochastic)."""
    if not time_varying:
        return [1 + j for j in range(num_peers)]
    return [1 + (iteration * num_peers + j) % (n - 1) for j in range(num_peers)]


def mixing_matrix(n: int, offsets: list[int]) -> torch.Tensor:
    """P [n, n] with p_ij = 1 / (1 + |N_in(i)|) for j = i and j in N_in(i) (Algorithm 1, footnote 1)."""
    P = torch.zeros(n, n, dtype=torch.float64)
    weight = 1.0 / (1 + len(offsets))
    for i in range(n):
        P[i, i] = weight
        for s in offsets:
            P[i, (i - s) % n] += weight
    return P


def gossip_mix_(x: torch.Tensor, messages: list[torch.Tensor]) -> torch.Tensor:
    """Algorithm 1, line 7, in place: x <- (x + sum_j m_j) / (1 + |N_in|)."""
    for m in messages:
        x.add_(m)
    return x.div_(1 + len(messages))


def average_model(states: list[dict]) -> dict:
    """x_bar: the learners' average parameters, the model a run saves and evaluates (in allreduce mode identical to
    each learner's)."""
    return {k: sum(s["model"][k].double() for s in states).div(len(states)).to(v.dtype)
            for k, v in states[0]["model"].items()}  # fmt: skip


def epsilon_ball_radius(P: torch.Tensor, alpha: float, L: float, tau: int = 0, B: int = 0) -> float:
    """Proposition 2's radius alpha * beta~ * L / (1 - beta), beta~ = beta^(-(tau+B)/(tau+B+1)).

    beta is the largest singular value of P restricted to the subspace orthogonal to the consensus direction 1
    (P' with Q P = P' Q, Appendix B), computed here for one doubly-stochastic mixing matrix, i.e. a static topology
    without message delay (tau = B = 0); the bound is on ||X - X_bar|| (Frobenius) with L >= ||G|| per iteration.
    """
    n = P.shape[0]
    basis = torch.linalg.qr(torch.cat([torch.ones(n, 1, dtype=P.dtype), torch.eye(n, dtype=P.dtype)[:, : n - 1]], 1))
    Q = basis.Q[:, 1:].T  # [n-1, n], orthonormal rows orthogonal to 1
    beta = torch.linalg.matrix_norm(Q @ P @ Q.T, ord=2).item()
    if beta >= 1:
        return math.inf
    return alpha * beta ** (-(tau + B) / (tau + B + 1)) * L / (1 - beta)


def flatten_into(flat: torch.Tensor, tensors: list[torch.Tensor]) -> torch.Tensor:
    """Copy tensors into a preallocated flat buffer, in logical (NCHW) order whatever their memory format."""
    offset = 0
    for t in tensors:
        flat[offset : offset + t.numel()].view(t.shape).copy_(t.detach())
        offset += t.numel()
    return flat


def unflatten_into(tensors: list[torch.Tensor], flat: torch.Tensor) -> None:
    """Inverse of `flatten_into`, in place, so each tensor keeps its device and memory format."""
    offset = 0
    with torch.no_grad():
        for t in tensors:
            t.copy_(flat[offset : offset + t.numel()].view(t.shape))
            offset += t.numel()


# ---- Storage and messages ------------------------------------------------------------------------------------------


class Record(NamedTuple):
    """A learner's summary of its iterations since its previous record (-> the main process, or rank 0's charts)."""

    learner: int
    steps: int  # agent steps of these iterations (under torchrun: summed over the ranks before logging)
    sps: float  # this learner's agent steps per second since it started
    episodes: list[tuple[float, int]]  # (true return, length) of each episode finished
    # tag -> its mean over the iterations: losses/, timing/, gossip/ (Learner.iterate), charts/learning_rate (now),
    # charts/policy_lag (over the messages mixed in, if any), gossip/consensus_distance (if measured)
    scalars: dict[str, float]


class State(NamedTuple):
    """A learner's state for checkpoint request `request`, or (request 0) its final one (learner -> main process). It
    crosses the queue as bytes: a queued tensor would be shared through a file descriptor that dies with the learner
    process, which may exit before the main process reads it."""

    learner: int
    request: int
    data: bytes  # Learner.state(), torch.save'd


def state_to_bytes(state: dict) -> bytes:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


class Mix(NamedTuple):
    """What one gossip step did: mixed or not, seconds blocked for in-peers, and the age of each message mixed in
    (this learner's iteration minus the sender's when it published it: `charts/policy_lag`)."""

    mixed: bool
    waited: float
    lags: tuple[int, ...] = ()


class GossipEndpoint:
    """Algorithm 1, lines 5-8, for one learner: publish without blocking, mix once every in-peer has a new message,
    block only when more than tau iterations passed without mixing. Subclasses move the messages."""

    def __init__(self, learner: int, n: int, num_peers: int, time_varying: bool, tau: int, cond):
        self.learner, self.n, self.num_peers, self.time_varying, self.tau = learner, n, num_peers, time_varying, tau
        self.staleness = 0  # local iterations since the last mix
        self.cond = cond  # notified whenever a message arrives: a blocked learner waits on it, without polling

    def in_peers(self, iteration: int) -> list[int]:
        return [(self.learner - s) % self.n for s in peer_offsets(self.n, self.num_peers, iteration, self.time_varying)]

    def step(self, x: torch.Tensor, iteration: int, at_sync: bool = False) -> Mix:
        """Gossip after local update `iteration` on the flat parameters `x` (mixed in place); `at_sync`: a sync point
        follows (where torchrun ranks meet)."""
        self.publish(x, iteration, at_sync)
        peers = self.in_peers(iteration)
        waited = 0.0
        if not self.ready(peers) and self.staleness >= self.tau and not self.any_silent(peers):
            start = time.perf_counter()
            self.wait_ready(peers)
            waited = time.perf_counter() - start
        if not self.ready(peers):  # fewer than tau iterations without mixing, or an in-peer will send nothing new
            self.staleness += 1
            return Mix(False, waited)
        messages, stamps = self.take(peers)
        gossip_mix_(x, messages)
        self.staleness = 0
        return Mix(True, waited, tuple(iteration - s for s in stamps))

    def wait_ready(self, peers: list[int]) -> None:
        with self.cond:
            while not self.ready(peers) and not self.any_silent(peers):
                self.check()
                self.cond.wait(timeout=1.0)


def num_params(run: Run) -> int:
    """The length of the flat parameter vector x_i: a gossip message."""
    return sum(p.numel() for p in make_model(*run.spaces, run.args.network).parameters())


class SharedMemoryGossip:
    """Preallocated broadcast buffers, one per learner, in shared memory (or CUDA memory); made by the main process
    before the learners start. Learner i's view of them is a SharedMemoryEndpoint."""

    def __init__(self, ctx, n: int, numel: int, device: torch.device):
        self.n, self.numel, self.device = n, numel, device
        self.buffers = torch.zeros(n, numel, device=device)  # [n, P] the newest message of each learner
        if device.type == "cpu":
            self.buffers.share_memory_()
        self.versions: SynchronizedArray = ctx.Array("q", n, lock=False)  # messages published so far, per learner
        self.stamps: SynchronizedArray = ctx.Array("q", n, lock=False)  # the iteration each newest message left at
        self.finished: SynchronizedArray = ctx.Array("b", n, lock=False)  # learner ended its run (no more messages)
        self.locks: list[Lock] = [ctx.Lock() for _ in range(n)]  # no torn reads: copies hold the buffer's lock
        self.arrived: Condition = ctx.Condition()  # notified on every publish: blocked receivers wake without polling


class SharedMemoryEndpoint(GossipEndpoint):
    def __init__(self, shared: SharedMemoryGossip, learner: int, num_peers: int, time_varying: bool, tau: int, stop):
        super().__init__(learner, shared.n, num_peers, time_varying, tau, shared.arrived)
        self.shared, self.stop = shared, stop  # stop: the run's StopFlag
        self.last_read = [0] * shared.n  # version of each learner's message this learner mixed last
        self.inbox = torch.zeros(num_peers, shared.numel, device=shared.device)  # allocated once

    def _sync(self) -> None:
        if self.shared.device.type == "cuda":  # another process reads the buffer: the copy must have landed
            torch.cuda.current_stream(self.shared.device).synchronize()

    def publish(self, x: torch.Tensor, iteration: int, at_sync: bool = False) -> None:  # no sync points on one machine
        s, i = self.shared, self.learner
        with s.locks[i]:
            s.buffers[i].copy_(x)
            self._sync()
            s.stamps[i] = iteration
            s.versions[i] += 1
        with self.cond:
            self.cond.notify_all()

    def ready(self, peers: list[int]) -> bool:
        return all(self.shared.versions[j] > self.last_read[j] for j in peers)

    def any_silent(self, peers: list[int]) -> bool:
        """An in-peer will send nothing new: it finished its run."""
        return any(self.shared.finished[j] for j in peers)

    def check(self) -> None:
        if self.stop.is_set():  # the run stops while this learner waits for its in-peers
            raise Stop

    def take(self, peers: list[int]) -> tuple[list[torch.Tensor], list[int]]:
        s, stamps = self.shared, []
        for k, j in enumerate(peers):
            with s.locks[j]:
                self.inbox[k].copy_(s.buffers[j])
                self._sync()
                self.last_read[j] = s.versions[j]
                stamps.append(s.stamps[j])
        return list(self.inbox[: len(peers)]), stamps

    def average(self, x: torch.Tensor, link: LocalLink) -> torch.Tensor:
        """The learners' average, with this learner's current parameters and the others' newest messages."""
        s, total = self.shared, x.clone()
        for j in range(self.n):
            if j != self.learner:
                with s.locks[j]:
                    total.add_(s.buffers[j])
        return total.div_(self.n)

    def finish(self, x: torch.Tensor, iteration: int) -> None:
        self.publish(x, iteration)
        self.shared.finished[self.learner] = 1
        with self.cond:
            self.cond.notify_all()


@dataclass
class Shared:
    """What the main process shares with its learner processes (single-machine launch)."""

    log_q: Queue  # Record and State: learners -> main process
    error_q: Queue  # the error line of a learner that fails
    stop: StopFlag  # set by the main process: the run is stopping
    # incremented by the main process every --checkpoint-interval seconds; no lock: main is the only writer, and a
    # learner killed while it held the lock to read would block main's next increment forever
    checkpoint_requests: ctypes.c_int64
    gossip: SharedMemoryGossip | None  # gossip mode: the send buffers
    port: int  # allreduce mode: the gloo rendezvous port on localhost


@dataclass
class Stats:
    """One learner's iterations since its previous Record."""

    iterations: int = 0
    scalars: dict[str, list[float]] = field(default_factory=dict)  # tag -> its value at each iteration
    episodes: list[tuple[float, int]] = field(default_factory=list)


# ---- Learner -------------------------------------------------------------------------------------------------------


class Learner:
    """Algorithm 1 for agent v_i: its simulators, model, optimizer and rollout storage, and its loop (`train`)."""

    def __init__(self, index: int, n: int, args: Args, device: torch.device, state: dict | None):
        cores = max(1, (os.cpu_count() or 1) // n)  # the machine's share of this learner
        torch.set_num_threads(args.torch_threads or cores)
        torch.use_deterministic_algorithms(args.torch_deterministic, warn_only=True)
        self.index, self.n, self.args = index, n, args
        E, T = args.num_envs, args.num_steps
        self.num_iterations = args.total_timesteps // (n * E * T)
        self.iteration = self.start_iteration = state["iteration"] if state else 0
        seed = args.seed + 10_000 * index + self.start_iteration  # distinct per learner; fresh episodes after --resume
        self.envs = make_vector_env(
            args.env_id, E, seed, protocol=args.atari_protocol, num_threads=args.env_threads or cores
        )
        obs_space = self.envs.single_observation_space
        self.obs_shape = obs_space.shape
        torch.manual_seed(args.seed)  # identical initial parameters on every learner
        self.model = make_model(obs_space, self.envs.single_action_space, args.network).to(device)
        self.params = list(self.model.parameters())
        self.lr0 = self.lr = args.learning_rate * (math.sqrt(n) if args.scale_lr else 1.0)
        self.optimizer = make_optimizer(self.params, self.lr0, args)
        self.generator = torch.Generator(device=device).manual_seed(args.seed * 104729 + index)
        if state:
            self.model.load_state_dict(state["model"])
            if "optimizer" in state:  # absent for a learner killed at the stop (Monitor.final_states) or a stand-in
                self.optimizer.load_state_dict(state["optimizer"])
            if "generator" in state:  # absent where another learner's state stands in (RankLink.stand_in_states)
                self.generator.set_state(state["generator"])
        numel = sum(p.numel() for p in self.params)
        self.x = torch.zeros(numel, device=device)  # flat parameters, mixed in place
        self.flat_grad = torch.zeros(numel, device=device)  # allreduce: the gradients, averaged in one call
        obs_dtype = torch.uint8 if obs_space.dtype == np.uint8 else torch.float32
        self.obs = torch.zeros((T + 1, E, *self.obs_shape), dtype=obs_dtype, device=device)  # [T+1, E, ...]
        self.actions = torch.zeros((T, E), dtype=torch.long, device=device)
        self.rewards, self.dones = torch.zeros((T, E), device=device), torch.zeros((T, E), device=device)
        self.obs[0].copy_(torch.from_numpy(self.envs.reset()[0]))
        self.stats, self.start_time = Stats(), time.time()

    def rollout(self) -> None:
        """Algorithm 1, line 2: N steps of every simulator, actions sampled from the current policy."""
        for t in range(self.args.num_steps):
            with torch.inference_mode():
                logits, _ = self.model(self.obs[t])
                self.actions[t] = sample_actions(logits, self.generator)
            next_obs, reward, terminated, truncated, info = self.envs.step(self.actions[t].cpu().numpy())
            self.obs[t + 1].copy_(torch.from_numpy(next_obs), non_blocking=True)
            self.rewards[t].copy_(torch.from_numpy(reward))
            self.dones[t].copy_(torch.from_numpy(terminated | truncated))
            self.stats.episodes += finished_episodes(info)

    def backward(self) -> dict[str, torch.Tensor]:
        """Lines 3-4 up to the gradient: n-step returns and the A2C loss from one batched forward pass over the T x E
        observations and the E bootstrap ones."""
        E, T = self.args.num_envs, self.args.num_steps
        logits, values = self.model(self.obs.reshape(-1, *self.obs_shape))
        values = values.reshape(T + 1, E)
        returns = n_step_returns(self.rewards, self.dones, values[T].detach(), self.args.gamma)
        loss = a2c_loss(
            logits[: T * E], values[:T].reshape(-1), self.actions.reshape(-1), returns.reshape(-1), self.args.vf_coef,
            self.args.ent_coef,
        )  # fmt: skip
        if not torch.isfinite(loss["total_loss"]):
            raise NonFiniteLoss(f"non-finite loss {loss['total_loss'].item()} at iteration {self.iteration + 1}")
        self.optimizer.zero_grad(set_to_none=False)
        loss["total_loss"].backward()
        return loss

    def average_gradients(self, link: LocalLink | RankLink) -> None:
        """The A2C baseline: every learner steps with the mean of all learners' gradients."""
        grads = [p.grad for p in self.params]
        flatten_into(self.flat_grad, grads)
        link.all_reduce(self.flat_grad, f"the gradient all-reduce of iteration {self.iteration + 1}")
        unflatten_into(grads, self.flat_grad.div_(self.n))

    def optimizer_step(self) -> torch.Tensor:
        grad_norm = nn.utils.clip_grad_norm_(self.params, self.args.max_grad_norm)
        if self.args.anneal_lr:
            self.lr = self.lr0 * (1.0 - self.iteration / self.num_iterations)
            for group in self.optimizer.param_groups:
                group["lr"] = self.lr
        self.optimizer.step()
        self.obs[0].copy_(self.obs[-1])
        return grad_norm

    def flat_params(self) -> torch.Tensor:
        return flatten_into(self.x, self.params)

    def train(self, gossip: GossipEndpoint | None, link: LocalLink | RankLink) -> dict:
        """Algorithm 1 up to this learner's share of --total-timesteps (or until the run stops): each iteration a
        rollout, an update, and (gossip) lines 5-8; its numbers go to `stats`. Returns the learner's final state."""
        while self.iteration < self.num_iterations:
            at_sync = (self.iteration + 1) % self.args.sync_interval == 0 or self.iteration + 1 == self.num_iterations
            timing: dict[str, float] = {}  # seconds in each part of the iteration
            with timed(timing, "rollout"):  # the simulators and the actions (Algorithm 1, line 2)
                self.rollout()
            with timed(timing, "train"):  # the forward and backward passes, and (below) the optimizer step
                loss = self.backward()
            with timed(timing, "allreduce"):  # averaging the gradients
                if self.args.mode == "allreduce":
                    self.average_gradients(link)
            with timed(timing, "train"):
                loss["grad_norm"] = self.optimizer_step()
            mix = Mix(False, 0.0, lags=(0,))  # allreduce: every update is of the policy that acted
            with timed(timing, "gossip"):  # publishing and mixing, less the wait for in-peers (gossip_wait)
                if gossip is not None:
                    try:
                        mix = gossip.step(self.flat_params(), self.iteration, at_sync)
                    except Stop:  # stopped while blocked for in-peers: this update stands, the link says stop
                        mix = Mix(False, 0.0)
                    if mix.mixed:
                        unflatten_into(self.params, self.x)
            self.iteration += 1
            self.note(loss, timing, mix, gossip)
            if gossip is not None and at_sync:  # ||x_i - x_bar||: how far gossip keeps this learner from it (Prop. 2)
                x = self.flat_params()
                distance = torch.linalg.vector_norm(x.double() - gossip.average(x, link).double()).item()
                self.stats.scalars["gossip/consensus_distance"] = [distance]
            if link.after_iteration(self, at_sync):
                break
        if self.stats.iterations:  # iterations not reported yet (under torchrun the loop ends at a sync point: none)
            link.report(self.record(), None)
        if gossip is not None:
            gossip.finish(self.flat_params(), self.iteration - 1)
        return self.state()

    def note(self, loss: dict[str, torch.Tensor], timing: dict[str, float], mix: Mix, gossip: GossipEndpoint | None):
        """One iteration's numbers into `stats`: its losses, the seconds of its parts, and what its gossip step did."""
        names = ("policy_loss", "value_loss", "entropy", "total_loss", "grad_norm")
        policy, value, entropy, total, grad_norm = torch.stack([loss[k].detach() for k in names]).tolist()  # one sync
        values = {"losses/policy_loss": policy, "losses/value_loss": value, "losses/entropy": entropy,
                  "losses/total_loss": total, "losses/grad_norm": grad_norm, "timing/rollout": timing["rollout"],
                  "timing/train": timing["train"], "timing/allreduce": timing["allreduce"],
                  "timing/gossip": timing["gossip"] - mix.waited, "timing/gossip_wait": mix.waited,
                  "timing/iteration": sum(timing.values())}  # fmt: skip
        if gossip is not None:  # staleness: iterations since the last mix
            values |= {"gossip/staleness": gossip.staleness, "gossip/mix_rate": float(mix.mixed)}
        self.stats.iterations += 1
        for tag, value in values.items():
            self.stats.scalars.setdefault(tag, []).append(value)
        if mix.lags:  # the age of each message mixed in
            self.stats.scalars.setdefault("charts/policy_lag", []).extend(mix.lags)

    def record(self) -> Record:
        """The Record of the iterations since the previous one; the stats start over."""
        s, self.stats = self.stats, Stats()
        E, T = self.args.num_envs, self.args.num_steps
        scalars = {tag: float(np.mean(values)) for tag, values in s.scalars.items()} | {"charts/learning_rate": self.lr}
        if "gossip/staleness" in scalars:
            scalars["gossip/share_of_iteration"] = scalars["timing/gossip"] / max(1e-12, scalars["timing/iteration"])
        sps = (self.iteration - self.start_iteration) * E * T / max(1e-9, time.time() - self.start_time)
        return Record(learner=self.index, steps=s.iterations * E * T, sps=sps, episodes=s.episodes, scalars=scalars)

    def state(self) -> dict:
        return dict(
            model={k: v.cpu() for k, v in self.model.state_dict().items()},
            optimizer=self.optimizer.state_dict(),
            generator=self.generator.get_state(),
            iteration=self.iteration,
        )


class LocalLink:
    """A learner's link to the main process of the single-machine launch: records and states go on `log_q`; stop and
    checkpoint requests come from it. Allreduce learners agree on both with an all-reduce every iteration, so all of
    them stop, and save, at the same iteration; gossip learners act on them on their own."""

    def __init__(self, args: Args, shared: Shared):
        self.args, self.shared, self.last_request = args, shared, 0

    def after_iteration(self, learner: Learner, at_sync: bool) -> bool:
        """Report every --log-frequency iterations, at a consensus measurement or checkpoint request; True: stop."""
        stop, request = self.shared.stop.is_set(), self.shared.checkpoint_requests.value
        if self.args.mode == "allreduce":
            agreed = torch.tensor([float(stop), float(request)])
            dist.all_reduce(agreed, op=dist.ReduceOp.MAX)
            stop, request = agreed[0].item() > 0, int(agreed[1].item())
        checkpoint, self.last_request = request > self.last_request, request
        stats = learner.stats
        if checkpoint or stats.iterations >= self.args.log_frequency or "gossip/consensus_distance" in stats.scalars:
            self.report(learner.record(), learner.state() if checkpoint else None)
        return stop

    def all_reduce(self, tensor: torch.Tensor, what: str) -> None:
        """The sum over the learners' `tensor`, in place (the learner processes of one machine share their fate)."""
        dist.all_reduce(tensor)

    def report(self, record: Record, state: dict | None) -> None:
        self.shared.log_q.put(record)
        if state is not None:
            self.shared.log_q.put(State(record.learner, self.last_request, state_to_bytes(state)))


def learner_process(index: int, n: int, args: Args, device_name: str, shared: Shared, state: dict | None) -> None:
    """A learner of the single-machine launch (worker_body runs it, under child_main), from `state` (--resume) or
    afresh: its records and states go to the main process, its error line (worker_body's) too."""
    gossip = None
    if args.mode == "allreduce":
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{shared.port}", rank=index, world_size=n)
    else:
        ring = (args.num_peers, args.time_varying, args.max_staleness)
        gossip = SharedMemoryEndpoint(shared.gossip, index, *ring, shared.stop)
    learner = Learner(index, n, args, torch.device(device_name), state)
    try:
        final = learner.train(gossip, LocalLink(args, shared))
    finally:
        learner.envs.close()
    shared.log_q.put(State(index, 0, state_to_bytes(final)))
    if args.mode == "allreduce":
        dist.destroy_process_group()


# ---- Main ----------------------------------------------------------------------------------------------------------


def main(args: Args) -> None:
    # one thread here: an OpenMP pool started in this process would deadlock the forked learners' first torch op
    torch.set_num_threads(1)
    if (run := open_run(args)) is None:  # resume, validation, run directory, args.json, device
        return  # --eval-only played the saved agent
    if run.world_size > 1:
        return main_distributed(run)  # torchrun: one learner per rank (below)
    args, n, device = run.args, run.args.num_learners, run.device
    ctx = mp.get_context("spawn" if device.type == "cuda" else "fork")  # CUDA cannot be used in forked children
    gossip = SharedMemoryGossip(ctx, n, num_params(run), device) if args.mode == "gossip" else None  # the B_i
    shared = Shared(log_q=ctx.Queue(), error_q=ctx.Queue(), stop=StopFlag(ctx), checkpoint_requests=ctx.Value("q", 0,
                    lock=False), gossip=gossip, port=free_port() if args.mode == "allreduce" else 0)  # fmt: skip
    signals, learners, monitor = run.stop_on_signals(shared.stop), Processes(ctx), Monitor(run, shared)
    states = run.checkpoint["learners"] if run.checkpoint else [None] * n
    for i in range(n):  # Algorithm 1: agent v_i in a process of its own
        learners.start(f"learner {i}", worker_body, learner_process, shared.error_q, i, n, args, str(device), shared,
                       states[i])  # fmt: skip
    # this process only watches: the learners' Records go to TensorBoard and the console, their States to checkpoints
    with run.training(monitor.logger.roles, lambda: monitor.logger.global_step, lambda _: monitor.stop(learners),
                      checkpoint=monitor.checkpoint, final_model=lambda: averaged_model(run, monitor.latest),
                      last_point=lambda: monitor.logger.maybe_print(force=True), who="the main process",
                      window=20) as record:  # fmt: skip
        monitor.logger.start(record)
        while len(monitor.finals) < n:  # each learner sends its final State once it has done its share of the budget
            monitor.drain(0.25)
            monitor.logger.maybe_print()
            if failure := monitor.write_failure or worker_failure(learners, shared.error_q):
                raise Stop(failure)
            if signals.signum:  # the learners stop first, so that the error line counts their last steps
                monitor.stop(learners)
                raise Stop
            run.checkpoint_if_due()  # asks every learner for its State (written once all have answered)


# ---- Multi-node (torchrun): one learner per rank, gossip over point-to-point messages --------------------------------


def main_distributed(run: Run) -> None:
    """One torchrun rank = one learner; the ranks gossip through DistributedEndpoint and meet every --sync-interval
    iterations (RankLink). Rank 0 also writes the run's charts and checkpoints, every other rank its own charts in
    {run_dir}/learner{rank}."""
    args, n, rank, device = run.args, run.world_size, run.rank, run.device
    backend = "nccl" if device.type == "cuda" else "gloo"
    # collectives fail after a bounded wait for a peer (gloo's default: 30 min); RankLink's own wait names it first
    timeout = datetime.timedelta(seconds=args.rank_timeout + 30)
    dist.init_process_group(backend, rank=rank, world_size=n, timeout=timeout)
    names = [str(run.run_dir)]
    dist.broadcast_object_list(names, src=0)  # one run directory, named by rank 0
    signals, logger = run.stop_on_signals(threading.Event()), Logger(run, n)
    states = [None] * n if rank == 0 else None  # rank 0 gathers every rank's final state
    link, gossip = RankLink(run, signals.stop, logger), None
    if args.mode == "gossip":
        group = dist.new_group(backend=backend, timeout=timeout)  # every rank, in one order
        ring = (args.num_peers, args.max_staleness, num_params(run), device, group, signals.stop, args.rank_timeout)
        gossip = DistributedEndpoint(rank, n, *ring)
    # rank 0: the final checkpoint, --save-model, --eval-episodes; every rank: its writer, its exit status, without
    # the interpreter's teardown: gloo's transport and worker threads (`gloo_tcp_loop`, `pt_gloo_runloop`) and the
    # gossip receivers inside `dist.recv` may still be alive, and destroying them while joinable aborts the rank
    # ("terminate called without an active exception", SIGABRT) or hangs it
    with run.training(logger.roles, lambda: logger.global_step, lambda _: link.end(),
                      checkpoint=(lambda: write_checkpoint(run, states)) if rank == 0 else None,
                      final_model=(lambda: averaged_model(run, states)) if rank == 0 else None,
                      last_point=lambda: logger.maybe_print(force=True), who=f"learner {rank} (rank {rank})",
                      window=20, teardown=False) as record:  # fmt: skip
        if record is None:  # a rank other than 0: its own charts
            record = Recorder(make_writer(Path(names[0]) / f"learner{rank}", args), None, args, logger.global_step, 20)
        logger.start(record)
        learner = Learner(rank, n, args, device, run.checkpoint["learners"][rank] if run.checkpoint else None)
        try:  # every collective below is waited for as RankLink.wait waits: a stalled peer cannot hold a rank in one
            final = learner.train(gossip, link)
            learner.envs.close()
            gathered = link.gather(final, "the gather of the final states")
            if rank == 0:
                states[:] = gathered
            if rank == 0 and args.mode == "allreduce":  # every learner holds the same parameters (averaged gradients)
                flats = [torch.cat([p.reshape(-1) for p in s["model"].values()]) for s in states]
                divergence = max((flat - flats[0]).abs().max().item() for flat in flats)
                print(f"max |parameter difference| across {n} learners: {divergence:.3g}")
            # no rank leaves the group while a peer may still be sending to it
            link.wait(dist.barrier(async_op=True), "the barrier before the end")
            dist.destroy_process_group()
        except (Stop, RankLost):  # a rank that stalled, or did not join after a signal: its final state is lost
            if rank == 0 and args.checkpoint_interval > 0 and None in states:
                states[:] = link.stand_in_states(learner)
            raise
        if signals.signum:  # the ranks stopped together at a sync point
            raise Stop


class RankLink:
    """One torchrun rank's side of the run: every --sync-interval iterations (and at its last) all ranks meet in the
    same collectives: the stop and checkpoint flags (rank 0's clock decides when a checkpoint is due), the exact global
    step, and rank 0 gathers the states to save."""

    def __init__(self, run: Run, stop: threading.Event, logger: Logger):
        self.run, self.rank, self.device, self.n = run, run.rank, run.device, run.world_size
        self.stop, self.logger = stop, logger
        self.last_checkpoint = time.time()
        self.write_failure: str | None = None

    def after_iteration(self, learner: Learner, at_sync: bool) -> bool:
        """At sync points only (ranks stop together): report, with the state if a checkpoint is due; True: stop."""
        if not at_sync:
            return False
        interval = self.run.args.checkpoint_interval
        due = self.rank == 0 and interval > 0 and time.time() - self.last_checkpoint >= interval
        flags = torch.tensor([float(self.stop.is_set()), float(due)], device=self.device)
        self.all_reduce(flags, f"the sync point of iteration {learner.iteration}")
        self.report(learner.record(), learner.state() if flags[1].item() > 0 else None)
        return flags[0].item() > 0

    def wait(self, work, what: str) -> None:
        """Wait for the collective `work` (issued with async_op=True) in slices: a signal is handled while a peer is
        late, and a peer that does not join within --rank-timeout (stopped, hung, out of step) is named (RankLost). No
        collective of a rank is a blocking call: a peer stalled before it would hold the rank there, deaf to Ctrl+C,
        until the process group's own timeout, and the rank would end without a line naming the peer."""
        wait_for_ranks(work, what, self.stop, self.rank, self.n, self.run.args.rank_timeout)

    def all_reduce(self, tensor: torch.Tensor, what: str) -> None:
        """The sum over the ranks' `tensor`, in place."""
        self.wait(dist.all_reduce(tensor, async_op=True), what)

    def gather(self, state: dict, what: str) -> list[dict] | None:
        """Every rank's `state` on rank 0 (None on the others): torch.save'd bytes, padded to the longest, gathered."""
        data = torch.frombuffer(bytearray(state_to_bytes(state)), dtype=torch.uint8)
        sizes = torch.zeros(self.n, dtype=torch.int64, device=self.device)
        sizes[self.rank] = data.numel()
        self.all_reduce(sizes, what)
        padded = torch.zeros(int(sizes.max().item()), dtype=torch.uint8, device=self.device)
        padded[: data.numel()].copy_(data)
        slots = [torch.empty_like(padded) for _ in range(self.n)] if self.rank == 0 else None
        self.wait(dist.gather(padded, slots, dst=0, async_op=True), what)
        if slots is None:
            return None
        sizes = sizes.tolist()
        return [torch.load(io.BytesIO(slot[: sizes[j]].cpu().numpy().tobytes()), weights_only=False)
                for j, slot in enumerate(slots)]  # fmt: skip

    def report(self, record: Record, state: dict | None) -> None:
        """Every rank calls this at the same sync points (collectives), all with a state (a checkpoint is due) or all
        without."""
        states = None if state is None else self.gather(state, "the gather of the states for a checkpoint")
        total = torch.tensor([float(record.steps)], device=self.device)
        self.all_reduce(total, "the global step's all-reduce")  # exact global step: all ranks' agent steps
        try:
            self.logger.handle(record._replace(steps=int(total.item())))
            if states is not None:  # rank 0's
                self.last_checkpoint = time.time()
                write_checkpoint(self.run, states)
            if self.rank == 0:
                self.logger.maybe_print()
        except (WriteError, OSError) as e:
            self.write_failure = self.write_failure or error_line(e, self.logger.global_step, 0)[1]
        if self.write_failure:
            self.stop.set()  # all ranks stop together at the next sync point

    def stand_in_states(self, learner: Learner) -> list[dict]:
        """The final checkpoint's states where the ranks' final states could not be gathered (a rank stalled, or did
        not join after a signal): this rank's own state, and its parameters in every other rank's place (allreduce:
        with its optimizer state, the same on every rank), at its iteration; a line says which."""
        own = learner.state()
        if self.run.args.mode == "allreduce":
            stand_in = {k: own[k] for k in ("model", "optimizer", "iteration")}
            which, why = "parameters and optimizer state", "allreduce keeps them the same on every rank"
        else:
            stand_in = {k: own[k] for k in ("model", "iteration")}
            which, why = "own parameters", "the other ranks' parameters and optimizer states are lost"
        print(f"warning: the ranks' final states could not be gathered; the final checkpoint holds rank {self.rank}'s "
              f"{which} at its iteration {own['iteration']} for every learner ({why})", file=sys.stderr)  # fmt: skip
        return [own if j == self.rank else stand_in for j in range(self.n)]

    def end(self) -> str | None:
        """Once the learner stopped (the training's `stop`): the own TensorBoard writer of a rank other than 0 closed
        (rank 0's is the run's); the error line of a failed write, if any."""
        if self.rank != 0 and self.logger.record is not None:
            try:
                self.logger.record.writer.close()
            except OSError as e:
                self.write_failure = self.write_failure or write_error(e, f"the TensorBoard events of rank {self.rank}")
        return self.write_failure


# A torchrun gossip message is [P + 2]: the parameters, then a flag and the sender's iteration (exact in float32 below
# 2^24 iterations). Flags: 0 an ordinary message, SENT_AT_SYNC sent right before a sync point (where the sender now
# waits for the other ranks), SENT_LAST the sender's last message (it finished its run).
SENT_AT_SYNC = 1.0
SENT_LAST = 2.0


class DistributedEndpoint(GossipEndpoint):
    """torchrun: a sender thread sends the newest snapshot to every out-peer with blocking `dist.send` (a newer
    snapshot replaces one still waiting), one receiver thread per in-peer `dist.recv`s and keeps only the newest
    message. gloo's isend/irecv handles cannot be polled (`is_completed` stays False until `wait`), so the threads are
    what makes the learner's side non-blocking. The messages travel on a process group of their own (`group`), so
    these threads never issue operations on the communicator that the main thread's sync-point all-reduces use (NCCL
    and gloo expect one thread's order of operations per communicator)."""

    def __init__(self, learner: int, n: int, num_peers: int, tau: int, numel: int, device: torch.device, group,
                 stop: threading.Event, timeout: float):  # fmt: skip
        super().__init__(learner, n, num_peers, False, tau, threading.Condition())
        self.numel, self.device, self.group, self.stop, self.timeout = numel, device, group, stop, timeout
        self.latest = torch.zeros(num_peers, numel, device=device)  # newest message per in-peer, allocated once
        self.stamps = [0] * num_peers
        self.fresh, self.done = [False] * num_peers, [False] * num_peers
        self.parked = [False] * num_peers  # the in-peer's newest message came from a sync point, where it now waits
        self.snapshot, self.pending = torch.zeros(numel + 2, device=device), False
        self.errors: list[str] = []  # tracebacks of the threads, raised in the learner's thread (check)
        loops = {"gossip-send": (self._send_loop,)}
        loops |= {f"gossip-recv-{j}": (self._recv_loop, k, j) for k, j in enumerate(self.in_peers(0))}
        self.threads = [threading.Thread(target=self._guarded, args=a, name=n, daemon=True) for n, a in loops.items()]
        for t in self.threads:
            t.start()

    def _guarded(self, loop, *args) -> None:
        try:
            loop(*args)
        except BaseException:
            self.errors.append(traceback.format_exc())

    def check(self) -> None:
        """No Stop here: ranks stop together, at sync points; a gossip thread's exception is raised here."""
        if self.errors:
            raise RuntimeError(f"gossip thread died:\n{self.errors[0]}")

    def wait_ready(self, peers: list[int]) -> None:
        """Blocked for in-peers past tau: Stop once this rank is asked to stop (iterate goes on without mixing, and
        the ranks agree on the stop at the next sync point); RankLost once an in-peer sent nothing for `timeout` s."""
        start = time.monotonic()
        with self.cond:
            while not self.ready(peers) and not self.any_silent(peers):
                self.check()
                if self.stop.is_set():
                    raise Stop
                if time.monotonic() - start >= self.timeout:
                    late = ", ".join(
                        f"rank {j}" for j, fresh in zip(self.in_peers(0), self.fresh, strict=True) if not fresh
                    )
                    raise RankLost(f"rank {self.learner}: {late} sent no gossip message within {self.timeout:.0f} s "
                                   "(stopped, hung, or out of step)")  # fmt: skip
                self.cond.wait(timeout=1.0)

    def _send_loop(self) -> None:
        out = torch.zeros(self.numel + 2, device=self.device)
        while out[self.numel].item() != SENT_LAST:
            with self.cond:
                while not self.pending:
                    self.cond.wait()
                out.copy_(self.snapshot)
                self.pending = False
            for dst in ((self.learner + s) % self.n for s in peer_offsets(self.n, self.num_peers)):
                dist.send(out, dst=dst, group=self.group)

    def _recv_loop(self, k: int, src: int) -> None:
        buf = torch.zeros(self.numel + 2, device=self.device)
        while not self.done[k]:
            dist.recv(buf, src=src, group=self.group)
            flag, stamp = buf[self.numel :].tolist()
            with self.cond:
                self.latest[k].copy_(buf[: self.numel])
                self.fresh[k], self.stamps[k] = True, int(stamp)
                self.done[k], self.parked[k] = flag == SENT_LAST, flag == SENT_AT_SYNC
                self.cond.notify_all()

    def publish(self, x: torch.Tensor, iteration: int, at_sync: bool = False, last: bool = False) -> None:
        with self.cond:
            self.snapshot[: self.numel].copy_(x)
            self.snapshot[self.numel] = SENT_LAST if last else SENT_AT_SYNC if at_sync else 0.0
            self.snapshot[self.numel + 1] = iteration
            self.pending = True
            self.cond.notify_all()

    def ready(self, peers: list[int]) -> bool:
        return all(self.fresh)

    def any_silent(self, peers: list[int]) -> bool:
        """An in-peer will send nothing new before this learner moves on, and its newest message is read: it finished,
        or it waits at the next sync point for this learner (waiting for it here would deadlock the ranks)."""
        return any((d or p) and not f for d, p, f in zip(self.done, self.parked, self.fresh, strict=True))

    def take(self, peers: list[int]) -> tuple[list[torch.Tensor], list[int]]:
        with self.cond:
            self.fresh = [False] * self.num_peers
            return [m.clone() for m in self.latest], list(self.stamps)

    def average(self, x: torch.Tensor, link: RankLink) -> torch.Tensor:
        """The learners' average (a collective: every rank calls it at the same sync point)."""
        total = x.clone()
        link.all_reduce(total, "the consensus all-reduce")
        return total.div_(self.n)

    def finish(self, x: torch.Tensor, iteration: int) -> None:
        """Send the last message and wait until every in-peer's last one arrived (no send or recv left pending), as a
        collective is waited for (RankLink.wait): a peer that stalled is named, and a stop does not wait on it."""
        self.publish(x, iteration, last=True)
        ended = ThreadsEnd(self.threads, self.check)
        wait_for_ranks(ended, "the exchange of the last gossip messages", self.stop, self.learner, self.n, self.timeout)


class ThreadsEnd(NamedTuple):
    """Threads that end once the peers have done their part, waited for as a collective's work is (wait_for_ranks)."""

    threads: list[threading.Thread]
    check: Callable[[], None]  # raises a thread's error

    def is_completed(self) -> bool:
        return not any(t.is_alive() for t in self.threads)

    def wait(self) -> None:
        self.check()


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


class StopFlag:
    """The stop that main shares with the worker processes: one byte in shared memory, set and read without a lock.
    A multiprocessing Event takes a lock shared by every process even to read it, and its set() waits until every
    process asleep in its wait() wakes: a worker SIGKILLed while it looked, or stopped (SIGSTOP) in a wait, would
    block main's next look or set() forever."""

    def __init__(self, ctx):
        self.flag = ctx.Value("b", 0, lock=False)

    def set(self) -> None:
        self.flag.value = 1

    def is_set(self) -> bool:
        return bool(self.flag.value)


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


# -- torchrun ranks (the scripts that run under torchrun) --


class RankLost(Exception):
    """Under torchrun, a rank that did not join a collective in time or is out of step: the message names it."""

    checkpoint_is_good = True  # the ranks' last whole update is the same on every rank


def wait_for_ranks(work, what: str, stop, rank: int, world_size: int, timeout: float, grace: float = 5.0) -> None:
    """Wait for the collective `work` (issued with async_op=True) by polling it, so that the signal handlers run while
    a peer is late (a blocking wait holds the main thread, and NCCL's timed wait aborts the communicator). Once `stop`
    is set the peers get `grace` seconds more to join (they may bring the stop they agree on), then Stop; a peer that
    does not join within `timeout` seconds (stopped, hung, or out of step) raises RankLost naming it (with two ranks
    it can only be the other one); a collective that failed raises its error (a peer that died)."""
    who = f"rank {1 - rank}" if world_size == 2 else f"a rank other than rank {rank} (of {world_size})"
    start, stopping_since = time.monotonic(), None
    while not work.is_completed():
        time.sleep(0.001)
        now = time.monotonic()
        if stop.is_set():
            stopping_since = stopping_since or now
            if now - stopping_since >= grace:
                print(f"warning: rank {rank}: {who} did not join {what} within {grace:.0f} s of the stop; stopping "
                      "without it", file=sys.stderr, flush=True)  # fmt: skip
                raise Stop
        elif now - start >= timeout:
            raise RankLost(f"rank {rank}: {who} did not join {what} within {timeout:.0f} s (stopped, hung, or out of "
                           "step)")  # fmt: skip
    work.wait()  # the collective's own error, if it failed (a peer that died); on NCCL it orders the stream after it


def watch_launcher() -> None:
    """Under torchrun (its agent started this rank): stop the rank when the launcher is gone. Its ranks run in their
    own sessions, so a launcher killed with kill -9 would leave them training, reparented; the stop's SIGTERM reaches
    the rank's own handler (a graceful stop: the final checkpoint), and a rank still running a few seconds later is
    ended."""
    if "TORCHELASTIC_RUN_ID" in os.environ:
        watch = threading.Thread(target=stop_when_orphaned, args=(os.getppid(),), name="launcher-watch", daemon=True)
        watch.start()


def stop_when_orphaned(launcher: int, grace: float = 8.0) -> None:
    """The launcher watch's thread: once this process's parent is no longer `launcher`, SIGTERM to itself, then exit
    143 after `grace` seconds if it has not stopped by then (a once-a-second check: the thread sleeps between)."""
    while os.getppid() == launcher:
        time.sleep(1.0)
    with contextlib.suppress(OSError):  # nobody may read the launcher's stderr any more
        print(f"error: the torchrun launcher (pid {launcher}) is gone; stopping this rank", file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(grace)
    os._exit(128 + signal.SIGTERM)


# -- script-specific: FLAG_RULES, RUN_SETTINGS, validate, env_spaces, checkpoint_meta, saved_model, evaluate, ... --

FLAG_RULES = (
    (">= 1", ("num_learners", "num_envs", "num_steps", "num_peers", "sync_interval", "log_frequency")),
    ("> 0", ("learning_rate", "max_grad_norm", "rmsprop_eps", "rank_timeout")),
    ("in [0, 1)", ("rmsprop_alpha",)),
    ("in (0, 1]", ("gamma",)),
    (">= 0", ("seed", "max_staleness", "ent_coef", "vf_coef", "checkpoint_interval", "eval_episodes", "log_interval",
              "env_threads", "torch_threads")),
)  # fmt: skip
RENAMED_FLAGS: dict[str, str] = {}  # old flag -> what to say instead
RESUME_FIXED = ("num_envs", "num_steps")  # the rollout storage and the step arithmetic (learners and mode: meta)
RUN_SETTINGS = ("env_id", "atari_protocol", "network")


def validate(args: Args, world_size: int = 1) -> str | None:
    """Every flag checked before anything starts; the error line or None. n: the torchrun ranks, or --num-learners."""
    n, torchrun = world_size if world_size > 1 else args.num_learners, world_size > 1
    if error := check_flags(args):
        return error
    if args.mode == "gossip" and n < 2:
        return f"gossip needs at least 2 learners, got {n} (use --num-learners 2 or more)"
    if args.mode == "gossip" and args.num_peers > n - 1:
        return f"--num-peers ({args.num_peers}) must be at most --num-learners - 1 ({n - 1})"
    if torchrun and args.time_varying:
        return "--time-varying needs the single-machine launch (torchrun ranks use a static ring)"
    if torchrun and args.eval_only:
        return "--eval-only runs in one process: python gala_a2c.py --eval-only PATH, without torchrun"
    if args.resume is not None and not Path(args.resume).is_file():
        return f"--resume {args.resume}: no such checkpoint file"
    if args.eval_only is not None and not Path(args.eval_only).is_file():
        return f"--eval-only {args.eval_only}: no such file"
    if args.time_varying and args.mode == "allreduce":
        return "--time-varying rotates the gossip ring, and --mode allreduce has none: drop --time-varying"
    if args.time_varying and args.num_peers == n - 1:
        return (f"--time-varying rotates the in-peers through the ring, but with --num-peers {args.num_peers} of {n} "
                "learners every learner has all the others as peers and nothing rotates: use more learners or fewer "
                "peers, or drop --time-varying")  # fmt: skip
    if args.total_timesteps < (update := n * args.num_envs * args.num_steps):
        learners = f"{n} torchrun ranks" if torchrun else "--num-learners"
        return (f"--total-timesteps {args.total_timesteps} is below one update, {update} agent steps ({learners} x "
                f"--num-envs x --num-steps): the run would learn nothing; give at least {update}")  # fmt: skip
    if args.capture_video and args.eval_episodes == 0 and args.eval_only is None:
        return "--capture-video records the evaluation episodes; add --eval-episodes N (N >= 1)"
    if args.eval_only is not None:  # env, network and model are the saved run's: main_eval_only checks them
        return None
    try:
        act_space = env_spaces(args)[1]  # an unknown env id: an EnvError that suggests close matches
        if args.capture_video:  # fail now, not at the final evaluation
            check_video(args.env_id, args.atari_protocol)
    except EnvError as e:
        return str(e)
    if not isinstance(act_space, gym.spaces.Discrete):
        return f"{args.env_id} has a {type(act_space).__name__} action space; Discrete only (apex_ddpg.py: continuous)"
    return None


def env_spaces(args: Args) -> tuple[gym.Space, gym.Space]:
    """(observation space, action space) of one env of the training vector env."""
    probe = make_vector_env(args.env_id, 1, args.seed, protocol=args.atari_protocol, num_threads=1)
    probe.close()
    return probe.single_observation_space, probe.single_action_space


def checkpoint_meta(args: Args, obs_space: gym.Space, act_space: gym.spaces.Discrete, world_size: int = 1) -> dict:
    """What a checkpoint must match to be resumed by this run: script, mode, learners, env, Atari protocol, network
    and shapes."""
    network = args.network if args.network != "auto" else ("nature" if len(obs_space.shape) == 3 else "mlp")
    learners = world_size if world_size > 1 else args.num_learners
    return dict(script=Path(__file__).name, algo=args.mode, learners=learners, env_id=args.env_id,
                atari_protocol=args.atari_protocol, network=network, obs_shape=list(obs_space.shape),
                action_shape_or_n=int(act_space.n))  # fmt: skip


def settled_args(args: Args) -> Args:
    """The flags as the run uses them: as given (no default here depends on another flag)."""
    return args


def steps_per_update(args: Args, world_size: int) -> int:
    """Agent steps of one update: one iteration of every learner (each stops at the budget's last whole one)."""
    return (world_size if world_size > 1 else args.num_learners) * args.num_envs * args.num_steps


def init_torch(args: Args, spaces: tuple[gym.Space, gym.Space], rank: int, world_size: int) -> torch.device:
    """The learners' device (torchrun: this rank's GPU, if any, and a watch on the launcher); Learner seeds torch."""
    use_cuda = args.cuda and torch.cuda.is_available()
    if world_size == 1:
        return torch.device("cuda" if use_cuda else "cpu")
    watch_launcher()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    return torch.device(f"cuda:{local_rank % torch.cuda.device_count()}" if use_cuda else "cpu")


def saved_model(args: Args, settings: dict, state_dict: dict) -> nn.Module:
    model = make_model(*env_spaces(args), settings["network"])
    model.load_state_dict(state_dict)
    return model


def evaluate(model: nn.Module, args: Args, video_dir: Path, device: torch.device) -> Iterator[float]:
    """Play `eval_episodes` full games with the final (or --eval-only's saved) policy on `device`, true returns; argmax
    actions with `--eval-greedy` (GALA Table 1), sampled ones otherwise; videos to `video_dir` with --capture-video."""
    env = make_env(args.env_id, args.seed + 1_000_003, protocol=args.atari_protocol, capture_video=args.capture_video,
                   video_dir=str(video_dir))  # fmt: skip
    generator = torch.Generator().manual_seed(args.seed + 1_000_003)
    model, played = model.to(device), 0  # the final model is built (and saved) on the CPU
    obs, _ = env.reset()
    while played < args.eval_episodes:
        with torch.inference_mode():
            logits, _ = model(torch.as_tensor(obs[None], device=device))
        action = logits.argmax(dim=1) if args.eval_greedy else sample_actions(logits.cpu(), generator)
        obs, _, terminated, truncated, info = env.step(int(action[0]))
        if terminated or truncated:
            played += 1
            yield float(info["episode"]["r"])
            if played < args.eval_episodes:  # no reset after the last game: it would record an empty video
                obs, _ = env.reset()
    env.close()


@contextlib.contextmanager
def timed(totals: dict[str, float], name: str):
    """Add the seconds the block takes to totals[name] (a learner's parts of one iteration)."""
    start = time.perf_counter()
    yield
    totals[name] = totals.get(name, 0.0) + time.perf_counter() - start


def averaged_model(run: Run, states: list[dict | None] | None) -> nn.Module | None:
    """The final model: the learners' average parameters; None where a learner's state is missing."""
    if not states or None in states:
        return None
    model = make_model(*run.spaces, run.args.network)
    model.load_state_dict(average_model(states))
    return model


def write_checkpoint(run: Run, states: list[dict | None] | None) -> bool | None:
    """The learners' states, and their average as "model", to {run_dir}/checkpoint.pt atomically (WriteError); False
    (nothing written) where a learner's state is missing."""
    if not states or None in states:
        return False
    steps = sum(s["iteration"] for s in states) * run.args.num_envs * run.args.num_steps
    checkpoint = dict(model=average_model(states), learners=states, global_step=steps, args=asdict(run.args),
                      torch_rng=torch.get_rng_state(), meta=run.meta)  # fmt: skip
    atomic_save(checkpoint, run.checkpoint_path)
    return None


class Logger:
    """The learners' Records into the run's Recorder (TensorBoard, and the console where the process has the run's
    Progress: the main process, rank 0), each Record one point. Global step = agent steps summed over all learners
    (exact on one machine; under torchrun rank 0 writes the exact sum at every sync point)."""

    def __init__(self, run: Run, n: int):
        args, gossip = run.args, run.args.mode == "gossip"
        self.global_step = run.checkpoint["global_step"] if run.checkpoint else 0
        self.record: Recorder | None = None  # from `start`
        self.mode, self.learner_sps = args.mode, [None] * n  # under torchrun a rank sees only its own records
        self.staleness, self.policy_lag = 0.0, math.nan
        # resumed, a gossip learner that is already past the budget does no more updates, and the others catch up
        done = [s["iteration"] for s in run.checkpoint["learners"]] if run.checkpoint else [0] * n
        self.total = sum(max(i, run.num_updates) for i in done) * args.num_envs * args.num_steps
        # the start line's roles: learners, mode, ring and, in gossip mode, what the console's staleness and peer_lag
        # (charts/policy_lag) mean
        ring = f", {args.num_peers}-peer {'time-varying ' * args.time_varying}ring, tau {args.max_staleness}"
        gloss = (" (console: staleness = updates since a learner last mixed, peer_lag = its updates minus its "
                 "in-peer's when that peer sent the parameters it mixed (negative: the in-peer is ahead))")  # fmt: skip
        self.roles = f"{n} learners x {args.num_envs} envs x {args.num_steps} steps, {args.mode}"
        self.roles += f"{ring}{gloss}" if gossip else ""

    def start(self, record: Recorder) -> None:
        """Record into `record` from here; its console counts to the agent steps the learners will end at."""
        self.record = record
        if record.progress is not None:
            record.progress.total = self.total

    def handle(self, r: Record) -> None:
        i, step = r.learner, self.global_step + r.steps
        self.global_step = step
        self.record.games((step, ret, length) for ret, length in r.episodes)
        for ret, _ in r.episodes:
            self.record.writer.add_scalar(f"per_learner/episodic_return_{i}", ret, step)
        own = {f"per_learner/SPS_{i}": r.sps}
        if "gossip/consensus_distance" in r.scalars:
            own[f"per_learner/consensus_distance_{i}"] = r.scalars["gossip/consensus_distance"]
        self.record.add(r.scalars | own)
        self.record.point(step)
        self.learner_sps[i], self.staleness = r.sps, r.scalars.get("gossip/staleness", 0.0)
        self.policy_lag = r.scalars.get("charts/policy_lag", self.policy_lag)

    def maybe_print(self, force: bool = False) -> None:
        """The console line every --log-interval seconds, where the run has its Progress; the gossip fields are glossed
        on the start line (`roles`)."""
        if self.record is not None and self.record.progress is not None:
            details = "learner_sps=" + "/".join("-" if s is None else f"{s:.0f}" for s in self.learner_sps)
            if self.mode == "gossip":  # allreduce: no messages, both are 0
                details += f" staleness={self.staleness:.2f} peer_lag={self.policy_lag:.2f}"
            self.record.line(self.global_step, details, force)


class Monitor:
    """The main process's side of the single-machine launch's queues: records to TensorBoard (its Logger), checkpoint
    states assembled into checkpoints (one per request, once every learner answered it), final states kept, error
    lines, and the learners' stop."""

    GRACE = 5.0  # seconds the learners get to stop after the stop request before they are killed
    END = "end"  # main's last message on log_q, behind every learner's

    def __init__(self, run: Run, shared: Shared):
        self.run, self.shared, self.n = run, shared, run.args.num_learners
        self.logger = Logger(run, self.n)
        self.finals: dict[int, dict] = {}
        self.latest: list[dict | None] = list(run.checkpoint["learners"]) if run.checkpoint else [None] * self.n
        self.pending: dict[int, dict[int, dict]] = {}  # checkpoint request -> {learner: state}
        self.write_failure: str | None = None  # a checkpoint or TensorBoard write failed: the run stops
        self.stopped, self.failure = False, None  # `stop` has run, and the error line it found
        # log_q's messages, each read whole by a thread of its own (started by the first drain, after the forks): a
        # learner killed or stopped half way through writing a State (megabytes) leaves that read blocked for good,
        # and main must still see the death and stop the run
        self.inbox: queue.Queue = queue.Queue()
        self.reader = threading.Thread(target=self.read_log_q, name="log_q reader", daemon=True)

    def read_log_q(self) -> None:
        try:
            while True:
                self.inbox.put(self.shared.log_q.get())
        except BaseException as e:  # at exit: the queue closed under the read (EOFError); otherwise a failed read
            self.inbox.put(e)

    def handle(self, message: Record | State | BaseException) -> None:
        if isinstance(message, BaseException):  # the reader's read failed: no message can follow
            if not self.stopped:
                raise Stop(f"error: the main process could not read the learners' messages: {message!r}")
            return
        try:
            if isinstance(message, Record):
                if self.logger.record is not None and self.write_failure is None:
                    self.logger.handle(message)
                return
            i, state = message.learner, torch.load(io.BytesIO(message.data), weights_only=False)
            if message.request == 0:
                self.finals[i] = self.latest[i] = state
            else:
                got = self.pending.setdefault(message.request, {})
                got[i] = state
                if len(got) == self.n:
                    self.pending.clear()
                    self.latest[:] = [got[j] for j in range(self.n)]
                    write_checkpoint(self.run, self.latest)
        except (WriteError, OSError) as e:
            self.write_failure = self.write_failure or error_line(e, self.logger.global_step, 0)[1]

    def checkpoint(self) -> bool | None:
        """The run's checkpoint. While the learners train, a request: each sends its State after its iteration, and
        `handle` writes the checkpoint once every learner answered. Once they stopped, written from their final states
        (final_states; False: a learner's is missing, nothing written)."""
        if not self.stopped:
            self.shared.checkpoint_requests.value += 1
            return None
        return write_checkpoint(self.run, self.final_states())

    def final_states(self) -> list[dict | None]:
        """The newest state of each learner: its final one, or the one of the last checkpoint (or --resume); for a
        gossip learner killed at the stop before it sent any, its last published parameters from its send buffer
        (read without its lock, which it may have held when killed): its optimizer statistics restart on resume."""
        states, gossip = list(self.latest), self.shared.gossip
        for j in (j for j, s in enumerate(states) if s is None and gossip is not None and gossip.versions[j]):
            model = make_model(*self.run.spaces, self.run.args.network)
            unflatten_into(list(model.parameters()), gossip.buffers[j].cpu())
            states[j] = dict(model=model.state_dict(), iteration=gossip.stamps[j] + 1)
            what = f"learner {j}'s last published parameters (iteration {states[j]['iteration']}, no optimizer state)"
            print(f"warning: the final checkpoint keeps {what}", file=sys.stderr)
        if missing := [f"learner {j}" for j, s in enumerate(states) if s is None]:
            print(f"warning: no final checkpoint: {', '.join(missing)} sent no state before the stop", file=sys.stderr)
        return states

    def drain(self, timeout: float) -> None:
        """Handle every message read from `log_q`, waiting up to `timeout` seconds for the first."""
        if self.reader.ident is None:  # the first drain, after the forks
            self.reader.start()
        with contextlib.suppress(queue.Empty):
            self.handle(self.inbox.get(timeout=timeout) if timeout else self.inbox.get_nowait())
            while True:
                self.handle(self.inbox.get_nowait())

    def drain_to_the_end(self) -> None:
        """Once the learners are gone: handle every message they finished writing, up to main's own END behind them
        (each within 5 s: a message that a killed learner left half written holds up all that follow it). Main's END
        may wait for that learner's lock forever, so main's exit does not wait for it."""
        self.drain(0.0)
        self.shared.log_q.cancel_join_thread()
        self.shared.log_q.put(self.END)
        with contextlib.suppress(queue.Empty):
            while (message := self.inbox.get(timeout=5.0)) != self.END:
                self.handle(message)

    def stop(self, learners: Processes) -> str | None:
        """Stop the learners (once): the stop flag, then `log_q` read while they finish (a learner exits only once its
        queued messages are in the pipe), a learner still running after GRACE seconds killed, and what they wrote read
        to the end (drain_to_the_end: 5 s more where a killed learner holds the queue). The error line of a learner
        that failed or of a failed write, or None."""
        if not self.stopped:
            self.stopped = True
            self.shared.stop.set()
            deadline = time.monotonic() + self.GRACE
            while any(p.exitcode is None for p in learners.procs.values()) and time.monotonic() < deadline:
                self.drain(0.1)
            self.failure = worker_failure(learners, self.shared.error_q) or self.write_failure
            if stuck := learners.stop(max(0.0, deadline - time.monotonic())):  # stuck, or blocked on a peer that is
                print(f"warning: {', '.join(stuck)} did not stop within {self.GRACE:.0f} s; killed", file=sys.stderr)
            self.drain_to_the_end()
        return self.failure


def free_port() -> int:
    """A free TCP port on localhost for the allreduce learners' gloo rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    main(parse_args(sys.argv[1:]))
