#include "kvc_checkpoint.h"

#include <stdlib.h>
#include <string.h>

size_t kvc_ckpt_state_bytes(const kvc_recurrent *c) {
    size_t n = 0;
    for (uint32_t il = 0; il < c->n_layer; il++) {
        n += c->layers[il].k_row_bytes + c->layers[il].v_row_bytes;
    }
    return n;
}

/* The pool's per-slot arrays (cap entries each), allocated and freed together. */
enum { CKPT_ARRAYS = 10 };
static void pool_arrays(kvc_ckpt_pool *p, kvc_array a[CKPT_ARRAYS]) {
    const kvc_array all[CKPT_ARRAYS] = {
        KVC_ARRAY(p->n_tok, p->cap),   KVC_ARRAY(p->salt, p->cap),  KVC_ARRAY(p->hash, p->cap),
        KVC_ARRAY(p->tokens, p->cap),  KVC_ARRAY(p->used_at, p->cap), KVC_ARRAY(p->made_at, p->cap),
        KVC_ARRAY(p->pins, p->cap),    KVC_ARRAY(p->owner, p->cap), KVC_ARRAY(p->gen, p->cap),
        KVC_ARRAY(p->order, p->cap),
    };
    memcpy(a, all, sizeof all);
}

int kvc_ckpt_init(kvc_ckpt_pool *p, const kvc_recurrent *c, uint32_t cap, uint32_t per_seq, uint8_t *memory,
                  size_t memory_len, kvc_err *err) {
    memset(p, 0, sizeof *p);
    if (!c->ops->checkpoints) {
        return kvc_err_set(err, KVC_E_ARG, "prefix reuse needs a recurrent cache of semantics '2026'");
    }
    if (cap == 0) {
        return kvc_err_set(err, KVC_E_ARG, "checkpoints = 0: the pool needs room for at least one");
    }
    if (per_seq > cap) {
        return kvc_err_set(err, KVC_E_ARG, "per_seq = %u exceeds checkpoints = %u", per_seq, cap);
    }
    for (uint32_t il = 0; il < c->n_layer; il++) {
        const kvc_layer *L = &c->layers[il];
        if ((L->k_row_bytes && !L->k) || (L->v_row_bytes && !L->v)) {
            return kvc_err_set(err, KVC_E_ARG, "the cache holds no state memory (buffers='none'): there is no "
                               "state to checkpoint");
        }
    }
    const size_t sb = kvc_ckpt_state_bytes(c);
    if (sb && (size_t)cap > SIZE_MAX / sb) {
        return kvc_err_set(err, KVC_E_ARG, "checkpoints = %u of %zu bytes do not fit in memory", cap, sb);
    }
    const size_t need = (size_t)cap * sb;
    if (memory && memory_len < need) {
        return kvc_err_set(err, KVC_E_ARG, "memory holds %zu bytes; %u checkpoints of %zu bytes need %zu",
                           memory_len, cap, sb, need);
    }
    p->cap = cap;
    p->per_seq = per_seq;
    p->n_layer = c->n_layer;
    p->state_bytes = sb;
    kvc_array arrays[CKPT_ARRAYS];
    pool_arrays(p, arrays);
    const int rc = kvc_alloc_arrays(arrays, CKPT_ARRAYS);
    if (memory) {
        p->data = memory;
    } else {
        p->data = need ? malloc(need) : NULL;
        p->owns_data = true;
    }
    if (rc != KVC_OK || (need && !p->data)) {
        kvc_ckpt_free(p);
        return kvc_err_set(err, KVC_E_NOMEM, "checkpoint pool of %u states of %zu bytes", cap, sb);
    }
    for (uint32_t i = 0; i < cap; i++) {
        p->owner[i] = -1;
    }
    return KVC_OK;
}

void kvc_ckpt_free(kvc_ckpt_pool *p) {
    (void)kvc_ckpt_spill_set(p, false, 1, NULL);
    if (p->tokens) {
        for (uint32_t i = 0; i < p->cap; i++) {
            free(p->tokens[i]);
        }
    }
    kvc_array arrays[CKPT_ARRAYS];
    pool_arrays(p, arrays);
    kvc_free_arrays(arrays, CKPT_ARRAYS);
    if (p->owns_data) {
        free(p->data);
    }
    memset(p, 0, sizeof *p);
}

