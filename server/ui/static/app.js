// The dashboard: polls /ui/status every second, keeps the last five minutes in this
// tab (the server keeps no history for the page), and asks for an API key when the
// server wants one. Every figure is set as text.
"use strict";

(() => {
  const POLL_MS = 1000;
  const SLOTS = 300; // samples kept: five minutes at one a second
  const KEY = "tandem.apiKey";
  const METHOD_ORDER = ["pld", "draft", "mtp", "dflash", "eagle3", "assistant"];
  const TPS_WINDOW = 2; // samples a tokens/s point averages over
  const ACCEPT_WINDOW = 10; // ... an acceptance or time-to-first-token point
  const history = []; // samples of the counters, oldest first (see sampleOf)
  let asking = false;

  const $ = (id) => document.getElementById(id);
  const field = (name) => document.querySelector(`[data-field="${name}"]`);
  const setText = (name, text) => {
    const node = field(name);
    if (node) node.textContent = text;
  };

  function getKey() {
    return sessionStorage.getItem(KEY) || "";
  }

  function make(tag, cls, text) {
    const node = document.createElement(tag);
    if (cls) node.className = cls;
    if (text != null) node.textContent = text;
    return node;
  }

  function bytes(n) {
    if (!n) return "0 B";
    const units = ["B", "KB", "MB", "GB", "TB"];
    const i = Math.min(Math.floor(Math.log(n) / Math.log(1024)), units.length - 1);
    return `${(n / Math.pow(1024, i)).toFixed(i ? 1 : 0)} ${units[i]}`;
  }

  function ms(seconds) {
    if (seconds == null) return "–";
    return seconds < 1 ? `${Math.round(seconds * 1000)} ms` : `${seconds.toFixed(2)} s`;
  }

  function pct(x) {
    return `${Math.round(100 * x)}%`;
  }

  function duration(s) {
    const d = Math.floor(s / 86400);
    const h = Math.floor((s % 86400) / 3600);
    const m = Math.floor((s % 3600) / 60);
    return d ? `${d}d ${h}h` : h ? `${h}h ${m}m` : `${m}m ${Math.floor(s % 60)}s`;
  }

  // ---- access ------------------------------------------------------------------

  function askForKey(refused) {
    $("key-error").classList.toggle("hidden", !refused);
    $("key-dialog").classList.remove("hidden");
    $("key-button").classList.remove("hidden");
    if (!asking) $("key-input").focus();
    asking = true;
  }

  $("key-form").addEventListener("submit", (event) => {
    event.preventDefault();
    const key = $("key-input").value.trim();
    if (!key) return;
    sessionStorage.setItem(KEY, key);
    $("key-input").value = "";
    $("key-dialog").classList.add("hidden");
    asking = false;
    poll();
  });
  $("key-button").addEventListener("click", () => askForKey(false));

  // ---- rendering ---------------------------------------------------------------

  // One sample per poll: the counters as read, so any window's rate can be computed.
  function sampleOf(s) {
    const methods = {};
    for (const [method, m] of Object.entries(s.speculation.by_method)) {
      methods[method] = [m.drafted, m.accepted];
    }
    return {
      time: s.time,
      tokens: s.tokens.generated,
      running: s.requests.running,
      waiting: s.requests.waiting,
      ttft: [s.ttft.sum, s.ttft.count],
      methods,
    };
  }

  // Rates over the `window` samples before sample i (fewer at the start).
  function rateAt(i, window) {
    const now = history[i];
    const then = history[Math.max(0, i - window)];
    const seconds = now.time - then.time;
    const out = { tps: null, ttft: null, accept: {} };
    if (seconds <= 0) return out;
    out.tps = Math.max(0, now.tokens - then.tokens) / seconds;
    const count = now.ttft[1] - then.ttft[1];
    if (count > 0) out.ttft = (now.ttft[0] - then.ttft[0]) / count;
    for (const [method, [drafted, accepted]] of Object.entries(now.methods)) {
      const [draftedThen, acceptedThen] = then.methods[method] || [0, 0];
      if (drafted > draftedThen) out.accept[method] = (accepted - acceptedThen) / (drafted - draftedThen);
    }
    return out;
  }

  function series() {
    // The charted window: the last SLOTS samples, each a rate over the seconds before it.
    const first = Math.max(1, history.length - SLOTS);
    const out = { tps: [], ttft: [], running: [], waiting: [], accept: {} };
    for (const m of METHOD_ORDER) out.accept[m] = [];
    for (let i = first; i < history.length; i++) {
      const fast = rateAt(i, TPS_WINDOW);
      const slow = rateAt(i, ACCEPT_WINDOW);
      out.tps.push(fast.tps);
      out.ttft.push(slow.ttft == null ? null : slow.ttft * 1000);
      out.running.push(history[i].running);
      out.waiting.push(history[i].waiting);
      for (const m of METHOD_ORDER) {
        out.accept[m].push(slow.accept[m] == null ? null : slow.accept[m] * 100);
      }
    }
    return out;
  }

  function renderHeader(s) {
    $("model-name").textContent = s.model;
    $("vision").classList.toggle("hidden", !s.vision);
    document.title = `${s.model} · Tandem`;
    const state = $("state");
    state.textContent = s.state;
    state.className = `pill ${s.state === "ready" ? "ok" : s.state === "loading" ? "warn" : "bad"}`;
    $("engine").textContent = s.engine;
    $("device").textContent = `${s.device.replace(/^Device\((\w+).*$/, "$1")} · BLAS ${s.blas}`;
    if (s.keys) $("key-button").classList.remove("hidden");
    setText("uptime", `up ${duration(s.uptime_s)}`);
  }

  function renderKpis(s, data) {
    const tpsNow = data.tps.length ? data.tps[data.tps.length - 1] : null;
    setText("tps", tpsNow == null ? "–" : tpsNow.toFixed(1));
    const peak = Math.max(0, ...data.tps.map((v) => v || 0));
    setText("tps-sub", `peak ${peak.toFixed(peak >= 100 ? 0 : 1)} in 5 min`);
    setText("running", String(s.requests.running));
    setText("waiting", String(s.requests.waiting));
    setText("finished", String(s.requests.finished));
    setText("batch", String(s.batch_size));
    setText("batch-sub", `at most ${s.requests.max_batch}`);
    const recent = data.ttft.filter((v) => v != null);
    const mean = s.ttft.count ? s.ttft.sum / s.ttft.count : null;
    setText("ttft", ms(recent.length ? recent[recent.length - 1] / 1000 : mean));
    setText("ttft-sub", mean == null ? "no requests yet" : `mean ${ms(mean)} · ${s.ttft.count} req`);
    const spec = s.speculation;
    setText("accept", spec.drafted ? pct(spec.accepted / spec.drafted) : "–");
    setText("accept-sub", spec.drafted ? `${spec.accepted} / ${spec.drafted} drafted`
      : spec.drafters.length ? "no drafts yet" : "no drafter");
    const pc = s.prefix_cache;
    setText("prefix", pc.queries ? pct(pc.hits / pc.queries) : "–");
    setText("prefix-sub", `${pc.hits} of ${pc.queries} tokens`);
    setText("memory", s.memory.active != null ? bytes(s.memory.active) : "–");
    setText("memory-sub", s.memory.peak != null ? `peak ${bytes(s.memory.peak)}` : "after a request");
    setText("switches", String(s.mode_switches));
    setText("switches-sub", "single ⇄ batched");
  }

  function renderCharts(data) {
    TandemCharts.line($("chart-tps"), [{ values: data.tps, cls: "s-accent", area: true }],
      { slots: SLOTS });
    const most = Math.max(2, ...data.running, ...data.waiting);
    TandemCharts.line($("chart-requests"), [
      { values: data.running, cls: "s-accent", area: true },
      { values: data.waiting, cls: "s-waiting" },
    ], { slots: SLOTS, max: 2 * Math.ceil(most / 2) });
    const methods = METHOD_ORDER.filter((m) => data.accept[m].some((v) => v != null));
    TandemCharts.line($("chart-accept"), methods.map((m) => ({ values: data.accept[m], cls: `s-${m}` })),
      { slots: SLOTS, max: 100, format: (v) => `${v.toFixed(0)}%` });
    const legend = $("accept-legend");
    legend.replaceChildren(...methods.map((m) => {
      const item = make("span", null);
      item.appendChild(make("span", `swatch sw-${m}`));
      item.appendChild(document.createTextNode(TandemChat.SOURCES[m] || m));
      return item;
    }));
    TandemCharts.line($("chart-ttft"), [{ values: data.ttft, cls: "s-good" }],
      { slots: SLOTS, format: (v) => `${Number.isInteger(v) ? v : v.toFixed(1)} ms` });
  }

  function renderSpeculation(s) {
    const spec = s.speculation;
    const drafters = $("drafters");
    if (spec.drafters.length) {
      drafters.replaceChildren(...spec.drafters.map((d) => make("span", "pill engine", d.name)));
    } else {
      drafters.replaceChildren(make("span", "pill", spec.supported ? "no drafter" : "speculation off for this model"));
    }
    const rows = Object.entries(spec.by_method).map(([method, m]) => {
      const tr = make("tr");
      tr.appendChild(make("td", null, m.name));
      tr.appendChild(make("td", "num", String(m.drafted)));
      tr.appendChild(make("td", "num", m.drafted ? `${m.accepted} (${pct(m.accepted / m.drafted)})` : "0"));
      const cell = make("td");
      const bar = make("div", `bar ${method}`);
      const fill = make("span");
      fill.style.width = `${m.drafted ? (100 * m.accepted) / m.drafted : 0}%`;
      bar.appendChild(fill);
      cell.appendChild(bar);
      tr.appendChild(cell);
      return tr;
    });
    if (!rows.length) {
      const tr = make("tr");
      const td = make("td", "note", "Nothing drafted yet.");
      td.colSpan = 4;
      tr.appendChild(td);
      rows.push(tr);
    }
    $("methods").tBodies[0].replaceChildren(...rows);
    const positions = $("positions");
    // Positions up to the last that is accepted at least 1% of the time (at most 12).
    let shown = 0;
    spec.per_position.forEach((rate, i) => {
      if (rate >= 0.01) shown = i + 1;
    });
    const kept = spec.per_position.slice(0, Math.min(Math.max(shown, 1), 12));
    positions.replaceChildren(...kept.map((rate, i) => {
      const col = make("div", "col");
      col.appendChild(make("span", "colval", pct(rate)));
      const bar = make("div", "colbar");
      bar.style.height = `${Math.max(1, rate * 100) * 0.5}px`;
      col.appendChild(bar);
      col.appendChild(make("span", "collabel", String(i + 1)));
      col.title = `draft position ${i + 1}: accepted in ${pct(rate)} of drafts`;
      return col;
    }));
    if (!spec.per_position.length) positions.replaceChildren(make("p", "note", "No drafts yet."));
    const perRow = spec.row_drafts_count ? (spec.row_drafts_sum / spec.row_drafts_count).toFixed(2) : "–";
    const trips = Object.values(spec.gate_trips).reduce((a, b) => a + b, 0);
    setText("row-drafts", `In batches: ${perRow} drafted tokens per row per step · gates closed ${trips} times`);
  }

  function renderYours(s) {
    $("yours-title").textContent = s.keys ? "Your recent requests" : "Recent requests";
    const rows = s.yours.map((r) => {
      const tr = make("tr");
      const id = make("td", null, r.id);
      id.title = `${r.id} · ${r.surface} · ${r.finish_reason} · ${r.modes.join("+")}`;
      tr.appendChild(id);
      tr.appendChild(make("td", "num", `${r.completion_tokens}`));
      tr.appendChild(make("td", "num", ms(r.ttft_s)));
      tr.appendChild(make("td", "num", r.tokens_per_second ? r.tokens_per_second.toFixed(1) : "–"));
      tr.appendChild(make("td", "num", r.drafted ? `${r.accepted}/${r.drafted}` : "–"));
      return tr;
    });
    $("yours").tBodies[0].replaceChildren(...rows);
    $("yours-empty").classList.toggle("hidden", rows.length > 0);
  }

  function render(s) {
    history.push(sampleOf(s));
    if (history.length > SLOTS + ACCEPT_WINDOW) history.shift();
    const data = series();
    renderHeader(s);
    renderKpis(s, data);
    renderCharts(data);
    renderSpeculation(s);
    renderYours(s);
  }

  // ---- polling -----------------------------------------------------------------

  async function poll() {
    const headers = {};
    const key = getKey();
    if (key) headers.Authorization = `Bearer ${key}`;
    try {
      const response = await fetch("/ui/status", { headers, cache: "no-store" });
      if (response.status === 401) {
        const refused = Boolean(key);
        sessionStorage.removeItem(KEY);
        askForKey(refused);
        return;
      }
      if (!response.ok) throw new Error(String(response.status));
      render(await response.json());
    } catch (error) {
      const state = $("state");
      state.textContent = "unreachable";
      state.className = "pill bad";
    }
  }

  TandemChat.init({ getKey, onUnauthorized: () => askForKey(true) });
  poll();
  setInterval(() => {
    if (!asking) poll();
  }, POLL_MS);
})();
