"""The runner's model: the provider interface and its implementations.

``provider`` (``Provider``, ``ModelError``, the pure ``TurnAssembler``), ``openai_provider``
(the real ``openai`` client), ``scripted`` and ``script`` (a deterministic model that
plays a script, ``SCRIPT_FORMAT.md``), ``fake_openai`` (an OpenAI-compatible server
that plays a script over HTTP, for tests and demos).

Imports nothing on purpose: ``openai`` costs over a second to import.
"""
