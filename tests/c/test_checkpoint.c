/* Tests of the checkpoint pool of recurrent states (kvc_checkpoint.h): a save copies the state
 * of a sequence (a pending rollback's plane when there is one), a match finds the deepest chain
 * that begins a request and leaves its last token, a restore places the state as the sequence
 * state reader does and copies the rows back, the bounds (per sequence, in all, pins) choose
 * the slot as the header says, a failed operation changes nothing, write-back at eviction records
 * each evicted checkpoint's chain and state while the pool behaves as without it, and a random
 * workload keeps the pool's records consistent. */
#include "kvc_recurrent_ops.h"
#include "kvc_checkpoint.h"
#include "kvc_types.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"

enum { SIZE = 4, RS = 2, ROWS = SIZE * (1 + RS), W = 2 };

static float kbuf[ROWS * W], vbuf[ROWS * W];

static int make(kvc_recurrent *c) {
    const uint32_t w[1] = { W };
    kvc_recurrent_params p = { SIZE, SIZE, KVC_TYPE_F32, KVC_TYPE_F32, 1, w, w, KVC_REC_2026, RS };
    const int rc = kvc_recurrent_init(c, &p, NULL);
    memset(kbuf, 0, sizeof kbuf);
    memset(vbuf, 0, sizeof vbuf);
    if (rc == KVC_OK) {
        kvc_recurrent_set_layer_buffers(c, 0, (uint8_t *)kbuf, (uint8_t *)vbuf);
    }
    return rc;
}

/* The model: sequence s computes n tokens from p0; the state p tokens back is (last - p, s). */
static void decode(kvc_recurrent *c, int32_t s, int32_t p0, uint32_t n) {
    int32_t pos[16];
    for (uint32_t i = 0; i < n; i++) {
        pos[i] = p0 + (int32_t)i;
    }
    const uint32_t off[2] = { 0, 1 };
    const kvc_ubatch ub = { n, n, 1, pos, off, &s, NULL, NULL, NULL };
    kvc_err err = { 0, "" };
    kvc_recurrent_find_slot(c, &ub, &err);
    for (uint32_t p = 0; p < n && p <= RS; p++) {
        const float row[W] = { (float)(p0 + (int32_t)n - 1 - (int32_t)p), (float)s };
        kvc_recurrent_store_plane(c, 0, p, 1, row, row);
    }
}

static float state_pos(const kvc_recurrent *c, int32_t s) {
    return kbuf[c->cells.tail[s] * W];
}

