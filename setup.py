"""Build of the kvcache._core extension: the C core in csrc/ plus the Cython bridge."""
import glob
import os
import shutil
import sys

from setuptools import Extension, setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
CSRC = "csrc"
SANITIZE = os.environ.get("KVCACHE_SANITIZE", "")  # e.g. "address,undefined"


def compile_args():
    if sys.platform == "win32" and "GCC" not in sys.version:
        return ["/std:c11", "/O2", "/W3"], []
    cflags = ["-std=c11", "-O3", "-Wall", "-Wextra", "-fno-strict-aliasing"]
    ldflags = []
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


cflags, ldflags = compile_args()
ext = Extension(
    "kvcache._core",
    sources=["src/kvcache/_core.pyx"] + sorted(glob.glob(os.path.join(CSRC, "*.c"))),
    include_dirs=[CSRC],
    extra_compile_args=cflags,
    extra_link_args=ldflags,
    define_macros=[("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION")],
)

from Cython.Build import cythonize  # noqa: E402

setup(
    ext_modules=cythonize(
        [ext],
        compiler_directives={
            "language_level": 3,
            "boundscheck": False,
            "wraparound": False,
            "cdivision": True,
            "initializedcheck": False,
            "embedsignature": True,
        },
        include_path=["src"],
    ),
    cmdclass={"build_py": build_py_with_headers},
)
