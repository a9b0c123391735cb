"""transformers ``Trainer`` under zero_plugin's Accelerator.

With ``accelerate.Accelerator`` swapped for zero_plugin's (``zero_plugin.run`` does it), the Trainer
already prepares, steps, accumulates, clips and evaluates through the Accelerator.  What remains
are the Trainer methods that assume every rank holds the full model or optimizer:

* ``save_model``: the Trainer saves on rank 0 only, from ``model.state_dict()`` (a shard at
  stage 3).  Here every rank joins the collective ``zp.full_state_dict`` and rank 0 writes
  (for a PEFT model only what ``PeftModel.save_pretrained`` keeps is gathered: the trainable adapter
  weights, and the embedding layers whole where PEFT saves them, e.g. LoRA on ``embed_tokens``).
* ``_save_optimizer_and_scheduler`` / ``_load_optimizer_and_scheduler``: the optimizer state is
  saved with ``common.save_sharded`` into ``checkpoint-N/zero_plugin/`` and loaded back on resume
  (a plain DDP checkpoint's ``optimizer.pt`` also loads: it is a full state dict; a checkpoint the Trainer
  wrote under DeepSpeed ZeRO, ``global_stepN/`` + ``latest``, loads weights and optimizer state from
  DeepSpeed's files, ``_load_from_checkpoint`` leaving the weights to that).  ``optimizer.pt``
  is a stub that a plain Trainer fails to load with a message naming the fix ([Note: optimizer stub]).
* ``_load_best_model`` (``load_best_model_at_end``): every rank loads the best checkpoint's weights
  from its ``zero_plugin/`` folder with ``zp.load_checkpoint`` (model only).
* ``create_accelerator_and_postprocess``: refuses the features that re-prepare a model
  (``auto_find_batch_size``) or need what the checkpoint lacks.
* ``_move_model_to_device``: ``Trainer.__init__`` moves the whole model to the device; a lazily loaded
  model has meta parameters, and stage 3 places one unit at a time (``place_before_setup``).
* ``_get_dataloader``, ``get_resumed_dataloader``, ``_get_num_items_in_batch``, ``training_step``,
  ``compute_loss``, ``evaluation_loop``: Ulysses sequence parallelism (``ZeroConfig.sequence_parallel_size`` K > 1), [Note: the
  Trainer under sequence parallelism].
* ``_build_accelerator_args``, ``create_optimizer``, ``create_scheduler``: a ``TrainingArguments(deepspeed=...)``
  taken over by ``deepspeed_config.py`` gives the Accelerator its ``ZeroConfig``, and its ``optimizer`` /
  ``scheduler`` sections the optimizer and schedule DeepSpeed would have built (torch's AdamW over every
  trainable parameter in one group; DeepSpeed's warm-up rates step for step).

:func:`install` patches these onto ``transformers.Trainer`` in one place; each override falls
back to the original method when the Trainer's accelerator is not zero_plugin's.

[Note: the Trainer under sequence parallelism]
With K > 1 the training loader is the accelerator's sequence-parallel one ([Note: sequence-parallel data loaders]
in ``accelerate.py``): sharded over the N / K data-parallel groups, each batch split into this rank's 1/K
(``input_ids``, ``position_ids``, ``shift_labels``).  The loss must be the whole sequences', so:

* ``_get_num_items_in_batch`` counts the labels of the split batches (``shift_labels`` != -100) over the
  accumulation steps: summed over all N ranks with ``average_tokens_across_devices`` (each token counted once: the
  slices of a group are disjoint), else over the rank's group and divided by K.
* ``compute_loss`` runs the model without ``labels=`` (its own loss would shift inside the slice) and computes
  this rank's sum S_r of per-token cross-entropies, tiled (``zp.tiled_lm_loss`` on the backbone's hidden states,
  the logits of the rank's s/K tokens never built: [Note: the Trainer's tiled loss]) where the model's head is
  provably a plain linear map, else from the logits (``token_loss_sum``); S_r is normalised as the Trainer
  normalises the model's own loss without sequence parallelism: S_r / num_items_in_batch, times N with
  ``average_tokens_across_devices``.  ZeRO averages gradients over the N ranks, so the step's gradient is the sum
  over every token of the step divided by the step's count of labels, what K = 1 computes; the logged loss (the
  ranks' mean) is that mean.  Without ``num_items_in_batch`` (a model whose forward takes no loss keyword
  arguments) the loss is ``zp.sequence_parallel_loss`` (``zp.tiled_lm_loss(..., sequence_parallel=model)`` where
  tiled), each micro-batch's whole-sequence mean, which the Trainer divides by the accumulation steps.  Either way
  each rank of a group scales its own S_r by the same factor ([Note: sequence-parallel loss] in
  ``zero_plugin/sequence/loss.py``).
* A subclass that computes its own loss (TRL's ``SFTTrainer``: its fused LM head reads ``shift_labels`` and
  divides by ``num_items_in_batch``, times N) gets the same count, so its loss is exact too; one that would get no
  count is refused, as are ``compute_loss_func``, label smoothing and TRL's MoE auxiliary loss and Liger kernels,
  which would compute a loss on a slice as if it were a sequence.
* Evaluation runs on whole sequences: the evaluation loaders are prepared without the split (sharded over all N
  ranks as without sequence parallelism) and ``evaluation_loop`` runs inside ``zp.sequence_parallel_of(model)
  .paused()``, so the model's own loss and ``compute_metrics`` see what they see at K = 1.
"""

