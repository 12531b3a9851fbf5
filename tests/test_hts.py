"""hts_a2c.py and hts_ppo.py: pure functions against slow loops written from the definitions, then the scripts end to
end on tiny budgets (TensorBoard tags, --track as one offline W&B run, --eval-only, policy lag, determinism, storage
role swap, resume, bad flags, shutdown).

Runs that only compare results call `main` in this process (no interpreter start-up per run); the command-line path,
signals, killed workers and a full disk run the scripts as subprocesses."""

import contextlib
import copy
import io
import json
import math
import os
import re
import signal
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import gymnasium as gym
import numpy as np
import pytest
import torch
import tyro
from helpers import (
    CORE_TAGS,
    FakeWandb,
    FixedLogitsPolicy,
    RecordingEnv,
    assert_documented_tags,
    assert_eval_only_refusals,
    assert_finite_tags,
    assert_tracked_once,
    children_of,
    event_accumulator,
    fill_disk,
    offline_wandb_env,
    only_run_dir,
    run_eval_only,
    run_script,
    scalars,
    small_tmpfs,
    start_run,
    write_unusable_checkpoint,
)
from torch import nn

import hts_a2c
import hts_ppo
from common.models import make_model

MODULES = {"hts_a2c.py": hts_a2c, "hts_ppo.py": hts_ppo}
REQUIRED_TAGS = [
    *CORE_TAGS,
    "timing/learner_wait_executors",
    "timing/executor_wait_actors",
    "timing/executor_wait_learner",
    "timing/actor_wait_requests",
    "timing/executor_wait_lockstep",
    "eval/episodic_return",
]
# Tiny CartPole runs: 4 envs, one per executor (so 4 actors all get work); A2C 8-step rollouts (30 updates), PPO
# 16-step rollouts with 2 minibatches (15 updates).
TOTAL = 960
COMMON = {"env_id": "CartPole-v1", "num_envs": 4, "num_executors": 4, "log_frequency": 1}
TINY = {
    "hts_a2c.py": {**COMMON, "sync_interval": 8, "total_timesteps": TOTAL},
    "hts_ppo.py": {**COMMON, "sync_interval": 16, "num_minibatches": 2, "total_timesteps": TOTAL},
}


def updates(script, total=TOTAL):
    return total // (4 * TINY[script]["sync_interval"])


def cli(settings):
    """Command-line flags for Args field values."""
    flags = []
    for key, value in settings.items():
        if value is not False:
            flags += [f"--{key.replace('_', '-')}", *([] if value is True else [str(value)])]
    return flags


def tiny_args(script, log_dir, **overrides):
    return MODULES[script].Args(**{**TINY[script], "log_dir": str(log_dir), **overrides})


@contextlib.contextmanager
def process_state_kept():
    """Undo what a script's `main` called in this process sets process-wide: torch threads, the thread excepthook."""
    excepthook, threads = threading.excepthook, torch.get_num_threads()
    try:
        yield
    finally:
        threading.excepthook = excepthook
        torch.set_num_threads(threads)


@pytest.fixture
def in_process():
    with process_state_kept():
        yield


# ---- Pure functions --------------------------------------------------------------------------------------------------


