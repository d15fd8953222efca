"""HDFS backend (``hdfs://namenode:8020/path``, ``hdfs:///path``, ``viewfs://``).

The same protocol as every backend, through an fsspec filesystem backed by
one of two client libraries:

- ``hdfs-native`` (pure Rust, no JVM; ``pip install 'bytecp[hdfs]'``), the
  default when installed;
- pyarrow's ``HadoopFileSystem`` (needs ``libhdfs.so`` and a Java runtime:
  ``HADOOP_HOME``/``ARROW_LIBHDFS_DIR``, ``CLASSPATH``).

Neither installed: a :class:`~bytecp.errors.StorageError` names the extra.

Before a client is created, the NameNode's RPC address (from the URL, or
``fs.defaultFS`` and the HA settings in ``$HADOOP_CONF_DIR``) is probed with
a plain TCP connect (``probe_timeout``, 5 s): an unreachable NameNode fails
at once with an error naming the address, instead of after the client
library's own retries (over 100 s for hdfs-native against a closed port).

Writes stream each file through the client; ``commit`` writes a temporary
file and renames it over ``metadata.json`` (HDFS renames are atomic on the
NameNode; hdfs-native renames with overwrite in one call, pyarrow deletes
the old file first). An exclusive commit (a save without ``overwrite``)
renames without overwrite: the NameNode refuses to replace an existing
file, so two jobs racing to one URL cannot both commit (atomic with both
clients). Java exception names in error messages are mapped:
``StandbyException``/``RetriableException``/``SafeModeException`` and
connection errors are retried, ``AccessControlException`` is a permission
error, ``FileNotFoundException`` means missing.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import urllib.parse
import xml.etree.ElementTree as ET
from typing import Any

from bytecp.errors import ConfigError, StorageError
from bytecp.storage_api import split_protocol

from . import _retry
from ._errors import file_url
from ._retry import NOT_FOUND, PERMISSION, TRANSIENT, RetryPolicy, Verdict
from .fsspec_backend import FsspecStorage

__all__ = ["HDFSStorage", "HdfsUrl", "parse_hdfs_url", "namenode_addresses", "probe_namenode"]

DEFAULT_NAMENODE_PORT = 8020
_CLIENTS = ("auto", "hdfs-native", "pyarrow")

_TRANSIENT_MARKERS = (
    "StandbyException",
    "RetriableException",
    "SafeModeException",
    "ConnectException",
    "SocketTimeoutException",
    "EOFException",
    "Connection refused",
    "Connection reset",
    "Broken pipe",
    "timed out",
)
_PERMISSION_MARKERS = ("AccessControlException", "Permission denied", "GSSException", "AuthenticationException")
_NOT_FOUND_MARKERS = ("FileNotFoundException", "File does not exist")


def _classify_hdfs(exc: BaseException) -> Verdict | None:
    """Map Java exception names carried in client errors (registered with :mod:`._retry`)."""
    text = str(exc)
    if "Exception" not in text and "hdfs" not in type(exc).__module__.lower():
        return None
    for marker in _PERMISSION_MARKERS:
        if marker in text:
            return Verdict(PERMISSION, marker)
    for marker in _NOT_FOUND_MARKERS:
        if marker in text:
            return Verdict(NOT_FOUND, marker)
    for marker in _TRANSIENT_MARKERS:
        if marker in text:
            return Verdict(TRANSIENT, marker.replace(" ", "_"))
    return None


_retry.register_classifier(_classify_hdfs)


@dataclasses.dataclass(frozen=True)
class HdfsUrl:
    """The parts of an ``hdfs://`` URL; ``host`` is ``None`` for ``hdfs:///path``."""

    scheme: str
    host: str | None
    port: int | None
    path: str


def parse_hdfs_url(url: str) -> HdfsUrl:
    """Split ``hdfs://host:port/path``; reject what is not an HDFS URL with a clear error."""
    proto, _ = split_protocol(url)
    if proto not in ("hdfs", "viewfs"):
        raise ConfigError(f"{url!r} is not an HDFS URL: expected hdfs://NAMENODE[:PORT]/PATH or hdfs:///PATH")
    parsed = urllib.parse.urlsplit(url)
    try:
        port = parsed.port
    except ValueError as e:
        raise ConfigError(f"{url!r}: invalid NameNode port ({e})") from e
    path = parsed.path or "/"
    if parsed.query or parsed.fragment:
        raise ConfigError(f"{url!r}: HDFS URLs take no query or fragment")
    return HdfsUrl(proto, parsed.hostname or None, port, path)


