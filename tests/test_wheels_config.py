"""The wheel build configuration agrees with itself: pyproject.toml's [tool.cibuildwheel], the
wheels workflow that runs it, the package metadata and the CI script that checks a wheel here."""
import os
import re
import shutil
import subprocess
import sys

import pytest

from conftest import REPO, need_module

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    tomllib = need_module("test", "tomli")   # pytest needs it there

yaml = need_module("test", "yaml")   # PyYAML comes with the gguf package of the test extra

PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
CIBW = PYPROJECT["tool"]["cibuildwheel"]
WORKFLOW_TEXT = (REPO / ".github" / "workflows" / "wheels.yml").read_text(encoding="utf-8")
WORKFLOW = yaml.safe_load(WORKFLOW_TEXT)
PYTHONS = ["3.10", "3.11", "3.12", "3.13", "3.14"]


def test_build_selection_is_cpython_310_to_314_and_314t():
    want = {f"cp{v.replace('.', '')}-*" for v in PYTHONS} | {"cp314t-*"}
    assert set(CIBW["build"]) == want
    assert PYPROJECT["project"]["requires-python"] == ">=3.10"
    classifiers = PYPROJECT["project"]["classifiers"]
    for v in PYTHONS:
        assert f"Programming Language :: Python :: {v}" in classifiers


def test_platforms_architectures_and_images():
    assert CIBW["linux"]["archs"] == ["x86_64", "aarch64"]
    assert CIBW["macos"]["archs"] == ["x86_64", "arm64"]
    assert CIBW["windows"]["archs"] == ["AMD64"]
    assert CIBW["manylinux-x86_64-image"] == CIBW["manylinux-aarch64-image"] == "manylinux_2_28"
    assert CIBW["musllinux-x86_64-image"] == "musllinux_1_2"
    assert CIBW["skip"] == ["*-musllinux_aarch64"]


def test_wheels_are_tested_as_installed():
    cmd = CIBW["test-command"]
    assert re.fullmatch(r"python -m pytest .*\{project\}/tests", cmd), cmd
    # cibuildwheel runs it from a scratch directory; the suite asserts it imported the wheel
    assert "test-sources" not in CIBW
    assert CIBW["test-environment"] == {"KVCACHE_EXPECT_INSTALLED": "1"}
    assert CIBW["test-extras"] == ["test"]
    for override in CIBW.get("overrides", []):
        # where the full extra cannot install, the test runner itself still does
        if "test-requires" in override:
            assert any(r.startswith("pytest") for r in override["test-requires"])


def test_the_workflow_builds_every_platform_of_the_configuration():
    jobs = WORKFLOW["jobs"]
    matrix = jobs["wheels"]["strategy"]["matrix"]["include"]
    built = {(m["platform"], m["archs"]) for m in matrix}
    want = {(p, a) for p in ("linux", "macos", "windows") for a in CIBW[p]["archs"]}
    assert built == want
    step = next(s for s in jobs["wheels"]["steps"] if str(s.get("uses", "")).startswith("pypa/cibuildwheel@"))
    env = step.get("env", {})
    # the selection of Pythons, images and tests stays in pyproject.toml
    assert set(env) == {"CIBW_PLATFORM", "CIBW_ARCHS"}
    assert env["CIBW_ARCHS"] == "${{ matrix.archs }}"


def test_the_workflow_has_an_sdist_job_and_publishes_on_tags():
    jobs = WORKFLOW["jobs"]
    sdist = " ".join(s.get("run", "") for s in jobs["sdist"]["steps"])
    assert "build --sdist" in sdist and "twine check --strict" in sdist
    publish = jobs["publish"]
    assert set(publish["needs"]) == {"wheels", "sdist"}
    assert "refs/tags/v" in publish["if"]
    assert publish["permissions"] == {"id-token": "write"}
    assert any(str(s.get("uses", "")).startswith("pypa/gh-action-pypi-publish@") for s in publish["steps"])
    triggers = WORKFLOW[True] if True in WORKFLOW else WORKFLOW["on"]   # YAML 1.1 reads `on` as true
    assert "v*" in triggers["push"]["tags"]


def test_metadata_and_stubs_ship():
    project = PYPROJECT["project"]
    assert project["license"] == "MIT" and project["readme"] == "README.md"
    data = PYPROJECT["tool"]["setuptools"]["package-data"]["kvcache"]
    assert "*.pyi" in data and "py.typed" in data and "*.pxd" in data
    manifest = (REPO / "MANIFEST.in").read_text(encoding="utf-8")
    assert "*.pyi py.typed" in manifest and "recursive-include docs" in manifest
    assert "setuptools>=77" in PYPROJECT["build-system"]["requires"]   # the SPDX license field needs it


def test_ci_script_checks_the_wheel():
    run = (REPO / ".ci" / "run").read_text(encoding="utf-8")
    assert "twine check --strict" in run
    assert "auditwheel\" show" in run and "auditwheel\" repair --plat" in run
    assert re.search(r"manylinux_\*\|musllinux_\*\)", run)


def _ci_stages(run: str) -> set:
    """The switchable stages .ci/run declares (its `stage NAME FULL QUICK "what"` lines)."""
    return set(re.findall(r"^stage (\w+) ", run, re.M))


def test_ci_script_stages_are_switchable_and_the_workflows_use_them():
    run = (REPO / ".ci" / "run").read_text(encoding="utf-8")
    stages = _ci_stages(run)
    assert {"checks", "bench", "llama", "torch", "ctests", "fuzz", "sanitize", "demo"} <= stages
    for name in stages:
        assert re.search(rf"^stage_{name}\(\) ", run, re.M), f"stage {name} has no stage_{name} function"
    # environment the script reads besides the stage switches
    other = {"KVCACHE_CI_WORK", "KVCACHE_CI_EXTRAS", "KVCACHE_CI_LIGHT", "KVCACHE_CI_KEEP"}
    for wf in sorted((REPO / ".github" / "workflows").glob("*.yml")):
        for var in re.findall(r"\b(KVCACHE_CI_\w+)\s*:", wf.read_text(encoding="utf-8")):
            assert var in other or var[len("KVCACHE_CI_"):].lower() in stages, f"{wf.name}: .ci/run has no {var}"
            assert var in run or var[len("KVCACHE_CI_"):].lower() in stages


def test_ci_script_lists_its_stages():
    bash = shutil.which("bash")
    if bash is None:
        pytest.skip("no bash")
    run = REPO / ".ci" / "run"
    full = subprocess.run([bash, str(run), "--list"], capture_output=True, text=True, timeout=60)
    quick = subprocess.run([bash, str(run), "--quick", "--list", "--with-ctests", "--no-demo"], capture_output=True,
                           text=True, timeout=60, env={**os.environ, "KVCACHE_CI_TORCH": "1"})
    assert full.returncode == 0 and quick.returncode == 0, full.stderr + quick.stderr
    state = {q: dict(line.split()[:2] for line in r.stdout.splitlines()) for q, r in (("full", full), ("quick", quick))}
    assert set(state["full"]) == _ci_stages(run.read_text(encoding="utf-8"))
    assert state["full"]["llama"] == "on" and state["quick"]["llama"] == "off"
    assert state["quick"]["ctests"] == "on" and state["quick"]["demo"] == "off" and state["quick"]["torch"] == "on"
    assert state["quick"]["bench"] == "on"   # the suite runs `kvcache bench --quick`
    bad = subprocess.run([bash, str(run), "--no-nothing"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "no stage named nothing" in bad.stderr