from __future__ import annotations

import inspect
import os
import warnings
from typing import Any, Callable

import torch
from torch import nn

import zero_plugin as zp
from zero_plugin.ckpt.deepspeed_reader import find_tag_dir
from zero_plugin.ckpt.rng import capture_rng, restore_rng
from zero_plugin.sequence.batch import IGNORE_INDEX, expect_batch
from zero_plugin.sequence.loss import token_loss_sum
from zero_plugin.sequence.parallel import find_sequence_parallel
from zero_plugin.sequence.tiled_loss import DEFAULT_TILE_TOKENS
from zero_plugin.state_dict import raw_state_dict

from .. import upstream
from . import common, deepspeed_config
from .accelerate import Accelerator as ZeroAccelerator
from .accelerate import SequenceParallelDataLoader, place_before_setup
from .optimizer_stub import is_stub, write_stub

__all__ = ["install"]

CHECKPOINT_SUBDIR = "zero_plugin"
_ORIGINALS: dict[str, Callable] = {}


def _uses_zero(trainer: Any) -> bool:
    return isinstance(getattr(trainer, "accelerator", None), ZeroAccelerator)


def _set_up_model(trainer: Any) -> nn.Module | None:
    model = trainer.model
    return model if _uses_zero(trainer) and common.is_set_up(model) else None


def _is_peft(model: nn.Module) -> bool:
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


# -- overrides (self is a transformers.Trainer) ------------------------------------------------
def create_accelerator_and_postprocess(self) -> None:
    _ORIGINALS["create_accelerator_and_postprocess"](self)
    if _uses_zero(self):
        _check_supported(self.args)


def _check_supported(args: Any) -> None:
    if getattr(args, "load_best_model_at_end", False) and getattr(args, "save_only_model", False):
        raise ValueError(
            "zero_plugin: TrainingArguments.load_best_model_at_end=True with save_only_model=True is not "
            "supported: the best weights are loaded from checkpoint-N/zero_plugin/, which "
            "save_only_model skips; set save_only_model=False"
        )
    refused = {
        "auto_find_batch_size": "it re-prepares the model after an out-of-memory error, and a sharded model is "
        "set up once; set per_device_train_batch_size instead",
        "deepspeed": "zero_plugin replaces DeepSpeed; choose the ZeRO stage with zero-plugin launch --stage",
        "fsdp": "zero_plugin replaces FSDP; choose the ZeRO stage with zero-plugin launch --stage",
    }
    for name, why in refused.items():
        if name == "deepspeed" and deepspeed_config.taken_over(args) is not None:
            continue  # translated to a ZeroConfig (deepspeed_config.py)
        if getattr(args, name, None):
            raise ValueError(f"zero_plugin: TrainingArguments.{name}={getattr(args, name)!r} is not supported: {why}")


