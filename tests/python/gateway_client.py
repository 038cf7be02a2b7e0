"""Drives `genfleet gateway` with the official openai Python SDK, as any OpenAI caller would.

Usage: gateway_client.py BASE_URL API_KEY PART

Expects a gateway in front of one worker of pool `default` with one slot, backed by the mock
LLM of tests/data/gateway.toml, and the demo calculator as a bus tool. PART is:
- `basics`: text whole and streamed, usage, reasoning, /v1/models, genfleet fields in
  extra_body, a bus tool inside the loop, errors (a model failure the SDK does not retry, a
  wrong key, an unknown model, a bad field, no slot with queue false), and a stream the caller closes mid-way (its request id printed as
  `CANCELLED_ID=<id>` for the test to check);
- `caller-tools`: OpenAI's tool round trip, streamed and not.
Exits non-zero (with a traceback) on the first mismatch, and prints `gateway client: PART
passed` at the end.
"""
import json
import sys

import openai

base_url, api_key, part = sys.argv[1], sys.argv[2], sys.argv[3]
client = openai.OpenAI(base_url=base_url, api_key=api_key, max_retries=0, timeout=60)


def basics():
    # The models: the pool itself and the configured name.
    models = {m.id for m in client.models.list()}
    assert {"default", "gpt-test"} <= models, models

    # Whole, under a configured model name; the request id comes back in a header.
    raw = client.chat.completions.with_raw_response.create(
        model="gpt-test", messages=[{"role": "user", "content": "Ada"}]
    )
    assert raw.headers.get("x-genfleet-request-id"), dict(raw.headers)
    reply = raw.parse()
    choice = reply.choices[0]
    assert choice.message.role == "assistant", choice.message
    assert choice.message.content == "Hello from the mock, Ada!", choice.message
    assert choice.finish_reason == "stop", choice.finish_reason
    assert reply.usage.completion_tokens > 0 and reply.usage.prompt_tokens > 0, reply.usage
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens
    assert reply.model == "gpt-test", reply.model
    assert reply.id.startswith("chatcmpl-"), reply.id
    # The answer echoed back as the SDK serialises it (reasoning, nulls and all) is accepted.
    follow_up = client.chat.completions.create(
        model="gpt-test",
        messages=[{"role": "user", "content": "Ada"}, choice.message,
                  {"role": "user", "content": "Eve"}],
    )
    assert follow_up.choices[0].message.content == "Hello from the mock, Eve!", follow_up

    # Streamed, with usage.
    text, reasoning, finish, usage = "", "", None, None
    stream = client.chat.completions.create(
        model="default",
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Bob"}],
        stream=True,
        stream_options={"include_usage": True},
        temperature=0.1,
        max_tokens=200,
        stop=["NEVER"],
        user="someone",
    )
    for chunk in stream:
        assert chunk.object == "chat.completion.chunk", chunk
        if chunk.usage is not None:
            usage = chunk.usage
        for c in chunk.choices:
            text += c.delta.content or ""
            reasoning += getattr(c.delta, "reasoning_content", None) or ""
            finish = c.finish_reason or finish
    assert text == "Hello from the mock, Bob!", text
    assert reasoning == "Short thought.", reasoning
    assert finish == "stop", finish
    assert usage is not None and usage.completion_tokens > 0, usage

    # genfleet's own fields in extra_body: a bus tool inside the loop, job name, metadata,
    # validation, the durable queue.
    raw = client.chat.completions.with_raw_response.create(
        model="default",
        messages=[{"role": "user", "content": "gw-calc please"}],
        extra_body={"genfleet": {
            "tools": ["calculate"], "job_name": "py-gateway", "durable": True,
            "metadata": {"origin": "sdk"}, "deadline_ms": 60000,
            "validation": [{"kind": "contains", "text": "42"}],
        }},
    )
    reply = raw.parse()
    assert "The fleet's tool said" in reply.choices[0].message.content, reply
    assert "42" in reply.choices[0].message.content, reply
    assert reply.choices[0].finish_reason == "stop", reply
    print(f"EXTRA_ID={raw.headers['x-genfleet-request-id']}", flush=True)

    # A failure no retry mends is sent once, though the SDK retries twice by default: the
    # gateway says `x-should-retry: false`. Each HTTP request the SDK sends is counted.
    import httpx
    sent = []
    retrying = openai.OpenAI(
        base_url=base_url, api_key=api_key, max_retries=2, timeout=60,
        http_client=httpx.Client(event_hooks={"request": [lambda request: sent.append(request.url)]}),
    )
    try:
        retrying.chat.completions.create(
            model="default", messages=[{"role": "user", "content": "gw-badtool"}])
        raise AssertionError("a call of a tool not offered succeeded")
    except openai.UnprocessableEntityError as e:
        assert e.status_code == 422 and e.code == "tool_parse_error", e
    assert len(sent) == 1, f"the SDK sent the failed request {len(sent)} times"

    # Errors, each in OpenAI's shape with the right status.
    try:
        openai.OpenAI(base_url=base_url, api_key="wrong-key", max_retries=0).chat.completions.create(
            model="default", messages=[{"role": "user", "content": "x"}])
        raise AssertionError("a wrong key was let in")
    except openai.AuthenticationError as e:
        assert e.status_code == 401 and e.code == "invalid_api_key", e
    try:
        client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "x"}])
        raise AssertionError("an unknown model was served")
    except openai.NotFoundError as e:
        assert e.code == "model_not_found", e
        assert e.body["param"] == "model", e.body
    try:
        client.chat.completions.create(
            model="default", messages=[{"role": "user", "content": "x"}],
            extra_body={"genfleet": {"durable": "very"}})
        raise AssertionError("a bad field was accepted")
    except openai.BadRequestError as e:
        assert e.body["param"] == "genfleet.durable", e.body
        assert "genfleet.durable" in e.message, e.message
    try:
        client.chat.completions.create(
            model="default", messages=[{"role": "user", "content": "x"}], extra_body={"temprature": 1})
        raise AssertionError("a misspelt field was accepted")
    except openai.BadRequestError as e:
        assert e.body["param"] == "temprature", e.body

    # The one slot taken by a slow stream: a request that may not queue is refused at once.
    raw = client.chat.completions.with_raw_response.create(
        model="default", messages=[{"role": "user", "content": "gw-slow"}], stream=True)
    slow_id = raw.headers["x-genfleet-request-id"]
    stream = raw.parse()
    seen = ""
    for chunk in stream:
        for c in chunk.choices:
            seen += c.delta.content or ""
        if "tick" in seen:
            break
    assert "tick" in seen, seen
    try:
        client.chat.completions.create(
            model="default", messages=[{"role": "user", "content": "x"}],
            extra_body={"genfleet": {"queue": False}})
        raise AssertionError("a request that may not queue was served with no slot free")
    except openai.RateLimitError as e:
        assert e.code == "no_slot_available", e
        assert e.response.headers.get("retry-after") == "1", dict(e.response.headers)
    # The caller goes away mid-stream: the test checks the request ends CANCELLED and the
    # backend saw its connection closed.
    stream.close()
    print(f"CANCELLED_ID={slow_id}", flush=True)


