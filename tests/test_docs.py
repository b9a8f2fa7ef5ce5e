"""The documentation in docs/ stays true: its Python examples run, print what their comments
say and emit no warning, its excerpts are taken from the files they name, the names its
llama.cpp table points to exist, the server-loop example runs and checks itself, and the README
leads to it.

What an example prints is stated, where it is stated, in a comment on the print (in the Python
blocks of docs/*.md, README.md's first example and docs/examples/server_loop.py):

- the comment after the line where the ``print(...)`` call ends (``print(n, k.shape)  # 14 (2,
  14, 16)``) or, when that line has none, the comment lines right below the print at its
  indentation (for a long output; they read as one line);
- the comment holds when it is what one run of the print wrote, runs of whitespace (line breaks
  included) counting as one space; it may go on with ``: `` and a remark (``# 5: the first
  cell``), and then holds when the output is the text before one of its ``: ``;
- ``...`` in a comment stands for any text: output that changes from run to run (timings,
  addresses) is written as ``...``;
- a print that runs several times (in a loop) is compared with its outputs joined by ``, ``;
- a print without a comment is not checked; a commented print that never runs fails. A remark
  about a print that is not its output goes on the line above the print.

The examples run with warnings as errors, so an example that warns (a deprecated keyword, say)
fails. A block marked ``needs: module ...`` is skipped when one of the modules is missing or
older than the version a ``module>=version`` asks for.
"""
import ast
import contextlib
import importlib
import importlib.metadata
import importlib.util
import io
import re
import subprocess
import sys
import tokenize
import warnings

import pytest
from packaging.version import Version

import kvcache
from conftest import EXPECTED, MODULE_STAGE, REPO, kvcache_env, need

DOCS = REPO / "docs"
PAGES = sorted(p.name for p in DOCS.glob("*.md"))
EXAMPLE = DOCS / "examples" / "server_loop.py"

# a fenced block, with the HTML comment on the line before it when there is one
_BLOCK = re.compile(r"(?:<!--(?P<marker>[^\n]*?)-->\n)?```(?P<lang>[\w-]*)\n(?P<code>.*?)```", re.S)


def _blocks(text: str):
    """(marker, language, code, line of the code's first line) of each fenced block of text."""
    for m in _BLOCK.finditer(text):
        yield ((m.group("marker") or "").strip(), m.group("lang"), m.group("code"),
               text.count("\n", 0, m.start("code")) + 1)


def _page_blocks(page: str):
    return _blocks((DOCS / page).read_text(encoding="utf-8"))


def _unmet(marker: str) -> list[str]:
    """The requirements of a ``needs: module module>=version ...`` marker this environment lacks."""
    unmet = []
    for wanted in marker.removeprefix("needs:").split():
        module, _, least = wanted.partition(">=")
        if importlib.util.find_spec(module) is None or (
                least and Version(importlib.metadata.version(module)) < Version(least)):
            unmet.append(wanted)
    return unmet


def _print_comments(source: str) -> dict[int, tuple[int, str]]:
    """{each line of a print call that states its output: (the print's first line, the comment)}."""
    lines = source.splitlines()
    comments = {t.start[0]: t.string[1:].strip()
                for t in tokenize.generate_tokens(io.StringIO(source).readline) if t.type == tokenize.COMMENT}
    stated = {}
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Expr) and isinstance(node.value, ast.Call)
                and isinstance(node.value.func, ast.Name) and node.value.func.id == "print"):
            continue
        said = [comments[node.end_lineno]] if node.end_lineno in comments else []
        below = node.end_lineno if not said else len(lines)     # 0-based: the line after the call
        while below < len(lines) and lines[below].strip().startswith("#") \
                and len(lines[below]) - len(lines[below].lstrip()) == node.col_offset:
            said.append(comments[below + 1])
            below += 1
        if said:
            for n in range(node.lineno, node.end_lineno + 1):
                stated[n] = (node.lineno, " ".join(said))
    return stated


