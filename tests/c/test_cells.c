/* Tests of the cell table (csrc/kvc_cells.c) against a naive model kept beside it: random edits
 * (placing positions, one cell at a time and in runs, adding and removing sequences, a sequence
 * joining another's cells in a range, shifts and divisions with the index rebuilt, moves of one
 * cell and of runs, raw sets) on tables of one sequence word and of several (65, 130 and 256
 * sequences), positions up to 2**31 - 1; after every edit the counters, the free-cell bits and
 * the empty-word bits, the scans for used and empty cells, for runs of empty cells and for the
 * k-th used cell from an end, and each sequence's position multiset (min, max, range queries,
 * range removal) are what the model says. */
#include "kvc_cells.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"

#define MAXN 300

/* The model: per cell a position, a shift and a membership flag per sequence. */
typedef struct model {
    uint32_t size, n_seq;
    int32_t pos[MAXN], shift[MAXN];
    bool has[MAXN][KVC_MAX_SEQ];
} model;

static int32_t model_min(const model *m, int32_t s) {
    int64_t r = -1;
    for (uint32_t i = 0; i < m->size; i++) {
        if (m->pos[i] != -1 && m->has[i][s] && (r == -1 || m->pos[i] < r)) {
            r = m->pos[i];
        }
    }
    return (int32_t)r;
}

static int32_t model_max(const model *m, int32_t s) {
    int32_t r = -1;
    for (uint32_t i = 0; i < m->size; i++) {
        if (m->pos[i] != -1 && m->has[i][s] && m->pos[i] > r) {
            r = m->pos[i];
        }
    }
    return r;
}

static bool model_empty_set(const model *m, uint32_t i) {
    for (uint32_t s = 0; s < m->n_seq; s++) {
        if (m->has[i][s]) {
            return false;
        }
    }
    return true;
}

