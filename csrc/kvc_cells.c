#include "kvc_cells.h"

#include <stdlib.h>
#include <string.h>

/* Every bit of a per-word summary (free_words, emptied) below n_words set. */
static void kvc_cells_words_all(const kvc_cells *c, uint64_t *bits) {
    const uint32_t n = (c->n_words + 63) / 64;
    for (uint32_t k = 0; k < n; k++) {
        const uint32_t left = c->n_words - 64 * k;
        bits[k] = left >= 64 ? ~(uint64_t)0 : ((uint64_t)1 << left) - 1;
    }
}

/* Every word of used_bits is 0: every bit of free_words below n_words set. */
static void kvc_cells_free_words_all(kvc_cells *c) { kvc_cells_words_all(c, c->free_words); }

int kvc_cells_init(kvc_cells *c, uint32_t size, uint32_t n_seq_max) {
    memset(c, 0, sizeof *c);
    if (n_seq_max > KVC_MAX_SEQ) {
        return KVC_E_ARG;
    }
    c->size = size;
    c->n_seq_max = n_seq_max;
    c->n_words = (size + 63) / 64;
    c->seq_words = kvc_seq_words(n_seq_max);
    /* the arrays read per cell come from kvc_table_calloc (resident, on huge pages) */
    c->pos = kvc_table_calloc(size, sizeof *c->pos);
    c->shift = kvc_table_calloc(size, sizeof *c->shift);
    c->seq = kvc_table_calloc((uint64_t)c->seq_words * size, sizeof *c->seq);
    c->n_seqs = kvc_table_calloc(size, sizeof *c->n_seqs);
    c->owner = kvc_table_calloc(size, sizeof *c->owner);
    c->seq_some = kvc_table_calloc(c->n_words, sizeof *c->seq_some);
    c->seq_many = kvc_table_calloc(c->n_words, sizeof *c->seq_many);
    c->used_bits = kvc_calloc(c->n_words, sizeof *c->used_bits);
    c->free_words = kvc_calloc((c->n_words + 63) / 64 + 1, sizeof *c->free_words);
    c->emptied = kvc_calloc((c->n_words + 63) / 64 + 1, sizeof *c->emptied);
    c->seq_pos = kvc_calloc(n_seq_max ? n_seq_max : 1, sizeof *c->seq_pos);
    c->blk_words = (c->n_words + 63) / 64;
    c->seq_blk = kvc_calloc((size_t)(n_seq_max ? n_seq_max : 1) * (c->blk_words ? c->blk_words : 1), sizeof *c->seq_blk);
    c->chg = kvc_table_calloc(size, sizeof *c->chg);
    bool ok = c->pos && c->shift && c->seq && c->n_seqs && c->owner && c->seq_some && c->seq_many && c->used_bits && c->free_words && c->emptied && c->seq_pos && c->seq_blk && c->chg;
    /* one entry per cell at most: never reallocated, so no operation can fail later */
    for (uint32_t s = 0; ok && s < n_seq_max; s++) {
        c->seq_pos[s].key = kvc_malloc_n(size, sizeof(uint64_t));
        ok = c->seq_pos[s].key != NULL;
    }
    if (!ok) {
        kvc_cells_free(c);
        return KVC_E_NOMEM;
    }
    for (uint32_t i = 0; i < size; i++) {
        c->pos[i] = -1;
    }
    kvc_cells_free_words_all(c);
    kvc_cells_words_all(c, c->emptied);
    return KVC_OK;
}

int kvc_cells_ext_enable(kvc_cells *c) {
    kvc_cell_ext *e = kvc_table_calloc(c->size, sizeof *e);
    if (!e) {
        return KVC_E_NOMEM;
    }
    for (uint32_t i = 0; i < c->size; i++) {
        e[i] = kvc_cell_ext_default();
    }
    kvc_free(c->ext);
    c->ext = e;
    return KVC_OK;
}

int kvc_cells_snapshot(kvc_cells *dst, const kvc_cells *src) {
    const uint32_t size = src->size, n_seq = src->n_seq_max;
    memset(dst, 0, sizeof *dst);
    dst->size = size;
    dst->n_seq_max = n_seq;
    dst->n_words = src->n_words;
    dst->seq_words = src->seq_words;
    dst->blk_words = src->blk_words;
    dst->empty_zeroes_shift = src->empty_zeroes_shift;
    uint64_t n_keys = 1;
    for (uint32_t s = 0; s < n_seq; s++) {
        n_keys += src->seq_pos[s].n;
    }
    /* every array but the change log is written by the copy below (a snapshot logs nothing) */
    dst->pos = kvc_malloc_n(size ? size : 1, sizeof *dst->pos);
    dst->shift = kvc_malloc_n(size ? size : 1, sizeof *dst->shift);
    dst->seq = kvc_malloc_n((uint64_t)dst->seq_words * size + 1, sizeof *dst->seq);
    dst->n_seqs = kvc_malloc_n(size ? size : 1, sizeof *dst->n_seqs);
    dst->owner = kvc_malloc_n(size ? size : 1, sizeof *dst->owner);
    dst->seq_some = kvc_malloc_n(dst->n_words + 1, sizeof *dst->seq_some);
    dst->seq_many = kvc_malloc_n(dst->n_words + 1, sizeof *dst->seq_many);
    dst->used_bits = kvc_malloc_n(dst->n_words + 1, sizeof *dst->used_bits);
    dst->free_words = kvc_malloc_n((dst->n_words + 63) / 64 + 1, sizeof *dst->free_words);
    dst->emptied = kvc_malloc_n((dst->n_words + 63) / 64 + 1, sizeof *dst->emptied);
    dst->seq_pos = kvc_calloc(n_seq ? n_seq : 1, sizeof *dst->seq_pos);
    dst->seq_blk = kvc_malloc_n((uint64_t)(n_seq ? n_seq : 1) * (dst->blk_words ? dst->blk_words : 1),
                                sizeof *dst->seq_blk);
    dst->chg = kvc_malloc_n(1, sizeof *dst->chg);
    dst->key_block = kvc_malloc_n(n_keys, sizeof *dst->key_block);
    dst->ext = src->ext ? kvc_malloc_n(size ? size : 1, sizeof *dst->ext) : NULL;
    if (!dst->pos || !dst->shift || !dst->seq || !dst->n_seqs || !dst->owner || !dst->seq_some || !dst->seq_many || !dst->used_bits || !dst->free_words ||
        !dst->emptied || !dst->seq_pos || !dst->seq_blk || !dst->chg || !dst->key_block || (src->ext && !dst->ext)) {
        kvc_cells_free(dst);
        return KVC_E_NOMEM;
    }
    uint64_t at = 0;
    for (uint32_t s = 0; s < n_seq; s++) {
        dst->seq_pos[s].key = dst->key_block + at;
        at += src->seq_pos[s].n;
    }
    kvc_cells_copy(dst, src);
    return KVC_OK;
}

void kvc_cells_free(kvc_cells *c) {
    kvc_free(c->ext);
    kvc_free(c->pos);
    kvc_free(c->shift);
    kvc_free(c->seq);
    kvc_free(c->n_seqs);
    kvc_free(c->owner);
    kvc_free(c->seq_some);
    kvc_free(c->seq_many);
    kvc_free(c->used_bits);
    kvc_free(c->free_words);
    kvc_free(c->emptied);
    for (uint32_t s = 0; c->seq_pos && !c->key_block && s < c->n_seq_max; s++) {
        kvc_free(c->seq_pos[s].key);
    }
    kvc_free(c->key_block);
    kvc_free(c->seq_pos);
    kvc_free(c->seq_blk);
    kvc_free(c->chg);
    memset(c, 0, sizeof *c);
}

