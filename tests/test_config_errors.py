"""Bad input ends in one line on stderr that names the field and the fix, before any worker starts."""

from __future__ import annotations

import subprocess

import pytest
from conftest import keel, plain_torchrun

from keel.trainer.config import ConfigError, load_config, validate, write_resolved_config

# (arguments, text the one-line error must contain: the field, and the fix)
CASES = {
    "unknown key": (["--optim.lrr=1e-3"], ["optim.lrr", "did you mean 'optim.lr'"]),
    "unknown section": (["--optimizer.lr=1e-3"], ["optimizer", "did you mean 'optim'"]),
    "wrong type": (["--training.steps=ten"], ["training.steps", "expected int"]),
    "unknown option": (["--stepz", "3"], ["--stepz", "--section.key=value"]),
    "negative restart budget": (["--max-restarts=-1"], ["--max-restarts=-1", "must be 0 or more"]),
    "fewer layers than stages": (["--pp", "5", "--training.microbatches=5"], ["model.n_layers=4", "pp*pp_virtual_stages", "4 or less"]),
    "layers do not split over pp*v": (
        ["--pp", "2", "--parallel.pp_schedule=Interleaved1F1B", "--parallel.pp_virtual_stages=4", "--training.microbatches=8"],
        ["model.n_layers=4", "8 pipeline stages"],
    ),
    "heads not divisible by tp": (["--tp", "3"], ["parallel.tp=3", "model.n_heads=4", "choose tp from [1, 2, 4]"]),
    "sequence not divisible by tp": (
        ["--tp", "2", "--parallel.sequence_parallel=true", "--data.seq_len=63"],
        ["parallel.sequence_parallel=true", "data.seq_len=63", "divisible by 2"],
    ),
    "hidden not divisible by tp": (
        ["--tp", "8", "--model.n_heads=8", "--model.n_kv_heads=8", "--model.ffn_dim=196"],
        ["parallel.tp=8", "model.ffn_dim=196"],
    ),
    "fewer micro-batches than stages": (
        ["--pp", "2", "--training.microbatches=1"],
        ["training.microbatches=1", "--training.microbatches=2"],
    ),
    "interleaved micro-batches not in rounds of pp": (
        [
            "--pp",
            "2",
            "--parallel.pp_schedule=Interleaved1F1B",
            "--parallel.pp_virtual_stages=2",
            "--training.microbatches=5",
            "--training.global_batch_size=10",
        ],
        ["training.microbatches=5", "rounds of equal size", "choose one of [2, 10]"],
    ),  # fmt: skip
    "context parallelism, planned only": (["--parallel.cp=2"], ["parallel.cp=2", "does not run context parallelism", "--parallel.cp=1"]),
    "zero1, planned only": (["--parallel.dp_mode=zero1"], ["parallel.dp_mode=zero1", "set --parallel.dp_mode=zero2"]),
    "tied embedding under a pipeline, planned only": (
        ["--pp", "2", "--training.microbatches=2", "--model.tie_embeddings=true"],
        ["model.tie_embeddings=true", "keel plan models it", "--model.tie_embeddings=false"],
    ),
    "global batch does not divide": (["--dp", "2", "--training.global_batch_size=6"], ["training.global_batch_size=6", "multiple of 4"]),
    "virtual stages without interleaving": (
        ["--pp", "2", "--parallel.pp_virtual_stages=2"],
        ["parallel.pp_virtual_stages=2", "Interleaved1F1B"],
    ),
    "unknown schedule": (["--pp", "2", "--parallel.pp_schedule=ZeroBubble"], ["parallel.pp_schedule", "GPipe"]),
    "unknown preset": (["--model.preset=13b"], ["model.preset", "tiny"]),
    "missing config file": (["--config", "nope.toml"], ["--config nope.toml", "file not found"]),
    "nodes do not split the processes": (["--dp", "2", "--nnodes", "3", "--rdzv-id=r"], ["--nnodes=3", "do not split"]),
    "unknown fault": (["--fault", "melt@step=3"], ["chaos.faults", "unknown fault 'melt'", "choose one of"]),
    "fault without step": (["--fault", "crash@rank=1"], ["chaos.faults", "has no step"]),
    "spike baseline larger than window": (["--spike.min_baseline=500"], ["spike.min_baseline=500", "spike.window=128"]),
    "spike hold outside [0, 1]": (["--spike.hold=1.5"], ["spike.hold=1.5", "[0, 1]"]),
    "spike ratio not above 1": (["--spike.ratio=0.5"], ["spike.ratio=0.5", "above 1"]),
    "lr factor above 1": (["--recovery.lr_factor=2"], ["recovery.lr_factor=2.0", "(0, 1]"]),
    "no rollback without a nonfinite limit": (["--recovery.nonfinite_limit=0"], ["recovery.nonfinite_limit=0", "at least 1"]),
    "negative checkpoint interval": (["--checkpoint.interval_steps=-5"], ["checkpoint.interval_steps=-5", "0 turns"]),
    "zero watchdog floor": (["--watchdog.floor_s=0"], ["watchdog.floor_s=0", "positive"]),
    "backwards skip range": (["--data.skip_batches=90:80"], ["data.skip_batches", "'90:80'", "FIRST < END"]),
    "straggler min samples": (["--stragglers.min_samples=9"], ["stragglers.min_samples=9", "stragglers.window=5"]),
    "negative grad clip": (["--optim.grad_clip=-1"], ["optim.grad_clip=-1.0", "0 (no clipping)"]),
    "beta at 1": (["--optim.beta2=1"], ["optim.beta2=1.0", "[0, 1)"]),
    "negative peak": (["--metrics.peak_tflops=-1"], ["metrics.peak_tflops=-1.0", "0 uses the GPU's data-sheet peak"]),
    "resume without a run": (["--resume", "no/such/run"], ["--resume no/such/run", "no config.toml"]),
    "a vocabulary far too big for the machine": (
        ["--model.vocab_size=1000000000000"],
        ["model.vocab_size=1000000000000", "choose a smaller model"],
    ),
}