static void agree(const kvc_cells *c, const model *m, const char *what) {
    uint32_t used = 0, last = 0;
    bool ok = true;
    for (uint32_t i = 0; i < m->size; i++) {
        ok = ok && c->pos[i] == m->pos[i];
        const bool bit = (c->used_bits[i >> 6] >> (i & 63)) & 1u;
        ok = ok && bit == (m->pos[i] != -1);
        if (m->pos[i] != -1) {
            used++;
            last = i + 1;
            ok = ok && c->shift[i] == m->shift[i];
        }
        for (uint32_t s = 0; s < m->n_seq; s++) {
            ok = ok && kvc_cells_seq_has(c, i, (int32_t)s) == (m->pos[i] != -1 && m->has[i][s]);
        }
        ok = ok && kvc_cells_seq_none(c, i) == (m->pos[i] == -1 || model_empty_set(m, i));
        uint32_t n_has = 0;
        for (uint32_t s = 0; s < m->n_seq; s++) {
            n_has += m->pos[i] != -1 && m->has[i][s];
        }
        ok = ok && kvc_cells_seq_count(c, i) == n_has;
        /* the set as its readers give it: the ids in order, and word by word */
        int32_t prev = -1;
        for (uint32_t s = 0; s < m->n_seq; s++) {
            if (m->pos[i] != -1 && m->has[i][s]) {
                ok = ok && kvc_cells_seq_next(c, i, prev) == (int32_t)s;
                prev = (int32_t)s;
            }
        }
        ok = ok && kvc_cells_seq_next(c, i, prev) == -1;
        for (uint32_t w = 0; w < c->seq_words; w++) {
            uint64_t want = 0;
            for (uint32_t s = 64 * w; s < m->n_seq && s < 64 * w + 64; s++) {
                want |= (uint64_t)(m->pos[i] != -1 && m->has[i][s]) << (s & 63);
            }
            ok = ok && kvc_cells_seq_word(c, i, w) == want;
        }
    }
    CHECK(ok, "%s: cells differ from the model", what);
    CHECK(kvc_cells_check(c, NULL) == KVC_OK, "%s: the sequence counts disagree with the sets", what);
    CHECK(c->used == used && c->used_max_p1 == last, "%s: used %u/%u, last %u/%u", what, c->used, used,
          c->used_max_p1, last);
    /* scans from every start, to every end */
    for (uint32_t k = 0; k < 8; k++) {
        const uint32_t from = check_rand(m->size + 1), to = from + check_rand(m->size + 1 - from);
        uint32_t want_used = to, want_empty = to;
        for (uint32_t i = from; i < to; i++) {
            if (want_used == to && m->pos[i] != -1) {
                want_used = i;
            }
            if (want_empty == to && m->pos[i] == -1) {
                want_empty = i;
            }
        }
        CHECK(kvc_cells_next_used(c, from, to) == want_used, "%s: next used in [%u, %u)", what, from, to);
        CHECK(kvc_cells_next_empty(c, from, to) == want_empty, "%s: next empty in [%u, %u)", what, from, to);
    }
    /* the empty-word bits; the first run of n empty cells starting in [a, b]; the used cell with
     * k used cells from it to an end */
    bool words = true;
    for (uint32_t w = 0; w < c->n_words; w++) {
        words = words && ((c->free_words[w >> 6] >> (w & 63)) & 1u) == (c->used_bits[w] == 0);
    }
    CHECK(words, "%s: the empty-word bits", what);
    for (uint32_t k = 0; k < 8; k++) {
        const uint32_t n = k & 1 ? check_rand(m->size + 1) : check_rand(9);
        const uint32_t a = check_rand(m->size - n + 1), b = a + check_rand(m->size - n + 1 - a);
        uint32_t want = UINT32_MAX;
        for (uint32_t q = a; q <= b && want == UINT32_MAX; q++) {
            uint32_t e = 0;
            while (e < n && m->pos[q + e] == -1) {
                e++;
            }
            want = e == n ? q : UINT32_MAX;
        }
        CHECK(kvc_cells_first_free_run(c, a, b, n) == want, "%s: first run of %u empty cells from [%u, %u]", what, n, a, b);
        const uint32_t lo = check_rand(m->size + 1), end = lo + check_rand(m->size + 1 - lo), kk = 1 + check_rand(20);
        uint32_t back = UINT32_MAX, seen = 0;
        for (uint32_t i = end; i-- > lo && back == UINT32_MAX;) {
            if (m->pos[i] != -1 && ++seen == kk) {
                back = i;
            }
        }
        CHECK(kvc_cells_kth_used_back(c, lo, end, kk) == back, "%s: used cell %u from %u down to %u", what, kk, end, lo);
    }
    /* each sequence's multiset: extremes, and the sorted entries themselves */
    for (uint32_t s = 0; s < m->n_seq; s++) {
        CHECK(kvc_cells_seq_pos_min(c, (int32_t)s) == model_min(m, (int32_t)s) &&
                  kvc_cells_seq_pos_max(c, (int32_t)s) == model_max(m, (int32_t)s),
              "%s: sequence %u extremes", what, s);
        uint32_t n = 0;
        for (uint32_t i = 0; i < m->size; i++) {
            n += m->pos[i] != -1 && m->has[i][s];
        }
        bool sorted = c->seq_pos[s].n == n;
        for (uint32_t k = 1; sorted && k < n; k++) {
            /* ascending (position, cell): no entry twice */
            sorted = c->seq_pos[s].key[k - 1] < c->seq_pos[s].key[k];
        }
        CHECK(sorted, "%s: sequence %u index has %u entries, the cells %u", what, s, c->seq_pos[s].n, n);
    }
}

/* A position: small (collisions), or near the top. */
static int32_t some_pos(void) {
    return check_rand(4) == 0 ? KVC_POS_MAX - (int32_t)check_rand(4) : (int32_t)check_rand(40);
}

static int32_t some_seq(const model *m) {
    /* the ids at the edges of the words as often as the rest */
    const int32_t edges[] = { 0, 63, 64, 127, 128, 255 };
    const int32_t e = edges[check_rand(6)];
    return check_rand(2) && (uint32_t)e < m->n_seq ? e : (int32_t)check_rand(m->n_seq);
}

/* The model of kvc_cells_mv. */
static void model_mv(model *m, uint32_t i, uint32_t j) {
    m->pos[j] = m->pos[i];
    m->shift[j] = m->shift[i];
    memcpy(m->has[j], m->has[i], sizeof m->has[i]);
    m->pos[i] = -1;
    m->shift[i] = 0;
    memset(m->has[i], 0, sizeof m->has[i]);
}

