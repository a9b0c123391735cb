"""What a training step holds above the resting RSS, per phase: peak RSS of forward, backward, optimizer step.

    zero-plugin launch --stage 3 --num_processes 2 benchmarks/step_memory.py \\
        examples/finetune_trainer.py --model /data/llama-1b --max_steps 3 --batch_size 1 --max_length 64 ...

Runs the script given (unmodified) after installing, in this process only:
* a process-wide ``torch.autograd.graph.saved_tensors_hooks`` that records every tensor autograd saves
  for backward (by storage, so views and tensors saved twice count once);
* phase boundaries: the start and end of ``torch.autograd.backward`` and, through torch's global
  optimizer hooks, the start and end of every ``Optimizer.step``.  At each boundary the kernel's peak RSS
  (``VmHWM``) is read and reset (``/proc/self/clear_refs``), so each line gives the peak *within* the
  phase that just ended: ``forward`` (from the last step's end to backward: the forward, plus the
  dataloader, logging and ``zero_grad``), ``backward``, ``between`` (backward end to step: clipping), ``step``.
Optimizer hooks fire for a wrapping optimizer's step and its inner one's alike, so under zero_plugin a step
gives two ``between`` and two ``step`` lines (the step counter counts both).  One JSON line per phase and rank (prefix ``step_memory``): the phase, its peak and end ``VmRSS`` (MiB),
glibc's heap figures at its end (``mallinfo2``: bytes in use, free but kept), and for ``forward`` the
bytes of distinct storages saved for backward, split into parameters (gathered weights the backward
needs) and everything else (activations), with the 5 largest activation storages and their shapes.
"""

from __future__ import annotations

import ctypes
import json
import os
import runpy
import sys

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

_MIB = 2**20


class _Mallinfo2(ctypes.Structure):
    _fields_ = [
        (name, ctypes.c_size_t)
        for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks")
    ] + [("keepcost", ctypes.c_size_t)]


def _heap() -> dict[str, float]:
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _Mallinfo2
        info = libc.mallinfo2()
    except (OSError, AttributeError):
        return {}
    return {
        "heap_in_use_MiB": round((info.uordblks + info.hblkhd) / _MIB, 1),
        "heap_free_kept_MiB": round(info.fordblks / _MIB, 1),
        "mmapped_MiB": round(info.hblkhd / _MIB, 1),
    }


def _status() -> dict[str, int]:
    with open("/proc/self/status", encoding="ascii") as f:
        rows = dict(line.split(":", 1) for line in f)
    return {k: int(rows[k].split()[0]) // 1024 for k in ("VmRSS", "VmHWM", "RssAnon", "RssFile")}


class _Saved:
    def __init__(self) -> None:
        self.storages: dict[int, tuple[int, bool, tuple[int, ...], str]] = {}
        self.step = 0
        self.engine = None

    def pack(self, tensor: torch.Tensor):
        if tensor.device.type == "cpu" and not tensor.is_meta:
            storage = tensor.untyped_storage()
            key = storage.data_ptr()
            if key and key not in self.storages:
                is_param = (
                    isinstance(tensor, torch.nn.Parameter)
                    or tensor._base is not None
                    and isinstance(tensor._base, torch.nn.Parameter)
                )
                self.storages[key] = (storage.nbytes(), is_param, tuple(tensor.shape), str(tensor.dtype))
        return tensor

    @staticmethod
    def unpack(tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def saved(self) -> dict:
        acts = [v for v in self.storages.values() if not v[1]]
        params = [v for v in self.storages.values() if v[1]]
        largest = sorted(acts, key=lambda v: -v[0])[:5]
        self.storages.clear()
        return {
            "saved_activations_MiB": round(sum(v[0] for v in acts) / _MIB, 1),
            "saved_activation_storages": len(acts),
            "saved_params_MiB": round(sum(v[0] for v in params) / _MIB, 1),
            "largest_activations": [[round(v[0] / _MIB, 2), list(v[2]), v[3]] for v in largest],
        }

    def gathered(self) -> list:
        """[unit name, full MiB] of each stage-3 unit gathered at this moment."""
        if self.engine is None or not hasattr(self.engine, "unsharded_units"):
            return []
        return [
            [u.name, round(sum(sp.layout.numel * sp.param.element_size() for sp in u.params) / _MIB, 1)]
            for u in self.engine.unsharded_units()
        ]

    def boundary(self, phase: str) -> None:
        """End of ``phase``: its peak (VmHWM since the last boundary), then reset the peak."""
        status = _status()
        line = {
            "rank": int(os.environ.get("RANK", "0")),
            "step": self.step,
            "phase": phase,
            "peak_MiB": status["VmHWM"],
            "end_MiB": status["VmRSS"],
            "anon_MiB": status["RssAnon"],
            **_heap(),
            "gathered_units": self.gathered(),
            **(self.saved() if phase == "forward" else {}),
        }
        print("step_memory " + json.dumps(line), flush=True)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := current RSS
        if phase == "step":
            self.step += 1


def install() -> None:
    saved = _Saved()
    torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack).__enter__()  # for the whole process
    original = torch.autograd.backward

    def backward(*args, **kwargs):
        saved.boundary("forward")
        try:
            return original(*args, **kwargs)
        finally:
            saved.boundary("backward")

    torch.autograd.backward = backward  # Tensor.backward calls torch.autograd.backward
    import zero_plugin
    from zero_plugin.engines.engine import engine_of

    setup = zero_plugin.setup

    def setup_and_keep(model, optimizer, *args, **kwargs):
        result = setup(model, optimizer, *args, **kwargs)
        if optimizer is not None:
            saved.engine = engine_of(model, "step_memory")
        return result

    zero_plugin.setup = setup_and_keep
    register_optimizer_step_pre_hook(lambda *a: saved.boundary("between"))
    register_optimizer_step_post_hook(lambda *a: saved.boundary("step"))


def main() -> None:
    if len(sys.argv) < 2:
        raise SystemExit("usage: step_memory.py SCRIPT [ARGS...]")
    install()
    script = os.path.abspath(sys.argv[1])
    sys.argv = sys.argv[1:]
    sys.path[0] = os.path.dirname(script)
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
