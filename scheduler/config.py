"""Engine configuration (frozen dataclass) and the command-line flags that build it."""
from __future__ import annotations

import argparse
import numbers
import os
from dataclasses import dataclass, field, replace

import torch

from hicache.config import MAX_TIER_PAGES, HiCacheConfig
from scheduler.speculative import SpeculativeConfig

MAX_SEED = (1 << 64) - 1  # torch.manual_seed's range (a larger one failed naming no flag)
FP32_LM_HEAD_OFF = ("CUDA, bf16 / fp16 weights: round the LM head's output to the model's dtype before float32 "
                    "(vLLM's; default: its float32 sums are the logits)")


@dataclass(frozen=True)
class EngineConfig:
    model: str = "tiny"  # a preset name (tiny, qwen3-0.6b, qwen3-4b, qwen3-8b) or a checkpoint directory
    device: str = "auto"  # auto | cpu | cuda
    dtype: str = "auto"  # auto (bf16 on cuda, float32 on cpu) | float32 | bfloat16 | float16
    seed: int = 0
    page_size: int = 0  # 0: 16 on cuda, 4 on cpu
    num_pages: int = 0  # L1 pages; 0: sized from max_total_tokens
    # L1 capacity in tokens when num_pages == 0; 0: on CUDA what gpu_memory_fraction of the GPU's memory
    # leaves after the weights and a reserve (scheduler/memory_plan.py), elsewhere DEFAULT_L1_TOKENS
    max_total_tokens: int = 8192
    gpu_memory_fraction: float = 0.9  # (0, 1]: the share of the GPU's memory weights, L1 and activations take
    max_prefill_tokens: int = 2048  # token budget of one prefill batch (chunked prefill above it)
    max_running_requests: int = 64
    # the queue's admission order: "fcfs" (arrival), "priority" (SamplingParams.priority, then arrival) or "lpm"
    # (SGLang's longest prefix match: the most prompt tokens L1 holds first; scheduler/admission.py)
    scheduling_policy: str = "fcfs"
    # the share of each request's possible output (max_tokens) admission reserves L1 pages for, in [0, 1]: 1, all of
    # it (a running request never runs short and nothing is preempted); below 1 more requests run at once, and one
    # that outgrows L1 preempts the least urgent in decode, whose K/V stays in the prefix cache; "auto" (the
    # default, as SGLang and vLLM overcommit by default; docs/benchmarks.md session 56): a share that adapts as
    # SGLang's new_token_ratio does, falling while nothing is preempted and rising after a preemption to what the
    # running requests used (scheduler/reservations.py `AutoReserveRatio`)
    decode_reserve_ratio: float | str = "auto"
    max_context_tokens: int = 16384  # longest sequence a captured decode graph serves (longer: eager)
    max_prompt_tokens: int = 0  # 0: no limit beyond what the pool and the model's positions can hold
    max_new_tokens_limit: int = 4096
    enable_prefix_cache: bool = True
    # a queued request waits for the pages of the request in prefill computing its prefix rather than
    # computing them beside it (scheduler/admission.py `_computes_prefix_of`); False: each computes its own
    share_prefill: bool = True
    cuda_graphs: bool = True  # CUDA only: small forwards (decode, short tails) replay captured graphs
    # projections of forwards of at most 64 rows on CUDA: "triton" (kernels/skinny_gemm.py, SiLU x up
    # folded into gate_up) or "cublas" (torch.nn.functional.linear + a SiLU kernel)
    small_gemm: str = "triton"
    # CUDA, bf16 / fp16 weights: the LM head's logits are its float32 sums, not rounded to the model's dtype
    # first (scheduler/model.py `logits_of`): faster, and no two logits tie by that rounding
    fp32_lm_head: bool = True
    # vLLM's --speculative-config, method "ngram" (scheduler/speculative.py: prompt lookup, greedy requests);
    # None: off
    speculative: SpeculativeConfig | None = None
    overlap_schedule: bool = True  # decode step N+1 is enqueued before step N's tokens are back
    restore_overlap: bool = True  # an L2 restore lands layer by layer while its tail's forward runs
    # CUDA: how the loop waits for a forward's tokens. "spin": it polls the step's event between
    # its other tasks and stays on the CPU; "block": a worker thread sleeps in the event's
    # synchronize. On the H200's host a thread that slept runs its next ~0.3 ms of work about half
    # as fast (scripts/probe_host.py), and every request's host path follows such a wait.
    gpu_wait: str = "spin"
    cpu_threads: int = 1  # torch intra-op threads on the CPU (tiny shapes run fastest on one)
    # the structured log's file (JSON lines, appended to): structlog is configured for the whole process, so every
    # engine of the process logs to the file the last one built with it named
    log_json: str | None = None
    simulate: bool = False  # no model, no KV bytes: tree, allocators and cost model only
    hicache: HiCacheConfig = field(default_factory=HiCacheConfig)

    def __post_init__(self) -> None:
        self._check_types()
        if self.small_gemm not in ("triton", "cublas"):
            raise ValueError(f"small_gemm must be 'triton' or 'cublas', got {self.small_gemm!r}")
        if self.gpu_wait not in ("spin", "block"):
            raise ValueError(f"gpu_wait must be 'spin' or 'block', got {self.gpu_wait!r}")
        if self.scheduling_policy not in ("fcfs", "priority", "lpm"):
            raise ValueError(f"scheduling_policy must be 'fcfs', 'priority' or 'lpm', got {self.scheduling_policy!r}")
        for name, minimum in ENGINE_MINIMUMS.items():
            _check_at_least(name, getattr(self, name), minimum, FLAGS.get(name))
        for name, maximum in _engine_maximums().items():
            if getattr(self, name) > maximum:
                raise ValueError(f"{_field_name(name, FLAGS.get(name))} must be <= {maximum:,}"
                                 f"{MAXIMUM_REASONS[name]}, got {getattr(self, name)!r}")
        if self.decode_reserve_ratio != "auto" and not 0.0 <= self.decode_reserve_ratio <= 1.0:  # (also NaN)
            raise ValueError("decode_reserve_ratio (--decode-reserve-ratio) must be in [0, 1] or 'auto', "
                             f"got {self.decode_reserve_ratio!r}")
        if not 0.0 < self.gpu_memory_fraction <= 1.0:  # (also NaN)
            raise ValueError("gpu_memory_fraction (--gpu-memory-fraction/--gpu-memory-utilization) must be in (0, 1], "
                             f"got {self.gpu_memory_fraction!r}")
        # (one page; the device's default page too: regression, 3 tokens took a default page of 4, and were refused
        # one given as --page-size 4)
        page_size = self.page_size or self.page_size_on("cuda" if self._on_cuda() else "cpu")
        if (self.num_pages == 0 and page_size > (self.max_total_tokens or DEFAULT_L1_TOKENS)
                and not self.l1_from_gpu_memory()):  # (regression: refused there, L1 not yet sized)
            given = (f"--max-total-tokens {self.max_total_tokens}" if self.max_total_tokens
                     else f"--max-total-tokens 0: {DEFAULT_L1_TOKENS:,} tokens without a GPU to size it from")
            named = "page_size (--page-size)" if self.page_size else "the device's default page size"
            raise ValueError(f"{named} {page_size} is larger than the L1 pool it divides "
                             f"({given}); give a smaller --page-size, or --num-pages")
        if not 0 <= self.seed <= MAX_SEED:
            raise ValueError(f"{_field_name('seed', FLAGS['seed'])} must be in [0, 2**64 - 1], got {self.seed!r}")
        if self.hicache.enable and not self.enable_prefix_cache:  # (L2/L3 sat idle, taking backups)
            raise ValueError("hicache.enable (--enable-hicache) cannot be used with enable_prefix_cache=False "
                             f"(--disable-prefix-cache): {HICACHE_NEEDS_PREFIX_CACHE}")

    def _check_types(self) -> None:
        """What the in-process API may be given that the flags' parser never makes (session 51, regressions: a
        max_prefill_tokens of 1.5 crashed the engine's loop at its first request, a page_size of 4.0 its pools; a
        dtype of "fp16" ran float32 without a word; vLLM's dict form of speculative_config failed inside the
        speculator): a ValueError naming the field, and a mapping given as `speculative` parsed as the flag's."""
        for name in (*ENGINE_MINIMUMS, "seed"):
            value = getattr(self, name)
            if not isinstance(value, numbers.Integral) or isinstance(value, bool):
                raise ValueError(f"{_field_name(name, FLAGS.get(name))} must be an integer, got {value!r}")
            object.__setattr__(self, name, int(value))  # (numpy's integers as Python's)
        if self.dtype not in ("auto", *_DTYPES):
            raise ValueError(f"dtype must be one of 'auto', {', '.join(map(repr, _DTYPES))}, got {self.dtype!r}")
        if not isinstance(self.device, str) or not (self.device in ("auto", "cpu", "cuda")
                                                    or self.device.startswith("cuda:") and self.device[5:].isdigit()):
            raise ValueError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        if not isinstance(self.speculative, (SpeculativeConfig, type(None))):
            object.__setattr__(self, "speculative", SpeculativeConfig.parse(self.speculative))  # (raises, named)
        # (session 52: simulate="false" ran a simulated engine; a gpu_memory_fraction of "0.5", a hicache of None,
        # a model of None failed with errors naming no field)
        for name in _BOOL_FIELDS:
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        for name, words in (("gpu_memory_fraction", "a number"), ("decode_reserve_ratio", "a number or 'auto'")):
            value = getattr(self, name)
            if name == "decode_reserve_ratio" and value == "auto":
                continue
            if not isinstance(value, numbers.Real) or isinstance(value, bool):
                raise ValueError(f"{name} must be {words}, got {value!r}")
        if not isinstance(self.hicache, HiCacheConfig):
            raise ValueError(f"hicache must be a HiCacheConfig (EngineConfig.with_hicache(...)), got {self.hicache!r}")
        for name in ("model", "log_json"):
            if isinstance(getattr(self, name), os.PathLike):  # (a pathlib.Path, as its text)
                object.__setattr__(self, name, os.fspath(getattr(self, name)))
            value = getattr(self, name)
            if not (isinstance(value, str) or value is None and name == "log_json"):
                raise ValueError(f"{name} must be a string, got {value!r}")

    def with_hicache(self, **changes) -> "EngineConfig":
        return replace(self, hicache=replace(self.hicache, **changes))

    def page_size_on(self, device_type: str) -> int:
        """Tokens a page: --page-size, else 16 on CUDA and 4 on the CPU."""
        return self.page_size or (16 if device_type == "cuda" else 4)

    def l1_from_gpu_memory(self) -> bool:
        """Whether the engine sizes L1 from the GPU's memory (scheduler/memory_plan.py plan_pools): no
        --num-pages, --max-total-tokens 0, on CUDA (auto: where there is one), not simulated."""
        return self.num_pages == 0 and self.max_total_tokens == 0 and not self.simulate and self._on_cuda()

    def _on_cuda(self) -> bool:
        """Whether the engine runs on CUDA (auto: where there is one; "cuda:N" too, as resolve_device's type)."""
        return self.device.startswith("cuda") or self.device == "auto" and torch.cuda.is_available()

    def l1_pages(self, page_size: int) -> int:
        """L1 pages: --num-pages, else --max-total-tokens (0: DEFAULT_L1_TOKENS; on CUDA the engine sizes it
        from the GPU's memory instead, scheduler/memory_plan.py) in pages of `page_size`."""
        return self.num_pages or -(-(self.max_total_tokens or DEFAULT_L1_TOKENS) // page_size)


DEFAULT_L1_TOKENS = 8192  # L1 with max_total_tokens 0 where there is no GPU memory to size it from


# The smallest valid value of each numeric EngineConfig field (0 where 0 means "the default"). Below
# them the engine hangs (no prefill budget, no running slot) or crashes building its pools.
ENGINE_MINIMUMS = {"page_size": 0, "num_pages": 0, "max_total_tokens": 0, "max_prefill_tokens": 1,
                   "max_running_requests": 1, "max_context_tokens": 1, "max_prompt_tokens": 0,
                   "max_new_tokens_limit": 1, "cpu_threads": 0}
# The largest valid value of the fields that have one: an L1 of more pages (or tokens: a page holds at
# least one) than page ids can name crashed the pool's allocation; torch crashes (SIGSEGV) given tens of
# thousands of threads, and more threads than CPUs only contend.
MAXIMUM_REASONS = {"num_pages": " (page ids are int32)", "max_total_tokens": " (page ids are int32)",
                   "cpu_threads": " (this machine's CPUs)"}


def _engine_maximums() -> dict[str, int]:
    return {"num_pages": MAX_TIER_PAGES, "max_total_tokens": MAX_TIER_PAGES, "cpu_threads": os.cpu_count() or 1}


# Why hicache needs the prefix cache: without its lookups L2 and L3 take backups that nothing reads
HICACHE_NEEDS_PREFIX_CACHE = "L2 and L3 only serve prefix-cache hits, so without the prefix cache they would sit idle"

# The command-line flag of each field checked here that has one (add_engine_args), its aliases too, as argparse names
# them (regression: --max-num-seqs 0 was refused naming only --max-running-requests, a flag the user never typed)
FLAGS = {"seed": "--seed", "page_size": "--page-size", "num_pages": "--num-pages",
         "max_total_tokens": "--max-total-tokens",
         "max_prefill_tokens": "--max-prefill-tokens/--max-num-batched-tokens/--chunked-prefill-size",
         "max_running_requests": "--max-running-requests/--max-num-seqs", "max_prompt_tokens": "--max-prompt-tokens",
         "cpu_threads": "--cpu-threads"}


def _field_name(name: str, flag: str | None) -> str:
    return f"{name} ({flag})" if flag else name


def _check_at_least(name: str, value: int | float, minimum: int | float, flag: str | None) -> None:
    if not value >= minimum:  # also refuses NaN
        raise ValueError(f"{_field_name(name, flag)} must be >= {minimum}, got {value!r}")


def reserve_ratio(text: str) -> float | str:
    """An argparse type: --decode-reserve-ratio's number in [0, 1], or "auto"."""
    if text == "auto":
        return text
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1] or 'auto', got {text!r}") from None
    if not 0.0 <= value <= 1.0:  # (also NaN)
        raise argparse.ArgumentTypeError(f"expected a number in [0, 1] or 'auto', got {text!r}")
    return value


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("engine")
    g.add_argument("--model", default="tiny", help="preset (tiny, qwen3-0.6b, qwen3-4b, qwen3-8b) or checkpoint dir")
    g.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                   help="auto: cuda when available, else cpu")
    g.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="weights and KV cache (auto: bfloat16 on cuda, float32 on cpu)")
    g.add_argument("--seed", type=int, default=0, help="seed of a preset's random weights, 0 to 2**64 - 1 (default 0)")
    g.add_argument("--page-size", type=int, default=0, help="tokens per page (default 16 on cuda, 4 on cpu)")
    g.add_argument("--num-pages", type=int, default=0, help="L1 pages (default: from --max-total-tokens)")
    g.add_argument("--max-total-tokens", type=int, default=0,
                   help="L1 capacity in tokens, rounded up to whole pages (when --num-pages is 0); 0: on CUDA "
                        "what --gpu-memory-fraction leaves after the weights and activations, on the CPU 8192")
    g.add_argument("--gpu-memory-fraction", "--gpu-memory-utilization", type=float,
                   default=EngineConfig.gpu_memory_fraction,
                   help="share of the GPU's memory the weights, L1 and activations may take, in (0, 1] "
                        "(with --max-total-tokens 0; vLLM's name too)")
    g.add_argument("--max-prefill-tokens", "--max-num-batched-tokens", "--chunked-prefill-size", type=int, default=2048,
                   help="tokens one prefill batch computes; longer prompts are prefilled in chunks, a decode step "
                        "between chunks while requests decode (vLLM's and SGLang's names too)")
    g.add_argument("--max-running-requests", "--max-num-seqs", type=int, default=64,
                   help="requests admitted (prefill or decode) at once (vLLM's name too)")
    g.add_argument("--scheduling-policy", default=EngineConfig.scheduling_policy, choices=["fcfs", "priority", "lpm"],
                   help="the queue's admission order: arrival (fcfs); a request's priority (lower first), then "
                        "arrival; or lpm, the most prompt tokens L1 holds first, then arrival (SGLang's longest "
                        "prefix match; arrival order past 128 queued); a more urgent request preempts none")
    g.add_argument("--decode-reserve-ratio", type=reserve_ratio, default=EngineConfig.decode_reserve_ratio,
                   help="share of each request's max_tokens admission reserves L1 pages for, in [0, 1] (1: all, "
                        "nothing is ever preempted); below 1 more requests run at once, and one that outgrows L1 "
                        "preempts the newest decoding request (the least urgent under --scheduling-policy "
                        "priority), which resumes later from its K/V in the prefix cache (SGLang's retract, vLLM's "
                        "recompute preemption); auto (default): a share that starts at 0.7, falls to 0.1 over 600 "
                        "decode steps without a preemption and, after one, rises to what the running requests used "
                        "(SGLang's adaptive new_token_ratio)")
    g.add_argument("--max-prompt-tokens", type=int, default=0,
                   help="longest prompt in tokens (0: what the L1 pool holds, within the model's positions; "
                        "never above either)")
    g.add_argument("--disable-prefix-cache", action="store_true", help="no prefix reuse, in L1 or below")
    g.add_argument("--disable-shared-prefill", action="store_true",
                   help="requests arriving together with one prefix each compute it (default: one waits for "
                        "the pages of the one computing it)")
    g.add_argument("--disable-cuda-graphs", action="store_true",
                   help="run small forwards eagerly instead of replaying captured CUDA graphs (CUDA only)")
    g.add_argument("--enable-cuda-graphs", action="store_true", help=argparse.SUPPRESS)  # the default; kept
    g.add_argument("--small-gemm", default=EngineConfig.small_gemm, choices=["triton", "cublas"],
                   help="projections of forwards of at most 64 rows (decode, a restore's tail, verify steps) on CUDA")
    g.add_argument("--disable-fp32-lm-head", action="store_true", help=FP32_LM_HEAD_OFF)
    g.add_argument("--speculative-config", default=None, metavar="JSON",
                   help='vLLM\'s speculative decoding config; served: prompt lookup, e.g. \'{"method": "ngram", '
                        '"num_speculative_tokens": 5, "prompt_lookup_max": 4}\' (greedy requests and unseeded '
                        'sampled ones verify up to that many drafts a step, taken from the prefix cache\'s earlier '
                        'answers or from their own tokens; default: off)')
    g.add_argument("--disable-overlap-schedule", action="store_true",
                   help="wait for each decode step's tokens before preparing the next")
    g.add_argument("--disable-restore-overlap", action="store_true",
                   help="finish an L2 restore before the forward over its tail starts (no layer-by-layer overlap)")
    g.add_argument("--gpu-wait", default=EngineConfig.gpu_wait, choices=["spin", "block"],
                   help="CUDA: the loop polls a forward's completion (spin: one core busy, a faster host "
                        "path after it) or a thread sleeps on it (block)")
    g.add_argument("--cpu-threads", type=int, default=1,
                   help="torch threads when running on the CPU, at most its CPUs (0: torch's default)")
    g.add_argument("--log-json", default=None,
                   help="append structured JSON-lines events to this file (a run_start line first; "
                        "its directory is created)")
    h = parser.add_argument_group("hicache")
    h.add_argument("--enable-hicache", action="store_true", help="back L1 with host memory (L2) and storage (L3)")
    h.add_argument("--hicache-ratio", type=float, default=2.0,
                   help="L2 pages = ratio x L1 pages, held to half the memory this process may have "
                        "(scheduler/memory_plan.py; --hicache-size-gb is not)")
    h.add_argument("--hicache-size-gb", type=float, default=None, help="L2 size in GiB (wins over the ratio)")
    h.add_argument("--hicache-storage-path", default=None,
                   help="the L3 file (default: a temporary file, removed at exit); truncated at start (unless "
                        "--hicache-storage-persist) and locked while the engine runs, so each engine needs its own")
    h.add_argument("--hicache-storage-persist", action="store_true",
                   help="keep the L3 file's prefixes across restarts: its index is saved next to it "
                        "(PATH.index) at a clean shutdown and adopted by the next engine on the same path "
                        "and model; needs --hicache-storage-path")
    h.add_argument("--hicache-storage-ratio", type=float, default=2.0,
                   help="L3 pages = ratio x L2 pages (0: no L3); an L3 file is held to half the free space of its "
                        "file system (--hicache-storage-size-gb is not)")
    h.add_argument("--hicache-storage-size-gb", type=float, default=None,
                   help="L3 size in GiB (wins over the ratio; 0: no L3)")
    h.add_argument("--hicache-storage-backend", default="file", choices=["file", "redis"],
                   help="L3 in a local file (--hicache-storage-path) or a redis server (--hicache-storage-url)")
    h.add_argument("--hicache-storage-url", default=None, help="redis://HOST:PORT/DB for the redis backend")
    h.add_argument("--hicache-disable-checksum", action="store_true", help="skip per-page L3 checksums")
    h.add_argument("--hicache-io-workers", type=int, default=4, help="threads doing the L3 file's reads and writes")
    h.add_argument("--hicache-policy", default="cost", choices=["cost", "always", "never"],
                   help="restore a cached prefix from L2/L3 when the cost model says it beats a recompute, "
                        "always, or never")
    h.add_argument("--hicache-write-policy", default="write_through",
                   choices=["write_through", "write_through_selective", "write_back"],
                   help="back up to L2: each new prefix (write_through), a prefix on its second hit "
                        "(write_through_selective), or a prefix as L1 evicts it (write_back)")
    h.add_argument("--hicache-transfer-backend", default="auto", choices=["auto", "triton", "torch"],
                   help="L1 <-> L2 copies")
    h.add_argument("--disable-hicache-prefetch", action="store_true",
                   help="restores block the request instead of running beside other work")
    h.add_argument("--hicache-kernel-restore-max-tokens", type=int, default=HiCacheConfig.kernel_restore_max_tokens,
                   help="layer-ordered L2 restores up to this many tokens use the copy kernel, not the copy engine")
    h.add_argument("--disable-hicache-kernel-calibration", action="store_true",
                   help="keep --hicache-kernel-restore-max-tokens as given (default: lowered at start where a "
                        "restore by the copy kernel times slower than one by the copy engine)")
    h.add_argument("--disable-hicache-whole-first", action="store_true",
                   help="layer-ordered restores move every page in layers (default: a restore by the DMAs, "
                        "longer than --hicache-kernel-restore-max-tokens, that is also longer than its "
                        "forward moves its first pages whole, keeping in layers what the H2D moves "
                        "during the forward)")
    h.add_argument("--hicache-recompute-us-per-token", type=float, default=50.0,
                   help="cost policy: prior of a prefill's cost in µs per token (> 0)")
    h.add_argument("--hicache-host-bandwidth-gib-s", type=float, default=12.0,
                   help="cost policy: prior of the L1 <-> L2 bandwidth in GiB/s (> 0)")
    h.add_argument("--hicache-storage-bandwidth-gib-s", type=float, default=3.0,
                   help="cost policy: prior of the L2 <-> L3 bandwidth in GiB/s (> 0)")
    h.add_argument("--hicache-cost-margin", type=float, default=1.0,
                   help="cost policy: restore when recompute cost > margin x restore cost (> 0)")
    h.add_argument("--disable-hicache-outcomes", action="store_true",
                   help="cost policy: price restores by their transfers only (default: also charge a restore "
                        "what its source's requests took end to end beyond their price, relative to a recompute's)")
    h.add_argument("--hicache-storage-explore-reads", type=int, default=2,
                   help="cost policy: L3 reads to time before the learned storage speed decides (0: the prior)")
    h.add_argument("--hicache-host-explore-transfers", type=int, default=1,
                   help="cost policy: L1<->L2 transfers to time each way before the learned host link decides "
                        "(0: the prior)")
    h.add_argument("--hicache-restore-explore-every", type=int, default=32,
                   help="cost policy: restore one hit after this many in a row were not restored from a tier, "
                        "and write one backup after this many refused for a tier, to re-time it (0: never)")


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    hc = HiCacheConfig(
        enable=args.enable_hicache,
        host_ratio=args.hicache_ratio,
        host_size_gb=args.hicache_size_gb,
        storage_ratio=args.hicache_storage_ratio,
        storage_size_gb=args.hicache_storage_size_gb,
        storage_path=args.hicache_storage_path,
        storage_backend=args.hicache_storage_backend,
        storage_url=args.hicache_storage_url,
        storage_checksum=not args.hicache_disable_checksum,
        storage_persist=args.hicache_storage_persist,
        io_workers=args.hicache_io_workers,
        policy=args.hicache_policy,
        write_policy=args.hicache_write_policy,
        transfer_backend=args.hicache_transfer_backend,
        kernel_restore_max_tokens=args.hicache_kernel_restore_max_tokens,
        kernel_calibration=not args.disable_hicache_kernel_calibration,
        whole_first=not args.disable_hicache_whole_first,
        prefetch=not args.disable_hicache_prefetch,
        recompute_us_per_token=args.hicache_recompute_us_per_token,
        host_bandwidth_gib_s=args.hicache_host_bandwidth_gib_s,
        storage_bandwidth_gib_s=args.hicache_storage_bandwidth_gib_s,
        cost_margin=args.hicache_cost_margin,
        learn_outcomes=not args.disable_hicache_outcomes,
        storage_explore_reads=args.hicache_storage_explore_reads,
        host_explore_transfers=args.hicache_host_explore_transfers,
        restore_explore_every=args.hicache_restore_explore_every,
    )
    return EngineConfig(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        seed=args.seed,
        page_size=args.page_size,
        num_pages=args.num_pages,
        max_total_tokens=args.max_total_tokens,
        gpu_memory_fraction=args.gpu_memory_fraction,
        max_prefill_tokens=args.max_prefill_tokens,
        max_running_requests=args.max_running_requests,
        scheduling_policy=args.scheduling_policy,
        decode_reserve_ratio=args.decode_reserve_ratio,
        max_prompt_tokens=args.max_prompt_tokens,
        enable_prefix_cache=not args.disable_prefix_cache,
        share_prefill=not args.disable_shared_prefill,
        cuda_graphs=not args.disable_cuda_graphs,
        small_gemm=args.small_gemm,
        fp32_lm_head=not args.disable_fp32_lm_head,
        speculative=SpeculativeConfig.parse(getattr(args, "speculative_config", None)),
        overlap_schedule=not args.disable_overlap_schedule,
        restore_overlap=not args.disable_restore_overlap,
        gpu_wait=args.gpu_wait,
        cpu_threads=args.cpu_threads,
        log_json=args.log_json,
        hicache=hc,
    )


_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_BOOL_FIELDS = ("enable_prefix_cache", "share_prefill", "cuda_graphs", "fp32_lm_head", "overlap_schedule",
                "restore_overlap", "simulate")


def resolve_device(config: EngineConfig) -> tuple[torch.device, torch.dtype]:
    """The device (auto: CUDA where there is one) and the dtype (auto: bf16 on CUDA, else float32)."""
    name = config.device
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda requested but CUDA is not available")
    dtype = _DTYPES.get(config.dtype) or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    return device, dtype
