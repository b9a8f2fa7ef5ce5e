/* Tests of the state of a cache of semantics 2026 (csrc/kvc_state.c) under the sanitizers: a
 * section per stream; a whole-cache state of a fragmented cache restored into a fresh one puts
 * cell k of section s into cell k of stream s (heads 0) with its rows and writes back the same
 * bytes; a sequence's state restored into a fragmented cache lands in scattered cells of the
 * sequence's stream with its rows (V transposed per stream or not) and writes back the same
 * bytes; a read that finds no room, or a blob cut short, changes no cell, head or K/V byte; a
 * state of the other V layout is refused, or converted on request (whole, and a sequence into
 * scattered cells), each cell's rows where the read puts the cell. */
#include "kvc_state.h"
#include "kvc_types.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "fixture.h"

#define SIZE 64
#define N_STREAM 3
#define WIDTH 3

typedef struct fixture {
    kvc_unified c;
    float k[N_STREAM * SIZE * WIDTH], v[N_STREAM * SIZE * WIDTH];
} fixture;

static int fixture_init(fixture *f, bool per_seq, bool v_trans) {
    const int32_t il[1] = { 0 };
    const uint32_t w[1] = { WIDTH };
    const kvc_unified_params p = {
        .kv_size = SIZE, .semantics = KVC_SEM_2026, .stream_per_seq = per_seq, .n_seq_max = N_STREAM, .n_pad = 1,
        .n_swa = 0, .swa_type = KVC_SWA_NONE, .type_k = KVC_TYPE_F32, .type_v = KVC_TYPE_F32, .v_trans = v_trans,
        .n_layer = 1, .layer_il = il, .n_embd_k = w, .n_embd_v = w,
    };
    return fixture_attach(&f->c, &p, f->k, sizeof f->k, f->v, sizeof f->v);
}

/* Place n tokens of sequence s from position p0 and store rows whose values name (s, pos, e). */
static void put(fixture *f, int32_t s, int32_t p0, uint32_t n) {
    int32_t pos[SIZE], ids[SIZE];
    uint32_t off[SIZE + 1];
    float rows[SIZE * WIDTH];
    for (uint32_t t = 0; t < n; t++) {
        pos[t] = p0 + (int32_t)t;
        ids[t] = s;
        off[t] = t;
        for (uint32_t e = 0; e < WIDTH; e++) {
            rows[t * WIDTH + e] = (float)(1000 * s + 10 * pos[t] + (int32_t)e);
        }
    }
    off[n] = n;
    const kvc_ubatch ub = { .n_tokens = n, .n_seq_tokens = 1, .n_seqs = n, .pos = pos, .seq_off = off, .seq_ids = ids };
    REQUIRE(kvc_unified_find_slot_2026(&f->c, &ub, NULL) == 1, "placing %u tokens of seq %d", n, s);
    REQUIRE(kvc_unified_store(&f->c, 0, n, rows, rows) == KVC_OK, "store");
}

/* A fragmented cache: every sequence with holes in its stream. */
static void fill(fixture *f) {
    for (int32_t s = 0; s < N_STREAM; s++) {
        put(f, s, 0, 12 + (uint32_t)s);
        kvc_unified_seq_rm(&f->c, s, 3, 6);
        put(f, s, 20, 5);
    }
}

static uint8_t *write_state(fixture *f, int32_t seq_id, size_t *n) {
    *n = kvc_unified_state_size_lay(&f->c, seq_id, KVC_LAYOUT_STREAMS);
    uint8_t *b = malloc(*n);
    size_t w = 0;
    if (!b || kvc_unified_state_write_range_lay(&f->c, seq_id, KVC_LAYOUT_STREAMS, 0, b, *n, &w) != KVC_OK ||
        w != *n) {
        fprintf(stderr, "state_write of seq %d failed\n", seq_id);
        abort();
    }
    return b;
}

static int read_state_flags(fixture *f, int32_t seq_id, const uint8_t *b, size_t n, unsigned flags) {
    kvc_unified *cs[1] = { &f->c };
    size_t used = 0;
    kvc_err err = { 0, "" };
    return kvc_unified_state_read_parts_lay(cs, 1, seq_id, b, n, flags, KVC_LAYOUT_STREAMS, &used, NULL, &err);
}

static int read_state(fixture *f, int32_t seq_id, const uint8_t *b, size_t n) {
    return read_state_flags(f, seq_id, b, n, 0);
}