def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
    model = _set_up_model(self)
    if model is None:
        return _ORIGINALS["save_model"](self, output_dir, _internal_call)
    output_dir = output_dir if output_dir is not None else self.args.output_dir
    # Collective on every rank (the Trainer calls save_model on all of them); rank 0 gets the tensors.
    state_dict = _peft_state_dict(model) if _is_peft(model) else zp.full_state_dict(model)
    self._save(output_dir, state_dict=state_dict)  # returns at once on ranks that do not write
    if self.args.push_to_hub and not _internal_call:
        self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)


def _peft_state_dict(model: nn.Module) -> dict:
    """Collective: on rank 0 the entries ``PeftModel.save_pretrained`` keeps, full (others ``{}``).  The trainable
    weights, plus the frozen ones PEFT's own selection picks besides: the embedding layers it saves whole
    (``save_embedding_layers="auto"`` with an embedding in ``target_modules``, or a resized vocabulary).  A DDP
    run's adapter file holds them; without them a LoRA on ``embed_tokens`` saved at any stage lacked
    ``embed_tokens.base_layer.weight``."""
    state = zp.full_state_dict(model, trainable_only=True)
    params = dict(model.named_parameters())
    frozen = [n for n in sorted(_peft_saved_names(model)) if n in params and not params[n].requires_grad]
    if frozen:
        with zp.gathered_parameters([params[n] for n in frozen], model=model):
            if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
                state.update({n: params[n].detach().to("cpu", copy=True) for n in frozen})
    return state


def _peft_saved_names(model: nn.Module) -> set[str]:
    """The state-dict names PEFT's ``get_peft_model_state_dict`` selects for the active adapter, found by running
    it on stand-in values (empty tensors: it selects entries by name; an entry it rebuilds is a trainable one)."""
    from peft.utils import get_peft_model_state_dict

    with raw_state_dict(model):  # this rank's shards, no collective: only the names are used
        names = list(model.state_dict().keys())
    stand_in = {n: torch.empty(0) for n in names}
    owner = {id(v): n for n, v in stand_in.items()}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PEFT's "Setting save_embedding_layers": it says it again when it saves
        picked = get_peft_model_state_dict(model, state_dict=stand_in, adapter_name=model.active_adapter)
    return {owner[id(v)] for v in picked.values() if id(v) in owner}


def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
    model = _set_up_model(self)
    if model is None:
        return _ORIGINALS["_save_optimizer_and_scheduler"](self, output_dir)
    # The sharded folder holds the weights too, beside save_model's files: _load_best_model reads them there.
    common.save_sharded(os.path.join(output_dir, CHECKPOINT_SUBDIR), model, self.optimizer)
    if self.args.should_save:
        from transformers.trainer import OPTIMIZER_NAME, SCHEDULER_NAME

        with warnings.catch_warnings(record=True):
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))
        write_stub(os.path.join(output_dir, OPTIMIZER_NAME), _stub_message(output_dir))


def _stub_message(output_dir: str) -> str:
    name = os.path.basename(os.path.normpath(output_dir))
    return (
        f"NOT AN OPTIMIZER STATE: resume {name} under `zero-plugin launch` (any stage, any number of processes): "
        f"zero_plugin wrote it, its optimizer state is sharded in {name}/{CHECKPOINT_SUBDIR}/ and this "
        f"optimizer.pt is a stub. Without zero_plugin: `zero-plugin consolidate {name}/{CHECKPOINT_SUBDIR} OUT "
        f"--format hf` writes the weights alone; delete this optimizer.pt to go on with a fresh optimizer and "
        f"learning-rate schedule"
    )


def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
    model = _set_up_model(self)
    if model is None or checkpoint is None:
        return _ORIGINALS["_load_optimizer_and_scheduler"](self, checkpoint)
    from transformers.trainer import OPTIMIZER_NAME, SCHEDULER_NAME

    sharded = os.path.join(checkpoint, CHECKPOINT_SUBDIR)
    if os.path.isdir(sharded):
        common.load_sharded(sharded, model, self.optimizer)
    elif find_tag_dir(checkpoint) is not None:  # written under DeepSpeed: weights and optimizer state from its files
        extra = common.load_sharded(checkpoint, model, self.optimizer)
        _load_deepspeed_scheduler(self, checkpoint, extra)
    elif is_stub(os.path.join(checkpoint, OPTIMIZER_NAME)):
        raise FileNotFoundError(
            f"zero_plugin: {checkpoint!r} was written by zero_plugin but its optimizer state "
            f"folder {sharded!r} is missing; copy the whole checkpoint folder"
        )
    elif os.path.isfile(os.path.join(checkpoint, OPTIMIZER_NAME)):
        # A checkpoint from an unsharded run: its optimizer state is full; ZeroOptimizer slices it.
        self.optimizer.load_state_dict(
            torch.load(os.path.join(checkpoint, OPTIMIZER_NAME), map_location="cpu", weights_only=True)
        )
    else:
        return
    scheduler_file = os.path.join(checkpoint, SCHEDULER_NAME)
    if os.path.isfile(scheduler_file):
        self.lr_scheduler.load_state_dict(torch.load(scheduler_file, weights_only=True))


