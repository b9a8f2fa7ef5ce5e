"""The prefix store's formats: what a chunk's bytes depend on (:class:`StoreGeometry`), the
constants of its chunk files and host keys, and the hand-off headers it reads and makes. The
store (kvcache.store), its parts (kvcache._store_parts) and relocation (kvcache.relocate) build
on this module; it imports none of them."""
from __future__ import annotations

import functools
import hashlib
import os
import struct
from dataclasses import dataclass
from collections import OrderedDict
from typing import Any, Protocol, Sequence, Union

import numpy as np
import numpy.typing as npt

from kvcache._core import _Hybrid, _ISWA, _Recurrent, _handoff_checksum, ggml_types

CHUNK_MAGIC = b"KVCS"
CHUNK_VERSION = 1           # a unified cache's chunks (the first format)
CHUNK_VERSIONS = (1, 2)     # 2: every other cache's (a part field, parts of sizes per chunk: docs/store.md)
META_NAME = "kvcache-store.json"
_FIXED = 96                 # bytes of a chunk file's header before its token ids
_SUM = 8                    # the checksum that ends a chunk file
_STEP = 1 << 18             # bytes read from a chunk file at a time (they stay in the core's cache)
_KEY = 16                   # bytes of a chunk's name
_HANDOFF_FIXED = 40         # bytes of a hand-off header before its layers (csrc/kvc_handoff.h)
_HANDOFF_SEQ = 36           # where it holds the source sequence id (i32)
_HANDOFF_LAYER = 28
_FLAG_V_TRANS, _FLAG_MEMORY, _FLAG_EXT = 1, 2, 4
_PART_EXT = (".kvc", ".kve", ".kvs")   # a chunk's rows, its end part, a windowed hybrid's state

_Path = Union[str, "os.PathLike[str]"]
_TYPE_NAMES = {t.id: t.name for t in ggml_types()}
_TYPE_IDS = {t.name: t.id for t in ggml_types()}


class StoreError(ValueError):
    """A store refused a directory or a cache: another geometry, or something that is not a store."""