def assert_one_line_error(proc: subprocess.CompletedProcess, expected: list[str]) -> None:
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    for text in expected:
        assert text in lines[0], f"{text!r} not in: {lines[0]}"


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_bad_config_is_one_line_before_any_worker(case, tmp_path):
    args, expected = CASES[case]
    run_dir = tmp_path / "run"
    proc = keel("train", "--config", "tiny", "--run-dir", str(run_dir), *args)
    assert_one_line_error(proc, expected)
    assert not run_dir.exists(), "the run directory is made only once the job is valid"


def test_nodes_without_a_run_dir_or_rendezvous_id_would_write_runs_of_their_own(tmp_path):
    proc = keel("train", "--config", "tiny", "--dp", "2", "--nnodes", "2", cwd=tmp_path)
    assert_one_line_error(proc, ["--nnodes=2 without --run-dir", "the same --rdzv-id"])
    assert list(tmp_path.iterdir()) == []


def test_missing_data_file(tmp_path):
    proc = keel("train", "--config", "tiny", "--run-dir", str(tmp_path / "run"), f"--data.source={tmp_path / 'none.bin'}")
    assert_one_line_error(proc, ["data.source=", "not found", "keel prepare-data"])


def test_empty_data_file(tmp_path):
    (tmp_path / "empty.bin").write_bytes(b"")
    proc = keel("train", "--config", "tiny", "--run-dir", str(tmp_path / "run"), f"--data.source={tmp_path / 'empty.bin'}")
    assert_one_line_error(proc, ["data.source=", "empty"])


def test_unwritable_run_dir(tmp_path):
    (tmp_path / "a-file").write_text("x")
    proc = keel("train", "--config", "tiny", "--run-dir", str(tmp_path / "a-file" / "run"))
    assert_one_line_error(proc, ["run.run_dir=", "not a directory", "--run-dir"])


@pytest.mark.slow
def test_process_count_mismatch_under_plain_torchrun(tmp_path):
    """Started by torchrun directly, the workers are the first to see the config: they stop with the
    same one-line error (printed once, by rank 0) before joining a process group."""
    proc = plain_torchrun(2, "--config=tiny", "--dp=4", f"--run-dir={tmp_path / 'run'}", timeout=120)
    assert proc.returncode != 0
    errors = [line for line in proc.stderr.splitlines() if "keel train: error" in line]
    assert len(errors) == 1, proc.stderr
    assert "pp*dp*tp = 1*4*1 = 4 but 2 processes" in errors[0]


def test_overrides_are_typed_and_config_round_trips(tmp_path):
    cfg = load_config("tiny", ["optim.lr=3e-4", "parallel.pp=2", "model.dim=128"])
    assert cfg.optim.lr == 3e-4 and cfg.parallel.pp == 2 and cfg.model.dim == 128
    write_resolved_config(cfg, tmp_path / "config.toml")
    assert load_config(str(tmp_path / "config.toml")) == cfg


def test_unknown_key_in_file_is_an_error(tmp_path):
    (tmp_path / "job.toml").write_text("[training]\nstepss = 3\n")
    with pytest.raises(ConfigError, match=r"training.stepss.*did you mean 'training.steps'"):
        load_config(str(tmp_path / "job.toml"))


def test_a_list_on_the_command_line_is_written_with_semicolons_or_as_toml():
    for text in ("nan;crash", '["nan", "crash"]', "['nan','crash']"):
        assert load_config("tiny", [f"chaos.random_kinds={text}"]).chaos.random_kinds == ["nan", "crash"], text
    assert load_config("tiny", ['chaos.faults=["nan@step=3,rank=1"]']).chaos.faults == ["nan@step=3,rank=1"]
    with pytest.raises(ConfigError, match=r"chaos.random_kinds='\[\"nan\",': not a TOML list .*; write") as e:
        load_config("tiny", ['chaos.random_kinds=["nan",'])
    assert "\n" not in str(e.value)


def test_random_faults_need_a_kind_to_draw():
    with pytest.raises(ConfigError, match=r"chaos.random_kinds is empty; .* or set chaos.mtbf_steps=0"):
        validate(load_config("tiny", ["chaos.mtbf_steps=25", "chaos.random_kinds="]))
