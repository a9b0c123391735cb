"""The planner's long-context rows (zero_plugin/planner/long_context.py, issue #50): one rank of a Ulysses group
traced, activation offload's parked bytes, the tiled loss, the longest sequence that fits, and
``zero-plugin estimate --device-memory``.  The measured side is benchmarks/long_context_memory.py."""

from __future__ import annotations

import pytest
import torch

from tests.models import planner_llama_config
from zero_plugin.launch.cli import main
from zero_plugin.planner import Planner, resolve_model
from zero_plugin.planner.long_context import activation_bytes_per_token, checkpointed_input_bytes, longest_sequence

MIB = 2**20


@pytest.fixture(scope="module")
def model():
    return resolve_model(planner_llama_config())


def test_offload_parks_each_layer_input_on_the_host(model):
    """On CUDA the parked bytes are ``checkpointed_input_bytes`` exactly, and at the end of forward every layer
    input but the last (kept until its unpack: [Note: activation offload]) has left the device; on CPU nothing
    moves (one memory)."""
    kwargs = dict(batch=2, seq=512, checkpointing=True, sequence_parallel=2)
    moved = checkpointed_input_bytes(model.config, batch=2, seq=512, sequence_parallel=2, dtype=torch.float32)
    assert moved == 2 * 2 * 256 * 64 * 4
    on = Planner(model, offload_activations=True, **kwargs)
    off = Planner(model, **kwargs)
    assert on.trace.offloaded_bytes == moved and off.trace.offloaded_bytes == 0
    assert off.trace.forward_bytes - on.trace.forward_bytes == moved // 2  # 2 layers: the first one's input
    row_on, row_off = on.estimate(2, 3), off.estimate(2, 3)
    assert row_on["peak"]["host"] - row_off["peak"]["host"] == moved
    cpu = Planner(model, offload_activations=True, device="cpu", **kwargs)
    assert (
        cpu.trace.offloaded_bytes == 0
        and cpu.trace.peak_bytes == Planner(model, device="cpu", **kwargs).trace.peak_bytes
    )
    with pytest.raises(ValueError, match="needs checkpointing"):
        Planner(model, batch=1, seq=64, offload_activations=True)


def test_sequence_parallel_and_tiled_loss_lower_the_activations(model):
    """K = 2 holds about half of each sequence's activations per rank; the tiled loss drops the whole logits."""
    one = activation_bytes_per_token(model, seq=1024, batch=1)
    two = activation_bytes_per_token(model, seq=1024, batch=1, sequence_parallel=2)
    assert 0.4 < two["peak"] / one["peak"] < 0.6
    tiled = activation_bytes_per_token(model, seq=1024, batch=1, checkpointing=True, tiled_loss=64)
    whole = activation_bytes_per_token(model, seq=1024, batch=1, checkpointing=True)
    assert tiled["peak"] < whole["peak"]


def test_longest_sequence_fits_and_the_next_does_not(model):
    options = dict(batch=1, checkpointing=True, sequence_parallel=2, device="cpu")
    found = longest_sequence(model, 24 * MIB, world_size=2, stage=3, multiple=16, **options)
    step = 32
    assert found["seq"] > 0 and found["seq"] % step == 0
    for seq, fits in ((found["seq"], True), (found["seq"] + step, False)):
        peak = Planner(model, seq=seq, **options).estimate(2, 3)["peak"]["total"]
        assert (peak <= 24 * MIB) is fits, (seq, peak)
    assert longest_sequence(model, 1 * MIB, world_size=2, stage=3, **options)["seq"] == 0


def test_cli_prints_the_longest_sequence_per_stage(capsys, model, tmp_path):
    planner_llama_config().save_pretrained(tmp_path)
    argv = ["estimate", "--model", str(tmp_path), "--world-size", "2", "--seq-len", "256", "--offload", "none"]
    argv += ["--sequence-parallel-size", "2", "--activation-checkpointing", "--offload-activations"]
    argv += ["--tiled-loss", "256", "--device-memory", "64MiB", "--margin", "0", "--dtype", "fp32"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "over a group of 2 ranks (128 tokens per rank)" in out and "longest sequence in 0.06 GiB" in out
    rows = [line.split() for line in out[out.index("longest sequence") :].splitlines() if "|" in line][1:]
    longest = [int(r[3].replace(",", "")) for r in rows]
    # Stages 0-2 in order; stage 3 close to stage 2 on this small model, whose states weigh little next to the
    # activations: the full gradients its reductions hold until the reduce stream's completion on CUDA
    # ([Note: collective footprints]) can outweigh the states it shards.
    assert [r[0] for r in rows] == ["0", "1", "2", "3"] and longest[:3] == sorted(longest[:3])
    assert longest[3] >= 0.98 * longest[2], longest
    assert all(float(r[6]) <= 64 / 1024 for r in rows if r[3] != "none"), rows  # peak GiB within the memory
    assert main(["estimate", "--model", "tiny-llama", "--offload-activations", "--batch", "1", "--seq", "8"]) == 2
    assert "add --checkpointing" in capsys.readouterr().err
