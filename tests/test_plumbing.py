"""The run plumbing is one section at the end of every script, and the same text wherever the behaviour is the same.

Every script ends with a section that starts with the `# ---- run plumbing` banner: validation, the run directory,
tracking, checkpoints, --eval-only, signals, supervision and error lines. A function or class defined there that two
or more scripts have must be the same text in all of them, so a fix made in one script is copied to every other; the
failure names each script and function that drifted from the majority. The names in SCRIPT_SPECIFIC differ by design.
The algorithm has a contract too: the `# ---- Algorithm` section (losses, returns, updates) uses only what it computes
with. Stop events, torchrun ranks and all-reduces, the finite check, locks, checkpoint writes and test hooks belong to
the learner loop, and no plumbing name is defined above the banner.
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
    "write_checkpoint": "what the script's checkpoint holds (its learner's state)",
    "settled_args": "the defaults that depend on another flag (cleanba's per-algorithm ones, impala's buffers)",
    "steps_per_update": "the agent steps of one update, the unit of the budget's arithmetic",
    "init_torch": "the process's seed, threads and device (cleanba: its torchrun process group, before the model)",
}

# Plumbing that one script alone has, each for the reason given; any other plumbing name is shared by two scripts or
# more (and then the same text in all of them).
SCRIPT_ONLY = {
    "check_resume_world_size": "cleanba: a checkpoint holds every rank's actor state, so a resume keeps the world size",
    "ranks_agree": "cleanba: the only script whose ranks must agree on a flag value before they start",
    "averaged_model": "gala: the final model is the average of the learners' parameters (Sec. 4), built at the end",
    "ignored_flags": "impala: the flags that TorchBeast has and that this script accepts without effect",
    "stop_threads_and_actors": "impala: the learner and inference threads end before the actors that feed them",
    "wait_for_actors": "impala: main's watch alone blocks on the child processes' sentinels (the others on queues)",
    "Watch": "a3c: main's record of the workers' updates on log_q, its checkpoints (or the server's) and its watch",
    "shut_down": "a3c: the gradient server applies the gradients queued before the stop and writes the checkpoint",
    "stop_actors": "cleanba: main's stop joins its actor threads, then (a finished run of several ranks) ranks_agree",
    "record_update": "cleanba: the learner loop's update, recorded with its queue waits on the console line",
    "checkpoint_state": "cleanba: a copy taken between updates, since a stop may cut the next update half way",
    "Logger": "gala: each learner's Record (its own SPS, staleness and peer lag) into the run's Recorder",
    "Monitor": "gala: main's side of the learners' queues, and checkpoints assembled from every learner's state",
    "timed": "gala: the parts of a learner process's iteration, summed per iteration for its Record",
    "drain_while": "a3c: main takes the workers' reports until they exit (a queued message holds a process's exit)",
    "free_port": "gala: the allreduce learners of one machine meet at a gloo rendezvous on a free localhost port",
}

# Algorithm helpers that several scripts define under one name though they differ by design, each for the reason
# given. Any other function or class that two scripts define in their `# ---- Algorithm` sections is one text in both
# (`vtrace`, `gae`, `n_step_returns`, `a2c_loss`, `impala_loss`, `gradient_step`, `sample_actions`, ...): a change
# pasted from one script into another means the same there. Where two computations truly differ, their names say how
# (hts_ppo's `ppo_loss_value_clipped` beside cleanba's `ppo_loss`, HTS-RL's `sample_actions_from_uniforms` beside the
# Gumbel-max `sample_actions`, Ape-X's `double_q_td_errors` and `critic_td_errors`).
ALGORITHM_DIFFERENT = {
    "make_optimizer": "each paper's optimizer and its settings (RMSprop, Adam; GALA's per-learner learning rate)",
    "Learner": "Ape-X's learner step (Algorithm 2) around each script's update: DQN's double Q, DDPG's actor-critic",
}

# Names the algorithm section may not use (as a name, attribute, argument or keyword), and where each belongs instead.
NOT_IN_ALGORITHM = {
    "stop": "a stop event: the learner loop checks it between steps",
    "Stop": "a stop: the learner loop raises and catches it",
    "signals": "signal handling: the run's plumbing",
    "NonFiniteLoss": "the finite check: the learner loop makes it before the update's parameters are used",
    "world_size": "torchrun ranks: the learner loop all-reduces",
    "rank": "torchrun ranks: the learner loop all-reduces",
    "all_reduce": "torchrun ranks: the learner loop all-reduces",
    "dist": "torch.distributed: the learner loop",
    "hold": "a lock helper: the processes that share the buffer",
    "LockTimeout": "a lock helper: the processes that share the buffer",
    "Lock": "a lock: the processes or threads that share the state",
    "learner_delay": "a test hook: the learner loop",
    "atomic_save": "a checkpoint write: the learner loop",
    "save": "a checkpoint write: the learner loop",
    "writer": "recording: the learner loop",
}

# Every script has these, in its plumbing section, as the same text.
EVERY_SCRIPT = (
    "Stop", "Interrupted", "NonFiniteLoss", "WriteError", "StopSignals", "fail", "flag", "check_flags", "parse_args",
    "new_run_dir", "write_run_args", "start_tracking", "finish_tracking", "make_writer", "quiet_writer_thread",
    "write_error", "atomic_save", "duration", "Progress", "help_paragraphs", "resumed_args", "load_checkpoint",
    "main_eval_only", "error_line", "final_evaluation", "leave", "flag_warnings", "Console", "Run",
    "open_run", "stop_if_signalled", "planned_updates",
)  # fmt: skip


def plumbing_of(text: str) -> tuple[int, dict[str, str]]:
    """The banner's line number and {name: source text} of every top-level function and class defined after it."""
    lines = text.splitlines()
    starts = [i for i, line in enumerate(lines, 1) if line.startswith(BANNER)]
    assert len(starts) == 1, f"{len(starts)} `{BANNER}` banners (one section, at the end)"
    tree = ast.parse(text)
    defs = (n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef)) and n.lineno > starts[0])
    return starts[0], {n.name: ast.get_source_segment(text, n) for n in defs}