static void test_save_match_restore(void) {
    kvc_recurrent c;
    kvc_ckpt_pool p;
    kvc_err err = { 0, "" };
    REQUIRE(make(&c) == KVC_OK, "init");
    REQUIRE(kvc_ckpt_init(&p, &c, 3, 0, NULL, 0, &err) == KVC_OK, "pool: %s", err.msg);
    CHECK(p.state_bytes == 2 * W * sizeof(float), "one K row and one V row");
    const int32_t toks[8] = { 5, 6, 7, 8, 9, 10, 11, 12 };
    uint32_t kept = 9, k = 9;
    CHECK(kvc_ckpt_save(&p, &c, 0, 0, toks, 8, NULL, &kept, &err) == KVC_E_ARG && kept == 0, "no state");
    decode(&c, 0, 0, 5);
    CHECK(kvc_ckpt_save(&p, &c, 0, 0, toks, 4, NULL, &kept, &err) == KVC_E_ARG && p.n_used == 0, "too few tokens");
    CHECK(kvc_ckpt_save(&p, &c, 0, 0, toks, 8, NULL, &kept, &err) == KVC_OK && kept == 5, "saved 5");
    CHECK(kvc_ckpt_save(&p, &c, 0, 0, toks, 5, NULL, &kept, &err) == KVC_OK && kept == 5 && p.n_used == 1,
          "the same chain again: touched");
    CHECK(kvc_recurrent_seq_rm(&c, 0, 3, -1), "a rollback of 2");
    CHECK(kvc_ckpt_save(&p, &c, 0, 0, toks, 8, NULL, &kept, &err) == KVC_OK && kept == 3, "the rolled-back state");
    CHECK(kvc_ckpt_match(&p, 0, toks, 5) == 3, "5 tokens: the last is computed, so 3");
    CHECK(kvc_ckpt_match(&p, 0, toks, 6) == 5, "6 tokens: 5");
    CHECK(kvc_ckpt_match(&p, 7, toks, 6) == 0, "another salt");
    const int32_t other[3] = { 5, 6, 99 };
    CHECK(kvc_ckpt_match(&p, 0, other, 3) == 0, "no chain begins it");
    CHECK(kvc_ckpt_attach(&p, &c, 0, 0, toks, 8, &k, &err) == KVC_E_ARG, "into a sequence holding a state");
    /* ids outside [0, n_seq_max): refused before any per-sequence record is read */
    CHECK(kvc_ckpt_attach(&p, &c, -1, 0, toks, 8, &k, &err) == KVC_E_ARG && k == 0, "attach -1");
    CHECK(kvc_ckpt_release(&p, &c, (int32_t)c.n_seq_max, 0, toks, 8, &kept, &err) == KVC_E_ARG, "release n_seq_max");
    CHECK(kvc_ckpt_save(&p, &c, -7, 0, toks, 8, NULL, &kept, &err) == KVC_E_ARG && kept == 0, "save -7");
    CHECK(kvc_ckpt_attach(&p, &c, 1, 0, toks, 8, &k, &err) == KVC_OK && k == 5, "attached 5");
    CHECK(kvc_recurrent_seq_pos_max(&c, 1) == 4 && state_pos(&c, 1) == 4.0f, "the state after 5, at position 4");
    CHECK(kvc_ckpt_attach(&p, &c, 2, 0, toks, 4, &k, &err) == KVC_OK && k == 3, "attached 3");
    CHECK(state_pos(&c, 2) == 2.0f && kbuf[c.cells.tail[2] * W + 1] == 0.0f, "the snapshot plane's state");
    CHECK(kvc_recurrent_unplace(&c) == KVC_OK && kvc_recurrent_seq_pos_max(&c, 2) == -1, "undone");
    CHECK(kvc_ckpt_check(&p, &err) == KVC_OK, "%s", err.msg);
    kvc_ckpt_free(&p);
    kvc_recurrent_free(&c);
}

/* The prefix store's access: a sequence's state and a checkpoint as bytes, and a state given as
 * bytes placed into an empty sequence (refused, nothing changed, into one holding a state). */
static void test_states_as_bytes(void) {
    kvc_recurrent c;
    kvc_ckpt_pool p;
    kvc_err err = { 0, "" };
    REQUIRE(make(&c) == KVC_OK, "init");
    REQUIRE(kvc_ckpt_init(&p, &c, 3, 0, NULL, 0, &err) == KVC_OK, "pool: %s", err.msg);
    const int32_t toks[8] = { 5, 6, 7, 8, 9, 10, 11, 12 };
    float out[2 * W] = { -1, -1, -1, -1 }, ck[2 * W];
    uint32_t kept = 0;
    CHECK(kvc_ckpt_copy_seq(&c, 0, (uint8_t *)out) == 0 && out[0] == -1.0f, "no state: nothing copied");
    decode(&c, 0, 0, 5);
    CHECK(kvc_ckpt_copy_seq(&c, 0, (uint8_t *)out) == 5 && out[0] == 4.0f && out[1] == 0.0f && out[2] == 4.0f,
          "the state after 5 tokens");
    CHECK(!kvc_ckpt_copy_out(&p, 0, toks, 5, (uint8_t *)ck), "no checkpoint yet");
    CHECK(kvc_ckpt_save(&p, &c, 0, 0, toks, 8, NULL, &kept, &err) == KVC_OK && kept == 5, "saved");
    CHECK(kvc_ckpt_copy_out(&p, 0, toks, 5, (uint8_t *)ck) && memcmp(ck, out, sizeof ck) == 0, "the checkpoint");
    CHECK(!kvc_ckpt_copy_out(&p, 0, toks, 4, (uint8_t *)ck) && !kvc_ckpt_copy_out(&p, 3, toks, 5, (uint8_t *)ck),
          "exact tokens and salt only");
    CHECK(kvc_ckpt_restore_state(&c, 0, 5, (const uint8_t *)out, &err) == KVC_E_ARG, "sequence 0 holds a state");
    CHECK(kvc_ckpt_restore_state(&c, 1, 0, (const uint8_t *)out, &err) == KVC_E_ARG, "no tokens");
    CHECK(kvc_ckpt_restore_state(&c, 1, 5, (const uint8_t *)out, &err) == KVC_OK, "%s", err.msg);
    CHECK(kvc_recurrent_seq_pos_max(&c, 1) == 4 && state_pos(&c, 1) == 4.0f, "the state after 5, at position 4");
    CHECK(kvc_ckpt_copy_seq(&c, 1, (uint8_t *)ck) == 5 && memcmp(ck, out, sizeof ck) == 0, "the same bytes");
    CHECK(kvc_recurrent_unplace(&c) == KVC_OK && kvc_recurrent_seq_pos_max(&c, 1) == -1, "undone");
    kvc_ckpt_free(&p);
    kvc_recurrent_free(&c);
}