#define CKPT_HASH_INIT 0xcbf29ce484222325ull
#define CKPT_HASH_MUL  0x100000001b3ull

static inline uint64_t ckpt_hash_step(uint64_t h, int32_t t) {
    return (h ^ (uint32_t)t) * CKPT_HASH_MUL;
}

uint64_t kvc_ckpt_hash(const int32_t *tokens, uint32_t n) {
    uint64_t h = CKPT_HASH_INIT;
    for (uint32_t i = 0; i < n; i++) {
        h = ckpt_hash_step(h, tokens[i]);
    }
    return h;
}

/* The cell holding s's state, -1 when none. */
static int32_t ckpt_cell_of(const kvc_recurrent *c, int32_t s) {
    const kvc_rec_cells *t = &c->cells;
    if (s < 0 || (uint32_t)s >= c->n_seq_max) {
        return -1;
    }
    const int32_t cell = t->tail[s];
    if (cell < 0 || !kvc_seqs_has(t->seq, t->size, (uint32_t)cell, s) || t->pos[cell] < 0) {
        return -1;
    }
    return cell;
}

uint32_t kvc_ckpt_seq_len(const kvc_recurrent *c, int32_t s) {
    const int32_t cell = ckpt_cell_of(c, s);
    return cell < 0 ? 0 : (uint32_t)c->cells.pos[cell] + 1;
}

void kvc_ckpt_touch(kvc_ckpt_pool *p, uint32_t slot) {
    p->used_at[slot] = ++p->clock;
}

static uint8_t *ckpt_data(const kvc_ckpt_pool *p, uint32_t slot) {
    return p->data + (size_t)slot * p->state_bytes;
}

/* Room for one more record; false when the list is full or memory cannot be had. */
static bool spill_room(kvc_ckpt_pool *p) {
    kvc_ckpt_spill *sp = p->spill;
    if (sp->n < sp->room) {
        return true;
    }
    if (sp->room == p->cap) {
        return false;
    }
    const uint32_t want = sp->room ? (sp->room <= p->cap / 2 ? 2 * sp->room : p->cap) : 4;
    const uint32_t room = want < p->cap ? want : p->cap;
    uint64_t *salt = kvc_realloc_n(sp->salt, room, sizeof *salt);
    if (salt) {
        sp->salt = salt;
    }
    uint32_t *n_tok = kvc_realloc_n(sp->n_tok, room, sizeof *n_tok);
    if (n_tok) {
        sp->n_tok = n_tok;
    }
    int32_t **tokens = kvc_realloc_n(sp->tokens, room, sizeof *tokens);
    if (tokens) {
        sp->tokens = tokens;
    }
    uint8_t *states = p->state_bytes ? kvc_realloc_n(sp->states, room, p->state_bytes) : sp->states;
    if (states) {
        sp->states = states;
    }
    if (!salt || !n_tok || !tokens || (p->state_bytes && !states)) {
        return false;
    }
    sp->room = room;
    return true;
}

/* Record held slot's checkpoint before it is dropped: its chain is taken over (the slot's
 * pointer cleared), its state copied. */
static void spill_record(kvc_ckpt_pool *p, uint32_t slot) {
    kvc_ckpt_spill *sp = p->spill;
    if (p->n_tok[slot] % sp->align) {
        return;
    }
    if (!spill_room(p)) {
        sp->n_lost++;
        return;
    }
    const uint32_t k = sp->n++;
    sp->salt[k] = p->salt[slot];
    sp->n_tok[k] = p->n_tok[slot];
    sp->tokens[k] = p->tokens[slot];
    p->tokens[slot] = NULL;
    if (p->state_bytes) {
        memcpy(sp->states + (size_t)k * p->state_bytes, ckpt_data(p, slot), p->state_bytes);
    }
}

int kvc_ckpt_spill_set(kvc_ckpt_pool *p, bool on, uint32_t align, kvc_err *err) {
    if (!on) {
        kvc_ckpt_spill_clear(p);
        if (p->spill) {
            kvc_free(p->spill->salt);
            kvc_free(p->spill->n_tok);
            kvc_free(p->spill->tokens);
            kvc_free(p->spill->states);
            kvc_free(p->spill);
            p->spill = NULL;
        }
        return KVC_OK;
    }
    if (align == 0) {
        return kvc_err_set(err, KVC_E_ARG, "align = 0: chains are recorded in multiples of at least one token");
    }
    if (!p->spill) {
        p->spill = kvc_calloc(1, sizeof *p->spill);
        if (!p->spill) {
            return kvc_err_set(err, KVC_E_NOMEM, "out of memory for the write-back list");
        }
    }
    p->spill->align = align;
    return KVC_OK;
}

