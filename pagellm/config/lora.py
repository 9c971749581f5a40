"""`LoRAConfig`: how many adapters a step may use, their largest rank, the host cache."""

from __future__ import annotations

from dataclasses import dataclass

# the dense families: adapters on their decoder layers' attention and MLP projections, by the
# PEFT module names the layers answer to (`pagellm.lora.layers.lora_targets`)
LORA_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
    "GemmaForCausalLM",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "Gemma3ForConditionalGeneration",  # its language model (vision-tower targets: an error)
    "Phi3ForCausalLM",
    "Olmo2ForCausalLM",
    "GraniteForCausalLM",
    "SmolLM3ForCausalLM",
    "Starcoder2ForCausalLM",
)


# the CPU kernel's largest rank (kMaxRank, pagellm/csrc/lora_cpu.cpp); vLLM's largest too
MAX_LORA_RANK = 512


@dataclass(frozen=True)
class LoRAConfig:
    max_loras: int = 1  # adapter slots on the device: distinct adapters in one step
    max_lora_rank: int = 16  # the largest rank an adapter may have
    max_cpu_loras: int | None = None  # adapters kept on the host (None: max_loras)

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {self.max_loras}")
        if not 1 <= self.max_lora_rank <= MAX_LORA_RANK:
            raise ValueError(
                f"max_lora_rank must be in [1, {MAX_LORA_RANK}], got {self.max_lora_rank}"
            )
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})"
            )

    @property
    def host_cache_size(self) -> int:
        return self.max_loras if self.max_cpu_loras is None else self.max_cpu_loras
