"""apex_dqn.py and apex_ddpg.py, in one file because the two scripts carry the same distributed prioritized replay and
the same lifecycle code (`test_shared_code_is_the_same_in_both_scripts` holds them to that): the replay's checks run
against both scripts, each subprocess check against one of them.

Checked: the sum/min trees against linear scans and a chi-square test, distributed sampling shares and importance
weights by hand, the taint (slot-version) check, n-step transitions and double-Q targets against references, Ape-X's
settings; end-to-end DQN on CartPole under torchrun (learner + 2 actor ranks) and on Breakout, DDPG on Pendulum, with
the exact policy lag of actors that never pull; --track (one offline W&B run for a run of 2 actors, from the learner
alone), --eval-only of a model.pt and a checkpoint.pt (the end-of-training evaluation replayed) and what it refuses;
the console's start line, lines and summary; bad flags (a budget that never starts the learner among them), the
warnings of a run that skips what its flags suggest, unusable checkpoints and run directories; a crashing or killed
actor, SIGINT with a stopped process, a signal during start-up, a full disk, SIGTERM to the torchrun launcher and
kill -9 of it (the final checkpoint, no rank left). Both scripts' rpc code is the same text, so DDPG under torchrun
runs the code the DQN torchrun test checks."""

import ast
import json
import math
import multiprocessing
import os
import re
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
    CONSOLE_LINE,
    ROOT,
    FakeWandb,
    RecordingEnv,
    alive,
    assert_documented_tags,
    assert_eval_only_refusals,
    assert_finite_tags,
    assert_tracked_once,
    children_of,
    end_launch,
    fill_disk,
    launch_ranks,
    offline_wandb_env,
    only_run_dir,
    processes_with,
    run_eval_only,
    run_script,
    scalars,
    small_tmpfs,
    start_run,
    state_of,
    wait_for,
    write_unusable_checkpoint,
)
from torch import nn

import apex_ddpg
import apex_dqn

sys.path.insert(0, str(ROOT / "benchmarks"))
import learn  # benchmarks/learn.py: the suites a refusal points to

SCRIPTS = [apex_dqn, apex_ddpg]
CTX = multiprocessing.get_context("fork")
# a learner that starts at once and keeps up on 2 cores: CartPole-sized settings
COMMON = [
    "--num-actors",
    "2",
    "--learning-starts",
    "200",
    "--batch-size",
    "32",
    "--actor-batch",
    "20",
    "--actor-update-interval",
    "20",
    "--log-frequency",
    "5",
    "--log-interval",
    "0.5",
    "--hidden-sizes",
    "32",
    "32",
]
TINY_DQN = [*COMMON, "--target-network-frequency", "20", "--optimizer", "adam", "--learning-rate", "1e-3"]
TINY_DDPG = [*COMMON, "--critic-learning-rate", "1e-3"]
NO_PULLS = ["--actor-update-interval", "1000000000"]  # actors keep the parameters they started with (version 0)
# DQN has no policy loss or entropy, and the Breakout run ends no game (tests add those)
REQUIRED_TAGS = ["charts/SPS", "charts/learning_rate", "charts/policy_lag", "losses/value_loss", "losses/total_loss",
                 "losses/grad_norm", "losses/q_values", "replay/size", "replay/priority_mean", "replay/stale_updates",
                 "timing/replay_wait"]  # fmt: skip
# what differs between the two scripts: their flags, their algorithm and the code that calls it
DIFFERENT = {"ALGORITHM", "RUN_SETTINGS", "Args", "RENAMED_FLAGS", "validate", "new_buffer", "append_prioritised",
             "build_model", "act", "play_episodes", "actor_loop", "evaluator_loop", "Learner", "FLAG_RULES",
             "env_spaces", "checkpoint_meta", "saved_model", "evaluate"}  # fmt: skip
script_ids = pytest.mark.parametrize("m", SCRIPTS, ids=lambda m: m.__name__)


def test_shared_code_is_the_same_in_both_scripts():
    """Every top-level function, class and constant the two scripts share is the same text in both, except the ones
    in DIFFERENT: the replay and lifecycle checks below then hold for both scripts, though each subprocess test runs
    one of them."""

    def definitions(module) -> dict[str, str]:
        source = Path(module.__file__).read_text()
        lines, out = source.splitlines(), {}
        for node in ast.parse(source).body:
            names = [t.id for t in getattr(node, "targets", []) if isinstance(t, ast.Name)]
            for name in [getattr(node, "name", None), *names]:
                if name:
                    out[name] = lines[node.lineno - 1 : node.end_lineno]
        return out

    dqn, ddpg = definitions(apex_dqn), definitions(apex_ddpg)
    shared = sorted(set(dqn) & set(ddpg) - DIFFERENT)
    assert {"PrioritizedBuffer", "RemoteReplay", "ActorHost", "Shared", "LearnerRun", "main"} <= set(shared)
    assert {"start_tracking", "finish_tracking", "write_run_args", "main_eval_only"} <= set(shared)
    assert [name for name in shared if dqn[name] != ddpg[name]] == []
    assert DIFFERENT <= set(dqn) & set(ddpg)  # no stale entry hides a difference


# ------------------------------------------------------------------ sum-tree and min-tree


