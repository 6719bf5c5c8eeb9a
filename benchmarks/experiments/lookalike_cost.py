"""Experiment: what the look-alike check costs on large call arguments, Python and JS.

A prompt-injected run's call arguments can be ~1 MiB (an event line's bound); the CLI
checks each call's (``history``, ``watch``), the dashboard each shown text on each render
(the runs list every 500 ms). For each text: the seconds ``lookalike_note`` takes and the
note's size (``supervisor/_lookalikes.py``), then ``lookalikes`` of ``lookalike.js`` in
node, first call and again on the same text (a re-render). ``--tree`` measures another
checkout (e.g. the commit before) on the same texts.

    .venv/bin/python benchmarks/experiments/lookalike_cost.py [--tree PATH]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent.parent

RUSSIAN = "Съешь же ещё этих мягких французских булок, да выпей чаю; ухо болит. "
CASES = {
    "pаypal x100k (700k chars)": "p\u0430ypal " * 100_000,
    "Russian prose (1.1 MB)": RUSSIAN * 8_500,
    "fullwidth ｒｍ x300k (one token)": "\uff52\uff4d" * 300_000,
    "ASCII 1 MiB + one pаypal": "x" * 1_048_576 + " p\u0430ypal",
    "distinct letters U+0100-U+9FFF": " ".join(chr(c) for c in range(0x100, 0xA000) if chr(c).isalpha()),
    "аррӏе/ x2000 in one word": "\u0430\u0440\u0440\u04cf\u0435/" * 2_000 + " привет",
}

# What one text may take in node before it is reported as "more than this" (s).
JS_TIMEOUT_S = 60
JS = """
const { lookalikes } = await import(process.argv[1] + "/supervisor/control/dashboard/static/js/lookalike.js");
const t = JSON.parse(require("fs").readFileSync(0, "utf8"));
{
  let t0 = performance.now(); const n = lookalikes(t).length; const first = performance.now() - t0;
  t0 = performance.now(); lookalikes(t); const again = performance.now() - t0;
  console.log(JSON.stringify([n, first / 1000, again / 1000]));
}
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tree", type=Path, default=HERE)
    tree = parser.parse_args().tree.resolve()
    sys.path.insert(0, str(tree))
    from supervisor._lookalikes import lookalike_note

    print(f"tree {tree}")
    print(f"{'text':36} {'chars':>9} | {'python s':>8} {'note B':>9} | {'js s':>7} {'js again':>8} {'found':>6}")
    script = "const require = (await import('node:module')).createRequire(import.meta.url);\n" + JS
    for name, text in CASES.items():
        t0 = time.perf_counter()
        note = lookalike_note(text)
        took = time.perf_counter() - t0
        size = len(note.encode())
        try:
            node = subprocess.run(
                ["node", "--experimental-default-type=module", "--input-type=module", "-e", script, str(tree)],
                input=json.dumps(text),
                capture_output=True,
                text=True,
                check=True,
                timeout=JS_TIMEOUT_S,
            )
            found, first, again = json.loads(node.stdout)
            js = f"{first:7.3f} {again:8.3f} {found:>6}"
        except subprocess.TimeoutExpired:
            js = f"{'>' + str(JS_TIMEOUT_S):>7} {'':8} {'':>6}"
        print(f"{name:36} {len(text):>9} | {took:8.3f} {size:>9} | {js}", flush=True)


if __name__ == "__main__":
    main()
