"""A mixed workload of cheap kvcache operations, for leak checks.

tests/test_leaks.py runs it a million times and asserts that memory stays flat;
tools/valgrind.sh runs a few thousand operations of it (and its allocation-failure part)
under valgrind and asserts that nothing kvcache allocated is lost.

    python tests/leak_workload.py [N_OPS] [--inject]
"""
import io
import random
import sys
import warnings

import numpy as np

import kvcache
from kvcache import _core


def _read(cache, blob, seq_id):
    try:
        cache.state_read(blob, seq_id)
    except kvcache.StateError:      # no contiguous room for the sequence now
        pass


class Workload:
    """Caches of every variant and a step() that runs one operation picked at random (the
    error paths included: bad arguments, truncated states, no room)."""

    def __init__(self, seed=0):
        self.rng = random.Random(seed)
        self.unified = kvcache.UnifiedCache(128, 2, [16, 32], [32, 16], n_seq_max=4, n_embd_head_k=8,
                                            rope=kvcache.RopeParams(8))
        self.iswa = kvcache.ISWACache(64, 3, 16, 16, swa_layers=[1], n_swa=4, n_batch=8, n_seq_max=4)
        self.recurrent = kvcache.RecurrentCache(4, 2, 8, 16)
        self.meta = kvcache.UnifiedCache(64, 1, 32, 32, type_k="q8_0", type_v="q8_0", v_trans=False, buffers=None,
                                         n_seq_max=4)
        self.ubs = [kvcache.UBatch([p, p + 1], [s, s]) for p in range(0, 60, 6) for s in range(4)]
        self.blob = self.unified.state_write()

    def step(self):
        rng = self.rng
        c = self.unified
        s = rng.randrange(4)
        k = rng.randrange(100)
        ub = rng.choice(self.ubs)
        if k >= 40:
            # the cheapest calls, most of the time: a server's per-token bookkeeping
            if k < 70:
                c.seq_pos_max(s)
                self.recurrent.seq_pos_min(s)
                self.iswa.seq_pos_max(s)
            elif k < 85:
                if c.find_slot(ub):
                    c.slot
                c.restore()
            else:
                c.seq_add(s, 0, -1, 0)
                c.used, c.head, self.recurrent.used
            return
        if 31 <= k < 34 and rng.random() < 0.7:
            k = 5          # batches are slow to build: fewer of them
        if k == 0:
            if c.find_slot(ub):
                c.store(0, np.ones((2, 16), np.float32), np.zeros((2, 32), np.float16))
            (c.commit if rng.random() < 0.5 else c.restore)()
        elif k == 1:
            c.seq_rm(s, rng.randrange(-1, 30), -1)
        elif k == 2:
            c.seq_cp(s, (s + 1) % 4, -1, -1)
        elif k == 3:
            c.seq_add(s, 0, -1, rng.randrange(-3, 4))
        elif k == 4:
            c.seq_div(s, 0, -1, 2)
        elif k == 5:
            c.seq_pos_min(s) + c.seq_pos_max(s)
        elif k == 6:
            c.kq_mask(ub)
        elif k == 7:
            c.kq_mask(ub, dtype="bool", out=np.empty((64, c.n), dtype=np.bool_))
        elif k == 8:
            c.cells()
        elif k == 9:
            blob = c.state_write(s)
            try:
                c.state_read(blob, (s + 1) % 4)
            except kvcache.StateError:
                pass
        elif k == 10:
            c.state_read(c.state_write())
        elif k == 11:
            try:
                c.state_read(self.blob[:rng.randrange(len(self.blob))])
            except kvcache.StateError:
                pass
        elif k == 12:
            c.k_shift()
            c.defrag_sched(-1.0)
            c.update()
        elif k == 13:
            c.defrag_prepare(8)
            c.defrag_runs()
            c.defrag_move()
        elif k == 14:
            c.state_write_into(bytearray(c.state_size()))
        elif k == 15:
            c.state_write_into(io.BytesIO(), s)
        elif k == 16:
            for bad in (lambda: c.seq_rm(99), lambda: c.seq_add("x", 0, 1, 1), lambda: c.k(7),
                        lambda: c.kq_mask(ub, dtype="f64"), lambda: c.state_read(3.5)):
                try:
                    bad()
                except (ValueError, TypeError, IndexError):
                    pass
        elif k == 17:
            c.pos_bucket(ub, 32)
        elif k == 18:
            with _core._Hold(c):
                c.head, c.n, c.used, c.slot
        elif k == 19:
            c.clear()
        elif k < 25:
            self._iswa(rng, s, k)
        elif k < 31:
            self._recurrent(rng, s, k)
        elif k < 34:
            b = kvcache.Batch([0, 1, 2, 3, 0], [s, s, s, [0, 1], 2], simple_split=rng.random() < 0.5)
            for u in b.ubatches(2):
                u.pos
            b.out_ids
        elif k < 36:
            kvcache.UBatch([1, 2, 3], [[0, 1], 2, 3])
        elif k == 36:
            m = self.meta
            if m.find_slot(ub):
                m.commit()
            m.update()
            m.state_read(m.state_write())
        elif k == 37:
            kk = np.ones((4, 16), np.float16)
            kvcache.rope_shift(kk, "f16", 2, 8, np.arange(4, dtype=np.int32), kvcache.RopeParams(8))
        elif k == 38:
            q = kvcache.quantize(np.ones((2, 32), np.float32), "q8_0")
            kvcache.dequantize(q, "q8_0", 32)
        else:
            repr(c), repr(self.iswa), repr(self.recurrent)

    def _iswa(self, rng, s, k):
        c = self.iswa
        if k == 20:
            b = kvcache.Batch([rng.randrange(40) + i for i in range(3)], [s] * 3)
            ok = all(c.find_slot(u) for u in c.ubatches(b, 2))
            (c.commit if ok else c.restore)()
        elif k == 21:
            c.kq_mask(rng.choice(self.ubs))
        elif k == 22:
            _read(c, c.state_write(s), s)
        elif k == 23:
            c.seq_rm(s, rng.randrange(40), -1)
            c.update()
        else:
            c.clear() if rng.random() < 0.1 else c.k_shift()

    def _recurrent(self, rng, s, k):
        c = self.recurrent
        if k == 25:
            p = c.seq_pos_max(s) + 1
            try:
                c.find_slot(kvcache.UBatch([p, p + 1], [s], n_seq_tokens=2))
            except ValueError:
                pass
            c.store(0, np.ones((1, 8), np.float32), None)
        elif k == 26:
            c.s_copy()
            c.s_mask()
        elif k == 27:
            _read(c, c.state_write(s), s)
        elif k == 28:
            c.seq_rm(s, 0, -1)
        elif k == 29:
            c.cells()
        else:
            c.clear() if rng.random() < 0.1 else c.state_read(c.state_write())

    def run(self, n):
        with warnings.catch_warnings(), np.errstate(all="ignore"):
            warnings.simplefilter("ignore")
            for _ in range(n):
                self.step()


def inject_failures(rounds=3):
    """Every C allocation of the operations that allocate, made to fail in turn: the error
    paths must free what they allocated."""
    for _ in range(rounds):
        for n in range(1, 40):
            _core._fail_alloc_after(n)
            try:
                w = Workload(seed=n)
                w.run(50)
            except MemoryError:
                pass
            finally:
                _core._fail_alloc_after(0)


if __name__ == "__main__":
    n_ops = int(sys.argv[1]) if len(sys.argv) > 1 and not sys.argv[1].startswith("-") else 5000
    Workload(seed=1).run(n_ops)
    if "--inject" in sys.argv:
        inject_failures()
    print(f"leak workload: {n_ops} operations done")
