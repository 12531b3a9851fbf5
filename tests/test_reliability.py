"""What every script does at the edges of a run, checked the same way for all eight (issue 35's probe): a closed
terminal (SIGHUP), Ctrl+C during the end-of-run evaluation or while the imports load, a --track whose wandb cannot
be imported, a resume with other flags, and an unknown flag; and what a run tells its user (issue 36): where it goes,
how far it is, what it left behind and how to go on, and a --help that reads as sentences. Each is triggered by what
the run prints or by an import hook, never by a timer; a deadline only catches a hang."""

import contextlib
import dataclasses
import fcntl
import importlib
import itertools
import json
import math
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
import types

import numpy as np
import pytest
import torch
from helpers import ROOT, FakeWandb, only_run_dir, scalars, start_run
from torch import nn

CARTPOLE = ("--env-id", "CartPole-v1")
APEX = ("--num-actors", "2", "--learning-starts", "200", "--batch-size", "32", "--actor-batch", "20",
        "--actor-update-interval", "20", "--log-frequency", "5", "--log-interval", "0.5", "--hidden-sizes", "32", "32",
        "--eval-interval", "500")  # fmt: skip
# Each script on a tiny run: its flags, a budget of a few seconds, and a flag (with a new value) that changes the
# run's shape, so that a checkpoint of the first run cannot continue under it.
RUNS = dict(
    a3c_large_batch=(("--num-workers", "2", "--num-envs-per-worker", "4", "--log-interval", "0.5",
                      "--torch-threads", "1", *CARTPOLE), 4000, ("--num-envs-per-worker", "2")),
    apex_ddpg=(("--env-id", "Pendulum-v1", *APEX, "--critic-learning-rate", "1e-3"), 1000, ("--num-actors", "3")),
    apex_dqn=(("--target-network-frequency", "20", "--optimizer", "adam", "--learning-rate", "1e-3", *APEX,
               *CARTPOLE), 1000, ("--num-actors", "3")),
    cleanba_ppo_impala=(("--num-envs", "4", "--num-steps", "32", "--num-actor-threads", "2", "--log-interval", "0",
                         "--torch-threads", "1", "--env-threads", "1", *CARTPOLE), 1024, ("--num-envs", "8")),
    gala_a2c=(("--num-learners", "2", "--num-envs", "4", "--log-interval", "1", "--torch-threads", "1",
               "--env-threads", "1", *CARTPOLE), 4000, ("--num-envs", "8")),
    hts_a2c=(("--num-envs", "4", "--num-executors", "2", "--num-actors", "2", "--sync-interval", "8",
              "--log-interval", "0.2", "--torch-threads", "1", *CARTPOLE), 2048, ("--num-envs", "8")),
    hts_ppo=(("--num-envs", "4", "--num-executors", "2", "--num-actors", "2", "--sync-interval", "16",
              "--num-minibatches", "2", "--log-interval", "0.2", "--torch-threads", "1", *CARTPOLE), 2048,
             ("--num-envs", "8")),
    impala_monobeast=(("--unroll-length", "16", "--batch-size", "2", "--num-actors", "2", "--log-interval", "0.1",
                       "--torch-threads", "1", *CARTPOLE), 2048, ("--num-actors", "3")),
)  # fmt: skip
SCRIPTS = sorted(RUNS)


def script_of(name):
    return f"{name}.py"


def flags(name, total, *extra):
    return [*RUNS[name][0], "--total-timesteps", str(total), *extra]


def finish(proc, timeout=60, stacks=False):
    """The exit status and output of a stopped run; a hang fails the test (after killing what is left). `stacks`: the
    run registered faulthandler on SIGUSR1, so its threads' Python stacks go to stderr before the kill."""
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        where = process_state(proc.pid)
        if stacks:
            proc.send_signal(signal.SIGUSR1)
            time.sleep(1.0)
        proc.kill()
        out, err = proc.communicate()
        pytest.fail(f"still running {timeout} s after the signal ({where}): {err[-1500:]}")
    return proc.returncode, out, err


def process_state(pid):
    """What a hung process is doing, for the failure message: each thread's name, state and kernel wait, and the
    signals the process blocks, has pending and catches (hex masks, bit n-1 for signal n)."""
    with contextlib.suppress(OSError):
        status = dict(line.split(":\t", 1) for line in open(f"/proc/{pid}/status").read().splitlines() if ":\t" in line)
        threads = []
        for task in sorted(os.listdir(f"/proc/{pid}/task")):
            with contextlib.suppress(OSError):
                t = f"/proc/{pid}/task/{task}"
                stat = open(f"{t}/stat").read().rsplit(")", 1)[1].split()
                threads.append(f"{open(f'{t}/comm').read().strip()} {stat[0]} {open(f'{t}/wchan').read() or '-'}")
        masks = " ".join(f"{k} {status.get(k, '?').strip()}" for k in ("SigBlk", "SigPnd", "ShdPnd", "SigCgt"))
        return f"threads: {'; '.join(threads)}; {masks}"
    return "its /proc entry is gone"


@pytest.mark.parametrize("name", SCRIPTS)
def test_sighup_stops_like_sigterm_with_a_final_checkpoint(name, tmp_path):
    proc = start_run(script_of(name), flags(name, 100_000_000, "--checkpoint-interval", "3600"), tmp_path)
    proc.send_signal(signal.SIGHUP)
    code, out, err = finish(proc)
    assert code == 128 + signal.SIGHUP, err[-1500:]
    assert "Traceback" not in err, err[-1500:]
    run_dir = only_run_dir(tmp_path)
    checkpoint = torch.load(run_dir / "checkpoint.pt", map_location="cpu", weights_only=False)
    assert checkpoint["global_step"] > 0
    # the summary after the stop: how far it got, and the commands that continue or evaluate it
    assert re.search(
        rf"^stopped \(exit status 129\): {checkpoint['global_step']:,} of [\d,]+ agent steps", out, re.M
    ), out
    assert f"python {script_of(name)} --resume {run_dir / 'checkpoint.pt'}" in out, out[-1500:]
    assert f"--eval-only {run_dir / 'checkpoint.pt'}" in out, out[-1500:]


