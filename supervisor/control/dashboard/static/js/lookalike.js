// Look-alike characters in what a person approves (the rule of supervisor/_lookalikes.py,
// which the CLI uses). A model driven by injected text can ask to approve
// "curl" of "pаypal.com" (a Cyrillic "а") or "ｒｍ -rf" (fullwidth letters): the person
// reads one thing and lets another run. A token (a run of letters, marks, digits and
// format characters, as a host label or a path segment is) is marked when it mixes
// scripts whose letters look like Latin ones, or holds compatibility forms of ASCII
// (fullwidth, mathematical alphanumerics: NFKC reads them as ASCII letters or digits), or
// is all Cyrillic or all Greek letters that each look Latin ("аррӏе": the whole-script
// rule) amid Latin text. Russian, Greek or Chinese prose is not marked. Shown, never changed.

import { h, reveal } from "./dom.js";

// Scripts with letters drawn like Latin ones; mixing Latin with Han, kana, Hangul,
// Arabic... in a token is not suspect (UTS #39; the others have no Latin look-alikes).
const SCRIPTS = ["Latin", "Greek", "Cyrillic", "Armenian", "Cherokee", "Coptic", "Lisu"].map((name) => [
  name,
  new RegExp(`^\\p{Script=${name}}$`, "u"),
]);
// Cyrillic and Greek letters drawn like one Latin letter, each with the letter it reads as:
// the string of supervisor/_lookalikes.py TWIN_PAIRS (its comment says how it was checked
// against Unicode's confusables.txt, and what is left out on purpose).
const TWIN_PAIRS =
  // Cyrillic small: а с е һ і ј о р ѕ у х ӏ ԁ ԛ ԝ ү ѵ
  "\u0430a \u0441c \u0435e \u04bbh \u0456i \u0458j \u043eo \u0440p \u0455s \u0443y \u0445x " +
  "\u04cfl \u0501d \u051bq \u051dw \u04afy \u0475v " +
  // Cyrillic capital: А В Е К М Н О Р С Т У Х Ѕ І Ј Ӏ Ү
  "\u0410A \u0412B \u0415E \u041aK \u041cM \u041dH \u041eO \u0420P \u0421C \u0422T \u0423Y " +
  "\u0425X \u0405S \u0406I \u0408J \u04c0I \u04aeY " +
  // Greek small: α γ ι ν ο ρ υ
  "\u03b1a \u03b3y \u03b9i \u03bdv \u03bfo \u03c1p \u03c5u " +
  // Greek capital: Α Β Ε Ζ Η Ι Κ Μ Ν Ο Ρ Τ Υ Χ
  "\u0391A \u0392B \u0395E \u0396Z \u0397H \u0399I \u039aK \u039cM \u039dN \u039fO \u03a1P " +
  "\u03a4T \u03a5Y \u03a7X";
