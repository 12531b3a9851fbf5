"""a3c_large_batch.py: n-step returns, the A3C loss and the shared RMSprop against independent references; Hogwild and
gradient-server pushes from two processes; end-to-end runs in both update modes with the policy lag each predicts;
--track (one offline W&B run for a multi-worker run) and --eval-only; a killed or crashing worker; SIGINT / SIGTERM
shutdown with checkpoint and resume; bad flags.

Runs that end by themselves call `main` in this process (`run_main`: the workers fork from it, no interpreter start-up
per run); runs that must be killed or signalled, and one bad-flag run, are subprocesses."""

import json
import math
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import numpy as np
import pytest
import torch
import tyro
from helpers import (
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
    fill_disk,
    offline_wandb_env,
    only_run_dir,
    processes_with,
    run_eval_only,
    run_script,
    scalars,
    small_tmpfs,
    start_run,
    wait_for,
    write_unusable_checkpoint,
)
from torch import nn

import a3c_large_batch as a3c
from a3c_large_batch import (
    Args,
    SaveCheckpoint,
    Shared,
    SharedRMSprop,
    Update,
    a2c_loss,
    finish_tracking,
    flatten,
    gradient_server,
    main,
    n_step_returns,
    push,
    start_tracking,
    validate,
)

SCRIPT = "a3c_large_batch.py"
TINY_CARTPOLE = ["--env-id", "CartPole-v1", "--num-workers", "2", "--num-envs-per-worker", "4", "--log-interval", "1"]
CARTPOLE = dict(env_id="CartPole-v1", num_workers=2, num_envs_per_worker=4, log_interval=1.0)  # TINY_CARTPOLE's Args
CTX = multiprocessing.get_context("fork")


# ------------------------------------------------------------------ references written from the definitions


def n_step_reference(rewards, dones, bootstrap, gamma):
    """R_t = sum_{k=t}^{T-1} gamma^{k-t} r_k [no episode end in t..k-1] + gamma^{T-t} V(s_T) [no end in t..T-1]."""
    T, B = rewards.shape
    out = np.zeros((T, B))
    for b in range(B):
        for t in range(T):
            total, alive = 0.0, True
            for k in range(t, T):
                total += gamma ** (k - t) * rewards[k, b]
                if dones[k, b]:
                    alive = False
                    break
            if alive:
                total += gamma ** (T - t) * bootstrap[b]
            out[t, b] = total
    return out


def test_n_step_returns_match_definition_with_dones_mid_rollout():
    rng = np.random.default_rng(0)
    T, B = 5, 4
    rewards, bootstrap = rng.normal(size=(T, B)), rng.normal(size=B)
    dones = np.zeros((T, B))
    dones[1, 0] = dones[3, 1] = dones[4, 2] = dones[0, 3] = dones[2, 3] = 1.0  # mid-rollout, last step, twice
    got = n_step_returns(*(torch.tensor(x) for x in (rewards, dones, bootstrap)), 0.99)
    np.testing.assert_allclose(got.numpy(), n_step_reference(rewards, dones, bootstrap, 0.99), rtol=1e-12)


def test_n_step_returns_known_values():
    got = n_step_returns(torch.tensor([[1.0], [0.0], [2.0]]), torch.zeros(3, 1), torch.tensor([4.0]), 0.5)
    assert got[:, 0].tolist() == [1 + 0.25 * 2 + 0.125 * 4, 0.5 * 2 + 0.25 * 4, 2 + 0.5 * 4]


def test_a2c_loss_known_values():
    """Two actions with equal logits: log pi = log 1/2, entropy log 2; the policy gradient pushes up the advantage."""
    logits = torch.zeros(2, 2, requires_grad=True)
    values, returns = torch.tensor([1.0, 0.0]), torch.tensor([3.0, -1.0])
    out = a2c_loss(logits, values, torch.tensor([0, 1]), returns, ent_coef=0.01, vf_coef=0.5)
    assert out["policy_loss"].item() == pytest.approx(-math.log(0.5) * (2.0 - 1.0) / 2)
    assert out["value_loss"].item() == pytest.approx((4.0 + 1.0) / 2)
    assert out["entropy"].item() == pytest.approx(math.log(2))
    assert out["total_loss"].item() == pytest.approx(out["policy_loss"].item() - 0.01 * math.log(2) + 0.5 * 2.5)
    out["policy_loss"].backward()
    assert logits.grad[0, 0] < 0 < logits.grad[1, 1]  # raise a_0 (advantage +2), lower a_1 (advantage -1)


