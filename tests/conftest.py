"""Shared pytest setup: repo root importable, worker pools closed at session end."""

import os
import sys

import pytest

_REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO_ROOT not in sys.path:
    sys.path.insert(0, _REPO_ROOT)

from tests.harness import close_all_pools  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def _close_worker_pools():
    yield
    close_all_pools()
