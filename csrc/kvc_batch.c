#include "kvc_batch.h"

#include <string.h>

/* ---------------------------------------------------------------------------------------------
 * Ordering.
 *
 * The token and group orders are not total: tokens with the same id list and position, or
 * groups with as many ids and the same length, compare equal, and their final order is whatever
 * the reference's sort leaves. That sort is the GNU C++ library's std::sort (introsort: median
 * of three quicksort down to runs of 16, heapsort past a depth limit, a final insertion sort),
 * so the same sequence of comparisons and moves is reproduced here over an array of indices.
 * ------------------------------------------------------------------------------------------- */

typedef bool (*kvc_before_fn)(uint32_t a, uint32_t b, const void *ctx);

enum { KVC_SORT_RUN = 16 };  /* runs this short are left to the final insertion sort */

static void swap_u32(uint32_t *x, uint32_t *y) {
    const uint32_t t = *x;
    *x = *y;
    *y = t;
}

/* Sift `value` up from `hole` towards `top` in the max-heap a[]. */
static void heap_sift_up(uint32_t *a, ptrdiff_t hole, ptrdiff_t top, uint32_t value,
                         kvc_before_fn before, const void *ctx) {
    ptrdiff_t parent = (hole - 1) / 2;
    while (hole > top && before(a[parent], value, ctx)) {
        a[hole] = a[parent];
        hole = parent;
        parent = (hole - 1) / 2;
    }
    a[hole] = value;
}

/* Move the hole at `hole` down to a leaf along the larger children, then sift `value` up. */
static void heap_adjust(uint32_t *a, ptrdiff_t hole, ptrdiff_t len, uint32_t value,
                        kvc_before_fn before, const void *ctx) {
    const ptrdiff_t top = hole;
    ptrdiff_t child = hole;
    while (child < (len - 1) / 2) {
        child = 2 * (child + 1);
        if (before(a[child], a[child - 1], ctx)) {
            child--;
        }
        a[hole] = a[child];
        hole = child;
    }
    if ((len & 1) == 0 && child == (len - 2) / 2) {
        child = 2 * (child + 1);
        a[hole] = a[child - 1];
        hole = child - 1;
    }
    heap_sift_up(a, hole, top, value, before, ctx);
}

static void heap_sort(uint32_t *a, ptrdiff_t n, kvc_before_fn before, const void *ctx) {
    if (n < 2) {
        return;
    }
    for (ptrdiff_t parent = (n - 2) / 2;; parent--) {
        heap_adjust(a, parent, n, a[parent], before, ctx);
        if (parent == 0) {
            break;
        }
    }
    for (ptrdiff_t last = n - 1; last > 0; last--) {
        const uint32_t value = a[last];
        a[last] = a[0];
        heap_adjust(a, 0, last, value, before, ctx);
    }
}

/* Put the median of a[x], a[y], a[z] into a[dst]. */
static void median_to(uint32_t *a, ptrdiff_t dst, ptrdiff_t x, ptrdiff_t y, ptrdiff_t z,
                      kvc_before_fn before, const void *ctx) {
    ptrdiff_t m;
    if (before(a[x], a[y], ctx)) {
        if (before(a[y], a[z], ctx)) {
            m = y;
        } else if (before(a[x], a[z], ctx)) {
            m = z;
        } else {
            m = x;
        }
    } else if (before(a[x], a[z], ctx)) {
        m = x;
    } else if (before(a[y], a[z], ctx)) {
        m = z;
    } else {
        m = y;
    }
    swap_u32(&a[dst], &a[m]);
}

/* Partition a[lo, hi) around the pivot a[pivot] (outside the range, which has sentinels on
 * both sides); returns the first index of the upper part. */
static ptrdiff_t partition_around(uint32_t *a, ptrdiff_t lo, ptrdiff_t hi, ptrdiff_t pivot,
                                  kvc_before_fn before, const void *ctx) {
    for (;;) {
        while (before(a[lo], a[pivot], ctx)) {
            lo++;
        }
        hi--;
        while (before(a[pivot], a[hi], ctx)) {
            hi--;
        }
        if (lo >= hi) {
            return lo;
        }
        swap_u32(&a[lo], &a[hi]);
        lo++;
    }
}

