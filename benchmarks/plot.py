"""Learning curves and a results table from TensorBoard runs made by any script in this repository.

Every script writes `runs/{env_id}__{exp_name}__{seed}__{unix_time}/events.out.tfevents.*` with
`charts/episodic_return` and `charts/SPS` against global agent steps (CONVENTIONS.md). This tool finds every run
directory under the paths it is given, groups runs by (env id, exp name) — one colour per script/mode, seeds pooled —
and draws, per env, episodic return against agent steps and against wall-clock time: the mean over seeds and a 95%
bootstrap confidence band (seeds resampled with replacement); a group with one seed is drawn as its single curve, with
no band, and its legend entry and table row say so. A seed counts once: a run's seed is `args.seed` in its
`args.json`, or the seed in its directory name when it has none, and of several runs with the same exp name and seed
the latest (by the start time in the directory name) is used and the others are named in a warning. Next to the figure
it writes a JSON file and prints a Markdown table: final return (mean of each seed's last `--window` episodes),
steps/s, and time to threshold (first agent step / second at which the mean of the last `--window` episodes reaches
`--threshold`, counted once `--window` episodes exist). A run taken in pieces (`--resume`) is timed by its running
time (the downtime between its pieces is left out), and the episodes that a later piece redid from its checkpoint
count once.

Examples:
  python benchmarks/plot.py runs/                                        # every run under runs/
  python benchmarks/plot.py runs/learn/cartpole --threshold 475 --out benchmarks/results/cartpole
  python benchmarks/plot.py runs/learn/cartpole --tag eval/episodic_return   # e.g. Ape-X's greedy evaluation
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import re
import sys
import warnings
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

# a run started in the same second as another of the same name gets the suffix -2, -3, ...
RUN_NAME = re.compile(r"^(?P<env>.+?)__(?P<exp>.+)__(?P<seed>-?\d+)__(?P<time>\d+)(?:-(?P<n>\d+))?$")


@dataclass
class Run:
    path: Path
    env: str
    exp: str
    seed: int
    steps: np.ndarray  # [E] global agent step at which each episode ended
    walls: np.ndarray  # [E] seconds since the run's first event, less the downtime of a resumed run
    returns: np.ndarray  # [E]
    sps: float  # agent steps per second over the whole run
    final_step: int
    started: tuple[int, int] = (0, 0)  # (unix time, same-second suffix) of the directory name: orders repeated runs


@dataclass
class Group:
    env: str
    exp: str
    tag: str
    runs: list[Run] = field(default_factory=list)


def find_run_dirs(paths: list[str]) -> list[Path]:
    dirs = set()
    for p in map(Path, paths):
        if not p.exists():
            raise FileNotFoundError(f"{p} does not exist")
        files = [p] if p.is_file() else p.rglob("events.out.tfevents.*")
        dirs.update(f.parent for f in files)
    return sorted(dirs)


def pieces(run_dir: Path) -> list[tuple[float, float, int]]:
    """(first wall time, last wall time, first step) of the scalars in each event file of a run, in time order. A run
    resumed from a checkpoint (`--resume`) writes one more file into the same directory per piece (and its text
    summary of the hyperparameters at step 0 again, hence scalars only)."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    out = []
    for f in run_dir.glob("events.out.tfevents.*"):
        events = [
            (e.wall_time, e.step)
            for e in EventFileLoader(str(f)).Load()  # scalars arrive migrated to tensors of the "scalars" plugin
            if any(v.metadata.plugin_data.plugin_name == "scalars" for v in e.summary.value)
        ]
        if events:
            walls, steps = zip(*events, strict=True)
            out.append((min(walls), max(walls), min(steps)))
    return sorted(out)


def running_seconds(walls: np.ndarray, t0: float, parts: list[tuple[float, float, int]]) -> np.ndarray:
    """Seconds since `t0` at each wall time, less the downtime between the pieces before it. The work lost between a
    piece's last checkpoint and its end stays counted: the machine spent that time."""
    out = walls - t0
    for (_, end, _), (start, _, _) in itertools.pairwise(parts):
        out -= np.clip(walls - end, 0.0, max(0.0, start - end))
    return out


