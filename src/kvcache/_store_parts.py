"""The prefix store's chunks of caches other than a plain unified one (docs/store.md, "Which caches").

A chunk has up to three parts, each its own entry in both tiers:

- its **rows**: the attention layers' K/V of its tokens (a UnifiedCache's layers, an ISWACache's
  base cache, a HybridCache's attention part), with the cells' 2-D positions when the cache
  carries the per-cell extension;
- its **end part**: what a query right after the chunk needs beyond the rows: an ISWACache's
  SWA layers' rows of the window before the chunk's end (the cells that query sees; earlier ones
  it never reads), a RecurrentCache's or HybridCache's recurrent state after the chunk (a
  checkpoint of the cache's pool taken there, or the sequence's own state when it ends there);
  a HybridCache with a sliding window has both: the window (part 1) and the state (part 2).

A prefix of k chunks is usable when the rows of chunks 0 .. k-1 are held (none for a recurrent
cache) and, for a cache with end parts, the end parts of chunk k-1. Loads read every part first
(checked), then go through the cache's transactional import (the attention parts) and, for a
recurrent state, a placement of the sequence's state that either takes a cell or changes nothing.
"""
from __future__ import annotations

import contextlib
import os
from typing import Any

import numpy as np
import numpy.typing as npt

from kvcache._core import _Hybrid, _ISWA, _Recurrent, _seq_import_begin, _Unified
from kvcache._store_format import ChunkTiers, StoreError, _KEY, _header_cells, _host_key, _make_import_header

def attn_part(cache: Any, kind: str) -> Any:
    """The cache part whose K/V are a chunk's rows (None for a recurrent cache)."""
    return {"unified": cache, "iswa": getattr(cache, "base", None), "hybrid": getattr(cache, "attn", None),
            "hybrid_iswa": getattr(getattr(cache, "attn", None), "base", None), "recurrent": None}[kind]


def window_part(cache: Any, kind: str) -> Any:
    """The cache part whose rows are a chunk's window (an iSWA pair's SWA cache)."""
    return cache.swa if kind == "iswa" else cache.attn.swa


def recurrent_part(cache: Any, kind: str) -> Any:
    """The cache part whose state is a chunk's state (None for a cache without one)."""
    return cache.recr if kind in ("hybrid", "hybrid_iswa") else cache if kind == "recurrent" else None


def rows_of(part: Any, il: int, cells: npt.NDArray[Any],
            stream: Any = 0) -> tuple[npt.NDArray[np.uint8], npt.NDArray[np.uint8]]:
    """Layer il's K rows and V rows (never transposed) of part's cells, as bytes; stream: the
    cells' stream, one for all or one per cell."""
    each = np.ndim(stream) > 0
    rows = np.asarray(cells, dtype=np.int64) + np.asarray(stream, dtype=np.int64) * int(part.size) \
        if each or stream else cells
    k = np.ascontiguousarray(np.asarray(part.k(il))[rows])
    v = np.asarray(part.v(il))
    if part.v_trans and v.ndim == 3 and each:     # a 2026 cache's transposed V: (streams, width, cells)
        v = np.ascontiguousarray(v[np.asarray(stream, dtype=np.intp), :, cells])
    elif part.v_trans:
        v = v[stream] if v.ndim == 3 else v
        v = np.ascontiguousarray(v[:, cells].T)
    else:
        v = np.ascontiguousarray(v[rows])
    n = len(cells)
    return k.view(np.uint8).reshape(n, -1), v.view(np.uint8).reshape(n, -1)


def _payload(layers: Any, ks: list[npt.NDArray[np.uint8]], vs: list[npt.NDArray[np.uint8]],
             ext: npt.NDArray[Any] | None) -> npt.NDArray[np.uint8]:
    """A part's bytes: per layer the K rows, then per layer the V rows, then the extensions."""
    pieces = [k.reshape(-1) for k in ks] + [v.reshape(-1) for v in vs]
    if ext is not None:
        pieces.append(np.ascontiguousarray(ext, dtype="<i4").view(np.uint8).reshape(-1))
    return np.concatenate(pieces) if pieces else np.empty(0, np.uint8)


