"""The project as a user installs it: a wheel built from the sources, installed (not editable), run from a
directory outside the checkout with the checkout off sys.path. Whatever the code opens beside its modules must be
in that wheel (regression: `hicache-replay` with no --trace, the README's default run, looked for the bundled
sample trace in site-packages/data/ and exited "cannot read trace")."""
from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PACKAGES = ("hicache", "kernels", "scheduler")


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """site-packages-like directory holding the installed wheel (its path is what PYTHONPATH gets below)."""
    setuptools = pytest.importorskip("setuptools")  # the build backend pyproject names, built without isolation
    if tuple(int(x) for x in setuptools.__version__.split(".")[:2]) < (70, 1):  # (older: bdist_wheel needs `wheel`)
        pytest.skip(f"setuptools {setuptools.__version__} builds no wheel without the `wheel` package")
    root = tmp_path_factory.mktemp("wheel")
    src = root / "src"  # a copy, so the build's build/ and egg-info stay out of the checkout
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    for name in PACKAGES:
        shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input"]
    subprocess.run(pip + ["wheel", "-q", "--no-deps", "--no-build-isolation", "--no-index", "-w", str(root / "dist"),
                          str(src)], check=True, cwd=root, capture_output=True, timeout=240)
    (wheel,) = (root / "dist").glob("hicache-*.whl")
    site = root / "site"
    with zipfile.ZipFile(wheel) as zf:  # what `pip install` would lay down (no console scripts needed here)
        zf.extractall(site)
    return site


def _run_installed(site: Path, cwd: Path, *args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PYTHONPATH"] = str(site)  # the installed copy only: not the checkout
    env["TRITON_INTERPRET"] = "1"
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=240)


def test_the_installed_packages_find_the_bundled_sample_trace(installed, tmp_path):
    proc = _run_installed(installed, tmp_path, "-c",
                          "import scheduler; from scheduler.replay_args import SAMPLE_TRACE; "
                          "print(scheduler.__file__); print(SAMPLE_TRACE); print(SAMPLE_TRACE.is_file())")
    assert proc.returncode == 0, proc.stderr
    module, trace, found = proc.stdout.split()
    assert Path(module).is_relative_to(installed)  # the wheel's copy ran, not the checkout's
    assert found == "True", f"{trace} is not in the wheel"


def test_the_installed_replay_runs_the_bundled_sample_from_another_directory(installed, tmp_path):
    proc = _run_installed(installed, tmp_path, "-m", "scheduler.replay", "--simulate", "--max-requests", "5",
                          "--no-progress")
    assert proc.returncode == 0, proc.stderr
    assert "cannot read trace" not in proc.stderr
    assert "sample_trace.jsonl" in proc.stderr and "passed" in proc.stdout  # the sample replayed, its integrity
    assert list(tmp_path.iterdir()) == []  # and nothing written into the cwd


def test_the_server_command_line_runs_under_python_OO(tmp_path):
    """PYTHONOPTIMIZE=2 (`python -OO`, set in some images to shed docstrings) strips every __doc__ (regression:
    hicache-serve built its --help description from the server module's docstring and died on None at start)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-OO", "-m", "scheduler.server", "--help"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "--model" in proc.stdout


def test_every_docstring_compiles_on_python_3_13():
    """From CPython 3.13 the compiler dedents a docstring through strict UTF-8, so a module whose docstring holds a
    lone surrogate (a non-raw "\\ud800" in its prose) raises UnicodeEncodeError at import (cpython#142411;
    regression: on 3.13, which requires-python admits, `import scheduler.server` and so hicache-serve died)."""
    bad = []
    for path in sorted(p for name in PACKAGES for p in (REPO / name).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
                doc = ast.get_docstring(node, clean=False) or ""
                try:
                    doc.encode("utf-8")
                except UnicodeEncodeError:
                    bad.append(f"{path.relative_to(REPO)}:{getattr(node, 'lineno', 1)}")
    assert bad == []


def test_every_third_party_import_is_a_declared_dependency():
    """What the packages import is what the wheel's metadata asks pip for (regression: pydantic, whose v2 API the
    request models need, starlette and jinja2 came only through fastapi's and torch's requirements: fastapi>=0.110
    lets pydantic 1 in)."""
    import re
    import tomllib
    from importlib.metadata import packages_distributions

    def norm(name: str) -> str:
        return name.lower().replace("_", "-")
    declared = {norm(re.split(r"[<>=!~\[; ]", d, maxsplit=1)[0])
                for d in tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]}
    declared.add("pydantic-core")  # (pydantic's own, pinned by it to its exact version)
    dists = packages_distributions()
    undeclared = set()
    for path in (p for name in PACKAGES for p in (REPO / name).rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else []
            for top in {n.split(".")[0] for n in names} - set(sys.stdlib_module_names) - set(PACKAGES):
                if not any(norm(d) in declared for d in dists.get(top, [top])):
                    undeclared.add(f"{top} ({path.relative_to(REPO)})")
    assert sorted(undeclared) == []
