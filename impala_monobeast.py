"""IMPALA with V-trace (Espeholt et al. 2018) in TorchBeast's MonoBeast architecture (Küttler et al., "TorchBeast: a
PyTorch platform for distributed RL", 2019, Section 5.1), with PolyBeast-style batched inference as an option.

Who runs where: actors are processes; learner threads and the inference thread run in the main process.
  buffers[K] (shared memory): rollouts of T + 1 rows; `free` and `full` queues carry buffer indices and a `ledger`
      says where each index is (free queue, actor i, full queue, a learner thread).
  actor i (M processes, N envs each): index <- free; row 0 = its previous rollout's row T; steps the envs T times,
      asking the policy at every row; index -> full.
  the policy: `--inference actor` (MonoBeast): the actor's CPU copy of the model in shared memory, refreshed in place
      after every update. `--inference batched` (PolyBeast's dynamic batching without gRPC): the actor writes its
      inputs to its slot and its id to a pipe; the inference thread takes every id waiting (up to
      `--max-inference-batch` envs), runs one forward pass (GPU when present), writes the outputs to the slots.
  learner thread j (`--num-learner-threads`): B indices <- full (under a lock), stacked to [T + 1, B * N], indices
      -> free; then, one thread at a time: V-trace loss, RMSprop step, refresh of the acting parameters, logging.
Policy lag (`charts/policy_lag`, updates between the acting and the learning parameters): with one actor and one
  learner thread a row is at most ceil(K / B) updates old, ceil((K + 1) / B) for row 0, as every buffer but the one
  being written may wait full. With more actors nothing bounds it, and it grows with their number (IMPALA, Sec. 3).
Determinism: none promised: which policy version acts on which step depends on process timing, as in MonoBeast.
Defaults are TorchBeast's (monobeast.py flags: AtariNet's inputs, losses summed over the batch, rewards clipped in the
  loss); IMPALA's Atari setting is Table G.1's:

    python impala_monobeast.py --env-id ALE/Pong-v5 --unroll-length 20 --batch-size 32 --learning-rate 6e-4 \\
        --ent-coef 0.01 --network impala --use-lstm
    python impala_monobeast.py --env-id ALE/Breakout-v5                                # batched inference, 4 actors
    python impala_monobeast.py --env-id ALE/Pong-v5 --inference actor --num-actors 8    # MonoBeast exactly
    python impala_monobeast.py --eval-only runs/<run>/model.pt --eval-episodes 10 --capture-video  # a saved agent
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
import math
import multiprocessing as mp
import multiprocessing.connection
import queue
import shlex
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, fields, replace
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Semaphore
from pathlib import Path
from typing import Literal, NoReturn

import gymnasium as gym
import numpy as np
import torch
import tyro
from torch import nn

from common.atari import EnvError, check_env_args, check_video, make_env, make_vector_env
from common.models import LSTMState, make_model


@dataclass
class Args:
    exp_name: str = Path(__file__).stem
    """name of this experiment (part of the run directory)"""
    seed: int = 1
    """seed of the experiment"""
    torch_deterministic: bool = True
    """use deterministic torch algorithms (the run itself is not reproducible: see the module docstring)"""
    cuda: bool = True
    """use a GPU for the learner and batched inference when one is present"""
    env_id: str = "ALE/Breakout-v5"
    """gymnasium id; ALE ids run in ale-py's C++ vector env"""
    atari_protocol: Literal["deepmind", "machado"] = "deepmind"
    """ALE preprocessing (`deepmind` is TorchBeast's setting)"""
    total_timesteps: int = 50_000_000
    """agent steps summed over all envs (the learner counts unroll_length x batch_size x envs per update)"""
    log_dir: str = "runs"
    """where run directories go"""
    save_model: bool = False
    """write the final model's state_dict to {run_dir}/model.pt"""
    checkpoint_interval: float = 600.0
    """seconds between checkpoints to {run_dir}/checkpoint.pt, also written at the end and at Ctrl+C (0 = none)"""
    resume: str | None = None
    """path of a checkpoint.pt to continue from (same run directory and step count)"""
    eval_episodes: int = 0
    """episodes to evaluate the final policy on (logged as eval/episodic_return; --eval-only: 0 plays 10)"""
    eval_greedy: bool = True
    """evaluate with argmax actions (TorchBeast's test mode; `--no-eval-greedy` samples) over full games, where
    TorchBeast's test() ends an episode at each lost life"""
    eval_only: str | None = None
    """evaluate a saved agent instead of training: a model.pt or checkpoint.pt of a run of this script; env, protocol,
    network and model options (TorchBeast's inputs, the LSTM) come from the run's args.json / checkpoint"""
    capture_video: bool = False
    """record videos of the evaluation episodes to {run_dir}/videos (--eval-only: {model dir}/videos-eval-{time})"""
    track: bool = False
    """log to Weights & Biases (TensorBoard synced, Args as config, videos uploaded); `pip install -e ".[track]"`"""
    wandb_project_name: str = "actorlearners"
    """Weights & Biases project of --track"""
    wandb_entity: str | None = None
    """Weights & Biases entity (team or user) of --track; None: your default entity"""

    # architecture (TorchBeast monobeast.py defaults)
    inference: Literal["batched", "actor"] = "batched"
    """`batched`: one inference thread batches all waiting actors (GPU when present); `actor`: MonoBeast's CPU copy"""
    num_actors: int = 4
    """actor processes"""
    num_envs_per_actor: int = 1
    """envs each actor steps (1 = MonoBeast; more gives each actor a batched forward pass)"""
    num_buffers: int | None = None
    """shared-memory rollout buffers; None: max(2 * num_actors, batch_size), TorchBeast's choice"""
    num_learner_threads: int = 2
    """learner threads: they batch concurrently, update one at a time"""
    max_inference_batch: int = 0
    """batched inference: most envs per forward pass (0 = all actors' envs)"""
    torch_threads: int = 0
    """torch threads of the main process, which learns and runs batched inference (0 = the cores the actors leave)"""
    network: Literal["auto", "nature", "impala", "mlp"] = "auto"
    """`nature` (TorchBeast's shallow net), `impala` (deep ResNet), `mlp`, or `auto` (nature for frames, else mlp)"""
    use_lstm: bool = False
    """LSTM core between torso and heads (state stored at each rollout start)"""
    lstm_size: int = 0
    """LSTM hidden size (0 = as wide as its input, TorchBeast's AtariNet)"""
    lstm_layers: int = 2
    """LSTM layers (TorchBeast's AtariNet: 2)"""
    action_reward_inputs: bool = True
    """feed the clipped reward and a one-hot of the last action beside the torso features (TorchBeast's AtariNet)"""

    # loss and optimiser (TorchBeast monobeast.py defaults; IMPALA's Atari setting, Table G.1: module docstring)
    unroll_length: int = 80
    """steps per rollout (T)"""
    batch_size: int = 8
    """rollouts per learner batch"""
    learning_rate: float = 0.00048
    """RMSprop learning rate, decayed linearly to 0 over total_timesteps"""
    rmsprop_alpha: float = 0.99
    """RMSprop smoothing constant"""
    rmsprop_eps: float = 0.01
    """RMSprop epsilon"""
    rmsprop_momentum: float = 0.0
    """RMSprop momentum"""
    max_grad_norm: float = 40.0
    """global gradient-norm clip"""
    gamma: float = 0.99
    """discount factor"""
    vf_coef: float = 0.5
    """weight of the baseline (value) loss: TorchBeast's --baseline_cost, the loss summed over the batch as there"""
    ent_coef: float = 0.0006
    """weight of the entropy regulariser: TorchBeast's --entropy_cost, the loss summed over the batch as there"""
    clip_rewards: bool = True
    """clip rewards to [-1, 1] in the loss (TorchBeast's reward_clipping=abs_one); the env hands them over raw"""
    vtrace_rho_bar: float = 1.0
    """truncation of the importance weights in the V-trace targets (rho-bar)"""
    vtrace_c_bar: float = 1.0
    """truncation of the trace-cutting coefficients (c-bar)"""
    vtrace_pg_rho_bar: float = 1.0
    """truncation of the importance weights in the policy-gradient advantage"""
    log_interval: float = 10.0
    """seconds between console lines"""


