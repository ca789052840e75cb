"""Benchmark: one tp=2 training step (forward, next-token loss, backward) of the runtime's own
tensor parallelism against torch's DTensor tensor parallelism on the same model and weights.

The measurement behind issue 44's decision on DTensor TP. One gloo world of 2 CPU ranks (one
thread each), tp=2, float32. Four implementations are timed alternately, step by step, so load
on the shared machine falls on all alike:

* `nereus`: the runtime's `DecoderPipelineStage` as `nereus run` builds it (each rank holds its
  boxes of the weights as plain tensors; column/row-parallel linears meeting through two
  autograd functions over torch's all-reduce, vocabulary-split embedding, chunked LM head and
  cross-entropy);
* `dtensor_flat`: the same decoder of plain `nn.Linear`/`nn.Embedding` modules, parallelised
  torchtitan's way by a flat plan through `parallelize_module` (ColwiseParallel for
  q/k/v/gate/up and the LM head with vocabulary-split logits, RowwiseParallel for o/down and
  the embedding) and its loss under `loss_parallel` (no full logits): DTensor parameters,
  every op of the linears dispatched through DTensor;
* `dtensor`: that plan plus `PrepareModuleInput` on each attention and MLP, so q/k/v (gate/up)
  share one `Replicate()` input DTensor: their input gradients are summed as `Partial()` and
  all-reduced once per module, not once per linear (4 all-reduces per layer instead of 7);
* `dtensor_local`: DTensor parameters in the same placements (custom `ParallelStyle`s through
  `parallelize_module`) whose forwards run on the local shards (`to_local()`), DTensor only
  where the ranks meet, with the shared inputs of `dtensor`.

All start from the same seeded weights (`init_logical_param`); the benchmark checks that their
losses and each rank's gradients agree before it times them. `--profile N` adds, per
implementation, where the milliseconds of N profiled steps go (`breakdown`) and how many
collectives and DTensor dispatches a step makes. The models are untied (the `tiny` preset and
the ~100M decoder of memory_parity.py, each with its own LM head): a tied LM head under DTensor
needs the embedding's rows as the head's, which the plans above do not cover.
Writes benchmarks/results/tp_dtensor.json.

    .venv/bin/python benchmarks/tp_dtensor.py [--models tiny,decoder-100m] [--iters 7] [--profile 3]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _record import begin, write_result
from memory_parity import MODEL
from torch import nn
from torch.nn import functional as F

from nereus.runtime.comm.spawn import spawn
from nereus.runtime.model.initialization import box_slice, init_logical_param
from nereus.runtime.model.parallel_groups import build_groups
from nereus.runtime.model.transformer import (
    DecoderPipelineStage,
    activate,
    apply_rope,
    grouped_attention,
    positions_from_mask,
    rms_norm,
    rope_inv_freq,
    rope_tables,
)
from nereus.runtime.state.shard_layout import RankLayout, local_box, param_infos
from nereus.spec.model import Model
from nereus.spec.presets import MODELS

RESULTS = Path(__file__).resolve().parent / "results" / "tp_dtensor.json"
IMPLEMENTATIONS = ("nereus", "dtensor_flat", "dtensor", "dtensor_local")
TP = 2


def models() -> dict[str, Model]:
    untied = {"tied_embeddings": False}
    return {
        "tiny": MODELS["tiny"].model_copy(update=untied),
        MODEL["name"]: Model.model_validate({**MODEL, **untied}),
    }


class Norm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class Attention(nn.Module):
    def __init__(self, model: Model, tp: int):
        super().__init__()
        self.model = model
        self.local_heads, self.local_kv_heads = model.num_heads // tp, model.num_kv_heads // tp
        q_dim, kv_dim = model.num_heads * model.head_dim, model.num_kv_heads * model.head_dim
        self.q_proj = nn.Linear(model.hidden_dim, q_dim, bias=model.qkv_bias)
        self.k_proj = nn.Linear(model.hidden_dim, kv_dim, bias=model.qkv_bias)
        self.v_proj = nn.Linear(model.hidden_dim, kv_dim, bias=model.qkv_bias)
        self.o_proj = nn.Linear(q_dim, model.hidden_dim, bias=False)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        batch, seq, _ = x.shape
        d = self.model.head_dim
        q = self.q_proj(x).view(batch, seq, self.local_heads, d)
        k = self.k_proj(x).view(batch, seq, self.local_kv_heads, d)
        v = self.v_proj(x).view(batch, seq, self.local_kv_heads, d)
        q, k = apply_rope(q, *rope), apply_rope(k, *rope)
        out: torch.Tensor = self.o_proj(grouped_attention(q, k, v, None))
        return out


class MLP(nn.Module):
    def __init__(self, model: Model):
        super().__init__()
        self.activation = model.activation
        self.gate_proj = nn.Linear(model.hidden_dim, model.ffn_dim, bias=False)
        self.up_proj = nn.Linear(model.hidden_dim, model.ffn_dim, bias=False)
        self.down_proj = nn.Linear(model.ffn_dim, model.hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = self.down_proj(activate(self.gate_proj(x), self.activation) * self.up_proj(x))
        return out


class Block(nn.Module):
    def __init__(self, model: Model, tp: int):
        super().__init__()
        self.attn_norm = Norm(model.hidden_dim, model.rms_norm_eps)
        self.attn = Attention(model, tp)
        self.mlp_norm = Norm(model.hidden_dim, model.rms_norm_eps)
        self.mlp = MLP(model)

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), rope)
        out: torch.Tensor = x + self.mlp(self.mlp_norm(x))
        return out


class Decoder(nn.Module):
    """The whole decoder of plain modules under the runtime's parameter names."""

    def __init__(self, model: Model, tp: int):
        super().__init__()
        self.inv_freq = rope_inv_freq(model)
        self.embed = nn.Embedding(model.vocab_size, model.hidden_dim)
        self.layers = nn.ModuleDict({str(i): Block(model, tp) for i in range(model.num_layers)})
        self.final_norm = Norm(model.hidden_dim, model.rms_norm_eps)
        self.lm_head = nn.Linear(model.hidden_dim, model.vocab_size, bias=False)

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens)
        rope = rope_tables(positions, self.inv_freq, x.dtype)
        for block in self.layers.values():
            x = block(x, rope)
        out: torch.Tensor = self.lm_head(self.final_norm(x))
        return out


