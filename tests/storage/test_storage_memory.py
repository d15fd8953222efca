"""memory:// backend and the generic fsspec fallback, through the contract."""

from __future__ import annotations

import uuid

import fsspec
import pytest
from bytecp.storage.fsspec_backend import FsspecStorage
from bytecp.storage.memory import MemoryStorage
from bytecp.storage.testing import StorageContract, StorageFixtures
from fsspec.implementations.memory import MemoryFileSystem

from bytecp.errors import StorageError
from bytecp.storage_api import open_storage


class TestMemory(StorageFixtures, StorageContract):
    @pytest.fixture
    def storage(self):
        st = open_storage(f"memory://bytecp-tests/{uuid.uuid4().hex}")
        assert isinstance(st, MemoryStorage)
        yield st
        st.delete_prefix()


class IsolatedMemoryFS(MemoryFileSystem):
    """A filesystem under a protocol bytecp has no tuned backend for."""

    protocol = "bytecptest"
    store: dict = {}
    pseudo_dirs = [""]


fsspec.register_implementation("bytecptest", IsolatedMemoryFS, clobber=True)


class TestFsspecFallback(StorageFixtures, StorageContract):
    """An unregistered protocol is served by the generic fsspec backend."""

    @pytest.fixture
    def storage(self):
        st = open_storage(f"bytecptest://ckpt/{uuid.uuid4().hex}")
        assert type(st) is FsspecStorage
        yield st
        st.delete_prefix()


class TestFsspecOnLocalDisk(StorageFixtures, StorageContract):
    """The generic backend over fsspec's local filesystem (commit = temp file + rename)."""

    @pytest.fixture
    def storage(self, tmp_path):
        return FsspecStorage(f"file://{tmp_path}/ck", auto_mkdir=True)


def test_unknown_protocol_names_the_url_and_what_to_install():
    with pytest.raises(StorageError, match=r"nosuchproto://b/x: unknown URL scheme 'nosuchproto://'.*typo.*pip install"):
        open_storage("nosuchproto://b/x")
