"""Extension points: adapters, storage backends and monitor kinds registered
in code (from any thread) or found through Python entry points of an
installed package (a real ``*.dist-info`` on ``sys.path``)."""

from __future__ import annotations

import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import bytecp.monitoring
import pytest
import torch
from bytecp.adapters.plain import PlainAdapter

import bytecp
from bytecp import adapter_api, recorder, storage_api
from bytecp.errors import ConfigError

PLUGIN = '''
from bytecp.adapters.plain import PlainAdapter
from bytecp.storage_api import open_storage

IMPORTED = True

class DemoAdapter(PlainAdapter):
    name = "demofw"

    @classmethod
    def detect(cls, state):
        return "demo_marker" in state

def open_demo(url, **options):
    return open_storage(url.split("://", 1)[1], **options)

class DemoRecorder:
    def __init__(self, address):
        self.address = address
        self.reports = []

    def on_report(self, report):
        self.reports.append(report)

    def on_event(self, name, value, labels):
        pass
'''


@pytest.fixture
def registries(monkeypatch: pytest.MonkeyPatch) -> None:
    """Fresh copies of the three registries, entry points not read yet."""
    monkeypatch.setattr(adapter_api, "_ADAPTERS", dict(adapter_api._ADAPTERS))
    monkeypatch.setattr(adapter_api, "_ORDER", list(adapter_api._ORDER))
    monkeypatch.setattr(adapter_api, "_discovered", False)
    monkeypatch.setattr(storage_api, "_REGISTRY", dict(storage_api._REGISTRY))
    monkeypatch.setattr(storage_api, "_discovered", False)
    monkeypatch.setattr(recorder, "_MONITOR_FACTORIES", dict(recorder._MONITOR_FACTORIES))
    monkeypatch.setattr(recorder, "_monitors_by_address", {})
    monkeypatch.setattr(recorder, "_monitors_discovered", False)


@pytest.fixture
def installed_plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, registries: None) -> str:
    """A package installed the way pip leaves one: a module and its dist-info with entry points."""
    name = f"bytecp_plugin_demo_{abs(hash(tmp_path)) % 10**8}"
    (tmp_path / f"{name}.py").write_text(PLUGIN)
    info = tmp_path / f"{name}-0.1.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 0.1\n")
    (info / "entry_points.txt").write_text(textwrap.dedent(f"""\
        [bytecp.adapters]
        demofw = {name}:DemoAdapter
        [bytecp.storage]
        demofs = {name}:open_demo
        [bytecp.monitors]
        demomon = {name}:DemoRecorder
        """))
    monkeypatch.syspath_prepend(str(tmp_path))
    return name


def test_entry_points_are_read_on_the_first_miss_and_imported_on_use(installed_plugin: str, tmp_path: Path) -> None:
    assert isinstance(adapter_api.detect_adapter({"x": torch.zeros(1)}, "ddp"), PlainAdapter)
    assert installed_plugin not in sys.modules and not adapter_api._discovered  # a hit reads nothing
    state: dict[str, Any] = {"demo_marker": 1, "w": torch.arange(6.0)}
    url = f"demofs://{tmp_path / 'ckpt'}"
    bytecp.save(url, state, monitor="demomon://collector:1")
    assert installed_plugin in sys.modules
    assert bytecp.load_state_dict(str(tmp_path / "ckpt"))["w"].equal(torch.arange(6.0))
    rec = recorder.resolve_monitor("demomon://collector:1")
    assert rec is not None and rec.address == "collector:1"  # type: ignore[attr-defined]
    assert [r.operation for r in rec.reports] == ["save"]  # type: ignore[attr-defined]
    from bytecp.loading.opened import read_metadata

    assert read_metadata(storage_api.open_storage(url)).framework == "demofw"


def test_code_registrations_win_over_entry_points(installed_plugin: str) -> None:
    adapter_api.register_adapter("demofw", PlainAdapter)
    assert type(adapter_api.get_adapter("demofw")) is PlainAdapter
    assert type(adapter_api.detect_adapter({"demo_marker": 1})) is PlainAdapter


def test_unknown_names_name_the_registries(registries: None) -> None:
    with pytest.raises(ConfigError, match="unknown framework 'nope'.*register_adapter"):
        adapter_api.get_adapter("nope")
    with pytest.raises(ConfigError, match="unknown monitor kind 'nope'.*register_monitor"):
        recorder.resolve_monitor("nope://host:1")


def test_register_monitor_makes_a_kind(registries: None) -> None:
    made: list[str] = []

    class Rec:
        def __init__(self, address: str) -> None:
            made.append(address)

        def on_report(self, report: Any) -> None: ...

        def on_event(self, name: str, value: float, labels: dict[str, str]) -> None: ...

    bytecp.monitoring.register_monitor("mine", Rec)
    a = recorder.resolve_monitor("mine://a:1")
    assert recorder.resolve_monitor("mine://a:1") is a and made == ["a:1"]
    with pytest.raises(ConfigError, match="plain name"):
        recorder.register_monitor("mine://x", Rec)


def test_register_adapter_from_many_threads(registries: None) -> None:
    names = [f"fw{i}" for i in range(64)]
    start = threading.Barrier(8)

    def work(k: int) -> None:
        start.wait()
        for name in names[k::8]:
            adapter_api.register_adapter(name, PlainAdapter)
            adapter_api.get_adapter(name)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    order = adapter_api._ORDER
    assert sorted(set(order)) == sorted(order)  # nobody inserted twice
    assert set(names) <= set(order) and order[-1] == "plain"
    assert all(type(adapter_api.get_adapter(n)) is PlainAdapter for n in names)
