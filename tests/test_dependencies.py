"""Every third-party package that a script, a benchmark or a test imports is declared in `pyproject.toml`, in the
place that installs it for that code: the scripts and `common/` in `dependencies` (or, behind a flag, in an extra of
SCRIPT_EXTRAS: `--track`'s wandb), `benchmarks/` in the `bench` extra, and `tests/` in the `test` extra (the suite
runs the benchmark tools, so `test` must cover their imports too).

Imports are read as syntax (every `import` statement, at any depth, including those inside functions), so a package
that is missing from this machine is still found. Import names map to distribution names through the installed
metadata, falling back to a table of the well-known names that differ."""

import ast
import functools
import importlib.metadata
import re
import sys
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from Python 3.11")

ROOT = Path(__file__).resolve().parents[1]

# import name -> distribution name, for packages whose names differ and that may not be installed here
KNOWN_DISTRIBUTIONS = {
    "cv2": "opencv-python-headless",
    "yaml": "pyyaml",
    "PIL": "pillow",
    "sklearn": "scikit-learn",
    "skimage": "scikit-image",
    "google": "protobuf",
    "wandb": "wandb",
}
# extras a script may import from behind its own flag (inside the function the flag reaches, never at module level):
# `--track` needs wandb, from `pip install -e ".[track]"`
SCRIPT_EXTRAS = ("track",)
# distributions that provide the same import; declaring any one of them covers it
ALTERNATIVES = {"opencv-python-headless": {"opencv-python", "opencv-contrib-python", "opencv-contrib-python-headless"}}


def normalize(dist: str) -> str:
    """PEP 503 name normalization: case-insensitive, runs of '-', '_', '.' are one '-'."""
    return re.sub(r"[-_.]+", "-", dist).lower()


def declared(pyproject: dict) -> dict[str, set[str]]:
    """Normalized distribution names installed by `dependencies` ("core") and by each extra, with the extras a
    requirement such as `actorlearners[bench]` pulls in resolved."""
    project = pyproject["project"]
    name = normalize(project["name"])
    groups = {"core": project.get("dependencies", []), **project.get("optional-dependencies", {})}
    own_extras: dict[str, list[str]] = {}
    direct: dict[str, set[str]] = {}
    for group, reqs in groups.items():
        direct[group], own_extras[group] = set(), []
        for req in reqs:
            m = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[([^\]]*)\])?", req)
            dist = normalize(m.group(1))
            if dist == name:
                own_extras[group] += [e.strip() for e in (m.group(2) or "").split(",") if e.strip()]
            else:
                direct[group].add(dist)

    def resolve(group: str, seen: frozenset = frozenset()) -> set[str]:
        out = set(direct[group])
        for extra in own_extras[group]:
            if extra not in seen:
                out |= resolve(extra, seen | {group})
        return out

    return {group: resolve(group) | (set() if group == "core" else resolve("core")) for group in groups}


def third_party_imports(files: list[Path], local: set[str]) -> dict[str, set[str]]:
    """Top-level import name -> the files (relative to their root) that import it, leaving out the standard library,
    relative imports and the repository's own modules."""
    found: dict[str, set[str]] = {}
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for top in {n.split(".")[0] for n in names}:
                if top not in sys.stdlib_module_names and top != "__future__" and top not in local:
                    found.setdefault(top, set()).add(path.name)
    return found


@functools.cache
def installed_distributions() -> dict[str, list[str]]:
    return importlib.metadata.packages_distributions()


def distribution_of(import_name: str) -> set[str]:
    """The normalized distributions that may provide `import_name`."""
    installed = installed_distributions().get(import_name)
    if installed:
        dists = {normalize(d) for d in installed}
    else:
        dists = {normalize(KNOWN_DISTRIBUTIONS.get(import_name, import_name))}
    return dists | {a for d in dists for a in ALTERNATIVES.get(d, set())}