static void run(uint32_t size, uint32_t n_seq) {
    kvc_cells c;
    static model m;
    char what[96];
    REQUIRE(kvc_cells_init(&c, size, n_seq) == KVC_OK, "init");
    CHECK(c.seq_words == (n_seq <= 64 ? 1u : (n_seq + 63) / 64), "words for %u sequences", n_seq);
    memset(&m, 0, sizeof m);
    m.size = size;
    m.n_seq = n_seq;
    for (uint32_t i = 0; i < size; i++) {
        m.pos[i] = -1;
    }
    for (int step = 0; step < 3000; step++) {
        const uint32_t op = check_rand(9), i = check_rand(size);
        snprintf(what, sizeof what, "%u cells, %u sequences, step %d (op %u)", size, n_seq, step, op);
        if (op == 0 && check_rand(2)) {                /* a run of empty cells placed, as find_slot does */
            uint32_t n = 0;
            while (i + n < size && n < 12 && m.pos[i + n] == -1) {
                n++;
            }
            int32_t pos[12], ids[3];
            const int32_t p0 = some_pos();
            const uint32_t n_ids = 1 + check_rand(3);
            for (uint32_t k = 0; k < n; k++) {
                /* ascending mostly, or a position again (the index inserts those one by one) */
                pos[k] = check_rand(4) ? (int32_t)(p0 + k > KVC_POS_MAX ? KVC_POS_MAX : p0 + k) : some_pos();
            }
            for (uint32_t q = 0; q < n_ids; q++) {
                ids[q] = some_seq(&m);   /* may repeat */
            }
            kvc_cells_place_run(&c, i, n, pos, ids, n_ids);
            for (uint32_t k = 0; k < n; k++) {
                m.pos[i + k] = pos[k];
                for (uint32_t q = 0; q < n_ids; q++) {
                    m.has[i + k][ids[q]] = true;
                }
            }
        } else if (op == 0 && check_rand(2)) {         /* a run of empty cells, a sequence each (apply's runs) */
            uint32_t n = 0;
            while (i + n < size && n < 12 && m.pos[i + n] == -1) {
                n++;
            }
            int32_t pos[12], seq[12];
            const int32_t p0 = some_pos();
            for (uint32_t k = 0; k < n; k++) {
                pos[k] = check_rand(4) ? (int32_t)(p0 + k > KVC_POS_MAX ? KVC_POS_MAX : p0 + k) : some_pos();
                seq[k] = check_rand(2) && k ? seq[k - 1] : some_seq(&m);
            }
            CHECK(kvc_cells_empty_run(&c, i, size - i < 12 ? size - i : 12) == n, "%s: the empty cells from %u", what, i);
            kvc_cells_place_first_run(&c, i, n, pos, seq);
            for (uint32_t k = 0; k < n; k++) {
                m.pos[i + k] = pos[k];
                m.has[i + k][seq[k]] = true;
            }
            CHECK(n == 0 || kvc_cells_empty_run(&c, i, size - i) == 0, "%s: cell %u is used", what, i);
        } else if (op < 3) {                           /* a token: an empty cell gets a position and ids */
            if (m.pos[i] != -1) {
                continue;
            }
            const int32_t p = some_pos();
            kvc_cells_pos_set(&c, i, p);
            m.pos[i] = p;
            for (uint32_t k = 1 + check_rand(3); k > 0; k--) {
                const int32_t s = some_seq(&m);
                kvc_cells_seq_add(&c, i, s);
                m.has[i][s] = true;
            }
        } else if (op == 3) {                          /* a sequence leaves a cell */
            if (m.pos[i] == -1) {
                continue;
            }
            for (uint32_t s = 0; s < n_seq; s++) {
                if (m.has[i][s]) {
                    const bool emptied = kvc_cells_seq_rm(&c, i, (int32_t)s);
                    m.has[i][s] = false;
                    CHECK(emptied == model_empty_set(&m, i), "%s: emptied", what);
                    if (emptied) {
                        m.pos[i] = -1;
                    }
                    break;
                }
            }
        } else if (op == 4) {                          /* shifts of a range of cells, the index rebuilt */
            const int32_t d = (int32_t)check_rand(21) - 10;
            kvc_seqset touched;
            kvc_seqset_clear(&touched);
            for (uint32_t j = i; j < size && j < i + 8; j++) {
                if (m.pos[j] == -1) {
                    continue;
                }
                kvc_cells_seq_or_into(&c, j, &touched);
                const bool gone = kvc_cells_pos_add_raw(&c, j, d);
                const int64_t p = (int64_t)m.pos[j] + d;
                m.shift[j] = kvc_wrap_add_i32(m.shift[j], d);   /* shifts wrap, as the table's */
                m.pos[j] = p > KVC_POS_MAX ? KVC_POS_MAX : (int32_t)p;
                CHECK(gone == (p < 0), "%s: pushed below 0", what);
                if (p < 0) {
                    m.pos[j] = -1;
                    memset(m.has[j], 0, sizeof m.has[j]);
                }
            }
            kvc_cells_rebuild_seq_pos(&c, &touched);
        } else if (op == 5) {                          /* division of one cell */
            if (m.pos[i] == -1) {
                continue;
            }
            const int32_t d = 1 + (int32_t)check_rand(4), old = m.pos[i];
            kvc_seqset touched;
            kvc_seqset_clear(&touched);
            kvc_cells_seq_or_into(&c, i, &touched);
            kvc_cells_pos_div_raw(&c, i, d);
            kvc_cells_rebuild_seq_pos(&c, &touched);
            m.pos[i] = old / d;
            m.shift[i] = kvc_wrap_add_i32(m.shift[i], old - m.pos[i]);
        } else if (op == 6 && check_rand(2)) {         /* a move to an empty cell */
            const uint32_t j = check_rand(size);
            if (m.pos[i] == -1 || m.pos[j] != -1) {
                continue;
            }
            kvc_cells_mv(&c, i, j);
            model_mv(&m, i, j);
        } else if (op == 6) {                          /* a run of used cells moved down into empty cells */
            uint32_t n = 0;
            while (i + n < size && n < 12 && m.pos[i + n] != -1) {
                n++;
            }
            const uint32_t j = n ? check_rand(i + 1) : 0;
            bool empty = n > 0 && j + n <= i;
            for (uint32_t k = 0; empty && k < n; k++) {
                empty = m.pos[j + k] == -1;
            }
            if (!empty) {
                continue;
            }
            kvc_cells_mv_run(&c, i, j, n);
            for (uint32_t k = 0; k < n; k++) {
                model_mv(&m, i + k, j + k);
            }
        } else if (op == 7 && check_rand(4) == 0) {    /* a sequence joins the cells of another in a range */
            const int32_t s = some_seq(&m), t = some_seq(&m);
            const kvc_pos_range r = kvc_pos_range_of(check_rand(2) ? -1 : some_pos(), check_rand(2) ? -1 : some_pos());
            if (s == t) {
                continue;
            }
            bool any = false;
            for (uint32_t j = 0; j < size; j++) {
                if (m.pos[j] != -1 && m.has[j][s] && kvc_pos_range_has(r, m.pos[j])) {
                    any = any || !m.has[j][t];
                    m.has[j][t] = true;
                }
            }
            CHECK(kvc_cells_seq_cp_range(&c, s, t, r) == any, "%s: sequence %d joined %d", what, t, s);
        } else if (op == 7) {                          /* range removal of one sequence, as seq_rm does it */
            const int32_t s = some_seq(&m);
            const kvc_pos_range r = kvc_pos_range_of(check_rand(2) ? -1 : some_pos(), check_rand(2) ? -1 : some_pos());
            bool any = false;
            for (uint32_t j = 0; j < size; j++) {
                any = any || (m.pos[j] != -1 && m.has[j][s] && kvc_pos_range_has(r, m.pos[j]));
            }
            CHECK(kvc_cells_seq_pos_any_in(&c, s, r) == any, "%s: any of sequence %d in the range", what, s);
            for (uint32_t j = 0; j < size; j++) {
                if (m.pos[j] != -1 && m.has[j][s] && kvc_pos_range_has(r, m.pos[j])) {
                    m.has[j][s] = false;
                    if (kvc_cells_seq_del_raw(&c, j, s)) {
                        m.pos[j] = -1;
                    }
                }
            }
            kvc_cells_seq_pos_rm_range(&c, s, r);
        } else {                                       /* a raw set, as an undo or a state read */
            uint64_t words[KVC_SEQ_WORDS] = { 0 };
            const int32_t p = check_rand(3) ? some_pos() : -1;
            kvc_seqset was;
            kvc_seqset_clear(&was);
            if (m.pos[i] != -1) {
                kvc_cells_seq_or_into(&c, i, &was);
            }
            memset(m.has[i], 0, sizeof m.has[i]);
            if (p != -1) {
                const int32_t s = some_seq(&m);
                words[s >> 6] |= (uint64_t)1 << (s & 63);
                m.has[i][s] = true;
                kvc_seqset_add(&was, s);
            }
            kvc_cells_set_raw(&c, i, p, words);
            m.pos[i] = p;
            kvc_cells_rebuild_seq_pos(&c, &was);
        }
        agree(&c, &m, what);
    }
    /* a copy is the same table */
    kvc_cells d;
    REQUIRE(kvc_cells_init(&d, size, n_seq) == KVC_OK, "init copy");
    kvc_cells_copy(&d, &c);
    agree(&d, &m, "copy");
    /* a snapshot is the same table, and put back over a table changed since gives it back */
    kvc_cells snap;
    REQUIRE(kvc_cells_snapshot(&snap, &c) == KVC_OK, "snapshot");
    agree(&snap, &m, "snapshot");
    kvc_cells_reset(&d);
    kvc_cells_copy(&d, &snap);
    agree(&d, &m, "snapshot put back");
    kvc_cells_free(&snap);
    kvc_cells_reset(&c);
    for (uint32_t i = 0; i < size; i++) {
        m.pos[i] = -1;
        m.shift[i] = 0;
        memset(m.has[i], 0, sizeof m.has[i]);
    }
    agree(&c, &m, "reset");
    CHECK(!c.has_shift, "reset clears has_shift");
    kvc_cells_free(&d);
    kvc_cells_free(&c);
}

