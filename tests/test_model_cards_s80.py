"""/v1/models under several --served-model-name names (session 80): vLLM lists a card per name (its
`show_available_models`, one per base model path), and a client that lists the models to find the alias it was
configured with (the openai SDK's models.list) found only the first; the SDK's models.retrieve of the second name
answered with the first name's card. Each name now has its own card, in the order given."""
from __future__ import annotations

import httpx
import openai
import pytest

from scheduler.server import ServerLimits
from server_fixtures import byte_level_server, tiny_config

NAMES = ("org/model-8b", "model-8b", "default")


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    limits = ServerLimits(shutdown_grace_s=1.0, served_model_names=NAMES)
    with byte_level_server(tmp_path_factory, tiny_config(max_new_tokens_limit=8), limits=limits) as s:
        yield s


def test_every_served_name_is_listed_with_its_own_card(srv):
    with openai.OpenAI(base_url=srv.url + "/v1", api_key="none", max_retries=0, timeout=30) as client:
        cards = client.models.list().data
        assert [card.id for card in cards] == list(NAMES)
        assert all(card.object == "model" and card.max_model_len == cards[0].max_model_len for card in cards)
        for name in NAMES:
            assert client.models.retrieve(name).id == name
            # each listed name serves requests; the reply names the first, as vLLM's
            reply = client.completions.create(model=name, prompt=[1, 2, 3], max_tokens=1)
            assert reply.model == NAMES[0]


def test_without_served_names_one_card_is_listed(tmp_path_factory):
    """The model's own names (its path, the path's last part, its id) all serve requests, but the list has one
    card, as vLLM's (its one name: the model path)."""
    with byte_level_server(tmp_path_factory, tiny_config(max_new_tokens_limit=8)) as s:
        listed = httpx.get(s.url + "/v1/models", timeout=30).json()["data"]
        assert [card["id"] for card in listed] == ["tiny"]
        assert httpx.get(s.url + f"/v1/models/{s.engine.model_id}", timeout=30).json()["id"] == s.engine.model_id