def test_shared_rmsprop_matches_torch_rmsprop():
    """Same rule as torch.optim.RMSprop (eps outside the square root, no momentum) step for step."""
    torch.manual_seed(0)
    mine = torch.randn(5, 3)
    ref = mine.clone().requires_grad_(True)
    opt_mine = SharedRMSprop([mine], alpha=0.99, eps=0.01).share_memory()
    opt_ref = torch.optim.RMSprop([ref], lr=7e-4, alpha=0.99, eps=0.01)
    for _ in range(4):
        g = torch.randn(5, 3)
        opt_mine.step([g], 7e-4)
        ref.grad = g.clone()
        opt_ref.step()
    torch.testing.assert_close(mine, ref.detach(), rtol=1e-6, atol=1e-7)


def test_default_rmsprop_eps_is_the_one_that_learns_and_the_optimizer_applies_it_outside_the_root():
    """1e-3: Table 2's 0.01 does not learn Pong, 1e-5 kills the ReLUs of 4 hogwild workers (README's eps study).
    One step from zero statistics, by hand: v = (1 - alpha) g^2, p -= lr g / (sqrt(v) + eps)."""
    args = tyro.cli(Args, args=[])
    assert args.rmsprop_eps == 1e-3 and args.optimizer == "rmsprop"
    p = torch.zeros(3)
    g = torch.tensor([1e-4, -2e-3, 0.5], dtype=torch.float64)
    a3c.make_optimizer([p], args).step([g.float()], 0.1)
    want = -0.1 * g / ((1 - 0.99) ** 0.5 * g.abs() + 1e-3)  # [-0.0099, 0.167, -0.980]; eps 0.01: [-0.001, 0.02, -0.83]
    torch.testing.assert_close(p.double(), want, rtol=1e-5, atol=0)


def test_evaluation_takes_argmax_actions_by_default_and_samples_with_no_eval_greedy(monkeypatch, tmp_path):
    """GALA Table 1 evaluates A3C, too, with argmax_a pi(a|s). The argmax (action 2) has probability about 0.34."""
    logits = torch.tensor([0.0, 0.4, 0.8, 0.2])
    for flags, greedy in [([], True), (["--no-eval-greedy"], False)]:
        env = RecordingEnv(length=25)
        monkeypatch.setattr(a3c, "make_env", lambda *a, env=env, **k: env)
        args = tyro.cli(Args, args=["--env-id", "CartPole-v1", "--eval-episodes", "4", *flags])
        assert list(a3c.evaluate(FixedLogitsPolicy(logits), args, tmp_path, torch.device("cpu"))) == [25.0] * 4
        assert len(env.actions) == 100
        if greedy:
            assert set(env.actions) == {2}
        else:  # sampled: every action shows up, the argmax in about a third of the steps
            assert set(env.actions) == {0, 1, 2, 3}
            assert 15 <= env.actions.count(2) <= 55


# ------------------------------------------------------------------ pushes from two processes


def shared_for_test(**kw) -> Shared:
    return Shared(
        stop=CTX.Event(), log_q=CTX.Queue(), error_q=CTX.Queue(), steps_claimed=CTX.Value("q", 0),
        version=CTX.Value("q", 0), **kw
    )  # fmt: skip


def known_grads(worker: int, k: int) -> list[torch.Tensor]:
    """Distinct, exactly representable gradients per (worker, push), so sums are exact in float32."""
    return [torch.full((3, 2), float(2**worker * (k + 1))), torch.arange(2.0) * (worker + 1) + k]


def hogwild_pusher(worker: int, shared: Shared, lock, pushes: int) -> None:
    for k in range(pushes):
        with lock:  # the check serialises writes: lock-free Hogwild may lose an update when two collide
            push(shared, known_grads(worker, k), Update(worker, 1, -1, 0, 0.5, {}, [], {}))


def test_hogwild_two_workers_change_shared_parameters_by_their_sum():
    params = [torch.zeros(3, 2).share_memory_(), torch.ones(2).share_memory_()]
    shared = shared_for_test(optimizer=SharedRMSprop(params, "sgd"))
    lock, pushes = CTX.Lock(), 5
    procs = [CTX.Process(target=hogwild_pusher, args=(w, shared, lock, pushes)) for w in range(2)]
    for p in procs:
        p.start()
    reported = [shared.log_q.get(timeout=30) for _ in range(2 * pushes)]  # each push reports its update to main
    assert sorted(r.version for r in reported) == list(range(1, 2 * pushes + 1))
    assert all(set(r.timing) == {"timing/push"} for r in reported)
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    total = [sum(known_grads(w, k)[i] for w in range(2) for k in range(pushes)) for i in range(2)]
    torch.testing.assert_close(params[0], torch.zeros(3, 2) - 0.5 * total[0], rtol=0, atol=0)
    torch.testing.assert_close(params[1], torch.ones(2) - 0.5 * total[1], rtol=0, atol=0)
    assert shared.version.value == 2 * pushes


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Parameter(torch.zeros(3, 2))
        self.b = nn.Parameter(torch.ones(2))


