// Phalanx dashboard: draws the cluster state served by `phalanx web` (/api/state, then /api/events as it changes).
// Small clusters are drawn whole as elements (each GPU a <div data-gpu="NODE/INDEX" data-job="JOB">); large ones
// (more than DOM_LIMIT GPUs) virtualized: only the leaves on screen hold elements. No framework, nothing fetched
// beyond this server.
//
// Every value from the server (names, messages, commands, node names, tenants, log lines) is drawn as text: the
// page is built with createElement and text nodes (el() below), never by parsing strings as HTML, so a hostile
// name stays a name. The server's Content-Security-Policy forbids inline scripts and styles besides.
"use strict";

// el("td", {className: "x", dataset: {job: id}}, "text", child, ...): an element; strings become text nodes.
function el(tag, props, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(props || {})) {
    if (k === "dataset") Object.assign(e.dataset, v);
    else e[k] = v;
  }
  for (const c of children.flat()) {
    if (c === null || c === undefined || c === false) continue;
    e.append(c instanceof Node ? c : String(c));
  }
  return e;
}

// A link that opens a job's page (the click is handled once, on the document: see the end of this file).
const jobLink = (id, text) => el("a", { href: "#/job/" + encodeURIComponent(id), dataset: { open: id } }, text);

let csrf = "";
let events = null; // the live state stream
let leaving = false;
// Once: the sign-out click and the stream's 401 both lead here, and a second navigation would abort the first.
function signedOut() {
  if (leaving) return;
  leaving = true;
  if (events) events.close();
  location.replace("/login");
}
async function api(path) {
  const r = await fetch(path, { credentials: "same-origin" });
  if (r.status === 401) { signedOut(); throw new Error("signed out"); }
  return r.json();
}

const DOM_LIMIT = 4096;
let state = null;
let selected = null; // the job whose page is open

const palette = (key) => {
  let h = 0;
  for (const c of key) h = (h * 31 + c.charCodeAt(0)) >>> 0;
  return `hsl(${h % 360}, 62%, ${48 + (h >> 9) % 16}%)`;
};

// GPU -> {job, tenant, part} from the running jobs' allocations.
function holders(jobs) {
  const held = new Map();
  for (const j of jobs) {
    if (j.state !== "RUNNING" && j.state !== "PREEMPTING") continue;
    for (const a of j.allocations) {
      for (const g of a.gpus) {
        const key = `${a.node}/${g}`;
        const part = a.slices ? "mig" : a.gpu_milli ? "share" : "";
        if (!held.has(key) || !part) held.set(key, { job: j.id, tenant: j.tenant || "-", part });
      }
    }
  }
  return held;
}

// nodes grouped spine -> leaf -> [node]: path[0] is the leaf, the last element the top switch.
function tree(nodes) {
  const spines = new Map();
  for (const n of nodes) {
    const leaf = n.path[0] || "(no leaf)";
    const spine = n.path.length > 1 ? n.path[n.path.length - 1] : "(cluster)";
    if (!spines.has(spine)) spines.set(spine, new Map());
    const leaves = spines.get(spine);
    if (!leaves.has(leaf)) leaves.set(leaf, []);
    leaves.get(leaf).push(n);
  }
  return spines;
}

function colourOf(h) {
  const by = document.getElementById("colour").value;
  return palette(by === "tenant" ? "t:" + h.tenant : "j:" + h.job);
}

