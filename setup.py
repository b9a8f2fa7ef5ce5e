"""Build of kvcache's extensions: the C core in csrc/ plus the Cython bridge (kvcache._core), and
the benchmark's C-level workloads (kvcache_bench._bench, of the kvcache-bench project in benchmarks/).

Every object file (the C core's and each extension's) compiles in one pool of parallel jobs, the
Cython-generated files first since they take longest, with one line of progress per file.
Environment:

- KVCACHE_BUILD_JOBS: parallel compiler jobs (default: the CPU count, or `build_ext -j N`);
- KVCACHE_DEBUG_INFO=1: keep debug information (wheels are built without it and stripped);
- KVCACHE_SANITIZE: e.g. "address,undefined", a sanitized build (debug information kept);
- KVCACHE_BENCH=0: a build in place (`setup.py build_ext --inplace`) leaves kvcache_bench._bench
  out; otherwise it builds it beside its Python side, in benchmarks/kvcache_bench/ (run from
  the tree with `PYTHONPATH=src:benchmarks`). Other builds never do: the kvcache wheel holds
  the runtime only, and benchmarks/setup.py (`pip install ./benchmarks`) builds kvcache-bench
  with the definitions of this file;
- KVCACHE_BUILD_VERBOSE=1: setuptools' own log (every command line) instead of the summary.
"""
import glob
import logging
import os
import shutil
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))
CSRC = "csrc"
SANITIZE = os.environ.get("KVCACHE_SANITIZE", "")
DEBUG_INFO = os.environ.get("KVCACHE_DEBUG_INFO", "") == "1" or bool(SANITIZE)
BENCH_MODULE = "kvcache_bench._bench"
BENCH_PROJECT = "benchmarks"   # the kvcache-bench project: its package kvcache_bench lies in it

MSVC = sys.platform == "win32" and "GCC" not in sys.version
# The benchmark baseline needs C++14; some compilers default to an older standard (Apple
# clang: C++98), so every compiler is asked for C++17.
CXX_STD = "/std:c++17" if MSVC else "-std=c++17"

CYTHON_DIRECTIVES = {
    "language_level": 3,
    "boundscheck": False,
    "wraparound": False,
    "cdivision": True,
    "initializedcheck": False,
    "embedsignature": True,
    # every object with mutable state holds its own lock (src/kvcache/_core.pxd, "locking"):
    # safe without the GIL, which a free-threaded CPython must not re-enable
    "freethreading_compatible": True,
}


def compile_args():
    """(C core flags, linker flags)."""
    if MSVC:
        return ["/std:c11", "/O2", "/W3"], []
    # -pthread: large defrag moves run on several threads (POSIX threads; libpthread on older glibc)
    cflags = ["-std=c11", "-O3", "-Wall", "-Wextra", "-fno-strict-aliasing", "-pthread", "-fvisibility=hidden"]
    ldflags = ["-pthread"]
    if SANITIZE:
        cflags += ["-O1", "-g", "-fno-omit-frame-pointer", f"-fsanitize={SANITIZE}", "-fno-sanitize-recover=all"]
        ldflags += [f"-fsanitize={SANITIZE}"]
    elif not DEBUG_INFO:
        # Python's own CFLAGS usually carry -g: debug information is most of a shared object's
        # size (and of its compile time), so release builds drop it, and strip on Linux
        cflags.append("-g0")
        if sys.platform.startswith("linux"):
            ldflags.append("-s")
    return cflags, ldflags


CFLAGS, LDFLAGS = compile_args()
# the bridge is compiled with the core's flags less those Cython's output does not meet
CYTHON_CFLAGS = [f for f in CFLAGS if f not in ("-Wextra", "-std=c11", "/std:c11")]


def core_sources(root=""):
    return sorted(glob.glob(os.path.join(root, CSRC, "*.c")))


