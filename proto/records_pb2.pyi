from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class HealthState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    HEALTH_UNKNOWN: _ClassVar[HealthState]
    HEALTH_OK: _ClassVar[HealthState]
    HEALTH_TRANSIENT: _ClassVar[HealthState]
    HEALTH_FATAL: _ClassVar[HealthState]

class HoldKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    HOLD_NONE: _ClassVar[HoldKind]
    HOLD_CORDON: _ClassVar[HoldKind]
    HOLD_DRAIN: _ClassVar[HoldKind]
HEALTH_UNKNOWN: HealthState
HEALTH_OK: HealthState
HEALTH_TRANSIENT: HealthState
HEALTH_FATAL: HealthState
HOLD_NONE: HoldKind
HOLD_CORDON: HoldKind
HOLD_DRAIN: HoldKind

class NodeRecord(_message.Message):
    __slots__ = ("node_id", "address", "devices", "hostname", "versions", "registered_at", "cordoned", "leaving")
    class VersionsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    DEVICES_FIELD_NUMBER: _ClassVar[int]
    HOSTNAME_FIELD_NUMBER: _ClassVar[int]
    VERSIONS_FIELD_NUMBER: _ClassVar[int]
    REGISTERED_AT_FIELD_NUMBER: _ClassVar[int]
    CORDONED_FIELD_NUMBER: _ClassVar[int]
    LEAVING_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    address: str
    devices: int
    hostname: str
    versions: _containers.ScalarMap[str, str]
    registered_at: float
    cordoned: bool
    leaving: bool
    def __init__(self, node_id: _Optional[str] = ..., address: _Optional[str] = ..., devices: _Optional[int] = ..., hostname: _Optional[str] = ..., versions: _Optional[_Mapping[str, str]] = ..., registered_at: _Optional[float] = ..., cordoned: _Optional[bool] = ..., leaving: _Optional[bool] = ...) -> None: ...

class Finding(_message.Message):
    __slots__ = ("source", "device", "state", "code", "detail", "round")
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    source: str
    device: int
    state: HealthState
    code: str
    detail: str
    round: int
    def __init__(self, source: _Optional[str] = ..., device: _Optional[int] = ..., state: _Optional[_Union[HealthState, str]] = ..., code: _Optional[str] = ..., detail: _Optional[str] = ..., round: _Optional[int] = ...) -> None: ...

class HealthRecord(_message.Message):
    __slots__ = ("node_id", "state", "findings", "unreachable_peers", "checked_at", "replacing", "lost_peers", "lost_peers_round")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    FINDINGS_FIELD_NUMBER: _ClassVar[int]
    UNREACHABLE_PEERS_FIELD_NUMBER: _ClassVar[int]
    CHECKED_AT_FIELD_NUMBER: _ClassVar[int]
    REPLACING_FIELD_NUMBER: _ClassVar[int]
    LOST_PEERS_FIELD_NUMBER: _ClassVar[int]
    LOST_PEERS_ROUND_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    state: HealthState
    findings: _containers.RepeatedCompositeFieldContainer[Finding]
    unreachable_peers: _containers.RepeatedScalarFieldContainer[str]
    checked_at: float
    replacing: bool
    lost_peers: _containers.RepeatedScalarFieldContainer[str]
    lost_peers_round: int
    def __init__(self, node_id: _Optional[str] = ..., state: _Optional[_Union[HealthState, str]] = ..., findings: _Optional[_Iterable[_Union[Finding, _Mapping]]] = ..., unreachable_peers: _Optional[_Iterable[str]] = ..., checked_at: _Optional[float] = ..., replacing: _Optional[bool] = ..., lost_peers: _Optional[_Iterable[str]] = ..., lost_peers_round: _Optional[int] = ...) -> None: ...

