"""A caller of the fleet: submit, enqueue, follow the events, status, result, cancel, decide.

Every call is one message of docs/protocol.md over nats-py; replies are the wire's JSON as
dicts, and error replies raise :class:`GenfleetError`.
"""

from __future__ import annotations

import asyncio
import json
import re
import uuid
from typing import Any, AsyncIterator, Dict, Iterable, List, Optional, Union

import nats
from nats.aio.client import Client as NATS
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeout

from .errors import GenfleetError, NoWorker

Request = Dict[str, Any]

_ID = re.compile(r"^[A-Za-z0-9_-]{1,128}$")
#: How often a submit refused with NO_SLOT_AVAILABLE is tried again (another worker of the pool
#: may be free by then), as the protocol advises.
SUBMIT_RETRIES = 3


def new_id() -> str:
    """A fresh request id (32 hex digits: unguessable, as ids are capabilities)."""
    return uuid.uuid4().hex


def check_id(what: str, value: str) -> str:
    """Refuses an id that could never name a request or decision, before anything is sent."""
    if not isinstance(value, str) or not _ID.match(value):
        raise ValueError(
            f"{value!r} is not a valid {what} id: 1 to 128 letters, digits, '_' or '-'"
        )
    return value


def request(
    prompt: Optional[str] = None,
    *,
    messages: Optional[List[Dict[str, Any]]] = None,
    system: Optional[str] = None,
    tools: Iterable[str] = (),
    max_tokens: Optional[int] = None,
    temperature: Optional[float] = None,
    job_name: Optional[str] = None,
    metadata: Optional[Dict[str, Any]] = None,
    request_id: Optional[str] = None,
    **fields: Any,
) -> Request:
    """A generation request: a prompt (one user message) or `messages`, and the common fields.

    Any other field of docs/protocol.md's generation request goes in `fields` as it is named
    there (`deadline_ms`, `validation`, `checkpoints`, `options`, ...).
    """
    if (prompt is None) == (messages is None):
        raise ValueError("give a prompt or messages (one of them)")
    body: Request = {
        "request_id": check_id("request", request_id) if request_id else new_id(),
        "messages": messages if messages is not None else [{"role": "user", "content": prompt}],
    }
    optional = {
        "system": system,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "job_name": job_name,
        "metadata": metadata,
    }
    body.update({k: v for k, v in optional.items() if v is not None})
    tools = list(tools)
    if tools:
        body["tools"] = tools
    body.update(fields)
    return body


def _as_request(given: Union[str, Request]) -> Request:
    if isinstance(given, str):
        return request(given)
    body = dict(given)
    body.setdefault("request_id", new_id())
    check_id("request", body["request_id"])
    return body


