"""Run one spec on its ranks and against the single-process reference; raise ``FuzzFailure`` on any mismatch.

The failure message starts with the spec as one JSON line, so any failure can be replayed alone with
``python -m tests.fuzz.replay 'SPEC_JSON'``.
"""

from __future__ import annotations

import atexit
import math

import torch

from tests.fuzz.reference import reference, reference_bf16
from tests.fuzz.spec import to_json
from tests.fuzz.workers import TIMEOUT_S, fuzz_worker
from tests.harness import RankError, WorkerPool

FP64_REL = 1e-9
# bf16 runs are held to the emulated mixed-precision reference (reference_bf16): their distance from it,
# relative to how far the float64 reference moved, may be BF16_UPDATE_REL plus the emulation's own
# distance from float64 (on 40 passing specs: at most 0.003, against emulation errors up to 0.33 where
# AdamW's first steps follow the sign of tiny bf16 gradients).
BF16_UPDATE_REL = 0.02
BF16_LOSS_REL = 0.03
# Our own pools: a gloo process group timeout of a minute, not the harness' five, because a fuzz case
# that pairs collectives wrongly blocks until that timeout.
POOL_TIMEOUT_S = 2 * TIMEOUT_S
_POOLS: dict[int, WorkerPool] = {}


class FuzzFailure(AssertionError):
    """A spec whose run raised or differed from the reference; ``kind`` is a short signature of why."""

    def __init__(self, spec: dict, kind: str, detail: str):
        super().__init__(f"fuzz spec failed ({kind}):\nSPEC {to_json(spec)}\n{detail}")
        self.spec, self.kind, self.detail = spec, kind, detail


def _pool(world_size: int) -> WorkerPool:
    pool = _POOLS.get(world_size)
    if pool is None or not pool.alive():
        if pool is not None:
            pool.close(force=True)
        pool = _POOLS[world_size] = WorkerPool(world_size, timeout=POOL_TIMEOUT_S)
    return pool


def close_pools() -> None:
    while _POOLS:
        _POOLS.popitem()[1].close()


atexit.register(close_pools)


def run_ranks_for(spec: dict) -> list[dict]:
    """Every rank's ``fuzz_worker(spec)`` result, in rank order (raises ``RankError``)."""
    return _pool(spec["world_size"]).run(fuzz_worker, spec)


def run_spec(spec: dict) -> None:
    """Raise ``FuzzFailure`` unless the ranks' training matches the reference."""
    try:
        results = run_ranks_for(spec)
    except RankError as exc:
        # a rank that failed mid-collective leaves its process group unusable (later specs would fail with
        # "Application timeout caused pair closure"): the next spec of this world size gets fresh workers
        _POOLS.pop(spec["world_size"]).close(force=True)
        raise FuzzFailure(spec, "rank error: " + _error_line(exc), str(exc)) from None
    ref = reference(spec)
    if spec["precision"] != "fp64":
        ref["bf16"] = reference_bf16(spec)
    problems = compare(spec, results, ref)
    if problems:
        raise FuzzFailure(spec, problems[0].split(":")[0], "\n".join(problems))


_PEER_FAILURE = ("Connection reset by peer", "Connection closed by peer", "worker exited")


def _error_line(exc: RankError) -> str:
    """What went wrong first: a rank's own exception, else a hang, else a rank that died.

    Ranks that only saw a peer go away say so and are passed over; a rank dies (no traceback) when gloo
    aborts the process on a collective size mismatch, and its stderr says so.
    """
    last = {r: ([ln for ln in tb.strip().splitlines() if ln.strip()] or ["?"])[-1] for r, tb in exc.tracebacks.items()}
    own = [ln for ln in last.values() if not any(p in ln for p in _PEER_FAILURE)]
    hangs = [ln for ln in own if "timed out" in ln]
    if own and len(hangs) < len(own):
        return [ln for ln in own if ln not in hangs][0][:160]
    if hangs:
        return "hang: " + hangs[0].split(" did not complete")[0].split(": ", 2)[-1][:120] + " timed out"
    if any("worker exited" in ln for ln in last.values()):
        return "a rank died (gloo abort, e.g. collective size mismatch)"
    return "ranks did not answer" if exc.missing else "peer failure"


