"""The OpenAI-compatible HTTP server as real clients use it (a bug hunt: the openai SDK's helpers,
load generators' disconnects and bursts, checkpoints served without a tokenizer). Real uvicorn
servers on the CPU (tiny preset); the harness is tests/test_server.py's."""
from __future__ import annotations

import asyncio
import json
import threading

import httpx
import openai
import pytest

from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.server import ServerLimits, create_app
from scheduler.tokenizer import HFTokenizer, load_tokenizer
from server_fixtures import byte_level_server, tiny_config
from test_server import ServerThread, assert_pools_whole
from test_server_text import _write_byte_level_tokenizer

HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def chat_srv(tmp_path_factory):
    config = tiny_config(num_pages=200, max_new_tokens_limit=64).with_hicache(enable=True, host_ratio=2.0)
    with byte_level_server(tmp_path_factory, config) as s:
        yield s


@pytest.fixture(scope="module")
def client(chat_srv):
    with openai.OpenAI(base_url=chat_srv.url + "/v1", api_key="none", max_retries=0, timeout=60) as c:
        yield c


# -- a conversation carried on with the message the openai SDK returned ------------------------------------
def test_the_message_of_the_sdks_stream_helper_can_be_sent_back(client):
    """Regression: the openai SDK's stream helper (`client.chat.completions.stream`) builds its
    message with refusal, annotations, audio, function_call, tool_calls and parsed, all null, and
    the usual loop appends it to the conversation: the next turn was a 400 "unknown field
    'messages.1.refusal'". `message.model_dump()` sends the same fields."""
    with client.chat.completions.stream(model="tiny", messages=HI, max_tokens=4) as stream:
        for _ in stream:
            pass
        streamed = stream.current_completion_snapshot.choices[0].message
    whole = client.chat.completions.create(model="tiny", messages=HI, max_tokens=4).choices[0].message
    for message in (streamed, whole.model_dump(), whole):
        r = client.chat.completions.create(model="tiny", messages=[*HI, message, {"role": "user", "content": "and?"}],
                                           max_tokens=2)
        assert r.usage.completion_tokens == 2
    # the turn is rendered as the plain assistant message it is
    plain = client.chat.completions.create(
        model="tiny", max_tokens=1, messages=[*HI, {"role": "assistant", "content": whole.content}, *HI])
    dumped = client.chat.completions.create(model="tiny", max_tokens=1, messages=[*HI, whole.model_dump(), *HI])
    assert dumped.usage.prompt_tokens == plain.usage.prompt_tokens


def test_a_tool_message_carries_its_tool_call_id_to_the_template(client, tmp_path):
    """Regression: role "tool" was accepted but its `tool_call_id`, which the SDK's tool message
    requires, was a 400 "unknown field" (a client that runs the tools a model wrote as text sends
    their results so). It reaches the template, as transformers passes a message."""
    messages = [*HI, {"role": "assistant", "content": '<tool_call>{"name": "f"}</tool_call>'},
                {"role": "tool", "tool_call_id": "call_1", "content": "42"}]
    r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=2)
    assert r.usage.completion_tokens == 2
    _write_byte_level_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": (
        "{% for m in messages %}<{{ m['role'] }}{% if m.tool_call_id is defined %} {{ m.tool_call_id }}"
        "{% endif %}>{{ m['content'] }}\n{% endfor %}")}))
    from scheduler.api_models import ChatMessage
    tok = HFTokenizer(str(tmp_path))
    text = tok.decode(tok.apply_chat_template([ChatMessage.model_validate(m).as_template_dict() for m in messages]))
    assert text.endswith("<tool call_1>42\n"), text


@pytest.mark.parametrize("field,value", [("refusal", "I can't"), ("audio", {"id": "a1"}),
                                         ("function_call", {"name": "f", "arguments": "{}"})])