class ProgressRecord(_message.Message):
    __slots__ = ("node_id", "round", "step", "step_time", "reported_at", "busy_time", "committed_step", "has_committed_step", "straggling_ranks", "gave_up", "gave_up_reason")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    STEP_TIME_FIELD_NUMBER: _ClassVar[int]
    REPORTED_AT_FIELD_NUMBER: _ClassVar[int]
    BUSY_TIME_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_STEP_FIELD_NUMBER: _ClassVar[int]
    HAS_COMMITTED_STEP_FIELD_NUMBER: _ClassVar[int]
    STRAGGLING_RANKS_FIELD_NUMBER: _ClassVar[int]
    GAVE_UP_FIELD_NUMBER: _ClassVar[int]
    GAVE_UP_REASON_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    round: int
    step: int
    step_time: float
    reported_at: float
    busy_time: float
    committed_step: int
    has_committed_step: bool
    straggling_ranks: _containers.RepeatedScalarFieldContainer[int]
    gave_up: bool
    gave_up_reason: str
    def __init__(self, node_id: _Optional[str] = ..., round: _Optional[int] = ..., step: _Optional[int] = ..., step_time: _Optional[float] = ..., reported_at: _Optional[float] = ..., busy_time: _Optional[float] = ..., committed_step: _Optional[int] = ..., has_committed_step: _Optional[bool] = ..., straggling_ranks: _Optional[_Iterable[int]] = ..., gave_up: _Optional[bool] = ..., gave_up_reason: _Optional[str] = ...) -> None: ...

class LeaderRecord(_message.Message):
    __slots__ = ("daemon_id", "address", "elected_at")
    DAEMON_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    ELECTED_AT_FIELD_NUMBER: _ClassVar[int]
    daemon_id: str
    address: str
    elected_at: float
    def __init__(self, daemon_id: _Optional[str] = ..., address: _Optional[str] = ..., elected_at: _Optional[float] = ...) -> None: ...

class RoundMember(_message.Message):
    __slots__ = ("node_id", "node_rank", "first_rank", "local_world_size", "address")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_RANK_FIELD_NUMBER: _ClassVar[int]
    FIRST_RANK_FIELD_NUMBER: _ClassVar[int]
    LOCAL_WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    node_rank: int
    first_rank: int
    local_world_size: int
    address: str
    def __init__(self, node_id: _Optional[str] = ..., node_rank: _Optional[int] = ..., first_rank: _Optional[int] = ..., local_world_size: _Optional[int] = ..., address: _Optional[str] = ...) -> None: ...

class RoundRecord(_message.Message):
    __slots__ = ("number", "members", "world_size", "master_addr", "master_port", "has_restore_step", "restore_step", "reason", "decided_by", "decided_at", "closed")
    NUMBER_FIELD_NUMBER: _ClassVar[int]
    MEMBERS_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    MASTER_ADDR_FIELD_NUMBER: _ClassVar[int]
    MASTER_PORT_FIELD_NUMBER: _ClassVar[int]
    HAS_RESTORE_STEP_FIELD_NUMBER: _ClassVar[int]
    RESTORE_STEP_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    DECIDED_BY_FIELD_NUMBER: _ClassVar[int]
    DECIDED_AT_FIELD_NUMBER: _ClassVar[int]
    CLOSED_FIELD_NUMBER: _ClassVar[int]
    number: int
    members: _containers.RepeatedCompositeFieldContainer[RoundMember]
    world_size: int
    master_addr: str
    master_port: int
    has_restore_step: bool
    restore_step: int
    reason: str
    decided_by: str
    decided_at: float
    closed: bool
    def __init__(self, number: _Optional[int] = ..., members: _Optional[_Iterable[_Union[RoundMember, _Mapping]]] = ..., world_size: _Optional[int] = ..., master_addr: _Optional[str] = ..., master_port: _Optional[int] = ..., has_restore_step: _Optional[bool] = ..., restore_step: _Optional[int] = ..., reason: _Optional[str] = ..., decided_by: _Optional[str] = ..., decided_at: _Optional[float] = ..., closed: _Optional[bool] = ...) -> None: ...

class CheckpointRecord(_message.Message):
    __slots__ = ("step", "path", "manifest_digest", "world_size", "round", "committed_at")
    STEP_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    MANIFEST_DIGEST_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_AT_FIELD_NUMBER: _ClassVar[int]
    step: int
    path: str
    manifest_digest: str
    world_size: int
    round: int
    committed_at: float
    def __init__(self, step: _Optional[int] = ..., path: _Optional[str] = ..., manifest_digest: _Optional[str] = ..., world_size: _Optional[int] = ..., round: _Optional[int] = ..., committed_at: _Optional[float] = ...) -> None: ...

