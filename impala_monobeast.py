"""IMPALA with V-trace (Espeholt et al. 2018) in TorchBeast's MonoBeast architecture (Küttler et al., "TorchBeast: a
PyTorch platform for distributed RL", 2019, Section 5.1), with PolyBeast-style batched inference as an option.

Architecture (one machine; actors are processes, learners and inference are threads of the main process):
  buffers[num_buffers]: shared-memory rollouts of unroll_length + 1 rows (obs, raw reward, done, last action,
    episode statistics, behaviour logits, baseline, action, policy version; the LSTM state at row 0).
    free_queue / full_queue carry buffer indices; a shared `ledger` says who owns each index (free queue, actor i,
    full queue, learner j).
  actor i (`--num-actors` processes, `--num-envs-per-actor` envs each, 1 env thread): take a free index, write row 0
    = the last row of its previous rollout, step the env unroll_length times, put the index on full_queue.
  acting: `--inference actor` (MonoBeast): each actor runs a CPU copy of the model in shared memory, refreshed in
    place after every update. `--inference batched` (PolyBeast's dynamic batching without gRPC): an actor writes its
    observation into its shared slot, writes its id to a request pipe and waits on its own semaphore; one inference
    thread takes whatever ids are waiting (up to `--max-inference-batch` envs), runs one forward pass (GPU when
    present), writes actions/logits/baseline/version back and releases each actor.
  learner threads (`--num-learner-threads`): dequeue batch_size indices, stack them to [T + 1, batch_size * envs],
    return the indices to free_queue, then (one at a time, under a lock) compute the V-trace loss and update.
Policy lag: nothing bounds it; data waits in full_queue while the learner trains, so `charts/policy_lag` (updates
  since the acting version, averaged over the batch) grows with the number of actors (IMPALA, Section 3).
Determinism: none promised. Envs, initial parameters and sampling are seeded, but which policy version acts on which
  step depends on process timing, as in MonoBeast.
Defaults are TorchBeast's (monobeast.py flags): 4 actors, unroll 80, batch 8, RMSprop lr 4.8e-4 decayed linearly to
  0, shallow network, losses summed over the batch. The IMPALA paper's Atari setting (Table G.1: unroll 20, batch 32,
  deep network): `--unroll-length 20 --batch-size 32 --network impala`.
Network inputs are TorchBeast's AtariNet's: the torso features, the clipped reward that arrived with the observation
  and a one-hot of the last action go to the heads, or to a 2-layer LSTM as wide as that input (`--use-lstm`).
  Rewards reach the buffers raw; the loss clips them (`--clip-rewards`), the network clips its reward input.

Examples:
  python impala_monobeast.py --env-id ALE/Breakout-v5                                # batched inference, 4 actors
  python impala_monobeast.py --env-id ALE/Pong-v5 --inference actor --num-actors 8    # MonoBeast exactly
  python impala_monobeast.py --env-id ALE/Pong-v5 --unroll-length 20 --batch-size 32 --network impala --use-lstm
"""

from __future__ import annotations

import ctypes
import errno
import io
import itertools
import math
import multiprocessing as mp
import multiprocessing.connection
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
from typing import Literal

import gymnasium as gym
import numpy as np
import torch
import tyro
from torch import nn
from torch.utils.tensorboard import SummaryWriter

from common.atari import PROTOCOLS, EnvError, check_env_args, make_env, make_vector_env
from common.models import NETWORKS, make_model


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
    atari_protocol: str = "deepmind"
    """ALE preprocessing: `deepmind` (TorchBeast's setting) or `machado`"""
    total_timesteps: int = 50_000_000
    """agent steps summed over all envs (the learner counts unroll_length x batch_size x envs per update)"""
    log_dir: str = "runs"
    """where run directories go"""
    save_model: bool = False
    """write the final model's state_dict to {run_dir}/model.pt"""
    checkpoint_interval: float = 0.0
    """seconds between checkpoints to {run_dir}/checkpoint.pt (0 = off)"""
    resume: str | None = None
    """path of a checkpoint.pt to continue from (same run directory and step count)"""
    eval_episodes: int = 0
    """episodes to evaluate the final policy on (logged as eval/episodic_return)"""
    capture_video: bool = False
    """record videos of the evaluation episodes to {run_dir}/videos"""

    # architecture (TorchBeast monobeast.py defaults)
    inference: Literal["batched", "actor"] = "batched"
    """`batched`: one inference thread batches all waiting actors (GPU when present); `actor`: MonoBeast's CPU copy"""
    num_actors: int = 4
    """actor processes"""
    num_envs_per_actor: int = 1
    """envs each actor steps (1 = MonoBeast; more gives each actor a batched forward pass)"""
    num_buffers: int | None = None
    """shared-memory rollout buffers (default: max(2 * num_actors, batch_size), TorchBeast's)"""
    num_learner_threads: int = 2
    """learner threads: they batch concurrently, update one at a time"""
    max_inference_batch: int = 0
    """batched inference: most envs per forward pass (0 = all actors' envs)"""
    torch_threads: int = 0
    """torch intra-op threads of the main process (0 = cores not taken by actors, at least 1)"""
    network: str = "auto"
    """`nature` (TorchBeast's shallow net), `impala` (deep ResNet), `mlp`, or `auto` (nature for frames, else mlp)"""
    use_lstm: bool = False
    """LSTM core between torso and heads (state stored at each rollout start)"""
    lstm_size: int = 0
    """LSTM hidden size (0 = as wide as its input, TorchBeast's AtariNet)"""
    lstm_layers: int = 2
    """LSTM layers (TorchBeast's AtariNet: 2)"""
    action_reward_inputs: bool = True
    """feed the clipped reward and a one-hot of the last action beside the torso features (TorchBeast's AtariNet)"""

    # loss and optimiser (TorchBeast monobeast.py defaults; IMPALA paper Table G.1 for Atari: unroll 20, batch 32)
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
    baseline_cost: float = 0.5
    """weight of the baseline (value) loss"""
    entropy_cost: float = 0.0006
    """weight of the entropy regulariser"""
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


