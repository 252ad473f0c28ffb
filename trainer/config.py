"""Job configuration: dataclasses, TOML presets, dotted command-line overrides, and validation.

Everything a worker needs is in one `JobConfig`. It is loaded and validated in the launcher, before
any process starts, so that bad input ends in one line naming the field and the fix. The parser checks
each value against its field's type (a Literal lists the choices); each section's validate() checks its
own fields, and validate(cfg) adds the checks that span sections.
"""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import os
import tomllib
import types
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any, Literal, get_args, get_origin, get_type_hints

from keel.chaos.fault_specs import parse_fault
from keel.chaos.kinds import KINDS
from keel.monitor.config_fields import WandbMode, at_least
from keel.monitor.detectors import SpikeConfig
from keel.monitor.redact import redact
from keel.monitor.stragglers import StragglerConfig
from keel.trainer.model_args import MODEL_PRESETS, model_args

# The choices of the enum-like settings, here only: the parser (_coerce) rejects any other value.
PipelineSchedule = Literal["GPipe", "1F1B", "Interleaved1F1B"]  # torch.distributed.pipelining's schedule names
DataParallelMode = Literal["zero3", "zero2", "zero1", "replicate"]
TrainingDtype = Literal["auto", "fp32", "bf16"]
ActivationCheckpointing = Literal["none", "selective", "full"]  # per block: see keel.trainer.parallel.activation_checkpoint
RankRows = Literal["sampled", "every_step"]  # which steps keep a row per rank in the run store
MAX_VAL_FRACTION = 0.5  # data.val_fraction: at most half the source is held out


class ConfigError(ValueError):
    """Bad user input. The message is one line: the field, what is wrong, and the fix."""


@dataclass
class ModelConfig:
    # A named shape from keel.trainer.model_args.MODEL_PRESETS; the fields below override it when set.
    preset: str = "tiny"
    dim: int | None = None  # the model width (d_model)
    n_layers: int | None = None  # transformer blocks
    n_heads: int | None = None  # attention heads
    n_kv_heads: int | None = None  # key/value heads (grouped-query attention; n_heads: plain multi-head)
    ffn_dim: int | None = None  # the SwiGLU feed-forward's hidden width
    # The tokenizer's vocabulary (e.g. 50304, 128256): token ids must be below it. Built padded for tensor
    # parallelism (keel.trainer.model_args.padded_vocab_size); counted unpadded.
    vocab_size: int | None = None
    # The head shares the token embedding's matrix (true in the 1b preset, as in Llama 3.2 1B). Needs the
    # embedding and the head on one pipeline stage: refused with pp*pp_virtual_stages > 1.
    tie_embeddings: bool | None = None

    def validate(self) -> None:
        if self.preset not in MODEL_PRESETS:
            raise ConfigError(f"model.preset={self.preset!r}: choose one of {sorted(MODEL_PRESETS)}")
        for name, value in vars(self).items():
            if name not in ("preset", "tie_embeddings") and value is not None:
                at_least(f"model.{name}", value, 1, f"set --model.{name} to a positive integer")


