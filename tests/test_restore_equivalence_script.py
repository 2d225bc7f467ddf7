import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))

import check_restore_equivalence  # noqa: E402


def test_restored_prefix_equals_l1_hit_on_cpu():
    assert check_restore_equivalence.main(["--model", "tiny", "--device", "cpu", "--prefix-tokens", "64",
                                           "--page-size", "4", "--iterations", "4"]) == 0
