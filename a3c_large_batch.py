"""A3C: asynchronous advantage actor-critic (Mnih et al., "Asynchronous methods for deep reinforcement learning",
ICML 2016), in the large-batch variant of Stooke and Abbeel (2018) that the GALA paper (Assran et al., NeurIPS 2019)
uses as its baseline (Appendix C.1, hyperparameters of Table 2), and as originally proposed (1 simulator per worker).

Data flow (`--num-workers` W worker processes, no synchronisation between them):

    worker w (x W): pull shared params -> N = --num-steps steps of --num-envs-per-worker envs (batched forward)
                    -> n-step returns, A2C gradient clipped to --max-grad-norm -> push -> repeat
      --update hogwild: push = lock-free RMSprop step on the shared-memory params and statistics (Recht et al. 2011)
      --update server:  push = gradient into one of the worker's 2 shared slots, Update -> grad_q -> server
    gradient server:    applies gradients in arrival order, publishes the flat params + version (+1 per gradient)
                        under a lock; owns the model and optimizer (on the GPU when there is one)
    workers (hogwild) / server --Update--> log_q --> main: TensorBoard, console, checkpoints, watches every process

Policy lag (`charts/policy_lag`): updates applied to the shared model between a worker's pull and its gradient's
application. Hogwild: each update of another worker falls between the pull and the push of at most one update of a
worker, so the mean lag over a run is at most W - 1 (equal in lockstep); one worker has lag 0. Server: a gradient's lag
counts at most 3 of its worker's own (two slots and the one being applied), and each update of another worker counts
in at most 4 of a worker's gradients (a push waits for the slot of the gradient two back): mean lag <= 4W - 1.
Determinism: none across runs with several workers or in server mode (arrival order is the hardware's); one hogwild
worker with `--torch-deterministic` on CPU is reproducible.

Examples:
  python a3c_large_batch.py --env-id ALE/Breakout-v5                                  # 4 workers x 16 envs, hogwild
  python a3c_large_batch.py --env-id ALE/Breakout-v5 --update server --num-workers 8 --track
  python a3c_large_batch.py --env-id ALE/Pong-v5 --num-workers 16 --num-envs-per-worker 1    # original A3C
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
from multiprocessing.queues import Queue
from multiprocessing.sharedctypes import Synchronized
from multiprocessing.synchronize import Lock
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
    """use a GPU for the workers' inference and the server's model when one is present"""
    env_id: str = "ALE/Breakout-v5"
    """gymnasium id; ALE ids run in ale-py's C++ vector env"""
    atari_protocol: Literal["deepmind", "machado"] = "deepmind"
    """ALE preprocessing: `deepmind` (the GALA paper's Table 2 setting) or `machado`"""
    total_timesteps: int = 10_000_000
    """agent steps summed over all envs of all workers"""
    log_dir: str = "runs"
    """where run directories go"""
    save_model: bool = False
    """write the final model's state_dict to {run_dir}/model.pt"""
    checkpoint_interval: float = 600.0
    """seconds between checkpoints to {run_dir}/checkpoint.pt, also written at the end and at Ctrl+C (0 = none)"""
    resume: str | None = None
    """path of a checkpoint.pt to continue from (same run directory and step count)"""
    eval_episodes: int = 0
    """episodes to evaluate the final policy on (logged as eval/episodic_return)"""
    eval_greedy: bool = True
    """evaluate with argmax actions (GALA Table 1's protocol for A3C); `--no-eval-greedy` samples from the policy"""
    eval_only: str | None = None
    """evaluate a saved agent instead of training: a model.pt or checkpoint.pt of a run of this script; env, protocol,
    network and model options come from the run's args.json / checkpoint (--eval-episodes 0 plays 10 episodes)"""
    capture_video: bool = False
    """record videos of the evaluation episodes to {run_dir}/videos (--eval-only: {model dir}/videos-eval-{time})"""
    track: bool = False
    """log the run to Weights & Biases (TensorBoard synced, Args as config, videos): pip install -e '.[track]'"""
    wandb_project_name: str = "actorlearners"
    """Weights & Biases project of --track"""
    wandb_entity: str | None = None
    """Weights & Biases entity (team or user) of --track; None: your default entity"""
    network: Literal["auto", "nature", "impala", "mlp"] = "auto"
    """`nature` (GALA Appendix C.2), `impala`, `mlp`, or `auto` (nature for frames, mlp for flat observations)"""

    update: Literal["hogwild", "server"] = "hogwild"
    """`hogwild` (lock-free shared parameters and RMSprop statistics) or `server` (a gradient server process)"""
    num_workers: int = 4
    """worker processes (4 x 16 = the 64 simulators of GALA's Figure 4)"""
    num_envs_per_worker: int = 16
    """simulators per worker, stepped together with batched inference (16: Stooke & Abbeel; 1: original A3C)"""
    env_threads: int = 1
    """ale-py stepping threads per worker's vector env (0 = the machine's cores / workers)"""
    torch_threads: int = 1
    """torch intra-op threads of each worker (each is a learner) and of the gradient server (0 = the machine's cores /
    workers); 1 by default, as the worker processes already use the cores"""
    # GALA Table 2 (A2C, GALA-A2C and A3C)
    num_steps: int = 5
    """horizon N: steps per env between pushes"""
    learning_rate: float = 7e-4
    """base learning rate (Table 2: no scaling with the number of learners for A3C)"""
    anneal_lr: bool = False
    """linearly anneal the learning rate to 0 over the run (Table 2 lists no schedule)"""
    optimizer: Literal["rmsprop", "sgd"] = "rmsprop"
    """`rmsprop` (Table 2) or `sgd` (plain p -= lr g, for checks)"""
    rmsprop_alpha: float = 0.99
    """RMSprop smoothing constant (Table 2: 0.99, momentum 0)"""
    rmsprop_eps: float = 1e-3
    """RMSprop epsilon, outside the square root as in PyTorch: not Table 2's 0.01 nor GALA's code's 1e-5 but the A3C eps
    study's 1e-3 (benchmarks/RESULTS.md), as 1e-5 lets the first, stale hogwild steps of 4 workers kill the ReLUs"""
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