static void test_bounds(void) {
    kvc_recurrent c;
    kvc_ckpt_pool p;
    kvc_err err = { 0, "" };
    REQUIRE(make(&c) == KVC_OK, "init");
    CHECK(kvc_ckpt_init(&p, &c, 0, 0, NULL, 0, &err) == KVC_E_ARG, "no room");
    CHECK(kvc_ckpt_init(&p, &c, 2, 3, NULL, 0, &err) == KVC_E_ARG, "per_seq > cap");
    uint8_t small[8];
    CHECK(kvc_ckpt_init(&p, &c, 2, 0, small, sizeof small, &err) == KVC_E_ARG, "memory too small");
    uint8_t mem[3 * 2 * W * sizeof(float)];
    REQUIRE(kvc_ckpt_init(&p, &c, 3, 2, mem, sizeof mem, &err) == KVC_OK, "the caller's memory");
    const int32_t toks[8] = { 1, 2, 3, 4, 5, 6, 7, 8 };
    uint32_t kept = 0;
    for (uint32_t n = 1; n <= 3; n++) {
        decode(&c, 0, (int32_t)n - 1, 1);
        kvc_ckpt_save(&p, &c, 0, 0, toks, 8, NULL, &kept, &err);
    }
    CHECK(p.n_used == 2 && kvc_ckpt_find_exact(&p, 0, toks, 1) < 0, "per_seq: the sequence's oldest went");
    kvc_ckpt_handle pin;
    CHECK(kvc_ckpt_pin(&p, 0, toks, 2, &pin, &err) == KVC_OK, "pinned 2");
    CHECK(kvc_ckpt_pin(&p, 0, toks, 4, &pin, &err) == KVC_E_ARG, "no chain of 4");
    decode(&c, 0, 3, 1);
    kvc_ckpt_save(&p, &c, 0, 0, toks, 8, NULL, &kept, &err);
    CHECK(kept == 4 && kvc_ckpt_find_exact(&p, 0, toks, 3) < 0 && kvc_ckpt_find_exact(&p, 0, toks, 2) >= 0,
          "the pinned one stays, the next oldest goes");
    kvc_ckpt_disown(&p, 0);
    decode(&c, 1, 0, 1);
    kvc_ckpt_save(&p, &c, 1, 0, toks + 4, 1, NULL, &kept, &err);
    CHECK(p.n_used == 3 && kept == 1, "free room");
    decode(&c, 2, 0, 1);
    const int32_t t9[1] = { 9 };
    kvc_ckpt_save(&p, &c, 2, 0, t9, 1, NULL, &kept, &err);
    CHECK(kept == 1 && kvc_ckpt_find_exact(&p, 0, toks, 4) < 0, "full: the least recently used unpinned went");
    CHECK(memcmp(mem + (size_t)kvc_ckpt_find_exact(&p, 0, t9, 1) * p.state_bytes + sizeof(float),
                 &(float){ 2.0f }, sizeof(float)) == 0, "the states live in the caller's memory");
    CHECK(kvc_ckpt_evict(&p, 5) == 2 && p.n_used == 1, "evict leaves the pinned one");
    CHECK(kvc_ckpt_unpin(&p, pin, &err) == KVC_OK && kvc_ckpt_unpin(&p, pin, &err) == KVC_E_ARG, "pins count");
    CHECK(kvc_ckpt_evict(&p, 5) == 1 && p.n_used == 0, "all gone");
    CHECK(kvc_ckpt_check(&p, &err) == KVC_OK, "%s", err.msg);
    kvc_ckpt_free(&p);
    kvc_recurrent_free(&c);
}

