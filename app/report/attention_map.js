// The attention map that both pages draw, written once: the explorer (app/report/explorer.py inlines it into each file it
// writes) and make serve's page (served as /static/attention_map.js). Layer and head selectors with the mean of
// heads, the heatmap with its token labels and colour scale, outlined links (reference links, or those read from
// the map), hover highlighting and a readout. No network, no libraries.

// matplotlib's viridis, the colour map of the PNG plots: 256 colours, value v / 255 -> LUT[v]
const LUT = '__VIRIDIS__'.match(/.{6}/g).map(hex => [0, 2, 4].map(k => parseInt(hex.slice(k, k + 2), 16)));
const hot = w => `rgba(255, 140, 0, ${w.toFixed(3)})`;  // label highlight, opacity = attention weight
const element = (tag, text, className = '') =>
  Object.assign(document.createElement(tag), { textContent: text, className });

// links outlined over the map: [target row, source column] cells of each kind, its dash and how a cell is named
const LINK_KINDS = {
  sure: { dash: [], name: 'sure reference link' },
  possible: { dash: [3, 2], name: 'possible reference link' },
  read: { dash: [], name: 'a link read from this map' },
  align: { dash: [], name: 'a link of hyp.align' },
};

const MAP_STYLE = `
  .buttons { margin: 2px 0; }
  .buttons > span { display: inline-block; width: 48px; color: #777; }
  .buttons button { min-width: 28px; margin: 0 2px 2px 0; padding: 2px 6px; border: 1px solid #bbb; border-radius: 3px;
                    background: #f7f7f7; cursor: pointer; }
  .buttons button.active { background: #3b5bdb; border-color: #3b5bdb; color: #fff; }
  .buttons > span.note { width: auto; margin-left: 6px; font-size: 12px; }
  #map { display: grid; grid-template-columns: auto auto auto; gap: 2px; align-items: end; justify-content: start;
         margin-top: 8px; }
  #corner { color: #888; font-size: 11px; text-align: right; padding-right: 4px; }
  #xlabels { display: flex; }
  #ylabels { display: flex; flex-direction: column; align-self: start; }
  .tok { box-sizing: border-box; overflow: hidden; white-space: nowrap; text-overflow: ellipsis; border-radius: 2px; }
  .tok.x { writing-mode: vertical-rl; transform: rotate(180deg); max-height: 120px; text-align: left; }
  .tok.y { max-width: 180px; text-align: right; padding-right: 4px; }
  .tok.focus { outline: 1.5px solid #000; }
  #stack { position: relative; align-self: start; }
  #stack canvas { display: block; }
  #overlay { position: absolute; left: 0; top: 0; cursor: crosshair; }
  #scale { align-self: start; display: flex; gap: 4px; margin-left: 8px; font-size: 11px; color: #555; }
  #scale div { display: flex; flex-direction: column; justify-content: space-between; }
  #readout { min-height: 1.4em; margin-top: 6px; color: #333; }
  .legend { color: #777; font-size: 12px; }
  .sure { color: #ff2d55; }
`;

const MAP_MARKUP = `
  <div id="layers" class="buttons"></div>
  <div id="heads" class="buttons"></div>
  <div id="map">
    <div id="corner"></div><div id="xlabels"></div><div></div>
    <div id="ylabels"></div>
    <div id="stack"><canvas id="heat"></canvas><canvas id="overlay"></canvas></div>
    <div id="scale"><canvas id="bar"></canvas><div><span>1</span><span>0.5</span><span>0</span></div></div>
  </div>
  <div id="readout"></div>
  <div id="legend" class="legend"></div>
`;

// A sentence's maps (app.report.attention_files.store_attention's views): the heads of each layer of headLayers, then every
// layer's mean of heads; an RNN's (or CTranslate2's) one map. info: { rnn, heads, headLayers }.
const hasHeads = (info, l) => info.headLayers.includes(l);
function mapIndex(info, l, h) {
  if (info.rnn) return 0;
  return h === 'mean' ? info.headLayers.length * info.heads + l : info.headLayers.indexOf(l) * info.heads + h;
}

// the (rows, columns) weights of one view, 0..1, from the uint8 maps (value v: weight v / 255)
function viewOf(maps, info, rows, columns, l, h) {
  const n = rows * columns, base = mapIndex(info, l, h) * n;
  const out = new Float32Array(n);
  for (let j = 0; j < n; j++) out[j] = maps[base + j] / 255;
  return out;
}

// the layer and head shown when none (or one that is not there) is asked for: the last layer whose heads were kept
function chosenView(info, l, h) {
  if (!(Number.isInteger(l) && l >= 0 && l < info.layers)) l = info.headLayers.at(-1) ?? info.layers - 1;
  if (!(Number.isInteger(h) && h >= 0 && h < info.heads && hasHeads(info, l))) h = 'mean';
  return [l, h];
}