void kvc_cells_reset(kvc_cells *c) {
    for (uint32_t i = 0; i < c->size; i++) {
        c->pos[i] = -1;
    }
    memset(c->shift, 0, (size_t)c->size * sizeof *c->shift);
    memset(c->seq, 0, (size_t)c->seq_words * c->size * sizeof *c->seq);
    memset(c->n_seqs, 0, (size_t)c->size * sizeof *c->n_seqs);
    memset(c->seq_some, 0, (size_t)c->n_words * sizeof *c->seq_some);
    memset(c->seq_many, 0, (size_t)c->n_words * sizeof *c->seq_many);
    memset(c->used_bits, 0, (size_t)c->n_words * sizeof *c->used_bits);
    kvc_cells_free_words_all(c);
    kvc_cells_words_all(c, c->emptied);
    c->used = 0;
    c->used_max_p1 = 0;
    c->has_shift = false;
    for (uint32_t s = 0; s < c->n_seq_max; s++) {
        kvc_seq_pos_clear(&c->seq_pos[s]);
    }
    memset(c->seq_blk, 0, (size_t)c->n_seq_max * c->blk_words * sizeof *c->seq_blk);
    for (uint32_t i = 0; c->ext && i < c->size; i++) {
        c->ext[i] = kvc_cell_ext_default();
    }
    kvc_cells_changed_all(c);
}

void kvc_cells_reset_shift(kvc_cells *c) {
    c->has_shift = false;
    memset(c->shift, 0, (size_t)c->size * sizeof *c->shift);
}

/* --- used-set bookkeeping ------------------------------------------------------------ */

static inline void kvc_cells_mark_used(kvc_cells *c, uint32_t i) {
    c->free_words[i >> 12] &= ~((uint64_t)1 << ((i >> 6) & 63));
    c->used_bits[i >> 6] |= (uint64_t)1 << (i & 63);
    c->used++;
    if (i + 1 > c->used_max_p1) {
        c->used_max_p1 = i + 1;
    }
}

/* used_max_p1 anew, knowing that no cell at or above `end` is used: the words below it that
 * hold a used cell are found through free_words. */
static void kvc_cells_find_used_max(kvc_cells *c, uint32_t end) {
    uint32_t w = end >> 6;
    uint64_t bits = w < c->n_words ? c->used_bits[w] : 0;
    if (!bits) {
        /* the last word with a used cell below w */
        uint32_t k = w >> 6;
        uint64_t m = k < (c->n_words + 63) / 64 ? ~c->free_words[k] & (((uint64_t)1 << (w & 63)) - 1) : 0;
        while (!m && k > 0) {
            m = ~c->free_words[--k];
            if (k == (c->n_words - 1) >> 6 && (c->n_words & 63)) {
                m &= ((uint64_t)1 << (c->n_words & 63)) - 1;   /* no words past n_words */
            }
        }
        if (!m) {
            c->used_max_p1 = 0;
            return;
        }
        w = (k << 6) + kvc_msb64(m);
        bits = c->used_bits[w];
    }
    c->used_max_p1 = (w << 6) + kvc_msb64(bits) + 1;
}

/* The cells `mask` of word w of used_bits going empty: the emptied, used and free-word bits. */
static inline void unused_word(kvc_cells *c, uint32_t w, uint64_t mask) {
    c->emptied[w >> 6] |= (uint64_t)1 << (w & 63);
    if (!(c->used_bits[w] &= ~mask)) {
        c->free_words[w >> 6] |= (uint64_t)1 << (w & 63);
    }
}

/* The bits of cell i going empty: its shift zeroed where the table does so, the emptied, used
 * and free-word bits; the counts (used, used_max_p1) are the caller's. */
static inline void unused_bits(kvc_cells *c, uint32_t i) {
    /* (a table with no shift since its last reset has every shift 0: the line is not written) */
    if (c->empty_zeroes_shift && c->has_shift) {
        c->shift[i] = 0;
    }
    unused_word(c, i >> 6, (uint64_t)1 << (i & 63));
}

/* The counts of cell i, which went empty (unused_bits done). */
static inline void unused_count(kvc_cells *c, uint32_t i) {
    c->used--;
    if (i + 1 == c->used_max_p1) {
        kvc_cells_find_used_max(c, i);   /* the last used cell went away */
    }
}

static void kvc_cells_mark_unused(kvc_cells *c, uint32_t i) {
    unused_bits(c, i);
    unused_count(c, i);
}

/* --- a cell's sequences: the owner of a cell one holds, the planes of a cell several hold --- */

/* Sequence s, not among cell i's, joins it: the cell's owner when it had none, else the planes
 * (with the owner it had, which leaves the owner array) and the count. */
static inline void cell_join(kvc_cells *c, uint32_t i, int32_t s) {
    const uint64_t b = (uint64_t)1 << (i & 63);
    uint64_t *some = &c->seq_some[i >> 6], *many = &c->seq_many[i >> 6];
    if (!(*some & b)) {
        *some |= b;
        c->owner[i] = (uint16_t)s;
        return;
    }
    if (!(*many & b)) {
        kvc_seqs_add(c->seq, c->size, i, c->owner[i]);   /* (the owner stays, stale) */
        *many |= b;
        c->n_seqs[i] = 2;
    } else {
        c->n_seqs[i]++;
    }
    kvc_seqs_add(c->seq, c->size, i, s);
}

/* Sequence s, among cell i's, leaves it; returns whether no sequence holds it now. The last of
 * several left becomes its owner (the planes of a cell one sequence holds are 0); the owner of a
 * cell going empty is left as it was (stale: its some bit says). */
static inline bool cell_leave(kvc_cells *c, uint32_t i, int32_t s) {
    const uint64_t b = (uint64_t)1 << (i & 63);
    uint64_t *many = &c->seq_many[i >> 6];
    if (!(*many & b)) {
        c->seq_some[i >> 6] &= ~b;
        return true;
    }
    kvc_seqs_del(c->seq, c->size, i, s);
    if (--c->n_seqs[i] == 1) {
        const int32_t o = kvc_seqs_next(c->seq, c->size, c->seq_words, i, -1);
        kvc_seqs_del(c->seq, c->size, i, o);
        c->owner[i] = (uint16_t)o;
        *many &= ~b;
    }
    return false;
}

void kvc_cells_seq_put(kvc_cells *c, uint32_t i, const uint64_t *in) {
    uint32_t n = 0;
    int32_t first = -1;
    for (uint32_t w = 0; in && w < c->seq_words; w++) {
        n += kvc_popcount64(in[w]);
        if (first < 0 && in[w]) {
            first = (int32_t)(64 * w + kvc_ctz64(in[w]));
        }
    }
    if (n >= 2) {
        kvc_seqs_put(c->seq, c->size, c->seq_words, i, in);
    } else {
        if (kvc_cells_bit(c->seq_many, i)) {
            kvc_seqs_put(c->seq, c->size, c->seq_words, i, NULL);
        }
        if (n) {
            c->owner[i] = (uint16_t)first;
        }
    }
    kvc_cells_count_set(c, i, n);
}

bool kvc_cells_same_sets(const kvc_cells *a, const kvc_cells *b) {
    const size_t n = a->size;
    if (memcmp(a->seq_some, b->seq_some, (size_t)a->n_words * sizeof *a->seq_some) ||
        memcmp(a->seq_many, b->seq_many, (size_t)a->n_words * sizeof *a->seq_many) ||
        memcmp(a->seq, b->seq, n * a->seq_words * sizeof *a->seq)) {
        return false;
    }
    for (uint32_t w = 0; w < a->n_words; w++) {
        for (uint64_t m = kvc_cells_one_word(a, w); m; m &= m - 1) {
            const uint32_t i = (w << 6) + kvc_ctz64(m);
            if (a->owner[i] != b->owner[i]) {
                return false;
            }
        }
    }
    return true;
}

void kvc_cells_seq_add_raw(kvc_cells *c, uint32_t i, int32_t s) {
    if (!kvc_cells_seq_has(c, i, s)) {
        cell_join(c, i, s);
    }
    kvc_cells_blk_mark(c, i, s);
    kvc_cells_changed(c, i);
}

void kvc_cells_seq_only_raw(kvc_cells *c, uint32_t i, int32_t s) {
    uint64_t only[KVC_SEQ_WORDS] = { 0 };
    only[s >> 6] = (uint64_t)1 << (s & 63);
    kvc_cells_seq_put(c, i, only);
    kvc_cells_changed(c, i);
}

