/* Tests of the unified cache's state codec (csrc/kvc_state.c): byte layout, round trips,
 * transactional failure on every truncation and corrupted field, trailing bytes, empty parts,
 * and the blobs written by llama.cpp in tests/data/interop. */
#include "kvc_state.h"
#include "kvc_types.h"
#include "kvc_unified_ops.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"

/* CHECK, then leave the test function when it failed (cond is evaluated once). */
#define REQUIRE(cond, ...)                                                 \
    do {                                                                   \
        const bool required_ok_ = (cond);                                  \
        CHECK(required_ok_, __VA_ARGS__);                                  \
        if (!required_ok_) {                                               \
            return;                                                        \
        }                                                                  \
    } while (0)

/* --- a growable byte buffer ----------------------------------------------------------- */

typedef struct buf {
    uint8_t *p;
    size_t n, cap;
} buf;

static void buf_put(buf *b, const void *src, size_t n) {
    if (b->n + n > b->cap) {
        b->cap = (b->n + n) * 2 + 64;
        b->p = realloc(b->p, b->cap);
        if (!b->p) {
            abort();
        }
    }
    memcpy(b->p + b->n, src, n);
    b->n += n;
}

static void buf_u32(buf *b, uint32_t v) {
    const uint8_t q[4] = { (uint8_t)v, (uint8_t)(v >> 8), (uint8_t)(v >> 16), (uint8_t)(v >> 24) };
    buf_put(b, q, 4);
}
static void buf_i32(buf *b, int32_t v) { buf_u32(b, (uint32_t)v); }
static void buf_u64(buf *b, uint64_t v) {
    buf_u32(b, (uint32_t)v);
    buf_u32(b, (uint32_t)(v >> 32));
}
static void buf_free(buf *b) {
    free(b->p);
    memset(b, 0, sizeof *b);
}