static void test_limits(void) {
    kvc_cells c;
    CHECK(kvc_cells_init(&c, 8, KVC_MAX_SEQ + 1) == KVC_E_ARG, "more sequences than the bound");
    for (int n = 1; n <= 6; n++) {
        kvc_fail_alloc_after = n;
        const int rc = kvc_cells_init(&c, 64, 130);
        kvc_fail_alloc_after = 0;
        CHECK(rc == KVC_E_NOMEM || rc == KVC_OK, "allocation %d failing: %d", n, rc);
        if (rc == KVC_OK) {
            kvc_cells_free(&c);
        }
    }
    /* an open range holds the top position; an explicit one stops before it */
    REQUIRE(kvc_cells_init(&c, 8, 1) == KVC_OK, "init");
    kvc_cells_pos_set(&c, 3, KVC_POS_MAX);
    kvc_cells_seq_add(&c, 3, 0);
    CHECK(kvc_cells_seq_pos_any_in(&c, 0, kvc_pos_range_of(-1, -1)), "open range");
    CHECK(!kvc_cells_seq_pos_any_in(&c, 0, kvc_pos_range_of(0, KVC_POS_MAX)), "bounded range");
    kvc_cells_seq_pos_rm_range(&c, 0, kvc_pos_range_of(KVC_POS_MAX, -1));
    CHECK(kvc_cells_seq_pos_max(&c, 0) == -1, "removed from the index");
    kvc_cells_free(&c);
}

