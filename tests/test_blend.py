"""Blends of token sources (data.sources, keel.trainer.data.blend): each source read in proportion to its
weight, a blend of one the same as data.source, exact resume and data skips across the blend, the shares in
the run store, the blend's version guarding resumes, and bad blends refused in one line."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from conftest import keel, train
from test_config_errors import assert_one_line_error

from keel.monitor.store import DATA_SOURCES_META, RunStore, read_data_sources, read_meta, read_steps
from keel.trainer.checkpoint.manifest import config_record, vet_resume
from keel.trainer.config import ConfigError, load_config, validate
from keel.trainer.data.blend import open_job_data
from keel.trainer.data.loader import BatchSampler, write_token_file
from keel.trainer.data.prepare import main as prepare_data_main

SEQ_LEN = 16
# Each source's bytes come from an alphabet of its own, so a row shows which source it was read from.
ALPHABETS = {"letters": b"abcdefghijklm", "digits": b"0123456789", "capitals": b"NOPQRSTUVWXYZ"}


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, Path]:
    """A byte token file per alphabet (keel's writer), 200,000 random characters of it each."""
    folder = tmp_path_factory.mktemp("blend")
    paths = {}
    for i, (name, alphabet) in enumerate(ALPHABETS.items()):
        text = folder / f"{name}.txt"
        text.write_bytes(bytes(np.random.default_rng(i).choice(list(alphabet), size=200_000).astype(np.uint8)))
        paths[name] = folder / f"{name}.bin"
        write_token_file(paths[name], [text])
    return paths


def blend_of(*pairs) -> str:
    """--data.sources's value: weight;source;weight;source..."""
    return ";".join(str(item) for item in pairs)


def job_data(sources_value: str, *overrides: str):
    cfg = load_config("tiny", [f"data.sources={sources_value}", f"data.seq_len={SEQ_LEN}", *overrides])
    validate(cfg)
    return open_job_data(cfg)


def sampler_of(data, global_batch_size: int = 8, dp_rank: int = 0, dp_size: int = 1, **kwargs) -> BatchSampler:
    return BatchSampler(data.tokens, SEQ_LEN, global_batch_size, dp_rank, dp_size, 3, weights=data.weights, **kwargs)


def source_of_rows(rows: np.ndarray) -> list[str]:
    """The alphabet each row was read from; fails on a row that mixes two."""
    found = []
    for row in rows:
        names = [name for name, alphabet in ALPHABETS.items() if set(row.tolist()) <= set(alphabet)]
        assert len(names) == 1, row
        found.append(names[0])
    return found


def test_each_source_is_read_in_proportion_to_its_weight(sources):
    weights = {"letters": 0.5, "digits": 0.3, "capitals": 0.2}
    data = job_data(blend_of(*(x for name, w in weights.items() for x in (w * 10, sources[name]))))  # 5;A;3;B;2;C
    assert data.weights == pytest.approx((0.5, 0.3, 0.2))
    counted = []
    sampler = sampler_of(data, global_batch_size=100, on_batch=counted.append)
    rows = [name for _ in range(100) for name in source_of_rows(sampler.next_batch()[0])]  # 10,000 rows
    shares = {name: rows.count(name) / len(rows) for name in weights}
    for name, weight in weights.items():
        assert abs(shares[name] - weight) < 0.02, shares  # measured: within 0.4% of every weight
    # What the sampler reports for the run store is what it read.
    assert list(np.sum(counted, axis=0)) == [rows.count(name) * SEQ_LEN for name in weights]


def test_a_blend_of_one_source_reads_exactly_the_batches_of_that_source(sources):
    blend = job_data(blend_of(1, sources["letters"]))
    alone = load_config("tiny", [f"data.source={sources['letters']}", f"data.seq_len={SEQ_LEN}"])
    single = open_job_data(alone)
    assert (blend.version, blend.description) == (single.version, single.description)
    tokens = single.tokens[0]
    for dp_size in (1, 2):
        blended = [sampler_of(blend, dp_rank=r, dp_size=dp_size) for r in range(dp_size)]
        plain = [sampler_of(single, dp_rank=r, dp_size=dp_size) for r in range(dp_size)]
        for batch_index in range(10):
            a = np.concatenate([s.next_batch()[0] for s in blended])
            assert np.array_equal(a, np.concatenate([s.next_batch()[0] for s in plain]))
            # The windows data.source has always read: a checkpoint of a run before blends resumes on the same data.
            offsets = np.random.default_rng([3, batch_index]).integers(0, len(tokens) - SEQ_LEN, size=8)
            assert np.array_equal(a, tokens[offsets[:, None] + np.arange(SEQ_LEN)])


def test_a_blend_resumes_skips_and_splits_over_dp_exactly(sources):
    data = job_data(blend_of(0.7, sources["letters"], 0.3, sources["digits"]))
    reader = sampler_of(data)
    read = [reader.next_batch()[0] for _ in range(8)]
    assert {name for batch in read for name in source_of_rows(batch)} == {"letters", "digits"}
    state = sampler_of(data)
    for _ in range(3):
        state.next_batch()
    saved = state.state_dict()
    assert saved == {"seed": 3, "batch_index": 3}  # a checkpoint's sampler state is what it always was
    resumed = sampler_of(data)
    resumed.load_state_dict(saved)
    assert all(np.array_equal(resumed.next_batch()[0], batch) for batch in read[3:])
    skipping = sampler_of(data)
    skipping.skip_to(6)
    assert np.array_equal(skipping.next_batch()[0], read[6])
    skipping.rewind_to(2)
    assert np.array_equal(skipping.next_batch()[0], read[2])
    skip_ranges = sampler_of(data, skip_ranges=[(1, 5)])
    assert [np.array_equal(skip_ranges.next_batch()[0], read[i]) for i in (0, 5)] == [True, True]
    shards = [sampler_of(data, dp_rank=r, dp_size=2) for r in range(2)]
    for batch in read:
        assert np.array_equal(np.concatenate([s.next_batch()[0] for s in shards]), batch)


def test_batches_with_ids_past_the_vocabulary_are_passed_over_across_sources(sources):
    data = job_data(blend_of(0.9, sources["letters"], 0.1, sources["digits"]))
    damaged = np.full(1000, 300, dtype=np.uint16)  # ids past the byte vocabulary, as a damaged file holds
    counted = []
    sampler = BatchSampler([data.tokens[0], damaged], SEQ_LEN, 8, 0, 1, 3, vocab_size=256, weights=(0.9, 0.1), on_batch=counted.append)
    returned = [sampler.next_batch()[0] for _ in range(10)]
    rejected = sampler.take_rejected()
    assert rejected and all(int(batch.max()) < 256 for batch in returned)
    assert sampler.batch_index == 10 + len(rejected)
    assert [tokens.tolist() for tokens in counted] == [[8 * SEQ_LEN, 0]] * 10  # the passed-over batches are not counted

    def poison_batch_1(batch_index, window, vocab_size):  # the chaos hook on data, as chaos's corrupt_batch
        return np.full_like(window, vocab_size) if batch_index == 1 else window

    hooked = sampler_of(data, vocab_size=256, transform=poison_batch_1)
    hooked.next_batch(), hooked.next_batch()
    assert hooked.take_rejected() == [1]


def test_the_version_covers_every_source_and_weight_and_guards_a_resume(sources):
    a, b = sources["letters"], sources["digits"]
    version = job_data(blend_of(0.7, a, 0.3, b)).version
    assert job_data(blend_of(7, a, 3, b)).version == version  # the same weights, normalized: the same batches
    assert job_data(blend_of(0.6, a, 0.4, b)).version != version
    assert job_data(blend_of(0.3, b, 0.7, a)).version != version  # the same shares in another order: other batches
    assert version not in (job_data(blend_of(1, a)).version, job_data(blend_of(1, b)).version)
    described = job_data(blend_of(0.7, a, 0.3, b)).description
    assert described.startswith("a blend of 2 sources: 0.7 x ") and str(b) in described

    saved_cfg = load_config("tiny", [f"data.sources={blend_of(0.7, a, 0.3, b)}"])
    now_cfg = load_config("tiny", [f"data.sources={blend_of(0.6, a, 0.4, b)}"])
    saved = config_record(saved_cfg, version)
    with pytest.raises(ConfigError) as refused:
        vet_resume(saved, Path("step-00000004"), config_record(now_cfg, job_data(blend_of(0.6, a, 0.4, b)).version))
    assert "data version" in str(refused.value) and f"data.sources={now_cfg.data.sources}" in str(refused.value)
    assert vet_resume(saved, Path("step-00000004"), config_record(saved_cfg, version)) is None


@pytest.fixture(scope="module")
def tokenized(tmp_path_factory) -> dict[str, Path]:
    """Two token files of BPE tokenizers of the same size trained by `keel prepare-data` on other texts."""
    folder = tmp_path_factory.mktemp("tokenized")
    files = {}
    for name, alphabet in ALPHABETS.items():
        words = np.random.default_rng(7).choice(list(alphabet), size=(3000, 5)).astype(np.uint8)
        (folder / f"{name}.txt").write_bytes(b" ".join(bytes(w) for w in words))
    for name in ("letters", "digits"):
        files[name] = folder / f"{name}-bpe.bin"
        assert prepare_data_main([str(files[name]), str(folder / f"{name}.txt"), "--train-tokenizer", "300"]) == 0
    return files


def refusal_cases(sources: dict[str, Path], tmp: Path) -> dict[str, tuple[list[str], list[str]]]:
    """(the overrides, the text the one-line error must hold) of each bad blend."""
    a, b = sources["letters"], sources["digits"]
    short = tmp / "short.bin"
    (tmp / "short.txt").write_bytes(b"0123456789")
    write_token_file(short, [tmp / "short.txt"])
    wide = tmp / "wide.bin"
    np.arange(1000, dtype="<u2").tofile(wide)  # a nanoGPT file of ids up to 999: not bytes
    return {
        "odd length": ([f"data.sources={blend_of(0.7, a, 0.3)}"], ["data.sources=", "3 items", "0.7;web.bin;0.3;code.bin"]),
        "not a number": ([f"data.sources={blend_of('x', a)}"], ["data.sources", "the weight 'x'", "not a positive number"]),
        "negative weight": ([f"data.sources={blend_of(-1, a, 2, b)}"], ["the weight '-1'", "not a positive number"]),
        "zero weight": ([f"data.sources={blend_of(0, a, 1, b)}"], ["the weight '0'", "not a positive number"]),
        "NaN weight": ([f"data.sources={blend_of('nan', a)}"], ["the weight 'nan'", "not a positive number"]),
        "infinite weight": ([f"data.sources={blend_of('inf', a)}"], ["the weight 'inf'", "not a positive number"]),
        "data.source too": (
            [f"data.source={a}", f"data.sources={blend_of(1, b)}"],
            [f"data.source={a}", "data.sources=", "unset data.sources"],
        ),
        "missing file": (
            [f"data.sources={blend_of(1, a, 1, tmp / 'none.bin')}"],
            ["data.sources: data.source=", "none.bin: file not found"],
        ),
        "shorter than a sequence": (
            [f"data.sources={blend_of(1, a, 1, short)}"],
            ["data.sources: data.source=", "fewer than data.seq_len+1"],
        ),
        "bytes and wider ids": (
            [f"data.sources={blend_of(1, 'builtin', 1, wide)}", "model.vocab_size=1024"],
            ["data.sources: ", "token ids up to 999 need a vocabulary of 1,000, but builtin was made with byte tokens (vocabulary 256)"],
        ),
        "held-out end": ([f"data.sources={blend_of(1, a, 1, b)}", "data.val_fraction=0.01"], ["data.val_fraction=0.01", "--eval.source"]),
    }


def test_bad_blends_are_refused_in_one_line(sources, tmp_path):
    for case, (overrides, expected) in refusal_cases(sources, tmp_path).items():
        with pytest.raises(ConfigError) as refused:
            cfg = load_config("tiny", [f"data.seq_len={SEQ_LEN}", *overrides])
            validate(cfg)
            open_job_data(cfg)
        message = str(refused.value)
        assert "\n" not in message, (case, message)
        assert all(text in message for text in expected), (case, message)


def test_sources_of_other_tokenizers_are_refused(tokenized):
    files = [str(path) for path in tokenized.values()]
    with pytest.raises(ConfigError) as refused:
        job_data(blend_of(1, files[0], 1, files[1]), "model.vocab_size=300")
    message = str(refused.value)
    assert "\n" not in message and "a blend's sources must share one tokenizer" in message
    assert f"{files[0]} was made with the tokenizer letters-bpe.bin.tokenizer.json" in message
    assert job_data(blend_of(1, files[0], 2, files[0]), "model.vocab_size=300").weights == pytest.approx((1 / 3, 2 / 3))


def test_the_store_counts_the_tokens_of_the_steps_that_count(tmp_path):
    """Each step's tokens per source, added up by the rule of read_steps(effective=True): a rollback's abandoned
    steps and a step that died before its row are not counted, a step run again counts once."""
    # (step, attempt, tokens per source): attempt 1 rolls back to step 1, runs step 2 twice and dies in step 4.
    written = [(1, 0, (6, 2)), (2, 0, (5, 3)), (3, 0, (8, 0)), (2, 1, (7, 1)), (2, 1, (4, 4)), (3, 1, (6, 2)), (4, 1, (9, 9))]
    with RunStore(tmp_path) as store:
        store.set_meta(
            DATA_SOURCES_META, [{"source": "a.bin", "weight": 0.75, "version": "v1"}, {"source": "b.bin", "weight": 0.25, "version": "v2"}]
        )
        for step, attempt, tokens in written:
            store.write_data_tokens(step, attempt, tokens)
            if step < 4:  # step 4 died before its row was written
                store.write_step({"step": step, "attempt": attempt, "tokens": 8 * step})
    sources = read_data_sources(tmp_path)
    assert sources.source.tolist() == ["a.bin", "b.bin"] and sources.weight.tolist() == [0.75, 0.25]
    assert sources.tokens.tolist() == [6 + 4 + 6, 2 + 4 + 2]  # steps 1 (attempt 0), 2 and 3 (attempt 1, step 2 as written last)
    assert sources.tokens.sum() == read_steps(tmp_path, effective=True).tokens.iloc[-1]
    assert sources.share.tolist() == [16 / 24, 8 / 24]
    with RunStore(tmp_path / "plain") as store:
        store.write_step({"step": 1, "attempt": 0})
    assert read_data_sources(tmp_path / "plain").empty  # a run of one source records none


@pytest.mark.slow
def test_a_blended_run_resumed_from_a_checkpoint_is_the_uninterrupted_run(sources, tmp_path):
    """A 2-source blend, 12 steps, checkpoints every 4: killed at step 7 and resumed from step 4, it trains
    bit for bit as the run never stopped, and its store counts each source's tokens once. A resume with
    other weights is refused before any worker starts."""
    blend = blend_of(0.7, sources["letters"], 0.3, sources["digits"])
    job = ["--config=tiny", f"--data.sources={blend}", "--steps=12", "--checkpoint.interval_steps=4", "--checkpoint.async_save=false",
           "--monitor.prometheus=false"]  # fmt: skip
    whole = train(tmp_path / "whole", *job)
    run_dir = tmp_path / "run"
    crashed = keel("train", f"--run-dir={run_dir}", *job, "--fault=crash@step=7", "--max-restarts=0")
    assert crashed.returncode != 0
    resumed = keel("train", "--resume", str(run_dir))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    run = read_steps(run_dir, effective=True)
    assert list(run.step) == list(range(1, 13)) and (run[run.step > 4].attempt == 1).all()
    np.testing.assert_array_equal(run.loss, whole.loss)
    np.testing.assert_array_equal(run.grad_norm, whole.grad_norm)

    shares, whole_shares = read_data_sources(run_dir), read_data_sources(tmp_path / "whole")
    assert shares.tokens.tolist() == whole_shares.tokens.tolist()  # the abandoned steps 5 and 6 are not counted twice
    assert shares.tokens.sum() == run.tokens.iloc[-1] == 12 * 8 * 32  # steps x global batch x tiny's seq_len
    assert shares.source.tolist() == [str(sources["letters"]), str(sources["digits"])] and shares.weight.tolist() == [0.7, 0.3]
    meta = read_meta(run_dir)
    assert meta["data"].startswith("a blend of 2 sources") and meta["data_version"] == job_data(blend).version
    table = keel("metrics", str(run_dir))
    assert "data sources" in table.stdout and f"{shares.share.iloc[0]:.2%}" in table.stdout

    reweighted = keel("train", "--resume", str(run_dir), f"--data.sources={blend_of(0.5, sources['letters'], 0.5, sources['digits'])}")
    assert_one_line_error(reweighted, ["data version", "in the checkpoint (data.sources=", "Resume with the run's own config"])


@pytest.mark.slow
def test_a_bad_blend_stops_keel_train_before_any_worker(sources, tmp_path):
    missing = blend_of(1, sources["letters"], 1, tmp_path / "x.bin")
    proc = keel("train", "--config", "tiny", "--run-dir", str(tmp_path / "run"), f"--data.sources={missing}")
    assert_one_line_error(proc, ["data.sources: data.source=", "x.bin: file not found"])
    assert not (tmp_path / "run").exists()
