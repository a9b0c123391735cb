"""A plain torch.distributed script that destroys its process group and returns leaves no gloo thread of
zero_plugin's cached groups alive at interpreter exit ([Note: cached groups at exit] in
``zero_plugin/comm/groups.py``): a worker thread still alive then aborts a successful run now and then
("terminate called without an active exception", exit -6: seen in ``examples/full_finetune.py`` under
torchrun).  The abort is a race; the thread count at exit is what fails every time without the fix."""

from __future__ import annotations

import os
import re

from tests.harness import REPO_ROOT, run_script_ranks

SCRIPT = os.path.join(REPO_ROOT, "tests", "integrations", "scripts", "plain_exit_run.py")
_THREADS = re.compile(r"THREADS before=(\d+) at_exit=(\d+)")


def _threads_at_exit(stage: int) -> list[int]:
    counts = []
    for rank, (code, out) in enumerate(run_script_ranks([SCRIPT, str(stage)])):
        assert code == 0, f"stage {stage} rank {rank}: exit code {code}\n{out[-3000:]}"
        found = _THREADS.search(out)
        assert found is not None, f"stage {stage} rank {rank}: no thread count\n{out[-3000:]}"
        counts.append(int(found.group(2)))
    return counts


def test_stage3_groups_are_joined_before_interpreter_exit():
    """Stage 3's cached groups (control channel, reduction group: 3 gloo threads each) are gone at exit: a
    stage-3 run leaves no more threads than a stage-1 run, which caches none.  Before the exit handler: 11
    threads at stage 3 against 5 at stage 1.  Still open (docs/architecture.md, known limits): the default
    group's own threads (4) outlive ``destroy_process_group()`` after any zp.setup, where a plain torch script's
    are joined by it."""
    stage1, stage3 = _threads_at_exit(1), _threads_at_exit(3)
    assert all(t3 <= max(stage1) for t3 in stage3), (stage1, stage3)