/* The bits of cells [j, j + k) in their word (k <= 64 - j % 64). */
static inline uint64_t span_bits(uint32_t j, uint32_t k) {
    return (k == 64 ? ~(uint64_t)0 : (((uint64_t)1 << k) - 1)) << (j & 63);
}

/* Set (used) or clear the used bits of cells [i, i + n), free_words kept; the counts are the
 * caller's. */
static void kvc_cells_used_range(kvc_cells *c, uint32_t i, uint32_t n, bool used) {
    for (uint32_t end = i + n; i < end;) {
        const uint32_t w = i >> 6, lo = i & 63, k = end - i < 64 - lo ? end - i : 64 - lo;
        const uint64_t m = span_bits(i, k);
        const uint64_t fbit = (uint64_t)1 << (w & 63);
        if (used) {
            c->used_bits[w] |= m;
            c->free_words[w >> 6] &= ~fbit;
        } else {
            c->emptied[w >> 6] |= fbit;
            if (!(c->used_bits[w] &= ~m)) {
                c->free_words[w >> 6] |= fbit;
            }
        }
        i += k;
    }
}

/* The first cell in [from, to) that is used (flip 0) or empty (flip ~0), or to. */
static inline uint32_t next_with_bit(const kvc_cells *c, uint32_t from, uint32_t to, uint64_t flip) {
    if (from >= to) {
        return to;
    }
    uint32_t w = from >> 6;
    uint64_t bits = (c->used_bits[w] ^ flip) & (~(uint64_t)0 << (from & 63));
    for (;;) {
        if (bits) {
            const uint32_t i = (w << 6) + kvc_ctz64(bits);
            return i < to ? i : to;
        }
        if (++w >= c->n_words || (w << 6) >= to) {
            return to;
        }
        bits = c->used_bits[w] ^ flip;
    }
}

uint32_t kvc_cells_next_used(const kvc_cells *c, uint32_t from, uint32_t to) {
    return next_with_bit(c, from, to, 0);
}

uint32_t kvc_cells_next_empty(const kvc_cells *c, uint32_t from, uint32_t to) {
    return next_with_bit(c, from, to, ~(uint64_t)0);
}

/* The first word >= w whose free_words bit is `want` (1: an empty word, 0: a word with a used
 * cell), or n_words. */
static uint32_t kvc_cells_next_word(const kvc_cells *c, uint32_t w, bool want) {
    const uint64_t flip = want ? 0 : ~(uint64_t)0;
    const uint32_t nk = (c->n_words + 63) / 64;
    uint32_t k = w >> 6;
    if (k >= nk) {
        return c->n_words;
    }
    uint64_t m = (c->free_words[k] ^ flip) & (~(uint64_t)0 << (w & 63));
    for (;;) {
        if (m) {
            const uint32_t r = (k << 6) + kvc_ctz64(m);
            return r < c->n_words ? r : c->n_words;
        }
        if (++k >= nk) {
            return c->n_words;
        }
        m = c->free_words[k] ^ flip;
    }
}

/* The empty cells at the top of a word of used bits. */
static inline uint32_t free_top(uint64_t used) {
    return used ? 63u - kvc_msb64(used) : 64u;
}

uint32_t kvc_cells_first_free_run(const kvc_cells *c, uint32_t a, uint32_t b, uint32_t n) {
    if (a > b || n == 0) {
        return a <= b ? a : UINT32_MAX;
    }
    if (n >= 127) {
        /* a run of n empty cells holds a whole empty word: from one run of empty words to the
         * next, each widened by the empty cells on either side */
        for (uint32_t w = a >> 6; w < c->n_words;) {
            const uint32_t z = kvc_cells_next_word(c, w, true);
            if (z >= c->n_words) {
                return UINT32_MAX;
            }
            const uint32_t e = kvc_cells_next_word(c, z, false);
            uint64_t start = ((uint64_t)z << 6) - (z ? free_top(c->used_bits[z - 1]) : 0);
            if (start < a) {
                start = a;
            }
            if (start > b) {
                return UINT32_MAX;
            }
            const uint64_t end = ((uint64_t)e << 6) + (e < c->n_words ? kvc_ctz64(c->used_bits[e]) : 0);
            if (end - start >= n) {
                return (uint32_t)start;
            }
            w = e + 1;
        }
        return UINT32_MAX;
    }
    /* word by word: `run` empty cells end where word w starts */
    uint32_t w = a >> 6;
    uint64_t used = c->used_bits[w] | (((uint64_t)1 << (a & 63)) - 1);   /* cells below a count as used */
    uint64_t run = 0;
    for (;;) {
        const uint64_t base = (uint64_t)w << 6;
        if (used == 0) {
            run += 64;
            if (run >= n) {
                const uint64_t p = base + 64 - run;
                return p <= b ? (uint32_t)p : UINT32_MAX;
            }
        } else {
            if (run + kvc_ctz64(used) >= n) {
                const uint64_t p = base - run;
                return p <= b ? (uint32_t)p : UINT32_MAX;
            }
            if (n <= 64) {
                /* windows inside the word: bit i of ok set when cells i .. i + n - 1 are empty */
                uint64_t ok = ~used;
                for (uint32_t have = 1; have < n && ok;) {
                    const uint32_t sh = have < n - have ? have : n - have;
                    ok &= ok >> sh;
                    have += sh;
                }
                if (ok) {
                    const uint64_t p = base + kvc_ctz64(ok);
                    return p <= b ? (uint32_t)p : UINT32_MAX;
                }
            }
            run = free_top(used);
        }
        if (base + 64 - run > b || ++w >= c->n_words) {
            return UINT32_MAX;
        }
        used = c->used_bits[w];
    }
}

uint32_t kvc_cells_kth_used_back(const kvc_cells *c, uint32_t lo, uint32_t end, uint32_t k) {
    if (end <= lo || k == 0) {
        return UINT32_MAX;
    }
    uint32_t w = (end - 1) >> 6;
    const unsigned top = end - (w << 6);   /* bits of word w below end: 1..64 */
    uint64_t bits = c->used_bits[w] & (top == 64 ? ~(uint64_t)0 : (((uint64_t)1 << top) - 1));
    for (;;) {
        if (w == lo >> 6) {
            bits &= ~(uint64_t)0 << (lo & 63);
        }
        const uint32_t n = kvc_popcount64(bits);
        if (n >= k) {
            for (; k > 1; k--) {
                bits &= ~((uint64_t)1 << kvc_msb64(bits));
            }
            return (w << 6) + kvc_msb64(bits);
        }
        k -= n;
        if (w == lo >> 6) {
            return UINT32_MAX;
        }
        bits = c->used_bits[--w];
    }
}

/* --- per-sequence (position, cell) index ------------------------------------------------ */

/* Index of the first entry >= key. */
static uint32_t kvc_seq_pos_lower(const kvc_seq_pos *sp, uint64_t key) {
    uint32_t lo = 0, hi = sp->n;
    while (lo < hi) {
        const uint32_t mid = lo + (hi - lo) / 2;
        if (sp->key[mid] < key) {
            lo = mid + 1;
        } else {
            hi = mid;
        }
    }
    return lo;
}

uint32_t kvc_cells_seq_pos_from(const kvc_cells *c, int32_t s, int32_t p) {
    return kvc_seq_pos_lower(&c->seq_pos[s], kvc_seq_key(p, 0));
}

void kvc_cells_seq_pos_span(const kvc_cells *c, int32_t s, kvc_pos_range r, uint32_t *a, uint32_t *b) {
    const kvc_seq_pos *sp = &c->seq_pos[s];
    *a = kvc_seq_pos_lower(sp, kvc_seq_key(r.p0, 0));
    *b = r.p1 > KVC_POS_MAX ? sp->n : kvc_seq_pos_lower(sp, kvc_seq_key((int32_t)r.p1, 0));
    if (*b < *a) {
        *b = *a;
    }
}

