/* kvcache — checkpoints of recurrent states: prefix reuse for recurrent and hybrid memories.
 *
 * A recurrent state exists only at the position its sequence reached: the cache cannot give a
 * later request the state after its first P tokens unless a copy of that state was taken when a
 * sequence stood exactly at P. A checkpoint is that copy: every recurrent layer's R row and S row
 * of one state, with the token chain it is the state after (tokens[0 .. P), positions 0 .. P - 1)
 * and a salt. A request resumes from the deepest checkpoint whose chain is a prefix of its own
 * tokens (at most all but its last token: the model needs that token's logits).
 *
 * The pool is bounded: `cap` checkpoints in all (memory cap * state_bytes, owned or the
 * caller's), at most `per_seq` made by one running sequence (its oldest goes first, as llama.cpp's
 * server drops a slot's oldest context checkpoint), the least recently used going first when the
 * pool is full; a pinned checkpoint never goes. Checkpoints are copies: nothing the cache does
 * to its cells (seq_rm, clear, a state read) changes them.
 *
 * Costs: a match walks the request's tokens once (a rolling hash) and the checkpoints once (kept
 * ordered by length), then compares the tokens of the hit; a save copies one state. */
#ifndef KVC_CHECKPOINT_H
#define KVC_CHECKPOINT_H

#include "kvc_common.h"
#include "kvc_recurrent.h"

