"""A plain torch.distributed script that destroys its process group has every gloo thread joined by
``destroy_process_group()`` after zp.setup at any stage, as without zp.setup ([Note: cached groups at exit]
in ``zero_plugin/comm/groups.py``): a worker thread still alive at interpreter exit aborts a successful run
now and then ("terminate called without an active exception", exit -6: seen in ``examples/full_finetune.py``
under torchrun).  The abort is a race; the thread count is what fails every time without the fix."""

from __future__ import annotations

import os
import re

import pytest

from tests.harness import REPO_ROOT, run_script_ranks

SCRIPT = os.path.join(REPO_ROOT, "tests", "integrations", "scripts", "plain_exit_run.py")
_THREADS = re.compile(r"THREADS before=(\d+) after_destroy=(\d+) at_exit=(\d+)")


def _thread_counts(stage: str) -> list[tuple[int, int, int]]:
    """Per rank: threads before the process group, right after ``destroy_process_group()``, at exit."""
    counts = []
    for rank, (code, out) in enumerate(run_script_ranks([SCRIPT, stage])):
        assert code == 0, f"stage {stage} rank {rank}: exit code {code}\n{out[-3000:]}"
        found = _THREADS.search(out)
        assert found is not None, f"stage {stage} rank {rank}: no thread count\n{out[-3000:]}"
        counts.append(tuple(int(n) for n in found.groups()))
    return counts


@pytest.mark.parametrize("stage", ["plain", "0", "2", "3"])
def test_destroy_process_group_joins_every_gloo_thread(stage):
    """Right after ``destroy_process_group()``, with the model and optimizer still referenced, the process has
    the threads it had before ``init_process_group``: the default group's (4 with the store's), the control
    channel's (stages 2 and 3) and stage 3's reduction group's (3 each) are gone, and so at exit.  Before the
    fix, on rank 0: 5 in the plain script and at stage 0 (torch's ``distributed.nn``, first imported by the
    optimizer, kept the default group), 8 at stage 2 and 11 at stage 3 (zero_plugin's cached groups too)."""
    for rank, (before, after_destroy, at_exit) in enumerate(_thread_counts(stage)):
        assert after_destroy == before and at_exit == before, (stage, rank, before, after_destroy, at_exit)