# ledger values: who owns a buffer index (actor i owns it while ledger == i)
FREE_QUEUE = -1  # ledger owner codes; actors are >= 0, learner threads below FULL_QUEUE
FULL_QUEUE = -2


def learner_owner(thread_id: int) -> int:
    return -3 - thread_id


# ----------------------------------------------------------------------------------------------------------------
# Pure algorithm functions
# ----------------------------------------------------------------------------------------------------------------


def vtrace(
    behaviour_logprob,
    target_logprob,
    rewards,
    values,
    dones,
    next_value,
    gamma: float,
    rho_bar: float,
    c_bar: float,
    pg_rho_bar: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """V-trace targets v_s and policy-gradient advantages (Espeholt et al. 2018, Eq. 1 and Section 4.2).

    Time-major inputs [T, B, ...] except next_value [B, ...] (any trailing dimensions); the discount is
    gamma * (1 - dones[t]), so no trace crosses an episode end. Returns (vs, pg_advantages), both [T, B, ...] and
    without gradient.
    """
    with torch.no_grad():
        ratio = torch.exp(target_logprob - behaviour_logprob)
        rho = ratio.clamp(max=rho_bar)
        c = ratio.clamp(max=c_bar)
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


def impala_loss(
    target_logprob, entropy, values, vs, pg_advantages, baseline_cost: float, entropy_cost: float
) -> dict[str, torch.Tensor]:
    """IMPALA's loss (Section 4.2) summed over the [T, B] batch, as TorchBeast sums it (its lr assumes sums)."""
    policy_loss = -(target_logprob * pg_advantages).sum()
    value_loss = 0.5 * ((vs - values) ** 2).sum()
    entropy_sum = entropy.sum()
    total = policy_loss + baseline_cost * value_loss - entropy_cost * entropy_sum
    return dict(total_loss=total, policy_loss=policy_loss, value_loss=value_loss, entropy=entropy.mean())


def linear_lr(base: float, steps_done: int, total_steps: int) -> float:
    """TorchBeast's schedule: linear decay to 0 over total_timesteps, evaluated before each update."""
    return base * (1.0 - min(steps_done, total_steps) / total_steps)


# ----------------------------------------------------------------------------------------------------------------
# Shared memory: rollout buffers, inference slots
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class Buffers:
    """`num_buffers` rollouts of T + 1 rows over one actor's N envs, in shared memory, allocated once.

    Row t holds observation x_t, the raw reward and done flag that arrived with it (done[t]: x_t starts a new
    episode), the action a_{t-1} that led to it (last_action), the game statistics if a game ended on arriving at
    x_t, and the agent's output at x_t (action a_t, behaviour logits, baseline, policy version). Row 0 is the previous
    rollout's row T, so transitions t = 0..T-1 are (x_t, a_t, reward[t + 1], done[t + 1], x_{t + 1}). As in
    TorchBeast's `Environment`, reward and last action are 0 only at an actor's first observation; the first row of
    any later episode carries the previous episode's last reward and action (only the LSTM state is zeroed).
    """

    obs: torch.Tensor  # [K, T + 1, N, *obs_shape]
    reward: torch.Tensor  # [K, T + 1, N]
    done: torch.Tensor  # [K, T + 1, N] bool
    last_action: torch.Tensor  # [K, T + 1, N] int64, a_{t-1}: the network's input beside x_t and reward[t]
    episode_end: torch.Tensor  # [K, T + 1, N] bool, a game (all lives) ended on arriving at this row
    episode_return: torch.Tensor  # [K, T + 1, N], its true return (valid where episode_end)
    episode_length: torch.Tensor  # [K, T + 1, N]
    logits: torch.Tensor  # [K, T + 1, N, A] behaviour policy logits
    baseline: torch.Tensor  # [K, T + 1, N]
    action: torch.Tensor  # [K, T + 1, N] int64
    version: torch.Tensor  # [K, T + 1, N] int64, learner updates done when the acting parameters were made
    initial_h: torch.Tensor  # [K, L, N, H] LSTM state before row 0 (L = H = 1 without LSTM)
    initial_c: torch.Tensor  # [K, L, N, H]
    meta: torch.Tensor  # [K, 4] float64: actor id, rollout count, seconds on free_queue.get, seconds waiting inference
    ledger: torch.Tensor  # [K] int64, owner of each index (FREE_QUEUE, FULL_QUEUE, actor id, learner_owner(j))

    @staticmethod
    def allocate(K: int, T: int, N: int, obs_shape, obs_dtype, num_actions: int, lstm: tuple[int, int]) -> Buffers:
        L, H = lstm
        shapes = dict(
            obs=((K, T + 1, N, *obs_shape), obs_dtype),
            reward=((K, T + 1, N), torch.float32),
            done=((K, T + 1, N), torch.bool),
            last_action=((K, T + 1, N), torch.int64),
            episode_end=((K, T + 1, N), torch.bool),
            episode_return=((K, T + 1, N), torch.float32),
            episode_length=((K, T + 1, N), torch.int64),
            logits=((K, T + 1, N, num_actions), torch.float32),
            baseline=((K, T + 1, N), torch.float32),
            action=((K, T + 1, N), torch.int64),
            version=((K, T + 1, N), torch.int64),
            initial_h=((K, L, N, H), torch.float32),
            initial_c=((K, L, N, H), torch.float32),
            meta=((K, 4), torch.float64),
            ledger=((K,), torch.int64),
        )
        return Buffers(**{k: torch.zeros(s, dtype=d).share_memory_() for k, (s, d) in shapes.items()})

    ROW_KEYS = (
        "obs",
        "reward",
        "done",
        "last_action",
        "episode_end",
        "episode_return",
        "episode_length",
        "logits",
        "baseline",
        "action",
        "version",
    )


@dataclass
class InferenceSlots:
    """Per-actor shared-memory slots for batched inference: the actor writes obs/done/last_action/reward, the
    inference thread writes the agent output (and the LSTM state it carries for that actor) back."""

    obs: torch.Tensor  # [num_actors, N, *obs_shape]
    done: torch.Tensor  # [num_actors, N] bool
    last_action: torch.Tensor  # [num_actors, N] int64
    reward: torch.Tensor  # [num_actors, N] raw
    action: torch.Tensor  # [num_actors, N]
    logits: torch.Tensor  # [num_actors, N, A]
    baseline: torch.Tensor  # [num_actors, N]
    version: torch.Tensor  # [num_actors]
    h: torch.Tensor  # [num_actors, L, N, H] LSTM state of each actor's envs
    c: torch.Tensor

    @staticmethod
    def allocate(M: int, N: int, obs_shape, obs_dtype, num_actions: int, lstm: tuple[int, int]) -> InferenceSlots:
        L, H = lstm
        return InferenceSlots(
            obs=torch.zeros((M, N, *obs_shape), dtype=obs_dtype).share_memory_(),
            done=torch.zeros((M, N), dtype=torch.bool).share_memory_(),
            last_action=torch.zeros((M, N), dtype=torch.int64).share_memory_(),
            reward=torch.zeros((M, N)).share_memory_(),
            action=torch.zeros((M, N), dtype=torch.int64).share_memory_(),
            logits=torch.zeros((M, N, num_actions)).share_memory_(),
            baseline=torch.zeros((M, N)).share_memory_(),
            version=torch.zeros(M, dtype=torch.int64).share_memory_(),
            h=torch.zeros((M, L, N, H)).share_memory_(),
            c=torch.zeros((M, L, N, H)).share_memory_(),
        )


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
        data = os.read(self.read_fd, 2 * limit)  # the pipe only ever holds whole 2-byte records
        return np.frombuffer(data, dtype="<u2").tolist()

    def close(self) -> None:
        os.close(self.read_fd)
        os.close(self.write_fd)


def policy_step(model: nn.Module, obs: torch.Tensor, done: torch.Tensor, last_action, reward, state):
    """The agent's forward pass at one step: [B, ...] obs (and the [B] done, last action, raw reward that came with
    it) -> sampled action, logits, baseline, next LSTM state."""
    if state is None:
        logits, baseline = model(obs, last_action, reward)
    else:
        logits, baseline, state = model.recurrent(obs[None], done[None], state, last_action[None], reward[None])
        logits, baseline = logits[0], baseline[0]
    action = torch.multinomial(torch.softmax(logits.float(), dim=-1), 1).squeeze(-1)
    return action, logits, baseline, state


# ----------------------------------------------------------------------------------------------------------------
# Actor process and inference thread
# ----------------------------------------------------------------------------------------------------------------


class Shutdown(Exception):
    """Raised inside a worker when the run is stopping."""


def get_or_stop(q, stop) -> object:
    """`q.get()` that gives up when `stop` is set (wakes once a second to look; no busy wait)."""
    while True:
        try:
            return q.get(timeout=1.0)
        except queue.Empty:
            if stop.is_set():
                raise Shutdown from None


class ActorPolicy:
    """How an actor gets its agent output: its own model copy (MonoBeast) or the inference thread (batched)."""

    def __init__(self, actor_id: int, args: Args, model=None, version=None, slots=None, requests=None, sem=None):
        self.actor_id, self.model, self.shared_version = actor_id, model, version
        self.slots, self.requests, self.sem = slots, requests, sem
        self.use_lstm = args.use_lstm
        self.state = None
        self.wait = 0.0  # seconds spent waiting on the inference thread
        if self.use_lstm and model is not None:
            self.state = model.initial_state(args.num_envs_per_actor)

    def current_state(self):
        """The LSTM state that the next forward pass starts from (zeros without an LSTM)."""
        if self.model is not None:
            return self.state
        return self.slots.h[self.actor_id], self.slots.c[self.actor_id]

    def __call__(self, obs: torch.Tensor, done: torch.Tensor, last_action: torch.Tensor, reward: torch.Tensor, stop):
        """The agent output at one row: (action, logits, baseline, policy version)."""
        if self.model is not None:  # MonoBeast: the CPU copy in shared memory, refreshed in place by the learner
            version = int(self.shared_version.item())  # read first: the data is at least this new
            with torch.inference_mode():
                action, logits, baseline, self.state = policy_step(
                    self.model, obs, done, last_action, reward, self.state
                )
            return action, logits, baseline, version
        i, slots = self.actor_id, self.slots
        slots.obs[i].copy_(obs)
        slots.done[i].copy_(done)
        slots.last_action[i].copy_(last_action)
        slots.reward[i].copy_(reward)
        start = time.perf_counter()
        self.requests.put(i)
        while not self.sem.acquire(timeout=1.0):
            if stop.is_set():
                raise Shutdown
        self.wait += time.perf_counter() - start
        return slots.action[i], slots.logits[i], slots.baseline[i], int(slots.version[i].item())


def die_with_parent(parent_pid: int) -> None:
    """Linux: the kernel kills this process when the main process dies, even by kill -9, so no actor outlives the run.
    The main process may have died before prctl ran: then exit at once."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # no prctl (not Linux)
        pass
    if os.getppid() != parent_pid:
        os._exit(0)


def actor_process(
    actor_id: int,
    args: Args,
    env_seed: int,
    buffers: Buffers,
    free_q,
    full_q,
    policy: ActorPolicy,
    stop,
    error_q,
    parent_pid: int | None = None,
) -> None:
    """MonoBeast's `act()`: take a free index, write a rollout (row 0 = previous row T), hand it to the learners."""
    if parent_pid is not None:
        die_with_parent(parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl+C reaches the whole process group: the main process decides
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    torch.set_num_threads(1)
    torch.manual_seed(env_seed)
    envs = None
    try:
        envs = make_vector_env(  # raw rewards: the loss clips them, or not (--clip-rewards)
            args.env_id,
            args.num_envs_per_actor,
            env_seed,
            protocol=args.atari_protocol,
            num_threads=1,
            clip_rewards=False,
        )
        T = args.unroll_length
        obs, _ = envs.reset()
        # the row carried into the next rollout: x_0 of the first episode, done = True (a new episode starts), reward
        # and last action 0 (TorchBeast's `Environment.initial`)
        last = {k: torch.zeros_like(getattr(buffers, k)[0, 0]) for k in Buffers.ROW_KEYS}
        last["obs"].copy_(torch.from_numpy(obs))
        last["done"].fill_(True)
        state_before_last = policy.current_state()
        state_before_last = None if state_before_last is None else tuple(s.clone() for s in state_before_last)
        action, logits, baseline, version = policy(last["obs"], last["done"], last["last_action"], last["reward"], stop)
        action = action.clone()  # batched inference returns a view of the slot it overwrites at the next step
        last["action"].copy_(action), last["logits"].copy_(logits), last["baseline"].copy_(baseline)
        last["version"].fill_(version)
        rollout = 0
        while True:
            start = time.perf_counter()
            index = get_or_stop(free_q, stop)
            if index is None:
                break
            free_wait = time.perf_counter() - start
            owner = int(buffers.ledger[index])
            if owner != FREE_QUEUE:
                raise RuntimeError(f"buffer {index} taken from free_queue but the ledger says owner {owner}")
            buffers.ledger[index] = actor_id
            policy.wait = 0.0
            for k in Buffers.ROW_KEYS:
                getattr(buffers, k)[index, 0].copy_(last[k])
            if state_before_last is not None:
                buffers.initial_h[index].copy_(state_before_last[0])
                buffers.initial_c[index].copy_(state_before_last[1])
            for t in range(1, T + 1):
                if stop.is_set():
                    raise Shutdown
                obs, reward, terminated, truncated, info = envs.step(action.numpy())
                row = {
                    "obs": torch.from_numpy(obs),
                    "reward": torch.from_numpy(np.asarray(reward, dtype=np.float32)),
                    "done": torch.from_numpy(terminated | truncated),
                    "last_action": action,  # kept across episode ends, as TorchBeast's `Environment.step` does
                    "episode_end": torch.from_numpy(info["_episode"]),
                    "episode_return": torch.from_numpy(info["episode"]["r"]),
                    "episode_length": torch.from_numpy(info["episode"]["l"]),
                }
                if t == T and state_before_last is not None:  # the next rollout starts from this forward pass
                    state_before_last = tuple(s.clone() for s in policy.current_state())
                action, logits, baseline, version = policy(
                    row["obs"], row["done"], row["last_action"], row["reward"], stop
                )
                action = action.clone()
                for k, v in row.items():
                    getattr(buffers, k)[index, t].copy_(v)
                buffers.action[index, t].copy_(action)
                buffers.logits[index, t].copy_(logits)
                buffers.baseline[index, t].copy_(baseline)
                buffers.version[index, t].fill_(version)
            for k in Buffers.ROW_KEYS:
                last[k].copy_(getattr(buffers, k)[index, T])
            rollout += 1
            buffers.meta[index] = torch.tensor([actor_id, rollout, free_wait, policy.wait], dtype=torch.float64)
            buffers.ledger[index] = FULL_QUEUE
            full_q.put(index)
    except Shutdown:
        pass
    except KeyboardInterrupt:
        pass
    except BaseException:
        error_q.put((actor_id, traceback.format_exc()))
        raise SystemExit(1) from None
    finally:
        if envs is not None:
            envs.close()


def inference_thread(
    model: nn.Module,
    model_lock: threading.Lock,
    version: list,
    slots: InferenceSlots,
    requests: RequestPipe,
    sems: list,
    max_actors: int,
    device: torch.device,
    stop,
    errors: list,
    stats: dict,
) -> None:
    """PolyBeast's dynamic batching: block for one request, take whatever else is waiting (up to `max_actors`
    actors), one forward pass, write the outputs to the actors' slots, release each actor."""
    try:
        N = slots.obs.shape[1]
        while not stop.is_set():
            ids = [i for i in requests.get_many(max_actors) if i != RequestPipe.WAKE]
            if not ids:
                continue
            idx = torch.tensor(ids)
            obs = slots.obs[idx].reshape(len(ids) * N, *slots.obs.shape[2:]).to(device, non_blocking=True)
            done = slots.done[idx].reshape(-1).to(device)
            last_action = slots.last_action[idx].reshape(-1).to(device)
            reward = slots.reward[idx].reshape(-1).to(device)
            state = None
            if model.core is not None:  # [k, L, N, H] -> [L, k * N, H]
                state = tuple(
                    s[idx].transpose(0, 1).reshape(s.shape[1], -1, s.shape[3]).to(device) for s in (slots.h, slots.c)
                )
            with model_lock, torch.inference_mode():
                acting_version = version[0]
                action, logits, baseline, state = policy_step(model, obs, done, last_action, reward, state)
            slots.action[idx] = action.view(len(ids), N).cpu()
            slots.logits[idx] = logits.view(len(ids), N, -1).float().cpu()
            slots.baseline[idx] = baseline.view(len(ids), N).float().cpu()
            slots.version[idx] = acting_version
            if state is not None:
                for s, out in zip((slots.h, slots.c), state, strict=True):
                    s[idx] = out.reshape(out.shape[0], len(ids), N, -1).transpose(0, 1).cpu()
            stats["batches"] += 1
            stats["envs"] += len(ids) * N
            for i in ids:
                sems[i].release()
    except BaseException:
        errors.append(f"inference thread died:\n{traceback.format_exc()}")
        stop.set()


# ----------------------------------------------------------------------------------------------------------------
# Learner
# ----------------------------------------------------------------------------------------------------------------


class NonFiniteLoss(RuntimeError):
    pass


def get_batch(
    thread_id: int, buffers: Buffers, free_q, full_q, batch_size: int, batch_lock: threading.Lock, stop
) -> tuple[dict[str, torch.Tensor], list[int]]:
    """Dequeue `batch_size` indices (under a lock, so two learners never deadlock on half batches), stack the
    rollouts to [T + 1, batch_size * N, ...], and put the indices back on free_queue. Returns (batch, indices)."""
    with batch_lock:
        indices = []
        for _ in range(batch_size):
            index = get_or_stop(full_q, stop)
            if index is None:
                raise Shutdown
            owner = int(buffers.ledger[index])
            if owner != FULL_QUEUE:
                raise RuntimeError(f"buffer {index} taken from full_queue but the ledger says owner {owner}")
            buffers.ledger[index] = learner_owner(thread_id)
            indices.append(index)
    idx = torch.tensor(indices)
    batch = {}
    for k in Buffers.ROW_KEYS:
        x = getattr(buffers, k)[idx]  # [B, T + 1, N, ...], a copy
        batch[k] = x.transpose(0, 1).reshape(x.shape[1], -1, *x.shape[3:])
    for k in ("initial_h", "initial_c"):
        x = getattr(buffers, k)[idx]  # [B, L, N, H] -> [L, B * N, H]
        batch[k] = x.transpose(0, 1).reshape(x.shape[1], -1, x.shape[3])
    batch["meta"] = buffers.meta[idx].clone()
    if len(set(indices)) != len(indices):
        raise RuntimeError(f"a learner batch holds the same buffer twice: {indices}")
    for index in indices:
        buffers.ledger[index] = FREE_QUEUE
        free_q.put(index)
    return batch, indices


def learner_outputs(model: nn.Module, b: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """The learner's logits [T + 1, B, A] and values [T + 1, B] on a batch, from the same inputs the actors fed."""
    T1, B = b["reward"].shape
    if model.core is None:
        logits, values = model(b["obs"].reshape(T1 * B, *b["obs"].shape[2:]), b["last_action"], b["reward"])
        return logits.reshape(T1, B, -1), values.reshape(T1, B)
    state = (b["initial_h"], b["initial_c"])
    logits, values, _ = model.recurrent(b["obs"], b["done"], state, b["last_action"], b["reward"])
    return logits, values


def learn(model: nn.Module, optimizer, batch: dict[str, torch.Tensor], args: Args, device: torch.device) -> dict:
    """One V-trace update on a [T + 1, B] batch; returns float metrics (losses, grad norm)."""
    b = {k: v.to(device, non_blocking=True) for k, v in batch.items() if k != "meta"}
    logits, values = learner_outputs(model, b)
    rewards = b["reward"][1:]  # raw from the env
    if args.clip_rewards:
        rewards = rewards.clamp(-1.0, 1.0)
    actions = b["action"][:-1]
    target_logprob, entropy = logprob_entropy(logits[:-1], actions)
    behaviour_logprob, _ = logprob_entropy(b["logits"][:-1], actions)
    vs, pg_adv = vtrace(
        behaviour_logprob,
        target_logprob.detach(),
        rewards,
        values[:-1].detach(),
        b["done"][1:],
        values[-1].detach(),
        args.gamma,
        args.vtrace_rho_bar,
        args.vtrace_c_bar,
        args.vtrace_pg_rho_bar,
    )
    losses = impala_loss(target_logprob, entropy, values[:-1], vs, pg_adv, args.baseline_cost, args.entropy_cost)
    if not torch.isfinite(losses["total_loss"]):
        raise NonFiniteLoss(f"non-finite loss {losses['total_loss'].item()}")
    optimizer.zero_grad(set_to_none=False)
    losses["total_loss"].backward()
    losses["grad_norm"] = nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm)
    optimizer.step()
    return {k: v.item() for k, v in losses.items()}


# ----------------------------------------------------------------------------------------------------------------
# Setup helpers: validation, checkpoints, evaluation, signals
# ----------------------------------------------------------------------------------------------------------------


def model_options(args: Args) -> dict:
    """make_model's core options from the flags."""
    return dict(
        use_lstm=args.use_lstm,
        lstm_size=args.lstm_size,
        lstm_layers=args.lstm_layers,
        action_reward_inputs=args.action_reward_inputs,
    )


def num_buffers_of(args: Args) -> int:
    return args.num_buffers if args.num_buffers is not None else max(2 * args.num_actors, args.batch_size)


def validate(args: Args) -> str | None:
    """Every flag checked before anything is spawned; returns the error line or None."""
    for name, value in asdict(args).items():
        if isinstance(value, float) and not math.isfinite(value):
            return f"--{name.replace('_', '-')} must be a finite number, got {value}"
    for name in (
        "num_actors",
        "num_envs_per_actor",
        "num_learner_threads",
        "unroll_length",
        "batch_size",
        "total_timesteps",
        "lstm_layers",
    ):
        if getattr(args, name) < 1:
            return f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}"
    K = num_buffers_of(args)
    if K < max(args.num_actors, args.batch_size):
        return (
            f"--num-buffers ({K}) must be >= --num-actors ({args.num_actors}) and >= --batch-size ({args.batch_size})"
        )
    if args.inference not in ("batched", "actor"):
        return f"--inference must be batched or actor, got {args.inference!r}"
    if args.network not in NETWORKS:
        return f"--network must be one of {', '.join(NETWORKS)}, got {args.network!r}"
    if args.atari_protocol not in PROTOCOLS:
        return f"--atari-protocol must be one of {', '.join(PROTOCOLS)}, got {args.atari_protocol!r}"
    for name in (
        "learning_rate",
        "max_grad_norm",
        "gamma",
        "vtrace_rho_bar",
        "vtrace_c_bar",
        "vtrace_pg_rho_bar",
        "rmsprop_eps",
        "rmsprop_alpha",
    ):
        if not getattr(args, name) > 0:
            return f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}"
    if args.gamma > 1:
        return f"--gamma must be in (0, 1], got {args.gamma}"
    for name in (
        "checkpoint_interval",
        "eval_episodes",
        "torch_threads",
        "max_inference_batch",
        "baseline_cost",
        "entropy_cost",
        "rmsprop_momentum",
        "lstm_size",
    ):
        if getattr(args, name) < 0:
            return f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}"
    if 0 < args.max_inference_batch < args.num_envs_per_actor:
        return (
            f"--max-inference-batch ({args.max_inference_batch}) must hold at least one actor's "
            f"--num-envs-per-actor ({args.num_envs_per_actor}) envs (or be 0 = all)"
        )
    if args.resume is not None and not Path(args.resume).is_file():
        return f"--resume {args.resume}: no such checkpoint file"
    steps = args.unroll_length * args.batch_size * args.num_envs_per_actor
    if args.total_timesteps < steps:
        return (
            f"--total-timesteps ({args.total_timesteps}) is less than one learner batch "
            f"({args.unroll_length} steps x {args.batch_size} rollouts x {args.num_envs_per_actor} envs)"
        )
    try:
        check_env_args(args.env_id, args.num_envs_per_actor, args.atari_protocol)
    except EnvError as e:
        return str(e)
    act_space = env_spaces(args)[1]
    if not isinstance(act_space, gym.spaces.Discrete):
        return (
            f"{args.env_id} has a continuous action space ({act_space}); impala_monobeast.py handles Discrete "
            f"action spaces only (for continuous actions: apex.py --algo ddpg)"
        )
    return None


