/* libFuzzer target: the unified cache's state decoders (csrc/kvc_state.h): kvc_unified_state_read_ex
 * (whole cache and per sequence, with or without V layout conversion and the exact-length check),
 * kvc_unified_state_read_parts_ex over two caches (the iSWA layout: a base part, then a SWA part),
 * and kvc_state_describe (the cache-free walk behind `kvcache inspect`).
 *
 * Input: an 18-byte header that chooses the caches and the call, then the state blob.
 *   [0]  bits 0-1 type_k (f32, f16, bf16, q8_0), bits 2-3 type_v (same list), bit 4 v_trans
 *        (ignored for a q8_0 V), bits 5-6 kept layers of cache 0 (0..3), bit 7 no K/V memory
 *   [1]  bits 0-2 kv_size of cache 0 (32, 64, 96, 128, 256, 512, 1024, 4096), bits 3-7 n_seq_max - 1
 *   [2]  destination: seq_id = byte % (n_seq_max + 1) - 1 (-1 = whole cache)
 *   [3]  seed of the operations that fill the caches before the read (0: empty caches)
 *   [4]  bits 0-3 allocation fault (0 none, else the n-th allocation inside the read fails),
 *        bit 4 KVC_STATE_CONVERT_V, bit 5 KVC_STATE_EXACT, bit 6 two parts (caches 0 and 1),
 *        bit 7 the layouts of today's llama.cpp: kvc_unified_state_read_parts_lay with the layout
 *        found from the bytes (the seed's, or stream counts and the sequence-blob prefix)
 *   [5..10]  K and V row widths of the layers 0..2 of cache 0: 1 + byte % 64 (q8_0: 32 or 64)
 *   [11] cache 1: bits 0-2 kv_size, bits 3-4 kept layers (0..3); types, v_trans, n_seq_max and
 *        the memory choice are cache 0's (as for the two halves of an iSWA cache)
 *   [12..17] the widths of cache 1
 *
 * Contract checked on every input:
 *   - failure: a status of KVC_E_STATE (or KVC_E_NOMEM under an injected fault), a message, and
 *     every cache byte-identical to before (cells, index structures, head, n, recovery, defrag
 *     plan, every K/V byte), also when only a later part is bad;
 *   - success: each cell table is consistent, exactly the cells a part describes changed (per
 *     sequence: the destination's old cells lost it, one contiguous run holds the part's cells;
 *     whole cache: cells [0, n) are the part's, the rest empty and zeroed), the K/V rows are the
 *     part's (V converted to the cache's layout when asked), with the exact flag nothing trails,
 *     state_write reproduces each consumed part (ids canonical, V in the cache's layout), and
 *     reading that re-write back leaves the same state;
 *   - describe: it fails or succeeds with a description inside the input, and after a
 *     successful whole-cache read it agrees with the read on every part (cells, ids, layout,
 *     offsets);
 *   - layouts (bit 7): failure as above; success: consistent cells, and the state re-written in
 *     the stream layout (with the prefix for a sequence) reads back in that layout to the same
 *     state, and writes the same bytes again. */
#include "fuzz_cache.h"
#include "fuzz_part.h"
#include "kvc_state.h"
#include "kvc_types.h"

enum { HEADER = 18, MAX_LAYERS = FP_MAX_LAYERS, MAX_PARTS = 2 };
_Static_assert(MAX_LAYERS == FC_MAX_LAYERS, "the geometry of fuzz_cache.h holds MAX_LAYERS layers");
static const size_t MAX_KV_BYTES = (size_t)256 << 10; /* larger geometries are skipped (speed) */

static const int32_t TYPES[4] = { KVC_TYPE_F32, KVC_TYPE_F16, KVC_TYPE_BF16, KVC_TYPE_Q8_0 };
static const uint32_t SIZES[8] = { 32, 64, 96, 128, 256, 512, 1024, 4096 };

typedef fc_geometry geometry; /* semantics 2025, no window */

typedef struct call {
    geometry g[MAX_PARTS];
    uint32_t n_parts;
    int32_t seq_id;
    uint8_t prefill, fault;
    unsigned flags;
    bool layouts;
} call;

static uint32_t width_of(int32_t type, uint8_t b) {
    return type == KVC_TYPE_Q8_0 ? 32u * (1u + b % 2u) : 1u + b % 64u;
}

