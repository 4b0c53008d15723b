from stalwart.proto import records_pb2 as _records_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class WorkerState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    WORKER_UNKNOWN: _ClassVar[WorkerState]
    WORKER_STARTING: _ClassVar[WorkerState]
    WORKER_RUNNING: _ClassVar[WorkerState]
    WORKER_STOPPING: _ClassVar[WorkerState]
    WORKER_SUCCEEDED: _ClassVar[WorkerState]
    WORKER_FAILED: _ClassVar[WorkerState]
    WORKER_REFORMING: _ClassVar[WorkerState]

class FaultKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FAULT_UNSPECIFIED: _ClassVar[FaultKind]
    FAULT_GPU_XID: _ClassVar[FaultKind]
    FAULT_GPU_ECC_DBE: _ClassVar[FaultKind]
    FAULT_GPU_LOST: _ClassVar[FaultKind]
    FAULT_KILL_WORKER: _ClassVar[FaultKind]
    FAULT_HANG_WORKER: _ClassVar[FaultKind]
    FAULT_CLEAR: _ClassVar[FaultKind]
    FAULT_DROP_PEERS: _ClassVar[FaultKind]
    FAULT_NAN_LOSS: _ClassVar[FaultKind]
    FAULT_LOSS_SPIKE: _ClassVar[FaultKind]
    FAULT_SLOW_WORKER: _ClassVar[FaultKind]
    FAULT_GPU_HANG: _ClassVar[FaultKind]
WORKER_UNKNOWN: WorkerState
WORKER_STARTING: WorkerState
WORKER_RUNNING: WorkerState
WORKER_STOPPING: WorkerState
WORKER_SUCCEEDED: WorkerState
WORKER_FAILED: WorkerState
WORKER_REFORMING: WorkerState
FAULT_UNSPECIFIED: FaultKind
FAULT_GPU_XID: FaultKind
FAULT_GPU_ECC_DBE: FaultKind
FAULT_GPU_LOST: FaultKind
FAULT_KILL_WORKER: FaultKind
FAULT_HANG_WORKER: FaultKind
FAULT_CLEAR: FaultKind
FAULT_DROP_PEERS: FaultKind
FAULT_NAN_LOSS: FaultKind
FAULT_LOSS_SPIKE: FaultKind
FAULT_SLOW_WORKER: FaultKind
FAULT_GPU_HANG: FaultKind

class StatusRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerStatus(_message.Message):
    __slots__ = ("local_rank", "rank", "pid", "state", "last_step", "exit_code", "exit_reason", "busy_time", "straggler", "slowdown", "round", "reformed")
    LOCAL_RANK_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    LAST_STEP_FIELD_NUMBER: _ClassVar[int]
    EXIT_CODE_FIELD_NUMBER: _ClassVar[int]
    EXIT_REASON_FIELD_NUMBER: _ClassVar[int]
    BUSY_TIME_FIELD_NUMBER: _ClassVar[int]
    STRAGGLER_FIELD_NUMBER: _ClassVar[int]
    SLOWDOWN_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    REFORMED_FIELD_NUMBER: _ClassVar[int]
    local_rank: int
    rank: int
    pid: int
    state: WorkerState
    last_step: int
    exit_code: int
    exit_reason: str
    busy_time: float
    straggler: bool
    slowdown: float
    round: int
    reformed: bool
    def __init__(self, local_rank: _Optional[int] = ..., rank: _Optional[int] = ..., pid: _Optional[int] = ..., state: _Optional[_Union[WorkerState, str]] = ..., last_step: _Optional[int] = ..., exit_code: _Optional[int] = ..., exit_reason: _Optional[str] = ..., busy_time: _Optional[float] = ..., straggler: _Optional[bool] = ..., slowdown: _Optional[float] = ..., round: _Optional[int] = ..., reformed: _Optional[bool] = ...) -> None: ...

class SpareStatus(_message.Message):
    __slots__ = ("pid", "ready", "age")
    PID_FIELD_NUMBER: _ClassVar[int]
    READY_FIELD_NUMBER: _ClassVar[int]
    AGE_FIELD_NUMBER: _ClassVar[int]
    pid: int
    ready: bool
    age: float
    def __init__(self, pid: _Optional[int] = ..., ready: _Optional[bool] = ..., age: _Optional[float] = ...) -> None: ...