bool kvc_cells_seq_pos_any_in(const kvc_cells *c, int32_t s, kvc_pos_range r) {
    uint32_t a, b;
    kvc_cells_seq_pos_span(c, s, r, &a, &b);
    return a < b;
}

uint32_t kvc_cells_seq_pos_count_in(const kvc_cells *c, int32_t s, kvc_pos_range r) {
    uint32_t a, b;
    kvc_cells_seq_pos_span(c, s, r, &a, &b);
    return b - a;
}

/* Index of the entry equal to key, or sp->n when there is none. A sequence usually holds one
 * cell per position, its positions contiguous: the entry of position p is then the (p - first)-th,
 * which is tried before the binary search. */
static uint32_t kvc_seq_pos_find(const kvc_seq_pos *sp, uint64_t key) {
    if (sp->n == 0) {
        return 0;
    }
    const int64_t guess = (int64_t)kvc_seq_key_pos(key) - kvc_seq_key_pos(sp->key[0]);
    if (guess >= 0 && guess < sp->n && sp->key[guess] == key) {
        return (uint32_t)guess;
    }
    const uint32_t k = kvc_seq_pos_lower(sp, key);
    return k < sp->n && sp->key[k] == key ? k : sp->n;
}

/* kvc_seq_pos_insert of a key before the last. */
static void seq_pos_insert_inside(kvc_seq_pos *sp, uint64_t key) {
    const uint32_t k = kvc_seq_pos_lower(sp, key);
    memmove(sp->key + k + 1, sp->key + k, (size_t)(sp->n - k) * sizeof *sp->key);
    sp->key[k] = key;
    sp->n++;
    sp->sure = 0;
}

static inline void kvc_seq_pos_insert(kvc_seq_pos *sp, uint64_t key) {
    const uint32_t n = sp->n;
    /* the common case (positions grow) appends, inline: a placement runs it for every token */
    if (n && sp->key[n - 1] > key) {
        seq_pos_insert_inside(sp, key);
        return;
    }
    sp->key[n] = key;
    sp->n = n + 1;
}

static void kvc_seq_pos_erase(kvc_seq_pos *sp, uint64_t key) {
    const uint32_t k = kvc_seq_pos_find(sp, key);
    if (k < sp->n) {
        memmove(sp->key + k, sp->key + k + 1, (size_t)(sp->n - k - 1) * sizeof *sp->key);
        sp->n--;
        sp->sure = 0;
    }
}

/* The entry `from` becomes `to` (same position): only the entries between the two move. */
static void kvc_seq_pos_rekey(kvc_seq_pos *sp, uint64_t from, uint64_t to) {
    uint32_t k = kvc_seq_pos_find(sp, from);
    if (k >= sp->n) {
        return;
    }
    sp->sure = 0;
    for (; k + 1 < sp->n && sp->key[k + 1] < to; k++) {
        sp->key[k] = sp->key[k + 1];
    }
    for (; k > 0 && sp->key[k - 1] > to; k--) {
        sp->key[k] = sp->key[k - 1];
    }
    sp->key[k] = to;
}

static void kvc_seq_pos_cut(kvc_seq_pos *sp, uint32_t a, uint32_t b) {
    if (a < b) {
        memmove(sp->key + a, sp->key + b, (size_t)(sp->n - b) * sizeof *sp->key);
        sp->n -= b - a;
        sp->sure = 0;
    }
}

void kvc_cells_seq_pos_rm_range(kvc_cells *c, int32_t s, kvc_pos_range r) {
    uint32_t a, b;
    kvc_cells_seq_pos_span(c, s, r, &a, &b);
    kvc_seq_pos_cut(&c->seq_pos[s], a, b);
}

static int kvc_u64_cmp(const void *a, const void *b) {
    const uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return (x > y) - (x < y);
}

/* Put seq_pos[s] (filled in any order) in order. */
static void kvc_cells_seq_pos_sort(kvc_cells *c, int32_t s) {
    kvc_seq_pos *sp = &c->seq_pos[s];
    /* most rebuilds find the entries in order already */
    bool sorted = true;
    for (uint32_t k = 1; k < sp->n && sorted; k++) {
        sorted = sp->key[k - 1] < sp->key[k];
    }
    if (!sorted) {
        qsort(sp->key, sp->n, sizeof *sp->key, kvc_u64_cmp);
    }
}

uint32_t kvc_cells_blk_count(const kvc_cells *c, int32_t s) {
    const uint64_t *bits = kvc_cells_blk(c, s);
    uint32_t n = 0;
    for (uint32_t w = 0; w < c->blk_words; w++) {
        n += kvc_popcount64(bits[w]);
    }
    return n;
}

/* Mark cell i's block for every sequence it holds. */
static void kvc_cells_blk_mark_all(kvc_cells *c, uint32_t i) {
    for (uint32_t w = 0; w < c->seq_words; w++) {
        for (uint64_t m = kvc_cells_seq_word(c, i, w); m; m &= m - 1) {
            kvc_cells_blk_mark(c, i, (int32_t)(64 * w + kvc_ctz64(m)));
        }
    }
}

/* seq_pos[s] from the cells of s, found through its blocks (whose bits become exact). */
static void kvc_cells_rebuild_one(kvc_cells *c, int32_t s) {
    kvc_seq_pos *sp = &c->seq_pos[s];
    kvc_seq_pos_clear(sp);
    for (uint32_t b = kvc_cells_blk_next(c, s, 0, c->used_max_p1); b != UINT32_MAX;
         b = kvc_cells_blk_next(c, s, b + 1, c->used_max_p1)) {
        uint64_t m = kvc_cells_blk_cells(c, s, b);
        if (!m) {
            kvc_cells_blk_drop(c, s, b);
        }
        for (; m; m &= m - 1) {
            const uint32_t i = (b << 6) + kvc_ctz64(m);
            sp->key[sp->n++] = kvc_seq_key(c->pos[i], i);
        }
    }
}

void kvc_cells_rebuild_seq_pos(kvc_cells *c, const kvc_seqset *touched) {
    /* only ids the table has (a mask may come from words of a wider set) */
    kvc_seqset mask = *touched;
    const uint32_t nw = c->seq_words;
    for (uint32_t w = 0; w < KVC_SEQ_WORDS; w++) {
        const uint32_t lo = 64 * w;
        if (w >= nw || c->n_seq_max <= lo) {
            mask.w[w] = 0;
        } else if (c->n_seq_max - lo < 64) {
            mask.w[w] &= ((uint64_t)1 << (c->n_seq_max - lo)) - 1;
        }
    }
    if (!kvc_seqset_any(&mask, nw)) {
        return;
    }
    /* a walk reads 64 cells per marked block, a pass every used cell once per plane */
    uint64_t walk = 0;
    for (int32_t s = kvc_seqset_next(&mask, nw, -1); s >= 0; s = kvc_seqset_next(&mask, nw, s)) {
        walk += (uint64_t)kvc_cells_blk_count(c, s) * 64;
    }
    uint32_t planes = 0;
    for (uint32_t w = 0; w < nw; w++) {
        planes += mask.w[w] != 0;
    }
    const bool by_walk = walk <= (uint64_t)c->used_max_p1 * planes;
    for (int32_t s = kvc_seqset_next(&mask, nw, -1); s >= 0; s = kvc_seqset_next(&mask, nw, s)) {
        if (by_walk) {
            kvc_cells_rebuild_one(c, s);
        } else {
            kvc_seq_pos_clear(&c->seq_pos[s]);
            memset(kvc_cells_blk(c, s), 0, (size_t)c->blk_words * sizeof *c->seq_blk);
        }
    }
    for (uint32_t w = 0; !by_walk && w < nw; w++) {
        if (!mask.w[w]) {
            continue;
        }
        for (uint32_t i = 0; i < c->used_max_p1; i++) {
            uint64_t m = kvc_cells_seq_word(c, i, w) & mask.w[w];
            if (c->pos[i] == -1 || !m) {
                continue;
            }
            for (; m; m &= m - 1) {
                const int32_t s = (int32_t)(64 * w + kvc_ctz64(m));
                kvc_seq_pos *sp = &c->seq_pos[s];
                sp->key[sp->n++] = kvc_seq_key(c->pos[i], i);
                kvc_cells_blk_mark(c, i, s);
            }
        }
    }
    for (int32_t s = kvc_seqset_next(&mask, nw, -1); s >= 0; s = kvc_seqset_next(&mask, nw, s)) {
        kvc_cells_seq_pos_sort(c, s);
    }
}

