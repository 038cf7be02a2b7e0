"""Placement by affinity key, the same rule every party of the fleet applies (docs/protocol.md,
Affinity): rendezvous hashing of the key against the ids of the pool's live workers, with
bounded loads.

Workers, gateway replicas, the Rust client and this package rank a key's workers alike, so a
conversation lands on the same worker whichever of them sends it; a client that reads no
heartbeats sends its keyed submits to the pool, and the worker that receives one places it by
this same rule. `tests/data/placement.json` holds the vectors every implementation is checked
against (python/tests/check_placement.py checks these functions with them).

- :func:`score`: a worker's score for a key, the first 8 bytes (big-endian, unsigned) of
  SHA-256(key's UTF-8 bytes, one zero byte, the worker id's UTF-8 bytes);
- :func:`rank`: the workers by score, highest first, equal scores by worker id (bytewise
  ascending), each once;
- :func:`choose`: among the pool's live workers that take work, the first in rank with a free
  slot whose load stays bounded.

:class:`Heartbeats` is how a :class:`~genfleet.Client` follows the workers' heartbeats (KV
bucket `GENFLEET_WORKERS`) into a :class:`PoolView` per pool.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import math
import re
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterable, List, Optional, Tuple, Union

#: The bounded-load factor used when none is set: a worker already busier than twice the
#: pool's average share is passed over for the next in rank.
DEFAULT_LOAD_FACTOR = 2.0
#: The KV bucket of the workers' heartbeats (key: the worker id).
WORKERS_BUCKET = "GENFLEET_WORKERS"
#: The header naming the key's worker (the first in rank) on a keyed submit.
PREFERRED_WORKER_HEADER = "Genfleet-Preferred-Worker"
#: The header saying why a keyed submit is not on its key's worker (`busy` or `load`).
AFFINITY_FALLBACK_HEADER = "Genfleet-Affinity-Fallback"

# A worker id that can name its own submit subject (every genfleet worker's can).
_WORKER_ID = re.compile(r"^[A-Za-z0-9_-]{1,256}$")

_log = logging.getLogger("genfleet")


def score(key: str, worker_id: str) -> int:
    """A worker's score for `key`: the first 8 bytes of SHA-256(key ‖ 0x00 ‖ worker_id),
    big-endian, unsigned."""
    digest = hashlib.sha256(key.encode("utf-8") + b"\x00" + worker_id.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big")


def rank(key: str, workers: Iterable[str]) -> List[str]:
    """`workers` in the key's order: highest score first, equal scores by id (bytewise
    ascending); a worker given twice comes once."""
    unique = dict.fromkeys(workers)
    return sorted(unique, key=lambda w: (-score(key, w), w.encode("utf-8")))


@dataclass(frozen=True)
class WorkerLoad:
    """A live worker of the pool that takes work, as its last heartbeat tells."""

    worker_id: str
    slots: int
    busy: int

    @property
    def free(self) -> int:
        return max(self.slots - self.busy, 0)


@dataclass(frozen=True)
class Choice:
    """Where a keyed request goes: `worker` takes it; `key_worker` is the first in the key's
    rank; `fallback` says why they differ (`"busy"`: the key's worker has no free slot;
    `"load"`: it is over the load bound), `None` when they are the same."""

    worker: str
    key_worker: str
    fallback: Optional[str] = None


Loads = Iterable[Union[WorkerLoad, Tuple[str, int, int]]]


def _over_load(worker: WorkerLoad, busy_total: int, slots_total: int, load_factor: float) -> bool:
    """Whether `worker` is passed over for the bounded load, in the order docs/protocol.md
    gives: at least half its slots busy (2 × busy ≥ slots) and, in IEEE 754 doubles,
    busy × S ≥ load_factor × (B + 1) × slots. A factor below 1 (0 among them) or not finite
    bounds nothing."""
    if not (math.isfinite(load_factor) and load_factor >= 1.0):
        return False
    if 2 * worker.busy < worker.slots:
        return False
    left = float(worker.busy) * float(slots_total)
    right = load_factor * float(busy_total + 1) * float(worker.slots)
    return left >= right


def choose(key: str, workers: Loads, load_factor: float = DEFAULT_LOAD_FACTOR) -> Optional[Choice]:
    """Where a request with `key` goes among `workers` (the pool's live workers that take work,
    as :class:`WorkerLoad` or `(worker_id, slots, busy)`): the first in rank with a free slot
    and a bounded load; when every worker with a free slot is over the bound, the first in
    rank with a free slot (the bound moves work, it never refuses it). `None` when no worker
    has a free slot, or there is none. A worker given twice counts as its last."""
    by_id: Dict[str, WorkerLoad] = {}
    for worker in workers:
        if not isinstance(worker, WorkerLoad):
            worker = WorkerLoad(*worker)
        by_id[worker.worker_id] = worker
    ranked = rank(key, by_id)
    if not ranked:
        return None
    key_worker = ranked[0]
    busy_total = sum(w.busy for w in by_id.values())
    slots_total = sum(w.slots for w in by_id.values())
    with_free = [by_id[w] for w in ranked if by_id[w].free > 0]
    if not with_free:
        return None
    chosen = next(
        (w for w in with_free if not _over_load(w, busy_total, slots_total, load_factor)),
        with_free[0],
    )
    if chosen.worker_id == key_worker:
        fallback = None
    elif by_id[key_worker].free == 0:
        fallback = "busy"
    else:
        fallback = "load"
    return Choice(worker=chosen.worker_id, key_worker=key_worker, fallback=fallback)


class PoolView:
    """A pool's live workers that take work, as heartbeats tell them: what :func:`choose`
    ranks. :meth:`sent` counts a submit sent to a worker as one more busy slot there until its
    next heartbeat (the client does not: its keyed submits are as often short as not)."""

    def __init__(self) -> None:
        self._workers: Dict[str, WorkerLoad] = {}

    def note(self, worker_id: str, load: Optional[Tuple[int, int]]) -> None:
        """A heartbeat: the worker's `(slots, busy)` now, or `None` when it takes no work
        (another pool, draining, paused)."""
        if load is None:
            self._workers.pop(worker_id, None)
        else:
            slots, busy = load
            self._workers[worker_id] = WorkerLoad(worker_id, slots, busy)

    def forget(self, worker_id: str) -> None:
        """The worker stopped or is lost."""
        self._workers.pop(worker_id, None)

    def sent(self, worker_id: str) -> None:
        """A submit went to `worker_id`: one more busy slot there until its next heartbeat."""
        worker = self._workers.get(worker_id)
        if worker is not None:
            self._workers[worker_id] = WorkerLoad(worker_id, worker.slots, min(worker.busy + 1, worker.slots))

    def workers(self) -> List[WorkerLoad]:
        """The workers followed, by id."""
        return [self._workers[w] for w in sorted(self._workers)]

    def any_free(self) -> bool:
        """Whether any worker followed has a free slot."""
        return any(w.free > 0 for w in self._workers.values())

    def __len__(self) -> int:
        return len(self._workers)

    def __contains__(self, worker_id: object) -> bool:
        return worker_id in self._workers

    def choose(self, key: str, load_factor: float = DEFAULT_LOAD_FACTOR, *, skip: Optional[str] = None) -> Optional[Choice]:
        """Where a request with `key` goes among the workers followed; a `skip`ped worker (one
        that just refused it) stays ranked, so it is still the key's worker, but offers no
        slot."""
        loads = (
            WorkerLoad(w.worker_id, w.slots, w.slots) if w.worker_id == skip else w
            for w in self._workers.values()
        )
        return choose(key, loads, load_factor)


def _heartbeat_load(value: bytes) -> Optional[Tuple[str, Optional[Tuple[int, int]]]]:
    """A heartbeat's pool and, when the worker takes work, its `(slots, busy)`; `None` for a
    value that is no heartbeat."""
    try:
        beat = json.loads(value)
    except (ValueError, TypeError):
        return None
    if not isinstance(beat, dict):
        return None
    pool, slots, busy = beat.get("pool"), beat.get("slots"), beat.get("busy")
    counts = (slots, busy)
    if not isinstance(pool, str) or not all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in counts):
        return None
    if beat.get("draining") is True or beat.get("paused") is True:
        return pool, None
    return pool, (slots, busy)


def _refusal_of_workers_bucket(error: BaseException) -> bool:
    """Whether `error` is the server refusing this connection the heartbeats bucket (its
    stream's API or its subjects)."""
    text = str(error).lower()
    return "permissions violation" in text and WORKERS_BUCKET.lower() in text


class Heartbeats:
    """The workers' heartbeats as a client follows them: a watch of every key of bucket
    `GENFLEET_WORKERS` (each worker's last heartbeat first, then every new one), kept as a
    :class:`PoolView` per pool.

    A worker whose heartbeat is deleted (it stopped cleanly) or purged is dropped at once; one
    whose heartbeat has not come for the bucket's max age (`worker.lost_after_ms`: the server
    drops the entry then, silently) is dropped as it would be. Until the watch has delivered
    every worker's last heartbeat, :meth:`choose` gives `None`. When the bucket cannot be read
    (the user may not, or there is none), following stops for good, with one debug line.
    """

    def __init__(self, nc: Any, *, timeout: float = 15.0, clock: Callable[[], float] = time.monotonic):
        self.nc = nc
        self.timeout = timeout
        self.clock = clock
        #: `idle` (not started), `loading`, `ready` (the view is loaded) or `unavailable`
        #: (the bucket cannot be read, or :meth:`stop` was called: following stopped).
        self.state = "idle"
        #: Seconds after its last heartbeat that a worker is dropped (the bucket's max age;
        #: `None`: never, only when deleted).
        self.max_age: Optional[float] = None
        self._views: Dict[str, PoolView] = {}
        # Each worker followed: its pool and when its last heartbeat arrived.
        self._seen: Dict[str, Tuple[str, float]] = {}
        self._task: Optional[asyncio.Task] = None
        self._watcher: Any = None
        # Set once the view is loaded or following stopped (made in the loop that follows).
        self._settled: Optional[asyncio.Event] = None
        self._refused: Optional[asyncio.Event] = None

    # The view, kept from the entries (also fed directly by tests).

    def note(self, worker_id: str, value: Optional[bytes], now: Optional[float] = None) -> None:
        """An entry of the bucket: a heartbeat (`value`), or `None` for a delete or purge."""
        if not _WORKER_ID.fullmatch(worker_id):
            return
        if value is None:
            self._drop(worker_id)
            return
        beat = _heartbeat_load(value)
        if beat is None:
            return  # not a heartbeat: what was known of the worker stands
        pool, load = beat
        was = self._seen.get(worker_id)
        if was is not None and was[0] != pool:
            self._drop(worker_id)
        self._seen[worker_id] = (pool, self.clock() if now is None else now)
        self._views.setdefault(pool, PoolView()).note(worker_id, load)

    def loaded(self) -> None:
        """Every worker's last heartbeat has been delivered."""
        if self.state in ("idle", "loading"):
            self.state = "ready"
        if self._settled is not None:
            self._settled.set()

    def _drop(self, worker_id: str) -> None:
        was = self._seen.pop(worker_id, None)
        if was is not None and was[0] in self._views:
            self._views[was[0]].forget(worker_id)

    def _expire(self, now: float) -> None:
        if not self.max_age:
            return
        stale = [w for w, (_, seen) in self._seen.items() if now - seen >= self.max_age]
        for worker_id in stale:
            self._drop(worker_id)

    def view(self, pool: str, now: Optional[float] = None) -> PoolView:
        """The live workers of `pool` that take work, as far as the heartbeats tell now."""
        self._expire(self.clock() if now is None else now)
        return self._views.setdefault(pool, PoolView())

    def choose(self, pool: str, key: str, load_factor: float = DEFAULT_LOAD_FACTOR) -> Optional[Choice]:
        """Where a request with `key` goes in `pool`; `None` until the view is loaded, or when
        no worker of the pool has a free slot."""
        if self.state != "ready":
            return None
        return self.view(pool).choose(key, load_factor)

    def sent(self, pool: str, worker_id: str) -> None:
        """A submit went to `worker_id`: one more busy slot there until its next heartbeat."""
        self._views.setdefault(pool, PoolView()).sent(worker_id)

    # Following.

    def start(self, listen: Optional[Callable[[Callable[[BaseException], bool]], None]] = None) -> None:
        """Starts following in the background (once). `listen`, when given, registers a
        function that hears the connection's asynchronous errors and tells which to keep
        quiet: the server's refusal of the bucket is one, and ends following at once."""
        if self.state != "idle":
            return
        self.state = "loading"
        self._settled = asyncio.Event()
        if listen is not None:
            refused = self._refused = asyncio.Event()

            def hear(error: BaseException) -> bool:
                if _refusal_of_workers_bucket(error):
                    refused.set()
                    return True
                return False

            listen(hear)
        self._task = asyncio.ensure_future(self._follow())

    async def ready(self, wait: float = 0.0) -> bool:
        """Whether the view is loaded, after waiting up to `wait` seconds for it to load or
        for following to stop."""
        if wait > 0 and self.state == "loading" and self._settled is not None:
            try:
                await asyncio.wait_for(self._settled.wait(), wait)
            except asyncio.TimeoutError:
                pass
        return self.state == "ready"

    async def stop(self) -> None:
        """Stops following for good: :meth:`choose` gives `None` from now on."""
        task, self._task = self._task, None
        if task is not None and not task.done():
            task.cancel()
            try:
                await task
            except (asyncio.CancelledError, Exception):  # noqa: BLE001 - stopping anyway
                pass
        watcher, self._watcher = self._watcher, None
        if watcher is not None:
            try:
                await watcher.stop()
            except Exception:  # noqa: BLE001 - the connection may be closing
                pass
        self.state = "unavailable"
        if self._settled is not None:
            self._settled.set()

    async def _open(self) -> Any:
        js = self.nc.jetstream(timeout=self.timeout)
        kv = await js.key_value(WORKERS_BUCKET)
        status = await kv.status()
        max_age = status.ttl
        self.max_age = float(max_age) if max_age else None
        return await kv.watch(">")

    async def _follow(self) -> None:
        try:
            opening = asyncio.ensure_future(self._open())
            refused = asyncio.ensure_future(self._refused.wait()) if self._refused is not None else None
            try:
                await asyncio.wait([f for f in (opening, refused) if f is not None], return_when=asyncio.FIRST_COMPLETED)
            finally:
                # Stopped, or refused first: nothing is left waiting.
                opened = opening.done()
                if not opened:
                    opening.cancel()
                if refused is not None:
                    refused.cancel()
            if not opened:
                raise PermissionError(f"the server refuses this NATS user the bucket {WORKERS_BUCKET}")
            self._watcher = opening.result()
        except asyncio.CancelledError:
            raise
        except Exception as error:  # noqa: BLE001 - whatever the reason, keyed submits go to the pool
            self.state = "unavailable"
            if self._settled is not None:
                self._settled.set()
            _log.debug(
                "not following the workers' heartbeats (%s: %s): keyed submits go to the pool, "
                "whose workers place them",
                type(error).__name__,
                str(error).strip() or "no detail",
            )
            return
        try:
            async for entry in self._watcher:
                if entry is None:
                    self.loaded()
                    continue
                deleted = entry.operation in ("DEL", "PURGE")
                self.note(entry.key, None if deleted else entry.value)
        except asyncio.CancelledError:
            raise
        except Exception as error:  # noqa: BLE001 - the entries known expire on their own
            _log.debug("following the workers' heartbeats stopped: %s", error)
