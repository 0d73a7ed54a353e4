"""Triton kernels, their launchers, and the torch reference of each (the CPU path and test oracle)."""

from opsnn_lab.kernels._dispatch import backend_for, calculate_settings, triton_available

__all__ = ["backend_for", "calculate_settings", "triton_available"]
