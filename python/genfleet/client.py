"""A caller of the fleet: submit, enqueue, follow the events, status, result, cancel, decide.

Every call is one message of docs/protocol.md over nats-py; replies are the wire's JSON as
dicts, and error replies raise :class:`GenfleetError`.

A client acts for one tenant: the default one (the v1 subjects, bare request ids) unless
:meth:`Client.connect` is given `tenant`, in which case its submits and queued requests carry
the tenant token in their subjects and its requests are known on the bus by their qualified
ids, `<tenant>.<id>`.

A submit with an `affinity_key` is placed as every party of the fleet places it
(:mod:`genfleet.placement`): once the client follows the workers' heartbeats, it goes to the
key's worker's own subject, else to the pool, whose worker places it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import uuid
from typing import Any, AsyncIterator, Callable, Dict, Iterable, List, Optional, Tuple, Union

import nats.aio.client as _nats_client
from nats.aio.client import Client as NATS
from nats.errors import AuthorizationError, NoRespondersError
from nats.errors import Error as NatsError
from nats.errors import TimeoutError as NatsTimeout

from .errors import GenfleetError, NoWorker
from .placement import (
    AFFINITY_FALLBACK_HEADER,
    DEFAULT_LOAD_FACTOR,
    PREFERRED_WORKER_HEADER,
    Choice,
    Heartbeats,
)

Request = Dict[str, Any]

_ID = re.compile(r"^[A-Za-z0-9_-]{1,128}$")
_TENANT = re.compile(r"^[A-Za-z0-9_-]{1,32}$")
# A subject prefix: dot-separated tokens, none empty, no wildcard and no whitespace.
_PREFIX = re.compile(r"^[^\s.*>]+(\.[^\s.*>]+)*$")
#: How often a submit refused with NO_SLOT_AVAILABLE is tried again (another worker of the pool
#: may be free by then), as the protocol advises.
SUBMIT_RETRIES = 3
#: The tenant of the v1 subjects (`gen.submit.<pool>`, `gen.queue.<pool>.<id>`).
DEFAULT_TENANT = "default"
#: The priority bands, the most urgent first; a request without `priority` is `normal`.
BANDS = ("high", "normal", "low")
#: How many times :meth:`Client.connect` tries each server before it gives up, and how long it
#: waits between two tries (nats-py's reconnect settings apply once connected).
CONNECT_TRIES = 2
CONNECT_TRY_WAIT = 0.5

_log = logging.getLogger("genfleet")


# How long a submit sent straight to a worker's own subject waits for its answer before it goes
# to the pool (seconds): a worker answers there at once, and one that does not is taken for gone
# (killed a moment ago, or on a node lost without closing its connections).
DIRECT_SUBMIT_WAIT = 2.0


def new_id() -> str:
    """A fresh request id (32 hex digits: unguessable, as ids are capabilities)."""
    return uuid.uuid4().hex


def check_id(what: str, value: str) -> str:
    """Refuses an id that could never name a request or decision, before anything is sent."""
    if not isinstance(value, str) or not _ID.fullmatch(value):
        raise ValueError(
            f"{value!r} is not a valid {what} id: 1 to 128 letters, digits, '_' or '-'"
        )
    return value


def check_tenant(value: Optional[str], what: str = "tenant") -> Optional[str]:
    """The tenant a client acts as: `None` for the default tenant (`"default"` is the same);
    a name that is not 1 to 32 letters, digits, '_' or '-' raises ValueError."""
    if value is None or value == DEFAULT_TENANT:
        return None
    if not isinstance(value, str) or not _TENANT.fullmatch(value):
        raise ValueError(
            f"{what}={value!r} is not a valid tenant: 1 to 32 letters, digits, '_' or '-'"
        )
    return value


def check_priority(value: Optional[str]) -> str:
    """The band a request's `priority` names (`normal` when absent); another value raises
    ValueError."""
    if value is None:
        return "normal"
    if value not in BANDS:
        raise ValueError(f"priority={value!r} is not a priority band: one of high, normal, low")
    return value


def qualified_id(request_id: str, tenant: Optional[str] = None) -> str:
    """A request's id on the bus: the bare id for the default tenant, `<tenant>.<id>` for
    another. An id that is already qualified is checked and returned as it is."""
    tenant_of, bare = split_id(request_id)
    if tenant_of is not None:
        return request_id
    tenant = check_tenant(tenant)
    return f"{tenant}.{bare}" if tenant else bare


def split_id(request_id: str) -> Tuple[Optional[str], str]:
    """The tenant (`None` for the default tenant) and the bare id of a request id as the bus
    knows it (`<id>` or `<tenant>.<id>`); anything else raises ValueError."""
    if isinstance(request_id, str) and request_id.count(".") == 1:
        tenant, bare = request_id.split(".")
        if tenant != DEFAULT_TENANT and _TENANT.fullmatch(tenant) and _ID.fullmatch(bare):
            return tenant, bare
        raise ValueError(
            f"{request_id!r} is not a valid request id: an id (1 to 128 letters, digits, '_' or "
            "'-'), or <tenant>.<id> for a tenant's request"
        )
    return None, check_id("request", request_id)


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
    priority: Optional[str] = None,
    **fields: Any,
) -> Request:
    """A generation request: a prompt (one user message) or `messages`, and the common fields.

    `request_id` is the bare id (the client qualifies it with its tenant on the bus);
    `priority` is the band, `high`, `normal` or `low` (absent: `normal`). Any other field of
    docs/protocol.md's generation request goes in `fields` as it is named there
    (`deadline_ms`, `validation`, `checkpoints`, `options`, `affinity_key`, ...).
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
        "priority": check_priority(priority) if priority is not None else None,
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
    if body.get("priority") is not None:
        check_priority(body["priority"])
    return body


