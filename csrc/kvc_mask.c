/* kvcache — the KQ mask: row kernels (one row of one sequence from its key positions, the rows
 * that see nothing; each output type's encoding lives here and nowhere else), then the strategy
 * that decides which rows and windows (kvc_unified_kq_mask). */
#include "kvc_mask.h"
#include "kvc_mask_memo.h"
#include "kvc_slot.h"
#include "kvc_unified.h"
#include "kvc_types.h"
#include "kvc_common.h"
#include "kvc_simd.h"

#include <math.h>
#include <string.h>

#define KVC_F32_NINF_BITS 0xff800000u
#define KVC_F16_NINF_BITS 0xfc00u
/* bytes of the pattern copied at a time when filling hidden rows that stay in the caches */
#define KVC_FILL_CHUNK ((size_t)4 << 10)

/* Bytes per mask element of dtype. */
static size_t kvc_mask_elsize(int dtype) {
    return dtype == KVC_MASK_F32 ? 4 : dtype == KVC_MASK_F16 ? 2 : 1;
}

/* The scalar definition of every kernel below; the SIMD loops only do more elements at once.
 * (float)(-d), not -(float)d: the reference negates the integer distance, so distance 0 gives
 * +0.0. */
static void kvc_mask_row_scalar(uint8_t *row, int dtype, const int32_t *vis, uint32_t i, uint32_t n,
                                int32_t lo, int32_t hi, int32_t p1, bool alibi) {
    for (; i < n; i++) {
        const int32_t v = vis[i];
        const bool seen = v >= lo && v <= hi;
        float f = -INFINITY;
        if (seen) {
            const int32_t d = v > p1 ? v - p1 : p1 - v;
            f = alibi ? (float)(-d) : 0.0f;
        }
        switch (dtype) {
        case KVC_MASK_F32: memcpy(row + 4 * (size_t)i, &f, 4); break;
        case KVC_MASK_F16: {
            const uint16_t h = seen ? (alibi ? kvc_f32_to_f16(f) : 0) : (uint16_t)KVC_F16_NINF_BITS;
            memcpy(row + 2 * (size_t)i, &h, 2);
            break;
        }
        default: row[i] = (uint8_t)seen; break;
        }
    }
}

#ifdef KVC_HAVE_SSE2
static inline void kvc_store16(void *p, __m128i x, bool stream) {
    if (stream) {
        _mm_stream_si128((__m128i *)p, x);
    } else {
        _mm_storeu_si128((__m128i *)p, x);
    }
}

/* all ones where vis[i..i+3] is outside [lo, hi] */
static inline __m128i kvc_hidden4(const int32_t *vis, __m128i vlo, __m128i vhi) {
    const __m128i v = _mm_loadu_si128((const __m128i *)vis);
    return _mm_or_si128(_mm_cmplt_epi32(v, vlo), _mm_cmpgt_epi32(v, vhi));
}
#endif

/* row[i] for i < n: visible where lo <= vis[i] <= hi (vis[i] is the key position of cell i in
 * the query's sequence, -1 where the cell is empty or not in it; lo >= 0). Visible is 0 (f32,
 * f16; -|vis[i]-p1| with alibi) or 1 (bool); hidden is -inf or 0. `stream` writes with
 * non-temporal stores (for outputs larger than the caches; kvc_stream_fence() afterwards). */
static void kvc_mask_row(void *out, int dtype, const int32_t *vis, uint32_t n, int32_t lo, int32_t hi,
                  int32_t p1, bool alibi, bool stream) {
    uint8_t *row = out;
    uint32_t i = 0;
#ifdef KVC_HAVE_SSE2
    if (!alibi || dtype == KVC_MASK_BOOL) {
        const size_t el = kvc_mask_elsize(dtype);
        /* scalar up to a 16-byte boundary of the output, so that every vector store is aligned */
        uint32_t head = (uint32_t)(((16u - ((uintptr_t)row & 15u)) & 15u) / el);
        if (((uintptr_t)row & (el - 1)) != 0 || head > n) {
            head = n;
        }
        kvc_mask_row_scalar(row, dtype, vis, 0, head, lo, hi, p1, alibi);
        i = head;
        const __m128i vlo = _mm_set1_epi32(lo), vhi = _mm_set1_epi32(hi);
        if (dtype == KVC_MASK_F32) {
            const __m128i ninf = _mm_set1_epi32((int)KVC_F32_NINF_BITS);
            for (; i + 8 <= n; i += 8) {
                kvc_store16(row + 4 * (size_t)i, _mm_and_si128(kvc_hidden4(vis + i, vlo, vhi), ninf), stream);
                kvc_store16(row + 4 * (size_t)i + 16, _mm_and_si128(kvc_hidden4(vis + i + 4, vlo, vhi), ninf), stream);
            }
        } else if (dtype == KVC_MASK_F16) {
            const __m128i ninf = _mm_set1_epi16((short)KVC_F16_NINF_BITS);
            for (; i + 8 <= n; i += 8) {
                /* the 32-bit all-ones/zero lanes saturate to 16-bit all-ones/zero */
                const __m128i h = _mm_packs_epi32(kvc_hidden4(vis + i, vlo, vhi), kvc_hidden4(vis + i + 4, vlo, vhi));
                kvc_store16(row + 2 * (size_t)i, _mm_and_si128(h, ninf), stream);
            }
        } else {
            const __m128i one = _mm_set1_epi8(1);
            for (; i + 16 <= n; i += 16) {
                const __m128i h01 = _mm_packs_epi32(kvc_hidden4(vis + i, vlo, vhi), kvc_hidden4(vis + i + 4, vlo, vhi));
                const __m128i h23 = _mm_packs_epi32(kvc_hidden4(vis + i + 8, vlo, vhi), kvc_hidden4(vis + i + 12, vlo, vhi));
                kvc_store16(row + i, _mm_andnot_si128(_mm_packs_epi16(h01, h23), one), stream);
            }
        }
    }
#else
    (void)stream;
#endif
    kvc_mask_row_scalar(row, dtype, vis, i, n, lo, hi, p1, alibi);
}

