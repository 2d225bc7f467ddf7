"""Regressions from session 52's hunt of what one client's request can do to the others: a grammar's chain of rules or
a schema's chain of $refs crashed the server (llguidance's stack overflowed: a segfault); 39,000 tools held the loop
17 s (a quadratic check); a body nested ~600 deep was a 500 (RecursionError); prompt logprobs fanned out by n and a
batch made a 378 MB body; compiled grammars were kept by count whatever their size."""
from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from scheduler.guide_compiler import (KEPT_SPEC_CHARS, MAX_GRAMMAR_RULES, MAX_SCHEMA_DEFS, MatcherCache,
                                      check_limits, on_compile_thread)
from scheduler.guided import GuidedSpec
from server_fixtures import byte_level_server, ok, post, tiny_config


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    with byte_level_server(tmp_path_factory, tiny_config()) as s:
        yield s


def _rule_chain(n: int) -> str:
    return "start: r0\n" + "\n".join(f'r{i}: "t" r{i + 1} | "e"' for i in range(n)) + f'\nr{n}: "end"'


def _ref_chain(n: int) -> dict:
    defs = {f"d{i}": {"type": "object", "properties": {"a": {"$ref": f"#/$defs/d{i + 1}"}}} for i in range(n)}
    return {"$ref": "#/$defs/d0", "$defs": {**defs, f"d{n}": {"type": "string"}}}


def test_chains_past_the_limits_are_400s_and_the_server_serves_on(srv):
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 4}
    r = post(srv, "/v1/completions", {**body, "guided_grammar": _rule_chain(3000)})
    assert r.status_code == 400 and f"at most {MAX_GRAMMAR_RULES}" in r.json()["error"]["message"], r.text
    fmt = {"type": "json_schema", "json_schema": {"name": "x", "schema": _ref_chain(1000)}}
    r = post(srv, "/v1/completions", {**body, "response_format": fmt})
    assert r.status_code == 400 and f"at most {MAX_SCHEMA_DEFS}" in r.json()["error"]["message"], r.text
    assert ok(srv, "/v1/completions", {**body, "guided_grammar": _rule_chain(400)})["choices"]
    fmt["json_schema"]["schema"] = _ref_chain(400)
    assert ok(srv, "/v1/completions", {**body, "response_format": fmt})["choices"]


def test_the_limits_count_what_they_say():
    check_limits("grammar", _rule_chain(MAX_GRAMMAR_RULES - 2))  # (start, the chain, its end)
    with pytest.raises(ValueError, match="rules"):
        check_limits("grammar", _rule_chain(MAX_GRAMMAR_RULES))
    check_limits("json_schema", GuidedSpec("json_schema", _ref_chain(MAX_SCHEMA_DEFS - 1)).value)
    with pytest.raises(ValueError, match="definitions"):
        check_limits("json_schema", GuidedSpec("json_schema", _ref_chain(MAX_SCHEMA_DEFS)).value)


def test_grammars_compile_on_the_thread_of_a_deep_stack():
    before = threading.stack_size()
    assert on_compile_thread(lambda: threading.current_thread().name).startswith("hicache-grammar")
    assert threading.stack_size() == before  # (set only while that thread was made)


def test_kept_matchers_are_bounded_by_their_specs_text():
    compiled = MatcherCache(lambda spec: object())
    big = [GuidedSpec("regex", f"{i}" + "a" * (KEPT_SPEC_CHARS // 3)) for i in range(5)]
    for spec in big:
        compiled(spec)
    assert compiled.cache_info().currsize == 2  # (three would pass the text's bound)
    compiled(big[-1])
    assert compiled.cache_info().hits == 1
    small = [GuidedSpec("regex", f"x{i}") for i in range(100)]
    for spec in small:
        compiled(spec)
    assert compiled.cache_info().currsize == 64


def test_many_tools_and_a_duplicate_among_them(srv):
    tools = [{"type": "function", "function": {"name": f"f{i}"}} for i in range(5000)]
    chat = {"model": "tiny", "messages": [{"role": "user", "content": "q"}], "max_tokens": 1, "tool_choice": "none"}
    assert ok(srv, "/v1/chat/completions", {**chat, "tools": tools})["choices"]
    r = post(srv, "/v1/chat/completions", {**chat, "tools": [*tools, {"type": "function", "function": {"name": "f7"}}]})
    assert r.status_code == 400 and "'f7' is given twice" in r.json()["error"]["message"], r.text


def test_a_body_nested_past_the_limit_is_a_400_naming_where(srv):
    deep = 1
    for _ in range(600):
        deep = [deep]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "x": deep}}}]
    r = post(srv, "/v1/chat/completions", {"model": "tiny", "messages": [{"role": "user", "content": "q"}],
                                           "max_tokens": 1, "tool_choice": "required", "tools": tools})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tools", r.text
    assert "deeper than 128" in r.json()["error"]["message"]


def test_prompt_logprobs_fanned_out_past_what_a_response_carries_is_a_400(srv):
    prompt = list(range(10, 410))  # (400 tokens)
    base = {"model": "tiny", "max_tokens": 1, "prompt_logprobs": 20}
    r = post(srv, "/v1/completions", {**base, "prompt": [prompt] * 16, "n": 16})  # (400 x 21 x 256 = 2,150,400)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs", r.text[:300]
    assert ok(srv, "/v1/completions", {**base, "prompt": prompt, "n": 2})["choices"][0]["prompt_logprobs"]
    r = post(srv, "/v1/completions", {"model": "tiny", "max_tokens": 1, "echo": True, "logprobs": 20,
                                      "prompt": [prompt] * 16, "n": 16})  # (400 x 21 x 256 = 2,150,400)
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs", r.text[:300]  # (an echo's count too)


def test_compiles_run_side_by_side():
    """(Review) one compile thread held every other client's grammar behind one slow schema."""
    both = threading.Barrier(2, timeout=30)
    with ThreadPoolExecutor(2) as callers:  # (two callers, each waiting on a compile thread that waits for the other)
        done = [callers.submit(on_compile_thread, both.wait) for _ in range(2)]
        assert sorted(f.result(timeout=60) for f in done) == [0, 1]


def test_the_compile_threads_are_made_once_with_their_stack_and_again_in_a_forked_child():
    """(Review) first compiles at once raced threading.stack_size (a pool of default stacks, or 256 MiB left set for
    every later thread); a forked child's first compile waited forever for the parent's threads."""
    script = textwrap.dedent("""
        import multiprocessing, threading
        from concurrent.futures import ThreadPoolExecutor
        from scheduler import guide_compiler as gc
        before = threading.stack_size()
        with ThreadPoolExecutor(4) as ex:
            list(ex.map(lambda _: gc._compiler(), range(4)))
        names = sorted(t.name for t in threading.enumerate() if t.name.startswith("hicache-grammar"))
        assert threading.stack_size() == before and len(names) == gc.COMPILE_THREADS, (names, threading.stack_size())
        ctx = multiprocessing.get_context("fork")
        with ctx.Pool(1) as pool:
            assert pool.apply_async(gc.on_compile_thread, (abs, -3)).get(timeout=60) == 3
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.stdout.strip() == "ok", out.stderr[-2000:]
