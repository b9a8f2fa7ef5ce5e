# State blobs at the Python edge: buffers and files in, buffers and files out, for every cache
# variant; and the description of a blob without a cache (csrc/kvc_state.h).

from cpython.mem cimport PyMem_Malloc, PyMem_Free
from libc.string cimport memset
from cpython.bytes cimport PyBytes_FromStringAndSize, PyBytes_AS_STRING
from kvcache.includes.kvc_state cimport (KVC_STATE_CONVERT_V, KVC_STATE_EXACT, kvc_state_desc,
                                         kvc_state_layer_desc, kvc_state_describe, KVC_LAYOUT_STREAMS,
                                         KVC_LAYOUT_PREFIX, KVC_LAYOUT_SWA_TRIM, KVC_LAYOUT_DETECT,
                                         KVC_SEQ_MAGIC, KVC_SEQ_PREFIX_BYTES, kvc_state_frame,
                                         kvc_state_describe_frame, KVC_LAYOUT_EXT_XY, KVC_LAYOUT_EXT_TOK,
                                         KVC_LAYOUT_CELL_EXT, kvc_layout_ext_bytes,
                                         KVC_LAYOUT_FRESH_OUT, kvc_state_describe_records)
from kvcache.includes.kvc_cells cimport KVC_SEQ_WORDS, kvc_cells_seq_cells, kvc_cell_ext
from kvcache.includes.kvc_state cimport (kvc_unified_state_size_lay, kvc_unified_state_write_range_lay,
                                         kvc_unified_state_read_parts_lay, KVC_STATE_MAX_PARTS)
from kvcache.includes.kvc_unified cimport kvc_unified

# Bytes handed to a file object's write() at a time: bounded memory whatever the state's size.
_STATE_CHUNK = 1 << 20

# A cache's state codec, as the state methods of every cache drive it (state_codec below):
# bytes of a blob; bytes [offset, offset + cap) of it (see kvc_unified_state_write_range_lay);
# a read, all or nothing. Each takes the state_codec that names them.
ctypedef size_t (*state_size_fn)(void *codec, int32_t seq_id, unsigned layout) noexcept nogil
ctypedef int (*state_range_fn)(const void *codec, int32_t seq_id, unsigned layout, uint64_t offset, uint8_t *out,
                               size_t cap, size_t *written) noexcept nogil
ctypedef int (*state_read_fn)(void *codec, int32_t seq_id, const uint8_t *data, size_t n, unsigned flags,
                              unsigned layout, size_t *consumed, kvc_err *err) noexcept nogil

# --- layouts ------------------------------------------------------------------------------------
# The one table of llama.cpp's state layouts (docs/state.md): the name a user gives, the codec's
# bits (csrc/kvc_state.h), what the wrappers of statefile hold, and the releases that wrote it.
# Named by the month of the llama.cpp that llama-cpp-python vendored.
_XY = KVC_LAYOUT_EXT_XY
_LAYOUT_TABLE = {
    "2025": (0, True, 9, 2, "0.3.10-0.3.14"),
    "2025-08": (KVC_LAYOUT_STREAMS, True, 9, 2, "0.3.15-0.3.16"),
    "2026-03": (KVC_LAYOUT_STREAMS | _XY, False, 9, 2, "0.3.17-0.3.22"),
    "2026-05": (KVC_LAYOUT_STREAMS | KVC_LAYOUT_PREFIX | _XY, False, 9, 2, "0.3.23-0.3.25"),
    "2026-06": (KVC_LAYOUT_STREAMS | KVC_LAYOUT_PREFIX | KVC_LAYOUT_SWA_TRIM | _XY, False, 9, 2, "0.3.26-0.3.35"),
    "2026": (KVC_LAYOUT_STREAMS | KVC_LAYOUT_PREFIX | KVC_LAYOUT_SWA_TRIM | _XY | KVC_LAYOUT_EXT_TOK, False, 10, 3,
             "0.3.36"),
}

