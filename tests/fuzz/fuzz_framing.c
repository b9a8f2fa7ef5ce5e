/* libFuzzer target: kvc_state_framings and kvc_state_frames_exactly (csrc/kvc_framing.h), a
 * blob's framings as a memory state without a cache.
 *
 * Input: one header byte (bit 0: the sequence-blob prefix may lead), then the blob.
 *
 * Contract checked on every input:
 *   - at most KVC_FRAMING_MAX framings, in the documented order (with stream counts before
 *     without, the hybrid ones last);
 *   - each framing takes the blob exactly: its cache parts walk, one after the other, in its
 *     layout to where the next starts (each section's offset and cell count as the walk finds
 *     them), and a hybrid framing's recurrent part describes with its layer records to the
 *     blob's end, with the cells it says, and with no fewer records;
 *   - a framing with an extension has cells; the prefix is there exactly when it says so;
 *   - each plain framing without an extension either is found or has its miss (an error with
 *     a message, or the end it reached before the blob's), never both;
 *   - kvc_state_frames_exactly agrees with the framings found without the prefix. */
#include "fuzz_common.h"
#include "kvc_framing.h"
#include "kvc_layout.h"

static kvc_framing out[KVC_FRAMING_MAX];
static size_t secs_off[KVC_FRAMING_SECS];
static uint32_t secs_cells[KVC_FRAMING_SECS];

static unsigned layout_of(const kvc_framing *f) {
    unsigned lay = (f->streams ? (unsigned)KVC_LAYOUT_STREAMS : 0u) | KVC_LAYOUT_PREFIX;
    if (f->ext_bytes) {
        lay |= KVC_LAYOUT_CELL_EXT | KVC_LAYOUT_EXT_XY | (f->ext_bytes == 12 ? (unsigned)KVC_LAYOUT_EXT_TOK : 0u);
    }
    return lay;
}

/* The framing walks: its parts where it says, then its recurrent part, to len. */
static void check_framing(const uint8_t *data, size_t len, bool allow_prefix, const kvc_framing *f) {
    kvc_err err;
    size_t off = 0;
    bool cells = false;
    FUZZ_CHECK(f->n_parts <= 2 && (f->n_parts || f->recurrent_records), "%u parts", f->n_parts);
    FUZZ_CHECK(!f->recurrent_records || (!f->ext_bytes && (f->streams == (f->n_parts > 0))),
               "a hybrid framing: attention parts with stream counts, no extension");
    FUZZ_CHECK(f->prefixed == (allow_prefix && len >= 8 && kvc_le_get_u32(data) == KVC_SEQ_MAGIC), "the prefix");
    if (f->prefixed) {
        FUZZ_CHECK(f->src_seq_id == kvc_le_get_i32(data + 4), "the prefix's id");
    }
    if (!f->n_parts) {
        off = 8;
    }
    for (uint32_t k = 0; k < f->n_parts; k++) {
        kvc_state_frame fr;
        FUZZ_CHECK(kvc_state_describe_frame(data + off, len - off, layout_of(f), allow_prefix && k == 0, &fr, secs_off,
                                            secs_cells, KVC_FRAMING_SECS, &err) == KVC_OK,
                   "part %u does not walk: %s", k, err.msg);
        const uint32_t n_sec = fr.n_stream < KVC_FRAMING_SECS ? fr.n_stream : KVC_FRAMING_SECS;
        FUZZ_CHECK(f->n_sec[k] == n_sec, "part %u: %u sections, the walk %u", k, f->n_sec[k], n_sec);
        for (uint32_t s = 0; s < n_sec; s++) {
            FUZZ_CHECK(f->sec_off[k][s] == off + secs_off[s] && f->sec_cells[k][s] == secs_cells[s],
                       "part %u section %u", k, s);
            cells = cells || secs_cells[s];
        }
        off += fr.end;
    }
    if (f->recurrent_records) {
        kvc_state_desc d;
        FUZZ_CHECK(f->rec_off == off, "the recurrent part at %zu, the cache parts end at %zu", f->rec_off, off);
        FUZZ_CHECK(kvc_state_describe_records(data + off, len - off, 0, f->recurrent_records, &d, NULL, NULL, NULL, 0,
                                              NULL, 0, &err) == KVC_OK && d.end == len - off &&
                       d.cell_count == f->rec_cells,
                   "the recurrent part with %u records: %s", f->recurrent_records, err.msg);
        if (f->recurrent_records > 1) {
            const int rc = kvc_state_describe_records(data + off, len - off, 0, f->recurrent_records - 1, &d, NULL,
                                                      NULL, NULL, 0, NULL, 0, &err);
            FUZZ_CHECK(rc != KVC_OK || d.end != len - off, "fewer records frame it too");
        }
        off = len;
    }
    FUZZ_CHECK(off == len, "the framing ends at %zu of %zu", off, len);
    FUZZ_CHECK(!f->ext_bytes || cells, "an extension without cells");
}

