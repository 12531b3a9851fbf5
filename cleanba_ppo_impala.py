"""Cleanba: reproducible actor-learner PPO and IMPALA (Huang et al., "Cleanba: a reproducible and efficient
distributed reinforcement learning platform", ICLR 2024; the paper's Figure 1 and Table 1).

One process per learner device (`torchrun` starts several, on one node or many); in each:
  actor thread i (`--num-actor-threads`): `--num-envs / threads` envs (ale-py C++ vector env), one batched forward
      pass per step on the actor device. Iteration k: Params <- param_Q[i] (skipped at k = 2), fill Rollout buffer
      k % 2, rollout_Q[i] <- that buffer.
  learner (the main thread). Update j: one Rollout from every rollout_Q[i], concatenated over envs -> PPO epochs x
      minibatches or V-trace minibatches -> gradients all-reduced over ranks (gloo on CPU, NCCL on GPU) -> every
      param_Q[i] <- Params(j, a flat copy of the parameters).
  param_Q[i], rollout_Q[i]: size 1, so an actor is at most one rollout ahead of the learner.
Policy lag (Table 1): update 1 trains on data of the initial parameters, update k >= 2 on the rollout of those after
  update k - 2 (pi_i --D(pi_{i-1})--> pi_{i+1}), so `charts/policy_lag` = (k - 1) - version is 0, 1, 1, 1, ... (from
  0 again after --resume). `--sync`, the paper's Synchronous architecture (rollout, then learn): always 0.
Determinism: the queue protocol fixes which parameters produced which data, whatever the hardware speed; actions come
  from per-thread seeded generators, envs are seeded per rank and thread: with `--torch-deterministic` on CPU, two
  runs with the same seed and flags end with bitwise equal parameters however slow either side is (`--learner-delay`).
`--algo` switches ALGO_DEFAULTS, make_optimizer and the update: PPO (clipped surrogate, GAE on the values the actor
  stored, epochs x minibatches) or IMPALA (V-trace, one pass over minibatches of whole unrolls, the loss summed).
  Episodes reset in the step they end (common.atari), so the (1 - done) discount is the whole mask. Step t pairs x_t
  and a_t with the reward and done of its own transition; Cleanba's cleanba_impala.py pairs x_t with those of the step
  before, so its IMPALA curves are not expected to match step for step.

  python cleanba_ppo_impala.py --env-id ALE/Breakout-v5                     # Cleanba's settings: 128 envs, ResNet
  python cleanba_ppo_impala.py --algo impala --env-id ALE/Pong-v5 --num-envs 32 --num-actor-threads 2 --track
  python cleanba_ppo_impala.py --eval-only runs/<run>/model.pt --eval-episodes 10 --capture-video  # a saved agent
  torchrun --nnodes 2 --node-rank $NODE_RANK --nproc-per-node 8 --rdzv-backend c10d \\
      --rdzv-endpoint $HEAD_NODE:29500 cleanba_ppo_impala.py --env-id ALE/Breakout-v5           # two nodes
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
import datetime
import errno
import fcntl
import functools
import hashlib
import io
import itertools
import json
import math
import queue
import shlex
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Annotated, ClassVar, Literal, NamedTuple, NoReturn

import gymnasium as gym
import numpy as np
import torch
import torch.distributed as dist
import tyro
from torch import nn
from tyro import conf

from common.atari import EnvError, check_video, finished_episodes, make_env, make_vector_env
from common.models import make_model

# ---- Args ----


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
    atari_protocol: Literal["deepmind", "machado"] = "machado"
    """ALE preprocessing: `machado` (sticky actions, full action set; Cleanba's evaluation) or `deepmind`"""
    total_timesteps: int = 50_000_000
    """agent steps summed over all envs of all ranks (Cleanba's 50M; the learning rate anneals over them)"""
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
    eval_greedy: bool = False
    """evaluate with argmax actions; by default they are sampled, as in training (the returns Cleanba reports)"""
    eval_only: str | None = None
    """evaluate a saved agent (model.pt or checkpoint.pt of this script) instead of training, on its run's settings"""
    capture_video: bool = False
    """record videos of the evaluation episodes to {run_dir}/videos (--eval-only: {model dir}/videos-eval-{time})"""
    track: bool = False
    """log to Weights & Biases (TensorBoard synced, Args as config, videos uploaded); `pip install -e ".[track]"`"""
    wandb_project_name: str = "actorlearners"
    """Weights & Biases project of --track"""
    wandb_entity: str | None = None
    """Weights & Biases entity (team or user) of --track; None: your default entity"""

    algo: Literal["ppo", "impala"] = "ppo"
    """`ppo` (Adam, clipped surrogate, GAE) or `impala` (RMSprop, V-trace), each with Cleanba's defaults"""
    sync: bool = False
    """the paper's Synchronous architecture: rollout, then learn, no overlap (policy lag 0)"""
    network: Literal["auto", "nature", "impala", "mlp"] = "auto"
    """`auto`: Cleanba's IMPALA ResNet (16/32/32, fc 256) on images, mlp on flat observations; `nature`: CleanRL's"""
    num_envs: int = 128
    """environments per rank, split evenly over the actor threads (Cleanba: 2 x 64; CleanRL ppo_atari: 1 x 8)"""
    num_actor_threads: int = 2
    """actor threads per rank (Cleanba: 2; the data does not depend on it per env)"""
    env_threads: int = 0
    """ale-py stepping threads per actor thread (0 = the machine's cores / actor threads, where a CPU learner training
    beside the rollouts, not --sync, counts as one more actor thread)"""
    torch_threads: int = 0
    """torch intra-op threads of the learner (each actor thread uses one); 0 = torch's default, one per core"""
    num_steps: Annotated[int | None, conf.arg(help_behavior_hint="(default: 128 ppo, 20 impala; Cleanba's)")] = None
    """steps per env per rollout"""
    learning_rate: Annotated[float | None, conf.arg(help_behavior_hint="(default: 2.5e-4 ppo, 6e-4 impala)")] = None
    """learning rate (ppo: Adam, impala: RMSprop; the defaults are Cleanba's)"""
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
    max_grad_norm: Annotated[float | None, conf.arg(help_behavior_hint="(default: 0.5 ppo, 40 impala)")] = None
    """global gradient-norm clip (the defaults are Cleanba's)"""
    adam_eps: float = 1e-5
    """PPO: Adam epsilon"""
    rmsprop_alpha: float = 0.99
    """IMPALA: RMSprop smoothing constant"""
    rmsprop_eps: float = 0.01
    """IMPALA: RMSprop epsilon (added outside the square root), sized for the loss summed over a minibatch"""
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
    rank_timeout: float = 120.0
    """torchrun: seconds a rank waits for the others at an all-reduce before it stops the run, naming the rank that did
    not join (stopped, hung, or out of step)"""


# ---- Algorithm ----


def gae(rewards: torch.Tensor, values: torch.Tensor, dones: torch.Tensor, next_value: torch.Tensor, gamma: float,
        lam: float) -> torch.Tensor:  # fmt: skip
    """Generalized advantage estimation (Schulman et al. 2016, Eq. 11-16): rewards, values, dones [T, B], dones[t] says
    the episode ended with transition t (no bootstrap past it); next_value [B], V of the observation after the last
    step. delta_t = r_t + gamma (1 - d_t) V_{t+1} - V_t, A_t = delta_t + gamma lam (1 - d_t) A_{t+1} -> A [T, B]."""
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


def ppo_loss(
    new_logprob, old_logprob, advantages, new_value, returns, entropy, clip_coef, ent_coef, vf_coef, norm_adv
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


def logprob_entropy(logits: torch.Tensor, actions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """log pi(a|s) and the policy entropy, [..., A] logits -> [...]."""
    logp = torch.log_softmax(logits, dim=-1)
    return logp.gather(-1, actions[..., None]).squeeze(-1), -(logp.exp() * logp).sum(-1)


# the flags whose default depends on --algo (None until settled_args): Cleanba's cleanba_ppo.py, cleanba_impala.py
ALGO_DEFAULTS = {
    "ppo": {"num_steps": 128, "learning_rate": 2.5e-4, "max_grad_norm": 0.5},
    "impala": {"num_steps": 20, "learning_rate": 6e-4, "max_grad_norm": 40.0},
}


def make_optimizer(args: Args, params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
    """Cleanba's: Adam for PPO, RMSprop for IMPALA."""
    if args.algo == "ppo":
        return torch.optim.Adam(params, lr=args.learning_rate, eps=args.adam_eps)
    return torch.optim.RMSprop(params, lr=args.learning_rate, alpha=args.rmsprop_alpha, eps=args.rmsprop_eps)


def ppo_update(model: nn.Module, data: Rollout, args: Args, generator) -> Iterator[dict[str, torch.Tensor]]:
    """Cleanba's PPO learner (cleanba_ppo.py `compute_gae`): GAE on the values the actor stored and a bootstrap value
    of the current parameters, then epochs x shuffled minibatches, each one's losses yielded for Learner.step."""
    with torch.no_grad():
        _, next_value = model(data.next_obs)
        advantages = gae(data.rewards, data.values, data.dones, next_value, args.gamma, args.gae_lambda)
        returns = advantages + data.values
    obs = data.obs.flatten(0, 1)  # [T * N, *obs_shape]
    actions, logprobs, advantages, returns = (x.reshape(-1) for x in (data.actions, data.logprobs, advantages, returns))
    mb_size = obs.shape[0] // args.num_minibatches
    coefs = (args.clip_coef, args.ent_coef, args.vf_coef, args.norm_adv)
    for _ in range(args.update_epochs):
        order = torch.randperm(obs.shape[0], generator=generator).to(obs.device)
        for start in range(0, mb_size * args.num_minibatches, mb_size):
            idx = order[start : start + mb_size]
            logits, new_value = model(obs.index_select(0, idx))  # whole rows; obs[idx] copies frames byte by byte
            new_logprob, entropy = logprob_entropy(logits, actions[idx])
            yield ppo_loss(new_logprob, logprobs[idx], advantages[idx], new_value, returns[idx], entropy, *coefs)


def impala_update(model: nn.Module, data: Rollout, args: Args, generator) -> Iterator[dict[str, torch.Tensor]]:
    """One pass over minibatches of whole unrolls (envs split in `num_minibatches`), V-trace at the current policy,
    each one's losses yielded for Learner.step."""
    T, N = data.rewards.shape
    envs_per_mb = N // args.num_minibatches
    order = torch.randperm(N, generator=generator).to(data.rewards.device)
    bars = (args.gamma, args.vtrace_rho_bar, args.vtrace_c_bar, args.vtrace_pg_rho_bar)
    for start in range(0, envs_per_mb * args.num_minibatches, envs_per_mb):
        cols = order[start : start + envs_per_mb]  # whole unrolls of a subset of envs
        B = len(cols)
        logits, values = model(torch.cat([data.obs[:, cols].flatten(0, 1), data.next_obs[cols]]))  # [T * B + B]
        values, next_value = values[: T * B].reshape(T, B), values[T * B :]
        target_logprob, entropy = logprob_entropy(logits[: T * B].reshape(T, B, -1), data.actions[:, cols])
        mu, rewards, dones = data.logprobs[:, cols], data.rewards[:, cols], data.dones[:, cols]
        vs, pg_adv = vtrace(mu, target_logprob.detach(), rewards, values.detach(), dones, next_value.detach(), *bars)
        yield impala_loss(target_logprob, entropy, values, vs, pg_adv, args.vf_coef, args.ent_coef)


# ---- Storage and messages ----


@dataclass
class Rollout:
    """T steps of N envs. Each actor thread owns two, preallocated and reused, and puts the one it filled in place on
    its rollout_Q (actor -> learner); the learner concatenates the threads' rollouts into one on its device."""

    TENSORS: ClassVar = ("obs", "actions", "logprobs", "values", "rewards", "dones", "next_obs")
    obs: torch.Tensor  # [T, N, *obs_shape], the observation each action was taken in
    actions: torch.Tensor  # [T, N]
    logprobs: torch.Tensor  # [T, N], log mu(a|s) of the behaviour policy
    values: torch.Tensor  # [T, N], V(s) of the parameters that acted (PPO's GAE, as Cleanba's cleanba_ppo.py)
    rewards: torch.Tensor  # [T, N], clipped training rewards
    dones: torch.Tensor  # [T, N], the episode (or training life) ended with this transition
    next_obs: torch.Tensor  # [N, *obs_shape], for the bootstrap value
    version: int = -1  # learner update count of the parameters that acted
    episodes: list[tuple[float, int]] = field(default_factory=list)  # (return, length) of the games that ended
    param_wait: float = 0.0  # seconds the actor blocked on param_Q.get before this rollout

    @staticmethod
    def allocate(T: int, N: int, obs_shape: tuple[int, ...], obs_dtype: torch.dtype) -> Rollout:
        floats = {k: torch.zeros((T, N)) for k in ("logprobs", "values", "rewards", "dones")}
        return Rollout(
            obs=torch.zeros((T, N, *obs_shape), dtype=obs_dtype),
            actions=torch.zeros((T, N), dtype=torch.long),
            next_obs=torch.zeros((N, *obs_shape), dtype=obs_dtype),
            **floats,
        )


class Params(NamedTuple):
    """learner -> actor on param_Q: the parameters after update `version`, copied flat so the learner can train on."""

    version: int
    flat: torch.Tensor


@dataclass
class Actor:
    """One actor thread's envs, policy copy, sampling generator, two rollout buffers and two size-1 queues."""

    index: int
    envs: gym.vector.VectorEnv
    model: nn.Module
    generator: torch.Generator
    buffers: tuple[Rollout, Rollout]
    param_q: queue.Queue[Params] = field(default_factory=lambda: queue.Queue(maxsize=1))
    rollout_q: queue.Queue[Rollout] = field(default_factory=lambda: queue.Queue(maxsize=1))
    error: str | None = None  # the error line and traceback of the thread, if it died


def flatten(tensors: Iterable[torch.Tensor]) -> torch.Tensor:
    """One flat copy, in logical (NCHW) order whatever the memory format (channels_last params included)."""
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def copy_flat_into(tensors: Iterable[torch.Tensor], flat: torch.Tensor) -> None:
    """Inverse of `flatten`, copying in place so each tensor keeps its device and memory format."""
    offset = 0
    for t in tensors:
        t.copy_(flat[offset : offset + t.numel()].view(t.shape), non_blocking=True)
        offset += t.numel()


def stack_rollouts(rollouts: list[Rollout], device: torch.device) -> Rollout:
    """The actor threads' rollouts concatenated along the env axis (no copy for one thread), on the learner device."""
    tensors = {k: [getattr(r, k) for r in rollouts] for k in Rollout.TENSORS}
    if len(rollouts) > 1:
        tensors = {k: [torch.cat(v, dim=0 if k == "next_obs" else 1)] for k, v in tensors.items()}
    return Rollout(**{k: v[0].to(device, non_blocking=True) for k, v in tensors.items()})


# ---- Actor threads ----


def sample_actions(logits: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
    """Gumbel-max sampling from a seeded generator (thread-safe, reproducible): [B, A] logits -> [B] actions."""
    u = torch.rand(logits.shape, generator=generator, device=logits.device).clamp_(min=1e-20)
    return torch.argmax(logits - torch.log(-torch.log(u)), dim=1)


def actor_thread(actor: Actor, device: torch.device, iterations: int, sync: bool, stop: threading.Event) -> None:
    """Figure 1 (right), `actor()`: get params (not at iteration 2), roll out, put the rollout."""
    # one intra-op thread for this actor's small inference batches (the setting is per thread): a second OpenMP team
    # would spin beside the learner's and slow it down
    torch.set_num_threads(1)
    params = [p.data for p in actor.model.parameters()]
    try:
        next_obs, _ = actor.envs.reset()
        for iteration in range(1, iterations + 1):
            start = time.perf_counter()
            if sync or iteration != 2:  # skipping the 2nd get is what lets rollout and learning overlap
                version, flat = blocking(actor.param_q.get, stop)
                copy_flat_into(params, flat)
            buf = actor.buffers[iteration % 2]  # the learner finished the other buffer before publishing `version`
            buf.param_wait = time.perf_counter() - start
            buf.version, buf.episodes = version, []
            for t in range(buf.obs.shape[0]):
                obs = torch.from_numpy(next_obs)
                buf.obs[t].copy_(obs)
                with torch.inference_mode():
                    logits, value = actor.model(obs.to(device, non_blocking=True))
                    actions = sample_actions(logits, actor.generator)
                    logprob = torch.log_softmax(logits, dim=1).gather(1, actions[:, None]).squeeze(1)  # mu(a|s)
                actions = actions.cpu()
                buf.actions[t].copy_(actions)
                buf.logprobs[t].copy_(logprob)
                buf.values[t].copy_(value)
                next_obs, reward, terminated, truncated, info = actor.envs.step(actions.numpy())
                buf.rewards[t].copy_(torch.from_numpy(reward))
                buf.dones[t].copy_(torch.from_numpy(terminated | truncated))
                buf.episodes += finished_episodes(info)
            buf.next_obs.copy_(torch.from_numpy(next_obs))
            blocking(actor.rollout_q.put, stop, buf)
    except Stop:
        pass
    except BaseException:
        actor.error = f"actor thread {actor.index} died:\n{traceback.format_exc()}"
        stop.set()
    finally:
        actor.envs.close()


def make_actors(args: Args, rank: int, device, network: str, obs_space, act_space, checkpoint) -> list[Actor]:
    """Every actor thread's envs, policy copy, generator and buffers. Env e of rank r has seed `seed + 10_000 r + e`
    whichever thread steps it, shifted on --resume so that the resumed run plays new episodes."""
    # a CPU learner's threads fill every core already while the actors roll out: with 2 cores and 1 actor thread, 1 env
    # thread instead of 2 ran 6-9% faster in each of 3 alternated rounds (RESULTS, "Against the peers' own code")
    sharers = args.num_actor_threads + (device.type == "cpu" and not args.sync)
    env_threads = args.env_threads or max(1, (os.cpu_count() or 1) // sharers)
    n = args.num_envs // args.num_actor_threads
    seed = args.seed + 10_000 * rank + (1_000_003 * checkpoint["update"] if checkpoint else 0)
    obs_dtype = torch.uint8 if obs_space.dtype == np.uint8 else torch.float32
    actors = []
    for i in range(args.num_actor_threads):
        generator = torch.Generator(device=device).manual_seed(args.seed * 104729 + 1000 * rank + i)
        if checkpoint:
            generator.set_state(checkpoint["actor_rngs"][i])
        envs = make_vector_env(args.env_id, n, seed + n * i, protocol=args.atari_protocol, num_threads=env_threads)
        # the Nature network infers faster contiguous on CPU and trains faster channels_last (common.models)
        model = make_model(obs_space, act_space, network, channels_last=network != "nature").to(device)
        buffers = (Rollout.allocate(args.num_steps, n, obs_space.shape, obs_dtype) for _ in range(2))
        actors.append(Actor(i, envs, model, generator, tuple(buffers)))
    return actors


# ---- Learner ----


class Learner:
    """The learner's state between updates (what a checkpoint holds) and its loop: take one rollout from every actor
    thread, step on the update's minibatch losses with gradients averaged over ranks, publish the new parameters."""

    def __init__(self, args: Args, model: nn.Module, actors: list[Actor], device, rank, world_size, meta, checkpoint):
        self.args, self.model, self.actors, self.device = args, model, actors, device
        self.rank, self.world_size, self.meta = rank, world_size, meta
        self.steps = 0  # optimizer steps of this process: the ranks' counts must agree at every all-reduce
        self.optimizer = make_optimizer(args, model.parameters())
        self.update_rule = ppo_update if args.algo == "ppo" else impala_update
        self.generator = torch.Generator().manual_seed(args.seed * 7919 + rank)
        self.steps_per_update = args.num_envs * args.num_steps * world_size
        self.num_updates = planned_updates(args.total_timesteps, self.steps_per_update)[0]
        self.update, self.global_step = 0, 0
        if checkpoint:
            model.load_state_dict(checkpoint["model"])
            self.optimizer.load_state_dict(checkpoint["optimizer"])
            self.update, self.global_step = checkpoint["update"], checkpoint["global_step"]
            self.generator.set_state(checkpoint["learner_rng"])

    def publish(self, stop: threading.Event) -> None:
        params = Params(self.update, flatten(self.model.parameters()))
        for actor in self.actors:
            blocking(actor.param_q.put, stop, params)

    def train(self, stop: threading.Event, requested: threading.Event) -> tuple[dict[str, float], list]:
        """One update; returns its TensorBoard scalars and the (return, length) of the games its rollouts ended.
        `stop` ends it at once; `requested` (a signal; under torchrun a rank's own) ends it where the ranks agree."""
        if self.args.learner_delay:
            time.sleep(self.args.learner_delay)
        start = time.perf_counter()
        rollouts = [blocking(actor.rollout_q.get, stop) for actor in self.actors]
        rollout_wait = time.perf_counter() - start
        self.update += 1
        lr = self.args.learning_rate * (1.0 - (self.update - 1) / self.num_updates if self.args.anneal_lr else 1.0)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        start = time.perf_counter()
        data = stack_rollouts(rollouts, self.device)
        metrics = []
        for losses in self.update_rule(self.model, data, self.args, self.generator):
            metrics.append(self.step(losses, stop, requested))
            if stop.is_set():  # an actor died or Ctrl+C: end here (checkpoint_state holds the last whole update)
                raise Stop
        scalars = {"charts/policy_lag": (self.update - 1) - rollouts[0].version, "charts/learning_rate": lr}
        mean = {k: torch.stack([m[k] for m in metrics]).mean().item() for k in metrics[0]}  # over the minibatches
        scalars |= {"losses/policy_loss": mean["policy_loss"], "losses/value_loss": mean["value_loss"],
                    "losses/entropy": mean["entropy"], "losses/total_loss": mean["total_loss"],
                    "losses/grad_norm": mean["grad_norm"]}  # fmt: skip
        if self.args.algo == "ppo":
            scalars |= {"losses/approx_kl": mean["approx_kl"], "losses/clipfrac": mean["clipfrac"]}
        scalars |= {"timing/rollout_queue_get": rollout_wait, "timing/train": time.perf_counter() - start}
        scalars["timing/param_queue_get"] = max(r.param_wait for r in rollouts)  # the slowest actor's
        self.global_step += self.steps_per_update
        return scalars, [episode for r in rollouts for episode in r.episodes]

    def step(self, losses: dict[str, torch.Tensor], stop: threading.Event, requested: threading.Event) -> dict:
        """One optimizer step; returns the detached losses and the gradient norm. Finiteness is checked after the
        all-reduce: a NaN on one rank reaches every rank's gradient norm there, so all ranks stop, none waits alone."""
        loss = losses["total_loss"]
        self.optimizer.zero_grad(set_to_none=False)
        loss.backward()
        self.steps += 1
        if self.world_size > 1:
            average_gradients(self, stop, requested)  # torchrun: the ranks' mean gradient (the end of the file)
        grad_norm = nn.utils.clip_grad_norm_(self.model.parameters(), self.args.max_grad_norm)
        if not (torch.isfinite(loss) & torch.isfinite(grad_norm)):  # one device sync for both
            raise NonFiniteLoss(f"non-finite loss {loss.item()} (gradient norm {grad_norm.item()})")
        self.optimizer.step()
        return {**{k: v.detach() for k, v in losses.items()}, "grad_norm": grad_norm}


# ---- Main ----


def main(args: Args) -> None:
    if (run := open_run(args)) is None:  # resume, validation, run directory, args.json, process group, seed, device
        return  # --eval-only played the saved agent
    args, device, rank, world_size, network = run.args, run.device, run.rank, run.world_size, run.meta["network"]
    model = make_model(*run.spaces, network).to(device)
    actors = make_actors(args, rank, device, network, *run.spaces, run.checkpoint)
    learner = Learner(args, model, actors, device, rank, world_size, run.meta, run.checkpoint)
    stop = threading.Event()  # ends the learner's and every actor thread's loop
    # a signal stops one process at once; under torchrun it is this rank's request, and the ranks stop together at
    # the all-reduce where they agree on it (average_gradients)
    requested = run.stop_on_signals(threading.Event() if world_size > 1 else stop).stop
    # rank 0, with --checkpoint-interval: the last whole update's state, the checkpoint a stop or a lost rank writes
    last = checkpoint_state(learner) if run.run_dir and args.checkpoint_interval else None
    remaining = learner.num_updates - learner.update
    work = (device, remaining, args.sync, stop)  # actor_thread's arguments after its Actor
    threads = [threading.Thread(target=actor_thread, args=(a, *work), name=f"actor-{a.index}", daemon=True)
               for a in actors]  # fmt: skip
    roles = (f"an update is {world_size} rank(s) x {args.num_envs} envs x {args.num_steps} steps; "
             f"{'sync' if args.sync else 'cleanba'} {args.algo}, {network} network")  # fmt: skip
    with run.training(roles, lambda: learner.global_step, functools.partial(stop_actors, learner, threads, stop),
                      checkpoint=last and (lambda: atomic_save(last, run.checkpoint_path)), window=20, threads=threads,
                      final_model=run.run_dir and (lambda: model), teardown=world_size == 1,  # rank 0's files
                      who=f"rank {rank}" if world_size > 1 else "the learner") as record:  # fmt: skip
        if record is not None:  # rank 0's; the ranks' envs all count in the global step
            record.writer.add_text("world_size", str(world_size))
        learner.publish(stop)  # the parameters of the actors' first rollout
        for thread in threads:
            thread.start()
        for j in range(1, remaining + 1):
            scalars, episodes = learner.train(stop, requested)
            if record is not None:
                record_update(record, learner, scalars, episodes)
            if last is not None:
                last = checkpoint_state(learner)
            run.checkpoint_if_due()
            if stop.is_set():  # a signal as the update ended, or an actor's error (stop_actors returns its line)
                raise Stop
            if j <= remaining - (1 if args.sync else 2):  # only parameters an actor will read (it skips its 2nd get)
                learner.publish(stop)


# ---- Multi-node (torchrun): the gradient all-reduce of Learner.step --------------------------------------------------


def average_gradients(learner: Learner, stop: threading.Event, requested: threading.Event) -> None:
    """Learner.step under torchrun: the ranks' mean gradient, in one all-reduce that also carries each rank's step
    count and stop request (a slot per rank). Ranks whose counts differ are out of step (a rank-local decision changed
    the number of steps), and a stop requested on any rank stops every rank here, at the same step."""
    W, r = learner.world_size, learner.rank
    grads = [p.grad for p in learner.model.parameters()]
    tail = torch.zeros(2 * W, device=learner.device)
    tail[r], tail[W + r] = learner.steps, float(requested.is_set())
    flat = flatten([*grads, tail])
    work = dist.all_reduce(flat, async_op=True)
    wait_for_ranks(work, f"the all-reduce of update {learner.update}", requested, r, W, learner.args.rank_timeout)
    steps, stops = flat[-2 * W : -W].tolist(), flat[-W:].tolist()
    if len(set(steps)) > 1:
        at = ", ".join(f"rank {i} at step {int(s)}" for i, s in enumerate(steps))
        raise RankLost(f"rank {r}: the ranks are out of step at the all-reduce of update {learner.update} ({at}): "
                       "each must take the same optimizer steps")  # fmt: skip
    if any(stops):
        stop.set()
        raise Stop
    copy_flat_into(grads, flat.div_(W))


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
    (">= 1", ("total_timesteps", "num_envs", "num_actor_threads", "num_steps", "num_minibatches", "update_epochs")),
    (">= 0", ("seed", "checkpoint_interval", "learner_delay", "log_interval", "eval_episodes", "env_threads",
              "torch_threads", "clip_coef", "ent_coef", "vf_coef")),
    ("> 0", ("learning_rate", "max_grad_norm", "adam_eps", "rmsprop_eps", "vtrace_rho_bar", "vtrace_c_bar",
             "vtrace_pg_rho_bar", "rank_timeout")),
    ("in (0, 1]", ("gamma",)),
    ("in [0, 1]", ("gae_lambda", "rmsprop_alpha")),
)  # fmt: skip
RENAMED_FLAGS: dict[str, str] = {}  # old flag -> what to say instead
# the run's shape: the envs and actor threads lay out the buffers, env seeds and saved generators, and an update's
# agent steps (envs x steps) are the unit of the saved update count and of the learning-rate schedule
RESUME_FIXED = ("num_envs", "num_actor_threads", "num_steps")
RUN_SETTINGS = ("env_id", "atari_protocol", "algo", "network")


def validate(args: Args, world_size: int = 1) -> str | None:
    """Every flag checked before anything is spawned (after settled_args); returns the error line or None."""
    if error := check_flags(args):
        return error
    n, threads, minibatches = args.num_envs, args.num_actor_threads, args.num_minibatches
    if n % threads:
        return f"--num-envs ({n}) must be a multiple of --num-actor-threads ({threads})"
    if args.algo == "ppo" and n * args.num_steps < minibatches:
        return f"a rollout of {n * args.num_steps} samples cannot fill --num-minibatches {minibatches}"
    if args.algo == "impala" and n < minibatches:
        return f"IMPALA minibatches are whole unrolls: --num-envs ({n}) must be >= --num-minibatches ({minibatches})"
    if args.total_timesteps < (rollout := n * args.num_steps * world_size):
        ranks = f" x {world_size} ranks" if world_size > 1 else ""
        return (f"--total-timesteps {args.total_timesteps} is below one update, {rollout} agent steps (--num-envs x "
                f"--num-steps{ranks}): the run would learn nothing; give at least {rollout}")  # fmt: skip
    if args.capture_video and args.eval_episodes == 0 and args.eval_only is None:
        return "--capture-video records the evaluation episodes; add --eval-episodes N (N >= 1)"
    if args.resume is not None and args.eval_only is not None:
        return "--eval-only trains nothing, so --resume would be ignored: give one of them"
    if args.resume is not None and not Path(args.resume).is_file():
        return f"--resume {args.resume}: no such checkpoint file"
    if args.eval_only is not None and world_size > 1:
        return "--eval-only runs in one process: python cleanba_ppo_impala.py --eval-only PATH, without torchrun"
    if args.eval_only is not None:  # the env and the network are the saved run's: main_eval_only checks them
        return None if Path(args.eval_only).is_file() else f"--eval-only {args.eval_only}: no such file"
    try:
        space = env_spaces(args)[1]  # an unknown env id: make_vector_env's error line suggests close matches
        if args.capture_video:  # fail now, not at the final evaluation
            check_video(args.env_id, args.atari_protocol)
    except EnvError as e:
        return str(e)
    if not isinstance(space, gym.spaces.Discrete):  # the policy is categorical
        has = f"{args.env_id} has a {type(space).__name__} action space {space}"
        return f"{has}; cleanba_ppo_impala.py needs a Discrete one (continuous actions: apex_ddpg.py)"
    return check_resume_world_size(args.resume, world_size) if args.resume else None


def env_spaces(args: Args):
    probe = make_vector_env(args.env_id, 1, args.seed, protocol=args.atari_protocol, num_threads=1)
    probe.close()  # its spaces outlive it
    return probe.single_observation_space, probe.single_action_space


def checkpoint_meta(args: Args, obs_space, act_space, world_size: int = 1) -> dict:
    """What a checkpoint was trained on, `auto` resolved (Cleanba's IMPALA ResNet on images with either algorithm, an
    MLP on flat observations): --resume refuses one whose script, algo, env, Atari protocol, network, shapes or world
    size differ (an update is every rank's envs x steps: the saved update count and the learning-rate schedule count
    in it)."""
    network = args.network if args.network != "auto" else ("impala" if len(obs_space.shape) == 3 else "mlp")
    return dict(script=Path(__file__).name, algo=args.algo, env_id=args.env_id, atari_protocol=args.atari_protocol,
                network=network, obs_shape=list(obs_space.shape), action_shape_or_n=int(act_space.n),
                world_size=world_size)  # fmt: skip


def settled_args(args: Args) -> Args:
    """--algo's defaults (ALGO_DEFAULTS) for the flags left None; the names of the flags the command line gave kept."""
    settled = replace(args, **{k: v for k, v in ALGO_DEFAULTS[args.algo].items() if getattr(args, k) is None})
    if hasattr(args, "given"):  # the flags the command line gave (parse_args), which --eval-only checks
        settled.given = args.given
    return settled


def steps_per_update(args: Args, world_size: int) -> int:
    """Agent steps of one update: every rank's envs x --num-steps (the Learner's arithmetic)."""
    return args.num_envs * args.num_steps * world_size


def check_resume_world_size(path: str, world_size: int) -> str | None:
    """--resume under another world size than the run's (its args.json meta): the error line, naming both and the
    launch that continues it (load_checkpoint's meta check is the guarantee; this says how to relaunch)."""
    try:
        saved = json.loads((Path(path).parent / "args.json").read_text())["meta"]["world_size"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if saved == world_size:
        return None
    script = Path(__file__).name
    now = f"{world_size} torchrun ranks (world size {world_size})" if world_size > 1 else "one process (world size 1)"
    was = f"{saved} torchrun ranks (world size {saved})" if saved > 1 else "one process (world size 1)"
    how = (f"torchrun --nproc-per-node {saved} {script} --resume {path} (or --nnodes x --nproc-per-node = {saved})"
           if saved > 1 else f"python {script} --resume {path}, without torchrun")  # fmt: skip
    return (f"cannot resume from {path} under {now}: its run had {was}, and an update is every rank's envs x steps; "
            f"relaunch it as it ran: {how}")  # fmt: skip


def saved_model(args: Args, settings: dict, state_dict: dict) -> nn.Module:
    """--eval-only: the saved run's network (`auto` as that run resolved it) for its env, with the saved parameters."""
    model = make_model(*env_spaces(args), settings["network"])
    model.load_state_dict(state_dict)
    return model


def evaluate(model: nn.Module, args: Args, video_dir: Path, device: torch.device) -> Iterator[float]:
    """Play `eval_episodes` full games with the final (or --eval-only's saved) policy, true returns; sampled actions,
    argmax ones with --eval-greedy; videos to `video_dir` with --capture-video."""
    seed = args.seed + 1_000_003
    env = make_env(
        args.env_id, seed, protocol=args.atari_protocol, capture_video=args.capture_video, video_dir=str(video_dir)
    )
    generator = torch.Generator(device=device).manual_seed(seed)
    played = 0
    obs, _ = env.reset()
    while played < args.eval_episodes:
        with torch.inference_mode():
            logits, _ = model(torch.as_tensor(obs[None], device=device))
        action = logits.argmax(dim=1) if args.eval_greedy else sample_actions(logits, generator)
        obs, _, terminated, truncated, info = env.step(int(action[0]))
        if terminated or truncated:
            played += 1
            yield float(info["episode"]["r"])
            if played < args.eval_episodes:  # no reset after the last game: it would record an empty video
                obs, _ = env.reset()
    env.close()


def ranks_agree(model: nn.Module, rank: int, world_size: int) -> str | None:
    """After a finished multi-rank run every rank must hold rank 0's parameters (identical averaged gradients).
    Returns the error line if they diverged; leaves the process group."""
    flat = flatten(model.parameters())
    reference = flat.clone()
    dist.broadcast(reference, src=0)
    divergence = (flat - reference).abs().max()
    dist.all_reduce(divergence, op=dist.ReduceOp.MAX)
    if rank == 0:
        print(f"max |parameter difference| across {world_size} ranks: {divergence.item():.3g}")
    dist.barrier()  # no rank leaves the group while a peer may still be sending to it
    dist.destroy_process_group()
    return f"error: ranks diverged (max parameter difference {divergence.item():.3g})" if divergence > 0 else None


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


def init_torch(args: Args, spaces: tuple[gym.Space, gym.Space], rank: int, world_size: int) -> torch.device:
    """This rank's device; under torchrun the launcher's watch and the process group; torch's threads, seed and
    determinism settings."""
    watch_launcher()
    use_cuda = args.cuda and torch.cuda.is_available()
    device = torch.device(f"cuda:{int(os.environ.get('LOCAL_RANK', '0'))}" if use_cuda else "cpu")
    if world_size > 1:  # collectives fail after a bounded wait for a peer (gloo's default: 30 min); the learner's
        timeout = datetime.timedelta(seconds=args.rank_timeout + 30)  # own wait names the peer first (wait_for_ranks)
        dist.init_process_group("nccl" if use_cuda else "gloo", rank=rank, world_size=world_size, timeout=timeout)
    if args.torch_threads:
        torch.set_num_threads(args.torch_threads)
    torch.manual_seed(args.seed)  # identical initial parameters on every rank
    torch.backends.cudnn.deterministic = args.torch_deterministic
    torch.use_deterministic_algorithms(args.torch_deterministic, warn_only=True)
    # deterministic mode would also fill every new tensor with NaN: nothing here reads uninitialised memory, and the
    # fill is a large share of the learner's time on CPU
    torch.utils.deterministic.fill_uninitialized_memory = False
    return device


def stop_actors(learner: Learner, threads: list[threading.Thread], stop: threading.Event, graceful: bool) -> str | None:
    """Main's stop: the actor threads joined within 8 s (each wait wakes within a second, a rollout ends within
    seconds); the error line of one that died, else, at the end of a finished run of several ranks, ranks_agree's."""
    stop.set()
    deadline = time.time() + 8.0
    for thread in (t for t in threads if t.ident is not None):  # started: the record may fail before they start
        thread.join(timeout=max(0.0, deadline - time.time()))
    if error := next((a.error for a in learner.actors if a.error), None):
        return error
    finished = learner.update == learner.num_updates  # on every rank, or on none: a stop is agreed at an all-reduce
    if graceful and finished and learner.world_size > 1:
        return ranks_agree(learner.model, learner.rank, learner.world_size)
    return None


def record_update(record: Recorder, learner: Learner, scalars: dict[str, float], episodes: list) -> None:
    """Every update's games and scalars to TensorBoard; the console line with its policy lag and queue waits."""
    step, lag = learner.global_step, scalars["charts/policy_lag"]
    record.games((step, ret, length) for ret, length in episodes)
    record.add(scalars)
    record.point(step)
    waits = f"rollout_wait={scalars['timing/rollout_queue_get']:.3f} param_wait={scalars['timing/param_queue_get']:.3f}"
    record.line(step, f"update={learner.update}/{learner.num_updates} policy_lag={lag} {waits}",
                now=learner.update == learner.num_updates)  # fmt: skip


def checkpoint_state(learner: Learner) -> dict:
    """A copy of everything a checkpoint holds, taken between updates (a stop may cut the next update half way)."""
    state = dict(model=learner.model.state_dict(), optimizer=learner.optimizer.state_dict(), args=asdict(learner.args))
    state.update(update=learner.update, global_step=learner.global_step, meta=learner.meta)
    state.update(
        learner_rng=learner.generator.get_state(), actor_rngs=[a.generator.get_state() for a in learner.actors]
    )
    return copy.deepcopy(state)


if __name__ == "__main__":
    main(parse_args(sys.argv[1:]))