void kvc_ckpt_spill_clear(kvc_ckpt_pool *p) {
    if (p->spill) {
        for (uint32_t k = 0; k < p->spill->n; k++) {
            free(p->spill->tokens[k]);
        }
        p->spill->n = 0;
    }
}

/* Empty a held slot: its chain goes (to the write-back list when that is on), stale pins are
 * refused from now on. */
static void ckpt_drop(kvc_ckpt_pool *p, uint32_t slot) {
    if (p->spill) {
        spill_record(p, slot);
    }
    uint32_t k = 0;
    while (k < p->n_used && p->order[k] != slot) {
        k++;
    }
    memmove(p->order + k, p->order + k + 1, (size_t)(p->n_used - k - 1) * sizeof *p->order);
    p->n_used--;
    free(p->tokens[slot]);
    p->tokens[slot] = NULL;
    p->n_tok[slot] = 0;
    p->pins[slot] = 0;
    p->owner[slot] = -1;
    p->gen[slot]++;
}

/* Keep order sorted by (P, slot). */
static void ckpt_order_insert(kvc_ckpt_pool *p, uint32_t slot) {
    uint32_t k = p->n_used;
    while (k > 0) {
        const uint32_t o = p->order[k - 1];
        if (p->n_tok[o] < p->n_tok[slot] || (p->n_tok[o] == p->n_tok[slot] && o < slot)) {
            break;
        }
        p->order[k] = o;
        k--;
    }
    p->order[k] = slot;
    p->n_used++;
}

static bool ckpt_chain_is(const kvc_ckpt_pool *p, uint32_t slot, uint64_t salt, uint64_t hash, const int32_t *tokens) {
    return p->salt[slot] == salt && p->hash[slot] == hash &&
           memcmp(p->tokens[slot], tokens, (size_t)p->n_tok[slot] * sizeof *tokens) == 0;
}

int32_t kvc_ckpt_find(const kvc_ckpt_pool *p, uint64_t salt, const int32_t *tokens, uint32_t n, uint32_t limit) {
    if (limit > n) {
        limit = n;
    }
    /* one pass over the tokens and the checkpoints by length: the deepest whose hash agrees; its
     * tokens are then compared, and only a hash collision (practically never) makes it search on */
    for (;;) {
        uint64_t h = CKPT_HASH_INIT;
        uint32_t at = 0;
        int32_t best = -1;
        for (uint32_t k = 0; k < p->n_used; k++) {
            const uint32_t slot = p->order[k];
            const uint32_t len = p->n_tok[slot];
            if (len > limit) {
                break;
            }
            while (at < len) {
                h = ckpt_hash_step(h, tokens[at++]);
            }
            if (p->salt[slot] == salt && p->hash[slot] == h) {
                best = (int32_t)slot;
            }
        }
        if (best < 0) {
            return -1;
        }
        if (memcmp(p->tokens[best], tokens, (size_t)p->n_tok[best] * sizeof *tokens) == 0) {
            return best;
        }
        limit = p->n_tok[best] - 1;
    }
}

int32_t kvc_ckpt_find_exact(const kvc_ckpt_pool *p, uint64_t salt, const int32_t *tokens, uint32_t n) {
    if (n == 0) {
        return -1;
    }
    const uint64_t h = kvc_ckpt_hash(tokens, n);
    for (uint32_t k = 0; k < p->n_used; k++) {
        const uint32_t slot = p->order[k];
        if (p->n_tok[slot] == n && ckpt_chain_is(p, slot, salt, h, tokens)) {
            return (int32_t)slot;
        }
    }
    return -1;
}

/* The slot a new checkpoint of sequence s takes: s's oldest unpinned one when s made per_seq
 * already, else an empty slot, else the least recently used unpinned one; -1 when none can go. */
