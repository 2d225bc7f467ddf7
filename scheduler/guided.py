"""Structured outputs: a request's tokens held to a grammar (OpenAI's `response_format`, vLLM's `guided_*`
fields; SamplingParams.guided), by llguidance's matcher (https://github.com/guidance-ai/llguidance).

A `GuidedSpec` names what the answer must be: text matching a JSON schema (a JSON object: the schema
{"type": "object"}), a regex, one of a list of strings, or a Lark grammar. JSON is compact: no whitespace
between tokens unless a schema's "x-guidance" asks for it (a model could otherwise spend its tokens on
blanks). The engine's `Guides` turns a spec into a grammar (checked before the request is queued: a bad
schema is that request's error) and each request into a `Guide`, its matcher:

* before each step that samples for the request, its row's allowed tokens are a bitmask the host fills
  from the matcher's state (`step_extras.ask`); the runner sets every other logit to -inf (`apply_masks`)
  after the penalties, so sampling (greedy, top-p, seeded) picks among the allowed ones only;
* the sampled token advances the matcher (`Admission.after_step`); once the grammar is complete (only EOS
  could follow) the request ends with finish_reason "stop"; a grammar wins over min_tokens: where it allows
  only the stop ids min_tokens holds back, they are not held (`step_extras.ask`), and where a mask allows
  nothing (a grammar whole before its first token, on a model without EOS) the step's token is dropped and
  the request ends ("stop", or an error where the grammar is not whole);
* a step's mask needs the token before it: a chained decode step (overlap scheduling) with guided rows
  enqueues its forward before the step before it is back, as any chained step, and its sampling only once
  the host has processed that step's tokens, its masks made then (`Engine._launch` / `_sample`,
  `ModelRunner.sample`): the device runs the forward meanwhile.

A model without EOS ids (the random-weight presets) gets a stand-in EOS that its masks never allow: such
a request ends when its grammar does, or at max_tokens. (With a checkpoint tokenizer that has no EOS either,
llguidance's stand-in is id 0, which such a grammar then cannot use.) llguidance is imported on the first guided
request: an engine without it serves everything else (and refuses guided requests with a clear error).
"""
from __future__ import annotations

import functools
import json
from dataclasses import dataclass

import structlog
import torch

from scheduler.guide_compiler import MatcherCache, check_limits, on_compile_thread
from scheduler.request import RequestError
from scheduler.tokenizer import BYTE_OFFSET, ByteTokenizer, load_tokenizer

log = structlog.get_logger("scheduler.guided")

KINDS = ("json_schema", "regex", "choice", "grammar")
JSON_OPTIONS = {"whitespace_flexible": False}  # compact JSON (a schema's "x-guidance" may say otherwise)


@dataclass(frozen=True)
class GuidedSpec:
    """What a guided answer must be. value: a JSON schema as JSON text, a regex, the JSON text of a list of
    strings (choice), or a Lark grammar; a schema given as a dict, choices as a list, are taken as their JSON text
    (regression: refused as "not a GuidedSpec of kind json_schema", which it was)."""
    kind: str
    value: str

    def __post_init__(self) -> None:
        if (self.kind, type(self.value)) in (("json_schema", dict), ("choice", list)):
            try:
                object.__setattr__(self, "value", json.dumps(self.value))
            except (TypeError, ValueError):  # (not JSON data: check_spec refuses it)
                pass

    @classmethod
    def json_object(cls) -> "GuidedSpec":
        return cls("json_schema", json.dumps({"type": "object"}))

    def grammar(self) -> str:
        """llguidance's grammar text (no check: `Guides.check` compiles it)."""
        from llguidance import LLMatcher

        check_limits(self.kind, self.value)
        if self.kind == "json_schema":
            return LLMatcher.grammar_from_json_schema(self.value, defaults=JSON_OPTIONS)
        if self.kind == "regex":
            return LLMatcher.grammar_from_regex(self.value)
        if self.kind == "choice":  # one lexeme, as llguidance makes an enum (regression: a rule of one alternative a
            # choice failed from 2,000 choices: llguidance's parser takes at most 2,000 items a row)
            return LLMatcher.grammar_from_lark("start: CHOICE\nCHOICE: " + " | ".join(json.dumps(c)
                                                                                   for c in json.loads(self.value)))
        return LLMatcher.grammar_from_lark(self.value)


