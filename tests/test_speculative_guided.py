"""Speculative decoding of structured outputs (scheduler/guided.py `valid_drafts`, `fill_verify_masks`;
step_extras `_verify_masks`; speculative `graph_rows`): drafts are cut where the grammar would refuse one, each
verify row is masked by the grammar's state after the drafts before it, and each token taken is judged by its own
row's mask. On the tiny CPU engine in float32, greedy answers (and top_k 1 draws) equal plain decoding's, served
once and again (the first answers drafted from the prefix cache), beside unguided requests; with min_tokens too,
where a row whose grammar allows only the held stop ids does not hold them."""
from __future__ import annotations

import json

import pytest

from scheduler.config import EngineConfig
from scheduler.engine import Engine
from scheduler.guided import GuidedSpec
from scheduler.request import SamplingParams
from scheduler.speculative import SpeculativeConfig, eligible, graph_rows
from scheduler.tokenizer import ByteTokenizer
from test_speculative import record_steps

SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}, "kind": {"enum": ["cat", "dog"]}},
          "required": ["n", "kind"], "additionalProperties": False}
SPECS = {
    "regex": GuidedSpec("regex", "[a-z ]{5,40}"),
    "json_schema": GuidedSpec("json_schema", json.dumps(SCHEMA)),
    "choice": GuidedSpec("choice", json.dumps(["alpha beta gamma", "alpha beta delta", "omega"])),
    "grammar": GuidedSpec("grammar", 'start: "(" num ")" " " word\nnum: /[1-9][0-9]?/\nword: /[a-z]{3,12}/'),
}
SPEC = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=3, prompt_lookup_min=1, draft_policy="always")


def make(speculative=None) -> Engine:
    return Engine(EngineConfig(model="tiny", device="cpu", dtype="float32", page_size=4, num_pages=1024,
                               speculative=speculative))


@pytest.fixture(scope="module")
def plain() -> Engine:
    return make()


def prompts(eng) -> list[list[int]]:
    tok = ByteTokenizer(eng.vocab_size)
    return [tok.encode(t) for t in ("Answer: ", "abc abc abc abc ", "The cat and the dog and the cat ")]


@pytest.mark.parametrize("kind", list(SPECS))
@pytest.mark.parametrize("extra", [{}, {"temperature": 0.7, "top_k": 1}], ids=["greedy", "top_k 1"])
def test_guided_requests_verify_and_equal_plain_decoding(plain, kind, extra, monkeypatch):
    ps = prompts(plain)
    guided = SamplingParams(max_tokens=32, guided=SPECS[kind], **extra)
    params = [guided, SamplingParams(max_tokens=31), guided]  # (an unguided neighbour in the same steps)
    want = plain.generate(ps, [SamplingParams(max_tokens=32, guided=SPECS[kind]), params[1],
                               SamplingParams(max_tokens=32, guided=SPECS[kind])])
    eng = make(SPEC)
    steps = record_steps(monkeypatch)
    for _ in range(2):  # served once (prompt lookup), then again (the first answers, from the prefix cache)
        got = eng.generate(ps, params)
        assert [r.output_ids for r in got] == [r.output_ids for r in want]
        assert [r.finish_reason for r in got] == [r.finish_reason for r in want]
        assert all(r.error is None for r in got)
    assert sum(len(s.yielded) - 1 for s in steps if s.max_tokens == 32) > 0  # (the guided ones' drafts accepted)
    assert eng.speculator.stats["cache_accepted_tokens"] > 0
    eng.check_integrity()


def test_drafts_stop_where_the_grammar_would_refuse_one(plain):
    guide = plain.guides.start(GuidedSpec("regex", "[0-9]{2,8}"))
    tok = ByteTokenizer(plain.vocab_size)
    digits, letter = tok.encode("1234"), tok.encode("x")
    assert guide.valid_drafts(digits + letter + digits) == digits
    assert guide.valid_drafts(letter + digits) == [] and guide.valid_drafts([]) == []
    assert guide.valid_drafts(digits) == digits and guide.matcher.validate_tokens(digits) == 4  # (nothing consumed)


def test_a_verify_step_takes_only_drafts_its_grammar_allows(plain, monkeypatch):
    """Prompt lookup proposes what followed the answer's digits in the prompt, letters among them: such drafts are
    cut before the first letter (the step verifies fewer rows), and the answer equals plain decoding's."""
    from scheduler.guided import Guide
    tok = ByteTokenizer(plain.vocab_size)
    prompt = tok.encode("1x2x3x4x5x6x7x8x9x0x" * 2)
    params = SamplingParams(max_tokens=24, guided=GuidedSpec("regex", "[0-9]{8,30}"))
    [want] = plain.generate([prompt], params)
    eng = make(SPEC)
    steps = record_steps(monkeypatch)
    cuts = []
    valid = Guide.valid_drafts
    monkeypatch.setattr(Guide, "valid_drafts", lambda self, d: cuts.append((d, valid(self, d))) or cuts[-1][1])
    [got] = eng.generate([prompt], params)
    assert got.output_ids == want.output_ids
    digits = set(tok.encode("0123456789"))
    assert any(len(kept) < len(d) for d, kept in cuts)  # (some proposal had a letter)
    assert all(set(s.draft) <= digits for s in steps) and any(s.draft for s in steps)


