"""Edits between ``from_pretrained`` and ``prepare`` under ``zero-plugin launch``: the same values as DDP.

``scripts/lazy_edits.py`` (plain Accelerate, no zero_plugin in it) runs every case of [Note: edits before
setup] (``zero_plugin/loading/lazy_edits.py``) in one process: vocabulary resizes with and without mean
initialisation (``run_clm_no_trainer.py``), TRL's ``clone_chat_template``, added special tokens on a tied
model with ``tie_weights`` and gradient checkpointing, PEFT ``modules_to_save`` on a resized embedding,
``model.to(accelerator.device)`` / ``train()`` / ``eval()`` before prepare (Accelerate's
``complete_nlp_example.py``), a bf16 round trip, and a forward before prepare.  It is launched once as plain
DDP (eager) and once per setting: stages 1 and 2 (eager), stage 2 with ``cpu_ram_efficient_loading`` (lazy on
rank 1) and stage 3 (lazy).  The models: a real-shaped Llama (vocabulary 4096 x hidden 256, untied output
layer of 2^20 elements, 2 layers) and a small tied one with a tokenizer.

Every case's embedding and output layer right after prepare equal DDP's bit for bit (the new rows are drawn
from the global RNG: same draws), the losses of 2 steps agree, and a forward before prepare either runs (an
eager rank) or names the cause and ``ZERO_PLUGIN_LAZY_LOADING``.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import sys
from pathlib import Path

import pytest
import torch

from tests import launching, models

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tests" / "integrations" / "scripts" / "lazy_edits.py"
PY = sys.executable
CONSOLE = Path(PY).parent / "zero-plugin"
ZERO_LAUNCH = [str(CONSOLE)] if CONSOLE.exists() else [PY, "-m", "zero_plugin.launch.cli"]
TWO = ["--num_processes", "2", "--main_process_port", "0"]
CASES = (
    "resize_mean",
    "resize_plain",
    "to_device",
    "dtype_round_trip",
    "chat_template",
    "special_tokens_tied",
    "peft_resized",
    "forward_first",
)
LAUNCHES = {
    "ddp": ([PY, "-m", "accelerate.commands.launch", "--multi_gpu", *TWO], {"ACCELERATE_USE_CPU": "true"}),
    "stage1": ([*ZERO_LAUNCH, "launch", "--stage", "1", "--no_estimate", *TWO], {}),
    "stage2": ([*ZERO_LAUNCH, "launch", "--stage", "2", "--no_estimate", *TWO], {}),
    "stage2_ram_efficient": (
        [*ZERO_LAUNCH, "launch", "--stage", "2", "--no_estimate", *TWO],
        {"ZERO_PLUGIN_CPU_RAM_EFFICIENT_LOADING": "true"},
    ),
    "stage3": ([*ZERO_LAUNCH, "launch", "--stage", "3", "--no_estimate", *TWO], {}),
}
LAZY_RANKS = {"stage2_ram_efficient": {1}, "stage3": {0, 1}}
LOSS_RTOL = 1e-4
TIMEOUT_S = 600

pytestmark = pytest.mark.filterwarnings("ignore:.*is_gradient_checkpointing.* is deprecated:FutureWarning")

EXAMPLES = REPO / "examples"
if str(EXAMPLES) not in sys.path:
    sys.path.insert(0, str(EXAMPLES))
import common  # noqa: E402  (examples/common.py: the default tokenizer)


def _models(tmp: Path) -> list[str]:
    """--real, --tied, --chat_source folders."""
    tokenizer = common.default_tokenizer(common.DEFAULT_DATA, tmp / "cache")
    for name, vocab, hidden, tied in (("real", 4096, 256, False), ("tied", len(tokenizer), 64, True)):
        config = models.llama_config(vocab, hidden, tie=tied, **models.token_ids_of(tokenizer))
        models.save_random_llama(tmp / name, config, seed=0, tokenizer=tokenizer)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"]})
    tokenizer.eos_token = "<|im_end|>"
    tokenizer.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    )
    tokenizer.save_pretrained(tmp / "chat")
    return ["--real", str(tmp / "real"), "--tied", str(tmp / "tied"), "--chat_source", str(tmp / "chat")]


def _launch(tmp: Path, name: str, model_args: list[str]) -> tuple[int, str]:
    cmd, extra = LAUNCHES[name]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ZERO_PLUGIN_", "ACCELERATE_", "MASTER_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env.update(XDG_CACHE_HOME=str(tmp / "xdg"), **extra)
    args = [str(SCRIPT), *model_args, "--out", str(tmp / name), "--cases", ",".join(CASES)]
    proc = launching.run([*cmd, *args], env=env, cwd=tmp, timeout=TIMEOUT_S)
    return proc.returncode, proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("lazy_edits")
    model_args = _models(tmp)
    with concurrent.futures.ThreadPoolExecutor(max_workers=2) as pool:
        futures = {name: pool.submit(_launch, tmp, name, model_args) for name in LAUNCHES}
    return tmp, {name: f.result() for name, f in futures.items()}


def _out(runs, name: str) -> Path:
    tmp, results = runs
    code, output = results[name]
    if code != 0:
        pytest.fail(f"{name} exited {code}:\n{output[-6000:]}")
    return tmp / name


@pytest.mark.parametrize("name", [n for n in LAUNCHES if n != "ddp"])
def test_edits_before_prepare_match_ddp(runs, name):
    ddp, run = _out(runs, "ddp"), _out(runs, name)
    for case in CASES:
        want, got = (torch.load(d / f"{case}.pt") for d in (ddp, run))
        assert sorted(got["tensors"]) == sorted(want["tensors"]), case
        for key, value in want["tensors"].items():
            assert torch.equal(got["tensors"][key], value), (case, key)
        worst = max(abs(a - b) / abs(b) for a, b in zip(got["losses"], want["losses"], strict=True))
        assert worst <= LOSS_RTOL, (case, got["losses"], want["losses"])


@pytest.mark.parametrize("name", list(LAUNCHES))
def test_forward_before_prepare_runs_or_names_the_switch(runs, name):
    out = _out(runs, name)
    for rank in (0, 1):
        outcome = json.loads((out / f"forward_first.rank{rank}.json").read_text())["forward"]
        if rank in LAZY_RANKS.get(name, ()):
            assert outcome.startswith("RuntimeError: zero_plugin: LlamaForCausalLM was loaded lazily"), outcome
            assert "ZERO_PLUGIN_LAZY_LOADING=false" in outcome and "after prepare" in outcome
        else:
            assert outcome == "ok", (name, rank, outcome)


def test_resized_rows_are_drawn_not_copied(runs):
    """The cases do what they say: mean resizing adds distinct rows, the chat template pads to 64."""
    ddp = _out(runs, "ddp")
    mean = torch.load(ddp / "resize_mean.pt")["tensors"]["model.embed_tokens.weight"]
    assert mean.shape == (4104, 256) and not torch.equal(mean[-1], mean[-2])
    chat = torch.load(ddp / "chat_template.pt")["tensors"]
    assert chat["model.embed_tokens.weight"].shape[0] % 64 == 0
    assert chat["lm_head.weight"].data_ptr() == chat["model.embed_tokens.weight"].data_ptr() or torch.equal(
        chat["lm_head.weight"], chat["model.embed_tokens.weight"]
    )
