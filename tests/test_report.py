"""benchmarks/report.py: the committed tables of README.md and benchmarks/RESULTS.md are what it writes from
benchmarks/results/*.json, and its tables hold hand-computed values on a small synthetic set of JSON files."""

import importlib
import json
import math
import re
import shlex
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import report  # noqa: E402


def test_committed_tables_are_what_report_writes():
    for path, (old, new, changed) in report.render(ROOT).items():
        assert new == old, f"{path.name}: tables {changed} differ from their JSON; run python benchmarks/report.py"


def write(path: Path, data: dict) -> None:
    path.write_text(json.dumps(data))


def learning_run(exp, env="ALE_Pong-v5", **fields):
    """One record of plot.py's JSON."""
    run = dict(env=env, exp=exp, seeds=[1], agent_steps=[1000], episodes=[10], final_return_per_seed=[0.0],
               final_return_mean=0.0, final_return_min=0.0, sps_mean=1.0)  # fmt: skip
    return run | fields


def manifest_run(label, *flags):
    """One record of learn.py's manifest: the flags that name the run, then the run's own."""
    command = [f"{label}.py", "--env-id", "ALE/Pong-v5", "--seed", "1", "--total-timesteps", "2500000",
               "--exp-name", label, "--log-dir", "/tmp/runs", "--atari-protocol", "deepmind",
               "--checkpoint-interval", "600", *flags]  # fmt: skip
    return dict(label=label, seed=1, env_id="ALE/Pong-v5", command=command, log="x.log", returncode=0,
                wall_seconds=1.0, stopped_at_time_limit=False)  # fmt: skip


def table_rows(markdown: str) -> list[list[str]]:
    """The body rows of the first Markdown table in `markdown`, as lists of cells."""
    lines = [line for line in markdown.splitlines() if line.startswith("|")][2:]
    return [[cell.strip() for cell in line.strip("|").split(" | ")] for line in lines]


def test_pong_table_takes_every_pong_json_with_hand_computed_values(tmp_path):
    write(tmp_path / "pong_cpu_hts.json", {"runs": [
        learning_run("hts_ppo", agent_steps=[1_200_000], final_return_mean=-7.26, sps_mean=400.0),
    ]})  # fmt: skip
    hts_manifest = manifest_run("hts_ppo", "--num-envs", "8", "--no-clip-vloss", "--torch-threads", "2")
    write(tmp_path / "pong_cpu_hts_manifest.json", {"suite": "atari-smoke", "machine": "2 CPU cores",
                                                    "runs": [manifest_run("hts_ppo"), hts_manifest]})  # fmt: skip
    (tmp_path / "pong_cpu_hts_ALE_Pong-v5.png").write_bytes(b"")
    write(tmp_path / "pong_cpu_gala.json", {"runs": [
        learning_run("gala_gossip", agent_steps=[2_500_000], final_return_mean=2.46, sps_mean=625.0),
    ]})  # fmt: skip

    rows = table_rows(report.pong_cpu_table(tmp_path))
    # sorted by script: gala_a2c.py before hts_ppo.py
    assert [r[:3] for r in rows] == [
        ["`gala_gossip`", "gala_a2c.py", "—"],  # no manifest: no flags to show
        ["`hts_ppo`", "hts_ppo.py", "`--num-envs 8 --no-clip-vloss --torch-threads 2`"],  # the last piece's flags
    ]
    # agent steps, final return, agent steps/s, running time: 2.5M / 625 / 60 = 66.67 min; 1.2M / 400 / 60 = 50 min
    assert [r[3:7] for r in rows] == [["2,500,000", "2.5", "625", "67"], ["1,200,000", "-7.3", "400", "50"]]
    assert rows[0][7:] == ["[`pong_cpu_gala.json`](results/pong_cpu_gala.json)", "—"]
    assert rows[1][8] == "[curves](results/pong_cpu_hts_ALE_Pong-v5.png)"

    # a new result is a new JSON: both IMPALA runs of it become rows, and the summary's best run per script
    write(tmp_path / "pong_cpu_impala2.json", {"runs": [
        learning_run("cleanba_impala_nature", agent_steps=[900_000], final_return_mean=5.0, sps_mean=300.0),
        learning_run("impala_batched_small", agent_steps=[800_000], final_return_mean=-3.0, sps_mean=200.0),
    ]})  # fmt: skip
    rows = table_rows(report.pong_cpu_table(tmp_path))
    assert [r[:2] for r in rows] == [
        ["`cleanba_impala_nature`", "cleanba_ppo_impala.py"],
        ["`gala_gossip`", "gala_a2c.py"],
        ["`hts_ppo`", "hts_ppo.py"],
        ["`impala_batched_small`", "impala_monobeast.py"],
    ]
    assert rows[0][3:7] == ["900,000", "5.0", "300", "50"]


