"""generate() through a PEFT wrapper at stage 3: the wrapper's generate enters the inner transformers model
directly, so the root unit must be gathered from there too ([Note: root entries] in stage3/hooks.py)."""

from tests.harness import run_ranks
from tests.unit import peft_generate_workers as W


def test_peft_generate_at_stage3_matches_unsharded():
    for r in run_ranks(2, W.peft_generate_worker, timeout=120):
        assert r["equal"] and r["unsharded"] == [], r
