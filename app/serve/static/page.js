// make serve's page: the lines of the text box to POST /translate, the hypotheses with their scores, and the chosen
// hypothesis' cross-attention drawn by the explorer's code (AttentionMap, /static/attention_map.js); of a
// Transformer also the encoder's self-attention and the hypothesis' decoder self-attention (the "map" buttons).
// With lines in the second box, those translations are scored instead (log p) and their attention drawn; with
// "continue my translation" ticked, each is the beginning the hypotheses of its line continue (the API's prefix),
// asked again as it is typed. The third box's lines are the phrases each line's translations contain (the API's
// constraints: one line per sentence, phrases separated by |; an empty or missing line: none).
'use strict';
const $ = id => document.getElementById(id);
const page = { data: null, lines: [], line: 0, hyp: 0, l: null, h: null, map: 'cross' };
const MAP_LABELS = { cross: 'cross', encoder: 'encoder self', decoder: 'decoder self' };
// the map's markup, colour scale and all, is made here; #attention-map stays hidden (index.html) until a map is drawn
const heatmap = new AttentionMap($('attention-map'), (l, h) => { Object.assign(page, { l, h }); drawMap(); });
const LEGEND = 'outlined: <span class="sure">▭ word links read from this map</span> ' +
  '(each target word to the source word it attends to most, pieces summed into words)';

function status(text, failed = false) {
  $('status').textContent = text;
  $('status').classList.toggle('error', failed);
}

async function loadInfo() {
  const info = await (await fetch('/info')).json();
  const model = info.model ?? {};
  const shown = {
    run: info.run, engine: info.engine, step: info.step, model: model.arch, device: info.device,
    parameters: info.parameters ? `${(info.parameters / 1e6).toFixed(1)} M` : '–',
  };
  $('meta').replaceChildren(...Object.entries(shown).map(([key, value]) => {
    const span = element('span', `${key}: `);
    span.append(element('b', String(value ?? '–')));
    return span;
  }));
  $('beam').value = info.defaults.beam_size;
  $('beam').max = info.limits.max_beam;
  $('ngram').value = info.defaults.no_repeat_ngram_size;
}

let asked = 0;  // requests sent: only the newest one's answer is shown

async function translate() {
  const ask = ++asked;
  const lines = $('text').value.split('\n').map(s => s.trim()).filter(Boolean);
  if (!lines.length) return status('type a sentence to translate', true);
  const given = $('reference').value.split('\n').map(s => s.trim()).filter(Boolean);
  if (given.length && given.length !== lines.length) {
    return status(`${given.length} translation${given.length > 1 ? 's' : ''} for ${lines.length} line` +
      `${lines.length > 1 ? 's' : ''}: give one a line, or none`, true);
  }
  const scored = given.length > 0 && !$('complete').checked;
  const constraints = requiredPhrases(lines.length);
  if (typeof constraints === 'string') return status(constraints, true);
  if (scored && constraints) {
    return status('required words apply to a translation the model writes: empty their box to score yours', true);
  }
  const body = scored ? { text: lines, translation: given, attention: true, self_attention: true } : {
    text: lines, beam_size: Number($('beam').value), n_best: Number($('nbest').value), attention: true,
    self_attention: true, no_repeat_ngram_size: Number($('ngram').value), ...(given.length ? { prefix: given } : {}),
    ...(constraints ? { constraints } : {}),
  };
  status(scored ? 'scoring…' : 'translating…');
  const response = await fetch('/translate', {
    method: 'POST', headers: { 'Content-Type': 'application/json' }, body: JSON.stringify(body),
  });
  const data = await response.json();
  if (ask !== asked) return;  // a newer request went out meanwhile (typing a beginning)
  if (!response.ok) {
    window.serveError = data.error;
    return status(`error ${response.status}: ${data.error}`, true);
  }
  Object.assign(page, { data, lines, line: 0, hyp: 0, scored });
  status(`${lines.length} line${lines.length > 1 ? 's' : ''} in ${data.seconds.toFixed(2)} s`);
  renderResults();
  drawMap();
}

// the third box: per line of text, its phrases (null: the box is empty; a string: what is wrong); lines missing at
// its end are free
function requiredPhrases(count) {
  const rows = $('constraints').value.replace(/\s+$/, '').split('\n');
  if (rows.length === 1 && !rows[0].trim()) return null;
  if (rows.length > count) {
    return `${rows.length} lines of required words for ${count} line${count > 1 ? 's' : ''}: give at most one ` +
      'a line (an empty line: none)';
  }
  return Array.from({ length: count }, (_, i) => (rows[i] ?? '').split(/[|\t]/).map(s => s.trim()).filter(Boolean));
}

