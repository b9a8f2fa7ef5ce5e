/* The prefix index (kvc_prefix.h): a radix tree in a node pool, a child table, a cell map and
 * one LRU list of the unprotected nodes. */
#include "kvc_prefix.h"

#include <string.h>

#define NIL 0u                      /* no node; slot 0 is the LRU list's head */
#define TENTATIVE UINT32_MAX        /* place[].node of a cell an insert is validating */
#define POOL_MIN 64u
#define TABLE_MIN 128u
#define EDGE_BYTES 12u              /* per token: token, cell, stream */
#define EVICT_AHEAD 16u             /* cells an eviction asks the place map's lines for ahead */

/* --- the cell map ------------------------------------------------------------------------------ */

static inline kvc_prefix_place *place_of(const kvc_prefix *idx, uint32_t stream, uint32_t cell) {
    return &idx->place[(size_t)stream * idx->n_cells + cell];
}

static inline bool cell_in_range(const kvc_prefix *idx, uint32_t stream, uint32_t cell) {
    return stream < idx->n_stream && cell < idx->n_cells;
}

/* --- the child table --------------------------------------------------------------------------- */

static inline uint32_t table_home(const kvc_prefix *idx, uint32_t parent, uint64_t label) {
    /* splitmix64's finalizer over the pair */
    uint64_t h = label ^ ((uint64_t)parent * 0x9E3779B97F4A7C15u);
    h = (h ^ (h >> 30)) * 0xBF58476D1CE4E5B9u;
    h = (h ^ (h >> 27)) * 0x94D049BB133111EBu;
    h ^= h >> 31;
    return (uint32_t)h & (idx->table_size - 1);
}

/* The slot of (parent, label), or of the empty slot where it would go. */
static uint32_t table_probe(const kvc_prefix *idx, uint32_t parent, uint64_t label) {
    const uint32_t mask = idx->table_size - 1;
    uint32_t i = table_home(idx, parent, label);
    while (idx->table[i].child != NIL && (idx->table[i].parent != parent || idx->table[i].label != label)) {
        i = (i + 1) & mask;
    }
    return i;
}

static inline uint32_t table_find(const kvc_prefix *idx, uint32_t parent, uint64_t label) {
    return idx->table[table_probe(idx, parent, label)].child;
}

/* Add or replace (parent, label) -> child; the caller reserved room (table_reserve). */
static void table_set(kvc_prefix *idx, uint32_t parent, uint64_t label, uint32_t child) {
    kvc_prefix_slot *s = &idx->table[table_probe(idx, parent, label)];
    if (s->child == NIL) {
        idx->table_used++;
    }
    *s = (kvc_prefix_slot){ label, parent, child };
}

static void table_del(kvc_prefix *idx, uint32_t parent, uint64_t label) {
    const uint32_t mask = idx->table_size - 1;
    uint32_t i = table_probe(idx, parent, label);
    if (idx->table[i].child == NIL) {
        return;
    }
    idx->table_used--;
    /* backward shift: move up every later entry of the run whose home does not lie in (i, j] */
    for (uint32_t j = (i + 1) & mask; idx->table[j].child != NIL; j = (j + 1) & mask) {
        const uint32_t home = table_home(idx, idx->table[j].parent, idx->table[j].label);
        if (((j - home) & mask) >= ((j - i) & mask)) {
            idx->table[i] = idx->table[j];
            i = j;
        }
    }
    idx->table[i].child = NIL;
}

/* Room for `more` entries at a load of at most one half. */
static int table_reserve(kvc_prefix *idx, uint32_t more) {
    uint64_t size = idx->table_size;
    while (((uint64_t)idx->table_used + more) * 2 > size) {
        size *= 2;
    }
    if (size == idx->table_size) {
        return KVC_OK;
    }
    if (size > ((uint64_t)1 << 31)) {
        return KVC_E_NOMEM;
    }
    kvc_prefix_slot *old = idx->table;
    const uint32_t old_size = idx->table_size;
    kvc_prefix_slot *t = kvc_calloc((size_t)size, sizeof *t);
    if (!t) {
        return KVC_E_NOMEM;
    }
    idx->table = t;
    idx->table_size = (uint32_t)size;
    idx->table_used = 0;
    for (uint32_t i = 0; i < old_size; i++) {
        if (old[i].child != NIL) {
            table_set(idx, old[i].parent, old[i].label, old[i].child);
        }
    }
    kvc_free(old);
    return KVC_OK;
}

/* --- the node pool ----------------------------------------------------------------------------- */

/* Slots [from, to) onto the free list, the lowest first out. */
static void pool_free_range(kvc_prefix *idx, uint32_t from, uint32_t to) {
    for (uint32_t i = to; i-- > from;) {
        idx->nodes[i].live = false;
        idx->nodes[i].next_sib = idx->free_head;
        idx->free_head = i;
        idx->n_free++;
    }
}

/* At least `more` free slots and room for as many table entries. */
static int pool_reserve(kvc_prefix *idx, uint32_t more) {
    if (idx->n_free < more) {
        const uint64_t want = (uint64_t)idx->n_slots * 2 > (uint64_t)idx->n_slots + more
                                  ? (uint64_t)idx->n_slots * 2 : (uint64_t)idx->n_slots + more;
        if (want > ((uint64_t)1 << 31)) {
            return KVC_E_NOMEM;
        }
        kvc_prefix_node *p = kvc_realloc_n(idx->nodes, want, sizeof *p);
        if (!p) {
            return KVC_E_NOMEM;
        }
        memset(p + idx->n_slots, 0, (size_t)(want - idx->n_slots) * sizeof *p);
        idx->nodes = p;
        const uint32_t old = idx->n_slots;
        idx->n_slots = (uint32_t)want;
        pool_free_range(idx, old, idx->n_slots);
    }
    return table_reserve(idx, more);
}

/* A node from the free list (pool_reserve made sure there is one). */
static uint32_t node_new(kvc_prefix *idx) {
    const uint32_t i = idx->free_head;
    kvc_prefix_node *n = &idx->nodes[i];
    idx->free_head = n->next_sib;
    idx->n_free--;
    const uint32_t gen = n->gen;
    *n = (kvc_prefix_node){ 0 };
    n->gen = gen;
    n->live = true;
    return i;
}

static void node_release(kvc_prefix *idx, uint32_t i) {
    kvc_prefix_node *n = &idx->nodes[i];
    /* a lock's handle names a node its lock holds: one going without a lock (every node an
     * eviction takes) leaves every lock's handle valid */
    idx->n_lock_released += n->n_lock != 0;
    kvc_free(n->mem);
    const uint32_t gen = n->gen + 1;
    *n = (kvc_prefix_node){ 0 };
    n->gen = gen;
    n->next_sib = idx->free_head;
    idx->free_head = i;
    idx->n_free++;
}

/* An edge's storage for len tokens: tokens, then cells, then streams. */
static void *edge_alloc(uint32_t len) { return kvc_malloc_n(len, EDGE_BYTES); }

static void edge_attach(kvc_prefix_node *n, void *mem, uint32_t len) {
    n->mem = mem;
    n->tok = mem;
    n->cell = (uint32_t *)(n->tok + len);
    n->strm = n->cell + len;
    n->len = len;
}

/* --- the LRU list ------------------------------------------------------------------------------ */

