"""Shared fixtures: the real Wikipedia lengths (skipped with a clear message when absent)."""

from __future__ import annotations

import gzip
import os
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, settings

# make test draws the same examples on every run (derandomize), so CI judges a commit, not a draw; the random
# search runs with HYPOTHESIS_PROFILE=explore (the same budget, fresh draws) or thorough (500 examples)
settings.register_profile("ci", max_examples=40, deadline=None, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("explore", max_examples=40, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("thorough", max_examples=500, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

REPO = Path(__file__).resolve().parents[1]
WIKI = REPO / "data" / "wikipedia_lengths.txt.gz"


def wikipedia_path() -> Path | None:
    env = os.environ.get("BALANCED_LOADER_WIKIPEDIA")
    p = Path(env) if env else WIKI
    return p if p.exists() else None


@pytest.fixture(scope="session")
def wiki_lengths() -> np.ndarray:
    """[1_000_000] token lengths of Wikipedia docs bundled in data/ (FlexSP, Apache-2.0)."""
    p = wikipedia_path()
    if p is None:
        pytest.skip(f"Wikipedia lengths not found at {WIKI} (set BALANCED_LOADER_WIKIPEDIA)")
    with gzip.open(p) as f:
        return np.loadtxt(f, dtype=np.int64)