#: the layouts state_write and the statefile writers produce, oldest first
LAYOUTS = tuple(_LAYOUT_TABLE)
#: what the writers produce unless told otherwise: what today's llama.cpp reads
DEFAULT_LAYOUT = "2026"
#: the first word of a sequence blob of the layouts that have the prefix
SEQ_MAGIC = <uint32_t>KVC_SEQ_MAGIC


def layout_info(layout):
    """What a layout (a name of LAYOUTS) is: a dict with ``streams`` (the memory state has a
    stream count), ``prefix`` (sequence blobs start with SEQ_MAGIC and the seq id), ``swa_trim``
    (sequence blobs leave out SWA-masked cells), ``outputs`` (whole-context states hold the
    outputs, logits and embeddings), ``session_version`` / ``sequence_version`` (of the files),
    ``cell_ext`` (bytes of the per-cell extension of models that have one: 0, 8 for x, y, 12
    for x, y and the token id) and ``llama_cpp_python`` (the releases that write it)."""
    bits, outputs, sv, qv, rel = _layout_row(layout)
    ext = kvc_layout_ext_bytes(bits)
    return {"name": layout, "streams": bool(bits & KVC_LAYOUT_STREAMS), "prefix": bool(bits & KVC_LAYOUT_PREFIX),
            "swa_trim": bool(bits & KVC_LAYOUT_SWA_TRIM), "outputs": outputs, "session_version": sv,
            "sequence_version": qv, "cell_ext": ext, "llama_cpp_python": rel}


cdef tuple _layout_row(object layout):
    row = _LAYOUT_TABLE.get(layout) if isinstance(layout, str) else None
    if row is None:
        if not isinstance(layout, str):
            raise TypeError(f"layout must be a str (one of {', '.join(LAYOUTS)}), not {type(layout).__name__}")
        raise ValueError(f"unknown layout {layout!r}: expected one of {', '.join(LAYOUTS)}")
    return row


cdef unsigned write_layout_bits(object layout, object prefix, int32_t seq_id) except? 0xffffffff:
    """The codec bits of a writer's layout; prefix None: the layout's own (a sequence blob of a
    layout with the prefix starts with it), False: the bare memory state, True: insist on it."""
    cdef unsigned bits = <unsigned>_layout_row(layout)[0]
    if prefix is None:
        return bits
    if not isinstance(prefix, bool):
        raise TypeError(f"prefix must be a bool or None, not {type(prefix).__name__}")
    if prefix:
        if seq_id < 0:
            raise ValueError("prefix=True: a whole-cache state (seq_id -1) has no sequence-blob prefix")
        if not bits & KVC_LAYOUT_PREFIX:
            raise ValueError(f"prefix=True: layout {layout!r} has no sequence-blob prefix")
        return bits
    return bits & ~(<unsigned>KVC_LAYOUT_PREFIX)


cdef unsigned read_layout_bits(object layout) except? 0xffffffff:
    """The codec bits of a reader's layout; None: found from the bytes (KVC_LAYOUT_DETECT)."""
    if layout is None:
        return KVC_LAYOUT_DETECT | KVC_LAYOUT_STREAMS | KVC_LAYOUT_PREFIX
    return <unsigned>_layout_row(layout)[0]


cdef _HeldBuffer state_data_view(object data):
    """The bytes of a state argument, taken at the edge and pinned (not copied): a C-contiguous
    buffer (bytes, bytearray, memoryview, numpy array, mmap, CPU tensor); release() it after use."""
    if not (PyObject_CheckBuffer(data) or hasattr(data, "__dlpack__")):
        raise TypeError(f"data must be bytes-like (bytes, bytearray, memoryview, numpy array...), "
                        f"not {type(data).__name__}")
    cdef _HeldBuffer hb = hold_buffer(data, "data", False)
    if not hb.c_contiguous():
        hb.release()
        raise ValueError("data must be a C-contiguous buffer")
    return hb


cdef const uint8_t *state_data_ptr(_HeldBuffer hb, size_t *n) noexcept:
    """Pointer to the bytes of a view from state_data_view (NULL when empty), n its length."""
    n[0] = <size_t>hb.view.len
    if n[0] == 0:
        return NULL
    return <const uint8_t *>hb.view.buf