@dataclass
class DataConfig:
    # "builtin" reads the Python standard library's source as bytes; anything else is a token file
    # (`keel prepare-data`'s, with its JSON sidecar, or nanoGPT's uint16 .bin) or a Megatron-LM indexed
    # dataset's PREFIX (PREFIX.bin + PREFIX.idx): docs/data.md.
    source: str = "builtin"
    # A blend instead of data.source, as Megatron-LM's --data-path: a weight, then its source, in pairs, e.g.
    # ["0.7", "web.bin", "0.3", "code.bin"] ('0.7;web.bin;0.3;code.bin' on the command line). Each batch row
    # draws its source by weight (normalized to sum to 1). []: data.source alone. docs/data.md#blends.
    sources: list[str] = field(default_factory=list)
    # The tokenizer file the job's model expects ("": not checked): a tokenizer.json, a SentencePiece .model or
    # a tiktoken file. A token file whose sidecar names another tokenizer (by sha256) is refused before any
    # worker starts.
    tokenizer: str = ""
    seq_len: int = 64  # tokens per sequence: the context the model is trained on
    # Batch index ranges never read, e.g. ["80:107"] (end excluded): a run that skips what another
    # run's rollback skipped, for a like-for-like comparison (the rollback event says which batches).
    skip_batches: list[str] = field(default_factory=list)
    # The fraction of the source's tokens, at its end, held out for validation (eval.every): training never
    # reads them. 0: none held out. It changes the training data: keep it when a run is resumed.
    val_fraction: float = 0.0
    # Leave out of the loss the token after each end-of-document id (Megatron-LM's --eod-mask-loss): the
    # first token of an unrelated document is not predictable from the one before. Needs a source that
    # records its end-of-document id (keel.trainer.data.documents).
    mask_eod: bool = False

    def validate(self) -> None:
        from keel.trainer.data.loader import parse_skip_ranges  # here, not at the top: keel.trainer.data.loader imports this module

        at_least("data.seq_len", self.seq_len, 1)
        if not 0 <= self.val_fraction <= MAX_VAL_FRACTION:
            raise ConfigError(
                f"data.val_fraction={self.val_fraction}: must be in [0, {MAX_VAL_FRACTION}]; 0 holds nothing out, 0.01 keeps the last 1% of the tokens for validation"
            )
        parse_skip_ranges(self.skip_batches)
        self._validate_sources()

    def _validate_sources(self) -> None:
        from keel.trainer.data.blend import parse_sources  # here, not at the top: it imports this module

        if not self.sources:
            return
        if self.source != DataConfig.source:  # the field's default
            raise ConfigError(
                f"data.source={self.source} and data.sources={self.sources} are both set; a blend names all its sources in data.sources: "
                f"add {self.source} there with a weight, or unset data.sources"
            )
        if self.val_fraction:
            raise ConfigError(
                f"data.val_fraction={self.val_fraction} holds out the end of data.source, and a blend (data.sources) has no one end; "
                f"set data.val_fraction=0 and name the validation data with --eval.source=PATH"
            )
        parse_sources(self.sources)


@dataclass
class TrainingConfig:
    steps: int = 20  # optimizer steps of the whole run (the LR schedule's length)
    global_batch_size: int = 8  # sequences per optimizer step, over all dp ranks
    microbatches: int = 1  # per dp rank; the pipeline schedule's n_microbatches when pp > 1
    seed: int = 0  # the model's initialization and the batches drawn (a batch is a function of seed and its index)
    dtype: TrainingDtype = "auto"  # auto: bf16 mixed precision on CUDA, fp32 on CPU
    activation_checkpointing: ActivationCheckpointing = "none"  # recompute in the backward instead of keeping
    compile: bool = False  # torch.compile each transformer block (inductor; its first step compiles)

    def bf16(self, on_gpu: bool) -> bool:
        """Whether the job trains in bf16 mixed precision on this kind of device (`auto`: on GPUs)."""
        return self.dtype == "bf16" or (self.dtype == "auto" and on_gpu)

    def validate(self) -> None:
        at_least("training.steps", self.steps, 1)
        at_least("training.microbatches", self.microbatches, 1)


@dataclass
class EvalConfig:
    # The validation loss every this many steps, and after the last step (0: never). It reads the validation
    # data only, under no_grad: training's parameters, optimizer, data position and RNG are untouched, so the
    # training losses are the same with it on or off.
    every: int = 0
    batches: int = 4  # global batches of the validation data per evaluation: the same ones every time
    # The validation data: "" is the held-out end of data.source (data.val_fraction); else a source of its
    # own, of any kind data.source takes, with the same vocabulary.
    source: str = ""

    def validate(self) -> None:
        at_least("eval.every", self.every, 0, "0 turns evaluation off")
        at_least("eval.batches", self.batches, 1)


@dataclass
class OptimConfig:
    lr: float = 3e-3  # peak learning rate, reached after warmup_steps
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 5  # linear from 0 to lr, then cosine decay over the remaining steps
    weight_decay: float = 0.1  # AdamW's decoupled decay, on matrices only (norm weights are not decayed)
    beta1: float = 0.9  # AdamW's first-moment decay
    beta2: float = 0.95  # AdamW's second-moment decay
    eps: float = 1e-8  # AdamW's denominator term
    grad_clip: float = 1.0  # the global gradient norm is clipped to this; 0 turns clipping off

    def validate(self) -> None:
        if not self.lr > 0:
            raise ConfigError(f"optim.lr={self.lr}: must be positive")
        if self.warmup_steps < 0:
            raise ConfigError(f"optim.warmup_steps={self.warmup_steps}: must be 0 or more")
        if not self.grad_clip >= 0:
            raise ConfigError(f"optim.grad_clip={self.grad_clip}: must be 0 (no clipping) or a positive norm")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ConfigError(f"optim.min_lr_ratio={self.min_lr_ratio}: must be in [0, 1]")
        if not self.weight_decay >= 0:
            raise ConfigError(f"optim.weight_decay={self.weight_decay}: must be 0 or more")
        for name in ("beta1", "beta2"):
            if not 0 <= getattr(self, name) < 1:
                raise ConfigError(f"optim.{name}={getattr(self, name)}: must be in [0, 1)")
        if not self.eps > 0:
            raise ConfigError(f"optim.eps={self.eps}: must be positive")


