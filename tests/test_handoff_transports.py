"""The hand-off through Ray and NIXL: the integrations' own functions (no transport needed), and
the two examples run end to end when their library is installed in this interpreter (CI's
handoff stage installs both; elsewhere the example tests skip, naming what is missing)."""
import importlib.util
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import kvcache
from kvcache.integrations.ray import export_sequence, import_sequence
from cache_state import assert_unchanged, busy_unified, snapshot
from conftest import kvcache_env, need

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "docs" / "examples"


def test_ray_export_and_import_equal_state_read_and_fail_cleanly():
    src = busy_unified(seed=0)
    dst = busy_unified(seed=1)
    ref = busy_unified(seed=1)
    header, data = export_sequence(src, 1)
    data.flags.writeable = False             # as ray.get returns it
    assert import_sequence(dst, header, data) == src.seq_export(1).n_cells
    ref.state_read(src.state_write(1), 1)
    assert snapshot(dst) == snapshot(ref)
    before = snapshot(dst)
    with pytest.raises(ValueError, match="bytes"):
        import_sequence(dst, header, data[:-1])
    with pytest.raises(kvcache.StateError):
        import_sequence(dst, header[:-3], data)
    assert_unchanged(dst, before, "failed import")


def _run_example(name, module, *args):
    if importlib.util.find_spec(module) is None:
        need("handoff", f"{module} is not installed in {sys.executable} (the {module} extra of kvcache; "
                        f"CI's handoff stage installs it)")
    env = kvcache_env(RAY_AUTH_MODE="disabled")
    res = subprocess.run([sys.executable, str(EXAMPLES / name), *args], capture_output=True, text=True,
                         timeout=600, env=env, cwd=ROOT)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "match" in res.stdout and "MISMATCH" not in res.stdout, res.stdout
    return res.stdout


def test_the_ray_example_moves_a_sequence_between_two_actors():
    out = _run_example("handoff_ray.py", "ray", "--tokens", "256", "--decode", "8")
    assert "moved sequence 0: 256 cells" in out and "zero-copy read-only view: True" in out


def test_the_nixl_example_moves_a_sequence_between_two_processes():
    out = _run_example("handoff_nixl.py", "nixl", "--tokens", "256", "--decode", "8")
    assert "moved sequence 0: 256 cells" in out and "NIXL READ over UCX" in out


def test_nixl_descriptors_and_cache_memory():
    from kvcache.integrations.nixl import cache_memory, descriptors
    c = busy_unified(seed=0)
    mem = cache_memory(c)
    assert mem.shape == (2 * len(c.layers), 3) and mem.dtype == np.uint64
    assert int(mem[:, 1].sum()) == c.total_size
    assert cache_memory(busy_unified(buffers="none")).shape == (0, 3)
    exp = c.seq_export(0)
    d = descriptors(exp.regions)
    assert d.shape == (len(exp.regions), 3) and (d[:, :2] == exp.regions).all() and not d[:, 2].any()
    # every region lies inside the registered memory
    lo, hi = mem[:, 0], mem[:, 0] + mem[:, 1]
    for a, n in exp.regions.tolist():
        assert ((lo <= a) & (a + n <= hi)).any()


def test_the_helpers_refuse_a_cache_that_is_not_a_unified_cache():
    """The Ray and NIXL helpers take a UnifiedCache: an ISWACache is refused in those words (its
    export went through, its import failed on an attribute of the pair's import), unchanged."""
    from kvcache.integrations.nixl import cache_memory
    from cache_state import busy_iswa

    src, dst = busy_iswa(seed=0), busy_iswa(seed=1)
    before = snapshot(dst)
    with pytest.raises(TypeError, match="must be a UnifiedCache, not ISWACache"):
        export_sequence(src, 1)
    header = src.seq_export(1).header
    data = src.seq_export(1).gather()
    with pytest.raises(TypeError, match="must be a UnifiedCache, not ISWACache"):
        import_sequence(dst, header, data)
    assert_unchanged(dst, before, "refused import")
    with pytest.raises(TypeError, match="must be a UnifiedCache, not ISWACache"):
        cache_memory(dst)
    # its parts move one by one
    for a, b in ((src.base, dst.base), (src.swa, dst.swa)):
        h, d = export_sequence(a, 1)
        import_sequence(b, h, d)
    assert dst.state_write(1) == src.state_write(1)


def test_nixl_descriptors_refuse_what_is_not_a_region_list():
    """descriptors takes (N, 2) uint64 regions as pair_regions does: an (N, 3) array was reshaped
    into rows of other regions' fields, negative addresses an OverflowError."""
    from kvcache.integrations.nixl import descriptors

    for bad in (np.zeros((2, 3), np.uint64), np.zeros(4, np.uint64), np.array([[-1, 2]])):
        with pytest.raises(ValueError, match=r"\(N, 2\) uint64"):
            descriptors(bad)
