"""Session 76: `POST /v1/responses/{id}/cancel` takes no body, so a browser page of any site could cancel a background
response (a form's POST or a no-cors fetch, which no CORS preflight guards), as it could reset the cache before
session 75 (`/reset_prefix_cache`, tests/test_docs_promises_s75.py). A response's id may be the client's own
`request_id` (vLLM's), one a page can guess ("job-1"). Such a cancel is now a 403 `cross_site_request`; a client that
is no page (no Origin) and a page of an origin --allowed-origins lets in cancel as before. DELETE is not a simple
request: a browser preflights it, and CORS refuses another site's."""
from __future__ import annotations

import time

import httpx
import pytest

from scheduler.api_auth import CORSSettings
from scheduler.server import ServerLimits
from server_fixtures import byte_level_server, tiny_config

ALLOWED = "http://dashboard.example"


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    limits = ServerLimits(shutdown_grace_s=1.0, cors=CORSSettings(allowed_origins=(ALLOWED,)))
    with byte_level_server(tmp_path_factory, tiny_config(max_new_tokens_limit=64), limits=limits) as s:
        yield s


def _background(srv, rid: str) -> None:
    body = {"model": "tiny", "input": "hi", "max_output_tokens": 64, "temperature": 0, "background": True,
            "request_id": rid}
    r = httpx.post(srv.url + "/v1/responses", json=body, timeout=60)
    assert r.status_code == 200 and r.json()["id"] == rid, r.text


def _ended(srv, rid: str) -> dict:
    deadline = time.monotonic() + 120
    while (got := httpx.get(f"{srv.url}/v1/responses/{rid}", timeout=30).json())["status"] in ("queued",
                                                                                              "in_progress"):
        assert time.monotonic() < deadline, got
        time.sleep(0.01)
    return got


@pytest.mark.parametrize("headers", [{"Content-Type": "application/x-www-form-urlencoded"},  # a form's POST
                                     {"Content-Type": "text/plain;charset=UTF-8"},
                                     {}])  # fetch(url, {method: "POST", mode: "no-cors"})
@pytest.mark.parametrize("origin", ["http://elsewhere.example", "null"])
def test_a_page_of_another_site_cannot_cancel_a_background_response(srv, headers, origin):
    rid = f"job-{origin[-7:]}-{len(headers) and headers['Content-Type'][:4]}"
    _background(srv, rid)
    r = httpx.post(f"{srv.url}/v1/responses/{rid}/cancel", headers={"Origin": origin, **headers}, content=b"",
                   timeout=30)
    assert r.status_code == 403 and r.json()["error"]["code"] == "cross_site_request", r.text
    assert _ended(srv, rid)["status"] != "cancelled"


def test_a_client_without_origin_and_an_allowed_page_still_cancel(srv):
    for i, headers in enumerate(({}, {"Origin": ALLOWED})):
        _background(srv, f"mine-{i}")
        r = httpx.post(f"{srv.url}/v1/responses/mine-{i}/cancel", headers=headers, timeout=30)
        assert r.status_code == 200 and r.json()["id"] == f"mine-{i}", (headers, r.text)
        assert _ended(srv, f"mine-{i}")["status"] in ("cancelled", "completed")