# ---- Algorithm ----


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


class SharedRMSprop:
    """RMSprop without momentum (Table 2), or plain SGD, with its statistics in tensors that `share_memory()` moves to
    shared memory: hogwild workers step the shared parameters concurrently and lock-free (Mnih et al. 2016, Section 4:
    "RMSProp with shared statistics"). v = alpha v + (1 - alpha) g^2; p -= lr g / (sqrt(v) + eps), the eps *outside*
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


# ---- Storage and messages ----


class Update(NamedTuple):
    """One gradient: worker -> gradient server, on `grad_q` (server mode: the gradient waits in `grad_slots[worker,
    slot]`); once applied to the shared model, worker (hogwild) or gradient server -> main, on `log_q`."""

    worker: int
    steps: int  # agent steps of the rollout behind the gradient
    pulled: int  # version of the parameters the rollout acted with
    version: int  # version this gradient made (in server mode the server sets it when it applies the gradient)
    lr: float
    losses: dict[str, float]  # policy_loss, value_loss, entropy, total_loss, grad_norm
    episodes: list[tuple[float, int]]  # (return, length) of the games that ended in the rollout
    timing: dict[str, float]  # seconds per phase: pull, rollout, train, then push (hogwild) or server_apply
    slot: int = 0  # server mode: the worker's gradient slot that holds it


class SaveCheckpoint(NamedTuple):
    """main -> gradient server, on `grad_q`: write the model and optimizer it owns, with `extra`, to `path` (None: no
    file); after the `final` one, sent once the workers exited (behind their last gradients), return."""

    path: str | None
    extra: dict  # args, meta, RNG state: what main adds to every checkpoint
    final: bool = False


@dataclass
class Shared:
    """Everything the processes share (handed over at process start; tensors and locks live in shared memory)."""

    stop: StopFlag  # the run is shutting down
    log_q: Queue  # -> main: the applied Updates
    error_q: Queue  # -> main: the error line of a process that fails (worker_body)
    steps_claimed: Synchronized  # int64: agent steps handed out to rollouts (the budget counter)
    version: Synchronized  # int64: gradients applied so far (the parameters' version); server: under param_lock
    optimizer: SharedRMSprop | None = None  # hogwild: steps the shared model's parameters, `optimizer.params`
    # server
    grad_q: Queue | None = None  # workers -> server: Update; main -> server: SaveCheckpoint
    grad_slots: torch.Tensor | None = None  # [W, 2, P] shared gradient slots
    free_slots: list[Queue] | None = None  # per worker: its free slot indices (0, 1)
    published: torch.Tensor | None = None  # [P] latest parameters
    param_lock: Lock | None = None  # guards (published, version) so a pull never mixes two versions


def make_shared(args: Args, ctx, stop: StopFlag, model: nn.Module, checkpoint: dict | None) -> Shared:
    """The shared state of `--update`; `model` resumed from `checkpoint` if given, in shared memory for hogwild."""
    if checkpoint:
        model.load_state_dict(checkpoint["model"])
    steps, version = (checkpoint["global_step"], checkpoint["version"]) if checkpoint else (0, 0)
    shared = Shared(stop, ctx.Queue(), ctx.Queue(), ctx.Value("q", steps), ctx.Value("q", version))
    params = list(model.parameters())
    if args.update == "hogwild":
        model.share_memory()
        shared.optimizer = make_optimizer(params, args).share_memory()
        if checkpoint:
            shared.optimizer.load_state_dict(checkpoint["optimizer"])
        return shared
    shared.grad_q = ctx.Queue()
    shared.grad_slots = torch.zeros((args.num_workers, 2, sum(p.numel() for p in params))).share_memory_()
    shared.free_slots = [ctx.Queue() for _ in range(args.num_workers)]
    for q in shared.free_slots:
        q.put(0)
        q.put(1)
    shared.published, shared.param_lock = flatten(params).share_memory_(), ctx.Lock()
    return shared


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
        version = shared.version.value
        for local, p in zip(params, shared.optimizer.params, strict=True):
            local.copy_(p, non_blocking=True)
        return version
    with shared.param_lock:
        version = shared.version.value
        copy_flat_into(params, shared.published)
    return version


def push(shared: Shared, grads: list[torch.Tensor], update: Update) -> None:
    """Hogwild: apply a gradient to the shared parameters, lock-free, and report it to main. Server: write it into a
    free slot of its worker and queue it for the server (which reports it once applied)."""
    if shared.grad_q is not None:
        slot = blocking(shared.free_slots[update.worker].get, shared.stop)  # free: the server copied its last gradient
        copy_into_flat(shared.grad_slots[update.worker, slot], grads)
        shared.grad_q.put(update._replace(slot=slot))
        return
    t0 = time.perf_counter()
    shared.optimizer.step(grads, update.lr)
    with shared.version.get_lock():  # the counter only, not the parameters
        shared.version.value += 1
        version = shared.version.value
    timing = {**update.timing, "timing/push": time.perf_counter() - t0}
    shared.log_q.put(update._replace(version=version, timing=timing))


# ---- Workers ----


def threads(requested: int, workers: int) -> int:
    """`--torch-threads` / `--env-threads`: the value given, or for 0 the machine's cores shared by the workers."""
    return requested or max(1, (os.cpu_count() or 1) // workers)


def worker_loop(worker: int, args: Args, shared: Shared, device: torch.device) -> None:
    """Mnih et al. 2016, Algorithm S3, for a batch of `num_envs_per_worker` simulators."""
    torch.set_num_threads(threads(args.torch_threads, args.num_workers))
    torch.use_deterministic_algorithms(args.torch_deterministic, warn_only=True)
    n, T = args.num_envs_per_worker, args.num_steps
    start_step = shared.steps_claimed.value  # > 0 after --resume: fresh action noise, not a replay
    envs = make_vector_env(
        args.env_id, n, args.seed + 10_000 * worker + start_step, protocol=args.atari_protocol,
        num_threads=threads(args.env_threads, args.num_workers),
    )  # fmt: skip
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
        while not shared.stop.is_set():
            global_step = claim_steps(shared, batch, args.total_timesteps)
            if not global_step:
                break
            t0 = time.perf_counter()
            pulled = pull(shared, params)
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
                logits[: T * n], values[:T].reshape(-1), actions.reshape(-1), returns.reshape(-1), args.vf_coef,
                args.ent_coef,
            )  # fmt: skip
            model.zero_grad(set_to_none=False)
            losses["total_loss"].backward()
            losses["grad_norm"] = nn.utils.clip_grad_norm_(params, args.max_grad_norm)
            stats = dict(zip(losses, torch.stack([v.detach() for v in losses.values()]).tolist(), strict=True))
            if not all(map(math.isfinite, stats.values())):  # checked before the push: the shared model stays finite
                raise NonFiniteLoss(f"non-finite loss at global step {global_step}: {stats}")
            lr = args.learning_rate * (1.0 - (global_step - batch) / args.total_timesteps if args.anneal_lr else 1.0)
            obs_buf[0].copy_(obs_buf[T])
            t3 = time.perf_counter()
            timing = {"timing/pull": t1 - t0, "timing/rollout": t2 - t1, "timing/train": t3 - t2}
            push(shared, [p.grad for p in params], Update(worker, batch, pulled, 0, lr, stats, episodes, timing))
    finally:
        envs.close()


