/* The prefix index (kvc_prefix.h): inserts, matches and splits; salts; the caller's duplicates
 * and bad cells (refused, nothing changed); locks and pins against eviction; the LRU order
 * (leaves before parents, the least recently used first); the cap; removal of cells the cache
 * let go; write-back at eviction (the evicted prompts recorded); clear; allocation failures at every point of an insert (nothing changed); a random
 * run against a naive model that knows only which prompts went in and which cells came out;
 * and a match of a 4096-token prompt in an index of 1M tokens (464 prompts), timed against a scan of the
 * prompts (printed, not asserted). kvc_prefix_check after every step. */
#define _POSIX_C_SOURCE 199309L   /* clock_gettime */
#include "kvc_prefix.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "check.h"

#define CHECKED(idx)                                                                \
    do {                                                                            \
        kvc_err err_ = { 0, "" };                                                   \
        CHECK(kvc_prefix_check((idx), &err_) == KVC_OK, "invariant: %s", err_.msg); \
    } while (0)

/* Insert tokens[0, n) with cells c0, c0 + 1, ... of stream s; the result's status. */
static int put(kvc_prefix *idx, uint64_t salt, const int32_t *tokens, uint32_t n, uint32_t c0, uint32_t s,
               kvc_prefix_inserted *res) {
    uint32_t cells[64], streams[64], dc[64], ds[64];
    for (uint32_t i = 0; i < n; i++) {
        cells[i] = c0 + i;
        streams[i] = s;
    }
    kvc_prefix_inserted r;
    const int rc = kvc_prefix_insert(idx, salt, tokens, cells, streams, n, dc, ds, res ? res : &r, NULL);
    CHECKED(idx);
    return rc;
}

static uint32_t find(kvc_prefix *idx, uint64_t salt, const int32_t *tokens, uint32_t n, uint32_t *cells,
                     kvc_prefix_handle *h) {
    uint32_t streams[64];
    const uint32_t m = kvc_prefix_match(idx, salt, tokens, n, n, cells, streams, h);
    CHECKED(idx);
    return m;
}

/* The freed list as "c c c" (streams left out). */
static const char *freed_str(const kvc_prefix *idx) {
    static char buf[1024];
    const uint32_t *c;
    const uint32_t n = kvc_prefix_freed(idx, &c, NULL);
    size_t o = 0;
    buf[0] = 0;
    for (uint32_t i = 0; i < n && o < sizeof buf - 16; i++) {
        o += (size_t)snprintf(buf + o, sizeof buf - o, i ? " %u" : "%u", c[i]);
    }
    return buf;
}

static void test_insert_match_split(void) {
    kvc_prefix idx;
    REQUIRE(kvc_prefix_init(&idx, 1, 1024, 0, NULL) == KVC_OK, "init");
    const int32_t a[] = { 1, 2, 3, 4, 5 }, b[] = { 1, 2, 3, 7, 8 }, q[] = { 1, 2, 3, 9 };
    kvc_prefix_inserted r;
    CHECK(put(&idx, 0, a, 5, 10, 0, &r) == KVC_OK && r.n_present == 0 && r.n_added == 5, "first insert");
    CHECK(kvc_prefix_n_held(&idx) == 5 && kvc_prefix_n_nodes(&idx) == 1, "one edge of 5");
    uint32_t cells[64];
    kvc_prefix_handle h;
    CHECK(find(&idx, 0, q, 4, cells, &h) == 3 && cells[0] == 10 && cells[2] == 12, "the match stops inside the edge");
    CHECK(kvc_prefix_handle_valid(&idx, h), "a handle to the edge");
    CHECK(put(&idx, 0, b, 5, 20, 0, &r) == KVC_OK && r.n_present == 3 && r.n_added == 2 && r.n_dup == 3,
          "the second shares 3: present %u added %u dup %u", r.n_present, r.n_added, r.n_dup);
    CHECK(kvc_prefix_n_held(&idx) == 7 && kvc_prefix_n_nodes(&idx) == 3, "split: [1 2 3] -> [4 5], [7 8]");
    CHECK(kvc_prefix_handle_valid(&idx, h), "the split keeps the handle (the lower part)");
    CHECK(find(&idx, 0, b, 5, cells, NULL) == 5 && cells[0] == 10 && cells[3] == 23 && cells[4] == 24,
          "the second's cells: the index's for the shared part");
    CHECK(kvc_prefix_match(&idx, 0, b, 5, 4, cells, NULL, NULL) == 4, "max_len caps the match");
    CHECK(kvc_prefix_match(&idx, 0, b, 5, 0, cells, NULL, &h) == 0 && h.node == 0, "max_len 0: nothing, no node");
    CHECK(find(&idx, 0, a, 2, cells, NULL) == 2, "a shorter prompt");
    const int32_t other[] = { 9, 9 };
    CHECK(find(&idx, 0, other, 2, cells, &h) == 0 && !kvc_prefix_handle_valid(&idx, h), "no match");
    /* a prompt inside an edge: all present, nothing new, no split */
    CHECK(put(&idx, 0, a, 2, 10, 0, &r) == KVC_OK && r.n_present == 2 && r.n_added == 0 && r.n_dup == 0,
          "a held prefix with its own cells");
    CHECK(kvc_prefix_n_nodes(&idx) == 3, "no split for a prefix already held");
    CHECK(put(&idx, 0, a, 0, 0, 0, &r) == KVC_OK && r.end.node == 0, "an empty insert");
    /* a long chain of splits: each insert diverges one token further down */
    int32_t t[40];
    for (uint32_t i = 0; i < 40; i++) {
        t[i] = 100 + (int32_t)i;
    }
    CHECK(put(&idx, 5, t, 40, 30, 0, NULL) == KVC_OK, "a 40-token prompt");
    for (uint32_t d = 1; d < 10; d++) {   /* the caller's cells for the present tokens: duplicates */
        int32_t u[40];
        memcpy(u, t, sizeof u);
        u[d * 4] = -1;
        CHECK(put(&idx, 5, u, d * 4 + 1, 100 + 50 * d, 0, &r) == KVC_OK && r.n_present == d * 4 && r.n_added == 1 &&
                  r.n_dup == d * 4,
              "diverging at %u", d * 4);
    }
    CHECK(kvc_prefix_n_nodes(&idx) == 3 + 1 + 9 + 9, "9 splits, 9 leaves: %u", kvc_prefix_n_nodes(&idx));
    CHECK(find(&idx, 5, t, 40, cells, NULL) == 40 && cells[0] == 30 && cells[39] == 69, "the chain still matches whole");
    kvc_prefix_free(&idx);
}

