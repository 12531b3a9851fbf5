"""The CUDA paths of every script, run on a machine with an NVIDIA GPU (skipped where torch sees none, as in CI).

Each script runs a tiny Breakout budget with `--cuda` (the default) and must write every core tag with finite
values and a finite `model.pt` whose tensors say where the learner kept its model; Cleanba also runs one NCCL rank
under torchrun, GALA gossips through CUDA tensors shared between learner processes, and HTS-RL's determinism
promise is checked on the GPU (two runs, bitwise equal parameters). Run them with `pytest tests/test_cuda.py`."""

import math
import os
import subprocess
from pathlib import Path

import pytest
import torch
from helpers import only_run_dir, run_script, scalars

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

BREAKOUT = ["--env-id", "ALE/Breakout-v5"]
GPU_TAGS = ["charts/SPS", "charts/learning_rate", "losses/policy_loss", "losses/value_loss", "losses/total_loss",
             "losses/grad_norm"]  # fmt: skip
APEX_TAGS = ["charts/SPS", "charts/learning_rate", "losses/total_loss", "losses/grad_norm"]

# name -> (script, flags, tags, device of the saved tensors: None where the script saves CPU copies or the model lives
# in CPU shared memory)
# fmt: off
CASES = {
    "cleanba_ppo": ("cleanba_ppo_impala.py", ["--num-envs", "8", "--num-steps", "32", "--num-minibatches", "2",
                    "--update-epochs", "2", "--total-timesteps", "1024"], GPU_TAGS, "cuda"),
    "cleanba_ppo_sync": ("cleanba_ppo_impala.py", ["--sync", "--num-envs", "8", "--num-steps", "32",
                         "--num-minibatches", "2", "--total-timesteps", "512"], GPU_TAGS, "cuda"),
    "cleanba_impala": ("cleanba_ppo_impala.py", ["--algo", "impala", "--num-envs", "8", "--total-timesteps", "640"],
                       GPU_TAGS, "cuda"),
    "impala_batched": ("impala_monobeast.py", ["--num-actors", "2", "--unroll-length", "20", "--batch-size", "2",
                       "--total-timesteps", "400"], GPU_TAGS, "cuda"),
    "impala_actor_lstm": ("impala_monobeast.py", ["--inference", "actor", "--use-lstm", "--num-actors", "2",
                          "--unroll-length", "20", "--batch-size", "2", "--total-timesteps", "400"], GPU_TAGS, "cuda"),
    "gala_gossip": ("gala_a2c.py", ["--num-learners", "2", "--num-envs", "4", "--total-timesteps", "800"],
                    [*GPU_TAGS, "gossip/consensus_distance"], None),
    "gala_allreduce": ("gala_a2c.py", ["--mode", "allreduce", "--num-learners", "2", "--num-envs", "4",
                       "--total-timesteps", "800"], GPU_TAGS, None),
    "hts_a2c": ("hts_a2c.py", ["--num-envs", "4", "--num-executors", "2", "--num-actors", "2", "--total-timesteps",
                "800", "--log-frequency", "1"], GPU_TAGS, "cuda"),
    "hts_a2c_sync": ("hts_a2c.py", ["--sync", "--num-envs", "4", "--num-executors", "2", "--num-actors", "2",
                     "--total-timesteps", "800", "--log-frequency", "1"], GPU_TAGS, "cuda"),
    "hts_ppo": ("hts_ppo.py", ["--num-envs", "4", "--num-executors", "2", "--num-actors", "2", "--sync-interval", "32",
                "--num-minibatches", "2", "--total-timesteps", "512", "--log-frequency", "1"], GPU_TAGS, "cuda"),
    "a3c_hogwild": ("a3c_large_batch.py", ["--num-workers", "2", "--num-envs-per-worker", "4", "--total-timesteps",
                    "800", "--log-frequency", "5"], GPU_TAGS, None),
    "a3c_server": ("a3c_large_batch.py", ["--update", "server", "--num-workers", "2", "--num-envs-per-worker", "4",
                   "--total-timesteps", "800", "--log-frequency", "5"], GPU_TAGS, None),
    "apex_dqn": ("apex_dqn.py", ["--num-actors", "2", "--total-timesteps", "600", "--buffer-size", "600",
                 "--learning-starts", "200", "--eval-interval", "0", "--batch-size", "16", "--log-frequency", "5"],
                 APEX_TAGS, "cuda"),
}
# fmt: on


