"""The daemon's published files in its state dir: the control token and the endpoint.

Stdlib only: the daemon writes them (through ``supervisor.control.server``) and the CLI's client
reads them without importing trio. Both are replaced atomically (write a temp file, then
rename), so a reader never sees half a file; the token file is 0600 from its creation.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

__all__ = [
    "TOKEN_FILE",
    "ENDPOINT_FILE",
    "default_state_dir",
    "new_token",
    "write_token",
    "read_token",
    "endpoint_url",
    "write_endpoint",
    "read_endpoint",
    "remove_endpoint",
]

# 32 random bytes, URL-safe: fits a header and a ?token= query alike.
TOKEN_BYTES = 32

TOKEN_FILE = "token"  # 0600, the control socket's shared secret
ENDPOINT_FILE = "daemon.json"  # {"url", "host", "port", "pid"} of the running daemon


def default_state_dir() -> Path:
    """The daemon's state dir when none is given (``supervisor.config`` re-exports it)."""
    env = os.environ.get("AGENTD_STATE_DIR")
    if env:
        return Path(env).absolute()  # a runner's cwd is its run dir: never relative
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        return Path("/var/lib/agentd")
    xdg = os.environ.get("XDG_STATE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".local" / "state"
    return (base / "agentd").absolute()


def new_token() -> str:
    import secrets  # only the daemon writes; the CLI's import path skips it (~2 ms)

    return secrets.token_urlsafe(TOKEN_BYTES)


def _write_atomic(path: Path, data: bytes, mode: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{os.urandom(4).hex()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        try:
            if hasattr(os, "fchmod"):  # POSIX: the umask may have narrowed it; never widened
                os.fchmod(fd, mode)
            os.write(fd, data)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def write_token(path: Path | str, token: str | None = None) -> str:
    """Write a fresh (or the given) control token to ``path``, mode 0600. Returns it."""
    token = new_token() if token is None else token
    _write_atomic(Path(path), (token + "\n").encode(), 0o600)
    return token


def read_token(path: os.PathLike[str] | str) -> str:
    """The token in ``path``.

    Raises:
        OSError: the file is missing or unreadable.
        ValueError: the file is empty.
    """
    token = Path(path).read_text(encoding="utf-8").strip()
    if not token:
        raise ValueError(f"expected a token in {str(path)!r}, got an empty file")
    return token


def endpoint_url(host: str, port: int) -> str:
    """The URL a local client dials for a server bound to ``host``."""
    if host in ("", "0.0.0.0"):
        host = "127.0.0.1"
    elif host == "::":
        host = "::1"
    if ":" in host:
        host = f"[{host}]"
    return f"ws://{host}:{port}/"


def write_endpoint(
    path: Path | str, *, host: str, port: int, pid: int | None = None, dashboard_url: str | None = None
) -> dict[str, Any]:
    """Publish where the daemon listens: ``{"url", "host", "port", "pid"}``. Returns it.

    ``dashboard_url``, when the daemon serves its web dashboard, is published too.
    """
    info: dict[str, Any] = {
        "url": endpoint_url(host, port),
        "host": host,
        "port": port,
        "pid": os.getpid() if pid is None else pid,
    }
    if dashboard_url is not None:
        info["dashboard_url"] = dashboard_url
    _write_atomic(Path(path), (json.dumps(info) + "\n").encode(), 0o644)
    return info


def read_endpoint(path: Path | str) -> dict[str, Any]:
    """The published endpoint.

    Raises:
        OSError: no such file (no daemon published one) or unreadable.
        ValueError: the file is not an endpoint record.
    """
    info = json.loads(Path(path).read_text(encoding="utf-8"))
    if not isinstance(info, dict) or not isinstance(info.get("url"), str) or not isinstance(info.get("port"), int):
        raise ValueError(f"expected an endpoint record in {str(path)!r}, got {info!r}")
    return info


def remove_endpoint(path: Path | str, *, pid: int | None = None) -> bool:
    """Remove the endpoint file; with ``pid``, only if that process published it.

    Returns whether it was removed: False when it is not that process's, is gone, or the
    filesystem refuses (read-only): a stale file whose pid is dead, never an error.
    """
    p = Path(path)
    if pid is not None:
        try:
            if read_endpoint(p).get("pid") != pid:
                return False
        except (OSError, ValueError):
            return False
    try:
        p.unlink()
    except FileNotFoundError:
        return False
    except OSError:  # a read-only or failing filesystem: a stale file (its pid says so), not a crash at exit
        return False
    return True
