"""ModelFleetSpec: the typed, frozen ``spec`` of a ModelFleet custom resource.

This is the one place where CRD names meet Python names: every field is snake_case here and
camelCase in the CRD (``served_name`` <-> ``servedName``), by pydantic's camel alias generator.
The checks mirror the CRD's schema and its CEL rules (``crds/modelfleets.modelfleet.io.yaml``),
so a spec that ``kubectl apply`` accepts parses here, and one it rejects fails here with a message
naming the field. Defaults are the CRD's defaults.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    StrictStr,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic.alias_generators import to_camel, to_snake

from modelfleet.engine.errors import ModelfleetError
from modelfleet.engine.speculative.config import BUILT, MAX_SPECULATIVE_TOKENS
from modelfleet.plan import Formats, NonNegativeInt, PositiveInt, _describe
from modelfleet.planner import parse_quantity, quantity_value

# the proposers the engine has built (engine.speculative.config), as the CRD's enum
SpeculativeMethod = Literal[BUILT]  # type: ignore[valid-type]

GROUP, VERSION, PLURAL, KIND = "modelfleet.io", "v1alpha1", "modelfleets", "ModelFleet"

# pvc://CLAIM/PATH, hostpath:///PATH, hf://ORG/NAME[@REV]
MODEL_URI_PATTERN = (
    r"^(pvc://[a-z0-9]([-a-z0-9]*[a-z0-9])?/[^/].*"
    r"|hostpath:///.+"
    r"|hf://[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*(@[A-Za-z0-9._/-]+)?)$"
)
DNS_SUBDOMAIN_PATTERN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
SECRET_KEY_PATTERN = r"^[-._a-zA-Z0-9]+$"
ENDPOINT_PATTERN = r"^https?://[^\s/]+(/[^\s]*)?$"
SERVED_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:/\-]*$"
QUANTITY_PATTERN = r"^([+]?([0-9]+(\.[0-9]*)?|\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE][+-]?[0-9]+))?$"


class SpecError(ModelfleetError, ValueError):
    """A ModelFleet spec is invalid; the message names the CRD field (``spec.serving.windowRows``)."""


class _Spec(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid", alias_generator=to_camel, populate_by_name=True)


class SecretKey(_Spec):
    name: StrictStr = Field(min_length=1, max_length=253, pattern=DNS_SUBDOMAIN_PATTERN)
    key: StrictStr = Field(min_length=1, max_length=253, pattern=SECRET_KEY_PATTERN)


class ModelCache(_Spec):
    claim_name: StrictStr = Field(min_length=1, max_length=253, pattern=DNS_SUBDOMAIN_PATTERN)


class ModelSource(_Spec):
    uri: StrictStr = Field(
        pattern=MODEL_URI_PATTERN, description="pvc://CLAIM/PATH, hostpath:///PATH, hf://ORG/NAME[@REV]"
    )
    served_name: StrictStr = Field(min_length=1, max_length=256, pattern=SERVED_NAME_PATTERN)
    formats: Formats = Formats()
    token_secret: SecretKey | None = Field(default=None, description="hf:// only: the Secret key holding HF_TOKEN")
    cache: ModelCache | None = Field(
        default=None, description="hf:// only: a PersistentVolumeClaim to download into (default: an emptyDir)"
    )
    endpoint: StrictStr | None = Field(
        default=None, pattern=ENDPOINT_PATTERN, description="hf:// only: a Hub mirror's URL (HF_ENDPOINT)"
    )

    @model_validator(mode="after")
    def _check_hub_fields(self) -> ModelSource:
        given = [name for name in ("tokenSecret", "cache", "endpoint") if getattr(self, to_snake(name)) is not None]
        if given and not self.uri.startswith("hf://"):
            raise ValueError(f"model.{given[0]} applies to hf:// models only, not {self.uri}")
        return self


class Accelerator(_Spec):
    profile: Literal["nvidia-gpu", "intel-igpu", "cpu"] = "cpu"
    count: NonNegativeInt | None = Field(default=None, description="devices per pod; 0 for cpu, default 1 otherwise")

    @model_validator(mode="after")
    def _check_count(self) -> Accelerator:
        if self.count is not None and (self.count != 0 if self.profile == "cpu" else self.count < 1):
            need = "0 (or unset) for profile cpu" if self.profile == "cpu" else f">= 1 for profile {self.profile}"
            raise ValueError(f"accelerator.count={self.count} must be {need}")
        return self

    @property
    def devices_per_pod(self) -> int:
        return self.count if self.count is not None else (0 if self.profile == "cpu" else 1)


class Parallelism(_Spec):
    pipeline: PositiveInt | Literal["auto"] = Field(default="auto", description="stages per group, or auto")
    tensor: PositiveInt = 1


class StageRange(_Spec):
    layer_start: NonNegativeInt
    layer_end: PositiveInt = Field(description="exclusive")

    @model_validator(mode="after")
    def _check_range(self) -> StageRange:
        if self.layer_end <= self.layer_start:
            raise ValueError(f"layerEnd={self.layer_end} must exceed layerStart={self.layer_start} (half-open)")
        return self


class Toleration(_Spec):
    key: StrictStr | None = None
    operator: Literal["Exists", "Equal"] = "Equal"
    value: StrictStr | None = None
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    toleration_seconds: StrictInt | None = None


class Placement(_Spec):
    node_selector: dict[str, str] = {}
    tolerations: tuple[Toleration, ...] = ()
    affinity: dict[str, Any] | None = Field(
        default=None,
        description="its required nodeAffinity filters nodes, its preferred one orders them, required pod (anti-)affinity on the hostname is evaluated among members; copied into pods",
    )
    numa: Literal["none", "single-numa-node"] = "none"


class Speculative(_Spec):
    """Speculative decoding at every head: the engine's SpeculativeConfig, in camelCase."""

    method: SpeculativeMethod
    num_speculative_tokens: Annotated[StrictInt, Field(ge=1, le=MAX_SPECULATIVE_TOKENS)] = 4
    prompt_lookup_max: PositiveInt = 4
    prompt_lookup_min: PositiveInt = 1
    phrase_table: StrictStr | None = None
    phrase_context: PositiveInt = 3
    model: StrictStr | None = Field(default=None, min_length=1)
    adaptive: StrictBool = True
    min_verified: PositiveInt = 32
    acceptance_threshold: Annotated[StrictFloat | StrictInt, Field(ge=0, le=1)] = 0.6
    cooldown_steps: NonNegativeInt = 64

    @model_validator(mode="after")
    def _check(self) -> Speculative:
        # mirrors the CRD's x-kubernetes-validations rules on serving.speculative
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError("serving.speculative.promptLookupMin must be <= promptLookupMax")
        if self.method == "draft_model" and self.model is None:
            raise ValueError("serving.speculative.method draft_model needs serving.speculative.model")
        return self

    def plan_fields(self) -> dict[str, object]:
        """The plan's serving.speculative: the engine's snake_case keys, defaults left out."""
        return self.model_dump(exclude_defaults=True)


