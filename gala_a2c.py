"""GALA-A2C: Gossip-based Actor-Learner Architecture (Assran et al., "Gossip-based Actor-Learner Architectures for
Deep Reinforcement Learning", NeurIPS 2019; Algorithm 1, Propositions 1-2, Table 2, Appendix C), with the paper's
all-reduce A2C baseline in the same file (`--mode allreduce`).

Architecture: `--num-learners` A2C agents, one process each (started here with torch.multiprocessing, or one per rank
by `torchrun`), each stepping `--num-envs` simulators with one batched forward pass per step on its device (several
learners may share a GPU). Learner i loops (Algorithm 1): N = `--num-steps` steps, n-step returns, one RMSprop step,
then gossip: publish its parameters to its out-peers without waiting, and once a message from every in-peer has
arrived, x_i <- (x_i + sum_j m_j) / (1 + |N_in|). Topology: directed ring, learner i sends to i+1..i+k (k =
`--num-peers`), or with `--time-varying` the k offsets rotate through 1..n-1 each iteration.
- One machine: every learner owns a preallocated broadcast buffer in shared memory (CUDA memory on a GPU), the paper's
  send buffer B_i (Appendix B): publishing overwrites it under its lock and bumps its version; a receiver copies an
  in-peer's buffer when the version is newer than the one it last read, so a newer message replaces an unread older
  one and nothing is queued. Receivers block (on a Condition, no busy wait) only when `--max-staleness` (tau) local
  iterations passed without mixing.
- torchrun: the same learner body, one learner per rank; a sender thread `dist.send`s the newest snapshot to each
  out-peer (newer snapshots replace one not yet sent), one receiver thread per in-peer `dist.recv`s into its slot.
  Every `--sync-interval` iterations the ranks meet in one small all-reduce (global step, stop and checkpoint flags,
  consensus distance): a stop or checkpoint happens there, so collectives always match.
- `--mode allreduce`: the same learners all-reduce their gradients before every step (gloo on localhost for the
  single-machine launch, NCCL/gloo under torchrun), mathematically one A2C over all simulators.
Policy lag: 0 (on-policy; gossip mixes parameters after the update, between rollouts).
Determinism: `--mode allreduce` keeps all learners bitwise identical; gossip is asynchronous, so which message a
learner mixes depends on timing, and runs are not reproducible (one learner is).

Examples:
  python gala_a2c.py --env-id ALE/Breakout-v5 --num-learners 4                      # 4 x 16 envs, 1-peer ring
  python gala_a2c.py --env-id ALE/Breakout-v5 --num-learners 4 --mode allreduce     # the A2C baseline
  torchrun --standalone --nproc-per-node 4 gala_a2c.py --env-id ALE/Breakout-v5     # one learner per rank
  torchrun --nnodes 2 --node-rank $NODE_RANK --nproc-per-node 4 --rdzv-backend c10d \\
      --rdzv-endpoint $HEAD_NODE:29500 gala_a2c.py --env-id ALE/Breakout-v5         # 8 learners on two machines
"""

from __future__ import annotations

import ctypes
import errno
import io
import math
import os
import queue
import signal
import socket
import sys
import threading
import time
import traceback
from collections import deque
from dataclasses import asdict, dataclass
from multiprocessing.connection import wait as wait_sentinels
from pathlib import Path
from typing import Literal

import gymnasium as gym
import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import tyro
from torch import nn

from common.atari import PROTOCOLS, EnvError, ale_game, check_env_args, finished_episodes, make_env, make_vector_env
from common.models import NETWORKS, make_model


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
    atari_protocol: str = "deepmind"
    """ALE preprocessing: `deepmind` (the GALA paper's Table 2 setting) or `machado`"""
    total_timesteps: int = 10_000_000
    """agent steps summed over all envs of all learners"""
    log_dir: str = "runs"
    """where run directories go"""
    save_model: bool = False
    """write the final model (the average of the learners' parameters) to {run_dir}/model.pt"""
    checkpoint_interval: float = 0.0
    """seconds between checkpoints to {run_dir}/checkpoint.pt (0 = off)"""
    resume: str | None = None
    """path of a checkpoint.pt to continue from (same run directory and step count)"""
    eval_episodes: int = 0
    """episodes to evaluate the final (averaged) policy on (logged as eval/episodic_return)"""
    eval_greedy: bool = True
    """evaluate with argmax actions (GALA Table 1's protocol); `--no-eval-greedy` samples from the policy instead"""
    capture_video: bool = False
    """record videos of the evaluation episodes to {run_dir}/videos"""
    network: str = "auto"
    """`nature` (GALA Appendix C.2), `impala`, `mlp`, or `auto` (nature for frames, mlp for flat observations)"""

    mode: Literal["gossip", "allreduce"] = "gossip"
    """`gossip` (GALA-A2C) or `allreduce` (the paper's A2C baseline: gradients averaged before every step)"""
    num_learners: int = 4
    """A2C agents, one process each (Appendix C: 4 learners x 16 envs = 64 simulators); torchrun: one per rank"""
    num_peers: int = 1
    """out-peers (= in-peers) of each learner in the directed ring (Appendix C: 1-peer ring)"""
    time_varying: bool = False
    """rotate each learner's peers through the ring every iteration (single-machine launch only)"""
    max_staleness: int = 10
    """tau: local iterations a learner may run without mixing before it blocks for its in-peers"""
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
    code, while Table 2's 0.01, outside the root, turns the clipped gradients' steps into small plain-SGD steps and
    Pong does not learn (README)"""
    max_grad_norm: float = 0.5
    """clip the global gradient norm (Table 2)"""
    ent_coef: float = 0.01
    """entropy bonus coefficient (Table 2)"""
    vf_coef: float = 0.5
    """value loss coefficient (Table 2)"""
    gamma: float = 0.99
    """discount factor (Table 2)"""
    log_frequency: int = 10
    """iterations per learner record sent to TensorBoard (losses and timings averaged over them)"""
    log_interval: float = 10.0
    """seconds between console lines"""


# ----------------------------------------------------------------------------------------------------------------
# Pure algorithm functions: A2C, topology, mixing, the epsilon-ball bound
# ----------------------------------------------------------------------------------------------------------------


def n_step_returns(rewards: torch.Tensor, dones: torch.Tensor, bootstrap: torch.Tensor, gamma: float) -> torch.Tensor:
    """G_t = sum_{i<N-t} gamma^i r_{t+i} + gamma^{N-t} V(s_N), cut at episode ends (Algorithm 1, line 3).

    rewards, dones: [T, B], dones[t] says the episode ended with transition t; bootstrap: [B]. Returns [T, B].
    """
    returns = torch.zeros_like(rewards)
    running = bootstrap
    not_done = 1.0 - dones.to(rewards.dtype)
    for t in reversed(range(rewards.shape[0])):
        running = rewards[t] + gamma * not_done[t] * running
        returns[t] = running
    return returns


def sample_actions(logits: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Gumbel-max sampling from a seeded generator: [B, A] logits -> [B] actions."""
    u = torch.rand(logits.shape, generator=generator, device=logits.device).clamp_(min=1e-20)
    return torch.argmax(logits - torch.log(-torch.log(u)), dim=1)


