"""Semantic validation: what a schema cannot say (GPUs exist, tp divides heads, ...)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from nereus.errors import SpecError
from nereus.spec.cluster import Cluster
from nereus.spec.io import ParseError, document_from_data, field_marks, locate, parse_data, read_text
from nereus.spec.model import LinearRopeScaling, Llama3RopeScaling, Model
from nereus.spec.plan import CpMethod, Plan, StagePlan
from nereus.spec.registry import file_problems, kind_of, semantic_problems
from nereus.spec.stages import model_stage
from nereus.spec.workload import Workload, async_problems, model_stages

Severity = Literal["error", "warning"]


@dataclass(frozen=True)
class Problem:
    """One thing wrong (or suspicious) at a field path of a document."""

    path: str
    message: str
    severity: Severity = "error"

    def format(self, source: str) -> str:
        prefix = "" if self.severity == "error" else "warning: "
        return f"{source}: {self.path}: {prefix}{self.message}"


def kv_heads_rule(model: Model, tp: int) -> str | None:
    """Why `tp` cannot shard `model`'s attention, or None if it can.

    Query heads are split evenly over tp ranks. KV heads are split when tp <= KV heads
    (tp must divide them); beyond that each rank holds a replica of one KV head, so
    tp must be a multiple of the KV heads.
    """
    if model.num_heads % tp:
        return f"tp={tp} does not divide the {model.num_heads} attention heads of {model.name}"
    if tp <= model.num_kv_heads and model.num_kv_heads % tp:
        return f"tp={tp} does not divide the {model.num_kv_heads} KV heads of {model.name}"
    if tp > model.num_kv_heads and tp % model.num_kv_heads:
        return (
            f"tp={tp} exceeds the {model.num_kv_heads} KV heads of {model.name} and is not a "
            "multiple of them (KV heads are replicated only in whole copies)"
        )
    return None


def cp_rule(model: Model, tp: int, cp: int, method: CpMethod = "ulysses") -> str | None:
    """Why Ulysses context parallelism of degree `cp` cannot split `model`'s attention after
    `tp`, or None if it can (docs/context-parallel.md).

    Around the attention core an all-to-all trades each cp rank's chunk of the sequence with all
    of its tp rank's heads for the whole sequence with 1/cp of them: cp must divide the query
    heads of a tensor rank. Where it does not divide that rank's KV heads too, each rank
    repeats the KV head of each of its query heads (GQA run as multi-head attention inside the
    core, the runtime's `SequenceSplit.attention`; the cost model moves the repeated keys and
    values through the all-to-alls, `StageCostModel.ulysses_bytes`). The all-gather method
    splits no heads: any cp (the sequence length bounds it at run time).
    """
    if cp == 1 or method == "allgather":
        return None
    local = model.num_heads // tp
    if local % cp:
        return (
            f"cp={cp} with tp={tp} does not divide the {local} query heads of a tensor rank of {model.name} "
            f"({model.num_heads} heads over tp={tp}; Ulysses gives each cp rank whole query heads)"
        )
    return None


def pp_rule(model: Model, pp: int) -> str | None:
    """Why `pp` cannot split `model`'s layers into equal stages, or None."""
    if model.num_layers % pp:
        return f"pp={pp} does not divide the {model.num_layers} layers of {model.name}"
    return None


def layout_problem(model: Model, tp: int, pp: int) -> str | None:
    """Why the runtime cannot shard `model` as (tp, pp), or None if it can: the attention and
    layer rules, and tp must divide the vocabulary and the MLP width too."""
    if tp < 1 or pp < 1:
        return f"tp={tp} and pp={pp} must be at least 1"
    for reason in (kv_heads_rule(model, tp), pp_rule(model, pp)):
        if reason:
            return reason
    if model.vocab_size % tp:
        return f"tp={tp} does not divide the vocabulary of {model.vocab_size} ({model.name})"
    if model.sparse_layers() < model.num_layers and model.ffn_dim % tp:
        return f"tp={tp} does not divide the MLP width {model.ffn_dim} ({model.name})"
    if model.moe is not None and model.moe.expert_ffn_dim % tp:
        return f"tp={tp} does not divide the expert MLP width {model.moe.expert_ffn_dim} ({model.name})"
    return None