def random_rollout(T=7, B=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    rewards = torch.randn(T, B, generator=g, dtype=torch.float64)
    dones = (torch.rand(T, B, generator=g) < 0.3).double()
    values = torch.randn(T + 1, B, generator=g, dtype=torch.float64)
    return rewards, dones, values


def test_n_step_returns_match_discounted_sums():
    rewards, dones, values = random_rollout()
    returns = hts_a2c.n_step_returns(rewards, dones, values[-1], 0.9)
    T, B = rewards.shape
    for b in range(B):
        for t in range(T):  # R_t = sum_k gamma^k r_{t+k} up to the episode end, + gamma^{T-t} V(s_T) if none
            total, discount = 0.0, 1.0
            for k in range(t, T):
                total += discount * rewards[k, b].item()
                discount *= 0.9
                if dones[k, b]:
                    break
            else:
                total += discount * values[-1, b].item()
            assert returns[t, b].item() == pytest.approx(total, abs=1e-10)


def test_gae_matches_sum_of_discounted_td_errors():
    rewards, dones, values = random_rollout(seed=1)
    gamma, lam = 0.99, 0.9
    T, B = rewards.shape
    advantages = hts_ppo.gae(rewards, values[:T], dones, values[T], gamma, lam)
    returns = advantages + values[:T]
    for b in range(B):
        for t in range(T):  # A_t = sum_l (gamma lam)^l delta_{t+l}, cut at the episode end (GAE paper, Eq. 16)
            total = 0.0
            for k in range(t, T):
                delta = rewards[k, b] + gamma * (1 - dones[k, b]) * values[k + 1, b] - values[k, b]
                total += (gamma * lam) ** (k - t) * delta.item()
                if dones[k, b]:
                    break
            assert advantages[t, b].item() == pytest.approx(total, abs=1e-10)
            assert returns[t, b].item() == pytest.approx(total + values[t, b].item(), abs=1e-10)
    # lambda = 1 gives the n-step returns of A2C
    returns_1 = hts_ppo.gae(rewards, values[:T], dones, values[T], gamma, 1.0) + values[:T]
    torch.testing.assert_close(returns_1, hts_a2c.n_step_returns(rewards, dones, values[-1], gamma))


def softmax_rows(logits):
    out = []
    for row in logits.tolist():
        m = max(row)
        e = [math.exp(x - m) for x in row]
        out.append([x / sum(e) for x in e])
    return out


def test_a2c_loss_matches_per_sample_formula():
    g = torch.Generator().manual_seed(2)
    logits, values = torch.randn(6, 4, generator=g, dtype=torch.float64), torch.randn(6, generator=g).double()
    actions, returns = torch.randint(0, 4, (6,), generator=g), torch.randn(6, generator=g).double()
    out = hts_a2c.a2c_loss(logits, values, actions, returns, vf_coef=0.5, ent_coef=0.01)
    probs = softmax_rows(logits)
    pl = vl = ent = 0.0
    for i in range(6):
        adv = returns[i].item() - values[i].item()
        pl += -adv * math.log(probs[i][actions[i]]) / 6
        vl += adv**2 / 6
        ent += -sum(p * math.log(p) for p in probs[i]) / 6
    assert out["policy_loss"].item() == pytest.approx(pl)
    assert out["value_loss"].item() == pytest.approx(vl)
    assert out["entropy"].item() == pytest.approx(ent)
    assert out["total_loss"].item() == pytest.approx(pl + 0.5 * vl - 0.01 * ent)


def test_ppo_loss_matches_per_sample_formula():
    g = torch.Generator().manual_seed(3)
    M = 8
    logits, values = torch.randn(M, 3, generator=g, dtype=torch.float64), torch.randn(M, generator=g).double()
    actions = torch.randint(0, 3, (M,), generator=g)
    old_log_probs = torch.log(torch.rand(M, generator=g).double() * 0.8 + 0.1)
    advantages, returns = torch.randn(M, generator=g).double(), torch.randn(M, generator=g).double()
    out = hts_ppo.ppo_loss_value_clipped(logits, values, actions, old_log_probs, advantages, returns, 0.1, 0.5, 0.003)
    probs = softmax_rows(logits)
    adv = advantages.numpy()
    norm = (adv - adv.mean()) / (adv.std() + 1e-8)
    pl = vl = ent = 0.0
    for i in range(M):
        ratio = probs[i][actions[i]] / math.exp(old_log_probs[i].item())
        pl += -min(ratio * norm[i], min(max(ratio, 0.9), 1.1) * norm[i]) / M
        vl += 0.5 * (returns[i].item() - values[i].item()) ** 2 / M
        ent += -sum(p * math.log(p) for p in probs[i]) / M
    assert out["policy_loss"].item() == pytest.approx(pl)
    assert out["value_loss"].item() == pytest.approx(vl)
    assert out["entropy"].item() == pytest.approx(ent)
    assert out["total_loss"].item() == pytest.approx(pl + 0.5 * vl - 0.003 * ent)


def test_ppo_clipped_value_loss_is_the_max_of_unclipped_and_clipped():
    """Kostrikov's PPO (use_clipped_value_loss, its default) and HTS-RL's code: 0.5 max((V - R)^2, (V_clip - R)^2)
    with V_clip = V_old + clip(V - V_old, -eps, eps); the default --clip-vloss turns it on."""
    g = torch.Generator().manual_seed(5)
    M, eps = 16, 0.1
    logits, values = torch.randn(M, 3, generator=g, dtype=torch.float64), torch.randn(M, generator=g).double()
    actions = torch.randint(0, 3, (M,), generator=g)
    old_log_probs = torch.log(torch.rand(M, generator=g).double() * 0.8 + 0.1)
    advantages, returns = torch.randn(M, generator=g).double(), torch.randn(M, generator=g).double()
    old_values = values + 0.3 * torch.randn(M, generator=g).double()  # some |V - V_old| above eps, some below
    out = hts_ppo.ppo_loss_value_clipped(
        logits, values, actions, old_log_probs, advantages, returns, eps, 0.5, 0.0, old_values
    )
    vl, clipped_wins = 0.0, 0
    for i in range(M):
        v, v_old, r = values[i].item(), old_values[i].item(), returns[i].item()
        v_clip = v_old + min(max(v - v_old, -eps), eps)
        vl += 0.5 * max((v - r) ** 2, (v_clip - r) ** 2) / M
        clipped_wins += (v_clip - r) ** 2 > (v - r) ** 2
    assert 0 < clipped_wins < M  # both branches of the max are exercised
    assert out["value_loss"].item() == pytest.approx(vl)
    assert out["total_loss"].item() == pytest.approx(out["policy_loss"].item() + 0.5 * vl)
    assert hts_ppo.Args().clip_vloss
    unclipped = hts_ppo.ppo_loss_value_clipped(
        logits, values, actions, old_log_probs, advantages, returns, eps, 0.5, 0.0
    )
    assert unclipped["value_loss"].item() == pytest.approx(0.5 * ((returns - values) ** 2).mean().item())


@pytest.mark.parametrize("variant", ["eq6", "released"])
def test_ppo_minibatches_match_a_per_sample_loop_over_the_rollout(variant):
    """hts_ppo's update from a rollout: pi_old, V_old of the behavior network, GAE per env, and each minibatch's
    losses, against a loop over the samples one at a time (the paper's equations written out). eq6: the parameters
    trained are the behavior's own copy (the bootstrap value is theirs too, the first ratios 1); released (HTS-RL's
    code): the current parameters theta_j, a step away from the behavior theta_{j-1}, are trained, their ratio taken
    against the behavior policy, their values clipped around the behavior's, GAE bootstrapped with theta_j's value.
    The second minibatch comes after the parameters moved, so ratios, value clipping and the advantages' alignment
    with their samples all count."""
    T, B, A = 3, 3, 3
    args = hts_ppo.Args(num_envs=B, sync_interval=T, num_minibatches=3, update_epochs=1, gamma=0.9, gae_lambda=0.8,
                        clip_coef=0.05, vf_coef=0.5, ent_coef=0.01)  # fmt: skip
    g = torch.Generator().manual_seed(11)
    batch = hts_ppo.Rollout(obs=torch.randn(T + 1, B, 4, generator=g), actions=torch.randint(0, A, (T, B), generator=g),
                            rewards=torch.randn(T, B, generator=g),
                            dones=torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 0.0], [1.0, 0.0, 0.0]]))  # fmt: skip
    torch.manual_seed(0)
    model = make_model(gym.spaces.Box(-1, 1, (4,), np.float32), gym.spaces.Discrete(A), "mlp")
    behavior = copy.deepcopy(model)
    if variant == "released":  # theta_{j-1}, which acted: an update behind the parameters trained
        with torch.no_grad():
            for p in behavior.parameters():
                p.add_(0.1 * torch.randn(p.shape, generator=g))
    current = copy.deepcopy(model)  # the parameters trained, before the first step
    torch.manual_seed(5)
    order = torch.randperm(T * B).tolist()
    torch.manual_seed(5)  # minibatch_losses draws the same order
    minibatches = hts_ppo.minibatch_losses(model, batch, args, behavior if variant == "released" else None)
    first = next(minibatches)
    with torch.no_grad():  # an optimizer step's worth of change before the second minibatch
        for p in model.parameters():
            p.add_(0.2 * torch.randn(p.shape, generator=g))
    second = next(minibatches)

    def one(net, t, b):  # one observation at a time: (log pi(.|s) as a list, V(s))
        with torch.no_grad():
            logits, value = net(batch.obs[t, b][None])
        return torch.log_softmax(logits[0].double(), -1).tolist(), value.item()

    old = {(t, b): one(behavior, t, b) for t in range(T) for b in range(B)}  # pi_old, V_old: the behavior network
    values = {(t, b): old[t, b][1] for t in range(T) for b in range(B)}
    values |= {(T, b): one(current, T, b)[1] for b in range(B)}  # the bootstrap: the trained parameters' value
    advantage = {}
    for b in range(B):
        for t in range(T):  # A_t = sum_l (gamma lam)^l delta_{t+l}, cut at the episode's end
            total = 0.0
            for k in range(t, T):
                not_done = 1.0 - batch.dones[k, b].item()
                delta = batch.rewards[k, b].item() + 0.9 * not_done * values[k + 1, b] - values[k, b]
                total += 0.72 ** (k - t) * delta
                if not not_done:
                    break
            advantage[t, b] = total

    def expected(net, samples):
        adv = np.array([advantage[s] for s in samples])
        norm = (adv - adv.mean()) / (adv.std() + 1e-8)
        pl = vl = ent = 0.0
        for i, (t, b) in enumerate(samples):
            log_probs, value = one(net, t, b)
            a, (old_log_probs, old_value) = batch.actions[t, b].item(), old[t, b]
            ratio = math.exp(log_probs[a] - old_log_probs[a])
            pl -= min(ratio * norm[i], min(max(ratio, 0.95), 1.05) * norm[i]) / len(samples)
            ret = advantage[t, b] + old_value
            clipped = old_value + min(max(value - old_value, -0.05), 0.05)
            vl += 0.5 * max((value - ret) ** 2, (clipped - ret) ** 2) / len(samples)
            ent -= sum(math.exp(lp) * lp for lp in log_probs) / len(samples)
        return {"policy_loss": pl, "value_loss": vl, "entropy": ent, "total_loss": pl + 0.5 * vl - 0.01 * ent}

    for losses, net, rows in ((first, current, order[:3]), (second, model, order[3:6])):
        want = expected(net, [divmod(i, B) for i in rows])  # flat sample i is (t, b) = (i // B, i % B)
        for key, value in want.items():
            assert losses[key].item() == pytest.approx(value, rel=1e-4, abs=1e-6), key
    if variant == "eq6":
        assert first["approx_kl"].item() == pytest.approx(0.0, abs=1e-6)  # the behavior policy itself: ratio 1
    else:
        assert first["approx_kl"].item() > 1e-4  # theta_j against theta_{j-1}: the first ratios are not 1
    assert second["clipfrac"].item() > 0


