"""Qwen3 in plain torch: RMSNorm, q/k-norm, RoPE, GQA attention over the paged L1 pool, SwiGLU MLP.

Projections are fused internally (qkv_proj = [q; k; v], gate_up_proj = [gate; up]); scheduler/loader.py
maps the HF tensor names onto slices of them.
"""
from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from kernels import fused_ops, skinny_gemm
from kernels.decode_attention import takes_head_dim
from kernels.layer_flags import LayerWait
from scheduler.attention import AttentionBatch, paged_attention, write_kv
from scheduler.presets import PRESETS, ModelConfig, is_preset

# attention callable of one layer: (layer, q [T,Hq,D], k [T,Hkv,D], v [T,Hkv,D]) -> [T,Hq,D]
AttnFn = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
# fused path: K/V are already in the pool; (layer, q [T,Hq,D]) -> [T,Hq,D]
FusedAttnFn = Callable[[int, torch.Tensor], torch.Tensor]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int) -> None:
        super().__init__()
        self.index = index
        self.cfg = cfg
        h, d = cfg.hidden_size, cfg.head_dim
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.qkv_proj = nn.Linear(h, cfg.q_size + 2 * cfg.kv_size, bias=False)
        self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.k_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.o_proj = nn.Linear(cfg.q_size, h, bias=False)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.gate_up_proj = nn.Linear(h, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, h, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attn: AttnFn) -> torch.Tensor:
        # x: [T, H]; cos, sin: [T, 1, D]
        cfg, tokens = self.cfg, x.shape[0]
        qkv = self.qkv_proj(self.input_layernorm(x))  # [T, (Hq + 2 Hkv) * D]
        q, k, v = qkv.split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
        q = self.q_norm(q.view(tokens, cfg.num_heads, cfg.head_dim))  # [T, Hq, D]
        k = self.k_norm(k.view(tokens, cfg.num_kv_heads, cfg.head_dim))  # [T, Hkv, D]
        v = v.view(tokens, cfg.num_kv_heads, cfg.head_dim)  # [T, Hkv, D]
        q = q * cos + fused_ops.rotate_half(q) * sin
        k = k * cos + fused_ops.rotate_half(k) * sin
        o = attn(self.index, q, k, v)  # [T, Hq, D]
        x = x + self.o_proj(o.reshape(tokens, cfg.q_size))
        gate, up = self.gate_up_proj(self.post_attention_layernorm(x)).chunk(2, dim=-1)  # [T, I] each
        return x + self.down_proj(F.silu(gate) * up)

    def forward_fused(self, h: torch.Tensor, residual: torch.Tensor | None, rope: tuple[torch.Tensor, torch.Tensor],
                      batch: AttentionBatch, kv_pool: torch.Tensor, attn: FusedAttnFn,
                      skinny: bool = False, rows: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Same layer in 8 kernels + 2 for attention: h is the previous layer's un-added output,
        residual the stream before it; h, residual: [T, H]. Layer 0: h is the embedding table [V, H],
        residual None and rows the input ids [T]: its first norm gathers those rows itself (the
        stream it returns is the embeddings), in place of the embedding's own kernel (12 us for a
        16-row tail in an H200 profile, session 25; the tail forward ~12 us faster for it, session 26).
        skinny (T <= 64): the projections are kernels/skinny_gemm.py, SiLU x up inside gate_up's (7 + 2);
        o_proj and down then leave float32 K-split partials [P, T, H] that the next add_rms_norm adds.
        Returns this layer's (un-added MLP output [T, H] or [P, T, H], residual stream [T, H])."""
        cfg = self.cfg

        def proj(linear: nn.Linear, x: torch.Tensor, swiglu: bool = False, partials: bool = False) -> torch.Tensor:
            """partials: the consumer (add_rms_norm) also takes a split-K projection's float32
            partials [P, T, N] and adds them up itself."""
            if skinny:
                split = skinny_gemm.split_k_for(*linear.weight.shape) if partials else 1
                return skinny_gemm.linear(x, linear.weight, swiglu=swiglu, split_k=split)
            return fused_ops.silu_mul_triton(linear(x)) if swiglu else linear(x)

        normed, residual = fused_ops.add_rms_norm_triton(h, residual, self.input_layernorm.weight, cfg.rms_norm_eps,
                                                         rows=rows)
        qkv = proj(self.qkv_proj, normed)  # [T, (Hq + 2 Hkv) * D]
        q = fused_ops.qk_norm_rope_kv_triton(
            qkv, self.q_norm.weight, self.k_norm.weight, cfg.rms_norm_eps, rope[0], rope[1], batch.positions,
            kv_pool[0, self.index], kv_pool[1, self.index], batch.out_slots, cfg.num_heads,
            cfg.num_kv_heads)  # [T, Hq, D]; K/V stored at out_slots
        o = attn(self.index, q)  # [T, Hq, D]
        attn_out = proj(self.o_proj, o.reshape(q.shape[0], cfg.q_size), partials=True)  # [T, H] or [P, T, H]
        normed, residual = fused_ops.add_rms_norm_triton(attn_out, residual, self.post_attention_layernorm.weight,
                                                         cfg.rms_norm_eps)
        return proj(self.down_proj, proj(self.gate_up_proj, normed, swiglu=True), partials=True), residual


