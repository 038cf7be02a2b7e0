"""Drives `genfleet mock-llm` with the official openai Python client.

Usage: openai_client.py BASE_URL. Exits non-zero (with a traceback) on the first mismatch.
"""
import json
import sys

import openai

base_url = sys.argv[1]
client = openai.OpenAI(base_url=base_url, api_key="test-key", max_retries=0)

models = [m.id for m in client.models.list()]
assert "mock-model" in models, models

# Non-streaming text.
reply = client.chat.completions.create(
    model="mock-model", messages=[{"role": "user", "content": "Ada"}]
)
choice = reply.choices[0]
assert choice.message.content == "Hello from the mock, Ada!", choice.message
assert choice.finish_reason == "stop", choice.finish_reason
assert reply.usage.completion_tokens > 0, reply.usage

# Streaming text with usage.
text, finish, usage, reasoning = "", None, None, ""
stream = client.chat.completions.create(
    model="mock-model",
    messages=[{"role": "user", "content": "Bob"}],
    stream=True,
    stream_options={"include_usage": True},
)
for chunk in stream:
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

tools = [
    {"type": "function", "function": {"name": "add", "description": "Add two numbers",
     "parameters": {"type": "object", "properties": {"a": {"type": "number"}, "b": {"type": "number"}}}}},
    {"type": "function", "function": {"name": "clock", "description": "Read the time",
     "parameters": {"type": "object", "properties": {}}}},
]

# Streamed native tool calls, reassembled the way OpenAI clients do.
calls = {}
finish = None
stream = client.chat.completions.create(
    model="mock-model", messages=[{"role": "user", "content": "add"}], tools=tools, stream=True
)
for chunk in stream:
    for c in chunk.choices:
        finish = c.finish_reason or finish
        for tc in c.delta.tool_calls or []:
            entry = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
            if tc.id:
                entry["id"] = tc.id
            if tc.function and tc.function.name:
                entry["name"] += tc.function.name
            if tc.function and tc.function.arguments:
                entry["arguments"] += tc.function.arguments
assert finish == "tool_calls", finish
assert [calls[i]["name"] for i in sorted(calls)] == ["add", "clock"], calls
assert json.loads(calls[0]["arguments"]) == {"a": 1, "b": 2}, calls
assert all(calls[i]["id"] for i in calls), calls

# Non-streamed native tool calls.
reply = client.chat.completions.create(
    model="mock-model", messages=[{"role": "user", "content": "add"}], tools=tools
)
message = reply.choices[0].message
assert reply.choices[0].finish_reason == "tool_calls"
assert message.tool_calls[0].function.name == "add"
assert json.loads(message.tool_calls[0].function.arguments) == {"a": 1, "b": 2}

# A wrong key is refused the way OpenAI refuses it.
bad = openai.OpenAI(base_url=base_url, api_key="wrong", max_retries=0)
try:
    bad.chat.completions.create(model="mock-model", messages=[{"role": "user", "content": "x"}])
    raise AssertionError("a wrong API key was accepted")
except openai.AuthenticationError:
    pass

print("openai client: all checks passed")
