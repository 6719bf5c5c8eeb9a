// One run's events as list items: one <li> per journal event, carrying its seq, so what
// the page shows can be compared with the journal. Unknown kinds (added by later daemons)
// are shown with their data, never dropped. A call's name and arguments, and a process
// group's command, are shown literally with their look-alike characters marked
// (lookalike.js), as in the approval box.

import { fmtClock, fmtDuration, h, reveal, short } from "./dom.js";
import { literal } from "./lookalike.js";

const TOOL_MARK = {
  running: "▶",
  succeeded: "✔",
  failed: "✖",
  cancelled: "■",
  unknown: "?",
  not_started: "∅",
  rejected: "⊘", // denied, or a stop ended its wait for approval: it never ran
};

/** A call's one line, its name and (while it runs) its arguments as `show(text, max)`
 * gives them. */
function toolBits(rec, show) {
  const bits = [[`${TOOL_MARK[rec.state] ?? "•"} `, show(rec.name)]];
  if (rec.state === "running") {
    bits.push(show(rec.arguments, 160));
    // An MCP call's request was handed to its server (a stop now meets a sent call).
    if (rec.sent_at) bits.push("· sent");
  } else bits.push(rec.state.replace("_", " "));
  if (rec.started_at && rec.finished_at) bits.push(`in ${fmtDuration(rec.finished_at - rec.started_at)}`);
  return bits.flatMap((bit, i) => (i ? [" ", bit] : [bit]));
}

/** A call's one line as text. */
export function toolLine(rec) {
  return toolBits(rec, (text, max) => reveal(max ? short(text, max) : text)).flat().join("");
}

/** The same line as children of a ".literal" element, look-alike tokens marked. */
export function toolLineNodes(rec) {
  return toolBits(rec, literal);
}

function toolBody(rec) {
  const parts = [];
  if (rec.reason) parts.push(h("span", { class: "reason", text: rec.reason }));
  if (rec.error) parts.push(h("span", { class: "reason", text: `error: ${rec.error}` }));
  if (rec.output !== null && rec.output !== undefined && rec.state !== "running") {
    parts.push(
      h(
        "details",
        {},
        h("summary", { text: `Output${rec.output_truncated ? " (truncated)" : ""}` }),
        h("pre", { text: rec.output }),
      ),
    );
  }
  return parts;
}

const STEERING_TEXT = {
  queued: "queued",
  applied: "applied",
  unapplied: "never applied",
};

/** The human text and extra nodes for one event. */
export function describe(ev) {
  const d = ev.data ?? {};
  switch (ev.kind) {
    case "state": {
      let text = `State: ${d.state}`;
      if (d.reason) text += ` (${d.reason})`;
      if (d.partial) text += " · partial result kept";
      return { text };
    }
    case "runner_started":
      return { text: `Runner started: pid ${d.pid}, model ${d.provider ?? "?"}` };
    case "step_started":
      return { text: `Step ${d.step}` };
    case "assistant_text":
      return {
        text: `Model text, step ${d.step}${d.complete === false ? " (cut)" : ""}`,
        extra: [h("span", { class: "text", text: d.text ?? "" })],
      };
    case "tool_call": {
      const rec = d.record ?? {};
      return { text: toolLine(rec), nodes: toolLineNodes(rec), extra: toolBody(rec), literal: true };
    }
    case "process_group": {
      const head = `${d.kind ?? "process"} group ${d.pgid} ${d.alive === false ? "ended" : "started"}: `;
      return { text: head + reveal(short(d.name, 100)), nodes: [head, literal(d.name, 100)], literal: true };
    }
    case "step_snapshot":
      if (d.unfinished_text?.streaming) return { text: `Model text streaming, step ${d.step}` };
      return { text: `Partial result saved after step ${d.step}${d.unfinished_text ? " (its text cut short)" : ""}` };
    case "stop_requested": {
      const during = { tool: "a tool call", model: "a model request (aborted)", idle: "no work" }[d.during] ?? d.during;
      return { text: `The runner got the stop (${d.reason}) during ${during}` };
    }
    case "steering":
      return { text: `Steering ${STEERING_TEXT[d.state] ?? d.state}${d.step ? ` at step ${d.step}` : ""}: ${short(d.text, 200)}` };
    case "steer_sent":
      return { text: `Steering sent: ${short(d.text, 200)}` };
    case "steer_unsent":
      return { text: `Steering not sent (${short(d.why, 120)}): ${short(d.text, 200)}` };
    case "log":
      return { text: `Log ${d.level ?? ""}: ${short(d.message, 300)}` };
    case "stderr":
      return { text: `Runner stderr${d.problem ? ` (${d.problem})` : ""}: ${short(d.text, 300)}` };
    default:
      return { text: `${ev.kind}: ${short(JSON.stringify(d), 300)}` };
  }
}

