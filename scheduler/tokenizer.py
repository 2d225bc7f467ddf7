"""Text <-> token ids for the HTTP server.

Two tokenizers, chosen by `load_tokenizer(model, vocab_size)`:

* `HFTokenizer` — a checkpoint directory with a `tokenizer.json` (the `tokenizers` library). When the
  directory's `tokenizer_config.json` (or `chat_template.jinja`) carries a chat template (and jinja2 is
  importable) the tokenizer can render chat messages (scheduler/chat_template.py); `/v1/chat/completions` is
  served only then. The template gets the special tokens the directory defines (bos/eos/unk/sep/pad/cls/
  mask_token as strings, additional_special_tokens a list; from tokenizer_config.json, and from
  special_tokens_map.json, winning, where the config has no `added_tokens_decoder`, as transformers reads them).

* `ByteTokenizer` — the documented fallback for the random-weight presets (tiny, qwen3-*), which ship
  no vocabulary (a checkpoint directory without tokenizer.json gets no tokenizer: token ids only).
  Text is encoded as its UTF-8 bytes shifted by `BYTE_OFFSET`:

      id = byte + 3          (ids 0, 1, 2 are reserved and never produced by encode)

  so the 256 byte ids are 3..258 and fit the tiny preset's vocabulary of 512. Decoding is the inverse
  for ids in [3, 259); runs of bytes are decoded as UTF-8 with invalid sequences replaced by U+FFFD,
  and every other id (reserved, or >= 259 — a random-weight model emits those freely) is rendered as
  the placeholder "<id:N>". There are no special tokens, no BOS/EOS and no chat template of its own (the
  server's --chat-template gives it one: `use_chat_template`, either tokenizer). A token's own
  string (`token_strs`, /tokenize's return_token_strs) is its byte's character when printable ASCII, else
  "<0xHH>".

`IncrementalDecoder` turns a stream of ids into text deltas: it re-decodes a short window of recent
ids and holds back text while it ends in an incomplete UTF-8 character. A completion is decoded after
the last few prompt ids (`completion_context`), so its text is what continues the prompt's text (a
SentencePiece "▁Paris" is " Paris" there); a whole response is decoded the same way as a stream
(scheduler/stop_strings.py `CompletionText`, for both), so streamed and non-streamed responses carry the same text.
`decode_completion` decodes ids at once, without the server's special-token options: the tests' reference.
"""
from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Sequence

from scheduler.chat_template import ChatTemplate
from scheduler.presets import is_preset

BYTE_OFFSET = 3
KEPT_REQUEST_TEMPLATES = 8  # requests' own chat templates kept compiled, per tokenizer (`request_template`)
_REPLACEMENT = "\ufffd"
# transformers' SPECIAL_TOKENS_ATTRIBUTES: what `apply_chat_template` passes a template (special_tokens_map)
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# the template variables HFTokenizer.apply_chat_template sets itself (template_kwargs may set none of them)
TEMPLATE_VARIABLES = ("messages", "tools", "documents", "add_generation_prompt", *SPECIAL_TOKEN_KEYS,
                      "additional_special_tokens")


class TokenizerError(RuntimeError):
    """The tokenizer failed on text a chat template rendered, or panicked: the server's failure, not the request's."""


def _is_panic(exc: BaseException) -> bool:
    """A panic of the Rust tokenizers library (a tokenizer.json it loads but cannot run, e.g. a truncation whose stride
    is not below its max_length) comes out as pyo3's PanicException, a BaseException: it went past every `except
    Exception`, the app's error handler too, and uvicorn answered a text/plain 500 (regression). A TokenizerError."""
    return (type(exc).__module__, type(exc).__name__) == ("pyo3_runtime", "PanicException")


