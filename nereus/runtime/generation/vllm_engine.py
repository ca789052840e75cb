"""vLLM as the actor/generation engine, inside the rank processes (`generation.engine: vllm`).

Every actor/generation replica of the plan is one vLLM engine over its tp ranks, built with
vLLM's `external_launcher` executor: no process is spawned, each rank of the torch.distributed
world runs one vLLM worker, and vLLM builds its groups over the existing world. vLLM reshapes
the world's ranks as (-1, dp, pp, tp) with the engine's own dp = pp = 1, so consecutive
blocks of `tp` ranks form one engine's tensor group and each block is an engine of its own
(the way TRL's colocate mode runs several replicas): with tp=1 on 2 ranks, rank 0 and rank 1
are two independent engines; with tp=2, one engine over both. That is the plan's layout only
when the generation replicas cover the world in rank order (`vllm_layout_problem`); every
rank of the world must build the engine at the same time (vLLM creates its groups
collectively), and the tp ranks of one engine run the same requests in the same order (the
external launcher's contract: each keeps a scheduler, all deterministic).

The engine is sized from the plan's KV budget (`kv_cache_memory_bytes`, never a guessed
`gpu_memory_utilization`), samples with the run's settings, each sample seeded by its own
key (`sample_seed`, as nereus's engine), and returns every response token's log-probability
in vLLM's `raw_logprobs` mode: the log-softmax of the model's logits before temperature,
top-k or top-p, which is what the trainer's old log-probs are.

Weights come in every step from the nereus actor/generation engine the weight sync fills
(`push_weights`): through the worker's `model_runner.reload_weights(weights_iterator=...)`
(the model's `load_weights` fails on CPU, whose linear layers repack their weights after
loading), streamed in buckets, nothing written to disk. vLLM's loaders take checkpoint-format
(whole) tensors and cut their own tp shard, so a tp-split parameter is assembled from the
engine's tp ranks one bucket at a time (an all-reduce of the zero-filled shards); no rank
ever holds the whole model beyond one bucket, and at tp=1 nothing is communicated.

vllm is imported inside functions only: `nereus --help` and runs on nereus's own engine never
import it.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from nereus.runtime.comm import collectives
from nereus.runtime.generation.sampling import SamplingConfig, sample_seed
from nereus.runtime.state.sharded_state import StateMeta, box_slices

#: Bytes of weights assembled and handed to vLLM at once during a weight sync.
SYNC_BUCKET_BYTES = 64 << 20
#: vLLM's log-prob mode: log-softmax of the raw logits (before temperature, top-k, top-p).
LOGPROBS_MODE = "raw_logprobs"


@dataclass(frozen=True)
class Generated:
    """One replica's responses and the engine's log-probability of each response token."""

    responses: list[list[int]]
    log_probs: list[list[float]]


@dataclass
class VLLMEngine:
    """One rank's part of a vLLM engine (an actor/generation replica over its tp ranks)."""

    llm: Any
    """The `vllm.LLM` (external launcher: this rank's worker lives in this process)."""
    replica: int
    """The replica (vLLM engine) this rank belongs to."""
    tp_group: Any
    """The torch process group of the engine's tp ranks (None at tp=1)."""

    @property
    def model_runner(self) -> Any:
        return self.llm.llm_engine.model_executor.driver_worker.worker.model_runner

    def generate(
        self,
        prompts: Sequence[list[int]],
        sampling: SamplingConfig,
        sample_ids: Sequence[int],
        budgets: Sequence[int] | None = None,
    ) -> Generated:
        """Responses to `prompts` (sample `sample_ids[i]` seeded by its own key), with the
        raw log-probability of every response token. Every tp rank of the engine calls it
        with the same arguments."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        requests = [TokensPrompt(prompt_token_ids=list(prompt)) for prompt in prompts]
        params = [
            SamplingParams(
                n=1,
                max_tokens=sampling.max_new_tokens if budgets is None else budgets[i],
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                top_k=sampling.top_k,
                seed=sample_seed(sampling.seed, sample_id),
                ignore_eos=True,  # the model's own EOS is not the run's: stop where the run's tokenizer says
                stop_token_ids=list(sampling.stop_tokens),
                logprobs=0,
                detokenize=False,
            )
            for i, sample_id in enumerate(sample_ids)
        ]
        if not requests:
            return Generated([], [])
        outputs = self.llm.generate(requests, params, use_tqdm=False)
        responses, log_probs = [], []
        for output in outputs:
            completion = output.outputs[0]
            tokens = list(completion.token_ids)
            assert completion.logprobs is not None and len(completion.logprobs) == len(tokens), "logprobs=0 asked"
            responses.append(tokens)
            log_probs.append(
                [float(step[token].logprob) for step, token in zip(completion.logprobs, tokens, strict=True)]
            )
        return Generated(responses, log_probs)

    def push_weights(
        self, weights: dict[str, torch.Tensor], meta: StateMeta, rank: int, names: Callable[[str], str]
    ) -> None:
        """Load the generation engine's live weights (`param/name` keys, this rank's shards
        as `meta` lays them out) into vLLM, bucket by bucket (collective over the engine's
        tp ranks); `names` gives the checkpoint (Hugging Face) name of a runtime parameter."""
        boxes = meta.rank_boxes(rank)
        self.model_runner.reload_weights(weights_iterator=self._whole_tensors(weights, meta, boxes, names))
        self._refresh_tied_head()

    def _refresh_tied_head(self) -> None:
        """Re-derive a tied output head's kernel weights from the reloaded embedding.

        A tied model's checkpoint has no `lm_head.weight`, so the reload never visits the head;
        its weight is the embedding's storage (updated in place), but on CPU the head computes
        with a packed copy made when it was loaded, which the head's own post-load step remakes."""
        model = self.model_runner.get_model()
        head = getattr(model, "lm_head", None)
        embed = getattr(getattr(model, "model", None), "embed_tokens", None)
        if head is None or embed is None or head.weight.data_ptr() != embed.weight.data_ptr():
            return
        head.quant_method.process_weights_after_loading(head)

    def _whole_tensors(
        self, weights: dict[str, torch.Tensor], meta: StateMeta, boxes: dict[str, Any], names: Callable[[str], str]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """(Hugging Face name, whole tensor) of every weight, assembled across the tp ranks a
        bucket at a time; every tp rank walks the keys in the same (meta) order."""
        bucket: list[tuple[str, torch.Tensor, bool]] = []
        size = 0
        for key in meta.tensors:
            shard = weights[key]
            tensor_meta = meta.tensors[key]
            whole_shape = tensor_meta.global_shape
            split = tuple(shard.shape) != tuple(whole_shape)
            if split:
                whole = torch.zeros(whole_shape, dtype=shard.dtype, device=shard.device)
                whole[box_slices(boxes[key])] = shard
            else:
                whole = shard
            bucket.append((names(tensor_meta.name), whole, split))
            size += whole.numel() * whole.element_size()
            if size >= SYNC_BUCKET_BYTES:
                yield from self._assembled(bucket)
                bucket, size = [], 0
        yield from self._assembled(bucket)

    def _assembled(self, bucket: list[tuple[str, torch.Tensor, bool]]) -> Iterator[tuple[str, torch.Tensor]]:
        split = [tensor for _, tensor, is_split in bucket if is_split]
        if split and self.tp_group is not None:
            flat = torch.cat([tensor.reshape(-1) for tensor in split])
            collectives.all_reduce(flat, self.tp_group)  # disjoint shards, zeros elsewhere: the sum is the whole
            offset = 0
            for tensor in split:
                tensor.copy_(flat[offset : offset + tensor.numel()].view_as(tensor))
                offset += tensor.numel()
        for name, tensor, _ in bucket:
            yield name, tensor

    def close(self) -> None:
        """Release vLLM's process groups, leaving torch.distributed's world to its owner.

        vLLM's own shutdown also destroys the default process group, which belongs to the
        rank loop: its finalizer is detached and only vLLM's groups are destroyed here."""
        from vllm.distributed import parallel_state

        client = self.llm.llm_engine.engine_core
        finalizer = getattr(client, "_finalizer", None)
        if finalizer is not None:
            finalizer.detach()
        core = getattr(client, "engine_core", None)
        if core is not None and core.model_executor is not None:
            core.model_executor.shutdown()
        parallel_state.destroy_model_parallel()
        world = parallel_state._WORLD
        if world is not None:
            world.destroy()
            parallel_state._WORLD = None


def start_engine(
    folder: Path,
    tp: int,
    dtype: str,
    kv_cache_bytes: int,
    max_model_len: int,
    seed: int,
    tp_group: Any,
) -> VLLMEngine:
    """This rank's part of its replica's vLLM engine over `folder` (collective over the whole
    world: vLLM builds its groups on it). `kv_cache_bytes`: the KV pool per rank."""
    from vllm import LLM

    rank, world_size = dist.get_rank(), dist.get_world_size()
    assert world_size % tp == 0, (world_size, tp)
    # The external launcher reads the launcher's variables (nereus's own spawn sets only LOCAL_RANK).
    os.environ.setdefault("RANK", str(rank))
    os.environ.setdefault("LOCAL_RANK", str(rank))
    os.environ.setdefault("WORLD_SIZE", str(world_size))
    on_cpu = not torch.cuda.is_available()
    llm = LLM(
        model=str(folder),
        tensor_parallel_size=tp,
        distributed_executor_backend="external_launcher",
        dtype=dtype,
        seed=seed + rank // tp,
        skip_tokenizer_init=True,
        kv_cache_memory_bytes=kv_cache_bytes,
        max_model_len=max_model_len,
        enforce_eager=on_cpu,
        enable_prefix_caching=False,
        logprobs_mode=LOGPROBS_MODE,
        generation_config="vllm",
    )
    from vllm.distributed import parallel_state

    theirs = list(parallel_state.get_tp_group().ranks)
    mine = list(range(rank - rank % tp, rank - rank % tp + tp))
    assert theirs == mine, f"vLLM's tensor group {theirs} is not the plan's {mine}"
    return VLLMEngine(llm, rank // tp, tp_group)
