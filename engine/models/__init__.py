"""Model families: how each architecture's checkpoint becomes decoder layers, and what each
layer caches.

A family module exposes ``validate(spec)`` (raise ConfigError for missing or unsupported
fields), ``build_layer(spec, layer_index, weights)`` returning a DecoderLayer, and
``cache_layout(spec, layer_index)`` returning the layer's
:class:`~modelfleet.engine.cache_layout.LayerCache` (asked through
:func:`modelfleet.engine.cache_layout.cache_layout`). Modules are imported on first use; this
module imports neither torch nor a family.

A family may also answer, where it differs from the rest (DeepSeek-V4 does):
``residual_shape(spec)`` (one row of the residual between stages, asked through
:func:`modelfleet.engine.residual.residual_shape`), ``residual_entry(spec)`` and
``residual_exit(spec, weights)`` (modules the first shard applies after the embedding and the last
before the final norm), ``tensor_source(spec, source)`` (the checkpoint read under the names the
family's builders use), ``tensor_split_fields(spec)`` (what tensor parallelism must divide), and
``published_index(spec, where)`` (the tensors of the checkpoint a config-only directory stands for).
"""

from __future__ import annotations

import importlib
from types import ModuleType

FAMILIES: tuple[str, ...] = ("deepseek_v3", "deepseek_v4", "gpt_oss", "mixtral", "qwen3_moe")


def family(name: str) -> ModuleType:
    if name not in FAMILIES:
        raise KeyError(name)
    return importlib.import_module(f"{__name__}.{name}")
