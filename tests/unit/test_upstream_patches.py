"""[Note: patched upstream names] (issue #51, item 6): every private name of transformers, PEFT and TRL that
zero_plugin replaces is in ``zero_plugin/upstream.py``'s table, and still takes the parameters our replacement
relies on in the installed versions.  An upgrade that renames or changes one fails here, naming the patched
function, instead of deep inside a training run."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings

from zero_plugin import upstream

# Run in a fresh interpreter: nothing of ours patched yet (a test in this process may have installed the hooks).
_PROBLEMS = "import json; from zero_plugin import upstream; print(json.dumps(upstream.problems()))"
_CLASSES = {
    "transformers.trainer.Trainer": "transformers.trainer",
    "transformers.training_args.TrainingArguments": "transformers.training_args",
    "transformers.modeling_utils.PreTrainedModel": "transformers.modeling_utils",
    "peft.tuners.tuners_utils.BaseTunerLayer": "peft.tuners.tuners_utils",
    "peft.tuners.tuners_utils.BaseTuner": "peft.tuners.tuners_utils",
    "trl.generation.vllm_generation.VLLMGeneration": "trl.generation.vllm_generation",
}
# Every install function of ours; what they change on the classes above (and transformers.trainer's names) must
# be in the table.
_CHANGED = """
import importlib, json
classes = {classes}
def snapshot():
    out = {{}}
    for path, module in classes.items():
        cls = getattr(importlib.import_module(module), path.rsplit(".", 1)[1])
        out.update({{path + "." + k: id(v) for k, v in vars(cls).items()}})
    trainer = importlib.import_module("transformers.trainer")
    out.update({{"transformers.trainer." + k: id(v) for k, v in vars(trainer).items()}})
    return out
before = snapshot()
from zero_plugin.integrations import deepspeed_config, hf_trainer, trl_vllm
from zero_plugin.loading import lazy_edits, lazy_pretrained
hf_trainer.install(); deepspeed_config.install(); trl_vllm.install(); lazy_pretrained.install(); lazy_edits.install()
after = snapshot()
print(json.dumps(sorted(k for k in after if before.get(k) != after[k])))
"""


def _run(code: str) -> list:
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def test_every_patched_name_still_takes_the_parameters_we_rely_on() -> None:
    found = _run(_PROBLEMS)
    assert not found, "upstream names zero_plugin replaces changed:\n" + "\n".join(found)


def test_every_name_our_install_functions_replace_is_in_the_table() -> None:
    changed = set(_run(_CHANGED.format(classes=repr(_CLASSES))))
    changed -= {"transformers.trainer.Trainer._zero_plugin_installed"}  # our own markers
    changed -= {"transformers.training_args.TrainingArguments._zero_plugin_takes_deepspeed"}
    listed = {patch.target for patch in upstream.PATCHES}
    assert changed, "the install functions changed nothing: the snapshot misses them"
    assert changed <= listed, f"patched but not in zero_plugin/upstream.py's PATCHES: {sorted(changed - listed)}"


def test_a_changed_signature_is_reported_by_name(monkeypatch) -> None:
    moved = upstream.Patch(
        "transformers.trainer.Trainer.save_model", "self, path", "zero_plugin.integrations.hf_trainer", "test"
    )
    gone = upstream.Patch("transformers.trainer.Trainer._no_such_method", "self", "zero_plugin.x", "test")
    monkeypatch.setattr(upstream, "PATCHES", (moved, gone))
    found = upstream.problems("transformers")  # the real Trainer may be patched here: only "gone" is sure
    assert any("_no_such_method" in f and "is gone" in f for f in found), found

    class Trainer:  # the class given (another test of this process may have patched the real one)
        def save_model(self, output_dir=None, _internal_call=False): ...

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        upstream.check("transformers.trainer.Trainer", Trainer)  # looked up on the class given: no import
        upstream.check("transformers.trainer.Trainer", Trainer)  # once per finding
    assert len(seen) == 2 and "Trainer.save_model" in str(seen[0].message), [str(w.message) for w in seen]
