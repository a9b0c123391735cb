"""The single-process reference for one fuzz spec, in float64.

Each micro-batch's loss is the mean over ranks of rank r's loss on its own batch with its own block usage,
so the gradients are what data-parallel averaging gives; no_sync only delays that averaging, so the
reference ignores it.
"""

from __future__ import annotations

import copy

import torch

from tests.fuzz.model import FORWARD_BATCHES, batch, build_model, build_optimizer, loss_fn, trainable_names, written


def reference(spec: dict) -> dict:
    """Losses per rank per micro-batch, clip norms, initial and final parameters (name -> float64 tensor)."""
    n = spec["world_size"]
    model = build_model(spec, torch.float64)
    opt = build_optimizer(spec, model)
    initial = {k: v.detach().clone() for k, v in model.state_dict().items()}
    trainable = [p for p in model.parameters() if p.requires_grad]
    losses, norms, forwards, micro = [], [], [], 0
    for op in spec["schedule"]:
        if op[0] == "forward":
            forwards.append(_forward(spec, model, op, len(forwards), n, torch.float64))
        elif op[0] == "write":
            _write(model, op[1])
        elif op[0] == "micro":
            per_rank = []
            for r in range(n):
                x, y = batch(spec, micro, r, torch.float64)
                per_rank.append(loss_fn(model(x, op[1]["usage"][r]), y))
            (torch.stack(per_rank).mean() * op[1]["scale"]).backward()
            losses.append([v.item() for v in per_rank])
            micro += 1
        else:
            _optimizer_op(op, opt, trainable, norms)
    final = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"losses": losses, "norms": norms, "forwards": forwards, "initial": initial, "final": final}


@torch.no_grad()
def _forward(spec: dict, model: torch.nn.Module, op: list, index: int, n: int, dtype: torch.dtype) -> list[float]:
    """A ``forward`` op's loss on each rank's batch (autograd does not change it); a bf16 ``model`` gets bf16
    inputs and float32 targets, as the micro-batches of :func:`reference_bf16`."""
    out = []
    for r in range(n):
        x, y = batch(spec, FORWARD_BATCHES + index, r, torch.float64 if dtype == torch.float64 else torch.float32)
        out.append(loss_fn(model(x.to(dtype), op[1]["usage"][r]), y).item())
    return out


@torch.no_grad()
def _write(model: torch.nn.Module, how: dict, param_dtype: torch.dtype | None = None) -> None:
    """A ``write`` op on the reference's weights; with ``param_dtype`` (the bf16 emulation's masters) a
    gathered edit is computed on the parameters as the ranks hold them, in ``param_dtype``."""
    params = dict(model.named_parameters())
    for i, name in enumerate(trainable_names(model)):
        p = params[name]
        if param_dtype is not None and how["how"] == "gathered":
            p.copy_(written(i, p.to(param_dtype), how["seed"]))
        else:
            p.copy_(written(i, p, how["seed"]))


