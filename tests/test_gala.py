"""gala_a2c.py: gossip mixing against mixing matrices written by hand, non-blocking gossip, the staleness bound and
the message ages it predicts (`charts/policy_lag`), Proposition 2's epsilon-ball, two learners over gloo in both modes,
end-to-end runs, --track (one offline W&B run per run), --eval-only, bad flags and shutdown."""

import contextlib
import datetime
import json
import math
import multiprocessing
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
import torch.distributed as dist
import tyro
from helpers import (
    CONSOLE_LINE,
    CORE_TAGS,
    ROOT,
    FakeWandb,
    FixedLogitsPolicy,
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

import gala_a2c
from gala_a2c import (
    Args,
    DistributedEndpoint,
    Mix,
    RankLink,
    Record,
    Run,
    SharedMemoryEndpoint,
    SharedMemoryGossip,
    Stop,
    checkpoint_meta,
    env_spaces,
    epsilon_ball_radius,
    load_checkpoint,
    mixing_matrix,
    n_step_returns,
    new_run_dir,
    peer_offsets,
    start_tracking,
    validate,
)

SCRIPT = "gala_a2c.py"
TINY_CARTPOLE = ["--env-id", "CartPole-v1", "--num-learners", "2", "--num-envs", "4", "--log-interval", "1"]
CTX = multiprocessing.get_context("fork")


def ring(n, num_peers=1, tau=0, time_varying=False, numel=6, stop=None):
    shared = SharedMemoryGossip(CTX, n, numel, torch.device("cpu"))
    stop = stop or threading.Event()  # never set unless a test sets it
    return [SharedMemoryEndpoint(shared, i, num_peers, time_varying, tau, stop) for i in range(n)]


def gossip_round(endpoints, X, iteration=0):
    """Every learner publishes, then every learner mixes: X <- P X (Algorithm 1, lines 5-8, all agents in step, so
    every message mixed in is from the receiver's own iteration: age 0)."""
    for e, x in zip(endpoints, X, strict=True):
        e.publish(x, iteration)
    steps = [e.step(x, iteration) for e, x in zip(endpoints, X, strict=True)]
    assert all(s.mixed and s.lags == (0,) * e.num_peers for s, e in zip(steps, endpoints, strict=True)), steps


def hand_ring_matrix(n, in_offsets):
    """p_ij = 1/(1+k) for j = i and the k in-peers j = i - s (mod n), written out entry by entry."""
    P = np.zeros((n, n))
    for i in range(n):
        P[i, i] = 1 / (1 + len(in_offsets))
        for s in in_offsets:
            P[i, (i - s) % n] = 1 / (1 + len(in_offsets))
    return P


# ------------------------------------------------------------------ pure functions and the gossip endpoints


def test_n_step_returns_known_values():
    rewards = torch.tensor([[1.0], [0.0], [2.0]])
    dones = torch.tensor([[0.0], [1.0], [0.0]])
    got = n_step_returns(rewards, dones, torch.tensor([4.0]), 0.9)
    assert got[:, 0].tolist() == pytest.approx([1 + 0.9 * 0, 0.0, 2 + 0.9 * 4])


def test_mixing_matrix_is_the_hand_written_ring_and_doubly_stochastic():
    P = mixing_matrix(4, peer_offsets(4, 1)).numpy()
    np.testing.assert_allclose(P, [[0.5, 0, 0, 0.5], [0.5, 0.5, 0, 0], [0, 0.5, 0.5, 0], [0, 0, 0.5, 0.5]])
    for n, k, t in [(5, 2, 0), (6, 2, 3), (4, 1, 1)]:
        P = mixing_matrix(n, peer_offsets(n, k, t, time_varying=True)).numpy()
        np.testing.assert_allclose(P.sum(0), 1)
        np.testing.assert_allclose(P.sum(1), 1)
    assert peer_offsets(4, 1, 0, True) != peer_offsets(4, 1, 1, True)  # the time-varying ring rotates


@pytest.mark.parametrize(("n", "num_peers"), [(4, 1), (5, 2)])
def test_one_gossip_step_is_the_mixing_matrix_product(n, num_peers):
    X = torch.randn(n, 6, dtype=torch.float32)
    want = hand_ring_matrix(n, range(1, num_peers + 1)) @ X.double().numpy()
    gossip_round(ring(n, num_peers), X)
    np.testing.assert_allclose(X.numpy(), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("time_varying", [False, True])
def test_repeated_gossip_converges_to_the_initial_average(time_varying):
    X = torch.randn(4, 6) * 10
    average = X.mean(0).clone()
    endpoints = ring(4, time_varying=time_varying)
    for t in range(60):
        gossip_round(endpoints, X, iteration=t)
    torch.testing.assert_close(X, average.expand_as(X), rtol=0, atol=1e-4)


def test_learner_keeps_stepping_until_max_staleness_then_waits_for_its_in_peer():
    """b, a's only in-peer, is slow: a runs tau iterations without mixing, blocks at the next, and mixes b's message
    from b's iteration 0 at its own iteration tau: the message is tau iterations old."""
    tau = 3
    a, b = ring(2, tau=tau)
    x = torch.ones(6)
    for k in range(tau):  # tau iterations without mixing: none blocks
        assert a.step(x, k) == Mix(False, 0.0) and a.staleness == k + 1
    result = {}
    waiter = threading.Thread(target=lambda: result.update(out=a.step(x, tau)), daemon=True)
    waiter.start()
    waiter.join(timeout=1.0)
    assert waiter.is_alive()  # iteration tau: blocked for the in-peer
    b.publish(torch.full((6,), 3.0), 0)
    waiter.join(timeout=10)
    assert not waiter.is_alive() and result["out"].mixed and result["out"].lags == (tau,) and a.staleness == 0
    torch.testing.assert_close(x, torch.full((6,), 2.0))  # (1 + 3) / 2


def test_blocked_learner_wakes_on_stop():
    stop = threading.Event()
    stop.set()
    a, _ = ring(2, tau=0, stop=stop)
    with pytest.raises(Stop):
        a.step(torch.ones(6), 0)


def test_newer_message_overwrites_an_unread_older_one():
    a, b = ring(2, tau=10)
    b.publish(torch.full((6,), 5.0), 0)
    b.publish(torch.full((6,), 7.0), 1)  # a has not read the 5s: they are gone
    x = torch.ones(6)
    assert a.step(x, 3) == Mix(True, 0.0, (2,))  # b's iteration-1 message, mixed at a's iteration 3
    torch.testing.assert_close(x, torch.full((6,), 4.0))  # (1 + 7) / 2: one message, the newest
    assert a.step(x, 4) == Mix(False, 0.0)  # nothing new from b: no second mix


def test_epsilon_ball_of_proposition_2_holds_for_bounded_updates():
    """Synchronous gossip with updates ||G|| = L exactly (worst-case size, random directions): the measured
    ||X - X_bar|| stays within alpha beta~ L / (1 - beta), beta from the 4-ring's mixing matrix (1/sqrt(2))."""
    n, d, alpha, L = 4, 50, 0.1, 1.0
    P = torch.tensor(hand_ring_matrix(n, [1]))
    radius = epsilon_ball_radius(P, alpha, L)
    assert radius == pytest.approx(alpha * L / (1 - 1 / math.sqrt(2)), rel=1e-9)  # known beta of the 4-ring
    generator = torch.Generator().manual_seed(0)
    X = torch.zeros(n, d)  # identical initial parameters
    endpoints = ring(n, numel=d)
    distances = []
    for t in range(300):
        G = torch.randn(n, d, generator=generator)
        if t % 50 < 25:  # stretches of one persistent direction per learner push the learners apart hardest
            G = torch.randn(n, d, generator=torch.Generator().manual_seed(t // 50))
        X -= alpha * G * (L / torch.linalg.matrix_norm(G))
        gossip_round(endpoints, X, t)
        distances.append(torch.linalg.matrix_norm(X.double() - X.double().mean(0)).item())
    assert max(distances) <= radius
    assert max(distances) > 0.2 * radius  # the bound is not vacuous for this problem


# ------------------------------------------------------------------ defaults: the optimizer and the evaluation


def test_default_rmsprop_eps_is_the_released_codes_and_the_optimizer_applies_it_outside_the_root():
    """facebookresearch/gala's --eps default is 1e-5 (Table 2's 0.01 does not learn Pong with eps outside the root).
    One step from zero statistics, by hand: v = (1 - alpha) g^2, p -= lr g / (sqrt(v) + eps)."""
    args = tyro.cli(gala_a2c.Args, args=[])
    assert args.rmsprop_eps == 1e-5
    p = torch.zeros(3, requires_grad=True)
    optimizer = gala_a2c.make_optimizer([p], 0.1, args)
    g = torch.tensor([1e-4, -2e-3, 0.5], dtype=torch.float64)
    p.grad = g.float()
    optimizer.step()
    want = -0.1 * g / ((1 - 0.99) ** 0.5 * g.abs() + 1e-5)  # [-0.5, 0.952, -0.9998]; eps 0.01: [-0.001, 0.0196, -0.833]
    torch.testing.assert_close(p.detach().double(), want, rtol=1e-5, atol=0)


def test_evaluation_takes_argmax_actions_by_default_and_samples_with_no_eval_greedy(monkeypatch, tmp_path):
    """GALA Table 1 evaluates with argmax_a pi(a|s). The policy's argmax (action 2) has probability about 0.34."""
    logits = torch.tensor([0.0, 0.4, 0.8, 0.2])
    for flags, greedy in [([], True), (["--no-eval-greedy"], False)]:
        env = RecordingEnv(length=25)
        monkeypatch.setattr(gala_a2c, "make_env", lambda *a, env=env, **k: env)
        args = tyro.cli(gala_a2c.Args, args=["--env-id", "CartPole-v1", "--eval-episodes", "4", *flags])
        assert list(gala_a2c.evaluate(FixedLogitsPolicy(logits), args, tmp_path, torch.device("cpu"))) == [25.0] * 4
        assert len(env.actions) == 100
        if greedy:
            assert set(env.actions) == {2}
        else:  # sampled: every action shows up, the argmax in about a third of the steps
            assert set(env.actions) == {0, 1, 2, 3}
            assert 15 <= env.actions.count(2) <= 55


# ------------------------------------------------------------------ running the script


REQUIRED_TAGS = [
    *CORE_TAGS,
    "timing/rollout",
    "timing/gossip",
    "timing/iteration",
    "per_learner/SPS_0",
    "per_learner/SPS_1",
]
GOSSIP_TAGS = ["gossip/consensus_distance", "gossip/staleness", "per_learner/consensus_distance_1"]
TORCHRUN = ("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2")


@pytest.fixture(scope="module")
def gossip_run(tmp_path_factory):
    """One tracked (offline) 2-learner gossip run on CartPole with --save-model, a final checkpoint and one evaluation
    episode: (its CompletedProcess, its run directory, its W&B directory)."""
    log_dir, wandb_dir = tmp_path_factory.mktemp("gossip-runs"), tmp_path_factory.mktemp("wandb")
    args = [*TINY_CARTPOLE, "--total-timesteps", "1200", "--sync-interval", "5", "--max-staleness", "0", "--track"]
    args += ["--eval-episodes", "1", "--save-model", "--checkpoint-interval", "3600"]
    proc = run_script(SCRIPT, args, log_dir, env=offline_wandb_env(wandb_dir))
    assert proc.returncode == 0, proc.stderr
    return proc, only_run_dir(log_dir), wandb_dir


def test_cartpole_gossip_end_to_end_with_the_message_ages_max_staleness_0_predicts(gossip_run):
    """--max-staleness 0: every iteration mixes (mix rate 1, staleness 0). Learner i at iteration t mixes its in-peer
    j's newest message, stamped with j's iteration s. i has mixed a strictly newer message at each iteration before, so
    s >= t; j can only have finished iteration s after mixing at s - 1 a message of i's, all of which are from
    iterations <= t, so s <= t + 1: the age t - s (charts/policy_lag) is 0 or -1, and so is every mean of it.
    --track: the main process alone logs to W&B (one run for the two learner processes)."""
    proc, run_dir, wandb_dir = gossip_run
    logged = scalars(run_dir)
    assert_finite_tags(logged, [*REQUIRED_TAGS, *GOSSIP_TAGS, "eval/episodic_return"])
    assert_documented_tags("gala_a2c.py", logged)
    assert max(s for s, _ in logged["charts/SPS"]) == 1200  # global step: both learners' agent steps
    assert (run_dir / "model.pt").is_file()
    lr = logged["charts/learning_rate"][0][1]
    assert lr == pytest.approx(7e-4 * math.sqrt(2))  # Table 2: scaled by sqrt(learners)
    assert {v for _, v in logged["gossip/mix_rate"]} == {1.0} and {v for _, v in logged["gossip/staleness"]} == {0.0}
    lags = [v for _, v in logged["charts/policy_lag"]]
    assert len(lags) == len(logged["gossip/mix_rate"]) and all(-1 <= v <= 0 for v in lags), lags
    assert re.search(r"^global_step=1200 SPS=\d+ mean_return=\d", proc.stdout, re.MULTILINE), proc.stdout[-500:]
    assert_console(proc.stdout, run_dir, "finished: 1,200 of 1,200 agent steps", gossip=True)
    tracked = assert_tracked_once(wandb_dir, run_dir)
    assert tracked.config["num_learners"] == 2 and tracked.config["max_staleness"] == 0
    saved = json.loads((run_dir / "args.json").read_text())
    assert saved["script"] == SCRIPT and saved["args"]["env_id"] == "CartPole-v1" and saved["meta"]["network"] == "mlp"


def assert_console(stdout, run_dir, ended, gossip):
    """One start line (the run directory, the plan, and in gossip mode the gloss of staleness and peer_lag), console
    lines whose gossip fields are the glossed ones, and one summary that names the run directory."""
    lines = stdout.splitlines()
    starts = [line for line in lines if line.startswith("run directory:")]
    assert len(starts) == 1 and starts[0].startswith(f"run directory: {run_dir}  ("), starts
    gloss = "peer_lag = its updates minus its in-peer's when that peer sent the parameters it mixed (negative: the"
    assert (gloss in starts[0]) == gossip and "updates of" in starts[0], starts[0]
    console = [line for line in lines if CONSOLE_LINE.match(line)]
    assert console and all(" done=" in line and " learner_sps=" in line for line in console), console
    assert all((" staleness=" in line and " peer_lag=" in line) == gossip for line in console), console
    assert not any("policy_lag=" in line for line in console), console
    assert [line for line in lines if line.startswith(("finished:", "stopped ("))] == [
        next(line for line in lines if line.startswith(ended))
    ], lines[-6:]
    assert f"next: tensorboard --logdir {run_dir}" in lines, lines[-6:]


def test_eval_only_replays_the_saved_agent_with_the_end_of_training_evaluation(gossip_run, tmp_path, capsys):
    """model.pt (in a subprocess, with its args.json) and checkpoint.pt (in process: its learners averaged as at the
    end of training) play the same greedy episodes, and the first is the run's own eval episode: same policy, same
    evaluation seed."""
    _, run_dir, _ = gossip_run
    proc, report = run_eval_only(SCRIPT, run_dir / "model.pt", tmp_path / "logs", "--eval-episodes", "3")
    assert proc.returncode == 0 and report is not None, proc.stderr
    assert report["episodes"] == 3 and report["greedy"] is True and report["model"] == str(run_dir / "model.pt")
    assert report["settings"] == {"env_id": "CartPole-v1", "atari_protocol": "deepmind", "network": "mlp"}
    returns = report["returns"]
    assert len(returns) == 3 and all(math.isfinite(r) and r == int(r) and 8 <= r <= 500 for r in returns), returns
    assert report["mean"] == pytest.approx(np.mean(returns))
    assert returns[0] == scalars(run_dir)["eval/episodic_return"][0][1]
    assert "from its run: env_id=CartPole-v1 atari_protocol=deepmind network=mlp" in proc.stdout
    threads = torch.get_num_threads()
    try:
        gala_a2c.main(tyro.cli(Args, args=["--eval-only", str(run_dir / "checkpoint.pt"), "--eval-episodes", "3"]))
    finally:
        torch.set_num_threads(threads)
    from_checkpoint = max(run_dir.glob("eval-*.json"), key=lambda p: p.stat().st_mtime_ns)
    assert json.loads(from_checkpoint.read_text())["returns"] == returns
    assert "eval episode 2: return" in capsys.readouterr().out


def test_eval_only_refuses_what_it_cannot_evaluate(gossip_run, tmp_path, capsys):
    _, run_dir, _ = gossip_run
    assert_eval_only_refusals(SCRIPT, run_dir / "model.pt", tmp_path)  # other script, --env-id Acrobot-v1, garbage
    lonely = tmp_path / "lonely"
    lonely.mkdir()
    (lonely / "model.pt").write_bytes((run_dir / "model.pt").read_bytes())
    error = run_main(capsys, ["--eval-only", str(lonely / "model.pt")])
    assert "cannot read its run's args.json" in error, error
    error = run_main(capsys, ["--eval-only", str(run_dir / "model.pt"), "--network", "nature"])
    assert "--network nature contradicts" in error and "mlp" in error, error
    error = run_main(capsys, ["--eval-only", str(tmp_path / "missing.pt")])
    assert error == f"error: --eval-only {tmp_path / 'missing.pt'}: no such file", error


def test_breakout_allreduce_keeps_learners_identical(tmp_path):
    """ALE frames through the Nature CNN, in the A2C baseline (too short for a finished episode: the episodic tags are
    checked on CartPole above)."""
    args = ["--env-id", "ALE/Breakout-v5", "--num-learners", "2", "--num-envs", "2", "--mode", "allreduce"]
    proc = run_script(SCRIPT, [*args, "--total-timesteps", "200", "--checkpoint-interval", "3600"], tmp_path, 240)
    assert proc.returncode == 0, proc.stderr
    run_dir = only_run_dir(tmp_path)
    logged = scalars(run_dir)
    assert_finite_tags(logged, [t for t in REQUIRED_TAGS if "episodic" not in t])
    assert max(s for s, _ in logged["charts/SPS"]) == 200
    assert {v for _, v in logged["charts/policy_lag"]} == {0.0}  # one synchronous A2C: the policy that acted
    checkpoint = torch.load(run_dir / "checkpoint.pt", weights_only=False)
    a, b = (s["model"] for s in checkpoint["learners"])
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert checkpoint["global_step"] == 200 and [s["iteration"] for s in checkpoint["learners"]] == [10, 10]


def test_two_allreduce_learners_in_two_torchrun_processes_over_gloo(tmp_path):
    """--track: rank 0 alone logs to W&B (one run for the two ranks)."""
    args = [*TINY_CARTPOLE, "--mode", "allreduce", "--total-timesteps", "1600", "--sync-interval", "10", "--track"]
    env = offline_wandb_env(tmp_path / "wandb")
    proc = run_script(SCRIPT, [*args, "--save-model"], tmp_path / "runs", 180, env=env, launcher=TORCHRUN)
    assert proc.returncode == 0, proc.stderr
    run_dir = only_run_dir(tmp_path / "runs")
    assert_tracked_once(tmp_path / "wandb", run_dir)
    assert [s for s, _ in scalars(run_dir)["charts/SPS"]] == [400, 800, 1200, 1600]  # sync points: both ranks' steps
    assert (run_dir / "model.pt").is_file() and (run_dir / "learner1").is_dir()
    assert "max |parameter difference| across 2 learners: 0" in proc.stdout
    assert_console(proc.stdout, run_dir, "finished: 1,600 of 1,600 agent steps", gossip=False)  # rank 0's console


def test_two_gossip_learners_launched_as_two_nodes_on_loopback(tmp_path):
    """The README's two-node launch (c10d rendezvous), one rank per node: gossip between the ranks over gloo."""
    args = [*TINY_CARTPOLE, "--total-timesteps", "1600", "--sync-interval", "10", "--save-model"]
    for r in two_node_launch(SCRIPT, args, tmp_path):
        assert r.returncode == 0 and "terminate called" not in r.stderr, r.stderr
    run_dir = only_run_dir(tmp_path)
    logged = scalars(run_dir)
    assert [s for s, _ in logged["charts/SPS"]] == [400, 800, 1200, 1600]  # sync points: both ranks' steps
    assert (run_dir / "model.pt").is_file() and (run_dir / "learner1").is_dir()
    assert_finite_tags(logged, ["gossip/consensus_distance", "gossip/staleness"])


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--env-id", "ALE/Breakot-v5"], "did you mean ALE/Breakout-v5"),
        (["--num-learners", "1"], "gossip needs at least 2 learners"),
        (["--num-learners", "2", "--num-peers", "2"], "--num-peers (2) must be at most"),
        (["--max-staleness", "-1"], "--max-staleness must be >= 0"),
        (["--learning-rate", "0"], "--learning-rate must be > 0"),
        (
            ["--total-timesteps", "10"],
            "--total-timesteps 10 is below one update, 320 agent steps (--num-learners x "
            "--num-envs x --num-steps): the run would learn nothing; give at least 320",
        ),
        (["--env-id", "CartPole-v1", "--capture-video"], "--capture-video records the evaluation episodes; add"),
        (["--mode", "allreduce", "--time-varying"], "--time-varying rotates the gossip ring, and --mode allreduce"),
        (["--num-learners", "3", "--num-peers", "2", "--time-varying"], "every learner has all the others as peers"),
        (["--resume", "/nonexistent/checkpoint.pt"], "no such checkpoint"),
        (["--env-id", "Pendulum-v1"], "Box action space"),
        (["--env-id", "CartPole-v1", "--learning-rate", "inf"], "--learning-rate must be a finite number"),
        (["--env-id", "CartPole-v1", "--gamma", "nan"], "--gamma must be a finite number"),
        (["--env-id", "CartPole-v1", "--max-grad-norm", "-inf"], "--max-grad-norm must be a finite number"),
        (["--env-id", "CartPole-v1", "--checkpoint-interval", "inf"], "--checkpoint-interval must be a finite number"),
        (["--eval-only", "/nonexistent/model.pt"], "--eval-only /nonexistent/model.pt: no such file"),
    ],
)
def test_validate_names_what_is_wrong(flags, message):
    args = tyro.cli(Args, args=flags)
    error = validate(args)
    assert error is not None and message in error, error
    assert validate(Args(env_id="CartPole-v1", num_learners=2)) is None
    assert "--time-varying needs the single-machine launch" in validate(Args(time_varying=True), world_size=4)


def test_validate_counts_torchrun_ranks_and_lets_a_ring_that_rotates_run():
    error = validate(Args(total_timesteps=10), world_size=2)
    assert "below one update, 160 agent steps (2 torchrun ranks x --num-envs x --num-steps)" in error, error
    assert validate(Args(env_id="CartPole-v1", num_learners=3, time_varying=True)) is None  # 1 of 2 peers: rotates


def test_track_without_wandb_is_refused_by_validate(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    error = validate(Args(env_id="CartPole-v1", num_learners=2, track=True))
    assert error.startswith('--track needs wandb (pip install -e ".[track]"): ModuleNotFoundError'), error
    assert validate(Args(env_id="CartPole-v1", num_learners=2)) is None


def test_tracking_names_the_run_after_its_directory_and_resumes_it(monkeypatch, tmp_path):
    """A --resume run continues the W&B run of its run directory (the same id)."""
    wandb = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    run_dir = tmp_path / "CartPole-v1__gala_a2c__1__1700000000"
    (run_dir / "videos").mkdir(parents=True)
    (run_dir / "videos" / "rl-video-episode-0.mp4").write_bytes(b"")
    assert start_tracking(Args(env_id="CartPole-v1"), run_dir) is None and wandb.inits == []
    assert start_tracking(Args(env_id="CartPole-v1", track=True, wandb_entity="me"), run_dir) is wandb
    resumed = Args(env_id="CartPole-v1", track=True, resume=str(run_dir / "checkpoint.pt"))
    start_tracking(resumed, run_dir)
    first, second = wandb.inits
    assert first["name"] == second["name"] == run_dir.name and first["id"] == second["id"]
    assert first["resume"] is None and second["resume"] == "allow" and first["entity"] == "me"
    assert first["sync_tensorboard"] and first["config"]["env_id"] == "CartPole-v1" and first["config"]["track"]
    assert wandb.finished == []  # Run.training ends it with the exit status (test_reliability)


def test_bad_flag_is_one_error_line_and_exit_2_before_anything_starts(tmp_path):
    proc = run_script(SCRIPT, ["--env-id", "ALE/Breakot-v5"], tmp_path, timeout=60)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "did you mean ALE/Breakout-v5" in lines[0], lines
    assert not any(Path(tmp_path).iterdir())


def learner_pids(proc, tmp_path):
    return [p for p in processes_with(str(tmp_path)) if p != proc.pid]


LONG_RUN = [*TINY_CARTPOLE, "--total-timesteps", "10000000", "--log-frequency", "1"]


def test_sigint_stops_everything_with_checkpoint_and_resume_continues(tmp_path):
    proc = start_run(SCRIPT, [*LONG_RUN, "--checkpoint-interval", "3600"], tmp_path)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "Traceback" not in err, err
    wait_for(lambda: not processes_with(str(tmp_path)), "no learner left (no orphans)")
    run_dir = only_run_dir(tmp_path)
    assert re.search(r"^stopped \(exit status 130\): [\d,]+ of 10,000,000 agent steps in ", out, re.MULTILINE), out
    assert f"      python {SCRIPT} --resume {run_dir / 'checkpoint.pt'}" in out.splitlines(), out[-600:]
    checkpoint = torch.load(run_dir / "checkpoint.pt", weights_only=False)
    stopped_at = checkpoint["global_step"]
    assert stopped_at > 0 and len(checkpoint["learners"]) == 2

    args = [*TINY_CARTPOLE, "--total-timesteps", str(stopped_at + 800), "--resume", str(run_dir / "checkpoint.pt")]
    resumed = run_script(SCRIPT, args, tmp_path)
    assert resumed.returncode == 0, resumed.stderr
    assert only_run_dir(tmp_path) == run_dir
    assert max(s for s, _ in scalars(run_dir)["charts/SPS"]) > stopped_at
    assert re.search(r"^finished: ([\d,]+) of \1 agent steps", resumed.stdout, re.MULTILINE), resumed.stdout[-600:]


def test_progress_of_a_resumed_run_counts_the_steps_of_a_learner_already_past_the_budget(tmp_path, capsys):
    """Gossip learners stop at different iterations: resumed with a budget of 45 updates, learner 0 (at 50) does
    nothing and learner 1 runs from 40 to 45, so the run ends at 95 iterations x 20 agent steps."""
    args = Args(env_id="CartPole-v1", num_learners=2, num_envs=4, total_timesteps=1800)
    checkpoint = dict(learners=[{"iteration": 50}, {"iteration": 40}], global_step=1800)
    steps = gala_a2c.steps_per_update(args, 1)
    run = Run(args, env_spaces(args), {}, checkpoint, tmp_path, torch.device("cpu"), 1, 0, steps,
              *gala_a2c.planned_updates(args.total_timesteps, steps), None)  # fmt: skip
    logger = gala_a2c.Logger(run, 2)
    # the Progress as Run.training makes it: the budget's updates, the roles, the device
    progress = gala_a2c.Progress(tmp_path, run.num_updates * steps, f"{run.plan}, {logger.roles}, cpu")
    logger.start(gala_a2c.Recorder(None, progress, args, logger.global_step))
    assert (logger.global_step, progress.total) == (1800, 1900)
    plan = "(45 updates of 40 agent steps, 2 learners x 4 envs x 5 steps, gossip, 1-peer ring, tau 10 (console:"
    assert capsys.readouterr().out.startswith(f"run directory: {tmp_path}  {plan}")


def test_killed_learner_stops_the_run_naming_it(tmp_path):
    proc = start_run(SCRIPT, LONG_RUN, tmp_path)
    children = learner_pids(proc, tmp_path)
    assert children
    os.kill(children[-1], signal.SIGKILL)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1
    assert "learner" in err and "killed by signal 9" in err, err
    wait_for(lambda: not processes_with(str(tmp_path)), "no learner left (no orphans)")


def test_crashing_learner_stops_the_run_with_its_traceback(tmp_path):
    args = ["--env-id", "tests.faulty_env:CrashingCartPole-v0", "--num-learners", "2", "--num-envs", "1"]
    proc = run_script(SCRIPT, args, tmp_path)
    assert proc.returncode == 1
    assert "learner" in proc.stderr and "died" in proc.stderr and "injected env failure" in proc.stderr


def test_torchrun_rank_that_fails_exits_with_its_error_not_an_abort(tmp_path):
    """Under torchrun the gossip receiver threads sit inside `dist.recv` when a rank fails; tearing the interpreter
    down around them aborts the process ("terminate called without an active exception"). The rank must print its
    error and exit 1."""
    args = ["--env-id", "tests.faulty_env:CrashingCartPole-v0", "--num-learners", "2", "--num-envs", "1"]
    proc = run_script(SCRIPT, args, tmp_path, timeout=180, launcher=TORCHRUN)
    assert proc.returncode == 1, proc.stderr
    assert "injected env failure" in proc.stderr and "learner" in proc.stderr
    assert "terminate called" not in proc.stderr and "SIGABRT" not in proc.stderr, proc.stderr


# ------------------------------------------------------------------ rare paths: run directories, resume


def refusal(capsys, function, *args):
    """The one error line `function` prints before it exits 2."""
    with pytest.raises(SystemExit) as exit_info:
        function(*args)
    assert exit_info.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


def test_runs_started_in_the_same_second_get_their_own_run_directories(tmp_path, monkeypatch):
    monkeypatch.setattr(time, "time", lambda: 1_700_000_000.0)
    args = Args(env_id="CartPole-v1", exp_name="x", log_dir=str(tmp_path))
    made = [new_run_dir(args) for _ in range(3)]
    assert [d.name for d in made] == [f"CartPole-v1__x__1__1700000000{s}" for s in ("", "-2", "-3")]


def run_main(capsys, flags):
    """gala_a2c.main in this process, expected to refuse with one error line and exit 2 before it starts anything."""
    threads = torch.get_num_threads()
    try:
        return refusal(capsys, gala_a2c.main, tyro.cli(Args, args=flags))
    finally:
        torch.set_num_threads(threads)


def test_log_dir_that_cannot_be_created_is_one_error_line(tmp_path, capsys):
    (tmp_path / "FILE").write_text("a file, not a directory")
    for log_dir in ("/proc/x", str(tmp_path / "FILE/runs")):
        error = run_main(capsys, [*TINY_CARTPOLE, "--log-dir", log_dir])
        assert error.startswith("error: cannot create the run directory"), error
        assert multiprocessing.active_children() == []


def fake_checkpoint(path, **meta_changes):
    meta = dict(
        script=SCRIPT,
        algo="gossip",
        learners=2,
        env_id="CartPole-v1",
        atari_protocol="deepmind",
        network="mlp",
        obs_shape=[4],
        action_shape_or_n=2,
    )
    torch.save(dict(learners=[{}, {}], global_step=0, meta={**meta, **meta_changes}), path)
    return path


def test_resume_refuses_what_it_cannot_use(tmp_path, capsys):
    spaces = env_spaces(Args(env_id="CartPole-v1"))
    ours, four = (checkpoint_meta(Args(env_id="CartPole-v1", num_learners=n), *spaces) for n in (2, 4))
    good = fake_checkpoint(tmp_path / "good.pt")
    args = Args(env_id="CartPole-v1")
    assert load_checkpoint(str(good), ours, args, 1)["learners"] == [{}, {}]
    assert "checkpoint (learners 2), this run is learners 4" in refusal(
        capsys, load_checkpoint, str(good), four, args, 1
    )
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"not a checkpoint at all")
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    old = tmp_path / "old.pt"
    torch.save(dict(learners=[{}, {}], global_step=0), old)
    for path in (garbage, truncated, old):
        error = refusal(capsys, load_checkpoint, str(path), ours, args, 1)
        assert error.startswith(f"error: cannot resume from {path}: not a checkpoint"), error
    assert '"meta"' in refusal(capsys, load_checkpoint, str(old), ours, args, 1)
    other = fake_checkpoint(tmp_path / "other.pt", script="cleanba_ppo_impala.py", algo="ppo")
    error = refusal(capsys, load_checkpoint, str(other), ours, args, 1)
    assert "it is a cleanba_ppo_impala.py checkpoint (script cleanba_ppo_impala.py, algo ppo)" in error, error
    assert error.endswith("this run is script gala_a2c.py, algo gossip"), error
    acrobot = fake_checkpoint(tmp_path / "acrobot.pt", env_id="Acrobot-v1", obs_shape=[6], action_shape_or_n=3)
    assert "(env_id Acrobot-v1, obs_shape [6], action_shape_or_n 3)" in refusal(
        capsys, load_checkpoint, str(acrobot), ours, args, 1
    )


def test_resume_of_a_run_that_ran_its_budget_is_refused(tmp_path, capsys):
    """Both learners did 5 updates of 2 x 4 x 5 = 40 agent steps: neither --total-timesteps 200 nor 239 holds another
    one (global_step counts both learners' updates), so the run is refused before anything is written."""
    path = tmp_path / "checkpoint.pt"
    torch.save(dict(learners=[{"iteration": 5}, {"iteration": 5}], global_step=200, meta=checkpoint_meta(
        Args(env_id="CartPole-v1", num_learners=2), *env_spaces(Args(env_id="CartPole-v1")))), path)  # fmt: skip
    for total in (200, 239):
        error = run_main(capsys, [*TINY_CARTPOLE, "--total-timesteps", str(total), "--resume", str(path)])
        assert error == (
            f"error: cannot resume from {path}: its run did 200 agent steps and --total-timesteps {total} "
            "(whole updates of 40) holds no more: the run would learn nothing; give at least 240"
        ), error
    assert list(tmp_path.iterdir()) == [path] and multiprocessing.active_children() == []


def test_refused_resume_exits_2_and_leaves_nothing_in_the_run_directory(tmp_path, capsys):
    run_dir = tmp_path / "CartPole-v1__x__1__1700000000"
    run_dir.mkdir()
    garbage = run_dir / "checkpoint.pt"
    garbage.write_bytes(b"\0" * 100)
    error = run_main(capsys, [*TINY_CARTPOLE, "--log-dir", str(tmp_path), "--resume", str(garbage)])
    assert error.startswith(f"error: cannot resume from {garbage}"), error
    assert list(run_dir.iterdir()) == [garbage] and multiprocessing.active_children() == []


# ------------------------------------------------------------------ rare paths: signals, stuck and orphaned learners


@pytest.mark.parametrize(("mode", "signum"), [("gossip", signal.SIGINT), ("allreduce", signal.SIGTERM)])
def test_stuck_learner_does_not_block_ctrl_c_or_sigterm_and_the_final_checkpoint_says_what_it_kept(
    mode, signum, tmp_path
):
    """A stopped learner (SIGSTOP) is killed after the grace; the run still ends with 128 + the signal's number. Its
    final state never comes (issue 35): in gossip mode the final checkpoint keeps its last published parameters (the
    main process holds its send buffer), and a resume from it runs; in allreduce mode its peer is stuck in the
    all-reduce too, and the run says that no final checkpoint was written."""
    proc = start_run(SCRIPT, [*LONG_RUN, "--mode", mode, "--checkpoint-interval", "3600"], tmp_path)
    for line in proc.stdout:  # both learners have reported (and published their parameters): no "-" in learner_sps
        if (sps := re.search(r"learner_sps=(\S+)", line)) and "-" not in sps.group(1):
            break
    learners = children_of(proc.pid)
    assert len(learners) == 2, learners
    os.kill(max(learners), signal.SIGSTOP)
    proc.send_signal(signum)
    try:
        _, err = proc.communicate(timeout=60)
        wait_for(lambda: not processes_with(str(tmp_path)), "no learner left (no orphans)")
    finally:
        for pid in processes_with(str(tmp_path)):
            os.kill(pid, signal.SIGKILL)
    assert proc.returncode == 128 + signum, err
    assert "did not stop within 5 s; killed" in err and "Traceback" not in err, err
    run_dir = only_run_dir(tmp_path)
    if mode == "allreduce":
        assert "warning: no final checkpoint: learner 0, learner 1 sent no state before the stop" in err, err
        assert not (run_dir / "checkpoint.pt").exists()
        return
    checkpoint = torch.load(run_dir / "checkpoint.pt", weights_only=False)
    # the stuck learner's entry (and its peer's, if it was stopped holding a lock that its peer then waited for)
    kept = [i for i, s in enumerate(checkpoint["learners"]) if "optimizer" not in s]
    assert kept, err
    assert all(f"the final checkpoint keeps learner {i}'s last published parameters" in err for i in kept), err
    assert checkpoint["global_step"] > 0 and all(s["iteration"] > 0 for s in checkpoint["learners"])
    args = [*TINY_CARTPOLE, "--total-timesteps", str(checkpoint["global_step"] + 400), "--resume"]
    resumed = run_script(SCRIPT, [*args, str(run_dir / "checkpoint.pt")], tmp_path)
    assert resumed.returncode == 0, resumed.stderr


def test_learners_die_with_a_killed_main_process(tmp_path):
    proc = start_run(SCRIPT, LONG_RUN, tmp_path)
    children = learner_pids(proc, tmp_path)
    assert children
    proc.kill()
    proc.communicate(timeout=60)
    try:
        wait_for(lambda: not processes_with(str(tmp_path)), "the learners to die with the main process")
    finally:
        for pid in processes_with(str(tmp_path)):
            os.kill(pid, signal.SIGKILL)


@pytest.fixture
def tmpfs(tmp_path):
    """A 2 MiB tmpfs the test can fill (tests/helpers.py), unmounted afterwards."""
    with small_tmpfs(tmp_path / "tmpfs", "2m") as mount:
        yield mount


def test_full_disk_stops_the_run_keeping_the_last_checkpoint(tmpfs):
    proc = start_run(SCRIPT, [*LONG_RUN, "--checkpoint-interval", "0.5"], tmpfs)
    run_dir = only_run_dir(tmpfs)
    wait_for((run_dir / "checkpoint.pt").exists, "the first checkpoint")
    fill_disk(tmpfs)
    try:
        _, err = proc.communicate(timeout=60)
        wait_for(lambda: not processes_with(str(tmpfs)), "no learner left (no orphans)")
    finally:
        for pid in processes_with(str(tmpfs)):
            os.kill(pid, signal.SIGKILL)
    assert proc.returncode == 1, err
    assert "Traceback" not in err and "error: no space left on device while writing" in err, err
    (tmpfs / "filler").unlink()
    checkpoint = torch.load(run_dir / "checkpoint.pt", weights_only=False)
    assert checkpoint["global_step"] > 0 and not list(run_dir.glob("*.tmp"))


# ------------------------------------------------------------------ torchrun: a lost rank


@pytest.mark.parametrize("mode", ["gossip", "allreduce"])
def test_torchrun_survivor_names_the_rank_that_died(mode, tmp_path):
    cmd = [sys.executable, *TORCHRUN, SCRIPT, "--log-dir", str(tmp_path), *TINY_CARTPOLE, "--mode", mode]
    cmd += ["--total-timesteps", "10000000", "--sync-interval", "5"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        for line in proc.stdout:  # training is under way
            if (match := CONSOLE_LINE.match(line)) and int(match.group(1)) > 0:
                break
        os.kill(rank_pid(proc.pid, 1), signal.SIGKILL)
        _, err = proc.communicate(timeout=60)
    finally:
        for pid in children_of(proc.pid):
            os.kill(pid, signal.SIGKILL)
        proc.kill()
    assert proc.returncode != 0, err
    assert "error: learner 0 (rank 0): lost contact with rank 1" in err and "learner 0 died" not in err, err


# ------------------------------------------------------------------ torchrun: a stopped rank, a killed launcher


def launch_two_ranks(log_dir, mode, *extra):
    """Two ranks on a long run, a checkpoint only at the end; (launcher, rank pids) once training is under way."""
    args = [*TINY_CARTPOLE, "--mode", mode, "--total-timesteps", "10000000", "--sync-interval", "5"]
    return launch_ranks(SCRIPT, [*args, "--checkpoint-interval", "3600", *extra], log_dir)


def assert_rank_0_stands_in_for_rank_1(out, log_dir, mode):
    """The final checkpoint of a run whose rank 1 stalled, as rank 0's line says: rank 0's state, and its parameters
    (allreduce: with its optimizer state, which every rank shares) in rank 1's place."""
    which = "parameters and optimizer state" if mode == "allreduce" else "own parameters"
    assert f"the final checkpoint holds rank 0's {which}" in out and "; checkpoint written to " in out, out[-3000:]
    checkpoint = torch.load(only_run_dir(log_dir) / "checkpoint.pt", weights_only=False)
    own, stand_in = checkpoint["learners"]
    assert checkpoint["global_step"] > 0 and stand_in["iteration"] == own["iteration"] > 0
    assert all(torch.equal(own["model"][k], stand_in["model"][k]) for k in own["model"])
    assert ("optimizer" in stand_in) == (mode == "allreduce") and "generator" not in stand_in


def test_ctrl_c_with_a_stopped_rank_gives_the_summary(tmp_path):
    """Rank 1 stopped (SIGSTOP), Ctrl+C to the launcher: rank 0, waiting for rank 1 in an all-reduce, still stops,
    names the rank that did not join, writes the final checkpoint from its own state and prints the summary."""
    proc, pids = launch_two_ranks(tmp_path, "allreduce")
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
    assert "rank 0: rank 1 did not join the " in out, out[-3000:]
    assert_rank_0_stands_in_for_rank_1(out, tmp_path, "allreduce")


@pytest.mark.parametrize("mode", ["gossip", "allreduce"])
def test_a_stopped_rank_stops_the_run_with_a_line_naming_it(mode, tmp_path):
    """Rank 1 stopped (SIGSTOP) and nothing else: rank 0 gives up after --rank-timeout with a line naming rank 1, and
    writes the final checkpoint from its own state."""
    proc, pids = launch_two_ranks(tmp_path, mode, "--rank-timeout", "5")
    seen: list[str] = []
    try:
        os.kill(pids[1], signal.SIGSTOP)
        read_until(proc, "stopped (exit status 1)", seen)
        os.kill(pids[1], signal.SIGCONT)
        seen.append(proc.communicate(timeout=120)[0])
    finally:
        end_launch(proc, pids)
    out = "".join(seen)
    # every wait of rank 0 for rank 1 is its own polled one, never a blocking gloo call: its line names rank 1
    assert re.search(r"error: rank 0: rank 1 (did not join|sent no gossip message) .* within 5 s", out), out[-3000:]
    assert proc.returncode != 0
    assert_rank_0_stands_in_for_rank_1(out, tmp_path, mode)


def rank_beside_a_peer_that_stalls(rank, port, part, stop_first, results):
    """One of two gloo ranks on localhost. Rank 1 does its share of `part` only up to where a rank stopped by SIGSTOP
    would stall: at a sync point where a checkpoint is due ("sync point") it joins the flags' all-reduce and nothing
    after; at the end of a gossip run ("last gossip") it joins the gossip group and sends no last message. Rank 0
    (--rank-timeout 2, its stop event set from the start or never) puts how its share ended on `results`."""
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(hours=1))  # fmt: skip  # only rank 0's own wait can end it
    group = dist.new_group(backend="gloo") if part == "last gossip" else None
    if rank == 1:
        if part == "sync point":
            dist.all_reduce(torch.tensor([0.0, 1.0]))  # no stop; a checkpoint is due
        threading.Event().wait()  # stalled
    stop = threading.Event()
    if stop_first:
        stop.set()
    try:
        if part == "sync point":
            run = SimpleNamespace(args=Args(rank_timeout=2.0), rank=0, device=torch.device("cpu"), world_size=2)
            logger = SimpleNamespace(handle=lambda record: None, maybe_print=lambda: None)
            learner = SimpleNamespace(iteration=5, record=lambda: Record(0, 40, 1.0, [], {}), state=lambda: {})
            RankLink(run, stop, logger).after_iteration(learner, at_sync=True)
        else:
            DistributedEndpoint(0, 2, 1, 0, 4, torch.device("cpu"), group, stop, 2.0).finish(torch.zeros(4), 3)
        results.put("returned")
    except Exception as e:
        results.put(f"{type(e).__name__}: {e}")


@pytest.mark.parametrize("stop_first", [False, True], ids=["rank-timeout", "stop"])
@pytest.mark.parametrize("part", ["sync point", "last gossip"])
def test_a_peer_that_stalls_mid_exchange_is_named_and_a_stop_does_not_wait_for_it(part, stop_first):
    """A peer that stalls after the first collective of a sync point where a checkpoint is due, or before its last
    gossip message: rank 0 is never held in a blocking call that the peer will not join (deaf to Ctrl+C there): it
    names the peer after --rank-timeout, or stops 5 s after its stop. The deadline only catches a rank 0 that hangs."""
    results, port = CTX.Queue(), gala_a2c.free_port()
    ranks = [CTX.Process(target=rank_beside_a_peer_that_stalls, args=(r, port, part, stop_first, results), daemon=True)
             for r in (0, 1)]  # fmt: skip
    for p in ranks:
        p.start()
    try:
        outcome = results.get(timeout=120)
    except queue.Empty:
        outcome = "still waiting after 120 s"
    finally:
        for p in ranks:
            p.kill()
            p.join()
    what = "the gather of the states for a checkpoint" if part == "sync point" else "the exchange of the last gossip"
    expected = "Stop: " if stop_first else f"RankLost: rank 0: rank 1 did not join {what}"
    assert outcome.startswith(expected), outcome


def test_killing_the_launcher_stops_its_ranks_with_a_checkpoint(tmp_path):
    """kill -9 of the torchrun launcher: its ranks (in their own sessions, reparented) stop as on SIGTERM, together
    at a sync point, with the final checkpoint; none is left running."""
    proc, pids = launch_two_ranks(tmp_path, "gossip")
    try:
        os.kill(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate(timeout=60)  # the ranks hold the pipe: it ends when both have exited
        wait_for(lambda: not any(alive(pid) for pid in pids), "no rank left running")
    finally:
        end_launch(proc, pids)
    assert "the torchrun launcher" in out and "is gone" in out, out[-3000:]
    assert torch.load(only_run_dir(tmp_path) / "checkpoint.pt", weights_only=False)["global_step"] > 0


def writing_to_a_full_pipe(pids):
    """One of `pids` has a thread in a write to a pipe that has no room left (its kernel wait, /proc's wchan)."""
    waits = []
    for pid in pids:
        for task in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError):
                waits.append(open(f"/proc/{pid}/task/{task}/wchan").read())
    return any("pipe_write" in w for w in waits)


def test_learners_killed_half_way_through_their_final_state_still_let_main_stop(tmp_path):
    """A learner's State (its model and optimizer, 84 KB for this net) is larger than a pipe holds: with main paused
    (SIGSTOP) the learners finish their budget (5 small Records each before it) and the first one's final State fills
    log_q's pipe half way. Both learners killed there, main continued: it names the death and exits, where a read of
    that half message would block it forever (the reader is a thread of its own, and main waits 5 s for the message
    that cannot come)."""
    proc = start_run(SCRIPT, [*TINY_CARTPOLE, "--total-timesteps", "40000", "--checkpoint-interval", "0",
                              "--eval-episodes", "0", "--log-frequency", "200"], tmp_path)  # fmt: skip
    learners = children_of(proc.pid)
    assert len(learners) == 2, learners
    os.kill(proc.pid, signal.SIGSTOP)
    try:
        wait_for(lambda: writing_to_a_full_pipe(learners), "a learner's final State to fill the pipe", timeout=300)
        for pid in learners:
            os.kill(pid, signal.SIGKILL)
    finally:
        os.kill(proc.pid, signal.SIGCONT)
    try:
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 1, err
    assert re.search(r"error: learner \d died \(killed by signal 9\)", err) and "Traceback" not in err, err
