// Approvals: a call awaiting a person's OK, with "Approve" and "Deny" (issue 11).
//
// The slot is ready; the mechanism is not in the daemon yet. When it lands, fill in:
// - feed(ev): the run's events, in order (e.g. an approval request naming the call, its
//   tool name and arguments; its resolution). Show each pending call in `list` with two
//   buttons, accessible names "Approve" and "Deny" (Deny with an optional reason), and
//   un-hide `section` while anything is pending.
// - onStatus(status): the run's status (a pending approval survives a page reload and a
//   daemon restart, so rebuild from it as well as from the events).
// - the buttons call `this.conn.request(<op>, {run_id, call_id, ...})`; the control socket
//   authenticates the page by its session cookie, so nothing else is needed here.
// run.js already creates this object for every run page and feeds it.

export class Approvals {
  constructor(section, list, { conn, runId }) {
    this.section = section;
    this.list = list;
    this.conn = conn;
    this.runId = runId;
    this.section.hidden = true;
  }

  feed(_ev) {}

  onStatus(_status) {}

  destroy() {
    this.section.hidden = true;
  }
}
