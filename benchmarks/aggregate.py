"""Aggregate Atari scores over games and seeds as the field reports them (Agarwal et al. 2021, "Deep Reinforcement
Learning at the Edge of the Statistical Precipice"): human-normalised scores, their interquartile mean (IQM), median,
mean and optimality gap, each with a 95% stratified-bootstrap confidence interval, and performance profiles (the
fraction of runs x games whose normalised score exceeds tau) with their bands. The statistics come from the `rliable`
package (the paper's own library); the random and human reference scores are data, with their source, in
benchmarks/atari_human_random.json.

A run's score is the mean of its last `--window` true game returns (`charts/episodic_return`, or `--tag`, e.g.
`eval/episodic_return`), read from the run directories every script writes (`{env}__{exp}__{seed}__{time}`). Runs are
grouped by exp name: one script or variant is one algorithm. A seed counts once (plot.py's rule: the seed in the run's
args.json, else in its name; of several runs of one exp name, game and seed the latest is used, and the others are
named on stderr). rliable's stratified bootstrap resamples the seeds of each game, so it needs two of them for an
interval: an algorithm with one seed per game gets its point estimates only. It also needs the same number of seeds on
every game an algorithm played: where the counts differ, the lowest `n` seeds of each game are kept (n = the fewest
runs of any game) and the runs left out are named on stderr. Algorithms that played different sets of games are
aggregated over their own games, and the table says how many.

Examples:
  python benchmarks/aggregate.py runs/learn/atari-paper --out benchmarks/results/atari_aggregate
  python benchmarks/aggregate.py runs/a runs/b --tag eval/episodic_return --window 10 --reps 2000
"""

from __future__ import annotations

import json
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import tyro
from rliable import library as rly
from rliable import metrics

sys.path.insert(0, str(Path(__file__).resolve().parent))
import plot  # run discovery and TensorBoard reading, shared with the curve plots)

REFERENCES = Path(__file__).resolve().parent / "atari_human_random.json"
# name: the rliable function of a [runs, games] matrix of normalised scores
AGGREGATES = {
    "IQM": metrics.aggregate_iqm,
    "median": metrics.aggregate_median,
    "mean": metrics.aggregate_mean,
    "optimality_gap": metrics.aggregate_optimality_gap,
}


@dataclass
class Args:
    paths: tyro.conf.Positional[tuple[str, ...]]
    """run directories, or folders searched for them"""
    out: str | None = None
    """write OUT.json (scores, aggregates, profiles) and OUT_profiles.png; default: print the table only"""
    tag: str = "charts/episodic_return"
    """the return each run is scored on"""
    window: int = 100
    """a run's score: the mean of its last `window` episodes"""
    reps: int = 50_000
    """bootstrap replications (rliable's default)"""
    seed: int = 0
    """seed of the bootstrap, for intervals that repeat exactly"""
    references: str = str(REFERENCES)
    """JSON of per-game random and human scores (`games`: {env id: {random, human}})"""


@dataclass
class ScoreMatrix:
    """One algorithm's normalised scores: scores[i, j] is seed seeds[i] on game games[j]."""

    games: list[str]
    seeds: list[int]
    raw: np.ndarray  # [runs, games] mean of the last `window` returns
    scores: np.ndarray  # [runs, games] human-normalised


def load_references(path: str | Path) -> dict[str, tuple[float, float]]:
    """{env id: (random, human)}."""
    games = json.loads(Path(path).read_text())["games"]
    return {env_id: (g["random"], g["human"]) for env_id, g in games.items()}


def env_id_of(run_env: str) -> str:
    """The gymnasium id behind a run directory's env field, which has '/' replaced by '_' (ALE_Pong-v5)."""
    return "ALE/" + run_env.removeprefix("ALE_") if run_env.startswith("ALE_") else run_env


def normalise(score: float, random: float, human: float) -> float:
    """Human-normalised score: 0 at the random agent's score, 1 at the human tester's."""
    return (score - random) / (human - random)


def score_matrices(
    runs: list[plot.Run], window: int, references: dict[str, tuple[float, float]]
) -> dict[str, ScoreMatrix]:
    """Group runs by algorithm (exp name) into [seeds, games] matrices; runs on a game without reference scores
    stop the tool (an aggregate over a subset the user did not choose would mislead)."""
    by_algo: dict[str, dict[str, dict[int, float]]] = {}
    for run in plot.distinct_seeds(runs):
        game = env_id_of(run.env)
        if game not in references:
            raise SystemExit(f"error: no random/human reference scores for {game} (run {run.path})")
        if len(run.returns) == 0:
            raise SystemExit(f"error: run {run.path} has no episodes under the tag")
        by_algo.setdefault(run.exp, {}).setdefault(game, {})[run.seed] = float(np.mean(run.returns[-window:]))
    matrices = {}
    for algo, per_game in sorted(by_algo.items()):
        games = sorted(per_game)
        n = min(len(seeds) for seeds in per_game.values())
        kept = {g: sorted(per_game[g])[:n] for g in games}
        for g in games:
            left_out = sorted(per_game[g])[n:]
            if left_out:
                print(f"{algo}: {g}: seeds {left_out} left out ({n} runs on every game)", file=sys.stderr)
        raw = np.array([[per_game[g][kept[g][i]] for g in games] for i in range(n)])
        scores = np.array([[normalise(raw[i, j], *references[g]) for j, g in enumerate(games)] for i in range(n)])
        seeds = kept[games[0]] if all(kept[g] == kept[games[0]] for g in games) else list(range(n))
        matrices[algo] = ScoreMatrix(games, seeds, raw, scores)
    return matrices


