"""The edge against hostile callers: array arguments whose Python attributes lie, callbacks that
re-enter the cache in the middle of an operation, torch tensors and PEP 688 buffers.

Every array argument is taken through the buffer protocol (or DLPack) once, before the cache is
locked; sizes come from that buffer, never from ``.shape`` / ``.nbytes`` /
``__array_interface__``; a call that re-enters a cache in the middle of one of its operations
raises RuntimeError and changes nothing. Reproducers that crashed the interpreter run in a
subprocess, so that a crash fails the test instead of killing the suite."""
import io
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

import kvcache
from kvcache import _core
from cache_state import snapshot
from conftest import kvcache_env, meddled, needs, wait_for_waiters

try:
    import torch
except ImportError:  # pragma: no cover - depends on the environment
    torch = None

needs_torch = needs("torch", torch is None, "torch is not installed")


_PRELUDE = textwrap.dedent("""
    import numpy as np, kvcache
    from kvcache import UBatch, UnifiedCache

    def lying(a, **claims):
        # a viewed as an ndarray subclass whose properties claim what they are given
        cls = type("Lying", (np.ndarray,), {k: property(lambda self, v=v: v) for k, v in claims.items()})
        return a.view(cls)

    def finalizing(a, call):
        # a viewed as a subclass whose __array_finalize__ (run by reshape / view) calls call()
        # once, after arm() -- the reproducer of the reentrancy crash
        armed = [False]
        class Evil(np.ndarray):
            def __array_finalize__(s, o):
                if armed[0]:
                    armed[0] = False
                    call()
        return a.view(Evil), lambda: armed.__setitem__(0, True)
""")


