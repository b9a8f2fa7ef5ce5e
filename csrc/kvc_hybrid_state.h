/* kvcache — the state codec of the hybrid memory, byte-identical to today's llama.cpp's
 * llama_memory_hybrid::state_write / state_read (the bytes: docs/state.md, "A hybrid memory").
 *
 * The memory state is the attention part's state (a unified cache's, with stream counts; an
 * iSWA pair's: its base cache's, then its SWA cache's, as llama_memory_hybrid_iswa writes it),
 * then the recurrent part's (its layer count the model's layers, records for the recurrent
 * layers only), with no separator or length between them; a sequence's blob has the
 * sequence-blob prefix once, in front. With KVC_HYBRID_PARTIAL_ONLY (llama.cpp's
 * LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY) the recurrent part is written and read, after the SWA
 * cache's state when the attention part is an iSWA pair (llama.cpp's iSWA pair keeps only its
 * base cache out of a partial state).
 *
 * Each part is written and read by its own cache's codec. Reading is transactional over both:
 * both parts are validated (and a sequence's cells given room) before either changes, so a read
 * that fails in either part leaves both exactly as they were. llama.cpp clears the sequence (or
 * the whole memory) instead; kvcache keeps the memory as it was, as every kvcache reader does. */
#ifndef KVC_HYBRID_STATE_H
#define KVC_HYBRID_STATE_H

#include "kvc_common.h"
#include "kvc_hybrid.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Which parts a state holds. */
enum kvc_hybrid_parts {
    KVC_HYBRID_BOTH         = 0u,
    KVC_HYBRID_PARTIAL_ONLY = 1u, /* the recurrent part alone */
};

/* Number the recurrent part's layers as the model's (its states say n_layer layers; layer k of
 * the part is the model's recurrent_il[k], ascending). KVC_OK, or KVC_E_ARG with err. */
int    kvc_hybrid_state_init(kvc_hybrid *h, uint32_t n_layer, const uint32_t *recurrent_il, kvc_err *err);

/* Bytes of the state of seq_id (-1 = whole memory) in layout (enum kvc_layout_bits, with stream
 * counts; KVC_LAYOUT_PREFIX writes the sequence-blob prefix of a sequence's state) with `parts`
 * (enum kvc_hybrid_parts). 0 for an id outside [-1, n_seq_max). */
size_t kvc_hybrid_state_size(const kvc_hybrid *h, int32_t seq_id, unsigned layout, unsigned parts);
/* Bytes [offset, offset + cap) of that state into out; *written = bytes produced (cap, or fewer
 * at its end). KVC_OK, KVC_E_ARG (bad seq_id), KVC_E_NOMEM. */
int    kvc_hybrid_state_write_range(kvc_hybrid *h, int32_t seq_id, unsigned layout, unsigned parts, uint64_t offset,
                                    uint8_t *out, size_t cap, size_t *written);
/* Read a state from data[0, len) into seq_id (-1 = whole memory): the sequence-blob prefix when
 * it is there (a sequence's state only; its id is not used, as llama.cpp's), then the parts.
 * flags: enum kvc_state_flags (KVC_STATE_CONVERT_V for the attention part; KVC_STATE_EXACT: the
 * last part ends at len). layout: the attention part's (with stream counts). All or nothing:
 * KVC_OK with *consumed, or a negative code with err naming the part, and neither part changed. */
int    kvc_hybrid_state_read(kvc_hybrid *h, int32_t seq_id, const uint8_t *data, size_t len, unsigned flags,
                             unsigned layout, unsigned parts, size_t *consumed, kvc_err *err);

#ifdef __cplusplus
}
#endif

#endif