def gradient_server(model: nn.Module, args: Args, shared: Shared, device: torch.device, resumed: dict | None) -> None:
    """The push-pull gradient server: apply gradients in arrival order, publish versioned parameters."""
    torch.set_num_threads(threads(args.torch_threads, args.num_workers))
    model = model.to(device)
    params = list(model.parameters())
    optimizer = make_optimizer(params, args)
    if resumed:  # the checkpoint of a --resume
        optimizer.load_state_dict(resumed["optimizer"])
    grads = [torch.zeros_like(p) for p in params]
    global_step = resumed["global_step"] if resumed else 0
    while True:  # until main's final SaveCheckpoint, sent after the workers stopped (child_main ends it if main dies)
        message = shared.grad_q.get()
        if isinstance(message, Update):
            update, t0 = message, time.perf_counter()
            copy_flat_into(grads, shared.grad_slots[update.worker, update.slot])
            shared.free_slots[update.worker].put(update.slot)  # copied out: the worker may write this slot again
            optimizer.step(grads, update.lr)
            flat = flatten(params).cpu()
            with shared.param_lock:
                shared.published.copy_(flat)
                shared.version.value += 1
                version = shared.version.value
            global_step += update.steps
            timing = {**update.timing, "timing/server_apply": time.perf_counter() - t0}
            shared.log_q.put(update._replace(version=version, timing=timing))
        else:  # SaveCheckpoint
            if message.path is not None:
                own = dict(model={k: v.cpu() for k, v in model.state_dict().items()}, optimizer=optimizer.state_dict())
                checkpoint = {**own, "global_step": global_step, "version": shared.version.value, **message.extra}
                atomic_save(checkpoint, Path(message.path))
            if message.final:  # exit 0 tells main that every gradient is applied and the checkpoint written
                return


