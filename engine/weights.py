"""Per-layer weight access for family builders: names relative to a prefix, converted to the
shard's dtype and device, with both on-disk expert layouts (per-expert keys or fused 3-D)."""

from __future__ import annotations

import torch

from .checkpoint import TensorSource
from .errors import CheckpointError


class LayerWeights:
    def __init__(self, checkpoint: TensorSource, prefix: str, dtype: torch.dtype, device: torch.device):
        self.checkpoint, self.prefix, self.dtype, self.device = checkpoint, prefix, dtype, device

    def sub(self, prefix: str) -> LayerWeights:
        return LayerWeights(self.checkpoint, self.prefix + prefix, self.dtype, self.device)

    def __contains__(self, name: str) -> bool:
        return self.prefix + name in self.checkpoint

    def raw(self, name: str) -> torch.Tensor:
        return self.checkpoint.read(self.prefix + name)

    def get(self, name: str, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The tensor in the compute dtype (or ``dtype``), in storage of its own on the device."""
        tensor = self.raw(name)
        return tensor.to(device=self.device, dtype=dtype or self.dtype)

    def optional(self, name: str) -> torch.Tensor | None:
        return self.get(name) if name in self else None

    def glu_experts(
        self, num_experts: int, hidden: int, names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj")
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """gate_up: [E, 2I, H] and down: [E, H, I] from per-expert or fused tensors.

        Per-expert: ``{e}.{gate}.weight`` [I, H], ``{e}.{up}.weight`` [I, H], ``{e}.{down}.weight`` [H, I].
        Fused (transformers' in-memory layout): ``gate_up_proj`` [E, 2I, H], ``down_proj`` [E, H, I].
        """
        if "gate_up_proj" in self:
            gate_up, down = self.get("gate_up_proj"), self.get("down_proj")
            if gate_up.shape[0] != num_experts:
                raise CheckpointError(
                    f"{self.prefix}gate_up_proj has {gate_up.shape[0]} experts, config says {num_experts}"
                )
            if gate_up.shape[-1] != hidden:  # stored [E, H, 2I]
                gate_up, down = gate_up.transpose(1, 2).contiguous(), down.transpose(1, 2).contiguous()
            return gate_up, down
        gate_name, up_name, down_name = names
        if f"0.{gate_name}.weight" not in self:
            raise CheckpointError(
                f"no experts under {self.prefix!r}: expected '{self.prefix}0.{gate_name}.weight' or "
                f"'{self.prefix}gate_up_proj'"
            )
        first = self.raw(f"0.{gate_name}.weight")
        inter = first.shape[0]
        gate_up = torch.empty((num_experts, 2 * inter, hidden), dtype=self.dtype, device=self.device)
        down = torch.empty((num_experts, hidden, inter), dtype=self.dtype, device=self.device)
        for e in range(num_experts):
            gate_up[e, :inter] = self.get(f"{e}.{gate_name}.weight")
            gate_up[e, inter:] = self.get(f"{e}.{up_name}.weight")
            down[e] = self.get(f"{e}.{down_name}.weight")
        return gate_up, down
