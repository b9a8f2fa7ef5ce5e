# cython: language_level=3
# The cimport contract of kvcache: cdef classes and their nogil C-level methods.
# Other extensions write `from kvcache._core cimport UnifiedCore`.

from libc.stdint cimport int32_t, uint32_t, uint64_t
from kvcache.includes.kvc_common cimport kvc_ubatch

# --- locking -----------------------------------------------------------------
# Every object with mutable state (the caches, Batch, SWAPending) carries a kvc_pylock: its
# Python methods hold it for the whole operation, including the loops that run without the
# GIL. The rule that keeps it free of deadlocks with the GIL: nobody blocks on the lock
# while holding the GIL (a busy lock is waited for with the GIL released; PyMutex does this
# itself), and several caches are locked in ascending address order. The lock is reentrant
# for its holder (an iSWA cache holds both of its caches while calling their methods).
# The C-level `*_c` methods below do not lock: their caller serializes (e.g. by holding
# lock_c() / unlock_c() around a loop, or by owning the cache in one thread).
cdef extern from *:
    """
    #ifndef KVC_PYLOCK_DEFINED
    #define KVC_PYLOCK_DEFINED
    #include <string.h>
    #include <pythread.h>
    /* Python >= 3.13 (free-threaded builds among them): a PyMutex, which parks a waiting thread
     * with its thread state detached. Before 3.13: a count of the threads holding or waiting
     * (an atomic add when free, no system call) and a PyThread lock, kept taken, that a waiter
     * blocks on until the holder hands over by releasing it once. */
    typedef struct kvc_pylock {
    #if PY_VERSION_HEX >= 0x030D0000
        PyMutex mutex;
    #else
        long count;                 /* threads holding or waiting for the lock */
        PyThread_type_lock wake;    /* taken; released once per hand-over to a waiter */
    #endif
        unsigned long long owner;   /* thread ident of the holder, 0 when free */
        unsigned long depth;        /* acquisitions by the holder not yet released */
    } kvc_pylock;
    #if PY_VERSION_HEX >= 0x030D0000
    #define KVC_PYLOCK_OWNER(l) _Py_atomic_load_ullong_relaxed(&(l)->owner)
    #define KVC_PYLOCK_SET_OWNER(l, v) _Py_atomic_store_ullong_relaxed(&(l)->owner, (v))
    #else
    #define KVC_PYLOCK_OWNER(l) ((l)->owner)
    #define KVC_PYLOCK_SET_OWNER(l, v) ((l)->owner = (v))
    #if defined(_MSC_VER) && !defined(__clang__)
    #include <intrin.h>
    #define KVC_PYLOCK_ADD(p, v) _InterlockedExchangeAdd((volatile long *)(p), (v))
    #else
    #define KVC_PYLOCK_ADD(p, v) __atomic_fetch_add((p), (v), __ATOMIC_ACQ_REL)
    #endif
    #endif
    /* 0, or -1 when the lock cannot be allocated. */
    static inline int kvc_pylock_init(kvc_pylock *l) {
        memset(l, 0, sizeof *l);
    #if PY_VERSION_HEX < 0x030D0000
        l->wake = PyThread_allocate_lock();
        if (l->wake == NULL) return -1;
        PyThread_acquire_lock(l->wake, WAIT_LOCK);
    #endif
        return 0;
    }
    static inline void kvc_pylock_free(kvc_pylock *l) {
    #if PY_VERSION_HEX < 0x030D0000
        if (l->wake != NULL) {
            PyThread_release_lock(l->wake);   /* nobody waits on a lock that is freed */
            PyThread_free_lock(l->wake);
        }
        l->wake = NULL;
    #else
        (void)l;
    #endif
    }
    /* The holder enters again (only the holder can read its own ident here). */
    static inline int kvc_pylock_reenter(kvc_pylock *l, unsigned long long me) {
        if (KVC_PYLOCK_OWNER(l) != me) return 0;
        l->depth++;
        return 1;
    }
    static inline void kvc_pylock_took(kvc_pylock *l, unsigned long long me) {
        KVC_PYLOCK_SET_OWNER(l, me);
        l->depth = 1;
    }
    /* With a thread state attached (the GIL held, on builds that have one). */
    static inline void kvc_pylock_acquire(kvc_pylock *l) {
        const unsigned long long me = PyThread_get_thread_ident();
        if (kvc_pylock_reenter(l, me)) return;
    #if PY_VERSION_HEX >= 0x030D0000
        PyMutex_Lock(&l->mutex);
    #else
        if (KVC_PYLOCK_ADD(&l->count, 1) > 0) {
            Py_BEGIN_ALLOW_THREADS
            PyThread_acquire_lock(l->wake, WAIT_LOCK);
            Py_END_ALLOW_THREADS
        }
    #endif
        kvc_pylock_took(l, me);
    }
    /* Without a thread state (inside `with nogil:`). */
    static inline void kvc_pylock_acquire_nogil(kvc_pylock *l) {
        const unsigned long long me = PyThread_get_thread_ident();
        if (kvc_pylock_reenter(l, me)) return;
    #if PY_VERSION_HEX >= 0x030D0000
        PyMutex_Lock(&l->mutex);
    #else
        if (KVC_PYLOCK_ADD(&l->count, 1) > 0) {
            PyThread_acquire_lock(l->wake, WAIT_LOCK);
        }
    #endif
        kvc_pylock_took(l, me);
    }
    static inline void kvc_pylock_release(kvc_pylock *l) {
        if (--l->depth == 0) {
            KVC_PYLOCK_SET_OWNER(l, 0);
    #if PY_VERSION_HEX >= 0x030D0000
            PyMutex_Unlock(&l->mutex);
    #else
            if (KVC_PYLOCK_ADD(&l->count, -1) > 1) {
                PyThread_release_lock(l->wake);   /* hand over to one waiter */
            }
    #endif
        }
    }
    #endif
    """
    ctypedef struct kvc_pylock:
        pass
    int  kvc_pylock_init(kvc_pylock *l)
    void kvc_pylock_free(kvc_pylock *l)
    void kvc_pylock_acquire(kvc_pylock *l)
    void kvc_pylock_acquire_nogil(kvc_pylock *l) nogil
    void kvc_pylock_release(kvc_pylock *l) nogil

