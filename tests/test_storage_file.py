"""Opening the L3 file (hicache/storage_file.py, through FileStore): symbolic links, directories
and foreign owners refused, a path created 0600 and kept, an existing file truncated, a temporary
file removed, and sizes the file system cannot hold refused before anything is touched. Moved
unchanged from test_storage.py."""
from __future__ import annotations

import os
import stat

import pytest
import torch

from hicache.geometry import KVGeometry
from hicache.storage import FileStore

SMALL = KVGeometry(num_layers=2, num_kv_heads=2, head_dim=8, page_size=4, dtype=torch.float32)


def test_symlink_refused(tmp_path):
    target = tmp_path / "target"
    target.write_bytes(b"keep me")
    link = tmp_path / "link"
    link.symlink_to(target)
    with pytest.raises(ValueError, match="symbolic link"):
        FileStore(SMALL, num_slots=4, path=str(link))
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "nowhere")
    with pytest.raises(ValueError, match="symbolic link"):
        FileStore(SMALL, num_slots=4, path=str(dangling))
    assert target.read_bytes() == b"keep me"
    assert not (tmp_path / "nowhere").exists()


def test_directory_refused(tmp_path):
    with pytest.raises(ValueError, match="not a regular file"):
        FileStore(SMALL, num_slots=4, path=str(tmp_path))


def test_other_owner_refused(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("needs root to create a file owned by another uid")
    path = tmp_path / "foreign"
    path.write_bytes(b"x")
    os.chown(path, 54321, -1)
    with pytest.raises(ValueError, match="owned by uid 54321"):
        FileStore(SMALL, num_slots=4, path=str(path))


def test_path_created_0600_and_kept(tmp_path):
    path = tmp_path / "l3.kv"
    s = FileStore(SMALL, num_slots=5, path=str(path))
    st_ = os.stat(path)
    assert stat.S_IMODE(st_.st_mode) == 0o600
    assert st_.st_size == 5 * SMALL.bytes_per_page
    assert s.stats() == {**s.stats(), "path": str(path), "num_slots": 5,
                         "bytes_per_page": SMALL.bytes_per_page, "is_temp": False}
    s.close()
    assert path.exists()  # a given path is kept


def test_existing_file_truncated_and_chmodded(tmp_path):
    path = tmp_path / "old.kv"
    path.write_bytes(b"\xff" * (10 * SMALL.bytes_per_page))
    os.chmod(path, 0o644)
    with FileStore(SMALL, num_slots=3, path=str(path)) as s:
        assert s.exists([0, 1, 2]) == [False] * 3
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    data = path.read_bytes()
    assert len(data) == 3 * SMALL.bytes_per_page and data.count(0) == len(data)


def test_temp_file_removed_on_close():
    s = FileStore(SMALL, num_slots=2)
    assert s.stats()["is_temp"] and os.path.exists(s.path)
    assert stat.S_IMODE(os.stat(s.path).st_mode) == 0o600
    s.close()
    assert not os.path.exists(s.path)


def test_temp_file_removed_when_collected():
    s = FileStore(SMALL, num_slots=2)
    path = s.path
    del s
    import gc
    gc.collect()
    assert not os.path.exists(path)


@pytest.mark.parametrize("use_path", [True, False])
def test_free_space_check_refuses_absurd_size(tmp_path, use_path):
    pib = 1 << 50
    path = tmp_path / "huge.kv"
    with pytest.raises(ValueError, match=r"needs \d+ bytes .* only \d+ bytes .* available"):
        FileStore(SMALL, num_slots=pib // SMALL.bytes_per_page, path=str(path) if use_path else None)
    assert not path.exists()  # nothing left behind


def test_free_space_check_keeps_refused_existing_file(tmp_path):
    path = tmp_path / "keep.kv"
    path.write_bytes(b"abc")
    with pytest.raises(ValueError, match="needs"):
        FileStore(SMALL, num_slots=(1 << 50) // SMALL.bytes_per_page, path=str(path))
    assert path.read_bytes() == b"abc"  # refused before truncation


def test_second_store_on_the_same_path_refused_and_first_intact(tmp_path):
    """Two stores on one path (two engines given the same --hicache-storage-path) would truncate
    and overwrite each other's pages: the second is refused, the first's pages stay readable, and
    once the first closes the path can be opened again."""
    path = str(tmp_path / "shared.kv")
    src = torch.randn(SMALL.page_major_shape(2), generator=torch.Generator().manual_seed(5))
    first = FileStore(SMALL, num_slots=4, path=path)
    first.write_pages(src, [0, 1], [2, 3]).result(timeout=10)
    with pytest.raises(ValueError, match="another store has it open"):
        FileStore(SMALL, num_slots=4, path=path)
    with pytest.raises(ValueError, match="another store has it open"):
        FileStore(SMALL, num_slots=8, path=path)  # a different size would have truncated it too
    assert os.stat(path).st_size == 4 * SMALL.bytes_per_page
    dst = torch.zeros_like(src)
    first.read_pages([2, 3], dst, [0, 1]).result(timeout=10)
    assert torch.equal(dst, src)
    first.close()
    with FileStore(SMALL, num_slots=4, path=path) as again:
        assert again.exists([0, 1, 2, 3]) == [False] * 4