def check_spec(spec: object) -> None:
    """A well-formed GuidedSpec (its grammar is checked by `Guides.check`); RequestError otherwise."""
    if not isinstance(spec, GuidedSpec) or spec.kind not in KINDS:
        raise RequestError(f"guided must be a GuidedSpec of kind {' / '.join(KINDS)}, got {spec!r}", "guided")
    if not isinstance(spec.value, str):
        raise RequestError(f"a GuidedSpec's value is text (a schema's or choices' JSON text, a regex, a grammar), got "
                           f"a {type(spec.value).__name__}", "guided")
    if spec.kind == "choice":
        try:
            choices = json.loads(spec.value)
        except (ValueError, RecursionError):  # (regression: json's error, out of add_request; RecursionError, nested
            choices = None  # past the parser, out of Engine.generate, which lost the whole batch)
        if not (isinstance(choices, list) and choices and all(isinstance(c, str) and c for c in choices)):
            raise RequestError("a guided choice is a non-empty list of non-empty strings", "guided")


class Guide:
    """One request's matcher: the tokens it may take next, and the tokens it took."""

    def __init__(self, matcher, words: int, blocked_id: int | None) -> None:
        self.matcher, self.words, self.blocked_id = matcher, words, blocked_id  # (words: int32s of a mask row)
        self.allows_none = False  # the last mask allowed no token (that step's token is no answer's: `stuck_error`)
        self.rows_allow_none: list[bool] | None = None  # a verify step's, per row (`fill_verify_masks`)

    def valid_drafts(self, drafts: list[int]) -> list[int]:
        """The drafts up to the first the grammar would not take after those before it (a speculative step's: a
        row after a draft it refuses could be scored by no mask)."""
        return drafts[:self.matcher.validate_tokens(drafts)] if drafts else drafts

    def fill_mask(self, row: torch.Tensor, held_ids: tuple[int, ...] = ()) -> bool:
        """row: [words] int32 on the host, bit t of word t // 32 set where token t may come next. held_ids: the
        stop ids min_tokens masks on the device after this mask; False when the grammar allows nothing else (then
        they must not be held: no valid answer is longer, and the grammar wins, as at its end)."""
        self.matcher.unsafe_compute_mask_ptr(row.data_ptr(), row.numel() * row.element_size())
        return self._filled(row, held_ids)

    def _filled(self, row: torch.Tensor, held_ids: tuple[int, ...]) -> bool:
        """`fill_mask`'s checks of a row the matcher has just filled."""
        if self.blocked_id is not None:  # (the stand-in EOS of a model that has none)
            _clear(row, (self.blocked_id,))
        self.allows_none = not bool(row.any())  # (e.g. a grammar whole before its first token, without an EOS)
        if not held_ids or self.allows_none:
            return True
        rest = row.clone()
        _clear(rest, held_ids)
        return bool(rest.any())

    def stuck_error(self) -> str | None:
        """After a step whose mask allowed no token: None where the grammar is whole (only an EOS this model lacks
        could follow: the answer ends there), else why it cannot go on."""
        if self.matcher.is_accepting() and not self.matcher.is_error():
            return None
        problem = _brief(self.matcher.get_error() or "") if self.matcher.is_error() else ""
        return "the request's grammar allows no token this model can sample here" + (f": {problem}" if problem else "")

    def accept(self, token: int) -> str | None:
        """Advance by a sampled token; the matcher's error when the token broke the grammar (it cannot, but for
        a token the mask did not hold: a NaN row's; or where llguidance gives up: a grammar too ambiguous)."""
        return None if self.matcher.consume_token(token) else _brief(self.matcher.get_error() or "rejected token")

    @property
    def complete(self) -> bool:
        """The grammar is satisfied and nothing but EOS may follow."""
        return self.matcher.is_stopped() and not self.matcher.is_error()


