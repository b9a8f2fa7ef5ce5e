/* Tests of the per-sequence block index of the cell table (kvc_cells.h seq_blk) and of the
 * position index beside it, through the operations that change cells: random sequences of
 * find_slot / commit / restore / rewind, seq_rm (one sequence and any), seq_cp (within a stream
 * and across streams), seq_keep, seq_add, seq_div, defrag plans, whole-cache snapshots put back,
 * the 2026 update's stream copies and clear, on caches of the seed's semantics and of 2026 (one
 * stream and a stream per sequence, with and without a sliding window), of sizes that are not
 * multiples of 64 and of more than 4096 cells (several words of block bits), with 1 and 2 words
 * of sequence sets. After every operation a full scan of every cell is held against the
 * indexes: every cell holding s has its block marked (and after a seq_rm of s no block
 * where it lost its last cell), seq_pos[s] is exactly the sorted positions of the cells holding s, and
 * kvc_cells_seq_cells (a copy of the index's cells) lists exactly those cells; every cell whose
 * position or sequences changed is in the table's change log since the step before (or the log
 * restarted); and a mask rewritten where the cells changed (kvc_unified_kq_mask_reuse and its
 * 2026 twin, into the same buffer step after step) equals a fresh one byte for byte. */
#include "kvc_cells.h"
#include "kvc_defrag.h"
#include "kvc_mask.h"
#include "kvc_slot.h"
#include "kvc_types.h"
#include "kvc_update.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "fixture.h"

#define WIDTH 2

typedef struct setup {
    const char *name;
    uint32_t size, n_seq, n_swa;
    int32_t semantics, swa_type;
    bool per_seq;
} setup;

static int cmp_i32(const void *a, const void *b) {
    const int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;
    return (x > y) - (x < y);
}

/* The indexes of table t against a scan of its cells. */
static void check_table(const kvc_cells *t, const char *what, uint32_t step) {
    int32_t *pos = malloc((size_t)t->size * sizeof *pos);
    int32_t *cells = malloc((size_t)t->size * sizeof *cells), *cpos = malloc((size_t)t->size * sizeof *cpos);
    if (!pos || !cells || !cpos) {
        CHECK(false, "out of memory");
        free(pos);
        free(cells);
        free(cpos);
        return;
    }
    /* each cell's sequence count: the bits of its set */
    bool counted = true;
    for (uint32_t i = 0; counted && i < t->size; i++) {
        uint32_t n = 0;
        for (uint32_t s = 0; s < t->n_seq_max; s++) {
            n += kvc_cells_seq_has(t, i, (int32_t)s);
        }
        counted = kvc_cells_seq_count(t, i) == n && kvc_cells_seq_none(t, i) == (n == 0);
    }
    CHECK(counted, "%s step %u: a cell's sequence count is not the number of its sequences", what, step);
    CHECK(kvc_cells_check(t, NULL) == KVC_OK, "%s step %u: kvc_cells_check", what, step);
    for (uint32_t s = 0; s < t->n_seq_max; s++) {
        uint32_t n = 0;
        bool marked = true, empty_none = true;
        for (uint32_t i = 0; i < t->size; i++) {
            if (!kvc_cells_seq_has(t, i, (int32_t)s)) {
                continue;
            }
            empty_none = empty_none && t->pos[i] != -1;
            marked = marked && ((kvc_cells_blk(t, (int32_t)s)[i >> 12] >> ((i >> 6) & 63)) & 1u);
            pos[n++] = t->pos[i];
        }
        CHECK(empty_none, "%s step %u: an empty cell holds sequence %u", what, step, s);
        CHECK(marked, "%s step %u: a cell of sequence %u in a block not marked", what, step, s);
        qsort(pos, n, sizeof *pos, cmp_i32);
        bool same = t->seq_pos[s].n == n;
        for (uint32_t k = 0; same && k < n; k++) {
            same = kvc_seq_key_pos(t->seq_pos[s].key[k]) == pos[k];
        }
        CHECK(same, "%s step %u: sequence %u has %u positions indexed, the cells %u", what, step, s,
              t->seq_pos[s].n, n);
        for (uint32_t k = 0; k < t->size; k++) {
            cells[k] = -1;
        }
        CHECK(kvc_cells_seq_cells(t, (int32_t)s, cells, cpos) == KVC_OK, "seq_cells");
        bool listed = true;
        for (uint32_t k = 0; listed && k < n; k++) {
            listed = cells[k] >= 0 && (uint32_t)cells[k] < t->size && kvc_cells_seq_has(t, (uint32_t)cells[k], (int32_t)s) && t->pos[cells[k]] == cpos[k] &&
                     cpos[k] == pos[k] && (k == 0 || cpos[k - 1] < cpos[k] || cells[k - 1] < cells[k]);
        }
        CHECK(listed, "%s step %u: seq_cells of sequence %u", what, step, s);
    }
    free(pos);
    free(cells);
    free(cpos);
}

