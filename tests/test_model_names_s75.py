"""GET /v1/models/{id} (the openai SDK's models.retrieve) for a served name that ends in "/" (a checkpoint's
directory given as `--model /path/ckpt/`, or such a --served-model-name): the route took the trailing "/" off
every id before it looked it up, so the id /v1/models listed was a 404 there. It is looked up as given first; a
trailing "/" after a name not ending in one still finds it (tests/test_http_s52_hunt.py)."""
from __future__ import annotations

import httpx

from scheduler.server import ServerLimits
from server_fixtures import byte_level_server, tiny_config


def test_a_listed_name_ending_in_a_slash_is_found_by_its_own_id(tmp_path_factory):
    limits = ServerLimits(shutdown_grace_s=1.0, served_model_names=("/models/ckpt/", "short"))
    with byte_level_server(tmp_path_factory, tiny_config(max_new_tokens_limit=8), limits=limits) as srv:
        listed = httpx.get(srv.url + "/v1/models", timeout=30).json()["data"]
        assert [m["id"] for m in listed] == ["/models/ckpt/", "short"]  # (session 80: a card per name, as vLLM)
        for path, name in (("/v1/models//models/ckpt/", "/models/ckpt/"), ("/v1/models/short", "short"),
                           ("/v1/models/short/", "short")):
            r = httpx.get(srv.url + path, timeout=30)
            assert r.status_code == 200 and r.json()["id"] == name, (path, r.text)
        r = httpx.get(srv.url + "/v1/models/ckpt", timeout=30)
        assert r.status_code == 404, r.text
