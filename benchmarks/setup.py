"""Build of kvcache-bench: the package kvcache_bench (the cases of `kvcache bench`) and its
extension kvcache_bench._bench, defined and built by the project's setup.py (one definition for
both), into a wheel of its own. Its version is kvcache's, which it requires exactly: the
extension is compiled against the C core and the cimport contract of that version."""
import os
import re
import runpy

from setuptools import setup

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
if not os.path.isfile(os.path.join(ROOT, "setup.py")) or not os.path.isdir(os.path.join(ROOT, "csrc")):
    raise SystemExit("kvcache-bench builds from a clone of kvcache: pip install ./benchmarks in the clone")

kv = runpy.run_path(os.path.join(ROOT, "setup.py"), run_name="kvcache_setup")
with open(os.path.join(ROOT, "pyproject.toml"), encoding="utf-8") as f:
    VERSION = re.search(r'^version = "([^"]+)"', f.read(), re.M).group(1)


class build_bench(kv["build_ext_parallel"]):
    """Only kvcache_bench._bench, into the wheel (not only in place as kvcache's build does)."""

    root = ROOT

    def _wants(self, ext):
        return True


if __name__ == "__main__":
    kv["_quiet_setuptools"]()
    setup(
        version=VERSION,
        install_requires=[f"kvcache=={VERSION}"],
        ext_modules=[e for e in kv["extensions"](ROOT) if e.name == kv["BENCH_MODULE"]],
        cmdclass={"build_ext": build_bench},
    )
