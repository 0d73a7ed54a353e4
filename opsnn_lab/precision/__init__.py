"""opsnn_lab.precision (see DESIGN.md)."""
