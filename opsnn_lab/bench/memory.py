"""Kept for existing imports: the activation-memory tools live in ``opsnn_lab.measuring``."""

from opsnn_lab.measuring import SavedTensorsReport, activation_bytes, saved_tensors_report

__all__ = ["activation_bytes", "saved_tensors_report", "SavedTensorsReport"]
