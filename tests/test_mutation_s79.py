"""Session 79's mutation check of the code written since a7d30d1 (sessions 74-78): each test kills a mutant that no
test noticed, named in its docstring, through a public path (the table is in the session's report)."""
from __future__ import annotations

import asyncio
import os

import httpx
import numpy as np
import pytest

from hicache.l3_index import index_path
from hicache.radix import Tier
from hicache_helpers import assert_whole, make_manager, write_prefix
from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.request import SamplingParams
from test_request_ids import echo_srv, srv  # noqa: F401  (module fixtures: a server, one with the echo flag)

A = tuple(range(100, 132))  # 8 pages of 4 tokens
B = A[:16] + tuple(range(500, 516))


# -- hicache/l3_index.py -------------------------------------------------------------------------------------------
def _persisting(tmp_path, **config):
    return make_manager(storage_pages=64, storage_path=str(tmp_path / "l3.kv"), storage_persist=True, model_id="m1",
                        **config)


async def _saved_index(tmp_path) -> str:
    """A and B written through to a kept L3 file, closed cleanly: the index's path."""
    mgr = _persisting(tmp_path)
    for seed, tokens in enumerate((A, B)):
        write_prefix(mgr, tokens, seed=seed)
        await mgr.drain()
    await mgr.close()
    path = index_path(str(tmp_path / "l3.kv"))
    assert os.path.exists(path)
    return path


def _rewrite(path: str, edit) -> None:
    with np.load(path, allow_pickle=False) as data:
        arrays = {k: data[k] for k in data.files}
    edit(arrays)
    with open(path, "wb") as f:
        np.savez(f, **arrays)


@pytest.mark.asyncio
async def test_an_index_naming_no_file_size_is_not_adopted_where_no_file_is_left(tmp_path):
    """The L3 file deleted since the save, and the index's header naming no size (an older or edited index): the
    new, empty file's pages are not adopted as the saved prefixes' (mutant M1: `found is None or` dropped in
    hicache/l3_index.py _problem, None == None let it through)."""
    import json
    path = await _saved_index(tmp_path)
    os.unlink(tmp_path / "l3.kv")

    def no_size(arrays):
        header = json.loads(str(arrays["header"]))
        del header["file_bytes"]
        arrays["header"] = np.array(json.dumps(header))
    _rewrite(path, no_size)
    mgr = _persisting(tmp_path)
    assert mgr.tree.num_resident_pages[Tier.L3] == 0
    assert not os.path.exists(path)
    assert_whole(mgr)
    await mgr.close()


@pytest.mark.asyncio
async def test_an_index_with_a_node_of_no_tokens_is_ignored(tmp_path):
    """A node of 0 tokens (every sum still adds up) is a damaged index: ignored whole, L3 starts empty (mutant M2:
    `key_tokens <= 0` made `< 0` in hicache/l3_index.py _problem)."""
    path = await _saved_index(tmp_path)

    def empty_node(arrays):
        arrays["parents"] = np.append(arrays["parents"], 0)
        arrays["key_tokens"] = np.append(arrays["key_tokens"], 0)
        arrays["lru_ranks"] = np.append(arrays["lru_ranks"], len(arrays["lru_ranks"]))
    _rewrite(path, empty_node)
    mgr = _persisting(tmp_path)
    assert mgr.tree.num_resident_pages[Tier.L3] == 0
    assert_whole(mgr)
    await mgr.close()


# -- hicache/radix.py ----------------------------------------------------------------------------------------------
@pytest.mark.asyncio
async def test_resident_tokens_counts_only_what_the_tier_itself_holds():
    """A prefix L2 holds and L1 evicted: L1 holds none of it, whatever the tree still keeps of its nodes (mutant M10:
    `or child.pages[tier] is None` dropped in hicache/radix.py resident_tokens, which counted L2's pages as L1's and
    so ordered the queue under "lpm" by prefixes L1 no longer holds)."""
    mgr = make_manager(storage_pages=0)
    write_prefix(mgr, A)
    await mgr.drain()
    assert mgr.tree.resident_tokens(A, Tier.L2) == len(A)
    mgr.tree.evict(Tier.L1, mgr.l1.num_pages)
    assert mgr.tree.match(A, touch=False).lengths[:2] == [0, len(A)]
    assert mgr.tree.resident_tokens(A, Tier.L1) == 0
    assert mgr.tree.resident_tokens(A, Tier.L2) == len(A)
    assert_whole(mgr)
    await mgr.close()


