"""Tool services: a Python function the fleet's models can call.

A tool is registered by putting its definition (three tiers: schema, brief, examples) in KV
bucket `GENFLEET_TOOLS` under its name, and served on `tools.<name>` in a queue group, so
several instances share the calls. The arguments come as a JSON object; the answer goes back as
`{"result": ...}`, or `{"error": {...}}` when the function raises :class:`ToolError` (the model
sees the error and may try again). docs/protocol.md, "Tools: three tiers", says what the fleet
checks.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import typing
from typing import Any, Awaitable, Callable, Dict, List, Optional, Union

from nats.aio.client import Client as NATS

#: The bucket where workers look for tool definitions.
BUCKET = "GENFLEET_TOOLS"

_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", dict: "object", list: "array"}


class ToolError(Exception):
    """Raised by a tool to answer the model with an error it can act on."""

    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


def _schema_of_type(hint: Any) -> Dict[str, Any]:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin is Union and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return _schema_of_type(rest[0]) if len(rest) == 1 else {}
    if origin is typing.Literal:
        return {"enum": list(args)}
    if origin in (list, List):
        return {"type": "array", "items": _schema_of_type(args[0])} if args else {"type": "array"}
    if origin in (dict, Dict):
        return {"type": "object"}
    if hint in _JSON_TYPES:
        return {"type": _JSON_TYPES[hint]}
    return {}


def schema_from_hints(function: Callable[..., Any]) -> Dict[str, Any]:
    """The JSON Schema of a function's keyword arguments, from its type hints: a parameter
    without a default is required; `Optional[...]` and defaults make it optional; `Literal`
    gives an enum. No other properties are allowed."""
    hints = typing.get_type_hints(function)
    properties: Dict[str, Any] = {}
    required: List[str] = []
    for name, parameter in inspect.signature(function).parameters.items():
        if parameter.kind in (parameter.VAR_POSITIONAL, parameter.VAR_KEYWORD):
            continue
        properties[name] = _schema_of_type(hints.get(name, Any))
        if parameter.default is inspect.Parameter.empty:
            required.append(name)
    schema: Dict[str, Any] = {"type": "object", "properties": properties, "additionalProperties": False}
    if required:
        schema["required"] = required
    return schema


class Tool:
    """A tool's definition and the function that answers its calls."""

    def __init__(
        self,
        function: Callable[..., Union[Any, Awaitable[Any]]],
        *,
        name: Optional[str] = None,
        brief: Optional[str] = None,
        schema: Optional[Dict[str, Any]] = None,
        description: Optional[str] = None,
        when_to_use: Optional[str] = None,
        examples: Optional[List[Dict[str, Any]]] = None,
        timeout_ms: Optional[int] = None,
    ):
        doc = inspect.getdoc(function) or ""
        self.function = function
        self.name = name or function.__name__
        self.brief = brief or (doc.splitlines()[0].strip() if doc else "")
        if not self.brief:
            raise ValueError(f"tool {self.name}: give a brief (or a docstring whose first line says what it does)")
        self.schema = schema or schema_from_hints(function)
        self.description = description or doc
        self.when_to_use = when_to_use
        self.examples = examples or []
        self.timeout_ms = timeout_ms

    def definition(self) -> Dict[str, Any]:
        """The definition workers read from the bucket."""
        definition: Dict[str, Any] = {"name": self.name, "schema": self.schema, "brief": self.brief}
        tier: Dict[str, Any] = {}
        if self.description:
            tier["description"] = self.description
        if self.when_to_use:
            tier["instructions"] = {"when_to_use": self.when_to_use, "common_pitfalls": [], "notes": []}
        if self.examples:
            tier["examples"] = self.examples
        if tier:
            definition["examples"] = tier
        if self.timeout_ms is not None:
            definition["timeout_ms"] = self.timeout_ms
        return definition

    async def answer(self, arguments: Dict[str, Any]) -> Dict[str, Any]:
        """Calls the function; its value (or its ToolError) as the reply body."""
        try:
            value = self.function(**arguments)
            if inspect.isawaitable(value):
                value = await value
            return {"result": value}
        except ToolError as error:
            return {"error": {"code": error.code, "message": error.message}}
        except TypeError as error:
            return {"error": {"code": "INVALID_ARGUMENTS", "message": str(error)}}


def tool(
    function: Optional[Callable[..., Any]] = None,
    **options: Any,
) -> Any:
    """Makes a function a :class:`Tool` (`@tool`, or `@tool(name=..., brief=..., schema=...)`).
    The schema comes from the type hints unless given; the brief from the docstring's first
    line."""
    if function is not None:
        return Tool(function, **options)
    return lambda f: Tool(f, **options)


class ToolService:
    """Serves tools on the bus until :meth:`stop`: registers their definitions, answers their
    calls, and withdraws them when it stops."""

    def __init__(self, nc: NATS, tools: List[Tool], *, bucket: str = BUCKET, queue: str = "genfleet-tools"):
        self.nc = nc
        self.tools = {t.name: t for t in tools}
        self.bucket = bucket
        self.queue = queue
        self._subscriptions: List[Any] = []
        self._kv: Any = None

    async def start(self) -> "ToolService":
        """Subscribes first (a worker may call as soon as it sees the definition), then
        registers."""
        for t in self.tools.values():
            self._subscriptions.append(
                await self.nc.subscribe(f"tools.{t.name}", queue=self.queue, cb=self._serve(t))
            )
        await self.nc.flush()
        self._kv = await self.nc.jetstream().key_value(self.bucket)
        for t in self.tools.values():
            await self._kv.put(t.name, json.dumps(t.definition()).encode())
        return self

    def _serve(self, t: Tool) -> Callable[[Any], Awaitable[None]]:
        async def serve(message: Any) -> None:
            try:
                arguments = json.loads(message.data or b"{}")
            except ValueError:
                reply: Dict[str, Any] = {"error": {"code": "INVALID_ARGUMENTS", "message": "the arguments are not JSON"}}
            else:
                if not isinstance(arguments, dict):
                    reply = {"error": {"code": "INVALID_ARGUMENTS", "message": "the arguments must be an object"}}
                else:
                    reply = await t.answer(arguments)
            await message.respond(json.dumps(reply).encode())

        return serve

    async def stop(self) -> None:
        """Withdraws the definitions, then stops answering."""
        if self._kv is not None:
            for name in self.tools:
                await self._kv.delete(name)
        for subscription in self._subscriptions:
            await subscription.unsubscribe()
        self._subscriptions.clear()

    async def serve_forever(self) -> None:
        """Starts, serves until cancelled (Ctrl-C), then withdraws."""
        await self.start()
        try:
            await asyncio.Event().wait()
        finally:
            await self.stop()

    async def __aenter__(self) -> "ToolService":
        return await self.start()

    async def __aexit__(self, *exc: Any) -> None:
        await self.stop()