static void check_cache(const kvc_unified *c, const char *what, uint32_t step) {
    for (uint32_t st = 0; st < c->n_stream; st++) {
        check_table(kvc_unified_stream_cells_c(c, st), what, step);
    }
}

/* A ubatch of n tokens of sequence s (one id each, or with a second sequence on every token)
 * at positions from p0. */
typedef struct ubuf {
    int32_t pos[64];
    uint32_t off[65];
    int32_t ids[128];
    kvc_ubatch ub;
} ubuf;

static const kvc_ubatch *make_ub(ubuf *u, uint32_t n, int32_t s, int32_t s2, int32_t p0) {
    return fixture_ub(&u->ub, u->pos, u->off, u->ids, n, p0, s, s2, 1);
}

/* The cells as they were at the last look, per stream, and the change log then. */
typedef struct seen {
    int32_t *pos;
    uint64_t *seq;
    uint64_t *epoch;
    uint32_t *chg_n;
} seen;

static void seen_take(seen *v, kvc_unified *c) {
    for (uint32_t st = 0; st < c->n_stream; st++) {
        kvc_cells *t = kvc_unified_stream_cells(c, st);
        kvc_cells_log_on(t);   /* this look keeps a place in the log */
        memcpy(v->pos + (size_t)st * t->size, t->pos, t->size * sizeof *t->pos);
        for (uint32_t w = 0; w < t->seq_words; w++) {
            for (uint32_t i = 0; i < t->size; i++) {
                v->seq[(size_t)st * t->size * t->seq_words + (size_t)w * t->size + i] = kvc_cells_seq_word(t, i, w);
            }
        }
        v->epoch[st] = t->chg_epoch;
        v->chg_n[st] = t->chg_n;
    }
}

/* Every cell that differs from the last look is in the log since then. */
static void check_log(const seen *v, const kvc_unified *c, const char *what, uint32_t step) {
    for (uint32_t st = 0; st < c->n_stream; st++) {
        const kvc_cells *t = kvc_unified_stream_cells_c(c, st);
        if (t->chg_epoch != v->epoch[st]) {
            continue;
        }
        bool logged = t->chg_n >= v->chg_n[st];
        for (uint32_t i = 0; logged && i < t->size; i++) {
            bool same = t->pos[i] == v->pos[(size_t)st * t->size + i];
            for (uint32_t w = 0; w < t->seq_words; w++) {
                same = same && kvc_cells_seq_word(t, i, w) ==
                               v->seq[(size_t)st * t->size * t->seq_words + (size_t)w * t->size + i];
            }
            if (same) {
                continue;
            }
            bool found = false;
            for (uint32_t k = v->chg_n[st]; k < t->chg_n && !found; k++) {
                found = t->chg[k] == i;
            }
            logged = found;
        }
        CHECK(logged, "%s step %u: a changed cell of stream %u is not in the change log", what, step, st);
    }
}

/* The mask of a decode-like ubatch (one token of each sequence in `which`, at the position
 * each goes on from, less a little) into the reused buffer, against a fresh one. */