/* Cache k's geometry from its size/layer bits and widths; false when it is too large. */
static bool part_geometry(geometry *g, const geometry *first, uint32_t kv_size, uint32_t n_layer,
                          const uint8_t *widths) {
    *g = *first;
    g->kv_size = kv_size;
    g->n_layer = n_layer;
    size_t total = 0;
    for (uint32_t l = 0; l < MAX_LAYERS; l++) {
        g->il[l] = (int32_t)l;
        g->ek[l] = width_of(g->type_k, widths[2 * l]);
        g->ev[l] = width_of(g->type_v, widths[2 * l + 1]);
        if (l < n_layer) {
            total += kvc_row_size(g->type_k, g->ek[l]) + kvc_row_size(g->type_v, g->ev[l]);
        }
    }
    return total * kv_size <= MAX_KV_BYTES;
}

static bool parse_header(const uint8_t *data, size_t size, call *k) {
    if (size < HEADER) {
        return false;
    }
    memset(k, 0, sizeof *k);
    geometry base;
    memset(&base, 0, sizeof base);
    base.type_k = TYPES[data[0] & 3];
    base.type_v = TYPES[(data[0] >> 2) & 3];
    base.v_trans = (data[0] >> 4) & 1 && base.type_v != KVC_TYPE_Q8_0;
    base.meta_only = data[0] >> 7;
    base.n_seq_max = 1u + (data[1] >> 3);
    k->seq_id = (int32_t)(data[2] % (base.n_seq_max + 1)) - 1;
    k->prefill = data[3];
    k->fault = data[4] & 15;
    k->flags = ((data[4] >> 4) & 1 ? KVC_STATE_CONVERT_V : 0) | ((data[4] >> 5) & 1 ? KVC_STATE_EXACT : 0);
    k->n_parts = (data[4] >> 6) & 1 ? 2 : 1;
    k->layouts = (data[4] >> 7) & 1;
    if (!part_geometry(&k->g[0], &base, SIZES[data[1] & 7], (data[0] >> 5) & 3, data + 5)) {
        return false;
    }
    return k->n_parts == 1 || part_geometry(&k->g[1], &base, SIZES[data[11] & 7], (data[11] >> 3) & 3, data + 12);
}

/* --- a cache with its own K/V memory (fuzz_cache.h) ---------------------------------- */

typedef fc_cache cache;

/* Fill the cache with a deterministic mix of operations chosen by seed (0: leave it empty),
 * then fill the K/V memory with noise. */
static void prefill(cache *t, uint8_t seed) {
    fz_rng g;
    fz_rng_seed(&g, seed);
    const uint32_t size = t->c.cells.size, n_seq = t->c.n_seq_max;
    int32_t next_pos[KVC_MAX_SEQ] = { 0 };
    const uint32_t n_ops = seed ? 1 + fz_below(&g, 24) : 0;
    const uint32_t max_ub = size / 4 < 64 ? size / 4 : 64;
    for (uint32_t op = 0; op < n_ops; op++) {
        const int32_t s = (int32_t)fz_below(&g, n_seq);
        switch (fz_below(&g, 10)) {
        case 0: case 1: case 2: case 3: case 4:
            fc_place(t, &g, -1, 1 + fz_below(&g, max_ub), next_pos, true);
            break;
        case 5: {
            const int32_t p0 = (int32_t)fz_below(&g, 64) - 8;
            kvc_unified_seq_rm(&t->c, fz_below(&g, 4) == 0 ? -1 : s, p0, p0 + (int32_t)fz_below(&g, 48));
            break;
        }
        case 6:
            kvc_unified_seq_cp(&t->c, s, (int32_t)fz_below(&g, n_seq), -1, -1);
            break;
        case 7:
            /* a pending shift: the read must keep (or, on success, reproduce) it */
            kvc_unified_seq_add(&t->c, s, 0, -1, (int32_t)fz_below(&g, 9) - 4);
            break;
        case 8:
            if (kvc_unified_defrag_prepare(&t->c, 1 + (int32_t)fz_below(&g, 64)) == 1) {
                kvc_unified_defrag_move(&t->c);
            }
            break;
        default:
            kvc_unified_seq_div(&t->c, s, 0, -1, 2);
            break;
        }
    }
    /* an uncommitted placement leaves recovery information behind */
    if (seed & 0x80) {
        fc_place(t, &g, -1, 1 + fz_below(&g, max_ub), next_pos, false);
    }
    fz_kv_fill(&t->mem, &g);
}

/* --- a deep copy of everything a failed read must leave alone ------------------------ */

typedef struct image {
    uint32_t size, n_words, n_seq_max;
    int32_t *pos, *shift;
    uint64_t *seq, *used_bits;
    uint32_t used, used_max_p1;
    bool has_shift;
    uint32_t seq_pos_n[KVC_MAX_SEQ];
    uint64_t *seq_pos_key[KVC_MAX_SEQ];
    uint32_t head, n, n_defrag_ids;
    kvc_slot slot;
    kvc_undo undo;       /* copies of the log's arrays (lengths only) */
    uint32_t *defrag_ids;
    bool do_defrag, defrag_pending;
    fz_kv mem;
} image;

