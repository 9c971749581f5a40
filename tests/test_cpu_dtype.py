"""`dtype="auto"` on the CPU: bfloat16 only where the CPU has bf16 matrix units (AMX or
AVX512-BF16), float32 elsewhere, and the start-up log says which."""

from __future__ import annotations

import logging

import pytest
import torch

from pagellm.engine import arg_utils


@pytest.mark.parametrize("units,dtype", [("AMX", torch.bfloat16), ("AVX512-BF16", torch.bfloat16),
                                         (None, torch.float32)])  # fmt: skip
def test_auto_dtype_follows_the_cpu(monkeypatch, caplog, units, dtype):
    monkeypatch.setattr(arg_utils, "cpu_bf16_units", lambda: units)
    with caplog.at_level(logging.INFO, logger="pagellm.engine.arg_utils"):
        got = arg_utils._resolve_dtype("auto", None, torch.device("cpu"))
    assert got == dtype
    assert (units or "neither AMX nor AVX512-BF16") in caplog.text
    # an explicit dtype is kept whatever the CPU
    assert arg_utils._resolve_dtype("float32", None, torch.device("cpu")) == torch.float32