def test_sample_actions_is_the_inverse_cdf():
    logits = torch.tensor([[0.0, 1.0, -1.0], [2.0, 0.0, 0.0]])
    probs = softmax_rows(logits)
    for u in np.linspace(0.0, 0.999, 37):
        actions = hts_a2c.sample_actions_from_uniforms(logits, torch.tensor([u, u]))
        for b in range(2):  # smallest a with P(A <= a) > u
            cumulative, expected = 0.0, None
            for a, p in enumerate(probs[b]):
                cumulative += p
                if cumulative > u:
                    expected = a
                    break
            assert actions[b].item() == expected
    # a uniform grid of u reproduces the softmax probabilities
    u = (torch.arange(10_000) + 0.5) / 10_000
    counts = torch.bincount(hts_a2c.sample_actions_from_uniforms(logits[:1].expand(10_000, 3), u), minlength=3) / 10_000
    np.testing.assert_allclose(counts.numpy(), probs[0], atol=2e-4)


@pytest.mark.parametrize("module", [hts_a2c, hts_ppo])
def test_delayed_update_applies_the_behavior_gradient_to_the_target(module):
    """Eq. 6 with SGD: theta_{j+1} = theta_j - lr * grad L(theta_{j-1}); L = 0.5 ||W x - y||^2, grad = (W x - y) x^T."""
    torch.manual_seed(0)
    target, behavior = nn.Linear(3, 2, bias=False).double(), nn.Linear(3, 2, bias=False).double()
    x, y = torch.randn(3, dtype=torch.float64), torch.randn(2, dtype=torch.float64)
    w_target, w_behavior = target.weight.detach().numpy().copy(), behavior.weight.detach().numpy().copy()
    optimizer = torch.optim.SGD(behavior.parameters(), lr=0.1)

    def step():
        optimizer.zero_grad()
        (0.5 * (behavior(x) - y).pow(2).sum()).backward()
        optimizer.step()
        return {"done": True}

    assert module.delayed_update(target, behavior, step) == {"done": True}
    grad = np.outer(w_behavior @ x.numpy() - y.numpy(), x.numpy())
    np.testing.assert_allclose(target.weight.detach().numpy(), w_target - 0.1 * grad, rtol=1e-12)


@pytest.mark.parametrize("module", [hts_a2c, hts_ppo])
def test_evaluation_samples_by_default_and_takes_argmax_actions_with_eval_greedy(module, monkeypatch, tmp_path):
    """The policy's argmax (action 2) has probability about 0.34: sampled, every action shows up."""
    logits = torch.tensor([0.0, 0.4, 0.8, 0.2])
    for flags, greedy in [([], False), (["--eval-greedy"], True)]:
        env = RecordingEnv(length=25)
        monkeypatch.setattr(module, "make_env", lambda *a, env=env, **k: env)
        args = tyro.cli(module.Args, args=["--env-id", "CartPole-v1", "--eval-episodes", "4", *flags])
        assert list(module.evaluate(FixedLogitsPolicy(logits), args, tmp_path, torch.device("cpu"))) == [25.0] * 4
        assert len(env.actions) == 100
        if greedy:
            assert set(env.actions) == {2}
        else:
            assert set(env.actions) == {0, 1, 2, 3} and 15 <= env.actions.count(2) <= 55


@pytest.mark.parametrize("module", [hts_a2c, hts_ppo])
@pytest.mark.parametrize("sync", [False, True])
def test_non_finite_loss_stops_before_any_parameter_changes(module, sync):
    """The learner checks the loss before the optimizer step: a NaN reward leaves the behavior and target parameters
    and the optimizer's state as they were."""
    torch.manual_seed(0)
    spaces = (gym.spaces.Box(-1, 1, (4,), np.float32), gym.spaces.Discrete(2))
    extra = {"num_minibatches": 1} if module is hts_ppo else {}
    args = module.Args(env_id="CartPole-v1", num_envs=2, sync_interval=4, sync=sync, **extra)
    learner = module.Learner(args, spaces, torch.device("cpu"), None)
    before = [copy.deepcopy(m.state_dict()) for m in (learner.behavior, learner.target)]
    batch = module.Rollout(obs=torch.randn(5, 2, 4), actions=torch.zeros(4, 2, dtype=torch.int64),
                           rewards=torch.tensor([[1.0, float("nan")]] * 4), dones=torch.zeros(4, 2))  # fmt: skip
    with pytest.raises(module.NonFiniteLoss, match="non-finite loss"):
        stop = (threading.Event(),) if module is hts_ppo else ()
        learner.step(batch, args.learning_rate, args, *stop)
    for model, state in zip((learner.behavior, learner.target), before, strict=True):
        assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    assert not learner.optimizer.state_dict()["state"]  # no step taken


@pytest.mark.parametrize("sync", [False, True])
def test_a_stop_request_ends_a_ppo_update_after_the_minibatch_step_in_progress(sync):
    """Ctrl+C while hts_ppo learns: the update ends after the step in progress (a Breakout update at the defaults
    is 16 steps, seconds long) and stands as it is: the parameters are those of that one step (the same as the first
    step of an uncut update, from the same state), the optimizer has counted one step, and the target took the
    behavior's displacement (Eq. 6) or, with --sync, its parameters."""
    args = hts_ppo.Args(env_id="CartPole-v1", num_envs=2, sync_interval=8, num_minibatches=2, update_epochs=3,
                        sync=sync, delayed_update="eq6")  # fmt: skip
    spaces = (gym.spaces.Box(-1, 1, (4,), np.float32), gym.spaces.Discrete(2))
    batch = hts_ppo.Rollout(obs=torch.randn(9, 2, 4), actions=torch.randint(0, 2, (8, 2)), rewards=torch.randn(8, 2),
                            dones=torch.zeros(8, 2))  # fmt: skip
    torch.manual_seed(0)
    learner = hts_ppo.Learner(args, spaces, torch.device("cpu"), None)
    with torch.no_grad():  # theta_j, a step ahead of the behavior parameters theta_{j-1} that collected the batch
        for p in learner.target.parameters():
            p.add_(0.5)
    reference, target = copy.deepcopy(learner.behavior), copy.deepcopy(learner.target.state_dict())
    behavior = copy.deepcopy(learner.behavior.state_dict())
    stop = threading.Event()
    stop.set()
    rng = torch.get_rng_state()
    stats = learner.step(batch, args.learning_rate, args, stop)
    assert learner.cut == (1, 6) and all(math.isfinite(v) for v in stats.values())
    assert {s["step"].item() for s in learner.optimizer.state_dict()["state"].values()} == {1}
    torch.set_rng_state(rng)  # the same minibatch order
    first = next(hts_ppo.minibatch_losses(reference, batch, args))
    hts_ppo.gradient_step(reference, hts_ppo.make_optimizer(reference, args), first["total_loss"], args.max_grad_norm)
    for name, p in reference.state_dict().items():
        assert torch.equal(learner.behavior.state_dict()[name], p)
        expected = p if sync else target[name] + (p - behavior[name])
        assert torch.allclose(learner.target.state_dict()[name], expected)
    learner.step(batch, args.learning_rate, args, threading.Event())
    assert learner.cut is None  # an update without a stop request takes all its steps


