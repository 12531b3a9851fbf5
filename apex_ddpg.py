"""Ape-X DDPG ("Ape-X DPG"): distributed prioritized experience replay (Horgan et al., "Distributed Prioritized
Experience Replay", ICLR 2018, Appendix D) for continuous control, with DDPG's actor and critic (Lillicrap et al. 2016)
and the replay distributed across the actors as in Machin's Ape-X: every actor owns a prioritized buffer with its own
sum-tree and lock, the learner samples across buffers in proportion to their priority sums, and priority updates carry
per-slot versions ("taint"), so a slot overwritten since it was sampled keeps its new priority. Ape-X DQN (discrete
actions) is `apex_dqn.py`: this file with DQN's actor and learner.

  actor i (process, CPU): mu(s) + noise of scale sigma (N - i) / N (Gaussian or OU) on --num-envs-per-actor envs
      -> n-step transitions, initial priorities |TD| from its local networks every --actor-batch
      -> append to buffer i (shared memory, under buffer i's lock; no global lock)
      -> ActorReport (steps, episodes) on log_q -> main process (the only TensorBoard writer)
  learner (main process, GPU if any): priority sums of all buffers -> split the batch -> sample each buffer
      -> IS-weighted n-step critic update, deterministic policy gradient, soft target updates
      -> new priorities back where slot versions match
      -> ParamStore (flat shared tensor + version) -> pulled by actors every --actor-update-interval steps
  evaluator (process): noise-free episodes every --eval-interval agent steps -> EvalReport on log_q (the run's
      end waits for the round due at the last boundary it crossed)
  torchrun: rank 0 is the learner and the evaluator; rank 0 builds an ActorHost on every other rank over rpc
      (`--num-actors` actors and their buffers) and calls it for buffer statistics, samples and priority updates,
      and every 0.25 s to exchange parameters (out) for actor reports (back).

Policy lag (`charts/policy_lag`): learner updates between the parameters that generated a sampled transition and the
update that learns from it (batch mean); unbounded: it grows with replay age and --actor-update-interval.
Determinism: none (actors, learner and evaluator race on the replay); the pure functions are deterministic.
--resume restores the networks, optimizers and step count; the replay starts empty and refills to --learning-starts.

  python apex_ddpg.py --env-id Pendulum-v1 --num-actors 2 --total-timesteps 40000 --buffer-size 40000 \\
      --learning-starts 2000 --batch-size 128 --critic-learning-rate 1e-3 --actor-learning-rate 1e-3 \\
      --actor-update-interval 50 --replay-ratio 64 --eval-interval 4000 --n-step 3 --anneal-beta
  torchrun --standalone --nproc-per-node 3 apex_ddpg.py --env-id Pendulum-v1 --num-actors 2  # learner + 2 actor ranks
  python apex_ddpg.py --eval-only runs/<run>/model.pt --eval-episodes 10 --capture-video     # a saved agent
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
import errno
import fcntl
import functools
import hashlib
import io
import itertools
import json
import logging
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
from pathlib import Path
from typing import Literal, NamedTuple, NoReturn

import gymnasium as gym
import numpy as np
import torch
import torch.multiprocessing as mp
import tyro
from torch import nn
from torch.distributed import rpc

from common.atari import EnvError, check_video, finished_episodes, make_env, make_vector_env
from common.models import make_ddpg_model

ALGORITHM = "Ape-X DDPG"
LOCK_TIMEOUT = 5.0  # seconds a replay buffer's lock may be held before the learner gives up on it
RPC_PERIOD = 0.25  # seconds between rank 0's exchanges with the actor hosts (torchrun), and between liveness checks
HOST_SETUP_TIMEOUT = 600.0  # seconds an actor host may take to allocate its buffers and start its actors
HOST_STOP_GRACE = 3.0  # seconds rank 0 waits for its own stop signal once an actor host is gone (torchrun's stop)

# ---- Args ----


@dataclass
class Args:
    exp_name: str = Path(__file__).stem
    """name of this experiment (part of the run directory)"""
    seed: int = 1
    """seed of the experiment"""
    torch_deterministic: bool = True
    """use deterministic torch algorithms"""
    cuda: bool = True
    """train the learner on a GPU when one is present (actors and the evaluator act on the CPU, as in Ape-X)"""
    env_id: str = "Pendulum-v1"
    """gymnasium id with flat observations and a bounded 1-D Box action space"""
    total_timesteps: int = 10_000_000
    """agent steps summed over all envs of all actors"""
    log_dir: str = "runs"
    """where run directories go"""
    save_model: bool = False
    """write the final model's state_dict to {run_dir}/model.pt"""
    checkpoint_interval: float = 600.0
    """seconds between checkpoints to {run_dir}/checkpoint.pt, also written at the end and at Ctrl+C (0 = none)"""
    resume: str | None = None
    """a checkpoint.pt to continue: its networks, optimizers, run directory and step count (the replay starts empty)"""
    eval_episodes: int = 0
    """episodes played by the final policy after training, logged as eval/episodic_return (--eval-only: 0 plays 10)"""
    eval_greedy: bool = True
    """evaluate with mu(s), no noise (Ape-X DPG); `--no-eval-greedy` adds actor 0's Gaussian --exploration-noise"""
    eval_only: str | None = None
    """evaluate a model.pt or checkpoint.pt of this script instead of training, with its run's env and network widths"""
    capture_video: bool = False
    """record the evaluation episodes to {run_dir}/videos (--eval-only: {model dir}/videos-eval-{unix time})"""
    track: bool = False
    """log the run to Weights & Biases (TensorBoard, Args, videos); needs `pip install -e ".[track]"`"""
    wandb_project_name: str = "actorlearners"
    """Weights & Biases project of --track"""
    wandb_entity: str | None = None
    """Weights & Biases entity (team or user) of --track; None: your default entity"""
    num_actors: int = 4
    """actor processes (under torchrun: per actor rank); each owns one replay buffer"""
    num_envs_per_actor: int = 1
    """envs each actor steps with one batched forward pass (Ape-X: 1)"""
    torch_threads: int = 1
    """torch intra-op threads of the learner (0: torch's); 1: the actors use the cores, more threads slow the update"""
    actor_torch_threads: int = 1
    """torch intra-op threads of each actor and of the evaluator"""
    hidden_sizes: tuple[int, ...] = (256, 256)
    """ReLU MLP widths of the actor and of the critic"""
    # Horgan et al. 2018, Appendix D (Ape-X DPG), the rest as in Appendix C: our reading, not checked against the
    # paper's text (RESULTS.md, Differences from the papers)
    buffer_size: int = 100_000
    """replay capacity over all actors, split evenly"""
    actor_batch: int = 50
    """transitions an actor collects before computing their priorities and appending them (Ape-X: B = 50)"""
    actor_update_interval: int = 400
    """agent steps an actor plays between parameter pulls, over its envs (Ape-X: 400 frames, one frame a step here)"""
    learning_starts: int = 50_000
    """transitions in the replay (all buffers) before the learner starts (Ape-X: 50,000)"""
    batch_size: int = 512
    """learner batch (Ape-X: 512), split across the buffers by their priority sums"""
    n_step: int = 5
    """n of the n-step returns (Ape-X DPG: 5)"""
    gamma: float = 0.99
    """discount factor"""
    priority_alpha: float = 0.6
    """priority exponent alpha: P(i) ~ p_i^alpha (Ape-X: 0.6)"""
    priority_beta: float = 0.4
    """importance-sampling exponent beta, fixed over the run as in Ape-X (0.4); see --anneal-beta"""
    anneal_beta: bool = False
    """anneal beta linearly from --priority-beta to 1 over the run (Schaul et al. 2016; Ape-X keeps it fixed)"""
    priority_eps: float = 1e-6
    """added to |TD error| so that no transition has priority 0"""
    critic_learning_rate: float = 1e-4
    """Adam learning rate of the critic (Ape-X DPG: 1e-4)"""
    actor_learning_rate: float = 1e-4
    """Adam learning rate of the actor (Ape-X DPG: 1e-4)"""
    adam_eps: float = 1e-8
    """Adam epsilon"""
    max_grad_norm: float = 40.0
    """clip each network's gradients to this global norm (Ape-X: 40)"""
    tau: float = 0.005
    """soft target update rate, target <- tau online + (1 - tau) target"""
    exploration_noise: float = 0.3
    """action-noise scale of actor 0 as a fraction of the half action range; actor i uses sigma (N - i) / N"""
    noise_type: Literal["gaussian", "ou"] = "gaussian"
    """`gaussian` or `ou` (Ornstein-Uhlenbeck, Lillicrap et al. 2016) action noise"""
    ou_theta: float = 0.15
    """mean reversion of the OU noise"""
    replay_ratio: float = 0.0
    """sampled transitions per agent step past --learning-starts, a rate limiter like Reverb's SampleToInsertRatio
    that holds both sides (each machine's actors under torchrun); 0 = off, actors and learner run free as in Ape-X.
    CPU-only runs need it, or actors starve the learner"""
    eval_interval: int = 100_000
    """agent steps between noise-free evaluation rounds in training (0 = off); the run ends after the last one due"""
    eval_interval_episodes: int = 5
    """episodes per evaluation round during training"""
    log_frequency: int = 10
    """learner updates per TensorBoard point for losses, lag and replay statistics (averaged over them)"""
    log_interval: float = 10.0
    """seconds between console lines"""