static void lru_unlink(kvc_prefix *idx, uint32_t i) {
    kvc_prefix_node *n = &idx->nodes[i];
    idx->nodes[n->lru_prev].lru_next = n->lru_next;
    idx->nodes[n->lru_next].lru_prev = n->lru_prev;
    n->lru_prev = n->lru_next = NIL;
}

/* Put i after `after` (NIL: the head, i.e. the tail is nodes[NIL].lru_prev). */
static void lru_insert_after(kvc_prefix *idx, uint32_t after, uint32_t i) {
    kvc_prefix_node *n = &idx->nodes[i];
    n->lru_prev = after;
    n->lru_next = idx->nodes[after].lru_next;
    idx->nodes[n->lru_next].lru_prev = i;
    idx->nodes[after].lru_next = i;
}

static inline void lru_append(kvc_prefix *idx, uint32_t i) { lru_insert_after(idx, idx->nodes[NIL].lru_prev, i); }

/* Use of the path from i up: its unprotected nodes, i first, go to the recent end. Nodes above
 * a protected one are protected, so the walk stops at the first. */
static void touch(kvc_prefix *idx, uint32_t i) {
    for (; i != NIL && !idx->nodes[i].root && idx->nodes[i].prot == 0; i = idx->nodes[i].parent) {
        lru_unlink(idx, i);
        lru_append(idx, i);
    }
}

/* a more locks or pins at i: the path's nodes that were unprotected leave the list. */
static void prot_add(kvc_prefix *idx, uint32_t i, uint32_t a) {
    for (; !idx->nodes[i].root; i = idx->nodes[i].parent) {
        kvc_prefix_node *n = &idx->nodes[i];
        if (n->prot == 0) {
            lru_unlink(idx, i);
            idx->n_evictable -= n->len;
        }
        n->prot += a;
    }
}

/* a fewer: the nodes left unprotected join the list's recent end, the deepest first. */
static void prot_sub(kvc_prefix *idx, uint32_t i, uint32_t a) {
    for (; !idx->nodes[i].root; i = idx->nodes[i].parent) {
        kvc_prefix_node *n = &idx->nodes[i];
        n->prot -= a;
        if (n->prot == 0) {
            lru_append(idx, i);
            idx->n_evictable += n->len;
        }
    }
}

/* --- the tree ---------------------------------------------------------------------------------- */

static void child_append(kvc_prefix *idx, uint32_t parent, uint32_t c) {
    kvc_prefix_node *p = &idx->nodes[parent];
    kvc_prefix_node *n = &idx->nodes[c];
    n->parent = parent;
    n->prev_sib = p->last_child;
    n->next_sib = NIL;
    if (p->last_child != NIL) {
        idx->nodes[p->last_child].next_sib = c;
    } else {
        p->first_child = c;
    }
    p->last_child = c;
    p->n_child++;
    table_set(idx, parent, n->label, c);
}

/* Take c out of its parent's children; a root left without children goes too. */
static void child_detach(kvc_prefix *idx, uint32_t c) {
    kvc_prefix_node *n = &idx->nodes[c];
    const uint32_t parent = n->parent;
    kvc_prefix_node *p = &idx->nodes[parent];
    table_del(idx, parent, n->label);
    if (n->prev_sib != NIL) {
        idx->nodes[n->prev_sib].next_sib = n->next_sib;
    } else {
        p->first_child = n->next_sib;
    }
    if (n->next_sib != NIL) {
        idx->nodes[n->next_sib].prev_sib = n->prev_sib;
    } else {
        p->last_child = n->prev_sib;
    }
    n->prev_sib = n->next_sib = NIL;
    p->n_child--;
    if (p->root && p->n_child == 0) {
        table_del(idx, NIL, p->label);
        node_release(idx, parent);
    }
}

/* Tokens [from, len) of node i to the freed list, unless the remove in progress named them. */
static void edge_let_go(kvc_prefix *idx, uint32_t i, uint32_t from) {
    const kvc_prefix_node *n = &idx->nodes[i];
    for (uint32_t k = from; k < n->len; k++) {
        if (k + KVC_CELLS_AHEAD < n->len) {
            KVC_PREFETCH_W(place_of(idx, n->strm[k + KVC_CELLS_AHEAD], n->cell[k + KVC_CELLS_AHEAD]));
        }
        kvc_prefix_place *pl = place_of(idx, n->strm[k], n->cell[k]);
        if (!(pl->depth & KVC_PREFIX_MARK)) {
            idx->freed_cell[idx->n_freed] = n->cell[k];
            idx->freed_strm[idx->n_freed] = n->strm[k];
            idx->n_freed++;
        }
        *pl = (kvc_prefix_place){ 0, 0 };
    }
}

/* Every token of node i to the freed list, for an eviction: no remove is in progress, so no
 * cell is named, and each cell's place is written without being read (a line of the place map
 * per cell, a store that need not wait for it), its line asked for EVICT_AHEAD cells before. */
static void edge_evict(kvc_prefix *idx, uint32_t i) {
    const kvc_prefix_node *n = &idx->nodes[i];
    const uint32_t len = n->len, *cell = n->cell, *strm = n->strm;
    uint32_t *fc = idx->freed_cell + idx->n_freed, *fs = idx->freed_strm + idx->n_freed;
    for (uint32_t k = 0; k < len; k++) {
        if (k + EVICT_AHEAD < len) {
            KVC_PREFETCH_W(place_of(idx, strm[k + EVICT_AHEAD], cell[k + EVICT_AHEAD]));
        }
        *place_of(idx, strm[k], cell[k]) = (kvc_prefix_place){ 0, 0 };
        fc[k] = cell[k];
        fs[k] = strm[k];
    }
    idx->n_freed += len;
}

/* Drop leaf i (its cells let go already): the counts, the list, its parent's children. */
static void leaf_drop(kvc_prefix *idx, uint32_t i) {
    kvc_prefix_node *n = &idx->nodes[i];
    idx->n_held -= n->len;
    idx->n_nodes--;
    if (n->prot == 0) {
        idx->n_evictable -= n->len;
        lru_unlink(idx, i);
    }
    child_detach(idx, i);
    node_release(idx, i);
}

/* Room for one more record of len tokens in the spill; false when memory cannot be had. */
static bool spill_room(kvc_prefix_spill *sp, uint32_t len) {
    if (sp->n == sp->cap) {
        const uint32_t cap = sp->cap ? 2 * sp->cap : 8;
        uint64_t *salt = kvc_realloc_n(sp->salt, cap, sizeof *salt);
        if (salt) {
            sp->salt = salt;
        }
        uint32_t *start = kvc_realloc_n(sp->start, (uint64_t)cap + 1, sizeof *start);
        if (start) {
            sp->start = start;
        }
        if (!salt || !start) {
            return false;
        }
        sp->cap = cap;
    }
    const uint64_t need = (uint64_t)sp->start[sp->n] + len;
    if (need > sp->cap_tok) {
        if (need > UINT32_MAX) {
            return false;
        }
        const uint64_t want = need > 2 * (uint64_t)sp->cap_tok ? need : 2 * (uint64_t)sp->cap_tok;
        const uint32_t cap = (uint32_t)(want < UINT32_MAX ? want : UINT32_MAX);
        int32_t *tok = kvc_realloc_n(sp->tok, cap, sizeof *tok);
        if (tok) {
            sp->tok = tok;
        }
        uint32_t *cell = kvc_realloc_n(sp->cell, cap, sizeof *cell);
        if (cell) {
            sp->cell = cell;
        }
        uint32_t *strm = kvc_realloc_n(sp->strm, cap, sizeof *strm);
        if (strm) {
            sp->strm = strm;
        }
        if (!tok || !cell || !strm) {
            return false;
        }
        sp->cap_tok = cap;
    }
    return true;
}

