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
