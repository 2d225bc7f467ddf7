"""The kernels package's one CPU-reachable partial branch that is a rule (session 72's branch-coverage hunt, area api):
the direct launcher keys a bool or float argument by its type and value (kernels/direct_launch.py `_variant`).

A bool is an int to Python, but the JIT types it as i1, not i32: keyed as the int it equals, a call with True after
one with 1 would reuse the kernel compiled for an int32 argument; so would a float, 32.0 after 32 (the JIT types it
fp32), were it keyed by an int's width and specialisation. The launcher is driven by test_direct_launch's
stand-in JIT (no CUDA).
"""
from __future__ import annotations

import contextlib
from types import SimpleNamespace

import torch

from kernels.direct_launch import DirectLaunch
from test_direct_launch import FakeJit


def _kinds(monkeypatch, *values) -> list[str]:
    """Launch with each `n` in turn: "jit" where the launcher compiled (a new variant), "direct" where it reused."""
    monkeypatch.setattr(torch.cuda, "stream", lambda s: contextlib.nullcontext())
    fn, stream = FakeJit(), SimpleNamespace(cuda_stream=1)
    launch = DirectLaunch(fn)
    x = torch.zeros(16, dtype=torch.int32)
    for n in values:
        launch((1,), stream, x, n, 5, BLOCK=16)
    return [c[0] for c in fn.calls]


def test_a_bool_is_not_the_variant_of_the_int_it_equals(monkeypatch):
    assert _kinds(monkeypatch, 1, True, True, 1) == ["jit", "jit", "direct", "direct"]
    assert _kinds(monkeypatch, 0, False) == ["jit", "jit"]


def test_a_float_is_not_the_variant_of_the_int_it_equals(monkeypatch):
    assert _kinds(monkeypatch, 32, 32.0, 32.0, 32) == ["jit", "jit", "direct", "direct"]
