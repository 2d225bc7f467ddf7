"""Content-addressed page keys for a shared L3 (DESIGN.md section 12).

A page's key is a chained hash of the token prefix up to and including that page:

    h_0 = blake2b-256(salt)
    h_i = blake2b-256(h_{i-1} || int64-LE tokens of page i)          (i = 1, 2, ...)

so key i depends on every earlier token, and two instances that computed the same prefix with the
same model produce the same keys. The salt holds everything that changes the KV bytes of a page:
model identity (weights), dtype, page size, KV geometry (layers, kv heads, head dim) and the
rank/shard of a sharded model, plus a format version. Without it two models (or two page sizes)
would read each other's pages and return wrong outputs.

`PageKeyer` caches the chains of recent token sequences: the hint refresh, the restore and the
backup of one request all ask for keys of the same prompt (or a prefix / extension of it).

`publish_l3_hints` turns a store's answer "the first n pages of this prompt exist" into L3 residency
hints in the tree; it is the backend-independent half of a content-addressed store's refresh_hints.
"""
from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Sequence

from typing import TYPE_CHECKING

from hicache.geometry import KVGeometry
from hicache.radix import Tier

if TYPE_CHECKING:
    from hicache.manager import CacheManager

KEY_FORMAT = "hicache-kv-v2"  # v2: Redis values carry their key's digest (redis_values.MAGIC)
DIGEST_BYTES = 32
_TOKEN_BYTES = 8  # tokens are hashed as little-endian int64


def kv_salt(model_id: str, geometry: KVGeometry, *, rank: int = 0, world_size: int = 1,
            extra: str = "") -> bytes:
    """The salt of every key of one model's KV pages: equal salts <=> interchangeable pages."""
    dtype = str(geometry.dtype).removeprefix("torch.")
    parts = [KEY_FORMAT, f"model={model_id}", f"dtype={dtype}", f"page_size={geometry.page_size}",
             f"layers={geometry.num_layers}", f"kv_heads={geometry.num_kv_heads}",
             f"head_dim={geometry.head_dim}", f"rank={rank}", f"world_size={world_size}"]
    if extra:
        parts.append(f"extra={extra}")
    return "|".join(parts).encode()


def _token_bytes(tokens: Sequence[int], num_tokens: int) -> bytes:
    data = array("q", tokens[:num_tokens])  # "q" is a signed 64-bit integer
    if sys.byteorder != "little":
        data.byteswap()
    return data.tobytes()


def _check_range(num_tokens: int, start_tokens: int, end_tokens: int, page_size: int) -> None:
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    if start_tokens % page_size or end_tokens % page_size:
        raise ValueError(f"key range [{start_tokens}, {end_tokens}) is not aligned to pages of {page_size}")
    if not 0 <= start_tokens <= end_tokens <= num_tokens:
        raise ValueError(f"key range [{start_tokens}, {end_tokens}) outside the {num_tokens} tokens given")


def _extend_chain(chain: list[bytes], data: bytes, first_page: int, end_page: int, page_bytes: int) -> None:
    """Append keys of pages [first_page, end_page) to `chain` (which holds keys of the pages before,
    chain[0] being h_0)."""
    prev = chain[-1]
    for p in range(first_page, end_page):
        h = hashlib.blake2b(prev, digest_size=DIGEST_BYTES)
        h.update(data[p * page_bytes:(p + 1) * page_bytes])
        prev = h.digest()
        chain.append(prev)