/* n elements that see nothing (-inf or 0). */
static void kvc_mask_fill_hidden(void *out, int dtype, size_t n, bool stream) {
    uint8_t *p = out;
    if (dtype == KVC_MASK_BOOL && !stream) {
        memset(p, 0, n);
        return;
    }
    const size_t el = kvc_mask_elsize(dtype);
    if (!stream && n * el >= 4 * KVC_FILL_CHUNK) {
        /* one chunk of the pattern, then copies of it: the C library's copy uses the widest
         * stores the processor has, and the chunk stays in L1/L2 */
        kvc_mask_fill_hidden(p, dtype, KVC_FILL_CHUNK / el, false);
        for (size_t done = KVC_FILL_CHUNK, total = n * el; done < total; done += KVC_FILL_CHUNK) {
            memcpy(p + done, p, total - done < KVC_FILL_CHUNK ? total - done : KVC_FILL_CHUNK);
        }
        return;
    }
    const uint32_t bits = dtype == KVC_MASK_F32 ? KVC_F32_NINF_BITS
                        : dtype == KVC_MASK_F16 ? (KVC_F16_NINF_BITS * 0x10001u) : 0u;
    size_t i = 0;
#ifdef KVC_HAVE_SSE2
    if (((uintptr_t)p & (el - 1)) == 0) {
        for (; i < n && ((uintptr_t)(p + i * el) & 15u); i++) {
            memcpy(p + i * el, &bits, el);
        }
        const __m128i x = _mm_set1_epi32((int)bits);
        const size_t per = 16 / el;
        for (; i + 4 * per <= n; i += 4 * per) {
            uint8_t *q = p + i * el;
            kvc_store16(q, x, stream);
            kvc_store16(q + 16, x, stream);
            kvc_store16(q + 32, x, stream);
            kvc_store16(q + 48, x, stream);
        }
    }
#else
    (void)stream;
#endif
    for (; i < n; i++) {
        memcpy(p + i * el, &bits, el);   /* f16: both halves of the pattern are the same */
    }
}

/* The key positions of sequence s: v[i] = pos[i] where cell i holds s (a cell one sequence
 * holds, bit i of `single`, whose owner[i] is s; or, with planes, bit s & 63 of seq[i]: the cells
 * several hold), else -1 (i < n; `single` from a word's first cell). seq NULL: no cell of the n
 * is held by several (their planes, all 0, are not read). */
static void kvc_mask_key_positions(int32_t *v, const int32_t *pos, const uint16_t *owner, const uint64_t *single,
                                   const uint64_t *seq, uint32_t n, int32_t s) {
    uint32_t i = 0;
    const unsigned bit = (unsigned)(s & 63);
#ifdef KVC_HAVE_SSE2
    const __m128i one = _mm_set1_epi32(1), zero = _mm_setzero_si128(), id = _mm_set1_epi32(s);
    const __m128i lane = _mm_set_epi32(8, 4, 2, 1);
    const __m128i shift = _mm_cvtsi32_si128((int)bit);
    for (; i + 4 <= n; i += 4) {
        /* all ones where the cell is one sequence's and its owner is s */
        const int ones = (int)((single[i >> 6] >> (i & 63)) & 0xfu);
        const __m128i is_one = _mm_cmpeq_epi32(_mm_and_si128(_mm_set1_epi32(ones), lane), lane);
        const __m128i own = _mm_and_si128(
            is_one, _mm_cmpeq_epi32(_mm_unpacklo_epi16(_mm_loadl_epi64((const __m128i *)(owner + i)), zero), id));
        __m128i absent = _mm_set1_epi32(-1);
        if (seq) {
            const __m128i s01 = _mm_srl_epi64(_mm_loadu_si128((const __m128i *)(seq + i)), shift);
            const __m128i s23 = _mm_srl_epi64(_mm_loadu_si128((const __m128i *)(seq + i + 2)), shift);
            /* the low 32 bits of the four words, in order */
            const __m128i lows = _mm_unpacklo_epi64(_mm_shuffle_epi32(s01, _MM_SHUFFLE(2, 0, 2, 0)),
                                                    _mm_shuffle_epi32(s23, _MM_SHUFFLE(2, 0, 2, 0)));
            /* has - 1: 0 where the planes hold s, all ones elsewhere */
            absent = _mm_sub_epi32(_mm_and_si128(lows, one), one);
        }
        absent = _mm_andnot_si128(own, absent);
        _mm_storeu_si128((__m128i *)(v + i), _mm_or_si128(_mm_loadu_si128((const __m128i *)(pos + i)), absent));
    }
#endif
    for (; i < n; i++) {
        const int32_t has = (((single[i >> 6] >> (i & 63)) & 1u) && owner[i] == (uint32_t)s) ||
                            (seq && ((seq[i] >> bit) & 1u));
        v[i] = pos[i] | (has - 1);
    }
}

/* Whether a cell of [i, i + n) is held by several sequences (its planes are read); into
 * single[0 ..], the words of the cells one sequence holds (i a multiple of 64). */
static bool kvc_mask_sets(const kvc_cells *cells, uint32_t i, uint32_t n, uint64_t *single) {
    uint64_t any = 0;
    for (uint32_t w = i >> 6; w <= (i + n - 1) >> 6; w++) {
        any |= cells->seq_many[w];
        single[w - (i >> 6)] = kvc_cells_one_word(cells, w);
    }
    return any != 0;
}

/* The end of the run of blocks marked for sequence s that starts at marked block b (cells
 * [64 b, result)), at most n cells. */
static uint32_t kvc_mask_run_end(const kvc_cells *cells, int32_t s, uint32_t b, uint32_t n) {
    const uint64_t *bits = kvc_cells_blk(cells, s);
    uint32_t e = b + 1;
    while ((uint64_t)e * 64 < n && ((bits[e >> 6] >> (e & 63)) & 1u)) {
        e++;
    }
    return (uint64_t)e * 64 < n ? e * 64 : n;
}

