"""Every Python mirror of a proto type has each of its fields and enum values (walks the proto descriptor).

Adding a field or an enum value to ``proto/primerl/v1/primerl.proto`` without its Python mirror fails here,
naming the proto field and the mirror that lacks it.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Iterable

import pytest
from google.protobuf.descriptor import EnumDescriptor

import grpo.masks
import rl_client.types
from core import types
from proto.primerl.v1 import primerl_pb2 as pb


def _enum_names(descriptor: EnumDescriptor) -> dict[int, str]:
    """Value -> short lower-case name (``TOKEN_ORIGIN_DRAFT_ACCEPTED`` -> ``draft_accepted``)."""
    prefix = descriptor.values[0].name.removesuffix("UNSPECIFIED")
    return {v.number: v.name.removeprefix(prefix).lower() for v in descriptor.values}


def _missing(wanted: Iterable[str], have: Iterable[str]) -> list[str]:
    return sorted(set(wanted) - set(have))


def test_sampling_fields_are_mirrored_both_ways() -> None:
    proto = [f.name for f in pb.SamplingParams.DESCRIPTOR.fields]
    python = list(types.SAMPLING_FIELDS)
    assert not _missing(proto, python), (
        f"proto SamplingParams fields {_missing(proto, python)} lack a field in core.types.SamplingParams"
    )
    assert not _missing(python, proto), (
        f"core.types.SamplingParams fields {_missing(python, proto)} lack a field in proto SamplingParams"
    )
    # The client sends the same type, converted by name.
    assert rl_client.types.Sampling is types.SamplingOverrides
    for f in pb.SamplingParams.DESCRIPTOR.fields:  # every scalar can be set independently (presence)
        assert f.has_presence or f.is_repeated, f"SamplingParams.{f.name} must be `optional`"


@pytest.mark.parametrize(
    ("descriptor", "python_enum"),
    [(pb.TokenOrigin.DESCRIPTOR, types.Origin), (pb.FinishReason.DESCRIPTOR, types.FinishReason)],
)
def test_engine_enums_have_every_proto_value(descriptor: EnumDescriptor, python_enum: type[enum.IntEnum]) -> None:
    names = _enum_names(descriptor)
    for number, name in names.items():
        if number == 0:
            continue  # UNSPECIFIED: never produced by the bridge
        member = python_enum.__members__.get(name.upper())
        assert member is not None, f"{descriptor.full_name} value {name!r} ({number}) lacks a {python_enum.__name__}"
        assert member.value == number, f"{python_enum.__name__}.{member.name} = {member.value}, proto says {number}"
    extra = {m.name.lower() for m in python_enum} - set(names.values())
    assert not extra, f"{python_enum.__name__} has {sorted(extra)}, which {descriptor.full_name} lacks"


@pytest.mark.parametrize(
    ("descriptor", "names", "where"),
    [
        (pb.TokenOrigin.DESCRIPTOR, rl_client.types.ORIGINS, "rl_client.types.ORIGINS"),
        (pb.TokenOrigin.DESCRIPTOR, grpo.masks.ORIGIN_NAMES, "grpo.masks.ORIGIN_NAMES"),
        (pb.FinishReason.DESCRIPTOR, rl_client.types.FINISH_REASONS, "rl_client.types.FINISH_REASONS"),
    ],
)
def test_name_tables_are_indexed_by_proto_value(descriptor: EnumDescriptor, names: tuple[str, ...], where: str) -> None:
    want = _enum_names(descriptor)
    got = dict(enumerate(names))
    assert got == want, f"{where} is {names}; the proto's values are {want}"


@pytest.mark.parametrize("mirror", [types.Usage, rl_client.types.Usage])
def test_usage_mirrors_have_every_proto_field(mirror: type) -> None:
    proto = [f.name for f in pb.Usage.DESCRIPTOR.fields]
    python = [f.name for f in dataclasses.fields(mirror)]
    assert python == proto, f"{mirror.__module__}.Usage has {python}; proto Usage has {proto}"
