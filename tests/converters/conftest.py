"""Fixtures of the converter tests."""

from __future__ import annotations

from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def hf_unified(fixture_unified) -> Path:
    """The qwen4_exp HF fixture converted once per session (tests/conftest.py's fixture_unified)."""
    return fixture_unified("qwen4_exp")
