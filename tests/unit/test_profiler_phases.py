"""[Note: profiler phases] (issue #51, item 5): a step under ``torch.profiler`` shows zero_plugin's phases as
``zero_plugin::<name>`` ranges, and they add no aten op (the same ops, the same count, with the ranges patched
out); without a profiler a phase is the shared null context."""

from __future__ import annotations

import pytest

from tests.harness import run_ranks
from tests.unit import phases_workers as W

CASES = {
    "stage3": (dict(stage=3), {"all_gather", "all_gather_copy_out", "reduce_scatter", "reduce_scatter_wait"}),
    "stage2_bf16": (
        dict(stage=2, param_dtype="bf16"),
        {"reduce_bucket", "reduce_bucket_wait", "param_all_gather", "master_write_back"},
    ),
    "stage0": (dict(stage=0), {"reduce_bucket", "reduce_bucket_wait"}),
}


@pytest.mark.parametrize("case", CASES)
def test_phases_in_the_trace_add_no_ops(case, tmp_path) -> None:
    config, expected = CASES[case]
    for result in run_ranks(2, W.profiled_step_worker, config, str(tmp_path)):
        names = {n.removeprefix("zero_plugin::") for n in result["names"]}
        assert expected | {"optimizer_step", "checkpoint_save"} <= names, sorted(names)
        assert result["same_ops"] and result["ops"] > 0
        assert result["null"]
