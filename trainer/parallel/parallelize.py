"""The parallel layout: a ("pp", "dp", "tp") DeviceMesh, tensor-parallel plans, FSDP2 over dp, and
pipeline stages with their schedule. Everything here is PyTorch's own distributed machinery; this
file only decides how the Llama blocks map onto it.
"""

from __future__ import annotations

import logging
import math
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel, SequenceParallel, parallelize_module
from torch.distributed.tensor.parallel import loss_parallel as tp_loss_parallel

from keel.trainer.config import DataParallelMode, JobConfig
from keel.trainer.model import Transformer
from keel.trainer.model_args import ModelArgs, padded_vocab_size, stage_layers
from keel.trainer.parallel.compile_blocks import apply_checkpointing_and_compile

# The train loop's logger: the stages built belong to its start-up story in the rank logs.
log = logging.getLogger("keel.train")


@dataclass
class Layout:
    """Where this process sits in the mesh."""

    mesh: DeviceMesh | None  # None on a single process
    pp: int
    dp: int
    tp: int
    pp_rank: int = 0
    dp_rank: int = 0
    tp_rank: int = 0

    @property
    def is_last_stage_rank(self) -> bool:
        return self.pp_rank == self.pp - 1

    def group(self, dim: str) -> dist.ProcessGroup | None:
        return self.mesh[dim].get_group() if self.mesh is not None else None


def build_layout(cfg: JobConfig, device: torch.device) -> Layout:
    par = cfg.parallel
    if cfg.world_size == 1:
        return Layout(mesh=None, pp=1, dp=1, tp=1)
    mesh = init_device_mesh(device.type, (par.pp, par.dp, par.tp), mesh_dim_names=("pp", "dp", "tp"))
    return Layout(mesh, par.pp, par.dp, par.tp, mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank(), mesh["tp"].get_local_rank())


def stage_ids(cfg: JobConfig, pp_rank: int) -> list[int]:
    """Pipeline stages held by this pp rank: the loop assignment r, r+pp, r+2pp, ... that
    ScheduleInterleaved1F1B expects."""
    return [pp_rank + k * cfg.parallel.pp for k in range(cfg.parallel.pp_virtual_stages)]


def build_stage_model(args: ModelArgs, cfg: JobConfig, stage: int) -> Transformer:
    """A pipeline stage on the meta device: shapes only, no memory. materialize() gives it storage once it
    is sharded, so no rank ever holds the whole stage (a 70B stage would not fit)."""
    n_stages = cfg.parallel.n_stages
    layer_ids = stage_layers(args.n_layers, n_stages, stage)
    padded_vocab = padded_vocab_size(args.vocab_size, cfg.parallel.tp)
    with torch.device("meta"):
        return Transformer(args, layer_ids, first=stage == 0, last=stage == n_stages - 1, padded_vocab=padded_vocab)


@torch.no_grad()
def materialize(model: Transformer, device: torch.device, seed: int) -> None:
    """Storage for this rank's shards only, then their initial values. A whole parameter is drawn in place
    (Transformer.draw_initial, seeded by its name); a sharded one is drawn whole into a buffer, one parameter
    at a time, and this rank keeps its slice. So every layout starts from the single process's weights and a
    rank's peak is its shards plus one whole parameter. DTensor's own random ops would avoid even that
    parameter, but their values depend on the layout (an offset-based generator per shard), and the parity
    tests compare layouts to one process."""
    model.to_empty(device=device)
    if model.args.tie_embeddings:
        model.tie_head()  # to_empty gives a plain tensor a new Parameter per module, which unties them
    model.init_buffers()
    for name, p in model.named_parameters():
        if not isinstance(p, DTensor):
            model.draw_initial(name, p, seed)
            continue
        whole = torch.empty(p.shape, dtype=p.dtype, device=device)
        model.draw_initial(name, whole, seed)
        local = _local_slice(whole, p)  # each rank slices the same whole value: no communication
        if local.shape != p.to_local().shape:
            raise RuntimeError(f"{name}: slice {tuple(local.shape)} for a shard of {tuple(p.to_local().shape)} ({p.placements})")
        p.to_local().copy_(local)
        del whole, local  # before the next one is made