/* Record the prompt node i ends (before it is evicted): its path's tokens, cells and streams. */
static void spill_record(kvc_prefix *idx, uint32_t i) {
    kvc_prefix_spill *sp = idx->spill;
    const kvc_prefix_node *n = &idx->nodes[i];
    const uint32_t len = n->depth + n->len;
    if (len < sp->min_len || len == 0) {
        return;
    }
    if (!spill_room(sp, len)) {
        sp->n_lost++;
        return;
    }
    const uint32_t base = sp->start[sp->n];
    uint32_t x = i;
    for (; !idx->nodes[x].root; x = idx->nodes[x].parent) {
        const kvc_prefix_node *e = &idx->nodes[x];
        memcpy(sp->tok + base + e->depth, e->tok, (size_t)e->len * sizeof *e->tok);
        memcpy(sp->cell + base + e->depth, e->cell, (size_t)e->len * sizeof *e->cell);
        memcpy(sp->strm + base + e->depth, e->strm, (size_t)e->len * sizeof *e->strm);
    }
    sp->salt[sp->n] = idx->nodes[x].label;
    sp->n++;
    sp->start[sp->n] = base + len;
}

int kvc_prefix_spill_set(kvc_prefix *idx, bool on, uint32_t min_len, kvc_err *err) {
    if (!on) {
        kvc_prefix_spill_clear(idx);
        if (idx->spill) {
            kvc_free(idx->spill->salt);
            kvc_free(idx->spill->start);
            kvc_free(idx->spill->tok);
            kvc_free(idx->spill->cell);
            kvc_free(idx->spill->strm);
            kvc_free(idx->spill);
            idx->spill = NULL;
        }
        return KVC_OK;
    }
    if (!idx->spill) {
        kvc_prefix_spill *sp = kvc_calloc(1, sizeof *sp);
        uint32_t *start = kvc_calloc(1, sizeof *start);
        if (!sp || !start) {
            kvc_free(sp);
            kvc_free(start);
            return kvc_err_set(err, KVC_E_NOMEM, "out of memory for the write-back list");
        }
        sp->start = start;
        idx->spill = sp;
    }
    idx->spill->min_len = min_len;
    return KVC_OK;
}

void kvc_prefix_spill_clear(kvc_prefix *idx) {
    if (idx->spill) {
        idx->spill->n = 0;
    }
}

/* Evict from the list's old end, sparing nodes on an insert's path, until `want` cells went or
 * none is left; the cells are appended to the freed list. Every node taken is a leaf: its
 * children were unprotected too, so before it in the list, and went first. */
static uint32_t evict_walk(kvc_prefix *idx, uint64_t want) {
    uint32_t got = 0;
    uint32_t i = idx->nodes[NIL].lru_next;
    while (i != NIL && got < want) {
        const uint32_t next = idx->nodes[i].lru_next;
        if (!idx->nodes[i].on_path) {
            got += idx->nodes[i].len;
            if (idx->spill) {
                spill_record(idx, i);
            }
            edge_evict(idx, i);
            leaf_drop(idx, i);
        }
        i = next;
    }
    return got;
}

/* --- the public functions ---------------------------------------------------------------------- */

/* kvc_prefix_evictable_in over the list from node `from` on. */
static uint32_t evictable_from(const kvc_prefix *idx, uint32_t from, uint32_t st, uint32_t size, const uint64_t *busy,
                               uint64_t need) {
    /* the list holds exactly the unprotected nodes, and evicting them all lets go of all their cells */
    uint64_t k = 0;
    for (uint32_t i = from; i != NIL && k < need; i = idx->nodes[i].lru_next) {
        const kvc_prefix_node *n = &idx->nodes[i];
        for (uint32_t t = 0; t < n->len; t++) {
            const uint32_t cell = n->cell[t];
            k += n->strm[t] == st && cell < size && !((busy[cell >> 6] >> (cell & 63)) & 1u);
        }
    }
    return (uint32_t)(k < need ? k : need);
}

uint32_t kvc_prefix_evictable_in(const kvc_prefix *idx, uint32_t st, uint32_t size, const uint64_t *busy,
                                 uint64_t need) {
    return evictable_from(idx, idx->nodes[NIL].lru_next, st, size, busy, need);
}

static inline uint32_t dry_next(const kvc_prefix *idx, const kvc_prefix_dry *d) {
    return d->next == KVC_PREFIX_DRY_START ? idx->nodes[NIL].lru_next : d->next;
}

uint32_t kvc_prefix_dry_evict(const kvc_prefix *idx, kvc_prefix_dry *d, uint32_t n_cells,
                              void (*fn)(void *ctx, uint32_t cell, uint32_t strm), void *ctx) {
    /* evict_walk's walk, taking nothing */
    uint32_t got = 0, i = dry_next(idx, d);
    for (; i != NIL && got < n_cells; i = idx->nodes[i].lru_next) {
        const kvc_prefix_node *n = &idx->nodes[i];
        if (n->on_path) {
            continue;
        }
        got += n->len;
        for (uint32_t k = 0; k < n->len; k++) {
            fn(ctx, n->cell[k], n->strm[k]);
        }
    }
    d->next = i;
    d->n_taken += got;
    return got;
}

uint32_t kvc_prefix_dry_evictable_in(const kvc_prefix *idx, const kvc_prefix_dry *d, uint32_t st, uint32_t size,
                                     const uint64_t *busy, uint64_t need) {
    return evictable_from(idx, dry_next(idx, d), st, size, busy, need);
}

int kvc_prefix_init(kvc_prefix *idx, uint32_t n_stream, uint32_t n_cells, uint32_t cap, kvc_err *err) {
    *idx = (kvc_prefix){ 0 };
    const uint64_t total = (uint64_t)n_stream * n_cells;
    if (n_stream == 0 || n_cells == 0 || total > KVC_PREFIX_MARK) {
        return kvc_err_set(err, KVC_E_ARG, "a prefix index needs 1 to 2**31 cells in all, not %u streams of %u",
                           n_stream, n_cells);
    }
    idx->n_stream = n_stream;
    idx->n_cells = n_cells;
    idx->cap = cap;
    /* the arrays read per cell come from kvc_table_calloc (resident, on huge pages) */
    idx->place = kvc_table_calloc(total, sizeof *idx->place);
    idx->freed_cell = kvc_table_calloc(total, sizeof *idx->freed_cell);
    idx->freed_strm = kvc_table_calloc(total, sizeof *idx->freed_strm);
    idx->nodes = kvc_calloc(POOL_MIN, sizeof *idx->nodes);
    idx->table = kvc_calloc(TABLE_MIN, sizeof *idx->table);
    if (!idx->place || !idx->freed_cell || !idx->freed_strm || !idx->nodes || !idx->table) {
        kvc_prefix_free(idx);
        return kvc_err_set(err, KVC_E_NOMEM, "out of memory for a prefix index of %llu cells",
                           (unsigned long long)total);
    }
    idx->n_slots = POOL_MIN;
    idx->table_size = TABLE_MIN;
    pool_free_range(idx, 1, POOL_MIN);
    return KVC_OK;
}