static void test_random(void) {
    kvc_recurrent c;
    kvc_ckpt_pool p;
    kvc_err err = { 0, "" };
    REQUIRE(make(&c) == KVC_OK, "init");
    REQUIRE(kvc_ckpt_init(&p, &c, 5, 2, NULL, 0, &err) == KVC_OK, "pool");
    int32_t toks[SIZE][16];
    for (int round = 0; round < 2000; round++) {
        const int32_t s = (int32_t)check_rand(SIZE);
        const int32_t len = kvc_recurrent_seq_pos_max(&c, s) + 1;
        uint32_t k = 0;
        switch (check_rand(5)) {
        case 0:   /* a new request: attach then a token */
            if (len == 0) {
                for (int i = 0; i < 16; i++) {
                    toks[s][i] = (int32_t)check_rand(3);
                }
                CHECK(kvc_ckpt_attach(&p, &c, s, 0, toks[s], 1 + check_rand(15), &k, &err) == KVC_OK, "attach");
                decode(&c, s, (int32_t)k, 1);
            }
            break;
        case 1:
            if (len > 0 && len < 15) {
                decode(&c, s, len, 1);
            }
            break;
        case 2:
            if (len > 0) {
                CHECK(kvc_ckpt_save(&p, &c, s, 0, toks[s], 16, NULL, &k, &err) == KVC_OK, "save");
            }
            break;
        case 3:
            CHECK(kvc_ckpt_release(&p, &c, s, 0, toks[s], 16, &k, &err) == KVC_OK, "release");
            break;
        default:
            kvc_ckpt_evict(&p, check_rand(2));
        }
        CHECK(kvc_ckpt_check(&p, &err) == KVC_OK, "round %d: %s", round, err.msg);
        if (n_failed) {
            break;
        }
    }
    kvc_ckpt_free(&p);
    kvc_recurrent_free(&c);
}

/* Two pools fed the same saves and evictions hold the same slots in the same order. */
static bool same_pools(const kvc_ckpt_pool *a, const kvc_ckpt_pool *b) {
    if (a->n_used != b->n_used || a->clock != b->clock) {
        return false;
    }
    for (uint32_t i = 0; i < a->cap; i++) {
        if (a->n_tok[i] != b->n_tok[i] || a->used_at[i] != b->used_at[i] || a->gen[i] != b->gen[i] ||
            (a->n_tok[i] && memcmp(a->data + (size_t)i * a->state_bytes, b->data + (size_t)i * b->state_bytes,
                                   a->state_bytes) != 0)) {
            return false;
        }
    }
    return memcmp(a->order, b->order, (size_t)a->n_used * sizeof *a->order) == 0;
}

