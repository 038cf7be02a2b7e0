// Drives genfleet console in headless Chromium, as a person would, for tests/console.rs.
//
// The Rust test starts nats-server, a worker on the mock backend, a tool service and two
// consoles (one answering, one read-only), then runs this script. Whatever needs the fleet
// (raise a decision, start a slow request, read a decision's record) is asked of the Rust
// side with a line `STEP {json}` on stdout; the answer comes back as one JSON line on stdin.
// `LOG text` lines are passed through. Any failure throws: the exit status is non-zero and
// the message says what the page did not show.
//
// Environment: GENFLEET_CONSOLE_URL, GENFLEET_READONLY_CONSOLE_URL, GENFLEET_CONSOLE_TOKEN,
// GENFLEET_TEST_CHROMIUM (the browser), GENFLEET_TEST_NODE_MODULES (where playwright-core
// is), GENFLEET_SCREENSHOT_DIR (where the screenshots go).

import { createInterface } from 'node:readline';
import { createRequire } from 'node:module';
import { randomUUID } from 'node:crypto';
import path from 'node:path';

const env = (name) => {
  const value = process.env[name];
  if (!value) throw new Error(`${name} is not set`);
  return value;
};
const require = createRequire(path.join(env('GENFLEET_TEST_NODE_MODULES'), 'x.js'));
const { chromium } = require('playwright-core');

const url = env('GENFLEET_CONSOLE_URL');
const readOnlyUrl = env('GENFLEET_READONLY_CONSOLE_URL');
const token = env('GENFLEET_CONSOLE_TOKEN');
const shots = env('GENFLEET_SCREENSHOT_DIR');

const lines = createInterface({ input: process.stdin })[Symbol.asyncIterator]();
async function ask(step, args = {}) {
  process.stdout.write(`STEP ${JSON.stringify({ step, ...args })}\n`);
  const { value, done } = await lines.next();
  if (done) throw new Error(`no answer to step ${step}`);
  const reply = JSON.parse(value);
  if (reply.error) throw new Error(`step ${step}: ${reply.error}`);
  return reply;
}
const log = (text) => process.stdout.write(`LOG ${text}\n`);

function check(condition, message) {
  if (!condition) throw new Error(message);
}

const card = (id) => `article[data-decision-id="${id}"]`;

async function textOf(page, selector) {
  return (await page.locator(selector).first().textContent()) || '';
}

async function signIn(page, user) {
  // By keyboard: the name, Tab to the token, Enter.
  await page.locator('#sign-in-user').focus();
  await page.keyboard.type(user);
  await page.keyboard.press('Tab');
  await page.keyboard.type(token);
  await page.keyboard.press('Enter');
  await page.locator('#signed-in-as', { hasText: `human:${user}` }).waitFor();
}

async function noHorizontalScroll(page, width) {
  const scroll = await page.evaluate(() => document.documentElement.scrollWidth);
  check(scroll <= width, `the page is ${scroll}px wide on a ${width}px screen`);
}

// Every time the console shows: one format, with its zone.
const TIME_FORMAT = /^\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2} UTC$/;

// Checks every time on the page: each <time> in that format, and no clock time printed any
// other way outside the model's and callers' own text (outputs, transcripts, JSON). Returns
// how many times the page shows.
async function checkTimes(page, where) {
  const { shown, stray } = await page.evaluate(() => {
    const shown = [...document.querySelectorAll('time')].map((t) => t.textContent);
    const stray = [];
    const walker = document.createTreeWalker(document.body, NodeFilter.SHOW_TEXT);
    for (let node = walker.nextNode(); node; node = walker.nextNode()) {
      if (node.parentElement.closest('time, pre, script, style')) continue;
      if (/\d:\d\d|\d{4}-\d\d-\d\d/.test(node.textContent)) stray.push(node.textContent);
    }
    return { shown, stray };
  });
  for (const text of shown) check(TIME_FORMAT.test(text), `${where} shows the time ${JSON.stringify(text)}, not as 2026-11-24 14:03:07 UTC`);
  check(stray.length === 0, `${where} prints a time outside the time helper: ${JSON.stringify(stray)}`);
  return shown.length;
}

