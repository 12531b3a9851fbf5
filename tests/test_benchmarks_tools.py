"""benchmarks/plot.py against hand-computed statistics on synthetic TensorBoard runs; benchmarks/learn.py suites
against the scripts' real flag parsers."""

import importlib
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import tyro
from torch.utils.tensorboard import SummaryWriter

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

import learn  # noqa: E402
import plot  # noqa: E402


def write_run(root: Path, env: str, exp: str, seed: int, returns: list[float], steps: list[int], extra_tag=None):
    run_dir = root / f"{env}__{exp}__{seed}__{1700000000 + seed}"
    w = SummaryWriter(str(run_dir))
    for i, (r, s) in enumerate(zip(returns, steps, strict=True)):
        w.add_scalar("charts/episodic_return", r, s, walltime=1000.0 + i)
        w.add_scalar("charts/SPS", 100.0, s, walltime=1000.0 + i)
        if extra_tag:
            w.add_scalar(extra_tag, 10 * r, s, walltime=1000.0 + i)
    w.close()
    return run_dir


def test_plot_table_matches_hand_computation(tmp_path):
    rng = np.random.default_rng(0)
    runs = {}
    for exp in ("algo_a", "algo_b"):
        for seed in (1, 2, 3):
            n = 30 + seed
            # rising returns that cross the threshold late, after an early lucky episode that alone would cross it
            returns = list(np.round(rng.uniform(0, 200, size=n) + 12 * np.arange(n), 1))
            returns[0] = 500.0
            steps = [100 * (i + 1) for i in range(n)]
            write_run(tmp_path / "runs", "CartPole-v1", exp, seed, returns, steps, extra_tag="eval/episodic_return")
            runs[exp, seed] = (np.array(returns), np.array(steps))
    threshold = 300.0
    assert plot.main([str(tmp_path / "runs"), "--threshold", str(threshold), "--out", str(tmp_path / "out")]) == 0
    assert (tmp_path / "out_CartPole-v1.png").stat().st_size > 10_000
    table = json.loads((tmp_path / "out.json").read_text())
    assert len(table["runs"]) == 2
    for row in table["runs"]:
        finals, t_steps, t_secs = [], [], []
        for seed in (1, 2, 3):
            returns, steps = runs[row["exp"], seed]
            finals.append(returns[-20:].mean())
            # slow reference: the first episode at which the mean of the last 20 episodes (20 of them) reaches it
            hit = next((i for i in range(19, len(returns)) if returns[i - 19 : i + 1].mean() >= threshold), None)
            t_steps.append(np.nan if hit is None else steps[hit])
            t_secs.append(np.nan if hit is None else float(hit))  # one event per second from the first event
        assert row["seeds"] == [1, 2, 3]
        np.testing.assert_allclose(row["final_return_per_seed"], finals, rtol=1e-5)
        np.testing.assert_allclose(row["final_return_mean"], np.mean(finals), rtol=1e-5)
        np.testing.assert_allclose(row["steps_to_threshold_per_seed"], t_steps)
        np.testing.assert_allclose(row["seconds_to_threshold_per_seed"], t_secs)
        # 100 steps per second of event time
        np.testing.assert_allclose(row["sps_mean"], np.mean([100 * (30 + s) / (30 + s - 1) for s in (1, 2, 3)]))
    # another tag for one exp name
    args = [str(tmp_path / "runs"), "--out", str(tmp_path / "tagged"), "--tag-for", "algo_b=eval/episodic_return"]
    assert plot.main(args) == 0
    rows = {r["exp"]: r for r in json.loads((tmp_path / "tagged.json").read_text())["runs"]}
    np.testing.assert_allclose(rows["algo_b"]["final_return_per_seed"][0], 10 * runs["algo_b", 1][0][-20:].mean())
    np.testing.assert_allclose(rows["algo_a"]["final_return_per_seed"][0], runs["algo_a", 1][0][-20:].mean())


@pytest.mark.parametrize("suffix", ["", "-2", "-13"])
def test_run_name_parses_with_and_without_the_same_second_suffix(suffix):
    m = plot.RUN_NAME.match(f"ALE_Pong-v5__hts_ppo__7__1700000000{suffix}")
    assert m and (m["env"], m["exp"], m["seed"], m["time"]) == ("ALE_Pong-v5", "hts_ppo", "7", "1700000000")


