"""Model families: how each architecture's checkpoint becomes decoder layers.

A family module exposes ``validate(spec)`` (raise ConfigError for missing or unsupported
fields) and ``build_layer(spec, layer_index, weights)`` returning a DecoderLayer whose
``attention`` has ``cache_shapes()`` and ``window``.
"""

from __future__ import annotations

from types import ModuleType

from . import deepseek_v3, gpt_oss, mixtral, qwen3_moe

FAMILIES: dict[str, ModuleType] = {
    "qwen3_moe": qwen3_moe,
    "mixtral": mixtral,
    "deepseek_v3": deepseek_v3,
    "gpt_oss": gpt_oss,
}
