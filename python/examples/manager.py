"""A manager: prints every signal, and answers each decision with its default option.

    python examples/manager.py

Managers named alike share the signals; this one is "py-example". NATS is at
$GENFLEET_NATS_URL (default nats://127.0.0.1:4222).
"""

import asyncio
import os

import nats

from genfleet import Manager


async def on_signal(signal: dict, manager: Manager) -> None:
    print(f"{signal['type']}.{signal['code']}: {signal['summary']} (request {signal['request_id']})", flush=True)
    decision = signal.get("decision")
    if decision:
        option = decision.get("default_option") or decision["options"][0]["id"]
        reply = await manager.decide(signal, option, rationale="the example takes the default")
        print(f"answered {decision['decision_id']} with {option}: {reply['outcome']}", flush=True)


async def main() -> None:
    nc = await nats.connect(os.environ.get("GENFLEET_NATS_URL", "nats://127.0.0.1:4222"))
    manager = await Manager(nc, "py-example", on_signal, deliver="new").start()
    print("following the fleet's signals", flush=True)
    try:
        await manager.run()
    finally:
        await nc.drain()


if __name__ == "__main__":
    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        pass