def server_pusher(worker: int, shared: Shared, pushes: int) -> None:
    for k in range(pushes):  # pulled version -1: only the arrival order matters here; (worker, k) marks the gradient
        update = Update(worker, 1, -1, 0, 0.5, dict(worker=worker, push=k), [], {})
        push(shared, known_grads(worker, k), update)


def test_server_applies_every_gradient_exactly_once_and_versions_count_them():
    model, pushes = Tiny(), 6
    num_params = sum(p.numel() for p in model.parameters())
    shared = shared_for_test(
        grad_q=CTX.Queue(),
        grad_slots=torch.zeros((2, 2, num_params)).share_memory_(),
        free_slots=[CTX.Queue() for _ in range(2)],
        published=flatten(list(model.parameters())).share_memory_(),
        param_lock=CTX.Lock(),
    )
    for q in shared.free_slots:
        q.put(0)
        q.put(1)
    args = Args(optimizer="sgd", torch_threads=1)
    server = CTX.Process(target=gradient_server, args=(model, args, shared, torch.device("cpu"), None))
    server.start()
    workers = [CTX.Process(target=server_pusher, args=(w, shared, pushes)) for w in range(2)]
    for p in workers:
        p.start()
    for p in workers:
        p.join(timeout=30)
        assert p.exitcode == 0
    shared.grad_q.put(SaveCheckpoint(None, {}, final=True))  # the server returns once it applied all before it
    records = [shared.log_q.get(timeout=30) for _ in range(2 * pushes)]
    server.join(timeout=30)
    assert server.exitcode == 0 and shared.log_q.empty()  # it reported each gradient once, and nothing else
    assert [r.version for r in records] == list(range(1, 2 * pushes + 1))  # version + 1 per applied gradient
    applied = sorted((r.losses["worker"], r.losses["push"]) for r in records)
    assert applied == [(w, k) for w in range(2) for k in range(pushes)]  # each exactly once
    for w in range(2):  # a worker's own gradients arrive in the order it pushed them
        assert [r.losses["push"] for r in records if r.losses["worker"] == w] == list(range(pushes))
    assert all(set(r.timing) == {"timing/server_apply"} for r in records)
    total = [sum(known_grads(w, k)[i] for w in range(2) for k in range(pushes)) for i in range(2)]
    want = torch.cat([(torch.zeros(3, 2) - 0.5 * total[0]).reshape(-1), torch.ones(2) - 0.5 * total[1]])
    torch.testing.assert_close(shared.published, want, rtol=0, atol=0)
    assert shared.version.value == 2 * pushes


# ------------------------------------------------------------------ running the script


@pytest.fixture
def run_main(capsys):
    """`main(Args(cuda=False, **kw))` in this process; returns (exit status, stdout, stderr). Puts back what main
    sets process-wide: signal handlers, torch's threads, determinism flags and RNG, threading.excepthook."""

    def run(**kw):
        saved = (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM), torch.get_num_threads(),
                 torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
                 torch.backends.cudnn.deterministic, torch.get_rng_state(), threading.excepthook,
                 signal.getsignal(signal.SIGHUP))  # fmt: skip
        try:
            main(Args(cuda=False, **kw))
            code = 0
        except SystemExit as e:
            code = e.code
        finally:
            signal.signal(signal.SIGINT, saved[0])
            signal.signal(signal.SIGTERM, saved[1])
            torch.set_num_threads(saved[2])
            torch.use_deterministic_algorithms(saved[3], warn_only=saved[4])
            torch.backends.cudnn.deterministic = saved[5]
            torch.set_rng_state(saved[6])
            threading.excepthook = saved[7]
            signal.signal(signal.SIGHUP, saved[8])
        out = capsys.readouterr()
        return code, out.out, out.err

    return run


REQUIRED_TAGS = [*CORE_TAGS, "timing/pull", "timing/rollout", "timing/train"]


def check_tags(logged, update, skip=()):
    apply_tag = "timing/push" if update == "hogwild" else "timing/server_apply"
    assert_finite_tags(logged, [t for t in [*REQUIRED_TAGS, apply_tag, "charts/policy_lag_max"] if t not in skip])
    assert_documented_tags("a3c_large_batch.py", logged)


def mean_lag(logged, updates: int, log_frequency: int) -> float:
    """The run's mean policy lag, from its `charts/policy_lag` points (each the mean of `log_frequency` updates)."""
    points = [v for _, v in logged["charts/policy_lag"]]
    assert updates % log_frequency == 0 and len(points) == updates // log_frequency  # equal windows
    return sum(points) / len(points)


