"""A file L3 that outlives its process (--hicache-storage-persist): the index of what the file holds, saved
at a clean close and adopted by the next engine opened on the same path.

The L3 file's bytes mean nothing without this process's bookkeeping: which prefix each slot holds (the tree)
and what each slot's page hashed to (FileStore's checksums). `save` writes both next to the file, as
`<path>.index`: an npz of the tree's L3 nodes in breadth-first order (each its parent's index, its tokens
and its slots), the slots' checksums, the nodes' LRU order, and a header naming the KV layout (page_keys.kv_salt:
model identity, dtype, page size, layers, heads), the file's page size and its size. It runs once the operations
drained (CacheManager.close), after an fsync of the file, and lands by a rename (its folder synced): it is whole
or absent.

The header also carries the cost model's windows of samples (CostModel.samples), each direction's reference slope
(the last fit of several sizes: a window of one size prices against it) and the machine they were timed on (host name
and device): the next engine on the same machine learns them again (`learn_costs`), so its first
restore-or-recompute decisions are priced as the last engine's last ones were, not from the priors. On another
machine they are ignored.

`load`, as the next store opens (before anything is written to it), makes those nodes L3-resident (L1 and L2 start
empty), their slots taken from the L3 allocator and their checksums the store's, in their saved LRU order. The index
is deleted as it is read: a process that dies later leaves none, and its successor starts empty rather than trusting
slots rewritten since (one that cannot be deleted is not adopted; an engine that fails to start after adopting it
saves it again, CacheManager.abandon); a run without the flag on the path, which truncates the file, deletes it too
(`discard`). An index of another layout or model, of a file deleted, cut short or replaced since (the size the store
found as it opened is not the saved one), one that is no regular file, cannot be read or does not add up, is ignored
with a warning (the engine starts with an empty L3); nodes whose slots lie past a smaller file are dropped, with
everything below them. Every page is still verified by its checksum when read, so a file changed between runs costs
a recompute (hicache/restores.py), never a wrong answer; persistence therefore needs checksums (HiCacheConfig). The
checksums are bound to their pages' prefix keys (storage.bound_checksums), so an index whose tree was edited (a node
re-parented) adopts pages that fail their first read under the prefix they were not computed for.
"""
from __future__ import annotations

import json
import os
import socket
import stat
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import structlog
import torch

from hicache.page_keys import kv_salt
from hicache.radix import Node, Tier

if TYPE_CHECKING:
    from hicache.manager import CacheManager

log = structlog.get_logger("hicache.l3_index")

# v2: its checksums are bound to their pages' prefix keys (storage.bound_checksums); a v1 index's are not, and
# is ignored with a warning
INDEX_FORMAT = "hicache-l3-index-v2"
_ARRAYS = ("parents", "key_tokens", "tokens", "slots", "checksums", "lru_ranks")


def index_path(store_path: str) -> str:
    return store_path + ".index"


class Adopted(NamedTuple):
    """What `load` took from an index: the L3 pages, and the cost samples timed on this machine (or None)."""
    pages: int
    cost_samples: dict | None
    cost_references: dict | None = None  # (CostModel.reference_slopes; an index saved before them has none)


def _machine(mgr: "CacheManager") -> dict:
    """Where the cost samples were timed: this host and its L1 device."""
    device = mgr.l1.device
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
    return {"host": socket.gethostname(), "device": name}


def _header(mgr: "CacheManager") -> dict:
    return {"format": INDEX_FORMAT, "kv_layout": kv_salt(mgr.config.model_id, mgr.geometry).decode(),
            "bytes_per_page": mgr.store.bytes_per_page}


def _l3_nodes(mgr: "CacheManager") -> list[Node]:
    """The tree's L3-resident nodes, breadth first (a node after its parent: residency is contiguous from
    the root)."""
    nodes, frontier = [], [mgr.tree.root]
    while frontier:
        frontier = [c for n in frontier for c in n.children.values() if c.pages[Tier.L3] is not None]
        nodes += frontier
    return nodes