def test_an_assistant_field_that_would_change_the_prompt_is_unsupported(chat_srv, field, value):
    messages = [*HI, {"role": "assistant", "content": "x", field: value}, *HI]
    r = httpx.post(chat_srv.url + "/v1/chat/completions", json={"messages": messages, "max_tokens": 2}, timeout=60)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert (err["param"], err["code"]) == ("messages.1", "unsupported_value"), err
    assert f"'{field}'" in err["message"] and "messages.1" in err["message"], err


# -- a checkpoint directory without a tokenizer ---------------------------------------------------------
def _checkpoint_without_tokenizer(path):
    import dataclasses

    import torch
    from safetensors.torch import save_file

    from scheduler.loader import export_hf_state_dict
    from scheduler.model import Qwen3Model, init_random_weights
    from scheduler.presets import PRESETS

    cfg = dataclasses.replace(PRESETS["tiny"], eos_token_id=None)
    model = init_random_weights(Qwen3Model.empty(cfg, torch.device("cpu"), torch.float32), 0)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg.to_hf_config()))
    save_file(export_hf_state_dict(model), str(path / "model.safetensors"))
    return path


def test_a_checkpoint_without_tokenizer_json_refuses_text_rather_than_reading_it_as_bytes(tmp_path):
    """Regression: the byte-level tokenizer (UTF-8 bytes + 3) is the fallback of the random-weight
    presets, which have no vocabulary; a checkpoint directory without a tokenizer.json got it too,
    so its text prompts reached real weights as the wrong token ids and came back as "<id:N>"
    placeholders and bytes, with a 200. Text is refused (400, send token ids), ids are served."""
    ckpt = _checkpoint_without_tokenizer(tmp_path / "ckpt")
    assert load_tokenizer(str(ckpt), 512) is None
    engine = Engine(EngineConfig(model=str(ckpt), device="cpu", page_size=4, num_pages=64, max_new_tokens_limit=8))
    with ServerThread(create_app(engine, ServerLimits(shutdown_grace_s=1.0))) as s:
        r = httpx.post(s.url + "/v1/completions", json={"prompt": "hello", "max_tokens": 2}, timeout=60)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == "prompt" and "token ids" in r.json()["error"]["message"]
        r = httpx.post(s.url + "/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 2}, timeout=60)
        assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) == 2, r.text
        assert httpx.get(s.url + "/hicache/status", timeout=30).json()["server"]["tokenizer"] is None


# -- streams: usage, saturation, disconnects, shutdown (these held; kept as regression tests) -------------
def _sse_events(r: httpx.Response) -> list[str]:
    raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""], events[-3:]
    assert all(e.startswith("data: {") for e in events[:-2]), events
    return events[:-2]