def parallelize(decoder: Decoder, mesh: Any, shared_inputs: bool) -> Decoder:
    """torchtitan's way: one plan of module name -> parallel style over a 1-D tp mesh. With
    `shared_inputs`, the attention and the MLP each take their input as one `Replicate()` DTensor
    (`PrepareModuleInput`), which q/k/v (gate/up) share: their input gradients are summed as
    `Partial()` DTensors and all-reduced once per module instead of once per linear."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        parallelize_module,
    )

    plan: dict[str, Any] = {
        "embed": RowwiseParallel(input_layouts=Replicate()),
        "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
    }
    for i in decoder.layers:
        if shared_inputs:
            plan[f"layers.{i}.attn"] = PrepareModuleInput(
                input_layouts=(Replicate(), None), desired_input_layouts=(Replicate(), None)
            )
            plan[f"layers.{i}.mlp"] = PrepareModuleInput(
                input_layouts=(Replicate(),), desired_input_layouts=(Replicate(),)
            )
        for name in ("attn.q_proj", "attn.k_proj", "attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            plan[f"layers.{i}.{name}"] = ColwiseParallel()
        for name in ("attn.o_proj", "mlp.down_proj"):
            plan[f"layers.{i}.{name}"] = RowwiseParallel()
    parallelize_module(decoder, mesh, plan, src_data_rank=None)  # every rank holds the same whole weights
    return decoder


def replicated_input(tensor: torch.Tensor, mesh: Any) -> torch.Tensor:
    """`tensor` (the same on every tensor rank) as a plain tensor whose gradient comes back
    `Partial()` and is all-reduced by DTensor once, however many local ops use it."""
    from torch.distributed.tensor import DTensor, Partial, Replicate

    return DTensor.from_local(tensor, mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])


def local_styles() -> dict[str, Any]:
    """Parallel styles whose parameters are DTensors but whose forward runs on the local shards
    (`to_local()` of each parameter, plain ops), with DTensor only where the ranks meet: an
    input's `Replicate()` -> `Partial()` gradient, a row-parallel output's `Partial()` ->
    `Replicate()`, the embedding's masked partial rows. Every op of the math dispatches as a plain
    tensor op; the collectives are DTensor's redistributions."""
    from torch.distributed.tensor import DTensor, Partial, Shard, distribute_tensor
    from torch.distributed.tensor.parallel import ParallelStyle

    def shard_params(module: nn.Module, mesh: Any, dims: dict[str, int]) -> None:
        for name, param in list(module.named_parameters(recurse=False)):
            placement = Shard(dims[name])
            dt = distribute_tensor(param.detach(), mesh, [placement], src_data_rank=None)
            module.register_parameter(name, nn.Parameter(dt, requires_grad=param.requires_grad))

    def local(module: nn.Module, name: str) -> Any:
        """This rank's shard of the module's DTensor parameter `name` (None if it has none)."""
        param = getattr(module, name)
        return None if param is None else param.to_local()

    class ReplicateInput(ParallelStyle):
        """The module's first input is replicated and its gradient summed over the tensor ranks."""

        def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
            def hook(_: nn.Module, args: tuple[Any, ...]) -> tuple[Any, ...]:
                return (replicated_input(args[0], device_mesh), *args[1:])

            module.register_forward_pre_hook(hook)
            return module

    class LocalColwise(ParallelStyle):
        """nn.Linear with `Shard(0)` weight and bias; a replicated local input (already prepared
        unless `replicate_input`), this rank's output columns as a plain tensor, or as a
        `Shard(-1)` DTensor with `dtensor_output`."""

        def __init__(self, replicate_input: bool = False, dtensor_output: bool = False):
            self.replicate_input, self.dtensor_output = replicate_input, dtensor_output

        def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
            shard_params(module, device_mesh, {"weight": 0, "bias": 0})

            def forward(x: torch.Tensor) -> torch.Tensor:
                if self.replicate_input:
                    x = replicated_input(x, device_mesh)
                out = F.linear(x, local(module, "weight"), local(module, "bias"))
                if self.dtensor_output:
                    return DTensor.from_local(out, device_mesh, [Shard(out.dim() - 1)], run_check=False)
                return out

            module.forward = forward
            return module

    class LocalRowwise(ParallelStyle):
        """nn.Linear with a `Shard(1)` weight on this rank's input columns; the output summed."""

        def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
            assert local(module, "bias") is None
            shard_params(module, device_mesh, {"weight": 1})

            def forward(x: torch.Tensor) -> torch.Tensor:
                out = F.linear(x, local(module, "weight"))
                return DTensor.from_local(out, device_mesh, [Partial()], run_check=False).full_tensor()

            module.forward = forward
            return module

    class LocalEmbedding(ParallelStyle):
        """nn.Embedding with `Shard(0)` rows: each rank looks up the tokens in its rows (zero for
        the others), the ranks' rows summed; the gradient stays on this rank's rows."""

        def _apply(self, module: nn.Module, device_mesh: Any) -> nn.Module:
            shard_params(module, device_mesh, {"weight": 0})
            rows = local(module, "weight").shape[0]
            first = device_mesh.get_local_rank() * rows

            def forward(tokens: torch.Tensor) -> torch.Tensor:
                shifted = tokens - first
                outside = (shifted < 0) | (shifted >= rows)
                out = F.embedding(shifted.masked_fill(outside, 0), local(module, "weight"))
                out = out.masked_fill(outside.unsqueeze(-1), 0.0)
                return DTensor.from_local(out, device_mesh, [Partial()], run_check=False).full_tensor()

            module.forward = forward
            return module

    return {
        "replicate_input": ReplicateInput,
        "colwise": LocalColwise,
        "rowwise": LocalRowwise,
        "embedding": LocalEmbedding,
    }


