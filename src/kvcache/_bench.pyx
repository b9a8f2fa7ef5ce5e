# cython: language_level=3
"""C-level workloads for `kvcache bench`.

kvcache's C core and the baseline (benchmarks/baseline: the seed's loops with the seed's
containers) run the same operations in one process; the timed loops hold no Python. Each
function returns nanoseconds (and checks that both implementations agree where it can)."""

from libc.stdint cimport int32_t, int64_t, uint32_t, uint64_t, uint8_t, uint16_t
from libc.stdlib cimport malloc, free, calloc
from libc.string cimport memset, memcpy
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


cdef inline uint64_t lcg(uint64_t *state) nogil:
    state[0] = state[0] * 6364136223846793005ULL + 1442695040888963407ULL
    return state[0] >> 33


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

    def fragment(self, double free_fraction, int32_t hole=4):
        """Free random runs of `hole` positions of random sequences until that fraction of the
        cells is free (same holes in both caches)."""
        cdef uint32_t size = self.fast.cells.size
        cdef int32_t s, p
        while self.fast.cells.used > <uint32_t>((1.0 - free_fraction) * size):
            s = <int32_t>(lcg(&self.rng) % self.n_seqs)
            p = <int32_t>(lcg(&self.rng) % (<uint64_t>self.next_pos[s] + 1))
            kvc_unified_seq_rm(&self.fast, s, p, p + hole)
            kvb_seq_rm(self.base, s, p, p + hole)
        self.check()

    def check(self):
        """Both caches agree on head, n and used."""
        if (self.fast.head != kvb_head(self.base) or self.fast.n != kvb_n(self.base)
                or self.fast.cells.used != kvb_used(self.base)):
            raise AssertionError(
                f"kvcache and baseline disagree: head {self.fast.head}/{kvb_head(self.base)} "
                f"n {self.fast.n}/{kvb_n(self.base)} used {self.fast.cells.used}/{kvb_used(self.base)}")

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
        """(ns kvcache, ns baseline) for reps x (find_slot of an n_tokens prompt of a new
        sequence 0 position run + undo), the cache unchanged afterwards."""
        cdef int32_t *pos = <int32_t *>malloc(n_tokens * sizeof(int32_t))
        cdef int32_t *seq = <int32_t *>malloc(n_tokens * sizeof(int32_t))
        cdef uint32_t *off = <uint32_t *>malloc((n_tokens + 1) * sizeof(uint32_t))
        cdef kvc_ubatch ub
        cdef uint32_t i, r
        cdef int ok_fast = 0, ok_base = 0
        cdef uint64_t t0, t1, t2
        cdef int32_t p0 = 1 << 30
        for i in range(n_tokens):
            pos[i] = p0 + <int32_t>i
            seq[i] = 0
            off[i] = i
        off[n_tokens] = n_tokens
        ub.n_tokens = n_tokens
        ub.n_seq_tokens = 1
        ub.n_seqs = n_tokens
        ub.pos = pos
        ub.seq_off = off
        ub.seq_ids = seq
        t0 = perf_counter_ns()
        with nogil:
            for r in range(reps):
                ok_fast += kvc_unified_find_slot(&self.fast, &ub)
                kvc_unified_seq_rm(&self.fast, 0, p0, -1)
                kvc_unified_commit(&self.fast)
        t1 = perf_counter_ns()
        with nogil:
            for r in range(reps):
                ok_base += kvb_find_slot(self.base, n_tokens, pos, seq)
                kvb_seq_rm(self.base, 0, p0, -1)
                kvb_commit(self.base)
        t2 = perf_counter_ns()
        free(pos); free(seq); free(off)
        self.check()
        if ok_fast != ok_base:
            raise AssertionError("kvcache and baseline disagree on prompt placement")
        return t1 - t0, t2 - t1

    def mask(self, uint32_t n_tokens, uint32_t n_mask_seqs, int dtype, uint32_t reps):
        """(ns kvcache, ns baseline (f32 only, else 0), ns memset of the same bytes, bytes) for a
        causal mask of n_tokens tokens spread over n_mask_seqs interleaved sequences at the
        sequences' next positions. Checks the f32 masks agree bit for bit."""
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
        cdef uint32_t i, r, s
        cdef uint64_t t0, t1, t2, t3
        for i in range(n_tokens):
            s = i % n_mask_seqs
            seq[i] = <int32_t>s
            pos[i] = self.next_pos[s] + <int32_t>(i // n_mask_seqs)
            off[i] = i
        off[n_tokens] = n_tokens
        ub.n_tokens = n_tokens
        ub.n_seq_tokens = 1
        ub.n_seqs = n_tokens
        ub.pos = pos
        ub.seq_off = off
        ub.seq_ids = seq
        # fault the output pages in first: a server reuses its mask buffer, and the memset
        # yardstick below writes into pages that are already mapped
        memset(out, 0, nbytes)
        if ref != NULL:
            memset(ref, 0, <size_t>rows * n_kv * 4)
        t0 = perf_counter_ns()
        with nogil:
            for r in range(reps):
                kvc_unified_kq_mask(&self.fast, &ub, True, False, dtype, out)
        t1 = perf_counter_ns()
        if dtype == 0:
            with nogil:
                for r in range(reps):
                    kvb_kq_mask(self.base, n_tokens, pos, seq, 1, ref)
        t2 = perf_counter_ns()
        with nogil:
            for r in range(reps):
                memset(out, r & 0xff, nbytes)
        t3 = perf_counter_ns()
        same = True
        if dtype == 0:
            kvc_unified_kq_mask(&self.fast, &ub, True, False, 0, out)
            same = (<bytes>(<char *>out)[:nbytes]) == (<bytes>(<char *>ref)[:nbytes])
        free(out); free(ref); free(pos); free(seq); free(off)
        if not same:
            raise AssertionError("kvcache and baseline masks differ")
        return t1 - t0, (t2 - t1) if dtype == 0 else 0, t3 - t2, nbytes

    def defrag_plan(self, uint32_t reps, uint32_t n_layer=32):
        """(ns kvcache, ns baseline) per defrag_prepare with an unlimited move budget, each
        repetition from the same fragmented state (restoring is not timed for kvcache; the
        baseline plan is made once, as it cannot be undone cheaply). Checks equal plans."""
        cdef kvc_unified_snapshot snap
        cdef uint64_t t_fast = 0, t0, t1, t_base
        cdef uint32_t r
        cdef int res_fast = 0, res_base
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
                res_base = kvb_defrag_prepare(self.base, 2147483647, n_layer)
            t_base = perf_counter_ns() - t0
        finally:
            kvc_unified_snapshot_free(&snap)
        self.check()
        if res_fast != res_base:
            raise AssertionError("kvcache and baseline disagree on the defrag plan")
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
            # streaming and threads as kvc_unified_defrag_move has them: from KVC_STREAM_BYTES of
            # rows moved
            stream = <size_t>n_moved * self.width * 2 * self.n_layer >= KVC_STREAM_BYTES
            n_jobs = min(kvc_parallel_width(), self.n_layer, 4) if stream else 1
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
            t0 = perf_counter_ns()
            with nogil:
                for r in range(reps):
                    kvc_parallel(floor_layers, jobs, sizeof(FloorJob), n_jobs)
            t0 = perf_counter_ns() - t0
            return t0 // max(reps, 1)
        finally:
            free(runs)
            free(lines)
            free(n_dst)

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
    cdef uint8_t[::1] va = alloc(nbytes), vb = alloc(nbytes)
    cdef uint8_t *a = &va[0]
    cdef uint8_t *b = &vb[0]
    cdef uint32_t r
    cdef uint64_t t0
    memset(a, 1, nbytes)
    memset(b, 2, nbytes)
    t0 = perf_counter_ns()
    with nogil:
        for r in range(reps):
            memcpy(b, a, nbytes)
            a[r % nbytes] = <uint8_t>r
    t0 = perf_counter_ns() - t0
    return t0


from kvcache._core cimport UnifiedCore


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
