"""A small Python client of genfleet's wire protocol (docs/protocol.md), run as a check.

Usage: fleet_client.py NATS_URL

Expects a running fleet: one worker of pool `default` with 2 slots, backed by the mock LLM of
tests/data/openai_compat.toml, which replies "Hello from the mock, <last user message>!".
Written from docs/protocol.md alone, with nats-py and msgpack: submit and follow the events,
status, result (peek, release, then NOT_FOUND), error replies, MessagePack, the durable queue,
cancel and the NATS service API. Exits non-zero with a message on the first failed check.
"""

import asyncio
import json
import sys
import uuid

import msgpack
import nats
from nats.errors import NoRespondersError

POOL = "default"
TIMEOUT = 10.0
MSGPACK = {"Content-Type": "application/msgpack"}


def check(cond, what):
    if not cond:
        raise AssertionError(what)


def new_id(prefix):
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


def expected_output(prompt):
    return f"Hello from the mock, {prompt}!"


def gen_request(request_id, prompt):
    return {"request_id": request_id, "messages": [{"role": "user", "content": prompt}]}


async def call(nc, subject, body=None, packed=False):
    """Request-reply in JSON (or MessagePack); returns the decoded reply and its headers."""
    if packed:
        msg = await nc.request(subject, msgpack.packb(body), timeout=TIMEOUT, headers=MSGPACK)
        return msgpack.unpackb(msg.data), msg.headers or {}
    payload = b"" if body is None else json.dumps(body).encode()
    msg = await nc.request(subject, payload, timeout=TIMEOUT)
    return json.loads(msg.data), msg.headers or {}


def error_code(reply):
    """The `code` of an error reply, else None; checks the documented error shape."""
    if not isinstance(reply, dict) or "error" not in reply:
        return None
    err = reply["error"]
    check(isinstance(err.get("code"), str), f"error without a code: {reply}")
    check(isinstance(err.get("message"), str), f"error without a message: {reply}")
    check(isinstance(err.get("detail", {}), dict), f"error detail not an object: {reply}")
    return err["code"]


async def submit(nc, request, packed=False):
    """gen.submit.<pool>, retrying NO_SLOT_AVAILABLE a few times as the docs advise."""
    for attempt in range(5):
        try:
            reply, _ = await call(nc, f"gen.submit.{POOL}", request, packed)
        except NoRespondersError:
            reply = {"error": {"code": "NO_SLOT_AVAILABLE", "message": "no responders"}}
        if error_code(reply) != "NO_SLOT_AVAILABLE":
            return reply
        await asyncio.sleep(0.1 * (attempt + 1))
    raise AssertionError(f"no slot for {request['request_id']}: {reply}")


async def wait_result(nc, request_id, packed=False):
    """Polls gen.result (peek) until the result is there (NOT_READY/NOT_FOUND mean wait)."""
    for _ in range(200):
        reply, _ = await call(nc, f"gen.result.{request_id}", {"release": False}, packed)
        if error_code(reply) not in ("NOT_READY", "NOT_FOUND"):
            check(error_code(reply) is None, f"result of {request_id}: {reply}")
            return reply
        await asyncio.sleep(0.05)
    raise AssertionError(f"{request_id} never finished")


async def release(nc, request_id, packed=False):
    """Reads and releases the result; the next read must get NOT_FOUND."""
    reply, _ = await call(nc, f"gen.result.{request_id}", {} if packed else None, packed)
    check(error_code(reply) is None, f"release of {request_id}: {reply}")
    again, _ = await call(nc, f"gen.result.{request_id}", {} if packed else None, packed)
    check(error_code(again) == "NOT_FOUND", f"{request_id} read twice: {again}")
    return reply


async def check_submit_events_status_result(nc):
    request_id, prompt = new_id("py-submit"), "Greetings from Python"
    events = []
    finished = asyncio.get_running_loop().create_future()

    async def on_event(msg):
        event = json.loads(msg.data)
        events.append(event)
        if event["event"] == "finished" and not finished.done():
            finished.set_result(event)

    sub = await nc.subscribe(f"gen.events.{request_id}", cb=on_event)
    await nc.flush()  # the subscription is on the server before the submit
    accepted = await submit(nc, gen_request(request_id, prompt))
    check(error_code(accepted) is None, f"submit refused: {accepted}")
    check(accepted["request_id"] == request_id, f"accepted another id: {accepted}")
    check(accepted["state"] == "RUNNING", f"accepted state: {accepted}")
    worker_id = accepted["worker_id"]
    done = await asyncio.wait_for(finished, TIMEOUT)
    await sub.unsubscribe()

    seqs = [e["seq"] for e in events]
    check(seqs == list(range(len(events))), f"seq not gapless from 0: {seqs}")
    check(events[0]["event"] == "started", f"first event: {events[0]}")
    check(events[0]["worker_id"] == worker_id, f"started by another worker: {events[0]}")
    check(all(e["request_id"] == request_id and "ts" in e for e in events), "event envelope")
    result = done["result"]
    joined = "".join(e["text"] for e in events if e["event"] == "delta")
    check(result["state"] == "COMPLETED" and result["reason"] == "stop", f"result: {result}")
    check(result["output"] == expected_output(prompt), f"output: {result['output']!r}")
    check(joined == result["output"], f"deltas {joined!r} != output {result['output']!r}")

    status, _ = await call(nc, f"gen.status.{request_id}")
    check(status.get("state") == "COMPLETED", f"status: {status}")
    check(status.get("worker_id") == worker_id, f"status worker: {status}")
    check(status.get("attempt") == 1, f"status attempt: {status}")

    peek, _ = await call(nc, f"gen.result.{request_id}", {"release": False})
    check(peek == result, f"peek differs from the finished event's result: {peek}")
    read = await release(nc, request_id)
    check(read == peek, "the released result differs from the peek")
    print(f"ok: submit, {len(events)} events, status, peek, release ({request_id})")


