"""benchmarks/throughput.py: each adapter's flags parse with its script and give the pieces its shapes imply; the
summaries against hand-computed values; bad flags; a tiny end-to-end run on CartPole beside a fake external command
that writes TensorBoard events at a known rate; the env table."""

import dataclasses
import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest
import tyro

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import measure  # noqa: E402
import throughput as tp  # noqa: E402


def configs(labels, env_id="ALE/Breakout-v5", **kw):
    args = tp.Args(only=labels, env_id=env_id, **kw)
    assert tp.validate(args) is None
    return {c.label: c for c in tp.our_configs(args, labels, tp.STRAGGLER if args.straggler else env_id, 2)}, args


def test_pieces_follow_the_scripts_flags():
    c, _ = configs(list(tp.ADAPTERS))
    ppo = c["cleanba_ppo"].pieces  # 16 envs x 128 steps, 4 epochs x 4 minibatches after a bootstrap pass
    # 2 cores, 1 actor thread: 1 env thread beside the learner, 2 under --sync (the learner waits for the rollout)
    assert (ppo.actor_batch, ppo.env_threads, ppo.learner_obs, ppo.samples, ppo.epochs, ppo.minibatches) == (
        16, 1, 2048, 2048, 4, 4)  # fmt: skip
    assert c["cleanba_ppo_sync"].pieces.env_threads == 2
    assert (ppo.extra_forward_obs, ppo.optimizer, ppo.network, ppo.train_threads) == (16, "adam", "nature", 2)
    impala = c["cleanba_impala"].pieces  # 20 steps + the bootstrap observation, one pass
    assert (impala.learner_obs, impala.samples, impala.epochs, impala.optimizer) == (336, 320, 1, "rmsprop")
    batched, actor = c["impala_batched"].pieces, c["impala_actor"].pieces  # 4 actors x 4 envs, 8 unrolls of 80
    assert (batched.actor_batch, batched.infer_copies, batched.learner_obs, batched.samples) == (16, 1, 81 * 32, 2560)
    assert (actor.actor_batch, actor.infer_copies, actor.num_envs, actor.env_copies) == (4, 4, 4, 4)
    a3c, gala = c["a3c_hogwild"].pieces, c["gala_gossip"].pieces  # 2 workers / learners x 8 envs, N = 5
    assert (a3c.num_envs, a3c.train_copies, a3c.learner_obs, a3c.samples, a3c.train_threads) == (8, 2, 48, 40, 1)
    assert (gala.num_envs, gala.train_copies, gala.env_threads, gala.train_threads) == (8, 2, 1, 1)
    hts = c["hts_ppo"].pieces  # 4 executors x 4 envs, a value pass over 129 x 16, then 4 x 4 minibatches of 128 x 16
    assert (hts.actor_batch, hts.env_copies, hts.learner_obs, hts.extra_forward_obs, hts.epochs) == (
        4,
        4,
        2048,
        2064,
        4,
    )
    assert c["hts_a2c"].pieces.learner_obs == 6 * 16 and "--sync" in c["hts_a2c_sync"].command
    apex = c["apex_dqn"].pieces
    assert (apex.model, apex.learner_obs, apex.actor_batch, apex.infer_copies) == ("q", 0, 8, 2)
    assert tp.opt(c["apex_dqn"].command, "--learning-starts", 0) == tp.opt(c["apex_dqn"].command, "--buffer-size", 1)
    c, _ = configs(["a3c_hogwild"], workers=[4], num_envs=[1], per_worker=True)  # A3C's original 1 env per worker
    assert tp.opt(c["a3c_hogwild"].command, "--num-envs-per-worker", 0) == 1 and c["a3c_hogwild"].num_envs == 4
    c, _ = configs(["cleanba_ppo"], extra=["cleanba_ppo=--num-steps 64 --update-epochs 2"])
    assert (c["cleanba_ppo"].pieces.learner_obs, c["cleanba_ppo"].pieces.epochs) == (1024, 2)
    c, _ = configs(["hts_a2c", "hts_a2c_sync"], straggler=True)  # one executor per env, alpha 512 vs lockstep's 64
    assert tp.opt(c["hts_a2c"].command, "--num-executors", 0) == 8 and c["hts_a2c"].workers is None
    assert tp.opt(c["hts_a2c"].command, "--sync-interval", 0) == 512 and "--sync" not in c["hts_a2c"].command
    assert tp.opt(c["hts_a2c_sync"].command, "--sync-interval", 0) == 64 and "--sync" in c["hts_a2c_sync"].command


