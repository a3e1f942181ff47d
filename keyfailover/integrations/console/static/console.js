// The keyfailover console: hash-routed pages that poll the admin endpoint's JSON about every second.
// Vanilla ES2020, no dependencies; every text from the server goes into the DOM as textContent.
"use strict";

const SLOTS = 65536;
const POLL_MS = 1000;
const MAX_BACKOFF_MS = 8000;
const TOKEN_KEY = "keyfailover-token";

const statusEl = document.getElementById("status");
const pageEl = document.getElementById("page");
const form = document.getElementById("token-form");
const tokenInput = document.getElementById("token-input");
const tokenError = document.getElementById("token-error");

let timer = null;
let generation = 0; // bumped at each route change: a poll of an older page draws nothing
let backoff = POLL_MS;
const colourIndex = new Map(); // consumer -> its colour's index, kept while the page is open

// -- small DOM helpers ------------------------------------------------------------------

function el(tag, attributes = {}, text = null) {
  const node = document.createElement(tag);
  for (const [name, value] of Object.entries(attributes)) node.setAttribute(name, value);
  if (text !== null) node.textContent = text;
  return node;
}

function svgEl(tag, attributes = {}) {
  const node = document.createElementNS("http://www.w3.org/2000/svg", tag);
  for (const [name, value] of Object.entries(attributes)) node.setAttribute(name, String(value));
  return node;
}

function table(id, headings) {
  const t = el("table", { id });
  const row = el("tr");
  for (const heading of headings) row.append(el("th", { scope: "col" }, heading));
  t.append(el("thead"), el("tbody"));
  t.tHead.append(row);
  return t;
}

// Make tbody's rows those of items, in order: a row per key kept and refilled, others removed.
function syncRows(tbody, items, keyOf, fill) {
  const old = new Map([...tbody.rows].map((row) => [row.dataset.key, row]));
  items.forEach((item, index) => {
    const key = keyOf(item);
    let row = old.get(key);
    old.delete(key);
    if (!row) {
      row = el("tr", { "data-key": key });
    }
    if (tbody.rows[index] !== row) tbody.insertBefore(row, tbody.rows[index] || null);
    fill(row, item);
  });
  for (const row of old.values()) row.remove();
}

function cells(row, values) {
  while (row.cells.length > values.length) row.deleteCell(-1);
  values.forEach((value, index) => {
    const cell = row.cells[index] || row.insertCell(-1);
    if (value instanceof Node) {
      if (cell.firstChild !== value) cell.replaceChildren(value);
    } else {
      cell.textContent = String(value);
      cell.className = typeof value === "number" ? "num" : "";
    }
  });
}

const percent = (share) => `${(100 * share).toFixed(1)}%`;
const clock = (seconds) => new Date(seconds * 1000).toLocaleTimeString();
const rate = (value) => value.toFixed(1);

// Consumer colours: 32 chosen to differ pairwise by at least 28 (CIE76 distance in Lab), the first 32
// consumers taking them in turn; further consumers get hues spread by the golden angle.
const PALETTE = ["#1b5ebb", "#1af91a", "#f91a1a", "#e6dba8", "#f91af9", "#772237", "#f9f91a", "#1ad4f9",
  "#138626", "#fc92e2", "#f99c1a", "#1a1af9", "#1af9c1", "#f91a77", "#776222", "#710495", "#227769", "#e97d67",
  "#a8e967", "#a8ade6", "#951004", "#225477", "#d1059e", "#bbae1b", "#5664fb", "#e6a8b7", "#9df1dc", "#1af977",
  "#c967e9", "#772269", "#aff91a", "#a392fc"];

// Relative luminance of a #rrggbb colour (WCAG), to put dark or light text on it.
function luminance(hex) {
  const [r, g, b] = [1, 3, 5].map((at) => {
    const c = parseInt(hex.slice(at, at + 2), 16) / 255;
    return c <= 0.04045 ? c / 12.92 : ((c + 0.055) / 1.055) ** 2.4;
  });
  return 0.2126 * r + 0.7152 * g + 0.0722 * b;
}

