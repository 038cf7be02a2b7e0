"""Checks the genfleet Python package against a running fleet (tests/python_client.rs runs it).

Usage: check_package.py NATS_URL

Expects one worker of pool `default` with 2 slots, backed by the mock LLM of
tests/data/openai_compat.toml. Exits non-zero with a message on the first failed check.
"""

import asyncio
import json
import logging
import sys
import time
from typing import List, Literal, Optional

import genfleet
from genfleet import GenfleetError, Manager, ToolError, ToolService, tool
from nats.errors import TimeoutError as NatsTimeout


def check(cond, what):
    if not cond:
        raise AssertionError(what)


async def eventually(what, attempt, tries=100):
    """Retries `attempt` while the fleet refuses it with INVALID_REQUEST (a tool not seen yet)."""
    for _ in range(tries):
        try:
            return await attempt()
        except GenfleetError as error:
            if error.code != "INVALID_REQUEST":
                raise
        await asyncio.sleep(0.1)
    raise AssertionError(f"never: {what}")


def check_schemas():
    def f(text: str, count: int, ratio: float = 1.0, tags: Optional[List[str]] = None, mode: Literal["a", "b"] = "a"):
        """Do something."""

    schema = genfleet.schema_from_hints(f)
    check(schema["required"] == ["text", "count"], f"required: {schema}")
    props = schema["properties"]
    check(props["text"] == {"type": "string"} and props["count"] == {"type": "integer"}, f"{props}")
    check(props["ratio"] == {"type": "number"}, f"{props}")
    check(props["tags"] == {"type": "array", "items": {"type": "string"}}, f"{props}")
    check(props["mode"] == {"enum": ["a", "b"]}, f"{props}")
    check(schema["additionalProperties"] is False, f"{schema}")
    t = genfleet.tool(f)
    check(t.name == "f" and t.brief == "Do something.", f"{t.definition()}")
    for bad in ("a.b", "", "x" * 129, "a b"):
        try:
            genfleet.check_id("request", bad)
        except ValueError as error:
            check("is not a valid request id" in str(error), str(error))
        else:
            raise AssertionError(f"{bad!r} was taken for an id")
    for bad in ("", "a.b", "x" * 33, "a b"):
        try:
            genfleet.check_tenant(bad)
        except ValueError as error:
            check("tenant=" in str(error) and "is not a valid tenant" in str(error), str(error))
        else:
            raise AssertionError(f"{bad!r} was taken for a tenant")
    check(genfleet.check_tenant("default") is None, "the default tenant is the v1 subjects")
    try:
        genfleet.request("x", priority="urgent")
    except ValueError as error:
        check("priority='urgent'" in str(error), str(error))
    else:
        raise AssertionError("an unknown priority band was taken")
    acme = genfleet.Client(None, tenant="acme")
    check(acme.qualify("r1") == "acme.r1" and acme.qualify("acme.r1") == "acme.r1", "qualified")
    for bad in ("bob.r1", "default.r1", "a.b.c"):
        try:
            acme.qualify(bad)
        except ValueError:
            pass
        else:
            raise AssertionError(f"{bad!r} was taken for one of acme's ids")
    check(
        acme.queue_subject(genfleet.request("x", request_id="r1", priority="high")) == "gen.queue.default.high.acme.r1",
        "a tenant's band subject",
    )
    v1 = genfleet.Client(None)
    check(v1.qualify("r1") == "r1", "the default tenant's ids are bare")
    check(v1.queue_subject(genfleet.request("x", request_id="r1")) == "gen.queue.default.r1", "v1 queue")
    check(
        v1.queue_subject(genfleet.request("x", request_id="r1", priority="low")) == "gen.queue.default.low.default.r1",
        "the default tenant's low band",
    )
    print("ok: schemas from type hints, ids, tenants and bands checked before sending")


class Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.records = []

    def emit(self, record):
        self.records.append(record)


async def check_wrong_url():
    """A server that is not there fails the connect in seconds, with one error and nothing
    logged (nats-py alone logs a traceback every 2 s for two minutes)."""
    records = Records()
    logging.getLogger().addHandler(records)
    started = time.monotonic()
    try:
        await genfleet.Client.connect("nats://127.0.0.1:1", timeout=2.0)
    except GenfleetError as error:
        check(error.code == "CONNECT_FAILED", f"{error}")
        check("cannot connect to NATS at nats://127.0.0.1:1" in str(error), str(error))
    else:
        raise AssertionError("a connect to a closed port succeeded")
    finally:
        logging.getLogger().removeHandler(records)
    took = time.monotonic() - started
    check(took < 10, f"the wrong URL took {took:.1f} s to fail")
    check(not records.records, f"logged while connecting: {[r.getMessage() for r in records.records]}")
    print(f"ok: a wrong URL fails in {took:.1f} s with one GenfleetError, nothing logged")


