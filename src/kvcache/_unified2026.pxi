# The unified cache of today's llama.cpp (semantics "2026"): streams, each token group placed for
# good in usable cells of its stream (prepare() is the dry run), stream copies that update()
# performs, masks without padding rows; no defragmentation.

from cpython.bytearray cimport PyByteArray_FromStringAndSize, PyByteArray_AS_STRING
from kvcache.includes.kvc_retain cimport *

import hashlib


cdef object salt_bytes(object salt):
    """A request's salt as bytes (a str as UTF-8), or None: read once, through the base types'
    own methods (what a subclass overrides is not asked)."""
    if salt is None:
        return None
    if isinstance(salt, str):
        return str.encode(salt, "utf-8")
    if isinstance(salt, (bytes, bytearray)):
        return bytes(memoryview(salt))
    raise TypeError(f"salt must be str, bytes or None, not {type(salt).__name__}")


cdef uint64_t salt_c(object salt) except? 0:
    """A request's namespace for prefix reuse: None (0), or the 64-bit hash of a str / bytes."""
    b = salt_bytes(salt)
    if b is None:
        return 0
    cdef uint64_t h = int.from_bytes(hashlib.blake2b(b, digest_size=8).digest(), "little")
    return h if h else 1   # 0 is no salt's


cdef object tokens_c(object tokens, str name="tokens"):
    """Token ids as a C-contiguous int32 copy owned by kvcache (ids in [0, 2**31))."""
    cdef Py_ssize_t n
    cdef int32_t[::1] ov
    f = _flat_ints(tokens)    # plain ints, or an int32 / int64 array: read once, straight into the copy
    if f is not None:
        n = len(f)
        if n >= UINT32_MAX:
            raise ValueError(f"{name}: too many tokens ({n})")
        out = np.empty(n, dtype=np.int32)
        if n:
            ov = out
            _ints_into(f, &ov[0], n, INT32_MAX, name)
        return out
    a = values_c(tokens, name, VALUES_INT)
    if a.shape[0] >= UINT32_MAX:
        raise ValueError(f"{name}: too many tokens ({a.shape[0]})")
    if a.shape[0] and (a.min() < 0 or a.max() > INT32_MAX):
        raise ValueError(f"{name} must hold token ids in [0, {INT32_MAX}], got values in [{a.min()}, {a.max()}]")
    return np.ascontiguousarray(a, dtype=np.int32)


cdef bytearray tokens_mem(object tokens, str name="tokens"):
    """tokens_c's copy as a bytearray of int32 (the per-request calls: no array object made)."""
    cdef Py_ssize_t n
    f = _flat_ints(tokens)
    if f is None:
        return bytearray(tokens_c(tokens, name))   # the general path, its checks and messages
    n = len(f)
    if n >= UINT32_MAX:
        raise ValueError(f"{name}: too many tokens ({n})")
    out = PyByteArray_FromStringAndSize(NULL, n * 4)
    if n:
        _ints_into(f, <int32_t *>PyByteArray_AS_STRING(out), n, INT32_MAX, name)
    return out


cdef inline const int32_t *mem_i32(bytearray b) noexcept:
    return <const int32_t *>PyByteArray_AS_STRING(b)


# The request of a prefix-reuse call (UnifiedCache2026's, ISWACache2026's, HybridCache's):
# prefix_match, prefix_attach, prefix_release, prefix_publish, prefix_pin.
cdef struct prefix_req:
    int32_t seq_id           # the sequence (calls that take one)
    uint64_t salt            # salt_c's
    const int32_t *tokens    # the tokens; NULL: none given (a keep then takes the cells' own)
    uint32_t n

# what an empty list of tokens points at: a keep given no tokens keeps nothing
cdef int32_t _NO_TOKENS = 0


cdef inline int _attach_c(kvc_unified *c, const prefix_req *q, const int32_t *pos, const int32_t *pos_x,
                          const int32_t *pos_y, uint32_t *k, kvc_err *err) noexcept nogil:
    """An attach of the request q (prefix_xy's positions)."""
    return kvc_retain_attach_xy(c, q.seq_id, q.salt, q.tokens, pos, pos_x, pos_y, q.n, k, err)


cdef inline int _keep_c(kvc_unified *c, const prefix_req *q, bint end, kvc_retained *res, kvc_err *err) noexcept nogil:
    """A release (end) or a publish of the request q."""
    if end:
        return kvc_retain_release(c, q.seq_id, q.salt, q.tokens, q.n, res, err)
    return kvc_retain_publish(c, q.seq_id, q.salt, q.tokens, q.n, res, err)


# prefix_args' seq_id for the calls that take none (a caller's None is refused as any non-int is)
cdef object NO_SEQ = object()


