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
steps/s, running time, and time to threshold (first agent step / second at which the mean of the last `--window`
episodes reaches `--threshold`, counted once `--window` episodes exist). A run taken in pieces (`--resume`) is timed by
its running time (the downtime between its pieces is left out), and the episodes that a later piece redid from its
checkpoint count once.

Runs of different env ids that share a protocol can share a figure, named explicitly: `--same-env
PongNoFrameskip-v4=ALE/Pong-v5` draws the runs of the first id (a reference such as CleanRL's ppo_atari.py) in the
second id's figure and JSON, each keeping its own env id in the legend and the table; `--frames` puts frames (agent
steps x 4, the frame skip of the deepmind protocol and of NoFrameskip-v4 with its usual wrappers) on the x axis and in
the table, and `--at-frames` adds, per run, the mean of the last `--window` episodes that ended at or before each frame
budget ('—' where the run stopped before it). `--label OLD=NEW` renames a run's label (its exp name) in the legend,
the table and the JSON.

Examples:
  python benchmarks/plot.py runs/                                        # every run under runs/
  python benchmarks/plot.py runs/learn/cartpole --threshold 475 --out benchmarks/results/cartpole
  python benchmarks/plot.py runs/learn/cartpole --tag eval/episodic_return   # e.g. Ape-X's greedy evaluation
  python benchmarks/plot.py runs/gpu ../cleanrl/runs --same-env PongNoFrameskip-v4=ALE/Pong-v5 --frames \
      --at-frames 4000000 10000000 --label ppo_atari=cleanrl_ppo_atari --out benchmarks/results/pong_ref_ppo
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
# Atari frames per agent step: the deepmind protocol's frame skip, and MaxAndSkipEnv(skip=4) on a NoFrameskip-v4 id
FRAMES_PER_STEP = 4
# A run reaches a frame budget when it gets within this fraction of it: a budget of agent steps ends at whole updates,
# e.g. 2.5M agent steps in updates of 32 envs x 128 steps end at 2,498,560 (9,994,240 frames of a 10M budget)
BUDGET_SLACK = 0.001


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
    seconds: float  # running time from the first event to the last, less the downtime of a resumed run
    started: tuple[int, int] = (0, 0)  # (unix time, same-second suffix) of the directory name: orders repeated runs


@dataclass
class Group:
    env: str  # the figure's env: the runs' own, or the one `--same-env` maps it to
    exp: str
    tag: str
    run_env: str  # the env id in the runs' directory names
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
        seconds=float(duration),
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


def return_at_frames(run: Run, frames: int, window: int) -> float | None:
    """Mean of the last `window` episodes that ended at or before `frames` (agent steps x FRAMES_PER_STEP); None when
    the run stopped before that budget (less BUDGET_SLACK) or had no episode by then."""
    ended = run.returns[run.steps * FRAMES_PER_STEP <= frames]
    reached = run.final_step * FRAMES_PER_STEP >= frames * (1 - BUDGET_SLACK)
    return float(np.mean(ended[-window:])) if reached and len(ended) else None


def at_budgets(group: Group, window: int, budgets: tuple[int, ...]) -> list[dict]:
    """Per frame budget: each seed's return there (None where it stopped before) and the mean over the seeds that got
    there."""
    out = []
    for frames in budgets:
        per_seed = [return_at_frames(r, frames, window) for r in group.runs]
        reached = [v for v in per_seed if v is not None]
        mean = float(np.mean(reached)) if reached else None
        out.append(dict(frames=frames, per_seed=per_seed, mean=mean, seeds_reaching=len(reached)))
    return out


