// One run's page: its facts, its events as they happen, tool calls, the partial result,
// the Stop control, steering, and the stop receipt once it has ended.
//
// Events come from a subscription from seq 0 (a reload replays the journal, so the page
// shows exactly the journal's events); a dropped connection resumes after the last seq
// shown (conn.js). Leaving or closing the page unsubscribes; the run goes on.

import { Approvals } from "./approvals.js";
import { clear, fmtAge, fmtClock, h, renderValue, stateBadge } from "./dom.js";
import { foldSnapshot, laterSnapshot, renderEvent, toolLineNodes } from "./events.js";
import { literal } from "./lookalike.js";
import { SessionTranscript } from "./sessions.js";
import { SteerBox } from "./steer.js";
import { StopControl } from "./stop.js";

const LIVE = new Set(["queued", "starting", "running", "cancelling", "awaiting_approval"]);
const $ = (id) => document.getElementById(id);

export class RunView {
  constructor(conn) {
    this.conn = conn;
    this.section = $("run-view");
    this.active = null;
  }

  mount(runId) {
    this.unmount();
    this.section.hidden = false;
    this.active = new RunPage(this.conn, runId);
  }

  unmount() {
    if (this.active) this.active.destroy();
    this.active = null;
    this.section.hidden = true;
  }
}

class RunPage {
  constructor(conn, runId) {
    this.conn = conn;
    this.runId = runId;
    this.status = null;
    this.state = null;
    this.tools = new Map();
    this.snapshot = null;
    this.steps = 0;
    this.lastEventTs = null;
    this.ended = false;
    this.destroyed = false;

    $("run-id").textContent = runId;
    document.title = `agentd · ${runId}`;
    $("run-missing").hidden = true;
    for (const id of ["events", "tools", "stop-steps", "steer-list", "receipt"]) clear($(id));
    $("events-count").textContent = "";
    $("stop-status").textContent = "";
    $("receipt-box").hidden = true;
    this._renderResult();

    this.stop = new StopControl($("stop"), $("stop-status"), $("stop-steps"), {
      cancel: () => conn.request("cancel", { run_id: runId }),
    });
    this.steer = new SteerBox(
      { form: $("steer-form"), textarea: $("steer-text"), button: $("steer-send"), list: $("steer-list") },
      { send: (text) => conn.request("steer", { run_id: runId, text }) },
    );
    this.steer.setLive(false);
    this.approvals = new Approvals($("approvals"), $("approvals-list"), { conn, runId });
    this.transcript = new SessionTranscript(
      $("transcript"),
      { list: $("transcript-list"), form: $("new-turn-form"), textarea: $("new-turn-text") },
      { conn },
    );
    this.ageTimer = setInterval(() => this._renderFacts(), 1000);

    conn
      .request("status", {})
      .then((d) => this.stop.setGrace(d?.summary?.grace_s ?? null))
      .catch(() => {});
    this._loadStatus().then(() => {
      if (this.destroyed) return;
      this.sub = conn.subscribe(runId, {
        afterSeq: 0,
        onEvent: (ev) => this._onEvent(ev),
        onEnd: (end) => this._onEnd(end),
        onError: (err) => this._missing(err.message),
      });
    });
  }

  destroy() {
    this.destroyed = true;
    if (this.sub) this.sub.close();
    clearInterval(this.ageTimer);
    this.stop.destroy();
    this.steer.destroy();
    this.approvals.destroy();
    this.transcript.destroy();
  }

  async _loadStatus() {
    try {
      const status = await this.conn.request("status", { run_id: this.runId });
      if (this.destroyed) return;
      this.status = status;
      this._setState(status.state);
      if (status.partial_snapshot) this.snapshot = laterSnapshot(this.snapshot, status.partial_snapshot);
      this.approvals.onStatus(status);
      this.transcript.onStatus(status);
      this._renderFacts();
      this._renderResult();
    } catch (err) {
      if (err.code === "not_found") this._missing(err.message);
      else if (err.code === "connection_lost") return this._loadStatus();
      else this._missing(err.message);
    }
  }

  _missing(message) {
    const el = $("run-missing");
    el.textContent = message;
    el.hidden = false;
  }

  _setState(state) {
    this.state = state;
    this.stop.setState(state);
    this.steer.setLive(state === "running" || state === "starting", state);
  }

  _onEvent(ev) {
    const list = $("events");
    list.append(renderEvent(ev));
    $("events-count").textContent = `(${list.childElementCount})`;
    this.lastEventTs = ev.ts;
    const d = ev.data ?? {};
    if (ev.kind === "state" && d.state) this._setState(d.state);
    if (ev.kind === "step_started" && typeof d.step === "number") this.steps = Math.max(this.steps, d.step);
    if (ev.kind === "tool_call" && d.record) {
      this.tools.set(d.record.id, d.record);
      this._renderTools();
    }
    if (ev.kind === "step_snapshot") {
      // A delta since the runner's last snapshot: folded into the whole one shown.
      this.snapshot = foldSnapshot(this.snapshot, d);
      this._renderResult();
    }
    if (ev.kind === "runner_started" && this.status) this.status.pid = d.pid;
    this.stop.feed(ev);
    this.steer.feed(ev);
    this.approvals.feed(ev);
    this._renderFacts();
  }

