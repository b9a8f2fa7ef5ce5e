"""llama.cpp's state wrappers: whole-context states, session files and sequence files.

llama.cpp saves a cache in three wrappers around the cache's memory state (``state_write``):

- the whole-context state (``llama_state_get_data`` / ``llama_state_set_data``): the model's
  architecture name, (in the layouts up to "2025-08" only) the output positions, logits and
  embeddings of the last batch, then the state of the whole cache;
- the session file (``llama_state_save_file``, magic ``ggsn``, version 9, or 10 in layout
  "2026"): a token list, then a whole-context state;
- the sequence file (``llama_state_seq_save_file``, magic ``ggsq``, version 2, or 3 in layout
  "2026"): a token list, then the memory state of one sequence (without the sequence-blob prefix).

The bytes of each wrapper and of the memory state inside: docs/format.md.

Every parser takes ``layout=`` (a name of :data:`kvcache.LAYOUTS`, docs/state.md) or finds it
from the bytes: the file version where it says it, else the one shape that parses to the end
(:class:`kvcache.StateError` asks for ``layout=`` when two do). Every writer takes ``layout=``
and defaults to :data:`kvcache.DEFAULT_LAYOUT` ("2026", what today's llama.cpp reads);
:func:`kvcache.convert.convert` rewrites a file in another layout without a cache. Every writer takes a path or
a binary file object: a path gets a temporary file in its folder that replaces it only once the
whole file is written (a failed write leaves what was there as it was); a file object, the
caller's, is written at its position and left open.

The parsers here read the wrappers' headers (every count is checked against the bytes left
before anything is taken; anything malformed raises :class:`kvcache.StateError` naming the byte),
expose tokens, output positions, logits and embeddings as numpy arrays that view the input (no
copy), and keep the cache part as a memoryview for ``cache.state_read`` (no copy either). The
cache part itself is decoded only by the cache (or :func:`kvcache._core.describe_state`).

Moving a sequence from llama.cpp to kvcache and back::

    seq = kvcache.statefile.load("seq0.ggsq")            # from llama_state_seq_save_file
    seq.restore(cache, seq_id=0)                         # cache: a UnifiedCache of the same geometry
    ...
    with open("out.ggsq", "wb") as f:
        kvcache.statefile.write_sequence_file(f, cache, seq_id=0, tokens=seq.tokens)
    # llama_state_seq_load_file(ctx, "out.ggsq", dest_seq_id, ...) loads it.
"""
from __future__ import annotations

import os
import struct
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, BinaryIO, Union, cast

import numpy as np
import numpy.typing as npt

from kvcache._atomic import atomic_write
from kvcache._core import DEFAULT_LAYOUT, LAYOUTS, SEQ_MAGIC, StateError, _write_all, layout_info, state_framings

if TYPE_CHECKING:
    # what the wrappers need of a cache: its state (UnifiedCache, ISWACache and RecurrentCache have it)
    from kvcache._core import _StateIO

__all__ = [
    "SESSION_MAGIC", "SESSION_VERSIONS", "SEQUENCE_MAGIC", "SEQUENCE_VERSIONS", "SEQ_MAGIC",
    "ContextState", "SessionFile", "SequenceFile", "Framing",
    "parse_context_state", "parse_session_file", "parse_sequence_file", "parse", "load", "detect",
    "memory_framings", "write_context_state", "write_session_file", "write_sequence_file",
]

SESSION_MAGIC = 0x6767736E    # "ggsn"
SEQUENCE_MAGIC = 0x67677371   # "ggsq"
#: file version -> the layouts that write it (layout_info(...)["session_version"] is the inverse)
SESSION_VERSIONS = {v: tuple(n for n in LAYOUTS if layout_info(n)["session_version"] == v)
                    for v in sorted({layout_info(n)["session_version"] for n in LAYOUTS})}
SEQUENCE_VERSIONS = {v: tuple(n for n in LAYOUTS if layout_info(n)["sequence_version"] == v)
                     for v in sorted({layout_info(n)["sequence_version"] for n in LAYOUTS})}

# llama.cpp's architecture names are short lowercase identifiers ("llama", "gemma2", "nomic-bert",
# "ernie4_5"); a "name" outside these bounds is not a context state.
_ARCH_MAX = 64
_ARCH_CHARS = frozenset(b"abcdefghijklmnopqrstuvwxyz0123456789-_.")


# A path or a binary file object opened for reading / writing.
_Source = Union[str, "os.PathLike[str]", BinaryIO]