/* Element i of a row: visible (0 or 1, never ALiBi) or hidden. */
static void kvc_mask_set(void *row, int dtype, uint32_t i, bool visible) {
    switch (dtype) {
    case KVC_MASK_F32: {
        const uint32_t bits = visible ? 0u : KVC_F32_NINF_BITS;
        memcpy((uint8_t *)row + 4 * (size_t)i, &bits, 4);
        break;
    }
    case KVC_MASK_F16: {
        const uint16_t bits = visible ? 0u : (uint16_t)KVC_F16_NINF_BITS;
        memcpy((uint8_t *)row + 2 * (size_t)i, &bits, 2);
        break;
    }
    default:
        ((uint8_t *)row)[i] = (uint8_t)visible;
        break;
    }
}

/* Show in a hidden row of n_kv elements the cells of the sequence index entries key[0, n),
 * whose positions are in the row's window [lo, hi] (entries of cells from n_kv on are not in
 * the row). */
static void kvc_mask_show_keys(uint8_t *row, int dtype, const uint64_t *key, uint32_t n, uint32_t n_kv, int32_t lo,
                               int32_t hi, int32_t p1, bool alibi) {
    if (alibi && dtype != KVC_MASK_BOOL) {
        const size_t el = kvc_mask_elsize(dtype);
        for (uint32_t k = 0; k < n; k++) {
            const uint32_t i = kvc_seq_key_cell(key[k]);
            const int32_t v = kvc_seq_key_pos(key[k]);
            if (i < n_kv) {
                kvc_mask_row_scalar(row + (size_t)i * el, dtype, &v, 0, 1, lo, hi, p1, true);
            }
        }
        return;
    }
    /* one loop per type: a visible element is then one constant store */
    switch (dtype) {
#define KVC_SHOW_KEYS(T)                                                                           \
    for (uint32_t k = 0; k < n; k++) {                                                             \
        const uint32_t i = kvc_seq_key_cell(key[k]);                                               \
        if (i < n_kv) {                                                                            \
            kvc_mask_set(row, T, i, true);                                                         \
        }                                                                                          \
    }                                                                                              \
    break;
    case KVC_MASK_F32: KVC_SHOW_KEYS(KVC_MASK_F32)
    case KVC_MASK_F16: KVC_SHOW_KEYS(KVC_MASK_F16)
    default: KVC_SHOW_KEYS(KVC_MASK_BOOL)
#undef KVC_SHOW_KEYS
    }
}

/* --- the strategy ------------------------------------------------------------------------ */


/* Cells of a row built at a time by kvc_mask_row_of: their key positions stay in L1. */
#define KVC_MASK_CHUNK 1024u

/* A row is written from its sequence's index (hidden, then its visible cells over it) while
 * the cells it sees are fewer than 1/KVC_MASK_SPARSE of the cells of the blocks it would read. */
#define KVC_MASK_SPARSE 4u

/* The row of sequence s for a query at p1 that sees key positions [lo, hi], over cells [0, n_kv)
 * of a table. A row that sees few cells (a decode step of many sequences) is filled as hidden
 * and the cells its window takes from the sequence's index (cells_seq_pos_span) are shown over
 * it: the other cells are not read. Otherwise the row is built straight from the cells a chunk
 * at a time, and the blocks of cells the sequence has not marked are filled as hidden without
 * reading the cells. Either way a row costs about its stores plus the sequence's own cells. The
 * first way is not taken when streaming: stores over non-temporal ones would read the lines
 * back. */
static void kvc_mask_row_of(const kvc_cells *cells, uint32_t n_kv, int32_t s, int32_t lo, int32_t hi, int32_t p1,
                            bool alibi, int dtype, bool stream, uint8_t *row) {
    const size_t el = kvc_mask_elsize(dtype);
    int32_t vis[KVC_MASK_CHUNK];
    uint64_t single[KVC_MASK_CHUNK / 64];
    const uint64_t *plane = kvc_cells_seq_plane(cells, s);
    const kvc_pos_range window = {lo, (int64_t)hi + 1};
    uint32_t a, e;
    kvc_cells_seq_pos_span(cells, s, window, &a, &e);
    if (!stream && (uint64_t)(e - a) * KVC_MASK_SPARSE < (uint64_t)kvc_cells_blk_count(cells, s) * 64) {
        kvc_mask_fill_hidden(row, dtype, n_kv, false);
        kvc_mask_show_keys(row, dtype, cells->seq_pos[s].key + a, e - a, n_kv, lo, hi, p1, alibi);
        return;
    }
    uint32_t done = 0;
    for (uint32_t b = kvc_cells_blk_next(cells, s, 0, n_kv); b != UINT32_MAX; ) {
        const uint32_t i0 = b * 64, i1 = kvc_mask_run_end(cells, s, b, n_kv);
        if (i0 > done) {
            kvc_mask_fill_hidden(row + (size_t)done * el, dtype, i0 - done, stream);
        }
        for (uint32_t off = i0; off < i1; off += KVC_MASK_CHUNK) {
            const uint32_t m = i1 - off < KVC_MASK_CHUNK ? i1 - off : KVC_MASK_CHUNK;
            const bool many = kvc_mask_sets(cells, off, m, single);
            kvc_mask_key_positions(vis, cells->pos + off, cells->owner + off, single, many ? plane + off : NULL, m, s);
            kvc_mask_row(row + (size_t)off * el, dtype, vis, m, lo, hi, p1, alibi, stream);
        }
        done = i1;
        b = i1 >= n_kv ? UINT32_MAX : kvc_cells_blk_next(cells, s, i1 / 64, n_kv);
    }
    if (n_kv > done) {
        kvc_mask_fill_hidden(row + (size_t)done * el, dtype, n_kv - done, stream);
    }
}

/* The cells of sequence s (below n_kv) whose positions are in [p0, p1) set visible or hidden.
 * One search for the first: the span is walked (it holds the cells to set). */
