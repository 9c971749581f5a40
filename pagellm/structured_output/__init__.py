"""Structured outputs: constraints (JSON schema, regex, choice, grammar) compiled by xgrammar
off the step loop, applied as a token bitmask before sampling. See docs/structured_outputs.md."""

from pagellm.structured_output.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
