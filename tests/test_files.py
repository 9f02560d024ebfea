"""Publishing into the shared cache folder: whole files and folders, the first one kept."""

from shardline.common.files import publish


def test_a_file_is_published_whole_and_the_first_copy_is_kept(tmp_path):
    path = tmp_path / "sub" / "choice.txt"
    assert publish(path, lambda tmp: tmp.write_text("first")) == path
    publish(path, lambda tmp: tmp.write_text("second"))  # another process, later
    assert path.read_text() == "first"
    assert [p.name for p in path.parent.iterdir()] == ["choice.txt"]  # no temporary left behind


def test_a_folder_is_published_whole_and_the_first_copy_is_kept(tmp_path):
    path = tmp_path / "tokenizer"

    def write(name):
        def into(tmp):
            (tmp / "tokenizer.json").write_text(name)

        return into

    publish(path, write("first"), folder=True)
    publish(path, write("second"), folder=True)
    assert (path / "tokenizer.json").read_text() == "first"
    assert [p.name for p in tmp_path.iterdir()] == ["tokenizer"]


def test_a_writer_that_fails_publishes_nothing(tmp_path):
    path = tmp_path / "weights.bin"

    def broken(tmp):
        tmp.write_text("half")
        raise OSError("disk full")

    try:
        publish(path, broken)
    except OSError:
        pass
    assert list(tmp_path.iterdir()) == []


def test_publishing_when_another_process_got_there_first_keeps_theirs(tmp_path):
    path = tmp_path / "choice.txt"

    def racing(tmp):  # while this one writes, another process publishes
        path.write_text("theirs")
        tmp.write_text("ours")

    publish(path, racing)
    assert path.read_text() == "theirs"
    assert [p.name for p in tmp_path.iterdir()] == ["choice.txt"]


def test_a_temporary_file_its_writer_left_is_removed_and_one_being_written_kept(tmp_path):
    """A shard killed while it kept its served weights leaves a temporary file of gigabytes: the
    next publish of that path removes it, but not one that another writer holds locked."""
    import fcntl
    import os

    path = tmp_path / "served.pt"
    abandoned, live = tmp_path / ".served.pt.dead", tmp_path / ".served.pt.live"
    abandoned.write_text("half")
    live.write_text("being written")
    fd = os.open(live, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)  # as publish holds its own while it writes
    try:
        publish(path, lambda tmp: tmp.write_text("whole"))
    finally:
        os.close(fd)
    assert sorted(p.name for p in tmp_path.iterdir()) == [".served.pt.live", "served.pt"]