/* An insert resumed where the caller knows the prompt runs (kvc_prefix_insert_upto_from): inside
 * an edge, at its end; the tokens before the resumed point are not read; bad resume points. */
static void test_insert_upto_from(void) {
    kvc_prefix idx;
    REQUIRE(kvc_prefix_init(&idx, 1, 1024, 0, NULL) == KVC_OK, "init");
    const int32_t a[] = { 1, 2, 3, 4, 5 };
    kvc_prefix_inserted r;
    CHECK(put(&idx, 0, a, 5, 10, 0, NULL) == KVC_OK, "a prompt of 5");
    kvc_prefix_handle h;
    uint32_t cells[64], streams[64], dc[64], ds[64];
    CHECK(kvc_prefix_match(&idx, 0, a, 5, 3, NULL, NULL, &h) == 3, "the first 3");
    /* inside the edge: 3 known, 2 more present, 2 new; the known ones unread (-7) */
    const int32_t longer[] = { -7, -7, -7, 4, 5, 6, 7 };
    for (uint32_t i = 0; i < 7; i++) {
        cells[i] = i < 3 ? 999 : 10 + i;
        streams[i] = 0;
    }
    CHECK(kvc_prefix_insert_upto_from(&idx, h, 3, longer, cells, streams, 7, dc, ds, &r, NULL) == KVC_OK &&
              r.n_present == 5 && r.n_added == 2 && r.n_dup == 0,
          "resumed inside the edge: present %u added %u dup %u", r.n_present, r.n_added, r.n_dup);
    CHECKED(&idx);
    const int32_t full[] = { 1, 2, 3, 4, 5, 6, 7 };
    uint32_t got[64];
    CHECK(find(&idx, 0, full, 7, got, &h) == 7 && got[0] == 10 && got[6] == 16, "the prompt of 7 held");
    /* at the end of an edge, diverging below it: a new leaf */
    kvc_prefix_handle h5;
    CHECK(kvc_prefix_match(&idx, 0, full, 7, 5, NULL, NULL, &h5) == 5, "the first 5");
    const uint32_t off5 = 5 - idx.nodes[h5.node].depth;
    const int32_t fork[] = { 0, 0, 0, 0, 0, 8, 9 };
    for (uint32_t i = 5; i < 7; i++) {
        cells[i] = 30 + i;
    }
    CHECK(kvc_prefix_insert_upto_from(&idx, h5, off5, fork, cells, streams, 7, dc, ds, &r, NULL) == KVC_OK &&
              r.n_present == 5 && r.n_added == 2,
          "resumed at 5: present %u added %u", r.n_present, r.n_added);
    CHECKED(&idx);
    const int32_t fork_full[] = { 1, 2, 3, 4, 5, 8, 9 };
    CHECK(find(&idx, 0, fork_full, 7, got, NULL) == 7 && got[5] == 35 && got[6] == 36, "the fork held");
    /* a cell held for another token past the resumed point ends what is kept */
    cells[5] = 16;   /* token 7's cell */
    CHECK(kvc_prefix_insert_upto_from(&idx, h5, off5, fork, cells, streams, 7, dc, ds, &r, NULL) == KVC_OK &&
              r.n_present + r.n_added == 5,
          "kept up to the held cell: %u", r.n_present + r.n_added);
    /* bad resume points change nothing */
    const uint32_t held = kvc_prefix_n_held(&idx);
    CHECK(kvc_prefix_insert_upto_from(&idx, h5, 0, fork, cells, streams, 7, dc, ds, &r, NULL) == KVC_E_ARG, "off 0");
    CHECK(kvc_prefix_insert_upto_from(&idx, h5, idx.nodes[h5.node].len + 1, fork, cells, streams, 7, dc, ds, &r,
                                      NULL) == KVC_E_ARG,
          "off past the edge");
    CHECK(kvc_prefix_insert_upto_from(&idx, h5, off5, fork, cells, streams, 4, dc, ds, &r, NULL) == KVC_E_ARG,
          "n short of the resumed point");
    CHECK(kvc_prefix_insert_upto_from(&idx, (kvc_prefix_handle){ 0, 0 }, 1, fork, cells, streams, 7, dc, ds, &r,
                                      NULL) == KVC_E_ARG,
          "no node");
    kvc_prefix_clear(&idx);
    CHECK(kvc_prefix_insert_upto_from(&idx, h5, off5, fork, cells, streams, 7, dc, ds, &r, NULL) == KVC_E_ARG,
          "a stale handle");
    CHECK(kvc_prefix_n_held(&idx) == 0 && held > 0, "nothing changed by the refusals");
    CHECKED(&idx);
    kvc_prefix_free(&idx);
}

static void test_salts(void) {
    kvc_prefix idx;
    REQUIRE(kvc_prefix_init(&idx, 2, 32, 0, NULL) == KVC_OK, "init");
    const int32_t a[] = { 1, 2, 3 };
    uint32_t cells[8];
    CHECK(put(&idx, 0, a, 3, 0, 0, NULL) == KVC_OK && put(&idx, 42, a, 3, 0, 1, NULL) == KVC_OK,
          "the same tokens under two salts, cells in two streams");
    CHECK(kvc_prefix_n_nodes(&idx) == 2 && kvc_prefix_n_held(&idx) == 6, "nothing shared");
    uint32_t streams[8];
    CHECK(kvc_prefix_match(&idx, 42, a, 3, 3, cells, streams, NULL) == 3 && streams[0] == 1, "salt 42's cells");
    CHECK(kvc_prefix_match(&idx, 0, a, 3, 3, cells, streams, NULL) == 3 && streams[0] == 0, "salt 0's cells");
    CHECK(kvc_prefix_match(&idx, UINT64_MAX, a, 3, 3, cells, streams, NULL) == 0, "an unknown salt");
    CHECK(kvc_prefix_evict(&idx, 100) == 6 && kvc_prefix_n_held(&idx) == 0, "everything evicts, roots too");
    CHECKED(&idx);
    kvc_prefix_free(&idx);
}

