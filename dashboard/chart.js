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

// Lines hidden by a click on their legend entry, per chart title: kept while the page redraws (a live
// run's refresh, a resize), as W&B and TensorBoard keep them.
const HIDDEN = new Map();
const MIN_PANEL_PX = 300; // narrower windows get fewer charts to a row rather than charts too small to read

export default function (component) {
  const { data, parentElement, setTriggerValue } = component;
  const root = parentElement.querySelector(".keel-chart") || parentElement.appendChild(document.createElement("div"));
  root.className = "keel-chart";
  const draw = () => render(root, data, setTriggerValue);
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

function render(root, data, setTriggerValue) {
  [TEXT, BACKGROUND] = theme(root);
  root.replaceChildren();
  root.dataset.width = String(root.clientWidth);
  const columns = Math.max(1, Math.min(data.columns, Math.floor(root.clientWidth / MIN_PANEL_PX)));
  root.style.cssText = `display:grid;grid-template-columns:repeat(${columns},minmax(0,1fr));gap:12px 18px;position:relative;`;
  // Fixed to the window, not the chart: the hover text stays on screen at any edge and above the sidebar.
  const tip = document.createElement("div");
  tip.className = "keel-tip";
  tip.style.cssText = `position:fixed;display:none;pointer-events:none;z-index:1000001;background:${BACKGROUND};color:${TEXT};max-width:min(640px,90vw);`
    + "border:1px solid rgba(128,128,128,.45);border-radius:4px;padding:4px 7px;font:12px sans-serif;white-space:pre-wrap;box-shadow:0 1px 4px rgba(0,0,0,.15);";
  for (const panel of data.panels) panelCell(root, panel, tip, setTriggerValue, () => render(root, data, setTriggerValue));
  root.appendChild(tip);
  root.dataset.drawn = String(data.panels.length);
}

function panelCell(root, panel, tip, setTriggerValue, redraw) {
  const cell = root.appendChild(document.createElement("div"));
  cell.className = "keel-panel";
  cell.dataset.title = panel.title;
  cell.style.position = "relative";
  const heading = cell.appendChild(document.createElement("div"));
  heading.style.cssText = `display:flex;justify-content:center;align-items:baseline;gap:8px;font:600 13px sans-serif;color:${TEXT};margin-bottom:2px;`;
  heading.appendChild(document.createElement("span")).textContent = panel.title; // text, not pixels: found by search, read by screen readers
  const canvas = cell.appendChild(document.createElement("canvas"));
  const width = Math.max(120, cell.clientWidth);
  const height = panel.height + PAD.top + PAD.bottom; // panel.height: the plot's own
  const g = sized(canvas, width, height);
  const hidden = HIDDEN.get(panel.title) || new Set();
  const chart = { lines: drawLines, heatmap: drawHeatmap, bars: drawBars }[panel.kind](g, panel, width, height, hidden);
  canvas.dataset.drawn = "1";
  if (panel.kind === "lines") heading.append(exportLink("CSV", panel, () => csv(panel)), exportLink("PNG", panel, () => canvas.toDataURL("image/png")));
  canvas.addEventListener("mousemove", (e) => showTip(tip, chart.hover(...at(canvas, e)), e));
  canvas.addEventListener("mouseleave", () => (tip.style.display = "none"));
  if (panel.zoom) zoomable(canvas, cell, chart, setTriggerValue);
  if (panel.legend) cell.appendChild(legend(panel, hidden, redraw));
}

const at = (canvas, e) => {
  const box = canvas.getBoundingClientRect();
  return [e.clientX - box.left, e.clientY - box.top];
};

function showTip(tip, text, e) {
  if (!text) return void (tip.style.display = "none");
  tip.textContent = text;
  tip.style.display = "block";
  const right = e.clientX + 14 + tip.offsetWidth <= window.innerWidth - 4;
  tip.style.left = `${Math.max(4, right ? e.clientX + 14 : e.clientX - 14 - tip.offsetWidth)}px`;
  tip.style.top = `${Math.max(4, Math.min(e.clientY + 14, window.innerHeight - tip.offsetHeight - 4))}px`;
}

// A drag across the plot asks the page for the steps under it (the page sets its step range, and the
// server sends those steps at full resolution); a double-click asks for every step.
function zoomable(canvas, cell, chart, setTriggerValue) {
  const band = cell.appendChild(document.createElement("div"));
  band.style.cssText = "position:absolute;display:none;pointer-events:none;background:rgba(100,140,255,.18);border:1px solid rgba(80,120,230,.6);";
  let start = null;
  canvas.addEventListener("mousedown", (e) => {
    const [mx] = at(canvas, e);
    if (mx >= chart.plot.left && mx <= chart.plot.right) start = mx;
  });
  canvas.addEventListener("mousemove", (e) => {
    if (start === null) return;
    const [mx] = at(canvas, e), lo = Math.min(start, mx), hi = Math.max(start, mx);
    Object.assign(band.style, { display: "block", left: `${canvas.offsetLeft + lo}px`, width: `${hi - lo}px`,
      top: `${canvas.offsetTop + chart.plot.top}px`, height: `${chart.plot.bottom - chart.plot.top}px` });
  });
  window.addEventListener("mouseup", (e) => {
    if (start === null) return;
    const [mx] = at(canvas, e), steps = chart.stepsBetween(Math.min(start, mx), Math.max(start, mx));
    start = null;
    band.style.display = "none";
    if (steps) setTriggerValue("zoom", steps);
  });
  canvas.addEventListener("dblclick", () => setTriggerValue("zoom", "all"));
}

function exportLink(label, panel, contents) {
  const link = document.createElement("a");
  link.textContent = label;
  link.className = `keel-export-${label.toLowerCase()}`;
  link.title = `Download this chart's ${label === "CSV" ? "data" : "image"}`;
  link.href = "#";
  link.style.cssText = `font:400 11px sans-serif;color:${TEXT};opacity:.6;text-decoration:underline;cursor:pointer;`;
  link.addEventListener("click", (e) => {
    e.preventDefault();
    const out = contents(), save = document.createElement("a");
    save.href = out.startsWith("data:") ? out : URL.createObjectURL(new Blob([out], { type: "text/csv" }));
    save.download = `${panel.title.replace(/[^A-Za-z0-9._-]+/g, "_")}.${label.toLowerCase()}`;
    document.body.appendChild(save).click();
    save.remove();
  });
  return link;
}

// The chart's points as drawn (already downsampled on the server), one CSV row each.
function csv(panel) {
  const columns = panel.frames.lines, names = Object.keys(columns);
  const cell = (v) => (v === null ? "" : typeof v === "string" && /[",\n]/.test(v) ? `"${v.replace(/"/g, '""')}"` : String(v));
  const rows = (columns[names[0]] || []).map((_, i) => names.map((n) => cell(columns[n][i])).join(","));
  return [names.join(","), ...rows].join("\n") + "\n";
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

function axes(g, x, y, xTicks, yTicks, plot, xTitle, format = number) {
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
  for (const v of xTicks) xLabel(g, format(v), x(v), plot.bottom + 5);
  g.textAlign = "center";
  g.fillText(xTitle, (plot.left + plot.right) / 2, plot.bottom + 17);
  g.textBaseline = "alphabetic";
  g.globalAlpha = 0.45;
  g.strokeRect(plot.left + 0.5, plot.top + 0.5, plot.right - plot.left, plot.bottom - plot.top);
  g.globalAlpha = 1;
}

// Seconds as a person reads a duration: 45 s, 12m 05s, 3h 20m.
function duration(v) {
  const s = Math.round(v), h = Math.floor(s / 3600), m = Math.floor((s % 3600) / 60), rest = s % 60;
  if (h) return `${h}h ${String(m).padStart(2, "0")}m`;
  return m ? `${m}m ${String(rest).padStart(2, "0")}s` : `${rest}s`;
}

// Round steps of a duration axis: seconds, minutes, hours.
const DURATION_STEPS = [1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600, 7200, 10800, 21600, 43200, 86400];

function xTicksOf(panel, lo, hi, count) {
  if (panel.x_format !== "duration") return ticks(lo, hi, count, true);
  const raw = (hi - lo) / count || 1, step = DURATION_STEPS.find((s) => s >= raw) || Math.ceil(raw / 86400) * 86400;
  const out = [];
  for (let v = Math.ceil(lo / step) * step; v <= hi + 1e-9; v += step) out.push(v);
  return out;
}

// Log-scale ticks: 1, 2 and 5 times the powers of ten within [lo, hi] (values, not logs), thinned to `count`.
function logTicks(lo, hi, count) {
  const out = [];
  for (let p = Math.floor(Math.log10(lo)); p <= Math.ceil(Math.log10(hi)); p++)
    for (const m of [1, 2, 5]) if (m * 10 ** p >= lo && m * 10 ** p <= hi) out.push(m * 10 ** p);
  const powers = out.filter((v) => Number.isInteger(Math.log10(v)));
  return out.length <= count ? out : powers.length >= 2 ? powers : [lo, hi];
}

// A line per segment (panel.by: the effective trajectory and each abandoned attempt, or each run; never
// joined), the raw line faint behind its smoothed one when smoothed; under a rule per step with events
// (its hover lists them all) and a shaded band per lasting fault. Hover: the nearest point, and the events
// there. Lines and event kinds in `hidden` (clicked off in the legend) are not drawn.
function drawLines(g, panel, width, height, hidden) {
  const L = panel.frames.lines, rules = panel.frames.rules, bands = panel.frames.bands;
  const segment = L[panel.by], shown = (i) => !hidden.has(segment[i]) && (!panel.log_y || L.value[i] > 0);
  const plot = { left: PAD.left, right: width - PAD.right, top: PAD.top, bottom: height - PAD.bottom };
  const [lo, hi] = panel.domain;
  let min = Infinity, max = -Infinity;
  for (let i = 0; i < L.value.length; i++) if (shown(i) && L.value[i] !== null) [min, max] = [Math.min(min, L.value[i]), Math.max(max, L.value[i])];
  const yCount = Math.max(2, Math.floor((plot.bottom - plot.top) / 35));
  let y, yTicks;
  if (panel.log_y && min <= max) {
    const [a, b] = [Math.log10(min), Math.log10(max)], margin = (b - a) * 0.05 || 0.05;
    const toPx = scale(a - margin, b + margin, plot.bottom, plot.top);
    y = (v) => (v > 0 ? toPx(Math.log10(v)) : NaN);
    yTicks = logTicks(10 ** (a - margin), 10 ** (b + margin), yCount);
  } else {
    if (!(min <= max)) [min, max] = [0, 1];
    const margin = (max - min) * 0.05 || Math.abs(max) * 0.05 || 1;
    yTicks = ticks(min - margin, max + margin, yCount, false);
    y = scale(Math.min(min - margin, yTicks[0] ?? min), Math.max(max + margin, yTicks[yTicks.length - 1] ?? max), plot.bottom, plot.top);
  }
  const x = scale(lo, hi === lo ? lo + 1 : hi, plot.left, plot.right);
  const format = panel.x_format === "duration" ? duration : number;
  axes(g, x, y, xTicksOf(panel, lo, hi, Math.max(2, Math.floor((plot.right - plot.left) / 80))), yTicks, plot, panel.x_title, format);
  g.save();
  g.beginPath();
  g.rect(plot.left, plot.top, plot.right - plot.left, plot.bottom - plot.top);
  g.clip();
  const bandShown = (i) => !hidden.has(bands.kind[i]), ruleShown = (i) => rules.kinds[i].some((k) => !hidden.has(k));
  for (let i = 0; i < (bands.x0 || []).length; i++) {
    if (!bandShown(i)) continue;
    g.fillStyle = bands.colour[i];
    g.globalAlpha = 0.16;
    const left = x(bands.x0[i]) - 1, right = x(bands.x1[i]) + 1;
    g.fillRect(left, plot.top, Math.max(2, right - left), plot.bottom - plot.top);
  }
  g.globalAlpha = 0.75;
  for (let i = 0; i < (rules.x || []).length; i++) {
    if (!ruleShown(i)) continue;
    // A group of events reads a little heavier than one, in a stripe of each kind's colour, top to bottom in
    // the order they happened: every kind the legend lists is seen.
    const colours = rules.colours[i].filter((_, k) => !hidden.has(rules.kinds[i][k]));
    const px = Math.round(x(rules.x[i])) + 0.5, stripe = (plot.bottom - plot.top) / colours.length;
    g.lineWidth = colours.length > 1 ? 2 : 1;
    colours.forEach((colour, k) => {
      g.strokeStyle = colour;
      g.beginPath();
      g.moveTo(px, plot.top + k * stripe);
      g.lineTo(px, plot.top + (k + 1) * stripe);
      g.stroke();
    });
  }
  g.globalAlpha = 1;
  const bySegment = new Map();
  segment.forEach((s, i) => shown(i) && (bySegment.get(s) || bySegment.set(s, []).get(s)).push(i));
  const drawn = [];
  const stroke = (rows, column, style, alpha, widthPx) => {
    g.globalAlpha = alpha;
    g.lineWidth = widthPx;
    g.strokeStyle = style.colour;
    g.setLineDash(style.dash);
    g.beginPath();
    rows.forEach((r, k) => (k ? g.lineTo : g.moveTo).call(g, x(L.x[r]), y(L[column][r])));
    g.stroke();
  };
  for (const [name, rows] of bySegment) {
    const style = panel.segments[name];
    if (panel.smoothed) {
      stroke(rows, "value", style, 0.25, 1); // the raw line stays, faint: a spike smoothing flattens is still seen
      stroke(rows, "smooth", style, 1, 1.8);
      drawn.push(`${name}:raw-faint`, `${name}:smooth`);
    } else {
      stroke(rows, "value", style, 1, 1.5);
      drawn.push(`${name}:raw`);
    }
  }
  g.restore();
  Object.assign(g.canvas.dataset, { segments: String(bySegment.size), lines: drawn.join(","), rules: String((rules.x || []).filter((_, i) => ruleShown(i)).length),
    bands: String((bands.x0 || []).filter((_, i) => bandShown(i)).length), yScale: panel.log_y ? "log" : "linear", xAxis: panel.x_title });
  const hover = (mx, my) => {
    if (mx < plot.left || mx > plot.right || my < plot.top || my > plot.bottom) return "";
    let best = null;
    for (const rows of bySegment.values())
      for (const r of rows) {
        const d = Math.hypot(x(L.x[r]) - mx, y(L.value[r]) - my);
        if (!best || d < best.d) best = { r, d };
      }
    const out = [];
    if (best && best.d < 30) {
      const r = best.r, smooth = panel.smoothed ? ` (smoothed ${number(L.smooth[r])})` : "";
      const where = panel.x_format === "duration" ? `step ${number(L.step[r])} at ${duration(L.x[r])}` : panel.x_title === "step" ? `step ${number(L.step[r])}` : `step ${number(L.step[r])}, ${panel.x_title} ${number(L.x[r])}`;
      out.push(`${segment[r]}  ${where}  ${panel.title} ${number(L.value[r])}${smooth}`);
    }
    for (let i = 0; i < (rules.x || []).length; i++) if (ruleShown(i) && Math.abs(x(rules.x[i]) - mx) <= 4) out.push(rules.text[i]);
    for (let i = 0; i < (bands.x0 || []).length; i++) if (bandShown(i) && mx >= x(bands.x0[i]) - 2 && mx <= x(bands.x1[i]) + 2) out.push(bands.text[i]);
    return out.join("\n");
  };
  // The steps of the points drawn between two pixel columns, for a drag's zoom.
  const stepsBetween = (a, b) => {
    let first = Infinity, last = -Infinity;
    for (let r = 0; r < L.x.length; r++) {
      const px = x(L.x[r]);
      if (px >= a && px <= b) [first, last] = [Math.min(first, L.step[r]), Math.max(last, L.step[r])];
    }
    return b - a >= 4 && first < last ? [first, last] : null;
  };
  return { hover, plot, stepsBetween };
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
  const hover = (mx, my) => {
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
  return { hover };
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
  const hover = (mx, my) => {
    const i = Math.floor((my - plot.top) / row);
    return mx >= plot.left && i >= 0 && i < labels.length ? `${labels[i]}: ${number(values[i])}` : "";
  };
  return { hover };
}

// The legend: the lines, then the kinds of event; a click hides or shows what an entry names.
function legend(panel, hidden, redraw) {
  const box = document.createElement("div");
  box.className = "keel-legend";
  box.style.cssText = `display:flex;flex-wrap:wrap;gap:4px 14px;justify-content:center;font:12px sans-serif;color:${TEXT};margin-top:4px;`;
  for (const { label, colour, dashed } of panel.legend) {
    const item = box.appendChild(document.createElement("span"));
    item.dataset.label = label;
    item.title = "Click to hide or show";
    item.style.cssText = `cursor:pointer;user-select:none;${hidden.has(label) ? "opacity:.35;text-decoration:line-through;" : ""}`;
    const swatch = item.appendChild(document.createElement("span"));
    swatch.style.cssText = `display:inline-block;width:16px;height:0;border-top:2px ${dashed ? "dashed" : "solid"} ${colour};margin-right:5px;vertical-align:middle;`;
    item.appendChild(document.createTextNode(label));
    item.addEventListener("click", () => {
      hidden.has(label) ? hidden.delete(label) : hidden.add(label);
      HIDDEN.set(panel.title, hidden);
      redraw();
    });
  }
  return box;
}