// A request id the fleet has never seen.
const freshId = (prefix) => `${prefix}-${randomUUID()}`;

const browser = await chromium.launch({
  executablePath: env('GENFLEET_TEST_CHROMIUM'),
  headless: true,
  args: ['--no-sandbox', '--disable-gpu', '--disable-dev-shm-usage'],
});
try {
  const context = await browser.newContext({ viewport: { width: 1280, height: 900 } });
  context.setDefaultTimeout(20000);
  const page = await context.newPage();
  const errors = [];
  page.on('pageerror', (e) => errors.push(e.message));

  // ---- inbox: a decision appears without reloading the page ----
  await page.goto(`${url}/#/inbox`);
  await page.locator('#live', { hasText: 'live' }).waitFor();
  await signIn(page, 'ann');
  const decision = await ask('decision');
  log(`decision ${decision.decision_id} raised by request ${decision.request_id}`);
  const pending = page.locator(`${card(decision.decision_id)}[data-state="pending"]`);
  await pending.waitFor();
  const shown = await pending.textContent();
  for (const needle of ['Where should the report go?', 'Email it to the team', 'Archive it', '+ everyone sees it today',
    '− nobody reads it', 'default', 'The product is 7,006,652', 'decision_request.NEEDS_MANAGER_DECISION', 'job console-report']) {
    check(shown.includes(needle), `the inbox card does not show ${JSON.stringify(needle)}: ${shown}`);
  }
  check((await textOf(page, '#pending-count')) === '1', 'the pending count is not 1');

  // An escalation shows its checks and confidence.
  const escalation = await ask('escalation');
  const esc = page.locator(`${card(escalation.decision_id)}[data-state="pending"]`);
  await esc.waitFor();
  check((await esc.locator('[data-field="confidence"]').textContent()) === '0', 'the escalation does not show confidence 0');
  check(await esc.locator('.checks li.fail').count() >= 1, 'the escalation does not show its failed check');
  const escText = await esc.textContent();
  for (const needle of ['escalation.LOW_CONFIDENCE', 'contains "TOTAL"', 'threshold 0.6', 'Run it again', 'Abort the job']) {
    check(escText.includes(needle), `the escalation card does not show ${JSON.stringify(needle)}`);
  }
  await page.screenshot({ path: path.join(shots, 'inbox.png'), fullPage: true });

  // ---- answering by keyboard: rationale, Tab to the first option, Enter ----
  await pending.locator('textarea[data-field="rationale"]').focus();
  await page.keyboard.type('the team needs it today');
  await page.keyboard.press('Tab');
  const focused = await page.evaluate(() => document.activeElement && document.activeElement.dataset.optionId);
  check(focused === 'email', `Tab from the rationale lands on ${focused}, not the first option`);
  await page.keyboard.press('Enter');
  // The page shows the continuation it started, follows it, and shows its result.
  const decided = page.locator(`${card(decision.decision_id)}[data-state="answered"]`);
  await decided.waitFor();
  check((await decided.locator('.decided-by').textContent()) === 'human:ann', 'the decided card does not say who decided');
  const follow = decided.locator('.follow[data-state="COMPLETED"]');
  await follow.waitFor();
  const result = await follow.locator('[data-field="result"]').textContent();
  check(result.includes('COMPLETED') && result.includes('stop'), `the continuation's result line is ${result}`);
  const output = await follow.locator('[data-field="output"]').textContent();
  check(output.includes('Report filed') && output.includes('Decision chosen: Email it to the team (email)'),
    `the continuation's output is ${output}`);
  const answer = await ask('answer', { decision_id: decision.decision_id });
  check(answer.option_id === 'email' && answer.decided_by === 'human:ann' && answer.rationale === 'the team needs it today',
    `the record holds ${JSON.stringify(answer)}`);
  check(await follow.locator(`a[data-request-link="${answer.continuation_request_id}"]`).count() === 1,
    'the follow panel does not name the continuation');
  // Raised, expires and decided at: all in the one format.
  check(await checkTimes(page, 'the inbox') >= 3, 'the inbox shows fewer than 3 times');

  // ---- an escalation answered with guidance and a confidence boost ----
  await esc.locator('textarea[data-field="guidance"]').fill('Write TOTAL first.');
  await esc.locator('input[data-field="confidence_boost"]').fill('0.1');
  await esc.locator('button[data-option-id="retry"]').click();
  await page.locator(`${card(escalation.decision_id)}[data-state="answered"]`).waitFor();
  const retried = await ask('answer', { decision_id: escalation.decision_id });
  check(retried.option_id === 'retry' && retried.guidance === 'Write TOTAL first.' && retried.confidence_boost === 0.1,
    `the escalation's record holds ${JSON.stringify(retried)}`);

  // ---- request view: reachable from the request id on the card ----
  await decided.locator(`a[data-request-link="${decision.request_id}"]`).first().click();
  await page.waitForURL(`**/#/request/${decision.request_id}`);
  const view = page.locator(`.follow[data-request-id="${decision.request_id}"][data-state="COMPLETED"]`);
  await view.waitFor();
  await view.locator('.act-tool_call').first().waitFor({ state: 'attached' });
  const viewText = await view.textContent();
  for (const needle of ['decision_requested', 'calculate', '7006652', 'Continued as', 'Transcript']) {
    check(viewText.includes(needle), `the request view does not show ${JSON.stringify(needle)}`);
  }
  // Its timeline: the turns, the tool call, the decision asked and answered, the continuation.
  const timeline = view.locator('ol.timeline');
  for (const kind of ['started', 'turn', 'tool_call', 'tool_result', 'decision', 'answered', 'finished']) {
    await timeline.locator(`li[data-kind="${kind}"]`).first().waitFor();
  }
  await timeline.locator(`li[data-kind="answered"] a[data-request-link="${answer.continuation_request_id}"]`).waitFor();
  check((await timeline.locator('li[data-kind="tool_call"]').first().textContent()).includes('calculate'), 'the timeline does not name the tool');
  check((await textOf(page, '[data-field="timeline-note"]')).includes('pool default'), 'the timeline does not name the pool');
  await page.screenshot({ path: path.join(shots, 'request.png'), fullPage: true });
  await checkTimes(page, 'the request view');

  // ---- request view: an id the fleet does not know, and one that is not an id ----
  const unknownId = freshId('never');
  await page.goto(`${url}/#/request/${unknownId}`);
  const unknown = page.locator(`.follow[data-request-id="${unknownId}"]`);
  await unknown.locator('[data-field="notice"]', { hasText: 'is not known to the fleet' }).waitFor();
  check((await unknown.getAttribute('data-state')) === 'UNKNOWN', 'an unknown request is not in the state UNKNOWN');
  await page.goto(`${url}/#/request/not.an.id`);
  const invalid = page.locator('.follow[data-request-id="not.an.id"]');
  await invalid.locator('[data-field="notice"]', { hasText: 'is not a valid request id' }).waitFor();
  check((await invalid.getAttribute('data-state')) === 'INVALID', 'a malformed id is not in the state INVALID');

  // ---- fleet: the slot counts change while a slow request runs ----
  await page.goto(`${url}/#/fleet`);
  await page.locator('#fleet-busy', { hasText: /^0$/ }).waitFor();
  check((await textOf(page, '#fleet-slots')) === '2', 'the fleet does not show the worker\'s 2 slots');
  // Followed live in a second tab opened before the request exists: the page says the fleet
  // does not know it, then, once it starts, shows it running and its result, without a reload.
  const slowId = freshId('slow');
  const live = await context.newPage();
  live.on('pageerror', (e) => errors.push(e.message));
  await live.goto(`${url}/#/request/${slowId}`);
  const notice = live.locator('[data-field="notice"]', { hasText: 'is not known to the fleet' });
  await notice.waitFor();
  const slow = await ask('slow', { request_id: slowId });
  await page.locator('#fleet-busy', { hasText: /^1$/ }).waitFor();
  await page.locator(`tr[data-worker-id] td[data-field="busy"]`, { hasText: /^1$/ }).waitFor();
  await page.locator(`tr[data-running="${slow.request_id}"]`).waitFor();
  // The pool's sparklines: the requests finished so far, and their latency.
  await page.locator('tr[data-series-pool="default"] td[data-field="finished"]', { hasText: /^[1-9]/ }).waitFor();
  const spark = page.locator('svg[data-sparkline="throughput"][data-pool="default"]');
  check(await spark.locator('polyline').count() === 1, 'the throughput sparkline has no line');
  check((await spark.locator('title').textContent()).includes('requests finished in pool default'), 'the throughput sparkline says nothing');
  const latency = page.locator('svg[data-sparkline="latency"][data-pool="default"]');
  check(Number(await latency.getAttribute('data-points')) >= 1, 'the latency sparkline has no point');
  check(/\d+ ms/.test(await textOf(page, 'tr[data-series-pool="default"] td[data-field="latency"]')), 'the mean latency is not shown');
  await page.screenshot({ path: path.join(shots, 'fleet.png'), fullPage: true });
  check(await checkTimes(page, 'the fleet') >= 3, 'the fleet shows fewer than 3 times');
  await live.locator(`.follow[data-state="RUNNING"] [data-field="output"]`, { hasText: /[a-z]+/ }).waitFor();
  check(await notice.count() === 0, 'the running request still says the fleet does not know it');
  await page.locator('#fleet-busy', { hasText: /^0$/ }).waitFor();
  const done = live.locator('.follow[data-state="COMPLETED"]');
  await done.waitFor();
  check(await notice.count() === 0, 'the finished request still says the fleet does not know it');
  const doneLine = await done.locator('[data-field="result"]').textContent();
  check(doneLine.includes('COMPLETED') && doneLine.includes('stop'), `the followed request's result line is ${doneLine}`);
  check((await done.locator('[data-field="output"]').textContent()).includes('thirty'), 'the followed request\'s output is not whole');
  check(await checkTimes(live, 'the followed request') >= 1, 'the followed request shows no time');
  await live.close();

  // ---- a failure in sight: listed with why, raised as a signal, and its page after the
  // caller read (so released) the result ----
  const failed = await ask('failed');
  const failedRow = page.locator('tr', { has: page.locator(`a[data-request-link="${failed.request_id}"]`) });
  await failedRow.locator('[data-field="detail"]', { hasText: 'the model ran out of memory' }).waitFor();
  check((await failedRow.textContent()).includes('backend_error'), 'the failed row does not name its reason');
  await failedRow.locator(`a[data-request-link="${failed.request_id}"]`).click();
  const failedView = page.locator(`.follow[data-request-id="${failed.request_id}"][data-state="FAILED"]`);
  await failedView.waitFor();
  const failedLine = await failedView.locator('[data-field="result"]').textContent();
  check(failedLine.includes('backend_error') && failedLine.includes('the model ran out of memory'),
    `the failed request's result line is ${failedLine}`);
  const kept = await failedView.locator('[data-field="summary"]').textContent();
  check(kept.includes('Fail loudly, please.'), `the failed request's summary is ${kept}`);
  await failedView.locator('[data-field="notice"]', { hasText: 'summary kept for people' }).waitFor();
  await checkTimes(page, 'the failed request');

  // ---- a request's page loads whole every time: its result read by its caller, and not ----
  // A tenant's requests: their ids are acme.<id>, a dot in the address and the API's paths.
  // Each load opens the request's stream once, and the live stream's snapshot (which signs
  // the page in again) leaves the request shown as it is.
  for (const read of [true, false]) {
    const { request_id: id } = await ask('hello', { read });
    check(id.startsWith('acme.'), `a tenant's request is ${id}, not acme.<id>`);
    const streamPath = `/api/requests/${encodeURIComponent(id)}/stream`;
    let streams = 0;
    const counting = (request) => { if (new URL(request.url()).pathname === streamPath) streams += 1; };
    page.on('request', counting);
    for (let load = 0; load < 20; load += 1) {
      streams = 0;
      if (load === 0) await page.goto(`${url}/#/request/${encodeURIComponent(id)}`);
      else await page.reload();
      const where = `load ${load + 1} of the page of ${id} (result ${read ? 'read' : 'not read'})`;
      await page.locator('#signed-in-as').waitFor();
      const view = page.locator(`.follow[data-request-id="${id}"][data-state="COMPLETED"]`);
      await view.locator('[data-field="result"]', { hasText: 'COMPLETED stop' }).waitFor();
      await view.locator('[data-field="output"]', { hasText: 'Hello from the fleet.' }).waitFor();
      if (read) {
        await view.locator('[data-field="summary"]', { hasText: 'Say hello.' }).waitFor();
        await view.locator('[data-field="notice"]', { hasText: 'summary kept for people' }).waitFor();
      } else {
        await view.locator('details.transcript').waitFor();
        check(await view.locator('[data-field="notice"]:not([hidden])').count() === 0,
          `${where}: a notice stays: ${await textOf(page, '[data-field="notice"]')}`);
      }
      check(await page.locator('[data-notice="asking"]').count() === 0, `${where}: it still says it is asking the fleet`);
      check(await page.locator('.follow').count() === 1, `${where}: the page shows ${await page.locator('.follow').count()} requests`);
      check(streams === 1, `${where}: the page opened the request's stream ${streams} times`);
    }
    page.off('request', counting);
  }

  // ---- requests: the list, filtered by state, tenant, job and pool, and searched by id ----
  await page.goto(`${url}/#/requests`);
  const failedListed = page.locator(`tr[data-request-row="${failed.request_id}"][data-state="FAILED"]`);
  await failedListed.waitFor();
  await page.locator(`tr[data-request-row="${decision.request_id}"][data-state="COMPLETED"]`).waitFor();
  await page.locator(`tr[data-request-row="${answer.continuation_request_id}"]`).waitFor();
  const everyRow = await page.locator('tr[data-request-row]').count();
  check(everyRow >= 5, `only ${everyRow} requests listed`);
  check((await failedListed.locator('[data-field="tenant"]').textContent()) === 'acme', 'the failed request\'s tenant is not shown');
  check((await failedListed.locator('[data-field="job"]').textContent()) === 'doomed', 'the failed request\'s job is not shown');
  check((await failedListed.locator('[data-field="pool"]').textContent()) === 'default', 'the failed request\'s pool is not shown');
  check(await checkTimes(page, 'the requests list') >= 5, 'the requests list shows fewer than 5 times');
  await page.screenshot({ path: path.join(shots, 'requests.png'), fullPage: true });
  await page.selectOption('#request-filters select[data-filter="state"]', 'FAILED');
  await page.waitForFunction(() => {
    const rows = [...document.querySelectorAll('tr[data-request-row]')];
    return rows.length > 0 && rows.every((r) => r.dataset.state === 'FAILED');
  });
  check(page.url().includes('state=FAILED'), 'the state filter is not in the address');
  await page.fill('#request-filters input[data-filter="tenant"]', 'acme');
  await page.waitForFunction((id) => {
    const rows = [...document.querySelectorAll('tr[data-request-row]')];
    return rows.length === 1 && rows[0].dataset.requestRow === id;
  }, failed.request_id);
  await page.fill('#request-filters input[data-filter="job"]', 'no-such-job');
  await page.locator('#request-list td', { hasText: 'No request matches.' }).waitFor();
  await page.click('#request-filters button[type="reset"]');
  await page.waitForFunction((n) => document.querySelectorAll('tr[data-request-row]').length >= n, everyRow);
  await page.fill('#request-filters input[data-filter="job"]', 'console-report');
  await page.waitForFunction(() => {
    const rows = [...document.querySelectorAll('tr[data-request-row]')];
    return rows.length > 0 && rows.every((r) => r.querySelector('[data-field="job"]').textContent === 'console-report');
  });
  await page.click('#request-filters button[type="reset"]');
  // The search: a part of the id finds the one request, Enter opens its page.
  await page.fill('#request-search', failed.request_id.slice(-8));
  await page.waitForFunction((id) => {
    const rows = [...document.querySelectorAll('tr[data-request-row]')];
    return rows.length === 1 && rows[0].dataset.requestRow === id;
  }, failed.request_id);
  await page.press('#request-search', 'Enter');
  await page.waitForURL(`**/#/request/${failed.request_id}`);
  await page.locator(`.follow[data-request-id="${failed.request_id}"] ol.timeline li[data-kind="finished"]`).waitFor();

  // ---- cancel a running request from its page ----
  const long = await ask('long');
  await page.goto(`${url}/#/request/${long.request_id}`);
  const longView = page.locator(`.follow[data-request-id="${long.request_id}"]`);
  await longView.locator('ol.timeline li[data-kind="started"]').waitFor();
  // It runs for a minute: cancelled once the model's turn shows.
  await longView.locator('ol.timeline li[data-kind="turn"]').waitFor();
  await longView.locator('button[data-action="cancel"]:not([disabled])').click();
  const cancelled = longView.locator('[data-field="cancel-status"]');
  await cancelled.waitFor();
  const cancelText = await cancelled.textContent();
  check(cancelText.includes('CANCELLED') && cancelText.includes('human:ann'), `the cancel's reply reads ${cancelText}`);
  await page.locator(`.follow[data-request-id="${long.request_id}"][data-state="CANCELLED"]`).waitFor();
  await longView.locator('ol.timeline li[data-kind="cancel"]').waitFor();
  await longView.locator('ol.timeline li[data-kind="finished"]', { hasText: 'CANCELLED' }).waitFor();
  check(await longView.locator('button[data-action="cancel"]').count() === 0, 'a cancelled request still offers to cancel');
  await page.screenshot({ path: path.join(shots, 'request-cancelled.png'), fullPage: true });
  await checkTimes(page, 'the cancelled request');

  // ---- a console started after the requests it shows: their timelines say they are partial ----
  const late = await ask('late_console');
  const lateTab = await context.newPage();
  lateTab.on('pageerror', (e) => errors.push(e.message));
  for (const [id, what] of [[late.read_id, 'the read request'], [late.running_id, 'the running request']]) {
    await lateTab.goto(`${late.url}/#/request/${encodeURIComponent(id)}`);
    const view = lateTab.locator(`.follow[data-request-id="${id}"]`);
    const note = view.locator('[data-field="timeline-note"][data-partial="true"]');
    await note.locator('[data-field="timeline-partial"]').waitFor();
    const text = await note.textContent();
    check(text.includes('Partial timeline') && text.includes('saw only part of this request\'s events'),
      `the late console's timeline of ${what} does not say it is partial: ${text}`);
    check(!/\b0 model turns\b|\b0 tool calls\b/.test(text), `the late console claims no turns or tool calls for ${what}: ${text}`);
  }
  // The read one ran a tool: its summary says so, its timeline does not claim otherwise.
  await lateTab.goto(`${late.url}/#/request/${encodeURIComponent(late.read_id)}`);
  await lateTab.locator(`.follow[data-request-id="${late.read_id}"] [data-field="summary"]`, { hasText: 'Tool iterations used1' }).waitFor();
  await lateTab.goto(`${late.url}/#/requests`);
  for (const id of [late.read_id, late.running_id]) {
    await lateTab.locator(`tr[data-request-row="${id}"] td[data-field="counts"][data-partial="true"]`, { hasText: 'partial' }).waitFor();
  }
  check((await lateTab.locator(`tr[data-request-row="${late.running_id}"] [data-field="tenant"]`).textContent()) === 'globex',
    'the running request\'s tenant is not the one of its id');
  await lateTab.close();
  const stopped = await ask('cancel', { request_id: late.running_id });
  check(stopped.state === 'CANCELLED', `the running request was not cancelled: ${JSON.stringify(stopped)}`);

  // ---- signals: the live feed, filtered ----
  await page.goto(`${url}/#/signals`);
  await page.locator('li.signal[data-type="outcome"]').first().waitFor();
  const failure = page.locator('li.signal[data-code="FAILED"]', { hasText: failed.request_id });
  await failure.waitFor();
  check((await failure.textContent()).includes('the model ran out of memory'), 'the failure signal does not say why');
  const all = await page.locator('li.signal').count();
  check(all >= 4, `only ${all} signals in the feed`);
  await page.screenshot({ path: path.join(shots, 'signals.png'), fullPage: true });
  check(await checkTimes(page, 'the signal feed') >= 4, 'the signal feed shows fewer than 4 times');
  await page.selectOption('select[data-filter="type"]', 'outcome');
  await page.waitForFunction(() => [...document.querySelectorAll('li.signal')].every((li) => li.dataset.type === 'outcome'));
  const outcomes = await page.locator('li.signal').count();
  check(outcomes >= 2 && outcomes < all, `the outcome filter shows ${outcomes} of ${all}`);
  check(page.url().includes('type=outcome'), 'the filter is not in the address');
  await page.fill('input[data-filter="code"]', 'SKIPPED');
  await page.waitForFunction(() => document.querySelectorAll('li.signal').length === 0);
  await page.click('button[type="reset"]');
  await page.waitForFunction((n) => document.querySelectorAll('li.signal').length === n, all);

  // ---- the gateway's batches, with their progress, read again while the view is shown ----
  const batch = await ask('batch');
  await page.click('nav a[data-view="batches"]');
  const batchRow = page.locator(`tr[data-batch-row="${batch.id}"]`);
  await batchRow.waitFor();
  const batchText = await batchRow.textContent();
  for (const needle of ['acme', 'in_progress', '/v1/chat/completions', '1 completed, 1 failed of 3', 'gw-browser']) {
    check(batchText.includes(needle), `the batch row does not show ${JSON.stringify(needle)}: ${batchText}`);
  }
  const bar = await batchRow.locator('progress').evaluate((p) => [p.value, p.max]);
  check(bar[0] === 2 && bar[1] === 3, `the batch's progress bar is ${JSON.stringify(bar)}`);
  await checkTimes(page, 'the batches list');
  await page.screenshot({ path: path.join(shots, 'batches.png'), fullPage: false });
  await ask('batch', { id: batch.id });
  await page.locator(`tr[data-batch-row="${batch.id}"][data-status="completed"]`, { hasText: '2 completed, 1 failed of 3' }).waitFor();

  // ---- a narrow screen, answered by keyboard ----
  const phone = await browser.newContext({ viewport: { width: 390, height: 844 }, isMobile: true, hasTouch: true });
  phone.setDefaultTimeout(20000);
  const small = await phone.newPage();
  small.on('pageerror', (e) => errors.push(e.message));
  await small.goto(`${url}/#/inbox`);
  await signIn(small, 'bo');
  const second = await ask('decision');
  const narrow = small.locator(`${card(second.decision_id)}[data-state="pending"]`);
  await narrow.waitFor();
  await noHorizontalScroll(small, 390);
  const box = await narrow.locator('button[data-option-id="archive"]').boundingBox();
  check(box && box.x >= 0 && box.x + box.width <= 390, `the option button is off screen: ${JSON.stringify(box)}`);
  await narrow.locator('.options').scrollIntoViewIfNeeded();
  await small.screenshot({ path: path.join(shots, 'inbox-narrow.png'), fullPage: false });
  await narrow.locator('button[data-option-id="archive"]').focus();
  await small.keyboard.press('Enter');
  await small.locator(`${card(second.decision_id)}[data-state="answered"] .follow[data-state="COMPLETED"]`).waitFor();
  const archived = await ask('answer', { decision_id: second.decision_id });
  check(archived.option_id === 'archive' && archived.decided_by === 'human:bo', `the record holds ${JSON.stringify(archived)}`);
  await small.goto(`${url}/#/signals`);
  await small.locator('li.signal').first().waitFor();
  await noHorizontalScroll(small, 390);
  await checkTimes(small, 'the narrow signal feed');
  // The fleet's tables, full (a worker, a running request, finished ones), fit the screen.
  const narrowSlow = await ask('slow');
  await small.goto(`${url}/#/fleet`);
  await small.locator(`tr[data-running="${narrowSlow.request_id}"]`).waitFor();
  await small.locator('tr[data-worker-id]').first().waitFor();
  await small.locator('#fleet-busy', { hasText: /^1$/ }).waitFor();
  await noHorizontalScroll(small, 390);
  await small.screenshot({ path: path.join(shots, 'fleet-narrow.png'), fullPage: true });
  // Not only the page: each table fits, with no sideways scrolling inside its box either.
  const tables = await small.evaluate(() => [...document.querySelectorAll('main table')].map((t) => ({
    caption: t.caption ? t.caption.textContent : '?',
    right: Math.round(t.getBoundingClientRect().right),
    inside: t.parentElement.scrollWidth - t.parentElement.clientWidth,
    rows: t.tBodies[0].rows.length,
  })));
  check(tables.length === 6 && tables.every((t) => t.rows > 0), `the narrow fleet view has the tables ${JSON.stringify(tables)}`);
  for (const t of tables) {
    check(t.right <= 390, `the table ${t.caption} reaches ${t.right}px on a 390px screen`);
    check(t.inside <= 0, `the table ${t.caption} scrolls ${t.inside}px sideways in its box`);
  }
  await checkTimes(small, 'the narrow fleet view');
  await small.goto(`${url}/#/requests`);
  await small.locator('tr[data-request-row]').first().waitFor();
  await noHorizontalScroll(small, 390);
  await checkTimes(small, 'the narrow requests list');
  await small.screenshot({ path: path.join(shots, 'requests-narrow.png'), fullPage: false });
  await small.goto(`${url}/#/fleet`);
  await small.locator('#fleet-busy', { hasText: /^0$/ }).waitFor();
  await phone.close();

  // ---- a read-only console refuses to answer ----
  const third = await ask('decision');
  const ro = await context.newPage();
  ro.on('pageerror', (e) => errors.push(e.message));
  await ro.goto(`${readOnlyUrl}/#/inbox`);
  const roCard = ro.locator(`${card(third.decision_id)}[data-state="pending"]`);
  await roCard.waitFor();
  check((await textOf(ro, '#session')).includes('Read-only'), 'the read-only console does not say so');
  check(await roCard.locator('button.option:not([disabled])').count() === 0, 'the read-only console offers enabled options');
  check((await roCard.locator('.signin-note').textContent()).includes('read-only'), 'the card does not say why it cannot be answered');
  const refused = await ro.evaluate(async ({ id, token }) => {
    const response = await fetch(`/api/decisions/${id}`, {
      method: 'POST',
      headers: { 'Content-Type': 'application/json', 'X-Genfleet-Token': token },
      body: JSON.stringify({ user: 'mallory', option_id: 'email' }),
    });
    return { status: response.status, body: await response.json() };
  }, { id: third.decision_id, token });
  check(refused.status === 403 && refused.body.error.code === 'UNAUTHORIZED', `the read-only console answered ${JSON.stringify(refused)}`);
  const noCancel = await ro.evaluate(async ({ id, token }) => {
    const response = await fetch(`/api/requests/${id}/cancel`, {
      method: 'POST',
      headers: { 'Content-Type': 'application/json', 'X-Genfleet-Token': token },
      body: JSON.stringify({ user: 'mallory' }),
    });
    return { status: response.status, body: await response.json() };
  }, { id: third.request_id, token });
  check(noCancel.status === 403 && noCancel.body.error.code === 'UNAUTHORIZED', `the read-only console cancelled: ${JSON.stringify(noCancel)}`);
  const still = await ask('pending', { decision_id: third.decision_id });
  check(still.pending === true, 'the decision was answered through the read-only console');
  await ro.close();

  check(errors.length === 0, `the page raised errors: ${errors.join('; ')}`);
  process.stdout.write('DONE\n');
} catch (error) {
  process.stderr.write(`${error.stack || error}\n`);
  process.exitCode = 1;
} finally {
  // Stdin stays open, so the script ends itself; a browser slow to close does not hold it.
  await Promise.race([browser.close(), new Promise((resolve) => setTimeout(resolve, 5000))]);
  process.exit();
}
