// Keel's chart element: panels of line charts, heatmaps and bar charts drawn on <canvas>, mounted by
// keel.dashboard.charts through st.components.v2. A canvas costs the browser next to nothing per chart,
// where a Vega view cost about 0.1 s each to compile, lay out and draw, most of the Run page's load time.
// The data arrive as column arrays, already downsampled on the server (M4), so every point is drawn.

const FONT = "11px 'Source Sans Pro', 'Source Sans 3', sans-serif";
// Streamlit's theme, light or dark (it follows the user's system by default): read from the CSS variables
// it gives components at each render (theme()), Streamlit's light theme until then.
let TEXT = "#31333f";
let BACKGROUND = "#ffffff";
const PAD = { left: 60, right: 10, top: 8, bottom: 30 };
// Viridis (matplotlib's colour map) at eleven stops, interpolated in between.
const VIRIDIS = ["#440154", "#482475", "#414487", "#355f8d", "#2a788e", "#21918c", "#22a884", "#44bf70", "#7ad151", "#bddf26", "#fde725"];

export default function (component) {
  const { data, parentElement } = component;
  const root = parentElement.querySelector(".keel-chart") || parentElement.appendChild(document.createElement("div"));
  root.className = "keel-chart";
  root.style.cssText = `display:grid;grid-template-columns:repeat(${data.columns},minmax(0,1fr));gap:12px 18px;position:relative;`;
  const draw = () => render(root, data);
  draw();
  const resized = new ResizeObserver(() => {
    if (root.dataset.width !== String(root.clientWidth)) draw();
  });
  resized.observe(root);
  return () => resized.disconnect();
}

function theme(root) {
  const style = getComputedStyle(root);
  const get = (name, fallback) => style.getPropertyValue(name).trim() || fallback;
  return [get("--st-text-color", "#31333f"), get("--st-background-color", "#ffffff")];
}

function render(root, data) {
  [TEXT, BACKGROUND] = theme(root);
  root.replaceChildren();
  root.dataset.width = String(root.clientWidth);
  const tip = document.createElement("div");
  tip.style.cssText = `position:absolute;display:none;pointer-events:none;z-index:10;background:${BACKGROUND};color:${TEXT};`
    + "border:1px solid rgba(128,128,128,.45);border-radius:4px;padding:4px 7px;font:12px sans-serif;white-space:pre;box-shadow:0 1px 4px rgba(0,0,0,.15);";
  for (const panel of data.panels) {
    const cell = root.appendChild(document.createElement("div"));
    cell.className = "keel-panel";
    cell.dataset.title = panel.title;
    const heading = cell.appendChild(document.createElement("div"));
    heading.textContent = panel.title; // text, not pixels: found by search and read by screen readers
    heading.style.cssText = `font:600 13px sans-serif;color:${TEXT};text-align:center;margin-bottom:2px;`;
    const canvas = cell.appendChild(document.createElement("canvas"));
    const width = Math.max(120, cell.clientWidth);
    const height = panel.height + PAD.top + PAD.bottom; // panel.height: the plot's own
    const g = sized(canvas, width, height);
    const hover = { lines: drawLines, heatmap: drawHeatmap, bars: drawBars }[panel.kind](g, panel, width, height);
    canvas.dataset.drawn = "1";
    canvas.addEventListener("mousemove", (e) => {
      const box = canvas.getBoundingClientRect();
      const text = hover(e.clientX - box.left, e.clientY - box.top);
      if (!text) return void (tip.style.display = "none");
      const at = root.getBoundingClientRect();
      tip.textContent = text;
      tip.style.display = "block";
      tip.style.left = `${Math.min(e.clientX - at.left + 14, at.width - tip.offsetWidth)}px`;
      tip.style.top = `${e.clientY - at.top + 14}px`;
    });
    canvas.addEventListener("mouseleave", () => (tip.style.display = "none"));
    if (panel.legend) cell.appendChild(legend(panel.legend));
  }
  root.appendChild(tip);
  root.dataset.drawn = String(data.panels.length);
}

function sized(canvas, width, height) {
  const ratio = window.devicePixelRatio || 1;
  canvas.width = Math.round(width * ratio);
  canvas.height = Math.round(height * ratio);
  canvas.style.width = `${width}px`;
  canvas.style.height = `${height}px`;
  const g = canvas.getContext("2d");
  g.scale(ratio, ratio);
  g.font = FONT;
  return g;
}

