"""Errors the engine declares. Each message names the field or value, the limit, and the fix."""


class ModelfleetError(Exception):
    """Base of every error modelfleet raises on purpose."""


class CheckpointError(ModelfleetError):
    """A checkpoint directory or safetensors file is missing, corrupt or incomplete."""


class ConfigError(ModelfleetError):
    """config.json lacks a field, or holds a value the engine cannot serve."""


class CapacityError(ModelfleetError):
    """The KV budget, slots or context of a shard ran out."""


class InputError(ModelfleetError):
    """A request's tokens or parameters are outside what the model accepts."""