@pytest.mark.parametrize("straggler", [False, True])
@pytest.mark.parametrize("label", sorted(tp.ADAPTERS))
def test_every_adapter_command_parses_with_its_script(label, straggler):
    if straggler and tp.ADAPTERS[label].continuous:
        pytest.skip("the straggler env has discrete actions")
    env_id = "Pendulum-v1" if tp.ADAPTERS[label].continuous else "ALE/Breakout-v5"
    cfg = configs([label], env_id, straggler=straggler)[0][label]
    if not (ROOT / cfg.command[0]).exists():
        pytest.skip(f"{cfg.command[0]} is not in this checkout")
    module = importlib.import_module(Path(cfg.command[0]).stem)
    if "--log-frequency" in cfg.command and "log_frequency" not in module.Args.__dataclass_fields__:
        pytest.skip(f"{cfg.command[0]} has no --log-frequency yet (the HTS flag renames of issue 22)")
    tyro.cli(module.Args, args=[*cfg.command[1:], "--log-dir", "runs"])


def test_summaries_take_medians_flag_a_beaten_bound_and_add_eq7(monkeypatch):
    c, args = configs(["cleanba_ppo", "cleanba_ppo_sync"], bound=True)
    for sps, bound in ((100.0, 250.0), (300.0, 260.0), (200.0, 240.0)):
        c["cleanba_ppo"].rounds.append(
            dict(sps=sps, ceiling=400.0, efficiency=sps / 400, bound=bound, pss_peak_mib=9.0)
        )
        c["cleanba_ppo_sync"].rounds.append(dict(sps=sps / 2, bound=bound, pss_peak_mib=float(sps)))
    by_key = {(x.label, x.num_envs, x.workers, x.std_ms): x for x in c.values()}
    row = tp.summarise(c["cleanba_ppo"], args, by_key)
    assert (row["sps"], row["efficiency"], row["bound"], row["exceeds_bound"]) == (200.0, 0.5, 260.0, True)
    assert (
        row["speedup_vs_baseline"] == 2.0 and tp.summarise(c["cleanba_ppo_sync"], args, by_key)["pss_peak_mib"] == 300
    )
    # Eq. 7 itself is checked in test_measure.py; here, which times the summary asks it for and what it does with them
    calls, seconds = [], {1500: 3.0, 1: 8.0, 512: 2.0}  # Eq. 7's time at alpha = K / n (async), 1 (lockstep), 512
    monkeypatch.setattr(measure, "eq7_time", lambda *a: calls.append(a) or seconds[a[2]])
    c, args = configs(["hts_a2c", "hts_a2c_sync"], straggler=True, stds_ms=[10.0])
    c["hts_a2c"].rounds.append(dict(sps=600.0, steps_measured=12000, pss_peak_mib=1.0))
    c["hts_a2c_sync"].rounds.append(dict(sps=100.0, steps_measured=3000, pss_peak_mib=1.0))
    by_key = {(x.label, x.num_envs, x.workers, x.std_ms): x for x in c.values()}
    row = tp.summarise(c["hts_a2c"], args, by_key)
    assert sorted(calls) == [(8, 12000, a, 0.01, 0.01) for a in (1, 512, 1500)]  # n, K, alpha, mean, std (seconds)
    assert row["speedup_vs_baseline"] == 6.0 and row["speedup_target_5x_met"] and row["eq7_alpha"] == 512
    assert row["eq7_async_sps"] == 4000.0 and row["runtime_vs_async"] == pytest.approx(4000 / 600)  # 12000 / 3 s
    assert row["eq7_speedup"] == 4.0 and not row["runtime_within_1.25x_async_met"]  # 8 s / 2 s; 6.67 > 1.25


def test_a_round_takes_its_ceiling_from_the_three_pieces_and_its_efficiency_against_it(monkeypatch):
    """CONVENTIONS.md: ceiling = 1 / (1/env + 1/infer + 1/train) of the pieces measured just before the run, and
    efficiency = the run's agent steps/s over that ceiling. Pieces and run are stubbed with known rates."""
    rates = {"env": 1000.0, "infer": 2000.0, "train": 4000.0}
    monkeypatch.setattr(measure, "run_piece", lambda kind, p, seconds: (rates[kind], 1e-4))
    monkeypatch.setattr(tp, "run_config", lambda cfg, args, seconds: dict(sps=400.0, pss_peak_mib=1.0))
    c, args = configs(["cleanba_ppo"])
    tp.measure_round(c["cleanba_ppo"], args, 0, cores=2)
    record = c["cleanba_ppo"].rounds[0]
    assert {k: record[k] for k in rates} == rates
    assert record["ceiling"] == pytest.approx(4000 / 7)  # 1 / (1/1000 + 1/2000 + 1/4000)
    assert record["efficiency"] == pytest.approx(0.7)  # 400 / (4000 / 7)


