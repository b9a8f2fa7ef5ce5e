"""The prefix store (kvcache.store): chunk names, the host and disk tiers, the chunk files'
checks, and saving / loading sequences of a UnifiedCache (transactionally, exact rows)."""
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import kvcache
from kvcache import StateError
from kvcache._core import ChunkSum
from conftest import needs_bench
from kvcache.store import META_NAME, USAGE_NAME, PrefixStore, StoreError, StoreGeometry, open_store

# where the kvcache under test was imported from (the tree's src/ or an installed wheel): the
# child processes below import the same one
_KVCACHE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(kvcache.__file__)))

C = 8  # tokens per chunk in these tests


def make_cache(v_trans=False, n_layer=3, k=16, v=24, size=256, semantics="2026", n_seq_max=4, type_k="f16"):
    return kvcache.UnifiedCache(size, n_layer, k, v, type_k=type_k, type_v="f16", v_trans=v_trans,
                                n_seq_max=n_seq_max, n_pad=1, semantics=semantics)


def fill(cache, seq_id, tokens, p0=0, seed=0):
    """Place tokens at positions p0.. of seq_id and store K/V rows that name (seed, position)."""
    n = len(tokens)
    ub = kvcache.UBatch(list(range(p0, p0 + n)), [seq_id] * n, tokens=list(tokens))
    assert cache.find_slot(ub)
    for il in cache.layers:
        kw = cache.k(il).shape[-1]
        rows_k = np.array([[seed * 1000 + p + il * 0.25 + j * 1e-3 for j in range(kw)] for p in range(p0, p0 + n)])
        vw = cache.v(il).shape[-2] if cache.v_trans else cache.v(il).shape[-1]
        rows_v = -np.array([[seed * 1000 + p + il * 0.25 + j * 1e-3 for j in range(vw)] for p in range(p0, p0 + n)])
        cache.store(il, rows_k.astype(np.float32), rows_v.astype(np.float32))
    if hasattr(cache, "commit"):
        cache.commit()


def seq_rows(cache, seq_id):
    """Per layer the (K rows, V rows) of seq_id in position order."""
    cells, pos = cache.seq_cells(seq_id)
    order = np.argsort(pos)
    cells = cells[order]
    out = []
    for il in cache.layers:
        k = cache.k(il)[cells]
        v = cache.v(il)[0][:, cells].T if cache.v_trans else cache.v(il)[cells]
        out.append((np.array(k), np.array(v)))
    return pos[order], out


def tokens(n, start=1):
    return list(range(start, start + n))


def store_dir(tmp_path):
    """A small store directory holding one prompt of two chunks (for the command-line tests)."""
    c = kvcache.UnifiedCache(64, 1, 8, 8, v_trans=False, semantics="2026")
    assert c.find_slot(kvcache.UBatch(list(range(8)), [0] * 8))
    with PrefixStore(c, tmp_path / "store", chunk_tokens=4) as st:
        st.save(c, 0, list(range(8)))
    return tmp_path / "store"


# --- names and the host tier ---------------------------------------------------------------------

def test_chunk_names_chain_and_namespaces():
    cache = make_cache()
    s = PrefixStore(cache, chunk_tokens=C)
    a = s.keys(tokens(3 * C + 5))
    assert len(a) == 3 and len(set(a)) == 3
    assert s.keys(tokens(2 * C)) == a[:2]                       # a prefix's names are the prompt's
    b = s.keys([99] + tokens(3 * C + 4, 2))                      # one token changed: every name after it
    assert not set(a) & set(b)
    assert s.keys(tokens(3 * C), salt="tenant") != a             # salts separate
    assert s.keys(tokens(3 * C), salt=b"tenant") != s.keys(tokens(3 * C), salt="tenant")
    other = PrefixStore(make_cache(k=32), chunk_tokens=C)        # another geometry: other names
    assert other.keys(tokens(3 * C)) != a
    assert PrefixStore(cache, chunk_tokens=2 * C).keys(tokens(4 * C))[0] not in a


