"""HTS-RL with A2C: High-Throughput Synchronous Deep RL (Liu, Yeh & Schwing, NeurIPS 2020), Section 4.

Architecture (Fig. 1e, Fig. 2d), one machine:
- `num_executors` executor processes each own `num_envs / num_executors` envs (one common.atari vector env). Per
  step an executor writes its observations and one pseudo-random number per env into the *state buffer* (shared
  memory), puts its id on the `requests` queue and blocks on its own pipe until an actor has answered.
- `num_actors` actor processes take executor ids from `requests` as they come (whichever actor is free), forward
  the published policy (shared-memory parameters) on that executor's observations, sample with the executor's
  random numbers (inverse CDF), write the actions into the *action buffer* and wake the executor.
- Executors write (obs, action, reward, done) into one of two *storages* while the learner (the main process) reads
  the other: rollout and learning run concurrently. Every `sync_interval` steps per env (alpha, Sec. 4.1) the
  learner waits for all executors (batch synchronization), publishes the new policy, and the storages swap roles.
- Delayed gradient (Eq. 6): theta_{j+1} = theta_j + eta * grad J(theta_{j-1}, D^{theta_{j-1}}): RMSprop steps on a
  copy of the behavior parameters theta_{j-1} that collected the data, the displacement is added to theta_j.
- `--sync`: the synchronous A2C baseline (Fig. 2a) on the same executors and actors: executors step in lockstep (a
  barrier after every env step, alpha = 1 in Eq. 7); after each rollout of `sync_interval` steps the learner
  updates the current parameters (no delayed gradient) and the executors wait for them before the next rollout.
Policy lag: exactly 1 update (0 for the first update after start or resume); 0 with `--sync`. Measured from version
stamps the actors write beside every transition, logged as `charts/policy_lag`. `--resume` restarts the pipeline
from the checkpoint's parameters and optimizer (envs start new episodes), in the same run directory and step count.
Determinism: all sampling randomness comes from per-env generators in the executors, and an actor forwards ONE
executor's observations per forward pass, never every observation waiting across executors: oneDNN convolution and
matmul results depend on the batch composition, so such batches would make actions depend on timing and on
`num_actors`. A run is thus bitwise reproducible for a given seed, `num_envs`, `num_executors`, `sync_interval` and
`--sync`, whatever `num_actors` and however the OS schedules. For large inference batches use fewer executors with
more envs each (`--num-executors 1`: one C++ vector env of all `num_envs`, one forward of `num_envs` per step).

    python hts_a2c.py --env-id ALE/Breakout-v5
    python hts_a2c.py --env-id CartPole-v1 --num-envs 8 --num-executors 8 --num-actors 2 --total-timesteps 200000
    python hts_a2c.py --env-id ALE/Breakout-v5 --sync  # the synchronous A2C baseline
    STRAGGLER_STD_MS=8 python hts_a2c.py --env-id benchmarks.measure:Straggler-v0 --num-envs 8 --num-executors 8
"""

from __future__ import annotations

import copy
import ctypes
import errno
import io
import itertools
import math
import os
import queue
import random
import signal
import sys
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import gymnasium as gym
import numpy as np
import torch
import torch.multiprocessing as mp
import tyro
from torch import nn
from torch.utils.tensorboard import SummaryWriter

from common.atari import PROTOCOLS, EnvError, check_env_args, finished_episodes, make_env, make_vector_env
from common.models import NETWORKS, make_model