def save(mgr: "CacheManager") -> int:
    """Write the index of what the L3 file holds (call once nothing moves: after the drain); returns the pages
    it lists. A failure to write it is a warning: the next engine starts with an empty L3."""
    store = mgr.store
    nodes = _l3_nodes(mgr)
    at = {node: i for i, node in enumerate(nodes)}
    slots = [s for node in nodes for s in node.pages[Tier.L3]]
    order = sorted(range(len(nodes)), key=lambda i: nodes[i].stamp[Tier.L3])
    ranks = np.empty(len(nodes), dtype=np.int64)
    ranks[order] = np.arange(len(nodes))
    arrays = {
        "parents": np.array([at.get(node.parent, -1) for node in nodes], dtype=np.int64),
        "key_tokens": np.array([len(node.key) for node in nodes], dtype=np.int64),
        "tokens": np.array([t for node in nodes for t in node.key], dtype=np.int64),
        "slots": np.array(slots, dtype=np.int64),
        "checksums": store.checksums_of(slots),
        "lru_ranks": ranks,
    }
    path, tmp = index_path(store.path), index_path(store.path) + ".tmp"
    try:
        store.sync()
        # (not through a link another user left: the L3 file's own rule, hicache/storage_file.py)
        # (a new file: whatever lies at the name goes first, a FIFO's open blocked the shutdown for good)
        _unlink_quietly(tmp)
        with os.fdopen(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600),
                       "wb") as f:
            header = {**_header(mgr), "file_bytes": store.size_bytes, "machine": _machine(mgr),
                      "cost_samples": mgr.cost.samples(), "cost_references": mgr.cost.reference_slopes()}
            np.savez(f, header=np.array(json.dumps(header)), **arrays)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        _sync_dir(path)
    except OSError as exc:
        log.warning("l3_index_not_saved", path=path, error=exc.strerror or str(exc))
        _unlink_quietly(tmp)
        return 0
    except BaseException:  # (regression: anything else, a bug, left the half-written temporary index on the disk)
        _unlink_quietly(tmp)
        raise
    log.info("l3_index_saved", path=path, nodes=len(nodes), pages=len(slots))
    return len(slots)


def discard(store_path: str) -> None:
    """The file at `store_path` was opened without --hicache-storage-persist, truncated: an index a run with
    the flag left next to it describes bytes gone, and goes (a later run with the flag starts empty), as does what
    a save a crash cut short left."""
    _unlink_quietly(index_path(store_path) + ".tmp")
    if os.path.lexists(index_path(store_path)):
        log.warning("l3_index_ignored", path=index_path(store_path),
                    reason="the L3 file was opened without --hicache-storage-persist (truncated)")
        _unlink_quietly(index_path(store_path))


def _sync_dir(path: str) -> None:
    """fsync the folder holding `path`, so that a rename or an unlink there outlives a power loss (regression: the
    saved index could be lost after its rename, and the index deleted as it was read come back). Best effort: a
    file system that cannot sync a folder (some network ones) keeps the index's rules as they were."""
    try:
        fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _unlink_quietly(path: str) -> OSError | None:
    """Unlink `path`; the error where that failed (None: it went, or was not there)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        return exc
    return None


def _read(path: str) -> tuple[dict, dict] | None:
    """The index's header and arrays, the file deleted as it is read; None where there is none, or where it
    cannot be deleted (what it says would outlive this process's changes to the file)."""
    try:
        # (O_NONBLOCK: a FIFO's open blocked the start for good; not a regular file: ignored)
        with os.fdopen(os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK), "rb") as f:
            if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                raise ValueError("not a regular file")
            with np.load(f, allow_pickle=False) as data:
                header = json.loads(str(data["header"]))
                if not isinstance(header, dict):  # (regression: a list's or a string's .get raised, the start failed)
                    raise ValueError(f"its header is a JSON {type(header).__name__}, not an object")
                arrays = {name: data[name] for name in _ARRAYS}
    except FileNotFoundError:
        return None
    except Exception as exc:  # every way a damaged file fails to read (regression: a flipped bit of the zip's
        # directory raised RuntimeError "encrypted" and every later start failed, the index kept)
        log.warning("l3_index_ignored", path=path, reason=f"unreadable: {type(exc).__name__}: {exc}")
        _unlink_quietly(path)
        return None
    if (err := _unlink_quietly(path)) is None:
        _sync_dir(path)  # (its deletion made durable before the file is written: else it could come back)
    else:  # (regression: adopted anyway, and again by the next start)
        log.warning("l3_index_ignored", path=path, reason=f"cannot be deleted as it is read: {err.strerror or err}")
        return None
    return header, arrays