function nodeElement(n, held) {
  const nd = document.createElement("div");
  nd.className = "node" + (n.state !== "READY" ? " down" : "") + (n.health && n.health !== "HEALTHY" ? " unhealthy" : "");
  nd.title = `${n.name} ${n.state} ${n.health}${n.releasing ? `, ${n.releasing} GPU(s) releasing` : ""}`;
  nd.dataset.node = n.name;
  let releasing = n.releasing;
  for (let i = 0; i < n.gpus; i++) {
    const g = document.createElement("div");
    const key = `${n.name}/${i}`;
    const h = held.get(key);
    g.className = "gpu";
    g.dataset.gpu = key;
    if (h) {
      g.dataset.job = h.job;
      g.style.background = colourOf(h);
      g.title = `${key}: ${h.job} (${h.tenant})${h.part ? " " + h.part : ""}`;
      if (h.part) g.classList.add(h.part === "mig" ? "mig" : "held");
      if (h.job === selected) g.classList.add("selected");
    } else {
      if (n.fatal.includes(i)) g.classList.add("fatal");
      else if (n.mig.includes(i)) g.classList.add("mig");
      else if (releasing > 0 && i >= n.gpus - n.free - releasing) { g.classList.add("releasing"); releasing--; }
      g.title = key;
    }
    nd.appendChild(g);
  }
  return nd;
}

function drawDom(nodes, held) {
  const root = document.getElementById("fabric");
  const frag = document.createDocumentFragment();
  for (const [spine, leaves] of tree(nodes)) {
    const s = document.createElement("div");
    s.className = "spine";
    s.append(el("div", { className: "label" }, spine));
    const ls = document.createElement("div");
    ls.className = "leaves";
    for (const [leaf, members] of leaves) {
      const l = document.createElement("div");
      l.className = "leaf";
      l.append(el("div", { className: "label" }, leaf));
      const ns = document.createElement("div");
      ns.className = "nodes";
      for (const n of members) ns.appendChild(nodeElement(n, held));
      l.appendChild(ns);
      ls.appendChild(l);
    }
    s.appendChild(ls);
    frag.appendChild(s);
  }
  root.replaceChildren(frag);
}

// Thousands of nodes: every leaf gets a placeholder of its final size, and only the leaves on screen (plus a
// margin) hold their node and GPU elements, made when they scroll into view and dropped when they leave it. Every
// GPU drawn on screen is still an element with data-gpu (and data-job), and the first paint makes a few thousand
// elements, not 32,768.
let observer = null;
function drawVirtual(nodes, held) {
  const root = document.getElementById("fabric");
  if (observer) observer.disconnect();
  const width = Math.max(200, root.clientWidth || 800);
  const perRow = Math.max(1, Math.floor((width - 40) / 54)); // a node is about 54 px wide with its gaps
  observer = new IntersectionObserver((entries) => {
    for (const e of entries) {
      const box = e.target;
      if (e.isIntersecting && !box.firstChild) fillLeaf(box, box._members, held);
      else if (!e.isIntersecting && box.firstChild) box.replaceChildren();
    }
  }, { root: null, rootMargin: "400px" });
  const frag = document.createDocumentFragment();
  for (const [spine, leaves] of tree(nodes)) {
    const s = document.createElement("div");
    s.className = "spine";
    s.append(el("div", { className: "label" }, spine));
    for (const [leaf, members] of leaves) {
      const l = document.createElement("div");
      l.className = "leaf virtual";
      l.append(el("div", { className: "label" }, `${leaf} (${members.length} nodes)`));
      const box = document.createElement("div");
      box.className = "nodes";
      box.style.minHeight = `${Math.ceil(members.length / perRow) * 30}px`;
      box._members = members;
      l.appendChild(box);
      s.appendChild(l);
      observer.observe(box);
    }
    frag.appendChild(s);
  }
  root.replaceChildren(frag);
}

function fillLeaf(box, members, held) {
  const frag = document.createDocumentFragment();
  for (const n of members) frag.appendChild(nodeElement(n, held));
  box.appendChild(frag);
}

function drawFabric() {
  const held = holders(state.jobs);
  const gpus = state.nodes.reduce((s, n) => s + n.gpus, 0);
  const big = gpus > DOM_LIMIT;
  (big ? drawVirtual : drawDom)(state.nodes, held);
  const busy = new Set([...held.values()].map((h) => h.job)).size;
  document.getElementById("summary").textContent =
    `${state.nodes.length} nodes, ${gpus} GPUs, ${held.size} held by ${busy} job(s)`;
}