# ---- Algorithm ----


def critic_td_errors(online: nn.Module, target: nn.Module, data: Transitions) -> tuple[torch.Tensor, torch.Tensor]:
    """n-step TD errors [B] of the critic, y = R + gamma^n Q'(s', mu'(s')) (Ape-X DPG), and Q(s, a) [B],
    differentiable through `online`'s critic. The learner passes its target networks; an actor computing initial
    priorities passes its one local copy twice."""
    q = online.q(data.obs, data.actions)  # [B]
    with torch.no_grad():
        y = data.returns + data.discounts * target.q(data.next_obs, target(data.next_obs))
    return y - q, q


def critic_loss(online: nn.Module, target: nn.Module, data: Transitions, weights: torch.Tensor):
    """The critic's loss (Ape-X DPG): the importance-sampling-weighted squared n-step TD error; also the TD errors [B]
    (the new priorities) and Q(s, a) [B]."""
    td, q = critic_td_errors(online, target, data)
    return 0.5 * (weights * td.pow(2)).mean(), td, q


def actor_loss(model: nn.Module, obs: torch.Tensor) -> torch.Tensor:
    """-Q(s, mu(s)) over the batch: its gradient is the deterministic policy gradient (Silver et al. 2014, Eq. 6)."""
    return -model.q(obs, model(obs)).mean()


def priorities_of(td: torch.Tensor, alpha: float, eps: float) -> np.ndarray:
    """Stored priorities p^alpha with p = |delta| + eps (Schaul et al. 2016, proportional variant)."""
    return ((td.detach().abs().double() + eps) ** alpha).cpu().numpy()


@torch.no_grad()
def soft_update(target: nn.Module, online: nn.Module, tau: float) -> None:
    """theta' <- tau theta + (1 - tau) theta' (Lillicrap et al. 2016)."""
    for t, o in zip(target.parameters(), online.parameters(), strict=True):
        t.lerp_(o, tau)


class Learner:
    """Ape-X DPG's learner: actor and critic, their target networks and Adam optimizers; `step` is one pass of the
    learner's loop (Ape-X's Algorithm 2 with DDPG's update), in the paper's order."""

    def __init__(self, args: Args, obs_space, act_space, device: torch.device):
        self.args, self.device = args, device
        self.model = build_model(args, obs_space, act_space).to(device)
        self.target = build_model(args, obs_space, act_space).to(device)
        self.target.load_state_dict(self.model.state_dict())
        self.target.requires_grad_(False)
        self.version = 0  # learner updates so far
        self.learning_rate = args.critic_learning_rate  # charts/learning_rate (the critic's)
        self.optimizers = {
            "critic": torch.optim.Adam(self.model.critic.parameters(), args.critic_learning_rate, eps=args.adam_eps),
            "actor": torch.optim.Adam(self.model.actor.parameters(), args.actor_learning_rate, eps=args.adam_eps),
        }

    def step(self, replay, beta: float, rng: np.random.Generator, stats: ReplayStats) -> dict[str, float]:
        """Algorithm 2, lines 4-10: sample a prioritized batch across the buffers, take one critic step on its
        IS-weighted squared TD error and one actor step on the deterministic policy gradient, write the batch's new
        priorities back, and move the target networks (a soft update every step, DDPG's). (Line 11, RemoveToFit, has
        nothing to do: each buffer is a ring that overwrites its oldest transitions.) Returns the update's
        statistics; `stale_updates` counts the priorities not written because their slots were overwritten."""
        args = self.args
        batch = sample_batch(replay, args.batch_size, beta, rng, stats)  # id, tau <- Replay.Sample()
        data = Transitions(*(t.to(self.device, non_blocking=True) for t in batch.data))
        value_loss, td, q = critic_loss(self.model, self.target, data, batch.weights.to(self.device))  # l_t
        grad_norm = self.gradient_step("critic", value_loss)  # theta_t+1 <- UpdateParameters(l_t; theta_t)
        policy_loss = actor_loss(self.model, data.obs)
        self.gradient_step("actor", policy_loss)
        priorities = priorities_of(td, args.priority_alpha, args.priority_eps)  # p <- ComputePriorities()
        stale = replay.update(split_updates(batch, priorities, len(stats.sizes)))  # Replay.SetPriority(id, p)
        soft_update(self.target, self.model, args.tau)  # the target networks
        lag = self.version - data.policy_version.double().mean()  # updates between the acting parameters and this
        values = {"losses/value_loss": value_loss, "losses/policy_loss": policy_loss,
                  "losses/total_loss": value_loss + policy_loss, "losses/grad_norm": grad_norm,
                  "losses/q_values": q.mean(), "charts/policy_lag": lag}  # fmt: skip
        scalars = dict(zip(values, torch.stack([v.detach().double() for v in values.values()]).tolist(), strict=True))
        self.version += 1
        return dict(scalars, stale_updates=stale)

    def gradient_step(self, name: str, loss: torch.Tensor) -> torch.Tensor:
        """One clipped Adam step of the `name` network (critic or actor); its gradient norm before clipping."""
        self.optimizers[name].zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = nn.utils.clip_grad_norm_(getattr(self.model, name).parameters(), self.args.max_grad_norm)
        self.optimizers[name].step()
        return grad_norm.detach()

    def flat_params(self) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1) for p in self.model.parameters()])  # logical order, any layout

    def state_dict(self) -> dict:
        optimizers = {k: o.state_dict() for k, o in self.optimizers.items()}
        return dict(model=self.model.state_dict(), target=self.target.state_dict(), optimizers=optimizers,
                    version=self.version)  # fmt: skip

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.target.load_state_dict(state["target"])
        for k, o in self.optimizers.items():
            o.load_state_dict(state["optimizers"][k])
        self.version = state["version"]


def noise_scales(num_actors: int, sigma: float) -> list[float]:
    """Actors' noise scales, evenly spread from sigma (actor 0) down to sigma / N (the last actor)."""
    return [sigma * (num_actors - i) / num_actors for i in range(num_actors)]


def ou_step(state: np.ndarray, theta: float, sigma: float, rng: np.random.Generator) -> np.ndarray:
    """One Ornstein-Uhlenbeck step with dt = 1 and mean 0: x <- x - theta x + sigma N(0, 1)."""
    return state - theta * state + sigma * rng.standard_normal(state.shape)


def importance_exponent(beta: float, anneal: bool, progress: float) -> float:
    """The IS exponent at `progress` in [0, 1]: beta (Ape-X), or linear from beta to 1 (Schaul et al. 2016, 3.4)."""
    return beta + (1.0 - beta) * min(1.0, progress) if anneal else beta


def tree_capacity(capacity: int) -> int:
    """Leaves of the sum/min trees: the next power of two >= capacity (trees are flat arrays of 2x that size)."""
    return 1 << max(0, capacity - 1).bit_length()


def tree_update(tree: np.ndarray, leaves: np.ndarray, values: np.ndarray, reduce) -> None:
    """Set `tree`'s leaves [k] to values [k] and recompute their ancestors with `reduce` (np.add or np.minimum).

    `tree` is a flat [2P] array: node j has children 2j and 2j+1, the root is 1, leaf i is P + i."""
    P = len(tree) // 2
    nodes = np.asarray(leaves, dtype=np.int64) + P
    tree[nodes] = values
    nodes = np.unique(nodes)
    while nodes[0] > 1:  # all leaves sit at the same depth: one level per pass, each parent once
        nodes = np.unique(nodes >> 1)
        tree[nodes] = reduce(tree[2 * nodes], tree[2 * nodes + 1])


