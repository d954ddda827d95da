"""Shared fixtures: valid raw configs per target (tests/helpers/configs.py), one copy per test."""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from tests.helpers.configs import BASE_AWS, BASE_BARE_METAL  # noqa: E402


@pytest.fixture
def aws_raw() -> dict:
    return copy.deepcopy(BASE_AWS)


@pytest.fixture
def bare_metal_raw() -> dict:
    return copy.deepcopy(BASE_BARE_METAL)