@dataclass(frozen=True)
class StoreGeometry:
    """What a chunk's bytes depend on: the K/V types, per layer (model layer index, K and V row
    widths in elements, K and V row bytes), and the tokens per chunk. Read from a cache with
    :meth:`of`; two stores share chunks only when theirs are equal.

    ``kind`` names the cache: ``"unified"``; ``"iswa"`` (``layers`` the base cache's,
    ``swa_layers`` the SWA cache's, with ``n_swa`` and ``swa_type``); ``"recurrent"`` (no
    ``layers``; ``state_layers`` per recurrent layer (model layer, R row bytes, S row bytes));
    ``"hybrid"`` (``layers`` the attention part's, ``state_layers`` the recurrent part's);
    ``"hybrid_iswa"`` (a hybrid memory with a sliding window: ``layers`` its iSWA pair's base
    cache's, ``swa_layers`` and the window its SWA cache's, ``state_layers`` the recurrent part's).
    ``ext``: the cells carry the per-cell extension (2-D positions), kept with the rows."""

    type_k: int
    type_v: int
    layers: tuple[tuple[int, int, int, int, int], ...]
    chunk_tokens: int
    kind: str = "unified"
    swa_layers: tuple[tuple[int, int, int, int, int], ...] = ()
    n_swa: int = 0
    swa_type: str = "none"
    state_layers: tuple[tuple[int, int, int], ...] = ()
    ext: bool = False

    @classmethod
    def of(cls, cache: Any, chunk_tokens: int) -> StoreGeometry:
        """The geometry of a cache with chunks of chunk_tokens tokens: a UnifiedCache or an
        ISWACache (either semantics, with or without the per-cell extension), a RecurrentCache
        or a HybridCache."""
        made = parts_geometry(cls, cache, chunk_tokens)
        if made is not None:
            return made
        if not hasattr(cache, "seq_export"):
            raise StoreError(f"cache must be a UnifiedCache, ISWACache, RecurrentCache or HybridCache, "
                             f"not {type(cache).__name__}")
        return cls._from_header(cache.seq_export(0).header, chunk_tokens)

    @classmethod
    def _from_header(cls, header: bytes, chunk_tokens: int) -> StoreGeometry:
        (flags,) = struct.unpack_from("<I", header, 12)
        return cls(*_header_layers(header), chunk_tokens, ext=bool(flags & _FLAG_EXT))

    @property
    def version(self) -> int:
        """The chunk format version of this geometry's files: 1 for a unified cache without the
        per-cell extension (the first format, unchanged), 2 for every other (docs/store.md)."""
        return 1 if self.kind == "unified" and not self.ext else 2

    @functools.cached_property
    def ext_bytes(self) -> int:
        """Bytes kept per row for the per-cell extension (x, y, token id), 0 without it."""
        return 12 if self.ext else 0

    @functools.cached_property
    def rows_bytes(self) -> int:
        """Bytes of a chunk's rows part: the attention layers' K/V of its tokens (and their
        extensions); 0 for a recurrent cache."""
        return self.chunk_bytes + self.ext_bytes * self.chunk_tokens

    @functools.cached_property
    def swa_token_bytes(self) -> int:
        """Bytes of K and V of one token in every layer of an iSWA cache's SWA cache."""
        return sum(ly[3] + ly[4] for ly in self.swa_layers)

    @functools.cached_property
    def state_bytes(self) -> int:
        """Bytes of one recurrent state (every recurrent layer's R row then S row)."""
        return sum(ly[1] + ly[2] for ly in self.state_layers)

    @property
    def has_end(self) -> bool:
        """Whether a chunk has an end part: what a query after the chunk needs beyond the rows
        (an iSWA cache's window of the SWA layers, a recurrent state)."""
        return self.kind != "unified"

    @property
    def windowed(self) -> bool:
        """Whether a chunk keeps the SWA layers' window before its end (part 1)."""
        return self.kind in ("iswa", "hybrid_iswa")

    @property
    def state_part(self) -> int:
        """The part number of a chunk's recurrent state: 1, or 2 after a window (0: none)."""
        return {"recurrent": 1, "hybrid": 1, "hybrid_iswa": 2}.get(self.kind, 0)

    @property
    def end_parts(self) -> tuple[int, ...]:
        """The part numbers a chunk has besides its rows (a prefix ends on a chunk with all)."""
        return (1, 2) if self.kind == "hybrid_iswa" else (1,) if self.has_end else ()

    def window_start(self, p: int) -> int:
        """The first position a query at p sees in the SWA layers (an iSWA geometry)."""
        if self.swa_type == "standard":
            return max(0, p - self.n_swa + 1)
        if self.swa_type == "chunked":
            return (p // self.n_swa) * self.n_swa
        return 0

    def end_bytes(self, index: int, part: int = 1) -> int:
        """Bytes of end part ``part`` (1 or 2) of chunk index (0: none)."""
        if self.windowed and part == 1:
            p = (index + 1) * self.chunk_tokens
            return (p - self.window_start(p)) * (self.swa_token_bytes + self.ext_bytes)
        return self.state_bytes

    @functools.cached_property
    def k_row_bytes(self) -> tuple[int, ...]:
        """Each layer's K row bytes."""
        return tuple(ly[3] for ly in self.layers)

    @functools.cached_property
    def v_row_bytes(self) -> tuple[int, ...]:
        """Each layer's V row bytes."""
        return tuple(ly[4] for ly in self.layers)

    @functools.cached_property
    def token_bytes(self) -> int:
        """Bytes of K and V of one token in every layer."""
        return sum(self.k_row_bytes) + sum(self.v_row_bytes)

    @functools.cached_property
    def chunk_bytes(self) -> int:
        """Bytes of K/V a chunk holds."""
        return self.token_bytes * self.chunk_tokens

    def to_json(self) -> dict[str, Any]:
        d = {"type_k": _TYPE_NAMES.get(self.type_k, self.type_k), "type_v": _TYPE_NAMES.get(self.type_v, self.type_v),
             "type_k_id": self.type_k, "type_v_id": self.type_v, "chunk_tokens": self.chunk_tokens,
             "layers": [list(ly) for ly in self.layers]}
        if self.version != 1:
            d.update(kind=self.kind, swa_layers=[list(ly) for ly in self.swa_layers], n_swa=self.n_swa,
                     swa_type=self.swa_type, state_layers=[list(ly) for ly in self.state_layers], ext=self.ext)
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> StoreGeometry:
        def rows(key: str) -> Any:
            return tuple(tuple(int(x) for x in ly) for ly in d.get(key, ()))
        return cls(int(d["type_k_id"]), int(d["type_v_id"]), rows("layers"), int(d["chunk_tokens"]),
                   str(d.get("kind", "unified")), rows("swa_layers"), int(d.get("n_swa", 0)),
                   str(d.get("swa_type", "none")), rows("state_layers"), bool(d.get("ext", False)))

    def digest(self) -> bytes:
        """16 bytes naming the geometry (in every chunk file and every chunk's name)."""
        h = hashlib.blake2b(digest_size=_KEY, person=b"kvcache-geometry")
        h.update(struct.pack("<iiII", self.type_k, self.type_v, len(self.layers), self.chunk_tokens))
        for ly in self.layers:
            h.update(struct.pack("<iIIQQ", *ly))
        if self.version != 1:     # the first format's names are unchanged
            h.update(self.kind.encode() + struct.pack("<IiII?", len(self.swa_layers), self.n_swa,
                                                      len(self.swa_type), len(self.state_layers), self.ext))
            h.update(self.swa_type.encode())
            for ly in self.swa_layers:
                h.update(struct.pack("<iIIQQ", *ly))
            for st in self.state_layers:
                h.update(struct.pack("<iQQ", *st))
        return h.digest()

    def describe(self) -> str:
        k = _TYPE_NAMES.get(self.type_k, str(self.type_k))
        v = _TYPE_NAMES.get(self.type_v, str(self.type_v))
        widths = sorted({(ly[1], ly[2]) for ly in self.layers})
        w = ", ".join(f"{a}/{b}" for a, b in widths)
        attn = f"{len(self.layers)} layers of K/V widths {w}, {k}/{v}"
        if self.windowed:
            attn += f", {len(self.swa_layers)} SWA layers ({self.swa_type} window of {self.n_swa})"
        if self.kind == "recurrent":
            attn = f"{len(self.state_layers)} recurrent layers of {self.state_bytes} state bytes"
        elif self.kind in ("hybrid", "hybrid_iswa"):
            attn += f", {len(self.state_layers)} recurrent layers of {self.state_bytes} state bytes"
        ext = ", cells with 2-D positions" if self.ext else ""
        return f"{self.kind} cache: {attn}{ext}, {self.chunk_tokens} tokens per chunk"

    def _offsets(self) -> tuple[list[int], list[int]]:
        """Byte offsets, inside a chunk, of each layer's K rows and of each layer's V rows."""
        c = self.chunk_tokens
        k_off, v_off, off = [], [], 0
        for kb in self.k_row_bytes:
            k_off.append(off)
            off += kb * c
        for vb in self.v_row_bytes:
            v_off.append(off)
            off += vb * c
        return k_off, v_off


@dataclass(frozen=True)
class ChunkInfo:
    """One chunk file of a store directory (:meth:`PrefixStore.chunks`)."""

    path: str
    key: str           # the chunk's name, hex
    parent: str        # the name of the chunk before it (all zeros for a prompt's first)
    index: int         # its place in its prompt: it holds tokens [index * chunk_tokens, ...)
    bytes: int         # the file's size
    mtime: float       # last written or used
    part: str = "rows"  # "rows": the chunk's K/V rows; "end": its end part (a SWA window, a recurrent state)



class ChunkTiers(Protocol):
    """What the store's parts (kvcache._store_parts) use of a store: its geometry and counters,
    its chunk names, and its host and disk tiers. kvcache.store.PrefixStore has it; the parts
    are written against this, below the store, not against the store's class."""

    geometry: StoreGeometry
    host_bytes: int
    disk_bytes: int
    path: str | None
    stats: dict[str, int]
    _host: OrderedDict[bytes, tuple[npt.NDArray[np.int32], npt.NDArray[np.uint8]]]

    def keys(self, tokens: Any, salt: str | bytes | None = None, *, pos_x: Any = None,
             pos_y: Any = None) -> list[bytes]: ...

    def _file(self, key: bytes, part: int = 0) -> str: ...

    def _host_put(self, key: bytes, toks: npt.NDArray[np.int32], payload: npt.NDArray[np.uint8]) -> None: ...

    def _disk_put(self, key: bytes, parent: bytes, index: int, toks: npt.NDArray[np.int32],
                  payload: npt.NDArray[np.uint8], part: int = 0) -> bool: ...

    def _split_rows(self, data: npt.NDArray[np.uint8], n: int, v_trans: bool,
                    order: npt.NDArray[np.intp]) -> tuple[list[npt.NDArray[np.uint8]], list[npt.NDArray[np.uint8]]]: ...

    def _read_file(self, path: str, key: bytes, index: int, toks: npt.NDArray[np.int32],
                   pieces: list[tuple[int, int, int]] | None, keep: npt.NDArray[np.uint8] | None = None,
                   stream: bool = False, part_no: int = 0) -> bool: ...

def _host_key(key: bytes, part: int) -> bytes:
    """The host tier's key of a chunk's rows (its name) or end part (its name and b"e", or b"s"
    for a windowed hybrid's state)."""
    return key + b"es"[part - 1:part] if part else key


def _salt_bytes(salt: str | bytes | None) -> bytes:
    if salt is None:
        return b""
    if isinstance(salt, str):
        return b"s" + salt.encode("utf-8")
    if isinstance(salt, (bytes, bytearray, memoryview)):
        return b"b" + bytes(salt)
    raise TypeError(f"salt must be a str, bytes or None, not {type(salt).__name__}")


def _tokens_array(tokens: Any) -> npt.NDArray[np.int32]:
    a = np.asarray(tokens)
    if a.ndim != 1 or (a.size and not np.issubdtype(a.dtype, np.integer)):
        raise TypeError("tokens must be a 1-d sequence of token ids (integers)")
    if a.size and (int(a.min()) < -2**31 or int(a.max()) >= 2**31):
        raise ValueError("tokens must fit in int32")
    return np.ascontiguousarray(a, dtype="<i4")


def _header_layers(header: bytes) -> tuple[int, int, tuple[tuple[int, int, int, int, int], ...]]:
    """The K/V types and the layers (model layer, K / V widths, K / V row bytes) of a hand-off header."""
    type_k, type_v, n_layer = struct.unpack_from("<iiI", header, 16)
    layers = tuple(tuple(int(x) for x in struct.unpack_from("<iIIQQ", header, _HANDOFF_FIXED + _HANDOFF_LAYER * i))
                   for i in range(n_layer))
    return type_k, type_v, layers  # type: ignore[return-value]


def _header_cells(header: bytes) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.int32] | None]:
    """The positions of a hand-off header's cells, and their extensions ((n, 3): x, y, token id)
    when the header carries them."""
    (flags,) = struct.unpack_from("<I", header, 12)
    (n_layer,) = struct.unpack_from("<I", header, 24)
    off = _HANDOFF_FIXED + _HANDOFF_LAYER * n_layer
    (n_runs,) = struct.unpack_from("<I", header, off)
    off += 4 + 8 * n_runs
    (cc,) = struct.unpack_from("<I", header, off)
    width = 6 if flags & _FLAG_EXT else 3
    cells = np.frombuffer(header, dtype="<i4", count=width * cc, offset=off + 4).reshape(cc, width)
    return cells[:, 0].copy(), (cells[:, 2:5].copy() if width == 6 else None)