def ring_runs(start: int, k: int, capacity: int) -> Iterator[tuple[int, int, int]]:
    """Rows 0..k-1 written to a ring of `capacity` slots from slot `start`: (first row, first slot, count) of each run
    of consecutive slots, in order (a later row overwrites an earlier one in the same slot)."""
    row = 0
    while row < k:
        slot = (start + row) % capacity
        count = min(k - row, capacity - slot)
        yield row, slot, count
        row += count


def tree_find_prefix(tree: np.ndarray, prefix: np.ndarray) -> np.ndarray:
    """Sum-tree search: for each prefix [k] in [0, total), the leaf i with sum(p[:i]) <= prefix < sum(p[:i+1])."""
    P = len(tree) // 2
    nodes = np.ones(len(prefix), dtype=np.int64)
    prefix = np.asarray(prefix, dtype=np.float64).copy()
    while P > 1 and nodes[0] < P:
        left = tree[2 * nodes]
        right = prefix >= left
        prefix -= np.where(right, left, 0.0)
        nodes = 2 * nodes + right
    return nodes - P


def importance_weights(priorities: np.ndarray, min_priority: float, beta: float) -> np.ndarray:
    """w_i = (N P(i))^-beta / max_j (N P(j))^-beta with P(i) = p_i / sum p (Schaul et al. 2016, Section 3.4);
    N and sum p cancel: w_i = (p_i / p_min)^-beta, p_min the smallest priority in *all* buffers."""
    return (np.asarray(priorities, dtype=np.float64) / min_priority) ** -beta


class NStepTransition(NamedTuple):
    obs: np.ndarray  # s_t
    action: np.ndarray  # a_t
    ret: float  # sum_k gamma^k r_{t+k} over the window
    discount: float  # gamma^len(window), 0 after a terminal state
    next_obs: np.ndarray  # s_{t+len(window)}, the state to bootstrap from
    env: int  # which env: where its episode goes on, the env's next action is taken in next_obs
    value: float  # the actor's estimate of Q(s_t, a_t) as it acted, where it gave one (nan: none)


class NStepBuilder:
    """Per env, the last n (obs, action, reward, value); emits n-step transitions. At an episode end every pending
    start is emitted with its shortened window (discount 0 if terminated; a truncated episode bootstraps from its
    final observation)."""

    def __init__(self, num_envs: int, n: int, gamma: float):
        self.n, self.gamma = n, gamma
        self.windows = [deque() for _ in range(num_envs)]

    def push(self, obs, actions, rewards, terminated, truncated, next_obs, values=None) -> list[NStepTransition]:
        """One step of every env (`values` [num_envs]: the actor's Q(s_t, a_t), if it has them)."""
        out = []
        for e, window in enumerate(self.windows):
            window.append((obs[e], actions[e], float(rewards[e]), math.nan if values is None else float(values[e])))
            done = bool(terminated[e] or truncated[e])
            while window and (done or len(window) == self.n):
                ret = sum(self.gamma**k * r for k, (_, _, r, _) in enumerate(window))  # R = sum_k gamma^k r_k
                discount = 0.0 if terminated[e] else self.gamma ** len(window)  # to bootstrap with
                first_obs, action, _, value = window[0]
                out.append(NStepTransition(first_obs, action, ret, discount, next_obs[e], e, value))
                window.popleft()
                if not done:
                    break
        return out


# ---- Storage and messages ----


class Transitions(NamedTuple):  # n-step transitions [k, ...]: a buffer's slots, the learner's batch
    obs: torch.Tensor  # s_t
    actions: torch.Tensor  # a_t
    returns: torch.Tensor  # n-step discounted reward sums
    discounts: torch.Tensor  # gamma^n, or 0 after a terminal state
    next_obs: torch.Tensor  # s_{t+n}
    policy_version: torch.Tensor  # learner version of the parameters that acted (for the policy lag)


class Sample(NamedTuple):  # what one buffer gives to a batch
    data: Transitions
    slots: torch.Tensor
    versions: torch.Tensor  # the slots' versions when sampled
    priorities: torch.Tensor


class Batch(NamedTuple):
    data: Transitions  # [B, ...], all buffers' samples concatenated
    weights: torch.Tensor  # [B] importance-sampling weights
    slots: torch.Tensor  # [B] slot in its buffer
    versions: torch.Tensor  # [B] the slot's version when sampled
    buffer_ids: np.ndarray  # [B] the buffer each sample came from


class PriorityUpdate(NamedTuple):  # new priorities of one buffer's sampled slots, where their versions still match
    slots: torch.Tensor
    versions: torch.Tensor
    priorities: np.ndarray


class ReplayStats(NamedTuple):  # per buffer [K]
    priority_sums: np.ndarray  # the sum of its priorities
    min_priorities: np.ndarray  # its smallest priority
    sizes: np.ndarray

    @classmethod
    def concat(cls, stats: list[ReplayStats]) -> ReplayStats:
        return cls(*(np.concatenate(column) for column in zip(*stats, strict=True)))


class ActorReport(NamedTuple):  # actor -> main on log_q, after every append and once at the end
    actor: int  # global actor id
    steps: int  # agent steps since the last report
    episodes: list[tuple[float, int]]  # (return, length) of the games finished since
    done: bool  # the actor has used up its share of --total-timesteps


class EvalReport(NamedTuple):  # evaluator -> main on log_q: one evaluation round
    step: int
    returns: list[float]


class WorkerFailed(NamedTuple):  # actor host -> rank 0: the error line of one of its processes that died
    error: str