// A linear scale from [lo, hi] onto pixels [a, b].
const scale = (lo, hi, a, b) => (v) => a + ((v - lo) / (hi - lo || 1)) * (b - a);

// A round step (1, 2 or 5 times a power of ten) giving about `count` ticks over [lo, hi].
function tickStep(lo, hi, count) {
  const raw = (hi - lo) / count || 1;
  const power = 10 ** Math.floor(Math.log10(raw));
  return [1, 2, 5, 10].map((m) => m * power).find((s) => s >= raw);
}

// The round tick values in [lo, hi], about `count` of them.
function ticks(lo, hi, count, whole) {
  const step = whole ? Math.max(1, Math.round(tickStep(lo, hi, count))) : tickStep(lo, hi, count);
  const out = [];
  for (let v = Math.ceil(lo / step) * step; v <= hi + step * 1e-9; v += step) out.push(Math.abs(v) < step * 1e-9 ? 0 : v);
  return out;
}

// A tick label centred under `at`, moved inside the canvas when it would be cut off at an edge.
function xLabel(g, text, at, top) {
  const half = g.measureText(text).width / 2, width = g.canvas.width / (window.devicePixelRatio || 1);
  g.textAlign = "center";
  g.fillText(text, Math.min(Math.max(at, half + 1), width - half - 1), top);
}

const number = (v) => (Math.abs(v) >= 1e4 || Number.isInteger(v) ? Math.round(v).toLocaleString("en-US") : String(Number(v.toPrecision(3))));

function frame(columns) {
  const names = Object.keys(columns);
  const length = names.length ? columns[names[0]].length : 0;
  return { names, length, row: (i) => Object.fromEntries(names.map((n) => [n, columns[n][i]])) };
}

function axes(g, x, y, xTicks, yTicks, plot, xTitle) {
  g.strokeStyle = TEXT; // grid lines and frame in the text colour, faint: they read on a light or dark theme
  g.lineWidth = 1;
  g.fillStyle = TEXT;
  g.textAlign = "right";
  g.textBaseline = "middle";
  for (const v of yTicks) {
    g.globalAlpha = 0.12;
    g.beginPath();
    g.moveTo(plot.left, Math.round(y(v)) + 0.5);
    g.lineTo(plot.right, Math.round(y(v)) + 0.5);
    g.stroke();
    g.globalAlpha = 1;
    g.fillText(number(v), plot.left - 5, y(v));
  }
  g.textBaseline = "top";
  for (const v of xTicks) xLabel(g, number(v), x(v), plot.bottom + 5);
  g.textAlign = "center";
  g.fillText(xTitle, (plot.left + plot.right) / 2, plot.bottom + 17);
  g.textBaseline = "alphabetic";
  g.globalAlpha = 0.45;
  g.strokeRect(plot.left + 0.5, plot.top + 0.5, plot.right - plot.left, plot.bottom - plot.top);
  g.globalAlpha = 1;
}

