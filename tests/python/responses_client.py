"""Drives the Responses API of `genfleet gateway` with the official openai Python SDK and the
OpenAI Agents SDK, as their users would.

Usage: responses_client.py BASE_URL API_KEY PART [ARG]

Expects a gateway in front of one worker of pool `default` with one slot, backed by the mock
LLM of tests/data/gateway.toml. PART is:
- `responses`: a response whole and streamed (the raw events in OpenAI's order, and the SDK's
  stream helper), stored and read back with its input items, deleted, and the errors: a bad
  field, an unknown previous_response_id;
- `tools`: a function tool round trip, by previous_response_id, statelessly with the output
  items sent back, and streamed;
- `chain SECOND_BASE_URL`: a conversation continued by previous_response_id through two
  gateway processes, each turn on the other;
- `background`: a background response polled to its end, and one cancelled while it runs
  (the one slot is free again after);
- `tenants OTHER_KEY`: another tenant's key refused on read, input items, continue, cancel
  and delete, exactly as an unknown id;
- `agents`: an OpenAI Agents SDK `Agent` with a `function_tool`, run by `Runner.run` on the
  gateway's Responses API.
Exits non-zero (with a traceback) on the first mismatch, and prints `responses client: PART
passed` at the end.
"""
import json
import sys
import time

import openai

base_url, api_key, part = sys.argv[1], sys.argv[2], sys.argv[3]
arg = sys.argv[4] if len(sys.argv) > 4 else None
client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=60)

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                          "required": ["city"]}}


def responses():
    r = client.responses.create(model="gpt-test", input="Ada", instructions="Be kind.")
    assert r.id.startswith("resp_"), r.id
    assert r.status == "completed", r
    assert r.output_text == "Hello from the mock, Ada!", r.output_text
    assert [item.type for item in r.output] == ["reasoning", "message"], r.output
    assert r.output[0].content[0].text == "Short thought.", r.output[0]
    assert r.instructions == "Be kind." and r.model == "gpt-test" and r.store, r
    assert r.usage.input_tokens > 0 and r.usage.output_tokens > 0, r.usage
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens, r.usage

    # Stored: read back, with its input items.
    back = client.responses.retrieve(r.id)
    assert back.output_text == r.output_text and back.status == "completed", back
    items = list(client.responses.input_items.list(r.id))
    assert len(items) == 1 and items[0].role == "user", items
    assert items[0].content[0].text == "Ada", items

    # Streamed: OpenAI's events, in order, numbered.
    events = list(client.responses.create(model="default", input="Bea", stream=True))
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"], kinds
    assert kinds[-1] == "response.completed", kinds
    assert [e.sequence_number for e in events] == list(range(len(events))), events
    for kind in ["response.output_item.added", "response.reasoning_text.delta",
                 "response.content_part.added", "response.output_text.delta",
                 "response.output_text.done", "response.output_item.done"]:
        assert kind in kinds, (kind, kinds)
    assert kinds.index("response.reasoning_text.delta") < kinds.index("response.output_text.delta")
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == "Hello from the mock, Bea!", text
    final = events[-1].response
    assert final.output_text == text and final.status == "completed", final
    assert client.responses.retrieve(final.id).output_text == text

    # The SDK's stream helper accumulates the same response.
    with client.responses.stream(model="default", input="Cy") as stream:
        for _ in stream:
            pass
        done = stream.get_final_response()
    assert done.output_text == "Hello from the mock, Cy!", done

    # Not stored: answered, and nothing to read back.
    unstored = client.responses.create(model="default", input="Di", store=False)
    assert unstored.output_text == "Hello from the mock, Di!", unstored
    try:
        client.responses.retrieve(unstored.id)
        raise AssertionError("an unstored response was read back")
    except openai.NotFoundError:
        pass

    # Bad input names the field; an unknown previous response is a 404 naming it.
    try:
        client.responses.create(model="default", input="x", extra_body={"temprature": 1})
        raise AssertionError("an unknown field was accepted")
    except openai.BadRequestError as error:
        assert error.body["param"] == "temprature", error.body
    try:
        client.responses.create(model="default", input=[{"role": "robot", "content": "x"}])
        raise AssertionError("a bad role was accepted")
    except openai.BadRequestError as error:
        assert error.body["param"] == "input[0].role", error.body
    try:
        client.responses.create(model="default", input="x",
                                previous_response_id="resp_01NOSUCHRESPONSE0000000000")
        raise AssertionError("an unknown previous response was accepted")
    except openai.NotFoundError as error:
        assert error.body["param"] == "previous_response_id", error.body

    # Deleted: gone.
    client.responses.delete(r.id)
    try:
        client.responses.retrieve(r.id)
        raise AssertionError("a deleted response was read back")
    except openai.NotFoundError:
        pass