static void check_mask(kvc_unified *c, const int32_t *next, uint64_t which, int dtype, bool pad, uint8_t *reused,
                       uint8_t *fresh, const char *what, uint32_t step) {
    ubuf u;
    uint32_t n = 0, k = 0;
    for (uint32_t s = 0; s < c->n_seq_max && s < 64; s++) {
        if (!((which >> s) & 1u)) {
            continue;
        }
        const int32_t back = (int32_t)check_rand(2);
        u.pos[n] = next[s] > back ? next[s] - back : 0;
        u.off[n] = k;
        u.ids[k++] = (int32_t)s;
        n++;
    }
    if (n == 0) {
        return;
    }
    u.off[n] = k;
    u.ub = (kvc_ubatch){ .n_tokens = n, .n_seq_tokens = 1, .n_seqs = n, .pos = u.pos, .seq_off = u.off,
                         .seq_ids = u.ids };
    const size_t el = dtype == KVC_MASK_F32 ? 4 : dtype == KVC_MASK_F16 ? 2 : 1;
    size_t bytes;
    kvc_err err;
    if (c->ops->semantics == KVC_SEM_2026) {
        uint32_t strm[KVC_MAX_SEQ], ng, nst;
        if (kvc_unified_groups(c, &u.ub, strm, &ng, &nst, &err) != KVC_OK) {
            return;
        }
        bytes = (size_t)n * kvc_unified_kq_mask_2026_n_kv(c, strm, ng) * el;
        CHECK(kvc_unified_kq_mask_2026_reuse(c, &u.ub, true, false, dtype, reused, true, &err) == KVC_OK, "mask");
        CHECK(kvc_unified_kq_mask_2026(c, &u.ub, true, false, dtype, fresh, &err) == KVC_OK, "mask");
    } else {
        bytes = (size_t)(pad ? kvc_pad_u32(n, KVC_KQ_MASK_PAD) : n) * c->n * el;
        CHECK(kvc_unified_kq_mask_reuse(c, &u.ub, true, false, dtype, pad, 0, reused, true) == KVC_OK, "mask");
        CHECK(kvc_unified_kq_mask(c, &u.ub, true, false, dtype, pad, 0, fresh) == KVC_OK, "mask");
    }
    CHECK(memcmp(reused, fresh, bytes) == 0, "%s step %u: the reused mask (%u tokens, dtype %d%s) differs from a "
          "fresh one", what, step, n, dtype, pad ? ", padded" : "");
}

static int32_t some_pos(uint32_t top) {
    return check_rand(8) == 0 ? -1 : (int32_t)check_rand(top + 1);
}

