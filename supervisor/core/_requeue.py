"""A run a killed daemon left ``queued`` is queued again by the next one, not dropped.

Its spawn was acknowledged and journaled (its record, its spec, its ``queued`` event) and
no runner ever had it: the restarted daemon queues it again, with its run id and its
journaled spec, in the order the runs were made (``journal.live_runs``), and it runs as
any queued run does (its timeout counts from its start, as for any run: a queued run has
no deadline yet). A ``requeued`` event says so. Not re-queued, ended with a clear error
instead (``failed``, never ``lost``): a spec that no longer validates (a config or host
change since the spawn), and a run spawned with its own ``model_key``, which is never
journaled (its ``queued`` event says ``own_model_key``): it would run on the daemon's key.
A run whose stop was asked, or that was ``starting``, is not this module's (``recovery``).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Final

from supervisor.config import Config
from supervisor.core._book import RunBook
from supervisor.core._run import Run
from supervisor.core._spec_check import validate_spec
from supervisor.core.token import CancelToken
from supervisor.errors import SpawnError
from supervisor.states import RunState

__all__ = ["REQUEUED", "OWN_MODEL_KEY", "requeue"]

logger = logging.getLogger(__name__)

# The event a re-queued run gets at the restart (add-only, docs/control-protocol.md).
REQUEUED: Final = "requeued"
# In a run's ``queued`` event: it was spawned with its own model key (never journaled).
OWN_MODEL_KEY: Final = "own_model_key"
# The reason and error code of a queued run the restarted daemon could not queue again.
NOT_REQUEUED: Final = "not_requeued"


async def requeue(book: RunBook, config: Config, row: Any) -> Run | None:
    """The run of ``row`` (``queued``, no stop asked, no process), queued again: its
    ``requeued`` event journaled, its ``Run`` returned for the queue. None when it cannot
    be (ended ``failed``, reason ``not_requeued``, its ``error`` saying why). Never raises
    for the run's spec: a spec that trips the validator ends that run alone."""
    run_id = row["id"]
    run = Run(
        run_id=run_id,
        session_id=row["session_id"],
        spec=dict(row["spec"]),
        timeout_s=row["timeout_s"],
        token=CancelToken(run_id),
        state=RunState.QUEUED,
        last_seq=row["last_seq"],
    )
    why = await _why_not(book, config, run)
    if why is not None:
        code, message = why
        logger.warning("run %s: queued when the daemon was killed, not queued again: %s", run_id, message)
        await book.finish(
            run,
            RunState.FAILED,
            reason=NOT_REQUEUED,
            result=None,
            partial=False,
            error={"code": code, "message": message},
            receipt={"note": "queued when the previous daemon ended; not queued again by the restarted daemon"},
        )
        return None
    await book.record(
        run,
        REQUEUED,
        {
            "note": "queued again after a daemon restart: its spawn was acknowledged before the previous daemon "
            "ended, and it had not started",
            "created_at": row["created_at"],
            "requeued_at": time.time(),
        },
    )
    logger.info("run %s: queued again after the daemon restart (created at %s)", run_id, row["created_at"])
    return run


async def _why_not(book: RunBook, config: Config, run: Run) -> tuple[str, str] | None:
    """(error code, message) if the run cannot be queued again, else None."""
    first = await book.journal.events_after(run.run_id, 0, limit=1)
    if first and first[0]["kind"] == "state" and first[0]["data"].get(OWN_MODEL_KEY):
        return (
            "model_key_gone",
            "it was spawned with its own model_key, which the daemon keeps in memory only (never journaled): "
            "the restarted daemon does not have it, and will not run it on its own key; spawn it again",
        )
    try:
        validate_spec(dict(run.spec), None, config)
    except SpawnError as exc:
        return ("bad_spec", f"its spec no longer validates at the daemon's restart: {exc}")
    except Exception as exc:  # a validator that trips on a journaled value: still the run's alone
        logger.exception("run %s: checking its spec at the restart failed", run.run_id)
        return ("bad_spec", f"its spec could not be checked at the daemon's restart: {type(exc).__name__}: {exc}")
    return None
