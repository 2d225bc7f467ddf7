"""Gaps found by session 66's mutation check of the forward path and its neighbours (scheduler/model.py,
attention.py, step_extras.py, loader.py, memory_plan.py): each test pins a rule whose removal no other test
noticed (session 56's are in tests/test_mutation_forward_s56.py)."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from hicache.config import MAX_TIER_PAGES
from hicache_helpers import finish, read_stream
from scheduler import memory_plan, step_extras
from scheduler.attention import AttentionBatch
from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.loader import CheckpointError, export_hf_state_dict, load_checkpoint
from scheduler.memory_plan import activation_reserve_bytes, l1_budget_pages
from scheduler.model import Qwen3Model, init_random_weights
from scheduler.presets import PRESETS, get_preset
from scheduler.request import Request, RequestState, SamplingParams
from scheduler.runner import BatchInput
from scheduler.tokenizer import ByteTokenizer
from test_loader_hunt import random_model, write

CPU = torch.device("cpu")


# -- model.py -------------------------------------------------------------------------------------------------
@torch.no_grad()
def test_the_rope_tables_grow_past_max_position_embeddings_for_a_paged_forward():
    """`rope_tables` is sized to max_position_embeddings and grows past it to the batch's longest sequence
    (prefix + new, not the prefix alone): a paged prefill longer than the config's positions equals the dense one."""
    cfg = dataclasses.replace(PRESETS["tiny"], max_position_embeddings=8)
    model = init_random_weights(Qwen3Model.empty(cfg, CPU, torch.float32), seed=0)
    ids = torch.randint(0, cfg.vocab_size, (13,), generator=torch.Generator().manual_seed(1))
    pool = torch.zeros(cfg.kv_geometry(4, torch.float32).l1_shape(8))
    batch = AttentionBatch.build([0], [13], [[5, 1, 6, 2]], 4, "cpu", is_decode=False)
    torch.testing.assert_close(model(ids, batch, pool)[0], model.forward_dense(ids)[-1], rtol=1e-5, atol=1e-5)


# -- attention.py ---------------------------------------------------------------------------------------------
def test_a_sequence_of_no_new_tokens_is_refused():
    """A sequence with new_len 0 would take the row before it as its last row (another sequence's logits)."""
    with pytest.raises(ValueError, match="new_len >= 1"):
        AttentionBatch.build([0, 3], [2, 0], [[1], [2]], 4, "cpu", is_decode=False)


# -- step_extras.py -------------------------------------------------------------------------------------------
def _asked(reqs: list[Request], binput: BatchInput, eos_ids=(7,)) -> BatchInput:
    step_extras.ask(reqs, binput, eos_ids)
    return binput


@pytest.mark.parametrize("params", [dict(min_tokens=5, stop_token_ids=(9,)),
                                    dict(allowed_token_ids=(3, 4, 5)),
                                    dict(bad_words_token_ids=((3,), (4, 5)))])
def test_a_row_whose_request_ended_asks_no_min_tokens_or_bans_inputs(params):
    """A deferred step's row whose request ended at the step before (an abort before min_tokens, or one with token
    bans) asks neither penalty (min_tokens' held stops) nor ban inputs: they made it a new PenaltyState after
    `finish` had dropped it, kept on the device with the Request. The live row beside it still asks."""
    ended = Request([1, 2, 3], SamplingParams(max_tokens=10, **params))
    ended.output, ended.state = [4], RequestState.ABORTED
    live = Request([1, 2, 3], SamplingParams(max_tokens=10, **params))
    live.output, live.state = [4], RequestState.DECODE
    binput = _asked([ended, live], BatchInput(prefix_lens=[3, 3], new_lens=[1, 1], is_decode=True))
    rows = binput.penalties if "min_tokens" in params else binput.bans
    assert rows[0] is None and rows[1] is not None
    assert ended.penalty_state is None


@pytest.mark.asyncio
async def test_a_request_that_stopped_is_not_failed_by_the_chained_step_after_it():
    """A request that stops at decode step N while step N + 1 was already chained: N + 1's row had no token left
    (its bad words ban both allowed ids after the stop token), argmax's token 0 is a banned one, yet the request
    keeps its stop: a request that ended is never judged by its bans again (`fail_broken_bans`)."""
    tok = ByteTokenizer(512)
    [a, b] = tok.encode("ab")
    engine = Engine(EngineConfig(model="tiny", device="cpu", max_total_tokens=4096))
    await engine.start()
    try:
        req = engine.add_request(tok.encode("x: "), SamplingParams(
            max_tokens=10, allowed_token_ids=(a, b), bad_words_token_ids=((b, b), (a, a), (a, b)),
            logit_bias={b: 100.0}, stop_token_ids=(a,)))
        assert await read_stream(req) == ([b, a], "stop")
        await engine.stop_loop()  # (the chained step after the stop is processed by then)
        assert req.state is RequestState.FINISHED and req.error is None and engine.stats["chained_steps"] > 0
    finally:
        await finish(engine)


