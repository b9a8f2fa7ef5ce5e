# _iswa: the interleaved sliding-window cache (kvcache.ISWACache): two UnifiedCache objects, a
# base cache for the full-attention layers and a SWA cache for the windowed ones, driven together
# by the rules of csrc/kvc_iswa.h (the operations over several caches it uses: _parts.pxi).
# _ISWA is what both semantics share; _iswa2025.pxi and _iswa2026.pxi hold what only one has.

import warnings

from kvcache.includes.kvc_retain cimport (kvc_retained, kvc_retain_enable_parts, kvc_retain_match_parts_xy,
                                         kvc_retain_attach_parts_xy, kvc_retain_release_parts)
from kvcache.includes.kvc_iswa cimport (KVC_ISWA_PAD_2026, kvc_iswa, kvc_iswa_pending, kvc_iswa_sizing, kvc_iswa_swa_size, kvc_iswa_init,
                                        KVC_ISWA_BASE, KVC_ISWA_SWA, kvc_iswa_layer,
                                        kvc_iswa_sbatch_init, kvc_iswa_find_slot, kvc_iswa_commit, kvc_iswa_restore,
                                        kvc_iswa_set_full, kvc_iswa_clear, kvc_iswa_seq_rm, kvc_iswa_seq_cp,
                                        kvc_iswa_seq_keep, kvc_iswa_seq_add, kvc_iswa_seq_div, kvc_iswa_seq_pos_min,
                                        kvc_iswa_seq_pos_max, kvc_iswa_can_shift, kvc_iswa_has_shift,
                                        kvc_iswa_shift_refused)
from kvcache.includes.kvc_cells cimport kvc_seqset_next


#: today's llama.cpp pads its SWA cache to a multiple of this many cells
SWA_PAD_2026 = KVC_ISWA_PAD_2026


def swa_full_arg(swa_full, semantics):
    """The ``swa_full`` an iSWA cache of ``semantics`` gets: the caller's (a bool), or for None the
    semantics' default, the one rule every constructor, plan and loader uses. "2026": True, as
    today's ``llama_context_default_params`` and llama-cpp-python's ``Llama(...)`` (which leaves
    it unset) give it. "2025": False, llama.cpp's own tools' default (``common_params``, llama-cli
    and llama-server), the SWA cache mid-2025 llama.cpp prunes on commit, as kvcache has always
    made it for that semantics."""
    return bool_arg(semantics == "2026" if swa_full is None else swa_full, "swa_full")


def swa_cells(kv_size, n_swa, n_seq_max, n_batch, n_pad, swa_full, semantics="2025", kv_unified=True):
    """Cells of an iSWA cache's SWA cache (per stream), by the rule of kvc_iswa_swa_size
    (kvcache.plan.swa_size documents it); every count in [0, 2**32 - 1]."""
    cdef kvc_iswa_sizing z
    z.kv_size = <uint32_t>int_c(kv_size, "kv_size", 0, UINT32_MAX)
    z.n_swa = <uint32_t>int_c(n_swa, "n_swa", 0, UINT32_MAX)
    z.n_seq_max = <uint32_t>int_c(n_seq_max, "n_seq_max", 0, UINT32_MAX)
    z.n_ubatch = <uint32_t>int_c(n_batch, "n_batch", 0, UINT32_MAX)
    z.n_pad = <uint32_t>int_c(n_pad, "n_pad", 0, UINT32_MAX)
    z.swa_full = bool(swa_full)
    z.kv_unified = bool(kv_unified)
    z.cap_then_pad = semantics == "2026"   # today's rule
    return kvc_iswa_swa_size(&z)


cdef list _pending_items(const kvc_iswa_pending *p):
    """``[[seq_id, pmin, pmax], ...]`` of a set of ranges, in ascending sequence order."""
    out = []
    cdef int s = kvc_seqset_next(&p.seqs, KVC_SEQ_WORDS, -1)
    while s >= 0:
        out.append([s, p.pmin[s], p.pmax[s]])
        s = kvc_seqset_next(&p.seqs, KVC_SEQ_WORDS, s)
    return out


