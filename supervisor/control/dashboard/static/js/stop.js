// The Stop button, in two phases, telling the truth.
//
// Phase 1, at once: a press disables the button and relabels it "Stopping…" before the
// cancel request is even sent; a second press does nothing (and the daemon's cancel is
// idempotent anyway). Phase 2: what is really happening, from the run's own events (the
// stop reaching the runner, a tool being interrupted or finishing by its policy, process
// groups ending, the grace running out), and at the end the truth from the stop receipt.
// A stop asked elsewhere (the CLI, another page) shows the same way. A press on a run
// that has already ended says so. A dropped connection while the cancel is in flight
// sends it again on the next connection (cancel is idempotent).

import { clear, fmtDuration, h, reveal } from "./dom.js";
import { stopSummary } from "./receipt.js";

const LIVE = new Set(["queued", "starting", "running", "cancelling", "awaiting_approval"]);

/** Pure model of a stop, fed with the run's events in order. */
export class StopModel {
  constructor() {
    this.stopTs = null; // wall-clock time of the "cancelling" state, or of the press
    this.steps = []; // [{atS, text}]
    this.running = new Map(); // tool call id -> record, while running
    this.names = new Map(); // tool call id -> its tool's name (for approval answers)
    this.finishedFirst = []; // [{name, afterS}]
    this.terminal = null;
    this.stopSeen = false;
    this.sentSeen = false;
  }

  _step(ts, text) {
    const atS = this.stopTs !== null && typeof ts === "number" ? Math.max(0, ts - this.stopTs) : null;
    this.steps.push({ atS, text });
  }

  /** Feed one event; returns true when it changed what the stop shows. */
  feed(ev) {
    const d = ev.data ?? {};
    if (ev.kind === "tool_call" && d.record) {
      const rec = { ...d.record, name: reveal(d.record.name) }; // a tool's name as stored (dom.js)
      if (rec.id && rec.name) this.names.set(rec.id, rec.name);
      if (rec.state === "running") this.running.set(rec.id, rec);
      else this.running.delete(rec.id);
      if (!this.stopSeen) return false;
      if (rec.state === "running") return false;
      if (rec.state === "cancelled") {
        this._step(ev.ts, `${rec.name} interrupted${rec.reason ? `: ${rec.reason}` : ""}`);
      } else if (rec.state === "not_started") {
        this._step(ev.ts, `${rec.name} never started (the stop came first)`);
      } else if (rec.stop_effect === "background_ended") {
        // A call done before the stop, whose background command the stop ended (its
        // record is sent again at the run's end): not a call that finished after the stop.
        this._step(ev.ts, `${rec.name}: its background command was ended by the stop`);
      } else if (rec.state === "succeeded" || rec.state === "failed") {
        const afterS = typeof rec.finished_at === "number" && this.stopTs !== null ? Math.max(0, rec.finished_at - this.stopTs) : 0;
        this.finishedFirst.push({ name: rec.name, afterS });
        this._step(ev.ts, `${rec.name} finished after the stop (${rec.state}, ${fmtDuration(afterS)} after it)`);
      } else {
        this._step(ev.ts, `${rec.name}: ${rec.state}${rec.reason ? ` (${rec.reason})` : ""}`);
      }
      return true;
    }
    if (ev.kind === "state") {
      if (d.state === "cancelling" && !this.sentSeen) {
        // The daemon signals the runner (path A) before it journals "cancelling", so the
        // runner's own "stop_requested" may come first: this step still goes first.
        this.sentSeen = true;
        const text = `Stop sent to the runner (reason: ${d.reason ?? "user"})`;
        if (this.stopSeen) {
          this.steps.unshift({ atS: 0, text });
        } else {
          this.stopSeen = true;
          this.stopTs = ev.ts;
          this._step(ev.ts, text);
        }
        return true;
      }
      if (!LIVE.has(d.state)) {
        this.terminal = d.state;
        if (this.stopSeen) this._step(ev.ts, `Run ${d.state} (outcome recorded)`);
        return true;
      }
      return false;
    }
    if (!this.stopSeen) {
      if (ev.kind === "stop_requested") {
        // A runner stopped by its own deadline: no "cancelling" state came first.
        this.stopSeen = true;
        this.stopTs = ev.ts;
      } else {
        return false;
      }
    }
    switch (ev.kind) {
      case "stop_requested": {
        this._step(ev.ts, `The runner got the stop during ${{ tool: "a tool call", model: "a model request (aborted at once)", idle: "no work" }[d.during] ?? d.during}`);
        for (const rec of this.running.values()) {
          const policy = rec.stop_policy ? ` (${rec.stop_policy})` : "";
          this._step(ev.ts, `${rec.name} is still running${policy}: waiting for it`);
        }
        return true;
      }
      case "process_group":
        if (d.alive === false) {
          this._step(ev.ts, `${d.kind ?? "process"} group ${d.pgid} ended`);
          return true;
        }
        return false;
      case "steering":
        if (d.state === "unapplied") {
          this._step(ev.ts, `Steering never applied: ${d.text}`);
          return true;
        }
        return false;
      case "approval_answered": {
        // A call that awaited approval when the stop came: the stop ends the wait.
        const name = this.names.get(d.call_id) ?? "a call";
        const why = d.reason ? ` (${d.reason})` : "";
        const text = {
          rejected: `${name} was awaiting approval: the stop ended the wait; it never ran${why}`,
          denied: `${name} denied${why}: it never ran`,
          approved: `${name} approved${why}`,
        }[d.decision] ?? `${name}: approval ${d.decision ?? "answered"}${why}`;
        this._step(ev.ts, text);
        return true;
      }
      case "approval_requested":
      case "assistant_text":
      case "step_started":
      case "step_snapshot":
      case "runner_started":
      case "steer_sent":
      case "steer_unsent":
        return false;
      default:
        // Kinds this page does not know yet (richer stop events from a later daemon).
        this._step(ev.ts, `${ev.kind}: ${d.message ?? d.text ?? JSON.stringify(d)}`);
        return true;
    }
  }