static void kvc_mask_set_span(uint8_t *row, int dtype, const kvc_cells *cells, int32_t s, uint32_t n_kv, int64_t p0,
                              int64_t p1, bool visible) {
    if (p0 < 0) {
        p0 = 0;
    }
    if (p0 >= p1 || p0 > KVC_POS_MAX) {
        return;
    }
    const kvc_seq_pos *sp = &cells->seq_pos[s];
    for (uint32_t a = kvc_cells_seq_pos_from(cells, s, (int32_t)p0); a < sp->n && kvc_seq_key_pos(sp->key[a]) < p1;
         a++) {
        const uint32_t i = kvc_seq_key_cell(sp->key[a]);
        if (i < n_kv) {
            kvc_mask_set(row, dtype, i, visible);
        }
    }
}

/* The cells of sequence s with positions in [lo, hi] but not in [olo, ohi] (below the other
 * window and above it) set visible or hidden. */
static void kvc_mask_set_outside(uint8_t *row, int dtype, const kvc_cells *cells, int32_t s, uint32_t n_kv,
                                 int32_t lo, int32_t hi, int32_t olo, int32_t ohi, bool visible) {
    const int64_t below = (int64_t)hi + 1 < olo ? (int64_t)hi + 1 : olo;
    const int64_t above = (int64_t)ohi + 1 > lo ? (int64_t)ohi + 1 : lo;
    kvc_mask_set_span(row, dtype, cells, s, n_kv, lo, below, visible);
    kvc_mask_set_span(row, dtype, cells, s, n_kv, above, (int64_t)hi + 1, visible);
}

/* A share of kvc_mask_rows' rows: entries [k0, k1) of the tokens ordered by sequence. */
typedef struct kvc_mask_part {
    const kvc_unified *c;
    const kvc_cells   *cells;
    const kvc_ubatch  *ub;
    const uint32_t    *order;       /* token indices, grouped by sequence */
    const uint32_t    *first;       /* first[s] .. first[s + 1]: the entries of sequence s */
    uint32_t           k0, k1;
    uint32_t           n_kv, t0;
    bool               causal, alibi, stream;
    int                dtype;
    size_t             row_stride;
    void              *out;
    uint8_t           *base;        /* a scratch row (streaming), else NULL */
} kvc_mask_part;

static void kvc_mask_part_run(void *arg) {
    const kvc_mask_part *p = arg;
    const size_t row_bytes = (size_t)p->n_kv * kvc_mask_elsize(p->dtype);
    int32_t lo0 = 0, hi0 = 0, s0 = -1;
    uint8_t *prev = NULL;
    for (uint32_t k = p->k0; k < p->k1; k++) {
        const uint32_t t = p->order[k];
        const int32_t s = kvc_ubatch_first_id(p->ub, t), p1 = p->ub->pos[t];
        int32_t lo, hi;
        kvc_unified_visible_range(p->c, p1, p->causal, &lo, &hi);
        uint8_t *row = (uint8_t *)p->out + (size_t)(t - p->t0) * p->row_stride;
        if (p->alibi || p->first[s + 1] - p->first[s] == 1) {
            kvc_mask_row_of(p->cells, p->n_kv, s, lo, hi, p1, p->alibi, p->dtype, p->stream, row);
            continue;
        }
        /* the row (or the scratch row) with this token's window */
        uint8_t *dst = p->base ? p->base : row;
        if (s != s0) {
            kvc_mask_row_of(p->cells, p->n_kv, s, lo, hi, p1, false, p->dtype, false, dst);
        } else {
            if (!p->base) {
                kvc_copy(row, prev, row_bytes, false);
            }
            kvc_mask_set_outside(dst, p->dtype, p->cells, s, p->n_kv, lo0, hi0, lo, hi, false);
            kvc_mask_set_outside(dst, p->dtype, p->cells, s, p->n_kv, lo, hi, lo0, hi0, true);
        }
        if (p->base) {
            kvc_copy(row, p->base, row_bytes, true);
        }
        prev = dst;
        s0 = s;
        lo0 = lo;
        hi0 = hi;
    }
    if (p->stream) {
        kvc_stream_fence();
    }
}

/* The rows of tokens [t0, t0 + n_tokens) of the ubatch over cells [0, n_kv) of one cell table,
 * into out (row r is token t0 + r, at r * row_stride bytes). A sequence with one token (or
 * ALiBi, whose values differ in every visible cell) has each row written by kvc_mask_row_of.
 * The rows of a sequence with several tokens differ only in the cells whose positions lie
 * between their windows: its first token's row is built once, and each next row is a copy of
 * the row before with the window moved through the sequence's index (the cells that change
 * sides, a few for tokens at neighbouring positions), so a row costs about as much as writing
 * it. The row before is read back from out while it is in the caches; a streamed mask keeps it
 * in a scratch row instead, and its rows are shared among the cache's n_threads threads when
 * the caller set more than one (each builds the first row of its share afresh). KVC_OK or
 * KVC_E_NOMEM (out untouched). */
