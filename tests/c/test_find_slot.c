/* Tests of the slot search and what goes with it (csrc/kvc_slot.c): find_slot against a naive
 * transcription of the seed's search (a window tested cell by cell from head, wrapping at the
 * end, giving up once the head has travelled over the whole cache; head reset to 0 when enough
 * cells are free before it) on random fragmented tables, small and large (windows of many
 * words), including the failure rules (ubatch
 * larger than the cache, no run left) and where head ends then; the attended span n; the
 * placement (its cells, store writing exactly there, refusals); restore putting every
 * overwritten cell back; and find_slot failing for lack of memory changing nothing. */
#include "kvc_slot.h"
#include "kvc_types.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "fixture.h"

#define SIZE 96
#define WIDTH 3

typedef struct fixture {
    kvc_unified c;
    float k[SIZE * WIDTH], v[SIZE * WIDTH];
} fixture;

static int fixture_init(fixture *f, bool v_trans, uint32_t n_pad) {
    const int32_t il[1] = { 0 };
    const uint32_t w[1] = { WIDTH };
    const kvc_unified_params p = {
        .kv_size = SIZE, .n_seq_max = 70, .n_pad = n_pad, .type_k = KVC_TYPE_F32, .type_v = KVC_TYPE_F32,
        .v_trans = v_trans, .n_layer = 1, .layer_il = il, .n_embd_k = w, .n_embd_v = w,
    };
    return fixture_attach(&f->c, &p, f->k, sizeof f->k, f->v, sizeof f->v);
}

/* The seed's search, cell by cell: the head it ends at, and whether the window is free. */
/* Every cell's set (two words a cell: ids below 128), into words[w * SIZE + i]. */
static void sets_take(uint64_t *words, const kvc_cells *c) {
    for (uint32_t w = 0; w < 2; w++) {
        for (uint32_t i = 0; i < SIZE; i++) {
            words[w * SIZE + i] = w < c->seq_words ? kvc_cells_seq_word(c, i, w) : 0;
        }
    }
}

/* The sets are the ones sets_take took. */
static bool same_words(const uint64_t *words, const kvc_cells *c) {
    uint64_t now[SIZE * 2];
    sets_take(now, c);
    return memcmp(now, words, sizeof now) == 0;
}

static bool naive_search(const kvc_cells *c, uint32_t *head, uint32_t n) {
    const uint32_t size = c->size;
    if (*head > c->used + 2 * n) {
        *head = 0;
    }
    if (n > size) {
        return false;
    }
    uint64_t tested = 0;
    for (;;) {
        if (*head + n > size) {
            tested += size - *head;
            *head = 0;
            continue;
        }
        bool found = true;
        for (uint32_t i = 0; i < n; i++) {
            if (c->pos[*head + i] != -1) {
                found = false;
                *head += i + 1;
                tested += i + 1;
                break;
            }
        }
        if (found) {
            return true;
        }
        if (tested >= size) {
            return false;
        }
    }
}

/* A ubatch of n tokens of sequence s (and t, one of the upper word, every third token). */
typedef struct ub_buf {
    int32_t pos[SIZE + 8], ids[2 * (SIZE + 8)];
    uint32_t off[SIZE + 9];
    kvc_ubatch ub;
} ub_buf;

static const kvc_ubatch *make_ub(ub_buf *b, uint32_t n, int32_t p0, int32_t s, int32_t t) {
    return fixture_ub(&b->ub, b->pos, b->off, b->ids, n, p0, s, t, 3);
}

