/* kvcache — the lock every object of the Python package with mutable state carries (the caches,
 * Batch, SWAPending): one operation at a time, reentrant for its holder, and the two refusals of a
 * change that the reentrancy must not let in.
 *
 * Taking it is two steps so that an embedding with a global interpreter lock never blocks while
 * holding that: kvc_lock_enter (never blocks) takes it, enters again, or queues the caller; a
 * queued caller then calls kvc_lock_wait, the only call that blocks, after letting its
 * interpreter run other threads. kvc_lock_acquire does both for callers that hold nothing.
 *
 * A thread names itself by a token: any nonzero value that no other living thread uses with this
 * lock (the Python bridge passes the interpreter's thread ident). Several locks are taken in
 * ascending address order.
 *
 * Free: an atomic add takes it (no system call). Contended: a count of the threads holding or
 * waiting, and a wake-up object that waiters block on until the holder hands over by posting
 * once. */
#ifndef KVC_LOCK_H
#define KVC_LOCK_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#if defined(_MSC_VER) && !defined(__clang__)
#include <intrin.h>   /* outside extern "C": it declares C++ overloads when compiled as C++ */
#endif

#ifdef __cplusplus
extern "C" {
#endif

#if defined(_MSC_VER) && !defined(__clang__)
#define KVC_LOCK_ADD(p, v) _InterlockedExchangeAdd((volatile long *)(p), (v))
#define KVC_LOCK_LOAD(p) _InterlockedOr((volatile long *)(p), 0)
/* MSVC's volatile loads and stores of an aligned 64-bit word are atomic on x64 and ARM64 */
#define KVC_LOCK_OWNER(l) (*(volatile const uint64_t *)&(l)->owner)
#define KVC_LOCK_SET_OWNER(l, v) (*(volatile uint64_t *)&(l)->owner = (v))
#else
#define KVC_LOCK_ADD(p, v) __atomic_fetch_add((p), (v), __ATOMIC_ACQ_REL)
#define KVC_LOCK_LOAD(p) __atomic_load_n((p), __ATOMIC_ACQUIRE)
/* read by any thread (is it mine?), written by the holder only: relaxed suffices, since a
 * thread only ever finds its own token there when it wrote it itself */
#define KVC_LOCK_OWNER(l) __atomic_load_n(&(l)->owner, __ATOMIC_RELAXED)
#define KVC_LOCK_SET_OWNER(l, v) __atomic_store_n(&(l)->owner, (v), __ATOMIC_RELAXED)
#endif

typedef struct kvc_lock_wake kvc_lock_wake;

typedef struct kvc_lock {
    long count;              /* threads holding or waiting for the lock */
    long waiting;            /* threads blocked waiting for it (for tests and diagnostics) */
    uint64_t owner;          /* token of the holder, 0 when free */
    unsigned long depth;     /* acquisitions by the holder not yet released */
    unsigned long busy;      /* operations of the holder in progress that must not see a change */
    const uint32_t *holds;   /* reservations that block a change while nonzero (a cache's
                              * sequence imports begun, not yet committed or aborted), or NULL */
    kvc_lock_wake *wake;     /* where waiters block */
} kvc_lock;

/* Why a change is refused: the holder is in the middle of an operation on the object (a
 * callback of that operation asks for the change), or a reservation is held. */
enum kvc_lock_refusal {
    KVC_LOCK_FREE_TO_CHANGE = 0,
    KVC_LOCK_BUSY = 1,
    KVC_LOCK_RESERVED = 2,
};

/* KVC_OK, or KVC_E_NOMEM (the lock is then unusable; kvc_lock_free may still be called). holds:
 * a counter that refuses changes while nonzero (see kvc_lock.holds), or NULL. */
int  kvc_lock_init(kvc_lock *l, const uint32_t *holds);
/* Nobody holds or waits for a lock that is freed. Freeing twice, or a failed init, is harmless. */
void kvc_lock_free(kvc_lock *l);

/* Blocks until the holder hands over to the caller queued by kvc_lock_enter, then holds it. */
void kvc_lock_wait(kvc_lock *l, uint64_t me);
/* Wakes one waiter (kvc_lock_release's slow path). */
void kvc_lock_hand_over(kvc_lock *l);

/* Whether thread me holds the lock (only the holder can find its own token there). */
static inline bool kvc_lock_mine(const kvc_lock *l, uint64_t me) {
    return KVC_LOCK_OWNER(l) == me;
}

/* Never blocks: true when me now holds the lock (it was free, or me held it already); false
 * when another thread holds it: me is then queued and must call kvc_lock_wait. */
static inline bool kvc_lock_enter(kvc_lock *l, uint64_t me) {
    if (KVC_LOCK_OWNER(l) == me) {
        l->depth++;
        return true;
    }
    if (KVC_LOCK_ADD(&l->count, 1) > 0) {
        return false;
    }
    KVC_LOCK_SET_OWNER(l, me);
    l->depth = 1;
    return true;
}

/* For a caller that holds nothing another thread might wait for while it blocks. */
static inline void kvc_lock_acquire(kvc_lock *l, uint64_t me) {
    if (!kvc_lock_enter(l, me)) {
        kvc_lock_wait(l, me);
    }
}

/* Undoes one acquisition of the holder; the last hands the lock to a waiter, if any. */
static inline void kvc_lock_release(kvc_lock *l) {
    if (--l->depth == 0) {
        KVC_LOCK_SET_OWNER(l, 0);
        if (KVC_LOCK_ADD(&l->count, -1) > 1) {
            kvc_lock_hand_over(l);
        }
    }
}

/* For the holder: whether a change may go ahead now (KVC_LOCK_FREE_TO_CHANGE), or why not. */
static inline int kvc_lock_refusal(const kvc_lock *l) {
    if (l->busy) {
        return KVC_LOCK_BUSY;
    }
    if (l->holds != NULL && *l->holds) {
        return KVC_LOCK_RESERVED;
    }
    return KVC_LOCK_FREE_TO_CHANGE;
}

/* Acquire for a change: KVC_LOCK_FREE_TO_CHANGE and held, or the refusal and not held. */
static inline int kvc_lock_acquire_change(kvc_lock *l, uint64_t me) {
    kvc_lock_acquire(l, me);
    const int why = kvc_lock_refusal(l);
    if (why != KVC_LOCK_FREE_TO_CHANGE) {
        kvc_lock_release(l);
    }
    return why;
}

/* Threads blocked in kvc_lock_wait on it now. */
static inline long kvc_lock_waiting(const kvc_lock *l) {
    return KVC_LOCK_LOAD((long *)&l->waiting);
}

#ifdef __cplusplus
}
#endif

#endif
