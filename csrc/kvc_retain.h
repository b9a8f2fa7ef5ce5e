/* kvcache — prefix reuse, the requests' side: a finished request hands its cells to the cache's
 * prefix index (kvc_retain_release), a new one takes the longest prefix the index holds
 * (kvc_retain_attach) and computes only the rest. The rules the cache follows for the cells the
 * index holds are kvc_reuse.h's.
 *
 * Prompts start at position 0: token i of a prompt is at position i. A sequence's cells are
 * kept for the leading tokens whose cell sits at exactly that position with no shift pending
 * (a sequence moved by seq_add keeps nothing from the first moved cell on); leading cells that
 * are, cell for cell, the prefix the sequence attached or published last are kept as the index
 * holds them, unchecked. With the per-cell
 * extension a prompt may hold several tokens at one position (an image's, by 2-D position) and
 * jump past them: its tokens are taken in the order they see each other (kvc_retain_release),
 * and each held cell keeps its position. Attaching puts the
 * matched cells in the sequence (a cell the index holds for no live sequence gets its position
 * back; K/V are never copied) and locks the prefix, so that it is not evicted while the sequence
 * holds it; with a stream per sequence, a prefix held in another stream is brought over with a
 * stream copy, which the next update performs (as seq_cp across streams). */
#ifndef KVC_RETAIN_H
#define KVC_RETAIN_H

#include "kvc_reuse.h"