# A script's envelope around a loop that a signal ends without main seeing the stop: `python -c THIS name flags...`
SIGNAL_THEN_LOOP_ENDS = """
import importlib, os, signal, sys, threading, tyro
script = importlib.import_module(sys.argv[1])
run = script.open_run(tyro.cli(script.Args, args=sys.argv[2:]))
stop = threading.Event()
run.stop_on_signals(stop)
with run.training("test", lambda: 123, lambda graceful: None, checkpoint=lambda: None):
    os.kill(os.getpid(), signal.SIGHUP)
    assert stop.wait(30)  # the workers saw the stop and ended the loop: main's own test of it never ran
"""


@pytest.mark.parametrize("name", SCRIPTS)
def test_a_signal_that_the_workers_act_on_first_still_ends_the_run_as_stopped(name, tmp_path):
    """impala's learner threads can see a signal's stop before main's loop does, and then the loop ends as if the
    budget were spent: the run must still say it was stopped and exit 128 + signum."""
    cmd = [sys.executable, "-c", SIGNAL_THEN_LOOP_ENDS, name, *flags(name, 100_000), "--log-dir", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 128 + signal.SIGHUP, proc.stderr[-1500:]
    assert "stopped by SIGHUP at global step 123" in proc.stderr, proc.stderr[-1500:]


@pytest.mark.parametrize("name", SCRIPTS)
def test_ctrl_c_during_the_final_evaluation_stops_the_run(name, tmp_path):
    cmd = [sys.executable, script_of(name), "--log-dir", str(tmp_path), *flags(name, RUNS[name][1]),
           "--eval-episodes", "1000000", "--save-model", "--checkpoint-interval", "0"]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)  # fmt: skip
    try:
        for line in proc.stdout:
            if line.startswith("eval episode 0: return"):  # a game of the final evaluation has ended
                break
        else:
            pytest.fail(f"no evaluation game ended (exit {proc.wait()}): {proc.stderr.read()[-1500:]}")
        proc.send_signal(signal.SIGINT)
        code, out, err = finish(proc)
    finally:  # a run that hangs (or a test killed by pytest-timeout) must not keep playing its million episodes
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert code == 128 + signal.SIGINT, err[-1500:]
    assert "Traceback" not in err, err[-1500:]
    run_dir = only_run_dir(tmp_path)
    assert (run_dir / "model.pt").is_file(), "the trained model is saved before the evaluation"
    # the games played before the signal stay: counted in the error line and logged, the first one as printed
    stopped = re.search(r"stopped by SIGINT in the final evaluation, after (\d+) of 1000000 games", err)
    assert stopped and int(stopped[1]) >= 1, err[-1500:]
    logged = [v for _, v in scalars(run_dir)["eval/episodic_return"]][-int(stopped[1]) :]  # apex: after its rounds'
    assert len(logged) == int(stopped[1]) and logged[0] == pytest.approx(float(line.split()[-1]), abs=0.005)


@pytest.mark.parametrize("name", SCRIPTS)
def test_a_signal_while_the_interpreter_exits_ends_the_run_quietly_with_its_status(name, tmp_path):
    """A second Ctrl+C right after the summary lands in the interpreter's exit handlers (multiprocessing's joins,
    wandb's upload): everything is written by then, so the process ends at once with the run's own status and no
    handler prints a traceback. A slow exit handler (registered before the script runs, so it runs after the
    script's own) holds the exit here until the signal comes."""
    hold = ("import atexit, faulthandler, runpy, signal, sys, time\n"
            "faulthandler.register(signal.SIGUSR1, all_threads=True)\n"  # a hang's stacks, for the failure message
            "atexit.register(lambda: (print('holding the exit', flush=True), time.sleep(60)))\n"
            "sys.argv = sys.argv[1:]\n"
            "runpy.run_path(sys.argv[0], run_name='__main__')\n")  # fmt: skip
    cmd = [sys.executable, "-c", hold, script_of(name), "--log-dir", str(tmp_path), *flags(name, RUNS[name][1]),
           "--eval-episodes", "0", "--checkpoint-interval", "0"]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)  # fmt: skip
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("holding the exit"):
                break
        else:
            pytest.fail(f"the run did not reach its exit handlers (exit {proc.wait()}): {proc.stderr.read()[-1500:]}")
        assert any(line.startswith("finished: ") for line in lines), "".join(lines)[-1500:]
        proc.send_signal(signal.SIGINT)
        code, _, err = finish(proc, timeout=30, stacks=True)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert code == 0, err[-1500:]
    assert "Exception ignored" not in err and "Traceback" not in err, err[-1500:]


@pytest.mark.parametrize("name", SCRIPTS)
def test_the_end_of_a_run_writes_what_is_due_and_ends_the_writer_and_tracking_with_its_status(
    name, tmp_path, capsys, monkeypatch
):
    """Run.training's end, every script's, for a finished run, a failed one (a worker's error line), one stopped by
    SIGTERM and one whose events file cannot be flushed: the final checkpoint where one is due (named in the signal's
    line; never after a failure), model.pt for the finished run only, the writer closed and the W&B run ended (videos
    uploaded) with the exit status every time, the error line, then the summary."""
    module = importlib.import_module(name)
    run_dir = tmp_path / "run"
    (run_dir / "videos").mkdir(parents=True)
    (run_dir / "videos" / "rl-video-episode-0.mp4").write_bytes(b"")
    args = module.Args(env_id="CartPole-v1", save_model=True, eval_episodes=0, checkpoint_interval=60)
    wandb, written, closed = FakeWandb(), [], []
    monkeypatch.setattr(module, "start_tracking", lambda args, run_dir: wandb)

    def close(fails=False):
        closed.append(True)
        if fails:
            raise OSError(28, "No space left on device")

    cases = [(0, None, True, False), (1, "error: worker 0 failed", True, False), (143, None, True, False),
             (0, None, False, True)]  # fmt: skip
    for code, failure, due, fails in cases:
        writer = types.SimpleNamespace(close=lambda fails=fails: close(fails))
        monkeypatch.setattr(module, "make_writer", lambda run_dir, args, writer=writer: writer)
        signals = module.StopSignals(threading.Event())
        signals.signum = signal.SIGTERM if code == 143 else 0  # as the handler leaves it
        run = module.Run(args, None, {}, None, run_dir, torch.device("cpu"), 1, 0, 96, 2, "p", signals)
        save = (lambda code=code: written.append(code)) if due else None
        exits = 1 if fails else code
        try:
            with pytest.raises(SystemExit) if exits else contextlib.nullcontext() as ended:
                with run.training("r", lambda: 96, lambda graceful, failure=failure: failure, checkpoint=save,
                                  final_model=lambda: nn.Linear(1, 1)):  # fmt: skip
                    pass
        finally:
            signals.restore()
        assert not exits or ended.value.code == exits
        assert wandb.finished[-1] == exits
        if code == 0:  # the run finished: its model is saved (before the writer is closed)
            assert (run_dir / "model.pt").is_file()
            (run_dir / "model.pt").unlink()  # no other case may write it
    assert written == [0, 143] and len(closed) == 4 and not (run_dir / "model.pt").exists()
    assert wandb.logged == [{"videos": ("video", str(run_dir / "videos" / "rl-video-episode-0.mp4"))}] * 4
    out, err = capsys.readouterr()
    checkpoint = run_dir / "checkpoint.pt"
    stopped = f"stopped by SIGTERM at global step 96; checkpoint written to {checkpoint}"
    assert err.splitlines()[:2] == ["error: worker 0 failed", stopped], err
    assert err.splitlines()[2].startswith("error: no space left on device while writing the TensorBoard events"), err
    ends = [line.split(":")[0] for line in out.splitlines() if line.startswith(("finished", "stopped"))]
    assert ends == ["finished", "stopped (exit status 1)", "stopped (exit status 143)", "stopped (exit status 1)"]


