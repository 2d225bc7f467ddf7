"""Session 75's hunt of what the docs promise against what the code does.

scheduler/api_models.read_json_body says bodies must be sent as JSON "so that a browser's simple request, text/plain
or a form, which no CORS preflight guards, cannot run generations or reset the cache from another site". A reset
takes its fields in the query too (vLLM's `curl -X POST .../reset_prefix_cache?reset_external=true`), with an empty
body, so a page of another site could still reset every tier, L3 included, by a form or a no-cors fetch of that URL:
the browser sends it with the page's Origin and no body. Such a reset is refused; a client that is no browser page
(no Origin) and a page of an origin --allowed-origins lets in are served as before."""
from __future__ import annotations

import httpx
import pytest

from scheduler.api_auth import CORSSettings
from scheduler.server import ServerLimits
from server_fixtures import byte_level_server, ok, tiny_config

RESET = "/reset_prefix_cache?tiers=l1"
ALLOWED = "http://dashboard.example"


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    limits = ServerLimits(shutdown_grace_s=1.0, cors=CORSSettings(allowed_origins=(ALLOWED,)))
    with byte_level_server(tmp_path_factory, tiny_config(max_new_tokens_limit=8), limits=limits) as s:
        yield s


def _l1_resident_pages(srv) -> int:
    return httpx.get(srv.url + "/hicache/status", timeout=30).json()["tiers"]["l1"]["resident_pages"]


def _cache_a_prompt(srv) -> None:
    ok(srv, "/v1/completions", {"prompt": "a prompt long enough to fill pages", "max_tokens": 1, "temperature": 0})
    assert _l1_resident_pages(srv) > 0


@pytest.mark.parametrize("headers", [{"Content-Type": "application/x-www-form-urlencoded"},  # a form's POST
                                     {"Content-Type": "text/plain;charset=UTF-8"},
                                     {}])  # fetch(url, {method: "POST", mode: "no-cors"}): no body, no Content-Type
@pytest.mark.parametrize("origin", ["http://elsewhere.example", "null"])  # ("null": a sandboxed page's)
def test_a_page_of_another_site_cannot_reset_the_cache_by_its_query(srv, headers, origin):
    _cache_a_prompt(srv)
    before = _l1_resident_pages(srv)
    r = httpx.post(srv.url + RESET, headers={"Origin": origin, **headers}, timeout=30)
    assert r.status_code == 403 and r.json()["error"]["code"] == "cross_site_request", r.text
    assert _l1_resident_pages(srv) == before


def test_a_client_without_origin_and_an_allowed_page_still_reset(srv):
    for headers in ({}, {"Origin": ALLOWED}):
        _cache_a_prompt(srv)
        r = httpx.post(srv.url + RESET, headers=headers, timeout=30)
        assert r.status_code == 200 and r.json()["pages_freed"]["l1"] > 0, (headers, r.text)
