"""Checkpoint checksums and retention on plain files (no torch): what `--load` refuses and what
`--save-retain K` deletes."""
import os

from megatron_vshape.integration import ckpt_integrity as integrity


def _checkpoint(root, iteration, files):
    target = os.path.join(root, f"iter_{iteration:07d}")
    os.makedirs(os.path.join(target, "sub"))
    for name, data in {"metadata.json": b"{}", **files}.items():
        with open(os.path.join(target, name), "wb") as f:
            f.write(data)
    names = integrity.files(target)
    entries = {}
    for rank in range(3):  # three ranks' shares make up the whole
        entries.update(integrity.digests(target, integrity.share(names, rank, 3)))
    integrity.write_manifest(target, entries)
    return target


def test_a_changed_a_truncated_and_a_missing_file_are_named(tmp_path):
    target = _checkpoint(str(tmp_path), 4, {"__0_0.distcp": b"x" * 1000, "sub/__1_0.distcp": b"y" * 10})
    manifest = integrity.read_manifest(target)
    assert sorted(manifest) == ["__0_0.distcp", "metadata.json", "sub/__1_0.distcp"]
    assert integrity.problem(target, manifest, manifest) is None
    shard = os.path.join(target, "__0_0.distcp")
    with open(shard, "r+b") as f:
        f.seek(500)
        f.write(b"z")
    assert "__0_0.distcp does not match its checksum" in integrity.problem(target, manifest, manifest)
    with open(shard, "wb") as f:
        f.write(b"x" * 10)
    assert "__0_0.distcp has 10 bytes, 1000 when saved" in integrity.problem(target, manifest, manifest)
    os.remove(shard)
    assert "__0_0.distcp cannot be read" in integrity.problem(target, manifest, manifest)


def test_retain_keeps_the_newest_and_the_one_resumed_from(tmp_path):
    root = str(tmp_path)
    dirs = {it: _checkpoint(root, it, {}) for it in (1, 2, 3, 4, 5)}
    os.makedirs(os.path.join(root, "iter_0000006"))  # incomplete (no metadata.json): not counted, not deleted
    gone = integrity.retire(root, 2, keep=[dirs[1]])
    assert sorted(gone) == [dirs[2], dirs[3]]
    assert [it for it, _ in integrity.iteration_dirs(root)] == [6, 5, 4, 1]
