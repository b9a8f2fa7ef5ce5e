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
};

/* One validated stream section of a part read into a cache of semantics 2026. */
typedef struct kvc_state_sec {
    uint32_t  stream;     /* the cache's stream it goes to */
    uint32_t  cell_count;
    size_t    data_off;   /* offset in the part of its data section (the V layout flag) */
    uint32_t  v_trans;    /* the section's V layout (differs from the cache's only when converting) */
    int32_t  *pos;        /* the cells' validated positions (owned) */
    uint64_t *seq;        /* whole cache: the cells' sequence sets (owned), else NULL */
    struct kvc_cell_ext *ext; /* the cells' extensions when the section has them (owned), else NULL */
} kvc_state_sec;

/* One validated part, ready to apply to the cache it was prepared against. */
typedef struct kvc_state_plan {
    const uint8_t *data;       /* the part (borrowed: must outlive the plan) */
    int32_t        seq_id;     /* destination: -1 = whole cache */
    uint32_t       cell_count; /* cells the part holds */
    size_t         data_off;   /* offset of its data section (the V layout flag) */
    size_t         len;        /* bytes of the part */
    int32_t       *pos;        /* the cells' validated positions (owned; NULL without cells) */
    uint32_t       v_trans;    /* the part's V layout (differs from the cache's only when converting) */
    uint64_t      *seq;        /* whole cache: the cells' validated sequence sets, the cache's
                                * seq_words words per cell (owned), else NULL */
    bool           noop;       /* a single sequence's empty stream section (layouts with streams):
                                * the destination keeps its cells */
    uint32_t       n_sec;      /* semantics 2026: the part's non-empty stream sections, in order */
    kvc_state_sec *secs;       /* [n_sec] (owned); the fields above describe no cells then */
} kvc_state_plan;

void kvc_state_plan_free(kvc_state_plan *plan);   /* safe on a zeroed plan */

/* --- internal to the readers ---------------------------------------------------------------- */

/* The cache as the section parser holds a state to it (every stream has one geometry: ref names
 * stream 0, and must outlive d). */
void kvc_state_dest(const kvc_state_stream *ref, int32_t seq_id, unsigned flags, unsigned layout, kvc_sec_dest *d);
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