class _Chat:
    """A tokenizer's chat: its template (ChatTemplate or None) rendered and encoded."""

    template: ChatTemplate | None = None
    # a checkpoint's template named "tool_use", for chats that send tools (transformers' get_chat_template(tools=)),
    # or why it does not compile
    tool_template: ChatTemplate | None = None
    no_tool_template_reason: str | None = None
    no_chat_reason = "no chat template"
    special_tokens: dict = {}

    @property
    def chat_template(self) -> str | None:
        return None if self.template is None else self.template.text

    def request_template(self, text: str) -> ChatTemplate:
        """A request's own template (vLLM's `chat_template` field, --trust-request-chat-template), compiled with this
        tokenizer's special tokens; ValueError where it does not compile. The last KEPT_REQUEST_TEMPLATES are kept, by
        this tokenizer (a client sends one template with every request: compiled once). (Regression, session 58's
        hunt: an lru_cache on the method kept its last 8 tokenizers alive, ~33 MB each at Qwen3's vocabulary.)"""
        kept = self.__dict__.setdefault("_request_templates", {})
        template = kept.pop(text, None)  # (re-inserted: the most recently used last)
        if template is None:
            template = ChatTemplate(text, self.special_tokens)
        kept[text] = template
        while len(kept) > KEPT_REQUEST_TEMPLATES:
            kept.pop(next(iter(kept)), None)
        return template

    def use_chat_template(self, text: str) -> None:
        """Render chats with `text` from now on (--chat-template: with tools too); ValueError where it does not
        compile."""
        self.template = ChatTemplate(text, self.special_tokens)
        self.tool_template = self.no_tool_template_reason = None

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            continue_final_message: bool = False, add_special_tokens: bool = False,
                            template_kwargs: dict | None = None, tools: list[dict] | None = None,
                            template: ChatTemplate | None = None) -> list[int]:
        """The messages rendered and encoded (as transformers' apply_chat_template with tokenize=True);
        continue_final_message: the text ends where the last message's content does, its end-of-turn
        markup cut off, for the model to continue it; template_kwargs: more variables for the template
        (vLLM's chat_template_kwargs, e.g. Qwen3's enable_thinking), none of those set here; tools: the
        request's tool definitions (transformers' `tools`: OpenAI's tool objects), None without; template: a
        request's own (`request_template`), rendering in place of the tokenizer's, tools or not."""
        if template is None:
            template = self._own_template(tools is not None)
        text = template.render(messages, add_generation_prompt, continue_final_message, template_kwargs, tools)
        try:
            return self.encode(text, add_special_tokens=add_special_tokens)
        except Exception as exc:  # (regression: a 400 'the chat template rejected the messages', counted rejected)
            raise TokenizerError(f"the tokenizer failed on the rendered chat: {exc}") from exc

    def content_format(self, template: ChatTemplate | None, with_tools: bool) -> str:
        """How messages' content reaches the template that renders them (`template`, a request's own, else this
        tokenizer's: `apply_chat_template`'s choice), as vLLM's --chat-template-content-format auto reads it."""
        try:
            return (template or self._own_template(with_tools)).content_format
        except ValueError:  # (no template to render with: apply_chat_template says why)
            return "string"

    def _own_template(self, with_tools: bool) -> ChatTemplate:
        if self.template is None:
            raise ValueError(self.no_chat_reason)
        if with_tools and self.no_tool_template_reason is not None:
            raise ValueError(self.no_tool_template_reason)
        if with_tools and self.tool_template is not None:
            return self.tool_template
        return self.template


