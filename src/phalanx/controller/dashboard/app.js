// The phalanx dashboard: live job status from the controller, no third-party code.
// The token comes from the URL fragment (#token=...) or a prompt, lives in this tab's
// sessionStorage, and travels only in the Authorization header.
"use strict";

const KEY = "phalanx-token";
const POLL_MS = 2000;
const $ = (id) => document.getElementById(id);
let token = null;
let last = null;
let pollTimer = null;
let streamAbort = null;
let known = [];   // the job's controllers, leader first (status.controllers), to follow
let misses = 0;   // polls in a row that found no controller here
const FOLLOW_AFTER = 2;

function el(tag, attrs, ...kids) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") e.className = v;
    else if (k.startsWith("on")) e.addEventListener(k.slice(2), v);
    else e.setAttribute(k, v);
  }
  for (const k of kids) e.append(k instanceof Node ? k : String(k));
  return e;
}

const fmt = (x, d = 3) => (x === null || x === undefined ? "-" : Number(x).toFixed(d));
// {staleness: tokens} as "0:120 1:40", by staleness.
const lags = (h) => (h ? Object.entries(h).sort((a, b) => a[0] - b[0]).map(([k, v]) => `${k}:${v}`).join(" ") || "-" : "-");
const ago = (s) => (s === null || s === undefined ? "-" : s < 90 ? `${s.toFixed(1)} s` : s < 5400 ? `${(s / 60).toFixed(1)} min` : `${(s / 3600).toFixed(1)} h`);
const bytes = (n) => (n >= 1e9 ? `${(n / 1e9).toFixed(2)} GB` : n >= 1e6 ? `${(n / 1e6).toFixed(1)} MB` : `${(n / 1e3).toFixed(1)} kB`);
const clock = (t) => new Date(t * 1000).toLocaleTimeString();

// -- token -----------------------------------------------------------------

function takeToken() {
  const m = location.hash.match(/token=([^&]+)/);
  if (m) {
    sessionStorage.setItem(KEY, decodeURIComponent(m[1]));
    history.replaceState(null, "", location.pathname);
  }
  return sessionStorage.getItem(KEY);
}

function askToken(message) {
  stop();
  token = null;
  sessionStorage.removeItem(KEY);
  $("app").hidden = true;
  $("forget").hidden = true;
  $("token-prompt").hidden = false;
  $("token-error").textContent = message || "";
  setConn("not connected", "");
  $("token-input").focus();
}

async function api(path, body) {
  const init = { headers: { Authorization: `Bearer ${token}` } };
  if (body !== undefined) {
    init.method = "POST";
    init.headers["Content-Type"] = "application/json";
    init.body = JSON.stringify(body);
  }
  const r = await fetch(path, init);
  if (r.status === 421) {
    // A standby: it names the leader. The page moves there (the token in the fragment).
    const data = await r.json();
    follow(data.leader);
    throw new Error(data.error || "a standby controller");
  }
  if (r.status === 401) {
    askToken("The controller refused this token.");
    throw new Error("unauthorized");
  }
  const data = await r.json();
  if (!r.ok) throw new Error(data.error || `HTTP ${r.status}`);
  return data;
}

async function connect(t) {
  token = t;
  try {
    render(await api("/v1/status"));
  } catch (e) {
    if (token) { setConn(`error: ${e.message}`, "down"); $("token-prompt").hidden = false; $("token-error").textContent = e.message; }
    return;
  }
  $("token-prompt").hidden = true;
  $("app").hidden = false;
  $("forget").hidden = false;
  sessionStorage.setItem(KEY, token);
  stream();
}

// -- following the leader (several controllers on an etcd journal) --------------

function follow(url) {
  // Open the dashboard of the controller at `url`, this tab's token in the fragment
  // (browsers never send a fragment to a server). Nothing if it is this one.
  if (!url || !token) return;
  let there;
  try { there = new URL(url); } catch (e) { return; }
  if (there.origin === location.origin) return;
  location.href = `${there.origin}/#token=${encodeURIComponent(token)}`;
}