static int kvc_mask_rows(const kvc_unified *c, const kvc_cells *cells, uint32_t n_kv, const kvc_ubatch *ub,
                         uint32_t t0, uint32_t n_tokens, bool causal, bool alibi, int dtype, bool stream,
                         size_t row_stride, void *out) {
    if (n_kv == 0 || n_tokens == 0) {
        return KVC_OK;
    }
    const size_t row_bytes = (size_t)n_kv * kvc_mask_elsize(dtype);
    /* the tokens grouped by sequence, in ubatch order within one (a counting sort) */
    uint32_t first[KVC_MAX_SEQ + 1] = {0};
    for (uint32_t t = t0; t < t0 + n_tokens; t++) {
        first[kvc_ubatch_first_id(ub, t) + 1]++;
    }
    bool shared = false;
    for (uint32_t s = 0; s < KVC_MAX_SEQ; s++) {
        shared |= first[s + 1] > 1;
        first[s + 1] += first[s];
    }
    /* threads only when the caller set n_threads, and only for masks that stream (their stores,
     * not the caches, are the cost): a thread costs tens of microseconds to start, and on a busy
     * machine it competes with the caller's own */
    unsigned n_parts = stream && c->n_threads > 1 ? c->n_threads : 1;
    n_parts = n_parts > n_tokens ? n_tokens : n_parts;
    /* a scratch row per share only when streaming: else a sequence's next row starts as a copy
     * of its row before, still in the caches */
    const bool scratch = shared && !alibi && stream;
    const size_t base_stride = (row_bytes + 63) & ~(size_t)63;   /* a row can pass 4 GiB */
    uint32_t *order = kvc_malloc((size_t)n_tokens * sizeof *order);
    uint8_t *base = scratch ? kvc_malloc_n(n_parts, base_stride) : NULL;
    if (!order || (scratch && !base)) {
        kvc_free(order);
        kvc_free(base);
        return KVC_E_NOMEM;
    }
    uint32_t fill[KVC_MAX_SEQ];
    memcpy(fill, first, sizeof fill);
    for (uint32_t t = t0; t < t0 + n_tokens; t++) {
        order[fill[kvc_ubatch_first_id(ub, t)]++] = t;
    }
    kvc_mask_part parts[KVC_MAX_THREADS];
    for (unsigned i = 0; i < n_parts; i++) {
        kvc_mask_part *p = &parts[i];
        *p = (kvc_mask_part){ .c = c, .cells = cells, .ub = ub, .order = order, .first = first,
                              .k0 = (uint32_t)((uint64_t)n_tokens * i / n_parts),
                              .k1 = (uint32_t)((uint64_t)n_tokens * (i + 1) / n_parts), .n_kv = n_kv, .t0 = t0,
                              .causal = causal, .alibi = alibi, .stream = stream, .dtype = dtype,
                              .row_stride = row_stride, .out = out,
                              .base = base ? base + (size_t)i * base_stride : NULL };
    }
    kvc_parallel(kvc_mask_part_run, parts, sizeof parts[0], n_parts);
    kvc_free(base);
    kvc_free(order);
    return KVC_OK;
}

int kvc_unified_kq_mask(const kvc_unified *c, const kvc_ubatch *ub, bool causal, bool alibi, int dtype, bool pad,
                        size_t row_stride, void *out) {
    const uint32_t n_kv = c->n, n_tokens = ub->n_tokens;
    const uint32_t rows = pad ? kvc_pad_u32(n_tokens, KVC_KQ_MASK_PAD) : n_tokens;
    const size_t row_bytes = (size_t)n_kv * kvc_mask_elsize(dtype);
    if (row_stride == 0) {
        row_stride = row_bytes;
    }
    /* masks larger than the last-level cache go straight to memory */
    const bool stream = (size_t)rows * row_bytes >= KVC_STREAM_BYTES;
    const int rc = kvc_mask_rows(c, &c->cells, n_kv, ub, 0, n_tokens, causal, alibi, dtype, stream, row_stride, out);
    if (rc != KVC_OK) {
        return rc;
    }
    /* padding rows see nothing */
    if (rows > n_tokens && n_kv) {
        /* dense rows: one fill; strided rows: the gaps between them are the caller's */
        const uint32_t n_fill = row_stride == row_bytes ? 1 : rows - n_tokens;
        const size_t per = row_stride == row_bytes ? (size_t)(rows - n_tokens) * n_kv : n_kv;
        for (uint32_t r = 0; r < n_fill; r++) {
            kvc_mask_fill_hidden((uint8_t *)out + (size_t)(n_tokens + r) * row_stride, dtype, per, stream);
        }
    }
    if (stream) {
        kvc_stream_fence();
    }
    return KVC_OK;
}

uint32_t kvc_unified_kq_mask_2026_n_kv(const kvc_unified *c, const uint32_t *strm, uint32_t n_groups) {
    uint32_t n_kv = 0;
    for (uint32_t g = 0; g < n_groups; g++) {
        const uint32_t n = kvc_unified_stream_n_kv(c, strm[g]);
        n_kv = n > n_kv ? n : n_kv;
    }
    return n_kv;
}

int kvc_unified_kv_groups_seed(const kvc_unified *c, const kvc_ubatch *ub, uint32_t *strm, uint32_t *n_groups,
                               uint32_t *n_seq_tokens, uint32_t *n_kv, kvc_err *err) {
    (void)err;
    strm[0] = 0;
    *n_groups = 1;
    *n_seq_tokens = ub->n_tokens;
    *n_kv = c->n;
    return KVC_OK;
}

int kvc_unified_kv_groups_streams(const kvc_unified *c, const kvc_ubatch *ub, uint32_t *strm, uint32_t *n_groups,
                                  uint32_t *n_seq_tokens, uint32_t *n_kv, kvc_err *err) {
    const int rc = kvc_unified_groups(c, ub, strm, n_groups, n_seq_tokens, err);
    if (rc == KVC_OK) {
        *n_kv = kvc_unified_kq_mask_2026_n_kv(c, strm, *n_groups);
    }
    return rc;
}

/* The layout of a 2026 mask: its token groups (strm[n_groups], nst tokens each) and n_kv. */
typedef struct kvc_mask_groups {
    uint32_t strm[KVC_MAX_SEQ], n_groups, nst, n_kv;
} kvc_mask_groups;

static int kvc_mask_groups_of(const kvc_unified *c, const kvc_ubatch *ub, kvc_mask_groups *g, kvc_err *err) {
    const int rc = kvc_unified_groups(c, ub, g->strm, &g->n_groups, &g->nst, err);
    if (rc == KVC_OK) {
        g->n_kv = kvc_unified_kq_mask_2026_n_kv(c, g->strm, g->n_groups);
    }
    return rc;
}

/* The M-RoPE causal rule of a ubatch with 2-D positions, over rows already written: a cell of the
 * token's sequence at the token's own position is hidden too when its 2-D position is after the
 * token's. Only cells whose position some token of the group has can be affected: they are
 * collected once per group. KVC_OK or KVC_E_NOMEM. */
