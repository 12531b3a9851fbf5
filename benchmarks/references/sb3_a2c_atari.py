"""Stable-Baselines3's A2C at RL Zoo's Atari settings (rl_zoo3 hyperparams/a2c.yml, `atari`: AtariWrapper, 4 stacked
frames, CnnPolicy, 16 envs, ent_coef 0.01, vf_coef 0.25, RMSpropTFLike eps 1e-5; SB3's defaults otherwise: 5 steps,
lr 7e-4 constant, gamma 0.99, max_grad_norm 0.5), unmodified library code. This launcher adds only: each finished game's
return written to TensorBoard as charts/episodic_return (and its length, and the SPS) against agent steps, so
benchmarks/plot.py reads it as it reads our runs; a save every --save-every agent steps; and --resume from that save.
With SB3's own virtual environment, not this project's (benchmarks/RESULTS.md, Pong beside the references):
  python sb3_a2c_atari.py --env-id PongNoFrameskip-v4 --seed 1 --total-timesteps 2500000 --log-dir runs"""

import argparse
import os
import time

import ale_py
import gymnasium
from stable_baselines3 import A2C
from stable_baselines3.common.callbacks import BaseCallback
from stable_baselines3.common.env_util import make_atari_env
from stable_baselines3.common.sb2_compat.rmsprop_tf_like import RMSpropTFLike
from stable_baselines3.common.vec_env import VecFrameStack
from torch.utils.tensorboard import SummaryWriter

gymnasium.register_envs(ale_py)  # the Atari ids (NoFrameskip-v4 among them), as RL Zoo's import_envs does


class Episodes(BaseCallback):
    def __init__(self, run_dir, save_every):
        super().__init__()
        self.run_dir, self.save_every, self.next_save = run_dir, save_every, None
        self.writer, self.start, self.start_step = SummaryWriter(run_dir), time.time(), None

    def _on_step(self):
        if self.start_step is None:
            self.start_step = self.num_timesteps - self.training_env.num_envs
            self.next_save = (self.num_timesteps // self.save_every + 1) * self.save_every
        for info in self.locals["infos"]:
            if "episode" in info:  # Monitor's record of a whole game (all lives), unclipped
                self.writer.add_scalar("charts/episodic_return", info["episode"]["r"], self.num_timesteps)
                self.writer.add_scalar("charts/episodic_length", info["episode"]["l"], self.num_timesteps)
                sps = (self.num_timesteps - self.start_step) / (time.time() - self.start)
                self.writer.add_scalar("charts/SPS", sps, self.num_timesteps)
                print(
                    f"global_step={self.num_timesteps} episodic_return={info['episode']['r']} SPS={sps:.0f}", flush=True
                )
        if self.num_timesteps >= self.next_save:
            self.model.save(os.path.join(self.run_dir, "model.zip"))
            self.next_save += self.save_every
        return True

    def _on_training_end(self):
        self.model.save(os.path.join(self.run_dir, "model.zip"))
        self.writer.close()


p = argparse.ArgumentParser()
p.add_argument("--env-id", default="PongNoFrameskip-v4")
p.add_argument("--seed", type=int, default=1)
p.add_argument("--total-timesteps", type=int, default=2_500_000)
p.add_argument("--log-dir", default="runs")
p.add_argument("--save-every", type=int, default=100_000)
p.add_argument("--resume", default=None, help="a run directory whose model.zip this run continues")
a = p.parse_args()
env = VecFrameStack(make_atari_env(a.env_id, n_envs=16, seed=a.seed), n_stack=4)
if a.resume:
    run_dir, model = a.resume, A2C.load(os.path.join(a.resume, "model.zip"), env=env)
else:
    run_dir = os.path.join(a.log_dir, f"{a.env_id}__sb3_a2c__{a.seed}__{int(time.time())}")
    os.makedirs(run_dir)
    model = A2C(
        "CnnPolicy",
        env,
        ent_coef=0.01,
        vf_coef=0.25,
        seed=a.seed,
        verbose=0,
        device="cpu",
        policy_kwargs=dict(optimizer_class=RMSpropTFLike, optimizer_kwargs=dict(eps=1e-5)),
    )
print(f"run directory: {run_dir}, from step {model.num_timesteps}", flush=True)
try:
    model.learn(
        total_timesteps=a.total_timesteps - model.num_timesteps,
        callback=Episodes(run_dir, a.save_every),
        reset_num_timesteps=False,
    )
except KeyboardInterrupt:  # Ctrl+C: the save above is the checkpoint (every --save-every steps) plus this one
    model.save(os.path.join(run_dir, "model.zip"))
    print(f"stopped at step {model.num_timesteps}; saved {run_dir}/model.zip", flush=True)