def test_pong_table_drops_a_run_only_once_its_replacing_json_holds_the_label(tmp_path, monkeypatch):
    monkeypatch.setattr(report, "REPLACED_BY", {("pong_cpu_old.json", "hts_ppo"): "pong_cpu_new.json"})
    for path in (ROOT / "benchmarks" / "results").glob("*.json"):  # the summary's other sources; no Pong run
        if not path.name.startswith("pong_cpu"):
            (tmp_path / path.name).write_text(path.read_text())
    write(tmp_path / "pong_cpu_old.json", {"runs": [
        learning_run("hts_ppo", agent_steps=[1_400_000], final_return_mean=-10.6),
        learning_run("gala_gossip", agent_steps=[2_500_000], final_return_mean=2.5),
    ]})  # fmt: skip
    # the replacing JSON is not there yet, then holds another label: the old run keeps its row
    for runs in ([], [learning_run("hts_a2c", agent_steps=[2_500_000], final_return_mean=17.9)]):
        if runs:
            write(tmp_path / "pong_cpu_new.json", {"runs": runs})
        rows = table_rows(report.pong_cpu_table(tmp_path))
        assert ["`hts_ppo`", "-10.6"] in [[r[0], r[4]] for r in rows]
    write(tmp_path / "pong_cpu_new.json", {"runs": [
        learning_run("hts_ppo", agent_steps=[2_500_000], final_return_mean=12.0),
    ]})  # fmt: skip
    rows = table_rows(report.pong_cpu_table(tmp_path))
    assert [[r[0], r[4], r[7]] for r in rows] == [
        ["`gala_gossip`", "2.5", "[`pong_cpu_old.json`](results/pong_cpu_old.json)"],
        ["`hts_ppo`", "12.0", "[`pong_cpu_new.json`](results/pong_cpu_new.json)"],
    ]
    # the summary's hts_ppo.py run is the later one, though the replaced one's -10.6 is higher
    write(tmp_path / "pong_cpu_new.json", {"runs": [
        learning_run("hts_ppo", agent_steps=[2_500_000], final_return_mean=-15.0),
    ]})  # fmt: skip
    summary = {r[0]: r for r in table_rows(report.summary_table(tmp_path))}
    assert summary["`hts_ppo.py`"][2].startswith("[-15.0 after 2.50M steps]")


def at_frames(*means):
    """plot.py --at-frames records of one seed: a mean per budget (None: the run stopped before it)."""
    budgets = (4_000_000, 10_000_000)
    return [dict(frames=b, per_seed=[m], mean=m, seeds_reaching=int(m is not None))
            for b, m in zip(budgets, means, strict=True)]  # fmt: skip