static void introsort_loop(uint32_t *a, ptrdiff_t lo, ptrdiff_t hi, int depth,
                           kvc_before_fn before, const void *ctx) {
    while (hi - lo > KVC_SORT_RUN) {
        if (depth == 0) {
            heap_sort(a + lo, hi - lo, before, ctx);
            return;
        }
        depth--;
        median_to(a, lo, lo + 1, lo + (hi - lo) / 2, hi - 1, before, ctx);
        const ptrdiff_t cut = partition_around(a, lo + 1, hi, lo, before, ctx);
        introsort_loop(a, cut, hi, depth, before, ctx);
        hi = cut;
    }
}

/* Insert a[i] into the sorted a[.., i); something not after it lies before the range. */
static void insert_unguarded(uint32_t *a, ptrdiff_t i, kvc_before_fn before, const void *ctx) {
    const uint32_t value = a[i];
    while (before(value, a[i - 1], ctx)) {
        a[i] = a[i - 1];
        i--;
    }
    a[i] = value;
}

static void insertion_sort(uint32_t *a, ptrdiff_t n, kvc_before_fn before, const void *ctx) {
    for (ptrdiff_t i = 1; i < n; i++) {
        if (before(a[i], a[0], ctx)) {
            const uint32_t value = a[i];
            memmove(a + 1, a, (size_t)i * sizeof *a);
            a[0] = value;
        } else {
            insert_unguarded(a, i, before, ctx);
        }
    }
}

static int floor_log2(size_t n) {
    int r = 0;
    while (n >>= 1) {
        r++;
    }
    return r;
}

/* Sort a[0, n) by `before`, leaving equal elements where the reference's sort leaves them. */
static void sort_like_reference(uint32_t *a, size_t n, kvc_before_fn before, const void *ctx) {
    if (n < 2) {
        return;
    }
    introsort_loop(a, 0, (ptrdiff_t)n, 2 * floor_log2(n), before, ctx);
    if (n > KVC_SORT_RUN) {
        insertion_sort(a, KVC_SORT_RUN, before, ctx);
        for (ptrdiff_t i = KVC_SORT_RUN; i < (ptrdiff_t)n; i++) {
            insert_unguarded(a, i, before, ctx);
        }
    } else {
        insertion_sort(a, (ptrdiff_t)n, before, ctx);
    }
}

/* Tokens: more sequence ids first, then the id lists element by element, then position. */
static bool token_before(uint32_t a, uint32_t b, const void *ctx) {
    const kvc_sbatch *sb = (const kvc_sbatch *)ctx;
    const uint32_t na = sb->seq_off[a + 1] - sb->seq_off[a];
    const uint32_t nb = sb->seq_off[b + 1] - sb->seq_off[b];
    if (na != nb) {
        return na > nb;
    }
    const int32_t *ia = sb->seq_ids + sb->seq_off[a];
    const int32_t *ib = sb->seq_ids + sb->seq_off[b];
    for (uint32_t i = 0; i < na; i++) {
        if (ia[i] != ib[i]) {
            return ia[i] < ib[i];
        }
    }
    return sb->pos[a] < sb->pos[b];
}

/* Groups: fewer sequence ids first (shared groups end up last, where splits take from), then
 * longer groups first. */
static bool group_before(uint32_t a, uint32_t b, const void *ctx) {
    const kvc_sbatch_group *g = (const kvc_sbatch_group *)ctx;
    if (g[a].n_seq_id != g[b].n_seq_id) {
        return g[a].n_seq_id < g[b].n_seq_id;
    }
    return g[a].length > g[b].length;
}

/* ---------------------------------------------------------------------------------------------
 * Construction.
 * ------------------------------------------------------------------------------------------- */

static bool same_ids(const kvc_sbatch *sb, uint32_t a, uint32_t b) {
    const uint32_t na = sb->seq_off[a + 1] - sb->seq_off[a];
    if (na != sb->seq_off[b + 1] - sb->seq_off[b]) {
        return false;
    }
    return memcmp(sb->seq_ids + sb->seq_off[a], sb->seq_ids + sb->seq_off[b], (size_t)na * sizeof(int32_t)) == 0;
}


