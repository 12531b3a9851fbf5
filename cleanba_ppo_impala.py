"""Cleanba: reproducible actor-learner PPO and IMPALA (Huang et al., "Cleanba: a reproducible and efficient
distributed reinforcement learning platform", ICLR 2024; the paper's Figure 1 and Table 1).

Architecture, per rank (one process per learner device; `torchrun` starts several, on one node or many):
  actor threads (`--num-actor-threads`) each step `--num-envs / threads` envs (ale-py C++ vector env) and run one
  batched forward pass over all of them per step on the actor device. Learner = the main thread.
  param_Q[i]   (size 1, one per actor thread): learner -> actor, (version, flat parameter snapshot)
  rollout_Q[i] (size 1, one per actor thread): actor -> learner, index of a filled preallocated Rollout buffer
  Actor iteration k: get params from param_Q (skipped at k = 2), fill a rollout, put it on rollout_Q. Learner
  iteration j: get one rollout from every actor thread, update, all-reduce gradients across ranks (gloo on CPU,
  NCCL on GPU), put the new parameters on every param_Q.
Policy lag (the paper's Table 1): update 1 trains pi_1 on D(pi_1); from then on the learner always trains on data
  of the second latest policy, pi_i --D(pi_{i-1})--> pi_{i+1}, so `charts/policy_lag` is 0, 1, 1, 1, ... `--sync` gives
  the Synchronous architecture (rollout, then learn; lag always 0). The size-1 queues keep an actor at most one
  rollout ahead, so hardware speed never changes which policy produced which data.
Determinism: which data each update sees is fixed by the queue protocol, actions are sampled from per-thread
  seeded generators, envs are seeded per rank and thread; with `--torch-deterministic` on CPU two runs with the same
  seed and flags give bitwise equal parameters, however slow either side is (`--learner-delay`).
Algorithms: `--algo ppo` (clipped surrogate, GAE on the values the actor stored, epochs x minibatches) or `--algo
  impala` (V-trace, one pass over minibatches of whole unrolls, the loss summed over each minibatch). Defaults are
  Cleanba's (cleanba_ppo.py / cleanba_impala.py); the network defaults to the Nature CNN for PPO (CleanRL's ppo_atari
  comparison) and the IMPALA ResNet for IMPALA. The envs reset in the same step an episode ends (common.atari), so no
  stored transition crosses an auto-reset: the (1 - done) discount is the whole mask, and GAE / V-trace traces stop
  at every episode end. Step t pairs x_t and a_t with the reward and done of its own transition x_t -> x_{t+1};
  Cleanba's cleanba_impala.py pairs x_t with the reward and done that arrived with x_t (one step earlier), so its
  IMPALA curves are not expected to match these step for step.

Examples:
  python cleanba_ppo_impala.py --env-id ALE/Breakout-v5
  python cleanba_ppo_impala.py --algo impala --env-id ALE/Pong-v5 --num-envs 32 --num-actor-threads 2
  torchrun --standalone --nproc-per-node 2 cleanba_ppo_impala.py --env-id ALE/Breakout-v5        # one node, 2 ranks
  torchrun --nnodes 2 --node-rank $NODE_RANK --nproc-per-node 8 --rdzv-backend c10d \\
      --rdzv-endpoint $HEAD_NODE:29500 cleanba_ppo_impala.py --env-id ALE/Breakout-v5           # two nodes
"""

from __future__ import annotations

import copy
import errno
import io
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
from typing import Literal

import gymnasium as gym
import numpy as np
import torch
import torch.distributed as dist
import tyro
from torch import nn

from common.atari import EnvError, ale_game, check_env_args, finished_episodes, make_env, make_vector_env
from common.models import NETWORKS, make_model


