# Declarations of csrc/kvc_store.h: the checksum of the prefix store's chunk files.
from libc.stdint cimport uint8_t, uint64_t

cdef extern from "kvc_store.h" nogil:
    ctypedef struct kvc_store_sum:
        uint64_t n

    void kvc_store_sum_init(kvc_store_sum *s)
    void kvc_store_sum_update(kvc_store_sum *s, const uint8_t *p, size_t n)
    void kvc_store_sum_copy(kvc_store_sum *s, uint8_t *dst, const uint8_t *src, size_t n, bint stream)
    int kvc_store_read(kvc_store_sum *s, int fd, uint8_t *dst, size_t n, uint8_t *bounce, size_t step, bint stream)
    uint64_t kvc_store_sum_digest(const kvc_store_sum *s)