def tools():
    first = client.responses.create(model="default", input="gw-weather in Paris?",
                                    tools=[WEATHER])
    calls = [item for item in first.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather", first.output
    assert json.loads(calls[0].arguments) == {"city": "Paris"}, calls
    assert calls[0].call_id and calls[0].id.startswith("fc_"), calls
    answer = {"type": "function_call_output", "call_id": calls[0].call_id,
              "output": "sunny, 21 C"}

    # Continued from the stored response.
    second = client.responses.create(model="default", previous_response_id=first.id,
                                     input=[answer], tools=[WEATHER])
    assert second.output_text == "The caller's tool said sunny, 21 C", second
    assert second.previous_response_id == first.id, second

    # Stateless: the output items sent back with the answer.
    items = [{"role": "user", "content": "gw-weather in Paris?"}]
    items += [item.model_dump(exclude_none=True) for item in first.output]
    items.append(answer)
    third = client.responses.create(model="default", input=items, tools=[WEATHER], store=False)
    assert third.output_text == "The caller's tool said sunny, 21 C", third

    # Streamed: the call's arguments as function_call_arguments events.
    events = list(client.responses.create(model="default", input="gw-weather in Paris?",
                                          tools=[WEATHER], stream=True))
    kinds = [e.type for e in events]
    assert "response.function_call_arguments.delta" in kinds, kinds
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert len(done) == 1 and json.loads(done[0].arguments) == {"city": "Paris"}, done
    final = events[-1].response
    assert [item.type for item in final.output] == ["function_call"], final.output


def chain():
    other = openai.OpenAI(base_url=arg, api_key=api_key, max_retries=0, timeout=60)
    one = client.responses.create(model="default", input="gw-chain one")
    assert one.output_text == "turn 1: gw-chain one", one.output_text
    two = other.responses.create(model="default", input="two", previous_response_id=one.id)
    assert two.output_text == "turn 2: two", two.output_text
    three = client.responses.create(model="default", input="three",
                                    previous_response_id=two.id, stream=True)
    final = [e for e in three if e.type == "response.completed"][0].response
    assert final.output_text == "turn 3: three", final.output_text
    # Either replica reads what the other stored.
    assert other.responses.retrieve(final.id).output_text == "turn 3: three"
    assert client.responses.retrieve(two.id).previous_response_id == one.id


def poll(response_id, until, within=60):
    deadline = time.time() + within
    while True:
        r = client.responses.retrieve(response_id)
        if r.status in until:
            return r
        assert time.time() < deadline, f"{response_id} still {r.status}"
        time.sleep(0.1)


def background():
    queued = client.responses.create(model="default", input="Eve", background=True)
    assert queued.status in ("queued", "in_progress") and queued.background, queued
    done = poll(queued.id, ("completed", "failed", "cancelled"))
    assert done.status == "completed", done
    assert done.output_text == "Hello from the mock, Eve!", done.output_text

    # Cancelled while it runs: the one slot is free again after.
    slow = client.responses.create(model="default", input="gw-slow", background=True)
    poll(slow.id, ("in_progress",))
    cancelled = client.responses.cancel(slow.id)
    assert cancelled.status == "cancelled", cancelled
    assert poll(slow.id, ("cancelled", "completed", "failed")).status == "cancelled"
    after = client.responses.create(model="default", input="Fay")
    assert after.output_text == "Hello from the mock, Fay!", after

    # Only a background response can be cancelled.
    try:
        client.responses.cancel(after.id)
        raise AssertionError("a foreground response was cancelled")
    except openai.BadRequestError:
        pass


def tenants():
    mine = client.responses.create(model="default", input="Gil")
    theirs = openai.OpenAI(base_url=base_url, api_key=arg, max_retries=0, timeout=60)
    attempts = [
        lambda: theirs.responses.retrieve(mine.id),
        lambda: list(theirs.responses.input_items.list(mine.id)),
        lambda: theirs.responses.cancel(mine.id),
        lambda: theirs.responses.delete(mine.id),
        lambda: theirs.responses.create(model="default", input="x",
                                        previous_response_id=mine.id),
    ]
    for attempt in attempts:
        try:
            attempt()
            raise AssertionError("another tenant reached a response")
        except openai.NotFoundError as error:
            assert mine.id in error.body["message"], error.body
    # Still there for its own tenant.
    assert client.responses.retrieve(mine.id).output_text == "Hello from the mock, Gil!"


def agents():
    import asyncio

    from agents import Agent, OpenAIResponsesModel, Runner, function_tool, set_tracing_disabled

    set_tracing_disabled(True)
    asked = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        asked.append(city)
        return f"sunny in {city}"

    model = OpenAIResponsesModel(
        model="default",
        openai_client=openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0),
    )
    agent = Agent(name="weather", instructions="Answer with the weather.",
                  tools=[get_weather], model=model)
    result = asyncio.run(Runner.run(agent, "gw-weather in Paris?"))
    assert asked == ["Paris"], asked
    assert result.final_output == "The caller's tool said sunny in Paris", result.final_output


{"responses": responses, "tools": tools, "chain": chain, "background": background,
 "tenants": tenants, "agents": agents}[part]()
print(f"responses client: {part} passed", flush=True)