def split_payload(layers: Any, payloads: list[npt.NDArray[np.uint8]], rows: int, ext: bool,
                  v_trans: bool) -> tuple[npt.NDArray[np.uint8], npt.NDArray[np.int32] | None]:
    """The bytes of a sequence's state data section (per layer the K rows of every payload in
    order, then per layer the V rows, transposed with v_trans) and the extensions ((n, 3) or
    None) from payloads of ``rows`` rows each, as _payload lays them out."""
    k_rows = [ly[3] for ly in layers]
    v_rows = [ly[4] for ly in layers]
    n = rows * len(payloads)
    out = np.empty(n * (sum(k_rows) + sum(v_rows)), np.uint8)
    k_off, off = [], 0
    for b in k_rows + v_rows:
        k_off.append(off)
        off += b * rows
    at = 0
    for il, kb in enumerate(k_rows):
        dst = out[at:at + n * kb].reshape(len(payloads), rows * kb)
        for i, p in enumerate(payloads):
            dst[i] = p[k_off[il]:k_off[il] + rows * kb]
        at += n * kb
    for il, (ly, vb) in enumerate(zip(layers, v_rows)):
        o = k_off[len(k_rows) + il]
        if v_trans:
            elt = vb // ly[2]
            block = np.concatenate([p[o:o + rows * vb].reshape(rows, ly[2], elt) for p in payloads])
            out[at:at + n * vb].reshape(ly[2], n, elt)[:] = block.transpose(1, 0, 2)
        else:
            dst = out[at:at + n * vb].reshape(len(payloads), rows * vb)
            for i, p in enumerate(payloads):
                dst[i] = p[o:o + rows * vb]
        at += n * vb
    if not ext:
        return out, None
    e = np.concatenate([p[off:off + 12 * rows].view("<i4").reshape(rows, 3) for p in payloads])
    return out, e


def _part_rows(part: Any, layers: Any, cells: npt.NDArray[Any], strms: Any,
               ext: npt.NDArray[Any] | None) -> npt.NDArray[np.uint8]:
    """A part's payload from the cells of a cache part (one stream per cell)."""
    ks, vs = [], []
    for ly in layers:
        k, v = rows_of(part, ly[0], cells, strms)
        ks.append(k)
        vs.append(v)
    return _payload(layers, ks, vs, ext)


# --- presence --------------------------------------------------------------------------------

def has_part(store: ChunkTiers, key: bytes, part: int, skip: set[tuple[bytes, int]] | None = None) -> bool:
    if skip and (key, part) in skip:
        return False
    return _host_key(key, part) in store._host or (store.path is not None and os.path.isfile(store._file(key, part)))

def usable(store: ChunkTiers, keys: list[bytes], skip: set[tuple[bytes, int]] | None = None) -> int:
    """The chunks of the longest usable prefix of keys: rows held for every chunk up to it,
    and the end part of its last one (one look-up per chunk and part)."""
    g = store.geometry
    rows = len(keys)
    if g.rows_bytes:
        for i, key in enumerate(keys):
            if not has_part(store, key, 0, skip):
                rows = i
                break
    if not g.has_end:
        return rows
    for i in range(rows - 1, -1, -1):
        if all(has_part(store, keys[i], p, skip) for p in g.end_parts):
            return i + 1
    return 0

# --- save ------------------------------------------------------------------------------------

def put_part(store: ChunkTiers, key: bytes, parent: bytes, index: int, ctoks: npt.NDArray[np.int32], part: int,
              make: Any) -> None:
    """Keep a chunk's part in both tiers (made by make() only when a tier lacks it)."""
    hkey = _host_key(key, part)
    n_bytes = store.geometry.end_bytes(index, part) if part else store.geometry.rows_bytes
    have_host = hkey in store._host
    disk_on = store.path is not None and store.disk_bytes > 0
    have_disk = disk_on and os.path.isfile(store._file(key, part))
    if have_host:
        store._host.move_to_end(hkey)
    if have_disk:
        with contextlib.suppress(OSError):
            os.utime(store._file(key, part))
    if (have_host or store.host_bytes < max(1, n_bytes)) and (have_disk or not disk_on):
        return
    payload = make()
    if payload is None:
        return
    if not have_host:
        store._host_put(hkey, ctoks, payload)
    if disk_on and not have_disk:
        store._disk_put(key, parent, index, ctoks, payload, part)
    store.stats["chunks_saved"] += 1
    store.stats["bytes_saved"] += payload.nbytes

