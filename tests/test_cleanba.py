"""cleanba_ppo_impala.py: GAE, V-trace and the IMPALA loss against slow loops from their definitions, the PPO learner's
values against Cleanba's, the policy-lag and determinism promises of Cleanba's architecture, two ranks with torchrun,
end-to-end runs, --track (one offline W&B run for two ranks), --eval-only, bad flags and shutdown."""

import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
import types
from dataclasses import replace
from pathlib import Path
from typing import NamedTuple

import gymnasium as gym
import numpy as np
import pytest
import torch
import tyro
from helpers import (
    CONSOLE_LINE,
    CORE_TAGS,
    ROOT,
    FixedLogitsPolicy,
    RecordingEnv,
    alive,
    assert_documented_tags,
    assert_eval_only_refusals,
    assert_finite_tags,
    assert_one_error_line,
    assert_tracked_once,
    children_of,
    end_launch,
    fill_disk,
    launch_ranks,
    offline_wandb_env,
    only_run_dir,
    rank_pid,
    read_until,
    run_eval_only,
    run_script,
    scalars,
    small_tmpfs,
    start_run,
    state_of,
    two_node_launch,
    wait_for,
)
from torch import nn

import cleanba_ppo_impala
from cleanba_ppo_impala import (
    Args,
    Learner,
    NonFiniteLoss,
    Rollout,
    checkpoint_meta,
    env_spaces,
    evaluate,
    gae,
    impala_loss,
    load_checkpoint,
    main,
    new_run_dir,
    ppo_loss,
    ppo_update,
    settled_args,
    start_tracking,
    validate,
    vtrace,
    write_run_args,
)
from common.models import make_model

SCRIPT = "cleanba_ppo_impala.py"
# --log-interval 0: a console line after every update, so start_run returns as soon as the first update is done;
# one learner thread: more only adds OpenMP hand-offs for the MLP, beside the actor threads on a 2-core machine
TINY_CARTPOLE = ["--env-id", "CartPole-v1", "--num-envs", "4", "--num-steps", "32", "--log-interval", "0"]
TINY_CARTPOLE += ["--torch-threads", "1", "--num-actor-threads", "1"]


# ------------------------------------------------------------------ references written from the definitions


def gae_reference(rewards, values, dones, next_value, gamma, lam):
    """A_t = sum_l (prod_{k=t}^{t+l-1} gamma lam (1 - d_k)) delta_{t+l} (Schulman et al. 2016, Eq. 16)."""
    T, B = rewards.shape
    v = np.concatenate([values, next_value[None]], axis=0)
    delta = rewards + gamma * (1 - dones) * v[1:] - v[:-1]
    adv = np.zeros((T, B))
    for b in range(B):
        for t in range(T):
            weight = 1.0
            for k in range(t, T):
                adv[t, b] += weight * delta[k, b]
                weight *= gamma * lam * (1 - dones[k, b])
    return adv


def vtrace_reference(mu_logp, pi_logp, rewards, values, dones, next_value, gamma, rho_bar, c_bar, pg_rho_bar):
    """Espeholt et al. 2018, Eq. 1: v_s = V(x_s) + sum_{t>=s} (prod_{i=s}^{t-1} gamma_i c_i) rho_t delta_t, and the
    policy-gradient advantage rho^pg_s (r_s + gamma_s v_{s+1} - V(x_s)), with gamma_i = gamma (1 - done_i)."""
    T, B = rewards.shape
    ratio = np.exp(pi_logp - mu_logp)
    v = np.concatenate([values, next_value[None]], axis=0)
    disc = gamma * (1 - dones)
    vs = np.zeros((T + 1, B))
    vs[T] = next_value
    pg = np.zeros((T, B))
    for b in range(B):
        for s in range(T):
            total, trace = 0.0, 1.0
            for t in range(s, T):
                delta = min(rho_bar, ratio[t, b]) * (rewards[t, b] + disc[t, b] * v[t + 1, b] - v[t, b])
                total += trace * delta
                trace *= disc[t, b] * min(c_bar, ratio[t, b])
            vs[s, b] = v[s, b] + total
        for s in range(T):
            pg[s, b] = min(pg_rho_bar, ratio[s, b]) * (rewards[s, b] + disc[s, b] * vs[s + 1, b] - v[s, b])
    return vs[:T], pg


def random_rollout(T=7, B=3, seed=0):
    rng = np.random.default_rng(seed)
    dones = np.zeros((T, B))
    dones[2, 0] = dones[5, 1] = dones[T - 1, 2] = 1.0  # episode ends mid-rollout and at the last step
    return dict(
        rewards=rng.normal(size=(T, B)),
        values=rng.normal(size=(T, B)),
        dones=dones,
        next_value=rng.normal(size=B),
        mu=rng.normal(size=(T, B)) - 1.5,
        pi=rng.normal(size=(T, B)) - 1.5,
    )


def t(x):
    return torch.tensor(x, dtype=torch.float64)


