/* kvcache — defragmenting a unified cache (see kvc_defrag.h). */
#include "kvc_defrag.h"

#include "kvc_cols.h"
#include "kvc_types.h"

#include <string.h>

float kvc_unified_fragmentation(const kvc_unified *c) {
    if (c->n == 0) {
        return 0.0f;
    }
    /* the padding counts as used */
    const float frag = 1.0f - ((float)(c->cells.used + c->n_pad) / (float)c->n);
    return frag > 0.0f ? frag : 0.0f;
}

void kvc_unified_defrag_sched(kvc_unified *c, float thold) {
    /* small contexts count as not fragmented (a negative threshold still schedules one) */
    const float frag = c->n >= 2048 ? kvc_unified_fragmentation(c) : 0.0f;
    if (frag > thold) {
        c->do_defrag = true;
    }
}

/* Room in the plan's run list for one more run; false (the list is given up: the runs are then
 * read from defrag_ids) when there is no memory for it. */
static bool kvc_defrag_run_room(kvc_unified *c) {
    if (c->n_defrag_runs < c->cap_defrag_runs) {
        return true;
    }
    const uint32_t cap = c->cap_defrag_runs ? 2 * c->cap_defrag_runs : 64;
    uint32_t *r = kvc_realloc_n(c->defrag_run_list, (uint64_t)cap * 3, sizeof *r);
    if (!r) {
        return false;
    }
    c->defrag_run_list = r;
    c->cap_defrag_runs = cap;
    return true;
}

/* Reverse runs [a, b) of the list in place. */
static void kvc_defrag_runs_reverse(uint32_t *runs, uint32_t a, uint32_t b) {
    for (; a + 1 < b; a++, b--) {
        for (unsigned k = 0; k < 3; k++) {
            const uint32_t t = runs[3 * a + k];
            runs[3 * a + k] = runs[3 * (b - 1) + k];
            runs[3 * (b - 1) + k] = t;
        }
    }
}

/* llama.cpp's defrag plan: the cells move (metadata), defrag_ids says where from. 1 = something
 * moves, 0 = not.
 *
 * The seed walks the cells below the used count; each hole is filled with the last used cells of
 * the cache, taken from above a falling mark `top` (every cell at or above it is empty or already
 * moved), in ascending order, a run of contiguous sources counting as one move against the graph
 * budget. Here the walk goes from hole to hole and from source run to source run through the used
 * bits (the cells between are not read), and the runs go into the plan's run list as they are made:
 * a hole's sources lie below those of every earlier hole, so each hole's runs are put in
 * descending order and the whole list reversed at the end, which gives them in the order of their
 * sources, each a maximal run (two holes' runs never join: their destinations are apart). */
