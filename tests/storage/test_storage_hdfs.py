"""HDFS backend: its own logic without a cluster; the contract on a real cluster when one is given.

No HDFS NameNode can run on a test machine without Java and Hadoop, so:
- URL parsing, NameNode resolution from Hadoop XML, the fail-fast probe, the
  missing-client-library error and the Java-exception mapping are tested here;
- the contract runs on ``HDFSStorage`` over a local fsspec filesystem (the
  backend's path, commit-by-rename and error handling, minus the wire);
- with ``BYTECP_TEST_HDFS_URL=hdfs://namenode:8020/tmp/bytecp`` the contract
  runs against that cluster (skipped with that reason otherwise).
"""

from __future__ import annotations

import builtins
import os
import socket
import sys
import time
import uuid

import pytest
from bytecp.storage import _retry
from bytecp.storage.hdfs import (
    HDFSStorage,
    HdfsUrl,
    namenode_addresses,
    parse_hdfs_url,
    probe_namenode,
)
from bytecp.storage.testing import StorageContract, StorageFixtures
from fsspec.implementations.local import LocalFileSystem

from bytecp.errors import CheckpointExistsError, ConfigError, StorageError
from bytecp.storage_api import open_storage
from tests.netport import free_port

HDFS_URL = os.environ.get("BYTECP_TEST_HDFS_URL")


class TestHDFSLogic(StorageFixtures, StorageContract):
    """The HDFS backend's own code over a local filesystem (no cluster)."""

    @pytest.fixture
    def storage(self, tmp_path):
        root = tmp_path / "ck"
        st = open_storage(f"hdfs://namenode.invalid:8020{root}", filesystem=LocalFileSystem(auto_mkdir=True))
        assert isinstance(st, HDFSStorage)
        return st


@pytest.mark.skipif(not HDFS_URL, reason="set BYTECP_TEST_HDFS_URL=hdfs://NAMENODE:PORT/PATH to run against a cluster")
class TestHDFSCluster(StorageFixtures, StorageContract):
    @pytest.fixture
    def storage(self):
        st = open_storage(f"{HDFS_URL.rstrip('/')}/{uuid.uuid4().hex}")
        yield st
        st.delete_prefix()


def test_parse_urls():
    assert parse_hdfs_url("hdfs://nn1:9000/user/x/ckpt") == HdfsUrl("hdfs", "nn1", 9000, "/user/x/ckpt")
    assert parse_hdfs_url("hdfs:///user/x") == HdfsUrl("hdfs", None, None, "/user/x")
    assert parse_hdfs_url("hdfs://ns1/a") == HdfsUrl("hdfs", "ns1", None, "/a")
    assert parse_hdfs_url("viewfs://cluster/a").scheme == "viewfs"
    with pytest.raises(ConfigError, match="not an HDFS URL"):
        parse_hdfs_url("s3://b/k")
    with pytest.raises(ConfigError, match="port"):
        parse_hdfs_url("hdfs://nn:notaport/x")
    with pytest.raises(ConfigError, match="query"):
        parse_hdfs_url("hdfs://nn:8020/x?user=a")


def _xml(path, props):
    body = "".join(f"<property><name>{k}</name><value>{v}</value></property>" for k, v in props.items())
    path.write_text(f'<?xml version="1.0"?><configuration>{body}</configuration>')


