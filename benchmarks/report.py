"""Every table of benchmarks/RESULTS.md, and the README's summary table, generated from benchmarks/results/*.json.

A table sits between `<!-- report:NAME -->` and `<!-- /report:NAME -->`: report.py rewrites what is between the two
markers and nothing else, so the prose around a table is written by hand and its numbers are not. Each table ends
with the JSON files its rows come from. Which JSON is current is data here (`CLASSIC_SOURCES`, ...): a row from a
later file replaces the row of the same run from an earlier one. The Pong table takes every `pong_cpu*.json` there
is (less the runs `REPLACED_BY` names), so a new Pong result is its JSON and manifest plus a re-run of this tool;
the table of Pong beside the reference implementations takes its families from `pong_references.json`.

    python benchmarks/report.py            # rewrite the tables in README.md and benchmarks/RESULTS.md
    python benchmarks/report.py --check    # exit 1, naming the tables that differ from what report.py would write
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import re
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MARKER = re.compile(r"(<!-- report:(?P<name>[\w-]+) -->\n)(?P<body>.*?)(<!-- /report:(?P=name) -->)", re.S)

CLASSIC_SOURCES = ["cartpole.json", "cartpole_hts_ppo_released.json", "pendulum.json"]
PONG_CPU_GLOB = "pong_cpu*.json"
# learn.py and the benchmark drivers name a run after what it runs: the first matching prefix gives the script
SCRIPT_OF_PREFIX = [("cleanba_", "cleanba_ppo_impala.py"), ("hts_a2c", "hts_a2c.py"), ("hts_ppo", "hts_ppo.py"),
                    ("impala", "impala_monobeast.py"), ("gala", "gala_a2c.py"), ("a3c", "a3c_large_batch.py"),
                    ("apex_dqn", "apex_dqn.py"), ("apex_ddpg", "apex_ddpg.py")]  # fmt: skip
# flags that name a run (learn.py's and the drivers'), not its settings; and the settings every row of a table shares
NAMING_FLAGS = {"--env-id", "--seed", "--total-timesteps", "--exp-name", "--log-dir", "--resume"}
PONG_FLAGS = {"--atari-protocol", "--checkpoint-interval"}
SHARED_FLAGS = NAMING_FLAGS | {"--atari-protocol", "--network"}  # the drivers' Breakout runs: deepmind, Nature CNN

# ----------------------------------------------------------------------------------------------------------------
# Reading and formatting
# ----------------------------------------------------------------------------------------------------------------


def load(path: Path) -> dict:
    return json.loads(path.read_text())  # plot.py writes NaN for a seed that never reached the bar


def num(x, digits: int = 0) -> str:
    missing = x is None or (isinstance(x, float) and math.isnan(x))
    return "—" if missing else f"{x:,.{digits}f}"


def nan_median(values: list[float]) -> float:
    kept = [v for v in values if not math.isnan(v)]
    return statistics.median(kept) if kept else math.nan


def spread(values: list[float]) -> str:
    return f"{num(min(values))}–{num(max(values))} ({max(values) / min(values) - 1:.0%})"


def script_of(label: str) -> str:
    return next((script for prefix, script in SCRIPT_OF_PREFIX if label.startswith(prefix)), "?")


def flags_of(command: list[str], drop: set[str]) -> str:
    """The `--flag [value]` pairs of a command (script first) less those in `drop`; 'defaults' when none is left."""
    kept = []
    for i, token in enumerate(command[1:], 1):
        if token.startswith("--") and token not in drop:
            value = command[i + 1] if i + 1 < len(command) and not command[i + 1].startswith("--") else ""
            kept.append(f"{token} {value}".strip())
    return f"`{' '.join(kept)}`" if kept else "defaults"


def table(header: str, align: str, rows: list[str]) -> str:
    """A Markdown table from ' | '-separated cells; `align` has one letter per column, l(eft) or r(ight)."""
    rule = " | ".join("---:" if a == "r" else "---" for a in align)
    return "\n".join(f"| {line} |" for line in [header, rule, *rows])


def link(name: str) -> str:
    return f"[`{name}`](results/{name})"


def provenance(results: Path, name: str) -> str:
    """When and where a JSON was measured, from what it records about itself and its learn.py manifest."""
    data = load(results / name)
    meta = data.get("meta", data)
    cores = meta.get("cpus") or meta.get("cores") or data.get("cpu_count")
    date = meta.get("time") or (meta.get("date") or "")[:10]  # throughput.py writes an ISO 8601 date and time
    bits = [date, meta.get("cpu_model"), f"{cores} CPUs" if cores else meta.get("machine"), meta.get("gpu")]
    bits.append(f"torch {meta['torch']}" if meta.get("torch") else None)
    manifest = results / name.replace(".json", "_manifest.json")
    bits.append(load(manifest)["machine"] if manifest.exists() else None)
    return ", ".join(b for b in bits if b)


def sources(results: Path, names: list[str]) -> str:
    parts = [link(n) + (f" ({p})" if (p := provenance(results, n)) else "") for n in dict.fromkeys(names)]
    return "\n\nJSON: " + "; ".join(parts) + "."


def figure(results: Path, name: str, env: str, text: str | None = "curves") -> str:
    """plot.py's figure beside a learning JSON, `{stem}_{env}.png`, as a link named `text` or, if None, the file name
    ('—' when there is none)."""
    png = f"{name.removesuffix('.json')}_{env}.png"
    return f"[{text or png}](results/{png})" if (results / png).exists() else "—"


# ----------------------------------------------------------------------------------------------------------------
# Learning (plot.py's JSON: one record per env and label, seeds pooled)
# ----------------------------------------------------------------------------------------------------------------


def learning_runs(results: Path, names: list[str]) -> list[tuple[dict, str]]:
    """(run, JSON name) for every env and label in `names`, a later file's run replacing an earlier one's."""
    runs = {(run["env"], run["exp"]): (run, name) for name in names for run in load(results / name)["runs"]}
    return [runs[key] for key in sorted(runs)]


def classic_control_table(results: Path) -> str:
    rows = [
        f"{r['env']} | `{r['exp']}` | {len(r['seeds'])} | {num(statistics.median(r['agent_steps']))} | "
        f"{num(r['final_return_mean'], 1)} ({num(r['final_return_min'], 1)}) | {num(r['threshold'])} | "
        f"{r['seeds_reaching_threshold']}/{len(r['seeds'])} | {num(nan_median(r['steps_to_threshold_per_seed']))} | "
        f"{link(name)} | {figure(results, name, r['env'])}"
        for r, name in learning_runs(results, CLASSIC_SOURCES)
    ]
    header = ("env | run | seeds | agent steps | final return: mean (worst seed) | bar | seeds reaching it | "
              "agent steps to the bar (median) | JSON | curves")  # fmt: skip
    return table(header, "llrrrrrrll", rows) + sources(results, CLASSIC_SOURCES)


def pong_cpu_files(results: Path) -> list[str]:
    return sorted(p.name for p in results.glob(PONG_CPU_GLOB) if not p.name.endswith("_manifest.json"))


# A Pong run that a later run of the same label replaces, and the JSON of the later run. The older JSON stays as
# plot.py wrote it, its figure with it; its row leaves the Pong table and the summary once the later JSON holds the
# label. impala_batched_small and hts_ppo: cut short (at 1.46M and 1.40M agent steps) on older code, then run again to
# the budget on current code.
REPLACED_BY = {
    ("pong_cpu_impala2.json", "impala_batched_small"): "pong_cpu_impala_small.json",
    ("pong_cpu_hts_ppo8.json", "hts_ppo"): "pong_cpu_hts_ppo.json",
    ("pong_cpu.json", "gala_gossip"): "pong_cpu_gate_gala.json",  # older code, 2.5M steps; then the gate's 5M budget
    ("pong_cpu_impala_small.json", "impala_batched_small"): "pong_cpu_gate_impala.json",  # 2.5M steps; then 5M
    ("pong_cpu_impala2.json", "cleanba_impala_nature"): "pong_cpu_gate_cleanba_impala.json",  # older code; the gate
    ("pong_cpu_a3c_eps1e-3.json", "a3c_hogwild"): "pong_cpu_gate_a3c.json",  # 2.5M steps; then the gate's 5M budget
}


def pong_cpu_runs(results: Path) -> list[tuple[str, dict]]:
    """(JSON name, run) for every run of every pong_cpu*.json, less those a later run replaces (REPLACED_BY)."""
    found = [(name, r) for name in pong_cpu_files(results) for r in load(results / name)["runs"]]
    labels = {(name, r["exp"]) for name, r in found}
    return [(name, r) for name, r in found if (REPLACED_BY.get((name, r["exp"])), r["exp"]) not in labels]


# Runs whose command left a flag at a default the script has since changed: the values they ran with.
# hts_ppo.py's default update was the paper's Eq. 6 before HTS-RL's released form (RESULTS, Differences from papers).
# cleanba_ppo_impala.py's defaults are Cleanba's (IMPALA ResNet, 128 envs x 2 actor threads); these runs ran at
# CleanRL ppo_atari's size (8 envs, one actor thread; the Nature CNN, which `auto` picked for PPO).
RAN_WITH = {
    ("pong_cpu_impala2.json", "cleanba_impala_nature"): ["--num-envs", "8", "--num-actor-threads", "1"],
    ("pong_h100.json", "cleanba_ppo"): ["--network", "nature", "--num-actor-threads", "1"],
    ("pong_cpu_hts_ppo.json", "hts_ppo"): ["--delayed-update", "eq6"],  # the default until released made it
    ("pong_cpu_hts_ppo8.json", "hts_ppo"): ["--delayed-update", "eq6"],
    ("pong_ref_ppo_hts.json", "hts_ppo"): ["--delayed-update", "eq6"],
    ("pong_h100.json", "hts_ppo"): ["--delayed-update", "eq6"],
    ("pong_h100_eps0.01.json", "cleanba_ppo"): ["--network", "nature", "--num-actor-threads", "1"],
}


def ran_with(command: list[str], name: str, label: str) -> list[str]:
    """A recorded command with the flags its run had at a default since changed (RAN_WITH): what reproduces it."""
    return [*command, *RAN_WITH.get((name, label), [])]


def run_flags(results: Path, name: str, label: str) -> str:
    """A learn.py run's settings: the flags of its command in the JSON's manifest (its last piece, if resumed), with
    those it ran with at a default since changed."""
    manifest = results / name.replace(".json", "_manifest.json")
    commands = [r["command"] for r in load(manifest)["runs"] if r["label"] == label] if manifest.exists() else []
    return flags_of(ran_with(commands[-1], name, label), NAMING_FLAGS | PONG_FLAGS) if commands else "—"


def pong_cpu_table(results: Path) -> str:
    found = pong_cpu_runs(results)
    rows = []
    for name, r in sorted(found, key=lambda item: (script_of(item[1]["exp"]), item[1]["exp"], item[0])):
        steps = statistics.median(r["agent_steps"])
        rows.append(
            f"`{r['exp']}` | {script_of(r['exp'])} | {run_flags(results, name, r['exp'])} | {num(steps)} | "
            f"{num(r['final_return_mean'], 1)} | {num(r['sps_mean'])} | {num(steps / r['sps_mean'] / 60)} | "
            f"{link(name)} | {figure(results, name, r['env'])}"
        )
    header = ("run | script | flags | agent steps | final return (last 20 episodes) | agent steps/s | "
              "running time (min) | JSON | curves")  # fmt: skip
    return table(header, "lllrrrrll", rows) + sources(results, sorted({name for name, _ in found}))


def pong_h100_table(results: Path) -> str:
    name = "pong_h100.json"
    rows = [
        f"`{r['exp']}` | {script_of(r['exp'])} | {run_flags(results, name, r['exp'])} | "
        f"{num(statistics.median(r['agent_steps']))} | {num(r['final_return_mean'], 1)} | {num(r['sps_mean'])}"
        for r, _ in learning_runs(results, [name])
    ]
    header = "run | script | flags | agent steps | final return (last 20 episodes) | agent steps/s"
    curves = f"\n\nCurves: {figure(results, name, 'ALE_Pong-v5', None)}."
    return table(header, "lllrrr", rows) + curves + sources(results, [name])


REFERENCES = "pong_references.json"  # per family: the plot.py JSON of our runs and the reference's, what each ran


def manifest_record(side: dict, results: Path) -> dict:
    """A side's run in its learn.py manifest (the last piece, if resumed); a reference's is its references entry."""
    if "manifest" not in side:
        return {"command": side["command"], "stopped_at_time_limit": False}
    return [r for r in load(results / side["manifest"])["runs"] if r["label"] == side["exp"]][-1]


def without_paths(command: list[str]) -> list[str]:
    """A command less `--log-dir DIR` and `--resume PATH`: where a run wrote on its machine, and the checkpoint its last
    piece continued from, are no settings of it."""
    for name in ("--log-dir", "--resume"):
        i = command.index(name) if name in command else len(command)
        command = command[:i] + command[i + 2 :]
    return command


def steps_reached(run: dict, record: dict) -> str:
    """'reached of budget', and whether learn.py's time limit cut the run."""
    command, reached = record["command"], num(statistics.median(run["agent_steps"]))
    budget = command[command.index("--total-timesteps") + 1] if "--total-timesteps" in command else None
    cut = " (time limit)" if record["stopped_at_time_limit"] else ""
    return reached + (f" of {num(int(budget))}" if budget else "") + cut