#ifdef __cplusplus
extern "C" {
#endif

/* What a release did. */
typedef struct kvc_retained {
    uint32_t n_kept;      /* leading tokens of the prompt the index holds now (0: it could not keep
                           * it: the cap is taken by protected prefixes) */
    uint32_t n_new;       /* of those, the cells the index took from the sequence */
    uint32_t n_evicted;   /* cells evicted to stay under the cap */
} kvc_retained;

/* Sequence s ends: the cells holding tokens[0 .. n) (the longest run of them at positions 0, 1,
 * ..., unshifted; with the extension, the cells in the order their tokens see each other: by
 * position, one position's tokens by 2-D position, row-major, a position after several tokens
 * one past their largest x or y) go to the index under salt, the sequence leaves every cell (seq_rm(s)); cells
 * only the sequence held and the index did not take become free. KVC_OK with *res;
 * KVC_E_ARG (reuse off; s not a sequence id; a cell the index holds for another token),
 * KVC_E_NOMEM (nothing changed). */
int kvc_retain_release(kvc_unified *c, int32_t s, uint64_t salt, const int32_t *tokens, uint32_t n,
                       kvc_retained *res, kvc_err *err);

/* The tokens a release of sequence s without tokens would keep, as the cells recorded them (the
 * leading positions 0, 1, ..., unshifted), into toks (room for kvc_retain_seq_cells(c, s)).
 * Returns how many (0 when reuse is off). Changes nothing the cache shows. */
uint32_t kvc_retain_seq_tokens(kvc_unified *c, int32_t s, int32_t *toks);
/* The cells sequence s holds: the room kvc_retain_seq_tokens needs. */
uint32_t kvc_retain_seq_cells(const kvc_unified *c, int32_t s);

/* Sequence s goes on, and what it holds of tokens[0 .. n) (as kvc_retain_release would keep
 * it) goes to the index now, for other requests to attach while s runs: the cells stay s's too
 * (shared, as seq_cp shares them), and s holds a lock on the prefix (it is not evicted while s
 * holds cells). What s later removes stays in the index (its K/V are unchanged); what it moves
 * or what is overwritten, the index forgets. KVC_OK with *res (n_evicted: by the cap);
 * KVC_E_ARG (reuse off, s not a sequence id), KVC_E_NOMEM (nothing changed). */
int kvc_retain_publish(kvc_unified *c, int32_t s, uint64_t salt, const int32_t *tokens, uint32_t n,
                       kvc_retained *res, kvc_err *err);

/* The longest prefix of tokens[0 .. n) the index holds under salt, leaving at least one token to
 * compute: at most n - 1 (0 when reuse is off); with a stream per sequence, of it the run in the
 * stream of its first token (what kvc_retain_attach takes). Touches the prefix (it becomes
 * recently used). */
uint32_t kvc_retain_match(kvc_unified *c, uint64_t salt, const int32_t *tokens, uint32_t n);

/* Sequence s (which holds no cell) takes the longest prefix of tokens[0 .. n) the index holds
 * under salt, at most n - 1 tokens: *n_attached of them, at positions 0 .. *n_attached - 1.
 * KVC_OK; KVC_E_ARG (reuse off, s not a sequence id or not empty); KVC_E_NOMEM (a stream copy could not be queued;
 * nothing changed). */
int kvc_retain_attach(kvc_unified *c, int32_t s, uint64_t salt, const int32_t *tokens, uint32_t n,
                      uint32_t *n_attached, kvc_err *err);

/* Pin the prefix tokens[0 .. n) (all of it must be held): it is not evicted until unpinned.
 * *pin names the pin for kvc_retain_unpin. KVC_OK, KVC_E_ARG (not held, reuse off). */
int kvc_retain_pin(kvc_unified *c, uint64_t salt, const int32_t *tokens, uint32_t n, kvc_prefix_handle *pin,
                   kvc_err *err);
/* KVC_OK, KVC_E_ARG (not a pin of this index: unknown, already unpinned, or its prefix left). */
int kvc_retain_unpin(kvc_unified *c, kvc_prefix_handle pin, kvc_err *err);
/* Whether pin names a pin kvc_retain_unpin takes now (reuse on, the prefix held and pinned). */
bool kvc_retain_pin_held(const kvc_unified *c, kvc_prefix_handle pin);

/* With the per-cell extension (kvc_reuse.h): match, attach and pin as above, counting a held
 * cell only where it sits at the position the request places tokens[i] at (pos[i]; NULL: i)
 * with the extension it places there: (pos_x[i], pos_y[i]) (NULL: zeros) and, with per-layer
 * embeddings, tokens[i]. Attached cells get their positions back. Without the extension the
 * same as the functions above (pos, pos_x, pos_y ignored). */
uint32_t kvc_retain_match_xy(kvc_unified *c, uint64_t salt, const int32_t *tokens, const int32_t *pos,
                             const int32_t *pos_x, const int32_t *pos_y, uint32_t n);
int kvc_retain_attach_xy(kvc_unified *c, int32_t s, uint64_t salt, const int32_t *tokens, const int32_t *pos,
                         const int32_t *pos_x, const int32_t *pos_y, uint32_t n, uint32_t *n_attached, kvc_err *err);
int kvc_retain_pin_xy(kvc_unified *c, uint64_t salt, const int32_t *tokens, const int32_t *pos, const int32_t *pos_x,
                      const int32_t *pos_y, uint32_t n, kvc_prefix_handle *pin, kvc_err *err);

/* --- composite caches (an iSWA pair): a prefix counts as far as every part holds it ------- */
/* Turn reuse on in every part (all or none). */
int kvc_retain_enable_parts(kvc_unified *const *cs, uint32_t n_parts, uint32_t cap, kvc_err *err);
/* Turn reuse on in an iSWA pair whose SWA cache is smaller than its base cache (both or
 * neither): the base as kvc_reuse_enable (cap), the SWA cache in window mode (kvc_reuse.h),
 * remembering prompts of up to the base's size. A hit of length P then needs the base's cells of
 * tokens 0 .. P-1 and the SWA cache's cells of the window before P (the tokens a query at token
 * P's position sees); the SWA cache remembers the rest of each prompt without cells (with the
 * extension, with each token's position and extension). KVC_E_ARG also when the two caches
 * disagree on the extension. */
int kvc_retain_enable_window_pair(kvc_unified *base, kvc_unified *swa, uint32_t cap, kvc_err *err);
/* The longest hit every part serves: the smallest of the parts' matches, and in a part in
 * window mode the longest hit no longer than that whose window it holds (the window of token
 * P's position: P with pos NULL, else pos[P]). */
uint32_t kvc_retain_match_parts(kvc_unified *const *cs, uint32_t n_parts, uint64_t salt, const int32_t *tokens,
                                uint32_t n);
/* Whether every part serves a hit of exactly p tokens of tokens[0 .. n) (0 < p <= n): a part in
 * window mode only where it holds the window before p. Both parts' prefixes count as used. */
bool kvc_retain_serves_parts(kvc_unified *const *cs, uint32_t n_parts, uint64_t salt, const int32_t *tokens,
                             uint32_t n, uint32_t p);
/* Attach that many tokens in every part, or nothing (KVC_E_ARG: s not a sequence id, or not empty in some part;
 * KVC_E_NOMEM). */
int kvc_retain_attach_parts(kvc_unified *const *cs, uint32_t n_parts, int32_t s, uint64_t salt,
                            const int32_t *tokens, uint32_t n, uint32_t *n_attached, kvc_err *err);
/* With the per-cell extension: match and attach in every part as above, a held cell counting
 * only where its extension is what the request places there (kvc_retain_match_xy). */
uint32_t kvc_retain_match_parts_xy(kvc_unified *const *cs, uint32_t n_parts, uint64_t salt, const int32_t *tokens,
                                   const int32_t *pos, const int32_t *pos_x, const int32_t *pos_y, uint32_t n);
int kvc_retain_attach_parts_xy(kvc_unified *const *cs, uint32_t n_parts, int32_t s, uint64_t salt,
                               const int32_t *tokens, const int32_t *pos, const int32_t *pos_x, const int32_t *pos_y,
                               uint32_t n, uint32_t *n_attached, kvc_err *err);
/* Release in every part: res->n_kept the smallest of the parts' (what a later request can reuse),
 * n_new and n_evicted summed. A part in window mode keeps the prompt the others kept (tokens
 * whose cells it no longer has as ghosts), so the parts that are not go first. A failure
 * (KVC_E_NOMEM) in a part leaves the parts before it released. */
int kvc_retain_release_parts(kvc_unified *const *cs, uint32_t n_parts, int32_t s, uint64_t salt,
                             const int32_t *tokens, uint32_t n, kvc_retained *res, kvc_err *err);
/* kvc_retain_publish in every part, as release_parts. */
int kvc_retain_publish_parts(kvc_unified *const *cs, uint32_t n_parts, int32_t s, uint64_t salt,
                             const int32_t *tokens, uint32_t n, kvc_retained *res, kvc_err *err);
/* Pin the prefix in every part (kvc_retain_pin_xy), pins[k] part k's pin: KVC_OK, or the first
 * part's refusal with no part pinned (the pins of the parts before it let go). */
int kvc_retain_pin_parts_xy(kvc_unified *const *cs, uint32_t n_parts, uint64_t salt, const int32_t *tokens,
                            const int32_t *pos, const int32_t *pos_x, const int32_t *pos_y, uint32_t n,
                            kvc_prefix_handle *pins, kvc_err *err);
/* Let go of pins[k] in every part k, each checked before any is let go: KVC_OK, or the refusal of
 * the first part whose pin kvc_retain_unpin does not take, nothing changed. */
int kvc_retain_unpin_parts(kvc_unified *const *cs, uint32_t n_parts, const kvc_prefix_handle *pins, kvc_err *err);
/* kvc_reuse_evict(n) in every part: the cells evicted in all. */
uint32_t kvc_retain_evict_parts(kvc_unified *const *cs, uint32_t n_parts, uint32_t n);

#ifdef __cplusplus
}
#endif

#endif
