//! Every type in `metaroce_io`'s public signatures can be named from
//! `metaroce_io` alone, without a direct dependency on `metaroce-proto`:
//! this file compiles only if each one is re-exported. (A service that
//! stores a `RemoteAddr`, matches a `VerbsError` or keeps `EndpointStats`
//! must be able to write its type down.)

#![allow(dead_code)]

use metaroce_io::{
    AccessFlags, ApiError, Backend, CompletionQueue, Connection, ConnectionError, ConnectionHandle,
    ConnectionState, ConnectionStats, CqHandle, Device, DriverConfig, DriverError, DriverStats,
    Endpoint, EndpointConfig, EndpointStats, Event, FaultConfig, Instant, MemoryRegion, Metrics,
    MrInfo, OobDecodeError, PathState, PathStats, PdHandle, ProtectionDomain, QpAttrs, QpCaps,
    QpEndpoint, QpInit, QpState, Qpn, QueuePair, RcAttrs, RecvWr, RegionBuf, Registry,
    RejectCounters, RejectReason, RemoteAddr, RemoteMr, SendOp, SendWr, Sge, VerbsError, WcOpcode,
    WcStatus, WorkCompletion, WorkRequest,
};

/// What the async API's calls give, written down as a service would.
struct Held {
    dev: Device,
    conn: Connection,
    pd: ProtectionDomain,
    cq: CompletionQueue,
    qp: QueuePair,
    mr: MemoryRegion,
    info: MrInfo,
    remote: RemoteAddr,
    remote_mr: RemoteMr,
    ep: QpEndpoint,
    qpn: Qpn,
    qp_state: Option<QpState>,
    conn_state: Option<ConnectionState>,
    conn_stats: Option<ConnectionStats>,
    path: Option<PathStats>,
    path_state: Option<PathState>,
    stats: EndpointStats,
    rejects: RejectCounters,
    reason: Option<RejectReason>,
    handle: ConnectionHandle,
    wc: WorkCompletion,
    caps: QpCaps,
    attrs: RcAttrs,
    pending: WorkRequest,
}

/// The errors, each matched by name.
fn why(e: &ApiError) -> &'static str {
    match e {
        ApiError::Verbs(VerbsError::InvalidKey(_)) => "key",
        ApiError::Verbs(_) => "verbs",
        ApiError::Connection(ConnectionError::RetryExceeded) => "retry",
        ApiError::Connection(_) => "connection",
        ApiError::Driver(DriverError::Io(_)) => "io",
        ApiError::Failed(WorkCompletion {
            status: WcStatus::RemoteAccessError,
            opcode: WcOpcode::Write,
            ..
        }) => "remote access",
        _ => "other",
    }
}

/// The driver API's types, and the core's handles it hands out.
type DriverApi<'a> = (
    &'a mut Endpoint,
    EndpointConfig,
    Instant,
    Option<Event>,
    QpInit,
    QpAttrs,
    PdHandle,
    CqHandle,
    DriverConfig,
    DriverStats,
    FaultConfig,
    Backend,
    &'a Metrics,
    &'a Registry,
    OobDecodeError,
    (AccessFlags, RegionBuf, SendWr, SendOp, RecvWr, Sge),
);

#[test]
fn the_core_is_reachable_whole() {
    // `proto` is the core crate itself: its types are the same types.
    let q: metaroce_io::proto::verbs::Qpn = Qpn(7);
    assert_eq!(q, Qpn(7));
    assert_eq!(why(&ApiError::Closed), "other");
}
