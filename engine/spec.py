"""ModelSpec: the typed, validated view of a Hugging Face ``config.json``.

Only what every family shares lives in named fields; family-specific values are read from
``raw`` by the family's own module through :func:`ModelSpec.require`, so a missing field is
reported with its name and the family that needs it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import CheckpointError, ConfigError


@dataclass(frozen=True)
class RopeSpec:
    """Rotary embedding parameters, normalised from ``rope_parameters`` (transformers >= 5)
    or ``rope_theta`` + ``rope_scaling`` (older checkpoints)."""

    theta: float
    rope_type: str = "default"  # default | linear | yarn
    factor: float = 1.0
    original_max_position_embeddings: int | None = None
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True


@dataclass(frozen=True)
class ModelSpec:
    family: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    eos_token_ids: tuple[int, ...]
    bos_token_id: int | None
    rope: RopeSpec
    raw: dict[str, Any] = field(repr=False, compare=False, hash=False)

    def require(self, key: str) -> Any:
        if key not in self.raw or self.raw[key] is None:
            raise ConfigError(
                f"config.json of this {self.family} checkpoint lacks '{key}', which the {self.family} "
                f"family needs; add it (see the model's reference config)"
            )
        return self.raw[key]

    def get(self, key: str, default: Any = None) -> Any:
        value = self.raw.get(key)
        return default if value is None else value


def _rope_from_raw(raw: dict[str, Any]) -> RopeSpec:
    params = raw.get("rope_parameters") or {}
    if isinstance(params, dict) and isinstance(params.get("main"), dict):
        params = params["main"]  # rope keyed by kind (DeepSeek-V4: main, compress): the family reads the rest
    if not isinstance(params, dict) or any(isinstance(v, dict) for v in params.values()):
        raise ConfigError("config.json field 'rope_parameters' must be one flat object (per-layer rope is unsupported)")
    merged = {**(raw.get("rope_scaling") or {}), **params}
    theta = merged.get("rope_theta", raw.get("rope_theta", 10000.0))
    rope_type = merged.get("rope_type", merged.get("type", "default")) or "default"
    if rope_type not in ("default", "linear", "yarn"):
        raise ConfigError(f"rope type '{rope_type}' is not supported; supported: default, linear, yarn")
    return RopeSpec(
        theta=float(theta),
        rope_type=rope_type,
        factor=float(merged.get("factor") or 1.0),
        original_max_position_embeddings=merged.get("original_max_position_embeddings"),
        beta_fast=float(merged.get("beta_fast") or 32.0),
        beta_slow=float(merged.get("beta_slow") or 1.0),
        mscale=merged.get("mscale"),
        mscale_all_dim=merged.get("mscale_all_dim"),
        attention_factor=merged.get("attention_factor"),
        truncate=bool(merged.get("truncate", True)),
    )


def _int_field(raw: dict[str, Any], key: str, family: str) -> int:
    value = raw.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"config.json field '{key}' must be a positive integer for {family}, got {value!r}")
    return value


def spec_from_config(raw: dict[str, Any]) -> ModelSpec:
    from .models import FAMILIES, MODEL_TYPES, family_of
    from .models import family as family_module  # late import: families import this module

    family = family_of(raw.get("model_type"))
    if family not in FAMILIES:
        supported = sorted({*FAMILIES, *MODEL_TYPES})
        raise ConfigError(
            f"architecture model_type={raw.get('model_type')!r} is not supported; supported: {', '.join(supported)}"
        )
    assert isinstance(family, str)
    raw = getattr(family_module(family), "decoder_config", dict)(raw)
    hidden = _int_field(raw, "hidden_size", family)
    heads = _int_field(raw, "num_attention_heads", family)
    eos = raw.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    spec = ModelSpec(
        family=family,
        vocab_size=_int_field(raw, "vocab_size", family),
        hidden_size=hidden,
        num_layers=_int_field(raw, "num_hidden_layers", family),
        num_heads=heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=int(raw.get("head_dim") or hidden // heads),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        eos_token_ids=eos_ids,
        bos_token_id=raw.get("bos_token_id"),
        rope=_rope_from_raw(raw),
        raw=dict(raw),
    )
    family_module(family).validate(spec)
    return spec


def load_spec(model_dir: str | Path) -> ModelSpec:
    path = Path(model_dir)
    if not path.is_dir():
        raise CheckpointError(f"model directory {str(path)!r} does not exist; pass --model DIR with a checkpoint")
    config_path = path / "config.json"
    if not config_path.is_file():
        raise CheckpointError(f"{str(config_path)!r} is missing; a checkpoint directory needs a config.json")
    try:
        raw = json.loads(config_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"{str(config_path)!r} is not valid JSON: {exc}") from exc
    if not isinstance(raw, dict):
        raise CheckpointError(f"{str(config_path)!r} must hold a JSON object")
    return spec_from_config(raw)