def test_namenode_addresses_from_url_and_hadoop_conf(tmp_path):
    assert namenode_addresses(parse_hdfs_url("hdfs://nn:9000/x"), str(tmp_path)) == [("nn", 9000)]
    assert namenode_addresses(parse_hdfs_url("hdfs://nn/x"), str(tmp_path)) == [("nn", 8020)]
    assert namenode_addresses(parse_hdfs_url("hdfs:///x"), str(tmp_path)) == []  # no core-site.xml
    _xml(tmp_path / "core-site.xml", {"fs.defaultFS": "hdfs://ns1"})
    _xml(
        tmp_path / "hdfs-site.xml",
        {
            "dfs.nameservices": "ns1",
            "dfs.ha.namenodes.ns1": "nn1,nn2",
            "dfs.namenode.rpc-address.ns1.nn1": "host-a:8020",
            "dfs.namenode.rpc-address.ns1.nn2": "host-b:8021",
        },
    )
    assert namenode_addresses(parse_hdfs_url("hdfs:///x"), str(tmp_path)) == [("host-a", 8020), ("host-b", 8021)]
    assert namenode_addresses(parse_hdfs_url("hdfs://ns1/x"), str(tmp_path)) == [("host-a", 8020), ("host-b", 8021)]
    assert namenode_addresses(parse_hdfs_url("viewfs://c/x"), str(tmp_path)) == []
    (tmp_path / "core-site.xml").write_text("<configuration><property>")
    with pytest.raises(ConfigError, match="core-site.xml"):
        namenode_addresses(parse_hdfs_url("hdfs:///x"), str(tmp_path))


def test_unreachable_namenode_fails_fast_naming_it():
    port = free_port()  # nothing listens there
    t0 = time.monotonic()
    with pytest.raises(StorageError, match=rf"cannot reach the HDFS NameNode.*127.0.0.1:{port}"):
        open_storage(f"hdfs://127.0.0.1:{port}/ckpt", probe_timeout=2)
    assert time.monotonic() - t0 < 3


def test_probe_passes_when_any_namenode_answers():
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen()
        up = srv.getsockname()[1]
        probe_namenode("hdfs://ns/x", [("127.0.0.1", free_port()), ("127.0.0.1", up)], timeout=2)


def test_missing_client_library_names_the_extra(monkeypatch):
    """Neither hdfs-native nor a usable pyarrow HadoopFileSystem: the error says what to install."""
    real_import = builtins.__import__

    def no_hdfs_native(name, *args, **kwargs):
        if name.startswith("hdfs_native"):
            raise ImportError(f"No module named {name!r}")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_hdfs_native)
    monkeypatch.delenv("ARROW_LIBHDFS_DIR", raising=False)
    monkeypatch.delenv("HADOOP_HOME", raising=False)
    with socket.socket() as srv:  # a reachable "NameNode" so the probe passes
        srv.bind(("127.0.0.1", 0))
        srv.listen()
        url = f"hdfs://127.0.0.1:{srv.getsockname()[1]}/ckpt"
        with pytest.raises(StorageError, match=r"pip install 'bytecp\[hdfs\]'") as info:
            open_storage(url)
        assert url in str(info.value)
        with pytest.raises(StorageError, match=r"pip install 'bytecp\[hdfs\]'"):
            open_storage(url, client="hdfs-native")


def test_client_option_is_validated():
    with pytest.raises(ConfigError, match="client='java'"):
        open_storage("hdfs://nn:8020/x", client="java")


@pytest.mark.parametrize(
    ("message", "kind"),
    [
        ("org.apache.hadoop.ipc.StandbyException: Operation category READ is not supported", _retry.TRANSIENT),
        ("org.apache.hadoop.hdfs.server.namenode.SafeModeException: Name node is in safe mode", _retry.TRANSIENT),
        ("org.apache.hadoop.security.AccessControlException: Permission denied: user=a", _retry.PERMISSION),
        ("java.io.FileNotFoundException: File does not exist: /x", _retry.NOT_FOUND),
    ],
)
def test_java_exceptions_are_classified(message, kind):
    assert _retry.classify(OSError(message)).kind == kind


def test_commit_replaces_through_rename(tmp_path):
    st = HDFSStorage(f"hdfs://nn:8020{tmp_path}/c", filesystem=LocalFileSystem(auto_mkdir=True))
    st.commit("metadata.json", b"one")
    st.commit("metadata.json", b"two")
    assert st.read_bytes("metadata.json") == b"two"
    assert st.list_files() == ["metadata.json"]
    assert st.child("sub").options()["filesystem"] is st.fs