# --- common ------------------------------------------------------------------
cdef class UBatch:
    cdef kvc_ubatch c              # the C view of the arrays below (pointers into them)
    cdef object _pos               # int32[n_tokens]
    cdef object _seq_off           # uint32[n_seqs + 1]
    cdef object _seq_ids           # int32[total ids]
    cdef object _seq_lists         # list of lists of ints, as given
    cdef readonly object output    # per-token output flags or None
    cdef readonly int max_seq      # largest sequence id (-1 when none)
    cdef int check(self, uint32_t n_seq_max) except -1

# --- unified -----------------------------------------------------------------
from kvcache.includes.kvc_unified cimport *

cdef class UnifiedCore:
    cdef kvc_unified c             # the C cache: cells, head/n, recovery, defrag plan, layer table
    cdef bint _ready               # c is initialised (kvc_unified_free is due)
    cdef uint32_t _n_layer_model   # model layer count given to the constructor
    cdef tuple _layers             # kept model layer indices, ascending (the cache's layer order)
    cdef dict _ikv                 # model layer index -> index into c.layers
    cdef tuple _n_embd_k           # K row width per model layer
    cdef tuple _n_embd_v           # V row width per model layer
    cdef list _k_mem               # per kept layer: K memory as uint8 (owned and aligned, or borrowed); empty without memory
    cdef list _v_mem               # per kept layer: V memory likewise
    cdef list _k_view              # per kept layer: K as the cache dtype, (size, n_embd_k) or (size, row_bytes)
    cdef list _v_view              # per kept layer: V likewise, (n_embd_v, size) when v_trans
    cdef str _buffers              # buffer mode: "owned", "borrowed" or "none" (metadata only)
    cdef object _borrowed          # borrowed mode: the caller's (K, V) objects per kept layer (kept alive)
    cdef tuple _n_embd_head_k      # K head size per model layer, or None (needed by the RoPE K-shift)
    cdef object _rope              # the model's RopeParams, or None (update() rotates K with them)
    cdef kvc_pylock _lock          # held by every Python method (see "locking" above)

    # C-level operations for other extensions (`from kvcache._core cimport UnifiedCore`). They do
    # not validate: sequence ids must lie in [0, n_seq_max) (-1 allowed for seq_rm), ubatches must
    # have passed UBatch.check. They run in _core (where the C core is linked), via the vtable.
    # They do not lock: the caller serializes, e.g. with lock_c() ... unlock_c() around them
    # (from any thread, without the GIL; reentrant for the holder).
    cdef inline void lock_c(self) noexcept nogil:
        kvc_pylock_acquire_nogil(&self._lock)
    cdef inline void unlock_c(self) noexcept nogil:
        kvc_pylock_release(&self._lock)
    cdef int find_slot_c(self, const kvc_ubatch *ub) noexcept nogil        # 1 placed, 0 no room, <0 error
    cdef void commit_c(self) noexcept nogil
    cdef void restore_c(self) noexcept nogil
    cdef bint seq_rm_c(self, int32_t s, int32_t p0, int32_t p1) noexcept nogil
    cdef void seq_cp_c(self, int32_t src, int32_t dst, int32_t p0, int32_t p1) noexcept nogil
    cdef void seq_keep_c(self, int32_t s) noexcept nogil
    cdef void seq_add_c(self, int32_t s, int32_t p0, int32_t p1, int32_t shift) noexcept nogil
    cdef void seq_div_c(self, int32_t s, int32_t p0, int32_t p1, int32_t d) noexcept nogil   # d > 0
    cdef void clear_c(self) noexcept nogil
    cdef void set_full_c(self) noexcept nogil
    cdef int store_c(self, uint32_t ikv, const void *k, const void *v) noexcept nogil        # rows of the placed ubatch; < 0: none placed
    cdef int kq_mask_c(self, const kvc_ubatch *ub, bint causal, bint alibi, int dtype, void *out) noexcept nogil
    cdef void k_shift_c(self, int32_t *out) noexcept nogil
    cdef void reset_shift_c(self) noexcept nogil
    # field reads and header-inline queries: inlined into the caller
    cdef inline int32_t seq_pos_min_c(self, int32_t s) noexcept nogil:
        return kvc_unified_seq_pos_min(&self.c, s)
    cdef inline int32_t seq_pos_max_c(self, int32_t s) noexcept nogil:
        return kvc_unified_seq_pos_max(&self.c, s)
    cdef inline uint32_t head_c(self) noexcept nogil:
        return self.c.head
    cdef inline uint32_t n_c(self) noexcept nogil:
        return self.c.n
    cdef inline uint32_t used_c(self) noexcept nogil:
        return self.c.cells.used