/* Everything observable of the index: counters, each live node, the LRU order. */
static void snapshot(const kvc_prefix *idx, char *buf, size_t size) {
    size_t o = (size_t)snprintf(buf, size, "%u %u %u |", idx->n_held, idx->n_evictable, idx->n_nodes);
    for (uint32_t i = 1; i < idx->n_slots && o < size - 128; i++) {
        const kvc_prefix_node *n = &idx->nodes[i];
        if (n->live) {
            o += (size_t)snprintf(buf + o, size - o, " %u:%llu,%u,%u,%u,%u,%u,%u,%u", i, (unsigned long long)n->label,
                                  n->len, n->depth, n->parent, n->prot, n->gen, n->first_child, n->next_sib);
            for (uint32_t k = 0; k < n->len && o < size - 64; k++) {
                o += (size_t)snprintf(buf + o, size - o, ",%d=%u", n->tok[k], n->cell[k]);
            }
        }
    }
    o += (size_t)snprintf(buf + o, size - o, " | lru");
    for (uint32_t i = idx->nodes[0].lru_next; i != 0 && o < size - 16; i = idx->nodes[i].lru_next) {
        o += (size_t)snprintf(buf + o, size - o, " %u", i);
    }
}

static void test_duplicates_and_bad_cells(void) {
    kvc_prefix idx;
    REQUIRE(kvc_prefix_init(&idx, 2, 16, 0, NULL) == KVC_OK, "init");
    const int32_t t[] = { 1, 2, 3, 4 };
    CHECK(put(&idx, 0, t, 3, 0, 0, NULL) == KVC_OK, "[1 2 3] in cells 0 1 2");
    uint32_t cells[] = { 5, 1, 7, 8 }, streams[] = { 0, 0, 0, 1 }, dc[4], ds[4];
    kvc_prefix_inserted r;
    CHECK(kvc_prefix_insert(&idx, 0, t, cells, streams, 4, dc, ds, &r, NULL) == KVC_OK, "insert");
    CHECK(r.n_present == 3 && r.n_dup == 2 && dc[0] == 5 && dc[1] == 7 && ds[1] == 0 && r.n_added == 1,
          "the caller's 5 and 7 are duplicates, 1 is the index's own: %u dups", r.n_dup);
    CHECKED(&idx);
    char before[4096], after[4096];
    snapshot(&idx, before, sizeof before);
    const int32_t u[] = { 1, 2, 9, 9 };
    struct { uint32_t cells[4], streams[4]; const char *what; } bad[] = {
        { { 0, 1, 16, 9 }, { 0, 0, 0, 0 }, "a cell out of range" },
        { { 0, 1, 9, 9 }, { 0, 0, 2, 0 }, "a stream out of range" },
        { { 0, 1, 9, 9 }, { 0, 0, 0, 0 }, "a cell named twice" },
        { { 0, 1, 8, 10 }, { 0, 0, 1, 0 }, "a cell held for another token" },
        { { 2, 1, 9, 10 }, { 0, 0, 0, 0 }, "a duplicate the index holds for another token" },
        { { 9, 1, 9, 10 }, { 0, 0, 0, 0 }, "a duplicate named again" },
    };
    for (size_t k = 0; k < sizeof bad / sizeof bad[0]; k++) {
        kvc_err err = { 0, "" };
        CHECK(kvc_prefix_insert(&idx, 0, u, bad[k].cells, bad[k].streams, 4, dc, ds, &r, &err) == KVC_E_ARG,
              "%s is refused", bad[k].what);
        CHECK(err.msg[0] != 0, "%s: a message", bad[k].what);
        snapshot(&idx, after, sizeof after);
        CHECK(strcmp(before, after) == 0, "%s: nothing changed", bad[k].what);
        CHECKED(&idx);
    }
    kvc_prefix_free(&idx);
}

static void test_lock_pin_evict(void) {
    kvc_prefix idx;
    REQUIRE(kvc_prefix_init(&idx, 1, 64, 0, NULL) == KVC_OK, "init");
    const int32_t a[] = { 1, 2, 3 }, b[] = { 1, 2, 4 }, c[] = { 5, 6 };
    kvc_prefix_inserted ra, rb, rc;
    put(&idx, 0, a, 3, 0, 0, &ra);
    put(&idx, 0, b, 3, 10, 0, &rb);   /* [1 2] -> [3] (cell 2), [4] (cell 12) */
    put(&idx, 0, c, 2, 20, 0, &rc);
    kvc_err err = { 0, "" };
    CHECK(kvc_prefix_lock(&idx, ra.end, &err) == KVC_OK, "lock [1 2 3]: %s", err.msg);
    CHECK(kvc_prefix_n_evictable(&idx) == 3, "[4] and [5 6] evictable: %u", kvc_prefix_n_evictable(&idx));
    CHECK(kvc_prefix_pin(&idx, rc.end, NULL) == KVC_OK, "pin [5 6]");
    CHECK(kvc_prefix_evict(&idx, 100) == 1 && strcmp(freed_str(&idx), "12") == 0, "only [4] goes: %s",
          freed_str(&idx));
    CHECKED(&idx);
    CHECK(!kvc_prefix_handle_valid(&idx, rb.end), "[4]'s handle is stale");
    CHECK(kvc_prefix_lock(&idx, rb.end, NULL) == KVC_E_ARG && kvc_prefix_unlock(&idx, rb.end, NULL) == KVC_E_ARG,
          "a stale handle is refused");
    CHECK(kvc_prefix_unpin(&idx, ra.end, NULL) == KVC_E_ARG, "unpin without a pin");
    CHECK(kvc_prefix_lock(&idx, ra.end, NULL) == KVC_OK, "a second lock");
    CHECK(kvc_prefix_unlock(&idx, ra.end, NULL) == KVC_OK && kvc_prefix_evict(&idx, 100) == 0, "one lock left");
    CHECK(kvc_prefix_unlock(&idx, ra.end, NULL) == KVC_OK, "the last lock");
    CHECK(kvc_prefix_unlock(&idx, ra.end, NULL) == KVC_E_ARG, "unlock without a lock");
    CHECK(kvc_prefix_n_evictable(&idx) == 3, "[1 2] [3] evictable");
    CHECK(kvc_prefix_evict(&idx, 100) == 3 && strcmp(freed_str(&idx), "2 0 1") == 0, "the leaf, then its parent: %s",
          freed_str(&idx));
    CHECK(kvc_prefix_unpin(&idx, rc.end, NULL) == KVC_OK && kvc_prefix_evict(&idx, 1) == 2, "unpinned, it goes");
    CHECK(kvc_prefix_n_held(&idx) == 0 && kvc_prefix_n_nodes(&idx) == 0, "empty");
    const kvc_prefix_handle none = { 0, 0 };
    CHECK(kvc_prefix_lock(&idx, none, NULL) == KVC_OK && kvc_prefix_unlock(&idx, none, NULL) == KVC_OK,
          "no node: nothing to do");
    CHECKED(&idx);
    kvc_prefix_free(&idx);
}