def test_pong_references_table_takes_each_family_from_its_plot_json_and_each_command_from_its_source(tmp_path):
    """Two families from pong_references.json: our runs' commands from their manifests (less --log-dir and a last
    piece's --resume), a reference's from the references JSON itself; the machine is the side's own plus its
    manifest's."""
    write(tmp_path / "pong_ref_ppo.json", {"runs": [
        learning_run("cleanba_ppo", agent_steps=[1_299_456], sps_mean=2847.99, running_seconds=[456.27],
                     at_frames=at_frames(-6.94, None)),
        learning_run("cleanrl_ppo_atari", run_env="PongNoFrameskip-v4", agent_steps=[2_499_584], sps_mean=250.4,
                     running_seconds=[9_990.0], at_frames=at_frames(-20.25, 14.96)),
    ]})  # fmt: skip
    write(tmp_path / "pong_ref_impala.json", {"runs": [
        learning_run("impala_batched", agent_steps=[600_000, 700_000], sps_mean=500.0, running_seconds=[1200.0, 1500.0],
                     at_frames=at_frames(None, None)),
    ]})  # fmt: skip
    (tmp_path / "pong_ref_ppo_ALE_Pong-v5.png").write_bytes(b"")
    ours = manifest_run("cleanba_ppo", "--num-envs", "8") | dict(stopped_at_time_limit=True)
    write(tmp_path / "gpu_manifest.json", {"suite": "atari-smoke", "machine": "16 CPU cores", "runs": [ours]})
    resumed = manifest_run("impala_batched", "--resume", "/runs/x/checkpoint.pt")  # its last piece's command
    write(tmp_path / "cpu_manifest.json", {"machine": "2 CPU cores", "runs": [resumed]})
    reference_command = ["run_ppo_atari.py", "--env-id", "PongNoFrameskip-v4", "--total-timesteps", "2500000"]
    write(tmp_path / report.REFERENCES, {"at_frames": [4_000_000, 10_000_000], "families": [
        {"family": "PPO", "plot": "pong_ref_ppo.json", "env": "ALE_Pong-v5", "runs": [
            {"exp": "cleanba_ppo", "code": "ours.py", "machine": "GPU machine", "manifest": "gpu_manifest.json"},
            {"exp": "cleanrl_ppo_atari", "code": "CleanRL", "machine": "2-core VM", "command": reference_command}]},
        {"family": "IMPALA", "plot": "pong_ref_impala.json", "env": "ALE_Pong-v5", "runs": [
            {"exp": "impala_batched", "code": "mono.py", "machine": "", "manifest": "cpu_manifest.json"},
            {"exp": "impala_small", "code": "mono.py", "machine": "2-core VM", "command": ["small.py"],
             "plot": "pong_ref_impala_small.json"},
            {"exp": "impala_small_sync", "code": "mono.py", "machine": "2-core VM", "command": ["small.py", "--sync"],
             "plot": "pong_ref_impala_small.json"}]},
    ]})  # fmt: skip
    # sides drawn in a figure of their own: their rows from its plot JSON, not the family's (which has no such run),
    # and one link to it
    write(tmp_path / "pong_ref_impala_small.json", {"runs": [
        learning_run("impala_small", agent_steps=[2_500_000], sps_mean=300.0, running_seconds=[8_400.0],
                     at_frames=at_frames(-19.5, 3.26)),
        learning_run("impala_small_sync", agent_steps=[1_000_000], sps_mean=150.0, running_seconds=[6_600.0],
                     at_frames=at_frames(1.24, None)),
    ]})  # fmt: skip
    (tmp_path / "pong_ref_impala_small_ALE_Pong-v5.png").write_bytes(b"")

    text = report.pong_references_table(tmp_path)
    ours_command = ("`python cleanba_ppo.py --env-id ALE/Pong-v5 --seed 1 --total-timesteps 2500000 --exp-name "
                    "cleanba_ppo --atari-protocol deepmind --checkpoint-interval 600 --num-envs 8`")  # fmt: skip
    assert table_rows(text) == [
        # 456.27 s = 7.6 min; 9,990 s = 166.5 min; the IMPALA pair: the median of 1,200 and 1,500 s is 22.5 min
        ["PPO", "`cleanba_ppo`", "ours.py", "GPU machine, 16 CPU cores", "-6.9", "—",
         "1,299,456 of 2,500,000 (time limit)", "2,848", "8", ours_command],
        ["PPO", "`cleanrl_ppo_atari`", "CleanRL", "2-core VM", "-20.2", "15.0", "2,499,584 of 2,500,000", "250", "166",
         "`python run_ppo_atari.py --env-id PongNoFrameskip-v4 --total-timesteps 2500000`"],
        ["IMPALA", "`impala_batched`", "mono.py", "2 CPU cores", "—", "—", "650,000 of 2,500,000", "500", "22",
         "`python impala_batched.py --env-id ALE/Pong-v5 --seed 1 --total-timesteps 2500000 --exp-name impala_batched "
         "--atari-protocol deepmind --checkpoint-interval 600`"],
        ["IMPALA", "`impala_small`", "mono.py", "2-core VM", "-19.5", "3.3", "2,500,000", "300", "140",
         "`python small.py`"],
        ["IMPALA", "`impala_small_sync`", "mono.py", "2-core VM", "1.2", "—", "1,000,000", "150", "110",
         "`python small.py --sync`"],
    ]  # fmt: skip
    assert "final return at 4M frames (last 20 episodes) | final return at 10M frames (last 20 episodes)" in text
    small = "[pong_ref_impala_small_ALE_Pong-v5.png](results/pong_ref_impala_small_ALE_Pong-v5.png)"
    assert ("Curves: PPO: [pong_ref_ppo_ALE_Pong-v5.png](results/pong_ref_ppo_ALE_Pong-v5.png); IMPALA: —; IMPALA, "
            f"`impala_small` and `impala_small_sync`: {small}." in text)  # fmt: skip
    assert text.endswith(
        "JSON: [`pong_references.json`](results/pong_references.json); "
        "[`pong_ref_ppo.json`](results/pong_ref_ppo.json); "
        "[`gpu_manifest.json`](results/gpu_manifest.json) (16 CPU cores); "
        "[`pong_ref_impala.json`](results/pong_ref_impala.json); [`cpu_manifest.json`](results/cpu_manifest.json) "
        "(2 CPU cores); [`pong_ref_impala_small.json`](results/pong_ref_impala_small.json)."
    )