static void run(const setup *su, uint32_t steps) {
    const int32_t il[1] = { 0 };
    const uint32_t w[1] = { WIDTH };
    const kvc_unified_params p = {
        .kv_size = su->size, .semantics = su->semantics, .stream_per_seq = su->per_seq, .n_seq_max = su->n_seq,
        .n_pad = 1, .n_swa = su->n_swa, .swa_type = su->swa_type, .type_k = KVC_TYPE_F32, .type_v = KVC_TYPE_F32,
        .v_trans = false, .n_layer = 1, .layer_il = il, .n_embd_k = w, .n_embd_v = w,
    };
    const uint32_t n_stream = su->per_seq ? su->n_seq : 1;
    const size_t bytes = (size_t)n_stream * su->size * WIDTH * sizeof(float);
    float *k = malloc(bytes), *v = malloc(bytes);
    kvc_unified c;
    if (!k || !v || fixture_attach(&c, &p, k, bytes, v, bytes) != KVC_OK) {
        CHECK(false, "%s: cache", su->name);
        free(k);
        free(v);
        return;
    }
    int32_t *next = calloc(su->n_seq, sizeof *next);   /* where each sequence goes on */
    const uint32_t top = 3 * su->size;
    kvc_unified_mark mark;
    kvc_unified_mark_take(&c, &mark);
    seen was = {
        malloc((size_t)n_stream * su->size * sizeof *was.pos),
        malloc((size_t)n_stream * su->size * kvc_seq_words(su->n_seq) * sizeof *was.seq),
        malloc(n_stream * sizeof *was.epoch), malloc(n_stream * sizeof *was.chg_n),
    };
    const size_t mask_bytes = (size_t)(su->n_seq + 64) * su->size * sizeof(float);
    uint8_t *reused = calloc(mask_bytes, 1), *fresh = calloc(mask_bytes, 1);
    if (!was.pos || !was.seq || !was.epoch || !was.chg_n || !reused || !fresh) {
        CHECK(false, "out of memory");
        steps = 0;
    } else {
        seen_take(&was, &c);
    }
    uint64_t which = 1;
    int dtype = KVC_MASK_F32;
    bool pad = false;
    bool have_mark = su->semantics != KVC_SEM_2026;
    for (uint32_t step = 0; next && step < steps; step++) {
        const uint32_t op = check_rand(12);
        const int32_t s = (int32_t)check_rand(su->n_seq), s2 = (int32_t)check_rand(su->n_seq);
        ubuf u;
        kvc_err err;
        switch (op) {
        case 0: case 1: case 2: {
            /* a few tokens of a sequence (in 2025 sometimes shared with a second one) */
            const uint32_t n = 1 + check_rand(su->semantics == KVC_SEM_2026 ? 24 : 40);
            const int32_t other = su->semantics == KVC_SEM_2026 && su->per_seq ? -1 : (check_rand(4) ? -1 : s2);
            const kvc_ubatch *ub = make_ub(&u, n, s, other, next[s]);
            const int rc = su->semantics == KVC_SEM_2026 ? kvc_unified_find_slot_2026(&c, ub, &err)
                                                          : kvc_unified_find_slot(&c, ub);
            if (rc == 1) {
                next[s] += (int32_t)n;
                if (other >= 0 && next[other] < next[s]) {
                    next[other] = next[s];
                }
                if (su->semantics != KVC_SEM_2026) {
                    const uint32_t what = check_rand(4);
                    if (what == 0) {
                        kvc_unified_restore(&c);
                        kvc_unified_mark_take(&c, &mark);
                        have_mark = true;
                    } else if (what == 1 && have_mark) {
                        CHECK(kvc_unified_rewind(&c, &mark) == KVC_OK, "rewind");
                        kvc_unified_commit(&c);
                        kvc_unified_mark_take(&c, &mark);
                    } else if (what == 2) {
                        kvc_unified_commit(&c);
                        kvc_unified_mark_take(&c, &mark);
                    }
                }
            }
            break;
        }
        case 3: {
            const int32_t p0 = some_pos(top), p1 = some_pos(top), who = check_rand(6) == 0 ? -1 : s;
            const kvc_cells *t = kvc_unified_stream_cells_c(&c, kvc_unified_stream_of(&c, s));
            const kvc_pos_range r = kvc_pos_range_of(p0, p1);
            /* the blocks where s loses cells */
            uint8_t *lost = calloc(t->n_words + 1, 1);
            for (uint32_t i = 0; lost && i < t->size; i++) {
                if (kvc_cells_seq_has(t, i, s) && kvc_pos_range_has(r, t->pos[i])) {
                    lost[i >> 6] = 1;
                }
            }
            kvc_unified_seq_rm(&c, who, p0, p1);
            if (who >= 0 && lost) {
                /* removing through the index drops the bit of every block left without s */
                bool exact = true;
                for (uint32_t b = 0; b < t->n_words; b++) {
                    const bool marked = (kvc_cells_blk(t, s)[b >> 6] >> (b & 63)) & 1u;
                    exact = exact && (!lost[b] || !marked || kvc_cells_blk_cells(t, s, b) != 0);
                }
                CHECK(exact, "%s step %u: block bits of sequence %d after its seq_rm", su->name, step, s);
            }
            free(lost);
            break;
        }
        case 4: {
            int32_t p0 = some_pos(top), p1 = some_pos(top);
            if (kvc_unified_stream_of(&c, s) != kvc_unified_stream_of(&c, s2)) {
                p0 = p1 = -1;
            }
            if (kvc_unified_seq_cp_check(&c, s, s2, p0, p1, &err) == KVC_OK) {
                kvc_unified_seq_cp(&c, s, s2, p0, p1);
                if (next[s2] < next[s]) {
                    next[s2] = next[s];
                }
            }
            break;
        }
        case 5:
            if (check_rand(4) == 0) {
                kvc_unified_seq_keep(&c, s);
            }
            break;
        case 6: {
            const int32_t d = (int32_t)check_rand(41) - 20;
            kvc_unified_seq_add(&c, s, some_pos(top), some_pos(top), d);
            if (d > 0) {
                next[s] += d;
            }
            break;
        }
        case 7:
            kvc_unified_seq_div(&c, s, some_pos(top), some_pos(top), 1 + (int32_t)check_rand(3));
            break;
        case 8:
            if (su->semantics != KVC_SEM_2026 && kvc_unified_defrag_prepare(&c, 2048) == 1) {
                kvc_unified_defrag_move(&c);
            }
            break;
        case 9: {
            /* a whole-cache snapshot, some changes, the snapshot put back */
            kvc_unified_snapshot snap;
            if (kvc_unified_snapshot_take(&c, &snap) == KVC_OK) {
                kvc_unified_seq_rm(&c, s, -1, -1);
                kvc_unified_seq_add(&c, s2, -1, -1, 3);
                kvc_unified_snapshot_restore(&c, &snap);
                kvc_unified_snapshot_free(&snap);
            }
            break;
        }
        case 10:
            if (su->semantics == KVC_SEM_2026) {
                uint32_t copies = 0;
                kvc_unified_update_2026(&c, &copies, true);
            } else {
                kvc_unified_commit(&c);
                kvc_unified_mark_take(&c, &mark);
                have_mark = true;
            }
            break;
        default:
            if (check_rand(20) == 0) {
                kvc_unified_clear(&c);
                memset(next, 0, su->n_seq * sizeof *next);
                kvc_unified_commit(&c);
                kvc_unified_mark_take(&c, &mark);
                have_mark = su->semantics != KVC_SEM_2026;
            }
            break;
        }
        if (op >= 3 && op <= 9) {
            /* not a find_slot: a rewind to the mark is no longer allowed */
            have_mark = false;
        }
        check_cache(&c, su->name, step);
        check_log(&was, &c, su->name, step);
        seen_take(&was, &c);
        /* the mask's shape holds still for a while, as a server's does between steps */
        if (check_rand(16) == 0) {
            which = ((uint64_t)check_rand(1u << 16) << 16 | check_rand(1u << 16)) |
                    (uint64_t)check_rand(1u << 16) << 32;
            dtype = (int)check_rand(3);
            pad = check_rand(2);
        }
        if (check_rand(2) == 0) {
            check_mask(&c, next, which, dtype, pad, reused, fresh, su->name, step);
        }
    }
    free(was.pos);
    free(was.seq);
    free(was.epoch);
    free(was.chg_n);
    free(reused);
    free(fresh);
    free(next);
    kvc_unified_free(&c);
    free(k);
    free(v);
}

