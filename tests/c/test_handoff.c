/* The hand-off of a sequence (kvc_handoff.h): regions copied with memcpy give what the state
 * codec gives; a cache changed between begin and commit (by a caller that ignored the bridge's
 * refusal) is refused at commit, unchanged; abort puts every byte back; a truncated header at
 * every length, and one sealed with too few bytes after its layers, is refused without a
 * change, and allocation failures at every point of begin leave nothing behind. Each for a cache of semantics 2025, and of 2026 with one stream and
 * with a stream per sequence, each of these with the per-cell extension too (the ubatches give
 * token ids and 2-D positions: the import's cells get the source cells' x, y and token id; a
 * change of an extension alone between begin and commit is refused); and an import into a
 * sequence that holds no cell, which is checked without a copy of the cache. */
#include "kvc_handoff.h"
#include "kvc_le.h"
#include "kvc_state.h"
#include "kvc_types.h"
#include "kvc_unified_ops.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"

#define CELLS 64u
#define W 4u

/* the caches of each test: the seed's, today's with one stream, today's with a stream per sequence */
enum mode { SEED, TODAY, STREAMS, TODAY_EXT, STREAMS_EXT, N_MODES };
static const char *const MODE_NAME[N_MODES] = { "2025", "2026", "2026 streams", "2026 ext", "2026 streams ext" };

static bool has_ext(enum mode m) { return m == TODAY_EXT || m == STREAMS_EXT; }

typedef struct cache {
    kvc_unified c;
    uint8_t *k, *v;
    size_t bytes;   /* of k and of v: every stream's */
} cache;

/* The layout of the state the import is compared with: the seed's, or today's streams. */
static unsigned layout_of(enum mode m) {
    return m == SEED ? 0u : (unsigned)KVC_LAYOUT_STREAMS | (has_ext(m) ? KVC_LAYOUT_EXT_XY | KVC_LAYOUT_EXT_TOK : 0u);
}

/* CELLS cells (per stream), 3 sequences, one f16 layer of width W, V transposed. */
static void cache_init(cache *t, uint32_t seed, enum mode m) {
    const int32_t il = 0;
    const uint32_t w = W;
    const kvc_unified_params p = {
        .kv_size = CELLS, .semantics = m == SEED ? KVC_SEM_2025 : KVC_SEM_2026,
        .stream_per_seq = m == STREAMS || m == STREAMS_EXT, .cell_ext = has_ext(m),
        .n_seq_max = 3, .n_pad = m == SEED ? 32 : 1, .n_swa = 0, .swa_type = KVC_SWA_NONE,
        .type_k = KVC_TYPE_F16, .type_v = KVC_TYPE_F16, .v_trans = true, .n_layer = 1,
        .layer_il = &il, .n_embd_k = &w, .n_embd_v = &w,
    };
    kvc_err err = { 0, "" };
    if (kvc_unified_init(&t->c, &p, &err) != KVC_OK) {
        fprintf(stderr, "kvc_unified_init: %s\n", err.msg);
        abort();
    }
    t->bytes = (size_t)t->c.n_stream * CELLS * W * 2;
    t->k = malloc(t->bytes);
    t->v = malloc(t->bytes);
    if (!t->k || !t->v) {
        abort();
    }
    for (uint32_t i = 0; i < t->bytes; i++) {
        t->k[i] = (uint8_t)(i * 7 + seed);
        t->v[i] = (uint8_t)(i * 13 + seed);
    }
    kvc_unified_set_layer_buffers(&t->c, 0, t->k, t->v);
    /* sequences 0, 1, 2 interleaved over 12 positions */
    for (int32_t p0 = 0; p0 < 12; p0++) {
        const int32_t s = (p0 + (int32_t)seed) % 3, x = p0 % 4 + 1, y = p0 / 4 + 2, tok = 500 + p0 + (int32_t)seed;
        const uint32_t off[2] = { 0, 1 };
        const bool two_d = has_ext(m) && p0 % 2, toks = has_ext(m) && p0 % 3;
        const kvc_ubatch ub = { 1, 1, 1, &p0, off, &s, two_d ? &x : NULL, two_d ? &y : NULL, toks ? &tok : NULL };
        if (m != SEED) {
            if (kvc_unified_find_slot_2026(&t->c, &ub, NULL) != 1) {
                abort();
            }
            continue;
        }
        if (kvc_unified_find_slot(&t->c, &ub) != 1) {
            abort();
        }
        kvc_unified_commit(&t->c);
    }
}