def test_classic_control_table_later_source_replaces_a_run(tmp_path, monkeypatch):
    nan = math.nan
    first = learning_run("algo_a", env="CartPole-v1", seeds=[1, 2, 3], agent_steps=[500_000] * 3,
                         final_return_mean=100.0, final_return_min=50.0, threshold=475.0, seeds_reaching_threshold=0,
                         steps_to_threshold_per_seed=[nan, nan, nan])  # fmt: skip
    kept = learning_run("algo_b", env="CartPole-v1", seeds=[1, 2, 3], agent_steps=[499_712, 499_712, 500_224],
                        final_return_mean=480.04, final_return_min=466.56, threshold=475.0, seeds_reaching_threshold=2,
                        steps_to_threshold_per_seed=[100_000.0, nan, 300_000.0])  # fmt: skip
    rerun = first | dict(final_return_mean=490.0, final_return_min=485.0, seeds_reaching_threshold=3,
                         steps_to_threshold_per_seed=[120_000.0, 90_000.0, 150_000.0])  # fmt: skip
    write(tmp_path / "suite.json", {"runs": [first, kept]})
    write(tmp_path / "rerun.json", {"runs": [rerun]})
    (tmp_path / "rerun_CartPole-v1.png").write_bytes(b"")
    monkeypatch.setattr(report, "CLASSIC_SOURCES", ["suite.json", "rerun.json"])

    markdown = report.classic_control_table(tmp_path)
    rows = table_rows(markdown)
    assert rows == [
        # algo_a from the rerun: median of 120k, 90k, 150k
        ["CartPole-v1", "`algo_a`", "3", "500,000", "490.0 (485.0)", "475", "3/3", "120,000",
         "[`rerun.json`](results/rerun.json)", "[curves](results/rerun_CartPole-v1.png)"],
        # algo_b: median agent steps 499,712; steps to the bar over the 2 seeds that reach it: (100k + 300k) / 2
        ["CartPole-v1", "`algo_b`", "3", "499,712", "480.0 (466.6)", "475", "2/3", "200,000",
         "[`suite.json`](results/suite.json)", "—"],
    ]  # fmt: skip
    assert markdown.endswith("JSON: [`suite.json`](results/suite.json); [`rerun.json`](results/rerun.json).")


def test_fill_rewrites_only_between_markers_and_check_fails_when_stale(tmp_path, monkeypatch, capsys):
    (tmp_path / "benchmarks").mkdir()
    doc = tmp_path / "benchmarks" / "RESULTS.md"
    prose = "# Results\n\nWritten by hand: 1.5x.\n\n<!-- report:demo -->\n| old |\n<!-- /report:demo -->\n\nAfter.\n"
    doc.write_text(prose)
    monkeypatch.setattr(report, "DOCUMENTS", {"benchmarks/RESULTS.md": {"demo": lambda results: "| new |"}})

    assert report.main(["--check", "--root", str(tmp_path)]) == 1
    assert "benchmarks/RESULTS.md: out of date: demo" in capsys.readouterr().out
    assert doc.read_text() == prose  # --check writes nothing

    assert report.main(["--root", str(tmp_path)]) == 0
    assert doc.read_text() == prose.replace("| old |", "| new |")
    assert report.main(["--check", "--root", str(tmp_path)]) == 0

    doc.write_text(prose.replace("demo", "other"))  # a table without its markers is an error, not a silent skip
    assert report.main(["--root", str(tmp_path)]) == 2
    assert "tables without markers: ['demo']" in capsys.readouterr().out
    with pytest.raises(ValueError):
        report.fill("<!-- report:a -->\n<!-- /report:a -->\n<!-- report:a -->\n<!-- /report:a -->\n", {"a": "x"})