/* Every cell's set, word w of cell i at [w * size + i] (a new allocation). */
static uint64_t *cell_sets(const kvc_cells *cl) {
    uint64_t *sets = fz_alloc(((size_t)cl->seq_words * cl->size + 1) * sizeof *sets);
    for (uint32_t w = 0; w < cl->seq_words; w++) {
        for (uint32_t i = 0; i < cl->size; i++) {
            sets[(size_t)w * cl->size + i] = kvc_cells_seq_word(cl, i, w);
        }
    }
    return sets;
}

static void image_take(image *m, const cache *t) {
    const kvc_unified *c = &t->c;
    const kvc_cells *cl = &c->cells;
    memset(m, 0, sizeof *m);
    m->size = cl->size;
    m->n_words = cl->n_words;
    m->n_seq_max = cl->n_seq_max;
    m->pos = (int32_t *)fz_dup((const uint8_t *)cl->pos, cl->size * sizeof *cl->pos);
    m->shift = (int32_t *)fz_dup((const uint8_t *)cl->shift, cl->size * sizeof *cl->shift);
    m->seq = cell_sets(cl);
    m->used_bits = (uint64_t *)fz_dup((const uint8_t *)cl->used_bits, cl->n_words * sizeof *cl->used_bits);
    m->used = cl->used;
    m->used_max_p1 = cl->used_max_p1;
    m->has_shift = cl->has_shift;
    for (uint32_t s = 0; s < cl->n_seq_max; s++) {
        m->seq_pos_n[s] = cl->seq_pos[s].n;
        m->seq_pos_key[s] = (uint64_t *)fz_dup((const uint8_t *)cl->seq_pos[s].key, cl->seq_pos[s].n * sizeof(uint64_t));
    }
    m->head = c->head;
    m->n = c->n;
    m->slot = c->slot;
    m->undo.n_spans = c->undo.n_spans;
    m->undo.n_cells = c->undo.n_cells;
    m->undo.spans = (kvc_undo_span *)fz_dup((const uint8_t *)c->undo.spans, c->undo.n_spans * sizeof *c->undo.spans);
    m->undo.pos = (int32_t *)fz_dup((const uint8_t *)c->undo.pos, c->undo.n_cells * sizeof *c->undo.pos);
    m->undo.seq = (uint64_t *)fz_dup((const uint8_t *)c->undo.seq,
                                     (size_t)c->undo.n_cells * c->undo.seq_words * sizeof *c->undo.seq);
    m->n_defrag_ids = c->n_defrag_ids;
    m->defrag_ids = (uint32_t *)fz_dup((const uint8_t *)c->defrag_ids, c->n_defrag_ids * sizeof *c->defrag_ids);
    m->do_defrag = c->do_defrag;
    m->defrag_pending = c->defrag_pending;
    fz_kv_copy(&m->mem, &t->mem);
}

static void image_free(image *m) {
    free(m->pos);
    free(m->shift);
    free(m->seq);
    free(m->used_bits);
    for (uint32_t s = 0; s < KVC_MAX_SEQ; s++) {
        free(m->seq_pos_key[s]);
    }
    free(m->undo.spans);
    free(m->undo.pos);
    free(m->undo.seq);
    free(m->defrag_ids);
    fz_kv_free(&m->mem);
    memset(m, 0, sizeof *m);
}

#define SAME_BYTES(a, b, n, what) \
    FUZZ_CHECK(memcmp((a), (b), (n)) == 0, "%s: %s differs at byte %ld", when, what, fz_first_diff((const uint8_t *)(a), (const uint8_t *)(b), (n)))
#define SAME_VALUE(a, b, what) \
    FUZZ_CHECK((a) == (b), "%s: %s %lld != %lld", when, what, (long long)(a), (long long)(b))

