"""The fleet plan: the one JSON document every modelfleet process reads.

The operator's planner writes it into a ConfigMap, ``modelfleet up`` writes it for local
processes, and agents load it at start. It lives in the top-level package so that the operator
and the agent import one definition (this module imports neither torch nor Kubernetes).

Invariants, checked when a plan is built (from Python or from JSON):
- every group's stages are listed in order, ``stage_index`` runs 0, 1, 2, ...;
- stage layer ranges are half-open ``[layer_start, layer_end)``, contiguous, non-empty, and
  together cover ``[0, model.num_layers)`` exactly;
- ``group_index`` runs 0, 1, 2, ... in list order.

Field names are the names used everywhere (CRD fields, ``MF_*`` variables, labels, metrics).
A **group** is one pipeline replica (``groups``, ``group_index``); a **microbatch** is one of the
sets of streams whose frames a head keeps in flight separately (``serving.microbatches``).
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationError,
    field_validator,
    model_validator,
)

from .engine.errors import InputError, ModelfleetError
from .engine.expert_placement import DEFAULT_EXPERT_PREFETCH, ExpertPrefetch
from .engine.format_names import ROLE_FORMATS
from .engine.speculative.config import SpeculativeConfig

PLAN_VERSION: Literal[1] = 1
# A stage's ports from its address's port: frames, HTTP (+1), clients (+2, stage 0), the tensor
# rendezvous (+3, tp_size > 1); tensor ranks sharing rank 0's host add one HTTP port each.
PORTS_PER_STAGE = 4

# The engine's format vocabulary (engine.format_names: names only, no torch), as JSON-schema enums:
# every format, and those a matmul role (attention, head) takes.
if TYPE_CHECKING:
    WeightFormat = str
    MatmulFormat = str
else:
    WeightFormat, MatmulFormat = Literal[ROLE_FORMATS["experts"]], Literal[ROLE_FORMATS["attention"]]
ComputeDtype = Literal["float32", "bfloat16", "float16"]
# what executes a stage's layers: torch (CPU or CUDA devices); openvino (CPUs and Intel GPUs)
StageBackendName = Literal["torch", "openvino"]
# host:port, where host is a DNS name, an IPv4 address or a bracketed IPv6 address.
ADDRESS_PATTERN = r"^([A-Za-z0-9]([A-Za-z0-9.\-]*[A-Za-z0-9])?|\[[0-9A-Fa-f:.]+\]):[0-9]{1,5}$"
# torch devices (cpu, cuda, cuda:N) and OpenVINO devices (GPU, GPU.N, NPU).
DEVICE_PATTERN = r"^(cpu|cuda(:[0-9]+)?|GPU(\.[0-9]+)?|NPU)$"

# Scalars are strict (no "5" for 5, no true for 1); lists and nested objects are accepted as usual.
NonNegativeInt = Annotated[StrictInt, Field(ge=0)]
PositiveInt = Annotated[StrictInt, Field(ge=1)]


# mypy names the engine by its folder ("engine"), so it cannot follow "modelfleet.engine" here and sees Any
class PlanError(ModelfleetError, ValueError):  # type: ignore[misc]
    """A fleet plan is invalid; the message names the field (``groups[0].stages[1].layer_start``)."""


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class Formats(_Frozen):
    """On-device weight format of each kind of tensor (experts are typically 4-bit, the rest 8-bit)."""

    experts: WeightFormat = "bf16"
    attention: MatmulFormat = "bf16"
    head: MatmulFormat = "bf16"
    embeddings: WeightFormat = "bf16"


class ModelRef(_Frozen):
    path: StrictStr = Field(min_length=1, description="checkpoint directory, or a URI such as hf://org/name")
    served_name: StrictStr = Field(min_length=1, max_length=256, pattern=r"^[A-Za-z0-9][A-Za-z0-9._:/\-]*$")
    family: StrictStr = Field(min_length=1)
    num_layers: PositiveInt
    dtype: ComputeDtype = "bfloat16"
    formats: Formats = Formats()


class StagePlan(_Frozen):
    """One stage: its layers, what executes them, and where it listens.

    ``address`` is host:port of its frame socket; every other port of the stage is derived here
    and only here (:attr:`http_port`, :attr:`client_port`, :attr:`rendezvous_port`,
    :meth:`rank_http_port`): HTTP (/healthz, /readyz, /status, /metrics) on port + 1 and, at
    stage 0, the client protocol on port + 2. With ``tp_size`` > 1 the stage is that many
    processes: rank 0 at ``address`` serves all of the above and hosts the tensor group's
    rendezvous (torch.distributed, tcp://host:port + 3); every rank r > 0 serves only its own
    HTTP, on port + 1 of its own host (its pod), or on port + 3 + r when ranks share one machine
    (``modelfleet up --tensor``). A stage uses the ports [port, port + :meth:`port_span`)."""

    stage_index: NonNegativeInt
    layer_start: NonNegativeInt
    layer_end: PositiveInt = Field(description="exclusive")
    tp_size: PositiveInt = 1
    backend: StageBackendName = "torch"
    address: StrictStr = Field(description="host:port of the stage's rank 0")
    device: StrictStr = "cpu"
    numa_node: NonNegativeInt | None = None
    weights_bytes: NonNegativeInt = 0
    kv_budget_bytes: NonNegativeInt = 0

    @field_validator("address")
    @classmethod
    def _check_address(cls, address: str) -> str:
        match = re.match(ADDRESS_PATTERN, address)
        if match is None or not 1 <= int(address.rsplit(":", 1)[1]) <= 65535:
            raise ValueError(f"{address!r} must be host:port, port in [1, 65535], e.g. 'stage-0.fleet:5555'")
        return address

    @field_validator("device")
    @classmethod
    def _check_device(cls, device: str) -> str:
        if re.match(DEVICE_PATTERN, device) is None:
            raise ValueError(f"{device!r} is not a device: cpu, cuda[:N] (torch), GPU[.N], NPU (OpenVINO)")
        return device

    @property
    def num_layers(self) -> int:
        return self.layer_end - self.layer_start

    @property
    def host(self) -> str:
        return self.address.rsplit(":", 1)[0]

    @property
    def port(self) -> int:
        """The frame socket's port."""
        return int(self.address.rsplit(":", 1)[1])

    @property
    def http_port(self) -> int:
        """/healthz, /readyz, /status and /metrics of rank 0 (and of every rank on its own host)."""
        return self.port + 1

    @property
    def client_port(self) -> int:
        """The head's client protocol (submit, cancel, output); stage 0 only."""
        return self.port + 2

    @property
    def rendezvous_port(self) -> int:
        """The tensor group's torch.distributed rendezvous at rank 0's host (tp_size > 1)."""
        return self.port + 3

    def rank_http_port(self, tp_rank: int, shared_host: bool) -> int:
        """Where tensor rank ``tp_rank`` serves HTTP: port + 1 on a host of its own, port + 3 + r
        when the group's ranks share rank 0's host."""
        return self.http_port if tp_rank == 0 or not shared_host else self.rendezvous_port + tp_rank

    def port_span(self, shared_host: bool = True) -> int:
        """How many consecutive ports from :attr:`port` the stage's processes use."""
        return stage_port_span(self.tp_size, shared_host)

    @property
    def ports(self) -> tuple[int, ...]:
        """Every port this stage's processes listen on when its ranks share one host."""
        tensor = (self.rendezvous_port, *(self.rank_http_port(r, True) for r in range(1, self.tp_size)))
        return (self.port, self.http_port, self.client_port, *(tensor if self.tp_size > 1 else ()))


def stage_port_span(tp_size: int, shared_host: bool = True) -> int:
    """Consecutive ports a stage of ``tp_size`` ranks uses from its port: PORTS_PER_STAGE, and one
    more per rank r > 0 when the ranks share rank 0's host (planners space stages by it)."""
    return PORTS_PER_STAGE + (tp_size - 1 if shared_host else 0)


def stage_at(address: str) -> StagePlan:
    """A stand-in stage listening at ``address``, for a client that knows only a head's address
    (its other ports are then the plan's: :attr:`StagePlan.client_port`, :attr:`StagePlan.http_port`)."""
    try:
        return StagePlan(stage_index=0, layer_start=0, layer_end=1, address=address)
    except ValidationError as exc:
        raise PlanError(f"invalid stage address: {_describe(exc)}") from exc


class GroupPlan(_Frozen):
    """One pipeline replica: its stages in order. Groups serve streams in parallel; the gateway
    balances requests over their heads."""

    group_index: NonNegativeInt
    stages: tuple[StagePlan, ...] = Field(min_length=1)


class ServingLimits(_Frozen):
    max_streams: PositiveInt = 16
    context_length: PositiveInt = 4096
    window_rows: PositiveInt = Field(default=8, description="rows of one stream's prefill window per frame")
    max_queue: NonNegativeInt = 64
    queue_timeout_seconds: Annotated[StrictFloat, Field(gt=0, allow_inf_nan=False)] = 30.0
    replay_timeout_seconds: Annotated[StrictFloat, Field(gt=0, allow_inf_nan=False)] = Field(
        default=120.0,
        description="how long a pipeline that lost a stage keeps its streams for replay before they fail",
    )
    microbatches: PositiveInt | None = Field(
        default=None,
        description="sets of streams whose frames the head keeps in flight separately (default: one per stage)",
    )
    speculative: dict[str, Any] | None = Field(
        default=None,
        description='speculative decoding, vLLM-style keys: {"method": "ngram", "num_speculative_tokens": 4, ...}',
    )
    gpu_memory_bytes: PositiveInt | None = Field(
        default=None,
        description="device memory each stage (each rank) plans for; MoE layers that do not fit keep their experts "
        "in host banks with device cache slots (default: the whole device)",
    )
    expert_split_q: Annotated[StrictFloat, Field(ge=0, le=1, allow_inf_nan=False)] | None = Field(
        default=None,
        description="share of each step's expert-miss bytes fetched to the device (default: q* measured at start)",
    )
    expert_prefetch: ExpertPrefetch = Field(
        default=DEFAULT_EXPERT_PREFETCH,
        description="experts copied into device cache slots ahead of the step: off; exact (hash-routed layers); "
        "predicted (also learned routers, by the next layer's router on this layer's input)",
    )

    @field_validator("speculative")
    @classmethod
    def _speculative_config(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None:
            try:
                SpeculativeConfig.from_mapping(value)
            except InputError as exc:
                raise ValueError(str(exc)) from exc
        return value

    def speculative_config(self) -> SpeculativeConfig | None:
        """The head's speculative decoding, or None."""
        return None if self.speculative is None else SpeculativeConfig.from_mapping(self.speculative)


class FleetPlan(_Frozen):
    version: Literal[1] = PLAN_VERSION
    model: ModelRef
    groups: tuple[GroupPlan, ...] = Field(min_length=1)
    serving: ServingLimits = ServingLimits()

    @model_validator(mode="after")
    def _check_layout(self) -> FleetPlan:
        for g, group in enumerate(self.groups):
            if group.group_index != g:
                raise ValueError(f"groups[{g}].group_index={group.group_index} must be {g} (in order from 0)")
            _check_stages(f"groups[{g}]", group.stages, self.model.num_layers)
        if self.serving.window_rows > self.serving.context_length:
            raise ValueError(
                f"serving.window_rows={self.serving.window_rows} exceeds serving.context_length="
                f"{self.serving.context_length}"
            )
        return self

    # ---- JSON ---------------------------------------------------------------------------

    def to_json(self, indent: int | None = 2) -> str:
        return self.model_dump_json(indent=indent)

    @classmethod
    def from_json(cls, text: str | bytes) -> FleetPlan:
        try:
            return cls.model_validate_json(text)
        except ValidationError as exc:
            raise PlanError(f"invalid fleet plan: {_describe(exc)}") from exc

    def canonical_json(self) -> str:
        """Sorted keys, no whitespace: the same plan always gives the same text."""
        return json.dumps(self.model_dump(mode="json"), sort_keys=True, separators=(",", ":"))

    def plan_hash(self) -> str:
        """sha256 hex of the canonical JSON; processes compare it to know they run one plan."""
        return hashlib.sha256(self.canonical_json().encode()).hexdigest()

    @property
    def streams_per_group(self) -> int:
        """Each group's share of ``serving.max_streams`` (the fleet's total), rounded up: the limit of
        the group's head and the KV slots of its stages (the planner budgets KV for this many)."""
        return -(-self.serving.max_streams // len(self.groups))

    def stage(self, group_index: int, stage_index: int) -> StagePlan:
        return self.groups[group_index].stages[stage_index]


def _check_stages(where: str, stages: tuple[StagePlan, ...], num_layers: int) -> None:
    expected_start = 0
    for s, stage in enumerate(stages):
        at = f"{where}.stages[{s}]"
        if stage.stage_index != s:
            raise ValueError(f"{at}.stage_index={stage.stage_index} must be {s} (stages in order from 0)")
        if stage.layer_start != expected_start:
            previous = "0 for the first stage" if s == 0 else f"stages[{s - 1}].layer_end={expected_start}"
            raise ValueError(f"{at}.layer_start={stage.layer_start} must equal {previous} (stages are contiguous)")
        if stage.layer_end <= stage.layer_start:
            raise ValueError(
                f"{at}.layer_end={stage.layer_end} must exceed layer_start={stage.layer_start} "
                "(every stage holds at least one layer; ranges are half-open)"
            )
        expected_start = stage.layer_end
    if expected_start != num_layers:
        raise ValueError(
            f"{where}.stages[{len(stages) - 1}].layer_end={expected_start} must equal model.num_layers="
            f"{num_layers} (the stages of a group cover every layer)"
        )


def _describe(exc: ValidationError) -> str:
    """'groups[0].stages[1].tp_size: Input should be greater than or equal to 1; ...'"""
    errors = exc.errors()
    located = [e["loc"] for e in errors]
    parts = []
    for error in errors:
        # A list whose items failed also reports itself as too short; the item errors say why.
        here = error["loc"]
        if error["type"] == "too_short" and any(loc[: len(here)] == here != loc for loc in located):
            continue
        loc = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in error["loc"]).lstrip(".")
        message = error["msg"].removeprefix("Value error, ")
        parts.append(f"{loc}: {message}" if loc else message)
    return "; ".join(parts)


def build(**fields: object) -> FleetPlan:
    """Build a plan from Python values, raising PlanError (not pydantic's error) when it is invalid."""
    try:
        return FleetPlan.model_validate(fields)
    except ValidationError as exc:
        raise PlanError(f"invalid fleet plan: {_describe(exc)}") from exc


def load(path: str | Path) -> FleetPlan:
    file = Path(path)
    try:
        text = file.read_text()
    except OSError as exc:
        raise PlanError(f"cannot read the fleet plan {str(file)!r}: {exc.strerror}") from exc
    try:
        return FleetPlan.from_json(text)
    except PlanError as exc:
        raise PlanError(f"{file}: {exc}") from exc


def save(plan: FleetPlan, path: str | Path) -> None:
    Path(path).write_text(plan.to_json() + "\n")