cdef unsigned state_read_flags(object convert, object exact) except? 0:
    cdef unsigned f = 0
    if bool_c(convert, "convert"):
        f |= KVC_STATE_CONVERT_V
    if bool_c(exact, "exact"):
        f |= KVC_STATE_EXACT
    return f


cdef object new_state_bytes(size_t n, uint8_t **p):
    """A bytes object of n bytes to write a state into (*p its data), with the writer's layout
    bits | KVC_LAYOUT_FRESH_OUT (plain stores into the pages as they fault in). Its pages are
    asked to be huge (kvc_advise_huge_pages) before anything writes them: a state of hundreds
    of MB then faults 2 MiB pages, not 4 KiB ones one by one."""
    out = PyBytes_FromStringAndSize(NULL, <Py_ssize_t>n)
    p[0] = <uint8_t *>PyBytes_AS_STRING(out)
    if n >= 2 * KVC_HUGE_PAGE:
        kvc_advise_huge_pages(p[0], n)
    return out


cdef object state_target(object buf):
    """The target of a state_write_into, taken at the edge: a pinned writable C-contiguous
    buffer (_HeldBuffer), or a binary file object (anything with write())."""
    cdef _HeldBuffer hb
    if PyObject_CheckBuffer(buf) or hasattr(buf, "__dlpack__"):
        try:
            hb = hold_buffer(buf, "buf", False)
        except ValueError as e:
            raise ValueError(f"buf: {e}") from None
        if hb.view.readonly:
            hb.release()
            raise TypeError(f"buf must be writable ({type(buf).__name__} is read-only)")
        if not hb.c_contiguous():
            hb.release()
            raise ValueError("buf must be a C-contiguous buffer")
        return hb
    if getattr(buf, "write", None) is None:
        raise TypeError(f"buf must be a writable buffer or a binary file object, not {type(buf).__name__}")
    return buf


cdef object state_write_into(const void *cache, state_range_fn fn, int32_t seq_id, unsigned layout, size_t total,
                             object target):
    """Write a cache's state into a target from state_target: a buffer (straight from C, no copy
    in between) or a binary file object (in chunks of _STATE_CHUNK bytes). Returns the bytes
    written. The caller holds the cache's lock as an operation (lock(..., RUNS_PYTHON)): a file's write()
    that tries to change the cache is refused, so the blob is the state of one moment."""
    cdef size_t written = 0, off = 0
    cdef uint8_t[::1] out
    cdef int r
    cdef _HeldBuffer hb
    if isinstance(target, _HeldBuffer):
        hb = <_HeldBuffer>target
        if <size_t>hb.view.len < total:
            raise ValueError(f"buf holds {hb.view.len} bytes, the state needs {total}")
        if total == 0:
            return 0
        with nogil:
            r = fn(cache, seq_id, layout, 0, <uint8_t *>hb.view.buf, total, &written)
        check_status(r, NULL, "state_write_into")
        return written
    write = getattr(target, "write", None)
    if write is None:
        raise TypeError(f"buf must be a writable buffer or a binary file object, not {type(target).__name__}")
    chunk = bytearray(min(total, <size_t>_STATE_CHUNK) or 1)
    out = chunk
    view = memoryview(chunk)
    while off < total:
        with nogil:
            r = fn(cache, seq_id, layout, off, &out[0], <size_t>out.shape[0], &written)
        check_status(r, NULL, "state_write_into")
        if written == 0:
            raise RuntimeError("state_write_into: the state ended early (internal error)")
        _write_all(write, view[:written])
        off += written
    return total


# --- the state methods of every cache -----------------------------------------------------------
# state_size / state_write / state_write_into / state_read are one implementation for every cache:
# a cache fills a state_codec (its C entry points, or the unified caches whose parts its blob is
# made of) and names the caches whose locks a call holds; the arguments, the locks and the
# buffers are handled here, the same for all.

