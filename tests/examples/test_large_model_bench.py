"""The large-model benchmark scripts at a tiny size: ``benchmarks/write_llama_checkpoint.py`` (a sharded
fp32 safetensors checkpoint written one block at a time) and ``benchmarks/large_model.py`` (the unmodified
Trainer example under ``zero-plugin launch --stage 3`` and plain DDP, measured from outside).

The writer and the benchmark's bookkeeping are checked in seconds; the end-to-end run of both launches
(~1 min on 2 busy cores) is marked slow.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from benchmarks import large_model as lm
from benchmarks import write_llama_checkpoint as wl

TINY = ["--layers", "2", "--hidden", "64", "--intermediate", "128", "--heads", "4", "--kv_heads", "2", "--vocab", "512"]


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    out = tmp_path_factory.mktemp("ckpt") / "tiny"
    summary = wl.main([str(out), *TINY, "--seed", "3"])
    return out, summary


def test_writer_output_loads_with_from_pretrained(tiny_checkpoint):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out, summary = tiny_checkpoint
    index = json.loads((out / "model.safetensors.index.json").read_text())
    model = AutoModelForCausalLM.from_pretrained(str(out))
    state = model.state_dict()
    assert set(index["weight_map"]) == set(state) and summary["files"] == 4  # embedding, 2 layers, head
    assert index["metadata"]["total_size"] == summary["bytes"] == sum(t.numel() * 4 for t in state.values())
    assert all(t.dtype == torch.float32 for t in state.values())
    config = wl.llama_config(
        layers=2,
        hidden=64,
        intermediate=128,
        heads=4,
        kv_heads=2,
        vocab=512,
        eos_token_id=model.config.eos_token_id,
        pad_token_id=model.config.pad_token_id,
    )
    for i, (name, shape) in enumerate(wl.tensor_layout(config)):  # the seeded generator, tensor by tensor
        assert torch.equal(state[name], wl.make_tensor(i, name, shape, seed=3, std=0.02)), name
    assert not torch.equal(state["lm_head.weight"], state["model.embed_tokens.weight"])  # untied
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    assert tokenizer.eos_token_id == model.config.eos_token_id and len(tokenizer) <= model.config.vocab_size
    ids = torch.tensor([tokenizer("hello")["input_ids"]])
    assert torch.isfinite(model(input_ids=ids, labels=ids).loss)


def test_writer_peak_rss_is_about_one_file(tmp_path):
    """20 layers of 13 MiB (272 MiB in all): the writer's peak RSS grows by about one file, not the model."""
    out = tmp_path / "mid"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.write_llama_checkpoint",
            str(out),
            "--layers",
            "20",
            "--hidden",
            "512",
            "--intermediate",
            "1536",
            "--heads",
            "4",
            "--kv_heads",
            "4",
            "--vocab",
            "512",
        ],
        capture_output=True,
        text=True,
        cwd=lm.REPO,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["files"] == 22 and summary["bytes"] > 18 * summary["largest_file_bytes"]
    assert summary["peak_rss_increase"] <= 2.5 * summary["largest_file_bytes"] + 16 * 2**20, summary


def test_writer_refuses_a_folder_with_files(tiny_checkpoint):
    with pytest.raises(SystemExit, match="not empty"):
        wl.main([str(tiny_checkpoint[0]), *TINY])


def test_timings_from_step_lines():
    lines = [
        (5.0, "zero-plugin launch: ..."),
        (20.0, "{'loss': '6.3', 'train_runtime': '1'}"),
        (21.0, " 33%|"),
        (22.5, "{'loss': '6.1'}"),
        (24.5, "{'loss': '6.0'}"),
        (25.0, "{'train_runtime': '9', 'train_loss': '6'}"),
    ]
    assert lm.timings(lines) == {"steps_logged": 3, "first_step_line_s": 20.0, "step_s": 2.25, "load_s": 17.75}
    assert lm.timings([(1.0, "no steps")]) == {"steps_logged": 0}


@pytest.mark.parametrize(
    "killed,marks,status",
    [
        (None, {"load": {0: 5, 1: 6}, "train": {0: 7, 1: 8}}, "ok"),
        (
            "killed by the watchdog after 9 s: MemAvailable fell to 1.90 GiB",
            {"load": {0: 5, 1: 6}},
            "failed: killed by the watchdog after 9 s: MemAvailable fell to 1.90 GiB",
        ),
        (
            "killed by the watchdog after 9 s: x",
            {"train": {0: 7, 1: 8}},
            "trained; then killed by the watchdog after 9 s: x in the example's epilogue (after training)",
        ),
    ],
)
def test_summary_status_and_ratio(killed, marks, status):
    raw = {
        "name": "r",
        "killed": killed,
        "returncode": -9 if killed else 0,
        "marks": marks,
        "hwm": {0: 9, 1: 10},
        "timing": {},
    }
    summary = lm.summarize(raw, full_copy=16)
    assert summary["status"] == status
    assert summary["ratio_to_full_copy"] == (0.5 if "train" in marks else None)
    assert [r["script_peak"] for r in summary["ranks"]] == [9, 10]