def caller_tools():
    tools = [{"type": "function", "function": {
        "name": "get_weather", "description": "The weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                       "required": ["city"]}}}]
    messages = [{"role": "user", "content": "gw-weather in Paris?"}]
    reply = client.chat.completions.create(model="default", messages=messages, tools=tools)
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    calls = choice.message.tool_calls
    assert len(calls) == 1 and calls[0].function.name == "get_weather", calls
    assert json.loads(calls[0].function.arguments) == {"city": "Paris"}, calls
    messages.append(choice.message)
    messages.append({"role": "tool", "tool_call_id": calls[0].id, "content": "sunny, 21 C"})
    reply = client.chat.completions.create(model="default", messages=messages, tools=tools)
    assert reply.choices[0].finish_reason == "stop", reply
    assert reply.choices[0].message.content == "The caller's tool said sunny, 21 C", reply

    # The same, streamed: the calls come as tool_calls deltas, joined by index.
    calls, finish = {}, None
    stream = client.chat.completions.create(
        model="default", messages=messages[:1], tools=tools, stream=True)
    for chunk in stream:
        for c in chunk.choices:
            finish = c.finish_reason or finish
            for call in c.delta.tool_calls or []:
                entry = calls.setdefault(call.index, {"id": None, "name": "", "arguments": ""})
                entry["id"] = call.id or entry["id"]
                entry["name"] += call.function.name or ""
                entry["arguments"] += call.function.arguments or ""
    assert finish == "tool_calls", finish
    assert [c["name"] for c in calls.values()] == ["get_weather"], calls
    assert json.loads(calls[0]["arguments"]) == {"city": "Paris"}, calls
    assert calls[0]["id"], calls


{"basics": basics, "caller-tools": caller_tools}[part]()
print(f"gateway client: {part} passed", flush=True)
