"""Tests of keras_gradtrack.io: the HDF5 log writer, reader and schema."""

import datetime
import json
import os
import time

import h5py
import numpy as np
import patience
import pytest
from helpers_io import (
    ATTRS,
    LAYERS,
    PER_EXAMPLE,
    PER_STEP,
    child_process,
    expected_tables,
    fake_step,
    make_writer,
    read_line,
    run_child,
    write_steps,
)

from keras_gradtrack.io import LogReader, LogWriter, schema
from keras_gradtrack.io.hdf5_tables import LIBVER


def assert_log_holds(path, steps):
    per_example, per_step = expected_tables(steps)
    with LogReader(path) as log:
        assert log.num_examples == len(per_example["step"])
        assert log.num_steps == len(steps)
        for name, values in per_example.items():
            np.testing.assert_array_equal(log.per_example(name), values, err_msg=name)
        for name, values in per_step.items():
            np.testing.assert_array_equal(log.per_step(name), values, err_msg=name)


def test_round_trip_with_ragged_batches(tmp_path):
    path = tmp_path / "run.h5"
    with make_writer(path, flush_every=2) as writer:
        assert (writer.step_offset, writer.last_step) == (0, None)
        steps = write_steps(writer, [4, 4, 3, 1, 2])
        assert writer.last_step == 4
    assert_log_holds(path, steps)
    with LogReader(path) as log:
        assert log.layers == LAYERS
        assert log.per_example_names == list(PER_EXAMPLE)
        assert log.per_step_names == list(PER_STEP)
        assert log.attrs.items() >= {**ATTRS, "schema_version": 2}.items()
        created = datetime.datetime.fromisoformat(log.attrs["created"])
        assert created.utcoffset() == datetime.timedelta(0)
        assert "14 example rows" in repr(log) and "layer_grad_norm" in repr(log)


def test_blocks_are_written_every_flush_every_steps(tmp_path):
    path = tmp_path / "run.h5"
    writer = make_writer(path, flush_every=3, flush_seconds=None)
    writer.open()
    write_steps(writer, [2, 2])
    with LogReader(path) as log:
        assert (log.num_examples, log.num_steps) == (0, 0)
        write_steps(writer, [2])
        log.refresh()
        assert (log.num_examples, log.num_steps) == (6, 3)
        write_steps(writer, [5])
        writer.flush()
        log.refresh()
        assert (log.num_examples, log.num_steps) == (11, 4)
    writer.close()
    writer.close()


def test_a_block_is_also_written_flush_seconds_after_the_last(tmp_path):
    path = tmp_path / "run.h5"
    with make_writer(path, flush_every=100, flush_seconds=1.0) as writer:
        write_steps(writer, [2, 2])
        with LogReader(path) as log:
            assert log.num_steps == 0  # well within the second
            time.sleep(1.05)
            write_steps(writer, [3])  # the first step after the second: one block
            log.refresh()
            assert (log.num_examples, log.num_steps) == (7, 3)
    every = tmp_path / "every.h5"
    with make_writer(every, flush_every=100, flush_seconds=0) as writer, LogReader(every) as log:
        for steps in range(1, 4):
            write_steps(writer, [2])
            log.refresh()
            assert log.num_steps == steps


def test_file_layout_follows_the_schema(tmp_path):
    path = tmp_path / "run.h5"
    with make_writer(path) as writer:
        write_steps(writer, [3])
    with h5py.File(path, "r") as file:  # plain h5py, no swmr: the writer closed cleanly
        assert list(file[schema.LAYERS_GROUP].attrs[schema.LAYER_NAMES_ATTR]) == LAYERS
        assert set(file.attrs) == set(schema.ROOT_ATTRS)
        for table, widths in (
            (schema.PER_EXAMPLE_GROUP, PER_EXAMPLE),
            (schema.PER_STEP_GROUP, PER_STEP),
        ):
            dtypes = {**schema.INDEX_COLUMNS[table], **dict.fromkeys(widths, np.dtype("float32"))}
            assert list(file[table]) == list(dtypes)
            for name, dtype in dtypes.items():
                dataset = file[table][name]
                width = widths.get(name)
                row_shape = () if width is None else (width,)
                assert dataset.dtype == dtype
                assert dataset.maxshape == (None, *row_shape)
                assert dataset.chunks == (schema.CHUNK_ROWS[table], *row_shape)
                assert (dataset.compression, dataset.compression_opts) == ("gzip", 4)
                assert dataset.shuffle