async def check_run_stream_status(fleet):
    result = await fleet.run(genfleet.request("Greetings from the package", job_name="py-package"))
    check(result["state"] == "COMPLETED", f"{result}")
    check(result["output"] == "Hello from the mock, Greetings from the package!", f"{result['output']}")
    try:
        await fleet.result(result["request_id"])
    except GenfleetError as error:
        check(error.code == "NOT_FOUND", f"{error}")
    else:
        raise AssertionError("a result was read twice")
    status = await fleet.status(result["request_id"])
    check(status["state"] == "COMPLETED", f"{status}")
    check(status["finished"]["prompt_start"] == "Greetings from the package", f"{status}")

    events = [e async for e in fleet.stream("Streamed, please")]
    kinds = [e["event"] for e in events]
    check(kinds[0] == "started" and kinds[-1] == "finished", f"{kinds}")
    text = "".join(e["text"] for e in events if e["event"] == "delta")
    check(text == events[-1]["result"]["output"], f"{text!r}")
    await fleet.result(events[-1]["request_id"])  # released

    queued = await fleet.enqueue(genfleet.request("Queued from Python"))
    done = await fleet.wait_result(queued)
    check(done["output"] == "Hello from the mock, Queued from Python!", f"{done}")
    print("ok: run, stream, status with its summary, enqueue and wait_result")


async def check_cancel(fleet):
    request = genfleet.request("py-slow: take your time")
    async for event in fleet.stream(request):
        if event["event"] == "delta":
            reply = await fleet.cancel(request["request_id"])
            check(reply["state"] == "CANCELLED", f"{reply}")
        if event["event"] == "finished":
            check(event["result"]["state"] == "CANCELLED", f"{event['result']['state']}")
    print("ok: a streamed request cancelled mid-way")


async def check_priority_bands(fleet):
    done = await fleet.run(genfleet.request("Urgent from Python", priority="high"), durable=True)
    check(done["state"] == "COMPLETED", f"{done}")
    check(done["output"] == "Hello from the mock, Urgent from Python!", f"{done['output']}")
    low = await fleet.enqueue(genfleet.request("Whenever from Python", priority="low"))
    done = await fleet.wait_result(low)
    check(done["state"] == "COMPLETED", f"{done}")

    # Both slots busy: two low requests wait, then a high one. The first slot freed takes the
    # high one, though it came last.
    slow = [genfleet.request("py-slow: hold a slot") for _ in range(2)]
    for body in slow:
        await fleet.submit(body)
    waiting = [genfleet.request(f"py-band {i}", priority=band) for i, band in enumerate(("low", "low", "high"))]
    started: List[str] = []
    subscriptions = []
    for body in waiting:
        async def on_event(message, request_id=body["request_id"]):
            if json.loads(message.data).get("event") == "started":
                started.append(request_id)
        subscriptions.append(await fleet.nc.subscribe(f"gen.events.{body['request_id']}", cb=on_event))
    await fleet.nc.flush()
    for body in waiting:
        await fleet.enqueue(body)
        await asyncio.sleep(0.05)
    for body in waiting:  # every one is on the queue before a slot frees
        for _ in range(100):
            try:
                if (await fleet.status(body["request_id"]))["state"] == "QUEUED":
                    break
            except GenfleetError as error:
                check(error.code == "NOT_FOUND", f"{error}")
            await asyncio.sleep(0.05)
    await asyncio.sleep(0.5)
    await fleet.cancel(slow[0]["request_id"])
    for _ in range(200):
        if started:
            break
        await asyncio.sleep(0.05)
    await fleet.cancel(slow[1]["request_id"])
    results = [await fleet.wait_result(body["request_id"], wait=60) for body in waiting]
    for subscription in subscriptions:
        await subscription.unsubscribe()
    for body in slow:
        await fleet.wait_result(body["request_id"], wait=60)
    check(all(r["state"] == "COMPLETED" for r in results), f"{results}")
    check(started and started[0] == waiting[2]["request_id"], f"started in the order {started}, high: {waiting[2]['request_id']}")
    print("ok: priority bands on the durable queue: a high request ran before the low ones waiting")