def bootstrap(score_dict: dict[str, np.ndarray], func, reps: int, seed: int):
    """rliable's point estimates and 95% stratified-bootstrap percentile intervals of `func` (runs resampled within
    each game), seeded. rliable hands the seed to `arch` as a RandomState, which `arch` now warns about."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="random_state is deprecated", category=FutureWarning)
        return rly.get_interval_estimates(score_dict, func, reps=reps, random_state=np.random.RandomState(seed))


def interval_estimates(
    matrices: dict[str, ScoreMatrix], reps: int, seed: int
) -> dict[str, dict[str, list[float | None]]]:
    """{algo: {aggregate: [point, ci low, ci high]}}, 95% stratified-bootstrap percentile intervals (None, None for an
    algorithm with one seed)."""

    def all_aggregates(scores: np.ndarray) -> np.ndarray:
        return np.array([f(scores) for f in AGGREGATES.values()])

    points, cis = bootstrap({a: m.scores for a, m in matrices.items()}, all_aggregates, reps, seed)
    return {
        a: {
            name: [float(points[a][k]), *([float(cis[a][0, k]), float(cis[a][1, k])] if banded(m) else [None, None])]
            for k, name in enumerate(AGGREGATES)
        }
        for a, m in matrices.items()
    }


def performance_profiles(
    matrices: dict[str, ScoreMatrix], taus: np.ndarray, reps: int, seed: int
) -> dict[str, dict[str, list[float | None]]]:
    """{algo: {fraction, low, high}} at each tau: the fraction of runs x games with a normalised score above tau (low
    and high None for an algorithm with one seed)."""
    points, cis = bootstrap(
        {a: m.scores for a, m in matrices.items()}, lambda scores: rly.score_distributions(scores, taus), reps, seed
    )
    return {
        a: {
            "fraction": points[a].tolist(),
            "low": cis[a][0].tolist() if banded(m) else None,
            "high": cis[a][1].tolist() if banded(m) else None,
        }
        for a, m in matrices.items()
    }


def banded(m: ScoreMatrix) -> bool:
    """A bootstrap interval needs two seeds: resampling one seed always gives that seed back."""
    return len(m.seeds) > 1


def markdown_table(matrices: dict[str, ScoreMatrix], estimates: dict[str, dict[str, list[float | None]]]) -> str:
    lines = [
        "| algorithm | games | seeds per game | " + " | ".join(AGGREGATES) + " |",
        "| --- | ---: | ---: | " + " | ".join("---:" for _ in AGGREGATES) + " |",
    ]
    for algo, m in matrices.items():
        cells = [
            f"{p:.3f} [{lo:.3f}, {hi:.3f}]" if banded(m) else f"{p:.3f}"
            for p, lo, hi in (estimates[algo][name] for name in AGGREGATES)
        ]
        n = len(m.seeds) if banded(m) else "1 (no interval)"
        lines.append(f"| {algo} | {len(m.games)} | {n} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def draw_profiles(profiles: dict[str, dict[str, list[float] | None]], taus: np.ndarray, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    for algo, p in profiles.items():
        if p["low"] is None:
            ax.plot(taus, p["fraction"], label=f"{algo} (1 seed, no band)")
        else:
            (line,) = ax.plot(taus, p["fraction"], label=algo)
            ax.fill_between(taus, p["low"], p["high"], color=line.get_color(), alpha=0.2)
    ax.set_xlabel("human-normalised score (tau)")
    ax.set_ylabel("fraction of runs with score > tau")
    ax.set_ylim(0, 1)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(args: Args) -> int:
    if args.window < 1 or args.reps < 1:
        print("error: --window and --reps must be >= 1", file=sys.stderr)
        return 2
    try:
        dirs = plot.find_run_dirs(list(args.paths))
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    runs = [r for r in (plot.load_run(d, args.tag) for d in dirs) if r is not None]
    if not runs:
        print(f"error: no run under {' '.join(args.paths)} logged {args.tag}", file=sys.stderr)
        return 2
    matrices = score_matrices(runs, args.window, load_references(args.references))
    estimates = interval_estimates(matrices, args.reps, args.seed)
    top = max(1.0, max(float(m.scores.max()) for m in matrices.values()))
    taus = np.linspace(0.0, top, 101)
    profiles = performance_profiles(matrices, taus, args.reps, args.seed)
    print(markdown_table(matrices, estimates))
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        record = {
            "tag": args.tag,
            "window": args.window,
            "reps": args.reps,
            "seed": args.seed,
            "references": json.loads(Path(args.references).read_text())["source"],
            "algorithms": {
                a: {
                    "games": m.games,
                    "seeds": m.seeds,
                    "raw_scores": m.raw.tolist(),
                    "normalised_scores": m.scores.tolist(),
                    "aggregates": estimates[a],
                    "profile": profiles[a],
                }
                for a, m in matrices.items()
            },
            "taus": taus.tolist(),
        }
        Path(f"{out}.json").write_text(json.dumps(record, indent=1))
        draw_profiles(profiles, taus, Path(f"{out}_profiles.png"))
        print(f"wrote {out}.json and {out}_profiles.png")
    return 0


if __name__ == "__main__":
    sys.exit(main(tyro.cli(Args)))
