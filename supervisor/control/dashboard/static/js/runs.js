// The runs list: live and recent runs, newest first, refreshed while the page is shown.
//
// It asks the control socket's "list" every POLL_MS (a new run shows within that; a
// row's steps and current tool come from the journal's partial snapshot and tool-call
// records, which the daemon writes as the runner reports them). Filters (state, session)
// live in the address (#/?state=running&session=s1), so a reload keeps them. Rows are
// updated in place, so keyboard focus on a row's link survives a refresh. A running call's
// name and arguments are shown literally, look-alike characters marked (lookalike.js).

import { clear, fmtAge, h, short, stateBadge } from "./dom.js";
import { literal } from "./lookalike.js";

const POLL_MS = 500;
const LIMIT = 100;
const LIVE = new Set(["queued", "starting", "running", "cancelling", "awaiting_approval"]);
const $ = (id) => document.getElementById(id);

/** The columns of one row, from a run record as `list` returns it (`tool`: the running
 * calls' names and arguments as stored; the row shows them through lookalike.js). */
export function rowFacts(run, nowMs = Date.now()) {
  const calls = Array.isArray(run.tool_calls) ? run.tool_calls : [];
  const steps = Math.max(
    0,
    run.result?.steps ?? 0,
    run.result?.step ?? 0,
    run.partial_snapshot?.step ?? 0,
    ...calls.map((c) => c.step ?? 0),
  );
  const running = calls.filter((c) => c.state === "running");
  const tool = running.map((c) => [String(c.name ?? ""), String(c.arguments ?? "")]);
  const awaiting = run.state === "awaiting_approval";
  return {
    id: run.id ?? run.run_id,
    state: run.state,
    session: run.session_id ?? "",
    task: run.spec?.task ?? "",
    age: fmtAge(run.created_at, nowMs),
    steps,
    tool,
    awaiting,
    containment: run.containment ?? "",
  };
}

/** The running calls, `name arguments` (40 characters of them) each, look-alikes marked. */
function toolCell(f) {
  const calls = f.tool.map(([name, args], i) => [i ? ", " : "", literal(name), " ", literal(args, 40)]);
  if (f.awaiting) return ["awaiting approval", calls.length ? ": " : "", calls];
  return calls.length ? calls : h("span", { class: "muted", text: "—" });
}

export class RunsView {
  constructor(conn) {
    this.conn = conn;
    this.section = $("runs-view");
    this.timer = null;
    this.busy = false;
    this.rows = new Map(); // run id -> <tr>
    this.mounted = false;
    $("runs-filter").addEventListener("submit", (e) => e.preventDefault());
    $("filter-state").addEventListener("change", () => this._filtersChanged());
    $("filter-session").addEventListener("input", () => this._filtersChanged());
    document.addEventListener("visibilitychange", () => {
      if (this.mounted && document.visibilityState === "visible") this.refresh();
    });
  }

  mount(query) {
    this.mounted = true;
    this.section.hidden = false;
    document.title = "agentd · runs";
    $("filter-state").value = query.get("state") ?? "";
    $("filter-session").value = query.get("session") ?? "";
    clear($("runs-body"));
    this.rows.clear();
    this.refresh();
    this.timer = setInterval(() => this.refresh(), POLL_MS);
  }

  unmount() {
    this.mounted = false;
    clearInterval(this.timer);
    this.timer = null;
    this.section.hidden = true;
  }

  _filtersChanged() {
    const params = new URLSearchParams();
    const state = $("filter-state").value;
    const session = $("filter-session").value.trim();
    if (state) params.set("state", state);
    if (session) params.set("session", session);
    const hash = `#/${params.toString() ? `?${params}` : ""}`;
    history.replaceState(null, "", hash);
    clear($("runs-body"));
    this.rows.clear();
    this.refresh();
  }

  async refresh() {
    if (!this.mounted || this.busy || document.visibilityState === "hidden" || this.conn.state !== "open") return;
    this.busy = true;
    try {
      const state = $("filter-state").value;
      const session = $("filter-session").value.trim();
      const args = { limit: LIMIT };
      if (state && state !== "live") args.state = state;
      if (session) args.session_id = session;
      const { runs } = await this.conn.request("list", args);
      if (!this.mounted) return;
      this._render(state === "live" ? runs.filter((r) => LIVE.has(r.state)) : runs);
    } catch {
      // A dropped connection: the next tick asks again once it is back.
    } finally {
      this.busy = false;
    }
  }

  _render(runs) {
    const body = $("runs-body");
    const now = Date.now();
    const seen = new Set();
    let before = body.firstChild;
    for (const run of runs) {
      const f = rowFacts(run, now);
      seen.add(f.id);
      let tr = this.rows.get(f.id);
      if (!tr) {
        tr = h("tr", { dataset: { runId: f.id } });
        this.rows.set(f.id, tr);
      }
      const key = JSON.stringify(f);
      if (tr.dataset.key !== key) {
        tr.dataset.key = key;
        tr.dataset.state = f.state;
        const link = tr.querySelector("a.run-link");
        const focused = link && document.activeElement === link;
        clear(tr).append(
          h("td", {}, h("a", { class: "run-link mono", href: `#/run/${encodeURIComponent(f.id)}`, text: f.id })),
          h("td", {}, stateBadge(f.state)),
          h("td", {}, f.session ? h("a", { href: `#/?session=${encodeURIComponent(f.session)}`, text: f.session }) : h("span", { class: "muted", text: "—" })),
          h("td", { class: "task", title: f.task }, short(f.task, 90)),
          h("td", {}, f.age),
          h("td", { class: "num" }, String(f.steps)),
          h("td", { class: "mono literal" }, toolCell(f)),
          h("td", {}, f.containment || "—"),
        );
        if (focused) tr.querySelector("a.run-link").focus();
      }
      if (tr !== before) body.insertBefore(tr, before);
      before = tr.nextSibling;
    }
    for (const [id, tr] of this.rows) {
      if (!seen.has(id)) {
        tr.remove();
        this.rows.delete(id);
      }
    }
    $("runs-empty").hidden = runs.length > 0;
  }
}
