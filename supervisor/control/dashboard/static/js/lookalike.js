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
const WORD_REST = /[^\s"'`,;:=(){}[\]<>|&]*/y;
const NON_ASCII = /[^\x00-\x7f]/;
const NON_ASCII_RUN = /[^\x00-\x7f]+/g;
const ALNUM_RUN = /[A-Za-z0-9]*/y;
const ALNUM_RUNS = /[A-Za-z0-9]+/g;
const PIECE = /[A-Za-z0-9]+|[^\x00-\x7f]+/g;
const ASCII_ALNUM = /^[A-Za-z0-9]+$/;
const ASCII_DIGIT = /^[0-9]$/;
const FORMAT = /^\p{Cf}$/u;
const LETTER = /^\p{L}$/u;
const TOKEN = /^[\p{L}\p{M}\p{N}\p{Cf}]$/u;
const isAlnum = (code) => (code >= 48 && code <= 57) || (code >= 65 && code <= 90) || (code >= 97 && code <= 122);
// The bounds of supervisor/_lookalikes.py (its comments say why): a text is checked up to
// SCAN_MAX characters (UTF-16 units here) when non-ASCII ones lie beyond, and says so; a
// note quotes NOTE_QUOTE characters of a token and names NOTE_MAX_CHARS of its characters
// (each once, with a count); a legend names NOTE_MAX_TOKENS tokens.
export const SCAN_MAX = 256 * 1024;
const NOTE_QUOTE = 40;
const NOTE_MAX_CHARS = 5;
const NOTE_MAX_TOKENS = 5;
// Checks kept by text, so that a view re-rendered every 500 ms (the runs list) does not
// check ~1 MiB of arguments again each time; the oldest is dropped past CACHE_MAX.
const CACHE_MAX = 64;
const cache = new Map();

const hex = (c) => `U+${c.codePointAt(0).toString(16).toUpperCase().padStart(4, "0")}`;

function formOf(c) {
  const cp = c.codePointAt(0);
  if (cp >= 0xff01 && cp <= 0xffef) return "fullwidth";
  if (cp >= 0x1d400 && cp <= 0x1d7ff) return "mathematical";
  return "compatibility form of";
}

/** What the check needs of a non-ASCII character: whether it is in a token (a letter, mark,
 * digit, format character or compatibility form), a letter's script among SCRIPTS, what
 * NFKC makes of it when that is ASCII letters or digits (not punctuation: an ellipsis). */
function classify(c) {
  const n = c.normalize("NFKC");
  const compat = n !== c && ASCII_ALNUM.test(n) ? n : null;
  let script = null;
  if (compat === null && LETTER.test(c)) for (const [name, re] of SCRIPTS) if (re.test(c)) script = script ?? name;
  const format = FORMAT.test(c);
  return { inside: TOKEN.test(c) || compat !== null, script, compat, format };
}

/** A `quoted` text, cut to NOTE_QUOTE characters with its length when longer. */
function quote(s) {
  const head = Array.from(s.slice(0, 2 * NOTE_QUOTE)).slice(0, NOTE_QUOTE).join("");
  return head.length < s.length ? `"${reveal(head)}…" (${s.length.toLocaleString("en")} characters)` : `"${reveal(s)}"`;
}

/** NOTE_MAX_CHARS of `chars` named by `name`, each with its count in `token`. */
function named(chars, token, name) {
  const out = chars.slice(0, NOTE_MAX_CHARS).map((c) => {
    const n = token.split(c).length - 1;
    return name(c) + (n > 1 ? ` ×${n.toLocaleString("en")}` : "");
  });
  if (chars.length > NOTE_MAX_CHARS) out.push(`and ${(chars.length - NOTE_MAX_CHARS).toLocaleString("en")} more`);
  return out.join(", ");
}

/** Where the tokens holding a non-ASCII character are in `s`: runs of ASCII letters and
 * digits and of non-ASCII characters that are inside (a zero-width joiner does not split a
 * token). Only non-ASCII characters are looked at one by one. */
function tokens(s, char) {
  const out = [];
  let start = -1;
  let pos = 0;
  NON_ASCII_RUN.lastIndex = 0;
  for (let m; (m = NON_ASCII_RUN.exec(s)); ) {
    const a = m.index;
    if (start >= 0) {
      ALNUM_RUN.lastIndex = pos;
      ALNUM_RUN.exec(s);
      if (ALNUM_RUN.lastIndex < a) {
        out.push([start, ALNUM_RUN.lastIndex]);
        start = -1;
      }
    }
    let i = a;
    for (const c of m[0]) {
      if (char(c).inside) {
        if (start < 0) {
          start = i;
          if (i === a) while (start > pos && isAlnum(s.charCodeAt(start - 1))) start--;
        }
      } else if (start >= 0) {
        out.push([start, i]);
        start = -1;
      }
      i += c.length;
    }
    pos = NON_ASCII_RUN.lastIndex;
  }
  if (start >= 0) {
    ALNUM_RUN.lastIndex = pos;
    ALNUM_RUN.exec(s);
    out.push([start, ALNUM_RUN.lastIndex]);
  }
  return out;
}

/** Its letters by script (those with Latin look-alikes), compatibility forms aside; its
 * ASCII letters only make "Latin" a key, in their place. */
function scriptsOf(token, char) {
  const scripts = new Map();
  for (const piece of token.match(PIECE) ?? []) {
    if (!NON_ASCII.test(piece)) {
      if (!/^[0-9]+$/.test(piece) && !scripts.has("Latin")) scripts.set("Latin", []);
      continue;
    }
    for (const c of piece) {
      const { script } = char(c);
      if (script === null) continue;
      if (!scripts.has(script)) scripts.set(script, []);
      scripts.get(script).push(c);
    }
  }
  return scripts;
}

/** Whether the word around a token holds ASCII letters or digits beside it: "аррӏе.com",
 * "/srv/ѕсоре/x", '"host":"аррӏе"' (a word ends at WORD_END). Tokens are asked in order
 * and each word is read once (a word of 100,000 tokens is not read 100,000 times). */
function words(s) {
  let wordEnd = -1;
  let alnum = 0;
  const count = (from, to) => (s.slice(from, to).match(ALNUM_RUNS) ?? []).reduce((n, run) => n + run.length, 0);
  return (start, end) => {
    if (start >= wordEnd) {
      let begin = start;
      while (begin > 0 && !WORD_END.test(s[begin - 1])) begin--;
      WORD_REST.lastIndex = end;
      WORD_REST.exec(s);
      wordEnd = WORD_REST.lastIndex;
      alnum = count(begin, wordEnd);
    }
    return alnum > count(start, end);
  };
}
const WORD_END = /[\s"'`,;:=(){}[\]<>|&]/u;

/** The Latin a token reads as when it is all Cyrillic or all Greek letters with Latin
 * twins (ASCII digits and format characters may stand among them), else null. */
function wholeScript(token, scripts, char) {
  if (scripts.size !== 1 || !["Cyrillic", "Greek"].includes([...scripts.keys()][0])) return null;
  for (const c of new Set(token)) if (!TWINS.has(c) && !ASCII_DIGIT.test(c) && !(NON_ASCII.test(c) && char(c).format)) return null;
  let read = "";
  for (const c of token) if (TWINS.has(c) || ASCII_DIGIT.test(c)) read += TWINS.get(c) ?? c;
  return read;
}

/**
 * The look-alike check of `text`: {found, checked, length}. `found`: the tokens to mark, in
 * order, {start, end, token, notes}, each note naming the characters as U+XXXX with their
 * script, or the ASCII they stand for; `checked`: how much of the text was (all of it, or
 * SCAN_MAX when non-ASCII characters lie beyond). A whole-script look-alike ("аррӏе") is
 * marked only amid Latin text: when its word holds ASCII letters or digits beside it (a
 * host, a path segment), or no other token of the text has a letter of its script ("ssh
 * ѕсоре"). In Russian or Greek prose it is a word. Kept by text (CACHE_MAX).
 */
export function check(text) {
  const s = String(text ?? "");
  const kept = cache.get(s);
  if (kept) {
    cache.delete(s);
    cache.set(s, kept);
    return kept;
  }
  const result = scan(s);
  cache.set(s, result);
  if (cache.size > CACHE_MAX) cache.delete(cache.keys().next().value);
  return result;
}

function scan(s) {
  if (!NON_ASCII.test(s)) return { found: [], checked: s.length, length: s.length };
  let checked = s.length;
  if (s.length > SCAN_MAX && NON_ASCII.test(s.slice(SCAN_MAX))) {
    checked = SCAN_MAX - (s.charCodeAt(SCAN_MAX - 1) >= 0xd800 && s.charCodeAt(SCAN_MAX - 1) < 0xdc00 ? 1 : 0);
  }
  const known = new Map();
  const char = (c) => {
    let got = known.get(c);
    if (got === undefined) known.set(c, (got = classify(c)));
    return got;
  };
  const spans = tokens(checked < s.length ? s.slice(0, checked) : s, char);
  const toks = spans.map(([start, end]) => s.slice(start, end));
  const count = new Map();
  for (const t of toks) count.set(t, (count.get(t) ?? 0) + 1);
  const holders = new Map(); // how many tokens have a letter of each script
  const scriptsOfToken = new Map();
  for (const [t, n] of count) {
    const scripts = scriptsOf(t, char);
    scriptsOfToken.set(t, scripts);
    for (const script of scripts.keys()) holders.set(script, (holders.get(script) ?? 0) + n);
  }
  const beside = words(s);
  const notesOf = new Map(); // per token: its notes but the whole-script one, and that one
  const found = [];
  spans.forEach(([start, end], n) => {
    const token = toks[n];
    let kept = notesOf.get(token);
    if (!kept) {
      const scripts = scriptsOfToken.get(token);
      const chars = [...new Set(token)];
      const notes = [];
      const forms = chars.filter((c) => NON_ASCII.test(c) && char(c).compat !== null);
      if (forms.length) {
        let read = "";
        for (const c of token) read += (NON_ASCII.test(c) && char(c).compat) || c;
        notes.push(`compatibility forms, read ${quote(read)}: ${named(forms, token, (c) => `${hex(c)} ${formOf(c)} "${char(c).compat}"`)}`);
      }
      if (scripts.size > 1) {
        const names = [...scripts.keys()];
        const main = scripts.has("Latin") ? "Latin" : names.reduce((a, b) => (scripts.get(b).length > scripts.get(a).length ? b : a));
        const odd = [];
        for (const [script, cs] of scripts) if (script !== main) odd.push(...new Set(cs));
        notes.push(`mixed scripts (${names.join(", ")}): ${named([...new Set(odd)], token, (c) => `${hex(c)} ${char(c).script}`)}`);
      }
      const read = forms.length ? null : wholeScript(token, scripts, char);
      let whole = null;
      if (read !== null) {
        const [script] = scripts.keys();
        const letters = chars.filter((c) => TWINS.has(c));
        whole = { script, note: `all ${script}, read ${quote(read)}: ${named(letters, token, (c) => `${hex(c)} ${script} "${TWINS.get(c)}"`)}` };
      }
      kept = { notes, whole };
      notesOf.set(token, kept);
    }
    const notes = [...kept.notes];
    if (kept.whole && (holders.get(kept.whole.script) === 1 || beside(start, end))) notes.push(kept.whole.note);
    if (notes.length) found.push({ start, end, token, notes });
  });
  return { found, checked, length: s.length };
}

/** The tokens of `text` to mark, in order (`check`). */
export function lookalikes(text) {
  return check(text).found;
}

/** What a check that stopped at its bound says, or null. */
function unchecked({ checked, length }) {
  return checked < length
    ? `look-alike check: first ${checked.toLocaleString("en")} of ${length.toLocaleString("en")} characters only`
    : null;
}

const describe = (f) => `${quote(f.token)}: ${f.notes.join("; ")}`;

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
  const result = check(whole);
  for (const f of result.found) {
    if (f.start >= cut) break;
    if (f.start > at) out.push(reveal(s.slice(at, f.start)));
    at = Math.min(f.end, cut);
    out.push(h("mark", { class: "lookalike", title: describe(f), text: reveal(s.slice(f.start, at)) }));
  }
  if (at < s.length || out.length === 0) out.push(reveal(s.slice(at)));
  if (cut < whole.length) out.push("…");
  // What is shown past the check's bound was not checked: said, not left to look clean.
  if (cut > result.checked) out.push(h("span", { class: "lookalike-unchecked", text: ` [${unchecked(result)}]` }));
  return out;
}

/** A visible legend naming the look-alike characters of `texts`, or null when none. */
export function lookalikeNote(...texts) {
  const checks = texts.map((t) => check(t));
  const seen = new Set();
  const lines = [];
  for (const f of checks.flatMap((c) => c.found)) {
    const key = `${f.token}\n${f.notes.join("\n")}`;
    if (seen.has(key)) continue;
    seen.add(key);
    if (lines.length < NOTE_MAX_TOKENS) lines.push(describe(f));
  }
  if (seen.size > NOTE_MAX_TOKENS) lines.push(`and ${seen.size - NOTE_MAX_TOKENS} more`);
  for (const c of checks) if (unchecked(c)) lines.push(unchecked(c));
  if (lines.length === 0) return null;
  return h("p", { class: "lookalike-note", role: "note" }, "Look-alike characters: ", lines.join(" · "));
}
