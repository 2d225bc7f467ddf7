"""Regressions from session 52's hunt of the HTTP surface: a body must be sent as JSON (any Content-Type was parsed,
so a page of another site could run generations or reset the cache through a browser's simple request, which no
CORS preflight guards); a 405's Allow names every method of its path; /reset_prefix_cache takes any empty body;
/v1/models/ is the list."""
from __future__ import annotations

import httpx
import pytest

from server_fixtures import byte_level_server, tiny_config

BODY = b'{"model": "tiny", "prompt": "hi", "max_tokens": 1}'


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    with byte_level_server(tmp_path_factory, tiny_config()) as s:
        yield s


@pytest.mark.parametrize("content_type", ["text/plain;charset=UTF-8", "application/x-www-form-urlencoded",
                                          "multipart/form-data; boundary=x", None])
@pytest.mark.parametrize("path, body", [("/v1/completions", BODY), ("/tokenize", b'{"prompt": "hi"}'),
                                        ("/reset_prefix_cache", b'{"tiers": ["l1"]}')])
def test_a_body_not_sent_as_json_is_refused(srv, content_type, path, body):
    headers = {"Origin": "http://elsewhere.example"} | ({} if content_type is None else {"Content-Type": content_type})
    r = httpx.post(srv.url + path, content=body, headers=headers, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_content_type", r.text


@pytest.mark.parametrize("content_type", ["application/json", "application/json; charset=utf-8",
                                          "Application/JSON", "application/vnd.api+json"])
def test_json_media_types_are_taken(srv, content_type):
    r = httpx.post(srv.url + "/v1/completions", content=BODY, headers={"Content-Type": content_type}, timeout=30)
    assert r.status_code == 200, r.text


def test_a_405_names_every_method_of_its_path(srv):
    r = httpx.request("PATCH", srv.url + "/ping", timeout=30)
    assert r.status_code == 405 and set(r.headers["allow"].split(", ")) == {"GET", "HEAD", "POST"}
    r = httpx.request("PATCH", srv.url + "/v1/responses/abc", timeout=30)
    assert r.status_code == 405 and {"GET", "DELETE"} <= set(r.headers["allow"].split(", "))


@pytest.mark.parametrize("headers, content", [({"Content-Length": "0"}, b""), ({}, iter([b""])),
                                              ({"Content-Length": "00"}, b"")])
def test_a_cache_reset_takes_any_empty_body(srv, headers, content):
    r = httpx.post(srv.url + "/reset_prefix_cache", content=content, headers=headers, timeout=30)
    assert r.status_code == 200 and r.json()["success"], r.text


def test_the_models_route_with_a_trailing_slash(srv):
    listed = httpx.get(srv.url + "/v1/models", timeout=30).json()
    assert httpx.get(srv.url + "/v1/models/", timeout=30).json() == listed
    name = listed["data"][0]["id"]
    assert httpx.get(srv.url + f"/v1/models/{name}/", timeout=30).json()["id"] == name
