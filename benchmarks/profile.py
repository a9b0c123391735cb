"""``--profile``: where a step's time goes, by wrapping bound methods of one variant's objects.

Only instance attributes are replaced (nothing global), so other variants run
untouched.  For zero_plugin the engine's pieces are timed: gradient copy-in and
launch (inside backward hooks), the end-of-backward flush, the wait on each
collective, the wrapped optimizer's own ``step`` (the Adam math), and the
parameter all-gather after the step.  Wall and process-CPU times are summed per timed step.
"""

from __future__ import annotations

import functools
import time
from collections import defaultdict

__all__ = ["PhaseProfiler"]


class _Clock:
    """Wall and process-CPU time of one region (CPU: all threads of this process, gloo's included)."""

    __slots__ = ("wall", "cpu")

    def __init__(self) -> None:
        self.wall, self.cpu = time.perf_counter(), time.process_time()

    def elapsed(self) -> tuple[float, float]:
        return time.perf_counter() - self.wall, time.process_time() - self.cpu


class _TimedWork:
    def __init__(self, work, profiler: PhaseProfiler, label: str) -> None:
        self._work, self._profiler, self._label = work, profiler, label

    def wait(self, *args, **kwargs):
        clock = _Clock()
        try:
            return self._work.wait(*args, **kwargs)
        finally:
            self._profiler.add(self._label, clock.elapsed())


class PhaseProfiler:
    def __init__(self, variant) -> None:
        self.totals: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
        if hasattr(variant, "zp"):
            self._instrument_zero_plugin(variant)
        else:
            self._instrument_torch(variant)

    def add(self, label: str, elapsed: tuple[float, float]) -> None:
        total = self.totals[label]
        total[0] += elapsed[0]
        total[1] += elapsed[1]

    def reset(self) -> None:
        self.totals.clear()

    def per_step(self, steps: int) -> dict[str, list[float]]:
        """label -> [wall s, CPU s] per timed step."""
        return {k: [wall / steps, cpu / steps] for k, (wall, cpu) in self.totals.items()}

    def _time(self, obj, method: str, label: str) -> None:
        fn = getattr(obj, method)

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            clock = _Clock()
            try:
                return fn(*args, **kwargs)
            finally:
                self.add(label, clock.elapsed())

        setattr(obj, method, timed)

    def _time_waits(self, comm, method: str) -> None:
        fn = getattr(comm, method)

        @functools.wraps(fn)
        def issued(*args, **kwargs):
            clock = _Clock()
            work = fn(*args, **kwargs)
            self.add(f"{method} issue", clock.elapsed())
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
        self._time_if(
            getattr(variant.optimizer, "guard", None), "should_step", "non-finite guard (isfinite pass + all-reduce)"
        )
        self._time(variant.optimizer.inner, "step", "inner optimizer step (Adam math)")
        self._time(engine, "after_step", "after_step (write-back + param all-gather)")
        reducer = getattr(engine, "reducer", None)  # stages 0-2
        self._time_if(reducer, "_launch", "grad copy-in + launch (in backward)")
        self._time_if(reducer, "finish", "end-of-backward flush + wait + copy-out")
        self._time_if(reducer, "_complete", "grad copy-out")
        self._time_if(getattr(engine, "param_sync", None), "run", "param all-gather (total)")
        runtime = getattr(engine, "runtime", None)  # stage 3
        self._time_if(runtime, "finalize_backward", "stage-3 finalize_backward")
        for unit in getattr(engine, "units", []):
            for method in ("unshard", "wait_unshard", "reshard", "reduce_grads", "complete_reduce"):
                self._time_if(unit, method, f"stage-3 unit.{method}")

    def _instrument_torch(self, variant) -> None:
        opt = variant.optimizer
        # ZeroRedundancyOptimizer's `optim` / DeepSpeed's ZeRO optimizer's `optimizer`: the Adam math
        inner = getattr(opt, "optim", None) or getattr(opt, "optimizer", None)
        if inner is not None:
            self._time(inner, "step", "inner optimizer step (Adam math)")
        self._time(opt, "step", "optimizer.step (total)")