@dataclass
class ParallelConfig:
    pp: int = 1  # pipeline-parallel degree: the layers split over pp ranks
    dp: int = 1  # data-parallel degree: each dp rank takes global_batch_size / dp sequences a step
    tp: int = 1  # tensor-parallel degree (Megatron-style: attention heads and the feed-forward split over tp ranks)
    pp_schedule: PipelineSchedule = "1F1B"  # the pipeline schedule, under pp > 1
    pp_virtual_stages: int = 1  # v stages per pp rank; more than 1 only with Interleaved1F1B
    dp_mode: DataParallelMode = "zero3"  # zero3 | zero2: FSDP2 (ZeRO-3 | ZeRO-2); replicate: gradients all-reduced
    # zero1 (the optimizer state sharded alone: Megatron's distributed optimizer, DeepSpeed's stage 1) and cp > 1
    # (each sequence split over cp ranks, ring attention) are planned by `keel plan`, not run by keel train yet.
    cp: int = 1
    # Both are ignored at tp 1, so a job resumed on fewer ranks keeps its config.
    sequence_parallel: bool = False  # tp > 1: norms and residual stream split by sequence over the tp ranks (Korthikanti et al. 2022)
    loss_parallel: bool = False  # tp > 1: the loss on each rank's vocabulary columns, logits never gathered (TorchTitan's loss parallel)
    # Set by `keel train --nnodes MIN:MAX` to the full job's dp: a world that lost nodes trains at the largest
    # dp it holds (pp and tp kept), with the same global batch in more micro-batches of the same size. 0: fixed.
    elastic_dp: int = 0

    @property
    def n_stages(self) -> int:
        """Pipeline stages of the whole model, over all pp ranks."""
        return self.pp * self.pp_virtual_stages

    def validate(self) -> None:
        for name in ("pp", "dp", "tp", "cp", "pp_virtual_stages"):
            at_least(f"parallel.{name}", getattr(self, name), 1)
        if self.pp_virtual_stages > 1 and self.pp_schedule != "Interleaved1F1B":
            raise ConfigError(
                f"parallel.pp_virtual_stages={self.pp_virtual_stages}: virtual stages need "
                f"parallel.pp_schedule=Interleaved1F1B, or set pp_virtual_stages=1"
            )


@dataclass
class MetricsConfig:
    log_every: int = 1  # console progress line
    comm_sample_every: int = 10  # profile one step in this many to measure comm_share
    # Per-rank rows of the run store: on those sampled steps only, or on every step (a small job whose
    # rank x step heatmaps should show every step). Every step row keeps the ranks' spread either way.
    rank_rows: RankRows = "sampled"
    # MFU's peak per device, in TFLOP/s; 0: the data-sheet peak of a known GPU, a matmul calibration on
    # CPU. Set it for a GPU the table does not know, or to compare MFU across CPU runs (the calibration
    # varies with the machine's load).
    peak_tflops: float = 0.0
    # Before the first step, time the link and print keel plan's estimate of this layout on this hardware;
    # keep it in the run for `keel plan --check RUN_DIR` (keel train --plan).
    plan: bool = False

    def validate(self) -> None:
        if self.comm_sample_every < 1 or self.log_every < 1:
            raise ConfigError("metrics.comm_sample_every and metrics.log_every must be at least 1")
        at_least("metrics.peak_tflops", self.peak_tflops, 0, "0 uses the GPU's data-sheet peak or a CPU calibration")


@dataclass
class MonitorConfig:
    prometheus: bool = True  # /metrics exporter on rank 0
    prometheus_host: str = "127.0.0.1"  # the address /metrics listens on (0.0.0.0: every interface)
    prometheus_port: int = 9400  # busy: the next free port, logged
    prometheus_linger_s: float = 0.0  # keep /metrics up this long after the last step, for short jobs
    pushgateway_url: str = ""  # push the final state here at the end (short jobs)
    wandb: bool = True  # on by default: without an API key W&B logs offline and never waits on the network
    wandb_project: str = "keel"  # the W&B project the run is logged to
    wandb_mode: WandbMode = "auto"  # auto: online with an API key, offline without (RUN_DIR/wandb/, for `wandb sync`)
    wandb_min_interval_s: float = 1.0  # at most one W&B log per this many seconds (every step if steps are slower)
    webhook_url: str = ""  # Slack-compatible incoming webhook for Keel's alerts (a secret: never written out)
    alert_throttle_s: float = 300.0  # one alert of a kind per this many seconds
    sink_queue_size: int = 1000  # per sink; when full, metrics are dropped and counted, training never waits

    def validate(self) -> None:
        if not 0 <= self.prometheus_port < 65536:
            raise ConfigError(f"monitor.prometheus_port={self.prometheus_port}: choose a port in 1-65535 (0: any free port)")


