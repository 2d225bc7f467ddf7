"""Rules that session 80's mutation pass (over scheduler/server.py, tokenizer.py, guide_compiler.py, api_tokenize.py,
prompt_truncation.py, stop_strings.py, hicache/storage_redis.py, and session 79's survivors in hicache/redis_hints.py)
found no test to guard. Each test's docstring names the mutant it kills. Redis tests start `redis-server` on a free
loopback port (skipped without the binary)."""
from __future__ import annotations

import asyncio

import httpx
import pytest

from hicache.radix import Tier
from hicache_helpers import assert_whole, make_manager
from redis_server import needs_redis, private_server, random_pages, redis_server, server  # noqa: F401
from scheduler.server import ServerLimits
from server_fixtures import byte_level_server, ok, post, tiny_config
from test_recheck_race_s76 import hold_first_reply

_FIXTURES = (redis_server, server, private_server)  # (the Redis tests' fixtures, found by pytest under these names)
PREFIX = tuple(range(100, 116))  # 4 pages of 4 tokens
A, C = PREFIX + (1, 2, 3, 4), PREFIX + (9, 10, 11, 12)
NODEL = ("ACL", "SETUSER", "nodel", "reset", "on", ">pw", "~*", "+@all", "-del", "-unlink")  # (may not delete)


def _redis_manager(server):
    mgr = make_manager(storage_backend="redis", storage_url=server.url(), model_id="m")
    mgr.store.hint_timeout_s = 30.0  # (a bound only: a test holds a reply)
    return mgr


async def _written_by_another_instance(server, tokens) -> None:
    """tokens' full pages written to Redis by another engine of the same model (not this store: no hint, no
    `written` record of this store's queries)."""
    other = _redis_manager(server)
    keys = other.store.page_keys(tokens, 0, len(tokens))
    await other.store.write_pages(random_pages(other.geometry, len(keys)), range(len(keys)), range(len(keys)), keys)
    await other.close()


# ---- hicache/redis_hints.py: session 79's survivors -----------------------------------------------------------
@needs_redis
@pytest.mark.asyncio
async def test_a_refresh_reply_older_than_a_sibling_refresh_keeps_the_hints_the_sibling_published(server):
    """Prompt C's hint refresh asks Redis, which holds none of the shared prefix yet; before its reply is seen,
    another instance writes the prefix and prompt A's refresh finds it and hints it. C's older reply ("none", as
    the tree hinted before it asked) must not drop the hints A's newer one published: Redis holds those pages.
    (mutants: `>` for `>=` in refresh_hints' `present * ps >= hinted_tokens`, and `held = present` for
    `held = max(present, now_tokens // ps)`: both dropped A's 4 fresh hints as stale.)"""
    mgr = _redis_manager(server)
    store = mgr.store
    gate, answered, calls = hold_first_reply(store)
    refresh = asyncio.ensure_future(store.refresh_hints(mgr, C))
    await asyncio.wait_for(answered.wait(), 10)  # C's reply: none of its pages
    await _written_by_another_instance(server, PREFIX)
    await store.refresh_hints(mgr, A)  # A's: the prefix's 4 pages, hinted
    assert mgr.match(A).lengths[Tier.L3] == 16 and store.counters["hint_pages_published"] == 4
    gate.set()
    await asyncio.wait_for(refresh, 10)
    assert calls == [5, 5]
    assert store.counters["stale_hints_dropped"] == 0
    assert mgr.match(A).lengths[Tier.L3] == 16 and mgr.match(C).lengths[Tier.L3] == 16
    assert_whole(mgr)
    await mgr.close()


@needs_redis
@pytest.mark.asyncio
async def test_a_refresh_hints_every_page_redis_holds_past_what_the_tree_hinted(server):
    """The tree hints 2 of a prompt's 4 pages and Redis holds all 4: the refresh hints all 4.
    (mutant: `held = now_tokens // ps` for `held = max(present, now_tokens // ps)`.)"""
    mgr = _redis_manager(server)
    store = mgr.store
    await _written_by_another_instance(server, PREFIX[:8])
    await store.refresh_hints(mgr, PREFIX[:8])
    assert mgr.match(PREFIX).lengths[Tier.L3] == 8
    await _written_by_another_instance(server, PREFIX)
    await store.refresh_hints(mgr, PREFIX)
    assert mgr.match(PREFIX).lengths[Tier.L3] == 16 and store.counters["hint_pages_found"] == 2 + 4
    assert_whole(mgr)
    await mgr.close()


