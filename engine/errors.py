"""Errors the engine declares, and the one vocabulary of error codes that crosses processes.

Each message names the field or value, the limit, and the fix. A message is for people; the
:class:`ErrorCode` is for programs: the wire carries it beside the message, and the gateway picks
the HTTP status and whether to retry from the code alone (no process parses another's text).
"""

from __future__ import annotations

import enum


class ErrorCode(enum.StrEnum):
    """Why a request, a frame or a stream failed. Values are wire values: add, never rename."""

    MALFORMED = "malformed"  # a message that does not match its schema (a bug, or a hostile peer)
    INPUT = "input"  # the request's own values: a token id outside the vocabulary, a bad parameter
    CONTEXT_LENGTH = "context_length"  # the prompt leaves no room in the context
    BUSY = "busy"  # every stream slot is taken and the queue is full: retry later
    QUEUE_TIMEOUT = "queue_timeout"  # the request waited for a slot longer than the queue allows
    NOT_READY = "not_ready"  # the pipeline is not whole (a stage not answering); nothing was started
    STAGE_LOST = "stage_lost"  # a stage stopped answering while the stream was in flight
    REPLAY_TIMEOUT = "replay_timeout"  # a stage was lost and the pipeline did not heal within its deadline
    CAPACITY = "capacity"  # a stage's KV slots or budget ran out for this stream
    UNAVAILABLE = "unavailable"  # a stage cannot compute (its tensor group is lost) until restarted
    INTERNAL = "internal"  # a bug: the stage or head failed where it should not have


class ModelfleetError(Exception):
    """Base of every error modelfleet raises on purpose."""

    code: ErrorCode = ErrorCode.INTERNAL


class CheckpointError(ModelfleetError):
    """A checkpoint directory or safetensors file is missing, corrupt or incomplete."""


class ConfigError(ModelfleetError):
    """config.json lacks a field, or holds a value the engine cannot serve."""


class CapacityError(ModelfleetError):
    """The KV budget, slots or context of a shard ran out."""

    code = ErrorCode.CAPACITY


class InputError(ModelfleetError):
    """A request's tokens or parameters are outside what the model accepts."""

    code = ErrorCode.INPUT