@pytest.fixture(scope="module")
def hogwild_run(tmp_path_factory):
    """One tracked (offline) 2-worker hogwild run on CartPole with --save-model, a final checkpoint and one evaluation
    episode, in a subprocess (wandb stays out of the test process): (its CompletedProcess, run directory, W&B
    directory). 100 pushes of 2 workers x 4 envs x 5 steps, one TensorBoard point per 10."""
    log_dir, wandb_dir = tmp_path_factory.mktemp("hogwild-runs"), tmp_path_factory.mktemp("wandb")
    args = [*TINY_CARTPOLE, "--update", "hogwild", "--total-timesteps", "2000", "--track", "--save-model"]
    args += ["--checkpoint-interval", "3600", "--eval-episodes", "1", "--no-cuda"]
    proc = run_script(SCRIPT, args, log_dir, env=offline_wandb_env(wandb_dir))
    assert proc.returncode == 0, proc.stderr
    return proc, only_run_dir(log_dir), wandb_dir


def test_cartpole_hogwild_end_to_end_with_the_predicted_lag(hogwild_run):
    """Each update of one worker falls between the pull and the push of at most one update of another, so over a run
    the mean lag is at most W - 1 (module docstring). --track: the main process alone logs to W&B (one run for the two
    worker processes)."""
    proc, run_dir, wandb_dir = hogwild_run
    total, workers = 2000, 2
    assert re.search(rf"^global_step={total} SPS=", proc.stdout, re.MULTILINE), proc.stdout[-500:]  # every script's
    start = f"run directory: {run_dir}  (100 updates of 20 agent steps, an update is one of 2 asynchronous workers' 4 "
    assert f"{start}envs x 5 steps; hogwild, cpu)\n" in proc.stdout, proc.stdout[:500]
    assert f"\nfinished: {total:,} of {total:,} agent steps in " in proc.stdout, proc.stdout[-800:]
    assert f"\n      python {SCRIPT} --eval-only {run_dir / 'model.pt'}\n" in proc.stdout  # the summary's last line
    logged = scalars(run_dir)
    check_tags(logged, "hogwild")
    assert max(s for s, _ in logged["charts/SPS"]) == total  # every agent step counted once
    assert mean_lag(logged, total // 20, 10) <= workers - 1 + 1e-6
    tracked = assert_tracked_once(wandb_dir, run_dir)
    assert tracked.config["num_workers"] == 2 and tracked.config["update"] == "hogwild"
    saved = json.loads((run_dir / "args.json").read_text())
    assert saved["script"] == SCRIPT and saved["args"]["env_id"] == "CartPole-v1" and saved["meta"]["network"] == "mlp"


def test_eval_only_replays_the_saved_agent_with_the_end_of_training_evaluation(hogwild_run, tmp_path, run_main):
    """model.pt (in a subprocess, with its args.json) and checkpoint.pt (in process) play the same greedy episodes,
    and the first is the run's own eval episode: same policy, same evaluation seed. --no-eval-greedy samples."""
    _, run_dir, _ = hogwild_run
    proc, report = run_eval_only(SCRIPT, run_dir / "model.pt", tmp_path / "logs", "--eval-episodes", "3")
    assert proc.returncode == 0 and report is not None, proc.stderr
    assert report["episodes"] == 3 and report["greedy"] is True and report["model"] == str(run_dir / "model.pt")
    assert report["settings"] == {"env_id": "CartPole-v1", "atari_protocol": "deepmind", "network": "mlp"}
    returns = report["returns"]
    assert len(returns) == 3 and all(math.isfinite(r) and r == int(r) and 8 <= r <= 500 for r in returns), returns
    assert report["mean"] == pytest.approx(np.mean(returns))
    assert returns[0] == scalars(run_dir)["eval/episodic_return"][0][1]
    assert "from its run: env_id=CartPole-v1 atari_protocol=deepmind network=mlp" in proc.stdout
    for greedy in (True, False):
        code, out, err = run_main(eval_only=str(run_dir / "checkpoint.pt"), eval_episodes=3, eval_greedy=greedy)
        assert code == 0 and "eval episode 2: return" in out, err
        latest = max(run_dir.glob("eval-*.json"), key=lambda p: p.stat().st_mtime_ns)
        from_checkpoint = json.loads(latest.read_text())
        assert from_checkpoint["greedy"] is greedy and len(from_checkpoint["returns"]) == 3
        if greedy:
            assert from_checkpoint["returns"] == returns


def test_eval_only_refuses_what_it_cannot_evaluate(hogwild_run, tmp_path, run_main):
    _, run_dir, _ = hogwild_run
    assert_eval_only_refusals(SCRIPT, run_dir / "model.pt", tmp_path)  # other script, --env-id Acrobot-v1, garbage
    lonely = tmp_path / "lonely"
    lonely.mkdir()
    (lonely / "model.pt").write_bytes((run_dir / "model.pt").read_bytes())
    code, _, err = run_main(eval_only=str(lonely / "model.pt"))
    assert code == 2 and "cannot read its run's args.json" in err, err
    code, _, err = run_main(eval_only=str(run_dir / "model.pt"), network="nature")
    assert code == 2 and "--network nature contradicts" in err and "mlp" in err, err


@pytest.mark.parametrize("update", ["hogwild", "server"])
def test_original_a3c_one_worker_one_env_lag_checkpoint_and_evaluation(update, tmp_path, run_main):
    """One worker, one env (Mnih et al.'s A3C worker), every update logged. Hogwild: the worker pulls what it pushed,
    lag 0. Server: only its own gradients still queued can land between its pull and its gradient, at most 3 (its two
    slots and the one being applied). The final checkpoint holds the final model, one version per gradient."""
    total = 500  # 100 pushes of 1 env x 5 steps
    code, _, err = run_main(
        env_id="CartPole-v1", num_envs_per_worker=1, num_workers=1, update=update, total_timesteps=total,
        log_frequency=1, eval_episodes=2, save_model=True, checkpoint_interval=3600.0, log_dir=str(tmp_path),
    )  # fmt: skip
    assert code == 0, err
    run_dir = only_run_dir(tmp_path)
    logged = scalars(run_dir)
    check_tags(logged, update, ["eval/episodic_return"])
    assert len(logged["losses/total_loss"]) == 100 and len(logged["eval/episodic_return"]) == 2
    lags = [v for _, v in logged["charts/policy_lag"]]
    assert lags == [v for _, v in logged["charts/policy_lag_max"]]  # one update per point: mean = max = its lag
    assert all(v == 0 for v in lags) if update == "hogwild" else all(0 <= v <= 3 for v in lags), lags
    checkpoint = torch.load(run_dir / "checkpoint.pt", weights_only=False)
    assert checkpoint["global_step"] == total and checkpoint["version"] == total // 5
    final = torch.load(run_dir / "model.pt")
    for name, value in final.items():
        assert torch.equal(value, checkpoint["model"][name]), name


@pytest.mark.parametrize(("update", "envs"), [("hogwild", 4), ("server", 1)])
def test_breakout_end_to_end(update, envs, tmp_path, run_main):
    """The Nature CNN on frames. Server mode, W = 2: a gradient's lag counts at most 3 of its worker's own and each
    other worker's update at most 4 times (it waits for a slot two gradients back), so the mean lag is <= 4W - 1."""
    total = 10 * envs * 2 * 5  # 10 pushes per worker, one TensorBoard point per 5 updates
    code, _, err = run_main(
        env_id="ALE/Breakout-v5", update=update, num_workers=2, num_envs_per_worker=envs, total_timesteps=total,
        log_frequency=5, log_dir=str(tmp_path),
    )  # fmt: skip
    assert code == 0, err
    logged = scalars(only_run_dir(tmp_path))
    check_tags(logged, update, skip=("charts/episodic_return", "charts/episodic_length"))  # no game ends this soon
    assert max(s for s, _ in logged["charts/SPS"]) == total
    assert mean_lag(logged, 20, 5) <= (1 if update == "hogwild" else 7) + 1e-6


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (dict(env_id="ALE/Breakot-v5"), "did you mean ALE/Breakout-v5"),
        (dict(num_workers=0), "--num-workers must be >= 1"),
        (dict(num_envs_per_worker=0), "--num-envs-per-worker must be >= 1"),
        (dict(env_threads=-1), "--env-threads must be >= 0"),
        (dict(learning_rate=-1.0), "--learning-rate must be > 0"),
        (dict(rmsprop_alpha=1.0), "--rmsprop-alpha must be in [0, 1)"),
        (dict(total_timesteps=10), "--total-timesteps 10 is below one update, 80 agent steps (--num-envs-per-worker"),
        (dict(num_steps=3, total_timesteps=47), "x --num-steps): the run would learn nothing; give at least 48"),
        (dict(env_id="CartPole-v1", capture_video=True), "--capture-video records the evaluation episodes; add"),
        (dict(resume=__file__, eval_only=__file__), "--eval-only trains nothing, so --resume would be ignored"),
        (dict(resume="/nonexistent/checkpoint.pt"), "no such checkpoint"),
        (dict(env_id="CartPole-v1", learning_rate=math.inf), "--learning-rate must be a finite number, got inf"),
        (dict(env_id="CartPole-v1", max_grad_norm=math.nan), "--max-grad-norm must be a finite number, got nan"),
        (dict(env_id="Pendulum-v1"), "continuous action space"),
        (dict(eval_only="/nonexistent/model.pt"), "--eval-only /nonexistent/model.pt: no such file"),
    ],
)
def test_bad_flags_are_one_error_line(args, message):
    error = validate(Args(**args))
    assert error is not None and message in error and "\n" not in error, error


