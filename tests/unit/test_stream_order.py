"""The CUDA stream protocol of stage 3 ([Note: side streams] in zero_plugin/comm/streams.py), checked on CPU.

A recording stand-in for the stream set (``stream_order_workers.RecordingStreams``) is injected into a
stage-3 engine that uses the buffered collective layout (NCCL's, forced on gloo), and a few training steps
run at world size 1 and 2.  From the log of records, waits, pool traffic, collectives, forwards and the
frees of full gradients we check, for every unit:
  * the gather stream waits for the compute stream before the copy-in and the all-gather launch, and the
    reduce stream waits for it before reading gradients (every pool take and launch is inside such a context);
  * a completion (the collective's wait, the copy-out or accumulation) runs on its side stream and ends
    with an event the compute stream waits for right after; buffers go back to the pool only after that wait;
  * a unit's forward starts only after the compute stream waited for its latest gather's copy-out event
    (and the copy-out had unsharded the unit's parameters when that event was recorded);
  * each full gradient a reduction read is freed only after the compute stream waited for that reduction.
The same steps without the stand-in give bit-identical parameters, and on a real CPU run the engine's
stream set is the no-op one (so the parity tests, which run that path, cover the results).  What needs a
GPU (real streams, overlap in time, peak memory) is in tests/gpu/overlap.py.
"""

from __future__ import annotations

import pytest

from tests.harness import run_ranks
from tests.unit import stream_order_workers as w

SIDES = ("gather", "reduce")


def _contexts(log: list) -> list[tuple[int, int, str]]:
    """(enter index, exit index, side) of every side-stream context; checks how each one is entered."""
    out, open_at = [], None
    for i, (kind, stream, _detail) in enumerate(log):
        if kind == "enter":
            assert open_at is None, f"entry {i}: nested side-stream contexts"
            assert i >= 2 and log[i - 2][0] == "record" and log[i - 2][1] == "compute", (
                f"entry {i}: the {stream} stream did not start from an event recorded on the compute stream"
            )
            event = log[i - 2][2][0]
            assert log[i - 1] == ("wait", stream, event), f"entry {i}: the {stream} stream did not wait for {event}"
            open_at = i
        elif kind == "exit":
            assert open_at is not None and log[open_at][1] == stream, f"entry {i}: unmatched exit"
            out.append((open_at, i, stream))
            open_at = None
    assert open_at is None, "a side-stream context was not closed"
    return out


def _side_of(contexts, i: int) -> str:
    for start, end, side in contexts:
        if start < i < end:
            return side
    return "compute"


def _completions(log: list, contexts) -> dict[str, list[tuple[int, int]]]:
    """For every completion context (one holding a collective's wait): check it and return, per
    "all-gather of unit 'X'" / "reduce-scatter of unit 'X'", (index of the wait, index of the compute wait)."""
    done: dict[str, list[tuple[int, int]]] = {}
    for start, end, side in contexts:
        waits = [i for i in range(start, end) if log[i][0] == "comm_wait"]
        if not waits:
            continue
        last = log[end - 1]
        assert last[0] == "record" and last[1] == side and end - 1 > max(waits), (
            f"entries {start}-{end}: the {side} stream did not record an event after its last completion step"
        )
        event, unsharded = last[2]
        assert log[end + 1] == ("wait", "compute", event), (
            f"entry {end + 1}: the compute stream did not wait for the {side} stream's event {event}: {log[end + 1]}"
        )
        for i in waits:
            what = log[i][2]
            expected = "gather" if what.startswith("all-gather") else "reduce"
            assert side == expected, f"entry {i}: {what!r} waited on the {side} stream"
            if side == "gather":  # the copy-out had unsharded the unit when the event was recorded
                unit = what.split("'")[1]
                assert unit in unsharded, f"entry {end - 1}: event recorded before the copy-out of {unit!r}"
            done.setdefault(what, []).append((i, end + 1))
    return done


