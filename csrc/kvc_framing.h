/* kvcache — every way a blob is exactly one memory state, found without a cache: with or without
 * stream counts, of one cache part or two (an iSWA cache), with stream counts also with a per-cell
 * extension of 12 or 8 bytes, and as a hybrid memory's state (an attention part of one cache or,
 * with a sliding window, of an iSWA pair's two, then a recurrent part whose layer count is the
 * model's); and, for each plain framing it is not, where and why the structure stops making sense
 * there. Each candidate framing's walk is made once: the walk of a first part serves the framings
 * of one part and of two, and the hybrid state's attention part. kvcache.statefile's
 * memory_framings (and through it inspect and convert) is kvc_state_framings; the detection of a
 * state's layout in kvc_state.c asks kvc_state_frames_exactly, once, which layouts the bytes frame
 * in: it reads the state in those alone, and that answer also picks its error. */
#ifndef KVC_FRAMING_H
#define KVC_FRAMING_H

#include "kvc_common.h"
#include "kvc_section.h"

#ifdef __cplusplus
extern "C" {
#endif

#define KVC_FRAMING_SECS 256u   /* stream sections recorded per cache part */
#define KVC_FRAMING_MAX  11u    /* framings one blob can have: 8 plain ones, 3 hybrid */

/* One framing of data[0, len) as exactly one memory state. */
typedef struct kvc_framing {
    bool     streams;           /* a stream count leads each cache part */
    uint32_t ext_bytes;         /* the per-cell extension's bytes in each cell record: 0, 8 or 12 */
    bool     prefixed;          /* the sequence-blob prefix leads; its id src_seq_id */
    int32_t  src_seq_id;
    uint32_t n_parts;           /* 0 to 2: the cache parts (an iSWA pair's: base, SWA), in order */
    uint32_t n_sec[2];          /* per part: the sections recorded (min(streams, KVC_FRAMING_SECS)) */
    size_t   sec_off[2][KVC_FRAMING_SECS];   /* where each section's body (its cell count) starts */
    uint32_t sec_cells[2][KVC_FRAMING_SECS]; /* and its cell count */
    uint32_t recurrent_records; /* a hybrid memory's state: the layer records of its recurrent part,
                                 * after the cache parts (one section, no stream count); 0: not one */
    size_t   rec_off;           /* where that part starts */
    uint32_t rec_cells;         /* and its cell count */
} kvc_framing;

/* Why data is not one memory state framed with or without stream counts as 1 or 2 parts, no
 * extension: rc KVC_OK when the parts frame but end at `end` before len (trailing bytes); else
 * the walk's error (err: what and where, in bytes of the part that failed). */
typedef struct kvc_framing_miss {
    int     rc;
    size_t  end;
    kvc_err err;
} kvc_framing_miss;

/* Every framing of data[0, len) into out[0, *n_out) (room for KVC_FRAMING_MAX), in this order:
 * with stream counts, then without; one part, then two; no extension, then 12 bytes, then 8
 * (a framing with an extension only when a section has cells, which alone tell them apart);
 * then the hybrid framings (attention part of one cache, then of two, each followed by the
 * recurrent part; the recurrent part alone after the prefix). allow_prefix: the sequence-blob
 * prefix may lead. miss[2 * !streams + n_parts - 1]: why the plain framing without an extension
 * did not take data (rc 1 where it did). */
void kvc_state_framings(const uint8_t *data, size_t len, bool allow_prefix, kvc_framing *out, uint32_t *n_out,
                        kvc_framing_miss miss[4]);

/* Which of layouts[0, n_layouts) (at most 32; enum kvc_layout_bits, the prefix not taken) frame
 * data[0, len) as exactly n_parts memory states one after the other, one walk each: bit k of
 * *framed for layouts[k]. *readable: the same where a reader may take the bytes, which for a
 * single sequence's state (single) also counts the framings whose cells list ids outside
 * [0, KVC_MAX_SEQ) (the reader ignores them); a reader takes no bytes outside it. */
void kvc_state_frames_exactly(const uint8_t *data, size_t len, const unsigned *layouts, uint32_t n_layouts,
                              uint32_t n_parts, bool single, uint32_t *framed, uint32_t *readable);

#ifdef __cplusplus
}
#endif

#endif
