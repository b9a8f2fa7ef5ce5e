/* Tests of the objects' lock (csrc/kvc_lock.h): reentrancy for its holder, the refusals of a
 * change (an operation of the holder in progress, a reservation held), a failed allocation at
 * init, and threads contending for it (each increment of a shared counter made under it is kept;
 * a thread queued by kvc_lock_enter gets it from the holder's last release). */
#define _POSIX_C_SOURCE 200112L
#include "kvc_common.h"
#include "kvc_lock.h"

#include <pthread.h>
#include <sched.h>
#include <string.h>

#include "check.h"

static void test_reentrant(void) {
    kvc_lock l;
    REQUIRE(kvc_lock_init(&l, NULL) == KVC_OK, "init");
    CHECK(!kvc_lock_mine(&l, 1), "free: nobody's");
    CHECK(kvc_lock_enter(&l, 1), "a free lock is taken");
    CHECK(kvc_lock_mine(&l, 1) && !kvc_lock_mine(&l, 2), "held by 1");
    CHECK(kvc_lock_enter(&l, 1), "the holder enters again");
    kvc_lock_acquire(&l, 1);
    kvc_lock_release(&l);
    kvc_lock_release(&l);
    CHECK(kvc_lock_mine(&l, 1), "held until the last release");
    kvc_lock_release(&l);
    CHECK(!kvc_lock_mine(&l, 1), "free after as many releases as acquisitions");
    CHECK(kvc_lock_waiting(&l) == 0, "nobody waited");
    kvc_lock_acquire(&l, 2);
    CHECK(kvc_lock_mine(&l, 2), "another thread takes it once free");
    kvc_lock_release(&l);
    kvc_lock_free(&l);
    kvc_lock_free(&l);   /* harmless twice */
}

static void test_refusals(void) {
    uint32_t imports = 0;
    kvc_lock l;
    REQUIRE(kvc_lock_init(&l, &imports) == KVC_OK, "init");
    CHECK(kvc_lock_acquire_change(&l, 1) == KVC_LOCK_FREE_TO_CHANGE, "a change goes ahead");
    CHECK(kvc_lock_mine(&l, 1), "and holds the lock");
    l.busy++;   /* an operation of the holder begins; a callback of it asks for a change */
    CHECK(kvc_lock_acquire_change(&l, 1) == KVC_LOCK_BUSY, "refused during the holder's operation");
    CHECK(kvc_lock_mine(&l, 1), "the operation still holds it");
    kvc_lock_acquire(&l, 1);   /* a read of the callback is allowed */
    kvc_lock_release(&l);
    l.busy--;
    kvc_lock_release(&l);
    CHECK(!kvc_lock_mine(&l, 1), "a refused change leaves no acquisition behind");

    imports = 1;
    CHECK(kvc_lock_acquire_change(&l, 2) == KVC_LOCK_RESERVED, "refused while a reservation is held");
    CHECK(!kvc_lock_mine(&l, 2), "and not held");
    kvc_lock_acquire(&l, 2);
    CHECK(kvc_lock_refusal(&l) == KVC_LOCK_RESERVED, "reads go ahead, the holder sees why a change would not");
    kvc_lock_release(&l);
    imports = 0;
    CHECK(kvc_lock_acquire_change(&l, 2) == KVC_LOCK_FREE_TO_CHANGE, "a change once the reservation is gone");
    kvc_lock_release(&l);
    kvc_lock_free(&l);
}

static void test_init_fails(void) {
    kvc_lock l;
    kvc_fail_alloc_after = 1;
    CHECK(kvc_lock_init(&l, NULL) == KVC_E_NOMEM, "no memory for the wake-up object");
    kvc_fail_alloc_after = 0;
    kvc_lock_free(&l);
}

/* --- threads ---------------------------------------------------------------------------- */
enum { N_THREADS = 4, ROUNDS = 20000 };

typedef struct shared {
    kvc_lock lock;
    unsigned long counter;   /* changed only under the lock */
    unsigned long nested;    /* likewise, from a reentrant acquisition */
} shared;

typedef struct worker {
    shared *s;
    uint64_t me;
} worker;

static void *work(void *arg) {
    const worker *w = arg;
    for (int i = 0; i < ROUNDS; i++) {
        kvc_lock_acquire(&w->s->lock, w->me);
        const unsigned long c = w->s->counter;
        if (i % 7 == 0) {
            sched_yield();   /* holds it longer: others queue */
        }
        w->s->counter = c + 1;
        if (i % 3 == 0) {
            kvc_lock_acquire(&w->s->lock, w->me);
            w->s->nested++;
            kvc_lock_release(&w->s->lock);
        }
        kvc_lock_release(&w->s->lock);
    }
    return NULL;
}

static void test_threads(void) {
    shared s;
    memset(&s, 0, sizeof s);
    REQUIRE(kvc_lock_init(&s.lock, NULL) == KVC_OK, "init");
    pthread_t t[N_THREADS];
    worker w[N_THREADS];
    int started = 0;
    for (int k = 0; k < N_THREADS; k++) {
        w[k].s = &s;
        w[k].me = (uint64_t)k + 1;
        if (pthread_create(&t[k], NULL, work, &w[k]) != 0) {
            break;
        }
        started++;
    }
    for (int k = 0; k < started; k++) {
        pthread_join(t[k], NULL);
    }
    CHECK(started > 1, "threads started: %d", started);
    CHECK(s.counter == (unsigned long)started * ROUNDS, "every increment kept: %lu of %lu", s.counter,
          (unsigned long)started * ROUNDS);
    CHECK(s.nested == (unsigned long)started * ((ROUNDS + 2) / 3), "every nested increment kept: %lu", s.nested);
    CHECK(s.lock.count == 0 && s.lock.owner == 0 && kvc_lock_waiting(&s.lock) == 0, "free at the end");
    kvc_lock_free(&s.lock);
}

typedef struct queued {
    kvc_lock *l;
    int got;
} queued;

static void *take_queued(void *arg) {
    queued *q = arg;
    if (!kvc_lock_enter(q->l, 2)) {
        kvc_lock_wait(q->l, 2);
    }
    q->got = kvc_lock_mine(q->l, 2);
    kvc_lock_release(q->l);
    return NULL;
}

static void test_hand_over(void) {
    kvc_lock l;
    REQUIRE(kvc_lock_init(&l, NULL) == KVC_OK, "init");
    queued q = { &l, 0 };
    kvc_lock_acquire(&l, 1);
    kvc_lock_acquire(&l, 1);
    pthread_t t;
    REQUIRE(pthread_create(&t, NULL, take_queued, &q) == 0, "thread");
    while (kvc_lock_waiting(&l) == 0) {
        sched_yield();   /* until the other thread blocks in kvc_lock_wait */
    }
    kvc_lock_release(&l);
    CHECK(kvc_lock_waiting(&l) == 1 && kvc_lock_mine(&l, 1), "the first release keeps it");
    kvc_lock_release(&l);
    pthread_join(t, NULL);
    CHECK(q.got, "the waiter held it after the holder's last release");
    CHECK(l.count == 0 && l.owner == 0 && kvc_lock_waiting(&l) == 0, "free at the end");
    kvc_lock_free(&l);
}

int main(void) {
    test_reentrant();
    test_refusals();
    test_init_fails();
    test_threads();
    test_hand_over();
    printf("test_lock: %d checks, %d failed\n", n_checks, n_failed);
    return n_failed != 0;
}
