"""The installed package: where it comes from and what it ships."""
import os
import sys
from pathlib import Path

import pytest

import kvcache

REPO = Path(__file__).resolve().parent.parent
INSTALLED = not Path(kvcache.__file__).resolve().is_relative_to(REPO / "src")


def test_version_matches_pyproject():
    text = (REPO / "pyproject.toml").read_text(encoding="utf-8")
    assert f'version = "{kvcache.__version__}"' in text


def test_imported_from_the_installation_when_expected():
    """.ci/run sets KVCACHE_EXPECT_INSTALLED: then the tests must exercise the wheel."""
    if os.environ.get("KVCACHE_EXPECT_INSTALLED") != "1":
        pytest.skip("source-tree run")
    assert INSTALLED, f"kvcache imported from {kvcache.__file__}, inside the source tree"


@pytest.mark.skipif(not INSTALLED, reason="headers are copied into the package only by a build")
def test_get_include_ships_the_c_headers():
    inc = Path(kvcache.get_include())
    for h in sorted((REPO / "csrc").glob("*.h")):
        assert (inc / "include" / h.name).is_file(), h.name
    assert (inc / "_core.pxd").is_file()
    assert (inc / "includes" / "kvc_common.pxd").is_file()


# --- what the build ships ----------------------------------------------------------------------------

def _manifest_patterns():
    """(command, directory, pattern) of every pattern of MANIFEST.in."""
    for line in (REPO / "MANIFEST.in").read_text(encoding="utf-8").splitlines():
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        cmd, args = words[0], words[1:]
        if cmd in ("recursive-include", "recursive-exclude"):
            for pat in args[1:]:
                yield cmd, args[0], pat
        elif cmd in ("include", "exclude"):
            for pat in args:
                yield cmd, "", pat
        else:   # global-include/exclude, graft, prune
            for pat in args:
                yield cmd, "", pat


def test_every_manifest_pattern_matches_a_file():
    """setuptools warns for each pattern that matches nothing; a build should warn about nothing."""
    unmatched = []
    for cmd, folder, pat in _manifest_patterns():
        if cmd.startswith("recursive-"):
            found = any(p.is_file() for p in (REPO / folder).rglob(pat))
        elif cmd in ("include", "exclude"):
            found = any(p.is_file() for p in REPO.glob(pat))
        else:
            found = any(p.exists() for p in REPO.rglob(pat))
        if not found:
            unmatched.append(f"{cmd} {folder} {pat}".replace("  ", " "))
    assert not unmatched, f"MANIFEST.in patterns matching no file: {unmatched}"


def test_manifest_ships_the_test_data():
    """Every file the tests read from tests/data goes into the sdist: a blob left out would fail
    the suite of whoever tests from the sdist."""
    import fnmatch

    rules = [(REPO / folder, pat) for cmd, folder, pat in _manifest_patterns() if cmd == "recursive-include"]
    left_out = [str(p.relative_to(REPO)) for p in sorted((REPO / "tests" / "data").rglob("*"))
                if p.is_file() and not any(p.is_relative_to(d) and fnmatch.fnmatch(p.name, pat) for d, pat in rules)]
    assert not left_out, f"files under tests/data that MANIFEST.in leaves out: {left_out}"


PROJECT_HOME = "https://github.com/kvcache/kvcache"


def test_project_urls_and_authors():
    text = (REPO / "pyproject.toml").read_text(encoding="utf-8")
    project = _toml(text)["project"]
    assert project["authors"] and all(a.get("name") for a in project["authors"])
    urls = project["urls"]
    assert {"Homepage", "Source", "Issues", "Changelog", "Documentation"} <= set(urls)
    assert all(u.startswith(PROJECT_HOME) for u in urls.values()), urls
    # one address everywhere it is written
    import re

    for path in ("README.md", "CHANGELOG.md", "benchmarks/pyproject.toml", "pyproject.toml"):
        found = set(re.findall(r"https://github\.com/[\w.-]+/[\w.-]+", (REPO / path).read_text(encoding="utf-8")))
        assert found <= {PROJECT_HOME}, (path, found)
    assert PROJECT_HOME in (REPO / "README.md").read_text(encoding="utf-8")


def _toml(text):
    import sys

    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - Python 3.10 (pytest needs tomli there)
        from conftest import need_module

        tomllib = need_module("test", "tomli")
    return tomllib.loads(text)


@pytest.mark.skipif(not INSTALLED, reason="the metadata of an installed kvcache")
def test_installed_metadata_has_home_page_author_and_urls():
    from importlib.metadata import metadata

    md = metadata("kvcache")
    urls = dict(u.split(", ", 1) for u in md.get_all("Project-URL") or [])
    assert urls.get("Homepage") == PROJECT_HOME
    assert md["Author"] or md["Author-email"]


def _elf_sections(path: Path) -> list:
    """Section names of an ELF shared object (64-bit little-endian)."""
    import struct

    data = path.read_bytes()
    assert data[:4] == b"\x7fELF" and data[4] == 2 and data[5] == 1, "not a 64-bit little-endian ELF file"
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    headers = [struct.unpack_from("<IIQQQQ", data, shoff + i * shentsize) for i in range(shnum)]
    strtab_off, strtab_size = headers[shstrndx][4], headers[shstrndx][5]
    strtab = data[strtab_off:strtab_off + strtab_size]
    return [strtab[h[0]:strtab.index(b"\0", h[0])].decode() for h in headers]


# What the kvcache wheel leaves to others, by the start of a name directly in kvcache/: the bench
# (the kvcache-bench distribution in benchmarks/), the test suite's reference models and
# conformance runner (tests/), the hand-off examples' toy workload (docs/examples/)
NOT_SHIPPED = ("bench", "_bench", "reference", "conformance", "_toy_serving")


def _not_shipped(files: list) -> list:
    """The files of kvcache (paths from above the package, as a wheel lists them) named in NOT_SHIPPED."""
    return [f for f in files if len(Path(f).parts) > 1 and Path(f).parts[0] == "kvcache"
            and Path(f).parts[1].startswith(NOT_SHIPPED)]


def test_the_package_source_holds_the_runtime_only():
    """The wheel is built from src/kvcache: nothing of the tools may lie there."""
    src = REPO / "src"
    files = [p.relative_to(src).as_posix() for p in (src / "kvcache").rglob("*")
             if p.suffix in (".py", ".pyi", ".pyx", ".pxd", ".pxi")]
    assert "kvcache/cli/bench.py" in files     # the command stays, it imports kvcache_bench
    assert not _not_shipped(files)


@pytest.mark.skipif(not INSTALLED, reason="an installed kvcache")
def test_the_wheel_holds_the_runtime_only():
    from importlib.metadata import distribution

    files = [str(f) for f in distribution("kvcache").files or []]
    assert any("_core" in f for f in files)
    assert not _not_shipped(files), "the kvcache wheel holds files of the bench, the tests or the examples"


@pytest.mark.skipif(not INSTALLED or not sys.platform.startswith("linux"), reason="an installed Linux build")
def test_the_wheel_is_stripped():
    from importlib.metadata import distribution

    if os.environ.get("KVCACHE_DEBUG_INFO") == "1":
        pytest.skip("built with KVCACHE_DEBUG_INFO=1")
    files = [str(f) for f in distribution("kvcache").files or []]
    assert any("_core" in f and f.endswith(".so") for f in files)
    core = Path(kvcache._core.__file__)
    sections = _elf_sections(core)
    assert ".text" in sections
    assert not [s for s in sections if s.startswith(".debug") or s == ".symtab"], sections
