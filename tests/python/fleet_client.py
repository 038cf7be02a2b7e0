"""A small Python client of genfleet's wire protocol (docs/protocol.md), run as a check.

Usage: fleet_client.py NATS_URL

Expects a running fleet: one worker of pool `default` with 2 slots, backed by the mock LLM of
tests/data/openai_compat.toml, which replies "Hello from the mock, <last user message>!", calls
the tool py_echo for "py-tool", requests a decision for "py-decide" and answers slowly for
"py-slow".
Written from docs/protocol.md alone, with nats-py and msgpack: submit and follow the events,
status, result (peek, release, then NOT_FOUND), error replies, MessagePack, the durable queue,
the NATS service API, a tool service registered in GENFLEET_TOOLS, a decision answered and its
continuation, and cancel of running, queued and finished requests. Exits non-zero with a message on the first failed check.
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


async def follow(nc, request_id):
    """Subscribes to a request's events; returns (events list, future of the finished event)."""
    events = []
    finished = asyncio.get_running_loop().create_future()

    async def on_event(msg):
        event = json.loads(msg.data)
        events.append(event)
        if event["event"] == "finished" and not finished.done():
            finished.set_result(event)

    sub = await nc.subscribe(f"gen.events.{request_id}", cb=on_event)
    await nc.flush()
    return sub, events, finished


async def eventually(what, probe, tries=100):
    """Calls probe() until it returns something true; returns that."""
    for _ in range(tries):
        found = await probe()
        if found:
            return found
        await asyncio.sleep(0.05)
    raise AssertionError(f"never: {what}")


async def check_tool_service(nc):
    """A tool service of our own: registered in GENFLEET_TOOLS, answering tools.py_echo."""
    js = nc.jetstream()
    tools = await js.key_value("GENFLEET_TOOLS")
    definition = {
        "name": "py_echo",
        "brief": "Echo the text it is given",
        "schema": {
            "type": "object",
            "properties": {"text": {"type": "string"}},
            "required": ["text"],
        },
        "timeout_ms": 5000,
    }
    await tools.put("py_echo", json.dumps(definition).encode())
    calls = []

    async def serve(msg):
        args = json.loads(msg.data)
        calls.append((args, dict(msg.headers or {})))
        await msg.respond(json.dumps({"result": {"echo": args["text"]}}).encode())

    service = await nc.subscribe("tools.py_echo", cb=serve)
    request_id = new_id("py-tool")
    request = gen_request(request_id, "py-tool: echo this")
    request["tools"] = ["py_echo"]
    request["job_name"] = "py-job"
    sub, events, finished = await follow(nc, request_id)

    async def accepted():
        # Workers learn of the registration by watching the bucket: until then, INVALID_REQUEST.
        reply = await submit(nc, request)
        return reply if error_code(reply) is None else None

    await eventually("the worker accepts a request naming py_echo", accepted)
    result = (await asyncio.wait_for(finished, TIMEOUT))["result"]
    await sub.unsubscribe()
    await service.unsubscribe()
    await tools.delete("py_echo")

    check(len(calls) == 1, f"tool calls: {calls}")
    args, headers = calls[0]
    check(args == {"text": "ping"}, f"tool arguments: {args}")
    check(headers.get("Genfleet-Request-Id") == request_id, f"tool headers: {headers}")
    check(headers.get("Genfleet-Call-Id"), f"no Genfleet-Call-Id: {headers}")
    check(headers.get("Genfleet-Job-Name") == "py-job", f"tool headers: {headers}")
    kinds = [e["event"] for e in events]
    check("tool_call" in kinds and "tool_result" in kinds, f"events: {kinds}")
    check(result["state"] == "COMPLETED" and result["reason"] == "stop", f"result: {result}")
    check(result["tool_iterations_used"] == 1, f"iterations: {result}")
    tool_messages = [m for m in result["messages"] if m["role"] == "tool"]
    check(len(tool_messages) == 1, f"tool messages: {result['messages']}")
    check(tool_messages[0].get("tool_call_id"), f"tool message: {tool_messages[0]}")
    check(json.loads(tool_messages[0]["content"]) == {"echo": "ping"}, f"{tool_messages[0]}")
    check("ping" in result["output"], f"output: {result['output']!r}")
    await release(nc, request_id)
    print(f"ok: a tool service registered in GENFLEET_TOOLS was called ({request_id})")


