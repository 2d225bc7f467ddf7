"""Structured outputs in the engine (scheduler/guided.py, SamplingParams.guided): every answer is what its
grammar allows, sampled or greedy, beside unguided requests that it must not change."""
from __future__ import annotations

import dataclasses
import json
import re

import pytest

from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.guided import GuidedSpec
from scheduler.request import RequestError, SamplingParams
from scheduler.tokenizer import ByteTokenizer
from tokenizer_files import write_byte_tokenizer

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}, "kind": {"enum": ["cat", "dog"]}},
          "required": ["n", "kind"], "additionalProperties": False}


@pytest.fixture(scope="module")
def eng():
    return Engine(EngineConfig(model="tiny", device="cpu", max_total_tokens=4096))


def _text(eng, result) -> str:
    return ByteTokenizer(eng.vocab_size).decode(result.output_ids)


def _guided(eng, spec: GuidedSpec, n: int = 4, **kw) -> list:
    prompt = ByteTokenizer(eng.vocab_size).encode("Answer: ")
    return [eng.generate([prompt], SamplingParams(max_tokens=48, seed=seed, guided=spec, **kw))[0]
            for seed in range(n)]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_every_answer_is_what_its_grammar_allows(eng, temperature):
    for r in _guided(eng, GuidedSpec("json_schema", json.dumps(SCHEMA)), temperature=temperature):
        if r.finish_reason == "stop":  # (a greedy random model may write digits up to max_tokens)
            value = json.loads(_text(eng, r))
            assert set(value) == {"n", "kind"} and isinstance(value["n"], int) and value["kind"] in ("cat", "dog")
        else:
            assert r.finish_reason == "length" and re.fullmatch(r'\{"n":-?[0-9]*', _text(eng, r)), _text(eng, r)
    for r in _guided(eng, GuidedSpec("regex", r"[0-9]{3}-[a-z]{2}"), temperature=temperature):
        assert r.finish_reason == "stop" and re.fullmatch(r"[0-9]{3}-[a-z]{2}", _text(eng, r))
    for r in _guided(eng, GuidedSpec("choice", json.dumps(["yes", "no", "maybe so"])), temperature=temperature):
        assert r.finish_reason == "stop" and _text(eng, r) in ("yes", "no", "maybe so")
    for r in _guided(eng, GuidedSpec("grammar", 'start: "(" num ")"\nnum: /[1-9][0-9]?/'), temperature=temperature):
        assert r.finish_reason == "stop" and re.fullmatch(r"\([1-9][0-9]?\)", _text(eng, r))
    eng.check_integrity()


def test_a_json_object_is_compact_json(eng):
    texts = [_text(eng, r) for r in _guided(eng, GuidedSpec.json_object(), n=6, temperature=1.0)]
    assert all(t.startswith("{") for t in texts)
    for t in texts:
        if t.endswith("}"):
            assert isinstance(json.loads(t), dict)


def test_unguided_requests_beside_guided_ones_are_unchanged(eng):
    """Masks apply to the guided rows only, their steps chained with the sampling deferred: the other
    requests' greedy answers are those they get alone."""
    tok = ByteTokenizer(eng.vocab_size)
    prompts = [tok.encode(f"request {i}: ") for i in range(6)]
    alone = [r.output_ids for r in eng.generate(prompts[::2], SamplingParams(max_tokens=20))]
    mixed = eng.generate(prompts, [SamplingParams(max_tokens=20) if i % 2 == 0 else
                                   SamplingParams(max_tokens=20, guided=GuidedSpec("regex", "[a-z]{4,30}"))
                                   for i in range(6)])
    assert [r.output_ids for r in mixed[::2]] == alone
    assert all(re.fullmatch("[a-z]{4,30}", _text(eng, r)) for r in mixed[1::2])
    eng.check_integrity()


@pytest.mark.parametrize("spec, says", [
    (GuidedSpec("regex", "[a-"), "does not compile"),
    (GuidedSpec("json_schema", '{"type": "nope"}'), "nope"),
    (GuidedSpec("json_schema", "not json"), "json_schema"),
    (GuidedSpec("grammar", "start: ("), "does not compile"),
    (GuidedSpec("choice", "[]"), "non-empty list"),
    (GuidedSpec("xml", "<a/>"), "GuidedSpec of kind"),
    ("a regex", "GuidedSpec of kind"),
])
def test_a_bad_grammar_is_that_requests_error(eng, spec, says):
    with pytest.raises(RequestError, match=re.escape(says)) as err:
        eng.add_request([10, 11], SamplingParams(guided=spec))
    assert err.value.param == "guided" and not eng.waiting


def test_a_simulated_engine_refuses_it():
    sim = Engine(EngineConfig(model="qwen3-0.6b", simulate=True))
    with pytest.raises(RequestError, match="simulated") as err:
        sim.add_request([10, 11], SamplingParams(guided=GuidedSpec.json_object()))
    assert err.value.param == "guided"


