from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DTYPE_UNSPECIFIED: _ClassVar[DType]
    FLOAT32: _ClassVar[DType]
    FLOAT16: _ClassVar[DType]
    BFLOAT16: _ClassVar[DType]

class Wire(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    LOSSLESS: _ClassVar[Wire]
    INT8: _ClassVar[Wire]
    FP8: _ClassVar[Wire]

class Path(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PATH_UNSPECIFIED: _ClassVar[Path]
    ONESHOT: _ClassVar[Path]
    TWOSHOT: _ClassVar[Path]
    DMA: _ClassVar[Path]
    NCCL: _ClassVar[Path]
    SERVICE: _ClassVar[Path]

class MemoryKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MEMORY_KIND_UNSPECIFIED: _ClassVar[MemoryKind]
    HOST_MEMFD: _ClassVar[MemoryKind]
    CUDA_VMM_FD: _ClassVar[MemoryKind]
    CUDA_IPC_LEGACY: _ClassVar[MemoryKind]

class CapturedAbort(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    CAPTURED_ABORT_UNSPECIFIED: _ClassVar[CapturedAbort]
    CAPTURED_ABORT_EXIT: _ClassVar[CapturedAbort]
    CAPTURED_ABORT_LOG: _ClassVar[CapturedAbort]

class ServiceOrdering(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SERVICE_ORDERING_UNSPECIFIED: _ClassVar[ServiceOrdering]
    STREAM_WORDS: _ClassVar[ServiceOrdering]
    IPC_EVENTS: _ClassVar[ServiceOrdering]

class BoundarySource(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    BOUNDARY_SOURCE_UNSPECIFIED: _ClassVar[BoundarySource]
    DEFAULT: _ClassVar[BoundarySource]
    CALIBRATED: _ClassVar[BoundarySource]
    OVERRIDE: _ClassVar[BoundarySource]

class GroupEventKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    GROUP_EVENT_UNSPECIFIED: _ClassVar[GroupEventKind]
    READY: _ClassVar[GroupEventKind]
    PEER_LOST: _ClassVar[GroupEventKind]
    DRAINING: _ClassVar[GroupEventKind]

class Op(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    OP_UNSPECIFIED: _ClassVar[Op]
    ALL_REDUCE: _ClassVar[Op]
    ALL_GATHER: _ClassVar[Op]
    TOPK_STAGE: _ClassVar[Op]
DTYPE_UNSPECIFIED: DType
FLOAT32: DType
FLOAT16: DType
BFLOAT16: DType
LOSSLESS: Wire
INT8: Wire
FP8: Wire
PATH_UNSPECIFIED: Path
ONESHOT: Path
TWOSHOT: Path
DMA: Path
NCCL: Path
SERVICE: Path
MEMORY_KIND_UNSPECIFIED: MemoryKind
HOST_MEMFD: MemoryKind
CUDA_VMM_FD: MemoryKind
CUDA_IPC_LEGACY: MemoryKind
CAPTURED_ABORT_UNSPECIFIED: CapturedAbort
CAPTURED_ABORT_EXIT: CapturedAbort
CAPTURED_ABORT_LOG: CapturedAbort
SERVICE_ORDERING_UNSPECIFIED: ServiceOrdering
STREAM_WORDS: ServiceOrdering
IPC_EVENTS: ServiceOrdering
BOUNDARY_SOURCE_UNSPECIFIED: BoundarySource
DEFAULT: BoundarySource
CALIBRATED: BoundarySource
OVERRIDE: BoundarySource
GROUP_EVENT_UNSPECIFIED: GroupEventKind
READY: GroupEventKind
PEER_LOST: GroupEventKind
DRAINING: GroupEventKind
OP_UNSPECIFIED: Op
ALL_REDUCE: Op
ALL_GATHER: Op
TOPK_STAGE: Op

class Geometry(_message.Message):
    __slots__ = ("capacity_bytes", "dtypes", "wire")
    CAPACITY_BYTES_FIELD_NUMBER: _ClassVar[int]
    DTYPES_FIELD_NUMBER: _ClassVar[int]
    WIRE_FIELD_NUMBER: _ClassVar[int]
    capacity_bytes: int
    dtypes: _containers.RepeatedScalarFieldContainer[DType]
    wire: Wire
    def __init__(self, capacity_bytes: _Optional[int] = ..., dtypes: _Optional[_Iterable[_Union[DType, str]]] = ..., wire: _Optional[_Union[Wire, str]] = ...) -> None: ...

class JoinRequest(_message.Message):
    __slots__ = ("group", "rank", "world_size", "device", "geometry", "pid", "join_timeout_seconds", "nccl_fallback", "overrides", "identity", "group_key")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    GEOMETRY_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    JOIN_TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    NCCL_FALLBACK_FIELD_NUMBER: _ClassVar[int]
    OVERRIDES_FIELD_NUMBER: _ClassVar[int]
    IDENTITY_FIELD_NUMBER: _ClassVar[int]
    GROUP_KEY_FIELD_NUMBER: _ClassVar[int]
    group: str
    rank: int
    world_size: int
    device: str
    geometry: Geometry
    pid: int
    join_timeout_seconds: float
    nccl_fallback: bool
    overrides: _containers.RepeatedCompositeFieldContainer[Boundary]
    identity: bytes
    group_key: bytes
    def __init__(self, group: _Optional[str] = ..., rank: _Optional[int] = ..., world_size: _Optional[int] = ..., device: _Optional[str] = ..., geometry: _Optional[_Union[Geometry, _Mapping]] = ..., pid: _Optional[int] = ..., join_timeout_seconds: _Optional[float] = ..., nccl_fallback: _Optional[bool] = ..., overrides: _Optional[_Iterable[_Union[Boundary, _Mapping]]] = ..., identity: _Optional[bytes] = ..., group_key: _Optional[bytes] = ...) -> None: ...

class Segment(_message.Message):
    __slots__ = ("owner_rank", "size_bytes", "ipc_handle")
    OWNER_RANK_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    IPC_HANDLE_FIELD_NUMBER: _ClassVar[int]
    owner_rank: int
    size_bytes: int
    ipc_handle: bytes
    def __init__(self, owner_rank: _Optional[int] = ..., size_bytes: _Optional[int] = ..., ipc_handle: _Optional[bytes] = ...) -> None: ...

class JoinReply(_message.Message):
    __slots__ = ("group_id", "claim_token", "descriptor_socket", "memory_kind", "control", "buffers", "thresholds", "timing_sample_period", "operation_timeout_seconds", "max_blocks", "table_switch_period", "explore_period", "rank_secret", "service_ordering", "captured_abort", "adoption")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    CLAIM_TOKEN_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTOR_SOCKET_FIELD_NUMBER: _ClassVar[int]
    MEMORY_KIND_FIELD_NUMBER: _ClassVar[int]
    CONTROL_FIELD_NUMBER: _ClassVar[int]
    BUFFERS_FIELD_NUMBER: _ClassVar[int]
    THRESHOLDS_FIELD_NUMBER: _ClassVar[int]
    TIMING_SAMPLE_PERIOD_FIELD_NUMBER: _ClassVar[int]
    OPERATION_TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    MAX_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    TABLE_SWITCH_PERIOD_FIELD_NUMBER: _ClassVar[int]
    EXPLORE_PERIOD_FIELD_NUMBER: _ClassVar[int]
    RANK_SECRET_FIELD_NUMBER: _ClassVar[int]
    SERVICE_ORDERING_FIELD_NUMBER: _ClassVar[int]
    CAPTURED_ABORT_FIELD_NUMBER: _ClassVar[int]
    ADOPTION_FIELD_NUMBER: _ClassVar[int]
    group_id: int
    claim_token: bytes
    descriptor_socket: str
    memory_kind: MemoryKind
    control: Segment
    buffers: _containers.RepeatedCompositeFieldContainer[Segment]
    thresholds: ThresholdTable
    timing_sample_period: int
    operation_timeout_seconds: float
    max_blocks: int
    table_switch_period: int
    explore_period: int
    rank_secret: bytes
    service_ordering: ServiceOrdering
    captured_abort: CapturedAbort
    adoption: AdoptionTicket
    def __init__(self, group_id: _Optional[int] = ..., claim_token: _Optional[bytes] = ..., descriptor_socket: _Optional[str] = ..., memory_kind: _Optional[_Union[MemoryKind, str]] = ..., control: _Optional[_Union[Segment, _Mapping]] = ..., buffers: _Optional[_Iterable[_Union[Segment, _Mapping]]] = ..., thresholds: _Optional[_Union[ThresholdTable, _Mapping]] = ..., timing_sample_period: _Optional[int] = ..., operation_timeout_seconds: _Optional[float] = ..., max_blocks: _Optional[int] = ..., table_switch_period: _Optional[int] = ..., explore_period: _Optional[int] = ..., rank_secret: _Optional[bytes] = ..., service_ordering: _Optional[_Union[ServiceOrdering, str]] = ..., captured_abort: _Optional[_Union[CapturedAbort, str]] = ..., adoption: _Optional[_Union[AdoptionTicket, _Mapping]] = ...) -> None: ...

class GroupRecord(_message.Message):
    __slots__ = ("group_id", "salt", "join", "ranks", "memory_kind", "buffer_bytes", "creator_uid", "creator_is_tcp", "max_blocks", "control_device", "control_inode")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    SALT_FIELD_NUMBER: _ClassVar[int]
    JOIN_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_KIND_FIELD_NUMBER: _ClassVar[int]
    BUFFER_BYTES_FIELD_NUMBER: _ClassVar[int]
    CREATOR_UID_FIELD_NUMBER: _ClassVar[int]
    CREATOR_IS_TCP_FIELD_NUMBER: _ClassVar[int]
    MAX_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    CONTROL_DEVICE_FIELD_NUMBER: _ClassVar[int]
    CONTROL_INODE_FIELD_NUMBER: _ClassVar[int]
    group_id: int
    salt: bytes
    join: JoinRequest
    ranks: _containers.RepeatedCompositeFieldContainer[RecordedRank]
    memory_kind: MemoryKind
    buffer_bytes: int
    creator_uid: int
    creator_is_tcp: bool
    max_blocks: int
    control_device: int
    control_inode: int
    def __init__(self, group_id: _Optional[int] = ..., salt: _Optional[bytes] = ..., join: _Optional[_Union[JoinRequest, _Mapping]] = ..., ranks: _Optional[_Iterable[_Union[RecordedRank, _Mapping]]] = ..., memory_kind: _Optional[_Union[MemoryKind, str]] = ..., buffer_bytes: _Optional[int] = ..., creator_uid: _Optional[int] = ..., creator_is_tcp: _Optional[bool] = ..., max_blocks: _Optional[int] = ..., control_device: _Optional[int] = ..., control_inode: _Optional[int] = ...) -> None: ...

class RecordedRank(_message.Message):
    __slots__ = ("pid", "uid", "device")
    PID_FIELD_NUMBER: _ClassVar[int]
    UID_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    pid: int
    uid: int
    device: str
    def __init__(self, pid: _Optional[int] = ..., uid: _Optional[int] = ..., device: _Optional[str] = ...) -> None: ...

class AdoptionTicket(_message.Message):
    __slots__ = ("record", "tag")
    RECORD_FIELD_NUMBER: _ClassVar[int]
    TAG_FIELD_NUMBER: _ClassVar[int]
    record: bytes
    tag: bytes
    def __init__(self, record: _Optional[bytes] = ..., tag: _Optional[bytes] = ...) -> None: ...

class AdoptRequest(_message.Message):
    __slots__ = ("ticket", "rank", "control_token", "thresholds", "calls_without_daemon")
    TICKET_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    CONTROL_TOKEN_FIELD_NUMBER: _ClassVar[int]
    THRESHOLDS_FIELD_NUMBER: _ClassVar[int]
    CALLS_WITHOUT_DAEMON_FIELD_NUMBER: _ClassVar[int]
    ticket: AdoptionTicket
    rank: int
    control_token: bytes
    thresholds: ThresholdTable
    calls_without_daemon: int
    def __init__(self, ticket: _Optional[_Union[AdoptionTicket, _Mapping]] = ..., rank: _Optional[int] = ..., control_token: _Optional[bytes] = ..., thresholds: _Optional[_Union[ThresholdTable, _Mapping]] = ..., calls_without_daemon: _Optional[int] = ...) -> None: ...

class AdoptReply(_message.Message):
    __slots__ = ("group_id", "adopted")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    ADOPTED_FIELD_NUMBER: _ClassVar[int]
    group_id: int
    adopted: bool
    def __init__(self, group_id: _Optional[int] = ..., adopted: _Optional[bool] = ...) -> None: ...

class Boundary(_message.Message):
    __slots__ = ("name", "value_bytes", "source")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VALUE_BYTES_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    name: str
    value_bytes: int
    source: BoundarySource
    def __init__(self, name: _Optional[str] = ..., value_bytes: _Optional[int] = ..., source: _Optional[_Union[BoundarySource, str]] = ...) -> None: ...

class PathRange(_message.Message):
    __slots__ = ("max_bytes", "unbounded", "path", "wire")
    MAX_BYTES_FIELD_NUMBER: _ClassVar[int]
    UNBOUNDED_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    WIRE_FIELD_NUMBER: _ClassVar[int]
    max_bytes: int
    unbounded: bool
    path: Path
    wire: Wire
    def __init__(self, max_bytes: _Optional[int] = ..., unbounded: _Optional[bool] = ..., path: _Optional[_Union[Path, str]] = ..., wire: _Optional[_Union[Wire, str]] = ...) -> None: ...

class ThresholdTable(_message.Message):
    __slots__ = ("epoch", "ranges", "boundaries", "wire", "origin", "settled")
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    RANGES_FIELD_NUMBER: _ClassVar[int]
    BOUNDARIES_FIELD_NUMBER: _ClassVar[int]
    WIRE_FIELD_NUMBER: _ClassVar[int]
    ORIGIN_FIELD_NUMBER: _ClassVar[int]
    SETTLED_FIELD_NUMBER: _ClassVar[int]
    epoch: int
    ranges: _containers.RepeatedCompositeFieldContainer[PathRange]
    boundaries: _containers.RepeatedCompositeFieldContainer[Boundary]
    wire: Wire
    origin: str
    settled: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, epoch: _Optional[int] = ..., ranges: _Optional[_Iterable[_Union[PathRange, _Mapping]]] = ..., boundaries: _Optional[_Iterable[_Union[Boundary, _Mapping]]] = ..., wire: _Optional[_Union[Wire, str]] = ..., origin: _Optional[str] = ..., settled: _Optional[_Iterable[int]] = ...) -> None: ...

class Timing(_message.Message):
    __slots__ = ("path", "bytes", "seconds", "wire")
    PATH_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    WIRE_FIELD_NUMBER: _ClassVar[int]
    path: Path
    bytes: int
    seconds: float
    wire: Wire
    def __init__(self, path: _Optional[_Union[Path, str]] = ..., bytes: _Optional[int] = ..., seconds: _Optional[float] = ..., wire: _Optional[_Union[Wire, str]] = ...) -> None: ...

class SessionUp(_message.Message):
    __slots__ = ("hello", "timings")
    HELLO_FIELD_NUMBER: _ClassVar[int]
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    hello: SessionHello
    timings: TimingBatch
    def __init__(self, hello: _Optional[_Union[SessionHello, _Mapping]] = ..., timings: _Optional[_Union[TimingBatch, _Mapping]] = ...) -> None: ...

class SessionHello(_message.Message):
    __slots__ = ("group_id", "rank")
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    group_id: int
    rank: int
    def __init__(self, group_id: _Optional[int] = ..., rank: _Optional[int] = ...) -> None: ...

class TimingBatch(_message.Message):
    __slots__ = ("timings", "counts", "captured")
    TIMINGS_FIELD_NUMBER: _ClassVar[int]
    COUNTS_FIELD_NUMBER: _ClassVar[int]
    CAPTURED_FIELD_NUMBER: _ClassVar[int]
    timings: _containers.RepeatedCompositeFieldContainer[Timing]
    counts: _containers.RepeatedCompositeFieldContainer[OperationCount]
    captured: _containers.RepeatedCompositeFieldContainer[CapturedSize]
    def __init__(self, timings: _Optional[_Iterable[_Union[Timing, _Mapping]]] = ..., counts: _Optional[_Iterable[_Union[OperationCount, _Mapping]]] = ..., captured: _Optional[_Iterable[_Union[CapturedSize, _Mapping]]] = ...) -> None: ...

class CapturedSize(_message.Message):
    __slots__ = ("bytes", "path")
    BYTES_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    bytes: int
    path: Path
    def __init__(self, bytes: _Optional[int] = ..., path: _Optional[_Union[Path, str]] = ...) -> None: ...

class OperationCount(_message.Message):
    __slots__ = ("op", "path", "operations", "bytes", "wire", "wire_bytes")
    OP_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    OPERATIONS_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    WIRE_FIELD_NUMBER: _ClassVar[int]
    WIRE_BYTES_FIELD_NUMBER: _ClassVar[int]
    op: Op
    path: Path
    operations: int
    bytes: int
    wire: Wire
    wire_bytes: int
    def __init__(self, op: _Optional[_Union[Op, str]] = ..., path: _Optional[_Union[Path, str]] = ..., operations: _Optional[int] = ..., bytes: _Optional[int] = ..., wire: _Optional[_Union[Wire, str]] = ..., wire_bytes: _Optional[int] = ...) -> None: ...

class GroupEvent(_message.Message):
    __slots__ = ("kind", "rank", "message")
    KIND_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    kind: GroupEventKind
    rank: int
    message: str
    def __init__(self, kind: _Optional[_Union[GroupEventKind, str]] = ..., rank: _Optional[int] = ..., message: _Optional[str] = ...) -> None: ...

class SessionDown(_message.Message):
    __slots__ = ("thresholds", "event")
    THRESHOLDS_FIELD_NUMBER: _ClassVar[int]
    EVENT_FIELD_NUMBER: _ClassVar[int]
    thresholds: ThresholdTable
    event: GroupEvent
    def __init__(self, thresholds: _Optional[_Union[ThresholdTable, _Mapping]] = ..., event: _Optional[_Union[GroupEvent, _Mapping]] = ...) -> None: ...

class AllocateMemoryRequest(_message.Message):
    __slots__ = ("group", "group_id", "rank", "size_bytes")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    group: str
    group_id: int
    rank: int
    size_bytes: int
    def __init__(self, group: _Optional[str] = ..., group_id: _Optional[int] = ..., rank: _Optional[int] = ..., size_bytes: _Optional[int] = ...) -> None: ...

class AllocateMemoryReply(_message.Message):
    __slots__ = ("allocation_id", "claim_token", "memory_kind", "size_bytes")
    ALLOCATION_ID_FIELD_NUMBER: _ClassVar[int]
    CLAIM_TOKEN_FIELD_NUMBER: _ClassVar[int]
    MEMORY_KIND_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    allocation_id: int
    claim_token: bytes
    memory_kind: MemoryKind
    size_bytes: int
    def __init__(self, allocation_id: _Optional[int] = ..., claim_token: _Optional[bytes] = ..., memory_kind: _Optional[_Union[MemoryKind, str]] = ..., size_bytes: _Optional[int] = ...) -> None: ...

class FreeMemoryRequest(_message.Message):
    __slots__ = ("group", "group_id", "rank", "allocation_id")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    ALLOCATION_ID_FIELD_NUMBER: _ClassVar[int]
    group: str
    group_id: int
    rank: int
    allocation_id: int
    def __init__(self, group: _Optional[str] = ..., group_id: _Optional[int] = ..., rank: _Optional[int] = ..., allocation_id: _Optional[int] = ...) -> None: ...

class FreeMemoryReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class MemoryRef(_message.Message):
    __slots__ = ("allocation_id", "offset_bytes")
    ALLOCATION_ID_FIELD_NUMBER: _ClassVar[int]
    OFFSET_BYTES_FIELD_NUMBER: _ClassVar[int]
    allocation_id: int
    offset_bytes: int
    def __init__(self, allocation_id: _Optional[int] = ..., offset_bytes: _Optional[int] = ...) -> None: ...

class SubmitRequest(_message.Message):
    __slots__ = ("group", "group_id", "rank", "sequence", "op", "dtype", "count", "topk", "input", "output", "timeout_seconds", "ready_event", "ready_value")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    OP_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    TOPK_FIELD_NUMBER: _ClassVar[int]
    INPUT_FIELD_NUMBER: _ClassVar[int]
    OUTPUT_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    READY_EVENT_FIELD_NUMBER: _ClassVar[int]
    READY_VALUE_FIELD_NUMBER: _ClassVar[int]
    group: str
    group_id: int
    rank: int
    sequence: int
    op: Op
    dtype: DType
    count: int
    topk: int
    input: MemoryRef
    output: MemoryRef
    timeout_seconds: float
    ready_event: bytes
    ready_value: int
    def __init__(self, group: _Optional[str] = ..., group_id: _Optional[int] = ..., rank: _Optional[int] = ..., sequence: _Optional[int] = ..., op: _Optional[_Union[Op, str]] = ..., dtype: _Optional[_Union[DType, str]] = ..., count: _Optional[int] = ..., topk: _Optional[int] = ..., input: _Optional[_Union[MemoryRef, _Mapping]] = ..., output: _Optional[_Union[MemoryRef, _Mapping]] = ..., timeout_seconds: _Optional[float] = ..., ready_event: _Optional[bytes] = ..., ready_value: _Optional[int] = ...) -> None: ...

class SubmitReply(_message.Message):
    __slots__ = ("sequence", "done_event", "done_value")
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    DONE_EVENT_FIELD_NUMBER: _ClassVar[int]
    DONE_VALUE_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    done_event: bytes
    done_value: int
    def __init__(self, sequence: _Optional[int] = ..., done_event: _Optional[bytes] = ..., done_value: _Optional[int] = ...) -> None: ...

class LeaveRequest(_message.Message):
    __slots__ = ("group", "group_id", "rank")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    group: str
    group_id: int
    rank: int
    def __init__(self, group: _Optional[str] = ..., group_id: _Optional[int] = ..., rank: _Optional[int] = ...) -> None: ...

class LeaveReply(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class TopkExchangeRequest(_message.Message):
    __slots__ = ("group", "group_id", "rank", "sequence", "max_rows", "topk", "layout_version", "timeout_seconds")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    MAX_ROWS_FIELD_NUMBER: _ClassVar[int]
    TOPK_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_VERSION_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_SECONDS_FIELD_NUMBER: _ClassVar[int]
    group: str
    group_id: int
    rank: int
    sequence: int
    max_rows: int
    topk: int
    layout_version: int
    timeout_seconds: float
    def __init__(self, group: _Optional[str] = ..., group_id: _Optional[int] = ..., rank: _Optional[int] = ..., sequence: _Optional[int] = ..., max_rows: _Optional[int] = ..., topk: _Optional[int] = ..., layout_version: _Optional[int] = ..., timeout_seconds: _Optional[float] = ...) -> None: ...

class TopkExchangeReply(_message.Message):
    __slots__ = ("exchange_id", "claim_token", "memory_kind", "slabs", "blocks", "rows_per_owner")
    EXCHANGE_ID_FIELD_NUMBER: _ClassVar[int]
    CLAIM_TOKEN_FIELD_NUMBER: _ClassVar[int]
    MEMORY_KIND_FIELD_NUMBER: _ClassVar[int]
    SLABS_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_FIELD_NUMBER: _ClassVar[int]
    ROWS_PER_OWNER_FIELD_NUMBER: _ClassVar[int]
    exchange_id: int
    claim_token: bytes
    memory_kind: MemoryKind
    slabs: _containers.RepeatedCompositeFieldContainer[Segment]
    blocks: int
    rows_per_owner: int
    def __init__(self, exchange_id: _Optional[int] = ..., claim_token: _Optional[bytes] = ..., memory_kind: _Optional[_Union[MemoryKind, str]] = ..., slabs: _Optional[_Iterable[_Union[Segment, _Mapping]]] = ..., blocks: _Optional[int] = ..., rows_per_owner: _Optional[int] = ...) -> None: ...

class CalibrateRequest(_message.Message):
    __slots__ = ("device_kind", "world_size", "min_bytes", "max_bytes", "wires")
    DEVICE_KIND_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    MIN_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_BYTES_FIELD_NUMBER: _ClassVar[int]
    WIRES_FIELD_NUMBER: _ClassVar[int]
    device_kind: str
    world_size: int
    min_bytes: int
    max_bytes: int
    wires: _containers.RepeatedScalarFieldContainer[Wire]
    def __init__(self, device_kind: _Optional[str] = ..., world_size: _Optional[int] = ..., min_bytes: _Optional[int] = ..., max_bytes: _Optional[int] = ..., wires: _Optional[_Iterable[_Union[Wire, str]]] = ...) -> None: ...

class CalibrationPoint(_message.Message):
    __slots__ = ("path", "bytes", "seconds", "wire")
    PATH_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    WIRE_FIELD_NUMBER: _ClassVar[int]
    path: Path
    bytes: int
    seconds: float
    wire: Wire
    def __init__(self, path: _Optional[_Union[Path, str]] = ..., bytes: _Optional[int] = ..., seconds: _Optional[float] = ..., wire: _Optional[_Union[Wire, str]] = ...) -> None: ...

class CalibrateReply(_message.Message):
    __slots__ = ("fingerprint_key", "stored_at", "thresholds", "points", "warnings")
    FINGERPRINT_KEY_FIELD_NUMBER: _ClassVar[int]
    STORED_AT_FIELD_NUMBER: _ClassVar[int]
    THRESHOLDS_FIELD_NUMBER: _ClassVar[int]
    POINTS_FIELD_NUMBER: _ClassVar[int]
    WARNINGS_FIELD_NUMBER: _ClassVar[int]
    fingerprint_key: str
    stored_at: str
    thresholds: ThresholdTable
    points: _containers.RepeatedCompositeFieldContainer[CalibrationPoint]
    warnings: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, fingerprint_key: _Optional[str] = ..., stored_at: _Optional[str] = ..., thresholds: _Optional[_Union[ThresholdTable, _Mapping]] = ..., points: _Optional[_Iterable[_Union[CalibrationPoint, _Mapping]]] = ..., warnings: _Optional[_Iterable[str]] = ...) -> None: ...

class CalibrateUpdate(_message.Message):
    __slots__ = ("point", "done")
    POINT_FIELD_NUMBER: _ClassVar[int]
    DONE_FIELD_NUMBER: _ClassVar[int]
    point: CalibrationPoint
    done: CalibrateReply
    def __init__(self, point: _Optional[_Union[CalibrationPoint, _Mapping]] = ..., done: _Optional[_Union[CalibrateReply, _Mapping]] = ...) -> None: ...

class PeerCheckReport(_message.Message):
    __slots__ = ("group", "group_id", "rank", "ok", "detail", "stage")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    OK_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    STAGE_FIELD_NUMBER: _ClassVar[int]
    group: str
    group_id: int
    rank: int
    ok: bool
    detail: str
    stage: int
    def __init__(self, group: _Optional[str] = ..., group_id: _Optional[int] = ..., rank: _Optional[int] = ..., ok: _Optional[bool] = ..., detail: _Optional[str] = ..., stage: _Optional[int] = ...) -> None: ...

class PeerCheckVerdict(_message.Message):
    __slots__ = ("peer_memory_ok", "reason", "thresholds")
    PEER_MEMORY_OK_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    THRESHOLDS_FIELD_NUMBER: _ClassVar[int]
    peer_memory_ok: bool
    reason: str
    thresholds: ThresholdTable
    def __init__(self, peer_memory_ok: _Optional[bool] = ..., reason: _Optional[str] = ..., thresholds: _Optional[_Union[ThresholdTable, _Mapping]] = ...) -> None: ...

class GetThresholdsRequest(_message.Message):
    __slots__ = ("group", "device_kind", "nccl_fallback")
    GROUP_FIELD_NUMBER: _ClassVar[int]
    DEVICE_KIND_FIELD_NUMBER: _ClassVar[int]
    NCCL_FALLBACK_FIELD_NUMBER: _ClassVar[int]
    group: str
    device_kind: str
    nccl_fallback: bool
    def __init__(self, group: _Optional[str] = ..., device_kind: _Optional[str] = ..., nccl_fallback: _Optional[bool] = ...) -> None: ...

class ListGroupsRequest(_message.Message):
    __slots__ = ("group_key",)
    GROUP_KEY_FIELD_NUMBER: _ClassVar[int]
    group_key: bytes
    def __init__(self, group_key: _Optional[bytes] = ...) -> None: ...

class GroupInfo(_message.Message):
    __slots__ = ("name", "group_id", "world_size", "joined_ranks", "live_ranks", "state", "device_kind", "reserved_bytes", "geometry", "thresholds", "topk_exchanges", "service_bytes", "service_ordering", "owner", "captured")
    NAME_FIELD_NUMBER: _ClassVar[int]
    GROUP_ID_FIELD_NUMBER: _ClassVar[int]
    WORLD_SIZE_FIELD_NUMBER: _ClassVar[int]
    JOINED_RANKS_FIELD_NUMBER: _ClassVar[int]
    LIVE_RANKS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_KIND_FIELD_NUMBER: _ClassVar[int]
    RESERVED_BYTES_FIELD_NUMBER: _ClassVar[int]
    GEOMETRY_FIELD_NUMBER: _ClassVar[int]
    THRESHOLDS_FIELD_NUMBER: _ClassVar[int]
    TOPK_EXCHANGES_FIELD_NUMBER: _ClassVar[int]
    SERVICE_BYTES_FIELD_NUMBER: _ClassVar[int]
    SERVICE_ORDERING_FIELD_NUMBER: _ClassVar[int]
    OWNER_FIELD_NUMBER: _ClassVar[int]
    CAPTURED_FIELD_NUMBER: _ClassVar[int]
    name: str
    group_id: int
    world_size: int
    joined_ranks: _containers.RepeatedScalarFieldContainer[int]
    live_ranks: _containers.RepeatedScalarFieldContainer[int]
    state: str
    device_kind: str
    reserved_bytes: int
    geometry: Geometry
    thresholds: ThresholdTable
    topk_exchanges: int
    service_bytes: int
    service_ordering: ServiceOrdering
    owner: str
    captured: _containers.RepeatedCompositeFieldContainer[CapturedSize]
    def __init__(self, name: _Optional[str] = ..., group_id: _Optional[int] = ..., world_size: _Optional[int] = ..., joined_ranks: _Optional[_Iterable[int]] = ..., live_ranks: _Optional[_Iterable[int]] = ..., state: _Optional[str] = ..., device_kind: _Optional[str] = ..., reserved_bytes: _Optional[int] = ..., geometry: _Optional[_Union[Geometry, _Mapping]] = ..., thresholds: _Optional[_Union[ThresholdTable, _Mapping]] = ..., topk_exchanges: _Optional[int] = ..., service_bytes: _Optional[int] = ..., service_ordering: _Optional[_Union[ServiceOrdering, str]] = ..., owner: _Optional[str] = ..., captured: _Optional[_Iterable[_Union[CapturedSize, _Mapping]]] = ...) -> None: ...

class ListGroupsReply(_message.Message):
    __slots__ = ("groups",)
    GROUPS_FIELD_NUMBER: _ClassVar[int]
    groups: _containers.RepeatedCompositeFieldContainer[GroupInfo]
    def __init__(self, groups: _Optional[_Iterable[_Union[GroupInfo, _Mapping]]] = ...) -> None: ...
