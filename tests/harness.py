"""A reusable pool of spawned gloo workers for distributed tests on CPU.

    results = run_ranks(3, my_check, 7, tol=1e-9)   # [result_rank0, result_rank1, result_rank2]

``fn`` must be a picklable *module-level* function (no lambdas, closures or
nested functions); every rank calls ``fn(*args, **kwargs)`` and finds its rank
with ``torch.distributed.get_rank()``. Arguments and results travel pickled
through pipes, so return CPU tensors or plain Python, never CUDA tensors,
modules or process groups. ``fn`` must not destroy the default process group.

Workers start once per world size (gloo on 127.0.0.1, one intra-op thread each, forked by a
``forkserver`` that imported torch and zero_plugin once: [Note: workers forked from a preloaded server])
and are reused across tests. Before each call a worker
re-seeds torch with 0 and resets ``zero_plugin.comm.collectives`` comm stats; after
it, it runs ``gc.collect()``. An exception on any rank is re-raised in the
parent as ``RankError`` carrying every failing rank's traceback. When some rank
does not answer (blocked in a collective its peers abandoned, or past the
timeout) the whole pool is killed and the next ``get_pool`` starts a fresh one.
"""

from __future__ import annotations

import atexit
import multiprocessing
import multiprocessing.forkserver
import os
import pickle
import subprocess
import sys
import time
import traceback
import unittest.mock
from multiprocessing.connection import wait

from tests import launching

REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Once one rank has failed, its peers usually finish (or fail) at once; if they
# do not within this many seconds they are blocked in a collective, so kill.
ERROR_GRACE_S = 3.0
STARTUP_TIMEOUT_S = 180.0
_INIT_ATTEMPTS = 4
# [Note: workers forked from a preloaded server]
# A spawned worker imported torch, zero_plugin and (for most tests) transformers' Llama itself, ~3-5 s of CPU
# each on 2 cores, at every pool start: once per world size and again after every test that leaves a rank
# blocked in a collective (the pool is killed), many times per suite.  A forkserver imports them once and
# forks each worker from there.  It runs no torch operation and starts no thread (checked: one thread after
# the imports), so no OpenMP pool or lock is forked.  Besides these modules a worker sees what a spawned one
# would: the server starts with one intra-op thread in its environment, as the spawned worker set it before
# importing torch, and each worker takes the parent's environment at its pool's start (``_worker_main``), as a
# spawned one inherited it; only transformers' import-time reads of the environment see the parent's at the
# first pool start.
#
# [Note: the preloaded heap frozen in each worker]
# The preloaded modules leave ~350k objects that the garbage collector tracks, and a worker collects after
# every call (``gc.collect()``, as do the tests that read the live tensors): a full collection walked them all,
# ~0.2 s of CPU per call and rank.  They live as long as the worker, so once its group is up the worker
# freezes them (``gc.freeze``: never collected, nor walked by a collection, nor listed by ``gc.get_objects``);
# what the calls make is collected as before.  A tensor made at import time is not listed among the live
# tensors, which the memory tests count above a baseline taken in the call.
_PRELOAD = ("torch", "torch.distributed", "zero_plugin", "transformers.models.llama.modeling_llama", "tests.harness")
_ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
_CONTEXT = None


class RankError(RuntimeError):
    """One or more ranks raised (or never answered); the message has every traceback.

    ``tracebacks`` maps each failing rank to its traceback text; ``missing`` lists
    the ranks that did not answer.
    """

    def __init__(self, message: str, tracebacks: dict | None = None, missing=()):
        super().__init__(message)
        self.tracebacks, self.missing = dict(tracebacks or {}), list(missing)


def run_script_ranks(
    args: list[str], rank_env=lambda rank: {"RANK": str(rank)}, world_size: int = 2, timeout: float = 300
) -> list[tuple[int, str]]:
    """Start ``world_size`` processes of ``python *args`` torchrun-style (``WORLD_SIZE``, ``MASTER_ADDR``,
    ``MASTER_PORT`` on a free port, one intra-op thread, the repo on ``PYTHONPATH``, plus ``rank_env(rank)``),
    for scripts that own their process group and exit, unlike the pool's workers; (exit code, output) per
    rank.  ``PL_TRAINER_STRATEGY`` is dropped, so that a Lightning script picks its own strategy."""
    port = str(launching.free_port())
    procs = []
    for rank in range(world_size):
        env = dict(
            os.environ,
            WORLD_SIZE=str(world_size),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port,
            OMP_NUM_THREADS="1",
            PYTHONPATH=REPO_ROOT,
            **rank_env(rank),
        )
        env.pop("PL_TRAINER_STRATEGY", None)
        procs.append(
            subprocess.Popen(
                [sys.executable, *args],
                env=env,
                cwd=REPO_ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
            )
        )
    return [(p.wait(timeout=timeout), p.stdout.read()) for p in procs]


