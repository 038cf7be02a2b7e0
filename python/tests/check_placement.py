"""Checks the placement of keyed submits (tests/python_client.rs runs it).

Usage: check_placement.py VECTORS NATS_URL LOST_AFTER_MS WORKER_ID...

VECTORS is tests/data/placement.json, the vectors every implementation of the placement rule
is checked against. The fleet: the workers named, of pool `default`, 2 slots each and no other
worker, idle, with `worker.lost_after_ms` = LOST_AFTER_MS, backed by the echoing mock, on a
server where this connection may do anything. Fake heartbeats (`ghost-...` workers, some
answered by this script on their own subjects) show what the client sends where; they are
deleted before the end.

Exits non-zero with a message on the first failed check.
"""

import asyncio
import json
import sys
from typing import Any, Dict, List, Optional

import genfleet
from genfleet import GenfleetError, PoolView, WorkerLoad, choose, rank, score
from genfleet.placement import AFFINITY_FALLBACK_HEADER, PREFERRED_WORKER_HEADER, Heartbeats

POOL = "default"
BUCKET = "GENFLEET_WORKERS"
# Waits for the fleet (a view to load, a heartbeat to arrive) are bounded by tries, never timed.
TRIES = 600
PAUSE = 0.05


def check(cond, what):
    if not cond:
        raise AssertionError(what)


async def eventually(what, ready):
    """Polls `ready()` (sync or async) until it is true; fails after TRIES looks."""
    for _ in range(TRIES):
        got = ready()
        if asyncio.iscoroutine(got):
            got = await got
        if got:
            return got
        await asyncio.sleep(PAUSE)
    raise AssertionError(f"never: {what}")


def heartbeat(worker_id: str, *, slots: int = 2, busy: int = 0, pool: str = POOL, **more: Any) -> bytes:
    beat = {
        "worker_id": worker_id,
        "pool": pool,
        "slots": slots,
        "busy": busy,
        "draining": False,
        "ts": "2026-01-01T00:00:00Z",
        "running": [],
    }
    beat.update(more)
    return json.dumps(beat).encode()


def check_vectors(path: str) -> None:
    vectors = json.load(open(path, encoding="utf-8"))
    for case in vectors["scores"]:
        got = score(case["key"], case["worker_id"])
        check(str(got) == case["score"] and f"{got:016x}" == case["score_hex"], f"score {got:016x}: {case}")
    for case in vectors["rankings"]:
        check(rank(case["key"], case["workers"]) == case["ranked"], f"rank: {case}")
        # Given twice, a worker is ranked once.
        check(rank(case["key"], case["workers"] * 2) == case["ranked"], f"rank with duplicates: {case}")
    for case in vectors["choices"]:
        loads = [WorkerLoad(w["worker_id"], w["slots"], w["busy"]) for w in case["workers"]]
        got = choose(case["key"], loads, case["load_factor"])
        as_json = None if got is None else {"worker": got.worker, "key_worker": got.key_worker, "fallback": got.fallback}
        check(as_json == case["choice"], f"choose gave {as_json}: {case}")
        # A PoolView that heard the same heartbeats chooses the same.
        view = PoolView()
        for load in loads:
            view.note(load.worker_id, (load.slots, load.busy))
        check(view.choose(case["key"], case["load_factor"]) == got, f"PoolView.choose: {case}")
    counts = [len(vectors[part]) for part in ("scores", "rankings", "choices")]
    check(all(counts) and counts[2] >= 10, f"vectors: {counts}")
    print(f"ok: the placement vectors hold: {counts[0]} scores, {counts[1]} rankings, {counts[2]} choices")


