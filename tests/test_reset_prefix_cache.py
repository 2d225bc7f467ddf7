"""An operator's cache reset over HTTP, vLLM's `POST /reset_prefix_cache` (scheduler/api_admin.py): by default
the engine-local tiers (L1, L2) are flushed and L3 stays; L3 only when named (`tiers`, or vLLM's
`reset_external=true`); a tier the engine lacks is skipped and said so; bad fields are 400s naming them; with
--api-key the key is asked. Requests in flight keep their pages and their outputs, and after a reset a
repeated prompt is recomputed (then hits again). Real servers on the CPU (tiny preset)."""
from __future__ import annotations

import json

import httpx
import pytest

from scheduler.engine import Engine
from scheduler.server import ServerLimits, create_app
from server_fixtures import byte_level_server, ok, post, tiny_config
from test_server import ServerThread, metric_samples, wait_idle

RESET = "/reset_prefix_cache"
KEY = "sk-reset-test"
GREEDY = {"temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    """L1 and L2, no L3 (a repeat after a default reset has nowhere to hit)."""
    config = tiny_config(num_pages=300, max_new_tokens_limit=1000).with_hicache(enable=True, host_ratio=2.0,
                                                                                 storage_ratio=0)
    with byte_level_server(tmp_path_factory, config) as s:
        yield s


@pytest.fixture(scope="module")
def l3_srv():
    """L1, L2 and a file L3, behind an API key (prompts as token ids)."""
    engine = Engine(tiny_config(num_pages=300, max_new_tokens_limit=64).with_hicache(enable=True, host_ratio=2.0))
    with ServerThread(create_app(engine, ServerLimits(shutdown_grace_s=1.0, api_key=KEY))) as s:
        s.engine = engine
        yield s


def _tiers(srv) -> dict:
    return httpx.get(srv.url + "/hicache/status").json()["tiers"]


def _cached(r: dict) -> int:
    return r["usage"]["prompt_tokens_details"]["cached_tokens"]


def _whole(srv) -> None:
    """Idle: every page of each tier the engine has is free or in the tree, and the tree is sound
    (test_server.assert_pools_whole, for an engine that may lack L3)."""
    for tier, t in wait_idle(srv)["tiers"].items():
        if t is not None:
            assert t["private_pages"] == 0 and t["free_pages"] + t["resident_pages"] == t["capacity_pages"], (tier, t)
    srv.call(srv.engine.check_integrity)


def _reset(srv, query: str = "", **kw) -> httpx.Response:
    return httpx.post(srv.url + RESET + query, timeout=60, **kw)


# -- what a reset drops ------------------------------------------------------------------------------------
def test_a_reset_drops_l1_and_l2_and_a_repeat_recomputes_then_hits_again(srv):
    body = {"prompt": "the reset drops every cached prefix of this prompt", "max_tokens": 8, **GREEDY}
    first = ok(srv, "/v1/completions", body)
    assert _cached(ok(srv, "/v1/completions", body)) > 0
    wait_idle(srv)  # (its write-through backup to L2 done)
    assert _tiers(srv)["l1"]["resident_pages"] > 0
    resets_before = metric_samples(srv.url).get(("hicache_prefix_cache_resets_total", (("tier", "l1"),)), 0)
    r = _reset(srv)  # no body, no query: the defaults
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["success"] is True and set(out["pages_freed"]) == {"l1", "l2"} and out["skipped"] == {}
    assert out["pages_freed"]["l1"] > 0 and out["pages_freed"]["l2"] > 0 and out["pages_left"] == {"l1": 0, "l2": 0}
    tiers = _tiers(srv)
    assert tiers["l1"]["resident_pages"] == tiers["l2"]["resident_pages"] == 0
    srv.call(srv.engine.check_integrity)
    again = ok(srv, "/v1/completions", body)
    assert _cached(again) == 0 and again["choices"][0]["token_ids"] == first["choices"][0]["token_ids"]
    assert _cached(ok(srv, "/v1/completions", body)) > 0  # cached again by the recompute
    samples = metric_samples(srv.url)
    assert samples[("hicache_prefix_cache_resets_total", (("tier", "l1"),))] == resets_before + 1
    assert samples[("hicache_evicted_pages_total", (("tier", "l1"),))] >= out["pages_freed"]["l1"]
    _whole(srv)


def test_a_tier_the_engine_lacks_is_skipped_and_named(srv):
    for query in ("?tiers=l1,l3", "?reset_external=true"):
        r = _reset(srv, query)
        assert r.status_code == 200, r.text
        out = r.json()
        assert "l3" not in out["pages_freed"] and "l1" in out["pages_freed"], out
        assert "l3" in out["skipped"] and "L3" in out["skipped"]["l3"], out
    # the same fields in a JSON body
    out = ok(srv, RESET, {"tiers": ["l2"]})
    assert set(out["pages_freed"]) == {"l2"} and out["skipped"] == {}


@pytest.mark.parametrize("query, body, param", [
    ("?tiers=l4", None, "tiers"),
    ("?tiers=l1,,l2", None, "tiers"),
    ("?tiers=", None, "tiers"),
    ("", {"tiers": ["l1", "L9"]}, "tiers"),
    ("", {"tiers": []}, "tiers"),
    ("", {"tiers": "l1"}, "tiers"),
    ("", {"tiers": [1]}, "tiers"),
    ("?tier=l1", None, "tier"),
    ("", {"tier": "l1"}, "tier"),
    ("?reset_external=maybe", None, "reset_external"),
    ("", {"reset_external": "yes"}, "reset_external"),
    ("?reset_running_requests=true", None, "reset_running_requests"),
    ("?tiers=l1", {"tiers": ["l2"]}, "tiers"),
])
def test_bad_fields_are_400s_naming_them(srv, query, body, param):
    r = _reset(srv, query, **({} if body is None else {"json": body}))
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err
    if "l4" in query or body and "L9" in json.dumps(body):
        assert ("'l4'" if "l4" in query else "'L9'") in err["message"]


def test_a_body_that_is_not_a_json_object_is_a_400_and_get_a_405(srv):
    r = _reset(srv, content=b"[1]", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json"
    assert _reset(srv, "?reset_running_requests=false").status_code == 200  # (vLLM's default, spelled out)
    assert httpx.get(srv.url + RESET).status_code == 405


# -- L3 only when asked; the key --------------------------------------------------------------------------
def test_a_default_reset_leaves_l3_and_l3_goes_when_named(l3_srv):
    auth = {"Authorization": f"Bearer {KEY}"}
    body = {"prompt": list(range(3, 40)), "max_tokens": 4, **GREEDY}
    call = lambda: httpx.post(l3_srv.url + "/v1/completions", json=body, headers=auth, timeout=60).json()  # noqa: E731
    first = call()
    wait_idle(l3_srv)  # (its backups to L2 and L3 written)
    l3_pages = _tiers(l3_srv)["l3"]["resident_pages"]
    assert l3_pages > 0
    out = _reset(l3_srv, headers=auth).json()
    assert set(out["pages_freed"]) == {"l1", "l2"} and out["skipped"] == {}
    tiers = _tiers(l3_srv)
    assert tiers["l1"]["resident_pages"] == tiers["l2"]["resident_pages"] == 0
    assert tiers["l3"]["resident_pages"] == l3_pages
    out = _reset(l3_srv, "?reset_external=true", headers=auth).json()  # vLLM's flag for the external cache
    assert out["pages_freed"]["l3"] == l3_pages and _tiers(l3_srv)["l3"]["resident_pages"] == 0
    again = call()
    assert _cached(again) == 0 and again["choices"][0]["token_ids"] == first["choices"][0]["token_ids"]
    wait_idle(l3_srv)
    out = _reset(l3_srv, "?tiers=l3", headers=auth).json()
    assert set(out["pages_freed"]) == {"l3"} and out["pages_freed"]["l3"] > 0
    _whole(l3_srv)


def test_with_an_api_key_the_reset_asks_for_it(l3_srv):
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        for query in ("", "?tiers=l9"):  # (refused before its fields are read)
            r = _reset(l3_srv, query, headers=headers)
            assert r.status_code == 401, r.text
            assert r.json()["error"]["code"] == "invalid_api_key" and r.headers["www-authenticate"] == "Bearer"
    assert _reset(l3_srv, headers={"Authorization": f"bearer {KEY}"}).status_code == 200


# -- requests in flight -----------------------------------------------------------------------------------
def test_a_reset_during_a_stream_leaves_its_output_as_an_unreset_run(srv):
    """The stream's pages are locked: the reset leaves them (pages_left), the stream goes on and its
    tokens are those of a run that saw no reset; once idle every tier is whole and the tree sound."""
    body = {"prompt": "a long answer streamed while the operator resets the cache", "max_tokens": 600, **GREEDY}
    reference = ok(srv, "/v1/completions", body)["choices"][0]["token_ids"]
    ok(srv, RESET, {})
    ids, reset = [], None
    with httpx.stream("POST", srv.url + "/v1/completions", json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ids += json.loads(line[6:])["choices"][0]["token_ids"]
            if reset is None and ids:
                reset = post(srv, RESET, {"tiers": ["l1", "l2"]})
    assert reset.status_code == 200, reset.text
    assert reset.json()["pages_left"]["l1"] > 0  # (the stream's prefix: it was running, and kept its pages)
    assert ids == reference
    _whole(srv)