async def check_invalid_request(nc):
    request = gen_request(new_id("py-invalid"), "hi")
    request["temprature"] = 0.5  # the typo the protocol must not let pass
    reply = await submit(nc, request)
    check(error_code(reply) == "INVALID_REQUEST", f"unknown field accepted: {reply}")
    check("temprature" in json.dumps(reply["error"]), f"the field is not named: {reply}")
    # The service error headers ride along.
    msg = await nc.request(f"gen.submit.{POOL}", json.dumps(request).encode(), timeout=TIMEOUT)
    headers = msg.headers or {}
    check(headers.get("Nats-Service-Error-Code", "").isdigit(), f"error headers: {headers}")
    check(headers.get("Nats-Service-Error"), f"no Nats-Service-Error header: {headers}")
    print("ok: unknown field -> INVALID_REQUEST")


async def check_msgpack(nc):
    request_id, prompt = new_id("py-packed"), "packed greetings"
    accepted = await submit(nc, gen_request(request_id, prompt), packed=True)
    check(error_code(accepted) is None, f"msgpack submit refused: {accepted}")
    check(accepted["request_id"] == request_id, f"msgpack accepted: {accepted}")
    result = await wait_result(nc, request_id, packed=True)
    check(result["output"] == expected_output(prompt), f"msgpack output: {result}")
    await release(nc, request_id, packed=True)
    print("ok: MessagePack submit and result")


async def check_durable_queue(nc):
    request_id, prompt = new_id("py-queued"), "queued greetings"
    js = nc.jetstream()
    body = json.dumps(gen_request(request_id, prompt)).encode()
    headers = {"Nats-Msg-Id": request_id}
    ack = await js.publish(f"gen.queue.{POOL}.{request_id}", body, headers=headers)
    check(ack.stream == "GENFLEET_QUEUE", f"stored by stream {ack.stream}")
    again = await js.publish(f"gen.queue.{POOL}.{request_id}", body, headers=headers)
    check(again.duplicate, f"the second publish was not deduplicated: {again}")
    result = await wait_result(nc, request_id)
    check(result["state"] == "COMPLETED", f"queued result: {result}")
    check(result["output"] == expected_output(prompt), f"queued output: {result}")
    check(result["attempt"] == 1, f"queued attempt: {result}")
    await release(nc, request_id)
    print("ok: durable queue (deduplicated) and result")


async def check_cancel_unknown(nc):
    reply, _ = await call(nc, f"gen.cancel.{new_id('py-nobody')}")
    check(error_code(reply) == "NOT_FOUND", f"cancel of an unknown id: {reply}")
    reply, _ = await call(nc, f"gen.status.{new_id('py-nobody')}")
    check(error_code(reply) == "NOT_FOUND", f"status of an unknown id: {reply}")
    print("ok: cancel/status of an unknown id -> NOT_FOUND")


async def check_service_info(nc):
    info, _ = await call(nc, "$SRV.INFO.genfleet")
    check(info.get("name") == "genfleet", f"service info: {info}")
    meta = info.get("metadata") or {}
    check(meta.get("pool") == POOL, f"metadata pool: {meta}")
    check(str(meta.get("slots")) == "2", f"metadata slots: {meta}")
    check(meta.get("worker_id"), f"metadata worker_id: {meta}")
    print(f"ok: $SRV.INFO.genfleet -> worker {meta['worker_id']}")


async def main(url):
    nc = await nats.connect(url, connect_timeout=5, max_reconnect_attempts=0)
    try:
        await check_submit_events_status_result(nc)
        await check_invalid_request(nc)
        await check_msgpack(nc)
        await check_durable_queue(nc)
        await check_cancel_unknown(nc)
        await check_service_info(nc)
    finally:
        await nc.close()
    print("python fleet client: all checks passed")


if __name__ == "__main__":
    if len(sys.argv) != 2:
        sys.exit(__doc__)
    try:
        asyncio.run(main(sys.argv[1]))
    except (AssertionError, asyncio.TimeoutError, nats.errors.Error) as e:
        sys.exit(f"python fleet client: FAILED: {type(e).__name__}: {e}")