async def check_decision(nc):
    """A model's decision request, answered on decisions.<id>, continued by a new request."""
    js = nc.jetstream()
    pending = await js.key_value("GENFLEET_DECISIONS")
    signals, outcomes = [], []

    async def on_signal(msg):
        signals.append(json.loads(msg.data))

    async def on_outcome(msg):
        outcomes.append(json.loads(msg.data))

    sig_sub = await nc.subscribe("signals.decision_request.>", cb=on_signal)
    out_sub = await nc.subscribe("signals.outcome.DECIDED", cb=on_outcome)
    request_id = new_id("py-decide")
    sub, events, finished = await follow(nc, request_id)
    accepted = await submit(nc, gen_request(request_id, "py-decide: which way?"))
    check(error_code(accepted) is None, f"submit refused: {accepted}")
    result = (await asyncio.wait_for(finished, TIMEOUT))["result"]
    check(result["state"] == "COMPLETED", f"asking request: {result}")
    check(result["reason"] == "decision_requested", f"asking request: {result}")

    async def signal_arrived():
        return [s for s in signals if s["request_id"] == request_id]

    signal = (await eventually("the decision request signal", signal_arrived))[0]
    check(signal["type"] == "decision_request", f"signal: {signal}")
    check(signal["code"] == "NEEDS_MANAGER_DECISION", f"signal code: {signal}")
    check(signal["source"] == "model", f"signal source: {signal}")
    decision = signal["decision"]
    check([o["id"] for o in decision["options"]] == ["left", "right"], f"{decision}")
    check(decision["default_option"] == "left" and decision["kind"] == "model", f"{decision}")
    check(decision.get("expires_at"), f"no expires_at: {decision}")
    check(result["signals"][0]["decision"]["decision_id"] == decision["decision_id"], "ids")
    decision_id = decision["decision_id"]

    record = json.loads((await pending.get(decision_id)).value)
    check(record["request_id"] == request_id and "answer" not in record, f"pending: {record}")

    bad, _ = await call(nc, f"decisions.{decision_id}", {"option_id": "up"})
    check(error_code(bad) == "INVALID_OPTION", f"bad option: {bad}")
    check(sorted(bad["error"]["detail"]["valid_options"]) == ["left", "right"], f"{bad}")
    answer = {"option_id": "right", "rationale": "shorter", "decided_by": "py-client"}
    reply, _ = await call(nc, f"decisions.{decision_id}", answer)
    check(error_code(reply) is None, f"answer refused: {reply}")
    check(reply["decision_id"] == decision_id and reply["outcome"] == "continued", f"{reply}")
    continuation = reply["continuation_request_id"]
    check(continuation, f"no continuation: {reply}")
    again, _ = await call(nc, f"decisions.{decision_id}", answer)
    check(again == reply, f"the same answer again: {again} != {reply}")
    other, _ = await call(nc, f"decisions.{decision_id}", {"option_id": "left"})
    check(error_code(other) == "ALREADY_DECIDED", f"another option: {other}")
    check(other["error"]["detail"]["option_id"] == "right", f"ALREADY_DECIDED detail: {other}")

    async def continued():
        return [e for e in events if e["event"] == "continued"]

    event = (await eventually("a continued event", continued))[0]
    check(event["continuation_request_id"] == continuation, f"continued event: {event}")
    await sub.unsubscribe()
    status, _ = await call(nc, f"gen.status.{request_id}")
    check(status.get("continuation_request_id") == continuation, f"status: {status}")

    follow_up = await wait_result(nc, continuation)
    check(follow_up["state"] == "COMPLETED", f"continuation: {follow_up}")
    check(follow_up["parent_request_id"] == request_id, f"parent: {follow_up}")
    check(follow_up["root_request_id"] == request_id, f"root: {follow_up}")
    check(follow_up["chain_position"] == 2, f"chain position: {follow_up}")
    told = [m["content"] for m in follow_up["messages"] if m["role"] == "user"]
    check(any("Decision chosen: Right (right)" in t for t in told), f"messages: {told}")

    async def announced():
        return [o for o in outcomes if o["meta"].get("decision_id") == decision_id]

    outcome = (await eventually("signals.outcome.DECIDED", announced))[0]
    check(outcome["meta"]["option_id"] == "right", f"outcome: {outcome}")
    check(outcome["meta"]["decided_by"] == "py-client", f"outcome: {outcome}")
    await sig_sub.unsubscribe()
    await out_sub.unsubscribe()
    record = json.loads((await pending.get(decision_id)).value)
    check(record["answer"]["option_id"] == "right", f"answered record: {record}")
    await release(nc, request_id)
    await release(nc, continuation)
    print(f"ok: decision request answered, continued as {continuation}")


