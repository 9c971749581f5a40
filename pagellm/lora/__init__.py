"""LoRA adapters served over one base model (vLLM's multi-LoRA interface).

`request` (what a caller names: `LoRARequest`), `peft` (a PEFT adapter folder read and
checked against the base model), `layers` (the delta a LoRA-wrapped Linear adds, from
stacked slots), `slots` (the runner's slot manager: adapters loaded and evicted between steps).
"""
