"""torchtitan's text dataloader (``HuggingFaceTextDataLoader`` over
``HuggingFaceTextDataset``, sequence packing, its ``{"dp_rank_<r>": pickle,
"world_size": W}`` state) across a change of the data-parallel degree, with
the real torchtitan 0.3.0 classes, ranks simulated in one process
(:mod:`tests.data.titan_sim`).

The check: every document of the epoch is trained on exactly once over the
save and the resume, its tokens included -- the tail of a document a saved
rank's buffer held moves to a new rank (and is seen there first). Map-style
data (``c4_test``) and streaming JSON-lines shards.
"""

from __future__ import annotations

import collections
import copy
import logging
from pathlib import Path

import pytest
from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataset

from bytecp.errors import DataReshardError

from .titan_sim import Setup, assets, documents, restore, resume, save_after

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory):
    logging.getLogger("torchtitan").setLevel(logging.ERROR)
    logging.getLogger("datasets").setLevel(logging.ERROR)
    return assets(tmp_path_factory.mktemp("titan"))


@pytest.fixture
def buffers_copied(monkeypatch: pytest.MonkeyPatch) -> None:
    """torchtitan 0.3.0's ``HuggingFaceTextDataset.state_dict`` returns its live
    buffer lists; with workers torchdata pickles the state in a queue thread
    while the worker extends them, so a saved buffer can hold later tokens
    (torchtitan's own resume at the same degree then repeats tokens). The
    worker tests copy the state, as the dataset should."""
    orig = HuggingFaceTextDataset.state_dict
    monkeypatch.setattr(HuggingFaceTextDataset, "state_dict", lambda self: copy.deepcopy(orig(self)))


def check_documents(data, saved, runs, finals, old_dp: int, new_dp: int) -> None:
    bos = data.tokenizer.bos_id
    before = [r.stream()[0] + b for r, b in zip(saved.runs, saved.buffers, strict=True)]
    after = []
    for r, (run, fin) in enumerate(zip(runs, finals, strict=True)):
        moved = [t for d in range(r, old_dp, new_dp) for t in saved.buffers[d]]  # saved rank d's buffer -> d % W'
        toks = run.stream()[0]
        assert toks[:len(moved)] == moved
        after.append(toks[len(moved):] + fin)
    assert documents(before, bos) + documents(after, bos) == collections.Counter(data.docs)


@pytest.mark.parametrize("old_dp,new_dp", [(2, 3), (3, 2), (4, 1), (1, 4)])
@pytest.mark.parametrize("steps", [3, 9])
def test_map_style_documents_are_read_once(data, old_dp: int, new_dp: int, steps: int) -> None:
    old = Setup(data, old_dp)
    saved = save_after(old, steps)
    runs, finals = resume(saved, old.with_(dp=new_dp))
    check_documents(data, saved, runs, finals, old_dp, new_dp)


def test_map_style_resharded_twice_in_an_epoch_then_loaded_at_the_same_degree(data) -> None:
    """2 -> 3 -> 2 -> 2 within one epoch: the rows a new chunk skips are
    recorded with its position, so every later load keeps them skipped."""
    first = save_after(Setup(data, 2), 2)
    second = save_after(Setup(data, 3), 3, restore(first, Setup(data, 3)))
    assert any(x is not None for x in second.record["varying"]["skip"])  # the chunks that skip rows say which
    third = save_after(Setup(data, 2), 2, restore(second, Setup(data, 2)))
    runs, finals = resume(third, Setup(data, 2))  # the same degree: still resharded, the skipped rows kept out
    bos = data.tokenizer.bos_id
    docs = collections.Counter()
    for s in (first, second, third):
        docs += documents([r.stream()[0] for r in s.runs], bos)
    # tokens of every stage, buffers moving between them: count tokens, and whole documents of the last stage
    tokens = collections.Counter(t for s in (first, second, third) for r in s.runs for t in r.stream()[0])
    tokens += collections.Counter(t for r, f in zip(runs, finals, strict=True) for t in r.stream()[0] + f)
    assert tokens == collections.Counter(t for d in data.docs for t in d)