@pytest.mark.parametrize("lam", [0.0, 0.95, 1.0])
def test_gae_matches_definition(lam):
    r = random_rollout()
    got = gae(t(r["rewards"]), t(r["values"]), t(r["dones"]), t(r["next_value"]), 0.99, lam)
    want = gae_reference(r["rewards"], r["values"], r["dones"], r["next_value"], 0.99, lam)
    np.testing.assert_allclose(got.numpy(), want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize(("rho_bar", "c_bar", "pg_rho_bar"), [(1.0, 1.0, 1.0), (0.7, 1.3, 0.9), (2.0, 0.5, 5.0)])
def test_vtrace_matches_definition(rho_bar, c_bar, pg_rho_bar):
    r = random_rollout(seed=1)
    assert (np.exp(r["pi"] - r["mu"]) > 1.3).any() and (np.exp(r["pi"] - r["mu"]) < 0.5).any()  # clipping matters
    vs, pg = vtrace(
        t(r["mu"]),
        t(r["pi"]),
        t(r["rewards"]),
        t(r["values"]),
        t(r["dones"]),
        t(r["next_value"]),
        0.99,
        rho_bar,
        c_bar,
        pg_rho_bar,
    )
    want_vs, want_pg = vtrace_reference(
        r["mu"], r["pi"], r["rewards"], r["values"], r["dones"], r["next_value"], 0.99, rho_bar, c_bar, pg_rho_bar
    )
    np.testing.assert_allclose(vs.numpy(), want_vs, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(pg.numpy(), want_pg, rtol=1e-10, atol=1e-10)


def test_vtrace_on_policy_is_the_n_step_return():
    """Known values: with pi = mu and no truncation, v_s is the discounted return bootstrapped at the end."""
    rewards = t([[1.0], [0.0], [2.0]])
    values, dones, next_value = t([[0.5], [0.3], [-1.0]]), t([[0.0], [0.0], [0.0]]), t([4.0])
    logp = torch.zeros(3, 1, dtype=torch.float64)
    vs, _ = vtrace(logp, logp, rewards, values, dones, next_value, 0.9, 1.0, 1.0, 1.0)
    assert vs[0, 0].item() == pytest.approx(1 + 0.9 * 0 + 0.81 * 2 + 0.729 * 4)
    assert vs[2, 0].item() == pytest.approx(2 + 0.9 * 4)


def test_ppo_loss_clips_the_ratio():
    """One sample, advantage +1, ratio e^0.5 > 1 + clip: the clipped term (1.1) is the objective; no gradient."""
    new_logp = torch.tensor([0.5], requires_grad=True)
    out = ppo_loss(
        new_logp,
        torch.zeros(1),
        torch.ones(1),
        torch.zeros(1),
        torch.zeros(1),
        torch.zeros(1),
        clip_coef=0.1,
        ent_coef=0.0,
        vf_coef=0.5,
        norm_adv=False,
    )
    assert out["policy_loss"].item() == pytest.approx(-1.1)
    out["total_loss"].backward()
    assert new_logp.grad.item() == 0.0
    out = ppo_loss(
        torch.tensor([-0.05]),
        torch.zeros(1),
        torch.ones(1),
        torch.tensor([1.0]),
        torch.tensor([3.0]),
        torch.tensor([0.7]),
        clip_coef=0.1,
        ent_coef=0.01,
        vf_coef=0.5,
        norm_adv=False,
    )
    assert out["policy_loss"].item() == pytest.approx(-math.exp(-0.05), rel=1e-6)
    assert out["total_loss"].item() == pytest.approx(-math.exp(-0.05) - 0.01 * 0.7 + 0.5 * 0.5 * 4.0, rel=1e-5)


def impala_loss_reference(logp, entropy, values, vs, pg_adv, ent_coef, vf_coef):
    """Cleanba's cleanba_impala.py, term by term: per env column b, rlax's policy-gradient and entropy losses are
    means over the T steps, multiplied by T and summed over the columns; baseline_loss = 0.5 sum (v_s - V(x_s))^2."""
    T, B = logp.shape
    pg_loss = baseline_loss = ent_loss = 0.0
    for b in range(B):
        pg_loss += T * sum(-logp[s, b] * pg_adv[s, b] for s in range(T)) / T
        ent_loss += T * sum(-entropy[s, b] for s in range(T)) / T
        for s in range(T):
            baseline_loss += 0.5 * (vs[s, b] - values[s, b]) ** 2
    return pg_loss, baseline_loss, pg_loss + vf_coef * baseline_loss + ent_coef * ent_loss


def test_impala_loss_is_summed_over_the_unroll_batch_as_cleanba():
    rng = np.random.default_rng(3)
    T, B = 5, 3
    logp, pg_adv = rng.normal(size=(T, B)) - 1.0, rng.normal(size=(T, B))
    entropy, values, vs = rng.uniform(0.1, 1.0, size=(T, B)), rng.normal(size=(T, B)), rng.normal(size=(T, B))
    got = impala_loss(t(logp), t(entropy), t(values), t(vs), t(pg_adv), ent_coef=0.01, vf_coef=0.5)
    want_pg, want_baseline, want_total = impala_loss_reference(logp, entropy, values, vs, pg_adv, 0.01, 0.5)
    assert got["policy_loss"].item() == pytest.approx(want_pg, rel=1e-12)
    assert got["value_loss"].item() == pytest.approx(want_baseline, rel=1e-12)
    assert got["total_loss"].item() == pytest.approx(want_total, rel=1e-12)
    mean_total = (-logp * pg_adv).mean() - 0.01 * entropy.mean() + 0.5 * 0.5 * ((vs - values) ** 2).mean()
    assert got["total_loss"].item() == pytest.approx(T * B * mean_total, rel=1e-12)  # T x B times the mean
    assert got["entropy"].item() == pytest.approx(entropy.mean(), rel=1e-12)  # logged per step


def test_impala_loss_by_hand():
    """T = 2, B = 1: policy -(-1 x 2 + -0.5 x -1) = 1.5, baseline 0.5 (1 + 4) = 2.5, entropy 0.3 + 0.5 = 0.8."""
    col = lambda *x: torch.tensor(x, dtype=torch.float64)[:, None]  # noqa: E731
    out = impala_loss(
        col(-1.0, -0.5), col(0.3, 0.5), col(0.0, 1.0), col(1.0, -1.0), col(2.0, -1.0), vf_coef=0.5, ent_coef=0.1
    )
    assert out["policy_loss"].item() == pytest.approx(1.5)
    assert out["value_loss"].item() == pytest.approx(2.5)
    assert out["total_loss"].item() == pytest.approx(1.5 + 0.5 * 2.5 - 0.1 * 0.8)


class StubActorCritic(nn.Module):
    """Uniform policy over A actions and V(x) = w x[0] with w = 1: the learner's values are known in closed form."""

    def __init__(self, num_actions: int):
        super().__init__()
        self.logits = nn.Parameter(torch.zeros(num_actions))
        self.w = nn.Parameter(torch.ones(()))

    def forward(self, x):
        return self.logits.expand(x.shape[0], -1), self.w * x[:, 0]


def test_ppo_gae_uses_the_actors_values_and_a_learner_bootstrap():
    """Cleanba's cleanba_ppo.py computes GAE from the values stored by the actor, recomputing only the bootstrap value
    V(x_T) with the learner's parameters. One epoch, one minibatch, no advantage normalisation and ratio 1 make the
    minibatch's losses -mean(A) and 0.5 mean((V_learner - (A + V_actor))^2), checked against the slow GAE reference."""
    rng = np.random.default_rng(4)
    T, N, A, gamma, lam = 6, 2, 3, 0.9, 0.8
    obs = rng.normal(size=(T, N, 2))
    next_obs = rng.normal(size=(N, 2))
    actor_values = rng.normal(size=(T, N))  # differ from the learner's V(x) = x[0]
    rewards, dones = rng.normal(size=(T, N)), np.zeros((T, N))
    dones[2, 1] = 1.0
    f32 = lambda x: torch.tensor(x, dtype=torch.float32)  # noqa: E731
    data = Rollout(
        obs=f32(obs),
        actions=torch.zeros((T, N), dtype=torch.long),
        logprobs=torch.full((T, N), -math.log(A)),
        values=f32(actor_values),
        rewards=f32(rewards),
        dones=f32(dones),
        next_obs=f32(next_obs),
    )
    args = settled_args(
        Args(update_epochs=1, num_minibatches=1, norm_adv=False, ent_coef=0.0, gamma=gamma, gae_lambda=lam)
    )
    (losses,) = ppo_update(StubActorCritic(A), data, args, torch.Generator().manual_seed(0))  # the one minibatch
    adv = gae_reference(rewards, actor_values, dones, next_obs[:, 0], gamma, lam)
    assert losses["policy_loss"].item() == pytest.approx(-adv.mean(), rel=1e-5, abs=1e-6)
    expected_value_loss = 0.5 * ((obs[:, :, 0] - (adv + actor_values)) ** 2).mean()
    assert losses["value_loss"].item() == pytest.approx(expected_value_loss, rel=1e-5)


# ------------------------------------------------------------------ running the script

REQUIRED_TAGS = [*CORE_TAGS, "timing/rollout_queue_get", "timing/param_queue_get"]
MODES = {"ppo": [], "sync": ["--sync"], "impala": ["--algo", "impala"]}
UPDATES = 8  # of 4 envs x 32 steps = 128 agent steps


class Run(NamedTuple):
    params: dict[str, torch.Tensor]
    logged: dict[str, list[tuple[int, float]]]
    stdout: str
    run_dir: Path


def train(log_dir, flags) -> Run:
    """A CartPole run of UPDATES updates with two actor threads, evaluated, saved and checkpointed at its end."""
    flags = [*TINY_CARTPOLE, "--num-actor-threads", "2", "--total-timesteps", str(128 * UPDATES), *flags]
    flags += ["--save-model", "--eval-episodes", "2", "--checkpoint-interval", "3600"]
    proc = run_script(SCRIPT, flags, log_dir, timeout=240)
    assert proc.returncode == 0, proc.stderr
    run_dir = only_run_dir(log_dir)
    return Run(torch.load(run_dir / "model.pt"), scalars(run_dir), proc.stdout, run_dir)


def values(run: Run, tag: str) -> list[float]:
    return [v for _, v in run.logged[tag]]


class SeedOneRuns(dict):
    """mode -> its Run at seed 1, made on first use and shared by the end-to-end, policy-lag, determinism and
    different-seeds tests."""

    def __init__(self, tmp_path_factory):
        super().__init__()
        self.tmp_path_factory = tmp_path_factory

    def __missing__(self, mode: str) -> Run:
        self[mode] = train(self.tmp_path_factory.mktemp(mode), MODES[mode])
        return self[mode]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return SeedOneRuns(tmp_path_factory)


def expected_lags(sync: bool, updates: int = UPDATES) -> list[int]:
    """Table 1: update 1 trains on data of the initial parameters; update k >= 2 on the rollout of the parameters
    after update k - 2 (the actor skips its 2nd param_Q.get), one update behind the parameters being updated.
    Synchronous: the rollout of the parameters being updated."""
    return [0] * updates if sync else [0] + [1] * (updates - 1)


@pytest.mark.parametrize("mode", MODES)
def test_end_to_end_tags_policy_lag_and_console_line(mode, runs):
    run = runs[mode]
    assert_finite_tags(run.logged, [*REQUIRED_TAGS, "eval/episodic_return"])
    assert_documented_tags("cleanba_ppo_impala.py", run.logged)
    assert values(run, "charts/policy_lag") == expected_lags(mode == "sync")
    assert [s for s, _ in run.logged["charts/SPS"]] == [128 * i for i in range(1, UPDATES + 1)]
    assert len(run.logged["eval/episodic_return"]) == 2
    lines = [CONSOLE_LINE.match(line) for line in run.stdout.splitlines()]
    assert [int(m.group(1)) for m in lines if m] == [128 * i for i in range(1, UPDATES + 1)]  # --log-interval 0
    assert f"update={UPDATES}/{UPDATES} policy_lag={expected_lags(mode == 'sync')[-1]} " in run.stdout
    first, *_, summary, wrote, tensorboard, evaluate_line = run.stdout.splitlines()
    assert first == (f"run directory: {run.run_dir}  ({UPDATES} updates of 128 agent steps, an update is 1 rank(s) x 4 "
                     f"envs x 32 steps; {'sync' if mode == 'sync' else 'cleanba'} {mode.replace('sync', 'ppo')}, mlp "
                     "network, cpu)")  # fmt: skip
    assert summary.startswith(f"finished: {128 * UPDATES:,} of {128 * UPDATES:,} agent steps in "), summary
    assert wrote.startswith(f"wrote to {run.run_dir}: args.json, checkpoint.pt, events.out.tfevents.") and (
        wrote.endswith(", model.pt")
    ), wrote
    assert tensorboard == f"next: tensorboard --logdir {run.run_dir}"  # finished: no --resume line
    assert evaluate_line == f"      python {SCRIPT} --eval-only {run.run_dir / 'model.pt'}"


@pytest.mark.parametrize("mode", MODES)
def test_deterministic_even_when_the_learner_is_slowed(mode, tmp_path, runs):
    """The paper's Figure 2 experiment as a test: slowing the learner must not change what it learns."""
    fast, slow = runs[mode], train(tmp_path, [*MODES[mode], "--learner-delay", "0.05"])
    returns = values(fast, "charts/episodic_return")
    assert returns and returns == values(slow, "charts/episodic_return")
    assert values(slow, "charts/policy_lag") == expected_lags(mode == "sync")
    for name, value in fast.params.items():
        assert torch.equal(value, slow.params[name]), name


def test_different_seeds_differ(tmp_path, runs):
    a, b = runs["ppo"].params, train(tmp_path, ["--seed", "2"]).params
    assert not all(torch.equal(a[k], b[k]) for k in a)


def test_evaluation_samples_actions_by_default_and_takes_the_argmax_with_eval_greedy(monkeypatch, tmp_path):
    """Sampled actions are the policy as it plays in training; the argmax (action 2) has probability about 0.34."""
    logits = torch.tensor([0.0, 0.4, 0.8, 0.2])
    for flags, greedy in [([], False), (["--eval-greedy"], True)]:
        env = RecordingEnv(length=25)
        monkeypatch.setattr(cleanba_ppo_impala, "make_env", lambda *a, env=env, **k: env)
        args = tyro.cli(Args, args=["--env-id", "CartPole-v1", "--eval-episodes", "4", *flags])
        assert list(evaluate(FixedLogitsPolicy(logits), args, tmp_path, torch.device("cpu"))) == [25.0] * 4
        assert len(env.actions) == 100
        if greedy:
            assert set(env.actions) == {2}
        else:
            assert set(env.actions) == {0, 1, 2, 3} and 15 <= env.actions.count(2) <= 55


def eval_only_in_process(model: Path, *flags) -> dict:
    """`main` with --eval-only `model` in this process; the eval JSON it wrote beside the model."""
    main(tyro.cli(Args, args=["--eval-only", str(model), *flags]))
    return json.loads(max(model.parent.glob("eval-*.json"), key=lambda p: p.stat().st_mtime_ns).read_text())


def test_eval_only_replays_the_saved_agent_with_the_end_of_training_evaluation(runs, tmp_path):
    """model.pt (in a subprocess, with its args.json) and checkpoint.pt (in process) play the run's own evaluation
    episodes again, then one more: same policy, same evaluation seed, actions sampled as at the end of training. An
    IMPALA run's model.pt is evaluated as one (its algo and network come from its run)."""
    run = runs["ppo"]
    model = run.run_dir / "model.pt"
    proc, report = run_eval_only(SCRIPT, model, tmp_path / "logs", "--eval-episodes", "3")
    assert proc.returncode == 0 and report is not None, proc.stderr
    assert report["episodes"] == 3 and report["greedy"] is False and report["model"] == str(model)
    assert report["settings"] == {"env_id": "CartPole-v1", "atari_protocol": "machado", "algo": "ppo", "network": "mlp"}
    returns = report["returns"]
    assert len(returns) == 3 and all(math.isfinite(r) and r == int(r) and 8 <= r <= 500 for r in returns), returns
    assert returns[:2] == values(run, "eval/episodic_return") and report["mean"] == pytest.approx(np.mean(returns))
    assert "from its run: env_id=CartPole-v1 atari_protocol=machado algo=ppo network=mlp" in proc.stdout
    assert eval_only_in_process(run.run_dir / "checkpoint.pt", "--eval-episodes", "3")["returns"] == returns
    impala = runs["impala"]
    report = eval_only_in_process(impala.run_dir / "model.pt", "--eval-episodes", "2")
    assert report["settings"]["algo"] == "impala" and report["returns"] == values(impala, "eval/episodic_return")


def test_eval_only_refuses_what_it_cannot_evaluate(runs, tmp_path, capsys):
    model = runs["ppo"].run_dir / "model.pt"
    assert_eval_only_refusals(SCRIPT, model, tmp_path)  # another script's, --env-id Acrobot-v1, a garbage file
    lonely = tmp_path / "lonely"
    lonely.mkdir()
    (lonely / "model.pt").write_bytes(model.read_bytes())
    refused = lambda *flags: refusal(capsys, main, tyro.cli(Args, args=["--eval-only", *flags]))  # noqa: E731
    assert "cannot read its run's args.json" in refused(str(lonely / "model.pt"))
    error = refused(str(model), "--algo", "impala")
    assert error == f"error: --algo impala contradicts {model}, saved by a run with ppo", error
    assert "--network nature contradicts" in refused(str(model), "--network", "nature")
    assert refused(str(tmp_path / "missing.pt")) == f"error: --eval-only {tmp_path / 'missing.pt'}: no such file"
    assert "without torchrun" in validate(checked(eval_only=str(model)), 2)


LEAVE_WITH_A_BUSY_THREAD = """
import threading, time, torch
from {module} import leave
def work():
    conv, x = torch.nn.Conv2d(4, 32, 8, 4), torch.randn(256, 4, 84, 84)
    while True:
        conv(x).sum().backward()
threads = [threading.Thread(target=work, name="busy", daemon=True) for _ in range(2)]
for t in threads:
    t.start()
time.sleep(1.0)
leave(3, threads)
"""


@pytest.mark.parametrize("module", ["cleanba_ppo_impala", "impala_monobeast"])
def test_leave_survives_a_thread_still_inside_torch(module):
    """A daemon thread still running torch ops when the interpreter tears down aborts the process in C++ ("terminate
    called without an active exception"). `leave` must exit with the code it is given, name the thread, and not
    abort."""
    code = LEAVE_WITH_A_BUSY_THREAD.format(module=module)
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3, proc.stderr
    assert "busy" in proc.stderr and "still running at exit" in proc.stderr, proc.stderr
    assert "terminate called" not in proc.stderr


def test_breakout_end_to_end(tmp_path):
    flags = ["--env-id", "ALE/Breakout-v5", "--num-envs", "4", "--num-steps", "64", "--num-minibatches", "2"]
    flags += ["--update-epochs", "1", "--total-timesteps", "1024", "--network", "nature", "--num-actor-threads", "1"]
    proc = run_script(SCRIPT, flags, tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert_finite_tags(scalars(only_run_dir(tmp_path)), REQUIRED_TAGS)


def test_impala_on_breakout_deepmind_protocol(tmp_path):
    flags = ["--algo", "impala", "--env-id", "ALE/Breakout-v5", "--atari-protocol", "deepmind", "--num-envs", "4"]
    flags += ["--num-actor-threads", "1"]
    proc = run_script(SCRIPT, [*flags, "--total-timesteps", "160"], tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr
    logged = scalars(only_run_dir(tmp_path))
    assert len(logged["losses/total_loss"]) == 2 and all(math.isfinite(v) for _, v in logged["losses/total_loss"])


# ------------------------------------------------------------------ defaults


@pytest.mark.parametrize("algo", ["ppo", "impala"])
def test_defaults_are_cleanbas(algo):
    """cleanba_ppo.py and cleanba_impala.py (vwxyzjn/cleanba) Args: local_num_envs 64 per actor thread,
    num_actor_threads 2, total_timesteps 50M, IMPALA's ResNet (channels 16/32/32, hiddens 256) for both algorithms;
    num_steps, learning_rate and max_grad_norm per algorithm."""
    args = settled_args(Args(algo=algo))
    assert (args.num_envs, args.num_actor_threads, args.total_timesteps) == (64 * 2, 2, 50_000_000)
    image, flat = gym.spaces.Box(0, 255, (4, 84, 84), np.uint8), gym.spaces.Box(-1, 1, (4,))
    networks = [checkpoint_meta(args, space, gym.spaces.Discrete(4), 1)["network"] for space in (image, flat)]
    assert networks == ["impala", "mlp"], networks
    expected = dict(ppo=(128, 2.5e-4, 0.5), impala=(20, 6e-4, 40.0))[algo]
    assert (args.num_steps, args.learning_rate, args.max_grad_norm) == expected
    model = make_model(gym.spaces.Box(0, 255, (4, 84, 84), np.uint8), gym.spaces.Discrete(4), "impala")
    convs = [m.out_channels for m in model.modules() if isinstance(m, nn.Conv2d)]
    linears = [m.out_features for m in model.modules() if isinstance(m, nn.Linear)]
    assert sorted(set(convs)) == [16, 32] and convs[0] == 16 and convs[-1] == 32 and 256 in linears


def test_help_shows_one_default_per_flag(capsys):
    with pytest.raises(SystemExit):
        tyro.cli(Args, args=["--help"])
    text = " ".join(capsys.readouterr().out.split())
    for default in ["(default: 128)", "(default: 50000000)", "(default: 128 ppo, 20 impala; Cleanba's)"]:
        assert default in text.replace("│ ", ""), default


# ------------------------------------------------------------------ bad input


def checked(**changes) -> Args:
    return settled_args(Args(**{"env_id": "CartPole-v1", **changes}))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(env_id="ALE/Breakot-v5"), "did you mean ALE/Breakout-v5"),
        (dict(num_envs=6, num_actor_threads=4), "multiple of --num-actor-threads"),
        (dict(learning_rate=-1.0), "--learning-rate must be > 0"),
        (
            dict(total_timesteps=10),
            "--total-timesteps 10 is below one update, 16384 agent steps (--num-envs x "
            "--num-steps): the run would learn nothing; give at least 16384",
        ),
        (dict(capture_video=True), "--capture-video records the evaluation episodes; add --eval-episodes N"),
        (dict(resume="a/checkpoint.pt", eval_only="b/model.pt"), "--eval-only trains nothing, so --resume would be"),
        (dict(resume="/nonexistent/checkpoint.pt"), "no such checkpoint"),
        (dict(algo="impala", num_envs=2), "whole unrolls"),
        (dict(num_minibatches=0), "--num-minibatches must be >= 1, got 0"),
        (dict(env_id="Pendulum-v1"), "Box action space"),
        (dict(learning_rate=math.inf), "--learning-rate must be a finite number"),
        (dict(gae_lambda=math.nan), "--gae-lambda must be a finite number"),
        (dict(clip_coef=-math.inf), "--clip-coef must be a finite number"),
    ],
)
def test_validate_names_the_bad_flag(change, message):
    error = validate(checked(**change), 1)
    assert error is not None and message in error and "\n" not in error, error
    assert validate(checked(), 1) is None


def test_a_budget_below_one_update_of_every_rank_is_refused():
    """Under torchrun an update is every rank's envs x steps (Learner.steps_per_update)."""
    args = checked(num_envs=4, num_steps=32, total_timesteps=255)
    assert validate(args, 1) is None and validate(replace(args, total_timesteps=256), 2) is None
    assert validate(args, 2) == (
        "--total-timesteps 255 is below one update, 256 agent steps (--num-envs x --num-steps x 2 ranks): the run "
        "would learn nothing; give at least 256"
    )


@pytest.mark.parametrize(("flag", "value"), [("--atari-protocol", "atari57"), ("--network", "resnet")])
def test_choice_flags_are_refused_by_tyro(flag, value, capsys):
    with pytest.raises(SystemExit) as exit_:
        tyro.cli(Args, args=[flag, value])
    assert exit_.value.code == 2 and value in capsys.readouterr().err


def test_track_without_wandb_is_refused_by_validate(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    error = validate(checked(track=True), 1)
    assert (
        error == '--track needs wandb (pip install -e ".[track]"): ModuleNotFoundError: import of wandb halted; '
        "None in sys.modules"
    ), error
    assert validate(checked(), 1) is None


def test_tracking_names_the_run_after_its_directory_and_resume_continues_it(monkeypatch, tmp_path):
    """A --resume run continues the W&B run of its run directory: the same id (wandb's rules: at most 64 letters,
    digits, - or _), resume="allow"."""
    inits = []
    monkeypatch.setitem(sys.modules, "wandb", types.SimpleNamespace(init=lambda **kwargs: inits.append(kwargs)))
    run_dir = tmp_path / "CartPole-v1__cleanba_ppo_impala__1__1700000000"
    assert start_tracking(checked(), run_dir) is None and inits == []
    assert start_tracking(checked(track=True, wandb_entity="me"), run_dir) is sys.modules["wandb"]
    start_tracking(checked(track=True, resume=str(run_dir / "checkpoint.pt")), run_dir)
    first, second = inits
    assert first["name"] == second["name"] == run_dir.name and first["id"] == second["id"]
    assert len(first["id"]) <= 64 and first["id"].replace("-", "").replace("_", "").isalnum()
    assert first["resume"] is None and second["resume"] == "allow" and first["entity"] == "me"
    assert first["project"] == "actorlearners" and first["sync_tensorboard"] and first["config"]["num_steps"] == 128


def test_bad_values_exit_2_with_one_line(tmp_path):
    proc = run_script(SCRIPT, ["--env-id", "Pendulum-v1", "--learning-rate", "inf"], tmp_path, timeout=60)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert proc.stderr.startswith("error: --learning-rate must be a finite number, got inf"), proc.stderr
    assert not any(Path(tmp_path).iterdir())  # nothing was created


def refusal(capsys, function, *args) -> str:
    """The one error line of `function(*args)`, which must exit 2 before anything starts."""
    with pytest.raises(SystemExit) as exit_:
        function(*args)
    lines = capsys.readouterr().err.strip().splitlines()
    assert exit_.value.code == 2 and len(lines) == 1, lines
    assert lines[0].startswith("error: ")
    return lines[0]


def test_runs_started_in_the_same_second_get_their_own_run_directories(tmp_path, monkeypatch):
    monkeypatch.setattr(time, "time", lambda: 1_700_000_000.0)
    args = Args(env_id="CartPole-v1", exp_name="x", log_dir=str(tmp_path))
    assert [new_run_dir(args).name for _ in range(2)] == [
        "CartPole-v1__x__1__1700000000",
        "CartPole-v1__x__1__1700000000-2",
    ]


def test_log_dir_that_cannot_be_created_is_one_error_line(tmp_path, capsys):
    (tmp_path / "file").write_text("a file, not a directory")
    for log_dir in ("/proc/x", tmp_path / "file" / "runs"):
        args = checked(num_envs=4, num_steps=32, total_timesteps=1024, log_dir=str(log_dir))
        assert refusal(capsys, main, args).startswith("error: cannot create the run directory")


def meta_of(**changes):
    args = checked(**changes)
    return checkpoint_meta(args, *env_spaces(args), 1)


def test_resume_refuses_what_it_cannot_use(tmp_path, capsys):
    ours = meta_of()
    good = tmp_path / "good.pt"
    torch.save(dict(model={}, meta=ours), good)
    assert load_checkpoint(str(good), ours, checked(), 1)["meta"] == ours
    garbage, truncated, old = tmp_path / "garbage.pt", tmp_path / "truncated.pt", tmp_path / "old.pt"
    garbage.write_bytes(b"not a checkpoint at all")
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    torch.save(dict(model={}, update=3), old)
    for path in (garbage, truncated, old):
        error = refusal(capsys, load_checkpoint, str(path), ours, checked(), 1)
        assert error.startswith(f"error: cannot resume from {path}: not a checkpoint"), error
    gala = tmp_path / "gala.pt"
    torch.save(dict(learners=[], meta={**ours, "script": "gala_a2c.py", "algo": "gossip"}), gala)
    error = refusal(capsys, load_checkpoint, str(gala), ours, checked(), 1)
    assert "it is a gala_a2c.py checkpoint (script gala_a2c.py, algo gossip), this run is script" in error, error
    impala = tmp_path / "impala.pt"
    torch.save(dict(model={}, meta=meta_of(algo="impala")), impala)
    assert "(algo impala), this run is algo ppo" in refusal(capsys, load_checkpoint, str(impala), ours, checked(), 1)


def test_refused_resume_exits_2_and_leaves_nothing_in_the_run_directory(tmp_path, capsys):
    run_dir = tmp_path / "CartPole-v1__x__1__1700000000"
    run_dir.mkdir()
    truncated = run_dir / "checkpoint.pt"
    torch.save(dict(model={}, meta=meta_of()), truncated)
    truncated.write_bytes(truncated.read_bytes()[:100])
    args = checked(num_envs=4, num_steps=32, log_dir=str(tmp_path), resume=str(truncated))
    error = refusal(capsys, main, args)
    assert error.startswith(f"error: cannot resume from {truncated}: not a checkpoint this script can read")
    assert list(run_dir.iterdir()) == [truncated]


def test_resume_of_a_run_that_did_its_budget_is_refused(tmp_path, capsys):
    """A checkpoint at update 8 of 128 agent steps: --total-timesteps 1024 (or 1100, not a whole update more) would
    learn nothing, so the run is refused before anything is written; under torchrun an update counts every rank."""
    run_dir = tmp_path / "CartPole-v1__x__1__1700000000"
    run_dir.mkdir()
    path = run_dir / "checkpoint.pt"
    torch.save(dict(model={}, meta=meta_of(), update=8, global_step=1024), path)
    for total in (1024, 1100):
        args = checked(num_envs=4, num_steps=32, total_timesteps=total, log_dir=str(tmp_path), resume=str(path))
        assert refusal(capsys, main, args) == (
            f"error: cannot resume from {path}: its run did 1024 agent steps and --total-timesteps {total} (whole "
            "updates of 128) holds no more: the run would learn nothing; give at least 1152"
        )
        assert list(run_dir.iterdir()) == [path]
    assert load_checkpoint(str(path), meta_of(), replace(args, total_timesteps=1152), 128)["update"] == 8  # one left
    two_ranks = "(whole updates of 256) holds no more: the run would learn nothing; give at least 1280"
    assert two_ranks in refusal(capsys, load_checkpoint, str(path), meta_of(), replace(args, total_timesteps=1279), 256)


# ------------------------------------------------------------------ failures and shutdown


def test_crashing_actor_stops_the_run_with_its_traceback(tmp_path):
    flags = ["--env-id", "tests.faulty_env:CrashingCartPole-v0", "--num-envs", "1", "--num-steps", "16"]
    flags += ["--num-actor-threads", "1"]
    flags += ["--update-epochs", "1", "--num-minibatches", "1", "--torch-threads", "1", "--total-timesteps", "100000"]
    proc = run_script(SCRIPT, flags, tmp_path, timeout=120)
    assert proc.returncode == 1
    assert "actor thread 0 died" in proc.stderr and "injected env failure" in proc.stderr
    assert "\nstopped (exit status 1): " in proc.stdout, proc.stdout  # the summary, also after a dead worker


def test_non_finite_loss_stops_and_keeps_last_checkpoint(tmp_path):
    flags = ["--env-id", "tests.faulty_env:NaNCartPole-v0", "--num-envs", "1", "--num-steps", "16"]
    flags += ["--num-actor-threads", "1"]
    flags += ["--update-epochs", "1", "--num-minibatches", "1", "--torch-threads", "1", "--total-timesteps", "100000"]
    flags += ["--checkpoint-interval", "0.000001"]
    proc = run_script(SCRIPT, flags, tmp_path, timeout=120)
    assert proc.returncode == 1
    assert "non-finite loss" in proc.stderr
    checkpoint = torch.load(only_run_dir(tmp_path) / "checkpoint.pt", weights_only=False)
    assert 0 < checkpoint["update"] and all(torch.isfinite(v).all() for v in checkpoint["model"].values())
    assert len(scalars(only_run_dir(tmp_path))["charts/SPS"]) == checkpoint["update"]  # every update's scalars


def test_a_non_finite_loss_or_gradient_is_refused_before_the_optimizer_step():
    """A finite loss can have a NaN gradient (here sqrt at 0, times 0): Learner.step refuses both, before the optimizer
    touches the parameters (checked after the all-reduce, so that every rank sees the NaN and stops)."""
    model = nn.Linear(1, 1)
    learner = Learner(checked(), model, [], torch.device("cpu"), 0, 1, {}, None)
    before = [p.detach().clone() for p in model.parameters()]
    nan_loss, nan_gradient = model.weight.sum() * math.nan, torch.sqrt(model.weight.sum() * 0)
    # the sign of the zero loss is the random weight's: sqrt(-0.0) is -0.0
    for loss, message in [(nan_loss, "non-finite loss nan"), (nan_gradient, r"loss -?0.0 \(gradient norm nan\)")]:
        with pytest.raises(NonFiniteLoss, match=message):
            learner.step({"total_loss": loss}, threading.Event(), threading.Event())
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def interrupt_training(tmp_path, sig, extra=()):
    """Start a long run, wait until its first update is done, send `sig`; returns (exit code, the rest of stdout,
    stderr). The deadline only catches a hang: the time to stop is measured in RESULTS.md."""
    proc = start_run(SCRIPT, [*TINY_CARTPOLE, "--total-timesteps", "10000000", *extra], tmp_path)
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=60)
    return proc.returncode, out, err


def test_sigint_stops_cleanly_with_checkpoint_and_resume_continues(tmp_path):
    code, out, err = interrupt_training(tmp_path, signal.SIGINT, ["--checkpoint-interval", "3600"])
    assert code == 130 and "Traceback" not in err, err
    run_dir = only_run_dir(tmp_path)
    checkpoint = torch.load(run_dir / "checkpoint.pt", weights_only=False)
    stopped_at = checkpoint["global_step"]
    assert stopped_at > 0 and stopped_at == max(s for s, _ in scalars(run_dir)["charts/SPS"])
    summary = out.splitlines()[-5:]  # the summary of a stopped run: it can be resumed
    assert summary[0].startswith(f"stopped (exit status 130): {stopped_at:,} of 10,000,000 agent steps in "), out
    assert summary[3:] == [f"      python {SCRIPT} --resume {run_dir / 'checkpoint.pt'}",
                           f"      python {SCRIPT} --eval-only {run_dir / 'checkpoint.pt'}"]  # fmt: skip

    flags = [*TINY_CARTPOLE, "--total-timesteps", str(stopped_at + 256), "--resume", str(run_dir / "checkpoint.pt")]
    resumed = run_script(SCRIPT, flags, tmp_path, timeout=240)
    assert resumed.returncode == 0, resumed.stderr
    logged = scalars(run_dir)
    assert max(s for s, _ in logged["charts/SPS"]) == stopped_at + 256 and only_run_dir(tmp_path) == run_dir
    assert [v for s, v in logged["charts/policy_lag"] if s > stopped_at] == expected_lags(False, 2)


def test_sigterm_also_stops_cleanly_with_the_default_final_checkpoint(tmp_path):
    code, out, err = interrupt_training(tmp_path, signal.SIGTERM)
    assert code == 143 and "Traceback" not in err, err  # 128 + SIGTERM
    checkpoint = only_run_dir(tmp_path) / "checkpoint.pt"  # --checkpoint-interval 600 by default: written at a stop
    assert torch.load(checkpoint, weights_only=False)["global_step"] > 0 and f"--resume {checkpoint}" in out


@pytest.fixture
def tmpfs(tmp_path):
    """A 2 MiB tmpfs the test can fill (tests/helpers.py), unmounted afterwards."""
    with small_tmpfs(tmp_path / "tmpfs", "2m") as mount:
        yield mount


def test_full_disk_stops_the_run_keeping_the_last_checkpoint(tmpfs):
    proc = start_run(SCRIPT, [*TINY_CARTPOLE, "--total-timesteps", "10000000", "--checkpoint-interval", "0.5"], tmpfs)
    try:
        run_dir, deadline = only_run_dir(tmpfs), time.time() + 60
        while not (run_dir / "checkpoint.pt").exists() and time.time() < deadline:
            time.sleep(0.1)
        fill_disk(tmpfs)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 1, err
    assert "Traceback" not in err and "error: no space left on device while writing" in err, err
    (tmpfs / "filler").unlink()
    checkpoint = torch.load(run_dir / "checkpoint.pt", weights_only=False)
    assert checkpoint["global_step"] > 0 and not list(run_dir.glob("*.tmp"))


# ------------------------------------------------------------------ torchrun: a lost rank, the two-node launch


def test_torchrun_survivor_names_the_rank_that_died(tmp_path):
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    cmd = [sys.executable, *launcher, SCRIPT, "--log-dir", str(tmp_path), *TINY_CARTPOLE]
    cmd += ["--total-timesteps", "10000000"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        for line in proc.stdout:
            if CONSOLE_LINE.match(line):  # training is under way
                break
        os.kill(rank_pid(proc.pid, 1), signal.SIGKILL)
        _, err = proc.communicate(timeout=60)
    finally:
        for pid in children_of(proc.pid):
            os.kill(pid, signal.SIGKILL)
        proc.kill()
    assert proc.returncode != 0, err
    assert "error: rank 0: lost contact with rank 1" in err and "died:" not in err, err


def test_two_node_launch_on_loopback_ends_with_identical_ranks(tmp_path, monkeypatch):
    """The README's two-node launch; the ranks all-reduce their gradients, so they end with identical parameters.
    --track: rank 0 alone logs to W&B (offline), one run for the two ranks."""
    for name, value in offline_wandb_env(tmp_path / "wandb").items():  # the launchers inherit this environment
        monkeypatch.setenv(name, value)
    results = two_node_launch(SCRIPT, [*TINY_CARTPOLE, "--total-timesteps", "1024", "--track"], tmp_path / "runs")
    for r in results:
        assert r.returncode == 0 and "terminate called" not in r.stderr, r.stderr
    assert any("max |parameter difference| across 2 ranks: 0" in r.stdout for r in results)
    run_dir = only_run_dir(tmp_path / "runs")
    tracked = assert_tracked_once(tmp_path / "wandb", run_dir)
    assert tracked.config["num_envs"] == 4 and tracked.config["algo"] == "ppo"
    saved = json.loads((run_dir / "args.json").read_text())
    assert saved["script"] == SCRIPT and saved["args"]["total_timesteps"] == 1024 and saved["meta"]["network"] == "mlp"
    logged = scalars(run_dir)
    assert [s for s, _ in logged["charts/SPS"]] == [256 * i for i in range(1, 5)]  # both ranks' envs count
    assert [v for _, v in logged["charts/policy_lag"]] == expected_lags(False, 4)


# ------------------------------------------------------------------ torchrun: world size, a stopped rank, the launcher

TWO_RANKS = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]


def test_resume_under_another_world_size_is_refused_naming_both(tmp_path, monkeypatch, capsys):
    """A 2-rank checkpoint resumed in one process (an update would be half the agent steps: the update count and the
    learning-rate schedule no longer fit the budget), and a one-process checkpoint under 2 ranks: one error line, exit
    2, naming both world sizes and the launch that continues the run."""
    first = run_script(SCRIPT, [*TINY_CARTPOLE, "--total-timesteps", "512"], tmp_path / "two", launcher=TWO_RANKS)
    assert first.returncode == 0, first.stderr[-1500:]
    checkpoint = only_run_dir(tmp_path / "two") / "checkpoint.pt"
    proc = run_script(SCRIPT, ["--resume", str(checkpoint), "--total-timesteps", "2048"], tmp_path / "two")
    relaunch = f"torchrun --nproc-per-node 2 {SCRIPT} --resume {checkpoint}"
    assert_one_error_line(proc, "world size 2", "world size 1", relaunch)
    run_dir = tmp_path / "one" / "CartPole-v1__x__1__1700000000"
    run_dir.mkdir(parents=True)
    args = checked(num_envs=4, num_steps=32, total_timesteps=2048, resume=str(run_dir / "checkpoint.pt"))
    write_run_args(run_dir, args, meta_of())
    torch.save(dict(model={}, meta=meta_of(), update=1, global_step=128), run_dir / "checkpoint.pt")
    monkeypatch.setenv("WORLD_SIZE", "2")
    error = refusal(capsys, main, args)
    assert "world size 2" in error and "world size 1" in error and f"python {SCRIPT} --resume" in error, error


class DoneWork:
    """A collective that has completed (what `dist.all_reduce(..., async_op=True)` returns)."""

    def wait(self, timeout=None):
        return True

    def is_completed(self):
        return True


class SilentWork:
    """A collective a peer never joins: each wait's slice times out, as gloo's does."""

    def wait(self, timeout=None):
        raise RuntimeError("Operation timed out!")

    def is_completed(self):
        return False


def two_rank_learner(monkeypatch, peer_step_offset=0, peer_stops=False):
    """Rank 0 of 2 in-process, its all-reduce faked: rank 1 sends gradients of 3 everywhere, its step count (this
    rank's plus `peer_step_offset`) and its stop request."""
    model = nn.Linear(2, 1)
    learner = Learner(checked(), model, [], torch.device("cpu"), 0, 2, {}, None)

    def all_reduce(flat, async_op=False):
        peer = torch.full_like(flat, 3.0)
        peer[-4:] = torch.tensor([0.0, learner.steps + peer_step_offset, 0.0, float(peer_stops)])
        flat.add_(peer)
        return DoneWork()

    monkeypatch.setattr(cleanba_ppo_impala.dist, "all_reduce", all_reduce)
    return learner, model


def test_the_gradient_all_reduce_carries_the_ranks_step_counts_and_stop_requests(monkeypatch):
    """The mean gradient over the ranks; a stop requested on another rank stops this one at the same step (before
    the optimizer moves); a rank at another step count is named as out of step."""
    learner, model = two_rank_learner(monkeypatch)
    model.weight.grad, model.bias.grad = torch.ones(1, 2), torch.ones(1)
    stop, requested = threading.Event(), threading.Event()
    learner.steps = 1
    cleanba_ppo_impala.average_gradients(learner, stop, requested)
    assert torch.equal(model.weight.grad, torch.full((1, 2), 2.0)) and torch.equal(model.bias.grad, torch.tensor([2.0]))
    learner, model = two_rank_learner(monkeypatch, peer_stops=True)
    model.weight.grad, model.bias.grad = torch.ones(1, 2), torch.ones(1)
    with pytest.raises(cleanba_ppo_impala.Stop):
        cleanba_ppo_impala.average_gradients(learner, stop, requested)
    assert stop.is_set()
    learner, model = two_rank_learner(monkeypatch, peer_step_offset=1)
    model.weight.grad, model.bias.grad = torch.ones(1, 2), torch.ones(1)
    learner.steps = 4
    with pytest.raises(cleanba_ppo_impala.RankLost, match=r"out of step .*rank 0 at step 4, rank 1 at step 5"):
        cleanba_ppo_impala.average_gradients(learner, threading.Event(), threading.Event())


def test_waiting_for_a_silent_rank_ends_with_a_stop_or_a_line_naming_it():
    wait_for_ranks = cleanba_ppo_impala.wait_for_ranks
    wait_for_ranks(DoneWork(), "the all-reduce of update 3", threading.Event(), 0, 2, timeout=0.0)
    with pytest.raises(cleanba_ppo_impala.RankLost, match=r"^rank 0: rank 1 did not join the all-reduce of update 3"):
        wait_for_ranks(SilentWork(), "the all-reduce of update 3", threading.Event(), 0, 2, timeout=0.0)
    with pytest.raises(cleanba_ppo_impala.RankLost, match=r"^rank 2: a rank other than rank 2 \(of 4\) did not join"):
        wait_for_ranks(SilentWork(), "the all-reduce of update 3", threading.Event(), 2, 4, timeout=0.0)
    stop = threading.Event()
    stop.set()
    with pytest.raises(cleanba_ppo_impala.Stop):  # asked to stop: the peer gets `grace` seconds, not `timeout`
        wait_for_ranks(SilentWork(), "the all-reduce of update 3", stop, 0, 2, timeout=3600.0, grace=0.0)


def launch_two_ranks(log_dir, *extra):
    """Two ranks on a long run, with a checkpoint only at the end; (launcher, rank pids) once training is under way."""
    args = [*TINY_CARTPOLE, "--total-timesteps", "10000000", "--checkpoint-interval", "3600", *extra]
    return launch_ranks(SCRIPT, args, log_dir)


def test_ctrl_c_with_a_stopped_rank_gives_the_checkpoint_and_the_summary(tmp_path):
    """Rank 1 stopped (SIGSTOP) and Ctrl+C to the launcher: rank 0 is waiting for rank 1 in an all-reduce; it still
    stops, names the rank that did not join, writes the checkpoint of its last whole update and prints the summary."""
    proc, pids = launch_two_ranks(tmp_path)
    seen: list[str] = []
    try:
        os.kill(pids[1], signal.SIGSTOP)
        wait_for(lambda: state_of(pids[1]) == "T", "rank 1 stopped")
        proc.send_signal(signal.SIGINT)
        read_until(proc, "stopped (exit status 130)", seen)
        os.kill(pids[1], signal.SIGCONT)
        seen.append(proc.communicate(timeout=120)[0])
    finally:
        end_launch(proc, pids)
    out = "".join(seen)
    assert "rank 0: rank 1 did not join the all-reduce of update" in out, out[-3000:]
    checkpoint = torch.load(only_run_dir(tmp_path) / "checkpoint.pt", weights_only=False)
    assert checkpoint["global_step"] > 0 and checkpoint["meta"]["world_size"] == 2
    assert f"stopped (exit status 130): {checkpoint['global_step']:,} of" in out, out[-3000:]


def test_a_stopped_rank_stops_the_run_with_a_line_naming_it(tmp_path):
    """Rank 1 stopped (SIGSTOP) and nothing else: rank 0 gives up after --rank-timeout with a line naming rank 1, and
    keeps the checkpoint of its last whole update (the same on both ranks)."""
    proc, pids = launch_two_ranks(tmp_path, "--rank-timeout", "5")
    seen: list[str] = []
    try:
        os.kill(pids[1], signal.SIGSTOP)
        read_until(proc, "stopped (exit status 1)", seen)
        os.kill(pids[1], signal.SIGCONT)
        seen.append(proc.communicate(timeout=120)[0])
    finally:
        end_launch(proc, pids)
    out = "".join(seen)
    assert "error: rank 0: rank 1 did not join the all-reduce of update" in out and "within 5 s" in out, out[-3000:]
    assert proc.returncode != 0
    assert torch.load(only_run_dir(tmp_path) / "checkpoint.pt", weights_only=False)["global_step"] > 0


def test_killing_the_launcher_stops_its_ranks_with_a_checkpoint(tmp_path):
    """kill -9 of the torchrun launcher: its ranks (in their own sessions, reparented) stop as on SIGTERM, rank 0
    with its final checkpoint; none is left running."""
    proc, pids = launch_two_ranks(tmp_path)
    try:
        os.kill(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate(timeout=60)  # the ranks hold the pipe: it ends when both have exited
        wait_for(lambda: not any(alive(pid) for pid in pids), "no rank left running")
    finally:
        end_launch(proc, pids)
    assert "the torchrun launcher" in out and "is gone" in out, out[-3000:]
    assert torch.load(only_run_dir(tmp_path) / "checkpoint.pt", weights_only=False)["global_step"] > 0


def test_a_stop_requested_by_the_other_rank_alone_ends_rank_0_with_its_checkpoint(tmp_path):
    """SIGTERM to rank 1 only: the ranks agree on the stop at an all-reduce, and rank 0, which got no signal itself,
    stops there too: it writes the checkpoint of its last whole update and does not wait for rank 1 in the end-of-run
    parameter check (only a run that spent its budget has one, on every rank)."""
    proc, pids = launch_two_ranks(tmp_path)
    try:
        os.kill(pids[1], signal.SIGTERM)
        out, _ = proc.communicate(timeout=90)
    finally:
        end_launch(proc, pids)
    assert "stopped by SIGTERM at global step" in out and "[rank0]: Traceback" not in out, out[-3000:]
    assert torch.load(only_run_dir(tmp_path) / "checkpoint.pt", weights_only=False)["global_step"] > 0