def test_compression_can_be_switched_off(tmp_path):
    with make_writer(tmp_path / "run.h5", compression=None) as writer:
        write_steps(writer, [3])
    with h5py.File(tmp_path / "run.h5", "r") as file:
        assert file["per_example/loss"].compression is None
        assert not file["per_example/loss"].shuffle


@pytest.mark.parametrize("compression", [None, "gzip", "lzf"])
def test_datasets_are_made_as_h5pys_create_dataset_makes_them(tmp_path, compression):
    made, expected = tmp_path / "run.h5", tmp_path / "h5py.h5"
    with make_writer(made, compression=compression) as writer:
        write_steps(writer, [3])
    filters = {} if compression is None else {"compression": compression, "shuffle": True}
    if compression == "gzip":
        filters["compression_opts"] = 4
    with h5py.File(made, "r") as file, h5py.File(expected, "w", libver=LIBVER) as own:
        names = [f"{table}/{name}" for table in schema.TABLES for name in file[table]]
        assert len(names) == 3 + len(PER_EXAMPLE) + 3 + len(PER_STEP)
        for name in names:
            own.create_dataset(
                name,
                shape=(0, *file[name].shape[1:]),
                maxshape=file[name].maxshape,
                dtype=file[name].dtype,
                chunks=file[name].chunks,
                fillvalue=-1 if file[name].dtype.kind == "i" else np.nan,
                **filters,
            )
    # Both read back from their files: HDF5 describes a dataset just made differently.
    with h5py.File(made, "r") as file, h5py.File(expected, "r") as own:
        for name in names:
            assert file[name].id.get_create_plist() == own[name].id.get_create_plist(), name
            assert file[name].id.get_type() == own[name].id.get_type(), name


def test_chunks_stay_under_one_mebibyte():
    assert schema.chunk_rows("per_example", None, 4) == 4096
    assert schema.chunk_rows("per_step", 3, 4) == 256
    assert schema.chunk_rows("per_example", 1000, 4) * 1000 * 4 <= 1 << 20
    assert schema.chunk_rows("per_example", 10**7, 4) == 1


def test_nan_and_inf_are_written_as_they_are(tmp_path):
    path = tmp_path / "run.h5"
    step = fake_step(0, 4)
    step["per_example"]["loss"] = np.array([np.nan, np.inf, -np.inf, 1e300])
    step["per_step"]["batch_grad_norm"] = np.nan
    with make_writer(path) as writer:
        writer.write_step(**step)
    with LogReader(path) as log:
        np.testing.assert_array_equal(log.per_example("loss"), [np.nan, np.inf, -np.inf, np.inf])
        assert np.isnan(log.per_step("batch_grad_norm")[0])


def test_append_continues_the_log(tmp_path):
    path = tmp_path / "run.h5"
    with make_writer(path) as writer:
        steps = write_steps(writer, [4, 2])
    with LogReader(path) as log:
        created = log.attrs["created"]
    with make_writer(path, append=True) as writer:
        assert (writer.step_offset, writer.last_step) == (2, None)
        steps += write_steps(writer, [3, 1], epoch=1)
    assert_log_holds(path, steps)
    with LogReader(path) as log:
        assert log.attrs["created"] == created


def test_append_to_a_missing_file_creates_it(tmp_path):
    with make_writer(tmp_path / "run.h5", append=True) as writer:
        assert writer.step_offset == 0
        steps = write_steps(writer, [2])
    assert_log_holds(tmp_path / "run.h5", steps)