def extensions(root=""):
    """The extension modules, their paths relative to root (the project directory)."""
    csrc = os.path.join(root, CSRC)
    # the extensions link the core statically: a change to it must relink them
    depends = sorted(glob.glob(os.path.join(csrc, "*.[ch]")))
    core = Extension(
        "kvcache._core",
        sources=[os.path.join(root, "src/kvcache/_core.pyx")],
        include_dirs=[csrc],
        depends=depends,
        extra_compile_args=CYTHON_CFLAGS,
        extra_link_args=LDFLAGS,
    )
    # Benchmark-only: kvcache's C core next to a transcription of the reference's loops
    bench_dir = os.path.join(root, BENCH_PROJECT)
    bench = Extension(
        BENCH_MODULE,
        sources=[os.path.join(bench_dir, "kvcache_bench/_bench.pyx"), os.path.join(bench_dir, "baseline/kvc_baseline.cpp"),
                 os.path.join(bench_dir, "baseline/kvc_baseline2026.cpp")],
        include_dirs=[csrc, os.path.join(bench_dir, "baseline")],
        depends=depends,
        language="c++",
        extra_compile_args=CYTHON_CFLAGS + [CXX_STD],
        extra_link_args=LDFLAGS,
    )
    return [core, bench]


def _quiet_setuptools():
    """setuptools logs every command and copied file; with pip -v that buries the build. Only
    its warnings are shown (setuptools configures logging only where nothing else has)."""
    if os.environ.get("KVCACHE_BUILD_VERBOSE") == "1" or logging.root.handlers:
        return
    handler = logging.StreamHandler(sys.stderr)
    handler.setLevel(logging.WARNING)
    handler.setFormatter(logging.Formatter("{message}", style="{"))
    # PEP 517 builds never byte-compile; setuptools says so once per command
    handler.addFilter(lambda r: "byte-compiling is disabled" not in r.getMessage())
    logging.root.addHandler(handler)


def say(msg):
    print(f"kvcache build: {msg}", flush=True)


def _size(path):
    n = os.path.getsize(path)
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.0f} KiB"


class build_py_with_headers(build_py):
    """Ship the C headers inside the package (kvcache/include) for kvcache.get_include()."""

    def run(self):
        super().run()
        dst = os.path.join(self.build_lib, "kvcache", "include")
        os.makedirs(dst, exist_ok=True)
        for h in glob.glob(os.path.join(HERE, CSRC, "*.h")):
            shutil.copy(h, dst)