class SWAWarning(UserWarning):
    """The SWA cache held only part of a sequence's window when it was pruned on commit: the
    sequence may have lost information (typically after cells were removed or the SWA cache
    was too small for the batch)."""


class ISWAUpdatePlan:
    """The UpdatePlans of an iSWA cache's two parts (``base``, ``swa``); true when both are
    (llama.cpp's iSWA update returns the AND of its caches' answers)."""

    __slots__ = ("base", "swa")

    def __init__(self, base, swa):
        self.base = base
        self.swa = swa

    def __bool__(self):
        return bool(self.base) and bool(self.swa)

    def __iter__(self):
        return iter((self.base, self.swa))

    def __repr__(self):
        return f"ISWAUpdatePlan(base={self.base!r}, swa={self.swa!r})"


_ISWA_SWA_TYPES = ("standard", "chunked")


cdef tuple _out_pair(object out):
    """The base and SWA buffers of an ``out`` argument: None, or a pair."""
    if out is None:
        return None, None
    try:
        out_base, out_swa = out
    except (TypeError, ValueError):
        raise TypeError("out must be None or a pair (base_out, swa_out)") from None
    return out_base, out_swa


cdef tuple _split_buffers(object buffers, Py_ssize_t n_layer, frozenset swa_set, frozenset held):
    """buffers for both caches: a mode name, or the pairs of each cache's layers (of held)."""
    if buffers is None or isinstance(buffers, str):
        return buffers, buffers
    if isinstance(buffers, dict):
        pairs = buffers
    elif isinstance(buffers, (list, tuple)):
        if len(buffers) != n_layer:
            raise ValueError(f"buffers has {len(buffers)} entries, expected one (K, V) pair per model "
                             f"layer ({n_layer})")
        pairs = dict(enumerate(buffers))
    else:
        raise TypeError(f"buffers must be 'owned', None, 'none', a dict {{layer: (K, V)}} or a list of "
                        f"(K, V) pairs, not {type(buffers).__name__}")
    base = {il: kv for il, kv in pairs.items() if il not in swa_set and il in held}
    swa = {il: kv for il, kv in pairs.items() if il in swa_set}
    return base, swa