void kvc_prefix_free(kvc_prefix *idx) {
    if (idx->nodes) {
        for (uint32_t i = 1; i < idx->n_slots; i++) {
            if (idx->nodes[i].live) {
                kvc_free(idx->nodes[i].mem);
            }
        }
    }
    kvc_free(idx->nodes);
    kvc_free(idx->table);
    kvc_free(idx->place);
    kvc_free(idx->freed_cell);
    kvc_free(idx->freed_strm);
    (void)kvc_prefix_spill_set(idx, false, 0, NULL);
    *idx = (kvc_prefix){ 0 };
}

int kvc_prefix_copy(kvc_prefix *dst, const kvc_prefix *src) {
    const uint64_t total = (uint64_t)src->n_stream * src->n_cells;
    *dst = *src;
    dst->spill = NULL;
    dst->nodes = kvc_malloc_n(src->n_slots, sizeof *dst->nodes);
    dst->table = kvc_malloc_n(src->table_size, sizeof *dst->table);
    dst->place = kvc_malloc_n(total, sizeof *dst->place);
    dst->freed_cell = kvc_malloc_n(total, sizeof *dst->freed_cell);
    dst->freed_strm = kvc_malloc_n(total, sizeof *dst->freed_strm);
    bool ok = dst->nodes && dst->table && dst->place && dst->freed_cell && dst->freed_strm;
    if (dst->nodes) {
        memcpy(dst->nodes, src->nodes, (size_t)src->n_slots * sizeof *dst->nodes);
        for (uint32_t i = 0; i < src->n_slots; i++) {
            dst->nodes[i].mem = NULL;   /* src's: each edge gets its own below */
        }
    }
    for (uint32_t i = 1; ok && i < src->n_slots; i++) {
        const kvc_prefix_node *s = &src->nodes[i];
        if (!s->live || !s->mem) {
            continue;
        }
        void *mem = edge_alloc(s->len ? s->len : 1);
        if (!mem) {
            ok = false;
            break;
        }
        kvc_prefix_node *d = &dst->nodes[i];
        edge_attach(d, mem, s->len);
        memcpy(d->tok, s->tok, (size_t)s->len * sizeof *d->tok);
        memcpy(d->cell, s->cell, (size_t)s->len * sizeof *d->cell);
        memcpy(d->strm, s->strm, (size_t)s->len * sizeof *d->strm);
    }
    if (!ok) {
        kvc_prefix_free(dst);
        return KVC_E_NOMEM;
    }
    memcpy(dst->table, src->table, (size_t)src->table_size * sizeof *dst->table);
    memcpy(dst->place, src->place, (size_t)total * sizeof *dst->place);
    memcpy(dst->freed_cell, src->freed_cell, (size_t)src->n_freed * sizeof *dst->freed_cell);
    memcpy(dst->freed_strm, src->freed_strm, (size_t)src->n_freed * sizeof *dst->freed_strm);
    return KVC_OK;
}

void kvc_prefix_clear(kvc_prefix *idx) {
    idx->n_lock_released++;
    for (uint32_t i = 1; i < idx->n_slots; i++) {
        if (idx->nodes[i].live) {
            kvc_free(idx->nodes[i].mem);
            idx->nodes[i].mem = NULL;
            idx->nodes[i].gen++;
        }
    }
    /* every slot free again, each keeping its generation */
    for (uint32_t i = 0; i < idx->n_slots; i++) {
        const uint32_t gen = idx->nodes[i].gen;
        idx->nodes[i] = (kvc_prefix_node){ 0 };
        idx->nodes[i].gen = gen;
    }
    idx->free_head = NIL;
    idx->n_free = 0;
    pool_free_range(idx, 1, idx->n_slots);
    memset(idx->table, 0, (size_t)idx->table_size * sizeof *idx->table);
    idx->table_used = 0;
    memset(idx->place, 0, (size_t)idx->n_stream * idx->n_cells * sizeof *idx->place);
    idx->n_freed = idx->n_held = idx->n_evictable = idx->n_nodes = 0;
}

void kvc_prefix_set_cap(kvc_prefix *idx, uint32_t cap) { idx->cap = cap; }

static kvc_prefix_handle handle_of(const kvc_prefix *idx, uint32_t i) {
    return i == NIL ? (kvc_prefix_handle){ 0, 0 } : (kvc_prefix_handle){ i, idx->nodes[i].gen };
}

/* The walk of a prompt down the tree: the node where it stops matching and how far. */
typedef struct prefix_walk {
    uint32_t root;     /* the salt's root, NIL when none */
    uint32_t deepest;  /* the node holding the last matched token, NIL when none */
    uint32_t off;      /* tokens of `deepest` matched (its len unless the match ends inside) */
    uint32_t n;        /* tokens matched */
} prefix_walk;

/* Go on with walk w down tokens[w->n, n): the rest of the edge it stopped inside first (a walk
 * resumed from a node the caller knows the prompt passes), then edge by edge; with out_cells /
 * out_streams, the cells of the tokens it matches as it goes. */
static void walk_on(const kvc_prefix *idx, prefix_walk *w, const int32_t *tokens, uint32_t n, uint32_t *out_cells,
                    uint32_t *out_streams) {
    uint32_t at = w->deepest != NIL ? w->deepest : w->root;
    uint32_t k0 = w->off;   /* where the walk stands in at's edge */
    bool inside = w->deepest != NIL && w->off < idx->nodes[w->deepest].len;
    while (w->n < n) {
        uint32_t k = k0;
        if (!inside) {
            const uint32_t c = at == NIL ? NIL : table_find(idx, at, (uint32_t)tokens[w->n]);
            if (c == NIL) {
                break;
            }
            at = c;
            k0 = 0;
            k = 1;   /* the table matched the first */
        }
        const kvc_prefix_node *e = &idx->nodes[at];
        const uint32_t lim = e->len - k0 < n - w->n ? e->len : k0 + (n - w->n);
        while (k < lim && e->tok[k] == tokens[w->n + (k - k0)]) {
            k++;
        }
        if (out_cells) {
            memcpy(out_cells + w->n, e->cell + k0, (size_t)(k - k0) * sizeof *out_cells);
        }
        if (out_streams) {
            memcpy(out_streams + w->n, e->strm + k0, (size_t)(k - k0) * sizeof *out_streams);
        }
        w->deepest = at;
        w->off = k;
        w->n += k - k0;
        if (k < e->len) {
            break;
        }
        inside = false;
    }
}

/* Where a walk starts: at salt's root, or resumed where `from` stands (a prefix of the prompt the
 * caller knows the index holds). */
static prefix_walk walk_start(const kvc_prefix *idx, uint64_t salt, const prefix_walk *from) {
    return from ? *from : (prefix_walk){ table_find(idx, NIL, salt), NIL, 0, 0 };
}

/* Walk tokens[0, n) under salt; with out_cells / out_streams, their cells as it goes. */
static prefix_walk walk_prompt(const kvc_prefix *idx, uint64_t salt, const int32_t *tokens, uint32_t n,
                               uint32_t *out_cells, uint32_t *out_streams) {
    prefix_walk w = walk_start(idx, salt, NULL);
    walk_on(idx, &w, tokens, n, out_cells, out_streams);
    return w;
}

