"""A3C: asynchronous advantage actor-critic (Mnih et al., "Asynchronous methods for deep reinforcement learning",
ICML 2016), in the large-batch variant of Stooke and Abbeel (2018) that the GALA paper (Assran et al., NeurIPS 2019)
uses as its baseline (Appendix C.1, hyperparameters of Table 2), and as originally proposed (1 simulator per worker).

Architecture: `--num-workers` worker processes, each stepping `--num-envs-per-worker` simulators (16: large batch;
1: original A3C) with one batched forward pass per step on its device. A worker loops, with no synchronisation
between workers: pull the latest shared parameters, take N = `--num-steps` steps, compute n-step returns and the A2C
gradient (clipped to `--max-grad-norm`), push it to the shared model, repeat.
- `--update hogwild` (Mnih et al. 2016): parameters and RMSprop statistics live in shared memory; each worker applies
  its own gradient to them lock-free (Recht et al. 2011). Pull = copy the shared parameters into the local model.
- `--update server` (the push-pull gradient server): a server process owns the model and optimizer (on the GPU when
  there is one: the only mode that keeps a single model there). Workers write gradients into two preallocated
  shared-memory slots each and put (worker, slot, pulled version) on `grad_q`; the server applies gradients in arrival
  order and publishes versioned parameters (a flat shared buffer under a lock, version += 1 per gradient).
Only the main process writes TensorBoard: workers (hogwild) or the server send one small record per update on
`log_q`; it also watches every process and stops the run when one dies.
Policy lag (`charts/policy_lag`): updates applied to the shared model between a worker's pull and its gradient's
  application; unbounded in principle, it grows with the number of workers (and, in server mode, includes the worker's
  own earlier pushes still queued). One hogwild worker has lag 0.
Determinism: none across runs with several workers or in server mode (arrival order is the hardware's); one hogwild
  worker with `--torch-deterministic` on CPU is reproducible.

Examples:
  python a3c_large_batch.py --env-id ALE/Breakout-v5                                  # 4 workers x 16 envs, hogwild
  python a3c_large_batch.py --env-id ALE/Breakout-v5 --update server --num-workers 8
  python a3c_large_batch.py --env-id ALE/Pong-v5 --num-workers 16 --num-envs-per-worker 1    # original A3C
"""

from __future__ import annotations

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

from common.atari import PROTOCOLS, EnvError, check_env_args, finished_episodes, make_env, make_vector_env
from common.models import NETWORKS, make_model

UPDATE_MODES = ("hogwild", "server")
OPTIMIZERS = ("rmsprop", "sgd")


@dataclass
class Args:
    exp_name: str = Path(__file__).stem
    """name of this experiment (part of the run directory)"""
    seed: int = 1
    """seed of the experiment"""
    torch_deterministic: bool = True
    """use deterministic torch algorithms"""
    cuda: bool = True
    """use a GPU for the workers' inference and the server's model when one is present"""
    env_id: str = "ALE/Breakout-v5"
    """gymnasium id; ALE ids run in ale-py's C++ vector env"""
    atari_protocol: str = "deepmind"
    """ALE preprocessing: `deepmind` (the GALA paper's Table 2 setting) or `machado`"""
    total_timesteps: int = 10_000_000
    """agent steps summed over all envs of all workers"""
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
    eval_greedy: bool = True
    """evaluate with argmax actions (GALA Table 1's protocol for A3C); `--no-eval-greedy` samples from the policy"""
    capture_video: bool = False
    """record videos of the evaluation episodes to {run_dir}/videos"""
    network: str = "auto"
    """`nature` (GALA Appendix C.2), `impala`, `mlp`, or `auto` (nature for frames, mlp for flat observations)"""

    update: str = "hogwild"
    """`hogwild` (lock-free shared parameters and RMSprop statistics) or `server` (a gradient server process)"""
    num_workers: int = 4
    """worker processes (4 x 16 = the 64 simulators of GALA's Figure 4)"""
    num_envs_per_worker: int = 16
    """simulators per worker, stepped together with batched inference (16: Stooke & Abbeel; 1: original A3C)"""
    torch_threads: int = 1
    """torch intra-op threads per process (the process count already uses the cores)"""
    # GALA Table 2 (A2C, GALA-A2C and A3C)
    num_steps: int = 5
    """horizon N: steps per env between pushes"""
    learning_rate: float = 7e-4
    """base learning rate (Table 2: no scaling with the number of learners for A3C)"""
    anneal_lr: bool = False
    """linearly anneal the learning rate to 0 over the run (Table 2 lists no schedule)"""
    optimizer: str = "rmsprop"
    """`rmsprop` (Table 2) or `sgd` (plain p -= lr g, for checks)"""
    rmsprop_alpha: float = 0.99
    """RMSprop smoothing constant (Table 2: 0.99, momentum 0)"""
    rmsprop_eps: float = 1e-3
    """RMSprop epsilon, added outside the square root as in PyTorch (GALA's implementation language), where Table 2's
    0.01 turns the clipped gradients' steps into small plain-SGD steps and Pong does not learn, and GALA's code's 1e-5
    lets 4 hogwild workers' first, stale steps kill the ReLUs; 1e-4 and 1e-3 learn (README)"""
    max_grad_norm: float = 0.5
    """clip each pushed gradient to this global norm"""
    ent_coef: float = 0.01
    """entropy bonus coefficient"""
    vf_coef: float = 0.5
    """value loss coefficient"""
    gamma: float = 0.99
    """discount factor"""
    log_frequency: int = 10
    """updates per TensorBoard point for losses, lag and timings (averaged over them); episodes are all logged"""
    log_interval: float = 10.0
    """seconds between console lines"""