int main(void) {
    const setup setups[] = {
        { "2025, 200 cells, 3 seqs", 200, 3, 0, KVC_SEM_2025, KVC_SWA_NONE, false },
        { "2025, 200 cells, 70 seqs", 200, 70, 0, KVC_SEM_2025, KVC_SWA_NONE, false },
        { "2025, 4200 cells, 5 seqs", 4200, 5, 0, KVC_SEM_2025, KVC_SWA_NONE, false },
        { "2026, 200 cells, 3 seqs", 200, 3, 0, KVC_SEM_2026, KVC_SWA_NONE, false },
        { "2026, 200 cells, 3 seqs, swa 16", 200, 3, 16, KVC_SEM_2026, KVC_SWA_STANDARD, false },
        { "2026, 130 cells, a stream per seq", 130, 3, 0, KVC_SEM_2026, KVC_SWA_NONE, true },
        { "2026, 130 cells, a stream per seq, swa 8", 130, 3, 8, KVC_SEM_2026, KVC_SWA_STANDARD, true },
        { "2026, 4200 cells, 70 seqs", 4200, 70, 0, KVC_SEM_2026, KVC_SWA_NONE, false },
    };
    for (size_t k = 0; k < sizeof setups / sizeof setups[0]; k++) {
        run(&setups[k], setups[k].size > 1000 || setups[k].n_seq > 8 ? 400 : 3000);
    }
    printf("test_cells_index: %d checks, %d failed\n", n_checks, n_failed);
    return n_failed != 0;
}
