"""How large L1 (and an L2 sized by its ratio) may be on this machine, as vLLM's gpu_memory_utilization
and SGLang's mem_fraction_static size their KV pools: L1 takes what a share of the GPU's memory leaves
once the weights are loaded and a reserve is set aside for a step's activations. A fixed L1 of 8,192
tokens had served an H200 with 139 GiB for a model of 16 GiB: 32 requests of 768 tokens queued behind
the 10 that fit.

  L1 bytes = fraction x device memory - memory in use now (the weights, the CUDA context, other
             processes) - reserve (a prefill batch's activations, a decode batch's logits and sampling
             copies, 1 GiB for workspaces, CUDA graphs and the allocator's slack)

An L2 sized by its ratio to L1 (no --hicache-size-gb) is held to half the host memory this process may
have: twice an auto-sized L1 of ~110 GiB would not fit a host of 128 GiB (pinned memory cannot be
swapped: the machine would thrash or the process be killed). Likewise an L3 file sized by its ratio to
L2 (no --hicache-storage-size-gb) is held to half the free space of its file system (twice that L2 is
~120 GiB, where the H200 machine's disk has 64 GiB: the file's reservation refused to start)."""
from __future__ import annotations

import gc
import os
import stat
import tempfile
from dataclasses import replace

import structlog
import torch

from hicache.config import MAX_TIER_PAGES, HiCacheConfig
from hicache.geometry import KVGeometry
from scheduler.config import EngineConfig
from scheduler.presets import ModelConfig

log = structlog.get_logger("scheduler.memory_plan")

GIB = 1 << 30
FIXED_RESERVE_BYTES = 1 << 30  # workspaces (cuBLAS, Triton), CUDA graphs' pool, the allocator's slack
SAMPLING_COPIES = 8            # float32 [rows, V] tensors a decode step may hold at once: the logits,
                               # a penalized copy, the sort's values and int64 ids, its probabilities, the
                               # exponential draws and what they make (scheduler/sampling.py)
HOST_SHARE = 0.5               # of the host memory this process may have, the most a ratio-sized L2 takes
DISK_SHARE = 0.5               # of its file system's free space, the most a ratio-sized L3 file takes


def activation_reserve_bytes(model: ModelConfig, config: EngineConfig, elem_bytes: int) -> int:
    """Device memory a step needs beside the weights and L1: a prefill batch of max_prefill_tokens
    (its hidden states, q/k/v, gate_up and its product, with room for the copies between them) and a
    decode batch of max_running_requests rows' logits and sampling copies, plus a fixed allowance."""
    qkv = (model.num_heads + 2 * model.num_kv_heads) * model.head_dim
    per_token_bytes = (8 * model.hidden_size + 4 * model.intermediate_size + 2 * qkv) * elem_bytes
    logits_bytes = config.max_running_requests * model.vocab_size * 4 * SAMPLING_COPIES
    return config.max_prefill_tokens * per_token_bytes + logits_bytes + FIXED_RESERVE_BYTES


def l1_pages_from_memory(config: EngineConfig, device: torch.device, model: ModelConfig,
                         geometry: KVGeometry) -> int:
    """L1 pages that config.gpu_memory_fraction of `device`'s memory leaves, read now (after the
    weights are loaded; `l1_budget_pages`), logged."""
    # what this process freed (an engine before this one, once gc collects its reference cycle) still
    # sits in torch's cache and reads as in use: give it back first (SGLang empties it as it sizes too)
    gc.collect()
    torch.cuda.empty_cache()
    free_bytes, total_bytes = torch.cuda.mem_get_info(device)
    pages = l1_budget_pages(config, model, geometry, total_bytes, total_bytes - free_bytes)
    log.info("l1_sized", pages=pages, tokens=pages * geometry.page_size,
             gib=round(pages * geometry.bytes_per_page / GIB, 2), fraction=config.gpu_memory_fraction,
             device_gib=round(total_bytes / GIB, 1), in_use_gib=round((total_bytes - free_bytes) / GIB, 2),
             reserve_gib=round(activation_reserve_bytes(model, config, geometry.itemsize) / GIB, 2))
    return pages


