"""What the script tests share: running a script in a subprocess (to its end, or in the background until training is
under way), finding its run directory, reading what it wrote to TensorBoard, the tags every script must write, finding
a process's children, a fixed-logits policy with an env that records the actions it is given (for checking how a
script's evaluation picks actions), files --resume must refuse, a small disk that fills up, and what an offline
Weights & Biases run recorded.

The test files import it as `from helpers import ...` (tests/ has no __init__.py, so pytest puts tests/ on sys.path)."""

import contextlib
import json
import math
import os
import re
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
import types
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"

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


CONSOLE_LINE = re.compile(r"^global_step=(\d+) SPS=(\d+) mean_return=(\S+)")


def start_run(script, args, log_dir, env=None):
    """Start `script` with `--log-dir log_dir` and `args` in the background and return its Popen once training is under
    way: the first console line (`global_step=N SPS=M mean_return=R`, the format every script prints) with N > 0.
    SIGINT is reset to its default in the child (a shell's background job would hand it an ignored SIGINT). The
    caller stops it (SIGINT, SIGTERM or SIGKILL) and reads the rest of its output. Fails with the script's stderr
    if it exits before that line."""
    cmd = [sys.executable, script, "--log-dir", str(log_dir), *args]
    env = {**(os.environ if env is None else env), "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(
        cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )  # fmt: skip
    for line in proc.stdout:
        match = CONSOLE_LINE.match(line)
        if match and int(match.group(1)) > 0:
            return proc
    proc.wait()
    pytest.fail(f"{script} exited ({proc.returncode}) before training got under way: {proc.stderr.read()[-2000:]}")


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


# the tags every script logs (README, "Shared flags and the run directory"); a script's own are in the README's table
SHARED_TAGS = {
    "charts/episodic_return", "charts/episodic_length", "charts/SPS", "charts/learning_rate", "charts/policy_lag",
    "losses/policy_loss", "losses/value_loss", "losses/entropy", "losses/total_loss", "losses/grad_norm",
    "eval/episodic_return",
}  # fmt: skip


def documented_tags(script: str) -> set[str]:
    """The tags README.md's tags-by-script table lists for `script`, with those of a script its row refers to."""
    table = README.read_text().split("<!-- tags-by-script -->")[1].split("<!-- /tags-by-script -->")[0]
    cell = dict(re.findall(r"^\| `(\w+\.py)` \| (.*) \|$", table, re.MULTILINE))[script]
    tags = set(re.findall(r"`([a-z_]+/[\w{}]+)`", cell))
    return tags.union(*(documented_tags(other) for other in re.findall(r"`(\w+\.py)`", cell)))


def assert_documented_tags(script: str, logged) -> None:
    """Every tag the run logged (`logged` from scalars()) is a shared one or in the README's row for `script`: a
    researcher finds what a tag is without reading the code. Per-learner tags are listed as `..._{i}`. And each is
    written in the script as a literal string (`"losses/value_loss"`, a per-learner one as `"..._{i}"` in its
    f-string), as CleanRL writes its tags: `grep -n '"TAG"' SCRIPT` finds the line that records it."""
    named = {re.sub(r"_\d+$", "_{i}", tag) for tag in logged}
    undocumented = sorted(named - SHARED_TAGS - documented_tags(script))
    assert not undocumented, f"README.md's tags-by-script table does not list {script}'s {undocumented}"
    source = (ROOT / script).read_text()
    built = sorted(tag for tag in named if f'"{tag}"' not in source)
    assert not built, f"{script} builds these tags from parts; write each as a literal where it is recorded: {built}"


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


def processes_with(text) -> list[int]:
    """pids whose command line mentions `text` (a test's unique log directory: a script's forked workers share its
    command line)."""
    pids = []
    for d in Path("/proc").iterdir():
        try:
            if d.name.isdigit() and text in (d / "cmdline").read_bytes().decode(errors="ignore"):
                pids.append(int(d.name))
        except OSError:
            pass
    return pids


def state_of(pid) -> str | None:
    """The state letter of process `pid` from /proc (R, S, T for stopped, Z for zombie, ...); None once it is gone."""
    try:
        return (Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]) or None
    except (OSError, IndexError):
        return None


def alive(pid) -> bool:
    """Process `pid` exists and is not a zombie."""
    return state_of(pid) not in (None, "Z")