function colour(consumer) {
  if (!colourIndex.has(consumer)) colourIndex.set(consumer, colourIndex.size);
  const index = colourIndex.get(consumer);
  if (index < PALETTE.length) {
    const background = PALETTE[index];
    // White text up to a luminance of 0.19, where #111 starts to contrast more (WCAG: at least 4.5 either way).
    return { background, text: luminance(background) > 0.19 ? "#111" : "#fff" };
  }
  const lightness = [38, 58, 74][index % 3];
  return { background: `hsl(${(index * 137.508) % 360}, 70%, ${lightness}%)`, text: lightness > 50 ? "#111" : "#fff" };
}

function swatch(consumer) {
  const span = el("span", { class: "swatch", "aria-hidden": "true" });
  span.style.background = colour(consumer).background;
  return span;
}

// -- requests, status and the token ------------------------------------------------------

class Unauthorized extends Error {}
class Unreachable extends Error {}

async function request(path, method = "GET") {
  const headers = {};
  const token = sessionStorage.getItem(TOKEN_KEY);
  if (token) headers.Authorization = `Bearer ${token}`;
  let response;
  try {
    response = await fetch(path, { method, headers, cache: "no-store" });
  } catch (error) {
    throw new Unreachable(`cannot reach the server (${error.message})`);
  }
  if (response.status === 401) throw new Unauthorized(token ? "refused" : "needed");
  if (response.status >= 500) throw new Unreachable(`the server answered ${response.status}`);
  const body = await response.json().catch(() => ({}));
  return { status: response.status, body };
}

function setStatus(state, text) {
  statusEl.dataset.state = state;
  statusEl.textContent = text;
}

function askToken(why) {
  form.hidden = false;
  tokenError.textContent = why === "refused" ? "The server refused this token: try again." : "";
  setStatus("unauthorized", "unauthorized: the server needs its token");
}

form.addEventListener("submit", (event) => {
  event.preventDefault();
  sessionStorage.setItem(TOKEN_KEY, tokenInput.value);
  tokenInput.value = "";
  form.hidden = true;
  route();
});

// Poll `path` about every second while the page is shown; draw(body, status) after each answer.
function poll(path, draw) {
  const mine = generation;
  const run = async () => {
    if (mine !== generation) return;
    try {
      const { status, body } = await request(typeof path === "function" ? path() : path);
      if (mine !== generation) return;
      form.hidden = true;
      backoff = POLL_MS;
      setStatus("live", `live, updated ${new Date().toLocaleTimeString()}`);
      draw(body, status);
      timer = setTimeout(run, POLL_MS);
    } catch (error) {
      if (mine !== generation) return;
      if (error instanceof Unauthorized) {
        askToken(error.message);
        return; // polled again once a token is given
      }
      setStatus("unreachable", `unreachable: ${error.message}; trying again in ${backoff / 1000} s`);
      timer = setTimeout(run, backoff);
      backoff = Math.min(backoff * 2, MAX_BACKOFF_MS);
    }
  };
  run();
}

// -- pages --------------------------------------------------------------------------------

function subscriptionLink(topic, subscription) {
  const link = el("a", {}, `${topic} / ${subscription}`);
  link.href = `#/subscription/${encodeURIComponent(topic)}/${encodeURIComponent(subscription)}`;
  return link;
}

function overviewPage() {
  const list = table("subscriptions", ["subscription", "partitions", "mode", "consumers", "stuck", "rate/s",
    "backlog", "dead letters", "epoch"]);
  const empty = el("p", { class: "note" });
  pageEl.replaceChildren(el("h2", {}, "Live subscriptions"), list, empty);
  poll("/console/overview", (view) => {
    empty.textContent = view.subscriptions.length ? "" : "No live subscription on this server.";
    syncRows(list.tBodies[0], view.subscriptions, (s) => `${s.topic}\u0000${s.subscription}`, (row, s) => {
      row.dataset.topic = s.topic;
      row.dataset.subscription = s.subscription;
      cells(row, [subscriptionLink(s.topic, s.subscription), s.partitions, s.consume_mode, s.consumers, s.stuck,
        rate(s.rate), s.backlog, s.dead_lettered, s.epoch]);
    });
  });
}