def env_spaces(args: Args):
    """(observation space, action space) of one env of the training vector env."""
    probe = make_vector_env(args.env_id, 1, args.seed, protocol=args.atari_protocol, num_threads=1)
    spaces = probe.single_observation_space, probe.single_action_space
    probe.close()
    return spaces


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


def checkpoint_meta(args: Args, network: str, obs_space, act_space) -> dict:
    """What a checkpoint must match to be resumed by this run: script, env, network and shapes."""
    return dict(
        script=Path(__file__).name,
        algo=None,
        env_id=args.env_id,
        network=network,
        **model_options(args),
        obs_shape=list(obs_space.shape),
        action_shape_or_n=int(act_space.n),
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


def evaluate(model: nn.Module, args: Args, run_dir: Path, device: torch.device) -> list[float]:
    """Play `eval_episodes` full games with the final policy (sampled actions), true returns."""
    env = make_env(
        args.env_id,
        args.seed + 1_000_003,
        protocol=args.atari_protocol,
        capture_video=args.capture_video,
        video_dir=str(run_dir / "videos"),
    )
    torch.manual_seed(args.seed + 1_000_003)
    returns = []
    obs, _ = env.reset()
    done = torch.ones(1, dtype=torch.bool, device=device)
    last_action = torch.zeros(1, dtype=torch.int64, device=device)
    reward = torch.zeros(1, device=device)
    state = model.initial_state(1, device) if model.core is not None else None
    while len(returns) < args.eval_episodes:
        with torch.inference_mode():
            obs_t = torch.as_tensor(obs[None], device=device)
            action, _, _, state = policy_step(model, obs_t, done, last_action, reward, state)
        obs, r, terminated, truncated, info = env.step(int(action[0]))
        done.fill_(bool(terminated or truncated))
        last_action.copy_(action)  # carried into the next game, as in training
        reward.fill_(r)
        if terminated or truncated:
            returns.append(float(info["episode"]["r"]))
            obs, _ = env.reset()
    env.close()
    return returns


def install_stop_handlers(interrupt: list) -> None:
    """Ctrl+C and SIGTERM append their number to `interrupt` (the exit status is 128 + it); the main thread's watch loop
    sees it within a second and sets `stop`. The handler must not touch `stop` itself: it runs in the main thread,
    which may be inside `stop.is_set()` holding the event's lock, and would wait on that lock forever."""

    def handler(signum, frame):
        interrupt.append(signum)

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)