/* Group the sorted tokens into runs with equal id lists and order the runs. */
static int build_groups(kvc_sbatch *sb, kvc_err *err) {
    const uint32_t n = sb->n_tokens;
    uint32_t n_groups = 0;
    for (uint32_t i = 0; i < n; i++) {
        if (i == 0 || !same_ids(sb, sb->order[i - 1], sb->order[i])) {
            n_groups++;
        }
    }
    kvc_sbatch_group *runs = kvc_malloc_n(n_groups, sizeof *runs);
    uint32_t *rank = kvc_malloc_n(n_groups, sizeof *rank);
    sb->groups = kvc_malloc_n(n_groups, sizeof *sb->groups);
    if (!runs || !rank || !sb->groups) {
        kvc_free(runs);
        kvc_free(rank);
        return kvc_err_set(err, KVC_E_NOMEM, "batch: out of memory for %u token groups", n_groups);
    }
    uint32_t g = 0;
    for (uint32_t i = 0; i < n; i++) {
        const uint32_t t = sb->order[i];
        if (i > 0 && same_ids(sb, runs[g - 1].token, t)) {
            runs[g - 1].length++;
            continue;
        }
        runs[g].n_seq_id = sb->seq_off[t + 1] - sb->seq_off[t];
        runs[g].token = t;
        runs[g].offset = i;
        runs[g].length = 1;
        rank[g] = g;
        g++;
    }
    sort_like_reference(rank, n_groups, group_before, runs);
    for (uint32_t i = 0; i < n_groups; i++) {
        sb->groups[i] = runs[rank[i]];
    }
    sb->n_groups = n_groups;
    kvc_free(runs);
    kvc_free(rank);
    return KVC_OK;
}

static int check_batch(uint32_t n_tokens, const int32_t *pos, const uint32_t *seq_off,
                       const int32_t *seq_ids, kvc_err *err) {
    if (n_tokens == UINT32_MAX) {
        return kvc_err_set(err, KVC_E_ARG, "batch: too many tokens (%u)", n_tokens);
    }
    if (n_tokens > 0 && (!pos || !seq_off || !seq_ids)) {
        return kvc_err_set(err, KVC_E_ARG, "batch: missing pos, seq_off or seq_ids");
    }
    if (seq_off && seq_off[0] != 0) {
        return kvc_err_set(err, KVC_E_ARG, "batch: seq_off[0] must be 0, got %u", seq_off[0]);
    }
    for (uint32_t t = 0; t < n_tokens; t++) {
        if (pos[t] < 0) {
            return kvc_err_set(err, KVC_E_ARG, "batch: pos[%u] = %d is negative", t, pos[t]);
        }
        if (seq_off[t + 1] <= seq_off[t]) {
            return kvc_err_set(err, KVC_E_ARG, "batch: token %u has no sequence id", t);
        }
        for (uint32_t j = seq_off[t]; j < seq_off[t + 1]; j++) {
            if (seq_ids[j] < 0 || seq_ids[j] >= KVC_MAX_SEQ) {
                return kvc_err_set(err, KVC_E_ARG, "batch: seq_id %d of token %u is outside [0, %d)",
                                   seq_ids[j], t, KVC_MAX_SEQ);
            }
        }
    }
    return KVC_OK;
}

