// A session's transcript and its "New turn" box.
//
// A session is a conversation; each run one turn of it. When the page's run has a session,
// its transcript comes from the daemon's "history" (rebuilt from the journal: every turn's
// task, the assistant's messages and calls, one result per call saying what really
// happened, a note after a turn that did not complete). "New turn" spawns the session's
// next turn with the same spec and a new task, then goes to it. One turn of a session is
// live at a time: the daemon refuses a new one ("session_busy") unless asked to stop the
// live one first (the "Stop the live turn first" box: spawn's "interrupt").

import { clear, fmtClock, h, reveal } from "./dom.js";

function messageItem(m) {
  if (m.role === "tool") {
    return h("li", { class: "msg msg-tool" }, h("span", { class: "who", text: `result ${m.tool_call_id}` }), h("pre", { text: m.content ?? "" }));
  }
  if (m.role === "system") return h("li", { class: "msg msg-note", text: m.content ?? "" });
  const calls = (m.tool_calls ?? []).map((c) =>
    h("p", { class: "call" }, h("span", { class: "who", text: `call ${c.id}` }), " ", h("strong", { class: "literal", text: reveal(c.function?.name ?? "?") }), " ", h("code", { class: "literal", text: reveal(c.function?.arguments) })),
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
    this.sessionId = status.session_id;
    this.spec = status.spec ?? null;
    try {
      const history = await this.conn.request("history", { session_id: this.sessionId });
      if (!this.destroyed) this.render(history, status.id ?? status.run_id);
    } catch (err) {
      if (!this.destroyed) this.say(err.message, true);
    }
  }

  render(history, currentRun) {
    clear(this.list);
    (history.turns ?? []).forEach((t, i) => {
      const head = h(
        "p",
        { class: "turn-head" },
        h("a", { href: `#/run/${encodeURIComponent(t.run_id)}`, text: `Turn ${i + 1}` }),
        ` · ${t.state}${t.reason ? ` (${t.reason})` : ""} · ${fmtClock(t.created_at)}`,
        t.run_id === currentRun ? " · this run" : "",
      );
      this.list.append(h("li", { class: "turn", dataset: { run: t.run_id, state: t.state } }, head, h("ol", { class: "msgs" }, (t.messages ?? []).map(messageItem))));
    });
    const closed = Boolean(history.closed_at);
    this.form.hidden = closed;
    if (closed) this.say("This session is closed: it takes no new turn.", false);
    this.section.hidden = false;
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
