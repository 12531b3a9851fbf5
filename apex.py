"""Ape-X: distributed prioritized experience replay (Horgan et al., "Distributed Prioritized Experience Replay",
ICLR 2018), DQN for discrete actions (Atari) and DDPG for continuous control, with the replay *distributed* across the
actors as in Machin's Ape-X (the tutorial among the papers): every actor owns a prioritized buffer with its own
sum-tree and lock, the learner samples across buffers in proportion to their priority sums, and priority updates
carry per-slot versions ("taint") so a slot overwritten since it was sampled keeps its new priority.

Architecture (single machine): `--num-actors` actor processes, each stepping `--num-envs-per-actor` envs on the CPU
with its own exploration (DQN: eps_i = 0.4^(1 + 7 i/(N-1)); DDPG: Gaussian or OU noise of scale sigma (N-i)/N), build
n-step transitions, compute their initial priorities |n-step TD error| with their local network copy every
`--actor-batch` transitions, and append them to *their own* shared-memory buffer under its lock (no global lock on the
append path). The main process is the learner (on the GPU when present): it reads the buffers' priority sums, splits
each batch across buffers by them, samples proportionally inside each, trains (n-step double-Q, dueling, target sync;
or DDPG with soft target updates), writes back new priorities where the slot versions still match, and publishes its
parameters to a versioned store (flat shared buffer + version under a lock) that actors pull every
`--actor-update-interval` frames. Actors send (steps, episodes) on `log_q`; an evaluator process plays greedy episodes
every `--eval-interval` agent steps. Only the main process writes TensorBoard. `--replay-ratio` adds a rate limiter.
torchrun (`torch.distributed.rpc`): rank 0 is the learner + evaluator; every other rank hosts `--num-actors` actors
and their buffers, serves buffer statistics, sampling and priority updates over rpc, relays its actors' messages, and
refreshes its copy of the parameter store from rank 0 every 0.25 s.
Policy lag (`charts/policy_lag`): learner updates between the parameters that generated a sampled transition and the
  update that learns from it (mean over the batch), unbounded: it grows with replay age and `--actor-update-interval`.
Determinism: none (actors, learner and evaluator race on the replay); the pure functions are deterministic.
Resume restores networks, optimizers and the step count; the replay starts empty and refills to `--learning-starts`.

Learning checks (classic-control overrides of the Atari defaults; measured on 2 shared CPU cores):
  python apex.py --env-id CartPole-v1 --num-actors 2 --total-timesteps 100000 --buffer-size 100000 \\
      --learning-starts 1000 --batch-size 64 --optimizer adam --learning-rate 1e-3 --target-network-frequency 100 \\
      --actor-update-interval 50 --replay-ratio 8 --eval-interval 5000 --anneal-beta \\
                                                                        # DQN: greedy 500 from 45k / 85k (seeds 1, 2)
  python apex.py --algo ddpg --env-id Pendulum-v1 --num-actors 2 --total-timesteps 40000 --buffer-size 40000 \\
      --learning-starts 2000 --batch-size 128 --critic-learning-rate 1e-3 --actor-learning-rate 1e-3 \\
      --actor-update-interval 50 --replay-ratio 64 --eval-interval 4000 --n-step 3 --anneal-beta \\
                                                                        # DDPG: greedy > -250 from 8k (seeds 1, 2)
Examples:
  python apex.py --env-id ALE/Breakout-v5 --num-actors 8                                  # Ape-X DQN, Atari defaults
  torchrun --standalone --nproc-per-node 3 apex.py --env-id CartPole-v1 --num-actors 2   # learner + 2 actor hosts
  torchrun --nnodes 4 --node-rank $NODE_RANK --nproc-per-node 1 --rdzv-backend c10d \\
      --rdzv-endpoint $HOST:29500 apex.py --env-id ALE/Pong-v5 --num-actors 16          # 3 nodes x 16 actors
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import io
import itertools
import math
import os
import queue
import signal
import sys
import threading
import time
import traceback
from collections import deque
from dataclasses import asdict, dataclass
from pathlib import Path

import gymnasium as gym
import numpy as np
import torch
import torch.multiprocessing as mp
import tyro
from torch import nn

from common.atari import (
    FRAME_SKIP,
    PROTOCOLS,
    EnvError,
    ale_game,
    check_env_args,
    finished_episodes,
    make_env,
    make_vector_env,
)
from common.models import NETWORKS, make_ddpg_model, make_q_network

ALGOS = ("dqn", "ddpg")
OPTIMIZERS = ("rmsprop", "adam")
NOISE_TYPES = ("gaussian", "ou")
DQN_LEARNING_RATE = 0.00025 / 4  # Horgan et al. 2018, Appendix C
LOCK_TIMEOUT = 5.0  # seconds a replay buffer's lock may be held before the learner gives up on it
RPC_PARAM_PERIOD = 0.25  # seconds between an actor host's parameter refreshes from rank 0 (torchrun)


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
    env_id: str = "ALE/Breakout-v5"
    """gymnasium id; ALE ids run in ale-py's C++ vector env"""
    atari_protocol: str = "deepmind"
    """ALE preprocessing: `deepmind` (Ape-X's setting) or `machado`"""
    total_timesteps: int = 10_000_000
    """agent steps summed over all envs of all actors"""
    log_dir: str = "runs"
    """where run directories go"""
    save_model: bool = False
    """write the final model's state_dict to {run_dir}/model.pt"""
    checkpoint_interval: float = 0.0
    """seconds between checkpoints to {run_dir}/checkpoint.pt (0 = off)"""
    resume: str | None = None
    """path of a checkpoint.pt to continue from (networks, optimizers, step count; the replay starts empty)"""
    eval_episodes: int = 0
    """episodes to evaluate the final policy on (logged as eval/episodic_return at the final step)"""
    capture_video: bool = False
    """record videos of the final evaluation episodes to {run_dir}/videos"""
    network: str = "auto"
    """DQN torso: `nature` (Ape-X), `impala`, `mlp`, or `auto` (nature for frames, mlp for flat observations)"""

    algo: str = "dqn"
    """`dqn` (Ape-X DQN, Discrete actions) or `ddpg` (Ape-X DPG, Box actions)"""
    num_actors: int = 4
    """actor processes (under torchrun: per actor rank); each owns one replay buffer"""
    num_envs_per_actor: int = 1
    """envs each actor steps with one batched forward pass (Ape-X: 1)"""
    torch_threads: int = 1
    """torch intra-op threads of each actor and the evaluator"""
    learner_threads: int = 1
    """torch intra-op threads of the learner (0 = torch's default; 1 by default: the actors already use the cores,
    and oversubscribed threads slowed a small learner update 30x on this project's 2-core machine)"""
    hidden_sizes: tuple[int, ...] = (256, 256)
    """MLP widths for flat observations (DQN torso, DDPG actor and critic)"""
    # Horgan et al. 2018, Appendix C (Ape-X DQN on Atari) and D (Ape-X DPG)
    buffer_size: int = 100_000
    """replay capacity over all actors, split evenly (Ape-X: 2M frames, PNG-compressed; raw frames here are ~56 KB a
    transition, so 100k is ~5.6 GB of shared memory on Atari)"""
    actor_batch: int = 50
    """transitions an actor collects before computing their priorities and appending them (Ape-X: B = 50)"""
    actor_update_interval: int = 400
    """frames an actor plays between parameter pulls, summed over its envs (Ape-X: 400 frames); an agent step is 4
    frames on ALE ids (frame skip 4) and 1 frame on other ids, so the default pulls every 100 agent steps on Atari"""
    learning_starts: int = 50_000
    """transitions in the replay (all buffers) before the learner starts (Ape-X: 50,000)"""
    batch_size: int = 512
    """learner batch (Ape-X: 512), split across the buffers by their priority sums"""
    n_step: int | None = None
    """n of the n-step returns (None: 3 for --algo dqn as in Ape-X DQN, 5 for --algo ddpg as in Ape-X DPG)"""
    gamma: float = 0.99
    """discount factor"""
    priority_alpha: float = 0.6
    """priority exponent alpha: P(i) ~ p_i^alpha (Ape-X: 0.6)"""
    priority_beta: float = 0.4
    """importance-sampling exponent beta, fixed over the run as in Ape-X (0.4); see --anneal-beta"""
    anneal_beta: bool = False
    """anneal beta linearly from --priority-beta to 1 over the run (Schaul et al. 2016's schedule; Ape-X keeps it
    fixed)"""
    priority_eps: float = 1e-6
    """added to |TD error| so that no transition has priority 0"""
    optimizer: str = "rmsprop"
    """DQN optimizer: `rmsprop` (centered, Ape-X) or `adam`; DDPG always uses Adam (Ape-X DPG)"""
    learning_rate: float = DQN_LEARNING_RATE
    """DQN: learning rate of the Q-network (Ape-X DQN: 0.00025 / 4); --algo ddpg takes --critic-learning-rate"""
    critic_learning_rate: float = 1e-4
    """DDPG: Adam learning rate of the critic (Ape-X DPG: 1e-4)"""
    actor_learning_rate: float = 1e-4
    """DDPG: Adam learning rate of the actor (Ape-X DPG: 1e-4)"""
    rmsprop_alpha: float = 0.95
    """RMSprop decay (Ape-X: 0.95)"""
    rmsprop_eps: float = 1.5e-7
    """RMSprop epsilon (Ape-X: 1.5e-7)"""
    adam_eps: float = 1e-8
    """Adam epsilon"""
    max_grad_norm: float = 40.0
    """clip the learner's gradients to this global norm (Ape-X: 40)"""
    target_network_frequency: int = 2500
    """DQN: learner updates between hard target-network syncs (Ape-X: 2500)"""
    tau: float = 0.005
    """DDPG: soft target update rate, target <- tau online + (1 - tau) target"""
    epsilon: float = 0.4
    """DQN: base epsilon of the actors' schedule eps_i = epsilon^(1 + i alpha / (N - 1)) (Ape-X: 0.4)"""
    epsilon_alpha: float = 7.0
    """DQN: exponent alpha of that schedule (Ape-X: 7)"""
    eval_epsilon: float = 0.001
    """DQN: epsilon of the evaluation episodes (greedy up to this)"""
    exploration_noise: float = 0.3
    """DDPG: action-noise scale of actor 0 as a fraction of the half action range; actor i uses sigma (N - i) / N"""
    noise_type: str = "gaussian"
    """DDPG: `gaussian` or `ou` (Ornstein-Uhlenbeck, Lillicrap et al. 2016) action noise"""
    ou_theta: float = 0.15
    """DDPG: mean reversion of the OU noise"""
    replay_ratio: float = 0.0
    """sampled transitions per agent step once learning starts, a rate limiter like Reverb's SampleToInsertRatio: the
    learner waits when ahead, actors wait when more than a small slack ahead (under torchrun only the learner side).
    0 = off: actors and learner run free, as in Ape-X. CPU-only runs need it, or actors starve the learner"""
    eval_interval: int = 100_000
    """agent steps between greedy evaluation rounds during training, logged as eval/episodic_return (0 = off)"""
    eval_interval_episodes: int = 5
    """episodes per evaluation round during training"""
    log_frequency: int = 10
    """learner updates per TensorBoard point for losses, lag and replay statistics (averaged over them)"""
    log_interval: float = 10.0
    """seconds between console lines"""

    def __post_init__(self):
        if self.n_step is None:  # each variant's own n (Horgan et al. 2018: 3 for Ape-X DQN, 5 for Ape-X DPG)
            self.n_step = 5 if self.algo == "ddpg" else 3


