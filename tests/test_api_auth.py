"""vLLM's access flags on the HTTP server (scheduler/api_auth.py, wired by scheduler/server.py and
scheduler/serve.py): --api-key (or HICACHE_API_KEY) guards the /v1/ routes alone, with the usual JSON
error body and `WWW-Authenticate: Bearer`; --served-model-name replaces the names a request's `model`
may use and the one reported; --allowed-origins (and its three companions) adds CORS, whose preflights
need no key. One real server with all three (tests/test_server.py's harness); the app without them
through starlette's TestClient, its lifespan not run (no engine start is needed for what it checks)."""
from __future__ import annotations

import json

import httpx
import openai
import pytest
from starlette.testclient import TestClient
from test_server import ServerThread

from scheduler import serve
from scheduler.api_auth import CORSSettings, api_key_from
from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.server import ServerLimits, create_app

KEY = "sk-test-0123456789"
ORIGIN = "http://ui.example"
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = [11, 12, 13, 14, 15]


@pytest.fixture(scope="module")
def engine():
    return Engine(EngineConfig(model="tiny", device="cpu", page_size=4, num_pages=64, max_new_tokens_limit=32))


@pytest.fixture(scope="module")
def srv(engine):
    limits = ServerLimits(shutdown_grace_s=1.0, api_key=KEY, served_model_names=("alias", "alias-2"),
                          cors=CORSSettings(allowed_origins=(ORIGIN,)))
    with ServerThread(create_app(engine, limits)) as s:
        yield s


def completion(url: str, headers: dict | None = None, model: str = "alias") -> httpx.Response:
    return httpx.post(url + "/v1/completions", headers=headers,
                      json={"model": model, "prompt": PROMPT, "max_tokens": 2, "temperature": 0})


# -- the key ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("authorization", [None, "Bearer wrong", f"Basic {KEY}", "Bearer", f"Bearer {KEY}x", KEY])
def test_v1_routes_refuse_a_missing_or_wrong_key(srv, authorization):
    headers = {} if authorization is None else {"Authorization": authorization}
    for r in (httpx.get(srv.url + "/v1/models", headers=headers), completion(srv.url, headers),
              httpx.get(srv.url + "/v1/models/alias", headers=headers)):
        assert r.status_code == 401, r.text
        assert r.headers["www-authenticate"] == "Bearer"
        err = r.json()["error"]
        assert err["code"] == "invalid_api_key" and err["type"] == "authentication_error" and err["param"] is None
        assert "--api-key" in err["message"] and KEY not in r.text


def test_the_key_opens_v1_and_the_first_served_name_is_reported(srv):
    models = httpx.get(srv.url + "/v1/models", headers=AUTH)
    # a card per served name, the first first (vLLM's; session 80: the first alone)
    assert models.status_code == 200 and [m["id"] for m in models.json()["data"]] == ["alias", "alias-2"]
    assert httpx.get(srv.url + "/v1/models/alias-2", headers=AUTH).json()["id"] == "alias-2"
    r = completion(srv.url, {"authorization": f"bearer {KEY}"}, model="alias-2")  # (scheme: any case, RFC 9110)
    assert r.status_code == 200 and r.json()["model"] == "alias"
    with openai.OpenAI(base_url=srv.url + "/v1", api_key=KEY, max_retries=0, timeout=60) as c:
        assert c.completions.create(model="alias", prompt=PROMPT, max_tokens=2, temperature=0).model == "alias"
        chunks = list(c.completions.create(model="alias", prompt=PROMPT, max_tokens=3, temperature=0, stream=True))
        assert chunks and all(ch.model == "alias" for ch in chunks)
        assert chunks[-1].choices[0].finish_reason == "length"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=srv.url + "/v1", api_key="wrong", max_retries=0).models.list()


def test_with_served_model_name_the_models_own_names_are_refused(srv, engine):
    for old in ("tiny", engine.model_id):
        r = completion(srv.url, AUTH, model=old)
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        # every name it answers to (regression: 'alias' alone, where 'alias-2' is served too)
        assert "serves 'alias' (also named 'alias-2')" in r.json()["error"]["message"], r.text
        card = httpx.get(f"{srv.url}/v1/models/{old}", headers=AUTH)
        assert card.status_code == 404 and "(also named 'alias-2')" in card.json()["error"]["message"]
    assert completion(srv.url, AUTH, model="").status_code == 200  # (no model: the served one, as before)


def test_routes_outside_v1_stay_open(srv):
    """As vLLM, which guards /v1 alone: probes, metrics and the tokenizer routes need no key."""
    for path in ("/health", "/version", "/metrics", "/hicache/status"):
        assert httpx.get(srv.url + path).status_code == 200, path
        assert httpx.head(srv.url + path).status_code == 200, path
    tok = httpx.post(srv.url + "/tokenize", json={"model": "alias", "prompt": "hi"})
    assert tok.status_code == 200, tok.text
    assert httpx.post(srv.url + "/detokenize", json={"tokens": tok.json()["tokens"]}).json()["prompt"] == "hi"
    assert httpx.post(srv.url + "/tokenize", json={"model": "tiny", "prompt": "hi"}).status_code == 404