function drawQueues() {
  const root = document.getElementById("queues");
  if (!state.queues.length) { root.replaceChildren(el("span", { className: "muted" }, "no queues configured")); return; }
  const table = el("table", {});
  for (const q of state.queues) {
    const used = (q.usage || []).reduce((s, u) => s + u.gpus, 0);
    const quota = (q.quotas || []).reduce((s, u) => s + u.gpus, 0);
    const borrowing = (q.usage || []).some((u) => u.borrowing) ? " (borrowing)" : "";
    table.append(el("tr", { dataset: { queue: q.name } },
      el("td", {}, el("b", {}, q.name), q.cohort ? [" ", el("span", { className: "muted" }, `(${q.cohort})`)] : null),
      el("td", {}, `${used}/${quota || "∞"} GPUs${borrowing}`),
      el("td", {}, `share ${(100 * (q.share || 0)).toFixed(1)}%`)));
    const pending = (q.pending || []).map((p) =>
      el("div", {}, `#${p.position} `, jobLink(p.job_id, p.name), " ", el("span", { className: "reason" }, p.message || "")));
    table.append(el("tr", {}, el("td", { colSpan: 3 }, pending)));
  }
  root.replaceChildren(table);
}

// A replica's badge: its service and index, and whether it is ready (a job of no service: none).
function serviceBadge(j) {
  const s = j.service;
  if (!s) return null;
  return el("span", { className: "badge " + (s.ready ? "ready" : "unready"), dataset: { serviceOf: j.id },
    title: `replica ${s.replica} of service ${s.service}, revision ${s.revision}: ${s.state}` },
    `${s.service}[${s.replica}] ${s.ready ? "ready" : "not ready"}`);
}

function drawJobs() {
  const order = { RUNNING: 0, PREEMPTING: 1, PENDING: 2 };
  const jobs = [...state.jobs].sort((a, b) => (order[a.state] - order[b.state]) || (a.submitted_at - b.submitted_at));
  const table = el("table", {});
  for (const j of jobs) {
    table.append(el("tr", { dataset: { jobRow: j.id } },
      el("td", {}, jobLink(j.id, j.id)), el("td", {}, j.name, " ", serviceBadge(j)), el("td", {}, j.tenant || ""),
      el("td", {}, j.state), el("td", {}, j.gang)));
    if (j.state === "PENDING") table.append(el("tr", {}, el("td", { colSpan: 5, className: "reason" }, j.message || "")));
  }
  document.getElementById("jobs").replaceChildren(table);
}

// Serving fleets: each service with its revision, ready/desired replicas, the controller's message and the
// autoscaler's last decision, then a row per replica (index, revision, state, readiness, nodes, leader, job).
function serviceElement(s) {
  const scale = s.autoscale
    ? `autoscaled ${s.autoscale.min}–${s.autoscale.max} on ${s.autoscale.metric} (target ${s.autoscale.target})`
    : "no autoscaler";
  const head = el("div", { className: "service-head" },
    el("b", { dataset: { serviceName: s.name } }, s.name), " ",
    s.tenant ? el("span", { className: "muted" }, `(${s.tenant})`) : null, " ",
    el("span", { className: "badge " + (s.ready >= s.desired ? "ready" : "unready"), dataset: { serviceReady: s.name } },
      `${s.ready}/${s.desired} ready`), " ",
    el("span", {}, `revision ${s.revision}, replicas of ${s.gang}, ${scale}`));
  const rows = s.replicas.map((r) =>
    el("tr", { dataset: { replica: `${s.name}/${r.index}/${r.revision}` } },
      el("td", {}, String(r.index), r.surge ? el("span", { className: "muted" }, " surge") : null),
      el("td", {}, `r${r.revision}`),
      el("td", {}, r.state, r.message ? [" ", el("span", { className: "reason" }, r.message)] : null),
      el("td", {}, el("span", { className: "badge " + (r.ready ? "ready" : "unready") }, r.ready ? "ready" : "not ready")),
      el("td", {}, r.nodes.join(", ") || "-"),
      el("td", {}, el("code", {}, r.leader || "-")),
      el("td", {}, r.job_id ? jobLink(r.job_id, r.job_id) : "-")));
  const header = el("tr", {}, ["replica", "revision", "state", "ready", "nodes", "leader", "job"].map((h) => el("th", {}, h)));
  return el("div", { className: "service", dataset: { service: s.name } },
    head,
    s.message ? el("div", { className: "reason" }, s.message) : null,
    s.autoscaler ? el("div", { className: "reason" }, "autoscaler: ", s.autoscaler) : null,
    el("table", { dataset: { replicas: s.name } }, header, rows));
}