def parallelize_local(decoder: Decoder, mesh: Any) -> Decoder:
    """The local-compute plan: DTensor parameters, plain math (`local_styles`)."""
    from torch.distributed.tensor.parallel import parallelize_module

    styles = local_styles()
    plan: dict[str, Any] = {
        "embed": styles["embedding"](),
        "lm_head": styles["colwise"](replicate_input=True, dtensor_output=True),
    }
    for i in decoder.layers:
        plan[f"layers.{i}.attn"] = styles["replicate_input"]()
        plan[f"layers.{i}.mlp"] = styles["replicate_input"]()
        for name in ("attn.q_proj", "attn.k_proj", "attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            plan[f"layers.{i}.{name}"] = styles["colwise"]()
        for name in ("attn.o_proj", "mlp.down_proj"):
            plan[f"layers.{i}.{name}"] = styles["rowwise"]()
    parallelize_module(decoder, mesh, plan)
    return decoder


def nereus_step(stage: DecoderPipelineStage, tokens: torch.Tensor) -> float:
    """Forward, mean next-token loss from the chunked head (vocabulary split over tp), backward; the loss."""
    mask = torch.ones_like(tokens, dtype=torch.bool)

    def mean_loss(hidden: torch.Tensor) -> torch.Tensor:
        return -stage.token_log_probs(hidden[:, :-1], tokens[:, 1:]).mean()

    loss = stage(tokens, mask, positions_from_mask(mask), reduce=mean_loss)
    loss.backward()
    return float(loss.detach())


def dtensor_step(decoder: Decoder, tokens: torch.Tensor) -> float:
    """The same under DTensor: the loss of Shard(-1) logits under `loss_parallel`."""
    from torch.distributed.tensor.parallel import loss_parallel

    logits = decoder(tokens, positions_from_mask(torch.ones_like(tokens, dtype=torch.bool)))
    with loss_parallel():
        loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
    return float(loss.detach().full_tensor())


def local_grad(param: torch.Tensor) -> torch.Tensor:
    """This rank's block of a parameter's gradient: a DTensor's local shard in the parameter's
    placements (DTensor's embedding backward leaves a `Replicate()` gradient on the `Shard(0)`
    weight), else the whole."""
    from torch.distributed.tensor import DTensor

    grad = param.grad
    assert grad is not None
    if isinstance(grad, DTensor):
        assert isinstance(param, DTensor)
        return grad.redistribute(placements=param.placements).to_local()
    return grad


#: DTensor's own work in a profile: its dispatch (the tensor subclass), redistributions and the
#: from_local / to_local autograd functions, forward and backward.
DTENSOR_EVENTS = ("PythonSubclass", "Redistribute", "NestedRedistribute", "_FromTorchTensor", "_ToTorchTensor")
MATMULS = ("aten::mm", "aten::addmm", "aten::addmm_", "aten::bmm", "aten::baddbmm")


def breakdown(step: Any, repeats: int) -> dict[str, float]:
    """Where one step's milliseconds go on this rank's main thread, by the self time of every
    profiled event (torch.profiler; its own overhead included), medians of `repeats` profiled
    steps: matmuls, the collectives (the call and the wait for the peer), DTensor (its dispatch,
    redistributions, from_local / to_local; an op dispatched to DTensor counts its own self time
    here too), the autograd engine, other aten ops; `wall`: the profiled step's wall time;
    `collective_calls` / `dtensor_dispatches`: per step, counted (these do not vary)."""
    from torch.profiler import ProfilerActivity, profile

    runs: list[dict[str, float]] = []
    for _ in range(repeats):
        dist.barrier()
        started = time.perf_counter()
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            step()
        wall = time.perf_counter() - started
        ms = dict.fromkeys(("matmul", "collectives", "dtensor", "autograd_engine", "other_ops"), 0.0)
        calls = dispatches = 0
        for event in prof.events():
            name, self_ms = event.name, event.self_cpu_time_total / 1e3
            if name.startswith("gloo:"):  # gloo's own threads
                continue
            if name.startswith(("c10d::", "_c10d_functional::")):
                ms["collectives"] += self_ms
                calls += name.startswith("c10d::")
            elif name.startswith(DTENSOR_EVENTS) or any(c.name == "PythonSubclass" for c in event.cpu_children):
                ms["dtensor"] += self_ms
                dispatches += name == "PythonSubclass"
            elif name in MATMULS:
                ms["matmul"] += self_ms
            elif name.startswith("autograd::engine"):
                ms["autograd_engine"] += self_ms
            else:
                ms["other_ops"] += self_ms
        runs.append({**ms, "wall": wall * 1e3, "collective_calls": calls, "dtensor_dispatches": dispatches})
    return {k: round(statistics.median(run[k] for run in runs), 2) for k in runs[0]}


def paired(times: list[float], baseline: list[float]) -> float:
    """The median over the alternation's rounds of `times` / `baseline` in the same round."""
    return statistics.median(t / b for t, b in zip(times, baseline, strict=True))


def time_model(rank: int, name: str, mesh: Any, args: argparse.Namespace) -> dict[str, Any]:
    model = models()[name]
    groups = build_groups(model, "lm", RankLayout(TP, 1, 1, tuple(range(TP))))
    assert groups is not None
    stage = DecoderPipelineStage(model, "lm", groups.tp, 1, 0)
    decoders = {impl: Decoder(model, TP) for impl in IMPLEMENTATIONS[1:]}
    with torch.no_grad():
        for info in param_infos(model):
            whole = init_logical_param(info, seed=0, randomize_all=True)
            stage.get_parameter(info.name).copy_(box_slice(whole, local_box(info, model, TP, rank)))
            for decoder in decoders.values():
                decoder.get_parameter(info.name).copy_(whole)
    for impl, decoder in decoders.items():
        if impl == "dtensor_local":
            parallelize_local(decoder, mesh)
        else:
            parallelize(decoder, mesh, shared_inputs=impl == "dtensor")
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, model.vocab_size, (args.rows, args.seq), generator=generator)
    losses = {"nereus": nereus_step(stage, tokens)}
    losses.update({impl: dtensor_step(decoder, tokens) for impl, decoder in decoders.items()})
    for impl, decoder in decoders.items():  # the same loss and this rank's same gradients
        assert abs(losses["nereus"] - losses[impl]) < 1e-4, losses
        for info in param_infos(model):
            ours, theirs = local_grad(stage.get_parameter(info.name)), local_grad(decoder.get_parameter(info.name))
            try:
                torch.testing.assert_close(theirs, ours, rtol=1e-4, atol=1e-5)
            except AssertionError as error:
                raise AssertionError(f"{impl} {info.name}: {error}") from None
    times: dict[str, list[float]] = {impl: [] for impl in IMPLEMENTATIONS}
    cpu: dict[str, list[float]] = {impl: [] for impl in IMPLEMENTATIONS}
    for step in range(args.warmup + args.iters):
        for impl in IMPLEMENTATIONS:  # alternated, step by step
            stage.zero_grad(set_to_none=True)
            for decoder in decoders.values():
                decoder.zero_grad(set_to_none=True)
            dist.barrier()
            started, cpu_started = time.perf_counter(), time.process_time()
            if impl == "nereus":
                nereus_step(stage, tokens)
            else:
                dtensor_step(decoders[impl], tokens)
            elapsed, cpu_elapsed = time.perf_counter() - started, time.process_time() - cpu_started
            if step >= args.warmup:
                times[impl].append(elapsed)
                cpu[impl].append(cpu_elapsed)
    medians = {impl: statistics.median(t) for impl, t in times.items()}
    profiled: dict[str, dict[str, float]] = {}
    for impl in IMPLEMENTATIONS if args.profile else ():
        stage.zero_grad(set_to_none=True)
        for decoder in decoders.values():
            decoder.zero_grad(set_to_none=True)
        if impl == "nereus":
            profiled[impl] = breakdown(lambda: nereus_step(stage, tokens), args.profile)
        else:
            profiled[impl] = breakdown(lambda d=decoders[impl]: dtensor_step(d, tokens), args.profile)
    return {
        "model": name,
        "rank": rank,
        "loss": losses,
        "median_step_s": medians,
        "over_nereus": {impl: medians[impl] / medians["nereus"] for impl in IMPLEMENTATIONS[1:]},
        # Under load the steps' wall times vary severalfold; the ratio within each round of the
        # alternation (same moment), and the process's CPU time (not the time spent descheduled
        # or waiting for the peer), are steadier.
        "paired_over_nereus": {impl: paired(times[impl], times["nereus"]) for impl in IMPLEMENTATIONS[1:]},
        "median_cpu_s": {impl: statistics.median(t) for impl, t in cpu.items()},
        "cpu_over_nereus": {impl: paired(cpu[impl], cpu["nereus"]) for impl in IMPLEMENTATIONS[1:]},
        "breakdown_ms": profiled,
        "times_s": times,
        "cpu_s": cpu,
    }


