"""The stub ``optimizer.pt`` ([Note: optimizer stub] in integrations/optimizer_stub.py): every way of
loading it fails with the message it carries, and nothing else in a checkpoint folder is taken for it."""

from __future__ import annotations

import pickle

import pytest
import torch
from zero_plugin.integrations.optimizer_stub import is_stub, write_stub

MESSAGE = "NOT AN OPTIMIZER STATE: checkpoint-2/zero_plugin/ holds it; resume under `zero-plugin launch`"


@pytest.fixture
def stub(tmp_path):
    path = tmp_path / "optimizer.pt"
    write_stub(path, MESSAGE)
    return path


def test_torch_load_weights_only_quotes_the_message(stub):
    with pytest.raises(pickle.UnpicklingError) as info:
        torch.load(stub, map_location="cpu", weights_only=True)  # what transformers.Trainer calls
    assert MESSAGE in str(info.value)


def test_unrestricted_loads_fail_with_the_message_too(stub):
    with pytest.raises(AttributeError, match="NOT AN OPTIMIZER STATE"):
        torch.load(stub, map_location="cpu", weights_only=False)
    with pytest.raises(AttributeError, match="NOT AN OPTIMIZER STATE"):
        pickle.loads(stub.read_bytes())


def test_is_stub_tells_it_from_a_real_optimizer_state(stub, tmp_path):
    real = tmp_path / "real.pt"
    torch.save(torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1).state_dict(), real)
    assert is_stub(stub) and not is_stub(real) and not is_stub(tmp_path / "missing.pt")


def test_message_must_be_one_line(tmp_path):
    with pytest.raises(ValueError, match="one line"):
        write_stub(tmp_path / "optimizer.pt", "two\nlines")
