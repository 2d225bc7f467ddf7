"""Gaps found by session 56's mutation check of the forward path and its neighbours (scheduler/model.py,
attention.py, step_extras.py, loader.py, guide_compiler.py): each test pins a rule whose removal no other test
noticed."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import re
from pathlib import Path

import pytest
import torch

from hicache_helpers import until
from scheduler.guided import GuidedSpec
from scheduler.loader import CheckpointError, export_hf_state_dict, load_checkpoint
from scheduler.model import Qwen3Model, init_random_weights
from scheduler.presets import PRESETS
from scheduler.request import RequestError, SamplingParams
from test_attention import check, make_seqs, run_step
import test_guided
from test_loader_hunt import random_model, write
from test_penalties import PROMPTS, make_engine

CPU = torch.device("cpu")
eng = test_guided.eng  # (its engine fixture: the tiny model behind a byte tokenizer)


# -- model.py -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_tied_random_model_does_not_just_repeat_its_input(seed):
    """The random-weight presets with tied embeddings (qwen3-0.6b, qwen3-4b) give the final norm random signs: with
    unit weights the logits are E @ norm(x), x holds the input token's own embedding, and greedy decoding emits the
    last prompt token forever (benchmarks and cache traces then see one token). Shown on the tiny shapes, tied."""
    cfg = dataclasses.replace(PRESETS["tiny"], tie_word_embeddings=True)
    model = init_random_weights(Qwen3Model.empty(cfg, CPU, torch.float32), seed)
    ids = [5, 6, 7, 8]
    with torch.inference_mode():
        for _ in range(8):
            ids.append(int(model.forward_dense(torch.tensor(ids), last_only=True)[0].argmax()))
    assert ids[4] != 8 and len(set(ids[4:])) > 1, ids[4:]


# -- attention.py ---------------------------------------------------------------------------------------------
def test_a_batchs_short_sequence_never_reads_a_nan_page_it_does_not_own():
    """A decode batch pads a shorter sequence's page table with its own first page: page 0, another request's,
    could hold NaN (a forward that went NaN there) and made every shorter sequence of the batch NaN too."""
    page_size = 4
    seqs, pool = make_seqs([3, 11], page_size, seed=7)
    seqs[0].pages, seqs[1].pages = [5], [2, 6, 3]  # (neither owns page 0)
    run_step([seqs[0]], pool, [0], [2], is_decode=False)
    run_step([seqs[1]], pool, [0], [10], is_decode=False)
    pool[:, :, 0] = float("nan")  # another request's page, gone NaN
    short, long = run_step(seqs, pool, [2, 10], [1, 1], is_decode=True)
    assert torch.isfinite(short).all() and torch.isfinite(long).all()
    check(short, seqs[0].ref[2:3])
    check(long, seqs[1].ref[10:11])


@pytest.mark.parametrize("page_size", [1, 4])
def test_a_prefill_batch_of_one_long_chunk_and_one_single_token_chunk(page_size):
    """A prefill batch whose only multi-token chunk sits beside a one-token chunk (a prompt cached but for its
    last token, next to a fresh prompt): both get their own attention, the one-token row included."""
    seqs, pool = make_seqs([6, 5], page_size, seed=8)
    run_step([seqs[1]], pool, [0], [4], is_decode=False)
    outs = run_step(seqs, pool, [0, 4], [6, 1], is_decode=False)
    check(outs[0], seqs[0].ref)
    check(outs[1], seqs[1].ref[4:5])
    # and the single row first in the batch
    seqs, pool = make_seqs([5, 6], page_size, seed=9)
    run_step([seqs[0]], pool, [0], [4], is_decode=False)
    outs = run_step(seqs, pool, [4, 0], [1, 6], is_decode=False)
    check(outs[0], seqs[0].ref[4:5])
    check(outs[1], seqs[1].ref)


# -- step_extras.py -------------------------------------------------------------------------------------------
@pytest.mark.asyncio
async def test_a_penalized_request_stopped_mid_chain_lets_go_of_its_device_state():
    """A penalized request that ends at a stop token while the next decode step is already chained, beside a guided
    request (whose step samples once the step before is processed): that step's row for it asks nothing, so its
    per-request device state is not made anew after `finish` dropped it (it stayed on the device with the Request
    until the caller let go of it)."""
    p = dict(max_tokens=12, ignore_eos=True, frequency_penalty=0.5, repetition_penalty=1.2)
    engine = make_engine()
    [first] = await engine.generate_async(PROMPTS[:1], [SamplingParams(**p)])
    out = first.output_ids
    stop = next(t for k, t in enumerate(out) if k >= 3 and t not in out[:k])
    await engine.start()
    try:
        req = engine.add_request(PROMPTS[0], SamplingParams(**p, stop_token_ids=(stop,)))
        guided = engine.add_request(PROMPTS[1], SamplingParams(max_tokens=20, guided=GuidedSpec("regex", "[a-z]{20}")))
        await until(lambda: req.state.done and guided.state.done, 60)
        for _ in range(20):  # (let the chained step after its end be processed too)
            await asyncio.sleep(0.01)
        assert req.finish_reason == "stop" and req.output == out[:out.index(stop) + 1]
        assert engine.stats["chained_steps"] > 0
        assert req.penalty_state is None
        engine.check_integrity()
    finally:
        await engine.shutdown()


# -- loader.py ------------------------------------------------------------------------------------------------
def test_a_checkpoint_index_cannot_name_files_outside_its_directory(tmp_path: Path):
    """model.safetensors.index.json names file names in the checkpoint's directory: a path ("../other.safetensors",
    "sub/x.safetensors") is refused, so an index cannot make the server read (and load) files elsewhere."""
    src = random_model()
    ckpt = write(tmp_path / "c", src.cfg.to_hf_config(), export_hf_state_dict(src), index=True)
    (ckpt / "model.safetensors").rename(tmp_path / "elsewhere.safetensors")
    names = json.loads((ckpt / "model.safetensors.index.json").read_text())["weight_map"]
    (ckpt / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": dict.fromkeys(names, "../elsewhere.safetensors")}))
    with pytest.raises(CheckpointError, match="weight_map"):
        load_checkpoint(ckpt, CPU, torch.float32)


def test_generation_configs_first_end_id_is_the_eos_where_config_json_names_none(tmp_path: Path):
    """A checkpoint whose config.json has no eos_token_id takes generation_config.json's first end id as its EOS
    (the one vLLM's check_stop ends at, reported with no stop_reason), the others as further end ids."""
    src = random_model()
    hf = {**src.cfg.to_hf_config(), "eos_token_id": None}
    ckpt = write(tmp_path / "c", hf, export_hf_state_dict(src))
    (ckpt / "generation_config.json").write_text(json.dumps({"eos_token_id": [9, 4]}))
    _, cfg, _ = load_checkpoint(ckpt, CPU, torch.float32)
    assert cfg.eos_token_id == 9 and cfg.eos_token_ids == (9, 4)


# -- guide_compiler.py ----------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", ["integer", ["integer", "null"], ["null", "integer"]])
def test_a_nullable_integer_bound_past_64_bits_is_refused(eng, kind):
    """llguidance clamps an integer bound past 64 bits (minimum 1e20 allowed 9223372036854775807, below it): such a
    schema is the request's error naming the 64-bit range, also where the type is a list with "integer" in it (a
    nullable integer; llguidance's own error there, "Failed to generate regex for integer range: min=Some(...)",
    names a bound the client never sent)."""
    schema = {"type": "object", "properties": {"n": {"type": kind, "minimum": 1e20}}, "required": ["n"]}
    with pytest.raises(RequestError, match=re.escape("64-bit")) as err:
        eng.add_request([10, 11], SamplingParams(guided=GuidedSpec("json_schema", json.dumps(schema))))
    assert err.value.param == "guided" and not eng.waiting

