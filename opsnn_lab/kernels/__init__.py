"""opsnn_lab.kernels (see DESIGN.md)."""
