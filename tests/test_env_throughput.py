"""benchmarks/env_throughput.py runs end to end on a tiny budget and writes a well-formed table."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_env_throughput_writes_json_and_table(tmp_path):
    out = tmp_path / "env.json"
    cmd = [
        sys.executable,
        "benchmarks/env_throughput.py",
        "--seconds",
        "0.2",
        "--num-envs",
        "2",
        "16",
        "--num-threads",
        "1",
        "--gym-num-envs",
        "2",
        "--out",
        str(out),
    ]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(out.read_text())["rows"]
    names = {r["env"].split(",")[0] for r in rows}
    assert {"make_vector_env (ale-py C++ vector env)", "gymnasium AsyncVectorEnv", "one env"} <= names
    for r in rows:
        assert r["agent_steps_per_s"] > 0 and abs(r["frames_per_s"] - 4 * r["agent_steps_per_s"]) < 1
    assert "steps/s" in proc.stdout and "frames/s" in proc.stdout


def test_env_throughput_rejects_non_ale_id():
    proc = subprocess.run(
        [sys.executable, "benchmarks/env_throughput.py", "--env-id", "CartPole-v1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and proc.stderr.strip().startswith("error:")
