from supervisor.core.token import CancelToken


def test_cancel_on_a_live_token_reports_active_and_keeps_the_first_reason() -> None:
    t = CancelToken("r-1")
    assert t.cancel("user") is True
    assert t.first_cancel
    assert t.cancel("timeout") is True
    assert not t.first_cancel
    assert t.reason == "user"
    assert t.cancelled


def test_a_retired_token_ignores_cancel_so_a_late_stop_reaches_nothing() -> None:
    t = CancelToken("r-1")
    t.retire()
    assert t.cancel("user") is False
    assert not t.cancelled
    assert t.reason is None


def test_each_turn_has_its_own_token() -> None:
    first, second = CancelToken("r-1"), CancelToken("r-2")
    first.cancel("user")
    first.retire()
    assert first.cancel("user") is False
    assert not second.cancelled
