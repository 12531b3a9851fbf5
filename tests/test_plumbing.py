"""The run plumbing is one section at the end of every script, and the same text wherever the behaviour is the same.

Every script ends with a section that starts with the `# ---- run plumbing` banner: validation, the run directory,
tracking, checkpoints, --eval-only, signals, supervision and error lines. A function or class defined there that two
or more scripts have must be the same text in all of them, so a fix made in one script is copied to every other; the
failure names each script and function that drifted from the majority. The names in SCRIPT_SPECIFIC differ by design.
These tests read the files as text and syntax trees: nothing is imported or run."""

import ast
import collections
import difflib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(p for p in ROOT.glob("*.py") if "\nclass Args" in p.read_text())
BANNER = "# ---- run plumbing"

# Plumbing that differs between scripts by design, each for the reason given.
SCRIPT_SPECIFIC = {
    "validate": "the cross-flag checks of the script's own flags (the per-flag rules are FLAG_RULES)",
    "env_spaces": "which env the script probes and which action spaces it can train on",
    "checkpoint_meta": "what a checkpoint must share with the run that resumes it",
    "saved_model": "how the script builds its model from the saved run's settings",
    "evaluate": "how the script's policy picks an action in the end-of-run evaluation",
}

# Every script has these, in its plumbing section, as the same text.
EVERY_SCRIPT = (
    "Stop", "Interrupted", "NonFiniteLoss", "WriteError", "StopSignals", "fail", "flag", "check_flags", "parse_args",
    "new_run_dir", "write_run_args", "start_tracking", "finish_tracking", "make_writer", "quiet_writer_thread",
    "write_error", "atomic_save", "duration", "Progress", "help_paragraphs", "resumed_args", "load_checkpoint",
    "main_eval_only", "error_line", "finish_run", "final_evaluation", "leave", "flag_warnings",
)  # fmt: skip


def plumbing_of(text: str) -> tuple[int, dict[str, str]]:
    """The banner's line number and {name: source text} of every top-level function and class defined after it."""
    lines = text.splitlines()
    starts = [i for i, line in enumerate(lines, 1) if line.startswith(BANNER)]
    assert len(starts) == 1, f"{len(starts)} `{BANNER}` banners (one section, at the end)"
    tree = ast.parse(text)
    defs = (n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.lineno > starts[0])
    return starts[0], {n.name: ast.get_source_segment(text, n) for n in defs}


def drift(texts: dict[str, str]) -> list[str]:
    """For each plumbing name that several scripts define and that is not script-specific: one line per script whose
    text differs from the text most scripts share, naming the script and the function, with the first lines of the
    difference."""
    by_name: dict[str, dict[str, str]] = collections.defaultdict(dict)
    for script, text in texts.items():
        for name, source in plumbing_of(text)[1].items():
            by_name[name][script] = source
    problems = []
    for name, sources in sorted(by_name.items()):
        if name in SCRIPT_SPECIFIC or len(sources) < 2:
            continue
        majority, _ = collections.Counter(sources.values()).most_common(1)[0]
        for script, source in sorted(sources.items()):
            if source != majority:
                diff = difflib.unified_diff(majority.splitlines(), source.splitlines(), lineterm="", n=0)
                shown = [line for line in diff if line[:1] in "+-" and line[:3] not in ("+++", "---")][:4]
                problems.append(f"{script}: `{name}` differs from the other scripts' text: " + " | ".join(shown))
    return problems


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_the_plumbing_is_one_section_after_main(script):
    text = script.read_text()
    start, defs = plumbing_of(text)
    tree = ast.parse(text)
    main = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "main")
    assert main.lineno < start, f"{script.name}: main (line {main.lineno}) must come before the plumbing ({start})"
    missing = [name for name in (*EVERY_SCRIPT, "validate") if name not in defs]
    assert not missing, f"{script.name}: not in the plumbing section: {', '.join(missing)}"
    above = [n.name for n in tree.body if getattr(n, "name", None) in EVERY_SCRIPT and n.lineno < start]
    assert not above, f"{script.name}: plumbing defined above the banner: {', '.join(above)}"


def test_plumbing_is_the_same_text_in_every_script():
    problems = drift({p.name: p.read_text() for p in SCRIPTS})
    assert not problems, "change it in every script (CONTRIBUTING.md):\n" + "\n".join(problems)


def test_drift_in_one_script_is_named():
    """The check itself can fail: one edited line in one copy of a shared function is reported with the script's and
    the function's name, and a script-specific function is not."""
    texts = {p.name: p.read_text() for p in SCRIPTS}
    victim = SCRIPTS[len(SCRIPTS) // 2].name
    source = plumbing_of(texts[victim])[1]["atomic_save"]
    texts[victim] = texts[victim].replace(source, source.replace("os.fsync(f.fileno())", "pass"))
    assert drift(texts) == [f"{victim}: `atomic_save` differs from the other scripts' text: "
                            f"-            os.fsync(f.fileno()) | +            pass"]  # fmt: skip
    source = plumbing_of(texts[victim])[1]["validate"]
    texts[victim] = texts[victim].replace(source, source + "\n    # an edit")
    assert len(drift(texts)) == 1
