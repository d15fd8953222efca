"""Local-disk backend: the contract, with and without O_DIRECT, plus its durability steps."""

from __future__ import annotations

import os

import pytest
from bytecp.storage.local import LocalStorage
from bytecp.storage.testing import StorageContract, StorageFixtures

from bytecp.errors import ConfigError, StoragePermissionError
from bytecp.storage_api import open_storage


class LocalFixtures(StorageFixtures):
    options: dict = {}

    @pytest.fixture
    def storage(self, tmp_path):
        return open_storage(str(tmp_path / "ckpt"), **self.options)


class TestLocal(LocalFixtures, StorageContract):
    pass


class TestLocalDirect(LocalFixtures, StorageContract):
    """O_DIRECT through aligned bounce buffers (buffered fallback where unsupported)."""

    options = {"direct": True}
    large_size = 9 * (1 << 20) + 4097  # more than one 8 MiB bounce buffer, unaligned tail


def test_file_url_and_plain_path_open_local(tmp_path):
    assert isinstance(open_storage(f"file://{tmp_path}"), LocalStorage)
    assert isinstance(open_storage(str(tmp_path)), LocalStorage)


def test_unknown_option_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="unknown option.*fsynk"):
        open_storage(str(tmp_path), fsynk=False)


def test_commit_fsyncs_data_directories_before_rename(tmp_path, monkeypatch):
    st = LocalStorage(str(tmp_path / "ck"))
    st.write_file("data/0-0.bin", [b"x" * 10])
    synced_dirs = []
    real_fsync = os.fsync
    order = []

    def fsync(fd):
        path = os.readlink(f"/proc/self/fd/{fd}")
        if os.path.isdir(path):
            synced_dirs.append(path)
        order.append(path)
        return real_fsync(fd)

    real_replace = os.replace

    def replace(a, b):
        order.append(f"rename->{b}")
        return real_replace(a, b)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", replace)
    st.commit("metadata.json", b"{}")
    root = str(tmp_path / "ck")
    assert os.path.join(root, "data") in synced_dirs  # the data file's directory entry
    assert root in synced_dirs
    rename_at = order.index(f"rename->{os.path.join(root, 'metadata.json')}")
    assert order.index(os.path.join(root, "data")) < rename_at  # before the commit point
    assert order[-1] == root  # and the directory holding metadata.json after it


def test_direct_io_bypasses_alignment_rules(tmp_path):
    st = LocalStorage(str(tmp_path / "d"), direct=True)
    data = os.urandom(10_000)
    st.write_file("odd.bin", [data[:3], data[3:]])
    assert st.size("odd.bin") == 10_000
    assert st.read_bytes("odd.bin", 4095, 10) == data[4095:4105]


@pytest.mark.skipif(os.geteuid() == 0, reason="root ignores file permissions")
def test_permission_error_is_typed(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    st = LocalStorage(str(ro))
    with pytest.raises(StoragePermissionError, match="ro"):
        st.write_file("f", [b"x"])
