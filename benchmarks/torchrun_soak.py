"""How often the README's two-node launch ends cleanly: two `torchrun` launchers on this machine (127.0.0.1, a free
port, c10d rendezvous, one rank each) run a script to the end, again and again. A launch is clean when both launchers
exit 0 and neither rank printed a C++ abort ("terminate called ...").

    python benchmarks/torchrun_soak.py --launches 20 --script cleanba_ppo_impala.py
    python benchmarks/torchrun_soak.py --launches 10 --script gala_a2c.py -- --num-envs 4 --total-timesteps 4000

Writes benchmarks/results/torchrun_soak_{script stem}.json: the counts, the command of one launch, and the last lines
of stderr of every launch that was not clean.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import tyro

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_ARGS = ["--env-id", "CartPole-v1", "--num-envs", "4", "--total-timesteps", "20000"]


@dataclass
class Args:
    launches: int = 20
    """two-node launches to run"""
    script: str = "cleanba_ppo_impala.py"
    """the script both ranks run; its flags go after `--` (default: a 20k-step CartPole run)"""
    timeout: float = 300.0
    """seconds one launch may take"""
    out: str | None = None
    """JSON path (default benchmarks/results/torchrun_soak_{script stem}.json)"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launcher_cmd(node_rank: int, port: int, script: str, script_args: list[str], log_dir: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node_rank),
            "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", script,
            "--log-dir", log_dir, *script_args]  # fmt: skip


def launch_once(script: str, script_args: list[str], timeout: float) -> dict:
    """Two launchers, node ranks 0 and 1, started together; returns their exit codes, seconds and stderr tails."""
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="soak-") as log_dir:
        procs = [subprocess.Popen(launcher_cmd(i, port, script, script_args, log_dir), cwd=ROOT,
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
                 for i in range(2)]  # fmt: skip
        start, errs, codes = time.time(), ["", ""], [None, None]
        for i, p in enumerate(procs):
            try:
                _, errs[i] = p.communicate(timeout=max(1.0, timeout - (time.time() - start)))
                codes[i] = p.returncode
            except subprocess.TimeoutExpired:
                for q in procs:  # the launchers and their ranks: nothing of a stuck launch may outlive it
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(q.pid, signal.SIGKILL)
                _, errs[i] = p.communicate()
                codes[i] = "timeout"
    aborted = any("terminate called" in e for e in errs)
    return dict(
        codes=codes,
        seconds=round(time.time() - start, 1),
        clean=codes == [0, 0] and not aborted,
        aborted=aborted,
        stderr_tails=["\n".join(e.strip().splitlines()[-15:]) for e in errs],
    )


def main(opts: Args, script_args: list[str]) -> None:
    script_args = script_args or DEFAULT_ARGS
    out = Path(opts.out or ROOT / "benchmarks" / "results" / f"torchrun_soak_{Path(opts.script).stem}.json")

    launches = []
    for k in range(opts.launches):
        result = launch_once(opts.script, script_args, opts.timeout)
        launches.append(result)
        status = "clean" if result["clean"] else f"FAILED {result['codes']}{' (abort)' if result['aborted'] else ''}"
        print(f"launch {k + 1}/{opts.launches}: {status} in {result['seconds']} s", flush=True)
        write_summary(out, opts, script_args, launches)  # after every launch: an interrupted soak keeps its counts
    clean = sum(r["clean"] for r in launches)
    aborted = sum(r["aborted"] for r in launches)
    print(f"{clean}/{len(launches)} launches clean ({aborted} aborted); wrote {out}")


def write_summary(out: Path, opts: Args, script_args: list[str], launches: list[dict]) -> None:
    summary = dict(
        command=" ".join(["python", "benchmarks/torchrun_soak.py", *sys.argv[1:]]),
        launch=" ".join(launcher_cmd(0, 0, opts.script, script_args, "LOG_DIR")[1:]).replace(
            "127.0.0.1:0", "127.0.0.1:PORT"
        ),
        launches_planned=opts.launches,
        launches=len(launches),
        clean=sum(r["clean"] for r in launches),
        aborted=sum(r["aborted"] for r in launches),
        failures=[dict(launch=k + 1, **r) for k, r in enumerate(launches) if not r["clean"]],
        seconds=[r["seconds"] for r in launches],
    )
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(summary, indent=1) + "\n")
    os.replace(tmp, out)


if __name__ == "__main__":
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    main(tyro.cli(Args, args=argv[:split], description=__doc__), argv[split + 1 :])