@pytest.mark.parametrize("sync", [False, True])
def test_released_update_steps_the_current_parameters_and_without_lag_is_the_eq6_update(sync):
    """--delayed-update released (HTS-RL's code): the optimizer steps theta_j (`target`) itself, and the behavior
    copy theta_{j-1} that collected the batch stays as it was; Eq. 6 steps the copy instead. With no lag (behavior ==
    target: the first update, and every one with --sync) the two are the same update: both learners end at the same
    parameters. A step later, with theta_j an update ahead of the behavior, they part."""
    spaces = (gym.spaces.Box(-1, 1, (4,), np.float32), gym.spaces.Discrete(2))
    g = torch.Generator().manual_seed(3)
    batch = hts_ppo.Rollout(obs=torch.randn(9, 2, 4, generator=g), actions=torch.randint(0, 2, (8, 2), generator=g),
                            rewards=torch.randn(8, 2, generator=g), dones=torch.zeros(8, 2))  # fmt: skip
    learners, settings = {}, {}
    for variant in ("eq6", "released"):
        settings[variant] = hts_ppo.Args(env_id="CartPole-v1", num_envs=2, sync_interval=8, num_minibatches=2,
                                         update_epochs=2, sync=sync, delayed_update=variant)  # fmt: skip
        torch.manual_seed(0)
        learners[variant] = hts_ppo.Learner(settings[variant], spaces, torch.device("cpu"), None)
    eq6, released = learners["eq6"], learners["released"]
    stepped = zip(released.optimizer.param_groups[0]["params"], released.target.parameters(), strict=True)
    assert all(p is q for p, q in stepped)  # the optimizer's parameters are theta_j's
    theta_0 = copy.deepcopy(released.target.state_dict())
    for variant, learner in learners.items():
        torch.manual_seed(1)  # the same minibatch order
        learner.step(batch, 1e-3, settings[variant], threading.Event())
    assert all(torch.equal(released.behavior.state_dict()[k], v) for k, v in theta_0.items())  # not stepped
    assert not all(torch.equal(released.target.state_dict()[k], v) for k, v in theta_0.items())
    for name, p in eq6.target.state_dict().items():
        assert torch.allclose(released.target.state_dict()[name], p, rtol=1e-5, atol=1e-7), name
    if sync:
        return
    for variant, learner in learners.items():  # the next update: data of theta_0, the target at theta_1
        learner.behavior.load_state_dict(theta_0)
        torch.manual_seed(2)
        learner.step(batch, 1e-3, settings[variant], threading.Event())
    assert all(torch.equal(released.behavior.state_dict()[k], v) for k, v in theta_0.items())
    assert not all(
        torch.allclose(released.target.state_dict()[k], v, rtol=1e-5, atol=1e-7)
        for k, v in eq6.target.state_dict().items()
    )


# ---- The scripts end to end ------------------------------------------------------------------------------------------


@pytest.fixture(scope="module", params=[(script, mode) for script in MODULES for mode in ("hts", "sync")],
                ids=lambda p: f"{p[0][:-3]}-{p[1]}")  # fmt: skip
def tiny_run(request, tmp_path_factory):
    """One tiny CartPole run per script and mode with 2 actors, evaluation, a checkpoint and a saved model: HTS-RL
    from the command line with --track (offline W&B), --sync through `main` in this process. Returns what it printed
    on stdout and its W&B directory (None: not tracked)."""
    script, mode = request.param
    log_dir = tmp_path_factory.mktemp(f"{script[:-3]}_{mode}")
    settings = {**TINY[script], "sync": mode == "sync", "num_actors": 2, "eval_episodes": 2, "save_model": True,
                "checkpoint_interval": 3600}  # fmt: skip
    if mode == "hts":
        wandb_dir = tmp_path_factory.mktemp(f"{script[:-3]}_wandb")
        proc = run_script(script, [*cli(settings), "--track"], log_dir, env=offline_wandb_env(wandb_dir))
        assert proc.returncode == 0, proc.stderr
        return script, mode, only_run_dir(log_dir), proc.stdout, wandb_dir
    with process_state_kept(), contextlib.redirect_stdout(io.StringIO()) as stdout:
        MODULES[script].main(MODULES[script].Args(**settings, log_dir=str(log_dir)))
    return script, mode, only_run_dir(log_dir), stdout.getvalue(), None


def test_tensorboard_tags_are_logged_and_finite(tiny_run):
    """--track: the learner alone logs to W&B (one run for its 4 executors and 2 actors)."""
    script, _, run_dir, stdout, wandb_dir = tiny_run
    data = scalars(run_dir)
    assert_finite_tags(data, REQUIRED_TAGS)
    assert_documented_tags(script, data)
    assert any(tag.startswith("hyperparameters") for tag in event_accumulator(run_dir).Tags()["tensors"])
    steps = updates(script) * 4 * TINY[script]["sync_interval"]
    assert max(step for step, _ in data["charts/SPS"]) == steps
    # the console: the start line with the plan, a line per report ending at the budget, the summary with its files
    plan = f"{updates(script)} updates of {steps // updates(script)} agent steps, 4 executors and 2 actors, cpu"
    assert stdout.startswith(f"run directory: {run_dir}  ({plan})\n"), stdout[:300]
    lines = re.findall(r"^global_step=\d+ SPS=\d+ mean_return=\S+ done=\S+% left=\S+ update=\d+/\d+$", stdout, re.M)
    last = f"done=100.0% left=0s update={updates(script)}/{updates(script)}"
    assert lines and lines[-1].startswith(f"global_step={steps} ") and lines[-1].endswith(last), stdout
    assert f"\nfinished: {steps:,} of {steps:,} agent steps in " in stdout, stdout
    assert f"wrote to {run_dir}: args.json, checkpoint.pt, events.out.tfevents." in stdout, stdout
    assert stdout.rstrip().endswith(f"python {script} --eval-only {run_dir / 'model.pt'}"), stdout[-300:]
    assert (run_dir / "model.pt").is_file() and (run_dir / "checkpoint.pt").is_file()
    checkpoint = torch.load(run_dir / "checkpoint.pt", weights_only=False)
    assert {"model", "optimizer", "global_step", "update", "rng", "args", "meta"} <= set(checkpoint)
    assert not list(run_dir.glob("*.tmp"))
    saved = json.loads((run_dir / "args.json").read_text())
    assert saved["script"] == script and saved["args"]["env_id"] == "CartPole-v1" and saved["meta"]["network"] == "mlp"
    if wandb_dir is not None:
        tracked = assert_tracked_once(wandb_dir, run_dir)
        assert tracked.config["num_executors"] == 4 and tracked.config["num_actors"] == 2