def undeclared_imports(root: Path) -> list[str]:
    """One line per third-party import that the extra installing its file does not declare."""
    pyproject = tomllib.loads((root / "pyproject.toml").read_text())
    groups = declared(pyproject)
    places = {
        "core": sorted(root.glob("*.py")) + sorted((root / "common").glob("*.py")),
        "bench": sorted((root / "benchmarks").glob("*.py")),
        "test": sorted((root / "tests").glob("*.py")) + sorted((root / "benchmarks").glob("*.py")),
    }
    # the repository's own importable names: top-level scripts, its packages and the modules inside tests/ and
    # benchmarks/ (each is put on sys.path by the code that uses it)
    local = {"common", "benchmarks", "tests"}
    local |= {p.stem for p in [*root.glob("*.py"), *(root / "tests").glob("*.py"), *(root / "benchmarks").glob("*.py")]}
    problems = []
    for group, files in places.items():
        allowed = set(groups.get(group, groups["core"]))
        if group == "core":
            allowed |= set().union(*(groups.get(extra, set()) for extra in SCRIPT_EXTRAS))
        for name, users in sorted(third_party_imports(files, local).items()):
            dists = distribution_of(name)
            if not dists & allowed:
                problems.append(
                    f"`import {name}` in {', '.join(sorted(users))}: distribution {' or '.join(sorted(dists))} "
                    f"is not declared for the '{group}' install"
                )
    return problems


def test_every_third_party_import_is_declared():
    assert undeclared_imports(ROOT) == []


def write_project(root: Path, bench: list[str], test: list[str], files: dict[str, str]) -> None:
    (root / "benchmarks").mkdir()
    (root / "tests").mkdir()
    (root / "common").mkdir()
    extras = f"bench = {bench!r}\ntest = {test!r}\n".replace("'", '"')
    (root / "pyproject.toml").write_text(
        f'[project]\nname = "demo"\ndependencies = ["numpy>=1", "torch"]\n[project.optional-dependencies]\n{extras}'
    )
    for rel, text in files.items():
        (root / rel).write_text(text)


def test_checker_finds_an_undeclared_benchmark_import(tmp_path):
    """The failure this test exists for: a benchmark imports scipy (inside a function, as a lazy import) and no extra
    declares it; the suite, which runs that benchmark, fails on a fresh machine."""
    write_project(
        tmp_path,
        bench=["matplotlib"],
        test=["demo[bench]", "pytest"],
        files={
            "script.py": "import numpy as np\nimport torch.nn\nfrom common import models\n",
            "common/models.py": "import torch\n",
            "benchmarks/straggler.py": "import matplotlib\n\ndef f():\n    from scipy.stats import gamma\n",
            "tests/test_x.py": "import pytest\nimport script\nfrom helpers import run\n",
            "tests/helpers.py": "import os\n",
        },
    )
    problems = undeclared_imports(tmp_path)
    assert len(problems) == 2, problems  # once for the bench install, once for the test install
    assert all("`import scipy`" in p and "straggler.py" in p for p in problems)
    assert {p.rsplit("'", 2)[1] for p in problems} == {"bench", "test"}


def test_checker_maps_import_names_and_places(tmp_path):
    """cv2 is declared as opencv-python-headless; yaml needs PyYAML, not 'yaml'; a test-only package declared only
    for tests is fine in tests but not in a script; an extra pulled in through `demo[bench]` counts for tests."""
    write_project(
        tmp_path,
        bench=["opencv-python-headless", "scipy"],
        test=["demo[bench]", "pytest", "yaml"],
        files={
            "script.py": "import pytest\n",
            "benchmarks/env.py": "import cv2\n",
            "tests/test_x.py": "import pytest\nimport scipy\nimport yaml\nimport cv2\n",
        },
    )
    problems = undeclared_imports(tmp_path)
    assert len(problems) == 2, problems
    assert any("`import pytest` in script.py" in p and "'core'" in p for p in problems)
    assert any("`import yaml`" in p and "pyyaml" in p and "'test'" in p for p in problems)