def _problem(mgr: "CacheManager", header: dict, a: dict) -> str | None:
    """Why the index cannot be adopted (None: it can)."""
    want = _header(mgr)
    for key in ("format", "kv_layout", "bytes_per_page"):
        if header.get(key) != want[key]:
            return f"{key} {header.get(key)!r} is not this engine's {want[key]!r}"
    found = getattr(mgr.store, "found_bytes", None)
    if found is None or header.get("file_bytes") != found:  # (None: no file was there; regression: an index naming
        # no size, None too, was adopted against the new empty file)
        return (f"the L3 file was {header.get('file_bytes')} bytes at its save and {found} as this engine opened "
                f"it (deleted, cut short or replaced since)")
    n, page = len(a["parents"]), mgr.page_size
    if any(a[name].ndim != 1 or a[name].dtype.kind not in "iu" for name in _ARRAYS):
        return "its arrays are not lists of integers"
    if len(a["key_tokens"]) != n or len(a["lru_ranks"]) != n:
        return "its arrays do not add up"
    if a["key_tokens"].sum() != len(a["tokens"]) or (a["key_tokens"] <= 0).any() or (a["key_tokens"] % page).any():
        return "its node lengths do not add up"
    if len(a["slots"]) != len(a["tokens"]) // page or len(a["checksums"]) != len(a["slots"]):
        return "its slots do not add up"
    if ((a["parents"] < -1) | (a["parents"] >= np.arange(n))).any():
        return "a node comes before its parent"
    if len(np.unique(a["slots"])) != len(a["slots"]) or (a["slots"] < 0).any():
        return "a slot is listed twice or negative"
    return None


def load(mgr: "CacheManager") -> Adopted:
    """Adopt the index of the store's file, if one is there and fits (see the module doc); returns the pages
    adopted, and its cost samples where they were timed on this machine."""
    store, tree = mgr.store, mgr.tree
    path = index_path(store.path)
    _unlink_quietly(path + ".tmp")  # (a save a crash cut short: tens of MiB left beside the file; ours, it is locked)
    read = _read(path)
    if read is None:
        return Adopted(0, None)
    header, a = read
    problem = _problem(mgr, header, a)
    if problem is not None:
        log.warning("l3_index_ignored", path=path, reason=problem)
        return Adopted(0, None)
    here = header.get("machine") == _machine(mgr)
    samples, references = (header.get("cost_samples"), header.get("cost_references")) if here else (None, None)
    alloc = tree.allocators[Tier.L3]
    slot_ends = np.cumsum(a["key_tokens"] // mgr.page_size)
    kept: list[tuple[int, tuple[int, ...], int, int, int]] = []  # (index, path, its start, slot range)
    paths: list[tuple[int, ...] | None] = []
    token_lo = 0
    for i, parent in enumerate(a["parents"].tolist()):
        token_hi, slot_hi = token_lo + int(a["key_tokens"][i]), int(slot_ends[i])
        slot_lo = slot_hi - int(a["key_tokens"][i]) // mgr.page_size
        head = () if parent < 0 else paths[parent]
        fits = head is not None and bool((a["slots"][slot_lo:slot_hi] < alloc.num_pages).all())
        paths.append(head + tuple(a["tokens"][token_lo:token_hi].tolist()) if fits else None)
        if fits:  # (one past a smaller file's end: dropped, with everything below it)
            kept.append((i, paths[i], len(head), slot_lo, slot_hi))
        token_lo = token_hi
    claim = alloc.new_claim("l3_index")
    alloc.take([s for *_, lo, hi in kept for s in a["slots"][lo:hi].tolist()], claim)
    adopted: list[tuple[int, Node]] = []
    try:
        for i, node_path, start, lo, hi in kept:
            slots = a["slots"][lo:hi].tolist()
            try:
                extra = set(tree.insert(node_path, Tier.L3, slots, claim, start_tokens=start))
            except ValueError as exc:  # (a path the checks let through that the tree refuses: stop here)
                log.warning("l3_index_partly_adopted", path=path, reason=str(exc))
                break
            store.adopt([s for s in slots if s not in extra],
                        [c for s, c in zip(slots, a["checksums"][lo:hi]) if s not in extra])
            m = tree.match(node_path, touch=False, split=False)
            if m.lengths[Tier.L3] == len(node_path) and m.handles[Tier.L3] is not None:
                adopted.append((int(a["lru_ranks"][i]), m.handles[Tier.L3]))
    finally:
        alloc.free(alloc.pages_of(claim), claim)  # (none left where every node went in)
        alloc.close_claim(claim)
    tree.restamp(Tier.L3, [node for _, node in sorted(adopted, key=lambda x: x[0])])
    pages = tree.num_resident_pages[Tier.L3]
    log.info("l3_index_adopted", path=path, nodes=len(adopted), pages=pages, dropped_nodes=len(paths) - len(kept))
    return Adopted(pages, samples if isinstance(samples, dict) else None,
                   references if isinstance(references, dict) else None)


def learn_costs(mgr: "CacheManager", samples: dict, references: dict | None = None) -> None:
    """The cost model learns an adopted index's samples, against its reference slopes (`load`); malformed ones are a
    warning, nothing learned."""
    try:
        learned = mgr.cost.learn_again(samples, references)
    except ValueError as exc:
        log.warning("l3_index_costs_ignored", reason=str(exc))
        return
    log.info("l3_index_costs_learned", samples=learned)