def test_summary_row_takes_a_new_pong_result(tmp_path):
    """The README's summary picks each script's best Pong run from whatever pong_cpu*.json exists."""
    for path in (ROOT / "benchmarks" / "results").glob("*.json"):
        # the file this test writes its own version of, and the newer runs of its two labels
        if not path.name.startswith(("pong_cpu_impala2", "pong_cpu_impala_small", "pong_cpu_gate_cleanba_impala")):
            (tmp_path / path.name).write_text(path.read_text())
    before = {r[0]: r for r in table_rows(report.summary_table(tmp_path))}
    assert before["`cleanba_ppo_impala.py --algo impala`"][2] == "—"

    write(tmp_path / "pong_cpu_impala2.json", {"runs": [
        learning_run("cleanba_impala_nature", agent_steps=[904_000], final_return_mean=5.04),
        learning_run("impala_batched_small", agent_steps=[1_000_000], final_return_mean=-25.0),
    ]})  # fmt: skip
    after = {r[0]: r for r in table_rows(report.summary_table(tmp_path))}
    link = "(benchmarks/RESULTS.md#pong-on-2-cpu-cores)"
    assert after["`cleanba_ppo_impala.py --algo impala`"][2] == f"[+5.0 after 0.90M steps]{link}"
    assert after["`impala_monobeast.py`"][2] == before["`impala_monobeast.py`"][2]  # -25.0 is not its best run
    assert {k: v for k, v in after.items() if "impala" not in k} == {
        k: v for k, v in before.items() if "impala" not in k
    }


def test_atari_table_shows_each_scripts_earliest_crossing_of_18_else_its_best_final_return(tmp_path):
    """The README's first table: a gate run's first +18 beats another run's higher final return; without a crossing,
    the best final return at the run's end; a script without a Pong run says so. Values computed by hand."""
    write(tmp_path / "pong_cpu_a.json", {"window": 20, "runs": [
        learning_run("gala_gossip", threshold=18.0, steps_to_threshold_per_seed=[2_000_000.0], agent_steps=[3_000_000],
                     seconds_to_threshold_per_seed=[3_900.0], final_return_mean=18.5),
        learning_run("hts_a2c", final_return_mean=12.0, agent_steps=[2_500_000], running_seconds=[7_260.0]),
        learning_run("hts_a2c_other", final_return_mean=3.0, agent_steps=[2_500_000]),
    ]})  # fmt: skip
    write(tmp_path / "pong_cpu_b.json", {"window": 20, "runs": [
        learning_run("gala_allreduce", final_return_mean=19.0, agent_steps=[2_500_000], running_seconds=[100.0]),
    ]})  # fmt: skip
    write(tmp_path / "pong_cpu_a_manifest.json", {"machine": "2 CPU cores", "runs": [
        manifest_run("gala_gossip", "--num-learners", "2"), manifest_run("hts_a2c")]})  # fmt: skip
    rows = {r[0]: r for r in table_rows(report.atari_table(tmp_path))}
    command = "[command](benchmarks/results/pong_cpu_a_manifest.json)"
    assert rows["`gala_a2c.py`"][1:] == [
        "`gala_gossip`: `--num-learners 2`", "yes: +18 at 2.00M agent steps (8.0M frames); +18.5 at 3.00M", "1",
        "1h05m", "2 CPU cores", f"—, {command}"]  # fmt: skip
    assert rows["`hts_a2c.py`"][1:] == [
        "`hts_a2c`: defaults", "not yet: +12.0 at 2.50M agent steps (10.0M frames), its end", "1", "2h01m",
        "2 CPU cores", f"—, {command}"]  # fmt: skip
    assert rows["`apex_dqn.py`"][1:3] == ["—", "no: not run on Atari yet"]
    assert len(rows) == len(report.SUMMARY_ROWS)