def run(script, args, log_dir, timeout=300, launcher=()):
    return run_script(script, ["--cuda", *args], log_dir, timeout, launcher=launcher)


def saved_tensors(run_dir):
    state = torch.load(run_dir / "model.pt", weights_only=True)  # no map_location: tensors come back where they were
    return [v for v in state.values() if torch.is_tensor(v)]


@pytest.mark.parametrize("name", list(CASES))
def test_breakout_on_the_gpu(name, tmp_path):
    script, flags, tags, model_device = CASES[name]
    proc = run(script, [*BREAKOUT, *flags, "--save-model"], tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    run_dir = only_run_dir(tmp_path)
    logged = scalars(run_dir)
    for tag in tags:
        assert logged.get(tag), f"{tag} missing: {sorted(logged)}"
        assert all(math.isfinite(v) for _, v in logged[tag]), (tag, logged[tag])
    tensors = saved_tensors(run_dir)
    assert tensors and all(torch.isfinite(v.float()).all() for v in tensors)
    if model_device is not None:
        assert {v.device.type for v in tensors} == {model_device}, {v.device for v in tensors}


def test_cleanba_one_nccl_rank_under_torchrun(tmp_path):
    """The multi-GPU path with the one GPU there is: NCCL all-reduce of the flat gradient, rank check at the end."""
    launcher = ("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "1")
    args = [*BREAKOUT, "--num-envs", "8", "--num-steps", "32", "--num-minibatches", "2", "--total-timesteps", "512"]
    proc = run("cleanba_ppo_impala.py", args, tmp_path, launcher=launcher)
    assert proc.returncode == 0, proc.stderr[-4000:]
    logged = scalars(only_run_dir(tmp_path))
    assert all(math.isfinite(v) for _, v in logged["losses/total_loss"])


@pytest.mark.parametrize("script", ["hts_a2c.py", "hts_ppo.py"])
def test_hts_bitwise_deterministic_on_the_gpu(script, tmp_path):
    """HTS-RL's promise (two runs with one seed give the same parameters) on the GPU, where cuDNN/cuBLAS must run
    their deterministic kernels."""
    flags = [*BREAKOUT, "--num-envs", "4", "--num-executors", "2", "--num-actors", "2", "--total-timesteps", "512",
             "--sync-interval", "32", "--torch-deterministic", "--save-model", "--seed", "3"]  # fmt: skip
    if script == "hts_ppo.py":
        flags += ["--num-minibatches", "2"]
    runs = []
    for i in range(2):
        proc = run(script, flags, tmp_path / str(i))
        assert proc.returncode == 0, proc.stderr[-4000:]
        runs.append(saved_tensors(only_run_dir(tmp_path / str(i))))
    assert len(runs[0]) == len(runs[1])
    assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True))


def test_no_process_of_these_tests_still_holds_the_gpu():
    """After the runs above, no process started by this test session still holds the GPU (clean shutdown of spawned
    CUDA workers). Processes are ours when they inherited pytest's PYTEST_CURRENT_TEST variable."""
    out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"],
                         capture_output=True, text=True, check=False)  # fmt: skip
    if out.returncode != 0:
        pytest.skip("nvidia-smi not available")
    ours = []
    for pid in {int(x) for x in out.stdout.split() if x.strip().isdigit()} - {os.getpid()}:
        try:
            if b"PYTEST_CURRENT_TEST=" in Path(f"/proc/{pid}/environ").read_bytes():
                ours.append((pid, Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")[:200]))
        except OSError:  # ended meanwhile, or another namespace's pid
            pass
    assert ours == [], ours
