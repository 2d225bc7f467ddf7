"""Qwen3Model through the paged pool against its own dense no-cache forward (CPU, float32, tiny)."""
from __future__ import annotations

import pytest
import torch

from scheduler.attention import AttentionBatch
from scheduler.model import Qwen3Model, init_random_weights, load_model
from scheduler.presets import PRESETS, ModelConfig

CFG = PRESETS["tiny"]
PAGE_SIZE = 4


@pytest.fixture(scope="module")
def model() -> Qwen3Model:
    return init_random_weights(Qwen3Model.empty(CFG, "cpu", torch.float32), seed=0)


def new_pool(num_pages: int = 64) -> torch.Tensor:
    return torch.zeros(CFG.kv_geometry(PAGE_SIZE, torch.float32).l1_shape(num_pages))


def prompt(seed: int, n: int) -> torch.Tensor:
    return torch.randint(0, CFG.vocab_size, (n,), generator=torch.Generator().manual_seed(seed))


def check(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


class Runner:
    """Feeds sequences step by step; each owns shuffled (non-consecutive) pages of one pool."""

    def __init__(self, model: Qwen3Model, num_seqs: int, pages_each: int = 8) -> None:
        self.model, self.pool = model, new_pool(num_seqs * pages_each + 5)
        perm = torch.randperm(self.pool.shape[2], generator=torch.Generator().manual_seed(7)).tolist()
        self.pages = [perm[i * pages_each:(i + 1) * pages_each] for i in range(num_seqs)]
        self.done = [0] * num_seqs

    def step(self, seqs: list[int], chunks: list[torch.Tensor], is_decode: bool = False) -> torch.Tensor:
        prefix = [self.done[s] for s in seqs]
        new = [len(c) for c in chunks]
        tables = [self.pages[s][: -(-(p + n) // PAGE_SIZE)] for s, p, n in zip(seqs, prefix, new)]
        batch = AttentionBatch.build(prefix, new, tables, PAGE_SIZE, "cpu", is_decode)
        for s, n in zip(seqs, new):
            self.done[s] += n
        return self.model(torch.cat(chunks), batch, self.pool)  # [B, V]


@torch.no_grad()
def test_prefill_chunks_and_decode_match_dense(model: Qwen3Model) -> None:
    ids = prompt(1, 29)
    dense = model.forward_dense(ids)  # [29, V]
    # all at once
    check(Runner(model, 1).step([0], [ids])[0], dense[-1])
    check(model.forward_dense(ids, last_only=True)[0], dense[-1])
    # cached prefix + chunks of several sizes (1 included)
    r, done = Runner(model, 1), 0
    for n in (6, 1, 10, 5, 7):
        check(r.step([0], [ids[done:done + n]])[0], dense[done + n - 1])
        done += n
    # token by token: a 1-token prefill, then decode steps
    r = Runner(model, 1)
    check(r.step([0], [ids[:1]])[0], dense[0])
    for i in range(1, 29):
        check(r.step([0], [ids[i:i + 1]], is_decode=True)[0], dense[i])


@torch.no_grad()
def test_batches_of_several_sequences_match_dense(model: Qwen3Model) -> None:
    lens = [13, 21, 6, 17]
    ids = [prompt(10 + i, n) for i, n in enumerate(lens)]
    dense = [model.forward_dense(x) for x in ids]
    r = Runner(model, len(lens))
    # mixed prefill: two fresh sequences, then cached prefixes with chunks of 1 and more tokens
    check(r.step([0, 1], [ids[0][:5], ids[1][:11]]), torch.stack([dense[0][4], dense[1][10]]))
    out = r.step([0, 1, 2, 3], [ids[0][5:6], ids[1][11:], ids[2][:5], ids[3][:16]])
    check(out, torch.stack([dense[0][5], dense[1][-1], dense[2][4], dense[3][15]]))
    # decode steps over the unfinished sequences, of different lengths
    while active := [s for s, n in enumerate(lens) if r.done[s] < n]:
        pos = [r.done[s] for s in active]
        out = r.step(active, [ids[s][p:p + 1] for s, p in zip(active, pos)], is_decode=True)
        check(out, torch.stack([dense[s][p] for s, p in zip(active, pos)]))


@torch.no_grad()
def test_greedy_is_not_degenerate(model: Qwen3Model) -> None:
    for seed in range(3):
        ids = prompt(100 + seed, 8)
        r = Runner(model, 1, pages_each=12)
        token = int(r.step([0], [ids])[0].argmax())
        out = [token]
        for _ in range(31):
            token = int(r.step([0], [torch.tensor([token])], is_decode=True)[0].argmax())
            out.append(token)
        tail = out[8:]
        assert len(set(out)) > 2, out
        assert tail[2:] != tail[:-2], f"greedy fell into a 1- or 2-cycle: {out}"


def test_presets_have_real_shapes() -> None:
    bf16 = torch.bfloat16
    assert PRESETS["qwen3-8b"].kv_bytes_per_token(bf16) == 147456
    assert PRESETS["qwen3-4b"].kv_bytes_per_token(bf16) == 147456
    assert PRESETS["qwen3-0.6b"].kv_bytes_per_token(bf16) == 2 * 28 * 8 * 128 * 2
    # parameter counts of the released models (billions)
    for name, billions in (("qwen3-0.6b", 0.596), ("qwen3-4b", 4.02), ("qwen3-8b", 8.19)):
        assert abs(PRESETS[name].num_params() / 1e9 - billions) / billions < 0.01, name
    assert not PRESETS["qwen3-8b"].tie_word_embeddings and PRESETS["qwen3-4b"].tie_word_embeddings
    assert all(c.eos_token_id is None for c in PRESETS.values())


def test_from_hf_config_round_trip() -> None:
    cfg = PRESETS["qwen3-8b"]
    assert ModelConfig.from_hf_config(cfg.to_hf_config()) == cfg
    hf = {**cfg.to_hf_config(), "eos_token_id": [151645, 151643]}
    listed = ModelConfig.from_hf_config(hf)
    assert listed.eos_token_id == 151645 and listed.eos_token_ids == (151645, 151643)  # every one stops
    assert ModelConfig.from_hf_config(listed.to_hf_config()) == listed
    with pytest.raises(ValueError, match="num_hidden_layers"):
        ModelConfig.from_hf_config({k: v for k, v in hf.items() if k != "num_hidden_layers"})
    with pytest.raises(ValueError, match="Qwen3"):
        ModelConfig.from_hf_config({**hf, "model_type": "llama"})


def test_load_model_presets_and_errors() -> None:
    a, cfg, ident = load_model("tiny", torch.device("cpu"), torch.float32, seed=3)
    b, _, ident_b = load_model("tiny", torch.device("cpu"), torch.float32, seed=3)
    c, _, ident_c = load_model("tiny", torch.device("cpu"), torch.float32, seed=4)
    assert cfg == CFG and ident == ident_b != ident_c and "tiny" in ident and "3" in ident
    assert torch.equal(a.layers[1].qkv_proj.weight, b.layers[1].qkv_proj.weight)
    assert not torch.equal(a.layers[1].qkv_proj.weight, c.layers[1].qkv_proj.weight)
    assert a.embed_tokens.weight.dtype == torch.float32
    with pytest.raises(ValueError, match="qwen3-8b"):
        load_model("no-such-model", torch.device("cpu"), torch.float32, seed=0)


def test_bf16_random_model_runs() -> None:
    model, _, _ = load_model("tiny", torch.device("cpu"), torch.bfloat16, seed=0)
    pool = torch.zeros(CFG.kv_geometry(PAGE_SIZE, torch.bfloat16).l1_shape(8), dtype=torch.bfloat16)
    batch = AttentionBatch.build([0], [9], [[3, 1, 6]], PAGE_SIZE, "cpu", is_decode=False)
    with torch.no_grad():
        logits = model(prompt(0, 9), batch, pool)
    assert logits.shape == (1, CFG.vocab_size) and logits.dtype == torch.float32
    assert torch.isfinite(logits).all()


def test_rope_tables_are_cached(model: Qwen3Model) -> None:
    cos, sin = model.rope_tables(10, torch.device("cpu"), torch.float32)
    assert cos.shape[0] >= CFG.max_position_embeddings
    again = model.rope_tables(100, torch.device("cpu"), torch.float32)
    assert again[0] is cos
    grown = model.rope_tables(CFG.max_position_embeddings + 1, torch.device("cpu"), torch.float32)
    assert grown[0].shape[0] > CFG.max_position_embeddings
    check(grown[0][: cos.shape[0]], cos)