def a2c_loss(logits, values, actions, returns, ent_coef: float, vf_coef: float) -> dict[str, torch.Tensor]:
    """A2C on an [M] batch: the batched policy gradient (Eq. 4) and TD value loss (Eq. 1) minus the entropy bonus."""
    logp_all = torch.log_softmax(logits, dim=-1)  # [M, A]
    logp = logp_all.gather(-1, actions[:, None]).squeeze(-1)  # [M]
    entropy = -(logp_all.exp() * logp_all).sum(-1).mean()
    advantages = (returns - values).detach()
    policy_loss = -(logp * advantages).mean()
    value_loss = ((returns - values) ** 2).mean()
    total = policy_loss - ent_coef * entropy + vf_coef * value_loss
    return dict(total_loss=total, policy_loss=policy_loss, value_loss=value_loss, entropy=entropy)


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


def in_peers(i: int, n: int, offsets: list[int]) -> list[int]:
    return [(i - s) % n for s in offsets]


def out_peers(i: int, n: int, offsets: list[int]) -> list[int]:
    return [(i + s) % n for s in offsets]


def mixing_matrix(n: int, offsets: list[int]) -> torch.Tensor:
    """P [n, n] with p_ij = 1 / (1 + |N_in(i)|) for j = i and j in N_in(i) (Algorithm 1, footnote 1)."""
    P = torch.zeros(n, n, dtype=torch.float64)
    weight = 1.0 / (1 + len(offsets))
    for i in range(n):
        P[i, i] = weight
        for j in in_peers(i, n, offsets):
            P[i, j] += weight
    return P


def gossip_mix_(x: torch.Tensor, messages: list[torch.Tensor]) -> torch.Tensor:
    """Algorithm 1, line 7, in place: x <- (x + sum_j m_j) / (1 + |N_in|)."""
    for m in messages:
        x.add_(m)
    return x.div_(1 + len(messages))


def consensus_distance(x: torch.Tensor, average: torch.Tensor) -> float:
    """||x_i - x_bar||: how far one learner's parameters are from the learners' average."""
    return torch.linalg.vector_norm(x.double() - average.double()).item()


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


def state_to_bytes(state: dict | None) -> bytes | None:
    """Learner states cross the queue as bytes: a queued tensor would be shared through a file descriptor that dies
    with the learner process, which may exit before the main process reads it."""
    if state is None:
        return None
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


def state_from_bytes(data: bytes | None) -> dict | None:
    return None if data is None else torch.load(io.BytesIO(data), weights_only=False)


# ----------------------------------------------------------------------------------------------------------------
# Gossip: one endpoint per learner, shared memory on one machine, torch.distributed point-to-point across machines
# ----------------------------------------------------------------------------------------------------------------


class Stop(Exception):
    """Raised inside a learner when the run is shutting down."""


class GossipEndpoint:
    """Algorithm 1, lines 5-8, for one learner: publish without blocking, mix once every in-peer has a new message,
    block only when more than tau iterations passed without mixing. Subclasses move the messages."""

    def __init__(self, learner: int, n: int, num_peers: int, time_varying: bool, tau: int):
        self.learner, self.n, self.num_peers, self.time_varying, self.tau = learner, n, num_peers, time_varying, tau
        self.staleness = 0  # local iterations since the last mix

    def in_peers(self, iteration: int) -> list[int]:
        return in_peers(self.learner, self.n, peer_offsets(self.n, self.num_peers, iteration, self.time_varying))

    def step(self, x: torch.Tensor, iteration: int, stop, at_sync: bool = False) -> tuple[bool, float]:
        """Gossip after local update `iteration` on the flat parameters `x` (mixed in place); `at_sync`: this learner
        meets the other ranks (torchrun) right after. Returns (mixed, seconds blocked waiting for in-peers)."""
        self.publish(x, at_sync)
        peers = self.in_peers(iteration)
        waited = 0.0
        if not self.ready(peers):
            if self.staleness < self.tau or self.any_silent(peers):
                self.staleness += 1
                return False, 0.0
            start = time.perf_counter()
            self.wait_ready(peers, stop)  # raises Stop if the run stops meanwhile
            waited = time.perf_counter() - start
            if not self.ready(peers):  # an in-peer finished its run: no message will come
                self.staleness += 1
                return False, waited
        gossip_mix_(x, self.take(peers))
        self.staleness = 0
        return True, waited


class SharedMemoryGossip:
    """Preallocated broadcast buffers, one per learner, in shared memory (or CUDA memory); made by the main process
    before the learners start. `endpoint(i)` is learner i's view."""

    def __init__(self, ctx, n: int, numel: int, device: torch.device):
        self.n, self.numel, self.device = n, numel, device
        self.buffers = torch.zeros(n, numel, device=device)  # [n, P] the newest message of each learner
        if device.type == "cpu":
            self.buffers.share_memory_()
        self.versions = ctx.Array("q", n, lock=False)  # messages published so far, per learner
        self.finished = ctx.Array("b", n, lock=False)  # learner ended its run (no more messages)
        self.locks = [ctx.Lock() for _ in range(n)]  # no torn reads: a copy in or out holds the buffer's lock
        self.arrived = ctx.Condition()  # notified on every publish, so blocked receivers wake without polling

    def endpoint(self, learner: int, num_peers: int, time_varying: bool, tau: int) -> SharedMemoryEndpoint:
        return SharedMemoryEndpoint(self, learner, num_peers, time_varying, tau)


class SharedMemoryEndpoint(GossipEndpoint):
    def __init__(self, shared: SharedMemoryGossip, learner: int, num_peers: int, time_varying: bool, tau: int):
        super().__init__(learner, shared.n, num_peers, time_varying, tau)
        self.shared = shared
        self.last_read = [0] * shared.n  # version of each learner's message this learner mixed last
        self.inbox = torch.zeros(num_peers, shared.numel, device=shared.device)  # allocated once

    def _sync(self) -> None:
        if self.shared.device.type == "cuda":  # another process reads the buffer: the copy must have landed
            torch.cuda.current_stream(self.shared.device).synchronize()

    def publish(self, x: torch.Tensor, at_sync: bool = False) -> None:  # one machine: no learner waits at a sync
        s, i = self.shared, self.learner
        with s.locks[i]:
            s.buffers[i].copy_(x)
            self._sync()
            s.versions[i] += 1
        with s.arrived:
            s.arrived.notify_all()

    def ready(self, peers: list[int]) -> bool:
        return all(self.shared.versions[j] > self.last_read[j] for j in peers)

    def any_silent(self, peers: list[int]) -> bool:
        """An in-peer will send nothing new: it finished its run."""
        return any(self.shared.finished[j] for j in peers)

    def wait_ready(self, peers: list[int], stop) -> None:
        with self.shared.arrived:
            while not self.ready(peers) and not self.any_silent(peers):
                if stop.is_set():
                    raise Stop
                self.shared.arrived.wait(timeout=1.0)

    def take(self, peers: list[int]) -> list[torch.Tensor]:
        s = self.shared
        for k, j in enumerate(peers):
            with s.locks[j]:
                self.inbox[k].copy_(s.buffers[j])
                self._sync()
                self.last_read[j] = s.versions[j]
        return list(self.inbox[: len(peers)])

    def average(self, x: torch.Tensor) -> torch.Tensor:
        """The learners' average, with this learner's current parameters and the others' newest messages."""
        s, total = self.shared, x.clone()
        for j in range(self.n):
            if j != self.learner:
                with s.locks[j]:
                    total.add_(s.buffers[j])
        return total.div_(self.n)

    def finish(self, x: torch.Tensor) -> None:
        self.publish(x)
        self.shared.finished[self.learner] = 1
        with self.shared.arrived:
            self.shared.arrived.notify_all()