def at_frames(run: dict, frames: int) -> str:
    """plot.py --at-frames: the mean return at a frame budget over the seeds that got there ('—' if none did)."""
    return num({b["frames"]: b for b in run["at_frames"]}[frames]["mean"], 1)


def pong_references_table(results: Path) -> str:
    """Our Pong runs beside the reference implementations' own code, per algorithm family, from the plot.py JSONs and
    manifests that pong_references.json names."""
    refs = load(results / REFERENCES)
    budgets, rows, curves, names = refs["at_frames"], [], [], [REFERENCES]
    for family in refs["families"]:
        names += [family["plot"]]
        curves.append(f"{family['family']}: {figure(results, family['plot'], family['env'], None)}")
        own: dict[str, list[str]] = {}  # a figure of their own -> the sides drawn in it, linked once
        for side in family["runs"]:
            # a side whose curve is not in the family's figure (the other runs' event files were gone when it
            # finished) names its own plot.py JSON and figure, which later sides may share
            plot = side.get("plot", family["plot"])
            if plot != family["plot"]:
                names += [] if plot in own else [plot]
                own.setdefault(plot, []).append(f"`{side['exp']}`")
            names += [side["manifest"]] if "manifest" in side else []
            run = {r["exp"]: r for r in load(results / plot)["runs"]}[side["exp"]]
            record = manifest_record(side, results)
            manifest_machine = load(results / side["manifest"]).get("machine") if "manifest" in side else None
            machine = ", ".join(m for m in (side["machine"], manifest_machine) if m)
            rows.append(
                f"{family['family']} | `{side['exp']}` | {side['code']} | {machine} | "
                + " | ".join(at_frames(run, b) for b in budgets)
                + f" | {steps_reached(run, record)} | {num(run['sps_mean'])} | "
                f"{num(statistics.median(run['running_seconds']) / 60)} | "
                f"`python {' '.join(without_paths(ran_with(record['command'], plot, side['exp'])))}`"
            )
        for plot, exps in own.items():
            drawn = " and ".join([", ".join(exps[:-1]), exps[-1]] if len(exps) > 1 else exps)
            curves.append(f"{family['family']}, {drawn}: {figure(results, plot, family['env'], None)}")
    header = ("family | run | code | machine | "
              + " | ".join(f"final return at {b / 1e6:g}M frames (last 20 episodes)" for b in budgets)
              + " | agent steps reached | agent steps/s | wall time (min) | command")  # fmt: skip
    figures = "\n\nCurves: " + "; ".join(curves) + "."
    return table(header, "llll" + "r" * (len(budgets) + 3) + "l", rows) + figures + sources(results, names)


