/* Internal to the C core: sets of sequence ids, one bit per id.
 *
 * A cell table keeps one set per cell in n_words 64-bit words (1 for up to 64 sequences, up to
 * KVC_SEQ_WORDS for KVC_MAX_SEQ), stored as word planes: word w of cell i at seq[w * size + i].
 * Plane 0 alone is the set of a cache of at most 64 sequences, so that case reads and writes one
 * word per cell as it always did, and a pass over one sequence reads one plane. The kvc_seqs_*
 * helpers work on such planes; kvc_seqset is a whole set in one value (what an operation touched,
 * the distinct sequences of a ubatch). Ids are not checked here. */
#ifndef KVC_SEQSET_H
#define KVC_SEQSET_H

#include "kvc_common.h"

#include <string.h>

#define KVC_SEQ_WORDS (KVC_MAX_SEQ / 64)

/* Words per cell for ids [0, n_seq_max). */
static inline uint32_t kvc_seq_words(uint32_t n_seq_max) {
    return n_seq_max <= 64 ? 1u : (n_seq_max + 63) / 64;
}

typedef struct kvc_seqset {
    uint64_t w[KVC_SEQ_WORDS];
} kvc_seqset;

static inline void kvc_seqset_clear(kvc_seqset *s) { memset(s, 0, sizeof *s); }
static inline void kvc_seqset_add(kvc_seqset *s, int32_t id) { s->w[id >> 6] |= (uint64_t)1 << (id & 63); }
static inline bool kvc_seqset_has(const kvc_seqset *s, int32_t id) { return (s->w[id >> 6] >> (id & 63)) & 1u; }
static inline bool kvc_seqset_any(const kvc_seqset *s, uint32_t nw) {
    uint64_t a = 0;
    for (uint32_t w = 0; w < nw; w++) {
        a |= s->w[w];
    }
    return a != 0;
}
static inline uint32_t kvc_seqset_count(const kvc_seqset *s, uint32_t nw) {
    uint32_t n = 0;
    for (uint32_t w = 0; w < nw; w++) {
        n += kvc_popcount64(s->w[w]);
    }
    return n;
}
/* The smallest id > after (after = -1: the smallest) in the first nw words, or -1. */
static inline int32_t kvc_seqset_next(const kvc_seqset *s, uint32_t nw, int32_t after) {
    const int32_t from = after + 1;
    for (uint32_t w = (uint32_t)from >> 6; w < nw; w++) {
        uint64_t m = s->w[w];
        if (w == (uint32_t)from >> 6) {
            m &= ~(uint64_t)0 << (from & 63);
        }
        if (m) {
            return (int32_t)(w * 64 + kvc_ctz64(m));
        }
    }
    return -1;
}

/* --- the sets of a cell table, as word planes of `size` cells ---------------------------- */

static inline bool kvc_seqs_has(const uint64_t *seq, uint32_t size, uint32_t i, int32_t s) {
    return (seq[(size_t)(s >> 6) * size + i] >> (s & 63)) & 1u;
}
static inline void kvc_seqs_add(uint64_t *seq, uint32_t size, uint32_t i, int32_t s) {
    seq[(size_t)(s >> 6) * size + i] |= (uint64_t)1 << (s & 63);
}
static inline void kvc_seqs_del(uint64_t *seq, uint32_t size, uint32_t i, int32_t s) {
    seq[(size_t)(s >> 6) * size + i] &= ~((uint64_t)1 << (s & 63));
}
/* Cell i holds no sequence. */
static inline bool kvc_seqs_none(const uint64_t *seq, uint32_t size, uint32_t nw, uint32_t i) {
    if (nw == 1) {
        return seq[i] == 0;
    }
    uint64_t a = 0;
    for (uint32_t w = 0; w < nw; w++) {
        a |= seq[(size_t)w * size + i];
    }
    return a == 0;
}
static inline uint32_t kvc_seqs_count(const uint64_t *seq, uint32_t size, uint32_t nw, uint32_t i) {
    uint32_t n = 0;
    for (uint32_t w = 0; w < nw; w++) {
        n += kvc_popcount64(seq[(size_t)w * size + i]);
    }
    return n;
}
/* Cell i's set: into the words out[0, nw), or added to acc. */
static inline void kvc_seqs_get(const uint64_t *seq, uint32_t size, uint32_t nw, uint32_t i, uint64_t *out) {
    for (uint32_t w = 0; w < nw; w++) {
        out[w] = seq[(size_t)w * size + i];
    }
}
static inline void kvc_seqs_or_into(const uint64_t *seq, uint32_t size, uint32_t nw, uint32_t i, kvc_seqset *acc) {
    for (uint32_t w = 0; w < nw; w++) {
        acc->w[w] |= seq[(size_t)w * size + i];
    }
}
/* Cell i's set becomes the words in[0, nw) (NULL: empty). */
static inline void kvc_seqs_put(uint64_t *seq, uint32_t size, uint32_t nw, uint32_t i, const uint64_t *in) {
    if (nw == 1) {
        seq[i] = in ? in[0] : 0;
        return;
    }
    for (uint32_t w = 0; w < nw; w++) {
        seq[(size_t)w * size + i] = in ? in[w] : 0;
    }
}
/* Cell i's set becomes {s}. */
static inline void kvc_seqs_only(uint64_t *seq, uint32_t size, uint32_t nw, uint32_t i, int32_t s) {
    kvc_seqs_put(seq, size, nw, i, NULL);
    kvc_seqs_add(seq, size, i, s);
}
/* Copy cell src's set to cell dst (same table). */
static inline void kvc_seqs_copy_cell(uint64_t *seq, uint32_t size, uint32_t nw, uint32_t dst, uint32_t src) {
    if (nw == 1) {
        seq[dst] = seq[src];
        return;
    }
    for (uint32_t w = 0; w < nw; w++) {
        seq[(size_t)w * size + dst] = seq[(size_t)w * size + src];
    }
}
/* The smallest id > after held by cell i, or -1 (ascending walk over a cell's ids). */
static inline int32_t kvc_seqs_next(const uint64_t *seq, uint32_t size, uint32_t nw, uint32_t i, int32_t after) {
    const int32_t from = after + 1;
    for (uint32_t w = (uint32_t)from >> 6; w < nw; w++) {
        uint64_t m = seq[(size_t)w * size + i];
        if (w == (uint32_t)from >> 6) {
            m &= ~(uint64_t)0 << (from & 63);
        }
        if (m) {
            return (int32_t)(w * 64 + kvc_ctz64(m));
        }
    }
    return -1;
}

#endif
