/* libFuzzer target: the batch splitter (csrc/kvc_batch.h): construction from arbitrary token
 * lists, then any sequence of splits, valid or not.
 *
 * Input:
 *   [0]    bit 0 simple_split, bit 1 logits_all, bit 2 output flags given, bit 3 drain with
 *          split_seq (else split_equal) once the program ends, bits 4-7 n_ubatch - 1 of the drain
 *   [1..2] n_tokens (u16, at most 1024)
 *   then per token: a control byte (bits 0-1 number of ids, 0 = none; bit 2 output flag;
 *   bits 3-7 ignored), a position byte (< 240: that position; otherwise a large or negative
 *   one) and one byte per id (< 0xF0: id & 63; otherwise an id outside [0, 64))
 *   then the split program, one byte per call: bits 0-1 mode (3 = not a mode), bits 2-7
 *   n_ubatch (0 is invalid); afterwards the batch is drained with valid calls.
 *
 * Contract checked: construction succeeds exactly when every token has a position >= 0 and
 * at least one id, all in [0, 64), and leaves nothing behind when it fails; a refused split
 * changes nothing; every ubatch is well formed (kvc_ubatch_check), holds at most n_ubatch
 * tokens not placed before, groups tokens with identical id lists in ascending position
 * (equal / seq splits) or takes the next tokens in batch order (simple split), copies each
 * token's position and output flag, and appends its outputs to out_ids in ubatch order; a
 * shared id list is never mixed with other groups; the batch is exhausted exactly when every
 * token was placed once. */
#include "fuzz_common.h"
#include "kvc_batch.h"
#include "kvc_seqset.h"

enum { MAX_TOKENS = 1024 };

static int32_t decode_pos(uint8_t b) {
    static const int32_t odd[16] = { -1, -2, INT32_MIN, INT32_MAX, INT32_MAX - 1, 1 << 30, 65535, 65536,
                                     1000000, -1000, 4096, 255, 256, 100000, 2147483600, -7 };
    return b < 240 ? (int32_t)b : odd[b - 240];
}

static int32_t decode_id(uint8_t b) {
    static const int32_t odd[16] = { -1, 64, 65, 1000, INT32_MIN, INT32_MAX, -64, 128,
                                     255, 256, -2, 63 + 64, 1 << 20, -1000000, 100, 99 };
    return b < 0xF0 ? (int32_t)(b & 63) : odd[b - 0xF0];
}

/* A deep copy of the splitter, to show that a refused call changed nothing. */
typedef struct sb_copy {
    kvc_sbatch s;
} sb_copy;

static void sb_take(sb_copy *m, const kvc_sbatch *sb) {
    const size_t n = sb->n_tokens, n_ids = sb->seq_off ? sb->seq_off[n] : 0;
    m->s = *sb;
    m->s.pos = (int32_t *)fz_dup((const uint8_t *)sb->pos, n * sizeof *sb->pos);
    m->s.seq_off = (uint32_t *)fz_dup((const uint8_t *)sb->seq_off, (n + 1) * sizeof *sb->seq_off);
    m->s.seq_ids = (int32_t *)fz_dup((const uint8_t *)sb->seq_ids, n_ids * sizeof *sb->seq_ids);
    m->s.logits = (int8_t *)fz_dup((const uint8_t *)sb->logits, n * sizeof *sb->logits);
    m->s.order = (uint32_t *)fz_dup((const uint8_t *)sb->order, n * sizeof *sb->order);
    m->s.groups = (kvc_sbatch_group *)fz_dup((const uint8_t *)sb->groups, sb->n_groups * sizeof *sb->groups);
    m->s.out_ids = (uint32_t *)fz_dup((const uint8_t *)sb->out_ids, n * sizeof *sb->out_ids);
    m->s.ub_token = (uint32_t *)fz_dup((const uint8_t *)sb->ub_token, n * sizeof *sb->ub_token);
    m->s.ub_pos = (int32_t *)fz_dup((const uint8_t *)sb->ub_pos, n * sizeof *sb->ub_pos);
    m->s.ub_seq_off = (uint32_t *)fz_dup((const uint8_t *)sb->ub_seq_off, (n + 1) * sizeof *sb->ub_seq_off);
    m->s.ub_seq_ids = (int32_t *)fz_dup((const uint8_t *)sb->ub_seq_ids, n_ids * sizeof *sb->ub_seq_ids);
    m->s.ub_output = (int8_t *)fz_dup((const uint8_t *)sb->ub_output, n * sizeof *sb->ub_output);
}