@dataclass
class CheckpointConfig:
    # A save starts when either interval is reached (0 turns that interval off). Both off: no checkpoints.
    interval_steps: int = 0
    # Young's rule (J. W. Young, "A first order approximation to the optimum checkpoint interval", 1974):
    # interval = sqrt(2 * save time * mean time between failures); a 1-minute save and a failure every
    # 8 hours give 31 minutes.
    interval_minutes: float = 30.0
    keep: int = 3  # the newest K checkpoints are kept ...
    keep_lookback_steps: int = 200  # ... plus one at least this many steps older (under twice that), for a rollback past them
    async_save: bool = True  # training goes on while the shards are written
    # In-memory snapshots (keel.trainer.checkpoint.snapshots): a rollback restores the newest one before the
    # bad steps, in milliseconds. Taken as often as their copies stay under this fraction of the step time
    # (0: none; a rollback then needs a checkpoint) ...
    snapshot_cost: float = 0.01
    snapshot_every_steps: int = 0  # ... or every this many steps (0: as snapshot_cost allows)
    # The newest two are also written here, in host memory (a tmpfs), so that a restart after a crash, hang or
    # out-of-memory resumes from them rather than from the last checkpoint; removed when the run ends. "": none.
    snapshot_dir: str = "/dev/shm"
    # On SIGTERM or SIGUSR1 (a preemption: SLURM, Kubernetes) the run saves the current step and ends within
    # this many seconds; a save that cannot finish in time leaves the newest complete checkpoint. Keep it
    # under the scheduler's own grace (SLURM's KillWait and Kubernetes' terminationGracePeriodSeconds: 30).
    preempt_grace_s: float = 20.0

    def snapshot_folder(self, run_dir: str | Path) -> Path | None:
        """The folder in snapshot_dir for the run in `run_dir` (named by its path: two runs never share one);
        None when snapshot files are off (keel.trainer.checkpoint.snapshots)."""
        if not self.snapshot_dir:
            return None
        key = hashlib.sha256(str(Path(run_dir).resolve()).encode()).hexdigest()[:16]
        return Path(self.snapshot_dir) / f"keel-snapshots-{key}"

    def validate(self) -> None:
        if not self.preempt_grace_s > 0:
            raise ConfigError(
                f"checkpoint.preempt_grace_s={self.preempt_grace_s}: must be positive (seconds); "
                "keep it under the scheduler's grace, 30 s by default"
            )
        at_least("checkpoint.interval_steps", self.interval_steps, 0, "0 turns step-based saves off")
        at_least("checkpoint.interval_minutes", self.interval_minutes, 0, "0 turns time-based saves off")
        at_least("checkpoint.keep", self.keep, 1)
        at_least("checkpoint.snapshot_every_steps", self.snapshot_every_steps, 0, "0 takes snapshots as often as snapshot_cost allows")
        if not 0 <= self.snapshot_cost < 1:
            raise ConfigError(
                f"checkpoint.snapshot_cost={self.snapshot_cost}: must be in [0, 1), a fraction of the step time; 0 turns snapshots off"
            )
        at_least("checkpoint.keep_lookback_steps", self.keep_lookback_steps, 0)