def test_a_chat_stream_with_include_usage_ends_with_a_usage_only_chunk(chat_srv, client):
    """OpenAI: with stream_options.include_usage every chunk carries "usage": null and one more chunk,
    with no choices, carries the usage of the whole request, before [DONE]."""
    body = {"messages": HI, "max_tokens": 5, "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.Client(base_url=chat_srv.url, timeout=60) as c, c.stream("POST", "/v1/chat/completions", json=body) as r:
        chunks = [json.loads(e[len("data: "):]) for e in _sse_events(r)]
    *choice_chunks, last = chunks
    assert all("usage" in ch and ch["usage"] is None for ch in choice_chunks)
    assert choice_chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert [ch["choices"][0]["finish_reason"] for ch in choice_chunks][-1] == "length"
    assert last["choices"] == [] and last["object"] == "chat.completion.chunk"
    whole = client.chat.completions.create(model="tiny", messages=HI, max_tokens=5, temperature=0)
    assert last["usage"]["completion_tokens"] == whole.usage.completion_tokens == 5
    assert last["usage"]["prompt_tokens"] == whole.usage.prompt_tokens
    assert "".join(ch["choices"][0]["delta"]["content"] for ch in choice_chunks) == whole.choices[0].message.content
    without = dict(body, stream_options={"include_usage": False})
    with httpx.Client(base_url=chat_srv.url, timeout=60) as c, c.stream("POST", "/v1/chat/completions",
                                                                       json=without) as r:
        assert all('"usage"' not in e for e in _sse_events(r))


async def _open_stream(url: str, body: dict) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    data = json.dumps({**body, "stream": True}).encode()
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n" % len(data) + data)
    await writer.drain()
    return reader, writer


def test_a_saturated_server_queues_then_refuses_and_frees_what_left_clients_held():
    """One request runs at a time (--max-running-requests 1) and three may be in flight: the other two
    wait, a fourth is a 429 in OpenAI's error shape with Retry-After, and the queued streams whose
    clients leave before their first token are aborted; no page, lock or slot stays held."""
    engine = Engine(EngineConfig(model="tiny", device="cpu", page_size=4, num_pages=600, max_new_tokens_limit=2000,
                                 max_running_requests=1).with_hicache(enable=True, host_ratio=2.0))
    with ServerThread(create_app(engine, ServerLimits(max_concurrent_requests=3, shutdown_grace_s=1.0))) as s:
        s.engine = engine

        async def scenario():
            body = {"max_tokens": 2000, "ignore_eos": True, "temperature": 0}
            streams = [await _open_stream(s.url, {**body, "prompt": [3 + i] * 9}) for i in range(3)]
            async with httpx.AsyncClient(base_url=s.url, timeout=60) as c:
                for _ in range(200):
                    st = (await c.get("/hicache/status")).json()
                    if st["server"]["in_flight"] == 3 and st["engine"]["waiting"] == 2:
                        break
                    await asyncio.sleep(0.02)
                assert (st["server"]["in_flight"], st["engine"]["running"], st["engine"]["waiting"]) == (3, 1, 2), st
                busy = await c.post("/v1/completions", json={"prompt": [1, 2], "max_tokens": 1})
                for _, writer in streams:
                    writer.close()
            return busy
        busy = asyncio.run(scenario())
        assert busy.status_code == 429 and busy.headers["retry-after"] == "1"
        err = busy.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["type"] == "rate_limit_error", err
        assert_pools_whole(s)
        st = httpx.get(s.url + "/hicache/status", timeout=30).json()
        assert st["engine"]["aborted"] == 3 and st["server"]["in_flight"] == 0
        assert httpx.post(s.url + "/v1/completions", json={"prompt": [1, 2], "max_tokens": 2}).status_code == 200


def test_streams_open_at_shutdown_end_with_an_error_event_and_done():
    """Shutdown with one stream running past the grace and others queued behind it: each stream ends
    with an OpenAI error event and `data: [DONE]` (not a cut connection), a non-streamed request gets
    a 503 in the error shape, and a new request is refused."""
    engine = Engine(EngineConfig(model="tiny", device="cpu", page_size=4, num_pages=600, max_new_tokens_limit=2000,
                                 max_running_requests=1))
    results: dict[int, object] = {}

    def run(i: int, url: str) -> None:
        body = {"prompt": [1, 2, 3 + i], "max_tokens": 2000, "ignore_eos": True}
        with httpx.Client(base_url=url, timeout=60) as c:
            if i == 3:
                results[i] = c.post("/v1/completions", json=body)
                return
            with c.stream("POST", "/v1/completions", json={**body, "stream": True}) as r:
                results[i] = _sse_events(r)
    with ServerThread(create_app(engine, ServerLimits(shutdown_grace_s=0.2))) as s:
        threads = [threading.Thread(target=run, args=(i, s.url)) for i in range(4)]
        for t in threads:
            t.start()
        for _ in range(500):
            eng = httpx.get(s.url + "/hicache/status").json()["engine"]
            if eng["running"] + eng["waiting"] == 4 and eng["decode_tokens"] > 0:
                break
            threading.Event().wait(0.02)
        s.call(s.app.state.hc.begin_shutdown)
        for t in threads:
            t.join(60)
        refused = httpx.post(s.url + "/v1/completions", json={"prompt": [1], "max_tokens": 1})
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
    for i in range(3):
        last = json.loads(results[i][-1][len("data: "):])
        assert last["error"]["code"] == "aborted", results[i][-1]
    assert results[3].status_code == 503 and results[3].json()["error"]["code"] == "aborted"