/* The cells and heads of every stream, to compare before and after. */
typedef struct snapshot {
    int32_t  pos[N_STREAM][SIZE];
    uint64_t seq[N_STREAM][SIZE * 4];
    uint32_t head[N_STREAM];
} snapshot;

static void take(const kvc_unified *c, snapshot *s) {
    memset(s, 0, sizeof *s);
    for (uint32_t st = 0; st < c->n_stream; st++) {
        const kvc_cells *t = kvc_unified_stream_cells_c(c, st);
        memcpy(s->pos[st], t->pos, SIZE * sizeof *t->pos);
        for (uint32_t w = 0; w < t->seq_words; w++) {
            for (uint32_t i = 0; i < SIZE; i++) {
                s->seq[st][(size_t)w * SIZE + i] = kvc_cells_seq_word(t, i, w);
            }
        }
        s->head[st] = kvc_unified_stream_head_c(c, st);
    }
}

/* The rows of cell i of stream st hold what put() stored for its (seq, pos). */
static bool rows_of(const fixture *f, uint32_t st, uint32_t i, int32_t s) {
    const int32_t p = kvc_unified_stream_cells_c(&f->c, st)->pos[i];
    for (uint32_t e = 0; e < WIDTH; e++) {
        const float want = (float)(1000 * s + 10 * p + (int32_t)e);
        const float v = f->c.v_trans ? f->v[((size_t)st * WIDTH + e) * SIZE + i]
                                     : f->v[((size_t)st * SIZE + i) * WIDTH + e];
        if (f->k[((size_t)st * SIZE + i) * WIDTH + e] != want || v != want) {
            return false;
        }
    }
    return true;
}

static void test_round_trips(bool per_seq, bool v_trans) {
    fixture *a = calloc(1, sizeof *a), *b = calloc(1, sizeof *b);
    REQUIRE(a && b && fixture_init(a, per_seq, v_trans) == KVC_OK && fixture_init(b, per_seq, v_trans) == KVC_OK,
            "init");
    fill(a);
    size_t n;
    uint8_t *whole = write_state(a, -1, &n);
    CHECK(read_state(b, -1, whole, n) == KVC_OK, "whole read");
    size_t nb;
    uint8_t *again = write_state(b, -1, &nb);
    CHECK(nb == n && memcmp(again, whole, n) == 0, "whole: writes back the same bytes");
    free(again);
    for (uint32_t st = 0; st < b->c.n_stream; st++) {     /* cell k of section s into cell k, heads 0 */
        const kvc_cells *t = kvc_unified_stream_cells_c(&b->c, st);
        CHECK(kvc_unified_stream_head_c(&b->c, st) == 0, "head of stream %u", st);
        CHECK(t->used == kvc_unified_stream_cells_c(&a->c, st)->used, "used of stream %u", st);
        for (uint32_t i = 0; i < t->used; i++) {
            const int32_t q = kvc_cells_seq_next(t, i, -1);
            CHECK(t->pos[i] >= 0 && rows_of(b, st, i, q), "stream %u cell %u", st, i);
        }
    }
    free(whole);

    /* sequence 1 into a fresh fragmented cache: scattered cells of its stream, its rows */
    kvc_unified_free(&b->c);
    REQUIRE(fixture_init(b, per_seq, v_trans) == KVC_OK, "init");
    put(b, 1, 100, 4);
    put(b, 2, 100, 4);
    kvc_unified_seq_rm(&b->c, 1, -1, -1);             /* holes where seq 1 was */
    uint8_t *one = write_state(a, 1, &n);
    CHECK(read_state(b, 1, one, n) == KVC_OK, "read of seq 1");
    const uint32_t st = kvc_unified_stream_of(&b->c, 1);
    const kvc_cells *t = kvc_unified_stream_cells_c(&b->c, st);
    uint32_t got = 0;
    for (uint32_t i = 0; i < SIZE; i++) {
        if (t->pos[i] >= 0 && kvc_cells_seq_has(t, i, 1)) {
            got++;
            CHECK(rows_of(b, st, i, 1), "rows of cell %u (pos %d)", i, t->pos[i]);
        }
    }
    CHECK(got == 13 - 3 + 5, "seq 1 holds %u cells", got);
    size_t n2;
    uint8_t *back = write_state(b, 1, &n2);
    CHECK(n2 == n && memcmp(back, one, n) == 0, "seq 1 writes back the same bytes");
    free(back);

    /* no room, and a blob cut short: nothing changes */
    put(b, 2, 200, SIZE - t->used - 2);
    float k0[sizeof b->k / sizeof *b->k], v0[sizeof b->v / sizeof *b->v];
    memcpy(k0, b->k, sizeof k0);
    memcpy(v0, b->v, sizeof v0);
    snapshot *before = malloc(sizeof *before), *after = malloc(sizeof *after);
    REQUIRE(before && after, "alloc");
    take(&b->c, before);
    if (!per_seq) {
        uint8_t *s0 = write_state(a, 0, &n2);       /* 15 cells of seq 0 into 2 free cells + seq 0's own */
        CHECK(read_state(b, 0, s0, n2) == KVC_E_STATE, "no room");
        free(s0);
    }
    for (size_t cut = 0; cut < n; cut += 7) {
        CHECK(read_state(b, 1, one, cut) == KVC_E_STATE, "cut at %zu", cut);
    }
    take(&b->c, after);
    CHECK(memcmp(before, after, sizeof *before) == 0, "a failed read changes no cell");
    CHECK(memcmp(k0, b->k, sizeof k0) == 0 && memcmp(v0, b->v, sizeof v0) == 0, "nor a K/V byte");
    free(one);
    kvc_unified_free(&a->c);
    kvc_unified_free(&b->c);
    free(before);
    free(after);
    free(a);
    free(b);
}