/* A sequence's removal from runs of adjacent cells it alone holds (taken a word at a time) does
 * what it does cell by cell: positions, shifts and extensions back to empty, the emptied bits,
 * the last used cell; shared cells beside them keep their other sequence. */
static void test_rm_runs(void) {
    kvc_cells c;
    REQUIRE(kvc_cells_init(&c, 256, 3) == KVC_OK, "init");
    REQUIRE(kvc_cells_ext_enable(&c) == KVC_OK, "extension");
    c.empty_zeroes_shift = true;
    /* shared cells 40..45 (sequences 1 and 2), then sequence 1 alone on 60..75 (across a word) */
    for (uint32_t i = 40; i < 46; i++) {
        kvc_cells_place_first(&c, i, (int32_t)(i - 40), 1);
        kvc_cells_seq_add(&c, i, 2);
    }
    for (uint32_t i = 60; i < 76; i++) {
        kvc_cells_place_first(&c, i, (int32_t)(i - 54), 1);
        c.ext[i] = (kvc_cell_ext){ 3, 4, 7 };
        c.shift[i] = 5;
    }
    c.has_shift = true;
    uint64_t emptied[2] = { 0, 0 };
    kvc_cells_take_emptied(&c, emptied);
    emptied[0] = 0;
    CHECK(kvc_cells_seq_rm_range(&c, 1, kvc_pos_range_of(-1, -1)) == 60, "the lowest cell emptied");
    bool ok = true;
    for (uint32_t i = 60; i < 76; i++) {
        ok = ok && c.pos[i] == -1 && c.shift[i] == 0 && c.ext[i].x == 0 && c.ext[i].y == 0 &&
             c.ext[i].tok == KVC_TOKEN_NULL && kvc_cells_seq_none(&c, i) && kvc_cells_is_empty_bit(&c, i);
    }
    CHECK(ok, "the run's cells are empty, their shifts and extensions at their defaults");
    for (uint32_t i = 40; i < 46; i++) {
        CHECK(c.pos[i] == (int32_t)(i - 40) && kvc_cells_seq_has(&c, i, 2) && !kvc_cells_seq_has(&c, i, 1) &&
              kvc_cells_seq_count(&c, i) == 1, "shared cell %u keeps sequence 2", i);
    }
    CHECK(c.used == 6 && c.used_max_p1 == 46, "used %u, last %u", c.used, c.used_max_p1);
    kvc_cells_take_emptied(&c, emptied);
    CHECK(emptied[0] == 3, "the emptied words: %llx", (unsigned long long)emptied[0]);
    CHECK(kvc_cells_check(&c, NULL) == KVC_OK, "the counts agree with the sets");
    CHECK(kvc_cells_seq_pos_max(&c, 1) == -1 && kvc_cells_seq_pos_max(&c, 2) == 5, "the index");
    kvc_cells_free(&c);
}

