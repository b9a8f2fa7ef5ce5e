# Declarations of csrc/kvc_lock.h: the lock of every object with mutable state.
from libc.stdint cimport uint32_t, uint64_t

cdef extern from "kvc_lock.h" nogil:
    ctypedef struct kvc_lock:
        unsigned long busy
    enum:   # enum kvc_lock_refusal
        KVC_LOCK_FREE_TO_CHANGE
        KVC_LOCK_BUSY
        KVC_LOCK_RESERVED

    int  kvc_lock_init(kvc_lock *l, const uint32_t *holds)
    void kvc_lock_free(kvc_lock *l)
    bint kvc_lock_enter(kvc_lock *l, uint64_t me)
    void kvc_lock_wait(kvc_lock *l, uint64_t me)
    void kvc_lock_acquire(kvc_lock *l, uint64_t me)
    void kvc_lock_release(kvc_lock *l)
    int  kvc_lock_refusal(const kvc_lock *l)
    int  kvc_lock_acquire_change(kvc_lock *l, uint64_t me)
    bint kvc_lock_mine(const kvc_lock *l, uint64_t me)
    long kvc_lock_waiting(const kvc_lock *l)
