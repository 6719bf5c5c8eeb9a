// The control socket, as the page uses it: requests with ids, and subscriptions that
// survive a dropped connection.
//
// The websocket authenticates with the dashboard's session secret, offered as a
// subprotocol entry (session.js; the page never sees the control token). When the
// connection drops, pending requests fail with "connection_lost" and every subscription
// is resumed on the next connection from the
// last sequence number it delivered: no gap (the server replays from its journal) and no
// duplicate (anything at or below that number is ignored). A request waiting for a
// connection is sent once it opens, unless it has timed out first: then it is taken out
// of the queue and never sent (the page has told the user it failed; a Stop or an approval
// arriving minutes later would be a surprise). A timeout says whether the request was sent
// ("timeout": it may or may not have been done) or not ("not_sent"); a dropped connection
// fails only what went out on it ("connection_lost"). Closing the page, or losing
// the connection, never stops a run: only an explicit "cancel" request does.

import { authHeaders, forget, socketProtocols } from "./session.js";

const BACKOFF_MS = [0, 250, 500, 1000, 2000, 4000];
const REQUEST_TIMEOUT_MS = 30000;
// A socket not open after this long is given up and tried again (a blocked or hung
// connect fires no event at all in Chromium).
const CONNECT_TIMEOUT_MS = 5000;

export class RequestError extends Error {
  constructor(code, message) {
    super(message);
    this.code = code;
  }
}

export class Connection {
  constructor(statusEl, { requestTimeoutMs = REQUEST_TIMEOUT_MS } = {}) {
    this.statusEl = statusEl;
    this.requestTimeoutMs = requestTimeoutMs;
    this.url = null;
    this.ws = null;
    this.state = "connecting";
    this.nextId = 1;
    this.pending = new Map(); // request id -> {resolve, reject, timer, sent}
    this.queue = []; // requests waiting for an open socket: {frame, entry}
    this.subs = new Set(); // Subscription
    this.bySub = new Map(); // server sub id -> Subscription
    this.attempt = 0;
    this.listeners = new Set();
    this.retryTimer = null;
  }

  /** Called with the state ("open", "reconnecting", "signed-out", "down") on each change. */
  onState(fn) {
    this.listeners.add(fn);
    return () => this.listeners.delete(fn);
  }

  async start() {
    await this._connect();
  }

  _setState(state, text) {
    this.state = state;
    if (this.statusEl) {
      this.statusEl.dataset.state = state;
      this.statusEl.textContent = text;
    }
    for (const fn of this.listeners) fn(state);
  }

  async _session() {
    // Where the control socket is; 401 once the session has ended.
    let resp;
    try {
      resp = await fetch("/api/session", { headers: authHeaders(), cache: "no-store" });
    } catch {
      return { down: true };
    }
    if (resp.status === 401) return { signedOut: true };
    if (!resp.ok) return { down: true };
    return resp.json();
  }

  async _connect() {
    this.retryTimer = null;
    const info = await this._session();
    if (info.signedOut) {
      forget();
      this._setState("signed-out", "Signed out: run `agentd dashboard` for a new login link");
      this._failQueued("unauthorized", "signed out");
      return;
    }
    if (info.down) {
      this._setState("down", "Daemon unreachable; retrying…");
      this._retry();
      return;
    }
    this.url = info.control_url;
    let ws;
    try {
      ws = new WebSocket(this.url, socketProtocols());
    } catch (err) {
      this._setState("reconnecting", `Cannot connect (${err.message}); retrying…`);
      this._retry();
      return;
    }
    this.ws = ws;
    const connectTimer = setTimeout(() => {
      if (this.ws !== ws || ws.readyState === WebSocket.OPEN) return;
      this.ws = null;
      ws.close();
      this._dropped();
    }, CONNECT_TIMEOUT_MS);
    ws.onopen = () => {
      clearTimeout(connectTimer);
      if (this.ws !== ws) return;
      this.attempt = 0;
      this._setState("open", "Connected");
      for (const sub of this.subs) sub._open();
      const queued = this.queue;
      this.queue = [];
      for (const { frame, entry } of queued) {
        entry.sent = true;
        ws.send(frame);
      }
    };
    ws.onmessage = (msg) => {
      if (this.ws === ws) this._onMessage(msg.data);
    };
    ws.onclose = () => {
      clearTimeout(connectTimer);
      if (this.ws !== ws) return;
      this.ws = null;
      this._dropped();
    };
  }

  _dropped() {
    for (const [id, entry] of this.pending) {
      // Only what went out on the lost socket is lost; what waits in the queue still
      // goes on the next one (or times out there, unsent).
      if (!entry.sent) continue;
      clearTimeout(entry.timer);
      entry.reject(new RequestError("connection_lost", "the connection to the daemon dropped"));
      this.pending.delete(id);
    }
    this.bySub.clear();
    for (const sub of this.subs) sub.serverSub = null;
    this._setState("reconnecting", "Connection lost; reconnecting… (runs go on)");
    this._retry();
  }