static int32_t ckpt_victim(const kvc_ckpt_pool *p, int32_t s) {
    if (p->per_seq) {
        uint32_t mine = 0;
        int32_t oldest = -1;
        for (uint32_t i = 0; i < p->cap; i++) {
            if (p->n_tok[i] && p->owner[i] == s) {
                mine++;
                if (!p->pins[i] && (oldest < 0 || p->made_at[i] < p->made_at[oldest])) {
                    oldest = (int32_t)i;
                }
            }
        }
        if (mine >= p->per_seq) {
            return oldest;
        }
    }
    int32_t lru = -1;
    for (uint32_t i = 0; i < p->cap; i++) {
        if (!p->n_tok[i]) {
            return (int32_t)i;
        }
        if (!p->pins[i] && (lru < 0 || p->used_at[i] < p->used_at[lru])) {
            lru = (int32_t)i;
        }
    }
    return lru;
}

/* Copy the state s's next step reads (a pending rollback's snapshot plane, else the cell's row)
 * into dst, every layer's R row then S row. */
static void rows_out(const kvc_recurrent *c, int32_t s, int32_t cell, uint8_t *dst) {
    const size_t row = (size_t)c->cells.rs_idx[s] * c->cells.size + (size_t)cell;
    for (uint32_t il = 0; il < c->n_layer; il++) {
        const kvc_layer *L = &c->layers[il];
        if (L->k_row_bytes) {
            memcpy(dst, L->k + row * L->k_row_bytes, L->k_row_bytes);
        }
        dst += L->k_row_bytes;
        if (L->v_row_bytes) {
            memcpy(dst, L->v + row * L->v_row_bytes, L->v_row_bytes);
        }
        dst += L->v_row_bytes;
    }
}

/* Copy a state laid out as rows_out writes it into cell's rows. */
static void rows_in(kvc_recurrent *c, uint32_t cell, const uint8_t *src) {
    for (uint32_t il = 0; il < c->n_layer; il++) {
        const kvc_layer *L = &c->layers[il];
        if (L->k_row_bytes) {
            memcpy(L->k + (size_t)cell * L->k_row_bytes, src, L->k_row_bytes);
        }
        src += L->k_row_bytes;
        if (L->v_row_bytes) {
            memcpy(L->v + (size_t)cell * L->v_row_bytes, src, L->v_row_bytes);
        }
        src += L->v_row_bytes;
    }
}

int kvc_ckpt_save(kvc_ckpt_pool *p, const kvc_recurrent *c, int32_t s, uint64_t salt, const int32_t *tokens,
                  uint32_t n, int32_t *copy, uint32_t *n_kept, kvc_err *err) {
    *n_kept = 0;
    if (kvc_seq_id_check(s, c->n_seq_max, err) != KVC_OK) {
        free(copy);
        return KVC_E_ARG;
    }
    const int32_t cell = ckpt_cell_of(c, s);
    if (cell < 0) {
        free(copy);
        return kvc_err_set(err, KVC_E_ARG, "sequence %d holds no state", s);
    }
    const uint32_t len = (uint32_t)c->cells.pos[cell] + 1;
    if (n < len) {
        free(copy);
        return kvc_err_set(err, KVC_E_ARG, "sequence %d's state is at position %u: it is the state after %u "
                           "tokens, and tokens has %u", s, len - 1, len, n);
    }
    const int32_t same = kvc_ckpt_find_exact(p, salt, tokens, len);
    if (same >= 0) {
        free(copy);
        kvc_ckpt_touch(p, (uint32_t)same);
        *n_kept = len;
        return KVC_OK;
    }
    if (!copy) {
        copy = malloc((size_t)len * sizeof *copy);
        if (!copy) {
            return kvc_err_set(err, KVC_E_NOMEM, "checkpoint of %u tokens", len);
        }
    }
    const int32_t slot = ckpt_victim(p, s);
    if (slot < 0) {
        free(copy);
        return KVC_OK;   /* every slot it could take is pinned: not kept */
    }
    if (p->n_tok[slot]) {
        ckpt_drop(p, (uint32_t)slot);
    }
    memcpy(copy, tokens, (size_t)len * sizeof *copy);
    p->tokens[slot] = copy;
    p->n_tok[slot] = len;
    p->salt[slot] = salt;
    p->hash[slot] = kvc_ckpt_hash(tokens, len);
    p->pins[slot] = 0;
    p->owner[slot] = s;
    p->made_at[slot] = ++p->clock;
    p->used_at[slot] = p->clock;
    ckpt_order_insert(p, (uint32_t)slot);
    rows_out(c, s, cell, ckpt_data(p, (uint32_t)slot));
    *n_kept = len;
    return KVC_OK;
}