async def check_cancel(nc):
    """Cancel of running requests, of a queued one, and of a finished one."""
    running = [new_id("py-slow") for _ in range(2)]  # both slots of the worker
    subs = []
    for request_id in running:
        sub, events, _ = await follow(nc, request_id)
        subs.append((sub, events))
        accepted = await submit(nc, gen_request(request_id, "py-slow: take your time"))
        check(error_code(accepted) is None, f"submit refused: {accepted}")
    for _, events in subs:

        async def streaming(seen=events):
            return any(e["event"] == "delta" for e in seen)

        await eventually("a first delta", streaming)

    queued = new_id("py-queued-cancel")
    js = nc.jetstream()
    body = json.dumps(gen_request(queued, "py-slow: never runs")).encode()
    await js.publish(f"gen.queue.{POOL}.{queued}", body, headers={"Nats-Msg-Id": queued})
    status, _ = await call(nc, f"gen.status.{queued}")
    check(status.get("state") == "QUEUED", f"status of a queued request: {status}")
    reply, _ = await call(nc, f"gen.cancel.{queued}")
    check(reply == {"request_id": queued, "state": "CANCELLED"}, f"cancel queued: {reply}")

    for request_id in running:
        reply, _ = await call(nc, f"gen.cancel.{request_id}")
        check(reply == {"request_id": request_id, "state": "CANCELLED"}, f"cancel: {reply}")
        result, _ = await call(nc, f"gen.result.{request_id}", {"release": False})
        check(result["state"] == "CANCELLED" and result["reason"] == "cancelled", f"{result}")
        partial = result["output"]
        check(partial.startswith("A") and "shutters" not in partial, f"partial output: {result}")
        again, _ = await call(nc, f"gen.cancel.{request_id}")
        check(error_code(again) == "ALREADY_FINISHED", f"cancel twice: {again}")
        check(again["error"]["detail"]["state"] == "CANCELLED", f"detail: {again}")
        await release(nc, request_id)
    for sub, _ in subs:
        await sub.unsubscribe()
    result = await wait_result(nc, queued)
    check(result["state"] == "CANCELLED" and result["output"] == "", f"queued: {result}")
    await release(nc, queued)
    print("ok: cancel of running, queued and finished requests")


async def main(url):
    nc = await nats.connect(url, connect_timeout=5, max_reconnect_attempts=0)
    try:
        await check_submit_events_status_result(nc)
        await check_invalid_request(nc)
        await check_msgpack(nc)
        await check_durable_queue(nc)
        await check_cancel_unknown(nc)
        await check_service_info(nc)
        await check_tool_service(nc)
        await check_decision(nc)
        await check_cancel(nc)
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
