"""Fixtures for the systemd tests: one booted container per test module."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator

import pytest

from tests.conftest import require
from tests.systemd.container import PREPARE, Container, ContainerError, image_root, prepared, venv_python

# A first build of the image takes about a minute; more means something is wrong.
PREPARE_TIMEOUT_S = 600


def require_container_tools() -> None:
    require(hasattr(os, "geteuid") and os.geteuid() == 0, "root (systemd-nspawn boots containers)")
    require(venv_python().exists(), f"{venv_python()} (run scripts/setup)")
    if not prepared() and PREPARE.exists():
        # scripts/test runs prepare before pytest; this covers a bare `pytest tests/systemd`.
        r = subprocess.run([str(PREPARE)], timeout=PREPARE_TIMEOUT_S)
        require(r.returncode == 0, f"tests/systemd/prepare (exited {r.returncode}; see its output)")
    for tool in ("systemd-nspawn", "nsenter"):
        require(shutil.which(tool) is not None, f"{tool} (apt-get install systemd-container)")
    require(prepared(), f"the test image at {image_root()} (run tests/systemd/prepare as root)")
    real = venv_python().resolve()
    if str(real).startswith("/usr/"):  # Debian's python3: the image must have the same one
        require(
            (image_root() / str(real).lstrip("/")).exists(),
            f"{real} (the venv's interpreter) in the bookworm test image; "
            "a venv made from another Debian release's python3 cannot run there",
        )


def boot(c: Container) -> None:
    """Boot, or skip (fail in CI) where this machine cannot run systemd-nspawn at all."""
    try:
        c.boot()
    except ContainerError as exc:
        require(False, f"a container booted with systemd-nspawn: {exc}")


@pytest.fixture(scope="module")
def container(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Container]:
    require_container_tools()
    c = Container(image_root(), tmp_path_factory.mktemp("nspawn"))
    boot(c)
    try:
        yield c
    finally:
        c.shutdown()