# ---- Algorithm -------------------------------------------------------------------------------------------------------


def vtrace(
    behaviour_logprob: torch.Tensor, target_logprob: torch.Tensor, rewards: torch.Tensor, values: torch.Tensor,
    dones: torch.Tensor, next_value: torch.Tensor, gamma: float, rho_bar: float, c_bar: float, pg_rho_bar: float,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """V-trace targets v_s and policy-gradient advantages (Espeholt et al. 2018, Eq. 1 and Section 4.2). Time-major
    inputs [T, B, ...] except next_value [B, ...]; the discount gamma * (1 - dones[t]) cuts every trace at an episode
    end. Returns (vs, pg_advantages), both [T, B, ...] and without gradient."""
    with torch.no_grad():
        ratio = torch.exp(target_logprob - behaviour_logprob)
        rho, c = ratio.clamp(max=rho_bar), ratio.clamp(max=c_bar)
        discounts = gamma * (1.0 - dones.to(rewards.dtype))
        values_next = torch.cat([values[1:], next_value[None]], dim=0)  # V(x_{t+1})
        deltas = rho * (rewards + discounts * values_next - values)
        vs_minus_v = torch.zeros_like(values)
        acc = torch.zeros_like(next_value)
        for t in reversed(range(values.shape[0])):  # v_s - V(x_s) = delta_s + gamma_s c_s (v_{s+1} - V(x_{s+1}))
            acc = deltas[t] + discounts[t] * c[t] * acc
            vs_minus_v[t] = acc
        vs = vs_minus_v + values
        vs_next = torch.cat([vs[1:], next_value[None]], dim=0)
        pg_advantages = ratio.clamp(max=pg_rho_bar) * (rewards + discounts * vs_next - values)
    return vs, pg_advantages


def logprob_entropy(logits: torch.Tensor, actions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """log pi(a|s) and the policy entropy, [..., A] logits -> [...]."""
    logp = torch.log_softmax(logits, dim=-1)
    return logp.gather(-1, actions[..., None]).squeeze(-1), -(logp.exp() * logp).sum(-1)


def impala_loss(target_logprob: torch.Tensor, entropy: torch.Tensor, values: torch.Tensor, vs: torch.Tensor,
                pg_advantages: torch.Tensor, vf_coef: float, ent_coef: float) -> dict[str, torch.Tensor]:  # fmt: skip
    """IMPALA's loss (Espeholt et al. 2018, Section 4.2) summed over the [T, B] batch, as the paper's code, TorchBeast
    and Cleanba's cleanba_impala.py (rlax's per-step means x T, summed over B) sum it: the learning rate, RMSprop's eps
    and the clip norm are set for gradients of that size. `entropy` is returned as the mean per step, for the logs."""
    policy_loss = -(target_logprob * pg_advantages).sum()
    value_loss = 0.5 * ((vs - values) ** 2).sum()
    entropy_sum = entropy.sum()
    total = policy_loss - ent_coef * entropy_sum + vf_coef * value_loss
    return dict(
        total_loss=total, policy_loss=policy_loss, value_loss=value_loss, entropy=entropy_sum.detach() / entropy.numel()
    )


def linear_lr(base: float, steps_done: int, total_steps: int) -> float:
    """TorchBeast's schedule: linear decay to 0 over total_timesteps, evaluated before each update."""
    return base * (1.0 - min(steps_done, total_steps) / total_steps)


def learner_outputs(model: nn.Module, b: Rollouts) -> tuple[torch.Tensor, torch.Tensor]:
    """The learner's logits [T + 1, B, A] and values [T + 1, B] on a batch, from the same inputs the actors fed."""
    T1, B = b.reward.shape
    if model.core is None:
        logits, values = model(b.obs.reshape(T1 * B, *b.obs.shape[2:]), b.last_action, b.reward)
        return logits.reshape(T1, B, -1), values.reshape(T1, B)
    logits, values, _ = model.recurrent(b.obs, b.done, (b.initial_h, b.initial_c), b.last_action, b.reward)
    return logits, values


def vtrace_losses(model: nn.Module, batch: Rollouts, args: Args, device: torch.device) -> dict[str, torch.Tensor]:
    """The V-trace actor-critic losses of `model` on a [T + 1, B] batch."""
    b = batch.to(device)
    logits, values = learner_outputs(model, b)
    rewards = b.reward[1:].clamp(-1.0, 1.0) if args.clip_rewards else b.reward[1:]  # raw from the env
    actions = b.action[:-1]
    target_logprob, entropy = logprob_entropy(logits[:-1], actions)
    behaviour_logprob, _ = logprob_entropy(b.logits[:-1], actions)
    vs, pg_adv = vtrace(behaviour_logprob, target_logprob.detach(), rewards, values[:-1].detach(), b.done[1:],
                        values[-1].detach(), args.gamma, args.vtrace_rho_bar, args.vtrace_c_bar,
                        args.vtrace_pg_rho_bar)  # fmt: skip
    return impala_loss(target_logprob, entropy, values[:-1], vs, pg_adv, args.vf_coef, args.ent_coef)


def gradient_step(model: nn.Module, optimizer: torch.optim.Optimizer, loss: torch.Tensor, max_grad_norm: float):
    """One optimizer step on `loss`, its gradient clipped to norm max_grad_norm; returns the norm before clipping."""
    optimizer.zero_grad(set_to_none=True)
    loss.backward()
    grad_norm = nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    optimizer.step()
    return grad_norm


# ---- Storage and messages --------------------------------------------------------------------------------------------

# ledger values: an actor's id (>= 0) while that actor writes the buffer, otherwise where the index is
FREE_QUEUE = -1
FULL_QUEUE = -2
LEARNER = -3
# the fields of one row t of a rollout, and what an actor records about the whole rollout (see Rollouts)
ROW_KEYS = ("obs", "reward", "done", "last_action", "episode_end", "episode_return", "episode_length", "logits",
            "baseline", "action", "version")  # fmt: skip
ROLLOUT_KEYS = ("actor_id", "rollout", "free_wait", "inference_wait")


@dataclass
class Rollouts:
    """Rollouts of T + 1 rows over one actor's N envs: [K, T + 1, N, ...] in the buffers, [T + 1, B * N, ...] in a
    learner batch of B of them (per-rollout fields [K] and [B]; LSTM states [K, L, N, H] and [L, B * N, H]). Row 0 is
    the previous rollout's row T, so transitions t = 0..T-1 are (x_t, a_t, reward[t + 1], done[t + 1], x_{t + 1}).
    As in TorchBeast's `Environment`, reward and last action are 0 only at an actor's first observation; the first
    row of any later episode carries the previous episode's last reward and action (only the LSTM state is zeroed)."""

    obs: torch.Tensor  # [K, T + 1, N, *obs_shape], x_t
    reward: torch.Tensor  # [K, T + 1, N], raw, arrived with x_t
    done: torch.Tensor  # [K, T + 1, N] bool, x_t starts a new episode
    last_action: torch.Tensor  # [K, T + 1, N] int64, a_{t-1}: the network's input beside x_t and reward[t]
    episode_end: torch.Tensor  # [K, T + 1, N] bool, a game (all lives) ended on arriving at this row
    episode_return: torch.Tensor  # [K, T + 1, N], its true return (valid where episode_end)
    episode_length: torch.Tensor  # [K, T + 1, N] int64
    logits: torch.Tensor  # [K, T + 1, N, A] behaviour policy logits
    baseline: torch.Tensor  # [K, T + 1, N]
    action: torch.Tensor  # [K, T + 1, N] int64, a_t
    version: torch.Tensor  # [K, T + 1, N] int64, learner updates behind the parameters that acted
    initial_h: torch.Tensor  # [K, L, N, H] LSTM state before row 0 (L = H = 1 without LSTM)
    initial_c: torch.Tensor  # [K, L, N, H]
    actor_id: torch.Tensor  # [K] int64, the actor that wrote the rollout
    rollout: torch.Tensor  # [K] int64, that actor's rollout count (1, 2, ...)
    free_wait: torch.Tensor  # [K] float64, seconds the actor waited on the free queue for this buffer
    inference_wait: torch.Tensor  # [K] float64, seconds it waited on the inference thread while writing it

    def to(self, device: torch.device) -> Rollouts:
        return Rollouts(**{f.name: getattr(self, f.name).to(device, non_blocking=True) for f in fields(Rollouts)})


@dataclass
class Buffers(Rollouts):
    """`num_buffers` rollouts in shared memory, allocated once, and the ledger of who owns each."""

    ledger: torch.Tensor  # [K] int64: an actor id, FREE_QUEUE, FULL_QUEUE or LEARNER

    @staticmethod
    def allocate(
        K: int, T: int, N: int, obs_shape: tuple[int, ...], obs_dtype: torch.dtype, num_actions: int,
        lstm: tuple[int, int],
    ) -> Buffers:  # fmt: skip
        rows, lstm_shape = (K, T + 1, N), (K, lstm[0], N, lstm[1])
        shapes = {k: rows for k in ROW_KEYS} | {k: (K,) for k in (*ROLLOUT_KEYS, "ledger")}
        shapes |= dict(obs=(*rows, *obs_shape), logits=(*rows, num_actions), initial_h=lstm_shape, initial_c=lstm_shape)
        floats = ("reward", "episode_return", "logits", "baseline", "initial_h", "initial_c")
        dtypes = dict(obs=obs_dtype, done=torch.bool, episode_end=torch.bool, free_wait=torch.float64,
                      inference_wait=torch.float64) | dict.fromkeys(floats, torch.float32)  # fmt: skip
        zeros = {k: torch.zeros(s, dtype=dtypes.get(k, torch.int64)).share_memory_() for k, s in shapes.items()}
        return Buffers(**zeros)

    def move(self, index: int, owner: int, new_owner: int) -> None:
        if (found := int(self.ledger[index])) != owner:
            raise RuntimeError(f"buffer {index} should be with owner {owner} but the ledger says owner {found}")
        self.ledger[index] = new_owner

    def stack(self, indices: list[int]) -> Rollouts:
        """The rollouts at `indices` as one time-major learner batch, a copy (shapes: Rollouts). index_select copies
        whole rows, where indexing with a tensor (buffer[idx]) would copy a uint8 frame byte by byte."""
        idx = torch.tensor(indices)
        rows = {k: getattr(self, k).index_select(0, idx) for k in (*ROW_KEYS, "initial_h", "initial_c", *ROLLOUT_KEYS)}
        return Rollouts(**{k: v if k in ROLLOUT_KEYS else v.transpose(0, 1).flatten(1, 2) for k, v in rows.items()})


class RequestPipe:
    """Actors -> inference thread: each request is the actor id as 2 bytes written to one OS pipe. Writes this small
    are atomic (POSIX, < PIPE_BUF), so actors need no lock and no feeder thread, and one `read` returns every request
    waiting, which is exactly the batch to run (PolyBeast's dynamic batching)."""

    WAKE = 0xFFFF  # not an actor id: wakes the inference thread at shutdown

    def __init__(self):
        self.read_fd, self.write_fd = os.pipe()

    def put(self, actor_id: int) -> None:
        os.write(self.write_fd, actor_id.to_bytes(2, "little"))

    def get_many(self, limit: int) -> list[int]:
        """Block until at least one request is waiting, return up to `limit` of them (oldest first)."""
        return np.frombuffer(os.read(self.read_fd, 2 * limit), dtype="<u2").tolist()  # whole 2-byte records only

    def close(self) -> None:
        os.close(self.read_fd)
        os.close(self.write_fd)


@dataclass
class ActingModel:
    """The parameters the actors act with, a copy of the learner's model refreshed after every update, and the number
    of updates behind them: in shared memory for MonoBeast's actors, the inference thread's copy otherwise."""

    model: nn.Module
    version: torch.Tensor  # [1] int64, shared memory
    lock: threading.Lock  # the inference thread's forward pass against the refresh

    def refresh(self, model: nn.Module, updates: int) -> None:
        """Copy the learner's parameters, then the version: an actor that reads the version first (MonoBeast's actors
        read without the lock) acts with parameters at least that new."""
        with self.lock:
            for dst, src in zip(self.model.parameters(), model.parameters(), strict=True):
                dst.data.copy_(src.data)
            self.version.fill_(updates)


@dataclass
class Queues:
    """The main process's channels to the actors, besides the buffers and the inference slots."""

    free: Queue  # buffer indices an actor may fill
    full: Queue  # indices of written rollouts, oldest first, for the learner threads
    stop: StopFlag  # set once: every worker returns

    @staticmethod
    def create(ctx: mp.context.BaseContext, buffers: Buffers) -> Queues:
        queues = Queues(free=ctx.Queue(), full=ctx.Queue(), stop=StopFlag(ctx))
        buffers.ledger.fill_(FREE_QUEUE)
        for index in range(len(buffers.ledger)):
            queues.free.put(index)
        return queues

    def close(self) -> None:
        for q in (self.free, self.full):
            q.cancel_join_thread()  # never block at exit on data no one will read
            q.close()


# ---- Actors and the inference thread ---------------------------------------------------------------------------------


def policy_step(
    model: nn.Module, obs: torch.Tensor, done: torch.Tensor, last_action: torch.Tensor, reward: torch.Tensor,
    state: LSTMState | None, greedy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, LSTMState | None]:  # fmt: skip
    """The agent's forward pass at one step: [B, ...] obs (and the [B] done, last action, raw reward that came with
    it) -> sampled (`greedy`: argmax) action, logits, baseline, next LSTM state."""
    if state is None:
        logits, baseline = model(obs, last_action, reward)
    else:
        logits, baseline, state = model.recurrent(obs[None], done[None], state, last_action[None], reward[None])
        logits, baseline = logits[0], baseline[0]
    if greedy:
        return logits.argmax(dim=-1), logits, baseline, state
    action = torch.multinomial(torch.softmax(logits.float(), dim=-1), 1).squeeze(-1)
    return action, logits, baseline, state


class CopyPolicy:
    """MonoBeast's acting: the actor's CPU copy of the model in shared memory, refreshed in place by the learner."""

    def __init__(self, acting: ActingModel, num_envs: int):
        self.acting = acting
        self.state = acting.model.initial_state(num_envs) if acting.model.core is not None else None
        self.wait = 0.0  # seconds spent waiting for outputs (none here)

    def lstm_state(self) -> LSTMState | None:
        """A copy of the LSTM state the next forward pass starts from (None without an LSTM)."""
        return None if self.state is None else (self.state[0].clone(), self.state[1].clone())

    def act(self, b: Buffers, index: int, t: int) -> None:
        """The agent's output at row t of buffer `index` (action, logits, baseline, version), from its inputs there."""
        b.version[index, t] = self.acting.version  # read first: the parameters are at least this new
        inputs = b.obs[index, t], b.done[index, t], b.last_action[index, t], b.reward[index, t]
        with torch.inference_mode():
            action, logits, baseline, self.state = policy_step(self.acting.model, *inputs, self.state)
        b.action[index, t], b.logits[index, t], b.baseline[index, t] = action, logits, baseline


class BatchedPolicy:
    """PolyBeast's acting: write the inputs to this actor's slot, request, wait for the inference thread."""

    def __init__(self, actor_id: int, server: InferenceServer):
        self.actor_id, self.server, self.slots = actor_id, server, server.slots
        self.use_lstm = server.acting.model.core is not None
        self.wait = 0.0  # seconds spent waiting on the inference thread

    def lstm_state(self) -> LSTMState | None:
        i = self.actor_id
        return (self.slots.initial_h[i].clone(), self.slots.initial_c[i].clone()) if self.use_lstm else None

    def act(self, b: Buffers, index: int, t: int) -> None:
        """The inference thread's output at row t of buffer `index`; Stop if the run stops while it is awaited."""
        i, slots = self.actor_id, self.slots
        for k in ("obs", "done", "last_action", "reward"):
            getattr(slots, k)[i, 0] = getattr(b, k)[index, t]
        start = time.perf_counter()
        self.server.requests.put(i)
        while not self.server.sems[i].acquire(timeout=1.0):
            if self.server.stop.is_set():
                raise Stop
        self.wait += time.perf_counter() - start
        for k in ("action", "logits", "baseline", "version"):
            getattr(b, k)[index, t] = getattr(slots, k)[i, 0]


def actor_process(
    actor_id: int, args: Args, env_seed: int, b: Buffers, queues: Queues, policy: CopyPolicy | BatchedPolicy
) -> None:
    """MonoBeast's `act()`: take a free index, write a rollout, hand it to the learners, until stopped; raw rewards."""
    torch.set_num_threads(1)
    torch.manual_seed(env_seed)
    envs = make_vector_env(args.env_id, args.num_envs_per_actor, env_seed, protocol=args.atari_protocol,
                           num_threads=1, clip_rewards=False)  # fmt: skip
    T, stop = args.unroll_length, queues.stop
    obs, _ = envs.reset()
    # row 0 of the first rollout: x_0 starts an episode, reward and last action 0 (TorchBeast's `Environment.initial`);
    # of every later one: the previous rollout's row T, with the LSTM state before it
    row = {k: torch.zeros_like(getattr(b, k)[0, 0]) for k in ROW_KEYS} | {"obs": torch.from_numpy(obs)}
    row["done"].fill_(True)
    state = policy.lstm_state()
    try:
        for rollout in itertools.count(1):
            start = time.perf_counter()
            index = blocking(queues.free.get, stop)
            free_wait = time.perf_counter() - start
            b.move(index, FREE_QUEUE, actor_id)
            policy.wait = 0.0
            for k in ROW_KEYS:
                getattr(b, k)[index, 0].copy_(row[k])
            if state is not None:
                b.initial_h[index].copy_(state[0])
                b.initial_c[index].copy_(state[1])
            if rollout == 1:
                policy.act(b, index, 0)
            for t in range(1, T + 1):
                if stop.is_set():
                    raise Stop
                obs, reward, terminated, truncated, info = envs.step(b.action[index, t - 1].numpy())
                b.obs[index, t].copy_(torch.from_numpy(obs))
                b.reward[index, t].copy_(torch.from_numpy(np.asarray(reward, dtype=np.float32)))
                b.done[index, t].copy_(torch.from_numpy(terminated | truncated))
                b.last_action[index, t].copy_(b.action[index, t - 1])  # kept across episode ends (TorchBeast)
                b.episode_end[index, t].copy_(torch.from_numpy(info["_episode"]))
                b.episode_return[index, t].copy_(torch.from_numpy(info["episode"]["r"]))
                b.episode_length[index, t].copy_(torch.from_numpy(info["episode"]["l"]))
                if t == T:  # the next rollout starts from this forward pass
                    state = policy.lstm_state()
                policy.act(b, index, t)
            row = {k: getattr(b, k)[index, T].clone() for k in ROW_KEYS}
            b.actor_id[index], b.rollout[index] = actor_id, rollout
            b.free_wait[index], b.inference_wait[index] = free_wait, policy.wait
            b.move(index, actor_id, FULL_QUEUE)
            queues.full.put(index)
    except Stop:
        pass
    finally:
        envs.close()


@dataclass
class InferenceServer:
    """PolyBeast's dynamic batching in one thread: every request waiting (up to `max_actors`) in one forward pass."""

    acting: ActingModel
    slots: Buffers  # one single-row buffer per actor (Learner.__init__)
    requests: RequestPipe
    sems: list[Semaphore]
    max_actors: int
    device: torch.device
    stop: StopFlag
    failures: list[str]
    batches: int = 0  # forward passes run
    envs: int = 0  # envs served, summed over them

    def run(self) -> None:
        try:
            while not self.stop.is_set():
                ids = [i for i in self.requests.get_many(self.max_actors) if i != RequestPipe.WAKE]
                if ids:
                    self.serve(ids)
        except BaseException:
            self.failures.append(f"error: inference thread died:\n{traceback.format_exc()}")
            self.stop.set()

    def serve(self, ids: list[int]) -> None:
        s, device, k, idx = self.slots, self.device, len(ids), torch.tensor(ids)
        N = s.obs.shape[2]
        obs = s.obs[idx, 0].flatten(0, 1).to(device, non_blocking=True)
        done, last_action, reward = (x[idx, 0].flatten().to(device) for x in (s.done, s.last_action, s.reward))
        state = None
        if self.acting.model.core is not None:  # [k, L, N, H] -> [L, k * N, H]
            state = tuple(x[idx].transpose(0, 1).flatten(1, 2).to(device) for x in (s.initial_h, s.initial_c))
        with self.acting.lock, torch.inference_mode():
            version = int(self.acting.version.item())
            action, logits, baseline, state = policy_step(self.acting.model, obs, done, last_action, reward, state)
        s.action[idx, 0] = action.view(k, N).cpu()
        s.logits[idx, 0] = logits.view(k, N, -1).float().cpu()
        s.baseline[idx, 0] = baseline.view(k, N).float().cpu()
        s.version[idx, 0] = version
        if state is not None:
            for x, out in zip((s.initial_h, s.initial_c), state, strict=True):
                x[idx] = out.unflatten(1, (k, N)).transpose(0, 1).cpu()
        self.batches += 1
        self.envs += k * N
        for i in ids:
            self.sems[i].release()


def get_batch(buffers: Buffers, queues: Queues, batch_size: int, lock: threading.Lock) -> tuple[Rollouts, list[int]]:
    """`batch_size` full rollouts stacked into one batch (a copy), their indices back on the free queue."""
    with lock:  # two learners never deadlock on half batches
        indices = []
        for _ in range(batch_size):
            index = blocking(queues.full.get, queues.stop)
            buffers.move(index, FULL_QUEUE, LEARNER)
            indices.append(index)
    batch = buffers.stack(indices)
    for index in indices:
        buffers.move(index, LEARNER, FREE_QUEUE)
        queues.free.put(index)
    return batch, indices


# ---- Learner ---------------------------------------------------------------------------------------------------------


class Learner:
    """TorchBeast's `batch_and_learn`, run by `--num-learner-threads` threads: each batches outside the learn lock,
    then learns, refreshes the acting parameters and logs under it, one update at a time. It is made before the actors
    fork, with what they share (inherited, not pickled: MonoBeast's choice): the rollout buffers, the queues, the
    acting copy of the model and, with batched inference, the inference server's slots, pipe and semaphores."""

    def __init__(self, args: Args, spaces: tuple, meta: dict, checkpoint: dict | None, device: torch.device,
                 num_updates: int, steps_per_update: int):  # fmt: skip
        (obs_space, act_space), network = spaces, meta["network"]
        M, N, A = args.num_actors, args.num_envs_per_actor, int(act_space.n)
        ctx = mp.get_context("fork")  # main's Processes too: the actors inherit the buffers, queues and model copy
        self.args, self.meta, self.device = args, meta, device
        self.model = make_model(obs_space, act_space, network, **model_options(args)).to(device)
        self.optimizer = torch.optim.RMSprop(self.model.parameters(), lr=args.learning_rate, alpha=args.rmsprop_alpha,
                                             eps=args.rmsprop_eps, momentum=args.rmsprop_momentum)  # fmt: skip
        self.num_updates, self.steps_per_update = num_updates, steps_per_update
        # updates done, and those a learner thread has claimed (each claims one before it batches): under the learn lock
        self.updates, self.global_step = (checkpoint["update"], checkpoint["global_step"]) if checkpoint else (0, 0)
        self.claimed = self.updates
        if checkpoint:
            self.model.load_state_dict(checkpoint["model"])
            self.optimizer.load_state_dict(checkpoint["optimizer"])
            torch.set_rng_state(checkpoint["torch_rng"])
        lstm = (self.model.core.num_layers, self.model.core.hidden_size) if self.model.core is not None else (1, 1)
        obs_dtype = torch.uint8 if obs_space.dtype == np.uint8 else torch.float32
        self.buffers = Buffers.allocate(args.num_buffers, args.unroll_length, N, obs_space.shape, obs_dtype, A, lstm)
        self.queues = Queues.create(ctx, self.buffers)
        self.failures: list[str] = []  # error lines of the threads and of dead actors; the first one is the run's
        # the actors' copy: the Nature net infers faster contiguous on CPU, trains faster channels_last (common.models)
        copy = make_model(obs_space, act_space, network, **model_options(args), channels_last=network != "nature")
        copy.to(device if args.inference == "batched" else torch.device("cpu"))
        self.acting = ActingModel(copy, torch.zeros(1, dtype=torch.int64).share_memory_(), threading.Lock())
        self.acting.refresh(self.model, self.updates)
        self.inference = None
        if args.inference == "actor":
            copy.share_memory()
        else:
            # the inference slots: a single-row buffer (T = 0) per actor; the actor writes the row's inputs, the
            # inference thread its outputs and, in initial_h / initial_c, the LSTM state of the actor's next step
            slots = Buffers.allocate(M, 0, N, obs_space.shape, obs_dtype, A, lstm)
            sems = [ctx.Semaphore(0) for _ in range(M)]
            max_actors = M if not args.max_inference_batch else max(1, args.max_inference_batch // N)
            self.inference = InferenceServer(
                self.acting, slots, RequestPipe(), sems, max_actors, device, self.queues.stop, self.failures
            )
        self.record: Recorder | None = None  # main's, made once the actors run (its SummaryWriter's thread not forked)
        self.learn_lock, self.batch_lock = threading.Lock(), threading.Lock()

    def run(self, thread_id: int) -> None:
        """One learner thread: updates until the budget is spent or the run stops."""
        try:
            while not self.queues.stop.is_set() and self.update():
                pass
            return
        except Stop:
            return
        except Exception as e:  # a failed write, a non-finite loss, a bug
            self.failures.append(error_line(e, self.global_step, 0, f"learner thread {thread_id}")[1])
        self.queues.stop.set()

    def update(self) -> bool:
        """Claim, batch and take one update; False once every update of the budget is claimed."""
        args = self.args
        with self.learn_lock:
            if self.claimed >= self.num_updates:
                return False
            self.claimed += 1
        start = time.perf_counter()
        batch, _ = get_batch(self.buffers, self.queues, args.batch_size, self.batch_lock)
        batch_wait = time.perf_counter() - start
        with self.learn_lock:
            start = time.perf_counter()
            lr = linear_lr(args.learning_rate, self.global_step, args.total_timesteps)
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            losses = vtrace_losses(self.model, batch, args, self.device)
            if not torch.isfinite(losses["total_loss"]):  # before the step: the parameters and checkpoints stay finite
                raise NonFiniteLoss(f"non-finite loss {losses['total_loss'].item()}")
            losses["grad_norm"] = gradient_step(self.model, self.optimizer, losses["total_loss"], args.max_grad_norm)
            # a finite loss, a step too large: no actor acts with them (NaN and inf carry through each tensor's sum:
            # one cheap pass over the weights after every update, where not_finite builds a mask per element)
            if not torch.isfinite(torch.stack([p.detach().sum() for p in self.model.parameters()])).all():
                raise NonFiniteLoss(f"non-finite weights after update {self.updates + 1} (learning rate {lr:.3g})")
            metrics = {k: v.item() for k, v in losses.items()}
            lag = self.updates - batch.version[:-1].double().mean().item()  # row T is the next rollout's row 0
            self.updates += 1
            self.global_step += self.steps_per_update
            self.acting.refresh(self.model, self.updates)
            timing = {"timing/full_queue_get": batch_wait, "timing/free_queue_get": batch.free_wait.mean().item(),
                      "timing/train": time.perf_counter() - start}  # fmt: skip
            if self.inference is not None:
                timing["timing/inference_wait"] = batch.inference_wait.mean().item()
                timing["timing/inference_batch_size"] = self.inference.envs / max(1, self.inference.batches)
            ends = batch.episode_end[1:]  # row 0 repeats the previous rollout's last row
            games = zip(batch.episode_return[1:][ends].tolist(), batch.episode_length[1:][ends].tolist(), strict=True)
            self.record.games((self.global_step, ret, length) for ret, length in games)
            self.record.add({"charts/policy_lag": lag, "charts/learning_rate": lr})
            self.record.add({"losses/policy_loss": metrics["policy_loss"], "losses/value_loss": metrics["value_loss"],
                             "losses/entropy": metrics["entropy"], "losses/total_loss": metrics["total_loss"],
                             "losses/grad_norm": metrics["grad_norm"]})  # fmt: skip
            self.record.add(timing)
            self.record.point(self.global_step)
            self.record.line(self.global_step, f"update={self.updates}/{self.num_updates} policy_lag={lag:.1f} "
                             f"batch_wait={batch_wait:.3f}s train={timing['timing/train']:.3f}s",
                             now=self.updates == self.num_updates)  # fmt: skip
        return True


# ---- Main ------------------------------------------------------------------------------------------------------------


def model_options(args: Args) -> dict:
    return dict(use_lstm=args.use_lstm, lstm_size=args.lstm_size, lstm_layers=args.lstm_layers,
                action_reward_inputs=args.action_reward_inputs)  # fmt: skip


def main(args: Args) -> None:
    if (run := open_run(args)) is None:  # resume, validation, run directory, args.json, seed, threads, device
        return  # --eval-only played the saved agent
    args, N = run.args, run.args.num_envs_per_actor
    learner = Learner(args, run.spaces, run.meta, run.checkpoint, run.device, run.num_updates, run.steps_per_update)
    queues, inference, actors = learner.queues, learner.inference, Processes(mp.get_context("fork"))
    run.stop_on_signals(queues.stop)
    env_seed = args.seed + (1_000_003 * learner.updates if run.checkpoint else 0)  # shifted on resume: new episodes
    for i in range(args.num_actors):  # env e of actor i is seeded env_seed + N i + e
        policy = BatchedPolicy(i, inference) if inference else CopyPolicy(learner.acting, N)
        actors.start(f"actor-{i}", actor_process, i, args, env_seed + N * i, learner.buffers, queues, policy)
    learners = [threading.Thread(target=learner.run, args=(j,), name=f"learner-{j}", daemon=True)
                for j in range(args.num_learner_threads)]  # fmt: skip
    threads = learners + ([threading.Thread(target=inference.run, name="inference", daemon=True)] if inference else [])
    roles = (f"{args.num_actors} actors x {N} envs, {args.inference} inference, {run.meta['network']} network"
             f"{' + LSTM' if args.use_lstm else ''}, {args.num_buffers} buffers")  # fmt: skip
    # the learner threads record through main's Recorder (the last 50 games' mean return), made after the fork
    with run.training(roles, lambda: learner.global_step, lambda _: stop_threads_and_actors(learner, threads, actors),
                      checkpoint=lambda: write_checkpoint(learner, run.checkpoint_path),
                      final_model=lambda: learner.model, window=50, threads=threads) as learner.record:  # fmt: skip
        for t in threads:
            t.start()
        while any(t.is_alive() for t in learners):  # until they have spent the budget
            if queues.stop.is_set():
                raise Stop  # a signal, or a thread that failed (its error line: stop_threads_and_actors)
            if died := wait_for_actors(actors, 1.0):
                raise Stop(f"error: {died}")  # its traceback: the actor printed it
            run.checkpoint_if_due(learner.learn_lock)  # a checkpoint between two updates


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


# -- a wait that ends when the run stops (the scripts whose threads or processes block on queues) --


def blocking(method, stop: threading.Event, *item):
    """A queue's get or put(item) (`method`) that gives up when `stop` is set (it wakes once a second: no busy wait)."""
    while True:
        try:
            return method(*item, timeout=1.0)
        except (queue.Empty, queue.Full):
            if stop.is_set():
                raise Stop from None


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


# -- script-specific: FLAG_RULES, RUN_SETTINGS, validate, env_spaces, checkpoint_meta, saved_model, evaluate, ... --


FLAG_RULES = (
    (">= 1", ("num_actors", "num_envs_per_actor", "num_learner_threads", "unroll_length", "batch_size")),
    (">= 1", ("total_timesteps", "lstm_layers")), ("in (0, 1]", ("gamma", "rmsprop_alpha")),
    ("> 0", ("learning_rate", "max_grad_norm", "vtrace_rho_bar", "vtrace_c_bar", "vtrace_pg_rho_bar", "rmsprop_eps")),
    (">= 0", ("seed", "checkpoint_interval", "eval_episodes", "torch_threads", "max_inference_batch", "lstm_size")),
    (">= 0", ("vf_coef", "ent_coef", "rmsprop_momentum")),
)  # fmt: skip
RESUME_FIXED = ("num_actors", "num_envs_per_actor", "num_buffers", "unroll_length", "batch_size")  # the run's shape
RUN_SETTINGS = ("env_id", "atari_protocol", "network", "use_lstm", "lstm_size", "lstm_layers", "action_reward_inputs")
RENAMED_FLAGS = {"--entropy-cost": "is now --ent-coef (see --help)", "--baseline-cost": "is now --vf-coef (see --help)"}


def validate(args: Args, world_size: int = 1) -> str | None:
    """Every flag checked before anything is made or started, the env too: the error line (without `error: `), or
    None."""
    if error := check_flags(args):
        return error
    if world_size > 1:
        return f"{Path(__file__).name} runs on one machine: start it with python, not torchrun"
    M, N, B, K = args.num_actors, args.num_envs_per_actor, args.batch_size, settled_args(args).num_buffers
    if K < max(M, B):
        return f"--num-buffers ({K}) must be >= --num-actors ({M}) and >= --batch-size ({B})"
    if 0 < args.max_inference_batch < N:
        return f"--max-inference-batch ({args.max_inference_batch}) must be 0 (all) or >= --num-envs-per-actor ({N})"
    if args.total_timesteps < (n := steps_per_update(args, world_size)):
        return (f"--total-timesteps {args.total_timesteps} is below one update, {n} agent steps (--unroll-length x "
                f"--batch-size x --num-envs-per-actor): the run would learn nothing; give at least {n}")  # fmt: skip
    if args.capture_video and args.eval_episodes == 0 and args.eval_only is None:
        return "--capture-video records the evaluation episodes; add --eval-episodes N (N >= 1)"
    for name, what in (("resume", "checkpoint file"), ("eval_only", "file")):
        if (path := getattr(args, name)) is not None and not Path(path).is_file():
            return f"{flag(name)} {path}: no such {what}"
    try:
        check_env_args(args.env_id, N, args.atari_protocol)  # the id too, without making the env
        if args.capture_video and args.eval_only is None:  # fail now, not at the final evaluation
            check_video(args.env_id, args.atari_protocol)
        if args.eval_only is None:  # the env made, and its action space (--eval-only: the saved run's env)
            env_spaces(args)
    except EnvError as e:
        return str(e)
    return None


def ignored_flags(args: Args) -> list[str]:
    """Flags a training run with these settings leaves without effect, where a sweep or a copied command may set them
    on purpose: the run goes on, with one warning line for each."""
    ignored = []
    if args.max_inference_batch and args.inference == "actor":
        ignored.append(f"--max-inference-batch {args.max_inference_batch} has no effect with --inference actor "
                       "(each actor runs its own copy of the model)")  # fmt: skip
    for name in ("lstm_size", "lstm_layers"):
        if not args.use_lstm and getattr(args, name) != getattr(Args, name):
            ignored.append(f"{flag(name)} {getattr(args, name)} has no effect without --use-lstm")
    return ignored


def env_spaces(args: Args) -> tuple[gym.Space, gym.spaces.Discrete]:
    """(observation space, action space) of one training env; EnvError if this script cannot train on it."""
    probe = make_vector_env(args.env_id, 1, args.seed, protocol=args.atari_protocol, num_threads=1)
    obs_space, act_space = probe.single_observation_space, probe.single_action_space
    probe.close()
    if not isinstance(act_space, gym.spaces.Discrete):
        raise EnvError(f"{args.env_id} has a continuous action space ({act_space}); impala_monobeast.py handles "
                       f"Discrete action spaces only (for continuous actions: apex_ddpg.py)")  # fmt: skip
    return obs_space, act_space


def checkpoint_meta(args: Args, obs_space: gym.Space, act_space: gym.spaces.Discrete, world_size: int = 1) -> dict:
    """What a checkpoint must match to be resumed by this run: script, env, Atari protocol, network (`auto` resolved)
    and shapes."""
    network = args.network if args.network != "auto" else ("nature" if len(obs_space.shape) == 3 else "mlp")
    return dict(script=Path(__file__).name, algo=None, env_id=args.env_id, atari_protocol=args.atari_protocol,
                network=network, **model_options(args), obs_shape=list(obs_space.shape),
                action_shape_or_n=int(act_space.n))  # fmt: skip


def settled_args(args: Args) -> Args:
    """The flags as the run uses them: --num-buffers None is TorchBeast's choice, max(2 x actors, batch size)."""
    if args.num_buffers is not None:
        return args
    resolved = replace(args, num_buffers=max(2 * args.num_actors, args.batch_size))
    if hasattr(args, "given"):  # parse_args's names of the flags given, which replace() drops
        resolved.given = args.given
    return resolved


def steps_per_update(args: Args, world_size: int) -> int:
    """Agent steps of one update: a batch of --batch-size rollouts of --unroll-length steps of an actor's envs."""
    return args.unroll_length * args.batch_size * args.num_envs_per_actor


def init_torch(args: Args, spaces: tuple[gym.Space, gym.Space], rank: int, world_size: int) -> torch.device:
    """The warnings of flags without effect; the main process's threads, GIL switch interval, seed and determinism
    (the actors inherit them), and the device of the learner and batched inference."""
    for ignored in ignored_flags(args):
        print(f"warning: {ignored}", file=sys.stderr, flush=True)
    torch.set_num_threads(args.torch_threads or max(1, (os.cpu_count() or 1) - args.num_actors))
    sys.setswitchinterval(0.0005)  # the inference thread gets the GIL as a request arrives, not after a 5 ms slice
    torch.manual_seed(args.seed)
    torch.backends.cudnn.deterministic = args.torch_deterministic
    torch.use_deterministic_algorithms(args.torch_deterministic, warn_only=True)
    return torch.device("cuda" if args.cuda and torch.cuda.is_available() else "cpu")


def saved_model(args: Args, settings: dict, state_dict: dict) -> nn.Module:
    """--eval-only: the saved run's network (its inputs and LSTM included) with its parameters."""
    model = make_model(*env_spaces(args), settings["network"], **model_options(args))
    model.load_state_dict(state_dict)
    return model


def evaluate(model: nn.Module, args: Args, video_dir: Path, device: torch.device) -> Iterator[float]:
    """The true returns of `eval_episodes` full games, with argmax actions under --eval-greedy (TorchBeast's test)."""
    env = make_env(args.env_id, args.seed + 1_000_003, protocol=args.atari_protocol, capture_video=args.capture_video,
                   video_dir=str(video_dir))  # fmt: skip
    torch.manual_seed(args.seed + 1_000_003)
    played = 0
    obs, _ = env.reset()
    done = torch.ones(1, dtype=torch.bool, device=device)
    last_action = torch.zeros(1, dtype=torch.int64, device=device)
    reward = torch.zeros(1, device=device)
    state = model.initial_state(1, device) if model.core is not None else None
    while played < args.eval_episodes:
        with torch.inference_mode():
            obs_t = torch.as_tensor(obs[None], device=device)
            action, _, _, state = policy_step(model, obs_t, done, last_action, reward, state, args.eval_greedy)
        obs, r, terminated, truncated, info = env.step(int(action[0]))
        done.fill_(bool(terminated or truncated))
        last_action.copy_(action)  # carried into the next game, as in training
        reward.fill_(r)
        if terminated or truncated:
            played += 1
            yield float(info["episode"]["r"])
            if played < args.eval_episodes:  # no reset after the last game: it would record an empty video
                obs, _ = env.reset()
    env.close()


def write_checkpoint(learner: Learner, path: Path) -> None:
    """The checkpoint: the model, the optimizer, the update and step counts, the RNG, Args and meta."""
    state = dict(model=learner.model.state_dict(), optimizer=learner.optimizer.state_dict(), update=learner.updates,
                 global_step=learner.global_step, torch_rng=torch.get_rng_state(), args=asdict(learner.args),
                 meta=learner.meta)  # fmt: skip
    atomic_save(state, path)


def wait_for_actors(actors: Processes, timeout: float) -> str | None:
    """Block until an actor ends or `timeout` seconds pass; `failed()` (main's watch between its other checks)."""
    running = [p.sentinel for p in actors.procs.values() if p.exitcode is None]
    if running:
        multiprocessing.connection.wait(running, timeout)
    return actors.failed()


def stop_threads_and_actors(learner: Learner, threads: list[threading.Thread], actors: Processes) -> str | None:
    """The end of a run: every wait looks at the stop once a second, and the inference thread, in a read of its
    pipe, is woken; an update in progress ends within seconds (8 for them all), then the actors get 3. Returns the
    first error line of a thread that failed (None: none did)."""
    queues, inference = learner.queues, learner.inference
    queues.stop.set()
    if inference is not None:
        inference.requests.put(RequestPipe.WAKE)
    deadline = time.monotonic() + 8.0
    for t in threads:
        if t.is_alive():  # not one that never started (the run failed before)
            t.join(timeout=max(0.0, deadline - time.monotonic()))
    actors.stop(grace=3.0)
    queues.close()
    if inference is not None:
        inference.requests.close()
    return learner.failures[0] if learner.failures else None


if __name__ == "__main__":
    main(parse_args(sys.argv[1:]))
