"""metadata.json read as far as its header (bytecp/format/header.py): what
listing a run, retention and gc read of each checkpoint."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

import bytecp
from bytecp.catalog import list_checkpoints
from bytecp.errors import CorruptCheckpointError, FormatVersionError
from bytecp.format import header, json_head
from bytecp.format import metadata as fmt
from bytecp.storage_api import open_storage

GOLDEN = Path(__file__).parent.parent / "golden"


class Counting:
    """A storage that counts the bytes read from it."""

    def __init__(self, url: str) -> None:
        self.inner = open_storage(url)
        self.url = self.inner.url
        self.read = 0

    def read_bytes(self, path: str, offset: int = 0, nbytes: int | None = None) -> bytes:
        data = self.inner.read_bytes(path, offset, nbytes)
        self.read += len(data)
        return data

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


@pytest.fixture(scope="module")
def saved_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """step-1 (full, with user metadata past the first 64 KiB) and step-2 referencing it."""
    root = tmp_path_factory.mktemp("header-run")
    w = {f"w{i}": torch.full((64,), float(i)) for i in range(3000)}  # a metadata.json of several 100 kB
    bytecp.save(str(root / "step-1"), w, step=1)
    w["w0"] = w["w0"] + 1
    bytecp.save(str(root / "step-2"), w, step=2, base=str(root / "step-1"))
    return root


@pytest.fixture
def run(saved_run: Path, tmp_path: Path) -> Path:
    """A copy of :func:`saved_run` the test may damage (two saves of 3000 tensors: once a module)."""
    shutil.copytree(saved_run, tmp_path / "run")
    return tmp_path / "run"


def test_a_version_4_and_later_header_is_read_from_the_first_bytes(run: Path) -> None:
    st = Counting(str(run / "step-2"))
    size = st.size(fmt.METADATA_FILE)
    head = header.read_header(st)  # type: ignore[arg-type]
    md = fmt.Metadata.from_bytes((run / "step-2" / fmt.METADATA_FILE).read_bytes(), "x")
    assert head == header.Header(md.save_id, fmt.FORMAT_VERSION, 2, md.created, {"step-1": md.references["step-1"]})
    assert size > json_head.HEADER_BYTES >= st.read, (size, st.read)
    keys = list(json.loads((run / "step-2" / fmt.METADATA_FILE).read_bytes()))
    assert keys[: len(json_head.HEADER_KEYS)] == list(json_head.HEADER_KEYS)  # references among the header's members
    files = header.read_files(st)  # type: ignore[arg-type]
    assert files is not None and files.data_files == md.data_files and files.files_of("step-1") == md.files_of("step-1")
    assert [(c.name, c.step, c.references) for c in list_checkpoints(str(run))] == [
        ("step-1", 1, ()), ("step-2", 2, ("step-1",))]


def test_a_long_header_and_older_versions_are_parsed_whole(tmp_path: Path) -> None:
    bytecp.save(str(tmp_path / "ck"), {"w": torch.ones(3)}, metadata={"notes": "x" * (100 << 10)}, step=7)
    st = Counting(str(tmp_path / "ck"))
    head = header.read_header(st)  # type: ignore[arg-type]
    assert head is not None and head.step == 7 and st.read > 100 << 10
    for version in ("v1", "v2", "v3"):
        for ck in sorted((GOLDEN / version).glob("*/metadata.json")):
            md = fmt.Metadata.from_bytes(ck.read_bytes(), str(ck))
            got = header.read_header(open_storage(str(ck.parent)))
            assert got == header.Header(md.save_id, md.format_version, md.step, md.created, md.references), ck


def _rewrite(ck: Path, edit: Any) -> None:
    d = json.loads((ck / fmt.METADATA_FILE).read_bytes())
    (ck / fmt.METADATA_FILE).write_text(json.dumps(edit(d)))


@pytest.mark.parametrize("case", ["step", "version", "format", "references", "created", "twice", "late_step",
                                  "not_json"])
def test_a_bad_header_is_refused_in_one_line(run: Path, case: str) -> None:
    ck = run / "step-2"
    text = (ck / fmt.METADATA_FILE).read_text()
    if case == "step":
        _rewrite(ck, lambda d: {**d, "step": "two"})
    elif case == "version":
        _rewrite(ck, lambda d: {**d, "format_version": 99})
    elif case == "format":
        _rewrite(ck, lambda d: {**d, "format": "other"})
    elif case == "references":
        _rewrite(ck, lambda d: {**d, "references": {"../x": "y"}})
    elif case == "created":
        _rewrite(ck, lambda d: {**d, "created": 1e300})
    elif case == "twice":  # the header says no references, the whole file (its last "references") that it has
        refs = json.dumps(json.loads(text)["references"], separators=(",", ":"))
        (ck / fmt.METADATA_FILE).write_text(text.replace(f'"references":{refs}', '"references":{}', 1)[:-1]
                                            + f',"references":{refs}}}')
    elif case == "late_step":  # a header member after the others: a reader of the header alone would miss it
        _rewrite(ck, lambda d: {**{k: v for k, v in d.items() if k != "step"}, "step": d["step"]})
    else:
        (ck / fmt.METADATA_FILE).write_bytes(b'{"format": "bytecp", "format_version": 4, "save_id": ')
    error = FormatVersionError if case == "version" else CorruptCheckpointError
    if case not in ("twice", "late_step"):  # (the header alone is well-formed there: the whole file is not)
        with pytest.raises(error) as e:
            header.read_header(open_storage(str(ck)))
        assert "\n" not in str(e.value) and "step-2" in str(e.value), e.value
    with pytest.raises(error) as e:
        bytecp.load_state_dict(str(ck))
    assert "\n" not in str(e.value) and "step-2" in str(e.value), e.value


def test_references_written_last_by_an_earlier_writer_are_read_whole(run: Path) -> None:
    """A version-4 file whose references come last (as bytecp wrote them before
    they moved into the header) loads, and every header reader sees them."""
    ck = run / "step-2"
    _rewrite(ck, lambda d: {**{k: v for k, v in d.items() if k != "references"}, "references": d["references"]})
    refs = json.loads((ck / fmt.METADATA_FILE).read_bytes())["references"]
    assert list(json.loads((ck / fmt.METADATA_FILE).read_bytes()))[-1] == "references" and refs
    head, files = header.read_header(open_storage(str(ck))), header.read_files(open_storage(str(ck)))
    assert head is not None and head.references == refs and files is not None and files.header.references == refs
    assert [c.references for c in list_checkpoints(str(run))] == [(), ("step-1",)]
    assert torch.equal(bytecp.load_state_dict(str(ck))["w0"], torch.full((64,), 1.0))


def test_a_metadata_json_moved_between_two_requests_is_read_again(run: Path) -> None:
    """Retention moves metadata.json to base.json: a reader between its two requests reads base.json."""
    ck = run / "step-1"
    st = open_storage(str(ck))

    class Moving:
        url = st.url

        def size(self, path: str) -> int:
            return st.size(path)

        def read_bytes(self, path: str, offset: int = 0, nbytes: int | None = None) -> bytes:
            if path == fmt.METADATA_FILE and (ck / path).exists():
                (ck / path).rename(ck / "base.json")  # (retention writes base.json first, then deletes this)
            return st.read_bytes(path, offset, nbytes)

    files = header.read_files(Moving())  # type: ignore[arg-type]
    assert files is not None and files.header.step == 1 and (ck / "base.json").exists()


def test_a_retired_base_is_read_from_base_json(run: Path) -> None:
    mgr = bytecp.CheckpointManager(str(run), keep_last=1)
    mgr._retain()  # step-2 kept; step-1, which it references, retired
    assert not (run / "step-1" / fmt.METADATA_FILE).exists() and (run / "step-1" / "base.json").exists()
    st = open_storage(str(run / "step-1"))
    assert header.read_header(st, committed=True) is None
    head = header.read_header(st)
    files = header.read_files(st)
    assert head is not None and head.step == 1 and files is not None
    base = json.loads((run / "step-1" / "base.json").read_bytes())
    assert set(files.data_files) == set(base["retained"])
    assert list(base) == [*json_head.HEADER_KEYS, "index_files", "data_files", "retained"]  # no tensors, no index
    assert [c.name for c in list_checkpoints(str(run))] == ["step-2"]
    got = bytecp.load_state_dict(str(run / "step-2"))
    assert torch.equal(got["w0"], torch.full((64,), 1.0)) and torch.equal(got["w2999"], torch.full((64,), 2999.0))


def test_a_header_cut_anywhere_is_read_whole_or_not_at_all(run: Path) -> None:
    """``scan_header`` of any prefix of a real ``metadata.json``: the exact
    header members, or None (then the file is parsed whole)."""
    text = (run / "step-2" / fmt.METADATA_FILE).read_text()
    full = json.loads(text)
    want = {k: full[k] for k in json_head.HEADER_KEYS if k in full}
    end = text.index('"index_files"') + 20
    seen = 0
    for cut in range(end):
        got = json_head.scan_header(text[:cut])
        assert got is None or got == want, cut
        seen += got is not None
    assert seen == end - text.index('"index_files":') - len('"index_files":')  # from the first other member's name on


@pytest.mark.parametrize("bad", [{"data_files": [1, 2]}, {"data_files": {"data/x/../y.bin": 4096}},
                                 {"data_files": {"data/x/0-0.bin": -1}}, {"retained": [1]}, {"retained": "x"}])
def test_crafted_files_are_refused_in_one_line(run: Path, bad: dict[str, Any]) -> None:
    """read_files of a metadata.json (or base.json) with malformed data files: one line naming the file."""
    mgr = bytecp.CheckpointManager(str(run), keep_last=1)
    mgr._retain()  # step-1 retired (base.json)
    target = run / "step-1" / "base.json" if "retained" in bad else run / "step-2" / fmt.METADATA_FILE
    d = json.loads(target.read_bytes())
    target.write_text(json.dumps({**d, **bad}))
    with pytest.raises(CorruptCheckpointError) as e:
        header.read_files(open_storage(str(target.parent)))
    assert "\n" not in str(e.value) and target.name in str(e.value), e.value

