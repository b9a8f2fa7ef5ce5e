/* The lock's slow path: the wake-up object waiters block on, a count of hand-overs not yet
 * taken behind a mutex and a condition variable (POSIX threads, or Windows' slim locks). */
#include "kvc_lock.h"
#include "kvc_common.h"

#include <string.h>

#if defined(_WIN32)
#define WIN32_LEAN_AND_MEAN
#include <windows.h>
#define KVC_LOCK_WIN32 1
#elif (defined(__unix__) || defined(__APPLE__)) && !defined(KVC_NO_THREADS)
#include <pthread.h>
#define KVC_LOCK_PTHREADS 1
#endif

struct kvc_lock_wake {
#if defined(KVC_LOCK_WIN32)
    SRWLOCK m;
    CONDITION_VARIABLE c;
#elif defined(KVC_LOCK_PTHREADS)
    pthread_mutex_t m;
    pthread_cond_t c;
#endif
    unsigned long posted;   /* hand-overs not yet taken by a waiter */
};

int kvc_lock_init(kvc_lock *l, const uint32_t *holds) {
    memset(l, 0, sizeof *l);
    l->holds = holds;
    kvc_lock_wake *w = kvc_malloc(sizeof *w);
    if (w == NULL) {
        return KVC_E_NOMEM;
    }
    memset(w, 0, sizeof *w);
#if defined(KVC_LOCK_WIN32)
    InitializeSRWLock(&w->m);
    InitializeConditionVariable(&w->c);
#elif defined(KVC_LOCK_PTHREADS)
    if (pthread_mutex_init(&w->m, NULL) != 0) {
        kvc_free(w);
        return KVC_E_NOMEM;
    }
    if (pthread_cond_init(&w->c, NULL) != 0) {
        pthread_mutex_destroy(&w->m);
        kvc_free(w);
        return KVC_E_NOMEM;
    }
#endif
    l->wake = w;
    return KVC_OK;
}

void kvc_lock_free(kvc_lock *l) {
    kvc_lock_wake *w = l->wake;
    if (w == NULL) {
        return;
    }
#if defined(KVC_LOCK_PTHREADS)
    pthread_cond_destroy(&w->c);
    pthread_mutex_destroy(&w->m);
#endif
    kvc_free(w);
    l->wake = NULL;
}

void kvc_lock_wait(kvc_lock *l, uint64_t me) {
    kvc_lock_wake *w = l->wake;
    KVC_LOCK_ADD(&l->waiting, 1);
#if defined(KVC_LOCK_WIN32)
    AcquireSRWLockExclusive(&w->m);
    while (w->posted == 0) {
        SleepConditionVariableSRW(&w->c, &w->m, INFINITE, 0);
    }
    w->posted--;
    ReleaseSRWLockExclusive(&w->m);
#elif defined(KVC_LOCK_PTHREADS)
    pthread_mutex_lock(&w->m);
    while (w->posted == 0) {
        pthread_cond_wait(&w->c, &w->m);
    }
    w->posted--;
    pthread_mutex_unlock(&w->m);
#else
    w->posted--;   /* without threads nobody else holds it: the hand-over is already posted */
#endif
    KVC_LOCK_ADD(&l->waiting, -1);
    KVC_LOCK_SET_OWNER(l, me);
    l->depth = 1;
}

void kvc_lock_hand_over(kvc_lock *l) {
    kvc_lock_wake *w = l->wake;
#if defined(KVC_LOCK_WIN32)
    AcquireSRWLockExclusive(&w->m);
    w->posted++;
    ReleaseSRWLockExclusive(&w->m);
    WakeConditionVariable(&w->c);
#elif defined(KVC_LOCK_PTHREADS)
    pthread_mutex_lock(&w->m);
    w->posted++;
    pthread_cond_signal(&w->c);
    pthread_mutex_unlock(&w->m);
#else
    w->posted++;
#endif
}
