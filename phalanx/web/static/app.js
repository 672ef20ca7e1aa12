// Phalanx dashboard: draws the cluster state served by `phalanx web` (/api/state, then /api/events as it changes).
// Small clusters are drawn whole as elements (each GPU a <div data-gpu="NODE/INDEX" data-job="JOB">); large ones
// (more than DOM_LIMIT GPUs) virtualized: only the leaves on screen hold elements. No framework, nothing fetched
// beyond this server.
"use strict";

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
      g.onclick = () => openJob(h.job);
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
    s.innerHTML = `<div class="label">${spine}</div>`;
    const ls = document.createElement("div");
    ls.className = "leaves";
    for (const [leaf, members] of leaves) {
      const l = document.createElement("div");
      l.className = "leaf";
      l.innerHTML = `<div class="label">${leaf}</div>`;
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
    s.innerHTML = `<div class="label">${spine}</div>`;
    for (const [leaf, members] of leaves) {
      const l = document.createElement("div");
      l.className = "leaf virtual";
      l.innerHTML = `<div class="label">${leaf} (${members.length} nodes)</div>`;
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
  const rows = state.queues.map((q) => {
    const used = (q.usage || []).reduce((s, u) => s + u.gpus, 0);
    const quota = (q.quotas || []).reduce((s, u) => s + u.gpus, 0);
    const pending = (q.pending || []).map((p) =>
      `<div>#${p.position} <a onclick="openJob('${p.job_id}')">${p.name}</a> <span class="reason">${escape(p.message)}</span></div>`).join("");
    return `<tr><td><b>${q.name}</b>${q.cohort ? ` <span class="muted">(${q.cohort})</span>` : ""}</td>
      <td>${used}/${quota || "∞"} GPUs${(q.usage || []).some((u) => u.borrowing) ? " (borrowing)" : ""}</td>
      <td>share ${(100 * (q.share || 0)).toFixed(1)}%</td></tr><tr><td colspan="3">${pending}</td></tr>`;
  });
  document.getElementById("queues").innerHTML = rows.length ? `<table>${rows.join("")}</table>` : `<span class="muted">no queues configured</span>`;
}

function drawJobs() {
  const order = { RUNNING: 0, PREEMPTING: 1, PENDING: 2 };
  const jobs = [...state.jobs].sort((a, b) => (order[a.state] - order[b.state]) || (a.submitted_at - b.submitted_at));
  document.getElementById("jobs").innerHTML = `<table>${jobs.map((j) =>
    `<tr data-job-row="${j.id}"><td><a onclick="openJob('${j.id}')">${j.id}</a></td><td>${escape(j.name)}</td><td>${j.state}</td>
     <td>${j.gang}</td></tr>${j.state === "PENDING" ? `<tr><td colspan="4" class="reason">${escape(j.message)}</td></tr>` : ""}`).join("")}</table>`;
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

function escape(s) {
  return String(s || "").replace(/[&<>"]/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;" })[c]);
}

async function openJob(id) {
  selected = id;
  location.hash = "#/job/" + id;
  const section = document.getElementById("job-section");
  section.hidden = false;
  document.getElementById("job-title").textContent = id;
  const r = await fetch("api/job/" + encodeURIComponent(id));
  const j = await r.json();
  if (j.error) { document.getElementById("job").textContent = j.error; return; }
  const g = j.goodput || {};
  const parts = ["productive", "rollback", "restart", "waiting"].map((k) =>
    `<tr><td>${k}</td><td><span class="bar" style="width:${Math.min(200, 200 * (g[k] || 0) / Math.max(1, (g.allocated || 0) + (g.waiting || 0)))}px"></span> ${(g[k] || 0).toFixed(0)} GPU·s</td></tr>`).join("");
  const when = (t) => (t ? new Date(t * 1000).toISOString().replace("T", " ").slice(0, 19) : "-");
  document.getElementById("job").innerHTML = `
    <table data-job-page="${j.id}">
      <tr><td>name</td><td>${escape(j.name)}</td></tr>
      <tr><td>state</td><td>${j.state} (attempt ${j.attempt}, ${j.failures} failure(s), ${j.preemptions} preemption(s))</td></tr>
      <tr><td>message</td><td>${escape(j.message)}</td></tr>
      <tr><td>history</td><td>submitted ${when(j.submitted_at)}, started ${when(j.started_at)}, finished ${when(j.finished_at)}</td></tr>
      <tr><td>placement</td><td>${j.allocations.map((a) => `${a.node}: ${a.gpus.join(",")}`).join("; ") || "-"}</td></tr>
      <tr><td>restored</td><td>${escape(j.restore || "no restore reported")}</td></tr>
    </table>
    <h2>Checkpoints</h2>${typeof j.checkpoints === "string" ? `<span class="muted">${escape(j.checkpoints)}</span>` :
      j.checkpoints.length ? `<table data-checkpoints="${j.id}">${j.checkpoints.map((c) =>
        `<tr><td>step ${c.step}</td><td>attempt ${c.attempt}</td><td>${when(c.committed_at)}</td><td>${c.shards} shard(s)</td></tr>`).join("")}</table>`
      : `<span class="muted">none committed</span>`}
    <h2>Goodput</h2><table>${parts}</table>
    <h2>Rank 0 log</h2><pre>${escape((j.logs || []).join("\n"))}</pre>`;
  if (state) drawFabric();
}

function render(next) {
  const t0 = performance.now();
  state = next;
  drawFabric();
  drawQueues();
  drawJobs();
  drawHistory();
  document.getElementById("status").textContent = state.error ? "error: " + state.error : `live · ${state.scheduler}`;
  window.phalanxRenderMs = performance.now() - t0;
  window.phalanxVersion = state.version;
}
window.phalanxRender = render;

document.getElementById("colour").onchange = () => state && drawFabric();
document.getElementById("job-close").onclick = (e) => {
  e.preventDefault();
  selected = null;
  location.hash = "";
  document.getElementById("job-section").hidden = true;
  if (state) drawFabric();
};

fetch("api/state").then((r) => r.json()).then(render);
const events = new EventSource("api/events");
events.addEventListener("state", (e) => window.phalanxLive !== false && render(JSON.parse(e.data)));
events.onerror = () => { document.getElementById("status").textContent = "reconnecting…"; };
if (location.hash.startsWith("#/job/")) openJob(location.hash.slice(6));