@dataclass
class Args:
    exp_name: str = Path(__file__).stem
    """name of this experiment (part of the run directory)"""
    seed: int = 1
    """seed of the run: envs, per-env sampling generators, network init"""
    torch_deterministic: bool = True
    """set `torch.backends.cudnn.deterministic`"""
    cuda: bool = True
    """learn and infer on the GPU when one is present"""
    env_id: str = "ALE/Breakout-v5"
    """gymnasium env id (ALE ids go through common.atari; `module:EnvId` imports `module` first)"""
    atari_protocol: str = "deepmind"
    """ALE preprocessing protocol: deepmind or machado"""
    network: str = "auto"
    """auto (nature for frames, mlp for vectors), nature, impala or mlp"""
    total_timesteps: int = 10_000_000
    """agent steps summed over all envs"""
    log_dir: str = "runs"
    """root of the run directories"""
    save_model: bool = False
    """write the final model's state_dict to {run_dir}/model.pt"""
    checkpoint_interval: float = 0.0
    """seconds between checkpoints to {run_dir}/checkpoint.pt (0 = off)"""
    resume: str | None = None
    """path of a checkpoint.pt to continue (same run directory and step count)"""
    eval_episodes: int = 0
    """episodes played by the final policy after training, logged as eval/episodic_return"""
    capture_video: bool = False
    """record the evaluation episodes to {run_dir}/videos (needs --eval-episodes)"""

    # HTS-RL / A2C settings: Table A3 ("A2C/Ours") and Kostrikov's A2C defaults it refers to
    num_envs: int = 16
    """parallel environments (Sec. 5: 16 on one machine)"""
    num_executors: int = 4
    """executor processes; each steps num_envs / num_executors envs (the paper runs one env per executor)"""
    num_actors: int = 4
    """actor processes doing inference (Table A3: 4)"""
    sync_interval: int = 5
    """alpha: steps per env between synchronizations = rollout length of one update (Table A3 unroll length: 5)"""
    sync: bool = False
    """run plain synchronous A2C instead (lockstep env steps, learn with the current parameters, policy lag 0)"""
    gamma: float = 0.99
    """discount factor (Table A3)"""
    learning_rate: float = 7e-4
    """RMSprop learning rate (Table A3)"""
    anneal_lr: bool = False
    """decay the learning rate linearly to 0 over the run"""
    rms_alpha: float = 0.99
    """RMSprop smoothing constant (Kostrikov's A2C)"""
    rms_eps: float = 1e-5
    """RMSprop epsilon (Table A3)"""
    vf_coef: float = 0.5
    """value loss coefficient (Table A3)"""
    ent_coef: float = 0.01
    """entropy bonus coefficient (Table A3)"""
    max_grad_norm: float = 0.5
    """gradient norm clip (Kostrikov's A2C)"""
    log_interval: int = 10
    """updates between TensorBoard loss scalars"""
    console_interval: float = 10.0
    """seconds between console lines"""
    torch_threads: int = 0
    """torch intra-op threads of the learner (0 = cores not taken by executors and actors, at least 1)"""


# ----------------------------------------------------------------------------------------------------------------------
# Pure algorithm functions


def nstep_returns(rewards: torch.Tensor, dones: torch.Tensor, bootstrap: torch.Tensor, gamma: float) -> torch.Tensor:
    """Bootstrapped discounted returns R_t = r_t + gamma (1 - d_t) R_{t+1}, R_T = V(s_T) (A2C, Mnih et al. 2016).

    rewards, dones: [T, B] (dones[t]: the episode ended with transition t); bootstrap: [B] -> returns [T, B].
    """
    returns = torch.empty_like(rewards)
    running = bootstrap
    for t in reversed(range(rewards.shape[0])):
        running = rewards[t] + gamma * (1.0 - dones[t]) * running
        returns[t] = running
    return returns


def a2c_loss(
    logits: torch.Tensor,
    values: torch.Tensor,
    actions: torch.Tensor,
    returns: torch.Tensor,
    vf_coef: float,
    ent_coef: float,
) -> dict[str, torch.Tensor]:
    """A2C loss of Kostrikov's implementation: logits [N, A], values/actions/returns [N] -> scalar losses."""
    log_probs = torch.log_softmax(logits, dim=-1)  # [N, A]
    action_log_probs = log_probs.gather(1, actions.long().unsqueeze(1)).squeeze(1)  # [N]
    advantages = returns - values  # [N]
    value_loss = advantages.pow(2).mean()
    policy_loss = -(advantages.detach() * action_log_probs).mean()
    entropy = -(log_probs.exp() * log_probs).sum(-1).mean()
    total_loss = policy_loss + vf_coef * value_loss - ent_coef * entropy
    return {"policy_loss": policy_loss, "value_loss": value_loss, "entropy": entropy, "total_loss": total_loss}


