"""``zero-plugin launch --allocator``: which library the ranks preload, and the errors that name the fix
([Note: host allocator] in ``zero_plugin/launch/allocator.py``; the launch itself: ``tests/integrations/
test_accelerate.py``)."""

from __future__ import annotations

import pytest

from zero_plugin.launch import allocator, launcher


def _nothing(name):
    return None


def _env(tmp_path, **extra):
    return {"CONDA_PREFIX": str(tmp_path / "conda"), "VIRTUAL_ENV": str(tmp_path / "venv"), **extra}


@pytest.fixture(autouse=True)
def _no_installed_copies(monkeypatch, tmp_path):
    """The interpreter's own prefix stays out of the search (a developer may have an allocator there)."""
    monkeypatch.setattr(allocator.sys, "prefix", str(tmp_path / "prefix"))


def test_glibc_preloads_nothing(tmp_path):
    assert allocator.preload_environment("glibc", _env(tmp_path, LD_PRELOAD="/x.so"), _nothing) == {}


def test_named_allocator_found_by_the_loader_and_put_before_the_users_preload(tmp_path):
    found = {"tcmalloc_minimal": None, "tcmalloc": "libtcmalloc.so.4", "jemalloc": "libjemalloc.so.2"}
    assert allocator.preload_environment("tcmalloc", _env(tmp_path), found.get) == {"LD_PRELOAD": "libtcmalloc.so.4"}
    env = _env(tmp_path, LD_PRELOAD="/opt/mine.so")
    assert allocator.preload_environment("jemalloc", env, found.get) == {"LD_PRELOAD": "libjemalloc.so.2:/opt/mine.so"}


def test_named_allocator_found_in_the_environments_lib_folder(tmp_path):
    lib = tmp_path / "conda" / "lib"
    lib.mkdir(parents=True)
    (lib / "libjemalloc.so.2").write_bytes(b"")
    got = allocator.preload_environment("jemalloc", _env(tmp_path), lambda name: "libjemalloc.so.2")
    assert got == {"LD_PRELOAD": str(lib / "libjemalloc.so.2")}  # the environment's copy before the system's


def test_missing_allocator_names_the_package_and_the_path_option(tmp_path):
    with pytest.raises(ValueError) as info:
        allocator.preload_environment("tcmalloc", _env(tmp_path), _nothing)
    message = str(info.value)
    assert "apt install libtcmalloc-minimal4" in message and "--allocator /path/to/libtcmalloc_minimal.so" in message
    with pytest.raises(ValueError, match="apt install libjemalloc2"):
        allocator.preload_environment("jemalloc", _env(tmp_path), _nothing)


def test_paths_and_unknown_names(tmp_path):
    lib = tmp_path / "libmine.so"
    lib.write_bytes(b"")
    assert allocator.preload_environment(str(lib), _env(tmp_path), _nothing) == {"LD_PRELOAD": str(lib)}
    with pytest.raises(ValueError, match="no such file"):
        allocator.preload_environment(str(tmp_path / "absent.so"), _env(tmp_path), _nothing)
    with pytest.raises(ValueError, match="must be one of glibc, tcmalloc, jemalloc or the path"):
        allocator.preload_environment("mimalloc", _env(tmp_path), _nothing)


def test_launch_refuses_before_starting_anything(monkeypatch, capsys, tmp_path):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(allocator.ctypes.util, "find_library", _nothing)
    monkeypatch.setattr(launcher, "_run_accelerate", lambda args, env: pytest.fail("launched"))
    monkeypatch.delenv("CONDA_PREFIX", raising=False)
    monkeypatch.setenv("VIRTUAL_ENV", str(tmp_path / "venv"))
    assert launcher.launch(["--allocator", "jemalloc", "--no_estimate", "train.py"]) == 2
    assert "--allocator jemalloc: the library is not installed" in capsys.readouterr().err