class ByteTokenizer(_Chat):
    """UTF-8 bytes + BYTE_OFFSET (see the module docstring)."""

    kind = "bytes"

    def __init__(self, vocab_size: int) -> None:
        if vocab_size < BYTE_OFFSET + 256:
            raise ValueError(f"the byte-level tokenizer needs a vocabulary of >= {BYTE_OFFSET + 256} ids, "
                             f"this model has {vocab_size}")
        self.vocab_size = vocab_size
        self.no_chat_reason = "a random-weight preset has a byte tokenizer but no chat template (--chat-template)"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """(add_special_tokens: HFTokenizer's signature; there are none to add)"""
        return [b + BYTE_OFFSET for b in text.encode("utf-8")]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """(skip_special_tokens: HFTokenizer's signature; there are none to skip)"""
        out: list[str] = []
        run = bytearray()
        for t in ids:
            b = int(t) - BYTE_OFFSET
            if 0 <= b < 256:
                run.append(b)
                continue
            if run:
                out.append(run.decode("utf-8", errors="replace"))
                run.clear()
            out.append(f"<id:{int(t)}>")
        if run:
            out.append(run.decode("utf-8", errors="replace"))
        return "".join(out)

    def token_strs(self, ids: Sequence[int]) -> list[str]:
        """Each id's token alone: its byte as the character when printable ASCII, else <0xHH> (SentencePiece's
        byte-fallback notation); an id that is no byte as `decode` renders it."""
        out: list[str] = []
        for t in map(int, ids):
            b = t - BYTE_OFFSET
            if not 0 <= b < 256:
                out.append(f"<id:{t}>")
            else:
                out.append(chr(b) if 0x20 <= b < 0x7F else f"<0x{b:02X}>")
        return out


class HFTokenizer(_Chat):
    """A `tokenizer.json` from a checkpoint directory, with its chat template when it has one."""

    kind = "tokenizer.json"

    def __init__(self, model_dir: str) -> None:
        from tokenizers import Tokenizer

        with _reading(os.path.join(model_dir, "tokenizer.json")) as path:
            self.tok = Tokenizer.from_file(path)
        self._added: dict[int, str] | None = None
        self._special_ids: frozenset[int] | None = None
        self.no_chat_reason = f"{model_dir} has no chat template (tokenizer_config.json or chat_template.jinja)"
        with _reading(os.path.join(model_dir, "tokenizer_config.json")) as path:
            cfg = _read_json(path)
        special_map = {}
        if "added_tokens_decoder" not in cfg:  # transformers reads the map only for such (older) saves
            try:  # (read for the special tokens only: one that cannot be read is left out, not fatal)
                special_map = _read_json(os.path.join(model_dir, "special_tokens_map.json"))
            except (OSError, ValueError):
                pass
        self.special_tokens = _special_tokens(cfg, special_map)
        named = _named_templates(model_dir, cfg)
        template = named.get("default") or next(iter(named.values()), None)
        if template:
            try:
                self.use_chat_template(template)
            except ValueError as exc:  # chat is refused, completions still served
                self.no_chat_reason = str(exc)
        if self.template is not None and named.get("tool_use") not in (None, template):
            try:
                self.tool_template = ChatTemplate(named["tool_use"], self.special_tokens)
            except ValueError as exc:  # (chats with tools refused, the others served)
                self.no_tool_template_reason = f"the checkpoint's tool_use chat template: {exc}"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        try:  # (a plain try: decode runs at every token, a context manager's generator would cost each call)
            return list(self.tok.encode(text, add_special_tokens=add_special_tokens).ids)
        except BaseException as exc:
            if not _is_panic(exc):
                raise
            raise TokenizerError(f"the tokenizer panicked: {exc}") from None

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        try:
            return self.tok.decode([int(t) for t in ids], skip_special_tokens=skip_special_tokens)
        except BaseException as exc:
            if not _is_panic(exc):
                raise
            raise TokenizerError(f"the tokenizer panicked: {exc}") from None

    def added_token_texts(self) -> dict[int, str]:
        """Each added token's (special or not) id and text, as vLLM's detokenizer reads them."""
        if self._added is None:
            self._added = {int(i): t.content for i, t in self.tok.get_added_tokens_decoder().items()}
        return self._added

    def special_token_ids(self) -> frozenset[int]:
        """The ids of the special tokens, those a decode with skip_special_tokens leaves out."""
        if self._special_ids is None:
            self._special_ids = frozenset(int(i) for i, t in self.tok.get_added_tokens_decoder().items() if t.special)
        return self._special_ids

    def token_strs(self, ids: Sequence[int]) -> list[str]:
        """Each id's token as the vocabulary spells it ("Ġthe"; transformers' convert_ids_to_tokens)."""
        return [self.tok.id_to_token(int(t)) for t in ids]