static void test_lru_order(void) {
    kvc_prefix idx;
    REQUIRE(kvc_prefix_init(&idx, 1, 64, 0, NULL) == KVC_OK, "init");
    const int32_t a[] = { 1 }, b[] = { 2 }, c[] = { 3 };
    put(&idx, 0, a, 1, 1, 0, NULL);
    put(&idx, 0, b, 1, 2, 0, NULL);
    put(&idx, 0, c, 1, 3, 0, NULL);
    uint32_t cells[8];
    find(&idx, 0, a, 1, cells, NULL);   /* a used last */
    CHECK(kvc_prefix_evict(&idx, 1) == 1 && strcmp(freed_str(&idx), "2") == 0, "b first: %s", freed_str(&idx));
    CHECK(kvc_prefix_evict(&idx, 2) == 2 && strcmp(freed_str(&idx), "3 1") == 0, "then c, a: %s", freed_str(&idx));
    /* a parent goes when its turn comes after its children: [1 2] -> [3], [4]; [9] between */
    const int32_t p[] = { 1, 2, 3 }, q[] = { 1, 2, 4 }, r[] = { 9 };
    put(&idx, 0, p, 3, 10, 0, NULL);
    put(&idx, 0, r, 1, 20, 0, NULL);
    put(&idx, 0, q, 3, 30, 0, NULL);   /* cells 10 11 | 12 | 32 */
    find(&idx, 0, r, 1, cells, NULL);  /* [9] newest, then [4]'s path */
    CHECK(kvc_prefix_evict(&idx, 1) == 1 && strcmp(freed_str(&idx), "12") == 0, "[3]: %s", freed_str(&idx));
    CHECK(kvc_prefix_evict(&idx, 2) == 3 && strcmp(freed_str(&idx), "32 10 11") == 0,
          "[4] then its parent [1 2] (at least 2 cells: whole nodes): %s", freed_str(&idx));
    CHECK(kvc_prefix_n_held(&idx) == 1, "[9] left");
    /* an unlock is a use */
    kvc_prefix_inserted ra;
    put(&idx, 0, a, 1, 1, 0, &ra);
    kvc_prefix_lock(&idx, ra.end, NULL);
    put(&idx, 0, b, 1, 2, 0, NULL);
    kvc_prefix_unlock(&idx, ra.end, NULL);
    CHECKED(&idx);
    CHECK(kvc_prefix_evict(&idx, 3) == 3 && strcmp(freed_str(&idx), "20 2 1") == 0, "[9], [2], then [1]: %s",
          freed_str(&idx));
    kvc_prefix_free(&idx);
}

/* Write-back at eviction: each evicted node's whole prompt (salt, tokens from the root, cells)
 * is recorded, prompts shorter than min_len are not; off by default, cleared on request. */
static void test_spill(void) {
    kvc_prefix idx;
    REQUIRE(kvc_prefix_init(&idx, 1, 64, 0, NULL) == KVC_OK, "init");
    CHECK(kvc_prefix_spill_pending(&idx) == NULL, "off by default");
    const int32_t p[] = { 1, 2, 3 }, q[] = { 1, 2, 4, 5 }, r[] = { 9 };
    put(&idx, 7, p, 3, 10, 0, NULL);
    put(&idx, 7, q, 4, 30, 0, NULL);   /* [1 2] (10 11) -> [3] (12), [4 5] (32 33) */
    put(&idx, 0, r, 1, 20, 0, NULL);
    REQUIRE(kvc_prefix_spill_set(&idx, true, 2, NULL) == KVC_OK, "on");
    CHECK(kvc_prefix_evict(&idx, 64) == 6, "everything");
    const kvc_prefix_spill *sp = kvc_prefix_spill_pending(&idx);
    REQUIRE(sp != NULL, "pending");
    /* leaves first ([3], [4 5]), then their parent [1 2]; [9] is shorter than 2 */
    CHECK(sp->n == 3, "three prompts: %u", sp->n);
    const int32_t want_tok[] = { 1, 2, 3, 1, 2, 4, 5, 1, 2 };
    const uint32_t want_cell[] = { 10, 11, 12, 10, 11, 32, 33, 10, 11 };
    CHECK(sp->start[0] == 0 && sp->start[1] == 3 && sp->start[2] == 7 && sp->start[3] == 9, "lengths");
    for (uint32_t i = 0; i < 9 && sp->n == 3; i++) {
        CHECK(sp->tok[i] == want_tok[i] && sp->cell[i] == want_cell[i] && sp->strm[i] == 0, "token %u", i);
    }
    CHECK(sp->salt[0] == 7 && sp->salt[1] == 7 && sp->salt[2] == 7, "salts");
    kvc_prefix_spill_clear(&idx);
    CHECK(kvc_prefix_spill_pending(&idx)->n == 0, "cleared");
    /* many prompts: the list grows */
    for (int32_t k = 0; k < 40; k++) {
        const int32_t t[] = { 100 + k, 1 };
        put(&idx, 0, t, 2, (uint32_t)k, 0, NULL);
        CHECK(kvc_prefix_evict(&idx, 2) == 2, "evict %d", k);
    }
    CHECK(kvc_prefix_spill_pending(&idx)->n == 40 && kvc_prefix_spill_pending(&idx)->start[40] == 80, "40 kept");
    REQUIRE(kvc_prefix_spill_set(&idx, false, 0, NULL) == KVC_OK, "off");
    CHECK(kvc_prefix_spill_pending(&idx) == NULL, "off again");
    REQUIRE(kvc_prefix_spill_set(&idx, true, 1, NULL) == KVC_OK, "on again");
    kvc_prefix_free(&idx);   /* frees the list */
}

/* A copy shares nothing with its index: evictions, inserts and a moved cell in the copy leave the
 * index (cells, order of use, locks, write-back records) as it was; a copy's evictions record no
 * write-back; a failed copy is zeroed (and freeing it is safe). */