def _local_slice(value: torch.Tensor, p: DTensor) -> torch.Tensor:
    """This rank's part of a parameter's whole value, as a view: the mesh's dimensions split it from the
    innermost (tp) out, because FSDP2 shards what tensor parallelism left on the rank (its _StridedShard
    placement records that order). Each split is torch.chunk's, as FSDP2's: the last ranks of an uneven
    dimension get less, or nothing. (distribute_tensor with src_data_rank=None gives the same values, but on
    the way it copied more than the whole matrix: 0.6 GiB more, for a 0.49 GiB embedding at dp4 tp2.)"""
    coordinate = p.device_mesh.get_coordinate()
    for mesh_dim in reversed(range(p.device_mesh.ndim)):
        placement = p.placements[mesh_dim]
        if placement.is_replicate():
            continue
        dim, parts, index = placement.dim, p.device_mesh.size(mesh_dim), coordinate[mesh_dim]
        pieces = torch.chunk(value, parts, dim)
        value = pieces[index] if index < len(pieces) else value.narrow(dim, 0, 0)
    return value


def apply_tensor_parallel(model: Transformer, tp_mesh: DeviceMesh, sequence_parallel: bool = False, loss_parallel: bool = False) -> None:
    """Megatron-style: q/k/v and gate/up split by output column, attention out and down by input row,
    so each of a block's two sub-blocks needs one all-reduce forward (its output) and one backward (its
    input's gradient). The embedding is split by vocabulary
    rows and the head by vocabulary columns; both are built padded to a multiple of 64 x tp rows
    (model_args.padded_vocab_size), so every rank holds an equal slice.

    sequence_parallel: between the blocks' matmuls the activations (the residual stream, the norms) are
    split by sequence position over the tp ranks; each all-reduce becomes a reduce-scatter into that
    split and an all-gather out of it, the same bytes, and the activations outside attention and the MLP
    take 1/tp of the memory (Korthikanti et al. 2022, section 4.2.2). loss_parallel: the loss is computed
    on each rank's vocabulary columns (torch's loss_parallel: a distributed log-softmax), never gathering
    the whole logits, which at a 128k vocabulary are the largest activation of all."""
    rows = Shard(1) if sequence_parallel else Replicate()  # how activations between the matmuls are laid out
    plan = {}
    if model.tok_embeddings is not None:
        plan["tok_embeddings"] = RowwiseParallel(input_layouts=Replicate(), output_layouts=rows)
    for i in model.layers:
        if sequence_parallel:
            for norm in ("attention_norm", "ffn_norm"):
                plan[f"layers.{i}.{norm}"] = SequenceParallel()
        # Each sub-block's input becomes one replicated DTensor that q/k/v (gate/up) all read: in the backward
        # their three (two) partial input gradients add up before a single all-reduce, Megatron's `f`. Under
        # sequence parallelism it is also where the sequence is all-gathered (reduce-scattered backward).
        plan[f"layers.{i}.attention"] = PrepareModuleInput(
            input_layouts=(rows, None, None), desired_input_layouts=(Replicate(), None, None)
        )
        plan[f"layers.{i}.feed_forward"] = PrepareModuleInput(input_layouts=(rows,), desired_input_layouts=(Replicate(),))
        for name in ("attention.wq", "attention.wk", "attention.wv", "feed_forward.w1", "feed_forward.w3"):
            plan[f"layers.{i}.{name}"] = ColwiseParallel()
        plan[f"layers.{i}.attention.wo"] = RowwiseParallel(output_layouts=rows)
        plan[f"layers.{i}.feed_forward.w2"] = RowwiseParallel(output_layouts=rows)
    if model.norm is not None and sequence_parallel:
        plan["norm"] = SequenceParallel()
    if model.output is not None:
        # Each rank's vocabulary columns: kept as a DTensor for the loss parallel, else gathered below.
        plan["output"] = ColwiseParallel(input_layouts=rows, use_local_output=not loss_parallel)
    parallelize_module(model, tp_mesh, plan)
    if model.args.tie_embeddings:
        # The plan gave the embedding and the head a DTensor each; both are Shard(0) over the same rows,
        # so the head can take the embedding's back and the matrix stays one parameter.
        model.tie_head()
    if model.output is None:
        return
    if loss_parallel:
        model.output.register_forward_hook(lambda _module, _inputs, logits: _mask_padding(logits, model.args.vocab_size))
        model.padding_masked = True
        return
    # Gathered by Keel rather than by the plan (output_layouts=Replicate): DTensor's to_local() returns
    # a view, and a view as an FSDP2 module's output would lose FSDP's pre-backward hook to any in-place
    # op on it (torch warns so on every rank). The gather returns a new tensor.
    group = tp_mesh.get_group()
    model.output.register_forward_hook(lambda _module, _inputs, local: _GatherVocab.apply(local, group))


