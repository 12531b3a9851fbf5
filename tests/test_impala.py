"""impala_monobeast.py: V-trace against a slow loop from its definition, the buffer protocol (ownership ledger, distinct
rollouts, row 0 carried over) with real actor processes, both inference modes end-to-end on CartPole and Breakout, the
LSTM core, the policy lag the architecture allows, --track (one offline W&B run for the main process and its actors),
--eval-only (the saved agent with the inputs and LSTM it was trained with), bad flags, a crashing or killed actor, and
clean shutdown. A run that needs no process of its own (nothing to signal or kill) calls main in the test's process."""

import json
import math
import multiprocessing as mp
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers import (
    CORE_TAGS,
    FakeWandb,
    FixedLogitsPolicy,
    RecordingEnv,
    alive,
    assert_documented_tags,
    assert_eval_only_refusals,
    assert_finite_tags,
    assert_one_error_line,
    assert_tracked_once,
    children_of,
    fill_disk,
    offline_wandb_env,
    only_run_dir,
    run_eval_only,
    run_script,
    scalars,
    small_tmpfs,
    start_run,
    wait_for,
    write_unusable_checkpoint,
)

import impala_monobeast as im

SCRIPT = "impala_monobeast.py"
TINY_CARTPOLE = ["--env-id", "CartPole-v1", "--unroll-length", "16", "--batch-size", "2", "--num-actors", "2",
                 "--log-interval", "1"]  # fmt: skip


# ------------------------------------------------------------------ V-trace against the paper's definition


def vtrace_reference(mu_logp, pi_logp, rewards, values, dones, next_value, gamma, rho_bar, c_bar, pg_rho_bar):
    """Espeholt et al. 2018, Eq. 1, one scalar sequence at a time: v_s = V(x_s) + sum_{t>=s} (prod_{i=s}^{t-1} gamma_i
    c_i) rho_t delta_t V with rho_t = min(rho_bar, pi/mu), c_i = min(c_bar, pi/mu), gamma_i = gamma (1 - done_i); the
    policy-gradient advantage is min(pg_rho_bar, pi/mu) (r_s + gamma_s v_{s+1} - V(x_s)). Inputs [T, ...]."""
    T = rewards.shape[0]
    flat = [np.asarray(x, dtype=np.float64).reshape(T, -1) for x in (mu_logp, pi_logp, rewards, values, dones)]
    mu, pi, r, v, d = flat
    nv = np.asarray(next_value, dtype=np.float64).reshape(-1)
    vs, pg = np.zeros_like(r), np.zeros_like(r)
    for b in range(r.shape[1]):
        ratio = [math.exp(pi[t, b] - mu[t, b]) for t in range(T)]
        V = [*v[:, b], nv[b]]
        disc = [gamma * (1 - d[t, b]) for t in range(T)]
        col = []
        for s in range(T):
            total, trace = 0.0, 1.0
            for t in range(s, T):
                total += trace * min(rho_bar, ratio[t]) * (r[t, b] + disc[t] * V[t + 1] - V[t])
                trace *= disc[t] * min(c_bar, ratio[t])
            col.append(V[s] + total)
        col.append(nv[b])
        for s in range(T):
            vs[s, b] = col[s]
            pg[s, b] = min(pg_rho_bar, ratio[s]) * (r[s, b] + disc[s] * col[s + 1] - V[s])
    return vs.reshape(rewards.shape), pg.reshape(rewards.shape)


