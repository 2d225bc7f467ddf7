"""Product gaps left from earlier sessions, each with the behaviour it had before: chat text parts
joined as vLLM joins them, chat templates that see every special token transformers passes, a
simulated pool larger than the machine refused in one line, and --disable-prefix-cache with hicache
(L2/L3 idle without a word) refused or resolved."""
from __future__ import annotations

import json

import pytest

from hicache.allocator import PageAllocator
from hicache.config import HiCacheConfig
from scheduler import serve
from scheduler.api_models import ChatCompletionRequest, ChatMessage
from scheduler.config import EngineConfig
from scheduler.replay import main as replay_main
from scheduler.replay import run_cli
from scheduler.tokenizer import HFTokenizer
from test_server_text import _write_byte_level_tokenizer

SIM = ["--simulate", "--no-progress", "--max-requests", "2"]  # the bundled sample, no model: fast


# -- chat content as text parts ----------------------------------------------------------------------
def test_text_parts_are_joined_with_newlines_as_vllm_joins_them():
    """vLLM's default ("string" content format) joins a message's text parts with "\\n"; here they
    were joined with "", so ["Hello", "World"] reached the template as "HelloWorld"."""
    msg = ChatMessage(role="user", content=[{"type": "text", "text": "Hello"}, {"type": "text", "text": "World"}])
    assert msg.as_template_dict()["content"] == "Hello\nWorld"
    one = ChatMessage(role="user", content=[{"type": "text", "text": "only"}])
    assert one.as_template_dict()["content"] == "only"
    req = ChatCompletionRequest(messages=[{"role": "system", "content": [{"type": "text", "text": "a"},
                                                                         {"type": "text", "text": "b"}]}])
    assert req.messages[0].as_template_dict() == {"role": "system", "content": "a\nb"}


# -- special tokens in chat templates ----------------------------------------------------------------
SPECIALS_TEMPLATE = ("bos={{ bos_token }} eos={{ eos_token }} unk={{ unk_token }} sep={{ sep_token }} "
                     "pad={{ pad_token }} cls={{ cls_token }} mask={{ mask_token }} "
                     "extra={{ additional_special_tokens | join(',') }} "
                     "{% if sep_token is defined %}sep-defined{% else %}sep-undefined{% endif %}")