export const TWINS = new Map(TWIN_PAIRS.split(" ").map((pair) => [pair[0], pair[1]]));
// What ends the word a token is in, for the whole-script rule: white space, quotes and the
// punctuation between arguments (JSON, shell). A host, a path, an address stay one word.
const WORD_END = /[\s"'`,;:=(){}[\]<>|&]/u;
const ASCII_DIGIT = /^[0-9]$/;
const FORMAT = /^\p{Cf}$/u;
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

/** Its letters by script (those with Latin look-alikes), compatibility forms aside. */
function scriptsOf(token) {
  const scripts = new Map();
  for (const c of token) {
    if (compat(c) !== null || !LETTER.test(c)) continue;
    const script = scriptOf(c);
    if (script) scripts.set(script, [...(scripts.get(script) ?? []), c]);
  }
  return scripts;
}

/** Whether the word around s[start, end) holds ASCII letters or digits beside it:
 * "аррӏе.com", "/srv/ѕсоре/x", '"host":"аррӏе"' (a word ends at WORD_END). */
function wordHasAscii(s, start, end) {
  let i = start;
  while (i > 0 && !WORD_END.test(s[i - 1])) i--;
  let j = end;
  while (j < s.length && !WORD_END.test(s[j])) j++;
  return /[A-Za-z0-9]/.test(s.slice(i, start) + s.slice(end, j));
}

/** The Latin a token reads as when it is all Cyrillic or all Greek letters with Latin
 * twins (ASCII digits and format characters may stand among them), else null. */
function wholeScript(token, scripts) {
  if (scripts.size !== 1 || !["Cyrillic", "Greek"].includes([...scripts.keys()][0])) return null;
  const chars = [...token];
  if (!chars.every((c) => TWINS.has(c) || ASCII_DIGIT.test(c) || FORMAT.test(c))) return null;
  return chars.filter((c) => TWINS.has(c) || ASCII_DIGIT.test(c)).map((c) => TWINS.get(c) ?? c).join("");
}

/**
 * The tokens of `text` to mark, in order: {start, end, token, notes}, each note naming
 * the characters as U+XXXX with their script, or the ASCII they stand for. A whole-script
 * look-alike ("аррӏе") is marked only amid Latin text: when its word holds ASCII letters
 * or digits beside it (a host, a path segment), or no other token of the text has a letter
 * of its script ("ssh ѕсоре"). In Russian or Greek prose it is a word.
 */
export function lookalikes(text) {
  const s = String(text ?? "");
  if (!NON_ASCII.test(s)) return [];
  const found = [];
  const spans = tokens(s);
  const perToken = spans.map(([start, end]) => scriptsOf(s.slice(start, end)));
  spans.forEach(([start, end], n) => {
    const token = s.slice(start, end);
    if (!NON_ASCII.test(token)) return;
    const chars = [...token];
    const notes = [];
    const forms = [...new Set(chars.filter((c) => compat(c) !== null))];
    if (forms.length) {
      const read = chars.map((c) => compat(c) ?? c).join("");
      notes.push(`compatibility forms, read "${reveal(read)}": ${forms.map((c) => `${hex(c)} ${formOf(c)} "${compat(c)}"`).join(", ")}`);
    }
    const scripts = perToken[n];
    if (scripts.size > 1) {
      const names = [...scripts.keys()];
      const main = scripts.has("Latin") ? "Latin" : names.reduce((a, b) => (scripts.get(b).length > scripts.get(a).length ? b : a));
      const odd = new Set();
      for (const [script, cs] of scripts) if (script !== main) for (const c of cs) odd.add(`${hex(c)} ${script}`);
      notes.push(`mixed scripts (${names.join(", ")}): ${[...odd].join(", ")}`);
    }
    const read = forms.length ? null : wholeScript(token, scripts);
    if (read !== null) {
      const [script] = scripts.keys();
      const alone = !perToken.some((other, m) => m !== n && other.has(script));
      if (alone || wordHasAscii(s, start, end)) {
        const letters = [...new Set(chars.filter((c) => TWINS.has(c)))];
        notes.push(`all ${script}, read "${read}": ${letters.map((c) => `${hex(c)} ${script} "${TWINS.get(c)}"`).join(", ")}`);
      }
    }
    if (notes.length) found.push({ start, end, token, notes });
  });
  return found;
}

const describe = (f) => `"${reveal(f.token)}": ${f.notes.join("; ")}`;

/**
 * `text` as reveal (dom.js) shows it, each look-alike token in a <mark class="lookalike">
 * whose title names its characters: children for an element of class "literal". With
 * `max`, cut as dom.js `short` cuts it; the tokens are found in the whole text, so a cut
 * that leaves one word of a Greek sentence does not make it look alone amid Latin.
 */
export function literal(text, max = Infinity) {
  const whole = String(text ?? "");
  const cut = whole.length > max ? max - 1 : whole.length;
  const s = whole.slice(0, cut);
  const out = [];
  let at = 0;
  for (const f of lookalikes(whole)) {
    if (f.start >= cut) break;
    if (f.start > at) out.push(reveal(s.slice(at, f.start)));
    at = Math.min(f.end, cut);
    out.push(h("mark", { class: "lookalike", title: describe(f), text: reveal(s.slice(f.start, at)) }));
  }
  if (at < s.length || out.length === 0) out.push(reveal(s.slice(at)));
  if (cut < whole.length) out.push("…");
  return out;
}

/** A visible legend naming the look-alike characters of `texts`, or null when none. */
export function lookalikeNote(...texts) {
  const lines = [...new Set(texts.flatMap((t) => lookalikes(t)).map(describe))];
  if (lines.length === 0) return null;
  return h("p", { class: "lookalike-note", role: "note" }, "Look-alike characters: ", lines.join(" · "));
}