@pytest.mark.parametrize(
    ("rho_bar", "c_bar", "pg_rho_bar"), [(1.0, 1.0, 1.0), (0.7, 1.3, 0.9), (2.0, 0.5, 5.0), (0.3, 0.8, 1.0)]
)
@pytest.mark.parametrize("shape", [(9, 4), (9, 3, 2)])  # time-major, with and without an extra trailing dimension
def test_vtrace_matches_definition(rho_bar, c_bar, pg_rho_bar, shape):
    rng = np.random.default_rng(hash((rho_bar, shape)) % 2**32)
    mu, pi = rng.normal(size=shape) - 1.0, rng.normal(size=shape) - 1.0
    ratio = np.exp(pi - mu)
    assert (ratio > 1.3).any() and (ratio < 0.5).any()  # the truncations matter
    rewards, values = rng.normal(size=shape), rng.normal(size=shape)
    dones = (rng.random(size=shape) < 0.2).astype(np.float64)
    dones[-1].flat[0] = 1.0
    next_value = rng.normal(size=shape[1:])
    t = lambda x: torch.tensor(x, dtype=torch.float64)  # noqa: E731
    vs, pg = im.vtrace(t(mu), t(pi), t(rewards), t(values), t(dones), t(next_value), 0.99, rho_bar, c_bar, pg_rho_bar)
    want_vs, want_pg = vtrace_reference(mu, pi, rewards, values, dones, next_value, 0.99, rho_bar, c_bar, pg_rho_bar)
    np.testing.assert_allclose(vs.numpy(), want_vs, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(pg.numpy(), want_pg, rtol=1e-10, atol=1e-10)


def test_vtrace_on_policy_is_the_n_step_return():
    rewards, values = torch.tensor([[1.0], [0.0], [2.0]]), torch.tensor([[0.5], [0.3], [-1.0]])
    logp, dones = torch.zeros(3, 1), torch.zeros(3, 1)
    vs, _ = im.vtrace(logp, logp, rewards, values, dones, torch.tensor([4.0]), 0.9, 1.0, 1.0, 1.0)
    assert vs[0, 0].item() == pytest.approx(1 + 0.81 * 2 + 0.729 * 4)


def test_loss_is_summed_and_lr_decays_linearly_to_zero():
    out = im.impala_loss(torch.tensor([[-1.0, -2.0]]), torch.tensor([[0.5, 1.5]]), torch.tensor([[1.0, 0.0]]),
                         torch.tensor([[2.0, 2.0]]), torch.tensor([[1.0, -1.0]]), 0.5, 0.01)  # fmt: skip
    assert out["policy_loss"].item() == pytest.approx(-1.0)  # -(-1 * 1 + -2 * -1)
    assert out["value_loss"].item() == pytest.approx(0.5 * (1 + 4))
    assert out["total_loss"].item() == pytest.approx(-1.0 + 0.5 * 2.5 - 0.01 * 2.0)
    assert im.linear_lr(1.0, 0, 100) == 1.0 and im.linear_lr(1.0, 25, 100) == 0.75 and im.linear_lr(1.0, 200, 100) == 0


# ------------------------------------------------------------------ the buffer protocol with real actor processes


def cartpole_model():
    from common.atari import make_vector_env
    from common.models import make_model

    probe = make_vector_env("CartPole-v1", 1, 0)
    model = make_model(probe.single_observation_space, probe.single_action_space)
    probe.close()
    return model


@pytest.mark.parametrize("inference", ["actor", "batched"])
def test_buffer_protocol_with_real_actors(inference):
    """Real actor processes and the script's get_batch / inference thread; this test is the learner. Every index is
    in exactly one place at all times (the ledger, sampled continuously, and the queues drained at the end); a batch
    holds batch_size distinct rollouts; row 0 of a rollout equals the last row of that actor's previous rollout."""
    args = im.Args(env_id="CartPole-v1", unroll_length=6, num_actors=3, batch_size=2, inference=inference)
    M, K, T, B = args.num_actors, 5, args.unroll_length, args.batch_size
    buffers = im.Buffers.allocate(K, T, 1, (4,), torch.float32, 2, (1, 1))
    ctx = mp.get_context("fork")
    queues = im.Queues.create(ctx, buffers)
    acting = im.ActingModel(cartpole_model(), torch.zeros(1, dtype=torch.int64).share_memory_(), threading.Lock())
    threads, failures = [], []
    if inference == "actor":
        acting.model.share_memory()
        policies = [im.CopyPolicy(acting, 1) for i in range(M)]
    else:
        slots = im.Buffers.allocate(M, 0, 1, (4,), torch.float32, 2, (1, 1))
        requests, sems = im.RequestPipe(), [ctx.Semaphore(0) for _ in range(M)]
        server = im.InferenceServer(acting, slots, requests, sems, M, torch.device("cpu"), queues.stop, failures)
        policies = [im.BatchedPolicy(i, server) for i in range(M)]
        threads.append(threading.Thread(target=server.run, daemon=True))
    actors = [ctx.Process(target=im.actor_process, args=(i, args, 10 + i, buffers, queues, policies[i]), daemon=True)
              for i in range(M)]  # fmt: skip
    for t in [*actors, *threads]:
        t.start()

    valid = set(range(M)) | {im.FREE_QUEUE, im.FULL_QUEUE, im.LEARNER}
    violations, watching = [], threading.Event()

    def watch():  # the ledger at many instants: one owner per index, an actor holds at most one index
        while not watching.is_set():
            snapshot = buffers.ledger.tolist()
            held = [o for o in snapshot if o >= 0]
            if not set(snapshot) <= valid or len(held) != len(set(held)):
                violations.append(snapshot)
            time.sleep(0.0005)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    last_row, counts, batch_lock = {}, {}, threading.Lock()
    try:
        for _ in range(25):
            batch, indices = im.get_batch(buffers, queues, B, batch_lock)
            assert len(set(indices)) == B
            pairs = list(zip(batch.actor_id.tolist(), batch.rollout.tolist(), strict=True))
            assert len(set(pairs)) == B  # distinct rollouts
            for col, (actor, count) in enumerate(pairs):
                rows = {k: getattr(batch, k)[:, col] for k in im.ROW_KEYS}
                if actor in last_row:
                    assert count == counts[actor] + 1  # an actor's rollouts arrive in order
                    for k, v in rows.items():
                        assert torch.equal(v[0], last_row[actor][k]), k
                else:
                    assert count == 1 and bool(rows["done"][0].all())  # the first rollout starts an episode
                last_row[actor], counts[actor] = {k: v[-1].clone() for k, v in rows.items()}, count
            acting.version += 1
        assert len(last_row) >= 2  # rollouts of several actors were checked
    finally:
        queues.stop.set()
        for p in actors:
            p.join(timeout=60)
        if inference == "batched":
            requests.put(im.RequestPipe.WAKE)
        for t in threads:
            t.join(timeout=60)
        watching.set()
        watcher.join()
        if inference == "batched":
            requests.close()
    assert all(p.exitcode == 0 for p in actors) and not failures  # 1: an actor died of an exception
    assert not violations, violations[:3]
    drained = {"free": [], "full": []}
    for name, q in (("free", queues.free), ("full", queues.full)):
        while True:
            try:
                drained[name].append(q.get(timeout=2.0))
            except Exception:
                break
    held = [i for i, o in enumerate(buffers.ledger.tolist()) if o >= 0]
    everywhere = drained["free"] + drained["full"] + held
    assert sorted(everywhere) == list(range(K)), drained  # each index in exactly one place
    assert all(buffers.ledger[i] == im.FREE_QUEUE for i in drained["free"])
    assert all(buffers.ledger[i] == im.FULL_QUEUE for i in drained["full"])


# ------------------------------------------------------------------ what the actors store is what the learner sees


@pytest.mark.parametrize("use_lstm", [False, True])
def test_learner_sees_the_actors_inputs_and_raw_rewards(use_lstm, monkeypatch):
    """One real actor process on Space Invaders (5..30 points per alien). Its rows carry the raw rewards and last
    action a_{t-1} (0 at its first observation, TorchBeast's `Environment.initial`); the learner, fed the same rows,
    recomputes the actor's logits exactly (same parameters); and the loss gets the raw rewards with
    --no-clip-rewards, the clipped ones by default."""
    args = im.Args(env_id="ALE/SpaceInvaders-v5", unroll_length=40, num_actors=1, batch_size=1, inference="actor",
                   use_lstm=use_lstm)  # fmt: skip
    from common.atari import make_vector_env
    from common.models import make_model

    probe = make_vector_env(args.env_id, 1, 0, num_threads=1)
    obs_space, act_space = probe.single_observation_space, probe.single_action_space
    probe.close()
    torch.manual_seed(0)
    if use_lstm:  # AtariNet's core is 2 layers as wide as its input; a narrower one, cheaper on CPU, runs below
        atari_net = make_model(obs_space, act_space, "nature", **im.model_options(args))
        assert (atari_net.core.num_layers, atari_net.core.hidden_size) == (2, 512 + 1 + 6)
        args.lstm_size = 32
    model = make_model(obs_space, act_space, "nature", **im.model_options(args), channels_last=False)
    assert model.action_reward_inputs  # TorchBeast's inputs are the default
    lstm = (model.core.num_layers, model.core.hidden_size) if use_lstm else (1, 1)
    T, K = args.unroll_length, 3
    buffers = im.Buffers.allocate(K, T, 1, obs_space.shape, torch.uint8, int(act_space.n), lstm)
    queues = im.Queues.create(mp.get_context("fork"), buffers)
    model.share_memory()
    acting = im.ActingModel(model, torch.zeros(1, dtype=torch.int64).share_memory_(), threading.Lock())
    actor = mp.get_context("fork").Process(
        target=im.actor_process, args=(0, args, 3, buffers, queues, im.CopyPolicy(acting, 1)), daemon=True
    )
    actor.start()
    batches, wanted = [], 2 if use_lstm else 12  # the rewards are checked once, without the LSTM
    try:
        while len(batches) < wanted and not any(b.reward.max() > 1 for b in batches):
            batches.append(im.get_batch(buffers, queues, 1, threading.Lock())[0])
    finally:
        queues.stop.set()
        actor.join(timeout=10)
    assert actor.exitcode == 0  # 1: it died of an exception
    first = batches[0]
    assert first.done[0].all() and first.last_action[0].eq(0).all() and first.reward[0].eq(0).all()
    for batch in batches:
        assert torch.equal(batch.last_action[1:], batch.action[:-1])
        with torch.no_grad():
            logits, values = im.learner_outputs(model, batch)
        np.testing.assert_allclose(logits, batch.logits, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(values, batch.baseline, rtol=1e-4, atol=1e-5)
    if use_lstm:
        return
    batch = batches[-1]
    raw = batch.reward[1:]
    assert raw.max() > 1, "no alien hit in 12 rollouts"
    seen = []
    vtrace = im.vtrace
    monkeypatch.setattr(im, "vtrace", lambda *a, **kw: (seen.append(a[2].clone()), vtrace(*a, **kw))[1])
    for clip in (False, True):
        args.clip_rewards = clip
        im.vtrace_losses(model, batch, args, torch.device("cpu"))
    torch.testing.assert_close(seen[0], raw)
    torch.testing.assert_close(seen[1], raw.clamp(-1, 1))


# ------------------------------------------------------------------ running the script


@pytest.fixture
def run_main(tmp_path, capsys, monkeypatch):
    """`im.main` on a command line, in this process (no interpreter start-up to pay), as a CompletedProcess. What main
    sets process-wide is put back afterwards: torch's threads, determinism and RNG, the GIL switch interval, the
    threading excepthook."""
    monkeypatch.setattr(threading, "excepthook", threading.excepthook)
    monkeypatch.setattr(torch.backends.cudnn, "deterministic", torch.backends.cudnn.deterministic)
    saved = (torch.get_num_threads(), sys.getswitchinterval(), torch.are_deterministic_algorithms_enabled(),
             torch.is_deterministic_algorithms_warn_only_enabled(), torch.get_rng_state())  # fmt: skip

    def run_main(argv):
        try:
            im.main(im.parse_args(["--log-dir", str(tmp_path), *argv]))
            code = 0
        except SystemExit as e:
            code = e.code
        out, err = capsys.readouterr()
        return subprocess.CompletedProcess(argv, code, out, err)

    yield run_main
    torch.set_num_threads(saved[0])
    sys.setswitchinterval(saved[1])
    torch.use_deterministic_algorithms(saved[2], warn_only=saved[3])
    torch.set_rng_state(saved[4])


REQUIRED_TAGS = [*CORE_TAGS, "timing/full_queue_get", "timing/free_queue_get", "timing/train"]
BATCHED_TAGS = ["timing/inference_wait", "timing/inference_batch_size"]


def one_actor_lag_bound(num_buffers, batch_size, unroll_length):
    """The largest `charts/policy_lag` (updates between acting and learning, averaged over a batch's rows 0..T-1) one
    actor and one learner thread allow. With K buffers and batches of B rollouts: when the actor takes a buffer for its
    rollout n, the other K - 1 buffers hold at most K - 1 rollouts not yet dequeued, so at least n - K rollouts were
    dequeued in whole batches, and every one of those batches but the one in training was learned. Rollout n is learned
    in batch ceil(n / B), at most ceil(n / B) - ceil((n - K) / B) <= ceil(K / B) updates after it took its buffer: the
    bound of rows 1..T, acted after the take. Row 0 is the previous rollout's row T, acted after the previous take:
    ceil((K + 1) / B). Both maxima are reached in some schedule."""
    K, B, T = num_buffers, batch_size, unroll_length
    return (math.ceil((K + 1) / B) + (T - 1) * math.ceil(K / B)) / T


def test_cartpole_end_to_end_batched_one_actor(tmp_path, run_main):
    """Batched inference with one actor and one learner thread: every tag, the step count, the lr schedule, the
    evaluation, TorchBeast's network inputs, and a policy lag never above what the buffers allow."""
    proc = run_main([*TINY_CARTPOLE, "--num-actors", "1", "--num-learner-threads", "1", "--total-timesteps", "320",
                     "--eval-episodes", "2", "--save-model"])  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    run_dir = only_run_dir(tmp_path)
    logged = scalars(run_dir)
    assert_finite_tags(logged, [*REQUIRED_TAGS, *BATCHED_TAGS, "eval/episodic_return"])
    assert_documented_tags("impala_monobeast.py", logged)
    assert [s for s, _ in logged["charts/SPS"]] == [32 * i for i in range(1, 11)]
    lrs = [v for _, v in logged["charts/learning_rate"]]
    assert lrs[0] == pytest.approx(0.00048) and lrs[-1] == pytest.approx(0.00048 * 32 / 320)
    bound = one_actor_lag_bound(num_buffers=2, batch_size=2, unroll_length=16)  # K = max(2 x 1 actor, batch 2)
    assert max(v for _, v in logged["charts/policy_lag"]) <= bound
    assert len(logged["eval/episodic_return"]) == 2
    # TorchBeast's inputs by default: 4 observation features, the clipped reward, a one-hot of 2 actions
    assert torch.load(run_dir / "model.pt")["policy.0.weight"].shape == (64, 4 + 1 + 2)
    # the console: the start line with the plan, the last update's line (always printed), the summary with its files
    plan = "10 updates of 32 agent steps, 1 actors x 1 envs, batched inference, mlp network, 2 buffers, cpu"
    assert proc.stdout.startswith(f"run directory: {run_dir}  ({plan})\n"), proc.stdout[:300]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("global_step=")]
    assert lines and lines[-1].startswith("global_step=320 SPS="), proc.stdout
    assert " done=100.0% left=0s update=10/10 policy_lag=" in lines[-1], lines[-1]
    assert "\nfinished: 320 of 320 agent steps in " in proc.stdout, proc.stdout
    assert f"wrote to {run_dir}: args.json, checkpoint.pt, events.out.tfevents." in proc.stdout, proc.stdout
    assert proc.stdout.rstrip().endswith(f"python {SCRIPT} --eval-only {run_dir / 'model.pt'}"), proc.stdout[-300:]
    # --eval-only replays the run's own (greedy) evaluation: same agent, TorchBeast's inputs included, same seed
    proc = run_main(["--eval-only", str(run_dir / "model.pt"), "--eval-episodes", "2"])
    assert proc.returncode == 0, proc.stderr
    report = json.loads(next(run_dir.glob("eval-*.json")).read_text())
    assert report["returns"] == [v for _, v in logged["eval/episodic_return"]] and report["greedy"] is True
    assert report["settings"]["action_reward_inputs"] is True and report["settings"]["network"] == "mlp"


def test_evaluation_takes_argmax_actions_by_default_and_samples_with_no_eval_greedy(monkeypatch, tmp_path):
    """TorchBeast's test mode (AtariNet in eval mode) takes the argmax action, whose probability here is about 0.34."""
    agent = FixedLogitsPolicy(torch.tensor([0.0, 0.4, 0.8, 0.2]))
    agent.forward = lambda obs, last_action, reward: FixedLogitsPolicy.forward(agent, obs)  # TorchBeast's inputs
    agent.core = None
    for flags, greedy in [([], True), (["--no-eval-greedy"], False)]:
        env = RecordingEnv(length=25)
        monkeypatch.setattr(im, "make_env", lambda *a, env=env, **k: env)
        args = im.parse_args(["--env-id", "CartPole-v1", "--eval-episodes", "4", *flags])
        assert list(im.evaluate(agent, args, tmp_path, torch.device("cpu"))) == [25.0] * 4
        assert len(env.actions) == 100
        if greedy:
            assert set(env.actions) == {2}
        else:
            assert set(env.actions) == {0, 1, 2, 3} and 15 <= env.actions.count(2) <= 55


# MonoBeast's acting with model options other than the defaults, which --eval-only must take from the run
LSTM_OPTIONS = ["--use-lstm", "--lstm-size", "8", "--lstm-layers", "1", "--no-action-reward-inputs"]


@pytest.fixture(scope="module")
def tracked_run(tmp_path_factory):
    """One tracked (offline W&B) CartPole run, two actors with MonoBeast's acting and an LSTM, with --save-model, a
    final checkpoint and two evaluation episodes: (its run directory, its W&B directory)."""
    log_dir, wandb_dir = tmp_path_factory.mktemp("runs"), tmp_path_factory.mktemp("wandb")
    flags = [*TINY_CARTPOLE, "--inference", "actor", *LSTM_OPTIONS, "--total-timesteps", "480", "--track"]
    flags += ["--save-model", "--eval-episodes", "2", "--checkpoint-interval", "3600"]
    proc = run_script(SCRIPT, flags, log_dir, env=offline_wandb_env(wandb_dir))
    assert proc.returncode == 0, proc.stderr
    return only_run_dir(log_dir), wandb_dir


def test_tracked_run_with_two_actors_logs_once_and_saves_its_args(tracked_run):
    """--track: the main process alone logs to W&B (one run for it and its two actor processes); args.json holds what
    --eval-only needs."""
    run_dir, wandb_dir = tracked_run
    assert_finite_tags(scalars(run_dir), [*REQUIRED_TAGS, "eval/episodic_return"])
    tracked = assert_tracked_once(wandb_dir, run_dir)
    assert tracked.config["num_actors"] == 2 and tracked.config["inference"] == "actor" and tracked.config["use_lstm"]
    saved = json.loads((run_dir / "args.json").read_text())
    assert saved["script"] == SCRIPT and saved["args"]["lstm_size"] == 8 and saved["meta"]["network"] == "mlp"


def test_eval_only_replays_the_saved_agent_with_the_network_it_was_trained_with(tracked_run, tmp_path, run_main):
    """model.pt (in a subprocess, with its args.json) and checkpoint.pt (in process) get the LSTM and inputs of their
    run without a flag, and play the run's own greedy evaluation episodes again, then one more."""
    run_dir, _ = tracked_run
    proc, report = run_eval_only(SCRIPT, run_dir / "model.pt", tmp_path / "logs", "--eval-episodes", "3")
    assert proc.returncode == 0 and report is not None, proc.stderr
    assert report["episodes"] == 3 and report["greedy"] is True and report["model"] == str(run_dir / "model.pt")
    settings = dict(env_id="CartPole-v1", atari_protocol="deepmind", network="mlp", use_lstm=True, lstm_size=8,
                    lstm_layers=1, action_reward_inputs=False)  # fmt: skip
    assert report["settings"] == settings
    returns = report["returns"]
    assert len(returns) == 3 and all(math.isfinite(r) and r == int(r) and 8 <= r <= 500 for r in returns), returns
    assert returns[:2] == [v for _, v in scalars(run_dir)["eval/episodic_return"]]
    assert report["mean"] == pytest.approx(np.mean(returns))
    assert "from its run: env_id=CartPole-v1 atari_protocol=deepmind network=mlp use_lstm=True" in proc.stdout
    for written in run_dir.glob("eval-*.json"):  # named by the second: the next one may reuse the name
        written.unlink()
    proc = run_main(["--eval-only", str(run_dir / "checkpoint.pt"), "--eval-episodes", "3"])
    assert proc.returncode == 0 and "eval episode 2: return" in proc.stdout, proc.stderr
    (written,) = run_dir.glob("eval-*.json")
    assert json.loads(written.read_text())["returns"] == returns


def test_eval_only_refuses_what_it_cannot_evaluate(tracked_run, tmp_path, run_main):
    run_dir, _ = tracked_run
    assert_eval_only_refusals(SCRIPT, run_dir / "model.pt", tmp_path)  # other script, --env-id Acrobot-v1, garbage
    lonely = tmp_path / "lonely"
    lonely.mkdir()
    (lonely / "model.pt").write_bytes((run_dir / "model.pt").read_bytes())
    assert_one_error_line(run_main(["--eval-only", str(lonely / "model.pt")]), "cannot read its run's args.json")
    proc = run_main(["--eval-only", str(run_dir / "model.pt"), "--network", "nature"])
    assert_one_error_line(proc, "--network nature contradicts", "saved by a run with mlp")


def test_track_without_wandb_is_refused_by_validate(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ModuleNotFoundError
    error = im.validate(im.Args(env_id="CartPole-v1", track=True))
    assert error.startswith('--track needs wandb (pip install -e ".[track]"): ModuleNotFoundError'), error
    assert im.validate(im.Args(env_id="CartPole-v1")) is None


def test_tracking_names_the_run_after_its_directory_and_resumes_it(monkeypatch, tmp_path):
    """A --resume run continues the W&B run of its run directory (the same id)."""
    wandb = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    run_dir = tmp_path / "CartPole-v1__impala_monobeast__1__1700000000"
    (run_dir / "videos").mkdir(parents=True)
    (run_dir / "videos" / "rl-video-episode-0.mp4").write_bytes(b"")
    assert im.start_tracking(im.Args(env_id="CartPole-v1"), run_dir) is None and wandb.inits == []
    assert im.start_tracking(im.Args(env_id="CartPole-v1", track=True, wandb_entity="me"), run_dir) is wandb
    resumed = im.Args(env_id="CartPole-v1", track=True, resume=str(run_dir / "checkpoint.pt"))
    im.start_tracking(resumed, run_dir)
    first, second = wandb.inits
    assert first["name"] == second["name"] == run_dir.name and first["id"] == second["id"]
    assert first["resume"] is None and second["resume"] == "allow" and first["entity"] == "me"
    assert first["sync_tensorboard"] and first["config"]["env_id"] == "CartPole-v1" and first["config"]["track"]
    assert wandb.finished == []  # Run.training ends it with the exit status (test_reliability)


@pytest.mark.parametrize("lstm", [[], ["--use-lstm", "--lstm-size", "32"]])
def test_breakout_end_to_end_batched(lstm, tmp_path, run_main):
    # a narrow LSTM keeps the run cheap on CPU (AtariNet's width: test_learner_sees_the_actors_inputs_and_raw_rewards)
    proc = run_main(["--env-id", "ALE/Breakout-v5", *lstm, "--num-actors", "2", "--unroll-length", "20",
                     "--batch-size", "1", "--total-timesteps", "80"])  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    logged = scalars(only_run_dir(tmp_path))
    # no game ends in 80 steps
    assert_finite_tags(logged, [t for t in [*REQUIRED_TAGS, *BATCHED_TAGS] if not t.startswith("charts/episodic")])
    assert len(logged["losses/total_loss"]) == 4


def test_policy_lag_grows_with_the_number_of_actors_and_a_killed_actor_stops_the_run(tmp_path):
    """IMPALA Section 3: with more actors, more rollouts wait in the full queue while the learner trains. Six actors
    (12 buffers) lag well beyond the most one actor (2 buffers) can, whatever the scheduling. Then an actor killed with
    SIGKILL stops the run, naming it, with no process left."""
    proc = start_run(SCRIPT, ["--env-id", "CartPole-v1", "--inference", "actor", "--num-actors", "6", "--unroll-length",
                              "8", "--batch-size", "1", "--num-learner-threads", "1", "--total-timesteps", "100000000",
                              "--log-interval", "0.5"], tmp_path)  # fmt: skip
    for line in proc.stdout:  # 40 updates: the full queue fills within the first 12
        if line.startswith("global_step=") and int(line.split()[0].removeprefix("global_step=")) >= 320:
            break
    actors = children_of(proc.pid)
    assert len(actors) == 6
    os.kill(actors[0], signal.SIGKILL)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1, err
    assert "error: actor" in err and "killed by signal 9" in err, err
    wait_for(lambda: not any(alive(p) for p in actors), "no actor left (no orphans)")
    lags = [v for _, v in scalars(only_run_dir(tmp_path))["charts/policy_lag"]]
    six = float(np.mean(lags[len(lags) // 3 :]))  # after the start-up, when every actor has buffers in flight
    one_at_most = one_actor_lag_bound(num_buffers=2, batch_size=1, unroll_length=8)
    assert six > 2 * one_at_most, (six, one_at_most)


def test_bad_flags_one_line_error(tmp_path, capsys):
    cases = [
        (dict(env_id="ALE/Breakot-v5"), "did you mean ALE/Breakout-v5"),
        (dict(num_buffers=3), "--num-buffers (3) must be >="),
        (dict(atari_protocol="atari57"), "--atari-protocol must be one of"),
        (dict(learning_rate=-1.0), "--learning-rate must be > 0"),
        (dict(vf_coef=-1.0), "--vf-coef must be >= 0"),
        (dict(total_timesteps=10), "--total-timesteps 10 is below one update, 640 agent steps"),
        (dict(capture_video=True), "--capture-video records the evaluation episodes; add --eval-episodes N (N >= 1)"),
        (dict(resume="/nonexistent/checkpoint.pt"), "no such checkpoint"),
        (dict(num_envs_per_actor=4, max_inference_batch=2), "--max-inference-batch (2)"),
        (dict(lstm_layers=0), "--lstm-layers must be >= 1"),
        (dict(learning_rate=math.inf), "--learning-rate must be a finite number, got inf"),
        (dict(gamma=math.nan), "--gamma must be a finite number, got nan"),
        (dict(eval_only="/nonexistent/model.pt"), "--eval-only /nonexistent/model.pt: no such file"),
    ]
    for kwargs, message in cases:
        error = im.validate(im.Args(log_dir=str(tmp_path), **kwargs))
        assert error is not None and message in error and "\n" not in error, (kwargs, error)
    assert im.validate(im.Args()) is None
    # what only the env can tell, and tyro's and the renamed flags' exit 2, in-process
    with pytest.raises(SystemExit) as e:
        im.main(im.Args(env_id="Pendulum-v1", log_dir=str(tmp_path)))
    assert e.value.code == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: Pendulum-v1 has a continuous action space (Box(-2.0, 2.0, (1,), float32)); impala_monobeast.py handles "
        "Discrete action spaces only (for continuous actions: apex_ddpg.py)"
    ]
    for argv, message in ((["--entropy-cost", "0.01"], "error: --entropy-cost is now --ent-coef (see --help)"),
                          (["--baseline-cost=0.5"], "error: --baseline-cost is now --vf-coef (see --help)"),
                          (["--network", "resnet"], "resnet")):  # fmt: skip
        with pytest.raises(SystemExit) as e:
            im.parse_args(argv)
        assert e.value.code == 2 and message in capsys.readouterr().err, argv
    assert not any(Path(tmp_path).iterdir())  # nothing was created


def test_a_budget_below_one_update_is_refused():
    """One update takes --unroll-length x --batch-size x --num-envs-per-actor agent steps: one step short would learn
    nothing."""
    args = dict(env_id="CartPole-v1", unroll_length=16, batch_size=2, num_envs_per_actor=3, num_actors=1)
    assert im.validate(im.Args(**args, total_timesteps=96)) is None
    assert im.validate(im.Args(**args, total_timesteps=95)) == (
        "--total-timesteps 95 is below one update, 96 agent steps (--unroll-length x --batch-size x "
        "--num-envs-per-actor): the run would learn nothing; give at least 96"
    )


def test_flags_without_effect_in_a_run_are_named_in_one_warning_line_each(tmp_path, run_main):
    """Batched inference's batch limit with MonoBeast's acting, and the LSTM's shape without the LSTM: the run goes
    on, saying so; with the settings that use them, nothing is said."""
    assert im.ignored_flags(im.Args()) == []
    assert im.ignored_flags(im.Args(max_inference_batch=4, use_lstm=True, lstm_size=8, lstm_layers=1)) == []
    assert im.ignored_flags(im.Args(inference="actor", max_inference_batch=4, lstm_size=8, lstm_layers=1)) == [
        "--max-inference-batch 4 has no effect with --inference actor (each actor runs its own copy of the model)",
        "--lstm-size 8 has no effect without --use-lstm",
        "--lstm-layers 1 has no effect without --use-lstm",
    ]
    proc = run_main([*TINY_CARTPOLE, "--num-actors", "1", "--num-learner-threads", "1", "--total-timesteps", "32",
                     "--lstm-layers", "1", "--checkpoint-interval", "0"])  # fmt: skip
    assert proc.returncode == 0 and proc.stderr == "warning: --lstm-layers 1 has no effect without --use-lstm\n"
    assert "\nfinished: 32 of 32 agent steps in " in proc.stdout, proc.stdout


def test_bad_flag_exits_2_with_one_line(tmp_path):
    proc = run_script(SCRIPT, ["--env-id", "CartPole-v1", "--learning-rate", "-1"], tmp_path)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == ["error: --learning-rate must be > 0, got -1.0"]
    assert not any(Path(tmp_path).iterdir())


META = dict(script="impala_monobeast.py", algo=None, env_id="CartPole-v1", atari_protocol="deepmind", network="mlp",
            use_lstm=False, lstm_size=0, lstm_layers=2, action_reward_inputs=True, obs_shape=[4],
            action_shape_or_n=2)  # fmt: skip


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("garbage", "not a checkpoint this script can read (UnpicklingError: "),
        ("truncated", "not a checkpoint this script can read ("),
        ("no_meta", 'not a checkpoint this script can read (it has no "meta" entry)'),
        ("other_script", "it is a hts_a2c.py checkpoint (script hts_a2c.py), this run is script impala_monobeast.py"),
        ("other_env", "(env_id Acrobot-v1, obs_shape [6], action_shape_or_n 3), this run is env_id CartPole-v1, "),
    ],
)
def test_resume_refuses_a_checkpoint_it_cannot_continue(case, message, tmp_path, capsys):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    path = write_unusable_checkpoint(run_dir, case, META)
    before = path.read_bytes()
    with pytest.raises(SystemExit) as e:
        im.main(im.Args(env_id="CartPole-v1", log_dir=str(tmp_path / "logs"), resume=str(path)))
    assert e.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: cannot resume from {path}: ") and message in lines[0], lines
    assert list(run_dir.iterdir()) == [path] and path.read_bytes() == before  # no events file, checkpoint unchanged
    assert not (tmp_path / "logs").exists()


def test_resume_with_no_whole_update_left_is_refused(tmp_path, capsys):
    """A checkpoint after 10 updates of unroll_length x batch_size x envs per actor agent steps: a budget one step
    short of the next update holds no more of them (the run would end at once and call itself finished)."""
    args = im.Args(env_id="CartPole-v1", log_dir=str(tmp_path / "logs"))
    per = args.unroll_length * args.batch_size * args.num_envs_per_actor
    path = tmp_path / "checkpoint.pt"
    torch.save(dict(meta=META, global_step=10 * per), path)
    with pytest.raises(SystemExit) as e:
        im.main(im.Args(**vars(args) | dict(total_timesteps=11 * per - 1, resume=str(path))))
    assert e.value.code == 2 and capsys.readouterr().err == (
        f"error: cannot resume from {path}: its run did {10 * per} agent steps and --total-timesteps {11 * per - 1} "
        f"(whole updates of {per}) holds no more: the run would learn nothing; give at least {11 * per}\n"
    )
    assert list(tmp_path.iterdir()) == [path]


@pytest.mark.parametrize("log_dir", ["/proc/x", "a_file/runs"])
def test_unusable_log_dir_is_one_error_line(log_dir, tmp_path, capsys):
    (tmp_path / "a_file").write_text("")
    with pytest.raises(SystemExit) as e:
        im.main(im.Args(env_id="CartPole-v1", log_dir=log_dir if log_dir.startswith("/") else str(tmp_path / log_dir)))
    assert e.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: cannot create the run directory "), lines


def test_runs_started_in_the_same_second_get_their_own_directories(tmp_path, monkeypatch):
    monkeypatch.setattr(im.time, "time", lambda: 1700000000.5)
    args = im.Args(env_id="CartPole-v1", log_dir=str(tmp_path))
    dirs = [im.new_run_dir(args) for _ in range(3)]
    assert [d.name for d in dirs] == [f"CartPole-v1__impala_monobeast__1__1700000000{s}" for s in ("", "-2", "-3")]


def test_crashing_actor_stops_the_run_with_its_traceback(tmp_path):
    # a process of its own: the actor prints its traceback to the stderr it inherits, which capsys does not see
    proc = run_script(SCRIPT, ["--env-id", "tests.faulty_env:CrashingCartPole-v0", "--num-actors", "2",
                               "--unroll-length", "16", "--batch-size", "2", "--total-timesteps", "10000000"],
                      tmp_path)  # fmt: skip
    assert proc.returncode == 1
    assert "actor" in proc.stderr and "died" in proc.stderr and "injected env failure" in proc.stderr, proc.stderr


def start_training(tmp_path, extra=()):
    """A long CartPole run in the background, returned at its first update's console line."""
    return start_run(SCRIPT, [*TINY_CARTPOLE, "--total-timesteps", "100000000", "--log-interval", "0.1", *extra],
                     tmp_path)  # fmt: skip


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_stops_everything_with_checkpoint_and_resume_continues(sig, tmp_path, run_main):
    """A signal stops every process with a checkpoint at the last update. SIGINT's run (MonoBeast's acting with the
    LSTM core) is then resumed to its end: same run directory and step count, every tag, AtariNet's LSTM in model.pt."""
    lstm = ["--inference", "actor", "--use-lstm"] if sig == signal.SIGINT else ["--inference", "actor"]
    proc = start_training(tmp_path, ["--checkpoint-interval", "3600", *lstm])
    actors = children_of(proc.pid)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + sig and "Traceback" not in err, err
    wait_for(lambda: not any(alive(p) for p in actors), "no actor left (no orphans)")
    run_dir = only_run_dir(tmp_path)
    checkpoint = torch.load(run_dir / "checkpoint.pt", weights_only=False)
    stopped_at = checkpoint["global_step"]
    assert stopped_at > 0 and stopped_at == max(s for s, _ in scalars(run_dir)["charts/SPS"])
    assert checkpoint["args"]["ent_coef"] == 0.0006 and "entropy_cost" not in checkpoint["args"]
    if sig == signal.SIGINT:
        resumed = run_main([*TINY_CARTPOLE, *lstm, "--total-timesteps", str(stopped_at + 64), "--save-model",
                            "--resume", str(run_dir / "checkpoint.pt")])  # fmt: skip
        assert resumed.returncode == 0, resumed.stderr
        logged = scalars(run_dir)
        assert max(s for s, _ in logged["charts/SPS"]) == stopped_at + 64
        assert only_run_dir(tmp_path) == run_dir
        assert_finite_tags(logged, REQUIRED_TAGS)
        state = torch.load(run_dir / "model.pt")
        assert state["core.weight_ih_l0"].shape == (4 * 7, 7) and "core.weight_ih_l1" in state  # AtariNet's 2 x 7 LSTM


def test_non_finite_loss_stops_and_keeps_last_checkpoint(tmp_path, run_main):
    # --no-action-reward-inputs: the NaN reward must reach the loss, not the network's reward input first
    proc = run_main(["--env-id", "tests.faulty_env:NaNCartPole-v0", "--num-actors", "1", "--unroll-length", "16",
                     "--batch-size", "1", "--num-learner-threads", "1", "--total-timesteps", "10000000",
                     "--checkpoint-interval", "0.000001", "--no-clip-rewards",
                     "--no-action-reward-inputs"])  # fmt: skip
    assert proc.returncode == 1
    assert "non-finite loss" in proc.stderr, proc.stderr
    checkpoint = torch.load(only_run_dir(tmp_path) / "checkpoint.pt", weights_only=False)
    assert 0 < checkpoint["update"] and all(torch.isfinite(v).all() for v in checkpoint["model"].values())


def test_weights_made_non_finite_by_an_update_stop_the_run_with_one_line(tmp_path, run_main):
    """A finite loss whose step (--learning-rate 1e38) leaves infinite weights: the learner stops the run before any
    actor or the inference thread acts with them, in one error line (no traceback, no dead actor), and the checkpoint
    of the run it resumed stays as it was. The resumed runs in processes of their own: a dying actor prints to the
    stderr it inherits."""
    flags = [*TINY_CARTPOLE, "--num-actors", "1", "--num-learner-threads", "1"]
    assert run_main([*flags, "--total-timesteps", "32", "--checkpoint-interval", "3600"]).returncode == 0
    saved, checkpoint = only_run_dir(tmp_path) / "checkpoint.pt", tmp_path / "copy" / "checkpoint.pt"
    checkpoint.parent.mkdir()  # a copy: this process holds the lock of the run's directory
    shutil.copy(saved, checkpoint)
    before = checkpoint.read_bytes()
    for inference in ("batched", "actor"):
        proc = run_script(SCRIPT, [*flags, "--inference", inference, "--learning-rate", "1e38", "--total-timesteps",
                                   "10000000", "--resume", str(checkpoint)], tmp_path / "logs")  # fmt: skip
        assert proc.returncode == 1 and "Traceback" not in proc.stderr, (inference, proc.stderr)
        warning, error = proc.stderr.strip().splitlines()  # --learning-rate's warning (flag_warnings), the error
        assert warning.startswith("warning: --learning-rate 1e+38 is above 1"), proc.stderr
        assert error == ("error: non-finite weights after update 2 (learning rate 1e+38) in learner thread 0 at global "
                         "step 32; stopping (the last good checkpoint, if any, is kept)"), proc.stderr  # fmt: skip
        assert checkpoint.read_bytes() == before


def test_killing_the_main_process_leaves_no_actor_behind(tmp_path):
    proc = start_training(tmp_path, ["--inference", "actor"])
    actors = children_of(proc.pid)
    assert len(actors) >= 2
    proc.kill()
    proc.communicate(timeout=60)
    try:  # each actor dies with its parent (PR_SET_PDEATHSIG), none lives on reparented to init
        wait_for(lambda: not any(alive(p) for p in actors), "the actors to die with the main process")
    finally:
        for p in actors:
            if alive(p):
                os.kill(p, signal.SIGKILL)


def test_full_disk_stops_cleanly_and_keeps_the_last_checkpoint(tmp_path):
    with small_tmpfs(tmp_path / "disk", "4m") as disk:
        proc = start_training(disk, ["--checkpoint-interval", "0.2"])
        actors = children_of(proc.pid)
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
        wait_for(lambda: not any(alive(p) for p in actors), "no actor left (no orphans)")