@dataclass
class RecoveryConfig:
    nonfinite_limit: int = 3  # this many non-finite steps in a row (each skipped) trigger a rollback
    rollback: bool = True  # roll back on a confirmed loss spike or nonfinite_limit; false: alert only
    skip_data: bool = True  # after a rollback, skip the batches read since the checkpoint ...
    skip_margin: int = 5  # ... and this many more
    lr_factor: float = 1.0  # multiply the LR by this after a rollback ...
    lr_factor_steps: int = 0  # ... for this many steps (0: no change)
    max_rollbacks: int = 3  # rollbacks without getting past the last rollback's step before the run stops
    oom_halve_microbatch: bool = True  # on out-of-memory, retry with half the micro-batch (twice the micro-batches)
    # After a halving, try the larger micro-batch again this many steps later (0: keep the smaller one) ...
    # 20: a transient out-of-memory's halving costs 7 steps' time on the main job (35% a step), 100 cost 35;
    # a memory that stays short costs a failed retry (a restart from a snapshot) at 20, 60, 140, ... steps.
    oom_retry_steps: int = 20
    oom_retry_backoff: int = 2  # ... and wait this many times longer after a retry that ran out of memory again

    def validate(self) -> None:
        at_least("recovery.nonfinite_limit", self.nonfinite_limit, 1)
        at_least("recovery.oom_retry_steps", self.oom_retry_steps, 0, "0 keeps the halved micro-batch for the rest of the run")
        at_least("recovery.oom_retry_backoff", self.oom_retry_backoff, 1, "1 retries at the same interval every time")
        at_least("recovery.skip_margin", self.skip_margin, 0)
        at_least("recovery.max_rollbacks", self.max_rollbacks, 0)
        at_least("recovery.lr_factor_steps", self.lr_factor_steps, 0)
        if not 0 < self.lr_factor <= 1:
            raise ConfigError(f"recovery.lr_factor={self.lr_factor}: must be in (0, 1]; 1 keeps the LR after a rollback")


@dataclass
class WatchdogConfig:
    enabled: bool = True  # a watchdog thread per rank (false: none)
    floor_s: float = 10.0  # a step may always take this long (a stall of a loaded machine is not a hang) ...
    step_factor: float = 5.0  # ... or this many times the median of the last `window` steps (the step after a checkpoint: twice that)
    window: int = 50  # steps whose median sets the allowance
    warmup_steps: int = 3  # steps of each process timed by startup_s (compilation, first allocations, first profiled step)
    startup_s: float = 600.0  # start-up until the first step ends: process group, model build, resume
    checkpoint_s: float = 600.0  # a checkpoint save or load
    poll_s: float = 1.0  # how often the watchdog looks

    def validate(self) -> None:
        for name in ("floor_s", "startup_s", "checkpoint_s", "poll_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"watchdog.{name}={getattr(self, name)}: must be positive (seconds)")
        at_least("watchdog.step_factor", self.step_factor, 1.0)
        at_least("watchdog.window", self.window, 1)
        at_least("watchdog.warmup_steps", self.warmup_steps, 0)


@dataclass
class ChaosConfig:
    # Fault plan, e.g. ["nan@step=40,rank=1"]; on the command line: --fault nan@step=40,rank=1 (repeatable).
    faults: list[str] = field(default_factory=list)
    # Random faults: exponentially distributed gaps with this mean, in steps (0: none), each of a kind
    # drawn from random_kinds on a random rank, the same draw for the same seed.
    mtbf_steps: float = 0.0
    random_kinds: list[str] = field(default_factory=lambda: ["nan", "crash", "hang", "oom"])  # fault kinds: docs/chaos.md
    random_seed: int = 0  # the random faults' draw: steps, kinds and ranks

    def validate(self) -> None:
        for spec in self.faults:
            parse_fault(spec)
        at_least("chaos.mtbf_steps", self.mtbf_steps, 0, "0 turns random faults off")
        if self.mtbf_steps > 0 and not self.random_kinds:
            raise ConfigError("chaos.random_kinds is empty; list the kinds to draw (e.g. 'nan;crash') or set chaos.mtbf_steps=0")
        for kind in self.random_kinds:
            if kind not in KINDS:
                raise ConfigError(f"chaos.random_kinds: unknown fault '{kind}'; choose from {list(KINDS)}")


@dataclass
class RunConfig:
    run_dir: str = ""  # default: runs/<run_id>
    run_id: str = ""  # default: a timestamp
    resume: bool = False  # start from the newest good checkpoint in run_dir (keel train --resume RUN_DIR)

    def validate(self) -> None:
        """Nothing to check without the disk: the launcher checks run_dir with check_run_dir."""


@dataclass
class JobConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    recovery: RecoveryConfig = field(default_factory=RecoveryConfig)
    spike: SpikeConfig = field(default_factory=SpikeConfig)
    watchdog: WatchdogConfig = field(default_factory=WatchdogConfig)
    stragglers: StragglerConfig = field(default_factory=StragglerConfig)
    chaos: ChaosConfig = field(default_factory=ChaosConfig)
    run: RunConfig = field(default_factory=RunConfig)

    @property
    def world_size(self) -> int:
        return self.parallel.pp * self.parallel.dp * self.parallel.cp * self.parallel.tp

    @property
    def microbatch_rows(self) -> int:
        """Sequences in one micro-batch of one dp rank."""
        return self.training.global_batch_size // self.parallel.dp // self.training.microbatches

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)


