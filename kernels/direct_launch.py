"""Triton launches on an explicit CUDA stream, without the JIT's per-call dispatch.

`kernel[grid](...)` binds the arguments, computes the specialisation key, looks the variant up and
reads torch's current stream on every call: ~25 µs of host time on the H200's host in a tight loop
(scripts/probe_host.py), and a transfer pipeline also needs a `with torch.cuda.stream(...)` around
it (~15 µs). Per chunk of a transfer that is what the copy engine waits for. `DirectLaunch` goes
through the JIT once per variant (compiling if needed), keeps the compiled kernel it returns, and
later calls that kernel's launcher with the stream handle.

A variant is what the JIT would pick: the constexprs and launch options, plus the specialisation
of every other argument (an int equal to 1 or a multiple of 16, a tensor's 16-byte alignment)
unless the kernel opts that argument out with do_not_specialize. So a later call can never run a
variant compiled for other arguments.
"""
from __future__ import annotations

import torch


class DirectLaunch:
    """launch(grid, stream, *args, **meta): args are the kernel's non-constexpr arguments in order,
    meta its constexprs and launch options (num_warps, ...), as for `kernel[grid](*args, **meta)`."""

    def __init__(self, fn) -> None:
        self.fn = fn
        params = fn.params
        self._constexprs = [p.name for p in params if p.is_constexpr]
        self._order = [(p.name, p.is_constexpr) for p in params]
        # positions (among the non-constexpr arguments) that the JIT specialises on
        runtime = [p for p in params if not p.is_constexpr]
        self._specialised = [i for i, p in enumerate(runtime) if not getattr(p, "do_not_specialize", False)]
        self._compiled: dict[tuple, object] = {}

    def _variant(self, args: tuple, meta: dict) -> tuple:
        spec = []
        for i in self._specialised:
            a = args[i]
            if isinstance(a, torch.Tensor):
                spec.append(a.data_ptr() % 16 == 0)
            elif isinstance(a, bool) or not isinstance(a, int):
                spec.append(a)
            else:
                spec.append((a == 1, a % 16 == 0))
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