def check_pool_view() -> None:
    check(genfleet.DEFAULT_LOAD_FACTOR == 2.0, "the default load factor")
    check(choose("k", []) is None and choose("k", [("w1", 1, 1), ("w2", 1, 1)]) is None, "no free slot: no choice")
    view = PoolView()
    view.note("w1", (2, 0))
    view.note("w2", (2, 2))
    view.note("w3", None)
    check(len(view) == 2 and "w3" not in view, f"{view.workers()}")
    view.sent("w1")
    view.sent("w1")
    view.sent("w1")
    check(view.workers()[0] == WorkerLoad("w1", 2, 2), f"sent counts up to the slots: {view.workers()}")
    check(not view.any_free() and view.choose("any") is None, "every slot counted busy")
    view.note("w1", (2, 0))
    check(view.workers()[0].busy == 0, "the next heartbeat replaces what was counted")
    # A skipped worker stays the key's worker but offers no slot.
    key = next(k for k in (f"k{i}" for i in range(100)) if rank(k, ["w1", "w2"])[0] == "w1")
    view.note("w2", (2, 0))
    skipped = view.choose(key, 0.0, skip="w1")
    check(skipped is not None and (skipped.worker, skipped.key_worker, skipped.fallback) == ("w2", "w1", "busy"), f"{skipped}")
    view.forget("w1")
    check([w.worker_id for w in view.workers()] == ["w2"], f"{view.workers()}")
    print("ok: a pool view counts what was sent until the next heartbeat, and forgets")


def check_heartbeats_followed() -> None:
    """The view a client keeps from the bucket's entries, fed here by hand with a clock of the
    check's own."""
    now = [100.0]
    beats = Heartbeats(None, clock=lambda: now[0])
    beats.max_age = 10.0
    beats.note("w1", heartbeat("w1"))
    beats.note("w2", heartbeat("w2", busy=1))
    beats.note("w3", heartbeat("w3", pool="other"))
    beats.note("w4", heartbeat("w4", draining=True))
    beats.note("w5", heartbeat("w5", paused=True))
    beats.note("w6", b"not a heartbeat")
    beats.note("w.7", heartbeat("w.7"))
    check(beats.choose(POOL, "k") is None, "a view not loaded chooses nothing")
    beats.loaded()
    ids = lambda pool: [w.worker_id for w in beats.view(pool).workers()]  # noqa: E731
    check(ids(POOL) == ["w1", "w2"], f"the pool's live workers that take work: {ids(POOL)}")
    check(ids("other") == ["w3"], f"another pool's: {ids('other')}")
    check(beats.choose(POOL, "k") == choose("k", beats.view(POOL).workers()), "the view chooses by the rule")
    # A worker that stops taking work, or moves to another pool, leaves the pool's view.
    beats.note("w2", heartbeat("w2", paused=True))
    check(ids(POOL) == ["w1"], f"paused: {ids(POOL)}")
    beats.note("w2", heartbeat("w2"))
    beats.note("w1", heartbeat("w1", pool="other"))
    check(ids(POOL) == ["w2"] and ids("other") == ["w1", "w3"], f"moved: {ids(POOL)} {ids('other')}")
    # Something that is no heartbeat leaves what was known.
    beats.note("w2", b'{"pool": "default", "slots": -1, "busy": 0}')
    check(ids(POOL) == ["w2"], f"a bad value: {ids(POOL)}")
    # Deleted (a clean stop) or purged: dropped at once.
    beats.note("w2", None)
    check(ids(POOL) == [], f"deleted: {ids(POOL)}")
    # Not refreshed within the bucket's max age: dropped as the server drops the entry.
    beats.note("w8", heartbeat("w8"))
    now[0] += 6.0
    beats.note("w9", heartbeat("w9"))
    now[0] += 3.9
    check(ids(POOL) == ["w8", "w9"], f"within the max age: {ids(POOL)}")
    now[0] += 0.1
    check(ids(POOL) == ["w9"], f"w8 past the max age: {ids(POOL)}")
    beats.note("w9", heartbeat("w9"))
    now[0] += 9.0
    check(ids(POOL) == ["w9"], f"refreshed: {ids(POOL)}")
    beats.sent(POOL, "w9")
    check(beats.view(POOL).workers() == [WorkerLoad("w9", 2, 1)], f"{beats.view(POOL).workers()}")
    print("ok: the heartbeats followed: pools, draining and paused workers, deletes and the max age")


