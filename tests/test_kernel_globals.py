"""A @triton.jit function may read a module global only when it is a tl.constexpr (or a module, or another
jit function): the compiler refuses the rest, while TRITON_INTERPRET=1, which every CPU test runs under,
reads any global. Session 33's prefetch variants and session 36's rejection sampler each passed every CPU
test and then failed to compile on the GPU for a float global. This reads each kernel module's source
and names such reads, so the CPU suite catches them."""
from __future__ import annotations

import ast
import builtins
from pathlib import Path

import pytest

KERNELS = sorted((Path(__file__).resolve().parents[1] / "kernels").glob("*.py"))


def _is_jit(fn: ast.FunctionDef) -> bool:
    return any("jit" in ast.unparse(d) for d in fn.decorator_list)


def _constexpr_call(value: ast.AST) -> bool:
    return isinstance(value, ast.Call) and ast.unparse(value.func).endswith("constexpr")


def bad_global_reads(source: str) -> list[str]:
    """'function: name' for each module global a jit function reads that is not a constexpr."""
    tree = ast.parse(source)
    plain, jit_names = set(), set()
    for node in ast.walk(tree):  # module level, also inside `if triton is not None:` blocks
        if isinstance(node, ast.FunctionDef) and _is_jit(node):
            jit_names.add(node.name)
    for node in tree.body + [n for top in tree.body if isinstance(top, ast.If) for n in top.body]:
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and node.value is not None:
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names = [n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)]
            values = node.value.elts if isinstance(node.value, ast.Tuple) else [node.value] * len(names)
            for name, value in zip(names, values):
                (plain.discard if _constexpr_call(value) else plain.add)(name)
    found = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.FunctionDef) and _is_jit(node)):
            continue
        local = {a.arg for a in node.args.args} | {n.id for n in ast.walk(node)
                                                  if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
        for n in ast.walk(node):
            if (isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load) and n.id in plain and n.id not in local
                    and n.id not in jit_names and not hasattr(builtins, n.id)):
                found.append(f"{node.name}: {n.id}")
    return sorted(set(found))


@pytest.mark.parametrize("path", KERNELS, ids=lambda p: p.name)
def test_jit_functions_read_only_constexpr_globals(path):
    assert bad_global_reads(path.read_text()) == []


def test_the_check_names_a_plain_float_global():
    source = ("import triton\nimport triton.language as tl\nLOW = -3.0\nOK = tl.constexpr(1.0)\n"
              "@triton.jit\ndef k(x_ptr):\n    tl.store(x_ptr, LOW + OK)\n")
    assert bad_global_reads(source) == ["k: LOW"]
