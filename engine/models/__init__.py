"""Model families: how each architecture's checkpoint becomes decoder layers, and what each
layer caches.

A family module exposes ``validate(spec)`` (raise ConfigError for missing or unsupported
fields), ``build_layer(spec, layer_index, weights)`` returning a DecoderLayer, and
``cache_layout(spec, layer_index)`` returning the layer's
:class:`~modelfleet.engine.cache_layout.LayerCache` (asked through
:func:`modelfleet.engine.cache_layout.cache_layout`). Modules are imported on first use; this
module imports neither torch nor a family.

A family may also answer, where it differs from the rest: ``decoder_config(raw)`` (the decoder's
fields of a config that nests them: Inkling's multimodal one), ``residual_shape(spec)`` (one row of
the residual between stages, asked through :func:`modelfleet.engine.residual.residual_shape`),
``residual_entry(spec)`` and ``residual_exit(spec, weights)`` (modules the first shard applies
after the embedding and the last before the final norm: DeepSeek-V4's hyper-connections),
``adapt_shard(spec, shard, weights)`` (the parts around the layers it changes: Inkling's embedding
norm, its scaled and cut head), ``tensor_source(spec, source)`` (the checkpoint read under the
names the family's builders use), ``tensor_split_fields(spec)`` (what tensor parallelism must
divide) and ``published_tensors(spec)`` (every tensor of the checkpoint the family publishes, with
its dtype and shape: what a config-only directory stands for when it is inspected).
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
