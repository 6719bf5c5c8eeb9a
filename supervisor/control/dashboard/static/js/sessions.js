// A session's transcript and its "New turn" box.
//
// A session is a conversation; each run one turn of it. When the page's run has a session,
// its transcript comes from the daemon's "history" (rebuilt from the journal: every turn's
// task, the assistant's messages and calls, one result per call saying what really
// happened, a note after a turn that did not complete). "New turn" spawns the session's
// next turn with the same spec and a new task, then goes to it. One turn of a session is
// live at a time: the daemon refuses a new one ("session_busy") unless asked to stop the
// live one first (the "Stop the live turn first" box: spawn's "interrupt"). A long
// session's history comes in pages: the newest turns show, "Load earlier turns" asks for
// the ones before them ("before_turn").

import { clear, fmtClock, h } from "./dom.js";
import { literal } from "./lookalike.js";

function messageItem(m) {
  if (m.role === "tool") {
    return h("li", { class: "msg msg-tool" }, h("span", { class: "who", text: `result ${m.tool_call_id}` }), h("pre", { text: m.content ?? "" }));
  }
  if (m.role === "system") return h("li", { class: "msg msg-note", text: m.content ?? "" });
  const calls = (m.tool_calls ?? []).map((c) =>
    h("p", { class: "call" }, h("span", { class: "who", text: `call ${c.id}` }), " ", h("strong", { class: "literal" }, literal(c.function?.name ?? "?")), " ", h("code", { class: "literal" }, literal(c.function?.arguments))),
  );
  return h("li", { class: `msg msg-${m.role}` }, h("span", { class: "who", text: m.role }), m.content ? h("p", { text: m.content }) : null, calls);
}

export class SessionTranscript {
  constructor(section, { list, form, textarea }, { conn }) {
    this.section = section;
    this.list = list;
    this.form = form;
    this.textarea = textarea;
    this.conn = conn;
    this.sessionId = null;
    this.spec = null;
    this.destroyed = false;
    this.known = new Map(); // turn number -> turn, of this.sessionId
    this.newest = 0;
    this.section.hidden = true;
    this.button = form.querySelector("button[type=submit]");
    this.interrupt = form.querySelector("#new-turn-interrupt");
    this.status = form.querySelector("#new-turn-status");
    this.onSubmit = (e) => {
      e.preventDefault();
      this.submit();
    };
    form.addEventListener("submit", this.onSubmit);
  }

  async onStatus(status) {
    if (!status || !status.session_id) return;
    if (status.session_id !== this.sessionId) {
      this.known = new Map();
      this.newest = 0;
    }
    this.sessionId = status.session_id;
    this.spec = status.spec ?? null;
    this.currentRun = status.id ?? status.run_id;
    const asked = (this.asked = (this.asked ?? 0) + 1);
    try {
      // The newest turns that fit in one reply; earlier ones on "Load earlier turns".
      const history = await this.conn.request("history", { session_id: this.sessionId });
      if (!this.destroyed && asked === this.asked) this.render(history);
    } catch (err) {
      if (!this.destroyed) this.say(err.message, true);
    }
  }

  async loadEarlier(beforeTurn) {
    const sessionId = this.sessionId;
    try {
      const page = await this.conn.request("history", { session_id: sessionId, before_turn: beforeTurn });
      if (this.destroyed || sessionId !== this.sessionId) return;
      for (const t of page.turns ?? []) this.known.set(t.turn, t);
      this.draw();
    } catch (err) {
      if (!this.destroyed) this.say(err.message, true);
    }
  }

  render(history) {
    // Turns by number (a number names the same turn on every page); a daemon that does
    // not page numbers none and sends them all.
    this.known ??= new Map();
    (history.turns ?? []).forEach((t, i) => this.known.set(t.turn ?? i + 1, t));
    this.newest = (history.turns ?? []).length ? (history.first_turn ?? 1) + history.turns.length - 1 : 0;
    this.draw();
    const closed = Boolean(history.closed_at);
    this.form.hidden = closed;
    if (closed) this.say("This session is closed: it takes no new turn.", false);
    this.section.hidden = false;
  }

  draw() {
    // The turns known without a gap back from the newest page; a gap or turns before the
    // first shown are offered by a button.
    let first = this.newest + 1;
    while (first > 1 && this.known.has(first - 1)) first -= 1;
    clear(this.list);
    if (first > 1) {
      const more = h("button", { type: "button", text: `Load earlier turns (${first - 1} more)` });
      more.onclick = () => {
        more.disabled = true;
        this.loadEarlier(first);
      };
      this.list.append(h("li", { class: "turn-more" }, more));
    }
    for (let n = first; n <= this.newest; n += 1) {
      const t = this.known.get(n);
      const head = h(
        "p",
        { class: "turn-head" },
        h("a", { href: `#/run/${encodeURIComponent(t.run_id)}`, text: `Turn ${n}` }),
        ` · ${t.state}${t.reason ? ` (${t.reason})` : ""} · ${fmtClock(t.created_at)}`,
        t.run_id === this.currentRun ? " · this run" : "",
      );
      this.list.append(h("li", { class: "turn", dataset: { run: t.run_id, state: t.state } }, head, h("ol", { class: "msgs" }, (t.messages ?? []).map(messageItem))));
    }
  }

  say(text, error) {
    if (!this.status) return;
    this.status.textContent = text;
    this.status.className = error ? "error" : "muted";
  }

  async submit() {
    const task = this.textarea.value.trim();
    if (!task || !this.sessionId) return;
    const spec = { ...(this.spec ?? {}), task };
    for (const key of ["run_id", "session_id", "session"]) delete spec[key];
    const args = { spec, session_id: this.sessionId };
    if (this.interrupt?.checked) args.interrupt = true;
    this.button.disabled = true;
    this.say("Starting…", false);
    try {
      const reply = await this.conn.request("spawn", args);
      this.textarea.value = "";
      location.hash = `#/run/${encodeURIComponent(reply.run_id)}`;
    } catch (err) {
      const busy = err.code === "session_busy";
      this.say(busy ? `One turn of a session is live at a time: ${err.message}` : err.message, true);
    } finally {
      this.button.disabled = false;
    }
  }

  destroy() {
    this.destroyed = true;
    this.form.removeEventListener("submit", this.onSubmit);
    clear(this.list);
    this.section.hidden = true;
  }
}