# the flag a torchrun gossip message carries after its parameters (0: an ordinary message)
SENT_AT_SYNC = 1.0  # sent right before a sync point, where the sender now waits for the other ranks
SENT_LAST = 2.0  # the sender's last message: it finished its run


class DistributedEndpoint(GossipEndpoint):
    """torchrun: messages are [P + 1] tensors (parameters, then a flag: SENT_AT_SYNC, SENT_LAST or 0). A sender thread
    sends the newest snapshot to every out-peer with blocking `dist.send` (a newer snapshot replaces one still
    waiting), one receiver thread per in-peer `dist.recv`s and keeps only the newest message. gloo's isend/irecv
    handles cannot be polled (`is_completed` stays False until `wait`), so the threads are what makes the learner's
    side non-blocking. The messages travel on a process group of their own (`group`), so these threads never issue
    operations on the communicator that the main thread's sync-point all-reduces use (NCCL and gloo expect one
    thread's order of operations per communicator)."""

    def __init__(self, learner: int, n: int, num_peers: int, tau: int, numel: int, device: torch.device, group):
        super().__init__(learner, n, num_peers, False, tau)
        self.numel, self.device, self.group = numel, device, group
        self.peers_in = self.in_peers(0)
        self.cond = threading.Condition()
        self.latest = torch.zeros(num_peers, numel, device=device)  # newest message per in-peer, allocated once
        self.fresh, self.done = [False] * num_peers, [False] * num_peers
        self.parked = [False] * num_peers  # the in-peer's newest message came from a sync point, where it now waits
        self.snapshot = torch.zeros(numel + 1, device=device)
        self.pending = False
        self.errors: list[str] = []
        self.threads = [threading.Thread(target=self._send_loop, name="gossip-send", daemon=True)]
        self.threads += [
            threading.Thread(target=self._recv_loop, args=(k, j), name=f"gossip-recv-{j}", daemon=True)
            for k, j in enumerate(self.peers_in)
        ]
        for t in self.threads:
            t.start()

    def _send_loop(self) -> None:
        out = torch.zeros(self.numel + 1, device=self.device)
        try:
            while True:
                with self.cond:
                    while not self.pending:
                        self.cond.wait()
                    out.copy_(self.snapshot)
                    self.pending = False
                for dst in out_peers(self.learner, self.n, peer_offsets(self.n, self.num_peers)):
                    dist.send(out, dst=dst, group=self.group)
                if out[-1].item() == SENT_LAST:
                    return
        except BaseException:
            self.errors.append(traceback.format_exc())

    def _recv_loop(self, k: int, src: int) -> None:
        buf = torch.zeros(self.numel + 1, device=self.device)
        try:
            while True:
                dist.recv(buf, src=src, group=self.group)
                flag = buf[-1].item()
                with self.cond:
                    self.latest[k].copy_(buf[: self.numel])
                    self.fresh[k] = True
                    self.done[k], self.parked[k] = flag == SENT_LAST, flag == SENT_AT_SYNC
                    self.cond.notify_all()
                if self.done[k]:
                    return
        except BaseException:
            self.errors.append(traceback.format_exc())

    def publish(self, x: torch.Tensor, at_sync: bool = False, last: bool = False) -> None:
        with self.cond:
            self.snapshot[: self.numel].copy_(x)
            self.snapshot[-1] = SENT_LAST if last else SENT_AT_SYNC if at_sync else 0.0
            self.pending = True
            self.cond.notify_all()

    def ready(self, peers: list[int]) -> bool:
        return all(self.fresh)

    def any_silent(self, peers: list[int]) -> bool:
        """An in-peer will send nothing new before this learner moves on, and its newest message is read: it finished,
        or it waits at the next sync point for this learner (waiting for it here would deadlock the ranks)."""
        return any((d or p) and not f for d, p, f in zip(self.done, self.parked, self.fresh, strict=True))

    def wait_ready(self, peers: list[int], stop) -> None:
        with self.cond:
            while not self.ready(peers) and not self.any_silent(peers):
                if self.errors:
                    raise RuntimeError(f"gossip thread died:\n{self.errors[0]}")
                self.cond.wait(timeout=1.0)  # no Stop here: ranks stop together at sync points

    def take(self, peers: list[int]) -> list[torch.Tensor]:
        with self.cond:
            self.fresh = [False] * self.num_peers
            return [m.clone() for m in self.latest]

    def finish(self, x: torch.Tensor) -> None:
        """Send the last message and wait until every in-peer's last one arrived (no send or recv left pending)."""
        self.publish(x, last=True)
        for t in self.threads:
            t.join()
        if self.errors:
            raise RuntimeError(f"gossip thread died:\n{self.errors[0]}")


# ----------------------------------------------------------------------------------------------------------------
# The learner (Algorithm 1 for agent v_i)
# ----------------------------------------------------------------------------------------------------------------


class NonFiniteLoss(RuntimeError):
    pass


LOSS_NAMES = ("policy_loss", "value_loss", "entropy", "total_loss", "grad_norm")
TIMING_NAMES = ("rollout", "train", "gossip", "gossip_wait", "allreduce", "iteration")


@dataclass
class Control:
    """What a learner needs besides its args: where records go, and when to stop or checkpoint."""

    report: object  # callable(record: dict)
    stop: object  # .is_set(): the run is stopping
    checkpoint_requests: object | None = None  # mp.Value: checkpoints asked for by the main process (spawn launch)
    checkpoint_due: object | None = None  # callable() -> bool: rank 0's clock says a checkpoint is due (torchrun)