def compare(spec: dict, results: list[dict], ref: dict) -> list[str]:
    problems = _ranks_agree(results)
    full = {k: v.to(torch.float64) for k, v in results[0]["full"].items()}
    missing = sorted(set(ref["final"]) - set(full))
    if missing:
        return problems + [f"full_state_dict: missing keys {missing}"]
    fp64 = spec["precision"] == "fp64"
    like = ref if fp64 else ref["bf16"]
    rel = FP64_REL if fp64 else BF16_LOSS_REL
    for r, res in enumerate(results):
        want = [row[r] for row in like["losses"]]
        problems += _close_list(f"loss of rank {r}", res["losses"], want, rel)
        problems += _close_list(f"clip norm on rank {r}", res["norms"], like["norms"], rel)
        want = [row[r] for row in like["forwards"]]
        problems += _close_list(f"forward without backward on rank {r}", res["forwards"], want, rel)
    if fp64:
        problems += _params_fp64(full, ref)
    else:
        problems += params_bf16(spec, full, ref)
    return problems


def _ranks_agree(results: list[dict]) -> list[str]:
    out = []
    for r, res in enumerate(results[1:], start=1):
        for k, v in results[0]["full"].items():
            other = res["full"].get(k)
            if other is None or other.dtype != v.dtype or not torch.equal(other, v):
                out.append(f"ranks disagree: full_state_dict[{k!r}] differs between rank 0 and rank {r}")
    return out


def _close_list(what: str, got: list[float], want: list[float], rel: float) -> list[str]:
    if len(got) != len(want):
        return [f"{what}: {len(got)} values, reference has {len(want)}"]
    for i, (g, w) in enumerate(zip(got, want)):
        if not (math.isfinite(g) and abs(g - w) <= rel * max(1.0, abs(w))):
            return [f"{what}: value {i} is {g!r}, reference {w!r} (rel tol {rel:g})"]
    return []


def _params_fp64(full: dict, ref: dict) -> list[str]:
    out = []
    for k, want in ref["final"].items():
        err = (full[k] - want).abs().max().item() / max(1.0, want.abs().max().item())
        if not err <= FP64_REL:
            moved = (want - ref["initial"][k]).abs().max().item()
            out.append(f"param {k}: max rel error {err:.3g} (reference moved {moved:.3g} from init)")
    return out


def frozen_keys(spec: dict) -> set[str]:
    """State-dict keys of frozen parameters, with the second name of a tied ``mix`` weight."""
    frozen = set(spec["model"]["frozen"])
    for j, i in enumerate(spec["model"]["tie_to"]):
        if i is not None and f"blocks.{i}.mix.weight" in frozen:
            frozen.add(f"blocks.{j}.mix.weight")
    return frozen


def params_bf16(spec: dict, full: dict, ref: dict) -> list[str]:
    """Trained parameters: distance from the emulated bf16 run, relative to the float64 update (see
    BF16_UPDATE_REL); frozen ones: unchanged up to bf16 rounding."""
    frozen = frozen_keys(spec)
    emulated = ref["bf16"]["final"]
    ambiguous = ref["bf16"]["ambiguous"]  # [Note: gradients within the reduction's rounding of zero]
    out, diff, emu_diff, moved, scale = [], 0.0, 0.0, 0.0, 0.0
    for k, want in ref["final"].items():
        init = ref["initial"][k]
        if k in frozen:
            err = (full[k] - init).abs().max().item()
            if not err <= 2**-8 * init.abs().max().item():
                out.append(f"frozen param {k}: moved by {err:.3g}")
            continue
        compared = ~ambiguous[k] if k in ambiguous else torch.ones_like(want, dtype=torch.bool)
        diff += (full[k] - emulated[k])[compared].pow(2).sum().item()
        emu_diff += (emulated[k] - want).pow(2).sum().item()
        moved += (want - init).pow(2).sum().item()
        scale += init.pow(2).sum().item()
    # A floor for schedules that barely move the weights: bf16 rounding of the forward alone is ~2^-8.
    denom = max(math.sqrt(moved), 2**-6 * math.sqrt(scale), 1e-12)
    err, emu_err = math.sqrt(diff) / denom, math.sqrt(emu_diff) / denom
    allowed = BF16_UPDATE_REL * (2 if ref["bf16"].get("stepped_after_ambiguous") else 1)
    if not err <= allowed + emu_err:
        out.append(
            f"bf16 update error ||p - p_emulated|| / ||p_ref - p0|| = {err:.3g} > {allowed} + "
            f"{emu_err:.3g} (the emulation's own error; ||p_ref - p0|| = {math.sqrt(moved):.3g})"
        )
    return out