def gqa_rule(num_heads: int, num_kv_heads: int) -> str | None:
    """Why `num_kv_heads` KV heads cannot serve `num_heads` query heads, or None: grouped-query
    attention gives every KV head the same number of query heads (transformers repeats each
    KV head num_heads // num_kv_heads times, so another count fails in its attention)."""
    if num_heads % num_kv_heads:
        return f"{num_kv_heads} KV heads do not divide {num_heads} query heads; grouped-query attention needs a divisor"
    return None


def head_dim_rule(head_dim: int) -> str | None:
    """Why RoPE cannot rotate heads `head_dim` wide, or None: it turns pairs of dimensions
    (transformers refuses an odd head_dim too)."""
    if head_dim % 2:
        return f"{head_dim} is odd; RoPE rotates pairs of dimensions, so a head needs an even width"
    return None


def experts_rule(model: Model) -> tuple[str, str] | None:
    """(field, why) a mixture of experts routes no token the way transformers would, or None:
    more experts per token than experts (transformers' top-k fails), a dense layer index past
    the last layer (it would silently select nothing), or no sparse layer at all."""
    moe = model.moe
    if moe is None:
        return None
    if moe.experts_per_token > moe.num_experts:
        return (
            "moe.experts_per_token",
            f"{moe.experts_per_token} experts per token exceed the {moe.num_experts} experts; choose at most "
            f"{moe.num_experts}",
        )
    outside = [layer for layer in moe.dense_layers if not 0 <= layer < model.num_layers]
    if outside:
        return ("moe.dense_layers", f"layer {outside[0]} is outside 0..{model.num_layers - 1}")
    if model.sparse_layers() == 0:
        return ("moe.sparse_step", f"no layer is sparse (sparse_step {moe.sparse_step}, {model.num_layers} layers)")
    return None


def llama3_rule(scaling: Llama3RopeScaling) -> str | None:
    """Why a llama3 RoPE scaling's frequency bands are empty or reversed, or None (its blend
    divides by high_freq_factor - low_freq_factor)."""
    if scaling.high_freq_factor <= scaling.low_freq_factor:
        return (
            f"{scaling.high_freq_factor} is not above low_freq_factor {scaling.low_freq_factor}; the llama3 "
            "scaling blends the wavelengths between the two"
        )
    return None


def model_problems(model: Model, prefix: str = "") -> Iterator[Problem]:
    """What makes a Model no network: grouped-query heads, an odd head width, llama3 bands."""
    rules = (
        ("num_kv_heads", gqa_rule(model.num_heads, model.num_kv_heads)),
        ("head_dim", head_dim_rule(model.head_dim)),
        (
            "rope_scaling.high_freq_factor",
            llama3_rule(model.rope_scaling) if isinstance(model.rope_scaling, Llama3RopeScaling) else None,
        ),
    )
    for path, rule in rules:
        if rule:
            yield Problem(f"{prefix}{path}", rule)
    experts = experts_rule(model)
    if experts:
        yield Problem(f"{prefix}{experts[0]}", experts[1])


def position_rule(model: Model, workload: Workload) -> str | None:
    """Why `workload`'s longest sequence (prompt plus the longest response) does not fit the
    positions `model` takes (`Model.position_limit`), or None: one rule for `nereus plan`,
    `nereus check` and `nereus run`."""
    longest = workload.prompt_len + workload.response_len.max
    limit = model.position_limit()
    if longest <= limit:
        return None
    if limit == model.max_positions:
        takes = f"max_positions {limit} (max_position_embeddings)"
    else:
        factor = model.rope_scaling.factor if isinstance(model.rope_scaling, LinearRopeScaling) else 1
        takes = f"{limit} positions (max_positions {model.max_positions} x rope_scaling.factor {factor:g})"
    room = limit - workload.prompt_len
    fix = f"lower response_len.max (--seq-len) to at most {room}" if room > 0 else "shorten prompt_len"
    return (
        f"workload {workload.name!r}: prompt_len {workload.prompt_len} + response_len.max "
        f"{workload.response_len.max} = {longest} tokens exceed model {model.name}'s {takes}; {fix}"
    )


def position_problems(models: Iterable[Model], workload: Workload, prefix: str = "") -> Iterator[Problem]:
    """`position_rule` for every model a role of `workload` plays (each model once)."""
    names = {name for name in workload.role_models().values() if name is not None}
    for model in models:
        rule = position_rule(model, workload) if model.name in names else None
        if rule:
            names.discard(model.name)
            yield Problem(f"{prefix}response_len.max", rule)