def anchor(heading: str) -> str:
    """GitHub's anchor of a Markdown heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_links_to_results_sections_resolve():
    results = (ROOT / "benchmarks" / "RESULTS.md").read_text()
    sections = {anchor(h) for h in re.findall(r"^#+ (.+)$", results, re.M)}
    readme = (ROOT / "README.md").read_text()
    targets = re.findall(r"\]\(benchmarks/RESULTS\.md#([\w-]+)\)", readme) + re.findall(r"\]\(#([\w-]+)\)", results)
    assert targets and not sorted(set(targets) - sections)
    files = re.findall(r"\]\((results/[^)#]+)\)", results)
    assert files and not [f for f in files if not (ROOT / "benchmarks" / f).exists()]


def driver_row(label, **fields):
    """One row of throughput.py's JSON (medians over `rounds`)."""
    return dict(label=label, external=False, command=f"python {label}.py", num_envs=8, workers=2, sps=100.0,
                pss_peak_mib=500.0, policy_lag_mean=None, rounds=[]) | fields  # fmt: skip


def test_driver_tables_pivot_derive_and_spread_with_hand_computed_values(tmp_path):
    meta = {"date": "2026-11-24T20:00:00+00:00", "cores": 2}
    write(tmp_path / "throughput_straggler.json", {"meta": meta, "rows": [
        driver_row("hts_a2c", std_ms=0.0, sps=700.0), driver_row("hts_a2c", std_ms=20.0, sps=650.4),
        driver_row("gala_gossip", std_ms=0.0, sps=210.0), driver_row("gala_gossip", std_ms=20.0, sps=190.0),
        driver_row("cleanba_ppo", std_ms=0.0, sps=math.nan), driver_row("cleanba_ppo", std_ms=20.0, sps=94.0),
        driver_row("peer", external=True, std_ms=0.0),
    ]})  # fmt: skip
    write(tmp_path / "throughput_straggler_cleanba_ppo.json", {"meta": meta, "rows": [
        driver_row("cleanba_ppo", std_ms=0.0, sps=97.0), driver_row("cleanba_ppo", std_ms=20.0, sps=98.0),
    ]})  # fmt: skip
    # one row per label, one column per std; a later JSON's run replaces an earlier one's; the peer is left out
    assert table_rows(report.straggler_table(tmp_path)) == [
        ["`hts_a2c`", "hts_a2c.py", "700", "650"], ["`gala_gossip`", "gala_a2c.py", "210", "190"],
        ["`cleanba_ppo`", "cleanba_ppo_impala.py", "97", "98"]]  # fmt: skip

    # HTS-RL's row carries its --sync rate: 600 / 2.5 = 240; the --sync row itself is not a row of the table
    write(tmp_path / "throughput_hts_straggler.json", {"meta": meta, "rows": [
        driver_row("hts_a2c", std_ms=20.0, sps=600.0, speedup_vs_baseline=2.5, eq7_async_sps=750.0,
                   runtime_vs_async=1.25),
        driver_row("hts_a2c_sync", std_ms=20.0, sps=240.0),
    ]})  # fmt: skip
    assert table_rows(report.hts_straggler_table(tmp_path)) == [["20 ms", "240", "600", "2.50x", "750", "1.25"]]

    # shares of an iteration from the median over rounds of each timing/* mean: gossip median(0.01, 0.03, 0.02) = 0.02
    # of median(0.4, 0.5, 0.5) = 0.5 -> 4.0%; all-reduce 0 -> 0.0%
    rounds = [dict(round=i + 1, scalars={"timing/gossip": g, "timing/allreduce": 0.0, "timing/iteration": it})
              for i, (g, it) in enumerate([(0.01, 0.4), (0.03, 0.5), (0.02, 0.5)])]  # fmt: skip
    write(tmp_path / "throughput_gala_straggler.json", {"meta": meta, "rows": [
        driver_row("gala_gossip", std_ms=4.0, workers=4, num_envs=16, sps=993.0, speedup_vs_baseline=1.3222,
                   rounds=rounds),
    ]})  # fmt: skip
    assert table_rows(report.gala_straggler_table(tmp_path)) == [
        ["4 ms", "`gala_gossip`", "4", "993", "1.32x", "4.0%", "0.0%"]]  # fmt: skip

    # the noise table: min–max over the rounds and (max / min - 1)
    pieces = [dict(env=2000.0, infer=5000.0, train=1000.0, sps=600.0, efficiency=0.8, policy_lag_max=2.0),
              dict(env=2500.0, infer=5000.0, train=1200.0, sps=690.0, efficiency=0.9, policy_lag_max=3.0)]  # fmt: skip
    write(tmp_path / report.A3C_ROUNDS, {"meta": meta, "rows": [
        driver_row("a3c_hogwild", num_envs=32, sps=645.0, env=2250.0, infer=5000.0, train=1100.0, ceiling=700.0,
                   efficiency=0.85, policy_lag_mean=0.99, rounds=pieces),
    ]})  # fmt: skip
    assert table_rows(report.noise_table(tmp_path)) == [
        ["`a3c_hogwild`", "2 x 16", "2,000–2,500 (25%)", "5,000–5,000 (0%)", "1,000–1,200 (20%)", "600–690 (15%)"]
    ]
    # the A3C table: ceiling (pieces), median rate, per-round efficiencies, mean lag / the largest max of any round
    assert table_rows(report.a3c_table(tmp_path)) == [
        ["`a3c_hogwild`", "2 x 16", "700 (2,250 / 5,000 / 1,100)", "645", "0.85", "0.80 0.90", "0.99 / 3", "500"]
    ]