static void test_copy(void) {
    kvc_prefix idx, cp;
    REQUIRE(kvc_prefix_init(&idx, 1, 64, 0, NULL) == KVC_OK, "init");
    const int32_t p[] = { 1, 2, 3 }, q[] = { 1, 2, 4, 5 }, r[] = { 9 }, s[] = { 7, 7 };
    kvc_prefix_inserted rr;
    put(&idx, 0, p, 3, 10, 0, NULL);
    put(&idx, 0, q, 4, 30, 0, NULL);   /* a split: [3]'s edge lies inside its old allocation */
    put(&idx, 0, r, 1, 20, 0, &rr);
    REQUIRE(kvc_prefix_lock(&idx, rr.end, NULL) == KVC_OK, "lock [9]");
    REQUIRE(kvc_prefix_spill_set(&idx, true, 1, NULL) == KVC_OK, "write-back on");
    char before[65536], after[65536];
    snapshot(&idx, before, sizeof before);
    for (int k = 1; k < 8; k++) {
        kvc_fail_alloc_after = k;
        const int rc = kvc_prefix_copy(&cp, &idx);
        kvc_fail_alloc_after = 0;
        CHECK(rc == KVC_E_NOMEM || rc == KVC_OK, "copy %d: %d", k, rc);
        CHECK(rc == KVC_OK || (cp.nodes == NULL && cp.n_held == 0), "a failed copy is zeroed");
        kvc_prefix_free(&cp);
    }
    REQUIRE(kvc_prefix_copy(&cp, &idx) == KVC_OK, "copy");
    CHECKED(&cp);
    CHECK(kvc_prefix_spill_pending(&cp) == NULL, "the copy records no write-back");
    CHECK(kvc_prefix_handle_valid(&cp, rr.end), "handles carry over");
    CHECK(kvc_prefix_move_cell(&cp, 0, 12, 13, NULL) == KVC_OK, "a cell moved in the copy");
    CHECK(kvc_prefix_evict(&cp, 64) == 5 && strcmp(freed_str(&cp), "13 32 33 10 11") == 0, "the copy evicts: %s",
          freed_str(&cp));
    put(&cp, 0, s, 2, 40, 0, NULL);
    CHECKED(&cp);
    kvc_prefix_free(&cp);
    snapshot(&idx, after, sizeof after);
    CHECK(strcmp(before, after) == 0, "the index is as it was");
    CHECKED(&idx);
    CHECK(kvc_prefix_spill_pending(&idx)->n == 0, "no record from the copy's evictions");
    CHECK(kvc_prefix_evict(&idx, 64) == 5 && strcmp(freed_str(&idx), "12 32 33 10 11") == 0,
          "its own order of use: %s", freed_str(&idx));
    kvc_prefix_free(&idx);
}

static void test_cap(void) {
    kvc_prefix idx;
    REQUIRE(kvc_prefix_init(&idx, 1, 64, 6, NULL) == KVC_OK, "init");
    const int32_t a[] = { 1, 2, 3, 4 }, b[] = { 5, 6, 7, 8 }, a2[] = { 1, 2, 3, 4, 9, 9 };
    kvc_prefix_inserted r;
    CHECK(put(&idx, 0, a, 4, 0, 0, &r) == KVC_OK && r.n_evicted == 0, "4 under the cap of 6");
    CHECK(put(&idx, 0, b, 4, 10, 0, &r) == KVC_OK && r.n_evicted == 4 && strcmp(freed_str(&idx), "0 1 2 3") == 0,
          "4 more: the first goes: %u, %s", r.n_evicted, freed_str(&idx));
    CHECK(kvc_prefix_n_held(&idx) == 4, "4 held");
    CHECK(kvc_prefix_lock(&idx, r.end, NULL) == KVC_OK, "lock it");
    char before[4096], after[4096];
    snapshot(&idx, before, sizeof before);
    kvc_err err = { 0, "" };
    uint32_t cells[6] = { 20, 21, 22, 23 }, streams[6] = { 0 }, dc[6], ds[6];
    CHECK(kvc_prefix_insert(&idx, 0, a, cells, streams, 4, dc, ds, &r, &err) == KVC_E_NOSPACE, "no room but locked");
    snapshot(&idx, after, sizeof after);
    CHECK(strcmp(before, after) == 0 && err.msg[0], "nothing changed: %s", err.msg);
    const int32_t b2[] = { 5, 6, 7, 8, 9, 9 };
    uint32_t cb[6] = { 10, 11, 12, 13, 30, 31 };
    CHECK(kvc_prefix_insert(&idx, 0, b2, cb, streams, 6, dc, ds, &r, NULL) == KVC_OK && r.n_evicted == 0,
          "6 of 6 along its own path");
    CHECK(kvc_prefix_unlock(&idx, r.end, NULL) == KVC_E_ARG,
          "the new leaf holds no lock");
    CHECKED(&idx);
    /* extending a prompt whose path is all there is: its own path is never evicted */
    kvc_prefix_clear(&idx);
    kvc_prefix_set_cap(&idx, 5);
    put(&idx, 0, a, 4, 0, 0, NULL);
    uint32_t c2[6] = { 0, 1, 2, 3, 40, 41 };
    CHECK(kvc_prefix_insert(&idx, 0, a2, c2, streams, 6, dc, ds, &r, &err) == KVC_E_NOSPACE,
          "6 on a path of 4 under a cap of 5: %s", err.msg);
    CHECKED(&idx);
    CHECK(kvc_prefix_n_held(&idx) == 4, "kept");
    kvc_prefix_set_cap(&idx, 3);
    CHECK(kvc_prefix_insert(&idx, 0, b, cells, streams, 4, dc, ds, &r, NULL) == KVC_E_NOSPACE,
          "4 new cells never fit a cap of 3");
    kvc_prefix_set_cap(&idx, 0);
    CHECK(kvc_prefix_insert(&idx, 0, a2, c2, streams, 6, dc, ds, &r, NULL) == KVC_OK, "no cap");
    CHECKED(&idx);
    kvc_prefix_free(&idx);
}

