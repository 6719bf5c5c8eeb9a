"""The durable store: the journal (SQLite, WAL, one worker thread) and its backlog.

``journal`` (``Journal``: the async API the daemon uses), ``_ops`` and ``_sessions``
(its operations, one transaction each, on the worker's connection), ``_schema``
(schema and migrations), ``_restore`` (the journal put back at its path when its file
was removed or replaced under the daemon), ``_read`` (a read-only view for a CLI with no
daemon) and ``backlog`` (a run's writes kept in order in memory while the journal cannot
be written; ``_unwritten``, its note on disk of which runs have writes waiting).

Imports nothing on purpose: ``agentd logs`` imports ``supervisor.store._read`` alone.
"""