/* Every cell of seq_id (-1: every cell) in every stream of f holds its rows. */
static bool all_rows(const fixture *f, int32_t seq_id, uint32_t *cells) {
    bool ok = true;
    *cells = 0;
    for (uint32_t st = 0; st < f->c.n_stream; st++) {
        const kvc_cells *t = kvc_unified_stream_cells_c(&f->c, st);
        for (uint32_t i = 0; i < SIZE; i++) {
            const int32_t q = t->pos[i] < 0 ? -1 : kvc_cells_seq_next(t, i, -1);
            if (q >= 0 && (seq_id < 0 || kvc_cells_seq_has(t, i, seq_id))) {
                ++*cells;
                ok = ok && rows_of(f, st, i, seq_id < 0 ? q : seq_id);
            }
        }
    }
    return ok;
}

static void test_conversions(bool per_seq, bool v_trans) {
    fixture *a = calloc(1, sizeof *a), *b = calloc(1, sizeof *b);
    REQUIRE(a && b && fixture_init(a, per_seq, v_trans) == KVC_OK && fixture_init(b, per_seq, !v_trans) == KVC_OK,
            "init");
    fill(a);
    size_t n;
    uint8_t *whole = write_state(a, -1, &n);
    CHECK(read_state(b, -1, whole, n) == KVC_E_STATE, "the other V layout without conversion");
    CHECK(read_state_flags(b, -1, whole, n, KVC_STATE_CONVERT_V) == KVC_OK, "whole read, converted");
    uint32_t ca = 0, cb = 0;
    CHECK(all_rows(a, -1, &ca) && all_rows(b, -1, &cb) && ca == cb && cb > 0, "whole: rows of %u / %u cells", cb, ca);
    free(whole);
    /* sequence 1 into scattered cells of its stream */
    kvc_unified_free(&b->c);
    REQUIRE(fixture_init(b, per_seq, !v_trans) == KVC_OK, "init");
    put(b, 1, 100, 4);
    put(b, 2, 100, 4);
    kvc_unified_seq_rm(&b->c, 1, -1, -1);
    uint8_t *one = write_state(a, 1, &n);
    CHECK(read_state_flags(b, 1, one, n, KVC_STATE_CONVERT_V) == KVC_OK, "seq 1, converted");
    CHECK(all_rows(b, 1, &cb) && cb == 13 - 3 + 5, "seq 1: rows of %u cells", cb);
    CHECK(all_rows(b, 2, &cb) && cb == 4, "seq 2 untouched: %u cells", cb);
    free(one);
    kvc_unified_free(&a->c);
    kvc_unified_free(&b->c);
    free(a);
    free(b);
}

int main(void) {
    test_round_trips(true, true);
    test_round_trips(true, false);
    test_round_trips(false, true);
    test_round_trips(false, false);
    test_conversions(true, true);
    test_conversions(true, false);
    test_conversions(false, true);
    test_conversions(false, false);
    printf("test_state_2026: %d checks, %d failed\n", n_checks, n_failed);
    return n_failed != 0;
}
