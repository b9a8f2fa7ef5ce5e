"""llama.cpp's state wrappers: whole-context states, session files and sequence files.

llama.cpp saves a cache in three wrappers around the cache state that ``state_write`` produces:

- the whole-context state (``llama_state_get_data`` / ``llama_state_set_data``): the model's
  architecture name, the output positions, logits and embeddings of the last batch, then the state
  of the whole cache;
- the session file (``llama_state_save_file``, magic ``ggsn``, version 9): a token list, then a
  whole-context state;
- the sequence file (``llama_state_seq_save_file``, magic ``ggsq``, version 2): a token list, then
  the state of one sequence.

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

import numpy as np

from kvcache._core import StateError

__all__ = [
    "SESSION_MAGIC", "SESSION_VERSION", "SEQUENCE_MAGIC", "SEQUENCE_VERSION",
    "ContextState", "SessionFile", "SequenceFile",
    "parse_context_state", "parse_session_file", "parse_sequence_file", "parse", "load",
    "write_context_state", "write_session_file", "write_sequence_file",
]

SESSION_MAGIC = 0x6767736E    # "ggsn"
SESSION_VERSION = 9
SEQUENCE_MAGIC = 0x67677371   # "ggsq"
SEQUENCE_VERSION = 2

# llama.cpp's architecture names are short lowercase identifiers ("llama", "gemma2", "nomic-bert",
# "ernie4_5"); a "name" outside these bounds is not a context state.
_ARCH_MAX = 64
_ARCH_CHARS = frozenset(b"abcdefghijklmnopqrstuvwxyz0123456789-_.")


def _arch_like(raw) -> bool:
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
        return struct.unpack("<I", self.take(4, field_name))[0]

    def i32(self, field_name: str) -> int:
        return struct.unpack("<i", self.take(4, field_name))[0]

    def u64(self, field_name: str) -> int:
        return struct.unpack("<Q", self.take(8, field_name))[0]

    def array(self, count: int, dtype, field_name: str) -> np.ndarray:
        """count items of dtype as a read-only view (count checked against the bytes left)."""
        size = np.dtype(dtype).itemsize
        if count > self.left() // size:
            raise StateError(f"{self.what} truncated at byte {self.off} of {len(self.buf)}: {field_name} "
                             f"holds {count} items of {size} bytes, {self.left()} bytes remain")
        return np.frombuffer(self.take(count * size, field_name), dtype=np.dtype(dtype).newbyteorder("<"))


def _view(data) -> memoryview:
    try:
        m = memoryview(data)
    except TypeError:
        raise TypeError(f"data must be bytes-like, not {type(data).__name__}") from None
    if not m.c_contiguous:
        raise ValueError("data must be a C-contiguous buffer")
    if m.ndim != 1 or m.itemsize != 1 or m.format != "B":
        m = m.cast("B")
    return m


@dataclass(frozen=True, eq=False)
class ContextState:
    """A whole-context state (``llama_state_get_data``).

    ``arch``: the model's architecture name; ``output_pos``: int32, the batch index of each output
    row; ``logits`` / ``embeddings``: float32, flat as stored (``n_outputs`` rows when there are
    outputs); ``cache``: the whole-cache state, a memoryview into the parsed data;
    ``cache_offset``: where it starts in the parsed data (in the wrapper, for a session file)."""

    arch: str
    output_pos: np.ndarray
    logits: np.ndarray
    embeddings: np.ndarray
    cache: memoryview = field(repr=False)
    cache_offset: int

    @property
    def n_outputs(self) -> int:
        return len(self.output_pos)

    @property
    def n_vocab(self) -> int | None:
        """Logits per output row, when the logits divide evenly into the outputs."""
        n = self.n_outputs
        return len(self.logits) // n if n and len(self.logits) % n == 0 else None

    def restore(self, cache, *, convert=False) -> int:
        """Restore the cache part into cache (as a whole; it must be all that follows the header).
        Returns the bytes consumed; StateError leaves cache as it was."""
        return cache.state_read(self.cache, -1, convert=convert, exact=True)


@dataclass(frozen=True, eq=False)
class SessionFile:
    """A session file (``llama_state_save_file``): ``tokens`` (int32) and the ``context`` state."""

    magic: int
    version: int
    tokens: np.ndarray
    context: ContextState

    def restore(self, cache, *, convert=False) -> int:
        """Restore the cache part into cache (as a whole)."""
        return self.context.restore(cache, convert=convert)


@dataclass(frozen=True, eq=False)
class SequenceFile:
    """A sequence file (``llama_state_seq_save_file``): ``tokens`` (int32) and the ``cache`` state of
    one sequence (a memoryview into the parsed data, starting at ``cache_offset``)."""

    magic: int
    version: int
    tokens: np.ndarray
    cache: memoryview = field(repr=False)
    cache_offset: int

    def restore(self, cache, seq_id, *, convert=False) -> int:
        """Restore the sequence into seq_id of cache. Returns the bytes consumed."""
        return cache.state_read(self.cache, seq_id, convert=convert, exact=True)


def _parse_context(r: _Reader) -> ContextState:
    n = r.u32("the architecture name length")
    if n < 2 or n > _ARCH_MAX:
        raise StateError(f"{r.what}: architecture name of {n} bytes at byte {r.off - 4} "
                         f"(expected 2 to {_ARCH_MAX})")
    raw = bytes(r.take(n, "the architecture name"))
    if not _arch_like(raw):
        raise StateError(f"{r.what}: the architecture name at byte {r.off - n} is not a model "
                         f"architecture name: {raw!r}")
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
    return ContextState(raw.decode("ascii"), output_pos, logits, embeddings, r.buf[r.off:], r.off)


def parse_context_state(data) -> ContextState:
    """Parse a whole-context state (``llama_state_get_data``) without copying it."""
    return _parse_context(_Reader(_view(data), "context state"))


def _header(r: _Reader, magic: int, version: int, name: str):
    m = r.u32("the magic")
    if m != magic:
        raise StateError(f"{r.what}: magic 0x{m:08x} is not {name}'s 0x{magic:08x}")
    v = r.u32("the version")
    if v != version:
        raise StateError(f"{r.what}: version {v} (byte 4), this reader knows version {version}")
    tokens = r.array(r.u32("the token count"), np.int32, "the tokens")
    return m, v, tokens


def parse_session_file(data) -> SessionFile:
    """Parse a session file (``ggsn``) held in data (bytes-like) without copying it."""
    r = _Reader(_view(data), "session file")
    m, v, tokens = _header(r, SESSION_MAGIC, SESSION_VERSION, "a session file")
    r.what = "session file context state"
    return SessionFile(m, v, tokens, _parse_context(r))


def parse_sequence_file(data) -> SequenceFile:
    """Parse a sequence file (``ggsq``) held in data (bytes-like) without copying it."""
    r = _Reader(_view(data), "sequence file")
    m, v, tokens = _header(r, SEQUENCE_MAGIC, SEQUENCE_VERSION, "a sequence file")
    return SequenceFile(m, v, tokens, r.buf[r.off:], r.off)


def detect(data) -> str:
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


def parse(data):
    """Parse data as what :func:`detect` says it is: a SessionFile, SequenceFile, ContextState, or,
    for a bare cache state, the data itself as a memoryview."""
    kind = detect(data)
    if kind == "session":
        return parse_session_file(data)
    if kind == "sequence":
        return parse_sequence_file(data)
    if kind == "context":
        return parse_context_state(data)
    return _view(data)


def load(source):
    """Read a path (str or os.PathLike) or a binary file object and :func:`parse` its bytes."""
    if isinstance(source, (str, os.PathLike)):
        with open(source, "rb") as f:
            return parse(f.read())
    read = getattr(source, "read", None)
    if read is None:
        raise TypeError(f"source must be a path or a binary file object, not {type(source).__name__}")
    return parse(read())


# --- writing -----------------------------------------------------------------------------------

class _Out:
    """Writes into a binary file object or a path (opened and closed here)."""

    def __init__(self, file):
        self.own = isinstance(file, (str, os.PathLike))
        self.f = open(file, "wb") if self.own else file
        if not hasattr(self.f, "write"):
            raise TypeError(f"file must be a path or a binary file object, not {type(file).__name__}")
        self.n = 0

    def put(self, b) -> None:
        m = memoryview(b).cast("B")
        done = 0
        while done < len(m):
            k = self.f.write(m[done:])
            if k is None:
                raise BlockingIOError("the file would block")
            if k <= 0:
                raise OSError("the file accepted no bytes")
            done += k
        self.n += len(m)

    def close(self) -> None:
        if self.own:
            self.f.close()


def _i32_array(v, name: str) -> np.ndarray:
    a = np.asarray(v)
    if a.ndim != 1 or (a.size and not np.issubdtype(a.dtype, np.integer)):
        raise TypeError(f"{name} must be a 1-d sequence of integers")
    if a.size and (int(a.min()) < -2**31 or int(a.max()) >= 2**31):
        raise ValueError(f"{name} must fit in int32")
    return np.ascontiguousarray(a, dtype="<i4")


def _f32_array(v, name: str) -> np.ndarray:
    a = np.asarray(v, dtype="<f4")
    return np.ascontiguousarray(a.reshape(-1))


def _context_header(arch: str, output_pos, logits, embeddings) -> bytes:
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
    return b"".join((struct.pack("<I", len(raw)), raw, struct.pack("<i", len(pos)), pos.tobytes(),
                     struct.pack("<Q", lg.size), lg.tobytes(), struct.pack("<Q", em.size), em.tobytes()))


def write_context_state(file, cache, arch: str, *, output_pos=(), logits=(), embeddings=()) -> int:
    """Write a whole-context state that ``llama_state_set_data`` loads: arch (the model's
    architecture name, e.g. "llama"), the outputs of the last batch (their batch positions must be
    below the loading context's n_batch; none by default), then cache's whole state.

    file: a path or a binary file object. Returns the bytes written."""
    head = _context_header(arch, output_pos, logits, embeddings)
    out = _Out(file)
    try:
        out.put(head)
        out.n += cache.state_write_into(out.f, -1)
    finally:
        out.close()
    return out.n


def write_session_file(file, cache, arch: str, tokens, *, output_pos=(), logits=(), embeddings=()) -> int:
    """Write a session file that ``llama_state_load_file`` loads: tokens, then the whole-context
    state of cache (see :func:`write_context_state`). Returns the bytes written."""
    toks = _i32_array(tokens, "tokens")
    head = _context_header(arch, output_pos, logits, embeddings)
    out = _Out(file)
    try:
        out.put(struct.pack("<III", SESSION_MAGIC, SESSION_VERSION, len(toks)))
        out.put(toks.tobytes())
        out.put(head)
        out.n += cache.state_write_into(out.f, -1)
    finally:
        out.close()
    return out.n


def write_sequence_file(file, cache, seq_id, tokens) -> int:
    """Write a sequence file that ``llama_state_seq_load_file`` loads: tokens, then the state of
    seq_id in cache. Returns the bytes written."""
    toks = _i32_array(tokens, "tokens")
    size = cache.state_size(seq_id)  # validates seq_id before anything is written
    out = _Out(file)
    try:
        out.put(struct.pack("<III", SEQUENCE_MAGIC, SEQUENCE_VERSION, len(toks)))
        out.put(toks.tobytes())
        out.n += cache.state_write_into(out.f, seq_id)
    finally:
        out.close()
    del size
    return out.n