def test_the_verify_masks_are_each_rows_after_the_drafts_before_it(plain):
    """fill_verify_masks' rows equal the masks of a matcher taken through the drafts one by one, and leave it
    where it was."""
    import torch

    from scheduler.guided import fill_verify_masks
    tok = ByteTokenizer(plain.vocab_size)
    spec = GuidedSpec("regex", "(ab|cd)[0-9]{1,3}")
    g1, g2 = plain.guides.start(spec), plain.guides.start(spec)
    drafts = [tok.encode("ab1"), tok.encode("c")]
    masks = torch.zeros(len(drafts[0]) + 1 + len(drafts[1]) + 1, g1.words, dtype=torch.int32)
    fill_verify_masks([g1, g2], drafts, masks)
    ref = plain.guides.start(spec)
    want = []
    for d in drafts:
        for j in range(len(d) + 1):
            row = torch.zeros(g1.words, dtype=torch.int32)
            ref.fill_mask(row)
            want.append(row)
            if j < len(d):
                assert ref.accept(d[j]) is None
        ref.matcher.rollback(len(d))
    assert torch.equal(masks, torch.stack(want))
    assert g1.rows_allow_none == [False] * 4 and g2.rows_allow_none == [False] * 2
    assert g1.matcher.validate_tokens(tok.encode("cd9")) == 3  # (left at its start)


@pytest.mark.parametrize("new_lens, stride, packed, want", [
    ([3, 2, 4], 0, [0, 2, 5, 8], [0, 2, 5, 8]),
    ([3, 2, 4], 4, [0, 2, 3, 4, 5, 8], [0, 2, 4, 5, 8, 11]),
])
def test_graph_rows(new_lens, stride, packed, want):
    assert graph_rows(packed, new_lens, stride) == want


def test_guided_requests_with_min_tokens_speculate():
    assert eligible(SamplingParams(max_tokens=8, guided=SPECS["regex"]))
    assert eligible(SamplingParams(max_tokens=8, guided=SPECS["regex"], min_tokens=2))


def unheld_rows_recorded(monkeypatch) -> list[dict]:
    """Every verify step's `_verify_masks` answer: per guided request, the rows whose stops are not held."""
    from scheduler import step_extras
    seen, orig = [], step_extras._verify_masks
    monkeypatch.setattr(step_extras, "_verify_masks", lambda *a: seen.append(orig(*a)) or seen[-1])
    return seen


@pytest.mark.parametrize("pattern, stop, min_tokens", [
    ("[a-z ]{5,40}", " ", 6),   # a space stops the answer, held for its first 6 tokens
    ("x{2}y", "y", 5),          # after "xx" the grammar allows only the held stop "y": it wins
])
def test_guided_with_min_tokens_verifies_and_equals_plain_decoding(plain, pattern, stop, min_tokens, monkeypatch):
    """A grammar with min_tokens and a stop id through verify steps: each row holds the stop while its own token is
    within min_tokens, unless its grammar allows nothing else there (then the grammar wins, as in a plain step:
    before, such a row was all -inf). Served once and again, equal to plain decoding."""
    tok = ByteTokenizer(plain.vocab_size)
    [stop_id] = tok.encode(stop)
    ps = [tok.encode("xxyxxyxxy abc abc abc xxy"), tok.encode("The cat and the dog and the cat ")]
    params = SamplingParams(max_tokens=24, guided=GuidedSpec("regex", pattern), min_tokens=min_tokens,
                            stop_token_ids=[stop_id])
    want = plain.generate(ps, params)
    eng = make(SPEC)
    steps = record_steps(monkeypatch)
    unheld = unheld_rows_recorded(monkeypatch)
    for _ in range(2):
        got = eng.generate(ps, params)
        assert [r.output_ids for r in got] == [r.output_ids for r in want]
        assert [r.finish_reason for r in got] == [r.finish_reason for r in want]
        assert all(r.error is None for r in got)
    assert any(s.draft for s in steps)
    if pattern == "x{2}y":  # the grammar won inside a verify step, at a row after drafts
        assert want[0].output_ids == tok.encode("xxy") and want[0].finish_reason == "stop"
        assert any(j > 0 for u in unheld for rows in u.values() for j in rows)
    eng.check_integrity()
