"""What the tests of the scripts share: the scripts' folder, the CPU smoke flags, a script loaded as a module
(its main(argv) called in-process, no second interpreter start-up), and a refusal's one line."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = REPO / "scripts"
CPU = ["--model", "tiny", "--device", "cpu"]


def load(name: str):
    if str(SCRIPTS) not in sys.path:
        sys.path.insert(0, str(SCRIPTS))
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def refused(capsys, call, *args, code: int = 2) -> str:
    """`call(*args)` exits with `code` and a one-line `error:` on stderr, no traceback: that line."""
    with pytest.raises(SystemExit) as stopped:
        call(*args)
    assert stopped.value.code == code
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return next(line for line in err.splitlines() if "error:" in line)