def test_track_without_wandb_is_refused_by_validate(monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    error = validate(Args(env_id="CartPole-v1", track=True))
    assert error.startswith('--track needs wandb (pip install -e ".[track]"): ') and "\n" not in error
    assert validate(Args(env_id="CartPole-v1")) is None


def test_tracking_names_the_run_after_its_directory_resumes_it_and_ends_with_the_exit_status(monkeypatch, tmp_path):
    """A --resume run continues the W&B run of its run directory (the same id); recorded videos are uploaded; the
    W&B run ends with the run's exit status."""
    wandb = FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", wandb)
    run_dir = tmp_path / "CartPole-v1__a3c_large_batch__1__1700000000"
    (run_dir / "videos").mkdir(parents=True)
    (run_dir / "videos" / "rl-video-episode-0.mp4").write_bytes(b"")
    assert start_tracking(Args(env_id="CartPole-v1"), run_dir) is None and wandb.inits == []
    assert start_tracking(Args(env_id="CartPole-v1", track=True, wandb_entity="me"), run_dir) is wandb
    start_tracking(Args(env_id="CartPole-v1", track=True, resume=str(run_dir / "checkpoint.pt")), run_dir)
    first, second = wandb.inits
    assert first["name"] == second["name"] == run_dir.name and first["id"] == second["id"]
    assert first["resume"] is None and second["resume"] == "allow" and first["entity"] == "me"
    assert first["sync_tensorboard"] and first["config"]["env_id"] == "CartPole-v1" and first["config"]["track"]
    finish_tracking(None, run_dir, 0)
    for code in (0, 1, 128 + signal.SIGTERM):
        finish_tracking(wandb, run_dir, code)
    assert wandb.finished == [0, 1, 143]
    assert wandb.logged == [{"videos": ("video", str(run_dir / "videos" / "rl-video-episode-0.mp4"))}] * 3


def test_failed_wandb_init_is_one_error_line_and_stops_the_started_processes(monkeypatch, tmp_path, run_main):
    """wandb.init runs after the forks (no worker inherits its threads): when it fails (not logged in, no network), the
    workers and the gradient server already started are stopped, and the run exits 2 with one error line."""
    monkeypatch.setitem(sys.modules, "wandb", FakeWandb(error=RuntimeError("No API key configured.\nmore")))
    code, _, err = run_main(**CARTPOLE, update="server", total_timesteps=100_000_000, track=True, log_dir=str(tmp_path))
    assert code == 2 and err.strip() == "error: --track: wandb.init failed: No API key configured.", err
    assert not multiprocessing.active_children()


@pytest.mark.parametrize("flags", [["--update", "allreduce"], ["--atari-protocol", "atari57"], ["--optimizer", "adam"],
                                   ["--network", "resnet"]])  # fmt: skip
def test_bad_choice_is_a_usage_error(flags):
    with pytest.raises(SystemExit) as e:
        tyro.cli(Args, args=flags)
    assert e.value.code == 2


def test_bad_flag_from_the_command_line(tmp_path):
    proc = run_script(SCRIPT, ["--num-workers", "0"], tmp_path, timeout=60)
    assert proc.returncode == 2 and proc.stderr.strip() == "error: --num-workers must be >= 1, got 0", proc.stderr
    assert not any(Path(tmp_path).iterdir())


META = dict(script="a3c_large_batch.py", algo="hogwild", env_id="CartPole-v1", atari_protocol="deepmind",
            network="mlp", obs_shape=[4], action_shape_or_n=2)  # fmt: skip


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("garbage", "not a checkpoint this script can read (UnpicklingError: "),
        ("truncated", "not a checkpoint this script can read ("),
        ("no_meta", 'not a checkpoint this script can read (it has no "meta" entry)'),
        ("other_script", "it is a hts_a2c.py checkpoint (script hts_a2c.py), this run is script a3c_large_batch.py"),
        ("other_env", "(env_id Acrobot-v1, obs_shape [6], action_shape_or_n 3), this run is env_id CartPole-v1, "),
        ("other_update", "it is a a3c_large_batch.py checkpoint (algo server), this run is algo hogwild"),
    ],
)
def test_resume_refuses_a_checkpoint_it_cannot_continue(case, message, tmp_path, run_main):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    if case == "other_update":
        path = run_dir / "checkpoint.pt"
        torch.save({"meta": {**META, "algo": "server"}}, path)
    else:
        path = write_unusable_checkpoint(run_dir, case, META)
    before = path.read_bytes()
    code, _, err = run_main(env_id="CartPole-v1", log_dir=str(tmp_path / "logs"), resume=str(path))
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: cannot resume from {path}: ") and message in lines[0], lines
    assert list(run_dir.iterdir()) == [path] and path.read_bytes() == before  # no events file, checkpoint unchanged
    assert not (tmp_path / "logs").exists()


