"""The run core: every run's life from spawn to its one terminal fact.

``runs`` (``RunManager``: the control socket's backend), ``_lifecycle`` (the one
supervision of a run, with an event source from ``_sources``: pipes for a run started
here, the run directory's files for one re-adopted after a restart by ``recovery``),
``_book`` (facts to the journal and out to watchers), ``_run`` (the record of a live
run), ``approvals``, ``sessions``, ``token`` (one cancel token per run), ``progress``
(runner stderr to event values), ``_stop_receipt`` and ``_spec_check``.

Imports nothing on purpose: import the module you need.
"""
