"""The writer core numbers, orders and keeps the steps it is given, whoever stops it."""

import errno
import os

import numpy as np
import pytest
from helpers_io import expected_tables, fake_step, make_writer, run_child, write_steps

from keras_gradtrack.io import LogReader


def file_steps(path):
    with LogReader(path) as log:
        return log.per_step("step").tolist(), log.per_example("step").tolist()


def test_appended_steps_are_numbered_on_from_the_files_last_step(tmp_path):
    path = tmp_path / "run.h5"
    with make_writer(path) as writer:
        writer.write_step(**fake_step(0, 2))
        writer.write_step(**fake_step(4, 1))  # untracked steps between: gaps are kept
    with make_writer(path, append=True) as writer:
        assert writer.step_offset == 5
        # The caller counts from the start of its own run; the writer continues the file.
        writer.write_step(**fake_step(0, 1))
        writer.write_step(**fake_step(2, 2))
        assert writer.last_step == 7
    assert file_steps(path) == ([0, 4, 5, 7], [0, 0, 4, 5, 7, 7])


@pytest.mark.parametrize("repeated", [3, 2])
def test_a_step_that_does_not_come_after_the_last_is_refused(tmp_path, repeated):
    path = tmp_path / "run.h5"
    with make_writer(path) as writer:
        steps = write_steps(writer, [2, 1, 3, 1])
        with pytest.raises(
            ValueError, match=f"come after the previous one \\(3\\). Received: step={repeated}"
        ):
            writer.write_step(**fake_step(repeated, 2))
    per_example, per_step = expected_tables(steps)
    assert file_steps(path) == (per_step["step"].tolist(), per_example["step"].tolist())


def test_a_second_writer_on_a_file_this_process_writes_is_refused(tmp_path):
    path = tmp_path / "run.h5"
    first = make_writer(path, flush_every=100, flush_seconds=None)
    first.open()
    steps = write_steps(first, [2, 3])  # buffered, not yet in the file
    for flags in ({"append": True}, {"overwrite": True}):
        with pytest.raises(OSError, match="already open for writing in this process") as raised:
            make_writer(path, **flags).open()
        assert raised.value.errno == errno.EBUSY
    first.close()  # writes its buffered block
    with make_writer(path, append=True) as second:
        steps += write_steps(second, [1])
    per_example, _ = expected_tables(steps)
    assert file_steps(path) == ([0, 1, 2], per_example["step"].tolist())
    with LogReader(path) as log:
        np.testing.assert_array_equal(log.per_example("loss"), per_example["loss"])


@pytest.mark.parametrize("ending", ["an uncaught error", "sys.exit"])
def test_buffered_steps_reach_the_file_when_the_process_exits(tmp_path, ending):
    path = tmp_path / "run.h5"
    returncode, _, stderr = run_child(
        f"""
        from helpers_io import make_writer, write_steps
        writer = make_writer({str(path)!r}, flush_every=100, flush_seconds=None)
        writer.open()
        write_steps(writer, [4, 3, 2])  # all three buffered: no close() follows
        if {ending!r} == "sys.exit":
            sys.exit(0)
        raise RuntimeError("stopped")
        """
    )
    assert returncode == (0 if ending == "sys.exit" else 1), stderr
    assert file_steps(path)[0] == [0, 1, 2]


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_leaves_its_parents_file_alone(tmp_path):
    path = tmp_path / "run.h5"
    returncode, stdout, stderr = run_child(
        f"""
        import os
        from helpers_io import make_writer, write_steps
        from keras_gradtrack.io import LogReader
        writer = make_writer({str(path)!r}, flush_every=100, flush_seconds=None)
        writer.open()
        write_steps(writer, [4, 3])  # buffered when the child is forked
        read_end, write_end = os.pipe()
        child = os.fork()
        if child == 0:
            os.read(read_end, 1)
            sys.exit(0)  # a normal exit runs the exit handlers, in the child too
        write_steps(writer, [2])
        writer.flush()
        os.write(write_end, b"x")
        assert os.waitpid(child, 0)[1] == 0
        with LogReader({str(path)!r}) as log:
            print(log.per_step("step").tolist(), log.num_examples)
        writer.close()
        """
    )
    assert (returncode, stdout.strip()) == (0, "[0, 1, 2] 9"), stderr
    assert file_steps(path) == ([0, 1, 2], [0] * 4 + [1] * 3 + [2] * 2)


def test_int64_and_uint64_ids_are_exact_or_refused(tmp_path):
    path = tmp_path / "run.h5"
    extremes = np.array([np.iinfo(np.int64).max, np.iinfo(np.int64).min, 2**53 + 1, -1])
    below = np.array([2**63 - 1, 2**53 + 1], dtype=np.uint64)
    with make_writer(path) as writer:
        writer.write_step(**{**fake_step(0, 4), "example_ids": extremes})
        writer.write_step(**{**fake_step(1, 2), "example_ids": below})
        above = np.array([2**63, 1], dtype=np.uint64)
        with pytest.raises(ValueError, match=r"integers that fit int64\. Received: dtype=uint64"):
            writer.write_step(**{**fake_step(2, 2), "example_ids": above})
    with LogReader(path) as log:
        ids = log.per_example("example_id")
    assert ids.dtype == np.int64
    assert ids.tolist() == [*extremes.tolist(), 2**63 - 1, 2**53 + 1]


@pytest.mark.parametrize(
    "per_example, per_step",
    [({"learning_rate": None}, {}), ({}, {"learning_rate": 3})],
    ids=["per_example", "per_layer"],
)
def test_learning_rate_is_a_reserved_per_step_column(tmp_path, per_example, per_step):
    with pytest.raises(ValueError, match="'learning_rate' is reserved for the per-step"):
        make_writer(tmp_path / "run.h5", per_example=per_example, per_step=per_step)
