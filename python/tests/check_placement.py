"""Checks the placement rule of keyed submits (tests/python_client.rs runs it).

Usage: check_placement.py VECTORS

VECTORS is tests/data/placement.json, the vectors every implementation of the placement rule
is checked against.

Exits non-zero with a message on the first failed check.
"""

import json
import sys

import genfleet
from genfleet import PoolView, WorkerLoad, choose, rank, score


def check(cond, what):
    if not cond:
        raise AssertionError(what)


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


def main(vectors: str) -> None:
    check_vectors(vectors)
    check_pool_view()
    print("python placement: all checks passed")


if __name__ == "__main__":
    main(*sys.argv[1:])
