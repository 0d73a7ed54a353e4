"""Glue to other libraries (one module per library, as Hugging Face keeps it)."""
