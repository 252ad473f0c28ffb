"""What a checkpoint's manifest records about the run that wrote it, and whether a resume may load it.

The model's shape and the data must be the same: another shape does not load, and other tokens (or
another sequence length) would continue a different run under the old one's name. The parallel layout
may change: a checkpoint holds the single model's tensors whatever the split (WholeModel) and the
sampler draws the same global batches at any dp, so a run resumed at another layout follows the
uninterrupted one (a dp2·tp2 run killed at step 57 and resumed at pp2·dp2 stayed within 5e-6 of it).
One exception: the embedding and the head hold the vocabulary padded for the run's tp (64 x tp,
model_args.padded_vocab_size), so a tp that pads to another number of rows is refused, with the tps that
load it (the real vocabularies of the presets pad alike from tp1 to tp4).

No torch here: `keel train` checks a resume before any worker starts, and the workers check again
when they load (torchrun started directly has no launcher).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path

from keel.monitor.run_dir import MANIFEST, list_checkpoints
from keel.trainer.config import ConfigError, JobConfig
from keel.trainer.model_args import model_args, padded_vocab_size

LAYOUT_FIELDS = ("pp", "dp", "tp", "pp_virtual_stages", "pp_schedule", "dp_mode")
# How the work is split, recorded in the manifest's "parallel": the layout, and training.microbatches.
SPLIT_FIELDS = (*LAYOUT_FIELDS, "microbatches")


def config_record(cfg: JobConfig, data_version: str) -> dict:
    """The manifest's fields about the config: the model's shape (its preset with the fields set), the
    data, the parallel layout, and config_hash over everything a resume must match."""
    args = model_args(cfg)
    shape = dataclasses.asdict(args)
    del shape["max_seq_len"]  # follows data.seq_len
    # data.skip_batches is not recorded: a resume may add a range to step over bad data.
    data = {"sources": cfg.data.sources} if cfg.data.sources else {"source": cfg.data.source}  # a blend, or one source
    data["seq_len"] = cfg.data.seq_len
    must_match = {"model": shape, "seq_len": cfg.data.seq_len, "data_version": data_version}
    return {
        "config_hash": hashlib.sha256(json.dumps(must_match, sort_keys=True).encode()).hexdigest()[:16],
        "data_version": data_version,
        "model": shape,
        "data": data,
        "parallel": {k: getattr(cfg.parallel, k) for k in LAYOUT_FIELDS} | {"microbatches": cfg.training.microbatches},
        "vocab_rows": padded_vocab_size(args.vocab_size, cfg.parallel.tp),  # the saved embedding's and head's rows
    }


def resume_differences(saved: dict, now: dict) -> tuple[list[str], str | None]:
    """Compares a checkpoint's manifest with this run's config_record. Returns (one line per field that
    must match and does not, the layout change or None). Only the fields the manifest has are compared:
    one written before they were recorded is checked on its data version alone."""
    refusals = [
        f"model.{k}: {v} in the checkpoint, {now['model'].get(k)} now"
        for k, v in saved.get("model", {}).items()
        if now["model"].get(k) != v
    ]
    refusals += _padding_refusal(saved, now)
    seq_len = saved.get("data", {}).get("seq_len", now["data"]["seq_len"])
    if seq_len != now["data"]["seq_len"]:
        refusals.append(f"data.seq_len: {seq_len} in the checkpoint, {now['data']['seq_len']} now")
    if saved["data_version"] != now["data_version"]:
        source = f" ({_data_named(saved['data'])})" if "data" in saved else ""
        refusals.append(
            f"data version: {saved['data_version']} in the checkpoint{source}, {now['data_version']} now ({_data_named(now['data'])})"
        )
    layout = saved.get("parallel", {})
    if all(layout.get(k, now["parallel"][k]) == now["parallel"][k] for k in SPLIT_FIELDS):
        return refusals, None
    return refusals, f"parallel layout: {_layout(layout, now['parallel'])} in the checkpoint, {_layout(now['parallel'], layout)} now"


def _data_named(data: dict) -> str:
    """The data a manifest's record names: data.sources=[...] for a blend, else data.source=X."""
    return f"data.sources={data['sources']}" if "sources" in data else f"data.source={data['source']}"


def _padding_refusal(saved: dict, now: dict) -> list[str]:
    """The line refusing a checkpoint whose vocabulary was padded to other rows than this run's tp pads it to
    (its tensors would not fit), naming the tps that pad alike; none when the rows agree or the vocabulary
    itself differs (refused as another model already)."""
    vocab, rows = now["model"]["vocab_size"], now["vocab_rows"]
    if saved.get("model", {}).get("vocab_size", vocab) != vocab:
        return []
    saved_rows = saved.get("vocab_rows", vocab)  # written before padding: the modules had the vocabulary's rows
    if saved_rows == rows:
        return []
    same = [tp for tp in range(1, 65) if padded_vocab_size(vocab, tp) == saved_rows]
    saved_tp = saved.get("parallel", {}).get("tp", "?")
    return [
        f"model.vocab_size={vocab} padded to {saved_rows} rows at tp={saved_tp} in the checkpoint, to {rows} at "
        f"tp={now['parallel']['tp']} now (64 x tp); resume at tp from {same}"
    ]


def _layout(mine: dict, other: dict) -> str:
    """pp·dp·tp, then the other fields of the split where the two differ ("pp2 dp1 tp1 pp_schedule=GPipe")."""
    extra = "".join(f" {k}={mine[k]}" for k in SPLIT_FIELDS[3:] if k in mine and k in other and mine[k] != other[k])
    return f"pp{mine['pp']} dp{mine['dp']} tp{mine['tp']}{extra}"


def vet_resume(saved: dict, checkpoint: Path, now: dict) -> str | None:
    """Raises ConfigError naming every field of the checkpoint at `checkpoint` that must match and does
    not; returns the line that says how the layout changed, or None."""
    refusals, layout_change = resume_differences(saved, now)
    if refusals:
        raise ConfigError(
            f"checkpoint {checkpoint} holds another model or data: {'; '.join(refusals)}. "
            f"Resume with the run's own config, or start a new run with --run-dir"
        )
    return layout_change and f"{layout_change} (resuming from {checkpoint}; a checkpoint loads at any layout)"


def newest_manifest(run_dir: str | Path) -> tuple[Path, dict] | None:
    """The newest finished checkpoint that has a readable manifest: (its folder, the manifest), or
    None. Its files are not hashed here: the workers verify them and pass over a corrupt one."""
    for _, path in reversed(list_checkpoints(run_dir)):
        try:
            return path, json.loads((path / MANIFEST).read_text())
        except (OSError, ValueError):
            continue
    return None