uint32_t kvc_prefix_match(kvc_prefix *idx, uint64_t salt, const int32_t *tokens, uint32_t n, uint32_t max_len,
                          uint32_t *out_cells, uint32_t *out_streams, kvc_prefix_handle *end) {
    const prefix_walk w = walk_prompt(idx, salt, tokens, n < max_len ? n : max_len, out_cells, out_streams);
    touch(idx, w.deepest);
    if (end) {
        *end = handle_of(idx, w.deepest);
    }
    return w.n;
}

/* Take back the marks an insert's validation left on tokens [0, upto). */
static void unmark_tentative(kvc_prefix *idx, const uint32_t *cells, const uint32_t *streams, uint32_t upto) {
    for (uint32_t i = 0; i < upto; i++) {
        kvc_prefix_place *pl = place_of(idx, streams[i], cells[i]);
        if (pl->node == TENTATIVE) {
            pl->node = NIL;
        }
    }
}

static void mark_path(kvc_prefix *idx, uint32_t i, bool on) {
    for (; i != NIL && !idx->nodes[i].root; i = idx->nodes[i].parent) {
        idx->nodes[i].on_path = on;
    }
}

/* Split node i after its first k tokens (0 < k < len): a new node takes them and i's place; i
 * keeps the rest below it (its handles stay good: the old path still runs through it). */
static uint32_t split(kvc_prefix *idx, uint32_t i, uint32_t k, void *upper_mem) {
    const uint32_t u = node_new(idx);
    kvc_prefix_node *n = &idx->nodes[i], *up = &idx->nodes[u];
    edge_attach(up, upper_mem, k);
    memcpy(up->tok, n->tok, (size_t)k * sizeof *up->tok);
    memcpy(up->cell, n->cell, (size_t)k * sizeof *up->cell);
    memcpy(up->strm, n->strm, (size_t)k * sizeof *up->strm);
    up->label = n->label;
    up->depth = n->depth;
    up->parent = n->parent;
    up->prot = n->prot;
    /* u takes i's place among its siblings and in the table */
    up->prev_sib = n->prev_sib;
    up->next_sib = n->next_sib;
    kvc_prefix_node *p = &idx->nodes[n->parent];
    if (n->prev_sib != NIL) {
        idx->nodes[n->prev_sib].next_sib = u;
    } else {
        p->first_child = u;
    }
    if (n->next_sib != NIL) {
        idx->nodes[n->next_sib].prev_sib = u;
    } else {
        p->last_child = u;
    }
    table_set(idx, n->parent, n->label, u);
    for (uint32_t t = 0; t < k; t++) {
        place_of(idx, up->strm[t], up->cell[t])->node = u;
    }
    /* i: the rest, as u's only child */
    n->tok += k;
    n->cell += k;
    n->strm += k;
    n->len -= k;
    n->depth += k;
    n->label = (uint32_t)n->tok[0];
    n->prev_sib = n->next_sib = NIL;
    child_append(idx, u, i);
    if (n->prot == 0) {
        lru_insert_after(idx, i, u);
    }
    idx->n_nodes++;
    return u;
}

/* Why check_cells stopped at a token. */
enum { CELL_OK, CELL_RANGE, CELL_TWICE, CELL_HELD };

/* The one pass over the caller's cells before an insert changes anything: each cell the index
 * would take, and each duplicate (the caller's cell of a token the index holds with another),
 * must be in range and held nowhere; the index's own cells on the matched path pass. Unless the
 * caller vouches that its cells are distinct (`distinct`: a sequence's cells), each such cell
 * is marked TENTATIVE, so that a second naming finds the mark (unmark_tentative takes the marks
 * back). The duplicates go to dup_cells / dup_streams (either may be NULL), their count to
 * *n_dup. Returns the first token that fails (n when none does), why in *why.
 * (The index's fields are read into locals once: the build does not assume that the stores to
 * the cell map and the outputs leave them alone, and this runs once per token of a release.) */
static uint32_t check_cells(kvc_prefix *idx, const prefix_walk *w, const prefix_walk *from, const int32_t *tokens,
                            const uint32_t *cells, const uint32_t *streams, uint32_t n, bool distinct,
                            uint32_t *dup_cells, uint32_t *dup_streams, uint32_t *n_dup, int *why) {
    kvc_prefix_place *const place = idx->place;
    const uint32_t n_stream = idx->n_stream, n_cells = idx->n_cells;
    /* a resumed walk starts where `from` stands (its tokens are the caller's known cells) */
    uint32_t i = from ? from->n : 0, dups = 0, at = from ? from->deepest : w->root;
    bool inside = from && from->deepest != NIL && from->off < idx->nodes[from->deepest].len;
    *why = CELL_OK;
    while (i < n && *why == CELL_OK) {
        /* along the matched path an edge at a time (e), then the new tokens (e NULL) */
        const kvc_prefix_node *e = NULL;
        uint32_t k_end = n - i, k = 0;
        if (i < w->n) {
            if (inside) {
                k = from->off;
                inside = false;
            } else {
                at = table_find(idx, at, (uint32_t)tokens[i]);
            }
            e = &idx->nodes[at];
            k_end = at == w->deepest ? w->off : e->len;
        }
        for (; k < k_end; k++, i++) {
            const uint32_t ahead = i + KVC_CELLS_AHEAD;
            if (ahead < n && streams[ahead] < n_stream && cells[ahead] < n_cells) {
                KVC_PREFETCH_W(&place[(size_t)streams[ahead] * n_cells + cells[ahead]]);
            }
            if (e && e->cell[k] == cells[i] && e->strm[k] == streams[i]) {
                continue;   /* the index's own cell (it holds only cells in range) */
            }
            if (streams[i] >= n_stream || cells[i] >= n_cells) {
                *why = CELL_RANGE;
                break;
            }
            kvc_prefix_place *pl = &place[(size_t)streams[i] * n_cells + cells[i]];
            if (pl->node != NIL) {
                *why = pl->node == TENTATIVE ? CELL_TWICE : CELL_HELD;
                break;
            }
            if (!distinct) {
                pl->node = TENTATIVE;
            }
            if (e) {
                if (dup_cells) {
                    dup_cells[dups] = cells[i];
                }
                if (dup_streams) {
                    dup_streams[dups] = streams[i];
                }
                dups++;
            }
        }
    }
    *n_dup = dups;
    return i;
}

/* The evictable cells off the path from node i up (the nodes an insert spares). */
static uint32_t evictable_off_path(const kvc_prefix *idx, uint32_t i) {
    uint32_t on = 0;
    for (; i != NIL && !idx->nodes[i].root; i = idx->nodes[i].parent) {
        on += idx->nodes[i].prot == 0 ? idx->nodes[i].len : 0;
    }
    return idx->n_evictable - on;
}