def _add_paths(paths) -> None:
    for p in reversed([REPO_ROOT, *paths]):
        if p not in sys.path:
            sys.path.insert(0, p)


def _reset_comm_stats() -> None:
    try:
        from zero_plugin.comm.collectives import reset_comm_stats
    except ImportError:
        return
    reset_comm_stats()


def _context():
    """The forkserver context, its server started (once per session) with ``_PRELOAD`` imported."""
    global _CONTEXT
    if _CONTEXT is None:
        ctx = multiprocessing.get_context("forkserver")
        ctx.set_forkserver_preload(list(_PRELOAD))
        with unittest.mock.patch.dict(os.environ, _ONE_THREAD):
            multiprocessing.forkserver.ensure_running()
        _CONTEXT = ctx
    return _CONTEXT


def _stop_forkserver() -> None:
    """At exit, end the server and reap it (its CPU time, and that of the workers it reaped, then counts as
    this process's children's, as spawned workers' did)."""
    stop = getattr(multiprocessing.forkserver._forkserver, "_stop", None)  # CPython's own, used by its tests
    if _CONTEXT is not None and stop is not None:
        stop()


def _worker_main(rank: int, world_size: int, port: int, timeout_s: float, conn, environ: dict[str, str]) -> None:
    # The parent's environment at this pool's start, as a spawned worker inherited it; one intra-op thread.
    os.environ.clear()
    os.environ.update(environ, **_ONE_THREAD)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    _add_paths([])
    import datetime
    import gc

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group(
            "gloo",
            rank=rank,
            world_size=world_size,
            init_method=f"tcp://127.0.0.1:{port}",
            timeout=datetime.timedelta(seconds=timeout_s),
        )
    except Exception:
        conn.send(("init_error", traceback.format_exc()))
        return
    # [Note: the preloaded heap frozen in each worker]
    gc.collect()
    gc.freeze()
    conn.send(("ready", os.getpid()))
    while True:
        try:
            msg = conn.recv_bytes()
        except (EOFError, OSError):  # parent went away
            break
        if msg == b"close":
            break
        ok, payload = True, None
        try:
            paths, fn, args, kwargs = pickle.loads(msg)
            _add_paths(paths)
            torch.manual_seed(0)
            _reset_comm_stats()
            payload = pickle.dumps(fn(*args, **kwargs))
        except BaseException:  # noqa: BLE001 - everything goes back to the parent
            ok, payload = False, traceback.format_exc()
        gc.collect()
        conn.send((ok, payload, dist.is_initialized()))
    if dist.is_initialized():
        dist.destroy_process_group()


