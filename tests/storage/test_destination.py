"""The Destination protocol itself (ckptkit/storage/destination.py): a local one (the atomic
commit) and one at a URL (staged, uploaded to moto's S3 server, visible only at the commit),
driven as convert drives them: planned, checked, each file written at its path and handed over,
all committed together in order, or none."""

from __future__ import annotations

import pytest
import servers

from ckptkit.errors import OutputError, UsageError
from ckptkit.storage.destination import LocalDestination, UrlDestination, destination

range_server = servers.range_server
s3_server = servers.s3_server
s3 = servers.s3
s3_env = servers.s3_env


def write_all(target, names, *, fail_after=None, folder=None, owns=None):
    """Plan ``names`` at the destination, check them, write each (``b"<name>"``) and commit;
    ``fail_after``: raise once that many files are handed over. Returns the planned paths."""
    with target.planned() as planned:
        base = planned if folder else planned.parent
        outputs = [base / name for name in names]
        target.check(outputs, folder=planned if folder else None)
        with target.files(outputs, folder=planned if folder else None, owns=owns) as files:
            for count, out in enumerate(outputs):
                if fail_after is not None and count == fail_after:
                    raise RuntimeError("stopped")
                files.path(out).write_bytes(out.name.encode())
                files.done(out)
    return outputs


def listing(s3, prefix):
    s3.fs.invalidate_cache()
    return sorted(p.rsplit("/", 1)[-1] for p in s3.fs.ls(prefix)) if s3.fs.exists(prefix) else []


def test_the_string_picks_the_kind(tmp_path, s3_env):
    s3_env.bucket("out")
    assert isinstance(destination(tmp_path / "m.safetensors", force=False), LocalDestination)
    assert isinstance(destination("s3://out/m.safetensors", force=False), UrlDestination)
    assert isinstance(destination("s3://out/model", force=False), UrlDestination)


def test_a_local_destination_commits_every_file_in_order_or_none(tmp_path):
    target = destination(tmp_path / "m.safetensors", force=False)
    names = ["m-00001-of-00002.safetensors", "m-00002-of-00002.safetensors", "m.index.json"]
    with pytest.raises(RuntimeError):
        write_all(target, names, fail_after=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no file, no temp file
    outputs = write_all(target, names)
    assert [p.read_bytes() for p in outputs] == [n.encode() for n in names]
    assert target.shown(outputs[0]) == str(outputs[0])
    with pytest.raises(OutputError, match="exists"):
        write_all(target, names)  # without force
    write_all(destination(tmp_path / "m.safetensors", force=True), names)


def test_a_local_folder_appears_whole_and_force_keeps_what_it_does_not_own(tmp_path):
    where = tmp_path / "save"
    target = destination(where, force=False)
    write_all(target, ["a.bin", ".metadata"], folder=True)
    assert sorted(p.name for p in where.iterdir()) == [".metadata", "a.bin"]
    (where / "notes.txt").write_text("mine")
    with pytest.raises(OutputError, match="exists"):
        write_all(target, ["a.bin", ".metadata"], folder=True)
    again = destination(where, force=True)
    write_all(again, ["b.bin", ".metadata"], folder=True, owns=lambda n: n != "notes.txt")
    assert sorted(p.name for p in where.iterdir()) == [".metadata", "b.bin", "notes.txt"]
    assert again.show_folder(where, ["b.bin"]) == [str(where)]  # named by itself


def test_local_stale_files_are_removed_by_name(tmp_path):
    (tmp_path / "m-00001-of-00003.safetensors").write_bytes(b"old")
    (tmp_path / "other.txt").write_bytes(b"kept")
    target = destination(tmp_path / "m.safetensors", force=True)
    write_all(target, ["m.safetensors"])
    target.remove_stale(tmp_path / "m.safetensors", lambda names: [n for n in names if "-of-" in n])
    assert sorted(target.names()) == ["m.safetensors", "other.txt"]
    assert target.missing([tmp_path / "m.safetensors", tmp_path / "gone.bin"]) == ["gone.bin"]


def test_a_url_destination_makes_its_files_visible_only_at_the_commit(s3_env):
    s3_env.bucket("out")
    target = destination("s3://out/run/m.safetensors", force=False)
    names = ["m-00001-of-00002.safetensors", "m-00002-of-00002.safetensors", "m.index.json"]
    with pytest.raises(RuntimeError):
        write_all(target, names, fail_after=2)  # two uploaded, none committed
    assert listing(s3_env, "out/run") == []
    outputs = write_all(target, names)
    assert listing(s3_env, "out/run") == sorted(names)
    assert s3_env.fs.cat("out/run/m.index.json") == b"m.index.json"
    assert target.shown(outputs[0]) == "s3://out/run/m-00001-of-00002.safetensors"
    with pytest.raises(OutputError, match="exists"):
        write_all(target, names)  # without force, as on disk
    assert sorted(target.names()) == sorted(names)
    forced = destination("s3://out/run/m.safetensors", force=True)
    (written,) = write_all(forced, ["m.safetensors"])
    forced.remove_stale(written, lambda present: [n for n in present if "-of-" in n])
    assert listing(s3_env, "out/run") == ["m.index.json", "m.safetensors"]


def test_a_url_folder_saved_whole_replaces_its_own_files_only(s3_env):
    s3_env.bucket("out")
    s3_env.fs.pipe("out/save/notes.txt", b"mine")
    with pytest.raises(OutputError, match="exists"):
        write_all(destination("s3://out/save", force=False, whole=True), ["a.bin"], folder=True)
    s3_env.fs.pipe("out/save/old.bin", b"old")
    target = destination("s3://out/save", force=True, whole=True)
    write_all(target, ["a.bin", ".metadata"], folder=True, owns=lambda n: n.endswith(".bin"))
    assert listing(s3_env, "out/save") == [".metadata", "a.bin", "notes.txt"]
    assert target.show_folder(target._local_root, ["a.bin"]) == ["s3://out/save/a.bin"]


def test_url_outputs_it_cannot_write_are_refused_before_anything(range_server, s3_env):
    with pytest.raises(UsageError, match=r"a \.safetensors or \.pt file"):
        destination("s3://out/model.txt", force=False)
    with pytest.raises(UsageError, match="--part writes shards beside a file"):
        destination("s3://out/model", force=False, parts=True)
    with pytest.raises(UsageError, match="HTTP URL"):
        with destination(range_server.url("m.safetensors"), force=False).planned():
            pass