def a3c_eps_table(results: Path) -> str:
    loss, ret = "a3c_eps_h100_value_loss.json", "a3c_eps_h100.json"
    returns = {r["exp"]: r["final_return_mean"] for r in load(results / ret)["runs"]}
    rows = [  # plot.py calls the last-`window` mean of any tag its "final return"
        f"`{r['exp']}` | {len(r['seeds'])} | {num(statistics.median(r['agent_steps']))} | "
        f"{r['final_return_mean']:.3f} ({max(r['final_return_per_seed']):.3f}) | {num(returns.get(r['exp']), 1)}"
        for r, _ in learning_runs(results, [loss])
    ]
    header = ("run (workers x envs, RMSprop eps) | seeds | agent steps (median) | "
              "value loss, last 50 points: mean (worst seed) | return (last 20 episodes)")  # fmt: skip
    curves = (f"\n\nCurves: {figure(results, loss, 'ALE_Pong-v5', 'value loss')}, "
              f"{figure(results, ret, 'ALE_Pong-v5', 'return')}.")  # fmt: skip
    return table(header, "lrrrr", rows) + curves + sources(results, [loss, ret])


# ----------------------------------------------------------------------------------------------------------------
# Throughput and memory (throughput.py's JSON: one row per configuration, medians over its rounds)
# ----------------------------------------------------------------------------------------------------------------


def ceiling(r: dict) -> str:
    """`ceiling (env / infer / train)`; a script whose learner runs apart from its actors (Ape-X) has no train piece."""
    return f"{num(r['ceiling'])} ({num(r['env'])} / {num(r['infer'])} / {num(r.get('train'))})"


def driver_rows(results: Path, names: list[str]) -> list[dict]:
    """The rows of throughput.py's JSONs `names`, in order, without the external commands (peers)."""
    return [r for name in names for r in load(results / name)["rows"] if not r.get("external")]


def scalar(r: dict, tag: str) -> float:
    """The median over a row's rounds of a TensorBoard scalar's mean over each run's steady part."""
    values = [x["scalars"][tag] for x in r["rounds"] if tag in x.get("scalars", {})]
    return statistics.median(values) if values else math.nan


def lag_max(r: dict) -> float | None:
    return max((x["policy_lag_max"] for x in r["rounds"] if x.get("policy_lag_max") is not None), default=None)


