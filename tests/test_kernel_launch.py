"""Programmatic dependent launch stays off unless asked for, on a GPU that has it, outside the interpreter."""
from __future__ import annotations

import torch

from pagedllm.kernel_launch import pdl_launch_args, use_pdl


def test_pdl_is_off_on_cpu_even_when_asked(monkeypatch):
    monkeypatch.setenv("PAGEDLLM_PDL", "1")
    t = torch.zeros(2)
    assert not use_pdl(t)
    assert pdl_launch_args(t) == {"USE_GDC": False}


def test_pdl_is_opt_in(monkeypatch):
    monkeypatch.delenv("PAGEDLLM_PDL", raising=False)
    assert pdl_launch_args(torch.zeros(1)) == {"USE_GDC": False}
    if torch.cuda.is_available():
        assert not use_pdl(torch.zeros(1, device="cuda"))
        monkeypatch.setenv("PAGEDLLM_PDL", "1")
        on = torch.cuda.get_device_capability()[0] >= 9
        assert pdl_launch_args(torch.zeros(1, device="cuda")) == (
            {"USE_GDC": True, "launch_pdl": True} if on else {"USE_GDC": False}
        )