int kvc_sbatch_init(kvc_sbatch *sb, uint32_t n_tokens, const int32_t *pos, const uint32_t *seq_off,
                    const int32_t *seq_ids, const int8_t *logits, bool logits_all, bool simple_split,
                    kvc_err *err) {
    memset(sb, 0, sizeof *sb);
    int rc = check_batch(n_tokens, pos, seq_off, seq_ids, err);
    if (rc != KVC_OK) {
        return rc;
    }
    const size_t n = n_tokens;
    const size_t n_ids = n ? seq_off[n] : 0;
    sb->n_tokens = n_tokens;
    sb->n_left = n_tokens;
    sb->simple_split = simple_split;
    sb->logits_all = logits_all;
    sb->pos = kvc_malloc_n(n, sizeof *sb->pos);
    sb->seq_off = kvc_malloc_n(n + 1, sizeof *sb->seq_off);
    sb->seq_ids = kvc_malloc_n(n_ids, sizeof *sb->seq_ids);
    sb->logits = logits ? kvc_malloc_n(n, sizeof *sb->logits) : NULL;
    sb->order = kvc_malloc_n(n, sizeof *sb->order);
    sb->out_ids = kvc_malloc_n(n, sizeof *sb->out_ids);
    sb->ub_token = kvc_malloc_n(n, sizeof *sb->ub_token);
    sb->ub_pos = kvc_malloc_n(n, sizeof *sb->ub_pos);
    sb->ub_seq_off = kvc_malloc_n(n + 1, sizeof *sb->ub_seq_off);
    sb->ub_seq_ids = kvc_malloc_n(n_ids, sizeof *sb->ub_seq_ids);
    sb->ub_output = kvc_malloc_n(n, sizeof *sb->ub_output);
    if (!sb->pos || !sb->seq_off || !sb->seq_ids || (logits && !sb->logits) || !sb->order || !sb->out_ids ||
        !sb->ub_token || !sb->ub_pos || !sb->ub_seq_off || !sb->ub_seq_ids || !sb->ub_output) {
        kvc_sbatch_free(sb);
        return kvc_err_set(err, KVC_E_NOMEM, "batch: out of memory for %u tokens", n_tokens);
    }
    if (n) {
        memcpy(sb->pos, pos, n * sizeof *pos);
        memcpy(sb->seq_off, seq_off, (n + 1) * sizeof *seq_off);
        memcpy(sb->seq_ids, seq_ids, n_ids * sizeof *seq_ids);
        if (logits) {
            memcpy(sb->logits, logits, n * sizeof *logits);
        }
    } else {
        sb->seq_off[0] = 0;
    }
    for (uint32_t i = 0; i < n_tokens; i++) {
        sb->order[i] = i;
    }

    if (simple_split) {
        sb->groups = kvc_malloc_n(1, sizeof *sb->groups);
        if (!sb->groups) {
            kvc_sbatch_free(sb);
            return kvc_err_set(err, KVC_E_NOMEM, "batch: out of memory");
        }
        sb->groups[0].n_seq_id = 0;
        sb->groups[0].token = 0;
        sb->groups[0].offset = 0;
        sb->groups[0].length = n_tokens;
        sb->n_groups = 1;
        return KVC_OK;
    }

    sort_like_reference(sb->order, n, token_before, sb);
    rc = build_groups(sb, err);
    if (rc != KVC_OK) {
        kvc_sbatch_free(sb);
    }
    return rc;
}

void kvc_sbatch_free(kvc_sbatch *sb) {
    kvc_free(sb->pos);
    kvc_free(sb->seq_off);
    kvc_free(sb->seq_ids);
    kvc_free(sb->logits);
    kvc_free(sb->order);
    kvc_free(sb->groups);
    kvc_free(sb->out_ids);
    kvc_free(sb->ub_token);
    kvc_free(sb->ub_pos);
    kvc_free(sb->ub_seq_off);
    kvc_free(sb->ub_seq_ids);
    kvc_free(sb->ub_output);
    memset(sb, 0, sizeof *sb);
}

/* ---------------------------------------------------------------------------------------------
 * Splitting.
 * ------------------------------------------------------------------------------------------- */

/* The ubatch being filled: counters over the splitter's ub_* buffers. */
typedef struct ubatch_fill {
    bool     equal_seqs;
    uint32_t n_tokens;
    uint32_t n_seq_tokens;
    uint32_t n_seqs;
    uint32_t n_ids;
} ubatch_fill;

/* Append token t's (or a group's) id list as the next group of the ubatch. */
static void fill_ids(kvc_sbatch *sb, ubatch_fill *f, uint32_t t) {
    for (uint32_t j = sb->seq_off[t]; j < sb->seq_off[t + 1]; j++) {
        sb->ub_seq_ids[f->n_ids++] = sb->seq_ids[j];
    }
    f->n_seqs++;
    sb->ub_seq_off[f->n_seqs] = f->n_ids;
}

/* Move the next `length` tokens of group g into the ubatch (as one group for an equal split,
 * as one group per token for a simple split) and record their outputs. */
static void take(kvc_sbatch *sb, ubatch_fill *f, kvc_sbatch_group *g, uint32_t length) {
    if (f->n_tokens == 0 && f->n_seqs == 0) {
        f->n_seq_tokens = f->equal_seqs ? length : 1;
    }
    if (f->equal_seqs) {
        fill_ids(sb, f, g->token);
    }
    for (uint32_t i = 0; i < length; i++) {
        const uint32_t t = sb->order[g->offset + i];
        const uint32_t k = f->n_tokens + i;
        int8_t out;
        if (sb->logits_all) {
            out = 1;
        } else if (sb->logits) {
            out = sb->logits[t];
        } else {
            out = t == sb->n_tokens - 1;
        }
        sb->ub_token[k] = t;
        sb->ub_pos[k] = sb->pos[t];
        sb->ub_output[k] = out;
        if (out) {
            sb->out_ids[sb->n_out++] = t;
        }
        if (!f->equal_seqs) {
            fill_ids(sb, f, t);
        }
    }
    f->n_tokens += length;
    g->offset += length;
    g->length -= length;
    sb->n_left -= length;
}