def versus(r: dict) -> str:
    """The speed-up over the row's baseline mode in the same JSON ('—' on the baseline's own row)."""
    return f"{r['speedup_vs_baseline']:.2f}x" if r.get("speedup_vs_baseline") else "—"


# A column: (header, alignment l or r, its cell from one row)
Column = tuple[str, str, Callable[[dict], str]]
RUN: Column = ("run", "l", lambda r: f"`{r['label']}`")
SCRIPT: Column = ("script", "l", lambda r: script_of(r["label"]))
SPLIT: Column = ("workers x envs", "l", lambda r: f"{r['workers']} x {r['num_envs'] // r['workers']}")
CEILING: Column = ("ceiling (env / infer / train)", "r", ceiling)
SPS: Column = ("agent steps/s", "r", lambda r: num(r["sps"]))
EFFICIENCY: Column = ("efficiency", "r", lambda r: num(r.get("efficiency"), 2))
VERSUS: Column = ("against its baseline mode", "r", versus)
LAG: Column = ("policy lag mean / max", "r", lambda r: f"{num(r['policy_lag_mean'], 2)} / {num(lag_max(r))}")
PSS: Column = ("peak PSS MiB", "r", lambda r: num(r["pss_peak_mib"]))
STD: Column = ("step-time std", "r", lambda r: f"{num(r['std_ms'])} ms")


def driver_table(results: Path, names: list[str], columns: list[Column], keep=lambda r: True) -> str:
    """One Markdown row per kept row of throughput.py's JSONs `names`, one cell per column, then the sources."""
    rows = [" | ".join(cell(r) for _, _, cell in columns) for r in driver_rows(results, names) if keep(r)]
    header, align = " | ".join(c[0] for c in columns), "".join(c[1] for c in columns)
    return table(header, align, rows) + sources(results, names)


TABLE_SOURCE = "throughput_table.json"  # `python benchmarks/throughput.py` (every label, one configuration)


def all_scripts_table(results: Path) -> str:
    """throughput.py's table mode: each label's steady rate against its ceiling and CPU bound, and its baseline mode."""
    flags = ("flags", "l", lambda r: flags_of(r["command"].split()[1:], SHARED_FLAGS))
    bound = ("CPU bound", "r", lambda r: num(r.get("bound")) + (" (exceeded)" if r.get("exceeds_bound") else ""))
    return driver_table(results, [TABLE_SOURCE], [RUN, SCRIPT, flags, SPS, CEILING, EFFICIENCY, bound, VERSUS, PSS])


# every label in 20-s runs, then Cleanba PPO in 60-s runs (an update of 8 x 128 straggler steps takes about 11 s)
STRAGGLER_SOURCES = ["throughput_straggler.json", "throughput_straggler_cleanba_ppo.json"]


def straggler_table(results: Path) -> str:
    """Every label on the straggler env, one column per step-time std; a later JSON's run replaces an earlier one's."""
    rows = driver_rows(results, STRAGGLER_SOURCES)
    stds = sorted({r["std_ms"] for r in rows})
    sps = {(r["label"], r["std_ms"]): r["sps"] for r in rows}
    labels = list(dict.fromkeys(r["label"] for r in rows))
    lines = [f"`{label}` | {script_of(label)} | " + " | ".join(num(sps[label, s]) for s in stds) for label in labels]
    header = "run | script | " + " | ".join(f"agent steps/s, std {num(s)} ms" for s in stds)
    return table(header, "ll" + "r" * len(stds), lines) + sources(results, STRAGGLER_SOURCES)


def env_table(results: Path) -> str:
    name = "throughput_env.json"
    rows = [
        f"{r['env']} | {r['num_envs']} | {r['num_threads']} | {r['batch']} | {num(r['agent_steps_per_s'])} | "
        f"{num(r['frames_per_s'])}"
        for r in load(results / name)["rows"]
    ]
    return table("env | envs | threads | batch | agent steps/s | frames/s", "lrrrrr", rows) + sources(results, [name])


def cleanba_table(results: Path) -> str:
    """Seconds per update: the learner's training and its wait on rollout_Q, the actor's wait on param_Q."""
    seconds = [(f"{what} (s/update)", "r", lambda r, tag=tag: num(scalar(r, tag), 3)) for what, tag in (
        ("learner trains", "timing/train"), ("learner waits on `rollout_Q`", "timing/rollout_queue_get"),
        ("actor waits on `param_Q`", "timing/param_queue_get"))]  # fmt: skip
    columns = [RUN, CEILING, SPS, EFFICIENCY, VERSUS, *seconds, PSS]
    return driver_table(results, ["throughput_cleanba.json"], columns)


CLEANBA_THREADS_SOURCE = "throughput_cleanba_threads.json"  # the 1-thread runs are --external commands of the script
CLEANBA_IMPALA_THREADS_SOURCE = "throughput_cleanba_impala_threads.json"  # the same, --algo impala
CLEANBA_THREADS = [("torch's default, one per core", ""), ("1 (`--torch-threads 1`)", "_1_thread")]


def cleanba_threads_table(results: Path, source: str = CLEANBA_THREADS_SOURCE, algo: str = "ppo") -> str:
    """Cleanba PPO (or IMPALA) against its --sync mode at each learner thread count, all four alternating over the
    same rounds."""
    rows = {r["label"]: r for r in load(results / source)["rows"]}
    lines = []
    for threads, suffix in CLEANBA_THREADS:
        cleanba, sync = rows[f"cleanba_{algo}{suffix}"], rows[f"cleanba_{algo}_sync{suffix}"]
        rates = [" ".join(num(x["sps"]) for x in r["rounds"]) for r in (cleanba, sync)]
        lines.append(f"{threads} | {num(cleanba['sps'])} ({rates[0]}) | {num(sync['sps'])} ({rates[1]}) | "
                     f"{cleanba['sps'] / sync['sps']:.2f}x")  # fmt: skip
    header = ("learner torch threads | Cleanba mode agent steps/s (per round) | `--sync` agent steps/s (per round) | "
              "Cleanba over `--sync`")  # fmt: skip
    return table(header, "lrrr", lines) + sources(results, [source])