def time_steps(rank: int, world: int, args: argparse.Namespace) -> list[dict[str, Any]]:
    from torch.distributed.device_mesh import init_device_mesh

    torch.set_num_threads(1)
    mesh = init_device_mesh("cpu", (TP,))
    return [time_model(rank, name, mesh, args) for name in args.models.split(",")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default=",".join(models()), help="Comma-separated: tiny, decoder-100m.")
    parser.add_argument("--rows", type=int, default=4, help="Sequences in the batch.")
    parser.add_argument("--seq", type=int, default=64, help="Tokens per sequence.")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--iters", type=int, default=7)
    parser.add_argument("--output", type=Path, default=RESULTS)
    parser.add_argument(
        "--profile", type=int, default=0, help="Also profile this many steps of each implementation (`breakdown_ms`)."
    )
    args = parser.parse_args()
    unknown = sorted(set(args.models.split(",")) - set(models()))
    if unknown:
        parser.error(f"unknown models {unknown}: choose from {', '.join(models())}")
    started = begin()
    rows = [row for per_rank in spawn(time_steps, TP, args) for row in per_rank]
    for row in rows:
        steps = ", ".join(f"{impl} {s:.4f} s" for impl, s in row["median_step_s"].items())
        ratios = ", ".join(
            f"{impl} {r:.2f}x (paired {row['paired_over_nereus'][impl]:.2f}x, cpu {row['cpu_over_nereus'][impl]:.2f}x)"
            for impl, r in row["over_nereus"].items()
        )
        print(f"{row['model']:14} rank {row['rank']}: {steps}; over nereus: {ratios}")
    payload = {
        "ranks": TP,
        "threads_per_rank": 1,
        "layout": {"tp": TP, "pp": 1, "dp": 1},
        "implementations": list(IMPLEMENTATIONS),
        "dtype": "float32",
        "rows_per_batch": args.rows,
        "seq": args.seq,
        "rows": [{k: v for k, v in row.items() if k not in ("times_s", "cpu_s")} for row in rows],
    }
    repetitions = {
        f"{row['model']}/rank{row['rank']}/{impl}_{kind}": t
        for row in rows
        for kind in ("s", "cpu_s")
        for impl, t in row["times_s" if kind == "s" else "cpu_s"].items()
    }
    write_result(args.output, payload, started, repetitions=repetitions)


if __name__ == "__main__":
    main()