@dataclass
class Args:
    exp_name: str = Path(__file__).stem
    """name of this experiment (part of the run directory)"""
    seed: int = 1
    """seed of the experiment"""
    torch_deterministic: bool = True
    """use deterministic torch algorithms (bitwise reproducible on CPU)"""
    cuda: bool = True
    """use a GPU for actors and learner when one is present"""
    env_id: str = "ALE/Breakout-v5"
    """gymnasium id; ALE ids run in ale-py's C++ vector env"""
    atari_protocol: str = "machado"
    """ALE preprocessing: `machado` (sticky actions, full action set; Cleanba's evaluation) or `deepmind`"""
    total_timesteps: int = 10_000_000
    """agent steps summed over all envs of all ranks"""
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

    algo: Literal["ppo", "impala"] = "ppo"
    """learning algorithm"""
    sync: bool = False
    """the paper's Synchronous architecture: rollout, then learn, no overlap (policy lag 0)"""
    network: str = "auto"
    """`nature`, `impala`, `mlp`, or `auto` (nature for ppo, impala for impala; mlp for flat observations)"""
    num_envs: int = 8
    """environments per rank, split evenly over the actor threads (CleanRL ppo_atari: 8; Cleanba: 64 x 2 threads)"""
    num_actor_threads: int = 1
    """actor threads per rank (hardware, not a hyperparameter: the data does not depend on it per env)"""
    env_threads: int = 0
    """ale-py stepping threads per actor thread (0 = the machine's cores / actor threads)"""
    torch_threads: int = 0
    """torch intra-op threads for this process (0 = torch's default)"""
    num_steps: int | None = None
    """steps per env per rollout (default: 128 ppo, 20 impala)"""
    learning_rate: float | None = None
    """learning rate (default: 2.5e-4 ppo with Adam, 6e-4 impala with RMSprop)"""
    anneal_lr: bool = True
    """linearly anneal the learning rate to 0 over the run"""
    gamma: float = 0.99
    """discount factor"""
    gae_lambda: float = 0.95
    """PPO: lambda of generalized advantage estimation"""
    update_epochs: int = 4
    """PPO: epochs over each rollout (IMPALA makes one pass)"""
    num_minibatches: int = 4
    """minibatches per epoch (IMPALA: minibatches of whole unrolls, split over envs)"""
    norm_adv: bool = True
    """PPO: normalise advantages per minibatch"""
    clip_coef: float = 0.1
    """PPO: surrogate clipping coefficient"""
    ent_coef: float = 0.01
    """entropy bonus coefficient"""
    vf_coef: float = 0.5
    """value loss coefficient"""
    max_grad_norm: float | None = None
    """global gradient-norm clip (default: 0.5 ppo, 40 impala)"""
    adam_eps: float = 1e-5
    """PPO: Adam epsilon"""
    rmsprop_alpha: float = 0.99
    """IMPALA: RMSprop smoothing constant"""
    rmsprop_eps: float = 0.01
    """IMPALA: RMSprop epsilon (PyTorch-style: added outside the square root), sized for the loss summed over a
    minibatch"""
    vtrace_rho_bar: float = 1.0
    """IMPALA: truncation of the importance weights in the V-trace value targets (rho-bar)"""
    vtrace_c_bar: float = 1.0
    """IMPALA: truncation of the trace-cutting coefficients (c-bar)"""
    vtrace_pg_rho_bar: float = 1.0
    """IMPALA: truncation of the importance weights in the policy-gradient advantage"""
    learner_delay: float = 0.0
    """seconds the learner sleeps before each update (the paper's Figure 2 slowdown; results must not change)"""
    log_interval: float = 10.0
    """seconds between console lines"""


PPO_DEFAULTS = {"num_steps": 128, "learning_rate": 2.5e-4, "max_grad_norm": 0.5}  # Cleanba cleanba_ppo.py Args
IMPALA_DEFAULTS = {"num_steps": 20, "learning_rate": 6e-4, "max_grad_norm": 40.0}  # Cleanba cleanba_impala.py Args


# ----------------------------------------------------------------------------------------------------------------
# Pure algorithm functions
# ----------------------------------------------------------------------------------------------------------------