def test_train_pieces_alternate_the_labels_one_update_at_a_time_and_take_the_median(monkeypatch):
    """--train-pieces: updates of hts_ppo and cleanba_ppo in turn (a first, warm-up update each left out), each at its
    learner's threads; the rate is one update's agent steps over the median seconds. A fake clock: each label's update
    takes its listed seconds."""
    torch = pytest.importorskip("torch")
    c, _ = configs(["hts_ppo", "cleanba_ppo"], num_envs=[8])
    durations = {"hts_ppo": [9.0, 1.0, 4.0, 2.0], "cleanba_ppo": [9.0, 3.0, 1.0, 1.0]}
    clock, order = [0.0], []

    def piece_fn(kind, pieces, rng):
        label = "hts_ppo" if pieces.extra_forward_obs > pieces.num_envs else "cleanba_ppo"  # its bootstrap pass only
        steps = iter(durations[label])
        return (lambda: order.append((label, torch.get_num_threads())) or clock.__setitem__(0, clock[0] + next(steps)),
                pieces.samples, lambda: None)  # fmt: skip

    monkeypatch.setattr(measure, "piece_fn", piece_fn)
    monkeypatch.setattr(tp.time, "perf_counter", lambda: clock[0])
    rows = tp.train_pieces([c["hts_ppo"], c["cleanba_ppo"]], rounds=3)  # restores torch's threads
    assert order == [("hts_ppo", 2), ("cleanba_ppo", 2)] * 4  # 8 envs x 128 steps: both learners take both cores
    assert [r["seconds"] for r in rows] == [[1.0, 4.0, 2.0], [3.0, 1.0, 1.0]]
    assert [r["train"] for r in rows] == [1024 / 2.0, 1024 / 1.0]  # 8 x 128 agent steps over the median


@pytest.mark.parametrize("label", sorted(tp.STOP_RUNS))
def test_every_stop_times_command_parses_with_its_script(label):
    """Each --stop-times run: its script's default mode, 2 workers, an endless budget, a checkpoint at the end."""
    run = tp.STOP_RUNS[label]
    row = tp.stop_row(label, "killed_worker", tp.Args(stop_times=True))
    assert row["command"].startswith(f"python {run.script} --env-id ") and row["env_id"] in (
        "CartPole-v1",
        "Pendulum-v1",
    )
    assert ("not_applicable" in row) == (run.victim is None) == (label == "cleanba_ppo")
    args = tyro.cli(importlib.import_module(Path(run.script).stem).Args, args=[*run.flags, "--log-dir", "runs"])
    assert args.checkpoint_interval == 3600 and args.total_timesteps == 10**8
    workers = [getattr(args, f) for f in ("num_workers", "num_learners", "num_actors", "num_actor_threads")
               if hasattr(args, f)]  # fmt: skip
    assert workers and all(w == 2 for w in workers)
    for flag, default in (("mode", "gossip"), ("update", "hogwild"), ("inference", "batched"), ("algo", "ppo")):
        assert getattr(args, flag, default) == default


@pytest.mark.parametrize("label", sorted(tp.STOP_RUNS))
def test_every_stop_atari_command_is_its_script_at_its_defaults_on_breakout(label):
    """--stop-atari: the script's own defaults but for the env, an endless budget and a checkpoint at the end."""
    run = tp.stop_runs(tp.Args(stop_times=True, stop_atari=True))[label]
    row = tp.stop_row(label, "sigint", tp.Args(stop_times=True, stop_atari=True))
    env = "" if label == "apex_ddpg" else "--env-id ALE/Breakout-v5 "  # continuous actions: its default env
    assert row["command"] == f"python {run.script} {env}--total-timesteps 100000000 --checkpoint-interval 3600"
    module = importlib.import_module(Path(run.script).stem)
    args = tyro.cli(module.Args, args=[*run.flags, "--log-dir", "runs"])
    changed = {f.name for f in dataclasses.fields(args) if getattr(args, f.name) != getattr(module.Args(), f.name)}
    assert {"total_timesteps"} <= changed <= {"env_id", "total_timesteps", "checkpoint_interval"}


