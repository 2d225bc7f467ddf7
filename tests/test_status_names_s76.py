"""Session 76: /hicache/status's `server.limits.served_model_names` was the configured field, `[]` for a server
started without --served-model-name: an operator read that no name was served, where /v1/models lists the model's and
requests are served under it (its path, its last part, its id). It now lists the names requests may use, the one
/v1/models lists first; the names given by --served-model-name are still listed as given."""
from __future__ import annotations

import httpx
import pytest

from server_fixtures import byte_level_server, tiny_config


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    with byte_level_server(tmp_path_factory, tiny_config()) as s:
        yield s


def test_status_lists_the_names_served_without_served_model_name(srv):
    listed = [card["id"] for card in httpx.get(srv.url + "/v1/models", timeout=30).json()["data"]]
    names = httpx.get(srv.url + "/hicache/status", timeout=30).json()["server"]["limits"]["served_model_names"]
    assert names and names[0] == listed[0], (names, listed)
    for name in names:  # each a name a request is served under
        r = httpx.post(srv.url + "/v1/completions", json={"model": name, "prompt": [1, 2], "max_tokens": 1},
                       timeout=60)
        assert r.status_code == 200, (name, r.text)
    assert srv.engine.model_id in names