static int kvc_defrag_plan(kvc_unified *c, int32_t n_max_nodes) {
    kvc_cells *cells = &c->cells;
    const uint32_t n_layer = c->n_layer;
    const uint32_t n_kv = cells->used_max_p1;
    const uint32_t n_used = cells->used;
    uint32_t *ids = c->defrag_ids;
    /* each move costs 6 graph nodes per layer; unsigned arithmetic as the seed (a budget below
     * 2*n_layer wraps around to "unlimited") */
    const uint32_t max_moves = n_layer ? ((uint32_t)n_max_nodes - 2 * n_layer) / (6 * n_layer) : 0;
    uint32_t n_moves = 0;
    bool moved = false, listed = true;
    uint32_t top = n_kv;
    int rc = KVC_OK;

    for (uint32_t i = 0; i < n_kv; i++) {
        ids[i] = n_kv;
    }
    c->n_defrag_ids = n_kv;
    c->n_defrag_runs = 0;

    uint32_t i0 = 0;
    while (i0 < n_used) {
        /* the used cells up to the next hole stay */
        for (const uint32_t h = kvc_cells_next_empty(cells, i0, n_used); i0 < h; i0++) {
            ids[i0] = i0;
        }
        if (i0 == n_used) {
            break;
        }
        /* the hole [i0, i0 + nh), filled from the nh used cells just below top */
        const uint32_t nh = kvc_cells_next_used(cells, i0, n_used) - i0;
        const uint32_t is = kvc_cells_kth_used_back(cells, i0 + 1, top, nh);
        if (is == UINT32_MAX) {
            rc = KVC_E_INTERNAL; /* the used count disagrees with the cells */
            break;
        }
        const uint32_t top_was = top, first_run = c->n_defrag_runs;
        top = is;
        uint32_t nf = 0, i1 = is;
        bool stop = false;
        for (;;) {
            /* a run of contiguous sources: one move */
            uint32_t m = kvc_cells_next_empty(cells, i1, top_was) - i1;
            if (m > nh - nf) {
                m = nh - nf;
            }
            for (uint32_t j = 0; j < m; j++) {
                ids[i1 + j] = i0 + nf + j;
            }
            kvc_cells_mv_run(cells, i1, i0 + nf, m);
            if (listed && (listed = kvc_defrag_run_room(c))) {
                uint32_t *r = c->defrag_run_list + 3 * c->n_defrag_runs++;
                r[0] = i1;
                r[1] = i0 + nf;
                r[2] = m;
            }
            moved = true;
            n_moves++;
            nf += m;
            if (nf == nh) {
                break;
            }
            /* a gap before the next source: the budget is checked there */
            if (n_moves == max_moves) {
                stop = true;
                break;
            }
            i1 = kvc_cells_next_used(cells, i1 + m, top_was);
        }
        if (listed) {
            kvc_defrag_runs_reverse(c->defrag_run_list, first_run, c->n_defrag_runs);
        }
        if (stop || n_moves == max_moves) {
            break;
        }
        i0 += nh;
    }
    if (listed) {
        kvc_defrag_runs_reverse(c->defrag_run_list, 0, c->n_defrag_runs);
    } else {
        c->n_defrag_runs = KVC_RUNS_FROM_IDS;
    }
    if (moved) {
        c->head = n_used; /* where llama.cpp leaves it after a move */
    }
    return rc != KVC_OK ? rc : n_moves > 0;
}

/* The next run of the plan at or after *i: cells [src, src + nm) move to [dst, dst + nm).
 * Returns false when no move is left. */
static bool kvc_defrag_next_run(const uint32_t *ids, uint32_t n_ids, uint32_t *i, uint32_t *src,
                                uint32_t *dst, uint32_t *nm) {
    for (uint32_t k = *i; k < n_ids; k++) {
        const uint32_t id = ids[k];
        if (id == k || id == n_ids) {
            continue;
        }
        uint32_t m = 1;
        while (k + m < n_ids && ids[k + m] == id + m) {
            m++;
        }
        *src = k;
        *dst = id;
        *nm = m;
        *i = k + m;
        return true;
    }
    *i = n_ids;
    return false;
}

uint32_t kvc_unified_defrag_runs(const kvc_unified *c, uint32_t *runs) {
    if (c->n_defrag_ids == 0) {
        return 0;
    }
    if (c->n_defrag_runs != KVC_RUNS_FROM_IDS) {
        if (runs && c->n_defrag_runs) {
            memcpy(runs, c->defrag_run_list, (size_t)c->n_defrag_runs * 3 * sizeof *runs);
        }
        return c->n_defrag_runs;
    }
    uint32_t i = 0, src, dst, nm, n = 0;
    while (kvc_defrag_next_run(c->defrag_ids, c->n_defrag_ids, &i, &src, &dst, &nm)) {
        if (runs) {
            runs[3 * n] = src;
            runs[3 * n + 1] = dst;
            runs[3 * n + 2] = nm;
        }
        n++;
    }
    return n;
}

/* Whether no cell is both a source and a destination of the runs: the moves can then be
 * made in any order, layer by layer and without overlap. */