/* The tables a cache reads per cell: zeroed whatever their size, on whole huge pages from 1 MiB
 * (Linux), NULL for a size that overflows or when the allocation hook says so. */
static void test_table_memory(void) {
    static const uint64_t sizes[] = { 0, 1, 4095, 4097, ((uint64_t)1 << 20) - 1, (uint64_t)1 << 20,
                                      ((uint64_t)3 << 20) + 5 };
    for (size_t k = 0; k < sizeof sizes / sizeof *sizes; k++) {
        unsigned char *p = kvc_table_calloc(sizes[k], 1);
        REQUIRE(p != NULL, "%llu bytes", (unsigned long long)sizes[k]);
        bool zero = true;
        for (uint64_t j = 0; j < sizes[k]; j++) {
            zero = zero && p[j] == 0;
        }
        CHECK(zero, "%llu bytes come zeroed", (unsigned long long)sizes[k]);
        if (sizes[k]) {
            p[sizes[k] - 1] = 1;   /* the last byte is the caller's */
        }
#if defined(__linux__)
        CHECK(sizes[k] < ((uint64_t)1 << 20) || (uintptr_t)p % KVC_HUGE_PAGE == 0, "%llu bytes on a huge page",
              (unsigned long long)sizes[k]);
#endif
        kvc_free(p);
    }
    CHECK(kvc_table_calloc(UINT64_MAX / 2, 4) == NULL, "a size that overflows");
    kvc_fail_alloc_after = 1;
    CHECK(kvc_table_calloc(16, 4) == NULL, "the allocation hook");
    kvc_fail_alloc_after = 0;
}

int main(void) {
    run(37, 1);
    run(64, 4);
    run(130, 64);
    run(200, 65);
    run(130, 130);
    run(MAXN, 256);
    test_limits();
    test_table_memory();
    test_rm_runs();
    printf("test_cells: %d checks, %d failed\n", n_checks, n_failed);
    return n_failed != 0;
}
