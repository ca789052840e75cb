"""The model and its training.

- `transformer`: the Llama-style decoder (a pipeline stage's shard, and the one-process reference).
- `attention`: attention kernels, packing of padded rows, decode masks, per-layer KV stores.
- `initialization`: seeded whole initial weights and a rank's shards of them.
- `tensor_parallel`: tensor parallelism (column/row-parallel linears, vocabulary-split embedding) over weights
  held as their boxes, meeting through autograd functions over torch's all-reduce.
- `context_parallel`: context parallelism (Ulysses all-to-all or all-gathered KV) for training and log-probs.
- `moe`: sparse (mixture-of-experts) layers and expert parallelism.
- `chunked_head`: the LM head's log-probs and entropy in chunks of tokens, never the whole logits.
- `pipeline`: pipeline stages' op lists, their deadlock check and the send/recv executor.
- `parallel_groups`: a rank's place in a RankLayout and its process groups.
- `micro_batches`: a replica's rows split into micro-batches (equal runs, or packed to a token budget).
- `offload`: an engine's state parked in host memory between its runs.
- `data_parallel`: gradient sync over replicas in bounded buckets (ZeRO-1 included).
- `losses`: the objective protocol, next-token cross-entropy, the value loss.
- `adamw`: AdamW with fp32 moments per parameter name.
- `engine`: the training engine of one model on one layout (state, training, inference).
- `grad_norm`: the global gradient norm in any layout, and clipping by it.
- `fused_schedule`, `fused_pipeline`: intra-stage fusion's schedule (no torch) and executor.
"""