async def check_lazy_and_off(url: str, workers: List[str]) -> None:
    async with await genfleet.Client.connect(url, timeout=10.0) as fleet:
        result = await fleet.run(genfleet.request("Nothing keyed"))
        check(result["state"] == "COMPLETED" and "affinity" not in result, f"{result}")
        check(fleet._heartbeats is None, "a client that sends no key follows no heartbeats")
    async with await genfleet.Client.connect(url, timeout=10.0, placement=False) as fleet:
        result = await fleet.run(genfleet.request("Keyed, placement off", affinity_key="py-off"))
        # The pool's worker that received it placed it on the key's worker.
        key_worker = rank("py-off", workers)[0]
        expected = {"key": "py-off", "preferred_worker": key_worker, "held": True}
        check(result["worker_id"] == key_worker, f"placement off: ran on {result['worker_id']}")
        check(result["affinity"] == expected, f"placement off: {result['affinity']}")
        check(not await fleet.placement_ready(wait=1.0), "placement off is never ready")
        check(fleet._heartbeats is None, "placement off follows no heartbeats")
    print("ok: heartbeats followed only from the first keyed submit, and not at all with placement off (the pool's worker places its keyed submits)")


def load_of(fleet: genfleet.Client, worker_id: str) -> Optional[WorkerLoad]:
    """What `fleet`'s view of the pool says of a worker (`None`: not in it)."""
    return next((w for w in fleet._heartbeats.view(POOL).workers() if w.worker_id == worker_id), None)


async def ready_client(url: str, workers: List[str], **options: Any) -> genfleet.Client:
    fleet = await genfleet.Client.connect(url, timeout=10.0, **options)
    check(await fleet.placement_ready(wait=60.0), "the view never loaded")
    await eventually(
        f"the view to show {workers}",
        lambda: sorted(w.worker_id for w in fleet._heartbeats.view(POOL).workers()) == sorted(workers),
    )
    return fleet


async def check_chains(url: str, workers: List[str], lost_after_ms: int) -> None:
    """Conversations whose every turn comes from a fresh client: each turn lands on the key's
    worker, the first in rank of the workers' ids."""
    chains, turns, landed = 6, 3, set()
    for chain in range(chains):
        key = f"py-chat-{chain}"
        expected = rank(key, workers)[0]
        messages: List[Dict[str, Any]] = []
        for turn in range(1, turns + 1):
            messages.append({"role": "user", "content": f"chain {chain}, turn {turn}: go on"})
            fleet = await ready_client(url, workers)
            try:
                check(fleet._heartbeats.max_age == lost_after_ms / 1000, f"max age {fleet._heartbeats.max_age}")
                result = await fleet.run(genfleet.request(messages=list(messages), affinity_key=key))
            finally:
                await fleet.close()
            check(result["state"] == "COMPLETED", f"{key} turn {turn}: {result}")
            check(result["worker_id"] == expected, f"{key} turn {turn} ran on {result['worker_id']}, not {expected}")
            record = result["affinity"]
            check(record == {"key": key, "preferred_worker": expected, "held": True}, f"{key} turn {turn}: {record}")
            messages.append({"role": "assistant", "content": result["output"]})
            landed.add(result["worker_id"])
    print(f"ok: {chains} keyed chains of {turns} turns, each turn from a new client, held on the key's worker ({len(landed)} workers used)")


class FakeWorker:
    """A worker's own submit subject answered by this check: what came, and with which
    headers."""

    def __init__(self, nc: Any, worker_id: str):
        self.nc = nc
        self.worker_id = worker_id
        self.answer: Optional[Dict[str, Any]] = None
        # Takes the submit and never answers (a node lost without closing its connections).
        self.silent = False
        self.got: List[Dict[str, Any]] = []
        self.subscription = None

    async def start(self) -> "FakeWorker":
        async def on_submit(message):
            body = json.loads(message.data)
            self.got.append({"subject": message.subject, "headers": dict(message.headers or {}), "body": body})
            if self.silent:
                return
            answer = self.answer or {"request_id": body["request_id"], "worker_id": self.worker_id, "state": "RUNNING"}
            await message.respond(json.dumps(answer).encode())

        self.subscription = await self.nc.subscribe(f"gen.worker.{self.worker_id}.submit", cb=on_submit)
        await self.nc.flush()
        return self

    async def stop(self) -> None:
        await self.subscription.unsubscribe()