def _make_import_header(type_k: int, type_v: int, layers: Sequence[tuple[int, int, int, int, int]], v_trans: bool,
                        pos: npt.NDArray[Any], seq_id: int, ext: npt.NDArray[Any] | None = None) -> bytes:
    """A hand-off header naming cells of seq_id at positions pos (and with extensions ext, (n, 3))
    of a cache part of these layers (the receiving cache checks it against its own)."""
    n = len(pos)
    flags = (_FLAG_V_TRANS if v_trans else 0) | _FLAG_MEMORY | (_FLAG_EXT if ext is not None else 0)
    lay = b"".join(struct.pack("<iIIQQ", *ly) for ly in layers)
    cells = np.empty((n, 6 if ext is not None else 3), dtype="<i4")
    cells[:, 0] = pos
    cells[:, 1] = 1
    if ext is not None:
        cells[:, 2:5] = ext
    cells[:, -1] = seq_id
    runs = struct.pack("<III", 1, 0, n)
    size = _HANDOFF_FIXED + len(lay) + len(runs) + 4 + cells.nbytes + 8
    token_bytes = sum(ly[3] + ly[4] for ly in layers)
    head = b"".join((b"KVCH", struct.pack("<IIIiiIQi", 1, size, flags, type_k, type_v, len(layers),
                                          n * token_bytes, seq_id),
                     lay, runs, struct.pack("<I", n), cells.tobytes()))
    return head + struct.pack("<Q", _handoff_checksum(head))


