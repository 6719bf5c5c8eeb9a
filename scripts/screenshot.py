"""Take the README's dashboard screenshot (run by scripts/screenshot).

Starts `agentd serve` on a temp state dir, runs a scripted sub-agent that runs two commands,
takes a steering message and is then stopped while the model is thinking, and captures the
run's page in headless Chromium. Everything started here is ended here.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
AGENTD = str(Path(sys.executable).with_name("agentd"))
CHROMIUM = os.environ.get("AGENTD_CHROMIUM", "/usr/lib/chromium/chromium")
WAIT_S = 30


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "img" / "dashboard.png")
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="agd-shot."))
    env = {k: v for k, v in os.environ.items() if k != "OPENAI_API_KEY"}
    env.update(AGENTD_STATE_DIR=str(tmp / "state"), AGENTD_GRACE_S="2")
    daemon = subprocess.Popen([AGENTD, "serve"], env=env, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        ready = threading.Event()

        def drain() -> None:
            assert daemon.stderr is not None
            for line in daemon.stderr:
                if "agentd listening on" in line:
                    ready.set()
            ready.set()

        threading.Thread(target=drain, daemon=True).start()
        if not ready.wait(WAIT_S) or daemon.poll() is not None:
            sys.exit("screenshot: the daemon did not start")
        shoot(env, tmp, args.out)
        print(f"screenshot: wrote {args.out}")
    finally:
        daemon.send_signal(signal.SIGTERM)
        try:
            daemon.wait(WAIT_S)
        except subprocess.TimeoutExpired:
            daemon.kill()
            daemon.wait()
        if daemon.stderr is not None:
            daemon.stderr.close()
        shutil.rmtree(tmp, ignore_errors=True)


def agentd(env: dict[str, str], *args: str) -> str:
    return subprocess.run([AGENTD, *args], env=env, capture_output=True, text=True, check=True, timeout=WAIT_S).stdout


def shoot(env: dict[str, str], tmp: Path, out: Path) -> None:
    from playwright.sync_api import sync_playwright

    # The gate lives in a dir the run is granted (a run's sandbox reaches only its own dir).
    shared = tmp / "shared"
    shared.mkdir()
    gate = shared / "gate"
    grant = tmp / "grant.json"
    grant.write_text(json.dumps({"sandbox": {"read": [str(shared)]}}))
    script = tmp / "script.json"
    script.write_text(
        json.dumps(
            {
                "turns": [
                    {
                        "text": "Let me see what is installed.",
                        "tool_calls": [{"name": "run_command", "arguments": {"command": "ls /usr/lib | head -n 5"}}],
                    },
                    {
                        "text": "Now the sizes (this takes a while).",
                        "tool_calls": [
                            {
                                "name": "run_command",
                                "arguments": {
                                    "command": f"while [ ! -f {gate} ]; do sleep 0.05; done; du -sh /usr/lib/python3* 2>/dev/null | head -n 3"
                                },
                            }
                        ],
                    },
                    {"text": "Summarising what I found", "hang": True},
                ],
                "final": "never reached",
            }
        )
    )
    # Not a turn of "demo": the next turn of a session starts from its history, and the
    # script below plays its turns from the first.
    agentd(env, "spawn", "count the files here", "--wait")
    run_id = agentd(
        env,
        "spawn",
        "survey /usr/lib and report the largest parts",
        "--session",
        "demo",
        "--script",
        str(script),
        "--spec",
        str(grant),
    ).strip()
    url = agentd(env, "dashboard").strip()
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, chromium_sandbox=False)
        try:
            page = browser.new_page(viewport={"width": 1280, "height": 1000}, device_scale_factor=1)
            page.set_default_timeout(WAIT_S * 1000)
            page.goto(url)
            page.wait_for_selector("#conn[data-state=open]")
            page.goto(url.split("/login")[0] + f"/#/run/{run_id}")
            page.locator("#events li[data-kind=tool_call]", has_text="du -sh").first.wait_for()
            page.get_by_label("Extra input for the running turn").fill("Only the three largest, please.")
            page.get_by_role("button", name="Send").click()
            page.locator("#steer-list .tag", has_text="queued").wait_for()
            gate.write_text("go\n")
            page.locator("#steer-list .tag", has_text="applied").wait_for()
            page.locator("#events li[data-kind=step_started]", has_text="Step 3").wait_for()
            page.get_by_role("button", name="Stop").click()
            page.locator("#stop[data-phase=done]").wait_for()
            page.locator("#receipt-box").wait_for()
            out.parent.mkdir(parents=True, exist_ok=True)
            page.screenshot(path=str(out))
        finally:
            browser.close()


if __name__ == "__main__":
    main()