class Client:
    """A caller of the fleet over one NATS connection.

    Use :meth:`connect`, or wrap a connection you have (`Client(nc)`). `pool` is where
    :meth:`submit`, :meth:`enqueue`, :meth:`stream` and :meth:`run` send by default.
    """

    def __init__(self, nc: NATS, *, pool: str = "default", timeout: float = 15.0):
        self.nc = nc
        self.pool = pool
        self.timeout = timeout
        self._owned = False

    @classmethod
    async def connect(
        cls,
        servers: Union[str, List[str]] = "nats://127.0.0.1:4222",
        *,
        pool: str = "default",
        timeout: float = 15.0,
        **nats_options: Any,
    ) -> "Client":
        """Connects to NATS (`nats_options` go to `nats.connect`: credentials, TLS, ...)."""
        nc = await nats.connect(servers, **nats_options)
        client = cls(nc, pool=pool, timeout=timeout)
        client._owned = True
        return client

    async def close(self) -> None:
        """Closes the connection if this client opened it."""
        if self._owned:
            await self.nc.drain()

    async def __aenter__(self) -> "Client":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def _call(self, subject: str, body: Any = None) -> Any:
        payload = b"" if body is None else json.dumps(body).encode()
        try:
            message = await self.nc.request(subject, payload, timeout=self.timeout)
        except NoRespondersError:
            raise NoWorker(subject) from None
        except NatsTimeout:
            raise GenfleetError("TIMEOUT", f"no answer on {subject} within {self.timeout} s") from None
        reply = json.loads(message.data)
        error = GenfleetError.from_reply(reply)
        if error:
            raise error
        return reply

    async def submit(self, given: Union[str, Request], *, pool: Optional[str] = None) -> Dict[str, Any]:
        """Starts a request on a free slot of the pool: `{"request_id", "state", "worker_id"}`.

        Refused with NO_SLOT_AVAILABLE when every slot is busy (after a few tries); use
        :meth:`enqueue` to wait for one instead.
        """
        body = _as_request(given)
        subject = f"gen.submit.{pool or self.pool}"
        for attempt in range(SUBMIT_RETRIES + 1):
            try:
                return await self._call(subject, body)
            except GenfleetError as error:
                if error.code != "NO_SLOT_AVAILABLE" or attempt == SUBMIT_RETRIES:
                    raise
            await asyncio.sleep(0.05 * (attempt + 1))
        raise AssertionError("unreachable")

    async def enqueue(self, given: Union[str, Request], *, pool: Optional[str] = None) -> str:
        """Puts a request on the durable queue (it runs when a slot is free, and survives a
        worker's loss); returns its id. Published twice within the duplicate window, it is kept
        once."""
        body = _as_request(given)
        request_id = body["request_id"]
        js = self.nc.jetstream(timeout=self.timeout)
        await js.publish(
            f"gen.queue.{pool or self.pool}.{request_id}",
            json.dumps(body).encode(),
            headers={"Nats-Msg-Id": request_id},
        )
        return request_id

    async def _subscribe(self, request_id: str) -> Any:
        """Subscribed to the request's events, and the server knows it (flushed)."""
        subscription = await self.nc.subscribe(f"gen.events.{request_id}")
        await self.nc.flush()
        return subscription

    async def follow(self, request_id: str, *, chain: bool = True, wait: float = 600.0) -> AsyncIterator[Dict[str, Any]]:
        """The request's events as they come (`started`, `delta`, `tool_call`, ..., `finished`).

        Subscribe before the request starts, or use :meth:`stream`: events are not kept. With
        `chain`, a request that ends asking a decision is followed on: its `continued` event,
        then the continuation's events, until a request finishes without a decision pending
        (or the chain ends). Gives up after `wait` seconds without an event.
        """
        subscription = await self._subscribe(check_id("request", request_id))
        async for event in self._events(subscription, request_id, chain, wait):
            yield event

    async def _events(self, subscription: Any, request_id: str, chain: bool, wait: float) -> AsyncIterator[Dict[str, Any]]:
        # Events are at most once, and a continuation can end before it is followed: when no
        # event comes for a second, the stored status says whether the request ended (its
        # result then stands in for the missed `finished`) or continued.
        current = request_id
        finished = False
        while True:
            next_id = None
            quiet = 0.0
            try:
                while next_id is None:
                    try:
                        message = await subscription.next_msg(timeout=1.0)
                    except NatsTimeout:
                        quiet += 1.0
                        if quiet >= wait:
                            raise GenfleetError("TIMEOUT", f"no event of {current} within {wait} s") from None
                        try:
                            status = await self.status(current)
                        except GenfleetError as error:
                            if error.code == "NOT_FOUND":
                                continue  # not on record yet
                            raise
                        if not finished and status["state"] in ("COMPLETED", "FAILED", "CANCELLED"):
                            result = await self.result(current, release=False)
                            event = {"event": "finished", "request_id": current, "result": result}
                        elif finished and status.get("continuation_request_id"):
                            event = {
                                "event": "continued",
                                "request_id": current,
                                "continuation_request_id": status["continuation_request_id"],
                            }
                        elif finished and status.get("decision_outcome") not in (None, "pending", "continued"):
                            event = {"event": "chain_ended", "request_id": current, "outcome": status["decision_outcome"]}
                        else:
                            continue
                    else:
                        quiet = 0.0
                        event = json.loads(message.data)
                    yield event
                    kind = event.get("event")
                    if kind == "finished":
                        finished = True
                        if not (chain and event["result"].get("reason") == "decision_requested"):
                            return
                    elif kind == "continued":
                        next_id = event["continuation_request_id"]
                    elif kind == "chain_ended":
                        return
            finally:
                await subscription.unsubscribe()
            current = next_id
            finished = False
            subscription = await self._subscribe(current)

    async def stream(self, given: Union[str, Request], *, pool: Optional[str] = None, chain: bool = True, durable: bool = False, wait: float = 600.0) -> AsyncIterator[Dict[str, Any]]:
        """Submits (or enqueues) a request and yields its events, subscribed before it starts."""
        body = _as_request(given)
        subscription = await self._subscribe(body["request_id"])
        try:
            if durable:
                await self.enqueue(body, pool=pool)
            else:
                await self.submit(body, pool=pool)
        except BaseException:
            await subscription.unsubscribe()
            raise
        async for event in self._events(subscription, body["request_id"], chain, wait):
            yield event

    async def run(self, given: Union[str, Request], *, pool: Optional[str] = None, chain: bool = True, durable: bool = False) -> Dict[str, Any]:
        """Runs a request to its end and returns the last result of its chain (read, so
        released)."""
        last: Optional[str] = None
        async for event in self.stream(given, pool=pool, chain=chain, durable=durable):
            if event.get("event") == "finished":
                last = event["request_id"]
        assert last is not None
        return await self.result(last)

    async def status(self, request_id: str) -> Dict[str, Any]:
        """`{"request_id", "state", ...}`; a finished request also carries `finished`, its
        summary (kept after its result is read)."""
        return await self._call(f"gen.status.{check_id('request', request_id)}", {})

    async def result(self, request_id: str, *, release: bool = True) -> Dict[str, Any]:
        """The terminal result. `release` (the default) removes it: a second read gets
        NOT_FOUND. Not finished yet: NOT_READY."""
        return await self._call(f"gen.result.{check_id('request', request_id)}", {"release": release})

    async def wait_result(self, request_id: str, *, release: bool = True, wait: float = 600.0, every: float = 0.2) -> Dict[str, Any]:
        """Polls for the result until it is there (for requests not followed by events)."""
        deadline = asyncio.get_running_loop().time() + wait
        while True:
            try:
                return await self.result(request_id, release=release)
            except GenfleetError as error:
                if error.code not in ("NOT_READY", "NOT_FOUND") or asyncio.get_running_loop().time() > deadline:
                    raise
            await asyncio.sleep(every)

    async def cancel(self, request_id: str) -> Dict[str, Any]:
        """Cancels a queued or running request: `{"request_id", "state"}`."""
        return await self._call(f"gen.cancel.{check_id('request', request_id)}", {})

    async def decide(
        self,
        decision_id: str,
        option_id: str,
        *,
        rationale: Optional[str] = None,
        decided_by: Optional[str] = None,
        guidance: Optional[str] = None,
        modified_prompt: Optional[str] = None,
        confidence_boost: Optional[float] = None,
    ) -> Dict[str, Any]:
        """Answers a decision: `{"decision_id", "outcome", "continuation_request_id"}`."""
        answer = {
            "option_id": option_id,
            "rationale": rationale,
            "decided_by": decided_by,
            "guidance": guidance,
            "modified_prompt": modified_prompt,
            "confidence_boost": confidence_boost,
        }
        body = {k: v for k, v in answer.items() if v is not None}
        return await self._call(f"decisions.{check_id('decision', decision_id)}", body)
