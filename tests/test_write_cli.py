"""retina-write's own usage checks (no cluster: they refuse before connecting)."""

from __future__ import annotations

import pytest

from retina_common import exit_codes
from retina_common.write_cli import main


def test_a_lease_under_a_second_is_refused_before_anything_is_written(
        capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["--writer", "w", "shop.events", "--rows", "[]", "--lease-ms", "10"])
    assert code == exit_codes.USAGE
    assert "--lease-ms 10: at least 1000" in capsys.readouterr().err
