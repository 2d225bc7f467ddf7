"""The Quick start's scripts on a user's machine, not CI's fresh clone (session 79's hunt): scripts/setup.sh,
run.sh and test.sh in a checkout that was moved or copied, whose path has a `$`, whose .venv was cut short while
`python3 -m venv` ran, or whose .venv's interpreter is gone; and scripts/timeline.py without the editable install.

The scripts run for real in a copy under tmp_path; pip, pytest, ensurepip and the replay are stand-ins (a module on
PYTHONPATH, a stub replay_trace.py) that log which Python ran them (its sys.prefix): nothing is installed, nothing
leaves the machine. A `python` and a `pip` first on PATH stand for the system's: they log SYSTEM."""
from __future__ import annotations

import os
import shutil
import site
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
REAL_PYTHON = sys.executable

FAKE_PIP = """import os, sys
prefix = os.path.realpath(sys.prefix)
if sys.argv[1:] == ["--version"] and not os.path.exists(os.path.join(prefix, "pip-installed")):
    sys.exit("No module named pip")  # (a venv cut short before ensurepip finished)
with open(os.environ["FAKE_LOG"], "a") as log:
    log.write("pip\\t" + prefix + "\\t" + " ".join(sys.argv[1:]) + "\\n")
"""
FAKE_ENSUREPIP = """import os, sys
if not set(sys.argv[1:]) <= {"-U", "--upgrade", "--default-pip", "-v"}:
    sys.exit("python -m ensurepip: error: unrecognized arguments")  # (the real one's options; no -q)
prefix = os.path.realpath(sys.prefix)
open(os.path.join(prefix, "pip-installed"), "w").close()
with open(os.environ["FAKE_LOG"], "a") as log:
    log.write("ensurepip\\t" + prefix + "\\n")
"""
PRINT_PREFIX = "import os, sys\nprint('ran in', os.path.realpath(sys.prefix))\n"
SYSTEM = '#!/bin/sh\necho "SYSTEM $0 $*" >> "$FAKE_LOG"\n'
# `python3 -m venv ... DIR` made by the real venv module, without the (slow) ensurepip: FAKE_PIP stands for the
# pip it would install, bin/pip for its script (which names the venv's python by its absolute path, as pip's does)
PYTHON3 = f"""#!/bin/sh
echo "python3 $*" >> "$FAKE_LOG"
"{REAL_PYTHON}" "$@" --without-pip || exit
for arg; do dir=$arg; done
dir=$(cd "$dir" && pwd)
printf '#!/bin/sh\\nexec "%s/bin/python" -m pip "$@"\\n' "$dir" > "$dir/bin/pip"
chmod +x "$dir/bin/pip"
touch "$dir/pip-installed"
"""


def checkout(parent: Path, name: str = "hicache") -> Path:
    """A copy of what the Quick start's scripts read: scripts/*.sh, pyproject.toml, stub replay_trace.py."""
    root = parent / name
    (root / "scripts").mkdir(parents=True)
    for script in ("setup.sh", "run.sh", "test.sh"):
        shutil.copy(REPO / "scripts" / script, root / "scripts" / script)
    shutil.copy(REPO / "pyproject.toml", root / "pyproject.toml")
    (root / "scripts" / "replay_trace.py").write_text(PRINT_PREFIX)
    return root


@pytest.fixture
def env(tmp_path):
    fakes = tmp_path / "fakes"
    for module, main in (("pip", FAKE_PIP), ("ensurepip", FAKE_ENSUREPIP), ("pytest", PRINT_PREFIX)):
        (fakes / module).mkdir(parents=True)
        (fakes / module / "__init__.py").write_text("")
        (fakes / module / "__main__.py").write_text(main)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("python", SYSTEM), ("pip", SYSTEM), ("python3", PYTHON3)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    environ = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONHOME")}
    environ.update(PATH=f"{bin_dir}:{os.environ['PATH']}", PYTHONPATH=str(fakes), FAKE_LOG=str(tmp_path / "log"))
    return environ


def run(env: dict, root: Path, script: str, cwd: Path | None = None) -> tuple[subprocess.CompletedProcess, list]:
    """`bash ROOT/scripts/SCRIPT` from cwd (another directory by default); its result and the lines it logged."""
    log = Path(env["FAKE_LOG"])
    log.unlink(missing_ok=True)
    proc = subprocess.run(["bash", str(root / "scripts" / script)], cwd=cwd or root.parent, env=env,
                          capture_output=True, text=True, timeout=60)
    return proc, log.read_text().splitlines() if log.exists() else []


def venv(root: Path, with_pip: bool = True) -> Path:
    """ROOT/.venv made by the real venv module (bin/python a link to this interpreter), pip in it or not."""
    subprocess.run([REAL_PYTHON, "-m", "venv", "--without-pip", str(root / ".venv")], check=True, timeout=60)
    if with_pip:
        (root / ".venv" / "pip-installed").touch()
        pip = root / ".venv" / "bin" / "pip"
        pip.write_text(f'#!/bin/sh\nexec "{root / ".venv" / "bin" / "python"}" -m pip "$@"\n')
        pip.chmod(0o755)
    return root / ".venv"