#ifdef __cplusplus
extern "C" {
#endif

/* A pin: the slot and its generation when pinned. */
typedef struct kvc_ckpt_handle {
    uint32_t slot;
    uint32_t gen;
} kvc_ckpt_handle;

/* Write-back at eviction (optional, off by default): each checkpoint the pool evicts (to make
 * room for a save, by kvc_ckpt_evict) is recorded before its slot is reused, its chain, salt and
 * a copy of its state, in a pending list the caller drains after the operation
 * (kvc_ckpt_spill_clear once read). Only chains of a multiple of `align` tokens are recorded (the
 * store keeps whole chunks). At most `cap` records are pending (the pool's cap: one operation
 * evicts no more); memory that cannot be had, or a full list, loses the record (counted), never
 * the eviction. */
typedef struct kvc_ckpt_spill {
    uint32_t  n;          /* records pending */
    uint32_t  room;       /* records allocated (at most the pool's cap) */
    uint32_t  align;      /* chains of other lengths are not recorded */
    uint64_t  n_lost;     /* evicted checkpoints not recorded */
    uint64_t *salt;       /* [room] */
    uint32_t *n_tok;      /* [room] */
    int32_t **tokens;     /* [room] each chain (the slot's own, taken over) */
    uint8_t  *states;     /* [room * state_bytes] each state as the slot held it */
} kvc_ckpt_spill;

typedef struct kvc_ckpt_pool {
    uint32_t  cap;          /* checkpoints the pool holds at most (>= 1) */
    uint32_t  per_seq;      /* checkpoints one running sequence made that it holds at most (0: cap) */
    uint32_t  n_layer;      /* the recurrent cache's layers */
    size_t    state_bytes;  /* one checkpoint: every layer's R row then S row, layer by layer */
    uint8_t  *data;         /* [cap * state_bytes] */
    bool      owns_data;    /* data is the pool's (freed with it) */
    uint32_t  n_used;       /* checkpoints held */
    uint64_t  clock;        /* the last use stamp given */
    /* per slot (n_tok 0: empty) */
    uint32_t *n_tok;        /* P: the state after tokens[0 .. P) */
    uint64_t *salt;
    uint64_t *hash;         /* kvc_ckpt_hash of the chain */
    int32_t **tokens;       /* [P] the chain (owned) */
    uint64_t *used_at;      /* last use (LRU) */
    uint64_t *made_at;      /* when it was made (a sequence's oldest goes first) */
    uint32_t *pins;
    int32_t  *owner;        /* the running sequence that made it, -1 once that sequence ended */
    uint32_t *gen;          /* bumped when the slot is emptied (stale pins are refused) */
    uint32_t *order;        /* [n_used] the held slots by ascending P (then slot) */
    kvc_ckpt_spill *spill;  /* write-back at eviction, NULL: off */
} kvc_ckpt_pool;

/* Bytes of one checkpoint of cache c (every layer's K row and V row of one cell). */
size_t kvc_ckpt_state_bytes(const kvc_recurrent *c);

/* An empty pool for cache c: cap checkpoints, per_seq per running sequence (0: no bound but cap).
 * memory: the caller's cap * state_bytes bytes (memory_len of them), or NULL for the pool's own.
 * KVC_OK; KVC_E_ARG (cap 0, per_seq > cap, memory too small, a cache of semantics 2025, a cache
 * holding no memory); KVC_E_NOMEM. */
int  kvc_ckpt_init(kvc_ckpt_pool *p, const kvc_recurrent *c, uint32_t cap, uint32_t per_seq, uint8_t *memory,
                   size_t memory_len, kvc_err *err);
void kvc_ckpt_free(kvc_ckpt_pool *p);

/* The polynomial hash of a token chain (the pool's key beside the length and the salt). */
uint64_t kvc_ckpt_hash(const int32_t *tokens, uint32_t n);

/* The tokens sequence s's state is the state after: pos + 1 of them (its position pos), or 0 when
 * s holds no state. */
uint32_t kvc_ckpt_seq_len(const kvc_recurrent *c, int32_t s);

/* Checkpoint sequence s's state (the snapshot plane a pending rollback reads, else plane 0) as the
 * state after tokens[0 .. P), P = its position + 1 (n >= P; later tokens are not used). An equal
 * chain already held is only touched. *n_kept = P, or 0 when every slot it could take is pinned.
 * copy: a malloc'd buffer of P tokens the pool takes over (freed when not needed), or NULL: the
 * pool allocates it. KVC_OK; KVC_E_ARG (s not a sequence id or holding no state, n < P);
 * KVC_E_NOMEM. Nothing changes on an error. */
int  kvc_ckpt_save(kvc_ckpt_pool *p, const kvc_recurrent *c, int32_t s, uint64_t salt, const int32_t *tokens,
                   uint32_t n, int32_t *copy, uint32_t *n_kept, kvc_err *err);

/* The slot of the deepest checkpoint under salt whose chain is a prefix of tokens[0 .. n) of at
 * most `limit` tokens, or -1. Changes nothing. */
int32_t kvc_ckpt_find(const kvc_ckpt_pool *p, uint64_t salt, const int32_t *tokens, uint32_t n, uint32_t limit);
/* The slot holding exactly the chain tokens[0 .. n) under salt, or -1. */
int32_t kvc_ckpt_find_exact(const kvc_ckpt_pool *p, uint64_t salt, const int32_t *tokens, uint32_t n);
/* Mark slot used now (LRU). */
void kvc_ckpt_touch(kvc_ckpt_pool *p, uint32_t slot);

/* The length of the deepest checkpoint a request of tokens[0 .. n) can resume from (at most
 * n - 1), touched; 0 when none. */
uint32_t kvc_ckpt_match(kvc_ckpt_pool *p, uint64_t salt, const int32_t *tokens, uint32_t n);

/* Sequence s (holding no state) takes the state of slot's checkpoint, at position P - 1: a cell
 * placed as the sequence state reader places one, the rows copied into it. KVC_OK; KVC_E_ARG (s
 * holds a state), KVC_E_NOSPACE (no cell): nothing changed. kvc_recurrent_unplace undoes it. */
int  kvc_ckpt_restore(kvc_ckpt_pool *p, kvc_recurrent *c, int32_t s, uint32_t slot, kvc_err *err);
/* kvc_ckpt_restore in two steps, for a composite cache whose other part may still fail in
 * between: place (the cell table only: *cell, undone by kvc_recurrent_unplace), then fill (the
 * rows copied into *cell, the checkpoint touched). */
int  kvc_ckpt_place(kvc_ckpt_pool *p, kvc_recurrent *c, int32_t s, uint32_t slot, uint32_t *cell, kvc_err *err);
void kvc_ckpt_fill(kvc_ckpt_pool *p, kvc_recurrent *c, uint32_t slot, uint32_t cell);

/* The prefix store's access to states (docs/store.md): states as bytes of the checkpoint layout
 * (kvc_ckpt_state_bytes: every layer's R row then S row). */
/* Copy the state s's next step reads (as kvc_ckpt_save takes it) into out; returns the tokens it
 * is the state after (its position + 1), 0 when s holds no state (out untouched). */
uint32_t kvc_ckpt_copy_seq(const kvc_recurrent *c, int32_t s, uint8_t *out);
/* Copy the checkpoint of exactly tokens[0 .. n) under salt into out; false when none is held
 * (nothing changes either way: not a use). */
bool kvc_ckpt_copy_out(const kvc_ckpt_pool *p, uint64_t salt, const int32_t *tokens, uint32_t n, uint8_t *out);
/* Sequence s (holding no state) takes state, the state after n_tok tokens, at position n_tok - 1,
 * placed as kvc_ckpt_restore places a checkpoint. KVC_OK; KVC_E_ARG (s holds a state, n_tok 0),
 * KVC_E_NOSPACE (no cell): nothing changed. kvc_recurrent_unplace undoes it. */
int  kvc_ckpt_restore_state(kvc_recurrent *c, int32_t s, uint32_t n_tok, const uint8_t *state, kvc_err *err);

/* A new request in s: from now on s's checkpoints are no longer its own (per_seq counts afresh). */
void kvc_ckpt_disown(kvc_ckpt_pool *p, int32_t s);

/* Match tokens[0 .. n) and restore the hit into s: *n_attached = its length (0: none, nothing
 * changed). Errors as kvc_ckpt_restore; KVC_E_ARG also for s not a sequence id. */
int  kvc_ckpt_attach(kvc_ckpt_pool *p, kvc_recurrent *c, int32_t s, uint64_t salt, const int32_t *tokens,
                     uint32_t n, uint32_t *n_attached, kvc_err *err);

/* Sequence s ends: its state is checkpointed (when it holds one and n > 0; as kvc_ckpt_save) and
 * the sequence leaves the cache (seq_rm(s)). KVC_OK with *n_kept; KVC_E_ARG (s not a sequence
 * id, as kvc_ckpt_save) / KVC_E_NOMEM (nothing changed). */
int  kvc_ckpt_release(kvc_ckpt_pool *p, kvc_recurrent *c, int32_t s, uint64_t salt, const int32_t *tokens,
                      uint32_t n, uint32_t *n_kept, kvc_err *err);

/* Pin the checkpoint of exactly tokens[0 .. n) (KVC_E_ARG when none is held): never evicted until
 * unpinned; pins count. */
int  kvc_ckpt_pin(kvc_ckpt_pool *p, uint64_t salt, const int32_t *tokens, uint32_t n, kvc_ckpt_handle *pin,
                  kvc_err *err);
/* Whether pin is a pin of a checkpoint held now (what kvc_ckpt_unpin accepts). */
bool kvc_ckpt_pin_held(const kvc_ckpt_pool *p, kvc_ckpt_handle pin);
/* KVC_OK; KVC_E_ARG (not a pin of this pool's checkpoints now). */
int  kvc_ckpt_unpin(kvc_ckpt_pool *p, kvc_ckpt_handle pin, kvc_err *err);

/* Drop up to n unpinned checkpoints, least recently used first; returns how many went. */
uint32_t kvc_ckpt_evict(kvc_ckpt_pool *p, uint32_t n);
/* Write-back at eviction on (align >= 1: only chains of a multiple of align tokens) or off (the
 * pending records go). KVC_OK; KVC_E_ARG (align 0); KVC_E_NOMEM (nothing changed). */
int  kvc_ckpt_spill_set(kvc_ckpt_pool *p, bool on, uint32_t align, kvc_err *err);
/* Forget the pending records (their chains are freed). */
void kvc_ckpt_spill_clear(kvc_ckpt_pool *p);
/* Record k's state (p->state_bytes bytes). */
static inline const uint8_t *kvc_ckpt_spill_state(const kvc_ckpt_pool *p, uint32_t k) {
    return p->spill->states + (size_t)k * p->state_bytes;
}

/* Checkpoints pinned now. */
uint32_t kvc_ckpt_n_pinned(const kvc_ckpt_pool *p);
/* KVC_OK, or KVC_E_INTERNAL with err when the pool's records disagree (for tests). */
int  kvc_ckpt_check(const kvc_ckpt_pool *p, kvc_err *err);

#ifdef __cplusplus
}
#endif

#endif
