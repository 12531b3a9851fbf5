"""benchmarks/measure.py against hand-computed values: steady rate from a known event stream (TensorBoard, CSV,
console), ceiling and CPU bound, PSS parsing and growth, Eq. 7, the straggler env, the JSON."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
from helpers import alive, wait_for
from torch.utils.tensorboard import SummaryWriter

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import measure  # noqa: E402


def test_steady_rate_drops_the_warmup_share_of_the_logged_span():
    walls = [100.0, 101.0, 102.0, 103.0, 104.0]
    steps = [0, 100, 300, 500, 700]
    # warm-up 0.25 of the 4 s span: points before 101 s are dropped, so (700 - 100) / (104 - 101)
    assert measure.steady_rate(walls, steps, 0.25) == (200.0, 600)
    assert measure.steady_rate(walls, steps, 0.0) == (175.0, 700)
    # a warm-up past the last points still keeps two of them
    assert measure.steady_rate(walls, steps, 0.99) == (200.0, 200)
    assert math.isnan(measure.steady_rate(walls[:2], steps[:2])[0])


def test_run_rate_reads_tensorboard_events_with_lag_and_timing_means(tmp_path):
    w = SummaryWriter(str(tmp_path / "runs" / "CartPole-v1__x__1__1"))
    for i in range(9):  # one point per second, 50 agent steps each, from wall time 1000
        w.add_scalar("charts/SPS", 1.0, 50 * i, walltime=1000.0 + i)
        w.add_scalar("charts/policy_lag", float(i % 3), 50 * i, walltime=1000.0 + i)
        w.add_scalar("timing/train", 0.1 * i, 50 * i, walltime=1000.0 + i)
        w.add_scalar("losses/value_loss", 7.0, 50 * i, walltime=1000.0 + i)
    w.close()
    r = measure.run_rate(tmp_path, console=[(0.0, 1), (1.0, 2), (2.0, 3)], warmup=0.25)
    # points at 1002..1008 s are kept: (400 - 100) / 6 s
    assert r["rate_source"] == "tensorboard" and r["sps"] == pytest.approx(50.0) and r["steps_measured"] == 300
    assert r["agent_steps"] == 400
    kept = [i for i in range(9) if i >= 2]
    assert r["policy_lag_mean"] == pytest.approx(np.mean([i % 3 for i in kept])) and r["policy_lag_max"] == 2.0
    assert r["scalars"] == {"timing/train": pytest.approx(np.mean([0.1 * i for i in kept]))}


def test_torchbeast_csv_log_with_fields_added_later(tmp_path):
    run = tmp_path / "torchbeast-123"
    run.mkdir()
    # TorchBeast's FileWriter: `# ` + the first fields, rows by position, fields.csv with the grown field list
    rows = [f"{i},{500.0 + 2 * i},{640 * i},{-21 + i}" for i in range(6)]
    (run / "logs.csv").write_text("# _tick,_time,step\n" + "\n".join(rows) + "\n")
    (run / "fields.csv").write_text("_tick,_time,step\n_tick,_time,step,mean_episode_return\n")
    times, steps = measure.read_csv_log(run / "logs.csv")
    assert times == [500.0 + 2 * i for i in range(6)] and steps == [640 * i for i in range(6)]
    r = measure.run_rate(tmp_path, console=[], warmup=0.0)
    assert r["rate_source"] == "csv" and r["sps"] == pytest.approx(320.0)
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "progress.csv").write_text("global_step,wall_time\n0,10\n100,11\n")
    assert measure.read_csv_log(plain / "progress.csv") == ([10.0, 11.0], [0.0, 100.0])


def test_console_lines_are_the_last_resort(tmp_path):
    console = [(10.0 + i, 1000 * i) for i in range(5)]
    r = measure.run_rate(tmp_path, console, warmup=0.5)
    assert r["rate_source"] == "console" and r["sps"] == pytest.approx(1000.0) and r["steps_measured"] == 2000
    assert measure.CONSOLE_STEP.search("global_step=4096 SPS=812 mean_return=-20.5").group(1) == "4096"


def test_ceiling_and_cpu_bound_known_values():
    assert measure.ceiling(1000.0, 2000.0, 4000.0) == pytest.approx(4000.0 / 7.0)
    assert measure.ceiling(1000.0, 1000.0) == pytest.approx(500.0)  # no train term
    # 2 cores; 0.5 + 0.25 + 1.25 ms of CPU per agent step: 2 / 2 ms
    assert measure.cpu_bound(2, {"env": 5e-4, "infer": 2.5e-4, "train": 1.25e-3}) == pytest.approx(1000.0)


def test_pieces_single_is_one_process_one_thread():
    p = measure.Pieces("CartPole-v1", 8, 8, env_threads=2, env_copies=3, infer_threads=2, infer_copies=3,
                       train_threads=2, train_copies=3, learner_obs=64)  # fmt: skip
    one = p.single()
    assert (one.env_threads, one.env_copies, one.infer_threads, one.infer_copies) == (1, 1, 1, 1)
    assert (one.train_threads, one.train_copies, one.learner_obs, one.num_envs) == (1, 1, 64, 8)


def test_pss_parsing_and_process_tree():
    text = "55d0-7ffc ---p 00000000 00:00 0 [rollup]\nRss:              123456 kB\nPss:               98765 kB\n"
    text += "Pss_Anon:          40000 kB\nShared_Clean:        100 kB\n"
    assert measure.pss_kib(text) == 98765 and measure.pss_kib("Rss: 5 kB\n") == 0
    child = subprocess.Popen(["sleep", "30"])
    try:
        assert child.pid in measure.process_tree(os.getpid())
        assert measure.tree_pss_mib(os.getpid()) > measure.tree_pss_mib(child.pid) > 0
    finally:
        child.kill()
        child.wait()
    assert measure.tree_pss_mib(child.pid) == 0.0  # gone: counts nothing


def test_pss_growth_known_series():
    t = np.arange(0, 100, 2.0)  # a sample every 2 s for 100 s
    pss = np.where(t < 20, 50.0, 200.0 + 0.5 * t)  # start-up below, then a creep of 0.5 MiB/s = 30 MiB/min
    g = measure.pss_growth(t, pss, warmup=25.0, window=10.0)
    base = np.mean(200 + 0.5 * np.array([26, 28, 30, 32, 34]))  # samples in [25, 35)
    end = np.mean(200 + 0.5 * np.array([88, 90, 92, 94, 96, 98]))  # samples in the last 10 s: [88, 98]
    assert g["pss_baseline_mib"] == pytest.approx(base) and g["pss_end_mib"] == pytest.approx(end)
    assert g["pss_growth_pct"] == pytest.approx(100 * (end - base) / base) and g["pss_peak_mib"] == 249.0
    assert g["pss_slope_mib_per_min"] == pytest.approx(30.0)
    assert measure.pss_growth([], [], 1.0, 1.0)["pss_peak_mib"] is None


def test_eq7_known_cases():
    n, K, mean = 8, 8000, 0.01
    assert measure.eq7_time(n, K, 1, mean, 0.0) == pytest.approx(K / n * mean)  # constant step times
    # exponential step times (std = mean), lockstep: E[max of n] ~ mean (ln n + Euler's gamma), the classic result
    assert measure.eq7_time(n, K, 1, mean, mean) == pytest.approx(K / n * mean * (math.log(n) + np.euler_gamma))
    # synchronizing less often waits less for the slowest env; below shape 1 the approximation is undefined
    assert measure.eq7_time(n, K, 16, mean, 4 * mean) > 2 * measure.eq7_time(n, K, 512, mean, 4 * mean)
    assert math.isnan(measure.eq7_time(n, K, 1, mean, 2 * mean))


def test_straggler_step_times_have_the_requested_mean_and_std(monkeypatch):
    env = gym.make("benchmarks.measure:Straggler-v0", mean_ms=5.0, std_ms=10.0).unwrapped
    env.reset(seed=0)
    draws = np.array([env.step_time() for _ in range(20_000)])  # drawn, not slept: no timing in the assertion
    assert draws.mean() == pytest.approx(0.005, rel=0.05) and draws.std() == pytest.approx(0.010, rel=0.1)
    assert measure.StragglerEnv(mean_ms=3.0, std_ms=0.0).step_time() == 0.003
    monkeypatch.setenv("STRAGGLER_MEAN_MS", "7")
    monkeypatch.setenv("STRAGGLER_STD_MS", "1")
    env = measure.StragglerEnv()
    assert (env.mean_s, env.std_s) == (0.007, 0.001)


def test_run_command_stops_with_sigint_and_times_console_lines(tmp_path):
    code = (  # one second of start-up before the first console line, which the clock must not count
        "import time\ntry:\n    time.sleep(1.0)\n    for i in range(1000):\n"
        "        print(f'global_step={i} SPS=1 mean_return=0\\n', end='')\n        time.sleep(0.05)\n"  # one write
        "except KeyboardInterrupt:\n    print('interrupted')\n    raise SystemExit(130)\n"
    )
    run = measure.run_command([sys.executable, "-c", code], 1.5, cwd=tmp_path, log_dir=tmp_path, interval=0.2)
    assert run.exit_code == 130 and run.tail[-1] == "interrupted"
    assert run.started >= 1.0 and run.seconds >= run.started + 1.5  # the clock starts at its first console line
    assert len(run.console) >= 3 and [s for _, s in run.console] == list(range(len(run.console)))
    assert len(run.pss) >= 3 and all(m > 0 for _, m in run.pss)


def test_json_is_rounded_with_machine_metadata(tmp_path):
    meta = measure.machine_meta()
    assert {"command", "date", "cpu_model", "cores", "usable_cores", "torch", "load_average_start"} <= set(meta)
    measure.write_json(tmp_path / "out.json", meta, [dict(sps=1234.5678, ceiling=float("nan"), ok=np.bool_(True))])
    data = json.loads((tmp_path / "out.json").read_text())
    assert data["rows"] == [dict(sps=1235.0, ceiling=None, ok=True)] and "load_average_end" in data["meta"]
    assert not list(tmp_path.glob("*.tmp"))


def test_pieces_in_several_processes_sum_their_rates():
    p = measure.Pieces("CartPole-v1", 2, 2, env_copies=2)
    rate, cpu = measure.run_piece("env", p, 0.2)  # two forked copies at once, behind a barrier
    assert rate > 0 and cpu > 0
    one_rate, _ = measure.run_piece("env", p.single(), 0.2)  # one copy, in this process
    assert one_rate > 0


FAKE_RUN = """import os, signal, sys, time
worker = os.fork()
if worker == 0:  # a worker that outlives its parent unless the parent kills it
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    time.sleep(120)
    os._exit(0)
