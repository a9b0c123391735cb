"""[Note: exit without finalisation] in zero_plugin/run.py: a successful script leaves with exit code 0,
its atexit handlers run and what it wrote to files it never closed is on disk."""

from __future__ import annotations

import subprocess
import sys

from tests.harness import REPO_ROOT


def test_successful_script_exits_0_with_atexit_and_unclosed_files_flushed(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(
        "import atexit, sys\n"
        f"LOG = open({str(tmp_path / 'unclosed.txt')!r}, 'w')\n"
        "LOG.write('kept')\n"
        f"atexit.register(lambda: open({str(tmp_path / 'atexit.txt')!r}, 'w').write('ran'))\n"
        "print('done', end='')\n"
        "sys.exit(0)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-m", "zero_plugin.run", str(script)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.endswith("done")
    assert (tmp_path / "unclosed.txt").read_text() == "kept"
    assert (tmp_path / "atexit.txt").read_text() == "ran"


def test_failing_script_keeps_its_exit_code(tmp_path):
    script = tmp_path / "script.py"
    script.write_text("import sys\nsys.exit(3)\n")
    proc = subprocess.run(
        [sys.executable, "-m", "zero_plugin.run", str(script)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 3
