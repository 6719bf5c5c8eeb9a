// Small DOM and formatting helpers. Text only ever goes in as text (never as HTML):
// events carry whatever a model or a tool printed.

/** Create an element: h("li", {class: "x", dataset: {seq: 1}}, "text", child). */
export function h(tag, attrs = {}, ...children) {
  const el = document.createElement(tag);
  for (const [key, value] of Object.entries(attrs)) {
    if (value === undefined || value === null || value === false) continue;
    if (key === "class") el.className = value;
    else if (key === "dataset") Object.assign(el.dataset, value);
    else if (key === "text") el.textContent = value;
    else if (key in el && typeof value !== "string") el[key] = value;
    else el.setAttribute(key, value === true ? "" : String(value));
  }
  append(el, children);
  return el;
}

function append(el, children) {
  for (const child of children) {
    if (child === undefined || child === null || child === false) continue;
    if (Array.isArray(child)) append(el, child);
    else el.append(child instanceof Node ? child : String(child));
  }
}

export function clear(el) {
  while (el.firstChild) el.removeChild(el.firstChild);
  return el;
}

// Characters that change what is shown without showing themselves: bidi controls (they
// reorder the text around them: an approval read "# ; rm -rf ~" for "~ fr- mr ; #"),
// zero-width and other format characters, control characters, line and paragraph
// separators, spaces other than U+0020, blank "filler" letters and variation selectors.
const HIDDEN =
  /[\p{Cf}\p{Cc}\p{Zl}\p{Zp}\p{Zs}\u034F\u115F\u1160\u17B4\u17B5\u180B-\u180F\u2800\u3164\uFE00-\uFE0F\uFFA0\u{E0100}-\u{E01EF}]/gu;

/**
 * `text` with each character that would not show itself (HIDDEN) written as a visible
 * mark, e.g. "⟦U+202E⟧". For what a person judges a call by (a tool's name, its
 * arguments, a command): shown with the class "literal" (app.css), which also lays the
 * rest out in the order it is stored, so what is seen is what runs.
 */
export function reveal(text) {
  return String(text ?? "").replace(HIDDEN, (c) =>
    c === " " ? c : `⟦U+${c.codePointAt(0).toString(16).toUpperCase().padStart(4, "0")}⟧`,
  );
}

/** "43 ms", "1.2 s", "2 min 5 s", "3 h 4 min". */
export function fmtDuration(seconds) {
  if (typeof seconds !== "number" || !Number.isFinite(seconds)) return "?";
  const s = Math.max(0, seconds);
  if (s < 1) return `${Math.round(s * 1000)} ms`;
  if (s < 10) return `${+s.toFixed(2)} s`;
  if (s < 60) return `${+s.toFixed(1)} s`;
  if (s < 3600) return `${Math.floor(s / 60)} min ${Math.floor(s % 60)} s`;
  return `${Math.floor(s / 3600)} h ${Math.floor((s % 3600) / 60)} min`;
}

/** Age of a wall-clock timestamp (seconds since the epoch). */
export function fmtAge(ts, nowMs = Date.now()) {
  if (typeof ts !== "number") return "-";
  const s = Math.max(0, nowMs / 1000 - ts);
  if (s < 60) return `${Math.floor(s)} s`;
  if (s < 3600) return `${Math.floor(s / 60)} min`;
  if (s < 86400) return `${Math.floor(s / 3600)} h ${Math.floor((s % 3600) / 60)} min`;
  return `${Math.floor(s / 86400)} d`;
}

/** Local clock time with milliseconds, for event timestamps. */
export function fmtClock(ts) {
  if (typeof ts !== "number") return "";
  const d = new Date(ts * 1000);
  const pad = (n, w = 2) => String(n).padStart(w, "0");
  return `${pad(d.getHours())}:${pad(d.getMinutes())}:${pad(d.getSeconds())}.${pad(d.getMilliseconds(), 3)}`;
}

export function plural(n, one, many = `${one}s`) {
  return `${n} ${n === 1 ? one : many}`;
}

export function short(text, max = 80) {
  const s = String(text ?? "");
  return s.length > max ? `${s.slice(0, max - 1)}…` : s;
}

/** A state badge: text, not only colour. */
export function stateBadge(state) {
  return h("span", { class: `state state-${state}`, text: state ?? "?" });
}

/** Render any JSON value as nested definition lists (new receipt fields show up as is). */
export function renderValue(value) {
  if (Array.isArray(value)) {
    if (value.length === 0) return h("span", { class: "muted", text: "none" });
    return h("ol", { class: "kv-list" }, value.map((v) => h("li", {}, renderValue(v))));
  }
  if (value && typeof value === "object") {
    const entries = Object.entries(value);
    if (entries.length === 0) return h("span", { class: "muted", text: "{}" });
    return h("dl", { class: "kv" }, entries.map(([k, v]) => [h("dt", { text: k }), h("dd", {}, renderValue(v))]));
  }
  if (value === null || value === undefined) return h("span", { class: "muted", text: "—" });
  return document.createTextNode(String(value));
}
