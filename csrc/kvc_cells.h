/* kvcache — the cell table of a unified KV cache (llama_kv_cells_unified).
 *
 * Struct of arrays over `size` cells: position (-1 = empty), accumulated shift, and the set of
 * sequences holding the cell: for a cell one sequence holds (the common case), that sequence in
 * `owner` (two bytes a cell; stale, and never read, for a cell none or several hold); for a cell
 * several hold, seq_words 64-bit words as word planes (kvc_seqset.h), all 0 for every other
 * cell. So a sequence taking a cell of its own writes two bytes, leaving it writes none, and
 * neither touches the planes (8 bytes a cell per 64 sequences, lines the CPU's caches do not
 * keep for a table of many cells). Read and edit the sets through kvc_cells_seq_*.
 * Index structures kept in step:
 *   - used_bits: one bit per cell, set when pos != -1 (the free-cell index that
 *     find_slot scans 64 cells at a time), with the count `used` and used_max_p1;
 *   - free_words: one bit per word of used_bits, set when that word is 0 (64 empty cells), so
 *     that a search for a long run of empty cells visits only the words that can hold one;
 *   - emptied: one bit per word of used_bits, set when a cell of it empties, until the table's
 *     user takes the bits (a summary of where free cells appeared, for a user that keeps its
 *     own of where cells it may place lie: the prefix index's placement);
 *   - seq_some / seq_many: one bit per cell, set when one or more / two or more sequences hold
 *     it, and n_seqs, the count of a cell whose many bit is set (stale otherwise): a cell of one
 *     sequence, the common case, is counted in bits that stay in the caches, not in a line of
 *     its own;
 *   - seq_pos[s]: one entry (position, cell) per cell holding sequence s, ordered by position
 *     then cell (positions may repeat), answering min/max in O(1) and naming the cells of a
 *     range of positions without reading the other cells;
 *   - seq_blk: per sequence one bit per block of 64 cells, set for every block in which some
 *     cell holds the sequence (it may stay set after the block lost it: a superset, made exact
 *     again by the walks that find a block empty), so that an operation on one sequence visits
 *     its blocks, not every cell;
 *   - chg: the cells whose position or sequences changed, in order (a cell may appear more than
 *     once), since the log last restarted; the log restarts (chg_epoch grows) when it is full
 *     and whenever the whole table is replaced, so that (chg_epoch, chg_n) taken at one moment
 *     names everything that changed since: what a mask written then must rewrite. The log is
 *     written only while a reader keeps a place in it (kvc_cells_log_on; until it next fills):
 *     otherwise a change only grows chg_epoch, which tells every (chg_epoch, chg_n) taken before
 *     that anything may have changed.
 * A table may carry the per-cell extension (llama_kv_cell_ext: a 2-D position for M-RoPE, the token
 * id for per-layer embeddings), allocated only for the caches of models that have it; a cell that
 * empties gets its defaults back except through pos_add_raw (llama.cpp's pos_add leaves it).
 * Every mutation below keeps all of them consistent unless it says otherwise. The table is a
 * value of its own (it knows nothing of the cache around it): a cache with several streams
 * keeps one per stream. */
#ifndef KVC_CELLS_H
#define KVC_CELLS_H

#include "kvc_common.h"
#include "kvc_seqset.h"