def wait_for(condition, what: str, timeout: float = 60.0, period: float = 0.05):
    """Poll `condition()` until it returns something true, and return that; the deadline only catches a hang (a
    loaded machine may take long, never that long), failing the test with `what` was awaited."""
    deadline = time.monotonic() + timeout
    while not (result := condition()):
        if time.monotonic() > deadline:
            pytest.fail(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(period)
    return result


class FixedLogitsPolicy(nn.Module):
    """An actor-critic whose logits are the given [A] tensor for every observation (values 0): (logits, values)."""

    def __init__(self, logits: torch.Tensor):
        super().__init__()
        self.register_buffer("logits", logits)

    def forward(self, obs: torch.Tensor):
        return self.logits.expand(obs.shape[0], -1), torch.zeros(obs.shape[0])


class RecordingEnv:
    """A gymnasium-style env whose episodes last `length` steps and return `length`; `actions` lists every action."""

    def __init__(self, length: int = 25):
        self.length, self.t, self.actions = length, 0, []

    def reset(self, seed=None, options=None):
        self.t = 0
        return np.zeros(4, dtype=np.float32), {}

    def step(self, action):
        self.actions.append(action)
        self.t += 1
        done = self.t == self.length
        info = {"episode": {"r": float(self.length), "l": self.length}} if done else {}
        return np.zeros(4, dtype=np.float32), 0.0, done, False, info

    def close(self):
        pass


def write_unusable_checkpoint(directory, case, meta):
    """A file `--resume` must refuse, written as `directory`/checkpoint.pt; `meta` is what the script under test writes
    into its checkpoints' "meta" entry. case: `garbage` (not a torch file), `truncated` (a checkpoint cut in half),
    `no_meta` (no "meta" entry, as before checkpoints recorded what wrote them), `other_script` (another script's),
    `other_env` (another env's, with its shapes)."""
    path = Path(directory) / "checkpoint.pt"
    if case == "garbage":
        path.write_bytes(b"not a checkpoint\n")
        return path
    other = "hts_ppo.py" if meta["script"] == "hts_a2c.py" else "hts_a2c.py"
    meta = {
        "truncated": meta,
        "no_meta": None,
        "other_script": {**meta, "script": other},
        "other_env": {**meta, "env_id": "Acrobot-v1", "obs_shape": [6], "action_shape_or_n": 3},
    }[case]
    torch.save({"model": {"w": torch.zeros(10_000)}, "global_step": 0, **({"meta": meta} if meta else {})}, path)
    if case == "truncated":
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    return path


@contextlib.contextmanager
def small_tmpfs(path, size):
    """A tmpfs of `size` (mount's syntax: "2m") mounted at `path` for the test, so that a disk can fill up; the test is
    skipped where mounting is not allowed (not root, no CAP_SYS_ADMIN in a container)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                             capture_output=True, text=True)  # fmt: skip
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs to fill up: {mounted.stderr.strip() or 'mount failed'}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


def fill_disk(path):
    """Write `path`/filler until its filesystem is full."""
    fd = os.open(Path(path) / "filler", os.O_WRONLY | os.O_CREAT)
    try:
        while True:
            os.write(fd, b"\0" * 4096)
    except OSError:
        pass
    finally:
        os.close(fd)


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


def launch_ranks(script, args, log_dir, n=2):
    """`script` under torchrun with `n` ranks on this machine (launcher output, stdout and stderr merged, in its own
    session), returned with the ranks' pids once training is under way (a console line with a step > 0). The caller
    ends it (end_launch)."""
    launcher = ("-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(n))
    cmd = [sys.executable, *launcher, script, "--log-dir", str(log_dir), *args]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            start_new_session=True)  # fmt: skip
    seen = []
    for line in proc.stdout:
        seen.append(line)
        if (match := CONSOLE_LINE.match(line)) and int(match.group(1)) > 0:
            return proc, [rank_pid(proc.pid, r) for r in range(n)]
    proc.wait()
    pytest.fail(f"the ranks exited ({proc.returncode}) before training got under way: {''.join(seen)[-3000:]}")


def read_until(proc, text, seen):
    """Read a launch's merged output into the list `seen` up to a line holding `text` (pytest's timeout catches a
    hang); fails if the output ends first."""
    for line in proc.stdout:
        seen.append(line)
        if text in line:
            return
    pytest.fail(f"no line with {text!r}: {''.join(seen)[-3000:]}")


def end_launch(proc, pids):
    """Whatever is left of a launch (launch_ranks): its ranks and the launcher's session, killed."""
    for pid in pids:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate()


@dataclass
class WandbRun:
    """What an offline Weights & Biases run recorded: display name, config, and each logged history row."""

    name: str
    config: dict
    history: list[dict]