@needs_redis
@pytest.mark.asyncio
async def test_pages_a_suspect_delete_removed_are_hinted_again_once_another_instance_writes_them_clean(server):
    """A suspect prefix's pages deleted from Redis (a NaN answer) are no longer suspect: once another instance
    computed them again and wrote them, this instance's refresh hints them (and deletes nothing more). (mutant:
    `_delete` without `self._suspect.difference_update(keys)`: the pages stayed suspect for good, every refresh of
    the prompt deleted the clean pages other instances wrote, and never hinted them.)"""
    mgr = _redis_manager(server)
    store = mgr.store
    await _written_by_another_instance(server, PREFIX)
    keys = store.page_keys(PREFIX, 0, 16)
    store.delete_suspect(keys)
    await store.settle_deletes()
    assert store.counters["suspect_pages_deleted"] == 4 and server.client().exists(*keys) == 0
    await _written_by_another_instance(server, PREFIX)  # recomputed clean elsewhere
    await store.refresh_hints(mgr, PREFIX)
    assert store.counters["suspect_pages_deleted"] == 4 and server.client().exists(*keys) == 4
    assert mgr.match(PREFIX).lengths[Tier.L3] == 16 and store.counters["hint_pages_found"] == 4
    assert_whole(mgr)
    await mgr.close()


@needs_redis
@pytest.mark.asyncio
async def test_a_refresh_counts_found_only_the_pages_before_the_first_suspect_one(server):
    """Suspect pages whose delete the server refused (an ACL without DEL) stay in Redis, never hinted: a refresh
    of their prompt finds and hints the 2 pages before the first suspect one, and counts those 2 found, not the 4
    Redis holds. (mutant: `present, held = present, first` for `min(present, first), first`.)"""
    sync = server.client()
    sync.execute_command(*NODEL)
    try:
        mgr = make_manager(storage_backend="redis", storage_url=f"redis://nodel:pw@127.0.0.1:{server.port}/0",
                           model_id="m")
        store = mgr.store
        keys = store.page_keys(PREFIX, 0, 16)
        await store.write_pages(random_pages(mgr.geometry, 4), range(4), range(4), keys)
        store.delete_suspect(keys[2:])
        await store.settle_deletes()
        assert store.errors == {"eio": 1} and sync.exists(*keys) == 4  # (refused: NOPERM)
        await store.refresh_hints(mgr, PREFIX)
        assert store.counters["suspect_pages_deleted"] == 0 and store.errors == {"eio": 2}  # (asked again)
        assert store.counters["hint_pages_found"] == 2 and store.counters["hint_pages_published"] == 2
        assert mgr.match(PREFIX).lengths[Tier.L3] == 8
        assert_whole(mgr)
        await mgr.close()
    finally:
        sync.execute_command("ACL", "DELUSER", "nodel")


@needs_redis
@pytest.mark.asyncio
async def test_suspect_pages_this_store_writes_again_are_hinted_again(server):
    """Suspect pages whose delete the server refused, then written again by this store (the prefix recomputed and
    backed up: clean pages): a refresh of their prompt hints them, deleting nothing. (mutant: RedisStore._write
    without `self._suspect.difference_update(keys)`, in hicache/storage_redis.py: they stayed suspect, every refresh
    asked to delete them again and never hinted them.)"""
    sync = server.client()
    sync.execute_command(*NODEL)
    try:
        mgr = make_manager(storage_backend="redis", storage_url=f"redis://nodel:pw@127.0.0.1:{server.port}/0",
                           model_id="m")
        store = mgr.store
        keys = store.page_keys(PREFIX, 0, 16)
        await store.write_pages(random_pages(mgr.geometry, 4), range(4), range(4), keys)
        store.delete_suspect(keys)
        await store.settle_deletes()
        assert store.errors == {"eio": 1}  # (refused: NOPERM)
        await store.write_pages(random_pages(mgr.geometry, 4, seed=1), range(4), range(4), keys)
        await store.refresh_hints(mgr, PREFIX)
        assert store.errors == {"eio": 1} and store.counters["hint_pages_published"] == 4
        assert mgr.match(PREFIX).lengths[Tier.L3] == 16
        assert_whole(mgr)
        await mgr.close()
    finally:
        sync.execute_command("ACL", "DELUSER", "nodel")