class Qwen3Model(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.scale = 1.0 / math.sqrt(cfg.head_dim)
        # fused Triton kernels for norms / RoPE / K/V writes / SiLU (kernels/fused_ops.py); set by
        # load_model for CUDA, settable for tests (the CPU runs them under TRITON_INTERPRET=1)
        self.fused = False
        # fused path, at most skinny_gemm.MAX_ROWS rows: projections by kernels/skinny_gemm.py instead
        # of cuBLAS (set by the Engine from EngineConfig.small_gemm; settable for tests)
        self.skinny = False
        # CUDA, half-precision weights: the LM head accumulates and outputs float32 (set by the Engine from
        # EngineConfig.fp32_lm_head; settable for tests); otherwise its output is the model's dtype, then float32
        self.fp32_lm_head = False
        self._rope: dict[tuple[torch.device, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}

    @classmethod
    def empty(cls, cfg: ModelConfig, device: torch.device | str, dtype: torch.dtype) -> "Qwen3Model":
        """Allocated on `device` in `dtype`, uninitialised (no CPU staging, no default init pass)."""
        with torch.device("meta"):
            model = cls(cfg).to(dtype)  # meta: no memory, no init
        return model.to_empty(device=device).eval().requires_grad_(False)

    @property
    def lm_head_weight(self) -> torch.Tensor:  # [V, H]
        return self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight

    def rope_tables(self, max_positions: int, device: torch.device,
                    dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin: [N >= max_positions, D], cached per (device, dtype).

        Sized to max_position_embeddings on first use (a few MiB), so it grows only past that; a CUDA
        graph runner should call this with its largest position before capturing.
        """
        key = (torch.device(device), dtype)
        cached = self._rope.get(key)
        if cached is not None and cached[0].shape[0] >= max_positions:
            return cached
        size = max(max_positions, self.cfg.max_position_embeddings, 2 * (cached[0].shape[0] if cached else 0))
        d = self.cfg.head_dim
        inv_freq = 1.0 / (self.cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32, device=device) / d))
        freqs = torch.outer(torch.arange(size, dtype=torch.float32, device=device), inv_freq)  # [N, D/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [N, D]
        self._rope[key] = (emb.cos().to(dtype), emb.sin().to(dtype))
        return self._rope[key]

    def _run_layers(self, input_ids: torch.Tensor, positions: torch.Tensor, max_positions: int,
                    attn: AttnFn) -> torch.Tensor:
        x = self.embed_tokens(input_ids)  # [T, H]
        cos, sin = self.rope_tables(max_positions, x.device, x.dtype)
        cos, sin = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)  # [T, 1, D]
        for layer in self.layers:
            x = layer(x, cos, sin, attn)
        return x

    def logits_of(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: the final norm's output [R, H] -> float32 logits [R, V].

        With `fp32_lm_head` on CUDA (bf16 / fp16 weights) the product's float32 sums are the logits: cuBLAS's
        half-precision GEMM with a float32 output, the same weight read and faster than a bf16 output and its
        cast (docs/design.md, "Small forwards"). Rounded to bf16 first (vLLM's, and this path's off CUDA),
        logits of magnitude 4 are kept in steps of 1/32, so two candidates often tie exactly. (Where the
        activations round differently, a verify row against a decode row, a restore's tail against a whole
        prefill, near-ties can still part either way.)"""
        weight = self.lm_head_weight  # [V, H]
        if self.fp32_lm_head and hidden.is_cuda and weight.dtype in (torch.bfloat16, torch.float16):
            return torch.mm(hidden, weight.t(), out_dtype=torch.float32)
        return F.linear(hidden, weight).float()

    def forward(self, input_ids: torch.Tensor, batch: AttentionBatch, kv_pool: torch.Tensor,
                wait_layer: LayerWait | None = None) -> torch.Tensor:
        """input_ids: [T] (new tokens, batch order) -> float32 logits [B, V] of each sequence's last new token
        (of every row for a decode batch of R > 1 rows per sequence given no last_rows: [B * R, V]).

        Writes the new tokens' K/V into kv_pool [2, L, P, S, Hkv, D] at batch.out_slots.
        wait_layer: layer l's attention first waits, on the device, for layer l of a prefix still
        being restored layer by layer (hicache/layer_copy.py, kernels/layer_flags.py).
        """
        return self.logits_of(self.hidden_states(input_ids, batch, kv_pool, wait_layer, batch.logit_rows))

    def hidden_states(self, input_ids: torch.Tensor, batch: AttentionBatch, kv_pool: torch.Tensor,
                      wait_layer: LayerWait | None = None, rows: torch.Tensor | None = None) -> torch.Tensor:
        """`forward` up to the final norm, whose output it returns at `rows` ([R] row numbers in T; None:
        every row): [R, H] (`logits_of` makes their logits; a prompt's logprobs need every row's)."""
        def attn(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            write_kv(kv_pool, layer, k, v, batch.out_slots)
            return paged_attention(q, kv_pool, layer, batch, self.scale, wait_layer)

        max_positions = max(p + n for p, n in zip(batch.prefix_lens, batch.new_lens))
        if self.fused:
            return self._hidden_fused(input_ids, batch, kv_pool, max_positions, wait_layer, rows)
        x = self._run_layers(input_ids, batch.positions, max_positions, attn)  # [T, H]
        if rows is not None:
            x = x.index_select(0, rows)  # [R, H]
        return self.norm(x)

    def _hidden_fused(self, input_ids: torch.Tensor, batch: AttentionBatch, kv_pool: torch.Tensor,
                      max_positions: int, wait_layer: LayerWait | None, rows: torch.Tensor | None) -> torch.Tensor:
        def attn(layer: int, q: torch.Tensor) -> torch.Tensor:
            return paged_attention(q, kv_pool, layer, batch, self.scale, wait_layer)

        table = self.embed_tokens.weight  # [V, H]: layer 0's first norm gathers the input rows
        rope = self.rope_tables(max_positions, table.device, table.dtype)
        skinny = self.skinny and input_ids.shape[0] <= skinny_gemm.MAX_ROWS
        h, residual = table, None
        for layer in self.layers:
            h, residual = layer.forward_fused(h, residual, rope, batch, kv_pool, attn, skinny,
                                              rows=input_ids if residual is None else None)
        # the norm reads only those rows (plain decode: every row is a last row)
        x, _ = fused_ops.add_rms_norm_triton(h, residual, self.norm.weight, self.cfg.rms_norm_eps, rows=rows)
        return x  # [R, H]

    def forward_dense(self, input_ids: torch.Tensor, last_only: bool = False) -> torch.Tensor:
        """Reference: one sequence, no cache, plain causal SDPA. input_ids: [N] -> float32 logits [N, V]
        ([1, V] with last_only: the fair baseline for timing a prefill, which needs only the last row)."""
        def attn(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            qh, kh, vh = (t.transpose(0, 1)[None] for t in (q, k, v))  # [1, H, N, D]
            out = F.scaled_dot_product_attention(qh, kh, vh, is_causal=True, scale=self.scale, enable_gqa=True)
            return out[0].transpose(0, 1)  # [N, Hq, D]

        n = input_ids.shape[0]
        positions = torch.arange(n, device=input_ids.device)
        x = self._run_layers(input_ids, positions, n, attn)  # [N, H]
        return self.logits_of(self.norm(x[-1:] if last_only else x))


@torch.no_grad()
def init_random_weights(model: Qwen3Model, seed: int) -> Qwen3Model:
    """Seeded random weights, drawn on the model's device in its dtype.

    Chosen so greedy decoding is not degenerate (measured on the H200 for 0.6b/4b/8b in bf16: 32 of 32
    greedy tokens distinct for 3 seeds each; tiny on CPU likewise varied):
    - embeddings ~ N(0, 1), projections ~ N(0, 1/fan_in), so activations keep unit scale;
    - o_proj further scaled by 1/sqrt(2 * layers): with full-size attention outputs the residual stream
      fills with context averages and every step picks the same "hub" token;
    - norms = 1, except the final norm's weight = random +-1: with tied embeddings the logits are
      E @ norm(x) and x contains the input token's own embedding, so unit weights make greedy decoding
      repeat its input; random signs remove that self-preference (0.6b/4b otherwise emit 1 token).
    """
    device = model.embed_tokens.weight.device
    gen = torch.Generator(device=device).manual_seed(seed)
    residual_gain = 1.0 / math.sqrt(2 * model.cfg.num_layers)
    for name, param in model.named_parameters():
        if name == "norm.weight":
            param.copy_(torch.randint(0, 2, param.shape, device=device, generator=gen).mul_(2).sub_(1))
        elif name.endswith("norm.weight"):
            param.fill_(1.0)
        elif name == "embed_tokens.weight":  # [V, H]
            param.normal_(0.0, 1.0, generator=gen)
        else:  # nn.Linear weight [out, in]
            gain = residual_gain if name.endswith("o_proj.weight") else 1.0
            param.normal_(0.0, gain / math.sqrt(param.shape[1]), generator=gen)
    return model


def check_head_dim(cfg: ModelConfig, device: torch.device) -> None:
    """On CUDA every decode step runs the paged decode kernel, which takes a power-of-two head_dim of >= 16: another
    is refused as the model loads (regression: a checkpoint of head_dim 96 loaded, prefilled, and failed its first
    decode step)."""
    if device.type == "cuda" and not takes_head_dim(cfg.head_dim):
        raise ValueError(f"head_dim {cfg.head_dim} is not served on CUDA: the paged decode kernel takes a power of "
                         f"two of at least 16 (the CPU serves any)")


def load_model(name_or_path: str, device: torch.device, dtype: torch.dtype,
               seed: int) -> tuple[Qwen3Model, ModelConfig, str]:
    """A preset (seeded random weights) or a checkpoint directory -> (model, config, model identity).

    Identity: "<preset>:seed<seed>:<device type>" (random draws differ between CPU and CUDA generators)
    or "ckpt:<digest of config.json and of each safetensors file's name, size and bytes>"
    (loader.checkpoint_identity).
    """
    import os

    device = torch.device(device)
    if is_preset(name_or_path):
        cfg = PRESETS[name_or_path]
        model = init_random_weights(Qwen3Model.empty(cfg, device, dtype), seed)
        identity = f"{name_or_path}:seed{seed}:{device.type}"
    elif os.path.isdir(name_or_path):
        from scheduler.loader import load_checkpoint  # loader imports this module

        model, cfg, identity = load_checkpoint(name_or_path, device, dtype)
    else:
        raise ValueError(f"model {name_or_path!r} is neither a preset ({', '.join(PRESETS)}) nor a directory")
    check_head_dim(cfg, device)
    model.fused = device.type == "cuda" and fused_ops.triton is not None and cfg.head_dim & (cfg.head_dim - 1) == 0
    return model, cfg, identity
