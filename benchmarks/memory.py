"""Memory over a long run of any script/mode: the "RSS growth under 5% over a 10-minute run" target of every issue.

Each label of `benchmarks/throughput.py`'s CONFIGS runs on `ALE/Breakout-v5` (deepmind protocol, Nature CNN, 16 envs
in total) for `--seconds`, then gets SIGINT. Every `--interval` seconds the tool sums PSS (proportional set size:
shared memory counted once across the processes that map it, so shared rollout buffers are not counted per process)
and RSS over the script's whole process tree, read from /proc/PID/smaps_rollup. Growth is measured from the mean
over the `--baseline` seconds after `--warmup` (start-up, first allocations, allocator pools filling) to the mean over
the last `--baseline` seconds, in percent of the baseline; the slope of a least-squares line through the samples
after warm-up (MiB per minute) is reported beside it, since two endpoints can hide a steady creep or show noise as one.
Runs go one at a time unless `--parallel` (then speeds are meaningless, but allocator behaviour is not).

    python benchmarks/memory.py --only a3c_hogwild --seconds 600 --out benchmarks/results/memory_a3c_600s.json
    python benchmarks/memory.py --only cleanba_ppo gala_gossip impala_batched a3c_hogwild --seconds 600
"""

from __future__ import annotations

import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import tyro

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from throughput import CONFIGS, steady_rate  # noqa: E402


@dataclass
class Args:
    only: list[str] = field(default_factory=lambda: ["cleanba_ppo", "impala_batched", "gala_gossip", "a3c_hogwild"])
    """labels of benchmarks/throughput.py's CONFIGS to run"""
    seconds: float = 600.0
    """wall time of each run"""
    warmup: float = 60.0
    """seconds after start before the baseline is taken"""
    baseline: float = 20.0
    """seconds averaged at the start (after warm-up) and at the end"""
    interval: float = 2.0
    """seconds between samples"""
    num_envs: int = 16
    """environments in total"""
    parallel: bool = False
    """run the labels at the same time (memory only: their speeds then share the cores)"""
    out: str = "benchmarks/results/memory.json"
    """where the JSON goes"""


def tree(pid: int) -> list[int]:
    """pid and all its descendants (from /proc/*/stat parent ids)."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def memory_kb(pid: int) -> tuple[int, int]:
    """(PSS, RSS) of one process in KiB; (0, 0) if it is gone."""
    pss = rss = 0
    try:
        for line in (Path("/proc") / str(pid) / "smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                pss = int(line.split()[1])
            elif line.startswith("Rss:"):
                rss = int(line.split()[1])
    except (OSError, ValueError):
        pass
    return pss, rss


def sample(pid: int) -> tuple[float, float]:
    """(PSS, RSS) of the whole tree in MiB."""
    totals = np.array([memory_kb(p) for p in tree(pid)]).sum(axis=0)
    return float(totals[0]) / 1024, float(totals[1]) / 1024


def measure(label: str, args: Args, log_dir: str) -> dict:
    script, flags = CONFIGS[label]
    n = args.num_envs
    flags = [f.format(n=n, half=n // 2, quarter=n // 4) for f in flags]
    cmd = [sys.executable, script, "--env-id", "ALE/Breakout-v5", "--atari-protocol", "deepmind", "--network", "nature"]
    cmd += ["--total-timesteps", "1000000000", "--log-dir", log_dir, "--exp-name", label, *flags]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    samples, t0 = [], time.time()
    while proc.poll() is None and time.time() - t0 < args.seconds:
        samples.append((time.time() - t0, *sample(proc.pid)))
        time.sleep(args.interval)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    if proc.returncode not in (0, 130, -signal.SIGINT):
        raise RuntimeError(f"{label} exited {proc.returncode}:\n{err[-2000:]}")
    t, pss, rss = (np.array(c) for c in zip(*samples, strict=True))
    start = (t >= args.warmup) & (t < args.warmup + args.baseline)
    end = t >= t[-1] - args.baseline
    after = t >= args.warmup
    slope = np.polyfit(t[after] / 60.0, pss[after], 1)[0] if after.sum() >= 3 else float("nan")
    (run_dir,) = [p for p in Path(log_dir).iterdir() if p.is_dir()]
    sps, steps = steady_rate(run_dir, 0.25)
    return dict(
        label=label,
        command=" ".join(cmd[1:]),
        seconds=round(float(t[-1]), 1),
        agent_steps=steps,
        agent_steps_per_s=round(sps, 1),
        pss_baseline_mb=round(float(pss[start].mean()), 1),
        pss_end_mb=round(float(pss[end].mean()), 1),
        pss_peak_mb=round(float(pss.max()), 1),
        pss_growth_pct=round(float(100 * (pss[end].mean() - pss[start].mean()) / pss[start].mean()), 2),
        pss_slope_mb_per_min=round(float(slope), 2),
        rss_baseline_mb=round(float(rss[start].mean()), 1),
        rss_end_mb=round(float(rss[end].mean()), 1),
        rss_growth_pct=round(float(100 * (rss[end].mean() - rss[start].mean()) / rss[start].mean()), 2),
        samples=[(round(float(a), 1), round(float(b), 1)) for a, b in zip(t, pss, strict=True)],
    )


def main(args: Args) -> None:
    unknown = sorted(set(args.only) - set(CONFIGS))
    if unknown:
        sys.exit(f"error: unknown label(s) {unknown}; known: {sorted(CONFIGS)}")
    if args.seconds < args.warmup + 2 * args.baseline:
        sys.exit("error: --seconds must be at least --warmup + 2 x --baseline")
    rows: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:

        def one(label: str) -> None:
            log_dir = Path(tmp) / label
            log_dir.mkdir()
            rows[label] = measure(label, args, str(log_dir))
            r = rows[label]
            print(f"  {label:16s} PSS {r['pss_baseline_mb']:7.1f} -> {r['pss_end_mb']:7.1f} MiB "
                  f"({r['pss_growth_pct']:+.2f}%, {r['pss_slope_mb_per_min']:+.2f} MiB/min)  "
                  f"RSS {r['rss_growth_pct']:+.2f}%  {r['agent_steps']:,} agent steps", flush=True)  # fmt: skip

        if args.parallel:
            threads = [threading.Thread(target=one, args=(label,)) for label in args.only]
            for th in threads:
                th.start()
            for th in threads:
                th.join()
        else:
            for label in args.only:
                one(label)
    result = dict(
        machine=f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPU cores",
        load_average_at_end=os.getloadavg(),
        time=time.strftime("%Y-%m-%d %H:%M:%S"),
        args=asdict(args),
        rows=[rows[label] for label in args.only if label in rows],
    )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print("\n| script / mode | seconds | agent steps | PSS after warm-up (MiB) | PSS at end | growth | slope |")
    print("|---|---|---|---|---|---|---|")
    for r in result["rows"]:
        cells = [r["label"], f"{r['seconds']:.0f}", f"{r['agent_steps']:,}", f"{r['pss_baseline_mb']:.0f}"]
        cells += [f"{r['pss_end_mb']:.0f}", f"{r['pss_growth_pct']:+.2f}%", f"{r['pss_slope_mb_per_min']:+.2f} MiB/min"]
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main(tyro.cli(Args))