def test_save_and_load_exact_rows_both_v_layouts():
    for v_trans in (False, True):
        src = make_cache(v_trans=v_trans)
        toks = tokens(5 * C + 3)
        fill(src, 1, toks)
        s = PrefixStore(src, chunk_tokens=C)
        assert s.save(src, 1, toks) == 5 * C
        assert s.match(toks) == 5 * C and s.match(toks[:C - 1]) == 0
        for dst_trans in (False, True):                      # chunks are independent of the V layout
            dst = make_cache(v_trans=dst_trans)
            fill(dst, 0, tokens(7, 500), seed=9)                 # another sequence, untouched
            before = dst.state_write(0)
            assert s.load(dst, 2, toks) == 5 * C
            pos, rows = seq_rows(dst, 2)
            assert list(pos) == list(range(5 * C))
            _, want = seq_rows(src, 1)
            for (k, v), (wk, wv) in zip(rows, want):
                assert np.array_equal(k, wk[:5 * C]) and np.array_equal(v, wv[:5 * C])
            assert dst.state_write(0) == before
            assert s.load(dst, 3, toks, max_tokens=2 * C + 7) == 2 * C
        assert s.stats["host_hits"] == 5 + 2 + 5 + 2


def test_put_takes_rows_from_anywhere():
    src = make_cache()
    toks = tokens(2 * C + 1)
    fill(src, 0, toks)
    _, rows = seq_rows(src, 0)
    s = PrefixStore(src, chunk_tokens=C)
    assert s.put(toks, [k for k, _ in rows], [v for _, v in rows]) == 2 * C
    dst = make_cache(v_trans=True)
    assert s.load(dst, 0, toks) == 2 * C
    assert all(np.array_equal(a[0], b[0][:2 * C]) and np.array_equal(a[1], b[1][:2 * C])
               for a, b in zip(seq_rows(dst, 0)[1], rows))
    with pytest.raises(ValueError, match="k_rows and v_rows"):
        s.put(toks, [k for k, _ in rows][:1], [v for _, v in rows])
    with pytest.raises(ValueError, match=r"k_rows\[0\] holds"):
        s.put(toks, [rows[0][0][:3]] + [k for k, _ in rows][1:], [v for _, v in rows])


def test_save_takes_the_leading_positions_in_any_cell_order():
    src = make_cache()
    fill(src, 0, tokens(20, 700), seed=3)
    src.seq_rm(0, 5, 12)                                          # a hole: later cells come first
    toks = tokens(3 * C)
    fill(src, 1, toks[:C])
    fill(src, 1, toks[C:], p0=C)
    s = PrefixStore(src, chunk_tokens=C)
    assert s.save(src, 1, toks) == 3 * C
    dst = make_cache()
    assert s.load(dst, 0, toks) == 3 * C
    _, a = seq_rows(dst, 0)
    _, b = seq_rows(src, 1)
    assert all(np.array_equal(x[0], y[0]) and np.array_equal(x[1], y[1]) for x, y in zip(a, b))
    # a sequence whose position 0 is missing has no prefix to keep
    src.seq_rm(1, 0, 1)
    assert s.save(src, 1, [5] + toks[1:]) == 0


def test_host_tier_is_bounded_lru():
    src = make_cache()
    s0 = PrefixStore(src, chunk_tokens=C)
    per = s0.geometry.chunk_bytes
    s = PrefixStore(src, chunk_tokens=C, host_bytes=3 * per)
    a, b = tokens(2 * C), tokens(2 * C, 100)
    fill(src, 0, a)
    fill(src, 1, b, seed=1)
    s.save(src, 0, a)
    s.save(src, 1, b)
    assert s.host_used == 3 * per and s.stats["host_evicted"] == 1
    assert s.match(a) == 0 and s.match(b) == 2 * C                # a's first chunk went first
    s.save(src, 0, a[:C])                                          # touches nothing it lacks
    assert s.match(a) == C