def wandb_offline_runs(wandb_dir):
    """Every offline run under `wandb_dir` (a run started with WANDB_MODE=offline and WANDB_DIR=wandb_dir), read from
    its `run-*.wandb` file: a LevelDB-style log (a 7-byte header, then 32 KiB blocks of records, each with a 7-byte
    header: crc32, length, type 1 full / 2 first / 3 middle / 4 last) of wandb's protobuf `Record`s."""
    from wandb.proto import wandb_internal_pb2

    out = []
    for path in sorted(Path(wandb_dir).glob("wandb/offline-run-*/run-*.wandb")):
        data = path.read_bytes()
        assert data[:4] == b":W&B", path
        name, config, history, chunks, pos = "", {}, [], [], 7
        while pos + 7 <= len(data):
            left = 32768 - pos % 32768
            _, length, kind = struct.unpack("<IHB", data[pos : pos + 7]) if left >= 7 else (0, 0, 0)
            if kind == 0:  # the zero padding that ends a block
                pos += left
                continue
            chunks.append(data[pos + 7 : pos + 7 + length])
            pos += 7 + length
            if kind not in (1, 4):
                continue
            record = wandb_internal_pb2.Record()
            record.ParseFromString(b"".join(chunks))
            chunks = []
            which = record.WhichOneof("record_type")
            if which == "run":
                name = record.run.display_name
                config.update({i.key: json.loads(i.value_json) for i in record.run.config.update})
            elif which == "config":
                config.update({i.key: json.loads(i.value_json) for i in record.config.update})
            elif which == "history":
                history.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item})
        out.append(WandbRun(name, config, history))
    return out


def offline_wandb_env(wandb_dir):
    """The environment for a `--track` run that writes its Weights & Biases run to `wandb_dir` and reaches no
    network: offline mode, no console chatter."""
    return {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DIR": str(wandb_dir)}


def assert_tracked_once(wandb_dir, run_dir, tags=("charts/episodic_return", "losses/value_loss")):
    """`wandb_dir` holds exactly one offline run (a multi-process run logs once), named like the run directory, with
    the Args as config and finite values of every tag in `tags` in its history (synced from TensorBoard)."""
    runs = wandb_offline_runs(wandb_dir)
    assert len(runs) == 1, [r.name for r in runs]
    run = runs[0]
    assert run.name == Path(run_dir).name
    assert "env_id" in run.config and "seed" in run.config, sorted(run.config)
    for tag in tags:
        values = [row[tag] for row in run.history if tag in row]
        assert values and all(math.isfinite(v) for v in values), (tag, values[:5])
    return run


def run_eval_only(script, model, log_dir, *args, timeout=180):
    """Run `script --eval-only model` with `args`; return (the CompletedProcess, the eval JSON it wrote beside the
    model or None). It must not make a run directory under `log_dir`."""
    before = set(Path(model).parent.glob("eval-*.json"))
    proc = run_script(script, ["--eval-only", str(model), *args], log_dir, timeout=timeout)
    assert not Path(log_dir).exists() or not any(p.is_dir() for p in Path(log_dir).iterdir()), "made a run directory"
    new = sorted(set(Path(model).parent.glob("eval-*.json")) - before)
    return proc, (json.loads(new[-1].read_text()) if new else None)


def assert_one_error_line(proc, *fragments):
    """The run refused its input: exit 2, one stderr line `error: ...` holding every fragment, no traceback."""
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error:"), (proc.returncode, proc.stderr)
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])


def assert_eval_only_refusals(script, model, tmp_path):
    """`--eval-only` refuses, with one `error:` line and exit 2: a model.pt whose args.json names another script, a
    `--env-id` that contradicts the saved run, and a file that is not a model."""
    other = tmp_path / "other-script"
    other.mkdir()
    saved = json.loads((Path(model).parent / "args.json").read_text())
    shutil.copy(model, other / "model.pt")
    (other / "args.json").write_text(json.dumps({**saved, "script": "some_other_script.py"}))
    proc, _ = run_eval_only(script, other / "model.pt", tmp_path / "logs-other")
    assert_one_error_line(proc, "some_other_script.py", script)
    proc, _ = run_eval_only(script, model, tmp_path / "logs-env", "--env-id", "Acrobot-v1")
    assert_one_error_line(proc, "Acrobot-v1", saved["args"]["env_id"])
    garbage = tmp_path / "garbage" / "model.pt"
    garbage.parent.mkdir()
    garbage.write_bytes(b"not a model")
    shutil.copy(Path(model).parent / "args.json", garbage.parent / "args.json")
    proc, _ = run_eval_only(script, garbage, tmp_path / "logs-garbage")
    assert_one_error_line(proc)


class FakeWandb(types.SimpleNamespace):
    """Records what a script asks of the wandb module (monkeypatched in as sys.modules["wandb"]); `init` raises
    `error` if one is given."""

    def __init__(self, error: Exception | None = None):
        super().__init__(inits=[], logged=[], finished=[], error=error)

    def init(self, **kwargs):
        if self.error:
            raise self.error
        self.inits.append(kwargs)

    def Video(self, path):  # wandb's name
        return ("video", path)

    def log(self, data):
        self.logged.append(data)

    def finish(self, exit_code=0):
        self.finished.append(exit_code)
