# Declarations of csrc/kvc_seqops.h: the sequence operations both cell tables answer, as one table
# (kvc_unified_seq_ops, kvc_recurrent_seq_ops); the bridge calls them through it.
from libc.stdint cimport int32_t

cdef extern from "kvc_seqops.h" nogil:
    ctypedef struct kvc_seq_ops:
        void (*clear)(void *c) noexcept nogil
        bint (*seq_rm)(void *c, int32_t s, int32_t p0, int32_t p1) noexcept nogil
        void (*seq_cp)(void *c, int32_t src, int32_t dst, int32_t p0, int32_t p1) noexcept nogil
        void (*seq_keep)(void *c, int32_t s) noexcept nogil
        void (*seq_add)(void *c, int32_t s, int32_t p0, int32_t p1, int32_t shift) noexcept nogil
        void (*seq_div)(void *c, int32_t s, int32_t p0, int32_t p1, int32_t d) noexcept nogil