@pytest.mark.parametrize("name", SCRIPTS)
def test_weights_with_nan_or_inf_never_replace_the_last_good_checkpoint(name, tmp_path):
    """Every checkpoint and model.pt goes through atomic_save: a diverged update (weights overflowed after the loss
    was checked) stops the run with the error line, and the file on disk stays the last finite one."""
    module = importlib.import_module(name)
    path = tmp_path / "checkpoint.pt"
    module.atomic_save({"model": {"w": torch.ones(3)}, "global_step": 10}, path)
    for bad in (math.inf, math.nan):
        diverged = {"model": {"w": torch.tensor([1.0, bad, 0.0])}, "optimizer": {"state": [torch.zeros(2)]}}
        with pytest.raises(module.WriteError, match="NaN or infinity"):
            module.atomic_save(diverged, path)
    assert torch.load(path)["model"]["w"].tolist() == [1.0, 1.0, 1.0]
    assert not path.with_suffix(".tmp").exists()


# what an unexpected exception (a bug, an optimizer overflow, CUDA out of memory) is injected into: the learner's step
LEARNER_STEP = {"hts_a2c": ("Learner", "step"), "hts_ppo": ("Learner", "step"), "apex_dqn": ("LearnerRun", "learn"),
                "apex_ddpg": ("LearnerRun", "learn")}  # fmt: skip


@pytest.mark.parametrize("name", sorted(LEARNER_STEP))
def test_an_unexpected_learner_exception_gives_the_error_line_and_the_summary(name, tmp_path, monkeypatch, capsys):
    module = importlib.import_module(name)

    def broken(*args, **kwargs):
        raise RuntimeError("injected learner failure")

    monkeypatch.setattr(getattr(module, LEARNER_STEP[name][0]), LEARNER_STEP[name][1], broken)
    argv = ["--log-dir", str(tmp_path), *flags(name, RUNS[name][1]), "--checkpoint-interval", "0"]
    with pytest.raises(SystemExit) as exit_status:
        module.main(module.parse_args(argv))
    out, err = capsys.readouterr()
    assert exit_status.value.code == 1, err[-1500:]
    assert "error: the learner died:" in err and "RuntimeError: injected learner failure" in err, err[-1500:]
    assert re.search(r"^stopped \(exit status 1\): ", out, re.M), out[-1500:]


@pytest.mark.parametrize("name", SCRIPTS)
def test_a_signal_in_the_final_evaluation_is_not_swallowed_by_an_except_exception(name):
    """gymnasium's env checker wraps the first step in `except Exception` (and warns): the evaluation's interrupt must
    pass through such a block, as KeyboardInterrupt does, or Ctrl+C leaves the evaluation playing on."""
    module = importlib.import_module(name)
    signals = module.StopSignals(threading.Event())
    try:
        signals.interruptible()
        with pytest.raises(module.Interrupted):
            try:  # what a library's step does around the code the signal lands in
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(5)  # the handler runs at once, in this (the main) thread
            except Exception:
                pass
    finally:
        signals.restore()
    assert signals.signum == signal.SIGINT