static void cache_free(cache *t) {
    kvc_unified_free(&t->c);
    free(t->k);
    free(t->v);
}

/* Everything observable: every stream's cells and head, n and the bytes. */
static bool same(const cache *a, const cache *b) {
    for (uint32_t st = 0; st < a->c.n_stream; st++) {
        const kvc_cells *x = kvc_unified_stream_cells_c(&a->c, st), *y = kvc_unified_stream_cells_c(&b->c, st);
        if (kvc_unified_stream_head_c(&a->c, st) != kvc_unified_stream_head_c(&b->c, st) || x->used != y->used ||
            memcmp(x->pos, y->pos, CELLS * sizeof(int32_t)) ||
            !kvc_cells_same_sets(x, y) || !x->ext != !y->ext ||
            (x->ext && memcmp(x->ext, y->ext, CELLS * sizeof *x->ext))) {
            return false;
        }
    }
    return a->c.n == b->c.n && !memcmp(a->k, b->k, a->bytes) && !memcmp(a->v, b->v, a->bytes);
}

/* The sender (seed 0), the receiver and a twin of the receiver to compare it with (seed 1). */
typedef struct trio {
    cache src, dst, twin;
} trio;

static void trio_init(trio *t, enum mode m) {
    cache_init(&t->src, 0, m);
    cache_init(&t->dst, 1, m);
    cache_init(&t->twin, 1, m);
}

static void trio_free(trio *t) {
    cache_free(&t->src);
    cache_free(&t->dst);
    cache_free(&t->twin);
}

static void copy_all(const kvc_handoff_export *e, const cache *src, kvc_handoff_import *imp) {
    uint8_t *buf = malloc(e->data_bytes);
    if (!buf) {
        abort();
    }
    kvc_handoff_gather(&src->c, e->stream, e->runs, e->n_runs, buf);
    kvc_handoff_scatter(imp->c, imp->stream, imp->runs, imp->n_runs, buf);
    free(buf);
}

/* Sequence 1 of src read into ref from its state (the layout of mode m), as the reference an
 * import of it is compared with. */
static void state_read_of(cache *src, cache *ref, enum mode m) {
    const unsigned lay = layout_of(m);
    size_t n = kvc_unified_state_size_lay(&src->c, 1, lay), w = 0, used = 0;
    uint8_t *blob = malloc(n);
    kvc_err err = { 0, "" };
    REQUIRE(blob && kvc_unified_state_write_range_lay(&src->c, 1, lay, 0, blob, n, &w) == KVC_OK && w == n,
            "state_write");
    kvc_unified *parts[1] = { &ref->c };
    CHECK(kvc_unified_state_read_parts_lay(parts, 1, 1, blob, n, 0, lay, &used, NULL, &err) == KVC_OK,
          "%s: state_read: %s", MODE_NAME[m], err.msg);
    free(blob);
}