cdef struct state_codec:
    state_size_fn size
    state_range_fn write_range
    state_read_fn read
    uint32_t n_seq_max                           # sequence ids are [-1, n_seq_max)
    void *cache                                  # the C cache of the entry points (none for parts)
    uint32_t n_parts                             # unified caches whose parts, in order, make the blob
    kvc_unified *parts[KVC_STATE_MAX_PARTS]
    size_t part_size[KVC_STATE_MAX_PARTS]        # their bytes, as the last size() measured them
    unsigned hybrid_parts                        # a hybrid memory's enum kvc_hybrid_parts
    bint today_only           # the state exists in layout "2026" only, partial_only applies (hybrid)
    bint check_read_layout    # a reader's layout must hold the parts' streams (a UnifiedCache)
    bint ignore_convert       # convert= is accepted and has nothing to convert (recurrent)


cdef size_t _parts_size(void *codec, int32_t seq_id, unsigned layout) noexcept nogil:
    """Bytes of the parts laid end to end; the sequence-blob prefix, when written, once in front."""
    cdef state_codec *k = <state_codec *>codec
    cdef size_t total = 0
    cdef uint32_t i
    for i in range(k.n_parts):
        k.part_size[i] = kvc_unified_state_size_lay(k.parts[i], seq_id, layout)
        total += k.part_size[i]
        layout &= ~(<unsigned>KVC_LAYOUT_PREFIX)
    return total


cdef int _parts_range(const void *codec, int32_t seq_id, unsigned layout, uint64_t offset, uint8_t *out, size_t cap,
                      size_t *written) noexcept nogil:
    """The window [offset, offset + cap) of the parts laid end to end (sizes from _parts_size)."""
    cdef const state_codec *k = <const state_codec *>codec
    cdef uint64_t start = 0, at
    cdef size_t done = 0, w, n
    cdef uint32_t i
    cdef int r
    written[0] = 0
    for i in range(k.n_parts):
        at = offset + done
        if done < cap and start <= at < start + k.part_size[i]:
            n = <size_t>min(<uint64_t>(cap - done), start + k.part_size[i] - at)
            w = 0
            r = kvc_unified_state_write_range_lay(k.parts[i], seq_id, layout, at - start, out + done, n, &w)
            if r < 0:
                return r
            done += w
        start += k.part_size[i]
        layout &= ~(<unsigned>KVC_LAYOUT_PREFIX)
    written[0] = done
    return 0


cdef int _parts_read(void *codec, int32_t seq_id, const uint8_t *data, size_t n, unsigned flags, unsigned layout,
                     size_t *consumed, kvc_err *err) noexcept nogil:
    cdef state_codec *k = <state_codec *>codec
    return kvc_unified_state_read_parts_lay(k.parts, k.n_parts, seq_id, data, n, flags, layout, consumed, NULL, err)


cdef void state_codec_init(state_codec *k, state_size_fn size, state_range_fn write_range, state_read_fn read,
                           void *cache, uint32_t n_seq_max) noexcept:
    """k: the codec of these entry points over cache, every option off."""
    memset(k, 0, sizeof(state_codec))
    k.size = size
    k.write_range = write_range
    k.read = read
    k.cache = cache
    k.n_seq_max = n_seq_max


cdef int state_codec_parts(state_codec *k, tuple caches) except -1:
    """k: the codec of a blob made of one part per unified cache of caches (_caches_arg)."""
    cdef _Unified c
    cdef uint32_t i
    state_codec_init(k, _parts_size, _parts_range, _parts_read, NULL, UINT32_MAX)
    k.n_parts = <uint32_t>len(caches)
    for i in range(k.n_parts):
        c = caches[i]
        k.parts[i] = &c.c
        k.n_seq_max = min(k.n_seq_max, c.c.n_seq_max)
    return 0


cdef int32_t _state_write_args(state_codec *k, object seq_id, object layout, object prefix, object partial_only,
                               str what, unsigned *bits) except -2:
    """The sequence of a writer's arguments; *bits its layout's codec bits."""
    cdef int32_t s = seq_c(seq_id, k.n_seq_max, "seq_id", True)
    cdef uint32_t i
    if k.today_only:
        layout = _hybrid_layout(layout, what)
    bits[0] = write_layout_bits(layout, prefix, s)
    for i in range(k.n_parts):
        _check_state_layout(k.parts[i], bits[0], what)
    if k.today_only:
        k.hybrid_parts = _hybrid_parts(partial_only, s)
    return s