static int kvc_mask_2d(const kvc_unified *c, const kvc_ubatch *ub, const kvc_mask_groups *gr, int dtype, void *out) {
    const uint32_t n_kv = gr->n_kv, nst = gr->nst;
    const size_t row_bytes = (size_t)n_kv * kvc_mask_elsize(dtype);
    uint32_t *cand = kvc_malloc_n(n_kv ? n_kv : 1, sizeof *cand);
    if (!cand) {
        return KVC_E_NOMEM;
    }
    for (uint32_t g = 0; g < gr->n_groups; g++) {
        const kvc_cells *cells = kvc_unified_stream_cells_c(c, gr->strm[g]);
        int32_t pmin = INT32_MAX, pmax = -1;
        for (uint32_t t = g * nst; t < (g + 1) * nst; t++) {
            pmin = ub->pos[t] < pmin ? ub->pos[t] : pmin;
            pmax = ub->pos[t] > pmax ? ub->pos[t] : pmax;
        }
        const uint32_t end = n_kv < cells->used_max_p1 ? n_kv : cells->used_max_p1;
        uint32_t n_cand = 0;
        for (uint32_t j = 0; j < end; j++) {
            if (cells->pos[j] >= pmin && cells->pos[j] <= pmax) {
                cand[n_cand++] = j;
            }
        }
        for (uint32_t t = g * nst; t < (g + 1) * nst && n_cand; t++) {
            const int32_t s = kvc_ubatch_first_id(ub, t), p1 = ub->pos[t];
            uint8_t *row = (uint8_t *)out + (size_t)t * row_bytes;
            for (uint32_t k = 0; k < n_cand; k++) {
                const uint32_t j = cand[k];
                if (cells->pos[j] == p1 && kvc_cells_seq_has(cells, j, s) &&
                    kvc_cell_ext_2d_gt(&cells->ext[j], ub->pos_x[t], ub->pos_y[t])) {
                    kvc_mask_set(row, dtype, j, false);
                }
            }
        }
    }
    kvc_free(cand);
    return KVC_OK;
}

/* kvc_unified_kq_mask_2026 of a ubatch whose groups are known. */
static int kvc_mask_2026_write(const kvc_unified *c, const kvc_ubatch *ub, const kvc_mask_groups *gr, bool causal,
                               bool alibi, int dtype, void *out, kvc_err *err) {
    const uint32_t *strm = gr->strm, n_groups = gr->n_groups, nst = gr->nst, n_kv = gr->n_kv;
    const size_t row_bytes = (size_t)n_kv * kvc_mask_elsize(dtype);
    const size_t block = (size_t)nst * row_bytes;
    int rc;
    const bool stream = block * n_groups >= KVC_STREAM_BYTES;
    /* one block of rows per token group, over the cells of the group's stream */
    for (uint32_t g = 0; g < n_groups; g++) {
        const kvc_cells *cells = kvc_unified_stream_cells_c(c, strm[g]);
        void *rows = (uint8_t *)out + g * block;
        rc = kvc_mask_rows(c, cells, n_kv, ub, g * nst, nst, causal, alibi, dtype, stream, row_bytes, rows);
        if (rc != KVC_OK) {
            return kvc_err_set(err, rc, "out of memory building the KQ mask");
        }
    }
    /* only ubatches with 2-D positions (the groups' check refused them without the extension) */
    if (causal && kvc_ubatch_is_2d(ub) && kvc_mask_2d(c, ub, gr, dtype, out) != KVC_OK) {
        return kvc_err_set(err, KVC_E_NOMEM, "out of memory building the KQ mask");
    }
    if (stream) {
        kvc_stream_fence();
    }
    return KVC_OK;
}

int kvc_unified_kq_mask_2026(const kvc_unified *c, const kvc_ubatch *ub, bool causal, bool alibi, int dtype,
                             void *out, kvc_err *err) {
    kvc_mask_groups gr;
    const int rc = kvc_mask_groups_of(c, ub, &gr, err);
    return rc != KVC_OK ? rc : kvc_mask_2026_write(c, ub, &gr, causal, alibi, dtype, out, err);
}

/* --- masks rewritten where the cells changed ----------------------------------------------- */


/* The slot remembering out, or NULL. */
static kvc_mask_slot *kvc_mask_slot_of(const kvc_unified *c, const void *out) {
    struct kvc_mask_memo *m = c->mask_memo;
    for (int k = 0; m && k < KVC_MASK_SLOTS; k++) {
        if (m->slot[k].valid && m->slot[k].out == out) {
            return &m->slot[k];
        }
    }
    return NULL;
}

/* out[0, extent) is being written: every slot whose buffer overlaps it is forgotten. */
static void kvc_mask_forget(kvc_unified *c, const void *out, size_t extent) {
    struct kvc_mask_memo *m = c->mask_memo;
    const uint8_t *a = out;
    for (int k = 0; m && k < KVC_MASK_SLOTS; k++) {
        kvc_mask_slot *sl = &m->slot[k];
        if (sl->valid && sl->out < a + extent && a < sl->out + sl->extent) {
            sl->valid = false;
        }
    }
}

/* A slot for out with room for n_tokens rows (the one remembering it, else the least recently
 * written), or NULL (out of memory: the mask is then not remembered). */