def preset_names() -> list[str]:
    folder = resources.files("keel.trainer") / "presets"
    return sorted(p.name.removesuffix(".toml") for p in folder.iterdir() if p.name.endswith(".toml"))


def _read_toml(source: str) -> tuple[dict, str]:
    """Reads a config file, or a preset shipped with Keel when `source` is a preset name."""
    path = Path(source)
    if path.suffix == ".toml" or path.exists():
        if not path.is_file():
            raise ConfigError(f"--config {source}: file not found; pass a TOML file or one of the presets {preset_names()}")
        text, origin = path.read_text(), str(path)
    elif source in preset_names():
        text = (resources.files("keel.trainer") / "presets" / f"{source}.toml").read_text()
        origin = f"preset {source}"
    else:
        raise ConfigError(f"--config {source}: no such file or preset; presets are {preset_names()}")
    try:
        return tomllib.loads(text), origin
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"--config {source}: invalid TOML ({e}); fix the file") from None


def _to_int(value: Any) -> int:
    if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
        raise ValueError  # int() would read true as 1 and cut 2.5 to 2
    return int(value)


def _to_bool(value: Any) -> bool:
    if isinstance(value, str):
        if value.lower() not in ("true", "false", "1", "0"):
            raise ValueError
        return value.lower() in ("true", "1")
    return bool(value)


# How a TOML value or a command-line string becomes a field of each scalar type.
_SCALAR_PARSERS: dict[type, Callable[[Any], Any]] = {int: _to_int, float: float, bool: _to_bool, str: str}


def _coerce(key: str, value: Any, annotation: Any) -> Any:
    """Converts a TOML value or a command-line string to the field's type (its evaluated annotation)."""
    if value is None:
        return None
    inner = [a for a in get_args(annotation) if a is not type(None)]
    if isinstance(annotation, types.UnionType) and len(inner) == 1:  # X | None: a field that may stay unset
        annotation = inner[0]
    if get_origin(annotation) is Literal:
        if value not in get_args(annotation):
            raise ConfigError(f"{key}={value!r}: choose one of {list(get_args(annotation))}")
        return value
    if annotation == list[str]:
        items = _list_from_text(key, value) if isinstance(value, str) else value
        if not isinstance(items, list):
            raise ConfigError(f"{key}={value!r}: expected a list of strings; fix the value")
        return [str(v).strip() for v in items if str(v).strip()]
    if annotation not in _SCALAR_PARSERS:
        raise TypeError(f"{key}: the config parser cannot read a field annotated {annotation}; give _coerce a case for it")
    try:
        return _SCALAR_PARSERS[annotation](value)
    except (TypeError, ValueError):
        raise ConfigError(f"{key}={value!r}: expected {annotation.__name__}; fix the value") from None


def _list_from_text(key: str, text: str) -> list:
    """A list given on the command line: 'a;b', or as TOML writes it, '["a", "b"]' (what the config file holds)."""
    if not text.lstrip().startswith("["):
        return text.split(";")
    try:
        return tomllib.loads(f"value = {text}")["value"]
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{key}={text!r}: not a TOML list ({e}); write '[\"a\", \"b\"]' or 'a;b'") from None


def _apply(cfg: JobConfig, section: str, key: str, value: Any) -> None:
    sections = {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg)}
    if section not in sections:
        close = difflib.get_close_matches(section, sections, n=1)
        hint = f"did you mean '{close[0]}'?" if close else f"sections are {sorted(sections)}"
        raise ConfigError(f"unknown config section '{section}': {hint}")
    target = sections[section]
    fields = {f.name: f for f in dataclasses.fields(target)}
    if key not in fields:
        close = difflib.get_close_matches(key, fields, n=1)
        hint = f"did you mean '{section}.{close[0]}'?" if close else f"keys are {sorted(fields)}"
        raise ConfigError(f"unknown config key '{section}.{key}': {hint}")
    setattr(target, key, _coerce(f"{section}.{key}", value, get_type_hints(type(target))[key]))


def load_config(source: str | None = None, overrides: list[str] | dict[str, Any] = ()) -> JobConfig:
    """Builds a JobConfig from a file or preset, then dotted overrides ("optim.lr=3e-4" or a dict)."""
    cfg = JobConfig()
    if source:
        data, origin = _read_toml(source)
        for section, values in data.items():
            if not isinstance(values, dict):
                raise ConfigError(f"{origin}: top-level key '{section}' must be a [section] table")
            for key, value in values.items():
                _apply(cfg, section, key, value)
    items = overrides.items() if isinstance(overrides, dict) else (_split_override(o) for o in overrides)
    for dotted, value in items:
        section, _, key = dotted.partition(".")
        if not key:
            raise ConfigError(f"override '{dotted}': use section.key=value, for example optim.lr=3e-4")
        _apply(cfg, section, key, value)
    return cfg