async def check_tool_service(fleet):
    calls = []

    @tool(brief="Echo the text back")
    async def py_echo(text: str) -> dict:
        calls.append(text)
        if text == "boom":
            raise ToolError("BOOM", "asked to fail")
        return {"echo": text}

    async with ToolService(fleet.nc, [py_echo]):
        request = genfleet.request("py-tool: call it", tools=["py_echo"])
        result = await eventually("the worker sees py_echo", lambda: fleet.run(dict(request)))
        check(calls == ["ping"], f"calls: {calls}")
        check('"echo":"ping"' in result["output"].replace(" ", ""), f"{result['output']}")
        answer = await py_echo.answer({"text": "boom"})
        check(answer == {"error": {"code": "BOOM", "message": "asked to fail"}}, f"{answer}")
    # Withdrawn: a request naming it is refused once the workers see the deletion.
    for _ in range(100):
        try:
            await fleet.submit(genfleet.request("py-tool again", tools=["py_echo"]))
        except GenfleetError as error:
            check(error.code == "INVALID_REQUEST", f"{error}")
            break
        await asyncio.sleep(0.1)
    else:
        raise AssertionError("py_echo was never withdrawn")
    print("ok: a tool service from a decorated function, called by the model, withdrawn")


async def check_silent_follow(fleet):
    """A chain whose decision nobody answers: once its first part ended, its follower hears
    nothing and asks the status after 1, 3 and 7 s (each read that finds the decision still
    pending doubles the wait), not every second; it gives up after `wait` seconds of silence.
    A busy machine only makes the asks later, so fewer."""
    request = genfleet.request("py-decide: nobody answers")
    asks = await fleet.nc.subscribe(f"gen.status.{request['request_id']}")
    events = []
    try:
        async for event in fleet.stream(request, wait=7.5):
            events.append(event)
    except GenfleetError as error:
        check(error.code == "TIMEOUT", f"{error}")
    else:
        raise AssertionError("a chain whose decision is pending ended")
    check(events[-1]["event"] == "finished", f"{[e['event'] for e in events]}")
    check(events[-1]["result"]["reason"] == "decision_requested", f"{events[-1]}")
    asked = 0
    while True:
        try:
            await asks.next_msg(timeout=0.1)
        except NatsTimeout:
            break
        asked += 1
    await asks.unsubscribe()
    check(1 <= asked <= 3, f"asked {asked} times in 7.5 s of silence")
    print(f"ok: a follower waiting for a decision asked {asked} times in 7.5 s of silence")


async def check_manager(fleet):
    seen = []

    async def on_signal(signal, manager):
        seen.append(signal["type"] + "." + signal["code"])
        if signal.get("decision"):
            await manager.decide(signal, "right", rationale="from the package's check")

    manager = await Manager(fleet.nc, "py-check", on_signal, deliver="new").start()
    running = asyncio.ensure_future(manager.run())
    try:
        events = [e async for e in fleet.stream("py-decide: which way?")]
    finally:
        manager.stop()
        await running
    kinds = [e["event"] for e in events]
    check("continued" in kinds, f"{kinds}")
    last = events[-1]["result"]
    check(last["state"] == "COMPLETED" and last["chain_position"] == 2, f"{last}")
    check("Decision chosen: Right (right)" in last["output"], f"{last['output']}")
    check("decision_request.NEEDS_MANAGER_DECISION" in seen, f"{seen}")
    print("ok: a manager answered the decision and the chain was followed to its end")


async def main(url):
    check_schemas()
    await check_wrong_url()
    async with await genfleet.Client.connect(url, timeout=10.0) as fleet:
        await check_run_stream_status(fleet)
        await check_cancel(fleet)
        await check_priority_bands(fleet)
        await check_tool_service(fleet)
        await check_silent_follow(fleet)
        await check_manager(fleet)
    try:
        async with await genfleet.Client.connect(url) as fleet:
            await fleet.submit("x", pool="nobody-serves-this")
    except genfleet.NoWorker as error:
        check("no worker answers on gen.submit.nobody-serves-this" in str(error), str(error))
    else:
        raise AssertionError("a pool without workers answered")
    print("ok: a pool without workers is NoWorker")


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1]))