def _hadoop_conf_dir() -> str | None:
    d = os.environ.get("HADOOP_CONF_DIR")
    if d:
        return d
    home = os.environ.get("HADOOP_HOME")
    if home:
        return os.path.join(home, "etc", "hadoop")
    return None


def _read_hadoop_xml(conf_dir: str | None, name: str) -> dict[str, str]:
    if not conf_dir:
        return {}
    path = os.path.join(conf_dir, name)
    if not os.path.isfile(path):
        return {}
    try:
        root = ET.parse(path).getroot()
    except ET.ParseError as e:
        raise ConfigError(f"{path}: not valid Hadoop XML configuration ({e})") from e
    out = {}
    for prop in root.iter("property"):
        k, v = prop.findtext("name"), prop.findtext("value")
        if k and v is not None:
            out[k.strip()] = v.strip()
    return out


def namenode_addresses(url: HdfsUrl, conf_dir: str | None = None) -> list[tuple[str, int]]:
    """The NameNode RPC addresses a URL resolves to (empty when they cannot be known).

    ``hdfs://host:port`` -> that address; ``hdfs://host`` -> the HA NameNodes of
    nameservice ``host`` from hdfs-site.xml, else ``host:8020``;
    ``hdfs:///path`` -> ``fs.defaultFS`` from core-site.xml. ``viewfs://``
    mount tables are not resolved (no probe).
    """
    if url.scheme != "hdfs":
        return []
    conf_dir = conf_dir if conf_dir is not None else _hadoop_conf_dir()
    host, port = url.host, url.port
    if host is None:
        default_fs = _read_hadoop_xml(conf_dir, "core-site.xml").get("fs.defaultFS", "")
        if not default_fs.startswith("hdfs://"):
            return []
        parsed = urllib.parse.urlsplit(default_fs)
        host, port = parsed.hostname, parsed.port
        if not host:
            return []
    if port is not None:
        return [(host, port)]
    site = _read_hadoop_xml(conf_dir, "hdfs-site.xml")
    if host in [s.strip() for s in site.get("dfs.nameservices", "").split(",")]:
        out = []
        for nn in site.get(f"dfs.ha.namenodes.{host}", "").split(","):
            addr = site.get(f"dfs.namenode.rpc-address.{host}.{nn.strip()}")
            if addr:
                h, _, p = addr.rpartition(":")
                out.append((h, int(p) if p.isdigit() else DEFAULT_NAMENODE_PORT))
        return out
    return [(host, DEFAULT_NAMENODE_PORT)]


def probe_namenode(url: str, addresses: list[tuple[str, int]], timeout: float) -> None:
    """TCP-connect to the NameNode(s); raise a clear error when none answers."""
    if not addresses or timeout <= 0:
        return
    errors = []
    for host, port in addresses:
        try:
            with socket.create_connection((host, port), timeout=timeout):
                return
        except OSError as e:
            errors.append(f"{host}:{port}: {type(e).__name__}: {e}")
    raise StorageError(
        f"{url}: cannot reach the HDFS NameNode ({'; '.join(errors)}). Check the URL's host and "
        "port (default 8020), that the cluster is up and reachable from this machine, and "
        "HADOOP_CONF_DIR for hdfs:/// URLs; probe_timeout=0 skips this check."
    )


def _install_hint(url: str, detail: str) -> StorageError:
    return StorageError(
        f"{url}: no HDFS client library is usable ({detail}). Install one: "
        "`pip install 'bytecp[hdfs]'` (hdfs-native, no JVM needed), or pyarrow with "
        "libhdfs.so and a Java runtime (HADOOP_HOME or ARROW_LIBHDFS_DIR, CLASSPATH)."
    )