function chart(title) {
  const svg = svgEl("svg", { class: "chart", viewBox: "0 0 320 80", role: "img", "aria-label": title });
  const line = svgEl("polyline");
  const top = svgEl("text", { x: 2, y: 9 });
  const caption = svgEl("text", { x: 2, y: 77 });
  svg.append(line, top, caption);
  const figure = el("figure");
  figure.append(el("figcaption", {}, title), svg);
  return {
    figure,
    draw(points, format) {
      const values = points.map((p) => p.value);
      const max = Math.max(1e-9, ...values);
      const first = points.length ? points[0].time : 0;
      const span = Math.max(1, points.length ? points[points.length - 1].time - first : 1);
      line.setAttribute("points", points.map((p) => `${(316 * (p.time - first)) / span + 2},${68 - (54 * p.value) / max}`)
        .join(" "));
      top.textContent = points.length ? `max ${format(max)}` : "no samples yet";
      caption.textContent = points.length ? `${clock(first)} to ${clock(first + span)}` : "";
    },
  };
}

function subscriptionPage(topic, subscription) {
  const bar = el("div", { id: "range-bar", role: "img", "aria-label": "key-hash ranges by consumer; see the table below" });
  const scale = el("div", { id: "range-scale" });
  for (const mark of [0, 16384, 32768, 49152, 65535]) scale.append(el("span", {}, String(mark)));
  const summary = el("p", { class: "note" });
  const consumers = table("consumers", ["consumer", "ranges", "slots", "traffic", "rate/s", "permits", "unacked",
    "draining keys", "stuck", "stalled", "next lease ends", "expired leases", "redeliveries"]);
  const history = el("div", { id: "history" });
  const backlog = chart("backlog (messages)");
  const latency = chart("delivery latency (mean, publish to delivery)");
  const charts = el("div", { class: "charts" });
  charts.append(backlog.figure, latency.figure);
  const ranges = table("range-table", ["start", "end", "consumer", "slots", "traffic"]);
  pageEl.replaceChildren(el("h2", {}, `${topic} / ${subscription}`), summary, bar, scale, el("h2", {}, "Consumers"),
    consumers, el("h2", {}, "Last range changes"), history, charts, el("h2", {}, "Ranges"), ranges);
  const path = `/console/subscription?topic=${encodeURIComponent(topic)}&subscription=${encodeURIComponent(subscription)}`;
  poll(path, (view, status) => {
    if (status !== 200) {
      summary.textContent = view.error || `the server answered ${status}`;
      summary.className = "error";
      return;
    }
    summary.className = "note";
    summary.textContent = `epoch ${view.epoch}, ${view.partitions} partition(s), ${view.consume_mode}, policy ` +
      `${view.policy}, backlog ${view.backlog}, dead-lettered ${view.dead_lettered}`;
    drawBar(bar, view);
    syncRows(consumers.tBodies[0], view.consumers, (c) => c.consumer, (row, c) => {
      row.dataset.consumer = c.consumer;
      const name = el("span");
      name.append(swatch(c.consumer), document.createTextNode(c.consumer));
      cells(row, [name, c.standby ? "standby" : c.ranges.map(([a, b]) => `${a}-${b}`).join(", "),
        percent(c.slot_share), percent(c.traffic_share), rate(c.rate), c.permits, c.unacked, c.draining_keys,
        c.stuck ? "stuck" : "no", c.stalled ? "stalled" : "no",
        c.lease_ends_in === null ? "-" : `in ${c.lease_ends_in.toFixed(1)} s`, c.expired_leases, c.redeliveries]);
    });
    drawHistory(history, view.changes);
    backlog.draw(view.series.map((s) => ({ time: s.time, value: s.backlog })),
      (n) => `${Math.round(n).toLocaleString()} message${Math.round(n) === 1 ? "" : "s"}`);
    latency.draw(view.series.filter((s) => s.delivery_seconds !== null)
      .map((s) => ({ time: s.time, value: s.delivery_seconds })), (seconds) => `${(1000 * seconds).toFixed(1)} ms`);
    syncRows(ranges.tBodies[0], view.ranges, (r) => `${r.start}`, (row, r) => {
      row.dataset.consumer = r.consumer;
      row.dataset.start = r.start;
      row.dataset.end = r.end;
      cells(row, [r.start, r.end, r.consumer, percent(r.slot_share), percent(r.traffic_share)]);
    });
  });
}