def test_watchdog_kills_the_whole_run(tmp_path):
    """Past its time limit, or with a threshold above any machine's free memory, a run is killed with its
    process group (grandchildren included) and the reason is recorded."""
    import os
    import time

    pid_file = tmp_path / "child"
    cmd = ["bash", "-c", f"sleep 60 & echo $! > {pid_file}; wait"]
    raw = lm.run_one("t", cmd, {}, tmp_path / "t.log", timeout_s=1.5, min_available=0)
    assert raw["returncode"] == -9 and raw["killed"].startswith("killed by the watchdog after ")
    assert "still running after 2 s" in raw["killed"]
    time.sleep(0.5)
    child = int(pid_file.read_text())
    gone = not os.path.exists(f"/proc/{child}")
    assert gone or open(f"/proc/{child}/stat").read().rsplit(")", 1)[1].split()[0] == "Z"  # or a zombie
    started = time.monotonic()
    raw = lm.run_one("m", ["sleep", "60"], {}, tmp_path / "m.log", timeout_s=60, min_available=2**60)
    assert time.monotonic() - started < 30 and raw["returncode"] == -9 and "MemAvailable fell to" in raw["killed"]
    assert lm.summarize({**raw, "hwm": {}}, full_copy=1)["status"].startswith("failed: killed by the watchdog")


@pytest.mark.slow
def test_large_model_bench_end_to_end_tiny(tiny_checkpoint, tmp_path):
    """Both launches of the unmodified Trainer example train 3 steps; the report has both, per rank."""
    out, summary = tiny_checkpoint
    report = lm.main(["--model", str(out), "--steps", "3", "--max_length", "32", "--out", str(tmp_path / "lm")])
    runs = {r["name"]: r for r in report["runs"]}
    assert set(runs) == {"zero3", "ddp"}
    for run in runs.values():
        assert run["status"] == "ok" and run["timing"]["steps_logged"] == 3, run["raw"]["tail"]
        assert [r["rank"] for r in run["ranks"]] == [0, 1]
        for r in run["ranks"]:
            assert 0 < r["load_peak"] <= r["train_peak"] <= r["script_peak"]
        assert run["timing"]["step_s"] > 0 and run["timing"]["load_s"] > 0
        assert run["ratio_to_full_copy"] == round(run["train_peak_max"] / summary["bytes"], 3)
    assert runs["zero3"]["estimate"][0].startswith(f"zero-plugin launch: memory per rank planned for --model {out}")
    assert not runs["ddp"]["estimate"]
    md = (tmp_path / "lm.md").read_text()
    assert "| zero3 | ok | 0 |" in md and "| ddp | ok | 0 |" in md and "target <= 0.6" in md
    assert json.loads((tmp_path / "lm.json").read_text())["model"]["full_copy_bytes"] == summary["bytes"]


_STEP_SCRIPT = """
import torch
layer = torch.nn.Linear(1000, 1000)  # weight 3.81 MiB
opt = torch.optim.SGD(layer.parameters(), lr=0.1)
x = torch.randn(64, 1000, requires_grad=True)  # 0.24 MiB: the matmul saves it and (for x's gradient) the weight
for _ in range(2):
    torch.relu(layer(x)).sum().backward()  # relu's output, 0.24 MiB, saved for its own backward
    opt.step()
    opt.zero_grad()
"""


def test_step_memory_counts_saved_tensors_per_phase(tmp_path):
    """``benchmarks/step_memory.py`` around a script: one line per phase boundary, the saved storages of each
    forward split into parameters and activations (known sizes here), each phase's own peak RSS."""
    script = tmp_path / "train.py"
    script.write_text(_STEP_SCRIPT)
    out = subprocess.run(
        [sys.executable, "-m", "benchmarks.step_memory", str(script)], capture_output=True, text=True, timeout=600
    )
    assert out.returncode == 0, out.stderr[-3000:]
    lines = [json.loads(line.split(" ", 1)[1]) for line in out.stdout.splitlines() if line.startswith("step_memory ")]
    assert [line["phase"] for line in lines] == ["forward", "backward", "between", "step"] * 2
    for forward in (line for line in lines if line["phase"] == "forward"):
        assert forward["saved_params_MiB"] == pytest.approx(1000 * 1000 * 4 / 2**20, abs=0.05)
        assert forward["saved_activations_MiB"] == pytest.approx(2 * 64 * 1000 * 4 / 2**20, abs=0.05)
        assert forward["largest_activations"][0][1] == [64, 1000]
    assert all(line["peak_MiB"] >= line["end_MiB"] > 0 and line["gathered_units"] == [] for line in lines)