def test_bad_arguments():
    cache = make_cache()
    with pytest.raises(ValueError, match="chunk_tokens"):
        PrefixStore(cache, chunk_tokens=0)
    with pytest.raises(ValueError, match="host_bytes"):
        PrefixStore(cache, host_bytes=-1)
    s = PrefixStore(cache, chunk_tokens=C)
    with pytest.raises(TypeError, match="salt"):
        s.keys([1, 2], salt=3)
    with pytest.raises(TypeError, match="tokens"):
        s.match([[1, 2]])
    with pytest.raises(StoreError, match="UnifiedCache"):
        s.save(object(), 0, [1])
    with pytest.raises(StoreError, match="buffers"):
        s.load(make_cache().__class__(64, 3, 16, 24, v_trans=False, buffers="none", semantics="2026"), 0, [1])
    other = make_cache(k=32)
    fill(other, 0, tokens(C))
    with pytest.raises(StoreError, match="geometry"):
        s.save(other, 0, tokens(C))
    # a load into a cache of another geometry is refused by the cache's own check, nothing changed
    fill(cache, 0, tokens(C))
    s.save(cache, 0, tokens(C))
    fill(other, 1, tokens(3, 40))
    before = other.state_write()
    with pytest.raises(StateError):
        s.load(other, 2, tokens(C + 1))
    assert other.state_write() == before


def test_load_into_a_full_cache_changes_nothing():
    src = make_cache()
    toks = tokens(4 * C)
    fill(src, 0, toks)
    s = PrefixStore(src, chunk_tokens=C)
    s.save(src, 0, toks)
    dst = make_cache(size=3 * C)
    fill(dst, 1, tokens(5, 900))
    before = dst.state_write()
    with pytest.raises(StateError, match="room"):
        s.load(dst, 0, toks)
    assert dst.state_write() == before


# --- the disk tier ---------------------------------------------------------------------------------

def _saved(tmp_path, n_chunks=3, **kw):
    src = make_cache()
    toks = tokens(n_chunks * C)
    fill(src, 0, toks)
    s = PrefixStore(src, tmp_path / "st", chunk_tokens=C, **kw)
    assert s.save(src, 0, toks) == n_chunks * C
    return src, toks, s


def test_disk_tier_survives_a_restart_and_reads_exactly(tmp_path):
    src, toks, s = _saved(tmp_path)
    assert s.stats["files_written"] == 3
    files = sorted(c.path for c in s.chunks())
    assert len(files) == 3
    assert all(os.path.getsize(f) == s._header_bytes + s.geometry.chunk_bytes + 8 for f in files)
    again = PrefixStore(src, tmp_path / "st", chunk_tokens=C, host_bytes=0)   # a new process, no host copy
    assert again.match(toks) == 3 * C
    dst = make_cache()
    assert again.load(dst, 0, toks) == 3 * C and again.stats["disk_hits"] == 3
    assert all(np.array_equal(x[0], y[0]) and np.array_equal(x[1], y[1])
               for x, y in zip(seq_rows(dst, 0)[1], seq_rows(src, 0)[1]))
    promoted = PrefixStore(src, tmp_path / "st", chunk_tokens=C)              # kept in host memory on the way
    assert promoted.load(make_cache(v_trans=True), 0, toks) == 3 * C and promoted.host_used == 3 * s.geometry.chunk_bytes
    opened = open_store(tmp_path / "st")
    assert opened.geometry == s.geometry and opened.match(toks) == 3 * C