def _load_deepspeed_scheduler(self, checkpoint: str, extra: dict) -> None:
    """The Trainer writes ``scheduler.pt`` beside DeepSpeed's files unless DeepSpeed ran the schedule itself
    (``"scheduler"`` in its config): then the state is in DeepSpeed's record."""
    from transformers.trainer import SCHEDULER_NAME

    if not os.path.isfile(os.path.join(checkpoint, SCHEDULER_NAME)):
        state = extra.get("deepspeed", {}).get("lr_scheduler")
        if state:
            self.lr_scheduler.load_state_dict(state)


def _load_from_checkpoint(self, resume_from_checkpoint: str, model: nn.Module | None = None) -> None:
    target = model if model is not None else self.model
    if _uses_zero(self) and common.is_set_up(target):
        raise ValueError(
            "zero_plugin: resume_from_checkpoint on a Trainer whose model is already sharded (a second "
            "train() call) is not supported; resume in a fresh Trainer/process"
        )
    if _uses_zero(self) and find_tag_dir(resume_from_checkpoint) is not None:
        # A checkpoint written under DeepSpeed: at ZeRO-3 it has no weights file, and at any stage its fp32
        # master weights are in DeepSpeed's files, which _load_optimizer_and_scheduler reads once set up.
        return None
    return _ORIGINALS["_load_from_checkpoint"](self, resume_from_checkpoint, model)


def _load_best_model(self) -> None:
    model = _set_up_model(self)
    if model is None:
        return _ORIGINALS["_load_best_model"](self)
    # Every rank calls this (Trainer.train's end).  The sharded folder holds the weights at full precision
    # (fp32 masters included) and each rank reads only its own region; the optimizer is left as it is.
    # zp.load_checkpoint also restores the saving step's RNG states: training is over, so keep the current ones.
    best = self.state.best_model_checkpoint
    if not os.path.isdir(os.path.join(best, CHECKPOINT_SUBDIR)):
        raise FileNotFoundError(
            f"zero_plugin: load_best_model_at_end: the best checkpoint {best!r} has no "
            f"{CHECKPOINT_SUBDIR}/ folder (written before this run used zero_plugin?); load its "
            "weights after training instead"
        )
    rng = capture_rng()
    zp.load_checkpoint(os.path.join(best, CHECKPOINT_SUBDIR), model)
    restore_rng(rng)


def _move_model_to_device(self, model: nn.Module, device: torch.device) -> None:
    if not _uses_zero(self):
        return _ORIGINALS["_move_model_to_device"](self, model, device)
    # A lazily loaded model has meta parameters (.to() raises), and stage 3 must not put the whole model on
    # the device: see [Note: no full model on the device] in accelerate.py.
    place_before_setup(model, device, self.accelerator.zero_config.stage)


def _build_accelerator_args(self, **kwargs: Any) -> dict[str, Any]:
    args = _ORIGINALS["_build_accelerator_args"](self, **kwargs)
    taken = deepspeed_config.taken_over(self.args)
    if taken is not None and trainer_accelerator() is ZeroAccelerator:
        args["zero_plugin"] = taken.config
    return args


def trainer_accelerator() -> type:
    from transformers import trainer as trainer_module

    return trainer_module.Accelerator


def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
    taken = deepspeed_config.taken_over(self.args)
    if taken is None or taken.optimizer is None or self.optimizer is not None:
        return _ORIGINALS["create_optimizer"](self, model)
    # DeepSpeed builds its optimizer over every trainable parameter in one group (transformers' deepspeed_init).
    params = [p for p in (self.model if model is None else model).parameters() if p.requires_grad]
    self.optimizer = taken.optimizer.build(params)
    return self.optimizer


