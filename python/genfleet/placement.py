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
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Tuple, Union

#: The bounded-load factor used when none is set: a worker already busier than twice the
#: pool's average share is passed over for the next in rank.
DEFAULT_LOAD_FACTOR = 2.0


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
    """Whether `worker` is passed over for the bounded load, in IEEE 754 doubles and in the
    order docs/protocol.md gives: busy × S ≥ load_factor × (B + 1) × slots. A factor below 1
    (0 among them) or not finite bounds nothing."""
    if not (math.isfinite(load_factor) and load_factor >= 1.0):
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
    ranks. A submit sent to a worker counts one more busy slot there until its next heartbeat
    says otherwise."""

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