def _split_override(text: str) -> tuple[str, str]:
    dotted, sep, value = text.removeprefix("--").partition("=")
    if not sep:
        raise ConfigError(f"override '{text}': use --section.key=value, for example --optim.lr=3e-4")
    return dotted, value


def divisors(n: int) -> list[int]:
    """The numbers that divide n, the choices a divisibility error offers and the planner enumerates."""
    return [d for d in range(1, n + 1) if n % d == 0]


def validate(cfg: JobConfig, world_size: int | None = None) -> None:
    """Raises ConfigError for the first problem found. Needs no process group and no data.

    Each section checks its own fields first; then come the checks that span sections."""
    for section in vars(cfg).values():
        try:
            section.validate()
        except ValueError as e:  # the spike, straggler and fault-spec checks live outside keel.trainer: plain ValueError
            raise ConfigError(str(e)) from None
    validate_runnable(cfg)
    fit_elastic_world(cfg, world_size)
    par = cfg.parallel
    if world_size is not None and world_size != cfg.world_size:
        raise ConfigError(
            f"parallel: pp*dp*tp = {par.pp}*{par.dp}*{par.tp} = {cfg.world_size} but {world_size} processes were "
            f"started; set --pp/--dp/--tp so their product is {world_size}, or start {cfg.world_size} processes"
        )
    validate_layout(cfg)
    _validate_eval_data(cfg)


def fit_elastic_world(cfg: JobConfig, world_size: int | None) -> None:
    """An elastic job (parallel.elastic_dp) at the dp its world holds: `world_size` processes, or the full
    job's where None (the launcher). The micro-batch keeps its size, so the global batch, the LR schedule
    and the data order stay the run's; only the number of micro-batches changes."""
    par, train = cfg.parallel, cfg.training
    if not par.elastic_dp:
        return
    world_size = world_size or par.pp * par.elastic_dp * par.tp
    if world_size % (par.pp * par.tp):
        raise ConfigError(f"{world_size} processes: an elastic job keeps pp*tp = {par.pp * par.tp}, which they do not divide")
    dp, rows = world_size // (par.pp * par.tp), cfg.microbatch_rows
    if train.global_batch_size % (dp * rows):
        raise ConfigError(
            f"training.global_batch_size={train.global_batch_size}: at dp {dp} it is no whole number of micro-batches of "
            f"{rows} sequences; choose a global batch that dp {dp} and dp {par.elastic_dp} both divide"
        )
    par.dp, train.microbatches = dp, train.global_batch_size // (dp * rows)


def _validate_eval_data(cfg: JobConfig) -> None:
    if cfg.eval.every and not cfg.eval.source and not cfg.data.val_fraction:
        raise ConfigError(
            f"eval.every={cfg.eval.every}: there is no validation data; hold some out with --data.val_fraction=0.01 (never trained on) "
            f"or name a source with --eval.source=PATH"
        )


def validate_layout(cfg: JobConfig) -> None:
    """The model and the batch must split over cfg's layout: what the planner keeps its candidates to, and
    keel train checks with validate_runnable."""
    _validate_model_split(cfg)
    _validate_batch_split(cfg)


def validate_runnable(cfg: JobConfig) -> None:
    """What the planner models and keel train does not run yet."""
    par, args = cfg.parallel, model_args(cfg)
    if par.cp > 1:
        raise ConfigError(
            f"parallel.cp={par.cp}: keel train does not run context parallelism yet (keel plan models it); set --parallel.cp=1"
        )
    if par.dp_mode == "zero1":
        raise ConfigError(
            "parallel.dp_mode=zero1: keel train's FSDP2 has no optimizer-only sharding (keel plan models it); "
            "set --parallel.dp_mode=zero2, which shards the gradients too for the same traffic"
        )
    if args.tie_embeddings and par.n_stages > 1:
        raise ConfigError(
            f"model.tie_embeddings=true shares one matrix between the embedding (first pipeline stage) and the head (last), "
            f"but pp*pp_virtual_stages={par.pp}*{par.pp_virtual_stages}={par.n_stages} puts them on different stages, which "
            f"keel train does not run yet (keel plan models it); set --pp 1 --parallel.pp_virtual_stages=1, or --model.tie_embeddings=false"
        )