static bool kvc_runs_disjoint(const uint32_t *runs, uint32_t n_runs, uint32_t size) {
    uint64_t *dst = kvc_calloc(((size_t)size + 63) / 64, sizeof *dst);
    if (!dst) {
        return false;
    }
    for (uint32_t q = 0; q < n_runs; q++) {
        for (uint32_t m = 0; m < runs[3 * q + 2]; m++) {
            const uint32_t i = runs[3 * q + 1] + m;
            dst[i / 64] |= (uint64_t)1 << (i % 64);
        }
    }
    bool disjoint = true;
    for (uint32_t q = 0; q < n_runs && disjoint; q++) {
        for (uint32_t m = 0; m < runs[3 * q + 2]; m++) {
            const uint32_t i = runs[3 * q] + m;
            disjoint = disjoint && !(dst[i / 64] >> (i % 64) & 1u);
        }
    }
    kvc_free(dst);
    return disjoint;
}

/* The moves of layers [l0, l1) of a plan whose runs are independent. */
typedef struct kvc_move_job {
    const kvc_unified *c;
    uint32_t           l0, l1;
    const uint32_t    *runs;
    uint32_t           n_runs;
    const kvc_cols    *cols;    /* the moved cells as columns of a transposed V (2- or 4-byte
                                 * elements), NULL otherwise */
    bool               stream;
} kvc_move_job;

static void kvc_move_layers(void *arg) {
    const kvc_move_job *j = arg;
    const kvc_unified *c = j->c;
    const uint32_t *runs = j->runs;
    const uint32_t n_runs = j->n_runs;
    const bool stream = j->stream;
    const size_t size = c->cells.size;
    const size_t el = kvc_type_get(c->type_v)->type_size;
    for (uint32_t l = j->l0; l < j->l1; l++) {
        const kvc_layer *ly = &c->layers[l];
        for (uint32_t q = 0; ly->k && q < n_runs; q++) {
            const uint32_t *u = runs + 3 * q;
            kvc_copy(ly->k + u[1] * ly->k_row_bytes, ly->k + u[0] * ly->k_row_bytes, u[2] * ly->k_row_bytes, stream);
        }
        if (!ly->v) {
            continue;
        }
        if (!c->v_trans) {
            for (uint32_t q = 0; q < n_runs; q++) {
                const uint32_t *u = runs + 3 * q;
                kvc_copy(ly->v + u[1] * ly->v_row_bytes, ly->v + u[0] * ly->v_row_bytes, u[2] * ly->v_row_bytes, stream);
            }
        } else if (j->cols) {
            kvc_cols_apply(j->cols, ly->v, size * el, ly->n_embd_v);
        } else {
            for (uint32_t e = 0; e < ly->n_embd_v; e++) {
                uint8_t *row = ly->v + (size_t)e * size * el;
                for (uint32_t q = 0; q < n_runs; q++) {
                    const uint32_t *u = runs + 3 * q;
                    memcpy(row + (size_t)u[1] * el, row + (size_t)u[0] * el, u[2] * el);
                }
            }
        }
    }
    if (stream) {
        kvc_stream_fence();   /* this thread's non-temporal stores, before it reports done */
    }
}

/* Move the K/V rows of every layer with memory as the plan in defrag_ids says (contiguous runs at
 * once). */