class Serving(_Spec):
    max_streams: PositiveInt = 16
    context_length: PositiveInt = 4096
    window_rows: PositiveInt = 8
    replay_timeout_seconds: Annotated[StrictFloat | StrictInt, Field(gt=0, allow_inf_nan=False)] = 120
    speculative: Speculative | None = None
    gpu_memory_bytes: PositiveInt | None = Field(
        default=None,
        description="device memory each stage member plans for; MoE layers that do not fit keep their experts "
        "in host banks with device cache slots",
    )


class RestartPolicy(_Spec):
    max_stage_restarts: NonNegativeInt = 3


class Rollout(_Spec):
    progress_deadline_seconds: PositiveInt = Field(
        default=900,
        description="how long a new revision may take to become ready beside the serving one before its rollout is abandoned",
    )


class Resources(_Spec):
    """A pod's CPU and memory: ``cpu`` and ``memory`` are requests, the limits default to none for
    CPU (a CFS quota throttles token streaming; requests already share a busy node) and to the
    request for memory (a pod never grows into its neighbours' memory)."""

    cpu: StrictStr | None = Field(default=None, pattern=QUANTITY_PATTERN)
    memory: StrictStr | None = Field(default=None, pattern=QUANTITY_PATTERN)
    cpu_limit: StrictStr | None = Field(default=None, pattern=QUANTITY_PATTERN)
    memory_limit: StrictStr | None = Field(default=None, pattern=QUANTITY_PATTERN)

    @field_validator("cpu", "memory", "cpu_limit", "memory_limit")
    @classmethod
    def _positive(cls, value: str | None) -> str | None:
        if value is not None and parse_quantity(value) <= 0:
            raise ValueError(f"{value!r} must be a positive quantity")
        return value

    @model_validator(mode="after")
    def _limits_cover_requests(self) -> Resources:
        # mirrors the CRD's rules on resources and gateway.resources
        for request, limit in (("cpu", "cpuLimit"), ("memory", "memoryLimit")):
            wanted, allowed = getattr(self, request), getattr(self, to_snake(limit))
            if wanted is not None and allowed is not None and quantity_value(wanted) > quantity_value(allowed):
                raise ValueError(f"{limit}={allowed} must be at least {request}={wanted}")
        return self


