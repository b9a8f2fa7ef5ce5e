"""The fuzz seeds replayed through the Python fuzz targets' checks (tests/fuzz/atheris_state.py):
every state blob of the corpora read into its caches, with the transactional and round-trip
contract checked, and llama.cpp's files through the state-file parsers and `kvcache inspect`.
The libFuzzer corpora serve the C targets too (make -C tests/fuzz regress)."""
import importlib.util
import os
import sys
from pathlib import Path

import pytest

import kvcache

FUZZ = Path(__file__).resolve().parent / "fuzz"
CORPUS = FUZZ / "corpus"


@pytest.fixture(scope="module")
def targets():
    spec = importlib.util.spec_from_file_location("kvcache_fuzz_targets", FUZZ / "atheris_state.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    try:
        spec.loader.exec_module(mod)
        yield mod
    finally:
        sys.modules.pop(spec.name, None)


def seeds(name):
    d = CORPUS / name
    return sorted(d.iterdir()) if d.is_dir() else []


@pytest.mark.parametrize("target, corpus", [("test_unified", "fuzz_unified_state"),
                                            ("test_unified2026", "fuzz_state2026"),
                                            ("test_recurrent", "fuzz_recurrent_state"),
                                            ("test_statefile", "atheris_files"),
                                            ("test_inspect", "atheris_files")])
def test_seeds_keep_the_contract(targets, target, corpus):
    files = seeds(corpus)
    if not files:
        pytest.skip(f"no seeds in {CORPUS / corpus}")
    check = getattr(targets, target)
    for f in files:
        try:
            check(f.read_bytes())
        except targets.ContractBroken as e:
            pytest.fail(f"{f.name}: {e}")


def test_seeds_reach_the_extension(targets):
    # the 2026 seeds include caches with the per-cell extension, read in layouts of 8- and 12-byte
    # extensions, found from the bytes, and from a state without it
    layouts = set()
    for f in seeds("fuzz_state2026"):
        parsed = targets._unified2026_geometry(f.read_bytes())
        if parsed is not None and parsed[0].get("cell_ext"):
            layouts.add(parsed[3]["layout"])
    assert {None, "2026", "2026-05", "2025-08"} <= layouts


def test_checks_can_fail(targets):
    # a read that changes the cache must be reported: a UnifiedCache whose state_read also
    # scribbles on K after failing (a subclass derives from its semantics' class)
    class Scribbler(kvcache.UnifiedCache2025):
        def state_read(self, *a, **k):
            try:
                return super().state_read(*a, **k)
            finally:
                self.k(0)[0, 0] += 1

    c = Scribbler(32, 1, 2, 2, type_k="f32", type_v="f32", n_seq_max=1)
    before = targets._unified_image(c)
    with pytest.raises(targets.StateError):
        c.state_read(b"\xff\xff\xff\xff", -1)
    assert not targets._same_unified(before, targets._unified_image(c))