static void test_remove_cells(void) {
    kvc_prefix idx;
    REQUIRE(kvc_prefix_init(&idx, 1, 64, 0, NULL) == KVC_OK, "init");
    const int32_t a[] = { 1, 2, 3, 4, 5 }, b[] = { 1, 2, 3, 6, 7 }, c[] = { 1, 2, 3, 6, 8 };
    kvc_prefix_inserted ra, rb, rc;
    put(&idx, 0, a, 5, 0, 0, &ra);     /* [1 2 3]=0 1 2 -> [4 5]=3 4 */
    put(&idx, 0, b, 5, 10, 0, &rb);    /*               -> [6]=13 -> [7]=14 */
    put(&idx, 0, c, 5, 20, 0, &rc);    /*                         -> [8]=24 */
    CHECK(kvc_prefix_n_nodes(&idx) == 5 && kvc_prefix_n_held(&idx) == 8, "5 nodes, 8 cells");
    kvc_prefix_lock(&idx, rc.end, NULL);
    /* cell 1 (token 2) goes: the rest of its edge and everything below; named cells not freed */
    const uint32_t gone[] = { 99, 24, 1, 63 }, gs[] = { 0, 0, 0, 5 };
    CHECK(kvc_prefix_remove_cells(&idx, gone, gs, 4) == 5, "dropped: %s", freed_str(&idx));
    CHECK(strcmp(freed_str(&idx), "2 3 4 13 14") == 0, "an edge's tail, then below in order: %s", freed_str(&idx));
    CHECKED(&idx);
    CHECK(kvc_prefix_n_held(&idx) == 1 && kvc_prefix_n_nodes(&idx) == 1, "[1] left");
    CHECK(!kvc_prefix_handle_valid(&idx, rc.end) && kvc_prefix_unlock(&idx, rc.end, NULL) == KVC_E_ARG,
          "the locked node went: its handle is stale");
    CHECK(kvc_prefix_n_evictable(&idx) == 1, "its path is unprotected again");
    CHECK(kvc_prefix_remove_cells(&idx, gone, gs, 4) == 0, "nothing held: nothing happens");
    /* a truncated node keeps its handle and its locks */
    kvc_prefix_clear(&idx);
    put(&idx, 0, a, 5, 0, 0, &ra);
    put(&idx, 0, b, 5, 10, 0, &rb);
    kvc_prefix_lock(&idx, rb.end, NULL);   /* [6 7] */
    kvc_prefix_inserted rx;
    const int32_t x[] = { 1 };
    put(&idx, 0, x, 1, 0, 0, &rx);          /* present in [1 2 3]: nothing new */
    CHECK(rx.n_present == 1 && rx.n_added == 0, "a prefix inside an edge");
    CHECK(kvc_prefix_lock(&idx, rx.end, NULL) == KVC_OK, "lock [1 2 3]");
    const uint32_t g2[] = { 2 }, s2[] = { 0 };
    CHECK(kvc_prefix_remove_cells(&idx, g2, s2, 1) == 4 && strcmp(freed_str(&idx), "3 4 13 14") == 0,
          "token 3 goes: %s", freed_str(&idx));
    CHECK(kvc_prefix_handle_valid(&idx, rx.end) && kvc_prefix_n_evictable(&idx) == 0, "[1 2] stays locked");
    CHECK(kvc_prefix_unlock(&idx, rx.end, NULL) == KVC_OK && kvc_prefix_n_evictable(&idx) == 2, "unlocked");
    CHECKED(&idx);
    kvc_prefix_free(&idx);
}

static void test_clear(void) {
    kvc_prefix idx;
    REQUIRE(kvc_prefix_init(&idx, 1, 16, 0, NULL) == KVC_OK, "init");
    const int32_t a[] = { 1, 2, 3 };
    kvc_prefix_inserted r;
    put(&idx, 0, a, 3, 0, 0, &r);
    kvc_prefix_pin(&idx, r.end, NULL);
    kvc_prefix_clear(&idx);
    CHECKED(&idx);
    CHECK(kvc_prefix_n_held(&idx) == 0 && kvc_prefix_n_nodes(&idx) == 0 && !kvc_prefix_handle_valid(&idx, r.end),
          "empty, the pinned handle stale");
    CHECK(put(&idx, 0, a, 3, 0, 0, &r) == KVC_OK && kvc_prefix_n_held(&idx) == 3, "its cells can be used again");
    kvc_err err = { 0, "" };
    kvc_prefix bad;
    CHECK(kvc_prefix_init(&bad, 0, 16, 0, &err) == KVC_E_ARG && err.msg[0], "no streams: %s", err.msg);
    CHECK(kvc_prefix_init(&bad, 65536, 65536, 0, NULL) == KVC_E_ARG, "more than 2**31 cells");
    kvc_prefix_free(&bad);
    kvc_prefix_free(&idx);
}

/* Every allocation of an insert that splits, adds a root and grows the pool and the table fails
 * in turn: KVC_E_NOMEM and nothing changed, then the insert goes through. */
static void test_nomem(void) {
    kvc_prefix idx;
    REQUIRE(kvc_prefix_init(&idx, 1, 4096, 0, NULL) == KVC_OK, "init");
    int32_t t[8];
    for (uint32_t k = 0; k < 61; k++) {   /* 61 leaves under one root: the pool of 64 is nearly full */
        t[0] = (int32_t)k;
        t[1] = 1000;
        put(&idx, 1, t, 2, 2 * k, 0, NULL);
    }
    const int32_t u[] = { 0, 7, 7 };
    uint32_t cells[3] = { 0, 500, 501 }, streams[3] = { 0 }, dc[3], ds[3];
    char before[65536], after[65536];
    snapshot(&idx, before, sizeof before);
    int rc = KVC_E_NOMEM;
    for (int k = 1; rc == KVC_E_NOMEM && k < 20; k++) {
        kvc_prefix_inserted r;
        kvc_fail_alloc_after = k;
        rc = kvc_prefix_insert(&idx, 1, u, cells, streams, 3, dc, ds, &r, NULL);
        kvc_fail_alloc_after = 0;
        if (rc == KVC_E_NOMEM) {
            snapshot(&idx, after, sizeof after);
            CHECK(strcmp(before, after) == 0, "allocation %d failed: nothing changed", k);
            CHECKED(&idx);
        }
    }
    CHECK(rc == KVC_OK, "the insert goes through when the allocations do");
    CHECKED(&idx);
    CHECK(kvc_prefix_n_nodes(&idx) == 63, "a split and a leaf: %u nodes", kvc_prefix_n_nodes(&idx));
    kvc_prefix_free(&idx);
}

