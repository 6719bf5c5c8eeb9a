"""The web dashboard the daemon serves: live runs, a Stop that tells the truth, steering.

An HTTP server of its own on a loopback port (``_server``), routes with no I/O (``_app``),
sign-in by one-time link and a session secret the page keeps in its origin's storage
(``_sessions``, which says why not a cookie; links are minted by
``supervisor.control._dashlink``), and the page itself: plain HTML, CSS and JavaScript modules
under ``static/``, shipped as package data, no build step. The page talks to the control
socket with that session; see ``docs/dashboard.md``.
"""

from supervisor.control.dashboard._server import dashboard_url as dashboard_url
from supervisor.control.dashboard._server import listen as listen
from supervisor.control.dashboard._server import load_static as load_static
from supervisor.control.dashboard._server import serve_dashboard as serve_dashboard
from supervisor.control.dashboard._sessions import Sessions as Sessions

__all__ = ["serve_dashboard", "dashboard_url", "listen", "load_static", "Sessions"]