static void kvc_defrag_apply(kvc_unified *c) {
    const size_t size = c->cells.size;
    const size_t el = kvc_type_get(c->type_v)->type_size;
    const uint32_t n_runs = kvc_unified_defrag_runs(c, NULL);
    uint32_t n_moved = 0;
    size_t row_bytes = 0; /* K and V rows of one cell over all layers (V: rows layout only) */
    for (uint32_t l = 0; l < c->n_layer; l++) {
        const kvc_layer *ly = &c->layers[l];
        row_bytes += (ly->k ? ly->k_row_bytes : 0) + (ly->v && !c->v_trans ? ly->v_row_bytes : 0);
    }
    /* a transposed V of 2- or 4-byte elements moves as columns (kvc_cols), from a pair list */
    const bool by_cols = c->v_trans && (el == 2 || el == 4);
    uint32_t *runs = NULL, *pairs = NULL;
    if (n_runs) {
        runs = kvc_malloc_n((uint64_t)n_runs * 3, sizeof *runs);
    }
    if (runs) {
        kvc_unified_defrag_runs(c, runs);
        for (uint32_t q = 0; q < n_runs; q++) {
            n_moved += runs[3 * q + 2];
        }
        if (by_cols) {
            pairs = kvc_malloc_n((uint64_t)n_moved * 2, sizeof *pairs);
        }
    }

    if (runs && (pairs || !by_cols) && kvc_runs_disjoint(runs, n_runs, c->cells.size)) {
        /* moves larger than the caches write their destinations straight to memory */
        const bool stream = (size_t)n_moved * row_bytes >= KVC_STREAM_BYTES;
        for (uint32_t q = 0, k = 0; pairs && q < n_runs; q++) {
            for (uint32_t m = 0; m < runs[3 * q + 2]; m++, k++) {
                pairs[2 * k] = runs[3 * q + 1] + m;
                pairs[2 * k + 1] = runs[3 * q] + m;
            }
        }
        /* layer by layer, so that each buffer is streamed through once; a large move is
         * shared among threads by layers (scattered copies are bound by how many reads are in
         * flight, and each core adds its own) */
        const unsigned width = c->n_threads ? c->n_threads : kvc_parallel_width();
        const unsigned n_jobs = stream ? kvc_min_u32(kvc_min_u32(width, KVC_MAX_THREADS), c->n_layer) : 1;
        kvc_cols cols;
        kvc_cols_init(&cols, pairs, by_cols ? n_moved : 0, c->cells.size, (uint32_t)el, c->vector_moves);
        kvc_move_job jobs[KVC_MAX_THREADS];
        for (unsigned t = 0; t < n_jobs; t++) {
            jobs[t] = (kvc_move_job){ c, (uint32_t)((uint64_t)c->n_layer * t / n_jobs),
                                      (uint32_t)((uint64_t)c->n_layer * (t + 1) / n_jobs),
                                      runs, n_runs, by_cols ? &cols : NULL, stream };
        }
        kvc_parallel(kvc_move_layers, jobs, sizeof jobs[0], n_jobs);
        kvc_cols_free(&cols);
    } else if (n_runs) {
        /* no memory for the run list (or a plan that refills cells it empties): the moves
         * one run at a time, in the order of their sources */
        uint32_t i = 0, src, dst, nm;
        while (kvc_defrag_next_run(c->defrag_ids, c->n_defrag_ids, &i, &src, &dst, &nm)) {
            for (uint32_t l = 0; l < c->n_layer; l++) {
                const kvc_layer *ly = &c->layers[l];
                if (ly->k) {
                    memmove(ly->k + dst * ly->k_row_bytes, ly->k + src * ly->k_row_bytes, nm * ly->k_row_bytes);
                }
                if (!ly->v) {
                    continue;
                }
                if (!c->v_trans) {
                    memmove(ly->v + dst * ly->v_row_bytes, ly->v + src * ly->v_row_bytes, nm * ly->v_row_bytes);
                } else {
                    for (uint32_t e = 0; e < ly->n_embd_v; e++) {
                        uint8_t *row = ly->v + (size_t)e * size * el;
                        memmove(row + (size_t)dst * el, row + (size_t)src * el, nm * el);
                    }
                }
            }
        }
    }
    kvc_free(pairs);
    kvc_free(runs);
}

void kvc_unified_defrag_settle_pending(kvc_unified *c) {
    if (kvc_unified_has_memory(c)) {
        kvc_defrag_apply(c);
    } else {
        c->n_defrag_ids = 0;   /* the owner of the memory had its chance to read the plan */
        c->n_defrag_runs = 0;
    }
    c->defrag_pending = false;
}

int kvc_unified_defrag_prepare(kvc_unified *c, int32_t n_max_nodes) {
    kvc_unified_defrag_settle(c);
    kvc_unified_slot_drop(c);
    const int r = kvc_defrag_plan(c, n_max_nodes);
    c->defrag_pending = r == 1;
    return r;
}

void kvc_unified_defrag_move(kvc_unified *c) {
    if (c->defrag_pending) {
        if (kvc_unified_has_memory(c)) {
            kvc_defrag_apply(c);
        }
        c->defrag_pending = false;
    }
    c->do_defrag = false;
}