def reference_bf16(spec: dict) -> dict:
    """The mixed-precision recipe in one process: fp32 masters, each rank's forward and backward in bf16,
    the ranks' bf16 gradients summed in fp32 and divided by N, clip and step on the masters.

    Not bitwise what the ranks do (their sum runs in ``reduce_dtype``, in the collective's order), but it
    rounds where they round, so its distance from the float64 reference calibrates theirs.

    [Note: gradients within the reduction's rounding of zero]
    With ``precision: bf16`` the ranks sum their gradients in bf16 (no fp32 reduction), and a sum of near-
    cancelling terms comes out with any sign, or zero, within (terms) x 2^-8 x the sum of their magnitudes.
    AdamW's update of such an element is sign-like (about +-lr whatever the size of its gradient), so its
    weight may land 2 x lr away from the emulation's although every operation rounded as bf16 may (seeds
    300301, 77777 and 912345: all four such specs pass with ``bf16_reduce_fp32`` and with SGD).  With
    ``bf16_reduce_fp32`` the sum across ranks is exact enough, but the micro-batches of one step still add up
    in the bf16 ``param.grad`` at stages 0-1, as under DDP: under ``no_sync`` before the reduction (seed 2718281:
    a tied weight's two near-cancelling micro-batches, AdamW; SGD passes) and, synced, after it (seed 1618033,
    stage 0), within (micro-batches) x 2^-8 x the sum of their magnitudes.  Those
    elements are returned in ``ambiguous`` (from the step that met them on) and left out of the comparison; a
    step after that one computes on weights that differ there, so every other weight may follow the run's own
    path a little (seed 1618033: 0.0276 against 0.0228 allowed, after masking), and ``stepped_after_ambiguous``
    doubles the allowance (bugs the fuzzer found stood at 0.55 and 0.83);
    an element whose gradient stands clear of that bound is compared as before, so a dropped or doubled
    micro-batch still shows.
    """
    n = spec["world_size"]
    master = build_model(spec, torch.float32)
    work = copy.deepcopy(master).to(torch.bfloat16)  # deepcopy keeps the ties
    opt = build_optimizer(spec, master)
    pairs = [(m, w) for m, w in zip(master.parameters(), work.parameters()) if m.requires_grad]
    trainable = [m for m, _ in pairs]
    losses, norms, forwards, micro = [], [], [], 0
    # SGD's step is proportional to the gradient: nothing to leave out; AdamW, Adafactor and LAMB normalise it
    adamw = spec["optimizer"]["kind"] != "sgd"
    magnitude: dict[int, torch.Tensor] = {}  # id(master) -> sum of |each rank's term| since zero_grad
    terms = 0  # bf16 additions into each gradient since zero_grad with a bf16 sum: N per micro-batch
    micros = 0  # micro-batches since zero_grad
    ambiguous = {id(m): torch.zeros_like(m, dtype=torch.bool) for m in trainable}
    steps_after = 0  # steps taken since the first one that met an ambiguous element (that one included)

    def refresh():
        with torch.no_grad():
            for m, w in zip(master.parameters(), work.parameters()):
                w.copy_(m)

    for op in spec["schedule"]:
        if op[0] == "forward":
            refresh()
            forwards.append(_forward(spec, work, op, len(forwards), n, torch.bfloat16))
        elif op[0] == "write":
            _write(master, op[1], torch.bfloat16)
        elif op[0] == "micro":
            losses.append([])
            refresh()
            for r in range(n):
                work.zero_grad()
                x, y = batch(spec, micro, r, torch.float32)
                loss = loss_fn(work(x.to(torch.bfloat16), op[1]["usage"][r]), y)
                (loss * op[1]["scale"]).backward()
                losses[-1].append(loss.item())
                for m, w in pairs:
                    if w.grad is not None:
                        add = w.grad.float() / n
                        m.grad = add if m.grad is None else m.grad + add
                        magnitude[id(m)] = add.abs() + magnitude.get(id(m), 0.0)
            terms += n
            micros += 1
            micro += 1
        else:
            additions = terms if spec["precision"] == "bf16" else micros if micros > 1 else 0
            if op[0] == "step":
                met_any = False
                for m in trainable:
                    if adamw and additions and m.grad is not None:
                        bound = (additions + 1) * 2**-8 * magnitude[id(m)]
                        met = (m.grad.abs() <= bound) & (bound > 0)
                        ambiguous[id(m)] |= met
                        met_any |= bool(met.any())
                steps_after += 1 if steps_after or met_any else 0
            elif op[0] == "zero_grad":
                magnitude, terms, micros = {}, 0, 0
            _optimizer_op(op, opt, trainable, norms)
    final = {k: v.detach().to(torch.float64).clone() for k, v in master.state_dict().items()}
    ambiguous_by_key = {
        k: ambiguous[id(p)] for k, p in master.named_parameters(remove_duplicate=False) if id(p) in ambiguous
    }
    return {
        "losses": losses,
        "norms": norms,
        "forwards": forwards,
        "final": final,
        "ambiguous": ambiguous_by_key,
        "stepped_after_ambiguous": steps_after > 1,
    }


def _optimizer_op(op: list, opt: torch.optim.Optimizer, trainable: list, norms: list) -> None:
    """``clip`` / ``step`` / ``zero_grad`` of a schedule, as torch does them in one process."""
    if op[0] == "clip":
        norms.append(float(torch.nn.utils.clip_grad_norm_(trainable, op[1])))
    elif op[0] == "step":
        opt.step()
    elif op[0] == "zero_grad":
        opt.zero_grad()