cdef int32_t _state_read_args(state_codec *k, object seq_id, object convert, object exact, object layout,
                              object partial_only, unsigned *flags, unsigned *bits) except -2:
    """The sequence of a reader's arguments; *flags and *bits its codec's flags and layout bits."""
    cdef uint32_t i
    if k.check_read_layout:
        for i in range(k.n_parts):
            _check_state_layout(k.parts[i], read_layout_bits(layout), "state_read", False)
    cdef int32_t s = seq_c(seq_id, k.n_seq_max, "seq_id", True)
    flags[0] = state_read_flags(convert, exact)   # convert checked as every cache checks it
    if k.ignore_convert:
        flags[0] &= ~(<unsigned>KVC_STATE_CONVERT_V)
    if k.today_only:
        layout = _hybrid_layout("2026" if layout is None else layout, "state_read")
    bits[0] = read_layout_bits(layout)
    if k.today_only:
        k.hybrid_parts = _hybrid_parts(partial_only, s)
    return s


cdef object cache_state_size(list order, state_codec *k, object seq_id, object layout, object prefix,
                             object partial_only=False):
    """state_size of a cache whose locks are those of order (the caches, in the global order)."""
    cdef unsigned bits
    cdef int32_t s = _state_write_args(k, seq_id, layout, prefix, partial_only, "state_size", &bits)
    cdef size_t n
    lock_all(order, READ, "state_size")
    try:
        n = k.size(k, s, bits)
    finally:
        unlock_all(order, READ)
    return n


cdef object cache_state_write(list order, state_codec *k, object seq_id, object layout, object prefix,
                              object partial_only=False):
    """state_write: the blob as a new bytes object, written by C straight into it."""
    cdef unsigned bits
    cdef int32_t s = _state_write_args(k, seq_id, layout, prefix, partial_only, "state_write", &bits)
    cdef size_t n, written = 0
    cdef uint8_t *p
    cdef int r = 0
    lock_all(order, RUNS_PYTHON, "state_write")
    try:
        n = k.size(k, s, bits)
        out = new_state_bytes(n, &p)
        with nogil:
            r = k.write_range(k, s, bits | KVC_LAYOUT_FRESH_OUT, 0, p, n, &written)
    finally:
        unlock_all(order, RUNS_PYTHON)
    check_status(r, NULL, "state_write")
    if written != n:
        raise RuntimeError(f"state_write wrote {written} bytes, expected {n} (internal error)")
    return out


cdef object cache_state_write_into(list order, state_codec *k, object buf, object seq_id, object layout,
                                   object prefix, object partial_only=False):
    """state_write_into: the blob into a buffer or a binary file object (state_write_into)."""
    cdef unsigned bits
    cdef int32_t s = _state_write_args(k, seq_id, layout, prefix, partial_only, "state_write_into", &bits)
    target = state_target(buf)      # taken before the locks, like every array argument
    try:
        lock_all(order, RUNS_PYTHON, "state_write_into")
    except BaseException:
        if isinstance(target, _HeldBuffer):
            (<_HeldBuffer>target).release()
        raise
    try:
        return state_write_into(k, k.write_range, s, bits, k.size(k, s, bits), target)
    finally:
        unlock_all(order, RUNS_PYTHON)
        if isinstance(target, _HeldBuffer):
            (<_HeldBuffer>target).release()


