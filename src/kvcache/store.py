"""A bounded store of prefixes' K/V in host memory and on disk (docs/store.md).

A prompt is cut into chunks of ``chunk_tokens`` tokens; chunk i is named by a chain of hashes
(BLAKE2b, 16 bytes): the hash of chunk i-1's name and chunk i's token ids, the first one's of a
namespace made of the model geometry (K/V types, per-layer row widths and bytes, the chunk size)
and an optional salt. Two prompts share a chunk exactly when they share every token up to its end,
under the same geometry and salt; finding how much of a prompt the store holds costs one hash per
chunk of the prompt and one look-up per chunk, whatever the store holds.

A chunk holds the K and V rows of its tokens in every layer, rows in token order (V never
transposed): per layer the K rows, then per layer the V rows. Two tiers hold chunks:

- host memory, bounded in bytes, least recently used first out;
- a directory, bounded in bytes, that survives restarts and is shared by processes: one file per
  chunk, written to a temporary file, flushed to disk and renamed (a reader sees a whole file or
  none), with a header (magic ``KVCS``, version, geometry digest, names, token ids) and a
  checksum of every byte (:class:`kvcache._core.ChunkSum`); a file that is truncated, corrupt or
  of another geometry is a miss and is removed. The directory's ``kvcache-store.json`` names its
  geometry: a store of another geometry refuses the directory.

:meth:`PrefixStore.save` copies the leading positions of a sequence of a :class:`kvcache.UnifiedCache`
into chunks; :meth:`PrefixStore.load` brings the longest stored prefix of a prompt back into a
sequence through the cache's transactional import (``seq_import_begin``): the cells are reserved,
the rows copied from the chunks (from disk through a small buffer, checked as they pass), and the
sequence appears on commit; a failed or corrupt load leaves every cell, sequence and prefix of the
cache as it was.
"""
from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import os
import stat
import struct
import time
import warnings
import weakref
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Iterator, Sequence

import numpy as np
import numpy.typing as npt

from kvcache._atomic import atomic_write, open_regular
from kvcache._core import _STREAM_BYTES, ChunkSum, _copy_pairs, _salt_hash, _seq_import_begin, _Unified, seq_arg
from kvcache import _store_parts as _parts
from kvcache._store_format import (CHUNK_MAGIC, CHUNK_VERSION, CHUNK_VERSIONS, META_NAME, _FIXED, _KEY, _PART_EXT,
                                   _STEP, _SUM, ChunkInfo, StoreError, StoreGeometry, _header_cells, _host_key,
                                   _make_import_header, _Path, _salt_bytes, _tokens_array)
from kvcache._store_parts import rows_of, split_payload
from kvcache.relocate import SeqRange, check_target, set_range
from kvcache.handoff import pair_regions


def _check_chunk_tokens(n: Any) -> None:
    # a chunk names its tokens in its header (32-bit sizes): 2^24 tokens of int32 ids at most
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n < 1 << 24:
        raise ValueError(f"chunk_tokens must be an int in [1, {1 << 24}), not {n!r}")


def _check_bytes(name: str, v: Any) -> None:
    """A size in bytes (a cap): an int >= 0."""
    if not isinstance(v, int) or isinstance(v, bool) or v < 0:
        raise ValueError(f"{name} must be an int >= 0, not {v!r}")


if TYPE_CHECKING:
    from kvcache._core import RopeParams
    from kvcache.unified import UnifiedCache

__all__ = ["PrefixStore", "StoreGeometry", "StoreError", "ChunkInfo", "META_NAME", "CHUNK_MAGIC", "CHUNK_VERSION",
           "CHUNK_VERSIONS",
           "open_store", "read_meta", "read_stats"]


def _addr(a: npt.NDArray[Any]) -> int:
    return int(a.ctypes.data)