class NodeStatus(_message.Message):
    __slots__ = ("node", "health", "round", "workers", "draining", "spares", "spares_disabled")
    NODE_FIELD_NUMBER: _ClassVar[int]
    HEALTH_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    WORKERS_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    SPARES_FIELD_NUMBER: _ClassVar[int]
    SPARES_DISABLED_FIELD_NUMBER: _ClassVar[int]
    node: _records_pb2.NodeRecord
    health: _records_pb2.HealthRecord
    round: int
    workers: _containers.RepeatedCompositeFieldContainer[WorkerStatus]
    draining: bool
    spares: _containers.RepeatedCompositeFieldContainer[SpareStatus]
    spares_disabled: str
    def __init__(self, node: _Optional[_Union[_records_pb2.NodeRecord, _Mapping]] = ..., health: _Optional[_Union[_records_pb2.HealthRecord, _Mapping]] = ..., round: _Optional[int] = ..., workers: _Optional[_Iterable[_Union[WorkerStatus, _Mapping]]] = ..., draining: _Optional[bool] = ..., spares: _Optional[_Iterable[_Union[SpareStatus, _Mapping]]] = ..., spares_disabled: _Optional[str] = ...) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("wait", "timeout")
    WAIT_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_FIELD_NUMBER: _ClassVar[int]
    wait: bool
    timeout: float
    def __init__(self, wait: _Optional[bool] = ..., timeout: _Optional[float] = ...) -> None: ...

class DrainReply(_message.Message):
    __slots__ = ("drained", "detail")
    DRAINED_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    drained: bool
    detail: str
    def __init__(self, drained: _Optional[bool] = ..., detail: _Optional[str] = ...) -> None: ...

class FaultRequest(_message.Message):
    __slots__ = ("kind", "device", "code", "step", "factor")
    KIND_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    FACTOR_FIELD_NUMBER: _ClassVar[int]
    kind: FaultKind
    device: int
    code: int
    step: int
    factor: float
    def __init__(self, kind: _Optional[_Union[FaultKind, str]] = ..., device: _Optional[int] = ..., code: _Optional[int] = ..., step: _Optional[int] = ..., factor: _Optional[float] = ...) -> None: ...

class FaultReply(_message.Message):
    __slots__ = ("applied", "detail")
    APPLIED_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    applied: bool
    detail: str
    def __init__(self, applied: _Optional[bool] = ..., detail: _Optional[str] = ...) -> None: ...

class PingRequest(_message.Message):
    __slots__ = ("from_node",)
    FROM_NODE_FIELD_NUMBER: _ClassVar[int]
    from_node: str
    def __init__(self, from_node: _Optional[str] = ...) -> None: ...

class PingReply(_message.Message):
    __slots__ = ("node_id", "round")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    round: int
    def __init__(self, node_id: _Optional[str] = ..., round: _Optional[int] = ...) -> None: ...

class WorkerMessage(_message.Message):
    __slots__ = ("hello", "step", "checkpoint", "goodbye", "peer_lost", "joining")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    GOODBYE_FIELD_NUMBER: _ClassVar[int]
    PEER_LOST_FIELD_NUMBER: _ClassVar[int]
    JOINING_FIELD_NUMBER: _ClassVar[int]
    hello: Hello
    step: StepReport
    checkpoint: CheckpointReport
    goodbye: Goodbye
    peer_lost: PeerLost
    joining: Joining
    def __init__(self, hello: _Optional[_Union[Hello, _Mapping]] = ..., step: _Optional[_Union[StepReport, _Mapping]] = ..., checkpoint: _Optional[_Union[CheckpointReport, _Mapping]] = ..., goodbye: _Optional[_Union[Goodbye, _Mapping]] = ..., peer_lost: _Optional[_Union[PeerLost, _Mapping]] = ..., joining: _Optional[_Union[Joining, _Mapping]] = ...) -> None: ...

