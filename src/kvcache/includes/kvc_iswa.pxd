# Declarations of csrc/kvc_iswa.h: the rules of the interleaved sliding-window cache's pair.
from libc.stdint cimport int32_t, int64_t, uint32_t, uint64_t
from kvcache.includes.kvc_common cimport kvc_err, kvc_ubatch
from kvcache.includes.kvc_cells cimport kvc_seqset
from kvcache.includes.kvc_unified cimport kvc_unified

cdef extern from "kvc_iswa.h" nogil:
    enum:
        KVC_ISWA_PAD_2026
    ctypedef struct kvc_iswa_sizing:
        uint32_t kv_size
        uint32_t n_swa
        uint32_t n_seq_max
        uint32_t n_ubatch
        uint32_t n_pad
        bint swa_full
        bint kv_unified
        bint cap_then_pad
    uint64_t kvc_iswa_swa_size(const kvc_iswa_sizing *s)

    ctypedef struct kvc_iswa_pending:
        kvc_seqset seqs
        int32_t pmin[256]
        int32_t pmax[256]
    void kvc_iswa_pending_clear(kvc_iswa_pending *p)
    int  kvc_iswa_pending_set(kvc_iswa_pending *p, uint32_t n_tokens, const int32_t *pos, const uint32_t *seq_off,
                              const int32_t *seq_ids, uint32_t n_seq_max, bint record, kvc_err *err)

    ctypedef struct kvc_iswa:
        kvc_unified *base
        kvc_unified *swa
        bint swa_full
        kvc_iswa_pending pending
    int  kvc_iswa_init(kvc_iswa *c, kvc_unified *base, kvc_unified *swa, bint swa_full, kvc_err *err)
    enum kvc_iswa_part:
        KVC_ISWA_NONE
        KVC_ISWA_BASE
        KVC_ISWA_SWA
    int  kvc_iswa_layer(const kvc_iswa *c, int64_t il, int64_t *index)
    int  kvc_iswa_sbatch_init(kvc_iswa *c, uint32_t n_tokens, const int32_t *pos, const uint32_t *seq_off,
                              const int32_t *seq_ids, kvc_err *err)
    int  kvc_iswa_find_slot(kvc_iswa *c, const kvc_ubatch *ub, int *found, kvc_err *err)
    uint32_t kvc_iswa_commit(kvc_iswa *c, kvc_iswa_pending *partial)
    void kvc_iswa_restore(kvc_iswa *c)
    void kvc_iswa_set_full(kvc_iswa *c)
    void kvc_iswa_clear(kvc_iswa *c)
    bint kvc_iswa_seq_rm(kvc_iswa *c, int32_t s, int32_t p0, int32_t p1)
    int  kvc_iswa_seq_cp(kvc_iswa *c, int32_t src, int32_t dst, int32_t p0, int32_t p1, kvc_err *err)
    void kvc_iswa_seq_keep(kvc_iswa *c, int32_t s)
    void kvc_iswa_seq_add(kvc_iswa *c, int32_t s, int32_t p0, int32_t p1, int32_t shift)
    void kvc_iswa_seq_div(kvc_iswa *c, int32_t s, int32_t p0, int32_t p1, int32_t d)
    int32_t kvc_iswa_seq_pos_min(const kvc_iswa *c, int32_t s)
    int32_t kvc_iswa_seq_pos_max(const kvc_iswa *c, int32_t s)
    bint kvc_iswa_can_shift(const kvc_iswa *c)
    bint kvc_iswa_has_shift(const kvc_iswa *c)
    bint kvc_iswa_shift_refused(const kvc_iswa *c)