class PrioritizedBuffer:
    """A ring buffer of n-step transitions with a sum-tree and a min-tree over priorities p^alpha, in shared memory
    (preallocated tensors; the trees are flat [2P] float64 arrays) behind one lock of its own. `slot_version[i]` is
    incremented every time slot i is overwritten (Machin's taint table): a priority update carries the versions seen
    at sampling and is skipped where they changed."""

    def __init__(self, capacity: int, obs_shape, obs_dtype, action_shape, action_dtype, lock):
        self.capacity, self.lock = capacity, lock
        self.data = Transitions(
            obs=torch.zeros((capacity, *obs_shape), dtype=obs_dtype),
            actions=torch.zeros((capacity, *action_shape), dtype=action_dtype),
            returns=torch.zeros(capacity),
            discounts=torch.zeros(capacity),
            next_obs=torch.zeros((capacity, *obs_shape), dtype=obs_dtype),
            policy_version=torch.zeros(capacity, dtype=torch.int64),
        )
        self.slot_version = torch.zeros(capacity, dtype=torch.int64)
        P = tree_capacity(capacity)
        self.sum_tree = torch.zeros(2 * P, dtype=torch.float64)
        self.min_tree = torch.full((2 * P,), math.inf, dtype=torch.float64)
        self.next_slot = torch.zeros((), dtype=torch.int64)
        self.size = torch.zeros((), dtype=torch.int64)
        for t in (*self.data, self.slot_version, self.sum_tree, self.min_tree, self.next_slot, self.size):
            t.share_memory_()

    def append(self, data: Transitions, priorities: np.ndarray) -> None:
        """Write k transitions with their priorities p^alpha [k]."""
        k = len(priorities)
        with hold(self.lock, "a replay buffer"):
            slots = (int(self.next_slot) + torch.arange(k)) % self.capacity
            for row, slot, count in ring_runs(int(self.next_slot), k, self.capacity):
                for stored, new in zip(self.data, data, strict=True):
                    stored[slot : slot + count] = new[row : row + count]  # whole rows (a slot tensor: byte by byte)
            self.slot_version[slots] += 1
            tree_update(self.sum_tree.numpy(), slots.numpy(), priorities, np.add)
            tree_update(self.min_tree.numpy(), slots.numpy(), priorities, np.minimum)
            self.next_slot.fill_((int(self.next_slot) + k) % self.capacity)
            self.size.fill_(min(int(self.size) + k, self.capacity))

    def stats(self) -> ReplayStats:
        with hold(self.lock, "a replay buffer"):
            return ReplayStats(self.sum_tree[1:2].numpy(), self.min_tree[1:2].numpy(), self.size[None].numpy())

    def sample(self, count: int, rng: np.random.Generator) -> Sample:
        """`count` slots in proportion to their priority, stratified over [0, total) (Schaul et al. 2016, B.2.1)."""
        with hold(self.lock, "a replay buffer"):
            tree = self.sum_tree.numpy()
            prefix = (np.arange(count) + rng.random(count)) * (tree[1] / count)
            slots = np.minimum(tree_find_prefix(tree, prefix), int(self.size) - 1)  # float round-off can pass the end
            index = torch.from_numpy(slots)
            return Sample(
                data=Transitions(*(t.index_select(0, index) for t in self.data)),  # whole rows, as append writes them
                slots=index,
                versions=self.slot_version[index],
                priorities=torch.from_numpy(tree[len(tree) // 2 + slots]),
            )

    def update_priorities(self, update: PriorityUpdate) -> int:
        """Set new priorities where the slot still holds the sampled transition; returns how many were stale."""
        with hold(self.lock, "a replay buffer"):
            fresh = (self.slot_version[update.slots] == update.versions).numpy()
            if fresh.any():
                keep = update.slots.numpy()[fresh]
                tree_update(self.sum_tree.numpy(), keep, update.priorities[fresh], np.add)
                tree_update(self.min_tree.numpy(), keep, update.priorities[fresh], np.minimum)
        return int((~fresh).sum())


def new_buffer(capacity: int, obs_space, act_space, lock) -> PrioritizedBuffer:
    """A buffer in shared memory for this env's transitions: float observations and actions."""
    return PrioritizedBuffer(capacity, obs_space.shape, torch.float32, act_space.shape, torch.float32, lock)


class LocalReplay:
    """The learner's view of the buffers in this machine's shared memory (and an actor host's view of its own)."""

    def __init__(self, buffers: list[PrioritizedBuffer], rng: np.random.Generator):
        self.buffers, self.rng = buffers, rng

    def stats(self) -> ReplayStats:
        return ReplayStats.concat([b.stats() for b in self.buffers])

    def sample(self, counts) -> list[Sample | None]:
        return [b.sample(int(c), self.rng) if c else None for b, c in zip(self.buffers, counts, strict=True)]

    def update(self, parts: list[PriorityUpdate | None]) -> int:
        return sum(b.update_priorities(p) for b, p in zip(self.buffers, parts, strict=True) if p is not None)

    def exchange(self, store: ParamStore) -> list:
        return []  # actors on this machine pull from the store and report on log_q themselves

    def close(self) -> None:
        pass


def sample_batch(replay, batch_size: int, beta: float, rng: np.random.Generator, stats: ReplayStats | None = None):
    """Sample across buffers: how many each gives is multinomial in their priority sums, then each samples by priority
    (drawing the buffer by its sum, then a slot by its priority within it, is exactly P(i) = p_i / sum_all p); IS
    weights normalised by the global maximum weight (from the smallest priority of all buffers). `stats`:
    `replay.stats()`, if just read."""
    stats = replay.stats() if stats is None else stats
    counts = rng.multinomial(batch_size, stats.priority_sums / stats.priority_sums.sum())  # [K]
    parts = [p for p in replay.sample(counts) if p is not None]
    priorities = torch.cat([p.priorities for p in parts]).numpy()
    min_priority = min(stats.min_priorities[stats.sizes > 0].min(), priorities.min())  # appends since stats()
    return Batch(
        data=Transitions(*(torch.cat(column) for column in zip(*(p.data for p in parts), strict=True))),
        weights=torch.from_numpy(importance_weights(priorities, min_priority, beta)).float(),
        slots=torch.cat([p.slots for p in parts]),
        versions=torch.cat([p.versions for p in parts]),
        buffer_ids=np.repeat(np.arange(len(counts)), counts),
    )


def split_updates(batch: Batch, priorities: np.ndarray, num_buffers: int) -> list[PriorityUpdate | None]:
    """Per buffer, its samples' new priorities, or None for a buffer that gave no sample."""
    masks = [batch.buffer_ids == k for k in range(num_buffers)]
    return [PriorityUpdate(batch.slots[m], batch.versions[m], priorities[m]) if m.any() else None for m in masks]


class ParamStore:
    """Versioned parameters: a flat shared tensor and its version under one lock, so a pull never mixes versions.
    Version = learner updates applied, -1 until the first publish (actors poll it: no event to set, which could
    block the learner as mp.Event.set does)."""

    def __init__(self, num_params: int, ctx):
        self.flat = torch.zeros(num_params).share_memory_()
        self.version = ctx.Value("q", -1, lock=False)
        self.lock = ctx.Lock()

    @torch.no_grad()  # a copy of parameters must not join their autograd graph
    def publish(self, flat: torch.Tensor, version: int) -> None:
        with hold(self.lock, "the parameter store"):
            self.flat.copy_(flat)
            self.version.value = version

    @torch.no_grad()
    def pull(self, params: list[torch.Tensor]) -> int:
        with hold(self.lock, "the parameter store"):
            for p, new in zip(params, self.flat.split([p.numel() for p in params]), strict=True):
                p.copy_(new.view_as(p))
            return self.version.value


class Shared:
    """Everything the processes of one machine share (tensors and locks in shared memory): a buffer per local actor,
    the parameter store, the queues and counters."""

    def __init__(self, args: Args, ctx, spaces, *, num_buffers: int, num_total: int, steps_limit: int,
                 start_step: int = 0):  # fmt: skip
        self.stop = StopFlag(ctx)  # the run is shutting down: set by the main process, polled by the others
        self.log_q = ctx.Queue()  # -> main: ActorReport, EvalReport
        self.error_q = ctx.Queue()  # -> main: "error: <who> died:\n<traceback>"
        self.steps_claimed = ctx.Value("q", start_step)  # under its lock: agent steps handed out (this machine's)
        self.steps_limit = steps_limit  # this machine's share of --total-timesteps
        # no locks where main is the only writer: a child stopped or killed holding one would block main forever
        self.global_step = ctx.Value("q", start_step, lock=False)  # agent steps the learner counted (evaluator's clock)
        self.learn_start = ctx.Value("d", math.nan, lock=False)  # the rate limiter's origin: set by start_rate_limit
        self.share = num_buffers / num_total  # this machine's share of the run's actors
        self.store = ParamStore(sum(p.numel() for p in build_model(args, *spaces).parameters()), ctx)
        self.buffers = [new_buffer(args.buffer_size // num_total, *spaces, ctx.Lock()) for _ in range(num_buffers)]
        self.parent_pid = os.getpid()


# ---- Workers ----


def build_model(args: Args, obs_space, act_space) -> nn.Module:
    return make_ddpg_model(obs_space, act_space, args.hidden_sizes)


def act(model: nn.Module, obs: np.ndarray, noise: np.ndarray | None = None) -> np.ndarray:
    """mu(s) [B, act_dim] for a [B, obs_dim] batch, plus `noise` in units of the half action range, clipped to the
    action bounds."""
    with torch.inference_mode():
        actions = model(torch.as_tensor(obs)).numpy()
    scale, bias = model.action_scale.numpy(), model.action_bias.numpy()
    if noise is not None:
        actions = actions + noise * scale
    return np.clip(actions, bias - scale, bias + scale).astype(np.float32)


def play_episodes(args: Args, model: nn.Module, env, episodes: int, rng: np.random.Generator) -> list[float]:
    """True returns of `episodes` evaluation episodes: noise-free, or with --no-eval-greedy actor 0's Gaussian noise
    (--exploration-noise)."""
    returns = []
    obs, _ = env.reset()
    while len(returns) < episodes:
        noise = None if args.eval_greedy else args.exploration_noise * rng.standard_normal(model.action_scale.shape)
        obs, _, terminated, truncated, info = env.step(act(model, np.asarray(obs)[None], noise)[0])
        if terminated or truncated:
            returns.append(float(info["episode"]["r"]))
            if len(returns) < episodes:  # no reset after the last episode: it would record an empty video
                obs, _ = env.reset()
    return returns


def claim_steps(shared: Shared, steps: int) -> bool:
    """Reserve agent steps within this machine's budget; False when none are left."""
    with shared.steps_claimed.get_lock():
        if shared.steps_claimed.value + steps > shared.steps_limit:
            return False
        shared.steps_claimed.value += steps
        return True


def start_rate_limit(args: Args, shared: Shared, version: int) -> None:
    """The origin of `--replay-ratio`'s actor side on this machine, set with the first parameters it publishes (the
    learner's `version`): its actors may claim their share of --learning-starts past the step they start from, then
    their share of the agent steps each learner update allows, as the learner's side (can_learn) counts."""
    if args.replay_ratio:
        allowed = args.learning_starts - version * args.batch_size / args.replay_ratio
        shared.learn_start.value = shared.steps_claimed.value + shared.share * allowed


def wait_for_learner(args: Args, shared: Shared, slack: int) -> None:
    """Rate limiter, actor side (`--replay-ratio`): sleep while this machine's agent steps run more than `slack` ahead
    of what the learner's samples allow (from start_rate_limit's origin)."""
    start = shared.learn_start.value
    if not args.replay_ratio or math.isnan(start):
        return
    per_update = shared.share * args.batch_size / args.replay_ratio  # this machine's agent steps per learner update
    sleep_until(
        shared, lambda: shared.steps_claimed.value - start - shared.store.version.value * per_update <= slack, 0.02
    )


def bootstrap_obs(next_obs: np.ndarray, done: np.ndarray, info: dict) -> np.ndarray:
    """The observations to bootstrap from: `next_obs`, except the last observation of each episode that ended (the
    SAME_STEP autoreset puts it in `final_obs`; an ALE life loss ends no game and has none)."""
    final = info.get("final_obs")
    if not done.any() or final is None:
        return next_obs
    out = next_obs.copy()
    for e in np.flatnonzero(done):
        if final[e] is not None:
            out[e] = final[e]
    return out


def actor_loop(actor: int, global_id: int, num_total: int, args: Args, shared: Shared) -> None:
    """One Ape-X actor (Horgan et al. 2018, Algorithm 1): act, build n-step transitions, prioritise them with the
    local network, append them to this actor's buffer, pull parameters every --actor-update-interval frames."""
    torch.set_num_threads(args.actor_torch_threads)
    n = args.num_envs_per_actor
    start = shared.steps_claimed.value  # > 0 after --resume: new episodes, not a replay of the first ones
    envs = make_vector_env(args.env_id, n, args.seed + 10_000 * global_id + start, num_threads=1)
    try:
        model = build_model(args, envs.single_observation_space, envs.single_action_space)
        params, rng = list(model.parameters()), np.random.default_rng([args.seed, global_id, start])
        sigma = noise_scales(num_total, args.exploration_noise)[global_id]
        noise = np.zeros((n, *envs.single_action_space.shape))
        buffer, builder = shared.buffers[actor], NStepBuilder(n, args.n_step, args.gamma)
        # unreported steps of all actors stay below this slack, so the learner is never blocked by it
        slack = 2 * len(shared.buffers) * n * (args.actor_batch + args.n_step)
        sleep_until(shared, lambda: shared.store.version.value >= 0, 0.05)  # the learner's first parameters
        version = shared.store.pull(params)
        since_pull, steps, episodes, pending = 0, 0, [], []
        obs, _ = envs.reset()
        while not should_stop(shared) and claim_steps(shared, n):
            if args.noise_type == "ou":
                noise = ou_step(noise, args.ou_theta, sigma, rng)
            else:
                noise = sigma * rng.standard_normal(noise.shape)
            actions = act(model, obs, noise)
            next_obs, reward, terminated, truncated, info = envs.step(actions)
            next_obs = next_obs.copy()  # transitions keep views of it
            real_next = bootstrap_obs(next_obs, terminated | truncated, info)
            noise[terminated | truncated] = 0.0  # each episode's OU process starts at its mean
            pending += builder.push(obs, actions, reward, terminated, truncated, real_next)
            episodes += finished_episodes(info)
            obs = next_obs
            steps, since_pull = steps + n, since_pull + n
            if len(pending) >= args.actor_batch:
                append_prioritised(args, model, buffer, pending, version)
                shared.log_q.put(ActorReport(global_id, steps, episodes, done=False))
                steps, episodes, pending = 0, [], []
                wait_for_learner(args, shared, slack)
            if since_pull >= args.actor_update_interval:
                version, since_pull = shared.store.pull(params), 0
        if pending:
            append_prioritised(args, model, buffer, pending, version)
        shared.log_q.put(ActorReport(global_id, steps, episodes, done=True))
    finally:
        envs.close()


def append_prioritised(args: Args, model: nn.Module, buffer: PrioritizedBuffer, pending: list, version: int) -> None:
    """Initial priorities from the actor's own n-step TD errors (Ape-X, Section 3), then one append."""
    obs, actions, returns, discounts, next_obs = (np.stack(x) for x in list(zip(*pending, strict=True))[:5])
    data = Transitions(
        obs=torch.from_numpy(obs),
        actions=torch.from_numpy(actions).to(buffer.data.actions.dtype),
        returns=torch.from_numpy(returns).float(),
        discounts=torch.from_numpy(discounts).float(),
        next_obs=torch.from_numpy(next_obs),
        policy_version=torch.full((len(pending),), version, dtype=torch.int64),
    )
    with torch.no_grad():
        td, _ = critic_td_errors(model, model, data)
    priorities = priorities_of(td, args.priority_alpha, args.priority_eps)
    if not np.isfinite(priorities).all():  # a NaN would poison the sum-tree, and with it every later sample
        raise NonFiniteLoss("non-finite n-step TD error (reward or network output) for an initial priority")
    buffer.append(data, priorities)


def evaluator_loop(args: Args, shared: Shared, obs_space, act_space) -> None:
    """Every --eval-interval agent steps: pull the newest parameters, play noise-free episodes, report the returns."""
    torch.set_num_threads(args.actor_torch_threads)
    env = make_env(args.env_id, args.seed + 1_000_003)
    try:
        model = build_model(args, obs_space, act_space)
        params, rng = list(model.parameters()), np.random.default_rng(args.seed + 1_000_003)
        next_eval = (shared.global_step.value // args.eval_interval + 1) * args.eval_interval
        while True:
            sleep_until(shared, lambda: shared.global_step.value >= next_eval, 0.5)  # noqa: B023 (called at once)
            step = shared.global_step.value
            shared.store.pull(params)
            shared.log_q.put(EvalReport(step, play_episodes(args, model, env, args.eval_interval_episodes, rng)))
            next_eval = (step // args.eval_interval + 1) * args.eval_interval
    finally:
        env.close()


# ---- Learner ----


class LearnerRun:
    """The learner's loop state: Ape-X's replay-ratio limiter (`can_learn`) and one learner update (`learn`), which
    main runs between the plumbing's waits for data and housekeeping (the actors' reports, the processes, the console
    line and checkpoints)."""

    def __init__(self, run: Run, learner: Learner, shared: Shared, procs: Processes, global_step: int,
                 num_actors: int):  # fmt: skip
        self.run, self.args, self.learner, self.shared, self.procs = run, run.args, learner, shared, procs
        self.replay = self.record = None  # made in run.training: after the writer, and its Recorder
        self.num_actors, self.global_step = num_actors, global_step
        self.start_step, self.last_check = global_step, time.time()
        self.last_eval_step = -1  # the step of the newest evaluator round reported
        self.stale_updates, self.replay_wait = 0, 0.0
        self.actors_done: set[int] = set()
        self.failure: str | None = None
        self.start_version = learner.version  # with start_step, the rate limiter's origin (start_rate_limit's too)
        self.stats = ReplayStats(np.zeros(1), np.ones(1), np.zeros(1, dtype=np.int64))  # until the loop reads it
        self.rng = np.random.default_rng([run.args.seed, 1])

    def running(self) -> bool:
        return len(self.actors_done) < self.num_actors and self.failure is None

    def can_learn(self) -> bool:
        """Enough transitions in the replay, and the learner is not ahead of the actors: --replay-ratio's learner side
        (the actors' side is wait_for_learner), like Reverb's SampleToInsertRatio, samples at most --replay-ratio
        transitions per agent step past --learning-starts (counted from the step and version the run starts at)."""
        args = self.args
        if self.stats.sizes.sum() < max(args.learning_starts, 1):
            return False
        sampled = (self.learner.version - self.start_version) * args.batch_size
        steps = self.global_step - self.start_step - args.learning_starts
        return not args.replay_ratio or sampled <= args.replay_ratio * steps

    def learn(self) -> None:
        """One learner update (Learner.step: Algorithm 2's pass), checked for a NaN or infinite loss or gradient norm
        before its parameters reach the actors, then published and recorded."""
        args, learner = self.args, self.learner
        drain_reports(self, 0.0)
        beta = importance_exponent(args.priority_beta, args.anneal_beta, self.global_step / args.total_timesteps)
        values = learner.step(self.replay, beta, self.rng, self.stats)
        loss, grad_norm = values["losses/total_loss"], values["losses/grad_norm"]
        if not (math.isfinite(loss) and math.isfinite(grad_norm)):  # before the actors
            raise NonFiniteLoss(f"non-finite loss {loss:g} (gradient norm {grad_norm:g}) "
                                f"at learner update {learner.version}")  # fmt: skip
        self.stale_updates += values.pop("stale_updates")
        self.shared.store.publish(learner.flat_params(), learner.version)
        self.record.add(values)
        if learner.version % args.log_frequency == 0:
            write_point(self)


# ---- Main ----


def start_workers(procs: Processes, args: Args, shared: Shared, spaces, *, first_actor: int, num_total: int,
                  evaluator: bool) -> None:  # fmt: skip
    """This machine's actors, one per buffer in `shared` (global ids from `first_actor`), and the evaluator if asked."""
    for a in range(len(shared.buffers)):
        name = f"actor {first_actor + a}"
        procs.start(name, worker_body, actor_loop, shared.error_q, a, first_actor + a, num_total, args, shared)
    if evaluator:
        procs.start("evaluator", worker_body, evaluator_loop, shared.error_q, args, shared, *spaces)


def start_learner(run: Run) -> tuple[LearnerRun, str]:
    """Rank 0: the learner (from --resume's checkpoint), this machine's processes (the actors and their buffers, or
    none under torchrun) and the evaluator; and the start line's words for them."""
    args, spaces, checkpoint, distributed = run.args, run.spaces, run.checkpoint, run.world_size > 1
    global_step = checkpoint["global_step"] if checkpoint else 0
    num_actors = args.num_actors * (run.world_size - 1 if distributed else 1)
    ctx = mp.get_context("spawn" if run.device.type == "cuda" else "fork")  # CUDA cannot be used in forked children
    shared = Shared(args, ctx, spaces, num_buffers=0 if distributed else args.num_actors, num_total=num_actors,
                    steps_limit=args.total_timesteps, start_step=global_step)  # fmt: skip
    learner = Learner(args, *spaces, run.device)
    if checkpoint:
        learner.load_state_dict(checkpoint)
        torch.set_rng_state(checkpoint["torch_rng"])
    shared.store.publish(learner.flat_params(), learner.version)
    start_rate_limit(args, shared, learner.version)
    stop_if_signalled(run.signals, run.run_dir, resumed=checkpoint is not None)
    for warning in start_warnings(args, global_step):
        print(f"warning: {warning}", file=sys.stderr, flush=True)
    procs = Processes(ctx)
    start_workers(procs, args, shared, spaces, first_actor=0, num_total=num_actors, evaluator=args.eval_interval > 0)
    run.plan = f"{ALGORITHM}: {args.total_timesteps:,} agent steps"  # no fixed updates: the learner keeps up with them
    roles = (f"{num_actors} actors x {args.num_envs_per_actor} envs, replay {args.buffer_size:,} in {num_actors} "
             f"buffers, learning from {max(args.learning_starts, 1):,} transitions"
             f"{f', {run.world_size - 1} actor ranks over rpc' if distributed else ''}")  # fmt: skip
    return LearnerRun(run, learner, shared, procs, global_step, num_actors), roles


def main(args: Args) -> None:
    """The learner (single machine, or rank 0 under torchrun), or an actor rank under torchrun."""
    if (run := open_run(args)) is None:  # resume, validation, run directory, args.json, seed, threads, device
        return  # --eval-only played the saved agent
    if run.rank > 0:  # an actor host under torchrun (its transports end the file); rank 0 learns
        return serve_actor_host(run.rank, run.world_size)
    args, signals = run.args, run.stop_on_signals(threading.Event())
    learning, roles = start_learner(run)
    with (
        run.training(roles, lambda: learning.global_step, functools.partial(stop_learning, learning), window=20,
                     checkpoint=lambda: write_checkpoint(learning), last_point=lambda: last_point(learning),
                     final_model=lambda: saved_model(args, run.meta, learning.learner.model.state_dict()),
                     ) as learning.record,
        named_failures(learning),
    ):  # fmt: skip
        # this machine's buffers, or the actor ranks' over rpc once the writer (slow to start under --track's
        # TensorBoard sync) is made: the actor ranks do not act ahead of a learner still starting up
        learning.replay = (RemoteReplay(args, run.world_size, signals.stop) if run.world_size > 1 else
                           LocalReplay(learning.shared.buffers, np.random.default_rng([args.seed, 0])))  # fmt: skip
        while learning.running():
            if signals.stop.is_set():
                raise Stop
            learning.stats = learning.replay.stats()
            if learning.can_learn():
                learning.learn()
            else:
                wait_for_data(learning)
            housekeeping(learning)
        wait_for_evaluation(learning, signals.stop)
        learning.stats = learning.replay.stats()  # for the last point: every actor has appended its last transitions


# ---- Multi-node (torchrun): rank 0 drives each actor host's buffers and actors over rpc ------------------------------


class ActorHost(LocalReplay):
    """An actor rank under torchrun: its actors and their buffers, built when rank 0 asks (`rpc.remote`), then
    driven by rank 0's calls, one at a time: LocalReplay's methods, `relay` and `close`."""

    def __init__(self, args: Args, rank: int, world_size: int):
        hosts, total, spaces, ctx = world_size - 1, args.total_timesteps, env_spaces(args), mp.get_context("fork")
        self.args, self.rank, self.procs = args, rank, Processes(ctx)
        self.shared = Shared(args, ctx, spaces, num_buffers=args.num_actors, num_total=hosts * args.num_actors,
                             steps_limit=total // hosts + (total % hosts if rank == 1 else 0))  # fmt: skip
        super().__init__(self.shared.buffers, np.random.default_rng([args.seed, rank]))
        start_workers(self.procs, args, self.shared, spaces, first_actor=(rank - 1) * args.num_actors,
                      num_total=hosts * args.num_actors, evaluator=False)  # fmt: skip

    def relay(self, flat: torch.Tensor | None, version: int) -> list[ActorReport | WorkerFailed]:
        """Publish rank 0's newer parameters (if any) to the actors; return their reports and any failure."""
        if flat is not None:
            if math.isnan(self.shared.learn_start.value):  # the first parameters, before the actors can act on them
                start_rate_limit(self.args, self.shared, version)
            self.shared.store.publish(flat, version)
        messages = []
        drain_into(self.shared.log_q, messages.append, 0.0)
        if failure := worker_failure(self.procs, self.shared.error_q):
            messages.append(WorkerFailed(f"{failure} (on rank {self.rank})"))
        return messages

    def close(self) -> None:
        stop_processes(self.procs, self.shared, lambda message: None, grace=4.0)


class RemoteReplay:
    """Rank 0's view of the buffers on the actor ranks (rank r holds buffers [(r-1) K, r K)), as LocalReplay's."""

    def __init__(self, args: Args, world_size: int, stop: threading.Event):
        self.stop = stop  # the run's, which a signal sets
        rpc.init_rpc("rank0", rank=0, world_size=world_size)
        self.hosts = [rpc.remote(f"rank{r}", ActorHost, args=(args, r, world_size)) for r in range(1, world_size)]
        self.per_host, self.sent_version = args.num_actors, -1
        self.call("stats", timeout=HOST_SETUP_TIMEOUT)  # returns once every host is built

    def call(self, method: str, per_host: list[tuple] | None = None, timeout: float = 60.0) -> list:
        futures = [getattr(host.rpc_async(timeout=timeout), method)(*(per_host[i] if per_host else ()))
                   for i, host in enumerate(self.hosts)]  # fmt: skip
        results = []
        for rank, future in enumerate(futures, start=1):
            try:
                results.append(future.wait())
            except Exception as e:  # the host's own error, or a lost connection
                # torchrun's SIGTERM reaches every rank (the end of the launcher too, through watch_launcher): an
                # actor host gone within moments of this rank's own signal ended with it, the run's stop
                if self.stop.wait(HOST_STOP_GRACE):
                    raise Stop from None
                reason = (str(e).strip().splitlines() or [type(e).__name__])[-1][:300]
                raise Stop(f"error: actor host rank {rank} failed: {reason}; stopping the run") from None
        return results

    def chunks(self, items: list) -> list[tuple]:
        return [(list(items[i * self.per_host : (i + 1) * self.per_host]),) for i in range(len(self.hosts))]

    def stats(self) -> ReplayStats:
        return ReplayStats.concat(self.call("stats"))

    def sample(self, counts) -> list[Sample | None]:
        return [part for parts in self.call("sample", self.chunks([int(c) for c in counts])) for part in parts]

    def update(self, parts: list[PriorityUpdate | None]) -> int:
        return sum(self.call("update", self.chunks(parts)))

    def exchange(self, store: ParamStore) -> list[ActorReport | WorkerFailed]:
        """Newer parameters out (a copy: rpc may send a tensor after the call returns), reports back."""
        version = store.version.value
        flat = store.flat.clone() if version > self.sent_version else None
        self.sent_version = version
        return [m for messages in self.call("relay", [(flat, version)] * len(self.hosts)) for m in messages]

    def close(self) -> None:
        """Stop the hosts' actors, then rpc: gracefully (waiting for every rank) if every host answered."""
        try:
            self.call("close", timeout=10.0)
        except Stop:  # a host is gone already (torchrun tears down failed ranks, and stops them all on a signal)
            rpc.shutdown(graceful=False)
            return
        with contextlib.suppress(Exception):  # a rank or the launcher's store gone since: the local shutdown is done
            logging.getLogger("torch.distributed.rpc.api").setLevel(logging.CRITICAL)  # and torch's traceback of it
            rpc.shutdown()


def serve_actor_host(rank: int, world_size: int) -> None:
    """An actor rank's main thread: rank 0 builds an ActorHost here over rpc and drives it; this thread waits for the
    end. Ctrl+C reaches every rank of a terminal's launch and rank 0 stops the run, so actor ranks ignore it; SIGTERM
    (the launcher's stop, or its watch's) ends an actor rank at once, as it holds nothing rank 0 needs to keep."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, signal.SIG_DFL)
    launcher = os.getppid()
    rpc.init_rpc(f"rank{rank}", rank=rank, world_size=world_size)
    try:
        rpc.shutdown()  # returns once every rank has shut down
    except RuntimeError as e:
        # a launcher killed with kill -9 takes rpc's store along: its watch's stop. The kernel closes the launcher's
        # sockets before it reparents this rank, so the new parent may take a moment to show
        deadline = time.monotonic() + 2.0
        while os.getppid() == launcher and time.monotonic() < deadline:
            time.sleep(0.05)
        if os.getppid() != launcher:
            raise SystemExit(128 + signal.SIGTERM) from None
        print(f"error: actor rank {rank} lost the learner (rank 0): {e}", file=sys.stderr)
        raise SystemExit(1) from None


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
    (">= 1", ("num_actors", "num_envs_per_actor", "actor_torch_threads", "actor_batch", "actor_update_interval",
              "batch_size", "n_step", "log_frequency", "eval_interval_episodes")),
    ("> 0", ("critic_learning_rate", "actor_learning_rate", "max_grad_norm", "adam_eps", "priority_eps")),
    (">= 0", ("seed", "torch_threads", "learning_starts", "checkpoint_interval", "eval_episodes", "eval_interval",
              "replay_ratio", "log_interval", "exploration_noise", "priority_alpha")),
    ("in [0, 1]", ("gamma", "tau", "priority_beta", "ou_theta")),
)  # fmt: skip
RESUME_FIXED = ("num_actors",)  # it sets each actor's exploration (eps_i or sigma_i); the replay is not saved
RUN_SETTINGS = ("env_id", "hidden_sizes")
RENAMED_FLAGS = {"--learner-threads": "is now --torch-threads (the actors' threads are --actor-torch-threads)",
                 "--algo": "is now two scripts: apex_dqn.py (Ape-X DQN) and apex_ddpg.py (Ape-X DDPG)",
                 "--learning-rate": "is now --critic-learning-rate (and --actor-learning-rate)"}  # fmt: skip


def validate(args: Args, world_size: int = 1) -> str | None:
    """check_flags, then the checks across flags, env and network; the error line (without `error: `) or None."""
    if error := check_flags(args):
        return error
    if not args.hidden_sizes or min(args.hidden_sizes) < 1:
        return f"--hidden-sizes must be one or more positive widths, got {args.hidden_sizes}"
    if args.eval_only is not None:  # env and network come from the saved run: main_eval_only checks them
        if world_size > 1:
            return f"--eval-only runs in one process: python {Path(__file__).name} --eval-only PATH, without torchrun"
        return None if Path(args.eval_only).is_file() else f"--eval-only {args.eval_only}: no such file"
    if args.resume is not None and not Path(args.resume).is_file():
        return f"--resume {args.resume}: no such checkpoint file"
    if world_size > 1 and args.resume is not None:
        return "--resume works with the single-machine launch only (the actor ranks' step counts are not saved)"
    actors = args.num_actors * max(1, world_size - 1)
    if args.buffer_size < actors * args.actor_batch:
        return f"--buffer-size {args.buffer_size} must hold at least one --actor-batch ({args.actor_batch}) per actor"
    starts, total = args.learning_starts, args.total_timesteps
    if starts > (capacity := args.buffer_size // actors * actors):  # split evenly, rounded down
        return (f"--learning-starts ({starts}) must be <= the replay's capacity, {capacity} (--buffer-size "
                f"{args.buffer_size} in {actors} buffers): the learner would never start")  # fmt: skip
    if starts >= total:
        return (f"--learning-starts {starts} is not below --total-timesteps {total}: the learner waits for {starts} "
                f"transitions in the replay and the run makes one per agent step, so it would learn nothing; give a "
                f"smaller --learning-starts or a larger --total-timesteps (flags that learn Pendulum-v1: python "
                f"benchmarks/learn.py --suite pendulum --only apex_ddpg --dry-run)")  # fmt: skip
    if args.capture_video and args.eval_episodes == 0:
        return "--capture-video records the evaluation episodes; add --eval-episodes N (N >= 1)"
    if args.total_timesteps < actors * args.num_envs_per_actor:
        return f"--total-timesteps ({args.total_timesteps}) is less than one step of every env of every actor"
    try:
        if args.capture_video:  # fail now, not at the final evaluation
            check_video(args.env_id)
        obs_space, act_space = env_spaces(args)
        if isinstance(act_space, gym.spaces.Discrete):
            return f"{args.env_id}'s actions are Discrete: Ape-X DDPG needs a Box action space: use apex_dqn.py"
        build_model(args, obs_space, act_space)
    except EnvError as e:
        return str(e)
    except ValueError as e:
        return f"{e} (Ape-X DDPG on {args.env_id})"
    return None


def env_spaces(args: Args):
    """(observation space, action space) of one env, from a probe of the training vector env."""
    probe = make_vector_env(args.env_id, 1, args.seed, num_threads=1)
    probe.close()
    return probe.single_observation_space, probe.single_action_space


def checkpoint_meta(args: Args, obs_space, act_space, world_size: int = 1) -> dict:
    """What a checkpoint must match to be resumed by this run: script, env, network widths and shapes."""
    return dict(script=Path(__file__).name, env_id=args.env_id, hidden_sizes=list(args.hidden_sizes),
                obs_shape=list(obs_space.shape), action_shape_or_n=list(act_space.shape))  # fmt: skip


def settled_args(args: Args) -> Args:
    """The flags as the run uses them: as given; --torch-threads takes effect at once, before validation builds a
    model (oversubscribed threads make that slow too)."""
    if args.torch_threads >= 1:
        torch.set_num_threads(args.torch_threads)
    return args


def steps_per_update(args: Args, world_size: int) -> int:
    """Agent steps of one step of the budget: 1 (the learner updates as the replay allows, not every so many steps)."""
    return 1


def init_torch(args: Args, spaces, rank: int, world_size: int) -> torch.device:
    """Every rank's launcher watch (torchrun), seed and determinism settings (its processes inherit them); the
    learner's device."""
    watch_launcher()
    torch.manual_seed(args.seed)
    torch.backends.cudnn.deterministic = args.torch_deterministic
    torch.use_deterministic_algorithms(args.torch_deterministic, warn_only=True)
    # deterministic mode would also NaN-fill every new tensor; nothing here reads uninitialised memory
    torch.utils.deterministic.fill_uninitialized_memory = False
    return torch.device("cuda" if args.cuda and torch.cuda.is_available() else "cpu")


def saved_model(eval_args: Args, settings: dict, state_dict: dict) -> nn.Module:
    """The saved run's actor and critic, with the saved parameters."""
    model = build_model(eval_args, *env_spaces(eval_args))
    model.load_state_dict(state_dict)
    return model


def evaluate(model: nn.Module, args: Args, video_dir: Path, device: torch.device) -> Iterator[float]:
    """--eval-episodes episodes of `model`, on the CPU as actors act, whatever `device`; videos with --capture-video."""
    env = make_env(args.env_id, args.seed + 2_000_003, capture_video=args.capture_video, video_dir=str(video_dir))
    model, rng = model.cpu(), np.random.default_rng(args.seed)
    try:
        for _ in range(args.eval_episodes):  # one game a call: the same games as one call for all of them
            yield from play_episodes(args, model, env, 1, rng)
    finally:
        env.close()


def stop_processes(procs: Processes, shared: Shared, handle, grace: float) -> None:
    """Set the stop flag that the processes poll and `handle` their messages while they exit (a process waits for its
    queued messages to reach the pipe before exiting), then Processes.stop: SIGKILL for the ones left after `grace`."""
    shared.stop.set()
    deadline = time.monotonic() + grace
    while any(p.is_alive() for p in procs.procs.values()) and time.monotonic() < deadline:
        with contextlib.suppress(OSError):  # TensorBoard's events file cannot be written: the caller reports it
            drain_into(shared.log_q, handle, 0.2)
    procs.stop(max(0.0, deadline - time.monotonic()))
    with contextlib.suppress(OSError):
        drain_into(shared.log_q, handle, 0.0)


def stop_learning(learning: LearnerRun, graceful: bool) -> str | None:
    """run.training's stop: this machine's processes and the actor hosts; the error line a process sent before the
    stop (or while it ran), which ends the run, if none came yet."""
    handle = functools.partial(take_report, learning) if learning.record is not None else lambda m: None
    stopped = graceful or learning.run.signals.signum  # the budget spent or a signal: wait for the last reports
    stop_processes(learning.procs, learning.shared, handle, grace=4.0 if stopped and not learning.failure else 1.0)
    if learning.replay is not None:
        learning.replay.close()
    with contextlib.suppress(queue.Empty):
        learning.failure = learning.failure or learning.shared.error_q.get_nowait()
    return learning.failure


@contextlib.contextmanager
def named_failures(learning: LearnerRun):
    """An error in the learner's loop once a process has died (a lock it held timed out, say) ends the run with that
    process's error line: it is the cause."""
    try:
        yield
    except Stop:
        raise
    except Exception:
        if failure := worker_failure(learning.procs, learning.shared.error_q):
            raise Stop(failure) from None
        raise


def take_report(learning: LearnerRun, message: ActorReport | EvalReport | WorkerFailed) -> None:
    """A message on log_q (or from an actor host): an actor's steps and games, an evaluator round, a failure."""
    if isinstance(message, ActorReport):
        learning.global_step += message.steps
        learning.shared.global_step.value = learning.global_step
        learning.record.games((learning.global_step, ret, length) for ret, length in message.episodes)
        if message.done:
            learning.actors_done.add(message.actor)
    elif isinstance(message, EvalReport):
        for ret in message.returns:
            learning.record.writer.add_scalar("eval/episodic_return", ret, message.step)
        learning.last_eval_step = max(learning.last_eval_step, message.step)
    else:
        learning.failure = learning.failure or message.error


def wait_for_evaluation(learning: LearnerRun, stop: threading.Event) -> None:
    """The budget is spent: take messages and check on the processes until no evaluator round is due, that is
    until one has reported from at or after the last --eval-interval boundary the run crossed. The evaluator is
    triggered by the step count, so a slow machine delays a round (it plays the newest parameters when it gets
    there) but the run waits for it rather than dropping it."""
    interval = learning.args.eval_interval
    boundary = (learning.global_step - 1) // interval * interval if interval else -1  # the last one before the end
    while learning.failure is None and boundary > learning.start_step and learning.last_eval_step < boundary:
        if stop.is_set():
            raise Stop
        drain_reports(learning, RPC_PERIOD)
        housekeeping(learning)


def wait_for_data(learning: LearnerRun) -> None:
    """Too little data (or the rate limiter): block on the actors' reports."""
    t0 = time.perf_counter()
    drain_reports(learning, RPC_PERIOD)
    learning.replay_wait += time.perf_counter() - t0


def housekeeping(learning: LearnerRun) -> None:
    """Exchange with the actor hosts and check on the processes every RPC_PERIOD; console line; checkpoint."""
    now = time.time()
    if now - learning.last_check >= RPC_PERIOD:
        learning.last_check = now
        for message in learning.replay.exchange(learning.shared.store):
            take_report(learning, message)
        learning.failure = learning.failure or worker_failure(learning.procs, learning.shared.error_q)
    console_line(learning)
    learning.run.checkpoint_if_due()


def write_point(learning: LearnerRun) -> None:
    """A TensorBoard point: the learner's statistics since the last one, and the replay's."""
    record, size = learning.record, learning.stats.sizes.sum()
    record.add({"charts/learning_rate": learning.learner.learning_rate, "timing/replay_wait": learning.replay_wait})
    record.add({"replay/size": size, "replay/priority_mean": learning.stats.priority_sums.sum() / max(1.0, size),
                "replay/stale_updates": learning.stale_updates})  # fmt: skip
    record.point(learning.global_step)


def console_line(learning: LearnerRun, now: bool = False) -> None:
    """The console line every --log-interval seconds (`now`: at once), with the updates and the replay's size."""
    details = f"updates={learning.learner.version} replay={int(learning.stats.sizes.sum())}"
    learning.record.line(learning.global_step, details, now)


def last_point(learning: LearnerRun) -> None:
    """The final step's TensorBoard point (whatever the update count) and console line."""
    write_point(learning)
    console_line(learning, now=True)


def write_checkpoint(learning: LearnerRun) -> None:
    """{run_dir}/checkpoint.pt: the learner's state (the model's state_dict at "model"), step, RNG, Args, meta."""
    state = dict(learning.learner.state_dict(), global_step=learning.global_step, args=asdict(learning.args),
                 torch_rng=torch.get_rng_state(), meta=learning.run.meta)  # fmt: skip
    atomic_save(state, learning.run.checkpoint_path)


def start_warnings(args: Args, start_step: int) -> list[str]:
    """What a run from `start_step` will not do though its flags may suggest it, as `warning:` lines: a resumed run
    too short to refill the replay (empty on --resume) to --learning-starts trains no more; a budget with no multiple
    of --eval-interval in it has no evaluation round (the combination can be intended: the default --eval-interval on
    a short run). A --resume of a finished run is refused by load_checkpoint."""
    total, interval = args.total_timesteps, args.eval_interval
    warnings = []
    if start_step and total - start_step <= args.learning_starts:
        warnings.append(f"--resume: the {total - start_step} agent steps left to --total-timesteps {total} cannot "
                        f"refill the replay (empty on --resume) to --learning-starts {args.learning_starts}: the "
                        f"learner will not update again; give a larger --total-timesteps")  # fmt: skip
    if interval and (total - 1) // interval * interval <= start_step:  # wait_for_evaluation's last boundary
        after = f" after the resumed step {start_step}" if start_step else ""
        warnings.append(f"--eval-interval {interval} puts no evaluation round{after} before --total-timesteps {total} "
                        f"(rounds run at its multiples): the run evaluates nothing during training; give a smaller "
                        f"--eval-interval, or 0 for no rounds")  # fmt: skip
    return warnings


def drain_reports(learning: LearnerRun, timeout: float) -> None:
    """take_report every message queued on log_q, waiting up to `timeout` for the first."""
    drain_into(learning.shared.log_q, functools.partial(take_report, learning), timeout)


def drain_into(q, handle, timeout: float) -> None:
    """Handle every queued message, waiting up to `timeout` for the first."""
    with contextlib.suppress(queue.Empty):
        handle(q.get(timeout=timeout) if timeout else q.get_nowait())
        while True:
            handle(q.get_nowait())


# -- Ape-X processes: the stop-aware sleep of actors and evaluator, the replay buffers' lock with a timeout --


def should_stop(shared: Shared) -> bool:
    """The run is stopping, or the main process is gone (then no one would ever tell us)."""
    return shared.stop.is_set() or os.getppid() != shared.parent_pid


def sleep_until(shared: Shared, ready, period: float) -> None:
    """Sleep `period` at a time until `ready()`; raise Stop if the run stops meanwhile."""
    while not ready():
        time.sleep(period)
        if should_stop(shared):
            raise Stop


class LockTimeout(Exception):
    """A shared lock held for LOCK_TIMEOUT seconds: most likely a process died holding it."""


@contextlib.contextmanager
def hold(lock, what: str):
    """`with lock`, given up after LOCK_TIMEOUT seconds: a process killed while holding a shared lock leaves it held,
    and the learner must then stop the run instead of hanging."""
    if not lock.acquire(timeout=LOCK_TIMEOUT):
        raise LockTimeout(f"{what}'s lock was held for {LOCK_TIMEOUT:.0f} s (a process died holding it?)")
    try:
        yield
    finally:
        lock.release()


if __name__ == "__main__":
    main(parse_args(sys.argv[1:]))