/* Everything in m is what the cache holds now. */
static void image_check(const image *m, const cache *t, const char *when) {
    const kvc_unified *c = &t->c;
    const kvc_cells *cl = &c->cells;
    SAME_BYTES(cl->pos, m->pos, m->size * sizeof *m->pos, "cell positions");
    SAME_BYTES(cl->shift, m->shift, m->size * sizeof *m->shift, "cell shifts");
    uint64_t *sets = cell_sets(cl);
    SAME_BYTES(sets, m->seq, (size_t)cl->seq_words * m->size * sizeof *m->seq, "cell sequence sets");
    free(sets);
    SAME_BYTES(cl->used_bits, m->used_bits, m->n_words * sizeof *m->used_bits, "used bits");
    SAME_VALUE(cl->used, m->used, "used");
    SAME_VALUE(cl->used_max_p1, m->used_max_p1, "used_max_p1");
    SAME_VALUE(cl->has_shift, m->has_shift, "has_shift");
    for (uint32_t s = 0; s < m->n_seq_max; s++) {
        SAME_VALUE(cl->seq_pos[s].n, m->seq_pos_n[s], "seq_pos count");
        SAME_BYTES(cl->seq_pos[s].key, m->seq_pos_key[s], m->seq_pos_n[s] * sizeof(uint64_t), "seq_pos entries");
    }
    SAME_VALUE(c->head, m->head, "head");
    SAME_VALUE(c->n, m->n, "n");
    SAME_VALUE(c->slot.head, m->slot.head, "placement head");
    SAME_VALUE(c->slot.n, m->slot.n, "placement size");
    SAME_VALUE(c->undo.n_spans, m->undo.n_spans, "undo spans");
    SAME_VALUE(c->undo.n_cells, m->undo.n_cells, "undo cells");
    SAME_BYTES(c->undo.spans, m->undo.spans, m->undo.n_spans * sizeof *m->undo.spans, "undo spans");
    SAME_BYTES(c->undo.pos, m->undo.pos, m->undo.n_cells * sizeof *m->undo.pos, "undo positions");
    SAME_BYTES(c->undo.seq, m->undo.seq, (size_t)m->undo.n_cells * c->undo.seq_words * sizeof *m->undo.seq,
               "undo sequence sets");
    SAME_VALUE(c->n_defrag_ids, m->n_defrag_ids, "defrag plan length");
    SAME_BYTES(c->defrag_ids, m->defrag_ids, m->n_defrag_ids * sizeof *m->defrag_ids, "defrag plan");
    SAME_VALUE(c->do_defrag, m->do_defrag, "do_defrag");
    SAME_VALUE(c->defrag_pending, m->defrag_pending, "defrag_pending");
    fz_kv_check(&t->mem, &m->mem, when);
}

/* --- invariants of the cell table ------------------------------------------------------ */

/* The index of a sequence: its cells' keys (position, then cell) ascending. */
static int cmp_u64(const void *a, const void *b) {
    const uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return (x > y) - (x < y);
}

static void check_cells(const kvc_cells *cl, const char *when) {
    uint32_t used = 0, used_max_p1 = 0;
    for (uint32_t i = 0; i < cl->size; i++) {
        const bool bit = (cl->used_bits[i >> 6] >> (i & 63)) & 1;
        FUZZ_CHECK(bit == (cl->pos[i] != -1), "%s: used bit of cell %u disagrees with pos %d", when, i, cl->pos[i]);
        FUZZ_CHECK(cl->pos[i] >= -1, "%s: cell %u has position %d", when, i, cl->pos[i]);
        if (cl->pos[i] == -1) {
            FUZZ_CHECK(kvc_cells_seq_word(cl, i, 0) == 0, "%s: empty cell %u holds sequences", when, i);
            continue;
        }
        FUZZ_CHECK(cl->n_seq_max >= 64 || (kvc_cells_seq_word(cl, i, 0) >> cl->n_seq_max) == 0, "%s: cell %u holds an id >= n_seq_max", when, i);
        used++;
        used_max_p1 = i + 1;
    }
    for (uint32_t b = cl->size; b < cl->n_words * 64; b++) {
        FUZZ_CHECK(!((cl->used_bits[b >> 6] >> (b & 63)) & 1), "%s: used bit past the end", when);
    }
    for (uint32_t w = 0; w < cl->n_words; w++) {
        FUZZ_CHECK(((cl->free_words[w >> 6] >> (w & 63)) & 1) == (cl->used_bits[w] == 0), "%s: empty-word bit %u", when, w);
    }
    SAME_VALUE(cl->used, used, "used count");
    SAME_VALUE(cl->used_max_p1, used_max_p1, "used_max_p1");
    uint64_t *expect = fz_alloc((cl->size ? cl->size : 1) * sizeof *expect);
    for (uint32_t s = 0; s < cl->n_seq_max; s++) {
        uint32_t k = 0;
        for (uint32_t i = 0; i < cl->size; i++) {
            if (cl->pos[i] != -1 && ((kvc_cells_seq_word(cl, i, 0) >> s) & 1)) {
                expect[k++] = kvc_seq_key(cl->pos[i], i);
            }
        }
        qsort(expect, k, sizeof *expect, cmp_u64);
        SAME_VALUE(cl->seq_pos[s].n, k, "seq_pos count");
        SAME_BYTES(cl->seq_pos[s].key, expect, k * sizeof *expect, "seq_pos entries");
    }
    free(expect);
}

/* Byte address, in the cache, of V element j of cell i. */
static const uint8_t *cache_v_elem(const kvc_unified *c, const uint8_t *v, uint32_t l, uint32_t i, uint32_t j) {
    const size_t el = v_elem(c);
    return v + (c->v_trans ? ((size_t)j * c->cells.size + i) * el : (size_t)i * c->layers[l].v_row_bytes + (size_t)j * el);
}