def _validate_model_split(cfg: JobConfig) -> None:
    """The model's shape (its preset with the fields set) must split over heads, pipeline stages and tp ranks."""
    par, args = cfg.parallel, model_args(cfg)
    if args.dim % args.n_heads:
        raise ConfigError(
            f"model.dim={args.dim} is not divisible by model.n_heads={args.n_heads}; choose n_heads from {divisors(args.dim)}"
        )
    if args.n_heads % args.n_kv_heads:
        raise ConfigError(
            f"model.n_heads={args.n_heads} is not divisible by model.n_kv_heads={args.n_kv_heads}; "
            f"choose n_kv_heads from {divisors(args.n_heads)}"
        )
    if args.n_layers < par.n_stages:  # an uneven split is fine (model_args.stage_layers), an empty stage is not
        raise ConfigError(
            f"model.n_layers={args.n_layers} is fewer than the pp*pp_virtual_stages={par.pp}*{par.pp_virtual_stages}={par.n_stages} "
            f"pipeline stages; set pp*pp_virtual_stages to {args.n_layers} or less"
        )
    # The vocabulary needs no check: the embedding and the head are padded to split over any tp.
    for name in ("n_heads", "n_kv_heads", "dim", "ffn_dim"):
        value = getattr(args, name)
        if value % par.tp:
            raise ConfigError(f"parallel.tp={par.tp}: model.{name}={value} is not divisible by tp; choose tp from {divisors(value)}")
    if par.sequence_parallel and par.tp > 1 and cfg.data.seq_len % par.tp:
        raise ConfigError(
            f"parallel.sequence_parallel=true splits data.seq_len={cfg.data.seq_len} over tp={par.tp} ranks; "
            f"choose a seq_len divisible by {par.tp}, or set --parallel.sequence_parallel=false"
        )
    if par.cp > 1 and cfg.data.seq_len % (2 * par.cp):
        raise ConfigError(
            f"parallel.cp={par.cp} splits data.seq_len={cfg.data.seq_len} into 2*cp load-balanced chunks; "
            f"choose a seq_len divisible by {2 * par.cp}"
        )


def _validate_batch_split(cfg: JobConfig) -> None:
    """The global batch must split over dp ranks and micro-batches, and the micro-batches fill the pipeline."""
    par, tr = cfg.parallel, cfg.training
    m = tr.microbatches
    if par.pp > 1 and par.pp_schedule == "1F1B" and m < par.pp:
        raise ConfigError(
            f"training.microbatches={m} is fewer than the {par.pp} pipeline stages of 1F1B; set --training.microbatches={par.pp} or more"
        )
    rounds = max(1, m // par.pp)  # torch's Interleaved1F1B runs the micro-batches in rounds of equal size
    if par.pp > 1 and par.pp_schedule == "Interleaved1F1B" and m % rounds:
        per_rank = tr.global_batch_size // par.dp
        fits = [k for k in divisors(per_rank) if k >= par.pp and k % max(1, k // par.pp) == 0]
        raise ConfigError(
            f"training.microbatches={m}: Interleaved1F1B over pp={par.pp} runs micro-batches in rounds of equal size ({rounds} rounds "
            f"do not divide {m}); choose one of {fits}"
        )
    if tr.global_batch_size % (par.dp * tr.microbatches):
        raise ConfigError(
            f"training.global_batch_size={tr.global_batch_size} does not divide into dp*microbatches="
            f"{par.dp}*{tr.microbatches}={par.dp * tr.microbatches}; use a multiple of {par.dp * tr.microbatches}"
        )


def check_run_dir(run_dir: str) -> None:
    """The output directory must be creatable and writable before workers start."""
    path = Path(run_dir)
    probe = path
    while not probe.exists():
        probe = probe.parent
    if not probe.is_dir():
        raise ConfigError(f"run.run_dir={run_dir}: '{probe}' is a file, not a directory; pass another --run-dir")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise ConfigError(f"run.run_dir={run_dir}: '{probe}' is not writable; pass a writable --run-dir")


def _toml_value(value: Any) -> str:
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    return '"' + str(value).replace("\\", "\\\\").replace('"', '\\"') + '"'


def write_resolved_config(cfg: JobConfig, path: Path) -> None:
    """Writes the config as TOML that load_config reads back, with secrets redacted."""
    lines = []
    for section, values in redact(cfg.to_dict()).items():
        lines.append(f"[{section}]")
        lines += [f"{key} = {_toml_value(value)}" for key, value in values.items() if value is not None]
        lines.append("")
    path.write_text("\n".join(lines))