// A line per segment (panel.by: the effective trajectory and each abandoned attempt, or each run; never
// joined) under a vertical rule per event, coloured by kind. Hover: the nearest point, and the events there.
function drawLines(g, panel, width, height) {
  const events = frame(panel.frames.events);
  const lines = { step: panel.frames.lines[panel.x], value: panel.frames.lines.value, segment: panel.frames.lines[panel.by] };
  const plot = { left: PAD.left, right: width - PAD.right, top: PAD.top, bottom: height - PAD.bottom };
  const [lo, hi] = panel.steps;
  let min = Infinity, max = -Infinity;
  for (const v of lines.value) [min, max] = [Math.min(min, v), Math.max(max, v)];
  if (!(min <= max)) [min, max] = [0, 1];
  const margin = (max - min) * 0.05 || Math.abs(max) * 0.05 || 1;
  const yTicks = ticks(min - margin, max + margin, Math.max(2, Math.floor((plot.bottom - plot.top) / 35)), false);
  const yLo = Math.min(min - margin, yTicks[0] ?? min), yHi = Math.max(max + margin, yTicks[yTicks.length - 1] ?? max);
  const x = scale(lo, hi === lo ? lo + 1 : hi, plot.left, plot.right), y = scale(yLo, yHi, plot.bottom, plot.top);
  axes(g, x, y, ticks(lo, hi, Math.max(2, Math.floor((plot.right - plot.left) / 70)), true), yTicks, plot, panel.x_title);
  g.save();
  g.beginPath();
  g.rect(plot.left, plot.top, plot.right - plot.left, plot.bottom - plot.top);
  g.clip();
  g.globalAlpha = 0.7;
  for (let i = 0; i < events.length; i++) {
    g.strokeStyle = panel.kinds[panel.frames.events.kind[i]];
    const px = Math.round(x(panel.frames.events.step[i])) + 0.5;
    g.beginPath();
    g.moveTo(px, plot.top);
    g.lineTo(px, plot.bottom);
    g.stroke();
  }
  g.globalAlpha = 1;
  g.lineWidth = 1.5;
  const bySegment = new Map();
  lines.segment.forEach((s, i) => (bySegment.get(s) || bySegment.set(s, []).get(s)).push(i));
  for (const [segment, rows] of bySegment) {
    const style = panel.segments[segment];
    g.strokeStyle = style.colour;
    g.setLineDash(style.dash);
    g.beginPath();
    rows.forEach((r, k) => (k ? g.lineTo : g.moveTo).call(g, x(lines.step[r]), y(lines.value[r])));
    g.stroke();
  }
  g.restore();
  g.canvas.dataset.segments = String(bySegment.size);
  return (mx, my) => {
    if (mx < plot.left || mx > plot.right || my < plot.top || my > plot.bottom) return "";
    let best = -1;
    for (let r = 0; r < lines.step.length; r++) {
      const d = Math.hypot(x(lines.step[r]) - mx, y(lines.value[r]) - my);
      if (best < 0 || d < best.d) best = { r, d };
    }
    const out = [];
    if (best.d < 30) out.push(`${lines.segment[best.r]}  ${panel.x_title} ${number(lines.step[best.r])}  ${panel.title} ${number(lines.value[best.r])}`);
    for (let i = 0; i < events.length; i++) {
      if (Math.abs(x(panel.frames.events.step[i]) - mx) > 3) continue;
      const e = events.row(i);
      out.push(`${e.kind} at step ${number(e.step)} (attempt ${e.attempt}, rank ${e.rank}, ${e.severity}): ${e.message}`);
    }
    return out.join("\n");
  };
}

function viridis(t) {
  const at = Math.min(1, Math.max(0, t)) * (VIRIDIS.length - 1), i = Math.min(VIRIDIS.length - 2, Math.floor(at)), f = at - i;
  const [a, b] = [VIRIDIS[i], VIRIDIS[i + 1]].map((c) => [1, 3, 5].map((k) => parseInt(c.slice(k, k + 2), 16)));
  return `rgb(${a.map((v, k) => Math.round(v + (b[k] - v) * f)).join(",")})`;
}