@pytest.mark.parametrize("damage", ["flip", "truncate", "empty", "zeros", "header", "tokens", "extra"])
def test_a_damaged_chunk_file_is_a_miss_and_removed(tmp_path, damage):
    src, toks, s = _saved(tmp_path)
    victim = s._file(s.keys(toks)[1])
    data = bytearray(open(victim, "rb").read())
    if damage == "flip":
        data[len(data) // 2] ^= 0x10
    elif damage == "truncate":
        data = data[:len(data) - 100]
    elif damage == "empty":
        data = bytearray()
    elif damage == "zeros":
        data[s._header_bytes:s._header_bytes + 4096] = bytes(4096)
    elif damage == "header":
        data[0] = ord("X")
    elif damage == "tokens":
        data[96:100] = (12345).to_bytes(4, "little")
    elif damage == "extra":
        data += b"\0"
    open(victim, "wb").write(bytes(data))
    fresh = PrefixStore(src, tmp_path / "st", chunk_tokens=C, host_bytes=0)
    dst = make_cache()
    fill(dst, 3, tokens(4, 300))
    before = dst.state_write(3)
    assert fresh.load(dst, 0, toks) == C                   # the chunk before it still loads
    assert not os.path.exists(victim) and fresh.stats["corrupt_removed"] == 1
    assert dst.state_write(3) == before
    assert np.array_equal(seq_rows(dst, 0)[1][0][0], seq_rows(src, 0)[1][0][0][:C])
    assert fresh.match(toks) == C


def test_a_file_removed_while_in_use_is_a_miss(tmp_path):
    src, toks, s = _saved(tmp_path)
    fresh = PrefixStore(src, tmp_path / "st", chunk_tokens=C, host_bytes=0)
    assert fresh.match(toks) == 3 * C
    os.unlink(fresh._file(fresh.keys(toks)[0]))
    dst = make_cache()
    assert fresh.load(dst, 0, toks) == 0 and dst.used == 0


def test_another_geometry_is_refused(tmp_path):
    _saved(tmp_path)
    with pytest.raises(StoreError, match="another geometry"):
        PrefixStore(make_cache(k=32), tmp_path / "st", chunk_tokens=C)
    with pytest.raises(StoreError, match="another geometry"):
        PrefixStore(make_cache(), tmp_path / "st", chunk_tokens=2 * C)
    with pytest.raises(StoreError, match="another geometry"):
        PrefixStore(make_cache(type_k="f32"), tmp_path / "st", chunk_tokens=C)
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / META_NAME).write_text("{}")
    with pytest.raises(StoreError, match="not a kvcache store"):
        open_store(tmp_path / "junk")
    with pytest.raises(StoreError, match="not a kvcache store"):
        open_store(tmp_path / "nothing")


def test_disk_cap_removes_least_recently_used(tmp_path):
    src = make_cache()
    probe = PrefixStore(src, chunk_tokens=C)
    file_bytes = probe._header_bytes + probe.geometry.chunk_bytes + 8
    s = PrefixStore(src, tmp_path / "st", chunk_tokens=C, host_bytes=0, disk_bytes=int(4.5 * file_bytes))
    a, b = tokens(3 * C), tokens(3 * C, 100)
    fill(src, 0, a)
    fill(src, 1, b, seed=1)
    s.save(src, 0, a)
    old = s._file(s.keys(a)[0])
    os.utime(old, (1, 1))                                   # the least recently used
    s.save(src, 1, b)
    assert s.disk_usage() <= s.disk_bytes and not os.path.exists(old)
    assert s.stats["disk_evicted"] >= 2 and s.match(b) == 3 * C
    assert s.gc(0) > 0 and s.disk_usage() == 0


def test_the_disk_cap_holds_for_stores_sharing_a_directory(tmp_path):
    """Every store writing to a directory counts in one usage file, under its lock: two stores
    (as two processes) writing in turn stay within the cap together (each counted its own
    writes only, and the directory grew to 1.7x the cap before either removed a file)."""
    src = make_cache()
    probe = PrefixStore(src, chunk_tokens=C)
    file_bytes = probe._header_bytes + probe.geometry.chunk_bytes + 8
    cap = int(6.5 * file_bytes)
    stores = [PrefixStore(src, tmp_path / "st", chunk_tokens=C, host_bytes=0, disk_bytes=cap) for _ in range(2)]
    for i in range(8):
        toks = tokens(2 * C, 1000 * i)
        fill(src, 0, toks, seed=i)
        stores[i % 2].save(src, 0, toks)
        src.seq_rm(0, -1, -1)
        assert stores[0].disk_usage() <= cap, i
    assert sum(st.stats["disk_evicted"] for st in stores) > 0
    # a usage count lost or garbled is taken afresh from the files
    for text in (None, b"garbage"):
        usage = tmp_path / "st" / USAGE_NAME
        usage.unlink()
        if text is not None:
            usage.write_bytes(text)
        toks = tokens(2 * C, 50_000 + len(text or b""))
        fill(src, 0, toks, seed=9)
        stores[0].save(src, 0, toks)
        src.seq_rm(0, -1, -1)
        assert int(usage.read_bytes()) == stores[0].disk_usage() <= cap


