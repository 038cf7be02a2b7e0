"""Ask the fleet: stream one request's output, follow it through any decision, print the end.

    python examples/ask.py "What is 1234 × 5678?" --tool calculate

NATS is at $GENFLEET_NATS_URL (default nats://127.0.0.1:4222); the pool is "default".
"""

import argparse
import asyncio
import os
import sys

import genfleet


async def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("prompt")
    parser.add_argument("--tool", action="append", default=[], help="a tool the model may call")
    args = parser.parse_args()
    url = os.environ.get("GENFLEET_NATS_URL", "nats://127.0.0.1:4222")
    async with await genfleet.Client.connect(url) as fleet:
        request = genfleet.request(args.prompt, tools=args.tool, job_name="ask")
        # Events are at most once: a continuation can start before it is followed, so the
        # text of a request whose deltas were missed is printed from its result.
        streamed = False
        async for event in fleet.stream(request):
            if event["event"] == "delta":
                streamed = True
                print(event["text"], end="", flush=True)
            elif event["event"] == "tool_call":
                print(f"\n[tool call: {event['name']} {event['arguments']}]", flush=True)
            elif event["event"] == "continued":
                streamed = False
                print(f"\n[the decision was answered: continuing as {event['continuation_request_id']}]", flush=True)
            elif event["event"] == "finished":
                result = event["result"]
                if not streamed and result.get("output"):
                    print(result["output"], end="", flush=True)
                print(f"\n[{result['request_id']} {result['state']} {result['reason']}]", flush=True)
        return 0 if result["state"] == "COMPLETED" else 1


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
