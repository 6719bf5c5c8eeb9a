// The login link's page (/login?t=...): the daemon put a new session's secret in this
// page; keep it in this origin's storage (session.js says why not a cookie) and go on to
// the dashboard. location.replace takes the one-time link out of the address bar and the
// history. A link from a page of another site works the same: nothing here depends on
// where the click came from.

import { keep } from "./session.js";

const meta = document.querySelector('meta[name="agentd-session"]');
const value = meta ? meta.content : "";
if (meta) meta.remove();
const status = document.getElementById("login-status");
if (!/^[A-Za-z0-9_-]+$/.test(value)) {
  status.textContent = "This page holds no session. Run `agentd dashboard` for a new link.";
} else {
  try {
    keep(value);
    location.replace("/");
  } catch (err) {
    status.textContent = `Cannot keep the session in this site's storage (${err.message}); allow local storage for it.`;
  }
}