static void test_search_matches_the_seed(void) {
    for (int round = 0; round < 40; round++) {
        fixture f;
        static const uint32_t pads[3] = { 1, 8, 32 };
        REQUIRE(fixture_init(&f, round & 1, pads[round % 3]) == KVC_OK, "init");
        kvc_unified *c = &f.c;
        ub_buf b;
        for (int step = 0; step < 200; step++) {
            const uint32_t n = 1 + (check_rand(6) == 0 ? check_rand(SIZE + 4) : check_rand(6));
            const int32_t s = (int32_t)check_rand(3), t = 64 + (int32_t)check_rand(6);
            const kvc_ubatch *ub = make_ub(&b, n, 10 * step, s, t);
            uint32_t head = c->head;
            const bool want = naive_search(&c->cells, &head, n);
            int32_t before[SIZE];
            memcpy(before, c->cells.pos, sizeof before);
            const int r = kvc_unified_find_slot(c, ub);
            CHECK(r == (want ? 1 : 0), "round %d step %d: %u tokens placed %d, the seed says %d", round, step, n, r, want);
            CHECK(c->head == head, "round %d step %d: head %u, the seed's %u", round, step, c->head, head);
            if (r == 1) {
                CHECK(kvc_unified_slot_n(c) == n && kvc_unified_slot_cell(c, 0) == head, "placement");
                bool placed = true;
                for (uint32_t i = 0; i < n; i++) {
                    placed = placed && before[head + i] == -1 && c->cells.pos[head + i] == ub->pos[i] &&
                             kvc_cells_seq_has(&c->cells, head + i, s) &&
                             kvc_cells_seq_has(&c->cells, head + i, t) == (i % 3 == 0);
                }
                CHECK(placed, "the tokens are in the window, with their sequences");
                uint32_t want_n = (c->cells.used_max_p1 + c->n_pad - 1) / c->n_pad * c->n_pad;
                want_n = want_n < c->n_pad ? c->n_pad : want_n;
                CHECK(c->n == (want_n < SIZE ? want_n : SIZE), "n %u", c->n);
                if (check_rand(4)) {
                    kvc_unified_commit(c);
                }
            } else {
                CHECK(kvc_unified_slot_n(c) == 0 && memcmp(before, c->cells.pos, sizeof before) == 0,
                      "no room: nothing placed, no cell changed");
            }
            /* holes: a few tokens leave */
            if (check_rand(3) == 0) {
                kvc_unified_seq_rm(c, (int32_t)check_rand(3), (int32_t)check_rand(10 * step + 10), -1);
            }
        }
        kvc_unified_free(c);
    }
}

/* The same on a larger metadata-only table, fragmented as a server fragments it: interleaved
 * one-token placements of several sequences (a finished one leaves holes of one cell) between
 * long runs, with windows up to several words long. */
static void test_search_matches_the_seed_large(void) {
    enum { BIG = 4096, NSEQ = 8 };
    static int32_t pos[BIG], ids[2 * BIG];
    static uint32_t off[BIG + 1];
    const int32_t il[1] = { 0 };
    const uint32_t w[1] = { WIDTH };
    const kvc_unified_params p = {
        .kv_size = BIG, .n_seq_max = NSEQ, .n_pad = 32, .type_k = KVC_TYPE_F32, .type_v = KVC_TYPE_F32,
        .n_layer = 1, .layer_il = il, .n_embd_k = w, .n_embd_v = w,
    };
    for (int round = 0; round < 6; round++) {
        kvc_unified c;
        REQUIRE(kvc_unified_init(&c, &p, NULL) == KVC_OK, "init");
        int32_t next[NSEQ] = { 0 };
        for (int step = 0; step < 400; step++) {
            kvc_ubatch ub;
            const uint32_t kind = check_rand(4);
            uint32_t n;
            if (kind == 0) {
                /* one token of each sequence, interleaved */
                n = NSEQ;
                for (uint32_t t = 0; t < n; t++) {
                    pos[t] = next[t]++;
                    ids[t] = (int32_t)t;
                    off[t] = t;
                }
                off[n] = n;
                ub = (kvc_ubatch){ n, 1, n, pos, off, ids, NULL, NULL, NULL };
            } else {
                static const uint32_t sizes[] = { 1, 5, 63, 64, 65, 126, 127, 128, 129, 191, 256, 300, 513 };
                n = kind == 1 ? 1 + check_rand(BIG / 4) : sizes[check_rand(sizeof sizes / sizeof sizes[0])];
                const int32_t s = (int32_t)check_rand(NSEQ);
                fixture_ub(&ub, pos, off, ids, n, next[s], s, -1, 1);
                next[s] += (int32_t)n;
            }
            uint32_t head = c.head;
            const bool want = naive_search(&c.cells, &head, n);
            const int r = kvc_unified_find_slot(&c, &ub);
            CHECK(r == (want ? 1 : 0), "round %d step %d: %u tokens placed %d, the seed says %d", round, step, n, r, want);
            CHECK(c.head == head, "round %d step %d: head %u, the seed's %u", round, step, c.head, head);
            kvc_unified_commit(&c);
            /* a sequence finishes now and then, or loses a stretch */
            if (check_rand(5) == 0) {
                const int32_t s = (int32_t)check_rand(NSEQ);
                const int32_t p0 = check_rand(2) ? 0 : (int32_t)check_rand((uint32_t)next[s] + 1);
                kvc_unified_seq_rm(&c, s, p0, -1);
                next[s] = p0;
            }
        }
        kvc_unified_free(&c);
    }
}