@pytest.mark.parametrize(
    ("overrides", "argument"),
    [
        ({"layer_names": ["dense", "other", "head"]}, "layer_names"),
        ({"per_example": {"loss": None}}, "per_example"),
        ({"per_example": {"loss": None, "layer_grad_norm": None}}, "per_example"),
        ({"per_step": {**PER_STEP, "noise_scale": None}}, "per_step"),
    ],
)
def test_append_refuses_a_different_layout(tmp_path, overrides, argument):
    path = tmp_path / "run.h5"
    with make_writer(path) as writer:
        steps = write_steps(writer, [2])
    with pytest.raises(ValueError, match=f"its {argument} differ.*Received: {argument}="):
        make_writer(path, append=True, **overrides).open()
    assert_log_holds(path, steps)


def write_foreign_files(directory):
    """Files that are not logs of a supported schema, each with the error message expected for it."""
    (directory / "text.h5").write_text("not hdf5")
    with h5py.File(directory / "foreign.h5", "w") as file:
        file["data"] = np.arange(3)
    with make_writer(directory / "future.h5") as writer:
        write_steps(writer, [1])
    with h5py.File(directory / "future.h5", "r+") as file:
        file.attrs["schema_version"] = 3
    return {
        "text.h5": "not a keras_gradtrack log",
        "foreign.h5": "not a keras_gradtrack log",
        "future.h5": r"Expected schema_version in \[1, 2\]. Received: schema_version=3\.",
    }


def test_append_refuses_files_that_are_not_logs_of_a_supported_schema(tmp_path):
    for name, message in write_foreign_files(tmp_path).items():
        before = (tmp_path / name).read_bytes()
        with pytest.raises(ValueError, match=message):
            make_writer(tmp_path / name, append=True).open()
        assert (tmp_path / name).read_bytes() == before


def test_reader_refuses_files_that_are_not_logs_of_a_supported_schema(tmp_path):
    for name, message in write_foreign_files(tmp_path).items():
        with pytest.raises(ValueError, match=message):
            LogReader(tmp_path / name)
    with pytest.raises(FileNotFoundError, match=r"missing\.h5"):
        LogReader(tmp_path / "missing.h5")


def test_reader_lists_the_columns_when_one_is_unknown(tmp_path):
    with make_writer(tmp_path / "run.h5") as writer:
        write_steps(writer, [2])
    with LogReader(tmp_path / "run.h5") as log:
        with pytest.raises(KeyError, match=r"'cosine'.*\['step', 'epoch', 'example_id', 'loss'"):
            log.per_example("cosine")
        with pytest.raises(KeyError, match="batch_size"):
            log.per_step("example_id")


def test_overwrite_replaces_the_file(tmp_path):
    path = tmp_path / "run.h5"
    with make_writer(path) as writer:
        write_steps(writer, [4, 4])
    with make_writer(path, overwrite=True) as writer:
        assert writer.step_offset == 0
        steps = write_steps(writer, [1])
    assert_log_holds(path, steps)


@pytest.mark.parametrize(
    ("name", "flags", "error", "message"),
    [
        ("new.h5", {"overwrite": True, "append": True}, ValueError, "at most one of"),
        ("old.h5", {}, FileExistsError, "pass overwrite=True.*append=True"),
        ("missing/new.h5", {}, FileNotFoundError, "does not exist"),
        ("old.h5/new.h5", {}, NotADirectoryError, "not a directory"),
        (".", {"append": True}, IsADirectoryError, "Received a directory"),
    ],
)
def test_check_path_errors(tmp_path, name, flags, error, message):
    (tmp_path / "old.h5").write_bytes(b"precious")
    flags = {"overwrite": False, "append": False, **flags}
    with pytest.raises(error, match=message):
        LogWriter.check_path(tmp_path / name, **flags)
    with pytest.raises(error, match=message):
        make_writer(tmp_path / name, **flags).open()
    assert sorted(os.listdir(tmp_path)) == ["old.h5"]
    assert (tmp_path / "old.h5").read_bytes() == b"precious"