# --- batch -------------------------------------------------------------------
from kvcache.includes.kvc_batch cimport kvc_sbatch, kvc_split_mode

cdef class SplitUBatch(UBatch):
    cdef readonly object ids        # int64[n_tokens]: batch index of each token, in ubatch order
    cdef readonly bint equal_seqs   # False for a simple split

cdef class Batch:
    cdef kvc_sbatch c               # the splitter (owns copies of the batch and the last ubatch)
    cdef kvc_pylock _lock           # held while splitting and reading the split state
    cdef object _split(self, kvc_split_mode mode, object n_ubatch)

# --- recurrent ---------------------------------------------------------------
from kvcache.includes.kvc_recurrent cimport kvc_recurrent

cdef class RecurrentCache:
    cdef kvc_recurrent c           # the C cache: cells, head/n/used, layer table
    cdef bint _ready               # c is initialised (and must be freed)
    cdef list _k                   # per layer: the owned K buffer (uint8, size rows)
    cdef list _v                   # per layer: the owned V buffer (uint8, size rows)
    cdef list _warnings            # messages of the last find_slot
    cdef str _buffers              # buffer mode: "owned", "borrowed" or "none" (metadata only)
    cdef object _borrowed          # borrowed mode: the caller's (K, V) objects per layer (kept alive)
    cdef readonly str type_k       # K type name ("f32", "f16", ...)
    cdef readonly str type_v       # V type name
    cdef kvc_pylock _lock          # held by every Python method (see "locking" above)
    cdef int _seq(self, object seq_id, str name, bint allow_any) except -2
    # C-level calls for other extensions (arguments already checked, no exceptions, no locking:
    # the caller serializes, e.g. with lock_c() ... unlock_c())
    cdef inline void lock_c(self) noexcept nogil:
        kvc_pylock_acquire_nogil(&self._lock)
    cdef inline void unlock_c(self) noexcept nogil:
        kvc_pylock_release(&self._lock)
    cdef int find_slot_c(self, const kvc_ubatch *ub) noexcept nogil
    cdef bint seq_rm_c(self, int32_t seq_id, int32_t p0, int32_t p1) noexcept nogil
    cdef int s_copy_c(self, int32_t *out) noexcept nogil
    cdef int s_mask_c(self, float *out) noexcept nogil

# --- rope --------------------------------------------------------------------
from kvcache.includes.kvc_rope cimport kvc_rope_params

cdef class RopeParams:
    cdef kvc_rope_params c         # the C view; c.freq_factors points into _factors
    cdef object _factors           # float32[n_rot/2] (C-contiguous) or None
    cdef object _layer_base        # dict model layer -> freq_base override, or None
    cdef object _layer_scale       # dict model layer -> freq_scale override, or None
    cdef int fill(self, kvc_rope_params *out, object layer, uint32_t head_dim) except -1

# --- iswa --------------------------------------------------------------------
from kvcache.includes.kvc_iswa cimport kvc_iswa_pending

cdef class SWAPending:
    cdef kvc_iswa_pending c        # per sequence: the smallest and largest position of the last batch
    cdef kvc_pylock _lock          # held by every method
