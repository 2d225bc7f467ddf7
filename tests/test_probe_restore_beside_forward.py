"""scripts/probe_restore_beside_forward.py on the CPU: its variants parse, bad ones and a machine
without a GPU are refused before any engine is built (the timing itself needs the GPU)."""
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

import probe_restore_beside_forward as probe  # noqa: E402


def test_variants_parse_to_a_kind_and_a_program_count():
    assert probe.parse_variant("plain") == ("plain", 0)
    assert probe.parse_variant("flags_set") == ("flags_set", 0)
    assert probe.parse_variant("dma") == ("dma", 0)
    assert probe.parse_variant("kernel64") == ("kernel", 64)
    for bad in ("kernel", "kernel0", "kernelx", "copy16"):
        with pytest.raises(ValueError, match="unknown variant"):
            probe.parse_variant(bad)


def test_bad_variants_and_no_gpu_are_refused(monkeypatch, capsys):
    with pytest.raises(SystemExit):
        probe.main(["--variants", "plain,copy16"])
    assert "unknown variant 'copy16'" in capsys.readouterr().err
    monkeypatch.setattr(probe.torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit):
        probe.main(["--variants", "plain,kernel16"])
    assert "needs a GPU" in capsys.readouterr().err