class WorkerPool:
    """``world_size`` spawned processes sharing one gloo process group."""

    def __init__(self, world_size: int, timeout: float = 300.0):
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size, self.timeout = world_size, timeout
        self.procs, self.conns = [], []
        self.broken = False
        for attempt in range(_INIT_ATTEMPTS):
            errors = self._start(launching.free_port())
            if not errors:
                return
            self._kill()
            retry = any("address already in use" in e.lower() for e in errors.values())
            if not retry or attempt == _INIT_ATTEMPTS - 1:
                head = f"pool of {world_size} failed to start"
                raise RankError(_format(errors, [], 0, head), errors)

    def _start(self, port: int) -> dict[int, str]:
        ctx = _context()
        self.procs, self.conns = [], []
        for rank in range(self.world_size):
            parent_conn, child_conn = ctx.Pipe()
            p = ctx.Process(
                target=_worker_main,
                daemon=True,
                name=f"zero-test-rank{rank}",
                args=(rank, self.world_size, port, self.timeout, child_conn, dict(os.environ)),
            )
            p.start()
            child_conn.close()
            self.procs.append(p)
            self.conns.append(parent_conn)
        answers, missing = self._collect(STARTUP_TIMEOUT_S)
        errors = {r: a[1] for r, a in answers.items() if a[0] != "ready"}
        errors.update({r: "worker did not start" for r in missing})
        self.pids = [answers[r][1] if r in answers else None for r in range(self.world_size)]
        return errors

    def _collect(self, timeout: float) -> tuple[dict, list[int]]:
        """Wait for one message per rank; stop early ERROR_GRACE_S after a failure."""
        answers: dict[int, tuple] = {}
        deadline = time.monotonic() + timeout
        by_conn = {c: r for r, c in enumerate(self.conns)}
        by_sentinel = {p.sentinel: r for r, p in enumerate(self.procs)}
        while len(answers) < self.world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            pending = [r for r in range(self.world_size) if r not in answers]
            ready = wait([self.conns[r] for r in pending] + [self.procs[r].sentinel for r in pending], remaining)
            for obj in ready:
                if obj in by_conn and by_conn[obj] not in answers:
                    r = by_conn[obj]
                    try:
                        answers[r] = obj.recv()
                    except (EOFError, OSError):
                        answers[r] = ("died", "worker exited without answering")
                elif obj in by_sentinel and by_sentinel[obj] not in answers:
                    r = by_sentinel[obj]
                    if not self.conns[r].poll():
                        answers[r] = ("died", f"worker exited with code {self.procs[r].exitcode}")
            if any(a[0] in (False, "died", "init_error") for a in answers.values()):
                deadline = min(deadline, time.monotonic() + ERROR_GRACE_S)
        return answers, [r for r in range(self.world_size) if r not in answers]

    def alive(self) -> bool:
        return not self.broken and all(p.is_alive() for p in self.procs)

    def run(self, fn, *args, timeout: float | None = None, **kwargs) -> list:
        """Call ``fn(*args, **kwargs)`` on every rank; return the results in rank order."""
        if not self.alive():
            raise RuntimeError(f"pool of {self.world_size} is closed or broken")
        timeout = self.timeout if timeout is None else timeout
        msg = pickle.dumps((list(sys.path), fn, args, kwargs))  # fails here if fn is local
        try:
            for conn in self.conns:
                conn.send_bytes(msg)
            answers, missing = self._collect(timeout)
        except BaseException:  # e.g. Ctrl-C or a dead pipe: late answers would poison the pool
            self.close(force=True)
            raise
        errors = {r: a[1] for r, a in answers.items() if a[0] is not True}
        if missing or any(a[0] == "died" or not a[2] for a in answers.values()):
            self.close(force=bool(missing))
        if errors or missing:
            raise RankError(_format(errors, missing, timeout), errors, missing)
        return [pickle.loads(answers[r][1]) for r in range(self.world_size)]

    def close(self, force: bool = False) -> None:
        self.broken = True
        if not force:
            for conn in self.conns:
                try:
                    conn.send_bytes(b"close")
                except OSError:
                    pass
            for p in self.procs:
                p.join(timeout=5)
        self._kill()

    def _kill(self) -> None:
        for p in self.procs:
            if p.is_alive():
                p.terminate()
        for p in self.procs:
            p.join(timeout=3)
            if p.is_alive():
                p.kill()
                p.join(timeout=3)
        for conn in self.conns:
            conn.close()
        self.procs, self.conns = [], []


def _format(errors: dict[int, str], missing: list[int], timeout: float, head: str = "") -> str:
    parts = [head] if head else []
    parts += [f"rank {r} failed:\n{tb}" for r, tb in sorted(errors.items())]
    if missing:
        ranks = ", ".join(map(str, missing))
        within = ERROR_GRACE_S if errors else timeout
        parts.append(
            f"ranks {ranks} did not answer within {within:g} s"
            + (" of the first failure (pool killed)" if errors else " (pool killed)")
        )
    return "\n".join(parts)


_POOLS: dict[int, WorkerPool] = {}


def get_pool(world_size: int) -> WorkerPool:
    """The cached live pool for ``world_size``, started (again) if needed."""
    pool = _POOLS.get(world_size)
    if pool is None or not pool.alive():
        if pool is not None:
            pool.close(force=True)
        pool = _POOLS[world_size] = WorkerPool(world_size)
    return pool


def run_ranks(world_size: int, fn, *args, **kwargs) -> list:
    """``get_pool(world_size).run(fn, *args, **kwargs)``; accepts ``timeout=``."""
    return get_pool(world_size).run(fn, *args, **kwargs)


def close_all_pools() -> None:
    while _POOLS:
        _POOLS.popitem()[1].close()


# atexit runs last what it registered first: the server outlives every pool, tests/fuzz/check.py's included
# (a worker of a stopped server reads as exited and would be left running).
atexit.register(_stop_forkserver)
atexit.register(close_all_pools)