class build_ext_parallel(build_ext):
    """Cythonize, then compile the C core and the extensions' sources in one pool of jobs, archive
    the core, link each extension against it. An extension newer than its sources and
    dependencies is left alone (unless --force)."""

    root = ""

    def _wants(self, ext):
        """Whether to build ext: kvcache._core always, the bench extension in place (see
        KVCACHE_BENCH)."""
        if ext.name != BENCH_MODULE:
            return True
        return bool(self.inplace) and os.environ.get("KVCACHE_BENCH", "") != "0"

    def _get_inplace_equivalent(self, build_py, ext):
        # the bench extension's package is in benchmarks/, outside the src/ layout of kvcache's
        inplace_file, regular_file = super()._get_inplace_equivalent(build_py, ext)
        if ext.name == BENCH_MODULE:
            inplace_file = self._bench_inplace_path()
        return inplace_file, regular_file

    def get_ext_fullpath(self, ext_name):
        if self.inplace and ext_name == BENCH_MODULE:
            return self._bench_inplace_path()
        return super().get_ext_fullpath(ext_name)

    def _bench_inplace_path(self):
        *package, name = BENCH_MODULE.split(".")
        return os.path.join(self.root or HERE, BENCH_PROJECT, *package, self.get_ext_filename(name))

    def _jobs(self):
        env = os.environ.get("KVCACHE_BUILD_JOBS", "")
        if env.isdigit() and int(env) > 0:
            return int(env)
        if isinstance(self.parallel, int) and not isinstance(self.parallel, bool) and self.parallel > 0:
            return self.parallel
        return max(1, os.cpu_count() or 1)

    def run(self):
        from Cython.Build import cythonize
        from setuptools.modified import newer_group

        wanted = [e for e in self.extensions if self._wants(e)]
        if not wanted:
            self.extensions = []
            return
        t0 = time.monotonic()
        names = ", ".join(e.name for e in wanted)
        say(f"cythonizing {names}")
        t = time.monotonic()
        translated = cythonize(wanted, compiler_directives=CYTHON_DIRECTIVES,
                               include_path=[os.path.join(self.root, "src")], quiet=True)
        for ext, out in zip(wanted, translated):   # setuptools keeps its own fields on the originals
            assert ext.name == out.name
            ext.sources = out.sources
        self.extensions = wanted
        say(f"cythonized in {time.monotonic() - t:.0f} s")
        self._todo = [e for e in self.extensions
                      if self.force or newer_group(list(e.sources) + list(e.depends or []),
                                                   self.get_ext_fullpath(e.name), "newer")]
        self._t0 = t0
        if self.inplace:
            # setuptools copies each built extension into the tree: only those rebuilt
            self.extensions = self._todo
        super().run()

    def build_extensions(self):
        if not self._todo:
            say("up to date")
            return
        self.check_extensions_list(self._todo)
        cc = self.compiler
        lib_dir = os.path.join(self.build_temp, "kvcache-core")
        # (label, compile call) for every object; the long Cython outputs first
        tasks = []
        for src in core_sources(self.root):
            tasks.append((src, dict(sources=[src], output_dir=self.build_temp, include_dirs=[os.path.join(self.root, CSRC)],
                                    extra_postargs=CFLAGS)))
        ext_objects = {}
        for ext in self._todo:
            macros = list(ext.define_macros or []) + [(u,) for u in ext.undef_macros or []]
            ext_objects[ext.name] = cc.object_filenames(ext.sources, output_dir=self.build_temp)
            for src in ext.sources:
                tasks.append((src, dict(sources=[src], output_dir=self.build_temp, macros=macros,
                                        include_dirs=ext.include_dirs, extra_postargs=ext.extra_compile_args or [],
                                        depends=ext.depends)))
        tasks.sort(key=lambda t: -os.path.getsize(t[0]))
        jobs = min(self._jobs(), len(tasks))
        say(f"compiling {len(tasks)} files ({names_of(self._todo)} and the C core) with {jobs} parallel "
            f"job{'s' if jobs != 1 else ''}{'' if DEBUG_INFO else ', no debug information'}")
        lock = threading.Lock()
        done = [0]

        def compile_one(task):
            label, kw = task
            t = time.monotonic()
            cc.compile(debug=self.debug, **kw)
            with lock:
                done[0] += 1
                say(f"[{done[0]:{len(str(len(tasks)))}}/{len(tasks)}] {os.path.relpath(label, self.root or '.')} "
                    f"({time.monotonic() - t:.1f} s)")

        with ThreadPoolExecutor(max_workers=jobs) as pool:
            for f in [pool.submit(compile_one, t) for t in tasks]:
                f.result()   # the first compile error stops the build
        core_objects = cc.object_filenames(core_sources(self.root), output_dir=self.build_temp)
        cc.create_static_lib(core_objects, "kvc", output_dir=lib_dir, debug=self.debug)
        for ext in self._todo:
            path = self.get_ext_fullpath(ext.name)
            os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
            language = ext.language or cc.detect_language(ext.sources)
            cc.link_shared_object(
                ext_objects[ext.name], path,
                libraries=self.get_libraries(ext) + ["kvc"],
                library_dirs=[lib_dir] + list(ext.library_dirs or []),
                runtime_library_dirs=ext.runtime_library_dirs,
                extra_postargs=ext.extra_link_args or [],
                export_symbols=self.get_export_symbols(ext),
                debug=self.debug,
                build_temp=self.build_temp,
                target_lang=language,
            )
            say(f"linked {ext.name}: {_size(path)}{'' if DEBUG_INFO else ', stripped' if '-s' in LDFLAGS else ''}")
        say(f"done in {time.monotonic() - self._t0:.0f} s")


def names_of(exts):
    return ", ".join(e.name for e in exts)


if __name__ == "__main__":
    _quiet_setuptools()
    setup(
        ext_modules=extensions(),
        cmdclass={"build_py": build_py_with_headers, "build_ext": build_ext_parallel},
    )