def create_scheduler(self, num_training_steps: int, optimizer: torch.optim.Optimizer | None = None):
    taken = deepspeed_config.taken_over(self.args)
    if taken is None or taken.schedule is None or self.lr_scheduler is not None:
        return _ORIGINALS["create_scheduler"](self, num_training_steps, optimizer)
    warmup = self.args.get_warmup_steps(num_training_steps)
    schedule = taken.schedule.resolved(num_training_steps, warmup, self.args.learning_rate)
    self.lr_scheduler = schedule.build(self.optimizer if optimizer is None else optimizer)
    self._created_lr_scheduler = True
    return self.lr_scheduler


# -- sequence parallelism: [Note: the Trainer under sequence parallelism] ------------------------------
def _sequence_parallel_size(trainer: Any) -> int:
    return trainer.accelerator.sequence_parallel_size if _uses_zero(trainer) else 1


def _check_sequence_parallel_loss(trainer: Any) -> None:
    """Refuse what would compute a loss on a slice as if it were the sequence."""
    k = _sequence_parallel_size(trainer)
    refused = {
        "compute_loss_func": trainer.compute_loss_func is not None,
        "label_smoothing_factor": trainer.label_smoother is not None,
        "TRL's MoE auxiliary loss (output_router_logits)": getattr(trainer, "aux_loss_enabled", False),
        "use_liger_kernel": getattr(trainer.args, "use_liger_kernel", False),
    }
    for name, given in refused.items():
        if given:
            raise ValueError(
                f"zero_plugin: {name} with sequence_parallel_size={k} is not supported: it computes a loss from one "
                "rank's slice of each sequence as if it were the whole sequence; train without it, or with "
                "sequence_parallel_size=1 (docs/long-context.md)"
            )


def _get_dataloader(
    self,
    dataset: Any,
    description: str,
    batch_size: int,
    sampler_fn: Callable | None = None,
    is_training: bool = False,
    dataloader_key: str | None = None,
):
    args = (self, dataset, description, batch_size, sampler_fn, is_training, dataloader_key)
    original = _ORIGINALS["_get_dataloader"]
    if _sequence_parallel_size(self) == 1:
        return original(*args)
    if is_training:  # split by the accelerator's prepare
        _check_sequence_parallel_loss(self)
        return original(*args)
    with self.accelerator.whole_sequence_loaders():  # evaluated on whole sequences, in evaluation_loop
        return original(*args)


def get_resumed_dataloader(self, dataloader: Any, num_batches: int):
    if isinstance(dataloader, SequenceParallelDataLoader):
        return self.accelerator.skip_first_batches(dataloader, num_batches)
    return _ORIGINALS["get_resumed_dataloader"](self, dataloader, num_batches)


def _get_num_items_in_batch(self, batch_samples: list, device: torch.device):
    if _sequence_parallel_size(self) == 1 or not batch_samples or "shift_labels" not in batch_samples[0]:
        return _ORIGINALS["_get_num_items_in_batch"](self, batch_samples, device)
    if not (self.model_accepts_loss_kwargs or self.compute_loss_func is not None):
        if type(self).compute_loss is not compute_loss:  # a subclass's loss, which gets no count
            raise ValueError(
                f"zero_plugin: {type(self).__name__} computes its own loss and its model's forward takes no loss "
                "keyword arguments, so the Trainer gives it no num_items_in_batch and it would divide each rank's "
                f"slice by the slice's own count; sequence_parallel_size={_sequence_parallel_size(self)} needs "
                "the count (a model whose forward takes **kwargs), or sequence_parallel_size=1"
            )
        return None
    count = sum((batch["shift_labels"] != IGNORE_INDEX).sum() for batch in batch_samples).to(device)
    if self.args.average_tokens_across_devices:
        return self.accelerator.gather(count).sum() if self.args.world_size > 1 else count
    setting = zp.sequence_parallel_of(self.accelerator.sequence_parallel_model())
    setting.comm.all_reduce(count, tag="sequence loss count")
    return count / setting.size


def training_step(self, model: nn.Module, inputs: dict, num_items_in_batch=None):
    if _sequence_parallel_size(self) > 1 and "shift_labels" in inputs:
        expect_batch(inputs, model)  # the Trainer split the step's micro-batches before running the first
    return _ORIGINALS["training_step"](self, model, inputs, num_items_in_batch)


