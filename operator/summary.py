"""ModelSummary: what the operator's planner needs to know about a checkpoint, as plain JSON.

The operator never opens a checkpoint: an inspection Job (or the user, or ``modelfleet render
--model-summary``) writes this summary into the ConfigMap ``<fleet>-model-summary`` under the key
``summary.json``. Sizes are bytes at the compute ``dtype``; ``kv_entries`` lists, per layer, what
one stream keeps (engine.cache_layout's entries: bytes a row, the window, positions a row), so the
operator sizes KV with the same arithmetic as the shard that allocates it.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError, model_validator

from modelfleet.plan import ComputeDtype, Formats, PlanError, _describe
from modelfleet.planner import LayerBytes, TensorIndex, dtype_itemsize, layer_bytes_of

if TYPE_CHECKING:
    from modelfleet.engine.spec import ModelSpec

SUMMARY_KEY = "summary.json"
NonNegativeInt = Annotated[StrictInt, Field(ge=0)]
PositiveInt = Annotated[StrictInt, Field(ge=1)]


class KVEntry(BaseModel):
    """One state entry of a layer for one stream (engine.cache_layout.CacheEntry, in bytes):
    ``bytes_per_row`` at the compute dtype, a row per ``stride`` positions, over the last
    ``window`` positions (plus the rewind slack) or every position (``window`` None)."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    bytes_per_row: NonNegativeInt
    window: PositiveInt | None = None
    stride: PositiveInt = 1


def summary_config_map_name(fleet: str) -> str:
    return f"{fleet}-model-summary"


class ModelSummary(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")

    family: StrictStr = Field(min_length=1)
    num_layers: Annotated[StrictInt, Field(ge=1)]
    dtype: ComputeDtype = "bfloat16"
    layer_bytes: tuple[NonNegativeInt, ...]
    embed_bytes: NonNegativeInt
    norm_bytes: NonNegativeInt
    head_matrix_bytes: NonNegativeInt
    tied: StrictBool = False
    kv_entries: tuple[tuple[KVEntry, ...], ...]
    # bytes of the plain float matrices a weight format would hold, by "role/format", per layer
    # and for the embedding table and an untied head (planner.LayerBytes); empty in summaries of
    # packed checkpoints
    layer_role_bytes: tuple[dict[StrictStr, NonNegativeInt], ...] = ()
    outer_role_bytes: dict[StrictStr, NonNegativeInt] = Field(default_factory=dict)
    # what the planner refuses with (planner.tensor_refusal, planner.context_length_for); absent in
    # summaries written before they were recorded, which are then not checked for them
    max_position_embeddings: PositiveInt | None = None
    tensor_split: dict[StrictStr, PositiveInt] = Field(default_factory=dict)  # config field: count ranks divide

    @model_validator(mode="after")
    def _check_lengths(self) -> ModelSummary:
        for name in ("layer_bytes", "kv_entries", "layer_role_bytes"):
            values = getattr(self, name)
            if values is not None and values != () and len(values) != self.num_layers:
                raise ValueError(f"{name} has {len(values)} entries for num_layers={self.num_layers}")
        return self

    def sizes(self, formats: Formats | None = None) -> LayerBytes:
        """Weight bytes as stored in the compute dtype, or as held once ``formats`` apply at load."""
        return LayerBytes(
            self.layer_bytes, self.embed_bytes, self.norm_bytes, self.head_matrix_bytes, self.tied,
            self.layer_role_bytes, self.outer_role_bytes,
        ).in_formats(formats)  # fmt: skip

    def kv_bytes(self, streams: int, context_length: int) -> list[int]:
        """KV bytes each layer reserves for ``streams`` streams of ``context_length`` positions."""
        from modelfleet.engine.cache_layout import rows_kept

        return [
            streams * sum(rows_kept(context_length, e.window, e.stride) * e.bytes_per_row for e in entries)
            for entries in self.kv_entries
        ]

    @classmethod
    def from_json(cls, text: str | bytes) -> ModelSummary:
        try:
            return cls.model_validate_json(text)
        except ValidationError as exc:
            raise PlanError(f"invalid model summary: {_describe(exc)}") from exc


def inspect_checkpoint(model: str | Path, dtype: str = "bfloat16") -> ModelSummary:
    """The summary of a checkpoint, from config.json and safetensors headers only: a local
    directory, or ``hf://ORG/NAME[@REV]`` read over HTTP Range requests (no tensor bytes). A
    directory holding only config.json is counted from the shapes its family lists, where the
    family lists them."""
    from modelfleet.engine.hub import RemoteCheckpoint, is_hub_uri
    from modelfleet.engine.spec import load_spec, spec_from_config

    if is_hub_uri(model):
        remote = RemoteCheckpoint(str(model))
        return _summarise(spec_from_config(remote.config), remote, dtype)
    spec = load_spec(model)
    return _summarise(spec, _tensor_index(spec, Path(model)), dtype)


def _tensor_index(spec: ModelSpec, directory: Path) -> TensorIndex:
    """The directory's safetensors headers; a directory holding only config.json stands for the
    checkpoint its family publishes, where the family lists that checkpoint's tensors
    (``published_tensors``: names, dtypes and shapes), so the real model is planned from its
    config alone."""
    from modelfleet.engine.checkpoint import Checkpoint, ListedTensors
    from modelfleet.engine.models import family

    has_weights = any(directory.glob("*.safetensors")) or (directory / "model.safetensors.index.json").is_file()
    published = getattr(family(spec.family), "published_tensors", None)
    if has_weights or published is None:
        return Checkpoint(directory)
    return ListedTensors(published(spec), directory / "config.json")


def _summarise(spec: ModelSpec, checkpoint: TensorIndex, dtype: str) -> ModelSummary:
    from modelfleet.engine.cache_layout import cache_layouts
    from modelfleet.engine.tensor_parallel import tensor_split_fields

    sizes = layer_bytes_of(spec, checkpoint, dtype)
    itemsize = dtype_itemsize(dtype)
    kv_entries = tuple(
        tuple(KVEntry(bytes_per_row=e.values_per_row * itemsize, window=e.window, stride=e.stride)
              for e in layout.entries.values())
        for layout in cache_layouts(spec)
    )  # fmt: skip
    return ModelSummary(
        family=spec.family, num_layers=spec.num_layers, dtype=dtype, layer_bytes=sizes.per_layer,  # type: ignore[arg-type]
        embed_bytes=sizes.embed_bytes, norm_bytes=sizes.norm_bytes, head_matrix_bytes=sizes.head_matrix_bytes,
        tied=sizes.tied, kv_entries=kv_entries,
        layer_role_bytes=tuple(dict(t) for t in sizes.role_bytes), outer_role_bytes=dict(sizes.outer_role_bytes),
        max_position_embeddings=spec.max_position_embeddings, tensor_split=dict(tensor_split_fields(spec)),
    )  # fmt: skip