def test_eval_only_replays_the_saved_agent_with_the_end_of_training_evaluation(tiny_run, tmp_path, capsys, in_process):
    """checkpoint.pt (in this process) and, for the command-line runs, model.pt (with its args.json) play the run's own
    evaluation episodes again: same final policy, same evaluation seed."""
    script, mode, run_dir, _, _ = tiny_run
    played = [v for _, v in scalars(run_dir)["eval/episodic_return"]]
    MODULES[script].main(tyro.cli(MODULES[script].Args, args=["--eval-only", str(run_dir / "checkpoint.pt")]))
    out = capsys.readouterr().out
    assert "from its run: env_id=CartPole-v1 atari_protocol=deepmind network=mlp" in out
    assert "(10 episodes, sampled actions)" in out and "eval episode 9: return" in out
    report = json.loads(max(run_dir.glob("eval-*.json")).read_text())
    assert report["episodes"] == 10 and report["greedy"] is False and report["returns"][:2] == played
    if mode == "hts":
        proc, report = run_eval_only(script, run_dir / "model.pt", tmp_path / "logs", "--eval-episodes", "3")
        assert proc.returncode == 0 and report is not None, proc.stderr
        assert report["model"] == str(run_dir / "model.pt") and report["episodes"] == 3 and not report["greedy"]
        assert report["settings"] == {"env_id": "CartPole-v1", "atari_protocol": "deepmind", "network": "mlp"}
        returns = report["returns"]
        assert len(returns) == 3 and all(math.isfinite(r) and r == int(r) and 8 <= r <= 500 for r in returns), returns
        assert returns[:2] == played and report["mean"] == pytest.approx(np.mean(returns))


def run_main(module, capsys, flags):
    """`main` on command-line flags that it must refuse: its one error line."""
    with pytest.raises(SystemExit) as exc:
        module.main(tyro.cli(module.Args, args=flags))
    lines = capsys.readouterr().err.strip().splitlines()
    assert exc.value.code == 2 and len(lines) == 1, (exc.value.code, lines)
    return lines[0]


def test_eval_only_refuses_what_it_cannot_evaluate(tiny_run, tmp_path, capsys, in_process):
    """From the command line (the helpers' cases: another script's model, --env-id Acrobot-v1, garbage), and in this
    process: a model.pt without its args.json, a contradicting --network, a missing file."""
    script, mode, run_dir, _, _ = tiny_run
    if mode == "hts":
        assert_eval_only_refusals(script, run_dir / "model.pt", tmp_path)
        return
    module = MODULES[script]
    lonely = tmp_path / "lonely"
    lonely.mkdir()
    (lonely / "model.pt").write_bytes((run_dir / "model.pt").read_bytes())
    error = run_main(module, capsys, ["--eval-only", str(lonely / "model.pt")])
    assert "cannot read its run's args.json" in error, error
    error = run_main(module, capsys, ["--eval-only", str(run_dir / "checkpoint.pt"), "--network", "nature"])
    assert error == f"error: --network nature contradicts {run_dir / 'checkpoint.pt'}, saved by a run with mlp", error
    error = run_main(module, capsys, ["--eval-only", str(tmp_path / "missing.pt")])
    assert error == f"error: --eval-only {tmp_path / 'missing.pt'}: no such file", error
    assert not list(tmp_path.glob("runs*"))


def test_policy_lag_is_one_update_and_zero_with_sync(tiny_run):
    """HTS-RL: the first update learns from data of the initial policy (lag 0), every later one with a lag of exactly
    1. --sync: every update learns from data of the parameters it updates (lag 0)."""
    script, mode, run_dir, *_ = tiny_run
    data = scalars(run_dir)
    lags = [v for _, v in data["charts/policy_lag"]]
    assert len(lags) == updates(script)
    if mode == "sync":
        assert set(lags) == {0.0}
    else:
        assert lags[0] == 0 and set(lags[1:]) == {1.0}


def final_model_and_returns(run_dir):
    return torch.load(run_dir / "model.pt"), scalars(run_dir)["charts/episodic_return"]


def test_runs_are_deterministic_whatever_the_number_of_actors(tiny_run, tmp_path, in_process):
    """Same seed with 1, 2 and 4 actors: bitwise the same final parameters and the same training episodes (step and
    return) after 15-30 synchronizations, in both modes (actors sample with executor-drawn uniforms and forward one
    executor's observations at a time). Another seed gives other parameters."""
    script, mode, run_dir, *_ = tiny_run
    runs = {"1": {"num_actors": 1}, "4": {"num_actors": 4}} | ({"seed2": {"seed": 2}} if mode == "hts" else {})
    for name, overrides in runs.items():
        MODULES[script].main(tiny_args(script, tmp_path / name, sync=mode == "sync", save_model=True, **overrides))
    model, returns = final_model_and_returns(run_dir)
    assert len(returns) >= 20  # CartPole episodes of a random-ish policy: tens of them in 960 steps
    for name in ("1", "4"):
        other_model, other_returns = final_model_and_returns(only_run_dir(tmp_path / name))
        assert model.keys() == other_model.keys()
        assert all(torch.equal(model[k], other_model[k]) for k in model), f"{name} actors: other parameters"
        assert returns == other_returns, f"{name} actors: other episodes"
    if mode == "hts":
        other, _ = final_model_and_returns(only_run_dir(tmp_path / "seed2"))
        assert not all(torch.equal(model[k], other[k]) for k in model)


@pytest.mark.parametrize("sync", [False, True], ids=["hts", "sync"])
@pytest.mark.parametrize("script", MODULES)
def test_each_update_learns_from_the_previous_policy_while_the_next_rollout_runs(script, sync, monkeypatch, tmp_path,
                                                                                  in_process):  # fmt: skip
    """HTS-RL's one step of delay, read off the parameters: update k learns from the data of behavior = theta_{k-1}
    (the target before update k-1; theta_0 for k = 0), on storage k % 2, while the executors fill the other storage:
    before update k returns, collection k+1 has replaced the bootstrap observations update k-1 read there (zeros for
    k = 0). Waited for as a condition, not timed; collection k+1 may also have finished before update k began.
    --sync: behavior = theta_k, the parameters being updated."""
    module = MODULES[script]
    seen = []  # per update: (storage, target before it, behavior)
    read_last = []  # per update: the bootstrap observations it read
    step = module.Learner.step

    def watching_step(learner, batch, lr, args, *stop):  # hts_ppo's step also takes the stop event
        storages = batch.obs._base  # [2, T+1, N, ...]: the shared storages the learner's batch is a view of
        s = (batch.obs.data_ptr() - storages.data_ptr()) // storages[0].nbytes
        params = [nn.utils.parameters_to_vector(m.parameters()).clone() for m in (learner.target, learner.behavior)]
        seen.append((s, *params))
        read_last.append(storages[s, -1].clone())
        if not sync and len(seen) < 6:  # all but the last update have a collection running concurrently
            previous = read_last[-2] if len(read_last) > 1 else torch.zeros_like(storages[1 - s, -1])
            deadline = time.time() + 60
            while torch.equal(storages[1 - s, -1], previous) and time.time() < deadline:
                time.sleep(0.01)
            assert not torch.equal(storages[1 - s, -1], previous), "executors did not fill the other storage"
        return step(learner, batch, lr, args, *stop)

    monkeypatch.setattr(module.Learner, "step", watching_step)
    module.main(tiny_args(script, tmp_path, num_envs=2, num_executors=2, num_actors=1, sync_interval=4,
                          total_timesteps=6 * 8, sync=sync, log_interval=100.0))  # fmt: skip
    assert [s for s, _, _ in seen] == [0, 1, 0, 1, 0, 1]
    targets, behaviors = [t for _, t, _ in seen], [b for _, _, b in seen]
    expected = targets if sync else [targets[0], *targets[:-1]]
    for k in range(6):
        assert torch.equal(behaviors[k], expected[k]), f"update {k}"
        assert k == 0 or not torch.equal(targets[k], targets[k - 1])  # every update moved the parameters


