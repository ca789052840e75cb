"""Hugging Face checkpoints in and out of the runtime.

- `names`: the one table between Hugging Face tensor names and the runtime's.
- `files`: which safetensors file holds each tensor, with its shape and dtype.
- `load`: weights straight into any TP/PP layout's shards, by box overlap.
- `export`: a run checkpoint's actor or critic as a Hugging Face folder.
- `run_setup`: what `nereus run` settles about Hugging Face models before any rank exists.
"""
