"""Checks the genfleet Python package as a tenant's client (tests/python_client.rs runs it).

Usage: check_tenant.py NATS_URL

Expects one worker of pool `default` with 2 slots, backed by the mock LLM of
tests/data/openai_compat.toml, on a nats-server with two users:

- `acme` (password `acpass`), allowed only tenant acme's subjects: publish
  `gen.submit.*.acme`, `gen.queue.*.*.acme.*`, `gen.status.acme.*`, `gen.result.acme.*`,
  `gen.cancel.acme.*`; subscribe `gen.events.acme.*` and its own replies, `_INBOX_acme.>`;
- `worker` (password `wpass`), allowed everything (the worker, and here a default-tenant caller).

Exits non-zero with a message on the first failed check.
"""

import asyncio
import logging
import sys

import nats

import genfleet
from genfleet import GenfleetError

ACME = {"user": "acme", "password": "acpass", "tenant": "acme", "inbox_prefix": "_INBOX_acme"}
DEFAULT = {"user": "worker", "password": "wpass"}


def check(cond, what):
    if not cond:
        raise AssertionError(what)


async def check_interactive(acme):
    request = genfleet.request("From acme", request_id="same-id", job_name="py-tenant")
    events = [e async for e in acme.stream(request)]
    kinds = [e["event"] for e in events]
    # Deltas come only through the subscription (a missed `finished` is made up from the
    # result): the tenant's events reached it on gen.events.acme.<id>.
    check(kinds[0] == "started" and "delta" in kinds and kinds[-1] == "finished", f"{kinds}")
    result = events[-1]["result"]
    check(events[-1]["request_id"] == "acme.same-id", f"{events[-1]}")
    check(result["request_id"] == "acme.same-id", f"the result's id: {result['request_id']}")
    check(result["output"] == "Hello from the mock, From acme!", f"{result['output']}")
    for name in ("same-id", "acme.same-id"):
        status = await acme.status(name)
        check(status["request_id"] == "acme.same-id" and status["state"] == "COMPLETED", f"{status}")
    read = await acme.result("same-id")
    check(read["output"] == result["output"], f"{read}")
    try:
        await acme.result("acme.same-id")
    except GenfleetError as error:
        check(error.code == "NOT_FOUND", f"{error}")
    else:
        raise AssertionError("a tenant's result was read twice")

    accepted = await acme.submit(genfleet.request("Submitted by acme"))
    check(accepted["request_id"].startswith("acme."), f"the submit's reply: {accepted}")
    done = await acme.wait_result(accepted["request_id"])
    check(done["output"] == "Hello from the mock, Submitted by acme!", f"{done}")
    print("ok: a tenant's interactive requests, events, status and results under acme.<id>")


async def check_same_id_in_the_default_tenant(acme, url):
    async with await genfleet.Client.connect(url, timeout=5.0, **DEFAULT) as default:
        mine = await default.run(genfleet.request("From the default tenant", request_id="same-id"))
        check(mine["request_id"] == "same-id", f"{mine['request_id']}")
        check(mine["output"] == "Hello from the mock, From the default tenant!", f"{mine['output']}")
    status = await acme.status("same-id")
    check(status["finished"]["prompt_start"] == "From acme", f"acme's same-id: {status}")
    print("ok: the same id in the default tenant is another request")


async def check_durable(acme):
    done = await acme.run(genfleet.request("Urgent from acme", priority="high"), durable=True)
    check(done["state"] == "COMPLETED", f"{done}")
    check(done["request_id"].startswith("acme."), f"{done['request_id']}")
    check(done["output"] == "Hello from the mock, Urgent from acme!", f"{done['output']}")
    for band in ("normal", "low"):
        request = genfleet.request(f"Queued by acme ({band})", priority=band)
        queued = await acme.enqueue(request)
        check(queued == f"acme.{request['request_id']}", f"enqueue returned {queued}")
        done = await acme.wait_result(request["request_id"], wait=30)
        check(done["output"] == f"Hello from the mock, Queued by acme ({band})!", f"{done}")
    print("ok: a tenant's durable requests in the high, normal and low bands")


async def check_cancel(acme):
    request = genfleet.request("py-slow: take your time")
    async for event in acme.stream(request):
        if event["event"] == "delta":
            reply = await acme.cancel(request["request_id"])
            check(reply["state"] == "CANCELLED", f"{reply}")
        if event["event"] == "finished":
            check(event["result"]["state"] == "CANCELLED", f"{event['result']['state']}")
    print("ok: a tenant's streamed request cancelled by its bare id")


class Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records = []

    def emit(self, record):
        self.records.append(record)


async def check_keyed_without_heartbeats(url):
    """A tenant's user may not read the workers' heartbeats: its keyed submits go to the pool
    (whose worker places them), and the client says so once, at debug level."""
    records = Records()
    logger = logging.getLogger("genfleet")
    level = logger.level
    logger.setLevel(logging.DEBUG)
    logger.addHandler(records)
    try:
        async with await genfleet.Client.connect(url, timeout=10.0, **ACME) as acme:
            for turn in (1, 2):
                result = await acme.run(genfleet.request(f"Keyed by acme, turn {turn}", affinity_key="acme-chat"))
                check(result["state"] == "COMPLETED", f"{result}")
                # The pool's worker that received it placed it on the key's worker.
                expected = {"key": "acme-chat", "preferred_worker": result["worker_id"], "held": True}
                check(result["affinity"] == expected, f"{result['affinity']}")
            check(not await acme.placement_ready(wait=30.0), "a tenant's user followed the heartbeats")
            check(acme._heartbeats.state == "unavailable", f"{acme._heartbeats.state}")
    finally:
        logger.removeHandler(records)
        logger.setLevel(level)
    said = [(r.levelname, r.getMessage()) for r in records.records]
    check(
        len(said) == 1 and said[0][0] == "DEBUG" and "not following the workers' heartbeats" in said[0][1],
        f"logged: {said}",
    )
    # A connection opened by the caller and wrapped: the refusal reaches the caller's own
    # error_cb, and the client gives up after its timeout.
    heard = []

    async def error_cb(error):
        heard.append(str(error))

    nc = await nats.connect(url, user=ACME["user"], password=ACME["password"], inbox_prefix=ACME["inbox_prefix"], error_cb=error_cb)
    try:
        acme = genfleet.Client(nc, tenant="acme", timeout=2.0)
        result = await acme.run(genfleet.request("Keyed by acme, wrapped", affinity_key="acme-chat"))
        # The pool's worker that received it placed it on the key's worker.
        expected = {"key": "acme-chat", "preferred_worker": result["worker_id"], "held": True}
        check(result["affinity"] == expected, f"{result['affinity']}")
        check(not await acme.placement_ready(wait=30.0), "a tenant's user followed the heartbeats")
        check(acme._heartbeats.state == "unavailable", f"{acme._heartbeats.state}")
        await acme.close()
    finally:
        await nc.drain()
    check(any("permissions violation" in h.lower() and "genfleet_workers" in h.lower() for h in heard), f"heard: {heard}")
    print("ok: a tenant's keyed submits go to the pool; the heartbeats it may not read cost one debug line (a wrapped connection hears the refusal itself)")


async def check_refusals(acme, url):
    try:
        await acme.status("bob.same-id")
    except ValueError as error:
        check("tenant 'bob'" in str(error), str(error))
    else:
        raise AssertionError("acme's client asked for bob's request")
    try:
        await genfleet.Client.connect(url, tenant="acme corp")
    except ValueError as error:
        check("tenant='acme corp'" in str(error), str(error))
    else:
        raise AssertionError("a tenant with a space was taken")
    # Without its own reply prefix the tenant's user hears no reply: the server refuses it
    # `_INBOX.>`.
    options = dict(ACME, inbox_prefix=None)
    async with await genfleet.Client.connect(url, timeout=1.0, **options) as plain:
        try:
            await plain.status("same-id")
        except GenfleetError as error:
            check(error.code == "TIMEOUT", f"{error}")
        else:
            raise AssertionError("a reply reached _INBOX for a user allowed only _INBOX_acme")
    print("ok: another tenant's ids refused before sending; replies need the tenant's inbox prefix")


async def main(url):
    async with await genfleet.Client.connect(url, timeout=10.0, **ACME) as acme:
        check(acme.tenant == "acme", f"{acme.tenant}")
        check(acme.nc.new_inbox().startswith("_INBOX_acme."), acme.nc.new_inbox())
        await check_interactive(acme)
        await check_same_id_in_the_default_tenant(acme, url)
        await check_durable(acme)
        await check_cancel(acme)
        await check_refusals(acme, url)
    await check_keyed_without_heartbeats(url)
    print("python tenant client: all checks passed")


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
