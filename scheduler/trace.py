"""Mooncake-format request traces: parsing, block-size scaling and deterministic prompt synthesis.

Format (Mooncake, FAST'25): one JSON object per line with `timestamp` (ms since trace start),
`input_length` and `output_length` (tokens) and `hash_ids`, one id per 512-token prompt block; equal
ids at equal positions mean an identical prefix block, so a cache keyed on them sees the trace's reuse.

Shipped sample: scheduler/sample_trace.jsonl is lines 376-675 (300 requests, unchanged, original timestamps
131999-225000 ms) of /work/shared/traces/mooncake_conversation_trace.jsonl, the 300-line window with
the most reuse inside itself (15.6% of its 7,703 blocks repeat a hash id seen earlier in the window).

Replay: `scale_record` maps each hash id to `block_tokens` tokens instead of 512 (a small model on a
small pool wants short prompts), and `TokenSynth` turns each hash id into a fixed seeded block of token
ids, concatenated and cut to the request's input length.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

TRACE_BLOCK_TOKENS = 512  # tokens per hash id in the Mooncake traces
GZIP_MAGIC = b"\x1f\x8b"
MAX_PROBLEMS_SHOWN = 10  # malformed lines spelled out in an error or on stderr; the rest counted


@dataclass(frozen=True)
class TraceRecord:
    line_no: int  # 1-based line in the trace file (0 for records built in code)
    timestamp_ms: float  # arrival time as written in the trace
    input_tokens: int
    output_tokens: int
    hash_ids: tuple[int, ...]  # one id per block of the prompt; the last block may be partial


@dataclass(frozen=True)
class TraceProblem:
    line_no: int
    reason: str


class TraceError(ValueError):
    """Raised by `load_trace(strict=True)`; `.problems` holds every problem found."""

    def __init__(self, path: str, problems: list[TraceProblem]):
        self.problems = problems
        shown = "; ".join(f"line {p.line_no}: {p.reason}" for p in problems[:MAX_PROBLEMS_SHOWN])
        more = len(problems) - MAX_PROBLEMS_SHOWN
        tail = f"; ... and {more} more" if more > 0 else ""
        super().__init__(f"{path}: {len(problems)} malformed line(s): {shown}{tail}")


def _is_int(x: object) -> bool:
    """A 64-bit integer (larger ones overflowed float arithmetic and numpy later: a traceback)."""
    return isinstance(x, int) and not isinstance(x, bool) and -2**63 <= x < 2**63


def _is_hash_id(x: object) -> bool:
    """An unsigned 64-bit integer: hash ids may be 64-bit hashes (TokenSynth's digit field holds any of them;
    regression: those of 2**63 or more were refused as not "non-negative 64-bit integers")."""
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 2**64


def _is_number(x: object) -> bool:
    return _is_int(x) or (isinstance(x, float) and math.isfinite(x))


def parse_line(line: str, line_no: int) -> TraceRecord | TraceProblem:
    """Parses one trace line; returns a problem instead of raising."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        return TraceProblem(line_no, f"bad JSON: {e.msg} at column {e.colno}")
    except ValueError as e:  # valid JSON Python will not read (an integer of over 4,300 digits)
        return TraceProblem(line_no, f"bad JSON: {e}")
    except RecursionError:  # (regression: a traceback, and no line of the trace ran)
        return TraceProblem(line_no, "bad JSON: nested too deeply for Python's JSON decoder")
    if not isinstance(obj, dict):
        return TraceProblem(line_no, f"expected a JSON object, got {type(obj).__name__}")
    missing = [k for k in ("timestamp", "input_length", "output_length", "hash_ids") if k not in obj]
    if missing:
        return TraceProblem(line_no, f"missing field(s): {', '.join(missing)}")
    ts, n_in, n_out, ids = obj["timestamp"], obj["input_length"], obj["output_length"], obj["hash_ids"]
    if not _is_number(ts):
        return TraceProblem(line_no, f"timestamp must be a finite number, got {str(ts)[:40]}")
    if ts < 0:
        return TraceProblem(line_no, f"negative timestamp {ts}")
    for name, value in (("input_length", n_in), ("output_length", n_out)):
        if not _is_int(value):
            return TraceProblem(line_no, f"{name} must be a 64-bit integer, got {str(value)[:40]}")
        if value < 0:
            return TraceProblem(line_no, f"negative {name} {value}")
    if n_in == 0:
        return TraceProblem(line_no, "input_length 0: a request needs at least one prompt token")
    if not isinstance(ids, list) or not all(_is_hash_id(h) for h in ids):
        return TraceProblem(line_no, "hash_ids must be a list of non-negative 64-bit integers")
    num_blocks_expected = math.ceil(n_in / TRACE_BLOCK_TOKENS)
    if len(ids) != num_blocks_expected:
        return TraceProblem(
            line_no,
            f"{len(ids)} hash_ids for input_length {n_in}: expected ceil({n_in}/512) = {num_blocks_expected}",
        )
    return TraceRecord(line_no, ts, n_in, n_out, tuple(ids))


