"""benchmarks/aggregate.py on a synthetic set of runs whose aggregates are worked out by hand: human-normalisation
against the reference table, IQM / median / mean / optimality gap, performance profiles, the last-`window` score,
stratified (per-game) bootstrap intervals, and what it refuses."""

import json
import sys
from pathlib import Path

import numpy as np
import pytest
from torch.utils.tensorboard import SummaryWriter

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import aggregate  # noqa: E402

# (random, human) of each game in benchmarks/atari_human_random.json
GAMES = {
    "ALE/Pong-v5": (-20.7, 14.6),
    "ALE/Breakout-v5": (1.7, 30.5),
    "ALE/Boxing-v5": (0.1, 12.1),
    "ALE/Freeway-v5": (0.0, 29.6),
}
# normalised score of each seed on each game, in GAMES' order
ALGO_A = {1: [0.1, 0.2, 0.3, 2.0], 2: [0.5, 0.6, 0.7, 0.8]}
ALGO_B = {1: [0.4, 0.4, 0.9, 0.1], 2: [0.4, 0.4, 0.9, 0.1], 3: [0.4, 0.4, 0.9, 0.1]}
WINDOW = 3


def write_run(root: Path, game: str, exp: str, seed: int, normalised: float, started: int = 1700000000) -> Path:
    """A run whose last WINDOW episodes average to the raw score of `normalised`, after an early episode far off."""
    random, human = GAMES[game]
    raw = random + normalised * (human - random)
    run_dir = root / f"{game.replace('/', '_')}__{exp}__{seed}__{started}"
    with SummaryWriter(str(run_dir)) as w:
        for step, value in enumerate([raw - 1000.0, raw - 1.0, raw, raw + 1.0]):
            w.add_scalar("charts/episodic_return", value, step * 100)
    return run_dir


@pytest.fixture(scope="module")
def runs_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("runs")
    for exp, table in (("algo_a", ALGO_A), ("algo_b", ALGO_B)):
        for seed, scores in table.items():
            for game, score in zip(GAMES, scores, strict=True):
                write_run(root, game, exp, seed, score)
    return root


def test_reference_table_has_the_57_games_with_their_source():
    data = json.loads(aggregate.REFERENCES.read_text())
    assert len(data["games"]) == 57 and "dqn_zoo" in data["source"]
    for game, (random, human) in GAMES.items():
        assert data["games"][game] == {"random": random, "human": human}


def test_aggregates_match_hand_computed_values(runs_dir, tmp_path):
    out = tmp_path / "agg"
    args = aggregate.Args(paths=(str(runs_dir),), out=str(out), window=WINDOW, reps=2000)
    assert aggregate.main(args) == 0
    record = json.loads(Path(f"{out}.json").read_text())
    a = record["algorithms"]["algo_a"]
    assert a["games"] == sorted(GAMES) and a["seeds"] == [1, 2]
    order = [list(GAMES).index(g) for g in a["games"]]
    expected = np.array([[ALGO_A[s][j] for j in order] for s in (1, 2)])
    np.testing.assert_allclose(a["normalised_scores"], expected, atol=1e-9)
    # the 8 scores sorted: 0.1 0.2 | 0.3 0.5 0.6 0.7 | 0.8 2.0 -> IQM = mean of the middle four
    # per-game means 0.3 0.4 0.5 1.4 -> median 0.45, mean 0.65; optimality gap = 1 - mean(min(score, 1)) = 1 - 4.2/8
    points = {name: v[0] for name, v in a["aggregates"].items()}
    assert points == pytest.approx({"IQM": 0.525, "median": 0.45, "mean": 0.65, "optimality_gap": 0.475})
    for point, low, high in a["aggregates"].values():
        assert low <= point <= high and high > low  # seeds differ on every game: a real interval
    taus = np.array(record["taus"])
    k = int(np.argmin(abs(taus - 0.55)))
    assert abs(taus[k] - 0.55) > 1e-6  # no score sits exactly on the tau checked
    above = sum(s > taus[k] for row in ALGO_A.values() for s in row) / 8
    assert a["profile"]["fraction"][k] == pytest.approx(above)
    assert Path(f"{out}_profiles.png").stat().st_size > 0


