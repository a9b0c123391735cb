"""The stub ``optimizer.pt`` ([Note: optimizer stub] in integrations/optimizer_stub.py): every way of
loading it fails with the message it carries, and nothing else in a checkpoint folder is taken for it."""

from __future__ import annotations

import pickle
import traceback

import pytest
import torch

from zero_plugin.integrations.optimizer_stub import is_stub, write_stub

MESSAGE = "NOT AN OPTIMIZER STATE: checkpoint-2/zero_plugin/ holds it; resume under `zero-plugin launch`"


@pytest.fixture
def stub(tmp_path):
    path = tmp_path / "optimizer.pt"
    write_stub(path, MESSAGE)
    return path


def _first_line(exc: BaseException) -> str:
    """What a traceback ends with: the exception's type and the first line of its text."""
    return traceback.format_exception_only(exc)[-1].splitlines()[0]


def test_torch_load_weights_only_says_it_first(stub):
    with pytest.raises(Exception) as info:
        torch.load(stub, map_location="cpu", weights_only=True)  # what transformers.Trainer calls
    assert _first_line(info.value) == f"KeyError: {MESSAGE!r}"


def test_unrestricted_loads_say_it_first_too(stub):
    with pytest.raises(KeyError) as info:
        torch.load(stub, map_location="cpu", weights_only=False)
    assert _first_line(info.value) == f"KeyError: {MESSAGE!r}"
    with pytest.raises(KeyError, match="NOT AN OPTIMIZER STATE"):
        pickle.loads(stub.read_bytes())


def test_plain_trainer_resume_stops_with_the_fix_first(tmp_path):
    """A plain transformers.Trainer (no zero_plugin.run) resuming a checkpoint written under zero_plugin."""
    from transformers import Trainer, TrainingArguments

    from tests import models

    checkpoint = tmp_path / "checkpoint-2"
    checkpoint.mkdir()
    write_stub(checkpoint / "optimizer.pt", MESSAGE)
    args = TrainingArguments(output_dir=str(tmp_path / "out"), max_steps=2, report_to=[], use_cpu=True)
    trainer = Trainer(model=models.make_tiny_llama(), args=args)
    trainer.create_optimizer_and_scheduler(num_training_steps=2)
    torch.save(trainer.lr_scheduler.state_dict(), checkpoint / "scheduler.pt")
    with pytest.raises(Exception) as info:
        trainer._load_optimizer_and_scheduler(str(checkpoint))  # Trainer.train(resume_from_checkpoint=...)
    assert _first_line(info.value) == f"KeyError: {MESSAGE!r}"


def test_stubs_of_earlier_versions_are_recognised(tmp_path):
    earlier = tmp_path / "optimizer.pt"
    earlier.write_bytes(b"\x80\x02czero_plugin\n" + MESSAGE.encode() + b"\n.")
    assert is_stub(earlier)


def test_is_stub_tells_it_from_a_real_optimizer_state(stub, tmp_path):
    real = tmp_path / "real.pt"
    torch.save(torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1).state_dict(), real)
    assert is_stub(stub) and not is_stub(real) and not is_stub(tmp_path / "missing.pt")


def test_message_must_be_one_line(tmp_path):
    with pytest.raises(ValueError, match="one line"):
        write_stub(tmp_path / "optimizer.pt", "two\nlines")
