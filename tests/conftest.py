"""Shared pytest setup: repo root importable, worker pools closed at session end."""

import os
import shutil
import sys

import pytest

_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO_ROOT not in sys.path:
    sys.path.insert(0, _REPO_ROOT)

from tests.harness import close_all_pools  # noqa: E402


def _write_bytecode() -> None:
    """Compile the repo's own modules to ``__pycache__`` once, before any process of the suite starts.

    Where ``PYTHONDONTWRITEBYTECODE=1`` is set (this machine and CI), Python never caches what it compiles, so
    every spawned worker and launched rank compiled zero_plugin's ~90 modules again: ~0.8 s of CPU per process,
    some hundreds of processes per run.  Cached bytecode is still read under that flag and is checked against
    the source's timestamp, so an edited file is compiled afresh as before.  Site-packages are compiled by pip.
    """
    import compileall

    for folder in ("zero_plugin", "tests", "examples", "benchmarks"):
        path = os.path.join(_REPO_ROOT, folder)
        if os.path.isdir(path):
            compileall.compile_dir(path, quiet=2, workers=1)


_write_bytecode()


@pytest.fixture(scope="session", autouse=True)
def _close_worker_pools():
    yield
    close_all_pools()


@pytest.fixture(scope="module", autouse=True)
def _free_module_tmp(request, tmp_path_factory):
    """Delete what a module's fixtures wrote under the session's temporary folder once the module passed.

    pytest keeps every ``tmp_path_factory.mktemp`` folder until the session ends, so the suite's disk use was
    the sum of all modules' checkpoints and saved models (one module alone writes ~300 MB); on a CI machine with
    little free disk the later ``torch.save`` calls failed and every test after them with them.  A module that
    failed keeps its folders for inspection (``tmp_path_retention_policy`` does the same for ``tmp_path``).
    """
    base = tmp_path_factory.getbasetemp()
    before = set(base.iterdir())
    failed = request.session.testsfailed
    yield
    if request.session.testsfailed != failed:
        return
    for path in set(base.iterdir()) - before:
        if path.is_symlink() or not path.is_dir():
            path.unlink(missing_ok=True)
        else:
            shutil.rmtree(path, ignore_errors=True)