class PrefixStore:
    """Chunks of prefixes' K/V in host memory and, with ``path``, in a directory.

    geometry: a :class:`StoreGeometry` (``StoreGeometry.of(cache, chunk_tokens)``) or a cache to
    read it from (then ``chunk_tokens``, default 256). path: a directory (made if missing) shared
    by every process that opens it with the same geometry; None for host memory only.
    host_bytes / disk_bytes: the caps of the two tiers (0: that tier is off; the disk cap is
    enforced by removing the least recently used files when a write passes it, counted with
    every process writing to the directory). promote: a chunk read from disk is also kept in
    host memory (when the host tier is on).

    Counters (``stats``): matched and missed chunks per tier, chunks and bytes written and loaded,
    disk errors (a full disk: the chunk stays in host memory and the write is counted here,
    ``last_error`` says why)."""

    def __init__(self, geometry: StoreGeometry | UnifiedCache, path: _Path | None = None, *,
                 chunk_tokens: int = 256, host_bytes: int = 1 << 30, disk_bytes: int = 8 << 30,
                 promote: bool = True) -> None:
        if not isinstance(geometry, StoreGeometry):
            _check_chunk_tokens(chunk_tokens)
            geometry = StoreGeometry.of(geometry, chunk_tokens)
        _check_chunk_tokens(geometry.chunk_tokens)
        _check_bytes("host_bytes", host_bytes)
        _check_bytes("disk_bytes", disk_bytes)
        if not isinstance(promote, bool):
            raise TypeError(f"promote must be a bool, not {type(promote).__name__}")
        if path is not None and not os.fspath(path):
            raise ValueError("path must name a directory (None: a store in host memory only), not ''")
        self.geometry = geometry
        self.host_bytes = host_bytes
        self.disk_bytes = disk_bytes
        self.promote = promote
        self._gdigest = geometry.digest()
        self._host: OrderedDict[bytes, tuple[npt.NDArray[np.int32], npt.NDArray[np.uint8]]] = OrderedDict()
        self._host_used = 0
        self.stats: dict[str, int] = dict.fromkeys(
            ("host_hits", "disk_hits", "misses", "chunks_saved", "bytes_saved", "files_written", "chunks_loaded",
             "bytes_loaded", "corrupt_removed", "disk_errors", "host_evicted", "disk_evicted", "evicted_saved",
             "evicted_skipped", "write_back_errors"), 0)
        self._salts: dict[int, str | bytes | None] = {0: None}   # the salts seen, by the index's hash
        self.last_error: str | None = None
        self.path: str | None = None
        self._header_bytes = -(-(_FIXED + 4 * geometry.chunk_tokens) // 32) * 32
        self._flushed: dict[str, int] = {}
        if path is not None:
            self.path = os.fspath(path)
            self._open_dir()
            weakref.finalize(self, _flush, self.path, self.stats, self._flushed)

    # --- the directory ---------------------------------------------------------------------

    def _open_dir(self) -> None:
        assert self.path is not None
        os.makedirs(os.path.join(self.path, "chunks"), exist_ok=True)
        meta = os.path.join(self.path, META_NAME)
        mine = {"format": "kvcache-store", "version": self.geometry.version, "geometry_digest": self._gdigest.hex(),
                "geometry": self.geometry.to_json()}
        if not os.path.exists(meta):
            with contextlib.suppress(OSError):
                with atomic_write(meta, "w", encoding="utf-8") as f:
                    json.dump(mine, f, indent=1)
        theirs = read_meta(self.path)
        if theirs.get("geometry_digest") != mine["geometry_digest"]:
            other = "unknown"
            if "geometry" in theirs:
                g = meta_geometry(self.path, theirs)
                if g.digest().hex() != theirs.get("geometry_digest"):
                    raise StoreError(f"path {self.path!r}: {META_NAME} is damaged: its geometry_digest is not the "
                                     f"digest of the geometry it names ({g.describe()})")
                other = g.describe()
            raise StoreError(f"path {self.path!r} is a store of another geometry ({other}); this cache's is "
                             f"{self.geometry.describe()}: use another directory")

    def _file(self, key: bytes, part: int = 0) -> str:
        """The file of a chunk's rows (part 0, ``.kvc``) or end part (1, ``.kve``; a windowed
        hybrid's state: 2, ``.kvs``)."""
        assert self.path is not None
        h = key.hex()
        return os.path.join(self.path, "chunks", h[:2], h + _PART_EXT[part])

    # --- names -------------------------------------------------------------------------------

    def keys(self, tokens: Any, salt: str | bytes | None = None, *, pos_x: Any = None,
             pos_y: Any = None) -> list[bytes]:
        """The names of the whole chunks of tokens, in order (one hash per chunk). pos_x, pos_y:
        for a cache whose cells carry 2-D positions, the tokens' (None: zeros), which name the
        chunks with the tokens."""
        toks = _tokens_array(tokens)
        c = self.geometry.chunk_tokens
        data = toks
        if self.geometry.ext:
            xy = [np.zeros(len(toks), "<i4") if a is None else _tokens_array(a) for a in (pos_x, pos_y)]
            for name, a in zip(("pos_x", "pos_y"), xy):
                if len(a) < len(toks):
                    raise ValueError(f"{name} holds {len(a)} positions for {len(toks)} tokens")
            data = np.stack([toks, xy[0][:len(toks)], xy[1][:len(toks)]], axis=1)
        elif pos_x is not None or pos_y is not None:
            raise ValueError("pos_x, pos_y: the store's cache does not carry 2-D positions (cell_ext)")
        prev = hashlib.blake2b(self._gdigest + _salt_bytes(salt), digest_size=_KEY, person=b"kvcache-salt").digest()
        out = []
        for i in range(len(toks) // c):
            prev = hashlib.blake2b(prev + data[i * c:(i + 1) * c].tobytes(), digest_size=_KEY).digest()
            out.append(prev)
        return out

    def match(self, tokens: Any, salt: str | bytes | None = None, *, pos_x: Any = None, pos_y: Any = None) -> int:
        """How many leading tokens of tokens the store holds (a multiple of chunk_tokens): the
        chunks in host memory or on disk, in order, up to the first missing one (with end parts:
        the longest such run whose last chunk has its end part)."""
        if self.geometry.version != 1:
            keys = self.keys(tokens, salt, pos_x=pos_x, pos_y=pos_y)
            return _parts.usable(self, keys) * self.geometry.chunk_tokens
        n = 0
        for key in self.keys(tokens, salt):
            if key not in self._host and not (self.path and os.path.isfile(self._file(key))):
                break
            n += 1
        return n * self.geometry.chunk_tokens

    # --- host tier -----------------------------------------------------------------------------

    def _host_put(self, key: bytes, toks: npt.NDArray[np.int32], payload: npt.NDArray[np.uint8]) -> None:
        if self.host_bytes < payload.nbytes:
            return
        old = self._host.pop(key, None)
        if old is not None:
            self._host_used -= old[1].nbytes
        self._host[key] = (toks, payload)
        self._host_used += payload.nbytes
        while self._host_used > self.host_bytes:
            _, (_, p) = self._host.popitem(last=False)
            self._host_used -= p.nbytes
            self.stats["host_evicted"] += 1

    @property
    def host_used(self) -> int:
        """Bytes of K/V in host memory."""
        return self._host_used

    # --- disk tier -----------------------------------------------------------------------------

    def _chunk_header(self, key: bytes, parent: bytes, index: int, toks: npt.NDArray[np.int32], part: int = 0,
                      n_bytes: int | None = None) -> bytes:
        g = self.geometry
        n_bytes = g.chunk_bytes if n_bytes is None else n_bytes
        head = CHUNK_MAGIC + struct.pack("<IIIQ", g.version, self._header_bytes, g.chunk_tokens, n_bytes)
        head += self._gdigest + key + parent + struct.pack("<II", index, part)
        head += bytes(_FIXED - len(head)) + toks.tobytes()
        return head + bytes(self._header_bytes - len(head))

    def _disk_put(self, key: bytes, parent: bytes, index: int, toks: npt.NDArray[np.int32],
                  payload: npt.NDArray[np.uint8], part: int = 0) -> bool:
        path = self._file(key, part)
        if os.path.isfile(path):
            with contextlib.suppress(OSError):
                os.utime(path)
            return True
        if os.path.lexists(path):
            # something else under a chunk's name (a FIFO, a folder, a dangling link): no chunk,
            # and no place to write one
            self.stats["disk_errors"] += 1
            self.last_error = f"{path}: not a regular file"
            return False
        size = self._header_bytes + payload.nbytes + _SUM
        if size > self.disk_bytes:
            return False
        head = self._chunk_header(key, parent, index, toks, part, payload.nbytes)
        s = ChunkSum()
        s.update(head)
        s.update(payload)
        try:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with atomic_write(path) as f:
                f.write(head)
                f.write(payload.data)
                f.write(struct.pack("<Q", s.digest()))
        except OSError as e:
            self.stats["disk_errors"] += 1
            self.last_error = str(e)
            return False
        self.stats["files_written"] += 1
        self._count_written(size)
        return True

    def _count_written(self, size: int) -> None:
        """Add a written file to the directory's byte count, which every process writing to it
        keeps in the usage file under its lock (each counting only its own writes, several
        processes passed the cap together); past the cap, remove the least recently used files
        down to 90% of it. A count that is missing or unreadable is taken afresh from the files."""
        assert self.path is not None
        try:
            with _usage(self.path) as usage:
                used = usage.read()
                used = self.disk_usage() if used is None else used + size    # a scan sees the new file
                if used > self.disk_bytes:
                    used = self._remove_lru(self.disk_bytes * 9 // 10)
                usage.write(used)
        except OSError as e:
            self.stats["disk_errors"] += 1
            self.last_error = f"the directory's byte count: {e}"

    def chunks(self) -> Iterator[ChunkInfo]:
        """Every chunk file of the directory (read from the headers; files that are not chunks
        of this geometry are left out). Costs a look at every file: for the command line and gc."""
        if self.path is None:
            return
        root = os.path.join(self.path, "chunks")
        for sub in sorted(os.listdir(root)):
            d = os.path.join(root, sub)
            if not os.path.isdir(d):
                continue
            for name in sorted(os.listdir(d)):
                if not name.endswith(_PART_EXT):
                    continue
                p = os.path.join(d, name)
                try:
                    with open_regular(p) as f:
                        st = os.fstat(f.fileno())
                        head = f.read(_FIXED)
                except OSError:
                    continue
                if len(head) < _FIXED or head[:4] != CHUNK_MAGIC or head[24:40] != self._gdigest:
                    continue
                index, part = struct.unpack_from("<II", head, 72)
                yield ChunkInfo(p, head[40:56].hex(), head[56:72].hex(), index, st.st_size, st.st_mtime,
                                "end" if part else "rows")

    def disk_usage(self) -> int:
        """Bytes of the chunk files in the directory (0 without one)."""
        return sum(c.bytes for c in self.chunks())

    def gc(self, max_bytes: int) -> int:
        """Remove the least recently used chunk files (and leftover temporary files older than an
        hour) until the directory holds at most max_bytes of chunks. Returns the files removed."""
        _check_bytes("max_bytes", max_bytes)
        if self.path is None:
            return 0
        before = self.stats["disk_evicted"]
        with _usage(self.path) as usage:
            usage.write(self._remove_lru(max_bytes))
        return self.stats["disk_evicted"] - before

    def _remove_lru(self, max_bytes: int) -> int:
        """gc's removals (the usage lock held): the bytes of chunks the directory holds after."""
        assert self.path is not None
        files = sorted(self.chunks(), key=lambda c: c.mtime)
        total = sum(c.bytes for c in files)
        removed = 0
        for c in files:
            if total <= max_bytes:
                break
            with contextlib.suppress(FileNotFoundError):
                os.unlink(c.path)
                removed += 1
            total -= c.bytes
        root = os.path.join(self.path, "chunks")
        now = time.time()
        for sub in os.listdir(root):
            d = os.path.join(root, sub)
            if os.path.isdir(d):
                for name in os.listdir(d):
                    p = os.path.join(d, name)
                    with contextlib.suppress(OSError):
                        if name.endswith(".tmp") and now - os.stat(p).st_mtime > 3600:
                            os.unlink(p)
        self.stats["disk_evicted"] += removed
        return total

    def _drop_file(self, path: str) -> None:
        with contextlib.suppress(OSError):
            os.unlink(path)
        self.stats["corrupt_removed"] += 1

    # --- putting chunks ----------------------------------------------------------------------

    def put(self, tokens: Any, k_rows: Sequence[npt.NDArray[Any]], v_rows: Sequence[npt.NDArray[Any]],
            salt: str | bytes | None = None) -> int:
        """Store the whole chunks of tokens from per-layer K and V rows: arrays of exactly
        len(tokens) rows of each layer's row bytes (what ``cache.k(il)`` rows hold, in any numeric
        dtype of that size; TypeError for other objects, ValueError for another size). A store of
        a unified cache without 2-D positions only (the others' chunks come from their caches:
        ``save``, ``write_back``). Returns the tokens the store now holds for this prompt (a
        multiple of chunk_tokens)."""
        g = self.geometry
        if g.kind != "unified" or g.ext:
            raise ValueError(f"put: a store of a {g.describe()} takes its chunks from the cache (save, or "
                             "write_back); put() takes rows for a unified cache without 2-D positions")
        toks = _tokens_array(tokens)
        n = len(toks)
        if len(k_rows) != len(g.layers) or len(v_rows) != len(g.layers):
            raise ValueError(f"k_rows and v_rows must hold {len(g.layers)} layers, not {len(k_rows)} and {len(v_rows)}")
        ks = [self._rows(a, n, b, f"k_rows[{i}]") for i, (a, b) in enumerate(zip(k_rows, g.k_row_bytes))]
        vs = [self._rows(a, n, b, f"v_rows[{i}]") for i, (a, b) in enumerate(zip(v_rows, g.v_row_bytes))]
        return self._put_rows(toks, ks, vs, salt)

    @staticmethod
    def _rows(a: Any, n: int, row_bytes: int, name: str) -> npt.NDArray[np.uint8]:
        # exactly n rows of numbers (their bytes, as cache.k(il) holds them): more bytes, or rows
        # of another width (f32 rows where the cache holds f16), are another tensor, not these rows
        if not isinstance(a, np.ndarray) and not isinstance(a, memoryview):
            raise TypeError(f"{name} must be an array of rows (numpy, as cache.k(il) gives them), not "
                            f"{type(a).__name__}")
        arr = np.ascontiguousarray(a)
        if arr.dtype.kind not in "biufV":
            raise TypeError(f"{name} must hold numbers or raw bytes, got dtype {arr.dtype}")
        if arr.nbytes != n * row_bytes or (arr.ndim > 1 and arr.shape[0] != n):
            raise ValueError(f"{name} holds {arr.nbytes} bytes in shape {arr.shape}, expected {n} rows of "
                             f"{row_bytes} bytes")
        return arr.reshape(-1).view(np.uint8).reshape(-1, row_bytes)

    def _put_rows(self, toks: npt.NDArray[np.int32], ks: list[npt.NDArray[np.uint8]],
                  vs: list[npt.NDArray[np.uint8]], salt: str | bytes | None) -> int:
        g = self.geometry
        c = g.chunk_tokens
        keys = self.keys(toks, salt)
        k_off, v_off = g._offsets()
        prev = bytes(_KEY)
        for i, key in enumerate(keys):
            ctoks = toks[i * c:(i + 1) * c].copy()
            have_host = key in self._host
            have_disk = self.path is not None and self.disk_bytes > 0 and os.path.isfile(self._file(key))
            if have_host:
                self._host.move_to_end(key)
            if (have_host or self.host_bytes == 0 or self.host_bytes < g.chunk_bytes) and \
                    (have_disk or self.path is None or self.disk_bytes == 0):
                if have_disk:
                    with contextlib.suppress(OSError):
                        os.utime(self._file(key))
                prev = key
                continue
            payload = np.empty(g.chunk_bytes, np.uint8)
            for il, (kr, vr) in enumerate(zip(ks, vs)):
                payload[k_off[il]:k_off[il] + c * kr.shape[1]].reshape(c, -1)[:] = kr[i * c:(i + 1) * c]
                payload[v_off[il]:v_off[il] + c * vr.shape[1]].reshape(c, -1)[:] = vr[i * c:(i + 1) * c]
            if not have_host:
                self._host_put(key, ctoks, payload)
            if self.path is not None and self.disk_bytes > 0 and not have_disk:
                self._disk_put(key, prev, i, ctoks, payload)
            self.stats["chunks_saved"] += 1
            self.stats["bytes_saved"] += payload.nbytes
            prev = key
        return len(keys) * c

    # --- with a cache ------------------------------------------------------------------------

    def _check_cache(self, cache: Any, what: str) -> None:
        if self.geometry.version != 1:
            return      # the parts' checks: the whole geometry, read from the cache
        if not isinstance(cache, _Unified):
            raise StoreError(f"{what}: cache must be a UnifiedCache (the store's geometry is a unified cache's), "
                             f"not {type(cache).__name__}")
        if getattr(cache, "cell_ext", False):
            raise StoreError(f"{what}: cache carries the per-cell extension (cell_ext=True): this store's "
                             f"geometry has none")
        if cache.buffers == "none":
            raise StoreError(f"{what}: cache holds no K/V memory (buffers='none')")

    def save(self, cache: UnifiedCache, seq_id: int, tokens: Any, salt: str | bytes | None = None) -> int:
        """Copy the whole chunks of a sequence's leading positions into the store: tokens are the
        token ids at positions 0, 1, ... of seq_id (the prompt and what was decoded after it).
        Only positions 0 .. m-1 that the sequence holds, each in one cell, are taken (m at most
        len(tokens)). Chunks the store holds already are only marked as used. Returns the tokens
        the store holds for this prompt afterwards (a multiple of chunk_tokens)."""
        self._check_cache(cache, "save")
        toks = _tokens_array(tokens)
        self._salts.setdefault(_salt_hash(salt), salt)
        if self.geometry.version != 1:
            return _parts.save_parts(self, cache, seq_id, toks, salt)
        exp = cache.seq_export(seq_id)
        geo = StoreGeometry._from_header(exp.header, self.geometry.chunk_tokens)
        if geo != self.geometry:
            raise StoreError(f"save: cache's geometry ({geo.describe()}) is not the store's "
                             f"({self.geometry.describe()})")
        pos = self._header_positions(exp.header)
        n = len(pos)
        # the leading positions 0 .. m-1, each held by one cell
        order = np.argsort(pos, kind="stable")
        sp = pos[order]
        good = sp == np.arange(n, dtype=sp.dtype)
        m = int(np.argmin(good)) if not good.all() else n
        m = min(m, len(toks))
        c = self.geometry.chunk_tokens
        m -= m % c
        if m == 0:
            return 0
        keys = self.keys(toks[:m], salt)
        if all(k in self._host or self.host_bytes < self.geometry.chunk_bytes for k in keys) and \
                (self.path is None or self.disk_bytes == 0 or all(os.path.isfile(self._file(k)) for k in keys)):
            return self._touch(keys)
        data = exp.gather()
        ks, vs = self._split_rows(data, n, cache.v_trans, order[:m])
        return self._put_rows(toks[:m], ks, vs, salt)

    def _touch(self, keys: list[bytes]) -> int:
        for k in keys:
            if k in self._host:
                self._host.move_to_end(k)
            elif self.path is not None:
                with contextlib.suppress(OSError):
                    os.utime(self._file(k))
        return len(keys) * self.geometry.chunk_tokens

    @staticmethod
    def _header_positions(header: bytes) -> npt.NDArray[np.int32]:
        return _header_cells(header)[0]

    def _split_rows(self, data: npt.NDArray[np.uint8], n: int, v_trans: bool,
                    order: npt.NDArray[np.intp]) -> tuple[list[npt.NDArray[np.uint8]], list[npt.NDArray[np.uint8]]]:
        """Per layer the K rows and the V rows of the cells in order, from a sequence's bytes in
        the order of a state's data section."""
        g = self.geometry
        ks, vs, off = [], [], 0
        for kb in g.k_row_bytes:
            ks.append(data[off:off + n * kb].reshape(n, kb)[order])
            off += n * kb
        for ly, vb in zip(g.layers, g.v_row_bytes):
            block = data[off:off + n * vb]
            if v_trans:
                elt = vb // ly[2]
                rows = block.reshape(ly[2], n, elt).transpose(1, 0, 2).reshape(n, vb)
            else:
                rows = block.reshape(n, vb)
            vs.append(np.ascontiguousarray(rows[order]))
            off += n * vb
        return ks, vs

    def _import_header(self, cache: Any, n: int, seq_id: int) -> bytes:
        """A hand-off header naming n cells at positions 0 .. n-1 of seq_id in the store's
        geometry (the receiving cache checks it against its own)."""
        g = self.geometry
        return _make_import_header(g.type_k, g.type_v, g.layers, cache.v_trans, np.arange(n), seq_id)

    def _sources(self, n_chunks: int) -> npt.NDArray[np.uint64]:
        """The store's side of a load as regions of a virtual address space in which chunk i's
        bytes start at i * chunk_bytes: per layer the K rows of every chunk, then the V rows."""
        g = self.geometry
        k_off, v_off = g._offsets()
        off = np.array(k_off + v_off, dtype=np.uint64)
        length = np.array(g.k_row_bytes + g.v_row_bytes, dtype=np.uint64) * np.uint64(g.chunk_tokens)
        base = np.arange(n_chunks, dtype=np.uint64) * np.uint64(g.chunk_bytes)
        out = np.empty((len(off), n_chunks, 2), dtype=np.uint64)
        out[:, :, 0] = off[:, None] + base[None, :]
        out[:, :, 1] = length[:, None]
        return out.reshape(-1, 2)

    def load(self, cache: UnifiedCache, seq_id: int, tokens: Any, salt: str | bytes | None = None, *,
             max_tokens: int | None = None, min_tokens: int = 1, pos_x: Any = None, pos_y: Any = None,
             at: int | None = None, rope: RopeParams | None = None) -> int:
        """Bring the longest stored prefix of tokens (at most max_tokens of them, whole chunks)
        into seq_id of cache, at positions 0 .. k-1, replacing what the sequence held; returns k
        (0: nothing loaded, the cache untouched; also when fewer than min_tokens are stored).

        at: place the prefix at positions at .. at + k - 1 instead, next to the cells the
        sequence holds (none of them in that range), its K rotated by at with rope (default:
        the cache's RopeParams) — not bit-exact against computing the tokens there
        (:func:`kvcache.relocate.set_range`). Only a plain unified cache's prefix moves: an
        iSWA, recurrent or hybrid cache, or cells with 2-D positions, are refused (StoreError;
        docs/store.md "Relocation" says why). The cells are then placed as a ubatch
        (``find_slot``) and nothing changes on failure.

        The load is one transactional import (``seq_import_begin``): nothing changes until it
        commits, and a load that fails changes no cell, sequence or prefix (a chunk file found
        corrupt is removed and the load retried with the chunks before it). Into a sequence that
        holds cells the bytes of the cells are put back too; into an empty one (the usual case)
        no copy of the free cells it fills is kept, so an abort leaves in them what was written
        (bytes that nothing reads). StateError when the cache is too full for the prefix."""
        self._check_cache(cache, "load")
        seq_id = seq_arg(seq_id, cache.n_seq_max)
        if at is not None:
            self._check_move(cache, seq_id, at, rope)
        toks = _tokens_array(tokens)
        self._salts.setdefault(_salt_hash(salt), salt)
        if max_tokens is not None:
            toks = toks[:max(0, max_tokens)]
        if self.geometry.version != 1:
            return _parts.load_parts(self, cache, seq_id, toks, self.keys(toks, salt, pos_x=pos_x, pos_y=pos_y),
                                    min_tokens)
        keys = self.keys(toks, salt)
        srcs: list[Any] = []
        for key in keys:
            hit = self._host.get(key)
            if hit is not None:
                self._host.move_to_end(key)
                srcs.append(hit)
            elif self.path is not None and os.path.isfile(self._file(key)):
                srcs.append(self._file(key))
            else:
                break
        while True:
            k = len(srcs) * self.geometry.chunk_tokens
            if k == 0 or k < min_tokens:
                self.stats["misses"] += 1
                return 0
            if at is None:
                bad = self._load_chunks(cache, seq_id, toks[:k], keys[:len(srcs)], srcs)
            else:
                bad = self._load_moved(cache, seq_id, toks[:k], keys[:len(srcs)], srcs, at, rope)
            if bad is None:
                break
            del srcs[bad:]
        self.stats["host_hits"] += sum(1 for s in srcs if not isinstance(s, str))
        self.stats["disk_hits"] += sum(1 for s in srcs if isinstance(s, str))
        self.stats["chunks_loaded"] += len(srcs)
        self.stats["bytes_loaded"] += len(srcs) * self.geometry.chunk_bytes
        return k

    def _load_chunks(self, cache: Any, seq_id: int, toks: npt.NDArray[np.int32], keys: list[bytes],
                     srcs: list[Any]) -> int | None:
        """One import of the chunks srcs (host pairs or file paths); None when committed, else the
        index of the first chunk found bad (its file removed, the cache untouched)."""
        n = len(toks)
        header = self._import_header(cache, n, seq_id)
        # into an empty sequence no copy of the free cells' bytes is kept for abort (they hold nothing)
        imp = _seq_import_begin(cache, header, seq_id, into_empty=True)
        try:
            if cache.v_trans:
                bad = self._fill_transposed(imp, srcs, keys, toks)
            else:
                src, dst = pair_regions(self._sources(len(srcs)), imp.regions)
                bad = self._fill(src, dst, srcs, keys, toks)
            if bad is not None:
                imp.abort()
                return bad
            imp.commit()
        except BaseException:
            imp.abort()
            raise
        return None

    def _fill(self, src: npt.NDArray[np.uint64], dst: npt.NDArray[np.uint64], srcs: list[Any], keys: list[bytes],
              toks: npt.NDArray[np.int32]) -> int | None:
        """Copy each chunk's pieces into the import's regions: from host memory in one call
        without the GIL, from files straight into the cells, checked as they pass. Returns the
        first bad chunk or None."""
        cb = self.geometry.chunk_bytes
        which = (src[:, 0] // np.uint64(cb)).astype(np.int64)
        stream = len(srcs) * cb >= _STREAM_BYTES
        host = np.array([not isinstance(s, str) for s in srcs], dtype=bool)
        if host.any():
            bases = np.array([_addr(s[1]) if not isinstance(s, str) else 0 for s in srcs], dtype=np.uint64)
            sel = host[which]
            real = src[sel].copy()
            real[:, 0] = real[:, 0] - which[sel].astype(np.uint64) * np.uint64(cb) + bases[which[sel]]
            _copy_pairs(real, dst[sel], stream)
        if host.all():
            return None
        order = np.argsort(which, kind="stable")
        bounds = np.searchsorted(which[order], np.arange(len(srcs) + 1))
        for i, s in enumerate(srcs):
            if not isinstance(s, str):
                continue
            sel = order[bounds[i]:bounds[i + 1]]
            offs = (src[sel, 0] - np.uint64(i * cb)).tolist()
            lens = src[sel, 1].tolist()
            pieces = list(zip(offs, dst[sel, 0].tolist(), lens))
            if sum(lens) != cb or any(a[0] + a[2] != b[0] for a, b in zip(pieces, pieces[1:])):
                raise AssertionError("the pieces of a chunk do not tile it")
            if not self._read_file(s, keys[i], i, toks, pieces, stream=stream):
                return i
        return None

    def _bounce(self) -> npt.NDArray[np.uint8]:
        """A buffer of _STEP bytes, made once (its pages touched)."""
        b = getattr(self, "_bounce_buf", None)
        if b is None:
            b = self._bounce_buf = np.zeros(_STEP, np.uint8)
        return b

    def _read_file(self, path: str, key: bytes, index: int, toks: npt.NDArray[np.int32],
                   pieces: list[tuple[int, int, int]] | None, keep: npt.NDArray[np.uint8] | None = None,
                   stream: bool = False, part_no: int = 0) -> bool:
        """Read a chunk file (its rows, or with part_no 1 its end part), checking it, copying its
        payload's pieces (offset, address, length, sorted by offset) as they pass (and the whole
        payload into keep, or into host memory when promoting). False when the file is missing,
        truncated or corrupt (then removed)."""
        g = self.geometry
        c = g.chunk_tokens
        hb = self._header_bytes
        n_bytes = g.end_bytes(index, part_no) if part_no else g.rows_bytes
        want = hb + n_bytes + _SUM
        if keep is None and self.promote and self.host_bytes >= n_bytes:
            keep = np.empty(n_bytes, np.uint8)
        try:
            f = open_regular(path)
        except OSError:
            return False
        with f:
            try:
                size = os.fstat(f.fileno()).st_size
                head = f.read(hb)
            except OSError:
                return False
            ctoks = toks[index * c:(index + 1) * c]
            if (size != want or len(head) != hb or head[:4] != CHUNK_MAGIC or
                    struct.unpack_from("<IIIQ", head, 4) != (g.version, hb, c, n_bytes) or
                    head[24:40] != self._gdigest or head[40:56] != key or
                    struct.unpack_from("<II", head, 72) != (index, part_no) or
                    head[_FIXED:_FIXED + 4 * c] != ctoks.tobytes()):
                self._drop_file(path)
                return False
            s = ChunkSum()
            s.update(head)
            # one C loop over the file's steps (no Python per step); the pieces tile the payload
            # in order, so the sum sees the file's bytes in order
            if keep is not None:
                ok = s.read_from(f.fileno(), [(_addr(keep), keep.nbytes)], _STEP)
                base = _addr(keep)
                for o, d, ln in (pieces or []) if ok else []:
                    ctypes.memmove(d, base + o, ln)
            else:
                # a load larger than the caches: each step read into a small buffer, then copied
                # into the cells with non-temporal stores and summed in the same pass; else
                # straight into the reserved cells, each step summed while in the cache
                regions = np.array([(d, ln) for _, d, ln in pieces or []], np.uint64).reshape(-1, 2)
                ok = s.read_from(f.fileno(), regions, _STEP, self._bounce() if stream else None, stream)
            if not ok:
                self._drop_file(path)
                return False
            tail = f.read(_SUM)
            if len(tail) != _SUM or struct.unpack("<Q", tail)[0] != s.digest():
                self._drop_file(path)
                return False
        with contextlib.suppress(OSError):
            os.utime(path)
        hkey = _host_key(key, part_no)
        if keep is not None and self.promote and self.host_bytes >= n_bytes and hkey not in self._host:
            self._host_put(hkey, ctoks.copy(), keep)
        return True

    def _payloads(self, srcs: list[Any], keys: list[bytes], toks: npt.NDArray[np.int32]) -> list[Any] | int:
        """Every chunk's payload in memory (files read and checked), or the index of the first bad chunk."""
        payloads = []
        for i, s in enumerate(srcs):
            if not isinstance(s, str):
                payloads.append(s[1])
                continue
            keep = np.empty(self.geometry.chunk_bytes, np.uint8)
            if not self._read_file(s, keys[i], i, toks, None, keep=keep):
                return i
            payloads.append(keep)
        return payloads

    def _check_move(self, cache: Any, seq_id: int, at: int, rope: RopeParams | None) -> None:
        """What a load at another start refuses before anything is read: a store of a cache
        other than a plain unified one, then what set_range refuses whatever the range."""
        g = self.geometry
        why = {"iswa": "an iSWA cache's SWA layers hide and reuse cells by position, and the window kept "
                       "with a chunk was seen from its own positions",
               "recurrent": "a recurrent state sums up every position before it and cannot be moved"}.get(g.kind)
        if g.state_part and why is None:
            why = "its recurrent state sums up every position before it and cannot be moved"
        if why is None and g.ext:
            why = "its cells carry 2-D positions (cell_ext, M-RoPE), which a rotation by one delta does not move"
        if why is not None:
            raise StoreError(f"load: at= is refused for this store ({g.describe()}): {why}")
        check_target(cache, seq_id, at, rope, "load")

    def _load_moved(self, cache: Any, seq_id: int, toks: npt.NDArray[np.int32], keys: list[bytes], srcs: list[Any],
                    at: int, rope: RopeParams | None) -> int | None:
        """The load at positions at ..: the chunks' rows as one range of positions 0 .. placed by
        set_range; None when placed, else the index of the first bad chunk (the cache untouched)."""
        g = self.geometry
        c = g.chunk_tokens
        payloads = self._payloads(srcs, keys, toks)
        if isinstance(payloads, int):
            return payloads
        k_off, v_off = g._offsets()
        ks = tuple(np.concatenate([p[o:o + c * b].reshape(c, b) for p in payloads])
                   for o, b in zip(k_off, g.k_row_bytes))
        vs = tuple(np.concatenate([p[o:o + c * b].reshape(c, b) for p in payloads])
                   for o, b in zip(v_off, g.v_row_bytes))
        set_range(cache, seq_id, SeqRange(g.type_k, g.type_v, g.layers, 0, ks, vs), at, rope=rope, tokens=toks,
                  what="load")
        return None

    def _fill_transposed(self, imp: Any, srcs: list[Any], keys: list[bytes], toks: npt.NDArray[np.int32]) -> int | None:
        """The load into a cache with a transposed V: every chunk's payload in memory (checked),
        the V rows of the prefix transposed, then one scatter."""
        payloads = self._payloads(srcs, keys, toks)
        if isinstance(payloads, int):
            return payloads
        out, _ = split_payload(self.geometry.layers, payloads, self.geometry.chunk_tokens, False, True)
        imp.scatter(out)
        return None

    # --- with the prefix index ----------------------------------------------------------------

    def attach(self, cache: Any, seq_id: int, tokens: Any, salt: str | bytes | None = None, *,
               pos_x: Any = None, pos_y: Any = None) -> int:
        """Start a request on a cache with prefix reuse on: the longer of the cache's own match
        (``prefix_attach``) and the store's (loaded into the sequence). At most len(tokens) - 1
        tokens, as ``prefix_attach``. pos_x, pos_y: the tokens' 2-D positions for a cache with
        ``cell_ext`` (as ``prefix_attach``). Returns the tokens the sequence now holds."""
        seq_id = seq_arg(seq_id, cache.n_seq_max)
        toks = _tokens_array(tokens)
        self._salts.setdefault(_salt_hash(salt), salt)
        xy = {} if pos_x is None and pos_y is None else {"pos_x": pos_x, "pos_y": pos_y}
        in_cache = cache.prefix_match(toks, salt=salt, **xy)
        if self.match(toks[:max(0, len(toks) - 1)], salt, **xy) > in_cache:
            k = self.load(cache, seq_id, toks, salt, max_tokens=len(toks) - 1, min_tokens=in_cache + 1, **xy)
            if k:
                return k
        return cache.prefix_attach(seq_id, toks, salt=salt, **xy)

    def release(self, cache: Any, seq_id: int, tokens: Any, salt: str | bytes | None = None) -> int:
        """End a request on a cache with prefix reuse on: its whole chunks are written to the
        store (before the index may evict them), then ``prefix_release``. Returns what
        ``prefix_release`` returns."""
        toks = _tokens_array(tokens)
        self.save(cache, seq_id, toks, salt)
        return cache.prefix_release(seq_id, tokens=toks, salt=salt)

    def write_back(self, cache: Any, on: bool = True, *, salts: Sequence[str | bytes | None] = ()) -> None:
        """Write-back at eviction (off by default): from now on every prompt the cache's prefix
        index evicts (to make room for a placement, past its cap, by ``prefix_evict``) has its
        whole chunks written to the store right after the operation, while the freed cells
        still hold its K/V: with write-back, requests can end with plain ``prefix_release`` and
        the store is written only for what the cache lets go. The index records the evicted
        prompts inside placement (no Python runs there); the cache hands them to the store
        after the call. A prompt is named by its salt: the salts the store saw (``save``,
        ``load``, ``attach``, ``release``), ``salts``, and None are known; a prompt of another
        salt is skipped (``stats["evicted_skipped"]``). A write that fails for another reason
        than the disk (counted in ``disk_errors``) loses those prefixes only: the cache's call
        stands, ``stats["write_back_errors"]`` counts it, ``last_error`` says why and a
        ``RuntimeWarning`` is issued.

        Every cache with a prefix index or a checkpoint pool, with prefix reuse on, in the
        store's geometry: a UnifiedCache2026 (any streams, with or without ``cell_ext``), an
        ISWACache2026 (the base cache's evicted rows; the SWA cache's evicted windows as end
        parts), a RecurrentCache (each checkpoint its pool evicts at a chunk's end: the state
        as that chunk's end part), a HybridCache (the attention part's rows; the recurrent
        states its checkpoint pool still holds at the chunks' ends, or evicts there; with a
        sliding window, its iSWA pair's as an ISWACache's and those states);
        docs/store.md says which chunks each writes back. ``StoreError`` for a "2025" cache (no
        index). on=False: off."""
        for salt in salts:
            self._salts[_salt_hash(salt)] = salt
        parts = _parts.write_back_parts(cache)
        if not on:
            for part, _ in parts:
                part._spill_set(None)
            return
        self._check_cache(cache, "write_back")
        geo = StoreGeometry.of(cache, self.geometry.chunk_tokens)
        if geo != self.geometry:
            raise StoreError(f"write_back: cache's geometry ({geo.describe()}) is not the store's "
                             f"({self.geometry.describe()})")
        me = weakref.ref(self)
        recr = getattr(cache, "recr", None)
        for part, role in parts:
            def sink(c: Any, records: list[Any], role: str = role) -> None:
                store = me()
                if store is not None:
                    try:
                        store._write_evicted(c, role, recr, records)
                    except Exception as e:
                        # the cache's operation is done and stands: the loss is the store's, said here
                        store.stats["write_back_errors"] += 1
                        store.last_error = f"write-back of evicted prefixes: {type(e).__name__}: {e}"
                        warnings.warn(f"kvcache store: {store.last_error} (the evicted prefixes are not stored)",
                                      RuntimeWarning, stacklevel=2)

            part._spill_set(sink, self.geometry.chunk_tokens)

    def _write_evicted(self, part: Any, role: str, recr: Any, records: list[Any]) -> None:
        """Store the whole chunks of prompts a cache part just evicted, from their cells, or
        (role "state") the checkpoints a pool just evicted, as the end parts of their last chunks."""
        c = self.geometry.chunk_tokens
        for salt_hash, toks, *rest in records:
            if salt_hash not in self._salts:
                self.stats["evicted_skipped"] += 1
                continue
            salt = self._salts[salt_hash]
            m = len(toks) - len(toks) % c
            before = self.stats["chunks_saved"]
            if role == "state":
                _parts.write_evicted_state(self, salt, toks[:m], rest[0])
                self.stats["evicted_saved"] += self.stats["chunks_saved"] - before
                continue
            cells, strms, ext = rest
            xy = {} if ext is None or not self.geometry.ext else {"pos_x": ext[:m, 0], "pos_y": ext[:m, 1]}
            keys = self.keys(toks[:m], salt, **xy)
            if self.geometry.version != 1:
                _parts.write_evicted_parts(self, part, role, recr, salt, toks[:m], keys, cells[:m], strms[:m], ext)
            elif not (all(k in self._host or self.host_bytes < self.geometry.chunk_bytes for k in keys) and
                      (self.path is None or self.disk_bytes == 0 or all(os.path.isfile(self._file(k)) for k in keys))):
                ks, vs = [], []
                for il in part.layers:
                    k, v = rows_of(part, il, cells[:m], strms[:m])
                    ks.append(k)
                    vs.append(v)
                self._put_rows(toks[:m], ks, vs, salt)
            else:
                self._touch(keys)
            self.stats["evicted_saved"] += self.stats["chunks_saved"] - before

    # --- whole-store information ------------------------------------------------------------

    def flush_stats(self) -> None:
        """Add the counters since the last flush to the directory's ``stats.json`` (what
        ``kvcache store`` reports for every process that used it); also done by :meth:`close`
        and when the store is collected."""
        if self.path is not None:
            _flush(self.path, self.stats, self._flushed)

    def close(self) -> None:
        """Flush the counters to the directory (the store stays usable)."""
        self.flush_stats()

    def __enter__(self) -> PrefixStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def summary(self) -> dict[str, Any]:
        """Geometry, the tiers' bytes and chunk counts, and the counters."""
        out: dict[str, Any] = {"geometry": self.geometry.describe(), "host_chunks": len(self._host),
                               "host_bytes": self._host_used, "host_cap": self.host_bytes}
        if self.path is not None:
            files = list(self.chunks())
            out.update(path=self.path, disk_chunks=len(files), disk_bytes=sum(c.bytes for c in files),
                       disk_cap=self.disk_bytes)
        out["stats"] = dict(self.stats)
        return out


def read_meta(path: _Path) -> dict[str, Any]:
    """The ``kvcache-store.json`` of a store directory; StoreError when it is missing or unreadable."""
    p = os.path.join(os.fspath(path), META_NAME)
    try:
        with open_regular(p) as f:
            meta = json.loads(f.read().decode("utf-8"))
    except FileNotFoundError:
        raise StoreError(f"path {os.fspath(path)!r} is not a kvcache store (no {META_NAME})") from None
    except (OSError, ValueError, RecursionError) as e:
        raise StoreError(f"path {os.fspath(path)!r}: {META_NAME} is unreadable ({e})") from None
    if not isinstance(meta, dict) or meta.get("format") != "kvcache-store":
        raise StoreError(f"path {os.fspath(path)!r}: {META_NAME} is not a kvcache store's")
    if meta.get("version") not in CHUNK_VERSIONS:
        raise StoreError(f"path {os.fspath(path)!r}: a store of version {meta.get('version')}; this kvcache reads "
                         f"versions {', '.join(map(str, CHUNK_VERSIONS))}")
    return meta


def meta_geometry(path: _Path, meta: dict[str, Any]) -> StoreGeometry:
    """The geometry a store directory's metadata names; StoreError when it names none that
    could be (a field missing, of the wrong type or out of range)."""
    try:
        g = StoreGeometry.from_json(meta["geometry"])
        _check_chunk_tokens(g.chunk_tokens)
        g.digest()     # every field packed as a chunk's header and name hold it
        return g
    except (KeyError, TypeError, ValueError, AttributeError, OverflowError, struct.error) as e:
        raise StoreError(f"path {os.fspath(path)!r}: {META_NAME} names no valid geometry ({type(e).__name__}: "
                         f"{e})") from None


def open_store(path: _Path, **kwargs: Any) -> PrefixStore:
    """Open an existing store directory with the geometry it names (for tools: the command line)."""
    return PrefixStore(meta_geometry(path, read_meta(path)), path, **kwargs)


STATS_NAME = "stats.json"
USAGE_NAME = ".disk-usage"     # the chunks' bytes, as the processes writing them count them


@contextlib.contextmanager
def _dir_lock(path: str, name: str) -> Iterator[int]:
    """An exclusive lock, shared by the processes using the directory, on its file `name`
    (created if missing): the file's descriptor, open for reading and writing. OSError when
    something other than a regular file stands there (a FIFO would block the open). Where the
    platform has no advisory locks, unlocked: a concurrent update may be lost."""
    p = os.path.join(path, name)
    fd = os.open(p, os.O_RDWR | os.O_CREAT | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0) |
                 getattr(os, "O_BINARY", 0), 0o644)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(f"{p}: not a regular file")
        try:
            import fcntl
            fcntl.flock(fd, fcntl.LOCK_EX)
        except ImportError:
            pass
        yield fd
    finally:
        os.close(fd)


class _Usage:
    """The byte count in a locked usage file (decimal text)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def read(self) -> int | None:
        os.lseek(self.fd, 0, os.SEEK_SET)
        text = os.read(self.fd, 32)
        return int(text) if text.isdigit() else None

    def write(self, n: int) -> None:
        data = str(n).encode("ascii")
        os.ftruncate(self.fd, 0)
        os.lseek(self.fd, 0, os.SEEK_SET)
        if os.write(self.fd, data) != len(data):
            raise OSError(f"{USAGE_NAME}: short write")


@contextlib.contextmanager
def _usage(path: str) -> Iterator[_Usage]:
    """The directory's usage count, locked."""
    with _dir_lock(path, USAGE_NAME) as fd:
        yield _Usage(fd)


def _flush(path: str, stats: dict[str, int], flushed: dict[str, int]) -> None:
    """Add stats - flushed to path's stats.json under a lock (processes share it); flushed is
    then stats."""
    delta = {k: v - flushed.get(k, 0) for k, v in stats.items() if v != flushed.get(k, 0)}
    if not delta:
        return
    target = os.path.join(path, STATS_NAME)
    try:
        with contextlib.suppress(FileNotFoundError):
            if not stat.S_ISREG(os.stat(target).st_mode):
                return     # not the store's file (a FIFO would block the flush)
        with _dir_lock(path, ".stats.lock"):
            total = read_stats(path)
            for k, v in delta.items():
                total[k] = total.get(k, 0) + v
            with atomic_write(target, "w", encoding="utf-8") as f:
                json.dump(total, f, indent=1)
    except OSError:
        return       # counters are best effort: a full disk must not fail the caller
    flushed.update(stats)


def read_stats(path: _Path) -> dict[str, int]:
    """The counters every process flushed to a store directory (empty when none did)."""
    try:
        with open_regular(os.path.join(os.fspath(path), STATS_NAME)) as f:
            d = json.loads(f.read().decode("utf-8"))
    except (OSError, ValueError, RecursionError):
        return {}
    return {k: int(v) for k, v in d.items() if isinstance(v, int)} if isinstance(d, dict) else {}
