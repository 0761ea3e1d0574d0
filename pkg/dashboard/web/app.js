// gpudra dashboard: draws the server's View. The server aggregates; this
// page only filters and draws, and draws only the fleet rows in view, so
// that 1,000 nodes of 8 GPUs cost a few dozen cards in the DOM.
// No framework, no build step: the CSP allows this file and app.css only,
// so every style set here goes through element.style (CSSOM), never a
// style attribute.
'use strict';
(() => {
  const SVGNS = 'http://www.w3.org/2000/svg';
  // Fixed row heights (px, as in app.css) make the fleet's layout a prefix
  // sum: a scroll position maps to rows without measuring the DOM.
  const ROW_HEIGHT = { domain: 36, node: 182 };
  // Rows drawn above and below the viewport, so that a scroll shows drawn
  // rows before the next frame replaces them.
  const MARGIN = 400;
  const STATE_RANK = { allocated: 0, free: 1, blocked: 2 };
  const FILTERS = { q: 'search', node: 'filter-node', class: 'filter-class', ns: 'filter-namespace', state: 'filter-state' };
  const PALETTE = ['#60a5fa', '#34d399', '#f472b6', '#fbbf24', '#a78bfa', '#f87171', '#22d3ee', '#a3e635', '#fb923c', '#e879f9'];

  const $ = (id) => document.getElementById(id);
  const state = {
    view: null,
    tab: 'fleet',
    filters: { q: '', node: '', class: '', ns: '', state: '' },
    rows: [],
    tops: [],
    drawn: new Map(),
    fetching: false,
    again: false,
    announced: 0,
    frame: 0,
  };

  // el builds an element: attrs may hold class, text, data (dataset), on
  // (listeners); anything else is an attribute.
  function el(tag, attrs, ...children) {
    const e = document.createElement(tag);
    setAttrs(e, attrs);
    for (const c of children.flat()) if (c != null && c !== false) e.append(c);
    return e;
  }
  function svg(tag, attrs, ...children) {
    const e = document.createElementNS(SVGNS, tag);
    setAttrs(e, attrs);
    for (const c of children.flat()) if (c != null && c !== false) e.append(c);
    return e;
  }
  function setAttrs(e, attrs) {
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v == null || v === false) continue;
      if (k === 'class') e.setAttribute('class', v);
      else if (k === 'text') e.textContent = v;
      else if (k === 'data') for (const [dk, dv] of Object.entries(v)) e.dataset[dk] = dv == null ? '' : String(dv);
      else if (k === 'on') for (const [ev, fn] of Object.entries(v)) e.addEventListener(ev, fn);
      else e.setAttribute(k, v === true ? '' : String(v));
    }
  }

  // ---- formatting ----
  const GiB = 1024 ** 3;
  function gib(bytes) {
    if (bytes == null) return '?';
    const g = bytes / GiB;
    return g >= 10 ? g.toFixed(0) : g.toFixed(1);
  }
  function pct(v) { return v == null ? '—' : `${Math.round(v)}%`; }
  function duration(ms) {
    const s = Math.max(0, Math.round(ms / 1000));
    if (s < 60) return `${s}s`;
    const m = Math.floor(s / 60);
    if (m < 60) return `${m}m`;
    const h = Math.floor(m / 60);
    if (h < 48) return `${h}h ${m % 60}m`;
    return `${Math.floor(h / 24)}d ${h % 24}h`;
  }
  function ago(t) { return t ? `${duration(Date.now() - Date.parse(t))} ago` : '—'; }
  function until(t) {
    if (!t) return '—';
    const ms = Date.parse(t) - Date.now();
    return ms <= 0 ? 'now' : `in ${duration(ms)}`;
  }
  function clock(ms) {
    const d = new Date(ms);
    return `${String(d.getHours()).padStart(2, '0')}:${String(d.getMinutes()).padStart(2, '0')}`;
  }

  // kubectl shows a command as text; a click selects it and copies it.
  function kubectl(cmd) {
    if (!cmd) return null;
    return el('code', { class: 'kubectl', tabindex: 0, title: 'Click to copy', on: { click: copy, keydown: (e) => { if (e.key === 'Enter') copy(e); } } }, cmd);
  }
  function copy(e) {
    const t = e.currentTarget;
    window.getSelection().selectAllChildren(t);
    if (!navigator.clipboard) return;
    navigator.clipboard.writeText(t.textContent).then(() => {
      t.classList.add('copied');
      setTimeout(() => t.classList.remove('copied'), 900);
    }, () => { /* the selection is there to copy by hand */ });
  }

  // ---- filters and the URL hash ----
  function readHash() {
    const p = new URLSearchParams(location.hash.slice(1));
    state.tab = ['fleet', 'queues', 'workloads', 'allocation'].includes(p.get('tab')) ? p.get('tab') : 'fleet';
    for (const k of Object.keys(FILTERS)) state.filters[k] = p.get(k) || '';
    for (const [k, id] of Object.entries(FILTERS)) setInput($(id), state.filters[k]);
  }
  function writeHash() {
    const p = new URLSearchParams();
    if (state.tab !== 'fleet') p.set('tab', state.tab);
    for (const [k, v] of Object.entries(state.filters)) if (v) p.set(k, v);
    const h = p.toString();
    if (h !== location.hash.slice(1)) history.replaceState(null, '', h ? `#${h}` : location.pathname + location.search);
  }
  // setInput sets a control's value, adding the option a link names even
  // when this View does not offer it (yet), so the link keeps its filter.
  function setInput(input, value) {
    if (input.tagName === 'SELECT' && value && ![...input.options].some((o) => o.value === value)) {
      input.append(el('option', { value, text: value }));
    }
    input.value = value;
  }
  function fillSelect(input, values, value) {
    const first = input.options[0];
    input.replaceChildren(first, ...values.map((v) => el('option', { value: v, text: v })));
    setInput(input, value);
  }
  function fillFilters(v) {
    const f = v.filters || {};
    const nodes = f.nodes || [];
    const list = $('node-list');
    // A datalist of thousands of names costs more than it helps.
    if (list.dataset.count !== String(nodes.length)) {
      list.replaceChildren(...nodes.slice(0, 500).map((n) => el('option', { value: n })));
      list.dataset.count = String(nodes.length);
    }
    fillSelect($('filter-class'), f.classes || [], state.filters.class);
    fillSelect($('filter-namespace'), f.namespaces || [], state.filters.ns);
    const states = [...(f.states || [])];
    if (!states.includes('idle')) states.push('idle');
    fillSelect($('filter-state'), states, state.filters.state);
  }
  function onFilter() {
    for (const [k, id] of Object.entries(FILTERS)) state.filters[k] = $(id).value.trim();
    writeHash();
    redraw();
  }

  function holdersOf(g) {
    const hs = [...(g.holders || [])];
    for (const p of g.placements || []) hs.push(...(p.holders || []));
    return hs;
  }
  function filtering() { return Object.values(state.filters).some(Boolean); }
  function matchNode(n) {
    const want = state.filters.node.toLowerCase();
    return !want || n.name.toLowerCase() === want || n.name.toLowerCase().includes(want);
  }
  function matchGPU(g) {
    const f = state.filters;
    if (f.class && !(g.classes || []).includes(f.class)) return false;
    if (f.state && (f.state === 'idle' ? !g.idleClaimed : g.state !== f.state)) return false;
    const hs = holdersOf(g);
    if (f.ns && !hs.some((h) => h.namespace === f.ns || h.user === f.ns)) return false;
    if (f.q) {
      const q = f.q.toLowerCase();
      const hay = [g.uuid, ...hs.flatMap((h) => [h.namespace, h.claim, h.user, h.local, ...(h.pods || [])])];
      if (!hay.some((s) => s && s.toLowerCase().includes(q))) return false;
    }
    return true;
  }
  function matchItem(it) {
    const f = state.filters;
    if (f.ns && it.namespace !== f.ns && it.user !== f.ns) return false;
    if (!f.q) return true;
    const q = f.q.toLowerCase();
    return [it.namespace, it.name, it.user].some((s) => s && s.toLowerCase().includes(q));
  }

  // ---- fleet: rows and virtual scrolling ----
  function buildRows() {
    const rows = [];
    let gpus = 0;
    const active = filtering();
    for (const d of state.view.domains || []) {
      let header = null;
      for (const n of d.nodes || []) {
        if (!matchNode(n)) continue;
        const shown = active ? (n.gpus || []).filter(matchGPU) : (n.gpus || []);
        if (active && !shown.length) continue;
        if (!header) {
          header = { kind: 'domain', domain: d, nodes: 0, gpus: 0, allocated: 0 };
          rows.push(header);
        }
        header.nodes++;
        header.gpus += shown.length;
        header.allocated += shown.filter((g) => g.state === 'allocated' || g.state === 'partial').length;
        gpus += shown.length;
        rows.push({ kind: 'node', node: n, gpus: shown });
      }
    }
    let top = 0;
    state.tops = rows.map((r) => { const t = top; top += ROW_HEIGHT[r.kind]; return t; });
    state.rows = rows;
    $('fleet-rows').style.height = `${top}px`;
    $('fleet-empty').hidden = rows.length > 0;
    $('match-count').textContent = active ? `${gpus} GPU${gpus === 1 ? '' : 's'} match` : '';
  }

  // firstRow is the first row whose bottom is below y (binary search).
  function firstRow(y) {
    let lo = 0;
    let hi = state.rows.length;
    while (lo < hi) {
      const mid = (lo + hi) >> 1;
      if (state.tops[mid] + ROW_HEIGHT[state.rows[mid].kind] <= y) lo = mid + 1;
      else hi = mid;
    }
    return lo;
  }

  function drawFleet(rebuild) {
    const box = $('fleet');
    const content = $('fleet-rows');
    if (rebuild) {
      content.replaceChildren();
      state.drawn.clear();
    }
    // A hidden fleet (another tab) has no height: draw a window's worth.
    const height = box.clientHeight || window.innerHeight;
    const lo = box.scrollTop - MARGIN;
    const hi = box.scrollTop + height + MARGIN;
    const want = new Set();
    for (let i = firstRow(lo); i < state.rows.length && state.tops[i] < hi; i++) want.add(i);
    for (const [i, e] of state.drawn) {
      if (!want.has(i)) { e.remove(); state.drawn.delete(i); }
    }
    for (const i of want) {
      if (state.drawn.has(i)) continue;
      const row = state.rows[i];
      const e = row.kind === 'domain' ? domainRow(row) : nodeRow(row);
      e.style.top = `${state.tops[i]}px`;
      content.append(e);
      state.drawn.set(i, e);
    }
    if (window.gpudraFirstPaint === undefined && state.drawn.size > 0) window.gpudraFirstPaint = performance.now();
  }
  function scheduleFleet() {
    if (state.frame) return;
    state.frame = requestAnimationFrame(() => { state.frame = 0; drawFleet(false); });
  }

  function domainRow(r) {
    const name = r.domain.name || 'no NVLink domain';
    return el('div', { class: 'row domain' },
      el('span', { class: 'domain-name', text: r.domain.name ? `NVLink domain ${name}` : name }),
      el('span', { class: 'domain-meta', text: `${r.nodes} node${r.nodes === 1 ? '' : 's'} · ${r.gpus} GPUs · ${r.allocated} in use` }));
  }

  function nodeRow(r) {
    const n = r.node;
    const meta = [n.mode, n.usageSource ? `usage: ${n.usageSource}` : 'usage: not read'].filter(Boolean).join(' · ');
    return el('div', { class: 'row node', data: { node: n.name } },
      el('div', { class: 'node-info' },
        el('div', { class: 'node-name', title: n.name, text: n.name }),
        el('div', { class: 'node-meta', text: meta }),
        kubectl(n.kubectl)),
      el('div', { class: 'cards' }, r.gpus.length ? r.gpus.map((g) => card(n, g)) : el('span', { class: 'muted', text: 'no GPUs' })));
  }

  function card(n, g) {
    const classes = ['gpu', `st-${g.state}`];
    if (g.idleClaimed) classes.push('idle');
    if (g.health) classes.push('sick');
    const u = g.usage || {};
    const memTotal = u.memoryTotalBytes != null ? u.memoryTotalBytes : g.memoryBytes;
    return el('div', { class: classes.join(' '), title: [g.uuid, (g.classes || []).join(', ')].filter(Boolean).join('\n'), data: { testid: 'gpu', node: n.name, gpu: g.name, state: g.state } },
      el('div', { class: 'gpu-head' },
        el('span', { class: 'gpu-name', text: g.name }),
        el('span', { class: `badge st-${g.state}`, text: g.state })),
      el('div', { class: 'gpu-model', title: [g.model, g.memoryBytes ? `${gib(g.memoryBytes)} GiB` : ''].filter(Boolean).join(', ') },
        el('span', { class: 'model-name', text: [(g.model || '').replace(/^NVIDIA /, ''), g.mig ? 'MIG' : ''].filter(Boolean).join(' · ') }),
        g.idleClaimed && el('span', { class: 'badge idle-badge', title: 'Claimed, but no kernel ran in the window the server can tell', text: 'idle' })),
      g.health && el('div', { class: 'health', title: g.health, text: `⚠ ${g.health}` }),
      // A GPU in MIG mode held whole (every placement blocked) shows its
      // holder instead of the strip: who holds it is what matters.
      g.mig && !(g.holders || []).length ? migStrip(n, g) : el('div', { class: 'holders' }, (g.holders || []).map(holder)),
      el('div', { class: 'usage' },
        bar('util', u.utilization, 100, pct(u.utilization), `utilization ${pct(u.utilization)}`),
        bar('mem', u.memoryUsedBytes, memTotal, u.memoryUsedBytes == null ? '—' : `${gib(u.memoryUsedBytes)}G`,
          u.memoryUsedBytes == null ? 'memory not read' : `memory ${gib(u.memoryUsedBytes)} of ${gib(memTotal)} GiB`),
        spark(u.spark)));
  }

  function bar(kind, value, max, label, title) {
    const fill = el('span', { class: 'fill' });
    fill.style.width = value == null || !max ? '0' : `${Math.min(100, (100 * value) / max).toFixed(1)}%`;
    return el('div', { class: `meter ${kind}${value == null ? ' unread' : ''}`, title }, el('span', { class: 'track' }, fill), el('span', { class: 'meter-label', text: label }));
  }

  // spark draws the utilization of the last minutes; a point not read
  // breaks the line instead of reading as 0.
  function spark(points) {
    const w = 56;
    const h = 18;
    const s = svg('svg', { class: 'spark', viewBox: `0 0 ${w} ${h}`, width: w, height: h, 'aria-hidden': 'true' });
    if (!points || points.length < 2) return s;
    const dx = w / (points.length - 1);
    let run = [];
    const flush = () => {
      if (run.length > 1) s.append(svg('polyline', { points: run.join(' ') }));
      run = [];
    };
    points.forEach((p, i) => {
      if (p == null) { flush(); return; }
      run.push(`${(i * dx).toFixed(1)},${(h - 1 - (Math.min(100, p) / 100) * (h - 2)).toFixed(1)}`);
    });
    flush();
    return s;
  }

  function holderText(h) {
    if (h.local || h.user) return `${h.user || '?'}${h.local ? `: ${h.local}` : ''}`;
    return `${h.namespace || ''}/${h.claim || ''}`;
  }
  function holderTitle(h) {
    return [holderText(h),
      h.pods && h.pods.length ? `pods: ${h.pods.join(', ')}` : '',
      h.gang ? `gang: ${h.gang}` : '',
      h.reservation ? `reservation: ${h.reservation}` : '',
      h.pid ? `pid: ${h.pid}` : '',
      h.shared ? 'shared' : '',
      h.kubectl || ''].filter(Boolean).join('\n');
  }
  function holder(h) {
    return el('div', {
      class: `holder${h.shared ? ' shared' : ''}`,
      title: holderTitle(h),
      data: { testid: 'holder', namespace: h.namespace || '', claim: h.claim || '', pods: (h.pods || []).join(','), user: h.user || '', local: h.local || '' },
    },
    // The claim (or local allocation) first: it is what a card is too
    // narrow to show whole; the namespace and pods under it.
    el('span', { class: 'holder-name', text: h.local || h.user ? holderText(h) : h.claim || '' }),
    el('span', { class: 'holder-pods', text: [h.namespace, ...(h.pods || [])].filter(Boolean).join(' · ') }));
  }

  // migStrip draws the memory slices and each placement over [start,
  // start+size), in lanes so that overlapping placements stay visible;
  // allocated ones take the first, taller lane.
  function migStrip(n, g) {
    const slices = g.memorySlices || 8;
    const order = [...(g.placements || [])].sort((a, b) =>
      (STATE_RANK[a.state] ?? 3) - (STATE_RANK[b.state] ?? 3) || b.size - a.size || a.start - b.start);
    const lanes = [];
    const laneOf = (p) => {
      let i = lanes.findIndex((l) => l.every((q) => p.start + p.size <= q.start || q.start + q.size <= p.start));
      if (i < 0) { lanes.push([]); i = lanes.length - 1; }
      lanes[i].push(p);
      return i;
    };
    const strip = el('div', { class: 'mig', title: `${slices} memory slices` });
    for (let i = 0; i < slices; i++) {
      const cell = el('span', { class: 'slice' });
      cell.style.gridColumn = String(i + 1);
      cell.style.gridRow = '1 / -1';
      strip.append(cell);
    }
    for (const p of order) {
      const lane = laneOf(p);
      const title = [`${p.profile} ${p.name}`, `slices ${p.start}–${p.start + p.size - 1}`, p.state,
        ...(p.holders || []).map(holderText), p.usage && p.usage.utilization != null ? `util ${pct(p.usage.utilization)}` : ''].filter(Boolean).join('\n');
      const e = el('div', { class: `pl st-${p.state}`, title, data: { testid: 'placement', node: n.name, gpu: g.name, device: p.name, state: p.state } },
        el('span', { class: 'pl-label', text: p.profile }),
        (p.holders || []).map(holder));
      e.style.gridColumn = `${p.start + 1} / span ${p.size}`;
      e.style.gridRow = String(lane + 1);
      strip.append(e);
    }
    strip.style.gridTemplateColumns = `repeat(${slices}, 1fr)`;
    strip.style.gridTemplateRows = (lanes.length ? lanes : [[]]).map((l) => (l.some((p) => p.state === 'allocated') ? '2fr' : '1fr')).join(' ');
    return strip;
  }

  // ---- queues ----
  function drawQueues() {
    const box = $('queues');
    const queues = state.view.queues || [];
    if (!queues.length) {
      box.replaceChildren(el('p', { class: 'empty', text: 'No queues and nothing waiting.' }));
      return;
    }
    box.replaceChildren(...queues.map((q) => {
      const items = (q.items || []).filter(matchItem);
      return el('div', { class: 'queue', data: { queueName: q.name } },
        el('div', { class: 'queue-head' },
          el('h2', { text: q.name || 'not queued' }),
          el('span', { class: 'badge', text: q.policy || 'FCFS' }),
          !q.exists && q.name && el('span', { class: 'badge warn', title: 'Named by waiting items; no GpuQueue object', text: 'no GpuQueue' }),
          el('span', { class: 'muted', text: `${items.length} item${items.length === 1 ? '' : 's'}` }),
          kubectl(q.kubectl)),
        el('table', null,
          el('thead', null, el('tr', null, ['#', 'Kind', 'Name', 'Devices', 'Reason', 'Message', 'Since', 'Est. start', 'kubectl'].map((t) => el('th', { text: t })))),
          el('tbody', null, items.length ? items.map((it) => queueRow(q, it)) : el('tr', null, el('td', { colspan: 9, class: 'muted', text: 'empty' })))));
    }));
  }
  function queueRow(q, it) {
    const name = it.namespace ? `${it.namespace}/${it.name}` : it.name;
    return el('tr', {
      class: it.holding ? 'holding' : '',
      data: { testid: 'queue-item', queue: q.name, kind: it.kind, namespace: it.namespace || '', name: it.name, position: it.position || 0, reason: it.reason || '', holding: it.holding ? 'true' : 'false' },
    },
    el('td', { class: 'pos', text: it.holding ? 'holds' : (it.position ? String(it.position) : '—') }),
    el('td', null, el('span', { class: `badge kind-${it.kind.toLowerCase()}`, text: it.kind })),
    el('td', { class: 'name' }, name, it.user ? el('span', { class: 'muted', text: ` (${it.user})` }) : null),
    el('td', { class: 'num', text: it.devices ? String(it.devices) : '—' }),
    el('td', { class: 'reason', text: it.reason || '' }),
    el('td', { class: 'message', title: it.message || '', text: it.message || '' }),
    el('td', { title: it.since || '', text: ago(it.since) }),
    el('td', { title: it.estimatedStart || (it.duration ? '' : 'something ahead declares no duration'), text: until(it.estimatedStart) }),
    el('td', null, kubectl(it.kubectl)));
  }

  // ---- workloads: Ray clusters, RayJobs, Kueue's jobs ----
  function matchWorkload(w) {
    const f = state.filters;
    if (f.ns && w.namespace !== f.ns) return false;
    if (!f.q) return true;
    const q = f.q.toLowerCase();
    return [w.namespace, w.name, w.rayCluster, w.kueue && w.kueue.workload, ...(w.pods || []).map((p) => p.name)]
      .some((s) => s && s.toLowerCase().includes(q));
  }
  function drawWorkloads() {
    const box = $('workloads');
    const all = state.view.workloads || [];
    $('tab-workloads').hidden = !all.length;
    const shown = all.filter(matchWorkload);
    if (!shown.length) {
      box.replaceChildren(el('p', { class: 'empty', text: all.length ? 'No workload matches these filters.' : 'No Ray cluster, RayJob or Kueue workload.' }));
      return;
    }
    box.replaceChildren(...shown.map(workloadBox));
  }
  function workloadBox(w) {
    const k = w.kueue;
    const summary = [w.state, w.rayCluster && `cluster ${w.rayCluster}${w.clusterState ? ` ${w.clusterState}` : ''}`].filter(Boolean).join(' · ');
    return el('div', {
      class: 'workload',
      data: { testid: 'workload', kind: w.kind, namespace: w.namespace, name: w.name, state: w.state || '', rayCluster: w.rayCluster || '',
        kueueState: k ? k.state : '', clusterQueue: k ? (k.clusterQueue || '') : '', kueueReason: k ? (k.reason || '') : '' },
    },
    el('div', { class: 'queue-head' },
      el('span', { class: `badge kind-${w.kind.toLowerCase()}`, text: w.kind }),
      el('h2', { text: `${w.namespace}/${w.name}` }),
      summary && el('span', { class: 'muted', text: summary }),
      kubectl(w.kubectl)),
    k && el('div', { class: `kueue kueue-${k.state.replace(/ /g, '-')}`, data: { testid: 'kueue' } },
      el('span', { class: 'badge', text: `Kueue: ${k.state}` }),
      el('span', { class: 'muted', text: [k.localQueue && `LocalQueue ${k.localQueue}`, k.clusterQueue && `ClusterQueue ${k.clusterQueue}`].filter(Boolean).join(' → ') }),
      k.message && el('span', { class: 'reason', data: { testid: 'kueue-message' }, title: k.reason || '', text: k.message }),
      kubectl(k.kubectl)),
    el('table', null,
      el('thead', null, el('tr', null, ['Pod', 'Role', 'Group', 'Node', 'Phase', 'Claims and devices'].map((t) => el('th', { text: t })))),
      el('tbody', null, (w.pods || []).length ? w.pods.map((p) => el('tr', {
        data: { testid: 'workload-pod', pod: p.name, role: p.role || '', node: p.node || '', devices: (p.claims || []).flatMap((c) => c.devices || []).join(',') },
      },
      el('td', { class: 'name', text: p.name }),
      el('td', { text: p.role || '—' }),
      el('td', { text: p.group || '—' }),
      el('td', { class: 'name', text: p.node || 'not scheduled' }),
      el('td', { text: p.phase || '' }),
      el('td', { class: 'name', text: (p.claims || []).map((c) => `${c.name}: ${(c.devices || []).join(', ') || 'not allocated'}`).join('; ') || '—' })))
        : el('tr', null, el('td', { colspan: 6, class: 'muted', text: 'no pods' })))));
  }

  // ---- allocation over time ----
  function drawAllocation() {
    const box = $('allocation');
    const a = state.view.allocation || {};
    const series = (a.series || []).filter((s) => s.points && s.points.length);
    const src = a.source === 'prometheus' ? 'from Prometheus' : 'seen by this server since it started';
    const head = el('p', { class: 'muted', text: `Devices allocated (solid) and in use (dashed) per owner, ${src}${a.stepSeconds ? `, one point per ${duration(a.stepSeconds * 1000)}` : ''}.` });
    if (!series.length) {
      box.replaceChildren(head, el('p', { class: 'empty', text: 'No allocation yet.' }));
      return;
    }
    const W = 900;
    const H = 320;
    const pad = { l: 44, r: 16, t: 12, b: 28 };
    let t0 = Infinity;
    let t1 = -Infinity;
    let ymax = 1;
    for (const s of series) {
      for (const p of s.points) {
        const t = Date.parse(p.at);
        t0 = Math.min(t0, t); t1 = Math.max(t1, t);
        ymax = Math.max(ymax, p.allocated, p.used || 0);
      }
    }
    if (t1 === t0) t1 = t0 + 1;
    const x = (t) => pad.l + ((t - t0) / (t1 - t0)) * (W - pad.l - pad.r);
    const y = (v) => H - pad.b - (v / ymax) * (H - pad.t - pad.b);
    const chart = svg('svg', { class: 'chart', viewBox: `0 0 ${W} ${H}`, role: 'img', 'aria-label': 'Allocation over time' });
    for (let i = 0; i <= 4; i++) {
      const v = (ymax * i) / 4;
      chart.append(svg('line', { class: 'grid', x1: pad.l, x2: W - pad.r, y1: y(v), y2: y(v) }),
        svg('text', { class: 'axis', x: pad.l - 6, y: y(v) + 4, 'text-anchor': 'end' }, String(Math.round(v * 10) / 10)));
    }
    for (let i = 0; i <= 4; i++) {
      const t = t0 + ((t1 - t0) * i) / 4;
      chart.append(svg('text', { class: 'axis', x: x(t), y: H - 8, 'text-anchor': 'middle' }, clock(t)));
    }
    const legend = el('ul', { class: 'legend' });
    series.forEach((s, i) => {
      const colour = PALETTE[i % PALETTE.length];
      const line = (key) => s.points.filter((p) => p[key] != null).map((p) => `${x(Date.parse(p.at)).toFixed(1)},${y(p[key]).toFixed(1)}`).join(' ');
      const alloc = line('allocated');
      const base = y(0).toFixed(1);
      const first = x(Date.parse(s.points[0].at)).toFixed(1);
      const last = x(Date.parse(s.points[s.points.length - 1].at)).toFixed(1);
      chart.append(svg('polygon', { class: 'area', fill: colour, points: `${first},${base} ${alloc} ${last},${base}` }),
        svg('polyline', { class: 'allocated', stroke: colour, points: alloc }));
      const used = line('used');
      if (used) chart.append(svg('polyline', { class: 'used', stroke: colour, points: used }));
      // Dots where points are few: a server that just started has one,
      // which a line cannot show.
      if (s.points.length <= 120) {
        for (const p of s.points) chart.append(svg('circle', { class: 'dot', fill: colour, cx: x(Date.parse(p.at)).toFixed(1), cy: y(p.allocated).toFixed(1), r: 3 }));
      }
      const lastP = s.points[s.points.length - 1];
      const sw = el('span', { class: 'swatch' });
      sw.style.background = colour;
      legend.append(el('li', null, sw, el('span', { class: 'owner', text: s.owner || '(none)' }),
        el('span', { class: 'muted', text: `${lastP.allocated} allocated${lastP.used != null ? `, ${lastP.used} in use` : ''}` })));
    });
    box.replaceChildren(head, el('div', { class: 'chart-box' }, chart), legend);
  }

  // ---- header ----
  function drawHeader(v) {
    $('context').textContent = [v.mode, v.context].filter(Boolean).join(' · ');
    const s = v.summary || {};
    const chip = (label, n, cls) => el('li', { class: `chip ${cls || ''}` }, el('b', { text: String(n || 0) }), ` ${label}`);
    $('summary').replaceChildren(
      chip('nodes', s.nodes), chip('GPUs', s.gpus), chip('allocated', s.allocated, 'st-allocated'),
      chip('free', s.free, 'st-free'), ...(s.unknown ? [chip('unknown', s.unknown, 'st-unknown')] : []),
      chip('unhealthy', s.unhealthy, s.unhealthy ? 'st-unhealthy' : ''),
      chip('idle claimed', s.idleClaimed, s.idleClaimed ? 'idle' : ''), chip('waiting', s.waiting));
    const notes = $('notes');
    notes.hidden = !(v.notes && v.notes.length);
    notes.replaceChildren(...(v.notes || []).map((n) => el('div', { class: 'note', text: n })));
  }
  function drawLive() {
    const b = document.body;
    const v = state.view;
    const connected = b.dataset.connected === 'true';
    const age = v && v.at ? `, ${duration(Date.now() - Date.parse(v.at))} old` : '';
    $('live-text').textContent = `${connected ? 'live' : 'reconnecting…'}${v ? ` · rev ${v.revision}${age}` : ''}`;
    $('live').classList.toggle('off', !connected);
  }

  // ---- drawing a View ----
  function redraw() {
    if (!state.view) return;
    buildRows();
    drawFleet(true);
    drawQueues();
    drawWorkloads();
    drawAllocation();
  }
  function draw(v) {
    state.view = v;
    drawHeader(v);
    fillFilters(v);
    redraw();
    document.body.dataset.revision = String(v.revision);
    drawLive();
  }
  function showTab(tab) {
    state.tab = tab;
    for (const t of ['fleet', 'queues', 'workloads', 'allocation']) {
      $(t).hidden = t !== tab;
      $(`tab-${t}`).setAttribute('aria-selected', String(t === tab));
    }
    if (tab === 'fleet' && state.view) drawFleet(true);
  }

  // load fetches the View; revisions that arrive during a fetch make one
  // more fetch, not one each.
  async function load() {
    if (state.fetching) { state.again = true; return; }
    state.fetching = true;
    try {
      const r = await fetch('/api/view', { cache: 'no-store' });
      if (!r.ok) throw new Error(`GET /api/view: ${r.status}`);
      const v = await r.json();
      if (!state.view || v.revision !== state.view.revision) draw(v);
    } catch (err) {
      $('live-text').textContent = `cannot load the view: ${err.message}`;
    } finally {
      state.fetching = false;
      const behind = !state.view || state.view.revision < state.announced;
      if (state.again && behind) load();
      state.again = false;
    }
  }
  function setConnected(on) {
    document.body.dataset.connected = String(on);
    drawLive();
  }
  function connect() {
    const es = new EventSource('/api/events');
    es.onopen = () => setConnected(true);
    // EventSource reconnects by itself (the server asks for 2 s).
    es.onerror = () => setConnected(false);
    es.addEventListener('revision', (e) => {
      state.announced = Number(e.data);
      if (!state.view || state.announced !== state.view.revision) load();
    });
  }

  function init() {
    readHash();
    showTab(state.tab);
    for (const t of ['fleet', 'queues', 'workloads', 'allocation']) {
      $(`tab-${t}`).addEventListener('click', () => { showTab(t); writeHash(); });
    }
    for (const id of Object.values(FILTERS)) {
      $(id).addEventListener('input', onFilter);
      $(id).addEventListener('change', onFilter);
    }
    window.addEventListener('hashchange', () => { readHash(); showTab(state.tab); redraw(); });
    $('fleet').addEventListener('scroll', scheduleFleet, { passive: true });
    window.addEventListener('resize', scheduleFleet);
    setInterval(drawLive, 1000);
    load();
    connect();
  }
  init();
})();
