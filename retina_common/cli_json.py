"""One JSON shape for a protobuf answer, in every CLI (``retina-admin``, ``retina-gc``).

``google.protobuf.json_format.MessageToDict`` is not used: it writes int64 fields as
strings and leaves out every field at its default (``virtual_node_id`` 0, an empty
list, ``false``), so one record would have a different set of keys depending on its
values, and a node with nothing to report would print ``{}``. A script reading our
JSON must find every field of a record, with numbers as numbers.
"""

from __future__ import annotations

from typing import Any

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message


def message_dict(message: Message) -> dict[str, Any]:
    """Every field of ``message`` by its proto name, defaults included; integers as
    integers, enums by name, nested messages and maps likewise."""
    out: dict[str, Any] = {}
    for f in message.DESCRIPTOR.fields:
        value = getattr(message, f.name)
        if f.message_type is not None and f.message_type.GetOptions().map_entry:
            out[f.name] = {k: _value(f, v) for k, v in sorted(value.items())}
        elif f.is_repeated:
            out[f.name] = [_value(f, v) for v in value]
        else:
            out[f.name] = _value(f, value)
    return out


def _value(f: FieldDescriptor, value: Any) -> Any:
    if isinstance(value, Message):
        return message_dict(value)
    if f.enum_type is not None and isinstance(value, int):
        return f.enum_type.values_by_number[value].name
    return value
