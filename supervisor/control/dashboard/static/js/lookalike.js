// Look-alike characters in what a person approves (the rule of supervisor/_lookalikes.py,
// which the CLI uses). A model driven by injected text can ask to approve
// "curl" of "pаypal.com" (a Cyrillic "а") or "ｒｍ -rf" (fullwidth letters): the person
// reads one thing and lets another run. A token (a run of letters, marks, digits and
// format characters, as a host label or a path segment is) is marked when it mixes
// scripts whose letters look like Latin ones, or holds compatibility forms of ASCII
// (fullwidth, mathematical alphanumerics: NFKC reads them as ASCII letters or digits).
// Text in one script (a Russian sentence, Chinese) is not marked. Shown, never changed.

import { h, reveal } from "./dom.js";

// Scripts with letters drawn like Latin ones; mixing Latin with Han, kana, Hangul,
// Arabic... in a token is not suspect (UTS #39; the others have no Latin look-alikes).
const SCRIPTS = ["Latin", "Greek", "Cyrillic", "Armenian", "Cherokee", "Coptic", "Lisu"].map((name) => [
  name,
  new RegExp(`^\\p{Script=${name}}$`, "u"),
]);
const LETTER = /^\p{L}$/u;
const TOKEN = /^[\p{L}\p{M}\p{N}\p{Cf}]$/u;
const ASCII_ALNUM = /^[A-Za-z0-9]+$/;
const NON_ASCII = /[^\x00-\x7f]/;

/** What NFKC makes of a non-ASCII character when that is ASCII letters or digits, else
 * null: not punctuation (an ellipsis, the fullwidth comma of Chinese text). */
function compat(c) {
  if (c.codePointAt(0) < 0x80) return null;
  const n = c.normalize("NFKC");
  return n !== c && ASCII_ALNUM.test(n) ? n : null;
}

const hex = (c) => `U+${c.codePointAt(0).toString(16).toUpperCase().padStart(4, "0")}`;

function formOf(c) {
  const cp = c.codePointAt(0);
  if (cp >= 0xff01 && cp <= 0xffef) return "fullwidth";
  if (cp >= 0x1d400 && cp <= 0x1d7ff) return "mathematical";
  return "compatibility form of";
}

function scriptOf(c) {
  for (const [name, re] of SCRIPTS) if (re.test(c)) return name;
  return null;
}

function tokens(text) {
  const out = [];
  let start = -1;
  let i = 0;
  for (const c of text) {
    const inside = TOKEN.test(c) || compat(c) !== null;
    if (inside && start < 0) start = i;
    else if (!inside && start >= 0) {
      out.push([start, i]);
      start = -1;
    }
    i += c.length;
  }
  if (start >= 0) out.push([start, text.length]);
  return out;
}

/**
 * The tokens of `text` to mark, in order: {start, end, token, notes}, each note naming
 * the characters as U+XXXX with their script, or the ASCII they stand for.
 */
export function lookalikes(text) {
  const s = String(text ?? "");
  if (!NON_ASCII.test(s)) return [];
  const found = [];
  for (const [start, end] of tokens(s)) {
    const token = s.slice(start, end);
    if (!NON_ASCII.test(token)) continue;
    const chars = [...token];
    const notes = [];
    const forms = [...new Set(chars.filter((c) => compat(c) !== null))];
    if (forms.length) {
      const read = chars.map((c) => compat(c) ?? c).join("");
      notes.push(`compatibility forms, read "${reveal(read)}": ${forms.map((c) => `${hex(c)} ${formOf(c)} "${compat(c)}"`).join(", ")}`);
    }
    const scripts = new Map();
    for (const c of chars) {
      if (forms.includes(c) || !LETTER.test(c)) continue;
      const script = scriptOf(c);
      if (script) scripts.set(script, [...(scripts.get(script) ?? []), c]);
    }
    if (scripts.size > 1) {
      const names = [...scripts.keys()];
      const main = scripts.has("Latin") ? "Latin" : names.reduce((a, b) => (scripts.get(b).length > scripts.get(a).length ? b : a));
      const odd = new Set();
      for (const [script, cs] of scripts) if (script !== main) for (const c of cs) odd.add(`${hex(c)} ${script}`);
      notes.push(`mixed scripts (${names.join(", ")}): ${[...odd].join(", ")}`);
    }
    if (notes.length) found.push({ start, end, token, notes });
  }
  return found;
}

const describe = (f) => `"${reveal(f.token)}": ${f.notes.join("; ")}`;

/**
 * `text` as reveal (dom.js) shows it, each look-alike token in a <mark class="lookalike">
 * whose title names its characters: children for an element of class "literal".
 */
export function literal(text) {
  const s = String(text ?? "");
  const out = [];
  let at = 0;
  for (const f of lookalikes(s)) {
    if (f.start > at) out.push(reveal(s.slice(at, f.start)));
    out.push(h("mark", { class: "lookalike", title: describe(f), text: reveal(f.token) }));
    at = f.end;
  }
  if (at < s.length || out.length === 0) out.push(reveal(s.slice(at)));
  return out;
}

/** A visible legend naming the look-alike characters of `texts`, or null when none. */
export function lookalikeNote(...texts) {
  const lines = [...new Set(texts.flatMap((t) => lookalikes(t)).map(describe))];
  if (lines.length === 0) return null;
  return h("p", { class: "lookalike-note", role: "note" }, "Look-alike characters: ", lines.join(" · "));
}