static void publish(const kvc_sbatch *sb, const ubatch_fill *f, kvc_sbatch_ubatch *out) {
    out->ub.n_tokens = f->n_tokens;
    out->ub.n_seq_tokens = f->n_seq_tokens;
    out->ub.n_seqs = f->n_seqs;
    out->ub.pos = sb->ub_pos;
    out->ub.seq_off = sb->ub_seq_off;
    out->ub.seq_ids = sb->ub_seq_ids;
    out->ub.pos_x = out->ub.pos_y = out->ub.token = NULL;
    out->token = sb->ub_token;
    out->output = sb->ub_output;
    out->equal_seqs = f->equal_seqs;
}

static uint32_t min_u32(uint32_t a, uint32_t b) { return a < b ? a : b; }

int kvc_sbatch_split(kvc_sbatch *sb, enum kvc_split_mode mode, uint32_t n_ubatch,
                     kvc_sbatch_ubatch *out, kvc_err *err) {
    if (mode != KVC_SPLIT_SIMPLE && mode != KVC_SPLIT_EQUAL && mode != KVC_SPLIT_SEQ) {
        return kvc_err_set(err, KVC_E_ARG, "batch: unknown split mode %d", (int)mode);
    }
    if (n_ubatch == 0) {
        return kvc_err_set(err, KVC_E_ARG, "batch: n_ubatch must be at least 1");
    }
    if ((mode == KVC_SPLIT_SIMPLE) != sb->simple_split) {
        return kvc_err_set(err, KVC_E_ARG, mode == KVC_SPLIT_SIMPLE
                           ? "batch: split_simple needs a batch built with simple_split=True"
                           : "batch: split_equal / split_seq need a batch built with simple_split=False");
    }
    /* Groups emptied by earlier ubatches are dropped from the end only: which group is last
     * decides what the next split takes. */
    while (sb->n_groups > 0 && sb->groups[sb->n_groups - 1].length == 0) {
        sb->n_groups--;
    }
    ubatch_fill f = {mode != KVC_SPLIT_SIMPLE, 0, 0, 0, 0};
    sb->ub_seq_off[0] = 0;
    n_ubatch = min_u32(n_ubatch, sb->n_left);

    if (sb->n_groups > 0 && n_ubatch > 0) {
        if (mode == KVC_SPLIT_SIMPLE) {
            kvc_sbatch_group *g = &sb->groups[0];
            take(sb, &f, g, min_u32(g->length, n_ubatch));
        } else if (mode == KVC_SPLIT_SEQ) {
            kvc_sbatch_group *g = &sb->groups[sb->n_groups - 1];
            take(sb, &f, g, min_u32(g->length, n_ubatch));
        } else {
            /* The last group is the shortest of its kind: its length (capped) becomes the
             * length of every group in this ubatch. Count the groups first so that nothing
             * changes if the ordering invariant were ever broken. */
            const uint32_t last = sb->n_groups - 1;
            const uint32_t length = min_u32(sb->groups[last].length, n_ubatch);
            uint32_t count = 0;
            uint64_t total = 0;
            for (uint32_t i = sb->n_groups; i-- > 0;) {
                const kvc_sbatch_group *g = &sb->groups[i];
                if (g->length < length) {
                    return kvc_err_set(err, KVC_E_INTERNAL, "batch: group %u is shorter than %u", i, length);
                }
                count++;
                total += length;
                /* a shared group is not mixed with the sequences it contains */
                if (g->n_seq_id > 1) {
                    break;
                }
                /* stop when another group of this length would not fit */
                if (length + total > n_ubatch) {
                    break;
                }
            }
            for (uint32_t k = 0; k < count; k++) {
                take(sb, &f, &sb->groups[last - k], length);
            }
        }
    }
    publish(sb, &f, out);
    return f.n_tokens > 0 ? 1 : 0;
}