@pytest.mark.parametrize("total", [2000, 2019])
def test_resume_of_a_run_that_did_its_budget_is_refused(total, tmp_path, run_main):
    """Workers claim whole rollouts of 4 envs x 5 steps from the budget: a checkpoint at global step 2000 has no update
    left in --total-timesteps 2000 or 2019, so the resumed run is refused before anything is written."""
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    path = run_dir / "checkpoint.pt"
    torch.save({"meta": META, "global_step": 2000, "version": 100}, path)
    code, _, err = run_main(**CARTPOLE, total_timesteps=total, resume=str(path), log_dir=str(tmp_path / "logs"))
    said = (
        f"its run did 2000 agent steps and --total-timesteps {total} (whole updates of 20) holds no more: the run "
        "would learn nothing; give at least 2020"
    )
    assert code == 2 and err.strip() == f"error: cannot resume from {path}: {said}", err
    assert list(run_dir.iterdir()) == [path] and not (tmp_path / "logs").exists()


def test_a_budget_of_fewer_updates_than_workers_warns_and_runs(tmp_path, run_main):
    code, out, err = run_main(env_id="CartPole-v1", num_workers=3, num_envs_per_worker=1, total_timesteps=10,
                              log_dir=str(tmp_path))  # fmt: skip
    assert code == 0 and err == "warning: 2 update(s) left for 3 workers: 1 of them will update nothing\n", err
    assert "\nfinished: 10 of 10 agent steps in " in out, out