  _retry() {
    if (this.retryTimer !== null) return;
    const delay = BACKOFF_MS[Math.min(this.attempt, BACKOFF_MS.length - 1)];
    this.attempt += 1;
    this.retryTimer = setTimeout(() => this._connect(), delay);
  }

  _failQueued(code, message) {
    for (const { entry } of this.queue) {
      clearTimeout(entry.timer);
      entry.reject(new RequestError(code, message));
    }
    this.queue = [];
  }

  _onMessage(text) {
    let msg;
    try {
      msg = JSON.parse(text);
    } catch {
      return;
    }
    if (msg.op === "event" || msg.op === "end") {
      const sub = this.bySub.get(msg.sub);
      if (sub) sub._push(msg);
      return;
    }
    const entry = this.pending.get(msg.id);
    if (!entry) return;
    this.pending.delete(msg.id);
    clearTimeout(entry.timer);
    if (msg.ok) entry.resolve(msg.result);
    else entry.reject(new RequestError(msg.error?.code ?? "error", msg.error?.message ?? "request failed"));
  }

  /** One request; resolves with its result, rejects with a RequestError. */
  request(op, args = {}) {
    const id = this.nextId++;
    const frame = JSON.stringify({ id, op, ...args });
    return new Promise((resolve, reject) => {
      const entry = { resolve, reject, timer: null, sent: false };
      entry.timer = setTimeout(() => {
        this.pending.delete(id);
        const secs = this.requestTimeoutMs / 1000;
        if (!entry.sent) {
          this.queue = this.queue.filter((q) => q.entry !== entry); // never sent later
          reject(new RequestError("not_sent", `not sent: no connection to the daemon within ${secs} s`));
        } else {
          reject(new RequestError("timeout", `sent, but no answer within ${secs} s: whether it was done is unknown`));
        }
      }, this.requestTimeoutMs);
      this.pending.set(id, entry);
      if (this.state === "signed-out") {
        this.pending.delete(id);
        clearTimeout(entry.timer);
        reject(new RequestError("unauthorized", "signed out"));
      } else if (this.ws && this.ws.readyState === WebSocket.OPEN) {
        entry.sent = true;
        this.ws.send(frame);
      } else {
        this.queue.push({ frame, entry });
      }
    });
  }

  /**
   * Follow a run's events: replay from the journal after `afterSeq`, then live.
   * `onEvent(event)` gets each event once, in order; `onEnd(end)` once the run is terminal.
   */
  subscribe(runId, { afterSeq = 0, onEvent, onEnd, onError }) {
    const sub = new Subscription(this, runId, afterSeq, onEvent, onEnd, onError);
    this.subs.add(sub);
    if (this.ws && this.ws.readyState === WebSocket.OPEN) sub._open();
    return sub;
  }
}

class Subscription {
  constructor(conn, runId, afterSeq, onEvent, onEnd, onError) {
    this.conn = conn;
    this.runId = runId;
    this.lastSeq = afterSeq;
    this.onEvent = onEvent;
    this.onEnd = onEnd;
    this.onError = onError;
    this.serverSub = null;
    this.closed = false;
    this.generation = 0;
  }

  _open() {
    if (this.closed) return;
    const generation = ++this.generation;
    this.conn
      .request("subscribe", { run_id: this.runId, after_seq: this.lastSeq })
      .then((result) => {
        if (this.closed || generation !== this.generation) {
          this.conn.request("unsubscribe", { sub: result.sub }).catch(() => {});
          return;
        }
        this.serverSub = result.sub;
        this.conn.bySub.set(result.sub, this);
      })
      .catch((err) => {
        // A dropped connection re-opens every subscription; anything else is final.
        if (err.code !== "connection_lost" && !this.closed && this.onError) this.onError(err);
      });
  }

  _push(msg) {
    if (this.closed) return;
    if (msg.op === "end") {
      this.conn.bySub.delete(this.serverSub); // the server has ended it already
      this.serverSub = null;
      this.close();
      if (this.onEnd) this.onEnd(msg);
      return;
    }
    if (msg.seq <= this.lastSeq) return; // already delivered: never twice
    if (msg.seq !== this.lastSeq + 1) {
      // A gap cannot happen with this server; if it ever did, start again from what we have.
      this._resubscribe();
      return;
    }
    this.lastSeq = msg.seq;
    this.onEvent(msg);
  }

  _resubscribe() {
    const old = this.serverSub;
    if (old !== null) {
      this.conn.bySub.delete(old);
      this.conn.request("unsubscribe", { sub: old }).catch(() => {});
    }
    this.serverSub = null;
    this._open();
  }

  /** Stop following (the run goes on). */
  close() {
    if (this.closed) return;
    this.closed = true;
    this.conn.subs.delete(this);
    if (this.serverSub !== null) {
      this.conn.bySub.delete(this.serverSub);
      if (this.conn.state === "open") this.conn.request("unsubscribe", { sub: this.serverSub }).catch(() => {});
      this.serverSub = null;
    }
  }
}