/* Cell k of the part sits in cell dst + k: its K row, and its V row or V column. */
static void check_rows(const cache *t, const layout *L, uint32_t dst, const char *when) {
    const kvc_unified *c = &t->c;
    const size_t size = c->cells.size;
    for (uint32_t l = 0; l < c->n_layer && t->mem.k[l]; l++) {
        const kvc_layer *ly = &c->layers[l];
        const size_t kr = ly->k_row_bytes;
        SAME_BYTES(t->mem.k[l] + dst * kr, L->p + L->k_off[l], L->cc * kr, "restored K rows");
        if (L->vt != c->v_trans) {
            const size_t el = v_elem(c);
            for (uint32_t k = 0; k < L->cc; k++) {
                for (uint32_t j = 0; j < ly->n_embd_v; j++) {
                    FUZZ_CHECK(memcmp(cache_v_elem(c, t->mem.v[l], l, dst + k, j), blob_v_elem(c, L, l, k, j), el) == 0,
                               "%s: converted V element %u of cell %u of layer %u differs", when, j, k, l);
                }
            }
        } else if (c->v_trans) {
            const size_t el = v_elem(c);
            for (uint32_t j = 0; j < ly->n_embd_v; j++) {
                SAME_BYTES(t->mem.v[l] + ((size_t)j * size + dst) * el, L->p + L->v_off[l] + (size_t)j * L->cc * el,
                           L->cc * el, "restored V column");
            }
        } else {
            const size_t vr = ly->v_row_bytes;
            SAME_BYTES(t->mem.v[l] + dst * vr, L->p + L->v_off[l], L->cc * vr, "restored V rows");
        }
    }
}

/* The K/V bytes of the cells outside [lo, hi) are as in m (or all 0 when m is NULL). */
static void check_rows_outside(const image *m, const cache *t, uint32_t lo, uint32_t hi, const char *when) {
    const kvc_unified *c = &t->c;
    const size_t size = c->cells.size;
    for (uint32_t l = 0; l < c->n_layer && t->mem.k[l]; l++) {
        const size_t kr = c->layers[l].k_row_bytes;
        const uint8_t *mk = m ? m->mem.k[l] : NULL, *mv = m ? m->mem.v[l] : NULL;
        FUZZ_CHECK(fz_same_or_zero(t->mem.k[l], mk, lo * kr), "%s: K rows of layer %u before the run changed", when, l);
        FUZZ_CHECK(fz_same_or_zero(t->mem.k[l] + hi * kr, mk ? mk + hi * kr : NULL, (size - hi) * kr),
                   "%s: K rows of layer %u after the run changed", when, l);
        if (c->v_trans) {
            const size_t el = v_elem(c);
            for (uint32_t j = 0; j < c->layers[l].n_embd_v; j++) {
                const size_t row = (size_t)j * size * el;
                FUZZ_CHECK(fz_same_or_zero(t->mem.v[l] + row, mv ? mv + row : NULL, lo * el) &&
                           fz_same_or_zero(t->mem.v[l] + row + hi * el, mv ? mv + row + hi * el : NULL, (size - hi) * el),
                           "%s: V row %u of layer %u changed outside the run", when, j, l);
            }
        } else {
            const size_t vr = c->layers[l].v_row_bytes;
            FUZZ_CHECK(fz_same_or_zero(t->mem.v[l], mv, lo * vr) &&
                       fz_same_or_zero(t->mem.v[l] + hi * vr, mv ? mv + hi * vr : NULL, (size - hi) * vr),
                       "%s: V rows of layer %u changed outside the run", when, l);
        }
    }
}