def installs(lines: list[str]) -> list[str]:
    return [line for line in lines if line.startswith("pip\t") and line.split("\t")[2].startswith("install ")]


def assert_set_up_in(root: Path, proc: subprocess.CompletedProcess, lines: list[str]) -> None:
    """setup.sh exited 0 and every install went into ROOT/.venv (none into the system's Python), the project's too."""
    assert proc.returncode == 0, proc.stderr
    prefix = os.path.realpath(root / ".venv")
    assert [line for line in lines if line.startswith("SYSTEM")] == [], lines
    assert installs(lines) and all(line.split("\t")[1] == prefix for line in installs(lines)), lines
    assert any(line.endswith("install -q -e .[test]") for line in installs(lines)), lines


@pytest.mark.parametrize("name", ["hicache", "hi cache ü", "hi$HOME cache"])
def test_setup_from_another_directory_installs_into_the_checkouts_venv(env, tmp_path, name):
    """regression: in a checkout whose path has a `$` ("hi$HOME cache"), bin/activate (Python 3.11's writes its
    directory in double quotes) put "hi/root cache/.venv/bin" on PATH: pip and the project went into the system's
    Python, and run.sh ran that Python."""
    root = checkout(tmp_path, name)
    proc, lines = run(env, root, "setup.sh")
    assert_set_up_in(root, proc, lines)
    proc, _ = run(env, root, "run.sh")
    assert proc.returncode == 0 and proc.stdout.strip() == f"ran in {os.path.realpath(root / '.venv')}", proc


def test_a_moved_checkout_sets_up_and_runs_in_its_own_venv(env, tmp_path):
    """regression: after `mv hicache hicache-old` setup.sh sourced .venv/bin/activate, which names the directory the
    venv was made in: PATH's first entry no longer existed, so setup.sh upgraded the system's pip, found (or
    installed) torch there and skipped the project (its stamp was in .venv); run.sh then ran the system's Python:
    "No module named 'redis'", on every run after. The editable install (its finder names the old path) is made
    again for the new one."""
    root = checkout(tmp_path)
    venv(root)
    proc, lines = run(env, root, "setup.sh")
    assert_set_up_in(root, proc, lines)
    moved = root.rename(tmp_path / "hicache-old")
    proc, lines = run(env, moved, "setup.sh")
    assert_set_up_in(moved, proc, lines)
    for script in ("run.sh", "test.sh"):
        proc, lines = run(env, moved, script)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.splitlines()[-1] == f"ran in {os.path.realpath(moved / '.venv')}", (script, proc.stdout)
        assert [line for line in lines if line.startswith("SYSTEM")] == [], (script, lines)


def test_a_venv_cut_short_while_python3_m_venv_ran_is_repaired(env, tmp_path):
    """regression: setup.sh stopped (Ctrl-C) while `python3 -m venv .venv` ran ensurepip left bin/python but
    neither pip nor bin/activate (venv writes it last): every setup.sh, run.sh and test.sh after failed with
    ".venv/bin/activate: No such file or directory". pip is brought in by ensurepip, into that venv."""
    root = checkout(tmp_path)
    for activate in venv(root, with_pip=False).glob("bin/activate*"):
        activate.unlink()
    proc, lines = run(env, root, "setup.sh", cwd=root)
    assert f"ensurepip\t{os.path.realpath(root / '.venv')}" in lines, (lines, proc.stderr)
    assert_set_up_in(root, proc, lines)


def test_a_venv_whose_interpreter_is_gone_is_made_again(env, tmp_path):
    """regression: a .venv whose python links to an interpreter since removed (pyenv uninstall, a distribution's
    upgrade from 3.11 to 3.12, a .venv copied from another machine): `python3 -m venv .venv` over it failed
    ("[Errno 2] No such file or directory: '.venv/bin/python3'"), on every run. Made again, the stamp of what the
    old one held goes with it: the project is installed into the new one."""
    root = checkout(tmp_path)
    old = venv(root)
    proc, _ = run(env, root, "setup.sh")
    assert proc.returncode == 0 and list(old.glob(".setup-*")), proc.stderr
    (old / "bin" / "python").unlink()
    (old / "bin" / "python").symlink_to(tmp_path / "removed" / "python3.10")
    proc, lines = run(env, root, "setup.sh")
    assert "python3 -m venv --clear .venv" in lines, (lines, proc.stderr)
    assert_set_up_in(root, proc, lines)
    assert len(list(old.glob(".setup-*"))) == 1


def test_timeline_script_runs_without_the_editable_install(tmp_path):
    """regression: scripts/timeline.py alone of the scripts did not put the checkout on sys.path: with the deps but
    not the editable install (or one naming a checkout since moved) it failed "No module named 'scheduler'"."""
    # site-packages through PYTHONPATH, without site: the deps import, the editable install's .pth is not read
    deps = os.pathsep.join(site.getsitepackages())
    environ = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([REAL_PYTHON, "-S", str(REPO / "scripts" / "timeline.py"), "--help"], cwd=tmp_path,
                          env={**environ, "PYTHONPATH": deps}, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "usage: timeline.py" in proc.stdout, proc.stderr