# -- scheduler/reservations.py -------------------------------------------------------------------------------------
@pytest.mark.asyncio
async def test_lpm_counts_a_whole_cached_prompt_less_its_last_token_it_must_compute():
    """Under "lpm", a queued prompt that L1 holds whole (8 tokens, 2 pages) can reuse only its first page (its last
    token is computed: `_reusable`), fewer than a longer prompt's 2 pages that arrived after it: the longer one goes
    first (mutant M42: `end=req.prefill_len` for `req.prefill_len - 1` in scheduler/reservations.py _l1_held
    counted the whole prompt, a tie, arrival order)."""
    eng = Engine(EngineConfig(model="tiny", device="cpu", page_size=4, max_total_tokens=120, max_running_requests=1,
                              scheduling_policy="lpm"))
    whole = [7, 8, 9, 10, 11, 12, 13, 14]
    await eng.generate_async([whole], SamplingParams(max_tokens=1))  # (the loop runs on: both queued in one pass)
    longer = whole + [20, 21, 22, 23]
    reqs = [eng.add_request(p, SamplingParams(max_tokens=2)) for p in (whole, longer)]
    while not all(r.state.done for r in reqs):
        await asyncio.sleep(0.005)
    eng.check_integrity()
    await eng.shutdown()
    assert reqs[1].first_token_s < reqs[0].first_token_s
    assert reqs[1].hit_tokens["l1"] == 8 and reqs[0].hit_tokens["l1"] == 4


# -- scheduler/request_ids.py --------------------------------------------------------------------------------------
def test_an_empty_request_id_header_counts_as_none(srv):  # noqa: F811
    """vLLM's precedence: an empty X-Request-Id header is no id, the body's names the request (mutant M32: `if header
    is not None` for `if header` in scheduler/request_ids.py resolve_ids, a 400 "must not be empty")."""
    r = httpx.post(srv.url + "/v1/completions", json={"prompt": "abc", "max_tokens": 2, "request_id": "b-9"},
                   headers={"X-Request-Id": ""}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["id"] == "cmpl-b-9"


def test_a_responses_request_echoes_its_own_header_not_its_body_id(echo_srv):  # noqa: F811
    """A Response is named by its body alone, but --enable-request-id-headers echoes the request's own X-Request-Id
    header first, as vLLM's middleware (mutant M33: the id the generation ran under read first in
    scheduler/request_ids.py RequestIdHeaders)."""
    r = httpx.post(echo_srv.url + "/v1/responses", json={"input": "hi", "max_output_tokens": 2, "request_id": "resp_b"},
                   headers={"X-Request-Id": "hdr-3"}, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["id"] == "resp_b" and r.headers["x-request-id"] == "hdr-3"


# -- scheduler/responses_store.py ----------------------------------------------------------------------------------
def test_input_items_between_two_cursors_page_forward_from_after(srv):  # noqa: F811
    """`after` and `before` both given: the page is the first `limit` items after `after` (mutant M38: `and after is
    None` dropped in scheduler/responses_store.py input_items, which took the last ones before `before`)."""
    given = [{"type": "message", "role": "user", "content": t} for t in "abcde"]
    out = httpx.post(srv.url + "/v1/responses", json={"input": given, "max_output_tokens": 2}, timeout=60)
    assert out.status_code == 200, out.text
    url = f"{srv.url}/v1/responses/{out.json()['id']}/input_items"
    ids = [i["id"] for i in httpx.get(url, params={"order": "asc"}, timeout=60).json()["data"]]
    page = httpx.get(url, params={"order": "asc", "after": ids[0], "before": ids[4], "limit": 2}, timeout=60).json()
    assert [i["content"][0]["text"] for i in page["data"]] == ["b", "c"]
    assert page["has_more"] is True


# -- scheduler/responses_background.py -----------------------------------------------------------------------------
def test_a_background_stream_is_followed_after_its_first_event(srv):  # noqa: F811
    """`starting_after=0` is a sequence number, the first event's: the events after it (mutant M49: `<= 0` for `< 0`
    in scheduler/responses_background.py BackgroundResponses.get refused it as no sequence number)."""
    from test_responses_background import _streamed
    events = _streamed(srv.url + "/v1/responses", "POST", json={"input": "hi", "max_output_tokens": 2, "stream": True,
                                                                 "background": True})
    url = f"{srv.url}/v1/responses/{events[0]['response']['id']}"
    assert _streamed(url, params={"stream": "true", "starting_after": 0}) == events[1:]
