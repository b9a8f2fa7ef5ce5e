"""The installed package: where it comes from and what it ships."""
import os
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