def test_checksum_streams_and_detects():
    rng = np.random.default_rng(0)
    data = rng.integers(0, 256, 10_000, dtype=np.uint8)
    whole = ChunkSum()
    whole.update(data)
    for cuts in ((4096,), (1, 33, 64, 65, 9000), (7, 8, 9, 31, 32, 33)):
        parts = ChunkSum()
        for a, b in zip((0,) + cuts, cuts + (len(data),)):
            parts.update(data[a:b])
        assert parts.digest() == whole.digest() and parts.n_bytes == 10_000
    copied = ChunkSum()
    out = np.zeros(len(data) + 5, np.uint8)
    copied.copy_to(out.ctypes.data + 5, data[:3000])
    copied.update(data[3000:])
    assert copied.digest() == whole.digest() and np.array_equal(out[5:3005], data[:3000]) and not out[:5].any()
    for i in (0, 5000, 9999):
        d = data.copy()
        d[i] ^= 1
        x = ChunkSum()
        x.update(d)
        assert x.digest() != whole.digest()
    swapped = data.copy()
    swapped[:8], swapped[32:40] = data[32:40], data[:8]       # two words of one lane exchanged
    x = ChunkSum()
    x.update(swapped)
    assert x.digest() != whole.digest()
    shorter = ChunkSum()
    shorter.update(np.concatenate([data, np.zeros(1, np.uint8)]))
    assert shorter.digest() != whole.digest()                # a trailing zero byte counts


@pytest.mark.parametrize("how", ["straight", "bounce", "stream"])
def test_checksum_reads_a_file_into_regions(how, tmp_path):
    """ChunkSum.read_from: a file's bytes read into regions in steps, summed as update sums them;
    a file that ends first reads False, a closed descriptor raises OSError."""
    rng = np.random.default_rng(1)
    data = rng.integers(0, 256, 10_000, dtype=np.uint8)
    p = tmp_path / "f"
    p.write_bytes(b"head" + data.tobytes())
    whole = ChunkSum()
    whole.update(data)
    out = np.zeros(12_000, np.uint8)
    regions = np.array([[out.ctypes.data, 3001], [out.ctypes.data + 4000, 6999]], np.uint64)
    bounce = np.zeros(1000, np.uint8) if how != "straight" else None
    with open(p, "rb", buffering=0) as f:
        assert f.read(4) == b"head"
        s = ChunkSum()
        assert s.read_from(f.fileno(), regions, 1000, bounce, how == "stream")
        assert f.read() == b""
    assert s.digest() == whole.digest() and s.n_bytes == 10_000
    assert np.array_equal(out[:3001], data[:3001]) and np.array_equal(out[4000:10_999], data[3001:])
    assert not out[3001:4000].any() and not out[10_999:].any()
    with open(p, "rb", buffering=0) as f:
        assert not ChunkSum().read_from(f.fileno(), [(out.ctypes.data, 10_005)], 4096,
                                            None if bounce is None else np.zeros(4096, np.uint8))
    with pytest.raises(OSError):
        ChunkSum().read_from(1 << 20, regions, 1000)
    with pytest.raises(ValueError, match="step"):
        ChunkSum().read_from(0, regions, 2000, np.zeros(1000, np.uint8))
    with pytest.raises(ValueError, match="address 0"):
        ChunkSum().read_from(0, [(0, 5)], 1000)


_FULL_DISK = textwrap.dedent("""
    import resource, signal, sys
    sys.path[:0] = sys.argv[3:]
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)       # a write past the limit fails with EFBIG
    from test_store import make_cache, fill, tokens, C
    from kvcache.store import PrefixStore
    src = make_cache()
    fill(src, 0, tokens(2 * C))
    fill(src, 1, tokens(4 * C, 500), seed=1)
    s = PrefixStore(src, sys.argv[1], chunk_tokens=C, host_bytes=0)
    s.save(src, 0, tokens(2 * C))                        # written before the disk fills up
    resource.setrlimit(resource.RLIMIT_FSIZE, (int(sys.argv[2]), int(sys.argv[2])))
    print(s.save(src, 1, tokens(4 * C, 500)), s.stats["files_written"], s.stats["disk_errors"], bool(s.last_error))
""")


