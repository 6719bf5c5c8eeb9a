// The dashboard's entry point: one connection to the control socket, two views, a router.
//
// Routes (in the address's #fragment, so a reload stays where it was):
//   #/                       the runs list (#/?state=running&session=s1 filters it)
//   #/run/<run id>           one run
// A run of a session shows the session's transcript and "New turn" (sessions.js).

import { Connection } from "./conn.js";
import { RunView } from "./run.js";
import { RunsView } from "./runs.js";
import { authHeaders, forget, secret } from "./session.js";

const conn = new Connection(document.getElementById("conn"));
const runsView = new RunsView(conn);
const runView = new RunView(conn);

function route() {
  const hash = location.hash.replace(/^#/, "") || "/";
  const [path, query = ""] = hash.split("?", 2);
  const match = /^\/run\/([^/]+)$/.exec(path);
  let run = null;
  try {
    run = match ? decodeURIComponent(match[1]) : null;
  } catch {
    run = null; // a malformed % escape (a mangled link): the list, not a blank page
  }
  let heading;
  if (run !== null) {
    runsView.unmount();
    runView.mount(run);
    heading = document.getElementById("run-title");
  } else {
    runView.unmount();
    runsView.unmount();
    runsView.mount(new URLSearchParams(query));
    heading = document.getElementById("runs-title");
  }
  // Move focus to the new view's heading, for keyboard and screen-reader users (not on
  // the first load: focus stays at the top of the page then).
  if (route.started) heading.focus();
  route.started = true;
}

async function signOut() {
  // The daemon ends the session (its sockets are refused from then on); the secret goes.
  try {
    await fetch("/logout", { method: "POST", headers: authHeaders(), cache: "no-store" });
  } finally {
    forget();
    location.replace("/signed-out");
  }
}

if (!secret()) {
  location.replace("/signed-out"); // never signed in on this origin, or signed out
} else {
  document.getElementById("sign-out").addEventListener("click", signOut);
  window.addEventListener("hashchange", route);
  conn.start(); // first: whatever the address holds, the page connects
  route();
}