# ---- Main ----


def main(args: Args) -> None:
    if (run := open_run(args)) is None:  # resume, validation, run directory, args.json, seed, threads, device
        return  # --eval-only played the saved agent
    args, device, checkpoint, workers = run.args, run.device, run.checkpoint, run.args.num_workers
    ctx = mp.get_context("spawn" if device.type == "cuda" else "fork")  # CUDA cannot be used in forked children
    signals = run.stop_on_signals(StopFlag(ctx))
    model = make_model(*run.spaces, args.network)  # hogwild: the shared model; server: main's view of it
    shared = make_shared(args, ctx, signals.stop, model, checkpoint)
    extra = dict(update=args.update, args=asdict(args), torch_rng=torch.get_rng_state(), meta=run.meta)
    stop_if_signalled(signals, run.run_dir, resumed=checkpoint is not None)  # no process started yet
    processes = Processes(ctx)
    watch = Watch(args, model, shared, processes, signals, extra, shared.steps_claimed.value)
    if (left := run.num_updates - watch.global_step // run.steps_per_update) < workers:
        print(f"warning: {left} update(s) left for {workers} workers: {workers - left} of them will update nothing",
              file=sys.stderr)  # fmt: skip
    if shared.grad_q is not None:  # the gradient server first, with its own copy of the model and the optimizer
        server = (copy.deepcopy(model), args, shared, device, checkpoint)
        processes.start("gradient server", worker_body, gradient_server, shared.error_q, *server)
    for w in range(workers):
        processes.start(f"worker {w}", worker_body, worker_loop, shared.error_q, w, args, shared, device)
    shape = f"{workers} asynchronous workers' {args.num_envs_per_worker} envs x {args.num_steps} steps; {args.update}"
    with run.training(f"an update is one of {shape}", lambda: watch.global_step,
                      lambda graceful: shut_down(watch, failed=not (graceful or signals.signum)), window=20,
                      checkpoint=watch.write_checkpoint if shared.grad_q is None else None,  # the server writes its own
                      save=watch.write_checkpoint, final_model=lambda: watch.model, last_point=watch.last_point,
                      ) as record:  # fmt: skip
        watch.record = record
        while watch.workers_running() and not signals.stop.is_set():  # log what the workers report, watch them
            watch.drain(0.5)
            if failure := worker_failure(processes, shared.error_q):
                raise Stop(failure)
            watch.console_line()
            run.checkpoint_if_due()
        if signals.signum:  # the loop ended by a signal
            raise Stop


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
    (">= 1", ("num_workers", "num_envs_per_worker", "num_steps", "log_frequency")),
    ("> 0", ("learning_rate", "max_grad_norm", "rmsprop_eps")), ("in [0, 1)", ("rmsprop_alpha",)),
    ("in (0, 1]", ("gamma",)),
    (">= 0", ("seed", "env_threads", "torch_threads", "ent_coef", "vf_coef", "eval_episodes", "checkpoint_interval",
              "log_interval")),
)  # fmt: skip
RENAMED_FLAGS: dict[str, str] = {}  # old flag -> what to say instead
# a gradient's rollout (agent steps per version, the step arithmetic of a run) and --update server's per-worker slots
RESUME_FIXED = ("num_workers", "num_envs_per_worker", "num_steps")
RUN_SETTINGS = ("env_id", "atari_protocol", "network")


