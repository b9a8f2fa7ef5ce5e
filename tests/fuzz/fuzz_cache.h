/* The unified caches of the targets that read into caches of either semantics (fuzz_state2026,
 * fuzz_handoff): a geometry decoded from header bytes, a cache with its own K/V memory (every
 * stream's), a prefill by a deterministic mix of operations, and a deep image of everything an
 * operation that fails must leave alone (every stream's cell table with each cell's extension,
 * and head, the placement, the queued stream copies, the defrag plan, every K/V byte).
 *
 * The geometry bytes (5 of them, then 6 width bytes):
 *   [0] bits 0-1 type_k (f32, f16, bf16, q8_0), bits 2-3 type_v (same list), bit 4 v_trans
 *       (ignored for a q8_0 V), bits 5-6 kept layers - 1 (1..3; 3 reads as 3), bit 7 no K/V memory
 *   [1] bits 0-2 kv_size per stream (32, 64, 96, 128, 256, 512, 1024, 2048), bits 3-4 n_seq_max - 1,
 *       bit 5 semantics 2026 (else the seed's), bit 6 a stream per sequence (2026 only),
 *       bit 7 a sliding window
 *   [2] bits 0-4 n_swa - 1, bit 5 chunked window (else standard), bit 6 the per-cell extension
 *       (2026 only), bit 7 with it, placements without token ids store FC_PLE_TOKEN (ple)
 *   [3] prefill seed (0: empty cache; bit 7: an uncommitted placement is left behind, 2025)
 *   [4] reserved for the target (flags)
 *   [5..10] K and V row widths of the layers 0..2: 1 + byte % 64 (q8_0: 32 or 64) */
#ifndef KVC_FUZZ_CACHE_H
#define KVC_FUZZ_CACHE_H

#include "fuzz_common.h"
#include "kvc_slot.h"
#include "kvc_defrag.h"
#include "kvc_types.h"
#include "kvc_unified.h"
#include "kvc_unified_ops.h"

enum { FC_GEOMETRY_BYTES = 11, FC_MAX_LAYERS = 3, FC_PLE_TOKEN = 262144 };
_Static_assert(FC_MAX_LAYERS <= FZ_MAX_LAYERS, "layers beyond the shared K/V memory");

typedef struct fc_geometry {
    int32_t type_k, type_v, semantics, swa_type;
    bool v_trans, meta_only, stream_per_seq, cell_ext, ple;
    uint32_t n_layer, kv_size, n_seq_max, n_swa;
    int32_t il[FC_MAX_LAYERS];
    uint32_t ek[FC_MAX_LAYERS], ev[FC_MAX_LAYERS];
} fc_geometry;

/* The geometry of bytes b[0, FC_GEOMETRY_BYTES); false when its K/V memory would exceed
 * max_bytes (larger geometries only slow the fuzzer down). */
static inline bool fc_geometry_parse(fc_geometry *g, const uint8_t *b, size_t max_bytes) {
    static const int32_t types[4] = { KVC_TYPE_F32, KVC_TYPE_F16, KVC_TYPE_BF16, KVC_TYPE_Q8_0 };
    static const uint32_t sizes[8] = { 32, 64, 96, 128, 256, 512, 1024, 2048 };
    memset(g, 0, sizeof *g);
    g->type_k = types[b[0] & 3];
    g->type_v = types[(b[0] >> 2) & 3];
    g->v_trans = (b[0] >> 4) & 1 && g->type_v != KVC_TYPE_Q8_0;
    g->n_layer = 1u + ((b[0] >> 5) & 3);
    g->n_layer = g->n_layer > FC_MAX_LAYERS ? FC_MAX_LAYERS : g->n_layer;
    g->meta_only = b[0] >> 7;
    g->kv_size = sizes[b[1] & 7];
    g->n_seq_max = 1u + ((b[1] >> 3) & 3);
    g->semantics = (b[1] >> 5) & 1 ? KVC_SEM_2026 : KVC_SEM_2025;
    g->stream_per_seq = g->semantics == KVC_SEM_2026 && (b[1] >> 6) & 1;
    g->cell_ext = g->semantics == KVC_SEM_2026 && (b[2] >> 6) & 1;
    g->ple = g->cell_ext && b[2] >> 7;
    if (b[1] >> 7) {
        g->swa_type = (b[2] >> 5) & 1 ? KVC_SWA_CHUNKED : KVC_SWA_STANDARD;
        g->n_swa = 1u + (b[2] & 31);
    }
    size_t row_bytes = 0;
    for (uint32_t l = 0; l < FC_MAX_LAYERS; l++) {
        g->il[l] = (int32_t)l;
        g->ek[l] = g->type_k == KVC_TYPE_Q8_0 ? 32u * (1u + b[5 + 2 * l] % 2u) : 1u + b[5 + 2 * l] % 64u;
        g->ev[l] = g->type_v == KVC_TYPE_Q8_0 ? 32u * (1u + b[6 + 2 * l] % 2u) : 1u + b[6 + 2 * l] % 64u;
        if (l < g->n_layer) {
            row_bytes += kvc_row_size(g->type_k, g->ek[l]) + kvc_row_size(g->type_v, g->ev[l]);
        }
    }
    const uint32_t n_stream = g->stream_per_seq ? g->n_seq_max : 1;
    return row_bytes * g->kv_size * n_stream <= max_bytes;
}