def _describe(error: BaseException) -> str:
    text = str(error).strip()
    return text if text else type(error).__name__


async def _open(
    servers: Union[str, List[str]],
    options: Dict[str, Any],
    listeners: Optional[List[Callable[[BaseException], bool]]] = None,
) -> NATS:
    """A nats-py connection that fails at once, with one GenfleetError, when no server takes
    it: each server is tried CONNECT_TRIES times, CONNECT_TRY_WAIT apart, and what goes wrong
    meanwhile is not logged (nats-py logs a traceback for each try). Once connected, nats-py's
    reconnect settings (the caller's, or its defaults) apply, and its asynchronous errors go to
    the caller's `error_cb` or, without one, to the `genfleet` logger as one line each, but
    for those one of `listeners` (added to as the client runs) says it handled."""
    options = dict(options)
    caller_error_cb = options.pop("error_cb", None)
    reconnect = {
        "max_reconnect_attempts": options.pop(
            "max_reconnect_attempts", getattr(_nats_client, "DEFAULT_MAX_RECONNECT_ATTEMPTS", 60)
        ),
        "reconnect_time_wait": options.pop(
            "reconnect_time_wait", getattr(_nats_client, "DEFAULT_RECONNECT_TIME_WAIT", 2)
        ),
    }
    errors: List[BaseException] = []
    connected = False

    async def on_error(error: Exception) -> None:
        if not connected:
            errors.append(error)
        if connected and listeners and any([heard(error) for heard in listeners]):
            return  # expected, and handled where it was heard
        if caller_error_cb is not None:
            await caller_error_cb(error)
        elif connected:
            _log.warning("NATS: %s", _describe(error))

    nc = NATS()
    try:
        await nc.connect(
            servers,
            error_cb=on_error,
            max_reconnect_attempts=CONNECT_TRIES - 1,
            reconnect_time_wait=min(CONNECT_TRY_WAIT, reconnect["reconnect_time_wait"]),
            **options,
        )
    except Exception as error:  # noqa: BLE001 - every way a connect fails ends the same
        # What the server said (a refused login, say) tells more than the socket's end after it.
        said = [e for e in errors if type(e) in (NatsError, AuthorizationError)]
        cause = said[0] if said else errors[-1] if errors else error
        try:
            await nc.close()
        except Exception:  # noqa: BLE001 - it never opened
            pass
        where = servers if isinstance(servers, str) else ", ".join(servers)
        raise GenfleetError(
            "CONNECT_FAILED", f"cannot connect to NATS at {where}: {_describe(cause)}"
        ) from None
    nc.options.update(reconnect)
    connected = True
    return nc