def cluster_problems(cluster: Cluster, prefix: str = "") -> Iterator[Problem]:
    if cluster.inter_node.bytes_per_s > cluster.intra_node.bytes_per_s:
        yield Problem(
            f"{prefix}inter_node.bytes_per_s",
            "inter-node bandwidth exceeds intra-node bandwidth; check the units (bytes/s per GPU)",
            "warning",
        )


def group_rule(workload: Workload) -> str | None:
    """Why `workload`'s groups cannot give its algorithm a baseline, or None (one rule for
    `nereus check` and `nereus run`)."""
    if workload.algorithm == "grpo" and workload.samples_per_prompt < 2:
        return (
            "grpo compares responses within a group (a group of one has no baseline), so grpo needs "
            "samples_per_prompt >= 2"
        )
    return None


CriticPart = Literal["key", "stages"]


def critic_rule(algorithm: str, has_critic: bool, part: CriticPart) -> str | None:
    """Why having a critic (or not) does not suit `algorithm`, or None: only ppo trains one.
    `part` is what the document says it with: a workload's `critic` key or a plan's critic
    model-stages (one rule for `nereus check` and `nereus run`)."""
    if algorithm == "ppo" and not has_critic:
        needed = "a critic model; name one" if part == "key" else "critic/inference and critic/training stages"
        return f"ppo needs {needed}"
    if algorithm != "ppo" and has_critic:
        return f"{algorithm} uses no critic; remove {'this key' if part == 'key' else 'the critic stages'}"
    return None


def workload_problems(workload: Workload, prefix: str = "") -> Iterator[Problem]:
    critic = critic_rule(workload.algorithm, workload.critic is not None, "key")
    if critic:
        yield Problem(f"{prefix}critic", critic)
    group = group_rule(workload)
    if group:
        yield Problem(f"{prefix}samples_per_prompt", group)
    for where, message in async_problems(workload):
        yield Problem(f"{prefix}{where}", message)
    if workload.samples_per_step % workload.mini_batches:
        yield Problem(
            f"{prefix}mini_batches",
            f"{workload.samples_per_step} samples per step do not split into "
            f"{workload.mini_batches} equal mini-batches; pick a divisor",
        )
    elif workload.micro_batch_size > workload.samples_per_step // workload.mini_batches:
        yield Problem(
            f"{prefix}micro_batch_size",
            f"micro_batch_size {workload.micro_batch_size} exceeds the "
            f"{workload.samples_per_step // workload.mini_batches} samples of a mini-batch",
        )


def _pool_problems(plan: Plan) -> Iterator[Problem]:
    owner: dict[int, str] = {}
    names: set[str] = set()
    for i, pool in enumerate(plan.pools):
        if pool.name in names:
            yield Problem(f"pools[{i}].name", f"pool name {pool.name!r} is used twice")
        names.add(pool.name)
        for j, gpu in enumerate(pool.gpus):
            if not 0 <= gpu < plan.cluster.num_gpus:
                yield Problem(
                    f"pools[{i}].gpus[{j}]",
                    f"GPU {gpu} does not exist; the cluster has GPUs 0..{plan.cluster.num_gpus - 1}",
                )
            elif gpu in owner:
                yield Problem(f"pools[{i}].gpus[{j}]", f"GPU {gpu} is already in pool {owner[gpu]!r}")
            else:
                owner[gpu] = pool.name


