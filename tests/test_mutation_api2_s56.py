"""The HTTP layer's own rules that no other test pinned down (a mutation check of scheduler/api_models.py,
api_tokenize.py, openai_fields.py, ban_fields.py and prom.py): a negative stop token id, the exact caps on
allowed_token_ids and metadata, /tokenize's max_model_len under --max-prompt-tokens, a request's own chat
template on a server with no tokenizer, and the finish-reason label set of hicache_requests_finished."""
from __future__ import annotations

import httpx
import pytest
from pydantic import ValidationError
from test_server import ServerThread

from scheduler import server
from scheduler.api_inputs import parse_prompts
from scheduler.api_models import APIError, ChatCompletionRequest, CompletionRequest
from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.prom import FINISH_REASONS, ServerMetrics
from scheduler.request import ALLOWED_TOKEN_IDS_MAX
from scheduler.server import ServerLimits, create_app

HI = [{"role": "user", "content": "hi"}]
TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"


def _engine(**kw) -> Engine:
    return Engine(EngineConfig(model="tiny", device="cpu", max_total_tokens=512, **kw))


def _parse(body: dict, chat: bool = False):
    return parse_prompts(body, chat, tokenizer=None, served_names={"tiny"}, model_name="tiny", vocab_size=512,
                         prompt_limit=64, max_tokens_limit=16)


@pytest.mark.parametrize("field", [{"stop": -1}, {"stop": [3, -1]}, {"stop_token_ids": [-1]}],
                         ids=["stop-int", "stop-list", "stop_token_ids"])
def test_a_negative_stop_token_id_is_a_400_naming_its_field(field):
    """A stop token id below 0 (-1 included) names no token: the request is refused with a 400 naming the field
    that held it ('stop' or 'stop_token_ids': session 74), not run with a stop that can never match."""
    with pytest.raises(APIError) as err:
        _parse({"prompt": [1, 2, 3], "max_tokens": 4, **field})
    assert err.value.status == 400 and err.value.param == next(iter(field)), err.value.message
    _, _, params = _parse({"prompt": [1, 2, 3], "max_tokens": 4, "stop_token_ids": [0]})  # (id 0 is a token)
    assert params.stop_token_ids == (0,)


def test_allowed_token_ids_takes_a_whole_vocabulary_of_the_cap_and_no_more():
    """allowed_token_ids may list ALLOWED_TOKEN_IDS_MAX (262,144) ids, a Gemma 3 vocabulary whole; one more is
    refused."""
    vocab = ALLOWED_TOKEN_IDS_MAX + 1
    ids = list(range(ALLOWED_TOKEN_IDS_MAX))
    req = CompletionRequest.model_validate({"prompt": [1], "allowed_token_ids": ids}, context={"vocab_size": vocab})
    assert len(req.allowed_token_ids) == ALLOWED_TOKEN_IDS_MAX
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate({"prompt": [1], "allowed_token_ids": ids + [ALLOWED_TOKEN_IDS_MAX]},
                                         context={"vocab_size": vocab})


@pytest.mark.parametrize("chat", [False, True], ids=["completion", "chat"])
def test_metadata_takes_at_most_16_pairs(chat):
    """OpenAI's `metadata` holds at most 16 key-value pairs: 16 are accepted (and change nothing), 17 are a 400
    naming 'metadata'."""
    base = {"messages": HI} if chat else {"prompt": [1, 2, 3]}
    pairs = {f"k{i}": "v" for i in range(16)}
    body = {**base, "max_tokens": 2, "metadata": pairs}
    if chat:  # (no tokenizer here: a chat renders nothing; only the request model's validation is exercised)
        req = ChatCompletionRequest.model_validate(body)
        assert len(req.metadata) == 16
    else:
        _parse(body)
    with pytest.raises(APIError) as err:
        _parse({**body, "metadata": {**pairs, "k16": "v"}}, chat)
    assert err.value.status == 400 and err.value.param == "metadata", err.value.message


def test_tokenize_reports_the_context_not_the_prompt_limit_as_max_model_len():
    """/tokenize's max_model_len is what /v1/models reports (the tokens one request may hold, prompt and
    generated), even where --max-prompt-tokens holds a prompt alone to fewer."""
    engine = _engine(max_prompt_tokens=100)
    assert engine.max_prompt_tokens == 100 < engine.max_kv_tokens
    with ServerThread(create_app(engine, ServerLimits(shutdown_grace_s=1.0))) as s:
        r = httpx.post(s.url + "/tokenize", json={"prompt": "hello"}, timeout=30)
        assert r.status_code == 200, r.text
        models = httpx.get(s.url + "/v1/models", timeout=30).json()["data"][0]["max_model_len"]
        assert r.json()["max_model_len"] == models == engine.max_kv_tokens


def test_a_requests_own_template_without_a_tokenizer_is_a_400(monkeypatch):
    """On a server with no tokenizer, a chat that brings its own chat_template (the server trusting request
    templates) is the 400 'chat_template_unavailable' (there is nothing to encode the rendered text with), on
    /tokenize and /v1/chat/completions alike, never a 500."""
    monkeypatch.setattr(server, "load_tokenizer", lambda model, vocab_size: None)
    limits = ServerLimits(shutdown_grace_s=1.0, trust_request_chat_template=True)
    with ServerThread(create_app(_engine(), limits)) as s:
        for path, body in (("/tokenize", {"messages": HI, "chat_template": TEMPLATE}),
                           ("/v1/chat/completions", {"messages": HI, "chat_template": TEMPLATE, "max_tokens": 2}),
                           ("/tokenize", {"messages": HI, "chat_template_kwargs": {"chat_template": TEMPLATE}})):
            r = httpx.post(s.url + path, json=body, timeout=30)
            assert r.status_code == 400, (path, r.status_code, r.text)
            assert r.json()["error"]["code"] == "chat_template_unavailable", r.text


def test_an_unknown_finish_reason_counts_as_an_error():
    """hicache_requests_finished (vLLM's request_success) keeps the four finish reasons stop, length, abort and
    error: an engine request that ends with any other reason (none, an empty one) counts as an error, so no
    stray label series appears on the dashboards."""
    metrics = ServerMetrics(_engine())
    metrics.ended("", 3, 0)
    metrics.ended("weird", 3, 1)
    counts = {s.labels["finish_reason"]: s.value for fam in metrics.finished.collect() for s in fam.samples
              if s.name.endswith("_total")}
    assert set(counts) == set(FINISH_REASONS), counts
    assert counts["error"] == 2 and sum(counts.values()) == 2
