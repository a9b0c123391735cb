"""The hypothesis strategy for one fuzz case: a plain-data spec (JSON-safe dict), replayable on its own.

A spec holds everything a run depends on::

    {"seed": 3, "world_size": 2, "stage": 1, "buffered": false, "offload": false,
     "precision": "fp64" | "bf16" | "bf16_reduce_fp32",
     "bucket_size_mb": 25.0 | 0.0001,                      # stages 0-2: one bucket or one per parameter
     "stage3": {"prefetch_depth": 1, "reshard_after_forward": true, "persistence_threshold": 0,
                "secondary_shard_size": null | k},              # hpZ (stage 3), k divides world_size
     "optimizer": {"kind": "sgd" | "adamw" | "adafactor" | "lamb", "lr": .., "momentum": .., "weight_decay": .., "two_groups": ..},
     "model": {"d_in": 3, "widths": [5, 7], "d_out": 2, "bias": true, "batch": 2,
               "tie_to": [null, 0],                        # block j's mix.weight is block tie_to[j]'s
               "frozen": ["blocks.0.fc.weight"]},
     "schedule": [["micro", {"sync": false, "scale": 0.5, "usage": [[2, 1], [2, 0]]}],   # per rank, per block
                  ["micro", {"sync": true, "scale": 0.5, "usage": [[2, 2], [2, 2]]}],
                  ["clip", 0.05], ["forward", {"usage": [[2, 2], [2, 2]]}], ["step"],
                  ["zero_grad", "optimizer" | "model"], ["write", {"how": "load" | "gathered", "seed": 3}]]}

Usage values are ``model.SKIP`` (0), ``DISCARD`` (1), ``USE`` (2). At stage 3 every rank calls the same
blocks in each micro-batch (a block not called on some rank is an error there, not a training pattern), so
only USE/DISCARD differ between ranks. The micro-batch before a clip or a step is synced (outside
``no_sync``). Every step is followed by a zero_grad.  A ``forward`` is a forward with autograd on whose
output gets no backward (its loss is compared, issue 38); it may come before a window's first micro-batch,
before the step and after the zero_grad.  A ``write`` changes the trainable weights after a zero_grad
(``model.write_weights``), so the next forward must see the new values (hpZ's secondary shards included).
"""

from __future__ import annotations

import json

from hypothesis import strategies as st

from tests.fuzz.model import DISCARD, SKIP, USE, FuzzModel, tie_roots

PRECISIONS = ("fp64", "bf16", "bf16_reduce_fp32")
TINY_BUCKET_MB = 1e-4  # ~100 bytes: every parameter in its own bucket
# How a "write" op changes the trainable weights between steps: the module's load_state_dict with full
# tensors, or an edit on rank 0 inside zp.gathered_parameters(modifier_rank=0) (model.write_weights).
WRITES = ("load", "gathered")


@st.composite
def specs(
    draw,
    stages=(0, 1, 2, 3),
    world_sizes=(1, 2, 3, 4),
    precisions=PRECISIONS,
    uneven=(False, True),
    frozen=(False, True),
    zero_grad=("optimizer", "optimizer", "model"),
    drop_steps=True,
    multi_sync=True,
    forwards=True,
    writes=True,
) -> dict:
    """Every dimension by default; the keyword arguments narrow the draw (``explore.py`` uses them to look
    past a known bug that would otherwise fail most specs first)."""
    stage = draw(st.sampled_from(stages))
    world_size = draw(st.sampled_from(world_sizes))
    model = draw(_models(frozen))
    return {
        "seed": draw(st.integers(0, 2**16)),
        "world_size": world_size,
        "stage": stage,
        "buffered": draw(st.booleans()),
        "offload": stage > 0 and draw(st.booleans()),
        "precision": draw(st.sampled_from(precisions)),
        "bucket_size_mb": draw(st.sampled_from([25.0, TINY_BUCKET_MB])),
        "stage3": {
            "prefetch_depth": draw(st.integers(0, 2)),
            "reshard_after_forward": draw(st.booleans()),
            "persistence_threshold": draw(st.sampled_from([0, 8])),
            "secondary_shard_size": draw(_secondary(stage, world_size)),
        },
        "optimizer": draw(_optimizers()),
        "model": model,
        "schedule": draw(
            _schedules(
                stage, world_size, len(model["widths"]), uneven, zero_grad, drop_steps, multi_sync, forwards, writes
            )
        ),
    }


@st.composite
def _models(draw, frozen) -> dict:
    depth = draw(st.integers(1, 4))
    widths = [draw(st.integers(1, 9)) for _ in range(depth)]
    tie_to = [None] + [draw(st.one_of(st.none(), st.integers(0, j - 1))) for j in range(1, depth)]
    tie_to = tie_roots(tie_to)
    widths = [widths[i] if i is not None else w for w, i in zip(widths, tie_to)]  # tied mixes are square alike
    m = {
        "d_in": draw(st.integers(1, 6)),
        "widths": widths,
        "d_out": draw(st.integers(1, 5)),
        "bias": draw(st.booleans()),
        "batch": draw(st.integers(1, 3)),
        "tie_to": tie_to,
        "frozen": [],
    }
    names = [n for n, _ in _shape_only(m).named_parameters() if n != "head.weight"]  # keep one trainable
    if draw(st.sampled_from(frozen)):
        m["frozen"] = [n for n in names if draw(st.integers(0, 3)) == 0]
    return m


