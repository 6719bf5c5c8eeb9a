// A session's transcript and its "New turn" box (issue 11: conversations).
//
// The slot is ready; sessions are still labels in the daemon. When turns of a session
// carry history, fill in:
// - onStatus(status): when the run has a session, load the transcript (the session's
//   turns, as the journal recorded them) into `list` and un-hide `section`;
// - the "New turn" form: spawn the session's next turn (`spawn` with `session_id`), then
//   route to the new run (location.hash = `#/run/<id>`). One turn of a session is live at
//   a time: say so when the daemon refuses.
// run.js already creates this object for every run page.

export class SessionTranscript {
  constructor(section, { list, form, textarea }, { conn }) {
    this.section = section;
    this.list = list;
    this.form = form;
    this.textarea = textarea;
    this.conn = conn;
    this.section.hidden = true;
  }

  onStatus(_status) {}

  destroy() {
    this.section.hidden = true;
  }
}
