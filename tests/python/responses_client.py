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
  gateway's Responses API;
- `batch OTHER_KEY`: files and batches: a chat batch with malformed lines (each in the error
  file with its line number, the rest answered), a Responses batch, the list, a cancel, a file
  over the gateway's limit refused, and another tenant's key refused on every file and batch
  route;
- `batch-big LINES`: a batch of LINES chat lines, its progress printed as `PROGRESS=<n>` while
  it runs (the test kills a worker meanwhile), every line answered exactly once.
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


def upload(lines, name="in.jsonl"):
    data = "".join(json.dumps(line) + "\n" for line in lines).encode()
    return client.files.create(file=(name, data), purpose="batch")


def chat_line(custom_id, text):
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "default", "messages": [{"role": "user", "content": text}]}}


def wait_batch(batch_id, within=120, progress=False):
    deadline = time.time() + within
    while True:
        b = client.batches.retrieve(batch_id)
        if progress:
            print(f"PROGRESS={b.request_counts.completed if b.request_counts else 0}", flush=True)
        if b.status in ("completed", "failed", "expired", "cancelled"):
            return b
        assert time.time() < deadline, f"{batch_id} still {b.status}: {b}"
        time.sleep(0.2)


def jsonl(file_id):
    text = client.files.content(file_id).text
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def batch():
    good = [chat_line(f"c{i}", f"line-{i}") for i in range(5)]
    raw = [json.dumps(line) for line in good[:3]]
    raw.append("{this is not json")                                   # line 4
    raw.append(json.dumps({**chat_line("wrong-url", "x"), "url": "/v1/embeddings"}))  # line 5
    raw.append(json.dumps(chat_line("c0", "again")))                  # line 6
    raw.append(json.dumps({**chat_line("bad-body", "x"),             # line 7
                           "body": {"model": "default", "messages": [], "temprature": 1}}))
    raw += [json.dumps(line) for line in good[3:]]                    # lines 8, 9
    f = client.files.create(file=("mixed.jsonl", ("\n".join(raw) + "\n").encode()),
                            purpose="batch")
    assert f.purpose == "batch" and f.bytes > 0 and f.id.startswith("file-"), f
    assert client.files.retrieve(f.id).filename == "mixed.jsonl"
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                              completion_window="24h", metadata={"run": "test"})
    assert b.status in ("validating", "in_progress"), b
    done = wait_batch(b.id)
    first = b.id
    assert done.status == "completed", done
    assert (done.request_counts.total, done.request_counts.completed,
            done.request_counts.failed) == (9, 5, 4), done.request_counts
    assert done.metadata == {"run": "test"}, done.metadata
    out = jsonl(done.output_file_id)
    assert sorted(o["custom_id"] for o in out) == [f"c{i}" for i in range(5)], out
    for o in out:
        i = o["custom_id"][1:]
        body = o["response"]["body"]
        assert o["response"]["status_code"] == 200, o
        assert body["choices"][0]["message"]["content"] == f"Hello from the mock, line-{i}!", o
        assert body["object"] == "chat.completion" and o["id"].startswith("batch_req_"), o
    errors = {e["error"]["line"] if e["error"] else e["custom_id"]: e for e in jsonl(done.error_file_id)}
    assert errors[4]["error"]["code"] == "invalid_json", errors
    assert "line 4" in errors[4]["error"]["message"], errors
    assert errors[5]["error"]["code"] == "invalid_url" and errors[5]["custom_id"] == "wrong-url"
    assert errors[6]["error"]["code"] == "duplicate_custom_id", errors
    bad = errors["bad-body"]["response"]
    assert bad["status_code"] == 400 and bad["body"]["error"]["param"] == "temprature", bad

    # A Responses batch.
    f = upload([{"custom_id": f"r{i}", "method": "POST", "url": "/v1/responses",
                 "body": {"model": "default", "input": f"resp-{i}"}} for i in range(3)])
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/responses",
                              completion_window="24h")
    done = wait_batch(b.id)
    assert done.status == "completed" and done.request_counts.completed == 3, done
    for o in jsonl(done.output_file_id):
        body = o["response"]["body"]
        assert body["object"] == "response" and body["status"] == "completed", o
        text = body["output"][-1]["content"][0]["text"]
        assert text == f"Hello from the mock, resp-{o['custom_id'][1:]}!", o
        # Stored: readable as any response.
        assert client.responses.retrieve(body["id"]).status == "completed"

    # Listed, newest first.
    listed = [x.id for x in client.batches.list(limit=10)]
    assert listed == [b.id, first], listed

    # Cancelled while it runs: it ends cancelled, lines that ran in its output.
    f = upload([chat_line(f"s{i}", "gw-slow") for i in range(3)])
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                              completion_window="24h")
    deadline = time.time() + 60
    while client.batches.retrieve(b.id).status != "in_progress":
        assert time.time() < deadline
        time.sleep(0.1)
    cancelling = client.batches.cancel(b.id)
    assert cancelling.status in ("cancelling", "cancelled"), cancelling
    done = wait_batch(b.id)
    assert done.status == "cancelled", done

    # Bad input: the batch's own fields, a file over the limit, unknown ids.
    for kwargs, param in [
        ({"endpoint": "/v1/embeddings"}, "endpoint"),
        ({"completion_window": "1h"}, "completion_window"),
        ({"input_file_id": "file-01NOSUCHFILE"}, "input_file_id"),
    ]:
        args = {"input_file_id": f.id, "endpoint": "/v1/chat/completions",
                "completion_window": "24h", **kwargs}
        try:
            client.batches.create(**args)
            raise AssertionError(f"{kwargs} was accepted")
        except (openai.BadRequestError, openai.NotFoundError) as error:
            assert error.body["param"] == param, error.body
    try:
        client.files.create(file=("big.jsonl", b"x" * 300_000), purpose="batch")
        raise AssertionError("a file over the limit was stored")
    except openai.APIStatusError as error:
        assert error.status_code == 413, error
    try:
        client.files.create(file=("in.jsonl", b"{}"), purpose="fine-tune")
        raise AssertionError("a purpose not served was accepted")
    except openai.BadRequestError as error:
        assert error.body["param"] == "purpose", error.body

    # Another tenant's key finds none of it.
    theirs = openai.OpenAI(base_url=base_url, api_key=arg, max_retries=0, timeout=60)
    attempts = [
        lambda: theirs.files.retrieve(f.id),
        lambda: theirs.files.content(f.id),
        lambda: theirs.files.delete(f.id),
        lambda: theirs.batches.retrieve(b.id),
        lambda: theirs.batches.cancel(b.id),
        lambda: theirs.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                      completion_window="24h"),
    ]
    for attempt in attempts:
        try:
            attempt()
            raise AssertionError("another tenant reached a file or a batch")
        except openai.NotFoundError:
            pass
    assert [x.id for x in theirs.batches.list()] == [], "another tenant's batches are listed"
    assert [x.id for x in theirs.files.list()] == [], "another tenant's files are listed"
    assert client.files.retrieve(f.id).id == f.id
    client.files.delete(f.id)
    try:
        client.files.retrieve(f.id)
        raise AssertionError("a deleted file was read")
    except openai.NotFoundError:
        pass


def batch_big():
    count = int(arg)
    f = upload([chat_line(f"big-{i}", f"line-{i}") for i in range(count)], "big.jsonl")
    b = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                              completion_window="24h")
    print(f"BATCH_ID={b.id}", flush=True)
    done = wait_batch(b.id, within=600, progress=True)
    assert done.status == "completed", done
    counts = done.request_counts
    assert (counts.total, counts.completed, counts.failed) == (count, count, 0), counts
    out = jsonl(done.output_file_id)
    ids = [o["custom_id"] for o in out]
    assert sorted(ids) == sorted(f"big-{i}" for i in range(count)), "not every line once"
    for o in out:
        i = o["custom_id"][4:]
        content = o["response"]["body"]["choices"][0]["message"]["content"]
        assert content == f"answer to line-{i}", o
    assert done.error_file_id is None, done
    print(f"COMPLETED={len(out)}", flush=True)


{"responses": responses, "tools": tools, "chain": chain, "background": background,
 "tenants": tenants, "agents": agents, "batch": batch, "batch-big": batch_big}[part]()
print(f"responses client: {part} passed", flush=True)