cdef object cache_state_read(list order, state_codec *k, object data, object seq_id, object convert, object exact,
                             object layout, object partial_only=False):
    """state_read: all or nothing, the caches changed by C alone (StateError otherwise)."""
    cdef unsigned flags, bits
    cdef int32_t s = _state_read_args(k, seq_id, convert, exact, layout, partial_only, &flags, &bits)
    cdef size_t n = 0, consumed = 0
    cdef _HeldBuffer keep = state_data_view(data)
    cdef const uint8_t *p = state_data_ptr(keep, &n)
    cdef kvc_err err
    cdef int r = 0
    err.msg[0] = 0
    try:
        lock_all(order, RUNS_PYTHON | CHANGE, "state_read")
    except BaseException:
        keep.release()
        raise
    try:
        with nogil:
            r = k.read(k, s, p, n, flags, bits, &consumed, &err)
    finally:
        unlock_all(order, RUNS_PYTHON | CHANGE)
        keep.release()
    check_status(r, &err, "state_read")
    return consumed


def _write_all(write, view, str what="state_write_into"):
    """file.write until every byte is taken (raw files may take fewer; None means none now). A
    count that is no int, or not within what was offered, is the file's error: the bytes it says
    it took are not known."""
    cdef Py_ssize_t done = 0, n = len(view)
    cdef long long k
    while done < n:
        r = write(view[done:])
        if r is None:
            raise BlockingIOError(f"{what}: the file would block")
        k = int_c(r, f"{what}: the file's write() count", LLONG_MIN, LLONG_MAX)
        if k <= 0 or k > n - done:
            raise OSError(f"{what}: the file's write() took {k} of the {n - done} bytes offered")
        done += k


cdef uint32_t _cell_ext_arg(object cell_ext) except? 0xffffffff:
    cdef long long n = int_c(cell_ext, "cell_ext", 0, 12)
    if n not in (0, 8, 12):
        raise ValueError(f"cell_ext = {n}: a cell's extension has 0, 8 (x, y) or 12 (x, y, token) bytes")
    return <uint32_t>n


def describe_state(data, cell_ext=0, records=0):
    """Describe one cache state at the front of data without restoring it.

    Returns a dict: ``cell_count``, ``v_trans``, ``n_layer``, ``data_offset`` (where the V layout
    flag is), ``size`` (bytes of the state; data may go on after it), ``n_seq_id_min`` /
    ``n_seq_id_max`` over the cells, ``pos`` (int32 array), ``seq`` (uint64 [cell_count, 4], bit b
    of word w set when the cell lists sequence 64 * w + b) and ``layers`` (one dict per layer: K and V types, row sizes, or
    for a transposed V element size and width, offsets and data bytes). The structure is checked
    as the readers check it (StateError says what is wrong and where), but nothing is checked
    against a cache. cell_ext: the bytes of the per-cell extension in each cell record (0, or
    for a model that has one 8 or 12: layout_info(layout)["cell_ext"]); with them the dict also
    has ``ext``: int32 [cell_count, 3], each cell's x, y and token id (-1 with 8 bytes). records:
    for a hybrid memory's recurrent part, whose layer count (``n_layer``) is the model's, the
    layer records it has (its recurrent layers'); ``layers`` then has that many (0: as many as
    the count says)."""
    cdef uint32_t eb = _cell_ext_arg(cell_ext)
    cdef uint32_t nrec = <uint32_t>int_c(records, "records", 0, 65536)
    cdef size_t n = 0
    cdef _HeldBuffer keep = state_data_view(data)
    cdef const uint8_t *p = state_data_ptr(keep, &n)
    cdef kvc_state_desc d
    cdef kvc_err err
    cdef int r
    err.msg[0] = 0
    with nogil:
        r = kvc_state_describe_records(p, n, eb, nrec, &d, NULL, NULL, NULL, 0, NULL, 0, &err)
    check_status(r, &err, "cache state")
    cdef uint32_t n_rec = nrec if nrec else d.n_layer
    # the counts are now known to fit in the data
    pos = np.empty(d.cell_count, dtype=np.int32)
    seq = np.empty((d.cell_count, KVC_SEQ_WORDS), dtype=np.uint64)
    cdef int32_t[::1] vp = pos
    cdef uint64_t[:, ::1] vs = seq
    cdef int32_t *pp = &vp[0] if d.cell_count else NULL
    cdef uint64_t *ps = &vs[0, 0] if d.cell_count else NULL
    ext = np.empty((max(d.cell_count, 1), 3), dtype=np.int32)
    cdef int32_t[:, ::1] ve = ext
    cdef kvc_state_layer_desc *ld = <kvc_state_layer_desc *>PyMem_Malloc(max(n_rec, 1) * sizeof(kvc_state_layer_desc))
    if ld == NULL:
        raise MemoryError()
    try:
        with nogil:
            r = kvc_state_describe_records(p, n, eb, nrec, &d, pp, ps, <kvc_cell_ext *>&ve[0, 0] if eb else NULL,
                                           d.cell_count, ld, n_rec, &err)
        check_status(r, &err, "cache state")
        layers = []
        for i in range(n_rec):
            e = {"k_type": ld[i].k_type, "k_row_size": ld[i].k_row_size, "k_offset": ld[i].k_offset,
                 "k_bytes": ld[i].k_bytes, "v_type": ld[i].v_type, "v_offset": ld[i].v_offset,
                 "v_bytes": ld[i].v_bytes}
            if d.v_trans:
                e["v_elem_size"] = ld[i].v_elem_size
                e["v_width"] = ld[i].v_width
            else:
                e["v_row_size"] = ld[i].v_row_size
            layers.append(e)
    finally:
        PyMem_Free(ld)
    out = {"cell_count": d.cell_count, "v_trans": d.v_trans, "n_layer": d.n_layer, "data_offset": d.data_off,
           "size": d.end, "n_seq_id_min": d.n_seq_id_min, "n_seq_id_max": d.n_seq_id_max, "pos": pos,
           "seq": seq, "layers": layers}
    if eb:
        out["ext"] = ext[:d.cell_count]
    return out


