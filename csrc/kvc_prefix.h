/* kvcache — a prefix index: which cells already hold the K/V of which token prefixes, so that a
 * new request reuses the longest one instead of computing it again (what vLLM does with hashed
 * blocks, SGLang with a radix tree, llama.cpp's server with its prompt cache). Self-contained: it
 * knows cells only as (stream, cell) pairs and never touches a cache; placing the matched cells
 * in a sequence, and freeing the cells it hands back, is its caller's part.
 *
 * A radix tree over token ids with one token per cell, not a table of hashed blocks: kvcache's
 * cells are pages of one token, so a prefix is found exactly at any length (no rounding down to a
 * block), and a lookup costs what it matches (O(tokens matched), one child lookup per edge), not
 * a hash per block over the whole prompt. Each edge holds a run of tokens and, per token, the
 * (stream, cell) holding its K/V. Every namespace has its own root, keyed by a 64-bit salt
 * (tenant, LoRA adapter, multimodal hash; 0 = none): two prompts share cells only under the same
 * salt.
 *
 * Keeping and letting go:
 * - a live sequence attached to a prefix holds a lock on its node (kvc_prefix_lock), an operator
 *   may pin one (kvc_prefix_pin): a node with a lock or pin at or below it is protected, and so is
 *   every node above it, and is never evicted;
 * - eviction takes unprotected leaves, least recently used first, whole nodes at a time; a node
 *   whose last child goes becomes a leaf and takes its turn. Use is a match, an insert, or a
 *   node's last lock or pin going (the sequence that held it just used it); each moves the nodes
 *   of the path, deepest first, to the recent end of one list of the unprotected nodes. That list
 *   is the order: no ties, no pointers compared, and its oldest node is always a leaf (a node
 *   only ever moves with its ancestors behind it);
 * - a cap bounds the cells the index holds: an insert past it evicts first, or fails with
 *   KVC_E_NOSPACE, unchanged, when only protected nodes (or its own path) stand in the way.
 *
 * Costs: insert and match O(tokens touched), lock and pin O(path nodes), evict O(cells evicted),
 * remove O(cells dropped); the node pool and the child table grow by doubling (amortized); clear
 * O(cells of the cache). Memory: 16 bytes per cell of the cache (where each lies, and room to
 * list every cell it lets go, so that evict and remove never allocate), 12 per token held, a node
 * per edge.
 * Failures leave the index as it was: an insert reserves every allocation before it changes
 * anything. Not thread-safe: the caller serializes (as it does for the cache). */
#ifndef KVC_PREFIX_H
#define KVC_PREFIX_H

#include "kvc_common.h"