def _stage_problems(plan: Plan, i: int, entry: StagePlan) -> Iterator[Problem]:
    at = f"stages[{i}]"
    model = plan.model(plan.workload.model_name(entry.role))
    pools: dict[str, set[int]] = {}
    for pool in plan.pools:
        pools.setdefault(pool.name, set()).update(pool.gpus)
    if entry.pool not in pools:
        yield Problem(f"{at}.pool", f"no pool named {entry.pool!r}; use one of {sorted(pools)}")
    for rule, key in ((kv_heads_rule(model, entry.tp), "tp"), (pp_rule(model, entry.pp), "pp")):
        if rule:
            yield Problem(f"{at}.{key}", rule)
    yield from _cp_problems(model, entry, at)
    if entry.tp > plan.cluster.gpus_per_node:
        yield Problem(f"{at}.tp", f"tp={entry.tp} exceeds the {plan.cluster.gpus_per_node} GPUs of a node")
    if entry.dp != len(entry.emus):
        yield Problem(f"{at}.dp", f"dp={entry.dp} but {len(entry.emus)} EMUs are listed; make them equal")
    seen: dict[int, int] = {}
    for k, emu in enumerate(entry.emus):
        if len(emu) != entry.replica_size:
            cp = f", cp={entry.cp}" if entry.cp > 1 else ""
            ep = f", ep={entry.ep}" if entry.ep > 1 else ""
            degrees = f"tp={entry.tp}{cp}{ep}, pp={entry.pp}"
            yield Problem(f"{at}.emus[{k}]", f"an EMU with {degrees} needs {entry.replica_size} GPUs, got {len(emu)}")
            continue
        for j, gpu in enumerate(emu):
            where = f"{at}.emus[{k}][{j}]"
            if gpu in seen:
                yield Problem(where, f"GPU {gpu} is also used by EMU {seen[gpu]} of {entry.model_stage}")
            seen[gpu] = k
            if entry.pool in pools and gpu not in pools[entry.pool]:
                yield Problem(where, f"GPU {gpu} is not in pool {entry.pool!r}")
        yield from _tp_group_problems(plan.cluster, entry, emu, f"{at}.emus[{k}]")


def cp_layout_problem(model: Model, tp: int, pp: int, cp: int, method: CpMethod = "ulysses") -> str | None:
    """Why nereus does not run context parallelism `cp` in a (tp, pp) replica of `model`, or None:
    heads Ulysses cannot split (`cp_rule`), or cp beside pipeline stages (cp on generation is
    refused when a plan entry is read)."""
    if cp > 1 and pp > 1:
        return f"cp={cp} with pp={pp} is not supported; set cp: 1 or pp: 1"
    return cp_rule(model, tp, cp, method)


def _cp_problems(model: Model, entry: StagePlan, at: str) -> Iterator[Problem]:
    problem = cp_layout_problem(model, entry.tp, entry.pp, entry.cp, entry.cp_method)
    if problem:
        yield Problem(f"{at}.cp", problem)
    problem = ep_rule(model, entry.ep, entry.cp)
    if problem:
        yield Problem(f"{at}.ep", problem)


def ep_rule(model: Model, ep: int, cp: int = 1) -> str | None:
    """Why expert parallelism of degree `ep` cannot split `model`'s experts, or None: a dense
    model has no experts to split, each ep rank holds a contiguous block of E / ep experts (so
    ep must divide them), and ep beside context parallelism is not supported yet."""
    if ep == 1:
        return None
    if model.moe is None:
        return f"ep={ep} but {model.name} is a dense model (no experts to split); set ep: 1"
    if model.moe.num_experts % ep:
        return (
            f"ep={ep} does not divide the {model.moe.num_experts} experts of {model.name}; "
            "pick a divisor (each ep rank holds an equal block of experts)"
        )
    if cp > 1:
        return f"ep={ep} with cp={cp} is not supported; set ep: 1 or cp: 1"
    return None


def _tp_group_problems(cluster: Cluster, entry: StagePlan, emu: list[int], at: str) -> Iterator[Problem]:
    ranks = entry.cp * entry.ep  # ep with cp > 1 is refused: at most one of them is above 1
    for stage in range(entry.pp):
        for rank in range(ranks):
            first = (stage * ranks + rank) * entry.tp
            group = emu[first : first + entry.tp]
            if len({cluster.node_of(gpu) for gpu in group}) > 1:
                name = "cp" if entry.cp > 1 else "ep"
                of = f"pipeline stage {stage}" + (f", {name} rank {rank}" if ranks > 1 else "")
                yield Problem(at, f"tp group {group} of {of} spans nodes; keep each tp group in one node")


def _stage_set_problems(plan: Plan) -> Iterator[Problem]:
    expected = [model_stage(role, stage) for role, stage in model_stages(plan.workload)]
    seen: set[str] = set()
    for i, entry in enumerate(plan.stages):
        if entry.model_stage in seen:
            yield Problem(f"stages[{i}].model_stage", f"{entry.model_stage} is listed twice")
        elif entry.model_stage not in expected:
            yield Problem(
                f"stages[{i}].model_stage",
                f"workload {plan.workload.name!r} ({plan.workload.algorithm}) does not run "
                f"{entry.model_stage}; remove this entry",
            )
        seen.add(entry.model_stage)
    for name in expected:
        if name not in seen:
            yield Problem("stages", f"no entry for {name}; add one")