def test_a_full_disk_fails_the_write_cleanly(tmp_path):
    here = os.path.dirname(__file__)
    st = tmp_path / "st"
    src = make_cache()
    probe = PrefixStore(src, chunk_tokens=C)
    file_bytes = probe._header_bytes + probe.geometry.chunk_bytes + 8
    # no file may grow to a whole chunk file: every write after the limit fails
    r = subprocess.run([sys.executable, "-c", _FULL_DISK, str(st), str(file_bytes - 100), here,
                        _KVCACHE_ROOT], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == [str(4 * C), "2", "4", "True"]
    names = [n for d in os.listdir(st / "chunks") for n in os.listdir(st / "chunks" / d)]
    assert len(names) == 2 and all(n.endswith(".kvc") for n in names)   # no temporary file left behind
    s = PrefixStore(src, st, chunk_tokens=C, host_bytes=0)
    assert s.match(tokens(4 * C, 500)) == 0
    fill(src, 0, tokens(2 * C))
    dst = make_cache()
    assert s.load(dst, 0, tokens(2 * C)) == 2 * C           # what was written reads back whole
    assert all(np.array_equal(x[0], y[0]) and np.array_equal(x[1], y[1])
               for x, y in zip(seq_rows(dst, 0)[1], seq_rows(src, 0)[1]))


_WRITER = textwrap.dedent("""
    import sys
    sys.path[:0] = sys.argv[3:]
    from test_store import make_cache, fill, tokens, C
    from kvcache.store import PrefixStore
    seed = int(sys.argv[2])
    src = make_cache()
    for r in range(6):
        toks = tokens(4 * C, 1 + 1000 * (r % 3))
        src.clear()
        fill(src, 0, toks, seed=r % 3)
        s = PrefixStore(src, sys.argv[1], chunk_tokens=C, host_bytes=0)
        s.save(src, 0, toks)
        dst = make_cache()
        k = s.load(dst, 0, toks)
        assert k in (0, C, 2 * C, 3 * C, 4 * C), k
        s.gc(10 * s.geometry.chunk_bytes)
    print("ok")
""")


def test_processes_share_a_directory_without_torn_reads(tmp_path):
    here = os.path.dirname(__file__)
    st = tmp_path / "st"
    PrefixStore(make_cache(), st, chunk_tokens=C)
    procs = [subprocess.Popen([sys.executable, "-c", _WRITER, str(st), str(i), here, _KVCACHE_ROOT],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(3)]
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0 and out.strip() == "ok", err
    s = PrefixStore(make_cache(), st, chunk_tokens=C, host_bytes=0)
    for r in range(3):
        toks = tokens(4 * C, 1 + 1000 * r)
        src = make_cache()
        fill(src, 0, toks, seed=r)
        dst = make_cache()
        k = s.load(dst, 0, toks)
        for (a, b), (c, d) in zip(seq_rows(dst, 0)[1], seq_rows(src, 0)[1]):
            assert np.array_equal(a, c[:k]) and np.array_equal(b, d[:k])
    assert s.stats["corrupt_removed"] == 0


# --- with the prefix index -------------------------------------------------------------------------

def test_release_writes_and_attach_loads_what_the_index_evicted():
    cache = make_cache(size=64)
    cache.enable_prefix_reuse()
    s = PrefixStore(cache, chunk_tokens=C)
    system = tokens(3 * C)
    first = system + [900, 901]
    fill(cache, 0, first)
    assert s.release(cache, 0, first) == len(first)
    assert s.match(system) == 3 * C
    cache.prefix_evict(1000)                               # the index forgets it
    assert cache.prefix_match(system + [5]) == 0
    second = system + [7, 8]
    assert s.attach(cache, 1, second) == 3 * C
    pos, rows = seq_rows(cache, 1)
    assert list(pos) == list(range(3 * C))
    ref = make_cache()
    fill(ref, 0, system)
    assert all(np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1]) for a, b in zip(rows, seq_rows(ref, 0)[1]))
    fill(cache, 1, [7, 8], p0=3 * C, seed=0)
    assert cache.prefix_release(1, tokens=second) == len(second)   # the loaded cells join the index
    assert cache.prefix_match(system + [7, 8, 9]) == len(second)
    assert s.attach(cache, 2, system + [7, 8, 9]) == len(second)    # the index's longer match wins


