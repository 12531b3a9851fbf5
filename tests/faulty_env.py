"""Envs that fail on purpose, for the crash, non-finite-loss and missing-renderer tests
(`--env-id tests.faulty_env:NaNCartPole-v0`)."""

import gymnasium as gym
from gymnasium.envs.classic_control import CartPoleEnv


class FaultyCartPole(CartPoleEnv):
    def __init__(self, fault: str, after: int):
        super().__init__()
        self.fault, self.after, self.steps = fault, after, 0

    def step(self, action):
        self.steps += 1
        obs, reward, terminated, truncated, info = super().step(action)
        if self.steps > self.after:
            if self.fault == "crash":
                raise RuntimeError("injected env failure")
            reward = float("nan")
        return obs, reward, terminated, truncated, info


class UnrenderableCartPole(CartPoleEnv):
    """CartPole on a machine without its renderer (pygame), whatever this machine has."""

    def render(self):
        raise gym.error.DependencyNotInstalled("pygame is not installed (this env's renderer)")


gym.register("CrashingCartPole-v0", entry_point=FaultyCartPole, kwargs=dict(fault="crash", after=300))
gym.register("NaNCartPole-v0", entry_point=FaultyCartPole, kwargs=dict(fault="nan", after=300))
gym.register("UnrenderableCartPole-v0", entry_point=UnrenderableCartPole)
