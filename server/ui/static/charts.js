// Small SVG line charts, drawn with DOM calls only (no innerHTML, no inline style):
// enough for a few series over the last minutes, redrawn on every poll.
"use strict";

const TandemCharts = (() => {
  const NS = "http://www.w3.org/2000/svg";

  function el(name, attrs) {
    const node = document.createElementNS(NS, name);
    for (const [key, value] of Object.entries(attrs || {})) node.setAttribute(key, String(value));
    return node;
  }

  function niceMax(value) {
    if (!(value > 0)) return 1;
    const power = Math.pow(10, Math.floor(Math.log10(value)));
    for (const step of [1, 2, 2.5, 5, 10]) {
      if (value <= step * power) return step * power;
    }
    return 10 * power;
  }

  function plain(v) {
    return Number.isInteger(v) ? String(v) : v.toFixed(v < 10 ? 1 : 0);
  }

  // series: [{values: [number|null], cls: "s-accent", area: bool}], over `slots` points,
  // the newest at the right. format: the axis label of a value.
  function line(container, series, options) {
    const opts = Object.assign({ slots: 300, format: plain, max: null }, options);
    const width = Math.max(container.clientWidth, 120);
    const height = Math.max(container.clientHeight, 60);
    const left = 34;
    const top = 6;
    const bottom = 14;
    const plotW = width - left - 4;
    const plotH = height - top - bottom;
    let peak = 0;
    for (const s of series) for (const v of s.values) if (v != null && v > peak) peak = v;
    const max = opts.max != null ? opts.max : niceMax(peak);
    const svg = el("svg", { viewBox: `0 0 ${width} ${height}`, role: "img" });
    for (const fraction of [0, 0.5, 1]) {
      const y = top + plotH * (1 - fraction);
      svg.appendChild(el("line", { x1: left, x2: width - 4, y1: y, y2: y, class: "grid" }));
      const label = el("text", { x: left - 5, y: y + 3, "text-anchor": "end", class: "axis" });
      label.textContent = opts.format(max * fraction);
      svg.appendChild(label);
    }
    const minutes = Math.round(opts.slots / 60);
    const edge = el("text", { x: left, y: height - 2, class: "axis" });
    edge.textContent = `-${minutes} min`;
    svg.appendChild(edge);
    const now = el("text", { x: width - 4, y: height - 2, "text-anchor": "end", class: "axis" });
    now.textContent = "now";
    svg.appendChild(now);
    const x = (i, count) => left + plotW * ((opts.slots - count + i) / Math.max(opts.slots - 1, 1));
    const y = (v) => top + plotH * (1 - Math.min(v, max) / max);
    for (const s of series) {
      const points = [];
      s.values.forEach((v, i) => {
        if (v != null) points.push([x(i, s.values.length), y(v)]);
      });
      if (points.length < 2) continue;
      const d = points.map(([px, py], i) => `${i ? "L" : "M"}${px.toFixed(1)},${py.toFixed(1)}`).join("");
      if (s.area) {
        const base = top + plotH;
        const closed = `${d}L${points[points.length - 1][0].toFixed(1)},${base}L${points[0][0].toFixed(1)},${base}Z`;
        svg.appendChild(el("path", { d: closed, class: `area ${s.cls}` }));
      }
      svg.appendChild(el("path", { d, class: `line ${s.cls}` }));
    }
    container.replaceChildren(svg);
  }

  return { line };
})();
