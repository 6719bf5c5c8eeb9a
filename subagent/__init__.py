"""The sub-agent runner: the child process the daemon starts, one per run.

``python -m subagent.runner [--warm]`` reads a run spec (``subagent.spec.RunSpec``) on
stdin, writes events on stderr and one result on stdout (``subagent.events``), and exits
with an ``events.ExitCode``. The script format of the ``scripted`` model is in
``subagent/SCRIPT_FORMAT.md``; ``subagent.model.fake_openai`` serves a script over HTTP.

This package imports nothing here on purpose: the daemon imports ``subagent.events`` and
``subagent.spec`` (stdlib only) and must not pay for trio, openai or mcp.
"""
