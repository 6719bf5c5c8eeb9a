"""The OS edge both sides share: process identity, the process table, signals, escalation.

The daemon (``supervisor``) and the runner (``subagent``) both end processes for real:
a run's tree, a command's group, an MCP server and its escapers, a browser's helpers.
They read the same kernel facts and send signals the same way, through this package:

- ``Kernel`` (a Protocol; ``LinuxKernel`` is the real one): every ``/proc`` read, pidfd,
  ``killpg``, ``cgroup.kill`` and reap. Tests inject a fake kernel once.
- ``ProcessTable``: the one reader of the table, and the cache its owner keeps.
- ``Targets``: a set of processes (groups, exact processes, a marker, a cgroup, command
  lines, pipes), resolved by ``ProcessTable.members``.
- ``signal_process`` / ``signal_group`` / ``kill_cgroup``: never a recycled pid;
  ``resume_stopped``: SIGCONT to a set's stopped members, before others' code closes them.
- ``escalate``: the one escalation routine every cancel ends in.
- ``run_trio``: ``trio.run`` that releases the signal wake-up fd before Trio closes it.
- ``Watch``: inotify on a file or directory (``cgroup.events``, a run's events file), for
  waits that are kernel events instead of polls; ``WatchSet``: one inotify descriptor
  for many such paths (the daemon's stopping trees).

A stdlib-only leaf, like ``subagent.events``: importing it imports neither trio nor
anything of ``supervisor`` (``TrioRuntime`` imports trio when it is made).
"""

from subagent.osedge._escalate import POLL_S as POLL_S
from subagent.osedge._escalate import Escalation as Escalation
from subagent.osedge._escalate import Runtime as Runtime
from subagent.osedge._escalate import Signalled as Signalled
from subagent.osedge._escalate import TrioRuntime as TrioRuntime
from subagent.osedge._escalate import escalate as escalate
from subagent.osedge._kernel import LINUX as LINUX
from subagent.osedge._kernel import Kernel as Kernel
from subagent.osedge._kernel import LinuxKernel as LinuxKernel
from subagent.osedge._kernel import Proc as Proc
from subagent.osedge._kernel import ProcessId as ProcessId
from subagent.osedge._kernel import parse_stat as parse_stat
from subagent.osedge._signal import Delivery as Delivery
from subagent.osedge._signal import group_exists as group_exists
from subagent.osedge._signal import kill_cgroup as kill_cgroup
from subagent.osedge._signal import open_pidfd as open_pidfd
from subagent.osedge._signal import resume_stopped as resume_stopped
from subagent.osedge._signal import signal_group as signal_group
from subagent.osedge._signal import signal_process as signal_process
from subagent.osedge._table import ProcessTable as ProcessTable
from subagent.osedge._table import Targets as Targets
from subagent.osedge._table import parse_var as parse_var
from subagent.osedge._trio import run_trio as run_trio
from subagent.osedge._watch import IN_DELETE as IN_DELETE
from subagent.osedge._watch import IN_MODIFY as IN_MODIFY
from subagent.osedge._watch import Watch as Watch
from subagent.osedge._watch import WatchSet as WatchSet

__all__ = [
    "Kernel",
    "LinuxKernel",
    "LINUX",
    "Proc",
    "ProcessId",
    "parse_stat",
    "ProcessTable",
    "Targets",
    "parse_var",
    "Delivery",
    "signal_process",
    "signal_group",
    "group_exists",
    "kill_cgroup",
    "open_pidfd",
    "resume_stopped",
    "Runtime",
    "TrioRuntime",
    "Signalled",
    "Escalation",
    "escalate",
    "POLL_S",
    "Watch",
    "WatchSet",
    "IN_MODIFY",
    "IN_DELETE",
    "run_trio",
]