# -- loader.py ------------------------------------------------------------------------------------------------
def test_a_tensor_in_two_shards_is_refused(tmp_path: Path):
    """A tensor that two shards both hold is refused naming both (else the later file's silently won)."""
    src = random_model()
    tensors = export_hf_state_dict(src)
    ckpt = write(tmp_path / "c", src.cfg.to_hf_config(), tensors, shards=2)
    save_file({"model.norm.weight": tensors["model.norm.weight"] * 2}, str(ckpt / "extra.safetensors"))
    with pytest.raises(CheckpointError, match=r"model\.norm\.weight appears in both"):
        load_checkpoint(ckpt, CPU, torch.float32)


def test_a_transposed_tensor_of_the_same_size_is_refused_naming_its_shape(tmp_path: Path):
    """Shapes are compared, not sizes: a [H, V] embedding where [V, H] is due is a CheckpointError naming both
    shapes (not torch's copy error, which the server does not name as a checkpoint problem)."""
    src = random_model()
    tensors = export_hf_state_dict(src)
    tensors["model.embed_tokens.weight"] = tensors["model.embed_tokens.weight"].t().contiguous()
    ckpt = write(tmp_path / "c", src.cfg.to_hf_config(), tensors)
    with pytest.raises(CheckpointError, match=r"embed_tokens\.weight.*shape \(64, 512\).*\(512, 64\)"):
        load_checkpoint(ckpt, CPU, torch.float32)


# -- memory_plan.py -------------------------------------------------------------------------------------------
QWEN8 = get_preset("qwen3-8b")
GEOMETRY = QWEN8.kv_geometry(16, torch.bfloat16)


def test_l1_is_held_to_the_pages_a_tier_can_have():
    """A device of petabytes: L1 takes at most MAX_TIER_PAGES pages (page ids are 31-bit)."""
    assert l1_budget_pages(EngineConfig(), QWEN8, GEOMETRY, 1 << 60, 0) == MAX_TIER_PAGES


def test_the_least_l1_is_one_request_of_max_context_tokens_where_that_is_shorter():
    """The least L1 is 2 pages and one request's: of 4,096 tokens, or max_context_tokens where fewer."""
    cfg = EngineConfig(gpu_memory_fraction=0.5, max_context_tokens=256)
    reserve = activation_reserve_bytes(QWEN8, cfg, 2)
    least = 2 + 256 // 16
    total = 2 * (least * GEOMETRY.bytes_per_page + reserve)
    assert l1_budget_pages(cfg, QWEN8, GEOMETRY, total, 0) == least


def test_at_a_fraction_of_one_the_refusal_does_not_advise_raising_it():
    """At --gpu-memory-fraction 1 the refusal names the reserve's flags and --max-total-tokens only."""
    with pytest.raises(ValueError) as err:
        l1_budget_pages(EngineConfig(gpu_memory_fraction=1.0), QWEN8, GEOMETRY, 8 * (1 << 30), 8 * (1 << 30))
    assert "raise --gpu-memory-fraction" not in str(err.value) and "--max-total-tokens" in str(err.value)
    with pytest.raises(ValueError, match="raise --gpu-memory-fraction"):
        l1_budget_pages(EngineConfig(gpu_memory_fraction=0.5), QWEN8, GEOMETRY, 8 * (1 << 30), 8 * (1 << 30))


def test_a_simulated_engine_on_cuda_does_not_size_l1_from_this_machines_gpu(monkeypatch):
    """--simulate with no L1 size given takes the default L1, not one read from this machine's GPU memory."""
    monkeypatch.setattr(memory_plan, "l1_pages_from_memory", lambda *a: pytest.fail("read the GPU's memory"))
    cfg = EngineConfig(simulate=True, max_total_tokens=0, num_pages=0)
    pages, _ = memory_plan.plan_pools(cfg, torch.device("cuda"), QWEN8, GEOMETRY, "m")
    assert pages == cfg.l1_pages(GEOMETRY.page_size)


def test_the_start_line_shows_a_tier_of_exactly_one_gib_in_gib():
    status = {"engine": {"model": "m", "device": "cpu", "dtype": "bf16", "page_size": 16},
              "tiers": {"l1": {"capacity_pages": 4, "capacity_bytes": 1 << 30}, "l2": None}}
    assert memory_plan.pools_line(status) == "m on cpu (bf16): L1 64 tokens (1.00 GiB)"