def compute_loss(self, model: nn.Module, inputs: dict, return_outputs: bool = False, num_items_in_batch=None):
    if _sequence_parallel_size(self) == 1 or "shift_labels" not in inputs:
        return _ORIGINALS["compute_loss"](self, model, inputs, return_outputs, num_items_in_batch)
    _check_sequence_parallel_loss(self)
    inputs = dict(inputs)
    shift_labels = inputs.pop("shift_labels")
    inputs.pop("labels", None)
    head = None if return_outputs else tiled_head(model)  # [Note: the Trainer's tiled loss]
    if head is not None:
        outputs = None
        hidden, weight = head.run(model, inputs)
        if num_items_in_batch is None:
            loss = zp.tiled_lm_loss(hidden, weight, shift_labels, tile_tokens=LOSS_TILE_TOKENS, sequence_parallel=model)
        else:
            loss = zp.tiled_lm_loss(hidden, weight, shift_labels, tile_tokens=LOSS_TILE_TOKENS, reduction="sum")
    else:
        outputs = model(**inputs)
        logits = outputs["logits"] if isinstance(outputs, dict) else outputs[0]
        if num_items_in_batch is None:
            loss = zp.sequence_parallel_loss(logits, shift_labels, model)
        else:
            loss = token_loss_sum(logits, shift_labels)
    if num_items_in_batch is not None:
        loss = loss / num_items_in_batch
        if self.args.average_tokens_across_devices:
            loss = loss * self.accelerator.num_processes
    return (loss, outputs) if return_outputs else loss


# [Note: the Trainer's tiled loss]
# Under sequence parallelism the logits of the rank's s/K tokens in float32 are the step's largest tensor at long
# context (32k tokens x 128k vocabulary x 4 B = 16 GiB), so ``compute_loss`` computes S_r with ``zp.tiled_lm_loss``
# ([Note: tiled LM loss] in ``zero_plugin/sequence/tiled_loss.py``) when it can prove that equal to the model's own
# head: a transformers causal LM (PEFT-wrapped or not) whose ``config.model_type`` is one whose forward is
# ``logits = self.lm_head(slice_logits_to_keep(last_hidden_state, logits_to_keep))`` and nothing more (checked
# in their modeling files: ``_PLAIN_HEAD_MODELS``), with no ``final_logit_softcapping``, whose output embedding is
# an ``nn.Linear`` without bias (not a PEFT LoRA layer or ``modules_to_save`` copy of the head, which compute more
# than ``F.linear``), and whose forward takes ``logits_to_keep``.  Any other model (Gemma2/3 with softcapping,
# Cohere's ``logit_scale``, Granite's ``logits_scaling``, a biased head, an unknown architecture) and
# ``return_outputs=True`` (the caller wants the logits) keep the untiled loss on the logits.
# The model runs through its own forward (stage 3's root unit and hooks fire as usual) with ``logits_to_keep`` an
# empty index tensor, so its head runs on zero tokens; a forward hook on its backbone (``base_model``), registered
# after stage 3's, takes the last hidden state and the head's weight at the backbone's end, the point where stage 3
# has entered the head for a direct read ([Note: direct reads of the output embedding] in
# ``zero_plugin/stage3/direct_reads.py``): gathered whole there at any stage, sliced heads included.
_PLAIN_HEAD_MODELS = frozenset({"llama", "mistral", "qwen2", "qwen3", "gemma", "phi3", "olmo2"})
LOSS_TILE_TOKENS = DEFAULT_TILE_TOKENS
"""Tokens per tile of the Trainer's tiled loss (one tile's float32 logits: 1024 x 128k vocabulary = 512 MiB)."""