def algorithm_of(text: str) -> dict[str, str]:
    """{name: source text} of every top-level function and class of the `# ---- Algorithm` section."""
    first, last = section_lines(text, "Algorithm")
    nodes = (n for n in ast.parse(text).body if isinstance(n, (ast.FunctionDef, ast.ClassDef)))
    return {n.name: ast.get_source_segment(text, n) for n in nodes if first <= n.lineno <= last}


def drift(texts: dict[str, str], section=lambda text: plumbing_of(text)[1], differ=SCRIPT_SPECIFIC) -> list[str]:
    """For each name that several scripts define in `section` (by default the plumbing) and that is not in `differ`:
    one line per script whose text differs from the text most scripts share, naming the script and the function, with
    the first lines of the difference."""
    by_name: dict[str, dict[str, str]] = collections.defaultdict(dict)
    for script, text in texts.items():
        for name, source in section(text).items():
            by_name[name][script] = source
    problems = []
    for name, sources in sorted(by_name.items()):
        if name in differ or len(sources) < 2:
            continue
        majority, _ = collections.Counter(sources.values()).most_common(1)[0]
        for script, source in sorted(sources.items()):
            if source != majority:
                diff = difflib.unified_diff(majority.splitlines(), source.splitlines(), lineterm="", n=0)
                shown = [line for line in diff if line[:1] in "+-" and line[:3] not in ("+++", "---")][:4]
                problems.append(f"{script}: `{name}` differs from the other scripts' text: " + " | ".join(shown))
    return problems


def section_lines(text: str, title: str) -> tuple[int, int]:
    """The first and last line of the `# ---- {title}` section: up to the next `# ---- ` banner."""
    lines = text.splitlines()
    heads = [i for i, line in enumerate(lines, 1) if line.startswith("# ---- ")]
    start = next(i for i in heads if lines[i - 1].startswith(f"# ---- {title} "))
    return start, min([i for i in heads if i > start], default=len(lines) + 1) - 1


def contract_breaches(text: str) -> list[str]:
    """Each use of a NOT_IN_ALGORITHM name in the algorithm section, as `line N: name (where it belongs)`."""
    first, last = section_lines(text, "Algorithm")
    found = set()
    for node in ast.walk(ast.parse(text)):
        if not first <= getattr(node, "lineno", 0) <= last:
            continue
        name = {ast.Name: "id", ast.Attribute: "attr", ast.arg: "arg", ast.keyword: "arg"}.get(type(node))
        if name and getattr(node, name) in NOT_IN_ALGORITHM:
            found.add((node.lineno, getattr(node, name)))
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)) and node.name in NOT_IN_ALGORITHM:
            found.add((node.lineno, node.name))
    return [f"line {n}: {name} ({NOT_IN_ALGORITHM[name]})" for n, name in sorted(found)]