function pollFailed() {
  // The controller here is gone (its host lost, or it was deposed): after a few polls
  // in a row, try the next controller it named; a standby there sends us to the leader.
  setConn("controller unreachable", "down");
  misses += 1;
  if (misses < FOLLOW_AFTER) return;
  const others = known.filter((u) => { try { return new URL(u).origin !== location.origin; } catch (e) { return false; } });
  if (others.length) follow(others[(misses - FOLLOW_AFTER) % others.length]);
}

// -- updates: server-sent events over fetch, polling as the fallback --------

function setConn(text, cls) {
  const c = $("conn");
  c.textContent = text;
  c.className = `conn ${cls}`;
}

function stop() {
  if (streamAbort) streamAbort.abort();
  streamAbort = null;
  clearInterval(pollTimer);
  pollTimer = null;
}

async function stream() {
  stop();
  const ctl = (streamAbort = new AbortController());
  try {
    const r = await fetch("/v1/stream", { headers: { Authorization: `Bearer ${token}` }, signal: ctl.signal });
    if (r.status === 401) return askToken("The controller refused this token.");
    if (!r.ok || !r.body) throw new Error(`HTTP ${r.status}`);
    setConn("live", "live");
    const reader = r.body.getReader();
    const dec = new TextDecoder();
    let buf = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += dec.decode(value, { stream: true });
      let i;
      while ((i = buf.indexOf("\n\n")) >= 0) {
        const chunk = buf.slice(0, i);
        buf = buf.slice(i + 2);
        const data = chunk.split("\n").filter((l) => l.startsWith("data: ")).map((l) => l.slice(6)).join("\n");
        if (data) render(JSON.parse(data));
      }
    }
  } catch (e) {
    if (ctl.signal.aborted) return;
  }
  if (ctl.signal.aborted || !token) return;
  // The stream ended (controller restarted, proxy timeout): poll, and try again soon.
  setConn("polling", "poll");
  pollTimer = setInterval(() => api("/v1/status").then(render, pollFailed), POLL_MS);
  setTimeout(() => { if (token && pollTimer) stream(); }, 5000);
}

// -- rendering -------------------------------------------------------------

function card(label, value, key) {
  return el("div", { class: "card", "data-k": key || label }, el("b", {}, value), el("span", {}, label));
}

function render(st) {
  last = st;
  misses = 0;
  const ov = st.overview;
  $("job-id").textContent = `job ${st.job_id} · controller epoch ${st.epoch}`;
  renderControl(st.controllers, st.journal);
  const j = ov.job;
  const cards = [card("step", j.step), card("quorum", j.quorum_id, "quorum_id"), card("steps/s", fmt(j.steps_per_s, 2), "steps_per_s")];
  if (j.rl) {
    cards.push(card("reward", fmt(j.rl.reward), "reward"), card("exact match", fmt(j.rl.exact_match), "exact_match"),
      card("exact match (avg)", fmt(j.rl.exact_match_avg), "exact_match_avg"), card("staleness", j.rl.staleness ?? "-", "staleness"),
      card("tokens/s", fmt(j.rl.tokens_per_s, 0), "tokens_per_s"), card("train tokens/s", fmt(j.rl.train_tokens_per_s, 0), "train_tokens_per_s"),
      // Off-policy metrics of the latest batch (rl.grpo.correction; docs/architecture.md).
      card("mismatch KL", fmt(j.rl.mismatch_kl, 5), "mismatch_kl"), card("ESS", fmt(j.rl.ess), "ess"),
      card("IS clipped", fmt(j.rl.is_clip_frac), "is_clip_frac"), card("IS masked", fmt(j.rl.is_mask_frac), "is_mask_frac"),
      card("tokens by staleness", lags(j.rl.staleness_tokens), "staleness_tokens"),
      card("policy idle", fmt(j.rl.policy_idle, 2), "policy_idle"));
  }
  if (j.diloco) cards.push(card("outer step", j.diloco.outer_step, "outer_step"), card("inner step", j.diloco.inner_step, "inner_step"));
  $("job").replaceChildren(...cards);
  for (const name of ["loss", "reward", "exact_match"]) chart($(`chart-${name}`), ov.series[name] || []);
  renderRoles(ov);
  renderLedger(ov.ledger);
  $("checkpoint-now").hidden = !ov.actions.checkpoint;
  $("checkpoints").tBodies[0].replaceChildren(...ov.checkpoints.map((c) =>
    el("tr", {}, el("td", {}, c.step), el("td", {}, bytes(c.nbytes)), el("td", {}, c.url), el("td", {}, c.by), el("td", {}, clock(c.at)))));
  $("timeline").replaceChildren(...ov.timeline.slice().reverse().map((e) =>
    el("li", { class: e.kind }, el("time", {}, clock(e.at)), e.text)));
}

