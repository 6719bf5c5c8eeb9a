"""``agentd dashboard --open``'s private page (``_dashopen``): what the opener is given, and
that the page never outlives the call (read, the bound, an error). The real CLI, browser
and daemon: tests/e2e/test_dashboard.py."""

from __future__ import annotations

import os
import time
from pathlib import Path
from urllib.parse import unquote, urlparse

import pytest

from supervisor.control import _dashopen
from supervisor.control._dashlink import LOGIN_TTL_S

URL = "http://127.0.0.1:1/login?t=v1.1.secret-nonce.mac"


def _path(page_url: str) -> str:
    return unquote(urlparse(page_url).path)


def test_a_page_no_browser_reads_is_removed_at_the_bound(tmp_path: Path) -> None:
    given: list[str] = []

    def opener(u: str) -> bool:  # a browser that was started and never reads anything
        given.append(u)
        assert os.stat(_path(u)).st_mode & 0o777 == 0o600
        return True

    t0 = time.monotonic()
    assert _dashopen.open_link(URL, tmp_path, opener=opener, linger_s=0.3, settle_s=5) is True
    assert time.monotonic() - t0 >= 0.3  # it waited for a read, at most the bound
    (page,) = given
    assert "secret-nonce" not in page and page.startswith(f"file://{tmp_path}/{_dashopen.PREFIX}")
    assert list(tmp_path.iterdir()) == []


def test_a_page_is_removed_when_the_opener_fails_or_raises(tmp_path: Path) -> None:
    assert _dashopen.open_link(URL, tmp_path, opener=lambda u: False, linger_s=60) is False
    assert list(tmp_path.iterdir()) == []

    def interrupted(u: str) -> bool:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        _dashopen.open_link(URL, tmp_path, opener=interrupted)
    assert list(tmp_path.iterdir()) == []


def test_a_page_read_is_removed_once_it_was_left_alone(tmp_path: Path) -> None:
    def reader(u: str) -> bool:
        with open(_path(u)) as f:
            assert URL.replace("&", "&amp;") in f.read()
        return True

    t0 = time.monotonic()
    assert _dashopen.open_link(URL, tmp_path, opener=reader, linger_s=60, settle_s=0.2) is True
    assert time.monotonic() - t0 < 30  # not the bound: the read was seen
    assert list(tmp_path.iterdir()) == []


def test_what_a_killed_cli_left_is_removed_by_the_next_once_its_link_expired(tmp_path: Path) -> None:
    old, recent = tmp_path / f"{_dashopen.PREFIX}old", tmp_path / f"{_dashopen.PREFIX}recent"
    for d in (old, recent):
        d.mkdir(mode=0o700)
        (d / "login.html").write_text("x")
    then = time.time() - LOGIN_TTL_S - 10
    os.utime(old, (then, then))
    (tmp_path / "token").write_text("t")
    assert _dashopen.open_link(URL, tmp_path, opener=lambda u: False) is False
    assert sorted(p.name for p in tmp_path.iterdir()) == [recent.name, "token"]