  async _onEnd(end) {
    if (end.error) {
      this._missing(`The event stream ended with an error: ${end.error.message}`);
      return;
    }
    this.ended = true;
    let status = null;
    for (let tries = 0; tries < 5 && !this.destroyed; tries++) {
      try {
        status = await this.conn.request("status", { run_id: this.runId });
        break;
      } catch (err) {
        if (err.code !== "connection_lost") break;
      }
    }
    if (this.destroyed) return;
    if (!status) {
      // The status was refused (a restarted daemon, say): the terminal state the events
      // showed has the last word, not the "Stopping…" the button was left on.
      const state = this.stop.model.terminal ?? end.state ?? this.state;
      if (state && !LIVE.has(state)) {
        this._setState(state);
        this.stop.finish({ state });
        this.steer.finish();
        this._renderFacts();
      }
      return;
    }
    this.status = status;
    // Calls the runner never reported an outcome for were settled by the daemon (e.g.
    // "unknown" after a kill): the status has their last word.
    for (const rec of status.tool_calls ?? []) if (rec && rec.id) this.tools.set(rec.id, rec);
    this._renderTools();
    this._setState(status.state);
    this.stop.finish(status);
    this.steer.finish();
    this.approvals.onStatus(status);
    this.transcript.onStatus(status);
    this._renderFacts();
    this._renderResult();
    this._renderReceipt();
  }

  _renderFacts() {
    if (this.destroyed) return;
    const s = this.status ?? {};
    const dl = clear($("run-facts"));
    const row = (label, value) => dl.append(h("dt", { text: label }), h("dd", {}, value));
    row("State", [stateBadge(this.state ?? s.state), s.reason ? ` (${s.reason})` : ""]);
    row("Session", s.session_id ?? "none");
    row("Task", s.spec?.task ?? "—");
    row("Created", s.created_at ? `${fmtClock(s.created_at)} (${fmtAge(s.created_at)} ago)` : "—");
    const steps = Math.max(this.steps, s.result?.steps ?? 0, s.result?.step ?? 0, this.snapshot?.step ?? 0);
    row("Steps", String(steps));
    const running = [...this.tools.values()].filter((r) => r.state === "running").map((r) => literal(r.name));
    row("Current tool", running.length ? h("span", { class: "literal" }, running.flatMap((n, i) => (i ? [", ", n] : [n]))) : "—");
    row("Containment", s.containment ?? "—");
    if (s.pid) row("Runner pid", String(s.pid));
  }

  _renderTools() {
    const ul = clear($("tools"));
    if (this.tools.size === 0) {
      ul.append(h("li", { class: "muted", text: "None yet." }));
      return;
    }
    for (const rec of this.tools.values()) {
      ul.append(
        h(
          "li",
          { dataset: { state: rec.state, id: rec.id } },
          h("span", { class: "literal" }, toolLineNodes(rec)),
          rec.reason ? h("span", { class: "reason", text: rec.reason }) : null,
          rec.state !== "running" ? h("span", { class: "reason" }, "arguments: ", h("span", { class: "literal" }, literal(rec.arguments))) : null,
        ),
      );
    }
  }

  _renderResult() {
    const box = clear($("result"));
    const s = this.status;
    const terminal = s && !LIVE.has(s.state) && this.ended;
    const whole = terminal && s.result && !s.partial && s.state === "completed";
    $("result-title").textContent = whole ? "Result" : "Partial result";
    if (terminal && s.result) {
      const r = s.result;
      if (s.partial) box.append(h("p", { class: "muted", text: "The run ended before its final result: this is its last snapshot." }));
      else if (s.state !== "completed") box.append(h("p", { class: "muted", text: `The run ${s.state} with this progress:` }));
      if (r.final_text) box.append(h("p", { text: r.final_text }));
      else if (r.progress) box.append(h("p", { text: r.progress }));
      if (!r.final_text && r.unfinished_text) {
        box.append(h("p", { class: "muted", text: `Step ${r.unfinished_text.step}'s text was cut short.` }));
      }
      if (Array.isArray(r.unapplied_steering) && r.unapplied_steering.length) {
        box.append(h("p", { class: "muted", text: `Steering never applied: ${r.unapplied_steering.join(" · ")}` }));
      }
    } else if (this.snapshot) {
      const u = this.snapshot.unfinished_text;
      const where = u?.streaming ? `Step ${u.step}, the model writing:` : `After step ${this.snapshot.step}:`;
      box.append(h("p", { class: "muted", text: where }));
      box.append(h("p", { text: this.snapshot.progress || "(no text yet)" }));
      if (u && !u.streaming) box.append(h("p", { class: "muted", text: `Step ${u.step}'s text was cut short.` }));
    } else {
      box.append(h("p", { class: "muted", text: "Nothing yet." }));
    }
    if (terminal && s.error) box.append(h("p", { class: "error", text: `${s.error.code}: ${s.error.message}` }));
  }

  _renderReceipt() {
    const s = this.status;
    if (!s || !s.receipt) return;
    $("receipt-box").hidden = false;
    $("receipt-summary").textContent = $("stop-status").textContent || `Ended: ${s.state}`;
    clear($("receipt")).append(renderValue(s.receipt));
  }
}