def validate(args: Args, world_size: int = 1) -> str | None:
    """The checks beyond check_flags's, before anything is made: the error line or None (tyro checks the choices)."""
    if error := check_flags(args):
        return error
    if world_size > 1:
        return f"{Path(__file__).name} runs on one machine: start it with python, not torchrun"
    if args.resume is not None and not Path(args.resume).is_file():
        return f"--resume {args.resume}: no such checkpoint file"
    if args.eval_only is not None and not Path(args.eval_only).is_file():
        return f"--eval-only {args.eval_only}: no such file"
    if args.total_timesteps < (rollout := args.num_envs_per_worker * args.num_steps):
        given = args.total_timesteps
        return (f"--total-timesteps {given} is below one update, {rollout} agent steps (--num-envs-per-worker x "
                f"--num-steps): the run would learn nothing; give at least {rollout}")  # fmt: skip
    if args.capture_video and args.eval_episodes == 0 and args.eval_only is None:
        return "--capture-video records the evaluation episodes; add --eval-episodes N (N >= 1)"
    if args.resume is not None and args.eval_only is not None:
        return "--eval-only trains nothing, so --resume would be ignored: give one of them"
    if args.eval_only is not None:  # env, network and model are the saved run's: main_eval_only checks them
        return None
    try:
        act_space = env_spaces(args)[1]  # an unknown env id: an EnvError that suggests close matches
        if args.capture_video:  # fail now, not at the final evaluation
            check_video(args.env_id, args.atari_protocol)
    except EnvError as e:
        return str(e)
    if not isinstance(act_space, gym.spaces.Discrete):
        return f"{args.env_id} has a continuous action space ({act_space}); Discrete only (apex_ddpg.py: continuous)"
    return None


def env_spaces(args: Args) -> tuple[gym.Space, gym.Space]:
    """(observation space, action space) of one env of the training vector env."""
    probe = make_vector_env(args.env_id, 1, args.seed, protocol=args.atari_protocol, num_threads=1)
    probe.close()
    return probe.single_observation_space, probe.single_action_space


