"""Column value encoding round trips (pure logic)."""

from __future__ import annotations

from datetime import UTC, date, datetime
from decimal import Decimal

import pytest

from retina_common.codec import (
    EncodingError,
    decode_column,
    encode_primary_key,
    encode_value,
    primary_key_problem,
    value_encoder,
)


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
    ("int64", [b"\x01\x02"]), ("boolean", [b"\x02"]), ("boolean", [b"\x02", b""]),
    ("string", [b"no-prefix"]),
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


def test_primary_key_problems_name_the_first_malformed_key() -> None:
    """LookupRows refuses a key that is not the encoding of one value per key column (its
    arity, each value's length and marker), naming the first one; well-formed keys of rows
    that do not exist are not problems. Fixed-width keys are checked a batch at a time."""
    ints = ["int32", "int64"]
    good = [encode_primary_key(ints, [i, i * 10]) for i in range(50)]
    assert primary_key_problem(ints, good) is None
    assert primary_key_problem(ints, []) is None
    swapped = encode_primary_key(["int64", "int32"], [1, 2])  # the same length, other widths
    assert primary_key_problem(ints, [*good, swapped]) == (
        50, "key column 0 (int32) holds 8 bytes, not 4")
    assert primary_key_problem(ints, [good[0], good[1] + b"x"]) == (
        1, "1 bytes follow its 2 key columns")
    assert primary_key_problem(ints, [good[0][:6]]) == (0, "key column 0 claims 4 bytes; "
                                                           "2 are left")
    mixed = ["int32", "string"]
    assert primary_key_problem(mixed, [encode_primary_key(mixed, [1, ""])]) is None
    assert primary_key_problem(mixed, [encode_primary_key(["int32"], [1])]) == (
        0, "it ends after 1 of 2 key columns")
    raw = encode_primary_key(["int32", "binary"], [1, b"x"])
    assert primary_key_problem(mixed, [raw]) is None  # string and binary share a shape
    no_marker = raw[:12] + b"\x02x"  # the value without its 0x01 marker
    assert primary_key_problem(mixed, [no_marker]) == (0, "key column 1 (string) lacks its "
                                                          "0x01 marker")


def test_a_value_no_column_can_hold_is_refused_promptly_with_an_encoding_error() -> None:
    """Only EncodingError, whatever the value (the connector stops on it and names the
    event; any other error would restart it on the same event forever), and at once:
    a decimal of a huge negative exponent once built ``10**100000000`` first."""
    with pytest.raises(EncodingError, match="does not fit a float64"):
        encode_value("float64", Decimal("sNaN"))
    with pytest.raises(EncodingError, match="more than 2 fractional digits"):
        encode_value("decimal(10,2)", Decimal("1e-100000000"))  # a hang: the suite's timeout
    # Trailing zeros below the scale are still exact.
    assert encode_value("decimal(10,2)", Decimal("1000e-5")) == \
        encode_value("decimal(10,2)", Decimal("0.01"))