@pytest.mark.parametrize("old_dp,new_dp", [(2, 3), (1, 4), (2, 2)])
def test_streaming_shards_and_their_buffers(data, old_dp: int, new_dp: int) -> None:
    old = Setup(data, old_dp, streaming=True)
    saved = save_after(old, 3)
    runs, finals = resume(saved, old.with_(dp=new_dp))
    check_documents(data, saved, runs, finals, old_dp, new_dp)


@pytest.mark.spawn  # loader worker processes
@pytest.mark.usefixtures("buffers_copied")
@pytest.mark.parametrize("old_dp,new_dp", [(2, 3), (1, 4)])
def test_streaming_with_workers(data, old_dp: int, new_dp: int) -> None:
    """Two workers per rank: each worker's cursor and buffer (the buffers join the new rank's first worker)."""
    old = Setup(data, old_dp, streaming=True, workers=2)
    saved = save_after(old, 3)
    runs, finals = resume(saved, old.with_(dp=new_dp))
    before = collections.Counter(t for r, b in zip(saved.runs, saved.buffers, strict=True) for t in r.stream()[0] + b)
    after = collections.Counter(t for r, f in zip(runs, finals, strict=True) for t in r.stream()[0] + f)
    moved = collections.Counter(t for b in saved.buffers for t in b)
    assert before + after - moved == collections.Counter(t for d in data.docs for t in d)


def test_what_cannot_continue_is_refused_with_a_count(data) -> None:
    """Shrinking the world merges partly read streaming shards; 6 shards on 4
    ranks are read one document in 4 by each rank, and packing makes the
    ranks read different numbers of documents: both refused, counted."""
    saved = save_after(Setup(data, 3, streaming=True), 3)
    with pytest.raises(DataReshardError, match=r"document\(s\) would be read twice; load with "
                                               r"data_reshard='approximate'"):
        resume(saved, Setup(data, 2, streaming=True))
    saved = save_after(Setup(data, 4, streaming=True), 3)
    with pytest.raises(DataReshardError, match=r"read different numbers of examples from stream 0"):
        resume(saved, Setup(data, 1, streaming=True))


def test_the_pickles_are_read_without_running_code(data, tmp_path: Path) -> None:
    import pickle

    from bytecp.adapters.torchtitan.data import loader_state

    from bytecp.errors import CorruptCheckpointError

    class Evil:
        def __reduce__(self):  # type: ignore[no-untyped-def]
            return (print, ("ran",))

    with pytest.raises(CorruptCheckpointError, match=r"builtins.print, which bytecp never loads"):
        loader_state({"dp_rank_0": pickle.dumps({"x": Evil()}), "world_size": 1}, "dataloader of saved rank 0")


def test_map_style_in_a_later_epoch(data) -> None:
    """One rank read the whole data once and 4 rows into its re-loop (epoch 1,
    torchtitan's ``shuffle(seed=43)`` order); 2 ranks then read exactly the
    documents of epoch 1 it had not read, each from its own chunk."""
    from bytecp.adapters.torchtitan.data import _order

    from .titan_sim import make

    one = Setup(data, 1, infinite=True)
    dl = make(one, 0)
    ds = dl.dataset
    it = iter(dl)
    while ds._epoch == 0 or ds._sample_idx < 4:
        next(it)
    shuffled = ds._original_data.shuffle(seed=43)
    assert [int(i) for i in _order(len(shuffled), 1)] == [int(i) for i in shuffled._indices.column(0).to_pylist()]
    read = {shuffled[i]["text"] for i in range(ds._sample_idx)}  # the epoch-1 documents it consumed
    saved = save_after(one, 0, [dl])
    assert saved.record["common"]["epoch"] == 1
    loaders = restore(saved, Setup(data, 2, infinite=True))
    left = [{row["text"] for row in d.dataset._data} for d in loaders]
    every = {t for t in ds._original_data["text"]}
    assert left[0] | left[1] == every - read and not left[0] & left[1]
    assert all(d.dataset._epoch == 1 and d.dataset._sample_idx == 0 for d in loaders)
