"""apex.py: the sum/min trees against linear scans and a chi-square test, distributed sampling shares and importance
weights by hand, the taint (slot-version) check, n-step transitions and double-Q targets against references;
end-to-end DQN on CartPole and Breakout, DDPG on Pendulum, the torchrun/rpc launch with 2 actor ranks; bad flags, a
crashing actor, SIGINT."""

import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import torch
import tyro
from helpers import (
    ROOT,
    assert_finite_tags,
    fill_disk,
    only_run_dir,
    run_script,
    scalars,
    small_tmpfs,
    write_unusable_checkpoint,
)

import apex
from apex import (
    Args,
    Learner,
    LocalReplay,
    NStepBuilder,
    PrioritizedBuffer,
    actor_loop,
    apex_epsilons,
    double_q_targets,
    frame_skip,
    importance_exponent,
    importance_weights,
    main,
    pull_interval_steps,
    sample_batch,
    setup_machine,
    split_updates,
    tree_capacity,
    tree_find_prefix,
    tree_update,
)

SCRIPT = "apex.py"
CTX = multiprocessing.get_context("fork")
# a learner that starts at once and keeps up on 2 cores: CartPole-sized settings
TINY = ["--num-actors", "2", "--learning-starts", "200", "--batch-size", "32", "--actor-batch", "20",
        "--actor-update-interval", "20", "--target-network-frequency", "20", "--optimizer", "adam",
        "--learning-rate", "1e-3", "--log-frequency", "5", "--log-interval", "1",
        "--hidden-sizes", "32", "32"]  # fmt: skip


# ------------------------------------------------------------------ sum-tree and min-tree