def filled_trees(m, priorities: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    P = m.tree_capacity(len(priorities))
    sum_tree, min_tree = np.zeros(2 * P), np.full(2 * P, np.inf)
    leaves = np.arange(len(priorities))
    m.tree_update(sum_tree, leaves, priorities, np.add)
    m.tree_update(min_tree, leaves, priorities, np.minimum)
    return sum_tree, min_tree


@script_ids
def test_tree_capacity_is_the_next_power_of_two(m):
    assert [m.tree_capacity(c) for c in (1, 2, 3, 4, 5, 1000, 1024)] == [1, 2, 4, 4, 8, 1024, 1024]


@script_ids
def test_sampling_frequencies_match_priorities_chi_square(m):
    rng = np.random.default_rng(0)
    priorities = np.array([0.5, 1.0, 2.0, 4.0, 0.25, 3.0, 1.5, 0.75, 2.5, 1.25])  # 10 leaves in a 16-leaf tree
    sum_tree, _ = filled_trees(m, priorities)
    draws = 5000
    leaves = m.tree_find_prefix(sum_tree, rng.random(draws) * sum_tree[1])
    observed = np.bincount(leaves, minlength=len(priorities))
    assert observed.sum() == draws and len(observed) == len(priorities)  # never an empty leaf
    expected = draws * priorities / priorities.sum()
    chi2 = ((observed - expected) ** 2 / expected).sum()
    assert chi2 < 27.88, (chi2, observed, expected)  # chi-square, 9 degrees of freedom, p = 0.001


@script_ids
@pytest.mark.parametrize("size", [1, 7, 64, 1000])
def test_prefix_search_matches_a_linear_scan(m, size):
    rng = np.random.default_rng(size)
    priorities = rng.random(size) + 1e-3
    sum_tree, _ = filled_trees(m, priorities)
    assert sum_tree[1] == pytest.approx(priorities.sum())
    prefixes = rng.random(500) * priorities.sum()
    cumulative = np.cumsum(priorities)
    # linear scan: the first i with prefix < p_0 + ... + p_i
    expected = [next(i for i in range(size) if x < cumulative[i]) for x in prefixes]
    np.testing.assert_array_equal(m.tree_find_prefix(sum_tree, prefixes), expected)


@script_ids
def test_min_and_sum_trees_correct_after_updates(m):
    rng = np.random.default_rng(1)
    priorities = rng.random(37) + 0.1
    sum_tree, min_tree = filled_trees(m, priorities)
    for _ in range(50):
        leaves = rng.choice(37, size=rng.integers(1, 6), replace=False)
        values = rng.random(len(leaves)) * rng.choice([0.01, 1.0, 100.0])
        priorities[leaves] = values
        m.tree_update(sum_tree, leaves, values, np.add)
        m.tree_update(min_tree, leaves, values, np.minimum)
        assert min_tree[1] == priorities.min()
        assert sum_tree[1] == pytest.approx(priorities.sum(), rel=1e-12)
    P = len(sum_tree) // 2
    for node in range(1, P):  # every internal node, not only the root
        assert min_tree[node] == min(min_tree[2 * node], min_tree[2 * node + 1])
        assert sum_tree[node] == pytest.approx(sum_tree[2 * node] + sum_tree[2 * node + 1])


# ------------------------------------------------------------------ distributed buffers, weights, taint


def make_buffer(m, capacity: int):
    return m.PrioritizedBuffer(capacity, (2,), torch.float32, (), torch.int64, CTX.Lock())


def transitions(m, k: int, tag: float):
    """k transitions whose observation says where they came from: obs[:, 0] = tag, obs[:, 1] = index."""
    obs = torch.stack([torch.full((k,), tag), torch.arange(k, dtype=torch.float32)], dim=1)
    zeros = torch.zeros(k, dtype=torch.int64)
    return m.Transitions(obs, zeros, torch.zeros(k), torch.ones(k), obs.clone(), zeros)


@script_ids
def test_distributed_sampling_shares_follow_priority_sums_and_weights_match_the_formula(m):
    rng = np.random.default_rng(2)
    priorities = [np.array([1.0, 2.0, 3.0, 4.0]), np.array([0.5] * 6), np.array([10.0, 0.2])]  # sums 10, 3, 10.2
    buffers = [make_buffer(m, 8) for _ in priorities]
    for b, (buffer, p) in enumerate(zip(buffers, priorities, strict=True)):
        buffer.append(transitions(m, len(p), float(b)), p)
    replay = m.LocalReplay(buffers, rng)
    beta, draws = 0.4, 0
    counts = np.zeros(3)
    all_p = np.concatenate(priorities)
    N, total = len(all_p), all_p.sum()
    w_max = (N * all_p.min() / total) ** -beta  # the largest weight of any slot in any buffer
    for _ in range(200):
        batch = m.sample_batch(replay, 64, beta, rng)
        draws += 64
        np.testing.assert_array_equal(batch.data.obs[:, 0].numpy(), batch.buffer_ids)  # ids say where each came from
        counts += np.bincount(batch.buffer_ids, minlength=3)
        p_i = np.array([priorities[b][int(j)] for b, j in zip(batch.buffer_ids, batch.data.obs[:, 1], strict=True)])
        np.testing.assert_allclose(batch.weights.numpy(), (N * p_i / total) ** -beta / w_max, rtol=1e-6)
    sums = np.array([p.sum() for p in priorities])
    np.testing.assert_allclose(counts / draws, sums / sums.sum(), atol=0.015)


@script_ids
def test_importance_weights_known_values(m):
    np.testing.assert_allclose(m.importance_weights(np.array([1.0, 2.0, 4.0]), 1.0, 0.5), [1.0, 2**-0.5, 0.5])


@script_ids
def test_a_full_buffer_wraps_dropping_its_oldest_transitions(m):
    """Three appends of 5 into 8 slots: the ring holds the newest 8 transitions in order of arrival, the trees hold
    only their priorities, and no sample returns one of the 7 overwritten."""
    buffer = make_buffer(m, 8)
    for tag in range(3):
        buffer.append(transitions(m, 5, float(tag)), np.full(5, 1.0 + tag))  # priority 1, 2, 3 per append
    held = sorted(map(tuple, buffer.data.obs.tolist()))
    assert held == sorted([(1.0, 2.0), (1.0, 3.0), (1.0, 4.0), *((2.0, float(i)) for i in range(5))])
    assert int(buffer.size) == 8 and int(buffer.next_slot) == 15 % 8
    assert buffer.sum_tree[1] == 3 * 2.0 + 5 * 3.0 and buffer.min_tree[1] == 2.0
    sampled = buffer.sample(256, np.random.default_rng(0)).data.obs
    assert set(sampled[:, 0].tolist()) == {1.0, 2.0} and sampled[sampled[:, 0] == 1.0, 1].min() >= 2.0


@script_ids
@pytest.mark.parametrize("sizes", [(3, 7), (6, 11), (2, 19, 4)], ids=["wraps", "wraps-twice", "more-than-the-ring"])
def test_append_writes_row_i_to_slot_next_plus_i_mod_capacity_the_later_row_kept(m, sizes):
    """Appends that wrap the ring (once, or more than its whole length in one append) leave every slot holding the row
    a one-row-at-a-time loop writes last there, field by field."""
    capacity, buffer, reference, next_slot = 8, make_buffer(m, 8), [None] * 8, 0
    for tag, k in enumerate(sizes):
        data = transitions(m, k, float(tag))
        buffer.append(data, np.ones(k))
        for i in range(k):
            reference[(next_slot + i) % capacity] = [field[i].clone() for field in data]
        next_slot = (next_slot + k) % capacity
    for slot, row in enumerate(reference):
        for stored, expected in zip(buffer.data, row, strict=True):
            assert torch.equal(stored[slot], expected), (slot, stored[slot], expected)
    assert int(buffer.next_slot) == next_slot and int(buffer.size) == capacity


@script_ids
def test_taint_overwritten_slot_keeps_its_new_priority(m):
    rng = np.random.default_rng(3)
    buffer = make_buffer(m, 4)
    buffer.append(transitions(m, 4, 0.0), np.array([1.0, 1.0, 1.0, 1.0]))
    sampled = buffer.sample(64, rng)  # all four slots, with the versions they had
    assert set(sampled.slots.tolist()) == {0, 1, 2, 3}
    buffer.append(transitions(m, 2, 1.0), np.array([7.0, 9.0]))  # overwrites slots 0 and 1 after sampling
    stale = buffer.update_priorities(m.PriorityUpdate(sampled.slots, sampled.versions, np.full(64, 0.25)))
    overwritten = int((sampled.slots < 2).sum())
    assert stale == overwritten > 0
    leaves = buffer.sum_tree[len(buffer.sum_tree) // 2 :][:4].tolist()
    assert leaves == [7.0, 9.0, 0.25, 0.25]  # the new transitions keep their priorities, the others are updated
    assert buffer.min_tree[1] == 0.25 and buffer.sum_tree[1] == 16.5
    # split_updates routes each buffer's part back: a buffer that gave nothing gets None
    batch = m.Batch(None, None, torch.tensor([2, 3, 0]), torch.tensor([1, 1, 1]), np.array([1, 1, 0]))
    parts = m.split_updates(batch, np.array([0.5, 0.5, 2.0]), 3)
    assert parts[2] is None and parts[1].slots.tolist() == [2, 3] and parts[0].priorities.tolist() == [2.0]


# ------------------------------------------------------------------ n-step transitions, targets, exploration


@script_ids
def test_n_step_builder_matches_a_reference(m):
    gamma, n = 0.9, 3
    rewards = [1.0, 2.0, 3.0, 4.0, 5.0]
    terminated = [False, False, False, False, True]
    builder, out = m.NStepBuilder(1, n, gamma), []
    for t in range(5):
        out += builder.push([t], [t], [rewards[t]], [terminated[t]], [False], [t + 1])
    expected = []
    for t in range(5):  # reference: the window t..min(t+n, T)-1, discounted sum, bootstrap unless it hits the end
        end = min(t + n, 5)
        ret = sum(gamma ** (k - t) * rewards[k] for k in range(t, end))
        expected.append((t, t, ret, 0.0 if end == 5 else gamma ** (end - t), end))
    assert [(o, a, pytest.approx(r), d, nx) for o, a, r, d, nx, _, _ in out] == expected


@script_ids
def test_n_step_builder_truncation_bootstraps_from_the_final_observation(m):
    builder = m.NStepBuilder(1, 3, 0.5)
    assert builder.push([0], [0], [1.0], [False], [False], [1]) == []
    out = builder.push([1], [1], [2.0], [False], [True], ["final"])
    assert [t[:5] for t in out] == [(0, 0, 1.0 + 0.5 * 2.0, 0.25, "final"), (1, 1, 2.0, 0.5, "final")]


def initial_priority(model, obs, action, ret, discount, next_obs, alpha, eps) -> float:
    """Ape-X's initial priority of one n-step transition from the actor's network, straight from the equations:
    (|R + gamma^n max_a Q(s', a) - Q(s, a)| + eps)^alpha (double Q with one network reduces to the max)."""
    with torch.no_grad():
        q = model(obs[None])[0, action].item()
        bootstrap = model(next_obs[None])[0].max().item()
    return (abs(ret + discount * bootstrap - q) + eps) ** alpha


def test_dqn_actor_priorities_reuse_its_acting_q_values_and_match_the_td_errors_of_its_network():
    """The actor prioritises its transitions with the Q-values it computed to act (no forward pass of its own, Ape-X
    Section 3): every stored priority must equal the n-step TD error of its network, one transition at a time, over
    episodes that end (bootstrap 0) and go on (the next state's values come from the next action)."""
    args = apex_dqn.Args(env_id="CartPole-v1", num_actors=1, num_envs_per_actor=3, actor_batch=16, n_step=3,
                         buffer_size=4000, hidden_sizes=(16,), epsilon=0.5, actor_update_interval=10**6)  # fmt: skip
    spaces = apex_dqn.env_spaces(args)
    shared = apex_dqn.Shared(args, CTX, spaces, num_buffers=1, num_total=1, steps_limit=900)
    shared.parent_pid = os.getppid()  # the actor runs in this process: its "main process" is this one's parent
    torch.manual_seed(0)
    model = apex_dqn.build_model(args, *spaces)
    shared.store.publish(torch.cat([p.detach().flatten() for p in model.parameters()]), 0)
    apex_dqn.actor_loop(0, 0, 1, args, shared)
    buffer = shared.buffers[0]
    size = int(buffer.size)
    assert size == 900 - 3 * (args.n_step - 1)  # all but the starts still in the n-step windows; the last emitted
    # ones bootstrapped after the loop
    assert (buffer.data.discounts[:size] == 0).sum() >= 10  # episodes ended: CartPole falls within 900 steps
    leaves = buffer.sum_tree[len(buffer.sum_tree) // 2 :][:size].numpy()
    d, alpha, eps = buffer.data, args.priority_alpha, args.priority_eps
    expected = [initial_priority(model, d.obs[i], int(d.actions[i]), float(d.returns[i]), float(d.discounts[i]),
                                 d.next_obs[i], alpha, eps) for i in range(size)]  # fmt: skip
    assert leaves == pytest.approx(np.array(expected), rel=1e-4, abs=1e-6)


def test_dqn_actor_bootstraps_a_truncated_episode_from_a_forward_pass_on_its_final_state():
    torch.manual_seed(0)
    model = nn.Linear(2, 3)
    final, other = torch.tensor([0.5, -1.0]), torch.tensor([2.0, 1.0])
    cut = apex_dqn.NStepTransition(other, 0, 1.0, 0.9, final, 0, 0.0)  # truncated: bootstraps from `final`
    ended = apex_dqn.NStepTransition(other, 1, 1.0, 0.0, final, 1, 0.0)  # terminated: nothing to bootstrap
    values = apex_dqn.ended_episode_bootstrap(model, [cut, ended])
    assert [v for _, v in values] == [pytest.approx(model(final).max().item()), 0.0]


def test_double_q_target_uses_online_argmax_and_target_values():
    online = torch.tensor([[1.0, 3.0], [5.0, 2.0]])  # argmax: 1, 0
    target = torch.tensor([[10.0, 20.0], [30.0, 40.0]])
    y = apex_dqn.double_q_targets(online, target, torch.tensor([1.0, 2.0]), torch.tensor([0.5, 0.0]))
    assert y.tolist() == [1.0 + 0.5 * 20.0, 2.0]


def test_apex_epsilon_schedule():
    eps = apex_dqn.apex_epsilons(8, 0.4, 7.0)
    assert eps[0] == pytest.approx(0.4) and eps[-1] == pytest.approx(0.4**8)
    assert eps[3] == pytest.approx(0.4 ** (1 + 3 * 7 / 7))
    assert apex_dqn.apex_epsilons(1) == [0.4]


def test_ddpg_noise_scales_and_ou_process():
    assert apex_ddpg.noise_scales(4, 0.3) == pytest.approx([0.3, 0.225, 0.15, 0.075])
    x = np.array([1.0, -2.0])
    rng, reference = np.random.default_rng(0), np.random.default_rng(0)
    np.testing.assert_allclose(apex_ddpg.ou_step(x, 0.15, 0.2, rng), x - 0.15 * x + 0.2 * reference.standard_normal(2))


# ------------------------------------------------------------------ Ape-X's settings (Horgan et al. 2018)


def test_parameter_pull_interval_is_400_frames():
    # 400 frames are 100 agent steps under the ALE frame skip of 4 (Mnih et al. 2015), 400 steps without a frame skip
    pull = apex_dqn.pull_interval_steps
    assert pull(400, "ALE/Pong-v5") == 100 and pull(400, "BreakoutNoFrameskip-v4") == 100
    assert pull(400, "CartPole-v1") == 400 and pull(2, "ALE/Pong-v5") == 1


def test_actor_pulls_parameters_every_100_agent_steps_on_atari(monkeypatch):
    """An actor run in this process for 200 agent steps of Breakout at the default --actor-update-interval: it pulls
    once before acting, then at agent steps 100 and 200 (every 400 frames)."""
    m = apex_dqn
    args = m.Args(env_id="ALE/Breakout-v5", num_actors=1, buffer_size=200, actor_batch=50, total_timesteps=200)
    spaces = m.env_spaces(args)
    shared = m.Shared(args, CTX, spaces, num_buffers=1, num_total=1, steps_limit=200)
    shared.parent_pid = os.getppid()  # the actor runs here: its "main process" is this one's parent
    shared.store.publish(shared.store.flat.clone(), 0)  # all-zero parameters: greedy action 0, finite priorities
    pulled_at, pull = [], shared.store.pull
    monkeypatch.setattr(
        shared.store, "pull", lambda params: pulled_at.append(shared.steps_claimed.value) or pull(params)
    )
    m.actor_loop(0, 0, 1, args, shared)
    assert pulled_at == [0, 100, 200]


def test_each_script_has_its_papers_defaults():
    dqn, ddpg = tyro.cli(apex_dqn.Args, args=[]), tyro.cli(apex_ddpg.Args, args=[])
    assert ddpg.n_step == 5 and dqn.n_step == 3  # Ape-X DPG: 5-step returns; Ape-X DQN: 3
    assert tyro.cli(apex_ddpg.Args, args=["--n-step", "2"]).n_step == 2
    assert dqn.learning_rate == 0.00025 / 4 and dqn.optimizer == "rmsprop" and dqn.batch_size == 512
    assert ddpg.critic_learning_rate == 1e-4 and ddpg.actor_learning_rate == 1e-4  # Ape-X DPG: Adam at 1e-4
    env = gym.make("Pendulum-v1")
    learner = apex_ddpg.Learner(ddpg, env.observation_space, env.action_space, torch.device("cpu"))
    assert learner.optimizers["critic"].param_groups[0]["lr"] == 1e-4
    assert learner.optimizers["actor"].param_groups[0]["lr"] == 1e-4
    critic = apex_ddpg.Learner(apex_ddpg.Args(critic_learning_rate=3e-3), env.observation_space, env.action_space,
                               torch.device("cpu"))  # fmt: skip
    assert critic.optimizers["critic"].param_groups[0]["lr"] == 3e-3


@script_ids
def test_importance_sampling_exponent_is_fixed_unless_annealed(m):
    args = m.Args()
    assert args.priority_beta == 0.4 and not args.anneal_beta  # Ape-X: beta = 0.4 throughout
    assert [m.importance_exponent(0.4, False, p) for p in (0.0, 0.5, 1.0)] == [0.4, 0.4, 0.4]
    # Schaul et al. 2016: linear from beta_0 to 1 over the run
    assert [m.importance_exponent(0.4, True, p) for p in (0.0, 0.5, 1.0, 2.0)] == pytest.approx([0.4, 0.7, 1.0, 1.0])


# ------------------------------------------------------------------ running the scripts


def assert_lag_of_actors_that_never_pull(logged, log_frequency=5):
    """Actors that keep version 0 make the lag of update v exactly v: a point averages updates k f .. (k + 1) f - 1,
    so it is k f + (f - 1) / 2; the last point may average fewer (the run's end)."""
    lags = [v for _, v in logged["charts/policy_lag"]]
    expected = [k * log_frequency + (log_frequency - 1) / 2 for k in range(len(lags))]
    assert lags[:-1] == expected[:-1], lags
    assert expected[-1] - (log_frequency - 1) / 2 <= lags[-1] <= expected[-1], lags


@pytest.fixture(scope="module")
def dqn_torchrun_run(tmp_path_factory):
    """One tracked (offline W&B) DQN run on CartPole under torchrun: the learner and 2 actor ranks of one actor each,
    held by --replay-ratio 1 (the actor ranks cannot finish the budget before the learner has learned), an evaluator
    round, --save-model, a final checkpoint and 2 final evaluation games: (its CompletedProcess, its run directory,
    its W&B directory)."""
    log_dir, wandb_dir = tmp_path_factory.mktemp("dqn-runs"), tmp_path_factory.mktemp("wandb")
    proc = run_script(
        "apex_dqn.py",
        ["--env-id", "CartPole-v1", *TINY_DQN, "--num-actors", "1", "--total-timesteps", "4000", "--buffer-size",
         "1000", "--eval-interval", "1000", "--eval-interval-episodes", "1", "--eval-episodes", "2", "--save-model",
         "--checkpoint-interval", "3600", "--replay-ratio", "1", "--track"],
        log_dir, timeout=200, env={**offline_wandb_env(wandb_dir), "OMP_NUM_THREADS": "1"},
        launcher=("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "3"),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc, only_run_dir(log_dir), wandb_dir


def test_dqn_cartpole_under_torchrun_with_two_actor_ranks(dqn_torchrun_run):
    """--track: rank 0 (the learner) alone logs to W&B, one run for the 3 ranks and their 2 actors."""
    proc, run_dir, wandb_dir = dqn_torchrun_run
    total = 4000
    assert "2 actor ranks over rpc" in proc.stdout
    # rank 0 alone speaks: one start line, one summary
    assert proc.stdout.count("run directory: ") == 1 and proc.stdout.count("finished: ") == 1, proc.stdout
    assert "finished: 4,000 of 4,000 agent steps in " in proc.stdout, proc.stdout
    assert "\nwarning: " not in f"\n{proc.stderr}", proc.stderr
    logged = scalars(run_dir)
    assert_finite_tags(logged, [*REQUIRED_TAGS, "charts/episodic_return", "charts/episodic_length",
                                "eval/episodic_return"])  # fmt: skip
    assert_documented_tags("apex_dqn.py", logged)
    assert max(s for s, _ in logged["charts/episodic_return"]) <= total
    assert max(s for s, _ in logged["charts/SPS"]) == total  # both ranks' steps, every one counted once
    assert logged["replay/size"][-1][1] == 1000  # every slot written (the wrap itself: the buffer test above)
    # the evaluator's rounds, then the 2 games of the final evaluation; the run ends only once a round has reported
    # from at or after the last --eval-interval boundary it crossed (3000), however slowly the evaluator runs
    *rounds, _, _ = logged["eval/episodic_return"]
    assert rounds and max(step for step, _ in rounds) >= 3000, rounds
    checkpoint = torch.load(run_dir / "checkpoint.pt", weights_only=False)
    assert checkpoint["global_step"] == total and checkpoint["meta"]["script"] == "apex_dqn.py"
    # --replay-ratio 1 holds each rank's actors as it holds the learner: one sampled transition per agent step past
    # --learning-starts, (4000 - 200) / 32 = 118.75 updates, less those the actors' slack (2 x 46 agent steps, and a
    # batch of 23 each past it) leaves undone when they finish
    assert 114 <= checkpoint["version"] <= 119, checkpoint["version"]
    final = torch.load(run_dir / "model.pt")
    for name, value in final.items():  # the final checkpoint holds the final model
        assert torch.equal(value, checkpoint["model"][name]), name
    tracked = assert_tracked_once(wandb_dir, run_dir)
    assert tracked.config["num_actors"] == 1 and tracked.config["total_timesteps"] == total
    saved = json.loads((run_dir / "args.json").read_text())
    assert saved["script"] == "apex_dqn.py" and saved["args"]["env_id"] == "CartPole-v1"
    assert saved["meta"] == checkpoint["meta"] and saved["meta"]["network"] == "mlp"


def test_dqn_atari_end_to_end(tmp_path):
    """Also the default --eval-interval (100,000) on this short run: no evaluation round is due, and one warning line
    says so; the console's start line, lines and summary."""
    proc = run_script(
        "apex_dqn.py",
        ["--env-id", "ALE/Breakout-v5", *TINY_DQN, *NO_PULLS, "--num-actors", "1", "--total-timesteps", "250",
         "--buffer-size", "250", "--learning-starts", "50", "--batch-size", "16", "--replay-ratio", "1"],
        tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == (
        "warning: --eval-interval 100000 puts no evaluation round before --total-timesteps 250 (rounds run at its "
        "multiples): the run evaluates nothing during training; give a smaller --eval-interval, or 0 for no rounds\n"
    )
    run_dir = only_run_dir(tmp_path)
    start, *lines, finished, wrote, tensorboard, eval_only = proc.stdout.splitlines()
    assert start.startswith(f"run directory: {run_dir}  (Ape-X DQN: 250 agent steps, 1 actors x 1 envs, replay 250 "
                            "in 1 buffers, learning from 50 transitions, "), start  # fmt: skip
    assert lines and all(CONSOLE_LINE.match(line) and " done=" in line and " updates=" in line for line in lines)
    assert lines[-1].startswith("global_step=250 ") and " done=100.0% " in lines[-1], lines
    assert finished.startswith("finished: 250 of 250 agent steps in "), finished
    assert wrote == f"wrote to {run_dir}: args.json, checkpoint.pt, {next(run_dir.glob('events.*')).name}", wrote
    assert tensorboard == f"next: tensorboard --logdir {run_dir}"  # finished: no --resume line
    assert eval_only == f"      python apex_dqn.py --eval-only {run_dir / 'checkpoint.pt'}"  # written by default
    logged = scalars(run_dir)
    assert_finite_tags(logged, REQUIRED_TAGS)  # no game ends this soon, but lives are lost (no final_obs)
    # the rate limiter: about 1 sampled transition per agent step after learning starts (200 steps / 16 per batch)
    assert 5 <= len(logged["losses/total_loss"]) * 5 <= 20, logged["losses/total_loss"]
    assert_lag_of_actors_that_never_pull(logged)


@pytest.fixture(scope="module")
def ddpg_run(tmp_path_factory):
    """One tracked (offline W&B) DDPG run on Pendulum, 2 actors that never pull, --save-model, a final checkpoint and
    one final evaluation episode: (its CompletedProcess, its run directory, its W&B directory)."""
    log_dir, wandb_dir = tmp_path_factory.mktemp("ddpg-runs"), tmp_path_factory.mktemp("wandb")
    proc = run_script(
        "apex_ddpg.py",
        ["--env-id", "Pendulum-v1", *TINY_DDPG, *NO_PULLS, "--total-timesteps", "1200", "--buffer-size", "1200",
         "--noise-type", "ou", "--eval-interval", "0", "--eval-episodes", "1", "--save-model", "--checkpoint-interval",
         "3600", "--track"],
        log_dir, env=offline_wandb_env(wandb_dir),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return proc, only_run_dir(log_dir), wandb_dir


def test_ddpg_pendulum_end_to_end(ddpg_run):
    """--track: the main process alone logs to W&B, one run for the learner and its 2 actor processes."""
    proc, run_dir, wandb_dir = ddpg_run
    start = f"run directory: {run_dir}  (Ape-X DDPG: 1,200 agent steps, 2 actors x 1 envs, replay 1,200 in 2 buffers, "
    assert proc.stdout.startswith(f"{start}learning from 200 transitions, "), proc.stdout
    assert "\nfinished: 1,200 of 1,200 agent steps in " in proc.stdout, proc.stdout
    assert "\nwarning: " not in f"\n{proc.stderr}", proc.stderr
    logged = scalars(run_dir)
    assert_finite_tags(logged, [*REQUIRED_TAGS, "losses/policy_loss", "charts/episodic_return",
                                "eval/episodic_return"])  # fmt: skip
    assert_documented_tags("apex_ddpg.py", logged)
    assert max(s for s, _ in logged["charts/SPS"]) == 1200
    assert_lag_of_actors_that_never_pull(logged)
    tracked = assert_tracked_once(wandb_dir, run_dir, ("charts/episodic_return", "losses/value_loss",
                                                       "losses/policy_loss"))  # fmt: skip
    assert tracked.config["num_actors"] == 2 and tracked.config["noise_type"] == "ou"


# ------------------------------------------------------------------ --eval-only and --track


def newest_eval_report(model_dir: Path) -> dict:
    return json.loads(max(model_dir.glob("eval-*.json"), key=lambda p: p.stat().st_mtime_ns).read_text())


@pytest.mark.parametrize("script", ["apex_dqn.py", "apex_ddpg.py"])
def test_eval_only_replays_the_saved_agent_with_the_end_of_training_evaluation(script, request, tmp_path, capsys,
                                                                               process_state):  # fmt: skip
    """model.pt (in a subprocess, with its args.json) and checkpoint.pt (in this process) play the same games (the
    default protocol: DQN epsilon 0.001, DDPG no noise), and the first ones are the run's own final evaluation: same
    policy, same evaluation seed."""
    m, fixture = (apex_dqn, "dqn_torchrun_run") if script == "apex_dqn.py" else (apex_ddpg, "ddpg_run")
    _, run_dir, _ = request.getfixturevalue(fixture)
    proc, report = run_eval_only(script, run_dir / "model.pt", tmp_path / "logs", "--eval-episodes", "3")
    assert proc.returncode == 0 and report is not None, proc.stderr
    assert report["episodes"] == 3 and report["model"] == str(run_dir / "model.pt")
    assert report["greedy"] is (m is apex_ddpg)  # the default protocols: DQN epsilon 0.001, DDPG no noise
    settings = dict(env_id="CartPole-v1", atari_protocol="deepmind", network="mlp", hidden_sizes=[32, 32])
    if m is apex_ddpg:
        settings = dict(env_id="Pendulum-v1", hidden_sizes=[32, 32])
    assert report["settings"] == settings
    assert "from its run: " + " ".join(f"{k}={v}" for k, v in settings.items()) in proc.stdout
    returns = report["returns"]
    assert len(returns) == 3 and all(math.isfinite(r) for r in returns), returns
    assert report["mean"] == pytest.approx(np.mean(returns))
    if m is apex_dqn:
        assert all(r == int(r) and 8 <= r <= 500 for r in returns), returns  # CartPole: one point per step
    else:
        assert all(-3300 < r <= 0 for r in returns), returns  # Pendulum: 200 steps of reward in [-16.3, 0]
    ran = 2 if m is apex_dqn else 1  # the run's --eval-episodes, logged last (as float32)
    assert returns[:ran] == pytest.approx([v for _, v in scalars(run_dir)["eval/episodic_return"]][-ran:], rel=1e-6)
    m.main(m.parse_args(["--eval-only", str(run_dir / "checkpoint.pt"), "--eval-episodes", "3"]))
    assert newest_eval_report(run_dir)["returns"] == returns
    assert "eval episode 2: return" in capsys.readouterr().out


def test_eval_only_refuses_what_it_cannot_evaluate(dqn_torchrun_run, tmp_path, capsys, process_state):
    """Another script's model (the helper's made-up one, and apex_dqn.py's given to apex_ddpg.py), a contradicting
    --env-id or --network, a garbage file, a model.pt without its args.json, a missing file, and torchrun: one error
    line each, exit 2. The two scripts' main_eval_only is the same text."""
    _, run_dir, _ = dqn_torchrun_run
    model = run_dir / "model.pt"
    assert_eval_only_refusals("apex_dqn.py", model, tmp_path)  # other script, --env-id Acrobot-v1, garbage
    lonely = tmp_path / "lonely" / "model.pt"
    lonely.parent.mkdir()
    lonely.write_bytes(model.read_bytes())
    assert "cannot read its run's args.json" in refusal(capsys, apex_dqn, ["--eval-only", str(lonely)])
    error = refusal(capsys, apex_dqn, ["--eval-only", str(model), "--network", "nature"])
    assert error == f"error: --network nature contradicts {model}, saved by a run with mlp", error
    error = refusal(capsys, apex_ddpg, ["--eval-only", str(run_dir / "checkpoint.pt")])
    assert error == f"error: {run_dir / 'checkpoint.pt'} was saved by apex_dqn.py, not apex_ddpg.py", error
    error = refusal(capsys, apex_dqn, ["--eval-only", str(tmp_path / "missing.pt")])
    assert error == f"error: --eval-only {tmp_path / 'missing.pt'}: no such file", error
    assert "without torchrun" in apex_dqn.validate(apex_dqn.Args(eval_only=str(model)), world_size=3)


def test_ddpg_eval_only_refuses_a_contradicting_env_id(ddpg_run, capsys, process_state):
    """apex_ddpg.py's --eval-only, of a model.pt and of a checkpoint.pt, refuses an --env-id other than the saved
    run's in one error line, as apex_dqn.py does."""
    _, run_dir, _ = ddpg_run
    for path in (run_dir / "model.pt", run_dir / "checkpoint.pt"):
        error = refusal(capsys, apex_ddpg, ["--eval-only", str(path), "--env-id", "MountainCarContinuous-v0"])
        assert error == f"error: --env-id MountainCarContinuous-v0 contradicts {path}, saved by a run with Pendulum-v1"


def refusal(capsys, m, argv) -> str:
    """The one error line of `m.main(argv)`, which must exit 2."""
    with pytest.raises(SystemExit) as e:
        m.main(m.parse_args(argv))
    assert e.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


class ConstantQ(nn.Module):
    """DQN: Q-values (1, 0) for every observation, so the greedy action is 0."""

    num_actions = 2

    def forward(self, obs):
        return torch.tensor([[1.0, 0.0]]).expand(len(obs), -1)


class ConstantMu(nn.Module):
    """DDPG: mu(s) = 0.5 for every observation, actions in [-2, 2]."""

    def __init__(self):
        super().__init__()
        self.register_buffer("action_scale", torch.tensor([2.0]))
        self.register_buffer("action_bias", torch.tensor([0.0]))

    def forward(self, obs):
        return torch.full((len(obs), 1), 0.5)


class CountingEnv(RecordingEnv):
    def __init__(self, length: int):
        super().__init__(length)
        self.resets = 0

    def reset(self, seed=None, options=None):
        self.resets += 1
        return super().reset(seed, options)


@script_ids
def test_evaluation_is_greedy_with_eval_greedy_and_explores_without(m):
    """--eval-greedy: DQN plays epsilon 0 (whatever --eval-epsilon), DDPG adds no noise. --no-eval-greedy: DQN's epsilon
    is --eval-epsilon (half the actions random here, so a quarter are 1), DDPG adds Gaussian noise of
    --exploration-noise half ranges (0.3 x 2). One reset before each game, none after the last (it would record an
    empty video). Defaults: DQN --no-eval-greedy (epsilon 0.001), DDPG --eval-greedy."""
    assert m.Args().eval_greedy is (m is apex_ddpg)
    model = ConstantQ() if m is apex_dqn else ConstantMu()
    played = {}
    for greedy in (True, False):
        env = CountingEnv(length=100)
        flags = dict(eval_epsilon=0.5) if m is apex_dqn else {}
        returns = m.play_episodes(m.Args(eval_greedy=greedy, **flags), model, env, 3, np.random.default_rng(0))
        assert returns == [100.0] * 3 and env.resets == 3
        played[greedy] = np.array(env.actions, dtype=np.float64).ravel()
    if m is apex_dqn:
        assert (played[True] == 0).all() and 0.15 < played[False].mean() < 0.35, played[False].mean()
    else:
        assert (played[True] == 0.5).all() and 0.5 < played[False].std() < 0.7, played[False].std()


@script_ids
def test_track_without_wandb_is_refused_by_validate(m, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ModuleNotFoundError
    env_id = "CartPole-v1" if m is apex_dqn else "Pendulum-v1"
    error = m.validate(m.Args(env_id=env_id, track=True))
    assert error.startswith('--track needs wandb (pip install -e ".[track]"): ModuleNotFoundError: '), error
    assert m.validate(m.Args(env_id=env_id)) is None


def test_tracking_names_the_run_after_its_directory_resumes_it_and_ends_with_the_exit_status(monkeypatch, tmp_path):
    """A --resume run continues the W&B run of its run directory (the same id); the final evaluation's videos are
    uploaded; the W&B run ends with the run's exit status."""
    m, wandb = apex_dqn, FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    run_dir = tmp_path / "CartPole-v1__apex_dqn__1__1700000000"
    (run_dir / "videos").mkdir(parents=True)
    (run_dir / "videos" / "rl-video-episode-0.mp4").write_bytes(b"")
    assert m.start_tracking(m.Args(env_id="CartPole-v1"), run_dir) is None and wandb.inits == []
    assert m.start_tracking(m.Args(env_id="CartPole-v1", track=True, wandb_entity="me"), run_dir) is wandb
    m.start_tracking(m.Args(env_id="CartPole-v1", track=True, resume=str(run_dir / "checkpoint.pt")), run_dir)
    first, second = wandb.inits
    assert first["name"] == second["name"] == run_dir.name and first["id"] == second["id"]
    assert len(first["id"]) <= 64 and first["id"].isalnum()  # W&B ids: letters, digits, - and _
    assert first["resume"] is None and second["resume"] == "allow" and first["entity"] == "me"
    assert first["sync_tensorboard"] and first["config"]["env_id"] == "CartPole-v1" and first["config"]["track"]
    m.finish_tracking(None, run_dir, 1)  # no --track
    m.finish_tracking(wandb, run_dir, 143)
    assert wandb.logged == [{"videos": ("video", str(run_dir / "videos" / "rl-video-episode-0.mp4"))}]
    assert wandb.finished == [143]


def test_a_failing_wandb_init_is_one_error_line_and_stops_the_actors(monkeypatch, tmp_path, capsys, process_state):
    """wandb.init fails (not logged in, say) once the actors run: one error line, exit 2, no process left behind."""
    monkeypatch.setitem(sys.modules, "wandb", FakeWandb(error=RuntimeError("api_key not configured (no-tty)")))
    args = apex_dqn.Args(env_id="CartPole-v1", log_dir=str(tmp_path), buffer_size=1000, learning_starts=100,
                         num_actors=2, hidden_sizes=(32,), track=True)  # fmt: skip
    with pytest.raises(SystemExit) as e:
        apex_dqn.main(args)
    assert e.value.code == 2 and not multiprocessing.active_children()
    assert capsys.readouterr().err == "error: --track: wandb.init failed: api_key not configured (no-tty)\n"


# ------------------------------------------------------------------ flags, checkpoints, run directories


@pytest.mark.parametrize(
    ("m", "args", "message"),
    [
        (apex_dqn, dict(env_id="CartPol-v1"), "did you mean CartPole-v1"),
        (apex_dqn, dict(env_id="Pendulum-v1"), "Ape-X DQN needs a Discrete action space: use apex_ddpg.py"),
        (apex_ddpg, dict(env_id="CartPole-v1"), "Ape-X DDPG needs a Box action space: use apex_dqn.py"),
        (apex_dqn, dict(num_actors=0), "--num-actors must be >= 1"),
        (apex_dqn, dict(priority_beta=1.5), "--priority-beta must be in [0, 1]"),
        (apex_ddpg, dict(critic_learning_rate=0.0), "--critic-learning-rate must be > 0"),
        (apex_dqn, dict(env_id="CartPole-v1", buffer_size=100), "must hold at least one --actor-batch"),
        (apex_dqn, dict(env_id="CartPole-v1", learning_starts=10**9), "--learning-starts"),
        (
            apex_dqn,
            dict(env_id="CartPole-v1", num_actors=3, buffer_size=1000, learning_starts=1000),
            "--learning-starts (1000) must be <= the replay's capacity, 999 (--buffer-size 1000 in 3 buffers)",
        ),
        (apex_ddpg, dict(capture_video=True), "--capture-video records the evaluation episodes; add --eval-episodes"),
        (apex_dqn, dict(resume="/nonexistent/checkpoint.pt"), "no such checkpoint"),
        (apex_dqn, dict(env_id="CartPole-v1", learning_rate=float("inf")), "--learning-rate must be a finite number"),
        (apex_ddpg, dict(tau=float("nan")), "--tau must be a finite number, got nan"),
        (apex_ddpg, dict(actor_torch_threads=0), "--actor-torch-threads must be >= 1"),
        (apex_dqn, dict(torch_threads=-1), "--torch-threads must be >= 0"),
        (apex_ddpg, dict(eval_only="/nonexistent/model.pt"), "--eval-only /nonexistent/model.pt: no such file"),
    ],
)
def test_bad_flags_one_line_error(m, args, message):
    assert message in m.validate(m.Args(**args))


@script_ids
def test_a_budget_that_never_starts_the_learner_is_refused(m, capsys, process_state):
    """Ape-X's --learning-starts (50,000) and a budget of 50,000 agent steps: the replay, one transition per agent step,
    never holds enough for the learner, which would end the run with updates=0 and exit 0. One error line names both
    flags and the command that prints flags that learn the env; those flags pass, and so does one step more."""
    env_id, suite = ("CartPole-v1", "cartpole") if m is apex_dqn else ("Pendulum-v1", "pendulum")
    error = refusal(capsys, m, ["--env-id", env_id, "--total-timesteps", "50000"])
    assert error.startswith("error: --learning-starts 50000 is not below --total-timesteps 50000: "), error
    hint = f"python benchmarks/learn.py --suite {suite} --only {m.__name__} --dry-run"
    assert hint in error, error
    assert m.validate(m.Args(env_id=env_id, total_timesteps=50_001)) is None
    (entry,) = [e for e in learn.suite(suite) if e.label == m.__name__]
    args = m.parse_args(learn.command(entry, 1, Path("runs"))[2:])  # the flags after `python SCRIPT`
    assert m.validate(args) is None and m.start_warnings(args, 0) == [], learn.command(entry, 1, Path("runs"))


@script_ids
@pytest.mark.parametrize(
    ("flags", "start_step", "warnings"),
    [
        (
            dict(total_timesteps=6000, eval_interval=100_000),
            0,
            ["--eval-interval 100000 puts no evaluation round before --total-timesteps 6000 (rounds run at its"],
        ),
        (dict(total_timesteps=6000, eval_interval=6000), 0, ["--eval-interval 6000 puts no evaluation round before"]),
        (dict(total_timesteps=6000, eval_interval=5999), 0, []),
        (dict(total_timesteps=6000, eval_interval=0), 0, []),
        (
            dict(total_timesteps=10_000, eval_interval=1500),
            9000,
            ["--eval-interval 1500 puts no evaluation round after the resumed step 9000 before"],
        ),
        (dict(total_timesteps=10_000, eval_interval=800), 9000, []),  # a round at 9,600
        (
            dict(total_timesteps=10_000, eval_interval=800, learning_starts=1000),
            9000,
            ["--resume: the 1000 agent steps left to --total-timesteps 10000 cannot refill the replay"],
        ),
        (dict(total_timesteps=10_000, eval_interval=800, learning_starts=999), 9000, []),
    ],
)
def test_a_run_that_skips_what_its_flags_suggest_warns(m, flags, start_step, warnings):
    """start_warnings, printed as `warning:` lines before the start line (the Atari run checks that): no multiple of
    --eval-interval before the budget's end (the run waits for no round at the end itself), or a resumed run that
    cannot refill the emptied replay to --learning-starts (one with nothing left to do is refused: test_reliability)."""
    said = m.start_warnings(m.Args(**{"learning_starts": 200, **flags}), start_step)
    assert len(said) == len(warnings) and all(s.startswith(w) for s, w in zip(said, warnings, strict=True)), said


@pytest.mark.parametrize(
    ("m", "argv", "message"),
    [
        (apex_dqn, ["--algo", "ddpg"], "error: --algo is now two scripts: apex_dqn.py (Ape-X DQN) and apex_ddpg.py"),
        (apex_ddpg, ["--algo=sac"], "error: --algo is now two scripts: apex_dqn.py (Ape-X DQN) and apex_ddpg.py"),
        (apex_dqn, ["--learner-threads", "2"], "error: --learner-threads is now --torch-threads (the actors'"),
        (apex_ddpg, ["--learning-rate", "1e-3"], "error: --learning-rate is now --critic-learning-rate (and --actor-"),
        (apex_dqn, ["--optimizer", "sgd"], "invalid choice 'sgd'"),
        (apex_dqn, ["--network", "resnet"], "invalid choice 'resnet'"),
        (apex_dqn, ["--atari-protocol", "openai"], "invalid choice 'openai'"),
        (apex_ddpg, ["--noise-type", "pink"], "invalid choice 'pink'"),
        (apex_ddpg, ["--epsilon", "0.1"], "Unrecognized options: --epsilon"),  # DQN's flags are not DDPG's
    ],
)
def test_flags_of_apex_py_and_bad_choices_exit_2(m, argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        m.parse_args(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert message in " ".join(err.replace("│", " ").split()), err
    if message.startswith("error: "):  # a renamed flag: one line naming the new one
        assert len(err.strip().splitlines()) == 1, err


def test_bad_flag_from_the_command_line(tmp_path):
    """One subprocess per script, both at once: exit 2, one error line, nothing created."""
    cases = {"apex_dqn.py": (["--n-step", "0"], "error: --n-step must be >= 1, got 0"),
             "apex_ddpg.py": (["--tau", "2"], "error: --tau must be in [0, 1], got 2.0")}  # fmt: skip
    procs = {}
    for script, (argv, _) in cases.items():
        cmd = [sys.executable, script, "--log-dir", str(tmp_path), *argv]
        procs[script] = subprocess.Popen(cmd, cwd=ROOT, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    for script, proc in procs.items():
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 2 and err.strip() == cases[script][1], (script, err)
    assert not any(Path(tmp_path).iterdir())


@pytest.fixture
def process_state():
    """main() run in this process changes signal handlers and torch's global settings: put them back."""
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    fill = torch.utils.deterministic.fill_uninitialized_memory
    yield
    for sig, handler in handlers.items():
        signal.signal(sig, handler)
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(deterministic)
    torch.utils.deterministic.fill_uninitialized_memory = fill


def meta(m) -> dict:
    if m is apex_dqn:
        return dict(script="apex_dqn.py", env_id="CartPole-v1", atari_protocol="deepmind", network="mlp",
                    hidden_sizes=[256, 256], obs_shape=[4], action_shape_or_n=2)  # fmt: skip
    return dict(script="apex_ddpg.py", env_id="Pendulum-v1", hidden_sizes=[256, 256], obs_shape=[3],
                action_shape_or_n=[1])  # fmt: skip


@script_ids
@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("garbage", "not a checkpoint this script can read (UnpicklingError: "),
        ("truncated", "not a checkpoint this script can read ("),
        ("no_meta", 'not a checkpoint this script can read (it has no "meta" entry)'),
        ("other_script", "it is a hts_a2c.py checkpoint (script hts_a2c.py), this run is script apex_"),
        ("other_env", "(env_id Acrobot-v1, obs_shape [6], action_shape_or_n 3), this run is env_id "),
    ],
)
def test_resume_refuses_a_checkpoint_it_cannot_continue(m, case, message, tmp_path, capsys, process_state):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    path = write_unusable_checkpoint(run_dir, case, meta(m))
    before = path.read_bytes()
    with pytest.raises(SystemExit) as e:
        m.main(m.Args(env_id=meta(m)["env_id"], log_dir=str(tmp_path / "logs"), resume=str(path)))
    assert e.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: cannot resume from {path}: ") and message in lines[0], lines
    assert list(run_dir.iterdir()) == [path] and path.read_bytes() == before  # no events file, checkpoint unchanged
    assert not (tmp_path / "logs").exists()


@script_ids
@pytest.mark.parametrize("log_dir", ["/proc/x", "a_file/runs"])
def test_unusable_log_dir_is_one_error_line(m, log_dir, tmp_path, capsys, process_state):
    (tmp_path / "a_file").write_text("")
    env_id = "CartPole-v1" if m is apex_dqn else "Pendulum-v1"
    with pytest.raises(SystemExit) as e:
        m.main(m.Args(env_id=env_id, log_dir=log_dir if log_dir.startswith("/") else str(tmp_path / log_dir)))
    assert e.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: cannot create the run directory "), lines


def test_runs_started_in_the_same_second_get_their_own_directories(tmp_path, monkeypatch):
    monkeypatch.setattr(apex_dqn.time, "time", lambda: 1700000000.5)
    args = apex_dqn.Args(env_id="CartPole-v1", log_dir=str(tmp_path))
    dirs = [apex_dqn.new_run_dir(args) for _ in range(3)]
    assert [d.name for d in dirs] == [f"CartPole-v1__apex_dqn__1__1700000000{s}" for s in ("", "-2", "-3")]


# ------------------------------------------------------------------ failures and shutdown


def long_run(script: str, log_dir, extra=()):
    """A CartPole (DQN) or Pendulum (DDPG) run with no end in sight, with its children: actor 0, actor 1, evaluator."""
    env_id, tiny = ("CartPole-v1", TINY_DQN) if script == "apex_dqn.py" else ("Pendulum-v1", TINY_DDPG)
    proc = start_run(script, ["--env-id", env_id, *tiny, "--total-timesteps", "100000000", "--eval-interval", "500",
                              *extra], log_dir)  # fmt: skip
    workers = sorted(children_of(proc.pid))  # in start order
    assert len(workers) == 3, workers
    return proc, workers


def test_crashing_actor_stops_the_run_naming_it(tmp_path):
    proc = run_script(
        "apex_dqn.py",
        ["--env-id", "tests.faulty_env:CrashingCartPole-v0", *TINY_DQN, "--total-timesteps", "100000000",
         "--eval-interval", "0"],
        tmp_path,
    )  # fmt: skip
    assert proc.returncode == 1
    assert "error: actor" in proc.stderr and "died" in proc.stderr and "injected env failure" in proc.stderr


def test_killed_actor_stops_the_run_naming_it(tmp_path):
    proc, workers = long_run("apex_dqn.py", tmp_path)
    os.kill(workers[1], signal.SIGKILL)
    _, err = proc.communicate(timeout=60)  # the deadline only catches a hang: RESULTS.md measures the time to stop
    assert proc.returncode == 1 and "error: actor 1 died (killed by signal 9)" in err, err
    wait_for(lambda: not any(alive(pid) for pid in workers), "no worker left (no orphans)")


def _hold_lock_forever(m, lock, held) -> None:
    with m.hold(lock, "actor 1's replay"):
        held.set()
        time.sleep(3600)


def _take_lock(m, lock, go) -> None:
    go.wait(10)
    with m.hold(lock, "actor 1's replay"):
        pass


@script_ids
def test_a_process_killed_holding_a_lock_is_named_not_the_lock_timeout_it_causes(m, monkeypatch):
    """Deterministic: a process is killed (signal 9) inside a shared lock; another then times out on that lock and
    queues its LockTimeout traceback. The run's error names the killed process, the cause, though the other process
    was started first and its traceback is in the queue."""
    monkeypatch.setattr(m, "LOCK_TIMEOUT", 0.5)  # read at call time, inherited by the forked children
    ctx = multiprocessing.get_context("fork")
    lock, held, go, error_q = ctx.Lock(), ctx.Event(), ctx.Event(), ctx.Queue()
    procs = m.Processes(ctx)
    procs.start("actor 0", m.worker_body, _take_lock, error_q, m, lock, go)  # waits for `go`
    procs.start("actor 1", m.worker_body, _hold_lock_forever, error_q, m, lock, held)
    holder, waiter = procs.procs["actor 1"], procs.procs["actor 0"]
    assert held.wait(10)
    os.kill(holder.pid, signal.SIGKILL)
    holder.join(10)
    go.set()
    waiter.join(10)
    assert (holder.exitcode, waiter.exitcode) == (-signal.SIGKILL, 1)
    line = m.worker_failure(procs, error_q)
    assert line == "error: actor 1 died (killed by signal 9); stopping the run"
    queued = error_q.get(timeout=5)  # the waiter's report is there, and was not the one chosen
    assert queued.startswith("error: actor 0 died:") and "LockTimeout" in queued, queued


def test_sigint_stops_cleanly_with_a_checkpoint_even_with_a_stopped_process(tmp_path):
    """The evaluator stopped (SIGSTOP, asleep on the stop flag: it can never wake) must not block Ctrl+C, which stops
    every process, exits 130 and writes a final checkpoint."""
    proc, workers = long_run("apex_ddpg.py", tmp_path, ["--checkpoint-interval", "3600"])
    for line in proc.stdout:  # until the learner has updated: the checkpoint then holds a trained model
        if " updates=0 " not in line:
            break
    os.kill(workers[2], signal.SIGSTOP)
    wait_for(lambda: state_of(workers[2]) == "T", "the evaluator to stop")
    proc.send_signal(signal.SIGINT)
    try:
        _, err = proc.communicate(timeout=60)
        wait_for(lambda: not any(alive(pid) for pid in workers), "no process left (no orphans)")
    finally:
        for pid in [proc.pid, *workers]:
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
    assert proc.returncode == 130 and "Traceback" not in err, err
    checkpoint = torch.load(only_run_dir(tmp_path) / "checkpoint.pt", weights_only=False)
    assert checkpoint["global_step"] > 0 and checkpoint["version"] > 0


@script_ids
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_during_start_up_stops_cleanly(m, sig, tmp_path, monkeypatch, capsys, process_state):
    """The signal arrives once the run directory exists (with its args.json) and the learner is being built, before
    any process starts: no process, no directory left, exit 128 + signal. A signal later in start-up is seen at the
    top of the training loop (the SIGINT test)."""
    learner = m.Learner

    def signalled(*args):
        os.kill(os.getpid(), sig)
        return learner(*args)

    monkeypatch.setattr(m, "Learner", signalled)
    env_id = "CartPole-v1" if m is apex_dqn else "Pendulum-v1"
    with pytest.raises(SystemExit) as e:
        m.main(m.Args(env_id=env_id, log_dir=str(tmp_path), buffer_size=1000, learning_starts=100, num_actors=2))
    assert e.value.code == 128 + sig
    assert "during the start" in capsys.readouterr().err
    assert not any(tmp_path.iterdir()) and not multiprocessing.active_children()


def test_full_disk_stops_cleanly_and_keeps_the_last_checkpoint(tmp_path):
    with small_tmpfs(tmp_path / "disk", "4m") as disk:
        proc, workers = long_run("apex_dqn.py", disk, ["--checkpoint-interval", "0.2"])
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
        wait_for(lambda: not any(alive(pid) for pid in workers), "no worker left (no orphans)")


@script_ids
def test_a_non_finite_update_stops_the_run_before_the_actors_get_its_parameters(m, tmp_path, monkeypatch, capsys,
                                                                                 process_state):  # fmt: skip
    """The learner's loop checks each update's loss and gradient norm: the 7th update's NaN loss (injected into the
    algorithm's loss function) stops the run with the error line, the parameters it made are never published to the
    actors, and the checkpoint on disk is the last good one."""
    name = "dqn_loss" if m is apex_dqn else "critic_loss"
    loss_of, calls, published = getattr(m, name), [], []

    def poisoned(*args):
        loss, td, q = loss_of(*args)
        calls.append(1)
        return (loss * math.nan if len(calls) == 7 else loss), td, q

    publish = m.ParamStore.publish

    def recorded(store, flat, version):
        published.append((version, bool(torch.isfinite(flat).all())))
        publish(store, flat, version)

    monkeypatch.setattr(m, name, poisoned)
    monkeypatch.setattr(m.ParamStore, "publish", recorded)
    env = ["--env-id", "CartPole-v1", *TINY_DQN] if m is apex_dqn else ["--env-id", "Pendulum-v1", *TINY_DDPG]
    argv = [*env, "--total-timesteps", "100000000", "--checkpoint-interval", "0.001", "--log-dir", str(tmp_path)]
    with pytest.raises(SystemExit) as e:
        m.main(m.parse_args(argv))
    err = capsys.readouterr().err
    assert e.value.code == 1 and "Traceback" not in err, err
    line = r"^error: non-finite loss nan \(gradient norm nan\) at learner update 7 in the learner at global step \d+"
    assert re.search(line, err, re.M), err
    assert published == [(v, True) for v in range(7)]  # the initial parameters and the 6 good updates
    checkpoint = torch.load(only_run_dir(tmp_path) / "checkpoint.pt", weights_only=False)
    assert checkpoint["version"] <= 6 and all(torch.isfinite(w).all() for w in checkpoint["model"].values())


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "kill-9"])
@pytest.mark.parametrize("script", ["apex_dqn.py", "apex_ddpg.py"])
def test_a_stopped_torchrun_launcher_stops_the_run_with_its_checkpoint(script, sig, tmp_path):
    """SIGTERM to the torchrun launcher, which forwards it to every rank, or kill -9 of it (the ranks, in their own
    sessions and reparented, stop as on SIGTERM): the actor rank ends at once, and the learner takes its going away
    for the stop it is (issue 64): the stop line, the final checkpoint, the summary of exit status 143, no error line
    and no traceback of a rank; none of the ranks and actors is left running."""
    env = ["--env-id", "CartPole-v1", *TINY_DQN] if script == "apex_dqn.py" else ["--env-id", "Pendulum-v1", *TINY_DDPG]
    args = [*env, "--num-actors", "1", "--total-timesteps", "100000000", "--checkpoint-interval", "3600"]
    proc, pids = launch_ranks(script, args, tmp_path)
    try:
        os.kill(proc.pid, sig)
        out, _ = proc.communicate(timeout=90)  # the ranks hold the pipe: it ends when they have exited
        wait_for(lambda: not processes_with(str(tmp_path)), "no rank or actor left running")
    finally:
        for pid in processes_with(str(tmp_path)):
            os.kill(pid, signal.SIGKILL)
        end_launch(proc, pids)
    if sig == signal.SIGKILL:
        assert "the torchrun launcher" in out and "is gone" in out, out[-3000:]
    checkpoint = only_run_dir(tmp_path) / "checkpoint.pt"
    stop_line = rf"^stopped by SIGTERM at global step \d+; checkpoint written to {re.escape(str(checkpoint))}$"
    assert re.search(stop_line, out, re.M), out[-3000:]
    assert re.search(r"^stopped \(exit status 143\): ", out, re.M) and "\nerror: actor" not in out, out[-3000:]
    # a traceback only from the launcher itself, which re-raises the SIGTERM it forwarded
    assert out.count("Traceback") == out.count("elastic.multiprocessing.api.SignalException: "), out[-3000:]
    assert torch.load(checkpoint, weights_only=False)["global_step"] > 0


@script_ids
@pytest.mark.parametrize("launcher_killed", [False, True], ids=["learner-lost", "launcher-killed"])
def test_an_actor_rank_tells_a_lost_learner_from_a_killed_launcher(m, launcher_killed, monkeypatch, capsys,
                                                                   process_state):  # fmt: skip
    """An actor rank's wait in rpc.shutdown fails when rank 0 dies, and also when the launcher is killed with kill -9,
    as rpc's store lives in the launcher: when rank 0's launcher watch fires first, the actor's wait fails before its
    own watch has looked. Rank 0 lost while the launcher lives is an error line and exit 1 (after the rank has waited
    2 s for a reparenting); a failure after the launcher is gone (this rank reparented) is the stop, exit 143 with no
    line of its own (the watches report it)."""
    calls = []

    def getppid():  # the launcher at the start; once the wait has failed, init (1) if the launcher was killed
        calls.append(1)
        return 1 if launcher_killed and len(calls) > 1 else 4321

    monkeypatch.setattr(m.os, "getppid", getppid)
    monkeypatch.setattr(m.rpc, "init_rpc", lambda *args, **kwargs: None)

    def store_gone():
        raise RuntimeError("Failed to recv, got 0 bytes. Connection was likely closed.")

    monkeypatch.setattr(m.rpc, "shutdown", store_gone)
    with pytest.raises(SystemExit) as e:
        m.serve_actor_host(1, 2)
    err = capsys.readouterr().err
    if launcher_killed:
        assert e.value.code == 143 and err == "", err
    else:
        assert e.value.code == 1 and err == "error: actor rank 1 lost the learner (rank 0): Failed to recv, got 0 " \
                                            "bytes. Connection was likely closed.\n", err  # fmt: skip