# ---- over HTTP: stop strings, truncate_prompt_tokens ----------------------------------------------------------
@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    # a context of 160 tokens (40 pages of 4), max_tokens up to 16, prompts up to 8 tokens
    with byte_level_server(tmp_path_factory, tiny_config(num_pages=40, max_new_tokens_limit=16),
                           limits=ServerLimits(shutdown_grace_s=1.0, max_prompt_tokens=8)) as s:
        yield s


def test_a_completion_ending_in_the_start_of_a_stop_string_keeps_that_text(srv):
    """A generation that ends (at max_tokens) on text that begins a stop string returns that text: it was held back
    in case the stop string followed, and let go at the end. (mutant: CompletionText.flush's
    `return text if self.stopped else text + self.matcher.flush()` as `return text`, in scheduler/stop_strings.py:
    the held text was lost.)"""
    body = {"prompt": "hi", "max_tokens": 6, "temperature": 0}
    text = ok(srv, "/v1/completions", body)["choices"][0]["text"]
    assert text
    choice = ok(srv, "/v1/completions", {**body, "stop": [text[-1] + "\u2603\u2603"]})["choices"][0]
    assert choice["text"] == text and choice["finish_reason"] == "length", (text, choice)


def test_a_truncation_past_a_longest_prompt_of_one_token_is_a_400_naming_it(srv):
    """A beam search of max_tokens 8 under a prompt limit of 8 tokens may have a prompt of 1 token (its steps send
    prompt + max_tokens - 1): truncate_prompt_tokens 2 is a 400 naming the field. (mutant: `longest <= 1` for
    `longest < 1` in scheduler/prompt_truncation.py kept_tokens: it kept 2 tokens and served the request.)"""
    r = post(srv, "/v1/completions", {"prompt": "hi", "max_tokens": 8, "use_beam_search": True,
                                      "truncate_prompt_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == "truncate_prompt_tokens", r.text
    assert "the longest prompt this request can have, 1 tokens" in r.json()["error"]["message"]


def test_a_max_tokens_past_its_limit_is_the_400_a_truncation_gets(srv):
    """max_tokens 155 (past the limit of 16) with truncate_prompt_tokens 8, within the longest prompt that the
    limit's max_tokens leaves: the 400 names max_tokens, the field to fix. (mutant: `_longest_prompt` without the
    clamp to max_tokens_limit, in scheduler/prompt_truncation.py: a 400 naming truncate_prompt_tokens, its longest
    prompt of 6 tokens counted from the refused max_tokens.)"""
    r = post(srv, "/v1/completions", {"prompt": "hello world", "max_tokens": 155, "truncate_prompt_tokens": 8})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text


# ---- scheduler/server.py --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def wide(tmp_path_factory):
    # ServerLimits' prompt limit past the engine's (a context of 160 tokens): the engine's holds
    with byte_level_server(tmp_path_factory, tiny_config(num_pages=40, max_new_tokens_limit=16),
                           limits=ServerLimits(shutdown_grace_s=1.0, max_prompt_tokens=10_000)) as s:
        yield s


def test_a_server_prompt_limit_past_the_engine_s_reports_and_holds_the_engine_s(wide):
    """ServerLimits.max_prompt_tokens above what the engine can hold: /hicache/status reports the engine's limit,
    the one prompts are held to. (mutant: _ServerState.prompt_limit returning the server's limit alone, without
    `min(limit, ...)`.)"""
    limit = wide.engine.max_prompt_tokens
    status = httpx.get(wide.url + "/hicache/status", timeout=30).json()
    assert limit < 10_000 and status["server"]["limits"]["max_prompt_tokens"] == limit


def test_an_engine_refusal_of_the_first_prompt_of_a_batch_names_it(wide):
    """The engine refuses prompt 0 of a batch of 2 (prompt + max_tokens past the context): the 400 says which
    prompt. (mutant: `index == 0` for `batch_size == 1` in scheduler/server.py _refused: the batch's first prompt
    was refused as a lone prompt's.)"""
    r = post(wide, "/v1/completions", {"prompt": [[5] * 150, [5, 6]], "max_tokens": 16})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["message"].startswith("prompt 0 of the batch: prompt (150) + max_tokens (16)"), err
    assert err["param"] == "max_tokens", err
