"""What a `--simulate` replay's pools need in host memory, checked before anything is allocated
(scheduler/replay.py): a pool whose bookkeeping cannot fit is one line naming the option that sized
it, not numpy's MemoryError; and requests the pools or the model cannot hold, and a timed replay's
waits of hours between arrivals, said before the replay runs."""
from __future__ import annotations

import argparse
import sys

from scheduler.config import EngineConfig, resolve_device
from scheduler.presets import model_config_of
from scheduler.request import kv_tokens

MAX_QUIET_WAIT_S = 3600.0  # a timed replay's wait between two arrivals beyond this is said first (warn_long_waits)

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


def warn_will_fail(parser: argparse.ArgumentParser, args: argparse.Namespace, items: list, config: EngineConfig,
                   positions: int) -> None:
    """One line before the replay when requests cannot fit (prompt + output - 1 tokens of K/V) the model's
    positions or the L1 pool, or their prompts --max-prompt-tokens: they will fail. The pool is known here unless
    the engine sizes it from the GPU's memory. (Regressions: the bundled sample given as --trace, at its 512
    tokens a hash id, failed 214 of 300 requests on the tiny preset, said only after the replay; --simulate at
    the 8B shape, its L1 the CPU's default 8,192 tokens, failed 148 of 300 where the line counted the 15 past
    the positions.) A second line counts the outputs past the engine's max_tokens limit."""
    page = config.page_size_on(resolve_device(config)[0].type)
    limits = [(positions, f"the model's {positions:,} positions")]
    if not config.l1_from_gpu_memory():
        l1_tokens = config.l1_pages(page) * page
        sized_by = sizing_flag(args, "L1")  # (regression: --l1-tokens, whichever flag sized it)
        limits.append((l1_tokens, f"the L1 pool's {l1_tokens:,} tokens ({sized_by} sizes it)"))
    kv_limit, why = min(limits)
    prompt_limit = min(config.max_prompt_tokens or kv_limit, kv_limit)
    past = [it.prompt_tokens for it in items
            if kv_tokens(it.prompt_tokens, it.output_tokens) > kv_limit or it.prompt_tokens > prompt_limit]
    if past:
        if prompt_limit < kv_limit:
            why += f" or --max-prompt-tokens {prompt_limit:,}"
        blocks = flag_name("block_tokens")
        print(f"{parser.prog}: {len(past):,} of {len(items):,} requests need more than {why} (prompts of "
              f"{min(past):,}-{max(past):,} tokens at {blocks} {args.block_tokens}) and will fail; "
              f"{flag_name('max_input_tokens')} and {flag_name('max_output_tokens')} clip them, a smaller "
              f"{blocks} scales every prompt down", file=sys.stderr)
    long_outputs = [it.output_tokens for it in items if it.output_tokens > config.max_new_tokens_limit]
    if long_outputs:  # (regression: said only after the replay, each request failing on its max_tokens)
        print(f"{parser.prog}: {len(long_outputs):,} of {len(items):,} requests ask for more than the engine's "
              f"{config.max_new_tokens_limit:,} output tokens (outputs of up to {max(long_outputs):,}) and will fail; "
              f"{flag_name('max_output_tokens')} clips them", file=sys.stderr)


def warn_long_waits(parser: argparse.ArgumentParser, args: argparse.Namespace, items: list) -> None:
    """One line before a timed replay (--time-scale > 0) that would wait more than an hour between two arrivals (a
    timestamp in microseconds rather than ms, a jump of days): the replay waits that long in silence (regression:
    a timestamp of 1e12 among the sample's waited 31 years with no word)."""
    if args.time_scale <= 0:
        return
    waits = [((b.arrival_s - a.arrival_s) * args.time_scale, b.line_no) for a, b in zip(items, items[1:])]
    long_waits = [w for w in waits if w[0] > MAX_QUIET_WAIT_S]
    if long_waits:
        wait_s, line_no = max(long_waits)
        more = f" ({len(long_waits):,} waits of more than an hour in all)" if len(long_waits) > 1 else ""
        print(f"{parser.prog}: {args.trace}:{line_no}: arrives {wait_s / 3600:,.1f} h after the request before it at "
              f"{flag_name('time_scale')} {args.time_scale:g} (timestamps are ms since the trace's start): the replay "
              f"will wait that long{more}; {flag_name('time_scale')} 0 replays as fast as possible", file=sys.stderr)