@contextlib.contextmanager
def _reading(path: str):
    """A tokenizer file that cannot be read (not UTF-8, not JSON, no permission: tokenizers' own exceptions too) as a
    ValueError naming it, which the server's start prints as one line (regression: a traceback naming no file)."""
    try:
        yield path
    except Exception as exc:
        raise ValueError(f"cannot read the tokenizer's {path}: {exc}") from None


def _token_text(tok) -> str:
    if isinstance(tok, dict):  # an AddedToken as saved: {"content": "<pad>", "lstrip": false, ...}
        return str(tok.get("content") or "")
    return tok if isinstance(tok, str) else ""


def _read_json(path: str) -> dict:
    """The JSON object in `path` (UTF-8, as transformers reads it, whatever the locale); {} when there is no such
    file (or it holds no object)."""
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    return data if isinstance(data, dict) else {}


def _named_templates(model_dir: str, config: dict) -> dict[str, str]:
    """A checkpoint's chat templates by name ("default", "tool_use", ...), as transformers reads them: its files,
    chat_template.jinja (the default) and additional_chat_templates/NAME.jinja, which take priority over
    tokenizer_config.json's `chat_template` (a string, the default, or [{"name", "template"}, ...]). Files are
    UTF-8. (Regressions: the config's template won over a newer chat_template.jinja; a "tool_use" template was
    never chosen, so tools never reached the prompt; a template file was read in the locale's encoding.)"""
    files: dict[str, str] = {}
    jinja_path = os.path.join(model_dir, "chat_template.jinja")
    extra_dir = os.path.join(model_dir, "additional_chat_templates")
    paths = [("default", jinja_path)] if os.path.isfile(jinja_path) else []
    if os.path.isdir(extra_dir):
        paths += [(name[:-len(".jinja")], os.path.join(extra_dir, name)) for name in sorted(os.listdir(extra_dir))
                  if name.endswith(".jinja")]
    for name, path in paths:
        with _reading(path), open(path, encoding="utf-8") as f:
            files[name] = f.read()
    if files:
        return {name: text for name, text in files.items() if text}
    template = config.get("chat_template")
    if isinstance(template, list):
        return {t["name"]: t["template"] for t in template if isinstance(t, dict) and isinstance(t.get("name"), str)
                and isinstance(t.get("template"), str) and t["template"]}
    return {"default": template} if isinstance(template, str) and template else {}


def _special_tokens(config: dict, special_tokens_map: dict) -> dict[str, str | list[str]]:
    """The special tokens transformers' `special_tokens_map` holds for this directory: those of
    SPECIAL_TOKEN_KEYS that are set (special_tokens_map.json's win over tokenizer_config.json's, as in
    transformers' legacy loading) as strings, and additional_special_tokens (the config's, then the
    map's new ones) as a list of strings when there are any."""
    out: dict[str, str | list[str]] = {}
    for key in SPECIAL_TOKEN_KEYS:
        text = _token_text(special_tokens_map.get(key)) or _token_text(config.get(key))
        if text:
            out[key] = text
    extra: list[str] = []
    for source in (config, special_tokens_map):
        tokens = source.get("additional_special_tokens")
        for tok in tokens if isinstance(tokens, list) else ():
            text = _token_text(tok)
            if text and text not in extra:
                extra.append(text)
    if extra:
        out["additional_special_tokens"] = extra
    return out


