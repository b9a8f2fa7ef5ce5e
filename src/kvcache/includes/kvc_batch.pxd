from libc.stdint cimport int8_t, int32_t, uint32_t, uint64_t
from kvcache.includes.kvc_common cimport kvc_err, kvc_ubatch

cdef extern from "kvc_batch.h" nogil:
    enum kvc_split_mode:
        KVC_SPLIT_SIMPLE
        KVC_SPLIT_EQUAL
        KVC_SPLIT_SEQ

    ctypedef struct kvc_sbatch_group:
        uint32_t n_seq_id
        uint32_t token
        uint32_t offset
        uint32_t length

    ctypedef struct kvc_sbatch_ubatch:
        kvc_ubatch ub
        const uint32_t *token
        const int8_t *output
        bint equal_seqs

    ctypedef struct kvc_sbatch:
        uint32_t n_tokens
        uint32_t n_left
        bint simple_split
        bint logits_all
        int32_t *pos
        uint32_t *seq_off
        int32_t *seq_ids
        int8_t *logits
        uint32_t *order
        kvc_sbatch_group *groups
        uint32_t n_groups
        uint32_t *out_ids
        uint32_t n_out

    int kvc_sbatch_init(kvc_sbatch *sb, uint32_t n_tokens, const int32_t *pos, const uint32_t *seq_off,
                        const int32_t *seq_ids, const int8_t *logits, bint logits_all, bint simple_split,
                        kvc_err *err)
    void kvc_sbatch_free(kvc_sbatch *sb)
    int kvc_sbatch_split(kvc_sbatch *sb, kvc_split_mode mode, uint32_t n_ubatch,
                         kvc_sbatch_ubatch *out, kvc_err *err)