/* kvc_prefix_insert, or with `upto` kvc_prefix_insert_upto. */
static int insert(kvc_prefix *idx, uint64_t salt, const int32_t *tokens, const uint32_t *cells, const uint32_t *streams,
                  uint32_t n, uint32_t *dup_cells, uint32_t *dup_streams, bool upto, const prefix_walk *from,
                  kvc_prefix_inserted *res, kvc_err *err) {
    *res = (kvc_prefix_inserted){ 0 };
    if (n == 0) {
        return KVC_OK;
    }
    if (!tokens || !cells || !streams) {
        return kvc_err_set(err, KVC_E_ARG, "an insert of %u tokens needs their tokens, cells and streams", n);
    }
    prefix_walk w = walk_start(idx, salt, from);
    walk_on(idx, &w, tokens, n, NULL, NULL);
    if (upto) {
        touch(idx, w.deepest);   /* the match of the whole prompt */
    }
    uint32_t n_dup = 0;
    int why = CELL_OK;
    const uint32_t bad = check_cells(idx, &w, from, tokens, cells, streams, n, upto, dup_cells, dup_streams, &n_dup,
                                     &why);
    int rc = KVC_OK;
    uint32_t marked = upto ? 0 : bad;   /* the tokens whose marks go back on failure */
    if (bad < n && upto && why == CELL_HELD) {
        /* the prompt ends before the first cell held for another token */
        n = bad;
        if (n == 0) {
            return KVC_OK;
        }
        if (n < w.n) {
            w = walk_start(idx, salt, from);   /* (a resumed walk's known tokens pass: bad >= from->n) */
            walk_on(idx, &w, tokens, n, NULL, NULL);
        }
    } else if (bad < n) {
        uint32_t at = bad;
        /* a cell out of range is told first, wherever it is */
        for (uint32_t i = bad + 1; why != CELL_RANGE && i < n; i++) {
            if (!cell_in_range(idx, streams[i], cells[i])) {
                at = i;
                why = CELL_RANGE;
            }
        }
        rc = why == CELL_RANGE
             ? kvc_err_set(err, KVC_E_ARG, "token %u: cell %u of stream %u is out of range (%u streams of %u cells)",
                           at, cells[at], streams[at], idx->n_stream, idx->n_cells)
             : kvc_err_set(err, KVC_E_ARG, why == CELL_TWICE
                           ? "token %u: cell %u of stream %u is named twice"
                           : "token %u: cell %u of stream %u is held for another token",
                           at, cells[at], streams[at]);
        goto fail;
    }
    res->n_present = w.n;
    res->n_dup = n_dup;
    const uint32_t n_new = n - w.n;
    /* on the matched path only the duplicates were marked: none, nothing to take back there */
    if (n_new == 0) {
        if (n_dup && !upto) {
            unmark_tentative(idx, cells, streams, n);
        }
        idx->n_freed = 0;
        touch(idx, w.deepest);
        res->end = handle_of(idx, w.deepest);
        return KVC_OK;
    }
    /* the cap: evict first, sparing the prompt's own path, or refuse */
    uint64_t need = 0;
    if (idx->cap != 0 && (uint64_t)idx->n_held + n_new > idx->cap) {
        need = (uint64_t)idx->n_held + n_new - idx->cap;
        const uint32_t can = evictable_off_path(idx, w.deepest);
        if (can < need) {
            rc = kvc_err_set(err, KVC_E_NOSPACE,
                             "keeping %u new cells under the cap of %u needs %llu cells evicted, and %u can be "
                             "(the others are locked, pinned or on the prompt's path)",
                             n_new, idx->cap, (unsigned long long)need, can);
            goto fail;
        }
    }
    /* every allocation before any change */
    const bool inside = w.deepest != NIL && w.off < idx->nodes[w.deepest].len;
    void *leaf_mem = NULL, *upper_mem = NULL;
    rc = pool_reserve(idx, 3);
    if (rc == KVC_OK) {
        leaf_mem = edge_alloc(n_new);
        upper_mem = inside ? edge_alloc(w.off) : NULL;
        if (!leaf_mem || (inside && !upper_mem)) {
            rc = KVC_E_NOMEM;
        }
    }
    if (rc != KVC_OK) {
        kvc_free(leaf_mem);
        kvc_free(upper_mem);
        rc = kvc_err_set(err, KVC_E_NOMEM, "out of memory inserting a prompt of %u tokens", n);
        goto fail;
    }
    idx->n_freed = 0;
    if (need > 0) {
        mark_path(idx, w.deepest, true);
        res->n_evicted = evict_walk(idx, need);
        mark_path(idx, w.deepest, false);
    }
    /* the root (an eviction may have taken it when nothing matched), the split, the leaf */
    uint32_t parent = w.deepest;
    if (parent == NIL) {
        parent = table_find(idx, NIL, salt);
        if (parent == NIL) {
            parent = node_new(idx);
            idx->nodes[parent].root = true;
            idx->nodes[parent].label = salt;
            table_set(idx, NIL, salt, parent);
        }
    } else if (inside) {
        parent = split(idx, w.deepest, w.off, upper_mem);
    }
    const uint32_t leaf = node_new(idx);
    kvc_prefix_node *l = &idx->nodes[leaf];
    edge_attach(l, leaf_mem, n_new);
    memcpy(l->tok, tokens + w.n, (size_t)n_new * sizeof *l->tok);
    memcpy(l->cell, cells + w.n, (size_t)n_new * sizeof *l->cell);
    memcpy(l->strm, streams + w.n, (size_t)n_new * sizeof *l->strm);
    l->label = (uint32_t)tokens[w.n];
    l->depth = w.n;
    child_append(idx, parent, leaf);
    kvc_prefix_place *const place = idx->place;
    for (uint32_t k = 0, depth = w.n, n_cells = idx->n_cells; k < n_new; k++) {
        place[(size_t)streams[depth + k] * n_cells + cells[depth + k]] = (kvc_prefix_place){ leaf, depth + k };
    }
    idx->n_held += n_new;
    idx->n_evictable += n_new;
    idx->n_nodes++;
    lru_append(idx, leaf);
    touch(idx, leaf);
    if (n_dup && !upto) {
        unmark_tentative(idx, cells, streams, w.n);   /* the duplicates' marks */
    }
    res->n_added = n_new;
    res->end = handle_of(idx, leaf);
    return KVC_OK;
fail:
    unmark_tentative(idx, cells, streams, marked);
    *res = (kvc_prefix_inserted){ 0 };
    return rc;
}

int kvc_prefix_insert(kvc_prefix *idx, uint64_t salt, const int32_t *tokens, const uint32_t *cells,
                      const uint32_t *streams, uint32_t n, uint32_t *dup_cells, uint32_t *dup_streams,
                      kvc_prefix_inserted *res, kvc_err *err) {
    return insert(idx, salt, tokens, cells, streams, n, dup_cells, dup_streams, false, NULL, res, err);
}

int kvc_prefix_insert_upto(kvc_prefix *idx, uint64_t salt, const int32_t *tokens, const uint32_t *cells,
                           const uint32_t *streams, uint32_t n, uint32_t *dup_cells, uint32_t *dup_streams,
                           kvc_prefix_inserted *res, kvc_err *err) {
    return insert(idx, salt, tokens, cells, streams, n, dup_cells, dup_streams, true, NULL, res, err);
}