function drawBar(bar, view) {
  const segments = [...bar.querySelectorAll(".segment")];
  while (segments.length > view.ranges.length) segments.pop().remove();
  view.ranges.forEach((r, index) => {
    let segment = segments[index];
    if (!segment) {
      segment = el("div", { class: "segment" });
      bar.append(segment);
      segments.push(segment);
    }
    const width = (100 * (r.end - r.start + 1)) / SLOTS;
    const { background, text } = colour(r.consumer);
    segment.dataset.consumer = r.consumer;
    segment.dataset.start = r.start;
    segment.dataset.end = r.end;
    Object.assign(segment.style, { left: `${(100 * r.start) / SLOTS}%`, width: `${width}%`, background, color: text });
    segment.title = `slots ${r.start}-${r.end}: ${r.consumer}, ${percent(r.slot_share)} of the slots, ` +
      `${percent(r.traffic_share)} of recent traffic`;
    segment.textContent = width > 8 ? r.consumer : "";
  });
  const hatches = [...bar.querySelectorAll(".draining")];
  while (hatches.length > view.draining.length) hatches.pop().remove();
  view.draining.forEach(([start, end], index) => {
    let hatch = hatches[index];
    if (!hatch) {
      hatch = el("div", { class: "draining" });
      bar.append(hatch);
      hatches.push(hatch);
    }
    hatch.dataset.start = start;
    hatch.dataset.end = end;
    Object.assign(hatch.style, { left: `${(100 * start) / SLOTS}%`, width: `${(100 * (end - start + 1)) / SLOTS}%` });
  });
}

function drawHistory(strip, changes) {
  const boxes = [...strip.children];
  while (boxes.length > changes.length) boxes.shift().remove();
  changes.forEach((change, index) => {
    let box = boxes[index];
    if (!box) {
      box = el("span", { class: "change" });
      strip.append(box);
      boxes.push(box);
    }
    box.dataset.epoch = change.epoch;
    box.dataset.reason = change.reason;
    const where = change.partition === null ? "" : ` p${change.partition}`;
    box.textContent = `${clock(change.time)} ${change.reason}${change.consumer ? ` ${change.consumer}` : ""} ` +
      `(epoch ${change.epoch}${where})`;
    box.title = `${change.moved_slots} slots moved, stickiness ${percent(change.stickiness)}, ` +
      `${change.draining_keys} keys draining`;
  });
}

