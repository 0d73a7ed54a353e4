"""Seed-compatible import path: ``from opsnn_lab.debug import ConsistencyChecker``."""

from opsnn_lab.consistency.checker import ConsistencyChecker
from opsnn_lab.consistency.report import ConsistencyReport, Divergence

__all__ = ["ConsistencyChecker", "ConsistencyReport", "Divergence"]