/* --- a cache with its own K/V memory ------------------------------------------------- */

typedef struct fc_cache {
    kvc_unified c;
    fz_kv mem;
} fc_cache;

static inline void fc_cache_init(fc_cache *t, const fc_geometry *g) {
    memset(t, 0, sizeof *t);
    const kvc_unified_params p = {
        .kv_size = g->kv_size, .semantics = g->semantics, .stream_per_seq = g->stream_per_seq,
        .n_seq_max = g->n_seq_max, .n_pad = 32, .n_swa = g->n_swa, .swa_type = g->swa_type,
        .type_k = g->type_k, .type_v = g->type_v, .v_trans = g->v_trans, .n_layer = g->n_layer,
        .layer_il = g->il, .n_embd_k = g->ek, .n_embd_v = g->ev,
        .cell_ext = g->cell_ext, .ple = g->ple, .ple_token = FC_PLE_TOKEN,
    };
    kvc_err err = { 0, "" };
    const int rc = kvc_unified_init(&t->c, &p, &err);
    FUZZ_CHECK(rc == KVC_OK, "kvc_unified_init: %s", err.msg);
    const size_t rows = (size_t)t->c.n_stream * g->kv_size;
    for (uint32_t l = 0; l < g->n_layer && !g->meta_only; l++) {
        fz_kv_layer(&t->mem, l, rows * t->c.layers[l].k_row_bytes, rows * t->c.layers[l].v_row_bytes);
        kvc_unified_set_layer_buffers(&t->c, l, t->mem.k[l], t->mem.v[l]);
    }
}

static inline void fc_cache_free(fc_cache *t) {
    kvc_unified_free(&t->c);
    fz_kv_free(&t->mem);
}

/* Place a ubatch of n tokens of sequence s (s < 0: each token's from the rng; with one stream
 * sometimes a second id per token), positions continuing next_pos; 2025: committed unless
 * `commit` is false. A cache with the per-cell extension gets 2-D positions, token ids, both or
 * neither. */
static inline void fc_place(fc_cache *t, fz_rng *g, int32_t s, uint32_t n, int32_t *next_pos, bool commit) {
    const uint32_t n_seq = t->c.n_seq_max;
    int32_t pos[64], ids[128], x[64], y[64], tok[64];
    const uint32_t ext = kvc_unified_has_ext(&t->c) ? fz_below(g, 4) : 0; /* bit 0 2-D, bit 1 tokens */
    uint32_t off[65];
    uint32_t k = 0;
    off[0] = 0;
    for (uint32_t i = 0; i < n; i++) {
        const int32_t s0 = s < 0 ? (int32_t)fz_below(g, n_seq) : s;
        ids[k++] = s0;
        if (t->c.n_stream == 1 && n_seq > 1 && fz_below(g, 4) == 0) {
            const int32_t s1 = (int32_t)fz_below(g, n_seq);
            if (s1 != s0) {
                ids[k++] = s1;
            }
        }
        off[i + 1] = k;
        pos[i] = next_pos[s0]++;
        if (ext) {
            x[i] = (int32_t)fz_below(g, 64);
            y[i] = (int32_t)fz_below(g, 64);
            tok[i] = (int32_t)fz_below(g, 1u << 20) - 1;
        }
    }
    const kvc_ubatch ub = { n, 1, n, pos, off, ids, ext & 1 ? x : NULL, ext & 1 ? y : NULL, ext & 2 ? tok : NULL };
    if (t->c.ops->semantics == KVC_SEM_2026) {
        kvc_err err = { 0, "" };
        const int r = kvc_unified_find_slot_2026(&t->c, &ub, &err);
        FUZZ_CHECK(r == 0 || r == 1, "prefill find_slot_2026 returned %d (%s)", r, err.msg);
        return;
    }
    const int r = kvc_unified_find_slot(&t->c, &ub);
    FUZZ_CHECK(r == 0 || r == 1, "prefill find_slot returned %d", r);
    if (r == 1 && commit) {
        kvc_unified_commit(&t->c);
    }
}