static kvc_mask_slot *kvc_mask_slot_for(kvc_unified *c, const void *out, uint32_t n_tokens) {
    struct kvc_mask_memo *m = c->mask_memo;
    if (!m) {
        m = kvc_calloc(1, sizeof *m);
        if (!m) {
            return NULL;
        }
        c->mask_memo = m;
    }
    kvc_mask_slot *sl = NULL;
    for (int k = 0; k < KVC_MASK_SLOTS && !sl; k++) {
        if (m->slot[k].out == out) {
            sl = &m->slot[k];
        }
    }
    for (int k = 0; k < KVC_MASK_SLOTS && !sl; k++) {
        if (!m->slot[k].valid) {
            sl = &m->slot[k];
        }
    }
    if (!sl) {
        sl = &m->slot[0];
        for (int k = 1; k < KVC_MASK_SLOTS; k++) {
            if (m->slot[k].used < sl->used) {
                sl = &m->slot[k];
            }
        }
    }
    sl->valid = false;
    if (!sl->strm) {
        const kvc_array per_stream[] = { KVC_ARRAY(sl->strm, c->n_stream), KVC_ARRAY(sl->epoch, c->n_stream),
                                         KVC_ARRAY(sl->chg_n, c->n_stream) };
        if (kvc_alloc_arrays(per_stream, sizeof per_stream / sizeof *per_stream) != KVC_OK) {
            return NULL;
        }
    }
    if (sl->cap < n_tokens) {
        int32_t *seq = kvc_realloc_n(sl->seq, n_tokens, sizeof *seq);
        sl->seq = seq ? seq : sl->seq;
        int32_t *lo = kvc_realloc_n(sl->lo, n_tokens, sizeof *lo);
        sl->lo = lo ? lo : sl->lo;
        int32_t *hi = kvc_realloc_n(sl->hi, n_tokens, sizeof *hi);
        sl->hi = hi ? hi : sl->hi;
        if (!seq || !lo || !hi) {
            return NULL;
        }
        sl->cap = n_tokens;
    }
    return sl;
}


/* Bytes from out that a mask of rows rows of n_kv elements, row_stride apart, spans. */
static size_t kvc_mask_extent(uint32_t rows, size_t row_stride, uint32_t n_kv, int dtype) {
    return rows ? (size_t)(rows - 1) * row_stride + (size_t)n_kv * kvc_mask_elsize(dtype) : 0;
}

/* Remember that out now holds the mask of ub over the groups' streams as they are. */
static void kvc_mask_memo_record(kvc_unified *c, const kvc_ubatch *ub, bool causal, bool alibi, int dtype, bool pad,
                                 size_t row_stride, uint32_t rows, uint32_t n_kv, const uint32_t *strm,
                                 uint32_t n_groups, uint32_t nst, const void *out) {
    const size_t extent = kvc_mask_extent(rows, row_stride, n_kv, dtype);
    kvc_mask_forget(c, out, extent);
    /* ALiBi's values follow each token's position: such a mask is always written whole */
    kvc_mask_slot *sl = alibi ? NULL : kvc_mask_slot_for(c, out, ub->n_tokens);
    if (!sl) {
        return;
    }
    sl->out = out;
    sl->extent = extent;
    sl->row_stride = row_stride;
    sl->n_tokens = ub->n_tokens;
    sl->rows = rows;
    sl->n_kv = n_kv;
    sl->n_groups = n_groups;
    sl->nst = nst;
    sl->dtype = dtype;
    sl->causal = causal;
    sl->pad = pad;
    sl->used = ++c->mask_memo->clock;
    for (uint32_t g = 0; g < n_groups; g++) {
        sl->strm[g] = strm[g];
        kvc_cells *cells = kvc_unified_stream_cells(c, strm[g]);
        kvc_cells_log_on(cells);
        sl->epoch[strm[g]] = cells->chg_epoch;
        sl->chg_n[strm[g]] = cells->chg_n;
    }
    for (uint32_t t = 0; t < ub->n_tokens; t++) {
        sl->seq[t] = kvc_ubatch_first_id(ub, t);
        kvc_unified_visible_range(c, ub->pos[t], causal, &sl->lo[t], &sl->hi[t]);
    }
    sl->valid = true;
}

static int kvc_u32_cmp(const void *a, const void *b) {
    const uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
    return (x > y) - (x < y);
}

/* The distinct cells of stream st's log since the slot was written, ascending, into m->cells;
 * their count, or UINT32_MAX when there is no room for them. */
static uint32_t kvc_mask_changed_cells(struct kvc_mask_memo *m, const kvc_mask_slot *sl, const kvc_cells *cells,
                                       uint32_t st) {
    const uint32_t n = cells->chg_n - sl->chg_n[st];
    if (n == 0) {
        return 0;
    }
    if (m->cells_cap < n) {
        uint32_t *a = kvc_realloc_n(m->cells, n, sizeof *a);
        if (!a) {
            return UINT32_MAX;
        }
        m->cells = a;
        m->cells_cap = n;
    }
    memcpy(m->cells, cells->chg + sl->chg_n[st], (size_t)n * sizeof *m->cells);
    qsort(m->cells, n, sizeof *m->cells, kvc_u32_cmp);
    uint32_t k = 0;
    for (uint32_t j = 0; j < n; j++) {
        if (k == 0 || m->cells[k - 1] != m->cells[j]) {
            m->cells[k++] = m->cells[j];
        }
    }
    return k;
}

/* Whether sequence s holds a cell with a position in r that is not among the n changed cells
 * (distinct). */
static bool kvc_mask_unchanged_in(const kvc_cells *cells, int32_t s, kvc_pos_range r, const uint32_t *changed,
                                  uint32_t n) {
    uint32_t n_in = 0;
    for (uint32_t j = 0; j < n; j++) {
        n_in += kvc_cells_seq_has(cells, changed[j], s) && kvc_cells_pos_in(cells, changed[j], r);
    }
    return kvc_cells_seq_pos_count_in(cells, s, r) != n_in;
}

/* The rewrite of what changed, when a slot remembers out with the call's shape (else false:
 * nothing written). */
