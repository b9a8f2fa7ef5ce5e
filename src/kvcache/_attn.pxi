# Attention indices: the cells each query token group of a placed ubatch attends to, as the CSR
# arrays paged-attention kernels take (csrc/kvc_attn.h); UnifiedCache.attention_indices and
# ISWACache.attention_indices call _attention_indices.

from libc.string cimport memset
from kvcache.includes.kvc_attn cimport kvc_attn, kvc_unified_attn_indices


class AttentionIndices(_namedtuple("AttentionIndices", "qo_indptr kv_indptr kv_indices causal stream kv_pos n_kv")):
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
    - ``kv_pos`` (int32, like kv_indices) each row's position (ALiBi's distance is
      ``|kv_pos - pos|``), or None when not asked for;
    - ``n_kv``: the KQ mask's columns (every cell is below it).

    ``AttentionIndices.buffers(n_groups, n_indices)`` makes arrays for ``out=``."""

    __slots__ = ()

    @classmethod
    def buffers(cls, n_groups, n_indices, positions=False):
        """Arrays with room for n_groups groups (at most the ubatch's tokens) and n_indices
        indices (at most n_groups x the cells of a stream), for ``attention_indices(out=...)``
        to fill step after step."""
        g = int_arg(n_groups, "n_groups", 0, INT32_MAX - 1)
        n = int_arg(n_indices, "n_indices", 0, INT32_MAX)
        return cls(np.zeros(g + 1, np.int32), np.zeros(g + 1, np.int32), np.zeros(n, np.int32),
                   np.zeros(g, np.bool_), np.zeros(g, np.int32),
                   np.zeros(n, np.int32) if bool_c(positions, "positions") else None, 0)


# the arrays of an out= AttentionIndices: (field, dtype, counts groups (else indices), extra entries)
_I32, _BOOL = np.dtype(np.int32), np.dtype(np.bool_)
_ATTN_FIELDS = (("qo_indptr", _I32, True, 1), ("kv_indptr", _I32, True, 1), ("kv_indices", _I32, False, 0),
                ("causal", _BOOL, True, 0), ("stream", _I32, True, 0), ("kv_pos", _I32, False, 0))


cdef int _attn_bind(kvc_attn *a, object bufs, bint positions, list held) except -1:
    """Point a's arrays at bufs' (an AttentionIndices), each checked and held (into held), and
    set its room; kv_pos only with positions."""
    cdef _HeldBuffer hb
    cdef void *ptrs[6]
    cdef Py_ssize_t cap_g = INT32_MAX, cap_n = INT32_MAX, k
    memset(ptrs, 0, sizeof(ptrs))
    for k, (name, dt, per_group, extra) in enumerate(_ATTN_FIELDS):
        if name == "kv_pos" and not positions:
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
        ptrs[k] = hb.view.buf
        if per_group:
            cap_g = min(cap_g, hb.dim(0) - extra)
        else:
            cap_n = min(cap_n, hb.dim(0))
    a.qo_indptr = <int32_t *>ptrs[0]
    a.kv_indptr = <int32_t *>ptrs[1]
    a.kv_indices = <int32_t *>ptrs[2]
    a.causal = <uint8_t *>ptrs[3]
    a.stream = <int32_t *>ptrs[4]
    a.kv_pos = <int32_t *>ptrs[5]
    a.cap_groups = <uint32_t>max(cap_g, 0)
    a.cap_nnz = <uint32_t>cap_n
    return 0


cdef object _attention_indices(_Unified cache, object ub, object causal, object positions, object out):
    """UnifiedCache.attention_indices (the checks, then the C call under the cache's lock)."""
    cdef UBatch u = ubatch_c(ub)
    cdef bint c_causal = bool_c(causal, "causal"), c_pos = bool_c(positions, "positions")
    cdef kvc_attn a
    cdef kvc_err err
    cdef int r = 0
    cdef list held = []
    err.msg[0] = 0
    memset(&a, 0, sizeof(a))
    u.check(cache.c.n_seq_max, kvc_unified_has_ext(&cache.c))
    if out is not None and not isinstance(out, AttentionIndices):
        raise TypeError(f"out must be a kvcache.AttentionIndices (AttentionIndices.buffers makes one), "
                        f"not {type(out).__name__}")
    try:
        if out is not None:
            # taken before the lock: an exporter's hooks see the cache as any other call would
            _attn_bind(&a, out, c_pos, held)
        op_begin(&cache._lock, False, "attention_indices")
        try:
            with nogil:
                r = kvc_unified_attn_indices(&cache.c, &u.c, c_causal, &a, &err)
            if r == KVC_E_NOSPACE and out is None:
                # the counts are known: arrays of that size (never empty), and the same call into them
                out = AttentionIndices.buffers(max(a.n_groups, 1), max(a.nnz, 1), c_pos)
                _attn_bind(&a, out, c_pos, held)
                with nogil:
                    r = kvc_unified_attn_indices(&cache.c, &u.c, c_causal, &a, &err)
        finally:
            op_end(&cache._lock)
    finally:
        for hb in held:
            (<_HeldBuffer>hb).release()
    if r == KVC_E_NOSPACE:
        need = {True: a.n_groups, False: a.nnz}
        short = [f"out.{name} has {len(getattr(out, name))} entries, needs {need[per_group] + extra}"
                 for name, dt, per_group, extra in _ATTN_FIELDS
                 if (name != "kv_pos" or c_pos) and len(getattr(out, name)) < need[per_group] + extra]
        raise ValueError(f"attention_indices: out is too small for {a.n_groups} groups and {a.nnz} indices ("
                         + "; ".join(short) + ")")
    if r < 0:
        raise_status(r, &err, "attention_indices")
    cdef Py_ssize_t g = a.n_groups, n = a.nnz
    return AttentionIndices(out.qo_indptr[:g + 1], out.kv_indptr[:g + 1], out.kv_indices[:n], out.causal[:g],
                            out.stream[:g], out.kv_pos[:n] if c_pos else None, <Py_ssize_t>a.n_kv)
