# cython: language_level=3
"""C-level workloads for `kvcache bench`.

kvcache's C core and the baseline (benchmarks/baseline: mid-2025 llama.cpp's loops with its
containers) run the same operations in one process; the timed loops hold no Python. Each
function returns nanoseconds (and checks that both implementations agree where it can)."""

from libc.stdint cimport int32_t, int64_t, uint32_t, uint64_t, uint8_t, uint16_t, uintptr_t
from libc.stdlib cimport malloc, free, calloc
from libc.string cimport memset, memcpy, memcmp
from kvcache.includes.kvc_common cimport (kvc_ubatch, kvc_err, KVC_TYPE_F16, KVC_STREAM_BYTES, kvc_copy, kvc_stream_fence, kvc_parallel,
                                          kvc_parallel_width)

from time import perf_counter_ns


from kvcache.includes.kvc_cells cimport *
from kvcache.includes.kvc_unified cimport *
from kvcache.includes.kvc_state cimport kvc_unified_state_size, kvc_unified_state_write, kvc_unified_state_read


cdef extern from "kvc_baseline.h" nogil:
    ctypedef struct kvb_cache:
        pass
    ctypedef struct kvb_layer:
        uint8_t *k
        uint8_t *v
        uint32_t k_row_bytes
        uint32_t v_row_bytes
        uint32_t v_el_bytes
        uint32_t n_embd_v
        int32_t type_k
        int32_t type_v
    kvb_cache *kvb_new(uint32_t size, uint32_t n_pad, uint32_t n_swa, int32_t swa_type, int v_trans)
    void kvb_free(kvb_cache *c)
    void kvb_set_layers(kvb_cache *c, uint32_t n_layer, const kvb_layer *layers)
    size_t kvb_state_write(const kvb_cache *c, int32_t seq_id, uint8_t *out, size_t cap)
    int kvb_state_read(kvb_cache *c, int32_t seq_id, const uint8_t *data, size_t len)
    int kvb_find_slot(kvb_cache *c, uint32_t n_tokens, const int32_t *pos, const int32_t *seq)
    void kvb_commit(kvb_cache *c)
    int kvb_seq_rm(kvb_cache *c, int32_t s, int32_t p0, int32_t p1)
    void kvb_kq_mask(const kvb_cache *c, uint32_t n_tokens, const int32_t *pos, const int32_t *seq, int causal, float *out)
    int kvb_defrag_prepare(kvb_cache *c, int32_t n_max_nodes, uint32_t n_layer)
    uint32_t kvb_head(const kvb_cache *c)
    uint32_t kvb_n(const kvb_cache *c)
    uint32_t kvb_used(const kvb_cache *c)
    uint32_t kvb_size(const kvb_cache *c)
    void kvb_cells(const kvb_cache *c, int32_t *pos, uint64_t *seq)
    uint32_t kvb_defrag_ids(const kvb_cache *c, uint32_t *ids)
    void kvb_store(kvb_cache *c, uint32_t il, uint32_t n_tokens, const uint8_t *k, const uint8_t *v)
    int kvb_step(kvb_cache *c, uint32_t n_tokens, const int32_t *pos, const int32_t *seq,
                 const uint8_t *const *k_rows, const uint8_t *const *v_rows, float *mask)


# --- yardsticks -----------------------------------------------------------------------------------
cdef extern from *:
    """
    #include <string.h>
    #include <stdint.h>
    #if defined(__SSE2__) || defined(_M_X64)
    #include <emmintrin.h>
    #define KVB_HAVE_STREAM 1
    #endif
    /* memset with non-temporal stores, the way kvcache writes a mask of KVC_STREAM_BYTES or more:
     * the floor of a write that bypasses the caches (plain memset where there are no such stores). */
    static void kvb_stream_memset(void *dst, int byte, size_t n) {
    #ifdef KVB_HAVE_STREAM
        uint8_t *p = (uint8_t *)dst;
        size_t lead = (16 - ((uintptr_t)p & 15)) & 15, i = 0;
        if (lead > n) lead = n;
        memset(p, byte, lead);
        p += lead;
        n -= lead;
        const __m128i x = _mm_set1_epi8((char)byte);
        for (; i + 64 <= n; i += 64) {
            _mm_stream_si128((__m128i *)(p + i), x);
            _mm_stream_si128((__m128i *)(p + i + 16), x);
            _mm_stream_si128((__m128i *)(p + i + 32), x);
            _mm_stream_si128((__m128i *)(p + i + 48), x);
        }
        for (; i + 16 <= n; i += 16) _mm_stream_si128((__m128i *)(p + i), x);
        memset(p + i, byte, n - i);
        _mm_sfence();
    #else
        memset(dst, byte, n);
    #endif
    }
    """
    void stream_memset "kvb_stream_memset"(void *dst, int byte, size_t n) nogil


cdef uint8_t *_scrub_buf = NULL
cdef size_t SCRUB_BYTES = (<size_t>64) << 20
cdef uint64_t _scrub_sink = 0


cdef void scrub_caches() noexcept nogil:
    """Read 64 MiB (twice a large last-level cache) line by line: afterwards the caches hold
    clean lines of that buffer, and the dirty lines a previous operation left have been written
    back. Called before each timed part, so that none pays for the write-backs of the one before
    it (a memset right after 64 MiB of ordinary stores ran at half its speed here)."""
    global _scrub_buf, _scrub_sink
    cdef size_t i
    cdef uint64_t acc = 0
    if _scrub_buf == NULL:
        _scrub_buf = <uint8_t *>malloc(SCRUB_BYTES)
        if _scrub_buf == NULL:
            return
        memset(_scrub_buf, 1, SCRUB_BYTES)
    for i in range(0, SCRUB_BYTES, 64):
        acc += _scrub_buf[i]
    _scrub_sink += acc


def scrub():
    """Write back what the caches hold dirty and fill them with clean lines (untimed, between the
    timed parts of a case)."""
    with nogil:
        scrub_caches()


cdef struct CopyJob:
    uint8_t *dst
    const uint8_t *src
    size_t n
    bint stream


cdef void copy_job(void *arg) noexcept nogil:
    cdef CopyJob *j = <CopyJob *>arg
    kvc_copy(j.dst, j.src, j.n, j.stream)
    if j.stream:
        kvc_stream_fence()


cdef uint64_t timed_parallel(void (*fn)(void *) noexcept nogil, void *jobs, size_t size, unsigned n_jobs,
                             uint32_t reps):
    """ns per run of fn over n_jobs jobs on that many threads (kvc_parallel), from clean caches."""
    cdef uint32_t r
    cdef uint64_t t0
    with nogil:
        scrub_caches()
    t0 = perf_counter_ns()
    with nogil:
        for r in range(reps):
            kvc_parallel(fn, jobs, size, n_jobs)
    return (perf_counter_ns() - t0) // max(reps, 1)


cdef unsigned move_threads(size_t moved_bytes, uint32_t n_layer) noexcept nogil:
    """The threads kvc_unified_defrag_move uses for a move of that many bytes: it streams (and
    shares the layers among threads) from KVC_STREAM_BYTES on."""
    if moved_bytes < KVC_STREAM_BYTES:
        return 1
    return min(kvc_parallel_width(), n_layer, 4)


cdef enum:
    MASK_KVCACHE = 0
    MASK_BASELINE = 1
    MASK_MEMSET = 2
    MASK_STREAM_MEMSET = 3


