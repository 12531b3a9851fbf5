"""Environments shared by every script: ALE games through ale-py's C++ vector env, anything else through gymnasium.

`make_vector_env` is what actors and executors step; `make_env` is one environment for evaluation and video, with
the same preprocessing. Both speak gymnasium's API with `SameStep` autoreset: when a sub-environment ends, the
observation returned with `terminated | truncated` is already the first one of its next episode (the last one is in
`info["final_obs"]`), so every step an agent takes is a usable transition.

ALE ids (`ALE/Breakout-v5`, `BreakoutNoFrameskip-v4`, ...) name only the game; the preprocessing is set by
`protocol`, whatever the id's version suffix would imply:

- `deepmind` (default; Mnih et al. 2015, the setting of the GALA, IMPALA, HTS-RL and A3C papers): 84x84 grayscale,
  frame skip 4 with a max-pool over the last 2 frames, up to 30 no-ops and FIRE on reset, end of life signalled as
  `terminated` for training (the game itself goes on, and the frame stack starts afresh: the frames from before the
  lost life read as zeros, as after a new game and as DQN's replay memory zeroes frames across a terminal), rewards
  clipped to [-1, 1], 4 stacked frames, no sticky actions, minimal action set, episodes cut at 108,000 frames.
- `machado` (Machado et al. 2018, as in Cleanba's evaluation): the same frames, but sticky actions with probability
  0.25, the full 18-action set, no life-loss signal and no no-op starts (`noop_max=1`, as Cleanba passes to envpool).

Whatever the protocol, `info["episode"]` holds the true game's return and length (all lives, unclipped rewards,
length in agent steps) for the sub-environments flagged in `info["_episode"]`, the layout of gymnasium's
`RecordEpisodeStatistics`. That is what every script logs as `charts/episodic_return`.

Training rewards are clipped unless `clip_rewards=False`, for a script that clips in its loss (impala_monobeast, as
TorchBeast does) and so must see the raw rewards.

Differences from the Python wrappers of OpenAI baselines (which TorchBeast uses): FIRE is pressed once per game, on
reset (ale-py's `use_fire_reset`), not after each lost life, since that would take an env step the agent did not
choose; after a new game or a lost life the frame stack holds zeros plus the newest frame, where baselines repeats
the first frame 4 times.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import importlib
import os
import tempfile
import warnings
from pathlib import Path
from typing import Any

import gymnasium as gym
import numpy as np

PROTOCOLS = ("deepmind", "machado")
ATARI_MAX_FRAMES = 108_000  # frames per episode (Machado et al. 2018; Hessel et al. 2018, Table 3)
FRAME_SKIP = 4  # emulator frames per agent step on ALE ids (Mnih et al. 2015), whatever the protocol
STACK = 4  # stacked frames per observation (Mnih et al. 2015)

# ale-py constructor settings of each protocol; the keys below the blank line are applied in Python by
# `EpisodeStatistics` (life-loss signal and clipping need the true, unclipped game underneath).
_PROTOCOL_SETTINGS = {
    "deepmind": dict(repeat_action_probability=0.0, full_action_space=False, noop_max=30, life_loss=True),
    "machado": dict(repeat_action_probability=0.25, full_action_space=True, noop_max=1, life_loss=False),
}


class EnvError(ValueError):
    """A bad env id or env flag; `str(error)` is one line saying what is wrong and what would be right."""


@functools.cache
def _registry() -> dict[str, Any]:
    import ale_py  # registers the ALE ids with gymnasium

    gym.register_envs(ale_py)
    return gym.registry


def ale_game(env_id: str) -> str | None:
    """The ale-py ROM name (`breakout`) behind a registered ALE id, or None for any other gymnasium id.

    Raises EnvError for an id gymnasium does not know, suggesting close matches. Like `gym.make`, it accepts
    `module:EnvId` and imports `module` first (e.g. `benchmarks.measure:Straggler-v0`), so a user's own
    registered env needs no change here.
    """
    registry = _registry()
    if ":" in env_id:
        module, env_id = env_id.split(":", 1)
        try:
            importlib.import_module(module)
        except ImportError as e:
            raise EnvError(f"cannot import {module!r} for env id {env_id!r}: {e}") from None
    if env_id not in registry:
        close = difflib.get_close_matches(env_id, list(registry), n=3, cutoff=0.6)
        hint = f"; did you mean {' or '.join(close)}?" if close else "; see gymnasium.pprint_registry() for ids"
        raise EnvError(f"unknown env id {env_id!r}{hint}")
    spec = registry[env_id]
    entry = spec.entry_point if isinstance(spec.entry_point, str) else ""
    if entry.startswith("ale_py"):
        return spec.kwargs["game"]
    return None


def check_env_args(env_id: str, num_envs: int = 1, protocol: str = "deepmind", batch_size: int = 0) -> None:
    """Validate env flags before anything is spawned; raises EnvError with a one-line message."""
    if protocol not in PROTOCOLS:
        raise EnvError(f"--atari-protocol must be one of {', '.join(PROTOCOLS)}, got {protocol!r}")
    if num_envs < 1:
        raise EnvError(f"the number of environments must be >= 1, got {num_envs}")
    game = ale_game(env_id)
    if batch_size and game is None:
        raise EnvError(f"async batches (batch_size={batch_size}) need an ALE id; {env_id!r} is not one")
    if not 0 <= batch_size <= num_envs:
        raise EnvError(f"batch_size must be in [0, num_envs={num_envs}] (0 = all envs each step), got {batch_size}")


class EpisodeStatistics(gym.vector.VectorWrapper):
    """Reports true game returns and lengths; for ALE training envs also signals life loss and clips rewards.

    The wrapped env must run unclipped and without a life-loss signal, so the statistics see the real game.
    Works in ale-py's async mode too: `info["env_id"]` says which sub-environments a `recv` returned.
    """

    def __init__(
        self, env: gym.vector.VectorEnv, *, life_loss: bool = False, clip_rewards: bool = False, seed: int | None = None
    ):
        super().__init__(env)
        self.life_loss, self.clip_rewards, self._seed = life_loss, clip_rewards, seed
        n = self.num_envs
        self._return = np.zeros(n, dtype=np.float64)  # running game return (unclipped, all lives)
        self._length = np.zeros(n, dtype=np.int64)  # running game length in agent steps
        self._lives = np.full(n, -1, dtype=np.int64)  # -1: not seen since reset
        self._fresh = np.full(n, STACK, dtype=np.int64)  # frames seen since a life loss (STACK: none to hide)
        self._acted = np.zeros(n, dtype=bool)  # an action was sent since the env's last observation
        self._last_ids = np.arange(n)

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        if seed is None:
            seed = self._seed  # the factory's seed applies to the first reset only
        self._seed = None
        obs, info = self.env.reset(seed=seed, options=options)
        mask = np.ones(self.num_envs, bool) if not options or "reset_mask" not in options else options["reset_mask"]
        self._return[mask], self._length[mask], self._lives[mask], self._acted[mask] = 0.0, 0, -1, False
        self._fresh[mask] = STACK
        self._last_ids = info.get("env_id", np.arange(len(obs)))
        if "lives" in info:
            self._lives[self._last_ids] = info["lives"]
        return obs, info

    def send(self, actions: np.ndarray) -> None:
        """ale-py async mode: act in the sub-environments returned by the last `recv` (or `reset`)."""
        self._acted[self._last_ids] = True
        self.env.send(actions)

    def recv(self):
        return self._track(*self.env.recv())

    def step(self, actions: np.ndarray):
        self._acted[self._last_ids] = True
        return self._track(*self.env.step(actions))

    def _track(self, obs, reward, terminated, truncated, info):
        ids = info.get("env_id", np.arange(len(obs)))
        self._last_ids = ids
        acted = self._acted[ids]  # False for a first observation after an async reset: no agent step happened
        self._acted[ids] = False
        reward = np.asarray(reward, dtype=np.float32)
        self._return[ids] += np.where(acted, reward, 0.0)
        self._length[ids] += acted
        game_over = (terminated | truncated) & acted
        info["episode"] = {"r": self._return[ids].astype(np.float32), "l": self._length[ids].copy()}
        info["_episode"] = game_over
        self._return[ids[game_over]], self._length[ids[game_over]] = 0.0, 0
        if "lives" in info:
            lives = info["lives"].astype(np.int64)
            prev = self._lives[ids]
            if self.life_loss:  # DeepMind: a lost life ends the training episode, not the game
                lost = (prev >= 0) & (lives < prev) & acted
                terminated = terminated | lost
                obs = self._restart_stack(obs, ids, lost, game_over, acted)
            self._lives[ids] = lives  # after a game over, `lives` already belongs to the new game
        if self.clip_rewards:
            reward = np.clip(reward, -1.0, 1.0)
        return obs, reward, terminated, truncated, info

    def _restart_stack(self, obs, ids: np.ndarray, lost: np.ndarray, game_over: np.ndarray, acted: np.ndarray):
        """A lost life starts a new training episode: zero the stacked frames (axis 1, oldest first) from before it,
        in this observation and the next STACK - 2, as the C++ env does after a new game."""
        fresh = np.minimum(self._fresh[ids] + acted, STACK)
        fresh = np.where(lost, 1, np.where(game_over, STACK, fresh))  # a game over: the C++ env restarted the stack
        self._fresh[ids] = fresh
        hide = STACK - fresh  # [n] oldest frames to zero
        if hide.any():
            obs = obs.copy()  # the C++ env's own buffer must not change
            obs[np.arange(STACK)[None, :] < hide[:, None]] = 0
        return obs


def make_vector_env(
    env_id: str,
    num_envs: int,
    seed: int,
    *,
    protocol: str = "deepmind",
    train: bool = True,
    num_threads: int = 0,
    batch_size: int = 0,
    clip_rewards: bool = True,
) -> EpisodeStatistics:
    """A gymnasium vector env of `num_envs` sub-environments with batched numpy observations.

    ALE ids run in ale-py's C++ `AtariVectorEnv` (`num_threads` stepping threads, 0 = one per core;
    `batch_size` > 0 turns on its async mode: `send` actions for the envs of the last `recv`, which returns the
    first `batch_size` envs to finish; benchmarks/throughput.py's env table measures it). Other ids run in gymnasium's
    SyncVectorEnv: the scripts run their envs inside worker processes already.
    `train=False` turns off the life-loss signal and reward clipping (evaluation); `clip_rewards=False` turns off
    the clipping only, for a script that clips in its loss. The first `reset()` without a seed seeds
    sub-environment i with `seed + i`; on ALE ids `seed` is first taken modulo ale-py's signed 32-bit range, so a
    resumed run's shifted seed (`1_000_003 * updates`) still fits.
    """
    check_env_args(env_id, num_envs, protocol, batch_size)
    game = ale_game(env_id)
    if game is not None:
        from ale_py.vector_env import AtariVectorEnv

        seed %= 2**31 - num_envs  # the C++ reset takes int32 seeds, seed + i each; smaller seeds are unchanged
        settings = dict(_PROTOCOL_SETTINGS[protocol])
        life_loss = settings.pop("life_loss")
        env = AtariVectorEnv(
            game,
            num_envs,
            batch_size=batch_size,
            num_threads=num_threads,
            autoreset_mode=gym.vector.AutoresetMode.SAME_STEP,
            max_num_frames_per_episode=ATARI_MAX_FRAMES,
            img_height=84,
            img_width=84,
            grayscale=True,
            stack_num=STACK,
            frameskip=FRAME_SKIP,
            maxpool=True,
            use_fire_reset=True,
            episodic_life=False,  # would reset the whole game on a life loss; we signal it instead
            life_loss_info=False,
            reward_clipping=False,  # clipped in EpisodeStatistics, after the true return is counted
            **settings,
        )
        env.single_action_space.seed(seed)
        return EpisodeStatistics(env, life_loss=life_loss and train, clip_rewards=train and clip_rewards, seed=seed)
    try:
        gym.make(env_id).close()  # surface missing extras (box2d, mujoco) as one line, before spawning anything
    except gym.error.Error as e:
        raise EnvError(f"cannot make {env_id!r}: {e}") from None
    env = gym.vector.SyncVectorEnv(
        [functools.partial(gym.make, env_id) for _ in range(num_envs)],
        autoreset_mode=gym.vector.AutoresetMode.SAME_STEP,
    )
    env.single_action_space.seed(seed)
    return EpisodeStatistics(env, seed=seed)


class _SingleFromVector(gym.Env):
    """One environment out of a size-1 `EpisodeStatistics` vector env (so ALE preprocessing is the C++ one)."""

    metadata = {"render_modes": ["rgb_array"], "render_fps": 15}

    def __init__(self, vector_env: EpisodeStatistics):
        self.vector_env = vector_env
        self.observation_space = vector_env.single_observation_space
        self.action_space = vector_env.single_action_space
        self.render_mode = "rgb_array"
        self._obs = None

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        super().reset(seed=seed)
        obs, info = self.vector_env.reset(seed=seed)
        self._obs = obs[0]
        return obs[0], {k: v[0] for k, v in info.items()}

    def step(self, action):
        obs, reward, terminated, truncated, info = self.vector_env.step(np.asarray([action], dtype=np.int64))
        self._obs = obs[0]
        out = {k: v[0] for k, v in info.items() if k not in ("episode", "_episode", "final_obs")}
        if info["_episode"][0]:
            out["episode"] = {"r": float(info["episode"]["r"][0]), "l": int(info["episode"]["l"][0])}
            self._obs = info["final_obs"][0]
        return obs[0], float(reward[0]), bool(terminated[0]), bool(truncated[0]), out

    def render(self) -> np.ndarray:
        """The agent's own view: the newest 84x84 grayscale frame, scaled 4x, as RGB (ale-py's vector env keeps
        no colour screen)."""
        frame = self._obs[-1]
        return np.repeat(np.repeat(frame, 4, axis=0), 4, axis=1)[..., None].repeat(3, axis=-1)

    def close(self):
        self.vector_env.close()


def make_env(
    env_id: str,
    seed: int,
    *,
    protocol: str = "deepmind",
    capture_video: bool = False,
    video_dir: str | None = None,
) -> gym.Env:
    """One evaluation environment with the training preprocessing, ending only at game over, rewards unclipped.

    `info["episode"] = {"r", "l"}` arrives with the step that ends a game. The env comes seeded (reset once with
    `seed`), so later `reset()` calls give the same episode sequence for the same seed. With `capture_video`,
    every episode is written as mp4 to `video_dir` (needs moviepy: `pip install -e ".[video]"`).
    """
    check_env_args(env_id, 1, protocol)
    if ale_game(env_id) is not None:
        env = _SingleFromVector(make_vector_env(env_id, 1, seed, protocol=protocol, train=False, num_threads=1))
    else:
        if capture_video:  # frames drawn off-screen: SDL (pygame) needs no display, and would print an `error:` line
            os.environ.setdefault("SDL_VIDEODRIVER", "dummy")  # of its own on a machine without one
        env = gym.wrappers.RecordEpisodeStatistics(gym.make(env_id, render_mode="rgb_array" if capture_video else None))
        env.action_space.seed(seed)
    if capture_video:
        if not video_dir:
            raise EnvError("capture_video needs a video_dir")
        try:
            env = gym.wrappers.RecordVideo(env, video_dir, episode_trigger=lambda _: True, disable_logger=True)
        except gym.error.DependencyNotInstalled as e:
            raise EnvError(f'--capture-video needs moviepy: pip install -e ".[video]" ({e})') from None
    try:
        env.reset(seed=seed)  # with capture_video, the first frame is rendered here
    except gym.error.DependencyNotInstalled as e:  # the env's renderer, e.g. pygame for classic control
        env.close()
        with contextlib.suppress(OSError):
            Path(video_dir).rmdir()  # RecordVideo made it and recorded nothing: leave no empty folder behind
        raise EnvError(f"--capture-video cannot render {env_id}: {str(e).splitlines()[0]}") from None
    return env


def check_video(env_id: str, protocol: str = "deepmind") -> None:
    """For `--capture-video`, before anything starts: raises EnvError (one line) unless an evaluation env of `env_id`
    can render its frames and write mp4 (moviepy), so that a run does not fail only at its final evaluation."""
    with tempfile.TemporaryDirectory(prefix="check-video-") as tmp, warnings.catch_warnings():
        warnings.simplefilter("ignore")  # RecordVideo's "zero frames to save" at close
        make_env(env_id, 0, protocol=protocol, capture_video=True, video_dir=str(Path(tmp) / "videos")).close()


def finished_episodes(info: dict) -> list[tuple[float, int]]:
    """(return, length) of every game that ended in this vector step, from `info` of `EpisodeStatistics`."""
    done = info.get("_episode")
    if done is None or not done.any():
        return []
    returns, lengths = info["episode"]["r"][done], info["episode"]["l"][done]
    return [(float(r), int(n)) for r, n in zip(returns, lengths, strict=True)]