function renderResults() {
  $('results').replaceChildren(...page.data.translations.map((translation, i) => {
    const box = element('div', '', 'line');
    box.append(element('div', page.lines[i], 'source'));
    translation.hypotheses.forEach((hyp, k) => {
      const row = element('div', '', 'hyp');
      Object.assign(row.dataset, { line: i, hyp: k });
      const score = hyp.score == null ? 'greedy' : (page.scored ? 'log p ' : '') + hyp.score.toFixed(3);
      row.append(element('span', score, 'score'), element('span', hyp.text || '(empty)', 'text'));
      row.onclick = () => { Object.assign(page, { line: i, hyp: k }); drawMap(); };
      box.append(row);
    });
    return box;
  }));
}

function drawMap() {
  const translation = page.data.translations[page.line], hyp = translation.hypotheses[page.hyp];
  for (const row of document.querySelectorAll('.hyp')) {
    row.classList.toggle('selected', row.dataset.line === String(page.line) && row.dataset.hyp === String(page.hyp));
  }
  const score = hyp.score == null ? '' : ` · ${page.scored ? 'log p' : 'score'} ${hyp.score.toFixed(3)}`;
  const which = page.scored ? 'your translation' : `hypothesis ${page.hyp + 1}`;
  $('title').replaceChildren(`line ${page.line + 1}, ${which}`, element('small', hyp.text + score + leastExpected(hyp)));
  const attention = translation.attention, maps = attention?.hypotheses[page.hyp];
  const own = translation.self_attention;
  const kinds = ['cross', ...(own && maps ? ['encoder', 'decoder'] : [])];
  if (!kinds.includes(page.map)) page.map = 'cross';
  drawButtons($('maps'), 'map', kinds, page.map, k => { page.map = k; drawMap(); }, kinds.length < 2,
    k => MAP_LABELS[k]);
  $('attention-map').hidden = !maps;
  if (!maps) {
    $('title').append(element('small', attention ? '(the export returns the best hypothesis\' attention only)'
      : '(this model has no attention)'));
  } else if (page.map === 'cross') {
    const info = {
      src: attention.columns, rnn: attention.layers === 0, layers: Math.max(attention.layers, 1),
      heads: Math.max(attention.heads, 1), headLayers: attention.head_layers,
    };
    [page.l, page.h] = chosenView(info, page.l, page.h);
    heatmap.draw({
      info, rows: maps.rows, maps: Uint8Array.from(maps.maps.flat(2)), l: page.l, h: page.h,
      links: { read: maps.cells[mapIndex(info, page.l, page.h)] }, rowsName: 'hypothesis',
      hint: `${attention.views[mapIndex(info, page.l, page.h)]} · hover a token or a cell`, legend: LEGEND,
      rowNotes: maps.copied ? maps.copied.map(c => `copied ${c.toFixed(2)} of its probability`) : null,
    });
  } else {
    const set = own[page.map], encoder = page.map === 'encoder', hypothesis = set.hypotheses?.[page.hyp];
    const info = {
      src: encoder ? attention.columns : hypothesis.columns, rnn: false, layers: set.layers, heads: set.heads,
      headLayers: set.head_layers,
    };
    [page.l, page.h] = chosenView(info, page.l, page.h);
    const weights = Uint8Array.from((encoder ? set : hypothesis).maps.flat(2));
    heatmap.draw({
      info, rows: encoder ? attention.columns : maps.rows, maps: weights, l: page.l, h: page.h,
      rowsName: encoder ? 'source' : 'hypothesis (writing)',
      columnsName: encoder ? 'source' : 'hypothesis (read)',
      hint: `${set.views[mapIndex(info, page.l, page.h)]} · ` + (encoder
        ? 'encoder self-attention: each source piece over the source'
        : 'decoder self-attention: the position writing each piece over the pieces it has read (causal)'),
    });
  }
  $('view').dataset.shown = `${page.line},${page.hyp},${page.l},${page.h},${page.map}`;
  window.serveReady = performance.now();
}

// a scored translation: the piece the model expected least, and its log p
function leastExpected(hyp) {
  if (!hyp.piece_log_probs) return '';
  const pieces = [...hyp.target_pieces, '</s>'], logp = hyp.piece_log_probs;
  const k = logp.indexOf(Math.min(...logp));
  return ` · least expected: ${pieces[k]} (${logp[k].toFixed(2)})`;
}

$('go').addEventListener('click', () => translate());
$('text').addEventListener('keydown', e => {
  if (e.key === 'Enter' && (e.ctrlKey || e.metaKey)) {
    e.preventDefault();
    translate();
  }
});
// "continue my translation" ticked: the page asks again as the beginning is typed, once typing pauses
const TYPING_PAUSE_MS = 400;
let typing = null;
$('reference').addEventListener('input', () => {
  if (!$('complete').checked) return;
  clearTimeout(typing);
  typing = setTimeout(() => translate(), TYPING_PAUSE_MS);
});
window.addEventListener('unhandledrejection', e => {
  window.serveError = String(e.reason);
  status(`error: ${e.reason}`, true);
});
loadInfo().then(() => { window.pageLoaded = true; });