class HDFSStorage(FsspecStorage):
    """A checkpoint directory on HDFS.

    Options: ``client`` (``"auto"``, ``"hdfs-native"`` or ``"pyarrow"``);
    ``probe_timeout`` (5 s; 0 skips the NameNode probe); ``config``: Hadoop
    settings for hdfs-native (``{"dfs.client.use.datanode.hostname": "true"}``);
    ``user``, ``replication``, ``kerb_ticket`` and other keywords go to the
    client's fsspec filesystem; ``retry`` as for every backend; ``filesystem``:
    an already configured fsspec filesystem to use instead (its protocol is
    not checked; tests use a local one).
    """

    backend = "hdfs"

    def __init__(
        self,
        url: str,
        *,
        client: str = "auto",
        probe_timeout: float = 5.0,
        config: dict[str, str] | None = None,
        filesystem: Any = None,
        retry: RetryPolicy | dict | float | None = None,
        **fs_options: Any,
    ) -> None:
        if client not in _CLIENTS:
            raise ConfigError(f"{url}: client={client!r} is not one of {', '.join(_CLIENTS)}")
        self.hdfs_url = parse_hdfs_url(url)
        self.client = client
        self.probe_timeout = float(probe_timeout)
        self.config = dict(config or {})
        self._filesystem = filesystem
        self._fs_options = dict(fs_options)
        super().__init__(url, retry=retry, **fs_options)

    def options(self) -> dict[str, Any]:
        opts = super().options()
        opts.update(client=self.client, probe_timeout=self.probe_timeout)
        if self.config:
            opts["config"] = dict(self.config)
        if self._filesystem is not None:
            opts["filesystem"] = self._filesystem
        return opts

    def child(self, path: str) -> HDFSStorage:
        # share this client (no new connection, no second probe)
        c = type(self)(
            file_url(self.url, path),
            client=self.client,
            probe_timeout=self.probe_timeout,
            config=self.config,
            filesystem=self.fs,
            retry=self._retry_option,
            **self._fs_options,
        )
        c.client_name = self.client_name
        return c

    def _make_fs(self, url: str, options: dict[str, Any]) -> tuple[Any, str]:
        u = self.hdfs_url
        if self._filesystem is not None:
            self.client_name = "given"
            return self._filesystem, u.path
        probe_namenode(url, namenode_addresses(u), self.probe_timeout)
        errors = []
        if self.client in ("auto", "hdfs-native"):
            try:
                from hdfs_native.fsspec import HdfsFileSystem, ViewfsFileSystem
            except ImportError as e:
                errors.append(f"hdfs-native: {e}")
                if self.client == "hdfs-native":
                    raise _install_hint(url, "; ".join(errors)) from e
            else:
                cls = HdfsFileSystem if u.scheme == "hdfs" else ViewfsFileSystem
                self.client_name = "hdfs-native"
                try:
                    return cls(u.host, u.port, **self.config, **options), u.path
                except Exception as e:
                    raise _retry.to_storage_error(e, f"{url} (connect with hdfs-native)") from e
        if self.client in ("auto", "pyarrow"):
            if u.scheme != "hdfs":
                raise ConfigError(f"{url}: pyarrow's HadoopFileSystem does not serve viewfs:// URLs; use hdfs-native")
            try:
                import pyarrow.fs as pafs
                from fsspec.implementations.arrow import ArrowFSWrapper

                hfs = pafs.HadoopFileSystem(
                    u.host or "default", u.port if u.port is not None else (0 if u.host is None else DEFAULT_NAMENODE_PORT),
                    **options,
                )
            except (ImportError, OSError) as e:
                errors.append(f"pyarrow HadoopFileSystem: {e}")
                raise _install_hint(url, "; ".join(errors)) from e
            self.client_name = "pyarrow"
            return ArrowFSWrapper(hfs), u.path
        raise _install_hint(url, "; ".join(errors))  # pragma: no cover - client validated above

    @property
    def exclusive_commit(self) -> str:  # type: ignore[override]
        if getattr(self, "client_name", "") in ("hdfs-native", "pyarrow"):
            return "atomic"
        return super().exclusive_commit

    def _links_locally(self) -> bool:
        # a real client renames on the NameNode, whatever filesystem class stands in
        return getattr(self, "client_name", "") not in ("hdfs-native", "pyarrow") and super()._links_locally()

    def _rename_new(self, src: str, dst: str, path: str) -> None:
        """A NameNode rename without overwrite: fails if ``dst`` exists (atomic)."""
        name = getattr(self, "client_name", "")
        if name not in ("hdfs-native", "pyarrow"):
            super()._rename_new(src, dst, path)
            return
        try:
            if name == "hdfs-native":
                self.fs.mv(src, dst, overwrite=False)
            else:
                self.fs.mv(src, dst)  # libhdfs's rename never replaces
        except Exception:
            if self.fs.isfile(dst):
                raise self._exists(path) from None
            raise

    def _rename_over(self, src: str, dst: str) -> None:
        if getattr(self, "client_name", "") == "hdfs-native":
            self.fs.mv(src, dst, overwrite=True)  # one NameNode rename with OVERWRITE
            return
        try:
            self.fs.mv(src, dst)
        except (FileExistsError, OSError):
            if not self.fs.exists(dst):
                raise
            # libhdfs's rename does not replace: remove the old file first
            self.fs.rm(dst)
            self.fs.mv(src, dst)
