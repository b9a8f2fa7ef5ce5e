# Attention indices: the cells each query token group of a placed ubatch attends to, as the CSR
# arrays paged-attention kernels take (csrc/kvc_attn.h); UnifiedCache.attention_indices and
# ISWACache.attention_indices call _attention_indices.

from libc.string cimport memset
from kvcache.includes.kvc_attn cimport kvc_attn, kvc_unified_attn_indices


class AttentionIndices(_namedtuple("AttentionIndices",
                                   "qo_indptr kv_indptr kv_indices causal stream kv_pos q_pos n_kv span")):
    """The cells each query token group of a ubatch attends to (UnifiedCache.attention_indices).

    - ``qo_indptr`` (int32, groups + 1): group g is the ubatch's tokens
      ``qo_indptr[g] .. qo_indptr[g + 1] - 1``;
    - ``kv_indptr`` (int32, groups + 1) and ``kv_indices`` (int32): group g attends to the K/V
      rows ``kv_indices[kv_indptr[g]:kv_indptr[g + 1]]`` (row ``stream * size + cell``, the
      rows of the cache's ``k(il)`` / ``v(il)``), ordered by position;
    - ``causal`` (bool, groups): True: token i of a group of q tokens and L rows sees its first
      ``L - q + i + 1`` rows (a kernel's causal rule with the queries as the last q keys,
      FlashInfer's ``causal=True``); False: every token of the group sees every row of it. A
      causal call has only causal groups of several tokens, a non-causal one none;
    - ``stream`` (int32, groups): each group's stream (0 with one);
    - ``kv_pos`` (int32, like kv_indices) each row's position and ``q_pos`` (int32, tokens)
      each query token's (ALiBi's distance of token t to row e is ``|kv_pos[e] - q_pos[t]|``,
      the mask's ``alibi=True`` values), or None when not asked for;
    - ``n_kv``: the KQ mask's columns (every cell is below it);
    - ``span``: the K/V rows the indices reach, ``max(kv_indices) + 1`` (0 with none): the rows
      a dense kernel over them reads.

    ``AttentionIndices.buffers(n_groups, n_indices)`` makes arrays for ``out=``."""

    __slots__ = ()

    @classmethod
    def buffers(cls, n_groups, n_indices, positions=False, n_tokens=None):
        """Arrays with room for n_groups groups (at most the ubatch's tokens) and n_indices
        indices (at most n_groups x the cells of a stream), for ``attention_indices(out=...)``
        to fill step after step; with positions, kv_pos and q_pos too (q_pos: room for
        n_tokens tokens, default n_groups)."""
        g = int_arg(n_groups, "n_groups", 0, INT32_MAX - 1)
        n = int_arg(n_indices, "n_indices", 0, INT32_MAX)
        t = g if n_tokens is None else int_arg(n_tokens, "n_tokens", 0, INT32_MAX)
        pos = bool_c(positions, "positions")
        return cls(np.zeros(g + 1, np.int32), np.zeros(g + 1, np.int32), np.zeros(n, np.int32),
                   np.zeros(g, np.bool_), np.zeros(g, np.int32), np.zeros(n, np.int32) if pos else None,
                   np.zeros(t, np.int32) if pos else None, 0, 0)


# the arrays of an out= AttentionIndices: (field, dtype, what it counts, extra entries)
_I32, _BOOL = np.dtype(np.int32), np.dtype(np.bool_)
_GROUPS, _INDICES, _TOKENS = 0, 1, 2
_ATTN_FIELDS = (("qo_indptr", _I32, _GROUPS, 1), ("kv_indptr", _I32, _GROUPS, 1), ("kv_indices", _I32, _INDICES, 0),
                ("causal", _BOOL, _GROUPS, 0), ("stream", _I32, _GROUPS, 0), ("kv_pos", _I32, _INDICES, 0),
                ("q_pos", _I32, _TOKENS, 0))
_ATTN_POSITIONS = ("kv_pos", "q_pos")


cdef int _attn_bind(kvc_attn *a, object bufs, bint positions, list held, dict arrays) except -1:
    """Point a's arrays at bufs' (an AttentionIndices), each read once (into arrays, by name),
    checked and held (into held), and set its room; kv_pos and q_pos only with positions. Arrays
    that share memory are refused (the indices would overwrite each other)."""
    cdef _HeldBuffer hb
    cdef void *ptrs[7]
    cdef Py_ssize_t cap[3]
    cdef Py_ssize_t k, j
    cdef list spans = []
    memset(ptrs, 0, sizeof(ptrs))
    cap[0] = cap[1] = cap[2] = INT32_MAX
    for k, (name, dt, counts, extra) in enumerate(_ATTN_FIELDS):
        if name in _ATTN_POSITIONS and not positions:
            continue
        arr = getattr(bufs, name)
        if arr is None:
            raise ValueError(f"out.{name} must be a writable 1-D {dt} array (positions=True needs "
                             f"one), got None")
        hb = hold_buffer(arr, f"out.{name}", True)
        held.append(hb)
        if (hb.dtype is not dt and hb.dtype != dt) or hb.view.ndim != 1 or not hb.c_contiguous():
            raise ValueError(f"out.{name} must be a writable contiguous 1-D {dt} array, "
                             f"got {hb.describe()}")
        lo = <size_t>hb.view.buf
        for other, o_lo, o_hi in spans:
            if hb.view.len and lo < o_hi and o_lo < lo + <size_t>hb.view.len:
                raise ValueError(f"out.{name} and out.{other} share memory: each needs arrays of its own")
        spans.append((name, lo, lo + <size_t>hb.view.len))
        arrays[name] = arr
        ptrs[k] = hb.view.buf
        cap[counts] = min(cap[counts], hb.dim(0) - extra)
    a.qo_indptr = <int32_t *>ptrs[0]
    a.kv_indptr = <int32_t *>ptrs[1]
    a.kv_indices = <int32_t *>ptrs[2]
    a.causal = <uint8_t *>ptrs[3]
    a.stream = <int32_t *>ptrs[4]
    a.kv_pos = <int32_t *>ptrs[5]
    a.q_pos = <int32_t *>ptrs[6]
    a.cap_groups = <uint32_t>max(cap[_GROUPS], 0)
    a.cap_nnz = <uint32_t>cap[_INDICES]
    a.cap_tokens = <uint32_t>cap[_TOKENS]
    return 0


