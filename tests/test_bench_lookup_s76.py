"""Session 76: scripts/bench_speculative.py fills a prompt-lookup bound left out from the other, as
--speculative-config and SpeculativeConfig do (vLLM's filling, session 75). `--prompt-lookup-max 8` alone benched
lookups of 4..8 tokens where the server's same setting looks up 8..8, and `--prompt-lookup-min 6` alone was refused
(min 6 above the bench's own max of 4). Neither given: the bench's 4..4, as before."""
from __future__ import annotations

import pytest

from script_helpers import CPU, load

SPEC = [*CPU, "--batches", "1", "--drafts", "1", "--context", "32", "--prompt-tokens", "32", "--block-tokens", "8",
        "--repeats", "1", "--max-tokens", "4"]


@pytest.mark.parametrize("flags, bounds", [
    (["--prompt-lookup-max", "8"], (8, 8)),
    (["--prompt-lookup-min", "6"], (6, 6)),
    (["--prompt-lookup-min", "2", "--prompt-lookup-max", "7"], (2, 7)),
    ([], (4, 4)),
])
def test_a_lookup_bound_left_out_takes_the_others_value(flags, bounds):
    spec = load("bench_speculative").parse_args([*SPEC, *flags]).spec
    assert (spec.prompt_lookup_min, spec.prompt_lookup_max) == bounds
