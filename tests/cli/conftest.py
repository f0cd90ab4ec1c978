"""What the command-line tests share: a tiny checkpoint made by `make-model`, and a random trace."""

from __future__ import annotations

import pytest

from moepager.cli.main import main
from tests.trace.conftest import random_trace


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    out = tmp_path_factory.mktemp("cli") / "tiny"
    assert main(["make-model", "--arch", "qwen3_moe", "--preset", "tiny", "--out", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    return random_trace(tmp_path_factory.mktemp("cli_trace") / "t.mpt")