int kvc_prefix_insert_upto_from(kvc_prefix *idx, kvc_prefix_handle h, uint32_t off, const int32_t *tokens,
                                const uint32_t *cells, const uint32_t *streams, uint32_t n, uint32_t *dup_cells,
                                uint32_t *dup_streams, kvc_prefix_inserted *res, kvc_err *err) {
    if (!kvc_prefix_handle_valid(idx, h) || off == 0 || off > idx->nodes[h.node].len ||
        idx->nodes[h.node].depth + off > n) {
        *res = (kvc_prefix_inserted){ 0 };
        return kvc_err_set(err, KVC_E_ARG, "an insert resumed at %u tokens of a node it does not name", off);
    }
    /* a walk resumed at a node never goes back to its root, and never needs the salt to find it */
    const prefix_walk from = { NIL, h.node, off, idx->nodes[h.node].depth + off };
    return insert(idx, 0, tokens, cells, streams, n, dup_cells, dup_streams, true, &from, res, err);
}

bool kvc_prefix_handle_valid(const kvc_prefix *idx, kvc_prefix_handle h) {
    return h.node != NIL && h.node < idx->n_slots && idx->nodes[h.node].live && !idx->nodes[h.node].root &&
           idx->nodes[h.node].gen == h.gen;
}

/* Change the locks (pin false) or pins of h's node by +1 or -1. */
static int protect(kvc_prefix *idx, kvc_prefix_handle h, bool pin, int by, kvc_err *err) {
    if (h.node == NIL && h.gen == 0) {
        return KVC_OK;
    }
    if (!kvc_prefix_handle_valid(idx, h)) {
        return kvc_err_set(err, KVC_E_ARG, "the prefix handle (%u, %u) is stale: its node was evicted, removed or cleared",
                           h.node, h.gen);
    }
    kvc_prefix_node *n = &idx->nodes[h.node];
    uint32_t *own = pin ? &n->n_pin : &n->n_lock;
    if (by > 0) {
        /* the node below the root counts every lock and pin of its subtree */
        uint32_t top = h.node;
        while (!idx->nodes[idx->nodes[top].parent].root) {
            top = idx->nodes[top].parent;
        }
        if (idx->nodes[top].prot == UINT32_MAX) {
            return kvc_err_set(err, KVC_E_ARG, "the prefix handle (%u, %u): 2**32 - 1 locks and pins on its path",
                               h.node, h.gen);
        }
        (*own)++;
        prot_add(idx, h.node, 1);
        return KVC_OK;
    }
    if (*own == 0) {
        return kvc_err_set(err, KVC_E_ARG, "the prefix handle (%u, %u) holds no %s", h.node, h.gen, pin ? "pin" : "lock");
    }
    (*own)--;
    prot_sub(idx, h.node, 1);
    return KVC_OK;
}

int kvc_prefix_lock(kvc_prefix *idx, kvc_prefix_handle h, kvc_err *err) { return protect(idx, h, false, 1, err); }
int kvc_prefix_unlock(kvc_prefix *idx, kvc_prefix_handle h, kvc_err *err) { return protect(idx, h, false, -1, err); }
int kvc_prefix_pin(kvc_prefix *idx, kvc_prefix_handle h, kvc_err *err) { return protect(idx, h, true, 1, err); }
int kvc_prefix_unpin(kvc_prefix *idx, kvc_prefix_handle h, kvc_err *err) { return protect(idx, h, true, -1, err); }

uint32_t kvc_prefix_evict(kvc_prefix *idx, uint32_t n_cells) {
    idx->n_freed = 0;
    return evict_walk(idx, n_cells);
}

/* Drop node i's tokens from `from` on and everything below it. */
static void truncate_at(kvc_prefix *idx, uint32_t x, uint32_t from) {
    /* the cells, top down: x's tail, then its subtree in pre-order */
    edge_let_go(idx, x, from);
    uint32_t dropped_prot = 0;
    for (uint32_t i = idx->nodes[x].first_child; i != NIL;) {
        edge_let_go(idx, i, 0);
        dropped_prot += idx->nodes[i].n_lock + idx->nodes[i].n_pin;
        if (idx->nodes[i].first_child != NIL) {
            i = idx->nodes[i].first_child;
            continue;
        }
        while (i != x && idx->nodes[i].next_sib == NIL) {
            i = idx->nodes[i].parent;
        }
        i = i == x ? NIL : idx->nodes[i].next_sib;
    }
    /* the nodes below x, leaves first */
    uint32_t i = x;
    while (idx->nodes[x].n_child > 0) {
        while (idx->nodes[i].first_child != NIL) {
            i = idx->nodes[i].first_child;
        }
        const uint32_t p = idx->nodes[i].parent;
        leaf_drop(idx, i);
        i = p;
    }
    kvc_prefix_node *n = &idx->nodes[x];
    const uint32_t parent = n->parent;
    if (from == 0) {
        dropped_prot += n->n_lock + n->n_pin;
        leaf_drop(idx, x);
        if (dropped_prot > 0 && idx->nodes[parent].live && !idx->nodes[parent].root) {
            prot_sub(idx, parent, dropped_prot);
        }
        return;
    }
    const uint32_t cut = n->len - from;
    n->len = from;
    idx->n_held -= cut;
    if (n->prot == 0) {
        idx->n_evictable -= cut;
    }
    if (dropped_prot > 0) {
        prot_sub(idx, x, dropped_prot);
    }
}

uint32_t kvc_prefix_remove_cells(kvc_prefix *idx, const uint32_t *cells, const uint32_t *streams, uint32_t n) {
    idx->n_freed = 0;
    for (uint32_t i = 0; i < n; i++) {
        if (cell_in_range(idx, streams[i], cells[i])) {
            kvc_prefix_place *pl = place_of(idx, streams[i], cells[i]);
            if (pl->node != NIL) {
                pl->depth |= KVC_PREFIX_MARK;
            }
        }
    }
    for (uint32_t i = 0; i < n; i++) {
        if (!cell_in_range(idx, streams[i], cells[i])) {
            continue;
        }
        const kvc_prefix_place pl = *place_of(idx, streams[i], cells[i]);
        if (pl.node != NIL) {
            truncate_at(idx, pl.node, (pl.depth & ~KVC_PREFIX_MARK) - idx->nodes[pl.node].depth);
        }
    }
    return idx->n_freed;
}

int kvc_prefix_move_cell(kvc_prefix *idx, uint32_t st, uint32_t from, uint32_t to, kvc_err *err) {
    if (!cell_in_range(idx, st, from) || !cell_in_range(idx, st, to) || place_of(idx, st, from)->node == NIL ||
        place_of(idx, st, to)->node != NIL) {
        return kvc_err_set(err, KVC_E_ARG, "moving cell %u to %u of stream %u: not a held cell to a free one", from,
                           to, st);
    }
    kvc_prefix_place *pf = place_of(idx, st, from);
    kvc_prefix_node *n = &idx->nodes[pf->node];
    n->cell[pf->depth - n->depth] = to;
    *place_of(idx, st, to) = *pf;
    pf->node = NIL;
    pf->depth = 0;
    return KVC_OK;
}

uint32_t kvc_prefix_freed(const kvc_prefix *idx, const uint32_t **cells, const uint32_t **streams) {
    if (cells) {
        *cells = idx->freed_cell;
    }
    if (streams) {
        *streams = idx->freed_strm;
    }
    return idx->n_freed;
}

/* --- the checker ------------------------------------------------------------------------------- */

#define CHECK_THAT(cond, ...)                                                  \
    do {                                                                       \
        if (!(cond)) {                                                         \
            kvc_free(pos);                                                     \
            return kvc_err_set(err, KVC_E_INTERNAL, __VA_ARGS__);              \
        }                                                                      \
    } while (0)