#ifdef __cplusplus
extern "C" {
#endif

/* A node of the tree, as a handle: valid until the node is evicted, removed or cleared (a
 * split keeps it valid: the handle stays with the deeper part, which the old path passes
 * through). {0, 0} is no node (the handle of an empty match). */
typedef struct kvc_prefix_handle {
    uint32_t node;   /* slot in the node pool, 0 for none */
    uint32_t gen;    /* the slot's generation when the handle was made */
} kvc_prefix_handle;

/* A node: a root (a salt's, no tokens) or an edge of len tokens below its parent. */
typedef struct kvc_prefix_node {
    uint64_t  label;         /* roots: the salt; others: the first token (as uint32) */
    int32_t  *tok;           /* [len] the edge's tokens */
    uint32_t *cell;          /* [len] the cell holding each token's K/V */
    uint32_t *strm;          /* [len] its stream */
    void     *mem;           /* the allocation tok/cell/strm lie in (a split advances them in it) */
    uint32_t  len;           /* tokens of the edge (0 for roots) */
    uint32_t  depth;         /* tokens above the edge's first (its position in the prompt) */
    uint32_t  parent;        /* parent slot; 0 for roots */
    uint32_t  first_child;   /* children: a list in the order they came (a split node takes its
                              * child's place), for the walks of remove and check; 0: none */
    uint32_t  last_child;    /* the list's last, where a new child goes */
    uint32_t  next_sib;      /* next sibling, or 0; on the free list: the next free slot */
    uint32_t  prev_sib;      /* previous sibling, or 0 */
    uint32_t  n_child;       /* children */
    uint32_t  prot;          /* locks and pins of this node and every node below it */
    uint32_t  n_lock;        /* locks of this node */
    uint32_t  n_pin;         /* pins of this node */
    uint32_t  lru_prev;      /* neighbours in the list of unprotected nodes (slot 0 is its head) */
    uint32_t  lru_next;
    uint32_t  gen;           /* bumped when the slot is freed: stale handles are refused */
    bool      live;          /* in use (a root or an edge) */
    bool      root;          /* a salt's root */
    bool      on_path;       /* during an insert: on its own path, which its eviction spares */
} kvc_prefix_node;

/* Where a held cell lies: node slot (0: not held) and the token's position in its prompt. */
typedef struct kvc_prefix_place {
    uint32_t node;
    uint32_t depth;   /* KVC_PREFIX_MARK set: named by the remove in progress */
} kvc_prefix_place;
#define KVC_PREFIX_MARK 0x80000000u

/* One slot of the child table: the child of `parent` whose label is `label` (parent 0: the
 * root of salt `label`). Open addressing, linear probing, deletion by backward shift. */
typedef struct kvc_prefix_slot {
    uint64_t label;
    uint32_t parent;
    uint32_t child;   /* 0: empty */
} kvc_prefix_slot;

/* Write-back at eviction (optional, off by default): each node eviction takes records the
 * whole prompt it ends (the salt, and from the root on each token with its cell and stream) in
 * a pending list that the caller drains after the operation (kvc_prefix_spill_take), before
 * anything writes into the freed cells: placement only chooses cells, so their K/V are intact
 * until the caller stores the new rows. Recording copies a path (no call out of the index);
 * memory that cannot be had loses the record (counted), never the eviction. */
typedef struct kvc_prefix_spill {
    uint32_t  n;          /* prompts pending */
    uint32_t  cap;        /* records room */
    uint64_t *salt;       /* [cap] each prompt's salt */
    uint32_t *start;      /* [cap + 1] each prompt's first token in tok / cell / strm */
    int32_t  *tok;        /* [cap_tok] the prompts' tokens, one after the other */
    uint32_t *cell;       /* [cap_tok] their cells */
    uint32_t *strm;       /* [cap_tok] their streams */
    uint32_t  cap_tok;
    uint32_t  min_len;    /* shorter prompts are not recorded */
    uint64_t  n_lost;     /* prompts not recorded (no memory) */
} kvc_prefix_spill;

typedef struct kvc_prefix {
    kvc_prefix_node  *nodes;       /* [n_slots] the pool; slot 0 is the head of the LRU list */
    uint32_t          n_slots;     /* slots allocated */
    uint32_t          free_head;   /* first free slot (linked by next_sib), 0 when none */
    uint32_t          n_free;      /* free slots */
    kvc_prefix_slot  *table;       /* [table_size] the child table */
    uint32_t          table_size;  /* a power of two, at least twice the live nodes */
    uint32_t          table_used;  /* entries (= live nodes, roots included) */
    kvc_prefix_place *place;       /* [n_stream * n_cells] where each cell lies */
    uint32_t         *freed_cell;  /* [n_stream * n_cells] cells let go by the last evict or remove */
    uint32_t         *freed_strm;  /* [n_stream * n_cells] their streams */
    uint32_t          n_freed;     /* entries of freed_cell / freed_strm */
    uint32_t          n_stream;    /* streams of the cells it may hold */
    uint32_t          n_cells;     /* cells per stream */
    uint32_t          cap;         /* the most cells it may hold; 0: no cap */
    uint32_t          n_held;      /* cells held */
    uint32_t          n_evictable; /* cells of unprotected nodes */
    uint32_t          n_nodes;     /* nodes with tokens (roots not counted) */
    uint64_t          n_lock_released; /* slots released that held a lock (kvc_prefix_clear
                                    * counts one): a lock's handle goes stale only when this grows */
    kvc_prefix_spill *spill;       /* write-back at eviction, NULL: off */
} kvc_prefix;

/* An index of cells of n_stream streams of n_cells cells each (n_stream * n_cells at most
 * 2**31), holding at most cap cells (0: no cap). KVC_OK, KVC_E_ARG, KVC_E_NOMEM. */
int  kvc_prefix_init(kvc_prefix *idx, uint32_t n_stream, uint32_t n_cells, uint32_t cap, kvc_err *err);
void kvc_prefix_free(kvc_prefix *idx);   /* safe on a zeroed index */
/* dst: a copy of src that shares no memory with it and records no write-back (its spill is off),
 * for a dry run that evicts from the copy and leaves src as it was; handles of src are handles
 * of the copy. KVC_OK, or KVC_E_NOMEM with dst zeroed. Free it with kvc_prefix_free. */
int  kvc_prefix_copy(kvc_prefix *dst, const kvc_prefix *src);
/* Forget everything (the cache was cleared or read from a state): every handle goes stale, no
 * cell is handed back. */
void kvc_prefix_clear(kvc_prefix *idx);
/* Set the cap (0: none). It is enforced by the next insert; kvc_prefix_evict brings the index
 * under it now. */
void kvc_prefix_set_cap(kvc_prefix *idx, uint32_t cap);

/* What an insert did. */
typedef struct kvc_prefix_inserted {
    uint32_t n_present;   /* leading tokens the index held already (their cells are kept) */
    uint32_t n_dup;       /* of those, the ones whose cell the caller passed is another: the
                           * caller's cells to free, in dup_cells / dup_streams */
    uint32_t n_added;     /* tokens whose cells the index took: n - n_present */
    uint32_t n_evicted;   /* cells evicted to stay under the cap: kvc_prefix_freed */
    kvc_prefix_handle end;   /* the node holding the last token ({0, 0} when n is 0) */
} kvc_prefix_inserted;

/* Record that cells[i] of stream streams[i] holds the K/V of tokens[i], i < n, the prompt under
 * salt. Where the index holds a prefix of it already, its cells are kept: the caller's cells
 * for those tokens that differ go to dup_cells / dup_streams (room for n), for the caller to
 * free. The cells the index takes must be held nowhere in it and named once; a cell the index
 * holds for the same token may be passed back (a sequence attached to a match). Past the cap,
 * the least recently used unprotected nodes off the prompt's path are evicted first
 * (kvc_prefix_freed: the caller frees them). The prompt's path is touched.
 * KVC_OK; KVC_E_ARG (a cell out of range, held for another token or named twice);
 * KVC_E_NOSPACE (the cap cannot be met without a protected node); KVC_E_NOMEM; nothing changed
 * on failure. */
int  kvc_prefix_insert(kvc_prefix *idx, uint64_t salt, const int32_t *tokens, const uint32_t *cells,
                       const uint32_t *streams, uint32_t n, uint32_t *dup_cells, uint32_t *dup_streams,
                       kvc_prefix_inserted *res, kvc_err *err);

/* What a release keeps: kvc_prefix_match of the whole prompt (its path touched), then
 * kvc_prefix_insert of its longest prefix that ends before the first cell the index holds for
 * another token (a cell of the prompt is one the index can take, or the index's own cell of that
 * token). The caller vouches that its cells are distinct (a sequence's cells: each sits at one
 * position): they are not marked, and a cell named twice is not told. The tokens kept:
 * res->n_present + res->n_added (0: nothing inserted). KVC_E_ARG only for a cell out of range;
 * else as kvc_prefix_insert. */
int  kvc_prefix_insert_upto(kvc_prefix *idx, uint64_t salt, const int32_t *tokens, const uint32_t *cells,
                            const uint32_t *streams, uint32_t n, uint32_t *dup_cells, uint32_t *dup_streams,
                            kvc_prefix_inserted *res, kvc_err *err);

/* kvc_prefix_insert_upto of a prompt whose first tokens the caller knows the index holds with the
 * caller's own cells: the path down to the first `off` tokens of h's edge, under h's salt (a
 * sequence's cells that are, cell for cell, the prefix it attached). The walk and the checks
 * start there, so that they cost the tokens past it; tokens, cells and streams are indexed from
 * the prompt's first token all the same (those before the resumed point are not read).
 * KVC_E_ARG also for a stale h, off 0 or past h's edge, or n short of the resumed point. */
int  kvc_prefix_insert_upto_from(kvc_prefix *idx, kvc_prefix_handle h, uint32_t off, const int32_t *tokens,
                                 const uint32_t *cells, const uint32_t *streams, uint32_t n, uint32_t *dup_cells,
                                 uint32_t *dup_streams, kvc_prefix_inserted *res, kvc_err *err);

/* The longest prefix of tokens[0, min(n, max_len)) the index holds under salt: its length; the
 * cells and streams of its tokens in out_cells / out_streams (room for that many; either may be
 * NULL), the node holding its last token in *end ({0, 0} for none). The path is touched. A
 * caller that must compute at least one token passes max_len = n - 1. */
uint32_t kvc_prefix_match(kvc_prefix *idx, uint64_t salt, const int32_t *tokens, uint32_t n, uint32_t max_len,
                          uint32_t *out_cells, uint32_t *out_streams, kvc_prefix_handle *end);

/* Whether h names a node (not stale, not {0, 0}). */
bool kvc_prefix_handle_valid(const kvc_prefix *idx, kvc_prefix_handle h);
/* A lock on h's node (a sequence attached to its prefix): it and its path are not evicted until
 * the lock goes. Locks and pins count. KVC_OK ({0, 0}: nothing to do), KVC_E_ARG (a stale
 * handle; for unlock and unpin also a node without a lock or pin). A last lock or pin going
 * touches the nodes it leaves unprotected. */
int  kvc_prefix_lock(kvc_prefix *idx, kvc_prefix_handle h, kvc_err *err);
int  kvc_prefix_unlock(kvc_prefix *idx, kvc_prefix_handle h, kvc_err *err);
/* A pin on h's node: as a lock, for prefixes kept on purpose (a system prompt). */
int  kvc_prefix_pin(kvc_prefix *idx, kvc_prefix_handle h, kvc_err *err);
int  kvc_prefix_unpin(kvc_prefix *idx, kvc_prefix_handle h, kvc_err *err);

/* Evict unprotected nodes, least recently used first, until n_cells cells are freed or none is
 * left; returns the cells freed, which kvc_prefix_freed lists in the order they went (each
 * node's tokens in order). */
uint32_t kvc_prefix_evict(kvc_prefix *idx, uint32_t n_cells);

/* The cache let go of cells[i] of streams[i], i < n, by other means (overwritten, freed): the
 * index drops every token from each such cell on (the rest of its edge and everything below),
 * locks and pins there included (their handles go stale; the nodes above that lose their last
 * protection are touched). Cells it does not hold are ignored; out-of-range ones too. Returns
 * the cells dropped that were not named (kvc_prefix_freed lists them: the caller frees them),
 * each edge's tokens in order, an edge before its children, children in the order they came. */
uint32_t kvc_prefix_remove_cells(kvc_prefix *idx, const uint32_t *cells, const uint32_t *streams, uint32_t n);

/* The token held in cell `from` of stream st is held in cell `to` of the same stream from now on
 * (to: held nowhere in the index). Nothing else changes: the tree, protection, recency, the
 * counters. KVC_OK; KVC_E_ARG (from not held, to held or either out of range; nothing changed). */
int  kvc_prefix_move_cell(kvc_prefix *idx, uint32_t st, uint32_t from, uint32_t to, kvc_err *err);

/* The cells the last kvc_prefix_evict, kvc_prefix_remove_cells or successful kvc_prefix_insert
 * let go (none for an insert that evicted nothing; valid until the next of those calls): their
 * count, with *cells and *streams set. */
uint32_t kvc_prefix_freed(const kvc_prefix *idx, const uint32_t **cells, const uint32_t **streams);

/* Write-back at eviction on (prompts of at least min_len tokens recorded; KVC_OK or
 * KVC_E_NOMEM) or off (on = false: the pending records go). */
int  kvc_prefix_spill_set(kvc_prefix *idx, bool on, uint32_t min_len, kvc_err *err);
/* The pending records (NULL when write-back is off): read them, then kvc_prefix_spill_clear. */
static inline const kvc_prefix_spill *kvc_prefix_spill_pending(const kvc_prefix *idx) { return idx->spill; }
void kvc_prefix_spill_clear(kvc_prefix *idx);

/* Where cell i of stream st lies is about to be read (the insert of a prompt naming it). */
static inline void kvc_prefix_prefetch_place(const kvc_prefix *idx, uint32_t st, uint32_t i) {
    KVC_PREFETCH(&idx->place[(size_t)st * idx->n_cells + i]);
}
static inline uint32_t kvc_prefix_n_held(const kvc_prefix *idx) { return idx->n_held; }
static inline uint32_t kvc_prefix_n_evictable(const kvc_prefix *idx) { return idx->n_evictable; }
static inline uint32_t kvc_prefix_n_nodes(const kvc_prefix *idx) { return idx->n_nodes; }
/* The cells of stream st below `size` that evicting every evictable cell would let go and whose
 * bit in busy[] is clear (the cells no live sequence holds too: the room eviction can make
 * there), counted up to `need` (the walk of the unprotected nodes stops there). */
uint32_t kvc_prefix_evictable_in(const kvc_prefix *idx, uint32_t st, uint32_t size, const uint64_t *busy,
                                 uint64_t need);

/* Eviction without evicting, for a dry run (the index unchanged): the order kvc_prefix_evict
 * takes nodes in is the list of unprotected nodes, oldest first, and taking one changes nothing
 * of the order of the rest, so a cursor in that list stands for the evictions so far. */
typedef struct kvc_prefix_dry {
    uint32_t next;        /* the node the next eviction takes first (KVC_PREFIX_DRY_START: the oldest) */
    uint64_t n_taken;     /* cells of the nodes taken so far */
} kvc_prefix_dry;
#define KVC_PREFIX_DRY_START UINT32_MAX
/* What kvc_prefix_evict(n_cells) would free after the evictions d stands for: the nodes it takes,
 * each one's cells passed to fn(ctx, cell, stream) in the order kvc_prefix_freed would list them;
 * d advanced past them. Returns the cells taken. */
uint32_t kvc_prefix_dry_evict(const kvc_prefix *idx, kvc_prefix_dry *d, uint32_t n_cells,
                              void (*fn)(void *ctx, uint32_t cell, uint32_t strm), void *ctx);
/* kvc_prefix_evictable_in after the evictions d stands for; kvc_prefix_n_evictable less d's. */
uint32_t kvc_prefix_dry_evictable_in(const kvc_prefix *idx, const kvc_prefix_dry *d, uint32_t st, uint32_t size,
                                     const uint64_t *busy, uint64_t need);
static inline uint64_t kvc_prefix_dry_n_evictable(const kvc_prefix *idx, const kvc_prefix_dry *d) {
    return (uint64_t)idx->n_evictable - d->n_taken;
}

/* KVC_OK when every invariant holds (each cell held once and placed right, parents, children
 * and the child table agree, protection counts add up, the LRU list holds exactly the
 * unprotected nodes, each after its children, the counters match); KVC_E_INTERNAL with err
 * naming the first that does not. O(index size): for the tests. */
int  kvc_prefix_check(const kvc_prefix *idx, kvc_err *err);

#ifdef __cplusplus
}
#endif

#endif