function drawButtons(box, name, values, active, onClick, hidden, label = v => v) {
  box.hidden = hidden;
  box.replaceChildren(element('span', name), ...values.map(v => {
    const button = element('button', label(v), v === active ? 'active' : '');
    button.dataset.value = v;
    button.onclick = () => onClick(v);
    return button;
  }));
}

function sizeCanvas(canvas, width, height) {  // a crisp canvas of width x height CSS px
  Object.assign(canvas, { width: Math.round(width * devicePixelRatio), height: Math.round(height * devicePixelRatio) });
  Object.assign(canvas.style, { width: `${width}px`, height: `${height}px` });
  const ctx = canvas.getContext('2d');
  ctx.setTransform(devicePixelRatio, 0, 0, devicePixelRatio, 0, 0);
  return ctx;
}

class AttentionMap {
  // root: the element the map fills; onSelect(l, h): a layer or head button was clicked (the page draws again)
  constructor(root, onSelect) {
    if (!document.getElementById('attention-map-style')) {
      document.head.append(Object.assign(element('style', MAP_STYLE), { id: 'attention-map-style' }));
    }
    root.innerHTML = MAP_MARKUP;
    this.root = root;
    this.onSelect = onSelect;
    this.$ = id => root.querySelector(`#${id}`);
    Object.assign(this, { src: [], rows: [], view: null, links: null, cell: 16, focus: null, hint: '' });
    const labelIndex = e => (e.target.dataset.index === undefined ? null : Number(e.target.dataset.index));
    this.$('xlabels').addEventListener('mouseover', e => labelIndex(e) != null && this.setFocus({ col: labelIndex(e) }));
    this.$('ylabels').addEventListener('mouseover', e => labelIndex(e) != null && this.setFocus({ row: labelIndex(e) }));
    this.$('overlay').addEventListener('mousemove', e => {
      const row = Math.min(this.rows.length - 1, Math.floor(e.offsetY / this.cell));
      const cell = Math.min(this.src.length - 1, Math.floor(e.offsetX / this.cell));
      if (this.focus?.row !== row || this.focus?.cell !== cell) this.setFocus({ row, cell });
    });
    for (const id of ['xlabels', 'ylabels', 'overlay']) this.$(id).addEventListener('mouseleave', () => this.setFocus(null));
  }

  // Draw one view. info: { src, rnn, layers, heads, headLayers } (the sentence; src: the column tokens); rows: the
  // row tokens; maps: the uint8 maps of those rows; l, h: the layer and head (or 'mean'); links: { kind: [[row,
  // column], ...] } or null; rowsName, columnsName: what the rows and columns are (corner label); hint: the readout
  // when nothing is hovered; legend: HTML below; rowNotes: per row a note the readout adds when it is hovered, or null
  draw({
    info, rows, maps, l, h, links = null, rowsName = 'target', columnsName = 'source', hint = '', legend = '',
    rowNotes = null,
  }) {
    const S = info.src.length, T = rows.length;
    Object.assign(this, { src: info.src, rows, links, focus: null, hint, l, h, rowNotes });
    this.view = viewOf(maps, info, T, S, l, h);
    const layers = [...Array(info.layers).keys()];
    const heads = ['mean', ...(hasHeads(info, l) ? Array(info.heads).keys() : [])];
    drawButtons(this.$('layers'), 'layer', layers, l, v => this.onSelect(v, h), info.rnn);
    drawButtons(this.$('heads'), 'head', heads, h, v => this.onSelect(l, v), info.rnn);
    if (!info.rnn && !hasHeads(info, l)) {  // make eval keeps the heads of viz.layer unless eval.attention=all
      this.$('heads').append(element('span', `heads kept for layer ${info.headLayers.join(', ')} ` +
        '(every layer\'s: make eval with eval.attention=all)', 'note'));
    }

    // cells as large as the width allows, 12-26 px, so the labels stay readable
    const cell = this.cell = Math.max(12, Math.min(26, Math.floor((this.root.clientWidth - 280) / S)));
    const font = `${Math.min(12, cell - 2)}px`;
    const label = (text, axis, index) => {
      const el = element('span', text, `tok ${axis}`);
      el.title = text;
      el.dataset.index = index;
      return el;
    };
    this.$('xlabels').replaceChildren(...info.src.map((tok, s) => {
      const el = label(tok, 'x', s);
      Object.assign(el.style, { width: `${cell}px`, lineHeight: `${cell}px`, fontSize: font });
      return el;
    }));
    this.$('ylabels').replaceChildren(...rows.map((tok, t) => {
      const el = label(tok, 'y', t);
      Object.assign(el.style, { height: `${cell}px`, lineHeight: `${cell}px`, fontSize: font });
      return el;
    }));
    this.$('corner').textContent = `${rowsName} ↓  ${columnsName} →`;

    // the heatmap: one pixel per cell, scaled up without smoothing
    const pixels = new ImageData(S, T);
    this.view.forEach((w, j) => pixels.data.set([...LUT[Math.round(w * 255)], 255], 4 * j));
    const small = document.createElement('canvas');
    Object.assign(small, { width: S, height: T }).getContext('2d').putImageData(pixels, 0, 0);
    const heat = sizeCanvas(this.$('heat'), S * cell, T * cell);
    heat.imageSmoothingEnabled = false;
    heat.drawImage(small, 0, 0, S * cell, T * cell);

    const barHeight = Math.max(120, Math.min(T * cell, 240));  // the colour scale, 0 at the bottom
    const bar = sizeCanvas(this.$('bar'), 14, barHeight);
    LUT.forEach((c, v) => {
      bar.fillStyle = `rgb(${c})`;
      bar.fillRect(0, barHeight * (1 - (v + 1) / 256), 14, barHeight / 256 + 0.5);
    });
    this.$('scale').lastElementChild.style.height = `${barHeight}px`;

    sizeCanvas(this.$('overlay'), S * cell, T * cell);
    this.drawOverlay();
    this.$('legend').innerHTML = legend;
    this.$('readout').textContent = this.describe(null);
  }