def leave(code: int, threads: list[threading.Thread]) -> None:
    """Exit with `code`. A thread still inside torch when the interpreter tears down makes C++ static destructors
    abort the process ("terminate called without an active exception", SIGABRT; reproduced with a daemon thread
    running backward passes at exit), so if a worker thread outlived its join, skip the teardown: TensorBoard is
    closed and checkpoints are written by now."""
    alive = [t.name for t in threads if t.is_alive()]
    if alive:
        print(f"warning: {', '.join(alive)} still running at exit; leaving without interpreter teardown",
              file=sys.stderr, flush=True)  # fmt: skip
        sys.stdout.flush()
        os._exit(code)
    if code:
        raise SystemExit(code)


def restore_default_handlers() -> None:
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


# ----------------------------------------------------------------------------------------------------------------
# main
# ----------------------------------------------------------------------------------------------------------------


def main(args: Args) -> None:
    if error := validate(args):
        fail(error)

    use_cuda = args.cuda and torch.cuda.is_available()
    device = torch.device("cuda" if use_cuda else "cpu")
    cores = os.cpu_count() or 1
    torch.set_num_threads(args.torch_threads or max(1, cores - args.num_actors))
    # the inference thread must get the GIL as soon as a request arrives, not after the learner's 5 ms time slice
    sys.setswitchinterval(0.0005)
    torch.manual_seed(args.seed)
    torch.backends.cudnn.deterministic = args.torch_deterministic
    torch.use_deterministic_algorithms(args.torch_deterministic, warn_only=True)

    # ---- checkpoint and run directory, before any process, thread or file
    obs_space, act_space = env_spaces(args)
    network = args.network if args.network != "auto" else ("nature" if len(obs_space.shape) == 3 else "mlp")
    meta = checkpoint_meta(args, network, obs_space, act_space)
    checkpoint = load_checkpoint(args.resume, meta) if args.resume else None
    if checkpoint:
        run_dir = Path(args.resume).parent
        if not os.access(run_dir, os.W_OK):
            fail(f"cannot write to the run directory {run_dir} of --resume {args.resume}")
    else:
        run_dir = new_run_dir(args)

    # ---- model, optimizer, shared memory (all allocated once, before the actors fork)
    model = make_model(obs_space, act_space, network, **model_options(args)).to(device)
    optimizer = torch.optim.RMSprop(
        model.parameters(),
        lr=args.learning_rate,
        alpha=args.rmsprop_alpha,
        eps=args.rmsprop_eps,
        momentum=args.rmsprop_momentum,
    )
    updates, global_step = 0, 0
    if checkpoint:
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        updates, global_step = checkpoint["update"], checkpoint["global_step"]
        torch.set_rng_state(checkpoint["torch_rng"])
    N, T, B, M = args.num_envs_per_actor, args.unroll_length, args.batch_size, args.num_actors
    steps_per_update = T * B * N
    num_updates = args.total_timesteps // steps_per_update
    K = num_buffers_of(args)
    lstm_shape = (model.core.num_layers, model.core.hidden_size) if model.core is not None else (1, 1)
    obs_dtype = torch.uint8 if obs_space.dtype == np.uint8 else torch.float32
    buffers = Buffers.allocate(K, T, N, obs_space.shape, obs_dtype, int(act_space.n), lstm_shape)
    # the actors' copy: the Nature network infers faster contiguous on CPU, trains faster channels_last (common.models)
    acting_device = device if args.inference == "batched" else torch.device("cpu")
    acting_model = make_model(
        obs_space, act_space, network, **model_options(args), channels_last=network != "nature"
    ).to(acting_device)
    acting_model.load_state_dict(model.state_dict())
    acting_version = [updates]  # batched: read by the inference thread under model_lock
    shared_version = torch.tensor([updates], dtype=torch.int64).share_memory_()  # actor mode: read by the actors
    if args.inference == "actor":
        acting_model.share_memory()

    ctx = mp.get_context("fork")  # MonoBeast's choice: buffers and the shared model are inherited, not pickled
    stop = ctx.Event()
    free_q, full_q, error_q = ctx.Queue(), ctx.Queue(), ctx.Queue()
    requests = RequestPipe() if args.inference == "batched" else None
    sems = [ctx.Semaphore(0) for _ in range(M)] if args.inference == "batched" else []
    slots = None
    if args.inference == "batched":
        slots = InferenceSlots.allocate(M, N, obs_space.shape, obs_dtype, int(act_space.n), lstm_shape)
    buffers.ledger.fill_(FREE_QUEUE)
    for index in range(K):
        free_q.put(index)

    # ---- actors (seed of env e of actor i: seed + N i + e; shifted on resume so episodes are new)
    env_seed0 = args.seed + (1_000_003 * updates if checkpoint else 0)
    parent_pid = os.getpid()
    actors = []
    for i in range(M):
        if args.inference == "actor":
            policy = ActorPolicy(i, args, model=acting_model, version=shared_version)
        else:
            policy = ActorPolicy(i, args, slots=slots, requests=requests, sem=sems[i])
        p = ctx.Process(
            target=actor_process,
            name=f"actor-{i}",
            args=(i, args, env_seed0 + N * i, buffers, free_q, full_q, policy, stop, error_q, parent_pid),
            daemon=True,
        )
        p.start()
        actors.append(p)

    # ---- TensorBoard (after the fork: the writer runs a background thread)
    quiet_writer_thread()
    writer = SummaryWriter(str(run_dir))
    table = "\n".join(f"|{k}|{v}|" for k, v in {**asdict(args), "num_buffers": K}.items())
    writer.add_text("hyperparameters", f"|param|value|\n|-|-|\n{table}")
    print(
        f"run directory: {run_dir}  ({num_updates} updates of {steps_per_update} agent steps, {M} actors x {N} envs, "
        f"{args.inference} inference, {network} network{' + LSTM' if args.use_lstm else ''}, {K} buffers)",
        flush=True,
    )

    # ---- learner threads and the inference thread
    errors: list[str] = []
    interrupt: list[int] = []  # the signal that stopped the run
    learn_lock, batch_lock, model_lock = threading.Lock(), threading.Lock(), threading.Lock()
    recent_returns: deque[float] = deque(maxlen=50)
    progress = dict(
        claimed=updates,
        updates=updates,
        global_step=global_step,
        last_print=time.time(),
        last_checkpoint=time.time(),
        failure=None,
    )
    inference_stats = dict(batches=0, envs=0)
    start_time, start_step = time.time(), global_step

    def checkpoint_state() -> dict:
        return dict(
            model=model.state_dict(),
            optimizer=optimizer.state_dict(),
            update=progress["updates"],
            global_step=progress["global_step"],
            torch_rng=torch.get_rng_state(),
            args=asdict(args),
            meta=meta,
        )

    def learner_thread(thread_id: int) -> None:
        """TorchBeast's `batch_and_learn`: batch outside the lock, learn and publish inside it."""
        try:
            while not stop.is_set():
                with learn_lock:
                    if progress["claimed"] >= num_updates:
                        break
                    progress["claimed"] += 1
                t0 = time.perf_counter()
                batch, _ = get_batch(thread_id, buffers, free_q, full_q, B, batch_lock, stop)
                batch_wait = time.perf_counter() - t0
                with learn_lock:
                    t1 = time.perf_counter()
                    lr = linear_lr(args.learning_rate, progress["global_step"], args.total_timesteps)
                    for group in optimizer.param_groups:
                        group["lr"] = lr
                    metrics = learn(model, optimizer, batch, args, device)
                    lag = progress["updates"] - batch["version"][:-1].double().mean().item()
                    progress["updates"] += 1
                    progress["global_step"] += steps_per_update
                    step = progress["global_step"]
                    with model_lock:  # publish: the actors' shared copy, or the inference thread's
                        for dst, src in zip(acting_model.parameters(), model.parameters(), strict=True):
                            dst.data.copy_(src.data)
                        acting_version[0] = progress["updates"]
                        shared_version.fill_(progress["updates"])
                    train_time = time.perf_counter() - t1
                    sps = (step - start_step) / (time.time() - start_time)
                    ends = batch["episode_end"][1:]  # row 0 repeats the previous rollout's last row
                    for ret, length in zip(
                        batch["episode_return"][1:][ends].tolist(),
                        batch["episode_length"][1:][ends].tolist(),
                        strict=True,
                    ):
                        writer.add_scalar("charts/episodic_return", ret, step)
                        writer.add_scalar("charts/episodic_length", length, step)
                        recent_returns.append(ret)
                    writer.add_scalar("charts/policy_lag", lag, step)
                    writer.add_scalar("charts/SPS", sps, step)
                    writer.add_scalar("charts/learning_rate", lr, step)
                    for name, value in metrics.items():
                        writer.add_scalar(f"losses/{name}", value, step)
                    writer.add_scalar("timing/full_queue_get", batch_wait, step)
                    writer.add_scalar("timing/free_queue_get", batch["meta"][:, 2].mean().item(), step)
                    writer.add_scalar("timing/train", train_time, step)
                    if args.inference == "batched":
                        writer.add_scalar("timing/inference_wait", batch["meta"][:, 3].mean().item(), step)
                        mean_batch = inference_stats["envs"] / max(1, inference_stats["batches"])
                        writer.add_scalar("timing/inference_batch_size", mean_batch, step)
                    now = time.time()
                    if now - progress["last_print"] >= args.log_interval or progress["updates"] == num_updates:
                        mean_ret = f"{np.mean(recent_returns):.2f}" if recent_returns else "n/a"
                        print(
                            f"step {step:>10,}  update {progress['updates']}/{num_updates}  SPS {sps:,.0f}  "
                            f"return(last {len(recent_returns)}) {mean_ret}  lag {lag:.1f}  "
                            f"wait batch {batch_wait:.3f}s  train {train_time:.3f}s",
                            flush=True,
                        )
                        progress["last_print"] = now
                    if args.checkpoint_interval and now - progress["last_checkpoint"] >= args.checkpoint_interval:
                        atomic_save(checkpoint_state(), run_dir / "checkpoint.pt")
                        progress["last_checkpoint"] = now
        except Shutdown:
            pass
        except NonFiniteLoss as e:
            progress["failure"] = (
                f"error: {e} at update {progress['updates'] + 1}; stopping (the last checkpoint, if any, is kept)"
            )
            stop.set()
        except WriteError as e:
            progress["failure"] = f"{e}; stopping (the last good checkpoint is kept)"
            stop.set()
        except OSError as e:  # the TensorBoard events file
            progress["failure"] = events_error(e, run_dir)
            stop.set()
        except BaseException:
            errors.append(f"learner thread {thread_id} died:\n{traceback.format_exc()}")
            stop.set()

    threads = [
        threading.Thread(target=learner_thread, args=(j,), name=f"learner-{j}", daemon=True)
        for j in range(args.num_learner_threads)
    ]
    if args.inference == "batched":
        max_actors = M if not args.max_inference_batch else max(1, args.max_inference_batch // N)
        threads.append(
            threading.Thread(
                target=inference_thread,
                name="inference",
                daemon=True,
                args=(
                    acting_model,
                    model_lock,
                    acting_version,
                    slots,
                    requests,
                    sems,
                    max_actors,
                    device,
                    stop,
                    errors,
                    inference_stats,
                ),
            )
        )
    install_stop_handlers(interrupt)
    for t in threads:
        t.start()
    learners = threads[: args.num_learner_threads]

    # ---- the main thread watches the workers: a dead actor (exception or kill -9) stops the run
    failure = None
    try:
        sentinels = {p.sentinel: i for i, p in enumerate(actors)}
        while not interrupt and not stop.is_set() and any(t.is_alive() for t in learners):
            ready = multiprocessing.connection.wait(list(sentinels), timeout=1.0)
            if ready and not interrupt and not stop.is_set():
                i = sentinels[ready[0]]
                actors[i].join(timeout=1.0)
                detail = ""
                try:
                    actor_id, tb = error_q.get(timeout=2.0)
                    i, detail = actor_id, f":\n{tb}"
                except queue.Empty:
                    code = actors[i].exitcode
                    detail = f" (killed by signal {-code})" if code is not None and code < 0 else f" (exit code {code})"
                failure = f"error: actor {i} (pid {actors[i].pid}) died{detail}"
                stop.set()
    finally:
        stop.set()
        if requests is not None:
            requests.put(RequestPipe.WAKE)
        for _ in learners:
            full_q.put(None)
        deadline = time.time() + 8.0  # queue waits wake within a second; an update ends within seconds
        for t in threads:
            t.join(timeout=max(0.0, deadline - time.time()))
        for _ in actors:
            free_q.put(None)
        for sem in sems:
            sem.release()
        deadline = time.time() + 3.0
        for p in actors:
            p.join(timeout=max(0.0, deadline - time.time()))
        for p in actors:
            if p.is_alive():
                p.terminate()
                p.join(timeout=1.0)
            if p.is_alive():
                p.kill()
                p.join()
        for q in (free_q, full_q, error_q):
            q.cancel_join_thread()  # never block at exit on data no one will read
            q.close()
        if requests is not None:
            requests.close()
        restore_default_handlers()

    if errors and failure is None:
        failure = f"error: {errors[0]}"
    failure = failure or progress["failure"]
    interrupted = bool(interrupt)
    global_step = progress["global_step"]
    if interrupted:
        print(f"interrupted at step {global_step}: shutting down", file=sys.stderr)
    try:
        if failure is None and args.checkpoint_interval:
            atomic_save(checkpoint_state(), run_dir / "checkpoint.pt")
        if failure is None and not interrupted and args.save_model:
            atomic_save(model.state_dict(), run_dir / "model.pt")
    except WriteError as e:
        failure = f"{e}; stopping (the last good checkpoint is kept)"
    if failure is None and not interrupted:
        if args.eval_episodes:
            for i, ret in enumerate(evaluate(model, args, run_dir, device)):
                writer.add_scalar("eval/episodic_return", ret, i)
                print(f"eval episode {i}: return {ret:.1f}")
    try:
        writer.close()
    except OSError as e:
        failure = failure or events_error(e, run_dir)
    if failure:
        print(failure, file=sys.stderr)
    leave(1 if failure else 128 + interrupt[0] if interrupted else 0, threads)


if __name__ == "__main__":
    main(tyro.cli(Args))