export function renderEvent(ev) {
  const { text, nodes, extra, literal } = describe(ev);
  const attrs = { dataset: { seq: String(ev.seq), kind: ev.kind } };
  if (ev.kind === "state") attrs.dataset.state = ev.data?.state ?? "";
  return h(
    "li",
    attrs,
    h("span", { class: "seq", text: `#${ev.seq}` }),
    h("time", { class: "time", text: fmtClock(ev.ts) }),
    h("span", { class: literal ? "what literal" : "what" }, nodes ?? text),
    extra ?? [],
  );
}

/**
 * The whole step snapshot after a `step_snapshot` event's data `d`, given the whole one
 * before (`base`, or null): as the daemon folds it (subagent/events.py `fold_snapshot`).
 * A delta (it has `progress_at`) adds its text at `progress_at` and replaces or adds its
 * changed records; one not newer than `base` (`snapshot_n`) changes nothing; its
 * `unfinished_text` (set while the model streams, or after a turn cut short) is the whole
 * one's. An older runner's whole snapshot replaces `base`.
 */
export function foldSnapshot(base, d) {
  if (!("progress_at" in d)) return d;
  if (base && typeof base.snapshot_n === "number" && d.snapshot_n <= base.snapshot_n) return base;
  let progress = typeof base?.progress === "string" ? base.progress : "";
  const added = d.progress_added ?? "";
  progress = progress.slice(0, codePointIndex(progress, d.progress_at)) + added;
  const calls = Array.isArray(base?.tool_calls) ? [...base.tool_calls] : [];
  for (const rec of d.tool_calls_changed ?? []) {
    const i = calls.findIndex((c) => c && c.id === rec.id);
    if (i < 0) calls.push(rec);
    else calls[i] = rec;
  }
  const whole = { step: d.step, progress, tool_calls: calls, _id: d._id, snapshot_n: d.snapshot_n };
  // Where the progress ends with model text that is not whole (streaming, or cut short).
  if (d.unfinished_text && typeof d.unfinished_text === "object") whole.unfinished_text = d.unfinished_text;
  return whole;
}

/**
 * Where the `n`th code point of `s` starts, as a JS string index (`s.length` past its end).
 * The runner counts `progress_at` in code points, as Python does; a JS string counts UTF-16
 * units, two for a character beyond the BMP (an emoji).
 */
export function codePointIndex(s, n) {
  if (!/[\uD800-\uDBFF]/.test(s)) return Math.min(n, s.length);
  let i = 0;
  for (let k = 0; k < n && i < s.length; k++) {
    const high = s.charCodeAt(i) >= 0xd800 && s.charCodeAt(i) <= 0xdbff;
    const low = i + 1 < s.length && s.charCodeAt(i + 1) >= 0xdc00 && s.charCodeAt(i + 1) <= 0xdfff;
    i += high && low ? 2 : 1;
  }
  return i;
}

/** The later of two whole snapshots (by `snapshot_n`; an older runner's has none: the new one). */
export function laterSnapshot(a, b) {
  if (!a) return b;
  if (!b) return a;
  return typeof a.snapshot_n === "number" && typeof b.snapshot_n === "number" && a.snapshot_n > b.snapshot_n ? a : b;
}