def _render(tmp_path, config: dict, special_tokens_map: dict | None = None) -> str:
    _write_byte_level_tokenizer(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": SPECIALS_TEMPLATE}))
    if special_tokens_map is not None:
        (tmp_path / "special_tokens_map.json").write_text(json.dumps(special_tokens_map))
    tok = HFTokenizer(str(tmp_path))
    assert tok.chat_template is not None, tok.no_chat_reason
    return tok.decode(tok.apply_chat_template([{"role": "user", "content": "hi"}]))


def test_a_chat_template_sees_every_special_token_the_tokenizer_defines(tmp_path):
    """transformers renders a template with the tokenizer's whole special_tokens_map (unk, sep, pad,
    cls, mask and additional_special_tokens besides bos / eos, strings, the last a list); here only
    bos_token and eos_token reached it, so e.g. `{{ pad_token }}` rendered as ""."""
    text = _render(tmp_path, {"bos_token": "<s>", "eos_token": {"content": "</s>", "special": True},
                              "unk_token": "<unk>", "pad_token": {"content": "<pad>", "lstrip": False},
                              "mask_token": "<mask>", "cls_token": "<cls>",
                              "additional_special_tokens": ["<|im_start|>", {"content": "<|im_end|>"}]})
    assert text == ("bos=<s> eos=</s> unk=<unk> sep= pad=<pad> cls=<cls> mask=<mask> "
                    "extra=<|im_start|>,<|im_end|> sep-undefined"), text


def test_special_tokens_map_json_is_read_as_transformers_reads_it(tmp_path):
    """Where tokenizer_config.json has no added_tokens_decoder (saved by transformers < 4.34),
    transformers reads special_tokens_map.json too: its entries win over the config's, and its
    additional_special_tokens are added to the config's. With added_tokens_decoder it is not read."""
    config = {"bos_token": "<s>", "pad_token": "<old-pad>", "additional_special_tokens": ["<a>"]}
    special_map = {"pad_token": {"content": "<pad>"}, "sep_token": "<sep>", "additional_special_tokens": ["<a>", "<b>"]}
    text = _render(tmp_path, config, special_map)
    assert text == "bos=<s> eos= unk= sep=<sep> pad=<pad> cls= mask= extra=<a>,<b> sep-defined", text
    text = _render(tmp_path, {**config, "added_tokens_decoder": {}}, special_map)
    assert text == "bos=<s> eos= unk= sep= pad=<old-pad> cls= mask= extra=<a> sep-undefined", text


# -- a simulated pool larger than the machine -------------------------------------------------------
def test_a_simulated_pool_larger_than_memory_is_refused_in_one_line(capsys, monkeypatch):
    """`--simulate` keeps an 8-byte owner entry per page of every tier (and the integrity check at the
    end temporaries over the largest): a pool past the machine's memory ended in numpy's MemoryError
    traceback (`--model qwen3-8b --num-pages 2000000000`). It is now refused before anything is
    allocated, naming the flag and the memory it needs. (The machine is made 64 MiB small here, so a
    10M-page L1, 260 MB, is too large without allocating much; before, it ran.)"""
    monkeypatch.setattr("hicache.simulated.memory_limit_bytes", lambda: 64 << 20, raising=False)
    with pytest.raises(SystemExit) as exc:
        replay_main([*SIM, "--disable-hicache", "--num-pages", "10000000"])
    err = capsys.readouterr().err
    assert exc.value.code == 2, err
    assert "--num-pages 10000000" in err and "GiB" in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1, err


def test_the_tiers_pages_all_count(capsys, monkeypatch):
    """L2 and L3 owner tables count too; the flag named is the one that sized the largest tier."""
    monkeypatch.setattr("hicache.simulated.memory_limit_bytes", lambda: 64 << 20, raising=False)
    with pytest.raises(SystemExit) as exc:
        replay_main([*SIM, "--model", "qwen3-8b", "--l1-tokens", "4096", "--l2-tokens", "4096",
                     "--l3-gib", "20000"])  # ~8.7M pages of 2.25 MiB
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "--l3-gib 20000" in err and "Traceback" not in err, err


def test_a_memory_error_building_the_pools_is_still_one_line(capsys, monkeypatch):
    """Where the estimate fits but the allocation fails anyway (a cgroup, other processes), numpy's
    MemoryError is reported in one line naming the flag (before: a traceback)."""
    monkeypatch.setattr("hicache.simulated.memory_limit_bytes", lambda: None, raising=False)
    real_init = PageAllocator.__init__

    def init(self, num_pages, name):
        if num_pages >= 10_000_000:  # what numpy raises for an owner table the machine cannot hold
            raise MemoryError(f"Unable to allocate {num_pages * 8 / 2**30:.1f} GiB for an array with shape "
                              f"({num_pages},) and data type int64")
        real_init(self, num_pages, name)

    monkeypatch.setattr(PageAllocator, "__init__", init)
    with pytest.raises(SystemExit) as exc:
        replay_main([*SIM, "--disable-hicache", "--num-pages", "10000000"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "--num-pages 10000000" in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1, err


# -- --disable-prefix-cache with hicache -------------------------------------------------------------
def test_engine_config_refuses_hicache_without_the_prefix_cache():
    """L2 and L3 only serve prefix hits: without the prefix cache they took backups nobody reads."""
    with pytest.raises(ValueError, match="prefix"):
        EngineConfig(enable_prefix_cache=False, hicache=HiCacheConfig(enable=True))
    with pytest.raises(ValueError, match="prefix"):
        EngineConfig(enable_prefix_cache=False).with_hicache(enable=True)
    EngineConfig(enable_prefix_cache=False)  # each alone is fine
    EngineConfig().with_hicache(enable=True)


def test_server_refuses_enable_hicache_with_disable_prefix_cache(capsys, monkeypatch):
    """Before: the server started, its L2/L3 idle."""
    served = []
    monkeypatch.setattr(serve._Server, "run", lambda self, *a, **k: served.append(True))
    code = serve.main(["--port", "0", "--device", "cpu", "--enable-hicache", "--disable-prefix-cache"])
    err = capsys.readouterr().err
    assert code == 2 and not served, err
    assert "--enable-hicache" in err and "--disable-prefix-cache" in err and "Traceback" not in err, err
    assert len(err.strip().splitlines()) == 1, err


def test_replay_disable_prefix_cache_turns_hicache_off_and_says_so(capsys):
    """The replay enables hicache by default; with --disable-prefix-cache it kept L2/L3 on, idle."""
    s = run_cli([*SIM, "--disable-prefix-cache"])
    err = capsys.readouterr().err
    assert s["completed"] == 2
    assert s["config"]["engine"]["hicache"]["enable"] is False
    assert s["config"]["engine"]["enable_prefix_cache"] is False
    assert s["hit_tokens"] == {"l1": 0, "l2": 0, "l3": 0}
    notes = [line for line in err.splitlines() if "--disable-prefix-cache" in line]
    assert len(notes) == 1 and "L2" in notes[0], err


def test_replay_refuses_an_explicit_enable_hicache_with_disable_prefix_cache(capsys):
    with pytest.raises(SystemExit) as exc:
        replay_main([*SIM, "--enable-hicache", "--disable-prefix-cache"])
    err = capsys.readouterr().err
    assert exc.value.code == 2 and "--enable-hicache" in err and "--disable-prefix-cache" in err, err


def test_replay_without_disable_prefix_cache_keeps_hicache_on(capsys):
    s = run_cli([*SIM])
    assert s["config"]["engine"]["hicache"]["enable"] is True
    assert "--disable-prefix-cache" not in capsys.readouterr().err
    s = run_cli([*SIM, "--enable-hicache"])
    assert s["config"]["engine"]["hicache"]["enable"] is True