def fill_masks(guides: list[Guide], masks: torch.Tensor, held: list[tuple[int, ...]]) -> list[bool]:
    """Each guide's `fill_mask` into its row of masks [R, words]: several rows by llguidance's threads at once
    (the GIL released; a batch's rows one after another cost their sum on the loop's thread)."""
    if len(guides) == 1:
        return [guides[0].fill_mask(masks[0], held[0])]
    _executor().unsafe_compute_mask_ptr([(g.matcher, i) for i, g in enumerate(guides)], masks.data_ptr(),
                                        masks.shape[1] * masks.element_size(), len(guides))
    return [g._filled(masks[i], held[i]) for i, g in enumerate(guides)]


def fill_verify_masks(guides: list[Guide], drafts: list[list[int]], masks: torch.Tensor,
                      held: list[list[tuple[int, ...]]] | None = None) -> list[list[bool]]:
    """A verify step's masks (scheduler/speculative.py): guide g's rows one after another in masks [R, words] (its
    pending token's mask, then one after each of its drafts, which its grammar takes: `valid_drafts`), by
    llguidance's threads, each matcher left where it was. Each guide's `rows_allow_none`: per row, whether its
    mask allowed no token (`after_step` reads the one of the row that chose each token). held: per guide, per row,
    the stop ids min_tokens masks after that row's mask (none: ()); returns per guide, per row, `fill_mask`'s
    answer: False where the grammar allows nothing else there (then they must not be held)."""
    starts, row = [], 0
    for d in drafts:
        starts.append(row)
        row += len(d) + 1
    at, row_bytes = masks.data_ptr(), masks.shape[1] * masks.element_size()
    with_drafts = [(g.matcher, start, list(d)) for g, start, d in zip(guides, starts, drafts) if d]
    if with_drafts:
        _executor().unsafe_compute_mask_ptr_with_draft_token(with_drafts, at, row_bytes, len(masks))
    if len(with_drafts) < len(guides):  # (llguidance takes no empty list of drafts)
        _executor().unsafe_compute_mask_ptr([(g.matcher, start) for g, start, d in zip(guides, starts, drafts)
                                             if not d], at, row_bytes, len(masks))
    fits = []
    for i, (g, start, d) in enumerate(zip(guides, starts, drafts)):
        flags, fit = [], []
        for j in range(len(d) + 1):
            fit.append(g._filled(masks[start + j], held[i][j] if held else ()))
            flags.append(g.allows_none)
        g.rows_allow_none = flags
        fits.append(fit)
    return fits


@functools.cache
def _executor():
    from llguidance import LLExecutor

    return LLExecutor()  # (threads: 80 % of the CPUs, at most 32)


