# Declarations of the unified KV cache: csrc/kvc_unified.h (state, construction, sequences, window),
# kvc_slot.h (slots, undo log, snapshots, store), kvc_defrag.h and kvc_mask.h; the cache types and
# the constructor: kvc_unified_ops.h.
from libc.stdint cimport int32_t, uint32_t, uint64_t, uint8_t, int64_t
from kvcache.includes.kvc_common cimport kvc_err, kvc_layer, kvc_ubatch
from kvcache.includes.kvc_seqops cimport kvc_seq_ops
from kvcache.includes.kvc_cells cimport kvc_cells

cdef extern from "kvc_unified.h" nogil:
    ctypedef enum kvc_swa_type:
        KVC_SWA_NONE
        KVC_SWA_STANDARD
        KVC_SWA_CHUNKED

    ctypedef enum kvc_semantics:
        KVC_SEM_2025
        KVC_SEM_2026

    ctypedef struct kvc_stream:
        kvc_cells cells
        uint32_t head

    ctypedef struct kvc_scatter:
        int32_t *idx
        uint32_t *strm
        uint32_t n_groups, n_seq_tokens

    ctypedef struct kvc_undo_span:
        uint32_t i, n, off

    ctypedef struct kvc_undo:
        kvc_undo_span *spans
        uint32_t n_spans, cap_spans
        int32_t *pos
        uint64_t *seq
        uint32_t n_cells, cap_cells
        uint32_t seq_words

    ctypedef struct kvc_slot:
        uint32_t head, n

    ctypedef struct kvc_unified_ops:
        int32_t semantics

    ctypedef struct kvc_unified:
        kvc_cells cells
        uint32_t head
        kvc_slot slot
        const kvc_unified_ops *ops
        uint32_t n_stream
        kvc_stream *more
        kvc_scatter scatter
        uint32_t n_copies
        kvc_undo undo
        uint32_t n
        uint32_t n_seq_max
        uint32_t n_pad
        uint32_t n_swa
        int32_t swa_type
        int32_t type_k
        int32_t type_v
        bint v_trans
        uint32_t n_layer
        kvc_layer *layers
        bint do_defrag
        uint32_t *defrag_ids
        uint32_t n_defrag_ids
        bint defrag_pending
        uint32_t n_threads
        bint vector_moves
        bint ple
        int32_t ple_token
        void *reuse          # kvc_reuse * (kvcache.includes.kvc_retain), NULL while prefix reuse is off
        uint32_t imports     # sequence imports begun, not committed or aborted (kvc_handoff.h)

    ctypedef struct kvc_unified_params:
        uint32_t kv_size
        int32_t semantics
        bint stream_per_seq
        uint32_t n_seq_max
        uint32_t n_pad
        uint32_t n_swa
        int32_t swa_type
        int32_t type_k, type_v
        bint v_trans
        uint32_t n_layer
        const int32_t *layer_il
        const uint32_t *n_embd_k
        const uint32_t *n_embd_v
        bint cell_ext
        bint ple
        int32_t ple_token

    void kvc_unified_free(kvc_unified *c)
    void kvc_unified_set_layer_buffers(kvc_unified *c, uint32_t ikv, uint8_t *k, uint8_t *v)
    int64_t kvc_unified_layer_index(const kvc_unified *c, int64_t il)
    bint kvc_unified_has_memory(const kvc_unified *c)
    int  kvc_unified_set_n_threads(kvc_unified *c, uint32_t n, kvc_err *err)

    const kvc_seq_ops kvc_unified_seq_ops   # clear, seq_rm, seq_cp, seq_keep, seq_add, seq_div
    int32_t kvc_unified_seq_pos_min(const kvc_unified *c, int32_t s)
    int32_t kvc_unified_seq_pos_max(const kvc_unified *c, int32_t s)
    int     kvc_unified_seq_cp_check(kvc_unified *c, int32_t src, int32_t dst, int32_t p0, int32_t p1, kvc_err *err)
    const kvc_cells *kvc_unified_stream_cells_c(const kvc_unified *c, uint32_t s)
    uint32_t kvc_unified_stream_of(const kvc_unified *c, int32_t s)
    uint32_t kvc_unified_stream_head_c(const kvc_unified *c, uint32_t s)
    uint32_t kvc_unified_stream_n_kv(const kvc_unified *c, uint32_t s)
    bint     kvc_unified_has_ext(const kvc_unified *c)
    bint    kvc_unified_any_shift(const kvc_unified *c)

    int     kvc_unified_prune_swa(kvc_unified *c, int32_t s, int32_t pmin, int32_t pmax)
    bint    kvc_unified_is_masked_swa(const kvc_unified *c, int32_t p0, int32_t p1)

    void    kvc_unified_pos_bucket(const kvc_unified *c, const kvc_ubatch *ub, uint32_t n_buckets, int32_t *out)
    int32_t kvc_relative_position_bucket(int32_t p0, int32_t p1, uint32_t n_buckets)
    void    kvc_unified_k_shift(const kvc_unified *c, int32_t *out)

