"""Fixtures shared by the integration modules."""

import pytest

from tests.integrations.trl_runs import TrlStageRuns


@pytest.fixture(scope="session")
def trl_stage_runs(tmp_path_factory) -> TrlStageRuns:
    """``scripts/trl_stages.py`` per setting, launched once for ``test_trl_stages.py`` and ``test_trl_dpo.py``."""
    return TrlStageRuns(tmp_path_factory)
