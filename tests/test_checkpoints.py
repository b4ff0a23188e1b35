"""The checkpoints epdmesh writes for itself: two processes writing the same one at once both end with it."""

import multiprocessing
import os

from epdmesh.checkpoints import write_once


def _slow_write(tmp, started, go):
    tmp.mkdir(parents=True)
    (tmp / "config.json").write_text(f"written by {os.getpid()}")
    started.set()
    go.wait(30)  # both writers hold a complete copy before either renames it


def _writer(path, started, go):
    write_once(path, "config.json", lambda tmp: _slow_write(tmp, started, go))


def test_two_processes_writing_one_checkpoint_at_once_both_end_with_it(tmp_path):
    ctx = multiprocessing.get_context("spawn")
    path = tmp_path / "models" / "x-config"
    started, go = [ctx.Event(), ctx.Event()], ctx.Event()
    procs = [ctx.Process(target=_writer, args=(path, started[i], go)) for i in range(2)]
    for p in procs:
        p.start()
    assert all(e.wait(60) for e in started)
    go.set()
    for p in procs:
        p.join(60)
    assert [p.exitcode for p in procs] == [0, 0]
    assert (path / "config.json").read_text().startswith("written by ")
    assert sorted(q.name for q in path.parent.iterdir()) == ["x-config"]  # no copy left behind


def test_an_interrupted_write_is_not_taken_for_the_checkpoint_and_is_redone(tmp_path):
    path = tmp_path / "x-config"

    def fails(tmp):
        tmp.mkdir()
        raise KeyboardInterrupt

    try:
        write_once(path, "config.json", fails)
    except KeyboardInterrupt:
        pass
    assert not path.exists()
    write_once(path, "config.json", lambda tmp: (tmp.mkdir(), (tmp / "config.json").write_text("ok")))
    assert (path / "config.json").read_text() == "ok"
    assert sorted(q.name for q in tmp_path.iterdir()) == ["x-config"]  # the interrupted copy (this pid's) is gone