@pytest.mark.parametrize("script", MODULES)
def test_resume_continues_the_run_directory_and_step_count(script, tmp_path, in_process):
    settings = {"checkpoint_interval": 3600, "num_actors": 1}
    MODULES[script].main(tiny_args(script, tmp_path, total_timesteps=640, **settings))
    run_dir = only_run_dir(tmp_path)
    assert torch.load(run_dir / "checkpoint.pt", weights_only=False)["global_step"] == 640
    resume = str(run_dir / "checkpoint.pt")
    MODULES[script].main(tiny_args(script, tmp_path, total_timesteps=1280, resume=resume, **settings))
    assert only_run_dir(tmp_path) == run_dir
    checkpoint = torch.load(run_dir / "checkpoint.pt", weights_only=False)
    assert checkpoint["global_step"] == 1280 and checkpoint["update"] == updates(script, 1280)
    lags = scalars(run_dir)["charts/policy_lag"]
    steps = [s for s, _ in lags]
    assert max(steps) == 1280 and min(steps) > 0
    after = [v for s, v in lags if s > 640]
    assert after[0] == 0 and set(after[1:]) == {1.0}  # the pipeline restarts like a new run


def test_released_update_keeps_the_policy_lag_determinism_and_resume(tmp_path, in_process, capsys):
    """--delayed-update released end to end: policy lag 0, then exactly 1; bitwise the same parameters and episodes
    with 1 and 2 actors; `--resume` alone continues it (its run directory, step count and --delayed-update), and one
    that gives --delayed-update eq6 is refused by name (the checkpoint's optimizer moments are those of theta_j, not
    of a behavior copy)."""
    settings = {"delayed_update": "released", "total_timesteps": 640, "save_model": True}
    hts_ppo.main(tiny_args("hts_ppo.py", tmp_path / "a", num_actors=2, checkpoint_interval=3600, **settings))
    hts_ppo.main(tiny_args("hts_ppo.py", tmp_path / "b", num_actors=1, **settings))
    run_dir = only_run_dir(tmp_path / "a")
    (model, returns), (other, other_returns) = map(final_model_and_returns, (run_dir, only_run_dir(tmp_path / "b")))
    assert all(torch.equal(model[k], other[k]) for k in model) and returns == other_returns and len(returns) >= 10
    lags = [v for _, v in scalars(run_dir)["charts/policy_lag"]]
    assert len(lags) == updates("hts_ppo.py", 640) and lags[0] == 0 and set(lags[1:]) == {1.0}
    resume = str(run_dir / "checkpoint.pt")
    with pytest.raises(SystemExit) as exc:
        hts_ppo.main(hts_ppo.parse_args(["--resume", resume, "--total-timesteps", "1280", "--delayed-update", "eq6"]))
    assert exc.value.code == 2
    error = f"error: cannot resume from {resume} with --delayed-update eq6: its run has released"
    assert capsys.readouterr().err.startswith(error)
    hts_ppo.main(hts_ppo.parse_args(["--resume", resume, "--total-timesteps", "1280", "--num-actors", "1"]))
    assert only_run_dir(tmp_path / "a") == run_dir
    checkpoint = torch.load(resume, weights_only=False)
    assert checkpoint["global_step"] == 1280 and checkpoint["args"]["delayed_update"] == "released"
    assert [v for s, v in scalars(run_dir)["charts/policy_lag"] if s > 640][1:] == [1.0] * 9


@pytest.mark.parametrize("module", [hts_a2c, hts_ppo])
@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ({"num_executors": 3}, "--num-executors must divide --num-envs"),
        ({"env_id": "CartPol-v1"}, "did you mean CartPole-v1"),
        ({"network": "nature"}, "needs [C, H, W] image observations"),
        ({"network": "resnet"}, "--network must be one of"),  # from Python; tyro refuses it on the command line
        ({"atari_protocol": "openai"}, "--atari-protocol must be one of"),
        ({"total_timesteps": 3}, "--total-timesteps 3 is below one update"),
        ({"resume": "/nonexistent/checkpoint.pt"}, "no such file"),
        ({"capture_video": True}, "--eval-episodes"),
        ({"gamma": 1.5}, "--gamma must be in [0, 1]"),
        ({"torch_threads": -1}, "--torch-threads must be >= 0"),
        ({"log_frequency": 0}, "--log-frequency must be >= 1, got 0"),
        ({"log_interval": 0.0}, "--log-interval must be > 0, got 0.0"),
        ({"learning_rate": math.inf}, "--learning-rate must be a finite number, got inf"),
        ({"max_grad_norm": math.nan}, "--max-grad-norm must be a finite number, got nan"),
        ({"env_id": "Pendulum-v1"}, "continuous action space"),
        ({"eval_only": "/nonexistent/model.pt"}, "--eval-only /nonexistent/model.pt: no such file"),
    ],
)
def test_validate_names_the_bad_flag_in_one_line(module, flags, message):
    flags = dict(flags)  # parametrize shares the dict between the two modules
    error = module.validate(module.Args(env_id=flags.pop("env_id", "CartPole-v1"), num_envs=4, **flags))
    assert error is not None and message in error and "\n" not in error, error


def test_validate_refuses_an_unknown_delayed_update():
    """From Python (tyro refuses it on the command line): an unknown value would otherwise run as eq6."""
    error = hts_ppo.validate(hts_ppo.Args(env_id="CartPole-v1", num_envs=4, delayed_update="paper"))
    assert error == "--delayed-update must be one of eq6, released, got 'paper'"


@pytest.mark.parametrize("module", [hts_a2c, hts_ppo])
def test_a_budget_below_one_update_is_refused(module):
    """One update takes --num-envs x --sync-interval agent steps: a budget one step short would learn nothing."""
    one = 4 * module.Args().sync_interval
    error = module.validate(module.Args(env_id="CartPole-v1", num_envs=4, total_timesteps=one - 1))
    assert error == (f"--total-timesteps {one - 1} is below one update, {one} agent steps (--num-envs x "
                     f"--sync-interval): the run would learn nothing; give at least {one}"), error  # fmt: skip
    assert module.validate(module.Args(env_id="CartPole-v1", num_envs=4, total_timesteps=one)) is None