def _mask_padding(logits: DTensor, vocab_size: int) -> DTensor:
    """The vocabulary-parallel logits with the padding columns at -inf, so that the softmax over the padded
    vocabulary is the unpadded model's (their probability is 0, and so is their gradient). Each rank masks
    its own columns: nothing is gathered."""
    local = logits.to_local()
    width = local.shape[-1]
    first = logits.device_mesh.get_local_rank() * width  # Shard(-1): rank r holds columns [r*width, (r+1)*width)
    padding = torch.arange(first, first + width, device=local.device) >= vocab_size
    masked = local.masked_fill(padding, float("-inf"))
    return DTensor.from_local(masked, logits.device_mesh, logits.placements, run_check=False)


def loss_context(cfg: JobConfig, layout: Layout) -> AbstractContextManager:
    """The context a step's forward and backward run in: torch's loss_parallel when the loss is computed on
    the vocabulary-parallel logits (its log-softmax and its backward both need it)."""
    return tp_loss_parallel() if cfg.parallel.loss_parallel and layout.tp > 1 else nullcontext()


class _GatherVocab(torch.autograd.Function):
    """The head's vocabulary-parallel logits, gathered along the last dimension into a new tensor
    (Megatron-LM's gather_from_tensor_model_parallel_region). Every tp rank then computes the same loss
    on the whole logits, so the gradient flowing back is each rank's own slice, not a sum."""

    @staticmethod
    def forward(ctx, local: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.group = group
        parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
        dist.all_gather(parts, local.contiguous(), group=group)
        return torch.cat(parts, dim=-1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        own = grad.chunk(dist.get_world_size(ctx.group), dim=-1)[dist.get_rank(ctx.group)]
        return own.contiguous(), None


def apply_fsdp(model: Transformer, dp_mesh: DeviceMesh, mode: DataParallelMode, bf16: bool) -> None:
    """ZeRO-3 (reshard after forward) or ZeRO-2 (keep parameters gathered until backward), one FSDP
    unit per block so the all-gather of block i+1 overlaps the compute of block i."""
    reshard = mode == "zero3"
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32) if bf16 else MixedPrecisionPolicy()
    for block in model.layers.values():
        fully_shard(block, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=mp)
    fully_shard(model, mesh=dp_mesh, reshard_after_forward=reshard, mp_policy=mp)


def uses_fsdp(cfg: JobConfig) -> bool:
    return cfg.parallel.dp > 1 and cfg.parallel.dp_mode != "replicate"


def mixed_precision(cfg: JobConfig, device: torch.device) -> tuple[bool, AbstractContextManager]:
    """(bf16 on?, the context the forward runs in). training.dtype=auto means bf16 on CUDA, fp32 on CPU.
    FSDP applies bf16 itself (its MixedPrecisionPolicy); everything else gets autocast."""
    bf16 = cfg.training.bf16(on_gpu=device.type == "cuda")
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if bf16 and not uses_fsdp(cfg) else nullcontext()
    return bf16, autocast


def build_model_parts(cfg: JobConfig, args: ModelArgs, layout: Layout, device: torch.device, bf16: bool) -> list[Transformer]:
    """The model chunks this process holds (one, or v under interleaving), sharded and ready. On the meta device
    they stay shapes only (keel.trainer.planning.simulate reads what a rank would hold)."""
    parts = []
    for stage in stage_ids(cfg, layout.pp_rank):
        model = build_stage_model(args, cfg, stage)
        padding = sum(p.numel() for p in model.parameters()) - model.real_parameter_count()
        log.info("pipeline stage %d built: %d parameters (+%d of vocabulary padding)", stage, model.real_parameter_count(), padding)
        if layout.tp > 1:
            apply_tensor_parallel(model, layout.mesh["tp"], cfg.parallel.sequence_parallel, cfg.parallel.loss_parallel)
        apply_checkpointing_and_compile(model, cfg.training.activation_checkpointing, cfg.training.compile)
        if cfg.training.activation_checkpointing != "none":
            log.info(
                "activation checkpointing (%s) on the %d blocks of stage %d",
                cfg.training.activation_checkpointing,
                len(model.layers),
                stage,
            )
        if cfg.training.compile:
            log.info("torch.compile on the %d blocks of stage %d", len(model.layers), stage)
        if uses_fsdp(cfg):
            apply_fsdp(model, layout.mesh["dp"], cfg.parallel.dp_mode, bf16)
        if device.type != "meta":
            materialize(model, device, cfg.training.seed)
        parts.append(model)
    return parts


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())