# ----------------------------------------------------------------------------------------------------------------
# Pure algorithm functions
# ----------------------------------------------------------------------------------------------------------------


def n_step_returns(rewards: torch.Tensor, dones: torch.Tensor, bootstrap: torch.Tensor, gamma: float) -> torch.Tensor:
    """R_t = r_t + gamma r_{t+1} + ... + gamma^{N-t} V(s_N), cut at episode ends (Mnih et al. 2016, Algorithm S3).

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
    """Gumbel-max sampling from a seeded generator: [B, A] logits -> [B] actions."""
    u = torch.rand(logits.shape, generator=generator, device=logits.device).clamp_(min=1e-20)
    return torch.argmax(logits - torch.log(-torch.log(u)), dim=1)


def a2c_loss(
    logits: torch.Tensor, values: torch.Tensor, actions: torch.Tensor, returns: torch.Tensor, ent_coef, vf_coef
) -> dict[str, torch.Tensor]:
    """The A2C/A3C loss on a [M] batch: -log pi(a|s) (R - V) - ent_coef H(pi) + vf_coef (R - V)^2, means over M
    (Mnih et al. 2016, Algorithm S3; the value loss is the mean squared error, as in baselines' A2C behind Table 2)."""
    logp_all = torch.log_softmax(logits, dim=-1)  # [M, A]
    logp = logp_all.gather(-1, actions[:, None]).squeeze(-1)  # [M]
    entropy = -(logp_all.exp() * logp_all).sum(-1).mean()
    advantages = (returns - values).detach()
    policy_loss = -(logp * advantages).mean()
    value_loss = ((returns - values) ** 2).mean()
    total = policy_loss - ent_coef * entropy + vf_coef * value_loss
    return dict(total_loss=total, policy_loss=policy_loss, value_loss=value_loss, entropy=entropy)


class SharedRMSprop:
    """RMSprop without momentum (Table 2), or plain SGD, over a list of parameter tensors, with its statistics in
    tensors that `share_memory()` moves to shared memory. Hogwild workers call `step` on the shared parameters
    concurrently and lock-free (Mnih et al. 2016, Section 4: "RMSProp with shared statistics"); the gradient server
    calls it on its own model. Update: v = alpha v + (1 - alpha) g^2; p -= lr g / (sqrt(v) + eps), the eps *outside*
    the square root like torch.optim.RMSprop (GALA is a PyTorch implementation; TensorFlow and baselines put it
    inside, sqrt(v + eps), which with eps = 0.01 damps steps far more)."""

    def __init__(self, params: list[torch.Tensor], kind: str = "rmsprop", alpha: float = 0.99, eps: float = 1e-3):
        self.params, self.kind, self.alpha, self.eps = list(params), kind, alpha, eps
        self.square_avg = [torch.zeros_like(p) for p in self.params] if kind == "rmsprop" else []

    def share_memory(self) -> SharedRMSprop:
        for s in self.square_avg:
            s.share_memory_()
        return self

    @torch.no_grad()
    def step(self, grads: list[torch.Tensor], lr: float) -> None:
        for i, (p, g) in enumerate(zip(self.params, grads, strict=True)):
            g = g.to(p.device)  # blocking: a non_blocking copy to the CPU may still be in flight when read below
            if self.kind == "sgd":
                p.add_(g, alpha=-lr)
                continue
            v = self.square_avg[i]
            v.mul_(self.alpha).addcmul_(g, g, value=1.0 - self.alpha)
            p.addcdiv_(g, v.sqrt().add_(self.eps), value=-lr)

    def state_dict(self) -> dict:
        return dict(kind=self.kind, square_avg=[s.detach().cpu().clone() for s in self.square_avg])

    def load_state_dict(self, state: dict) -> None:
        for s, saved in zip(self.square_avg, state["square_avg"], strict=True):
            s.copy_(saved)


def make_optimizer(params: list[torch.Tensor], args: Args) -> SharedRMSprop:
    """The optimizer of `--optimizer` on these parameters (the hogwild workers' shared one, or the server's)."""
    return SharedRMSprop(params, args.optimizer, args.rmsprop_alpha, args.rmsprop_eps)


def flatten(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One flat copy, in logical (NCHW) order whatever the memory format."""
    return torch.cat([t.detach().reshape(-1) for t in tensors])


def copy_into_flat(flat: torch.Tensor, tensors: list[torch.Tensor]) -> None:
    """`flat.copy_(flatten(tensors))` without the temporary."""
    offset = 0
    for t in tensors:
        flat[offset : offset + t.numel()].view(t.shape).copy_(t)  # blocking: the reader is another process
        offset += t.numel()


def copy_flat_into(tensors: list[torch.Tensor], flat: torch.Tensor) -> None:
    """Inverse of `flatten`, in place, so each tensor keeps its device and memory format."""
    offset = 0
    for t in tensors:
        t.copy_(flat[offset : offset + t.numel()].view(t.shape), non_blocking=True)
        offset += t.numel()


# ----------------------------------------------------------------------------------------------------------------
# Shared state, pull/push, and the process bodies
# ----------------------------------------------------------------------------------------------------------------


class Stop(Exception):
    """Raised inside a process when the run is shutting down."""


class NonFiniteLoss(RuntimeError):
    pass


@dataclass
class Shared:
    """Everything the processes share (handed over at process start; tensors and locks live in shared memory)."""

    stop: object  # mp.Event: the run is shutting down
    log_q: object  # mp.Queue -> main: ("update", ...), ("done", worker), ("server_done", version)
    error_q: object  # mp.Queue -> main: "<who> died:\n<traceback>"
    steps_claimed: object  # mp.Value int64: agent steps handed out to rollouts (the budget counter)
    parent_pid: int
    # hogwild
    params: list | None = None  # shared-memory parameters of the model
    optimizer: SharedRMSprop | None = None
    updates: object | None = None  # mp.Value int64: gradients applied so far (the parameters' version)
    # server
    grad_q: object | None = None  # mp.Queue workers/main -> server: ("grad", ...), ("save", ...), ("stop", ...)
    grad_slots: torch.Tensor | None = None  # [W, 2, P] shared gradient slots
    free_slots: list | None = None  # per worker mp.Queue of free slot indices (0, 1)
    published: torch.Tensor | None = None  # [P] latest parameters
    version: object | None = None  # mp.Value int64: version of `published` = gradients applied
    param_lock: object | None = None  # guards (published, version) so a pull never mixes two versions


def should_stop(shared: Shared) -> bool:
    """The run is stopping, or the main process is gone (then no one would ever tell us)."""
    return shared.stop.is_set() or os.getppid() != shared.parent_pid


def blocking_get(q, shared: Shared):
    """`q.get()` that gives up when the run stops (wakes once a second to look; no busy wait)."""
    while True:
        try:
            return q.get(timeout=1.0)
        except queue.Empty:
            if should_stop(shared):
                raise Stop from None


def claim_steps(shared: Shared, batch: int, total: int) -> int:
    """Reserve the agent steps of one rollout within the budget; returns the global step it ends at, 0 if none left."""
    with shared.steps_claimed.get_lock():
        end = shared.steps_claimed.value + batch
        if end > total:
            return 0
        shared.steps_claimed.value = end
        return end


@torch.no_grad()
def pull(shared: Shared, params: list[torch.Tensor]) -> int:
    """Copy the latest shared parameters into `params`; returns their version (gradients applied so far)."""
    if shared.grad_q is None:  # hogwild: whatever is in shared memory now (other workers may be mid-write)
        version = shared.updates.value
        for local, p in zip(params, shared.params, strict=True):
            local.copy_(p, non_blocking=True)
        return version
    with shared.param_lock:
        version = shared.version.value
        copy_flat_into(params, shared.published)
    return version


def push_hogwild(shared: Shared, grads: list[torch.Tensor], lr: float) -> int:
    """Apply a gradient to the shared parameters, lock-free; returns the version this update made."""
    shared.optimizer.step(grads, lr)
    with shared.updates.get_lock():  # the counter only, not the parameters
        shared.updates.value += 1
        return shared.updates.value


def push_server(shared: Shared, worker: int, grads: list[torch.Tensor], message: tuple) -> None:
    """Write a gradient into a free slot of this worker and queue it for the server (returns before it is applied)."""
    slot = blocking_get(shared.free_slots[worker], shared)  # a free slot: the server applied this slot's last gradient
    copy_into_flat(shared.grad_slots[worker, slot], grads)
    shared.grad_q.put(("grad", worker, slot, *message))


def die_with_parent(parent_pid: int) -> None:
    """Linux: the kernel kills this process when the main process dies, even by kill -9, so no child outlives the run.
    The main process may have died before prctl ran: then exit at once."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # no prctl (not Linux)
        pass
    if os.getppid() != parent_pid:
        os._exit(0)


def worker_process(worker: int, args: Args, shared: Shared, device_name: str) -> None:
    """Run `worker_loop`, reporting any exception with its traceback to the main process."""
    die_with_parent(shared.parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the main process coordinates Ctrl+C / SIGTERM
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})  # blocked by main around start()
    try:
        worker_loop(worker, args, shared, torch.device(device_name))
    except Stop:
        pass
    except NonFiniteLoss as e:
        shared.error_q.put(f"error: worker {worker}: {e}; stopping (the last checkpoint, if any, is kept)")
        raise SystemExit(1) from None
    except BaseException:
        shared.error_q.put(f"error: worker {worker} died:\n{traceback.format_exc()}")
        raise SystemExit(1) from None


def worker_loop(worker: int, args: Args, shared: Shared, device: torch.device) -> None:
    """Mnih et al. 2016, Algorithm S3, for a batch of `num_envs_per_worker` simulators."""
    torch.set_num_threads(args.torch_threads)
    torch.use_deterministic_algorithms(args.torch_deterministic, warn_only=True)
    n, T = args.num_envs_per_worker, args.num_steps
    start_step = shared.steps_claimed.value  # > 0 after --resume: fresh action noise, not a replay
    envs = make_vector_env(
        args.env_id, n, args.seed + 10_000 * worker + start_step, protocol=args.atari_protocol, num_threads=1
    )
    try:
        model = make_model(envs.single_observation_space, envs.single_action_space, args.network).to(device)
        params = list(model.parameters())
        generator = torch.Generator(device=device).manual_seed(args.seed * 104729 + worker + start_step)
        obs_space = envs.single_observation_space
        obs_dtype = torch.uint8 if obs_space.dtype == np.uint8 else torch.float32
        obs_buf = torch.zeros((T + 1, n, *obs_space.shape), dtype=obs_dtype, device=device)  # [T+1, B, ...]
        actions = torch.zeros((T, n), dtype=torch.long, device=device)
        rewards, dones = torch.zeros((T, n)), torch.zeros((T, n))
        next_obs, _ = envs.reset()
        obs_buf[0].copy_(torch.from_numpy(next_obs))
        batch = n * T
        while not should_stop(shared):
            global_step = claim_steps(shared, batch, args.total_timesteps)
            if not global_step:
                break
            t0 = time.perf_counter()
            version = pull(shared, params)
            t1 = time.perf_counter()
            episodes = []
            for t in range(T):
                with torch.inference_mode():
                    logits, _ = model(obs_buf[t])
                    actions[t] = sample_actions(logits, generator)
                next_obs, reward, terminated, truncated, info = envs.step(actions[t].cpu().numpy())
                obs_buf[t + 1].copy_(torch.from_numpy(next_obs), non_blocking=True)
                rewards[t].copy_(torch.from_numpy(reward))
                dones[t].copy_(torch.from_numpy(terminated | truncated))
                episodes += finished_episodes(info)
            t2 = time.perf_counter()
            # the A2C gradient: one batched forward over the T x B observations (+ the bootstrap ones), backward
            logits, values = model(obs_buf.reshape(-1, *obs_space.shape))
            values = values.reshape(T + 1, n)
            returns = n_step_returns(rewards.to(device), dones.to(device), values[T].detach(), args.gamma)
            losses = a2c_loss(
                logits[: T * n], values[:T].reshape(-1), actions.reshape(-1), returns.reshape(-1), args.ent_coef,
                args.vf_coef,
            )  # fmt: skip
            if not torch.isfinite(losses["total_loss"]):
                raise NonFiniteLoss(f"non-finite loss {losses['total_loss'].item()} at global step {global_step}")
            model.zero_grad(set_to_none=False)
            losses["total_loss"].backward()
            grad_norm = nn.utils.clip_grad_norm_(params, args.max_grad_norm)
            if not torch.isfinite(grad_norm):
                raise NonFiniteLoss(f"non-finite gradient norm at global step {global_step}")
            stats = tuple(torch.stack([*(losses[k].detach() for k in LOSS_NAMES[:4]), grad_norm]).tolist())
            lr = args.learning_rate
            if args.anneal_lr:
                lr *= 1.0 - (global_step - batch) / args.total_timesteps
            obs_buf[0].copy_(obs_buf[T])
            t3 = time.perf_counter()
            grads = [p.grad for p in params]
            if shared.grad_q is None:
                new_version = push_hogwild(shared, grads, lr)
                t4 = time.perf_counter()
                timing = (t1 - t0, t2 - t1, t3 - t2, t4 - t3)
                lag = new_version - 1 - version  # updates that landed between this pull and this update
                shared.log_q.put(("update", worker, batch, new_version, lag, lr, stats, episodes, timing))
            else:
                push_server(shared, worker, grads, (version, batch, lr, stats, episodes, (t1 - t0, t2 - t1, t3 - t2)))
        shared.log_q.put(("done", worker))
    finally:
        envs.close()


LOSS_NAMES = ("policy_loss", "value_loss", "entropy", "total_loss", "grad_norm")
# seconds per update: the worker's pull, rollout, gradient; then its lock-free apply (hogwild) or the server's apply
TIMING_NAMES = {"hogwild": ("pull", "rollout", "train", "push"), "server": ("pull", "rollout", "train", "server_apply")}


def gradient_server(model: nn.Module, args: Args, shared: Shared, device_name: str, state: dict | None) -> None:
    """The push-pull gradient server: apply gradients in arrival order, publish versioned parameters."""
    die_with_parent(shared.parent_pid)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        torch.set_num_threads(args.torch_threads)
        server_loop(model, args, shared, torch.device(device_name), state or {})
    except Stop:
        pass
    except WriteError as e:
        shared.error_q.put(f"{e}; stopping (the last good checkpoint is kept)")
        raise SystemExit(1) from None
    except BaseException:
        shared.error_q.put(f"error: gradient server died:\n{traceback.format_exc()}")
        raise SystemExit(1) from None


def server_loop(model: nn.Module, args: Args, shared: Shared, device: torch.device, state: dict) -> None:
    model = model.to(device)
    params = list(model.parameters())
    optimizer = make_optimizer(params, args)
    if "optimizer" in state:
        optimizer.load_state_dict(state["optimizer"])
    grads = [torch.zeros_like(p) for p in params]
    global_step = state.get("global_step", 0)
    while True:
        try:
            message = shared.grad_q.get(timeout=1.0)
        except queue.Empty:
            if os.getppid() != shared.parent_pid:
                raise Stop from None
            continue  # the main process ends the server with a "stop" message, after the workers
        kind = message[0]
        if kind == "grad":
            _, worker, slot, pulled, steps, lr, stats, episodes, timing = message
            t0 = time.perf_counter()
            copy_flat_into(grads, shared.grad_slots[worker, slot])
            shared.free_slots[worker].put(slot)  # copied out: the worker may write this slot again
            optimizer.step(grads, lr)
            flat = flatten(params).cpu()
            with shared.param_lock:
                shared.published.copy_(flat)
                shared.version.value += 1
                version = shared.version.value
            global_step += steps
            timing = (*timing, time.perf_counter() - t0)
            shared.log_q.put(("update", worker, steps, version, version - 1 - pulled, lr, stats, episodes, timing))
        elif kind == "save":  # ("save", path, extra): a checkpoint of the model and optimizer this process owns
            _, path, extra = message
            state = dict(model={k: v.cpu() for k, v in model.state_dict().items()}, optimizer=optimizer.state_dict())
            atomic_save({**state, "global_step": global_step, "version": shared.version.value, **extra}, Path(path))
        elif kind == "stop":  # after every queued gradient (FIFO): each one is applied exactly once
            _, path, extra = message
            if path is not None:
                shared.grad_q.put(("save", path, extra))
                shared.grad_q.put(("stop", None, None))
                continue
            shared.log_q.put(("server_done", shared.version.value))
            return


# ----------------------------------------------------------------------------------------------------------------
# Setup helpers: validation, checkpoints, evaluation
# ----------------------------------------------------------------------------------------------------------------


def validate(args: Args) -> str | None:
    """Every flag checked before anything is spawned; returns the error line or None."""
    for name, value in asdict(args).items():
        if isinstance(value, float) and not math.isfinite(value):
            return f"--{name.replace('_', '-')} must be a finite number, got {value}"
    if args.update not in UPDATE_MODES:
        return f"--update must be one of {', '.join(UPDATE_MODES)}, got {args.update!r}"
    if args.optimizer not in OPTIMIZERS:
        return f"--optimizer must be one of {', '.join(OPTIMIZERS)}, got {args.optimizer!r}"
    for name in ("num_workers", "num_envs_per_worker", "num_steps", "torch_threads", "log_frequency"):
        if getattr(args, name) < 1:
            return f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}"
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
    if args.network not in NETWORKS:
        return f"--network must be one of {', '.join(NETWORKS)}, got {args.network!r}"
    if args.atari_protocol not in PROTOCOLS:
        return f"--atari-protocol must be one of {', '.join(PROTOCOLS)}, got {args.atari_protocol!r}"
    if args.resume is not None and not Path(args.resume).is_file():
        return f"--resume {args.resume}: no such checkpoint file"
    batch = args.num_envs_per_worker * args.num_steps
    if args.total_timesteps < batch:
        return (
            f"--total-timesteps ({args.total_timesteps}) is less than one rollout "
            f"({args.num_envs_per_worker} envs x {args.num_steps} steps)"
        )
    try:
        check_env_args(args.env_id, args.num_envs_per_worker, args.atari_protocol)
    except EnvError as e:
        return str(e)
    act_space = env_spaces(args)[1]
    if not isinstance(act_space, gym.spaces.Discrete):
        return (
            f"{args.env_id} has a continuous action space ({act_space}); a3c_large_batch.py handles Discrete "
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


def checkpoint_meta(args: Args, obs_space, act_space) -> dict:
    """What a checkpoint must match to be resumed by this run: script, update mode, env, network and shapes."""
    return dict(
        script=Path(__file__).name,
        algo=args.update,
        env_id=args.env_id,
        network=args.network if args.network != "auto" else ("nature" if len(obs_space.shape) == 3 else "mlp"),
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


def evaluate(model: nn.Module, args: Args, run_dir: Path) -> list[float]:
    """Play `eval_episodes` full games with the final policy, true returns; argmax actions with `--eval-greedy`
    (GALA Table 1), sampled ones otherwise."""
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


class Aggregate:
    """Means over the last `log_frequency` update records, for TensorBoard."""

    def __init__(self, timing_names: tuple[str, ...]):
        self.timing_names = timing_names
        self.sums: dict[str, float] = {}
        self.count, self.lag_max = 0, 0

    def add(self, lag: int, stats: tuple, timing: tuple) -> None:
        values = {"charts/policy_lag": lag, **{f"losses/{k}": v for k, v in zip(LOSS_NAMES, stats, strict=True)}}
        values.update({f"timing/{k}": v for k, v in zip(self.timing_names, timing, strict=True)})
        for k, v in values.items():
            self.sums[k] = self.sums.get(k, 0.0) + v
        self.count += 1
        self.lag_max = max(self.lag_max, lag)

    def write(self, writer, global_step: int) -> None:
        for k, v in self.sums.items():
            writer.add_scalar(k, v / self.count, global_step)
        writer.add_scalar("charts/policy_lag_max", self.lag_max, global_step)
        self.sums, self.count, self.lag_max = {}, 0, 0


def shutdown(procs: dict, shared: Shared, drain, grace: float) -> list[str]:
    """Stop processes within `grace` seconds: set `stop`, keep draining the log queue while they exit (a process
    waits for its queued messages to reach the pipe before exiting), kill what is left and return their names. After
    a death the grace is short: a process killed while writing to a queue leaves its lock held, and the others' exits
    would hang on it."""
    shared.stop.set()
    deadline = time.time() + grace
    while any(p.is_alive() for p in procs.values()) and time.time() < deadline:
        try:
            drain(0.2)
        except OSError:  # TensorBoard's events file cannot be written (reported by the caller): keep stopping
            time.sleep(0.2)
    killed = []
    for name, p in procs.items():
        if p.is_alive():
            p.kill()
            killed.append(name)
        p.join(timeout=2.0)
    try:
        drain(0.0)
    except OSError:
        pass
    return killed


# ----------------------------------------------------------------------------------------------------------------
# main
# ----------------------------------------------------------------------------------------------------------------


def main(args: Args) -> None:
    if error := validate(args):
        fail(error)
    obs_space, act_space = env_spaces(args)
    meta = checkpoint_meta(args, obs_space, act_space)
    checkpoint = load_checkpoint(args.resume, meta) if args.resume else None
    signals = StopSignals()

    use_cuda = args.cuda and torch.cuda.is_available()
    device = "cuda" if use_cuda else "cpu"
    torch.set_num_threads(args.torch_threads)
    torch.manual_seed(args.seed)
    torch.backends.cudnn.deterministic = args.torch_deterministic
    torch.use_deterministic_algorithms(args.torch_deterministic, warn_only=True)
    if checkpoint:
        run_dir = Path(args.resume).parent
        if not os.access(run_dir, os.W_OK):
            fail(f"cannot write to the run directory {run_dir} of --resume {args.resume}")
    else:
        run_dir = new_run_dir(args)
    checkpoint_path = run_dir / "checkpoint.pt"

    model = make_model(obs_space, act_space, args.network)  # hogwild: the shared model; server: main's view of it
    global_step, version = 0, 0
    if checkpoint:
        model.load_state_dict(checkpoint["model"])
        global_step, version = checkpoint["global_step"], checkpoint["version"]
    params = list(model.parameters())

    ctx = mp.get_context("spawn" if use_cuda else "fork")  # CUDA cannot be used in forked children
    W, batch = args.num_workers, args.num_envs_per_worker * args.num_steps
    shared = Shared(
        stop=ctx.Event(),
        log_q=ctx.Queue(),
        error_q=ctx.Queue(),
        steps_claimed=ctx.Value("q", global_step),
        parent_pid=os.getpid(),
    )
    procs: dict[str, mp.Process] = {}
    if args.update == "hogwild":
        model.share_memory()
        shared.params, shared.updates = params, ctx.Value("q", version)
        shared.optimizer = make_optimizer(params, args).share_memory()
        if checkpoint:
            shared.optimizer.load_state_dict(checkpoint["optimizer"])
    else:
        num_params = sum(p.numel() for p in params)
        shared.grad_q = ctx.Queue()
        shared.grad_slots = torch.zeros((W, 2, num_params)).share_memory_()
        shared.free_slots = [ctx.Queue() for _ in range(W)]
        for q in shared.free_slots:
            q.put(0)
            q.put(1)
        shared.published = flatten(params).share_memory_()
        shared.version, shared.param_lock = ctx.Value("q", version, lock=False), ctx.Lock()
        server_model = make_model(obs_space, act_space, args.network)
        server_model.load_state_dict(model.state_dict())
        state = {"global_step": global_step, **({"optimizer": checkpoint["optimizer"]} if checkpoint else {})}
        procs["gradient server"] = ctx.Process(
            target=gradient_server, args=(server_model, args, shared, device, state), daemon=True
        )
    for w in range(W):
        procs[f"worker {w}"] = ctx.Process(target=worker_process, args=(w, args, shared, device), daemon=True)

    print(
        f"run directory: {run_dir}  ({W} workers x {args.num_envs_per_worker} envs, {args.update} updates, "
        f"{args.num_steps}-step rollouts of {batch} agent steps, {device})",
        flush=True,
    )
    if signals.requested.is_set():  # Ctrl+C while setting up: stop before any process starts, leave nothing behind
        if not checkpoint:
            run_dir.rmdir()
        print("interrupted during start-up", file=sys.stderr)
        raise SystemExit(128 + signals.signum)
    # children start with SIGINT/SIGTERM blocked, then ignore them: Ctrl+C reaches the whole process group
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    try:
        for p in procs.values():
            p.start()
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT, signal.SIGTERM})

    from torch.utils.tensorboard import SummaryWriter  # after the forks: the writer runs a thread

    quiet_writer_thread()
    writer = SummaryWriter(str(run_dir))
    table = "\n".join(f"|{k}|{v}|" for k, v in asdict(args).items())
    writer.add_text("hyperparameters", f"|param|value|\n|-|-|\n{table}")

    recent_returns: deque[float] = deque(maxlen=20)
    aggregate = Aggregate(TIMING_NAMES[args.update])
    start_time, start_step = time.time(), global_step
    last_print = last_checkpoint = last_check = time.time()
    workers_done, server_done = set(), args.update == "hogwild"
    lr, last_lag, updates_seen = args.learning_rate, 0, 0
    interrupted, failure, stop_sent = False, None, False

    def handle(message) -> None:
        nonlocal global_step, version, lr, last_lag, updates_seen, server_done
        kind = message[0]
        if kind == "update":
            _, _, steps, version, last_lag, lr, stats, episodes, timing = message
            global_step += steps
            updates_seen += 1
            for ret, length in episodes:
                writer.add_scalar("charts/episodic_return", ret, global_step)
                writer.add_scalar("charts/episodic_length", length, global_step)
                recent_returns.append(ret)
            aggregate.add(last_lag, stats, timing)
            if aggregate.count >= args.log_frequency:
                aggregate.write(writer, global_step)
                writer.add_scalar("charts/SPS", sps(), global_step)
                writer.add_scalar("charts/learning_rate", lr, global_step)
        elif kind == "done":
            workers_done.add(message[1])
        elif kind == "server_done":
            server_done = True

    def sps() -> float:
        return (global_step - start_step) / max(1e-9, time.time() - start_time)

    def drain(timeout: float) -> None:
        try:
            handle(shared.log_q.get(timeout=timeout) if timeout else shared.log_q.get_nowait())
            while True:
                handle(shared.log_q.get_nowait())
        except queue.Empty:
            pass

    def check_processes(ignore: tuple[str, ...] = ()) -> str | None:
        for name, p in procs.items():
            if name not in ignore and p.exitcode is not None and p.exitcode != 0:
                try:  # its traceback, if it lived to send one
                    return shared.error_q.get(timeout=2.0)
                except queue.Empty:
                    how = f"killed by signal {-p.exitcode}" if p.exitcode < 0 else f"exit status {p.exitcode}"
                    return f"error: {name} died ({how}); stopping the run"
        return None

    def hogwild_checkpoint() -> dict:
        return dict(
            model=model.state_dict(),
            optimizer=shared.optimizer.state_dict(),
            global_step=global_step,
            version=shared.updates.value,
        )

    def extra() -> dict:
        return dict(update=args.update, args=asdict(args), torch_rng=torch.get_rng_state(), meta=meta)

    def write_checkpoint() -> None:
        if args.update == "hogwild":
            atomic_save({**hogwild_checkpoint(), **extra()}, checkpoint_path)
        else:
            shared.grad_q.put(("save", str(checkpoint_path), extra()))

    try:
        while len(workers_done) < W or not server_done:
            if signals.requested.is_set():
                raise KeyboardInterrupt
            if len(workers_done) == W and not server_done and not stop_sent:
                # every worker finished: the server applies what is queued, writes the final checkpoint, stops
                shared.grad_q.put(("stop", str(checkpoint_path) if args.checkpoint_interval else None, extra()))
                stop_sent = True
            drain(0.5)
            now = time.time()
            if now - last_check >= 0.5:
                last_check = now
                if failure := check_processes():
                    break
            if now - last_print >= args.log_interval:
                mean_ret = f"{np.mean(recent_returns):.2f}" if recent_returns else "n/a"
                print(
                    f"step {global_step:>10,}  updates {updates_seen:,}  SPS {sps():,.0f}  "
                    f"return(last {len(recent_returns)}) {mean_ret}  lag {last_lag}",
                    flush=True,
                )
                last_print = now
            if args.checkpoint_interval and now - last_checkpoint >= args.checkpoint_interval:
                write_checkpoint()
                last_checkpoint = now
    except KeyboardInterrupt:
        interrupted = True
        print("interrupted: shutting down", file=sys.stderr, flush=True)
    except WriteError as e:
        failure = f"{e}; stopping (the last good checkpoint is kept)"
    except OSError as e:  # the TensorBoard events file
        failure = events_error(e, run_dir)
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl+C must not cut the shutdown short
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        server = procs.pop("gradient server", None)
        killed = shutdown(procs, shared, drain, grace=4.0 if failure is None else 1.0)  # the workers
        if server is not None:  # then the server: queued gradients, the final checkpoint, stop
            if failure is None and server.is_alive():
                if not stop_sent:
                    shared.grad_q.put(("stop", str(checkpoint_path) if args.checkpoint_interval else None, extra()))
                deadline = time.time() + 4.0
                while not server_done and server.is_alive() and time.time() < deadline:
                    drain(0.2)
            killed += shutdown({"gradient server": server}, shared, drain, grace=1.0)
            if failure is None and not server_done:
                failure = check_processes() or "error: the gradient server did not finish; stopping"
        if interrupted and killed:  # e.g. Ctrl+C while a worker was still starting up: not a crash
            print(f"{', '.join(killed)} did not stop in time after the interrupt: killed", file=sys.stderr)
        if failure is None:
            failure = check_processes(ignore=tuple(killed) if interrupted else ())
    if args.update == "server":  # main's view of the shared model: the latest published version
        with torch.no_grad():
            copy_flat_into(params, shared.published)
    try:
        if failure is None and args.checkpoint_interval and args.update == "hogwild":
            atomic_save({**hogwild_checkpoint(), **extra()}, checkpoint_path)
        if failure is None and not interrupted and args.save_model:
            atomic_save(model.state_dict(), run_dir / "model.pt")
    except WriteError as e:
        failure = f"{e}; stopping (the last good checkpoint is kept)"
    try:
        if aggregate.count:
            aggregate.write(writer, global_step)
            writer.add_scalar("charts/SPS", sps(), global_step)
            writer.add_scalar("charts/learning_rate", lr, global_step)
    except OSError as e:
        failure = failure or events_error(e, run_dir)
    finished = failure is None and not interrupted
    mean_ret = f"{np.mean(recent_returns):.2f}" if recent_returns else "n/a"
    print(f"step {global_step:>10,}  updates {updates_seen:,}  SPS {sps():,.0f}  return {mean_ret}", flush=True)
    if finished:
        if args.eval_episodes:
            for i, ret in enumerate(evaluate(model, args, run_dir)):
                writer.add_scalar("eval/episodic_return", ret, i)
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