function dlqPage() {
  const list = table("dead-letters", ["subscription", "dead letters", "not replayed", "oldest", "reasons", ""]);
  const message = el("p", { id: "dlq-message", role: "status" });
  const empty = el("p", { class: "note" });
  pageEl.replaceChildren(el("h2", {}, "Dead letters"), message, list, empty);
  const act = async (action, s) => {
    const verb = action === "replay" ? "Re-publish" : "Delete";
    if (!confirm(`${verb} the dead letters of ${s.topic} / ${s.subscription}?`)) return;
    const query = `topic=${encodeURIComponent(s.topic)}&subscription=${encodeURIComponent(s.subscription)}`;
    try {
      const { status, body } = await request(`/dlq/${action}?${query}`, "POST");
      message.className = status === 200 ? "note" : "error";
      message.textContent = status === 200
        ? `${action}: ${body[action === "replay" ? "replayed" : "purged"]} dead letter(s) of ${s.topic} / ${s.subscription}`
        : body.error || `the server answered ${status}`;
    } catch (error) {
      message.className = "error";
      message.textContent = `${action} failed: ${error.message}`;
    }
  };
  poll("/console/dlq", (view) => {
    empty.textContent = view.subscriptions.length ? "" : "No dead letters on this server.";
    syncRows(list.tBodies[0], view.subscriptions, (s) => `${s.topic}\u0000${s.subscription}`, (row, s) => {
      row.dataset.topic = s.topic;
      row.dataset.subscription = s.subscription;
      let buttons = row.cells[5] && row.cells[5].firstChild;
      if (!buttons) {
        buttons = el("span");
        const replay = el("button", { class: "replay", type: "button" }, "Replay");
        const purge = el("button", { class: "purge", type: "button" }, "Purge");
        replay.addEventListener("click", () => act("replay", row.dataset));
        purge.addEventListener("click", () => act("purge", row.dataset));
        buttons.append(replay, purge);
      }
      const reasons = Object.entries(s.reasons).map(([reason, count]) => `${reason}: ${count}`).join(", ");
      cells(row, [subscriptionLink(s.topic, s.subscription), s.count, s.waiting, clock(s.oldest), reasons, buttons]);
    });
  });
}

function clusterPage() {
  const note = el("p", { id: "cluster-note", class: "note" });
  const brokers = table("brokers", ["broker", "address", "reachable", "role", "partitions"]);
  const partitions = table("partitions", ["topic", "partition", "broker", "owner epoch", "subscriptions"]);
  pageEl.replaceChildren(el("h2", {}, "Cluster"), note, el("h2", {}, "Brokers"), brokers, el("h2", {}, "Partitions"),
    partitions);
  poll("/console/cluster", (view) => {
    if (!view.cluster) {
      note.textContent = "This server is not a cluster broker: it serves every topic itself.";
      syncRows(brokers.tBodies[0], [], () => "", () => {});
      syncRows(partitions.tBodies[0], [], () => "", () => {});
      return;
    }
    note.textContent = view.joined
      ? `Seen from ${view.broker}: coordinator ${view.coordinator || "unknown"}, epoch ${view.epoch}, ` +
        `generation ${view.generation}`
      : "This broker is not in its cluster now: what it knew is not shown.";
    syncRows(brokers.tBodies[0], view.brokers, (b) => b.id, (row, b) => {
      row.dataset.broker = b.id;
      row.dataset.reachable = String(b.reachable);
      const role = [b.id === view.coordinator ? "coordinator" : "", b.id === view.broker ? "this broker" : ""];
      cells(row, [b.id, b.address, b.reachable ? "reachable" : "unreachable", role.filter(Boolean).join(", "),
        b.partitions]);
    });
    syncRows(partitions.tBodies[0], view.partitions, (p) => `${p.topic}\u0000${p.partition}`, (row, p) => {
      row.dataset.topic = p.topic;
      row.dataset.partition = p.partition;
      row.dataset.broker = p.broker;
      const subscriptions = el("span");
      p.subscriptions.forEach((name, index) => {
        if (index) subscriptions.append(document.createTextNode(", "));
        const link = subscriptionLink(p.topic, name);
        link.textContent = name;
        subscriptions.append(link);
      });
      cells(row, [p.topic, p.partition, p.broker, p.owner_epoch === null ? "not opened" : p.owner_epoch,
        subscriptions]);
    });
  });
}

// -- routing ------------------------------------------------------------------------------

function route() {
  generation += 1;
  clearTimeout(timer);
  backoff = POLL_MS;
  setStatus("loading", "loading");
  const parts = location.hash.replace(/^#\/?/, "").split("/");
  if (parts[0] === "subscription" && parts.length === 3) {
    subscriptionPage(decodeURIComponent(parts[1]), decodeURIComponent(parts[2]));
  } else if (parts[0] === "dlq") {
    dlqPage();
  } else if (parts[0] === "cluster") {
    clusterPage();
  } else {
    overviewPage();
  }
}

window.addEventListener("hashchange", route);
route();