def filled_trees(priorities: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    P = tree_capacity(len(priorities))
    sum_tree, min_tree = np.zeros(2 * P), np.full(2 * P, np.inf)
    leaves = np.arange(len(priorities))
    tree_update(sum_tree, leaves, priorities, np.add)
    tree_update(min_tree, leaves, priorities, np.minimum)
    return sum_tree, min_tree


def test_tree_capacity_is_the_next_power_of_two():
    assert [tree_capacity(c) for c in (1, 2, 3, 4, 5, 1000, 1024)] == [1, 2, 4, 4, 8, 1024, 1024]


def test_sampling_frequencies_match_priorities_chi_square():
    rng = np.random.default_rng(0)
    priorities = np.array([0.5, 1.0, 2.0, 4.0, 0.25, 3.0, 1.5, 0.75, 2.5, 1.25])  # 10 leaves in a 16-leaf tree
    sum_tree, _ = filled_trees(priorities)
    draws = 5000
    leaves = tree_find_prefix(sum_tree, rng.random(draws) * sum_tree[1])
    observed = np.bincount(leaves, minlength=len(priorities))
    assert observed.sum() == draws and len(observed) == len(priorities)  # never an empty leaf
    expected = draws * priorities / priorities.sum()
    chi2 = ((observed - expected) ** 2 / expected).sum()
    assert chi2 < 27.88, (chi2, observed, expected)  # chi-square, 9 degrees of freedom, p = 0.001


@pytest.mark.parametrize("size", [1, 7, 64, 1000])
def test_prefix_search_matches_a_linear_scan(size):
    rng = np.random.default_rng(size)
    priorities = rng.random(size) + 1e-3
    sum_tree, _ = filled_trees(priorities)
    assert sum_tree[1] == pytest.approx(priorities.sum())
    prefixes = rng.random(500) * priorities.sum()
    cumulative = np.cumsum(priorities)
    # linear scan: the first i with prefix < p_0 + ... + p_i
    expected = [next(i for i in range(size) if x < cumulative[i]) for x in prefixes]
    np.testing.assert_array_equal(tree_find_prefix(sum_tree, prefixes), expected)


def test_min_and_sum_trees_correct_after_updates():
    rng = np.random.default_rng(1)
    priorities = rng.random(37) + 0.1
    sum_tree, min_tree = filled_trees(priorities)
    for _ in range(50):
        leaves = rng.choice(37, size=rng.integers(1, 6), replace=False)
        values = rng.random(len(leaves)) * rng.choice([0.01, 1.0, 100.0])
        priorities[leaves] = values
        tree_update(sum_tree, leaves, values, np.add)
        tree_update(min_tree, leaves, values, np.minimum)
        assert min_tree[1] == priorities.min()
        assert sum_tree[1] == pytest.approx(priorities.sum(), rel=1e-12)
    P = len(sum_tree) // 2
    for node in range(1, P):  # every internal node, not only the root
        assert min_tree[node] == min(min_tree[2 * node], min_tree[2 * node + 1])
        assert sum_tree[node] == pytest.approx(sum_tree[2 * node] + sum_tree[2 * node + 1])


# ------------------------------------------------------------------ distributed buffers, weights, taint


def make_buffer(capacity: int) -> PrioritizedBuffer:
    return PrioritizedBuffer(capacity, (2,), torch.float32, (), torch.int64, CTX.Lock()).share_memory_()


def transitions(k: int, tag: float) -> dict:
    """k transitions whose observation says where they came from: obs[:, 0] = tag, obs[:, 1] = index."""
    obs = torch.stack([torch.full((k,), tag), torch.arange(k, dtype=torch.float32)], dim=1)
    zeros = torch.zeros(k, dtype=torch.int64)
    return dict(obs=obs, actions=zeros, returns=torch.zeros(k), discounts=torch.ones(k), next_obs=obs.clone(),
                policy_version=zeros)  # fmt: skip


def test_distributed_sampling_shares_follow_priority_sums_and_weights_match_the_formula():
    rng = np.random.default_rng(2)
    priorities = [np.array([1.0, 2.0, 3.0, 4.0]), np.array([0.5] * 6), np.array([10.0, 0.2])]  # sums 10, 3, 10.2
    buffers = [make_buffer(8) for _ in priorities]
    for b, (buffer, p) in enumerate(zip(buffers, priorities, strict=True)):
        buffer.append(transitions(len(p), float(b)), p)
    replay = LocalReplay(buffers, rng)
    beta, draws = 0.4, 0
    counts = np.zeros(3)
    all_p = np.concatenate(priorities)
    N, total = len(all_p), all_p.sum()
    w_max = (N * all_p.min() / total) ** -beta  # the largest weight of any slot in any buffer
    for _ in range(200):
        batch, buffer_ids, _ = sample_batch(replay, 64, beta, rng)
        draws += 64
        np.testing.assert_array_equal(batch["obs"][:, 0].numpy(), buffer_ids)  # ids say where each sample came from
        counts += np.bincount(buffer_ids, minlength=3)
        p_i = np.array([priorities[b][int(j)] for b, j in zip(buffer_ids, batch["obs"][:, 1], strict=True)])
        np.testing.assert_allclose(batch["weights"].numpy(), (N * p_i / total) ** -beta / w_max, rtol=1e-6)
    sums = np.array([p.sum() for p in priorities])
    np.testing.assert_allclose(counts / draws, sums / sums.sum(), atol=0.015)


def test_importance_weights_known_values():
    w = importance_weights(np.array([1.0, 2.0, 4.0]), 1.0, 0.5)
    np.testing.assert_allclose(w, [1.0, 2**-0.5, 0.5])


def test_taint_overwritten_slot_keeps_its_new_priority():
    rng = np.random.default_rng(3)
    buffer = make_buffer(4)
    buffer.append(transitions(4, 0.0), np.array([1.0, 1.0, 1.0, 1.0]))
    sampled = buffer.sample(64, rng)  # all four slots, with the versions they had
    assert set(sampled["slots"].tolist()) == {0, 1, 2, 3}
    buffer.append(transitions(2, 1.0), np.array([7.0, 9.0]))  # overwrites slots 0 and 1 after sampling
    new = np.full(64, 0.25)
    stale = buffer.update_priorities(sampled["slots"], sampled["versions"], new)
    overwritten = int((sampled["slots"] < 2).sum())
    assert stale == overwritten > 0
    leaves = buffer.sum_tree[len(buffer.sum_tree) // 2 :][:4].tolist()
    assert leaves == [7.0, 9.0, 0.25, 0.25]  # the new transitions keep their priorities, the others are updated
    assert buffer.min_tree[1] == 0.25 and buffer.sum_tree[1] == 16.5
    # split_updates routes each buffer's part back: a buffer that gave nothing gets None
    batch = {"slots": torch.tensor([2, 3, 0]), "versions": torch.tensor([1, 1, 1])}
    parts = split_updates(batch, np.array([1, 1, 0]), np.array([0.5, 0.5, 2.0]), 3)
    assert parts[2] is None and parts[1][0].tolist() == [2, 3] and parts[0][2].tolist() == [2.0]


# ------------------------------------------------------------------ n-step transitions, targets, exploration


def test_n_step_builder_matches_a_reference():
    gamma, n = 0.9, 3
    rewards = [1.0, 2.0, 3.0, 4.0, 5.0]
    terminated = [False, False, False, False, True]
    builder, out = NStepBuilder(1, n, gamma), []
    for t in range(5):
        out += builder.push([t], [t], [rewards[t]], [terminated[t]], [False], [t + 1])
    expected = []
    for t in range(5):  # reference: the window t..min(t+n, T)-1, discounted sum, bootstrap unless it hits the end
        end = min(t + n, 5)
        ret = sum(gamma ** (k - t) * rewards[k] for k in range(t, end))
        expected.append((t, t, ret, 0.0 if end == 5 else gamma ** (end - t), end))
    assert [(o, a, pytest.approx(r), d, nx) for o, a, r, d, nx in out] == expected


def test_n_step_builder_truncation_bootstraps_from_the_final_observation():
    builder = NStepBuilder(1, 3, 0.5)
    assert builder.push([0], [0], [1.0], [False], [False], [1]) == []
    out = builder.push([1], [1], [2.0], [False], [True], ["final"])
    assert out == [(0, 0, 1.0 + 0.5 * 2.0, 0.25, "final"), (1, 1, 2.0, 0.5, "final")]


def test_double_q_target_uses_online_argmax_and_target_values():
    online = torch.tensor([[1.0, 3.0], [5.0, 2.0]])  # argmax: 1, 0
    target = torch.tensor([[10.0, 20.0], [30.0, 40.0]])
    y = double_q_targets(online, target, torch.tensor([1.0, 2.0]), torch.tensor([0.5, 0.0]))
    assert y.tolist() == [1.0 + 0.5 * 20.0, 2.0]


def test_apex_epsilon_schedule():
    eps = apex_epsilons(8, 0.4, 7.0)
    assert eps[0] == pytest.approx(0.4) and eps[-1] == pytest.approx(0.4**8)
    assert eps[3] == pytest.approx(0.4 ** (1 + 3 * 7 / 7))
    assert apex_epsilons(1) == [0.4]


# ------------------------------------------------------------------ Ape-X's settings (Horgan et al. 2018)


def test_parameter_pull_interval_is_400_frames():
    # 400 frames are 100 agent steps under the ALE frame skip of 4 (Mnih et al. 2015), 400 steps without a frame skip
    assert frame_skip("ALE/Pong-v5") == 4 and frame_skip("BreakoutNoFrameskip-v4") == 4
    assert frame_skip("CartPole-v1") == 1
    assert pull_interval_steps(400, 4) == 100 and pull_interval_steps(400, 1) == 400 and pull_interval_steps(2, 4) == 1


def test_actor_pulls_parameters_every_100_agent_steps_on_atari(monkeypatch):
    """An actor run in this process for 200 agent steps of Breakout at the default --actor-update-interval: it pulls
    once before acting, then at agent steps 100 and 200 (every 400 frames)."""
    args = Args(env_id="ALE/Breakout-v5", num_actors=1, buffer_size=200, actor_batch=50, total_timesteps=200)
    shared, _, _ = setup_machine(args, CTX, num_actors=1, steps_limit=200, first_global=0, num_total=1, evaluator=False)
    shared.parent_pid = os.getppid()  # the actor runs here: its "main process" is this one's parent
    shared.store.publish(shared.store.flat.clone(), 0)  # all-zero parameters: greedy action 0, finite priorities
    pulled_at, pull = [], shared.store.pull
    monkeypatch.setattr(
        shared.store, "pull", lambda params: pulled_at.append(shared.steps_claimed.value) or pull(params)
    )
    actor_loop(0, 0, 1, args, shared)
    assert pulled_at == [0, 100, 200]


def test_ddpg_defaults_are_ape_x_dpg_and_dqn_keeps_its_own():
    ddpg, dqn = tyro.cli(Args, args=["--algo", "ddpg"]), tyro.cli(Args, args=[])
    assert ddpg.n_step == 5 and dqn.n_step == 3  # Ape-X DPG: 5-step returns; Ape-X DQN: 3
    assert tyro.cli(Args, args=["--algo", "ddpg", "--n-step", "2"]).n_step == 2
    assert ddpg.critic_learning_rate == 1e-4 and ddpg.actor_learning_rate == 1e-4  # Ape-X DPG: Adam at 1e-4
    env = gym.make("Pendulum-v1")
    learner = Learner(ddpg, env.observation_space, env.action_space, torch.device("cpu"))
    assert learner.optimizers["critic"].param_groups[0]["lr"] == 1e-4
    assert learner.optimizers["actor"].param_groups[0]["lr"] == 1e-4
    critic = Learner(Args(algo="ddpg", critic_learning_rate=3e-3), env.observation_space, env.action_space, "cpu")
    assert critic.optimizers["critic"].param_groups[0]["lr"] == 3e-3


def test_importance_sampling_exponent_is_fixed_unless_annealed():
    args = Args()
    assert args.priority_beta == 0.4 and not args.anneal_beta  # Ape-X: beta = 0.4 throughout
    assert [importance_exponent(0.4, False, p) for p in (0.0, 0.5, 1.0)] == [0.4, 0.4, 0.4]
    # Schaul et al. 2016: linear from beta_0 to 1 over the run
    assert [importance_exponent(0.4, True, p) for p in (0.0, 0.5, 1.0, 2.0)] == pytest.approx([0.4, 0.7, 1.0, 1.0])


# ------------------------------------------------------------------ running the script


def run(args, tmp_path, timeout=120):
    return run_script(SCRIPT, args, tmp_path, timeout)


# not [*CORE_TAGS, ...]: DQN has no policy loss or entropy, and the Breakout run ends no episode (tests add those)
REQUIRED_TAGS = [
    "charts/SPS",
    "charts/learning_rate",
    "charts/policy_lag",
    "losses/value_loss",
    "losses/total_loss",
    "losses/grad_norm",
    "losses/q_values",
    "replay/size",
    "replay/priority_mean",
    "replay/stale_updates",
]


def check_tags(logged, extra=()):
    assert_finite_tags(logged, [*REQUIRED_TAGS, *extra])


def test_dqn_cartpole_end_to_end(tmp_path):
    total = 3000
    proc = run(
        ["--env-id", "CartPole-v1", *TINY, "--total-timesteps", str(total), "--buffer-size", "1000",
         "--eval-interval", "1000", "--eval-interval-episodes", "1", "--eval-episodes", "2", "--save-model",
         "--checkpoint-interval", "3600"],
        tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    run_dir = only_run_dir(tmp_path)
    logged = scalars(run_dir)
    check_tags(logged, ["charts/episodic_return", "charts/episodic_length", "eval/episodic_return"])
    assert max(s for s, _ in logged["charts/episodic_return"]) <= total
    assert max(s for s, _ in logged["charts/SPS"]) == total  # every agent step counted once
    assert max(v for _, v in logged["replay/size"]) <= 1000  # the ring buffers wrapped (3000 steps into 1000 slots)
    assert all(v >= 0 for _, v in logged["charts/policy_lag"])
    assert len(logged["eval/episodic_return"]) >= 2 + 1  # final evaluation + at least one round during training
    checkpoint = torch.load(run_dir / "checkpoint.pt", weights_only=False)
    assert checkpoint["global_step"] == total and checkpoint["algo"] == "dqn"
    final = torch.load(run_dir / "model.pt")
    for name, value in final.items():  # the final checkpoint holds the final model
        assert torch.equal(value, checkpoint["learner"]["model"][name]), name


def test_dqn_atari_end_to_end(tmp_path):
    proc = run(
        ["--env-id", "ALE/Breakout-v5", *TINY, "--num-actors", "1", "--total-timesteps", "300", "--buffer-size", "300",
         "--learning-starts", "100", "--eval-interval", "0", "--batch-size", "16", "--replay-ratio", "1"],
        tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    logged = scalars(only_run_dir(tmp_path))
    check_tags(logged)  # no game ends this soon, but lives are lost: `terminated` without a reset (no final_obs)
    # the rate limiter: about 1 sampled transition per agent step after learning starts (200 steps / 16 per batch)
    assert 5 <= len(logged["losses/total_loss"]) * 5 <= 20, logged["losses/total_loss"]


def test_ddpg_pendulum_end_to_end(tmp_path):
    tiny = [a if a != "--learning-rate" else "--critic-learning-rate" for a in TINY]
    proc = run(
        ["--algo", "ddpg", "--env-id", "Pendulum-v1", *tiny, "--total-timesteps", "1200", "--buffer-size", "1200",
         "--noise-type", "ou", "--eval-interval", "0", "--eval-episodes", "1"],
        tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    logged = scalars(only_run_dir(tmp_path))
    check_tags(logged, ["losses/policy_loss", "charts/episodic_return", "eval/episodic_return"])


@pytest.mark.timeout(180)
def test_rpc_two_actor_ranks_on_localhost(tmp_path):
    torchrun = shutil.which("torchrun")
    if torchrun is None:
        pytest.skip("torchrun not on PATH")
    cmd = [torchrun, "--standalone", "--nproc-per-node", "3", SCRIPT, "--log-dir", str(tmp_path),
           "--env-id", "CartPole-v1", *TINY, "--num-actors", "1", "--total-timesteps", "1500",
           "--buffer-size", "1000", "--eval-interval", "0"]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=170, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "2 actor ranks over rpc" in proc.stdout
    logged = scalars(only_run_dir(tmp_path))
    check_tags(logged, ["charts/episodic_return"])
    assert max(s for s, _ in logged["charts/SPS"]) == 1500  # both ranks' steps, counted once


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (dict(env_id="CartPol-v1"), "did you mean CartPole-v1"),
        (dict(algo="sac"), "--algo must be one of dqn, ddpg"),
        (dict(algo="ddpg", env_id="CartPole-v1"), "Box action space"),
        (dict(algo="dqn", env_id="Pendulum-v1"), "Discrete action space"),
        (dict(num_actors=0), "--num-actors must be >= 1"),
        (dict(priority_beta=1.5), "--priority-beta must be in [0, 1]"),
        (dict(algo="ddpg", env_id="Pendulum-v1", learning_rate=1e-3), "--algo ddpg takes --critic-learning-rate"),
        (dict(algo="ddpg", env_id="Pendulum-v1", critic_learning_rate=0.0), "--critic-learning-rate must be > 0"),
        (dict(env_id="CartPole-v1", buffer_size=100), "must hold at least one --actor-batch"),
        (dict(env_id="CartPole-v1", learning_starts=10**9), "--learning-starts"),
        (dict(resume="/nonexistent/checkpoint.pt"), "no such checkpoint"),
        (dict(env_id="CartPole-v1", learning_rate=float("inf")), "--learning-rate must be a finite number, got inf"),
        (dict(env_id="CartPole-v1", tau=float("nan")), "--tau must be a finite number, got nan"),
        (dict(env_id="Pendulum-v1"), "use apex.py --algo ddpg"),
    ],
)
def test_bad_flags_one_line_error(args, message, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(Args(log_dir=str(tmp_path), **args))
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], lines
    assert not any(Path(tmp_path).iterdir())  # nothing was created


META = dict(script="apex.py", algo="dqn", env_id="CartPole-v1", network="mlp", hidden_sizes=[256, 256], obs_shape=[4],
            action_shape_or_n=2)  # fmt: skip


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("garbage", "not a checkpoint this script can read (UnpicklingError: "),
        ("truncated", "not a checkpoint this script can read ("),
        ("no_meta", 'not a checkpoint this script can read (it has no "meta" entry)'),
        ("other_script", "it is a hts_a2c.py checkpoint (script hts_a2c.py), this run is script apex.py"),
        ("other_env", "(env_id Acrobot-v1, obs_shape [6], action_shape_or_n 3), this run is env_id CartPole-v1, "),
    ],
)
def test_resume_refuses_a_checkpoint_it_cannot_continue(case, message, tmp_path, capsys):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    path = write_unusable_checkpoint(run_dir, case, META)
    before = path.read_bytes()
    with pytest.raises(SystemExit) as e:
        main(Args(env_id="CartPole-v1", log_dir=str(tmp_path / "logs"), resume=str(path)))
    assert e.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: cannot resume from {path}: ") and message in lines[0], lines
    assert list(run_dir.iterdir()) == [path] and path.read_bytes() == before  # no events file, checkpoint unchanged
    assert not (tmp_path / "logs").exists()


@pytest.mark.parametrize("log_dir", ["/proc/x", "a_file/runs"])
def test_unusable_log_dir_is_one_error_line(log_dir, tmp_path, capsys):
    (tmp_path / "a_file").write_text("")
    with pytest.raises(SystemExit) as e:
        main(Args(env_id="CartPole-v1", log_dir=log_dir if log_dir.startswith("/") else str(tmp_path / log_dir)))
    assert e.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: cannot create the run directory "), lines


def test_runs_started_in_the_same_second_get_their_own_directories(tmp_path, monkeypatch):
    monkeypatch.setattr(apex.time, "time", lambda: 1700000000.5)
    args = Args(env_id="CartPole-v1", log_dir=str(tmp_path))
    dirs = [apex.new_run_dir(args) for _ in range(3)]
    assert [d.name for d in dirs] == [f"CartPole-v1__apex__1__1700000000{s}" for s in ("", "-2", "-3")]


def test_bad_flag_from_the_command_line(tmp_path):
    proc = run(["--n-step", "0"], tmp_path, timeout=60)
    assert proc.returncode == 2 and proc.stderr.strip() == "error: --n-step must be >= 1, got 0", proc.stderr
    assert not any(Path(tmp_path).iterdir())


# ------------------------------------------------------------------ failures and shutdown


def children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except FileNotFoundError:
        return []


def alive(pid: int) -> bool:
    try:
        return "State:\tZ" not in Path(f"/proc/{pid}/status").read_text()
    except FileNotFoundError:
        return False


def test_crashing_actor_stops_the_run_naming_it(tmp_path):
    proc = run(
        ["--env-id", "tests.faulty_env:CrashingCartPole-v0", *TINY, "--total-timesteps", "100000000",
         "--eval-interval", "0"],
        tmp_path,
    )  # fmt: skip
    assert proc.returncode == 1
    assert "error: actor" in proc.stderr and "died" in proc.stderr and "injected env failure" in proc.stderr


def start_long_run(tmp_path, extra=()):
    cmd = [sys.executable, SCRIPT, "--log-dir", str(tmp_path), "--env-id", "CartPole-v1", *TINY,
           "--total-timesteps", "100000000", "--eval-interval", "500", *extra]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    # SIGINT back to its default: a shell's background job would otherwise hand the run an ignored SIGINT
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # fmt: skip
    for line in proc.stdout:  # wait until the learner is training
        if line.startswith("step") and " updates 0 " not in line:
            break
    workers = children(proc.pid)  # in start order: actor 0, actor 1, the evaluator
    assert len(workers) == 3, workers
    return proc, workers


def test_killed_actor_stops_the_run_naming_it(tmp_path):
    proc, workers = start_long_run(tmp_path)
    os.kill(workers[1], signal.SIGKILL)
    start = time.time()
    _, err = proc.communicate(timeout=60)
    assert time.time() - start < 10, err
    assert proc.returncode == 1 and "error: actor 1 died (killed by signal 9)" in err, err
    assert not any(alive(pid) for pid in workers)


def test_sigint_stops_cleanly_with_a_checkpoint(tmp_path):
    proc, workers = start_long_run(tmp_path, ["--checkpoint-interval", "3600"])
    proc.send_signal(signal.SIGINT)
    start = time.time()
    _, err = proc.communicate(timeout=60)
    assert time.time() - start < 10 and proc.returncode == 130, err
    assert "Traceback" not in err
    assert not any(alive(pid) for pid in workers)  # no orphans
    checkpoint = torch.load(only_run_dir(tmp_path) / "checkpoint.pt", weights_only=False)
    assert checkpoint["global_step"] > 0 and checkpoint["learner"]["version"] > 0


def test_a_stopped_process_does_not_block_ctrl_c(tmp_path):
    proc, workers = start_long_run(tmp_path)
    os.kill(workers[2], signal.SIGSTOP)  # the evaluator, asleep on the stop flag: it can never wake
    time.sleep(0.5)
    proc.send_signal(signal.SIGINT)
    start = time.time()
    try:
        _, err = proc.communicate(timeout=60)
    finally:
        for pid in [proc.pid, *workers]:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
    assert time.time() - start < 10 and proc.returncode == 130 and "Traceback" not in err, err
    assert not any(alive(pid) for pid in workers)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_during_start_up_stops_cleanly(sig, tmp_path):
    cmd = [sys.executable, SCRIPT, "--log-dir", str(tmp_path), "--env-id", "CartPole-v1", *TINY,
           "--total-timesteps", "100000000"]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # fmt: skip
    assert proc.stdout.readline().startswith("run directory:")  # the actors are being started now
    proc.send_signal(sig)
    start = time.time()
    _, err = proc.communicate(timeout=60)
    assert time.time() - start < 10 and proc.returncode == 128 + sig and "Traceback" not in err, err
    assert not children(proc.pid)


def test_full_disk_stops_cleanly_and_keeps_the_last_checkpoint(tmp_path):
    with small_tmpfs(tmp_path / "disk", "4m") as disk:
        proc, workers = start_long_run(disk, ["--checkpoint-interval", "0.2"])
        checkpoint = only_run_dir(disk) / "checkpoint.pt"
        deadline = time.time() + 60
        while not checkpoint.exists() and time.time() < deadline:
            time.sleep(0.1)
        fill_disk(disk)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 1 and "Traceback" not in err, err
        # whichever write hits the full disk first: the checkpoint or the TensorBoard events file
        assert "error: no space left on device while writing " in err and len(err.strip().splitlines()) <= 2, err
        assert torch.load(checkpoint, weights_only=False)["global_step"] > 0  # the last good one, intact
        assert not list(checkpoint.parent.glob("*.tmp"))
        assert not any(alive(pid) for pid in workers)