/* Fill the cache with a deterministic mix of operations chosen by seed (0: leave it empty),
 * then fill the K/V memory with noise. A 2026 cache may keep stream copies queued. */
static inline void fc_prefill(fc_cache *t, uint8_t seed) {
    fz_rng g;
    fz_rng_seed(&g, seed);
    kvc_unified *c = &t->c;
    const uint32_t n_seq = c->n_seq_max;
    int32_t next_pos[KVC_MAX_SEQ] = { 0 };
    const uint32_t n_ops = seed ? 1 + fz_below(&g, 24) : 0;
    const uint32_t max_ub = c->cells.size / 4 < 64 ? c->cells.size / 4 : 64;
    const bool today = c->ops->semantics == KVC_SEM_2026;
    for (uint32_t op = 0; op < n_ops; op++) {
        const int32_t s = (int32_t)fz_below(&g, n_seq);
        switch (fz_below(&g, 11)) {
        case 0: case 1: case 2: case 3: case 4:
            fc_place(t, &g, s, 1 + fz_below(&g, max_ub), next_pos, true);
            break;
        case 5: {
            const int32_t p0 = (int32_t)fz_below(&g, 64) - 8;
            kvc_unified_seq_rm(c, fz_below(&g, 4) == 0 ? -1 : s, p0, p0 + (int32_t)fz_below(&g, 48));
            break;
        }
        case 6: {
            const int32_t d = (int32_t)fz_below(&g, n_seq);
            if (!today || kvc_unified_seq_cp_check(c, s, d, -1, -1, NULL) == KVC_OK) {
                kvc_unified_seq_cp(c, s, d, -1, -1);
            }
            if (today && fz_below(&g, 2) == 0) {
                uint32_t copies = 0;
                kvc_unified_update_2026(c, &copies, false);
            }
            break;
        }
        case 7:
            /* a pending shift: the read must keep (or, on success, reproduce) it */
            kvc_unified_seq_add(c, s, 0, -1, (int32_t)fz_below(&g, 9) - 4);
            break;
        case 8:
            if (!today && kvc_unified_defrag_prepare(c, 1 + (int32_t)fz_below(&g, 64)) == 1) {
                kvc_unified_defrag_move(c);
            }
            break;
        case 9:
            if (c->swa_type != KVC_SWA_NONE && next_pos[s] > 0) {
                kvc_unified_prune_swa(c, s, next_pos[s] - 1, next_pos[s] - 1);
            }
            break;
        default:
            kvc_unified_seq_div(c, s, 0, -1, 2);
            break;
        }
    }
    if (!today && (seed & 0x80)) {
        fc_place(t, &g, (int32_t)fz_below(&g, n_seq), 1 + fz_below(&g, max_ub), next_pos, false);
    }
    fz_kv_fill(&t->mem, &g);
}

/* --- a deep copy of everything a failed operation must leave alone ------------------- */

typedef struct fc_image {
    uint32_t n_stream;
    kvc_cells cells[KVC_MAX_SEQ];
    uint32_t heads[KVC_MAX_SEQ];
    uint32_t n, slot_head, slot_n, undo_spans, undo_cells, n_copies, n_defrag_ids;
    uint32_t *copy_src, *copy_dst, *defrag_ids;
    bool do_defrag, defrag_pending;
    fz_kv mem;
} fc_image;