def test_peers_are_timed_against_the_peer_of_their_own_json(tmp_path):
    meta = {"date": "2026-11-24T20:00:00+00:00", "cores": 2}
    ppo = [
        driver_row(
            "cleanba_ppo",
            sps=380.0,
            rounds=[dict(sps=370.0, rate_source="tensorboard"), dict(sps=390.0, rate_source="tensorboard")],
        ),
        driver_row(
            "cleanrl_ppo_atari",
            external=True,
            sps=240.0,
            rounds=[dict(sps=250.0, rate_source="csv"), dict(sps=230.0, rate_source="csv")],
        ),
    ]
    impala = [
        driver_row("impala_batched", sps=660.0, rounds=[dict(sps=660.0, rate_source="tensorboard")]),
        driver_row("torchbeast_monobeast", external=True, sps=550.0, rounds=[dict(sps=550.0, rate_source="csv")]),
    ]
    for name, rows in zip(report.PEER_SOURCES, [ppo, impala], strict=True):
        write(tmp_path / name, {"meta": meta, "rows": rows})
    # 380 / 240 = 1.583; 660 / 550 = 1.2: each against the peer of its own JSON, never the other one's; and each
    # round against the peer's run of that round: 370 / 250 = 1.48, 390 / 230 = 1.696
    assert table_rows(report.peers_table(tmp_path)) == [
        ["`cleanba_ppo`", "cleanba_ppo_impala.py", "380", "370 390", "1.58x", "1.48x 1.70x", "tensorboard"],
        ["`cleanrl_ppo_atari`", "CleanRL's `ppo_atari.py`", "240", "250 230", "—", "—", "csv"],
        ["`impala_batched`", "impala_monobeast.py", "660", "660", "1.20x", "1.20x", "tensorboard"],
        ["`torchbeast_monobeast`", "TorchBeast's MonoBeast", "550", "550", "—", "—", "csv"],
    ]
    assert report.against_peers(tmp_path) == {"cleanba_ppo": "1.58x CleanRL's `ppo_atari.py`",
                                              "impala_batched": "1.20x TorchBeast's MonoBeast"}  # fmt: skip


def test_cleanba_threads_table_pairs_each_thread_count_with_its_sync_mode(tmp_path):
    rates = {"cleanba_ppo": 380.0, "cleanba_ppo_sync": 400.0, "cleanba_ppo_1_thread": 300.0,
             "cleanba_ppo_sync_1_thread": 250.0}  # fmt: skip
    rows = [driver_row(label, external=label.endswith("thread"), sps=v, rounds=[dict(sps=v - 10), dict(sps=v + 10)])
            for label, v in rates.items()]  # fmt: skip
    write(tmp_path / report.CLEANBA_THREADS_SOURCE, {"meta": {"cores": 2}, "rows": rows})
    # 380 / 400 = 0.95; 300 / 250 = 1.2
    assert table_rows(report.cleanba_threads_table(tmp_path)) == [
        ["torch's default, one per core", "380 (370 390)", "400 (390 410)", "0.95x"],
        ["1 (`--torch-threads 1`)", "300 (290 310)", "250 (240 260)", "1.20x"],
    ]


