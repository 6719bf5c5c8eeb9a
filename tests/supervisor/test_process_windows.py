"""The taskkill command lines of supervisor/trees/_windows.py (pure: tested on every OS)."""

from __future__ import annotations

import pytest

from supervisor.trees._windows import hard_kill_command, soft_kill_command


def test_the_soft_kill_asks_the_whole_tree_to_end() -> None:
    assert soft_kill_command(4242) == ["taskkill", "/T", "/PID", "4242"]


def test_the_hard_kill_forces_the_whole_tree_down() -> None:
    assert hard_kill_command(4242) == ["taskkill", "/F", "/T", "/PID", "4242"]


@pytest.mark.parametrize("bad", [0, -1, True, "4242", 4242.0, None])
def test_a_pid_that_is_not_a_positive_int_is_refused(bad: object) -> None:
    with pytest.raises(ValueError, match="expected a positive process id"):
        soft_kill_command(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="expected a positive process id"):
        hard_kill_command(bad)  # type: ignore[arg-type]