def save_parts(store: ChunkTiers, cache: Any, seq_id: int, toks: npt.NDArray[np.int32],
                salt: str | bytes | None) -> int:
    g = store.geometry
    c = g.chunk_tokens
    geo = type(g).of(cache, c)
    if geo != g:
        raise StoreError(f"save: cache's geometry ({geo.describe()}) is not the store's ({g.describe()})")
    attn = attn_part(cache, g.kind)
    ext = None
    if attn is not None:
        exp = attn.seq_export(seq_id)
        pos, cell_ext = _header_cells(exp.header)
        n = len(pos)
        order = np.argsort(pos, kind="stable")
        good = pos[order] == np.arange(n, dtype=pos.dtype)
        m = min(int(np.argmin(good)) if not good.all() else n, len(toks))
    else:
        m = len(toks)
    m -= m % c
    if m == 0:
        return 0
    if attn is not None and g.ext and cell_ext is not None:
        ext = cell_ext[order[:m]]
    keys = store.keys(toks[:m], salt, pos_x=None if ext is None else ext[:, 0],
                     pos_y=None if ext is None else ext[:, 1])
    rows: tuple[list[Any], list[Any]] | None = None
    if attn is not None:
        rows = store._split_rows(exp.gather(), n, attn.v_trans, order[:m])
    ends = _EndSource(store, cache, seq_id, toks, salt)
    prev = bytes(_KEY)
    for i, key in enumerate(keys):
        ctoks = toks[i * c:(i + 1) * c].copy()
        if rows is not None and g.rows_bytes:    # an iSWA base cache may hold no layer
            ks, vs = rows
            sl = slice(i * c, (i + 1) * c)
            put_part(store, key, prev, i, ctoks, 0, lambda sl=sl: _payload(
                g.layers, [k[sl] for k in ks], [v[sl] for v in vs], None if ext is None else ext[sl]))
        for part in g.end_parts:
            put_part(store, key, prev, i, ctoks, part, lambda i=i, part=part: ends.end(i, part))
        prev = key
    return usable(store, keys) * c

# --- load ------------------------------------------------------------------------------------

def get_part(store: ChunkTiers, key: bytes, part: int, index: int, toks: npt.NDArray[np.int32],
              hits: list[int]) -> npt.NDArray[np.uint8] | None:
    """A part's bytes from host memory or its file (checked; a bad file is removed)."""
    hkey = _host_key(key, part)
    hit = store._host.get(hkey)
    if hit is not None:
        store._host.move_to_end(hkey)
        hits[0] += 1
        return hit[1]
    if store.path is None:
        return None
    n_bytes = store.geometry.end_bytes(index, part) if part else store.geometry.rows_bytes
    keep = np.empty(n_bytes, np.uint8)
    if not store._read_file(store._file(key, part), key, index, toks, None, keep=keep, part_no=part):
        return None
    hits[1] += 1
    return keep

def load_parts(store: ChunkTiers, cache: Any, seq_id: int, toks: npt.NDArray[np.int32], keys: list[bytes],
                min_tokens: int) -> int:
    g = store.geometry
    c = g.chunk_tokens
    check_parts_target(store, cache, seq_id)
    skip: set[tuple[bytes, int]] = set()
    while True:
        k = usable(store, keys, skip)
        if k == 0 or k * c < min_tokens:
            store.stats["misses"] += 1
            return 0
        hits = [0, 0]
        rows: list[npt.NDArray[np.uint8]] = []
        for i in range(k if g.rows_bytes else 0):
            p = get_part(store, keys[i], 0, i, toks, hits)
            if p is None:
                skip.add((keys[i], 0))
                break
            rows.append(p)
        if len(rows) != (k if g.rows_bytes else 0):
            continue
        ends: dict[int, npt.NDArray[np.uint8]] = {}
        for part in g.end_parts:
            got = get_part(store, keys[k - 1], part, k - 1, toks, hits)
            if got is None:
                skip.add((keys[k - 1], part))
                break
            ends[part] = got
        if len(ends) != len(g.end_parts):
            continue
        import_parts(store, cache, seq_id, k * c, rows, ends)
        store.stats["host_hits"] += hits[0]
        store.stats["disk_hits"] += hits[1]
        store.stats["chunks_loaded"] += k
        store.stats["bytes_loaded"] += sum(p.nbytes for p in rows) + sum(p.nbytes for p in ends.values())
        return k * c

def check_parts_target(store: ChunkTiers, cache: Any, seq_id: int) -> None:
    g = store.geometry
    geo = type(g).of(cache, g.chunk_tokens)
    if geo != g:
        raise StoreError(f"load: cache's geometry ({geo.describe()}) is not the store's ({g.describe()})")
    recr = recurrent_part(cache, g.kind)
    if recr is not None and recr.seq_pos_max(seq_id) >= 0:
        raise ValueError(f"load: seq_id {seq_id} holds a state: a recurrent state loads into an empty sequence")
    if g.kind in ("hybrid", "hybrid_iswa") and cache.attn.seq_pos_max(seq_id) >= 0:
        raise ValueError(f"load: seq_id {seq_id} holds cells: a hybrid prefix loads into an empty sequence")

