"""What a stage executes: the :class:`StageBackend` protocol and :func:`load_backend`.

A stage agent, a tensor-parallel follower and ``modelfleet generate`` hold their layers through
this protocol only, so a backend (torch today, OpenVINO next) plugs in without touching the
request path. A backend owns layers ``[layer_start, layer_end)`` of one model and their per-slot
state; the head decides which slot holds which stream (:mod:`.scheduler`), a backend only keeps
the state. ``forward`` returns float32 hidden states [R, *residual_shape] from a stage before the last,
and float32 logits [N, vocab] of the frame's ``output_rows`` from the last. A torch stage runs a
frame flagged ``Frame.decode_only`` as a fixed-shape step (a CUDA graph replay on GPUs,
:class:`~.static_decode.StaticSteps`) where it can, and every other frame as a general one.

A tensor-parallel group wraps a backend (:class:`modelfleet.agent.tensor_group.TensorStage`); a
chain of backends in one process is :class:`modelfleet.engine.generate.LocalModel`.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch

from .errors import InputError, ModelfleetError
from .formats.plan import FormatPlan
from .frame import Frame
from .kvcache import SlotState, SlotTable
from .shard import Shard
from .spec import ModelSpec
from .static_decode import StaticSteps
from .tensor_parallel import TensorGroup

BACKENDS = ("torch", "openvino")  # the names a fleet plan's stage may give


@runtime_checkable
class StageBackend(Protocol):
    spec: ModelSpec
    layer_start: int
    layer_end: int

    @property
    def slots(self) -> SlotTable | None:
        """The slot table once :meth:`allocate_cache` ran."""

    @property
    def weights_bytes(self) -> int: ...

    @property
    def kv_bytes(self) -> int: ...

    @property
    def bytes_by_role(self) -> dict[str, dict[str, int]]:
        """{role: {format: resident bytes}}: experts, attention, head, embeddings, other."""

    def allocate_cache(self, max_slots: int, max_context: int, kv_budget_bytes: int | None = None) -> None: ...

    def refusals(self, frame: Frame) -> dict[int, ModelfleetError]:
        """Slots whose rows :meth:`forward` would refuse, with why; computed before any work."""

    def forward(self, frame: Frame) -> torch.Tensor: ...

    def release(self, slot: int) -> None: ...

    def rewind(self, slot: int, position: int) -> None:
        """Keep positions [0, position) of the slot's stream."""

    def export_slot(self, slot: int) -> SlotState: ...

    def import_slot(self, slot: int, state: SlotState) -> None: ...


def load_backend(
    name: str,
    model_dir: str | Path,
    layer_start: int,
    layer_end: int,
    *,
    device: str = "cpu",
    dtype: str | torch.dtype = "float32",
    formats: FormatPlan | None = None,
    tensor: TensorGroup | None = None,
    on_layer: Callable[[int, int], None] | None = None,
    progress: bool = False,
    static_decode: bool | None = None,
    experts_on_host: bool = False,
) -> StageBackend:
    """The backend ``name`` holding layers [layer_start, layer_end) of the checkpoint (this rank's
    share of them when ``tensor`` is given). ``static_decode``: decode-only frames as fixed-shape
    steps (None: on CUDA, where the shard supports them; the OpenVINO backend runs general frames).
    ``experts_on_host``: the torch backend keeps routed experts in host memory as it loads (a
    device cap places them afterwards)."""
    refusal = backend_refusal(name, device)
    if refusal is not None:
        raise InputError(refusal)
    if name == "openvino":
        if tensor is not None and tensor.size > 1:
            raise InputError(
                "backend 'openvino' runs a stage as one process (tp_size 1); set the stage's tp_size to 1 "
                "or its backend to torch"
            )
        from .openvino.stage import OpenVINOShard, default_cache_dir

        return OpenVINOShard.load_openvino(
            model_dir, layer_start, layer_end, device=device, dtype=dtype, formats=formats, cache_dir=default_cache_dir(),
            on_layer=on_layer, progress=progress,
        )  # fmt: skip
    shard = Shard.load(
        model_dir, layer_start, layer_end, device=device, dtype=dtype, formats=formats, tensor=tensor,
        on_layer=on_layer, progress=progress, experts_on_host=experts_on_host,
    )  # fmt: skip
    shard.static_steps = StaticSteps([shard], static_decode)
    return shard


def backend_info(backend: object) -> dict[str, object]:
    """What executes a stage, for ``/status`` and ``generate --json``: the backend's name and device
    (and, for OpenVINO, how many MoE blocks compiled and fused)."""
    info = getattr(backend, "backend_info", None)
    if isinstance(info, dict):
        return info
    device = getattr(backend, "device", None)
    return {"backend": "torch", "device": str(device) if device is not None else "cpu"}


def backend_refusal(name: str, device: str) -> str | None:
    """Why backend ``name`` cannot run a stage on ``device`` (the field, the limit, the fix), or
    None: asked before anything loads, so a stage fails at start with one line, not a traceback."""
    if name == "openvino":
        return openvino_refusal(device)
    if name != "torch":
        return f"backend {name!r} is unknown; choose one of {', '.join(BACKENDS)}"
    if not device.startswith(("cpu", "cuda")):
        return f"device {device!r} is an OpenVINO device; the torch backend runs on cpu or cuda[:N]"
    return None


def openvino_refusal(device: str) -> str | None:
    """Why the OpenVINO backend cannot run on ``device`` (or is not installed), or None."""
    if device == "NPU":
        return (
            "device 'NPU': the OpenVINO backend's fused MoE blocks have no NPU lowering; "
            "use device cpu or GPU (an Intel iGPU) for backend openvino"
        )
    if not (device.lower() == "cpu" or device == "GPU" or device.startswith("GPU.")):
        return f"device {device!r} is not an OpenVINO device; backend openvino runs on cpu (CPU) or GPU[.N]"
    if importlib.util.find_spec("openvino") is None:
        return "backend 'openvino' needs the openvino package: pip install 'modelfleet[openvino]'"
    return None
