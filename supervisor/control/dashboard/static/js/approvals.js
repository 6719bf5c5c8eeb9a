// Approvals: a call awaiting a person's OK, with "Approve" and "Deny".
//
// What is pending comes from the run's events ("approval_requested" names the call, its
// tool and arguments; "approval_answered" resolves it) and from its status ("approvals":
// what the daemon holds pending, which survives a page reload and a daemon restart). The
// buttons send the control socket's "approve" / "deny" (with the optional reason from the
// box beside Deny); the page is authenticated by its session (session.js). Once a run is stopping
// or has ended, nothing can be answered: the section goes.

import { clear, h, reveal } from "./dom.js";
import { literal, lookalikeNote } from "./lookalike.js";

const ENDED = new Set(["completed", "failed", "cancelled", "lost"]);

export class Approvals {
  constructor(section, list, { conn, runId }) {
    this.section = section;
    this.list = list;
    this.conn = conn;
    this.runId = runId;
    this.pending = new Map(); // call_id -> {call_id, name, arguments, deadline, sending, error}
    this.closed = false;
    this.section.hidden = true;
  }

  feed(ev) {
    const d = ev.data ?? {};
    if (ev.kind === "approval_requested" && d.call_id) {
      this.pending.set(d.call_id, { ...(this.pending.get(d.call_id) ?? {}), ...d });
    } else if (ev.kind === "approval_answered" && d.call_id) {
      this.pending.delete(d.call_id);
    } else if (ev.kind === "state" && (d.state === "cancelling" || ENDED.has(d.state))) {
      this.closed = true;
    } else {
      return;
    }
    this.render();
  }

  onStatus(status) {
    if (!status) return;
    if (status.state === "cancelling" || ENDED.has(status.state)) this.closed = true;
    if (Array.isArray(status.approvals)) {
      // The daemon's word: what it holds pending now (e.g. after a restart).
      const now = new Map();
      for (const a of status.approvals) if (a && a.call_id) now.set(a.call_id, { ...(this.pending.get(a.call_id) ?? {}), ...a });
      this.pending = now;
    }
    this.render();
  }

  async answer(callId, approve, reason) {
    const item = this.pending.get(callId);
    if (!item) return;
    item.sending = true;
    item.error = null;
    this.render();
    try {
      const args = { run_id: this.runId, call_id: callId };
      if (!approve && reason) args.reason = reason;
      await this.conn.request(approve ? "approve" : "deny", args);
      item.sent = approve ? "approved" : "denied";
    } catch (err) {
      item.error = err.message;
    } finally {
      item.sending = false;
      this.render();
    }
  }

  render() {
    clear(this.list);
    const items = this.closed ? [] : [...this.pending.values()];
    this.section.hidden = items.length === 0;
    for (const it of items) {
      const reason = h("input", {
        type: "text",
        class: "deny-reason",
        placeholder: "reason (optional)",
        "aria-label": `Reason to deny ${reveal(it.name)}`,
        maxlength: "1000",
      });
      const busy = Boolean(it.sending || it.sent);
      const approve = h("button", { type: "button", class: "approve", text: "Approve", disabled: busy });
      const deny = h("button", { type: "button", class: "deny", text: "Deny", disabled: busy });
      approve.addEventListener("click", () => this.answer(it.call_id, true));
      deny.addEventListener("click", () => this.answer(it.call_id, false, reason.value.trim()));
      const due = typeof it.deadline === "number" ? new Date(it.deadline * 1000).toLocaleTimeString() : null;
      this.list.append(
        h(
          "li",
          { dataset: { call: it.call_id } },
          // As stored, hidden characters shown (reveal) and look-alike ones marked and named
          // (lookalike.js): what is approved is what is seen.
          h("p", {}, h("strong", { class: "literal" }, literal(it.name)), " ", h("code", { class: "args literal" }, literal(it.arguments))),
          lookalikeNote(it.name, it.arguments),
          h("p", { class: "muted", text: `call ${it.call_id}` + (due ? ` · stops the run at ${due} unless answered` : "") }),
          h("div", { class: "row" }, approve, deny, reason),
          it.sent ? h("p", { class: "muted", role: "status", text: `${it.sent}: waiting for the runner` }) : null,
          it.error ? h("p", { class: "error", role: "alert", text: it.error }) : null,
        ),
      );
    }
  }

  destroy() {
    clear(this.list);
    this.section.hidden = true;
  }
}