class Client:
    """A caller of the fleet over one NATS connection.

    Use :meth:`connect`, or wrap a connection you have (`Client(nc)`). `pool` is where
    :meth:`submit`, :meth:`enqueue`, :meth:`stream` and :meth:`run` send by default. `tenant`
    is the tenant it acts as (`None`: the default tenant, the v1 subjects). `placement`
    (on by default) follows the workers' heartbeats from the first submit with an
    `affinity_key` on, to send keyed submits to their key's worker; `load_factor` is the
    placement's bounded-load factor (below 1: no bound).
    """

    def __init__(
        self,
        nc: NATS,
        *,
        pool: str = "default",
        timeout: float = 15.0,
        tenant: Optional[str] = None,
        placement: bool = True,
        load_factor: float = DEFAULT_LOAD_FACTOR,
    ):
        self.tenant = check_tenant(tenant)
        self.nc = nc
        self.pool = pool
        self.timeout = timeout
        self.placement = placement
        self.load_factor = float(load_factor)
        self._owned = False
        # The connection's asynchronous errors, offered to the client first (a connection it
        # opened; one it was given reports to whoever opened it).
        self._listeners: Optional[List[Callable[[BaseException], bool]]] = None
        # The workers' heartbeats, followed from the first keyed submit on.
        self._heartbeats: Optional[Heartbeats] = None

    @classmethod
    async def connect(
        cls,
        servers: Union[str, List[str]] = "nats://127.0.0.1:4222",
        *,
        pool: str = "default",
        timeout: float = 15.0,
        tenant: Optional[str] = None,
        inbox_prefix: Union[str, bytes, None] = None,
        placement: bool = True,
        load_factor: float = DEFAULT_LOAD_FACTOR,
        **nats_options: Any,
    ) -> "Client":
        """Connects to NATS (`nats_options` go to nats-py's `connect`: credentials, TLS, ...).

        `tenant` (1 to 32 letters, digits, '_' or '-') makes every submit, queued request,
        status, result, cancel and event subscription the tenant's; `inbox_prefix` is the
        prefix of the connection's reply subjects (nats-py's `_INBOX` otherwise), for a NATS
        user allowed only its own replies (`_INBOX_acme`, say). A server that cannot be
        reached, or refuses the connection, raises GenfleetError `CONNECT_FAILED` within a few
        seconds. `placement` and `load_factor`: see :class:`Client`.
        """
        tenant = check_tenant(tenant)
        if inbox_prefix is not None:
            text = inbox_prefix.decode() if isinstance(inbox_prefix, bytes) else inbox_prefix
            if not isinstance(text, str) or not _PREFIX.fullmatch(text):
                raise ValueError(
                    f"inbox_prefix={inbox_prefix!r} is not a subject prefix: dot-separated "
                    "tokens, none empty, without '*', '>' or whitespace"
                )
            nats_options["inbox_prefix"] = text
        listeners: List[Callable[[BaseException], bool]] = []
        nc = await _open(servers, nats_options, listeners)
        client = cls(nc, pool=pool, timeout=timeout, tenant=tenant, placement=placement, load_factor=load_factor)
        client._owned = True
        client._listeners = listeners
        return client

    def qualify(self, request_id: str) -> str:
        """A request's id as the bus knows it: a bare id is this client's tenant's
        (`<tenant>.<id>`, or the id itself for the default tenant); a qualified id
        (`<tenant>.<id>`) is taken as it is, but a tenant's client refuses another tenant's
        (ValueError)."""
        tenant, bare = split_id(request_id)
        if tenant is None:
            return f"{self.tenant}.{bare}" if self.tenant else bare
        if self.tenant is not None and tenant != self.tenant:
            raise ValueError(
                f"{request_id!r} is a request of tenant {tenant!r}; this client acts as {self.tenant!r}"
            )
        return request_id

    async def close(self) -> None:
        """Stops following the heartbeats, and closes the connection if this client opened
        it."""
        if self._heartbeats is not None:
            await self._heartbeats.stop()
        if self._owned:
            await self.nc.drain()

    async def __aenter__(self) -> "Client":
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()

    async def _call(
        self,
        subject: str,
        body: Any = None,
        headers: Optional[Dict[str, str]] = None,
        timeout: Optional[float] = None,
    ) -> Any:
        payload = b"" if body is None else json.dumps(body).encode()
        wait = self.timeout if timeout is None else timeout
        try:
            message = await self.nc.request(subject, payload, timeout=wait, headers=headers)
        except NoRespondersError:
            raise NoWorker(subject) from None
        except NatsTimeout:
            raise GenfleetError("TIMEOUT", f"no answer on {subject} within {wait} s") from None
        reply = json.loads(message.data)
        error = GenfleetError.from_reply(reply)
        if error:
            raise error
        return reply

    async def submit(self, given: Union[str, Request], *, pool: Optional[str] = None) -> Dict[str, Any]:
        """Starts a request on a free slot of the pool: `{"request_id", "state", "worker_id"}`.

        Refused with NO_SLOT_AVAILABLE when every slot is busy (after a few tries); use
        :meth:`enqueue` to wait for one instead. A request with an `affinity_key` goes first to
        the worker the placement rule chooses, once the client follows the heartbeats
        (:meth:`placement_ready`); when that worker has no slot, is gone, or does not answer
        within 2 s, to the pool at once.
        """
        body = _as_request(given)
        pool = pool or self.pool
        tenant = f".{self.tenant}" if self.tenant else ""
        headers: Optional[Dict[str, str]] = None
        # The chosen worker, when its own subject did not answer in time: it may have started
        # the request all the same.
        unanswered: Optional[str] = None
        choice = self._place(body, pool)
        if choice is not None and self._heartbeats is not None:
            headers = {PREFERRED_WORKER_HEADER: choice.key_worker}
            if choice.fallback:
                headers[AFFINITY_FALLBACK_HEADER] = choice.fallback
            subject = f"gen.worker.{choice.worker}.submit{tenant}"
            try:
                return await self._call(subject, body, headers, min(self.timeout, DIRECT_SUBMIT_WAIT))
            except NoWorker:
                pass  # gone meanwhile
            except GenfleetError as error:
                if error.code == "TIMEOUT":
                    unanswered = choice.worker
                elif error.code != "NO_SLOT_AVAILABLE":
                    raise
            headers = {PREFERRED_WORKER_HEADER: choice.key_worker, AFFINITY_FALLBACK_HEADER: "busy"}
        subject = f"gen.submit.{pool}{tenant}"
        for attempt in range(SUBMIT_RETRIES + 1):
            try:
                return await self._call(subject, body, headers)
            except GenfleetError as error:
                if error.code == "DUPLICATE_REQUEST_ID" and unanswered is not None:
                    # The chosen worker started it after all, and answered late.
                    status = await self.status(body["request_id"])
                    if status.get("worker_id") == unanswered:
                        return {
                            "request_id": status["request_id"],
                            "state": status["state"],
                            "worker_id": unanswered,
                        }
                if error.code != "NO_SLOT_AVAILABLE" or attempt == SUBMIT_RETRIES:
                    raise
            await asyncio.sleep(0.05 * (attempt + 1))
        raise AssertionError("unreachable")

    def _following(self) -> Optional[Heartbeats]:
        """The heartbeats, followed from now on (unless placement is off)."""
        if not self.placement:
            return None
        if self._heartbeats is None:
            self._heartbeats = Heartbeats(self.nc, timeout=self.timeout)
            listen = self._listeners.append if self._listeners is not None else None
            self._heartbeats.start(listen)
        return self._heartbeats

    def _place(self, body: Request, pool: str) -> Optional[Choice]:
        """Where a keyed request goes, when the heartbeats tell (`None`: to the pool)."""
        key = body.get("affinity_key")
        if not isinstance(key, str) or not key:
            return None
        heartbeats = self._following()
        if heartbeats is None:
            return None
        return heartbeats.choose(pool, key, self.load_factor)

    async def placement_ready(self, wait: float = 0.0) -> bool:
        """Whether keyed submits are placed here: the client follows the workers' heartbeats
        and has read each one's last. Starts following if it has not yet (as the first keyed
        submit does), then waits up to `wait` seconds for the heartbeats to load (or for
        following to stop: placement off, or a NATS user that may not read the bucket).
        Until it is ready, keyed submits go to the pool."""
        heartbeats = self._following()
        if heartbeats is None:
            return False
        return await heartbeats.ready(wait)

    def queue_subject(self, body: Request, *, pool: Optional[str] = None) -> str:
        """Where a request is queued: its band (`priority`) and this client's tenant;
        `gen.queue.<pool>.<id>` for a `normal` request of the default tenant,
        `gen.queue.<pool>.<band>.<tenant>.<id>` otherwise."""
        band = check_priority(body.get("priority"))
        request_id = check_id("request", body["request_id"])
        pool = pool or self.pool
        if band == "normal" and self.tenant is None:
            return f"gen.queue.{pool}.{request_id}"
        return f"gen.queue.{pool}.{band}.{self.tenant or DEFAULT_TENANT}.{request_id}"

    async def enqueue(self, given: Union[str, Request], *, pool: Optional[str] = None) -> str:
        """Puts a request on the durable queue, in the band its `priority` names (it runs when
        a slot is free, higher bands first, and survives a worker's loss); returns its id on
        the bus (qualified for a tenant). Published twice within the duplicate window, it is
        kept once. A duplicate acknowledgement for an id the fleet does not know means another
        publisher used the same message id first (the window is the whole stream's): nothing
        was queued, and GenfleetError DUPLICATE_REQUEST_ID says to send it under another id."""
        body = _as_request(given)
        subject = self.queue_subject(body, pool=pool)
        request_id = self.qualify(body["request_id"])
        js = self.nc.jetstream(timeout=self.timeout)
        ack = await js.publish(
            subject,
            json.dumps(body).encode(),
            headers={"Nats-Msg-Id": request_id},
        )
        if getattr(ack, "duplicate", False):
            try:
                await self.status(request_id)
            except GenfleetError as error:
                if error.code != "NOT_FOUND":
                    raise
                raise GenfleetError(
                    "DUPLICATE_REQUEST_ID",
                    f"the queue took request {request_id} for a duplicate of a message published "
                    "with the same id within its duplicate window, but no such request is queued, "
                    "running or finished: another publisher used this id; send it again under "
                    "another request id",
                ) from None
        return request_id

    async def _subscribe(self, request_id: str) -> Any:
        """Subscribed to the request's events (`request_id` qualified), and the server knows it
        (flushed)."""
        subscription = await self.nc.subscribe(f"gen.events.{request_id}")
        await self.nc.flush()
        return subscription

    async def follow(self, request_id: str, *, chain: bool = True, wait: float = 600.0) -> AsyncIterator[Dict[str, Any]]:
        """The request's events as they come (`started`, `delta`, `tool_call`, ..., `finished`).

        Subscribe before the request starts, or use :meth:`stream`: events are not kept. With
        `chain`, a request that ends asking a decision is followed on: its `continued` event,
        then the continuation's events, until a request finishes without a decision pending
        (or the chain ends). Gives up after `wait` seconds without an event. `request_id` is
        the bare id or the qualified one.
        """
        request_id = self.qualify(request_id)
        subscription = await self._subscribe(request_id)
        async for event in self._events(subscription, request_id, chain, wait):
            yield event

    async def _events(self, subscription: Any, request_id: str, chain: bool, wait: float) -> AsyncIterator[Dict[str, Any]]:
        follow = _Follow(self, subscription, request_id, chain, wait)
        try:
            while True:
                event = await follow.next()
                if event is None:
                    return
                yield event
        finally:
            await follow.close()

    async def stream(self, given: Union[str, Request], *, pool: Optional[str] = None, chain: bool = True, durable: bool = False, wait: float = 600.0) -> AsyncIterator[Dict[str, Any]]:
        """Submits (or enqueues) a request and yields its events, subscribed before it starts."""
        body = _as_request(given)
        request_id = self.qualify(body["request_id"])
        subscription = await self._subscribe(request_id)
        try:
            if durable:
                await self.enqueue(body, pool=pool)
            else:
                await self.submit(body, pool=pool)
        except BaseException:
            await subscription.unsubscribe()
            raise
        async for event in self._events(subscription, request_id, chain, wait):
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
        summary (kept after its result is read). Here and in :meth:`result`, :meth:`cancel`
        and :meth:`follow`, `request_id` is the bare id or the qualified one."""
        return await self._call(f"gen.status.{self.qualify(request_id)}", {})

    async def result(self, request_id: str, *, release: bool = True) -> Dict[str, Any]:
        """The terminal result. `release` (the default) removes it: a second read gets
        NOT_FOUND. Not finished yet: NOT_READY."""
        return await self._call(f"gen.result.{self.qualify(request_id)}", {"release": release})

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
        return await self._call(f"gen.cancel.{self.qualify(request_id)}", {})

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


#: How long the events may be silent before the stored state is read.
CHECK_AFTER = 1.0
#: The longest silence between two reads while they find nothing new: each read that finds the
#: request still waiting in the queue, still running as it was known to, or its decision still
#: pending doubles the wait before the next, from CHECK_AFTER up to this; an event, or a read
#: that finds something new, brings CHECK_AFTER back. So many requests waiting behind busy
#: slots, running without streaming or waiting for a person do not each ask every second (as
#: the Rust client's `client::follow`).
CHECK_MAX = 16.0
_TERMINAL = ("COMPLETED", "FAILED", "CANCELLED")


class _Follow:
    """One request followed through its decision chain, as the Rust client's
    `client::follow` walks it: events first; the stored state read only where an event can be
    missed (after a second of silence, longer while the request waits in the queue, a skipped
    `seq`, a continuation that may have run before it was followed). A part whose events were
    missed gets its text from its stored result, as one `delta` event marked
    `"from_result": true`, so no text is given twice or lost; a missed `finished` is stood in
    for by the result (peeked); a `continued` or `chain_ended` whose `finished` was missed
    comes after it."""

    def __init__(self, client: "Client", subscription: Any, request_id: str, chain: bool, wait: float):
        self.client = client
        self.subscription = subscription
        self.current = request_id
        self.chain = chain
        self.wait = wait
        self.next_seq = 0
        self.gapped = False
        self.streamed = ""
        self.streamed_reasoning = ""
        self.awaiting_decision = False
        # Known to have started: an event of it came, or a read found it past the queue.
        self.started = False
        self.pending: List[Dict[str, Any]] = []
        self.done = False
        self.check_after = CHECK_AFTER

    async def close(self) -> None:
        await self.subscription.unsubscribe()

    async def next(self) -> Optional[Dict[str, Any]]:
        quiet = 0.0
        while True:
            if self.pending:
                return self.pending.pop(0)
            if self.done:
                return None
            silence = min(self.check_after, max(self.wait - quiet, 0.001))
            try:
                message = await self.subscription.next_msg(timeout=silence)
            except NatsTimeout:
                quiet += silence
                if quiet >= self.wait:
                    raise GenfleetError("TIMEOUT", f"no event of {self.current} within {self.wait} s") from None
                await self._check_stored()
                continue
            quiet = 0.0
            self.check_after = CHECK_AFTER
            await self._on_event(json.loads(message.data))

    async def _on_event(self, event: Dict[str, Any]) -> None:
        if event.get("request_id") != self.current:
            return
        seq = event.get("seq", self.next_seq)
        if seq < self.next_seq:
            return  # sent again after a move (docs/protocol.md, Resume): seen already
        if seq != self.next_seq and not self.gapped:
            _log.debug("an event of %s was missed: the text comes from the result", self.current)
            self.gapped = True
        self.next_seq = seq + 1
        self.started = True
        kind = event.get("event")
        open_ = not self.awaiting_decision
        if kind == "delta" and open_ and not self.gapped:
            self.streamed += event.get("text", "")
            self.pending.append(event)
        elif kind == "reasoning" and open_ and not self.gapped:
            self.streamed_reasoning += event.get("text", "")
            self.pending.append(event)
        elif kind in ("delta", "reasoning"):
            pass
        elif kind == "finished":
            if open_:
                self._on_result(event["result"], event)
        elif kind == "continued":
            await self._catch_up()
            if not self.done:
                await self._continue_as(event)
        elif kind == "chain_ended":
            await self._catch_up()
            if not self.done:
                self.done = True
                self.pending.append(event)
        elif open_:
            self.pending.append(event)

    async def _catch_up(self) -> None:
        """A `continued` or `chain_ended` came while the `finished` before it was missed."""
        if self.awaiting_decision or self.done:
            return
        result = await self.client.wait_result(self.current, release=False, wait=10.0)
        self._on_result(result, None)

    async def _check_stored(self) -> None:
        try:
            status = await self.client.status(self.current)
        except GenfleetError as error:
            if error.code == "NOT_FOUND":
                return  # not on record yet
            raise
        state = status.get("state")
        pending = (
            self.awaiting_decision
            and not status.get("continuation_request_id")
            and status.get("decision_outcome") in (None, "pending", "continued")
        )
        running = self.started and state not in _TERMINAL
        if state == "QUEUED" or running or pending:
            # Nothing new: still queued, still running as known, the decision still pending.
            self.check_after = min(self.check_after * 2, CHECK_MAX)
        else:
            self.check_after = CHECK_AFTER
        if state is not None and state != "QUEUED":
            self.started = True
        if self.awaiting_decision:
            if status.get("continuation_request_id"):
                await self._continue_as(
                    {
                        "event": "continued",
                        "request_id": self.current,
                        "continuation_request_id": status["continuation_request_id"],
                    }
                )
            elif status.get("decision_outcome") not in (None, "pending", "continued"):
                self.done = True
                self.pending.append({"event": "chain_ended", "request_id": self.current, "outcome": status["decision_outcome"]})
        elif status["state"] in _TERMINAL:
            result = await self.client.wait_result(self.current, release=False, wait=10.0)
            self._on_result(result, None)

    def _on_result(self, result: Dict[str, Any], event: Optional[Dict[str, Any]]) -> None:
        if result.get("request_id") != self.current:
            return
        reasoning = result.get("reasoning") or ""
        if reasoning.startswith(self.streamed_reasoning) and len(reasoning) > len(self.streamed_reasoning):
            self.pending.append(
                {"event": "reasoning", "request_id": self.current, "text": reasoning[len(self.streamed_reasoning):], "from_result": True}
            )
        output = result.get("output") or ""
        if output.startswith(self.streamed) and len(output) > len(self.streamed):
            self.pending.append({"event": "delta", "request_id": self.current, "text": output[len(self.streamed):], "from_result": True})
        asks = result.get("reason") == "decision_requested" and any(s.get("decision") for s in result.get("signals") or [])
        self.awaiting_decision = asks and self.chain
        self.done = not self.awaiting_decision
        self.pending.append(event or {"event": "finished", "request_id": self.current, "result": result})

    async def _continue_as(self, event: Dict[str, Any]) -> None:
        self.pending.append(event)
        # Subscribed to the continuation before the finished part is let go: should the
        # subscribe fail, the one subscription held is still the one `close` ends.
        following = self.client.qualify(event["continuation_request_id"])
        subscription = await self.client._subscribe(following)
        await self.subscription.unsubscribe()
        self.subscription = subscription
        self.current = following
        self.next_seq = 0
        self.gapped = False
        self.streamed = ""
        self.streamed_reasoning = ""
        self.awaiting_decision = False
        self.started = False