static void equals_state_read(enum mode m) {
    trio t;
    trio_init(&t, m);
    cache *src = &t.src, *dst = &t.dst, *ref = &t.twin;
    kvc_err err;
    kvc_handoff_export e;
    REQUIRE(kvc_handoff_export_make(&src->c, 1, &e, &err) == KVC_OK, "export: %s", err.msg);
    CHECK(e.cell_count == 4 && e.data_bytes == 4u * W * 2 * 2, "%s: %u cells, %llu bytes", MODE_NAME[m],
          e.cell_count, (unsigned long long)e.data_bytes);
    CHECK(e.stream == (m == STREAMS || m == STREAMS_EXT ? 1u : 0u), "%s: stream %u", MODE_NAME[m], e.stream);
    CHECK(kvc_handoff_n_regions(&src->c, e.n_runs) == (uint64_t)e.n_runs * (1 + W), "regions");
    kvc_handoff_import imp;
    REQUIRE(kvc_handoff_import_begin(&dst->c, 1, e.header, e.header_len, &imp, &err) == KVC_OK, "begin: %s", err.msg);
    CHECK(dst->c.imports == 1, "an active import is counted: %u", dst->c.imports);
    copy_all(&e, src, &imp);
    uint32_t scells[CELLS], dcells[CELLS], ns = 0, nd = 0;   /* cell k of the source, of the destination */
    for (uint32_t r = 0; r < e.n_runs; r++) {
        for (uint32_t i = 0; i < e.runs[r].n; i++) {
            scells[ns++] = e.runs[r].first + i;
        }
    }
    for (uint32_t r = 0; r < imp.n_runs; r++) {
        for (uint32_t i = 0; i < imp.runs[r].n; i++) {
            dcells[nd++] = imp.runs[r].first + i;
        }
    }
    CHECK(ns == e.cell_count && nd == ns, "%s: %u and %u cells", MODE_NAME[m], ns, nd);
    CHECK(kvc_handoff_import_commit(&imp, &err) == KVC_OK, "commit: %s", err.msg);
    CHECK(dst->c.imports == 0, "a committed import is not counted: %u", dst->c.imports);
    state_read_of(src, ref, m);
    CHECK(same(dst, ref), "%s: the import differs from the state read", MODE_NAME[m]);
    if (has_ext(m)) {
        /* destination cell k has the x, y and token id of source cell k, not all defaults */
        const kvc_cells *sc = kvc_unified_stream_cells_c(&src->c, e.stream);
        const kvc_cells *dc = kvc_unified_stream_cells_c(&dst->c, e.stream);
        uint32_t k = 0, set = 0;
        for (uint32_t t = 0; t < ns; t++) {
            const kvc_cell_ext *a = &sc->ext[scells[t]], *b = &dc->ext[dcells[t]];
            k += a->x == b->x && a->y == b->y && a->tok == b->tok;
            set += a->tok != KVC_TOKEN_NULL || a->x != 0;
        }
        CHECK(k == e.cell_count && set == e.cell_count, "%s: %u of %u extensions carried, %u set", MODE_NAME[m], k,
              e.cell_count, set);
    }
    kvc_handoff_export_free(&e);
    trio_free(&t);
}

static void changed_cache_and_abort(enum mode m) {
    trio t;
    trio_init(&t, m);
    cache *src = &t.src, *dst = &t.dst, *before = &t.twin;
    kvc_err err;
    kvc_handoff_export e;
    REQUIRE(kvc_handoff_export_make(&src->c, 0, &e, &err) == KVC_OK, "export: %s", err.msg);
    kvc_handoff_import imp;
    REQUIRE(kvc_handoff_import_begin(&dst->c, 0, e.header, e.header_len, &imp, &err) == KVC_OK, "begin: %s", err.msg);
    CHECK(same(dst, before), "begin changed the cache");
    copy_all(&e, src, &imp);
    /* a change behind the bridge's back: commit refuses it and the import stays active */
    kvc_unified_seq_rm(&dst->c, 2, -1, -1);
    CHECK(kvc_handoff_import_commit(&imp, &err) == KVC_E_STATE && imp.active, "%s: commit of a changed cache",
          MODE_NAME[m]);
    CHECK(strstr(err.msg, "changed") != NULL, "message: %s", err.msg);
    CHECK(dst->c.imports == 1, "a refused commit leaves the import counted: %u", dst->c.imports);
    kvc_handoff_import_abort(&imp);
    CHECK(!imp.active, "abort leaves it active");
    CHECK(dst->c.imports == 0, "an aborted import is not counted: %u", dst->c.imports);
    if (has_ext(m)) {
        /* an extension alone changed: the commit refuses too */
        REQUIRE(kvc_handoff_import_begin(&dst->c, 0, e.header, e.header_len, &imp, &err) == KVC_OK, "begin: %s",
                err.msg);
        kvc_cells *cells = kvc_unified_stream_cells(&dst->c, 0);
        const kvc_cell_ext was = cells->ext[CELLS - 1];
        cells->ext[CELLS - 1].tok = 12345;
        CHECK(kvc_handoff_import_commit(&imp, &err) == KVC_E_STATE && imp.active, "%s: commit after an extension "
              "changed", MODE_NAME[m]);
        cells->ext[CELLS - 1] = was;
        kvc_handoff_import_abort(&imp);
    }
    kvc_handoff_import_abort(&imp);   /* a no-op now */
    CHECK(dst->c.imports == 0, "aborting twice counts once: %u", dst->c.imports);
    /* the bytes are back; the seq_rm above is the only difference left */
    kvc_unified_seq_rm(&before->c, 2, -1, -1);
    CHECK(same(dst, before), "%s: abort did not restore the bytes", MODE_NAME[m]);
    kvc_handoff_export_free(&e);
    trio_free(&t);
}