def hts_table(results: Path) -> str:
    return driver_table(results, ["throughput_hts.json"], [RUN, CEILING, SPS, EFFICIENCY, VERSUS, PSS])


def hts_straggler_table(results: Path) -> str:
    """HTS-RL against its --sync mode at each step-time std (the HTS-RL row carries both), with Eq. 7's bound."""
    columns = [STD, ("`--sync` agent steps/s", "r", lambda r: num(r["sps"] / r["speedup_vs_baseline"])),
               ("HTS-RL agent steps/s", "r", lambda r: num(r["sps"])), ("speedup", "r", versus),
               ("Eq. 7 asynchronous bound", "r", lambda r: num(r["eq7_async_sps"])),
               ("HTS-RL runtime / bound", "r", lambda r: num(r["runtime_vs_async"], 2))]  # fmt: skip
    return driver_table(results, ["throughput_hts_straggler.json"], columns, keep=lambda r: r["label"] == "hts_a2c")


def impala_table(results: Path) -> str:
    columns = [RUN, ("actors", "r", lambda r: str(r["workers"])), CEILING, SPS, EFFICIENCY, VERSUS, LAG, PSS]
    return driver_table(results, ["throughput_impala.json"], columns)


def gala_share(r: dict, part: str) -> str:
    """The share of a learner's iteration spent in `part` (gossip or all-reduce)."""
    return f"{scalar(r, f'timing/{part}') / scalar(r, 'timing/iteration'):.1%}"


GALA_SHARES: list[Column] = [("gossip share of an iteration", "r", lambda r: gala_share(r, "gossip")),
                             ("all-reduce share", "r", lambda r: gala_share(r, "allreduce"))]  # fmt: skip


def gala_straggler_table(results: Path) -> str:
    learners: Column = ("learners", "r", lambda r: str(r["workers"]))
    columns = [STD, RUN, learners, SPS, VERSUS, *GALA_SHARES]
    return driver_table(results, ["throughput_gala_straggler.json"], columns)


def gala_breakout_table(results: Path) -> str:
    columns = [RUN, SPLIT, CEILING, SPS, EFFICIENCY, VERSUS, *GALA_SHARES]
    return driver_table(results, ["throughput_gala.json"], columns)


A3C_ROUNDS = "throughput_a3c_rounds.json"  # 2 workers, 3 rounds; throughput_a3c_lag.json: 4 workers, 1 round


def a3c_table(results: Path) -> str:
    per_round = ("efficiency per round", "l", lambda r: " ".join(f"{x['efficiency']:.2f}" for x in r["rounds"]))
    return driver_table(results, [A3C_ROUNDS], [RUN, SPLIT, CEILING, SPS, EFFICIENCY, per_round, LAG, PSS])


def a3c_lag_table(results: Path) -> str:
    return driver_table(results, [A3C_ROUNDS, "throughput_a3c_lag.json"], [RUN, SPLIT, LAG])


def noise_table(results: Path) -> str:
    """How far the same measurement moves between rounds a few minutes apart on this machine."""
    names = {"env": "env piece, min–max (spread)", "infer": "infer piece", "train": "train piece",
             "sps": "the run's agent steps/s"}  # fmt: skip
    columns = [RUN, SPLIT] + [
        (header, "r", lambda r, key=key: spread([x[key] for x in r["rounds"]])) for key, header in names.items()
    ]
    return driver_table(results, [A3C_ROUNDS], columns)


PEER_SOURCES = ["throughput_peers_ppo.json", "throughput_peers_impala.json"]
PEER_NAMES = {"cleanrl_ppo_atari": "CleanRL's `ppo_atari.py`", "torchbeast_monobeast": "TorchBeast's MonoBeast"}


def with_peer(results: Path) -> list[tuple[dict, dict]]:
    """(row, the peer's row of the same JSON) for every row of the peers' JSONs, the peer's own row included."""
    pairs = []
    for name in PEER_SOURCES:
        rows = load(results / name)["rows"]
        peer = next(r for r in rows if r["external"])
        pairs += [(r, peer) for r in rows]
    return pairs


def peers_table(results: Path) -> str:
    """Our scripts and a peer's own code (throughput.py --external) in the same rounds: each row's rate over the
    peer's from the same JSON, of the medians and of each round (the peer's run of the same round)."""
    lines = []
    for r, peer in with_peer(results):
        code = PEER_NAMES.get(r["label"], r["label"]) if r is peer else script_of(r["label"])
        rates = " ".join(num(x["sps"]) for x in r["rounds"])
        versus_peer = "—" if r is peer else f"{r['sps'] / peer['sps']:.2f}x"
        ratios = [ours["sps"] / theirs["sps"] for ours, theirs in zip(r["rounds"], peer["rounds"], strict=True)]
        per_round = "—" if r is peer else " ".join(f"{x:.2f}x" for x in ratios)
        sources_read = ", ".join(sorted({x["rate_source"] for x in r["rounds"]}))
        lines.append(
            f"`{r['label']}` | {code} | {num(r['sps'])} | {rates} | {versus_peer} | {per_round} | {sources_read}"
        )
    header = "run | code | agent steps/s (median) | per round | against the peer | per round | rate read from"
    return table(header, "llrrrrl", lines) + sources(results, PEER_SOURCES)


def first_round(key: str, fmt: Callable[[float], str] = num) -> Callable[[dict], str]:
    """A memory run's cell: `key` of its one round, formatted."""
    return lambda r: fmt(r["rounds"][0][key])


def memory_table(results: Path) -> str:
    """Long runs: PSS after the warm-up against the end of the run, and the least-squares slope over it."""
    columns = [RUN, ("flags", "l", lambda r: flags_of(r["command"].split()[1:], SHARED_FLAGS)),
               ("agent steps", "r", first_round("agent_steps")),
               ("PSS after warm-up MiB", "r", first_round("pss_baseline_mib")),
               ("PSS at the end MiB", "r", first_round("pss_end_mib")),
               ("growth", "r", first_round("pss_growth_pct", lambda x: f"{x:+.2f}%")),
               ("slope", "r", first_round("pss_slope_mib_per_min", lambda x: f"{x:+.2f} MiB/min"))]  # fmt: skip
    return driver_table(results, ["throughput_memory.json"], columns)


