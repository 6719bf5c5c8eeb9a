"""The control edge: how clients reach the daemon.

``server`` (the websocket control server: access, dispatch of ``supervisor.protocol``
messages to the run manager, per-connection limits in ``_conn_limits``), ``client`` (the
light synchronous client the CLI and the fleet use, over ``_wsclient``), ``_statefiles``
(the token and endpoint files that say where the daemon is), ``dashboard`` (the web page)
and ``_dashlink`` (its one-time sign-in links).

Imports nothing on purpose: ``agentd status`` imports ``supervisor.control.client``
without paying for the server's trio.
"""