def load_tokenizer(model: str, vocab_size: int) -> ByteTokenizer | HFTokenizer | None:
    """A model directory's tokenizer.json, a preset's byte-level fallback; None when neither fits
    (text prompts are then refused with a 400). A directory without tokenizer.json gets None: its
    weights speak their own vocabulary (bytes were the wrong ids for them, served with a 200)."""
    if os.path.isdir(model) and not is_preset(model):
        return HFTokenizer(model) if os.path.isfile(os.path.join(model, "tokenizer.json")) else None
    try:
        return ByteTokenizer(vocab_size)
    except ValueError:
        return None


CONTEXT_TOKENS = 5


def completion_context(tokenizer, prompt: Sequence[int]) -> list[int]:
    """The last few prompt ids, decoded ahead of a completion so that its text is what continues the
    prompt's text: a SentencePiece decoder (Llama 2, Mistral) strips the leading space of what it
    decodes, so "▁Paris" alone is "Paris", after the prompt " Paris". Empty when they end inside a
    character (the completion's first bytes would complete the prompt's text)."""
    context = [int(t) for t in prompt[-CONTEXT_TOKENS:]]
    return [] if tokenizer.decode(context).endswith(_REPLACEMENT) else context


def decode_completion(tokenizer, prompt: Sequence[int], ids: Sequence[int]) -> str:
    """The text of generated `ids` after `prompt`: what a stream of them adds up to. Decoded the
    way a stream is, not in one go: a byte-fallback decoder turns a whole run of byte tokens into
    U+FFFDs when the run ends inside a character ("<0x74><0xE4>" is "\ufffd\ufffd", while the
    stream had already sent the "t")."""
    decoder = IncrementalDecoder(tokenizer, completion_context(tokenizer, prompt))
    return "".join(decoder.feed(t) for t in ids) + decoder.flush()


class IncrementalDecoder:
    """Text deltas of a growing id sequence (a window of the last ids is re-decoded each step),
    after `context` ids whose text is not emitted (completion_context); special tokens left out of
    the text unless skip_special_tokens is False (vLLM's field). With them kept and vLLM's
    spaces_between_special_tokens False, an added token right after another is its text alone, without
    the space a decoder (WordPiece's, say) puts between them, as vLLM V1's detokenizer does."""

    def __init__(self, tokenizer, context: Sequence[int] = (), skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True) -> None:
        self.tokenizer, self.skip_special_tokens = tokenizer, skip_special_tokens
        self.ids: list[int] = [int(t) for t in context]
        self.prefix_offset = 0              # window start: ids before it are already text
        self.read_offset = len(self.ids)    # ids before it have been emitted
        added = getattr(tokenizer, "added_token_texts", None)
        self.joined: dict[int, str] | None = None  # the added tokens' texts, where they join without spaces
        if not (skip_special_tokens or spaces_between_special_tokens) and added is not None:
            self.joined = added() or None
        self.last_added = False
        # the ids its decodes leave out: kept out of the window (regression: a run of them, a model repeating its EOS
        # under ignore_eos, added no text, so the window grew by one id a token and was decoded whole each time)
        specials = getattr(tokenizer, "special_token_ids", None)
        self.skipped: frozenset[int] = specials() if skip_special_tokens and specials is not None else frozenset()

    def feed(self, token_id: int) -> str:
        if int(token_id) in self.skipped:
            return ""  # (as vLLM's detokenizer, which leaves them out of its tokens: the text is the same)
        self.ids.append(int(token_id))
        prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset:])
        delta = ""
        if len(new_text) > len(prefix_text) and not new_text.endswith(_REPLACEMENT):
            delta = new_text[len(prefix_text):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        if self.joined is not None:
            text = self.joined.get(int(token_id))
            if text is not None and self.last_added:
                delta = text  # (the token before was one too: its text, nothing held, all emitted)
            self.last_added = text is not None
        return delta

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character at the end becomes U+FFFD)."""
        prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        new_text = self._decode(self.ids[self.prefix_offset:])
        self.prefix_offset = self.read_offset = len(self.ids)
        return new_text[len(prefix_text):] if len(new_text) > len(prefix_text) else ""

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)