  // the links and the hovered row/column, over the heatmap
  drawOverlay() {
    const cell = this.cell, focus = this.focus, S = this.src.length, T = this.rows.length;
    const ctx = this.$('overlay').getContext('2d');
    ctx.clearRect(0, 0, S * cell, T * cell);
    ctx.lineWidth = 2;
    ctx.strokeStyle = '#ff2d55';
    for (const [kind, { dash }] of Object.entries(LINK_KINDS)) {
      ctx.setLineDash(dash);
      for (const [t, s] of this.links?.[kind] ?? []) ctx.strokeRect(s * cell + 1, t * cell + 1, cell - 2, cell - 2);
    }
    ctx.setLineDash([]);
    ctx.lineWidth = 1;
    ctx.strokeStyle = '#fff';
    if (focus?.row != null) ctx.strokeRect(0.5, focus.row * cell + 0.5, S * cell - 1, cell - 1);
    if (focus?.col != null) ctx.strokeRect(focus.col * cell + 0.5, 0.5, cell - 1, T * cell - 1);
  }

  // focus = {row: t} (a target token: its source labels lit by its weights), {row: t, cell: s}, {col: s}
  // (a source token: the target labels lit by the weights on it), or null
  setFocus(focus) {
    const S = this.src.length, view = this.view;
    this.focus = focus;
    const xs = this.$('xlabels').children, ys = this.$('ylabels').children;
    for (let s = 0; s < S; s++) {
      xs[s].style.background = focus?.row != null ? hot(view[focus.row * S + s]) : '';
      xs[s].classList.toggle('focus', focus?.col === s || focus?.cell === s);
    }
    for (let t = 0; t < this.rows.length; t++) {
      ys[t].style.background = focus?.col != null ? hot(view[t * S + focus.col]) : '';
      ys[t].classList.toggle('focus', focus?.row === t);
    }
    this.drawOverlay();
    this.$('readout').textContent = this.describe(focus);
  }

  describe(focus) {
    const S = this.src.length, view = this.view, rows = this.rows, src = this.src, q = tok => `‘${tok}’`;
    if (focus == null) return this.hint;
    const note = focus.row != null && this.rowNotes?.[focus.row] ? ` · ${this.rowNotes[focus.row]}` : '';
    if (focus.cell != null) {
      const link = Object.keys(LINK_KINDS).find(k => this.links?.[k]?.some(([t, s]) => t === focus.row && s === focus.cell));
      return `${q(rows[focus.row])} → ${q(src[focus.cell])}: ${view[focus.row * S + focus.cell].toFixed(3)}` +
        (link ? ` (${LINK_KINDS[link].name})` : '') + note;
    }
    if (focus.row != null) {
      const row = view.subarray(focus.row * S, (focus.row + 1) * S), best = row.indexOf(Math.max(...row));
      return `${q(rows[focus.row])} attends most to ${q(src[best])} (${row[best].toFixed(3)})${note}`;
    }
    const col = rows.map((_, t) => view[t * S + focus.col]), best = col.indexOf(Math.max(...col));
    return `${q(src[focus.col])} is attended most by ${q(rows[best])} (${col[best].toFixed(3)})`;
  }
}
