"""Typing and documentation of the public surface.

- the package ships its stubs (``_core.pyi``) and ``py.typed``;
- ``mypy --strict`` accepts tests/typed_usage.py, a program over the main API whose
  ``assert_type`` lines pin what the stubs promise, and that program runs;
- ``mypy.stubtest`` finds the stubs consistent with the compiled module;
- every public name (the ``__all__`` of the package and of its modules, their public methods
  and properties) has a docstring.

The mypy checks use the kvcache this suite imports: the source tree in development (then its
``src`` is given to mypy as MYPYPATH), the installed wheel in CI (found as a PEP 561 package)."""
import importlib
import inspect
import os
import re
import site
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

import kvcache
from conftest import TESTS, kvcache_env, need_module

PACKAGE = Path(kvcache.__file__).resolve().parent
EXAMPLE = TESTS / "typed_usage.py"
ALLOWLIST = TESTS / "stubtest_allowlist.txt"

# the modules whose __all__ is public API
MODULES = ["kvcache", "kvcache.unified", "kvcache.recurrent", "kvcache.iswa", "kvcache.batch",
           "kvcache.geometry", "kvcache.statefile", "kvcache.inspect", "kvcache.plan", "kvcache.simulate",
           "kvcache.demo", "kvcache.cli"]


def test_stubs_and_marker_ship_with_the_package():
    for name in ("py.typed", "_core.pyi"):
        assert (PACKAGE / name).is_file(), f"{name} is missing from {PACKAGE}"


def _mypy_env() -> dict:
    """Environment for mypy: the kvcache of this process, as source or as installed package."""
    env = kvcache_env()
    where = str(PACKAGE.parent)
    installed = {os.path.realpath(p) for p in
                 [*site.getsitepackages(), site.getusersitepackages(),
                  sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]]}
    if os.path.realpath(where) not in installed:
        env["MYPYPATH"] = where
    else:
        env.pop("MYPYPATH", None)
    return env


@pytest.fixture(scope="module")
def mypy_cache(tmp_path_factory):
    need_module("test", "mypy")
    return tmp_path_factory.mktemp("mypy-cache")