cdef object _attention_indices(_Unified cache, object ub, object causal, object positions, object out):
    """UnifiedCache.attention_indices (the checks, then the C call under the cache's lock)."""
    cdef UBatch u = ubatch_c(ub)
    cdef bint c_causal = bool_c(causal, "causal"), c_pos = bool_c(positions, "positions")
    cdef kvc_attn a
    cdef kvc_err err
    cdef int r = 0
    cdef list held = []
    cdef dict arrays = {}     # out's arrays as bound (each read once)
    err.msg[0] = 0
    memset(&a, 0, sizeof(a))
    u.check(cache.c.n_seq_max, kvc_unified_has_ext(&cache.c))
    if out is not None and not isinstance(out, AttentionIndices):
        raise TypeError(f"out must be a kvcache.AttentionIndices (AttentionIndices.buffers makes one), "
                        f"not {type(out).__name__}")
    try:
        if out is not None:
            # taken before the lock: an exporter's hooks see the cache as any other call would
            _attn_bind(&a, out, c_pos, held, arrays)
        lock(&cache._lock, RUNS_PYTHON, "attention_indices")
        try:
            with nogil:
                r = kvc_unified_attn_indices(&cache.c, &u.c, c_causal, &a, &err)
            if r == KVC_E_NOSPACE and out is None:
                # the counts are known: arrays of that size (never empty), and the same call into them
                out = AttentionIndices.buffers(max(a.n_groups, 1), max(a.nnz, 1), c_pos, max(u.c.n_tokens, 1))
                _attn_bind(&a, out, c_pos, held, arrays)
                with nogil:
                    r = kvc_unified_attn_indices(&cache.c, &u.c, c_causal, &a, &err)
        finally:
            unlock(&cache._lock, RUNS_PYTHON)
    finally:
        for hb in held:
            (<_HeldBuffer>hb).release()
    if r == KVC_E_NOSPACE:
        need = (a.n_groups, a.nnz, u.c.n_tokens)
        short = [f"out.{name} has {len(arrays[name])} entries, needs {need[counts] + extra}"
                 for name, dt, counts, extra in _ATTN_FIELDS
                 if name in arrays and len(arrays[name]) < need[counts] + extra]
        what = f"{a.n_groups} groups and {a.nnz} indices" + (f" of {u.c.n_tokens} tokens" if c_pos else "")
        raise ValueError(f"attention_indices: out is too small for {what} (" + "; ".join(short) + ")")
    if r < 0:
        raise_status(r, &err, "attention_indices")
    cdef Py_ssize_t g = a.n_groups, n = a.nnz
    cdef Py_ssize_t t = u.c.n_tokens
    return AttentionIndices(arrays["qo_indptr"][:g + 1], arrays["kv_indptr"][:g + 1], arrays["kv_indices"][:n],
                            arrays["causal"][:g], arrays["stream"][:g], arrays["kv_pos"][:n] if c_pos else None,
                            arrays["q_pos"][:t] if c_pos else None,
                            <Py_ssize_t>a.n_kv, <Py_ssize_t>a.span)



cdef inline bint _never_decreases(const int32_t[::1] a) noexcept nogil:
    cdef Py_ssize_t j
    cdef int32_t down = 0
    for j in range(1, a.shape[0]):
        down |= a[j] < a[j - 1]    # no early exit: the loop vectorizes
    return not down


def _csr_check(qo, kv, rows):
    """One pass in C over int32 CSR arrays (C-contiguous 1-D, as attention_indices makes them),
    for kvcache.torch_attention's check of indices a caller hands back: their span (max(rows) +
    1, 0 for none) when qo and kv start at 0 and never decrease, kv ends at len(rows) and no row
    is negative; -1 when one of these fails (numpy then names which); None for arrays of another
    layout (numpy checks them)."""
    if not (type(qo) is _NDARRAY and type(kv) is _NDARRAY and type(rows) is _NDARRAY):
        return None
    if not (qo.dtype == _I32 and kv.dtype == _I32 and rows.dtype == _I32):
        return None
    if not (qo.ndim == 1 and kv.ndim == 1 and rows.ndim == 1 and qo.flags.c_contiguous and
            kv.flags.c_contiguous and rows.flags.c_contiguous) or len(qo) == 0 or len(kv) == 0:
        return None
    cdef const int32_t[::1] a = qo
    cdef const int32_t[::1] b = kv
    cdef const int32_t[::1] r = rows
    cdef Py_ssize_t j
    cdef int32_t lo = 0, hi = -1, x
    cdef bint ok
    with nogil:
        ok = a[0] == 0 and b[0] == 0 and b[b.shape[0] - 1] == r.shape[0] and _never_decreases(a) and \
            _never_decreases(b)
        for j in range(r.shape[0]):
            x = r[j]
            lo = x if x < lo else lo
            hi = x if x > hi else hi
    if not ok or lo < 0:
        return -1
    return <int64_t>hi + 1