def key_ranking(first: List[str], among: List[str], prefix: str) -> str:
    """A key whose rank among `among` starts with `first`."""
    for i in range(100_000):
        key = f"{prefix}-{i}"
        if rank(key, among)[: len(first)] == first:
            return key
    raise AssertionError(f"no key ranks {first} first")


async def check_fallbacks(url: str, workers: List[str]) -> None:
    ghost, other = "ghost-a", "ghost-b"
    async with await genfleet.Client.connect(url, timeout=10.0) as admin:
        kv = await admin.nc.jetstream().key_value(BUCKET)
        fake = await FakeWorker(admin.nc, ghost).start()
        fake_other = await FakeWorker(admin.nc, other).start()
        await kv.put(ghost, heartbeat(ghost, slots=4))
        key = key_ranking([ghost], workers + [ghost], "py-ghost")
        fleet = await ready_client(url, workers + [ghost])
        try:
            # The key's worker refuses (no slot): to the pool at once, saying so.
            fake.answer = {"error": {"code": "NO_SLOT_AVAILABLE", "message": "no free slot"}}
            result = await fleet.run(genfleet.request("Refused by the key's worker", affinity_key=key))
            check([g["headers"] for g in fake.got] == [{PREFERRED_WORKER_HEADER: ghost}], f"{fake.got}")
            check(result["worker_id"] in workers, f"{result['worker_id']}")
            check(result["affinity"] == {"key": key, "preferred_worker": ghost, "held": False, "fallback": "busy"}, f"{result['affinity']}")

            # Gone ("no responders"): the same.
            await fake.stop()
            await kv.put(ghost, heartbeat(ghost, slots=4))  # the count this client kept is replaced
            await eventually("the ghost's heartbeat to be followed", lambda: load_of(fleet, ghost) == WorkerLoad(ghost, 4, 0))
            result = await fleet.run(genfleet.request("Its worker is gone", affinity_key=key))
            check(result["affinity"] == {"key": key, "preferred_worker": ghost, "held": False, "fallback": "busy"}, f"{result['affinity']}")

            # Silent (its subscription there, nothing answers): to the pool after a moment.
            fake = await FakeWorker(admin.nc, ghost).start()
            fake.silent = True
            await kv.put(ghost, heartbeat(ghost, slots=4))
            await eventually("the ghost's heartbeat to be followed", lambda: load_of(fleet, ghost) == WorkerLoad(ghost, 4, 0))
            result = await fleet.run(genfleet.request("Its worker does not answer", affinity_key=key))
            check(len(fake.got) == 1 and fake.got[0]["body"]["request_id"] == result["request_id"], f"{fake.got}")
            check(result["worker_id"] in workers, f"{result['worker_id']}")
            check(result["affinity"] == {"key": key, "preferred_worker": ghost, "held": False, "fallback": "busy"}, f"{result['affinity']}")
            await fake.stop()
            # The submit sent it counts against it until its next heartbeat: one with no busy slot.
            await kv.put(ghost, heartbeat(ghost, slots=4))
            await eventually("the ghost's heartbeat to be followed", lambda: load_of(fleet, ghost) == WorkerLoad(ghost, 4, 0))

            # Any other answer is final: an acceptance, or a refusal of another kind.
            fake = await FakeWorker(admin.nc, ghost).start()
            accepted = await fleet.submit(genfleet.request("Taken by the key's worker", request_id="py-taken", affinity_key=key))
            check(accepted == {"request_id": "py-taken", "worker_id": ghost, "state": "RUNNING"}, f"{accepted}")
            fake.answer = {"error": {"code": "DUPLICATE_REQUEST_ID", "message": "in use"}}
            try:
                await fleet.submit(genfleet.request("Refused for good", request_id="py-refused", affinity_key=key))
            except GenfleetError as error:
                check(error.code == "DUPLICATE_REQUEST_ID", f"{error}")
            else:
                raise AssertionError("a refusal other than NO_SLOT_AVAILABLE was not final")
            for request_id in ("py-taken", "py-refused"):
                try:
                    await fleet.status(request_id)
                except GenfleetError as error:
                    check(error.code == "NOT_FOUND", f"{error}")
                else:
                    raise AssertionError(f"{request_id} reached the pool after a final answer")
            check([g["subject"] for g in fake.got] == [f"gen.worker.{ghost}.submit"] * 2, f"{fake.got}")
        finally:
            await fleet.close()

        # A key's worker whose heartbeat shows it full is passed over for the next in rank (a
        # submit sent is not counted against it: requests are as often short as not); its next
        # heartbeat with a free slot takes the key back.
        fake.got.clear()
        fake.answer = None
        await kv.put(ghost, heartbeat(ghost, slots=2, busy=2))
        fleet = await ready_client(url, workers + [ghost], load_factor=0.0)
        try:
            full = await fleet.run(genfleet.request("The key's worker is full", affinity_key=key))
            check(full["worker_id"] == rank(key, workers)[0], f"the next in rank: {full['worker_id']}")
            check(full["affinity"]["fallback"] == "busy", f"{full['affinity']}")
            check(not fake.got, f"{len(fake.got)} submits reached the full worker")
            await kv.put(ghost, heartbeat(ghost, slots=2))
            await eventually("the ghost's next heartbeat", lambda: load_of(fleet, ghost) == WorkerLoad(ghost, 2, 0))
            again = await fleet.submit(genfleet.request("Free again", affinity_key=key))
            check(again["worker_id"] == ghost, f"{again}")
        finally:
            await fleet.close()

        # Over the load bound: the next in rank, on its own subject, told why.
        fake.got.clear()
        await kv.put(ghost, heartbeat(ghost, slots=4, busy=3))
        await kv.put(other, heartbeat(other, slots=4))
        both = workers + [ghost, other]
        loaded_key = key_ranking([ghost, other], both, "py-load")
        fleet = await ready_client(url, both, load_factor=1.0)
        try:
            taken = await fleet.submit(genfleet.request("Over the bound", affinity_key=loaded_key))
            check(taken["worker_id"] == other and not fake.got, f"{taken} {fake.got}")
            check(
                fake_other.got[-1]["headers"] == {PREFERRED_WORKER_HEADER: ghost, AFFINITY_FALLBACK_HEADER: "load"},
                f"{fake_other.got}",
            )
            # Draining, purged or deleted (a clean stop): out of the view at once.
            await kv.put(other, heartbeat(other, slots=4, draining=True))
            await eventually("a draining worker to leave the view", lambda: load_of(fleet, other) is None)
            await kv.put(other, heartbeat(other, slots=4))
            await eventually("the worker back in the view", lambda: load_of(fleet, other) is not None)
            await kv.purge(other)
            await eventually("a purged worker to leave the view", lambda: load_of(fleet, other) is None)
            await kv.delete(ghost)
            await eventually("a deleted worker to leave the view", lambda: load_of(fleet, ghost) is None)
            # The key's worker ran the full-worker turn above; until a heartbeat says it is idle
            # again, one busy slot of six is over this client's bound of 1.0.
            home = rank(key, workers)[0]
            await eventually("the key's worker idle in the view", lambda: load_of(fleet, home) == WorkerLoad(home, 2, 0))
            result = await fleet.run(genfleet.request("Back on a live worker", affinity_key=key))
            check(result["affinity"] == {"key": key, "preferred_worker": home, "held": True}, f"{result['affinity']}")
        finally:
            await fleet.close()
        await fake.stop()
        await fake_other.stop()
        await kv.purge(ghost)
    print("ok: a refusal, a gone worker or one that does not answer sends the keyed submit to the pool at once, saying busy; other answers are final; the load bound holds and a full key's worker is passed over")


async def main(vectors: str, url: str, lost_after_ms: str, *workers: str) -> None:
    check(len(workers) >= 2, f"workers: {workers}")
    check_vectors(vectors)
    check_pool_view()
    check_heartbeats_followed()
    await check_lazy_and_off(url, list(workers))
    await check_chains(url, list(workers), int(lost_after_ms))
    await check_fallbacks(url, list(workers))
    print("python placement: all checks passed")


if __name__ == "__main__":
    asyncio.run(main(*sys.argv[1:]))
