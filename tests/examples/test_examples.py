"""The examples, end to end: a few steps each on 2 CPU processes (gloo), launched as a user would.

* ``lora_finetune_accelerate.py`` at stage 2 (through ``examples/configs/stage2.yaml``) and 3
  (``zero-plugin launch --stage 3``), and once more as two single-process "nodes" on loopback
  (``torchrun --nnodes 2 ... -m zero_plugin.run``), which must reproduce the single-node stage-3
  losses to 1e-4 relative;
* ``finetune_trainer.py`` (HF Trainer + PEFT) and ``lora_finetune_lightning.py`` (``strategy="zero3"``)
  at stage 3; ``full_finetune.py`` (plain ``zp.setup`` under torchrun) at stage 3.

Stages 0 and 1 of a plain Accelerate script, each matching DDP, are launched in
``tests/integrations/test_accelerate.py``; the shipped stage0/stage1 configs are checked here in process
(``test_config_files``), so the example is launched at one replicated-parameter stage (2) and at stage 3.

Every run must exit 0, learn (the loss falls), report memory that matches the ZeRO theory, and leave
artifacts that load here, in the test process: the LoRA adapters with ``PeftModel.from_pretrained`` on
a freshly built base model (and they lower the loss), the full model with
``AutoModelForCausalLM.from_pretrained`` (and it differs from the initial weights).

All launches start when the module's first test asks for one (two at a time: each is 2 processes on a
2-core machine) and tests wait for the ones they need.  Cheap in-process checks cover the shipped
configs and data.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import os
import subprocess
import sys
import time
from argparse import Namespace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests import launching

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
CONFIGS = EXAMPLES / "configs"
PY = sys.executable
CONSOLE = Path(PY).parent / "zero-plugin"
ZERO_LAUNCH = [str(CONSOLE)] if CONSOLE.exists() else [PY, "-m", "zero_plugin.launch.cli"]
TORCHRUN = [PY, "-m", "torch.distributed.run"]
STEPS = 12
SCRIPT_ARGS = ("--max_steps", str(STEPS), "--log_every", "4", "--warmup_steps", "2", "--max_new_tokens", "6")
LAUNCH_TIMEOUT_S = 600
MULTINODE_LOSS_RTOL = 1e-4

# peft reads transformers' deprecated is_gradient_checkpointing (noise; the examples filter it too).
pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.* is deprecated:FutureWarning")

if str(EXAMPLES) not in sys.path:
    sys.path.insert(0, str(EXAMPLES))
import common  # noqa: E402  (examples/common.py)


@dataclasses.dataclass(frozen=True)
class Launch:
    """``cmd`` (each element formatted with {port}) run ``nodes`` times with NODE_RANK-specific {node}."""

    name: str
    script: str
    cmd: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()
    nodes: int = 1


def _zero(*options: str) -> tuple[str, ...]:
    return (*ZERO_LAUNCH, "launch", *options, "--main_process_port", "{port}")


ACCELERATE = "lora_finetune_accelerate.py"
LAUNCHES = {
    launch.name: launch
    for launch in [
        *(
            Launch(f"accelerate_stage{s}", ACCELERATE, _zero("--config_file", str(CONFIGS / f"stage{s}.yaml")))
            for s in (2,)
        ),
        Launch("accelerate_stage3", ACCELERATE, _zero("--stage", "3", "--num_processes", "2")),
        Launch(
            "accelerate_multinode",
            ACCELERATE,
            (
                *TORCHRUN,
                "--nnodes",
                "2",
                "--node_rank",
                "{node}",
                "--nproc_per_node",
                "1",
                "--master_addr",
                "127.0.0.1",
                "--master_port",
                "{port}",
                "-m",
                "zero_plugin.run",
            ),
            env=(("ZERO_PLUGIN_STAGE", "3"), ("ACCELERATE_USE_CPU", "true")),
            nodes=2,
        ),
        Launch("trainer_stage3", "finetune_trainer.py", _zero("--stage", "3", "--num_processes", "2")),
        Launch("lightning_zero3", "lora_finetune_lightning.py", (PY,), env=(("MASTER_PORT", "{port}"),)),
        Launch(
            "full_stage3",
            "full_finetune.py",
            (*TORCHRUN, "--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port", "{port}"),
            env=(("ZERO_PLUGIN_STAGE", "3"),),
        ),
    ]
}
EXTRA_ARGS = {"lightning_zero3": ("--strategy", "zero3", "--devices", "2", "--accelerator", "cpu")}


def _env(extra: dict[str, str], cache: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ZERO_PLUGIN_", "ACCELERATE_", "MASTER_"))}
    env.update(
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        HF_HUB_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        XDG_CACHE_HOME=str(cache),
    )
    env.update(extra)
    return env


def _run_launch(launch: Launch, tmp: Path) -> SimpleNamespace:
    out = tmp / launch.name
    out.mkdir()
    port = str(launching.free_port())
    args = [
        str(EXAMPLES / launch.script),
        "--output_dir",
        str(out),
        "--cache_dir",
        str(tmp / "cache"),
        *SCRIPT_ARGS,
        *EXTRA_ARGS.get(launch.name, ()),
    ]
    env = _env({k: v.format(port=port) for k, v in launch.env}, tmp / "xdg")
    start = time.monotonic()
    procs = []
    for node in range(launch.nodes):
        cmd = [c.format(port=port, node=node) for c in launch.cmd] + args
        log = open(out / f"launch{node}.log", "w")
        procs.append(
            (subprocess.Popen(cmd, env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, text=True), log, cmd)
        )
    codes = []
    for proc, log, _ in procs:
        try:
            codes.append(proc.wait(timeout=LAUNCH_TIMEOUT_S))
        except subprocess.TimeoutExpired:
            for other, _, _ in procs:
                other.kill()
            codes.append(-9)
        log.close()
    output = "\n".join((out / f"launch{n}.log").read_text() for n in range(launch.nodes))
    return SimpleNamespace(
        name=launch.name,
        returncode=max(codes, key=abs),
        output=output,
        out=out,
        seconds=time.monotonic() - start,
        cmd=[c for _, _, c in procs],
    )


class Runs:
    """Starts every launch (two at a time) and hands out results by name."""

    ORDER = (
        "accelerate_stage3",
        "accelerate_multinode",
        "trainer_stage3",
        "lightning_zero3",
        "full_stage3",
        "accelerate_stage2",
    )

    def __init__(self, tmp: Path) -> None:
        self.pool = concurrent.futures.ThreadPoolExecutor(max_workers=2)
        self.futures = {name: self.pool.submit(_run_launch, LAUNCHES[name], tmp) for name in self.ORDER}

    def get(self, name: str) -> SimpleNamespace:
        result = self.futures[name].result(timeout=3 * LAUNCH_TIMEOUT_S)
        if result.returncode != 0:
            pytest.fail(f"{name} exited {result.returncode}: {result.cmd}\n{result.output[-6000:]}")
        return result

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        times = {n: round(f.result().seconds, 1) for n, f in self.futures.items() if f.exception() is None}
        print(f"\nexample launch wall times (s): {times}")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    runner = Runs(tmp_path_factory.mktemp("examples"))
    yield runner
    runner.close()


# -- checks shared by the examples -----------------------------------------------------------------
def _metrics(result) -> dict:
    return json.loads((result.out / "metrics.json").read_text())


def _assert_learns(losses: list[float], what: str) -> None:
    """The last quarter of the logged losses averages below 80% of the first one."""
    assert len(losses) >= 3 and all(x == x for x in losses), (what, losses)
    tail = losses[-max(1, len(losses) // 4) :]
    assert sum(tail) / len(tail) < 0.8 * losses[0], f"{what}: the loss did not fall: {losses}"


def _assert_memory_matches_theory(reports: list[dict], stage: int) -> None:
    assert [r["rank"] for r in reports] == [0, 1]
    for report in reports:
        assert report["stage"] == stage and report["world_size"] == 2
        for key in ("params", "grads", "optimizer"):
            measured, theory = report["measured"][key], report["theory"][key]
            # Adam's per-parameter `step` scalars are outside the theory.
            assert abs(measured - theory) <= 1e-3 * theory + 4 * 256, (stage, report["rank"], key, measured, theory)


def _base_args() -> Namespace:
    return Namespace(model=None, seed=0, max_length=128, max_new_tokens=6)


def _eval_batch(tokenizer, rows: int = 32) -> dict[str, torch.Tensor]:
    records = common.load_records(common.DEFAULT_DATA)[:rows]
    return common.Collator(tokenizer.pad_token_id)(common.encode_all(records, tokenizer, 128))


@torch.no_grad()
def _loss(model, batch) -> float:
    return float(model.eval()(**batch).loss)


def _assert_adapter_loads_and_helps(adapter_dir: Path, metrics: dict) -> None:
    from peft import PeftModel
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(adapter_dir)
    batch = _eval_batch(tokenizer)
    base_loss = _loss(common.build_model(_base_args(), tokenizer), batch)
    model = PeftModel.from_pretrained(common.build_model(_base_args(), tokenizer), adapter_dir)
    trained_loss = _loss(model, batch)
    assert trained_loss < 0.8 * base_loss, (trained_loss, base_loss)
    # The script's own reload (rank 0, after training) generated the same answers.
    assert common.samples(model, tokenizer, 6) == metrics["samples_reloaded"]


# -- Accelerate: every stage, and multi-node ---------------------------------------------------------------
@pytest.mark.parametrize("stage", [2, 3])
def test_accelerate_example_at_stages_2_and_3(runs, stage):
    result = runs.get(f"accelerate_stage{stage}")
    metrics = _metrics(result)
    assert metrics["num_processes"] == 2 and metrics["zero_config"]["stage"] == stage
    assert len(metrics["losses"]) == STEPS
    _assert_learns(metrics["losses"], f"accelerate stage {stage}")
    _assert_memory_matches_theory(metrics["memory"], stage)
    assert metrics["comm"]["total"]["bytes"] > 0
    assert "Model state per rank, ZeRO-" in result.output and "Communication per optimizer step" in result.output
    assert (result.out / "state" / "zero_plugin_0").is_dir()  # save_state
    _assert_adapter_loads_and_helps(result.out / "adapter", metrics)


def test_accelerate_stages_agree(runs):
    """Same script, same data: only the sharding differs, so the losses agree across stages."""
    losses = {s: _metrics(runs.get(f"accelerate_stage{s}"))["losses"] for s in (2, 3)}
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses[3], losses[2]))
    assert worst <= 1e-3, (losses[3], losses[2])


def test_multinode_torchrun_matches_single_node(runs):
    single, multi = _metrics(runs.get("accelerate_stage3")), _metrics(runs.get("accelerate_multinode"))
    assert multi["num_processes"] == 2 and multi["zero_config"]["stage"] == 3
    assert len(multi["losses"]) == len(single["losses"]) == STEPS
    worst = max(abs(a - b) / abs(b) for a, b in zip(multi["losses"], single["losses"]))
    assert worst <= MULTINODE_LOSS_RTOL, (multi["losses"], single["losses"])
    _assert_adapter_loads_and_helps(runs.get("accelerate_multinode").out / "adapter", multi)


# -- HF Trainer, Lightning, full fine-tune ------------------------------------------------------------------
def test_trainer_example(runs):
    result = runs.get("trainer_stage3")
    metrics = _metrics(result)
    assert metrics["world_size"] == 2 and metrics["zero_config"]["stage"] == 3
    assert metrics["global_step"] == STEPS
    _assert_learns(metrics["losses"], "trainer")
    _assert_memory_matches_theory(metrics["memory"], 3)
    assert (result.out / f"checkpoint-{STEPS}").is_dir()
    _assert_adapter_loads_and_helps(result.out / "adapter", metrics)


def test_lightning_example(runs):
    result = runs.get("lightning_zero3")
    metrics = _metrics(result)
    assert metrics["world_size"] == 2 and metrics["strategy"] == "zero3"
    _assert_learns(metrics["losses"], "lightning")
    _assert_memory_matches_theory(metrics["memory"], 3)
    assert (result.out / "last.ckpt").exists()
    _assert_adapter_loads_and_helps(result.out / "adapter", metrics)


def test_full_finetune_example(runs):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    result = runs.get("full_stage3")
    metrics = _metrics(result)
    assert metrics["num_processes"] == 2 and metrics["zero_config"]["stage"] == 3
    assert metrics["trainable_params"] == metrics["total_params"]
    _assert_learns(metrics["losses"], "full fine-tune")
    _assert_memory_matches_theory(metrics["memory"], 3)
    assert (result.out / "checkpoint" / "COMPLETE").is_file()  # zp.save_checkpoint
    model_dir = result.out / "model"
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    initial = common.build_model(_base_args(), tokenizer)
    batch = _eval_batch(tokenizer)
    assert _loss(model, batch) < 0.8 * _loss(initial, batch)
    assert common.samples(model, tokenizer, 6) == metrics["samples_reloaded"]


# -- shipped configs and data (in-process, fast) ---------------------------------------------------------
EXPECTED_CONFIGS = {
    "stage0": (0, "none", False),
    "stage1": (1, "none", False),
    "stage2": (2, "none", False),
    "stage3": (3, "none", False),
    "stage2_offload": (2, "cpu", False),
    "stage3_offload": (3, "cpu", True),
}


@pytest.mark.parametrize("name", sorted(EXPECTED_CONFIGS))
def test_config_files(name, tmp_path):
    import yaml
    from accelerate.commands.config.config_args import ClusterConfig

    import zero_plugin as zp

    path = CONFIGS / f"{name}.yaml"
    config = zp.ZeroConfig.from_env({"ZERO_PLUGIN_CONFIG": str(path)})
    assert (config.stage, config.offload_optimizer, config.offload_params) == EXPECTED_CONFIGS[name]
    rest = {k: v for k, v in yaml.safe_load(path.read_text()).items() if k != "zero_plugin"}
    (tmp_path / "accelerate.yaml").write_text(yaml.safe_dump(rest))
    ClusterConfig.from_yaml_file(str(tmp_path / "accelerate.yaml"))  # what Accelerate will read: valid


def test_shipped_data_is_what_make_data_generates(tmp_path):
    out = tmp_path / "instructions.jsonl"
    subprocess.run([PY, str(EXAMPLES / "data" / "make_data.py"), "--out", str(out)], check=True, capture_output=True)
    assert out.read_text() == (EXAMPLES / "data" / "instructions.jsonl").read_text()
    assert len(common.load_records(out)) >= 300


def test_data_formats(tmp_path):
    from transformers import AutoTokenizer  # noqa: F401  (the default tokenizer loads through it)

    (tmp_path / "plain.txt").write_text("first line\n\n  second line  \n")
    assert common.load_records(tmp_path / "plain.txt") == [{"text": "first line"}, {"text": "second line"}]
    (tmp_path / "rows.jsonl").write_text('{"text": "a"}\n{"instruction": "q", "response": "r", "id": 3}\n')
    assert common.load_records(tmp_path / "rows.jsonl") == [{"text": "a"}, {"instruction": "q", "response": "r"}]
    (tmp_path / "bad.jsonl").write_text('{"question": "q"}\n')
    with pytest.raises(ValueError, match="line 1: expected"):
        common.load_records(tmp_path / "bad.jsonl")
    tokenizer = common.default_tokenizer(common.DEFAULT_DATA, tmp_path / "cache")
    row = common.encode({"instruction": "What is 1 plus 2?", "response": "1 plus 2 is 3."}, tokenizer, 128)
    prompt = common.prompt_ids(tokenizer, "What is 1 plus 2?")
    assert row["labels"][: len(prompt)] == [common.IGNORE_INDEX] * len(prompt)  # the prompt is not trained on
    assert row["labels"][len(prompt) :] == row["input_ids"][len(prompt) :]
    assert row["input_ids"][-1] == tokenizer.eos_token_id
    assert tokenizer.decode(row["input_ids"][len(prompt) : -1]) == "1 plus 2 is 3."
    again = common.default_tokenizer(common.DEFAULT_DATA, tmp_path / "cache")  # from the cache
    assert again.get_vocab() == tokenizer.get_vocab()