static void test_restore_and_placement(void) {
    fixture f;
    REQUIRE(fixture_init(&f, true, 8) == KVC_OK, "init");
    kvc_unified *c = &f.c;
    ub_buf b;
    REQUIRE(kvc_unified_find_slot(c, make_ub(&b, 20, 0, 1, 65)) == 1, "prefill");
    kvc_unified_commit(c);
    kvc_unified_seq_rm(c, 1, 7, 9);                     /* a hole at cells 7, 8 (they hold only 1) */
    int32_t pos0[SIZE];
    uint64_t seq0[SIZE * 2];
    memcpy(pos0, c->cells.pos, sizeof pos0);
    sets_take(seq0, &c->cells);
    const uint32_t used0 = c->cells.used;
    /* three placements, one into the hole, then undone together */
    REQUIRE(kvc_unified_find_slot(c, make_ub(&b, 2, 100, 2, 69)) == 1, "into the hole");
    CHECK(kvc_unified_slot_cell(c, 0) == 7, "the hole is at 7: %u", kvc_unified_slot_cell(c, 0));
    REQUIRE(kvc_unified_find_slot(c, make_ub(&b, 7, 200, 0, 64)) == 1, "after");
    /* store writes exactly the placed cells: K rows, and V columns when transposed */
    float k[7 * WIDTH], v[7 * WIDTH];
    for (int i = 0; i < 7 * WIDTH; i++) {
        k[i] = (float)(1000 + i);
        v[i] = (float)(2000 + i);
    }
    const uint32_t at = kvc_unified_slot_cell(c, 0);
    int32_t cells[8];
    kvc_unified_slot_cells(c, cells);
    CHECK(cells[0] == (int32_t)at && cells[6] == (int32_t)at + 6, "the placed cells");
    CHECK(kvc_unified_store(c, 0, 6, k, v) == KVC_E_ARG, "a row count that is not the placement's");
    CHECK(kvc_unified_store(c, 1, 7, k, v) == KVC_E_ARG, "no such layer");
    CHECK(kvc_unified_store(c, 0, 7, k, v) == KVC_OK, "store");
    bool rows = true;
    for (uint32_t t = 0; t < 7; t++) {
        for (uint32_t e = 0; e < WIDTH; e++) {
            rows = rows && f.k[(at + t) * WIDTH + e] == k[t * WIDTH + e] && f.v[e * SIZE + at + t] == v[t * WIDTH + e];
        }
    }
    CHECK(rows && f.k[(at - 1) * WIDTH] == 0.0f && f.k[(at + 7) * WIDTH] == 0.0f, "rows in the placed cells only");
    REQUIRE(kvc_unified_find_slot(c, make_ub(&b, 3, 300, 2, 66)) == 1, "a third");
    kvc_unified_restore(c);
    CHECK(memcmp(pos0, c->cells.pos, sizeof pos0) == 0 && same_words(seq0, &c->cells) &&
              c->cells.used == used0, "restore puts every overwritten cell back");
    CHECK(kvc_unified_slot_n(c) == 0 && kvc_unified_store(c, 0, 3, k, v) == KVC_E_ARG, "nothing placed after it");
    CHECK(kvc_unified_seq_pos_max(c, 2) == -1 && kvc_unified_seq_pos_max(c, 64) == -1 &&
              kvc_unified_seq_pos_max(c, 65) == 18 && kvc_unified_seq_pos_max(c, 1) == 19, "the index follows");
    /* a ubatch larger than the cache: no room, nothing placed */
    CHECK(kvc_unified_find_slot(c, make_ub(&b, SIZE + 1, 0, 0, 64)) == 0 && kvc_unified_slot_n(c) == 0, "too large");
    /* without memory for the undo log nothing changes, the placement included */
    REQUIRE(kvc_unified_find_slot(c, make_ub(&b, 2, 400, 0, 64)) == 1, "placed");
    const kvc_slot slot = c->slot;
    memcpy(pos0, c->cells.pos, sizeof pos0);
    const uint32_t head = c->head;
    for (int fail = 1; fail <= 2; fail++) {
        kvc_fail_alloc_after = fail;
        const int r = kvc_unified_find_slot(c, make_ub(&b, 90, 500, 0, 64));
        kvc_fail_alloc_after = 0;
        CHECK(r == KVC_E_NOMEM || r == 0 || r == 1, "result %d", r);
        if (r == KVC_E_NOMEM) {
            CHECK(memcmp(pos0, c->cells.pos, sizeof pos0) == 0 && c->head == head && c->slot.n == slot.n &&
                      c->slot.head == slot.head,
                  "a failed allocation changed the cache");
        }
    }
    kvc_unified_free(c);
}

int main(void) {
    test_search_matches_the_seed();
    test_search_matches_the_seed_large();
    test_restore_and_placement();
    printf("test_find_slot: %d checks, %d failed\n", n_checks, n_failed);
    return n_failed != 0;
}
