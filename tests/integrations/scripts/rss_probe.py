"""Run an example unmodified and measure its host memory over from_pretrained + prepare, per rank.

    zero-plugin launch --stage 3 --num_processes 2 rss_probe.py OUT EXAMPLE.py [example args...]

At the first ``from_pretrained`` the probe takes the RSS and resets the kernel's peak (``VmHWM``, via
``/proc/self/clear_refs``); when the first ``zp.setup`` with an optimizer returns (inside
``accelerator.prepare``, the Trainer's ``train`` or Lightning's ``fit``) it reads the peak and writes
``OUT/rank<r>.json``: the growth (peak minus the RSS before loading), this rank's shard bytes, the largest
unit's full bytes (``lazy_load.unit_sizes``) and how many parameters were still on meta after loading.
Used by tests/integrations/test_examples_memory.py.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from lazy_load import import_model_code, rss_bytes, unit_sizes  # noqa: E402


def _peak_bytes() -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        rows = dict(line.split(":", 1) for line in f)
    return int(rows["VmHWM"].split()[0]) * 1024


def install(out: Path) -> None:
    import transformers.modeling_utils as modeling_utils

    import zero_plugin

    state: dict = {}
    load, setup = modeling_utils.PreTrainedModel.from_pretrained.__func__, zero_plugin.setup

    def from_pretrained(cls, *args, **kwargs):
        first = "before" not in state
        if first:
            state["before"] = rss_bytes()
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")  # resets VmHWM to the current RSS
        model = load(cls, *args, **kwargs)
        if first:
            state["meta_after_load"] = sum(p.is_meta for p in model.parameters())
        return model

    def probed_setup(model, optimizer, *args, **kwargs):
        result = setup(model, optimizer, *args, **kwargs)
        if optimizer is not None and "before" in state and "growth" not in state:
            state["growth"] = _peak_bytes() - state["before"]
            state.update(unit_sizes(model))
            out.mkdir(parents=True, exist_ok=True)
            (out / f"rank{os.environ.get('RANK', '0')}.json").write_text(json.dumps(state))
        return result

    modeling_utils.PreTrainedModel.from_pretrained = classmethod(from_pretrained)
    zero_plugin.setup = probed_setup


def main() -> None:
    out, script = Path(sys.argv[1]), os.path.abspath(sys.argv[2])
    import_model_code(lora=True)  # code, not weights: the growth measured is tensors
    install(out)
    sys.argv = sys.argv[2:]
    sys.path[0] = os.path.dirname(script)
    runpy.run_path(script, run_name="__main__")


if __name__ == "__main__":
    main()