def sample_actions(logits: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling from softmax(logits) [B, A] with executor-supplied uniforms [B] in [0, 1) -> [B].

    Sec. 4.1: randomness is deferred to the executors, so the action does not depend on which actor served it.
    """
    cdf = torch.softmax(logits.double(), dim=-1).cumsum(-1)  # [B, A]
    actions = torch.searchsorted(cdf, uniforms.double().unsqueeze(1)).squeeze(1)
    return actions.clamp_(max=logits.shape[-1] - 1)  # cdf[-1] can round to just below 1


def delayed_update(target: nn.Module, behavior: nn.Module, step: Callable[[], dict]) -> dict:
    """Eq. 6: run `step()` (an optimizer update of `behavior`, i.e. at theta_{j-1} on D^{theta_{j-1}}) and add the
    displacement it made to `target` (theta_j). Returns what `step` returned."""
    start = [p.detach().clone() for p in behavior.parameters()]
    stats = step()
    with torch.no_grad():
        for p_target, p_behavior, p_start in zip(target.parameters(), behavior.parameters(), start, strict=True):
            p_target.add_(p_behavior - p_start)
    return stats


# ----------------------------------------------------------------------------------------------------------------------
# Learner update (runs on the behavior copy inside `delayed_update`)


def learn(behavior: nn.Module, optimizer: torch.optim.Optimizer, batch: dict, args: Args) -> dict:
    """One A2C gradient step of `behavior` on a rollout: obs [T+1, B, ...], actions/rewards/dones [T, B]."""
    obs, actions, rewards, dones = batch["obs"], batch["actions"], batch["rewards"], batch["dones"]
    T, B = actions.shape
    logits, values = behavior(obs.reshape(-1, *obs.shape[2:]))  # [(T+1) B, A], [(T+1) B]
    values = values.reshape(T + 1, B)
    returns = nstep_returns(rewards, dones, values[T].detach(), args.gamma)  # [T, B]
    losses = a2c_loss(logits[: T * B], values[:T].reshape(-1), actions.reshape(-1), returns.reshape(-1), args.vf_coef,
                      args.ent_coef)  # fmt: skip
    if not torch.isfinite(losses["total_loss"]):
        raise FloatingPointError(f"non-finite loss {losses['total_loss'].item()}")
    optimizer.zero_grad(set_to_none=True)
    losses["total_loss"].backward()
    grad_norm = nn.utils.clip_grad_norm_(behavior.parameters(), args.max_grad_norm)
    optimizer.step()
    return {k: v.item() for k, v in losses.items()} | {"grad_norm": grad_norm.item()}


def make_optimizer(model: nn.Module, args: Args) -> torch.optim.Optimizer:
    return torch.optim.RMSprop(model.parameters(), lr=args.learning_rate, alpha=args.rms_alpha, eps=args.rms_eps)


# ----------------------------------------------------------------------------------------------------------------------
# Worker bodies


def _worker_setup(parent_pid: int) -> None:
    """Let the main process decide about Ctrl+C, die with it (no orphans), one intra-op thread per worker. The main
    process may have died before prctl ran: then exit at once."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if sys.platform.startswith("linux"):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() != parent_pid:
        os._exit(0)
    torch.set_num_threads(1)


def fixed_mmap_threshold(nbytes: int = 4 << 20) -> None:
    """Serve allocations >= nbytes with mmap, returned to the OS when freed (glibc's default threshold grows up to 32
    MiB after such frees). The learner's per-minibatch float frames and activations then never pile up in the heap:
    without this, hts_ppo.py's learner RSS crept up by tens of MiB per minute on Breakout (benchmarks/)."""
    if sys.platform.startswith("linux"):
        try:
            ctypes.CDLL("libc.so.6").mallopt(-3, nbytes)  # M_MMAP_THRESHOLD; also turns off the dynamic threshold
        except (OSError, AttributeError):  # not glibc
            pass


def _run_worker(name: str, results, parent_pid: int, body: Callable, *body_args) -> None:
    """Run a worker body; on an exception, report name and traceback to the main process and exit non-zero."""
    _worker_setup(parent_pid)
    try:
        body(*body_args)
    except BaseException:
        results.put(("error", name, traceback.format_exc()))
        results.close()
        results.join_thread()
        os._exit(1)
    results.close()
    results.join_thread()


def executor(eid: int, lo: int, hi: int, args: Args, shared: dict, commands, requests, action_conn, lockstep,
             results) -> None:  # fmt: skip
    """Step envs lo..hi-1 for `sync_interval` per command, writing transitions into the storage the command names.
    `lockstep` (a barrier of all executors, `--sync` only) makes every env step wait for the slowest one (alpha = 1)."""
    envs = make_vector_env(args.env_id, hi - lo, args.seed + lo, protocol=args.atari_protocol, num_threads=1)
    obs, _ = envs.reset()
    shared["storage_obs"][:, :, lo:hi].zero_()  # map our slices of both storages now: RSS is flat after start-up
    rngs = None
    N, T = args.num_envs, args.sync_interval
    while True:
        start = time.perf_counter()
        command = commands.get()  # the batch-synchronization point: wait for the learner's go
        wait_learner = time.perf_counter() - start
        if command is None:
            break
        j, s, base_step = command  # collection index, storage index, global step at its start
        if rngs is None:  # per-env generators: sampling does not depend on how envs are split among executors
            rngs = [np.random.default_rng([args.seed, i, j]) for i in range(lo, hi)]
        episodes, wait_actor, wait_lockstep = [], 0.0, 0.0
        for t in range(T):
            obs_t = torch.from_numpy(obs)
            shared["state_obs"][lo:hi] = obs_t
            shared["state_u"][lo:hi] = torch.from_numpy(np.array([g.random() for g in rngs]))
            shared["storage_obs"][s, t, lo:hi] = obs_t
            start = time.perf_counter()
            requests.put(eid)
            action_conn.recv_bytes()  # an actor wrote our actions
            wait_actor += time.perf_counter() - start
            actions = shared["action"][lo:hi]
            obs, reward, terminated, truncated, info = envs.step(actions.numpy())
            shared["storage_actions"][s, t, lo:hi] = actions
            shared["storage_version"][s, t, lo:hi] = shared["action_version"][lo:hi]
            shared["storage_collection"][s, t, lo:hi] = j
            shared["storage_rewards"][s, t, lo:hi] = torch.from_numpy(reward)
            shared["storage_dones"][s, t, lo:hi] = torch.from_numpy((terminated | truncated).astype(np.float32))
            step = base_step + (t + 1) * N
            episodes += [(step, r, n) for r, n in finished_episodes(info)]
            if lockstep is not None:
                start = time.perf_counter()
                lockstep.wait()
                wait_lockstep += time.perf_counter() - start
        shared["storage_obs"][s, T, lo:hi] = torch.from_numpy(obs)
        results.put(("done", eid, j, episodes, wait_actor, wait_learner, wait_lockstep))
    envs.close()


def actor(aid: int, args: Args, shared: dict, model: nn.Module, version: torch.Tensor, requests, action_conns) -> None:
    """Serve executors as their requests arrive: forward, sample with their uniforms, answer through their pipe."""
    device = torch.device("cuda" if args.cuda and torch.cuda.is_available() else "cpu")
    local, local_version = (copy.deepcopy(model).to(device), -1) if device.type == "cuda" else (model, None)
    sizes = args.num_envs // args.num_executors
    wait = shared["actor_wait"]
    while True:
        start = time.perf_counter()
        eid = requests.get()
        wait[aid] += time.perf_counter() - start
        if eid is None:
            return
        v = int(version.item())  # stable during a collection: the learner publishes only between collections
        if local_version is not None and local_version != v:
            local.load_state_dict(model.state_dict())
            local_version = v
        lo, hi = eid * sizes, (eid + 1) * sizes
        with torch.no_grad():  # one executor's batch per forward: same shapes whatever the timing (determinism)
            logits, _ = local(shared["state_obs"][lo:hi].to(device))
            actions = sample_actions(logits.cpu(), shared["state_u"][lo:hi])
        shared["action"][lo:hi] = actions
        shared["action_version"][lo:hi] = v
        action_conns[eid].send_bytes(b"")


# ----------------------------------------------------------------------------------------------------------------------
# Main: validate, set up, spawn, train, shut down


def fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    raise SystemExit(2)


def validate(args: Args) -> tuple:
    """Check every flag before anything is spawned; returns the env's observation and action spaces."""
    for key, value in asdict(args).items():
        if isinstance(value, float) and not math.isfinite(value):
            fail(f"--{key.replace('_', '-')} must be a finite number, got {value}")
    if args.network not in NETWORKS:
        fail(f"--network must be one of {', '.join(NETWORKS)}, got {args.network!r}")
    if args.atari_protocol not in PROTOCOLS:
        fail(f"--atari-protocol must be one of {', '.join(PROTOCOLS)}, got {args.atari_protocol!r}")
    checks = [
        (args.num_envs >= 1, f"--num-envs must be >= 1, got {args.num_envs}"),
        (1 <= args.num_executors <= args.num_envs and args.num_envs % args.num_executors == 0,
         f"--num-executors must divide --num-envs {args.num_envs}, got {args.num_executors}"),
        (args.num_actors >= 1, f"--num-actors must be >= 1, got {args.num_actors}"),
        (args.torch_threads >= 0, f"--torch-threads must be >= 0 (0 = auto), got {args.torch_threads}"),
        (args.sync_interval >= 1, f"--sync-interval must be >= 1, got {args.sync_interval}"),
        (args.total_timesteps >= args.num_envs * args.sync_interval,
         f"--total-timesteps must be >= num_envs * sync_interval = {args.num_envs * args.sync_interval} (one rollout), "
         f"got {args.total_timesteps}"),
        (0.0 <= args.gamma <= 1.0, f"--gamma must be in [0, 1], got {args.gamma}"),
        (args.learning_rate > 0, f"--learning-rate must be > 0, got {args.learning_rate}"),
        (0.0 <= args.rms_alpha < 1.0, f"--rms-alpha must be in [0, 1), got {args.rms_alpha}"),
        (args.rms_eps > 0, f"--rms-eps must be > 0, got {args.rms_eps}"),
        (args.vf_coef >= 0, f"--vf-coef must be >= 0, got {args.vf_coef}"),
        (args.ent_coef >= 0, f"--ent-coef must be >= 0, got {args.ent_coef}"),
        (args.max_grad_norm > 0, f"--max-grad-norm must be > 0, got {args.max_grad_norm}"),
        (args.log_interval >= 1, f"--log-interval must be >= 1, got {args.log_interval}"),
        (args.console_interval > 0, f"--console-interval must be > 0, got {args.console_interval}"),
        (args.checkpoint_interval >= 0, f"--checkpoint-interval must be >= 0 seconds (0 = off), got "
         f"{args.checkpoint_interval}"),
        (args.eval_episodes >= 0, f"--eval-episodes must be >= 0, got {args.eval_episodes}"),
        (not args.capture_video or args.eval_episodes > 0,
         "--capture-video records the evaluation episodes; add --eval-episodes N (N >= 1)"),
        (bool(args.exp_name) and "/" not in args.exp_name, f"--exp-name must be a non-empty name without '/', got "
         f"{args.exp_name!r}"),
    ]  # fmt: skip
    for ok, message in checks:
        if not ok:
            fail(message)
    if args.resume is not None and not Path(args.resume).is_file():
        fail(f"--resume {args.resume!r}: no such file; pass the checkpoint.pt of an earlier run")
    try:
        check_env_args(args.env_id, args.num_envs, args.atari_protocol)
        envs = make_vector_env(args.env_id, 1, args.seed, protocol=args.atari_protocol, num_threads=1)
        spaces = envs.single_observation_space, envs.single_action_space
        envs.close()
        if not isinstance(spaces[1], gym.spaces.Discrete):
            fail(f"{args.env_id} has a continuous action space ({spaces[1]}); hts_a2c.py handles Discrete action "
                 f"spaces only (for continuous actions: apex.py --algo ddpg)")  # fmt: skip
        make_model(*spaces, args.network)
    except (EnvError, ValueError) as e:
        fail(str(e).splitlines()[0] if str(e) else type(e).__name__)
    if args.resume is not None:
        load_checkpoint(args.resume, checkpoint_meta(args, *spaces))
    return spaces


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


def checkpoint_meta(args: Args, observation_space, action_space) -> dict:
    """What a checkpoint must match to be resumed by this run: script, env, network and shapes."""
    return {
        "script": Path(__file__).name,
        "algo": None,
        "env_id": args.env_id,
        "atari_protocol": args.atari_protocol,
        "network": args.network
        if args.network != "auto"
        else ("nature" if len(observation_space.shape) == 3 else "mlp"),
        "obs_shape": list(observation_space.shape),
        "action_shape_or_n": int(action_space.n),
    }


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


class WorkerError(RuntimeError):
    """A worker process raised or died; the message names it and carries its traceback."""


class Stop(Exception):
    """SIGINT or SIGTERM arrived."""


def hyperparameter_table(args: Args) -> str:
    return "|param|value|\n|-|-|\n" + "\n".join(f"|{k}|{v}|" for k, v in asdict(args).items())


class WriteError(RuntimeError):
    """A checkpoint or model file could not be written; the message is the error line."""


def atomic_save(obj, path: Path) -> None:
    """torch.save, atomic: a temporary file, then a rename over the old file, so a full disk leaves the last good one.
    Serialised in memory first: torch.save to a full disk raises a cryptic "unexpected pos" instead of ENOSPC."""
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    tmp = path.with_suffix(".pt.tmp")
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


def quiet_writer_thread() -> None:
    """TensorBoard's writer thread dies of a full disk (OSError) and prints its traceback; the main thread gets the same
    error at its next write and reports it in one line, so the thread stays quiet about OSErrors."""
    default = threading.excepthook
    threading.excepthook = lambda hook_args: None if issubclass(hook_args.exc_type, OSError) else default(hook_args)


def save_checkpoint(path: Path, target: nn.Module, optimizer, global_step: int, update: int, args: Args,
                    meta: dict) -> None:  # fmt: skip
    """Write everything needed to continue the run (atomically)."""
    state = {
        "model": target.state_dict(),
        "optimizer": optimizer.state_dict(),
        "global_step": global_step,
        "update": update,
        "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},  # executors reseed per collection
        "args": asdict(args),
        "meta": meta,
    }
    atomic_save(state, path)


def evaluate(model: nn.Module, args: Args, run_dir: Path, device: torch.device) -> list[float]:
    """Play `eval_episodes` full games with the final policy (sampling, seeded), unclipped returns."""
    env = make_env(args.env_id, args.seed + 10_000, protocol=args.atari_protocol, capture_video=args.capture_video,
                   video_dir=str(run_dir / "videos"))  # fmt: skip
    generator = torch.Generator().manual_seed(args.seed)
    returns = []
    obs, _ = env.reset()
    while len(returns) < args.eval_episodes:
        with torch.no_grad():
            logits, _ = model(torch.as_tensor(np.asarray(obs)).unsqueeze(0).to(device))
        action = sample_actions(logits.cpu(), torch.rand(1, generator=generator))
        obs, _, terminated, truncated, info = env.step(int(action.item()))
        if terminated or truncated:
            returns.append(float(info["episode"]["r"]))
            obs, _ = env.reset()
    env.close()
    return returns


def main(args: Args) -> None:
    observation_space, action_space = validate(args)
    if args.resume:
        checkpoint = torch.load(args.resume, map_location="cpu", weights_only=False)
        run_dir = Path(args.resume).resolve().parent
    else:
        checkpoint = None
        run_dir = new_run_dir(args)
    if not os.access(run_dir, os.W_OK):
        fail(f"cannot write to the run directory {run_dir}")
    meta = checkpoint_meta(args, observation_space, action_space)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    torch.backends.cudnn.deterministic = args.torch_deterministic
    use_cuda = args.cuda and torch.cuda.is_available()
    device = torch.device("cuda" if use_cuda else "cpu")
    # By default the learner gets the cores the workers leave: oversubscribed intra-op threads spin and slowed updates
    # 10x here. A2C's short updates gain nothing from more: on Pong, 2 cores, 2 threads ran 372-386 SPS against 396-401
    # (hts_ppo's long PPO phase is the case for --torch-threads).
    torch.set_num_threads(args.torch_threads or max(1, (os.cpu_count() or 1) - args.num_executors - args.num_actors))
    fixed_mmap_threshold()  # inherited by the workers

    target = make_model(observation_space, action_space, args.network).to(device)  # theta_j, the policy updated
    behavior = copy.deepcopy(target)  # theta_{j-1}, which collected the data being learned: the optimizer steps here
    optimizer = make_optimizer(behavior, args)
    global_step, update = 0, 0
    if checkpoint is not None:
        target.load_state_dict(checkpoint["model"])
        behavior.load_state_dict(checkpoint["model"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        global_step, update = checkpoint["global_step"], checkpoint["update"]
        torch.set_rng_state(checkpoint["rng"]["torch"])
        random.setstate(checkpoint["rng"]["python"])
    published = copy.deepcopy(target).cpu().share_memory()  # what the actors run
    version = torch.zeros(1, dtype=torch.int64).share_memory_()
    version[0] = update  # parameters version = number of updates applied

    N, T, E = args.num_envs, args.sync_interval, args.num_executors
    obs_shape, obs_dtype = observation_space.shape, torch.from_numpy(np.zeros(1, observation_space.dtype)).dtype
    shared = {
        "state_obs": torch.zeros((N, *obs_shape), dtype=obs_dtype),  # state buffer: latest obs of every env
        "state_u": torch.zeros(N, dtype=torch.float64),  # executor-drawn uniforms for the actors' sampling
        "action": torch.zeros(N, dtype=torch.int64),  # action buffer
        "action_version": torch.zeros(N, dtype=torch.int64),  # parameters version that chose each action
        "actor_wait": torch.zeros(args.num_actors, dtype=torch.float64),  # seconds each actor waited on requests
        "storage_obs": torch.zeros((2, T + 1, N, *obs_shape), dtype=obs_dtype),  # two storages (Fig. 1e)
        "storage_actions": torch.zeros((2, T, N), dtype=torch.int64),
        "storage_rewards": torch.zeros((2, T, N)),
        "storage_dones": torch.zeros((2, T, N)),
        "storage_version": torch.full((2, T, N), -1, dtype=torch.int64),
        "storage_collection": torch.full((2, T, N), -1, dtype=torch.int64),
    }
    for tensor in shared.values():
        tensor.share_memory_()

    quiet_writer_thread()
    writer = SummaryWriter(str(run_dir))
    writer.add_text("hyperparameters", hyperparameter_table(args))
    checkpoint_path = run_dir / "checkpoint.pt"
    ctx = mp.get_context("spawn" if use_cuda else "fork")  # CUDA cannot be used in forked children
    results = ctx.Queue()
    requests = ctx.SimpleQueue()
    commands = [ctx.SimpleQueue() for _ in range(E)]
    pipes = [ctx.Pipe(duplex=False) for _ in range(E)]  # (executor end, actor end)
    lockstep = ctx.Barrier(E) if args.sync else None
    procs: dict[str, mp.Process] = {}
    parent_pid = os.getpid()
    k = N // E
    for e in range(E):
        procs[f"executor {e}"] = ctx.Process(
            target=_run_worker,
            args=(f"executor {e}", results, parent_pid, executor, e, e * k, (e + 1) * k, args, shared, commands[e],
                  requests, pipes[e][0], lockstep, results),
            daemon=True,
        )  # fmt: skip
    action_conns = [p[1] for p in pipes]
    for a in range(args.num_actors):
        procs[f"actor {a}"] = ctx.Process(
            target=_run_worker,
            args=(f"actor {a}", results, parent_pid, actor, a, args, shared, published, version, requests,
                  action_conns),
            daemon=True,
        )  # fmt: skip
    for p in procs.values():
        p.start()

    stop_signal = []
    previous_handlers = {
        s: signal.signal(s, lambda signum, _: stop_signal.append(signum)) for s in (signal.SIGINT, signal.SIGTERM)
    }

    def wait_collection(j: int) -> dict:
        """Block until every executor finished collection j (the batch-synchronization barrier)."""
        pending, start = set(range(E)), time.perf_counter()
        out = {"episodes": [], "executor_wait_actors": 0.0, "executor_wait_learner": 0.0, "executor_wait_lockstep": 0.0}
        while pending:
            if stop_signal:
                raise Stop
            try:
                message = results.get(timeout=0.5)
            except queue.Empty:
                message = None
            if message is not None and message[0] == "error":
                raise WorkerError(f"{message[1]} failed:\n{message[2]}")
            for name, p in procs.items():  # a killed actor leaves the others running: check every time
                if p.exitcode is not None:
                    raise WorkerError(f"{name} died (exit code {p.exitcode}) without a traceback")
            if message is None:
                continue
            _, eid, jj, episodes, wait_actors, wait_learner, wait_lockstep = message
            if jj != j:
                raise RuntimeError(f"executor {eid} finished collection {jj} while collection {j} was expected")
            pending.discard(eid)
            out["episodes"] += episodes
            out["executor_wait_actors"] += wait_actors / E
            out["executor_wait_learner"] += wait_learner / E
            out["executor_wait_lockstep"] += wait_lockstep / E
        out["learner_wait_executors"] = time.perf_counter() - start
        return out

    def start_collection(j: int, base_step: int) -> None:
        for q in commands:
            q.put((j, j % 2, base_step))

    def publish_and_start(j: int, base_step: int) -> None:
        """Publish the target parameters (version = updates applied so far), then start collection j if any."""
        published.load_state_dict(target.state_dict())
        version[0] = update
        if j < num_collections:
            start_collection(j, base_step)

    steps_per_collection = N * T
    num_collections = args.total_timesteps // steps_per_collection
    exit_code, message = 0, None
    start_time, last_console, last_checkpoint = time.time(), time.time(), time.time()
    start_step = global_step
    recent_returns: deque[float] = deque(maxlen=100)
    try:
        j = update
        if j < num_collections:
            start_collection(j, global_step)
        while j < num_collections:
            collected = wait_collection(j)
            for step, r, n in sorted(collected.pop("episodes")):  # not in the executors' (timing-dependent) order
                writer.add_scalar("charts/episodic_return", r, step)
                writer.add_scalar("charts/episodic_length", n, step)
                recent_returns.append(r)
            s = j % 2
            # Storage s holds D_j, collected by the published parameters: they become the behavior copy.
            behavior.load_state_dict(published.state_dict())
            behavior_version = int(version.item())
            stamps = shared["storage_version"][s]
            if not (bool((shared["storage_collection"][s] == j).all()) and bool((stamps == behavior_version).all())):
                raise RuntimeError(f"storage {s} is not entirely collection {j} by policy version {behavior_version}")
            batch = {
                "obs": shared["storage_obs"][s].to(device),
                "actions": shared["storage_actions"][s].to(device),
                "rewards": shared["storage_rewards"][s].to(device),
                "dones": shared["storage_dones"][s].to(device),
            }
            if not args.sync:  # HTS-RL: publish theta_j, executors fill the other storage while we learn from this one
                publish_and_start(j + 1, global_step + steps_per_collection)
            lr = args.learning_rate * (1.0 - j / num_collections if args.anneal_lr else 1.0)
            for group in optimizer.param_groups:
                group["lr"] = lr
            learn_start = time.perf_counter()
            if args.sync:  # behavior == target: a plain update of the current parameters
                stats = learn(behavior, optimizer, batch, args)
                target.load_state_dict(behavior.state_dict())
            else:
                stats = delayed_update(target, behavior, lambda: learn(behavior, optimizer, batch, args))  # noqa: B023
            learn_time = time.perf_counter() - learn_start
            policy_lag = update - behavior_version  # updates between the acting policy and the updated one
            update += 1
            global_step += steps_per_collection
            j += 1
            if args.sync:  # the executors waited for the new parameters
                publish_and_start(j, global_step)
            sps = (global_step - start_step) / max(time.time() - start_time, 1e-9)
            if update % args.log_interval == 0 or j == num_collections:
                for key, value in stats.items():
                    writer.add_scalar(f"losses/{key}", value, global_step)
                writer.add_scalar("charts/policy_lag", policy_lag, global_step)
                writer.add_scalar("charts/learning_rate", lr, global_step)
                writer.add_scalar("charts/SPS", sps, global_step)
                for key, value in collected.items():
                    writer.add_scalar(f"timing/{key}", value, global_step)
                writer.add_scalar("timing/actor_wait_requests", shared["actor_wait"].mean().item(), global_step)
                writer.add_scalar("timing/learner_update", learn_time, global_step)
            if time.time() - last_console >= args.console_interval or j == num_collections:
                mean_return = np.mean(recent_returns) if recent_returns else float("nan")
                print(f"global_step={global_step} SPS={sps:.0f} mean_return={mean_return:.2f}", flush=True)
                last_console = time.time()
            if args.checkpoint_interval > 0 and time.time() - last_checkpoint >= args.checkpoint_interval:
                save_checkpoint(checkpoint_path, target, optimizer, global_step, update, args, meta)
                last_checkpoint = time.time()
        if args.checkpoint_interval > 0:
            save_checkpoint(checkpoint_path, target, optimizer, global_step, update, args, meta)
    except Stop:
        exit_code = 128 + stop_signal[0]
        message = f"stopped by {signal.Signals(stop_signal[0]).name} at global step {global_step}"
        if args.checkpoint_interval > 0:
            try:
                save_checkpoint(checkpoint_path, target, optimizer, global_step, update, args, meta)
                message += f"; checkpoint written to {checkpoint_path}"
            except WriteError as e:
                exit_code, message = 1, f"{e}; stopping (the last good checkpoint is kept)"
    except WriteError as e:
        exit_code, message = 1, f"{e}; stopping (the last good checkpoint is kept)"
    except OSError as e:  # from the TensorBoard writer: the events file
        reason = "no space left on device" if e.errno == errno.ENOSPC else (e.strerror or str(e))
        exit_code, message = 1, f"error: {reason} while writing the TensorBoard events in {run_dir}; stopping"
    except WorkerError as e:
        exit_code, message = 1, f"error: {e}"
    except FloatingPointError as e:
        exit_code = 1
        message = f"error: {e} at update {update}; stopping (the last good checkpoint, if any, is kept)"
    finally:
        shutdown(procs, commands, requests, args.num_actors, results, graceful=exit_code == 0 and message is None)
        for signum, handler in previous_handlers.items():
            signal.signal(signum, handler)
    if exit_code == 0 and args.save_model:
        try:
            atomic_save(target.state_dict(), run_dir / "model.pt")
        except WriteError as e:
            exit_code, message = 1, str(e)
    if exit_code == 0:
        if args.eval_episodes > 0:
            for i, r in enumerate(evaluate(target, args, run_dir, device)):
                writer.add_scalar("eval/episodic_return", r, global_step + i)
                print(f"eval episode {i}: return {r:.2f}", flush=True)
    try:
        writer.close()
    except OSError as e:  # the events file could not be flushed: the error above, or this one
        message = message or f"error: {e.strerror or e} while writing the TensorBoard events in {run_dir}"
        exit_code = exit_code or 1
    if message:
        print(message, file=sys.stderr, flush=True)
    if exit_code:
        raise SystemExit(exit_code)


def shutdown(procs: dict, commands: list, requests, num_actors: int, results, graceful: bool) -> None:
    """Stop every worker within a few seconds: after a normal finish ask them (sentinels), otherwise (signal, dead
    worker: a killed process may hold a queue's lock) terminate; kill what is left."""
    if graceful:
        for q in commands:
            q.put(None)
        for _ in range(num_actors):
            requests.put(None)
        deadline = time.time() + 3.0
        for p in procs.values():
            p.join(timeout=max(0.0, deadline - time.time()))
    for p in procs.values():
        if p.is_alive():
            p.terminate()
    for p in procs.values():
        p.join(timeout=2.0)
        if p.is_alive():
            p.kill()
            p.join()
    results.cancel_join_thread()


if __name__ == "__main__":
    main(tyro.cli(Args))