def check_protocol(r: dict) -> None:
    log = r["log"]
    assert log, "nothing was logged: the stand-in was not used"
    contexts = _contexts(log)
    names = set(r["units"])
    for i, (kind, stream, detail) in enumerate(log):
        side = _side_of(contexts, i)
        if kind not in ("enter", "exit", "wait"):  # a wait names the waiting stream, not the current one
            assert stream == side, f"entry {i}: {kind} logged on {stream} inside a {side} context"
        if kind == "take":
            assert side in SIDES, f"entry {i}: a pool buffer taken on the compute stream"
        if kind == "all_gather":
            assert detail in names and side == "gather", f"entry {i}: all-gather of {detail!r} on the {side} stream"
        if kind == "reduce_scatter":
            assert detail in names and side == "reduce", f"entry {i}: reduce-scatter of {detail!r} on {side}"
        if kind == "comm_wait":
            assert side in SIDES, f"entry {i}: {detail!r} waited on the compute stream"
    done = _completions(log, contexts)

    # buffers return to the pool only after the compute stream waited for the side stream that used them
    waited = False
    for i, (kind, stream, detail) in enumerate(log):
        if kind == "exit":
            waited = False
        elif kind == "wait" and stream == "compute" and detail[0] in SIDES:
            waited = True
        elif kind == "give":
            assert stream == "compute" and waited, f"entry {i}: buffer given back before the compute stream waited"

    def latest_completed(kind: str, unit: str, i: int) -> int:
        """Compute-wait index of the completion of ``unit``'s latest launch before entry ``i``."""
        launches = [j for j in range(i) if log[j][0] == kind and log[j][2] == unit]
        assert launches, f"entry {i}: {unit!r} used before any {kind}"
        label = ("all-gather" if kind == "all_gather" else "reduce-scatter") + f" of unit {unit!r}"
        after = [cw for j, cw in done.get(label, []) if j > launches[-1]]
        assert after and after[0] < i, (
            f"entry {i}: {unit!r} used before the compute stream waited for its latest {kind} "
            f"(launched at {launches[-1]})"
        )
        return after[0]

    forwards = [(i, d) for i, (k, _, d) in enumerate(log) if k == "forward"]
    assert {d for _, d in forwards} == names, "every unit must run forward"
    for i, unit in forwards:
        latest_completed("all_gather", unit, i)
    freed = [(i, d) for i, (k, _, d) in enumerate(log) if k == "grad_freed"]
    assert len(freed) == r["sources"] > 0, f"{r['sources']} gradients held, {len(freed)} freed during training"
    for i, unit in freed:
        latest_completed("reduce_scatter", unit, i)


def _check_results(results: list) -> None:
    for r in results:
        assert not r["in_place"], "the buffered layout must be in use"
        assert r["same_params"], f"rank {r['rank']}: the stand-in changed the training results"
        assert r["own_is_no_streams"] and r["own_streams"] == "StreamSet" and not r["own_overlaps"], (
            f"rank {r['rank']}: a CPU run must use the no-op stream set, got {r['own_streams']}"
        )
        check_protocol(r)


@pytest.mark.parametrize("world", [1, 2])
def test_stream_protocol_order_buffered(world):
    _check_results(run_ranks(world, w.protocol_worker, True, timeout=120))


def test_stream_protocol_order_prefetch_two():
    _check_results(run_ranks(2, w.protocol_worker, True, prefetch_depth=2, timeout=120))


def test_in_place_layout_makes_no_stream_calls():
    """gloo's in-place layout (the CPU default) never enters the protocol, and its stream set is the no-op one."""
    for r in run_ranks(2, w.protocol_worker, False, timeout=120):
        assert r["in_place"] and r["same_params"] and r["own_is_no_streams"]
        assert [e for e in r["log"] if e[0] in ("enter", "record", "wait")] == [], r["log"][:5]