def run_isolated(code):
    """Run code in a fresh interpreter; returns its stdout (fails on a crash or an error)."""
    prog = _PRELUDE + textwrap.dedent(code)
    r = subprocess.run([sys.executable, "-c", prog], env=kvcache_env(), capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, f"exit {r.returncode}\n{r.stdout}\n{r.stderr[-3000:]}"
    return r.stdout


# --- re-entering the cache from the caller's array ---------------------------------------------------

def test_kq_mask_out_whose_views_call_find_slot():
    out = run_isolated("""
        cache = UnifiedCache(4096, 1, 8, 8)
        big = UBatch(list(range(10, 4010)), [0] * 4000)
        cache.find_slot(UBatch([0], [0])); cache.commit()
        out, arm = finalizing(np.zeros((64, cache.n), np.float32), lambda: cache.find_slot(big))
        arm()
        try:
            got = cache.kq_mask(UBatch([1], [0]), out=out)
        except (RuntimeError, ValueError) as e:
            print("refused", type(e).__name__)
        else:
            assert got is out
            assert np.array_equal(np.asarray(out), cache.kq_mask(UBatch([1], [0])))
            print("ok")
    """)
    assert out.split()[0] in ("ok", "refused")


def test_store_rows_whose_views_call_find_slot():
    out = run_isolated("""
        cache = UnifiedCache(4096, 1, 8, 8, type_k="f32", type_v="f32", v_trans=False)
        big = UBatch(list(range(10, 4010)), [0] * 4000)
        assert cache.find_slot(UBatch([0], [0]))
        k, arm = finalizing(np.ones((1, 8), np.float32), lambda: cache.find_slot(big))
        arm()
        try:
            cache.store(0, k, None)
        except (RuntimeError, ValueError) as e:
            print("refused", type(e).__name__)
        else:
            print("ok")
        # nothing was written past the one placed row
        assert not cache.k(0)[1:].any()
    """)
    assert out.split()[0] in ("ok", "refused")


@pytest.mark.parametrize("semantics", ["2025", "2026"])
@pytest.mark.parametrize("call", ["seq_cells", "slot_indices", "slot_indices_out", "slot_info"])
def test_reads_whose_allocations_run_a_finalizer_that_places(call, semantics):
    """A read sizes its result from the cache, then allocates it: the garbage collector may run
    there, and with it Python code (a finalizer, a gc callback) that places a ubatch. That
    placement is refused; the result is the cells as they were (it used to be written past the
    array it was sized for)."""
    out = run_isolated(f"""
        import gc
        from kvcache import _core
        cache = UnifiedCache(4096, 1, 8, 8, n_seq_max=2, semantics={semantics!r})
        assert cache.find_slot(UBatch([0, 1, 2, 3], [0] * 4))
        big = UBatch(list(range(4, 4000)), [0] * 3996)
        seen = []

        def meddle(phase, info):
            # once, at a collection in the middle of the read
            if phase == "start" and not seen and _core._lock_state(cache)["mine"]:
                try:
                    cache.find_slot(big)
                    seen.append("placed")
                except RuntimeError as e:
                    seen.append(str(e))
        calls = {{"seq_cells": lambda: cache.seq_cells(0)[0], "slot_indices": cache.slot_indices,
                 "slot_indices_out": lambda: cache.slot_indices(np.zeros(8, np.int64))[:4],
                 "slot_info": lambda: cache.slot_info()[0][1]}}
        gc.callbacks.append(meddle)
        gc.set_threshold(1)
        got = calls[{call!r}]()
        gc.set_threshold(700)
        gc.callbacks.remove(meddle)
        print(len(seen), repr(seen[0][:60]) if seen else "")
        assert list(got) == [0, 1, 2, 3], got
        assert cache.seq_pos_max(0) == 3
    """)
    n, msg = out.split(None, 1)
    assert n == "1" and "middle of" in msg, out


@pytest.mark.parametrize("call", ["disable_prefix_reuse", "enable_prefix_reuse"])
def test_checkpoint_memory_whose_finalizer_calls_the_cache(call):
    """The caller's checkpoint memory (and write-back sink) a recurrent cache lets go of are
    released after the operation: their finalizers call the cache as any later call would, not
    in the middle of the operation (a disable_prefix_reuse then ended with reuse on, and a new
    pool was lost)."""
    c = kvcache.RecurrentCache(2, 1, 8, 8, semantics="2026")
    seen = []

    class Memory(bytearray):
        def __del__(self):
            seen.append(_core._lock_state(c)["mine"])
            c.enable_prefix_reuse(2)

    c.enable_prefix_reuse(4, memory=Memory(4 * 4096))
    if call == "disable_prefix_reuse":
        c.disable_prefix_reuse()
    else:
        c.enable_prefix_reuse(8)
    # the finalizer ran once the call was over, and its call then took effect
    assert seen == [False]
    assert c.prefix_stats["cap"] == 2


class _Sink:
    """A write-back sink whose finalizer calls on_del(): it runs where the cache lets go of it."""

    def __init__(self, on_del):
        self.on_del = on_del

    def __call__(self, cache, records):
        pass

    def __del__(self):
        self.on_del()


@pytest.mark.parametrize("kind,call", [("hybrid", "disable_prefix_reuse"), ("hybrid", "enable_prefix_reuse"),
                                       ("iswa", "disable_prefix_reuse")])
def test_prefix_reuse_is_switched_in_both_parts_at_one_moment(kind, call):
    """A composite cache turns prefix reuse on or off in both parts as one operation: the
    finalizer of a write-back sink a part lets go of runs after it, and sees both parts switched
    (it ran between the two and saw one part on, the other off)."""
    if kind == "hybrid":
        c = kvcache.HybridCache(64, 2, [0], 8, 8, 8, 4, n_seq_max=2)
        first, second = c.attn, c.recr
    else:
        c = kvcache.ISWACache(64, 2, 8, 8, swa_layers=[1], n_swa=4, n_seq_max=2, semantics="2026")
        first, second = c.base, c.swa
    seen = []
    if call == "enable_prefix_reuse":
        second.enable_prefix_reuse()     # the recurrent part alone: its new pool lets go of the sink
        second._spill_set(_Sink(lambda: seen.append((first.prefix_reuse, second.prefix_reuse))))
    else:
        c.enable_prefix_reuse()
        first._spill_set(_Sink(lambda: seen.append((first.prefix_reuse, second.prefix_reuse))))
    getattr(c, call)()
    on = call == "enable_prefix_reuse"
    assert seen == [(on, on)]
    assert c.prefix_reuse is on


def test_hybrid_enable_prefix_reuse_refused_by_one_part_changes_neither():
    """An enable_prefix_reuse the attention part refuses (a sequence import into it is in
    progress) leaves both parts as they were: the recurrent part keeps its pool and checkpoints
    (its new pool used to replace them, then reuse was turned off there)."""
    c = kvcache.HybridCache(64, 2, [0], 8, 8, 8, 4, n_seq_max=2)
    c.enable_prefix_reuse()
    assert c.find_slot(kvcache.UBatch(list(range(6)), [0], n_seq_tokens=6))
    assert c.checkpoint(0, list(range(6))) == 6
    before = c.prefix_stats, c.recr.prefix_checkpoints()
    imp = c.attn.seq_import_begin(c.attn.seq_export(0).header, 1)
    with pytest.raises(RuntimeError, match="import"):
        c.enable_prefix_reuse(checkpoints=4)
    imp.abort()
    assert c.prefix_reuse and (c.prefix_stats, c.recr.prefix_checkpoints()) == before


def _iswa_2026():
    c = kvcache.ISWACache(256, 2, 8, 8, swa_layers=[1], n_swa=8, n_seq_max=2, swa_full=True, semantics="2026")
    assert c.find_slot(kvcache.UBatch(list(range(20)), [0] * 20))
    return c


def test_iswa_update_is_of_one_moment():
    """An iSWA update (semantics '2026') updates both caches as one operation: a shift from a
    finalizer the garbage collector runs in the middle of it (here at each collection in turn) is
    refused, or comes before or after it in both caches (it came between the two, applied in one
    cache and left pending in the other)."""
    for n in range(1, 40):
        c = _iswa_2026()
        c.seq_add(0, 0, -1, 5)
        meddled(c.update, n, lambda: c.seq_add(0, 0, -1, 3))
        assert c.base.has_shift == c.swa.has_shift, n
        assert c.base.seq_pos_max(0) == c.swa.seq_pos_max(0), n


def _slot_infos(got):
    return None if got is None else [[[(s, list(cells)) for s, cells in ub] for ub in part] for part in got]


def test_iswa_prepare_is_of_one_moment():
    """An iSWA prepare (semantics '2026') is the dry run of both caches at one moment: a
    placement from a finalizer the garbage collector runs in the middle of it (here at each
    collection in turn) is refused, or comes before or after it for both caches (it came
    between the two, and the SWA cache's slot_infos were of another state than the base
    cache's)."""
    ubs = [kvcache.UBatch(list(range(20, 24)), [1] * 4)]
    for n in range(1, 40):
        c = _iswa_2026()
        before = _slot_infos(c.prepare(ubs))
        got = _slot_infos(meddled(lambda: c.prepare(ubs), n,
                                  lambda: c.find_slot(kvcache.UBatch(list(range(30, 36)), [0] * 6))))
        assert got in (before, _slot_infos(c.prepare(ubs))), n


_PROMPT = list(range(1, 7))


def _iswa_held(**kw):
    """An iSWA pair (semantics '2026') whose caches both hold _PROMPT in their indexes."""
    c = kvcache.ISWACache(64, 2, 4, 4, swa_layers=[1], n_swa=4, n_seq_max=2, swa_full=True, semantics="2026", **kw)
    c.enable_prefix_reuse()
    assert c.find_slot(kvcache.UBatch(list(range(6)), [0] * 6, tokens=_PROMPT))
    c.prefix_release(0)
    return c


def _hybrid_held(**kw):
    """A hybrid memory holding _PROMPT in both parts (the attention cells and its checkpoint)."""
    c = kvcache.HybridCache(64, 2, [1], 4, 4, 4, 4, n_seq_max=2, **kw)
    c.enable_prefix_reuse()
    assert c.find_slot(kvcache.UBatch(list(range(6)), [0], n_seq_tokens=6, tokens=_PROMPT))
    c.prefix_release(0, _PROMPT)
    return c


def _pinned_or_none(call):
    try:
        return call()
    except ValueError:
        return None     # refused: the prefix was evicted before it


@pytest.mark.parametrize("kind", ["iswa", "hybrid"])
def test_composite_prefix_pin_is_of_one_moment(kind):
    """A composite cache pins in both parts as one operation: an eviction from a finalizer the
    garbage collector runs in the middle of it (here at each collection in turn) is refused, or
    comes before it (nothing pinned, both parts evicted) or after it (both pinned, nothing
    evicted). It came between the two: the part pinned first kept the prefix, the other lost it,
    and the pin was refused."""
    for n in range(1, 40):
        if kind == "iswa":     # the positions of a cell_ext request: its arrays are made in each part's pin
            c = _iswa_held(cell_ext=True)
            pin = _pinned_or_none(lambda: meddled(lambda: c.prefix_pin(_PROMPT, pos=list(range(6)), pos_x=[0] * 6,
                                                                       pos_y=[0] * 6), n, lambda: c.prefix_evict(100)))
            held = [c.base.prefix_stats["cells"], c.swa.prefix_stats["cells"]]
        else:
            c = _hybrid_held(n_swa=4, swa_full=True)
            pin = _pinned_or_none(lambda: meddled(lambda: c.prefix_pin(_PROMPT), n, lambda: c.prefix_evict(100, 100)))
            held = [c.attn.base.prefix_stats["cells"], c.attn.swa.prefix_stats["cells"],
                    6 * c.recr.prefix_stats["checkpoints"]]
        assert held == [0 if pin is None else 6] * len(held), (n, held)


class _Seeing:
    """A write-back sink that records what see() answers when it is called."""

    def __init__(self, see):
        self.see, self.seen = see, []

    def __call__(self, cache, records):
        self.seen.append(self.see())


@pytest.mark.parametrize("kind", ["iswa", "hybrid", "hybrid_iswa"])
def test_composite_prefix_evict_is_one_operation(kind):
    """A composite cache evicts in both parts as one operation: the write-back sink of the part
    that evicts first is called once both have evicted (it was called between the two, and saw
    the other part still holding the prefix)."""
    if kind == "iswa":
        c = _iswa_held()
        first, held = c.base, lambda: (c.base.prefix_stats["cells"], c.swa.prefix_stats["cells"])
        evict = lambda: c.prefix_evict(100)
    else:
        c = _hybrid_held(**({"n_swa": 4, "swa_full": True} if kind == "hybrid_iswa" else {}))
        first = c.attn.base if kind == "hybrid_iswa" else c.attn
        held = lambda: (first.prefix_stats["cells"], c.recr.prefix_stats["checkpoints"])
        evict = lambda: c.prefix_evict(100, 100)
    sink = _Seeing(held)
    first._spill_set(sink)
    evict()
    assert sink.seen == [(0, 0)]


# --- attributes that lie about the memory -----------------------------------------------------------

def test_kq_mask_out_with_a_lying_shape_is_refused():
    out = run_isolated("""
        cache = UnifiedCache(4096, 1, 8, 8)
        cache.set_full()
        out = lying(np.zeros((64, 32), np.float32), shape=(64, 4096))
        try:
            cache.kq_mask(UBatch([1], [0]), out=out)
        except ValueError as e:
            print("refused", e)
    """)
    assert out.startswith("refused")


def test_store_rows_with_a_lying_shape_are_refused():
    out = run_isolated("""
        cache = UnifiedCache(4096, 1, 8, 8, type_k="f32", type_v="f32", v_trans=False)
        assert cache.find_slot(UBatch(list(range(4000)), [0] * 4000))
        rows = lying(np.ones((1, 8), np.float32), shape=(4000, 8))
        try:
            cache.store(0, rows, rows)
        except ValueError as e:
            print("refused", e)
    """)
    assert out.startswith("refused")


def test_rope_shift_with_a_lying_array_interface_is_refused():
    out = run_isolated("""
        k = lying(np.zeros((4, 16), np.float32), shape=(1 << 20, 16),
                  __array_interface__={"data": (8, False), "shape": (1 << 20, 16), "typestr": "<f4", "version": 3})
        try:
            # a shift for every row the lie claims
            kvcache.rope_shift(k, "f32", 1, 16, np.ones(1 << 20, np.int32), kvcache.RopeParams(16))
        except ValueError as e:
            print("refused", e)
        else:
            print("ok")
    """)
    assert out.split()[0] in ("ok", "refused")


def test_rope_shift_uses_the_real_memory():
    k = np.random.default_rng(0).standard_normal((4, 16)).astype(np.float32)
    want = k.copy()
    p = kvcache.RopeParams(16)
    kvcache.rope_shift(want, "f32", 1, 16, np.arange(4, dtype=np.int32), p)

    class Lying(np.ndarray):
        @property
        def __array_interface__(self):
            return {"data": (8, False), "shape": (4, 16), "typestr": "<f4", "version": 3}

    got = k.copy().view(Lying)
    kvcache.rope_shift(got, "f32", 1, 16, np.arange(4, dtype=np.int32), p)
    assert np.array_equal(np.asarray(got), want)


def test_borrowed_buffer_with_lying_nbytes_is_refused():
    out = run_isolated("""
        class Lying(np.ndarray):
            nbytes = property(lambda self: 4096 * 8 * 2)      # what the layer needs
            shape = property(lambda self: (4096 * 8,))
            def reshape(self, *shape, **kw):
                return self
        v = np.zeros(4096 * 8, np.float16)
        small = np.zeros(64, np.float16).view(Lying)           # 128 bytes
        try:
            c = UnifiedCache(4096, 1, 8, 8, buffers={0: (small, v)})
        except ValueError as e:
            print("refused", e)
        else:
            c.clear()                                          # zeroes what it was given
            print("accepted")
    """)
    assert out.startswith("refused") and "holds 128 bytes" in out

def test_objects_that_only_claim_memory_are_not_arrays():
    """An object with a forged __array_interface__ (no buffer of its own) is refused where the
    cache reads or writes memory."""
    class Claims:
        __array_interface__ = {"data": (8, False), "shape": (1 << 20,), "typestr": "|u1", "version": 3}

    cache = kvcache.UnifiedCache(64, 1, 8, 8)
    assert cache.find_slot(kvcache.UBatch([0], [0]))
    with pytest.raises(TypeError):
        cache.kq_mask(kvcache.UBatch([1], [0]), out=Claims())
    with pytest.raises(TypeError):
        cache.store(0, Claims(), None)
    with pytest.raises(TypeError):
        cache.state_read(Claims())
    with pytest.raises(TypeError):
        cache.state_write_into(Claims())
    with pytest.raises(TypeError):
        kvcache.rope_shift(Claims(), "f16", 1, 8, [0], kvcache.RopeParams(8))
    with pytest.raises(TypeError):
        kvcache.UnifiedCache(64, 1, 8, 8, buffers={0: (Claims(), Claims())})
    with pytest.raises(TypeError):
        kvcache.UBatch(Claims(), [0])


# --- an iSWA cache's arguments, read once before both caches are held ------------------------------

class _Reads(np.int64):
    """An integer whose every read (__index__) calls on_read(k), k counting the reads, and gives
    what it returns."""

    def __new__(cls, on_read):
        self = super().__new__(cls, 0)
        self.on_read, self.reads = on_read, 0
        return self

    def __index__(self):
        self.reads += 1
        return self.on_read(self.reads)


class _FloatReads(float):
    def __new__(cls, on_read):
        self = super().__new__(cls, 0.0)
        self.on_read, self.reads = on_read, 0
        return self

    def __float__(self):
        self.reads += 1
        return self.on_read(self.reads)


def test_iswa_n_threads_is_read_once_for_both_caches():
    c = kvcache.ISWACache(256, 2, 8, 8, swa_layers=[1], n_swa=8)
    c.n_threads = _Reads(lambda k: 2 if k == 1 else 100)     # 100 is refused
    assert (c.base.n_threads, c.swa.n_threads) == (2, 2)


def test_iswa_defrag_sched_is_read_once_for_both_caches():
    c = kvcache.ISWACache(4096, 2, 8, 8, swa_layers=[1], n_swa=8, swa_full=True)
    assert c.find_slot(kvcache.UBatch(list(range(3000)), [0] * 3000))
    c.commit()
    c.seq_rm(0, 0, 2000)               # fragmentation 0.73 in both caches
    c.defrag_sched(_FloatReads(lambda k: 0.1 if k == 1 else 0.9))
    assert c.base.do_defrag and c.swa.do_defrag


def test_iswa_update_refuses_a_shift_an_argument_made():
    """An iSWA cache whose SWA cache is smaller cannot shift: update() refuses a pending shift,
    also one that the code of its own n_max_nodes argument made."""
    c = kvcache.ISWACache(1024, 2, 8, 8, swa_layers=[1], n_swa=8, n_batch=32)
    assert not c.can_shift
    assert c.find_slot(kvcache.UBatch(list(range(20)), [0] * 20))
    c.commit()

    def shift(k):
        c.seq_add(0, 0, 100, 3)
        return 100
    with pytest.raises(RuntimeError, match="cannot shift"):
        c.update(None, _Reads(shift))
    assert c.base.has_shift and c.swa.has_shift        # nothing was shifted


class _DLPackOut:
    """An out buffer known by its __dlpack__ only, whose export calls meddle() (its error kept)."""

    def __init__(self, a, meddle):
        self.a, self.meddle, self.errors = a, meddle, []

    def __dlpack_device__(self):
        try:
            self.meddle()
        except RuntimeError as e:
            self.errors.append(e)
        return (1, 0)

    def __dlpack__(self, **kwargs):
        return self.a.__dlpack__(**kwargs)


@pytest.mark.parametrize("semantics", ["2025", "2026"])
def test_iswa_slot_indices_into_buffers_that_change_the_cache(semantics):
    c = kvcache.ISWACache(256, 2, 8, 8, swa_layers=[1], n_swa=8, n_seq_max=2, semantics=semantics)
    assert c.find_slot(kvcache.UBatch(list(range(6)), [0, 1] * 3))
    want = c.slot_indices()
    before = snapshot(c.base), snapshot(c.swa)
    outs = [_DLPackOut(np.full(6, -1, np.int32), lambda: c.seq_rm(-1)) for _ in range(2)]
    got = c.slot_indices(tuple(outs))
    # the change from inside the call is refused: the indices are those of one moment
    assert [len(o.errors) for o in outs] == [1, 1]
    assert all("middle of" in str(o.errors[0]) for o in outs)
    assert (snapshot(c.base), snapshot(c.swa)) == before
    for g, w, o in zip(got, want, outs):
        assert g is o and np.array_equal(o.a, w)


# --- state_write_into while the file changes the cache ----------------------------------------------

class _MeddlingFile(io.RawIOBase):
    """A file whose write() changes the cache it is being written from."""

    def __init__(self, meddle, swallow=False):
        self.meddle, self.swallow = meddle, swallow
        self.data = bytearray()
        self.errors = []

    def writable(self):
        return True

    def write(self, b):
        try:
            self.meddle()
        except RuntimeError as e:
            self.errors.append(e)
            if not self.swallow:
                raise
        self.data += bytes(b)
        return len(b)


def _busy_unified():
    c = kvcache.UnifiedCache(256, 2, 8, 8, n_seq_max=4)
    assert c.find_slot(kvcache.UBatch(list(range(40)), [i % 3 for i in range(40)]))
    c.commit()
    return c


@pytest.mark.parametrize("meddle", ["seq_rm", "find_slot", "clear", "state_read", "store"])
def test_state_write_into_a_file_that_changes_the_cache(meddle):
    c = _busy_unified()
    before, blob = snapshot(c), c.state_write()
    calls = {"seq_rm": lambda: c.seq_rm(0),
             "find_slot": lambda: c.find_slot(kvcache.UBatch([100], [1])),
             "clear": c.clear,
             "state_read": lambda: c.state_read(blob),
             "store": lambda: c.store(0, None, None)}
    f = _MeddlingFile(calls[meddle])
    with pytest.raises(RuntimeError, match="middle of"):
        c.state_write_into(f)
    assert snapshot(c) == before
    # a file that swallows the refusal gets the state as it was
    f = _MeddlingFile(calls[meddle], swallow=True)
    assert c.state_write_into(f) == len(blob)
    assert bytes(f.data) == blob and f.errors
    assert snapshot(c) == before


def test_iswa_state_write_into_a_file_that_changes_either_part():
    c = kvcache.ISWACache(256, 2, 8, 8, swa_layers=[1], n_swa=8, n_seq_max=2)
    assert c.find_slot(kvcache.UBatch(list(range(20)), [0] * 20))
    c.commit()
    blob = c.state_write()
    for part in (c.base, c.swa):
        f = _MeddlingFile(lambda: part.seq_rm(0), swallow=True)
        assert c.state_write_into(f) == len(blob)
        assert bytes(f.data) == blob and f.errors


def test_recurrent_state_write_into_a_file_that_changes_the_cache():
    c = kvcache.RecurrentCache(2, 1, 8, 8)
    assert c.find_slot(kvcache.UBatch([0, 1], [0], n_seq_tokens=2))
    blob = c.state_write()
    f = _MeddlingFile(lambda: c.seq_rm(0), swallow=True)
    assert c.state_write_into(f) == len(blob)
    assert bytes(f.data) == blob and f.errors
    assert c.seq_pos_max(0) == 1


def test_reads_from_inside_an_operation_are_allowed():
    c = _busy_unified()
    seen = []
    f = _MeddlingFile(lambda: seen.append((c.used, c.seq_pos_max(0), c.cells().nonempty()[:1])))
    c.state_write_into(f)
    assert seen and seen[0][0] == 40


# --- the lock's owner -------------------------------------------------------------------------------

def test_hold_exit_from_another_thread_is_refused():
    c = kvcache.UnifiedCache(64, 1, 8, 8)
    h = _core._Hold(c)
    h.__enter__()
    errors = []
    t = threading.Thread(target=lambda: errors.append(pytest.raises(RuntimeError, h.__exit__, None, None, None)))
    t.start()
    t.join(60)
    assert errors
    # still held by this thread: another thread waits for it
    got = []
    t = threading.Thread(target=lambda: got.append(c.used))
    t.start()
    wait_for_waiters(c, 1)
    assert not got
    h.__exit__(None, None, None)
    t.join(60)
    assert got == [0]


def test_hold_exit_without_enter_is_refused():
    c = kvcache.UnifiedCache(64, 1, 8, 8)
    with pytest.raises(RuntimeError):
        _core._Hold(c).__exit__(None, None, None)
    h = _core._Hold(c)
    with h:
        with pytest.raises(RuntimeError):
            _core._Hold(c).__exit__(None, None, None)
    with pytest.raises(RuntimeError):
        h.__exit__(None, None, None)


# --- torch tensors and PEP 688 buffers ---------------------------------------------------------------

@needs_torch
@pytest.mark.parametrize("tk,tdt", [("f32", "float32"), ("f16", "float16"), ("bf16", "bfloat16")])
def test_store_and_mask_take_cpu_tensors_without_a_copy(tk, tdt):
    tdt = getattr(torch, tdt)
    c = kvcache.UnifiedCache(64, 1, 8, 8, type_k=tk, type_v=tk, v_trans=False)
    ref = kvcache.UnifiedCache(64, 1, 8, 8, type_k=tk, type_v=tk, v_trans=False)
    ub = kvcache.UBatch(torch.arange(3), [0, 0, 0])
    assert c.find_slot(ub) and ref.find_slot(ub)
    k = torch.randn(3, 8).to(tdt)
    c.store(0, k, k)
    ref.store(0, k.float().numpy(), k.float().numpy())
    assert np.array_equal(np.asarray(c.k(0)).view(np.uint8), np.asarray(ref.k(0)).view(np.uint8))
    out = torch.empty(64, c.n)
    got = c.kq_mask(ub, out=out)
    assert got is out
    assert np.array_equal(out.numpy(), c.kq_mask(ub))


@needs_torch
def test_rope_shift_state_and_ubatch_take_tensors():
    k = torch.randn(4, 16)
    want = k.numpy().copy()
    p = kvcache.RopeParams(16)
    kvcache.rope_shift(want, "f32", 1, 16, np.arange(4), p)
    kvcache.rope_shift(k, "f32", 1, 16, torch.arange(4, dtype=torch.int32), p)   # in place, no copy
    assert np.array_equal(k.numpy(), want)
    c = _busy_unified()
    blob = c.state_write()
    buf = torch.zeros(len(blob), dtype=torch.uint8)
    assert c.state_write_into(buf) == len(blob)
    assert bytes(buf.numpy()) == blob
    assert c.state_read(buf) == len(blob)
    b = kvcache.Batch(torch.arange(3), [0, 0, 0], output=torch.tensor([False, False, True]))
    assert b.n_tokens == 3


@needs_torch
def test_tensors_that_cannot_be_used_are_refused_clearly():
    c = kvcache.UnifiedCache(64, 1, 8, 8, type_k="f32", type_v="f32", v_trans=False)
    assert c.find_slot(kvcache.UBatch([0, 1], [0, 0]))
    with pytest.raises(TypeError, match="dtype"):
        c.store(0, torch.zeros(2, 8, dtype=torch.float64), None)
    with pytest.raises(ValueError, match="C-contiguous"):
        c.store(0, torch.zeros(8, 2).t(), None)
    with pytest.raises(BufferError, match="gradient"):
        c.store(0, torch.zeros(2, 8, requires_grad=True), None)
    with pytest.raises(ValueError, match="shape"):
        c.kq_mask(kvcache.UBatch([1], [0]), out=torch.empty(63, c.n))   # fewer rows than the mask has


@needs_torch
def test_a_tensor_is_read_through_torch_never_through_what_it_claims():
    """An exact torch.Tensor is read through torch's own Tensor.numpy (an attribute set on the
    instance is not consulted); a subclass goes the DLPack route (its numpy is never called);
    both are the tensor's own memory, a view's offset included."""
    c = kvcache.UnifiedCache(64, 1, 8, 8, type_k="f32", type_v="f32", v_trans=False)
    assert c.find_slot(kvcache.UBatch([0, 1], [0, 0]))
    big = torch.arange(48, dtype=torch.float32).reshape(6, 8)
    rows = big[2:4]                                       # storage offset 16
    rows.numpy = lambda: np.full((2, 8), -1, np.float32)  # not torch's: never called
    c.store(0, rows, rows)
    assert np.array_equal(c.k(0)[c.slot[0]:c.slot[0] + 2], big[2:4].numpy())

    class Claims(torch.Tensor):
        def numpy(self, *a, **k):
            raise AssertionError("a subclass's numpy must not be called")

    other = big[4:6].as_subclass(Claims)
    c.store(0, other, other)
    assert np.array_equal(c.v(0)[c.slot[0]:c.slot[0] + 2], big[4:6].numpy())
    out = torch.empty(64, c.n)
    out.numpy = lambda: np.empty((64, c.n), np.float32)   # the mask lands in the tensor all the same
    assert c.kq_mask(kvcache.UBatch([2], [0]), out=out) is out
    assert np.array_equal(torch.Tensor.numpy(out), c.kq_mask(kvcache.UBatch([2], [0])))


@needs_torch
def test_tensors_whose_memory_is_not_their_values_are_refused():
    """A tensor with the negative bit set holds its values negated (DLPack would export that
    memory as it is): TypeError, for a subclass too, and nothing is stored; a tensor whose
    __dlpack__ fails inside torch (a nested tensor) is a TypeError naming the argument."""
    import warnings

    c = kvcache.UnifiedCache(64, 1, 8, 8, type_k="f32", type_v="f32", v_trans=False)
    assert c.find_slot(kvcache.UBatch([0, 1], [0, 0]))
    before = np.array(c.k(0))
    neg = (torch.arange(16, dtype=torch.float32).reshape(2, 8) + 1)._neg_view()

    class Sub(torch.Tensor):
        pass

    for t in (neg, neg.as_subclass(Sub)):
        with pytest.raises(TypeError, match="negative bit"):
            c.store(0, t, t)
    assert np.array_equal(c.k(0), before)
    c.store(0, neg.resolve_neg(), neg.resolve_neg())
    assert np.array_equal(c.k(0)[c.slot[0]:c.slot[0] + 2], -(np.arange(16, dtype=np.float32).reshape(2, 8) + 1))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        nested = torch.nested.nested_tensor([torch.zeros(8), torch.zeros(8)])
    with pytest.raises(TypeError, match="k_rows"):
        c.store(0, nested, nested)


class _DeviceTensor:
    """Claims to live on a CUDA device (DLPack device type 2)."""

    def __dlpack__(self, **kw):
        raise AssertionError("a device tensor's memory must not be taken")

    def __dlpack_device__(self):
        return (2, 0)


def test_device_tensors_are_a_type_error_everywhere():
    c = kvcache.UnifiedCache(64, 1, 8, 8)
    assert c.find_slot(kvcache.UBatch([0], [0]))
    for call in (lambda: c.store(0, _DeviceTensor(), None),
                 lambda: c.kq_mask(kvcache.UBatch([1], [0]), out=_DeviceTensor()),
                 lambda: c.state_read(_DeviceTensor()),
                 lambda: c.state_write_into(_DeviceTensor()),
                 lambda: kvcache.rope_shift(_DeviceTensor(), "f16", 1, 8, [0], kvcache.RopeParams(8)),
                 lambda: kvcache.UBatch(_DeviceTensor(), [0]),
                 lambda: kvcache.UnifiedCache(64, 1, 8, 8, buffers={0: (_DeviceTensor(), _DeviceTensor())})):
        with pytest.raises(TypeError, match="not the CPU"):
            call()


@pytest.mark.skipif(sys.version_info < (3, 12), reason="PEP 688 (__buffer__) needs Python 3.12")
def test_pep688_buffer_objects():
    class Rows:
        def __init__(self, a):
            self.a = a

        def __buffer__(self, flags):
            return memoryview(self.a)

    c = kvcache.UnifiedCache(64, 1, 8, 8, type_k="f32", type_v="f32", v_trans=False)
    assert c.find_slot(kvcache.UBatch([0, 1], [0, 0]))
    k = np.arange(16, dtype=np.float32).reshape(2, 8)
    c.store(0, Rows(k), Rows(k))
    assert np.array_equal(c.k(0)[:2], k)
    out = np.zeros((64, c.n), np.float32)
    c.kq_mask(kvcache.UBatch([2], [0]), out=Rows(out))
    assert np.array_equal(out, c.kq_mask(kvcache.UBatch([2], [0])))

    class Reentering:
        def __buffer__(self, flags):
            c.find_slot(kvcache.UBatch(list(range(10, 50)), [0] * 40))   # before the mask is taken
            return memoryview(np.zeros((64, 32), np.float32))

    with pytest.raises(ValueError, match="shape"):
        c.kq_mask(kvcache.UBatch([2], [0]), out=Reentering())


@needs_torch
def test_bfloat16_tensors_hold_floats_never_integers():
    """A bfloat16 tensor holds floats, with or without ml_dtypes (without it its memory comes as
    uint16 bit patterns): every argument of integers refuses it, as it refuses float32, and the
    cache is left as it was; an argument of numbers takes its values; a bf16 K array is bf16."""
    def bf(v):
        return torch.tensor(v, dtype=torch.bfloat16)

    c = kvcache.UnifiedCache(64, 1, 8, 8, n_seq_max=2, semantics="2026")
    c.enable_prefix_reuse()
    assert c.find_slot(kvcache.UBatch([0, 1], [0, 0], tokens=[5, 6]))
    before = snapshot(c)
    k = np.zeros((2, 8), np.float32)
    for name, call in (
            ("pos", lambda: kvcache.UBatch(bf([0, 1, 2, 3]), [0] * 4)),
            ("seq_id", lambda: kvcache.UBatch([2, 3], bf([1, 1]))),
            ("seq_id", lambda: kvcache.UBatch([2, 3], [bf([1]), bf([1])])),
            ("tokens", lambda: kvcache.UBatch([2, 3], [0, 0], tokens=bf([7, 8]))),
            ("pos_x", lambda: kvcache.UBatch([2, 3], [0, 0], pos_x=bf([1, 1]), pos_y=[0, 0])),
            ("pos", lambda: kvcache.Batch(bf([2, 3]), [0, 0])),
            ("output", lambda: kvcache.Batch([2, 3], [0, 0], output=bf([0, 1]))),
            ("tokens", lambda: c.prefix_match(bf([5, 6]))),
            ("tokens", lambda: c.prefix_attach(1, bf([5, 6]))),
            ("shift", lambda: kvcache.rope_shift(k, "f32", 1, 8, bf([1, 1]), kvcache.RopeParams(8))),
            ("k", lambda: kvcache.rope_shift(bf(k.tolist()), "f16", 1, 8, [1, 1], kvcache.RopeParams(8)))):
        with pytest.raises(TypeError, match=rf"{name}.*bfloat16"):
            call()
    assert snapshot(c) == before
    # numbers: the values, not the bit patterns
    x = torch.randn(2, 32).to(torch.bfloat16)
    assert np.array_equal(kvcache.quantize(x, "q8_0"), kvcache.quantize(x.float().numpy(), "q8_0"))
    assert kvcache.RopeParams(8, freq_factors=bf([1.0, 2.0, 4.0, 8.0])).freq_factors.tolist() == [1, 2, 4, 8]
    r = kvcache.RecurrentCache(2, 1, 8, 8)
    assert r.find_slot(kvcache.UBatch([0], [0]))
    r.store(0, bf([[1.5] * 8]), bf([[-2.0] * 8]))
    assert r.k(0)[r.head].tolist() == [1.5] * 8 and r.v(0)[r.head].tolist() == [-2.0] * 8
    # a bf16 K array is rotated as bf16, in place
    kb = torch.randn(2, 8).to(torch.bfloat16)
    bits = kb.view(torch.int16).numpy().view(np.uint16).copy()
    kvcache.rope_shift(bits, "bf16", 1, 8, [3, 1], kvcache.RopeParams(8))
    kvcache.rope_shift(kb, "bf16", 1, 8, [3, 1], kvcache.RopeParams(8))
    assert np.array_equal(kb.view(torch.int16).numpy().view(np.uint16), bits)


@needs_torch
def test_recurrent_store_quantize_and_rope_factors_take_tensors():
    c = kvcache.RecurrentCache(2, 1, 8, 8)
    assert c.find_slot(kvcache.UBatch([0, 1], [0], n_seq_tokens=2))
    c.store(0, torch.ones(1, 8), torch.full((1, 8), 2.0))
    assert c.k(0)[c.head].tolist() == [1.0] * 8 and c.v(0)[c.head].tolist() == [2.0] * 8
    x = torch.randn(2, 32)
    q = kvcache.quantize(x, "q8_0")
    assert np.array_equal(q, kvcache.quantize(x.numpy(), "q8_0"))
    assert np.array_equal(kvcache.dequantize(torch.from_numpy(q), "q8_0", 32), kvcache.dequantize(q, "q8_0", 32))
    p = kvcache.RopeParams(8, freq_factors=torch.tensor([1.0, 2.0, 4.0, 8.0]))
    assert p.freq_factors.tolist() == [1.0, 2.0, 4.0, 8.0]


def test_float_rows_into_a_bf16_cache_without_ml_dtypes_are_rounded_not_truncated():
    """Without ml_dtypes a bf16 cache's rows are uint16 bits: float32 rows are rounded to bf16
    (as the unified cache's store does), never cast to integers (a recurrent cache stored 1 for
    1.5). Run in a process where ml_dtypes cannot be imported."""
    code = textwrap.dedent("""
        import sys
        sys.modules["ml_dtypes"] = None
        import numpy as np, kvcache
        r = kvcache.RecurrentCache(2, 1, 8, 8, type_k="bf16", type_v="bf16")
        assert r.k(0).dtype == np.uint16
        assert r.find_slot(kvcache.UBatch([0], [0]))
        r.store(0, np.full((1, 8), 1.5, np.float32), np.full((1, 8), -2.0, np.float16))
        assert r.k(0)[0].tolist() == [0x3FC0] * 8 and r.v(0)[0].tolist() == [0xC000] * 8, (r.k(0)[0], r.v(0)[0])
        r.store(0, np.full((1, 8), 0x4000, np.uint16))          # bits as they are
        assert r.k(0)[0].tolist() == [0x4000] * 8
        u = kvcache.UnifiedCache(32, 1, 8, 8, type_k="bf16", type_v="bf16")
        assert u.find_slot(kvcache.UBatch([0], [0]))
        u.store(0, np.full((1, 8), 1.5, np.float32), np.full((1, 8), 1.5, np.float32))
        assert u.k(0)[0].tolist() == [0x3FC0] * 8
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr
