"""Hugging Face checkpoints in and out of the runtime: the one name table (`names`), the
safetensors files' headers (`files`), loading into any TP/PP layout by box overlap (`load`)."""
