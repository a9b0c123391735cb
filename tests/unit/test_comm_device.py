"""Where a group's collectives run (``Comm.device``), which is where stage 3 gathers and computes.

The H200 run of 2026-12-04 found a stage-3 model set up under torch's fake group on a CUDA machine placed
on the CPU (only ``backend == "nccl"`` meant CUDA), and a composite backend such as ``"cpu:gloo,cuda:nccl"``
would have done the same."""

from __future__ import annotations

import pytest
import torch

from zero_plugin.comm.collectives import Comm, backend_uses_cuda


@pytest.mark.parametrize(
    "backend,cuda,want",
    [
        ("nccl", True, True),
        ("cpu:gloo,cuda:nccl", True, True),
        ("cuda:nccl,cpu:gloo", True, True),
        ("gloo", True, False),
        ("gloo", False, False),
        ("fake", True, True),
        ("fake", False, False),
        ("none", True, False),
    ],
)
def test_backend_uses_cuda(monkeypatch, backend, cuda, want):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    assert backend_uses_cuda(backend) is want


def test_comm_device_follows_the_backend(monkeypatch):
    comm = Comm()  # no process group: a one-rank world on the CPU
    assert comm.device == torch.device("cpu")
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    comm.backend = "cpu:gloo,cuda:nccl"
    assert comm.device == torch.device("cuda", 3)
    comm.backend = "gloo"
    assert comm.device == torch.device("cpu")