def _says(comment: str, output: str) -> bool:
    """Whether a print's comment states its output (the rules of the module's docstring)."""
    comment, output = " ".join(comment.split()), " ".join(output.split())
    heads = [comment] + [comment[:m.start()] for m in re.finditer(": ", comment)]
    return any(re.fullmatch(".*?".join(map(re.escape, head.split("..."))), output) for head in heads)


class _Prints:
    """Stands in for ``print`` in an example's namespace: prints as print does, and keeps what
    each print that states its output wrote, to compare with its comment."""

    def __init__(self, filename: str):
        self.filename = filename
        self.stated: dict[int, tuple[int, str]] = {}
        self.outputs: dict[int, list[str]] = {}

    def add(self, source: str) -> None:
        """Takes the commented prints of source (compiled with this filename, at its own lines)."""
        self.stated.update(_print_comments(source))

    def __call__(self, *args, **kwargs):
        caller = sys._getframe(1)
        where = self.stated.get(caller.f_lineno) if caller.f_code.co_filename == self.filename else None
        if where is None or kwargs.get("file") is not None:
            return print(*args, **kwargs)
        out = io.StringIO()
        print(*args, **{**kwargs, "file": out})
        self.outputs.setdefault(where[0], []).append(out.getvalue())
        sys.stdout.write(out.getvalue())

    def disagreements(self, name: str) -> list[str]:
        """One line per commented print whose output is not what its comment says."""
        wrong = []
        for line, comment in sorted(set(self.stated.values())):
            if line not in self.outputs:
                wrong.append(f"{name}:{line}: the print never ran; its comment says {comment!r}")
                continue
            output = ", ".join(" ".join(o.split()) for o in self.outputs[line])
            if not _says(comment, output):
                wrong.append(f"{name}:{line}: prints {output!r}; the comment says {comment!r}")
        return wrong


@contextlib.contextmanager
def _checked(prints: _Prints, name: str):
    """Runs an example with warnings as errors, then fails naming each print that disagrees
    with its comment."""
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        yield
    wrong = prints.disagreements(name)
    if wrong:
        raise AssertionError("\n".join(wrong))


def _run_blocks(path, blocks, namespace: dict) -> tuple[int, int]:
    """Runs the Python blocks of a page (path, with its ``_blocks``) in order in namespace, checked
    (``_checked``); (blocks run, blocks skipped for a missing module)."""
    prints = namespace["print"] = _Prints(str(path))
    ran = missing = 0
    with _checked(prints, path.relative_to(REPO).as_posix() if path.is_relative_to(REPO) else path.name):
        for marker, lang, code, line in blocks:
            if lang != "python" or marker.startswith(("not run", "excerpt")):
                continue
            unmet = _unmet(marker) if marker.startswith("needs:") else []
            for req in unmet:      # what CI installed must not pass as missing
                stage = MODULE_STAGE.get(re.split("[<>=]", req)[0], "test")
                if stage in EXPECTED:
                    need(stage, f"{path.name}, line {line}: the block needs {req}")
            if unmet:
                missing += 1
                continue
            code = "\n" * (line - 1) + code        # the page's line numbers in tracebacks and messages
            prints.add(code)
            exec(compile(code, str(path), "exec"), namespace)
            ran += 1
    return ran, missing


def test_the_pages_exist():
    for page in ("index.md", "quickstart.md", "buffers.md", "server-loop.md", "state.md", "cimport.md", "cli.md",
                 "llama-cpp-api.md", "torch.md"):
        assert page in PAGES