def test_bootstrap_is_stratified_by_game(runs_dir):
    """Resampling runs within each game: seeds that agree on every game leave no uncertainty, although the games
    differ (a bootstrap over all runs x games would spread IQM and mean)."""
    runs = [aggregate.plot.load_run(d, "charts/episodic_return") for d in aggregate.plot.find_run_dirs([str(runs_dir)])]
    matrices = aggregate.score_matrices(runs, WINDOW, aggregate.load_references(aggregate.REFERENCES))
    estimates = aggregate.interval_estimates({"algo_b": matrices["algo_b"]}, reps=500, seed=0)
    assert estimates["algo_b"]["mean"][0] == pytest.approx(0.45)
    for point, low, high in estimates["algo_b"].values():
        assert low == pytest.approx(point) and high == pytest.approx(point)


def test_unequal_seed_counts_keep_the_lowest_seeds(tmp_path, capsys):
    for seed, score in ((1, 0.2), (2, 0.4), (3, 0.9)):
        write_run(tmp_path, "ALE/Pong-v5", "algo", seed, score)
    write_run(tmp_path, "ALE/Breakout-v5", "algo", 2, 0.5)
    write_run(tmp_path, "ALE/Breakout-v5", "algo", 1, 0.3)
    runs = [aggregate.plot.load_run(d, "charts/episodic_return") for d in aggregate.plot.find_run_dirs([str(tmp_path)])]
    m = aggregate.score_matrices(runs, WINDOW, aggregate.load_references(aggregate.REFERENCES))["algo"]
    assert m.games == ["ALE/Breakout-v5", "ALE/Pong-v5"] and m.seeds == [1, 2]
    np.testing.assert_allclose(m.scores, [[0.3, 0.2], [0.5, 0.4]], atol=1e-9)
    assert "ALE/Pong-v5: seeds [3] left out" in capsys.readouterr().err


def test_game_without_reference_scores_is_refused(tmp_path):
    with SummaryWriter(str(tmp_path / "CartPole-v1__algo__1__1700000000")) as w:
        w.add_scalar("charts/episodic_return", 500.0, 0)
    with pytest.raises(SystemExit, match="no random/human reference scores for CartPole-v1"):
        aggregate.main(aggregate.Args(paths=(str(tmp_path),), reps=10))


def test_repeated_seed_counts_once_and_the_latest_run_is_used(tmp_path, capsys):
    """Two runs of seed 1 on Pong and one of seed 2 are two seeds, not three: the later run of seed 1 (by the start
    time in the name, not the name's sort order) is scored, a warning names both, and the JSON lists each seed once."""
    runs = tmp_path / "runs"
    older = write_run(runs, "ALE/Pong-v5", "algo", 1, 0.9, started=999999999)
    newer = write_run(runs, "ALE/Pong-v5", "algo", 1, 0.2, started=1700000000)
    write_run(runs, "ALE/Pong-v5", "algo", 2, 0.4)
    out = tmp_path / "agg"
    assert aggregate.main(aggregate.Args(paths=(str(runs),), out=str(out), window=WINDOW, reps=200)) == 0
    captured = capsys.readouterr()
    (warning,) = captured.err.splitlines()
    assert warning.startswith("warning: algo on ALE_Pong-v5: seed 1 has 2 runs") and str(older) in warning, warning
    assert warning.endswith(f"using the latest by the start time in its name, {newer}"), warning
    assert "| algo | 1 | 2 | " in captured.out, captured.out
    a = json.loads(Path(f"{out}.json").read_text())["algorithms"]["algo"]
    assert a["seeds"] == [1, 2]
    np.testing.assert_allclose(a["normalised_scores"], [[0.2], [0.4]], atol=1e-9)
    assert None not in a["aggregates"]["mean"] and a["profile"]["low"] is not None


def test_one_seed_gives_points_without_intervals(tmp_path, capsys):
    """Resampling one seed per game gives that seed back: a zero-width interval that would claim certainty."""
    for game, score in zip(GAMES, ALGO_A[1], strict=True):
        write_run(tmp_path, game, "algo", 1, score)
    out = tmp_path / "agg"
    assert aggregate.main(aggregate.Args(paths=(str(tmp_path),), out=str(out), window=WINDOW, reps=200)) == 0
    table = capsys.readouterr().out
    assert "| algo | 4 | 1 (no interval) | " in table and "[" not in table, table
    a = json.loads(Path(f"{out}.json").read_text())["algorithms"]["algo"]
    assert a["seeds"] == [1]
    # per-game scores 0.1 0.2 0.3 2.0: mean 0.65
    assert a["aggregates"]["mean"] == [pytest.approx(0.65), None, None]
    assert a["profile"]["low"] is None and a["profile"]["high"] is None