def stop_row(label, script, kind, *tries, **fields):
    """One row of throughput.py --stop-times; each try (seconds or None, exit code or None, hung, processes left)."""
    made = [dict(seconds=s, exit_code=c, hung=h, left_behind=[100] * n, error=None) for s, c, h, n in tries]
    return dict(label=label, script=script, kind=kind, timeout=60.0, tries=made) | fields


def test_stop_table_takes_median_and_worst_of_each_kind_with_hand_computed_values(tmp_path):
    rows = [
        stop_row("a3c_hogwild", "a3c.py", "sigint", (1.2, 130, False, 0), (0.8, 130, False, 0), (3.1, 130, False, 1)),
        stop_row(
            "a3c_hogwild",
            "a3c.py",
            "sigterm",
            (2.0, 143, False, 0),
            (1.0, 143, False, 0),
            (None, None, True, 2),
            (4.0, -9, False, 0),
        ),
        stop_row("a3c_hogwild", "a3c.py", "killed_worker", (0.5, 1, False, 0), victim="worker 1"),
        stop_row("cleanba_ppo", "cleanba.py", "sigint", (0.3, 130, False, 0)),
        stop_row("cleanba_ppo", "cleanba.py", "sigterm", (0.4, 143, False, 0)),
        stop_row("cleanba_ppo", "cleanba.py", "killed_worker", not_applicable="its actors are threads"),
    ]
    write(tmp_path / report.STOP_SOURCE, {"meta": {"date": "2026-11-25T10:00:00+00:00", "cores": 2}, "rows": rows})
    text = report.stop_table(tmp_path)
    # SIGINT: median of 0.8, 1.2, 3.1 is 1.2, worst 3.1; SIGTERM: median of the three that exited (1.0, 2.0, 4.0) is
    # 2.0, worst beyond the 60-s timeout; processes left: 1 + 2
    assert table_rows(text) == [
        ["`a3c.py`", "`a3c_hogwild`", "1.20 / 3.10 (3)", "130", "2.00 / > 60 (4), 1 hung", "-9 (1x), 143 (2x)",
         "0.50 / 0.50 (1)", "1", "worker 1", "3"],
        ["`cleanba.py`", "`cleanba_ppo`", "0.30 / 0.30 (1)", "130", "0.40 / 0.40 (1)", "143", "n/a", "—", "—", "0"],
    ]  # fmt: skip
    assert "`cleanba.py`, a killed worker: n/a, its actors are threads." in text
    assert "(2026-11-25, 2 CPUs)" in text


def test_every_command_of_the_readme_first_runs_is_accepted_as_it_stands():
    """The README's 'Learn in minutes' commands (from the measured runs' manifests) still parse and validate with
    today's scripts, and Ape-X's raise no warning: a new user copying one gets a run, not an error line."""
    section = (ROOT / "README.md").read_text().split("<!-- report:learn-in-minutes -->")[1].split("<!-- /report")[0]
    commands = [shlex.split(c)[1:] for c in re.findall(r"`(python \S+\.py [^`]+)`", section)]
    assert {c[0] for c in commands} == {s.strip("`").split()[0] for s, _, _ in report.SUMMARY_ROWS}, commands
    for script, *argv in commands:
        module = importlib.import_module(script.removesuffix(".py"))
        args = module.parse_args(argv)
        args = module.settled_args(args) if hasattr(module, "settled_args") else args  # as its open_run does
        world = {"cleanba_ppo_impala": 1, "apex_dqn": 1, "apex_ddpg": 1, "gala_a2c": getattr(args, "num_learners", 0)}
        extra = (world[module.__name__],) if module.__name__ in world else ()  # their validate takes the rank count
        assert module.validate(args, *extra) is None, (script, argv)
        if hasattr(module, "start_warnings"):
            assert module.start_warnings(args, 0) == [], (script, argv)
