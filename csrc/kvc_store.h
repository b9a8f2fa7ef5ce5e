/* The checksum of the prefix store's chunk files (src/kvcache/store.py, docs/store.md).
 *
 * A position-dependent sum over the bytes read as little-endian 64-bit words in four lanes
 * (Fletcher's scheme: each lane keeps the sum of its words and the sum of those sums), finished
 * by a 64-bit mix of the lanes and the byte count (a last partial group counts as zero-padded).
 * It runs at the speed of the memory it reads, so that a chunk read from disk is checked in the
 * time of the read itself; it detects flipped bits, zeroed or garbled pages, truncation and
 * words moved within a file, not an adversary. */
#ifndef KVC_STORE_H
#define KVC_STORE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define KVC_STORE_GROUP 32u  /* bytes per step: one 64-bit word per lane */

/* The sum of the bytes seen so far. */
typedef struct kvc_store_sum {
    uint64_t a[4];                      /* per lane: the sum of its words */
    uint64_t b[4];                      /* per lane: the sum of the running sums a */
    uint64_t n;                         /* bytes seen */
    uint8_t  pend[KVC_STORE_GROUP];     /* the bytes of a group not complete yet */
    uint32_t n_pend;
} kvc_store_sum;

/* An empty sum. */
void kvc_store_sum_init(kvc_store_sum *s);

/* Add n bytes (updates may split the bytes anywhere). */
void kvc_store_sum_update(kvc_store_sum *s, const uint8_t *p, size_t n);

/* Copy n bytes from src to dst (not overlapping) and add them, in one pass over src while it
 * is in the first-level cache. With stream, dst is written with non-temporal stores (kvc_copy):
 * call kvc_stream_fence() before reading it. */
void kvc_store_sum_copy(kvc_store_sum *s, uint8_t *dst, const uint8_t *src, size_t n, bool stream);

/* Read n bytes from file descriptor fd, from its offset on, into dst and add them to s, in steps
 * of step bytes (> 0) while each is in the caches: with bounce (step bytes) each step is read
 * into it, then copied into dst and added in one pass (non-temporal stores with stream: call
 * kvc_stream_fence() before reading dst); without, read straight into dst and added. One call
 * per file, no caller's loop per step. 0 when read whole, 1 when the file ends first, -1 on a
 * read error (errno says which; an interrupted read is retried). */
int kvc_store_read(kvc_store_sum *s, int fd, uint8_t *dst, size_t n, uint8_t *bounce, size_t step, bool stream);

/* The checksum of the bytes seen (the sum is unchanged: more may follow a peek). */
uint64_t kvc_store_sum_digest(const kvc_store_sum *s);

#endif