@pytest.mark.parametrize("name", SCRIPTS)
def test_track_with_a_wandb_that_cannot_be_imported_is_one_error_line(name, tmp_path):
    fake = tmp_path / "fake"
    (fake / "wandb").mkdir(parents=True)
    (fake / "wandb" / "__init__.py").write_text('raise ImportError("this wandb is broken")\n')
    env = {**os.environ, "PYTHONPATH": str(fake), "WANDB_MODE": "offline"}
    logs = tmp_path / "runs"
    cmd = [sys.executable, script_of(name), "--log-dir", str(logs), *flags(name, RUNS[name][1]), "--track"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 2, proc.stderr[-1500:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "wandb" in lines[0], proc.stderr[-1500:]
    assert not logs.exists() or not any(logs.iterdir()), "a run directory was made for a run that never started"


@pytest.mark.parametrize("name", SCRIPTS)
def test_a_resume_says_its_step_and_flags_and_refuses_a_new_shape(name, tmp_path):
    total = RUNS[name][1]
    cmd = [sys.executable, script_of(name), "--log-dir", str(tmp_path), *flags(name, total)]
    cmd += ["--checkpoint-interval", "3600", "--save-model", "--seed", "3"]
    first = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert first.returncode == 0, first.stderr[-1500:]
    run_dir = only_run_dir(tmp_path)
    checkpoint_path = run_dir / "checkpoint.pt"
    said_what_it_did(first.stdout, run_dir, name)
    step = torch.load(checkpoint_path, map_location="cpu", weights_only=False)["global_step"]
    shape_flag, value = RUNS[name][2]
    refused = subprocess.run([sys.executable, script_of(name), "--log-dir", str(tmp_path), *flags(name, 2 * total),
                              "--resume", str(checkpoint_path), shape_flag, value], cwd=ROOT, capture_output=True,
                             text=True, timeout=120)  # fmt: skip
    assert refused.returncode == 2, refused.stderr[-1500:]
    lines = refused.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and shape_flag in lines[0], refused.stderr[-1500:]
    done = subprocess.run([sys.executable, script_of(name), "--resume", str(checkpoint_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    spent = f"its run did {step} agent steps and --total-timesteps {total}"  # the run's budget, from its args.json
    assert done.returncode == 2 and spent in done.stderr and "would learn nothing" in done.stderr, done.stderr[-1500:]
    refusals_before_training(name, run_dir, step, total, tmp_path)
    (run_dir / "checkpoint.tmp").write_bytes(b"left by a write that kill -9 cut short")
    # only what changes is given: the env, the workers and the rest are the run's own (its args.json); --seed 1 is
    # the default, and given, it replaces the run's 3
    resumed = subprocess.run([sys.executable, script_of(name), "--resume", str(checkpoint_path), "--total-timesteps",
                              str(2 * total), "--seed", "1"], cwd=ROOT, capture_output=True, text=True,
                             timeout=300)  # fmt: skip
    assert resumed.returncode == 0, resumed.stderr[-1500:]
    said = [line for line in resumed.stdout.splitlines() if line.startswith("resuming")]
    assert len(said) == 1 and f"step {step}" in said[0], resumed.stdout[-1500:]
    assert said[0].endswith(f"flags that differ from its run: --seed 1 (was 3), --total-timesteps {2 * total} (was "
                            f"{total})"), said  # fmt: skip
    assert json.loads((run_dir / "args.json").read_text())["args"]["seed"] == 1
    assert not (run_dir / "checkpoint.tmp").exists(), "the resume removes what a killed write left"


def refusals_before_training(name: str, run_dir, step: int, total: int, tmp_path) -> None:
    """What a resume or an evaluation of a finished run must refuse, each in one error line and exit 2, before it
    trains or plays: a directory without a checkpoint.pt given as the checkpoint, a run directory another process
    holds, an --env-id given at its default that is not the saved run's, and a model whose weights are NaN. A
    checkpoint copied without its args.json still resumes as its own run (its budget is what stops it here, not
    another env's defaults)."""
    default_env = importlib.import_module(name).Args().env_id

    def refused(*argv: str) -> str:
        p = subprocess.run([sys.executable, script_of(name), *argv], cwd=ROOT, capture_output=True, text=True,
                           timeout=120)  # fmt: skip
        lines = p.stderr.strip().splitlines()
        assert p.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), (argv, p.stderr[-1500:])
        return lines[0]

    (tmp_path / "empty").mkdir()
    line = refused("--resume", str(tmp_path / "empty"), "--total-timesteps", str(2 * total))
    assert "without a checkpoint.pt" in line, line
    fd = os.open(run_dir / ".lock", os.O_RDWR | os.O_CREAT)
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX)  # as a run still writing there holds it
        assert "another run is writing to" in refused("--resume", str(run_dir / "checkpoint.pt"), "--total-timesteps",
                                                      str(2 * total))  # fmt: skip
    finally:
        os.close(fd)
    if name != "apex_ddpg":  # the Atari protocol a run's envs were made with stays (apex_ddpg has no Atari)
        saved = json.loads((run_dir / "args.json").read_text())["args"]["atari_protocol"]
        other = {"deepmind": "machado", "machado": "deepmind"}[saved]
        line = refused("--resume", str(run_dir / "checkpoint.pt"), "--total-timesteps", str(2 * total),
                       "--atari-protocol", other)  # fmt: skip
        assert f"atari_protocol {saved}" in line, line
    cut = tmp_path / "cut"
    cut.mkdir()
    whole = (run_dir / "checkpoint.pt").read_bytes()
    (cut / "checkpoint.pt").write_bytes(whole[: len(whole) // 2])
    shutil.copy(run_dir / "args.json", cut / "args.json")
    assert "truncated" in refused("--resume", str(cut / "checkpoint.pt"), "--total-timesteps", str(2 * total))
    alone = tmp_path / "copied"
    alone.mkdir()
    shutil.copy(run_dir / "checkpoint.pt", alone / "checkpoint.pt")
    line = refused("--resume", str(alone / "checkpoint.pt"))
    assert f"its run did {step} agent steps and --total-timesteps {total}" in line, line
    if RUNS[name][0][RUNS[name][0].index("--env-id") + 1] != default_env:
        assert "contradicts" in refused("--eval-only", str(run_dir / "model.pt"), "--env-id", default_env)
    model = torch.load(run_dir / "model.pt", map_location="cpu")
    next(v for v in model.values() if v.is_floating_point()).view(-1)[0] = math.nan
    torch.save(model, tmp_path / "nan.pt")
    shutil.copy(run_dir / "args.json", tmp_path / "args.json")
    assert "NaN" in refused("--eval-only", str(tmp_path / "nan.pt"))


def said_what_it_did(out: str, run_dir, name: str) -> None:
    """A finished run's console: the run directory first, lines with the share done and the time left, then the
    summary naming every file the run wrote and the commands that show and evaluate it."""
    lines = out.splitlines()
    assert lines[0].startswith(f"run directory: {run_dir}  ("), lines[:2]
    assert any(re.search(r"^global_step=\d+ SPS=\d+ mean_return=\S+ done=[\d.]+% left=\S+", x) for x in lines), out
    ended = [x for x in lines if x.startswith("finished: ")]
    assert len(ended) == 1 and re.match(r"finished: ([\d,]+) of \1 agent steps in \d", ended[0]), ended
    wrote = next(x for x in lines if x.startswith(f"wrote to {run_dir}: ")).split(": ", 1)[1].split(", ")
    assert {"args.json", "checkpoint.pt", "model.pt"} <= set(wrote), wrote
    assert any(f.startswith("events.out.tfevents.") for f in wrote), wrote
    assert set(wrote) <= {p.name + "/" * p.is_dir() for p in run_dir.iterdir()}, wrote  # what is there, no more
    assert f"next: tensorboard --logdir {run_dir}" in lines, out[-1500:]
    assert f"      python {script_of(name)} --eval-only {run_dir / 'model.pt'}" in lines, out[-1500:]
    assert "--resume" not in out.split("finished: ")[1], "a finished run has nothing to continue"


@pytest.mark.parametrize("name", SCRIPTS)
def test_a_tyro_without_its_private_help_formatter_still_runs_the_script(name):
    """parse_args wraps tyro's private `_strings.remove_single_line_breaks`: a tyro that renames or moves it must still
    parse and print --help (in tyro's own wrapping), not break every script at import."""
    # tyro as renamed: its own modules call the helper by its new name (they keep the module they imported), and the
    # `tyro._strings` a script reaches has no `remove_single_line_breaks`
    code = (
        "import runpy, sys, types, tyro, tyro._strings as s; m = types.ModuleType(s.__name__); "
        "m.__dict__.update({k: v for k, v in vars(s).items() if k != 'remove_single_line_breaks'}); tyro._strings = m; "
        f"sys.argv = ['{script_of(name)}', '--help']; runpy.run_path('{script_of(name)}', run_name='__main__')"
    )
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "--total-timesteps" in p.stdout, p.stderr[-1500:]


@pytest.mark.parametrize("name", SCRIPTS)
def test_help_gives_each_flag_whole_sentences_and_one_default(name, monkeypatch, capsys):
    """tyro keeps a docstring's line break before an indented line, which cuts a flag's help mid-sentence: every
    line break inside a flag's help must be a wrap (the next word did not fit), and each help has one default."""
    monkeypatch.setenv("COLUMNS", "160")
    with pytest.raises(SystemExit) as e:
        importlib.import_module(name).parse_args(["--help"])
    assert e.value.code in (0, None)
    lines = capsys.readouterr().out.splitlines()  # not a terminal: tyro draws the box as a title and a rule
    rule = next(i for i, line in enumerate(lines) if set(line.strip()) == {"-"})
    width, rows = len(lines[rule].rstrip()), [line.rstrip() for line in lines[rule + 1 :] if line.strip()]
    entries: list[list[str]] = []  # per flag: its rows, the flag's own first
    for row in rows:
        if re.match(r" {0,3}-", row):  # a flag at the left margin; its help (which may start with --) is indented
            entries.append([row])
        else:
            entries[-1].append(row)
    assert len(entries) > 20, entries
    for entry in entries[1:]:  # [0]: -h, --help
        own_help = re.search(r"\S\s{2,}\S", entry[0])  # a long flag's help starts on the next row
        for row, after in itertools.pairwise(entry if own_help else entry[1:]):
            word = after.split()[0]
            assert len(row) + 1 + len(word) > width - 2, f"help cut mid-sentence before {word!r}:\n" + "\n".join(entry)
        assert " ".join(entry).count("(default:") == 1, entry


IMPORT_HOOK = """
import os, runpy, signal, sys

class InterruptAtTorch:
    def find_spec(self, name, path=None, target=None):
        if name == "torch":
            sys.meta_path.remove(self)
            os.kill(os.getpid(), signal.SIGINT)  # Ctrl+C while the script's imports load
        return None

sys.meta_path.insert(0, InterruptAtTorch())
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


# the same Ctrl+C, taken while a finalizer runs (multiprocessing's Finalize objects are weakref callbacks like this
# one): an exception raised there is printed as "Exception ignored in: ..." and swallowed, and the process goes on
IMPORT_HOOK_IN_A_FINALIZER = IMPORT_HOOK.replace(
    "            os.kill(os.getpid(), signal.SIGINT)  # Ctrl+C while the script's imports load",
    "            import weakref\n"
    "            doomed = type('Doomed', (), {})()\n"
    "            ref = weakref.ref(doomed, lambda _: os.kill(os.getpid(), signal.SIGINT))\n"
    "            del doomed  # the callback runs here, and the handler inside it",
)


@pytest.mark.parametrize("name", SCRIPTS)
@pytest.mark.parametrize("hook", [IMPORT_HOOK, IMPORT_HOOK_IN_A_FINALIZER], ids=["import", "in-a-finalizer"])
def test_ctrl_c_while_importing_exits_quietly(name, hook):
    proc = subprocess.run([sys.executable, "-c", hook, script_of(name), "--help"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode == 128 + signal.SIGINT, proc.stderr[-1500:]
    assert "Traceback" not in proc.stderr and "Exception ignored" not in proc.stderr, proc.stderr[-1500:]


@pytest.mark.parametrize("name", SCRIPTS)
@pytest.mark.parametrize("argv", [("--no-such-flag", "3"), ("--seed", "abc")], ids=["unknown", "not-an-int"])
def test_a_flag_tyro_cannot_parse_is_one_error_line(name, argv):
    proc = subprocess.run([sys.executable, script_of(name), *argv], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and argv[0] in lines[0], proc.stderr
    assert "--help" in lines[0]


@pytest.mark.parametrize("name", SCRIPTS)
def test_a_learning_rate_above_one_is_warned_of_by_name_before_the_run(name, tmp_path, capsys):
    """A learning rate of 1e6 passes the `> 0` rule, and the run it starts can end with exit status 0, its losses huge
    but finite: the run says so at its start, naming each such flag; a learning rate of 0.5 draws no warning."""
    module = importlib.import_module(name)
    rates = [f.name for f in dataclasses.fields(module.Args) if f.name.endswith("learning_rate")]
    module.flag_warnings(module.Args(**dict.fromkeys(rates, 0.5)))
    assert capsys.readouterr().err == ""
    module.flag_warnings(module.Args(**dict.fromkeys(rates, 1e6)))
    lines = capsys.readouterr().err.splitlines()
    assert [line.split()[1] for line in lines] == [module.flag(rate) for rate in rates], lines
    assert all(line.startswith("warning: ") and " 1e+06 is above 1: " in line for line in lines), lines
    flag = module.flag(rates[0])
    cmd = [sys.executable, script_of(name), "--log-dir", str(tmp_path), *flags(name, RUNS[name][1]), flag, "1e6",
           "--eval-episodes", "0", "--checkpoint-interval", "0"]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert f"warning: {flag} 1e+06 is above 1: " in proc.stderr, proc.stderr[-1500:]


# ---- issue 64, the fifth probe: resumes, names and paths, a closed stdout, the seed, the evaluation's console ----


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """`copy(name, dest)`: a finished tiny run of the script (args.json, checkpoint.pt, model.pt), made once per test
    worker and script, copied to `dest` so that a test may resume or edit it; the copy's run directory."""
    made = {}

    def copy(name: str, dest):
        if name not in made:
            logs = tmp_path_factory.mktemp(name)
            cmd = [sys.executable, script_of(name), "--log-dir", str(logs), *flags(name, RUNS[name][1]),
                   "--checkpoint-interval", "3600", "--save-model", "--eval-episodes", "0"]  # fmt: skip
            p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
            assert p.returncode == 0, p.stderr[-1500:]
            made[name] = only_run_dir(logs)
        run_dir = dest / made[name].name
        shutil.copytree(made[name], run_dir, ignore=shutil.ignore_patterns(".lock"))
        return run_dir

    return copy


def one_error_line(p: subprocess.CompletedProcess) -> str:
    """The one error line of a command refused as bad input (exit 2, no traceback)."""
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), p.stderr[-1500:]
    return lines[0]


@pytest.mark.parametrize("name", SCRIPTS)
def test_a_plain_resume_takes_the_checkpoints_flags_not_those_of_a_failed_resume(name, tmp_path):
    """A resume writes its flags to args.json at its start; one that fails before it writes a checkpoint (a learning
    rate that diverges) must not hand them to the next `--resume DIR/checkpoint.pt`, which continues the run that the
    checkpoint holds. Checked on resumed_args: the checkpoint's flags, args.json as the failed resume left it."""
    module = importlib.import_module(name)
    rates = [f.name for f in dataclasses.fields(module.Args) if f.name.endswith("learning_rate")]
    run = module.Args(env_id="CartPole-v1", seed=3, **{rate: 0.0005 for rate in rates})
    torch.save({"args": dataclasses.asdict(run), "meta": {}, "global_step": 64}, tmp_path / "checkpoint.pt")
    failed = dataclasses.replace(run, **{rate: 1e38 for rate in rates}, resume=str(tmp_path / "checkpoint.pt"))
    (tmp_path / "args.json").write_text(json.dumps(dict(script=script_of(name), args=dataclasses.asdict(failed))))
    args = module.resumed_args(module.parse_args(["--resume", str(tmp_path / "checkpoint.pt")]))
    assert {rate: getattr(args, rate) for rate in rates} == dict.fromkeys(rates, 0.0005)
    assert args.seed == 3 and args.env_id == "CartPole-v1"
    given = module.resumed_args(module.parse_args(["--resume", str(tmp_path / "checkpoint.pt"), "--seed", "1"]))
    assert given.seed == 1, "a flag the command line gives still replaces the run's"


@pytest.mark.parametrize("name", ["impala_monobeast", "hts_a2c"])
def test_a_resume_after_one_that_diverged_continues_the_run_as_it_was(name, tmp_path, finished_run):
    """The issue's commands: a resume with --learning-rate 1e38 stops (a non-finite loss), and the plain resume after
    it continues the checkpoint's run: it names no learning rate among the flags that differ, and finishes."""
    run_dir = finished_run(name, tmp_path)
    checkpoint, total = run_dir / "checkpoint.pt", 2 * RUNS[name][1]
    rate = json.loads((run_dir / "args.json").read_text())["args"]["learning_rate"]
    resume = [sys.executable, script_of(name), "--resume", str(checkpoint), "--total-timesteps", str(total)]
    diverged = subprocess.run([*resume, "--learning-rate", "1e38"], cwd=ROOT, capture_output=True, text=True,
                              timeout=300)  # fmt: skip
    assert diverged.returncode == 1, diverged.stderr[-1500:]  # stopped, whichever thread met the NaN first
    again = subprocess.run(resume, cwd=ROOT, capture_output=True, text=True, timeout=300)
    said = [line for line in again.stdout.splitlines() if line.startswith("resuming")]
    assert len(said) == 1 and said[0].endswith(f"flags that differ from its run: --total-timesteps {total} (was "
                                               f"{RUNS[name][1]})"), again.stdout[-1500:]  # fmt: skip
    assert again.returncode == 0, again.stderr[-1500:]
    assert json.loads((run_dir / "args.json").read_text())["args"]["learning_rate"] == rate


@pytest.mark.parametrize("name", SCRIPTS)
def test_a_resume_refuses_a_checkpoint_whose_weights_hold_nan(name, tmp_path, finished_run):
    """One NaN edited into a good checkpoint's model: --resume refuses it in one error line, as --eval-only does,
    before it trains (a run from NaN weights would stop at its first loss, or play on with a broken policy)."""
    run_dir = finished_run(name, tmp_path)
    checkpoint = torch.load(run_dir / "checkpoint.pt", map_location="cpu", weights_only=False)
    next(v for v in checkpoint["model"].values() if v.is_floating_point()).view(-1)[0] = math.nan
    torch.save(checkpoint, run_dir / "checkpoint.pt")
    for argv in (("--resume", run_dir / "checkpoint.pt", "--total-timesteps", 2 * RUNS[name][1]),
                 ("--eval-only", run_dir / "checkpoint.pt")):  # fmt: skip
        p = subprocess.run([sys.executable, script_of(name), *map(str, argv)], cwd=ROOT, capture_output=True,
                           text=True, timeout=120)  # fmt: skip
        assert "NaN" in one_error_line(p), argv
    assert not any(p.name.startswith("eval-") for p in run_dir.iterdir())


@pytest.mark.parametrize("name", SCRIPTS)
def test_resume_takes_a_run_directory_for_its_checkpoint_and_says_what_to_give_otherwise(name, tmp_path, capsys):
    module = importlib.import_module(name)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    with pytest.raises(SystemExit) as e:  # a directory without a checkpoint: the line says what to give
        module.resumed_args(module.parse_args(["--resume", str(run_dir)]))
    line = capsys.readouterr().err.strip()
    assert e.value.code == 2 and line.startswith(f"error: --resume {run_dir}: ") and "checkpoint.pt" in line, line
    run = module.Args(env_id="CartPole-v1", seed=3)
    torch.save({"args": dataclasses.asdict(run), "meta": {}, "global_step": 64}, run_dir / "checkpoint.pt")
    args = module.resumed_args(module.parse_args(["--resume", str(run_dir), "--total-timesteps", "4096"]))
    assert args.resume == str(run_dir / "checkpoint.pt") and args.seed == 3 and args.total_timesteps == 4096


@pytest.mark.parametrize("name", ["hts_ppo", "apex_dqn"])
def test_a_resume_from_a_run_directory_continues_its_checkpoint(name, tmp_path, finished_run):
    run_dir = finished_run(name, tmp_path)
    p = subprocess.run([sys.executable, script_of(name), "--resume", str(run_dir), "--total-timesteps",
                        str(2 * RUNS[name][1])], cwd=ROOT, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert p.returncode == 0, p.stderr[-1500:]
    assert f"resuming {run_dir / 'checkpoint.pt'} from step {RUNS[name][1]}" in p.stdout, p.stdout[-1500:]
    step = torch.load(run_dir / "checkpoint.pt", map_location="cpu", weights_only=False)["global_step"]
    assert step == 2 * RUNS[name][1] and [d.name for d in tmp_path.iterdir()] == [run_dir.name]


@pytest.mark.parametrize("name", SCRIPTS)
def test_an_exp_name_that_is_a_path_is_refused(name, tmp_path):
    """--exp-name is one part of the run directory's name: a '/' in it would put the run elsewhere (outside --log-dir
    with ../../..), leave stray directories or nest them. Refused as bad input, with no directory made."""
    module = importlib.import_module(name)
    for exp_name in ("../../../escape", "../../escape", "x/y"):
        line = module.check_flags(module.Args(exp_name=exp_name))  # validate's first check
        assert line and line.startswith(f"--exp-name {exp_name} ") and "'/'" in line, line
    assert module.check_flags(module.Args(exp_name="v1..v2 lr=0.5")) is None
    logs = tmp_path / "a" / "b" / "runs"
    cmd = [sys.executable, script_of(name), "--log-dir", str(logs), *flags(name, RUNS[name][1]), "--exp-name",
           "../../escape"]  # fmt: skip
    assert "--exp-name" in one_error_line(subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120))
    assert not (tmp_path / "a").exists()


@pytest.mark.parametrize("name", SCRIPTS)
def test_a_read_only_checkpoint_is_never_replaced(name, tmp_path):
    """A read-only file says "do not replace me" (rm asks first, editors refuse): atomic_save refuses to write over it
    (the run's error line, the file kept as it is, mode included), and nothing writes it behind the user's back."""
    module = importlib.import_module(name)
    path = tmp_path / "checkpoint.pt"
    module.atomic_save({"model": {"w": torch.ones(3)}, "global_step": 10}, path)
    path.chmod(0o444)
    with pytest.raises(module.WriteError, match="read-only"):
        module.atomic_save({"model": {"w": torch.zeros(3)}, "global_step": 20}, path)
    assert torch.load(path)["global_step"] == 10 and path.stat().st_mode & 0o777 == 0o444
    assert not path.with_suffix(".tmp").exists()
    path.chmod(0o640)  # writable: replaced, and its mode kept
    module.atomic_save({"model": {"w": torch.zeros(3)}, "global_step": 20}, path)
    assert torch.load(path)["global_step"] == 20 and path.stat().st_mode & 0o777 == 0o640


@pytest.mark.parametrize("name", ["impala_monobeast", "gala_a2c"])
def test_a_resume_of_a_read_only_checkpoint_is_refused_before_it_trains(name, tmp_path, finished_run):
    run_dir = finished_run(name, tmp_path)
    checkpoint = run_dir / "checkpoint.pt"
    checkpoint.chmod(0o444)
    before = checkpoint.read_bytes()
    p = subprocess.run([sys.executable, script_of(name), "--resume", str(checkpoint), "--total-timesteps",
                        str(2 * RUNS[name][1])], cwd=ROOT, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert "read-only" in one_error_line(p)
    assert checkpoint.read_bytes() == before and checkpoint.stat().st_mode & 0o777 == 0o444


@pytest.mark.parametrize("name", SCRIPTS)
def test_a_run_whose_stdout_closes_trains_to_its_budget(name, tmp_path):
    """`python SCRIPT ... | head -2`: the reader of stdout goes away after the first line, and the run goes on to its
    budget without its console, every file written as it would be (checkpoint, events, model, the evaluation)."""
    total, logs = RUNS[name][1], tmp_path / "runs"
    cmd = [sys.executable, script_of(name), "--log-dir", str(logs), *flags(name, total), "--checkpoint-interval",
           "3600", "--save-model", "--eval-episodes", "2"]  # fmt: skip
    with open(tmp_path / "stderr", "w") as err:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=err, text=True, start_new_session=True)
        try:
            assert proc.stdout.readline().startswith("run directory: ")
            proc.stdout.close()  # as `head -1` exits
            code = proc.wait(timeout=300)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    stderr = (tmp_path / "stderr").read_text()
    assert code == 0 and "Traceback" not in stderr and "Exception ignored" not in stderr, stderr[-1500:]
    run_dir = only_run_dir(logs)
    assert torch.load(run_dir / "checkpoint.pt", map_location="cpu", weights_only=False)["global_step"] == total
    assert (run_dir / "model.pt").is_file() and len(scalars(run_dir)["eval/episodic_return"]) >= 2


@pytest.mark.parametrize("name", SCRIPTS)
def test_a_negative_seed_is_one_error_line(name, tmp_path):
    module = importlib.import_module(name)
    assert module.check_flags(module.Args(seed=-1)) == "--seed must be >= 0, got -1"
    assert module.check_flags(module.Args(seed=0)) is None
    cmd = [sys.executable, script_of(name), "--log-dir", str(tmp_path), *flags(name, RUNS[name][1]), "--seed", "-1"]
    line = one_error_line(subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120))
    assert line == "error: --seed must be >= 0, got -1" and not any(tmp_path.iterdir())


@pytest.mark.parametrize("name", SCRIPTS)
def test_a_long_evaluation_prints_its_first_games_then_a_running_summary(name, tmp_path, monkeypatch, capsys):
    """4,000 CartPole games are 4,000 lines in 10 s: the evaluation prints its first 10 games one by one, then at
    most a line every few seconds with the games so far and their mean (how many depends on the machine's speed),
    and a last line with the mean over all of them; TensorBoard still gets every game."""
    module = importlib.import_module(name)
    returns = [float(i % 7) for i in range(40)]
    monkeypatch.setattr(module, "evaluate", lambda *a: iter(returns))
    logged = []
    writer = types.SimpleNamespace(add_scalar=lambda tag, value, step: logged.append((tag, value, step)))
    args = module.Args(eval_episodes=40)
    signals = module.StopSignals(threading.Event())
    try:
        result = module.final_evaluation(nn.Linear(1, 1), args, tmp_path, 96, signals, writer, torch.device("cpu"))
    finally:
        signals.restore()
    assert result == (0, None)
    assert logged == [("eval/episodic_return", r, 96 + i) for i, r in enumerate(returns)]
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "evaluating the final policy: 40 episodes"
    assert lines[1:11] == [f"eval episode {i}: return {r:.2f}" for i, r in enumerate(returns[:10])]
    assert lines[-1] == f"mean return over 40 episodes: {np.mean(returns):.2f}", lines
    assert all(re.fullmatch(r"eval: \d+ of 40 games, mean return \S+", line) for line in lines[11:-1]), lines


@pytest.mark.parametrize("name", ["apex_dqn", "cleanba_ppo_impala"])
def test_ctrl_c_in_an_eval_only_keeps_the_games_played(name, tmp_path, finished_run):
    """--eval-only stopped by Ctrl+C: the games played are written to eval-*.json and summed up, as the final
    evaluation keeps them, and the run exits with 128 + SIGINT."""
    run_dir = finished_run(name, tmp_path)
    cmd = [sys.executable, script_of(name), "--eval-only", str(run_dir / "model.pt"), "--eval-episodes", "1000000"]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                            start_new_session=True)  # fmt: skip
    hang = threading.Timer(240, os.killpg, (proc.pid, signal.SIGKILL))  # a deadline that only catches a hang
    hang.start()
    try:
        for line in proc.stdout:
            if line.startswith("eval episode 0: return"):
                break
        else:
            pytest.fail(f"no evaluation game ended (exit {proc.wait()}): {proc.stderr.read()[-1500:]}")
        proc.send_signal(signal.SIGINT)
        code, out, err = finish(proc)
    finally:
        hang.cancel()
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert code == 128 + signal.SIGINT and "Traceback" not in err, err[-1500:]
    [report] = run_dir.glob("eval-*.json")
    saved = json.loads(report.read_text())
    assert set(saved) == {"model", "episodes", "greedy", "returns", "mean", "settings"}
    assert saved["episodes"] == len(saved["returns"]) >= 1 and saved["mean"] == pytest.approx(np.mean(saved["returns"]))
    assert saved["returns"][0] == pytest.approx(float(line.split()[-1]), abs=0.005)
    assert f"mean return over {saved['episodes']} episodes: " in out, out[-1500:]
    assert re.search(rf"stopped by SIGINT in the evaluation, after {saved['episodes']} of 1000000 games", err), err


@pytest.mark.parametrize("name", SCRIPTS)
@pytest.mark.parametrize("ranks", [None, 2])
def test_the_summary_commands_paste_into_a_shell_as_printed(name, ranks, tmp_path, monkeypatch, capsys):
    """Issue 64, item 6: a --log-dir with spaces and non-ASCII characters, and a run under torchrun (2 ranks on one
    machine): each command the summary prints splits, as a POSIX shell splits it (shlex), into the command that goes
    on from the run: its own launcher, the script, the flag and the file."""
    module = importlib.import_module(name)
    if ranks:
        monkeypatch.setenv("WORLD_SIZE", str(ranks))
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str(ranks))
    run_dir = tmp_path / "my runs" / "ünï©ødé 日本 $HOME;'x'"
    run_dir.mkdir(parents=True)
    for file in ("checkpoint.pt", "model.pt"):
        (run_dir / file).write_bytes(b"")
    progress = module.Progress(run_dir, 1000, "a plan")
    progress.summary(500, 130)
    lines = capsys.readouterr().out.split("next: ", 1)[1].splitlines()
    launch = ["python"] if not ranks else ["torchrun", "--nproc-per-node", str(ranks), "--standalone"]
    assert [shlex.split(line) for line in lines] == [
        ["tensorboard", "--logdir", str(run_dir)],
        [*launch, script_of(name), "--resume", str(run_dir / "checkpoint.pt")],
        ["python", script_of(name), "--eval-only", str(run_dir / "model.pt")],
    ]


@pytest.mark.parametrize("name", SCRIPTS)
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_during_the_start_is_one_line_and_leaves_no_run_directory(name, signum, tmp_path, monkeypatch, capsys):
    """Issue 64, item 9: a signal while the run starts (here as the process sets up torch, after its run directory
    and args.json are made) ends it before any worker starts, with one line and 128 + signum, and no directory."""
    module = importlib.import_module(name)
    init_torch = module.init_torch

    def signalled(*args, **kwargs):
        device = init_torch(*args, **kwargs)
        os.kill(os.getpid(), signum)  # delivered at once to this thread: the run's handler takes it
        return device

    monkeypatch.setattr(module, "init_torch", signalled)
    before = signal.getsignal(signum)
    with pytest.raises(SystemExit) as exit_status:
        module.main(module.parse_args(["--log-dir", str(tmp_path / "runs"), *flags(name, RUNS[name][1])]))
    assert exit_status.value.code == 128 + signum
    name_of = signal.Signals(signum).name
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"stopped by {name_of} during the start"
    assert not any((tmp_path / "runs").iterdir())
    assert signal.getsignal(signum) == before, "the handler the process had before is back"


def look_at_the_stop_forever(stop):
    while True:
        stop.is_set()


def look_set_look(stop, seen):
    seen.extend([stop.is_set(), stop.set(), stop.is_set()])


@pytest.mark.parametrize("name", ["a3c_large_batch", "apex_ddpg", "apex_dqn", "gala_a2c", "impala_monobeast"])
def test_a_worker_killed_while_it_looks_at_the_stop_cannot_block_main(name):
    """The stop that main shares with its worker processes: a worker SIGKILLed at any moment (the OOM killer), here
    while it reads the stop over and over, leaves main free to read it and set it. A multiprocessing Event fails this
    in about a third of the kills (its read takes a lock shared by every process, which a killed reader never gives
    back: main then hangs at its next look, as impala did once under CI), so it is killed 20 times."""
    stop_flag, ctx = importlib.import_module(name).StopFlag, torch.multiprocessing.get_context("fork")
    for kill in range(20):
        stop = stop_flag(ctx)
        worker = ctx.Process(target=look_at_the_stop_forever, args=(stop,), daemon=True)
        worker.start()
        time.sleep(0.05)
        os.kill(worker.pid, signal.SIGKILL)
        worker.join()
        seen = []
        main_side = threading.Thread(target=look_set_look, args=(stop, seen), daemon=True)
        main_side.start()
        main_side.join(timeout=30)  # only a hang takes this long
        assert seen == [False, None, True], f"kill {kill}: main blocked on the stop after the worker died"