def _batch_problems(plan: Plan, i: int, entry: StagePlan) -> Iterator[Problem]:
    w = plan.workload
    samples = w.samples_per_step // w.mini_batches if entry.stage == "training" else w.samples_per_step
    per = "mini-batch" if entry.stage == "training" else "step"
    if entry.dp > samples:
        yield Problem(
            f"stages[{i}].dp",
            f"dp={entry.dp} replicas share only {samples} samples per {per}; some would idle: lower dp",
        )
        return
    busiest = -(-samples // entry.dp)  # replicas get ceil or floor of an uneven split
    if entry.stage != "generation" and entry.micro_batches > busiest:
        yield Problem(
            f"stages[{i}].micro_batches",
            f"{entry.micro_batches} micro-batches but a replica gets at most {busiest} samples per {per}; "
            "lower micro_batches or dp",
        )


def plan_problems(plan: Plan) -> Iterator[Problem]:
    for i, model in enumerate(plan.models):
        yield from model_problems(model, f"models[{i}].")
        if [m.name for m in plan.models].index(model.name) != i:
            yield Problem(f"models[{i}].name", f"model {model.name!r} is listed twice")
    yield from cluster_problems(plan.cluster, "cluster.")
    yield from workload_problems(plan.workload, "workload.")
    names = {model.name for model in plan.models}
    missing = [
        (role, name) for role, name in plan.workload.role_models().items() if name is not None and name not in names
    ]
    for role, name in missing:
        yield Problem(f"workload.{role}", f"model {name!r} is not among the plan's models; add it")
    yield from position_problems(plan.models, plan.workload, "workload.")
    yield from _pool_problems(plan)
    yield from _stage_set_problems(plan)
    if missing:
        return  # stage checks need every model
    for i, entry in enumerate(plan.stages):
        if entry.role in plan.workload.roles():
            yield from _stage_problems(plan, i, entry)
            yield from _batch_problems(plan, i, entry)


@dataclass(frozen=True)
class Finding:
    """One error or warning of a checked file, with where in the file it is."""

    file: str
    text: str
    """The problem as one line, `FILE: FIELD: what is wrong`."""
    severity: Severity
    field_path: str | None = None
    """The field path it is about (`stages[0].tp`), when it is about one."""
    line: int | None = None
    """1-based line of the field (or of its nearest written parent)."""
    column: int | None = None
    """1-based column of that line."""

    @property
    def located(self) -> str:
        """The line with the position after the file name, `FILE:LINE:COL: FIELD: ...`
        (the form editors and CI logs link to the place)."""
        if self.line is None or not self.text.startswith(f"{self.file}: "):
            return self.text
        return f"{self.file}:{self.line}:{self.column}: {self.text[len(self.file) + 2 :]}"


@dataclass
class CheckResult:
    """The outcome of checking one file."""

    file: str
    kind: str | None
    findings: list[Finding] = field(default_factory=list)

    @property
    def errors(self) -> list[str]:
        return [f.located for f in self.findings if f.severity == "error"]

    @property
    def warnings(self) -> list[str]:
        return [f.located for f in self.findings if f.severity == "warning"]

    @property
    def ok(self) -> bool:
        return not self.errors


def check_file(path: str | Path) -> CheckResult:
    """Schema and semantic validation of one file, every finding with its line and column;
    never raises for bad input."""
    source = str(path)
    text = ""
    try:
        text = read_text(Path(path))
        document = document_from_data(parse_data(text, source), source)
    except SpecError as exc:
        # a text that does not parse has no field marks; parsing it again is wasted (or deep)
        marks = field_marks(text) if any(exc.fields) else {}
        at_parse = exc.position if isinstance(exc, ParseError) else None
        findings = [
            _finding(source, line, "error", name, at_parse if name is None else locate(name, marks))
            for line, name in zip(exc.problems, exc.fields, strict=True)
        ]
        return CheckResult(source, None, findings)
    marks = field_marks(text)
    problems = semantic_problems(document)
    if not any(p.severity == "error" for p in problems):
        problems += file_problems(document, Path(path))
    findings = [_finding(source, p.format(source), p.severity, p.path, locate(p.path, marks)) for p in problems]
    return CheckResult(source, kind_of(document), findings)


def _finding(source: str, text: str, severity: Severity, name: str | None, at: tuple[int, int] | None) -> Finding:
    line, column = at if at else (None, None)
    return Finding(source, text, severity, name, line, column)