uint32_t kvc_ckpt_match(kvc_ckpt_pool *p, uint64_t salt, const int32_t *tokens, uint32_t n) {
    if (n == 0) {
        return 0;
    }
    const int32_t slot = kvc_ckpt_find(p, salt, tokens, n, n - 1);
    if (slot < 0) {
        return 0;
    }
    kvc_ckpt_touch(p, (uint32_t)slot);
    return p->n_tok[slot];
}

int kvc_ckpt_place(kvc_ckpt_pool *p, kvc_recurrent *c, int32_t s, uint32_t slot, uint32_t *cell, kvc_err *err) {
    return kvc_recurrent_seq_restore(c, s, (int32_t)p->n_tok[slot] - 1, cell, err);
}

void kvc_ckpt_fill(kvc_ckpt_pool *p, kvc_recurrent *c, uint32_t slot, uint32_t cell) {
    rows_in(c, cell, ckpt_data(p, slot));
    kvc_ckpt_touch(p, slot);
}

uint32_t kvc_ckpt_copy_seq(const kvc_recurrent *c, int32_t s, uint8_t *out) {
    const int32_t cell = ckpt_cell_of(c, s);
    if (cell < 0) {
        return 0;
    }
    rows_out(c, s, cell, out);
    return (uint32_t)c->cells.pos[cell] + 1;
}

bool kvc_ckpt_copy_out(const kvc_ckpt_pool *p, uint64_t salt, const int32_t *tokens, uint32_t n, uint8_t *out) {
    const int32_t slot = kvc_ckpt_find_exact(p, salt, tokens, n);
    if (slot < 0) {
        return false;
    }
    memcpy(out, ckpt_data(p, (uint32_t)slot), p->state_bytes);
    return true;
}

int kvc_ckpt_restore_state(kvc_recurrent *c, int32_t s, uint32_t n_tok, const uint8_t *state, kvc_err *err) {
    if (n_tok == 0 || n_tok > (uint32_t)INT32_MAX) {
        return kvc_err_set(err, KVC_E_ARG, "a state after %u tokens", n_tok);
    }
    uint32_t cell = 0;
    const int r = kvc_recurrent_seq_restore(c, s, (int32_t)n_tok - 1, &cell, err);
    if (r == KVC_OK) {
        rows_in(c, cell, state);
    }
    return r;
}

int kvc_ckpt_restore(kvc_ckpt_pool *p, kvc_recurrent *c, int32_t s, uint32_t slot, kvc_err *err) {
    uint32_t cell = 0;
    const int r = kvc_ckpt_place(p, c, s, slot, &cell, err);
    if (r == KVC_OK) {
        kvc_ckpt_fill(p, c, slot, cell);
    }
    return r;
}

void kvc_ckpt_disown(kvc_ckpt_pool *p, int32_t s) {
    for (uint32_t i = 0; i < p->cap; i++) {
        if (p->owner[i] == s) {
            p->owner[i] = -1;
        }
    }
}

int kvc_ckpt_attach(kvc_ckpt_pool *p, kvc_recurrent *c, int32_t s, uint64_t salt, const int32_t *tokens,
                    uint32_t n, uint32_t *n_attached, kvc_err *err) {
    *n_attached = 0;
    if (kvc_seq_id_check(s, c->n_seq_max, err) != KVC_OK) {
        return KVC_E_ARG;
    }
    if (kvc_recurrent_seq_pos_max(c, s) >= 0) {
        return kvc_err_set(err, KVC_E_ARG, "sequence %d holds a state: attach into an empty sequence", s);
    }
    const int32_t slot = n ? kvc_ckpt_find(p, salt, tokens, n, n - 1) : -1;
    if (slot >= 0) {
        const int r = kvc_ckpt_restore(p, c, s, (uint32_t)slot, err);
        if (r != KVC_OK) {
            return r;
        }
        *n_attached = p->n_tok[slot];
    }
    kvc_ckpt_disown(p, s);
    return KVC_OK;
}

