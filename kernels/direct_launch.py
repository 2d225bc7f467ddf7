"""Triton launches on an explicit CUDA stream, without the JIT's per-call dispatch.

`kernel[grid](...)` binds the arguments, computes the specialisation key, looks the variant up and
reads torch's current stream on every call: ~25 µs of host time on the H200's host in a tight loop
(scripts/probe_host.py), and a transfer pipeline also needs a `with torch.cuda.stream(...)` around
it (~15 µs). Per chunk of a transfer that is what the copy engine waits for. `DirectLaunch` goes
through the JIT once per variant (compiling if needed), keeps the compiled kernel it returns, and
later calls that kernel's launcher with the stream handle.

A variant is what the JIT would pick: the constexprs and launch options, every argument's type (a
tensor's dtype, an int's width), and the specialisation of every argument the kernel does not opt
out of with do_not_specialize (an int equal to 1 or a multiple of 16, a tensor's 16-byte
alignment). So a later call can never run a variant compiled for other arguments.
"""
from __future__ import annotations

import torch


class DirectLaunch:
    """launch(grid, stream, *args, **meta): args are the kernel's non-constexpr arguments in order,
    meta its constexprs and launch options (num_warps, ...), as for `kernel[grid](*args, **meta)`."""

    def __init__(self, fn) -> None:
        self.fn = fn
        self._order = [(p.name, p.is_constexpr) for p in fn.params]
        # which non-constexpr arguments the JIT specialises on their value (alignment, 1, % 16)
        self._specialised = [not getattr(p, "do_not_specialize", False) for p in fn.params if not p.is_constexpr]
        self._compiled: dict[tuple, object] = {}

    def _variant(self, args: tuple, meta: dict) -> tuple:
        """What the JIT's choice of compiled code depends on: every argument's type (a tensor's
        dtype, an int's width) whether specialised or not, the specialised ones' values as the
        JIT sees them, the constexprs and options."""
        spec = []
        for a, specialised in zip(args, self._specialised):
            if isinstance(a, torch.Tensor):
                spec.append((a.dtype, specialised and a.data_ptr() % 16 == 0))
            elif isinstance(a, bool) or not isinstance(a, int):
                spec.append((type(a), a))  # floats and bools: keyed by value (none of ours take them)
            else:
                width = 32 if -2**31 <= a < 2**31 else 64 if -2**63 <= a < 2**63 else 65  # i32 / i64 / u64
                spec.append((width, specialised and a == 1, specialised and a % 16 == 0))
        return tuple(spec), tuple(sorted(meta.items()))

    def __call__(self, grid: tuple[int, ...], stream: torch.cuda.Stream, *args, **meta) -> None:
        key = self._variant(args, meta)
        kernel = self._compiled.get(key)
        if kernel is None:  # first call of this variant: through the JIT, on `stream`
            with torch.cuda.stream(stream):
                self._compiled[key] = self.fn[grid](*args, **meta)
            return
        it = iter(args)
        values = [meta[name] if constexpr else next(it) for name, constexpr in self._order]
        kernel[tuple(grid) + (1,) * (3 - len(grid))](*values, stream=stream.cuda_stream)  # the launcher takes 3 axes