def build_schedule(cfg: JobConfig, parts: list[Transformer], layout: Layout, device: torch.device, last_stage_loss):
    """A torch.distributed.pipelining schedule over this rank's stages. Gradients are scaled by
    1/microbatches (scale_grads) so the loss matches the mean over the whole batch."""
    # Imported here, by pipelined runs only: torch.distributed.pipelining costs a process 0.6 s of CPU to
    # import (keel train's workers are forked with it imported: keel.trainer.launch.fork_server).
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti, PipelineScheduleSingle, get_schedule_class

    group = layout.group("pp")
    stages = [
        PipelineStage(part, stage, cfg.parallel.n_stages, device, group=group) for part, stage in zip(parts, stage_ids(cfg, layout.pp_rank))
    ]
    kind = get_schedule_class(cfg.parallel.pp_schedule)  # PipelineSchedule's names are PyTorch's own, as in TorchTitan
    if issubclass(kind, PipelineScheduleMulti):
        return kind(stages, n_microbatches=cfg.training.microbatches, loss_fn=last_stage_loss, scale_grads=True)
    assert issubclass(kind, PipelineScheduleSingle)
    return kind(stages[0], n_microbatches=cfg.training.microbatches, loss_fn=last_stage_loss, scale_grads=True)


def all_reduce_replicated_grads(parts: list[Transformer], layout: Layout) -> None:
    """dp_mode=replicate: average gradients over dp after backward (DDP without bucketing)."""
    group = layout.group("dp")
    grads = [p.grad for part in parts for p in part.parameters() if p.grad is not None]
    local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
    flat = torch.cat([g.reshape(-1) for g in local])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    flat /= layout.dp
    offset = 0
    for g in local:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


def global_grad_norm(parts: list[Transformer], layout: Layout, local_loss_finite: bool = True) -> torch.Tensor:
    """The L2 norm of the whole model's gradient, the same number on every rank. It is NaN on every
    rank when any rank's gradient or loss is not finite (`local_loss_finite`): the NaN guard's verdict
    rides on this all-reduce, so every rank skips the same steps.

    Each rank sums the squares of its local gradient shard, divided by how many ranks hold a copy of
    that same shard (a parameter of one pipeline stage lives on dp·tp ranks; dims it is sharded over
    do not copy it). One all-reduce over the world then counts every element exactly once, across
    dp and tp shards and across pipeline stages."""
    holders = layout.dp * layout.tp
    total = torch.zeros((), dtype=torch.float64, device=next(parts[0].parameters()).device)
    for part in parts:
        for p in part.parameters():
            if p.grad is None:
                continue
            g = p.grad
            shards = 1
            if isinstance(g, DTensor):
                g = _reduced(g)
                shards = _shard_count(g)
                g = g.to_local()
            total += g.detach().double().pow(2).sum() / (holders // shards)
    if not local_loss_finite:
        total += math.nan
    if layout.mesh is not None:
        dist.all_reduce(total)
    return total.sqrt()


def _reduced(grad: DTensor) -> DTensor:
    """The gradient with its pending sums done. Under sequence parallelism a norm's weight is replicated
    over tp, but each rank's gradient covers its own sequence positions only: DTensor leaves it Partial
    and sums it where it is used (the optimizer's update), so its squares must be taken after the sum."""
    if not any(placement.is_partial() for placement in grad.placements):
        return grad
    return grad.redistribute(grad.device_mesh, [Replicate() if p.is_partial() else p for p in grad.placements])


def _shard_count(t: DTensor) -> int:
    """How many pieces t is split into. FSDP over a TP-sharded dim uses _StridedShard, for which
    is_shard() is False, so count every placement that is neither a copy nor a pending sum."""
    count = 1
    for size, placement in zip(t.device_mesh.shape, t.placements):
        if not (placement.is_replicate() or placement.is_partial()):
            count *= size
    return count