@pytest.mark.parametrize("log_dir", ["/proc/x", "a_file/runs"])
def test_unusable_log_dir_is_one_error_line(log_dir, tmp_path, run_main):
    (tmp_path / "a_file").write_text("")
    code, _, err = run_main(
        env_id="CartPole-v1", log_dir=log_dir if log_dir.startswith("/") else str(tmp_path / log_dir)
    )
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: cannot create the run directory "), lines


def test_runs_started_in_the_same_second_get_their_own_directories(tmp_path, monkeypatch):
    monkeypatch.setattr(a3c.time, "time", lambda: 1700000000.5)
    args = Args(env_id="CartPole-v1", log_dir=str(tmp_path))
    dirs = [a3c.new_run_dir(args) for _ in range(3)]
    assert [d.name for d in dirs] == [f"CartPole-v1__a3c_large_batch__1__1700000000{s}" for s in ("", "-2", "-3")]


# ------------------------------------------------------------------ failures and shutdown


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except FileNotFoundError:
        return ""


def start_long_run(log_dir, extra):
    """The script on CartPole with an endless budget, once training is under way, and its worker (and server) pids."""
    proc = start_run(SCRIPT, [*TINY_CARTPOLE, "--total-timesteps", "100000000", *extra], log_dir)
    return proc, sorted(c for c in children_of(proc.pid) if SCRIPT in cmdline(c))


def shm_segments(pids) -> list[str]:
    return [p.name for p in Path("/dev/shm").iterdir() if any(f"_{pid}_" in p.name for pid in pids)]


@pytest.mark.parametrize("update", ["hogwild", "server"])
def test_killed_worker_stops_the_run_naming_it(update, tmp_path):
    proc, workers = start_long_run(tmp_path, ["--update", update])
    assert len(workers) == (2 if update == "hogwild" else 3)  # the workers (and the gradient server, started first)
    os.kill(workers[-1], signal.SIGKILL)  # the last started: worker 1
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 1 and "error: worker 1 died (killed by signal 9)" in err, err
    assert "\nstopped (exit status 1): " in out, out  # the summary, also after a dead worker
    wait_for(lambda: not any(alive(pid) for pid in workers), "no worker left (no orphans)")


def test_crashing_worker_stops_the_run_with_its_traceback(tmp_path, run_main):
    code, _, err = run_main(
        env_id="tests.faulty_env:CrashingCartPole-v0", num_workers=2, num_envs_per_worker=1,
        total_timesteps=100_000_000, log_dir=str(tmp_path),
    )  # fmt: skip
    assert code == 1
    assert "error: worker" in err and "died" in err and "injected env failure" in err, err


def test_non_finite_loss_stops_with_a_clear_message(tmp_path, run_main):
    code, _, err = run_main(
        env_id="tests.faulty_env:NaNCartPole-v0", num_workers=1, num_envs_per_worker=1, total_timesteps=100_000_000,
        checkpoint_interval=0.000001, log_dir=str(tmp_path),
    )  # fmt: skip
    assert code == 1 and "non-finite loss" in err and "Traceback" not in err, err
    checkpoint = torch.load(only_run_dir(tmp_path) / "checkpoint.pt", weights_only=False)
    assert all(torch.isfinite(v).all() for v in checkpoint["model"].values())  # the last good one, kept


