"""A checkpoint-sized byte-level BPE tokenizer (tokenizer.json) for measurements that need a real vocabulary's
size and shape, where no checkpoint tokenizer can be had (the lent GPU machine has no internet): trained with
the `tokenizers` library on this Python's own standard library sources (code, docstrings, comments), to Qwen3's
151,643 regular tokens by default, with Qwen3's control tokens after them. Deterministic for one corpus.

    python scripts/make_bpe_tokenizer.py --out /tmp/bpe151k        (~1-2 min on 2 cores)

What it is for: structured outputs' per-step masks (llguidance walks the vocabulary's token trie for each
row), whose cost the presets' 256-id byte tokenizer understates (`bench_engine.py --guided-tokenizer DIR`).
"""
from __future__ import annotations

import argparse
import json
import sys
import sysconfig
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_cli import fail, positive_int  # noqa: E402

CONTROL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")  # special: left out of decoded text
ADDED = ("<tool_call>", "</tool_call>", "<think>", "</think>")  # as Qwen3's: kept in decoded text


def corpus(root: Path, max_bytes: int):
    """The .py files under `root`, in a fixed order, up to about `max_bytes`."""
    total = 0
    for path in sorted(root.rglob("*.py")):
        try:
            text = path.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        yield text
        total += len(text)
        if total >= max_bytes:
            return


def build(out: Path, vocab_tokens: int, root: Path, max_bytes: int) -> dict:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_tokens, min_frequency=2, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    t = time.perf_counter()
    tok.train_from_iterator(corpus(root, max_bytes), trainer=trainer)
    trained_s = time.perf_counter() - t
    if tok.get_vocab_size() < vocab_tokens:  # (regression: a 263-token tokenizer, silently, for 151,643 asked)
        raise ValueError(f"the corpus {root} gave {tok.get_vocab_size():,} tokens of the {vocab_tokens:,} asked: "
                         "give a larger --corpus or fewer --vocab-tokens (nothing was written)")
    tok.add_tokens([AddedToken(a, special=False) for a in ADDED])
    tok.add_special_tokens([AddedToken(c, special=True) for c in CONTROL])
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    config = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None}
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return {"vocab": tok.get_vocab_size(), "trained_s": round(trained_s, 1), "corpus_root": str(root)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, type=Path, help="directory for tokenizer.json / tokenizer_config.json")
    ap.add_argument("--vocab-tokens", type=positive_int, default=151643,
                    help="regular tokens (Qwen3's: 151,643; more than the 256 bytes)")
    ap.add_argument("--corpus", type=Path, default=Path(sysconfig.get_paths()["stdlib"]),
                    help="a directory of .py files to train on (default: this Python's standard library)")
    ap.add_argument("--max-corpus-bytes", type=positive_int, default=120 << 20)
    args = ap.parse_args(argv)
    if args.vocab_tokens <= 256:
        ap.error(f"--vocab-tokens must be more than the 256 byte tokens, got {args.vocab_tokens}")
    if args.out.exists() and not args.out.is_dir():  # (regression: FileExistsError's traceback)
        ap.error(f"--out {args.out}: exists and is not a directory")
    if not args.corpus.is_dir() or next(args.corpus.rglob("*.py"), None) is None:  # (regression: silently trained
        ap.error(f"--corpus {args.corpus}: not a directory holding .py files")  # on nothing)
    try:
        result = build(args.out, args.vocab_tokens, args.corpus, args.max_corpus_bytes)
    except ValueError as exc:
        fail(str(exc), code=1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