def sample_actions(logits: torch.Tensor, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Gumbel-max sampling from a seeded generator (thread-safe, reproducible). [B, A] -> actions [B], logprob [B]."""
    u = torch.rand(logits.shape, generator=generator, device=logits.device).clamp_(min=1e-20)
    actions = torch.argmax(logits - torch.log(-torch.log(u)), dim=1)
    logprob = torch.log_softmax(logits, dim=1).gather(1, actions[:, None]).squeeze(1)
    return actions, logprob


def gae(rewards, values, dones, next_value, gamma: float, lam: float) -> torch.Tensor:
    """Generalized advantage estimation (Schulman et al. 2016, Eq. 11-16).

    rewards, values, dones: [T, B], where dones[t] says the episode ended with transition t (no bootstrap past it);
    next_value: [B], the value of the observation after the last step. Returns advantages [T, B].
    """
    T = rewards.shape[0]
    advantages = torch.zeros_like(rewards)
    not_done = 1.0 - dones.to(rewards.dtype)
    last = torch.zeros_like(next_value)
    for t in reversed(range(T)):
        v_next = next_value if t == T - 1 else values[t + 1]
        delta = rewards[t] + gamma * v_next * not_done[t] - values[t]
        last = delta + gamma * lam * not_done[t] * last
        advantages[t] = last
    return advantages


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

    All inputs [T, B] except next_value [B]; the discount is gamma * (1 - dones[t]), so no trace crosses an episode
    end. Returns (vs [T, B], pg_advantages [T, B]), both without gradient.
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


def ppo_loss(
    new_logprob,
    old_logprob,
    advantages,
    new_value,
    returns,
    entropy,
    clip_coef: float,
    ent_coef: float,
    vf_coef: float,
    norm_adv: bool,
) -> dict[str, torch.Tensor]:
    """Clipped surrogate objective (Schulman et al. 2017, Eq. 7) + value loss - entropy bonus, on a minibatch [M]."""
    if norm_adv:
        advantages = (advantages - advantages.mean()) / (advantages.std() + 1e-8)
    log_ratio = new_logprob - old_logprob
    ratio = log_ratio.exp()
    policy_loss = torch.max(-advantages * ratio, -advantages * ratio.clamp(1 - clip_coef, 1 + clip_coef)).mean()
    value_loss = 0.5 * ((new_value - returns) ** 2).mean()
    entropy_mean = entropy.mean()
    total = policy_loss - ent_coef * entropy_mean + vf_coef * value_loss
    with torch.no_grad():
        approx_kl = ((ratio - 1) - log_ratio).mean()
        clipfrac = ((ratio - 1.0).abs() > clip_coef).float().mean()
    return dict(
        total_loss=total,
        policy_loss=policy_loss,
        value_loss=value_loss,
        entropy=entropy_mean,
        approx_kl=approx_kl,
        clipfrac=clipfrac,
    )


def impala_loss(
    target_logprob, entropy, values, vs, pg_advantages, ent_coef: float, vf_coef: float
) -> dict[str, torch.Tensor]:
    """IMPALA's loss (Espeholt et al. 2018, Section 4.2) summed over the [T, B] unroll batch, as Cleanba's
    cleanba_impala.py (rlax per-step means x T, summed over B) and the paper's own code sum it: RMSprop's eps and the
    clip norm are set for gradients of that size. `entropy` is returned as the mean per step, for the logs."""
    policy_loss = -(target_logprob * pg_advantages).sum()
    value_loss = 0.5 * ((vs - values) ** 2).sum()
    entropy_sum = entropy.sum()
    total = policy_loss - ent_coef * entropy_sum + vf_coef * value_loss
    return dict(
        total_loss=total, policy_loss=policy_loss, value_loss=value_loss, entropy=entropy_sum.detach() / entropy.numel()
    )


# ----------------------------------------------------------------------------------------------------------------
# Rollout storage and the actor thread
# ----------------------------------------------------------------------------------------------------------------


@dataclass
class Rollout:
    """One actor thread's preallocated rollout of T steps over its N envs (two per thread, reused)."""

    obs: torch.Tensor  # [T, N, *obs_shape], the observation each action was taken in
    actions: torch.Tensor  # [T, N]
    logprobs: torch.Tensor  # [T, N], log mu(a|s) of the behaviour policy
    values: torch.Tensor  # [T, N], V(s) of the parameters that acted (PPO's GAE, as Cleanba's cleanba_ppo.py)
    rewards: torch.Tensor  # [T, N], clipped training rewards
    dones: torch.Tensor  # [T, N], the episode (or training life) ended with this transition
    next_obs: torch.Tensor  # [N, *obs_shape], for the bootstrap value
    version: int = -1  # learner update count of the parameters that acted
    episodes: list | None = None  # (return, length) of the games that ended during this rollout
    param_wait: float = 0.0  # seconds this actor blocked on param_Q.get before the rollout

    @staticmethod
    def allocate(T: int, N: int, obs_shape, obs_dtype) -> Rollout:
        return Rollout(
            obs=torch.zeros((T, N, *obs_shape), dtype=obs_dtype),
            actions=torch.zeros((T, N), dtype=torch.long),
            logprobs=torch.zeros((T, N)),
            values=torch.zeros((T, N)),
            rewards=torch.zeros((T, N)),
            dones=torch.zeros((T, N)),
            next_obs=torch.zeros((N, *obs_shape), dtype=obs_dtype),
        )


class Stop(Exception):
    """Raised inside a thread when the run is shutting down."""


def blocking_get(q: queue.Queue, stop: threading.Event):
    """`q.get()` that gives up when `stop` is set (wakes once a second to look; no busy wait)."""
    while True:
        try:
            return q.get(timeout=1.0)
        except queue.Empty:
            if stop.is_set():
                raise Stop from None


def blocking_put(q: queue.Queue, item, stop: threading.Event) -> None:
    while True:
        try:
            return q.put(item, timeout=1.0)
        except queue.Full:
            if stop.is_set():
                raise Stop from None


def actor_thread(
    thread_id: int,
    envs,
    model: nn.Module,
    device: torch.device,
    buffers: list[Rollout],
    param_q: queue.Queue,
    rollout_q: queue.Queue,
    num_iterations: int,
    sync: bool,
    generator: torch.Generator,
    stop: threading.Event,
    errors: list,
) -> None:
    """Figure 1 (right), `actor()`: get params (not at iteration 2), roll out, put the rollout."""
    # One intra-op thread for this actor's small inference batches (the setting is per thread): a second OpenMP
    # team spinning beside the learner's cost the learner about 20% on a 2-core CPU.
    torch.set_num_threads(1)
    try:
        next_obs, _ = envs.reset()
        T = buffers[0].obs.shape[0]
        version = -1
        for iteration in range(1, num_iterations + 1):
            start = time.perf_counter()
            if sync or iteration != 2:  # skipping the 2nd get is what lets rollout and learning overlap
                version, flat_params = blocking_get(param_q, stop)
                copy_flat_into([p.data for p in model.parameters()], flat_params)
            buf = buffers[iteration % 2]  # the learner finished the other buffer before publishing `version`
            buf.param_wait = time.perf_counter() - start
            buf.version, buf.episodes = version, []
            for t in range(T):
                obs = torch.from_numpy(next_obs)
                buf.obs[t].copy_(obs)
                with torch.inference_mode():
                    logits, value = model(obs.to(device, non_blocking=True))
                    actions, logprob = sample_actions(logits, generator)
                actions = actions.cpu()
                buf.actions[t].copy_(actions)
                buf.logprobs[t].copy_(logprob)
                buf.values[t].copy_(value)
                next_obs, reward, terminated, truncated, info = envs.step(actions.numpy())
                buf.rewards[t].copy_(torch.from_numpy(reward))
                buf.dones[t].copy_(torch.from_numpy(terminated | truncated))
                buf.episodes += finished_episodes(info)
            buf.next_obs.copy_(torch.from_numpy(next_obs))
            blocking_put(rollout_q, iteration % 2, stop)
    except Stop:
        pass
    except BaseException:
        errors.append(f"actor thread {thread_id} died:\n{traceback.format_exc()}")
        stop.set()
    finally:
        envs.close()


# ----------------------------------------------------------------------------------------------------------------
# Learner
# ----------------------------------------------------------------------------------------------------------------


class NonFiniteLoss(RuntimeError):
    pass


def flatten(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One flat copy, in logical (NCHW) order whatever the memory format (channels_last params included)."""
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def copy_flat_into(tensors: list[torch.Tensor], flat: torch.Tensor) -> None:
    """Inverse of `flatten`, copying in place so each tensor keeps its device and memory format."""
    offset = 0
    for t in tensors:
        t.copy_(flat[offset : offset + t.numel()].view(t.shape), non_blocking=True)
        offset += t.numel()


def optimizer_step(
    model: nn.Module, optimizer: torch.optim.Optimizer, loss: torch.Tensor, max_grad_norm: float, world_size: int
) -> torch.Tensor:
    """Backward, average gradients over ranks (one flat all-reduce), clip the global norm, step."""
    if not torch.isfinite(loss):
        raise NonFiniteLoss(f"non-finite loss {loss.item()}")
    optimizer.zero_grad(set_to_none=False)
    loss.backward()
    if world_size > 1:
        grads = [p.grad for p in model.parameters()]
        flat = flatten(grads)
        dist.all_reduce(flat)
        copy_flat_into(grads, flat.div_(world_size))
    grad_norm = nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    optimizer.step()
    return grad_norm


def max_divergence_from_rank0(model: nn.Module) -> float:
    """Largest absolute difference between this rank's parameters and rank 0's, maximised over ranks."""
    flat = flatten(list(model.parameters()))
    reference = flat.clone()
    dist.broadcast(reference, src=0)
    divergence = (flat - reference).abs().max()
    dist.all_reduce(divergence, op=dist.ReduceOp.MAX)
    return divergence.item()


def stack_rollouts(rollouts: list[Rollout], device: torch.device) -> dict[str, torch.Tensor]:
    """Concatenate the actor threads' rollouts along the env axis and move them to the learner device."""
    keys = ("obs", "actions", "logprobs", "values", "rewards", "dones", "next_obs")
    if len(rollouts) == 1:
        data = {k: getattr(rollouts[0], k) for k in keys}
    else:
        data = {k: torch.cat([getattr(r, k) for r in rollouts], dim=0 if k == "next_obs" else 1) for k in keys}
    return {k: v.to(device, non_blocking=True) for k, v in data.items()}


def ppo_update(
    model, optimizer, data, args: Args, generator: torch.Generator, world_size: int, stop: threading.Event
) -> dict:
    """Cleanba's PPO learner (cleanba_ppo.py `compute_gae`): GAE on the values the actor stored with the rollout and
    a bootstrap value recomputed with the current parameters, then epochs x shuffled minibatches."""
    with torch.no_grad():
        _, next_value = model(data["next_obs"])
        advantages = gae(data["rewards"], data["values"], data["dones"], next_value, args.gamma, args.gae_lambda)
        returns = advantages + data["values"]
    T, N = data["rewards"].shape
    flat = dict(
        obs=data["obs"].reshape(T * N, *data["obs"].shape[2:]),
        actions=data["actions"].reshape(-1),
        logprobs=data["logprobs"].reshape(-1),
        advantages=advantages.reshape(-1),
        returns=returns.reshape(-1),
    )
    batch = T * N
    mb_size = batch // args.num_minibatches
    metrics = []
    for _ in range(args.update_epochs):
        order = torch.randperm(batch, generator=generator).to(flat["obs"].device)
        for start in range(0, mb_size * args.num_minibatches, mb_size):
            idx = order[start : start + mb_size]
            logits, new_value = model(flat["obs"][idx])
            new_logprob, entropy = logprob_entropy(logits, flat["actions"][idx])
            losses = ppo_loss(
                new_logprob,
                flat["logprobs"][idx],
                flat["advantages"][idx],
                new_value,
                flat["returns"][idx],
                entropy,
                args.clip_coef,
                args.ent_coef,
                args.vf_coef,
                args.norm_adv,
            )
            losses["grad_norm"] = optimizer_step(model, optimizer, losses["total_loss"], args.max_grad_norm, world_size)
            metrics.append({k: v.detach() for k, v in losses.items()})
            if stop.is_set():  # an actor died or Ctrl+C: stop within a minibatch (the snapshot is consistent)
                raise Stop
    return {k: torch.stack([m[k] for m in metrics]).mean().item() for k in metrics[0]}


def impala_update(
    model, optimizer, data, args: Args, generator: torch.Generator, world_size: int, stop: threading.Event
) -> dict:
    """One pass over minibatches of whole unrolls (envs split in `num_minibatches`), V-trace at the current policy."""
    T, N = data["rewards"].shape
    envs_per_mb = N // args.num_minibatches
    order = torch.randperm(N, generator=generator).to(data["rewards"].device)
    metrics = []
    for start in range(0, envs_per_mb * args.num_minibatches, envs_per_mb):
        cols = order[start : start + envs_per_mb]  # whole unrolls of a subset of envs
        obs = data["obs"][:, cols]
        logits, values = model(torch.cat([obs.reshape(T * len(cols), *obs.shape[2:]), data["next_obs"][cols]]))
        values, next_value = values[: T * len(cols)].reshape(T, -1), values[T * len(cols) :]
        target_logprob, entropy = logprob_entropy(
            logits[: T * len(cols)].reshape(T, len(cols), -1), data["actions"][:, cols]
        )
        vs, pg_adv = vtrace(
            data["logprobs"][:, cols],
            target_logprob.detach(),
            data["rewards"][:, cols],
            values.detach(),
            data["dones"][:, cols],
            next_value.detach(),
            args.gamma,
            args.vtrace_rho_bar,
            args.vtrace_c_bar,
            args.vtrace_pg_rho_bar,
        )
        losses = impala_loss(target_logprob, entropy, values, vs, pg_adv, args.ent_coef, args.vf_coef)
        losses["grad_norm"] = optimizer_step(model, optimizer, losses["total_loss"], args.max_grad_norm, world_size)
        metrics.append({k: v.detach() for k, v in losses.items()})
        if stop.is_set():
            raise Stop
    return {k: torch.stack([m[k] for m in metrics]).mean().item() for k in metrics[0]}


# ----------------------------------------------------------------------------------------------------------------
# Setup helpers: validation, run directory, checkpoints, evaluation
# ----------------------------------------------------------------------------------------------------------------


def resolve_defaults(args: Args) -> Args:
    """Fill the algorithm-dependent defaults (None) from Cleanba's PPO or IMPALA settings."""
    defaults = PPO_DEFAULTS if args.algo == "ppo" else IMPALA_DEFAULTS
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    return args


def pick_network(args: Args, obs_shape: tuple[int, ...]) -> str:
    """`auto`: the Nature CNN for PPO, the IMPALA ResNet for IMPALA (Cleanba's), an MLP for flat observations."""
    if args.network != "auto":
        return args.network
    if len(obs_shape) != 3:
        return "mlp"
    return "nature" if args.algo == "ppo" else "impala"


def validate(args: Args, world_size: int) -> str | None:
    """Every flag checked before anything is spawned; returns the error line or None."""
    if args.total_timesteps < 1:
        return f"--total-timesteps must be >= 1, got {args.total_timesteps}"
    if args.num_actor_threads < 1:
        return f"--num-actor-threads must be >= 1, got {args.num_actor_threads}"
    if args.num_envs < 1 or args.num_envs % args.num_actor_threads:
        return (
            f"--num-envs ({args.num_envs}) must be a positive multiple of --num-actor-threads "
            f"({args.num_actor_threads})"
        )
    if args.num_steps < 1:
        return f"--num-steps must be >= 1, got {args.num_steps}"
    if args.num_minibatches < 1 or args.update_epochs < 1:
        return "--num-minibatches and --update-epochs must be >= 1"
    if args.algo == "ppo" and args.num_envs * args.num_steps < args.num_minibatches:
        return (
            f"a rollout of {args.num_envs * args.num_steps} samples cannot fill --num-minibatches "
            f"{args.num_minibatches}"
        )
    if args.algo == "impala" and args.num_envs < args.num_minibatches:
        return (
            f"IMPALA minibatches are whole unrolls: --num-envs ({args.num_envs}) must be >= --num-minibatches "
            f"({args.num_minibatches})"
        )
    if args.network not in NETWORKS:
        return f"--network must be one of {', '.join(NETWORKS)}, got {args.network!r}"
    for name in FLOAT_FLAGS:
        if not math.isfinite(getattr(args, name)):
            return f"--{name.replace('_', '-')} must be a finite number, got {getattr(args, name)}"
    for name in (
        "learning_rate",
        "max_grad_norm",
        "gamma",
        "vtrace_rho_bar",
        "vtrace_c_bar",
        "vtrace_pg_rho_bar",
        "rmsprop_eps",
        "adam_eps",
    ):
        if not getattr(args, name) > 0:
            return f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}"
    if not 0 <= args.gae_lambda <= 1 or not 0 < args.gamma <= 1:
        return "--gamma must be in (0, 1] and --gae-lambda in [0, 1]"
    for name in ("checkpoint_interval", "learner_delay", "eval_episodes", "env_threads", "torch_threads"):
        if getattr(args, name) < 0:
            return f"--{name.replace('_', '-')} must be >= 0, got {getattr(args, name)}"
    if args.resume is not None and not Path(args.resume).is_file():
        return f"--resume {args.resume}: no such checkpoint file"
    if args.total_timesteps < args.num_envs * args.num_steps * world_size:
        return (
            f"--total-timesteps ({args.total_timesteps}) is less than one rollout "
            f"({args.num_envs} envs x {args.num_steps} steps x {world_size} ranks)"
        )
    try:
        check_env_args(args.env_id, args.num_envs, args.atari_protocol)
    except EnvError as e:
        return str(e)
    return action_space_error(args.env_id)


FLOAT_FLAGS = (
    "learning_rate", "gamma", "gae_lambda", "clip_coef", "ent_coef", "vf_coef", "max_grad_norm", "adam_eps",
    "rmsprop_alpha", "rmsprop_eps", "vtrace_rho_bar", "vtrace_c_bar", "vtrace_pg_rho_bar", "checkpoint_interval",
    "learner_delay", "log_interval",
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
        f"{env_id} has a {type(space).__name__} action space {space}; cleanba_ppo_impala.py needs a Discrete one "
        f"(continuous actions: apex.py --algo ddpg)"
    )


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


def checkpoint_meta(args: Args, obs_space, act_space) -> dict:
    """What a checkpoint was trained on: --resume refuses one whose script, algo, env, network or shapes differ."""
    return dict(
        script=Path(__file__).name,
        algo=args.algo,
        env_id=args.env_id,
        network=pick_network(args, obs_space.shape),
        obs_shape=list(obs_space.shape),
        action_shape_or_n=int(act_space.n),
    )


def read_checkpoint(path: str, meta: dict) -> tuple[dict | None, str | None]:
    """Load a --resume checkpoint and check it was written by this script for this algo, env and network.
    Returns (checkpoint, None) or (None, the error line)."""
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=False)
    except Exception as e:  # garbage, truncated, or pickled objects this interpreter cannot rebuild
        reason = (str(e).strip().splitlines() or [""])[0][:120]
        return None, (
            f"error: cannot resume from {path}: not a checkpoint this script can read ({type(e).__name__}: {reason})"
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


def run_error(e: Exception, rank: int, world_size: int) -> str:
    """The error line of an exception that ended the learner: a TensorBoard write that failed (a full disk), a
    collective that failed because another rank is gone (with two ranks it can only be the other one), or a bug."""
    frames = traceback.extract_tb(e.__traceback__)
    if isinstance(e, OSError) and any("tensorboard" in f.filename for f in frames):
        return write_error(e, "the TensorBoard events")
    text = str(e)
    signs = ("Connection closed by peer", "Connection reset", "Broken pipe", "Timed out", "timed out")
    if world_size > 1 and (isinstance(e, dist.DistError) or any(m in text for m in signs)):
        who = f"rank {1 - rank}" if world_size == 2 else "another rank"
        reason = (text.strip().splitlines() or [""])[0][:160]
        return f"error: rank {rank}: lost contact with {who}, which died or lost its connection ({reason})"
    where = f" (rank {rank})" if world_size > 1 else ""
    return f"error: the learner{where} died:\n{traceback.format_exc()}"


def quiet_writer_thread_errors(hook) -> None:
    """threading.excepthook: TensorBoard's writer thread dies on a write error (a full disk) and the next write or
    close raises it again in the main thread, which reports it as the run's one error line; its traceback is noise."""
    frames = traceback.extract_tb(hook.exc_traceback)
    if not (issubclass(hook.exc_type, OSError) and any("tensorboard" in f.filename for f in frames)):
        threading.__excepthook__(hook)


def evaluate(model: nn.Module, args: Args, run_dir: Path, device: torch.device) -> list[float]:
    """Play `eval_episodes` full games with the final policy (sampled actions), true returns."""
    env = make_env(
        args.env_id,
        args.seed + 1_000_003,
        protocol=args.atari_protocol,
        capture_video=args.capture_video,
        video_dir=str(run_dir / "videos"),
    )
    generator = torch.Generator(device=device).manual_seed(args.seed + 1_000_003)
    returns = []
    obs, _ = env.reset()
    while len(returns) < args.eval_episodes:
        with torch.inference_mode():
            logits, _ = model(torch.as_tensor(obs[None], device=device))
        obs, _, terminated, truncated, info = env.step(int(sample_actions(logits, generator)[0]))
        if terminated or truncated:
            returns.append(float(info["episode"]["r"]))
            obs, _ = env.reset()
    env.close()
    return returns


def install_stop_handlers(stop: threading.Event, signals: list[int]) -> None:
    """Ctrl+C and SIGTERM ask every thread to stop: the learner leaves the update in progress at the next minibatch
    and blocked queue calls give up within a second. `signals` records which signal came (the exit status)."""

    def handler(signum, frame):
        signals.append(signum)
        stop.set()

    signal.signal(signal.SIGINT, handler)
    signal.signal(signal.SIGTERM, handler)


def leave(code: int, threads: list[threading.Thread], teardown: bool = True) -> None:
    """Exit with `code`. A thread still inside torch when the interpreter tears down makes C++ static destructors
    abort the process ("terminate called without an active exception", SIGABRT; reproduced with a daemon thread
    running backward passes at exit), so if a worker thread outlived its join, skip the teardown: TensorBoard is
    closed and checkpoints are written by now. `teardown=False` skips it too, for torchrun ranks: gloo's transport and
    worker threads (`gloo_tcp_loop`, `pt_gloo_runloop`) are still alive after destroy_process_group (the C++ process
    group stays referenced), or the group lost a rank and was never destroyed, and the teardown then aborts the same
    way now and then."""
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


def restore_default_handlers() -> None:
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


# ----------------------------------------------------------------------------------------------------------------
# main
# ----------------------------------------------------------------------------------------------------------------


def main(args: Args) -> None:
    args = resolve_defaults(args)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    if error := validate(args, world_size):
        print(f"error: {error}", file=sys.stderr)
        raise SystemExit(2)
    probe = make_vector_env(args.env_id, 1, args.seed, protocol=args.atari_protocol, num_threads=1)
    meta = checkpoint_meta(args, probe.single_observation_space, probe.single_action_space)
    probe.close()
    # ---- checkpoint and run directory, before any thread, writer or process group starts
    checkpoint = None
    if args.resume:
        checkpoint, error = read_checkpoint(args.resume, meta)
        if error:
            print(error, file=sys.stderr)
            raise SystemExit(2)
    run_dir = None
    if rank == 0:  # under torchrun the other ranks are stopped by torchrun when this one exits 2
        run_dir, error = create_run_dir(args)
        if error:
            print(error, file=sys.stderr)
            raise SystemExit(2)

    use_cuda = args.cuda and torch.cuda.is_available()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device(f"cuda:{local_rank}" if use_cuda else "cpu")
    if world_size > 1:
        dist.init_process_group("nccl" if use_cuda else "gloo", rank=rank, world_size=world_size)
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    torch.manual_seed(args.seed)  # identical initial parameters on every rank
    torch.backends.cudnn.deterministic = args.torch_deterministic
    torch.use_deterministic_algorithms(args.torch_deterministic, warn_only=True)
    # Deterministic mode would also fill every new tensor with NaN; nothing here reads uninitialised memory, and the
    # fill cost about 15% of the learner's time on CPU.
    torch.utils.deterministic.fill_uninitialized_memory = False

    # ---- envs, models, optimizer
    threads_per_env = args.env_threads or max(1, (os.cpu_count() or 1) // args.num_actor_threads)
    envs_per_thread = args.num_envs // args.num_actor_threads
    # env e of rank r has seed `seed + 10_000 r + e` whichever thread steps it (shifted on resume: new episodes)
    env_seed0 = args.seed + 10_000 * rank + (1_000_003 * checkpoint["update"] if checkpoint else 0)
    all_envs = [
        make_vector_env(
            args.env_id,
            envs_per_thread,
            env_seed0 + envs_per_thread * i,
            protocol=args.atari_protocol,
            num_threads=threads_per_env,
        )
        for i in range(args.num_actor_threads)
    ]
    obs_space, act_space = all_envs[0].single_observation_space, all_envs[0].single_action_space
    network = pick_network(args, obs_space.shape)
    model = make_model(obs_space, act_space, network).to(device)
    if args.algo == "ppo":
        optimizer = torch.optim.Adam(model.parameters(), lr=args.learning_rate, eps=args.adam_eps)
    else:
        optimizer = torch.optim.RMSprop(
            model.parameters(), lr=args.learning_rate, alpha=args.rmsprop_alpha, eps=args.rmsprop_eps
        )
    steps_per_update = args.num_envs * args.num_steps * world_size
    num_updates = args.total_timesteps // steps_per_update
    start_update, global_step = 0, 0
    learner_gen = torch.Generator().manual_seed(args.seed * 7919 + rank)
    actor_gens = [
        torch.Generator(device=device).manual_seed(args.seed * 104729 + 1000 * rank + i)
        for i in range(args.num_actor_threads)
    ]
    if checkpoint:
        model.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        start_update, global_step = checkpoint["update"], checkpoint["global_step"]
        learner_gen.set_state(checkpoint["learner_rng"])
        for g, s in zip(actor_gens, checkpoint["actor_rngs"], strict=True):
            g.set_state(s)
    if world_size > 1:
        for p in model.parameters():
            dist.broadcast(p.data, src=0)

    writer = None
    if rank == 0:
        from torch.utils.tensorboard import SummaryWriter

        threading.excepthook = quiet_writer_thread_errors
        writer = SummaryWriter(str(run_dir))
        table = "\n".join(f"|{k}|{v}|" for k, v in {**asdict(args), "world_size": world_size}.items())
        writer.add_text("hyperparameters", f"|param|value|\n|-|-|\n{table}")
        print(
            f"run directory: {run_dir}  ({num_updates} updates of {steps_per_update} agent steps, "
            f"{'sync' if args.sync else 'cleanba'} {args.algo}, {network} network, {world_size} rank(s))"
        )

    # ---- queues, buffers, actor threads (Figure 1, right)
    stop, errors = threading.Event(), []
    param_qs = [queue.Queue(maxsize=1) for _ in range(args.num_actor_threads)]
    rollout_qs = [queue.Queue(maxsize=1) for _ in range(args.num_actor_threads)]
    obs_dtype = torch.uint8 if obs_space.dtype == np.uint8 else torch.float32
    buffers = [
        [Rollout.allocate(args.num_steps, envs_per_thread, obs_space.shape, obs_dtype) for _ in range(2)]
        for _ in range(args.num_actor_threads)
    ]
    # actor copies: the Nature network infers faster contiguous on CPU, trains faster channels_last (common.models)
    actor_models = [
        make_model(obs_space, act_space, network, channels_last=network != "nature").to(device)
        for _ in range(args.num_actor_threads)
    ]
    remaining = num_updates - start_update
    threads = [
        threading.Thread(
            target=actor_thread,
            name=f"actor-{i}",
            daemon=True,
            args=(
                i,
                all_envs[i],
                actor_models[i],
                device,
                buffers[i],
                param_qs[i],
                rollout_qs[i],
                remaining,
                args.sync,
                actor_gens[i],
                stop,
                errors,
            ),
        )
        for i in range(args.num_actor_threads)
    ]

    def publish(version: int) -> None:
        flat = flatten(list(model.parameters()))  # a snapshot: the learner trains on while actors use it
        for q in param_qs:
            blocking_put(q, (version, flat), stop)

    update_fn = ppo_update if args.algo == "ppo" else impala_update
    recent_returns: deque[float] = deque(maxlen=20)
    last_checkpoint = last_print = time.time()
    start_time, start_step = time.time(), global_step
    signals, failure = [], None
    install_stop_handlers(stop, signals)

    def snapshot() -> dict:
        """A copy of everything a checkpoint holds, taken at an update boundary: a stop may interrupt the next
        update half way, and the final checkpoint must not hold half an update."""
        state = dict(
            model=model.state_dict(),
            optimizer=optimizer.state_dict(),
            update=update,
            global_step=global_step,
            learner_rng=learner_gen.get_state(),
            actor_rngs=[g.get_state() for g in actor_gens],
            torch_rng=torch.get_rng_state(),
            args=asdict(args),
            meta=meta,
        )
        return copy.deepcopy(state)

    update = start_update
    last_state = snapshot() if args.checkpoint_interval else None
    try:
        publish(start_update)  # pi_1 for the actors' first rollout
        for t in threads:
            t.start()
        for j in range(1, remaining + 1):
            update = start_update + j
            if args.learner_delay:
                time.sleep(args.learner_delay)
            t0 = time.perf_counter()
            indices = [blocking_get(q, stop) for q in rollout_qs]
            rollout_wait = time.perf_counter() - t0
            rollouts = [buffers[i][k] for i, k in enumerate(indices)]
            version = rollouts[0].version
            lr = args.learning_rate * (1.0 - (update - 1) / num_updates) if args.anneal_lr else args.learning_rate
            for group in optimizer.param_groups:
                group["lr"] = lr
            t1 = time.perf_counter()
            data = stack_rollouts(rollouts, device)
            metrics = update_fn(model, optimizer, data, args, learner_gen, world_size, stop)
            train_time = time.perf_counter() - t1
            global_step += steps_per_update
            if writer is not None:
                sps = (global_step - start_step) / (time.time() - start_time)
                param_wait = max(r.param_wait for r in rollouts)
                for ret, length in (ep for r in rollouts for ep in r.episodes):
                    writer.add_scalar("charts/episodic_return", ret, global_step)
                    writer.add_scalar("charts/episodic_length", length, global_step)
                    recent_returns.append(ret)
                writer.add_scalar("charts/policy_lag", (update - 1) - version, global_step)
                writer.add_scalar("charts/SPS", sps, global_step)
                writer.add_scalar("charts/learning_rate", lr, global_step)
                for name, value in metrics.items():
                    writer.add_scalar(f"losses/{name}", value, global_step)
                writer.add_scalar("timing/rollout_queue_get", rollout_wait, global_step)
                writer.add_scalar("timing/param_queue_get", param_wait, global_step)
                writer.add_scalar("timing/train", train_time, global_step)
                if time.time() - last_print >= args.log_interval or j == remaining:
                    mean_ret = f"{np.mean(recent_returns):.2f}" if recent_returns else "n/a"
                    print(
                        f"step {global_step:>10,}  update {update}/{num_updates}  SPS {sps:,.0f}  "
                        f"return(last {len(recent_returns)}) {mean_ret}  lag {(update - 1) - version}  "
                        f"wait rollout {rollout_wait:.3f}s param {param_wait:.3f}s",
                        flush=True,
                    )
                    last_print = time.time()
            if args.checkpoint_interval:
                last_state = snapshot()
                if writer is not None and time.time() - last_checkpoint >= args.checkpoint_interval:
                    if failure := write_atomically(run_dir / "checkpoint.pt", last_state):
                        break
                    last_checkpoint = time.time()
            if stop.is_set():
                break
            # publish pi_{update} only if an actor iteration will read it (see actor_thread's skipped 2nd get)
            if j <= remaining - (1 if args.sync else 2):
                publish(update)
    except Stop:
        pass
    except NonFiniteLoss as e:
        failure = f"error: {e} at update {update}; stopping (the last checkpoint, if any, is kept)"
    except Exception as e:
        failure = run_error(e, rank, world_size)
    finally:
        stop.set()
        deadline = time.time() + 8.0  # every wait wakes within a second; a rollout or minibatch ends within seconds
        for t in threads:
            t.join(timeout=max(0.0, deadline - time.time()))
        restore_default_handlers()
    if errors:
        failure = failure or errors[0]
    interrupted = bool(signals)
    if interrupted:
        print(f"interrupted at step {global_step}: shutting down", file=sys.stderr)
    finished = failure is None and not interrupted
    if finished and world_size > 1:  # every rank must hold the same parameters (identical averaged gradients)
        divergence = max_divergence_from_rank0(model)
        if rank == 0:
            print(f"max |parameter difference| across {world_size} ranks: {divergence:.3g}")
        if divergence > 0:
            failure = f"error: ranks diverged (max parameter difference {divergence:.3g})"
        dist.barrier()  # no rank leaves the group while a peer may still be sending to it
        dist.destroy_process_group()

    if writer is not None:
        keep = last_state if failure is None else None  # after a failure the last good checkpoint stays as it is
        failure = failure or end_run(args, run_dir, writer, model, keep, finished, device)
    if failure:
        print(failure, file=sys.stderr)
    code = 1 if failure else 128 + signals[0] if interrupted else 0
    leave(code, threads, teardown=world_size == 1)


def end_run(args: Args, run_dir: Path, writer, model, last_state, finished: bool, device) -> str | None:
    """Rank 0 after training: the final checkpoint, --save-model, --eval-episodes, the writer closed. Returns the
    error line of a write that failed (a full disk); never raises, so the shutdown always completes."""
    failure = None
    try:
        if args.checkpoint_interval and last_state is not None:
            failure = write_atomically(run_dir / "checkpoint.pt", last_state)
        if finished and failure is None:
            if args.save_model:
                failure = write_atomically(run_dir / "model.pt", model.state_dict())
            if args.eval_episodes and failure is None:
                for i, ret in enumerate(evaluate(model, args, run_dir, device)):
                    writer.add_scalar("eval/episodic_return", ret, i)
                    print(f"eval episode {i}: return {ret:.1f}")
        writer.close()
    except OSError as e:
        failure = failure or write_error(e, f"the TensorBoard events in {run_dir}")
    return failure


if __name__ == "__main__":
    main(tyro.cli(Args))