class Hello(_message.Message):
    __slots__ = ("rank", "local_rank", "round", "pid", "spare", "can_reform", "warm")
    RANK_FIELD_NUMBER: _ClassVar[int]
    LOCAL_RANK_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    SPARE_FIELD_NUMBER: _ClassVar[int]
    CAN_REFORM_FIELD_NUMBER: _ClassVar[int]
    WARM_FIELD_NUMBER: _ClassVar[int]
    rank: int
    local_rank: int
    round: int
    pid: int
    spare: bool
    can_reform: bool
    warm: bool
    def __init__(self, rank: _Optional[int] = ..., local_rank: _Optional[int] = ..., round: _Optional[int] = ..., pid: _Optional[int] = ..., spare: _Optional[bool] = ..., can_reform: _Optional[bool] = ..., warm: _Optional[bool] = ...) -> None: ...

class StepReport(_message.Message):
    __slots__ = ("step", "step_time", "loss", "time", "busy_time")
    STEP_FIELD_NUMBER: _ClassVar[int]
    STEP_TIME_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    BUSY_TIME_FIELD_NUMBER: _ClassVar[int]
    step: int
    step_time: float
    loss: float
    time: float
    busy_time: float
    def __init__(self, step: _Optional[int] = ..., step_time: _Optional[float] = ..., loss: _Optional[float] = ..., time: _Optional[float] = ..., busy_time: _Optional[float] = ...) -> None: ...

class CheckpointReport(_message.Message):
    __slots__ = ("step", "path", "committed", "stall_seconds")
    STEP_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    COMMITTED_FIELD_NUMBER: _ClassVar[int]
    STALL_SECONDS_FIELD_NUMBER: _ClassVar[int]
    step: int
    path: str
    committed: bool
    stall_seconds: float
    def __init__(self, step: _Optional[int] = ..., path: _Optional[str] = ..., committed: _Optional[bool] = ..., stall_seconds: _Optional[float] = ...) -> None: ...

class Goodbye(_message.Message):
    __slots__ = ("reason",)
    REASON_FIELD_NUMBER: _ClassVar[int]
    reason: str
    def __init__(self, reason: _Optional[str] = ...) -> None: ...

class Joining(_message.Message):
    __slots__ = ("round", "arrived", "world_size")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    ARRIVED_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    round: int
    arrived: int
    world_size: int
    def __init__(self, round: _Optional[int] = ..., arrived: _Optional[int] = ..., world_size: _Optional[int] = ...) -> None: ...

class PeerLost(_message.Message):
    __slots__ = ("round", "hosts", "detail")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    HOSTS_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    round: int
    hosts: _containers.RepeatedScalarFieldContainer[str]
    detail: str
    def __init__(self, round: _Optional[int] = ..., hosts: _Optional[_Iterable[str]] = ..., detail: _Optional[str] = ...) -> None: ...

class AgentCommand(_message.Message):
    __slots__ = ("reform", "stop", "inject_fault")
    REFORM_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    INJECT_FAULT_FIELD_NUMBER: _ClassVar[int]
    reform: Reform
    stop: Stop
    inject_fault: InjectTrainingFault
    def __init__(self, reform: _Optional[_Union[Reform, _Mapping]] = ..., stop: _Optional[_Union[Stop, _Mapping]] = ..., inject_fault: _Optional[_Union[InjectTrainingFault, _Mapping]] = ...) -> None: ...

class InjectTrainingFault(_message.Message):
    __slots__ = ("kind", "step", "factor")
    KIND_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    FACTOR_FIELD_NUMBER: _ClassVar[int]
    kind: str
    step: int
    factor: float
    def __init__(self, kind: _Optional[str] = ..., step: _Optional[int] = ..., factor: _Optional[float] = ...) -> None: ...

class Reform(_message.Message):
    __slots__ = ("round", "rank", "world_size", "local_rank")
    ROUND_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    LOCAL_RANK_FIELD_NUMBER: _ClassVar[int]
    round: _records_pb2.RoundRecord
    rank: int
    world_size: int
    local_rank: int
    def __init__(self, round: _Optional[_Union[_records_pb2.RoundRecord, _Mapping]] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., local_rank: _Optional[int] = ...) -> None: ...

class Stop(_message.Message):
    __slots__ = ("reason", "grace")
    REASON_FIELD_NUMBER: _ClassVar[int]
    GRACE_FIELD_NUMBER: _ClassVar[int]
    reason: str
    grace: float
    def __init__(self, reason: _Optional[str] = ..., grace: _Optional[float] = ...) -> None: ...