def superseded(wall: float, step: int, parts: list[tuple[float, float, int]]) -> bool:
    """True for an event that a later piece redid: the later piece restarted from a checkpoint at or before its step."""
    return any(start > wall and step >= first_step for start, _, first_step in parts)


def load_run(run_dir: Path, tag: str) -> Run | None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    # every event of every file (0: no sampling); the accumulator reads a run's files in name order and would drop the
    # events of a file that sorts first when a later-read file's steps go back, so `superseded` drops repeats instead
    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0}, purge_orphaned_data=False)
    acc.Reload()
    tags = acc.Tags()["scalars"]
    if tag not in tags:
        return None
    parts = pieces(run_dir)
    kept = [e for e in acc.Scalars(tag) if not superseded(e.wall_time, e.step, parts)]
    events = sorted(kept, key=lambda e: e.wall_time)
    all_events = [e for t in tags for e in acc.Scalars(t)]
    t0 = min(e.wall_time for e in all_events)
    final_step = max(e.step for e in all_events)
    duration = running_seconds(np.array([max(e.wall_time for e in all_events)]), t0, parts)[0]
    # one rate for every script: last step over the running time from the first event to the last (includes warm-up)
    sps = final_step / duration if duration > 0 else float("nan")
    m = RUN_NAME.match(run_dir.name)
    env, exp, seed = (m["env"], m["exp"], int(m["seed"])) if m else ("?", run_dir.name, 0)
    return Run(
        path=run_dir,
        env=env,
        exp=exp,
        seed=seed_of(run_dir, seed),
        steps=np.array([e.step for e in events], dtype=np.float64),
        walls=running_seconds(np.array([e.wall_time for e in events], dtype=np.float64), t0, parts),
        returns=np.array([e.value for e in events], dtype=np.float64),
        sps=sps,
        final_step=final_step,
        started=(int(m["time"]), int(m["n"] or 1)) if m else (0, 0),
    )


def seed_of(run_dir: Path, name_seed: int) -> int:
    """The seed the run was started with: `args.seed` in its args.json (written by every script at start), else the
    seed in its directory name."""
    try:
        return int(json.loads((run_dir / "args.json").read_text())["args"]["seed"])
    except (OSError, ValueError, KeyError, TypeError):
        return name_seed


def distinct_seeds(runs: list[Run]) -> list[Run]:
    """One run per (env, exp name, seed), the latest started, ordered by seed within each (env, exp name). Repeats of
    a seed are the same experiment run again (a bitwise identical copy with deterministic scripts): pooled as seeds
    they would give a band that measures nothing, so each repeat is named on stderr and left out. Copies with the
    same start time (one directory copied to two places) have no latest: the last by path is used, and said so."""
    by_seed: dict[tuple[str, str, int], list[Run]] = defaultdict(list)
    for r in runs:
        by_seed[r.env, r.exp, r.seed].append(r)
    kept = []
    for (env, exp, seed), same in sorted(by_seed.items()):
        same.sort(key=lambda r: (r.started, str(r.path)))
        if len(same) > 1:
            dirs = ", ".join(str(r.path) for r in same)
            latest = same[-1].path
            rule = "latest by the start time in its name" if same[-1].started > same[-2].started else "last by path"
            print(
                f"warning: {exp} on {env}: seed {seed} has {len(same)} runs ({dirs}); using the {rule}, {latest}",
                file=sys.stderr,
            )
        kept.append(same[-1])
    return kept


def trailing_mean(x: np.ndarray, window: int) -> np.ndarray:
    """Mean of the last `window` values at every index (fewer at the start)."""
    c = np.concatenate([[0.0], np.cumsum(x)])
    idx = np.arange(1, len(x) + 1)
    lo = np.maximum(idx - window, 0)
    return (c[idx] - c[lo]) / (idx - lo)


def first_crossing(x: np.ndarray, curve: np.ndarray, threshold: float) -> float:
    hit = np.nonzero(curve >= threshold)[0]
    return float(x[hit[0]]) if len(hit) else math.nan