def describe_frame(data, streams, allow_prefix=True, cell_ext=0):
    """The framing of one cache's memory state at the front of data, with stream counts (streams
    true) or without: a dict with ``prefixed`` (a sequence-blob prefix leads; only with allow_prefix),
    ``src_seq_id`` (its id), ``n_stream`` (1 in the layouts without a stream count), ``size``
    (bytes of the framed state) and ``sections``: per stream ``(offset, cell_count)``, the
    offset of the stream's body (pass ``data[offset:]`` to describe_state when cell_count > 0,
    or in the layouts without streams always). cell_ext: the bytes of the per-cell extension in
    each cell record (0, 8 or 12, as describe_state). StateError names what is wrong and where."""
    cdef uint32_t eb = _cell_ext_arg(cell_ext)
    cdef unsigned bits = (KVC_LAYOUT_STREAMS if streams else 0) | KVC_LAYOUT_PREFIX
    if eb:
        bits |= KVC_LAYOUT_CELL_EXT | KVC_LAYOUT_EXT_XY | (KVC_LAYOUT_EXT_TOK if eb == 12 else 0)
    cdef size_t n = 0
    cdef _HeldBuffer keep = state_data_view(data)
    cdef const uint8_t *p = state_data_ptr(keep, &n)
    cdef kvc_state_frame f
    cdef kvc_err err
    cdef int r
    cdef bint ap = bool(allow_prefix)
    cdef size_t offs[256]
    cdef uint32_t cells[256]
    err.msg[0] = 0
    try:
        with nogil:
            r = kvc_state_describe_frame(p, n, bits, ap, &f, offs, cells, 256, &err)
    finally:
        keep.release()
    check_status(r, &err, "cache state framing")
    return {"prefixed": bool(f.prefixed), "src_seq_id": f.src_seq_id if f.prefixed else None,
            "n_stream": f.n_stream, "size": f.end,
            "sections": [(offs[i], cells[i]) for i in range(min(f.n_stream, 256))]}


def ggml_type_name(type_id):
    """The ggml name of a K/V type id ("f16", "q8_0", ...), or None for an id kvcache does not know."""
    cdef long long i = int_c(type_id, "type_id", LLONG_MIN, LLONG_MAX)
    if not INT32_MIN <= i <= INT32_MAX:
        return None
    cdef const kvc_type_info *t = kvc_type_get(<int32_t>i)
    return t.name.decode() if t != NULL else None