  /** What the stop is waiting for right now. */
  current() {
    if (this.running.size > 0) {
      const names = [...this.running.values()].map((r) => r.name).join(", ");
      return `Waiting for ${names} to finish or be interrupted`;
    }
    return "Waiting for the runner's processes to exit";
  }
}

export class StopControl {
  /**
   * @param button the Stop button; @param statusEl its role=status line;
   * @param stepsEl an <ol> for the stop's steps; @param cancel () => Promise<reply>.
   */
  constructor(button, statusEl, stepsEl, { cancel, graceS = null }) {
    this.button = button;
    this.statusEl = statusEl;
    this.stepsEl = stepsEl;
    this.cancel = cancel;
    this.graceS = graceS;
    this.model = new StopModel();
    this.pressed = false;
    this.phase = "idle"; // idle | stopping | done
    this.state = null;
    this.graceTimer = null;
    this.onPress = () => this.press();
    button.addEventListener("click", this.onPress);
    this._render();
  }

  destroy() {
    this.button.removeEventListener("click", this.onPress);
    clearTimeout(this.graceTimer);
  }

  setGrace(graceS) {
    this.graceS = graceS;
  }

  /** The run's state as known from status (before or between events). */
  setState(state) {
    this.state = state;
    if (state === "cancelling" && this.phase === "idle") this.phase = "stopping";
    this._render();
  }

  press() {
    if (this.pressed || this.phase === "done") return; // twice = once
    this.pressed = true;
    this.phase = "stopping";
    this.button.disabled = true;
    this.button.textContent = "Stopping…";
    this._status("Sending the stop…");
    this._send();
  }

  _send() {
    this.cancel().then(
      (reply) => {
        if (reply.was_active === false) {
          this.phase = "done";
          this.late = reply.state;
          this._render();
        } else if (this.phase === "stopping" && !this.model.stopSeen) {
          this._status("Stop sent; waiting for the run to react");
        }
      },
      (err) => {
        if (err.code === "connection_lost") {
          this._status("Connection lost; the stop is sent again on reconnect");
          this._send(); // queued until the connection is back; cancel is idempotent
        } else {
          this.pressed = false;
          this.phase = this.model.stopSeen ? "stopping" : "idle";
          if (err.code === "not_sent") {
            this._status(`The stop was not sent (${err.message}); it will not be sent later. Press Stop again.`);
          } else if (err.code === "timeout") {
            this._status(`No answer to the stop (${err.message}); the run's events will show whether it arrived.`);
          } else {
            this._status(`The stop was refused: ${err.message}`);
          }
          this._render();
        }
      },
    );
  }

  /** Feed a run event (in seq order). */
  feed(ev) {
    const changed = this.model.feed(ev);
    if (ev.kind === "state") this.state = ev.data?.state ?? this.state;
    if (this.model.stopSeen && this.phase === "idle") this.phase = "stopping";
    if (changed && this.model.stopSeen && this.model.terminal === null) this._armGrace();
    if (changed) this._render();
  }

  _armGrace() {
    if (this.graceTimer !== null || this.graceS === null || this.model.stopTs === null) return;
    const dueMs = (this.model.stopTs + this.graceS) * 1000 - Date.now();
    this.graceTimer = setTimeout(() => {
      if (this.model.terminal === null && this.phase === "stopping") {
        this.model.steps.push({ atS: this.graceS, text: `Grace of ${fmtDuration(this.graceS)} over: the daemon escalates to SIGKILL` });
        this._render();
      }
    }, Math.max(0, dueMs) + 50);
  }

  /** The run is terminal: its status (with the receipt) has the last word. */
  finish(status) {
    this.phase = "done";
    this.state = status.state;
    this.finalText = this.late
      ? null
      : this.model.stopSeen || this.pressed
        ? stopSummary(status, { finishedFirst: this.model.finishedFirst, pressed: true })
        : null;
    clearTimeout(this.graceTimer);
    this._render();
  }

  _status(text) {
    this.statusEl.textContent = text;
  }

  _render() {
    const b = this.button;
    b.dataset.phase = this.phase;
    if (this.phase === "idle") {
      b.textContent = "Stop";
      b.disabled = !(this.state && LIVE.has(this.state) && this.state !== "cancelling");
    } else if (this.phase === "stopping") {
      b.textContent = "Stopping…";
      b.disabled = true;
      if (this.model.stopSeen) this._status(`Stopping… ${this.model.current()}`);
    } else {
      b.disabled = true;
      if (this.late) {
        b.textContent = "Stop";
        this._status(`The run had already ended (${this.late}): nothing to stop`);
      } else if (this.finalText) {
        b.textContent = this.state === "cancelled" ? "Stopped" : "Stop";
        this._status(this.finalText);
      } else {
        b.textContent = "Stop";
      }
    }
    clear(this.stepsEl);
    for (const s of this.model.steps) {
      this.stepsEl.append(h("li", {}, s.atS === null ? "" : `+${fmtDuration(s.atS)} `, s.text));
    }
  }
}