@pytest.mark.parametrize("page", PAGES)
def test_python_examples_run(page, tmp_path, monkeypatch):
    """The Python blocks of a page run in order in one namespace (from a scratch directory, as
    they may write files) and print what they say; blocks marked ``not run`` or ``excerpt`` are
    skipped, and so are blocks marked ``needs: ...`` when this environment lacks what they need."""
    monkeypatch.chdir(tmp_path)
    ran, missing = _run_blocks(DOCS / page, _page_blocks(page), {"__name__": f"docs_{page}"})
    # reference pages (the command line, the API table, the contributors' fuzzing and architecture notes) and
    # design pages (of parts without a Python API yet) hold shell commands and tables rather
    # than Python
    if page not in ("index.md", "cli.md", "llama-cpp-api.md", "fuzzing.md", "architecture.md",
                    "prefix-reuse.md"):
        assert ran or missing, f"{page} has no runnable example"
    if missing and not ran:
        pytest.skip(f"{page}: its examples need modules this environment lacks")


def _readme_example() -> list:
    text = (REPO / "README.md").read_text(encoding="utf-8")
    section = text.index("\n## A first example\n")
    blocks = [b for b in _blocks(text) if b[3] > text.count("\n", 0, section) and b[1] == "python"]
    return blocks[:1]