@pytest.mark.parametrize(("update", "sig"), [("hogwild", signal.SIGINT), ("server", signal.SIGTERM)])
def test_signal_stops_cleanly_with_checkpoint_and_resume_continues(update, sig, tmp_path, run_main):
    proc, workers = start_long_run(tmp_path, ["--update", update, "--checkpoint-interval", "3600"])
    pids = [proc.pid, *workers]
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + sig, err
    assert "Traceback" not in err
    wait_for(lambda: not any(alive(pid) for pid in workers), "no worker left (no orphans)")
    assert not shm_segments(pids)  # no leaked shared memory
    run_dir = only_run_dir(tmp_path)
    checkpoint = torch.load(run_dir / "checkpoint.pt", weights_only=False)
    stopped_at = checkpoint["global_step"]
    assert stopped_at > 0 and stopped_at == max(s for s, _ in scalars(run_dir)["charts/SPS"])  # TensorBoard flushed
    assert checkpoint["version"] == stopped_at // 20
    assert f"\nstopped (exit status {128 + sig}): {stopped_at:,} of 100,000,000 agent steps in " in out, out
    assert f"\n      python {SCRIPT} --resume {run_dir / 'checkpoint.pt'}\n" in out, out

    code, _, err = run_main(**CARTPOLE, update=update, total_timesteps=stopped_at + 400,
                            resume=str(run_dir / "checkpoint.pt"), log_dir=str(tmp_path))  # fmt: skip
    assert code == 0, err
    assert only_run_dir(tmp_path) == run_dir
    assert max(s for s, _ in scalars(run_dir)["charts/SPS"]) == stopped_at + 400


def test_ctrl_c_during_start_up_stops_cleanly(tmp_path):
    cmd = [sys.executable, SCRIPT, "--log-dir", str(tmp_path), *TINY_CARTPOLE, "--total-timesteps", "100000000"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # fmt: skip
    assert proc.stdout.readline().startswith("run directory:")  # the workers are being started now
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "Traceback" not in err, err
    wait_for(lambda: not processes_with(str(tmp_path)), "no worker left (no orphans)")  # forked: same command line


def test_full_disk_stops_cleanly_and_keeps_the_last_checkpoint(tmp_path):
    with small_tmpfs(tmp_path / "disk", "4m") as disk:  # server mode: the gradient server process writes checkpoints
        proc, workers = start_long_run(disk, ["--update", "server", "--checkpoint-interval", "0.2"])
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


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_signal_during_start_up_stops_cleanly(sig, tmp_path, monkeypatch, capsys):
    """The signal arrives once the run directory and its args.json exist and the handlers are installed, before any
    process starts: no process, no directory left, exit 128 + signal (the plumbing's stop_if_signalled, as in apex)."""
    make_shared = a3c.make_shared

    def signalled(*args):
        shared = make_shared(*args)
        os.kill(os.getpid(), sig)
        return shared

    monkeypatch.setattr(a3c, "make_shared", signalled)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}  # main changes them
    threads = torch.get_num_threads()
    try:
        with pytest.raises(SystemExit) as e:
            a3c.main(a3c.Args(env_id="CartPole-v1", log_dir=str(tmp_path), num_workers=2))
    finally:
        for s, handler in handlers.items():
            signal.signal(s, handler)
        torch.set_num_threads(threads)
    assert e.value.code == 128 + sig
    assert "during the start" in capsys.readouterr().err
    assert not any(tmp_path.iterdir()) and not multiprocessing.active_children()


def hold_until_killed(lock, held) -> None:
    lock.acquire()
    held.set()
    time.sleep(600)


def test_the_last_point_does_not_wait_for_the_lock_of_a_killed_worker():
    """A server-mode worker killed (kill -9) inside `pull` leaves the published parameters' lock held for good: the
    end of the run (Watch.last_point) must not wait for it (a loaded CI run hung there for its 60 s)."""
    ctx = multiprocessing.get_context("fork")
    lock, held = ctx.Lock(), ctx.Event()
    worker = ctx.Process(target=hold_until_killed, args=(lock, held), daemon=True)
    worker.start()
    assert held.wait(30)
    os.kill(worker.pid, signal.SIGKILL)
    worker.join()
    shared, processes = types.SimpleNamespace(grad_q=ctx.Queue(), param_lock=lock), types.SimpleNamespace(procs={})
    processes.procs["worker 1"] = worker
    run = types.SimpleNamespace(shared=shared, processes=processes, model=nn.Linear(1, 1), write=lambda: None,
                                console_line=lambda now=False: None)  # fmt: skip
    ended = threading.Thread(target=a3c.Watch.last_point, args=(run,), daemon=True)
    ended.start()
    ended.join(timeout=20)
    assert not ended.is_alive(), "Watch.last_point waits for a lock a killed process held"