def _run(args: list, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", *args], cwd=cwd, env=_mypy_env(), capture_output=True, text=True)


@pytest.mark.static_analysis
def test_mypy_strict_accepts_the_typed_usage_example(mypy_cache, tmp_path):
    res = _run(["mypy", "--strict", "--cache-dir", str(mypy_cache), "--no-color-output", str(EXAMPLE)], tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "Success" in res.stdout


# the modules of the main API are annotated throughout (the rest passes plain mypy via stubtest)
CORE_MODULES = ["kvcache", "kvcache.unified", "kvcache.recurrent", "kvcache.iswa", "kvcache.batch",
                "kvcache.geometry", "kvcache.statefile"]


def _strict_core(mypy_cache, tmp_path, *extra: str) -> subprocess.CompletedProcess:
    # by module name, mypy checks the kvcache this suite imports: src/ through MYPYPATH, or the
    # installed package (its files in site-packages are checked like any other)
    modules = [arg for name in CORE_MODULES for arg in ("-m", name)]
    return _run(["mypy", "--strict", "--follow-imports=silent", "--cache-dir", str(mypy_cache), "--no-color-output",
                 *extra, *modules], tmp_path)


@pytest.mark.static_analysis
def test_core_modules_pass_mypy_strict(mypy_cache, tmp_path):
    res = _strict_core(mypy_cache, tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr
    assert f"{len(CORE_MODULES)} source files" in res.stdout, res.stdout


@pytest.mark.static_analysis
def test_core_check_reads_the_imported_package(mypy_cache, tmp_path):
    """The check can fail, on the files this suite imports: an error put into the imported
    unified.py (through --shadow-file, which applies only to the file mypy really reads) is found."""
    target = PACKAGE / "unified.py"
    shadow = tmp_path / "unified.py"
    shadow.write_text(target.read_text(encoding="utf-8") + '\nnot_an_int: int = "0"\n', encoding="utf-8")
    res = _strict_core(mypy_cache, tmp_path, "--shadow-file", str(target), str(shadow))
    assert res.returncode == 1, res.stdout + res.stderr
    assert 'Incompatible types in assignment (expression has type "str", variable has type "int")' in res.stdout


@pytest.mark.static_analysis
def test_mypy_strict_rejects_a_misuse(mypy_cache, tmp_path):
    """The check can fail: a wrong argument type, a wrong promised type and a member the cache's
    semantics does not have are reported."""
    bad = tmp_path / "misuse.py"
    bad.write_text(
        "import numpy as np\nimport numpy.typing as npt\nimport kvcache\nfrom typing_extensions import assert_type\n"
        "c = kvcache.UnifiedCache(64, 1, 8, 8)\n"
        "c.seq_rm('0')\n"
        "assert_type(c.kq_mask(kvcache.UBatch([0], [0])), npt.NDArray[np.float16])\n"
        "kvcache.UnifiedCache(64, 1, 8, 8, semantics='2026').commit()\n")
    res = _run(["mypy", "--strict", "--cache-dir", str(mypy_cache), "--no-color-output", str(bad)], tmp_path)
    assert res.returncode == 1
    assert 'incompatible type "str"; expected "int"' in res.stdout
    assert "[assert-type]" in res.stdout
    assert '"UnifiedCache2026" has no attribute "commit"' in res.stdout


def test_the_typed_usage_example_runs():
    sys.path.insert(0, str(TESTS))
    try:
        mod = importlib.import_module("typed_usage")
    finally:
        sys.path.remove(str(TESTS))
    try:
        import gguf  # noqa: F401
        with_gguf = True
    except ImportError:
        with_gguf = False
    mod.main(with_gguf=with_gguf)


@pytest.mark.static_analysis
def test_stubtest_finds_the_stubs_consistent(mypy_cache, tmp_path):
    help_text = _run(["mypy.stubtest", "--help"], tmp_path).stdout
    # PEP 800 (disjoint bases) is not declared for the Cython classes; older mypy does not check it
    flags = ["--ignore-disjoint-bases"] if "--ignore-disjoint-bases" in help_text else []
    # the optional modules import what they adapt: without it stubtest cannot import them
    optional = (("integrations\\.transformers", ("torch", "transformers")), ("torch_attention", ("torch",)),
                ("integrations\\.llama_cpp", ("llama_cpp",)))
    absent = [module for module, needs in optional if any(importlib.util.find_spec(m) is None for m in needs)]
    allowlist = ALLOWLIST
    if absent:
        allowlist = tmp_path / "allowlist.txt"
        allowlist.write_text(ALLOWLIST.read_text(encoding="utf-8")
                             + "".join(f"kvcache\\.{module}(\\..*)?\n" for module in absent), encoding="utf-8")
    res = _run(["mypy.stubtest", "kvcache", "--concise", "--allowlist", str(allowlist), *flags], tmp_path)
    assert res.returncode == 0, res.stdout + res.stderr


# --- docstrings ---------------------------------------------------------------------------------

def _doc(obj) -> str:
    d = getattr(obj, "__doc__", None)
    return d.strip() if isinstance(d, str) else ""


def _members(cls):
    """(name, kind, documented) of the public methods, properties and attributes of a kvcache
    class and its kvcache bases. An attribute without its own docstring (a Cython ``readonly``
    field, a ``__slots__`` entry) counts as documented when a class docstring names it."""
    class_docs = " ".join(_doc(k) for k in cls.__mro__ if k.__module__.startswith("kvcache"))
    seen = set()
    for klass in cls.__mro__:
        if klass is object or not klass.__module__.startswith("kvcache"):
            continue
        for name, v in vars(klass).items():
            if name.startswith("_") or name in seen:
                continue
            seen.add(name)
            if isinstance(v, property):
                yield name, "property", bool(_doc(v.fget) or _doc(v))
            elif isinstance(v, (staticmethod, classmethod)):
                yield name, "method", bool(_doc(v.__func__))
            elif inspect.isgetsetdescriptor(v) or inspect.ismemberdescriptor(v):
                named = re.search(rf"\b{re.escape(name)}\b", class_docs) is not None
                yield name, "attribute", bool(_doc(v)) or named
            elif callable(v):
                yield name, "method", bool(_doc(v))
            elif hasattr(type(v), "__get__"):
                # an attribute descriptor of kvcache's own (ISWACache's shared attributes)
                yield name, "attribute", bool(_doc(v))


def test_every_public_name_has_a_docstring():
    missing = []
    for mod_name in MODULES:
        mod = importlib.import_module(mod_name)
        if not _doc(mod):
            missing.append(mod_name)
        for name in getattr(mod, "__all__", []):
            obj = getattr(mod, name)
            if not (inspect.isclass(obj) or callable(obj)):
                continue   # constants (__version__, magic numbers)
            if not _doc(obj):
                missing.append(f"{mod_name}.{name}")
            if inspect.isclass(obj):
                missing += [f"{mod_name}.{name}.{m} ({kind})" for m, kind, ok in _members(obj) if not ok]
    assert not missing, "no docstring: " + ", ".join(sorted(set(missing)))


def test_the_docstring_check_can_fail():
    class Undocumented:
        def method(self):
            pass

        @property
        def prop(self):
            return 1

    Undocumented.__module__ = "kvcache.example"
    assert {(m, ok) for m, _, ok in _members(Undocumented)} == {("method", False), ("prop", False)}