def _clear(row: torch.Tensor, ids) -> None:
    """Clear the bits of `ids` in a mask row (those within it)."""
    for t in ids:
        if 0 <= t < row.numel() * 32:
            row[t // 32] &= ~(1 << (t % 32))


def _brief(message: str, limit_chars: int = 400) -> str:
    """llguidance's message without the parser state and grammar it appends (kilobytes, to a client), cut."""
    text = message.split("\n<state>")[0].strip()
    return text if len(text) <= limit_chars else text[:limit_chars] + "..."


class Guides:
    """The engine's grammar compiler: its tokenizer as llguidance sees it (built on first use)."""

    def __init__(self, model: str, vocab_size: int, eos_ids: tuple[int, ...]) -> None:
        self.model, self.vocab_size, self.eos_ids = model, vocab_size, eos_ids
        self.words = (vocab_size + 31) // 32  # int32 words of a row's bitmask
        self.tokenizer = None  # None: the model's own (load_tokenizer), loaded on first use
        # each spec's matcher in its first state, compiled once (a server sees the same schema again and again);
        # this engine's own (regression: an lru_cache on the method kept every Guides alive, and `use` cleared all)
        self.compiled = MatcherCache(self._compile)

    def use(self, tokenizer) -> None:
        """Compile grammars for `tokenizer` (the server's, which may not be the model directory's)."""
        self.tokenizer = tokenizer
        self.__dict__.pop("_tokenizer", None)
        self.compiled.cache_clear()

    def warm(self) -> None:
        """Build the tokenizer's llguidance form now, off the loop (a server does at start): ~1 s for a vocabulary
        of 150k tokens, which the first guided request would otherwise spend on the loop. Quiet where it cannot
        (no llguidance, no tokenizer): the first guided request says why."""
        try:
            self._tokenizer  # noqa: B018 (a cached property, built)
        except RequestError:
            pass
        except Exception as exc:  # (run in an executor no one awaits: left in its future, asyncio reported it as an
            # error, "Future exception was never retrieved", as the future was collected)
            log.warning("guided_warm_failed", error=f"{type(exc).__name__}: {exc}")

    @functools.cached_property
    def _tokenizer(self):
        try:
            from llguidance import LLTokenizer, TokenizerWrapper
        except ImportError:
            raise RequestError("structured outputs need the llguidance package (pip install llguidance)",
                               "guided") from None
        tok = self.tokenizer or load_tokenizer(self.model, self.vocab_size)
        if tok is None:
            raise RequestError("structured outputs need the model's tokenizer; this model has none", "guided")
        try:
            if isinstance(tok, ByteTokenizer):  # (its stand-in EOS without one: an id that is no byte)
                eos = self.eos_ids[0] if self.eos_ids else self.vocab_size - 1
                return LLTokenizer(TokenizerWrapper(_ByteTokens(self.vocab_size, eos)), n_vocab=self.vocab_size)
            # (without EOS ids llguidance takes the tokenizer's EOS, or its id 0, as the stand-in)
            return LLTokenizer(_plain_added_tokens(tok.tok.to_str()), n_vocab=self.vocab_size,
                               eos_token=list(self.eos_ids) or None)
        except ValueError as exc:  # (regression: llguidance's error, out of validate, for every guided request)
            raise RequestError(f"structured outputs cannot use this model's tokenizer: {_brief(str(exc))}",
                               "guided") from None

    def check(self, spec: GuidedSpec):
        """The spec's matcher, compiled once (its grammar checked); RequestError with llguidance's message if it
        fails. (A malformed spec first: one that is unhashable raised lru_cache's TypeError.)"""
        check_spec(spec)
        return self.compiled(spec)

    def _compile(self, spec: GuidedSpec):
        """A matcher of the spec's grammar in its first state, never advanced (`start` copies it), compiled on the
        thread of a deep stack (scheduler/guide_compiler.py)."""
        self._tokenizer  # noqa: B018 (built here, where its errors are the caller's)
        return on_compile_thread(self._compile_here, spec)

    def _compile_here(self, spec: GuidedSpec):
        from llguidance import LLMatcher

        try:
            grammar = spec.grammar()
        except ValueError as exc:  # (a schema that is not JSON)
            raise RequestError(f"guided {spec.kind}: {_brief(str(exc))}", "guided") from None
        if problem := LLMatcher.validate_grammar(grammar, self._tokenizer):
            raise RequestError(f"guided {spec.kind} does not compile: {_brief(problem)}", "guided")
        matcher = LLMatcher(self._tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise RequestError(f"guided {spec.kind}: {_brief(matcher.get_error())}", "guided")
        self._first_token(spec, matcher)
        return matcher

    def _first_token(self, spec: GuidedSpec, matcher) -> None:
        """RequestError where a copy of the matcher cannot take a first token: no text satisfies the grammar (a regex
        of no string, a rule only itself derives), or llguidance gives up on it at once (a schema past its limits).
        Compiled, such a request was queued and then failed, a 500 (regression). Later limits still fail mid-answer."""
        probe = Guide(matcher.deep_copy(), self.words, None if self.eos_ids else self._tokenizer.eos_token)
        row = torch.zeros(self.words, dtype=torch.int32)
        probe.fill_mask(row)
        if probe.allows_none:
            if (why := probe.stuck_error()) is not None:
                raise RequestError(f"guided {spec.kind}: no text satisfies it ({why})", "guided")
            return
        word = int(torch.nonzero(row)[0])
        bits = int(row[word]) & 0xFFFFFFFF
        if (broken := probe.accept(word * 32 + (bits & -bits).bit_length() - 1)) is not None:
            raise RequestError(f"guided {spec.kind}: {broken}", "guided")

    def start(self, spec: GuidedSpec | None) -> Guide | None:
        """A request's matcher: a copy of its spec's (microseconds; compiling a large schema for each request
        held the loop: ~25 ms at 1,000 properties)."""
        if spec is None:
            return None
        return Guide(self.check(spec).deep_copy(), self.words, None if self.eos_ids else self._tokenizer.eos_token)


def _plain_added_tokens(tokenizer_json: str) -> str:
    """A byte-level BPE tokenizer.json with its non-special added tokens (Qwen3's <think>, </think>, <tool_call>:
    "special": false, their text kept in decoded text) moved into the model's vocabulary, where llguidance reads
    them as the bytes they spell. llguidance takes every added token as special: a grammar that wrote "<think>"
    was forced to that one token, which its matcher then refused (regression: the request failed on its first
    token). Text a grammar forces is then tokenized without them (their characters' tokens); where it allows the
    text, the model may still take the one token. Special added tokens stay special; another model's json (no
    byte-level BPE) is returned as it is."""
    spec = json.loads(tokenizer_json)
    model, plain = spec.get("model") or {}, [a for a in spec.get("added_tokens", ()) if not a.get("special")]
    if model.get("type") != "BPE" or (spec.get("decoder") or {}).get("type") != "ByteLevel" or not plain:
        return tokenizer_json
    vocab, spelled = model["vocab"], _byte_level_chars()
    for added in plain:
        word = "".join(spelled[b] for b in added["content"].encode("utf-8"))
        if vocab.setdefault(word, added["id"]) != added["id"]:  # (the text is another token: it stays added)
            continue
        spec["added_tokens"].remove(added)
    return json.dumps(spec)


@functools.cache
def _byte_level_chars() -> dict[int, str]:
    """GPT-2's byte-level alphabet: the character each byte is spelled as in a ByteLevel BPE vocabulary."""
    shown = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    hidden = [b for b in range(256) if b not in shown]
    return {**{b: chr(b) for b in shown}, **{b: chr(256 + i) for i, b in enumerate(hidden)}}


class _ByteTokens:
    """A ByteTokenizer as llguidance's TokenizerWrapper reads one: each id's bytes (ids that are not a byte
    are special: no text a grammar could match)."""

    def __init__(self, vocab_size: int, eos_id: int) -> None:
        self.eos_token_id, self.bos_token_id = eos_id, None
        self.tokens = [bytes([i - BYTE_OFFSET]) if 0 <= i - BYTE_OFFSET < 256 else b"" for i in range(vocab_size)]
        self.special_token_ids = [i for i in range(vocab_size) if not 0 <= i - BYTE_OFFSET < 256]

    def __call__(self, text: str | bytes) -> list[int]:
        return [b + BYTE_OFFSET for b in (text.encode("utf-8") if isinstance(text, str) else text)]


def apply_masks(logits: torch.Tensor, rows: list[int], masks: torch.Tensor) -> torch.Tensor:
    """logits [B, V] with every token a row's mask does not allow at -inf (a copy); masks [len(rows), words]
    int32 on the host, one per guided row."""
    words = masks.to(logits.device, non_blocking=True)  # [R, W]
    shifts = torch.arange(32, device=logits.device, dtype=torch.int32)
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).reshape(len(rows), -1)[:, :logits.shape[1]]  # [R, V]
    index = torch.tensor(rows, dtype=torch.int64).to(logits.device, non_blocking=True)
    out = logits.clone()
    out[index] = logits.index_select(0, index).masked_fill(allowed == 0, float("-inf"))
    return out
