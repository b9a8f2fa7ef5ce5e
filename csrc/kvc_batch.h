/* kvcache — the batch splitter: cuts one batch of tokens into ubatches.
 *
 * Behaviour follows llama.cpp's llama_sbatch (split_simple / split_equal /
 * split_seq), including the order of tokens and groups, which output flags are
 * set and the order of out_ids.
 *
 * A splitter built with simple_split keeps the batch in its given order and
 * only serves split_simple. Otherwise the tokens are sorted (more sequence ids
 * first, then by the id list element by element, then by position) and runs of
 * tokens with the same id list form groups, which are ordered by fewer ids
 * first and, among equals, longer groups first; split_equal and split_seq take
 * tokens from the end of that group list.
 *
 * The splitter owns copies of its inputs and the buffers of the ubatch it last
 * produced: a split never allocates, so it cannot fail half-way. */
#ifndef KVC_BATCH_H
#define KVC_BATCH_H

#include "kvc_common.h"
#include "kvc_ubatch.h"

#ifdef __cplusplus
extern "C" {
#endif

enum kvc_split_mode {
    KVC_SPLIT_SIMPLE = 0,  /* a prefix of the batch, one group per token */
    KVC_SPLIT_EQUAL  = 1,  /* equal-length slices of several groups */
    KVC_SPLIT_SEQ    = 2,  /* a slice of the last group alone */
};

/* A run of tokens (consecutive in split order) that share one sequence id list. */
typedef struct kvc_sbatch_group {
    uint32_t n_seq_id;  /* ids in the shared list; 0 for the one group of a simple splitter */
    uint32_t token;     /* a batch token carrying the group's id list */
    uint32_t offset;    /* next token of the group, as an index into order[] */
    uint32_t length;    /* tokens of the group not yet placed into a ubatch */
} kvc_sbatch_group;

/* A ubatch produced by a split. Its arrays belong to the splitter and stay valid until the
 * next split or kvc_sbatch_free. For a simple split every token is its own group. */
typedef struct kvc_sbatch_ubatch {
    kvc_ubatch      ub;          /* shape, positions and per-group sequence ids */
    const uint32_t *token;       /* [ub.n_tokens] batch index of each token, in ubatch order */
    const int8_t   *output;      /* [ub.n_tokens] output flag of each token (the logits value) */
    bool            equal_seqs;  /* false for a simple split */
} kvc_sbatch_ubatch;

typedef struct kvc_sbatch {
    uint32_t          n_tokens;      /* tokens in the batch */
    uint32_t          n_left;        /* tokens not yet placed into a ubatch */
    bool              simple_split;  /* built for split_simple only */
    bool              logits_all;    /* every token is an output */
    int32_t          *pos;           /* [n_tokens] positions (copy) */
    uint32_t         *seq_off;       /* [n_tokens + 1] token t's ids: seq_ids[seq_off[t] .. seq_off[t+1]) */
    int32_t          *seq_ids;       /* flat sequence id lists (copy, order as given) */
    int8_t           *logits;        /* [n_tokens] output flags (copy), or NULL: only the last token */
    uint32_t         *order;         /* [n_tokens] batch indices in split order */
    kvc_sbatch_group *groups;        /* [n_groups] in split order; taken from the end */
    uint32_t          n_groups;      /* groups still listed (empty ones are dropped from the end) */
    uint32_t         *out_ids;       /* [n_out] output tokens in the order they were placed */
    uint32_t          n_out;         /* outputs placed so far */
    /* buffers of the last ubatch, sized for the whole batch */
    uint32_t         *ub_token;      /* [n_tokens] */
    int32_t          *ub_pos;        /* [n_tokens] */
    uint32_t         *ub_seq_off;    /* [n_tokens + 1] */
    int32_t          *ub_seq_ids;    /* [seq_off[n_tokens]] */
    int8_t           *ub_output;     /* [n_tokens] */
} kvc_sbatch;

/* Build a splitter over a batch of n_tokens tokens: pos[t] >= 0, token t's sequence ids are
 * seq_ids[seq_off[t] .. seq_off[t+1]) (at least one, each in [0, KVC_MAX_SEQ)), seq_off[0] == 0
 * and non-decreasing. logits (may be NULL) holds one output flag per token. The inputs are
 * copied. On failure (KVC_E_ARG / KVC_E_NOMEM, with err) sb holds nothing to free. */
int kvc_sbatch_init(kvc_sbatch *sb, uint32_t n_tokens, const int32_t *pos, const uint32_t *seq_off,
                    const int32_t *seq_ids, const int8_t *logits, bool logits_all, bool simple_split,
                    kvc_err *err);

/* Release what the splitter owns; sb may then be initialised again. Safe on a zeroed struct. */
void kvc_sbatch_free(kvc_sbatch *sb);

/* Place the next ubatch of at most n_ubatch (>= 1) tokens into *out. Returns 1 when a ubatch
 * was produced, 0 when the batch is exhausted (out->ub.n_tokens == 0), KVC_E_ARG (with err,
 * splitter unchanged) for n_ubatch == 0 or a mode the splitter was not built for (simple mode
 * needs simple_split, equal and seq modes need it off). */
int kvc_sbatch_split(kvc_sbatch *sb, enum kvc_split_mode mode, uint32_t n_ubatch,
                     kvc_sbatch_ubatch *out, kvc_err *err);

#ifdef __cplusplus
}
#endif

#endif
