"""Preempted requests over HTTP (session 55's mutation check: nothing failed with the server's usage reading the
resumption's hits): a streamed completion preempted while it decodes reports, in every usage it sends, the cached
tokens of its first admission, not the 0 its resumption had yet to find; and it streams the tokens it streams at
decode_reserve_ratio 1."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

from server_fixtures import byte_level_server, post, sse, tiny_config

PREFIX = [9, 8, 7, 6] * 5  # 5 pages of 4: every request's first admission hits them in L1


def streams(srv) -> list[list[dict]]:
    assert post(srv, "/v1/completions", {"prompt": PREFIX + [1], "max_tokens": 1}).status_code == 200  # (warm)
    bodies = [{"prompt": PREFIX + [i + 20] * (3 + i), "max_tokens": 60, "ignore_eos": True, "temperature": 0,
               "stream_options": {"include_usage": True, "continuous_usage_stats": True}} for i in range(10)]
    with ThreadPoolExecutor(len(bodies)) as pool:
        return list(pool.map(lambda body: sse(srv, "/v1/completions", body), bodies))


def test_a_preempted_streams_usage_counts_its_first_admissions_hits(tmp_path_factory):
    with byte_level_server(tmp_path_factory, tiny_config(num_pages=64)) as whole_srv:
        whole = streams(whole_srv)
    with byte_level_server(tmp_path_factory, tiny_config(num_pages=64, decode_reserve_ratio=0.0)) as srv:
        short = streams(srv)
        assert srv.engine.stats["preempted"] > 0
    for chunks, reference in zip(short, whole):
        usages = [c["usage"] for c in chunks if c.get("usage")]
        assert usages and {u["prompt_tokens_details"]["cached_tokens"] for u in usages} == {20}, usages
        assert usages[-1]["completion_tokens"] == 60
        text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
        assert text == "".join(c["choices"][0]["text"] for c in reference if c["choices"])
