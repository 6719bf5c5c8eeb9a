"""``python runner_with_patch.py [--warm]``: the real runner with one constant patched.

Sets ``subagent.tools.commands.DRAIN_AFTER_EXIT_S`` from ``$BENCH_COMMAND_DRAIN_S`` (when set),
then runs ``subagent.runner`` as ``python -m subagent.runner`` would.
"""

import os
import runpy
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

if os.environ.get("BENCH_COMMAND_DRAIN_S"):
    import subagent.tools.commands

    subagent.tools.commands.DRAIN_AFTER_EXIT_S = float(os.environ["BENCH_COMMAND_DRAIN_S"])

sys.argv[0] = "subagent.runner"
runpy.run_module("subagent.runner", run_name="__main__", alter_sys=True)