static bool kvc_mask_patch(kvc_unified *c, const kvc_ubatch *ub, bool causal, bool alibi, int dtype, bool pad,
                           size_t row_stride, uint32_t rows, uint32_t n_kv, const uint32_t *strm, uint32_t n_groups,
                           uint32_t nst, void *out) {
    kvc_mask_slot *sl = kvc_mask_slot_of(c, out);
    if (!sl || alibi || sl->row_stride != row_stride || sl->n_tokens != ub->n_tokens || sl->rows != rows ||
        sl->n_kv != n_kv || sl->n_groups != n_groups || sl->nst != nst || sl->dtype != dtype ||
        sl->causal != causal || sl->pad != pad) {
        return false;
    }
    uint64_t changes = 0;
    for (uint32_t g = 0; g < n_groups; g++) {
        const kvc_cells *cells = kvc_unified_stream_cells_c(c, strm[g]);
        if (sl->strm[g] != strm[g] || sl->epoch[strm[g]] != cells->chg_epoch || sl->chg_n[strm[g]] > cells->chg_n) {
            return false;
        }
        changes += cells->chg_n - sl->chg_n[strm[g]];
    }
    /* patching costs a store per changed cell and row; past a quarter of the mask, write it whole */
    if (changes * ub->n_tokens > (uint64_t)rows * n_kv / 4) {
        return false;
    }
    struct kvc_mask_memo *m = c->mask_memo;
    /* rows written whole go straight to memory when the mask is larger than the caches */
    const bool stream = (size_t)rows * n_kv * kvc_mask_elsize(dtype) >= KVC_STREAM_BYTES;
    for (uint32_t g = 0; g < n_groups; g++) {
        const kvc_cells *cells = kvc_unified_stream_cells_c(c, strm[g]);
        const uint32_t n_chg = kvc_mask_changed_cells(m, sl, cells, strm[g]);
        if (n_chg == UINT32_MAX) {
            if (stream) {
                kvc_stream_fence();
            }
            return false;
        }
        for (uint32_t t = g * nst; t < (g + 1) * nst; t++) {
            const int32_t s = kvc_ubatch_first_id(ub, t), p1 = ub->pos[t];
            int32_t lo, hi;
            kvc_unified_visible_range(c, p1, causal, &lo, &hi);
            uint8_t *row = (uint8_t *)out + (size_t)t * row_stride;
            bool whole = s != sl->seq[t];
            /* the cells of s between the old and the new window's start, and between their ends,
             * change sides: unless every one of them is a changed cell, the row is written whole */
            if (!whole && lo != sl->lo[t]) {
                const kvc_pos_range r = { lo < sl->lo[t] ? lo : sl->lo[t], lo < sl->lo[t] ? sl->lo[t] : lo };
                whole = kvc_mask_unchanged_in(cells, s, r, m->cells, n_chg);
            }
            if (!whole && hi != sl->hi[t]) {
                const int32_t a = hi < sl->hi[t] ? hi : sl->hi[t], b = hi < sl->hi[t] ? sl->hi[t] : hi;
                const kvc_pos_range r = { a + 1, (int64_t)b + 1 };
                whole = kvc_mask_unchanged_in(cells, s, r, m->cells, n_chg);
            }
            if (whole) {
                kvc_mask_row_of(cells, n_kv, s, lo, hi, p1, false, dtype, stream, row);
                continue;
            }
            for (uint32_t j = 0; j < n_chg && m->cells[j] < n_kv; j++) {
                const uint32_t i = m->cells[j];
                kvc_mask_set(row, dtype, i, kvc_cells_seq_has(cells, i, s) && cells->pos[i] >= lo &&
                                            cells->pos[i] <= hi);
            }
        }
    }
    if (stream) {
        kvc_stream_fence();
    }
    return true;
}

int kvc_unified_kq_mask_reuse(kvc_unified *c, const kvc_ubatch *ub, bool causal, bool alibi, int dtype, bool pad,
                              size_t row_stride, void *out, bool reuse) {
    const uint32_t n_kv = c->n, n_tokens = ub->n_tokens;
    const uint32_t rows = pad ? kvc_pad_u32(n_tokens, KVC_KQ_MASK_PAD) : n_tokens;
    if (row_stride == 0) {
        row_stride = (size_t)n_kv * kvc_mask_elsize(dtype);
    }
    const uint32_t strm[1] = {0};
    if (!(reuse && kvc_mask_patch(c, ub, causal, alibi, dtype, pad, row_stride, rows, n_kv, strm, 1, n_tokens, out))) {
        /* out is being rewritten: an error leaves it unknown */
        kvc_mask_forget(c, out, kvc_mask_extent(rows, row_stride, n_kv, dtype));
        const int rc = kvc_unified_kq_mask(c, ub, causal, alibi, dtype, pad, row_stride, out);
        if (rc != KVC_OK) {
            return rc;
        }
    }
    kvc_mask_memo_record(c, ub, causal, alibi, dtype, pad, row_stride, rows, n_kv, strm, 1, n_tokens, out);
    return KVC_OK;
}

int kvc_unified_kq_mask_2026_reuse(kvc_unified *c, const kvc_ubatch *ub, bool causal, bool alibi, int dtype,
                                   void *out, bool reuse, kvc_err *err) {
    kvc_mask_groups gr;
    int rc = kvc_mask_groups_of(c, ub, &gr, err);
    if (rc != KVC_OK) {
        return rc;
    }
    const size_t row_bytes = (size_t)gr.n_kv * kvc_mask_elsize(dtype);
    if (kvc_ubatch_is_2d(ub)) {
        /* the patch knows nothing of the 2-D rule: such a mask is written whole and not remembered */
        kvc_mask_forget(c, out, kvc_mask_extent(ub->n_tokens, row_bytes, gr.n_kv, dtype));
        return kvc_mask_2026_write(c, ub, &gr, causal, alibi, dtype, out, err);
    }
    if (!(reuse && kvc_mask_patch(c, ub, causal, alibi, dtype, false, row_bytes, ub->n_tokens, gr.n_kv, gr.strm,
                                  gr.n_groups, gr.nst, out))) {
        kvc_mask_forget(c, out, kvc_mask_extent(ub->n_tokens, row_bytes, gr.n_kv, dtype));
        rc = kvc_mask_2026_write(c, ub, &gr, causal, alibi, dtype, out, err);
        if (rc != KVC_OK) {
            return rc;
        }
    }
    kvc_mask_memo_record(c, ub, causal, alibi, dtype, false, row_bytes, ub->n_tokens, gr.n_kv, gr.strm, gr.n_groups,
                         gr.nst, out);
    return KVC_OK;
}
