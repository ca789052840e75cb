"""Benchmark: one tp=2 training step (forward, next-token loss, backward) of the runtime's own
tensor parallelism against torch's DTensor tensor parallelism on the same model and weights.

The measurement behind issue 44's decision on DTensor TP. One gloo world of 2 CPU ranks (one
thread each), tp=2, float32. Two implementations are timed alternately, step by step, so load
on the shared machine falls on both alike:

* `nereus`: the runtime's `DecoderPipelineStage` as `nereus run` builds it (each rank holds its
  boxes of the weights as plain tensors; column/row-parallel linears, vocabulary-split
  embedding, LM head and cross-entropy);
* `dtensor`: the same decoder of plain `nn.Linear`/`nn.Embedding` modules, parallelised by a
  flat plan through `parallelize_module` (ColwiseParallel for q/k/v/gate/up and the LM head with
  vocabulary-split logits, RowwiseParallel for o/down and the embedding) and its loss under
  `loss_parallel` (no full logits): DTensor parameters, every op dispatched through DTensor.

Both start from the same seeded weights (`init_logical_param`), and the benchmark checks that
their losses agree before it times them. The models are untied (the `tiny` preset and the
~100M decoder of memory_parity.py, each with its own LM head): a tied LM head under DTensor
needs the embedding's rows as the head's, which the plan above does not cover.
Writes benchmarks/results/tp_dtensor.json.

    .venv/bin/python benchmarks/tp_dtensor.py [--models tiny,decoder-100m] [--iters 7]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from _record import begin, rank_times, write_result
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
IMPLEMENTATIONS = ("nereus", "dtensor")
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


def parallelize(decoder: Decoder, mesh: Any) -> Decoder:
    """torchtitan's way: one flat plan of module name -> parallel style over a 1-D tp mesh."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan: dict[str, Any] = {
        "embed": RowwiseParallel(input_layouts=Replicate()),
        "lm_head": ColwiseParallel(output_layouts=Shard(-1), use_local_output=False),
    }
    for i in decoder.layers:
        for name in ("attn.q_proj", "attn.k_proj", "attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            plan[f"layers.{i}.{name}"] = ColwiseParallel()
        for name in ("attn.o_proj", "mlp.down_proj"):
            plan[f"layers.{i}.{name}"] = RowwiseParallel()
    parallelize_module(decoder, mesh, plan, src_data_rank=None)  # every rank holds the same whole weights
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


def time_model(rank: int, name: str, mesh: Any, args: argparse.Namespace) -> dict[str, Any]:
    model = models()[name]
    groups = build_groups(model, "lm", RankLayout(TP, 1, 1, tuple(range(TP))))
    assert groups is not None
    stage = DecoderPipelineStage(model, "lm", groups.tp, 1, 0)
    decoder = Decoder(model, TP)
    with torch.no_grad():
        for info in param_infos(model):
            whole = init_logical_param(info, seed=0, randomize_all=True)
            stage.get_parameter(info.name).copy_(box_slice(whole, local_box(info, model, TP, rank)))
            decoder.get_parameter(info.name).copy_(whole)
    parallelize(decoder, mesh)
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, model.vocab_size, (args.rows, args.seq), generator=generator)
    losses = {"nereus": nereus_step(stage, tokens), "dtensor": dtensor_step(decoder, tokens)}
    assert abs(losses["nereus"] - losses["dtensor"]) < 1e-4, losses
    times: dict[str, list[float]] = {impl: [] for impl in IMPLEMENTATIONS}
    for step in range(args.warmup + args.iters):
        for impl in IMPLEMENTATIONS:  # alternated, step by step
            stage.zero_grad(set_to_none=True)
            decoder.zero_grad(set_to_none=True)
            dist.barrier()
            started = time.perf_counter()
            if impl == "dtensor":
                dtensor_step(decoder, tokens)
            else:
                nereus_step(stage, tokens)
            elapsed = time.perf_counter() - started
            if step >= args.warmup:
                times[impl].append(elapsed)
    medians = {impl: statistics.median(t) for impl, t in times.items()}
    return {
        "model": name,
        "rank": rank,
        "loss": losses,
        "median_step_s": medians,
        "dtensor_over_nereus": medians["dtensor"] / medians["nereus"],
        "times_s": times,
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
    args = parser.parse_args()
    unknown = sorted(set(args.models.split(",")) - set(models()))
    if unknown:
        parser.error(f"unknown models {unknown}: choose from {', '.join(models())}")
    started = begin()
    rows = [row for per_rank in spawn(time_steps, TP, args) for row in per_rank]
    for row in rows:
        steps = ", ".join(f"{impl} {s:.4f} s" for impl, s in row["median_step_s"].items())
        print(f"{row['model']:14} rank {row['rank']}: {steps}; dtensor / nereus {row['dtensor_over_nereus']:.2f}x")
    kept, repetitions = rank_times(rows)
    payload = {
        "ranks": TP,
        "threads_per_rank": 1,
        "layout": {"tp": TP, "pp": 1, "dp": 1},
        "implementations": list(IMPLEMENTATIONS),
        "dtype": "float32",
        "rows_per_batch": args.rows,
        "seq": args.seq,
        "rows": kept,
    }
    write_result(args.output, payload, started, repetitions=repetitions)


if __name__ == "__main__":
    main()