/* --- cell edits ------------------------------------------------------------------------ */

void kvc_cells_pos_set(kvc_cells *c, uint32_t i, int32_t p) {
    c->pos[i] = p;
    kvc_cells_changed(c, i);
    kvc_cells_mark_used(c, i);
}

void kvc_cells_seq_add(kvc_cells *c, uint32_t i, int32_t s) {
    if (kvc_cells_seq_has(c, i, s)) {
        return;
    }
    cell_join(c, i, s);
    kvc_cells_blk_mark(c, i, s);
    kvc_cells_changed(c, i);
    kvc_seq_pos_insert(&c->seq_pos[s], kvc_seq_key(c->pos[i], i));
}

void kvc_cells_place_first(kvc_cells *c, uint32_t i, int32_t p, int32_t s) {
    c->pos[i] = p;
    kvc_cells_mark_used(c, i);
    c->owner[i] = (uint16_t)s;
    c->seq_some[i >> 6] |= (uint64_t)1 << (i & 63);   /* the cell was empty: its many bit is clear */
    kvc_cells_blk_mark(c, i, s);
    kvc_cells_changed(c, i);
    kvc_seq_pos_insert(&c->seq_pos[s], kvc_seq_key(p, i));
}

/* The empty cells [i, i + n) (n > 0) get positions pos[0 .. n) and become used; their
 * sequences and log entries are the caller's. */
static void use_run(kvc_cells *c, uint32_t i, uint32_t n, const int32_t *pos) {
    memcpy(c->pos + i, pos, (size_t)n * sizeof *pos);
    kvc_cells_used_range(c, i, n, true);
    c->used += n;
    if (i + n > c->used_max_p1) {
        c->used_max_p1 = i + n;
    }
}

/* kvc_cells_place_first_run's per-sequence part where every cell of the run goes to one
 * sequence at growing positions (a prompt's chunk, an attached prefix's run), a field at a time:
 * the owners, the sequence's block bits, the change log and its entries appended in one pass
 * each. false (nothing written) otherwise. */
static bool place_run_one_seq(kvc_cells *c, uint32_t i, uint32_t n, const int32_t *pos, const int32_t *seq) {
    const int32_t s = seq[0];
    kvc_seq_pos *sp = &c->seq_pos[s];
    const uint32_t m = sp->n;
    uint64_t *key = sp->key;
    bool ok = m == 0 || key[m - 1] < kvc_seq_key(pos[0], i);
    for (uint32_t j = 1; j < n; j++) {
        ok &= (seq[j] == s) & (pos[j] >= pos[j - 1]);   /* (cells grow: equal positions still sort) */
    }
    if (!ok) {
        return false;
    }
    uint16_t *owner = c->owner + i;
    for (uint32_t j = 0; j < n; j++) {
        owner[j] = (uint16_t)s;
    }
    uint64_t *blk = kvc_cells_blk(c, s);
    for (uint32_t b = i >> 6; b <= (i + n - 1) >> 6; b++) {
        blk[b >> 6] |= (uint64_t)1 << (b & 63);
    }
    if (c->chg_on && c->size - c->chg_n >= n) {
        uint32_t *log = c->chg + c->chg_n;
        for (uint32_t j = 0; j < n; j++) {
            log[j] = i + j;
        }
        c->chg_n += n;
    } else {
        for (uint32_t j = 0; j < n; j++) {
            kvc_cells_changed(c, i + j);
        }
    }
    uint64_t *out = key + m;
    for (uint32_t j = 0; j < n; j++) {
        out[j] = kvc_seq_key(pos[j], i + j);
    }
    sp->n = m + n;
    return true;
}

void kvc_cells_place_first_run(kvc_cells *c, uint32_t i, uint32_t n, const int32_t *pos, const int32_t *seq) {
    if (n == 0) {
        return;
    }
    use_run(c, i, n, pos);
    /* (the cells were empty: their many bits are clear) */
    for (uint32_t end = i + n, j = i; j < end;) {
        const uint32_t lo = j & 63, k = end - j < 64 - lo ? end - j : 64 - lo;
        c->seq_some[j >> 6] |= span_bits(j, k);
        j += k;
    }
    if (place_run_one_seq(c, i, n, pos, seq)) {
        return;
    }
    for (uint32_t j = 0; j < n; j++) {
        const int32_t s = seq[j];
        if (j + KVC_CELLS_AHEAD < n) {
            /* the end of the entries of a sequence further on (a decode step's are scattered) */
            kvc_cells_prefetch_append(c, i + j + KVC_CELLS_AHEAD, seq[j + KVC_CELLS_AHEAD]);
        }
        c->owner[i + j] = (uint16_t)s;
        kvc_cells_blk_mark(c, i + j, s);
        kvc_cells_changed(c, i + j);
        kvc_seq_pos_insert(&c->seq_pos[s], kvc_seq_key(pos[j], i + j));
    }
}

uint32_t kvc_cells_empty_run(const kvc_cells *c, uint32_t i, uint32_t n) {
    uint32_t k = 0;
    while (k < n) {
        const uint32_t j = i + k, lo = j & 63;
        const uint64_t used = c->used_bits[j >> 6] >> lo;
        if (used) {
            k += kvc_ctz64(used);
            break;
        }
        k += 64 - lo;
    }
    return k < n ? k : n;
}

/* Whether ids[q] is also among ids[0 .. q). */
static bool id_seen_before(const int32_t *ids, uint32_t q) {
    for (uint32_t r = 0; r < q; r++) {
        if (ids[r] == ids[q]) {
            return true;
        }
    }
    return false;
}

void kvc_cells_place_run(kvc_cells *c, uint32_t i, uint32_t n, const int32_t *pos, const int32_t *ids, uint32_t n_ids) {
    if (n == 0) {
        return;
    }
    use_run(c, i, n, pos);
    /* the distinct ids (a repeated id joins a cell once) */
    uint32_t k = 0;
    for (uint32_t q = 0; q < n_ids; q++) {
        k += !id_seen_before(ids, q);
    }
    for (uint32_t j = 0; j < n; j++) {
        kvc_cells_count_set(c, i + j, k);   /* the cells were empty */
        for (uint32_t e = 0; e <= k; e++) {
            kvc_cells_changed(c, i + j);   /* the position, then each sequence joining */
        }
    }
    for (uint32_t q = 0; q < n_ids; q++) {
        const int32_t s = ids[q];
        if (id_seen_before(ids, q)) {
            continue;
        }
        if (k == 1) {
            for (uint32_t j = 0; j < n; j++) {
                c->owner[i + j] = (uint16_t)s;
            }
        } else {
            uint64_t *plane = c->seq + (size_t)(s >> 6) * c->size;
            const uint64_t bit = (uint64_t)1 << (s & 63);
            for (uint32_t j = 0; j < n; j++) {
                plane[i + j] |= bit;
            }
        }
        for (uint32_t b = i >> 6; b <= (i + n - 1) >> 6; b++) {
            kvc_cells_blk_mark(c, b << 6, s);
        }
        /* the entries in order after the last: appended; else one by one */
        kvc_seq_pos *sp = &c->seq_pos[s];
        bool append = !sp->n || sp->key[sp->n - 1] < kvc_seq_key(pos[0], i);
        for (uint32_t j = 1; append && j < n; j++) {
            append = pos[j - 1] < pos[j];
        }
        for (uint32_t j = 0; j < n; j++) {
            if (append) {
                sp->key[sp->n++] = kvc_seq_key(pos[j], i + j);
            } else {
                kvc_seq_pos_insert(sp, kvc_seq_key(pos[j], i + j));
            }
        }
    }
}