cdef bytearray prefix_args(prefix_req *q, object seq_id, uint32_t n_seq_max, object tokens, object salt,
                           bint keep=False):
    """q: a prefix-reuse call's arguments, checked in order: seq_id (NO_SEQ: the call takes none),
    tokens (keep: None allowed, the cells' own), salt. Returns the memory holding the tokens."""
    q.seq_id = -1 if seq_id is NO_SEQ else seq_c(seq_id, n_seq_max, "seq_id", False)
    t = None if keep and tokens is None else tokens_mem(tokens)
    q.salt = salt_c(salt)
    q.tokens = NULL
    q.n = 0
    if t is not None:
        q.n = <uint32_t>(len(t) // 4)
        if q.n:
            q.tokens = mem_i32(t)
        elif keep:
            q.tokens = &_NO_TOKENS
    return t


cdef object xy_c(object v, str name, Py_ssize_t n):
    """A request's positions or 2-D positions for prefix reuse: None, or int32 values, one per token."""
    if v is None:
        return None
    a = values_c(v, name, VALUES_INT)
    if a.shape[0] != n:
        raise ValueError(f"{name} must hold one value per token ({n}), got {a.shape[0]}")
    if n and (a.min() < INT32_MIN or a.max() > INT32_MAX):
        raise ValueError(f"{name} must hold values in [{INT32_MIN}, {INT32_MAX}]")
    return np.ascontiguousarray(a, dtype=np.int32)


cdef class _PrefixXY:
    """A request's positions as the prefix calls hand them to C (``pos``, ``pos_x`` / ``pos_y`` of
    prefix_match, prefix_attach and prefix_pin): the checked arrays, held, and pointers to them
    (NULL: 0, 1, ... for pos, zeros for pos_x / pos_y). prefix_xy makes one."""
    cdef const int32_t[::1] pv
    cdef const int32_t[::1] xv
    cdef const int32_t[::1] yv
    cdef const int32_t *p
    cdef const int32_t *x
    cdef const int32_t *y


# the positions of a request given none: every pointer NULL (shared: a _PrefixXY is never changed
# after prefix_xy returns it)
cdef _PrefixXY _NO_XY = _PrefixXY.__new__(_PrefixXY)
_NO_XY.p = _NO_XY.x = _NO_XY.y = NULL


cdef _PrefixXY prefix_xy(object pos, object pos_x, object pos_y, Py_ssize_t n, bint has_ext):
    """The positions of a request of n tokens to a cache whose cells carry the extension (has_ext;
    ValueError when they are given to one whose cells do not: its prompts sit at 0, 1, ...)."""
    if (pos is not None or pos_x is not None or pos_y is not None) and not has_ext:
        raise ValueError("pos / pos_x / pos_y: this cache's cells carry no 2-D positions (cell_ext=False); "
                         "its prompts sit at positions 0, 1, ...")
    if pos is None and pos_x is None and pos_y is None:
        return _NO_XY       # a request at 0, 1, ... (the common call): nothing to check or hold
    cdef _PrefixXY r = _PrefixXY.__new__(_PrefixXY)
    p, x, y = xy_c(pos, "pos", n), xy_c(pos_x, "pos_x", n), xy_c(pos_y, "pos_y", n)
    r.p = r.x = r.y = NULL
    if p is not None and n:
        r.pv = p
        r.p = &r.pv[0]
    if x is not None and n:
        r.xv = x
        r.x = &r.xv[0]
    if y is not None and n:
        r.yv = y
        r.y = &r.yv[0]
    return r


cdef inline uint64_t pin_of(uint32_t gen, uint32_t index) noexcept:
    """A pin as prefix_pin returns it (every cache's): the handle's generation in the high 32
    bits, its index (a prefix node, a checkpoint slot) below."""
    return (<uint64_t>gen << 32) | index


cdef object reuse_off(str what):
    """The error of a prefix-reuse call to a cache whose reuse is off (every cache kind's)."""
    return RuntimeError(f"{what}: prefix reuse is off for this cache (enable_prefix_reuse() turns it on)")


cdef long long pin_canon(object pin) except? -1:
    """A pin (pin_of) as prefix_unpin reads it, read once; TypeError / ValueError for what no pin
    can be."""
    return int_c(pin, "pin", 0, LLONG_MAX)


cdef tuple pin_pair(object pin):
    """The two halves of a composite cache's pin (one per part), each still to be read."""
    if not isinstance(pin, tuple):
        raise TypeError(f"pin must be a pin prefix_pin returned (a pair), not {type(pin).__name__}")
    if len(pin) != 2:
        raise ValueError(f"pin must be a pin prefix_pin returned (a pair), not {pin!r}")
    return pin[0], pin[1]


cdef int pin_arg(object pin, uint32_t *index, uint32_t *gen) except -1:
    """The handle of a pin (pin_of) prefix_unpin is given (pin_canon)."""
    cdef long long v = pin_canon(pin)
    index[0] = <uint32_t>(v & 0xFFFFFFFF)
    gen[0] = <uint32_t>(v >> 32)
    return 0


cdef object pins_of(const kvc_prefix_handle *h, uint32_t k):
    """The pin of a prefix pinned in k caches: pin_of its handle in one cache, the pair of them in
    an iSWA pair's two."""
    if k == 1:
        return pin_of(h[0].gen, h[0].node)
    return (pin_of(h[0].gen, h[0].node), pin_of(h[1].gen, h[1].node))


cdef int pins_arg(object pin, kvc_prefix_handle *h, uint32_t k) except -1:
    """The handles of a pin of k caches (pins_of's), each half read once."""
    if k == 1:
        return pin_arg(pin, &h[0].node, &h[0].gen)
    a, b = pin_pair(pin)
    pin_arg(a, &h[0].node, &h[0].gen)
    return pin_arg(b, &h[1].node, &h[1].gen)


cdef class _DryRun:
    """prepare()'s dry run in one cache of today's semantics: the ubatches checked and the
    result's arrays made before the cache is locked, run() under the lock (no Python code runs
    there: an iSWA pair runs both caches' dry runs as one operation), result() after it."""
    cdef list ubs
    cdef kvc_ubatch *arr
    cdef uint32_t n_ub
    cdef object cells, strm, groups
    cdef int32_t[::1] oc
    cdef uint32_t[::1] os_
    cdef uint32_t[::1] og
    cdef uint32_t ns
    cdef int r                     # kvc_unified_prepare_2026's: 1 all placed, 0 one did not fit, < 0 error
    cdef kvc_err err

    def __dealloc__(self):
        free(self.arr)

    cdef void run(self, kvc_unified *c) noexcept nogil:
        self.r = kvc_unified_prepare_2026(c, self.arr, self.n_ub, &self.oc[0], &self.os_[0], &self.og[0], &self.err)

    cdef object result(self):
        """The slot_infos (UnifiedCache2026.prepare), or None when one did not fit."""
        cdef UBatch ub
        cdef Py_ssize_t u, off = 0
        if self.r < 0:
            raise_status(self.r, &self.err, "prepare")
        if self.r == 0:
            return None
        out = []
        for u in range(self.n_ub):
            ub = self.ubs[u]
            ng = int(self.groups[u])
            nst = ub.c.n_tokens // ng
            out.append([(int(self.strm[u * self.ns + g]), self.cells[off + g * nst:off + (g + 1) * nst].copy())
                        for g in range(ng)])
            off += ub.c.n_tokens
        return out


cdef _DryRun _dry_run(_Unified c, list ubs):
    """The dry run of ubs in c, every ubatch checked (ValueError, TypeError), not run yet."""
    cdef Py_ssize_t n_ub = len(ubs), u, total = 0
    cdef _DryRun d = _DryRun.__new__(_DryRun)
    if n_ub == 0:
        raise ValueError("prepare needs at least one ubatch")
    for u in range(n_ub):
        if not isinstance(ubs[u], UBatch):
            raise TypeError(f"ubatches[{u}] must be a UBatch, not {type(ubs[u]).__name__}")
        (<UBatch>ubs[u]).check(c.c.n_seq_max, kvc_unified_has_ext(&c.c))
        total += (<UBatch>ubs[u]).c.n_tokens
    d.ubs = ubs
    d.n_ub = <uint32_t>n_ub
    d.ns = c.c.n_stream
    d.err.msg[0] = 0
    d.cells = np.zeros(max(total, 1), dtype=np.int32)
    d.strm = np.zeros(n_ub * d.ns, dtype=np.uint32)
    d.groups = np.zeros(n_ub, dtype=np.uint32)
    d.oc, d.os_, d.og = d.cells, d.strm, d.groups
    d.arr = <kvc_ubatch *>malloc(n_ub * sizeof(kvc_ubatch))
    if d.arr == NULL:
        raise MemoryError("prepare")
    for u in range(n_ub):
        d.arr[u] = (<UBatch>ubs[u]).c
    return d


cdef class _Unified2026(_Unified):
    """Today's unified cache (kvcache.UnifiedCache2026 is the documented public class)."""

    __signature__ = _signatures.ClassSignature(_signatures.unified)   # semantics None: "2026"
    cdef object _spill_sink        # write-back at eviction: called with the evicted prompts, or None

    cdef tuple _v_trans_shape(self, Py_ssize_t n_embd_v):
        return (<Py_ssize_t>self.c.n_stream, n_embd_v, <Py_ssize_t>self.c.cells.size)

    cdef uint32_t _n_kv(self, uint32_t s) noexcept nogil:
        return kvc_unified_stream_n_kv(&self.c, s)

    cdef int _place(self, const kvc_ubatch *ub, kvc_err *err) noexcept nogil:
        return kvc_unified_find_slot_2026(&self.c, ub, err)

    # the cimport API's placement is find_slot's (kvc_unified_find_slot_2026)
    cdef int find_slot_c(self, const kvc_ubatch *ub) noexcept nogil:
        return kvc_unified_find_slot_2026(&self.c, ub, NULL)

    # --- placement -----------------------------------------------------------------------
    def find_slot(self, ub):
        """Place the ubatch for good, as today's llama.cpp does (find_slot(cont=false) +
        apply_ubatch): each token group goes to usable cells of its stream from the stream's
        head on, wrapping, not necessarily contiguous (slot_info() tells where); a cell whose one
        sequence's sliding window has left it is reused, and that sequence loses its positions
        up to the one overwritten. Returns True when placed, False when there is no room (then
        nothing changed); prepare() is the dry run. With several streams the tokens of each
        sequence must be together, one id per token, every sequence with as many tokens
        (ValueError otherwise)."""
        cdef UBatch u = ubatch_c(ub)
        cdef int r = 0
        cdef kvc_err err
        err.msg[0] = 0
        u.check(self.c.n_seq_max, kvc_unified_has_ext(&self.c))
        lock(&self._lock, CHANGE, "find_slot")
        try:
            if short_work(u.c.n_tokens):
                r = self._place(&u.c, &err)
            else:
                with nogil:
                    r = self._place(&u.c, &err)
        finally:
            unlock(&self._lock, CHANGE)
        self._spill_drain()
        if r < 0:
            raise_status(r, &err, "find_slot")
        return r == 1

    def place_seqs(self, pos, n_tokens=1, n_seqs=1):
        """Place, for good, positions ``pos .. pos + n_tokens - 1`` of each of the sequences
        ``0 .. n_seqs - 1`` (a batch of equal rows: row s is sequence s), in one call and
        without a UBatch: the ubatch whose token ``j * n_seqs + s`` is sequence s at position
        ``pos + j`` (one token per group), placed by find_slot.

        Returns the cell of the first token when the tokens' cells are consecutive in token
        order, -1 when they are scattered (``slot_indices()`` lists them), None when there is
        no room (nothing placed)."""
        try:
            return self._place_seqs(pos, n_tokens, n_seqs)
        finally:
            self._spill_drain()

    def slot_info(self):
        """Where the last successful find_slot put each token, per token group: a list of
        ``(stream, int32 cells)`` — token ``g * n_seq_tokens + i`` of group g in cell
        ``cells[i]`` of the group's stream; ``[]`` when no placement is current."""
        cdef uint32_t g, ng, nst
        lock(&self._lock, RUNS_PYTHON, "slot_info")
        try:
            cells = self._slot_cells()
            if not len(cells):
                return []
            ng, nst = self.c.scatter.n_groups, self.c.scatter.n_seq_tokens
            return [(<int>self.c.scatter.strm[g], cells[g * nst:(g + 1) * nst].copy()) for g in range(ng)]
        finally:
            unlock(&self._lock, RUNS_PYTHON)

    def prepare(self, ubatches):
        """The dry run of placing several ubatches in turn: the slot_info()
        each would get, found against the state holding the ubatches before it (placements
        and the cells they reuse), or None when one does not fit. The cache is left exactly as
        it was, its prefix index included: a ubatch that fits only by evicting held prefixes gets
        the cells the real placement would give it after evicting them, yet nothing is evicted
        (nor written back). Every ubatch is checked first (ValueError, nothing changed)."""
        cdef _DryRun d = _dry_run(self, _items(ubatches))
        lock(&self._lock, CHANGE, "prepare")
        try:
            with nogil:
                d.run(&self.c)
        finally:
            unlock(&self._lock, CHANGE)
        return d.result()

    # --- stream copies -------------------------------------------------------------------
    @property
    def pending_copies(self):
        """Stream copies queued by seq_cp across streams for the next update()."""
        return self.c.n_copies

    # --- graph inputs --------------------------------------------------------------------
    def kq_mask(self, ub, causal=True, alibi=False, out=None, dtype="f32", pad=None, reuse=False):
        """The KQ mask of ub against the cache, as today's llama.cpp builds it: [streams, rows,
        n_kv] without padding rows (pad None or False), a block of rows per token group over the
        cells of the group's stream (streams 1 and rows n_tokens with one stream), n_kv the
        largest n_kv_per_stream of those streams.

        dtype "f32" (default) or "f16": 0 where token t sees cell j (-|p_cell - p_token| with
        alibi), -inf elsewhere; "bool": True where it sees the cell (torch's
        scaled_dot_product_attention reads a bool attn_mask the same way: True takes part).
        out: a writable C-contiguous array of that dtype (a numpy array, a buffer-protocol
        object or a CPU tensor) of exactly that shape, written and returned.

        reuse=True (a decode loop's mask): out holds the mask this cache last wrote into it,
        untouched since. When this call's mask has the same shape there (dtype, shape, causal,
        the ubatch's token groups and streams), only what changed is rewritten: the cells whose
        position or sequences changed since, and whole rows whose sequence or window start
        moved; anything else (ALiBi, another buffer or shape, a cache restored from a state,
        more changes than a full write costs) writes the whole mask. The result is always equal
        to a fresh mask."""
        cdef UBatch u = ubatch_c(ub)
        cdef bint c_causal = bool_c(causal, "causal"), c_alibi = bool_c(alibi, "alibi")
        cdef bint c_pad = False if pad is None else bool_c(pad, "pad")
        cdef bint c_reuse = bool_c(reuse, "reuse")
        mdt, npdt = _mask_dtype(dtype)
        u.check(self.c.n_seq_max, kvc_unified_has_ext(&self.c))
        if c_reuse and out is None:
            raise ValueError("kq_mask: reuse=True needs out (the buffer of the previous mask)")
        if c_pad:
            raise ValueError("kq_mask: a cache of semantics '2026' has no padding rows (pad=False)")
        return self._kq_mask(u, c_causal, c_alibi, mdt, npdt, out, c_reuse)

    cdef object _kq_mask(self, UBatch ub, bint causal, bint alibi, int mdt, object npdt, object out, bint reuse):
        cdef uint32_t strm[256]      # KVC_MAX_SEQ groups at most
        cdef uint32_t ng = 0, nst = 0, n_kv
        cdef kvc_err err
        cdef int r = 0
        cdef uint8_t[::1] o
        cdef void *p = NULL
        cdef _HeldBuffer ob = None
        err.msg[0] = 0
        if out is not None:
            ob = hold_buffer(out, "out", True)
            if (ob.dtype is not npdt and ob.dtype != npdt) or not ob.c_contiguous() or ob.view.ndim != 3:
                raise ValueError(f"out must be a writable C-contiguous {npdt} array of shape "
                                 f"(streams, rows, n_kv), got {ob.describe()}")
        lock(&self._lock, RUNS_PYTHON, "kq_mask")
        try:
            r = kvc_unified_groups(&self.c, &ub.c, strm, &ng, &nst, &err)
            if r < 0:
                raise_status(r, &err, "kq_mask")
            n_kv = kvc_unified_kq_mask_2026_n_kv(&self.c, strm, ng)
            shape = (<Py_ssize_t>ng, <Py_ssize_t>nst, <Py_ssize_t>n_kv)
            if ob is None:
                out = np.empty(shape, dtype=npdt)
                if out.size:
                    o = out.reshape(-1).view(np.uint8)
                    p = &o[0]
            else:
                if (ob.dim(0), ob.dim(1), ob.dim(2)) != shape:
                    raise ValueError(f"out must be a writable C-contiguous {npdt} array of shape "
                                     f"{shape}, got {ob.describe()}")
                p = ob.view.buf
            if n_kv:
                with nogil:
                    r = kvc_unified_kq_mask_2026_reuse(&self.c, &ub.c, causal, alibi, mdt, p, reuse, &err)
        finally:
            unlock(&self._lock, RUNS_PYTHON)
            if ob is not None:
                ob.release()
        if r < 0:
            raise_status(r, &err, "kq_mask")
        return out

    # --- update --------------------------------------------------------------------------
    def update(self, rope=None, n_max_nodes=65536):
        """Apply the queued stream copies (seq_cp across streams), then the pending K-shift, as
        today's llama.cpp's update does (it does not defragment).

        rope: the model's RopeParams (default: the ones given to the constructor, for a cache
        holding K): every stream's K is rotated in place by each cell's shift, with the layer's
        freq_base / freq_scale overrides (needs n_embd_head_k from the constructor). Without
        any, the model has no RoPE and the shifts are dropped. A metadata-only cache copies and
        rotates nothing: the returned StreamUpdate says what to apply to your own K/V memory.

        Returns a :class:`StreamUpdate` (true when anything changed). Arguments are checked
        before anything changes."""
        cdef int32_t nmax = <int32_t>int_c(n_max_nodes, "n_max_nodes", INT32_MIN, INT32_MAX)
        self._check_update(rope, n_max_nodes)
        return self._update(rope, nmax)

    cdef object _update(self, object rope, int32_t nmax):
        # today's update(): the stream copies, then the K-shift (rotated with RoPE when the
        # model has it and the cache holds K, else the shifts are dropped), all or nothing
        lock(&self._lock, RUNS_PYTHON | CHANGE, "update")
        try:
            return _update_caches((self,), rope, nmax)[0]
        finally:
            unlock(&self._lock, RUNS_PYTHON | CHANGE)

    # --- prefix reuse (docs/prefix-reuse.md; csrc/kvc_reuse.h, kvc_retain.h) -------------------
    cdef kvc_reuse *_reuse(self, str what) except NULL:
        # under the cache's lock: another thread's disable_prefix_reuse frees the index
        if self.c.reuse == NULL:
            raise reuse_off(what)
        return <kvc_reuse *>self.c.reuse

    def enable_prefix_reuse(self, cap=0):
        """Keep finished requests' cells for later ones: from now on :meth:`prefix_release`
        hands a sequence's cells to the cache's prefix index instead of freeing them, and
        :meth:`prefix_attach` starts a new sequence from the longest prefix it holds.

        ``cap``: the most cells the index may hold (0: no cap other than the cache). Cells the
        index holds for no live sequence belong to no sequence (no mask shows them, no state
        holds them, ``used`` does not count them) and placement evicts them, least recently
        used first, when it needs room. Calling it again sets the cap. With ``cell_ext`` a held
        cell serves a request only where it carries the request's 2-D position (``pos_x``,
        ``pos_y`` of prefix_match / prefix_attach) and position (``pos``) and, with ``ple_token``,
        the token as its per-layer-embedding input; a prompt with images (several tokens at one
        position) is kept through them (docs/prefix-reuse.md)."""
        cdef uint32_t ccap = <uint32_t>int_c(cap, "cap", 0, UINT32_MAX)
        cdef kvc_err err
        cdef int r
        err.msg[0] = 0
        lock(&self._lock, CHANGE, "enable_prefix_reuse")
        try:
            r = self._reuse_enable(ccap, &err)
        finally:
            unlock(&self._lock, CHANGE)
        check_status(r, &err, "enable_prefix_reuse")

    cdef int _reuse_enable(self, uint32_t cap, kvc_err *err) noexcept nogil:
        # the index on, or its cap set (the cells past it evicted); the caller holds the lock
        return kvc_reuse_enable(&self.c, cap, err)

    def disable_prefix_reuse(self):
        """Turn prefix reuse off: the index forgets every prefix (its cells become free)."""
        lock(&self._lock, CHANGE, "disable_prefix_reuse")
        try:
            sink = self._reuse_off()     # let go of after the unlock
        finally:
            unlock(&self._lock, CHANGE)

    cdef object _reuse_off(self):
        """The index off (the caller holds the lock); returns the write-back sink it let go of,
        for the caller to drop after unlocking (its finalizer may call the cache). Nothing is
        allocated: no Python code runs in the middle of the caller's operation."""
        kvc_reuse_disable(&self.c)
        sink = self._spill_sink
        self._spill_sink = None
        return sink

    @property
    def prefix_reuse(self):
        """Whether prefix reuse is on (:meth:`enable_prefix_reuse`)."""
        return self.c.reuse != NULL

    @property
    def prefix_stats(self):
        """The prefix index now: ``{"cells": held cells, "evictable": cells of prefixes no live
        sequence or pin protects, "nodes": radix-tree edges, "cap": the cap (0: none)}``; None
        while reuse is off."""
        cdef kvc_reuse *r
        lock(&self._lock, RUNS_PYTHON, "prefix_stats")
        try:
            if self.c.reuse == NULL:
                return None
            r = <kvc_reuse *>self.c.reuse
            return {"cells": int(kvc_reuse_n_cells(&self.c)), "evictable": int(r.idx.n_evictable),
                    "nodes": int(r.idx.n_nodes), "cap": int(r.idx.cap)}
        finally:
            unlock(&self._lock, RUNS_PYTHON)

    def prefix_match(self, tokens, salt=None, *, pos=None, pos_x=None, pos_y=None):
        """How many leading tokens of a new request the index holds under ``salt`` (what
        :meth:`prefix_attach` would attach), at most ``len(tokens) - 1``: the last token is
        always computed, for its logits. 0 while reuse is off. The prefix counts as used.
        ``pos``, ``pos_x``, ``pos_y``: with ``cell_ext``, the position (None: 0, 1, ...) and 2-D
        position (None: zeros) the request places each token at, as its ubatches carry them (an
        image's tokens share a position), which a held cell must carry to count."""
        cdef prefix_req q
        t = prefix_args(&q, NO_SEQ, 0, tokens, salt)
        cdef uint32_t r
        cdef _PrefixXY xy = prefix_xy(pos, pos_x, pos_y, q.n, kvc_unified_has_ext(&self.c))
        lock(&self._lock, CHANGE, "prefix_match")
        try:
            with nogil:
                r = kvc_retain_match_xy(&self.c, q.salt, q.tokens, xy.p, xy.x, xy.y, q.n)
        finally:
            unlock(&self._lock, CHANGE)
        return int(r)

    def prefix_attach(self, seq_id, tokens, salt=None, *, pos=None, pos_x=None, pos_y=None):
        """Start sequence ``seq_id`` (which must hold no cell) from the longest prefix of
        ``tokens`` the index holds under ``salt``, at most ``len(tokens) - 1`` tokens: those
        cells join the sequence at positions ``0 .. k - 1`` without copying K/V, and the prefix
        is not evicted while the sequence holds it. Returns k: compute ``tokens[k:]`` at
        positions ``k ..``. With a stream per sequence (``kv_unified=False``) a prefix held in
        another stream is brought over by a stream copy, which the next :meth:`update` performs
        (as :meth:`seq_cp` across streams). ``pos``, ``pos_x``, ``pos_y``: as prefix_match (the
        cells attached get them back: with ``cell_ext`` the k cells sit at ``pos[:k]``, and
        ``tokens[k:]`` are computed at ``pos[k:]``)."""
        cdef prefix_req q
        t = prefix_args(&q, seq_id, self.c.n_seq_max, tokens, salt)
        cdef uint32_t k = 0
        cdef kvc_err err
        cdef int r
        err.msg[0] = 0
        cdef _PrefixXY xy = prefix_xy(pos, pos_x, pos_y, q.n, kvc_unified_has_ext(&self.c))
        lock(&self._lock, CHANGE, "prefix_attach")
        try:
            self._reuse("prefix_attach")
            if short_work(q.n):
                r = _attach_c(&self.c, &q, xy.p, xy.x, xy.y, &k, &err)
            else:
                with nogil:
                    r = _attach_c(&self.c, &q, xy.p, xy.x, xy.y, &k, &err)
        finally:
            unlock(&self._lock, CHANGE)
        check_status(r, &err, "prefix_attach")
        return int(k)

    def prefix_release(self, seq_id, tokens=None, salt=None):
        """End sequence ``seq_id``, keeping its cells for later requests: the cells of its
        leading tokens (positions 0, 1, ... each in a cell not moved since it was computed)
        go to the index under ``salt``, then the sequence leaves every cell (as
        ``seq_rm(seq_id)``). A cell's token is the one its ubatch carried (``tokens=`` of
        UBatch / Batch); ``tokens`` here, when given, supplies the tokens of cells placed
        without them and bounds what is kept (a cell whose recorded token differs ends it).
        With ``cell_ext`` the prompt's tokens are its cells in the order they see each other:
        by position, the tokens of one position (an image's) by 2-D position, row by row, and
        a position after an image one past its largest ``pos_x`` or ``pos_y`` (M-RoPE's layout).

        Returns the number of leading tokens the index now holds (0 when it could not keep
        them: the cap is taken by pinned or attached prefixes). Without reuse on, RuntimeError."""
        return self._keep(seq_id, tokens, salt, True, "prefix_release")

    def prefix_publish(self, seq_id, tokens=None, salt=None):
        """Hand what sequence ``seq_id`` holds so far to the index while it goes on (a long
        prompt other requests should attach to before it ends): the cells it would keep on
        :meth:`prefix_release` become the index's too, shared as :meth:`seq_cp` shares cells,
        and the sequence holds the prefix as an attached sequence does (not evicted while it
        has cells). Cells it later removes stay in the index (their K/V do not change); cells
        it moves (``seq_add``, ``seq_div``) the index forgets. ``tokens``, ``salt`` and the
        result as prefix_release's; publishing again later adds what was computed since."""
        return self._keep(seq_id, tokens, salt, False, "prefix_publish")

    cdef object _keep(self, seq_id, tokens, salt, bint end, str what):
        cdef prefix_req q
        t = prefix_args(&q, seq_id, self.c.n_seq_max, tokens, salt, True)
        cdef kvc_retained res
        cdef kvc_err err
        cdef int r
        err.msg[0] = 0
        lock(&self._lock, CHANGE, what)
        try:
            self._reuse(what)
            if short_work(kvc_retain_seq_cells(&self.c, q.seq_id)):
                r = _keep_c(&self.c, &q, end, &res, &err)
            else:
                with nogil:
                    r = _keep_c(&self.c, &q, end, &res, &err)
        finally:
            unlock(&self._lock, CHANGE)
        self._spill_drain()
        check_status(r, &err, what)
        return int(res.n_kept)

    def prefix_pin(self, tokens, salt=None, *, pos=None, pos_x=None, pos_y=None):
        """Keep the prefix ``tokens`` (all of which the index must hold: ValueError otherwise)
        from eviction until :meth:`prefix_unpin` (a system prompt, say). Returns the pin, an
        opaque int. Pins count: a prefix pinned twice needs two unpins. ``pos``, ``pos_x``,
        ``pos_y``: as prefix_match."""
        cdef prefix_req q
        t = prefix_args(&q, NO_SEQ, 0, tokens, salt)
        cdef kvc_prefix_handle h
        cdef kvc_err err
        cdef int r
        err.msg[0] = 0
        cdef _PrefixXY xy = prefix_xy(pos, pos_x, pos_y, q.n, kvc_unified_has_ext(&self.c))
        lock(&self._lock, CHANGE, "prefix_pin")
        try:
            self._reuse("prefix_pin")
            r = kvc_retain_pin_xy(&self.c, q.salt, q.tokens, xy.p, xy.x, xy.y, q.n, &h, &err)
        finally:
            unlock(&self._lock, CHANGE)
        check_status(r, &err, "prefix_pin")
        return pin_of(h.gen, h.node)

    def prefix_unpin(self, pin):
        """Let go of a pin :meth:`prefix_pin` returned (ValueError for anything else)."""
        cdef kvc_prefix_handle h
        cdef kvc_err err
        cdef int r
        err.msg[0] = 0
        pin_arg(pin, &h.node, &h.gen)
        lock(&self._lock, CHANGE, "prefix_unpin")
        try:
            self._reuse("prefix_unpin")
            r = kvc_retain_unpin(&self.c, h, &err)
        finally:
            unlock(&self._lock, CHANGE)
        check_status(r, &err, "prefix_unpin")

    def prefix_evict(self, n_cells):
        """Evict up to ``n_cells`` cells from the index now (least recently used prefixes no
        live sequence or pin protects, leaves first); returns how many went."""
        cdef uint32_t n = <uint32_t>int_c(n_cells, "n_cells", 0, UINT32_MAX), r
        lock(&self._lock, CHANGE, "prefix_evict")
        try:
            self._reuse("prefix_evict")
            r = kvc_reuse_evict(&self.c, n)
        finally:
            unlock(&self._lock, CHANGE)
        self._spill_drain()
        return int(r)

    # --- write-back at eviction (kvcache.store.PrefixStore.write_back; csrc/kvc_prefix.h) -------
    def _spill_set(self, sink, min_len=1):
        """Write-back at eviction: with a callable sink, every prompt the index evicts (at least
        min_len tokens) is recorded inside the placement, and after the operation (find_slot,
        place_seqs, prefix_release, prefix_publish, prefix_evict; an iSWA or hybrid
        cache's own placements too) ``sink(cache, records)`` is called with a list of ``(salt
        hash, tokens, cells, streams, ext)`` (int32 arrays; the prompt's tokens from position 0
        (with ``cell_ext``, up to its first image),
        the cells holding them and their streams, whose K/V are intact until new rows are
        stored; cells at or past ``size`` are ghosts of a SWA cache's window mode, which name no
        cell; ext: each cell's (x, y, token) as the index took it, with ``cell_ext``, else
        None), exceptions it raises ignored; sink None: off."""
        cdef uint32_t m = <uint32_t>int_c(min_len, "min_len", 1, UINT32_MAX)
        cdef kvc_err err
        cdef int r
        err.msg[0] = 0
        sink = spill_sink_arg(sink)
        lock(&self._lock, CHANGE, "write_back")
        try:
            r = kvc_prefix_spill_set(&self._reuse("write_back").idx, sink is not None, m, &err)
        finally:
            unlock(&self._lock, CHANGE)
        check_status(r, &err, "write_back")
        self._spill_sink = sink

    cdef int _spill_drain(self) except -1:
        # the prompts the operation just evicted to the sink, if one is set (after every operation
        # that places or evicts); the records are built apart, so that the common call (no sink)
        # sets up none of their memoryviews
        if self._spill_sink is None:
            return 0
        return self._spill_deliver()

    cdef int _spill_deliver(self) except -1:
        # the index is read under the lock: another thread may have dropped it since the operation
        cdef kvc_reuse *ru
        cdef kvc_prefix_spill *sp
        cdef uint32_t k, a, b, j
        cdef int32_t[::1] tv
        cdef int32_t[::1] cv
        cdef int32_t[::1] sv
        cdef int32_t[:, ::1] ev
        cdef const kvc_cell_ext *e
        out = []
        lock(&self._lock, RUNS_PYTHON, "write_back")
        try:
            ru = <kvc_reuse *>self.c.reuse
            if ru == NULL or ru.idx.spill == NULL or ru.idx.spill.n == 0:
                return 0
            sp = ru.idx.spill
            sink = self._spill_sink
            for k in range(sp.n):
                a, b = sp.start[k], sp.start[k + 1]
                if ru.pos != NULL:
                    # a store's prompt sits at positions 0, 1, ...: one with images is written up
                    # to its first (its tokens share a position, the positions after it jump);
                    # every token the index holds has its position, a ghost's too (window mode)
                    for j in range(b - a):
                        if ru.pos[kvc_reuse_at(ru, sp.strm[a + j], sp.cell[a + j])] != <int32_t>j:
                            b = a + j
                            break
                    if b == a:
                        continue
                toks = np.empty(b - a, dtype=np.int32)
                cells = np.empty(b - a, dtype=np.int32)
                strms = np.empty(b - a, dtype=np.int32)
                tv = toks
                cv = cells
                sv = strms
                for j in range(b - a):
                    tv[j] = sp.tok[a + j]
                    cv[j] = <int32_t>sp.cell[a + j]
                    sv[j] = <int32_t>sp.strm[a + j]
                ext = None
                if ru.ext != NULL:
                    # the held tokens' extensions as the index took them (the table reset them)
                    ext = np.zeros((b - a, 3), dtype=np.int32)
                    ev = ext
                    for j in range(b - a):
                        e = &ru.ext[kvc_reuse_at(ru, sp.strm[a + j], sp.cell[a + j])]
                        ev[j, 0], ev[j, 1], ev[j, 2] = e.x, e.y, e.tok
                out.append((int(sp.salt[k]), toks, cells, strms, ext))
            kvc_prefix_spill_clear(&ru.idx)
        finally:
            unlock(&self._lock, RUNS_PYTHON)
        return spill_deliver(sink, self, out)

    @property
    def _spill_lost(self):
        """Evicted prompts write-back at eviction could not record (no memory)."""
        cdef kvc_reuse *ru
        lock(&self._lock, READ, "_spill_lost")
        try:
            ru = <kvc_reuse *>self.c.reuse
            return 0 if ru == NULL or ru.idx.spill == NULL else int(ru.idx.spill.n_lost)
        finally:
            unlock(&self._lock, READ)

    def _prefix_check(self):
        """Raise RuntimeError unless the prefix index and the cells agree (for tests)."""
        cdef kvc_err err
        cdef int r
        err.msg[0] = 0
        lock(&self._lock, READ, "_prefix_check")
        try:
            r = kvc_reuse_check(&self.c, &err)
        finally:
            unlock(&self._lock, READ)
        if r != KVC_OK:
            raise RuntimeError(err.msg.decode())


cdef inline int spill_flush(object part) except -1:
    # a part's pending write-back records to its sink: an iSWA or hybrid cache's placement ran in C
    # past the part's own methods
    if isinstance(part, _Unified2026):
        (<_Unified2026>part)._spill_drain()
    return 0