# --- the command line ------------------------------------------------------------------------------

def test_cli_reports_and_trims_a_store(tmp_path, capsys):
    import json

    from kvcache import cli

    src, toks, s = _saved(tmp_path)
    dst = make_cache()
    s.load(dst, 0, toks)
    s.load(dst, 1, tokens(3 * C, 777))
    s.close()
    assert cli.main(["store", str(tmp_path / "st"), "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert (r["chunks"], r["tokens"], r["prompts"], r["longest_prefix_tokens"]) == (3, 3 * C, 1, 3 * C)
    assert r["stats"]["host_hits"] == 3 and r["stats"]["misses"] == 1 and r["stats"]["files_written"] == 3
    assert cli.main(["store", str(tmp_path / "st")]) == 0
    text = capsys.readouterr().out
    assert "3 chunks (24 tokens)" in text and "3 from memory, 0 from disk" in text
    assert cli.main(["store", str(tmp_path / "st"), "--gc", "0", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert r["gc_removed"] == 3 and r["chunks"] == 0
    assert cli.main(["store", str(tmp_path)]) == 2
    assert "not a kvcache store" in capsys.readouterr().err


# --- the bench case ---------------------------------------------------------------------------------

@needs_bench
def test_the_store_bench_case_checks_both_tiers():
    import kvcache_bench

    rows = kvcache_bench.CASES["store"](True, 1)
    assert [r.case.split(",")[0] for r in rows] == [
        "store: restore a prefix from the host tier into a cache",
        "store: restore a prefix from the disk tier (page cache warm) into a cache"]
    assert all(r.kvcache_ns > 0 and r.yardstick_ratio > 0 for r in rows)


# --- bad input and hostile directories ------------------------------------------------------------

def test_a_fifo_in_place_of_a_store_file_is_no_chunk_and_blocks_nothing(tmp_path):
    # opened without O_NONBLOCK, a FIFO blocks the reader forever: run where a hang is a failure
    code = textwrap.dedent(f"""
        import glob, os, kvcache
        from kvcache.store import PrefixStore, open_store
        c = kvcache.UnifiedCache(64, 1, 8, 8, v_trans=False, semantics="2026")
        assert c.find_slot(kvcache.UBatch(list(range(8)), [0] * 8))
        st = PrefixStore(c, {str(tmp_path / "s")!r}, chunk_tokens=4, host_bytes=0)
        assert st.save(c, 0, list(range(8))) == 8
        f = sorted(glob.glob({str(tmp_path / "s/chunks/*/*.kvc")!r}))[0]
        os.unlink(f)
        os.mkfifo(f)
        os.unlink({str(tmp_path / "s" / "stats.json")!r}) if os.path.exists({str(tmp_path / "s" / "stats.json")!r}) else None
        os.mkfifo({str(tmp_path / "s" / "stats.json")!r})
        print(len(list(st.chunks())), st.summary()["disk_chunks"])
        d = kvcache.UnifiedCache(64, 1, 8, 8, v_trans=False, semantics="2026")
        print(st.load(d, 0, list(range(8))), open_store({str(tmp_path / "s")!r}).match(list(range(8))))
        print(st.gc(0))
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    n_files, n_chunks, loaded, matched, removed = map(int, r.stdout.split())
    # the FIFO is no chunk: one chunk file left; a load or match stops at the FIFO's chunk
    assert (n_files, n_chunks, removed) == (1, 1, 1) and loaded == matched and loaded in (0, 4)


def test_put_takes_exactly_the_rows_of_the_cache():
    src = make_cache()
    toks = tokens(2 * C)
    fill(src, 0, toks)
    _, rows = seq_rows(src, 0)
    s = PrefixStore(src, chunk_tokens=C)
    ks, vs = [k for k, _ in rows], [v for _, v in rows]
    with pytest.raises(ValueError, match=r"k_rows\[0\] holds .* expected 16 rows"):
        s.put(toks, [ks[0].astype(np.float32)] + ks[1:], vs)         # f32 rows into an f16 store
    with pytest.raises(ValueError, match=r"k_rows\[0\] holds"):
        s.put(toks, [np.concatenate([ks[0], ks[0]])] + ks[1:], vs)   # more rows than tokens
    with pytest.raises(TypeError, match=r"k_rows\[0\] must be an array of rows"):
        s.put(toks, ["x" * 100] + ks[1:], vs)
    with pytest.raises(TypeError, match=r"v_rows\[1\] must hold numbers"):
        s.put(toks, ks, [vs[0], vs[1].astype("U2")] + vs[2:])
    assert s.match(toks) == 0
    assert s.put(toks, ks, vs) == 2 * C
    e = kvcache.UnifiedCache(64, 1, 8, 8, n_seq_max=2, semantics="2026", cell_ext=True)
    with pytest.raises(ValueError, match="put: a store of a unified cache: .*2-D positions"):
        PrefixStore(e, chunk_tokens=4).put(tokens(4), [np.zeros((4, 16), np.uint8)], [np.zeros((4, 16), np.uint8)])


def test_bad_arguments_are_named(tmp_path):
    src = make_cache()
    with pytest.raises(ValueError, match="chunk_tokens must be an int in"):
        PrefixStore(src, chunk_tokens=1 << 40)
    with pytest.raises(ValueError, match="path must name a directory"):
        PrefixStore(src, "", chunk_tokens=C)
    with pytest.raises(TypeError, match="promote must be a bool"):
        PrefixStore(src, chunk_tokens=C, promote="no")
    s = PrefixStore(src, chunk_tokens=C)
    with pytest.raises(ValueError, match="max_bytes"):
        s.gc(-1)
    with pytest.raises(TypeError, match="seq_id must be an int, not float"):
        s.load(make_cache(), 1.0, tokens(C))
    with pytest.raises(TypeError, match="seq_id must be an int, not NoneType"):
        s.attach(make_cache(), None, tokens(C))
    with pytest.raises(ValueError, match=r"seq_id = 9 is outside \[0, 4\)"):
        s.load(make_cache(), 9, tokens(C))


@pytest.mark.parametrize("geometry", [{}, {"type_k_id": "x"}, {"type_k_id": 1, "type_v_id": 1, "layers": [[0, 1, 2]],
                                                                 "chunk_tokens": 4},
                                      {"type_k_id": 1, "type_v_id": 1, "layers": [], "chunk_tokens": 0},
                                      {"type_k_id": 1 << 40, "type_v_id": 1, "layers": [], "chunk_tokens": 4}])
def test_metadata_naming_no_geometry_is_a_store_error(tmp_path, geometry):
    (tmp_path / META_NAME).write_text(json.dumps({"format": "kvcache-store", "version": 1, "geometry_digest": "00",
                                                  "geometry": geometry}))
    with pytest.raises(StoreError, match="names no valid geometry"):
        open_store(tmp_path)
    with pytest.raises(StoreError):
        PrefixStore(make_cache(), tmp_path, chunk_tokens=C)


def test_metadata_whose_digest_is_not_its_geometry_is_named_damaged(tmp_path):
    """A digest that disagrees with the geometry beside it is damage, not another geometry: the
    message does not compare a cache with itself (`kvcache store` opens a store in its own)."""
    _saved(tmp_path)
    meta = json.loads((tmp_path / "st" / META_NAME).read_text())
    meta["geometry_digest"] = "00" * 16
    (tmp_path / "st" / META_NAME).write_text(json.dumps(meta))
    for call in (lambda: open_store(tmp_path / "st"), lambda: PrefixStore(make_cache(), tmp_path / "st", chunk_tokens=C)):
        with pytest.raises(StoreError, match=f"{META_NAME} is damaged: its geometry_digest is not the digest of the "
                                             "geometry it names"):
            call()