GPU_SOURCE = "throughput_gpu_h200.json"  # throughput.py --memory --seconds 20 --num-envs 32 on a GPU machine


def gpu_table(results: Path) -> str:
    """Each script's default mode on one GPU: the steady rate of a 20-s run (memory mode: no CPU ceiling pieces)."""
    flags = ("flags", "l", lambda r: flags_of(r["command"].split()[1:], SHARED_FLAGS))
    return driver_table(results, [GPU_SOURCE], [RUN, SCRIPT, flags, SPS, LAG, PSS])


STOP_SOURCE = "throughput_stop_times.json"  # throughput.py --stop-times
STOP_ATARI_SOURCE = "throughput_stop_times_atari.json"  # throughput.py --stop-times --stop-atari
STOP_ATARI_LOADED_SOURCE = "throughput_stop_times_atari_loaded.json"  # the same, beside two Pong training runs
STOP_KINDS = {"sigint": "Ctrl+C (SIGINT)", "sigterm": "SIGTERM", "killed_worker": "a killed worker"}


def stop_cell(row: dict) -> str:
    """'median / worst (tries)' seconds from the signal to the exit, over the tries that exited; a hung try makes the
    worst '> timeout', a try that never got under way is counted apart; 'n/a' where the kind does not apply."""
    if "not_applicable" in row:
        return "n/a"
    tries = row["tries"]
    seconds = [t["seconds"] for t in tries if t["seconds"] is not None]
    hung, failed = sum(t["hung"] for t in tries), sum(bool(t["error"]) for t in tries)
    worst = f"> {num(row['timeout'])}" if hung else num(max(seconds), 2) if seconds else "—"
    cell = f"{num(statistics.median(seconds), 2) if seconds else '—'} / {worst} ({len(tries)})"
    return cell + (f", {hung} hung" if hung else "") + (f", {failed} not under way" if failed else "")


def exit_cell(row: dict) -> str:
    """The exit status of its tries: one value, or each with its count when they differ ('—' where none exited)."""
    codes = collections.Counter(t["exit_code"] for t in row["tries"] if t["exit_code"] is not None)
    if len(codes) <= 1:
        return next((str(code) for code in codes), "—")
    return ", ".join(f"{code} ({n}x)" for code, n in sorted(codes.items()))


def stop_table(results: Path, source: str = STOP_SOURCE) -> str:
    """throughput.py --stop-times: one row per script, each kind of stop it tried with its exit status, the worker a
    killed-worker try killed, and the processes its tries left behind."""
    by_label: dict[str, dict[str, dict]] = {}
    for r in load(results / source)["rows"]:
        by_label.setdefault(r["label"], {})[r["kind"]] = r
    tried = [k for k in STOP_KINDS if any(k in kinds for kinds in by_label.values())]
    lines, notes = [], []
    for label, kinds in by_label.items():
        script = next(iter(kinds.values()))["script"]
        killed = [kinds["killed_worker"].get("victim", "—")] if "killed_worker" in tried else []
        cells = [f"{stop_cell(kinds[k])} | {exit_cell(kinds[k])}" for k in tried]
        left = sum(len(t["left_behind"]) for r in kinds.values() for t in r["tries"])
        lines.append(f"`{script}` | `{label}` | {' | '.join([*cells, *killed])} | {left}")
        notes += [f"`{script}`, {STOP_KINDS[k]}: n/a, {r['not_applicable']}." for k, r in kinds.items()
                  if "not_applicable" in r]  # fmt: skip
    header = ("script | run | " + " | ".join(f"{STOP_KINDS[k]}: median / worst s (tries) | exit" for k in tried)
              + (" | worker killed" if "killed_worker" in tried else "") + " | processes left behind")  # fmt: skip
    align = "ll" + "rr" * len(tried) + "l" * ("killed_worker" in tried) + "r"
    notes_text = "\n\n" + " ".join(notes) if notes else ""
    return table(header, align, lines) + notes_text + sources(results, [source])


def soak_table(results: Path) -> str:
    names = sorted(p.name for p in results.glob("torchrun_soak_*.json"))
    rows = [
        f"`{next(t for t in d['launch'].split() if t.endswith('.py'))}` | {d['launches']} | {d['clean']} | "
        f"{d['aborted']} | {num(statistics.median(d['seconds']))}"
        for d in (load(results / n) for n in names)
    ]
    header = "script | launches | both launchers exit 0 | aborted | seconds per launch (median)"
    return table(header, "lrrrr", rows) + sources(results, names)


# ----------------------------------------------------------------------------------------------------------------
# The README's summary: one row per script
# ----------------------------------------------------------------------------------------------------------------

# (the row's script, its run in learn.py's classic-control suites and throughput.py's label, the prefix of its Pong
# runs' labels)
ONE_CONFIG = "every-script-at-one-configuration"  # the RESULTS.md section of all_scripts_table
SUMMARY_ROWS = [
    ("`cleanba_ppo_impala.py`", "cleanba_ppo", "cleanba_ppo"),
    ("`cleanba_ppo_impala.py --algo impala`", "cleanba_impala", "cleanba_impala"),
    ("`hts_a2c.py`", "hts_a2c", "hts_a2c"),
    ("`hts_ppo.py`", "hts_ppo", "hts_ppo"),
    ("`impala_monobeast.py`", "impala_batched", "impala"),
    ("`gala_a2c.py`", "gala_gossip", "gala"),
    ("`a3c_large_batch.py`", "a3c_hogwild", "a3c"),
    ("`apex_dqn.py`", "apex_dqn", "apex_dqn"),
    ("`apex_ddpg.py`", "apex_ddpg", "apex_ddpg"),
]


def cell(ours: float, efficiency: float | None, base: float | None, design: str) -> str:
    """'agent steps/s (efficiency) | N.NNx the design it replaces' ('—' where the script has no baseline mode)."""
    eff = "" if efficiency is None else f" ({efficiency:.2f})"
    return f"{num(ours)}{eff} | " + (f"{ours / base:.2f}x {design}" if base else "—")


A3C_ONE_ENV_SOURCE = "throughput_a3c_one_env.json"  # a3c_hogwild with one env per worker: the original A3C
BASELINE_DESIGN = {"cleanba_ppo": "`--sync`", "cleanba_impala": "`--sync`", "hts_a2c": "`--sync`",
                   "hts_ppo": "`--sync`", "impala_batched": "MonoBeast", "gala_gossip": "all-reduce A2C"}  # fmt: skip


def breakout_throughput(results: Path) -> dict[str, str]:
    """Classic-control run -> its `cell` on Breakout: throughput.py's table, each label against its baseline mode."""
    rows = {r["label"]: r for r in load(results / TABLE_SOURCE)["rows"]}
    out = {}
    for label, design in BASELINE_DESIGN.items():
        r = rows[label]
        out[label] = cell(r["sps"], r["efficiency"], r["sps"] / r["speedup_vs_baseline"], design)
    r, one_env = rows["a3c_hogwild"], load(results / A3C_ONE_ENV_SOURCE)["rows"][0]
    out["a3c_hogwild"] = cell(r["sps"], r["efficiency"], one_env["sps"], "one env per worker")
    out["apex_dqn"] = cell(rows["apex_dqn"]["sps"], rows["apex_dqn"]["efficiency"], None, "")
    return out


def against_peers(results: Path) -> dict[str, str]:
    """Label -> 'N.NNx <peer>': its rate over the peer's own code's in the same peers JSON (its rounds alternated)."""
    return {
        r["label"]: f"{r['sps'] / peer['sps']:.2f}x {PEER_NAMES.get(peer['label'], peer['label'])}"
        for r, peer in with_peer(results)
        if r is not peer
    }


def summary_table(results: Path) -> str:
    rel = "benchmarks/RESULTS.md#"
    peers = against_peers(results)
    classic = {r["exp"]: r for r, _ in learning_runs(results, CLASSIC_SOURCES)}
    # a run of the Pong gate (plot.py --window 20 --threshold 18) also says where it first reached +18
    pong = [r | {"gate": load(results / name).get("window") == 20 and r.get("threshold") == 18.0}
            for name, r in pong_cpu_runs(results)]  # fmt: skip
    speed = breakout_throughput(results)
    rows = []
    for script, label, prefix in SUMMARY_ROWS:
        learned, atari = "—", "—"
        if run := classic.get(label):
            env = "" if run["env"] == "CartPole-v1" else f" ({run['env']})"
            learned = (f"[{run['final_return_mean']:.1f}, {run['seeds_reaching_threshold']}/{len(run['seeds'])} "
                       f"seeds{env}]({rel}cartpole-and-pendulum)")  # fmt: skip
        if ours := [r for r in pong if r["exp"].startswith(prefix)]:
            best = max(ours, key=lambda r: r["final_return_mean"])
            text = f"{best['final_return_mean']:+.1f} after {statistics.median(best['agent_steps']) / 1e6:.2f}M steps"
            if best["gate"] and best["seeds_reaching_threshold"]:
                text = f"+18 at {nan_median(best['steps_to_threshold_per_seed']) / 1e6:.2f}M steps; {text}"
            atari = f"[{text}]({rel}pong-on-2-cpu-cores)"
        rate, versus = speed.get(label, "— | —").split(" | ")
        rate = f"[{rate}]({rel}{ONE_CONFIG})" if label in speed else rate
        peer = f"[{peers[label]}]({rel}against-the-peers-own-code)" if label in peers else "—"
        rows.append(f"{script} | {learned} | {atari} | {rate} | {versus} | {peer}")
    header = ("script | CartPole-v1: final return, seeds reaching 475 | Pong on 2 CPU cores: first +18 over 20 "
              "games (gate runs), final return (best run) | "
              "Breakout agent steps/s (efficiency) | against the design it replaces | "
              "against the peer's own code")  # fmt: skip
    return table(header, "lrrrll", rows)


def clock(seconds: float | None) -> str:
    """A wall time as 1h05m or 42m ('—' when the JSON has none)."""
    if seconds is None or math.isnan(seconds):
        return "—"
    minutes = round(seconds / 60)
    return f"{minutes // 60}h{minutes % 60:02d}m" if minutes >= 60 else f"{minutes}m"


def gate_crossing(r: dict) -> tuple[float, float] | None:
    """(agent steps, seconds of running time) where a gate run's last-20-games mean first reached +18, if it did."""
    steps, seconds = r.get("steps_to_threshold_per_seed") or [], r.get("seconds_to_threshold_per_seed") or []
    if r.get("threshold") != 18.0 or not steps or math.isnan(nan_median(steps)):
        return None
    return nan_median(steps), nan_median(seconds) if seconds else math.nan


def atari_table(results: Path) -> str:
    """The README's first table: per script, the Pong run that shows it learning best (the earliest crossing of +18
    over 20 games in a gate run, else the highest final return), at what cost in agent steps, frames and running
    time, and where its curves and command are."""
    found = [(name, r) for name, r in pong_cpu_runs(results) if load(results / name).get("window") == 20]
    rows = []
    for script, _, prefix in SUMMARY_ROWS:
        ours = [(name, r) for name, r in found if r["exp"].startswith(prefix)]
        if not ours:
            why = "continuous actions: no Atari run" if prefix == "apex_ddpg" else "not run on Atari yet"
            rows.append(f"{script} | — | no: {why} | — | — | — | —")
            continue
        crossed = [(crossing, name, r) for name, r in ours if (crossing := gate_crossing(r))]
        if crossed:
            (steps, seconds), name, r = min(crossed, key=lambda c: c[0][0])
            final = statistics.median(r["agent_steps"])
            result = (f"yes: +18 at {steps / 1e6:.2f}M agent steps ({4 * steps / 1e6:.1f}M frames); "
                      f"{r['final_return_mean']:+.1f} at {final / 1e6:.2f}M")  # fmt: skip
        else:
            name, r = max(ours, key=lambda item: item[1]["final_return_mean"])
            steps, seconds = statistics.median(r["agent_steps"]), nan_median(r.get("running_seconds") or [math.nan])
            learned = "yes" if r["final_return_mean"] >= 18 else "not yet"
            result = (f"{learned}: {r['final_return_mean']:+.1f} at {steps / 1e6:.2f}M agent steps "
                      f"({4 * steps / 1e6:.1f}M frames), its end")  # fmt: skip
        manifest = name.replace(".json", "_manifest.json")
        machine, command = "—", "—"
        if (results / manifest).exists():
            machine, command = load(results / manifest).get("machine", "—"), f"[command](benchmarks/results/{manifest})"
        curves = figure(results, name, r["env"]).replace("](results/", "](benchmarks/results/")
        rows.append(f"{script} | `{r['exp']}`: {run_flags(results, name, r['exp'])} | {result} | "
                    f"{len(r['seeds'])} | {clock(seconds)} | {machine} | {curves}, {command}")  # fmt: skip
    header = ("script | Pong run: its flags beside `--atari-protocol deepmind` | learns Pong (+18 over the last 20 "
              "games)? | seeds | running time (to +18, or in all) | machine | curves, command")  # fmt: skip
    return table(header, "lllrrll", rows)


