"""GALA-A2C vs its all-reduce A2C baseline: aggregate agent steps/s on the straggler env (2 and 4 learners, low and
high step-time variance), the gossip share of a learner's iteration, consensus distance over training; optionally
Breakout with 2 learners against the CONVENTIONS.md ceiling.

    python benchmarks/gala_throughput.py              # straggler sweep -> benchmarks/results/gala_throughput.json
    python benchmarks/gala_throughput.py --breakout           # + Breakout efficiency (2 learners x 16 envs)

Every number comes from the script's own TensorBoard events: the last `charts/SPS` (all learners' agent steps over
wall time since the learners started; the Breakout efficiency uses the steady rate after the first quarter of the
logged span instead, so start-up does not count), means of `timing/gossip` / `timing/iteration`, and
`gossip/consensus_distance`.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the Breakout ceiling imports the script's own loss functions


def scalars(run_dir: Path) -> dict[str, list[tuple[int, float]]]:
    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def steady_sps(run_dir: Path, skip: float = 0.25) -> float:
    """Agent steps/s between the `charts/SPS` event at `skip` of the logged wall span and the last one: start-up
    (process spawn, env creation, the first updates) left out."""
    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    acc.Reload()
    events = acc.Scalars("charts/SPS")
    walls = np.array([e.wall_time for e in events])
    k = min(int(np.searchsorted(walls, walls[0] + skip * (walls[-1] - walls[0]))), len(events) - 2)
    return (events[-1].step - events[k].step) / (walls[-1] - walls[k])


def run_gala(flags: list[str], env: dict | None = None, timeout: int = 300) -> dict:
    with tempfile.TemporaryDirectory() as log_dir:
        cmd = [sys.executable, "gala_a2c.py", "--log-dir", log_dir, "--log-interval", "1000", *flags]
        start = time.time()
        proc = subprocess.run(
            cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env={**os.environ, **(env or {})}
        )
        if proc.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")
        (run_dir,) = [p for p in Path(log_dir).iterdir() if p.is_dir()]
        logged = scalars(run_dir)
        steady = steady_sps(run_dir) if len(logged["charts/SPS"]) >= 3 else float("nan")
    gossip = np.array([v for _, v in logged.get("timing/gossip", [])])
    iteration = np.array([v for _, v in logged["timing/iteration"]])
    return dict(
        sps=logged["charts/SPS"][-1][1],
        steady_sps=steady,
        wall_s=time.time() - start,
        gossip_share=float(gossip.mean() / iteration.mean()) if len(gossip) else 0.0,
        gossip_wait_share=float(np.mean([v for _, v in logged["timing/gossip_wait"]]) / iteration.mean()),
        allreduce_share=float(np.mean([v for _, v in logged["timing/allreduce"]]) / iteration.mean()),
        consensus_distance=[(s, round(v, 5)) for s, v in logged.get("gossip/consensus_distance", [])],
        staleness=float(np.mean([v for _, v in logged.get("gossip/staleness", [(0, 0.0)])])),
    )


def straggler_sweep(args) -> list[dict]:
    rows = []
    for std in args.stds:
        for n in args.learners:
            for mode in ("gossip", "allreduce"):
                flags = [
                    "--env-id", "benchmarks.straggler:Straggler-v0", "--mode", mode, "--num-learners", str(n),
                    "--num-envs", str(args.num_envs), "--torch-threads", "1", "--sync-interval", "20",
                    "--total-timesteps", str(n * args.num_envs * 5 * args.iterations),
                ]  # fmt: skip
                env = {"STRAGGLER_MEAN_MS": str(args.mean_ms), "STRAGGLER_STD_MS": str(std)}
                result = run_gala(flags, env)
                rows.append(dict(env="straggler", mean_ms=args.mean_ms, std_ms=std, learners=n, mode=mode, **result))
                print(
                    f"straggler std {std:>4} ms  {n} learners  {mode:<9}  SPS {result['sps']:>8,.0f}  "
                    f"gossip {100 * result['gossip_share']:.2f}% of iteration  "
                    f"wait {100 * result['gossip_wait_share']:.1f}%"
                    f"  allreduce {100 * result['allreduce_share']:.1f}%",
                    flush=True,
                )
    return rows


def breakout_ceiling(num_envs: int, num_steps: int, threads: int) -> dict:
    """CONVENTIONS.md ceiling pieces for one learner: env steps/s (random actions), inference and training samples/s."""
    import torch

    from common.atari import make_vector_env
    from common.models import make_model
    from gala_a2c import a2c_loss, n_step_returns

    torch.set_num_threads(threads)
    envs = make_vector_env("ALE/Breakout-v5", num_envs, 0, num_threads=threads)
    envs.reset()
    for _ in range(20):
        envs.step(envs.action_space.sample())
    start, k = time.perf_counter(), 200
    for _ in range(k):
        envs.step(envs.action_space.sample())
    env_sps = k * num_envs / (time.perf_counter() - start)
    model = make_model(envs.single_observation_space, envs.single_action_space, "nature")
    obs = torch.randint(0, 255, (num_steps + 1, num_envs, 4, 84, 84), dtype=torch.uint8)
    with torch.inference_mode():
        for _ in range(5):
            model(obs[0])
        start = time.perf_counter()
        for _ in range(100):
            model(obs[0])
        infer_sps = 100 * num_envs / (time.perf_counter() - start)
    optimizer = torch.optim.RMSprop(model.parameters(), lr=7e-4, eps=0.01)
    actions = torch.randint(0, 4, (num_steps * num_envs,))

    def train_step():
        logits, values = model(obs.reshape(-1, 4, 84, 84))
        values = values.reshape(num_steps + 1, num_envs)
        returns = n_step_returns(
            torch.zeros(num_steps, num_envs), torch.zeros(num_steps, num_envs), values[-1].detach(), 0.99
        )
        loss = a2c_loss(
            logits[: num_steps * num_envs], values[:-1].reshape(-1), actions, returns.reshape(-1), 0.01, 0.5
        )
        optimizer.zero_grad()
        loss["total_loss"].backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
        optimizer.step()

    for _ in range(3):
        train_step()
    start = time.perf_counter()
    for _ in range(20):
        train_step()
    train_sps = 20 * num_steps * num_envs / (time.perf_counter() - start)
    envs.close()
    ceiling = 1 / (1 / env_sps + 1 / infer_sps + 1 / train_sps)
    return dict(env_sps=env_sps, infer_sps=infer_sps, train_sps=train_sps, ceiling_per_learner=ceiling)


def breakout(args) -> list[dict]:
    n = 2
    threads = max(1, (os.cpu_count() or 1) // n)
    pieces = breakout_ceiling(16, 5, threads)
    rows = []
    for mode in ("gossip", "allreduce"):
        flags = ["--env-id", "ALE/Breakout-v5", "--mode", mode, "--num-learners", str(n), "--total-timesteps",
                 str(n * 16 * 5 * args.breakout_iterations)]  # fmt: skip
        result = run_gala(flags, timeout=600)
        ceiling = pieces["ceiling_per_learner"] * n  # each learner on its own share of the cores
        rows.append(dict(env="ALE/Breakout-v5", learners=n, mode=mode, **result, **pieces, ceiling=ceiling,
                         efficiency=result["steady_sps"] / ceiling))  # fmt: skip
        print(
            f"Breakout 2 learners {mode:<9} steady SPS {result['steady_sps']:,.0f} (from start {result['sps']:,.0f})  "
            f"ceiling {ceiling:,.0f} "
            f"(env {pieces['env_sps']:,.0f} infer {pieces['infer_sps']:,.0f} train {pieces['train_sps']:,.0f} "
            f"per learner x{n})  "
            f"efficiency {result['steady_sps'] / ceiling:.2f}  gossip {100 * result['gossip_share']:.2f}% of iteration",
            flush=True,
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--learners", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--stds", type=float, nargs="+", default=[0.0, 4.0], help="straggler step-time std (ms)")
    parser.add_argument("--mean-ms", type=float, default=2.0)
    parser.add_argument("--num-envs", type=int, default=4)
    parser.add_argument("--iterations", type=int, default=60, help="iterations per learner per run")
    parser.add_argument("--breakout", action="store_true")
    parser.add_argument("--no-straggler", action="store_true", help="skip the straggler sweep (with --breakout)")
    parser.add_argument("--breakout-iterations", type=int, default=400)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "gala_throughput.json"))
    args = parser.parse_args()
    rows = [] if args.no_straggler else straggler_sweep(args)
    if args.breakout:
        rows += breakout(args)
    summary = []
    for std in [] if args.no_straggler else args.stds:
        for n in args.learners:
            g, a = (next(r for r in rows if r["env"] == "straggler" and r["std_ms"] == std and r["learners"] == n
                         and r["mode"] == m) for m in ("gossip", "allreduce"))  # fmt: skip
            summary.append(dict(std_ms=std, learners=n, gossip_sps=g["sps"], allreduce_sps=a["sps"],
                                speedup=g["sps"] / a["sps"]))  # fmt: skip
    print("\nstd_ms  learners  gossip SPS  allreduce SPS  gossip/allreduce")
    for s in summary:
        print(
            f"{s['std_ms']:>6}  {s['learners']:>8}  {s['gossip_sps']:>10,.0f}  {s['allreduce_sps']:>13,.0f}  "
            f"{s['speedup']:>16.2f}"
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(
        json.dumps(dict(args=vars(args), cpu_count=os.cpu_count(), runs=rows, summary=summary), indent=1)
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