// One cell per rank and step range coloured by the mean of `metric` (blank: not measured), straggler
// events ringed in red. Hover: the cell's numbers, or the straggler's message.
function drawHeatmap(g, panel, width, height) {
  const cells = frame(panel.frames.cells), rings = frame(panel.frames.rings), ranks = panel.ranks;
  const plot = { left: PAD.left, right: width - PAD.right - 64, top: PAD.top, bottom: height - PAD.bottom }; // room for the colour key
  const x = scale(panel.steps[0], panel.steps[1] + 1, plot.left, plot.right);
  const row = (plot.bottom - plot.top) / ranks.length, rowOf = new Map(ranks.map((r, i) => [r, i]));
  const values = panel.frames.cells[panel.metric].filter((v) => v !== null);
  const lo = Math.min(...values), hi = Math.max(...values);
  for (let i = 0; i < cells.length; i++) {
    const v = panel.frames.cells[panel.metric][i];
    if (v === null) continue;
    g.fillStyle = viridis(hi > lo ? (v - lo) / (hi - lo) : 0.5);
    // Whole pixels, so that neighbouring cells meet without an anti-aliased seam between them.
    const left = Math.floor(x(panel.frames.cells.first_step[i])), right = Math.ceil(x(panel.frames.cells.last_step[i] + 1));
    g.fillRect(left, Math.floor(plot.top + rowOf.get(panel.frames.cells.rank[i]) * row), Math.max(1, right - left), Math.ceil(row));
  }
  g.fillStyle = TEXT;
  g.textAlign = "right";
  g.textBaseline = "middle";
  const every = Math.ceil(12 / row);
  ranks.forEach((r, i) => i % every === 0 && g.fillText(String(r), plot.left - 5, plot.top + (i + 0.5) * row));
  g.textBaseline = "top";
  for (const v of ticks(panel.steps[0], panel.steps[1], Math.max(2, Math.floor((plot.right - plot.left) / 70)), true))
    xLabel(g, number(v), x(v + 0.5), plot.bottom + 5);
  g.textAlign = "center";
  g.fillText("step", (plot.left + plot.right) / 2, plot.bottom + 17);
  g.save();
  g.translate(12, (plot.top + plot.bottom) / 2);
  g.rotate(-Math.PI / 2);
  g.fillText("rank", 0, -6);
  g.restore();
  for (let k = 0; k <= 20; k++) { // the colour key
    g.fillStyle = viridis(k / 20);
    g.fillRect(plot.right + 12, plot.bottom - ((k + 1) * (plot.bottom - plot.top)) / 21, 10, (plot.bottom - plot.top) / 21 + 1);
  }
  g.fillStyle = TEXT;
  g.textAlign = "left";
  g.textBaseline = "middle";
  if (values.length) [lo, hi].forEach((v, k) => g.fillText(number(v), plot.right + 25, k ? plot.top + 4 : plot.bottom - 4));
  g.strokeStyle = "#ff2d2d";
  g.lineWidth = 2.5;
  for (let i = 0; i < rings.length; i++) {
    g.beginPath();
    g.arc(x(panel.frames.rings.step[i] + 0.5), plot.top + (rowOf.get(panel.frames.rings.rank[i]) + 0.5) * row, 6, 0, 2 * Math.PI);
    g.stroke();
  }
  return (mx, my) => {
    for (let i = 0; i < rings.length; i++) {
      const e = rings.row(i);
      if (Math.hypot(x(e.step + 0.5) - mx, plot.top + (rowOf.get(e.rank) + 0.5) * row - my) < 8) return `step ${number(e.step)}, rank ${e.rank}: ${e.message}`;
    }
    const r = ranks[Math.floor((my - plot.top) / row)];
    for (let i = 0; i < cells.length; i++) {
      const c = cells.row(i);
      if (c.rank !== r || mx < x(c.first_step) || mx > x(c.last_step + 1)) continue;
      return [`rank ${r}, steps ${number(c.first_step)} to ${number(c.last_step)}`, ...panel.hover.map((f) => `${f}: ${c[f] === null ? "not measured" : number(c[f])}`)].join("\n");
    }
    return "";
  };
}

// Horizontal bars, one row of `row_px` pixels per label, in the frame's order.
function drawBars(g, panel, width, height) {
  const labels = panel.frames.bars[panel.label].map(String), values = panel.frames.bars[panel.value];
  g.font = FONT;
  const left = 8 + Math.max(...labels.map((l) => g.measureText(l).width));
  const plot = { left, right: width - PAD.right - 10, top: PAD.top, bottom: height - PAD.bottom };
  const most = Math.max(...values, 0) || 1, count = Math.max(2, Math.floor((plot.right - plot.left) / 60));
  const end = Math.ceil(most / tickStep(0, most, count)) * tickStep(0, most, count); // the axis ends on a tick
  const xTicks = ticks(0, end, count, false), x = scale(0, end, plot.left, plot.right), row = (plot.bottom - plot.top) / labels.length;
  g.fillStyle = TEXT;
  g.textBaseline = "top";
  for (const v of xTicks) xLabel(g, number(v), x(v), plot.bottom + 5);
  g.textAlign = "right";
  g.textBaseline = "middle";
  labels.forEach((l, i) => {
    g.fillStyle = TEXT;
    g.fillText(l, plot.left - 5, plot.top + (i + 0.5) * row);
    g.fillStyle = "#4c78a8";
    g.fillRect(plot.left, plot.top + i * row + 2, Math.max(0, x(values[i]) - plot.left), row - 4);
  });
  return (mx, my) => {
    const i = Math.floor((my - plot.top) / row);
    return mx >= plot.left && i >= 0 && i < labels.length ? `${labels[i]}: ${number(values[i])}` : "";
  };
}

function legend(entries) {
  const box = document.createElement("div");
  box.style.cssText = `display:flex;flex-wrap:wrap;gap:4px 14px;justify-content:center;font:12px sans-serif;color:${TEXT};margin-top:4px;`;
  for (const { label, colour, dashed } of entries) {
    const item = box.appendChild(document.createElement("span"));
    const swatch = item.appendChild(document.createElement("span"));
    swatch.style.cssText = `display:inline-block;width:16px;height:0;border-top:2px ${dashed ? "dashed" : "solid"} ${colour};margin-right:5px;vertical-align:middle;`;
    item.appendChild(document.createTextNode(label));
  }
  return box;
}
