"""A tool service: counts the words of a text, for any model of the fleet to call.

    python examples/word_count_tool.py

Registers `word_count` in the fleet's tool bucket and answers its calls until Ctrl-C, then
withdraws it. NATS is at $GENFLEET_NATS_URL (default nats://127.0.0.1:4222).
"""

import asyncio
import os

import nats

from genfleet import ToolError, ToolService, tool


@tool(when_to_use="Any question about how long a text is.")
def word_count(text: str, unique: bool = False) -> dict:
    """Count the words of a text (or only its distinct words)."""
    words = text.split()
    if not words:
        raise ToolError("EMPTY_TEXT", "the text has no words")
    return {"words": len(set(words)) if unique else len(words)}


async def main() -> None:
    nc = await nats.connect(os.environ.get("GENFLEET_NATS_URL", "nats://127.0.0.1:4222"))
    service = await ToolService(nc, [word_count]).start()
    print("serving: word_count", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        await service.stop()
        await nc.drain()


if __name__ == "__main__":
    try:
        asyncio.run(main())
    except KeyboardInterrupt:
        pass
