"""How the tests start multi-process launches: ports that cannot be taken from under them, and a run that, when
it hangs, says where.

* **Ports.**  ``--main_process_port 0`` (accelerate) and a port read from a socket bound to 0 both pick a free
  port, close it, and bind it again later: in between, any socket the kernel hands an ephemeral port (gloo's
  pairs, a client connection of another launch running beside it) can take it.  ``free_port`` hands out ports
  below the kernel's ephemeral range (``/proc/sys/net/ipv4/ip_local_port_range``), which only an explicit bind
  can take, each at most once per test session, so launches running side by side never share one either.
* **Hangs.**  ``run`` runs a command like ``subprocess.run(capture_output=True, text=True)``; past its timeout
  it sends SIGABRT to every process under it, each Python process dumps its threads' stacks
  (``PYTHONFAULTHANDLER``) into the captured output, and it returns exit code 124 (as ``timeout(1)``) with
  that output, so that the caller's usual ``returncode == 0`` check fails showing where each process stood.
"""

from __future__ import annotations

import itertools
import os
import signal
import socket
import subprocess

import psutil

_PORT_FLAGS = ("--main_process_port", "--master_port")
TIMED_OUT = 124


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


_LOW = 20000
_SPAN = max(_ephemeral_low() - _LOW, 1000)
_next = itertools.count(os.getpid() * 61)  # another pytest session on the machine starts elsewhere


def free_port() -> int:
    """A port nobody listens on now, below the ephemeral range, never returned before in this process."""
    for _ in range(_SPAN):
        port = _LOW + next(_next) % _SPAN
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free port in {_LOW}..{_LOW + _SPAN}")


def fresh_ports(cmd: list[str]) -> list[str]:
    """``cmd`` with the value of every ``--main_process_port`` / ``--master_port`` that is ``0`` replaced by a
    ``free_port()``."""
    out = list(cmd)
    for i in range(len(out) - 1):
        if out[i] in _PORT_FLAGS and out[i + 1] == "0":
            out[i + 1] = str(free_port())
    return out


def run(cmd: list[str], *, env: dict[str, str] | None = None, cwd=None, timeout: float) -> subprocess.CompletedProcess:
    """``subprocess.run(fresh_ports(cmd), capture_output=True, text=True)``; a command that outlives
    ``timeout`` ends with exit code 124 and every process's stacks at the end of its stderr."""
    cmd = fresh_ports(cmd)
    env = dict(os.environ if env is None else env, PYTHONFAULTHANDLER="1")
    with subprocess.Popen(cmd, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            stdout, stderr = _abort_tree(proc)
            note = f"\n[tests.launching] timed out after {timeout:.0f} s; above: each process's stacks then\n"
            return subprocess.CompletedProcess(cmd, TIMED_OUT, stdout, stderr + note)
        return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def _abort_tree(proc: subprocess.Popen) -> tuple[str, str]:
    """SIGABRT to every process under the launcher, deepest first (each Python one dumps its stacks and dies;
    a torchrun-style launcher then reports its workers and exits); whatever is left after a while, orphans
    included (launchers start their workers in sessions of their own), is killed.  Returns the output read."""
    seen: dict[int, psutil.Process] = {}

    def under() -> list[psutil.Process]:
        try:
            found = psutil.Process(proc.pid).children(recursive=True)
        except psutil.NoSuchProcess:
            found = []
        for p in found:
            seen.setdefault(p.pid, p)
        return found

    for p in reversed(under()):
        _signal(p, signal.SIGABRT)
    try:
        return proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        pass
    under()
    for p in seen.values():
        _signal(p, signal.SIGKILL)
    proc.kill()
    try:
        return proc.communicate(timeout=30)
    except subprocess.TimeoutExpired:  # something outside the tree still holds the pipes
        return "", "[tests.launching] the command's output could not be read to its end"


def _signal(p: psutil.Process, sig: int) -> None:
    try:
        p.send_signal(sig)  # psutil checks the pid still names the same process
    except psutil.NoSuchProcess:
        pass
