"""``--profile``: where a step's time goes, by wrapping bound methods of one variant's objects.

Only instance attributes are replaced (nothing global), so other variants run
untouched.  For zero_plugin the engine's pieces are timed: gradient copy-in and
launch (inside backward hooks), the end-of-backward flush, the wait on each
collective, the wrapped optimizer's own ``step`` (the Adam math), and the
parameter all-gather after the step.  Times are summed per timed step.
"""
from __future__ import annotations

import functools
import time
from collections import defaultdict

__all__ = ["PhaseProfiler"]


class _TimedWork:
    def __init__(self, work, profiler: "PhaseProfiler", label: str) -> None:
        self._work, self._profiler, self._label = work, profiler, label

    def wait(self, *args, **kwargs):
        t0 = time.perf_counter()
        try:
            return self._work.wait(*args, **kwargs)
        finally:
            self._profiler.add(self._label, time.perf_counter() - t0)


class PhaseProfiler:
    def __init__(self, variant) -> None:
        self.totals: dict[str, float] = defaultdict(float)
        if hasattr(variant, "zp"):
            self._instrument_zero_plugin(variant)
        else:
            self._instrument_torch(variant)

    def add(self, label: str, seconds: float) -> None:
        self.totals[label] += seconds

    def reset(self) -> None:
        self.totals.clear()

    def per_step(self, steps: int) -> dict[str, float]:
        return {k: v / steps for k, v in self.totals.items()}

    def _time(self, obj, method: str, label: str) -> None:
        fn = getattr(obj, method)

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.add(label, time.perf_counter() - t0)

        setattr(obj, method, timed)

    def _time_waits(self, comm, method: str) -> None:
        fn = getattr(comm, method)

        @functools.wraps(fn)
        def issued(*args, **kwargs):
            t0 = time.perf_counter()
            work = fn(*args, **kwargs)
            self.add(f"{method} issue", time.perf_counter() - t0)
            return _TimedWork(work, self, f"{method} wait") if work is not None else None

        setattr(comm, method, issued)

    def _time_if(self, obj, method: str, label: str) -> None:
        """Engines differ by stage (and evolve): time only what this one has."""
        if obj is not None and callable(getattr(obj, method, None)):
            self._time(obj, method, label)

    def _instrument_zero_plugin(self, variant) -> None:
        engine = variant._engine()
        for method in ("all_reduce", "reduce_scatter", "all_gather"):
            self._time_waits(engine.comm, method)
        self._time(engine, "before_step", "before_step (set master grads)")
        self._time(variant.optimizer.inner, "step", "inner optimizer step (Adam math)")
        self._time(engine, "after_step", "after_step (write-back + param all-gather)")
        reducer = getattr(engine, "reducer", None)          # stages 0-2
        self._time_if(reducer, "_launch", "grad copy-in + launch (in backward)")
        self._time_if(reducer, "finish", "end-of-backward flush + wait + copy-out")
        self._time_if(reducer, "_complete", "grad copy-out")
        self._time_if(getattr(engine, "param_sync", None), "run", "param all-gather (total)")
        runtime = getattr(engine, "runtime", None)          # stage 3
        self._time_if(runtime, "finalize_backward", "stage-3 finalize_backward")
        for unit in getattr(engine, "units", []):
            for method in ("unshard", "wait_unshard", "reshard", "reduce_grads", "complete_reduce"):
                self._time_if(unit, method, f"stage-3 unit.{method}")

    def _instrument_torch(self, variant) -> None:
        opt = variant.optimizer
        inner = getattr(opt, "optim", None)
        if inner is not None:   # ZeroRedundancyOptimizer: its local optimizer is the Adam math
            self._time(inner, "step", "inner optimizer step (Adam math)")
        self._time(opt, "step", "optimizer.step (total)")
