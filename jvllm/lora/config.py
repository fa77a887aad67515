"""LoRAConfig: the engine's LoRA knobs (vLLM's names), validated once.

Owns `max_loras` (adapters resident on the devices at once, and so the most distinct
adapters one step may mix), `max_lora_rank` (the rank every device slot is padded to),
`max_cpu_loras` (adapters kept read in host memory, at least `max_loras`) and
`lora_dtype` (the slots' dtype; "auto" is the model's).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

LORA_DTYPES = ("auto", "float32", "bfloat16", "float16")


@dataclass(frozen=True)
class LoRAConfig:
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None  # None: max_loras
    lora_dtype: str = "auto"

    def __post_init__(self) -> None:
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        cpu = self.max_cpu_loras
        if cpu is not None and (not isinstance(cpu, int) or cpu < self.max_loras):
            raise ValueError(
                f"max_cpu_loras ({cpu!r}) must be an integer >= max_loras ({self.max_loras})"
            )
        if self.lora_dtype not in LORA_DTYPES:
            raise ValueError(f"lora_dtype must be one of {LORA_DTYPES}, got {self.lora_dtype!r}")

    @property
    def host_capacity(self) -> int:
        """Adapters kept read in host memory."""
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras

    @classmethod
    def from_args(cls, args: Any) -> LoRAConfig | None:
        """The config of `EngineArgs` fields (None without `enable_lora`)."""
        if not args.enable_lora:
            return None
        return cls(args.max_loras, args.max_lora_rank, args.max_cpu_loras, args.lora_dtype)