bool kvc_cells_seq_rm(kvc_cells *c, uint32_t i, int32_t s) {
    kvc_seq_pos_erase(&c->seq_pos[s], kvc_seq_key(c->pos[i], i));
    return kvc_cells_seq_del_raw(c, i, s);
}

/* kvc_cells_seq_del_raw but for the table's counts (unused_count, when it returns true: the cell
 * went empty): a caller removing many cells counts once. */
static inline bool seq_leave_bits(kvc_cells *c, uint32_t i, int32_t s, bool held) {
    bool none;
    if (held || kvc_cells_seq_has(c, i, s)) {
        none = cell_leave(c, i, s);
    } else {
        none = kvc_cells_seq_none(c, i);
    }
    kvc_cells_changed(c, i);
    if (none) {
        c->pos[i] = -1;
        kvc_cells_ext_reset(c, i);
        unused_bits(c, i);
        return true;
    }
    return false;
}

/* seq_leave_bits of the cells [i, i + m), one word's `run` of bits, that s alone holds (each
 * empties): the same edits and log, the bitmaps a word at a time. */
static void leave_run(kvc_cells *c, uint32_t i, uint32_t m, uint64_t run) {
    const uint32_t w = i >> 6;
    for (uint32_t j = i; j < i + m; j++) {
        kvc_cells_changed(c, j);
        c->pos[j] = -1;
        kvc_cells_ext_reset(c, j);
    }
    if (c->empty_zeroes_shift && c->has_shift) {
        memset(c->shift + i, 0, (size_t)m * sizeof *c->shift);
    }
    c->seq_some[w] &= ~run;
    unused_word(c, w, run);
}

bool kvc_cells_seq_del_raw(kvc_cells *c, uint32_t i, int32_t s) {
    if (seq_leave_bits(c, i, s, false)) {
        unused_count(c, i);
        return true;
    }
    return false;
}

uint32_t kvc_cells_seq_rm_range(kvc_cells *c, int32_t s, kvc_pos_range r) {
    kvc_seq_pos *sp = &c->seq_pos[s];
    uint32_t a, b, lowest = c->size, runs = 0, prev = UINT32_MAX;
    kvc_cells_seq_pos_span(c, s, r, &a, &b);
    const uint64_t *const key = sp->key;
    int32_t *const shift = c->empty_zeroes_shift && c->has_shift ? c->shift : NULL;
    /* the counts once, after the loop: the cells emptied, and the last used cell if it went */
    const uint32_t top = c->used_max_p1;
    uint32_t n_empty = 0;
    bool top_went = false;
    for (uint32_t k = a; k < b;) {
        const uint32_t i = kvc_seq_key_cell(key[k]);
        if (k + KVC_CELLS_AHEAD < b) {
            /* the cell's lines, and the shift an emptied cell loses */
            const uint32_t next = kvc_seq_key_cell(key[k + KVC_CELLS_AHEAD]);
            kvc_cells_prefetch_leave(c, next);
            if (shift) {
                KVC_PREFETCH_W(shift + next);
            }
        }
        runs += (i >> 6) != prev;
        prev = i >> 6;
        /* a run of entries on adjacent cells of one word of 64 (a prompt's chunk) whose cells s
         * alone holds: each empties, so their bits go a word at a time */
        uint32_t m = 1;
        while (m < 64 && k + m < b && kvc_seq_key_cell(key[k + m]) == i + m && ((i + m) & 63)) {
            m++;
        }
        const uint64_t run = (m == 64 ? ~(uint64_t)0 : (((uint64_t)1 << m) - 1)) << (i & 63);
        if (m >= 4 && !(c->seq_many[i >> 6] & run)) {
            leave_run(c, i, m, run);
            for (uint32_t q = k + 1 + KVC_CELLS_AHEAD; q < k + m + KVC_CELLS_AHEAD && q < b; q++) {
                kvc_cells_prefetch_leave(c, kvc_seq_key_cell(key[q]));   /* the entries the skip passed over */
            }
            n_empty += m;
            top_went |= top > i && top <= i + m;
            lowest = i < lowest ? i : lowest;
            k += m;
            continue;
        }
        if (seq_leave_bits(c, i, s, true)) {   /* (an entry of s: s holds the cell) */
            n_empty++;
            top_went |= i + 1 == top;
            lowest = i < lowest ? i : lowest;
        }
        k++;
    }
    c->used -= n_empty;
    if (top_went) {
        kvc_cells_find_used_max(c, top - 1);   /* no cell from the old last one on is used */
    }
    if (a == b) {
        return lowest;
    }
    /* the blocks that may have lost their last cell of s: checked one by one (64 cells each)
     * when they are few, else the bits are redone from the entries that stay */
    const uint32_t stay = sp->n - (b - a);
    uint64_t *bits = kvc_cells_blk(c, s);
    if (stay && (uint64_t)runs * 64 <= stay) {
        prev = UINT32_MAX;
        for (uint32_t k = a; k < b; k++) {
            const uint32_t blk = kvc_seq_key_cell(sp->key[k]) >> 6;
            if (blk != prev && !kvc_cells_blk_cells(c, s, blk)) {
                kvc_cells_blk_drop(c, s, blk);
            }
            prev = blk;
        }
        kvc_seq_pos_cut(sp, a, b);
    } else {
        kvc_seq_pos_cut(sp, a, b);
        memset(bits, 0, (size_t)c->blk_words * sizeof *bits);
        for (uint32_t k = 0; k < sp->n; k++) {
            kvc_cells_blk_mark(c, kvc_seq_key_cell(sp->key[k]), s);
        }
    }
    return lowest;
}

bool kvc_cells_seq_cp_range(kvc_cells *c, int32_t src, int32_t dst, kvc_pos_range r) {
    const uint64_t *from = c->seq_pos[src].key;
    kvc_seq_pos *to = &c->seq_pos[dst];
    uint32_t a, b, added = 0;
    kvc_cells_seq_pos_span(c, src, r, &a, &b);
    for (uint32_t k = a; k < b; k++) {
        added += !kvc_cells_seq_has(c, kvc_seq_key_cell(from[k]), dst);
    }
    if (!added) {
        return false;
    }
    /* the new entries (cells not holding dst yet) merged into dst's from the back; no key is in
     * both lists, a cell being in one entry of each at most */
    uint32_t out = to->n + added, have = to->n;
    for (uint32_t k = b; k-- > a;) {
        const uint64_t key = from[k];
        if (kvc_cells_seq_has(c, kvc_seq_key_cell(key), dst)) {
            continue;
        }
        while (have && to->key[have - 1] > key) {
            to->key[--out] = to->key[--have];
        }
        to->key[--out] = key;
    }
    to->n += added;
    to->sure = 0;
    for (uint32_t k = a; k < b; k++) {
        const uint32_t i = kvc_seq_key_cell(from[k]);
        if (!kvc_cells_seq_has(c, i, dst)) {
            kvc_cells_seq_add_raw(c, i, dst);
        }
    }
    return true;
}

void kvc_cells_mv(kvc_cells *c, uint32_t src, uint32_t dst) {
    /* the fields first: every store below could alias them (no strict aliasing) */
    int32_t *pos = c->pos, *shift = c->shift;
    uint64_t *seq = c->seq;
    const uint32_t nw = c->seq_words;
    const bool many = kvc_cells_bit(c->seq_many, src);
    pos[dst] = pos[src];
    shift[dst] = shift[src];
    pos[src] = -1;
    shift[src] = 0;
    if (c->ext) {
        c->ext[dst] = c->ext[src];
        c->ext[src] = kvc_cell_ext_default();
    }
    kvc_cells_count_set(c, dst, kvc_cells_seq_count(c, src));
    kvc_cells_count_set(c, src, 0);
    c->owner[dst] = c->owner[src];
    if (many) {
        const uint32_t size = c->size;
        kvc_seqs_copy_cell(seq, size, nw, dst, src);
        kvc_seqs_put(seq, size, nw, src, NULL);
    }
    kvc_cells_mark_unused(c, src);
    kvc_cells_mark_used(c, dst);
    kvc_cells_blk_mark_all(c, dst);
    for (int32_t s = kvc_cells_seq_next(c, dst, -1); s >= 0; s = kvc_cells_seq_next(c, dst, s)) {
        kvc_seq_pos_rekey(&c->seq_pos[s], kvc_seq_key(pos[dst], src), kvc_seq_key(pos[dst], dst));
    }
    kvc_cells_changed(c, src);
    kvc_cells_changed(c, dst);
}

