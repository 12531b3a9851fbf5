"""A straggler environment: every step sleeps for a random time, so step-time variance can be set at will.

HTS-RL's Claim 1 (Eq. 7) and Fig. 4 are about environments whose step time varies: a synchronous A2C waits for the
slowest env at every step, HTS-RL only every alpha steps. `Straggler-v0` sleeps for a Gamma-distributed time with the
given mean and standard deviation (std 0: constant; std = mean: exponential, the paper's simulation) and otherwise
is a trivial control task (CartPole's observations and dynamics), so learning code runs on it unchanged.

Importing this module registers `Straggler-v0`; scripts take it as `--env-id benchmarks.straggler:Straggler-v0`
(common.atari imports the module before the lookup). Since scripts build envs by id alone, the step time is set by
environment variables, read when the env is made (worker processes inherit them):

    STRAGGLER_MEAN_MS=5 STRAGGLER_STD_MS=5 python hts_a2c.py --env-id benchmarks.straggler:Straggler-v0
    gym.make("benchmarks.straggler:Straggler-v0", mean_ms=5.0, std_ms=10.0)  # or as keyword arguments
"""

from __future__ import annotations

import os
import time

import gymnasium as gym
import numpy as np
from gymnasium.envs.classic_control.cartpole import CartPoleEnv


class StragglerEnv(CartPoleEnv):
    """CartPole whose every step takes a Gamma(mean, std)-distributed wall-clock time (sleep, no CPU use)."""

    def __init__(self, mean_ms: float | None = None, std_ms: float | None = None, render_mode: str | None = None):
        super().__init__(render_mode=render_mode)
        self.mean_s = float(os.environ.get("STRAGGLER_MEAN_MS", 2.0) if mean_ms is None else mean_ms) / 1000
        self.std_s = float(os.environ.get("STRAGGLER_STD_MS", 2.0) if std_ms is None else std_ms) / 1000
        if self.mean_s < 0 or self.std_s < 0:
            raise ValueError(f"step time mean and std must be >= 0 ms, got {self.mean_s * 1e3}, {self.std_s * 1e3}")
        self._timing_rng = np.random.default_rng()  # step times are timing only: they never touch the trajectory

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        if seed is not None:
            self._timing_rng = np.random.default_rng(seed + 1_000_003)
        return super().reset(seed=seed, options=options)

    def step_time(self) -> float:
        """One draw of the step time in seconds: Gamma with shape (mean/std)^2 and scale std^2/mean."""
        if self.std_s == 0 or self.mean_s == 0:
            return self.mean_s
        shape = (self.mean_s / self.std_s) ** 2
        return float(self._timing_rng.gamma(shape, self.std_s**2 / self.mean_s))

    def step(self, action):
        time.sleep(self.step_time())
        return super().step(action)


if "Straggler-v0" not in gym.registry:
    gym.register("Straggler-v0", entry_point=StragglerEnv, max_episode_steps=500)