@pytest.mark.parametrize("module", [hts_a2c, hts_ppo])
def test_good_flags_pass_and_choices_are_checked_by_tyro(module, capsys):
    assert module.validate(module.Args(env_id="CartPole-v1", num_envs=4)) is None
    assert module.validate(module.Args(eval_only=__file__, capture_video=True)) is None  # --eval-only: 10 episodes
    for flags in (["--network", "resnet"], ["--atari-protocol", "openai"]):
        with pytest.raises(SystemExit) as exc:
            tyro.cli(module.Args, args=flags)
        assert exc.value.code == 2
    assert "resnet" in capsys.readouterr().err


@pytest.mark.parametrize("module", [hts_a2c, hts_ppo])
def test_track_without_wandb_is_refused_by_validate(module, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ModuleNotFoundError
    error = module.validate(module.Args(env_id="CartPole-v1", track=True))
    assert error.startswith('--track needs wandb (pip install -e ".[track]"): ModuleNotFoundError: '), error
    assert module.validate(module.Args(env_id="CartPole-v1")) is None


@pytest.mark.parametrize("module", [hts_a2c, hts_ppo])
def test_tracking_names_the_run_after_its_directory_and_resumes_it(module, monkeypatch, tmp_path):
    """A --resume run continues the W&B run of its run directory (the same id)."""
    wandb = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    run_dir = tmp_path / f"CartPole-v1__{module.__name__}__1__1700000000"
    (run_dir / "videos").mkdir(parents=True)
    (run_dir / "videos" / "rl-video-episode-0.mp4").write_bytes(b"")
    assert module.start_tracking(module.Args(env_id="CartPole-v1"), run_dir) is None and wandb.inits == []
    assert module.start_tracking(module.Args(env_id="CartPole-v1", track=True, wandb_entity="me"), run_dir) is wandb
    resumed = module.Args(env_id="CartPole-v1", track=True, resume=str(run_dir / "checkpoint.pt"))
    module.start_tracking(resumed, run_dir)
    first, second = wandb.inits
    assert first["name"] == second["name"] == run_dir.name and first["id"] == second["id"]
    assert first["resume"] is None and second["resume"] == "allow" and first["entity"] == "me"
    assert first["sync_tensorboard"] and first["config"]["env_id"] == "CartPole-v1" and first["config"]["track"]
    assert wandb.finished == []  # Run.training ends it with the exit status (test_reliability)


@pytest.mark.parametrize(
    ("script", "flags", "error"),
    [
        ("hts_a2c.py", ["--rms-alpha", "0.9"], "error: --rms-alpha is now --rmsprop-alpha (see --help)"),
        ("hts_ppo.py", ["--num-minibatches", "7"], "error: --num-minibatches must divide num_envs * sync_interval"),
    ],
)
def test_bad_flag_on_the_command_line_is_one_error_line_and_status_2(script, flags, error, tmp_path):
    proc = run_script(script, ["--env-id", "ALE/Breakout-v5", *flags], tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.startswith(error) and proc.stderr.count("\n") == 1, proc.stderr
    assert not tmp_path.exists() or not any(tmp_path.iterdir())


@pytest.mark.parametrize("module", [hts_a2c, hts_ppo])
@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("garbage", "not a checkpoint this script can read (UnpicklingError: "),
        ("truncated", "not a checkpoint this script can read ("),
        ("no_meta", 'not a checkpoint this script can read (it has no "meta" entry)'),
        ("other_script", "checkpoint (script hts_"),
        ("other_env", "(env_id Acrobot-v1, obs_shape [6], action_shape_or_n 3), this run is env_id CartPole-v1, "),
    ],
)
def test_resume_refuses_a_checkpoint_it_cannot_continue(module, case, message, tmp_path, capsys):
    args = module.Args(env_id="CartPole-v1", num_envs=4, log_dir=str(tmp_path / "logs"))
    path = write_unusable_checkpoint(tmp_path, case, module.checkpoint_meta(args, *module.env_spaces(args)))
    args.resume = str(path)
    with pytest.raises(SystemExit) as exc:
        module.main(args)
    assert exc.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: cannot resume from {path}: ") and message in lines[0], lines
    assert list(tmp_path.iterdir()) == [path]  # no run directory, no events file


@pytest.mark.parametrize("module", [hts_a2c, hts_ppo])
def test_resume_with_no_whole_update_left_is_refused(module, tmp_path, capsys):
    """A checkpoint after 100 updates of num_envs x sync_interval agent steps: a budget one step short of the next
    update holds no more of them (the run would end at once and call itself finished), one of exactly 101 holds one."""
    args = module.Args(env_id="CartPole-v1", num_envs=4, log_dir=str(tmp_path / "logs"))
    meta, per = module.checkpoint_meta(args, *module.env_spaces(args)), 4 * args.sync_interval
    path = tmp_path / "checkpoint.pt"
    torch.save(dict(meta=meta, global_step=100 * per), path)
    with pytest.raises(SystemExit) as exc:
        module.main(module.Args(**vars(args) | dict(total_timesteps=101 * per - 1, resume=str(path))))
    assert exc.value.code == 2 and capsys.readouterr().err == (
        f"error: cannot resume from {path}: its run did {100 * per} agent steps and --total-timesteps {101 * per - 1} "
        f"(whole updates of {per}) holds no more: the run would learn nothing; give at least {101 * per}\n"
    )
    assert list(tmp_path.iterdir()) == [path]
    args.total_timesteps = 101 * per
    assert module.load_checkpoint(str(path), meta, args, per)["global_step"] == 100 * per


def test_hts_ppo_refuses_an_hts_a2c_checkpoint_before_starting(tmp_path, capsys):
    args = hts_a2c.Args(env_id="CartPole-v1", num_envs=4)
    spaces = hts_a2c.env_spaces(args)
    learner = hts_a2c.Learner(args, spaces, torch.device("cpu"), None)
    learner.global_step, learner.update = 4096, 32
    path = tmp_path / "checkpoint.pt"
    run = SimpleNamespace(checkpoint_path=path, args=args, meta=hts_a2c.checkpoint_meta(args, *spaces))
    hts_a2c.write_checkpoint(learner, run)
    before = path.read_bytes()
    with pytest.raises(SystemExit) as exc:
        hts_ppo.main(hts_ppo.Args(**COMMON, resume=str(path), log_dir=str(tmp_path / "logs")))
    assert exc.value.code == 2 and capsys.readouterr().err.strip().splitlines() == [
        f"error: cannot resume from {path}: it is a hts_a2c.py checkpoint (script hts_a2c.py), this run is script "
        "hts_ppo.py"
    ]
    assert list(tmp_path.iterdir()) == [path] and path.read_bytes() == before


@pytest.mark.parametrize("module", [hts_a2c, hts_ppo])
def test_unusable_log_dir_is_one_error_line(module, tmp_path, capsys):
    (tmp_path / "a_file").write_text("")
    for log_dir in ("/proc/x", str(tmp_path / "a_file" / "runs")):
        with pytest.raises(SystemExit) as exc:
            module.main(module.Args(env_id="CartPole-v1", num_envs=4, log_dir=log_dir))
        assert exc.value.code == 2
        lines = capsys.readouterr().err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: cannot create the run directory "), lines


