"""The benchmark's transcription of today's llama.cpp loop (benchmarks/baseline/kvc_baseline2026.cpp)
against the reference model of the 2026 semantics (tests/reference2026.py): on random workloads
both place every ubatch in the same cells, hold the same cells and heads, and write the same
masks. The baseline is what `kvcache bench` times the 2026 cases against, so it must be today's
loop, not something near it."""
import random

import numpy as np
import pytest

from conftest import needs_bench
from reference import RefUBatch
from reference2026 import UnifiedReference2026

pytestmark = needs_bench


def _pair(size, n_seq_max, kv_unified, n_swa=0, swa_type="none"):
    from kvcache_bench import _bench

    ref = UnifiedReference2026(size, 1, 4, 4, n_seq_max=n_seq_max, n_swa=n_swa, swa_type=swa_type,
                               kv_unified=kv_unified)
    swa = {"none": 0, "standard": 1, "chunked": 2}[swa_type]
    base = _bench.Baseline2026(size, 1 if kv_unified else n_seq_max, n_seq_max, 1, n_swa, swa)
    return ref, base


def _same_state(ref, base):
    assert tuple(ref.heads) == base.heads
    for s, snap in enumerate(ref.cells()):
        pos, seq = base.cells(s)
        assert np.array_equal(pos, snap.pos), f"stream {s}: positions differ"
        for i in np.flatnonzero(pos >= 0):
            ids = [64 * w + b for w in range(4) for b in range(64) if (int(seq[i, w]) >> b) & 1]
            assert ids == snap.seqs[i], f"stream {s} cell {i}: sequences {ids} / {snap.seqs[i]}"
    for q in range(ref.n_seq_max):
        assert ref.seq_pos_min(q) == base.seq_pos_min(q) and ref.seq_pos_max(q) == base.seq_pos_max(q)


def _ubatch(rng, next_pos, n_seq_max, kv_unified, live):
    """Tokens of some live sequences at their next positions: one group per sequence, all of one
    length (every cache takes that); in one stream, sometimes a token shared by two sequences."""
    seqs = rng.sample(live, rng.randint(1, min(3, len(live))))
    n = rng.choice([1, 1, 2, 5, 17])
    pos, ids = [], []
    for s in seqs:
        for k in range(n):
            pos.append(next_pos[s] + k)
            ids.append([s])
        next_pos[s] += n
    if kv_unified and len(seqs) == 1 and rng.random() < 0.2:
        other = rng.choice([q for q in range(n_seq_max) if q != seqs[0]])
        ids[-1] = [seqs[0], other]
    return pos, ids


@pytest.mark.parametrize("kv_unified,swa_type,n_swa", [(True, "none", 0), (True, "standard", 24),
                                                        (True, "chunked", 16), (False, "none", 0),
                                                        (False, "standard", 24)])
@pytest.mark.parametrize("seed", [0, 1])
def test_the_2026_baseline_is_todays_loop(kv_unified, swa_type, n_swa, seed):
    rng = random.Random(seed)
    n_seq_max, size = 4, 96
    ref, base = _pair(size, n_seq_max, kv_unified, n_swa, swa_type)
    next_pos = [0] * n_seq_max
    placed = failed = masks = 0
    for _ in range(120):
        live = list(range(n_seq_max))
        if rng.random() < 0.15:
            s = rng.randrange(-1 if kv_unified else 0, n_seq_max)
            p0 = rng.randrange(-1, 40)
            p1 = -1 if rng.random() < 0.5 else p0 + rng.randrange(1, 30)
            ref.seq_rm(s, p0, p1)
            base.seq_rm(s, p0, p1)
        else:
            saved = list(next_pos)
            pos, ids = _ubatch(rng, next_pos, n_seq_max, kv_unified, live)
            ub = RefUBatch(pos, ids)
            ok = ref.find_slot(ub)
            assert base.find_slot(pos, ids) == ok
            if ok:
                placed += 1
                streams, cells = base.slot()
                want = [(s, int(c)) for s, idxs in ref.slot_info() for c in idxs]
                assert list(zip(streams.tolist(), cells.tolist())) == want
                mask = base.kq_mask(pos, ids)
                assert np.array_equal(mask, ref.kq_mask(ub)), "masks differ"
                masks += 1
            else:
                failed += 1
                next_pos[:] = saved
        _same_state(ref, base)
    # the workload exercised the masks and, without a window to reuse cells, a full cache
    assert placed > 20 and masks == placed
    assert failed > 0 or swa_type != "none"


def test_the_2026_baseline_refuses_what_llama_cpp_aborts_on():
    from kvcache_bench import _bench

    base = _bench.Baseline2026(64, 4, 4)
    with pytest.raises(ValueError):
        base.find_slot([0, 1, 0], [[0], [0], [1]])        # groups of unequal size
    with pytest.raises(ValueError):
        base.find_slot([0], [[7]])                          # no such sequence
    assert base.used == (0, 0, 0, 0)