def _arch_like(raw: bytes) -> bool:
    return 2 <= len(raw) <= _ARCH_MAX and all(b in _ARCH_CHARS for b in raw)


class _Reader:
    """A bounds-checked little-endian cursor over a byte memoryview."""

    __slots__ = ("buf", "off", "what")

    def __init__(self, buf: memoryview, what: str, off: int = 0):
        self.buf = buf
        self.off = off
        self.what = what

    def left(self) -> int:
        return len(self.buf) - self.off

    def truncated(self, need: int, field_name: str) -> StateError:
        return StateError(f"{self.what} truncated at byte {self.off} of {len(self.buf)} while reading "
                          f"{field_name} ({need} bytes, {self.left()} remain)")

    def take(self, n: int, field_name: str) -> memoryview:
        if n > self.left():
            raise self.truncated(n, field_name)
        out = self.buf[self.off:self.off + n]
        self.off += n
        return out

    def u32(self, field_name: str) -> int:
        return int(struct.unpack("<I", self.take(4, field_name))[0])

    def i32(self, field_name: str) -> int:
        return int(struct.unpack("<i", self.take(4, field_name))[0])

    def u64(self, field_name: str) -> int:
        return int(struct.unpack("<Q", self.take(8, field_name))[0])

    def array(self, count: int, dtype: npt.DTypeLike, field_name: str) -> npt.NDArray[Any]:
        """count items of dtype as a read-only view (count checked against the bytes left)."""
        size = np.dtype(dtype).itemsize
        if count > self.left() // size:
            raise StateError(f"{self.what} truncated at byte {self.off} of {len(self.buf)}: {field_name} "
                             f"holds {count} items of {size} bytes, {self.left()} bytes remain")
        return np.frombuffer(self.take(count * size, field_name), dtype=np.dtype(dtype).newbyteorder("<"))


def _view(data: Any) -> memoryview:
    try:
        m = memoryview(data)
    except TypeError:
        raise TypeError(f"data must be bytes-like, not {type(data).__name__}") from None
    if not m.c_contiguous:
        raise ValueError("data must be a C-contiguous buffer")
    if m.ndim != 1 or m.itemsize != 1 or m.format != "B":
        m = m.cast("B")
    return m


@dataclass(frozen=True)
class Framing:
    """How a memory state is framed, as its bytes say (:func:`memory_framings`): ``streams`` (a
    stream count leads each cache's part), ``prefixed`` (a sequence blob's prefix leads; its id
    ``src_seq_id``), ``parts``: per cache part (1, or 2 for an iSWA cache: base, SWA) the
    ``(offset, cell_count)`` of each stream section, offsets into the memory state;
    ``cell_ext``: the bytes of the per-cell extension in each cell record (0, or 8 / 12 for the
    models that have one, in the layouts with stream counts). ``recurrent_records``: a hybrid
    memory's state (layout "2026"), whose last part is its recurrent part (one section, no stream
    count; its layer count the model's): the layer records that part has (0: no hybrid state).
    A hybrid state's parts are (attention, recurrent), or (recurrent,) for the recurrent part
    alone (``LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY``)."""

    streams: bool
    prefixed: bool
    src_seq_id: int | None
    parts: tuple[tuple[tuple[int, int], ...], ...]
    size: int
    cell_ext: int = 0
    recurrent_records: int = 0


def memory_framings(mem: Any, *, allow_prefix: bool = True) -> list[Framing]:
    """Every framing in which mem (bytes-like) is exactly one memory state: with or without stream
    counts, of one cache part or two (iSWA), with stream counts also with a per-cell extension
    of 12 or 8 bytes (listed after the one without, and only for states with cells, which
    alone tell them apart), and as a hybrid memory's state (``recurrent_records``, last). Empty
    when none is."""
    return _framings(mem, allow_prefix)[0]


def _framings(mem: Any, allow_prefix: bool) -> tuple[list[Framing], dict[tuple[bool, int], StateError]]:
    """memory_framings(mem), and why mem is no memory state framed (streams, n_parts) without an
    extension, for each that it is not: one C call walks each candidate framing once
    (kvcache._core.state_framings) and gives both, so a report never walks the bytes again to say
    where they stop making sense."""
    m = _view(mem)
    found, errors = state_framings(m, allow_prefix)
    return [Framing(streams, prefixed, src, parts, len(m), ext, records)
            for streams, prefixed, src, parts, ext, records in found], errors