def checkpoint_meta(args: Args, obs_space: gym.Space, act_space: gym.spaces.Discrete, world_size: int = 1) -> dict:
    """What a checkpoint must match to be resumed by this run: script, update mode, env, Atari protocol, network and
    shapes."""
    network = args.network if args.network != "auto" else ("nature" if len(obs_space.shape) == 3 else "mlp")
    return dict(script=Path(__file__).name, algo=args.update, env_id=args.env_id, atari_protocol=args.atari_protocol,
                network=network, obs_shape=list(obs_space.shape), action_shape_or_n=int(act_space.n))  # fmt: skip


def settled_args(args: Args) -> Args:
    """The flags as the run uses them: as given (no default here depends on another flag)."""
    return args


def steps_per_update(args: Args, world_size: int) -> int:
    """Agent steps of one update: a worker's rollout of --num-envs-per-worker envs x --num-steps, claimed whole."""
    return args.num_envs_per_worker * args.num_steps


def init_torch(args: Args, spaces: tuple[gym.Space, gym.Space], rank: int, world_size: int) -> torch.device:
    """Threads, seed and determinism of main's process (the forked workers inherit them), and the workers' device."""
    torch.set_num_threads(threads(args.torch_threads, args.num_workers))
    torch.manual_seed(args.seed)
    torch.backends.cudnn.deterministic = args.torch_deterministic
    torch.use_deterministic_algorithms(args.torch_deterministic, warn_only=True)
    return torch.device("cuda" if args.cuda and torch.cuda.is_available() else "cpu")


def saved_model(eval_args: Args, settings: dict, state_dict: dict) -> nn.Module:
    model = make_model(*env_spaces(eval_args), settings["network"])
    model.load_state_dict(state_dict)
    return model


def evaluate(model: nn.Module, args: Args, video_dir: Path, device: torch.device) -> Iterator[float]:
    """Play `eval_episodes` full games with the final (or --eval-only's saved) policy, true returns; argmax actions
    with `--eval-greedy` (GALA Table 1), sampled ones otherwise; videos to `video_dir` with --capture-video."""
    seed = args.seed + 1_000_003
    env = make_env(args.env_id, seed, protocol=args.atari_protocol, capture_video=args.capture_video,
                   video_dir=str(video_dir))  # fmt: skip
    generator, model = torch.Generator(device=device).manual_seed(seed), model.to(device)
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


@dataclass
class Watch:
    """Main's side of the run once the processes run: the record of what they report on `log_q` (TensorBoard:
    episodes as they end; lag, losses and timings averaged over --log-frequency updates; the console line) and
    checkpoints (in server mode written by the gradient server, which owns the model and optimizer: main sends it
    SaveCheckpoint); shut_down ends the processes."""

    args: Args
    model: nn.Module  # hogwild: the shared model; server: main's view of it
    shared: Shared
    processes: Processes
    signals: StopSignals
    extra: dict  # what main adds to every checkpoint: the Args, meta and its RNG state
    global_step: int
    record: Recorder | None = None  # the run's, made after the forks (its SummaryWriter runs a thread)
    updates: int = 0
    lag: int = 0  # of the latest update

    def handle(self, update: Update) -> None:
        self.global_step += update.steps
        self.updates += 1
        # the policy lag: updates applied to the shared model between this rollout's pull and this gradient
        self.lag = update.version - 1 - update.pulled
        self.record.games((self.global_step, ret, length) for ret, length in update.episodes)
        self.record.add({"charts/policy_lag": self.lag, "charts/learning_rate": update.lr})
        losses = update.losses
        self.record.add({"losses/policy_loss": losses["policy_loss"], "losses/value_loss": losses["value_loss"],
                         "losses/entropy": losses["entropy"], "losses/total_loss": losses["total_loss"],
                         "losses/grad_norm": losses["grad_norm"]})  # fmt: skip
        self.record.add(update.timing)
        if self.updates % self.args.log_frequency == 0:
            self.write()

    def write(self) -> None:
        """One TensorBoard point (the means over the updates since the last one, and the largest lag among them)."""
        if lags := self.record.values.get("charts/policy_lag"):
            self.record.add({"charts/policy_lag_max": max(lags)})
            self.record.point(self.global_step)

    def drain(self, timeout: float) -> None:
        """Handle every message on `log_q`, waiting up to `timeout` seconds for the first."""
        with contextlib.suppress(queue.Empty):
            self.handle(self.shared.log_q.get(timeout=timeout))
            while True:
                self.handle(self.shared.log_q.get_nowait())

    def workers_running(self) -> bool:
        """A worker exits once its budget is spent and what it queued is in the pipe (or once the run stops)."""
        return any(p.is_alive() for name, p in self.processes.procs.items() if name.startswith("worker"))

    def console_line(self, now: bool = False) -> None:
        self.record.line(self.global_step, f"updates={self.updates} policy_lag={self.lag}", now)

    def write_checkpoint(self) -> None:
        path, shared = self.record.progress.run_dir / "checkpoint.pt", self.shared
        if shared.grad_q is not None:
            shared.grad_q.put(SaveCheckpoint(str(path), self.extra))
            return
        # the version read without its lock: a worker killed while it held the lock would block this read forever
        version = shared.version.get_obj().value
        own = dict(model=self.model.state_dict(), optimizer=shared.optimizer.state_dict(), version=version)
        atomic_save({**own, "global_step": self.global_step, **self.extra}, path)

    def last_point(self) -> None:
        """After the processes stopped: main's view of the shared model made the latest published version (gradient
        server; not after a kill: the process may have died holding its lock), then the last point and console line."""
        killed = any(p.exitcode is not None and p.exitcode < 0 for p in self.processes.procs.values())
        if self.shared.grad_q is not None and not killed:  # a killed run ends with an error: the view is not used
            pull(self.shared, list(self.model.parameters()))
        self.write()
        self.console_line(now=True)


