"""Benchmarks and the measuring tools they share.

``python -m opsnn_lab.bench NAME`` runs ``opsnn_lab/bench/NAME.py``'s ``main(argv)``.
Every benchmark prints ratios against a baseline measured in the same process and
writes JSON under ``build/bench/``; none asserts on time.
"""

from opsnn_lab.measuring import activation_bytes, saved_tensors_report

__all__ = ["activation_bytes", "saved_tensors_report"]