/* Per sequence: cells outside the restored run are the old ones minus the destination. */
static void check_seq_result(const image *m, const cache *t, int32_t seq_id, const layout *L) {
    const char *when = "single-sequence read";
    const kvc_cells *cl = &t->c.cells;
    const uint64_t bit = (uint64_t)1 << seq_id;
    const uint32_t lo = L->cc ? t->c.head : 0, hi = lo + L->cc;
    FUZZ_CHECK(hi <= cl->size, "%s: run [%u, %u) past the cache", when, lo, hi);
    if (L->cc > 0) {
        SAME_VALUE(t->c.undo.n_spans, 0, "recovery entries after a committed placement");
    } else {
        SAME_VALUE(t->c.undo.n_spans, m->undo.n_spans, "recovery entries after removing the sequence");
    }
    for (uint32_t i = 0; i < cl->size; i++) {
        if (i >= lo && i < hi) {
            const int32_t p = (int32_t)kvc_le_get_u32(L->p + 4 + 12 * (size_t)(i - lo));
            FUZZ_CHECK(cl->pos[i] == p && kvc_cells_seq_word(cl, i, 0) == bit, "%s: cell %u is (%d, %llx), the part says (%d, {%d})",
                       when, i, cl->pos[i], (unsigned long long)kvc_cells_seq_word(cl, i, 0), p, seq_id);
            const uint64_t left = m->pos[i] == -1 ? 0 : m->seq[i] & ~bit;
            FUZZ_CHECK(left == 0, "%s: cell %u was overwritten while it held other sequences", when, i);
            continue;
        }
        uint64_t seq = m->seq[i];
        int32_t pos = m->pos[i];
        if (pos != -1 && (seq & bit)) {
            seq &= ~bit;
            if (seq == 0) {
                pos = -1;
            }
        }
        FUZZ_CHECK(cl->pos[i] == pos && kvc_cells_seq_word(cl, i, 0) == seq, "%s: cell %u outside the run is (%d, %llx), expected (%d, %llx)",
                   when, i, cl->pos[i], (unsigned long long)kvc_cells_seq_word(cl, i, 0), pos, (unsigned long long)seq);
        SAME_VALUE(cl->shift[i], m->shift[i], "shift of a cell outside the run");
    }
    check_rows(t, L, lo, when);
    check_rows_outside(m, t, lo, hi, when);
}

/* Whole cache: cells [0, cc) are the part's, the rest empty, shifts gone, the rest of K/V 0, no
 * undo log. */
static void check_whole_result(const image *m, const cache *t, const layout *L) {
    const char *when = "whole-cache read";
    const kvc_unified *c = &t->c;
    const kvc_cells *cl = &c->cells;
    SAME_VALUE(c->head, 0, "head");
    SAME_VALUE(c->n, m->n, "n");
    SAME_VALUE(cl->has_shift, false, "has_shift");
    /* the read replaces the cells: the undo log of an uncommitted find_slot from before is dropped */
    SAME_VALUE(c->undo.n_spans, 0, "undo spans");
    size_t off = 4;
    for (uint32_t i = 0; i < cl->size; i++) {
        SAME_VALUE(cl->shift[i], 0, "shift");
        if (i >= L->cc) {
            SAME_VALUE(cl->pos[i], -1, "position of a cell past the part's");
            continue;
        }
        const uint32_t n_ids = kvc_le_get_u32(L->p + off + 4);
        uint64_t bits = 0;
        for (uint32_t j = 0; j < n_ids; j++) {
            bits |= (uint64_t)1 << kvc_le_get_u32(L->p + off + 8 + 4 * (size_t)j);
        }
        SAME_VALUE(cl->pos[i], (int32_t)kvc_le_get_u32(L->p + off), "restored position");
        SAME_VALUE(kvc_cells_seq_word(cl, i, 0), bits, "restored sequence set");
        off += 8 + 4 * (size_t)n_ids;
    }
    check_rows(t, L, 0, when);
    check_rows_outside(NULL, t, 0, L->cc, when);
}

/* Every part's state, written one after the other (the layout of an iSWA state). */
static uint8_t *write_parts(cache *t, uint32_t n_parts, int32_t seq_id, size_t *part_len, size_t *len) {
    size_t total = 0;
    for (uint32_t k = 0; k < n_parts; k++) {
        part_len[k] = kvc_unified_state_size(&t[k].c, seq_id);
        total += part_len[k];
    }
    uint8_t *out = fz_alloc(total);
    size_t off = 0;
    for (uint32_t k = 0; k < n_parts; k++) {
        size_t written = 0;
        const int rc = kvc_unified_state_write(&t[k].c, seq_id, out + off, part_len[k], &written);
        FUZZ_CHECK(rc == KVC_OK && written == part_len[k], "state_write: rc %d, %zu of %zu bytes", rc, written,
                   part_len[k]);
        /* one byte short is refused */
        FUZZ_CHECK(kvc_unified_state_write(&t[k].c, seq_id, out + off, part_len[k] - 1, &written) == KVC_E_NOSPACE &&
                   written == 0, "state_write into %zu of %zu bytes did not refuse", part_len[k] - 1, part_len[k]);
        FUZZ_CHECK(kvc_unified_state_write(&t[k].c, seq_id, out + off, part_len[k], &written) == KVC_OK,
                   "state_write again failed");
        off += part_len[k];
    }
    *len = total;
    return out;
}