def page_keys(salt: bytes, tokens: Sequence[int], start_tokens: int, end_tokens: int,
              page_size: int) -> list[bytes]:
    """Keys (32-byte digests) of the pages covering tokens[start_tokens:end_tokens] (page aligned);
    the chain is computed from token 0, so each key depends on the whole prefix."""
    _check_range(len(tokens), start_tokens, end_tokens, page_size)
    data = _token_bytes(tokens, end_tokens)
    chain = [hashlib.blake2b(salt, digest_size=DIGEST_BYTES).digest()]
    _extend_chain(chain, data, 0, end_tokens // page_size, page_size * _TOKEN_BYTES)
    return chain[1 + start_tokens // page_size:]


class PageKeyer:
    """page_keys() for one salt and page size, with a small cache of recent chains: a request for a
    prefix of (or an extension of) a cached token sequence reuses its chain."""

    def __init__(self, salt: bytes, page_size: int, cache_entries: int = 16) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.salt, self.page_size, self.cache_entries = salt, page_size, max(0, cache_entries)
        self._root = hashlib.blake2b(salt, digest_size=DIGEST_BYTES).digest()
        self._cache: list[tuple[bytes, list[bytes]]] = []  # (token bytes of whole pages, [h_0, h_1, ...])
        self.hits = self.misses = 0

    def keys(self, tokens: Sequence[int], start_tokens: int, end_tokens: int) -> list[bytes]:
        ps = self.page_size
        _check_range(len(tokens), start_tokens, end_tokens, ps)
        if end_tokens == start_tokens:
            return []
        data = _token_bytes(tokens, end_tokens)
        first, last = 1 + start_tokens // ps, 1 + end_tokens // ps
        best: tuple[bytes, list[bytes]] | None = None
        for i, (cached, chain) in enumerate(self._cache):
            if len(cached) >= len(data) and cached.startswith(data):
                self._cache.append(self._cache.pop(i))  # most recently used last
                self.hits += 1
                return chain[first:last]
            if len(data) > len(cached) and (best is None or len(cached) > len(best[0])) and data.startswith(cached):
                best = (cached, chain)
        self.misses += 1
        chain = list(best[1]) if best is not None else [self._root]
        _extend_chain(chain, data, len(chain) - 1, end_tokens // ps, ps * _TOKEN_BYTES)
        if best is not None:
            self._cache = [e for e in self._cache if e[0] is not best[0]]  # the extension supersedes it
        if self.cache_entries:
            self._cache.append((data, chain))
            del self._cache[:-self.cache_entries]
        return chain[first:last]


def publish_l3_hints(mgr: "CacheManager", tokens: Sequence[int], present_tokens: int) -> tuple[int, int]:
    """The shared store holds tokens[:present_tokens] (page aligned, contiguous from the first page):
    drop the tree's L3 hints from the first vanished page on, and publish local L3 slots for the
    pages beyond the tree's current L3 match. Synchronous, so the tree cannot change under it.
    Returns (pages published, stale pages dropped)."""
    ps, tree = mgr.page_size, mgr.tree
    tokens = tuple(tokens[: len(tokens) - len(tokens) % ps])
    if present_tokens % ps or not 0 <= present_tokens <= len(tokens):
        raise ValueError(f"present_tokens {present_tokens} is not a page-aligned length of the {len(tokens)} tokens")
    dropped = 0
    m = tree.match(tokens, include_storage=True, touch=False)
    if m.lengths[Tier.L3] > present_tokens:  # hints from the first vanished page on are stale
        above = tree.match(tokens[:present_tokens], include_storage=True, touch=False)  # splits there
        parent = above.path[-1] if above.path else tree.root
        node = parent.children.get(tokens[present_tokens:present_tokens + ps])
        try:
            dropped = len(tree.drop(node, Tier.L3)) if node is not None else 0
        except ValueError:
            pass  # a reader holds it: that read fails and drops the hint itself
        m = tree.match(tokens, include_storage=True, touch=False)
    l3_len, handle = m.lengths[Tier.L3], m.handles[Tier.L3]
    if present_tokens <= l3_len:
        return 0, dropped
    published = 0
    claim = mgr.new_claim("l3-hints", Tier.L3)
    mgr.lock(handle, Tier.L3)  # the prefix the new hints hang from must survive the allocation
    try:
        avail = mgr.allocator(Tier.L3).num_free + tree.evictable_pages(Tier.L3)
        num_pages = min((present_tokens - l3_len) // ps, avail)
        slots = mgr.alloc_pages(Tier.L3, num_pages, claim) if num_pages > 0 else None
        if slots is not None:
            dups = tree.insert(tokens[:l3_len + num_pages * ps], Tier.L3, slots, claim, start_tokens=l3_len)
            published = num_pages - len(dups)
    finally:
        mgr.unlock(handle, Tier.L3)
        mgr.release_claim(claim, Tier.L3)  # frees duplicates (everything when nothing was published)
    return published, dropped
