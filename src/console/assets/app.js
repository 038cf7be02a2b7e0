// genfleet console: the fleet live, the signals, and the decisions to answer.
// Plain JavaScript, no dependencies. Everything shown is set as text (never as HTML): signals,
// prompts and outputs come from models and callers.
'use strict';

(() => {
  // The seq of a finished event sent by the worker that ended a request whose own worker was lost.
  const SEQ_AFTER_LOST = 9007199254740991;
  const SESSION_KEY = 'genfleet.console.session';
  const main = document.getElementById('main');

  // What the server told us; replaced whole by every snapshot.
  const store = {
    console: { read_only: true, max_signals: 1000 },
    inbox: new Map(),
    droppedPending: 0,
    signals: [],
    fleet: null,
    links: {},
  };
  // Typed but not yet sent, per decision, so a re-render keeps it.
  const drafts = new Map();
  // Answers given from this page: decision id -> {reply, follow}.
  const answeredHere = new Map();
  // Cards on the inbox view: decision id -> {key, el}.
  const cards = new Map();
  let session = loadSession();
  let leaveView = () => {};
  let viewName = '';
  // The view shown: its name, and for a request's page which request. A request's page is
  // made once per visit: it opens the request's stream and keeps it (a snapshot of the live
  // stream leaves it be).
  let viewKey = '';
  let lastHash = null;

  // ---------- small helpers ----------

  function h(tag, attrs, ...children) {
    const el = document.createElement(tag);
    for (const [name, value] of Object.entries(attrs || {})) {
      if (value === null || value === undefined || value === false) continue;
      if (name === 'class') el.className = value;
      else if (name === 'text') el.textContent = value;
      else if (name.startsWith('on')) el.addEventListener(name.slice(2), value);
      else if (name === 'dataset') Object.assign(el.dataset, value);
      else if (name === 'value') el.value = value;
      else el.setAttribute(name, value === true ? '' : String(value));
    }
    append(el, children);
    return el;
  }

  function append(el, children) {
    for (const child of children.flat(Infinity)) {
      if (child === null || child === undefined || child === false) continue;
      el.append(child instanceof Node ? child : document.createTextNode(String(child)));
    }
    return el;
  }

  function clear(el) {
    while (el.firstChild) el.removeChild(el.firstChild);
    return el;
  }

  // Every time the page shows goes through here: one format, in UTC and saying so
  // ("2026-11-24 14:03:07 UTC"), the same for everyone who looks at the fleet.
  function formatTime(ts) {
    const date = new Date(ts);
    if (isNaN(date)) return String(ts);
    return date.toISOString().slice(0, 19).replace('T', ' ') + ' UTC';
  }

  function time(ts) {
    if (!ts) return h('span', { text: '-' });
    return h('time', { datetime: ts, text: formatTime(ts) });
  }

  function requestLink(id, label) {
    if (!id) return h('span', { text: '-' });
    return h('a', { href: '#/request/' + encodeURIComponent(id), class: 'id', 'data-request-link': id, text: label || id });
  }

  function badge(text, kind) {
    return h('span', { class: 'badge ' + (kind || ''), text });
  }

  function json(value) {
    return JSON.stringify(value, null, 2);
  }

  function scalar(value) {
    return typeof value === 'string' ? value : JSON.stringify(value);
  }

  function announce(text) {
    const region = document.getElementById('announce');
    region.textContent = text;
  }

  function loadSession() {
    try {
      const saved = JSON.parse(sessionStorage.getItem(SESSION_KEY) || 'null');
      return saved && saved.token && saved.user ? saved : null;
    } catch (_) {
      return null;
    }
  }

  async function post(path, body) {
    const response = await fetch(path, {
      method: 'POST',
      headers: { 'Content-Type': 'application/json', 'X-Genfleet-Token': session ? session.token : '' },
      body: JSON.stringify(body),
      credentials: 'omit',
    });
    let data = null;
    try { data = await response.json(); } catch (_) { data = null; }
    return { ok: response.ok, status: response.status, data };
  }

  function errorText(data, status) {
    if (data && data.error) return data.error.code + ': ' + data.error.message;
    return 'HTTP ' + status;
  }

  // ---------- the session (who answers) ----------

  function renderSession() {
    const box = clear(document.getElementById('session'));
    if (store.console.read_only) {
      box.append(badge('Read-only: answering is off', 'warn'));
      return;
    }
    if (session) {
      box.append(
        h('span', { class: 'who', text: 'Answering as ' }, h('strong', { id: 'signed-in-as', text: 'human:' + session.user })),
        h('button', { type: 'button', class: 'link', onclick: () => { sessionStorage.removeItem(SESSION_KEY); session = null; renderSession(); refreshForms(); } }, 'Sign out'),
      );
      return;
    }
    const user = h('input', { id: 'sign-in-user', autocomplete: 'username', placeholder: 'Your name', required: true, spellcheck: 'false', size: 10 });
    const token = h('input', { id: 'sign-in-token', type: 'password', autocomplete: 'current-password', placeholder: 'Console token', required: true, size: 12 });
    const status = h('span', { class: 'form-status', role: 'status' });
    const form = h('form', { class: 'sign-in', 'aria-label': 'Sign in to answer' },
      h('label', { for: 'sign-in-user', class: 'visually-hidden', text: 'Your name' }), user,
      h('label', { for: 'sign-in-token', class: 'visually-hidden', text: 'Console token' }), token,
      h('button', { type: 'submit' }, 'Sign in'), status);
    form.addEventListener('submit', async (e) => {
      e.preventDefault();
      const wanted = { user: user.value.trim(), token: token.value.trim() };
      session = wanted;
      const reply = await post('/api/session', { user: wanted.user });
      if (reply.ok) {
        sessionStorage.setItem(SESSION_KEY, JSON.stringify(wanted));
        renderSession();
        refreshForms();
      } else {
        session = null;
        status.textContent = errorText(reply.data, reply.status);
      }
    });
    box.append(form);
  }

  // ---------- live updates ----------

  function connect() {
    const live = document.getElementById('live');
    const source = new EventSource('/api/stream');
    source.addEventListener('open', () => { live.textContent = 'live'; live.className = 'live on'; });
    source.addEventListener('error', () => { live.textContent = 'reconnecting…'; live.className = 'live off'; });
    source.addEventListener('snapshot', (e) => {
      const snap = JSON.parse(e.data);
      store.console = snap.console;
      store.inbox = new Map(snap.inbox.items.map((i) => [i.decision_id, i]));
      store.droppedPending = snap.inbox.dropped_pending;
      store.signals = snap.signals;
      store.fleet = snap.fleet;
      store.links = snap.links;
      renderSession();
      renderLinks();
      updateCount();
      render();
      // What may be answered or cancelled here follows the console's settings it just told.
      refreshForms();
    });
    source.addEventListener('inbox', (e) => {
      const item = JSON.parse(e.data);
      const before = store.inbox.get(item.decision_id);
      store.inbox.set(item.decision_id, item);
      if (!before && item.state === 'pending') announce('New decision: ' + item.question);
      updateCount();
      if (viewName === 'inbox') renderInbox();
    });
    source.addEventListener('inbox_removed', (e) => {
      const gone = JSON.parse(e.data);
      store.inbox.delete(gone.decision_id);
      store.droppedPending = gone.dropped_pending;
      updateCount();
      if (viewName === 'inbox') renderInbox();
    });
    source.addEventListener('signal', (e) => {
      const signal = JSON.parse(e.data);
      store.signals.push(signal);
      while (store.signals.length > store.console.max_signals) store.signals.shift();
      if (viewName === 'signals') addSignalRow(signal);
    });
    source.addEventListener('fleet', (e) => {
      store.fleet = JSON.parse(e.data);
      if (viewName === 'fleet') renderFleet();
    });
    source.addEventListener('requests', () => {
      if (viewName === 'requests') refreshRequestsSoon();
    });
    source.addEventListener('links', (e) => {
      store.links = JSON.parse(e.data);
      renderLinks();
    });
  }

  function updateCount() {
    let pending = 0;
    for (const item of store.inbox.values()) if (item.state === 'pending') pending += 1;
    document.getElementById('pending-count').textContent = String(pending);
    document.title = (pending ? '(' + pending + ') ' : '') + 'genfleet console';
  }

  function renderLinks() {
    const box = document.getElementById('links');
    const problems = [];
    if (store.links.nats_connected === false && store.fleet && store.fleet.polled_at) problems.push('NATS connection lost; reconnecting');
    for (const key of ['decisions', 'signals', 'events', 'results']) if (store.links[key]) problems.push(store.links[key]);
    box.hidden = problems.length === 0;
    clear(box);
    for (const p of problems) box.append(h('p', { text: p }));
  }

  // ---------- router ----------

  // An address typed by hand may hold a broken %-escape: kept as it is, the server says why
  // it is not an id.
  function decoded(text) {
    try { return decodeURIComponent(text); } catch (_) { return text; }
  }

  function route() {
    const hash = location.hash.replace(/^#\/?/, '');
    const [path, query] = hash.split('?');
    const parts = path.split('/');
    const params = new URLSearchParams(query || '');
    if (parts[0] === 'request' && parts[1]) return { name: 'request', id: decoded(parts[1]), params };
    if (['fleet', 'signals', 'requests', 'batches'].includes(parts[0])) return { name: parts[0], params };
    return { name: 'inbox', params };
  }

  // Draws the view the address names: called when the address changes and with every
  // snapshot of the live stream. A view that draws from the snapshot (inbox, fleet, signals)
  // is drawn again; a request's page is left as it is, with its own stream, unless the address
  // names another request.
  function render() {
    const r = route();
    const key = r.name === 'request' ? 'request/' + r.id : r.name;
    const changed = key !== viewKey;
    const newHash = location.hash !== lastHash;
    lastHash = location.hash;
    if (changed) {
      leaveView();
      leaveView = () => {};
      viewName = r.name;
      viewKey = key;
      cards.clear();
      clear(main);
      for (const a of document.querySelectorAll('nav a')) {
        if (a.dataset.view === r.name) a.setAttribute('aria-current', 'page');
        else a.removeAttribute('aria-current');
      }
    }
    if (r.name === 'inbox') {
      renderInbox();
      // A link to one decision: show its card.
      const wanted = r.params.get('decision');
      const card = wanted && cards.get(wanted);
      if (card && newHash) {
        card.el.setAttribute('tabindex', '-1');
        card.el.scrollIntoView({ block: 'start' });
        card.el.focus({ preventScroll: true });
      }
    }
    else if (r.name === 'fleet') renderFleet();
    else if (r.name === 'signals') renderSignals(r.params, changed);
    else if (r.name === 'requests') renderRequests(r.params, changed);
    else if (r.name === 'batches' && changed) renderBatches();
    else if (r.name === 'request' && changed) renderRequest(r.id);
  }

  window.addEventListener('hashchange', () => {
    render();
    if (!main.contains(document.activeElement)) main.focus({ preventScroll: true });
  });
  document.getElementById('open-request').addEventListener('submit', (e) => {
    e.preventDefault();
    const id = document.getElementById('open-request-id').value.trim();
    if (id) location.hash = '#/request/' + encodeURIComponent(id);
  });

  // ---------- inbox ----------

  function renderInbox() {
    let pendingList = document.getElementById('pending-list');
    let decidedList = document.getElementById('decided-list');
    if (!pendingList) {
      pendingList = h('div', { id: 'pending-list', class: 'cards' });
      decidedList = h('div', { id: 'decided-list', class: 'cards' });
      append(main, [
        h('h1', { text: 'Inbox' }),
        h('p', { class: 'hint', id: 'inbox-hint' }),
        h('section', { 'aria-labelledby': 'pending-h' }, h('h2', { id: 'pending-h', text: 'Waiting for an answer' }), pendingList),
        h('section', { 'aria-labelledby': 'decided-h' }, h('h2', { id: 'decided-h', text: 'Decided' }), decidedList),
      ]);
    }
    const items = [...store.inbox.values()].sort((a, b) => (b.raised_at + b.decision_id).localeCompare(a.raised_at + a.decision_id));
    const pending = items.filter((i) => i.state === 'pending');
    const decided = items.filter((i) => i.state !== 'pending');
    const hint = document.getElementById('inbox-hint');
    hint.textContent = store.droppedPending
      ? store.droppedPending + ' older pending decisions are not shown (console.max_inbox).'
      : 'Decision requests, escalations and checkpoints, newest first. An answer takes one click on an option.';
    place(pendingList, pending, 'Nothing waits for an answer.');
    place(decidedList, decided, 'No decision answered yet.');
  }

  // Puts the cards of `items` into `list` in order, reusing unchanged cards so that focus
  // and typed text stay where they are.
  function place(list, items, emptyText) {
    const wanted = [];
    for (const item of items) {
      const key = JSON.stringify(item) + (answeredHere.has(item.decision_id) ? '+' : '');
      let card = cards.get(item.decision_id);
      if (!card || card.key !== key) {
        const el = item.state === 'pending' ? pendingCard(item) : decidedCard(item);
        if (card && card.el.parentNode) card.el.replaceWith(el);
        card = { key, el };
        cards.set(item.decision_id, card);
      }
      wanted.push(card.el);
    }
    if (wanted.length === 0) {
      if (!list.querySelector('.empty')) clear(list).append(h('p', { class: 'empty', text: emptyText }));
      return;
    }
    const empty = list.querySelector('.empty');
    if (empty) empty.remove();
    wanted.forEach((el, i) => {
      if (list.children[i] !== el) list.insertBefore(el, list.children[i] || null);
    });
    while (list.children.length > wanted.length) list.lastChild.remove();
  }

  function cardHeader(item) {
    const kindNames = { model: 'model decision', escalation: 'escalation', checkpoint: 'checkpoint' };
    return h('header', { class: 'card-head' },
      h('div', { class: 'badges' },
        badge(kindNames[item.kind] || item.kind, 'kind-' + item.kind),
        badge(item.type + '.' + item.code, 'code'),
        badge(item.severity, 'sev-' + item.severity)),
      h('p', { class: 'where' },
        item.job_name ? ['job ', h('strong', { text: item.job_name }), ' · '] : null,
        'pool ', item.pool, ' · request ', requestLink(item.request_id),
        item.root_request_id !== item.request_id ? [' · root ', requestLink(item.root_request_id)] : null,
        ' · chain position ', String(item.chain_position),
        ' · raised ', time(item.raised_at),
        item.expires_at && item.state === 'pending' ? [' · expires ', time(item.expires_at)] : null));
  }

  function field(label, content) {
    return [h('dt', { text: label }), h('dd', {}, content)];
  }

  // Where a request ran and where it stands in its chain: a result and a finished summary
  // name these the same way.
  function placeFacts(r) {
    return [
      field('Worker', r.worker_id || '-'),
      r.job_name ? field('Job', r.job_name) : null,
      field('Chain position', String(r.chain_position)),
      r.parent_request_id ? field('Continues', requestLink(r.parent_request_id)) : null,
      r.root_request_id && r.root_request_id !== r.request_id ? field('Chain root', requestLink(r.root_request_id)) : null,
    ];
  }

  function checksList(checks) {
    return h('ul', { class: 'checks' }, checks.map((c) => {
      if (typeof c !== 'object' || c === null) return h('li', { text: scalar(c) });
      return h('li', { class: c.passed ? 'pass' : 'fail' },
        h('span', { class: 'mark', 'aria-label': c.passed ? 'passed' : 'failed', text: c.passed ? '✓' : '✗' }), ' ',
        c.name || c.kind || 'check',
        c.weight !== undefined ? h('span', { class: 'muted', text: ' (weight ' + c.weight + ')' }) : null,
        c.detail ? h('span', { class: 'detail', text: ': ' + c.detail }) : null);
    }));
  }

  function metaSection(item) {
    const meta = item.meta || {};
    const shown = new Set(['suggestions']);
    const dl = h('dl', { class: 'facts' });
    const num = (v) => (typeof v === 'number' ? v.toFixed(2).replace(/\.?0+$/, '') : scalar(v));
    if (meta.confidence !== undefined) {
      shown.add('confidence'); shown.add('threshold');
      const conf = h('span', { class: 'confidence' },
        h('meter', { min: 0, max: 1, value: meta.confidence, low: meta.threshold, optimum: 1, 'aria-label': 'confidence' }),
        ' ', h('strong', { 'data-field': 'confidence', text: num(meta.confidence) }),
        meta.threshold !== undefined ? ' (threshold ' + num(meta.threshold) + ')' : '');
      append(dl, field('Confidence', conf));
    }
    if (meta.pass_rate !== undefined) { shown.add('pass_rate'); append(dl, field('Checks passed', num(meta.pass_rate) + ' %')); }
    if (Array.isArray(meta.checks)) { shown.add('checks'); append(dl, field('Checks', checksList(meta.checks))); }
    for (const key of ['checkpoint', 'matched', 'message', 'chain_position', 'attempt', 'tries', 'min_attempt']) {
      if (meta[key] === undefined) continue;
      shown.add(key);
      append(dl, field(key.replace(/_/g, ' '), Array.isArray(meta[key]) ? meta[key].map(scalar).join(', ') : scalar(meta[key])));
    }
    if (Array.isArray(meta.error_history) && meta.error_history.length) {
      shown.add('error_history');
      append(dl, field('Error history', h('ol', {}, meta.error_history.map((e) => h('li', {
        text: typeof e === 'object' && e !== null
          ? ['position ' + e.chain_position, e.try_in_request ? 'try ' + e.try_in_request : null, e.confidence !== undefined ? 'confidence ' + num(e.confidence) : null, e.failed_checks ? 'failed: ' + [].concat(e.failed_checks).join(', ') : null, e.decided ? 'decided ' + e.decided : null].filter(Boolean).join(' · ')
          : scalar(e),
      })))));
    }
    for (const key of ['prompt', 'output_summary']) {
      if (meta[key] === undefined) continue;
      shown.add(key);
      append(dl, field(key === 'prompt' ? 'Prompt' : 'Output', h('pre', { class: 'text', text: scalar(meta[key]) })));
    }
    for (const key of Object.keys(meta).sort()) {
      if (shown.has(key)) continue;
      const value = meta[key];
      append(dl, field(key.replace(/_/g, ' '), typeof value === 'object' && value !== null ? h('pre', { class: 'json', text: json(value) }) : scalar(value)));
    }
    return dl.children.length ? dl : null;
  }

  function suggestionsSection(item) {
    const list = (item.meta || {}).suggestions;
    if (!Array.isArray(list)) return null;
    if (list.length === 0) return h('p', { class: 'muted', text: 'No similar decision in the history.' });
    return h('section', { class: 'suggestions', 'aria-label': 'Historical suggestions' },
      h('h4', { text: 'Earlier decisions like this one' }),
      h('ol', {}, list.map((s) => {
        if (typeof s !== 'object' || s === null) return h('li', { text: scalar(s) });
        const head = [s.option_id ? 'chose ' + s.option_id : null, s.outcome ? 'outcome ' + s.outcome : null,
          s.confidence !== undefined ? 'confidence ' + scalar(s.confidence) : null,
          s.pass_rate !== undefined ? 'pass rate ' + scalar(s.pass_rate) : null,
          s.prompt_similarity !== undefined ? 'similarity ' + scalar(s.prompt_similarity) : null,
          s.decided_by ? 'by ' + s.decided_by : null].filter(Boolean).join(' · ');
        return h('li', { class: 'suggestion outcome-' + (s.outcome || '') },
          h('p', { text: head }),
          s.rationale ? h('p', { class: 'muted', text: 'Rationale: ' + s.rationale }) : null,
          s.guidance ? h('p', { class: 'muted', text: 'Guidance: ' + s.guidance }) : null,
          s.modified_prompt ? h('p', { class: 'muted', text: 'Modified prompt: ' + s.modified_prompt }) : null,
          s.prompt ? h('p', { class: 'muted', text: 'Prompt: ' + s.prompt }) : null);
      })));
  }

  function contextBlocks(item) {
    return [
      item.summary && item.summary !== item.question ? h('p', { class: 'summary', text: item.summary }) : null,
      item.context ? h('div', { class: 'context' }, h('h4', { text: 'Context' }), h('p', { class: 'text', text: item.context })) : null,
      metaSection(item),
      suggestionsSection(item),
      item.prompt ? h('details', { class: 'task' }, h('summary', { text: 'The task' }), h('pre', { class: 'text', text: item.prompt })) : null,
      item.metadata && Object.keys(item.metadata).length ? h('details', {}, h('summary', { text: 'Request metadata' }), h('pre', { class: 'json', text: json(item.metadata) })) : null,
    ];
  }

  const ENDS_CHAIN = new Set(['skip', 'abort']);

  function pendingCard(item) {
    const id = item.decision_id;
    const draft = drafts.get(id) || {};
    drafts.set(id, draft);
    const qid = 'q-' + id;
    const extras = item.kind !== 'model';
    const input = (name, el) => { el.value = draft[name] || ''; el.addEventListener('input', () => { draft[name] = el.value; }); return el; };
    const rationale = input('rationale', h('textarea', { id: 'rationale-' + id, rows: 2, 'data-field': 'rationale' }));
    const guidance = extras ? input('guidance', h('textarea', { id: 'guidance-' + id, rows: 2, 'data-field': 'guidance' })) : null;
    const modified = extras ? input('modified_prompt', h('textarea', { id: 'modified-' + id, rows: 3, 'data-field': 'modified_prompt' })) : null;
    const boost = extras ? input('boost', h('input', { id: 'boost-' + id, type: 'number', min: 0, max: 1, step: 0.05, inputmode: 'decimal', 'data-field': 'confidence_boost' })) : null;
    const status = h('p', { class: 'form-status', role: 'status' });
    const optionsBox = h('div', { class: 'options', role: 'group', 'aria-labelledby': qid });
    for (const option of item.options) {
      const isDefault = option.id === item.default_option;
      optionsBox.append(h('button', {
        type: 'button', class: 'option' + (isDefault ? ' default' : ''), 'data-option-id': option.id,
        onclick: () => answer(item, option, { rationale, guidance, modified, boost, status, optionsBox }),
      },
      h('span', { class: 'label', text: option.label }),
      h('span', { class: 'option-id', text: option.id }),
      isDefault ? h('span', { class: 'badge default-badge', text: 'default' }) : null,
      option.pros ? h('span', { class: 'pros', text: '+ ' + option.pros }) : null,
      option.cons ? h('span', { class: 'cons', text: '− ' + option.cons }) : null));
    }
    const form = h('div', { class: 'answer' },
      h('label', { for: rationale.id, text: 'Rationale (optional, passed to the model)' }), rationale,
      extras ? [
        h('label', { for: guidance.id, text: 'Guidance for the next attempt (optional)' }), guidance,
        h('label', { for: modified.id, text: 'Modified prompt (with “' + (item.options.find((o) => o.id === 'modify_prompt') || { label: 'modify_prompt' }).label + '” only: replaces the task)' }), modified,
        h('label', { for: boost.id, text: 'Confidence boost, 0 to 1 (optional: lowers the next threshold)' }), boost,
      ] : null,
      h('p', { class: 'choose', text: item.default_option ? 'Choose an option (default: ' + item.default_option + '):' : 'Choose an option:' }),
      optionsBox,
      h('p', { class: 'signin-note muted' }),
      status);
    const card = h('article', { class: 'card pending', 'data-decision-id': id, 'data-state': item.state, 'aria-labelledby': qid },
      cardHeader(item),
      h('h3', { id: qid, class: 'question', text: item.question }),
      contextBlocks(item),
      form);
    refreshForm(card);
    return card;
  }

  // Enables the option buttons when answering is possible, and says why not otherwise.
  function refreshForm(card) {
    const note = card.querySelector('.signin-note');
    if (!note) return;
    const can = !store.console.read_only && !!session;
    for (const b of card.querySelectorAll('button.option')) b.disabled = !can;
    note.textContent = store.console.read_only
      ? 'This console is read-only: it was started without a token.'
      : session ? '' : 'Sign in (name and console token, at the top) to answer.';
  }

  function refreshForms() {
    for (const card of document.querySelectorAll('article.card.pending')) refreshForm(card);
    for (const panel of document.querySelectorAll('section.follow')) if (panel.refreshControls) panel.refreshControls();
  }

  async function answer(item, option, form) {
    const body = { user: session ? session.user : '', option_id: option.id };
    const rationale = form.rationale.value.trim();
    if (rationale) body.rationale = rationale;
    if (item.kind !== 'model' && !ENDS_CHAIN.has(option.id)) {
      const guidance = form.guidance.value.trim();
      if (guidance) body.guidance = guidance;
      const boost = form.boost.value.trim();
      if (boost) {
        const value = Number(boost);
        if (!(value >= 0 && value <= 1)) { form.status.textContent = 'The confidence boost is a number from 0 to 1.'; form.boost.focus(); return; }
        body.confidence_boost = value;
      }
    }
    if (option.id === 'modify_prompt' && item.kind !== 'model') {
      const prompt = form.modified.value.trim();
      if (!prompt) { form.status.textContent = 'Write the modified prompt first: it replaces the task.'; form.modified.focus(); return; }
      body.modified_prompt = prompt;
    }
    const buttons = [...form.optionsBox.querySelectorAll('button')];
    buttons.forEach((b) => { b.disabled = true; });
    form.status.textContent = 'Answering ' + option.label + '…';
    const reply = await post('/api/decisions/' + encodeURIComponent(item.decision_id), body);
    if (reply.ok) {
      drafts.delete(item.decision_id);
      answeredHere.set(item.decision_id, { reply: reply.data, option, follow: null });
      announce('Answered: ' + option.label);
      // The record's update moves the card to Decided; until it comes, say what happened here.
      const known = store.inbox.get(item.decision_id);
      if (known && known.state === 'pending') {
        form.status.textContent = '';
        form.status.append(outcomeLine(reply.data, option));
        const follow = followOf(item.decision_id);
        if (follow) form.status.append(follow);
      }
      if (viewName === 'inbox') renderInbox();
      return;
    }
    buttons.forEach((b) => { b.disabled = false; });
    const error = reply.data && reply.data.error;
    if (error && error.code === 'ALREADY_DECIDED') {
      const d = error.detail || {};
      form.status.textContent = 'Already decided by ' + (d.decided_by || 'someone') + ': ' + (d.option_id || '?') + '.';
    } else {
      form.status.textContent = 'Not answered: ' + errorText(reply.data, reply.status);
      // A token the console no longer takes (it restarted with another): sign in again.
      if (error && error.code === 'UNAUTHORIZED' && /token/.test(error.message) && !store.console.read_only) {
        sessionStorage.removeItem(SESSION_KEY);
        session = null;
        renderSession();
        refreshForms();
      }
    }
  }

  function outcomeLine(reply, option) {
    return h('p', { class: 'outcome', 'data-outcome': reply.outcome },
      'You chose ', h('strong', { text: option.label }), ' (' + option.id + ')',
      reply.answered_first_by ? ' — ' + reply.answered_first_by + ' had chosen the same option first' : '',
      reply.continuation_request_id ? [': continued as ', requestLink(reply.continuation_request_id)] : ': ' + reply.outcome + '.');
  }

  // The live panel of the continuation an answer from this page started.
  function followOf(decisionId) {
    const mine = answeredHere.get(decisionId);
    if (!mine || !mine.reply.continuation_request_id) return null;
    if (!mine.follow) mine.follow = followPanel(mine.reply.continuation_request_id, true);
    return mine.follow.el;
  }

  function decidedCard(item) {
    const a = item.answer;
    const option = a ? item.options.find((o) => o.id === a.option_id) : null;
    const lines = [];
    if (a) {
      lines.push(h('p', { class: 'outcome', 'data-outcome': a.outcome },
        'Decided by ', h('strong', { class: 'decided-by', text: a.decided_by || 'someone' }), ': ',
        h('strong', { text: option ? option.label : a.option_id }), ' (' + a.option_id + ') at ', time(a.decided_at),
        a.continuation_request_id ? [' · continued as ', requestLink(a.continuation_request_id)] : ' · ' + a.outcome));
      for (const [key, label] of [['rationale', 'Rationale'], ['guidance', 'Guidance'], ['modified_prompt', 'Modified prompt'], ['confidence_boost', 'Confidence boost']]) {
        if (a[key] !== undefined && a[key] !== null) lines.push(h('p', { class: 'muted', text: label + ': ' + scalar(a[key]) }));
      }
    } else {
      lines.push(h('p', { class: 'outcome', 'data-outcome': 'expired' }, 'Expired unanswered at ', time(item.expired_at),
        item.meta && item.meta.expired_because ? ': ' + item.meta.expired_because : ''));
    }
    const follow = followOf(item.decision_id);
    let more = null;
    if (!follow && a && a.continuation_request_id) {
      more = h('button', { type: 'button', class: 'link', onclick: (e) => {
        const panel = followPanel(a.continuation_request_id, true);
        e.target.replaceWith(panel.el);
      } }, 'Follow the continuation here');
    }
    return h('article', { class: 'card decided', 'data-decision-id': item.decision_id, 'data-state': item.state },
      cardHeader(item),
      h('h3', { class: 'question', text: item.question }),
      lines, follow, more,
      h('details', {}, h('summary', { text: 'Options and context' }),
        h('ul', {}, item.options.map((o) => h('li', { text: o.id + ': ' + o.label + (o.pros ? ' (+ ' + o.pros + ')' : '') + (o.cons ? ' (− ' + o.cons + ')' : '') }))),
        contextBlocks(item)));
  }

  function plural(n, what) {
    return n + ' ' + what + (n === 1 ? '' : 's');
  }

  // A count of what the console saw of a request it did not see whole: "no tool call", never
  // a total of 0.
  function seenCount(n, what) {
    return n ? plural(n, what) : 'no ' + what;
  }

  // How each kind of moment reads in a timeline.
  const TIMELINE_LABELS = {
    queued: 'queued', started: 'started', turn: 'model', tool_call: 'tool call', tool_result: 'tool result',
    signal: 'signal', decision: 'decision', answered: 'answered', cancel: 'cancel', finished: 'finished',
    continued: 'continued', chain_ended: 'chain ended', released: 'released',
  };

  // ---------- following one request ----------

  // A live view of one request: its state, streamed output, tool calls and results, signals
  // and final result. `compact` shows less and stops once the request finished.
  function followPanel(id, compact) {
    const stateBadge = badge('…', 'state');
    const facts = h('dl', { class: 'facts' });
    const output = h('pre', { class: 'output', 'data-field': 'output', 'aria-live': 'off' });
    const reasoning = h('pre', { class: 'text' });
    const reasoningBox = h('details', { hidden: true }, h('summary', { text: 'Reasoning' }), reasoning);
    const activity = h('ol', { class: 'activity' });
    const final = h('div', { class: 'final' });
    // Where the request stands, in words (not known to the fleet, queued, running, not a
    // valid id ...): replaced as soon as the request shows otherwise. Its kind is in
    // data-notice.
    const notice = h('p', { class: 'notice', 'data-field': 'notice' });
    // The decision it raised and the continuation an answer started.
    const chain = h('p', { class: 'muted', 'data-field': 'chain', hidden: true });
    // The full view also has the request's timeline (as the console's requests list knows
    // it) and a way to cancel it.
    const controls = compact ? null : h('div', { class: 'controls', 'data-field': 'controls', hidden: true });
    const timelineNote = compact ? null : h('p', { class: 'muted', 'data-field': 'timeline-note' });
    const timelineList = compact ? null : h('ol', { class: 'timeline', 'data-field': 'timeline' });
    const el = h('section', { class: compact ? 'follow compact' : 'follow', 'data-request-id': id, 'aria-label': 'Request ' + id },
      h('p', { class: 'follow-head' }, compact ? ['Continuation ', requestLink(id), ' '] : null, stateBadge),
      controls, notice, chain, facts,
      compact ? null : [h('h4', { text: 'Timeline' }), timelineNote, timelineList],
      h('h4', { text: 'Output' }), output, reasoningBox,
      compact ? [h('h4', { text: 'Activity' }), activity]
        : h('details', { class: 'wire-events' }, h('summary', { text: 'Events this page received' }), activity),
      final);
    let lastSeq = null;
    let finished = false;
    const source = new EventSource('/api/requests/' + encodeURIComponent(id) + '/stream');
    const close = () => source.close();

    function setState(state, detail) {
      stateBadge.textContent = state + (detail ? ' ' + detail : '');
      stateBadge.className = 'badge state state-' + String(state).toLowerCase();
      el.dataset.state = state;
      refreshControls();
    }

    // Cancel: offered while the request is queued or running, or waits on its decision.
    let waitingDecision = false;
    let cancelReply = null;
    function refreshControls() {
      if (compact) return;
      const state = el.dataset.state;
      const running = state === 'RUNNING' || state === 'QUEUED';
      const cancellable = running || waitingDecision;
      controls.hidden = !cancellable && !cancelReply;
      clear(controls);
      if (cancellable) {
        const can = !store.console.read_only && !!session;
        controls.append(
          h('button', { type: 'button', class: 'danger', 'data-action': 'cancel', disabled: !can, onclick: cancelIt },
            running ? 'Cancel this request' : 'Cancel: expire its pending decision'),
          can ? null : h('span', { class: 'muted', text: store.console.read_only ? ' This console is read-only.' : ' Sign in (at the top) to cancel.' }));
      }
      if (cancelReply) controls.append(cancelReply);
    }
    el.refreshControls = refreshControls;

    async function cancelIt(e) {
      e.currentTarget.disabled = true;
      const reply = await post('/api/requests/' + encodeURIComponent(id) + '/cancel', { user: session ? session.user : '' });
      cancelReply = h('p', { class: 'cancel-status', 'data-field': 'cancel-status', 'data-ok': reply.ok ? 'true' : 'false', role: 'status' },
        reply.ok
          ? ['Cancel sent by ' + reply.data.cancelled_by + ': the fleet answered ', h('strong', { text: reply.data.state }),
            reply.data.decision_id ? ' (its decision ' + reply.data.decision_id + ' expired)' : '', '.']
          : 'Not cancelled: ' + errorText(reply.data, reply.status));
      if (reply.ok && reply.data.decision_id) waitingDecision = false;
      refreshControls();
      refreshTimelineSoon();
    }

    let timelineTimer = null;
    function refreshTimelineSoon() {
      if (compact || timelineTimer) return;
      timelineTimer = setTimeout(() => { timelineTimer = null; loadTimeline(); }, 300);
    }

    async function loadTimeline() {
      let response = null;
      let data = null;
      try {
        response = await fetch('/api/requests/' + encodeURIComponent(id) + '/timeline', { credentials: 'omit' });
        data = await response.json();
      } catch (_) {
        return;
      }
      if (!response.ok) {
        clear(timelineList);
        timelineNote.dataset.notice = 'unseen';
        timelineNote.textContent = (data && data.error ? data.error.message : 'HTTP ' + response.status) + '.';
        return;
      }
      delete timelineNote.dataset.notice;
      timelineNote.dataset.partial = data.partial ? 'true' : 'false';
      // A request the console did not see from its start: its counts are only what it saw.
      const counts = data.partial ? null : [plural(data.turns, 'model turn'), plural(data.tool_calls, 'tool call')];
      timelineNote.textContent = [
        data.pool ? 'pool ' + data.pool : null,
        data.job_name ? 'job ' + data.job_name : null,
        data.tenant ? 'tenant ' + data.tenant : null,
        counts,
        data.latency_ms !== undefined ? data.latency_ms + ' ms from acceptance to result' : null,
        data.timeline_dropped ? data.timeline_dropped + ' later moments not kept' : null,
      ].flat().filter(Boolean).join(' · ');
      if (data.partial) {
        timelineNote.append(h('span', { class: 'partial', 'data-field': 'timeline-partial' },
          (timelineNote.textContent ? '. ' : '') + 'Partial timeline: the console saw only part of this request\'s events ' +
          '(the request began before the console was watching), so moments before that are missing; ' +
          (data.turns || data.tool_calls
            ? 'of its model turns and tool calls it saw ' + seenCount(data.turns, 'model turn') + ' and ' + seenCount(data.tool_calls, 'tool call') + '.'
            : 'it saw none of its model turns or tool calls.')));
      }
      clear(timelineList);
      for (const t of data.timeline) {
        timelineList.append(h('li', { class: 'tl tl-' + t.kind, 'data-kind': t.kind },
          time(t.ts), ' ', h('span', { class: 'tl-kind', text: TIMELINE_LABELS[t.kind] || t.kind }), ' ',
          h('span', { class: 'tl-text', text: t.text }),
          t.request_id && t.request_id !== id ? [' ', requestLink(t.request_id, 'open ' + t.request_id)] : null,
          t.decision_id ? [' ', h('a', { href: '#/inbox?decision=' + encodeURIComponent(t.decision_id), text: 'decision' })] : null));
      }
    }
    if (!compact) loadTimeline();

    // `kind` null: nothing to say.
    function setNotice(kind, ...content) {
      clear(notice);
      if (kind) append(notice, content);
      notice.hidden = !kind;
      if (kind) notice.dataset.notice = kind;
      else delete notice.dataset.notice;
    }

    function setChain(...content) {
      clear(chain);
      append(chain, content);
      chain.hidden = chain.childNodes.length === 0;
    }

    setNotice('asking', 'Asking the fleet about this request…');

    function addActivity(kind, ...content) {
      activity.append(h('li', { class: 'act act-' + kind, 'data-kind': kind }, content));
    }

    function showResult(result) {
      finished = true;
      refreshTimelineSoon();
      setState(result.state, result.reason);
      if (notice.dataset.notice !== 'result_gone') setNotice(null);
      el.dataset.reason = result.reason;
      clear(output).append(document.createTextNode(result.output || ''));
      if (result.reasoning) { reasoning.textContent = result.reasoning; reasoningBox.hidden = false; }
      clear(facts);
      append(facts, placeFacts(result));
      clear(final);
      final.append(h('p', { class: 'result-line', 'data-field': 'result' },
        h('strong', { text: result.state }), ' ', result.reason, result.detail ? ': ' + result.detail : ''));
      if (!compact) {
        const usage = result.usage || {};
        const timings = result.timings_ms || {};
        append(final, [
          h('dl', { class: 'facts' },
            field('Tokens', (usage.prompt_tokens || 0) + ' prompt, ' + (usage.completion_tokens || 0) + ' completion'),
            field('Tool iterations used', String(result.tool_iterations_used)),
            field('Timings', 'queued ' + (timings.queued || 0) + ' ms, first token ' + (timings.first_token !== undefined ? timings.first_token + ' ms' : '-') + ', total ' + (timings.total || 0) + ' ms'),
            field('Attempt', String(result.attempt)),
            result.truncated ? field('Truncated', 'yes') : null,
            result.signals_dropped ? field('Signals dropped', String(result.signals_dropped)) : null),
          result.validation ? h('section', {}, h('h4', { text: 'Validation' }),
            h('p', { text: 'confidence ' + result.validation.confidence + ' (threshold ' + result.validation.threshold + '), ' + (result.validation.passed ? 'passed' : 'below the threshold') }),
            checksList(result.validation.checks || [])) : null,
          result.signals && result.signals.length ? h('section', {}, h('h4', { text: 'Signals' }),
            h('ul', {}, result.signals.map((s) => h('li', {}, signalLine(s))))) : null,
          h('details', { class: 'transcript' }, h('summary', { text: 'Transcript (' + (result.messages || []).length + ' messages)' }),
            h('ol', {}, (result.messages || []).map(messageItem))),
          h('details', {}, h('summary', { text: 'Result as JSON' }), h('pre', { class: 'json', text: json(result) })),
        ]);
        // Tool calls and results from the transcript, when they were not seen live.
        if (!activity.querySelector('.act-tool_call')) {
          for (const m of result.messages || []) {
            for (const call of m.tool_calls || []) addActivity('tool_call', 'tool call ', h('code', { text: call.function ? call.function.name : call.name }), ' ', h('code', { class: 'args', text: call.function ? call.function.arguments : scalar(call.arguments) }));
            if (m.role === 'tool') addActivity('tool_result', 'tool result ', h('code', { class: 'args', text: scalar(m.content) }));
          }
        }
      }
      if (compact) close();
    }

    function messageItem(m) {
      const text = typeof m.content === 'string' ? m.content : Array.isArray(m.content) ? m.content.map((p) => p.text || '').join('') : '';
      return h('li', { class: 'msg role-' + m.role },
        h('span', { class: 'role', text: m.role }),
        text ? h('pre', { class: 'text', text }) : null,
        (m.tool_calls || []).map((c) => h('pre', { class: 'json', text: 'call ' + (c.function ? c.function.name + ' ' + c.function.arguments : json(c)) })));
    }

    // A finished request whose result its caller has read: the summary the fleet keeps for
    // people (how it ended and why, its figures, the openings of prompt and output).
    let summarised = false;
    function showSummary(f) {
      summarised = true;
      setState(f.state, f.reason);
      if (notice.dataset.notice !== 'result_gone') setNotice(null);
      el.dataset.reason = f.reason;
      clear(output).append(document.createTextNode(f.output_start || ''));
      clear(facts);
      append(facts, [
        placeFacts(f),
        f.finished_at ? field('Finished', time(f.finished_at)) : null,
      ]);
      clear(final);
      const usage = f.usage || {};
      const timings = f.timings_ms || {};
      append(final, [
        h('p', { class: 'result-line', 'data-field': 'result' },
          h('strong', { text: f.state }), ' ', f.reason, f.detail ? ': ' + f.detail : ''),
        compact ? null : h('dl', { class: 'facts', 'data-field': 'summary' },
          f.prompt_start ? field('Prompt (opening)', f.prompt_start) : null,
          field('Output', f.output_chars + ' characters' + (f.output_chars > (f.output_start || '').length ? ', the opening shown above' : '')),
          field('Tokens', (usage.prompt_tokens || 0) + ' prompt, ' + (usage.completion_tokens || 0) + ' completion'),
          field('Tool iterations used', String(f.tool_iterations_used)),
          field('Timings', 'queued ' + (timings.queued || 0) + ' ms, first token ' + (timings.first_token !== undefined ? timings.first_token + ' ms' : '-') + ', total ' + (timings.total || 0) + ' ms'),
          field('Attempt', String(f.attempt)),
          f.signals && f.signals.length ? field('Signals', f.signals.join(', ')) : null),
      ]);
    }

    function showStatus(status) {
      waitingDecision = status.decision_outcome === 'pending';
      refreshControls();
      refreshTimelineSoon();
      if (!finished && status.finished) showSummary(status.finished);
      if (!finished && !summarised) {
        setState(status.state);
        if (status.state === 'QUEUED') setNotice('queued', 'Waiting in the queue for a free slot.');
        else if (status.state === 'RUNNING') {
          // Seen from its start here (a stream that reconnected), nothing was missed.
          setNotice(compact || lastSeq !== null ? null : 'running', 'Running on ' + (status.worker_id || '?') + '. Output streamed before this page opened comes with the result.');
        } else setNotice(null);
      }
      if (status.continuation_request_id) setChain('Continued as ', requestLink(status.continuation_request_id), '.');
      else if (status.decision_id) setChain('Decision ' + status.decision_id + ': ' + (status.decision_outcome || 'pending') + '.');
    }

    function showStatusError(error) {
      if (finished) return;
      if (error.code === 'NOT_FOUND') {
        setState('UNKNOWN');
        setNotice('unknown', 'This request is not known to the fleet: it has not started yet, or the fleet no longer keeps it. ' +
          'It shows here as soon as it starts.');
      } else {
        setState('ERROR');
        setNotice('error', 'The fleet did not say how this request stands (' + error.code + ': ' + error.message + '). It shows here as soon as it sends an event.');
      }
    }

    source.addEventListener('status', (e) => showStatus(JSON.parse(e.data)));
    source.addEventListener('status_error', (e) => showStatusError(JSON.parse(e.data).error || {}));
    source.addEventListener('result', (e) => showResult(JSON.parse(e.data)));
    source.addEventListener('result_error', (e) => {
      const error = JSON.parse(e.data).error || {};
      setNotice('result_gone', summarised
        ? 'Its caller has read the result, so the fleet no longer holds it whole: this is the summary kept for people.'
        : 'The result is not available: ' + error.message);
    });
    // A stream the console refused (a malformed id, too many live streams) is not retried by
    // the browser: ask once why, and say it.
    source.addEventListener('error', async () => {
      if (source.readyState !== EventSource.CLOSED || finished) return;
      let reply = null;
      try {
        const response = await fetch('/api/requests/' + encodeURIComponent(id), { credentials: 'omit' });
        let data = null;
        try { data = await response.json(); } catch (_) { data = null; }
        reply = { ok: response.ok, status: response.status, data };
      } catch (_) {
        reply = null;
      }
      if (finished) return;
      if (reply && reply.status === 400) {
        setState('INVALID');
        setNotice('invalid', 'This is not a valid request id: ' + (reply.data && reply.data.error ? reply.data.error.message : 'HTTP 400') + '.');
      } else if (reply && reply.ok && reply.data) {
        if (reply.data.status) showStatus(reply.data.status);
        if (reply.data.status_error) showStatusError(reply.data.status_error.error || {});
        if (reply.data.result) showResult(reply.data.result);
        if (!finished) {
          notice.hidden = false;
          notice.dataset.notice = 'not_live';
          notice.append((notice.childNodes.length ? ' ' : '') + 'The console did not open a live stream for it (it serves a limited number at once, ' +
            'console.max_clients): reload the page to follow it live.');
        }
      } else {
        setState('ERROR');
        setNotice('error', 'This request cannot be followed: ' + (reply ? errorText(reply.data, reply.status) : 'the console does not answer') + '.');
      }
    });
    source.addEventListener('event', (e) => {
      const event = JSON.parse(e.data);
      refreshTimelineSoon();
      if (event.event === 'continued' || event.event === 'chain_ended') { waitingDecision = false; refreshControls(); }
      // Sent again after a move (the run that took the request up cannot know what was sent): seen already.
      if (lastSeq !== null && event.seq <= lastSeq) return;
      // A request whose worker was lost is ended by another, numbered past anything sent.
      if (lastSeq !== null && event.seq > lastSeq + 1 && event.seq !== SEQ_AFTER_LOST) addActivity('gap', 'missed ' + (event.seq - lastSeq - 1) + ' events; the result has all of it');
      // The request shows itself: what was said before (not known, queued, no answer) goes.
      if (!finished && el.dataset.state !== 'RUNNING' && event.event !== 'finished') {
        setState('RUNNING');
        const missed = lastSeq === null && event.event !== 'started';
        setNotice(missed && !compact ? 'running' : null, 'Output streamed before this page opened comes with the result.');
      }
      lastSeq = event.seq;
      switch (event.event) {
        case 'started':
          setState('RUNNING');
          addActivity('started', 'started on ', h('code', { text: event.worker_id }), ' at ', time(event.ts), ' (attempt ' + event.attempt + ', chain position ' + event.chain_position + ')');
          break;
        case 'delta':
          output.append(document.createTextNode(event.text));
          break;
        case 'reasoning':
          reasoning.append(document.createTextNode(event.text));
          reasoningBox.hidden = false;
          break;
        case 'tool_call':
          addActivity('tool_call', 'tool call ', h('code', { text: event.name }), ' ', h('code', { class: 'args', text: JSON.stringify(event.arguments) }));
          break;
        case 'tool_result':
          addActivity('tool_result', event.ok ? 'tool result ' : 'tool error ', h('code', { text: event.name }), ' → ', h('code', { class: 'args', text: JSON.stringify(event.result) }));
          break;
        case 'signal':
          addActivity('signal', signalLine(event.signal));
          break;
        case 'finished':
          showResult(event.result);
          break;
        case 'continued':
          addActivity('continued', 'the decision was answered at ', time(event.ts), ': continued as ', requestLink(event.continuation_request_id));
          setChain('Continued as ', requestLink(event.continuation_request_id), '.');
          break;
        case 'chain_ended':
          addActivity('chain_ended', 'the chain ended at ', time(event.ts), ': ' + event.outcome + (event.decided_by ? ' by ' + event.decided_by : ''));
          break;
        default:
          break;
      }
    });
    return { el, close };
  }

  function signalLine(s) {
    return [
      badge(s.type + '.' + s.code, 'code'), ' ', badge(s.severity, 'sev-' + s.severity), ' ',
      h('span', { class: 'summary', text: s.summary }),
      s.decision ? [' ', h('a', { href: '#/inbox?decision=' + encodeURIComponent(s.decision.decision_id), text: 'decision ' + s.decision.decision_id })] : null,
    ];
  }

  function renderRequest(id) {
    clear(main);
    const panel = followPanel(id, false);
    append(main, [h('h1', {}, 'Request ', h('span', { class: 'id', text: id })), panel.el]);
    leaveView = panel.close;
  }

  // ---------- fleet ----------

  // On a narrow screen each row becomes a block of "column: value" lines (app.css): every
  // cell carries its column's name, and the roles keep it a table for screen readers.
  function table(caption, head, rows, attrs) {
    const body = h('tbody', { role: 'rowgroup' }, rows);
    for (const tr of body.rows) {
      tr.setAttribute('role', 'row');
      [...tr.cells].forEach((td, i) => {
        td.setAttribute('role', 'cell');
        if (!td.hasAttribute('colspan') && head[i]) td.dataset.label = head[i];
      });
    }
    return h('div', { class: 'table-wrap' },
      h('table', Object.assign({ role: 'table' }, attrs || {}),
        h('caption', { text: caption }),
        h('thead', { role: 'rowgroup' }, h('tr', { role: 'row' }, head.map((c) => h('th', { scope: 'col', role: 'columnheader', text: c })))),
        body));
  }

  // The fleet view is drawn anew on each change; a link that had the focus gets it back.
  function renderFleet() {
    const had = document.activeElement && main.contains(document.activeElement) ? document.activeElement.dataset.requestLink : null;
    drawFleet();
    if (had) {
      const again = main.querySelector('[data-request-link="' + CSS.escape(had) + '"]');
      if (again) again.focus({ preventScroll: true });
    }
  }

  function drawFleet() {
    const f = store.fleet;
    clear(main);
    main.append(h('h1', { text: 'Fleet' }));
    if (!f) { main.append(h('p', { class: 'empty', text: 'Asking the workers…' })); return; }
    main.append(h('div', { class: 'tiles' },
      tile('Workers', f.workers.length, 'fleet-workers'),
      tile('Slots', f.slots, 'fleet-slots'),
      tile('Busy', f.busy, 'fleet-busy'),
      tile('Free', f.free, 'fleet-free'),
      tile('Running requests', f.running_total, 'fleet-running')));
    if (f.workers.length === 0) main.append(h('p', { class: 'empty', text: 'No worker answers the service API ($SRV.INFO.genfleet).' }));
    main.append(table('Pools', ['pool', 'workers', 'slots', 'busy', 'free'],
      f.pools.map((p) => h('tr', { 'data-pool': p.pool }, h('td', { text: p.pool }), h('td', { text: p.workers }), h('td', { text: p.slots }), h('td', { text: p.busy }), h('td', { text: p.free })))));
    if (f.series) main.append(seriesRows(f.series));
    main.append(table('Workers', ['worker', 'pool', 'slots in use', 'busy', 'free', 'state', 'version', 'started'],
      f.workers.map((w) => h('tr', { 'data-worker-id': w.worker_id, class: w.answering ? '' : 'stale' },
        h('td', {}, h('code', { text: w.worker_id })),
        h('td', { text: w.pool }),
        h('td', {}, h('meter', { min: 0, max: Math.max(w.slots, 1), value: w.busy, 'aria-label': w.busy + ' of ' + w.slots + ' slots busy' }), ' ' + w.busy + '/' + w.slots),
        h('td', { 'data-field': 'busy', text: w.busy }),
        h('td', { 'data-field': 'free', text: w.free }),
        h('td', { text: !w.answering ? 'not answering' : w.draining ? 'draining' : 'ready' }),
        h('td', { text: w.version }),
        h('td', {}, time(w.started))))));
    // Per tenant and band, over the workers: the queue's waiting count (each worker sees the
    // same), the running and completed ones summed, the mean wait of those that started.
    const tenants = new Map();
    for (const w of f.workers) for (const t of (w.tenants || [])) {
      const key = t.tenant + ' ' + t.band;
      const row = tenants.get(key) || { tenant: t.tenant, band: t.band, waiting: 0, running: 0, completed: 0, started: 0, wait: 0 };
      row.waiting = Math.max(row.waiting, t.waiting); row.running += t.running; row.completed += t.completed;
      row.started += t.started; row.wait += t.wait_ms_total;
      tenants.set(key, row);
    }
    if (tenants.size) main.append(table('Tenants', ['tenant', 'band', 'waiting', 'running', 'completed', 'mean wait'],
      [...tenants.values()].map((t) => h('tr', { 'data-tenant': t.tenant, 'data-band': t.band },
        h('td', {}, h('code', { text: t.tenant })), h('td', { text: t.band }), h('td', { text: t.waiting }),
        h('td', { text: t.running }), h('td', { text: t.completed }),
        h('td', { text: t.started ? Math.round(t.wait / t.started) + ' ms' : '-' })))));
    main.append(table('Running requests' + (f.running_total > f.running.length ? ' (newest ' + f.running.length + ' of ' + f.running_total + ')' : ''),
      ['request', 'worker', 'since', 'chain position', 'attempt'],
      f.running.length ? f.running.map((r) => h('tr', { 'data-running': r.request_id },
        h('td', {}, requestLink(r.request_id)), h('td', {}, h('code', { text: r.worker_id })), h('td', {}, time(r.since)),
        h('td', { text: r.chain_position }), h('td', { text: r.attempt })))
        : h('tr', {}, h('td', { colspan: 5, class: 'muted', text: 'None seen running.' }))));
    main.append(table('Recently finished', ['request', 'job', 'result', 'worker', 'finished'],
      f.finished.length ? f.finished.map((r) => h('tr', {},
        h('td', {}, requestLink(r.request_id)), h('td', { text: r.job_name || '-' }),
        h('td', {}, badge(r.state, 'state state-' + r.state.toLowerCase()), ' ' + r.reason, r.detail ? h('span', { class: 'detail', 'data-field': 'detail', text: ': ' + r.detail }) : null),
        h('td', {}, h('code', { text: r.worker_id })), h('td', {}, time(r.finished_at))))
        : h('tr', {}, h('td', { colspan: 5, class: 'muted', text: 'None yet.' }))));
    main.append(h('p', { class: 'muted' }, 'The workers are asked every ' + (store.console.fleet_refresh_ms || 1000) + ' ms through the NATS service API; last answer at ', time(f.polled_at), '.'));
  }

  function tile(label, value, id) {
    return h('div', { class: 'tile' }, h('span', { class: 'tile-label', text: label }), h('strong', { id, text: String(value) }));
  }

  // ---------- requests ----------

  const REQUEST_FILTERS = ['state', 'pool', 'job', 'tenant', 'id'];
  const STATES = ['QUEUED', 'RUNNING', 'COMPLETED', 'FAILED', 'CANCELLED'];
  let requestFilters = {};
  let requestsTimer = null;
  let requestsAsked = 0;

  function refreshRequestsSoon() {
    if (requestsTimer) return;
    requestsTimer = setTimeout(() => { requestsTimer = null; loadRequests(); }, 300);
  }

  function renderRequests(params, fresh) {
    requestFilters = {};
    for (const k of REQUEST_FILTERS) if (params.get(k)) requestFilters[k] = params.get(k);
    if (!fresh && document.getElementById('request-list')) { loadRequests(); return; }
    clear(main);
    const text = (name, label, attrs) => h('label', {}, label, ' ', h('input', Object.assign({ name, 'data-filter': name, value: requestFilters[name] || '', size: 12, spellcheck: 'false', autocomplete: 'off' }, attrs || {})));
    const form = h('form', { class: 'filters', id: 'request-filters', role: 'search', 'aria-label': 'Filter and search the requests' },
      text('id', 'Request id', { type: 'search', placeholder: 'search by id', size: 22, id: 'request-search' }),
      h('label', {}, 'State ', h('select', { name: 'state', 'data-filter': 'state' },
        [['', 'any'], ...STATES.map((st) => [st, st.toLowerCase()])].map(([v, t]) => h('option', { value: v, selected: (requestFilters.state || '') === v, text: t })))),
      text('pool', 'Pool', { list: 'request-pools' }),
      text('job', 'Job', { list: 'request-jobs' }),
      text('tenant', 'Tenant', { list: 'request-tenants' }),
      h('datalist', { id: 'request-pools' }), h('datalist', { id: 'request-jobs' }), h('datalist', { id: 'request-tenants' }),
      h('button', { type: 'submit', title: 'Open the request whose id this is, or the only one that matches' }, 'Open'),
      h('button', { type: 'reset' }, 'Clear'));
    const sync = () => {
      requestFilters = {};
      for (const el of form.querySelectorAll('[data-filter]')) if (el.value.trim()) requestFilters[el.dataset.filter] = el.value.trim();
      const query = new URLSearchParams(requestFilters).toString();
      history.replaceState(null, '', '#/requests' + (query ? '?' + query : ''));
      lastHash = location.hash;
      loadRequests();
    };
    form.addEventListener('input', sync);
    form.addEventListener('change', sync);
    form.addEventListener('reset', () => setTimeout(sync, 0));
    // Enter in the search box opens the request: the one whose id it is, or the only match.
    form.addEventListener('submit', (e) => {
      e.preventDefault();
      const wanted = (requestFilters.id || '').trim();
      if (!wanted) return;
      const rows = [...document.querySelectorAll('#request-list tr[data-request-row]')].map((tr) => tr.dataset.requestRow);
      const target = rows.includes(wanted) ? wanted : rows.length === 1 ? rows[0] : wanted;
      location.hash = '#/request/' + encodeURIComponent(target);
    });
    append(main, [
      h('h1', { text: 'Requests' }),
      form,
      h('p', { class: 'muted', id: 'request-count', role: 'status' }),
      h('div', { id: 'request-list' }),
    ]);
    loadRequests();
  }

  async function loadRequests() {
    const asked = ++requestsAsked;
    const query = new URLSearchParams(Object.assign({ limit: '200' }, requestFilters)).toString();
    let page = null;
    let problem = null;
    try {
      const response = await fetch('/api/requests?' + query, { credentials: 'omit' });
      const data = await response.json();
      if (response.ok) page = data; else problem = errorText(data, response.status);
    } catch (e) {
      problem = 'the console does not answer';
    }
    // An answer to an older question (the filter changed meanwhile) is not shown.
    if (asked !== requestsAsked || viewName !== 'requests') return;
    const list = document.getElementById('request-list');
    if (!list) return;
    const count = document.getElementById('request-count');
    if (!page) { count.textContent = 'The list cannot be read: ' + problem + '.'; return; }
    for (const [id, values] of [['request-pools', page.pools], ['request-jobs', page.jobs], ['request-tenants', page.tenants]]) {
      const dl = document.getElementById(id);
      if (dl) { clear(dl); for (const v of values) dl.append(h('option', { value: v })); }
    }
    const filtered = Object.keys(requestFilters).length > 0;
    count.textContent = (filtered ? page.matched + ' of the ' : '') + page.kept + ' requests the console keeps' + (filtered ? ' match' : '') +
      (page.requests.length < page.matched ? ', the newest ' + page.requests.length + ' shown' : '') +
      ' (newest first; it keeps at most ' + page.max + ', console.max_requests).';
    const had = document.activeElement && list.contains(document.activeElement) ? document.activeElement.dataset.requestLink : null;
    clear(list).append(table('Requests', ['request', 'state', 'pool', 'job', 'tenant', 'started', 'latency', 'turns, tools'],
      page.requests.length ? page.requests.map((r) => h('tr', { 'data-request-row': r.request_id, 'data-state': r.state },
        h('td', {}, requestLink(r.request_id), r.parent_request_id ? h('span', { class: 'muted', text: ' (continues ' + r.parent_request_id.slice(0, 10) + '…)' }) : null),
        h('td', {}, badge(r.state, 'state state-' + r.state.toLowerCase()), r.reason ? ' ' + r.reason : '', r.released ? h('span', { class: 'muted', text: ' · read' }) : null),
        h('td', { 'data-field': 'pool', text: r.pool || '-' }),
        h('td', { 'data-field': 'job', text: r.job_name || '-' }),
        h('td', { 'data-field': 'tenant', text: r.tenant || '-' }),
        h('td', {}, time(r.started_at || r.accepted_at)),
        h('td', { text: r.latency_ms !== undefined ? r.latency_ms + ' ms' : '-' }),
        r.partial
          ? h('td', { 'data-field': 'counts', 'data-partial': 'true', title: 'The console saw only part of this request\'s events (it began before the console was watching)',
            text: (r.turns || r.tool_calls ? 'at least ' + r.turns + ', ' + r.tool_calls : 'not seen') + ' (partial)' })
          : h('td', { 'data-field': 'counts', text: r.turns + ', ' + r.tool_calls })))
        : h('tr', {}, h('td', { colspan: 8, class: 'muted', text: filtered ? 'No request matches.' : 'No request seen yet.' }))));
    if (had) {
      const again = list.querySelector('[data-request-link="' + CSS.escape(had) + '"]');
      if (again) again.focus({ preventScroll: true });
    }
  }

  // ---------- batches ----------

  // The gateway's batches are read from their bucket when asked: the view asks again every
  // BATCHES_POLL_MS while it is shown.
  const BATCHES_POLL_MS = 5000;
  const BATCH_STATES = { completed: 'state-completed', failed: 'state-failed', expired: 'state-failed', cancelled: 'state-cancelled', cancelling: 'state-cancelled' };

  function renderBatches() {
    let timer = null;
    let left = false;
    leaveView = () => { left = true; clearTimeout(timer); };
    append(main, [
      h('h1', { text: 'Batches' }),
      h('p', { class: 'muted', id: 'batch-count', role: 'status', text: 'Reading the batches…' }),
      h('div', { id: 'batch-list' }),
    ]);
    const poll = async () => {
      await loadBatches();
      if (!left) timer = setTimeout(poll, BATCHES_POLL_MS);
    };
    poll();
  }

  function batchProgress(b) {
    const counts = b.request_counts || {};
    const total = counts.total || 0;
    const completed = counts.completed || 0;
    const failed = counts.failed || 0;
    const text = completed + ' completed, ' + failed + ' failed of ' + total;
    return h('td', { 'data-field': 'progress', class: 'batch-progress' },
      h('progress', { max: Math.max(total, 1), value: Math.min(completed + failed, Math.max(total, 1)), 'aria-label': text }),
      ' ', h('span', { text }));
  }

  async function loadBatches() {
    let page = null;
    let problem = null;
    try {
      const response = await fetch('/api/batches', { credentials: 'omit' });
      const data = await response.json();
      if (response.ok) page = data; else problem = errorText(data, response.status);
    } catch (e) {
      problem = 'the console does not answer';
    }
    const list = document.getElementById('batch-list');
    if (viewName !== 'batches' || !list) return;
    const count = document.getElementById('batch-count');
    if (!page) { count.textContent = 'The batches cannot be read: ' + problem + '.'; return; }
    count.textContent = page.note ? page.note + '.'
      : page.total + (page.total === 1 ? ' batch' : ' batches') + ', newest first' + (page.batches.length < page.total ? ', the newest ' + page.batches.length + ' shown (console.max_requests)' : '') + '.';
    clear(list).append(table('Batches of every tenant', ['batch', 'tenant', 'status', 'endpoint', 'progress', 'created', 'driven by'],
      page.batches.length ? page.batches.map((b) => h('tr', { 'data-batch-row': b.id, 'data-status': b.status },
        h('td', {}, h('code', { class: 'id', text: b.id })),
        h('td', { 'data-field': 'tenant', text: b.tenant }),
        h('td', {}, badge(b.status, 'batch-status state ' + (BATCH_STATES[b.status] || ''))),
        h('td', {}, h('code', { text: b.endpoint || '-' })),
        batchProgress(b),
        h('td', {}, time(typeof b.created_at === 'number' ? new Date(b.created_at * 1000).toISOString() : null)),
        h('td', {}, b.driven_by ? h('code', { text: b.driven_by }) : '-')))
        : h('tr', {}, h('td', { colspan: 7, class: 'muted', text: 'No batch yet.' }))));
  }

  // ---------- sparklines ----------

  const SVG = 'http://www.w3.org/2000/svg';

  function svg(tag, attrs, ...children) {
    const el = document.createElementNS(SVG, tag);
    for (const [name, value] of Object.entries(attrs || {})) el.setAttribute(name, String(value));
    for (const child of children.flat()) if (child) el.append(child);
    return el;
  }

  // Small bars over `values` (null: no bar), highest at the top, as plain inline SVG: one
  // bucket with a value shows as plainly as many.
  function sparkbars(values, label, kind, pool) {
    const width = 150;
    const height = 32;
    const max = Math.max(1, ...values.filter((v) => v !== null));
    const step = width / values.length;
    const bars = [];
    values.forEach((v, i) => {
      if (v === null) return;
      const tall = Math.max(2, (v / max) * (height - 4));
      bars.push(svg('rect', { x: (i * step + 0.5).toFixed(1), y: (height - 1 - tall).toFixed(1), width: Math.max(1, step - 1).toFixed(1), height: tall.toFixed(1) }));
    });
    return svg('svg', { class: 'sparkline spark-' + kind, viewBox: '0 0 ' + width + ' ' + height, width, height, role: 'img', 'aria-label': label, 'data-sparkline': kind, 'data-pool': pool, 'data-points': bars.length },
      svg('title', {}, document.createTextNode(label)),
      svg('line', { x1: 0, y1: height - 1, x2: width, y2: height - 1, class: 'baseline' }),
      bars);
  }

  // A small line over `values` (null: no value), highest at the top, as plain inline SVG.
  function sparkline(values, label, kind, pool) {
    const width = 150;
    const height = 32;
    const max = Math.max(1, ...values.filter((v) => v !== null));
    const step = width / Math.max(1, values.length - 1);
    const points = [];
    values.forEach((v, i) => {
      if (v === null) return;
      points.push((i * step).toFixed(1) + ',' + (height - 2 - (v / max) * (height - 4)).toFixed(1));
    });
    return svg('svg', { class: 'sparkline spark-' + kind, viewBox: '0 0 ' + width + ' ' + height, width, height, role: 'img', 'aria-label': label, 'data-sparkline': kind, 'data-pool': pool, 'data-points': points.length },
      svg('title', {}, document.createTextNode(label)),
      svg('line', { x1: 0, y1: height - 1, x2: width, y2: height - 1, class: 'baseline' }),
      points.length > 1 ? svg('polyline', { points: points.join(' '), fill: 'none' }) : null,
      points.length ? svg('circle', { cx: points[points.length - 1].split(',')[0], cy: points[points.length - 1].split(',')[1], r: 2 }) : null);
  }

  function seriesRows(series) {
    const minutes = Math.round((series.bucket_ms * (series.pools[0] ? series.pools[0].points.length : 30)) / 60000);
    const seconds = series.bucket_ms / 1000;
    return table('Throughput and latency per pool (the last ' + minutes + ' minutes, ' + seconds + ' s a point)',
      ['pool', 'finished', 'throughput', 'mean latency', 'latency'],
      series.pools.length ? series.pools.map((p) => {
        const finished = p.points.reduce((n, x) => n + x.finished, 0);
        const failed = p.points.reduce((n, x) => n + x.failed, 0);
        const withLatency = p.points.filter((x) => x.mean_latency_ms !== undefined);
        const mean = withLatency.length ? Math.round(withLatency.reduce((n, x) => n + x.mean_latency_ms * x.finished, 0) / Math.max(1, finished)) : null;
        const peak = withLatency.length ? Math.max(...withLatency.map((x) => x.max_latency_ms)) : null;
        return h('tr', { 'data-series-pool': p.pool },
          h('td', { text: p.pool }),
          h('td', { 'data-field': 'finished', text: finished + (failed ? ' (' + failed + ' not completed)' : '') }),
          h('td', {}, sparkline(p.points.map((x) => x.finished), finished + ' requests finished in pool ' + p.pool + ', per ' + seconds + ' s', 'throughput', p.pool)),
          h('td', { 'data-field': 'latency', text: mean === null ? '-' : mean + ' ms (highest ' + peak + ' ms)' }),
          h('td', {}, sparkbars(p.points.map((x) => (x.mean_latency_ms === undefined ? null : x.mean_latency_ms)), 'mean latency in pool ' + p.pool + (mean === null ? ': nothing finished' : ': ' + mean + ' ms'), 'latency', p.pool)));
      }) : h('tr', {}, h('td', { colspan: 5, class: 'muted', text: 'No pool yet.' })));
  }

  // ---------- signals ----------

  const FILTERS = ['type', 'code', 'severity', 'pool', 'job'];
  let filters = {};

  function matches(s) {
    if (filters.type && s.type !== filters.type) return false;
    if (filters.code && !s.code.toLowerCase().includes(filters.code.toLowerCase())) return false;
    if (filters.severity && s.severity !== filters.severity) return false;
    if (filters.pool && !s.pool.toLowerCase().includes(filters.pool.toLowerCase())) return false;
    if (filters.job && !(s.job_name || '').toLowerCase().includes(filters.job.toLowerCase())) return false;
    return true;
  }

  function renderSignals(params, fresh) {
    filters = {};
    for (const k of FILTERS) if (params.get(k)) filters[k] = params.get(k);
    if (!fresh && document.getElementById('signal-feed')) { refillSignals(); return; }
    clear(main);
    const select = (name, label, values) => h('label', {}, label, ' ', h('select', { name, 'data-filter': name },
      values.map(([v, text]) => h('option', { value: v, selected: (filters[name] || '') === v, text }))));
    const text = (name, label, list) => h('label', {}, label, ' ', h('input', { name, 'data-filter': name, value: filters[name] || '', list: list || null, size: 12, spellcheck: 'false' }));
    const codes = new Set(store.signals.map((s) => s.code));
    const form = h('form', { class: 'filters', 'aria-label': 'Filter the signals' },
      select('type', 'Type', [['', 'any'], ['issue', 'issue'], ['escalation', 'escalation'], ['decision_request', 'decision request'], ['outcome', 'outcome']]),
      text('code', 'Code', 'signal-codes'),
      h('datalist', { id: 'signal-codes' }, [...codes].sort().map((c) => h('option', { value: c }))),
      select('severity', 'Severity', [['', 'any'], ['low', 'low'], ['med', 'med'], ['high', 'high']]),
      text('pool', 'Pool'),
      text('job', 'Job'),
      h('button', { type: 'reset' }, 'Clear'));
    const sync = () => {
      filters = {};
      for (const el of form.querySelectorAll('[data-filter]')) if (el.value.trim()) filters[el.dataset.filter] = el.value.trim();
      const query = new URLSearchParams(filters).toString();
      history.replaceState(null, '', '#/signals' + (query ? '?' + query : ''));
      refillSignals();
    };
    form.addEventListener('input', sync);
    form.addEventListener('change', sync);
    form.addEventListener('reset', () => setTimeout(sync, 0));
    form.addEventListener('submit', (e) => e.preventDefault());
    append(main, [
      h('h1', { text: 'Signals' }),
      form,
      h('p', { class: 'muted', id: 'signal-count', role: 'status' }),
      h('ol', { id: 'signal-feed', class: 'feed', reversed: true }),
    ]);
    refillSignals();
  }

  function signalRow(s) {
    return h('li', { class: 'signal sev-' + s.severity, 'data-type': s.type, 'data-code': s.code, 'data-severity': s.severity, 'data-seq': s.seq },
      h('div', { class: 'signal-head' }, time(s.ts), ' ', signalLine(s)),
      h('p', { class: 'where' },
        'pool ', s.pool, s.job_name ? [' · job ', s.job_name] : null, ' · request ', requestLink(s.request_id),
        ' · worker ', h('code', { text: s.worker_id }), ' · raised by the ', s.source),
      Object.keys(s.meta || {}).length ? h('details', {}, h('summary', { text: 'meta' }), h('pre', { class: 'json', text: json(s.meta) })) : null);
  }

  function refillSignals() {
    const feed = document.getElementById('signal-feed');
    if (!feed) return;
    clear(feed);
    const shown = store.signals.filter(matches).reverse();
    for (const s of shown) feed.append(signalRow(s));
    countSignals();
  }

  function countSignals() {
    const feed = document.getElementById('signal-feed');
    document.getElementById('signal-count').textContent =
      'Showing ' + feed.children.length + ' of the newest ' + store.signals.length + ' signals' + (Object.keys(filters).length ? ' (filtered)' : '') + '.';
  }

  function addSignalRow(s) {
    const feed = document.getElementById('signal-feed');
    if (!feed) return;
    if (matches(s)) feed.insertBefore(signalRow(s), feed.firstChild);
    while (feed.children.length > store.console.max_signals) feed.lastChild.remove();
    countSignals();
  }

  // ---------- start ----------

  renderSession();
  render();
  connect();
})();