void kvc_cells_mv_run(kvc_cells *c, uint32_t src, uint32_t dst, uint32_t n) {
    if (n == 0) {
        return;
    }
    const uint32_t size = c->size, nw = c->seq_words;
    int32_t *pos = c->pos;
    memcpy(pos + dst, pos + src, (size_t)n * sizeof *pos);
    memcpy(c->shift + dst, c->shift + src, (size_t)n * sizeof *c->shift);
    memset(c->shift + src, 0, (size_t)n * sizeof *c->shift);
    for (uint32_t j = 0; j < n; j++) {
        pos[src + j] = -1;
    }
    for (uint32_t w = 0; w < nw; w++) {
        uint64_t *plane = c->seq + (size_t)w * size;
        memcpy(plane + dst, plane + src, (size_t)n * sizeof *plane);
        memset(plane + src, 0, (size_t)n * sizeof *plane);
    }
    memcpy(c->owner + dst, c->owner + src, (size_t)n * sizeof *c->owner);
    for (uint32_t j = 0; j < n; j++) {
        kvc_cells_count_set(c, dst + j, kvc_cells_seq_count(c, src + j));
        kvc_cells_count_set(c, src + j, 0);
    }
    if (c->ext) {
        memcpy(c->ext + dst, c->ext + src, (size_t)n * sizeof *c->ext);
        for (uint32_t j = 0; j < n; j++) {
            c->ext[src + j] = kvc_cell_ext_default();
        }
    }
    kvc_cells_used_range(c, dst, n, true);
    kvc_cells_used_range(c, src, n, false);
    if (src + n >= c->used_max_p1) {
        kvc_cells_find_used_max(c, src + n);
    }
    /* per cell, as kvc_cells_mv: its sequences' blocks and index entries, then the log */
    for (uint32_t j = 0; j < n; j++) {
        const uint32_t d = dst + j;
        for (uint32_t w = 0; w < nw; w++) {
            for (uint64_t m = kvc_cells_seq_word(c, d, w); m; m &= m - 1) {
                const int32_t s = (int32_t)(64 * w + kvc_ctz64(m));
                kvc_cells_blk_mark(c, d, s);
                kvc_seq_pos_rekey(&c->seq_pos[s], kvc_seq_key(pos[d], src + j), kvc_seq_key(pos[d], d));
            }
        }
        kvc_cells_changed(c, src + j);
        kvc_cells_changed(c, d);
    }
}

bool kvc_cells_pos_add_raw(kvc_cells *c, uint32_t i, int32_t d) {
    /* int64 so that a huge shift cannot overflow: a position pushed past KVC_POS_MAX stays there */
    const int64_t p = (int64_t)c->pos[i] + d;
    c->pos[i] = (int32_t)(p > KVC_POS_MAX ? KVC_POS_MAX : p);
    c->shift[i] = kvc_wrap_add_i32(c->shift[i], d);
    c->has_shift = true;
    kvc_cells_changed(c, i);
    if (p < 0) {
        /* the extension stays, as llama.cpp's pos_add leaves it */
        kvc_cells_seq_put(c, i, NULL);
        c->pos[i] = -1;
        kvc_cells_mark_unused(c, i);
        return true;
    }
    return false;
}

void kvc_cells_pos_div_raw(kvc_cells *c, uint32_t i, int32_t d) {
    const int32_t old = c->pos[i];
    c->pos[i] = old / d;
    kvc_cells_changed(c, i);
    c->shift[i] = kvc_wrap_add_i32(c->shift[i], old - c->pos[i]);
    c->has_shift = true;
}

void kvc_cells_set_raw(kvc_cells *c, uint32_t i, int32_t pos, const uint64_t *seq) {
    const bool was = c->pos[i] != -1, now = pos != -1;
    c->pos[i] = pos;
    kvc_cells_seq_put(c, i, seq);
    kvc_cells_blk_mark_all(c, i);
    kvc_cells_changed(c, i);
    if (!now) {
        kvc_cells_ext_reset(c, i);
    }
    if (was && !now) {
        kvc_cells_mark_unused(c, i);
    } else if (!was && now) {
        kvc_cells_mark_used(c, i);
    }
}

void kvc_cells_clear_raw(kvc_cells *c, uint32_t i) {
    if (c->pos[i] != -1) {
        c->pos[i] = -1;
        kvc_cells_ext_reset(c, i);
        kvc_cells_changed(c, i);
        kvc_cells_seq_put(c, i, NULL);
        kvc_cells_mark_unused(c, i);
    }
}

void kvc_cells_copy(kvc_cells *dst, const kvc_cells *src) {
    const size_t n = src->size;
    memcpy(dst->pos, src->pos, n * sizeof *src->pos);
    memcpy(dst->shift, src->shift, n * sizeof *src->shift);
    memcpy(dst->seq, src->seq, (size_t)src->seq_words * n * sizeof *src->seq);
    memcpy(dst->n_seqs, src->n_seqs, n * sizeof *src->n_seqs);
    memcpy(dst->owner, src->owner, n * sizeof *src->owner);
    memcpy(dst->seq_some, src->seq_some, (size_t)src->n_words * sizeof *src->seq_some);
    memcpy(dst->seq_many, src->seq_many, (size_t)src->n_words * sizeof *src->seq_many);
    memcpy(dst->used_bits, src->used_bits, (size_t)src->n_words * sizeof *src->used_bits);
    memcpy(dst->free_words, src->free_words, (size_t)(src->n_words + 63) / 64 * sizeof *src->free_words);
    kvc_cells_words_all(dst, dst->emptied);   /* any cell may have emptied */
    dst->used = src->used;
    dst->used_max_p1 = src->used_max_p1;
    dst->has_shift = src->has_shift;
    memcpy(dst->seq_blk, src->seq_blk, (size_t)src->n_seq_max * src->blk_words * sizeof *src->seq_blk);
    if (src->ext && dst->ext) {
        memcpy(dst->ext, src->ext, n * sizeof *src->ext);
    }
    kvc_cells_changed_all(dst);   /* the log is dst's own: whatever it said is void now */
    for (uint32_t s = 0; s < src->n_seq_max; s++) {
        memcpy(dst->seq_pos[s].key, src->seq_pos[s].key, (size_t)src->seq_pos[s].n * sizeof(uint64_t));
        dst->seq_pos[s].n = src->seq_pos[s].n;
        dst->seq_pos[s].sure = 0;
    }
}

int kvc_cells_check(const kvc_cells *c, kvc_err *err) {
    for (uint32_t i = 0; i < c->size; i++) {
        const uint32_t in_planes = kvc_seqs_count(c->seq, c->size, c->seq_words, i);
        const uint32_t o = kvc_cells_owner(c, i);
        if (o != KVC_CELLS_NO_OWNER && (o >= c->n_seq_max || in_planes)) {
            return kvc_err_set(err, KVC_E_INTERNAL, "cell %u has owner %u and %u sequences in its planes", i, o,
                               in_planes);
        }
        if (in_planes == 1) {
            return kvc_err_set(err, KVC_E_INTERNAL, "cell %u holds one sequence in its planes, not as its owner", i);
        }
        const uint32_t n = in_planes + (o != KVC_CELLS_NO_OWNER);
        if (kvc_cells_seq_count(c, i) != n || kvc_cells_bit(c->seq_many, i) != (n >= 2)) {
            return kvc_err_set(err, KVC_E_INTERNAL, "cell %u holds %u sequences but counts %u", i, n,
                               kvc_cells_seq_count(c, i));
        }
        if (n && c->pos[i] == -1) {
            return kvc_err_set(err, KVC_E_INTERNAL, "empty cell %u holds %u sequences", i, n);
        }
    }
    return KVC_OK;
}