function renderControl(c, j) {
  // Who leads (several controllers), and whether the journal takes writes.
  const out = [];
  if (c) {
    known = [c.leader, ...c.standbys.map((s) => s.url)];
    const standbys = c.standbys.map((s) => s.url).join(", ") || "none";
    out.push(el("span", { "data-k": "leader" }, `controller ${c.leader} leads since ${clock(c.since)} (term ${c.term}, ${c.failovers} failover(s)); standbys: ${standbys}`));
  }
  if (j && !j.healthy) {
    out.push(el("span", { class: "error", "data-k": "journal" }, `journal unavailable: ${j.where}: ${j.error}; ${j.unjournaled} change(s) held, writes refused`));
  } else if (j && j.kind === "etcd") {
    out.push(el("span", { "data-k": "journal" }, `journal: ${j.where}`));
  }
  $("control").hidden = out.length === 0;
  $("control").replaceChildren(...out);
}

function renderRoles(ov) {
  const out = [];
  for (const [role, r] of Object.entries(ov.roles)) {
    const scale = el("input", { type: "number", min: "0", max: "1000", value: String(r.desired ?? r.replicas.length), "aria-label": `${role} replicas` });
    const quorate = r.forms_quorums;
    const head = el("h3", {}, `${role}: ${r.replicas.length} live` + (quorate ? `, step ${r.step}, quorum ${r.quorum_id}` : "") + (r.desired !== null ? `, desired ${r.desired}` : "") + " ",
      scale, el("button", { type: "button", onclick: () => act(`Scale ${role} to ${scale.value} replicas? (phalanx run follows it)`, "/v1/scale", { role, replicas: Number(scale.value) }) }, "scale"));
    const rows = r.replicas.map((x) => el("tr", { "data-replica": x.replica_id, "data-state": x.state },
      el("td", {}, x.name), el("td", {}, el("span", { class: `state ${x.state}` }, x.state)), el("td", {}, x.incarnation),
      el("td", {}, ago(x.uptime_s)), el("td", {}, x.weights_version ?? "-"), el("td", {}, ago(x.heartbeat_age_s)),
      el("td", {}, x.address || "-"), el("td", {}, quorate ? x.step : "-"),
      el("td", {},
        el("button", { type: "button", onclick: () => act(`Drain ${x.replica_id}? It leaves at its next step boundary.`, "/v1/replicas/drain", { replica_id: x.replica_id }) }, "drain"), " ",
        el("button", { type: "button", onclick: () => act(`Evict ${x.replica_id} now?`, "/v1/replicas/evict", { replica_id: x.replica_id, reason: "from the dashboard" }) }, "evict"))));
    const gone = r.evicted.slice().reverse().map((x) => el("tr", { class: "gone", "data-replica": x.replica_id, "data-state": "evicted" },
      el("td", {}, x.replica_id.split(":")[0]), el("td", {}, el("span", { class: "state evicted" }, "evicted")), el("td", {}, x.replica_id.split(":")[1] || ""),
      el("td", { colspan: "6" }, `${clock(x.at)} by ${x.detector} (${x.reason})`)));
    const table = el("table", { "data-role": role },
      el("thead", {}, el("tr", {}, ...["replica", "state", "incarnation", "uptime", "weights", "heartbeat", "address", "step", ""].map((h) => el("th", {}, h)))),
      el("tbody", {}, ...rows, ...gone));
    out.push(el("div", { class: "role" }, head, table));
  }
  // Keep a scale input the user is typing in.
  if (!document.activeElement || document.activeElement.type !== "number") $("roles").replaceChildren(...out);
}

