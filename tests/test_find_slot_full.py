"""find_slot on full and nearly full caches: with fewer empty cells than the ubatch has tokens the
cache refuses without searching, and must answer (and, in semantics '2025', leave the head) as
the reference models' searches do. Random workloads keep the caches at or near full, so that the
refusals and the successes on the last free cells alternate."""
import random

import pytest

from kvcache import UBatch, UnifiedCache
from reference import UnifiedReference
from reference2026 import UnifiedReference2026


def _pair(semantics, size, n_seq, kv_unified, n_swa):
    args = dict(n_seq_max=n_seq, n_pad=1, n_swa=n_swa, swa_type="standard" if n_swa else "none")
    if semantics == "2025":
        c = UnifiedCache(size, 1, 1, 1, type_k="f32", type_v="f32", buffers=None, **args)
        return c, UnifiedReference(size, **args)
    args.update(semantics="2026", kv_unified=kv_unified)
    return (UnifiedCache(size, 1, 1, 1, type_k="f32", type_v="f32", buffers=None, **args),
            UnifiedReference2026(size, 1, 1, 1, type_k="f32", type_v="f32", **args))


def _heads(c, semantics):
    return (c.head,) if semantics == "2025" else tuple(c.heads)


def _used(c, semantics):
    return (c.used,) if semantics == "2025" else tuple(c.used_per_stream)


@pytest.mark.parametrize("semantics,kv_unified,n_swa", [
    ("2025", True, 0), ("2025", True, 4), ("2026", True, 0), ("2026", False, 0), ("2026", True, 4),
])
@pytest.mark.parametrize("seed", range(6))
def test_full_and_nearly_full_caches_answer_as_the_reference(semantics, kv_unified, n_swa, seed):
    rng = random.Random(seed)
    size = rng.choice([7, 16, 33, 64, 130])
    n_seq = 1 if kv_unified and semantics == "2026" and rng.random() < 0.5 else 3
    c, ref = _pair(semantics, size, n_seq, kv_unified, n_swa)
    nxt = [0] * n_seq
    refusals = 0
    for step in range(300):
        if rng.random() < 0.7:
            s = rng.randrange(n_seq)
            # mostly small ubatches (the last free cells), sometimes one larger than what is free
            n = rng.choice([1, 1, 2, 3, 5, size // 4 + 1, size])
            ub = UBatch(list(range(nxt[s], nxt[s] + n)), [s] * n)
            got, want = c.find_slot(ub), ref.find_slot(ub)
            assert got == want, (step, n)
            assert _heads(c, semantics) == _heads(ref, semantics), (step, n)
            if got:
                if semantics == "2025":      # a 2026 find_slot places for good
                    c.commit()
                    ref.commit()
                nxt[s] += n
            else:
                refusals += 1
        else:
            # a few holes: one position, or a short range, of one sequence
            s = rng.randrange(n_seq)
            p0 = rng.randrange(max(nxt[s], 1))
            p1 = p0 + rng.choice([1, 1, 2, 4])
            assert c.seq_rm(s, p0, p1) == ref.seq_rm(s, p0, p1)
        assert _used(c, semantics) == _used(ref, semantics), step
    assert refusals > 0


@pytest.mark.parametrize("semantics,kv_unified", [("2025", True), ("2026", True), ("2026", False)])
def test_a_completely_full_cache_refuses_and_one_free_cell_takes_a_token(semantics, kv_unified):
    size, n_seq = 64, 2
    c, ref = _pair(semantics, size, n_seq, kv_unified, 0)
    # every stream full: one table of seq 0, or a stream per sequence
    for s in range(1 if kv_unified else n_seq):
        for cache in (c, ref):
            assert cache.find_slot(UBatch(list(range(size)), [s] * size))
            if semantics == "2025":
                cache.commit()
    for n in (1, 2, size):
        ub = UBatch(list(range(size, size + n)), [0] * n)
        assert c.find_slot(ub) is False and ref.find_slot(ub) is False
        assert _heads(c, semantics) == _heads(ref, semantics)
    for cache in (c, ref):
        assert cache.seq_rm(0, 10, 11)
    ub = UBatch([size], [0])
    assert c.find_slot(ub) and ref.find_slot(ub)
    assert _heads(c, semantics) == _heads(ref, semantics)
    ub = UBatch([size + 1, size + 2], [0, 0])
    assert c.find_slot(ub) is False and ref.find_slot(ub) is False
    assert _heads(c, semantics) == _heads(ref, semantics)