def test_bootstrap_band_brackets_the_mean_and_collapses_for_identical_seeds():
    same = np.tile(np.linspace(0, 1, 50), (4, 1))
    mean, lo, hi = plot.bootstrap_band(same)
    np.testing.assert_allclose(lo, mean)
    np.testing.assert_allclose(hi, mean)
    noisy = np.random.default_rng(1).normal(size=(5, 50))
    mean, lo, hi = plot.bootstrap_band(noisy)
    np.testing.assert_allclose(mean, noisy.mean(0))
    assert np.all(lo <= mean + 1e-12) and np.all(mean <= hi + 1e-12) and np.all(hi - lo > 0)


def test_plot_table_names_a_loss_tag_and_keeps_its_digits(tmp_path, capsys):
    # a loss of 0.0312 must not print as "0.0" under a "final return" heading
    for seed, level in ((1, 0.0312), (2, 0.0288)):
        run_dir = tmp_path / f"ALE_Pong-v5__a3c__{seed}__{1700000000 + seed}"
        w = SummaryWriter(str(run_dir))
        for i in range(30):
            w.add_scalar("losses/value_loss", level, 100 * (i + 1), walltime=1000.0 + i)
        w.close()
    args = [str(tmp_path), "--tag", "losses/value_loss", "--out", str(tmp_path / "out"), "--ylim", "0", "0.1"]
    assert plot.main(args) == 0
    header, _, row = capsys.readouterr().out.strip().splitlines()[-3:]
    assert "| final losses/value_loss (mean, min over seeds) |" in header, header
    assert "| 0.03 (0.0288) |" in row, row


def test_plot_reports_missing_runs(tmp_path, capsys):
    assert plot.main([str(tmp_path / "nothing")]) == 2
    assert capsys.readouterr().err.startswith("error:")
    (tmp_path / "empty").mkdir()
    assert plot.main([str(tmp_path / "empty")]) == 2


def write_pieces(run_dir: Path, pieces: list[list[float]], args_seed: int | None = None) -> Path:
    """A run in one directory, one event file per piece (a resumed run writes one more per `--resume`); each piece
    restarts 5 steps back, as from a checkpoint. With `args_seed`, an args.json as every script writes it."""
    for k, returns in enumerate(pieces):
        t_start = 1000.0 + 100 * k
        with SummaryWriter(str(run_dir), filename_suffix=f".{k}") as w:
            for i, r in enumerate(returns):
                w.add_scalar("charts/episodic_return", r, 100 * (5 * k + i + 1), walltime=t_start + i)
    if args_seed is not None:
        (run_dir / "args.json").write_text(json.dumps({"script": "x.py", "args": {"seed": args_seed}, "meta": {}}))
    return run_dir


class Figures:
    """Records what plot.py draws instead of writing PNGs: per figure, its title, legend and bands per axis."""

    def __init__(self, monkeypatch):
        import matplotlib.figure

        self.drawn = []
        monkeypatch.setattr(matplotlib.figure.Figure, "savefig", lambda fig, path, **kw: self.drawn.append(fig))

    def legend(self, i=0):
        return [t.get_text() for t in self.drawn[i].axes[0].get_legend().get_texts()]

    def bands(self, i=0):
        return [len(ax.collections) for ax in self.drawn[i].axes]  # fill_between adds one collection per band


