"""One mapping from a gRPC door's SamplingParams message to the engine's SamplingParams, for
both doors (minivllm.v1 and vLLM's engine contract): the messages name the same fields and
differ only in what an unset or zero field means and what the structured-output oneof is
called, which each door describes in a SamplingMessage."""
from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from types import MappingProxyType

from google.protobuf.message import Message

from engine import FieldError, SamplingParams, StructuredOutput

# The engine's fields a message may carry as they are (structured output and logit bias have
# shapes of their own on the wire).
_PLAIN_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams) if f.init) - {
    "structured_output", "logit_bias"}


def _empty() -> Mapping[str, object]:
    return MappingProxyType({})


@dataclasses.dataclass(frozen=True, slots=True)
class SamplingMessage:
    """How one door's SamplingParams message reads, beyond proto3's own rule (a field with
    presence counts when set, any other always)."""

    constraint: str  # the structured-output oneof
    # A field with presence left unset means this (else the engine's default).
    unset: Mapping[str, object] = dataclasses.field(default_factory=_empty)
    # A field without presence at zero means this (else zero).
    zero: Mapping[str, object] = dataclasses.field(default_factory=_empty)
    refused: frozenset[str] = frozenset()  # constraint kinds the engine does not serve
    # The door's names for the fields this mapping's own checks name (the engine's checks name
    # theirs as the engine does; the door renames those where it calls them otherwise).
    names: Mapping[str, str] = dataclasses.field(default_factory=_empty)


def sampling_params_from_message(msg: Message, how: SamplingMessage) -> SamplingParams:
    """Validated SamplingParams; a FieldError names the bad field."""
    kwargs: dict[str, object] = {}
    for field in msg.DESCRIPTOR.fields:
        name = field.name
        if name not in _PLAIN_FIELDS:
            continue
        if field.has_presence and not msg.HasField(name):
            if name in how.unset:
                kwargs[name] = how.unset[name]
            continue
        value = getattr(msg, name)
        if not field.has_presence and not value and name in how.zero:
            value = how.zero[name]
        kwargs[name] = list(value) if name in ("stop", "stop_token_ids") else value
    if msg.logit_bias:
        kwargs["logit_bias"] = dict(msg.logit_bias)
    kind = msg.WhichOneof(how.constraint)
    if kind in how.refused:
        raise FieldError(kind, "not supported by this engine").renamed(how.names)
    if kind == "choice":
        kwargs["structured_output"] = StructuredOutput.choice(list(msg.choice.choices))
    elif kind == "json_object":
        if msg.json_object:
            kwargs["structured_output"] = StructuredOutput("json_object")
    elif kind is not None:
        kwargs["structured_output"] = StructuredOutput(kind, getattr(msg, kind))
    try:
        return SamplingParams(**kwargs)
    except FieldError as exc:  # the engine's check, in this door's field names
        raise exc.renamed(how.names) from None