class _TiledHead:
    """A causal LM's backbone and head, for [Note: the Trainer's tiled loss]."""

    def __init__(self, backbone: nn.Module, head: nn.Linear) -> None:
        self.backbone, self.head = backbone, head

    def run(self, model: nn.Module, inputs: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """``model``'s forward without logits: the backbone's last hidden state and the head's weight."""
        seen: dict[str, torch.Tensor] = {}

        def at_backbone_end(module, args, output):
            seen["hidden"] = output[0] if isinstance(output, tuple) else output["last_hidden_state"]
            seen["weight"] = self.head.weight  # stage 3 entered the head here (direct reads)

        handle = self.backbone.register_forward_hook(at_backbone_end)
        try:
            model(**inputs, logits_to_keep=torch.empty(0, dtype=torch.long, device=inputs["input_ids"].device))
        finally:
            handle.remove()
        assert "hidden" in seen, f"{type(model).__name__}'s forward did not run its base_model"
        return seen["hidden"], seen["weight"]


def tiled_head(model: nn.Module) -> _TiledHead | None:
    """The backbone and head of ``model`` when its loss may be tiled, else None ([Note: the Trainer's tiled loss])."""
    causal_lm = model.get_base_model() if _is_peft(model) else model
    config = getattr(causal_lm, "config", None)
    if getattr(config, "model_type", None) not in _PLAIN_HEAD_MODELS:
        return None
    if getattr(config, "final_logit_softcapping", None) is not None:
        return None
    if "logits_to_keep" not in inspect.signature(type(causal_lm).forward).parameters:
        return None
    head, backbone = causal_lm.get_output_embeddings(), getattr(causal_lm, "base_model", None)
    if not isinstance(head, nn.Linear) or head.bias is not None:
        return None
    if not isinstance(backbone, nn.Module) or backbone is causal_lm or any(m is head for m in backbone.modules()):
        return None
    return _TiledHead(backbone, head)


def evaluation_loop(
    self,
    dataloader: Any,
    description: str,
    prediction_loss_only: bool | None = None,
    ignore_keys: list[str] | None = None,
    metric_key_prefix: str = "eval",
):
    args = (self, dataloader, description, prediction_loss_only, ignore_keys, metric_key_prefix)
    original = _ORIGINALS["evaluation_loop"]
    if _sequence_parallel_size(self) == 1:
        return original(*args)
    if self.accelerator.zero_config.stage == 3 and not common.is_set_up(self.model) and not self.accelerator._models:
        # set up for evaluation here, as the loop would, so that the pause below covers its attention
        self.accelerator.prepare_model(self.model, evaluation_mode=True)
    setting = find_sequence_parallel(self.model)
    if setting is None:  # not set up (stages 0-2 before training): the model's own attention runs
        return original(*args)
    with setting.paused():
        return original(*args)


_OVERRIDES: dict[str, Callable] = {
    "_build_accelerator_args": _build_accelerator_args,
    "create_optimizer": create_optimizer,
    "create_scheduler": create_scheduler,
    "_move_model_to_device": _move_model_to_device,
    "create_accelerator_and_postprocess": create_accelerator_and_postprocess,
    "save_model": save_model,
    "_save_optimizer_and_scheduler": _save_optimizer_and_scheduler,
    "_load_optimizer_and_scheduler": _load_optimizer_and_scheduler,
    "_load_from_checkpoint": _load_from_checkpoint,
    "_load_best_model": _load_best_model,
    "_get_dataloader": _get_dataloader,
    "get_resumed_dataloader": get_resumed_dataloader,
    "_get_num_items_in_batch": _get_num_items_in_batch,
    "compute_loss": compute_loss,
    "training_step": training_step,
    "evaluation_loop": evaluation_loop,
}


def install() -> None:
    """Make ``transformers.Trainer`` use zero_plugin's Accelerator and checkpoint methods (idempotent).

    The one place where transformers' Trainer is patched: the ``Accelerator`` name ``transformers.trainer``
    imported from accelerate, and the sixteen Trainer methods in ``_OVERRIDES`` (subclasses such as
    ``Seq2SeqTrainer`` inherit them).  Each override defers to the original unless the Trainer's
    accelerator is zero_plugin's.
    """
    from transformers import trainer as trainer_module

    trainer_module.Accelerator = ZeroAccelerator
    trainer_cls = trainer_module.Trainer
    if getattr(trainer_cls, "_zero_plugin_installed", False):
        return
    upstream.check("transformers.trainer.Trainer", trainer_cls)  # [Note: patched upstream names]
    upstream.check("transformers.trainer", trainer_module)
    for name, override in _OVERRIDES.items():
        _ORIGINALS[name] = getattr(trainer_cls, name)
        setattr(trainer_cls, name, override)
    trainer_cls._zero_plugin_installed = True
