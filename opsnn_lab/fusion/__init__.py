"""opsnn_lab.fusion (see DESIGN.md)."""