cdef class _ISWA:
    """The interleaved sliding-window cache (kvcache.ISWACache is the documented public class)."""
    cdef kvc_iswa c                # the pair in C: both caches' structs, swa_full, the pending ranges
    cdef _Unified _base            # the full-attention layers' cache (a UnifiedCache)
    cdef _Unified _swa             # the sliding-window layers' cache (a UnifiedCache)
    cdef _Unified _first           # the two in the global lock order (ascending address)
    cdef _Unified _second
    cdef uint32_t _n_batch         # the ubatch size the SWA cache was sized for
    cdef readonly _Hold _hold      # both caches' locks, in the global order
    # the same, as one operation of both: a callback it runs (a file's write(), an array
    # exporter's hooks) cannot change either cache under it
    cdef _Hold _op

    __signature__ = _signatures.ClassSignature(_signatures.iswa)

    def __cinit__(self, *args, **kwargs):
        (kv_size, n_layer, n_embd_k_gqa, n_embd_v_gqa, swa_layers, n_swa, swa_type, n_batch, swa_full, type_k, type_v,
         v_trans, n_seq_max, n_pad, buffers, n_embd_head_k, rope, semantics, kv_unified, cell_ext,
         ple_token, held) = _signatures.bind(_signatures.iswa, type(self), args, kwargs)
        cdef kvc_iswa_sizing z
        cdef kvc_err err
        err.msg[0] = 0
        from kvcache.unified import UnifiedCache      # the public class of the parts (a layer above)
        n_layer = int_arg(n_layer, "n_layer", 0, 2**31 - 1)
        layers = layers_arg(swa_layers, n_layer, "swa_layers", any_order=True)
        # the model layers with K/V (a hybrid model's attention layers); the SWA ones among them
        held = frozenset(layers_arg(held, n_layer, "layers", any_order=True))
        if not held.issuperset(layers):
            raise ValueError(f"swa_layers: layers {sorted(set(layers) - held)} are not among layers")
        n_swa = int_arg(n_swa, "n_swa", 1, 2**31 - 1)
        if swa_type not in _ISWA_SWA_TYPES:
            raise ValueError(f"swa_type = {swa_type!r}: expected one of {', '.join(map(repr, _ISWA_SWA_TYPES))}")
        n_batch = int_arg(n_batch, "n_batch", 1, 2**31 - 1)
        # each class is one semantics (ISWACache(...) picks the class)
        fixed = "2025" if isinstance(self, _ISWA2025) else "2026" if isinstance(self, _ISWA2026) else None
        if fixed is None:
            raise TypeError(f"{type(self).__name__}: an iSWA cache is an ISWACache2025 or an ISWACache2026 "
                            f"(ISWACache(..., semantics=...) makes the one asked for)")
        if semantics is not None and semantics != fixed:
            raise ValueError(f"semantics = {semantics!r}: an {type(self).__name__} has semantics {fixed!r}")
        semantics = fixed
        swa_full = swa_full_arg(swa_full, semantics)
        kv_unified = bool_arg(kv_unified, "kv_unified")
        kv_size = int_arg(kv_size, "kv_size", 1, 2**32 - 1)
        n_pad = int_arg(n_pad, "n_pad", 1, 2**32 - 1)
        n_seq_max = n_seq_max_arg(n_seq_max)
        z.kv_size = <uint32_t>kv_size
        z.n_swa = <uint32_t>n_swa
        z.n_seq_max = <uint32_t>n_seq_max
        z.n_ubatch = <uint32_t>n_batch
        z.n_pad = <uint32_t>n_pad
        z.swa_full = swa_full
        z.kv_unified = kv_unified
        z.cap_then_pad = semantics == "2026"   # today's rule
        size_swa = kvc_iswa_swa_size(&z)
        swa_set = frozenset(layers)
        common = dict(n_layer=n_layer, n_embd_k_gqa=n_embd_k_gqa, n_embd_v_gqa=n_embd_v_gqa, type_k=type_k,
                      type_v=type_v, v_trans=v_trans, n_seq_max=n_seq_max, n_pad=n_pad,
                      n_embd_head_k=n_embd_head_k, rope=rope, semantics=semantics, kv_unified=kv_unified,
                      cell_ext=cell_ext, ple_token=ple_token)
        buf_base, buf_swa = _split_buffers(buffers, n_layer, swa_set, held)
        self._base = UnifiedCache(kv_size=kv_size, n_swa=0, swa_type="none", buffers=buf_base,
                                  layers=[il for il in range(n_layer) if il in held and il not in swa_set], **common)
        self._swa = UnifiedCache(kv_size=size_swa, n_swa=n_swa, swa_type=swa_type, layers=list(layers),
                                 buffers=buf_swa, **common)
        check_status(kvc_iswa_init(&self.c, &self._base.c, &self._swa.c, swa_full, &err), &err, "ISWACache")
        self._first, self._second = _lock_order((self._base, self._swa))
        self._n_batch = <uint32_t>n_batch
        self._hold = _Hold(self._base, self._swa)
        self._op = _Hold(self._base, self._swa, busy=True)

    # lock() of both caches, in _lock_order's order (see "locking" in _common.pxi): for a change,
    # a read, or the pair's own pending ranges
    cdef int _lock_parts(self, int how, str what) except -1:
        lock(&self._first._lock, how, what)
        try:
            lock(&self._second._lock, how, what)
        except BaseException:
            unlock(&self._first._lock, how)
            raise
        return 0

    cdef void _unlock_parts(self, int how) noexcept nogil:
        unlock(&self._second._lock, how)
        unlock(&self._first._lock, how)

    # --- the parts and the geometry (read-only) ----------------------------------------------
    @property
    def base(self):
        """The cache of the full-attention layers (kv_size cells, no window)."""
        return self._base

    @property
    def swa(self):
        """The cache of the sliding-window layers."""
        return self._swa

    @property
    def n_layer(self):
        """Number of model layers."""
        return self._base.n_layer

    @property
    def swa_layers(self):
        """Model layers held by the SWA cache, ascending."""
        return self._swa.layers

    cdef tuple _layers(self):
        """Model layers held by either cache, ascending (the pair's layer table, kvc_iswa_layer)."""
        return tuple(sorted(_kept_layers(self.c.base) + _kept_layers(self.c.swa)))

    @property
    def base_layers(self):
        """Model layers held by the base cache, ascending."""
        return self._base.layers

    @property
    def n_swa(self):
        """Sliding window size."""
        return self._swa.n_swa

    @property
    def swa_type(self):
        """'standard' or 'chunked'."""
        return self._swa.swa_type

    @property
    def semantics(self):
        """'2025' (llama.cpp's iSWA cache as of mid-2025) or '2026' (today's llama.cpp), as both caches have it."""
        return self._base.semantics

    @property
    def kv_unified(self):
        """True when every sequence shares one stream in both caches."""
        return self._base.kv_unified

    @property
    def cell_ext(self):
        """True when both caches' cells carry the per-cell extension (see UnifiedCache)."""
        return self._base.cell_ext

    @property
    def ple_token(self):
        """The token id a ubatch without token ids stores (see UnifiedCache), or None."""
        return self._base.ple_token

    @property
    def n_stream(self):
        """Streams of each cache (1, or n_seq_max when not kv_unified)."""
        return self._base.n_stream

    @property
    def n_seq_max(self):
        """Valid sequence ids are [0, n_seq_max)."""
        return self._base.n_seq_max

    @property
    def size_base(self):
        """Cells of the base cache."""
        return self._base.size

    @property
    def size_swa(self):
        """Cells of the SWA cache."""
        return self._swa.size

    @property
    def buffers(self):
        """How the K/V memory is held: 'owned', 'borrowed' or 'none' (see UnifiedCache)."""
        return self._base.buffers

    @property
    def n_embd_head_k(self):
        """K head size per model layer, or None."""
        return self._base.n_embd_head_k

    @property
    def rope(self):
        """The model's RopeParams (update() rotates K with them), or None."""
        return self._base.rope

    @property
    def n_batch(self):
        """The batch size the SWA cache was sized for."""
        return self._n_batch

    @property
    def swa_full(self):
        """True when the SWA cache has kv_size cells (semantics "2025": and is never pruned)."""
        return self.c.swa_full

    @property
    def n_threads(self):
        """Threads a large K/V move may use, in both caches (see UnifiedCache.n_threads)."""
        return self._base.n_threads

    @n_threads.setter
    def n_threads(self, value):
        value = int_c(value, "n_threads", 0, UINT32_MAX)   # read once, before the locks: both get it
        with self._hold:
            self._base.n_threads = value
            self._swa.n_threads = value

    @property
    def can_shift(self):
        """Whether a K-shift may be applied: only when both caches have the same size (a smaller
        SWA cache has pruned cells whose positions a shift would need). Semantics "2026": what
        today's ``llama_memory_can_shift`` answers (the same rule); update() shifts anyway."""
        return kvc_iswa_can_shift(&self.c)

    @property
    def has_shift(self):
        """True when either cache has a pending K-shift."""
        cdef bint r
        self._lock_parts(READ, "has_shift")
        try:
            r = kvc_iswa_has_shift(&self.c)
        finally:
            self._unlock_parts(READ)
        return r

    @property
    def pending(self):
        """The pruning ranges recorded by the last sbatch_init: ``[[seq, pmin, pmax], ...]``."""
        cdef kvc_iswa_pending p
        self._lock_parts(READ, "pending")
        try:
            p = self.c.pending
        finally:
            self._unlock_parts(READ)
        return _pending_items(&p)

    @property
    def size_k_bytes(self):
        """Bytes of K memory of both caches."""
        return self._base.size_k_bytes + self._swa.size_k_bytes

    @property
    def size_v_bytes(self):
        """Bytes of V memory of both caches."""
        return self._base.size_v_bytes + self._swa.size_v_bytes

    @property
    def total_size(self):
        """size_k_bytes + size_v_bytes."""
        return self.size_k_bytes + self.size_v_bytes

    def __repr__(self):
        return (f"ISWACache(kv_size={self._base.size}, n_layer={self.n_layer}, swa_layers={list(self.swa_layers)}, "
                f"n_swa={self.n_swa}, swa_type={self.swa_type!r}, n_batch={self._n_batch}, "
                f"swa_full={self.swa_full}, n_seq_max={self.n_seq_max}, size_swa={self._swa.size}"
                + (f", semantics='2026', kv_unified={self.kv_unified}"
                   + (", cell_ext=True)" if self.cell_ext else ")") if self.c.base.ops.semantics == KVC_SEM_2026
                   else ")"))

    # --- batches ---------------------------------------------------------------------------
    # --- slots -----------------------------------------------------------------------------
    cdef int _place(self, object ub, int *found) except -1:
        # kvc_iswa_find_slot under both locks: 1 placed in both, 0 not
        cdef int r
        cdef kvc_err err
        cdef UBatch u = ubatch_c(ub)
        err.msg[0] = 0
        found[0] = found[1] = 0
        u.check(self.c.base.n_seq_max, kvc_unified_has_ext(self.c.base))
        self._lock_parts(CHANGE, "find_slot")
        try:
            with nogil:
                r = kvc_iswa_find_slot(&self.c, &u.c, found, &err)
        finally:
            self._unlock_parts(CHANGE)
        spill_flush(self._base)
        spill_flush(self._swa)
        if r < 0:
            raise_status(r, &err, "find_slot")
        return r

    def find_slot_each(self, ub):
        """Place the ubatch in the base cache, then in the SWA cache (both are always tried);
        returns each cache's result. When the SWA cache raises (MemoryError), the base
        cache's placement is undone: both are as they were. Semantics "2026": the ubatch is
        placed in both caches when each found room, else in neither (as today's llama.cpp
        prepares both before it applies either); the results say which found room."""
        cdef int found[2]
        self._place(ub, found)
        return found[0] == 1, found[1] == 1

    def find_slot(self, ub):
        """Place the ubatch in both caches; True when both found room (restore() undoes it;
        semantics "2026": placed for good, and a False changed nothing)."""
        cdef int found[2]
        return self._place(ub, found) == 1

    def slot_info(self):
        """Where the last successful find_slot put each token in each cache:
        ``(base.slot_info(), swa.slot_info())``."""
        with self._hold:
            return self._base.slot_info(), self._swa.slot_info()

    def slot_indices(self, out=None):
        """The cell of each placed token in each cache: ``(base.slot_indices(),
        swa.slot_indices())`` (see UnifiedCache.slot_indices); ``out``: None or a pair of
        buffers to fill."""
        out_base, out_swa = _out_pair(out)
        with self._op:      # the buffers' own code may run: a change from it is refused
            return self._base.slot_indices(out_base), self._swa.slot_indices(out_swa)

    def clear(self):
        """Empty both caches (the pending ranges are kept, as llama.cpp does)."""
        self._lock_parts(CHANGE, "clear")
        try:
            with nogil:
                kvc_iswa_clear(&self.c)
        finally:
            self._unlock_parts(CHANGE)

    # --- sequences -------------------------------------------------------------------------
    def seq_rm(self, seq_id, p0=-1, p1=-1):
        """Remove seq_id (-1: any) from the cells with p0 <= pos < p1 of both caches."""
        cdef int32_t s = seq_c(seq_id, self.c.base.n_seq_max, "seq_id", True)
        cdef int32_t a = pos_c(p0, "p0"), b = pos_c(p1, "p1")
        cdef bint r
        self._lock_parts(CHANGE, "seq_rm")
        try:
            r = kvc_iswa_seq_rm(&self.c, s, a, b)
        finally:
            self._unlock_parts(CHANGE)
        return r

    def seq_cp(self, src, dst, p0=-1, p1=-1):
        """Add dst to every cell of src with p0 <= pos < p1, in both caches. Semantics "2026"
        with several streams: across streams whole sequences only (ValueError otherwise,
        nothing changed in either cache)."""
        cdef int32_t s = seq_c(src, self.c.base.n_seq_max, "src", False)
        cdef int32_t d = seq_c(dst, self.c.base.n_seq_max, "dst", False)
        cdef int32_t a = pos_c(p0, "p0"), b = pos_c(p1, "p1")
        cdef kvc_err err
        cdef int r
        err.msg[0] = 0
        self._lock_parts(CHANGE, "seq_cp")
        try:
            r = kvc_iswa_seq_cp(&self.c, s, d, a, b, &err)
        finally:
            self._unlock_parts(CHANGE)
        check_status(r, &err, "seq_cp")

    def seq_keep(self, seq_id):
        """Keep only seq_id, in both caches."""
        cdef int32_t s = seq_c(seq_id, self.c.base.n_seq_max, "seq_id", False)
        self._lock_parts(CHANGE, "seq_keep")
        try:
            kvc_iswa_seq_keep(&self.c, s)
        finally:
            self._unlock_parts(CHANGE)

    def seq_add(self, seq_id, p0, p1, shift):
        """Shift the positions of seq_id in [p0, p1), in both caches."""
        cdef int32_t s = seq_c(seq_id, self.c.base.n_seq_max, "seq_id", False)
        cdef int32_t a = pos_c(p0, "p0"), b = pos_c(p1, "p1")
        cdef int32_t d = pos_c(shift, "shift")
        self._lock_parts(CHANGE, "seq_add")
        try:
            kvc_iswa_seq_add(&self.c, s, a, b, d)
        finally:
            self._unlock_parts(CHANGE)

    def seq_div(self, seq_id, p0, p1, d):
        """Integer-divide the positions of seq_id in [p0, p1) by d (> 0), in both caches."""
        cdef int32_t s = seq_c(seq_id, self.c.base.n_seq_max, "seq_id", False)
        cdef int32_t a = pos_c(p0, "p0"), b = pos_c(p1, "p1")
        cdef int32_t dd = divisor_c(d)
        self._lock_parts(CHANGE, "seq_div")
        try:
            kvc_iswa_seq_div(&self.c, s, a, b, dd)
        finally:
            self._unlock_parts(CHANGE)

    def seq_pos_min(self, seq_id):
        """Smallest position of seq_id in the SWA cache (-1 when absent)."""
        cdef int32_t s = seq_c(seq_id, self.c.swa.n_seq_max, "seq_id", False), r
        lock(&self._swa._lock, READ, "seq_pos_min")
        try:
            r = kvc_iswa_seq_pos_min(&self.c, s)
        finally:
            unlock(&self._swa._lock, READ)
        return r

    def seq_pos_max(self, seq_id):
        """Largest position of seq_id (the SWA cache's answer; -1 when absent)."""
        cdef int32_t s = seq_c(seq_id, self.c.swa.n_seq_max, "seq_id", False), r
        lock(&self._swa._lock, READ, "seq_pos_max")
        try:
            r = kvc_iswa_seq_pos_max(&self.c, s)
        finally:
            unlock(&self._swa._lock, READ)
        return r

    # --- K/V data --------------------------------------------------------------------------
    def cache_of(self, il):
        """The cache holding model layer il."""
        cdef int64_t index
        cdef int part = kvc_iswa_layer(&self.c, _layer_key(il), &index)
        if part == KVC_ISWA_SWA:
            return self._swa
        if part == KVC_ISWA_BASE:
            return self._base
        if 0 <= il < self.n_layer:
            raise IndexError(f"il = {il} is a model layer without K/V in this cache (layers: {list(self._layers())})")
        raise IndexError(f"il = {il} is not a model layer (n_layer = {self.n_layer})")

    def k(self, il):
        """K of model layer il (a view into the cache holding it)."""
        return self.cache_of(il).k(il)

    def v(self, il):
        """V of model layer il (a view into the cache holding it)."""
        return self.cache_of(il).v(il)

    def store(self, il, k_rows, v_rows):
        """Write the K/V rows of model layer il for the ubatch just placed (see UnifiedCache.store)."""
        self.cache_of(il).store(il, k_rows, v_rows)

    # --- graph inputs ----------------------------------------------------------------------
    def kq_mask(self, ub, causal=True, alibi=False, out=None, dtype="f32", pad=None):
        """The KQ masks of ub against both caches: ``(base_mask, swa_mask)``; the SWA mask also
        hides what lies outside the window. ``out``: None or a pair of arrays to fill; ``pad``
        (None: the semantics' default) and the shapes as UnifiedCache.kq_mask."""
        out_base, out_swa = _out_pair(out)
        with self._op:
            return (self._base.kq_mask(ub, causal=causal, alibi=alibi, out=out_base, dtype=dtype, pad=pad),
                    self._swa.kq_mask(ub, causal=causal, alibi=alibi, out=out_swa, dtype=dtype, pad=pad))

    def attention_indices(self, ub, causal=True, positions=False, out=None):
        """The attention indices of ub against both caches: ``(base, swa)`` AttentionIndices
        (the SWA half's also leave out what lies outside the window). ``out``: None or a pair
        of AttentionIndices to fill; the rest as UnifiedCache.attention_indices."""
        out_base, out_swa = _out_pair(out)
        with self._op:
            return (self._base.attention_indices(ub, causal=causal, positions=positions, out=out_base),
                    self._swa.attention_indices(ub, causal=causal, positions=positions, out=out_swa))

    def k_shift(self):
        """The per-cell K-shift inputs of both caches: ``(base_shift, swa_shift)``."""
        with self._hold:
            return self._base.k_shift(), self._swa.k_shift()

    def reset_shift(self):
        """Clear the pending shifts of both caches (after the K-shift was applied)."""
        with self._hold:
            self._base.reset_shift()
            self._swa.reset_shift()

    # --- maintenance -----------------------------------------------------------------------
    # --- state -----------------------------------------------------------------------------
    def state_size(self, seq_id=-1, *, layout=DEFAULT_LAYOUT, prefix=None):
        """Bytes state_write(seq_id, layout=layout, prefix=prefix) produces."""
        cdef state_codec k
        return cache_state_size(self._state_codec(&k), &k, seq_id, layout, prefix)

    def state_write(self, seq_id=-1, *, layout=DEFAULT_LAYOUT, prefix=None):
        """The state of seq_id (-1: everything) in llama.cpp's layout ``layout`` (a name of
        kvcache.LAYOUTS): the base cache's part, then the SWA cache's; a sequence's state of a
        layout with the sequence-blob prefix starts with it once (prefix=False: without). From
        "2026-06" on a sequence's state leaves out the SWA cache's cells outside the window."""
        cdef state_codec k
        return cache_state_write(self._state_codec(&k), &k, seq_id, layout, prefix)

    def state_write_into(self, buf, seq_id=-1, *, layout=DEFAULT_LAYOUT, prefix=None):
        """Write the state of seq_id (-1: everything) into buf: a writable buffer of at least
        state_size(seq_id) bytes (each cache writes its part straight into it) or a binary file
        object. Returns the bytes written. layout, prefix: as state_write."""
        cdef state_codec k
        return cache_state_write_into(self._state_codec(&k), &k, buf, seq_id, layout, prefix)

    def state_read(self, data, seq_id=-1, *, convert=False, exact=False, layout=None):
        """Restore a state written by state_write (or llama.cpp) into seq_id (-1: everything).

        All or nothing: when any part is malformed, does not fit or finds no room, StateError is
        raised and both caches (cells, K/V bytes, uncommitted slots) and the pending ranges are
        exactly as they were. Returns the bytes consumed (bytes after the state are not read,
        unless exact: then they are an error). convert: accept parts whose V layout (transposed
        or not) differs from the caches' and convert them. layout: a name of kvcache.LAYOUTS,
        or None to find it from the bytes (as UnifiedCache.state_read)."""
        cdef state_codec k
        return cache_state_read(self._state_codec(&k), &k, data, seq_id, convert, exact, layout)

    cdef list _state_codec(self, state_codec *k):
        """k: the codec of the pair's state (the base cache's part, then the SWA cache's); returns
        the caches to lock."""
        state_codec_parts(k, (self._base, self._swa))
        return [self._first, self._second]
