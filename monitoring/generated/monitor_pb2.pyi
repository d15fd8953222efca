from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Span(_message.Message):
    __slots__ = ("phase", "start", "duration", "nbytes", "files")
    PHASE_FIELD_NUMBER: _ClassVar[int]
    START_FIELD_NUMBER: _ClassVar[int]
    DURATION_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    FILES_FIELD_NUMBER: _ClassVar[int]
    phase: str
    start: float
    duration: float
    nbytes: int
    files: int
    def __init__(self, phase: _Optional[str] = ..., start: _Optional[float] = ..., duration: _Optional[float] = ..., nbytes: _Optional[int] = ..., files: _Optional[int] = ...) -> None: ...

class RankReport(_message.Message):
    __slots__ = ("operation", "url", "checkpoint_id", "rank", "world_size", "job", "step", "started", "ended", "stall_seconds", "spans", "ok", "error", "nbytes", "retries", "host", "pid")
    OPERATION_FIELD_NUMBER: _ClassVar[int]
    URL_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    STARTED_FIELD_NUMBER: _ClassVar[int]
    ENDED_FIELD_NUMBER: _ClassVar[int]
    STALL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    SPANS_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    RETRIES_FIELD_NUMBER: _ClassVar[int]
    HOST_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    operation: str
    url: str
    checkpoint_id: str
    rank: int
    world_size: int
    job: str
    step: int
    started: float
    ended: float
    stall_seconds: float
    spans: _containers.RepeatedCompositeFieldContainer[Span]
    ok: bool
    error: str
    nbytes: int
    retries: int
    host: str
    pid: int
    def __init__(self, operation: _Optional[str] = ..., url: _Optional[str] = ..., checkpoint_id: _Optional[str] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., job: _Optional[str] = ..., step: _Optional[int] = ..., started: _Optional[float] = ..., ended: _Optional[float] = ..., stall_seconds: _Optional[float] = ..., spans: _Optional[_Iterable[_Union[Span, _Mapping]]] = ..., ok: _Optional[bool] = ..., error: _Optional[str] = ..., nbytes: _Optional[int] = ..., retries: _Optional[int] = ..., host: _Optional[str] = ..., pid: _Optional[int] = ...) -> None: ...

class ReportAck(_message.Message):
    __slots__ = ("accepted",)
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    def __init__(self, accepted: _Optional[bool] = ...) -> None: ...

class Straggler(_message.Message):
    __slots__ = ("rank", "phase", "seconds", "median_seconds", "lag_seconds")
    RANK_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    MEDIAN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    LAG_SECONDS_FIELD_NUMBER: _ClassVar[int]
    rank: int
    phase: str
    seconds: float
    median_seconds: float
    lag_seconds: float
    def __init__(self, rank: _Optional[int] = ..., phase: _Optional[str] = ..., seconds: _Optional[float] = ..., median_seconds: _Optional[float] = ..., lag_seconds: _Optional[float] = ...) -> None: ...

class CheckpointSummary(_message.Message):
    __slots__ = ("job", "operation", "checkpoint_id", "url", "step", "world_size", "ranks_reported", "complete", "ok", "started", "ended", "max_stall_seconds", "nbytes", "retries", "straggler", "reports")
    JOB_FIELD_NUMBER: _ClassVar[int]
    OPERATION_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_ID_FIELD_NUMBER: _ClassVar[int]
    URL_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    RANKS_REPORTED_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    STARTED_FIELD_NUMBER: _ClassVar[int]
    ENDED_FIELD_NUMBER: _ClassVar[int]
    MAX_STALL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    NBYTES_FIELD_NUMBER: _ClassVar[int]
    RETRIES_FIELD_NUMBER: _ClassVar[int]
    STRAGGLER_FIELD_NUMBER: _ClassVar[int]
    REPORTS_FIELD_NUMBER: _ClassVar[int]
    job: str
    operation: str
    checkpoint_id: str
    url: str
    step: int
    world_size: int
    ranks_reported: int
    complete: bool
    ok: bool
    started: float
    ended: float
    max_stall_seconds: float
    nbytes: int
    retries: int
    straggler: Straggler
    reports: _containers.RepeatedCompositeFieldContainer[RankReport]
    def __init__(self, job: _Optional[str] = ..., operation: _Optional[str] = ..., checkpoint_id: _Optional[str] = ..., url: _Optional[str] = ..., step: _Optional[int] = ..., world_size: _Optional[int] = ..., ranks_reported: _Optional[int] = ..., complete: _Optional[bool] = ..., ok: _Optional[bool] = ..., started: _Optional[float] = ..., ended: _Optional[float] = ..., max_stall_seconds: _Optional[float] = ..., nbytes: _Optional[int] = ..., retries: _Optional[int] = ..., straggler: _Optional[_Union[Straggler, _Mapping]] = ..., reports: _Optional[_Iterable[_Union[RankReport, _Mapping]]] = ...) -> None: ...

class ListCheckpointsRequest(_message.Message):
    __slots__ = ("job", "operation", "limit")
    JOB_FIELD_NUMBER: _ClassVar[int]
    OPERATION_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    job: str
    operation: str
    limit: int
    def __init__(self, job: _Optional[str] = ..., operation: _Optional[str] = ..., limit: _Optional[int] = ...) -> None: ...

class ListCheckpointsResponse(_message.Message):
    __slots__ = ("checkpoints",)
    CHECKPOINTS_FIELD_NUMBER: _ClassVar[int]
    checkpoints: _containers.RepeatedCompositeFieldContainer[CheckpointSummary]
    def __init__(self, checkpoints: _Optional[_Iterable[_Union[CheckpointSummary, _Mapping]]] = ...) -> None: ...

class GetCheckpointRequest(_message.Message):
    __slots__ = ("checkpoint", "job", "operation")
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    JOB_FIELD_NUMBER: _ClassVar[int]
    OPERATION_FIELD_NUMBER: _ClassVar[int]
    checkpoint: str
    job: str
    operation: str
    def __init__(self, checkpoint: _Optional[str] = ..., job: _Optional[str] = ..., operation: _Optional[str] = ...) -> None: ...