function drawServices() {
  const root = document.getElementById("services");
  if (!state.serving) { root.replaceChildren(el("span", { className: "muted" }, "this scheduler serves no services")); return; }
  if (!state.services.length) { root.replaceChildren(el("span", { className: "muted" }, "no services")); return; }
  root.replaceChildren(...state.services.map(serviceElement));
}

function drawHistory() {
  const c = document.getElementById("history"), ctx = c.getContext("2d");
  ctx.clearRect(0, 0, c.width, c.height);
  const h = state.history;
  if (h.length < 2) return;
  const t0 = h[0][0], t1 = h[h.length - 1][0] || t0 + 1;
  for (const [k, colour] of [[1, "#2563eb"], [2, "#16a34a"]]) {
    ctx.strokeStyle = colour;
    ctx.beginPath();
    h.forEach((p, i) => {
      const x = ((p[0] - t0) / (t1 - t0 || 1)) * (c.width - 4) + 2, y = c.height - 2 - p[k] * (c.height - 4);
      i ? ctx.lineTo(x, y) : ctx.moveTo(x, y);
    });
    ctx.stroke();
  }
}

const when = (t) => (t ? new Date(t * 1000).toISOString().replace("T", " ").slice(0, 19) : "-");

function checkpointsOf(id, checkpoints) {
  if (typeof checkpoints === "string") return el("span", { className: "muted" }, checkpoints);
  if (!checkpoints || !checkpoints.length) return el("span", { className: "muted" }, "none committed");
  return el("table", { dataset: { checkpoints: id } }, checkpoints.map((c) =>
    el("tr", { dataset: { step: c.step } }, el("td", {}, `step ${c.step}`), el("td", {}, `attempt ${c.attempt}`),
      el("td", {}, when(c.committed_at)), el("td", {}, `${c.shards} shard(s)`))));
}

// What a replica is, on its job's page.
function serviceOf(j) {
  const s = j.service;
  if (!s) return "-";
  return el("span", {}, `replica ${s.replica} of `, el("b", {}, s.service), `, revision ${s.revision}, ${s.state} `,
    serviceBadge(j));
}