def on_grid(x: np.ndarray, curve: np.ndarray, grid: np.ndarray) -> np.ndarray:
    """The step function `curve` (value after the last episode at or before each grid point); NaN before the first
    episode and after the run's last episode."""
    idx = np.searchsorted(x, grid, side="right") - 1
    out = np.where(idx >= 0, curve[np.clip(idx, 0, None)], np.nan)
    out[grid > x[-1]] = np.nan
    return out


def bootstrap_band(values: np.ndarray, reps: int = 1000, seed: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """values [S, G] (NaN where a seed has no data): mean over seeds and the 95% percentile bootstrap interval."""
    s = values.shape[0]
    with warnings.catch_warnings():  # all-NaN grid points (past every seed's end) stay NaN, silently
        warnings.simplefilter("ignore", RuntimeWarning)
        mean = np.nanmean(values, axis=0)
        if s == 1:
            return mean, mean.copy(), mean.copy()
        picks = np.random.default_rng(seed).integers(0, s, size=(reps, s))  # resample seeds with replacement
        boot = np.nanmean(values[picks], axis=1)  # [reps, G]
        lo, hi = np.nanpercentile(boot, [2.5, 97.5], axis=0)
    return mean, lo, hi


def summarise(group: Group, window: int, threshold: float | None) -> dict:
    finals, sps, t_steps, t_secs = [], [], [], []
    for r in group.runs:
        finals.append(float(np.mean(r.returns[-window:])))
        sps.append(r.sps)
        if threshold is not None:
            curve = trailing_mean(r.returns, window)
            curve[: window - 1] = -np.inf  # the bar is a mean over `window` episodes: none before the window fills
            t_steps.append(first_crossing(r.steps, curve, threshold))
            t_secs.append(first_crossing(r.walls, curve, threshold))
    out = {
        "env": group.env,
        "exp": group.exp,
        "seeds": [r.seed for r in group.runs],  # distinct, in order (distinct_seeds)
        "agent_steps": [r.final_step for r in group.runs],
        "episodes": [len(r.returns) for r in group.runs],
        "final_return_per_seed": finals,
        "final_return_mean": float(np.mean(finals)),
        "final_return_min": float(np.min(finals)),
        "sps_mean": float(np.nanmean(sps)) if not all(math.isnan(v) for v in sps) else math.nan,
    }
    if threshold is not None:
        reached = [t for t in t_steps if not math.isnan(t)]
        out.update(
            threshold=threshold,
            seeds_reaching_threshold=len(reached),
            steps_to_threshold_per_seed=t_steps,
            seconds_to_threshold_per_seed=t_secs,
        )
    return out


def draw(
    env: str,
    groups: list[Group],
    window: int,
    threshold: float | None,
    tag: str,
    path: Path,
    ylim: tuple[float, float] | None = None,
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, g in enumerate(groups):
        color = colors[i % len(colors)]
        tag_note = "" if g.tag == tag else f", {g.tag}"
        for ax, axis in zip(axes, ("steps", "walls"), strict=True):
            xs = [getattr(r, axis) for r in g.runs]
            grid = np.linspace(0.0, max(float(x[-1]) for x in xs), 200)
            curves = [on_grid(x, trailing_mean(r.returns, window), grid) for x, r in zip(xs, g.runs, strict=True)]
            mean, lo, hi = bootstrap_band(np.stack(curves))
            ax.plot(grid, mean, color=color, label=f"{g.exp} ({seed_note(len(g.runs))}{tag_note})")
            if len(g.runs) > 1:  # one seed has no spread to resample
                ax.fill_between(grid, lo, hi, color=color, alpha=0.2, linewidth=0)
    for ax, xlabel in zip(axes, ("agent steps", "wall-clock time (s)"), strict=True):
        if threshold is not None:
            ax.axhline(threshold, color="grey", linestyle=":", linewidth=1)
        ax.set_xlabel(xlabel)
        if ylim:
            ax.set_ylim(*ylim)
        ax.set_ylabel(f"{tag} (mean of last {window})")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8, loc="best")
    banded = any(len(g.runs) > 1 for g in groups)
    fig.suptitle(f"{env}: mean over seeds, 95% bootstrap CI" if banded else f"{env}: one seed per run, no band")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def seed_note(n: int) -> str:
    """How many distinct seeds a curve or row stands for, and that one seed gets no band."""
    return f"{n} seeds" if n > 1 else "1 seed, no band"


def markdown_table(rows: list[dict], tag: str = "charts/episodic_return") -> str:
    has_threshold = any("threshold" in r for r in rows)
    is_return = tag.endswith("episodic_return")
    final = "final return" if is_return else f"final {tag}"
    short = "{:.1f}".format if is_return else "{:.3g}".format  # other tags (losses, rates): 0.0312, not 0.0
    head = f"| env | run | seeds | agent steps | {final} (mean, min over seeds) | steps/s |"
    sep = "|---|---|---|---|---|---|"
    if has_threshold:
        head += " steps to threshold (median) | seconds to threshold (median) | seeds reaching |"
        sep += "---|---|---|"
    lines = [head, sep]
    for r in rows:
        line = (
            f"| {r['env']} | {r['exp']} | {len(r['seeds']) if len(r['seeds']) > 1 else '1 (no band)'} "
            f"| {int(np.median(r['agent_steps'])):,} "
            f"| {short(r['final_return_mean'])} ({short(r['final_return_min'])}) | {r['sps_mean']:,.0f} |"
        )
        if has_threshold:
            if "threshold" in r and r["seeds_reaching_threshold"]:
                steps = np.nanmedian(r["steps_to_threshold_per_seed"])
                secs = np.nanmedian(r["seconds_to_threshold_per_seed"])
                line += f" {steps:,.0f} | {secs:,.0f} | {r['seeds_reaching_threshold']}/{len(r['seeds'])} |"
            else:
                line += f" — | — | 0/{len(r['seeds'])} |"
        lines.append(line)
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("paths", nargs="+", help="run directories, or directories to search for them")
    p.add_argument("--tag", default="charts/episodic_return", help="scalar to plot (default: %(default)s)")
    p.add_argument(
        "--tag-for", action="append", default=[], metavar="EXP=TAG", help="another tag for runs of one exp name"
    )
    p.add_argument("--window", type=int, default=20, help="episodes averaged for curves and the final return")
    p.add_argument("--threshold", type=float, default=None, help="return for the time-to-threshold columns")
    p.add_argument("--out", default="plots/learning", help="output prefix: writes {out}_{env}.png and {out}.json")
    p.add_argument("--title", default=None, help="heading printed above the table")
    p.add_argument("--ylim", type=float, nargs=2, default=None, metavar=("LO", "HI"), help="y-axis range of the plots")
    a = p.parse_args(argv)
    try:
        run_dirs = find_run_dirs(a.paths)
    except FileNotFoundError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    tag_for = dict(item.split("=", 1) for item in a.tag_for)
    runs = []
    for d in run_dirs:
        m = RUN_NAME.match(d.name)
        tag = tag_for.get(m["exp"] if m else d.name, a.tag)
        r = load_run(d, tag)
        if r is not None and len(r.returns):
            runs.append(r)
    if not runs:
        print(f"error: no run under {' '.join(a.paths)} has `{a.tag}` events", file=sys.stderr)
        return 2
    groups: dict[tuple[str, str], Group] = {}
    for r in distinct_seeds(runs):
        groups.setdefault((r.env, r.exp), Group(r.env, r.exp, tag_for.get(r.exp, a.tag))).runs.append(r)
    by_env: dict[str, list[Group]] = defaultdict(list)
    for key in sorted(groups):
        by_env[key[0]].append(groups[key])
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    for env, env_groups in by_env.items():
        png = out.parent / f"{out.name}_{env}.png"
        draw(env, env_groups, a.window, a.threshold, a.tag, png, a.ylim)
        print(f"wrote {png}")
        rows += [summarise(g, a.window, a.threshold) for g in env_groups]
    json_path = out.parent / f"{out.name}.json"
    summary = {"tag": a.tag, "tag_for": tag_for, "window": a.window, "runs": rows}
    json_path.write_text(json.dumps(summary, indent=1, allow_nan=True))
    print(f"wrote {json_path}\n")
    if a.title:
        print(f"### {a.title}\n")
    print(markdown_table(rows, a.tag))
    return 0


if __name__ == "__main__":
    sys.exit(main())