int kvc_prefix_check(const kvc_prefix *idx, kvc_err *err) {
    uint32_t *pos = kvc_calloc(idx->n_slots, sizeof *pos);   /* 1 + place in the LRU list */
    if (!pos) {
        return kvc_err_set(err, KVC_E_NOMEM, "out of memory checking a prefix index");
    }
    /* the free list */
    uint32_t n_free = 0;
    for (uint32_t i = idx->free_head; i != NIL; i = idx->nodes[i].next_sib) {
        CHECK_THAT(i < idx->n_slots && !idx->nodes[i].live && n_free < idx->n_slots, "free list: slot %u", i);
        n_free++;
    }
    CHECK_THAT(n_free == idx->n_free, "free list: %u slots, counted %u", n_free, idx->n_free);
    /* the LRU list: unprotected nodes, each after its children */
    uint32_t n_lru = 0;
    for (uint32_t i = idx->nodes[NIL].lru_next, prev = NIL; i != NIL; prev = i, i = idx->nodes[i].lru_next) {
        CHECK_THAT(i < idx->n_slots && n_lru < idx->n_slots, "LRU list: slot %u out of range or a cycle", i);
        const kvc_prefix_node *n = &idx->nodes[i];
        CHECK_THAT(n->live && !n->root && n->prot == 0, "LRU list: node %u is not an unprotected edge", i);
        CHECK_THAT(n->lru_prev == prev, "LRU list: node %u's previous is %u, not %u", i, n->lru_prev, prev);
        CHECK_THAT(pos[i] == 0, "LRU list: node %u twice", i);
        pos[i] = ++n_lru;
        for (uint32_t c = n->first_child; c != NIL; c = idx->nodes[c].next_sib) {
            CHECK_THAT(c < idx->n_slots && pos[c] != 0, "LRU list: node %u comes before its child %u", i, c);
        }
    }
    CHECK_THAT(idx->nodes[NIL].lru_prev == NIL || pos[idx->nodes[NIL].lru_prev] == n_lru, "LRU list: wrong tail");
    /* every node */
    uint32_t live = 0, held = 0, evictable = 0, nodes = 0, unprot = 0;
    for (uint32_t i = 1; i < idx->n_slots; i++) {
        const kvc_prefix_node *n = &idx->nodes[i];
        if (!n->live) {
            continue;
        }
        live++;
        CHECK_THAT(!n->on_path, "node %u is still marked as on an insert's path", i);
        uint32_t kids = 0, kids_prot = 0, prev = NIL;
        for (uint32_t c = n->first_child; c != NIL; prev = c, c = idx->nodes[c].next_sib) {
            CHECK_THAT(c < idx->n_slots && kids < idx->n_slots, "node %u: child list broken", i);
            const kvc_prefix_node *ch = &idx->nodes[c];
            CHECK_THAT(ch->live && !ch->root && ch->parent == i && ch->prev_sib == prev,
                       "node %u: child %u does not link back", i, c);
            kids++;
            kids_prot += ch->prot;
        }
        CHECK_THAT(kids == n->n_child && n->last_child == prev, "node %u: %u children listed, %u counted", i, kids,
                   n->n_child);
        if (n->root) {
            CHECK_THAT(n->len == 0 && n->parent == NIL && n->prot == 0 && n->n_lock == 0 && n->n_pin == 0,
                       "root %u has tokens, a parent or protection", i);
            CHECK_THAT(kids > 0, "root %u (salt %llu) has no children", i, (unsigned long long)n->label);
            CHECK_THAT(table_find(idx, NIL, n->label) == i, "root %u is not in the child table", i);
            continue;
        }
        nodes++;
        CHECK_THAT(n->len > 0 && n->parent < idx->n_slots && idx->nodes[n->parent].live, "node %u: no tokens or parent", i);
        const kvc_prefix_node *p = &idx->nodes[n->parent];
        CHECK_THAT(n->label == (uint32_t)n->tok[0], "node %u: label %llu, first token %d", i,
                   (unsigned long long)n->label, n->tok[0]);
        CHECK_THAT(table_find(idx, n->parent, n->label) == i, "node %u is not in the child table", i);
        CHECK_THAT(n->depth == (p->root ? 0 : p->depth + p->len), "node %u: depth %u, its parent ends at %u", i,
                   n->depth, p->root ? 0 : p->depth + p->len);
        CHECK_THAT(n->prot == n->n_lock + n->n_pin + kids_prot, "node %u: protection %u, locks %u, pins %u, below %u", i,
                   n->prot, n->n_lock, n->n_pin, kids_prot);
        CHECK_THAT((n->prot == 0) == (pos[i] != 0), "node %u: protection %u but %s the LRU list", i, n->prot,
                   pos[i] ? "in" : "not in");
        for (uint32_t k = 0; k < n->len; k++) {
            CHECK_THAT(cell_in_range(idx, n->strm[k], n->cell[k]), "node %u: cell %u of stream %u out of range", i,
                       n->cell[k], n->strm[k]);
            const kvc_prefix_place *pl = place_of(idx, n->strm[k], n->cell[k]);
            CHECK_THAT(pl->node == i && pl->depth == n->depth + k,
                       "cell %u of stream %u: held by node %u at %u, placed at node %u, %u", n->cell[k], n->strm[k], i,
                       n->depth + k, pl->node, pl->depth);
        }
        held += n->len;
        if (n->prot == 0) {
            evictable += n->len;
            unprot++;
        }
    }
    CHECK_THAT(live + n_free + 1 == idx->n_slots, "%u live and %u free slots of %u", live, n_free, idx->n_slots);
    CHECK_THAT(unprot == n_lru, "%u unprotected nodes, %u in the LRU list", unprot, n_lru);
    CHECK_THAT(held == idx->n_held && evictable == idx->n_evictable && nodes == idx->n_nodes,
               "counted %u cells held, %u evictable, %u nodes; the index says %u, %u, %u", held, evictable, nodes,
               idx->n_held, idx->n_evictable, idx->n_nodes);
    uint32_t used = 0;
    for (uint32_t s = 0; s < idx->table_size; s++) {
        const kvc_prefix_slot *t = &idx->table[s];
        if (t->child == NIL) {
            continue;
        }
        used++;
        CHECK_THAT(t->child < idx->n_slots && idx->nodes[t->child].live && idx->nodes[t->child].parent == t->parent &&
                       idx->nodes[t->child].label == t->label && idx->nodes[t->child].root == (t->parent == NIL),
                   "child table: slot %u names node %u wrongly", s, t->child);
    }
    CHECK_THAT(used == idx->table_used && used == live && used * 2 <= idx->table_size,
               "child table: %u entries, counted %u, %u live nodes, size %u", used, idx->table_used, live,
               idx->table_size);
    uint64_t placed = 0;
    const uint64_t total = (uint64_t)idx->n_stream * idx->n_cells;
    for (uint64_t c = 0; c < total; c++) {
        placed += idx->place[c].node != NIL;
        CHECK_THAT(!(idx->place[c].depth & KVC_PREFIX_MARK), "cell %llu still marked", (unsigned long long)c);
    }
    CHECK_THAT(placed == held, "%llu cells placed, %u held", (unsigned long long)placed, held);
    kvc_free(pos);
    return KVC_OK;
}