def test_status_reports_whether_a_key_is_asked_never_the_key(srv):
    r = httpx.get(srv.url + "/hicache/status")
    assert KEY not in r.text
    limits = r.json()["server"]["limits"]
    assert limits["api_key"] is True and limits["served_model_names"] == ["alias", "alias-2"]
    assert limits["cors"] == {"allowed_origins": [ORIGIN], "allow_credentials": False,
                              "allowed_methods": ["*"], "allowed_headers": ["*"]}
    assert KEY not in repr(ServerLimits(api_key=KEY)) and KEY not in repr(srv.app.user_middleware)


# -- CORS ------------------------------------------------------------------------------------------------
def test_cors_preflight_needs_no_key_and_a_401_carries_cors_headers(srv):
    preflight = {"Origin": ORIGIN, "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization, content-type"}
    r = httpx.options(srv.url + "/v1/completions", headers=preflight)
    assert r.status_code == 200, r.text
    assert r.headers["access-control-allow-origin"] == ORIGIN
    assert "authorization" in r.headers["access-control-allow-headers"].lower()
    # another origin: starlette refuses the preflight (400), and a response names no origin
    assert httpx.options(srv.url + "/v1/completions", headers={**preflight, "Origin": "http://evil.example"}
                         ).status_code == 400
    assert "access-control-allow-origin" not in httpx.get(srv.url + "/health",
                                                          headers={"Origin": "http://evil.example"}).headers
    # a browser page can read the 401 (CORS outside the key check) and the answers
    denied = httpx.get(srv.url + "/v1/models", headers={"Origin": ORIGIN})
    assert denied.status_code == 401 and denied.headers["access-control-allow-origin"] == ORIGIN
    assert completion(srv.url, {**AUTH, "Origin": ORIGIN}).headers["access-control-allow-origin"] == ORIGIN


# -- without the flags: as before ------------------------------------------------------------------------
def test_without_the_flags_nothing_changes(engine):
    client = TestClient(create_app(engine, ServerLimits()))  # (no `with`: the engine is not started)
    r = client.get("/v1/models")
    assert r.status_code == 200 and r.json()["data"][0]["id"] == "tiny"
    for name in ("tiny", engine.model_id):
        assert client.get(f"/v1/models/{name}").status_code == 200
    preflight = client.options("/v1/completions", headers={"Origin": ORIGIN, "Access-Control-Request-Method": "POST"})
    assert preflight.status_code == 405 and "access-control-allow-origin" not in preflight.headers
    assert client.get("/hicache/status").json()["server"]["limits"]["api_key"] is False


# -- the command line ------------------------------------------------------------------------------------
def parse(*argv: str):
    return serve.build_parser().parse_args(["--port", "0", "--model", "tiny", *argv])


def test_cli_flags_become_the_limits(monkeypatch):
    monkeypatch.delenv("HICACHE_API_KEY", raising=False)
    args = parse("--api-key", KEY, "--served-model-name", "a", "b", "--allowed-origins", json.dumps([ORIGIN]),
                 "--allow-credentials", "--allowed-methods", '["GET", "POST"]',
                 "--allowed-headers", '["Authorization"]')
    assert serve._check_server_args(args) is None
    assert serve._access_limits(args) == {
        "api_key": KEY, "served_model_names": ("a", "b"),
        "cors": CORSSettings(allowed_origins=(ORIGIN,), allow_credentials=True, allowed_methods=("GET", "POST"),
                             allowed_headers=("Authorization",))}
    # none given: the limits as before (no key, the model's names, no CORS)
    assert serve._access_limits(parse()) == {"api_key": None, "served_model_names": (), "cors": None}
    assert serve._access_limits(parse("--allowed-origins", '["*"]'))["cors"] == CORSSettings(allowed_origins=("*",))


def test_cli_api_key_falls_back_to_hicache_api_key(monkeypatch):
    monkeypatch.setenv("HICACHE_API_KEY", "from-env")
    assert serve._access_limits(parse())["api_key"] == "from-env" == api_key_from(None)
    assert serve._access_limits(parse("--api-key", KEY))["api_key"] == KEY  # (the flag wins, as vLLM's)
    monkeypatch.setenv("HICACHE_API_KEY", "")  # (an empty variable: no key)
    assert serve._access_limits(parse())["api_key"] is None


@pytest.mark.parametrize("argv,says", [
    (["--api-key", ""], "--api-key must not be empty"),
    (["--served-model-name", "a", ""], "--served-model-name"),
])
def test_cli_refuses_empty_names(argv, says, capsys):
    assert says in serve._check_server_args(parse(*argv))
    assert serve.main(["--port", "0", "--device", "cpu", "--model", "tiny", *argv]) == 2
    assert says in capsys.readouterr().err


@pytest.mark.parametrize("value", ["not json", '"http://a"', '[1]', '{"a": 1}'])
def test_cli_allowed_origins_must_be_a_json_list_of_strings(value, capsys):
    with pytest.raises(SystemExit) as exc:
        parse("--allowed-origins", value)
    assert exc.value.code == 2 and "--allowed-origins: a JSON list of strings" in capsys.readouterr().err