def import_parts(store: ChunkTiers, cache: Any, seq_id: int, n: int, rows: list[npt.NDArray[np.uint8]],
                 ends: dict[int, npt.NDArray[np.uint8]]) -> None:
    """Bring n tokens' parts into seq_id (ends: the last chunk's end parts by part number):
    every attention part through one transactional import, committed only when the recurrent
    state (if any) has taken its cell."""
    from kvcache.handoff import PartsImport
    g = store.geometry
    imports = []
    try:
        attn = attn_part(cache, g.kind)
        if attn is not None:
            if not g.rows_bytes:      # a base cache of no layer: its cells, no bytes
                rows = [np.empty(0, np.uint8)] * (n // g.chunk_tokens)
            data, ext = split_payload(g.layers, rows, g.chunk_tokens, g.ext, attn.v_trans)
            head = _make_import_header(g.type_k, g.type_v, g.layers, attn.v_trans, np.arange(n), seq_id, ext)
            imports.append((_seq_import_begin(attn, head, seq_id, into_empty=True), data))
        if g.windowed:
            swa = window_part(cache, g.kind)
            w = g.window_start(n)
            data, ext = split_payload(g.swa_layers, [ends[1]], n - w, g.ext, swa.v_trans)
            head = _make_import_header(g.type_k, g.type_v, g.swa_layers, swa.v_trans, np.arange(w, n), seq_id, ext)
            imports.append((_seq_import_begin(swa, head, seq_id, into_empty=True), data))
        for imp, data in imports:
            imp.scatter(data)
        whole = PartsImport([imp for imp, _ in imports])
        for imp, _ in imports:
            imp.check()
        recr = recurrent_part(cache, g.kind)
        if recr is not None:
            recr._store_restore(seq_id, n, ends[g.state_part])
        try:
            whole.commit()
        except BaseException:
            if recr is not None:
                recr.seq_rm(seq_id, -1, -1)
            raise
    except BaseException:
        for imp, _ in imports:
            imp.abort()
        raise


class _EndSource:
    """The end parts a save can take: an iSWA cache's SWA rows of each window still held, a
    recurrent state checkpointed at a chunk's end or the sequence's own state there."""

    def __init__(self, store: ChunkTiers, cache: Any, seq_id: int, toks: npt.NDArray[np.int32],
                 salt: str | bytes | None) -> None:
        self.store, self.cache, self.seq_id, self.toks, self.salt = store, cache, seq_id, toks, salt
        self._pos: dict[int, int] | None = None
        self._own: tuple[int, Any] | None = None

    def end(self, index: int, part: int) -> npt.NDArray[np.uint8] | None:
        g = self.store.geometry
        p = (index + 1) * g.chunk_tokens
        if part != g.state_part:
            return self._window(p)
        recr = recurrent_part(self.cache, g.kind)
        got = _checkpoint_bytes(recr, self.toks[:p], self.salt)
        if got is not None:
            return got
        if self._own is None:
            self._own = recr._store_state(self.seq_id)
        own = self._own[1] if self._own[0] == p else None
        return None if own is None else np.frombuffer(own, np.uint8).copy()

    def _window(self, p: int) -> npt.NDArray[np.uint8] | None:
        g = self.store.geometry
        swa = window_part(self.cache, g.kind)
        if self._pos is None:
            cells, pos = swa.seq_cells(self.seq_id)
            self._pos = {}
            for cell, q in zip(cells.tolist(), pos.tolist()):
                self._pos[q] = -1 if q in self._pos else cell    # a position held twice is not taken
        want = range(g.window_start(p), p)
        cells = [self._pos.get(q, -1) for q in want]
        if any(x < 0 for x in cells):
            return None
        idx = np.asarray(cells, dtype=np.intp)
        ks, vs = [], []
        for ly in g.swa_layers:
            k, v = rows_of(swa, ly[0], idx)
            ks.append(k)
            vs.append(v)
        ext = swa.cells().ext[idx] if g.ext else None
        return _payload(g.swa_layers, ks, vs, ext)


# --- write-back at eviction --------------------------------------------------------------------

def write_back_parts(cache: Any) -> list[tuple[Any, str]]:
    """The parts of a cache whose prefix indexes write back, each with what its evicted prompts
    give: ``"rows"`` (a chunk's rows), ``"window"`` (an iSWA cache's SWA windows: end parts),
    ``"rows+state"`` (a hybrid cache's attention rows, and the recurrent states its checkpoint
    pool still holds at the chunks' ends: end parts; with a sliding window, its iSWA pair's
    base cache's rows and those states, the SWA cache's windows), ``"state"`` (the checkpoints a
    recurrent or hybrid cache's pool evicts at chunk ends: end parts); StoreError saying why for
    another."""
    if isinstance(cache, _ISWA):
        if not hasattr(cache, "prefix_publish"):
            raise StoreError("write_back: an ISWACache of semantics '2025' has no prefix index (prefix reuse is "
                             "today's llama.cpp's: ISWACache2026)")
        return [(cache.base, "rows"), (cache.swa, "window")]
    if isinstance(cache, _Hybrid):
        if isinstance(cache.attn, _ISWA):
            return [(cache.attn.base, "rows+state"), (cache.attn.swa, "window"), (cache.recr, "state")]
        return [(cache.attn, "rows+state"), (cache.recr, "state")]
    if isinstance(cache, _Recurrent):
        if not hasattr(cache, "_spill_set"):
            raise StoreError("write_back: a RecurrentCache of semantics '2025' keeps no checkpoints (prefix reuse is "
                             "today's llama.cpp's: RecurrentCache2026)")
        return [(cache, "state")]
    if isinstance(cache, _Unified):
        if not hasattr(cache, "_spill_set"):
            raise StoreError("write_back: a UnifiedCache of semantics '2025' has no prefix index (prefix reuse is "
                             "today's llama.cpp's: UnifiedCache2026)")
        return [(cache, "rows")]
    raise StoreError(f"write_back: cache must be a UnifiedCache, ISWACache, RecurrentCache or HybridCache, "
                     f"not {type(cache).__name__}")


def write_evicted_parts(store: ChunkTiers, part: Any, role: str, recr: Any, salt: str | bytes | None,
                        toks: npt.NDArray[np.int32], keys: list[bytes], cells: npt.NDArray[np.int32],
                        strms: npt.NDArray[np.int32], ext: npt.NDArray[np.int32] | None) -> None:
    """Write what an evicted prompt's cells (a whole number of chunks) give for each chunk:
    its rows where every cell is real, its end part where the cells (an iSWA window) or the
    checkpoint pool (a hybrid cache's state) still hold it. Ghosts (cells at or past the part's
    size) name no cell: what needs one is not written."""
    g = store.geometry
    c = g.chunk_tokens
    real = cells < int(part.size)
    if not g.ext:
        ext = None
    prev = bytes(_KEY)
    for i, key in enumerate(keys):
        ctoks = toks[i * c:(i + 1) * c].copy()
        a, b = i * c, (i + 1) * c
        if role != "window" and g.rows_bytes and real[a:b].all():
            put_part(store, key, prev, i, ctoks, 0, lambda a=a, b=b: _part_rows(
                part, g.layers, cells[a:b], strms[a:b], None if ext is None else ext[a:b]))
        if role == "window":
            w = g.window_start(b)
            if real[w:b].all():
                put_part(store, key, prev, i, ctoks, 1, lambda w=w, b=b: _part_rows(
                    part, g.swa_layers, cells[w:b], strms[w:b], None if ext is None else ext[w:b]))
        elif role == "rows+state":
            put_part(store, key, prev, i, ctoks, g.state_part, lambda b=b: _checkpoint_bytes(recr, toks[:b], salt))
        prev = key


def _checkpoint_bytes(recr: Any, toks: npt.NDArray[np.int32], salt: str | bytes | None) -> npt.NDArray[np.uint8] | None:
    state = recr._store_checkpoint(toks, salt)
    return None if state is None else np.frombuffer(state, np.uint8).copy()


def write_evicted_state(store: ChunkTiers, salt: str | bytes | None, toks: npt.NDArray[np.int32],
                        state: bytes) -> None:
    """Write a checkpoint a pool evicted, the state after toks (a whole number of chunks), as
    the end part of its last chunk."""
    c = store.geometry.chunk_tokens
    k = len(toks) // c
    if k == 0:
        return
    keys = store.keys(toks, salt)
    put_part(store, keys[-1], keys[-2] if k > 1 else bytes(_KEY), k - 1, toks[-c:].copy(),
             store.geometry.state_part, lambda: np.frombuffer(state, np.uint8).copy())