static void truncations_and_allocation_failures(enum mode m) {
    trio t;
    trio_init(&t, m);
    cache *src = &t.src, *dst = &t.dst, *before = &t.twin;
    kvc_err err;
    kvc_handoff_export e;
    REQUIRE(kvc_handoff_export_make(&src->c, 2, &e, &err) == KVC_OK, "export: %s", err.msg);
    kvc_handoff_import imp;
    for (size_t len = 0; len < e.header_len; len++) {
        const int rc = kvc_handoff_import_begin(&dst->c, 2, len ? e.header : NULL, len, &imp, &err);
        CHECK(rc == KVC_E_STATE && !imp.active, "%zu of %zu bytes: %d", len, e.header_len, rc);
    }
    /* sealed (length and checksum agreeing) with less than the run count and the checksum after
     * the layers: the room left for the runs once wrapped around, and the runs were read past
     * the header's end */
    const size_t runs_at = 40 + 28 * (size_t)dst->c.n_layer;
    for (size_t extra = 0; extra < 12; extra++) {
        const size_t n = runs_at + extra;
        uint8_t *h = malloc(n);
        REQUIRE(h != NULL, "out of memory");
        memcpy(h, e.header, n);
        kvc_le_put_u32(h + 8, (uint32_t)n);
        if (n >= 8) {
            kvc_le_put_u64(h + n - 8, kvc_handoff_checksum(h, n - 8));
        }
        const int rc = kvc_handoff_import_begin(&dst->c, 2, h, n, &imp, &err);
        CHECK(rc == KVC_E_STATE && !imp.active, "%s: sealed after the layers + %zu: %d", MODE_NAME[m], extra, rc);
        free(h);
    }
    for (int k = 1; k < 64; k++) {
        kvc_fail_alloc_after = k;
        const int rc = kvc_handoff_import_begin(&dst->c, 2, e.header, e.header_len, &imp, &err);
        kvc_fail_alloc_after = 0;
        CHECK(rc == KVC_OK || rc == KVC_E_NOMEM, "allocation %d: %d", k, rc);
        CHECK(rc == KVC_OK || !imp.active, "allocation %d: a failed begin is active", k);
        kvc_handoff_import_abort(&imp);
    }
    CHECK(same(dst, before), "%s: a failed begin changed the cache", MODE_NAME[m]);
    for (int k = 1; k < 8; k++) {   /* an export that runs out of memory leaves nothing behind */
        kvc_handoff_export x;
        kvc_fail_alloc_after = k;
        const int rc = kvc_handoff_export_make(&src->c, 2, &x, &err);
        kvc_fail_alloc_after = 0;
        CHECK(rc == KVC_OK || (rc == KVC_E_NOMEM && !x.header && !x.runs), "%s: export allocation %d: %d",
              MODE_NAME[m], k, rc);
        CHECK(rc != KVC_OK || (x.header_len == e.header_len && !memcmp(x.header, e.header, e.header_len)),
              "%s: export allocation %d: another header", MODE_NAME[m], k);
        kvc_handoff_export_free(&x);
    }
    kvc_handoff_export_free(&e);
    trio_free(&t);
}

/* A change made behind the bridge's back while an import into an empty sequence is under way. */
enum change { RM_OTHER, SHIFT_OTHER, PLACE_OTHER, ELSEWHERE, N_CHANGES };

static void change_cache(cache *t, enum mode m, enum change ch) {
    if (ch == RM_OTHER) {
        kvc_unified_seq_rm(&t->c, 2, -1, -1);
    } else if (ch == SHIFT_OTHER) {
        kvc_unified_seq_add(&t->c, 0, 0, -1, 3);
    } else {
        const int32_t p0 = 40, s = 2;
        const uint32_t off[2] = { 0, 1 };
        const kvc_ubatch ub = { 1, 1, 1, &p0, off, &s, NULL, NULL, NULL };
        REQUIRE((m == SEED ? kvc_unified_find_slot(&t->c, &ub) : kvc_unified_find_slot_2026(&t->c, &ub, NULL)) == 1,
                "placing a token");
        if (m == SEED) {
            kvc_unified_commit(&t->c);
        }
    }
}