def load_trace(
    path: str | Path, *, strict: bool = False, max_requests: int | None = None
) -> tuple[list[TraceRecord], list[TraceProblem]]:
    """Reads a Mooncake JSONL trace. Malformed lines become `TraceProblem`s and are skipped; with
    `strict` any problem raises `TraceError` after the whole file (or the first `max_requests` good
    records) has been read. Blank lines are ignored. Never stops half way on a bad line (a gzip file
    is one problem, not a line of it)."""
    records: list[TraceRecord] = []
    problems: list[TraceProblem] = []
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, start=1):
            if max_requests is not None and len(records) >= max_requests:
                break
            if line_no == 1 and raw.startswith(GZIP_MAGIC):  # regression: a problem for each "line" of it
                problems.append(TraceProblem(1, "the file is gzip-compressed: gunzip it first"))
                break
            try:  # regression: a byte-order mark (Windows editors write one) cost the first request
                line = raw.decode("utf-8-sig" if line_no == 1 else "utf-8")
            except UnicodeDecodeError as e:
                problems.append(TraceProblem(line_no, f"not UTF-8: {e.reason}"))
                continue
            if not line.strip():
                continue
            parsed = parse_line(line, line_no)
            (records if isinstance(parsed, TraceRecord) else problems).append(parsed)
    if strict and problems:
        raise TraceError(str(path), problems)
    return records, problems


def _round_half_up(x: float) -> int:
    return int(math.floor(x + 0.5))


def scale_record(rec: TraceRecord, block_tokens: int) -> TraceRecord:
    """Maps each hash id to `block_tokens` tokens instead of 512. Lengths scale by block_tokens/512
    (rounded half up; input and output at least 1). The input is then kept inside the blocks it has:
    more than len(hash_ids)-1 full blocks and at most len(hash_ids), so every hash id still covers at
    least one token and the last block is cut to the remaining length."""
    if block_tokens <= 0:
        raise ValueError(f"block_tokens must be positive, got {block_tokens}")
    factor = block_tokens / TRACE_BLOCK_TOKENS
    num_blocks = len(rec.hash_ids)
    input_tokens = max(1, _round_half_up(rec.input_tokens * factor))
    if num_blocks:
        input_tokens = min(max(input_tokens, (num_blocks - 1) * block_tokens + 1), num_blocks * block_tokens)
    output_tokens = max(1, _round_half_up(rec.output_tokens * factor))
    return replace(rec, input_tokens=input_tokens, output_tokens=output_tokens)


class TokenSynth:
    """Turns hash ids into token ids: each id is a fixed block of `block_tokens` ids, so equal ids
    give identical blocks in every record and every run. A block starts with the id's digits in
    base vocab_size, least significant first, in a field of fixed width (as many digits as a 64-bit
    id needs, at most the block), so different ids give different blocks whenever the id fits in
    that field (drawn at random, two ids could give one block: a cache hit the trace does not have;
    4.6 % more hits on the sample at one token a block; regression: with the field as wide as each
    id, a short id's random tail could spell a longer id's digits, 358 pairs of the Mooncake trace's
    ids at 2 tokens a block); the rest is drawn from np.random.default_rng([seed, hash_id]). Blocks
    are cached (int32, block_tokens * 4 bytes each)."""

    def __init__(self, vocab_size: int, block_tokens: int, seed: int = 0):
        if vocab_size <= 0 or block_tokens <= 0 or seed < 0:
            raise ValueError("vocab_size and block_tokens must be positive, seed non-negative")
        self.vocab_size = vocab_size
        self.block_tokens = block_tokens
        self.seed = seed
        digits, width = 1 << 64, 0  # the digit field: what a 64-bit id needs in base vocab_size
        while digits:
            digits //= vocab_size
            width += 1
        self.id_width = min(block_tokens, width)
        self._blocks: dict[int, np.ndarray] = {}

    def block(self, hash_id: int) -> np.ndarray:
        """The token ids of one hash id: int32 [block_tokens], read-only."""
        blk = self._blocks.get(hash_id)
        if blk is None:
            rng = np.random.default_rng([self.seed, hash_id])
            blk = rng.integers(0, self.vocab_size, size=self.block_tokens, dtype=np.int32)
            digits = hash_id
            for i in range(self.id_width):
                digits, blk[i] = divmod(digits, self.vocab_size)
            blk.flags.writeable = False
            self._blocks[hash_id] = blk
        return blk

    def prompt_tokens(self, rec: TraceRecord, max_input_tokens: int | None = None) -> list[int]:
        """The prompt of a record already scaled to this synth's block size (see `scale_record`),
        cut to its input length and then clipped to `max_input_tokens` if given."""
        num_tokens = rec.input_tokens
        if len(rec.hash_ids) * self.block_tokens < num_tokens:
            raise ValueError(
                f"line {rec.line_no}: {len(rec.hash_ids)} blocks of {self.block_tokens} tokens cannot hold "
                f"{num_tokens} input tokens; scale the record with scale_record(rec, {self.block_tokens}) first"
            )
        if max_input_tokens is not None:
            num_tokens = min(num_tokens, max_input_tokens)
        num_blocks = math.ceil(num_tokens / self.block_tokens)
        if num_blocks == 0:
            return []
        tokens = np.concatenate([self.block(h) for h in rec.hash_ids[:num_blocks]])
        return tokens[:num_tokens].tolist()

    @property
    def num_cached_blocks(self) -> int:
        return len(self._blocks)


@dataclass(frozen=True)
class SynthPrompt:
    """A prompt synthesized when its request is submitted: built up front, the prompts of the bundled
    Mooncake trace (145 M tokens at 512 a hash id, as Python ints) took 6.1 GB and 33 s before the
    first request, and a longer trace or larger blocks ran out of memory. Only requests in flight
    hold their prompt now (and the synth its blocks: 2 KB a distinct hash id at 512 tokens)."""
    synth: TokenSynth
    record: TraceRecord  # scaled to the synth's block size (scale_record)
    max_input_tokens: int | None

    def __len__(self) -> int:
        n = self.record.input_tokens
        return n if self.max_input_tokens is None else min(n, self.max_input_tokens)

    def tokens(self) -> list[int]:
        return self.synth.prompt_tokens(self.record, self.max_input_tokens)
