"""Column value encoding round trips (pure logic)."""

from __future__ import annotations

from datetime import UTC, date, datetime
from decimal import Decimal

import pytest

from retina_common.codec import EncodingError, decode_column, encode_value, value_encoder


@pytest.mark.parametrize("type_name, values", [
    ("int64", [1, -2, 2**62, None, 0]),
    ("int32", [7, None, -7]),
    ("float64", [1.5, None, -0.25]),
    ("float32", [0.5, 2.0]),
    ("boolean", [True, False, None]),
    ("string", ["a", "", None, "ünïcode"]),
    ("binary", [b"\x00\xff", b"", None]),
    ("date32", [date(2026, 1, 2), None]),
    ("timestamp_us", [datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC), None]),
    ("decimal(12,2)", [Decimal("12.34"), Decimal("-0.05"), None]),
])
def test_round_trip(type_name: str, values: list) -> None:
    decoded = decode_column(type_name, [encode_value(type_name, v) for v in values]).to_pylist()
    assert decoded == values


def test_fast_path_without_nulls() -> None:
    values = list(range(-500, 500))
    assert decode_column("int64", [encode_value("int64", v) for v in values]).to_pylist() == values


@pytest.mark.parametrize("type_name, raw", [
    ("int64", [b"\x01\x02"]), ("boolean", [b"\x02"]), ("string", [b"no-prefix"]),
    ("string", [b"\x01\xff\xfe"]), ("int32", [b"\x00" * 4, b"\x00" * 3]),
])
def test_malformed_values_are_refused(type_name: str, raw: list[bytes]) -> None:
    with pytest.raises(EncodingError):
        decode_column(type_name, raw)


def test_an_unknown_column_type_is_refused_when_a_value_is_encoded() -> None:
    """Not when the encoder is looked up: writers resolve every column's encoder before
    they know which values are NULL, and a NULL of any type encodes to nothing."""
    encode = value_encoder("interval")
    with pytest.raises(EncodingError, match="unknown column type interval"):
        encode(5)
    assert encode_value("interval", None) == b""
    with pytest.raises(EncodingError, match="unknown column type interval"):
        encode_value("interval", 5)