static void put_u32_at(uint8_t *p, uint32_t v) {
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
    p[2] = (uint8_t)(v >> 16);
    p[3] = (uint8_t)(v >> 24);
}
static uint32_t get_u32_at(const uint8_t *p) {
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

/* --- test caches with their own K/V memory ------------------------------------------- */

#define MAX_LAYERS 8

typedef struct geom {
    uint32_t size, n_seq_max, n_pad;
    int32_t type_k, type_v;
    bool v_trans;
    uint32_t n_layer;
    int32_t il[MAX_LAYERS];
    uint32_t ek[MAX_LAYERS], ev[MAX_LAYERS];
    bool meta_only; /* no K/V memory attached */
} geom;

typedef struct tc {
    geom g;
    kvc_unified c;
    uint8_t *k[MAX_LAYERS], *v[MAX_LAYERS];
} tc;

static uint64_t rng_state = 0x9e3779b97f4a7c15u;
static uint64_t rng(void) {
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return rng_state;
}

static bool tc_init(tc *t, const geom *g) {
    memset(t, 0, sizeof *t);
    t->g = *g;
    const kvc_unified_params p = {
        .kv_size = g->size, .n_seq_max = g->n_seq_max, .n_pad = g->n_pad, .n_swa = 0, .swa_type = KVC_SWA_NONE,
        .type_k = g->type_k, .type_v = g->type_v, .v_trans = g->v_trans, .n_layer = g->n_layer,
        .layer_il = g->il, .n_embd_k = g->ek, .n_embd_v = g->ev,
    };
    kvc_err err = { 0, "" };
    if (kvc_unified_init(&t->c, &p, &err) != KVC_OK) {
        fprintf(stderr, "kvc_unified_init: %s\n", err.msg);
        return false;
    }
    if (g->meta_only) {
        return true;
    }
    for (uint32_t l = 0; l < g->n_layer; l++) {
        const size_t nk = (size_t)g->size * t->c.layers[l].k_row_bytes;
        const size_t nv = (size_t)g->size * t->c.layers[l].v_row_bytes;
        t->k[l] = calloc(nk, 1);
        t->v[l] = calloc(nv, 1);
        kvc_unified_set_layer_buffers(&t->c, l, t->k[l], t->v[l]);
    }
    return true;
}

static void tc_free(tc *t) {
    for (uint32_t l = 0; l < t->g.n_layer; l++) {
        free(t->k[l]);
        free(t->v[l]);
    }
    kvc_unified_free(&t->c);
}

/* Random bytes in every K/V byte (empty cells included, so stray copies show). */
static void tc_scribble(tc *t) {
    if (t->g.meta_only) {
        return;
    }
    for (uint32_t l = 0; l < t->g.n_layer; l++) {
        const size_t nk = (size_t)t->g.size * t->c.layers[l].k_row_bytes;
        const size_t nv = (size_t)t->g.size * t->c.layers[l].v_row_bytes;
        for (size_t i = 0; i < nk; i++) {
            t->k[l][i] = (uint8_t)rng();
        }
        for (size_t i = 0; i < nv; i++) {
            t->v[l][i] = (uint8_t)rng();
        }
    }
}

/* find_slot (+ commit) of n tokens, token i at pos[i] with the sequences of mask[i]. */
static int tc_place(tc *t, uint32_t n, const int32_t *pos, const uint64_t *mask, bool commit) {
    uint32_t seq_off[65];
    int32_t seq_ids[64 * 64];
    uint32_t k = 0;
    if (n > 64) {
        abort();
    }
    for (uint32_t i = 0; i < n; i++) {
        seq_off[i] = k;
        for (int32_t s = 0; s < 64; s++) {
            if ((mask[i] >> s) & 1u) {
                seq_ids[k++] = s;
            }
        }
    }
    seq_off[n] = k;
    const kvc_ubatch ub = { n, 1, n, pos, seq_off, seq_ids, NULL, NULL, NULL };
    const int rc = kvc_unified_find_slot(&t->c, &ub);
    if (rc == 1 && commit) {
        kvc_unified_commit(&t->c);
    }
    return rc;
}

/* One token per call, for quick set-ups. */
static int tc_place1(tc *t, int32_t pos, uint64_t mask) { return tc_place(t, 1, &pos, &mask, true); }

/* Everything observable about a cache, serialized, to compare "before" and "after". */
static void tc_dump(const tc *t, buf *out) {
    const kvc_unified *c = &t->c;
    const kvc_cells *cl = &c->cells;
    out->n = 0;
    buf_put(out, cl->pos, cl->size * sizeof *cl->pos);
    buf_put(out, cl->shift, cl->size * sizeof *cl->shift);
    for (uint32_t i = 0; i < cl->size; i++) {
        const uint64_t set = kvc_cells_seq_word(cl, i, 0);
        buf_put(out, &set, sizeof set);
    }
    buf_put(out, cl->used_bits, cl->n_words * sizeof *cl->used_bits);
    buf_u32(out, cl->used);
    buf_u32(out, cl->used_max_p1);
    buf_u32(out, cl->has_shift);
    for (uint32_t s = 0; s < cl->n_seq_max; s++) {
        buf_u32(out, cl->seq_pos[s].n);
        buf_put(out, cl->seq_pos[s].key, cl->seq_pos[s].n * sizeof(uint64_t));
    }
    buf_u32(out, c->head);
    buf_u32(out, c->n);
    buf_u32(out, c->undo.n_spans);
    buf_put(out, c->undo.spans, c->undo.n_spans * sizeof *c->undo.spans);
    buf_u32(out, c->undo.n_cells);
    buf_put(out, c->undo.pos, c->undo.n_cells * sizeof *c->undo.pos);
    buf_put(out, c->undo.seq, c->undo.n_cells * sizeof *c->undo.seq);
    buf_u32(out, c->do_defrag);
    buf_u32(out, c->n_defrag_ids);
    buf_put(out, c->defrag_ids, c->n_defrag_ids * sizeof *c->defrag_ids);
    if (!t->g.meta_only) {
        for (uint32_t l = 0; l < t->g.n_layer; l++) {
            buf_put(out, t->k[l], (size_t)cl->size * c->layers[l].k_row_bytes);
            buf_put(out, t->v[l], (size_t)cl->size * c->layers[l].v_row_bytes);
        }
    }
}

static bool tc_write(tc *t, int32_t seq_id, buf *out) {
    const size_t n = kvc_unified_state_size(&t->c, seq_id);
    size_t written = 0;
    out->n = 0;
    if (out->cap < n + 1) {
        out->cap = n + 1;
        out->p = realloc(out->p, out->cap);
    }
    if (n > 0 && kvc_unified_state_write(&t->c, seq_id, out->p, n - 1, &written) != KVC_E_NOSPACE) {
        fprintf(stderr, "state_write accepted a buffer one byte short\n");
        return false;
    }
    const int rc = kvc_unified_state_write(&t->c, seq_id, out->p, n, &written);
    out->n = written;
    return rc == KVC_OK && written == n;
}

/* Check the invariants of the cell table (used count, bits, seq_pos = the true multiset). */
static void check_cells_consistent(const tc *t, const char *what) {
    const kvc_cells *cl = &t->c.cells;
    uint32_t used = 0, max_p1 = 0;
    for (uint32_t i = 0; i < cl->size; i++) {
        const bool bit = (cl->used_bits[i / 64] >> (i % 64)) & 1u;
        CHECK(bit == (cl->pos[i] != -1), "%s: used bit of cell %u", what, i);
        if (cl->pos[i] != -1) {
            used++;
            max_p1 = i + 1;
        } else {
            CHECK(kvc_cells_seq_word(cl, i, 0) == 0, "%s: empty cell %u holds sequences", what, i);
        }
    }
    CHECK(cl->used == used, "%s: used %u != %u", what, cl->used, used);
    CHECK(cl->used_max_p1 == max_p1, "%s: used_max_p1 %u != %u", what, cl->used_max_p1, max_p1);
    for (uint32_t s = 0; s < cl->n_seq_max; s++) {
        uint32_t n = 0;
        int32_t mn = -1, mx = -1;
        for (uint32_t i = 0; i < cl->size; i++) {
            if (cl->pos[i] != -1 && kvc_cells_seq_has(cl, i, (int32_t)s)) {
                n++;
                mn = (mn < 0 || cl->pos[i] < mn) ? cl->pos[i] : mn;
                mx = cl->pos[i] > mx ? cl->pos[i] : mx;
            }
        }
        CHECK(cl->seq_pos[s].n == n, "%s: seq_pos[%u].n %u != %u", what, s, cl->seq_pos[s].n, n);
        CHECK(kvc_cells_seq_pos_min(cl, (int32_t)s) == mn && kvc_cells_seq_pos_max(cl, (int32_t)s) == mx,
              "%s: seq %u min/max", what, s);
    }
}

/* Bytes of V element j of cell i. */
static const uint8_t *v_elem(const tc *t, uint32_t l, uint32_t i, uint32_t j, size_t *n) {
    const kvc_layer *ly = &t->c.layers[l];
    if (t->g.v_trans) {
        *n = kvc_type_get(t->g.type_v)->type_size;
        return t->v[l] + ((size_t)j * t->g.size + i) * *n;
    }
    *n = ly->v_row_bytes;
    return j == 0 ? t->v[l] + (size_t)i * ly->v_row_bytes : NULL;
}

/* Does dst cell di hold the data of src cell si (every layer, K and V)? */
static bool same_data(const tc *dst, uint32_t di, const tc *src, uint32_t si) {
    for (uint32_t l = 0; l < src->g.n_layer; l++) {
        const size_t kr = src->c.layers[l].k_row_bytes;
        if (memcmp(dst->k[l] + di * kr, src->k[l] + si * kr, kr) != 0) {
            return false;
        }
        const uint32_t nj = src->g.v_trans ? src->g.ev[l] : 1;
        for (uint32_t j = 0; j < nj; j++) {
            size_t n;
            const uint8_t *a = v_elem(dst, l, di, j, &n), *b = v_elem(src, l, si, j, &n);
            if (memcmp(a, b, n) != 0) {
                return false;
            }
        }
    }
    return true;
}

/* --- geometries ----------------------------------------------------------------------- */

static geom geom_small(int32_t tk, int32_t tv, bool v_trans) {
    geom g = { .size = 64, .n_seq_max = 4, .n_pad = 32, .type_k = tk, .type_v = tv, .v_trans = v_trans,
               .n_layer = 3, .il = { 0, 2, 5 }, .ek = { 8, 16, 4 }, .ev = { 4, 12, 8 } };
    return g;
}

static geom geom_quant(void) {
    geom g = { .size = 32, .n_seq_max = 3, .n_pad = 32, .type_k = KVC_TYPE_Q8_0, .type_v = KVC_TYPE_Q4_0,
               .v_trans = false, .n_layer = 2, .il = { 0, 1 }, .ek = { 32, 64 }, .ev = { 64, 32 } };
    return g;
}

/* A scattered multi-sequence population: shared cells, holes, several runs per sequence. */
static void populate(tc *t) {
    const uint32_t ns = t->g.n_seq_max;
    for (int32_t p = 0; p < 20; p++) {
        tc_place1(t, p, (uint64_t)1 << (p % (int32_t)ns) | (p % 5 == 0 ? 1u : 0u));
    }
    for (int32_t p = 0; p < 6; p++) {
        tc_place1(t, 100 + p, ((uint64_t)1 << ns) - 1); /* every sequence */
    }
    kvc_unified_seq_rm(&t->c, 1, 5, 10);
    kvc_unified_seq_rm(&t->c, 2, 14, 15);
    kvc_unified_seq_rm(&t->c, -1, 102, 103);
    for (int32_t p = 30; p < 34; p++) {
        tc_place1(t, p, 2u);
    }
    tc_scribble(t);
}

/* --- tests ---------------------------------------------------------------------------- */

/* A tiny cache and the blob written by hand from the format description. */
static void test_layout(bool v_trans) {
    geom g = { .size = 8, .n_seq_max = 3, .n_pad = 8, .type_k = KVC_TYPE_F32, .type_v = KVC_TYPE_F32,
               .v_trans = v_trans, .n_layer = 2, .il = { 0, 1 }, .ek = { 2, 1 }, .ev = { 1, 3 } };
    tc t;
    REQUIRE(tc_init(&t, &g), "init");
    const int32_t pos[5] = { 0, 1, 7, 5, 2 };
    const uint64_t mask[5] = { 1u, 5u, 2u, 2u, 1u };
    REQUIRE(tc_place(&t, 5, pos, mask, true) == 1, "place");
    kvc_unified_seq_rm(&t.c, 1, 7, 8); /* cell 2 becomes a hole */
    /* K[l][cell][e] = 100 l + 10 cell + e, V[l][cell][e] = 1000 + the same */
    for (uint32_t l = 0; l < 2; l++) {
        for (uint32_t i = 0; i < 8; i++) {
            for (uint32_t e = 0; e < g.ek[l]; e++) {
                const float f = (float)(100 * l + 10 * i + e);
                memcpy(t.k[l] + (i * g.ek[l] + e) * 4, &f, 4);
            }
            for (uint32_t e = 0; e < g.ev[l]; e++) {
                const float f = (float)(1000 + 100 * l + 10 * i + e);
                const size_t at = v_trans ? (size_t)e * 8 + i : (size_t)i * g.ev[l] + e;
                memcpy(t.v[l] + at * 4, &f, 4);
            }
        }
    }
    const uint32_t listed_all[4] = { 0, 1, 3, 4 }, listed_s0[3] = { 0, 1, 4 };
    for (int32_t seq = -1; seq < 3; seq += 1) {
        const uint32_t *cells = seq < 0 ? listed_all : listed_s0;
        uint32_t n = seq < 0 ? 4 : 3;
        if (seq == 1) {
            static const uint32_t s1[1] = { 3 };
            cells = s1;
            n = 1;
        } else if (seq == 2) {
            static const uint32_t s2[1] = { 1 };
            cells = s2;
            n = 1;
        }
        buf want = { 0 }, got = { 0 };
        buf_u32(&want, n);
        for (uint32_t k = 0; k < n; k++) {
            const uint32_t i = cells[k];
            buf_i32(&want, t.c.cells.pos[i]);
            if (seq >= 0) {
                buf_u32(&want, 1);
                buf_i32(&want, seq);
            } else {
                const uint64_t m = kvc_cells_seq_word(&t.c.cells, i, 0);
                buf_u32(&want, (uint32_t)kvc_popcount64(m));
                for (int32_t s = 0; s < 3; s++) {
                    if ((m >> s) & 1u) {
                        buf_i32(&want, s);
                    }
                }
            }
        }
        buf_u32(&want, v_trans);
        buf_u32(&want, 2);
        for (uint32_t l = 0; l < 2; l++) {
            buf_i32(&want, 0);
            buf_u64(&want, 4 * g.ek[l]);
            for (uint32_t k = 0; k < n; k++) {
                for (uint32_t e = 0; e < g.ek[l]; e++) {
                    const float f = (float)(100 * l + 10 * cells[k] + e);
                    buf_put(&want, &f, 4);
                }
            }
        }
        for (uint32_t l = 0; l < 2; l++) {
            buf_i32(&want, 0);
            if (v_trans) {
                buf_u32(&want, 4);
                buf_u32(&want, g.ev[l]);
                for (uint32_t e = 0; e < g.ev[l]; e++) {
                    for (uint32_t k = 0; k < n; k++) {
                        const float f = (float)(1000 + 100 * l + 10 * cells[k] + e);
                        buf_put(&want, &f, 4);
                    }
                }
            } else {
                buf_u64(&want, 4 * g.ev[l]);
                for (uint32_t k = 0; k < n; k++) {
                    for (uint32_t e = 0; e < g.ev[l]; e++) {
                        const float f = (float)(1000 + 100 * l + 10 * cells[k] + e);
                        buf_put(&want, &f, 4);
                    }
                }
            }
        }
        CHECK(kvc_unified_state_size(&t.c, seq) == want.n, "v_trans %d seq %d: size %zu != %zu", v_trans, seq,
              kvc_unified_state_size(&t.c, seq), want.n);
        CHECK(tc_write(&t, seq, &got), "write");
        CHECK(got.n == want.n && memcmp(got.p, want.p, want.n) == 0, "v_trans %d seq %d: layout differs", v_trans,
              seq);
        buf_free(&want);
        buf_free(&got);
    }
    /* an empty sequence: the count and every header, nothing else */
    {
        buf got = { 0 };
        kvc_unified_seq_rm(&t.c, 2, -1, -1);
        CHECK(tc_write(&t, 2, &got), "write");
        CHECK(got.n == 4 + 8 + 2 * (12 + 12), "empty part is %zu bytes", got.n);
        CHECK(get_u32_at(got.p) == 0, "cell count");
        buf_free(&got);
    }
    size_t w;
    uint8_t one[4];
    CHECK(kvc_unified_state_write(&t.c, 3, one, 4, &w) == KVC_E_ARG, "seq 3 of 3");
    CHECK(kvc_unified_state_write(&t.c, -2, one, 4, &w) == KVC_E_ARG, "seq -2");
    tc_free(&t);
}

/* Whole-cache round trip into a cache that held something else. */
static void roundtrip_whole(const geom *g) {
    tc a, b;
    REQUIRE(tc_init(&a, g), "init");
    REQUIRE(tc_init(&b, g), "init");
    populate(&a);
    tc_place1(&b, 3, 1u);
    tc_place1(&b, 4, 1u);
    tc_scribble(&b);
    const uint32_t n_before = b.c.n;
    buf blob = { 0 }, again = { 0 };
    CHECK(tc_write(&a, -1, &blob), "write");
    kvc_err err = { 0, "" };
    size_t consumed = 0;
    const int rc = kvc_unified_state_read(&b.c, -1, blob.p, blob.n, &consumed, &err);
    CHECK(rc == KVC_OK, "whole read: %d %s", rc, err.msg);
    CHECK(consumed == blob.n, "consumed %zu of %zu", consumed, blob.n);
    CHECK(b.c.head == 0, "head %u", b.c.head);
    CHECK(b.c.n == n_before, "n changed: %u -> %u", n_before, b.c.n);
    uint32_t k = 0;
    for (uint32_t i = 0; i < g->size; i++) {
        if (a.c.cells.pos[i] == -1) {
            continue;
        }
        CHECK(b.c.cells.pos[k] == a.c.cells.pos[i] && kvc_cells_seq_word(&b.c.cells, k, 0) == kvc_cells_seq_word(&a.c.cells, i, 0), "cell %u -> %u", i, k);
        CHECK(g->meta_only || same_data(&b, k, &a, i), "data of cell %u -> %u", i, k);
        k++;
    }
    CHECK(b.c.cells.used == k, "used %u != %u", b.c.cells.used, k);
    for (uint32_t i = k; i < g->size; i++) {
        CHECK(b.c.cells.pos[i] == -1, "cell %u not empty", i);
    }
    check_cells_consistent(&b, "after whole read");
    CHECK(tc_write(&b, -1, &again), "rewrite");
    CHECK(again.n == blob.n && memcmp(again.p, blob.p, blob.n) == 0, "re-written whole state differs");
    buf_free(&blob);
    buf_free(&again);
    tc_free(&a);
    tc_free(&b);
}

/* Per-sequence round trips: into the same id and into another one, into a cache with other
 * content; the cells land as one run at head. */
static void roundtrip_seq(const geom *g) {
    tc a;
    REQUIRE(tc_init(&a, g), "init");
    populate(&a);
    for (int32_t s = 0; s < (int32_t)g->n_seq_max; s++) {
        for (int32_t d = 0; d < (int32_t)g->n_seq_max; d++) {
            tc b;
            REQUIRE(tc_init(&b, g), "init");
            /* the destination holds something to be replaced, another sequence something to keep */
            tc_place1(&b, 50, (uint64_t)1 << d);
            tc_place1(&b, 51, (uint64_t)1 << ((d + 1) % (int32_t)g->n_seq_max) | (uint64_t)1 << d);
            tc_scribble(&b);
            buf blob = { 0 }, again = { 0 };
            CHECK(tc_write(&a, s, &blob), "write");
            kvc_err err = { 0, "" };
            size_t consumed = 0;
            const int rc = kvc_unified_state_read(&b.c, d, blob.p, blob.n, &consumed, &err);
            CHECK(rc == KVC_OK, "seq %d -> %d: %d %s", s, d, rc, err.msg);
            CHECK(consumed == blob.n, "consumed");
            CHECK(b.c.undo.n_spans == 0, "committed");
            const uint32_t cc = get_u32_at(blob.p);
            uint32_t k = 0;
            for (uint32_t i = 0; i < g->size && cc; i++) {
                if (a.c.cells.pos[i] == -1 || !kvc_cells_seq_has(&a.c.cells, i, s)) {
                    continue;
                }
                const uint32_t di = b.c.head + k;
                CHECK(b.c.cells.pos[di] == a.c.cells.pos[i] && kvc_cells_seq_word(&b.c.cells, di, 0) == (uint64_t)1 << d,
                      "seq %d -> %d: cell %u -> %u", s, d, i, di);
                CHECK(g->meta_only || same_data(&b, di, &a, i), "seq %d -> %d: data of cell %u -> %u", s, d, i, di);
                k++;
            }
            CHECK(k == cc, "cell count %u != %u", k, cc);
            CHECK(kvc_unified_seq_pos_min(&b.c, (d + 1) % (int32_t)g->n_seq_max) == 51, "other sequence kept");
            check_cells_consistent(&b, "after seq read");
            CHECK(tc_write(&b, d, &again), "rewrite");
            /* the same bytes but for the sequence id of each cell */
            size_t off = 4;
            for (uint32_t j = 0; j < cc; j++, off += 12) {
                put_u32_at(blob.p + off + 8, (uint32_t)d);
            }
            CHECK(again.n == blob.n && memcmp(again.p, blob.p, blob.n) == 0, "seq %d -> %d: re-written state differs",
                  s, d);
            buf_free(&blob);
            buf_free(&again);
            tc_free(&b);
        }
    }
    tc_free(&a);
}

/* Read blob[0, len) into seq_id of t and expect failure with `code`, t unchanged. */
static void expect_fail(tc *t, int32_t seq_id, const uint8_t *blob, size_t len, int code, const char *msg_has,
                        const char *what) {
    buf before = { 0 }, after = { 0 };
    tc_dump(t, &before);
    kvc_err err = { 0, "" };
    size_t consumed = 12345;
    const int rc = kvc_unified_state_read(&t->c, seq_id, blob, len, &consumed, &err);
    CHECK(rc == code, "%s: rc %d != %d (%s)", what, rc, code, err.msg);
    CHECK(rc == KVC_OK || err.code == rc, "%s: err.code %d", what, err.code);
    CHECK(rc == KVC_OK || consumed == 0, "%s: consumed %zu on failure", what, consumed);
    CHECK(!msg_has || strstr(err.msg, msg_has), "%s: message \"%s\" lacks \"%s\"", what, err.msg, msg_has);
    tc_dump(t, &after);
    CHECK(before.n == after.n && memcmp(before.p, after.p, before.n) == 0, "%s: the cache changed", what);
    buf_free(&before);
    buf_free(&after);
}

/* A target cache with uncommitted recovery, a defrag flag and content in every sequence. */
static void busy_target(tc *t) {
    tc_place1(t, 40, 1u);
    tc_place1(t, 41, 3u);
    tc_place1(t, 42, 2u);
    const int32_t p[2] = { 60, 61 };
    const uint64_t m[2] = { 1u, 1u };
    tc_place(t, 2, p, m, false); /* left uncommitted */
    t->c.do_defrag = true;
    tc_scribble(t);
}

static void test_truncations(const geom *g) {
    tc a, t;
    REQUIRE(tc_init(&a, g), "init");
    REQUIRE(tc_init(&t, g), "init");
    populate(&a);
    busy_target(&t);
    for (int32_t seq = -1; seq < 2; seq++) {
        buf blob = { 0 };
        CHECK(tc_write(&a, seq, &blob), "write");
        char what[96];
        for (size_t len = 0; len < blob.n; len++) {
            snprintf(what, sizeof what, "seq %d truncated to %zu of %zu", seq, len, blob.n);
            expect_fail(&t, seq, blob.p, len, KVC_E_STATE, "truncated at byte", what);
        }
        expect_fail(&t, seq, NULL, 0, KVC_E_STATE, "truncated at byte 0 of 0", "no data");
        buf_free(&blob);
    }
    tc_free(&a);
    tc_free(&t);
}

/* Patch a u32 at `at` of a copy of blob and expect failure. */
static void corrupt(tc *t, int32_t seq_id, const buf *blob, size_t at, uint32_t value, const char *msg_has,
                    const char *what) {
    uint8_t *copy = malloc(blob->n);
    memcpy(copy, blob->p, blob->n);
    put_u32_at(copy + at, value);
    expect_fail(t, seq_id, copy, blob->n, KVC_E_STATE, msg_has, what);
    free(copy);
}

static void test_corruptions(void) {
    /* layers of different widths; il differs from the layer's index */
    for (int vt = 0; vt < 2; vt++) {
        const geom g = geom_small(KVC_TYPE_F16, KVC_TYPE_F16, vt);
        tc a, t;
        REQUIRE(tc_init(&a, &g), "init");
        REQUIRE(tc_init(&t, &g), "init");
        populate(&a);
        busy_target(&t);
        for (int32_t seq = -1; seq < 1; seq++) {
            buf blob = { 0 };
            CHECK(tc_write(&a, seq, &blob), "write");
            const uint32_t cc = get_u32_at(blob.p);
            size_t meta = 0;
            for (uint32_t i = 0; i < cc; i++) {
                meta += 8 + 4 * (size_t)get_u32_at(blob.p + 4 + meta + 4);
            }
            const size_t d = 4 + meta; /* v_trans */
            corrupt(&t, seq, &blob, 0, g.size + 1, "not enough cells", "cell count > size");
            /* a count whose cells' records cannot fit in the bytes is no number to compare with the
             * cache: the bytes are truncated */
            corrupt(&t, seq, &blob, 0, 0xffffffffu, "the cell count (byte 0) says 4294967295 cells",
                    "cell count 2^32-1");
            corrupt(&t, seq, &blob, 0, cc + 1, NULL, "cell count + 1");
            corrupt(&t, seq, &blob, 4, (uint32_t)-1, "negative position -1", "negative position");
            corrupt(&t, seq, &blob, 4 + 12, 0x80000000u, "cell 1", "INT32_MIN position");
            if (seq >= 0) {
                corrupt(&t, seq, &blob, 8, 2, "must be 1", "n_seq_id 2");
                corrupt(&t, seq, &blob, 8 + 12, 0, "must be 1", "n_seq_id 0");
            } else {
                corrupt(&t, seq, &blob, 12, g.n_seq_max, "out of range", "seq id n_seq_max");
                corrupt(&t, seq, &blob, 12, 64, "out of range", "seq id 64");
                corrupt(&t, seq, &blob, 12, (uint32_t)-1, "out of range", "seq id -1");
                corrupt(&t, seq, &blob, 8, 1000, NULL, "n_seq_id 1000");
            }
            corrupt(&t, seq, &blob, d, !vt, "V layout", "v_trans flipped");
            corrupt(&t, seq, &blob, d + 4, g.n_layer + 1, "layer count", "n_layer + 1");
            corrupt(&t, seq, &blob, d + 4, g.n_layer - 1, "layer count", "n_layer - 1");
            const size_t k0 = d + 8;
            const size_t k1 = k0 + 12 + (size_t)cc * a.c.layers[0].k_row_bytes;
            const size_t k2 = k1 + 12 + (size_t)cc * a.c.layers[1].k_row_bytes;
            corrupt(&t, seq, &blob, k0, KVC_TYPE_F32, "layer 0 (byte", "layer 0 key type");
            corrupt(&t, seq, &blob, k1, KVC_TYPE_F32, "layer 2 (byte", "layer 1 key type");
            corrupt(&t, seq, &blob, k2, KVC_TYPE_Q8_0, "key type 8 (q8_0) != cache's 1 (f16)", "layer 2 key type");
            corrupt(&t, seq, &blob, k2, 77, "key type 77 (unknown)", "unknown key type");
            corrupt(&t, seq, &blob, k1 + 4, 33, "key row size 33", "key row size");
            /* the high word counts: the rows it makes cannot fit in the bytes */
            char rows[64];
            snprintf(rows, sizeof rows, "(%u x %llu bytes", (unsigned)cc,
                     (unsigned long long)(((uint64_t)1 << 32) + a.c.layers[1].k_row_bytes));
            corrupt(&t, seq, &blob, k1 + 8, 1, rows, "key row size high word");
            const size_t v0 = k2 + 12 + (size_t)cc * a.c.layers[2].k_row_bytes;
            corrupt(&t, seq, &blob, v0, KVC_TYPE_BF16, "value type 30 (bf16)", "layer 0 value type");
            if (vt) {
                corrupt(&t, seq, &blob, v0 + 4, 4, "value element size 4", "element size");
                corrupt(&t, seq, &blob, v0 + 8, g.ev[0] + 1, "value width", "n_embd_v");
                const size_t v1 = v0 + 12 + (size_t)g.ev[0] * cc * 2;
                corrupt(&t, seq, &blob, v1 + 8, g.ev[0], "layer 2 (byte", "layer 1 n_embd_v");
            } else {
                corrupt(&t, seq, &blob, v0 + 4, 2 * g.ev[1], "value row size", "value row size");
            }
            buf_free(&blob);
        }
        tc_free(&a);
        tc_free(&t);
    }
}

static void test_trailing_and_whole_quirks(void) {
    const geom g = geom_small(KVC_TYPE_F32, KVC_TYPE_F32, true);
    tc a, t;
    REQUIRE(tc_init(&a, &g), "init");
    REQUIRE(tc_init(&t, &g), "init");
    populate(&a);
    for (int32_t seq = -1; seq < 2; seq++) {
        buf blob = { 0 }, ref = { 0 };
        CHECK(tc_write(&a, seq, &blob), "write");
        const size_t n = blob.n;
        for (int i = 0; i < 16; i++) {
            const uint8_t x = (uint8_t)(0xA5 ^ i);
            buf_put(&blob, &x, 1);
        }
        kvc_err err = { 0, "" };
        size_t consumed = 0;
        CHECK(kvc_unified_state_read(&t.c, seq, blob.p, blob.n, &consumed, &err) == KVC_OK, "extra16: %s", err.msg);
        CHECK(consumed == n, "consumed %zu != %zu", consumed, n);
        /* a second state right after the first reads too */
        CHECK(tc_write(&t, seq, &ref), "write");
        CHECK(ref.n == n && memcmp(ref.p, blob.p, n) == 0, "state after trailing bytes");
        buf_free(&blob);
        buf_free(&ref);
    }
    /* whole cache: duplicate ids set one bit; a cell without sequences is kept (as the reference) */
    {
        tc u;
        REQUIRE(tc_init(&u, &g), "init");
        buf blob = { 0 };
        buf_u32(&blob, 2);
        buf_i32(&blob, 7);
        buf_u32(&blob, 3);
        buf_i32(&blob, 2);
        buf_i32(&blob, 2);
        buf_i32(&blob, 0);
        buf_i32(&blob, 9);
        buf_u32(&blob, 0);
        buf_u32(&blob, 1);
        buf_u32(&blob, g.n_layer);
        for (uint32_t l = 0; l < g.n_layer; l++) {
            buf_i32(&blob, 0);
            buf_u64(&blob, 4 * g.ek[l]);
            for (uint32_t i = 0; i < 2 * g.ek[l]; i++) {
                buf_u32(&blob, 0x3f800000u);
            }
        }
        for (uint32_t l = 0; l < g.n_layer; l++) {
            buf_i32(&blob, 0);
            buf_u32(&blob, 4);
            buf_u32(&blob, g.ev[l]);
            for (uint32_t i = 0; i < 2 * g.ev[l]; i++) {
                buf_u32(&blob, 0x40000000u);
            }
        }
        kvc_err err = { 0, "" };
        size_t consumed = 0;
        CHECK(kvc_unified_state_read(&u.c, -1, blob.p, blob.n, &consumed, &err) == KVC_OK, "%s", err.msg);
        CHECK(consumed == blob.n, "consumed");
        CHECK(u.c.cells.pos[0] == 7 && kvc_cells_seq_word(&u.c.cells, 0, 0) == 5u, "duplicate ids");
        CHECK(u.c.cells.pos[1] == 9 && kvc_cells_seq_word(&u.c.cells, 1, 0) == 0u && u.c.cells.used == 2, "cell without sequences");
        check_cells_consistent(&u, "quirks");
        float f;
        memcpy(&f, u.v[2] + ((size_t)3 * g.size + 1) * 4, 4);
        CHECK(f == 2.0f, "transposed V element");
        memcpy(&f, u.v[2] + ((size_t)3 * g.size + 2) * 4, 4);
        CHECK(f == 0.0f, "cleared V element");
        buf_free(&blob);
        tc_free(&u);
    }
    /* whole cache, 0 cells: the cache is cleared (buffers too), head 0, n kept */
    {
        tc e;
        REQUIRE(tc_init(&e, &g), "init");
        buf blob = { 0 };
        CHECK(tc_write(&e, -1, &blob), "write empty");
        busy_target(&t);
        const uint32_t n = t.c.n, n_spans = t.c.undo.n_spans;
        kvc_err err = { 0, "" };
        size_t consumed = 0;
        CHECK(kvc_unified_state_read(&t.c, -1, blob.p, blob.n, &consumed, &err) == KVC_OK, "%s", err.msg);
        CHECK(consumed == blob.n && t.c.cells.used == 0 && t.c.head == 0 && t.c.n == n, "cleared");
        CHECK(n_spans > 0 && t.c.undo.n_spans == 0, "the cache is replaced: its undo log goes");
        CHECK(kvc_unified_slot_n(&t.c) == 0, "nothing placed");
        bool zero = true;
        for (size_t i = 0; i < (size_t)g.size * t.c.layers[0].k_row_bytes; i++) {
            zero = zero && t.k[0][i] == 0;
        }
        CHECK(zero, "K zeroed by the clear");
        check_cells_consistent(&t, "whole empty");
        buf_free(&blob);
        tc_free(&e);
    }
    tc_free(&a);
    tc_free(&t);
}

/* Contract C1b and the no-room failure of a single-sequence read. */
static void test_seq_placement(void) {
    const geom g = geom_small(KVC_TYPE_F16, KVC_TYPE_F16, false);
    tc a, t;
    REQUIRE(tc_init(&a, &g), "init");
    REQUIRE(tc_init(&t, &g), "init");
    populate(&a);
    busy_target(&t);
    /* C1b: an empty part removes the destination and succeeds, consuming the part */
    {
        tc e;
        REQUIRE(tc_init(&e, &g), "init");
        buf blob = { 0 };
        CHECK(tc_write(&e, 3, &blob), "write");
        CHECK(blob.n == 4 + 8 + 24 * g.n_layer, "empty part %zu bytes", blob.n);
        buf_u32(&blob, 0xdeadbeefu);
        const uint32_t used = t.c.cells.used, head = t.c.head, n_spans = t.c.undo.n_spans;
        kvc_err err = { 0, "" };
        size_t consumed = 0;
        CHECK(kvc_unified_seq_pos_max(&t.c, 0) == 61, "dest present");
        CHECK(kvc_unified_state_read(&t.c, 0, blob.p, blob.n, &consumed, &err) == KVC_OK, "%s", err.msg);
        CHECK(consumed == blob.n - 4, "consumed %zu", consumed);
        CHECK(kvc_unified_seq_pos_max(&t.c, 0) == -1, "dest removed");
        CHECK(t.c.cells.used == used - 3 && t.c.undo.n_spans == n_spans, "others kept, no commit");
        CHECK(t.c.head <= head, "head");
        check_cells_consistent(&t, "C1b");
        /* a damaged header after the empty count: nothing is removed */
        busy_target(&t);
        corrupt(&t, 0, &blob, 8, g.n_layer + 1, "layer count", "C1b with a bad layer count");
        corrupt(&t, 0, &blob, 12 + 12 * g.n_layer + 24, KVC_TYPE_F32, "layer 5", "C1b with a bad value type");
        expect_fail(&t, 0, blob.p, 4 + 8 + 24 * 2 + 7, KVC_E_STATE, "truncated", "C1b truncated");
        buf_free(&blob);
        tc_free(&e);
    }
    /* no room: every other cell used; removing the destination's own cells does not help */
    {
        tc f;
        REQUIRE(tc_init(&f, &g), "init");
        for (uint32_t i = 0; i < g.size; i++) {
            tc_place1(&f, (int32_t)i, (i % 2) ? 2u : 1u); /* seq 0 in even cells, seq 1 in odd */
        }
        kvc_unified_seq_rm(&f.c, 1, 0, 20); /* 10 isolated holes */
        tc_scribble(&f);
        buf blob = { 0 };
        CHECK(tc_write(&a, 0, &blob), "write");
        CHECK(get_u32_at(blob.p) > 2, "needs a run");
        expect_fail(&f, 1, blob.p, blob.n, KVC_E_STATE, "no room", "no room");
        CHECK(kvc_unified_seq_pos_min(&f.c, 1) == 21 && kvc_unified_seq_pos_max(&f.c, 1) == 63, "destination kept");
        /* into a sequence that holds no cell (its dry run undone from the undo log): the same;
         * with every other cell free, far fewer used than the head, the failed search starts
         * from cell 0 (the seed moves its head there): the head is put back too */
        expect_fail(&f, 2, blob.p, blob.n, KVC_E_STATE, "no room", "no room in an empty sequence");
        kvc_unified_seq_rm(&f.c, 1, -1, -1);
        f.c.head = g.size - 4;   /* (where a placement at the end leaves it) */
        CHECK(get_u32_at(blob.p) < 16 && f.c.head > f.c.cells.used + 2 * get_u32_at(blob.p),
              "the search would start from 0: head %u, %u used", f.c.head, f.c.cells.used);
        expect_fail(&f, 2, blob.p, blob.n, KVC_E_STATE, "no room", "no room in an empty sequence, head moved");
        buf_free(&blob);
        tc_free(&f);
    }
    /* allocation failures at every step leave no trace */
    for (int k = 1; k < 40; k++) {
        tc u;
        REQUIRE(tc_init(&u, &g), "init");
        buf blob = { 0 }, before = { 0 }, after = { 0 };
        CHECK(tc_write(&a, 1, &blob), "write");
        busy_target(&u);
        tc_dump(&u, &before);
        kvc_err err = { 0, "" };
        size_t consumed = 0;
        kvc_fail_alloc_after = k;
        const int rc = kvc_unified_state_read(&u.c, 1, blob.p, blob.n, &consumed, &err);
        const bool hit = kvc_fail_alloc_after == 0;
        kvc_fail_alloc_after = 0;
        tc_dump(&u, &after);
        const bool done = rc == KVC_OK;
        if (done) {
            CHECK(!hit, "allocation %d failed and the read succeeded", k);
            CHECK(k > 1, "the read allocates");
        } else {
            CHECK(rc == KVC_E_NOMEM && err.code == KVC_E_NOMEM, "allocation %d: rc %d", k, rc);
            CHECK(before.n == after.n && memcmp(before.p, after.p, before.n) == 0, "allocation %d: the cache changed",
                  k);
        }
        buf_free(&blob);
        buf_free(&before);
        buf_free(&after);
        tc_free(&u);
        if (done) {
            break;
        }
        CHECK(k < 39, "the read never succeeded");
    }
    /* the head heuristic and the uncommitted recovery are the slot search's own: after the read,
     * everything is committed and the sequence sits at head */
    {
        buf blob = { 0 };
        busy_target(&t);
        CHECK(tc_write(&a, 2, &blob), "write");
        kvc_err err = { 0, "" };
        size_t consumed = 0;
        CHECK(kvc_unified_state_read(&t.c, 2, blob.p, blob.n, &consumed, &err) == KVC_OK, "%s", err.msg);
        CHECK(t.c.undo.n_spans == 0, "committed");
        CHECK(t.c.cells.pos[t.c.head] == (int32_t)get_u32_at(blob.p + 4), "first cell at head");
        check_cells_consistent(&t, "seq read");
        buf_free(&blob);
    }
    tc_free(&a);
    tc_free(&t);
}

/* --- interop blobs written by llama.cpp ----------------------------------------------- */

static char *read_file(const char *path, size_t *n) {
    FILE *f = fopen(path, "rb");
    if (!f) {
        return NULL;
    }
    fseek(f, 0, SEEK_END);
    const long len = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *p = malloc((size_t)len + 1);
    if (fread(p, 1, (size_t)len, f) != (size_t)len) {
        free(p);
        fclose(f);
        return NULL;
    }
    p[len] = 0;
    fclose(f);
    *n = (size_t)len;
    return p;
}

/* The value after "key": at or after `from` (manifests are plain JSON written by json.dump). */
static const char *jkey(const char *from, const char *key) {
    char pat[64];
    snprintf(pat, sizeof pat, "\"%s\"", key);
    const char *p = from ? strstr(from, pat) : NULL;
    if (!p) {
        return NULL;
    }
    p += strlen(pat);
    while (*p == ' ' || *p == ':' || *p == '\n') {
        p++;
    }
    return p;
}

static long jnum(const char *p) { return p ? strtol(p, NULL, 10) : -999999; }

/* The blobs ship with the tests (the Makefile runs the tests from tests/c); KVC_INTEROP_DIR
 * points at another copy. */
static const char *interop_dir(void) {
    const char *env = getenv("KVC_INTEROP_DIR");
    return env ? env : "../data/interop";
}

/* Geometry of a manifest's unified cache. */
static bool manifest_geom(const char *js, geom *g) {
    memset(g, 0, sizeof *g);
    const char *ctx = jkey(js, "context"), *geo = jkey(js, "geometry");
    if (!ctx || !geo) {
        return false;
    }
    g->n_seq_max = (uint32_t)jnum(jkey(ctx, "n_seq_max"));
    g->n_pad = (uint32_t)jnum(jkey(ctx, "n_pad"));
    g->size = (uint32_t)jnum(jkey(geo, "kv_size"));
    const char *vt = jkey(geo, "v_trans");
    g->v_trans = vt && strncmp(vt, "true", 4) == 0;
    const char *end = strstr(geo, "\"script\"");
    const char *p = jkey(geo, "layers");
    while ((p = jkey(p, "il")) != NULL && (!end || p < end)) {
        if (g->n_layer == MAX_LAYERS) {
            return false;
        }
        const uint32_t l = g->n_layer++;
        g->il[l] = (int32_t)jnum(p);
        g->ek[l] = (uint32_t)jnum(jkey(p, "n_embd_k_gqa"));
        g->ev[l] = (uint32_t)jnum(jkey(p, "n_embd_v_gqa"));
        g->type_k = (int32_t)jnum(jkey(p, "type_k"));
        g->type_v = (int32_t)jnum(jkey(p, "type_v"));
    }
    return g->n_layer > 0 && g->size > 0;
}

/* Compare the cells of t at [first, first + cc) with the manifest's expected cells. */
static void check_expected(const tc *t, const char *js, uint32_t first, const char *name) {
    const char *p = jkey(jkey(js, "expected"), "sections");
    const long cc = jnum(jkey(p, "cell_count"));
    long k = 0;
    CHECK(cc >= 0, "%s: no cell_count", name);
    while ((p = jkey(p, "cell")) != NULL) {
        const int32_t pos = (int32_t)jnum(jkey(p, "pos"));
        const char *ids = jkey(p, "seq_ids");
        uint64_t want = 0;
        for (const char *q = ids + 1; q && *q != ']';) {
            char *e;
            const long s = strtol(q, &e, 10);
            if (e == q) {
                q++;
                continue;
            }
            want |= (uint64_t)1 << s;
            q = e;
        }
        const uint32_t i = first + (uint32_t)k;
        CHECK(i < t->g.size && t->c.cells.pos[i] == pos && kvc_cells_seq_word(&t->c.cells, i, 0) == want,
              "%s: cell %u: pos %d seq %llx, expected pos %d seq %llx", name, i, t->c.cells.pos[i],
              (unsigned long long)kvc_cells_seq_word(&t->c.cells, i, 0), pos, (unsigned long long)want);
        k++;
        p = ids;
    }
    CHECK(k == cc, "%s: %ld expected cells listed, cell_count %ld", name, k, cc);
    CHECK(t->c.cells.used == (uint32_t)cc, "%s: used %u", name, t->c.cells.used);
}

/* Offset of the cache state in a whole-context blob: arch, outputs, logits, embeddings. */
static size_t context_prefix(const uint8_t *p, size_t n) {
    size_t off = 0;
    if (n < 4) {
        return 0;
    }
    off = 4 + get_u32_at(p);
    if (off + 4 > n) {
        return 0;
    }
    off += 4 + 4 * (size_t)get_u32_at(p + off);
    for (int i = 0; i < 2; i++) {
        if (off + 8 > n) {
            return 0;
        }
        const uint64_t cnt = get_u32_at(p + off) | (uint64_t)get_u32_at(p + off + 4) << 32;
        off += 8 + 4 * cnt;
    }
    return off <= n ? off : 0;
}

static void test_interop_blob(const char *dir, const char *folder, const char *file) {
    char path[512], name[128];
    size_t n_blob = 0, n_js = 0;
    snprintf(name, sizeof name, "%s/%s", folder, file);
    snprintf(path, sizeof path, "%s/%s/%s", dir, folder, file);
    uint8_t *blob = (uint8_t *)read_file(path, &n_blob);
    snprintf(path, sizeof path, "%s/%s/%s.json", dir, folder, file);
    char *js = read_file(path, &n_js);
    if (!blob || !js) {
        CHECK(false, "%s: cannot read the blob or its manifest", name);
        free(blob);
        free(js);
        return;
    }
    geom g;
    tc t;
    if (!manifest_geom(js, &g) || !tc_init(&t, &g)) {
        CHECK(false, "%s: geometry", name);
        free(blob);
        free(js);
        return;
    }
    const int32_t seq_id = (int32_t)jnum(jkey(jkey(js, "api"), "seq_id"));
    const size_t off = seq_id < 0 ? context_prefix(blob, n_blob) : 0;
    if (strcmp(folder, "llama_fa0") == 0 && seq_id < 0) {
        CHECK(off == 1233, "%s: cache state at byte %zu", name, off);
    }
    kvc_err err = { 0, "" };
    size_t consumed = 0;
    const int rc = kvc_unified_state_read(&t.c, seq_id, blob + off, n_blob - off, &consumed, &err);
    CHECK(rc == KVC_OK, "%s: read: %d %s", name, rc, err.msg);
    CHECK(consumed == n_blob - off, "%s: consumed %zu of %zu", name, consumed, n_blob - off);
    if (rc == KVC_OK) {
        check_expected(&t, js, seq_id < 0 ? 0 : t.c.head, name);
        check_cells_consistent(&t, name);
        buf again = { 0 };
        CHECK(tc_write(&t, seq_id, &again), "%s: write", name);
        CHECK(again.n == n_blob - off && memcmp(again.p, blob + off, again.n) == 0, "%s: re-written bytes differ",
              name);
        buf_free(&again);
    }
    tc_free(&t);
    free(blob);
    free(js);
}

static void test_interop(void) {
    const char *dir = interop_dir();
    char readme[512];
    snprintf(readme, sizeof readme, "%s/README.md", dir);
    FILE *f = fopen(readme, "rb");
    REQUIRE(f != NULL, "the llama.cpp blobs are missing: no %s", readme);
    fclose(f);
    static const char *folders[] = { "llama_fa0", "llama_fa1", "llama_q8_fa1", "llama_bf16_fa1" };
    static const char *files[] = { "seq0.bin", "seq1.bin", "seq2.bin", "seq3.bin", "state.bin" };
    for (size_t f = 0; f < sizeof folders / sizeof folders[0]; f++) {
        for (size_t i = 0; i < sizeof files / sizeof files[0]; i++) {
            test_interop_blob(dir, folders[f], files[i]);
        }
    }
}

/* --- streaming, layout conversion, exact reads, describing ------------------------------ */

/* Every window of the blob, in chunks of several sizes, equals the whole write. */
static void test_write_range(const geom *g) {
    tc a;
    REQUIRE(tc_init(&a, g), "init");
    populate(&a);
    for (int32_t seq = -1; seq < (int32_t)g->n_seq_max; seq++) {
        buf whole = { 0 };
        CHECK(tc_write(&a, seq, &whole), "write");
        static const size_t chunks[] = { 1, 3, 7, 64, 1000, 1u << 20 };
        for (size_t k = 0; k < sizeof chunks / sizeof chunks[0]; k++) {
            uint8_t *got = malloc(whole.n + 1);
            uint8_t *piece = malloc(chunks[k]);
            size_t at = 0, w = 0;
            int rc = KVC_OK;
            do {
                rc = kvc_unified_state_write_range(&a.c, seq, at, piece, chunks[k], &w);
                if (rc != KVC_OK || at + w > whole.n) {
                    break;
                }
                memcpy(got + at, piece, w);
                at += w;
            } while (w == chunks[k]);
            CHECK(rc == KVC_OK && at == whole.n && memcmp(got, whole.p, whole.n) == 0,
                  "seq %d chunk %zu: streamed %zu of %zu bytes differ", seq, chunks[k], at, whole.n);
            free(got);
            free(piece);
        }
        size_t w = 1;
        uint8_t one;
        CHECK(kvc_unified_state_write_range(&a.c, seq, whole.n + 5, &one, 1, &w) == KVC_OK && w == 0,
              "past the end writes nothing");
        buf_free(&whole);
    }
    size_t w;
    uint8_t one;
    CHECK(kvc_unified_state_write_range(&a.c, (int32_t)g->n_seq_max, 0, &one, 1, &w) == KVC_E_ARG, "bad seq id");
    tc_free(&a);
}

/* A threaded state write's shares: whole pages, at most `width` of them, covering the window,
 * for every width and windows around the sizes where rounding n / width down first fell short
 * (n / width a whole number of pages with a remainder: width + 1 shares, past the array). */
static void test_share_bytes(void) {
    static const size_t pages[] = { 1, 2, 4096, 4097, 65536 };
    for (unsigned width = 1; width <= KVC_MAX_THREADS; width++) {
        for (size_t i = 0; i < sizeof pages / sizeof pages[0]; i++) {
            const size_t base = pages[i] * 4096 * width;
            const size_t ns[] = { base - 1, base, base + 1, base + width - 1, base + width, base + 4095,
                                  base + (size_t)check_rand(1u << 20) };
            for (size_t j = 0; j < sizeof ns / sizeof ns[0]; j++) {
                const size_t n = ns[j];
                const size_t per = kvc_state_share_bytes(n, width);
                const size_t shares = n / per + (n % per != 0);
                CHECK(per % 4096 == 0 && per > 0 && shares <= width,
                      "n %zu width %u: shares of %zu bytes, %zu of them", n, width, per, shares);
            }
        }
    }
    CHECK(kvc_state_share_bytes((size_t)64 * (16u << 20) + 40, 64) == (16u << 20) + 4096,
          "64 threads, 1 GiB + 40 bytes: each share a page more than 16 MiB");
}

/* V transposed -> rows -> transposed with the convert flag: the data follows and the final
 * blob is the original's; without the flag the read is refused and nothing changes. */
static void test_convert(int32_t type_v) {
    const geom gt = geom_small(KVC_TYPE_F16, type_v, true);
    geom gr = gt;
    gr.v_trans = false;
    tc a, b, c2;
    REQUIRE(tc_init(&a, &gt) && tc_init(&b, &gr) && tc_init(&c2, &gt), "init");
    populate(&a);
    busy_target(&b);
    for (int32_t seq = -1; seq < 2; seq++) {
        buf blob = { 0 }, back = { 0 }, again = { 0 };
        CHECK(tc_write(&a, seq, &blob), "write");
        expect_fail(&b, seq, blob.p, blob.n, KVC_E_STATE, "conversion not requested", "transposed into rows");
        kvc_err err = { 0, "" };
        size_t consumed = 0;
        int rc = kvc_unified_state_read_ex(&b.c, seq, blob.p, blob.n, KVC_STATE_CONVERT_V, &consumed, &err);
        CHECK(rc == KVC_OK && consumed == blob.n, "seq %d convert into rows: %d %s", seq, rc, err.msg);
        check_cells_consistent(&b, "converted into rows");
        /* every restored cell holds the source cell's values, element by element */
        const int32_t dseq = seq < 0 ? -1 : seq;
        for (uint32_t i = 0; i < gt.size; i++) {
            if (b.c.cells.pos[i] < 0 || (dseq >= 0 && !kvc_cells_seq_has(&b.c.cells, i, dseq))) {
                continue;
            }
            uint32_t si = gt.size;
            for (uint32_t k = 0; k < gt.size && si == gt.size; k++) {
                if (a.c.cells.pos[k] == b.c.cells.pos[i] &&
                    (dseq < 0 ? kvc_cells_seq_word(&a.c.cells, k, 0) == kvc_cells_seq_word(&b.c.cells, i, 0) : kvc_cells_seq_has(&a.c.cells, k, dseq))) {
                    si = k;
                }
            }
            REQUIRE(si < gt.size, "cell %u has no source", i);
            const size_t el = kvc_type_get(type_v)->type_size;
            for (uint32_t l = 0; l < gt.n_layer; l++) {
                for (uint32_t j = 0; j < gt.ev[l]; j++) {
                    const uint8_t *x = a.v[l] + ((size_t)j * gt.size + si) * el;
                    const uint8_t *y = b.v[l] + (size_t)i * b.c.layers[l].v_row_bytes + (size_t)j * el;
                    CHECK(memcmp(x, y, el) == 0, "seq %d layer %u cell %u element %u", seq, l, i, j);
                }
            }
        }
        /* and back: the rows blob into a transposed cache gives the original blob again */
        CHECK(tc_write(&b, seq, &back), "write rows");
        kvc_unified_clear(&c2.c);
        rc = kvc_unified_state_read_ex(&c2.c, seq, back.p, back.n, KVC_STATE_CONVERT_V, &consumed, &err);
        CHECK(rc == KVC_OK && consumed == back.n, "seq %d convert into transposed: %d %s", seq, rc, err.msg);
        CHECK(tc_write(&c2, seq, &again), "write again");
        if (seq < 0) {
            CHECK(again.n == blob.n && memcmp(again.p, blob.p, blob.n) == 0, "whole round trip differs");
        } else {
            CHECK(again.n == blob.n, "seq %d: %zu != %zu bytes", seq, again.n, blob.n);
        }
        buf_free(&blob);
        buf_free(&back);
        buf_free(&again);
    }
    tc_free(&a);
    tc_free(&b);
    tc_free(&c2);

    /* a quantized V cannot be held transposed: a transposed blob is refused even with the flag */
    geom gq = geom_quant();
    geom gf = gq;
    gf.type_v = KVC_TYPE_F16;
    gf.type_k = KVC_TYPE_Q8_0;
    gf.v_trans = true;
    tc q, f;
    REQUIRE(tc_init(&q, &gq) && tc_init(&f, &gf), "init");
    populate(&f);
    buf blob = { 0 };
    CHECK(tc_write(&f, -1, &blob), "write");
    /* make the blob's V type the cache's q4_0 so that the element check is what refuses it */
    uint32_t cc = get_u32_at(blob.p);
    size_t off = 4;
    for (uint32_t i = 0; i < cc; i++) {
        off += 8 + 4 * (size_t)get_u32_at(blob.p + off + 4);
    }
    off += 8;
    for (uint32_t l = 0; l < gf.n_layer; l++) {
        off += 12 + (size_t)cc * f.c.layers[l].k_row_bytes;
    }
    put_u32_at(blob.p + off, KVC_TYPE_Q4_0);
    kvc_err err = { 0, "" };
    size_t consumed = 0;
    CHECK(kvc_unified_state_read_ex(&q.c, -1, blob.p, blob.n, KVC_STATE_CONVERT_V, &consumed, &err) == KVC_E_STATE &&
              strstr(err.msg, "cannot be transposed"),
          "quantized transposed V: %s", err.msg);
    buf_free(&blob);
    tc_free(&q);
    tc_free(&f);
}

static void test_exact(void) {
    const geom g = geom_small(KVC_TYPE_F16, KVC_TYPE_F16, true);
    tc a, t;
    REQUIRE(tc_init(&a, &g) && tc_init(&t, &g), "init");
    populate(&a);
    busy_target(&t);
    buf blob = { 0 };
    CHECK(tc_write(&a, 1, &blob), "write");
    const uint8_t zero = 0;
    buf_put(&blob, &zero, 1);
    buf before = { 0 }, after = { 0 };
    tc_dump(&t, &before);
    kvc_err err = { 0, "" };
    size_t consumed = 0;
    CHECK(kvc_unified_state_read_ex(&t.c, 1, blob.p, blob.n, KVC_STATE_EXACT, &consumed, &err) == KVC_E_STATE &&
              strstr(err.msg, "1 trailing bytes after the state"),
          "exact: %s", err.msg);
    tc_dump(&t, &after);
    CHECK(before.n == after.n && memcmp(before.p, after.p, before.n) == 0, "exact failure changed the cache");
    CHECK(kvc_unified_state_read_ex(&t.c, 1, blob.p, blob.n - 1, KVC_STATE_EXACT, &consumed, &err) == KVC_OK &&
              consumed == blob.n - 1,
          "exact read of the exact blob: %s", err.msg);
    buf_free(&before);
    buf_free(&after);
    buf_free(&blob);
    tc_free(&a);
    tc_free(&t);
}

static void test_describe(void) {
    for (int vt = 0; vt < 2; vt++) {
        const geom g = geom_small(KVC_TYPE_F16, KVC_TYPE_F16, vt);
        tc a;
        REQUIRE(tc_init(&a, &g), "init");
        populate(&a);
        for (int32_t seq = -1; seq < 2; seq++) {
            buf blob = { 0 };
            CHECK(tc_write(&a, seq, &blob), "write");
            kvc_state_desc d;
            int32_t pos[64];
            uint64_t seqs[64 * KVC_SEQ_WORDS];   /* a cell's set in KVC_SEQ_WORDS words */
            kvc_state_layer_desc ld[4];
            kvc_err err = { 0, "" };
            int rc = kvc_state_describe(blob.p, blob.n, &d, pos, seqs, 64, ld, 4, &err);
            CHECK(rc == KVC_OK, "describe: %s", err.msg);
            CHECK(d.end == blob.n && d.v_trans == (uint32_t)vt && d.n_layer == g.n_layer, "header");
            uint32_t k = 0;
            for (uint32_t i = 0; i < g.size; i++) {
                const kvc_cells *cl = &a.c.cells;
                if (cl->pos[i] < 0 || (seq >= 0 && !kvc_cells_seq_has(cl, i, seq))) {
                    continue;
                }
                CHECK(k < d.cell_count && pos[k] == cl->pos[i], "cell %u position", i);
                CHECK(seqs[KVC_SEQ_WORDS * k] == (seq < 0 ? kvc_cells_seq_word(cl, i, 0) : (uint64_t)1 << seq) &&
                      !seqs[KVC_SEQ_WORDS * k + 1] && !seqs[KVC_SEQ_WORDS * k + 2] && !seqs[KVC_SEQ_WORDS * k + 3],
                      "cell %u ids", i);
                k++;
            }
            CHECK(k == d.cell_count, "cell count %u != %u", d.cell_count, k);
            for (uint32_t l = 0; l < g.n_layer; l++) {
                CHECK(ld[l].k_type == g.type_k && ld[l].k_row_size == a.c.layers[l].k_row_bytes, "layer %u K", l);
                CHECK(vt ? ld[l].v_width == g.ev[l] && ld[l].v_elem_size == 2
                         : ld[l].v_row_size == a.c.layers[l].v_row_bytes,
                      "layer %u V", l);
            }
            /* without arrays, and truncated anywhere */
            CHECK(kvc_state_describe(blob.p, blob.n + 0, &d, NULL, NULL, 0, NULL, 0, &err) == KVC_OK, "no arrays");
            for (size_t len = 0; len < blob.n; len++) {
                rc = kvc_state_describe(blob.p, len, &d, pos, seqs, 64, ld, 4, &err);
                CHECK(rc == KVC_E_STATE && strstr(err.msg, "truncated at byte"), "describe truncated to %zu: %s",
                      len, err.msg);
            }
            buf_free(&blob);
        }
        tc_free(&a);
    }
    /* a huge cell count in a short blob is refused before anything is allocated or read */
    uint8_t tiny[8] = { 0xff, 0xff, 0xff, 0xff, 0, 0, 0, 0 };
    kvc_state_desc d;
    kvc_err err = { 0, "" };
    CHECK(kvc_state_describe(tiny, sizeof tiny, &d, NULL, NULL, 0, NULL, 0, &err) == KVC_E_STATE &&
              strstr(err.msg, "the cell count (byte 0) says 4294967295 cells, which need at least"),
          "huge count: %s", err.msg);
}

int main(void) {
    test_layout(false);
    test_layout(true);

    geom gs[6];
    gs[0] = geom_small(KVC_TYPE_F32, KVC_TYPE_F32, false);
    gs[1] = geom_small(KVC_TYPE_F32, KVC_TYPE_F32, true);
    gs[2] = geom_small(KVC_TYPE_F16, KVC_TYPE_F16, true);
    gs[3] = geom_small(KVC_TYPE_F16, KVC_TYPE_BF16, false);
    gs[4] = geom_quant();
    gs[5] = geom_small(KVC_TYPE_F16, KVC_TYPE_F16, true);
    gs[5].meta_only = true;
    for (size_t i = 0; i < sizeof gs / sizeof gs[0]; i++) {
        roundtrip_whole(&gs[i]);
        roundtrip_seq(&gs[i]);
    }
    test_truncations(&gs[0]);
    test_truncations(&gs[2]);
    test_truncations(&gs[5]);
    test_corruptions();
    test_trailing_and_whole_quirks();
    test_seq_placement();
    test_interop();
    test_write_range(&gs[0]);
    test_write_range(&gs[2]);
    test_write_range(&gs[4]);
    test_write_range(&gs[5]);
    test_share_bytes();
    test_convert(KVC_TYPE_F16);
    test_convert(KVC_TYPE_F32);
    test_exact();
    test_describe();

    printf("test_state: %d checks, %d failed\n", n_checks, n_failed);
    return n_failed ? 1 : 0;
}
