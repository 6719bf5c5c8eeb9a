// The truth about a stop, from the run's terminal status and its stop receipt.
//
// Read generically: known fields make the one-line summary, and the whole receipt is also
// rendered as is (renderValue), so fields added by a later daemon show up without a change
// here. Known today (supervisor/core/runs.py _receipt_head, supervisor/trees/_handles.py StopReceipt):
// cancel_reason, path_a, containment, exit_code, cancel_to_tree_dead_s, note, and path_b
// {escalated, waited_s, grace_s, leader, pid, signals, killed, reaped, survivors, timed_out}.
// Fields a later daemon may add and that are used when present: processes_ended, and
// survivors at the top level.

import { fmtDuration, plural } from "./dom.js";

function pathB(receipt) {
  const pb = receipt?.path_b;
  return pb && typeof pb === "object" ? pb : {};
}

/**
 * Processes the receipt says were ended: its `processes_ended` count, else null. Not
 * counted from path_b's `killed`/`reaped`/leader: those list only what was signalled by
 * pid or reaped here, and a cgroup.kill or a killpg ends a whole tree without naming its
 * members ("1 process ended" for a tree of 4).
 */
export function processesEnded(receipt) {
  if (!receipt) return null;
  for (const holder of [receipt, pathB(receipt)]) {
    const n = holder.processes_ended;
    if (typeof n === "number") return n;
    if (Array.isArray(n)) return n.length;
  }
  return null;
}

/** Processes still alive after the stop, as the receipt reports them. */
export function survivors(receipt) {
  if (!receipt) return [];
  const top = Array.isArray(receipt.survivors) ? receipt.survivors : [];
  const pb = Array.isArray(pathB(receipt).survivors) ? pathB(receipt).survivors : [];
  return [...top, ...pb];
}

/**
 * One line for a terminal run that was stopped (or that ended while a stop was asked).
 * `finishedFirst`: tool calls that finished after the stop, [{name, afterS}], from events.
 */
export function stopSummary(status, { finishedFirst = [], pressed = false } = {}) {
  const state = status?.state;
  const receipt = status?.receipt ?? null;
  if (state === "completed" || state === "failed") {
    return pressed || status?.reason === "user"
      ? `${state === "completed" ? "Completed" : "Failed"} before the stop took effect`
      : `${state === "completed" ? "Completed" : "Failed"}`;
  }
  if (state === "lost") return "Lost: the daemon restarted and the runner was gone";
  if (state !== "cancelled") return `Ended: ${state}`;
  if (!receipt || receipt.note || !receipt.path_b) {
    if (receipt?.note && /never started/.test(receipt.note)) return "Cancelled before it started · nothing was running";
    return `Cancelled${receipt?.note ? ` · ${receipt.note}` : ""}`;
  }
  const pb = pathB(receipt);
  const parts = [];
  const took = receipt.cancel_to_tree_dead_s;
  if (pb.escalated) {
    parts.push(typeof took === "number" ? `Cancelled at the grace (${fmtDuration(took)})` : "Cancelled at the grace");
    parts.push("escalated to SIGKILL");
  } else if (finishedFirst.length > 0) {
    const f = finishedFirst[finishedFirst.length - 1];
    parts.push(`Stopped · the ${f.name} call finished first (${fmtDuration(f.afterS)})`);
  } else {
    parts.push(typeof took === "number" ? `Stopped in ${fmtDuration(took)}` : "Stopped");
  }
  const ended = processesEnded(receipt);
  if (ended !== null) parts.push(`${plural(ended, "process", "processes")} ended`);
  const left = survivors(receipt);
  if (left.length === 0) parts.push("0 left");
  else parts.push(`${plural(left.length, "process", "processes")} could not be confirmed`);
  if (pb.timed_out) parts.push("the stop routine hit its own deadline");
  return parts.join(" · ");
}
