"""Model families: how each architecture's checkpoint becomes decoder layers.

A family module exposes ``validate(spec)`` (raise ConfigError for missing or unsupported
fields) and ``build_layer(spec, layer_index, weights)`` returning a DecoderLayer whose
``attention`` has ``cache_shapes()`` and ``window``. Modules are imported on first use.
"""

from __future__ import annotations

import importlib
from types import ModuleType

FAMILIES: tuple[str, ...] = ("deepseek_v3", "gpt_oss", "mixtral", "qwen3_moe")


def family(name: str) -> ModuleType:
    if name not in FAMILIES:
        raise KeyError(name)
    return importlib.import_module(f"{__name__}.{name}")
