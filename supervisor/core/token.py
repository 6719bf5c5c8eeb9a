"""One cancel token per run (per turn), after seed 001.

A token is created when its run is registered and retired exactly once when the run
reaches its terminal state, whatever the outcome. ``cancel()`` on a live token records
the first reason and reports ``True`` every time (pressing Stop five times has the
effect of once); on a retired token it does nothing and reports ``False``, so a late stop
can never reach the next turn: the next turn has a different token. No I/O here.
"""

from __future__ import annotations

from typing import Final, final

__all__ = ["CancelToken"]


@final
class CancelToken:
    __slots__ = ("run_id", "_reason", "_retired", "_cancel_count")

    def __init__(self, run_id: str) -> None:
        self.run_id: Final = run_id
        self._reason: str | None = None
        self._retired = False
        self._cancel_count = 0

    def cancel(self, reason: str) -> bool:
        """Trigger the token. Returns ``was_active``: False once the run has ended."""
        if self._retired:
            return False
        self._cancel_count += 1
        if self._reason is None:
            self._reason = reason
        return True

    def retire(self) -> None:
        self._retired = True

    @property
    def cancelled(self) -> bool:
        return self._reason is not None

    @property
    def reason(self) -> str | None:
        return self._reason

    @property
    def retired(self) -> bool:
        return self._retired

    @property
    def first_cancel(self) -> bool:
        """True right after the first effective cancel (the one that starts the stop)."""
        return self._cancel_count == 1

    def __repr__(self) -> str:
        state = "retired" if self._retired else ("cancelled" if self.cancelled else "live")
        return f"<CancelToken {self.run_id} {state} reason={self._reason!r}>"