def parts_geometry(cls: type[StoreGeometry], cache: Any, chunk_tokens: int) -> StoreGeometry | None:
    """The geometry of an ISWACache, RecurrentCache or HybridCache (None for another object)."""
    if isinstance(cache, _ISWA):
        parts: tuple[Any, Any] = (cache.base, cache.swa)
        _refuse_no_memory(parts[0], StoreError)
        tk, tv, base = _header_layers(parts[0].seq_export(0).header)
        swa = _header_layers(parts[1].seq_export(0).header)[2]
        return cls(tk, tv, base, chunk_tokens, "iswa", swa, int(cache.n_swa), str(cache.swa_type),
                   ext=bool(cache.cell_ext))
    if isinstance(cache, _Hybrid):
        pair: Any = cache.attn if isinstance(cache.attn, _ISWA) else None
        attn_cache: Any = cache.attn if pair is None else pair.base
        _refuse_no_memory(attn_cache, StoreError)
        tk, tv, attn = _header_layers(attn_cache.seq_export(0).header)
        st = tuple((int(il), r, s) for il, (r, s) in zip(cache.recurrent_layers, cache.recr._state_layout()))
        if pair is None:
            return cls(tk, tv, attn, chunk_tokens, "hybrid", state_layers=st)
        swa = _header_layers(pair.swa.seq_export(0).header)[2]
        return cls(tk, tv, attn, chunk_tokens, "hybrid_iswa", swa, int(pair.n_swa), str(pair.swa_type), st,
                   ext=bool(pair.cell_ext))
    if isinstance(cache, _Recurrent):
        if cache.buffers == "none":
            raise StoreError("cache holds no state memory (buffers='none')")
        st = tuple((il, r, s) for il, (r, s) in enumerate(cache._state_layout()))
        return cls(_TYPE_IDS[cache.type_k], _TYPE_IDS[cache.type_v], (), chunk_tokens, "recurrent", state_layers=st)
    return None


def _refuse_no_memory(part: Any, error: type[Exception]) -> None:
    if part.buffers == "none":
        raise error("cache holds no K/V memory (buffers='none')")
