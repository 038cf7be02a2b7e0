"""A manager loop: the fleet's signals through a durable consumer, and decisions answered.

Managers of one name share the signals between them (one durable pull consumer,
`genfleet-manager-<name>`, on stream `GENFLEET_SIGNALS`, as `genfleet manager` uses); managers
of different names each see every signal. A signal is acknowledged once the handler returns, so
one a manager dies on comes back to another of its name. docs/manager.md and docs/protocol.md
("Decisions") describe the signals and the answers.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import logging
from typing import Any, Awaitable, Callable, Dict, Optional, Union

from nats.aio.client import Client as NATS
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from .client import Client

Signal = Dict[str, Any]
Handler = Callable[[Signal, "Manager"], Union[None, Awaitable[None]]]

STREAM = "GENFLEET_SIGNALS"

log = logging.getLogger("genfleet.manager")


class Manager:
    """Pulls signals and hands each to `handler(signal, manager)`; the handler answers
    decisions with :meth:`decide` (or leaves them to others)."""

    def __init__(
        self,
        nc: NATS,
        name: str,
        handler: Handler,
        *,
        deliver: str = "all",
        stream: str = STREAM,
        subjects: str = "signals.>",
        ack_wait: float = 30.0,
        max_in_flight: int = 256,
        decided_by: Optional[str] = None,
    ):
        if deliver not in ("all", "new"):
            raise ValueError("deliver must be 'all' or 'new'")
        self.nc = nc
        self.name = name
        self.handler = handler
        self.deliver = deliver
        self.stream = stream
        self.subjects = subjects
        self.ack_wait = ack_wait
        self.max_in_flight = max_in_flight
        self.decided_by = decided_by or f"manager:{name}"
        self.client = Client(nc)
        self._stopped = asyncio.Event()
        self._subscription: Any = None

    @property
    def durable(self) -> str:
        """The durable consumer this manager shares with those of its name."""
        return f"genfleet-manager-{self.name}"

    async def decide(self, signal: Signal, option_id: str, *, rationale: Optional[str] = None, **answer: Any) -> Dict[str, Any]:
        """Answers the decision a signal carries, as this manager."""
        decision = signal.get("decision") or {}
        if "decision_id" not in decision:
            raise ValueError("this signal asks no decision")
        return await self.client.decide(
            decision["decision_id"], option_id, rationale=rationale, decided_by=self.decided_by, **answer
        )

    def stop(self) -> None:
        """Ends :meth:`run` after the signal in hand."""
        self._stopped.set()

    async def start(self) -> "Manager":
        """Opens (or creates) the durable consumer: signals published from now on reach this
        manager's name, even before :meth:`run` pulls them."""
        if self._subscription is not None:
            return self
        js = self.nc.jetstream()
        config = ConsumerConfig(
            durable_name=self.durable,
            filter_subject=self.subjects,
            ack_policy=AckPolicy.EXPLICIT,
            ack_wait=self.ack_wait,
            deliver_policy=DeliverPolicy.NEW if self.deliver == "new" else DeliverPolicy.ALL,
            max_ack_pending=self.max_in_flight,
        )
        self._subscription = await js.pull_subscribe(
            self.subjects, durable=self.durable, stream=self.stream, config=config
        )
        return self

    async def run(self) -> None:
        """Follows the signals until :meth:`stop` (or cancellation)."""
        await self.start()
        subscription = self._subscription
        try:
            while not self._stopped.is_set():
                try:
                    messages = await subscription.fetch(batch=16, timeout=1.0)
                except asyncio.TimeoutError:
                    # nats-py's own TimeoutError, or (when the wait runs out between its two
                    # pull requests) asyncio's: either way, no signal this second.
                    continue
                for message in messages:
                    try:
                        signal = json.loads(message.data)
                    except ValueError:
                        await message.term()  # not a signal: never again
                        continue
                    await self._handle(signal, message)
        finally:
            self._subscription = None
            await subscription.unsubscribe()

    async def _handle(self, signal: Signal, message: Any) -> None:
        # Kept alive while the handler works (it may wait on a person or a model).
        async def keep_alive() -> None:
            while True:
                await asyncio.sleep(max(self.ack_wait / 3, 0.1))
                await message.in_progress()

        alive = asyncio.ensure_future(keep_alive())
        try:
            outcome = self.handler(signal, self)
            if inspect.isawaitable(outcome):
                await outcome
        except Exception:
            alive.cancel()
            log.exception("the handler failed on signal %s; it comes back in a second", signal.get("signal_id"))
            await message.nak(delay=1.0)  # another try, here or at another manager
            return
        alive.cancel()
        await message.ack()
