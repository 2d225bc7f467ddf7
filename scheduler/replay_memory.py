"""What a `--simulate` replay's pools need in host memory, checked before anything is allocated
(scheduler/replay.py): a pool whose bookkeeping cannot fit is one line naming the option that sized
it, not numpy's MemoryError."""
from __future__ import annotations

import argparse

from scheduler.config import EngineConfig, resolve_device
from scheduler.presets import model_config_of

GIB = 1 << 30
# The options that size each tier, in the order they win (the last is the fallback): the one to lower
TIER_SIZE_OPTIONS = {"L1": ("l1_tokens", "l1_gib", "num_pages", "max_total_tokens"),
                     "L2": ("l2_gib", "l2_tokens", "hicache_size_gb", "hicache_ratio"),
                     "L3": ("l3_gib", "l3_tokens", "hicache_storage_size_gb", "hicache_storage_ratio")}


def flag_name(key: str) -> str:
    """An argparse dest's option: l3_gib -> --l3-gib."""
    return "--" + key.replace("_", "-")


def pool_pages(cfg: EngineConfig) -> dict[str, int]:
    """The pages of each tier, sized as the engine sizes them (Engine, CacheManager)."""
    device, dtype = resolve_device(cfg)
    page_size = cfg.page_size_on(device.type)
    bpp = model_config_of(cfg.model).kv_geometry(page_size, dtype).bytes_per_page
    pages = {"L1": cfg.l1_pages(page_size), "L2": 0, "L3": 0}
    if cfg.hicache.enable:
        pages["L2"] = cfg.hicache.host_pages(pages["L1"], bpp)
        if pages["L2"] >= 1:  # (else the engine refuses it, naming its flag)
            pages["L3"] = cfg.hicache.storage_pages(pages["L2"], bpp)
    return pages


def _sizing_flag(args: argparse.Namespace, pages: dict[str, int]) -> str:
    """The option, with its value, that sized the largest tier: the one to lower."""
    return sizing_flag(args, max(pages, key=pages.get))


def sizing_flag(args: argparse.Namespace, tier: str) -> str:
    """The option, with its value, that sized `tier` ("L1", "L2", "L3")."""
    keys = TIER_SIZE_OPTIONS[tier]
    key = next((k for k in keys[:-1] if getattr(args, k) not in (None, 0)), keys[-1])
    value = str(getattr(args, key))
    return f"{flag_name(key)} {value[:-2] if value.endswith('.0') else value}"


def _pool_text(pages: dict[str, int]) -> str:
    return " + ".join(f"{n:,} {tier}" for tier, n in pages.items() if n or tier == "L1") + " pages"


def check_simulated_memory(args: argparse.Namespace, cfg: EngineConfig) -> None:
    """Refuses a simulated pool whose bookkeeping (an owner entry per page of each tier) cannot fit
    in this machine's memory, before anything is allocated: it ended in numpy's MemoryError."""
    from hicache import simulated

    pages = pool_pages(cfg)
    need_bytes, limit_bytes = simulated.simulated_pool_bytes(list(pages.values())), simulated.memory_limit_bytes()
    if limit_bytes is not None and need_bytes > limit_bytes:
        raise ValueError(f"{_sizing_flag(args, pages)}: a simulated pool of {_pool_text(pages)} needs "
                         f"{need_bytes / GIB:,.2f} GiB of host memory for its bookkeeping "
                         f"({simulated.OWNER_TABLE_BYTES_PER_PAGE} bytes a page, more during the integrity "
                         f"check), more than the {limit_bytes / GIB:,.2f} GiB this process can have; lower it")


def out_of_memory(args: argparse.Namespace, cfg: EngineConfig, exc: MemoryError) -> str:
    """One line for a MemoryError that building the pools raised (where the estimate fit)."""
    detail = str(exc).splitlines()[0] if str(exc) else "MemoryError"
    if cfg.l1_from_gpu_memory():  # (pool_pages counts such an L1 at 8,192 tokens: regression, it said so)
        return (f"out of memory building the pools, L1 sized from the GPU's memory ({detail}); lower "
                f"--gpu-memory-fraction or give --l1-tokens, and the L2 / L3 sizes")
    pages = pool_pages(cfg)
    return (f"{_sizing_flag(args, pages)}: out of memory building a pool of {_pool_text(pages)} ({detail}); "
            f"lower it")
