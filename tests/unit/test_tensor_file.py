"""``zero_plugin.loading.tensor_file`` reads what safetensors wrote, bit for bit, into existing tensors."""

import json
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

from zero_plugin.loading import tensor_file


@pytest.fixture()
def written(tmp_path):
    gen = torch.Generator().manual_seed(0)
    tensors = {
        "f32": torch.randn(7, 15, generator=gen),
        "bf16": torch.randn(33, 5, generator=gen).bfloat16(),
        "f64": torch.randn(3, generator=gen, dtype=torch.float64),
        "i64": torch.arange(11),
        "scalar": torch.tensor(2.5),
        "empty": torch.empty(0, 4),
        "bool": torch.tensor([True, False, True]),
    }
    path = tmp_path / "m.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt"})
    return path, tensors


def test_same_dtype_reads_bit_for_bit(written):
    path, tensors = written
    entries = tensor_file.header(path)
    assert set(entries) == set(tensors)
    ref = load_file(str(path))
    for key, value in ref.items():
        out = torch.full_like(value, 7) if value.numel() else torch.empty_like(value)
        tensor_file.read_into(entries[key], out)
        assert torch.equal(out, value), key


def test_converting_reads_match_a_cast(written, monkeypatch):
    path, tensors = written
    monkeypatch.setattr(tensor_file, "_STAGING_BYTES", 16)  # many chunks, a last partial one
    out = torch.empty(33, 5, dtype=torch.float32)
    tensor_file.read_into(tensor_file.header(path)["bf16"], out)
    assert torch.equal(out, tensors["bf16"].float())
    wide = torch.empty(15, 7).t()  # not contiguous: staged through a contiguous copy
    tensor_file.read_into(tensor_file.header(path)["f32"], torch.empty(7, 15))
    entry = tensor_file.header(path)["f32"]
    assert not wide.is_contiguous()
    tensor_file.read_into(entry, wide)
    assert torch.equal(wide, tensors["f32"])


def test_wrong_shape_and_truncated_file_are_clear_errors(written):
    path, _ = written
    with pytest.raises(ValueError, match=r"has shape \(7, 15\), the model expects \(15, 7\)"):
        tensor_file.read_into(tensor_file.header(path)["f32"], torch.empty(15, 7))
    entry = tensor_file.header(path)["f32"]
    data = path.read_bytes()
    path.write_bytes(data[: entry.start + 10])
    with pytest.raises(ValueError, match="ends early"):
        tensor_file.read_into(entry, torch.empty(7, 15))


def _rewrite_header(path, edit):
    """Edit the JSON header in place, padded to its old length so every byte offset stays valid."""
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    meta = json.loads(data[8 : 8 + length])
    edit(meta)
    text = json.dumps(meta, separators=(",", ":")).encode()
    assert len(text) <= length
    path.write_bytes(data[:8] + text.ljust(length, b" ") + data[8 + length :])


@pytest.mark.parametrize("dest_dtype", [torch.float32, torch.float64])  # plain read, converting read
def test_header_whose_byte_range_disagrees_with_shape_is_a_clear_error(written, dest_dtype):
    """A header recording (7, 14) for 7 x 15 floats of bytes: the read would silently take 392 of the 420
    bytes (or run into the next tensor's bytes if the shape were larger), so it must fail, naming the
    tensor, the file and both byte counts, before the destination is touched."""
    path, _ = written
    _rewrite_header(path, lambda meta: meta["f32"].update(shape=[7, 14]))
    out = torch.full((7, 14), 7.0, dtype=dest_dtype)
    with pytest.raises(ValueError) as err:
        tensor_file.read_into(tensor_file.header(path)["f32"], out)
    message = str(err.value)
    for part in ("'f32'", str(path), "392", "420", "re-save"):
        assert part in message, (part, message)
    assert torch.equal(out, torch.full((7, 14), 7.0, dtype=dest_dtype))