# -- a checkpoint with a tokenizer.json and an EOS ------------------------------------------------------
@pytest.fixture(scope="module")
def ckpt_eng(tmp_path_factory):
    import torch
    from safetensors.torch import save_file
    from tokenizers import Tokenizer

    from scheduler.loader import export_hf_state_dict
    from scheduler.model import Qwen3Model, init_random_weights
    from scheduler.presets import PRESETS

    path = write_byte_tokenizer(tmp_path_factory.mktemp("ckpt"), special=("<eos>",))  # (<eos>: id 256)
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    cfg = dataclasses.replace(PRESETS["tiny"], eos_token_id=256)
    model = init_random_weights(Qwen3Model.empty(cfg, torch.device("cpu"), torch.float32), 0)
    (path / "config.json").write_text(json.dumps(cfg.to_hf_config()))
    save_file(export_hf_state_dict(model), str(path / "model.safetensors"))
    eng = Engine(EngineConfig(model=str(path), device="cpu", max_total_tokens=1024))
    eng.tok = tok
    return eng


def test_eos_ends_an_answer_once_the_grammar_accepts_it(ckpt_eng):
    """A digit string may stop after any digit: with EOS favoured it stops at the first, the EOS its last id;
    before the grammar accepts, EOS is masked however much it is favoured."""
    prompt = ckpt_eng.tok.encode("n=").ids
    [r] = ckpt_eng.generate([prompt], SamplingParams(max_tokens=20, guided=GuidedSpec("regex", "[0-9]{2,5}"),
                                                     logit_bias={256: 50.0}))
    assert r.finish_reason == "stop" and r.output_ids[-1] == 256
    assert re.fullmatch("[0-9]{2}", ckpt_eng.tok.decode(r.output_ids[:-1]))
    [r] = ckpt_eng.generate([prompt], SamplingParams(max_tokens=20, guided=GuidedSpec("regex", "[0-9]{2,5}"),
                                                     logit_bias={256: -50.0}))
    assert r.finish_reason == "stop" and re.fullmatch("[0-9]{5}", ckpt_eng.tok.decode(r.output_ids))
    ckpt_eng.check_integrity()


def test_a_batch_of_masks_filled_at_once_equals_each_row_filled_alone(eng):
    """`fill_masks` (llguidance's threads, several rows) against `Guide.fill_mask` row by row, matchers at
    different states."""
    import torch

    from scheduler.guided import fill_masks

    tok = ByteTokenizer(eng.vocab_size)
    specs = [GuidedSpec("regex", "[a-z]{2}[0-9]+"), GuidedSpec("json_schema", json.dumps(SCHEMA)),
             GuidedSpec("choice", json.dumps(["alpha", "beta"])), GuidedSpec("regex", "[a-z]{2}[0-9]+")]
    guides = [eng.guides.start(s) for s in specs]
    for guide, text in zip(guides, ["ab", '{"n":1', "al", ""]):
        for t in tok.encode(text):
            assert guide.accept(t) is None
    together = torch.empty(len(guides), eng.guides.words, dtype=torch.int32)
    assert fill_masks(guides, together, [()] * len(guides)) == [True] * len(guides)
    for i, guide in enumerate(guides):
        alone = torch.empty(eng.guides.words, dtype=torch.int32)
        assert guide.fill_mask(alone)
        assert torch.equal(alone, together[i])
    assert not torch.equal(together[0], together[3])  # (the same grammar at two states)


def test_guided_steps_chain_and_answer_as_unchained_steps_do():
    """A chained step with guided rows enqueues its forward early and samples once the step before it is
    processed (`Engine._sample`): the batch keeps chaining, and every answer (penalized and seeded rows
    too, their counts taken from the host then) is the one an engine without overlap scheduling gives."""
    def answers(overlap: bool):
        eng = Engine(EngineConfig(model="tiny", device="cpu", max_total_tokens=4096, overlap_schedule=overlap))
        tok = ByteTokenizer(eng.vocab_size)
        spec = GuidedSpec("regex", "[a-z ]{5,40}")
        params = [SamplingParams(max_tokens=30), SamplingParams(max_tokens=30, guided=spec),
                  SamplingParams(max_tokens=30, guided=spec, temperature=1.0, seed=5, frequency_penalty=1.5,
                                 presence_penalty=0.5, logprobs=2),
                  SamplingParams(max_tokens=30, temperature=0.8, seed=9, repetition_penalty=1.3)]
        out = eng.generate([tok.encode(f"say {i}: ") for i in range(4)], params)
        eng.check_integrity()
        kept = [(r.output_ids, [round(lp.logprob, 4) for lp in r.logprobs or ()]) for r in out]
        return kept, eng.stats["chained_steps"]

    chained, steps = answers(True)
    unchained, none = answers(False)
    assert chained == unchained and none == 0 and steps >= 20