class RecordingHdfsFS(LocalFileSystem):
    """Stands in for hdfs_native.fsspec.HdfsFileSystem: records its arguments, stores on local disk."""

    made: list = []
    moves: list = []

    def __init__(self, host=None, port=None, **options):
        super().__init__(auto_mkdir=True)
        RecordingHdfsFS.made.append((host, port, options))

    def mv(self, path1, path2, **kwargs):
        RecordingHdfsFS.moves.append(kwargs)
        if kwargs.get("overwrite"):
            os.replace(path1, path2)
        elif os.path.exists(path2):  # a NameNode rename without overwrite refuses
            raise FileExistsError(f"org.apache.hadoop.fs.FileAlreadyExistsException: {path2}")
        else:
            super().mv(path1, path2)


@pytest.fixture
def fake_hdfs_native(monkeypatch):
    import types

    pkg = types.ModuleType("hdfs_native")
    mod = types.ModuleType("hdfs_native.fsspec")
    mod.HdfsFileSystem = mod.ViewfsFileSystem = RecordingHdfsFS
    pkg.fsspec = mod
    monkeypatch.setitem(sys.modules, "hdfs_native", pkg)
    monkeypatch.setitem(sys.modules, "hdfs_native.fsspec", mod)
    RecordingHdfsFS.made.clear()
    RecordingHdfsFS.moves.clear()
    return RecordingHdfsFS


def test_client_options_reach_hdfs_native(fake_hdfs_native, tmp_path):
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen()
        port = srv.getsockname()[1]
        st = open_storage(
            f"hdfs://127.0.0.1:{port}{tmp_path}/ck",
            config={"dfs.client.use.datanode.hostname": "true"},
            retry=7,
        )
    assert st.client_name == "hdfs-native"
    assert fake_hdfs_native.made == [("127.0.0.1", port, {"dfs.client.use.datanode.hostname": "true"})]
    assert st.root == f"{tmp_path}/ck"
    st.write_file("data/0.bin", [b"abc"])
    st.commit("metadata.json", b"1")
    st.commit("metadata.json", b"2")
    assert st.read_bytes("metadata.json") == b"2"
    assert fake_hdfs_native.moves == [{"overwrite": True}] * 2  # one NameNode rename with overwrite
    child = st.child("data")
    assert child.options()["config"] == {"dfs.client.use.datanode.hostname": "true"}
    assert child.options()["retry"] == 7
    assert child.retry.deadline == 7


def test_exclusive_commit_is_a_rename_without_overwrite(fake_hdfs_native, tmp_path, monkeypatch):
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen()
        st = open_storage(f"hdfs://127.0.0.1:{srv.getsockname()[1]}{tmp_path}/ck")
    assert st.exclusive_commit == "atomic"
    st.commit("metadata.json", b"first", exclusive=True)
    with pytest.raises(CheckpointExistsError, match="metadata.json already exists"):
        st.commit("metadata.json", b"second", exclusive=True)  # seen up front: no rename
    assert fake_hdfs_native.moves == [{"overwrite": False}]
    # another job commits between the up-front check and the rename: the NameNode refuses
    real_isfile = st.fs.isfile
    checks = []

    def isfile_missing_once(p):
        checks.append(p)
        return False if len(checks) == 1 else real_isfile(p)

    monkeypatch.setattr(st.fs, "isfile", isfile_missing_once)
    with pytest.raises(CheckpointExistsError, match="metadata.json already exists"):
        st.commit("metadata.json", b"third", exclusive=True)
    assert fake_hdfs_native.moves == [{"overwrite": False}] * 2
    assert st.read_bytes("metadata.json") == b"first"
    assert st.list_files() == ["metadata.json"]  # the refused temp file is gone


def test_viewfs_uses_hdfs_native_without_probe(fake_hdfs_native):
    st = open_storage("viewfs://cluster/user/x")
    assert st.client_name == "hdfs-native"
    assert fake_hdfs_native.made[0][:2] == ("cluster", None)