static void test_spill(void) {
    kvc_recurrent c;
    kvc_ckpt_pool p, q;
    kvc_err err = { 0, "" };
    REQUIRE(make(&c) == KVC_OK, "init");
    REQUIRE(kvc_ckpt_init(&p, &c, 2, 0, NULL, 0, &err) == KVC_OK, "pool");
    REQUIRE(kvc_ckpt_init(&q, &c, 2, 0, NULL, 0, &err) == KVC_OK, "pool without write-back");
    CHECK(kvc_ckpt_spill_set(&p, true, 0, &err) == KVC_E_ARG && p.spill == NULL, "align 0 refused");
    REQUIRE(kvc_ckpt_spill_set(&p, true, 2, &err) == KVC_OK && p.spill && p.spill->n == 0, "on: %s", err.msg);
    const int32_t toks[8] = { 5, 6, 7, 8, 9, 10, 11, 12 };
    float st[4][2 * W];
    uint32_t kept = 0, k2 = 0;
    for (uint32_t n = 1; n <= 4; n++) {   /* states after 1, 2, 3, 4 tokens: the pool keeps the last two */
        decode(&c, 0, (int32_t)n - 1, 1);
        kvc_ckpt_copy_seq(&c, 0, (uint8_t *)st[n - 1]);
        CHECK(kvc_ckpt_save(&p, &c, 0, 7, toks, 8, NULL, &kept, &err) == KVC_OK && kept == n, "save %u", n);
        CHECK(kvc_ckpt_save(&q, &c, 0, 7, toks, 8, NULL, &k2, &err) == KVC_OK && k2 == n, "save %u", n);
        CHECK(same_pools(&p, &q), "after save %u: the pool behaves as without write-back", n);
    }
    /* 1 went (odd: not recorded), then 2 (recorded with its state as saved) */
    CHECK(p.spill->n == 1 && p.spill->n_lost == 0, "one record: %u", p.spill->n);
    CHECK(p.spill->n_tok[0] == 2 && p.spill->salt[0] == 7 && memcmp(p.spill->tokens[0], toks, 2 * sizeof *toks) == 0,
          "the chain and salt of the evicted checkpoint");
    CHECK(memcmp(kvc_ckpt_spill_state(&p, 0), st[1], sizeof st[1]) == 0, "its state, copied before the slot's reuse");
    CHECK(kvc_ckpt_check(&p, &err) == KVC_OK, "%s", err.msg);
    kvc_ckpt_spill_clear(&p);
    CHECK(p.spill->n == 0, "drained");
    CHECK(kvc_ckpt_evict(&p, 5) == 2 && kvc_ckpt_evict(&q, 5) == 2 && same_pools(&p, &q), "evict: same pools");
    CHECK(p.spill->n == 1 && p.spill->n_tok[0] == 4 && memcmp(kvc_ckpt_spill_state(&p, 0), st[3], sizeof st[3]) == 0,
          "evict records the state after 4 (3 is not a multiple of 2)");
    /* not drained: at most cap records pend, the rest are counted lost */
    for (uint32_t n = 5; n <= 8; n++) {
        decode(&c, 0, (int32_t)n - 1, 1);
        kvc_ckpt_save(&p, &c, 0, 7, toks, 8, NULL, &kept, &err);
    }
    CHECK(p.spill->n == 2 && p.spill->n_lost == 0 && p.spill->n_tok[1] == 6, "6 recorded, the list is full");
    CHECK(kvc_ckpt_evict(&p, 5) == 2 && p.n_used == 0 && p.spill->n == 2 && p.spill->n_lost == 1,
          "8 evicted, not recorded: lost");
    kvc_ckpt_spill_clear(&p);
    /* no memory for the list: the record is lost, never the eviction */
    REQUIRE(kvc_ckpt_spill_set(&p, false, 1, &err) == KVC_OK && p.spill == NULL, "off");
    REQUIRE(kvc_ckpt_spill_set(&p, true, 1, &err) == KVC_OK, "on again");
    kvc_ckpt_save(&p, &c, 0, 7, toks, 8, NULL, &kept, &err);
    kvc_fail_alloc_after = 1;
    CHECK(kvc_ckpt_evict(&p, 1) == 1 && p.n_used == 0, "evicted");
    kvc_fail_alloc_after = 0;
    CHECK(p.spill->n == 0 && p.spill->n_lost == 1, "the record lost");
    kvc_ckpt_save(&p, &c, 0, 7, toks, 8, NULL, &kept, &err);
    CHECK(kvc_ckpt_evict(&p, 1) == 1 && p.spill->n == 1 && p.spill->n_tok[0] == 8, "recorded again");
    CHECK(kvc_ckpt_check(&p, &err) == KVC_OK, "%s", err.msg);
    kvc_ckpt_free(&p);   /* the pending record's chain goes with the pool */
    kvc_ckpt_free(&q);
    kvc_recurrent_free(&c);
}

int main(void) {
    test_save_match_restore();
    test_states_as_bytes();
    test_bounds();
    test_spill();
    test_random();
    printf("test_checkpoint: %d checks, %d failed\n", n_checks, n_failed);
    return n_failed != 0;
}