def learn_in_minutes_table(results: Path) -> str:
    """The README's first runs: for each classic-control run of learn.py (a later JSON's run replacing an earlier
    one's), its seed-1 command as measured (from the manifest, without the naming flags) and the wall time it took
    here, to the bar and for the whole budget."""
    rows = []
    for run, source in learning_runs(results, CLASSIC_SOURCES):
        manifest = load(results / source.replace(".json", "_manifest.json"))
        runs = [r for r in manifest["runs"] if r["label"] == run["exp"]]
        seed1 = next(r for r in runs if r["seed"] == min(x["seed"] for x in runs))["command"]
        command = f"`python {seed1[0]} --env-id {run['env']} --total-timesteps {run['agent_steps'][0]} " + \
            flags_of(seed1, NAMING_FLAGS).strip("`") + "`"  # fmt: skip
        to_bar = [s for s in run["seconds_to_threshold_per_seed"] if s is not None]
        rows.append(f"`{run['exp']}` | {command} | {num(run['threshold'])} | "
                    f"{num(statistics.median(to_bar)) if to_bar else '—'} s | "
                    f"{num(statistics.median(r['wall_seconds'] for r in runs))} s")  # fmt: skip
    header = "run | command | bar | time to the bar (median of seeds) | time for the whole run (median)"
    links = sources(results, CLASSIC_SOURCES).replace("](results/", "](benchmarks/results/")  # from the README
    return table(header, "llrrr", rows) + links


# ----------------------------------------------------------------------------------------------------------------
# Filling the documents
# ----------------------------------------------------------------------------------------------------------------

DOCUMENTS: dict[str, dict[str, Callable[[Path], str]]] = {
    "README.md": {"atari": atari_table, "summary": summary_table, "learn-in-minutes": learn_in_minutes_table},
    "benchmarks/RESULTS.md": {
        "noise": noise_table,
        "classic-control": classic_control_table,
        "pong-cpu": pong_cpu_table,
        "pong-h100": pong_h100_table,
        "pong-references": pong_references_table,
        "a3c-eps": a3c_eps_table,
        "all-scripts": all_scripts_table,
        "straggler": straggler_table,
        "env": env_table,
        "cleanba": cleanba_table,
        "cleanba-threads": cleanba_threads_table,
        "cleanba-impala-threads": lambda r: cleanba_threads_table(r, CLEANBA_IMPALA_THREADS_SOURCE, "impala"),
        "hts": hts_table,
        "hts-straggler": hts_straggler_table,
        "impala": impala_table,
        "gala-straggler": gala_straggler_table,
        "gala-breakout": gala_breakout_table,
        "a3c": a3c_table,
        "a3c-lag": a3c_lag_table,
        "peers": peers_table,
        "memory": memory_table,
        "gpu": gpu_table,
        "stop-times": stop_table,
        "stop-times-atari": lambda results: stop_table(results, STOP_ATARI_SOURCE),
        "stop-times-atari-loaded": lambda results: stop_table(results, STOP_ATARI_LOADED_SOURCE),
        "soak": soak_table,
    },
}


def fill(text: str, tables: dict[str, str]) -> str:
    """`text` with the body between each pair of markers replaced by its table; every table must have its markers."""
    found = [m["name"] for m in MARKER.finditer(text)]
    unknown, absent = sorted(set(found) - set(tables)), sorted(set(tables) - set(found))
    if unknown or absent or len(found) != len(set(found)):
        raise ValueError(f"markers without a table: {unknown}; tables without markers: {absent}; markers: {found}")
    return MARKER.sub(lambda m: m.group(1) + tables[m["name"]] + "\n" + m.group(4), text)


def render(root: Path) -> dict[Path, tuple[str, str, list[str]]]:
    """Each document: (its text now, its text with fresh tables, the names of the tables that differ)."""
    results, out = root / "benchmarks" / "results", {}
    for doc, makers in DOCUMENTS.items():
        old = (root / doc).read_text()
        tables = {name: make(results) for name, make in makers.items()}
        before = {m["name"]: m["body"] for m in MARKER.finditer(old)}
        try:
            new = fill(old, tables)
        except ValueError as e:
            raise ValueError(f"{doc}: {e}") from None
        out[root / doc] = (old, new, [n for n, t in tables.items() if before.get(n) != t + "\n"])
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 if a committed table is out of date")
    p.add_argument("--root", type=Path, default=ROOT, help="repository root (default: this checkout)")
    a = p.parse_args(argv)
    try:
        documents = render(a.root)
    except (ValueError, OSError, KeyError) as e:  # a marker pair missing, a JSON missing or without a field
        print(f"error: {type(e).__name__}: {e}")
        return 2
    stale = False
    for path, (old, new, changed) in documents.items():
        if new != old and a.check:
            stale = True
            print(f"{path.relative_to(a.root)}: out of date: {', '.join(changed)} (run python benchmarks/report.py)")
        elif new != old:
            path.write_text(new)
            print(f"wrote {path.relative_to(a.root)}: {', '.join(changed)}")
    return 1 if stale else 0


if __name__ == "__main__":
    sys.exit(main())
