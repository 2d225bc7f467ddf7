"""A checkpoint tokenizer for tests: a byte-level BPE tokenizer.json (and tokenizer_config.json) written into a
directory, the shape of Qwen's and Llama 3's, small enough to build in milliseconds."""
from __future__ import annotations

import json
from pathlib import Path


def write_byte_tokenizer(path: Path, special: tuple[str, ...] = (), added: tuple[str, ...] = (),
                         bos: str | None = None, config: dict | None = None) -> Path:
    """The 256 byte tokens (ids 0-255), then the `added` tokens (not special: their text stays in decoded text,
    as Qwen3's <think>) and the `special` ones, ids from 256 in that order. bos: a special token a plain
    encode puts first. config: tokenizer_config.json's content (a chat template, a bos_token); none: no file."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    path.mkdir(parents=True, exist_ok=True)
    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    extra = {t: 256 + i for i, t in enumerate((*added, *special))}
    tok = Tokenizer(models.BPE(vocab={**vocab, **extra}, merges=[]))
    tok.add_tokens([AddedToken(t, special=False) for t in added])
    tok.add_special_tokens([AddedToken(t, special=True) for t in special])
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    if bos is not None:
        tok.post_processor = processors.TemplateProcessing(single=f"{bos} $A", special_tokens=[(bos, extra[bos])])
    tok.save(str(path / "tokenizer.json"))
    if config is not None:
        (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path
