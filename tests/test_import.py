"""What ``import kvcache`` gives: the runtime only (the bench, the reference models and the
conformance runner live elsewhere), its public names all in ``__all__``, and a package docstring
that says what to read first."""
import pydoc
import subprocess
import sys
import types

import kvcache
from conftest import kvcache_env

# Top-level modules an import of kvcache must not load: the tools that live beside it (the
# kvcache-bench distribution, the test suite's models and runner) and what only optional
# features or the tools import.
NOT_LOADED = {"kvcache_bench", "reference", "reference2026", "conformance", "matplotlib", "torch", "transformers",
              "ray", "nixl", "hypothesis", "pytest", "gguf", "tqdm", "llama_cpp"}
# kvcache's own modules that only their users load
NOT_LOADED_SUBMODULES = ("kvcache.cli", "kvcache.integrations")


def test_import_loads_the_runtime_only(tmp_path):
    code = "import sys, kvcache; print('\\n'.join(sorted(sys.modules)))"
    r = subprocess.run([sys.executable, "-c", code], env=kvcache_env(), cwd=tmp_path, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    loaded = r.stdout.split()
    assert "kvcache._core" in loaded
    extra = [m for m in loaded if m.split(".")[0] in NOT_LOADED
             or any(m == s or m.startswith(s + ".") for s in NOT_LOADED_SUBMODULES)]
    assert not extra, f"import kvcache loaded {extra}"


def test_all_is_the_public_names():
    """``kvcache.__all__`` lists every public name ``dir(kvcache)`` shows, submodules aside, and
    nothing else (``__version__`` besides)."""
    public = {n for n in dir(kvcache) if not n.startswith("_") and not isinstance(getattr(kvcache, n), types.ModuleType)}
    assert len(kvcache.__all__) == len(set(kvcache.__all__)), "a name is listed twice"
    assert set(kvcache.__all__) - {"__version__"} == public


def test_help_starts_with_what_to_read_first():
    first = kvcache.__doc__.split("\n\n")[1]
    assert "README.md" in first and "docs/quickstart.md" in first
    text = pydoc.render_doc(kvcache, renderer=pydoc.plaintext)
    assert text.index("Read first") < text.index("PACKAGE CONTENTS") < text.index("CLASSES")