def misplaced_plumbing(texts: dict[str, str]) -> list[str]:
    """A plumbing name (one that some script defines after its banner, or one every script has) defined above a
    script's banner; and a plumbing name that one script alone has and SCRIPT_ONLY does not give a reason for."""
    defined_in: dict[str, set[str]] = collections.defaultdict(set)
    for script, text in texts.items():
        defined_in.update({name: defined_in[name] | {script} for name in plumbing_of(text)[1]})
    problems = [
        f"{next(iter(s))}: `{name}` is plumbing that this script alone has; share it, or give SCRIPT_ONLY its reason"
        for name, s in sorted(defined_in.items())
        if len(s) == 1 and name not in SCRIPT_ONLY
    ]
    for script, text in sorted(texts.items()):
        start = plumbing_of(text)[0]
        for node in ast.parse(text).body:
            name = getattr(node, "name", None)
            if node.lineno < start and (name in defined_in or name in EVERY_SCRIPT):
                problems.append(f"{script}: `{name}` is plumbing, defined above the banner (line {node.lineno})")
    return problems


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_the_algorithm_section_uses_only_what_it_computes_with(script):
    breaches = contract_breaches(script.read_text())
    assert not breaches, f"{script.name}, algorithm section:\n" + "\n".join(breaches)


def test_no_plumbing_above_the_banner_and_every_script_only_helper_has_a_reason():
    problems = misplaced_plumbing({p.name: p.read_text() for p in SCRIPTS})
    assert not problems, "\n".join(problems)


def test_the_contract_checks_name_a_breach_in_an_edited_copy():
    """The checks themselves can fail: a finite check put back into a loss, a stop event given to it, a plumbing
    helper moved above the banner, and a new helper in one script's plumbing are each named."""
    texts = {p.name: p.read_text() for p in SCRIPTS}
    hts = texts["hts_a2c.py"]
    loss = ast.get_source_segment(hts, next(n for n in ast.parse(hts).body if getattr(n, "name", "") == "a2c_loss"))
    checked = loss.replace("    return {", "    if not torch.isfinite(total_loss):\n        raise NonFiniteLoss()\n"
                                          "    return {", 1)  # fmt: skip
    breaches = contract_breaches(hts.replace(loss, checked))
    assert len(breaches) == 1 and breaches[0].endswith(": NonFiniteLoss (" + NOT_IN_ALGORITHM["NonFiniteLoss"] + ")")
    given = loss.replace("ent_coef: float)", "ent_coef: float, stop=None)", 1)
    assert [b.split(": ", 1)[1] for b in contract_breaches(hts.replace(loss, given))] == [
        f"stop ({NOT_IN_ALGORITHM['stop']})"
    ]
    start, defs = plumbing_of(hts)
    moved = hts.replace(defs["fail"], "").replace("# ---- Algorithm", defs["fail"] + "\n\n\n# ---- Algorithm")
    line = moved.splitlines().index("def fail(message: str) -> NoReturn:") + 1
    assert misplaced_plumbing(texts | {"hts_a2c.py": moved}) == [
        f"hts_a2c.py: `fail` is plumbing, defined above the banner (line {line})"
    ]
    extra = hts + "\n\ndef our_helper():\n    pass\n"
    assert misplaced_plumbing(texts | {"hts_a2c.py": extra}) == [
        "hts_a2c.py: `our_helper` is plumbing that this script alone has; share it, or give SCRIPT_ONLY its reason"
    ]


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


def test_an_algorithm_helper_is_one_text_wherever_it_has_its_name():
    texts = {p.name: p.read_text() for p in SCRIPTS}
    problems = drift(texts, algorithm_of, ALGORITHM_DIFFERENT)
    assert not problems, "one name, one text (or a name that says how it differs):\n" + "\n".join(problems)


def test_an_algorithm_helper_changed_by_one_character_in_one_script_is_named():
    """The check itself can fail: one character changed in GALA's copy of the n-step returns (a discount of 2 - d) is
    reported with the script's and the function's name."""
    texts = {p.name: p.read_text() for p in SCRIPTS}
    source = algorithm_of(texts["gala_a2c.py"])["n_step_returns"]
    edited = source.replace("not_done = 1.0 - dones", "not_done = 2.0 - dones", 1)
    assert sum(a != b for a, b in zip(source, edited, strict=True)) == 1
    texts["gala_a2c.py"] = texts["gala_a2c.py"].replace(source, edited)
    assert drift(texts, algorithm_of, ALGORITHM_DIFFERENT) == [
        "gala_a2c.py: `n_step_returns` differs from the other scripts' text: "
        "-    not_done = 1.0 - dones.to(rewards.dtype) | +    not_done = 2.0 - dones.to(rewards.dtype)"
    ]
