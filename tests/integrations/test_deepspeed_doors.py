"""A DeepSpeed user's configuration at every door of zero_plugin (issue 53).

* The HF Trainer's ``--deepspeed`` (one launch, 2 CPU processes): ``scripts/trainer_deepspeed.py`` trains the
  transformers docs' ZeRO-2 and ZeRO-3 JSON files (``"auto"`` wherever they put it) and a JSON with an
  ``optimizer`` section, each beside the same training configured the zero_plugin way (``--stage 2`` /
  ``--stage 3`` with the optimizer and schedule DeepSpeed builds from the sections, made by hand): equal losses,
  gradient norms and learning rates step for step, DeepSpeed never imported.
* ``zero-plugin launch`` built in this process (no processes started): an Accelerate ``DEEPSPEED`` config and the
  ``--use_deepspeed`` flags become the children's ``ZeroConfig``; nvme offload, an unknown stage, a batch-size
  mismatch, an optimizer section and a ``--stage`` that disagrees are refused naming the key.  One real
  ``zero-plugin launch`` shows the refusal comes before any process starts.
* ``TrainingArguments(deepspeed=...)`` in this process: the take-over, its refusals, the optimizer and schedule.

The Accelerate loop under an Accelerate DEEPSPEED config and under ``--use_deepspeed --deepspeed_config_file``
runs with the other Accelerate launches, in ``test_accelerate.py``; the translator alone in
``tests/unit/test_config_deepspeed.py``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml

from tests import launching

REPO = Path(__file__).resolve().parents[2]
SCRIPTS = REPO / "tests" / "integrations" / "scripts"
CONFIGS = REPO / "tests" / "fixtures" / "deepspeed_configs"
ZERO2, ZERO3 = CONFIGS / "ds_config_zero2.json", CONFIGS / "ds_config_zero3.json"
CONSOLE = Path(sys.executable).parent / "zero-plugin"
ZERO_LAUNCH = [str(CONSOLE)] if CONSOLE.exists() else [sys.executable, "-m", "zero_plugin.launch.cli"]
RTOL = 1e-5


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ZERO_PLUGIN_", "ACCELERATE_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    return env


def _close(got: list[float], want: list[float], what: str) -> None:
    assert len(got) == len(want) > 0, what
    worst = max(abs(g - w) / max(abs(w), 1e-12) for g, w in zip(got, want))
    assert worst <= RTOL, f"{what}: worst relative difference {worst:.3g}\n got  {got}\n want {want}"


# -- the HF Trainer's --deepspeed, one launch --------------------------------------------------------------
@pytest.fixture(scope="module")
def trainer_runs(tmp_path_factory):
    from transformers import LlamaForCausalLM, set_seed

    from tests.models import llama_config

    out = tmp_path_factory.mktemp("trainer_deepspeed")
    set_seed(0)
    LlamaForCausalLM(llama_config(128, 64, use_cache=False)).save_pretrained(out / "base")
    cmd = [*ZERO_LAUNCH, "launch", "--num_processes", "2", "--main_process_port", "0", "--no_estimate"]
    script = [str(SCRIPTS / "trainer_deepspeed.py"), "--out", str(out), "--base", str(out / "base")]
    proc = launching.run([*cmd, *script], env=_env(), cwd=out, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads((out / "result.json").read_text()), proc.stdout + proc.stderr


@pytest.mark.parametrize(
    "deepspeed, zero_plugin, stage, offload_params",
    [("ds_zero2", "stage2", 2, False), ("ds_zero3", "stage3", 3, True), ("ds_optimizer", "adamw_by_hand", 2, False)],
)
def test_trainer_deepspeed_json_equals_the_zero_plugin_run(trainer_runs, deepspeed, zero_plugin, stage, offload_params):
    info, output = trainer_runs
    assert info["world_size"] == 2 and not info["deepspeed_imported"]
    ds, twin = info["runs"][deepspeed], info["runs"][zero_plugin]
    for key in ("losses", "grad_norms", "learning_rates"):
        _close(ds[key], twin[key], f"{deepspeed} vs {zero_plugin} {key}")
    config = ds["zero_config"]
    assert (config["stage"], config["offload_params"], config["clip_grad_norm"]) == (stage, offload_params, 1.0)
    assert config["offload_optimizer"] == ("none" if deepspeed == "ds_optimizer" else "cpu")  # as the JSON says
    assert twin["zero_config"]["stage"] == stage
    # DeepSpeed's optimizer: torch's AdamW over every parameter in one group, weight decay on all of them.
    assert (ds["zero_optimizer"], ds["inner_optimizer"], ds["weight_decays"]) == ("ZeroOptimizer", "AdamW", [0.01])
    assert ds["betas"] == [[0.9, 0.999]] and ds["deepspeed_kept"]
    if deepspeed != "ds_optimizer":  # WarmupLR: the first two steps at warmup_min_lr (0), then the log warm-up
        assert ds["learning_rates"][:2] == [0.0, 0.0] and ds["learning_rates"][-1] == pytest.approx(3e-3)
    else:  # no scheduler section: the Trainer's own linear schedule
        assert ds["learning_rates"][:4] == pytest.approx([0.0, 1e-3, 2e-3, 3e-3])
    assert output.count("zero_plugin: DeepSpeed config") == 3  # rank 0, once per configuration
    if deepspeed == "ds_zero3":  # the ZeRO-3 JSON, given before from_pretrained, loads the model lazily
        assert ds["lazily_loaded"]


# -- zero-plugin launch, built in this process -------------------------------------------------------------
ACCELERATE_DEEPSPEED = {
    "compute_environment": "LOCAL_MACHINE",
    "distributed_type": "DEEPSPEED",
    "deepspeed_config": {"zero_stage": 3, "offload_optimizer_device": "cpu", "offload_param_device": "cpu",
                         "zero3_init_flag": False, "gradient_clipping": 0.5},
    "num_processes": 2,
    "mixed_precision": "no",
    "use_cpu": True,
}  # fmt: skip


def _build(argv: list[str], monkeypatch, tmp_path: Path):
    """What ``zero-plugin launch argv`` hands Accelerate and the children, without starting them."""
    from zero_plugin.launch import launcher

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(launcher, "_has_accelerator_devices", lambda: False)
    for key in [k for k in os.environ if k.startswith(("ZERO_PLUGIN_", "ACCELERATE_"))]:
        monkeypatch.delenv(key)
    args = launcher._launch_parser().parse_args(argv)
    temp_files: list[str] = []
    try:
        args.config_file, section, settings = launcher._split_accelerate_config(args.config_file, temp_files)
        env = launcher._zero_environment(args, section)
        launcher._take_deepspeed(args, settings, env, temp_files)
        launcher._prepare_accelerate_args(args, settings, env)
        files = {path: Path(path).read_text() for path in temp_files}
    finally:
        for path in temp_files:
            os.unlink(path)
    return args, env, files


def test_launch_maps_an_accelerate_deepspeed_config(monkeypatch, tmp_path, capsys):
    from zero_plugin import ZeroConfig

    (tmp_path / "acc.yaml").write_text(yaml.safe_dump(ACCELERATE_DEEPSPEED))
    args, env, files = _build(["--config_file", "acc.yaml", "train.py"], monkeypatch, tmp_path)
    accelerate_copy = yaml.safe_load(files[args.config_file])
    assert accelerate_copy["distributed_type"] == "MULTI_CPU" and "deepspeed_config" not in accelerate_copy
    assert args.multi_gpu and not args.use_deepspeed and env["ACCELERATE_USE_CPU"] == "true"
    zero_yaml = tmp_path / "zero.yaml"
    zero_yaml.write_text(files[env["ZERO_PLUGIN_CONFIG"]])
    assert ZeroConfig.from_file(zero_yaml) == ZeroConfig(
        stage=3, offload_optimizer="cpu", offload_params=True, clip_grad_norm=0.5, lazy_loading=False
    )
    printed = capsys.readouterr().err
    assert printed.count("zero_plugin: DeepSpeed config") == 1 and "mapped:  zero3_init_flag = false" in printed


def test_launch_maps_the_deepspeed_flags(monkeypatch, tmp_path):
    from zero_plugin import ZeroConfig

    ds = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}, "gradient_clipping": "auto",
          "gradient_accumulation_steps": 4, "train_micro_batch_size_per_gpu": 2, "train_batch_size": 16}  # fmt: skip
    (tmp_path / "ds.json").write_text(json.dumps(ds))
    argv = ["--use_deepspeed", "--deepspeed_config_file", "ds.json", "--gradient_clipping", "2.0"]
    args, env, files = _build([*argv, "--num_processes", "2", "train.py"], monkeypatch, tmp_path)
    (tmp_path / "zero.yaml").write_text(files[env["ZERO_PLUGIN_CONFIG"]])
    assert ZeroConfig.from_file(tmp_path / "zero.yaml") == ZeroConfig(
        stage=2, offload_optimizer="cpu", clip_grad_norm=2.0
    )
    assert env["ACCELERATE_GRADIENT_ACCUMULATION_STEPS"] == "4"
    # A file without gradient_accumulation_steps: 1, as Accelerate makes it (the script's own value is overridden).
    (tmp_path / "ds1.json").write_text(json.dumps({"zero_optimization": {"stage": 1}}))
    args, env, files = _build(
        ["--use_deepspeed", "--deepspeed_config_file", "ds1.json", "train.py"], monkeypatch, tmp_path
    )
    assert env["ACCELERATE_GRADIENT_ACCUMULATION_STEPS"] == "1"
    # Flags alone: Accelerate's defaults (stage 2, clipping 1.0) under the flags given.
    args, env, files = _build(["--use_deepspeed", "--zero_stage", "1", "train.py"], monkeypatch, tmp_path)
    (tmp_path / "zero.yaml").write_text(files[env["ZERO_PLUGIN_CONFIG"]])
    assert ZeroConfig.from_file(tmp_path / "zero.yaml") == ZeroConfig(stage=1, clip_grad_norm=1.0)
    # zero_plugin's own settings add to DeepSpeed's.
    (tmp_path / "extra.yaml").write_text("prefetch_depth: 2\nstage: 1\n")
    args, env, files = _build(
        ["--use_deepspeed", "--zero_stage", "1", "--zero_config", "extra.yaml", "train.py"], monkeypatch, tmp_path
    )
    (tmp_path / "zero.yaml").write_text(files[env["ZERO_PLUGIN_CONFIG"]])
    assert ZeroConfig.from_file(tmp_path / "zero.yaml") == ZeroConfig(stage=1, clip_grad_norm=1.0, prefetch_depth=2)


@pytest.mark.parametrize(
    "argv, ds, named",
    [
        (["--use_deepspeed", "--offload_param_device", "nvme", "--zero_stage", "3"], None, 'zero_optimization.offload_param.device="nvme"'),
        (["--use_deepspeed", "--zero_stage", "4"], None, "zero_optimization.stage=4"),
        (["--use_deepspeed", "--num_processes", "2"], {"train_batch_size": 12, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2},
         "train_batch_size=12 is not train_micro_batch_size_per_gpu=4 x gradient_accumulation_steps=2 x world size 2"),
        (["--use_deepspeed", "--stage", "2"], {"zero_optimization": {"stage": 3}},
         "zero_plugin's stage='2' (from --stage 2 / ZERO_PLUGIN_STAGE=2) and DeepSpeed's zero_optimization.stage"),
        (["--use_deepspeed", "--offload", "none"], {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}},
         "zero_plugin's offload_optimizer='none'"),
        (["--use_deepspeed"], {"optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}, "applies the optimizer section(s) only through the HF Trainer"),
    ],
)  # fmt: skip
def test_launch_refusals_name_the_key(monkeypatch, tmp_path, argv, ds, named):
    if ds is not None:
        (tmp_path / "ds.json").write_text(json.dumps(ds))
        argv = [*argv, "--deepspeed_config_file", "ds.json"]
    with pytest.raises(ValueError) as info:
        _build([*argv, "train.py"], monkeypatch, tmp_path)
    assert named in str(info.value), str(info.value)


def test_launch_checks_a_trainer_scripts_deepspeed_file(monkeypatch, tmp_path):
    from zero_plugin.launch import launcher

    args, env, _ = _build(["--stage", "2", "train.py", "--deepspeed", str(ZERO3)], monkeypatch, tmp_path)
    with pytest.raises(ValueError, match=r"--stage 2 / ZERO_PLUGIN_STAGE=2.*zero_optimization.stage"):
        launcher._check_trainer_deepspeed(["train.py", "--deepspeed", str(ZERO3)], env)
    nvme = tmp_path / "nvme.json"
    nvme.write_text(json.dumps({"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}}))
    with pytest.raises(ValueError, match=r'offload_param.device="nvme"'):
        launcher._check_trainer_deepspeed(["train.py", f"--deepspeed={nvme}"], {})
    launcher._check_trainer_deepspeed(["train.py", "--deepspeed", str(ZERO3)], {})  # autos left to the Trainer
    launcher._check_trainer_deepspeed(["train.py", "--deepspeed", "missing.json"], {})  # the script's business


def test_a_conflicting_stage_is_refused_before_any_process_starts(tmp_path):
    (tmp_path / "ds3.json").write_text(json.dumps({"zero_optimization": {"stage": 3}, "gradient_clipping": "auto"}))
    cmd = [
        *ZERO_LAUNCH,
        "launch",
        "--stage",
        "2",
        "--use_deepspeed",
        "--deepspeed_config_file",
        str(tmp_path / "ds3.json"),
    ]
    cmd += ["--num_processes", "2", "--main_process_port", "0", str(SCRIPTS / "hello_accelerate.py")]
    proc = launching.run(cmd, env=_env(), cwd=tmp_path, timeout=300)
    output = proc.stdout + proc.stderr
    assert proc.returncode == 2, output[-3000:]
    assert "--stage 2 / ZERO_PLUGIN_STAGE=2" in output and "zero_optimization.stage" in output, output[-3000:]
    assert "hello from" not in output


# -- TrainingArguments(deepspeed=...), in this process -----------------------------------------------------
@pytest.fixture
def take_over(monkeypatch):
    from zero_plugin.integrations import deepspeed_config, hf_trainer

    for key in [k for k in os.environ if k.startswith(("ZERO_PLUGIN_", "ACCELERATE_"))]:
        monkeypatch.delenv(key)
    deepspeed_config.install()
    hf_trainer.install()
    return deepspeed_config


def _args(tmp_path, **kw):
    from transformers import TrainingArguments

    return TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[], learning_rate=1e-3, **kw)


def test_training_arguments_take_over(take_over, tmp_path):
    from zero_plugin import ZeroConfig
    from zero_plugin.integrations import hf_trainer

    args = _args(tmp_path, deepspeed=str(ZERO3), max_grad_norm=0.7, gradient_accumulation_steps=3)
    taken = take_over.taken_over(args)
    assert args.deepspeed == str(ZERO3) and args.deepspeed_plugin is None  # the user's value kept, no DeepSpeed plugin
    assert taken.config == ZeroConfig(stage=3, offload_optimizer="cpu", offload_params=True, clip_grad_norm=0.7)
    assert taken.translation.batch["gradient_accumulation_steps"] == 3
    hf_trainer._check_supported(args)  # a taken-over deepspeed is no longer refused
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.LayerNorm(4))
    trainer = SimpleNamespace(args=args, model=model, optimizer=None, lr_scheduler=None)
    optimizer = hf_trainer.create_optimizer(trainer)
    assert type(optimizer) is torch.optim.AdamW and len(optimizer.param_groups) == 1
    assert optimizer.param_groups[0]["weight_decay"] == args.weight_decay and optimizer.param_groups[0]["lr"] == 1e-3
    scheduler = hf_trainer.create_scheduler(trainer, num_training_steps=10)
    assert type(scheduler).__name__ == "LambdaLR" and optimizer.param_groups[0]["lr"] == 0.0  # WarmupLR's start


def test_training_arguments_refusals(take_over, tmp_path, monkeypatch):
    monkeypatch.setenv("ZERO_PLUGIN_STAGE", "2")  # what zero-plugin launch --stage 2 sets
    with pytest.raises(ValueError, match=r"--stage 2 / ZERO_PLUGIN_STAGE=2.*zero_optimization.stage"):
        _args(tmp_path, deepspeed=str(ZERO3))
    monkeypatch.delenv("ZERO_PLUGIN_STAGE")
    mismatch = {"zero_optimization": {"stage": 2}, "gradient_clipping": 0.5}
    with pytest.raises(ValueError, match=r"gradient_clipping=0.5 vs the run's 1.0"):
        _args(tmp_path, deepspeed=mismatch)
    with pytest.raises(ValueError, match=r'zero_optimization.offload_optimizer.device="nvme"'):
        _args(tmp_path, deepspeed={"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "nvme"}}})