def _check_layout(layout: str | None) -> None:
    if layout is not None:
        layout_info(layout)  # TypeError / ValueError for an unknown name


@dataclass(frozen=True, eq=False)
class ContextState:
    """A whole-context state (``llama_state_get_data``).

    ``arch``: the model's architecture name; ``output_pos``: int32, the batch index of each output
    row; ``logits`` / ``embeddings``: float32, flat as stored (``n_outputs`` rows when there are
    outputs; empty in the layouts without outputs); ``cache``: the whole-cache state, a
    memoryview into the parsed data; ``cache_offset``: where it starts in the parsed data (in the
    wrapper, for a session file); ``layout``: the layout it was read in (given or found)."""

    arch: str
    output_pos: npt.NDArray[np.int32]
    logits: npt.NDArray[np.float32]
    embeddings: npt.NDArray[np.float32]
    cache: memoryview = field(repr=False)
    cache_offset: int
    layout: str = DEFAULT_LAYOUT

    @property
    def n_outputs(self) -> int:
        """Number of output rows of the last batch."""
        return len(self.output_pos)

    @property
    def n_vocab(self) -> int | None:
        """Logits per output row, when the logits divide evenly into the outputs."""
        n = self.n_outputs
        return len(self.logits) // n if n and len(self.logits) % n == 0 else None

    def restore(self, cache: _StateIO, *, convert: bool = False) -> int:
        """Restore the cache part into cache (as a whole; it must be all that follows the header).
        Returns the bytes consumed; StateError leaves cache as it was."""
        return cache.state_read(self.cache, -1, convert=convert, exact=True, layout=self.layout)

    @property
    def has_outputs(self) -> bool:
        """Whether this state's layout carries the outputs (they may still be none)."""
        return bool(layout_info(self.layout)["outputs"])


@dataclass(frozen=True, eq=False)
class SessionFile:
    """A session file (``llama_state_save_file``): ``tokens`` (int32) and the ``context`` state
    (whose ``layout`` is the file's)."""

    magic: int
    version: int
    tokens: npt.NDArray[np.int32]
    context: ContextState

    @property
    def layout(self) -> str:
        """The layout the file was read in."""
        return self.context.layout

    def restore(self, cache: _StateIO, *, convert: bool = False) -> int:
        """Restore the cache part into cache (as a whole)."""
        return self.context.restore(cache, convert=convert)


@dataclass(frozen=True, eq=False)
class SequenceFile:
    """A sequence file (``llama_state_seq_save_file``): ``tokens`` (int32) and the ``cache`` state of
    one sequence (a memoryview into the parsed data, starting at ``cache_offset``)."""

    magic: int
    version: int
    tokens: npt.NDArray[np.int32]
    cache: memoryview = field(repr=False)
    cache_offset: int
    layout: str = DEFAULT_LAYOUT

    def restore(self, cache: _StateIO, seq_id: int, *, convert: bool = False) -> int:
        """Restore the sequence into seq_id of cache. Returns the bytes consumed."""
        return cache.state_read(self.cache, seq_id, convert=convert, exact=True, layout=self.layout)


def _newest(names: tuple[str, ...], outputs: bool | None, streams: bool | None) -> list[str]:
    """The layouts of names with these properties (None: any), newest first."""
    out = []
    for n in reversed(names):
        i = layout_info(n)
        if (outputs is None or i["outputs"] == outputs) and (streams is None or i["streams"] == streams):
            out.append(n)
    return out


def _arch(r: _Reader) -> str:
    n = r.u32("the architecture name length")
    if n < 2 or n > _ARCH_MAX:
        raise StateError(f"{r.what}: architecture name of {n} bytes at byte {r.off - 4} "
                         f"(expected 2 to {_ARCH_MAX})")
    raw = bytes(r.take(n, "the architecture name"))
    if not _arch_like(raw):
        raise StateError(f"{r.what}: the architecture name at byte {r.off - n} is not a model "
                         f"architecture name: {raw!r}")
    return raw.decode("ascii")


def _outputs(r: _Reader) -> tuple[npt.NDArray[np.int32], npt.NDArray[np.float32], npt.NDArray[np.float32]]:
    n_outputs = r.i32("the output count")
    if n_outputs < 0:
        raise StateError(f"{r.what}: negative output count {n_outputs} at byte {r.off - 4}")
    at = r.off
    output_pos = r.array(n_outputs, np.int32, "the output positions")
    if n_outputs and int(output_pos.min()) < 0:
        i = int(np.argmin(output_pos))
        raise StateError(f"{r.what}: output {i} (byte {at + 4 * i}) has the negative batch position "
                         f"{int(output_pos[i])}")
    logits = r.array(r.u64("the logit count"), np.float32, "the logits")
    embeddings = r.array(r.u64("the embedding count"), np.float32, "the embeddings")
    return output_pos, logits, embeddings


