"""Generation.

- `generate`: generation on a replica's engine (a batch, or samples continued).
- `continuous`: the continuous-batching engine of one replica over a paged KV cache.
- `block_scheduler`: which sequences run at each decode step, over a block pool.
- `kv_cache`: the paged KV cache (fixed-size blocks in one pool per rank and model-stage).
- `decoding`: what the decoders share (left-padded prompts, finished batches, hand-offs).
- `sampling`: choosing next tokens for a batch on the logits' device.
- `engine_choice`: `generation.engine` (nereus, vllm, auto) and why vLLM cannot run a plan (torch-free).
- `vllm_engine`: a vLLM engine per actor/generation replica, inside the rank processes.
"""
