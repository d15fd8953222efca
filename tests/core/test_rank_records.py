"""metadata.json's per-rank records as a load's coordinator parses them and
every rank receives them (:mod:`bytecp.format.rank_records`): the same
records through the ``Mapping`` interface before and after a pickle round
trip (the broadcast), decoded one by one on demand; ranks missing from a
partial table are missing after it too."""

from __future__ import annotations

import pickle

import pytest

from bytecp.format.metadata import ObjectRecord
from bytecp.format.rank_records import RankRecords


def records(ranks: list[int]) -> dict[int, ObjectRecord]:
    out = {r: ObjectRecord(json={"samples": 30, "seed": r, "big": 2**80 + r}) for r in ranks}
    out[ranks[-1]] = ObjectRecord(file="data/s/1-0.bin", byte_offset=4096, nbytes=77, crc32c=5, pickle=False)
    return out


@pytest.mark.parametrize("ranks", [list(range(6)), [0, 2, 5], [3, 1, 2]])
def test_the_records_survive_the_broadcast_and_decode_on_demand(ranks: list[int]) -> None:
    want = records(ranks)
    table = RankRecords(want, ObjectRecord.from_json)
    assert dict(table) == want and list(table) == ranks and len(table) == len(ranks)
    got = pickle.loads(pickle.dumps(table))
    assert isinstance(got, RankRecords) and list(got) == ranks and got._decoded == {}
    assert got[ranks[1]] == want[ranks[1]] and list(got._decoded) == [ranks[1]]  # only what was asked
    assert dict(got) == want and got == table
    assert 9 not in got and ranks[0] in got
    with pytest.raises(KeyError):
        got[9]
    again = pickle.loads(pickle.dumps(got))  # a received table passes its texts on as they are
    assert dict(again) == want
    fresh = pickle.loads(pickle.dumps(pickle.loads(pickle.dumps(table))))  # passed on before any look-up
    assert dict(fresh) == want


def test_the_broadcast_is_smaller_than_the_records() -> None:
    """Loader states alike but for their seeds: the compressed texts are a fraction of the pickled records."""
    big = {r: ObjectRecord(json={"_snapshot": {"_main_snapshot": {"_sampler_iter_yielded": 5, "_base_seed": r}},
                                 "_steps_since_snapshot": 0}) for r in range(2048)}
    compact = pickle.dumps(RankRecords(big, ObjectRecord.from_json))
    assert len(compact) < len(pickle.dumps(big)) / 2
    assert pickle.loads(compact)[2047] == big[2047]