// A job's page draws as soon as the job comes (/api/job/ID); its checkpoints and log tail are fetched after, at
// once and apart (each bounded by the server), and fill their places: a slow coordinator or node agent delays only
// its own part. `opened` counts the pages opened: an answer for a page since replaced is dropped.
let opened = 0;
async function openJob(id) {
  const ticket = ++opened;
  selected = id;
  location.hash = "#/job/" + encodeURIComponent(id);
  document.getElementById("job-section").hidden = false;
  document.getElementById("job-title").textContent = id;
  const out = document.getElementById("job");
  const base = "/api/job/" + encodeURIComponent(id);
  let j;
  try { j = await api(base); } catch (e) { return; }
  if (ticket !== opened) return;
  if (j.error) { out.textContent = j.error; return; }
  const g = j.goodput || {};
  const total = Math.max(1, (g.allocated || 0) + (g.waiting || 0));
  const parts = ["productive", "rollback", "restart", "waiting"].map((k) => {
    const bar = el("span", { className: "bar" });
    bar.style.width = `${Math.min(200, 200 * (g[k] || 0) / total)}px`; // CSSOM, not an inline style attribute
    return el("tr", {}, el("td", {}, k), el("td", {}, bar, ` ${(g[k] || 0).toFixed(0)} GPU·s`));
  });
  const row = (k, ...v) => el("tr", {}, el("td", {}, k), el("td", {}, ...v));
  const spec = j.spec || {};
  const checkpointsBox = el("div", { dataset: { part: "checkpoints" } }, el("span", { className: "muted" }, "loading…"));
  const logBox = el("pre", { dataset: { part: "log", log: j.id } }, "loading…");
  out.replaceChildren(
    el("table", { dataset: { jobPage: j.id } },
      row("name", j.name),
      row("tenant", j.tenant || "-"),
      row("queue", j.queue || "-"),
      row("service", serviceOf(j)),
      row("state", `${j.state} (attempt ${j.attempt}, ${j.failures} failure(s), ${j.preemptions} preemption(s))`),
      row("message", j.message || ""),
      row("command", el("code", { className: "spec" }, (spec.command || []).join(" "))),
      row("history", `submitted ${when(j.submitted_at)}, started ${when(j.started_at)}, finished ${when(j.finished_at)}`),
      row("placement", (j.allocations || []).map((a) => `${a.node}: ${a.gpus.join(",")}`).join("; ") || "-"),
      row("restored", j.restore || "no restore reported")),
    el("h2", {}, "Checkpoints"), checkpointsBox,
    el("h2", {}, "Goodput"), el("table", {}, parts),
    el("h2", {}, "Rank 0 log"), logBox);
  if (state) drawFabric();
  fillPart(ticket, base + "/checkpoints", checkpointsBox, (d) => checkpointsOf(j.id, d.checkpoints));
  fillPart(ticket, base + "/logs", logBox, (d) => (d.logs || []).join("\n"));
}

async function fillPart(ticket, path, box, draw) {
  let d;
  try { d = await api(path); } catch (e) { d = { error: String(e) }; }
  if (ticket !== opened) return;
  box.replaceChildren(d.error ? el("span", { className: "muted" }, d.error) : draw(d));
  box.dataset.loaded = "1";
}

function render(next) {
  const t0 = performance.now();
  state = next;
  drawFabric();
  drawQueues();
  drawServices();
  drawJobs();
  drawHistory();
  document.getElementById("status").textContent = state.error ? "error: " + state.error : `live · ${state.scheduler}`;
  window.phalanxRenderMs = performance.now() - t0;
  window.phalanxVersion = state.version;
}
window.phalanxRender = render;

function closeJob() {
  selected = null;
  history.replaceState(null, "", location.pathname);
  document.getElementById("job-section").hidden = true;
  if (state) drawFabric();
}

async function signOut() {
  if (events) events.close(); // the session ends now: the stream must not see it end and navigate on its own
  const r = await fetch("/logout", { method: "POST", credentials: "same-origin", headers: { "X-CSRF-Token": csrf } });
  if (r.ok || r.status === 401) signedOut();
}

document.getElementById("colour").addEventListener("change", () => state && drawFabric());
document.getElementById("job-close").addEventListener("click", (e) => { e.preventDefault(); closeJob(); });
document.getElementById("sign-out").addEventListener("click", signOut);
// One handler for every job link and GPU (thousands of them): the element's data-open / data-job names the job.
document.addEventListener("click", (e) => {
  const target = e.target instanceof Element ? e.target.closest("[data-open], #fabric [data-job]") : null;
  if (!target) return;
  e.preventDefault();
  openJob(target.dataset.open || target.dataset.job);
});

async function start() {
  try { csrf = (await api("/api/session")).csrf; } catch (e) { return; }
  render(await api("/api/state"));
  events = new EventSource("/api/events");
  events.addEventListener("state", (e) => window.phalanxLive !== false && render(JSON.parse(e.data)));
  events.onerror = () => {
    document.getElementById("status").textContent = "reconnecting…";
    api("/api/session").catch(() => events.close()); // a 401 there: the session is over, to the sign-in page
  };
  if (location.hash.startsWith("#/job/")) openJob(decodeURIComponent(location.hash.slice(6)));
}
start();