def _shape_only(m: dict) -> FuzzModel:
    model = FuzzModel(m["d_in"], m["widths"], m["d_out"], m["bias"])
    for j, i in enumerate(m["tie_to"]):
        if i is not None:
            model.blocks[j].mix.weight = model.blocks[i].mix.weight
    return model


def _secondary(stage: int, world_size: int):
    """hpZ's k (a divisor of the world size above 1) on some stage-3 specs, else None."""
    sizes = [k for k in range(2, world_size + 1) if world_size % k == 0] if stage == 3 else []
    return st.sampled_from([None, *sizes]) if sizes else st.none()


def _optimizers():
    sgd = st.fixed_dictionaries(
        {
            "kind": st.just("sgd"),
            "lr": st.sampled_from([0.05, 0.2]),
            "momentum": st.sampled_from([0.0, 0.9]),
            "weight_decay": st.sampled_from([0.0, 0.01]),
            "two_groups": st.booleans(),
        }
    )
    adamw = st.fixed_dictionaries(
        {
            "kind": st.just("adamw"),
            "lr": st.sampled_from([0.01, 0.05]),
            "momentum": st.just(0.0),
            "weight_decay": st.sampled_from([0.0, 0.1]),
            "two_groups": st.booleans(),
        }
    )
    # shape-aware (issue #48): stepped whole by one owning rank at stages 1-3 ([Note: optimizer partitions])
    shaped = st.fixed_dictionaries(
        {
            "kind": st.sampled_from(["adafactor", "lamb"]),
            "lr": st.sampled_from([0.01, 0.05]),
            "momentum": st.just(0.0),
            "weight_decay": st.sampled_from([0.0, 0.1]),
            "two_groups": st.booleans(),
        }
    )
    return st.one_of(sgd, adamw, shaped)


@st.composite
def _usage(draw, stage: int, world_size: int, depth: int, uneven: bool) -> list[list[int]]:
    """One micro-batch: per rank, per block, SKIP / DISCARD / USE."""
    if not uneven:
        return [[USE] * depth for _ in range(world_size)]
    if stage == 3:  # every rank calls the same blocks
        called = [draw(st.integers(0, 3)) > 0 for _ in range(depth)]
        return [[(USE if draw(st.booleans()) else DISCARD) if c else SKIP for c in called] for _ in range(world_size)]
    return [[draw(st.sampled_from([SKIP, DISCARD, USE, USE])) for _ in range(depth)] for _ in range(world_size)]


@st.composite
def _schedules(
    draw,
    stage: int,
    world_size: int,
    depth: int,
    uneven,
    zero_grad,
    drop_steps: bool,
    multi_sync: bool,
    forwards: bool,
    writes: bool,
) -> list:
    uneven = draw(st.sampled_from(uneven))
    schedule: list = []

    def maybe_forward():  # a forward with autograd on whose output gets no backward (an evaluation pass)
        if forwards and draw(st.integers(0, 3)) == 0:
            schedule.append(["forward", {"usage": draw(_usage(stage, world_size, depth, uneven))}])

    for _ in range(draw(st.integers(1, 3))):
        maybe_forward()
        k = draw(st.integers(1, 3))
        for i in range(k):
            sync = i == k - 1 or (multi_sync and draw(st.booleans()))
            usage = draw(_usage(stage, world_size, depth, uneven))
            schedule.append(["micro", {"sync": sync, "scale": 1.0 / k, "usage": usage}])
        if draw(st.booleans()):
            schedule.append(["clip", draw(st.sampled_from([0.05, 1.0, 100.0]))])
        if not drop_steps or draw(st.integers(0, 5)) > 0:
            maybe_forward()
            schedule.append(["step"])
        # else: the accumulated (maybe clipped) gradients are dropped by the zero_grad below
        schedule.append(["zero_grad", draw(st.sampled_from(zero_grad))])
        maybe_forward()
        if writes and draw(st.integers(0, 3)) == 0:
            how = draw(st.sampled_from(WRITES))
            schedule.append(["write", {"how": how, "seed": draw(st.integers(0, 99))}])
    return schedule


def written_spec(schedule: list, world_size: int, stage: int, depth: int = 2, **fields) -> dict:
    """A spec written by hand (the focused tests pin the schedules the fuzzer found): an fp64 AdamW run of
    ``depth`` untied blocks of width 5, in-place layout, no offload; ``fields`` replace top-level keys, and
    ``secondary_shard_size`` / ``prefetch_depth`` the stage-3 ones."""
    stage3 = {"prefetch_depth": 1, "reshard_after_forward": True, "persistence_threshold": 0}
    stage3.update({k: fields.pop(k) for k in ("secondary_shard_size", "prefetch_depth") if k in fields})
    spec = {
        "seed": 7,
        "world_size": world_size,
        "stage": stage,
        "buffered": False,
        "offload": False,
        "precision": "fp64",
        "bucket_size_mb": 25.0,
        "stage3": stage3,
        "optimizer": {"kind": "adamw", "lr": 0.05, "momentum": 0.0, "weight_decay": 0.1, "two_groups": False},
        "model": {
            "d_in": 3,
            "widths": [5] * depth,
            "d_out": 2,
            "bias": True,
            "batch": 2,
            "tie_to": [None] * depth,
            "frozen": [],
        },
        "schedule": schedule,
    }
    spec.update(fields)
    return spec


def to_json(spec: dict) -> str:
    return json.dumps(spec, sort_keys=True, separators=(",", ":"))


def from_json(text: str) -> dict:
    return json.loads(text)
