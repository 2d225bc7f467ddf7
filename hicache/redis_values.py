"""The values the Redis L3 store (hicache/storage_redis.py) keeps, one per page.

`HKV2` magic, payload length (u32), xxh3_64 of the value's own key (u64), xxh3_64 of the
payload (u64), then the page's bytes (one page-major L2 page). A read checks all four (the payload's
checksum only when checksums are on; the key's, 8 bytes, always): a value copied under another key
(a tool or a buggy client that moved keys) is another prefix's KV, refused like a corrupt one rather
than restored into the wrong prefix (regression).
"""
from __future__ import annotations

import struct

import xxhash

from hicache.storage import page_checksum

HEADER = struct.Struct("<4sIQQ")  # magic, payload bytes, xxh3_64(key), xxh3_64(payload)
MAGIC = b"HKV2"  # (HKV1 values carried no key; page_keys.KEY_FORMAT v2 keeps them apart)


def key_digest(key: bytes) -> int:
    return xxhash.xxh3_64_intdigest(key)


def pack_value(page: memoryview, key: bytes) -> bytes:
    """One stored value of `key`: header + the page's bytes."""
    return b"".join((HEADER.pack(MAGIC, len(page), key_digest(key), page_checksum(page)), page))


def check_value(value: bytes | None, key: bytes, page_bytes: int, verify: bool) -> str | None:
    """None when `value` is a valid page of `page_bytes` bytes stored under `key`, else why not
    ("missing"/"checksum")."""
    if value is None:
        return "missing"
    if len(value) != HEADER.size + page_bytes:
        return "checksum"
    magic, length, key_hash, digest = HEADER.unpack_from(value)
    if magic != MAGIC or length != page_bytes or key_hash != key_digest(key):
        return "checksum"
    if verify and page_checksum(memoryview(value)[HEADER.size:]) != digest:
        return "checksum"
    return None