def shut_down(run: Watch, failed: bool) -> str | None:
    """Stop the workers, let the gradient server apply what is queued and write the final checkpoint (unless the run
    `failed`), then end every process (SIGKILL for one that does not stop in time); returns the error line of one that
    failed meanwhile. Before the record is made (tracking failed to start) every process is killed at once."""
    shared, interrupted = run.shared, bool(run.signals.signum)
    if interrupted:
        print("interrupted: shutting down", file=sys.stderr, flush=True)
    shared.stop.set()
    if shared.grad_q is not None:  # main's puts need no wait at exit (the server's exit says they arrived), and a
        shared.grad_q.cancel_join_thread()  # worker killed holding the queue's write lock would make it endless
    if run.record is None:
        run.processes.stop(grace=0.0)
        return None
    # after a death the wait is short: a process killed while writing to a queue leaves its lock held, and the others'
    # exits would hang on it
    drain_while(run, run.workers_running, 1.0 if failed else 4.0)
    failure = None if failed else worker_failure(run.processes, shared.error_q)
    server = run.processes.procs.get("gradient server")
    if server is not None and not (failed or failure):
        path = str(run.record.progress.run_dir / "checkpoint.pt") if run.args.checkpoint_interval else None
        shared.grad_q.put(SaveCheckpoint(path, run.extra, final=True))  # behind the exited workers' gradients
        wait = 5.0 if interrupted else 60.0  # the final checkpoint of a finished run may take a while to write
        drain_while(run, server.is_alive, wait)
        if server.exitcode != 0:  # 0: every gradient applied, the final checkpoint written
            failure = (
                worker_failure(run.processes, shared.error_q) or "error: the gradient server did not finish; stopping"
            )
    killed = run.processes.stop(grace=1.0)
    with contextlib.suppress(OSError):  # the events file's error, if any, is reported by Run.training
        run.drain(0.0)
    if interrupted and killed:  # e.g. Ctrl+C while a worker was still starting up: not a crash
        print(f"{', '.join(killed)} did not stop in time after the interrupt: killed", file=sys.stderr)
    return failure


def drain_while(run: Watch, busy, seconds: float) -> None:
    """Handle the messages on `log_q` while `busy()` holds, for at most `seconds` (a process that stops exits only once
    its queued messages are in the pipe). The events file's errors are the caller's to report."""
    deadline = time.monotonic() + seconds
    while busy() and time.monotonic() < deadline:
        try:
            run.drain(0.2)
        except OSError:
            time.sleep(0.2)


if __name__ == "__main__":
    main(parse_args(sys.argv[1:]))