cdef struct MaskPart:
    const kvc_unified *c
    const kvb_cache *base
    const kvc_ubatch *ub
    int dtype
    uint8_t *out
    float *ref
    size_t nbytes
    uint32_t n_tokens
    const int32_t *pos
    const int32_t *seq


cdef void run_mask_part(const MaskPart *m, int which, uint32_t n) noexcept nogil:
    cdef uint32_t r
    for r in range(n):
        if which == MASK_KVCACHE:
            kvc_unified_kq_mask(m.c, m.ub, True, False, m.dtype, True, 0, m.out)
        elif which == MASK_BASELINE:
            kvb_kq_mask(m.base, m.n_tokens, m.pos, m.seq, 1, m.ref)
        elif which == MASK_MEMSET:
            memset(m.out, r & 0xff, m.nbytes)
        else:
            stream_memset(m.out, r & 0xff, m.nbytes)


cdef uint64_t timed_mask_part(const MaskPart *m, int which, uint32_t reps):
    """ns for reps runs of one part of the mask case. It starts with clean caches and one
    untimed run: the caches then hold what this part leaves behind, not the dirty lines of the
    part before it (up to a last-level cache of write-backs)."""
    cdef uint64_t t0
    with nogil:
        scrub_caches()
        run_mask_part(m, which, 1)
    t0 = perf_counter_ns()
    with nogil:
        run_mask_part(m, which, reps)
    return perf_counter_ns() - t0


cdef Py_ssize_t cells_differ(const kvc_cells *a, kvb_cache *b):
    """The first cell where kvcache's cells and the baseline's differ (position or sequences),
    -1 when none does."""
    cdef uint32_t n = kvb_size(b), i
    if n != a.size:
        return 0
    cdef int32_t *pos = <int32_t *>malloc(n * sizeof(int32_t))
    cdef uint64_t *seq = <uint64_t *>malloc(n * sizeof(uint64_t))
    if pos == NULL or seq == NULL:
        free(pos); free(seq)
        raise MemoryError()
    kvb_cells(b, pos, seq)
    cdef Py_ssize_t bad = -1
    for i in range(n):
        if pos[i] != a.pos[i] or (pos[i] != -1 and seq[i] != kvc_cells_seq_word(a, i, 0)):
            bad = i
            break
    free(pos); free(seq)
    return bad


#: bytes from which kvcache's masks and moves write with non-temporal stores (KVC_STREAM_BYTES)
STREAM_BYTES = KVC_STREAM_BYTES


cdef inline uint64_t lcg(uint64_t *state) nogil:
    state[0] = state[0] * 6364136223846793005ULL + 1442695040888963407ULL
    return state[0] >> 33


cdef inline void singles_ubatch(kvc_ubatch *ub, uint32_t n_tokens, int32_t *pos, int32_t *seq,
                                uint32_t *off) noexcept nogil:
    # ub over n_tokens tokens, one group each (fills off: off[i] = i)
    cdef uint32_t i
    for i in range(n_tokens + 1):
        off[i] = i
    ub.n_tokens = n_tokens
    ub.n_seq_tokens = 1
    ub.n_seqs = n_tokens
    ub.pos = pos
    ub.seq_off = off
    ub.seq_ids = seq
    ub.pos_x = NULL
    ub.pos_y = NULL
    ub.token = NULL