# ----------------------------------------------------------------------------------------------------------------
# Pure algorithm functions
# ----------------------------------------------------------------------------------------------------------------


def apex_epsilons(num_actors: int, epsilon: float = 0.4, alpha: float = 7.0) -> list[float]:
    """Horgan et al. 2018, Section 4.1: actor i of N explores with eps_i = eps^(1 + i alpha / (N - 1)); 1 actor: eps."""
    if num_actors == 1:
        return [epsilon]
    return [epsilon ** (1 + i * alpha / (num_actors - 1)) for i in range(num_actors)]


def frame_skip(env_id: str) -> int:
    """Emulator frames per agent step: ALE ids run with common.atari's frame skip, other envs step once."""
    return FRAME_SKIP if ale_game(env_id) is not None else 1


def pull_interval_steps(frames: int, skip: int) -> int:
    """Agent steps between an actor's parameter pulls for an interval in frames (Ape-X: 400 frames), at least 1."""
    return max(1, frames // skip)


def importance_exponent(beta: float, anneal: bool, progress: float) -> float:
    """The IS exponent at `progress` in [0, 1] of the run: beta itself (Ape-X), or with `anneal` linear from beta to 1
    (Schaul et al. 2016, Section 3.4)."""
    return beta + (1.0 - beta) * min(1.0, progress) if anneal else beta


def noise_scales(num_actors: int, sigma: float) -> list[float]:
    """DDPG actors' noise scales, evenly spread from sigma (actor 0) down to sigma / N (the last actor)."""
    return [sigma * (num_actors - i) / num_actors for i in range(num_actors)]


def ou_step(state: np.ndarray, theta: float, sigma: float, rng: np.random.Generator) -> np.ndarray:
    """One Ornstein-Uhlenbeck step with dt = 1 and mean 0: x <- x - theta x + sigma N(0, 1)."""
    return state - theta * state + sigma * rng.standard_normal(state.shape)


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


def split_counts(totals: np.ndarray, batch_size: int, rng: np.random.Generator) -> np.ndarray:
    """How many of a batch each buffer gives: multinomial in the buffers' priority sums [K] -> counts [K]. Drawing
    the buffer by its sum, then a slot by its priority within it, is exactly P(i) = p_i / sum_all p."""
    totals = np.asarray(totals, dtype=np.float64)
    return rng.multinomial(batch_size, totals / totals.sum())


def importance_weights(priorities: np.ndarray, min_priority: float, beta: float) -> np.ndarray:
    """w_i = (N P(i))^-beta / max_j (N P(j))^-beta with P(i) = p_i / sum p (Schaul et al. 2016, Section 3.4);
    N and sum p cancel: w_i = (p_i / p_min)^-beta, p_min the smallest priority in *all* buffers."""
    return (np.asarray(priorities, dtype=np.float64) / min_priority) ** -beta


def n_step_window(rewards: list[float], gamma: float, terminated: bool) -> tuple[float, float]:
    """R = sum_k gamma^k r_k over the window and the bootstrap discount: gamma^len, or 0 after a terminal state."""
    ret = sum(gamma**k * r for k, r in enumerate(rewards))
    return ret, 0.0 if terminated else gamma ** len(rewards)


class NStepBuilder:
    """Per env, the last n (obs, action, reward); emits n-step transitions (obs_t, a_t, R_t, discount, obs_{t+k}).
    At an episode end every pending start is emitted with its shortened window (discount 0 if terminated; a
    truncated episode bootstraps from its final observation)."""

    def __init__(self, num_envs: int, n: int, gamma: float):
        self.n, self.gamma = n, gamma
        self.windows = [deque() for _ in range(num_envs)]

    def push(self, obs, actions, rewards, terminated, truncated, next_obs) -> list[tuple]:
        out = []
        for e, window in enumerate(self.windows):
            window.append((obs[e], actions[e], float(rewards[e])))
            done = bool(terminated[e] or truncated[e])
            while window and (done or len(window) == self.n):
                ret, discount = n_step_window([r for _, _, r in window], self.gamma, bool(terminated[e]))
                out.append((window[0][0], window[0][1], ret, discount, next_obs[e]))
                window.popleft()
                if not done:
                    break
        return out


def double_q_targets(next_q_online: torch.Tensor, next_q_target: torch.Tensor, returns, discounts) -> torch.Tensor:
    """n-step double-Q target R + gamma^n Q_target(s', argmax_a Q_online(s', a)) (van Hasselt et al. 2016; Ape-X
    Eq. 1): [B, A], [B, A], [B], [B] -> [B]."""
    best = next_q_online.argmax(dim=1, keepdim=True)  # [B, 1]
    return returns + discounts * next_q_target.gather(1, best).squeeze(1)


def huber(x: torch.Tensor, delta: float = 1.0) -> torch.Tensor:
    """Elementwise Huber loss (Mnih et al. 2015's error clipping)."""
    a = x.abs()
    return torch.where(a <= delta, 0.5 * x * x, delta * (a - 0.5 * delta))


def td_errors(algo: str, online: nn.Module, target: nn.Module, batch: dict) -> tuple[torch.Tensor, torch.Tensor]:
    """n-step TD errors [B] and Q(s, a) [B], differentiable through `online`'s Q(s, a). The learner passes its target
    network; an actor computing initial priorities passes its one local copy twice (double Q reduces to max)."""
    obs, actions, next_obs = batch["obs"], batch["actions"], batch["next_obs"]
    if algo == "dqn":
        q = online(obs).gather(1, actions[:, None]).squeeze(1)  # [B]
        with torch.no_grad():
            next_online = online(next_obs)  # [B, A]
            next_target = next_online if target is online else target(next_obs)
            y = double_q_targets(next_online, next_target, batch["returns"], batch["discounts"])
    else:
        q = online.q(obs, actions)  # [B]
        with torch.no_grad():
            y = batch["returns"] + batch["discounts"] * target.q(next_obs, target(next_obs))
    return y - q, q


def priorities_of(td: torch.Tensor, alpha: float, eps: float) -> np.ndarray:
    """Stored priorities p^alpha with p = |delta| + eps (Schaul et al. 2016, proportional variant)."""
    return ((td.detach().abs().double() + eps) ** alpha).cpu().numpy()


@torch.no_grad()
def soft_update(target: nn.Module, online: nn.Module, tau: float) -> None:
    """theta' <- tau theta + (1 - tau) theta' (Lillicrap et al. 2016)."""
    for t, o in zip(target.parameters(), online.parameters(), strict=True):
        t.lerp_(o, tau)


# ----------------------------------------------------------------------------------------------------------------
# The distributed prioritized replay: one buffer per actor, and the learner's view over all of them
# ----------------------------------------------------------------------------------------------------------------


class LockTimeout(RuntimeError):
    pass


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


class PrioritizedBuffer:
    """A ring buffer of n-step transitions with a sum-tree and a min-tree over priorities p^alpha, in shared memory
    (preallocated tensors; the trees are flat [2P] float64 arrays) behind one lock of its own. `slot_version[i]` is
    incremented every time slot i is overwritten (Machin's taint table): a priority update carries the versions seen
    at sampling and is skipped where they changed."""

    FIELDS = ("obs", "actions", "returns", "discounts", "next_obs", "policy_version")

    def __init__(self, capacity: int, obs_shape, obs_dtype, action_shape, action_dtype, lock):
        self.capacity, self.lock = capacity, lock
        self.obs = torch.zeros((capacity, *obs_shape), dtype=obs_dtype)
        self.next_obs = torch.zeros((capacity, *obs_shape), dtype=obs_dtype)
        self.actions = torch.zeros((capacity, *action_shape), dtype=action_dtype)
        self.returns = torch.zeros(capacity)
        self.discounts = torch.zeros(capacity)
        self.policy_version = torch.zeros(capacity, dtype=torch.int64)  # learner version the actor acted with
        self.slot_version = torch.zeros(capacity, dtype=torch.int64)
        P = tree_capacity(capacity)
        self.sum_tree = torch.zeros(2 * P, dtype=torch.float64)
        self.min_tree = torch.full((2 * P,), math.inf, dtype=torch.float64)
        self.cursor = torch.zeros(2, dtype=torch.int64)  # next write position, size

    def share_memory_(self) -> PrioritizedBuffer:
        for name in (*self.FIELDS, "slot_version", "sum_tree", "min_tree", "cursor"):
            getattr(self, name).share_memory_()
        return self

    def append(self, data: dict, priorities: np.ndarray) -> None:
        """Write k transitions (tensors [k, ...] keyed by FIELDS) with their priorities p^alpha [k]."""
        k = len(priorities)
        with hold(self.lock, "a replay buffer"):
            pos, size = self.cursor.tolist()
            slots = (pos + torch.arange(k)) % self.capacity
            for name in self.FIELDS:
                getattr(self, name)[slots] = data[name]
            self.slot_version[slots] += 1
            tree_update(self.sum_tree.numpy(), slots.numpy(), priorities, np.add)
            tree_update(self.min_tree.numpy(), slots.numpy(), priorities, np.minimum)
            self.cursor[0], self.cursor[1] = (pos + k) % self.capacity, min(size + k, self.capacity)

    def stats(self) -> tuple[float, float, int]:
        """(sum of priorities, smallest priority, size)."""
        with hold(self.lock, "a replay buffer"):
            return float(self.sum_tree[1]), float(self.min_tree[1]), int(self.cursor[1])

    def sample(self, count: int, rng: np.random.Generator) -> dict:
        """`count` slots drawn in proportion to their priority, stratified over [0, total) (Schaul et al. 2016,
        Appendix B.2.1): the transitions, their slots, slot versions and priorities."""
        with hold(self.lock, "a replay buffer"):
            tree, size = self.sum_tree.numpy(), int(self.cursor[1])
            prefix = (np.arange(count) + rng.random(count)) * (tree[1] / count)
            slots = np.minimum(tree_find_prefix(tree, prefix), size - 1)  # float round-off can step past the end
            index = torch.from_numpy(slots)
            out = {name: getattr(self, name)[index] for name in self.FIELDS}
            out.update(
                slots=index,
                versions=self.slot_version[index],
                priorities=torch.from_numpy(tree[len(tree) // 2 + slots]),
            )
        return out

    def update_priorities(self, slots: torch.Tensor, versions: torch.Tensor, priorities: np.ndarray) -> int:
        """Set new priorities where the slot still holds the sampled transition; returns how many were stale."""
        with hold(self.lock, "a replay buffer"):
            fresh = (self.slot_version[slots] == versions).numpy()
            if fresh.any():
                keep = slots.numpy()[fresh]
                tree_update(self.sum_tree.numpy(), keep, priorities[fresh], np.add)
                tree_update(self.min_tree.numpy(), keep, priorities[fresh], np.minimum)
        return int((~fresh).sum())


class LocalReplay:
    """The learner's view of the buffers in this machine's shared memory."""

    def __init__(self, buffers: list[PrioritizedBuffer], rng: np.random.Generator):
        self.buffers, self.rng = buffers, rng

    def stats(self) -> np.ndarray:
        return np.array([b.stats() for b in self.buffers])  # [K, 3]: sum, min, size

    def sample(self, counts) -> list[dict | None]:
        return [b.sample(int(c), self.rng) if c else None for b, c in zip(self.buffers, counts, strict=True)]

    def update(self, parts: list[tuple | None]) -> int:
        return sum(b.update_priorities(*p) for b, p in zip(self.buffers, parts, strict=True) if p is not None)


def sample_batch(replay, batch_size: int, beta: float, rng: np.random.Generator, stats: np.ndarray | None = None):
    """Sample across buffers: split by priority sums, proportional inside each, IS weights normalised by the global
    maximum weight (from the smallest priority of all buffers). `stats` [K, 3]: `replay.stats()`, if just read.
    Returns (batch of tensors [B, ...], buffer id per sample [B], the replay statistics [K, 3])."""
    stats = replay.stats() if stats is None else stats
    counts = split_counts(stats[:, 0], batch_size, rng)
    parts = replay.sample(counts)
    batch = {k: torch.cat([p[k] for p in parts if p is not None]) for k in (*PrioritizedBuffer.FIELDS, "slots")}
    batch["versions"] = torch.cat([p["versions"] for p in parts if p is not None])
    priorities = torch.cat([p["priorities"] for p in parts if p is not None]).numpy()
    min_priority = min(stats[stats[:, 2] > 0, 1].min(), priorities.min())  # appends since stats() may be lower
    batch["weights"] = torch.from_numpy(importance_weights(priorities, min_priority, beta)).float()
    buffer_ids = np.repeat(np.arange(len(counts)), counts)
    return batch, buffer_ids, stats


def split_updates(batch: dict, buffer_ids: np.ndarray, priorities: np.ndarray, num_buffers: int) -> list:
    """Per buffer (slots, versions, new priorities), or None for a buffer that gave no sample."""
    parts = []
    for k in range(num_buffers):
        mask = buffer_ids == k
        parts.append((batch["slots"][mask], batch["versions"][mask], priorities[mask]) if mask.any() else None)
    return parts


# ----------------------------------------------------------------------------------------------------------------
# Shared state, the parameter store, and the process bodies
# ----------------------------------------------------------------------------------------------------------------


class Stop(Exception):
    """Raised inside a process when the run is shutting down."""


class NonFiniteLoss(RuntimeError):
    pass


class StopFlag:
    """The run is shutting down: one byte of shared memory, set by the main process only. Unlike mp.Event, setting it
    takes no lock and waits for no one: mp.Event.set() waits until every process sleeping in wait() wakes, forever if
    one of them is stopped (SIGSTOP) or frozen, and Ctrl+C could then not stop the run."""

    def __init__(self, ctx):
        self.flag = ctx.Value("b", 0, lock=False)

    def set(self) -> None:
        self.flag.value = 1

    def is_set(self) -> bool:
        return bool(self.flag.value)

    def wait(self, timeout: float) -> bool:
        """Sleep up to `timeout` seconds unless set; whether it is set."""
        if not self.flag.value:
            time.sleep(timeout)
        return bool(self.flag.value)


class ParamStore:
    """Versioned parameters: a flat shared buffer and its version under one lock, so a pull never mixes versions.
    Version = learner updates applied (-1 until the first publish, which sets `ready`)."""

    def __init__(self, num_params: int, ctx):
        self.flat = torch.zeros(num_params).share_memory_()
        self.version = ctx.Value("q", -1, lock=False)
        self.lock, self.ready = ctx.Lock(), ctx.Event()

    @torch.no_grad()  # a copy of parameters must not join their autograd graph
    def publish(self, params: list[torch.Tensor] | torch.Tensor, version: int) -> None:
        with hold(self.lock, "the parameter store"):
            if isinstance(params, torch.Tensor):
                self.flat.copy_(params)
            else:
                copy_into_flat(self.flat, params)
            self.version.value = version
        self.ready.set()

    @torch.no_grad()
    def pull(self, params: list[torch.Tensor]) -> int:
        with hold(self.lock, "the parameter store"):
            offset = 0
            for p in params:
                p.copy_(self.flat[offset : offset + p.numel()].view(p.shape))
                offset += p.numel()
            return self.version.value

    def snapshot(self, known: int) -> tuple[int, torch.Tensor | None]:
        """(version, a copy of the parameters if newer than `known`) for an rpc pull."""
        with hold(self.lock, "the parameter store"):
            version = self.version.value
            return version, self.flat.clone() if version > known else None


def copy_into_flat(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    offset = 0
    for t in tensors:
        flat[offset : offset + t.numel()].view(t.shape).copy_(t)
        offset += t.numel()


@dataclass
class Shared:
    """Everything the processes of one machine share (tensors and locks in shared memory)."""

    stop: StopFlag  # the run is shutting down
    log_q: object  # mp.Queue -> main: ("actor", ...), ("done", actor), ("eval", step, returns), ("error", text)
    error_q: object  # mp.Queue -> main: "<who> died:\n<traceback>"
    steps_claimed: object  # mp.Value int64: agent steps handed out (the budget counter of this machine)
    steps_limit: int  # this machine's share of --total-timesteps
    global_step: object  # mp.Value int64: agent steps the learner has counted (the evaluator's clock)
    learn_start: object  # mp.Value double: the rate limiter's origin, steps_claimed - updates * B / ratio (nan before)
    store: ParamStore
    buffers: list  # [PrioritizedBuffer] of this machine's actors
    parent_pid: int


def should_stop(shared: Shared) -> bool:
    """The run is stopping, or the main process is gone (then no one would ever tell us)."""
    return shared.stop.is_set() or os.getppid() != shared.parent_pid


def wait_ready(shared: Shared) -> None:
    """Block until the learner's first parameters are published (no busy wait)."""
    while not shared.store.ready.wait(1.0):
        if should_stop(shared):
            raise Stop


def claim_steps(shared: Shared, steps: int) -> bool:
    """Reserve agent steps within this machine's budget; False when none are left."""
    with shared.steps_claimed.get_lock():
        if shared.steps_claimed.value + steps > shared.steps_limit:
            return False
        shared.steps_claimed.value += steps
        return True


def wait_for_learner(args: Args, shared: Shared, slack: int) -> None:
    """Rate limiter, actor side (`--replay-ratio`): block while this machine's agent steps since learning started
    run more than `slack` ahead of what the learner's samples allow (timed waits on the stop event, no busy wait)."""
    start = shared.learn_start.value
    if not args.replay_ratio or math.isnan(start):
        return
    while shared.steps_claimed.value - start - shared.store.version.value * args.batch_size / args.replay_ratio > slack:
        if shared.stop.wait(0.02) or os.getppid() != shared.parent_pid:
            raise Stop


def build_model(args: Args, obs_space, act_space, channels_last: bool = True) -> nn.Module:
    if args.algo == "dqn":
        return make_q_network(obs_space, act_space, args.network, hidden=args.hidden_sizes, channels_last=channels_last)
    return make_ddpg_model(obs_space, act_space, args.hidden_sizes)


def act(args: Args, model: nn.Module, obs: np.ndarray, explore: float, rng: np.random.Generator, noise=None):
    """Actions for a [B, ...] batch: epsilon-greedy (DQN) or mu(s) plus noise, clipped to the bounds (DDPG; `noise`
    [B, act_dim] is in units of the half action range, None = no noise)."""
    with torch.inference_mode():
        out = model(torch.as_tensor(obs)).cpu().numpy()
    if args.algo == "dqn":
        actions = out.argmax(axis=1)
        random = rng.random(len(actions)) < explore
        actions[random] = rng.integers(0, out.shape[1], int(random.sum()))
        return actions
    scale, bias = model.action_scale.numpy(), model.action_bias.numpy()
    if noise is not None:
        out = out + noise * scale
    return np.clip(out, bias - scale, bias + scale).astype(np.float32)


def play_episodes(args: Args, model: nn.Module, env, episodes: int, rng: np.random.Generator) -> list[float]:
    """True returns of `episodes` evaluation games: greedy up to `eval_epsilon` (DQN), noise-free (DDPG)."""
    returns = []
    obs, _ = env.reset()
    while len(returns) < episodes:
        action = act(args, model, np.asarray(obs)[None], args.eval_epsilon, rng)[0]
        obs, _, terminated, truncated, info = env.step(action)
        if terminated or truncated:
            returns.append(float(info["episode"]["r"]))
            obs, _ = env.reset()
    return returns


def die_with_parent(parent_pid: int) -> None:
    """Linux: the kernel kills this process when the main process dies, even by kill -9, so no child outlives the run.
    The main process may have died before prctl ran: then exit at once."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # no prctl (not Linux)
        pass
    if os.getppid() != parent_pid:
        os._exit(0)


def process_body(name: str, loop, shared: Shared, *loop_args) -> None:
    """Run `loop(*loop_args)` in a child process, reporting any exception with its traceback to the main process."""
    die_with_parent(shared.parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the main process coordinates Ctrl+C / SIGTERM
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})  # blocked by main around start()
    try:
        loop(*loop_args)
    except Stop:
        pass
    except NonFiniteLoss as e:
        shared.error_q.put(f"error: {name}: {e}; stopping (the last checkpoint, if any, is kept)")
        raise SystemExit(1) from None
    except BaseException:
        shared.error_q.put(f"error: {name} died:\n{traceback.format_exc()}")
        raise SystemExit(1) from None


def actor_loop(actor: int, global_id: int, num_total: int, args: Args, shared: Shared) -> None:
    """One Ape-X actor (Horgan et al. 2018, Algorithm 1): act, build n-step transitions, prioritise them with the
    local network, append them to this actor's buffer, pull parameters every `actor_update_interval` frames."""
    torch.set_num_threads(args.torch_threads)
    n = args.num_envs_per_actor
    start = shared.steps_claimed.value  # > 0 after --resume: new episodes, not a replay of the first ones
    envs = make_vector_env(
        args.env_id, n, args.seed + 10_000 * global_id + start, protocol=args.atari_protocol, num_threads=1
    )
    try:
        model = build_model(args, envs.single_observation_space, envs.single_action_space, channels_last=False)
        params = list(model.parameters())
        rng = np.random.default_rng([args.seed, global_id, start])
        explore = (
            apex_epsilons(num_total, args.epsilon, args.epsilon_alpha)
            if args.algo == "dqn"
            else noise_scales(num_total, args.exploration_noise)
        )[global_id]
        buffer, builder = shared.buffers[actor], NStepBuilder(n, args.n_step, args.gamma)
        pull_every = pull_interval_steps(args.actor_update_interval, frame_skip(args.env_id))  # agent steps
        wait_ready(shared)
        version = shared.store.pull(params)
        since_pull, steps, episodes, pending = 0, 0, [], []
        noise = np.zeros((n, *envs.single_action_space.shape)) if args.algo == "ddpg" else None
        obs, _ = envs.reset()
        while not should_stop(shared) and claim_steps(shared, n):
            if args.algo == "ddpg":
                noise = (
                    ou_step(noise, args.ou_theta, explore, rng)
                    if args.noise_type == "ou"
                    else explore * rng.standard_normal(noise.shape)
                )
            actions = act(args, model, obs, explore, rng, noise)
            next_obs, reward, terminated, truncated, info = envs.step(actions)
            next_obs = next_obs.copy()  # transitions keep views of it
            done = terminated | truncated
            real_next = next_obs
            if done.any():  # SAME_STEP autoreset: the last observation of an episode is in final_obs
                real_next, final = next_obs.copy(), info.get("final_obs")  # none after an ALE life loss: no reset
                for e in np.flatnonzero(done):
                    if final is not None and final[e] is not None:
                        real_next[e] = final[e]
                if noise is not None:
                    noise[done] = 0.0
            pending += builder.push(obs, actions, reward, terminated, truncated, real_next)
            episodes += finished_episodes(info)
            obs = next_obs
            steps, since_pull = steps + n, since_pull + n
            if len(pending) >= args.actor_batch:
                append_prioritised(args, model, buffer, pending, version)
                shared.log_q.put(("actor", global_id, steps, episodes, len(pending)))
                steps, episodes, pending = 0, [], []
                # unreported steps of all actors stay below this slack, so the learner is never blocked by it
                wait_for_learner(args, shared, slack=2 * len(shared.buffers) * n * (args.actor_batch + args.n_step))
            if since_pull >= pull_every:
                version, since_pull = shared.store.pull(params), 0
        if pending:
            append_prioritised(args, model, buffer, pending, version)
        shared.log_q.put(("actor", global_id, steps, episodes, len(pending)))
        shared.log_q.put(("done", global_id))
    finally:
        envs.close()


def append_prioritised(args: Args, model: nn.Module, buffer: PrioritizedBuffer, pending: list, version: int) -> None:
    """Initial priorities from the actor's own n-step TD errors (Ape-X, Section 3), then one append."""
    obs, actions, returns, discounts, next_obs = (np.stack(x) for x in zip(*pending, strict=True))
    data = dict(
        obs=torch.from_numpy(obs),
        actions=torch.from_numpy(actions).to(buffer.actions.dtype),
        returns=torch.from_numpy(returns).float(),
        discounts=torch.from_numpy(discounts).float(),
        next_obs=torch.from_numpy(next_obs),
        policy_version=torch.full((len(pending),), version, dtype=torch.int64),
    )
    with torch.no_grad():
        td, _ = td_errors(args.algo, model, model, data)
    priorities = priorities_of(td, args.priority_alpha, args.priority_eps)
    if not np.isfinite(priorities).all():  # a NaN would poison the sum-tree, and with it every later sample
        raise NonFiniteLoss("non-finite n-step TD error (reward or network output) for an initial priority")
    buffer.append(data, priorities)


def evaluator_loop(args: Args, shared: Shared, obs_space, act_space) -> None:
    """Every `eval_interval` agent steps: pull the newest parameters, play greedy episodes, report their returns."""
    torch.set_num_threads(args.torch_threads)
    env = make_env(args.env_id, args.seed + 1_000_003, protocol=args.atari_protocol)
    try:
        model = build_model(args, obs_space, act_space, channels_last=False)
        params, rng = list(model.parameters()), np.random.default_rng(args.seed + 1_000_003)
        next_eval = (shared.global_step.value // args.eval_interval + 1) * args.eval_interval
        while True:
            while shared.global_step.value < next_eval:
                if shared.stop.wait(0.5) or os.getppid() != shared.parent_pid:
                    raise Stop
            step = shared.global_step.value
            shared.store.pull(params)
            shared.log_q.put(("eval", step, play_episodes(args, model, env, args.eval_interval_episodes, rng)))
            next_eval = (step // args.eval_interval + 1) * args.eval_interval
    finally:
        env.close()


# ----------------------------------------------------------------------------------------------------------------
# The learner
# ----------------------------------------------------------------------------------------------------------------


class Learner:
    """Networks, target networks and optimizers; `update` is one Ape-X learner step on a sampled batch."""

    def __init__(self, args: Args, obs_space, act_space, device: torch.device):
        self.args, self.device = args, device
        self.model = build_model(args, obs_space, act_space).to(device)
        self.target = build_model(args, obs_space, act_space).to(device)
        self.target.load_state_dict(self.model.state_dict())
        self.target.requires_grad_(False)
        self.version = 0  # learner updates so far
        if args.algo == "dqn":
            params = self.model.parameters()
            if args.optimizer == "rmsprop":  # Ape-X: centered RMSProp
                opt = torch.optim.RMSprop(
                    params, lr=args.learning_rate, alpha=args.rmsprop_alpha, eps=args.rmsprop_eps, centered=True
                )
            else:
                opt = torch.optim.Adam(params, lr=args.learning_rate, eps=args.adam_eps)
            self.optimizers = {"q": opt}
        else:
            self.optimizers = {
                "critic": torch.optim.Adam(
                    self.model.critic.parameters(), lr=args.critic_learning_rate, eps=args.adam_eps
                ),
                "actor": torch.optim.Adam(
                    self.model.actor.parameters(), lr=args.actor_learning_rate, eps=args.adam_eps
                ),
            }

    def params(self) -> list[torch.Tensor]:
        return list(self.model.parameters())

    def update(self, batch: dict) -> tuple[np.ndarray, dict]:
        """One gradient step; returns the new priorities [B] and scalar statistics."""
        args = self.args
        batch = {k: batch[k].to(self.device, non_blocking=True) for k in (*PrioritizedBuffer.FIELDS, "weights")}
        td, q = td_errors(args.algo, self.model, self.target, batch)
        weights = batch["weights"]
        if args.algo == "dqn":
            value_loss = (weights * huber(td)).mean()  # IS-weighted Huber (Ape-X DQN)
            values = dict(value_loss=value_loss, total_loss=value_loss)
            values["grad_norm"] = self.step("q", value_loss, self.model.parameters())
            if (self.version + 1) % args.target_network_frequency == 0:
                self.target.load_state_dict(self.model.state_dict())
        else:
            value_loss = 0.5 * (weights * td.pow(2)).mean()  # IS-weighted squared TD error of the critic
            values = dict(
                value_loss=value_loss, grad_norm=self.step("critic", value_loss, self.model.critic.parameters())
            )
            policy_loss = -self.model.q(batch["obs"], self.model(batch["obs"])).mean()  # deterministic policy gradient
            self.step("actor", policy_loss, self.model.actor.parameters())
            values.update(policy_loss=policy_loss, total_loss=value_loss + policy_loss)
            soft_update(self.target, self.model, args.tau)
        # learner updates between the parameters that acted and this update
        values.update(q_values=q.mean(), policy_lag=self.version - batch["policy_version"].double().mean())
        stats = dict(zip(values, torch.stack([v.detach().double() for v in values.values()]).tolist(), strict=True))
        self.version += 1
        return priorities_of(td, args.priority_alpha, args.priority_eps), stats

    def step(self, name: str, loss: torch.Tensor, params) -> torch.Tensor:
        if not torch.isfinite(loss):
            raise NonFiniteLoss(f"non-finite {name} loss {loss.item()} at learner update {self.version}")
        optimizer = self.optimizers[name]
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        grad_norm = nn.utils.clip_grad_norm_(list(params), self.args.max_grad_norm)
        optimizer.step()
        return grad_norm.detach()

    def state_dict(self) -> dict:
        return dict(
            model=self.model.state_dict(),
            target=self.target.state_dict(),
            optimizers={k: o.state_dict() for k, o in self.optimizers.items()},
            version=self.version,
        )

    def load_state_dict(self, state: dict) -> None:
        self.model.load_state_dict(state["model"])
        self.target.load_state_dict(state["target"])
        for k, o in self.optimizers.items():
            o.load_state_dict(state["optimizers"][k])
        self.version = state["version"]


class Means:
    """Means of the learner's statistics over the last `log_frequency` updates."""

    def __init__(self):
        self.sums: dict[str, float] = {}
        self.count = 0

    def add(self, values: dict) -> None:
        for k, v in values.items():
            self.sums[k] = self.sums.get(k, 0.0) + v
        self.count += 1

    def write(self, writer, global_step: int) -> None:
        for k, v in self.sums.items():
            writer.add_scalar(f"charts/{k}" if k == "policy_lag" else f"losses/{k}", v / self.count, global_step)
        self.sums, self.count = {}, 0


# ----------------------------------------------------------------------------------------------------------------
# torchrun: actor hosts (ranks > 0) and the functions they serve over rpc
# ----------------------------------------------------------------------------------------------------------------

_HOST = None  # on an actor rank: dict(buffers, rng, rng_lock, stop_requested) for the rpc handlers below
_LEARNER = None  # on rank 0: dict(store, log_q) for the rpc handlers below


def _host_stats() -> np.ndarray:
    return LocalReplay(_HOST["buffers"], None).stats()


def _host_sample(counts: list[int]) -> list[dict | None]:
    with _HOST["rng_lock"]:  # rpc handlers run on a thread pool; numpy generators are not thread-safe
        return LocalReplay(_HOST["buffers"], _HOST["rng"]).sample(counts)


def _host_update(parts: list) -> int:
    return LocalReplay(_HOST["buffers"], None).update(parts)


def _host_stop() -> None:
    _HOST["stop_requested"].set()


def _learner_params(known: int):
    return _LEARNER["store"].snapshot(known)


def _learner_inbox(messages: list) -> None:
    for m in messages:
        _LEARNER["log_q"].put(m)


class RemoteReplay:
    """The learner's view of the buffers on the actor ranks (rank r holds buffers [(r-1) K, r K))."""

    def __init__(self, hosts: list[str], per_host: int):
        self.hosts, self.per_host = hosts, per_host

    def _all(self, fn, per_host_args=None) -> list:
        from torch.distributed import rpc

        futures = [
            rpc.rpc_async(h, fn, args=() if per_host_args is None else (per_host_args[i],))
            for i, h in enumerate(self.hosts)
        ]
        return [f.wait() for f in futures]

    def _chunks(self, items) -> list:
        return [list(items[i * self.per_host : (i + 1) * self.per_host]) for i in range(len(self.hosts))]

    def stats(self) -> np.ndarray:
        return np.concatenate(self._all(_host_stats))

    def sample(self, counts) -> list[dict | None]:
        return [part for parts in self._all(_host_sample, self._chunks([int(c) for c in counts])) for part in parts]

    def update(self, parts: list) -> int:
        return sum(self._all(_host_update, self._chunks(parts)))


def run_actor_host(args: Args, rank: int, world_size: int) -> None:
    """An actor rank: its actors and buffers, an rpc server for them, a relay of messages and parameters."""
    from torch.distributed import rpc

    global _HOST
    hosts = world_size - 1
    limit = args.total_timesteps // hosts + (args.total_timesteps % hosts if rank == 1 else 0)
    ctx = mp.get_context("fork")
    shared, procs, _ = setup_machine(
        args,
        ctx,
        num_actors=args.num_actors,
        steps_limit=limit,
        first_global=(rank - 1) * args.num_actors,
        num_total=hosts * args.num_actors,
        evaluator=False,
    )
    start_processes(procs)
    _HOST = dict(
        buffers=shared.buffers,
        rng=np.random.default_rng([args.seed, rank]),
        rng_lock=threading.Lock(),
        stop_requested=threading.Event(),
    )
    signals = StopSignals()
    rpc.init_rpc(f"rank{rank}", rank=rank, world_size=world_size)
    known, last_pull, status = -1, 0.0, 0
    try:
        while not _HOST["stop_requested"].is_set():
            if signals.requested.is_set():
                raise KeyboardInterrupt
            messages = []
            drain_into(shared.log_q, messages.append, 0.1)
            if failure := dead_process(procs, shared):
                messages.append(("error", f"{failure} (on rank {rank})"))
            if messages:
                rpc.rpc_sync("rank0", _learner_inbox, args=(messages,))
            if failure:
                status = 1
                break
            if time.time() - last_pull >= RPC_PARAM_PERIOD:
                version, flat = rpc.rpc_sync("rank0", _learner_params, args=(known,))
                if flat is not None:
                    shared.store.publish(flat, version)
                    known = version
                last_pull = time.time()
    except KeyboardInterrupt:
        status = 128 + signals.signum
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        shutdown(procs, shared, lambda t: drain_into(shared.log_q, lambda m: None, t), grace=4.0)
        rpc.shutdown(graceful=status == 0)
    if status:
        raise SystemExit(status)


# ----------------------------------------------------------------------------------------------------------------
# Setup helpers: validation, processes, checkpoints
# ----------------------------------------------------------------------------------------------------------------


def validate(args: Args, world_size: int = 1) -> str | None:
    """Every flag checked before anything is spawned; returns the error line or None."""
    for name, value in asdict(args).items():
        if isinstance(value, float) and not math.isfinite(value):
            return f"--{name.replace('_', '-')} must be a finite number, got {value}"
    for name, choices in (
        ("algo", ALGOS),
        ("optimizer", OPTIMIZERS),
        ("noise_type", NOISE_TYPES),
        ("network", NETWORKS),
        ("atari_protocol", PROTOCOLS),
    ):
        if getattr(args, name) not in choices:
            return f"--{name.replace('_', '-')} must be one of {', '.join(choices)}, got {getattr(args, name)!r}"
    for name in (
        "num_actors",
        "num_envs_per_actor",
        "torch_threads",
        "actor_batch",
        "actor_update_interval",
        "batch_size",
        "n_step",
        "target_network_frequency",
        "log_frequency",
        "eval_interval_episodes",
    ):
        if getattr(args, name) < 1:
            return f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}"
    for name in (
        "learning_rate",
        "critic_learning_rate",
        "actor_learning_rate",
        "max_grad_norm",
        "rmsprop_eps",
        "adam_eps",
        "priority_eps",
    ):
        if not getattr(args, name) > 0:
            return f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}"
    for name in (
        "learner_threads",
        "learning_starts",
        "checkpoint_interval",
        "eval_episodes",
        "eval_interval",
        "replay_ratio",
        "log_interval",
        "exploration_noise",
        "priority_alpha",
    ):
        if getattr(args, name) < 0:
            return f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}"
    for name in ("gamma", "tau", "epsilon", "eval_epsilon", "priority_beta", "rmsprop_alpha", "ou_theta"):
        if not 0 <= getattr(args, name) <= 1:
            return f"--{name.replace('_', '-')} must be in [0, 1], got {getattr(args, name)}"
    if args.algo == "ddpg" and args.learning_rate != DQN_LEARNING_RATE:
        return "--learning-rate is the DQN Q-network's; --algo ddpg takes --critic-learning-rate, --actor-learning-rate"
    if not args.hidden_sizes or min(args.hidden_sizes) < 1:
        return f"--hidden-sizes must be one or more positive widths, got {args.hidden_sizes}"
    if args.resume is not None and not Path(args.resume).is_file():
        return f"--resume {args.resume}: no such checkpoint file"
    if world_size > 1 and args.resume is not None:
        return "--resume works with the single-machine launch only (the actor ranks' step counts are not saved)"
    actors = args.num_actors * max(1, world_size - 1)
    if args.buffer_size < actors * args.actor_batch:
        return (
            f"--buffer-size ({args.buffer_size}) must hold at least one --actor-batch ({args.actor_batch}) per "
            f"actor ({actors} actors)"
        )
    if args.learning_starts > args.buffer_size:
        return f"--learning-starts ({args.learning_starts}) must be <= --buffer-size ({args.buffer_size})"
    if args.total_timesteps < actors * args.num_envs_per_actor:
        return f"--total-timesteps ({args.total_timesteps}) is less than one step of every env of every actor"
    try:
        check_env_args(args.env_id, args.num_envs_per_actor, args.atari_protocol)
        spaces = env_spaces(args)
        discrete = isinstance(spaces[1], gym.spaces.Discrete)
        if discrete != (args.algo == "dqn"):
            kind, other = ("Discrete", "ddpg") if args.algo == "dqn" else ("Box", "dqn")
            return (
                f"{args.env_id} has a {'Discrete' if discrete else 'continuous'} action space ({spaces[1]}); "
                f"--algo {args.algo} needs a {kind} action space: use apex.py --algo {other}"
            )
        build_model(args, *spaces)
    except (EnvError, ValueError) as e:
        return f"{e} (--algo {args.algo} on {args.env_id})" if not isinstance(e, EnvError) else str(e)
    return None


def env_spaces(args: Args):
    """(observation space, action space) of one env, from a probe of the training vector env."""
    probe = make_vector_env(args.env_id, 1, args.seed, protocol=args.atari_protocol, num_threads=1)
    spaces = probe.single_observation_space, probe.single_action_space
    probe.close()
    return spaces


def setup_machine(
    args: Args,
    ctx,
    *,
    num_actors: int,
    steps_limit: int,
    first_global: int,
    num_total: int,
    evaluator: bool,
    start_step: int = 0,
):
    """This machine's buffers, parameter store and (unstarted) processes: actors, and the evaluator if asked."""
    obs_space, act_space = env_spaces(args)
    model = build_model(args, obs_space, act_space)
    discrete = args.algo == "dqn"
    obs_dtype = torch.uint8 if obs_space.dtype == np.uint8 else torch.float32
    capacity = args.buffer_size // num_total
    buffers = [
        PrioritizedBuffer(
            capacity,
            obs_space.shape,
            obs_dtype,
            () if discrete else act_space.shape,
            torch.int64 if discrete else torch.float32,
            ctx.Lock(),
        ).share_memory_()
        for _ in range(num_actors)
    ]
    shared = Shared(
        stop=StopFlag(ctx),
        log_q=ctx.Queue(),
        error_q=ctx.Queue(),
        steps_claimed=ctx.Value("q", start_step),
        steps_limit=steps_limit,
        # no locks where main is the only writer: a child stopped or killed holding one would block main forever
        global_step=ctx.Value("q", start_step, lock=False),
        learn_start=ctx.Value("d", math.nan, lock=False),
        store=ParamStore(sum(p.numel() for p in model.parameters()), ctx),
        buffers=buffers,
        parent_pid=os.getpid(),
    )
    procs = {}
    for a in range(num_actors):
        procs[f"actor {first_global + a}"] = ctx.Process(
            target=process_body,
            args=(f"actor {first_global + a}", actor_loop, shared, a, first_global + a, num_total, args, shared),
            daemon=True,
        )
    if evaluator:
        procs["evaluator"] = ctx.Process(
            target=process_body,
            args=("evaluator", evaluator_loop, shared, args, shared, obs_space, act_space),
            daemon=True,
        )
    return shared, procs, (obs_space, act_space)


def start_processes(procs: dict) -> None:
    """Children start with SIGINT/SIGTERM blocked, then ignore them: Ctrl+C reaches the whole process group."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        for p in procs.values():
            p.start()
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})


def drain_into(q, handle, timeout: float) -> None:
    """Handle every queued message, waiting up to `timeout` for the first."""
    try:
        handle(q.get(timeout=timeout) if timeout else q.get_nowait())
        while True:
            handle(q.get_nowait())
    except queue.Empty:
        pass


def dead_process(procs: dict, shared: Shared) -> str | None:
    for name, p in procs.items():
        if p.exitcode is not None and p.exitcode != 0:
            try:  # its traceback, if it lived to send one
                return shared.error_q.get(timeout=2.0)
            except queue.Empty:
                how = f"killed by signal {-p.exitcode}" if p.exitcode < 0 else f"exit status {p.exitcode}"
                return f"error: {name} died ({how}); stopping the run"
    return None


def shutdown(procs: dict, shared: Shared, drain, grace: float) -> None:
    """Stop processes within `grace` seconds: set `stop`, keep draining the log queue while they exit (a process
    waits for its queued messages to reach the pipe before exiting), kill what is left."""
    shared.stop.set()
    deadline = time.time() + grace
    while any(p.is_alive() for p in procs.values()) and time.time() < deadline:
        try:
            drain(0.2)
        except OSError:  # TensorBoard's events file cannot be written (reported by the caller): keep stopping
            time.sleep(0.2)
    for p in procs.values():
        if p.is_alive():
            p.kill()
        p.join(timeout=2.0)
    try:
        drain(0.0)
    except OSError:
        pass


def fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def new_run_dir(args: Args) -> Path:
    """Create this run's directory, never one that exists: a run started in the same second with the same name gets
    the suffix -2, -3, ... (mkdir is atomic, so two runs cannot both take one name). Exit 2 if it cannot be made."""
    base = Path(args.log_dir) / f"{args.env_id.replace('/', '_')}__{args.exp_name}__{args.seed}__{int(time.time())}"
    try:
        base.parent.mkdir(parents=True, exist_ok=True)
    except FileExistsError:
        fail(f"cannot create the run directory {base}: {base.parent} is not a directory")
    except OSError as e:
        fail(f"cannot create the run directory {base}: {e.strerror or e}")
    for n in itertools.count(1):
        run_dir = base if n == 1 else base.with_name(f"{base.name}-{n}")
        try:
            run_dir.mkdir()
            return run_dir
        except FileExistsError:
            continue
        except OSError as e:
            fail(f"cannot create the run directory {run_dir}: {e.strerror or e}")


def checkpoint_meta(args: Args, obs_space, act_space) -> dict:
    """What a checkpoint must match to be resumed by this run: script, algo, env, networks and shapes."""
    auto_network = "nature" if len(obs_space.shape) == 3 else "mlp"
    return dict(
        script=Path(__file__).name,
        algo=args.algo,
        env_id=args.env_id,
        network=None if args.algo == "ddpg" else args.network if args.network != "auto" else auto_network,
        hidden_sizes=list(args.hidden_sizes),
        obs_shape=list(obs_space.shape),
        action_shape_or_n=int(act_space.n) if args.algo == "dqn" else list(act_space.shape),
    )


def load_checkpoint(path: str, meta: dict) -> dict:
    """The checkpoint at `path` if this run can continue it; otherwise one error line and exit 2 (nothing started)."""
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:
        reason = (str(e).strip().splitlines() or [""])[0][:120]
        fail(f"cannot resume from {path}: not a checkpoint this script can read ({type(e).__name__}: {reason})")
    theirs = checkpoint.get("meta") if isinstance(checkpoint, dict) else None
    if not isinstance(theirs, dict):
        fail(f'cannot resume from {path}: not a checkpoint this script can read (it has no "meta" entry)')
    differ = [k for k in meta if theirs.get(k) != meta[k]]
    if differ:
        fail(
            f"cannot resume from {path}: it is a {theirs.get('script')} checkpoint "
            f"({', '.join(f'{k} {theirs.get(k)}' for k in differ)}), this run is "
            f"{', '.join(f'{k} {meta[k]}' for k in differ)}"
        )
    return checkpoint


def events_error(e: OSError, run_dir: Path) -> str:
    """The error line for a TensorBoard events file that cannot be written (a full disk, most often). TensorBoard's
    writer thread dies of it and the main thread gets it at its next write; the thread is kept from printing its own
    traceback (`threading.excepthook`), so the run reports it in this one line."""
    reason = "no space left on device" if e.errno == errno.ENOSPC else (e.strerror or str(e))
    return f"error: {reason} while writing the TensorBoard events in {run_dir}; stopping"


def quiet_writer_thread() -> None:
    default = threading.excepthook
    threading.excepthook = lambda hook_args: None if issubclass(hook_args.exc_type, OSError) else default(hook_args)


class WriteError(RuntimeError):
    """A checkpoint or model file could not be written; the message is the error line."""


def atomic_save(obj, path: Path) -> None:
    """torch.save, atomic: a temporary file, then a rename over the old file, so a full disk leaves the last good one.
    Serialised in memory first: torch.save to a full disk raises a cryptic "unexpected pos" instead of ENOSPC."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    tmp = path.with_suffix(".tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(buffer.getbuffer())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        reason = "no space left on device" if e.errno == errno.ENOSPC else (e.strerror or str(e))
        raise WriteError(f"error: {reason} while writing {path}") from None


class StopSignals:
    """Ctrl+C and SIGTERM only set `requested` (and `signum`, for the exit status 128 + signum): start-up checks it
    before starting processes and the main loop at the top of every iteration, then unwinds through `finally`. An
    exception raised from the handler could cut start-up between two process starts (orphans, a traceback), or leave
    half a message in the pipe inside a `log_q.get` (`EOFError: Ran out of input` at the next read)."""

    def __init__(self):
        self.requested, self.signum = threading.Event(), 0
        signal.signal(signal.SIGINT, self.handler)
        signal.signal(signal.SIGTERM, self.handler)

    def handler(self, signum, frame) -> None:
        self.signum = self.signum or signum
        self.requested.set()


# ----------------------------------------------------------------------------------------------------------------
# main: the learner (single machine, or rank 0 under torchrun) or an actor rank
# ----------------------------------------------------------------------------------------------------------------


def main(args: Args) -> None:
    world_size, rank = int(os.environ.get("WORLD_SIZE", "1")), int(os.environ.get("RANK", "0"))
    if args.learner_threads >= 1:  # before validation builds a model: oversubscribed threads make that slow too
        torch.set_num_threads(args.learner_threads)
    if error := validate(args, world_size):
        fail(error)
    torch.manual_seed(args.seed)
    torch.backends.cudnn.deterministic = args.torch_deterministic
    torch.use_deterministic_algorithms(args.torch_deterministic, warn_only=True)
    # deterministic mode would also NaN-fill every new tensor; nothing here reads uninitialised memory
    torch.utils.deterministic.fill_uninitialized_memory = False
    if rank > 0:
        run_actor_host(args, rank, world_size)
        return
    run_learner(args, world_size)


def run_learner(args: Args, world_size: int) -> None:
    meta = checkpoint_meta(args, *env_spaces(args))
    checkpoint = load_checkpoint(args.resume, meta) if args.resume else None
    signals = StopSignals()
    use_cuda = args.cuda and torch.cuda.is_available()
    device = torch.device("cuda" if use_cuda else "cpu")
    if checkpoint:
        run_dir = Path(args.resume).parent
        if not os.access(run_dir, os.W_OK):
            fail(f"cannot write to the run directory {run_dir} of --resume {args.resume}")
    else:
        run_dir = new_run_dir(args)
    checkpoint_path = run_dir / "checkpoint.pt"
    global_step = checkpoint["global_step"] if checkpoint else 0
    distributed = world_size > 1
    num_total = args.num_actors * (world_size - 1 if distributed else 1)

    ctx = mp.get_context("spawn" if use_cuda else "fork")  # CUDA cannot be used in forked children
    shared, procs, (obs_space, act_space) = setup_machine(
        args,
        ctx,
        num_actors=0 if distributed else args.num_actors,
        steps_limit=args.total_timesteps,
        first_global=0,
        num_total=num_total,
        evaluator=args.eval_interval > 0,
        start_step=global_step,
    )
    learner = Learner(args, obs_space, act_space, device)
    if checkpoint:
        learner.load_state_dict(checkpoint["learner"])
        torch.set_rng_state(checkpoint["torch_rng"])
    shared.store.publish(learner.params(), learner.version)
    rng = np.random.default_rng([args.seed, 1])
    if distributed:
        from torch.distributed import rpc

        global _LEARNER
        _LEARNER = dict(store=shared.store, log_q=shared.log_q)
        replay = RemoteReplay([f"rank{r}" for r in range(1, world_size)], args.num_actors)
    else:
        replay = LocalReplay(shared.buffers, rng)

    print(
        f"run directory: {run_dir}  (Ape-X {args.algo.upper()}: {num_total} actors x {args.num_envs_per_actor} envs, "
        f"replay {args.buffer_size:,} in {num_total} buffers, learner on {device}"
        f"{f', {world_size - 1} actor ranks over rpc' if distributed else ''})",
        flush=True,
    )
    if signals.requested.is_set():  # Ctrl+C while setting up: stop before any process starts, leave nothing behind
        if not checkpoint:
            run_dir.rmdir()
        print("interrupted during start-up", file=sys.stderr)
        raise SystemExit(128 + signals.signum)
    start_processes(procs)
    if distributed:
        rpc.init_rpc("rank0", rank=0, world_size=world_size)

    from torch.utils.tensorboard import SummaryWriter  # after the forks: the writer runs a thread

    quiet_writer_thread()
    writer = SummaryWriter(str(run_dir))
    table = "\n".join(f"|{k}|{v}|" for k, v in asdict(args).items())
    writer.add_text("hyperparameters", f"|param|value|\n|-|-|\n{table}")

    recent_returns: deque[float] = deque(maxlen=20)
    means = Means()
    start_time, start_step = time.time(), global_step
    last_print = last_checkpoint = last_check = time.time()
    actors_done, stale_total, wait_time = set(), 0, 0.0
    learn_start, start_version = -1, 0
    interrupted, failure = False, None
    stats = np.zeros((num_total, 3))
    learning_rate = args.learning_rate if args.algo == "dqn" else args.critic_learning_rate

    def handle(message) -> None:
        nonlocal global_step, failure
        kind = message[0]
        if kind == "actor":
            _, _, steps, episodes, _ = message
            global_step += steps
            shared.global_step.value = global_step
            for ret, length in episodes:
                writer.add_scalar("charts/episodic_return", ret, global_step)
                writer.add_scalar("charts/episodic_length", length, global_step)
                recent_returns.append(ret)
        elif kind == "done":
            actors_done.add(message[1])
        elif kind == "eval":
            for ret in message[2]:
                writer.add_scalar("eval/episodic_return", ret, message[1])
        elif kind == "error":
            failure = failure or message[1]

    def sps() -> float:
        return (global_step - start_step) / max(1e-9, time.time() - start_time)

    def write_checkpoint() -> None:
        state = dict(learner=learner.state_dict(), global_step=global_step, algo=args.algo, args=asdict(args))
        atomic_save({**state, "torch_rng": torch.get_rng_state(), "meta": meta}, checkpoint_path)

    def log_scalars() -> None:
        means.write(writer, global_step)
        writer.add_scalar("charts/SPS", sps(), global_step)
        writer.add_scalar("charts/learning_rate", learning_rate, global_step)
        writer.add_scalar("replay/size", stats[:, 2].sum(), global_step)
        writer.add_scalar("replay/priority_mean", stats[:, 0].sum() / max(1.0, stats[:, 2].sum()), global_step)
        writer.add_scalar("replay/stale_updates", stale_total, global_step)
        writer.add_scalar("timing/replay_wait", wait_time, global_step)

    try:
        while len(actors_done) < num_total and failure is None:
            if signals.requested.is_set():
                raise KeyboardInterrupt
            stats = replay.stats()
            size = stats[:, 2].sum()
            ratio_ok = (
                not args.replay_ratio
                or learn_start < 0
                or (learner.version - start_version) * args.batch_size < args.replay_ratio * (global_step - learn_start)
            )
            if size >= max(args.learning_starts, 1) and ratio_ok:
                if learn_start < 0:  # the rate limiter counts from here
                    learn_start, start_version = global_step, learner.version
                    if args.replay_ratio:
                        shared.learn_start.value = (  # steps_claimed read without its lock (actors hold it)
                            shared.steps_claimed.get_obj().value - start_version * args.batch_size / args.replay_ratio
                        )
                drain_into(shared.log_q, handle, 0.0)
                beta = importance_exponent(args.priority_beta, args.anneal_beta, global_step / args.total_timesteps)
                batch, buffer_ids, stats = sample_batch(replay, args.batch_size, beta, rng, stats)
                priorities, values = learner.update(batch)
                stale_total += replay.update(split_updates(batch, buffer_ids, priorities, num_total))
                shared.store.publish(learner.params(), learner.version)
                means.add(values)
                if means.count >= args.log_frequency:
                    log_scalars()
            else:  # waiting for data: block on the actors' reports
                t0 = time.perf_counter()
                drain_into(shared.log_q, handle, 0.5)
                wait_time += time.perf_counter() - t0
            now = time.time()
            if now - last_check >= 0.5:
                last_check = now
                failure = failure or dead_process(procs, shared)
            if now - last_print >= args.log_interval:
                mean_ret = f"{np.mean(recent_returns):.2f}" if recent_returns else "n/a"
                print(
                    f"step {global_step:>10,}  updates {learner.version:,}  SPS {sps():,.0f}  "
                    f"replay {int(size):,}  return(last {len(recent_returns)}) {mean_ret}",
                    flush=True,
                )
                last_print = now
            if args.checkpoint_interval and now - last_checkpoint >= args.checkpoint_interval:
                write_checkpoint()
                last_checkpoint = now
    except KeyboardInterrupt:
        interrupted = True
        print("interrupted: shutting down", file=sys.stderr, flush=True)
    except NonFiniteLoss as e:
        failure = f"error: learner: {e}; stopping (the last checkpoint, if any, is kept)"
    except LockTimeout as e:
        failure = dead_process(procs, shared) or f"error: learner: {e}; stopping"
    except WriteError as e:
        failure = f"{e}; stopping (the last good checkpoint is kept)"
    except OSError as e:  # the TensorBoard events file
        failure = events_error(e, run_dir)
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl+C must not cut the shutdown short
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        shutdown(procs, shared, lambda t: drain_into(shared.log_q, handle, t), grace=4.0 if failure is None else 1.0)
        if distributed:
            for host in range(1, world_size):
                try:
                    rpc.rpc_sync(f"rank{host}", _host_stop, timeout=5.0)
                except Exception:  # the host is gone already (torchrun tears down failed ranks)
                    pass
            rpc.shutdown(graceful=failure is None and not interrupted)
        if failure is None:  # an error a process sent before the stop (ones killed by `shutdown` are not failures)
            try:
                failure = shared.error_q.get_nowait()
            except queue.Empty:
                pass
    try:
        if failure is None and args.checkpoint_interval:
            write_checkpoint()
        if failure is None and not interrupted and args.save_model:
            atomic_save(learner.model.state_dict(), run_dir / "model.pt")
    except WriteError as e:
        failure = f"{e}; stopping (the last good checkpoint is kept)"
    try:
        if means.count:
            log_scalars()
    except OSError as e:
        failure = failure or events_error(e, run_dir)
    finished = failure is None and not interrupted
    mean_ret = f"{np.mean(recent_returns):.2f}" if recent_returns else "n/a"
    print(f"step {global_step:>10,}  updates {learner.version:,}  SPS {sps():,.0f}  return {mean_ret}", flush=True)
    if finished:
        if args.eval_episodes:
            env = make_env(
                args.env_id,
                args.seed + 2_000_003,
                protocol=args.atari_protocol,
                capture_video=args.capture_video,
                video_dir=str(run_dir / "videos"),
            )
            model = build_model(args, obs_space, act_space, channels_last=False)
            model.load_state_dict(learner.model.state_dict())
            returns = play_episodes(args, model, env, args.eval_episodes, np.random.default_rng(args.seed))
            env.close()
            for i, ret in enumerate(returns):
                writer.add_scalar("eval/episodic_return", ret, global_step)
                print(f"eval episode {i}: return {ret:.1f}")
    try:
        writer.close()
    except OSError as e:
        failure = failure or events_error(e, run_dir)
    if failure:
        print(failure, file=sys.stderr)
        raise SystemExit(1)
    if interrupted:
        raise SystemExit(128 + signals.signum)


if __name__ == "__main__":
    main(tyro.cli(Args))