static inline void fc_image_take(fc_image *m, const fc_cache *t) {
    const kvc_unified *c = &t->c;
    memset(m, 0, sizeof *m);
    m->n_stream = c->n_stream;
    for (uint32_t s = 0; s < c->n_stream; s++) {
        const kvc_cells *cl = kvc_unified_stream_cells_c(c, s);
        FUZZ_CHECK(kvc_cells_snapshot(&m->cells[s], cl) == KVC_OK, "out of memory");
        m->heads[s] = kvc_unified_stream_head_c(c, s);
    }
    m->n = c->n;
    m->slot_head = c->slot.head;
    m->slot_n = c->slot.n;
    m->undo_spans = c->undo.n_spans;
    m->undo_cells = c->undo.n_cells;
    m->n_copies = c->n_copies;
    m->copy_src = (uint32_t *)fz_dup((const uint8_t *)c->copy_src, c->n_copies * sizeof *c->copy_src);
    m->copy_dst = (uint32_t *)fz_dup((const uint8_t *)c->copy_dst, c->n_copies * sizeof *c->copy_dst);
    m->n_defrag_ids = c->n_defrag_ids;
    m->defrag_ids = (uint32_t *)fz_dup((const uint8_t *)c->defrag_ids, c->n_defrag_ids * sizeof *c->defrag_ids);
    m->do_defrag = c->do_defrag;
    m->defrag_pending = c->defrag_pending;
    fz_kv_copy(&m->mem, &t->mem);
}

static inline void fc_image_free(fc_image *m) {
    for (uint32_t s = 0; s < m->n_stream; s++) {
        kvc_cells_free(&m->cells[s]);
    }
    free(m->copy_src);
    free(m->copy_dst);
    free(m->defrag_ids);
    fz_kv_free(&m->mem);
    memset(m, 0, sizeof *m);
}

#define FC_SAME_BYTES(a, b, n, what)                                                                    \
    FUZZ_CHECK((n) == 0 || memcmp((a), (b), (n)) == 0, "%s: %s differs at byte %ld", when, what,         \
               fz_first_diff((const uint8_t *)(a), (const uint8_t *)(b), (n)))
#define FC_SAME_VALUE(a, b, what) \
    FUZZ_CHECK((a) == (b), "%s: %s %lld != %lld", when, what, (long long)(a), (long long)(b))

/* Cell tables a and b are equal in every array, counter and index. */
static inline void fc_cells_same(const kvc_cells *a, const kvc_cells *b, const char *when) {
    FC_SAME_BYTES(a->pos, b->pos, a->size * sizeof *a->pos, "cell positions");
    FC_SAME_BYTES(a->shift, b->shift, a->size * sizeof *a->shift, "cell shifts");
    FC_SAME_BYTES(a->seq, b->seq, (size_t)a->seq_words * a->size * sizeof *a->seq, "cell sequence sets");
    FC_SAME_BYTES(a->used_bits, b->used_bits, a->n_words * sizeof *a->used_bits, "used bits");
    FC_SAME_VALUE(a->used, b->used, "used");
    FC_SAME_VALUE(a->used_max_p1, b->used_max_p1, "used_max_p1");
    FC_SAME_VALUE(a->has_shift, b->has_shift, "has_shift");
    FC_SAME_VALUE(a->ext != NULL, b->ext != NULL, "the extension's presence");
    if (a->ext && b->ext) {
        FC_SAME_BYTES(a->ext, b->ext, a->size * sizeof *a->ext, "cell extensions");
    }
    for (uint32_t s = 0; s < a->n_seq_max; s++) {
        FC_SAME_VALUE(a->seq_pos[s].n, b->seq_pos[s].n, "seq_pos count");
        FC_SAME_BYTES(a->seq_pos[s].key, b->seq_pos[s].key, a->seq_pos[s].n * sizeof(uint64_t), "seq_pos entries");
    }
}

