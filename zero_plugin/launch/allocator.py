"""The host memory allocator of the processes ``zero-plugin launch`` starts: ``--allocator``.

[Note: host allocator]
On the CPU every tensor's memory comes from the C allocator (glibc's ``malloc`` unless another is preloaded).
glibc keeps freed blocks in its heaps and reuses them by size, so a training step whose buffers are freed
and allocated in a changing order leaves the heap holding far more than the live bytes: measured on
``blocks34m`` (33.7M parameters, 2 ranks), tuned DDP's peak RSS increase is ~1090 MiB for ~700 MiB live, and
stage 3 must trim the heap every forward ([Note: heap trimming] in ``engines/hostmem.py``), which costs page
faults, to hold ~700 MiB for ~420 MiB live. tcmalloc and jemalloc keep their free memory in size classes and
waste less of it (``benchmarks/results/49-allocators-*``, 2 ranks):

  * tcmalloc (gperftools' minimal build): stage 3 at 33.7M holds 608-610 MiB with no page faults, 0.59-0.60x
    the peak of tuned DDP on glibc in the same run at 1.04x its step; at 117M 0.54x at 0.97x. DDP gains too
    (883 against 1010-1025 MiB at 33.7M): against DDP on tcmalloc stage 3 holds 0.69x at 1.07x its step;
  * jemalloc (with its default ``MALLOC_CONF``): as little memory as tcmalloc, but it hands freed pages back to
    the kernel on a timer (its dirty-page decay) and faults them in again, ~85k faults per step at 33.7M.

An allocator has to be chosen before the interpreter starts (``LD_PRELOAD``): a library already running
cannot change it, which is why this is the launcher's option and not a ``ZeroConfig`` field. The children of
``accelerate launch`` / torchrun inherit the variable, so ``--allocator`` is ``LD_PRELOAD=<library>`` (before
any the user set) for every rank; the launcher itself keeps glibc. Users of another launcher set the variable
themselves (``docs/tuning.md``). Stage 3 then neither trims glibc's heap nor pools unit storages
(``engines/hostmem.malloc_preloaded``).
"""

from __future__ import annotations

import ctypes.util
import glob
import os
import sys
from collections.abc import Callable, Mapping

__all__ = ["ALLOCATORS", "preload_environment"]

# --allocator NAME -> the library names ctypes.util.find_library knows it by, most capable first
ALLOCATORS: dict[str, tuple[str, ...]] = {
    "tcmalloc": ("tcmalloc_minimal", "tcmalloc"),
    "jemalloc": ("jemalloc",),
}
_PACKAGES = {
    "tcmalloc": "apt install libtcmalloc-minimal4 (Debian/Ubuntu), dnf install gperftools-libs (Fedora), "
    "conda install -c conda-forge gperftools",
    "jemalloc": "apt install libjemalloc2 (Debian/Ubuntu), dnf install jemalloc (Fedora), "
    "conda install -c conda-forge jemalloc",
}
DEFAULT = "glibc"


def _prefix_dirs(environ: Mapping[str, str]) -> list[str]:
    """Library folders of the Python environment, where conda and pip-installed copies land (ldconfig does not
    know them)."""
    roots = [environ.get("CONDA_PREFIX"), environ.get("VIRTUAL_ENV"), sys.prefix]
    return [os.path.join(root, "lib") for root in roots if root]


def find_allocator(name: str, environ: Mapping[str, str], find: Callable[[str], str | None]) -> str | None:
    """The library to preload for ``--allocator name`` (a soname the dynamic loader finds, or a path), or None."""
    for lib in ALLOCATORS[name]:
        for folder in _prefix_dirs(environ):
            hits = sorted(glob.glob(os.path.join(folder, f"lib{lib}.so*")))
            if hits:
                return hits[0]
        found = find(lib)
        if found:
            return found
    return None


def preload_environment(
    choice: str, environ: Mapping[str, str], find: Callable[[str], str | None] | None = None
) -> dict[str, str]:
    """The variables that make the ranks use ``choice`` ([Note: host allocator]): ``glibc`` (nothing), ``tcmalloc``,
    ``jemalloc``, or a path to an allocator's shared library. ValueError, naming the fix, where it cannot be had.
    ``find``: how a library name is looked up in the loader's cache (``ctypes.util.find_library``)."""
    if choice == DEFAULT:
        return {}
    if not sys.platform.startswith("linux"):
        raise ValueError(f"--allocator {choice}: preloading an allocator needs Linux (LD_PRELOAD); drop the option")
    if os.sep in choice:
        if not os.path.isfile(choice):
            raise ValueError(f"--allocator {choice}: no such file; give the path of the allocator's shared library")
        library = os.path.abspath(choice)
    elif choice in ALLOCATORS:
        library = find_allocator(choice, environ, find or ctypes.util.find_library)
        if library is None:
            raise ValueError(
                f"--allocator {choice}: the library is not installed ({_PACKAGES[choice]}); or give its path "
                f"(--allocator /path/to/lib{ALLOCATORS[choice][0]}.so), or drop the option to keep glibc's"
            )
    else:
        names = ", ".join([DEFAULT, *ALLOCATORS])
        raise ValueError(f"--allocator must be one of {names} or the path of a shared library; got {choice!r}")
    existing = environ.get("LD_PRELOAD", "").strip()
    return {"LD_PRELOAD": f"{library}:{existing}" if existing else library}