_NO_I32 = np.zeros(0, dtype="<i4")
_NO_F32 = np.zeros(0, dtype="<f4")


def _parse_context(r: _Reader, layout: str | None, candidates: tuple[str, ...] = LAYOUTS) -> ContextState:
    """The whole-context state at r's cursor in layout, or (None) in the one of candidates whose
    shape (with outputs or without) leaves exactly a memory state after the header."""
    arch = _arch(r)
    start = r.off
    if layout is not None:
        if layout_info(layout)["outputs"]:
            pos, lg, em = _outputs(r)
        else:
            pos, lg, em = _NO_I32, _NO_F32, _NO_F32
        return ContextState(arch, pos, lg, em, r.buf[r.off:], r.off, layout)
    found = []
    errors = []
    for outputs in (False, True):
        names = _newest(candidates, outputs, None)
        if not names:
            continue
        r.off = start
        try:
            pos, lg, em = _outputs(r) if outputs else (_NO_I32, _NO_F32, _NO_F32)
            framings = memory_framings(r.buf[r.off:], allow_prefix=False)
        except StateError as e:
            errors.append(f"{'with' if outputs else 'without'} outputs: {e}")
            continue
        if not framings:
            errors.append(f"{'with' if outputs else 'without'} outputs: what follows at byte {r.off} is not a "
                          "memory state that ends at the end of the data")
            continue
        # a stream count tells the layouts with outputs apart; without outputs every layout has it
        # (a recurrent memory state has none in any layout)
        streams = {f.streams for f in framings}
        pick = _newest(candidates, outputs, streams.pop() if outputs and len(streams) == 1 else None)
        if outputs and len(streams) != 1:
            pick = pick[::-1]   # a recurrent state reads either way: the first layout that wrote it
        if pick:
            found.append(ContextState(arch, pos, lg, em, r.buf[r.off:], r.off, pick[0]))
    if len(found) > 1:
        raise StateError(f"{r.what}: it reads both with outputs (layout {found[1].layout}) and without "
                         f"(layout {found[0].layout}): pass layout= to say which")
    if not found:
        raise StateError(f"{r.what}: not a whole-context state in any layout ({'; '.join(errors)})")
    r.off = found[0].cache_offset
    return found[0]


def parse_context_state(data: Any, *, layout: str | None = None) -> ContextState:
    """Parse a whole-context state (``llama_state_get_data``) without copying it. layout: a name
    of kvcache.LAYOUTS, or None to find it (the shape, with outputs or without, after which
    exactly a memory state follows)."""
    _check_layout(layout)
    return _parse_context(_Reader(_view(data), "context state"), layout)


def _header(r: _Reader, magic: int, versions: dict[int, tuple[str, ...]], name: str,
            layout: str | None, key: str) -> tuple[int, int, npt.NDArray[np.int32], tuple[str, ...]]:
    """Magic, version, tokens; and the layouts the version allows (only layout, when given)."""
    m = r.u32("the magic")
    if m != magic:
        raise StateError(f"{r.what}: magic 0x{m:08x} is not {name}'s 0x{magic:08x}")
    v = r.u32("the version")
    if v not in versions:
        known = " and ".join(str(x) for x in versions)
        newer = " (written by a newer llama.cpp?)" if v > max(versions) else ""
        raise StateError(f"a {r.what} of version {v}{newer}: kvcache reads versions {known}")
    names = versions[v]
    if layout is not None:
        if layout not in names:
            info = layout_info(layout)
            want = info["session_version"] if key == "session_version" else info["sequence_version"]
            raise StateError(f"{r.what}: version {v} (byte 4) is not layout {layout}'s {want}")
        names = (layout,)
    tokens = r.array(r.u32("the token count"), np.int32, "the tokens")
    return m, v, tokens, names


def parse_session_file(data: Any, *, layout: str | None = None) -> SessionFile:
    """Parse a session file (``ggsn``) held in data (bytes-like) without copying it. layout: a name
    of kvcache.LAYOUTS or None (found: version 10 is "2026"; a version-9 file is found by its
    shape, see :func:`parse_context_state`)."""
    _check_layout(layout)
    r = _Reader(_view(data), "session file")
    m, v, tokens, names = _header(r, SESSION_MAGIC, SESSION_VERSIONS, "a session file", layout, "session_version")
    r.what = "session file context state"
    return SessionFile(m, v, tokens, _parse_context(r, names[0] if len(names) == 1 else None, names))