/* The state of the caches in the stream layout (the prefix, for a sequence, in front of part 0). */
static uint8_t *write_parts_lay(cache *t, uint32_t n_parts, int32_t seq_id, size_t *len) {
    const unsigned lay = KVC_LAYOUT_STREAMS | KVC_LAYOUT_PREFIX | KVC_LAYOUT_SWA_TRIM;
    size_t part_len[MAX_PARTS], total = 0;
    for (uint32_t k = 0; k < n_parts; k++) {
        part_len[k] = kvc_unified_state_size_lay(&t[k].c, seq_id, k ? lay & ~(unsigned)KVC_LAYOUT_PREFIX : lay);
        total += part_len[k];
    }
    uint8_t *out = fz_alloc(total);
    size_t off = 0;
    for (uint32_t k = 0; k < n_parts; k++) {
        size_t written = 0;
        const int rc = kvc_unified_state_write_range_lay(&t[k].c, seq_id, k ? lay & ~(unsigned)KVC_LAYOUT_PREFIX : lay,
                                                         0, out + off, part_len[k], &written);
        FUZZ_CHECK(rc == KVC_OK && written == part_len[k], "state_write_range_lay: rc %d, %zu of %zu bytes", rc,
                   written, part_len[k]);
        off += part_len[k];
    }
    *len = total;
    return out;
}