/* An import into a sequence that holds no cell (a new request's: the prefix store's and a
 * decoding server's case), which the commit checks by the streams' change logs, not a copy of the
 * cache: begin changes nothing; the commit equals a state read of the sequence;
 * every change behind the bridge's back between begin and commit is refused, changing nothing;
 * a commit whose placement finds other cells than the dry run's changes nothing; allocation
 * failures in begin leave nothing behind. */
static void into_an_empty_sequence(enum mode m) {
    for (int ch = -1; ch < N_CHANGES; ch++) {
        trio t;
        trio_init(&t, m);
        cache *src = &t.src, *dst = &t.dst, *ref = &t.twin;
        kvc_unified_seq_rm(&dst->c, 1, -1, -1);
        kvc_unified_seq_rm(&ref->c, 1, -1, -1);
        kvc_err err;
        kvc_handoff_export e;
        REQUIRE(kvc_handoff_export_make(&src->c, 1, &e, &err) == KVC_OK, "export: %s", err.msg);
        kvc_handoff_import imp;
        REQUIRE(kvc_handoff_import_begin(&dst->c, 1, e.header, e.header_len, &imp, &err) == KVC_OK, "%s: begin: %s",
                MODE_NAME[m], err.msg);
        CHECK(same(dst, ref), "%s: begin changed the cache", MODE_NAME[m]);
        CHECK(imp.marks != NULL, "%s: an import into an empty sequence keeps a copy of the cache", MODE_NAME[m]);
        if (ch == N_CHANGES - 1) {
            /* the commit finds other cells than the dry run reserved (here: the reserved run moved
             * by one): refused as an internal error, the placement undone */
            const uint32_t first = imp.runs[0].first;
            imp.runs[0].first = (first + 1) % CELLS;
            CHECK(kvc_handoff_import_commit(&imp, &err) == KVC_E_INTERNAL && imp.active, "%s: commit elsewhere: %s",
                  MODE_NAME[m], err.msg);
            imp.runs[0].first = first;   /* (abort puts the reserved cells' bytes back) */
            kvc_handoff_import_abort(&imp);
            CHECK(same(dst, ref), "%s: a commit on other cells changed the cache", MODE_NAME[m]);
        } else if (ch >= 0) {
            change_cache(dst, m, (enum change)ch);
            change_cache(ref, m, (enum change)ch);
            CHECK(kvc_handoff_import_commit(&imp, &err) == KVC_E_STATE && imp.active && strstr(err.msg, "changed"),
                  "%s: commit after change %d: %s", MODE_NAME[m], ch, err.msg);
            kvc_handoff_import_abort(&imp);
            CHECK(same(dst, ref), "%s: a refused commit after change %d changed the cache", MODE_NAME[m], ch);
        } else {
            copy_all(&e, src, &imp);
            CHECK(kvc_handoff_import_commit(&imp, &err) == KVC_OK, "%s: commit: %s", MODE_NAME[m], err.msg);
            state_read_of(src, ref, m);
            CHECK(same(dst, ref), "%s: the import into an empty sequence differs from the state read", MODE_NAME[m]);
            for (int k = 1; k < 64; k++) {
                kvc_fail_alloc_after = k;
                const int rc = kvc_handoff_import_begin(&dst->c, 1, e.header, e.header_len, &imp, &err);
                kvc_fail_alloc_after = 0;
                CHECK(rc == KVC_OK || (rc == KVC_E_NOMEM && !imp.active), "%s: allocation %d: %d", MODE_NAME[m], k, rc);
                kvc_handoff_import_abort(&imp);
            }
            CHECK(same(dst, ref), "%s: a failed or aborted begin changed the cache", MODE_NAME[m]);
        }
        kvc_handoff_export_free(&e);
        trio_free(&t);
    }
}

int main(void) {
    for (int m = 0; m < N_MODES; m++) {
        equals_state_read((enum mode)m);
        changed_cache_and_abort((enum mode)m);
        truncations_and_allocation_failures((enum mode)m);
        into_an_empty_sequence((enum mode)m);
    }
    printf("test_handoff: %d checks, %d failed\n", n_checks, n_failed);
    return n_failed != 0;
}