/* Everything in m is what the cache holds now (memory: also every K/V byte). */
static inline void fc_image_check(const fc_image *m, const fc_cache *t, bool memory, const char *when) {
    const kvc_unified *c = &t->c;
    for (uint32_t s = 0; s < m->n_stream; s++) {
        fc_cells_same(kvc_unified_stream_cells_c(c, s), &m->cells[s], when);
        FC_SAME_VALUE(kvc_unified_stream_head_c(c, s), m->heads[s], "head");
    }
    FC_SAME_VALUE(c->n, m->n, "n");
    FC_SAME_VALUE(c->slot.head, m->slot_head, "placement head");
    FC_SAME_VALUE(c->slot.n, m->slot_n, "placement size");
    FC_SAME_VALUE(c->undo.n_spans, m->undo_spans, "undo spans");
    FC_SAME_VALUE(c->undo.n_cells, m->undo_cells, "undo cells");
    FC_SAME_VALUE(c->n_copies, m->n_copies, "queued stream copies");
    FC_SAME_BYTES(c->copy_src, m->copy_src, m->n_copies * sizeof *m->copy_src, "stream copy sources");
    FC_SAME_BYTES(c->copy_dst, m->copy_dst, m->n_copies * sizeof *m->copy_dst, "stream copy destinations");
    FC_SAME_VALUE(c->n_defrag_ids, m->n_defrag_ids, "defrag plan length");
    FC_SAME_BYTES(c->defrag_ids, m->defrag_ids, m->n_defrag_ids * sizeof *m->defrag_ids, "defrag plan");
    FC_SAME_VALUE(c->do_defrag, m->do_defrag, "do_defrag");
    FC_SAME_VALUE(c->defrag_pending, m->defrag_pending, "defrag_pending");
    if (memory) {
        fz_kv_check(&t->mem, &m->mem, when);
    }
}

/* The index structures of a cell table agree with its cells. */
static inline void fc_check_cells(const kvc_cells *cl, const char *when) {
    uint32_t used = 0, used_max_p1 = 0;
    uint32_t count[KVC_MAX_SEQ] = { 0 };
    for (uint32_t i = 0; i < cl->size; i++) {
        const bool bit = (cl->used_bits[i >> 6] >> (i & 63)) & 1;
        FUZZ_CHECK(bit == (cl->pos[i] != -1), "%s: used bit of cell %u disagrees with pos %d", when, i, cl->pos[i]);
        FUZZ_CHECK(cl->pos[i] >= -1, "%s: cell %u has position %d", when, i, cl->pos[i]);
        for (uint32_t s = 0; s < cl->n_seq_max; s++) {
            const bool has = kvc_cells_seq_has(cl, i, (int32_t)s);
            FUZZ_CHECK(!has || cl->pos[i] != -1, "%s: empty cell %u holds sequence %u", when, i, s);
            count[s] += has;
        }
        if (cl->pos[i] != -1) {
            used++;
            used_max_p1 = i + 1;
        }
    }
    FUZZ_CHECK(used == cl->used && used_max_p1 == cl->used_max_p1, "%s: used %u/%u, used_max_p1 %u/%u", when, used,
               cl->used, used_max_p1, cl->used_max_p1);
    for (uint32_t w = 0; w < cl->n_words; w++) {
        FUZZ_CHECK(((cl->free_words[w >> 6] >> (w & 63)) & 1) == (cl->used_bits[w] == 0), "%s: empty-word bit %u", when, w);
    }
    for (uint32_t s = 0; s < cl->n_seq_max; s++) {
        FUZZ_CHECK(count[s] == cl->seq_pos[s].n, "%s: sequence %u in %u cells, seq_pos has %u", when, s, count[s],
                   cl->seq_pos[s].n);
        for (uint32_t j = 0; j < cl->seq_pos[s].n; j++) {
            const uint64_t key = cl->seq_pos[s].key[j];
            const uint32_t i = kvc_seq_key_cell(key);
            FUZZ_CHECK(j == 0 || cl->seq_pos[s].key[j - 1] < key, "%s: seq_pos of %u unsorted", when, s);
            FUZZ_CHECK(i < cl->size && cl->pos[i] == kvc_seq_key_pos(key) && kvc_cells_seq_has(cl, i, (int32_t)s),
                       "%s: seq_pos of %u names cell %u, which does not hold it there", when, s, i);
        }
    }
}

static inline void fc_check_streams(const kvc_unified *c, const char *when) {
    for (uint32_t s = 0; s < c->n_stream; s++) {
        fc_check_cells(kvc_unified_stream_cells_c(c, s), when);
    }
}

#endif