function renderLedger(l) {
  $("ledger-section").hidden = !l;
  if (!l) return;
  const cards = [card("prompts leased", l.prompts_leased, "prompts_leased"), card("prompts done", l.prompts_done, "prompts_done"),
    card("prompts trained", l.prompts_trained, "prompts_trained"), card("rollouts pending", l.rollouts_pending, "rollouts_pending"),
    card("rollouts trained", l.rollouts_trained, "rollouts_trained")];
  const reasons = Object.entries(l.rollouts_discarded);
  cards.push(card("discarded", reasons.reduce((a, [, n]) => a + n, 0), "rollouts_discarded"));
  for (const [why, n] of reasons) cards.push(card(`discarded: ${why}`, n, `discarded_${why}`));
  cards.push(card("ledger", l.ok ? "balanced" : "UNBALANCED", "ok"));
  $("ledger").replaceChildren(...cards);
}

// A small SVG line chart: x = step, y = value, min/max labelled.
function chart(svg, pts) {
  const W = 320, H = 140, L = 34, B = 16, T = 6, R = 6;
  const ns = "http://www.w3.org/2000/svg";
  const mk = (tag, attrs, text) => {
    const e = document.createElementNS(ns, tag);
    for (const [k, v] of Object.entries(attrs)) e.setAttribute(k, v);
    if (text !== undefined) e.textContent = text;
    return e;
  };
  const kids = [mk("line", { x1: L, y1: H - B, x2: W - R, y2: H - B }), mk("line", { x1: L, y1: T, x2: L, y2: H - B })];
  svg.setAttribute("data-points", String(pts.length));
  if (pts.length) {
    const xs = pts.map((p) => p[0]), ys = pts.map((p) => p[1]);
    const x0 = Math.min(...xs), x1 = Math.max(...xs), y0 = Math.min(...ys), y1 = Math.max(...ys);
    const sx = (x) => L + ((x - x0) / (x1 - x0 || 1)) * (W - L - R);
    const sy = (y) => H - B - ((y - y0) / (y1 - y0 || 1)) * (H - B - T);
    kids.push(mk("polyline", { points: pts.map((p) => `${sx(p[0]).toFixed(1)},${sy(p[1]).toFixed(1)}`).join(" ") }));
    kids.push(mk("text", { x: 2, y: T + 8 }, fmt(y1, 3)), mk("text", { x: 2, y: H - B }, fmt(y0, 3)));
    kids.push(mk("text", { x: L, y: H - 3 }, `step ${x0}`), mk("text", { x: W - R - 50, y: H - 3 }, `step ${x1}`));
  } else {
    kids.push(mk("text", { x: L + 8, y: H / 2 }, "no points yet"));
  }
  svg.replaceChildren(...kids);
}

// -- actions ---------------------------------------------------------------

function confirmDialog(text) {
  const d = $("confirm");
  $("confirm-text").textContent = text;
  d.returnValue = "";
  d.showModal();
  return new Promise((resolve) => d.addEventListener("close", () => resolve(d.returnValue === "ok"), { once: true }));
}

async function act(text, path, body) {
  if (!(await confirmDialog(text))) return;
  try {
    await api(path, body);
    setConn("done: " + text.replace(/\?.*$/, ""), "live");
  } catch (e) {
    setConn(`refused: ${e.message}`, "down");
  }
}

document.addEventListener("DOMContentLoaded", () => {
  $("token-form").addEventListener("submit", (ev) => {
    ev.preventDefault();
    connect($("token-input").value.trim());
  });
  $("forget").addEventListener("click", () => askToken(""));
  $("checkpoint-now").addEventListener("click", () => act("Checkpoint the policy a few steps from now?", "/v1/checkpoints/trigger", {}));
  // A link with #token=... opened on a page already showing the prompt.
  window.addEventListener("hashchange", () => { if (/token=/.test(location.hash)) connect(takeToken()); });
  const t = takeToken();
  if (t) connect(t); else askToken("");
});
