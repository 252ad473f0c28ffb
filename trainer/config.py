"""Job configuration: dataclasses, TOML presets, dotted command-line overrides, and validation.

Everything a worker needs is in one `JobConfig`. It is loaded and validated in the launcher, before
any process starts, so that bad input ends in one line naming the field and the fix.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import tomllib
from dataclasses import dataclass, field
from importlib import resources
from pathlib import Path
from typing import Any

from keel.monitor.detectors import SpikeConfig
from keel.monitor.redact import redact
from keel.monitor.stragglers import StragglerConfig


class ConfigError(ValueError):
    """Bad user input. The message is one line: the field, what is wrong, and the fix."""


@dataclass
class ModelConfig:
    # A named shape from keel.trainer.model.MODEL_PRESETS; the fields below override it when set.
    preset: str = "tiny"
    dim: int | None = None
    n_layers: int | None = None
    n_heads: int | None = None
    n_kv_heads: int | None = None
    ffn_dim: int | None = None


@dataclass
class DataConfig:
    # "builtin" reads the Python standard library's source as bytes; anything else is a path to a
    # uint16 token file (nanoGPT's .bin format), made with `keel prepare-data`.
    source: str = "builtin"
    seq_len: int = 64
    # Batch index ranges never read, e.g. ["80:107"] (end excluded): a run that skips what another
    # run's rollback skipped, for a like-for-like comparison (the rollback event says which batches).
    skip_batches: list[str] = field(default_factory=list)


@dataclass
class TrainingConfig:
    steps: int = 20
    global_batch_size: int = 8  # sequences per optimizer step, over all dp ranks
    microbatches: int = 1  # per dp rank; the pipeline schedule's n_microbatches when pp > 1
    seed: int = 0
    dtype: str = "auto"  # auto: bf16 mixed precision on CUDA, fp32 on CPU


@dataclass
class OptimConfig:
    lr: float = 3e-3
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 5
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    grad_clip: float = 1.0


@dataclass
class ParallelConfig:
    pp: int = 1
    dp: int = 1
    tp: int = 1
    pp_schedule: str = "1F1B"  # GPipe | 1F1B | Interleaved1F1B
    pp_virtual_stages: int = 1  # v stages per pp rank; more than 1 only with Interleaved1F1B
    dp_mode: str = "zero3"  # zero3 | zero2 | replicate


@dataclass
class MetricsConfig:
    log_every: int = 1  # console progress line
    comm_sample_every: int = 10  # profile one step in this many to measure comm_share


@dataclass
class MonitorConfig:
    prometheus: bool = True  # /metrics exporter on rank 0
    prometheus_host: str = "127.0.0.1"
    prometheus_port: int = 9400  # busy: the next free port, logged
    prometheus_linger_s: float = 0.0  # keep /metrics up this long after the last step, for short jobs
    pushgateway_url: str = ""  # push the final state here at the end (short jobs)
    wandb: bool = False
    wandb_project: str = "keel"
    wandb_mode: str = "auto"  # auto: online with an API key, offline without; offline | online | disabled
    wandb_min_interval_s: float = 1.0  # at most one W&B log per this many seconds (every step if steps are slower)
    webhook_url: str = ""  # Slack-compatible incoming webhook for Keel's alerts (a secret: never written out)
    alert_throttle_s: float = 300.0  # one alert of a kind per this many seconds
    sink_queue_size: int = 1000  # per sink; when full, metrics are dropped and counted, training never waits


@dataclass
class CheckpointConfig:
    # A save starts when either interval is reached (0 turns that interval off). Both off: no checkpoints.
    interval_steps: int = 0
    interval_minutes: float = 30.0  # the seed chapter's default
    keep: int = 3  # the newest K checkpoints are kept ...
    keep_lookback_steps: int = 200  # ... plus the newest one at least this many steps older, for a rollback past them
    async_save: bool = True  # training goes on while the shards are written


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


@dataclass
class WatchdogConfig:
    enabled: bool = True
    floor_s: float = 60.0  # a step may always take this long
    step_factor: float = 5.0  # ... or this many times the longest step seen after warmup_steps
    warmup_steps: int = 3  # steps timed by startup_s (compilation, first allocations)
    startup_s: float = 600.0  # start-up until the first step ends: process group, model build, resume
    checkpoint_s: float = 600.0  # a checkpoint save or load
    poll_s: float = 1.0  # how often the watchdog looks


@dataclass
class ChaosConfig:
    # Fault plan, e.g. ["nan@step=40,rank=1"]; on the command line: --fault nan@step=40,rank=1 (repeatable).
    faults: list[str] = field(default_factory=list)
    # Random faults: exponentially distributed gaps with this mean, in steps (0: none), each of a kind
    # drawn from random_kinds on a random rank, the same draw for the same seed.
    mtbf_steps: float = 0.0
    random_kinds: list[str] = field(default_factory=lambda: ["nan", "crash", "hang", "oom"])
    random_seed: int = 0


@dataclass
class RunConfig:
    run_dir: str = ""  # default: runs/<run_id>
    run_id: str = ""  # default: a timestamp
    resume: bool = False  # start from the newest good checkpoint in run_dir (keel train --resume RUN_DIR)


@dataclass
class JobConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
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
        return self.parallel.pp * self.parallel.dp * self.parallel.tp

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return dataclasses.asdict(self)


PIPELINE_SCHEDULES = ("GPipe", "1F1B", "Interleaved1F1B")
DP_MODES = ("zero3", "zero2", "replicate")
DTYPES = ("auto", "fp32", "bf16")


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


def _coerce(key: str, value: Any, annotation: str) -> Any:
    """Converts a TOML value or a command-line string to the field's type."""
    kind = annotation.replace(" | None", "")
    if value is None:
        return None
    if kind == "list[str]":
        items = value.split(";") if isinstance(value, str) else value
        if not isinstance(items, list):
            raise ConfigError(f"{key}={value!r}: expected a list of strings; fix the value")
        return [str(v).strip() for v in items if str(v).strip()]
    try:
        if kind == "int":
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError
            return int(value)
        if kind == "float":
            return float(value)
        if kind == "bool":
            if isinstance(value, str):
                if value.lower() not in ("true", "false", "1", "0"):
                    raise ValueError
                return value.lower() in ("true", "1")
            return bool(value)
        return str(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{key}={value!r}: expected {kind}; fix the value") from None


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
    setattr(target, key, _coerce(f"{section}.{key}", value, str(fields[key].type)))


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


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def validate(cfg: JobConfig, world_size: int | None = None) -> None:
    """Raises ConfigError for the first problem found. Needs no process group and no data."""
    from keel.chaos.faults import KINDS, parse_fault
    from keel.trainer.data import parse_skip_ranges
    from keel.trainer.model import MODEL_PRESETS, model_args

    par, tr, m = cfg.parallel, cfg.training, cfg.model
    for name in ("pp", "dp", "tp", "pp_virtual_stages"):
        if getattr(par, name) < 1:
            raise ConfigError(f"parallel.{name}={getattr(par, name)}: must be at least 1")
    if world_size is not None and world_size != cfg.world_size:
        raise ConfigError(
            f"parallel: pp*dp*tp = {par.pp}*{par.dp}*{par.tp} = {cfg.world_size} but {world_size} processes were "
            f"started; set --pp/--dp/--tp so their product is {world_size}, or start {cfg.world_size} processes"
        )
    if par.pp_schedule not in PIPELINE_SCHEDULES:
        raise ConfigError(f"parallel.pp_schedule={par.pp_schedule!r}: choose one of {list(PIPELINE_SCHEDULES)}")
    if par.dp_mode not in DP_MODES:
        raise ConfigError(f"parallel.dp_mode={par.dp_mode!r}: choose one of {list(DP_MODES)}")
    if tr.dtype not in DTYPES:
        raise ConfigError(f"training.dtype={tr.dtype!r}: choose one of {list(DTYPES)}")
    if par.pp_virtual_stages > 1 and par.pp_schedule != "Interleaved1F1B":
        raise ConfigError(
            f"parallel.pp_virtual_stages={par.pp_virtual_stages}: virtual stages need "
            f"parallel.pp_schedule=Interleaved1F1B, or set pp_virtual_stages=1"
        )
    if m.preset not in MODEL_PRESETS:
        raise ConfigError(f"model.preset={m.preset!r}: choose one of {sorted(MODEL_PRESETS)}")
    args = model_args(cfg)
    for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim"):
        if getattr(args, name) < 1:
            raise ConfigError(f"model.{name}={getattr(args, name)}: must be at least 1")
    if args.dim % args.n_heads:
        raise ConfigError(f"model.dim={args.dim} is not divisible by model.n_heads={args.n_heads}; choose n_heads from {_divisors(args.dim)}")
    if args.n_heads % args.n_kv_heads:
        raise ConfigError(f"model.n_heads={args.n_heads} is not divisible by model.n_kv_heads={args.n_kv_heads}; choose n_kv_heads from {_divisors(args.n_heads)}")
    stages = par.pp * par.pp_virtual_stages
    if args.n_layers % stages:
        raise ConfigError(
            f"model.n_layers={args.n_layers} does not split over pp*pp_virtual_stages={par.pp}*{par.pp_virtual_stages}={stages} "
            f"pipeline stages; choose pp*pp_virtual_stages from {_divisors(args.n_layers)}"
        )
    for name, value in (("n_heads", args.n_heads), ("n_kv_heads", args.n_kv_heads), ("dim", args.dim), ("ffn_dim", args.ffn_dim), ("vocab_size", args.vocab_size)):
        if value % par.tp:
            raise ConfigError(f"parallel.tp={par.tp}: model.{name}={value} is not divisible by tp; choose tp from {_divisors(value)}")
    if tr.steps < 1:
        raise ConfigError(f"training.steps={tr.steps}: must be at least 1")
    if tr.microbatches < 1:
        raise ConfigError(f"training.microbatches={tr.microbatches}: must be at least 1")
    if par.pp > 1 and tr.microbatches < stages:
        raise ConfigError(
            f"training.microbatches={tr.microbatches} is fewer than the {stages} pipeline stages; "
            f"set --training.microbatches={stages} or more"
        )
    if tr.global_batch_size % (par.dp * tr.microbatches):
        raise ConfigError(
            f"training.global_batch_size={tr.global_batch_size} does not divide into dp*microbatches="
            f"{par.dp}*{tr.microbatches}={par.dp * tr.microbatches}; use a multiple of {par.dp * tr.microbatches}"
        )
    if cfg.data.seq_len < 1:
        raise ConfigError(f"data.seq_len={cfg.data.seq_len}: must be at least 1")
    try:
        parse_skip_ranges(cfg.data.skip_batches)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if cfg.optim.lr <= 0:
        raise ConfigError(f"optim.lr={cfg.optim.lr}: must be positive")
    if cfg.optim.warmup_steps < 0:
        raise ConfigError(f"optim.warmup_steps={cfg.optim.warmup_steps}: must be 0 or more")
    if cfg.monitor.wandb_mode not in ("auto", "offline", "online", "disabled"):
        raise ConfigError(f"monitor.wandb_mode={cfg.monitor.wandb_mode!r}: choose auto, offline, online or disabled")
    if not 0 <= cfg.monitor.prometheus_port < 65536:
        raise ConfigError(f"monitor.prometheus_port={cfg.monitor.prometheus_port}: choose a port in 1-65535 (0: any free port)")
    for spec in cfg.chaos.faults:
        try:
            parse_fault(spec)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    _at_least("chaos.mtbf_steps", cfg.chaos.mtbf_steps, 0, "0 turns random faults off")
    for kind in cfg.chaos.random_kinds:
        if kind not in KINDS:
            raise ConfigError(f"chaos.random_kinds: unknown fault '{kind}'; choose from {list(KINDS)}")
    if cfg.metrics.comm_sample_every < 1 or cfg.metrics.log_every < 1:
        raise ConfigError("metrics.comm_sample_every and metrics.log_every must be at least 1")
    _validate_stability(cfg)


def _at_least(name: str, value: float, low: float, fix: str = "") -> None:
    if not value >= low:
        raise ConfigError(f"{name}={value}: must be at least {low}{'; ' + fix if fix else ''}")


def _validate_stability(cfg: JobConfig) -> None:
    ck, rc, wd, sp, st = cfg.checkpoint, cfg.recovery, cfg.watchdog, cfg.spike, cfg.stragglers
    _at_least("checkpoint.interval_steps", ck.interval_steps, 0, "0 turns step-based saves off")
    _at_least("checkpoint.interval_minutes", ck.interval_minutes, 0, "0 turns time-based saves off")
    _at_least("checkpoint.keep", ck.keep, 1)
    _at_least("checkpoint.keep_lookback_steps", ck.keep_lookback_steps, 0)
    _at_least("recovery.nonfinite_limit", rc.nonfinite_limit, 1)
    _at_least("recovery.skip_margin", rc.skip_margin, 0)
    _at_least("recovery.max_rollbacks", rc.max_rollbacks, 0)
    _at_least("recovery.lr_factor_steps", rc.lr_factor_steps, 0)
    if not 0 < rc.lr_factor <= 1:
        raise ConfigError(f"recovery.lr_factor={rc.lr_factor}: must be in (0, 1]; 1 keeps the LR after a rollback")
    for name in ("floor_s", "startup_s", "checkpoint_s", "poll_s"):
        if not getattr(wd, name) > 0:
            raise ConfigError(f"watchdog.{name}={getattr(wd, name)}: must be positive (seconds)")
    _at_least("watchdog.step_factor", wd.step_factor, 1.0)
    _at_least("watchdog.warmup_steps", wd.warmup_steps, 0)
    _at_least("spike.window", sp.window, 2)
    _at_least("spike.min_baseline", sp.min_baseline, 2)
    if sp.min_baseline > sp.window:
        raise ConfigError(f"spike.min_baseline={sp.min_baseline} is larger than spike.window={sp.window}; lower it or widen the window")
    _at_least("spike.persistence", sp.persistence, 1)
    _at_least("spike.grad_persistence", sp.grad_persistence, 1)
    _at_least("spike.min_rel_spread", sp.min_rel_spread, 0)
    _at_least("spike.history", sp.history, 0)
    if not 1 <= sp.center_window <= sp.window:
        raise ConfigError(f"spike.center_window={sp.center_window}: must be between 1 and spike.window={sp.window}")
    if not 0 <= sp.hold <= 1:
        raise ConfigError(f"spike.hold={sp.hold}: must be in [0, 1] (a fraction of the way from the center to the threshold)")
    _at_least("spike.warmup_steps", sp.warmup_steps, 0)
    for name in ("sigmas", "grad_sigmas"):
        if not getattr(sp, name) > 0:
            raise ConfigError(f"spike.{name}={getattr(sp, name)}: must be positive")
    for name in ("ratio", "grad_ratio"):
        if not getattr(sp, name) > 1:
            raise ConfigError(f"spike.{name}={getattr(sp, name)}: must be above 1 (a multiple of the baseline)")
    _at_least("stragglers.window", st.window, 1)
    if not 1 <= st.min_samples <= st.window:
        raise ConfigError(f"stragglers.min_samples={st.min_samples}: must be between 1 and stragglers.window={st.window}")
    if not 0 < st.threshold <= 1:
        raise ConfigError(f"stragglers.threshold={st.threshold}: must be in (0, 1]; 0.75 flags a rank 33% slower than the fastest")
    _at_least("stragglers.warmup_steps", st.warmup_steps, 0)
    if not 0 < st.escalation < 1:
        raise ConfigError(f"stragglers.escalation={st.escalation}: must be in (0, 1); 0.5 reports a flagged rank again once twice as slow")


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
