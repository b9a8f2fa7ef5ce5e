/* Tests of the framings of a memory state without a cache (csrc/kvc_framing.c) under the
 * sanitizers: a state of a cache with three streams frames with stream counts as one part (each
 * section's offset and cell count as written); two of them as two parts; cut short, or with bytes
 * after it, it frames in no way, and the misses say where the walk stopped or where the state
 * ended; bytes that are no state frame in none. kvc_state_frames_exactly says which layouts frame
 * the bytes as a number of parts, and for a single sequence's read also where only the ids the
 * cells list (which that read ignores) are out of range. */
#include "kvc_framing.h"
#include "kvc_le.h"
#include "kvc_state.h"
#include "kvc_types.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "fixture.h"

#define SIZE 32
#define N_STREAM 3
#define WIDTH 2

static float k_mem[N_STREAM * SIZE * WIDTH], v_mem[N_STREAM * SIZE * WIDTH];

static uint8_t *state_of(kvc_unified *c, size_t *n) {
    *n = kvc_unified_state_size_lay(c, -1, KVC_LAYOUT_STREAMS);
    uint8_t *b = malloc(2 * *n + 8);
    size_t w = 0;
    if (!b || kvc_unified_state_write_range_lay(c, -1, KVC_LAYOUT_STREAMS, 0, b, *n, &w) != KVC_OK || w != *n) {
        fprintf(stderr, "state_write failed\n");
        abort();
    }
    return b;
}

/* The layouts of lays[0, 2) that frame b[0, len) as `parts` parts (checked alike, whole cache). */
static uint32_t frames(const uint8_t *b, size_t len, const unsigned *lays, uint32_t parts) {
    uint32_t framed, readable;
    kvc_state_frames_exactly(b, len, lays, 2, parts, false, &framed, &readable);
    CHECK(readable == framed, "a whole cache's read: readable %x where framed %x", readable, framed);
    return framed;
}

static void test_framings(void) {
    const int32_t il[1] = { 0 };
    const uint32_t w[1] = { WIDTH };
    const kvc_unified_params p = {
        .kv_size = SIZE, .semantics = KVC_SEM_2026, .stream_per_seq = true, .n_seq_max = N_STREAM, .n_pad = 1,
        .swa_type = KVC_SWA_NONE, .type_k = KVC_TYPE_F32, .type_v = KVC_TYPE_F32, .n_layer = 1, .layer_il = il,
        .n_embd_k = w, .n_embd_v = w,
    };
    kvc_unified c;
    REQUIRE(fixture_attach(&c, &p, k_mem, sizeof k_mem, v_mem, sizeof v_mem) == KVC_OK, "cache");
    int32_t pos[8], ids[8];
    uint32_t off[9];
    kvc_ubatch ub;
    for (int32_t s = 0; s < N_STREAM; s += 2) {   /* stream 1 stays empty */
        REQUIRE(kvc_unified_find_slot_2026(&c, fixture_ub(&ub, pos, off, ids, 3 + (uint32_t)s, 0, s, -1, 1), NULL) == 1,
                "placing sequence %d", s);
    }
    size_t n;
    uint8_t *b = state_of(&c, &n);
    kvc_framing *out = malloc(KVC_FRAMING_MAX * sizeof *out);
    kvc_framing_miss miss[4];
    uint32_t n_out = 0;
    REQUIRE(out, "memory");

    kvc_state_framings(b, n, true, out, &n_out, miss);
    CHECK(n_out == 1, "one framing, not %u", n_out);
    if (n_out == 1) {
        const kvc_framing *f = &out[0];
        CHECK(f->streams && f->n_parts == 1 && !f->prefixed && f->ext_bytes == 0 && f->recurrent_records == 0,
              "with stream counts, one part");
        CHECK(f->n_sec[0] == N_STREAM && f->sec_off[0][0] == 4 && f->sec_cells[0][0] == 3 &&
              f->sec_cells[0][1] == 0 && f->sec_cells[0][2] == 5, "the sections as written");
    }
    CHECK(miss[0].rc == 1 && miss[1].rc == KVC_E_STATE && miss[2].rc == KVC_E_STATE && miss[3].rc == KVC_E_STATE,
          "only the one part with stream counts frames: %d %d %d %d", miss[0].rc, miss[1].rc, miss[2].rc, miss[3].rc);

    /* two states one after the other: two parts (an iSWA cache's) */
    memcpy(b + n, b, n);
    kvc_state_framings(b, 2 * n, true, out, &n_out, miss);
    CHECK(n_out == 1 && out[0].n_parts == 2 && out[0].sec_off[1][0] == n + 4, "two parts");
    CHECK(miss[0].rc == KVC_OK && miss[0].end == n, "one part ends at %zu, before the end", n);

    const unsigned lays[2] = { KVC_LAYOUT_STREAMS, 0 };
    CHECK(frames(b, 2 * n, lays, 2) == 1u && frames(b, 2 * n, lays, 1) == 0, "two parts with stream counts, not one");
    CHECK(frames(b, n, lays, 1) == 1u, "one part with stream counts");

    /* a cell listing an id out of range: no framing, but readable as a single sequence's state,
     * whose read ignores the ids */
    uint32_t framed, readable;
    const uint32_t id_at = 4 + 4 + 8;   /* stream count, cell count, cell 0's position and id count */
    const uint32_t id0 = kvc_le_get_u32(b + id_at);
    kvc_le_put_u32(b + id_at, 0xffffffffu);
    kvc_state_frames_exactly(b, n, lays, 2, 1, true, &framed, &readable);
    CHECK(framed == 0 && readable == 1u, "an id out of range: framed %x, readable %x", framed, readable);
    CHECK(frames(b, n, lays, 1) == 0, "an id out of range: a whole cache's read takes it in no layout");
    kvc_le_put_u32(b + id_at, id0);
    kvc_state_frames_exactly(b, n, lays, 2, 1, true, &framed, &readable);
    CHECK(framed == 1u && readable == 1u, "the ids in range again: framed %x, readable %x", framed, readable);

    /* bytes after the state, and a state cut short */
    kvc_state_framings(b, n + 3, true, out, &n_out, miss);
    CHECK(n_out == 0 && miss[0].rc == KVC_OK && miss[0].end == n, "trailing bytes: where the state ends");
    kvc_state_framings(b, n - 1, true, out, &n_out, miss);
    CHECK(n_out == 0 && miss[0].rc == KVC_E_STATE && strstr(miss[0].err.msg, "truncated"),
          "cut short: %s", miss[0].err.msg);
    CHECK(frames(b, n - 1, lays, 1) == 0 && frames(b, n + 3, lays, 1) == 0,
          "cut short or with bytes after it: no layout frames it");

    /* no state at all */
    memset(b, 0xff, 16);
    kvc_state_framings(b, 16, true, out, &n_out, miss);
    CHECK(n_out == 0 && miss[0].rc < 0 && miss[2].rc < 0, "not a state");
    kvc_state_framings(NULL, 0, true, out, &n_out, miss);
    CHECK(n_out == 0 && miss[0].rc < 0 && miss[3].rc < 0, "no bytes");

    free(out);
    free(b);
    kvc_unified_free(&c);
}

int main(void) {
    test_framings();
    printf("test_framing: %d checks, %d failed\n", n_checks, n_failed);
    return n_failed != 0;
}
