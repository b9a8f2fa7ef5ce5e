# Declarations of csrc/kvc_iswa.h: the pending pruning ranges of an iSWA cache.
from libc.stdint cimport int32_t, uint32_t, uint64_t
from kvcache.includes.kvc_common cimport kvc_err
from kvcache.includes.kvc_cells cimport kvc_seqset

cdef extern from "kvc_iswa.h" nogil:
    ctypedef struct kvc_iswa_pending:
        kvc_seqset seqs
        int32_t pmin[256]
        int32_t pmax[256]
    void kvc_iswa_pending_clear(kvc_iswa_pending *p)
    int  kvc_iswa_pending_set(kvc_iswa_pending *p, uint32_t n_tokens, const int32_t *pos, const uint32_t *seq_off,
                              const int32_t *seq_ids, uint32_t n_seq_max, bint record, kvc_err *err)
