"""keeper:// backend: the storage contract against two in-process keepers,
replication, tokens, and the memory budget."""

from __future__ import annotations

import os
import signal
import time
import uuid
from collections.abc import Iterator

import pytest
from bytecp.storage._keeper_wire import request
from bytecp.storage.keeper import KeeperStorage
from bytecp.storage.keeper_server import Keeper
from bytecp.storage.testing import StorageContract, StorageFixtures
from keepers import TOKEN, pair_fixture, spec, start_keepers

from bytecp.errors import CorruptCheckpointError, StorageError
from bytecp.storage_api import open_storage

pair = pair_fixture("h0", "h1")


class TestKeeper(StorageFixtures, StorageContract):
    xfail = {}

    @pytest.fixture
    def storage(self, pair: list[Keeper]) -> Iterator[KeeperStorage]:
        st = open_storage(f"keeper://job/{uuid.uuid4().hex}", keepers=spec(pair), host="h0", token=TOKEN)
        assert isinstance(st, KeeperStorage)
        yield st
        st.delete_prefix()


def test_each_file_has_two_copies_and_reads_survive_losing_one(pair: list[Keeper]) -> None:
    run = uuid.uuid4().hex
    st = open_storage(f"keeper://job/{run}", keepers=spec(pair), host="h1", token=TOKEN)
    st.write_file("data/0.bin", [b"abc" * 1000])
    for k in pair:
        assert k._sizes(f"job/{run}") == {f"job/{run}/data/0.bin": 3000}
    pair[1].op_delete({"paths": [f"job/{run}"]}, memoryview(b""))  # the local copy is lost
    assert st.read_bytes("data/0.bin") == b"abc" * 1000  # from the peer
    outs = [memoryview(bytearray(3)), memoryview(bytearray(6))]
    st.read_ranges("data/0.bin", [(0, outs[0]), (2994, outs[1])])  # one request to the peer
    assert bytes(outs[0]) == b"abc" and bytes(outs[1]) == b"abcabc"
    with pytest.raises(CorruptCheckpointError):
        st.read_ranges("data/0.bin", [(0, outs[0]), (2998, outs[1])])


def test_wrong_token_is_refused(pair: list[Keeper]) -> None:
    st = open_storage("keeper://job/x", keepers=spec(pair), host="h0", token="another-job")
    with pytest.raises(StorageError, match="wrong job token"):
        st.write_file("a", [b"1"])


def test_budget_evicts_older_checkpoints_then_refuses() -> None:
    keepers = start_keepers(["b0", "b1"], budget=10_000)
    try:
        st = open_storage("keeper://run", keepers=spec(keepers), host="b0", token=TOKEN)
        for step in (1, 2, 3):
            st.write_file(f"step-{step}/d.bin", [bytes(4000)])
            st.commit(f"step-{step}/metadata.json", b"{}")
        assert sorted(st.list_children("")) == ["step-2", "step-3"]  # step-1 evicted
        with pytest.raises(StorageError, match="budget of 10000 bytes cannot hold"):
            st.write_file("step-4/d.bin", [bytes(20_000)])
    finally:
        for k in keepers:
            k.close()


def test_a_budget_eviction_evicts_the_checkpoint_at_every_keeper() -> None:
    keepers = start_keepers(["e0", "e1"], budget=10_000)
    keepers[1].budget = None  # e1 would keep everything: it evicts because e0 does
    try:
        st = open_storage("keeper://run", keepers=spec(keepers), host="e0", token=TOKEN)
        for step in (1, 2, 3):
            st.write_file(f"step-{step}/d.bin", [bytes(4000)])
            st.commit(f"step-{step}/metadata.json", b"{}")
        for _ in range(200):
            if "run/step-1" not in keepers[1]._committed():
                break
            time.sleep(0.02)
        assert [k._committed() for k in keepers] == [["run/step-2", "run/step-3"]] * 2
        assert keepers[1]._sizes("run/step-1") == {}
    finally:
        for k in keepers:
            k.close()


def test_keeper_metrics_report_memory_replication_and_drains(pair: list[Keeper], tmp_path) -> None:
    from bytecp.monitoring.keeper_metrics import KeeperCollector
    from prometheus_client import CollectorRegistry

    run = uuid.uuid4().hex
    st = open_storage(f"keeper://job/{run}/step-1", keepers=spec(pair), host="h0", token=TOKEN)
    data = os.urandom(5000)  # drained from a mapping of the keeper's copy: every byte in place
    st.write_file("data/0.bin", [data])
    st.commit("metadata.json", b"{}")
    reg = CollectorRegistry()
    reg.register(KeeperCollector(lambda: pair[0].op_stats({}, memoryview(b""))[0], "j"))
    labels = {"job": "j", "host": "h0"}
    assert reg.get_sample_value("bytecp_keeper_memory_bytes", labels) >= 5000
    assert reg.get_sample_value("bytecp_keeper_checkpoints", labels) >= 1
    assert reg.get_sample_value("bytecp_keeper_replication_seconds", labels) > 0
    st.drain_to(str(tmp_path / "out"))  # type: ignore[attr-defined]
    for _ in range(200):
        if reg.get_sample_value("bytecp_keeper_drains", {**labels, "state": "done"}):
            break
        time.sleep(0.02)
    assert (tmp_path / "out" / "data" / "0.bin").read_bytes() == data
    assert (tmp_path / "out" / "metadata.json").read_bytes() == b"{}"


def test_copies_go_to_another_failure_domain_first() -> None:
    k = Keeper("a1", 0, TOKEN, {"a2": ("127.0.0.1", 1), "b1": ("127.0.0.1", 2), "b2": ("127.0.0.1", 3)},
               domains={"a1": "rackA", "a2": "rackA", "b1": "rackB", "b2": "rackB"})
    try:
        assert [n for n, _ in k._ring()] == ["b1", "b2", "a2"]
    finally:
        k.close()


def test_a_run_does_not_list_a_sibling_sharing_its_prefix(pair: list[Keeper]) -> None:
    base = uuid.uuid4().hex
    for name in ("run", "run2"):
        open_storage(f"keeper://{base}/{name}", keepers=spec(pair), host="h0", token=TOKEN).write_file("a", [b"1"])
    assert open_storage(f"keeper://{base}/run", keepers=spec(pair), host="h0", token=TOKEN).list_files() == ["a"]


@pytest.mark.spawn
def test_the_first_save_on_a_host_starts_its_keeper(pair: list[Keeper]) -> None:
    from tests.netport import free_ports

    (port,) = free_ports(1)
    keepers = f"{spec(pair)},h9=127.0.0.1:{port}"
    st = open_storage("keeper://job/auto", keepers=keepers, host="h9", token=TOKEN, autostart=True)
    try:
        st.write_file("a", [b"xyz"])  # starts h9's keeper, detached; h0 takes the second copy
        assert st.read_bytes("a") == b"xyz"
        assert pair[0]._sizes("job/auto") == {"job/auto/a": 3}
        with pytest.raises(StorageError, match="is not running: start it with `bytecp keeper"):
            open_storage("keeper://job/x", keepers=f"{spec(pair)},h8=127.0.0.1:1", host="h8",
                         token=TOKEN).write_file("a", [b"1"])
    finally:
        answer, _ = request(("127.0.0.1", port), {"op": "hello", "token": TOKEN})
        os.kill(answer["pid"], signal.SIGTERM)  # the keeper frees its shared memory on SIGTERM
