"""opsnn_lab.ops (see DESIGN.md)."""
