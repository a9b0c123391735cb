"""Functions that run inside the ranks of ``tests/unit/test_stream_order.py``.

:class:`RecordingStreams` implements the stream protocol of ``zero_plugin/comm/streams.py`` without a GPU:
it keeps a notion of the current stream ("compute", or "gather"/"reduce" inside a side-stream context)
and logs every record, wait, entry and exit.  The worker adds to the same log, tagged with the current
stream, what the protocol orders: pool takes and gives, collective launches and waits, the start of each
unit's forward, and the moment each full gradient a reduction read is freed.  Instrumentation goes on this
call's objects only (instance attributes, hooks with handles removed at the end).
"""

from __future__ import annotations

import contextlib
import weakref

import torch
import torch.distributed as dist

import zero_plugin as zp
from tests import models
from tests.unit.memory_comm_workers import collectives_layout
from tests.unit.stage3_behaviour_workers import DeepMLP, _full_params, _seeded, train_steps
from zero_plugin.comm.streams import NO_STREAMS, StreamSet
from zero_plugin.engines.engine import engine_of
from zero_plugin.stage3.param import ShardedState

SIDES = ("gather", "reduce")


class RecordingStreams(StreamSet):
    """The protocol with named streams and numbered events; every call appends to ``log``.

    Entries are tuples ``(kind, stream, detail)``; an event is ``(stream it was recorded on, serial)``.
    ``probe()`` is called at each record and its value stored with it (what the copy-out had done)."""

    overlaps = True

    def __init__(self, log: list, probe=lambda: None) -> None:
        self.log = log
        self.probe = probe
        self._stack = ["compute"]
        self._serial = 0

    @property
    def current(self) -> str:
        return self._stack[-1]

    def gather(self):
        return self._on("gather")

    def reduce(self):
        return self._on("reduce")

    @contextlib.contextmanager
    def _on(self, side: str):
        assert self.current == "compute", f"{side} stream entered from the {self.current} stream"
        ready = self.record()
        self.log.append(("wait", side, ready))
        self.log.append(("enter", side, None))
        self._stack.append(side)
        try:
            yield
        finally:
            self._stack.pop()
            self.log.append(("exit", side, None))

    def record(self):
        self._serial += 1
        event = (self.current, self._serial)
        self.log.append(("record", self.current, (event, self.probe())))
        return event

    def wait(self, event) -> None:
        self.log.append(("wait", self.current, event))


def _instrument(engine, model, streams: RecordingStreams) -> tuple[list, dict]:
    """Log pool, collective, forward and gradient-lifetime events; returns hook handles and counters."""
    log = streams.log
    comm, pool = engine.comm, engine.units[0].pool
    counts = {"sources": 0}

    def wrap(obj, name, entry):
        original = getattr(obj, name)

        def wrapped(*args, **kwargs):
            kind, detail = entry(*args, **kwargs)
            log.append((kind, streams.current, detail))
            return original(*args, **kwargs)

        setattr(obj, name, wrapped)

    wrap(pool, "take", lambda numel, *a, **k: ("take", numel))
    wrap(pool, "give", lambda t, *a, **k: ("give", None if t is None else t.numel()))
    reduce_comm = engine.units[0].reduce_comm  # [Note: reductions on their own group] in stage3/hooks.py
    wrap(comm, "all_gather", lambda out, inp, *a, tag="", **k: ("all_gather", tag))
    wrap(reduce_comm, "reduce_scatter", lambda out, inp, *a, tag="", **k: ("reduce_scatter", tag))
    for c in {id(comm): comm, id(reduce_comm): reduce_comm}.values():
        wrap(c, "wait", lambda work, what="collective": ("comm_wait", what))

    def freed(name: str) -> None:
        log.append(("grad_freed", streams.current, name))

    for unit in engine.units:
        original = unit.reduce_grads

        def reduce_grads(unit=unit, original=original):
            launched = original()
            for pending in launched:
                for grad in pending.sources or []:
                    weakref.finalize(grad, freed, unit.name)
                    counts["sources"] += 1
            return launched

        unit.reduce_grads = reduce_grads

    handles = []
    for unit in engine.units:
        module = model if unit is engine.runtime.root else unit.module
        handles.append(
            module.register_forward_pre_hook(
                lambda m, args, name=unit.name: log.append(("forward", streams.current, name))
            )
        )
    return handles, counts


def _unsharded_units(engine):
    def probe():
        return sorted(
            u.name
            for u in engine.units
            if all(sp.state is ShardedState.UNSHARDED for sp in u.params if sp.layout.numel)
        )

    return probe


def protocol_worker(buffered: bool, prefetch_depth: int = 1, steps: int = 3) -> dict:
    """Train the same model twice: with the engine's own streams, then with :class:`RecordingStreams`.

    Returns the log of the second run, the unit names, how many gradient references were held, the
    type of the engine's own stream set and whether both runs ended with identical parameters."""
    rank, world = dist.get_rank(), dist.get_world_size()
    batches = models.make_batches("mlp", steps, world, per_rank_batch=2, seed=21)
    config = zp.ZeroConfig(stage=3, prefetch_depth=prefetch_depth, reshard_after_forward=True)
    results = []
    for fake in (False, True):
        model = _seeded(DeepMLP, 4)
        with collectives_layout(buffered):
            model, opt = zp.setup(model, models.two_group_adamw(model), config)
        engine = engine_of(model, "test")
        own = engine.units[0].streams
        log: list = []
        handles, counts = [], {"sources": 0}
        if fake:
            streams = RecordingStreams(log, _unsharded_units(engine))
            engine.set_streams(streams)
            handles, counts = _instrument(engine, model, streams)
        train_steps(model, opt, batches)
        for h in handles:
            h.remove()
        log = list(log)  # the training steps only (the state-dict gathers below are not unit gathers)
        results.append(
            {
                "params": _full_params(model),
                "log": log,
                "sources": counts["sources"],
                "own_streams": type(own).__name__,
                "own_is_no_streams": own is NO_STREAMS,
                "own_overlaps": own.overlaps,
                "units": [u.name for u in engine.units],
                "in_place": engine.comm.gathers_regions_in_place,
            }
        )
    plain, recorded = results
    same = all(torch.equal(plain["params"][k], recorded["params"][k]) for k in plain["params"])
    out = {k: v for k, v in recorded.items() if k != "params"}
    out.update(
        same_params=same,
        own_streams=plain["own_streams"],
        own_is_no_streams=plain["own_is_no_streams"],
        own_overlaps=plain["own_overlaps"],
        rank=rank,
    )
    return out
