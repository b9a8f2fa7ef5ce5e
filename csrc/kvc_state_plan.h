/* kvcache — a memory state validated for a unified cache, ready to apply (the plan), and what
 * the readers of the two semantics share: the cache as the section parser holds a state to it,
 * and the moves of a state's V data into the cache's rows (converting the V layout). */
#ifndef KVC_STATE_PLAN_H
#define KVC_STATE_PLAN_H

#include "kvc_common.h"
#include "kvc_section.h"
#include "kvc_state_write.h"
#include "kvc_unified.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Flags of the _ex readers. */
enum kvc_state_flags {
    KVC_STATE_CONVERT_V = 1u, /* accept V in the other layout (transposed <-> rows) and convert it */
    KVC_STATE_EXACT     = 2u, /* the state must end exactly at len: trailing bytes are an error */
    KVC_STATE_NO_ROOM   = 4u, /* the bytes only: the room a single sequence's sections need is checked
                               * later (kvc_state_plan_room), once every part of the state is read */
};

struct kvc_state_plan;
/* What a semantics adds to the validation of a single sequence's state with sections: whether c
 * has room for them, its prefix index evicting where room needs it (evict) or not at all. KVC_OK,
 * KVC_ROOM_EVICTING (!evict: room only by evicting), or a negative code with err. */
typedef int kvc_state_room_fn(kvc_unified *c, const struct kvc_state_plan *plan, bool evict, kvc_err *err);

/* One validated stream section of a part: where its cells go and where its data is. */
typedef struct kvc_state_sec {
    uint32_t  stream;     /* the cache's stream it goes to (0 in a cache of one stream) */
    uint32_t  cell_count;
    size_t    data_off;   /* offset in the part of its data section (the V layout flag) */
    uint32_t  v_trans;    /* the section's V layout (differs from the cache's only when converting) */
    int32_t  *pos;        /* the cells' validated positions (owned; NULL without cells, and in a
                           * recurrent cache's plan, whose reader parses into its own table) */
    uint64_t *seq;        /* whole cache: the cells' sequence sets, the cache's seq_words words per
                           * cell (owned), else NULL */
    struct kvc_cell_ext *ext; /* the cells' extensions when the section has them (owned), else NULL */
} kvc_state_sec;

/* One validated part, ready to apply to the cache it was prepared against: its non-empty stream
 * sections in order (the seed's semantics and a recurrent cache: at most one). A plan may be
 * copied by value (it points to nothing inside itself). */
typedef struct kvc_state_plan {
    const uint8_t *data;       /* the part (borrowed: must outlive the plan) */
    int32_t        seq_id;     /* destination: -1 = whole cache */
    size_t         len;        /* bytes of the part */
    bool           noop;       /* a single sequence's state of empty stream sections (layouts with
                                * streams): the destination keeps its cells */
    uint32_t       n_sec;      /* the non-empty stream sections */
    kvc_state_sec  one;        /* they are this one, in a part of one stream */
    kvc_state_sec *many;       /* else [n_sec] (owned; room for a section per stream) */
    kvc_state_room_fn *room;   /* the semantics' room check (NULL: none to make) */
} kvc_state_plan;

/* The plan's sections, [n_sec]. */
static inline const kvc_state_sec *kvc_state_plan_secs(const kvc_state_plan *plan) {
    return plan->many ? plan->many : &plan->one;
}

void kvc_state_plan_free(kvc_state_plan *plan);   /* safe on a zeroed plan */

/* The readers of a unified cache of each semantics (kvc_unified_ops.state_prepare and
 * state_apply): prepare validates a state for c into plan (kvc_unified_state_prepare_lay's work,
 * seq_id valid): KVC_OK, or a negative code with err and the plan freed; apply applies a plan
 * prepared against c, unchanged since (not a no-op plan): KVC_OK, or a negative code when c
 * changed in between. */
typedef int kvc_state_prepare_fn(kvc_unified *c, int32_t seq_id, const uint8_t *data, size_t len, unsigned flags,
                                 unsigned layout, kvc_state_plan *plan, kvc_err *err);
typedef int kvc_state_apply_fn(kvc_unified *c, const kvc_state_plan *plan);

/* --- internal to the readers ---------------------------------------------------------------- */

/* The prepare of either semantics: the framing and every stream section parsed against c into
 * plan (a parsed section becomes a plan section), then for a single sequence's state with
 * sections room(c, plan), unless flags has KVC_STATE_NO_ROOM. KVC_OK, or a negative code with err
 * and the plan freed. */
int kvc_state_plan_prepare(kvc_unified *c, int32_t seq_id, const uint8_t *data, size_t len, unsigned flags,
                           unsigned layout, kvc_state_room_fn *room, kvc_state_plan *plan, kvc_err *err);
/* The room check a prepare with KVC_STATE_NO_ROOM left out (a no-op for a whole-cache state or
 * one without sections). KVC_OK, or a negative code with err (the caller frees the plan). A
 * reader of several parts parses every part first, so that a part's room (which may evict
 * prefix-index cells, as placement does) is looked for only when every byte of the state is valid. */
int kvc_state_plan_room(kvc_unified *c, const kvc_state_plan *plan, kvc_err *err);
/* kvc_state_plan_room of the n parts plans[k] prepared against cs[k] (a composite cache's state),
 * all or none evicting (kvc_parts_room): a part's prefix index evicts only once every part has
 * room or can make it. KVC_OK, or a negative code with err, *failed naming the part. */
int kvc_state_plan_room_parts(kvc_unified *const *cs, const kvc_state_plan *plans, uint32_t n, uint32_t *failed,
                              kvc_err *err);

/* Whether a read copies the K/V data of cc cells with non-temporal stores: from KVC_STREAM_BYTES
 * on (data that does not stay in the caches anyway). */
bool kvc_state_stream_data(const kvc_unified *c, uint32_t cc);
/* cc cells of V given as n_embd_v rows of cc elements (a transposed blob) into rows of the cache
 * (row of cell i at dst + i, or at cells[i] when cells is not NULL). */
void kvc_state_v_transpose_in(uint8_t *v, size_t row, const uint8_t *src, uint32_t cc, uint32_t width, size_t el,
                              uint32_t dst, const int32_t *cells);
/* The reverse: rows of the blob into the cache's transposed V of `size` elements per row. */
void kvc_state_v_untranspose_in(uint8_t *v, uint32_t size, const uint8_t *src, size_t row, uint32_t cc,
                                uint32_t width, size_t el, uint32_t dst, const int32_t *cells);
/* n_rows transposed V rows of cc elements el, src's one after the other, into rows of `size`
 * elements from element dst. */
void kvc_state_v_rows_in(uint8_t *v, uint32_t size, const uint8_t *src, uint32_t cc, uint32_t n_rows, size_t el,
                         uint32_t dst, bool stream);

#ifdef __cplusplus
}
#endif

#endif
