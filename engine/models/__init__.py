"""Model families: how each architecture's checkpoint becomes decoder layers, and what each
layer caches.

A family module exposes ``validate(spec)`` (raise ConfigError for missing or unsupported
fields), ``build_layer(spec, layer_index, weights)`` returning a DecoderLayer, and
``cache_layout(spec, layer_index)`` returning the layer's
:class:`~modelfleet.engine.cache_layout.LayerCache` (asked through
:func:`modelfleet.engine.cache_layout.cache_layout`). Optionally: ``decoder_config(raw)`` (the
decoder's fields of a config that nests them), ``tensor_source(spec, source)`` (a view of a
checkpoint in the family's own layout under the names ``build_layer`` reads),
``adapt_shard(spec, shard, weights)`` (the parts around the layers the family changes: an
embedding norm, a scaled or cut head) and ``published_tensors(spec)`` (every tensor of the
checkpoint the family publishes, with its dtype and shape, for a summary of a config-only
directory). Modules are imported on first use; this module imports
neither torch nor a family.
"""

from __future__ import annotations

import importlib
from types import ModuleType

FAMILIES: tuple[str, ...] = ("deepseek_v3", "deepseek_v4", "gpt_oss", "inkling", "mixtral", "qwen3_moe")
# config.json model_type -> family, where the two differ (a family serving several model types)
MODEL_TYPES: dict[str, str] = {"inkling_text": "inkling", "inkling_mm_model": "inkling"}


def family_of(model_type: object) -> object:
    """The family serving checkpoints of ``model_type`` (itself unless :data:`MODEL_TYPES` maps it)."""
    return MODEL_TYPES.get(model_type, model_type) if isinstance(model_type, str) else model_type


def family(name: str) -> ModuleType:
    if name not in FAMILIES:
        raise KeyError(name)
    return importlib.import_module(f"{__name__}.{name}")
