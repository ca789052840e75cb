"""The model and its training: the Llama-style decoder, tensor and pipeline parallelism, AdamW, the training engine."""