def test_readme_example_runs(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert _run_blocks(REPO / "README.md", _readme_example(), {"__name__": "docs_readme"}) == (1, 0)


def _run_page(tmp_path, code: str) -> tuple[int, int]:
    page = tmp_path / "page.md"
    page.write_text(f"A page.\n\n```python\n{code}```\n", encoding="utf-8")
    return _run_blocks(page, _blocks(page.read_text(encoding="utf-8")), {})


def test_comments_state_the_output_by_the_documented_rules(tmp_path, capsys):
    assert _run_page(tmp_path, (
        "import numpy as np\n"
        "x = 14\n"
        "print(x, (2, x, 16))                # 14 (2, 14, 16)\n"
        "print(x + 1)                        # 15: one more\n"
        "print(np.arange(24).reshape(2, 12))\n"
        "# [[ 0  1  2  3  4  5  6  7  8  9 10 11]\n"
        "#  [12 13 14 15 16 17 18 19 20 21 22 23]]\n"
        "print(object())                     # <object object at ...>\n"
        "for i in range(3):\n"
        "    print(i, i * i)                 # 0 0, 1 1, 2 4\n"
        "print('a: b')                       # a: b: the remark may follow an output with a colon\n"
        "print(x)\n"
        "print(\n"
        "    x)                              # 14\n")) == (1, 0)
    assert "14 (2, 14, 16)\n15\n" in capsys.readouterr().out      # the prints still print


@pytest.mark.parametrize("code, message", [
    ("x = 14\nprint(x + 1)        # 14: one more\n", "page.md:5: prints '15'; the comment says '14: one more'"),
    ("print(1)\n# 2\n", "page.md:4: prints '1'; the comment says '2'"),
    ("for i in range(2):\n    print(i)    # 0\n", "page.md:5: prints '0, 1'; the comment says '0'"),
    ("if False:\n    print(1)    # 1\n", "page.md:5: the print never ran; its comment says '1'"),
])
def test_a_wrong_comment_fails_naming_the_page_the_line_and_both_texts(tmp_path, code, message):
    with pytest.raises(AssertionError) as err:
        _run_page(tmp_path, code)
    assert str(err.value) == message


def test_an_example_that_warns_fails(tmp_path):
    with pytest.raises(FutureWarning, match="renamed"):
        _run_page(tmp_path, "import warnings\nwarnings.warn('renamed', FutureWarning)\n")


def test_needs_markers_name_modules_and_least_versions():
    assert _unmet("needs: pytest") == []
    assert _unmet("needs: pytest>=1.0 no_such_module") == ["no_such_module"]
    assert _unmet(f"needs: pytest>={int(pytest.__version__.split('.')[0]) + 1}") == [
        f"pytest>={int(pytest.__version__.split('.')[0]) + 1}"]


@pytest.mark.parametrize("page", PAGES)
def test_excerpts_come_from_their_files(page):
    for marker, _, code, _ in _page_blocks(page):
        if not marker.startswith("excerpt:"):
            continue
        source = (DOCS / marker.split(":", 1)[1].strip()).resolve()
        have = {line.strip() for line in source.read_text(encoding="utf-8").splitlines()}
        for line in code.splitlines():
            assert not line.strip() or line.strip() in have, f"{page}: {line.strip()!r} is not in {source.name}"


def test_every_marked_block_says_why():
    for page in PAGES:
        for marker, _, _, _ in _page_blocks(page):
            if marker.startswith("not run"):
                assert marker.startswith("not run: ") and len(marker) > len("not run: "), (page, marker)


def _load_example():
    spec = importlib.util.spec_from_file_location("server_loop_example", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod        # its dataclasses look their module up
    try:
        spec.loader.exec_module(mod)
    finally:
        del sys.modules[spec.name]
    return mod


def test_server_loop_example_runs_as_a_program(tmp_path):
    res = subprocess.run([sys.executable, str(EXAMPLE)], cwd=tmp_path, env=kvcache_env(), capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert "every output checked" in res.stdout


def test_server_loop_example_reuses_cells_checks_outputs_and_prints_what_it_says():
    mod = _load_example()
    mod.print = prints = _Prints(str(EXAMPLE))
    prints.add(EXAMPLE.read_text(encoding="utf-8"))
    with _checked(prints, EXAMPLE.relative_to(REPO).as_posix()):
        stats = mod.main()
    # more tokens went through the cache than it has cells: finished requests' cells were reused
    assert stats["tokens"] > 128 and stats["max_used"] <= 128
    assert stats["ubatches"] > stats["steps"]       # batches were split into several ubatches
    # later requests started from the system prompt earlier ones left in the prefix index
    assert stats["reused"] >= 8 and stats["held"] > 0


def test_only_the_examples_run_here_state_their_output():
    """The other examples (the hand-off ones) run in their own processes, where a stated output
    would go unchecked; what they print (timings) changes from run to run anyway."""
    for path in sorted((DOCS / "examples").glob("*.py")):
        if path != EXAMPLE:
            stated = _print_comments(path.read_text(encoding="utf-8"))
            assert not stated, f"{path.name}:{min(stated)}: states an output no test checks"


def test_server_loop_example_check_can_fail():
    mod = _load_example()
    r = mod.Request(tokens=[1, 2, 3, 4], n_prompt=3, max_new=1)
    mod.serve([r])
    mod.check(r)
    pos, out = r.outputs[-1]
    r.outputs[-1] = (pos, out + 1e-3)
    with pytest.raises(AssertionError):
        mod.check(r)


def test_server_loop_example_reports_a_full_cache():
    mod = _load_example()
    with pytest.raises(MemoryError, match="no room"):
        mod.serve([mod.Request(tokens=list(range(20)) * 3, n_prompt=60, max_new=1)], kv_size=32, n_batch=64)


# --- the llama.cpp table --------------------------------------------------------------------------

def _resolve(name: str):
    obj = kvcache
    path = "kvcache"
    for part in name.split("."):
        path = f"{path}.{part}"
        if hasattr(obj, part):
            obj = getattr(obj, part)
        else:
            obj = importlib.import_module(path)
    return obj


def _table_rows(page: str):
    for line in (DOCS / page).read_text(encoding="utf-8").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("|") and len(cells) >= 2 and not set(cells[0]) <= set("-: ") and cells[0] != "llama.cpp":
            yield cells


def test_llama_cpp_table_points_to_names_that_exist():
    names = []
    for cells in _table_rows("llama-cpp-api.md"):
        found = re.findall(r"`([A-Za-z_][\w.]*)`", cells[1])
        assert found, f"no kvcache name in {cells}"
        names += found
    for name in names:
        _resolve(name)      # AttributeError / ImportError when the docs name something that is not there
    assert len(names) > 50


def test_llama_cpp_table_covers_the_c_api():
    llama = " ".join(cells[0] for cells in _table_rows("llama-cpp-api.md"))
    for fn in ("llama_memory_clear", "llama_kv_self_clear", "llama_memory_seq_rm", "llama_kv_self_seq_rm",
               "llama_memory_seq_cp", "llama_memory_seq_keep", "llama_memory_seq_add", "llama_memory_seq_div",
               "llama_memory_seq_pos_min", "llama_memory_seq_pos_max", "llama_kv_self_seq_pos_max",
               "llama_memory_can_shift", "llama_kv_self_can_shift", "llama_kv_self_update", "llama_kv_self_defrag",
               "llama_state_seq_get_size", "llama_state_seq_get_data", "llama_state_seq_set_data",
               "llama_state_seq_save_file", "llama_state_seq_load_file", "llama_state_get_data",
               "llama_state_set_data", "llama_state_save_file", "llama_state_load_file"):
        assert f"`{fn}`" in llama, fn


def test_the_name_check_can_fail():
    with pytest.raises((AttributeError, ImportError)):
        _resolve("UnifiedCache.seq_remove")


# --- navigation ---------------------------------------------------------------------------------

def test_cli_page_has_a_section_per_command():
    from kvcache.cli import commands

    text = (DOCS / "cli.md").read_text(encoding="utf-8")
    for name in commands():
        assert f"## `kvcache {name}`" in text, name


def test_index_links_every_page_and_links_resolve():
    index = (DOCS / "index.md").read_text(encoding="utf-8")
    for page in PAGES:
        if page != "index.md":
            assert f"({page})" in index, page
    for page in PAGES:
        text = (DOCS / page).read_text(encoding="utf-8")
        for target in re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text):
            if "://" not in target:
                assert (DOCS / target).exists(), f"{page} links to {target}, which does not exist"


def test_readme_keeps_its_commands_and_links_the_docs():
    readme = (REPO / "README.md").read_text(encoding="utf-8")
    first = readme.split("```sh", 1)[1].split("```", 1)[0].strip().splitlines()
    assert first[0].startswith("python3 -m venv .venv") and re.search(r"pip install (-v )?\. ", first[0])
    assert first[0].endswith("kvcache demo")
    # the daily test command: .ci/run's quick path, with the time it takes here
    assert first[1].startswith("bash .ci/run --quick") and re.search(r"\d+ minutes", first[1])
    assert "(docs/index.md)" in readme
    for page in PAGES:
        if page != "index.md":
            assert f"(docs/{page})" in readme, page


def _texts():
    for path in [REPO / "README.md", REPO / "benchmarks" / "README.md", *sorted(DOCS.glob("*.md")),
                 *sorted((REPO / "src" / "kvcache").rglob("*.py"))]:
        yield path, path.read_text(encoding="utf-8")


def test_install_commands_work_today_and_in_any_shell():
    """No release is on PyPI yet: the docs install from the clone; extras are quoted (zsh reads
    unquoted brackets as a pattern)."""
    for path, text in _texts():
        for n, line in enumerate(text.splitlines(), 1):
            for cmd in re.findall(r"pip install [^`\n)]*", line):
                assert not re.search(r"(^|\s)[^\s'\"]*\[", cmd.split("pip install", 1)[1]), \
                    f"{path}:{n}: unquoted brackets: {cmd}"
                # (the hints of error messages name the extra as it will be once released)
                if "released" not in line and path.suffix == ".md":
                    assert not re.search(r"pip install ['\"]?kvcache\b(?!-)", cmd), f"{path}:{n}: {cmd}"


def test_cli_page_says_what_demo_runs():
    from kvcache.demo import run_demo

    runs = run_demo(steps=1).runs
    section = (DOCS / "cli.md").read_text(encoding="utf-8").split("## `kvcache demo`", 1)[1].split("\n## ", 1)[0]
    words = {2: "two", 3: "three", 4: "four"}
    assert f"runs {words[len(runs)]} configurations" in section
    assert ("ISWACache" in section) == any(r.swa is not None for r in runs)