@pytest.mark.skipif(not os.path.isdir("/sys/kernel"), reason="needs Linux sysfs")
def test_check_path_refuses_a_directory_nobody_can_write():
    # sysfs refuses new files even to root, for whom os.access says yes.
    with pytest.raises(PermissionError, match="not writable"):
        LogWriter.check_path("/sys/kernel/run.h5", overwrite=False, append=False)


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root ignores mode bits")
def test_check_path_refuses_read_only_directories_and_files(tmp_path):
    (tmp_path / "old.h5").write_bytes(b"precious")
    (tmp_path / "old.h5").chmod(0o444)
    with pytest.raises(PermissionError, match="not writable"):
        LogWriter.check_path(tmp_path / "old.h5", overwrite=True, append=False)
    tmp_path.chmod(0o555)
    try:
        with pytest.raises(PermissionError, match="not writable"):
            LogWriter.check_path(tmp_path / "new.h5", overwrite=False, append=False)
    finally:
        tmp_path.chmod(0o755)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"layer_names": "dense"}, "sequence of strings"),
        ({"layer_names": ["a", "a", "b"]}, "unique layer names"),
        ({"per_example": {"loss": 2}}, r"len\(layer_names\)=3"),
        ({"per_example": {"example_id": None}}, "other than the index columns"),
        ({"per_step": {"a/b": None}}, "without '/'"),
        ({"attrs": {"model_name": "mlp"}}, "to hold the strings"),
        ({"attrs": {**ATTRS, "created": "today"}}, r"sets the attributes \['created'\]"),
        ({"flush_every": 0}, "positive integer"),
        ({"flush_seconds": -1}, "non-negative number or None"),
        ({"flush_seconds": "1"}, "non-negative number or None"),
        ({"compression": "zstd"}, "Expected compression in"),
    ],
)
def test_writer_arguments_are_checked(tmp_path, overrides, message):
    with pytest.raises(ValueError, match=message):
        make_writer(tmp_path / "run.h5", **overrides)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"step": -1}, "non-negative integer. Received: step=-1"),
        ({"epoch": 1.5}, "non-negative integer. Received: epoch=1.5"),
        ({"example_ids": np.zeros(4)}, "1-D array of integers"),
        ({"per_example": {"loss": np.zeros(4)}}, r"Received: \['loss'\]"),
        ({"per_example": {"loss": np.zeros(3), "layer_grad_norm": np.zeros((4, 3))}}, r"\(4,\)"),
        ({"per_step": {"batch_grad_norm": 1.0, "layer_batch_grad_norm": 1.0}}, r"\(3,\)"),
    ],
)
def test_write_step_arguments_are_checked(tmp_path, change, message):
    with make_writer(tmp_path / "run.h5") as writer:
        with pytest.raises(ValueError, match=message):
            writer.write_step(**{**fake_step(0, 4), **change})
        assert writer.last_step is None
    with LogReader(tmp_path / "run.h5") as log:
        assert (log.num_examples, log.num_steps) == (0, 0)


def test_writer_must_be_open_to_write(tmp_path):
    writer = make_writer(tmp_path / "run.h5")
    with pytest.raises(RuntimeError, match="Call open"):
        writer.write_step(**fake_step(0, 2))
    writer.close()  # closing a writer never opened does nothing
    assert not (tmp_path / "run.h5").exists()


def test_to_pandas_spreads_per_layer_statistics_over_columns(tmp_path):
    pytest.importorskip("pandas")
    with make_writer(tmp_path / "run.h5") as writer:
        steps = write_steps(writer, [3, 2])
    per_example, per_step = expected_tables(steps)
    with LogReader(tmp_path / "run.h5") as log:
        frame = log.to_pandas()
        per_step_frame = log.to_pandas("per_step")
        with pytest.raises(ValueError, match="Received: kind='layers'"):
            log.to_pandas("layers")
    layer_columns = [f"layer_grad_norm/{layer}" for layer in LAYERS]
    assert list(frame.columns) == ["step", "epoch", "example_id", "loss", *layer_columns]
    np.testing.assert_array_equal(frame[layer_columns], per_example["layer_grad_norm"])
    np.testing.assert_array_equal(frame["example_id"], per_example["example_id"])
    assert list(per_step_frame.columns[:4]) == ["step", "epoch", "batch_size", "batch_grad_norm"]
    np.testing.assert_array_equal(
        per_step_frame["layer_batch_grad_norm/head"], per_step["layer_batch_grad_norm"][:, 2]
    )