int kvc_cells_seq_cells(const kvc_cells *c, int32_t s, int32_t *cells, int32_t *pos) {
    const kvc_seq_pos *sp = &c->seq_pos[s];
    for (uint32_t k = 0; k < sp->n; k++) {
        cells[k] = (int32_t)kvc_seq_key_cell(sp->key[k]);
        pos[k] = kvc_seq_key_pos(sp->key[k]);
    }
    return KVC_OK;
}

int kvc_cells_undo_init(kvc_cells_undo *u, const kvc_cells *c) {
    memset(u, 0, sizeof *u);
    const uint32_t n_seq = c->n_seq_max ? c->n_seq_max : 1;
    u->blk = kvc_malloc_n((uint64_t)n_seq * (c->blk_words ? c->blk_words : 1), sizeof *u->blk);
    u->keys = kvc_calloc(n_seq, sizeof *u->keys);
    u->n_keys = kvc_malloc_n(n_seq, sizeof *u->n_keys);
    if (!u->blk || !u->keys || !u->n_keys) {
        kvc_cells_undo_free(u);
        return KVC_E_NOMEM;
    }
    u->used = c->used;
    u->used_max_p1 = c->used_max_p1;
    u->has_shift = c->has_shift;
    return KVC_OK;
}

/* Room for n more cells in u. */
static bool undo_room(kvc_cells_undo *u, const kvc_cells *c, uint32_t n) {
    if (u->n + (uint64_t)n <= u->cap) {
        return true;
    }
    uint64_t cap = u->cap ? (uint64_t)u->cap * 2 : 64;
    while (cap < u->n + (uint64_t)n) {
        cap *= 2;
    }
    if (cap > UINT32_MAX) {
        return false;
    }
    /* each array grown on its own: one that fails leaves the others larger, and u still right */
    uint32_t *cell = kvc_realloc_n(u->cell, cap, sizeof *cell);
    if (cell) {
        u->cell = cell;
    }
    int32_t *pos = cell ? kvc_realloc_n(u->pos, cap, sizeof *pos) : NULL;
    if (pos) {
        u->pos = pos;
    }
    int32_t *shift = pos ? kvc_realloc_n(u->shift, cap, sizeof *shift) : NULL;
    if (shift) {
        u->shift = shift;
    }
    uint64_t *seq = shift ? kvc_realloc_n(u->seq, cap * c->seq_words, sizeof *seq) : NULL;
    if (seq) {
        u->seq = seq;
    }
    kvc_cell_ext *ext = seq && c->ext ? kvc_realloc_n(u->ext, cap, sizeof *ext) : NULL;
    if (ext) {
        u->ext = ext;
    }
    if (!seq || (c->ext && !ext)) {
        return false;
    }
    u->cap = (uint32_t)cap;
    return true;
}

/* Cell i as it is now into u (undo_room made room for it). */
static void keep_cell(kvc_cells_undo *u, const kvc_cells *c, uint32_t i) {
    const uint32_t j = u->n++;
    u->cell[j] = i;
    u->pos[j] = c->pos[i];
    u->shift[j] = c->shift[i];
    kvc_cells_seq_get(c, i, u->seq + (size_t)j * c->seq_words);
    if (c->ext) {
        u->ext[j] = c->ext[i];
    }
}

int kvc_cells_undo_cells(kvc_cells_undo *u, const kvc_cells *c, const int32_t *cells, uint32_t n) {
    if (!undo_room(u, c, n)) {
        return KVC_E_NOMEM;
    }
    for (uint32_t k = 0; k < n; k++) {
        keep_cell(u, c, (uint32_t)cells[k]);
    }
    return KVC_OK;
}

/* s's entries and block bits kept (the first time s is named): all of them (full), or, where the
 * run only appends to them (a first position after s's last), their count. A count kept becomes
 * all of them when the run is about to do more (its entries up to the count are still the ones
 * kept). */
static int undo_entries(kvc_cells_undo *u, const kvc_cells *c, int32_t s, bool full) {
    const kvc_seq_pos *sp = &c->seq_pos[s];
    const bool seen = kvc_seqset_has(&u->seqs, s);
    if (seen && (u->keys[s] || !full)) {
        return KVC_OK;
    }
    const uint32_t n = seen ? u->n_keys[s] : sp->n;
    if (full) {
        uint64_t *keys = kvc_malloc_n(n ? n : 1, sizeof *keys);
        if (!keys) {
            return KVC_E_NOMEM;
        }
        memcpy(keys, sp->key, (size_t)n * sizeof *keys);
        u->keys[s] = keys;
    }
    if (!seen) {
        u->n_keys[s] = n;
        memcpy(u->blk + (size_t)s * c->blk_words, kvc_cells_blk(c, s), (size_t)c->blk_words * sizeof *u->blk);
        kvc_seqset_add(&u->seqs, s);
    }
    return KVC_OK;
}

int kvc_cells_undo_seq(kvc_cells_undo *u, const kvc_cells *c, int32_t s) {
    if (kvc_seqset_has(&u->cells_of, s)) {
        return KVC_OK;
    }
    const kvc_seq_pos *sp = &c->seq_pos[s];
    if (!undo_room(u, c, sp->n) || undo_entries(u, c, s, true) != KVC_OK) {
        return KVC_E_NOMEM;
    }
    for (uint32_t k = 0; k < sp->n; k++) {
        keep_cell(u, c, kvc_seq_key_cell(sp->key[k]));
    }
    kvc_seqset_add(&u->cells_of, s);
    return KVC_OK;
}

int kvc_cells_undo_seq_grows(kvc_cells_undo *u, const kvc_cells *c, int32_t s, int32_t p_min) {
    return undo_entries(u, c, s, c->seq_pos[s].n && p_min <= kvc_cells_seq_pos_max(c, s));
}

void kvc_cells_undo_apply(kvc_cells *c, const kvc_cells_undo *u) {
    /* the last saved first: a cell saved twice ends as it was first */
    for (uint32_t j = u->n; j-- > 0;) {
        const uint32_t i = u->cell[j];
        c->pos[i] = u->pos[j];
        c->shift[i] = u->shift[j];
        kvc_cells_seq_put(c, i, u->seq + (size_t)j * c->seq_words);
        if (c->ext) {
            c->ext[i] = u->ext[j];
        }
    }
    for (uint32_t j = 0; j < u->n; j++) {
        kvc_cells_used_range(c, u->cell[j], 1, c->pos[u->cell[j]] != -1);
    }
    for (int32_t s = kvc_seqset_next(&u->seqs, KVC_SEQ_WORDS, -1); s >= 0; s = kvc_seqset_next(&u->seqs, KVC_SEQ_WORDS, s)) {
        if (u->keys[s]) {
            memcpy(c->seq_pos[s].key, u->keys[s], (size_t)u->n_keys[s] * sizeof *u->keys[s]);
        }
        c->seq_pos[s].n = u->n_keys[s];   /* (entries only appended to: the count is enough) */
        memcpy(kvc_cells_blk(c, s), u->blk + (size_t)s * c->blk_words, (size_t)c->blk_words * sizeof *u->blk);
    }
    c->used = u->used;
    c->used_max_p1 = u->used_max_p1;
    c->has_shift = u->has_shift;
    kvc_cells_words_all(c, c->emptied);   /* any cell may have emptied */
    kvc_cells_changed_all(c);
}

void kvc_cells_undo_free(kvc_cells_undo *u) {
    kvc_free(u->cell);
    kvc_free(u->pos);
    kvc_free(u->shift);
    kvc_free(u->seq);
    kvc_free(u->ext);
    for (int32_t s = kvc_seqset_next(&u->seqs, KVC_SEQ_WORDS, -1); u->keys && s >= 0;
         s = kvc_seqset_next(&u->seqs, KVC_SEQ_WORDS, s)) {
        kvc_free(u->keys[s]);
    }
    kvc_free(u->keys);
    kvc_free(u->n_keys);
    kvc_free(u->blk);
    memset(u, 0, sizeof *u);
}
