"""The C core's includes follow its layers (csrc/LAYERS): a file includes only headers of its own
layer or below, and no chain of includes comes back to where it started. A module is a header and
the .c file of the same name, so a .c that includes a header which includes the .c's own header
is a cycle too. The checks are plain functions of an include graph, so that the tests below can
feed them graphs that must fail."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CSRC = ROOT / "csrc"
LAYERS_FILE = CSRC / "LAYERS"
INCLUDE = re.compile(r'^\s*#\s*include\s+"([^"]+)"', re.M)


def read_layers(text: str) -> dict[str, int]:
    """Module -> layer index (0 at the bottom) from the lines ``name: module module ...``."""
    layer_of: dict[str, int] = {}
    index = 0
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        name, sep, modules = line.partition(":")
        assert sep and name.strip() and modules.split(), f"csrc/LAYERS: a layer is 'name: modules', not {line!r}"
        for m in modules.split():
            assert m not in layer_of, f"csrc/LAYERS lists {m} twice"
            layer_of[m] = index
        index += 1
    return layer_of


def include_graph(csrc: Path) -> dict[str, set[str]]:
    """Module -> the modules its header and its .c include (quoted includes of csrc's own headers)."""
    headers = {p.stem for p in csrc.glob("*.h")}
    graph: dict[str, set[str]] = {}
    for p in sorted(csrc.glob("*.[ch]")):
        deps = graph.setdefault(p.stem, set())
        for name in INCLUDE.findall(p.read_text(encoding="utf-8")):
            stem = Path(name).stem
            if stem in headers and stem != p.stem:
                deps.add(stem)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of the graph as the modules along it (first == last), or None."""
    state: dict[str, int] = {}   # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        path.append(m)
        for d in sorted(graph.get(m, ())):
            if state.get(d) == 1:
                return path[path.index(d):] + [d]
            if d not in state:
                found = visit(d)
                if found:
                    return found
        path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state:
            found = visit(m)
            if found:
                return found
    return None


def upward_includes(graph: dict[str, set[str]], layer_of: dict[str, int]) -> list[str]:
    """Every include of a higher layer's module, as 'module (layer) includes module (layer)'."""
    return [f"{m} (layer {layer_of[m]}) includes {d} (layer {layer_of[d]})"
            for m in sorted(graph) for d in sorted(graph[m])
            if m in layer_of and d in layer_of and layer_of[d] > layer_of[m]]


def test_every_module_has_a_layer():
    layer_of = read_layers(LAYERS_FILE.read_text(encoding="utf-8"))
    modules = set(include_graph(CSRC))
    missing = sorted(modules - set(layer_of))
    assert not missing, f"modules in no layer of csrc/LAYERS (add each to the layer it belongs to): {missing}"
    gone = sorted(set(layer_of) - modules)
    assert not gone, f"csrc/LAYERS lists modules csrc/ does not have: {gone}"


def test_no_include_cycle():
    cycle = find_cycle(include_graph(CSRC))
    assert cycle is None, "an include cycle in csrc/: " + " -> ".join(cycle or [])


def test_no_layer_includes_a_higher_one():
    layer_of = read_layers(LAYERS_FILE.read_text(encoding="utf-8"))
    bad = upward_includes(include_graph(CSRC), layer_of)
    assert not bad, "includes against csrc/LAYERS' order:\n" + "\n".join(bad)


# --- the checks fail where they must ---------------------------------------------------------


def test_a_cycle_is_found(tmp_path):
    (tmp_path / "a.h").write_text('#include "b.h"\n')
    (tmp_path / "b.h").write_text('#include "c.h"\n')
    (tmp_path / "c.h").write_text("\n")
    (tmp_path / "c.c").write_text('#include "c.h"\n#include "a.h"\n')   # a .c counts as its header
    cycle = find_cycle(include_graph(tmp_path))
    assert cycle is not None and cycle[0] == cycle[-1] and set(cycle) == {"a", "b", "c"}
    (tmp_path / "c.c").write_text('#include "c.h"\n')
    assert find_cycle(include_graph(tmp_path)) is None


def test_an_upward_include_is_found(tmp_path):
    (tmp_path / "low.h").write_text('#include "high.h"\n')
    (tmp_path / "high.h").write_text("\n")
    layer_of = read_layers("bottom: low\ntop: high  # comment\n")
    assert upward_includes(include_graph(tmp_path), layer_of) == ["low (layer 0) includes high (layer 1)"]
    assert upward_includes(include_graph(tmp_path), read_layers("one: low high\n")) == []


def test_a_malformed_layers_file_is_refused():
    with pytest.raises(AssertionError, match="twice"):
        read_layers("a: x\nb: x\n")
    with pytest.raises(AssertionError, match="name: modules"):
        read_layers("just words\n")


# --- the wire format has one home -------------------------------------------------------------

FORMAT_HOME = "docs/format.md"
DOC_PATH = re.compile(r"(?<![\w/.])((?:tests/)?golden/[\w.-]+\.md|docs/[\w.-]+\.md)")


def _pointer_sources():
    yield from sorted(CSRC.glob("*.[ch]"))
    yield from sorted((ROOT / "src" / "kvcache").rglob("*.py*"))
    yield ROOT / "CONTRIBUTING.md"


def test_the_state_code_points_to_the_one_description_of_the_bytes():
    assert (ROOT / FORMAT_HOME).is_file()
    for name in ("csrc/kvc_layout.h", "csrc/kvc_section.h", "csrc/kvc_state.h", "csrc/kvc_state_write.h",
                 "src/kvcache/statefile.py"):
        assert FORMAT_HOME in (ROOT / name).read_text(encoding="utf-8"), f"{name} does not name {FORMAT_HOME}"


def test_every_document_the_code_names_exists():
    for path in _pointer_sources():
        for name in DOC_PATH.findall(path.read_text(encoding="utf-8")):
            target = ROOT / ("tests/" + name if name.startswith("golden/") else name)
            assert target.is_file(), f"{path.relative_to(ROOT)} names {name}, which does not exist"