def learner_loop(
    learner: int, n: int, args: Args, device: torch.device, gossip, control: Control, state: dict | None, distributed
):
    """Run one learner to its share of `--total-timesteps`; returns its final state. `gossip` is its endpoint (None in
    allreduce mode); `distributed` says the ranks are torchrun's (sync points carry stop and checkpoint flags)."""
    torch.set_num_threads(args.torch_threads or max(1, (os.cpu_count() or 1) // n))
    torch.use_deterministic_algorithms(args.torch_deterministic, warn_only=True)
    E, T = args.num_envs, args.num_steps
    num_iterations = args.total_timesteps // (n * E * T)
    start_iteration = state["iteration"] if state else 0
    envs = make_vector_env(
        args.env_id,
        E,
        args.seed + 10_000 * learner + start_iteration,  # distinct per learner; fresh episodes after --resume
        protocol=args.atari_protocol,
        num_threads=args.env_threads or max(1, (os.cpu_count() or 1) // n),
    )
    try:
        obs_space = envs.single_observation_space
        torch.manual_seed(args.seed)  # identical initial parameters on every learner
        model = make_model(obs_space, envs.single_action_space, args.network).to(device)
        params = list(model.parameters())
        lr0 = args.learning_rate * (math.sqrt(n) if args.scale_lr else 1.0)
        optimizer = make_optimizer(params, lr0, args)
        generator = torch.Generator(device=device).manual_seed(args.seed * 104729 + learner)
        if state:
            model.load_state_dict(state["model"])
            optimizer.load_state_dict(state["optimizer"])
            generator.set_state(state["generator"])
        numel = sum(p.numel() for p in params)
        x = torch.zeros(numel, device=device)  # flat parameters, mixed in place (allocated once)
        flat_grad = torch.zeros(numel, device=device)  # allreduce: the gradients, averaged in one call
        obs_dtype = torch.uint8 if obs_space.dtype == np.uint8 else torch.float32
        obs_buf = torch.zeros((T + 1, E, *obs_space.shape), dtype=obs_dtype, device=device)  # [T+1, E, ...]
        actions = torch.zeros((T, E), dtype=torch.long, device=device)
        rewards, dones = torch.zeros((T, E), device=device), torch.zeros((T, E), device=device)
        next_obs, _ = envs.reset()
        obs_buf[0].copy_(torch.from_numpy(next_obs))

        sums = dict.fromkeys((*LOSS_NAMES, *TIMING_NAMES, "staleness", "mixed"), 0.0)
        episodes, count, steps_unreported, consensus = [], 0, 0, None
        start_time, last_checkpoint_request = time.time(), 0
        lr = lr0
        iteration = start_iteration

        def final_state() -> dict:
            return dict(
                model={k: v.cpu() for k, v in model.state_dict().items()},
                optimizer=optimizer.state_dict(),
                generator=generator.get_state(),
                iteration=iteration,
            )

        def flush(extra: dict | None = None) -> None:
            nonlocal sums, episodes, count, steps_unreported, consensus
            record = dict(
                learner=learner,
                steps=steps_unreported,
                iteration=iteration,
                lr=lr,
                episodes=episodes,
                means={k: v / max(1, count) for k, v in sums.items()},
                consensus=consensus,
                sps=(iteration - start_iteration) * E * T / max(1e-9, time.time() - start_time),
                **(extra or {}),
            )
            control.report(record)
            sums = dict.fromkeys(sums, 0.0)
            episodes, count, steps_unreported, consensus = [], 0, 0, None

        while iteration < num_iterations:
            if not distributed and args.mode == "gossip" and control.stop.is_set():
                break  # (allreduce learners stop together, at the iteration their all-reduced flags agree on)
            t0 = time.perf_counter()
            for t in range(T):  # Algorithm 1, line 2
                with torch.inference_mode():
                    logits, _ = model(obs_buf[t])
                    actions[t] = sample_actions(logits, generator)
                next_obs, reward, terminated, truncated, info = envs.step(actions[t].cpu().numpy())
                obs_buf[t + 1].copy_(torch.from_numpy(next_obs), non_blocking=True)
                rewards[t].copy_(torch.from_numpy(reward))
                dones[t].copy_(torch.from_numpy(terminated | truncated))
                episodes += finished_episodes(info)
            t1 = time.perf_counter()
            # lines 3-4: n-step returns and one A2C step from one batched forward over the T x E (+ E bootstrap) obs
            logits, values = model(obs_buf.reshape(-1, *obs_space.shape))
            values = values.reshape(T + 1, E)
            returns = n_step_returns(rewards, dones, values[T].detach(), args.gamma)
            losses = a2c_loss(
                logits[: T * E], values[:T].reshape(-1), actions.reshape(-1), returns.reshape(-1), args.ent_coef,
                args.vf_coef,
            )  # fmt: skip
            if not torch.isfinite(losses["total_loss"]):
                raise NonFiniteLoss(f"non-finite loss {losses['total_loss'].item()} at iteration {iteration + 1}")
            optimizer.zero_grad(set_to_none=False)
            losses["total_loss"].backward()
            t2 = time.perf_counter()
            stop_all, request = False, 0
            if args.mode == "allreduce":  # the A2C baseline: average the gradients first
                flatten_into(flat_grad, [p.grad for p in params])
                dist.all_reduce(flat_grad)
                unflatten_into([p.grad for p in params], flat_grad.div_(n))
                if not distributed:  # agree on stopping and checkpointing at this very iteration
                    agree = torch.tensor([float(control.stop.is_set()), float(control.checkpoint_requests.value)])
                    dist.all_reduce(agree, op=dist.ReduceOp.MAX)
                    stop_all, request = agree[0].item() > 0, int(agree[1].item())
            t3 = time.perf_counter()
            grad_norm = nn.utils.clip_grad_norm_(params, args.max_grad_norm)
            if args.anneal_lr:
                lr = lr0 * (1.0 - iteration / num_iterations)
                for group in optimizer.param_groups:
                    group["lr"] = lr
            optimizer.step()
            obs_buf[0].copy_(obs_buf[T])
            t4 = time.perf_counter()
            waited, mixed = 0.0, False
            at_sync = (iteration + 1) % args.sync_interval == 0 or iteration + 1 == num_iterations
            if gossip is not None:  # lines 5-8
                flatten_into(x, params)
                try:
                    mixed, waited = gossip.step(x, iteration, control.stop, at_sync=distributed and at_sync)
                except Stop:  # stopped while blocked for in-peers: this iteration's update stands
                    stop_all = True
                if mixed:
                    unflatten_into(params, x)
            t5 = time.perf_counter()
            iteration += 1
            steps_unreported += E * T
            stats = torch.stack([*(losses[k].detach() for k in LOSS_NAMES[:4]), grad_norm]).tolist()
            for k, v in zip(LOSS_NAMES, stats, strict=True):
                sums[k] += v
            timing = (t1 - t0, (t2 - t1) + (t4 - t3), t5 - t4 - waited, waited, t3 - t2, t5 - t0)
            for k, v in zip(TIMING_NAMES, timing, strict=True):
                sums[k] += v
            sums["staleness"] += gossip.staleness if gossip is not None else 0
            sums["mixed"] += float(mixed)
            count += 1

            if distributed and at_sync:  # torchrun: meet the other ranks (matched collectives)
                if gossip is not None:
                    avg = x.clone() if mixed else flatten_into(x, params).clone()
                    dist.all_reduce(avg)
                    consensus = consensus_distance(x, avg.div_(n))
                flags = torch.tensor([float(control.stop.is_set()), float(control.checkpoint_due())], device=device)
                dist.all_reduce(flags)
                stop_all = stop_all or flags[0].item() > 0
                extra = dict(checkpoint=final_state() if flags[1].item() > 0 else None)
                flush(extra)
            elif not distributed:
                if gossip is not None and at_sync:
                    consensus = consensus_distance(flatten_into(x, params), gossip.average(x))
                if count >= args.log_frequency or (at_sync and consensus is not None):
                    flush()
                if args.mode == "gossip":
                    request = control.checkpoint_requests.value
                if request > last_checkpoint_request:
                    last_checkpoint_request = request
                    control.report(dict(learner=learner, checkpoint=state_to_bytes(final_state()), request=request))
            if stop_all:
                break
        if count or steps_unreported:
            flush()
        if gossip is not None:
            gossip.finish(flatten_into(x, params))
        return final_state()
    finally:
        envs.close()


def die_with_parent(parent: int) -> None:
    """Linux: the kernel kills this process when the main process dies, even by kill -9, so no learner outlives the
    run; the parent may have died before prctl ran, hence the pid check."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: no prctl
        return
    if os.getppid() != parent:
        os._exit(1)


def learner_process(
    learner: int, n: int, args: Args, device_name: str, shared, log_q, error_q, stop, requests, port, parent: int
):
    """A learner of the single-machine launch: report everything to the main process, never raise past here."""
    die_with_parent(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the main process coordinates Ctrl+C / SIGTERM
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})  # blocked by main around start()
    try:
        device = torch.device(device_name)
        state = None
        if args.resume:
            state = torch.load(args.resume, map_location="cpu", weights_only=False)["learners"][learner]
        gossip = None
        if args.mode == "allreduce":
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=learner, world_size=n)
        else:
            gossip = shared.endpoint(learner, args.num_peers, args.time_varying, args.max_staleness)
        control = Control(report=log_q.put, stop=stop, checkpoint_requests=requests)
        final = learner_loop(learner, n, args, device, gossip, control, state, distributed=False)
        log_q.put(dict(learner=learner, final=state_to_bytes(final)))
        if args.mode == "allreduce":
            dist.destroy_process_group()
    except Stop:
        log_q.put(dict(learner=learner, final=None))
    except NonFiniteLoss as e:
        error_q.put(f"error: learner {learner}: {e}; stopping (the last checkpoint, if any, is kept)")
        raise SystemExit(1) from None
    except BaseException:
        error_q.put(f"error: learner {learner} died:\n{traceback.format_exc()}")
        raise SystemExit(1) from None


# ----------------------------------------------------------------------------------------------------------------
# Logging, validation, checkpoints, evaluation
# ----------------------------------------------------------------------------------------------------------------


class Logger:
    """Turns learner records into TensorBoard scalars and console lines. Global step = agent steps summed over all
    learners (exact on one machine; under torchrun each rank adds its own steps times the number of ranks, and rank 0
    writes the exact sum at every sync point)."""

    def __init__(self, writer, n: int, args: Args, global_step: int = 0):
        self.writer, self.n, self.args = writer, n, args
        self.global_step, self.start_step, self.start_time = global_step, global_step, time.time()
        self.recent: deque[float] = deque(maxlen=20)
        self.last_print = time.time()
        self.learner_sps: list[float | None] = [None] * n  # under torchrun a rank sees only its own records
        self.staleness = 0.0

    def sps(self) -> float:
        return (self.global_step - self.start_step) / max(1e-9, time.time() - self.start_time)

    def handle(self, r: dict, step_scale: int = 1) -> None:
        w, i = self.writer, r["learner"]
        self.global_step += r["steps"] * step_scale
        g = self.global_step
        for ret, length in r["episodes"]:
            w.add_scalar("charts/episodic_return", ret, g)
            w.add_scalar("charts/episodic_length", length, g)
            w.add_scalar(f"per_learner/episodic_return_{i}", ret, g)
            self.recent.append(ret)
        means = r["means"]
        for k in LOSS_NAMES:
            w.add_scalar(f"losses/{k}", means[k], g)
        for k in TIMING_NAMES:
            w.add_scalar(f"timing/{k}", means[k], g)
        w.add_scalar("charts/learning_rate", r["lr"], g)
        w.add_scalar("charts/policy_lag", 0, g)
        w.add_scalar("charts/SPS", self.sps(), g)
        w.add_scalar(f"per_learner/SPS_{i}", r["sps"], g)
        self.learner_sps[i] = r["sps"]
        if self.args.mode == "gossip":
            self.staleness = means["staleness"]
            w.add_scalar("gossip/staleness", means["staleness"], g)
            w.add_scalar("gossip/mix_rate", means["mixed"], g)
            w.add_scalar("gossip/share_of_iteration", means["gossip"] / max(1e-12, means["iteration"]), g)
            if r["consensus"] is not None:
                w.add_scalar("gossip/consensus_distance", r["consensus"], g)
                w.add_scalar(f"per_learner/consensus_distance_{i}", r["consensus"], g)

    def maybe_print(self, force: bool = False) -> None:
        if force or time.time() - self.last_print >= self.args.log_interval:
            mean_ret = f"{np.mean(self.recent):.2f}" if self.recent else "n/a"
            per = " ".join("-" if s is None else f"{s:,.0f}" for s in self.learner_sps)
            print(
                f"step {self.global_step:>10,}  SPS {self.sps():,.0f} (learners {per})  "
                f"return(last {len(self.recent)}) {mean_ret}  staleness {self.staleness:.2f}",
                flush=True,
            )
            self.last_print = time.time()


def validate(args: Args, n: int) -> str | None:
    """Every flag checked before anything is spawned; returns the error line or None."""
    for name in ("num_learners", "num_envs", "num_steps", "num_peers", "sync_interval", "log_frequency"):
        if getattr(args, name) < 1:
            return f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}"
    if args.mode not in ("gossip", "allreduce"):
        return f"--mode must be gossip or allreduce, got {args.mode!r}"
    if args.mode == "gossip" and n < 2:
        return f"gossip needs at least 2 learners, got {n} (use --num-learners 2 or more)"
    if args.mode == "gossip" and args.num_peers > n - 1:
        return f"--num-peers ({args.num_peers}) must be at most --num-learners - 1 ({n - 1})"
    if args.max_staleness < 0:
        return f"--max-staleness must be >= 0, got {args.max_staleness}"
    for name in FLOAT_FLAGS:
        if not math.isfinite(getattr(args, name)):
            return f"--{name.replace('_', '-')} must be a finite number, got {getattr(args, name)}"
    for name in ("learning_rate", "max_grad_norm", "rmsprop_eps"):
        if not getattr(args, name) > 0:
            return f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}"
    if not 0 <= args.rmsprop_alpha < 1:
        return f"--rmsprop-alpha must be in [0, 1), got {args.rmsprop_alpha}"
    if not 0 < args.gamma <= 1:
        return f"--gamma must be in (0, 1], got {args.gamma}"
    for name in ("ent_coef", "vf_coef", "checkpoint_interval", "eval_episodes", "log_interval"):
        if getattr(args, name) < 0:
            return f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}"
    for name in ("env_threads", "torch_threads"):
        if getattr(args, name) < 0:
            return f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}"
    if args.network not in NETWORKS:
        return f"--network must be one of {', '.join(NETWORKS)}, got {args.network!r}"
    if args.atari_protocol not in PROTOCOLS:
        return f"--atari-protocol must be one of {', '.join(PROTOCOLS)}, got {args.atari_protocol!r}"
    if args.resume is not None and not Path(args.resume).is_file():
        return f"--resume {args.resume}: no such checkpoint file"
    batch = n * args.num_envs * args.num_steps
    if args.total_timesteps < batch:
        return (
            f"--total-timesteps ({args.total_timesteps}) is less than one iteration of all learners "
            f"({n} learners x {args.num_envs} envs x {args.num_steps} steps)"
        )
    try:
        check_env_args(args.env_id, args.num_envs, args.atari_protocol)
    except EnvError as e:
        return str(e)
    return action_space_error(args.env_id)


FLOAT_FLAGS = (
    "learning_rate", "rmsprop_alpha", "rmsprop_eps", "max_grad_norm", "ent_coef", "vf_coef", "gamma",
    "checkpoint_interval", "log_interval",
)  # fmt: skip


def action_space_error(env_id: str) -> str | None:
    """The policy is categorical: a continuous-action env is refused before anything starts (ALE ids are Discrete)."""
    if ale_game(env_id) is not None:
        return None
    env = gym.make(env_id)
    space = env.action_space
    env.close()
    if isinstance(space, gym.spaces.Discrete):
        return None
    return (
        f"{env_id} has a {type(space).__name__} action space {space}; gala_a2c.py needs a Discrete one "
        f"(continuous actions: apex.py --algo ddpg)"
    )


def write_atomically(path: Path, obj) -> str | None:
    """Write `obj` with torch.save to a temporary file beside `path`, then rename it over `path`, so a crash or a full
    disk leaves the previous file intact. Returns the error line, or None once written."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)  # serialised in memory first: a full disk then shows as ENOSPC, not a zip-writer error
    tmp = path.with_suffix(".tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(buffer.getbuffer())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        return None
    except OSError as e:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
        return write_error(e, path)


def write_error(e: OSError, what) -> str:
    if e.errno == errno.ENOSPC:
        return f"error: no space left on device while writing {what}"
    return f"error: cannot write {what}: {e.strerror or e}"


def save_checkpoint(run_dir: Path, states: list[dict], args: Args, meta: dict) -> str | None:
    """The learners' states to {run_dir}/checkpoint.pt, atomically; returns the error line, or None once written."""
    state = dict(
        learners=states,
        global_step=steps_of(states, args),
        args=asdict(args),
        torch_rng=torch.get_rng_state(),
        meta=meta,
    )
    return write_atomically(run_dir / "checkpoint.pt", state)


def checkpoint_meta(args: Args, obs_space, act_space) -> dict:
    """What a checkpoint was trained on: --resume refuses one whose script, mode, env, network or shapes differ."""
    network = args.network if args.network != "auto" else "nature" if len(obs_space.shape) == 3 else "mlp"
    return dict(
        script=Path(__file__).name,
        algo=args.mode,
        env_id=args.env_id,
        network=network,
        obs_shape=list(obs_space.shape),
        action_shape_or_n=int(act_space.n),
    )


def read_checkpoint(path: str, meta: dict) -> tuple[dict | None, str | None]:
    """Load a --resume checkpoint and check it was written by this script for this env, mode and network.
    Returns (checkpoint, None) or (None, the error line)."""
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # garbage, truncated, or pickled objects this interpreter cannot rebuild
        reason = (str(e).strip().splitlines() or [""])[0][:120]
        return (
            None,
            f"error: cannot resume from {path}: not a checkpoint this script can read ({type(e).__name__}: {reason})",
        )
    theirs = checkpoint.get("meta") if isinstance(checkpoint, dict) else None
    if not isinstance(theirs, dict):
        return None, f'error: cannot resume from {path}: not a checkpoint this script can read (no "meta" entry)'
    differ = [k for k in meta if theirs.get(k) != meta[k]]
    if differ:
        return None, (
            f"error: cannot resume from {path}: it is a {theirs.get('script')} checkpoint "
            f"({', '.join(f'{k} {theirs.get(k)}' for k in differ)}), this run is "
            f"{', '.join(f'{k} {meta[k]}' for k in differ)}"
        )
    return checkpoint, None


def steps_of(states: list[dict], args: Args) -> int:
    """Global agent steps of a set of learner states: their iterations x envs x horizon."""
    return sum(s["iteration"] for s in states) * args.num_envs * args.num_steps


def average_model(states: list[dict]) -> dict:
    """The learners' average parameters (identical to each learner's in allreduce mode)."""
    return {
        k: sum(s["model"][k].double() for s in states).div(len(states)).to(v.dtype)
        for k, v in states[0]["model"].items()
    }


def evaluate(model: nn.Module, args: Args, run_dir: Path) -> list[float]:
    """Play `eval_episodes` full games with the final policy, true returns; argmax actions with `--eval-greedy`
    (Table 1), sampled ones otherwise."""
    env = make_env(
        args.env_id,
        args.seed + 1_000_003,
        protocol=args.atari_protocol,
        capture_video=args.capture_video,
        video_dir=str(run_dir / "videos"),
    )
    generator = torch.Generator().manual_seed(args.seed + 1_000_003)
    returns = []
    obs, _ = env.reset()
    while len(returns) < args.eval_episodes:
        with torch.inference_mode():
            logits, _ = model(torch.as_tensor(obs[None]))
        action = logits.argmax(dim=1) if args.eval_greedy else sample_actions(logits, generator)
        obs, _, terminated, truncated, info = env.step(int(action[0]))
        if terminated or truncated:
            returns.append(float(info["episode"]["r"]))
            obs, _ = env.reset()
    env.close()
    return returns


def finish_run(args: Args, run_dir: Path, writer, states: list[dict] | None, obs_space, act_space) -> str | None:
    """--save-model and --eval-episodes on the averaged final parameters; returns an error line if a write failed."""
    if not states or not (args.save_model or args.eval_episodes):
        return None
    model = make_model(obs_space, act_space, args.network)
    model.load_state_dict(average_model(states))
    if args.save_model and (error := write_atomically(run_dir / "model.pt", model.state_dict())):
        return error
    if args.eval_episodes:
        for i, ret in enumerate(evaluate(model, args, run_dir)):
            writer.add_scalar("eval/episodic_return", ret, i)
            print(f"eval episode {i}: return {ret:.1f}")
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def probe_spaces(args: Args):
    probe = make_vector_env(args.env_id, 1, args.seed, protocol=args.atari_protocol, num_threads=1)
    spaces = probe.single_observation_space, probe.single_action_space
    probe.close()
    return spaces


def create_run_dir(args: Args) -> tuple[Path, str | None]:
    """A new run directory, made atomically and never shared: a run started in the same second as another with the
    same name gets the suffix -2, -3, ... Returns (path, None), or (path, the error line) when it cannot be made or
    written. --resume keeps the checkpoint's own directory."""
    if args.resume:
        run_dir = Path(args.resume).parent
        if not os.access(run_dir, os.W_OK):
            return run_dir, f"error: cannot write to the run directory {run_dir}: {os.strerror(errno.EACCES)}"
        return run_dir, None
    base = Path(args.log_dir) / f"{args.env_id.replace('/', '_')}__{args.exp_name}__{args.seed}__{int(time.time())}"
    for k in range(1, 1000):
        run_dir = base if k == 1 else base.with_name(f"{base.name}-{k}")
        try:
            run_dir.mkdir(parents=True, exist_ok=False)
            return run_dir, None
        except FileExistsError:
            continue
        except OSError as e:
            return run_dir, f"error: cannot create the run directory {run_dir}: {e.strerror or e}"
    return base, f"error: cannot create the run directory {base}: 999 runs of that name started in the same second"


def quiet_writer_thread_errors(hook) -> None:
    """threading.excepthook: TensorBoard's writer thread dies on a write error (a full disk) and the next write or
    close raises it again in the main thread, which reports it as the run's one error line; its traceback is noise."""
    frames = traceback.extract_tb(hook.exc_traceback)
    if not (issubclass(hook.exc_type, OSError) and any("tensorboard" in f.filename for f in frames)):
        threading.__excepthook__(hook)


def make_writer(run_dir: Path, args: Args, n: int):
    from torch.utils.tensorboard import SummaryWriter  # after the forks: the writer runs a thread

    threading.excepthook = quiet_writer_thread_errors
    run_dir.mkdir(parents=True, exist_ok=True)  # rank r > 0 writes to {run_dir}/learner{r}
    writer = SummaryWriter(str(run_dir))
    table = "\n".join(f"|{k}|{v}|" for k, v in {**asdict(args), "learners": n}.items())
    writer.add_text("hyperparameters", f"|param|value|\n|-|-|\n{table}")
    return writer


# ----------------------------------------------------------------------------------------------------------------
# main: the single-machine launch (learner processes + a monitor) or one torchrun rank
# ----------------------------------------------------------------------------------------------------------------


def main(args: Args) -> None:
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    n = world_size if world_size > 1 else args.num_learners
    if error := validate(args, n):
        print(f"error: {error}", file=sys.stderr)
        raise SystemExit(2)
    if world_size > 1 and args.time_varying:
        print(
            "error: --time-varying needs the single-machine launch (torchrun ranks use a static ring)", file=sys.stderr
        )
        raise SystemExit(2)
    # one thread here: an OpenMP pool started in this process would deadlock the forked learners' first torch op
    torch.set_num_threads(1)
    obs_space, act_space = probe_spaces(args)
    meta = checkpoint_meta(args, obs_space, act_space)
    checkpoint = None
    if args.resume:  # checked before any process, thread or writer starts: a refused resume leaves no trace
        checkpoint, error = read_checkpoint(args.resume, meta)
        if error:
            print(error, file=sys.stderr)
            raise SystemExit(2)
        if len(checkpoint["learners"]) != n:
            print(f"error: --resume {args.resume} has {len(checkpoint['learners'])} learners, not {n}", file=sys.stderr)
            raise SystemExit(2)
    if world_size > 1:
        return main_distributed(args, n, checkpoint, obs_space, act_space, meta)
    run_dir, error = create_run_dir(args)
    if error:
        print(error, file=sys.stderr)
        raise SystemExit(2)
    return main_single_machine(args, n, checkpoint, run_dir, obs_space, act_space, meta)


STOP_GRACE = 5.0  # seconds a learner gets to stop after the stop request before it is killed


def main_single_machine(args: Args, n: int, checkpoint: dict | None, run_dir: Path, obs_space, act_space, meta) -> None:
    use_cuda = args.cuda and torch.cuda.is_available()
    device = torch.device("cuda" if use_cuda else "cpu")
    torch.manual_seed(args.seed)
    numel = sum(p.numel() for p in make_model(obs_space, act_space, args.network).parameters())

    ctx = mp.get_context("spawn" if use_cuda else "fork")  # CUDA cannot be used in forked children
    shared = SharedMemoryGossip(ctx, n, numel, device) if args.mode == "gossip" else None
    log_q, error_q, stop, requests = ctx.Queue(), ctx.Queue(), ctx.Event(), ctx.Value("q", 0)
    port = free_port() if args.mode == "allreduce" else 0
    procs = [
        ctx.Process(
            target=learner_process,
            args=(i, n, args, str(device), shared, log_q, error_q, stop, requests, port, os.getpid()),
            name=f"learner {i}",
            daemon=True,
        )
        for i in range(n)
    ]
    print(
        f"run directory: {run_dir}  ({n} learners x {args.num_envs} envs, {args.mode}"
        f"{f', {args.num_peers}-peer ring, tau {args.max_staleness}' if args.mode == 'gossip' else ''}, {device})",
        flush=True,
    )

    signals: list[int] = []  # the signal that asked the run to stop

    def on_signal(signum, frame):
        signals.append(signum)
        stop.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    # children start with SIGINT/SIGTERM blocked, then ignore them: the main process stops them through `stop`
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        for p in procs:
            p.start()
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})

    writer, logger = None, None
    finals: dict[int, dict | None] = {}
    latest_states: list[dict | None] = list(checkpoint["learners"]) if checkpoint else [None] * n
    pending: dict[int, dict] = {}  # checkpoint request -> {learner: state}
    write_errors: list[str] = []  # a checkpoint or TensorBoard write failed (full disk): the run stops
    last_checkpoint, failure, killed = time.time(), None, []

    def handle(record: dict) -> None:
        i = record["learner"]
        if "final" in record:
            finals[i] = state_from_bytes(record["final"])
            if finals[i] is not None:
                latest_states[i] = finals[i]
        elif "checkpoint" in record:
            got = pending.setdefault(record["request"], {})
            got[i] = state_from_bytes(record["checkpoint"])
            if len(got) == n:
                if error := save_checkpoint(run_dir, [got[j] for j in range(n)], args, meta):
                    write_errors.append(error)
                pending.clear()
                for j in range(n):
                    latest_states[j] = got[j]
        elif logger is not None and not write_errors:
            try:
                logger.handle(record)
            except OSError as e:
                write_errors.append(write_error(e, f"the TensorBoard events in {run_dir}"))

    def drain(timeout: float) -> None:
        try:
            handle(log_q.get(timeout=timeout) if timeout else log_q.get_nowait())
            while True:
                handle(log_q.get_nowait())
        except queue.Empty:
            pass

    def dead_learner() -> str | None:
        watched = [p for p in procs if p.name not in killed]  # killed here for not stopping: not a failure
        ready = wait_sentinels([p.sentinel for p in watched], timeout=0)
        for p in (p for p in watched if p.sentinel in ready):
            p.join(timeout=5.0)  # the sentinel can fire before the exit status is set (seen with CUDA learners)
            if p.exitcode != 0:
                try:  # its traceback, if it lived to send one
                    return error_q.get(timeout=2.0)
                except queue.Empty:
                    how = f"killed by signal {-p.exitcode}" if p.exitcode < 0 else f"exit status {p.exitcode}"
                    return f"error: {p.name} died ({how}); stopping the run"
        return None

    try:
        writer = make_writer(run_dir, args, n)  # inside the try: whatever fails from here on stops the learners
        logger = Logger(writer, n, args, checkpoint["global_step"] if checkpoint else 0)
        while len(finals) < n and not signals and not write_errors:
            drain(0.25)
            if failure := dead_learner():
                break
            logger.maybe_print()
            if args.checkpoint_interval and time.time() - last_checkpoint >= args.checkpoint_interval:
                with requests.get_lock():
                    requests.value += 1
                last_checkpoint = time.time()
    except OSError as e:  # the writer could not start (full disk, directory removed)
        failure = write_error(e, f"the TensorBoard events in {run_dir}")
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl+C must not cut the shutdown short
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        stop.set()
        deadline = time.time() + (STOP_GRACE if failure is None else 1.0)
        while any(p.is_alive() for p in procs) and time.time() < deadline:
            drain(0.1)
            if failure is None and (failure := dead_learner()):
                deadline = min(deadline, time.time() + 1.0)
        for p in procs:
            if p.is_alive():  # stuck (stopped, or blocked on a peer that is): the run must still end
                killed.append(p.name)
                p.kill()
            p.join(timeout=2.0)
        drain(0.0)
        if failure is None:
            failure = dead_learner()
    failure = failure or (write_errors[0] if write_errors else None)
    end_run(
        args, run_dir, writer, logger, latest_states, finals, failure, signals, killed, (obs_space, act_space, meta)
    )


def end_run(args, run_dir, writer, logger, latest_states, finals, failure, signals, killed, spaces) -> None:
    """After every learner stopped: the final checkpoint, --save-model and --eval-episodes, the writer closed, the
    exit status (1 on a failure, 128 + signal number when stopped by a signal). Nothing here raises: a write that
    fails is reported as the run's error."""
    obs_space, act_space, meta = spaces
    n = len(latest_states)
    finished = failure is None and not signals and len(finals) == n and all(finals.values())
    complete = all(s is not None for s in latest_states)
    if failure is None and args.checkpoint_interval and complete:
        failure = save_checkpoint(run_dir, latest_states, args, meta)
    try:
        if logger is not None:
            logger.maybe_print(force=True)
        if finished and failure is None:
            failure = finish_run(args, run_dir, writer, latest_states, obs_space, act_space)
        if writer is not None:
            writer.close()
    except OSError as e:
        failure = failure or write_error(e, f"the TensorBoard events in {run_dir}")
    if killed:
        print(f"warning: {', '.join(killed)} did not stop within {STOP_GRACE:.0f} s; killed", file=sys.stderr)
    if failure:
        print(failure, file=sys.stderr)
        raise SystemExit(1)
    if signals:
        step = logger.global_step if logger is not None else 0
        print(f"interrupted at step {step}: shut down", file=sys.stderr)
        raise SystemExit(128 + signals[0])


def main_distributed(args: Args, n: int, checkpoint: dict | None, obs_space, act_space, meta) -> None:
    """One torchrun rank = one learner; rank 0 also writes the run's charts and checkpoints."""
    rank, local_rank = int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", "0"))
    use_cuda = args.cuda and torch.cuda.is_available()
    device = torch.device(f"cuda:{local_rank % torch.cuda.device_count()}" if use_cuda else "cpu")
    run_dir = None
    if rank == 0:  # before the rendezvous: the other ranks are stopped by torchrun when this one exits 2
        run_dir, error = create_run_dir(args)
        if error:
            print(error, file=sys.stderr)
            raise SystemExit(2)
    dist.init_process_group("nccl" if use_cuda else "gloo", rank=rank, world_size=n)
    names = [str(run_dir)]
    dist.broadcast_object_list(names, src=0)  # one run directory, named by rank 0
    run_dir = Path(names[0])

    stop, signals, last_checkpoint, write_errors = threading.Event(), [], [time.time()], []

    def on_signal(signum, frame):
        signals.append(signum)
        stop.set()

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    writer = make_writer(run_dir if rank == 0 else run_dir / f"learner{rank}", args, n)
    logger = Logger(writer, n, args, checkpoint["global_step"] if checkpoint else 0)

    def checkpoint_due() -> bool:
        due = (
            rank == 0 and args.checkpoint_interval > 0 and time.time() - last_checkpoint[0] >= args.checkpoint_interval
        )
        return due

    def report(record: dict) -> None:  # called by every rank at the same sync points
        states = [None] * n if rank == 0 else None
        dist.gather_object(record.pop("checkpoint", None), states, dst=0)
        totals = torch.tensor([float(record["steps"])], device=device)
        dist.all_reduce(totals)  # exact global step: all ranks' agent steps
        try:
            logger.handle({**record, "steps": int(totals.item())})
        except OSError as e:
            write_errors.append(write_error(e, f"the TensorBoard events in {run_dir}"))
        if rank == 0:
            if states[0] is not None:
                if error := save_checkpoint(run_dir, states, args, meta):
                    write_errors.append(error)
                last_checkpoint[0] = time.time()
            logger.maybe_print()
        if write_errors:
            stop.set()  # all ranks stop together at the next sync point

    control = Control(report=report, stop=stop, checkpoint_due=checkpoint_due)  # rank 0 decides, the sync tells all
    gossip = None
    if args.mode == "gossip":
        numel = sum(p.numel() for p in make_model(obs_space, act_space, args.network).parameters())
        group = dist.new_group(backend="nccl" if use_cuda else "gloo")  # every rank makes it, in the same order
        gossip = DistributedEndpoint(rank, n, args.num_peers, args.max_staleness, numel, device, group)
    failure = None
    try:
        final = learner_loop(
            rank, n, args, device, gossip, control, checkpoint["learners"][rank] if checkpoint else None, True
        )
    except NonFiniteLoss as e:
        failure = f"error: learner {rank}: {e}; stopping (the last checkpoint, if any, is kept)"
    except Exception as e:
        failure = lost_contact(rank, n, e) or f"error: learner {rank} died:\n{traceback.format_exc()}"
    if failure:  # the other ranks would wait forever on this one: torchrun stops them when this rank exits non-zero
        print(failure, file=sys.stderr, flush=True)
        try:
            writer.close()
        except OSError:
            pass
        sys.stdout.flush()
        # The gossip receivers are blocked inside `dist.recv`: tearing the interpreter down around a thread inside
        # torch aborts ("terminate called without an active exception", SIGABRT) or hangs, so skip the teardown.
        os._exit(1)
    states = [None] * n if rank == 0 else None
    dist.gather_object(final, states, dst=0)
    if args.mode == "allreduce":  # every learner must hold the same parameters (identical averaged gradients)
        flat = torch.cat([p.reshape(-1) for p in final["model"].values()]).to(device)
        reference = flat.clone()
        dist.broadcast(reference, src=0)
        divergence = (flat - reference).abs().max()
        dist.all_reduce(divergence, op=dist.ReduceOp.MAX)
        if rank == 0:
            print(f"max |parameter difference| across {n} learners: {divergence.item():.3g}")
    dist.barrier()  # no rank leaves the group while a peer may still be sending to it
    dist.destroy_process_group()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    failure = write_errors[0] if write_errors else None
    try:
        if rank == 0:  # the final checkpoint, --save-model, --eval-episodes, the exit status
            spaces = (obs_space, act_space, meta)
            end_run(args, run_dir, writer, logger, states, dict(enumerate(states)), failure, signals, [], spaces)
        else:
            try:
                writer.close()
            except OSError as e:
                failure = failure or write_error(e, f"the TensorBoard events in {run_dir / f'learner{rank}'}")
            if failure:
                print(failure, file=sys.stderr)
        code = 1 if failure else 128 + signals[0] if signals else 0
    except SystemExit as e:
        code = e.code
    exit_without_teardown(code)


def exit_without_teardown(code: int) -> None:
    """End a torchrun rank. gloo's transport and worker threads (`gloo_tcp_loop`, `pt_gloo_runloop`) are still alive
    after destroy_process_group (the C++ process group stays referenced), and the interpreter's teardown destroys
    them while joinable: now and then the rank aborts at exit ("terminate called without an active exception",
    SIGABRT). Everything is written and closed by now, so leave without that teardown."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def lost_contact(rank: int, n: int, e: BaseException) -> str | None:
    """The error line when a collective or gossip message failed because another rank is gone (killed, crashed, its
    machine down): with two ranks it can only be the other one; with more, this rank cannot tell which."""
    text = f"{e}"
    signs = ("Connection closed by peer", "Connection reset", "Broken pipe", "Timed out", "timed out", "gossip thread")
    if not isinstance(e, dist.DistError) and not any(m in text for m in signs):
        return None
    who = f"rank {1 - rank}" if n == 2 else "another rank"
    reason = (text.strip().splitlines() or [""])[0][:160]
    return f"error: learner {rank} (rank {rank}): lost contact with {who}, which died or lost its connection ({reason})"


if __name__ == "__main__":
    main(tyro.cli(Args))