def parse_sequence_file(data: Any, *, layout: str | None = None) -> SequenceFile:
    """Parse a sequence file (``ggsq``) held in data (bytes-like) without copying it. layout: a
    name of kvcache.LAYOUTS or None (version 3 is "2026"; for version 2 the memory state's shape
    says whether it has stream counts)."""
    _check_layout(layout)
    r = _Reader(_view(data), "sequence file")
    m, v, tokens, names = _header(r, SEQUENCE_MAGIC, SEQUENCE_VERSIONS, "a sequence file", layout,
                                  "sequence_version")
    if len(names) > 1:
        streams = {f.streams for f in memory_framings(r.buf[r.off:], allow_prefix=False)}
        pick = _newest(names, None, streams.pop()) if len(streams) == 1 else []
        if not pick:
            raise StateError(f"{r.what}: the memory state after byte {r.off} reads "
                             f"{'both with and without' if streams else 'neither with nor without'} stream "
                             f"counts: pass layout= (one of {', '.join(names)})")
        names = (pick[0],)
    return SequenceFile(m, v, tokens, r.buf[r.off:], r.off, names[0])


def detect(data: Any) -> str:
    """What data holds, from its first bytes: "session", "sequence", "context" (a whole-context
    state: a plausible architecture name first) or "cache" (a bare cache state)."""
    m = _view(data)
    if len(m) >= 4:
        head = struct.unpack_from("<I", m, 0)[0]
        if head == SESSION_MAGIC:
            return "session"
        if head == SEQUENCE_MAGIC:
            return "sequence"
        if 2 <= head <= _ARCH_MAX and len(m) >= 4 + head and _arch_like(bytes(m[4:4 + head])):
            return "context"
    return "cache"


def parse(data: Any, *, layout: str | None = None) -> SessionFile | SequenceFile | ContextState | memoryview:
    """Parse data as what :func:`detect` says it is: a SessionFile, SequenceFile, ContextState, or,
    for a bare cache state, the data itself as a memoryview. layout: as the parsers."""
    kind = detect(data)
    if kind == "session":
        return parse_session_file(data, layout=layout)
    if kind == "sequence":
        return parse_sequence_file(data, layout=layout)
    if kind == "context":
        return parse_context_state(data, layout=layout)
    _check_layout(layout)
    return _view(data)


def load(source: _Source, *, layout: str | None = None) -> SessionFile | SequenceFile | ContextState | memoryview:
    """Read a path (str or os.PathLike) or a binary file object and :func:`parse` its bytes."""
    if isinstance(source, (str, os.PathLike)):
        with open(source, "rb") as f:
            return parse(f.read(), layout=layout)
    read = getattr(source, "read", None)
    if read is None:
        raise TypeError(f"source must be a path or a binary file object, not {type(source).__name__}")
    return parse(read(), layout=layout)


# --- writing -----------------------------------------------------------------------------------

class _Out:
    """Writes into a binary file object, counting the bytes."""

    def __init__(self, f: BinaryIO):
        if not hasattr(f, "write"):
            raise TypeError(f"file must be a path or a binary file object, not {type(f).__name__}")
        self.f = f
        self.n = 0

    def put(self, b: Any) -> None:
        m = memoryview(b).cast("B")
        _write_all(self.f.write, m, "write")
        self.n += len(m)


def _i32_array(v: npt.ArrayLike, name: str) -> npt.NDArray[np.int32]:
    a = np.asarray(v)
    if a.ndim != 1 or (a.size and not np.issubdtype(a.dtype, np.integer)):
        raise TypeError(f"{name} must be a 1-d sequence of integers")
    if a.size and (int(a.min()) < -2**31 or int(a.max()) >= 2**31):
        raise ValueError(f"{name} must fit in int32")
    return np.ascontiguousarray(a, dtype="<i4")


def _f32_array(v: npt.ArrayLike, name: str) -> npt.NDArray[np.float32]:
    a = np.asarray(v, dtype="<f4")
    return np.ascontiguousarray(a.reshape(-1))


