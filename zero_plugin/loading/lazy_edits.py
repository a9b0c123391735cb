"""What a lazily loaded model accepts between ``from_pretrained`` and ``zp.setup``.

[Note: edits before setup]
Scripts edit the model they loaded before handing it to ``prepare``.  On a lazily loaded model ([Note: lazy
from_pretrained] in ``lazy_pretrained.py``) the parameters are on meta, so each edit is made to mean what it
means eagerly:

* ``.to(device)``, ``.cuda()``, ``.cpu()``, ``.half()``, ``.to(dtype)``, ``.float()``: all are
  ``Module._apply``, which ``PreTrainedModel`` gets here.  Real tensors (buffers, fresh adapters, a resized
  embedding) move and cast as asked; a meta parameter stays on meta and takes the dtype, and the dtypes it
  passed through are replayed on its values when they are read ([Note: casts on meta] in ``materialize.py``).
  Its device is not kept: ``zp.setup`` places every shard on the process's device
  (Accelerate's ``accelerator.device``), where the script moved it.
* ``resize_token_embeddings`` (``run_clm_no_trainer.py`` when the tokenizer outgrew the embedding, TRL's
  ``clone_chat_template``): transformers reads the old rows (the new rows are drawn from a normal with their
  mean and covariance, from the global RNG; the old rows are copied).  Just before, the input embedding and
  the output layer are read from the files for real, in this process (one tensor each, the rest stays on
  meta), and transformers' resize runs as eagerly: the same values and the same RNG draws.
* a forward (``generate``, an evaluation before training) needs every weight: it is refused, naming the
  cause and the switch that loads eagerly (``ZeroConfig.lazy_loading``).

``train()`` / ``eval()``, ``tie_weights``, ``gradient_checkpointing_enable`` and PEFT (adapters: [Note: PEFT
adapters on a meta base]) need no values and work as they are.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from .. import upstream
from . import materialize

__all__ = ["install", "uninstall", "refuse_forward"]

_ORIGINALS: dict[str, object] = {}
_MISSING = object()
_EAGER_SWITCH = (
    "load eagerly instead (every process then holds a full copy until setup): ZERO_PLUGIN_LAZY_LOADING=false, "
    "or lazy_loading: false in the zero_plugin config (--zero_config)"
)


def install() -> None:
    """Give ``PreTrainedModel`` the ``_apply`` and ``_resize_token_embeddings`` above (idempotent)."""
    from transformers.modeling_utils import PreTrainedModel

    if "apply" not in _ORIGINALS:
        upstream.check("transformers.modeling_utils.PreTrainedModel", PreTrainedModel)  # [Note: patched upstream names]
        _ORIGINALS["apply"] = PreTrainedModel.__dict__.get("_apply", _MISSING)
        _ORIGINALS["resize"] = PreTrainedModel.__dict__["_resize_token_embeddings"]
        PreTrainedModel._apply = _apply_keeping_meta
        PreTrainedModel._resize_token_embeddings = _resize_with_real_embeddings


def uninstall() -> None:
    if "apply" in _ORIGINALS:
        from transformers.modeling_utils import PreTrainedModel

        original = _ORIGINALS.pop("apply")
        if original is _MISSING:
            del PreTrainedModel._apply
        else:
            PreTrainedModel._apply = original
        PreTrainedModel._resize_token_embeddings = _ORIGINALS.pop("resize")


# -- moves and casts -------------------------------------------------------------------------------
class _MetaStaysMeta(TorchDispatchMode):
    """A copy of a meta tensor to a device stays on meta (with the dtype asked for): there is nothing to copy."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is torch.ops.aten._to_copy.default and args[0].is_meta:
            kwargs["device"] = torch.device("meta")
            kwargs.pop("pin_memory", None)
        return func(*args, **kwargs)


def _apply_keeping_meta(self, fn, recurse=True):
    original = _ORIGINALS["apply"]
    apply = nn.Module._apply if original is _MISSING else original
    if not (materialize.is_recorded(self) and materialize.has_meta_params(self)):
        return apply(self, fn, recurse)
    before = {
        (module, attr): p.dtype
        for module in self.modules()
        for attr, p in module._parameters.items()
        if p is not None and p.is_meta
    }
    with _MetaStaysMeta():
        out = apply(self, fn, recurse)
    for (module, attr), dtype in before.items():
        now = module._parameters[attr].dtype
        if now != dtype:
            materialize.note_cast(module, attr, dtype, now)
    return out


# -- vocabulary resize -----------------------------------------------------------------------------
def _resize_with_real_embeddings(self, new_num_tokens=None, pad_to_multiple_of=None, mean_resizing=True):
    if materialize.is_recorded(self) and _changes_rows(self, new_num_tokens, pad_to_multiple_of):
        heads = [self.get_input_embeddings(), self.get_output_embeddings()]
        materialize.load_params(self, [p for m in heads if m is not None for p in m.parameters(recurse=False)])
    return _ORIGINALS["resize"](self, new_num_tokens, pad_to_multiple_of, mean_resizing)


def _changes_rows(model, new_num_tokens: int | None, pad_to_multiple_of: int | None) -> bool:
    """The resize will read the old rows (transformers returns early when the row count stays)."""
    rows = model.get_input_embeddings().weight.shape[0]
    target = rows if new_num_tokens is None else new_num_tokens
    if isinstance(pad_to_multiple_of, int) and pad_to_multiple_of > 0:
        target = -(-target // pad_to_multiple_of) * pad_to_multiple_of
    return target != rows


# -- forward ---------------------------------------------------------------------------------------
def refuse_forward(model: nn.Module) -> Callable[[], None]:
    """Refuse a forward of the lazily loaded ``model`` while a weight is on meta; returns the undo."""
    return model.register_forward_pre_hook(_refuse_forward_on_meta).remove


def _refuse_forward_on_meta(module: nn.Module, args) -> None:
    meta = next((name for name, p in module.named_parameters() if p.is_meta), None)
    if meta is not None:
        raise RuntimeError(
            f"zero_plugin: {type(module).__name__} was loaded lazily (from_pretrained under zero-plugin launch / "
            "zero_plugin.run at stage 3, or with cpu_ram_efficient_loading): its weights (e.g. "
            f"{meta!r}) stay on the meta device until accelerator.prepare / zp.setup reads them, so it cannot run "
            f"before that. Run it after prepare, or {_EAGER_SWITCH}"
        )