/* Cells that do not hold seq_id are as in m. */
static void check_others_kept(const image *m, const cache *t, int32_t seq_id, const char *when) {
    const kvc_cells *cl = &t->c.cells;
    const uint64_t bit = (uint64_t)1 << seq_id;
    for (uint32_t i = 0; i < cl->size; i++) {
        const bool was = m->pos[i] != -1 && (m->seq[i] & bit);
        const bool is = cl->pos[i] != -1 && (kvc_cells_seq_word(cl, i, 0) & bit);
        if (!was && !is) {
            FUZZ_CHECK(cl->pos[i] == m->pos[i] && kvc_cells_seq_word(cl, i, 0) == m->seq[i], "%s: cell %u changed", when, i);
        }
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    call k;
    if (!parse_header(data, size, &k)) {
        return 0;
    }
    const uint8_t *blob = data + HEADER;
    const size_t len = size - HEADER;
    cache t[MAX_PARTS];
    kvc_unified *cs[MAX_PARTS];
    image before[MAX_PARTS];
    for (uint32_t p = 0; p < k.n_parts; p++) {
        fc_cache_init(&t[p], &k.g[p]);
        prefill(&t[p], (uint8_t)(k.prefill ? k.prefill + 37 * p : 0));
        image_take(&before[p], &t[p]);
        cs[p] = &t[p].c;
    }

    kvc_err err = { 0, "" };
    size_t consumed = 12345;
    kvc_fail_alloc_after = k.fault;
    const unsigned detect = KVC_LAYOUT_DETECT | KVC_LAYOUT_STREAMS | KVC_LAYOUT_PREFIX;
    const int rc = k.layouts
        ? kvc_unified_state_read_parts_lay(cs, k.n_parts, k.seq_id, blob, len, k.flags, detect, &consumed, NULL, &err)
        : kvc_unified_state_read_parts_ex(cs, k.n_parts, k.seq_id, blob, len, k.flags, &consumed, &err);
    const bool fault_pending = kvc_fail_alloc_after > 0;
    kvc_fail_alloc_after = 0;
    if (fz_verbose()) {
        fprintf(stderr, "%u part(s), seq_id %d, flags %u, %zu bytes: %s\n", k.n_parts, k.seq_id, k.flags, len,
                rc == KVC_OK ? "read" : err.msg);
    }

    if (rc != KVC_OK) {
        fz_check_refused(rc, &err, k.fault, fault_pending, "state_read");
        for (uint32_t p = 0; p < k.n_parts; p++) {
            image_check(&before[p], &t[p], "after a failed read");
        }
        fp_check_describe(blob, len, 0, NULL, NULL, NULL);
        for (uint32_t p = 0; p < k.n_parts; p++) {
            image_free(&before[p]);
            fc_cache_free(&t[p]);
        }
        return 0;
    }
    if (k.layouts) {
        FUZZ_CHECK(consumed <= len, "consumed %zu of %zu bytes", consumed, len);
        image after[MAX_PARTS];
        for (uint32_t p = 0; p < k.n_parts; p++) {
            check_cells(&t[p].c.cells, "after a successful read");
            image_take(&after[p], &t[p]);
        }
        size_t w1_len, w2_len;
        uint8_t *w1 = write_parts_lay(t, k.n_parts, k.seq_id, &w1_len);
        /* read back in the layout it was written in (detection may find both layouts fit) */
        const int rc2 = kvc_unified_state_read_parts_lay(cs, k.n_parts, k.seq_id, w1, w1_len, KVC_STATE_EXACT,
                                                         detect & ~(unsigned)KVC_LAYOUT_DETECT, &consumed, NULL,
                                                         &err);
        if (rc2 != KVC_OK && k.seq_id >= 0 && strstr(err.msg, "no room: sequence") != NULL) {
            /* an empty stream section reads as a no-op, which leaves a prefilled sequence's cells
             * where they were: its own state then needs a contiguous run the cache may lack
             * (the seed's placement of a read sequence) — refused, nothing changed */
            for (uint32_t p = 0; p < k.n_parts; p++) {
                image_check(&after[p], &t[p], "after a refused re-read");
                image_free(&after[p]);
                image_free(&before[p]);
                fc_cache_free(&t[p]);
            }
            free(w1);
            return 0;
        }
        FUZZ_CHECK(rc2 == KVC_OK && consumed == w1_len, "reading the stream-layout re-write back: %d (%s)", rc2,
                   err.msg);
        uint8_t *w2 = write_parts_lay(t, k.n_parts, k.seq_id, &w2_len);
        FUZZ_CHECK(w2_len == w1_len && memcmp(w1, w2, w1_len) == 0, "second stream-layout re-write differs");
        for (uint32_t p = 0; p < k.n_parts; p++) {
            check_cells(&t[p].c.cells, "after reading the re-write");
            if (k.seq_id < 0) {
                image_check(&after[p], &t[p], "after reading the stream-layout re-write");
            } else {
                check_others_kept(&after[p], &t[p], k.seq_id, "after reading the stream-layout re-write");
            }
            image_free(&after[p]);
            image_free(&before[p]);
            fc_cache_free(&t[p]);
        }
        free(w1);
        free(w2);
        return 0;
    }

    FUZZ_CHECK(consumed <= len, "consumed %zu of %zu bytes", consumed, len);
    FUZZ_CHECK(!(k.flags & KVC_STATE_EXACT) || consumed == len, "exact read left %zu trailing bytes", len - consumed);
    layout L[MAX_PARTS];
    size_t off = 0;
    for (uint32_t p = 0; p < k.n_parts; p++) {
        check_cells(&t[p].c.cells, "after a successful read");
        L[p] = walk(&t[p].c, k.seq_id, blob + off, consumed - off, 0);
        if (k.seq_id >= 0) {
            check_seq_result(&before[p], &t[p], k.seq_id, &L[p]);
        } else {
            check_whole_result(&before[p], &t[p], &L[p]);
        }
        fp_check_describe(blob + off, len - off, 0, &t[p].c, &t[p].c.cells, k.seq_id < 0 ? &L[p] : NULL);
        off += L[p].end;
    }
    FUZZ_CHECK(off == consumed, "the parts span %zu bytes, the read consumed %zu", off, consumed);

    /* the re-write is the consumed parts, canonical */
    size_t part_len[MAX_PARTS], w1_len;
    uint8_t *w1 = write_parts(t, k.n_parts, k.seq_id, part_len, &w1_len);
    off = 0;
    for (uint32_t p = 0; p < k.n_parts; p++) {
        size_t want_len;
        uint8_t *want = canonical(&t[p].c, k.seq_id, &L[p], k.g[p].meta_only, 0, &want_len);
        FUZZ_CHECK(part_len[p] == want_len, "re-write of part %u has %zu bytes, expected %zu", p, part_len[p], want_len);
        FUZZ_CHECK(memcmp(w1 + off, want, want_len) == 0, "re-write of part %u differs at byte %ld", p,
                   fz_first_diff(w1 + off, want, want_len));
        free(want);
        off += part_len[p];
    }

    /* reading the re-write back gives the same state */
    image after[MAX_PARTS];
    for (uint32_t p = 0; p < k.n_parts; p++) {
        image_take(&after[p], &t[p]);
    }
    const int rc2 = kvc_unified_state_read_parts_ex(cs, k.n_parts, k.seq_id, w1, w1_len, KVC_STATE_EXACT, &consumed, &err);
    FUZZ_CHECK(rc2 == KVC_OK && consumed == w1_len, "reading the re-write back: %d (%s)", rc2, err.msg);
    if (k.seq_id >= 0) {
        size_t w2_len, part2[MAX_PARTS];
        uint8_t *w2 = write_parts(t, k.n_parts, k.seq_id, part2, &w2_len);
        FUZZ_CHECK(w2_len == w1_len && memcmp(w1, w2, w1_len) == 0, "second re-write differs");
        free(w2);
    }
    for (uint32_t p = 0; p < k.n_parts; p++) {
        check_cells(&t[p].c.cells, "after reading the re-write");
        if (k.seq_id < 0) {
            image_check(&after[p], &t[p], "after reading the re-write");
        } else {
            check_others_kept(&after[p], &t[p], k.seq_id, "after reading the re-write");
        }
        image_free(&after[p]);
        image_free(&before[p]);
        fc_cache_free(&t[p]);
    }
    free(w1);
    return 0;
}