cdef class Workload:
    """A kvcache cache and a baseline cache driven through the same operations.

    Tokens are placed one per call, round-robin over n_seqs sequences (each sequence's
    positions grow by one); fragment() then punches random seq_rm holes."""
    cdef kvc_unified fast
    cdef kvb_cache *base
    cdef uint32_t n_seqs
    cdef int32_t *next_pos
    cdef uint64_t rng
    cdef bint ready
    # one-token ubatch storage
    cdef int32_t t_pos, t_seq
    cdef uint32_t t_off[2]
    cdef kvc_ubatch ub

    cdef uint32_t n_layer, width
    cdef bint v_trans
    cdef list bufs
    cdef kvb_layer *blayers

    def __cinit__(self, uint32_t size, uint32_t n_seqs=32, uint32_t n_pad=32, uint32_t n_swa=0,
                  int32_t swa_type=0, uint64_t seed=1, uint32_t n_layer=1, uint32_t width=32,
                  bint v_trans=True, bint buffers=False):
        cdef kvc_unified_params p
        cdef kvc_err err
        cdef int32_t *il = <int32_t *>malloc(n_layer * sizeof(int32_t))
        cdef uint32_t *w = <uint32_t *>malloc(n_layer * sizeof(uint32_t))
        cdef uint32_t l
        for l in range(n_layer):
            il[l] = l
            w[l] = width
        memset(&p, 0, sizeof(p))
        p.kv_size = size
        p.n_seq_max = n_seqs
        p.n_pad = n_pad
        p.n_swa = n_swa
        p.swa_type = swa_type
        p.type_k = 1
        p.type_v = 1
        p.v_trans = v_trans
        p.n_layer = n_layer
        p.layer_il = il
        p.n_embd_k = w
        p.n_embd_v = w
        rc = kvc_unified_init(&self.fast, &p, &err)
        free(il)
        free(w)
        if rc != 0:
            raise MemoryError("cannot create the cache")
        self.base = kvb_new(size, n_pad, n_swa, swa_type, v_trans)
        self.n_layer = n_layer
        self.width = width
        self.v_trans = v_trans
        self.bufs = []
        self.blayers = <kvb_layer *>calloc(n_layer, sizeof(kvb_layer))
        if buffers:
            self._attach(size)
        self.next_pos = <int32_t *>calloc(n_seqs, sizeof(int32_t))
        self.n_seqs = n_seqs
        self.rng = seed * 0x9E3779B97F4A7C15ULL + 1
        self.t_off[0] = 0
        self.t_off[1] = 1
        self.ub.n_tokens = 1
        self.ub.n_seq_tokens = 1
        self.ub.n_seqs = 1
        self.ub.pos = &self.t_pos
        self.ub.seq_off = self.t_off
        self.ub.seq_ids = &self.t_seq
        self.ready = True

    def __dealloc__(self):
        if self.ready:
            kvc_unified_free(&self.fast)
            kvb_free(self.base)
            free(self.next_pos)
            free(self.blayers)

    def _attach(self, uint32_t size):
        """f16 K/V buffers for every layer: one set for kvcache, one for the baseline, filled
        with the same bytes."""
        import numpy as np
        from kvcache._core import _aligned_zeros
        cdef uint32_t l
        cdef uint8_t[::1] kf, vf, kb, vb
        rng = np.random.default_rng(0)
        nbytes = <size_t>size * self.width * 2
        for l in range(self.n_layer):
            data = rng.integers(0, 255, size=2 * nbytes, dtype=np.uint8)
            # kvcache's side in memory allocated as its owned K/V memory is
            ka, va = _aligned_zeros(nbytes), _aligned_zeros(nbytes)
            ka[:] = data[:nbytes]
            va[:] = data[nbytes:]
            kf, vf = ka, va
            kb = data[:nbytes].copy()
            vb = data[nbytes:].copy()
            self.bufs += [kf, vf, kb, vb]
            kvc_unified_set_layer_buffers(&self.fast, l, &kf[0], &vf[0])
            self.blayers[l].k = &kb[0]
            self.blayers[l].v = &vb[0]
            self.blayers[l].k_row_bytes = self.width * 2
            self.blayers[l].v_row_bytes = self.width * 2
            self.blayers[l].v_el_bytes = 2
            self.blayers[l].n_embd_v = self.width
            self.blayers[l].type_k = 1
            self.blayers[l].type_v = 1
        kvb_set_layers(self.base, self.n_layer, self.blayers)

    def data_bytes(self, uint32_t n_cells):
        """K+V bytes of n_cells cells over all layers."""
        return <size_t>n_cells * self.width * 2 * 2 * self.n_layer

    cdef size_t row_move_bytes(self, uint32_t n_cells):
        # the bytes kvc_unified_defrag_move counts to choose streaming and threads: the K rows
        # and the V rows of those cells (a transposed V moves by columns and does not count)
        return <size_t>n_cells * self.width * 2 * self.n_layer * (1 if self.v_trans else 2)

    def move_yardstick(self, uint32_t reps):
        """(ns per copy of the bytes the current plan moves with the threads and stores the moves
        use (kvc_copy, streaming from KVC_STREAM_BYTES, the layers shared among threads), the
        number of threads, whether it streams, ns per single memcpy of them), both in memory
        allocated as kvcache's owned K/V memory is."""
        cdef const uint32_t *ids = self.fast.defrag_ids
        cdef uint32_t n = self.fast.n_defrag_ids, i, moved = 0, t
        for i in range(n):
            if ids[i] != i and ids[i] != n:
                moved += 1
        cdef size_t nbytes = self.data_bytes(moved)
        cdef unsigned n_jobs = move_threads(self.row_move_bytes(moved), self.n_layer)
        cdef bint stream = self.row_move_bytes(moved) >= KVC_STREAM_BYTES
        return copy_ns(nbytes, reps, n_jobs, stream), n_jobs, stream, memcpy_ns(nbytes, reps, True) // max(reps, 1)

    cdef inline void next_token(self, uint32_t k) noexcept nogil:
        self.t_seq = <int32_t>(k % self.n_seqs)
        self.t_pos = self.next_pos[self.t_seq]
        self.next_pos[self.t_seq] += 1

    def fill(self, uint32_t n_tokens):
        """Place n_tokens tokens in both caches (untimed); returns how many were placed."""
        cdef uint32_t k
        for k in range(n_tokens):
            self.next_token(k)
            if kvc_unified_find_slot(&self.fast, &self.ub) != 1:
                return k
            kvb_find_slot(self.base, 1, &self.t_pos, &self.t_seq)
            kvc_unified_commit(&self.fast)
            kvb_commit(self.base)
        return n_tokens

    def fragment(self, double free_fraction, int32_t hole=4, uint32_t runs=0, int32_t run_positions=0):
        """Free random runs of `hole` positions of random sequences until that fraction of the
        cells is free (same holes in both caches). First, `runs` windows of `run_positions`
        positions are freed in every sequence: after fill() (round robin) each is a free run of
        run_positions * n_seqs cells, long enough for a prompt."""
        cdef uint32_t size = self.fast.cells.size, k
        cdef int32_t s, p, p_top = self.next_pos[0]
        for s in range(<int32_t>self.n_seqs):
            p_top = min(p_top, self.next_pos[s])
        for k in range(runs):
            p = <int32_t>(lcg(&self.rng) % (<uint64_t>max(p_top - run_positions, 0) + 1))
            for s in range(<int32_t>self.n_seqs):
                kvc_unified_seq_ops.seq_rm(&self.fast, s, p, p + run_positions)
                kvb_seq_rm(self.base, s, p, p + run_positions)
        while self.fast.cells.used > <uint32_t>((1.0 - free_fraction) * size):
            s = <int32_t>(lcg(&self.rng) % self.n_seqs)
            p = <int32_t>(lcg(&self.rng) % (<uint64_t>self.next_pos[s] + 1))
            kvc_unified_seq_ops.seq_rm(&self.fast, s, p, p + hole)
            kvb_seq_rm(self.base, s, p, p + hole)
        self.check()

    def check(self):
        """Both caches agree on head, n, used and every cell (position and sequences)."""
        if (self.fast.head != kvb_head(self.base) or self.fast.n != kvb_n(self.base)
                or self.fast.cells.used != kvb_used(self.base)):
            raise AssertionError(
                f"kvcache and baseline disagree: head {self.fast.head}/{kvb_head(self.base)} "
                f"n {self.fast.n}/{kvb_n(self.base)} used {self.fast.cells.used}/{kvb_used(self.base)}")
        bad = cells_differ(&self.fast.cells, self.base)
        if bad >= 0:
            raise AssertionError(f"kvcache and baseline disagree on cell {bad}")

    def _desync(self, int32_t s, int32_t p0, int32_t p1):
        """For the tests: seq_rm on kvcache's side only, so that the agreement checks must fail."""
        kvc_unified_seq_ops.seq_rm(&self.fast, s, p0, p1)

    def find_slot_1tok(self, uint32_t n_ops):
        """(ns kvcache, ns baseline, ops done): n_ops 1-token find_slot+commit on each cache,
        stopping early when the cache is full. The caches end in the same state."""
        cdef uint32_t k, done_fast = 0, done_base = 0
        cdef int32_t *saved = <int32_t *>malloc(self.n_seqs * sizeof(int32_t))
        cdef uint64_t t0, t1, t2
        memcpy(saved, self.next_pos, self.n_seqs * sizeof(int32_t))
        t0 = perf_counter_ns()
        with nogil:
            for k in range(n_ops):
                self.next_token(k)
                if kvc_unified_find_slot(&self.fast, &self.ub) != 1:
                    break
                kvc_unified_commit(&self.fast)
                done_fast += 1
        t1 = perf_counter_ns()
        memcpy(self.next_pos, saved, self.n_seqs * sizeof(int32_t))
        with nogil:
            for k in range(n_ops):
                self.next_token(k)
                if kvb_find_slot(self.base, 1, &self.t_pos, &self.t_seq) != 1:
                    break
                kvb_commit(self.base)
                done_base += 1
        t2 = perf_counter_ns()
        free(saved)
        self.check()
        if done_fast != done_base:
            raise AssertionError(f"kvcache placed {done_fast} tokens, baseline {done_base}")
        return t1 - t0, t2 - t1, done_fast

    def prompt(self, uint32_t n_tokens, uint32_t reps):
        """(ns kvcache, ns baseline, prompts placed) for reps x (find_slot of an n_tokens prompt
        of a new sequence 0 position run + undo), the cache unchanged afterwards. Both must place
        the same prompts at the same cells, and at least one."""
        cdef int32_t *pos = <int32_t *>malloc(n_tokens * sizeof(int32_t))
        cdef int32_t *seq = <int32_t *>malloc(n_tokens * sizeof(int32_t))
        cdef uint32_t *off = <uint32_t *>malloc((n_tokens + 1) * sizeof(uint32_t))
        cdef kvc_ubatch ub
        cdef uint32_t i, r
        cdef int ok_fast = 0, ok_base = 0, placed
        cdef uint64_t t0, t1, t2
        cdef int32_t p0 = 1 << 30
        # where each repetition placed its prompt (-1: not placed), on each side
        cdef int64_t *at_fast = <int64_t *>malloc(reps * sizeof(int64_t))
        cdef int64_t *at_base = <int64_t *>malloc(reps * sizeof(int64_t))
        for i in range(n_tokens):
            pos[i] = p0 + <int32_t>i
            seq[i] = 0
        singles_ubatch(&ub, n_tokens, pos, seq, off)
        t0 = perf_counter_ns()
        with nogil:
            for r in range(reps):
                placed = kvc_unified_find_slot(&self.fast, &ub)
                ok_fast += placed
                at_fast[r] = self.fast.head if placed == 1 else -1
                kvc_unified_seq_ops.seq_rm(&self.fast, 0, p0, -1)
                kvc_unified_commit(&self.fast)
        t1 = perf_counter_ns()
        with nogil:
            for r in range(reps):
                placed = kvb_find_slot(self.base, n_tokens, pos, seq)
                ok_base += placed
                at_base[r] = kvb_head(self.base) if placed else -1
                kvb_seq_rm(self.base, 0, p0, -1)
                kvb_commit(self.base)
        t2 = perf_counter_ns()
        same = memcmp(at_fast, at_base, reps * sizeof(int64_t)) == 0
        free(pos); free(seq); free(off); free(at_fast); free(at_base)
        self.check()
        if ok_fast != ok_base or not same:
            raise AssertionError(f"kvcache and baseline disagree on prompt placement ({ok_fast} / {ok_base} placed)")
        if ok_fast <= 0:
            raise AssertionError("no prompt was placed: the case would time a failed search")
        return t1 - t0, t2 - t1, ok_fast

    def mask(self, uint32_t n_tokens, uint32_t n_mask_seqs, int dtype, uint32_t reps):
        """(ns kvcache, ns baseline (f32 only, else 0), ns memset of the same bytes, ns streaming
        memset of them, bytes) for a causal mask of n_tokens tokens spread over n_mask_seqs
        interleaved sequences at the sequences' next positions, reps times each. Checks the f32
        masks agree bit for bit."""
        cdef uint32_t n_kv = self.fast.n
        cdef uint32_t rows = ((n_tokens + 63) // 64) * 64
        cdef size_t el = 4 if dtype == 0 else (2 if dtype == 1 else 1)
        cdef size_t nbytes = <size_t>rows * n_kv * el
        cdef uint8_t *out = <uint8_t *>malloc(nbytes)
        cdef float *ref = <float *>malloc(<size_t>rows * n_kv * 4) if dtype == 0 else NULL
        cdef int32_t *pos = <int32_t *>malloc(n_tokens * sizeof(int32_t))
        cdef int32_t *seq = <int32_t *>malloc(n_tokens * sizeof(int32_t))
        cdef uint32_t *off = <uint32_t *>malloc((n_tokens + 1) * sizeof(uint32_t))
        cdef kvc_ubatch ub
        cdef uint32_t i, s
        cdef uint64_t t_fast, t_base, t_memset, t_stream
        for i in range(n_tokens):
            s = i % n_mask_seqs
            seq[i] = <int32_t>s
            pos[i] = self.next_pos[s] + <int32_t>(i // n_mask_seqs)
        singles_ubatch(&ub, n_tokens, pos, seq, off)
        # fault the output pages in first: a server reuses its mask buffer, and the memset
        # yardsticks below write into pages that are already mapped
        memset(out, 0, nbytes)
        if ref != NULL:
            memset(ref, 0, <size_t>rows * n_kv * 4)
        cdef MaskPart part
        part.c, part.base, part.ub, part.dtype, part.out, part.ref = &self.fast, self.base, &ub, dtype, out, ref
        part.nbytes, part.n_tokens, part.pos, part.seq = nbytes, n_tokens, pos, seq
        t_fast = timed_mask_part(&part, MASK_KVCACHE, reps)
        t_base = timed_mask_part(&part, MASK_BASELINE, reps) if dtype == 0 else 0
        t_memset = timed_mask_part(&part, MASK_MEMSET, reps)
        t_stream = timed_mask_part(&part, MASK_STREAM_MEMSET, reps)
        same = True
        if dtype == 0:
            kvc_unified_kq_mask(&self.fast, &ub, True, False, 0, True, 0, out)
            same = memcmp(out, ref, nbytes) == 0
        free(out); free(ref); free(pos); free(seq); free(off)
        if not same:
            raise AssertionError("kvcache and baseline masks differ")
        return t_fast, t_base, t_memset, t_stream, nbytes

    def defrag_plan(self, uint32_t reps):
        """(ns kvcache, ns baseline) per defrag_prepare with an unlimited move budget from the
        current (fragmented) state: kvcache's plan reps times from a snapshot of it (restoring
        is not timed), the baseline's once (it cannot be undone cheaply; a fresh workload per
        repetition pairs the two). Checks both made the same plan (every cell's destination)
        and left the same cells."""
        cdef kvc_unified_snapshot snap
        cdef uint64_t t_fast = 0, t0, t_base
        cdef uint32_t r, n_ids
        cdef int res_fast = 0, res_base
        cdef uint32_t *ids = NULL
        if kvc_unified_snapshot_take(&self.fast, &snap) != 0:
            raise MemoryError()
        try:
            for r in range(reps):
                kvc_unified_snapshot_restore(&self.fast, &snap)
                t0 = perf_counter_ns()
                with nogil:
                    res_fast = kvc_unified_defrag_prepare(&self.fast, 2147483647)
                t_fast += perf_counter_ns() - t0
            t0 = perf_counter_ns()
            with nogil:
                res_base = kvb_defrag_prepare(self.base, 2147483647, self.n_layer)
            t_base = perf_counter_ns() - t0
        finally:
            kvc_unified_snapshot_free(&snap)
        if res_fast != res_base:
            raise AssertionError(f"kvcache and baseline disagree on the defrag plan ({res_fast} / {res_base})")
        n_ids = kvb_defrag_ids(self.base, NULL)
        if n_ids != self.fast.n_defrag_ids:
            raise AssertionError(f"the defrag plans have {self.fast.n_defrag_ids} / {n_ids} entries")
        ids = <uint32_t *>malloc((n_ids + 1) * sizeof(uint32_t))
        kvb_defrag_ids(self.base, ids)
        same = memcmp(ids, self.fast.defrag_ids, n_ids * sizeof(uint32_t)) == 0
        free(ids)
        if not same:
            raise AssertionError("kvcache and baseline made different defrag plans")
        self.check()
        return t_fast // reps, t_base

    def defrag_move(self, uint32_t reps):
        """(ns per defrag_move of the current plan, bytes it moves). Each repetition replays the
        same plan (the data moves again; the cost is the same)."""
        cdef const uint32_t *ids = self.fast.defrag_ids
        cdef uint32_t n = self.fast.n_defrag_ids, i, moved = 0, r
        cdef uint64_t t0
        for i in range(n):
            if ids[i] != i and ids[i] != n:
                moved += 1
        scrub_caches()
        t0 = perf_counter_ns()
        with nogil:
            for r in range(reps):
                self.fast.defrag_pending = True   # the same plan again: only its first move is real
                kvc_unified_defrag_move(&self.fast)
        t0 = perf_counter_ns() - t0
        return t0 // max(reps, 1), self.data_bytes(moved)

    def defrag_move_floor(self, uint32_t reps):
        """ns per run of the least-traffic sweep for the current plan (see floor_layers), or
        None where it does not apply (V not transposed, not f16, rows not whole lines)."""
        cdef size_t size = self.fast.cells.size, row_bytes = size * 2, n_lines = row_bytes // 64
        cdef const uint32_t *ids = self.fast.defrag_ids
        cdef uint32_t n = self.fast.n_defrag_ids, i, n_runs, t, n_jobs, r, n_moved = 0
        cdef bint stream
        cdef uint32_t *runs = NULL
        cdef uint8_t *lines = NULL
        cdef uint16_t *n_dst = NULL
        cdef FloorJob jobs[4]
        cdef uint64_t t0
        if not self.v_trans or self.fast.type_v != KVC_TYPE_F16 or row_bytes % 64 or not self.bufs:
            return None
        n_runs = kvc_unified_defrag_runs(&self.fast, NULL)
        runs = <uint32_t *>malloc((n_runs + 1) * 3 * sizeof(uint32_t))
        lines = <uint8_t *>calloc(n_lines, 1)
        n_dst = <uint16_t *>calloc(n_lines, sizeof(uint16_t))
        try:
            if runs == NULL or lines == NULL or n_dst == NULL:
                raise MemoryError()
            kvc_unified_defrag_runs(&self.fast, runs)
            for i in range(n):
                if ids[i] != i and ids[i] != n:
                    n_moved += 1
                    lines[i * 2 // 64] |= LINE_READ
                    lines[ids[i] * 2 // 64] |= LINE_WRITE
                    n_dst[ids[i] * 2 // 64] += 1
            for i in range(n_lines):
                if n_dst[i] == 32 and not (lines[i] & LINE_READ):
                    lines[i] = LINE_FULL
                elif lines[i] & LINE_WRITE:
                    lines[i] |= LINE_READ
            # streaming and threads as kvc_unified_defrag_move has them
            n_jobs = move_threads(self.row_move_bytes(n_moved), self.n_layer)
            stream = self.row_move_bytes(n_moved) >= KVC_STREAM_BYTES
            for t in range(n_jobs):
                jobs[t].c = &self.fast
                jobs[t].l0 = <uint32_t>(<uint64_t>self.n_layer * t // n_jobs)
                jobs[t].l1 = <uint32_t>(<uint64_t>self.n_layer * (t + 1) // n_jobs)
                jobs[t].runs = runs
                jobs[t].n_runs = n_runs
                jobs[t].lines = lines
                jobs[t].n_lines = n_lines
                jobs[t].key = 0
                jobs[t].acc = 0
                jobs[t].stream = stream
            return timed_parallel(floor_layers, jobs, sizeof(FloorJob), n_jobs, reps)
        finally:
            free(runs)
            free(lines)
            free(n_dst)

    def layer_data(self, uint32_t l):
        """(K, V) of layer l on kvcache's side: uint8 views of the buffers (the baseline holds the
        same bytes)."""
        import numpy as np
        return np.asarray(self.bufs[4 * l]), np.asarray(self.bufs[4 * l + 1])

    def base_layer_data(self, uint32_t l):
        """(K, V) of layer l on the baseline's side: uint8 views of its buffers."""
        import numpy as np
        return np.asarray(self.bufs[4 * l + 2]), np.asarray(self.bufs[4 * l + 3])

    def base_state(self, unsigned char[::1] buf, bint read):
        """(ns, bytes) of the baseline's whole-cache state write into buf, or (read) of its read
        of buf (with mid-2025 llama.cpp's clear), from clean caches."""
        cdef uint64_t t0
        cdef size_t n = 0
        cdef int ok = 1
        scrub_caches()
        t0 = perf_counter_ns()
        with nogil:
            if read:
                ok = kvb_state_read(self.base, -1, &buf[0], buf.shape[0])
            else:
                n = kvb_state_write(self.base, -1, &buf[0], buf.shape[0])
        t0 = perf_counter_ns() - t0
        if not ok:
            raise AssertionError("the baseline's state read failed")
        return t0, (buf.shape[0] if read else n)

    def state_io(self, uint32_t reps):
        """(ns write kvcache, ns write baseline, ns read kvcache, ns read baseline, bytes) for the
        whole-cache state; both blobs must be identical and both reads must succeed."""
        cdef size_t n = kvc_unified_state_size(&self.fast, -1), written = 0, consumed = 0
        cdef uint8_t *a = <uint8_t *>malloc(n + 1)
        cdef uint8_t *b = <uint8_t *>malloc(n + 1)
        cdef uint64_t t0, t1, t2, t3, t4
        cdef uint32_t r, ok_fast = 0, ok_base = 0
        cdef kvc_err err
        if a == NULL or b == NULL:
            free(a); free(b)
            raise MemoryError()
        # fault the pages in first, as the memcpy yardstick does
        memset(a, 0, n)
        memset(b, 0, n)
        try:
            t0 = perf_counter_ns()
            with nogil:
                for r in range(reps):
                    kvc_unified_state_write(&self.fast, -1, a, n, &written)
            t1 = perf_counter_ns()
            with nogil:
                for r in range(reps):
                    kvb_state_write(self.base, -1, b, n)
            t2 = perf_counter_ns()
            if written != n or (<bytes>(<char *>a)[:n]) != (<bytes>(<char *>b)[:n]):
                raise AssertionError("kvcache and baseline state blobs differ")
            with nogil:
                for r in range(reps):
                    ok_fast += kvc_unified_state_read(&self.fast, -1, a, n, &consumed, &err) == 0
            t3 = perf_counter_ns()
            with nogil:
                for r in range(reps):
                    ok_base += kvb_state_read(self.base, -1, b, n)
            t4 = perf_counter_ns()
            if ok_fast != reps or ok_base != reps:
                raise AssertionError("a state read failed")
            return (t1 - t0) // reps, (t2 - t1) // reps, (t3 - t2) // reps, (t4 - t3) // reps, n
        finally:
            free(a)
            free(b)



# --- the least memory traffic a transposed-V defrag allows --------------------------------------
# With V transposed, a moved cell is one element in each V row: a 64-byte line of a row holding a
# source must be read, one holding a destination read and written (written only when every element
# of it is a destination). The sweep makes exactly that traffic, in address order and with no
# other work, the K rows copied as the moves copy them and the layers split among threads as the
# moves split them: a measure, in the same run, of the traffic no implementation of the plan can
# avoid.

cdef enum:
    LINE_READ = 1
    LINE_WRITE = 2
    LINE_FULL = 4      # every element of the line is a destination: written without reading

cdef struct FloorJob:
    kvc_unified *c
    uint32_t l0, l1
    const uint32_t *runs
    uint32_t n_runs
    const uint8_t *lines     # LINE_* per 64-byte line of a V row
    size_t n_lines
    uint64_t key             # 0, read at run time: the lines written keep their values
    uint64_t acc             # the reads' checksum, stored so that they are not optimized away
    bint stream              # the K rows copied with non-temporal stores, as the moves do


cdef void floor_layers(void *arg) noexcept nogil:
    cdef FloorJob *j = <FloorJob *>arg
    cdef kvc_layer *ly
    cdef const uint32_t *u
    cdef uint64_t *w
    cdef uint64_t acc = 0, key = j.key
    cdef size_t row_bytes = <size_t>j.c.cells.size * 2, L
    cdef uint32_t l, q, e, i
    cdef uint8_t kind
    for l in range(j.l0, j.l1):
        ly = &j.c.layers[l]
        for q in range(j.n_runs):
            u = j.runs + 3 * q
            kvc_copy(ly.k + u[1] * ly.k_row_bytes, ly.k + u[0] * ly.k_row_bytes, u[2] * ly.k_row_bytes, j.stream)
        for e in range(ly.n_embd_v):
            for L in range(j.n_lines):
                kind = j.lines[L]
                if kind == 0:
                    continue
                w = <uint64_t *>(ly.v + e * row_bytes + L * 64)
                if kind & LINE_FULL:
                    for i in range(8):
                        w[i] = key
                    continue
                for i in range(8):
                    acc ^= w[i]
                if kind & LINE_WRITE:
                    for i in range(8):
                        w[i] ^= key
    if j.stream:
        kvc_stream_fence()
    j.acc = acc


def memcpy_ns(size_t nbytes, uint32_t reps, bint kv_memory=False):
    """Nanoseconds for reps memcpy of nbytes (the bandwidth yardstick), between plain numpy
    buffers, or with kv_memory between buffers allocated as kvcache's owned K/V memory is (huge
    pages where the system offers them: the yardstick of moves within that memory)."""
    import numpy as np
    from kvcache._core import _aligned_zeros
    alloc = _aligned_zeros if kv_memory else (lambda n: np.zeros(n, dtype=np.uint8))
    return memcpy_into_ns(alloc(nbytes), alloc(nbytes), reps)


def kv_memory(size_t nbytes):
    """A zeroed uint8 array of nbytes allocated as kvcache's owned K/V memory is (huge pages where
    the system offers them)."""
    from kvcache._core import _aligned_zeros
    return _aligned_zeros(nbytes)


def memcpy_into_ns(dst, src, uint32_t reps):
    """Nanoseconds for reps memcpy from the buffer src into the buffer dst (writable, C-contiguous,
    both of len(dst) bytes), written before timing so that their pages are faulted in: the
    yardstick of a copy between memory of those kinds (say a bytearray and huge pages)."""
    cdef uint8_t[::1] vd = memoryview(dst).cast("B"), vs = memoryview(src).cast("B")
    cdef size_t nbytes = <size_t>vd.shape[0]
    if <size_t>vs.shape[0] != nbytes or nbytes == 0:
        raise ValueError(f"src holds {vs.shape[0]} bytes, dst {nbytes}: expected the same number, not 0")
    cdef uint8_t *a = &vs[0]
    cdef uint8_t *b = &vd[0]
    cdef uint32_t r
    cdef uint64_t t0
    memset(a, 1, nbytes)
    memset(b, 2, nbytes)
    scrub_caches()
    t0 = perf_counter_ns()
    with nogil:
        for r in range(reps):
            memcpy(b, a, nbytes)
            a[r % nbytes] = <uint8_t>r
    return perf_counter_ns() - t0


def copy_ns(size_t nbytes, uint32_t reps, unsigned n_threads=1, bint stream=False):
    """Nanoseconds per copy of nbytes split among n_threads threads (kvc_parallel), each part
    with kvc_copy (non-temporal stores with stream), between buffers allocated as kvcache's
    owned K/V memory is: the yardstick of a move that uses those threads and stores."""
    from kvcache._core import _aligned_zeros
    cdef uint8_t[::1] va = _aligned_zeros(nbytes + 1), vb = _aligned_zeros(nbytes + 1)
    cdef CopyJob jobs[4]
    cdef unsigned t, n_jobs = max(1, min(n_threads, 4))
    cdef uint32_t r
    cdef uint64_t t0
    memset(&va[0], 1, nbytes)
    memset(&vb[0], 2, nbytes)
    for t in range(n_jobs):
        jobs[t].src = &va[0] + nbytes * t // n_jobs
        jobs[t].dst = &vb[0] + nbytes * t // n_jobs
        jobs[t].n = nbytes * (t + 1) // n_jobs - nbytes * t // n_jobs
        jobs[t].stream = stream
    return timed_parallel(copy_job, jobs, sizeof(CopyJob), n_jobs, reps)


from kvcache._core cimport UnifiedCore, UBatch


def cimport_call_ns(UnifiedCore cache, uint32_t reps):
    """(ns per seq_pos_max_c, ns per seq_rm_c of an absent range) called from Cython through
    the cimport contract (kvcache/_core.pxd), without the GIL."""
    cdef uint32_t r
    cdef int64_t acc = 0
    cdef uint64_t t0, t1, t2
    # the sequence id depends on the previous answer, so the compiler cannot hoist the call
    t0 = perf_counter_ns()
    with nogil:
        for r in range(reps):
            acc += cache.seq_pos_max_c(<int32_t>(acc & 3))
    t1 = perf_counter_ns()
    with nogil:
        for r in range(reps):
            acc += cache.seq_rm_c(0, 2000000000, 2000000001)
    t2 = perf_counter_ns()
    return (t1 - t0) / reps, (t2 - t1) / reps, acc


# --- the baseline driven from Python: the decode step and the scale cases ------------------------

cdef class Baseline:
    """The baseline's cache (mid-2025 llama.cpp's loops and containers) with K/V memory of the caller's,
    driven from Python one operation at a time, for the cases timed as a server calls kvcache.

    ``Baseline(size, n_layer, width, n_pad=32, v_trans=False)``: f16 K and V rows of ``width``
    elements; ``layer(il)`` gives the (K, V) uint8 arrays of a layer (allocated as kvcache's
    owned K/V memory is, zeros mapped lazily)."""
    cdef kvb_cache *c
    cdef uint32_t n_layer, width, size
    cdef bint v_trans
    cdef list bufs
    cdef kvb_layer *layers

    def __cinit__(self, uint32_t size, uint32_t n_layer, uint32_t width, uint32_t n_pad=32, bint v_trans=False):
        from kvcache._core import _aligned_zeros
        cdef uint8_t[::1] kb, vb
        cdef uint32_t l
        self.c = kvb_new(size, n_pad, 0, 0, v_trans)
        self.layers = <kvb_layer *>calloc(n_layer, sizeof(kvb_layer))
        if self.c == NULL or self.layers == NULL:
            raise MemoryError()
        self.n_layer, self.width, self.size, self.v_trans = n_layer, width, size, v_trans
        self.bufs = []
        nbytes = <size_t>size * width * 2
        for l in range(n_layer):
            kb, vb = _aligned_zeros(nbytes), _aligned_zeros(nbytes)
            self.bufs.append((kb, vb))
            self.layers[l].k = &kb[0]
            self.layers[l].v = &vb[0]
            self.layers[l].k_row_bytes = width * 2
            self.layers[l].v_row_bytes = width * 2
            self.layers[l].v_el_bytes = 2
            self.layers[l].n_embd_v = width
            self.layers[l].type_k = 1
            self.layers[l].type_v = 1
        kvb_set_layers(self.c, n_layer, self.layers)

    def __dealloc__(self):
        if self.c != NULL:
            kvb_free(self.c)
        free(self.layers)

    def layer(self, uint32_t il):
        """(K, V) of layer il: uint8 arrays of size * width * 2 bytes."""
        import numpy as np
        kb, vb = self.bufs[il]
        return np.asarray(kb), np.asarray(vb)

    def counters(self):
        """(head, n, used): where the next slot search starts (where the last find_slot placed),
        the cells the mask spans, the cells in use."""
        return kvb_head(self.c), kvb_n(self.c), kvb_used(self.c)

    def cells(self):
        """(pos int32[size], seq uint64[size]): every cell's position (-1 empty) and sequences."""
        import numpy as np
        pos = np.empty(self.size, dtype=np.int32)
        seq = np.empty(self.size, dtype=np.uint64)
        cdef int32_t[::1] p = pos
        cdef uint64_t[::1] q = seq
        kvb_cells(self.c, &p[0], &q[0])
        return pos, seq

    def find_slot(self, const int32_t[::1] pos, const int32_t[::1] seq):
        """Place one token per (pos, seq) entry: True when placed."""
        if pos.shape[0] != seq.shape[0] or pos.shape[0] == 0:
            raise ValueError("pos and seq need one entry per token")
        cdef int ok
        with nogil:
            ok = kvb_find_slot(self.c, <uint32_t>pos.shape[0], &pos[0], &seq[0])
        return ok == 1

    def commit(self):
        """Forget the last find_slot's recovery snapshots."""
        kvb_commit(self.c)

    def seq_rm(self, int32_t s, int32_t p0=-1, int32_t p1=-1):
        """Remove sequence s from the cells with positions in [p0, p1)."""
        kvb_seq_rm(self.c, s, p0, p1)

    def step(self, const int32_t[::1] pos, const int32_t[::1] seq, const uint64_t[::1] k_rows,
             const uint64_t[::1] v_rows, float[:, ::1] mask):
        """(ns, placed) of one decode step (kvb_step): the ubatch of one token per (pos, seq),
        find_slot, the K/V rows of every layer from the addresses k_rows[il] / v_rows[il]
        (n_tokens rows each), the padded f32 mask into mask, commit."""
        cdef uint32_t n = <uint32_t>pos.shape[0]
        if seq.shape[0] != n or n == 0 or k_rows.shape[0] != self.n_layer or v_rows.shape[0] != self.n_layer:
            raise ValueError("step: one seq per token and one K and V address per layer")
        if mask.shape[0] != (n + 63) // 64 * 64 or mask.shape[1] < 1:
            raise ValueError("step: the mask needs pad(n_tokens, 64) rows")
        cdef uint64_t t0
        cdef int ok
        scrub_caches()
        t0 = perf_counter_ns()
        with nogil:
            ok = kvb_step(self.c, n, &pos[0], &seq[0], <const uint8_t *const *>&k_rows[0],
                          <const uint8_t *const *>&v_rows[0], &mask[0, 0])
        t0 = perf_counter_ns() - t0
        if ok and mask.shape[1] != kvb_n(self.c):
            raise ValueError("step: the mask has n columns")
        return t0, ok == 1


def step_floor_ns(unsigned char[::1] mask, const uint64_t[::1] dst, const uint64_t[::1] src, size_t row_bytes):
    """Nanoseconds of a decode step's floor: writing the mask's bytes at memset speed (with
    non-temporal stores from STREAM_BYTES on, as kvcache writes such masks) and copying the K/V
    rows it stores (memcpy of row_bytes from src[i] to dst[i] for every i): the bytes a step
    must write, written the fastest plain way."""
    cdef size_t nbytes = mask.shape[0]
    cdef Py_ssize_t i, n = dst.shape[0]
    cdef bint stream = nbytes >= KVC_STREAM_BYTES
    cdef uint64_t t0
    if src.shape[0] != n:
        raise ValueError("one source per destination")
    scrub_caches()
    t0 = perf_counter_ns()
    with nogil:
        if stream:
            stream_memset(&mask[0], 0, nbytes)
        else:
            memset(&mask[0], 0, nbytes)
        for i in range(n):
            memcpy(<void *><uintptr_t>dst[i], <const void *><uintptr_t>src[i], row_bytes)
    return perf_counter_ns() - t0


# --- today's llama.cpp loop (benchmarks/baseline/kvc_baseline2026.cpp) ----------------------------

cdef extern from "kvc_baseline2026.h" nogil:
    ctypedef struct kvb26_cache:
        pass
    kvb26_cache *kvb26_new(uint32_t size, uint32_t n_stream, uint32_t n_seq_max, uint32_t n_pad, uint32_t n_swa,
                           int32_t swa_type)
    void kvb26_free(kvb26_cache *c)
    uint32_t kvb26_head(const kvb26_cache *c, uint32_t stream)
    uint32_t kvb26_used(const kvb26_cache *c, uint32_t stream)
    void kvb26_cells(const kvb26_cache *c, uint32_t stream, int32_t *pos, uint64_t *seq)
    int kvb26_find_slot(kvb26_cache *c, uint32_t n_tokens, const int32_t *pos, const uint32_t *seq_off,
                        const int32_t *seq_ids)
    uint32_t kvb26_slot(const kvb26_cache *c, int32_t *streams, int32_t *cells)
    int kvb26_seq_rm(kvb26_cache *c, int32_t s, int32_t p0, int32_t p1)
    int32_t kvb26_seq_pos_min(const kvb26_cache *c, int32_t s)
    int32_t kvb26_seq_pos_max(const kvb26_cache *c, int32_t s)
    int kvb26_mask_shape(const kvb26_cache *c, uint32_t n_tokens, const uint32_t *seq_off, const int32_t *seq_ids,
                         uint32_t *n_blocks, uint32_t *rows, uint32_t *n_kv)
    int kvb26_kq_mask(const kvb26_cache *c, uint32_t n_tokens, const int32_t *pos, const uint32_t *seq_off,
                      const int32_t *seq_ids, int causal, float *out)


def _flat_ubatch(pos, seq_ids):
    """(pos int32, seq_off uint32, seq_ids int32) of a ubatch given one entry per token: an id
    or a list of ids."""
    import numpy as np
    lists = [[int(s)] if isinstance(s, (int, np.integer)) else [int(x) for x in s] for s in seq_ids]
    off = np.zeros(len(lists) + 1, dtype=np.uint32)
    off[1:] = np.cumsum([len(x) for x in lists])
    flat = np.array([x for l in lists for x in l] or [0], dtype=np.int32)
    return np.ascontiguousarray(pos, dtype=np.int32), off, flat


cdef class Baseline2026:
    """Today's llama.cpp cache loop (the team's transcription, kvc_baseline2026.cpp), driven from
    Python: ``Baseline2026(size, n_stream=1, n_seq_max=1, n_pad=1, n_swa=0, swa_type=0)`` with
    ``size`` cells per stream; swa_type 0 none, 1 standard, 2 chunked. Ubatches are given as
    positions and one entry per token of sequence ids (an int or a list)."""
    cdef kvb26_cache *c
    cdef readonly uint32_t size, n_stream, n_seq_max

    def __cinit__(self, uint32_t size, uint32_t n_stream=1, uint32_t n_seq_max=1, uint32_t n_pad=1,
                  uint32_t n_swa=0, int32_t swa_type=0):
        self.c = kvb26_new(size, n_stream, n_seq_max, n_pad, n_swa, swa_type)
        if self.c == NULL:
            raise ValueError("n_stream must be 1 or n_seq_max, n_seq_max in [1, 256]")
        self.size, self.n_stream, self.n_seq_max = size, n_stream, n_seq_max

    def __dealloc__(self):
        if self.c != NULL:
            kvb26_free(self.c)

    @property
    def heads(self):
        """The head of each stream."""
        return tuple(kvb26_head(self.c, s) for s in range(self.n_stream))

    @property
    def used(self):
        """The cells in use in each stream."""
        return tuple(kvb26_used(self.c, s) for s in range(self.n_stream))

    def cells(self, uint32_t stream=0):
        """(pos int32[size], seq uint64[size, 4]) of a stream: positions (-1 empty) and 256
        sequence bits per cell."""
        import numpy as np
        if stream >= self.n_stream:
            raise ValueError("no such stream")
        pos = np.empty(self.size, dtype=np.int32)
        seq = np.empty((self.size, 4), dtype=np.uint64)
        cdef int32_t[::1] p = pos
        cdef uint64_t[:, ::1] q = seq
        kvb26_cells(self.c, stream, &p[0], &q[0, 0])
        return pos, seq

    def find_slot(self, pos, seq_ids):
        """find_slot(ubatch, cont=false) and apply_ubatch: True placed, False no slot (nothing
        changed); ValueError for a ubatch the cache cannot take."""
        p, o, f = _flat_ubatch(pos, seq_ids)
        cdef int32_t[::1] pv = p
        cdef uint32_t[::1] ov = o
        cdef int32_t[::1] fv = f
        if p.shape[0] == 0 or p.shape[0] + 1 != o.shape[0]:
            raise ValueError("one entry of sequence ids per position, at least one token")
        cdef int rc
        with nogil:
            rc = kvb26_find_slot(self.c, <uint32_t>pv.shape[0], &pv[0], &ov[0], &fv[0])
        if rc < 0:
            raise ValueError("a ubatch this cache cannot take")
        return rc == 1

    def slot(self):
        """(streams, cells) int32 arrays: where the last successful find_slot put each token."""
        import numpy as np
        cdef uint32_t n = kvb26_slot(self.c, NULL, NULL)
        st = np.empty(n, dtype=np.int32)
        ce = np.empty(n, dtype=np.int32)
        cdef int32_t[::1] a = st
        cdef int32_t[::1] b = ce
        if n:
            kvb26_slot(self.c, &a[0], &b[0])
        return st, ce

    def seq_rm(self, int32_t s, int32_t p0=-1, int32_t p1=-1):
        """Remove sequence s (-1: every one) from the cells with positions in [p0, p1)."""
        if not -1 <= s < <int32_t>self.n_seq_max:
            raise ValueError("no such sequence")
        kvb26_seq_rm(self.c, s, p0, p1)

    def seq_pos_min(self, int32_t s):
        """Smallest position of sequence s, -1 when absent."""
        if not 0 <= s < <int32_t>self.n_seq_max:
            raise ValueError("no such sequence")
        return kvb26_seq_pos_min(self.c, s)

    def seq_pos_max(self, int32_t s):
        """Largest position of sequence s, -1 when absent."""
        if not 0 <= s < <int32_t>self.n_seq_max:
            raise ValueError("no such sequence")
        return kvb26_seq_pos_max(self.c, s)

    def kq_mask(self, pos, seq_ids, bint causal=True, out=None):
        """The f32 KQ mask [blocks, rows, n_kv] of a ubatch (no padding rows), into out when
        given (a C-contiguous float32 array of that shape)."""
        import numpy as np
        p, o, f = _flat_ubatch(pos, seq_ids)
        cdef int32_t[::1] pv = p
        cdef uint32_t[::1] ov = o
        cdef int32_t[::1] fv = f
        cdef uint32_t nb, rows, n_kv
        if p.shape[0] == 0 or p.shape[0] + 1 != o.shape[0] or kvb26_mask_shape(self.c, <uint32_t>pv.shape[0], &ov[0], &fv[0], &nb, &rows, &n_kv) != 0:
            raise ValueError("a ubatch this cache cannot take")
        if out is None:
            out = np.empty((nb, rows, n_kv), dtype=np.float32)
        elif out.shape != (nb, rows, n_kv) or out.dtype != np.float32 or not out.flags.c_contiguous:
            raise ValueError(f"out must be a C-contiguous float32 array of shape {(nb, rows, n_kv)}")
        cdef float[:, :, ::1] ov3 = out
        with nogil:
            kvb26_kq_mask(self.c, <uint32_t>pv.shape[0], &pv[0], &ov[0], &fv[0], causal, &ov3[0, 0, 0])
        return out

    def kq_mask_ns(self, pos, seq_ids, out, uint32_t reps):
        """ns per f32 KQ mask of a ubatch into out (as kq_mask), reps times in a C loop."""
        self.kq_mask(pos, seq_ids, out=out)     # checks the ubatch and out
        p, o, f = _flat_ubatch(pos, seq_ids)
        cdef int32_t[::1] pv = p
        cdef uint32_t[::1] ov = o
        cdef int32_t[::1] fv = f
        cdef float[:, :, ::1] ov3 = out
        cdef uint32_t r
        cdef uint64_t t0 = perf_counter_ns()
        with nogil:
            for r in range(reps):
                kvb26_kq_mask(self.c, <uint32_t>pv.shape[0], &pv[0], &ov[0], &fv[0], True, &ov3[0, 0, 0])
        return (perf_counter_ns() - t0) // max(reps, 1)

    def run(self, list ubatches, int32_t undo_seq=-2, int32_t undo_p0=0):
        """(ns, placed) for find_slot of each ubatch in turn in a C loop (ubatches: a list of
        (pos, seq_ids) as find_slot takes them, converted before timing); with undo_seq >= 0 each
        placement is undone right after by seq_rm(undo_seq, undo_p0, -1)."""
        import numpy as np
        conv = [_flat_ubatch(p, s) for p, s in ubatches]
        cdef Py_ssize_t n = len(conv), k
        cdef const int32_t **pp = <const int32_t **>malloc((n + 1) * sizeof(void *))
        cdef const uint32_t **oo = <const uint32_t **>malloc((n + 1) * sizeof(void *))
        cdef const int32_t **ff = <const int32_t **>malloc((n + 1) * sizeof(void *))
        cdef uint32_t *nt = <uint32_t *>malloc((n + 1) * sizeof(uint32_t))
        cdef int32_t[::1] pv
        cdef uint32_t[::1] ov
        cdef int32_t[::1] fv
        cdef uint64_t t0
        cdef int placed = 0, rc
        try:
            for k in range(n):
                pv, ov, fv = conv[k]
                pp[k], oo[k], ff[k], nt[k] = &pv[0], &ov[0], &fv[0], <uint32_t>pv.shape[0]
            t0 = perf_counter_ns()
            with nogil:
                for k in range(n):
                    rc = kvb26_find_slot(self.c, nt[k], pp[k], oo[k], ff[k])
                    if rc == 1:
                        placed += 1
                        if undo_seq >= 0:
                            kvb26_seq_rm(self.c, undo_seq, undo_p0, -1)
            return perf_counter_ns() - t0, placed
        finally:
            free(pp); free(oo); free(ff); free(nt)


def cimport_find_slot_ns(UnifiedCore cache, list ubatches, int32_t undo_seq=-2, int32_t undo_p0=0):
    """(ns, placed) for find_slot_c + commit_c of each UBatch in turn through the cimport contract
    (no Python in the loop); with undo_seq >= 0 each placement is undone right after by
    seq_rm_c(undo_seq, undo_p0, -1). The ubatches are checked against the cache first."""
    from kvcache._core import UBatch as PyUBatch
    cdef Py_ssize_t n = len(ubatches), k
    cdef const kvc_ubatch **ub = <const kvc_ubatch **>malloc((n + 1) * sizeof(void *))
    cdef UBatch u
    cdef uint64_t t0, t1
    cdef int placed = 0, locked
    try:
        for k in range(n):
            if not isinstance(ubatches[k], PyUBatch):
                raise TypeError("ubatches must be kvcache.UBatch objects")
            u = <UBatch>ubatches[k]
            u.check(cache.n_seq_max_c())
            ub[k] = &u.c
        # lock_c() may wait: called without the GIL (kvcache/_core.pxd)
        with nogil:
            locked = cache.lock_c()
        if locked != 0:
            raise RuntimeError("the cache is in the middle of an operation")
        t0 = perf_counter_ns()
        with nogil:
            for k in range(n):
                if cache.find_slot_c(ub[k]) == 1:
                    placed += 1
                    cache.commit_c()
                    if undo_seq >= 0:
                        cache.seq_rm_c(undo_seq, undo_p0, -1)
        t1 = perf_counter_ns()
        cache.unlock_c()
        return t1 - t0, placed
    finally:
        free(ub)
