"""opsnn_lab.consistency (see DESIGN.md)."""