def _context_header(arch: str, output_pos: npt.ArrayLike, logits: npt.ArrayLike, embeddings: npt.ArrayLike,
                    layout: str) -> bytes:
    if not isinstance(arch, str):
        raise TypeError(f"arch must be a str, not {type(arch).__name__}")
    raw = arch.encode("ascii", "replace")
    if not _arch_like(raw):
        raise ValueError(f"arch must be a model architecture name (2 to {_ARCH_MAX} characters of a-z, 0-9, "
                         f"'-', '_', '.'), got {arch!r}")
    pos = _i32_array(output_pos, "output_pos")
    if pos.size and int(pos.min()) < 0:
        raise ValueError("output_pos must not be negative")
    lg = _f32_array(logits, "logits")
    em = _f32_array(embeddings, "embeddings")
    name = struct.pack("<I", len(raw)) + raw
    if not layout_info(layout)["outputs"]:
        if pos.size or lg.size or em.size:
            raise ValueError(f"layout {layout!r} has no outputs, logits or embeddings in a whole-context state "
                             "(llama.cpp dropped them): pass none, or a layout that has them ('2025', '2025-08')")
        return name
    return b"".join((name, struct.pack("<i", len(pos)), pos.tobytes(),
                     struct.pack("<Q", lg.size), lg.tobytes(), struct.pack("<Q", em.size), em.tobytes()))


def write_context_state(file: _Source, cache: _StateIO, arch: str, *, output_pos: npt.ArrayLike = (),
                        logits: npt.ArrayLike = (), embeddings: npt.ArrayLike = (),
                        layout: str = DEFAULT_LAYOUT) -> int:
    """Write a whole-context state that ``llama_state_set_data`` of the llama.cpp of ``layout``
    loads: arch (the model's architecture name, e.g. "llama"), in the layouts that have them the
    outputs of the last batch (their batch positions must be below the loading context's n_batch;
    none by default; ValueError when given for a layout without them), then cache's whole state.

    file: a path or a binary file object. Returns the bytes written."""
    _check_layout(layout)
    head = _context_header(arch, output_pos, logits, embeddings, layout)
    return _write_state(file, [head], cache, -1, layout)


def write_session_file(file: _Source, cache: _StateIO, arch: str, tokens: npt.ArrayLike, *,
                       output_pos: npt.ArrayLike = (), logits: npt.ArrayLike = (),
                       embeddings: npt.ArrayLike = (), layout: str = DEFAULT_LAYOUT) -> int:
    """Write a session file that ``llama_state_load_file`` of the llama.cpp of ``layout`` loads
    (version 10 for "2026", 9 before): tokens, then the whole-context state of cache (see
    :func:`write_context_state`). Returns the bytes written."""
    _check_layout(layout)
    toks = _i32_array(tokens, "tokens")
    head = _context_header(arch, output_pos, logits, embeddings, layout)
    return _write_state(file, [struct.pack("<III", SESSION_MAGIC, layout_info(layout)["session_version"], len(toks)),
                               toks.tobytes(), head], cache, -1, layout)


def write_sequence_file(file: _Source, cache: _StateIO, seq_id: int, tokens: npt.ArrayLike, *,
                        layout: str = DEFAULT_LAYOUT) -> int:
    """Write a sequence file that ``llama_state_seq_load_file`` of the llama.cpp of ``layout``
    loads (version 3 for "2026", 2 before): tokens, then the memory state of seq_id in cache
    (without the sequence-blob prefix, as llama.cpp writes it). Returns the bytes written."""
    _check_layout(layout)
    toks = _i32_array(tokens, "tokens")
    cache.state_size(seq_id, layout=layout, prefix=False)  # validates seq_id before anything is written
    return _write_state(file, [struct.pack("<III", SEQUENCE_MAGIC, layout_info(layout)["sequence_version"], len(toks)),
                               toks.tobytes()], cache, seq_id, layout, prefix=False)


def _write_state(file: _Source, head: list[bytes], cache: _StateIO, seq_id: int, layout: str,
                 prefix: bool | None = None) -> int:
    """The bytes of head, then cache's state of seq_id in layout, into file: a binary file object
    (the caller's: written at its position, left open), or a path, replaced only once the whole
    file is written (kvcache._atomic). Returns the bytes written."""
    if isinstance(file, (str, os.PathLike)):
        with atomic_write(file) as f:
            return _write_state(cast(BinaryIO, f), head, cache, seq_id, layout, prefix)
    out = _Out(file)
    for part in head:
        out.put(part)
    out.n += cache.state_write_into(out.f, seq_id, layout=layout, prefix=prefix)
    return out.n
