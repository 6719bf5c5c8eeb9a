// The steering box: extra input for a running turn, and whether each piece was applied.
//
// What is shown comes from the run's events (so a reload shows the same): the daemon's
// "steer_sent" when it passed the text to the runner, then the runner's "steering" events
// (queued, applied at step N, or never applied when the run ended first). Steering carries
// no id, so events are matched to what was sent by text, first in first out. A refusal
// (the run is stopping or ended) is not journaled: it is shown from the reply; but one
// journaled and then not written into the runner's input is ("steer_unsent").

import { clear, h } from "./dom.js";

const LABEL = {
  refused: "not accepted",
  sent: "sent",
  queued: "queued for the next step",
  applied: "applied",
  unapplied: "never applied (the run ended first)",
  unknown: "sent; connection lost before the answer",
  unanswered: "sent; no answer (whether it arrived is unknown)",
  unsent: "not sent (no connection to the daemon)",
};

export class SteerModel {
  constructor() {
    this.items = []; // {text, state, step, why}
  }

  feed(ev) {
    const d = ev.data ?? {};
    if (ev.kind === "steer_sent") {
      this.items.push({ text: d.text, state: "sent", step: null });
      return true;
    }
    if (ev.kind === "steer_unsent") {
      // Journaled, then not written into the runner's input: it never reached it.
      const item = [...this.items].reverse().find((it) => it.text === d.text && it.state === "sent");
      if (item) Object.assign(item, { state: "refused", why: d.why });
      return Boolean(item);
    }
    if (ev.kind !== "steering") return false;
    // Each text moves sent -> queued -> applied | unapplied; the oldest item that can take
    // this step does.
    const from = d.state === "queued" ? ["sent"] : ["sent", "queued"];
    let item = this.items.find((it) => it.text === d.text && from.includes(it.state));
    if (!item) {
      item = { text: d.text, state: d.state, step: null };
      this.items.push(item);
    }
    item.state = d.state;
    if (d.step) item.step = d.step;
    return true;
  }
}

export class SteerBox {
  constructor({ form, textarea, button, list }, { send }) {
    this.form = form;
    this.textarea = textarea;
    this.button = button;
    this.list = list;
    this.send = send;
    this.model = new SteerModel();
    this.local = []; // refusals and unknown outcomes, not in the journal
    this.live = false;
    this.onSubmit = (e) => {
      e.preventDefault();
      this.submit();
    };
    form.addEventListener("submit", this.onSubmit);
    this.render();
  }

  destroy() {
    this.form.removeEventListener("submit", this.onSubmit);
  }

  setLive(live, state = null) {
    this.live = live;
    this.textarea.disabled = !live;
    this.button.disabled = !live;
    // An ended run takes no more input: the form goes, what was sent stays listed.
    this.form.hidden = !live && state !== null && !["queued", "starting", "running", "cancelling", "awaiting_approval"].includes(state);
  }

  async submit() {
    const text = this.textarea.value.trim();
    if (!text || !this.live) return;
    this.button.disabled = true;
    try {
      const reply = await this.send(text);
      if (reply.accepted) {
        this.textarea.value = "";
      } else {
        this.local.push({ text, state: "refused", why: reply.why ?? reply.state });
      }
    } catch (err) {
      const state = { connection_lost: "unknown", timeout: "unanswered", not_sent: "unsent" }[err.code] ?? "refused";
      this.local.push({ text, state, why: err.message });
    } finally {
      this.button.disabled = !this.live;
      this.render();
    }
  }

  feed(ev) {
    if (this.model.feed(ev)) this.render();
  }

  /** The run has ended: what it never applied, it never will (even if it was killed
   * before it could say so). */
  finish() {
    for (const it of this.model.items) if (it.state === "sent" || it.state === "queued") it.state = "unapplied";
    this.render();
  }

  render() {
    clear(this.list);
    // A refusal the journal has (``steer_unsent``) is shown once, from the journal.
    const journaled = new Set(this.model.items.filter((it) => it.state === "refused").map((it) => it.text));
    const local = this.local.filter((it) => !(it.state === "refused" && journaled.has(it.text)));
    for (const it of [...this.model.items, ...local]) {
      let label = LABEL[it.state] ?? it.state;
      if (it.state === "applied" && it.step) label += ` at step ${it.step}`;
      if (it.why) label += `: ${it.why}`;
      this.list.append(
        h("li", { dataset: { state: it.state } }, h("span", { class: `tag tag-${it.state}`, text: label }), it.text),
      );
    }
  }
}
