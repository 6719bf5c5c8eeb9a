// The dashboard session's secret, kept in this origin's localStorage.
//
// Not a cookie: a browser sends a host's cookies to every port of it, so any other server
// on 127.0.0.1 (a local web app, or one a supervised run starts) would receive it, and the
// secret is the whole credential. localStorage is scoped to scheme, host and port. The page
// presents the secret itself: in the X-Agentd-Session header of its HTTP calls and as a
// subprotocol entry of the control socket's handshake (a WebSocket takes no headers).

const KEY = "agentd_session";
export const SUBPROTOCOL = "agentd-dashboard";
export const SESSION_PROTOCOL_PREFIX = "agentd-session.";

export function secret() {
  try {
    return localStorage.getItem(KEY);
  } catch {
    return null; // storage disabled: not signed in
  }
}

export function keep(value) {
  localStorage.setItem(KEY, value);
}

export function forget() {
  try {
    localStorage.removeItem(KEY);
  } catch {
    // nothing kept
  }
}

/** Headers for a request to the dashboard's own API. */
export function authHeaders() {
  const s = secret();
  return s ? { "X-Agentd-Session": s } : {};
}

/** The subprotocols the page offers the control socket: its own, and the session. */
export function socketProtocols() {
  const s = secret();
  return s ? [SUBPROTOCOL, SESSION_PROTOCOL_PREFIX + s] : [SUBPROTOCOL];
}