int kvc_ckpt_release(kvc_ckpt_pool *p, kvc_recurrent *c, int32_t s, uint64_t salt, const int32_t *tokens,
                     uint32_t n, uint32_t *n_kept, kvc_err *err) {
    *n_kept = 0;
    if (kvc_seq_id_check(s, c->n_seq_max, err) != KVC_OK) {
        return KVC_E_ARG;
    }
    if (n && ckpt_cell_of(c, s) >= 0) {
        const int r = kvc_ckpt_save(p, c, s, salt, tokens, n, NULL, n_kept, err);
        if (r != KVC_OK) {
            return r;
        }
    }
    kvc_recurrent_seq_rm(c, s, -1, -1);
    kvc_ckpt_disown(p, s);
    return KVC_OK;
}

int kvc_ckpt_pin(kvc_ckpt_pool *p, uint64_t salt, const int32_t *tokens, uint32_t n, kvc_ckpt_handle *pin,
                 kvc_err *err) {
    const int32_t slot = kvc_ckpt_find_exact(p, salt, tokens, n);
    if (slot < 0) {
        return kvc_err_set(err, KVC_E_ARG, "no checkpoint of these %u tokens is held", n);
    }
    p->pins[slot]++;
    pin->slot = (uint32_t)slot;
    pin->gen = p->gen[slot];
    return KVC_OK;
}

bool kvc_ckpt_pin_held(const kvc_ckpt_pool *p, kvc_ckpt_handle pin) {
    return pin.slot < p->cap && p->n_tok[pin.slot] && p->gen[pin.slot] == pin.gen && p->pins[pin.slot];
}

int kvc_ckpt_unpin(kvc_ckpt_pool *p, kvc_ckpt_handle pin, kvc_err *err) {
    if (!kvc_ckpt_pin_held(p, pin)) {
        return kvc_err_set(err, KVC_E_ARG, "not a pin of a checkpoint held now");
    }
    p->pins[pin.slot]--;
    return KVC_OK;
}

uint32_t kvc_ckpt_evict(kvc_ckpt_pool *p, uint32_t n) {
    uint32_t done = 0;
    while (done < n) {
        int32_t lru = -1;
        for (uint32_t i = 0; i < p->cap; i++) {
            if (p->n_tok[i] && !p->pins[i] && (lru < 0 || p->used_at[i] < p->used_at[lru])) {
                lru = (int32_t)i;
            }
        }
        if (lru < 0) {
            break;
        }
        ckpt_drop(p, (uint32_t)lru);
        done++;
    }
    return done;
}

uint32_t kvc_ckpt_n_pinned(const kvc_ckpt_pool *p) {
    uint32_t n = 0;
    for (uint32_t i = 0; i < p->cap; i++) {
        n += p->n_tok[i] && p->pins[i];
    }
    return n;
}

int kvc_ckpt_check(const kvc_ckpt_pool *p, kvc_err *err) {
    uint32_t held = 0;
    for (uint32_t i = 0; i < p->cap; i++) {
        if (!p->n_tok[i]) {
            if (p->tokens[i] || p->pins[i] || p->owner[i] != -1) {
                return kvc_err_set(err, KVC_E_INTERNAL, "empty slot %u keeps a chain, a pin or an owner", i);
            }
            continue;
        }
        held++;
        if (!p->tokens[i] || p->hash[i] != kvc_ckpt_hash(p->tokens[i], p->n_tok[i])) {
            return kvc_err_set(err, KVC_E_INTERNAL, "slot %u: its chain and its hash disagree", i);
        }
    }
    if (held != p->n_used) {
        return kvc_err_set(err, KVC_E_INTERNAL, "%u slots held, n_used %u", held, p->n_used);
    }
    for (uint32_t k = 0; k < p->n_used; k++) {
        const uint32_t a = p->order[k];
        if (a >= p->cap || !p->n_tok[a]) {
            return kvc_err_set(err, KVC_E_INTERNAL, "order[%u] = %u is no held slot", k, a);
        }
        if (k && (p->n_tok[p->order[k - 1]] > p->n_tok[a] ||
                  (p->n_tok[p->order[k - 1]] == p->n_tok[a] && p->order[k - 1] >= a))) {
            return kvc_err_set(err, KVC_E_INTERNAL, "order is not by length at %u", k);
        }
    }
    return KVC_OK;
}