int LLVMFuzzerTestOneInput(const uint8_t *input, size_t size) {
    if (size < 1) {
        return 0;
    }
    const bool allow_prefix = input[0] & 1;
    const uint8_t *data = size > 1 ? input + 1 : NULL;
    const size_t len = size - 1;
    kvc_framing_miss miss[4];
    uint32_t n = 0;
    kvc_state_framings(data, len, allow_prefix, out, &n, miss);
    FUZZ_CHECK(n <= KVC_FRAMING_MAX, "%u framings", n);
    bool found[4] = { false, false, false, false };
    for (uint32_t i = 0; i < n; i++) {
        const kvc_framing *f = &out[i];
        check_framing(data, len, allow_prefix, f);
        if (i) {
            const kvc_framing *p = &out[i - 1];
            FUZZ_CHECK(!p->recurrent_records || f->recurrent_records, "the hybrid framings last");
            FUZZ_CHECK(f->recurrent_records || p->streams >= f->streams, "with stream counts first");
        }
        if (!f->recurrent_records && !f->ext_bytes) {
            const uint32_t k = 2 * !f->streams + f->n_parts - 1;
            FUZZ_CHECK(!found[k], "framing %u twice", k);
            found[k] = true;
        }
    }
    for (uint32_t k = 0; k < 4; k++) {
        FUZZ_CHECK((miss[k].rc == 1) == found[k], "framing %u: found %d, miss %d", k, found[k], miss[k].rc);
        if (miss[k].rc < 0) {
            FUZZ_CHECK(miss[k].rc == KVC_E_STATE && miss[k].err.msg[0], "miss %u: %d without a message", k, miss[k].rc);
        } else if (miss[k].rc == KVC_OK) {
            FUZZ_CHECK(miss[k].end != len, "miss %u ends at the end", k);
        }
    }
    /* without the prefix: the framings' plain parts are the layouts that frame exactly */
    if (!allow_prefix) {
        static const unsigned lays[2] = { KVC_LAYOUT_STREAMS, 0 };
        for (uint32_t parts = 1; parts <= 2; parts++) {
            uint32_t bits, readable, single_bits, single_readable;
            kvc_state_frames_exactly(data, len, lays, 2, parts, false, &bits, &readable);
            FUZZ_CHECK(((bits & 1u) != 0) == found[parts - 1] && ((bits & 2u) != 0) == found[2 + parts - 1],
                       "frames_exactly %u parts: %x", parts, bits);
            FUZZ_CHECK(readable == bits, "frames_exactly %u parts, whole cache: readable %x, framed %x", parts,
                       readable, bits);
            /* a single sequence's walk leaves the ids unchecked: the same framings, and maybe more */
            kvc_state_frames_exactly(data, len, lays, 2, parts, true, &single_bits, &single_readable);
            FUZZ_CHECK(single_bits == bits && (single_readable & bits) == bits,
                       "frames_exactly %u parts, single sequence: framed %x, readable %x (%x)", parts, single_bits,
                       single_readable, bits);
        }
    }
    if (fz_verbose()) {
        fprintf(stderr, "%zu bytes: %u framings\n", len, n);
    }
    return 0;
}