def test_stop_summary_with_hand_computed_values():
    row = tp.stop_row("a3c_hogwild", "sigint", tp.Args(stop_times=True))

    def attempt(seconds, code, hung=False, left=(), error=None):
        return dict(seconds=seconds, exit_code=code, hung=hung, left_behind=list(left), error=error)

    row["tries"] = [attempt(1.5, 130), attempt(4.0, 130), attempt(None, None, hung=True, left=(7, 8)),
                    attempt(2.5, 1, left=(9,)), attempt(None, None, error="not under way")]  # fmt: skip
    out = tp.stop_summary(row)
    # the three that exited: median of 1.5, 2.5, 4.0 is 2.5, worst 4.0
    assert (out["seconds"], out["median"], out["worst"], out["exit_codes"]) == ([1.5, 4.0, 2.5], 2.5, 4.0, [1, 130])
    assert (out["hung"], out["errors"], out["left_behind"], out["timeout"]) == (1, 1, 3, 60.0)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--external", "no-command"], "--external NAME=COMMAND expected"),
        (["--extra", "nope=--x 1"], "unknown label"),
        (["--memory", "--straggler"], "separate modes"),
        (["--parallel"], "with --memory only"),
        (["--env-table", "--env-id", "CartPole-v1"], "must be an ALE id"),
        (["--env-id", "Breakout-v9"], "unknown env id"),
        (["--only", "a3c_hogwild", "--num-envs", "15"], "does not split evenly"),
        (["--only", "apex_ddpg"], "need a Box action space"),
        (["--stop-times", "--env-table"], "separate modes"),
        (["--stop-times", "--only", "cleanba_ppo_sync"], "default mode"),
        (["--stop-times", "--extra", "a3c_hogwild=--num-steps 8"], "no --external or --extra"),
        (["--train-pieces", "--external", "x=true"], "no --external"),
        (["--stop-times", "--stop-timeout", "0"], "--stop-timeout must be > 0"),
        (["--stop-atari"], "go with --stop-times"),
        (["--stop-times", "--stop-kinds", "sigkill"], "--stop-kinds takes"),
    ],
)
def test_bad_flags_exit_2_with_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        tp.main(tyro.cli(tp.Args, args=argv))
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("error:") and message in err and len(err.strip().splitlines()) == 1
    with pytest.raises(SystemExit) as e:  # labels are a Literal: tyro refuses an unknown one
        tyro.cli(tp.Args, args=["--only", "nope"])
    assert e.value.code == 2


FAKE_PEER = """import sys, time
from torch.utils.tensorboard import SummaryWriter

writer = SummaryWriter(sys.argv[1] + "/runs/peer")  # 1000 agent steps per second of its own wall time
t0 = time.time()
try:
    while True:
        t = time.time()
        writer.add_scalar("charts/SPS", 1000.0, int(1000 * (t - t0)), walltime=t)
        writer.flush()
        time.sleep(0.2)
except KeyboardInterrupt:
    writer.close()
"""


def test_driver_runs_a_script_and_an_external_command_the_same_way(tmp_path):
    (tmp_path / "peer.py").write_text(FAKE_PEER)
    out = tmp_path / "t.json"
    cmd = [sys.executable, "benchmarks/throughput.py", "--only", "cleanba_ppo", "--env-id", "CartPole-v1",
           "--num-envs", "8", "--seconds", "4", "--piece-seconds", "0.3", "--interval", "0.5",
           "--extra", "cleanba_ppo=--num-steps 16 --torch-threads 1",
           "--external", f"peer={sys.executable} {tmp_path / 'peer.py'} {{log_dir}}", "--out", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["meta"]["mode"] == "table" and result["meta"]["torch"]
    ours, peer = result["rows"]
    assert ours["label"] == "cleanba_ppo" and not ours["external"] and ours["rounds"][0]["rate_source"] == "tensorboard"
    assert ours["sps"] > 0 and ours["ceiling"] > 0 and ours["efficiency"] > 0 and ours["pss_peak_mib"] > 50
    assert peer["label"] == "peer" and peer["external"] and peer["rounds"][0]["rate_source"] == "tensorboard"
    assert peer["sps"] == pytest.approx(1000.0, rel=0.01) and peer["pss_peak_mib"] > 10 and "ceiling" not in peer
    assert "| cleanba_ppo |" in proc.stdout and "| peer |" in proc.stdout


def test_env_table_writes_json(tmp_path):
    out = tmp_path / "env.json"
    cmd = [sys.executable, "benchmarks/throughput.py", "--env-table", "--num-envs", "2", "--env-threads", "1",
           "--seconds", "0.2", "--out", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    names = {r["env"].split(",")[0] for r in rows}
    assert {"make_vector_env (ale-py C++ vector env)", "gymnasium AsyncVectorEnv", "one env"} <= names
    assert all(r["agent_steps_per_s"] > 0 for r in rows)