class GatewayResources(Resources):
    """The gateway's: it tokenizes and streams (measured in docs/results/hardening_issue30.md)."""

    cpu: StrictStr | None = Field(default="500m", pattern=QUANTITY_PATTERN)
    memory: StrictStr | None = Field(default="1Gi", pattern=QUANTITY_PATTERN)


class Gateway(_Spec):
    replicas: PositiveInt = 1
    service_type: Literal["ClusterIP", "NodePort", "LoadBalancer"] = "ClusterIP"
    api_keys_secret: StrictStr | None = None
    max_queue: NonNegativeInt = 64
    queue_timeout_seconds: Annotated[StrictFloat | StrictInt, Field(gt=0, allow_inf_nan=False)] = 30
    resources: GatewayResources = GatewayResources()


class Images(_Spec):
    agent: StrictStr | None = Field(default=None, min_length=1)
    gateway: StrictStr | None = Field(default=None, min_length=1)
    pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"


class ModelFleetSpec(_Spec):
    model: ModelSource
    backend: Literal["torch", "openvino"] = "torch"
    accelerator: Accelerator = Accelerator()
    parallelism: Parallelism = Parallelism()
    stages: tuple[StageRange, ...] | None = Field(default=None, min_length=1)
    replicas: PositiveInt = 1
    placement: Placement = Placement()
    serving: Serving = Serving()
    gateway: Gateway = Gateway()
    restart_policy: RestartPolicy = RestartPolicy()
    rollout: Rollout = Rollout()
    resources: Resources = Resources()
    images: Images = Images()

    @model_validator(mode="after")
    def _check(self) -> ModelFleetSpec:
        # each check mirrors one x-kubernetes-validations rule of the CRD
        profile = self.accelerator.profile
        if self.backend == "torch" and profile == "intel-igpu":
            raise ValueError("backend=torch cannot drive accelerator.profile=intel-igpu; use backend=openvino")
        if self.backend == "openvino" and profile == "nvidia-gpu":
            raise ValueError("backend=openvino cannot drive accelerator.profile=nvidia-gpu; use backend=torch")
        if self.serving.window_rows > self.serving.context_length:
            raise ValueError(
                f"serving.windowRows={self.serving.window_rows} exceeds serving.contextLength={self.serving.context_length}"
            )
        numa_pinned = self.placement.numa == "single-numa-node"
        if numa_pinned and (self.resources.cpu is None or self.resources.memory is None):
            raise ValueError(
                "placement.numa=single-numa-node needs resources.cpu and resources.memory (Guaranteed QoS)"
            )
        if numa_pinned and (self.resources.cpu_limit is not None or self.resources.memory_limit is not None):
            raise ValueError(
                "placement.numa=single-numa-node sets the limits to the requests (Guaranteed QoS): leave resources.cpuLimit and resources.memoryLimit unset"
            )
        if self.stages is not None:
            _check_stage_ranges(self.stages)
            pipeline = self.parallelism.pipeline
            if pipeline != "auto" and pipeline != len(self.stages):
                raise ValueError(f"parallelism.pipeline={pipeline} must equal the {len(self.stages)} listed stages")
        return self

    @property
    def pipeline(self) -> int | None:
        """Stages per group when the spec fixes it (a number or explicit stages); None for auto."""
        if self.stages is not None:
            return len(self.stages)
        return None if self.parallelism.pipeline == "auto" else self.parallelism.pipeline


def _check_stage_ranges(stages: tuple[StageRange, ...]) -> None:
    expected = 0
    for k, stage in enumerate(stages):
        if stage.layer_start != expected:
            raise ValueError(f"stages[{k}].layerStart={stage.layer_start} must be {expected} (contiguous from 0)")
        expected = stage.layer_end


def parse_spec(spec: Mapping[str, Any]) -> ModelFleetSpec:
    """The CR's ``spec`` (camelCase dict) as a ModelFleetSpec, or SpecError naming the field."""
    try:
        return ModelFleetSpec.model_validate(dict(spec))
    except ValidationError as exc:
        raise SpecError(f"invalid ModelFleet spec: {_camel(_describe(exc))}") from exc


def _camel(message: str) -> str:
    """Field paths in pydantic messages are already aliases; drop pydantic's internal union tags."""
    return re.sub(r"\.(int|literal\[[^\]]*\]|constrained-int|function-after\[[^\]]*\])(?=[.:\[])", "", message)