def l1_budget_pages(config: EngineConfig, model: ModelConfig, geometry: KVGeometry, total_bytes: int,
                    used_bytes: int) -> int:
    """L1 pages in config.gpu_memory_fraction of a device of `total_bytes` with `used_bytes` in use,
    less the activation reserve (at most the pages a tier can have). Raises ValueError naming the
    flags when that leaves no room for the pages of one request of 4,096 tokens (or
    max_context_tokens, if fewer)."""
    reserve_bytes = activation_reserve_bytes(model, config, geometry.itemsize)
    budget_bytes = int(config.gpu_memory_fraction * total_bytes) - used_bytes - reserve_bytes
    pages = min(MAX_TIER_PAGES, max(0, budget_bytes // geometry.bytes_per_page))
    least_pages = 2 + -(-min(config.max_context_tokens, 4096) // geometry.page_size)
    if pages < least_pages:  # (at a fraction of 1 already, "raise it" was the advice)
        raise_it = "raise --gpu-memory-fraction, " if config.gpu_memory_fraction < 1 else ""
        raise ValueError(
            f"--gpu-memory-fraction {config.gpu_memory_fraction} of this GPU's {total_bytes / GIB:.1f} GiB leaves "
            f"{max(0, budget_bytes) / GIB:.2f} GiB for L1 once {used_bytes / GIB:.1f} GiB in use (the weights "
            f"among it) and a {reserve_bytes / GIB:.1f} GiB reserve for activations are counted: fewer than the "
            f"{least_pages} pages a request needs; {raise_it}lower --max-prefill-tokens / --max-running-requests "
            f"(the reserve), or give --max-total-tokens")
    return pages


def host_config_within_memory(hc: HiCacheConfig, l1_pages: int, bytes_per_page: int,
                              limit_bytes: int | None) -> HiCacheConfig:
    """hc, with an L2 sized by its ratio held to HOST_SHARE of `limit_bytes` (the host memory this
    process may have; None: unknown, nothing held). An L2 given in GiB is left as asked."""
    if not hc.enable or hc.host_size_gb is not None or limit_bytes is None:
        return hc
    asked_bytes = int(l1_pages * hc.host_ratio) * bytes_per_page
    # (at most a tier's pages: half a host of terabytes was refused naming --hicache-size-gb, not given)
    most_bytes = min(int(HOST_SHARE * limit_bytes) // bytes_per_page, MAX_TIER_PAGES) * bytes_per_page
    if asked_bytes <= most_bytes:
        return hc
    if most_bytes == 0:  # (was "raise --hicache-ratio / --hicache-size-gb": the ratio had not sized it)
        raise ValueError(
            f"hicache: --hicache-ratio {hc.host_ratio} asks L2 of {asked_bytes / GIB:.2f} GiB, held to half the "
            f"memory this process may have ({limit_bytes / GIB:.2f} GiB: the machine's, ulimit -v or the "
            f"cgroup's memory.max): no page of {bytes_per_page:,} bytes; allow it more memory, lower --page-size, "
            f"or give --hicache-size-gb")
    log.warning("l2_held_to_host_memory", asked_gib=round(asked_bytes / GIB, 2), gib=round(most_bytes / GIB, 2),
                host_gib=round(limit_bytes / GIB, 1), ratio=hc.host_ratio)
    return replace(hc, host_size_gb=most_bytes / GIB)


def plan_pools(config: EngineConfig, device: torch.device, model: ModelConfig, geometry: KVGeometry,
               model_id: str) -> tuple[int, HiCacheConfig]:
    """(L1 pages, the hicache config the pools are built from): L1 from --num-pages or --max-total-tokens,
    or, with max_total_tokens 0 on CUDA, from the GPU's memory now; L2 held to the host's memory."""
    from hicache.simulated import memory_limit_bytes

    if config.max_total_tokens == 0 and config.num_pages == 0 and device.type == "cuda" and not config.simulate:
        l1_pages = l1_pages_from_memory(config, device, model, geometry)
    else:
        l1_pages = config.l1_pages(geometry.page_size)
    hc = replace(config.hicache, model_id=model_id)
    if not config.simulate:  # (simulated: no L2 or L3 byte is held; the deployment's tiers, as asked)
        hc = host_config_within_memory(hc, l1_pages, geometry.bytes_per_page, memory_limit_bytes())
        hc = storage_config_within_disk(hc, l1_pages, geometry.bytes_per_page, disk_free_bytes(hc))
    check_l2_holds_a_page(hc, l1_pages, geometry.bytes_per_page)
    return l1_pages, hc


def check_l2_holds_a_page(hc: HiCacheConfig, l1_pages: int, bytes_per_page: int) -> None:
    """Raises ValueError naming the flag that sized an L2 of no page (the pool manager's own refusal
    advised raising --hicache-ratio beside --hicache-size-gb, which overrides it, and the reverse)."""
    if not hc.enable or hc.host_pages(l1_pages, bytes_per_page) >= 1:
        return
    if hc.host_size_gb is not None:
        raise ValueError(f"hicache: --hicache-size-gb {hc.host_size_gb} holds no L2 page of {bytes_per_page:,} "
                         f"bytes; raise it")
    raise ValueError(f"hicache: --hicache-ratio {hc.host_ratio} x {l1_pages:,} L1 pages gives L2 no page; raise it, "
                     f"or give --hicache-size-gb")


def disk_free_bytes(hc: HiCacheConfig) -> int | None:
    """Free bytes (for this user) of the file system the L3 file goes on: its path's directory, or the
    temporary directory (hicache/storage_file.py); None when unknown. A regular file already at the path
    (the last run's L3) counts too: the new one is truncated into its blocks, as the file's own check
    counts them (else each restart held L3 to half of what the last one left free)."""
    directory = os.path.dirname(os.path.abspath(hc.storage_path)) if hc.storage_path else tempfile.gettempdir()
    try:
        st = os.statvfs(directory)
    except OSError:
        return None
    try:
        old = os.lstat(hc.storage_path) if hc.storage_path else None
    except OSError:
        old = None
    old_bytes = old.st_blocks * 512 if old is not None and stat.S_ISREG(old.st_mode) else 0
    return st.f_bavail * st.f_frsize + old_bytes


def storage_config_within_disk(hc: HiCacheConfig, l1_pages: int, bytes_per_page: int,
                               free_bytes: int | None) -> HiCacheConfig:
    """hc, with an L3 file sized by its ratio held to DISK_SHARE of `free_bytes` (None: unknown, nothing
    held). An L3 given in GiB, or on Redis, is left as asked; so is one where even the held size would
    not hold a page (the file's own check refuses it, naming the flags)."""
    if (not hc.enable or hc.storage_backend != "file" or hc.storage_size_gb is not None or hc.storage_ratio == 0
            or free_bytes is None):
        return hc
    asked_bytes = int(hc.host_pages(l1_pages, bytes_per_page) * hc.storage_ratio) * bytes_per_page
    most_bytes = min(int(DISK_SHARE * free_bytes) // bytes_per_page, MAX_TIER_PAGES) * bytes_per_page
    if asked_bytes <= most_bytes or most_bytes < bytes_per_page:
        return hc
    log.warning("l3_held_to_free_disk", asked_gib=round(asked_bytes / GIB, 2), gib=round(most_bytes / GIB, 2),
                free_gib=round(free_bytes / GIB, 1), ratio=hc.storage_ratio)
    return replace(hc, storage_size_gb=most_bytes / GIB)


def pools_line(status: dict) -> str:
    """One line of what the tiers hold, from Engine.status(): what the server prints as it starts (the
    L1 that --gpu-memory-fraction gave is not otherwise shown)."""
    engine, tiers = status["engine"], status["tiers"]
    parts = [f"{tier.upper()} {t['capacity_pages'] * engine['page_size']:,} tokens ({_size(t['capacity_bytes'])})"
             for tier, t in tiers.items() if t]  # (a tier that is off: None)
    return f"{engine['model']} on {engine['device']} ({engine['dtype']}): " + ", ".join(parts)


def _size(num_bytes: int) -> str:
    """GiB, or MiB below one GiB (regression: a tier under 5 MiB was "(0.00 GiB)")."""
    return f"{num_bytes / GIB:.2f} GiB" if num_bytes >= GIB else f"{num_bytes / (1 << 20):.2f} MiB"