/* --- a random run against a naive model ----------------------------------------------------------- */

#define R_CELLS 48u
#define R_PROMPTS 400u
#define R_LEN 10u

/* What the model knows: every prompt that went in with the cells the index said it holds, how
 * much of it is still held (up to its first cell handed back), and which cells are held. */
typedef struct model_prompt {
    uint64_t salt;
    uint32_t n;
    uint32_t live;   /* its first tokens whose cells were never handed back */
    int32_t  tok[R_LEN];
    uint32_t cell[R_LEN];
} model_prompt;

static model_prompt prompts[R_PROMPTS];
static uint32_t n_prompts;
static bool held[R_CELLS];

/* The index handed cell c back: no prompt holds it, or what came after it, any more. */
static void model_let_go(uint32_t c) {
    held[c] = false;
    for (uint32_t p = 0; p < n_prompts; p++) {
        for (uint32_t k = 0; k < prompts[p].live; k++) {
            if (prompts[p].cell[k] == c) {
                prompts[p].live = k;
            }
        }
    }
}

/* The longest prefix the model says is held: of a prompt whose tokens agree, within its live
 * part. */
static uint32_t model_match(uint64_t salt, const int32_t *tok, uint32_t n, uint32_t *cells) {
    uint32_t best = 0;
    for (uint32_t p = 0; p < n_prompts; p++) {
        if (prompts[p].salt != salt) {
            continue;
        }
        uint32_t k = 0;
        while (k < n && k < prompts[p].live && prompts[p].tok[k] == tok[k]) {
            k++;
        }
        if (k > best) {
            best = k;
            memcpy(cells, prompts[p].cell, k * sizeof *cells);
        }
    }
    return best;
}

typedef struct model_lock {
    kvc_prefix_handle h;
    uint32_t n;
    uint32_t cell[R_LEN];
} model_lock;

static void test_random_vs_naive(void) {
    kvc_prefix idx;
    REQUIRE(kvc_prefix_init(&idx, 1, R_CELLS, 0, NULL) == KVC_OK, "init");
    model_lock locks[16];
    uint32_t n_locks = 0, n_matched = 0, n_evicted = 0;
    for (uint32_t step = 0; step < 4000 && n_failed == 0; step++) {
        const uint32_t what = check_rand(10);
        const uint64_t salt = check_rand(3) == 0 ? 77 : 0;
        int32_t tok[R_LEN] = { 0 };
        const uint32_t n = 1 + check_rand(R_LEN);
        uint32_t from = 0;
        if (n_prompts && check_rand(4)) {   /* most prompts extend an earlier one */
            const model_prompt *p = &prompts[check_rand(n_prompts)];
            memcpy(tok, p->tok, sizeof tok);
            from = check_rand(n);
        }
        for (uint32_t i = from; i < n; i++) {
            tok[i] = (int32_t)check_rand(3);
        }
        if (step % 997 == 0) {
            kvc_prefix_set_cap(&idx, step % 2 ? 0 : 30);
        }
        if (what < 4 && n_prompts < R_PROMPTS) {
            uint32_t cells[R_LEN], streams[R_LEN] = { 0 }, dc[R_LEN], ds[R_LEN], own[R_LEN];
            const uint32_t m = model_match(salt, tok, n, own);
            bool taken[R_CELLS];
            memcpy(taken, held, sizeof taken);
            uint32_t n_free = 0;
            for (uint32_t c = 0; c < R_CELLS; c++) {
                n_free += !held[c];
            }
            if (n_free < n - m + 1) {
                continue;
            }
            for (uint32_t i = 0; i < n; i++) {
                if (i < m) {
                    cells[i] = own[i];
                    continue;
                }
                do {
                    cells[i] = check_rand(R_CELLS);
                } while (taken[cells[i]]);
                taken[cells[i]] = true;
            }
            kvc_prefix_inserted r;
            const int rc = kvc_prefix_insert(&idx, salt, tok, cells, streams, n, dc, ds, &r, NULL);
            CHECKED(&idx);
            if (rc == KVC_E_NOSPACE) {
                continue;
            }
            REQUIRE(rc == KVC_OK, "step %u: insert %d", step, rc);
            CHECK(r.n_present == m && r.n_dup == 0, "step %u: present %u, the model says %u", step, r.n_present, m);
            const uint32_t *fc;
            const uint32_t nf = r.n_evicted ? kvc_prefix_freed(&idx, &fc, NULL) : 0;
            for (uint32_t k = 0; k < nf; k++) {
                CHECK(held[fc[k]], "step %u: evicted cell %u was not held", step, fc[k]);
                model_let_go(fc[k]);
                for (uint32_t l = 0; l < n_locks; l++) {
                    for (uint32_t j = 0; j < locks[l].n; j++) {
                        CHECK(locks[l].cell[j] != fc[k], "step %u: evicted cell %u of a locked prefix", step, fc[k]);
                    }
                }
            }
            for (uint32_t i = m; i < n; i++) {
                held[cells[i]] = true;
            }
            model_prompt *p = &prompts[n_prompts++];
            p->salt = salt;
            p->n = p->live = n;
            memcpy(p->tok, tok, sizeof tok);
            memcpy(p->cell, cells, sizeof cells);
        } else if (what < 7) {
            uint32_t cells[R_LEN], want[R_LEN];
            kvc_prefix_handle h;
            const uint32_t m = kvc_prefix_match(&idx, salt, tok, n, n, cells, NULL, &h);
            const uint32_t mm = model_match(salt, tok, n, want);
            CHECK(m == mm && memcmp(cells, want, m * sizeof *cells) == 0, "step %u: matched %u, the model %u", step,
                  m, mm);
            n_matched += m;
            if (m && n_locks < 16 && check_rand(2)) {
                REQUIRE(kvc_prefix_lock(&idx, h, NULL) == KVC_OK, "lock");
                locks[n_locks].h = h;
                locks[n_locks].n = m;
                memcpy(locks[n_locks].cell, cells, sizeof cells);
                n_locks++;
            }
        } else if (what < 8 && n_locks) {
            const uint32_t l = check_rand(n_locks);
            CHECK(kvc_prefix_unlock(&idx, locks[l].h, NULL) == KVC_OK, "unlock");
            locks[l] = locks[--n_locks];
        } else {
            const uint32_t want = check_rand(8);
            const uint32_t got = kvc_prefix_evict(&idx, want);
            const uint32_t *fc;
            const uint32_t nf = kvc_prefix_freed(&idx, &fc, NULL);
            CHECK(got == nf && (got >= want || kvc_prefix_n_evictable(&idx) == 0), "step %u: evicted %u of %u", step,
                  got, want);
            n_evicted += got;
            for (uint32_t k = 0; k < nf; k++) {
                CHECK(held[fc[k]], "step %u: evicted cell %u was not held", step, fc[k]);
                model_let_go(fc[k]);
                for (uint32_t l = 0; l < n_locks; l++) {
                    for (uint32_t j = 0; j < locks[l].n; j++) {
                        CHECK(locks[l].cell[j] != fc[k], "step %u: evicted cell %u of a locked prefix", step, fc[k]);
                    }
                }
            }
        }
        uint32_t n_held = 0;
        for (uint32_t c = 0; c < R_CELLS; c++) {
            n_held += held[c];
        }
        CHECK(n_held == kvc_prefix_n_held(&idx), "step %u: %u held, the model %u", step, kvc_prefix_n_held(&idx), n_held);
        CHECKED(&idx);
    }
    CHECK(n_matched > 100 && n_evicted > 100, "the run matched (%u) and evicted (%u)", n_matched, n_evicted);
    kvc_prefix_free(&idx);
}