cdef extern from "kvc_unified_ops.h" nogil:
    int  kvc_unified_init(kvc_unified *c, const kvc_unified_params *p, kvc_err *err)

cdef extern from "kvc_slot.h" nogil:
    int     kvc_unified_find_slot(kvc_unified *c, const kvc_ubatch *ub)
    void    kvc_unified_commit(kvc_unified *c)
    void    kvc_unified_restore(kvc_unified *c)
    void    kvc_unified_set_full(kvc_unified *c)

    uint32_t kvc_unified_slot_n(const kvc_unified *c)
    uint32_t kvc_unified_slot_cell(const kvc_unified *c, uint32_t t)
    void    kvc_unified_slot_cells(const kvc_unified *c, int32_t *out)
    uint32_t kvc_unified_slot_stream(const kvc_unified *c, uint32_t t)
    int     kvc_unified_groups(const kvc_unified *c, const kvc_ubatch *ub, uint32_t *strm, uint32_t *n_groups,
                               uint32_t *n_seq_tokens, kvc_err *err)
    int     kvc_unified_find_slot_2026(kvc_unified *c, const kvc_ubatch *ub, kvc_err *err)
    int     kvc_unified_find_slot_2026_parts(kvc_unified *const *cs, uint32_t n, const kvc_ubatch *ub, int *found,
                                             kvc_err *err)
    int     kvc_unified_prepare_2026(kvc_unified *c, const kvc_ubatch *ubs, uint32_t n_ub, int32_t *out_cells,
                                     uint32_t *out_strm, uint32_t *out_groups, kvc_err *err)
    int     kvc_unified_store(kvc_unified *c, uint32_t ikv, uint32_t n_tokens, const void *k, const void *v)

    ctypedef struct kvc_unified_mark:
        uint32_t head, n
        kvc_slot slot
        uint32_t n_spans, n_cells
    void kvc_unified_mark_take(const kvc_unified *c, kvc_unified_mark *m)
    int  kvc_unified_rewind(kvc_unified *c, const kvc_unified_mark *m)

    ctypedef struct kvc_unified_snapshot:
        kvc_cells cells
        uint32_t head, n
        kvc_slot slot
        kvc_undo undo
        bint do_defrag, defrag_pending
    int  kvc_unified_snapshot_take(const kvc_unified *c, kvc_unified_snapshot *s)
    void kvc_unified_snapshot_restore(kvc_unified *c, const kvc_unified_snapshot *s)
    void kvc_unified_snapshot_free(kvc_unified_snapshot *s)

cdef extern from "kvc_defrag.h" nogil:
    float   kvc_unified_fragmentation(const kvc_unified *c)
    void    kvc_unified_defrag_sched(kvc_unified *c, float thold)
    int     kvc_unified_defrag_prepare(kvc_unified *c, int32_t n_max_nodes)
    void    kvc_unified_defrag_move(kvc_unified *c)
    void    kvc_unified_defrag_settle(kvc_unified *c)
    uint32_t kvc_unified_defrag_runs(const kvc_unified *c, uint32_t *runs)

cdef extern from "kvc_mask.h" nogil:
    ctypedef enum kvc_mask_dtype:
        KVC_MASK_F32
        KVC_MASK_F16
        KVC_MASK_BOOL
    int     kvc_unified_kq_mask(const kvc_unified *c, const kvc_ubatch *ub, bint causal, bint alibi,
                                int dtype, bint pad, size_t row_stride, void *out)
    int     kvc_unified_kq_mask_2026(const kvc_unified *c, const kvc_ubatch *ub, bint causal, bint alibi,
                                     int dtype, void *out, kvc_err *err)
    uint32_t kvc_unified_kq_mask_2026_n_kv(const kvc_unified *c, const uint32_t *strm, uint32_t n_groups)
    int     kvc_unified_kq_mask_reuse(kvc_unified *c, const kvc_ubatch *ub, bint causal, bint alibi, int dtype,
                                      bint pad, size_t row_stride, void *out, bint reuse)
    int     kvc_unified_kq_mask_2026_reuse(kvc_unified *c, const kvc_ubatch *ub, bint causal, bint alibi, int dtype,
                                           void *out, bint reuse, kvc_err *err)