def summarise(
    group: Group, window: int, threshold: float | None, budgets: tuple[int, ...] = (), frames: bool = False
) -> dict:
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
        "run_env": group.run_env,
        "exp": group.exp,
        "seeds": [r.seed for r in group.runs],  # distinct, in order (distinct_seeds)
        "agent_steps": [r.final_step for r in group.runs],
        "episodes": [len(r.returns) for r in group.runs],
        "final_return_per_seed": finals,
        "final_return_mean": float(np.mean(finals)),
        "final_return_min": float(np.min(finals)),
        "sps_mean": float(np.nanmean(sps)) if not all(math.isnan(v) for v in sps) else math.nan,
        "running_seconds": [r.seconds for r in group.runs],
    }
    if frames:
        out["frames"] = [r.final_step * FRAMES_PER_STEP for r in group.runs]
    if budgets:
        out["at_frames"] = at_budgets(group, window, budgets)
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
    frames: bool = False,
) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    scale = FRAMES_PER_STEP if frames else 1
    for i, g in enumerate(groups):
        color = colors[i % len(colors)]
        notes = [g.run_env] if g.run_env != env else []  # a run drawn here by `--same-env` names its own env id
        notes += [seed_note(len(g.runs))] + ([g.tag] if g.tag != tag else [])
        for ax, xs in zip(axes, ([r.steps * scale for r in g.runs], [r.walls for r in g.runs]), strict=True):
            grid = np.linspace(0.0, max(float(x[-1]) for x in xs), 200)
            curves = [on_grid(x, trailing_mean(r.returns, window), grid) for x, r in zip(xs, g.runs, strict=True)]
            mean, lo, hi = bootstrap_band(np.stack(curves))
            ax.plot(grid, mean, color=color, label=f"{g.exp} ({', '.join(notes)})")
            if len(g.runs) > 1:  # one seed has no spread to resample
                ax.fill_between(grid, lo, hi, color=color, alpha=0.2, linewidth=0)
    x_steps = f"frames (agent steps x {FRAMES_PER_STEP})" if frames else "agent steps"
    for ax, xlabel in zip(axes, (x_steps, "wall-clock time (s)"), strict=True):
        if threshold is not None:
            ax.axhline(threshold, color="grey", linestyle=":", linewidth=1)
        ax.set_xlabel(xlabel)
        if ylim:
            ax.set_ylim(*ylim)
        ax.set_ylabel(f"{tag} (mean of last {window})")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8, loc="best")
    banded = any(len(g.runs) > 1 for g in groups)
    others = sorted({g.run_env for g in groups} - {env})
    title = f"{env} (and {', '.join(others)}: same protocol)" if others else env
    fig.suptitle(f"{title}: mean over seeds, 95% bootstrap CI" if banded else f"{title}: one seed per run, no band")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def seed_note(n: int) -> str:
    """How many distinct seeds a curve or row stands for, and that one seed gets no band."""
    return f"{n} seeds" if n > 1 else "1 seed, no band"


def env_cell(row: dict) -> str:
    """A row's env; a run drawn under another env id by `--same-env` names both."""
    return row["env"] if row.get("run_env", row["env"]) == row["env"] else f"{row['run_env']} (as {row['env']})"


def at_frames_cell(budget: dict, seeds: int, short) -> str:
    """The mean return at a frame budget; the seeds that got there when not all did; '—' when none did."""
    if budget["mean"] is None:
        return "—"
    reached = budget["seeds_reaching"]
    return short(budget["mean"]) + ("" if reached == seeds else f" ({reached}/{seeds} seeds)")


def markdown_table(rows: list[dict], tag: str = "charts/episodic_return", frames: bool = False) -> str:
    has_threshold = any("threshold" in r for r in rows)
    is_return = tag.endswith("episodic_return")
    final = "final return" if is_return else f"final {tag}"
    short = "{:.1f}".format if is_return else "{:.3g}".format  # other tags (losses, rates): 0.0312, not 0.0
    scale, unit = (FRAMES_PER_STEP, "frames") if frames else (1, "agent steps")
    budgets = [b["frames"] for b in rows[0].get("at_frames", [])]
    head = f"| env | run | seeds | {unit} | {final} (mean, min over seeds) | agent steps/s | running time (min) |"
    head += "".join(f" {final} at {b:,} frames |" for b in budgets)
    sep = "|---|---|---|---|---|---|---|" + "---|" * len(budgets)
    if has_threshold:
        head += f" {'frames' if frames else 'steps'} to threshold (median) | seconds to threshold (median) |"
        head += " seeds reaching |"
        sep += "---|---|---|"
    lines = [head, sep]
    for r in rows:
        line = (
            f"| {env_cell(r)} | {r['exp']} "
            f"| {len(r['seeds']) if len(r['seeds']) > 1 else '1 (no band)'} "
            f"| {int(np.median(r['agent_steps'])) * scale:,} "
            f"| {short(r['final_return_mean'])} ({short(r['final_return_min'])}) | {r['sps_mean']:,.0f} "
            f"| {np.median(r['running_seconds']) / 60:,.0f} |"
        )
        line += "".join(f" {at_frames_cell(b, len(r['seeds']), short)} |" for b in r.get("at_frames", []))
        if has_threshold:
            if "threshold" in r and r["seeds_reaching_threshold"]:
                steps = np.nanmedian(r["steps_to_threshold_per_seed"]) * scale
                secs = np.nanmedian(r["seconds_to_threshold_per_seed"])
                line += f" {steps:,.0f} | {secs:,.0f} | {r['seeds_reaching_threshold']}/{len(r['seeds'])} |"
            else:
                line += f" — | — | 0/{len(r['seeds'])} |"
        lines.append(line)
    return "\n".join(lines)