static void sb_copy_free(sb_copy *m) {
    free(m->s.pos);
    free(m->s.seq_off);
    free(m->s.seq_ids);
    free(m->s.logits);
    free(m->s.order);
    free(m->s.groups);
    free(m->s.out_ids);
    free(m->s.ub_token);
    free(m->s.ub_pos);
    free(m->s.ub_seq_off);
    free(m->s.ub_seq_ids);
    free(m->s.ub_output);
}

#define SAME_ARRAY(field, count)                                                                   \
    FUZZ_CHECK(fz_same_or_zero((const uint8_t *)sb->field, (const uint8_t *)m->s.field, (count) * sizeof *sb->field), \
               "a refused split changed " #field)

static void sb_check_same(const sb_copy *m, const kvc_sbatch *sb) {
    const size_t n = m->s.n_tokens, n_ids = m->s.seq_off[n];
    FUZZ_CHECK(sb->n_tokens == m->s.n_tokens && sb->n_left == m->s.n_left && sb->n_groups == m->s.n_groups &&
               sb->n_out == m->s.n_out && sb->simple_split == m->s.simple_split && sb->logits_all == m->s.logits_all,
               "a refused split changed the counters");
    SAME_ARRAY(pos, n);
    SAME_ARRAY(seq_off, n + 1);
    SAME_ARRAY(seq_ids, n_ids);
    if (m->s.logits) {
        SAME_ARRAY(logits, n);
    }
    SAME_ARRAY(order, n);
    SAME_ARRAY(groups, m->s.n_groups);
    SAME_ARRAY(out_ids, m->s.n_out);
    SAME_ARRAY(ub_token, n);
    SAME_ARRAY(ub_pos, n);
    SAME_ARRAY(ub_seq_off, n + 1);
    SAME_ARRAY(ub_seq_ids, n_ids);
    SAME_ARRAY(ub_output, n);
}

/* The batch as given, kept by the target to judge the splits. */
typedef struct batch {
    uint32_t n;
    int32_t pos[MAX_TOKENS];
    uint32_t off[MAX_TOKENS + 1];
    int32_t ids[MAX_TOKENS * 3];
    int8_t logits[MAX_TOKENS];
    bool has_logits, logits_all, simple;
    bool placed[MAX_TOKENS];
    uint32_t n_placed, next_simple;
} batch;

static bool same_list(const batch *b, uint32_t t, const int32_t *ids, uint32_t n_ids) {
    return b->off[t + 1] - b->off[t] == n_ids && memcmp(b->ids + b->off[t], ids, n_ids * sizeof *ids) == 0;
}

/* Judge one produced ubatch against the batch and mark its tokens placed. */
static void check_ubatch(batch *b, const kvc_sbatch *sb, const kvc_sbatch_ubatch *u, int mode, uint32_t n_ubatch,
                         uint32_t n_out_before) {
    const kvc_ubatch *ub = &u->ub;
    kvc_err err = { 0, "" };
    FUZZ_CHECK(ub->n_tokens >= 1 && ub->n_tokens <= n_ubatch, "ubatch of %u tokens for n_ubatch %u", ub->n_tokens,
               n_ubatch);
    FUZZ_CHECK(kvc_ubatch_check(ub, KVC_MAX_SEQ, &err) == KVC_OK, "malformed ubatch: %s", err.msg);
    FUZZ_CHECK(u->equal_seqs == (mode != KVC_SPLIT_SIMPLE), "equal_seqs %d in mode %d", u->equal_seqs, mode);
    if (mode == KVC_SPLIT_SIMPLE) {
        FUZZ_CHECK(ub->n_seq_tokens == 1, "simple split with %u tokens per group", ub->n_seq_tokens);
    }
    if (mode == KVC_SPLIT_SEQ) {
        FUZZ_CHECK(ub->n_seqs == 1, "split_seq made %u groups", ub->n_seqs);
    }
    kvc_seqset seen;
    kvc_seqset_clear(&seen);
    for (uint32_t g = 0; g < ub->n_seqs; g++) {
        const int32_t *gids = ub->seq_ids + ub->seq_off[g];
        const uint32_t n_gids = ub->seq_off[g + 1] - ub->seq_off[g];
        if (mode == KVC_SPLIT_EQUAL) {
            FUZZ_CHECK(n_gids == 1 || ub->n_seqs == 1, "a shared id list mixed with %u other groups", ub->n_seqs - 1);
            for (uint32_t j = 0; j < n_gids; j++) {
                FUZZ_CHECK(!kvc_seqset_has(&seen, gids[j]), "a sequence in two groups of one ubatch");
            }
            for (uint32_t j = 0; j < n_gids; j++) {
                kvc_seqset_add(&seen, gids[j]);
            }
        }
        for (uint32_t j = 0; j < ub->n_seq_tokens; j++) {
            const uint32_t k = g * ub->n_seq_tokens + j;
            const uint32_t t = u->token[k];
            FUZZ_CHECK(t < b->n, "token index %u of %u", t, b->n);
            FUZZ_CHECK(!b->placed[t], "token %u placed twice", t);
            b->placed[t] = true;
            b->n_placed++;
            FUZZ_CHECK(same_list(b, t, gids, n_gids), "token %u's ids differ from its group's", t);
            FUZZ_CHECK(ub->pos[k] == b->pos[t], "token %u at position %d, the batch says %d", t, ub->pos[k], b->pos[t]);
            const int8_t out = b->logits_all ? 1 : b->has_logits ? b->logits[t] : (int8_t)(t == b->n - 1);
            FUZZ_CHECK(u->output[k] == out, "token %u output %d, expected %d", t, u->output[k], out);
            if (mode == KVC_SPLIT_SIMPLE) {
                FUZZ_CHECK(t == b->next_simple, "simple split took token %u, next in order is %u", t, b->next_simple);
                b->next_simple++;
            } else if (j > 0) {
                FUZZ_CHECK(ub->pos[k - 1] <= ub->pos[k], "positions of a group descend at token %u", t);
            }
            if (out) {
                FUZZ_CHECK(n_out_before < sb->n_out && sb->out_ids[n_out_before] == t,
                           "out_ids[%u] is not token %u", n_out_before, t);
                n_out_before++;
            }
        }
    }
    FUZZ_CHECK(n_out_before == sb->n_out, "%u outputs listed, %u expected", sb->n_out, n_out_before);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    fz_reader r = { data, size, 0 };
    static batch b;
    memset(&b, 0, sizeof b);
    const uint8_t flags = fz_u8(&r);
    b.simple = flags & 1;
    b.logits_all = (flags >> 1) & 1;
    b.has_logits = (flags >> 2) & 1;
    b.n = fz_u16(&r) % (MAX_TOKENS + 1);
    bool valid = true;
    uint32_t k = 0;
    for (uint32_t t = 0; t < b.n; t++) {
        const uint8_t c = fz_u8(&r);
        const uint32_t n_ids = c & 3;
        b.logits[t] = (int8_t)((c >> 2) & 1);
        b.pos[t] = decode_pos(fz_u8(&r));
        valid = valid && n_ids > 0 && b.pos[t] >= 0;
        for (uint32_t j = 0; j < n_ids; j++) {
            b.ids[k] = decode_id(fz_u8(&r));
            valid = valid && b.ids[k] >= 0 && b.ids[k] < KVC_MAX_SEQ;
            k++;
        }
        b.off[t + 1] = k;
    }

    kvc_sbatch sb;
    kvc_err err = { 0, "" };
    memset(&sb, 0xA5, sizeof sb);
    const int rc = kvc_sbatch_init(&sb, b.n, b.pos, b.off, b.ids, b.has_logits ? b.logits : NULL, b.logits_all,
                                   b.simple, &err);
    if (!valid) {
        static const kvc_sbatch zero;
        FUZZ_CHECK(rc == KVC_E_ARG && err.msg[0], "an invalid batch was accepted (%d)", rc);
        FUZZ_CHECK(memcmp(&sb, &zero, sizeof sb) == 0, "a refused batch left something behind");
        kvc_sbatch_free(&sb);
        return 0;
    }
    FUZZ_CHECK(rc == KVC_OK, "a valid batch of %u tokens was refused: %d (%s)", b.n, rc, err.msg);
    FUZZ_CHECK(sb.n_tokens == b.n && sb.n_left == b.n, "splitter of %u tokens for a batch of %u", sb.n_tokens, b.n);

    /* the program, then a drain with valid calls */
    const int drain_mode = b.simple ? KVC_SPLIT_SIMPLE : (flags >> 3) & 1 ? KVC_SPLIT_SEQ : KVC_SPLIT_EQUAL;
    const uint32_t drain_n = 1 + (flags >> 4);
    for (uint32_t calls = 0;; calls++) {
        int mode;
        uint32_t n_ubatch;
        if (!fz_done(&r)) {
            const uint8_t op = fz_u8(&r);
            mode = op & 3;
            n_ubatch = op >> 2;
        } else {
            mode = drain_mode;
            n_ubatch = drain_n;
        }
        FUZZ_CHECK(calls <= size + b.n + 1, "the splitter does not make progress");
        const bool ok_call = n_ubatch > 0 && mode != 3 && (mode == KVC_SPLIT_SIMPLE) == b.simple;
        const uint32_t n_left = sb.n_left, n_out = sb.n_out;
        kvc_sbatch_ubatch u;
        memset(&u, 0, sizeof u);
        if (!ok_call) {
            sb_copy before;
            sb_take(&before, &sb);
            const int s = kvc_sbatch_split(&sb, (enum kvc_split_mode)mode, n_ubatch, &u, &err);
            FUZZ_CHECK(s == KVC_E_ARG, "split(mode %d, n_ubatch %u) on a %s splitter returned %d", mode, n_ubatch,
                       b.simple ? "simple" : "sorting", s);
            sb_check_same(&before, &sb);
            sb_copy_free(&before);
            continue;
        }
        const int s = kvc_sbatch_split(&sb, (enum kvc_split_mode)mode, n_ubatch, &u, &err);
        FUZZ_CHECK(s == 0 || s == 1, "split failed: %d (%s)", s, err.msg);
        if (s == 0) {
            FUZZ_CHECK(n_left == 0 && u.ub.n_tokens == 0, "exhausted with %u tokens left", n_left);
            if (fz_done(&r)) {
                break;
            }
            continue;
        }
        FUZZ_CHECK(sb.n_left + u.ub.n_tokens == n_left, "n_left went from %u to %u for %u tokens", n_left, sb.n_left,
                   u.ub.n_tokens);
        check_ubatch(&b, &sb, &u, mode, n_ubatch, n_out);
    }
    FUZZ_CHECK(b.n_placed == b.n, "%u of %u tokens placed", b.n_placed, b.n);
    kvc_sbatch_free(&sb);
    return 0;
}