stop = []
if "hang" in sys.argv:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
else:
    signal.signal(signal.SIGINT, lambda *_: stop.append(130))
    signal.signal(signal.SIGTERM, lambda *_: stop.append(143))
print("global_step=0 SPS=0 mean_return=0", flush=True)  # not under way yet
print("global_step=8 SPS=1 mean_return=0", flush=True)
while not stop:
    if os.waitpid(worker, os.WNOHANG)[0]:
        print("error: worker died", flush=True)
        sys.exit(1)
    time.sleep(0.05)
if "leave" not in sys.argv:
    os.kill(worker, signal.SIGKILL)
print("stopped", flush=True)
sys.exit(stop[0])
"""


UNDER_WAY = "global_step=8 SPS=1 mean_return=0"


# (kind, fake's flag, victim) -> (exit code, hung, processes left behind, last line, workers found, error)
@pytest.mark.parametrize(
    ("kind", "flag", "victim", "expected"),
    [
        ("sigint", "", None, (130, False, 0, "stopped", None, None)),
        ("sigterm", "", None, (143, False, 0, "stopped", None, None)),
        ("killed_worker", "", 0, (1, False, 0, "error: worker died", 1, None)),
        ("sigint", "leave", None, (130, False, 1, "stopped", None, None)),  # its worker outlives it
        ("sigterm", "hang", None, (None, True, 2, UNDER_WAY, None, None)),  # it and its worker, after the timeout
        ("killed_worker", "", 3, (None, False, 0, UNDER_WAY, 1, "no worker 3 among the 1 worker processes")),
    ],
)
def test_time_to_stop_signals_once_under_way_and_kills_what_is_left(kind, flag, victim, expected, tmp_path):
    script = tmp_path / "fake_run.py"
    script.write_text(FAKE_RUN)
    timeout = 1.0 if flag == "hang" else 60.0  # only the fake that ignores signals may count as hung
    out = measure.time_to_stop([sys.executable, str(script), flag], kind, cwd=tmp_path, script="fake_run.py",
                               victim=victim, timeout=timeout)  # fmt: skip
    got = (out["exit_code"], out["hung"], len(out["left_behind"]), out["last_lines"][-1], out["workers"], out["error"])
    assert got == expected
    assert (out["seconds"] is not None) == (expected[0] is not None)
    wait_for(lambda: not any(alive(pid) for pid in out["left_behind"]), "the group's kill to end what was left")
