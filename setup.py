"""Build of the kvcache._core extension: the C core in csrc/ plus the Cython bridge."""
import glob
import os
import shutil
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
CSRC = "csrc"
SANITIZE = os.environ.get("KVCACHE_SANITIZE", "")  # e.g. "address,undefined"


MSVC = sys.platform == "win32" and "GCC" not in sys.version
# The benchmark baseline needs C++14; some compilers default to an older standard (Apple
# clang: C++98), so every compiler is asked for C++17.
CXX_STD = "/std:c++17" if MSVC else "-std=c++17"


def compile_args():
    if MSVC:
        return ["/std:c11", "/O2", "/W3"], []
    # -pthread: large defrag moves run on several threads (POSIX threads; libpthread on older glibc)
    cflags = ["-std=c11", "-O3", "-Wall", "-Wextra", "-fno-strict-aliasing", "-pthread"]
    ldflags = ["-pthread"]
    if SANITIZE:
        cflags += ["-O1", "-g", "-fno-omit-frame-pointer", f"-fsanitize={SANITIZE}", "-fno-sanitize-recover=all"]
        ldflags += [f"-fsanitize={SANITIZE}"]
    return cflags, ldflags


class build_py_with_headers(build_py):
    """Ship the C headers inside the package (kvcache/include) for kvcache.get_include()."""

    def run(self):
        super().run()
        dst = os.path.join(self.build_lib, "kvcache", "include")
        os.makedirs(dst, exist_ok=True)
        for h in glob.glob(os.path.join(HERE, CSRC, "*.h")):
            shutil.copy(h, dst)


class build_ext_with_core(build_ext):
    """Build the static C core first, also for `build_ext --inplace`."""

    def run(self):
        self.run_command("build_clib")
        super().run()


cflags, ldflags = compile_args()
# The C core is built once, as a static library with its own strict flags, and linked into
# every extension.
core_lib = ("kvc", {"sources": sorted(glob.glob(os.path.join(CSRC, "*.c"))), "include_dirs": [CSRC], "cflags": cflags})
cython_cflags = [f for f in cflags if f not in ("-Wextra", "-std=c11", "/std:c11")]
# the extensions link the core statically: a change to it must relink them
core_depends = sorted(glob.glob(os.path.join(CSRC, "*.[ch]")))
ext = Extension(
    "kvcache._core",
    sources=["src/kvcache/_core.pyx"],
    include_dirs=[CSRC],
    libraries=["kvc"],
    depends=core_depends,
    extra_compile_args=cython_cflags,
    extra_link_args=ldflags,
)

# Benchmark-only extension: kvcache's C core next to a transcription of the seed's loops.
bench = Extension(
    "kvcache._bench",
    sources=["src/kvcache/_bench.pyx", "benchmarks/baseline/kvc_baseline.cpp"],
    include_dirs=[CSRC, "benchmarks/baseline"],
    libraries=["kvc"],
    depends=core_depends,
    language="c++",
    extra_compile_args=cython_cflags + [CXX_STD],
    extra_link_args=ldflags,
)

from Cython.Build import cythonize  # noqa: E402

setup(
    libraries=[core_lib],
    ext_modules=cythonize(
        [ext, bench],
        compiler_directives={
            "language_level": 3,
            "boundscheck": False,
            "wraparound": False,
            "cdivision": True,
            "initializedcheck": False,
            "embedsignature": True,
            # every object with mutable state holds its own lock (src/kvcache/_core.pxd,
            # "locking"): safe without the GIL, which a free-threaded CPython must not re-enable
            "freethreading_compatible": True,
        },
        include_path=["src"],
    ),
    cmdclass={"build_py": build_py_with_headers, "build_ext": build_ext_with_core},
)
