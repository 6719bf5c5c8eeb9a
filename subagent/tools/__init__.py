"""The runner's tools: what a model's tool calls run.

``toolbox`` (``ToolBox``: lists tools, runs a call under its stop policy), ``commands``
(``run_command``: a shell command in its own process group), ``background`` (background
commands), ``mcp_spawn`` and ``mcp_tools`` (MCP servers: spawned before ``mcp`` is
imported, then driven through the SDK), ``browser`` (the ``@playwright/mcp`` preset; the
daemon sees it only through ``subagent.presets``).

Imports nothing on purpose: ``mcp`` costs over a second to import.
"""