def pairs(items: list[str], flag: str) -> dict[str, str]:
    """`A=B` items of a repeatable flag as a dict; ValueError naming the flag for an item without both sides."""
    out = {}
    for item in items:
        left, sep, right = item.partition("=")
        if not (sep and left and right):
            raise ValueError(f"{flag} takes A=B, got {item!r}")
        out[left] = right
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
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
    p.add_argument(
        "--same-env",
        action="append",
        default=[],
        metavar="ID=INTO",
        help="draw the runs of env ID in the figure and JSON of env INTO, keeping ID in their legend and rows:\n"
        "for ids with one protocol, e.g. PongNoFrameskip-v4=ALE/Pong-v5 (with the deepmind protocol)",
    )
    p.add_argument(
        "--frames",
        action="store_true",
        help=f"x axis and table in Atari frames (agent steps x {FRAMES_PER_STEP}) instead of agent steps",
    )
    p.add_argument(
        "--at-frames",
        type=int,
        nargs="+",
        default=[],
        metavar="FRAMES",
        help=f"per run, the mean of the last --window episodes that ended at or before each budget in frames\n"
        f"(agent steps x {FRAMES_PER_STEP}); '—' where a run stopped before it (one within"
        f" {BUDGET_SLACK * 100:g}%% of it\nreached it: a budget of agent steps ends at whole updates)",
    )
    p.add_argument(
        "--label", action="append", default=[], metavar="EXP=NAME", help="show the runs of exp name EXP as NAME"
    )
    return p.parse_args(argv)


def load_runs(run_dirs: list[Path], tag: str, tag_for: dict[str, str], labels: dict[str, str]) -> list[Run]:
    """The runs with at least one event of their tag (`tag_for` by the exp name in the directory name), each renamed
    by `labels`."""
    runs = []
    for d in run_dirs:
        m = RUN_NAME.match(d.name)
        r = load_run(d, tag_for.get(m["exp"] if m else d.name, tag))
        if r is not None and len(r.returns):
            r.exp = labels.get(r.exp, r.exp)
            runs.append(r)
    return runs


def unused(run_dirs: list[Path], same_env: dict[str, str], labels: dict[str, str]) -> list[str]:
    """A warning for each `--same-env` id and `--label` exp name that no run directory has: a typo must not pass
    unseen."""
    names = [m for d in run_dirs if (m := RUN_NAME.match(d.name))]
    envs, exps = {m["env"] for m in names}, {m["exp"] for m in names}
    return [f"warning: --same-env {e}: no run of env {e}" for e in same_env if e not in envs] + [
        f"warning: --label {e}: no run of exp name {e}" for e in labels if e not in exps
    ]


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    try:
        run_dirs = find_run_dirs(a.paths)
        tag_for = pairs(a.tag_for, "--tag-for")
        labels = pairs(a.label, "--label")
        # env ids as run directories spell them (`/` replaced by `_`)
        same_env = {k.replace("/", "_"): v.replace("/", "_") for k, v in pairs(a.same_env, "--same-env").items()}
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    runs = load_runs(run_dirs, a.tag, tag_for, labels)
    if not runs:
        print(f"error: no run under {' '.join(a.paths)} has `{a.tag}` events", file=sys.stderr)
        return 2
    for line in unused(run_dirs, same_env, labels):
        print(line, file=sys.stderr)
    groups: dict[tuple[str, str, str], Group] = {}
    for r in distinct_seeds(runs):
        env = same_env.get(r.env, r.env)
        groups.setdefault((env, r.exp, r.env), Group(env, r.exp, tag_for.get(r.exp, a.tag), r.env)).runs.append(r)
    by_env: dict[str, list[Group]] = defaultdict(list)
    for key in sorted(groups):
        by_env[key[0]].append(groups[key])
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = []
    for env, env_groups in by_env.items():
        png = out.parent / f"{out.name}_{env}.png"
        draw(env, env_groups, a.window, a.threshold, a.tag, png, a.ylim, a.frames)
        print(f"wrote {png}")
        rows += [summarise(g, a.window, a.threshold, tuple(a.at_frames), a.frames) for g in env_groups]
    json_path = out.parent / f"{out.name}.json"
    summary = {"tag": a.tag, "tag_for": tag_for, "window": a.window, "runs": rows}
    if same_env or labels or a.frames or a.at_frames:
        summary |= {"same_env": same_env, "labels": labels, "frames_per_agent_step": FRAMES_PER_STEP}
        summary |= {"budget_slack": BUDGET_SLACK} if a.at_frames else {}
    json_path.write_text(json.dumps(summary, indent=1, allow_nan=True))
    print(f"wrote {json_path}\n")
    if a.title:
        print(f"### {a.title}\n")
    print(markdown_table(rows, a.tag, a.frames))
    return 0


if __name__ == "__main__":
    sys.exit(main())