def test_half_written_blocks_are_hidden_from_readers_and_dropped_on_append(tmp_path):
    path = tmp_path / "run.h5"
    with make_writer(path) as writer:
        steps = write_steps(writer, [3, 2])
    with h5py.File(path, "r+") as file:  # as if killed while writing a block of 2 steps
        for name in ("step", "epoch", "example_id"):
            file["per_example"][name].resize((9,))
        file["per_example/loss"].resize((7,))
        file["per_step/step"].resize((4,))
    with LogReader(path) as log:
        assert (log.num_examples, log.num_steps) == (5, 2)
        assert log.per_example("example_id").shape == (5,)
    with make_writer(path, append=True) as writer:
        assert writer.step_offset == 2
        steps += write_steps(writer, [1])
    assert_log_holds(path, steps)


def test_refresh_reopens_a_log_not_opened_in_swmr_mode(tmp_path):
    path = tmp_path / "run.h5"
    with make_writer(path) as writer:
        steps = write_steps(writer, [2])
    steps.append(fake_step(1, 3))
    per_example, per_step = expected_tables(steps)
    # A plain h5py writer in this process: HDF5 shares its non-SWMR handle with readers.
    with h5py.File(path, "r+") as file, LogReader(path) as log:
        for table, columns in (("per_example", per_example), ("per_step", per_step)):
            for name, values in columns.items():
                file[table][name].resize(len(values), axis=0)
                file[table][name][:] = values
        log.refresh()
        assert (log.num_examples, log.num_steps) == (5, 2)
        np.testing.assert_array_equal(log.per_example("loss"), per_example["loss"])


def test_io_does_not_import_tensorflow_or_keras():
    returncode, stdout, stderr = run_child(
        """
        import keras_gradtrack.io
        print(sorted(m for m in sys.modules if m.split(".")[0] in ("tensorflow", "keras")))
        """
    )
    assert (returncode, stdout.strip()) == (0, "[]"), stderr


def test_a_reader_in_another_process_follows_the_writer(tmp_path):
    path = tmp_path / "run.h5"
    writer = make_writer(path, flush_every=100)
    writer.open()
    write_steps(writer, [4, 3])
    writer.flush()
    reader_code = f"""
        import json
        from keras_gradtrack.io import LogReader
        log = LogReader({str(path)!r})
        while True:
            print(json.dumps([log.num_examples, log.num_steps, log.per_step("step").tolist()]), flush=True)
            if not sys.stdin.readline().strip():
                break
            log.refresh()
        """
    with writer, child_process(reader_code) as reader:
        assert json.loads(read_line(reader)) == [7, 2, [0, 1]]
        write_steps(writer, [2])
        reader.stdin.write("refresh\n")
        reader.stdin.flush()
        assert json.loads(read_line(reader)) == [7, 2, [0, 1]]  # not flushed yet
        writer.flush()
        reader.stdin.write("refresh\n")
        reader.stdin.flush()
        assert json.loads(read_line(reader)) == [9, 3, [0, 1, 2]]
        reader.communicate(input="\n", timeout=patience.seconds())
        assert reader.returncode == 0


def test_a_killed_writer_leaves_every_flushed_row(tmp_path):
    path = tmp_path / "run.h5"
    returncode, _, stderr = run_child(
        f"""
        import os, signal
        from helpers_io import make_writer, write_steps
        writer = make_writer({str(path)!r}, flush_every=2, flush_seconds=None)
        writer.open()
        write_steps(writer, [4, 3, 2])  # the third step stays in the buffer
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    assert returncode == -9, stderr
    steps = [fake_step(0, 4), fake_step(1, 3)]
    assert_log_holds(path, steps)
    with pytest.raises(OSError, match="h5clear"):
        make_writer(path, append=True).open()
