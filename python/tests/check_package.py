"""Checks the genfleet Python package against a running fleet (tests/python_client.rs runs it).

Usage: check_package.py NATS_URL

Expects one worker of pool `default` with 2 slots, backed by the mock LLM of
tests/data/openai_compat.toml. Exits non-zero with a message on the first failed check.
"""

import asyncio
import sys
from typing import List, Literal, Optional

import genfleet
from genfleet import GenfleetError, Manager, ToolError, ToolService, tool


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
    print("ok: schemas from type hints, ids checked before sending")


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
    async with await genfleet.Client.connect(url, timeout=10.0) as fleet:
        await check_run_stream_status(fleet)
        await check_cancel(fleet)
        await check_tool_service(fleet)
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