@pytest.mark.parametrize("module", [hts_a2c, hts_ppo])
def test_runs_started_in_the_same_second_get_their_own_directories(module, tmp_path, monkeypatch):
    monkeypatch.setattr(module.time, "time", lambda: 1700000000.5)
    args = module.Args(env_id="CartPole-v1", log_dir=str(tmp_path))
    dirs = [module.new_run_dir(args) for _ in range(3)]
    stem = module.__name__
    assert [d.name for d in dirs] == [f"CartPole-v1__{stem}__1__1700000000{s}" for s in ("", "-2", "-3")]


def test_atari_tiny_run(tmp_path, in_process):
    """The frame path: Breakout through common.atari's C++ vector env, the nature network, uint8 storages."""
    hts_a2c.main(hts_a2c.Args(num_envs=2, num_executors=2, num_actors=1, total_timesteps=200, log_frequency=1,
                              log_dir=str(tmp_path)))  # fmt: skip
    data = scalars(only_run_dir(tmp_path))
    assert max(s for s, _ in data["losses/total_loss"]) == 200
    assert all(math.isfinite(v) for _, v in data["losses/total_loss"])


def alive(pid):
    try:
        state = (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def at_collection(monkeypatch, module, j, action):
    """Call `action(workers, stop)` in the learner (the main thread) when it starts waiting for collection j; `stop` is
    the run's stop event."""
    wait = module.Workers.wait_collection

    def wait_collection(workers, k, stop):
        if k == j:
            action(workers, stop)
        return wait(workers, k, stop)

    monkeypatch.setattr(module.Workers, "wait_collection", wait_collection)


def long_run(script, log_dir, **overrides):
    return tiny_args(script, log_dir, total_timesteps=100_000_000, **overrides)


def test_ctrl_c_stops_everything_and_writes_a_final_checkpoint(tmp_path):
    """From the command line, as a user's Ctrl+C (SIGINT to the main process) arrives at any time."""
    settings = {**TINY["hts_ppo.py"], "total_timesteps": 100_000_000, "log_interval": 0.2, "checkpoint_interval": 3600}
    proc = start_run("hts_ppo.py", cli(settings), tmp_path)
    workers = children_of(proc.pid)
    assert len(workers) >= 4 + 4  # 4 executors and 4 actors (the queue's feeder thread is not a process)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, err
    assert "stopped by SIGINT" in err and "Traceback" not in err
    assert not [w for w in workers if alive(w)]
    run_dir = only_run_dir(tmp_path)
    assert re.search(r"^stopped \(exit status 130\): ", out, re.M), out  # start_run read the lines before the stop
    assert f"python hts_ppo.py --resume {run_dir / 'checkpoint.pt'}\n" in out, out
    assert torch.load(run_dir / "checkpoint.pt", weights_only=False)["global_step"] > 0
    assert scalars(run_dir)["charts/SPS"]


def test_sigterm_stops_everything_and_writes_a_final_checkpoint(tmp_path, monkeypatch, capsys, in_process):
    pids = []

    def terminate(workers, stop):
        pids.extend(p.pid for p in workers.processes.procs.values())
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.wait(60)  # set from the signal handler's helper thread: stop at this collection, not a later one

    at_collection(monkeypatch, hts_a2c, 3, terminate)
    with pytest.raises(SystemExit) as exc:
        hts_a2c.main(long_run("hts_a2c.py", tmp_path, checkpoint_interval=3600))
    assert exc.value.code == 143
    err = capsys.readouterr().err
    assert re.fullmatch(r"stopped by SIGTERM at global step 96; checkpoint written to \S+checkpoint.pt\n", err), err
    assert len(pids) == 8 and not [pid for pid in pids if alive(pid)]
    run_dir = only_run_dir(tmp_path)
    assert torch.load(run_dir / "checkpoint.pt", weights_only=False)["global_step"] == 96  # 3 updates of 4 x 8
    assert len(scalars(run_dir)["charts/SPS"]) == 3


def test_killed_worker_stops_the_run(tmp_path, monkeypatch, capsys, in_process):
    """A killed actor leaves the executors and other actors running: the learner still names it and stops."""
    pids = []

    def kill_an_actor(workers, stop):
        pids.extend(p.pid for p in workers.processes.procs.values())
        os.kill(workers.processes.procs["actor 3"].pid, signal.SIGKILL)

    at_collection(monkeypatch, hts_a2c, 3, kill_an_actor)
    with pytest.raises(SystemExit) as exc:
        hts_a2c.main(long_run("hts_a2c.py", tmp_path))
    assert exc.value.code == 1
    err = capsys.readouterr().err
    assert err == "error: actor 3 died (killed by signal 9); stopping the run\n", err
    assert len(pids) == 8 and not [pid for pid in pids if alive(pid)]


@pytest.mark.parametrize(
    ("script", "env_id", "error"),
    [
        (
            "hts_ppo.py",
            "CrashingCartPole-v0",
            r"error: executor \d died:\nTraceback(.|\n)*RuntimeError: injected env",
        ),
        ("hts_a2c.py", "NaNCartPole-v0", r"^error: non-finite loss nan in the learner at global step \d+; stopping"),
    ],
)
def test_a_failing_worker_or_loss_stops_the_run_with_one_message(script, env_id, error, tmp_path, capsys, in_process):
    """The env fails after 300 of its steps: a worker's exception arrives with its traceback, a NaN reward stops the
    learner before it changes a parameter; exit status 1 either way, and the checkpoint of the last good update (one
    after every update here) stays intact."""
    args = tiny_args(script, tmp_path, env_id=f"tests.faulty_env:{env_id}", total_timesteps=100_000,
                     checkpoint_interval=1e-6)  # fmt: skip
    with pytest.raises(SystemExit) as exc:
        MODULES[script].main(args)
    assert exc.value.code == 1
    err = capsys.readouterr().err
    assert re.search(error, err), err
    checkpoint = torch.load(only_run_dir(tmp_path) / "checkpoint.pt", weights_only=False)
    assert checkpoint["global_step"] > 0 and all(torch.isfinite(v).all() for v in checkpoint["model"].values())


def test_full_disk_stops_cleanly_and_keeps_the_last_checkpoint(tmp_path, monkeypatch, capsys, in_process):
    with small_tmpfs(tmp_path / "disk", "4m") as disk:
        at_collection(monkeypatch, hts_a2c, 5, lambda workers, stop: fill_disk(disk))
        with pytest.raises(SystemExit) as exc:
            hts_a2c.main(long_run("hts_a2c.py", disk, checkpoint_interval=1e-6))  # one checkpoint per update
        err = capsys.readouterr().err
        assert exc.value.code == 1 and "Traceback" not in err, err
        # whichever write hits the full disk first: the checkpoint or the TensorBoard events file
        assert "error: no space left on device while writing " in err and len(err.strip().splitlines()) <= 2, err
        checkpoint = only_run_dir(disk) / "checkpoint.pt"
        assert torch.load(checkpoint, weights_only=False)["global_step"] == 5 * 32  # the last good one, intact
        assert not list(checkpoint.parent.glob("*.tmp"))
