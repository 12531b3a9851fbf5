"""What the script tests share: running a script in a subprocess, finding its run directory, reading what it wrote
to TensorBoard, the tags every script must write, and finding a process's children.

The test files import it as `from helpers import ...` (tests/ has no __init__.py, so pytest puts tests/ on sys.path)."""

import math
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

ROOT = Path(__file__).resolve().parents[1]

# the tags every script must write (the conventions every script follows); each test file adds its script's own
CORE_TAGS = [
    "charts/episodic_return",
    "charts/episodic_length",
    "charts/SPS",
    "charts/learning_rate",
    "charts/policy_lag",
    "losses/policy_loss",
    "losses/value_loss",
    "losses/entropy",
    "losses/total_loss",
    "losses/grad_norm",
]


def run_script(script, args, log_dir, timeout=180, env=None, launcher=()):
    """Run `script` from the repository root with `--log-dir log_dir` and `args`, output captured as text.
    `launcher`: interpreter arguments before the script, such as ("-m", "torch.distributed.run", ...).
    On a timeout the whole process group is killed, not only the direct child: a torchrun launcher's ranks or a
    script's workers left behind would slow every later test."""
    cmd = [sys.executable, *launcher, script, "--log-dir", str(log_dir), *args]
    with subprocess.Popen(
        cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True
    ) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def only_run_dir(log_dir):
    """The run directory a script made under `log_dir`: there must be exactly one."""
    dirs = [p for p in Path(log_dir).iterdir() if p.is_dir()]
    assert len(dirs) == 1, dirs
    return dirs[0]


def event_accumulator(run_dir):
    """The run's TensorBoard events, loaded, every scalar kept."""
    acc = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return acc


def scalars(run_dir):
    """{tag: [(step, value), ...]} of every scalar the run logged."""
    acc = event_accumulator(run_dir)
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def assert_finite_tags(logged, tags):
    """Every tag in `tags` was logged (`logged` from scalars()), and all its values are finite."""
    for tag in tags:
        assert tag in logged, (tag, sorted(logged))
        assert all(math.isfinite(v) for _, v in logged[tag]), tag


def children_of(pid):
    """The pids whose parent is `pid` (from /proc/*/stat, whichever thread started them)."""
    out = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if int((d / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    out.append(int(d.name))
            except (OSError, ValueError, IndexError):
                pass
    return out


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_node_launch(script, args, log_dir, timeout=300):
    """The README's two-node launch on one machine: two torchrun launchers (node ranks 0 and 1, one rank each) meeting
    at 127.0.0.1 through c10d rendezvous. Returns both launchers' CompletedProcess; on a timeout both process groups
    are killed."""
    port = free_port()
    procs = []
    for node in (0, 1):
        launcher = ("-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node), "--nproc-per-node", "1")
        launcher += ("--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}")
        cmd = [sys.executable, *launcher, script, "--log-dir", str(log_dir), *args]
        procs.append(
            (cmd, subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                   start_new_session=True))
        )  # fmt: skip
    results = []
    try:
        for cmd, proc in procs:
            stdout, stderr = proc.communicate(timeout=timeout)
            results.append(subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr))
    finally:
        for _, proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate()
    return results


def rank_pid(launcher_pid, rank, timeout=120):
    """The pid of torchrun rank `rank` among the descendants of `launcher_pid` (read from their RANK variable)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        for pid in children_of(launcher_pid):
            try:
                env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            if f"RANK={rank}".encode() in env:
                return pid
        time.sleep(0.2)
    raise TimeoutError(f"no rank {rank} under launcher {launcher_pid}")