class CordonRecord(_message.Message):
    __slots__ = ("node_id", "kind", "reason", "by", "at")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    BY_FIELD_NUMBER: _ClassVar[int]
    AT_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    kind: HoldKind
    reason: str
    by: str
    at: float
    def __init__(self, node_id: _Optional[str] = ..., kind: _Optional[_Union[HoldKind, str]] = ..., reason: _Optional[str] = ..., by: _Optional[str] = ..., at: _Optional[float] = ...) -> None: ...

class FaultRecord(_message.Message):
    __slots__ = ("node_id", "fault_times", "quarantined", "reason", "written_by")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    FAULT_TIMES_FIELD_NUMBER: _ClassVar[int]
    QUARANTINED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    WRITTEN_BY_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    fault_times: _containers.RepeatedScalarFieldContainer[float]
    quarantined: bool
    reason: str
    written_by: str
    def __init__(self, node_id: _Optional[str] = ..., fault_times: _Optional[_Iterable[float]] = ..., quarantined: _Optional[bool] = ..., reason: _Optional[str] = ..., written_by: _Optional[str] = ...) -> None: ...

class DaemonStatus(_message.Message):
    __slots__ = ("reason", "round", "daemon_id", "at", "stragglers", "goodput")
    REASON_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    DAEMON_ID_FIELD_NUMBER: _ClassVar[int]
    AT_FIELD_NUMBER: _ClassVar[int]
    STRAGGLERS_FIELD_NUMBER: _ClassVar[int]
    GOODPUT_FIELD_NUMBER: _ClassVar[int]
    reason: str
    round: int
    daemon_id: str
    at: float
    stragglers: _containers.RepeatedCompositeFieldContainer[Straggler]
    goodput: JobGoodput
    def __init__(self, reason: _Optional[str] = ..., round: _Optional[int] = ..., daemon_id: _Optional[str] = ..., at: _Optional[float] = ..., stragglers: _Optional[_Iterable[_Union[Straggler, _Mapping]]] = ..., goodput: _Optional[_Union[JobGoodput, _Mapping]] = ...) -> None: ...

class JobGoodput(_message.Message):
    __slots__ = ("productive_seconds", "elapsed_seconds", "step", "step_time", "faults")
    PRODUCTIVE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    ELAPSED_SECONDS_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    STEP_TIME_FIELD_NUMBER: _ClassVar[int]
    FAULTS_FIELD_NUMBER: _ClassVar[int]
    productive_seconds: float
    elapsed_seconds: float
    step: int
    step_time: float
    faults: _containers.RepeatedCompositeFieldContainer[FaultCostRecord]
    def __init__(self, productive_seconds: _Optional[float] = ..., elapsed_seconds: _Optional[float] = ..., step: _Optional[int] = ..., step_time: _Optional[float] = ..., faults: _Optional[_Iterable[_Union[FaultCostRecord, _Mapping]]] = ...) -> None: ...

class FaultCostRecord(_message.Message):
    __slots__ = ("node_id", "kind", "at", "step", "cost", "known")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    AT_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    COST_FIELD_NUMBER: _ClassVar[int]
    KNOWN_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    kind: str
    at: float
    step: int
    cost: float
    known: bool
    def __init__(self, node_id: _Optional[str] = ..., kind: _Optional[str] = ..., at: _Optional[float] = ..., step: _Optional[int] = ..., cost: _Optional[float] = ..., known: _Optional[bool] = ...) -> None: ...

class Straggler(_message.Message):
    __slots__ = ("node_id", "busy_time", "others_median", "consecutive", "excluded", "since_step")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    BUSY_TIME_FIELD_NUMBER: _ClassVar[int]
    OTHERS_MEDIAN_FIELD_NUMBER: _ClassVar[int]
    CONSECUTIVE_FIELD_NUMBER: _ClassVar[int]
    EXCLUDED_FIELD_NUMBER: _ClassVar[int]
    SINCE_STEP_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    busy_time: float
    others_median: float
    consecutive: int
    excluded: bool
    since_step: int
    def __init__(self, node_id: _Optional[str] = ..., busy_time: _Optional[float] = ..., others_median: _Optional[float] = ..., consecutive: _Optional[int] = ..., excluded: _Optional[bool] = ..., since_step: _Optional[int] = ...) -> None: ...