def test_repeated_seed_counts_once_and_the_latest_run_is_used(tmp_path, monkeypatch, capsys):
    """Two hts_a2c runs of seed 1 are one seed, not two: a warning names both directories and the later run (by the
    start time in its name, not by the name's sort order: 999999999 sorts after 1700000000) is the one used."""
    runs = tmp_path / "runs"
    older = write_pieces(runs / "CartPole-v1__hts_a2c__1__999999999", [[10.0] * 25])
    newer = write_pieces(runs / "CartPole-v1__hts_a2c__1__1700000000", [[20.0] * 25])
    figures = Figures(monkeypatch)
    assert plot.main([str(runs), "--out", str(tmp_path / "out")]) == 0
    out, err = capsys.readouterr()
    warnings = [line for line in err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1, err
    assert "hts_a2c" in warnings[0] and "seed 1 has 2 runs" in warnings[0], warnings[0]
    assert str(older) in warnings[0], warnings[0]
    assert warnings[0].endswith(f"using the latest by the start time in its name, {newer}"), warnings[0]
    (row,) = json.loads((tmp_path / "out.json").read_text())["runs"]
    assert row["seeds"] == [1]
    assert row["final_return_per_seed"] == [20.0] and row["episodes"] == [25]
    assert "| CartPole-v1 | hts_a2c | 1 (no band) |" in out, out
    assert figures.legend() == ["hts_a2c (1 seed, no band)"]
    assert figures.bands() == [0, 0]
    assert figures.drawn[0]._suptitle.get_text() == "CartPole-v1: one seed per run, no band"


def test_copies_of_one_seed_beside_another_seed_are_two_seeds(tmp_path, monkeypatch, capsys):
    """The issue's case: one hts_a2c run of seed 1 copied into two folders (same name, bitwise identical) and a run of
    seed 2 are two seeds, not three; the copies have the same start time, so the warning says the last by path is
    used."""
    runs = tmp_path / "runs"
    name = "CartPole-v1__hts_a2c__1__1700000001"
    first = write_pieces(runs / "a" / name, [[10.0] * 25], args_seed=1)
    second = write_pieces(runs / "b" / name, [[10.0] * 25], args_seed=1)
    write_pieces(runs / "a" / "CartPole-v1__hts_a2c__2__1700000002", [[30.0] * 25], args_seed=2)
    figures = Figures(monkeypatch)
    assert plot.main([str(runs), "--out", str(tmp_path / "out")]) == 0
    out, err = capsys.readouterr()
    warnings = [line for line in err.splitlines() if line.startswith("warning:")]
    assert warnings == [
        f"warning: hts_a2c on CartPole-v1: seed 1 has 2 runs ({first}, {second}); using the last by path, {second}"
    ], err
    (row,) = json.loads((tmp_path / "out.json").read_text())["runs"]
    assert row["seeds"] == [1, 2] and row["final_return_per_seed"] == [10.0, 30.0]
    assert "| CartPole-v1 | hts_a2c | 2 |" in out, out
    assert figures.legend() == ["hts_a2c (2 seeds)"]
    assert figures.bands() == [1, 1]


def test_latest_of_runs_started_in_the_same_second_goes_by_the_suffix_number(tmp_path, capsys):
    runs = tmp_path / "runs"
    for suffix, value in (("", 1.0), ("-2", 2.0), ("-13", 13.0)):  # "-13" sorts before "-2" as text
        write_pieces(runs / f"CartPole-v1__algo__1__1700000000{suffix}", [[value] * 5])
    loaded = [plot.load_run(d, "charts/episodic_return") for d in plot.find_run_dirs([str(runs)])]
    (kept,) = plot.distinct_seeds(loaded)
    assert kept.path.name.endswith("-13") and kept.returns[-1] == 13.0
    assert "seed 1 has 3 runs" in capsys.readouterr().err


def test_two_seeds_give_a_band_and_a_resumed_run_is_one_run(tmp_path, monkeypatch, capsys):
    """Seed 2 of algo_a was resumed once (two event files in its directory): still one run, no warning. algo_b beside
    it has one seed: its curve alone, no band."""
    runs = tmp_path / "runs"
    write_pieces(runs / "CartPole-v1__algo_a__1__1700000001", [[10.0] * 25])
    write_pieces(runs / "CartPole-v1__algo_a__2__1700000002", [[30.0] * 15, [40.0] * 20])
    write_pieces(runs / "CartPole-v1__algo_b__1__1700000003", [[50.0] * 25])
    figures = Figures(monkeypatch)
    assert plot.main([str(runs), "--out", str(tmp_path / "out")]) == 0
    out, err = capsys.readouterr()
    assert "warning" not in err, err
    rows = {r["exp"]: r for r in json.loads((tmp_path / "out.json").read_text())["runs"]}
    assert rows["algo_a"]["seeds"] == [1, 2] and rows["algo_b"]["seeds"] == [1]
    # piece 2 redid piece 1's last 10 episodes: 5 + 20 episodes, the last 20 from piece 2
    assert rows["algo_a"]["episodes"] == [25, 25] and rows["algo_a"]["final_return_per_seed"] == [10.0, 40.0]
    assert "| CartPole-v1 | algo_a | 2 |" in out and "| CartPole-v1 | algo_b | 1 (no band) |" in out, out
    assert figures.legend() == ["algo_a (2 seeds)", "algo_b (1 seed, no band)"]
    assert figures.bands() == [1, 1]  # algo_a's, on the steps and the wall-clock axes
    assert figures.drawn[0]._suptitle.get_text() == "CartPole-v1: mean over seeds, 95% bootstrap CI"


def test_seed_comes_from_args_json_when_there_is_one(tmp_path, capsys):
    """Directory names that disagree with the seed the runs were started with (renamed, copied): args.json decides.
    Two runs started with seed 7 are one seed; a directory without args.json keeps the seed in its name."""
    runs = tmp_path / "runs"
    write_pieces(runs / "CartPole-v1__algo__1__1700000001", [[10.0] * 25], args_seed=7)
    write_pieces(runs / "CartPole-v1__algo__2__1700000002", [[20.0] * 25], args_seed=7)
    write_pieces(runs / "CartPole-v1__algo__3__1700000003", [[30.0] * 25])
    assert plot.main([str(runs), "--out", str(tmp_path / "out")]) == 0
    assert "seed 7 has 2 runs" in capsys.readouterr().err
    (row,) = json.loads((tmp_path / "out.json").read_text())["runs"]
    assert row["seeds"] == [3, 7] and row["final_return_per_seed"] == [30.0, 20.0]


def mean_of_last_20_by(frames_budget: int, returns: list[float], steps: list[int]) -> float:
    """Slow reference for --at-frames: walk the episodes in order, keep those that ended at or before the budget (4
    frames per agent step), average the last 20 kept."""
    kept = []
    for r, s in zip(returns, steps, strict=True):
        if 4 * s <= frames_budget:
            kept.append(r)
    last = kept[-20:]
    return sum(last) / len(last)


def test_same_env_draws_a_reference_env_in_one_figure_in_frames_with_returns_at_frame_budgets(
    tmp_path, monkeypatch, capsys
):
    """A reference's PongNoFrameskip-v4 run and two seeds of ours on ALE/Pong-v5 go into one figure and one env of
    the JSON only when --same-env names the pair; --frames draws 4 frames per agent step; --at-frames averages the
    last 20 episodes by each budget. Ours, seed 1, ends at 249,900 agent steps (999,600 frames: within 0.1% of the
    1M-frame budget, as a budget of agent steps cut to whole updates ends); seed 2 ends at 960,000 frames and the
    reference at 480,000, short of it."""
    runs = tmp_path / "runs"
    ours = {
        1: ([float(i % 7 - 3) for i in range(50)], [4998 * (i + 1) for i in range(50)]),
        2: ([float((3 * i) % 11 - 5) for i in range(40)], [6000 * (i + 1) for i in range(40)]),
    }
    for seed, (returns, steps) in ours.items():
        run_dir = write_run(runs, "ALE_Pong-v5", "ours", seed, returns, steps)
        (run_dir / "args.json").write_text(json.dumps({"args": {"seed": seed}}))
    ref_returns, ref_steps = [float(-21 + i // 3) for i in range(30)], [4000 * (i + 1) for i in range(30)]
    write_run(runs, "PongNoFrameskip-v4", "ppo_atari", 1, ref_returns, ref_steps)  # CleanRL writes no args.json

    # without --same-env the ids stay apart: two figures, two envs
    figures = Figures(monkeypatch)
    assert plot.main([str(runs), "--out", str(tmp_path / "apart")]) == 0
    capsys.readouterr()
    assert len(figures.drawn) == 2
    assert {r["env"] for r in json.loads((tmp_path / "apart.json").read_text())["runs"]} == {
        "ALE_Pong-v5",
        "PongNoFrameskip-v4",
    }

    figures = Figures(monkeypatch)
    budgets = [400_000, 1_000_000]
    args = [str(runs), "--same-env", "PongNoFrameskip-v4=ALE/Pong-v5", "--frames", "--label", "ppo_atari=cleanrl"]
    args += ["--at-frames", *map(str, budgets), "--out", str(tmp_path / "merged")]
    assert plot.main(args) == 0
    out = capsys.readouterr().out
    assert len(figures.drawn) == 1
    summary = json.loads((tmp_path / "merged.json").read_text())
    rows = {r["exp"]: r for r in summary["runs"]}
    assert sorted(rows) == ["cleanrl", "ours"]
    assert {r["env"] for r in rows.values()} == {"ALE_Pong-v5"}
    assert rows["cleanrl"]["run_env"] == "PongNoFrameskip-v4" and rows["ours"]["run_env"] == "ALE_Pong-v5"
    assert summary["same_env"] == {"PongNoFrameskip-v4": "ALE_Pong-v5"}
    assert figures.legend() == ["cleanrl (PongNoFrameskip-v4, 1 seed, no band)", "ours (2 seeds)"]

    # frames: 4 per agent step, in the JSON and on the x axis of the first panel (to the longest seed's last episode)
    assert rows["ours"]["agent_steps"] == [249_900, 240_000] and rows["ours"]["frames"] == [999_600, 960_000]
    assert rows["cleanrl"]["frames"] == [4 * 120_000]
    panel = figures.drawn[0].axes[0]
    assert panel.get_xlabel() == "frames (agent steps x 4)"
    assert [line.get_xdata()[-1] for line in panel.get_lines()] == [480_000, 999_600]

    # the returns at each budget, against the slow reference; None where a seed stopped short of the budget
    expected = {
        ("ours", 400_000): [mean_of_last_20_by(400_000, *ours[1]), mean_of_last_20_by(400_000, *ours[2])],
        ("ours", 1_000_000): [mean_of_last_20_by(1_000_000, *ours[1]), None],
        ("cleanrl", 400_000): [mean_of_last_20_by(400_000, ref_returns, ref_steps)],
        ("cleanrl", 1_000_000): [None],
    }
    for exp, row in rows.items():
        assert [b["frames"] for b in row["at_frames"]] == budgets
        for b in row["at_frames"]:
            want = expected[exp, b["frames"]]
            assert b["per_seed"] == pytest.approx(want), (exp, b)
            reached = [v for v in want if v is not None]
            assert b["seeds_reaching"] == len(reached)
            assert b["mean"] == (pytest.approx(np.mean(reached)) if reached else None), (exp, b)
    # the table: frames, and each budget's mean, the seeds that got there when not all did, '—' when none did
    ours_line = next(line for line in out.splitlines() if "| ours |" in line)
    ref_line = next(line for line in out.splitlines() if "| cleanrl |" in line)
    assert ours_line.startswith("| ALE_Pong-v5 | ours | 2 | 979,800 |"), ours_line  # median of 999,600 and 960,000
    assert ref_line.startswith("| PongNoFrameskip-v4 (as ALE_Pong-v5) | cleanrl | 1 (no band) | 480,000 |"), ref_line
    at_4 = np.mean(expected["ours", 400_000])
    assert ours_line.endswith(f"| {at_4:.1f} | {expected['ours', 1_000_000][0]:.1f} (1/2 seeds) |"), ours_line
    assert ref_line.endswith(f"| {expected['cleanrl', 400_000][0]:.1f} | — |"), ref_line


@pytest.mark.parametrize("flag", ["--same-env", "--label", "--tag-for"])
def test_pair_flags_without_both_sides_are_refused(tmp_path, flag, capsys):
    write_run(tmp_path / "runs", "ALE_Pong-v5", "ours", 1, [1.0, 2.0], [100, 200])
    assert plot.main([str(tmp_path / "runs"), flag, "PongNoFrameskip-v4", "--out", str(tmp_path / "out")]) == 2
    assert capsys.readouterr().err == f"error: {flag} takes A=B, got 'PongNoFrameskip-v4'\n"


@pytest.mark.parametrize("suite", sorted(learn.SUITES))
def test_every_suite_entry_parses_with_its_script(suite, tmp_path):
    entries = learn.suite(suite)
    assert entries
    distinct = {(e.script, tuple(e.args)): e for e in entries}  # atari-paper: hundreds of games, a dozen settings
    for e in distinct.values():
        module = importlib.import_module(Path(e.script).stem)
        cmd = learn.command(e, seed=3, out=tmp_path)
        args = tyro.cli(module.Args, args=cmd[2:])  # the script's own parser: every flag must exist
        assert (args.env_id, args.seed, args.total_timesteps, args.exp_name) == (
            e.env_id,
            3,
            e.total_timesteps,
            e.label,
        )


@pytest.mark.parametrize("later_piece_sorts_first", [False, True])
def test_resumed_run_is_timed_without_its_downtime(tmp_path, later_piece_sorts_first):
    """A run resumed from a checkpoint writes a second event file in the same directory; plot.py times it by its
    running time. Piece 1: steps 100..1000 at t = 1000..1009 s; the machine is off for an hour; piece 2 restarts from
    the step-500 checkpoint: steps 600..1500 at t = 4609..4618 s. Which file's name sorts first (two pieces started in
    the same second differ only in pid and a per-process counter) does not matter."""
    run_dir = tmp_path / "runs" / "CartPole-v1__algo__1__1700000001"
    for start_step, t_start in ((100, 1000.0), (600, 4609.0)):
        w = SummaryWriter(str(run_dir), filename_suffix=f".{int(t_start)}")  # one file per piece
        w.add_text("hyperparameters", "|param|value|", 0, walltime=t_start)  # every piece logs these at step 0
        for i in range(10):
            w.add_scalar("charts/episodic_return", float(i), start_step + 100 * i, walltime=t_start + i)
        w.close()
    files = sorted(run_dir.glob("events.out.tfevents.*"), key=lambda f: f.name.endswith(".4609"))  # piece 1 first
    assert len(files) == 2
    for f, tie in zip(files, "ba" if later_piece_sorts_first else "ab", strict=True):  # same second, pid and counter
        f.rename(run_dir / f"events.out.tfevents.1.host.{tie}.{f.name.rsplit('.', 1)[1]}")
    assert plot.pieces(run_dir) == [(1000.0, 1009.0, 100), (4609.0, 4618.0, 600)]
    run = plot.load_run(run_dir, "charts/episodic_return")
    # running time: 9 s in piece 1, then piece 2 continues at 9 s (piece 1's steps 600..1000, which piece 2 redid,
    # are left out)
    np.testing.assert_allclose(run.steps, [100, 200, 300, 400, 500, *range(600, 1501, 100)])
    np.testing.assert_allclose(run.walls, [0, 1, 2, 3, 4, *range(9, 19)])
    np.testing.assert_allclose(run.sps, 1500 / 18)


def test_learn_resume_continues_each_run_from_its_newest_checkpoint(tmp_path, capsys):
    out = tmp_path / "out"
    names = {"ALE_Pong-v5__hts_a2c__1__100": 3, "ALE_Pong-v5__hts_a2c__1__200": 2, "ALE_Pong-v5__hts_a2c_x__2__300": 4}
    for name, mtime in names.items():  # the newest checkpoint by time written, not by directory name
        (out / name).mkdir(parents=True)
        (out / name / "checkpoint.pt").write_bytes(b"")
        os.utime(out / name / "checkpoint.pt", (mtime, mtime))
    newest = out / "ALE_Pong-v5__hts_a2c__1__100" / "checkpoint.pt"
    argv = ["--suite", "atari-smoke", "--only", "hts_a2c", "--seeds", "1", "2", "--out", str(out), "--dry-run"]
    assert learn.main([*argv, "--resume"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].endswith(f"--resume {newest}")  # seed 1: its newest checkpoint
    assert "--resume" not in lines[1]  # seed 2 has none (hts_a2c_x is another label)
    assert learn.main(argv) == 0
    assert "--resume" not in capsys.readouterr().out  # without --resume, fresh runs


def test_learn_records_a_run_that_ctrl_c_stopped_in_the_manifest(tmp_path, monkeypatch):
    """A long run taken in pieces ends each piece with Ctrl+C: that piece's command and exit status belong in
    manifest.json like a finished run's (report.py reads a run's command from its last piece)."""
    child = tmp_path / "child.py"  # a stand-in script: exits 130 on SIGINT, as the scripts do
    child.write_text(
        "import pathlib, signal, sys, time\n"
        "signal.signal(signal.SIGINT, lambda signum, frame: sys.exit(130))\n"
        "pathlib.Path(sys.argv[sys.argv.index('--log-dir') + 1], 'started').touch()\n"
        "time.sleep(120)\n"
    )
    out, real_sleep, pressed = tmp_path / "out", time.sleep, []

    def sleep_until_started(seconds):  # Ctrl+C arrives once, when the child runs (and handles SIGINT)
        real_sleep(min(seconds, 0.05))
        if (out / "started").exists() and not pressed:
            pressed.append(True)
            raise KeyboardInterrupt

    monkeypatch.setattr(learn.time, "sleep", sleep_until_started)
    done = []
    with pytest.raises(KeyboardInterrupt):
        learn.run_all([(learn.Entry("piece", str(child), "CartPole-v1", 1000), 1)], out, 1, done)
    assert [(r["label"], r["seed"], r["returncode"], r["stopped_at_time_limit"]) for r in done] == [
        ("piece", 1, 130, False)
    ]
    assert done[0]["command"][:3] == [str(child), "--env-id", "CartPole-v1"]