/* --- 1M tokens --------------------------------------------------------------------------------- */

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

#define BIG_PROMPT 4096u
#define BIG_PROMPTS 464u   /* 1024 shared + 58 * 1024 + 464 * 2048 = 1,010,688 tokens held */

/* Prompt p: a system prompt (1024 tokens) all share, 1024 its group of 8 shares (few-shot
 * examples), then 2048 of its own. */
static void big_prompt(uint32_t p, int32_t *tok) {
    for (uint32_t i = 0; i < BIG_PROMPT; i++) {
        tok[i] = i < 1024   ? (int32_t)((i * 31u + 7u) % 50000)
               : i < 2048 ? (int32_t)(((p / 8) * 7919u + i * 31u) % 50000)
                          : (int32_t)((p * 104729u + i * 613u) % 50000);
    }
}

static void test_million_tokens(void) {
    kvc_prefix idx;
    REQUIRE(kvc_prefix_init(&idx, 1, BIG_PROMPTS * BIG_PROMPT, 0, NULL) == KVC_OK, "init");
    int32_t *all = malloc((size_t)BIG_PROMPTS * BIG_PROMPT * sizeof *all);
    uint32_t *cells = malloc(BIG_PROMPT * sizeof *cells), *streams = calloc(BIG_PROMPT, sizeof *streams);
    uint32_t *dc = malloc(BIG_PROMPT * sizeof *dc), *ds = malloc(BIG_PROMPT * sizeof *ds);
    REQUIRE(all && cells && streams && dc && ds, "memory");
    uint32_t next = 0;
    for (uint32_t p = 0; p < BIG_PROMPTS; p++) {
        int32_t *tok = all + (size_t)p * BIG_PROMPT;
        big_prompt(p, tok);
        const uint32_t m = kvc_prefix_match(&idx, 0, tok, BIG_PROMPT, BIG_PROMPT, cells, NULL, NULL);
        for (uint32_t i = m; i < BIG_PROMPT; i++) {
            cells[i] = next++;
        }
        kvc_prefix_inserted r;
        REQUIRE(kvc_prefix_insert(&idx, 0, tok, cells, streams, BIG_PROMPT, dc, ds, &r, NULL) == KVC_OK, "insert %u",
                p);
    }
    CHECKED(&idx);
    /* the query: prompt 200's system prompt and 1000 of its tokens, then new ones */
    int32_t *q = malloc(BIG_PROMPT * sizeof *q);
    REQUIRE(q != NULL, "memory");
    memcpy(q, all + (size_t)200 * BIG_PROMPT, BIG_PROMPT * sizeof *q);
    for (uint32_t i = 3048; i < BIG_PROMPT; i++) {
        q[i] = -1;
    }
    const int reps = 200;
    uint32_t m = 0;
    double t0 = now_s();
    for (int r = 0; r < reps; r++) {
        m = kvc_prefix_match(&idx, 0, q, BIG_PROMPT, BIG_PROMPT - 1, cells, streams, NULL);
    }
    const double t_match = (now_s() - t0) / reps;
    /* the scan: the longest common prefix with every prompt held (a prompt cache without an index) */
    uint32_t best = 0;
    t0 = now_s();
    for (int r = 0; r < reps / 10; r++) {
        best = 0;
        for (uint32_t p = 0; p < BIG_PROMPTS; p++) {
            const int32_t *tok = all + (size_t)p * BIG_PROMPT;
            uint32_t k = 0;
            while (k < BIG_PROMPT - 1 && tok[k] == q[k]) {
                k++;
            }
            best = k > best ? k : best;
        }
    }
    const double t_scan = (now_s() - t0) / (reps / 10);
    CHECK(m == 3048 && best == 3048, "matched %u, the scan %u", m, best);
    printf("prefix index: %u tokens held in %u nodes; a 4096-token match %.1f us, a scan of the prompts %.1f us "
           "(%.0fx)\n", kvc_prefix_n_held(&idx), kvc_prefix_n_nodes(&idx), t_match * 1e6, t_scan * 1e6,
           t_scan / t_match);
    const uint32_t n_held = kvc_prefix_n_held(&idx);
    CHECK(n_held == 1024 + 1024 * (BIG_PROMPTS / 8) + 2048 * BIG_PROMPTS, "%u held", n_held);
    CHECK(kvc_prefix_evict(&idx, UINT32_MAX) == n_held && kvc_prefix_n_nodes(&idx) == 0, "everything evicts");
    CHECKED(&idx);
    free(q), free(all), free(cells), free(streams), free(dc), free(ds);
    kvc_prefix_free(&idx);
}

int main(void) {
    test_insert_match_split();
    test_insert_upto_from();
    test_salts();
    test_duplicates_and_bad_cells();
    test_lock_pin_evict();
    test_lru_order();
    test_spill();
    test_copy();
    test_cap();
    test_remove_cells();
    test_clear();
    test_nomem();
    test_random_vs_naive();
    test_million_tokens();
    printf("test_prefix: %d checks, %d failed\n", n_checks, n_failed);
    return n_failed ? 1 : 0;
}