#ifdef __cplusplus
extern "C" {
#endif

/* The token id of a cell that has none (LLAMA_TOKEN_NULL). */
#define KVC_TOKEN_NULL (-1)

/* owner of a cell that none or several sequences hold */
#define KVC_CELLS_NO_OWNER UINT16_MAX
#if KVC_MAX_SEQ >= 65535
#error "a cell's owner holds a sequence id in 16 bits"
#endif

/* A cell's extension: its 2-D position (x, y) and token id; defaults 0, 0, KVC_TOKEN_NULL. */
typedef struct kvc_cell_ext {
    int32_t x, y, tok;
} kvc_cell_ext;

static inline kvc_cell_ext kvc_cell_ext_default(void) {
    const kvc_cell_ext e = { 0, 0, KVC_TOKEN_NULL };
    return e;
}

/* Is the 2-D position (x, y) after (ox, oy) (row-major: y first)? */
static inline bool kvc_cell_ext_2d_gt(const kvc_cell_ext *e, int32_t ox, int32_t oy) {
    return e->y > oy || (e->y == oy && e->x > ox);
}

typedef struct kvc_seq_pos {
    uint64_t *key;   /* ascending, one per cell holding the sequence: position << 32 | cell
                      * (kvc_seq_key_pos / kvc_seq_key_cell), so that an entry is one word */
    uint32_t n;      /* number of entries (capacity is the cell count) */
    uint32_t sure;   /* the first `sure` entries are the cells of the prefix the index attached
                      * the sequence to, at positions 0, 1, ... (set by the attach, kvc_retain):
                      * 0 once any entry is removed, changed or added before the last */
} kvc_seq_pos;

/* The sequence holds no entry (and the attach's ones with them). */
static inline void kvc_seq_pos_clear(kvc_seq_pos *sp) {
    sp->n = 0;
    sp->sure = 0;
}

static inline uint64_t kvc_seq_key(int32_t pos, uint32_t cell) { return (uint64_t)(uint32_t)pos << 32 | cell; }
static inline int32_t kvc_seq_key_pos(uint64_t key) { return (int32_t)(key >> 32); }
static inline uint32_t kvc_seq_key_cell(uint64_t key) { return (uint32_t)key; }

typedef struct kvc_cells {
    uint32_t    size;         /* number of cells */
    uint32_t    n_seq_max;    /* sequences in use: ids [0, n_seq_max) */
    uint32_t    n_words;      /* (size + 63) / 64: words of used_bits */
    uint32_t    seq_words;    /* kvc_seq_words(n_seq_max): words of a cell's sequence set */
    int32_t    *pos;          /* [size] position, -1 when empty */
    int32_t    *shift;        /* [size] shift accumulated since the last reset_shift */
    uint64_t   *seq;          /* [seq_words * size] word w of cell i's set at seq[w * size + i],
                               * where two or more sequences hold it (its many bit); 0 elsewhere */
    uint16_t   *owner;        /* [size] the sequence holding cell i where exactly one does (its
                               * some bit set, its many bit clear); stale for every other cell,
                               * so that a cell going empty does not write it (kvc_cells_owner) */
    uint16_t   *n_seqs;       /* [size] the sequences in cell i's set (its bits) where its many bit
                               * is set, so that a removal learns whether the cell empties without
                               * reading every plane (planes lie `size` words apart) */
    uint64_t   *seq_some;     /* [n_words] bit i set when some sequence holds cell i */
    uint64_t   *seq_many;     /* [n_words] bit i set when two or more sequences hold cell i */
    uint64_t   *used_bits;    /* [n_words] bit i set when pos[i] != -1 */
    uint64_t   *free_words;   /* [(n_words + 63) / 64] bit w set when used_bits[w] == 0 */
    uint64_t   *emptied;      /* [(n_words + 63) / 64] bit w set when a cell of word w of used_bits
                               * emptied since the bits were last taken (kvc_cells_take_emptied);
                               * init, reset and copy set every bit */
    uint32_t    used;         /* number of cells with pos != -1 */
    uint32_t    used_max_p1;  /* largest used index + 1, or 0 */
    bool        has_shift;    /* some pos_add / pos_div since the last reset_shift */
    bool        empty_zeroes_shift; /* a cell that empties loses its shift (today's llama.cpp);
                               * false: it keeps it until reset_shift (the seed's) */
    bool        chg_on;       /* the log is written (kvc_cells_log_on); false: a change grows chg_epoch */
    kvc_seq_pos *seq_pos;     /* [n_seq_max] per sequence */
    uint64_t   *key_block;    /* a snapshot's (kvc_cells_snapshot): every sequence's entries in one
                               * array, each sequence's exactly as many as it had; NULL: each
                               * sequence's own array, room for every cell */
    uint32_t    blk_words;    /* (n_words + 63) / 64: words of a sequence's block bits */
    uint64_t   *seq_blk;      /* [n_seq_max * blk_words] bit b of sequence s's words: some cell
                               * in [64 b, 64 b + 64) may hold s (every such block has it set) */
    uint32_t   *chg;          /* [size] the change log */
    uint32_t    chg_n;        /* entries in it */
    uint64_t    chg_epoch;    /* grows every time the log restarts */
    kvc_cell_ext *ext;        /* [size] each cell's extension, or NULL: the table has none */
} kvc_cells;

int  kvc_cells_init(kvc_cells *c, uint32_t size, uint32_t n_seq_max); /* KVC_OK / KVC_E_NOMEM */
void kvc_cells_free(kvc_cells *c);
/* Give an initialised table the per-cell extension (every cell at its defaults). KVC_OK or
 * KVC_E_NOMEM (the table unchanged). */
int  kvc_cells_ext_enable(kvc_cells *c);
/* Cell i's extension back to its defaults (no-op for a table without one). */
static inline void kvc_cells_ext_reset(kvc_cells *c, uint32_t i) {
    if (c->ext) {
        c->ext[i] = kvc_cell_ext_default();
    }
}

/* Empty every cell (extensions at their defaults), zero every shift, has_shift = false. */
void kvc_cells_reset(kvc_cells *c);
/* Zero every shift, has_shift = false. */
void kvc_cells_reset_shift(kvc_cells *c);

static inline bool kvc_cells_is_empty(const kvc_cells *c, uint32_t i) { return c->pos[i] == -1; }
/* The same from the used bits (a word for 64 cells): for cells that lie scattered. */
static inline bool kvc_cells_is_empty_bit(const kvc_cells *c, uint32_t i) {
    return !((c->used_bits[i >> 6] >> (i & 63)) & 1u);
}
/* The cells of word w (64 cells) that exactly one sequence holds: those whose owner is theirs. */
static inline uint64_t kvc_cells_one_word(const kvc_cells *c, uint32_t w) {
    return c->seq_some[w] & ~c->seq_many[w];
}
/* The one sequence holding cell i, or KVC_CELLS_NO_OWNER (none or several hold it). */
static inline uint32_t kvc_cells_owner(const kvc_cells *c, uint32_t i) {
    return (kvc_cells_one_word(c, i >> 6) >> (i & 63)) & 1u ? c->owner[i] : KVC_CELLS_NO_OWNER;
}
static inline bool kvc_cells_seq_has(const kvc_cells *c, uint32_t i, int32_t s) {
    const uint64_t b = (uint64_t)1 << (i & 63);
    if (c->seq_many[i >> 6] & b) {
        return kvc_seqs_has(c->seq, c->size, i, s);
    }
    return (c->seq_some[i >> 6] & b) && c->owner[i] == (uint32_t)s;
}
/* Bit i of a per-cell bitmap. */
static inline bool kvc_cells_bit(const uint64_t *bits, uint32_t i) {
    return (bits[i >> 6] >> (i & 63)) & 1u;
}
/* Cell i holds no sequence. */
static inline bool kvc_cells_seq_none(const kvc_cells *c, uint32_t i) {
    return !kvc_cells_bit(c->seq_some, i);
}
/* The number of sequences holding cell i. */
static inline uint32_t kvc_cells_seq_count(const kvc_cells *c, uint32_t i) {
    return kvc_cells_bit(c->seq_many, i) ? c->n_seqs[i] : kvc_cells_bit(c->seq_some, i);
}
/* Cell i is held by n sequences from now on (its bits and count; its sets are the caller's). */
static inline void kvc_cells_count_set(kvc_cells *c, uint32_t i, uint32_t n) {
    const uint64_t b = (uint64_t)1 << (i & 63);
    uint64_t *some = &c->seq_some[i >> 6], *many = &c->seq_many[i >> 6];
    *some = n ? *some | b : *some & ~b;
    if (n >= 2) {
        *many |= b;
        c->n_seqs[i] = (uint16_t)n;
    } else {
        *many &= ~b;
    }
}
/* Word w of cell i's set: bit j for sequence 64 w + j. */
static inline uint64_t kvc_cells_seq_word(const kvc_cells *c, uint32_t i, uint32_t w) {
    const uint32_t o = kvc_cells_owner(c, i);
    if (o != KVC_CELLS_NO_OWNER) {
        return o >> 6 == w ? (uint64_t)1 << (o & 63) : 0;
    }
    return c->seq[(size_t)w * c->size + i];
}
/* Cell i's set into the words out[0, seq_words). */
static inline void kvc_cells_seq_get(const kvc_cells *c, uint32_t i, uint64_t *out) {
    for (uint32_t w = 0; w < c->seq_words; w++) {
        out[w] = kvc_cells_seq_word(c, i, w);
    }
}
/* Add cell i's sequences to acc. */
static inline void kvc_cells_seq_or_into(const kvc_cells *c, uint32_t i, kvc_seqset *acc) {
    for (uint32_t w = 0; w < c->seq_words; w++) {
        acc->w[w] |= kvc_cells_seq_word(c, i, w);
    }
}
/* The smallest sequence id > after holding cell i, or -1 (ascending walk over a cell's ids). */
static inline int32_t kvc_cells_seq_next(const kvc_cells *c, uint32_t i, int32_t after) {
    const uint32_t o = kvc_cells_owner(c, i);
    if (o != KVC_CELLS_NO_OWNER) {
        return (int32_t)o > after ? (int32_t)o : -1;
    }
    return kvc_cells_bit(c->seq_many, i) ? kvc_seqs_next(c->seq, c->size, c->seq_words, i, after) : -1;
}
/* Cell i's set becomes the words in[0, seq_words) (NULL: empty), its counts with it. */
void kvc_cells_seq_put(kvc_cells *c, uint32_t i, const uint64_t *in);
/* Whether every cell of a holds the sequences it holds in b (tables of one size and n_seq_max). */
bool kvc_cells_same_sets(const kvc_cells *a, const kvc_cells *b);
/* The plane of the word that holds sequence s's bit (one word per cell; the cells several
 * sequences hold: kvc_cells_seq_has also reads the owners). */
static inline const uint64_t *kvc_cells_seq_plane(const kvc_cells *c, int32_t s) {
    return c->seq + (size_t)(s >> 6) * c->size;
}
/* Cell i's position is in r (r.p0 >= 0: an empty cell, pos -1, never is). */
static inline bool kvc_cells_pos_in(const kvc_cells *c, uint32_t i, kvc_pos_range r) {
    return kvc_pos_range_has(r, c->pos[i]);
}

/* The emptied bits ((n_words + 63) / 64 words) ORed into `into`, and cleared: the words of
 * used_bits where a cell emptied since the last take (every word after init, reset or copy). */
static inline void kvc_cells_take_emptied(kvc_cells *c, uint64_t *into) {
    const uint32_t n = (c->n_words + 63) / 64;
    for (uint32_t k = 0; k < n; k++) {
        into[k] |= c->emptied[k];
        c->emptied[k] = 0;
    }
}

/* Cell i changed (position or sequences). */
static inline void kvc_cells_changed(kvc_cells *c, uint32_t i) {
    if (!c->chg_on) {
        c->chg_epoch++;   /* no reader keeps a place in the log: nothing to write in it */
    } else if (c->chg_n < c->size) {
        c->chg[c->chg_n++] = i;
    } else {
        c->chg_epoch++;   /* full: every place kept in it is void, so is the reason to write it */
        c->chg_n = 0;
        c->chg_on = false;
    }
}
/* A reader keeps its place in the log, (chg_epoch, chg_n) as they are now: the changes from now
 * on are written in it (until it fills). */
static inline void kvc_cells_log_on(kvc_cells *c) {
    c->chg_on = true;
}
/* Every cell may have changed: the log restarts. */
static inline void kvc_cells_changed_all(kvc_cells *c) {
    c->chg_epoch++;
    c->chg_n = 0;
}

/* The block bits of sequence s (blk_words words). */
static inline uint64_t *kvc_cells_blk(const kvc_cells *c, int32_t s) {
    return c->seq_blk + (size_t)s * c->blk_words;
}
/* Cell i may hold s from now on: its block's bit. */
static inline void kvc_cells_blk_mark(kvc_cells *c, uint32_t i, int32_t s) {
    kvc_cells_blk(c, s)[i >> 12] |= (uint64_t)1 << ((i >> 6) & 63);
}
/* The first block >= b whose bit sequence s has set and that starts below `end` cells, or
 * UINT32_MAX. */
static inline uint32_t kvc_cells_blk_next(const kvc_cells *c, int32_t s, uint32_t b, uint32_t end) {
    const uint64_t *bits = kvc_cells_blk(c, s);
    const uint32_t n_blk = (end + 63) >> 6;
    if (b >= n_blk) {
        return UINT32_MAX;
    }
    uint32_t w = b >> 6;
    uint64_t m = bits[w] & (~(uint64_t)0 << (b & 63));
    for (;;) {
        if (m) {
            const uint32_t k = (w << 6) + kvc_ctz64(m);
            return k < n_blk ? k : UINT32_MAX;
        }
        if (++w >= (n_blk + 63) >> 6) {
            return UINT32_MAX;
        }
        m = bits[w];
    }
}
/* The cells of block b holding sequence s, bit j for cell 64 b + j (exact; from the cells). */
static inline uint64_t kvc_cells_blk_cells(const kvc_cells *c, int32_t s, uint32_t b) {
    const uint64_t *plane = kvc_cells_seq_plane(c, s) + ((size_t)b << 6);
    const uint16_t *owner = c->owner + ((size_t)b << 6);
    const unsigned bit = (unsigned)(s & 63);
    const uint32_t n = c->size - (b << 6) < 64 ? c->size - (b << 6) : 64;
    uint64_t m = 0;
    for (uint64_t one = kvc_cells_one_word(c, b); one; one &= one - 1) {
        const uint32_t j = kvc_ctz64(one);
        m |= (uint64_t)(owner[j] == (uint32_t)s) << j;
    }
    if (c->seq_many[b]) {
        for (uint32_t j = 0; j < n; j++) {
            m |= ((plane[j] >> bit) & 1u) << j;
        }
    }
    return m;
}
/* Block b holds no cell of s any more: its bit goes. */
static inline void kvc_cells_blk_drop(kvc_cells *c, int32_t s, uint32_t b) {
    kvc_cells_blk(c, s)[b >> 6] &= ~((uint64_t)1 << (b & 63));
}
/* Blocks sequence s has marked. */
uint32_t kvc_cells_blk_count(const kvc_cells *c, int32_t s);

/* Cell i is about to get sequence s: its position and owner (the planes and the count are read
 * only for a cell several sequences share). */
KVC_PREFETCH_FN void kvc_cells_prefetch_seq(const kvc_cells *c, uint32_t i, int32_t s) {
    (void)s;
    KVC_PREFETCH_W(c->pos + i);
    KVC_PREFETCH_W(c->owner + i);
}
/* Cell i is about to lose a sequence that holds it: its position (a cell of one sequence
 * empties; its owner is not read). */
KVC_PREFETCH_FN void kvc_cells_prefetch_leave(const kvc_cells *c, uint32_t i) {
    KVC_PREFETCH_W(c->pos + i);
}
/* Cell i is about to get sequence s at a position after s's last: also the end of s's entries
 * (every sequence's in a line of its own). */
KVC_PREFETCH_FN void kvc_cells_prefetch_append(const kvc_cells *c, uint32_t i, int32_t s) {
    kvc_cells_prefetch_seq(c, i, s);
    if (c->seq_pos[s].n) {
        KVC_PREFETCH_W(c->seq_pos[s].key + c->seq_pos[s].n - 1);
    }
}

/* Give the empty cell i position p (>= 0); it becomes used (no sequences yet). */
void kvc_cells_pos_set(kvc_cells *c, uint32_t i, int32_t p);
/* Give the empty cell i position p (>= 0) and its first sequence s, in one call (a placed
 * token's common case: each field of the cell written once, one entry in the change log). */
void kvc_cells_place_first(kvc_cells *c, uint32_t i, int32_t p, int32_t s);
/* The runs placement and attaching hand to kvc_cells_place_first_run: at least MIN cells
 * (below it placing cell by cell costs less than finding the run), at most MAX at a time. */
#define KVC_CELLS_RUN_MIN 8u
#define KVC_CELLS_RUN_MAX 64u
/* kvc_cells_place_first of the empty cells i .. i + n - 1 in order, cell i + j at pos[j] for
 * sequence seq[j]: the same table, change log included, the run's bits set a word at a time. */
void kvc_cells_place_first_run(kvc_cells *c, uint32_t i, uint32_t n, const int32_t *pos, const int32_t *seq);
/* How many of the cells i, i + 1, ... are empty before the first used one, at most n (cells
 * past the table's end are not read: n <= size - i). */
uint32_t kvc_cells_empty_run(const kvc_cells *c, uint32_t i, uint32_t n);
/* Sequence s joins non-empty cell i (no-op when already there). */
void kvc_cells_seq_add(kvc_cells *c, uint32_t i, int32_t s);
/* The empty cells [i, i + n) get positions pos[0 .. n) and each the sequences ids[0 .. n_ids),
 * as kvc_cells_pos_set and kvc_cells_seq_add of every id would, cell after cell, with one pass
 * per array (a sequence's index entries appended at once when they come after its last). */
void kvc_cells_place_run(kvc_cells *c, uint32_t i, uint32_t n, const int32_t *pos, const int32_t *ids, uint32_t n_ids);
/* Sequence s leaves cell i (which holds it); returns true when the cell became empty. */
bool kvc_cells_seq_rm(kvc_cells *c, uint32_t i, int32_t s);
/* Move cell src to the empty cell dst (defrag): pos, shift and sequences; src becomes empty
 * with shift 0. */
void kvc_cells_mv(kvc_cells *c, uint32_t src, uint32_t dst);
/* kvc_cells_mv of cells src + j to dst + j for j = 0 .. n - 1, in that order (the two ranges
 * apart, every destination empty). */
void kvc_cells_mv_run(kvc_cells *c, uint32_t src, uint32_t dst, uint32_t n);

/* Raw edits used by bulk operations: they keep used_bits/used/used_max_p1 right but NOT
 * seq_pos; the caller must call kvc_cells_rebuild_seq_pos(c, mask) with the union of the
 * sequence bits of every cell it touched (before and after). */
/* pos += d (saturating at KVC_POS_MAX), shift += d, has_shift = true; a cell pushed below 0 is
 * emptied (returns true). */
bool kvc_cells_pos_add_raw(kvc_cells *c, uint32_t i, int32_t d);
/* pos = pos / d (C division), shift += old - new, has_shift = true. */
void kvc_cells_pos_div_raw(kvc_cells *c, uint32_t i, int32_t d);
/* Set cell i to (pos, the seq_words words of its set) as a snapshot had it (shift untouched);
 * pos -1 = empty. */
void kvc_cells_set_raw(kvc_cells *c, uint32_t i, int32_t pos, const uint64_t *seq);
/* Sequence s leaves cell i; a cell left with no sequence is emptied (returns true). The index
 * (seq_pos) is not updated. */
bool kvc_cells_seq_del_raw(kvc_cells *c, uint32_t i, int32_t s);
/* Sequence s joins non-empty cell i (no-op when already there). The index (seq_pos) is not
 * updated. */
void kvc_cells_seq_add_raw(kvc_cells *c, uint32_t i, int32_t s);
/* Cell i keeps only sequence s (which it holds). The index is not updated. */
void kvc_cells_seq_only_raw(kvc_cells *c, uint32_t i, int32_t s);
/* Empty cell i (sequences cleared, shift kept). */
void kvc_cells_clear_raw(kvc_cells *c, uint32_t i);
/* Recompute seq_pos[s] from the cells for every s in mask (walking their blocks when they are
 * few, else one pass over the cells that also makes their block bits exact). */
void kvc_cells_rebuild_seq_pos(kvc_cells *c, const kvc_seqset *mask);
/* Remove the entries in r from seq_pos[s] (after clearing s from those cells). */
void kvc_cells_seq_pos_rm_range(kvc_cells *c, int32_t s, kvc_pos_range r);
/* The entries of seq_pos[s] whose position is in r: [*a, *b). O(log n). */
void kvc_cells_seq_pos_span(const kvc_cells *c, int32_t s, kvc_pos_range r, uint32_t *a, uint32_t *b);
/* The first entry of seq_pos[s] whose position is p or more (seq_pos[s].n when none). O(log n). */
uint32_t kvc_cells_seq_pos_from(const kvc_cells *c, int32_t s, int32_t p);
/* Sequence s leaves every cell whose position is in r (cells found through seq_pos[s]: the
 * others are not read; every index kept, and no block left without s keeps its bit). Returns
 * the lowest cell that became empty, or c->size when none did. */
uint32_t kvc_cells_seq_rm_range(kvc_cells *c, int32_t s, kvc_pos_range r);

/* Sequence dst (!= src) joins every cell of sequence src whose position is in r (cells found
 * through seq_pos[src], dst's entries merged into seq_pos[dst]: O(cells in r + cells of dst),
 * every index kept). Returns whether any cell changed. */
bool kvc_cells_seq_cp_range(kvc_cells *c, int32_t src, int32_t dst, kvc_pos_range r);

/* Smallest / largest position of sequence s, -1 when absent. O(1). */
static inline int32_t kvc_cells_seq_pos_min(const kvc_cells *c, int32_t s) {
    return c->seq_pos[s].n ? kvc_seq_key_pos(c->seq_pos[s].key[0]) : -1;
}
static inline int32_t kvc_cells_seq_pos_max(const kvc_cells *c, int32_t s) {
    return c->seq_pos[s].n ? kvc_seq_key_pos(c->seq_pos[s].key[c->seq_pos[s].n - 1]) : -1;
}

/* Does sequence s hold a position in r? O(log n). */
bool kvc_cells_seq_pos_any_in(const kvc_cells *c, int32_t s, kvc_pos_range r);
/* How many cells of sequence s have a position in r? O(log n). */
uint32_t kvc_cells_seq_pos_count_in(const kvc_cells *c, int32_t s, kvc_pos_range r);

/* The cells holding sequence s (c->seq_pos[s].n of them) ordered by position, ties by cell:
 * cell k into cells[k], its position into pos[k]. KVC_OK (it cannot fail: the index is in that
 * order). */
int kvc_cells_seq_cells(const kvc_cells *c, int32_t s, int32_t *cells, int32_t *pos);

/* First used cell in [from, to), or `to` when none. */
uint32_t kvc_cells_next_used(const kvc_cells *c, uint32_t from, uint32_t to);
/* The first p in [a, b] such that cells [p, p + n) are all empty (b + n <= size), or
 * UINT32_MAX. Reads the used bits of [a, p + n) a word at a time, or for n >= 127 (a run that
 * long holds a whole empty word) only the words around the empty ones. */
uint32_t kvc_cells_first_free_run(const kvc_cells *c, uint32_t a, uint32_t b, uint32_t n);
/* The used cell u in [lo, end) such that [u, end) holds exactly k (>= 1) used cells, or
 * UINT32_MAX when [lo, end) holds fewer. Reads the used bits a word at a time from end down. */
uint32_t kvc_cells_kth_used_back(const kvc_cells *c, uint32_t lo, uint32_t end, uint32_t k);
/* First empty cell in [from, to), or `to` when none. */
uint32_t kvc_cells_next_empty(const kvc_cells *c, uint32_t from, uint32_t to);

/* KVC_OK when every cell's sequence count (its bits, n_seqs) is the number of its sequences and no empty
 * cell holds a sequence, else KVC_E_INTERNAL naming the first cell that breaks it. */
int kvc_cells_check(const kvc_cells *c, kvc_err *err);

/* Copy the whole table (arrays, counters, seq_pos, extensions) from src into dst, both
 * initialised with the same size, n_seq_max and extension, or dst a table src is a snapshot of
 * (putting the snapshot back). */
void kvc_cells_copy(kvc_cells *dst, const kvc_cells *src);
/* dst becomes a copy of src to put back later with kvc_cells_copy (transactional operations):
 * its sequences' entries take only the room src's have, in one allocation, so that a snapshot
 * costs the table's cells and the entries there are, not a full-size array per sequence. A
 * snapshot is read and put back, never changed. KVC_OK, or KVC_E_NOMEM (dst zeroed). */
int kvc_cells_snapshot(kvc_cells *dst, const kvc_cells *src);

/* What a dry run changes of a table, kept to put it back (kvc_cells_undo_apply): each cell as it
 * was before the run named it (kvc_cells_undo_cells), the entries and block bits of each sequence
 * it named (kvc_cells_undo_seq, kvc_cells_undo_seq_grows), and the counts. It costs what the run touches, where a snapshot
 * costs the whole table. The run may change only the cells and sequences it named first. */
typedef struct kvc_cells_undo {
    uint32_t      n, cap;        /* cells saved (one may be saved more than once: the first wins) */
    uint32_t     *cell;          /* [cap] */
    int32_t      *pos, *shift;   /* [cap] */
    uint64_t     *seq;           /* [cap * seq_words] each cell's words, one after the other */
    kvc_cell_ext *ext;           /* [cap] with the extension, else NULL */
    kvc_seqset    seqs;          /* the sequences whose entries and block bits are kept */
    kvc_seqset    cells_of;      /* the sequences whose cells are kept too */
    uint64_t    **keys;          /* [n_seq_max] each kept sequence's entries (owned), or NULL: the
                                  * run only appends to them, and n_keys is enough */
    uint32_t     *n_keys;        /* [n_seq_max] */
    uint64_t     *blk;           /* [n_seq_max * blk_words] the saved sequences' block bits */
    uint32_t      used, used_max_p1;
    bool          has_shift;
} kvc_cells_undo;

/* Begin an undo of c (its counts kept). KVC_OK or KVC_E_NOMEM (u zeroed). */
int  kvc_cells_undo_init(kvc_cells_undo *u, const kvc_cells *c);
/* Keep cells[0, n) as they are now. KVC_OK or KVC_E_NOMEM (nothing kept: put back what was). */
int  kvc_cells_undo_cells(kvc_cells_undo *u, const kvc_cells *c, const int32_t *cells, uint32_t n);
/* Keep sequence s's entries and block bits as they are now, and its cells: the run may remove s
 * from any of them (kept once; a later call keeps nothing more). KVC_OK or KVC_E_NOMEM. */
int  kvc_cells_undo_seq(kvc_cells_undo *u, const kvc_cells *c, int32_t s);
/* Keep what the run changes of sequence s when it gives s cells at positions p_min or more (cells
 * kept with kvc_cells_undo_cells): its entries (their count alone while they only grow after its
 * last) and block bits. KVC_OK or KVC_E_NOMEM. */
int  kvc_cells_undo_seq_grows(kvc_cells_undo *u, const kvc_cells *c, int32_t s, int32_t p_min);
/* Put c back as u kept it (every index kept; the change log restarts, as after kvc_cells_copy). */
void kvc_cells_undo_apply(kvc_cells *c, const kvc_cells_undo *u);
void kvc_cells_undo_free(kvc_cells_undo *u);

#ifdef __cplusplus
}
#endif

#endif
