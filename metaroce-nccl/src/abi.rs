//! The NCCL net plugin ABI, as `#[repr(C)]` Rust types.
//!
//! Written from NCCL's documented ext-net interface (`nccl_net.h`,
//! `net_v8.h` … `net_v12.h`, `net_device.h`, `nccl_common.h`, `err.h`):
//! NCCL `dlopen`s `libnccl-net-NAME.so` and looks up the symbol
//! `ncclNetPlugin_vN`, newest version first, and calls through the table of
//! function pointers it finds there. RCCL loads the same symbols.
//!
//! Every function pointer is an `Option`, so that a table may leave one
//! NULL (NCCL checks the optional ones, such as `regMrDmaBuf` or
//! `makeVDevice`, before calling them) and so that the harness can tell.
//!
//! ```
//! use metaroce_nccl::abi::{NCCL_NET_HANDLE_MAXSIZE, NCCL_PTR_HOST, NetPropertiesV8};
//! assert_eq!(NCCL_NET_HANDLE_MAXSIZE, 128);
//! let props = NetPropertiesV8::default();
//! assert_eq!(props.ptr_support & NCCL_PTR_HOST, 0);
//! ```

use std::ffi::{c_char, c_int, c_ulong, c_void};

/// `ncclResult_t`.
pub type NcclResult = c_int;
/// `ncclSuccess`.
pub const NCCL_SUCCESS: NcclResult = 0;
/// `ncclUnhandledCudaError`.
pub const NCCL_UNHANDLED_CUDA_ERROR: NcclResult = 1;
/// `ncclSystemError`: a system call or the network failed.
pub const NCCL_SYSTEM_ERROR: NcclResult = 2;
/// `ncclInternalError`: a bug, in NCCL or here.
pub const NCCL_INTERNAL_ERROR: NcclResult = 3;
/// `ncclInvalidArgument`.
pub const NCCL_INVALID_ARGUMENT: NcclResult = 4;
/// `ncclInvalidUsage`.
pub const NCCL_INVALID_USAGE: NcclResult = 5;
/// `ncclRemoteError`: the peer failed or went away.
pub const NCCL_REMOTE_ERROR: NcclResult = 6;
/// `ncclInProgress`.
pub const NCCL_IN_PROGRESS: NcclResult = 7;

/// Largest opaque handle `listen` may fill (`NCCL_NET_HANDLE_MAXSIZE`).
pub const NCCL_NET_HANDLE_MAXSIZE: usize = 128;
/// Most requests NCCL keeps outstanding per comm (`NCCL_NET_MAX_REQUESTS`).
pub const NCCL_NET_MAX_REQUESTS: usize = 32;
/// Host memory (`NCCL_PTR_HOST`).
pub const NCCL_PTR_HOST: c_int = 0x1;
/// CUDA device memory (`NCCL_PTR_CUDA`).
pub const NCCL_PTR_CUDA: c_int = 0x2;
/// DMA-BUF memory (`NCCL_PTR_DMABUF`).
pub const NCCL_PTR_DMABUF: c_int = 0x4;
/// `NCCL_NET_DEVICE_HOST`: no device offload.
pub const NCCL_NET_DEVICE_HOST: c_int = 0;
/// `NCCL_NET_DEVICE_INVALID_VERSION`.
pub const NCCL_NET_DEVICE_INVALID_VERSION: c_int = 0;
/// Virtual-NIC slots of `ncclNetVDeviceProps` in v9 to v11.
pub const NCCL_NET_MAX_DEVS_PER_NIC_V9: usize = 4;
/// Virtual-NIC slots of `ncclNetVDeviceProps_v12_t`.
pub const NCCL_NET_MAX_DEVS_PER_NIC_V12: usize = 8;

/// `ncclDebugLogLevel`: `NCCL_LOG_WARN`.
pub const NCCL_LOG_WARN: c_int = 2;
/// `ncclDebugLogLevel`: `NCCL_LOG_INFO`.
pub const NCCL_LOG_INFO: c_int = 3;
/// `ncclDebugLogLevel`: `NCCL_LOG_TRACE`.
pub const NCCL_LOG_TRACE: c_int = 5;
/// `ncclDebugLogSubSys`: `NCCL_INIT`.
pub const NCCL_INIT: c_ulong = 0x1;
/// `ncclDebugLogSubSys`: `NCCL_NET`.
pub const NCCL_NET: c_ulong = 0x10;

/// `ncclDebugLogger_t`: `(level, flags, file, line, fmt, ...)`, printf-like.
pub type NcclDebugLogger = Option<
    unsafe extern "C" fn(
        level: c_int,
        flags: c_ulong,
        file: *const c_char,
        line: c_int,
        fmt: *const c_char,
        ...
    ),
>;

/// `ncclProfilerCallback_t` (v10 and later; the plugin does not call it).
pub type NcclProfilerCallback = Option<
    unsafe extern "C" fn(
        e_handle: *mut *mut c_void,
        kind: c_int,
        p_handle: *mut c_void,
        plugin_id: i64,
        ext_data: *mut c_void,
    ) -> NcclResult,
>;

/// `ncclNetDeviceHandle_v7_t` … `_v12_t` (one layout): device offload,
/// which this plugin does not offer (NCCL passes it only when
/// `netDeviceType` asks for it).
#[repr(C)]
#[derive(Debug)]
pub struct NetDeviceHandle {
    /// `ncclNetDeviceType`.
    pub net_device_type: c_int,
    /// `netDeviceVersion`.
    pub net_device_version: c_int,
    /// `handle`.
    pub handle: *mut c_void,
    /// `size`.
    pub size: usize,
    /// `needsProxyProgress`.
    pub needs_proxy_progress: c_int,
}

/// `ncclNetProperties_v8_t`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct NetPropertiesV8 {
    /// Used mostly for logging.
    pub name: *mut c_char,
    /// Path to the PCI device in /sys.
    pub pci_path: *mut c_char,
    /// Unique identifier of the NIC.
    pub guid: u64,
    /// `NCCL_PTR_HOST | NCCL_PTR_CUDA | NCCL_PTR_DMABUF`.
    pub ptr_support: c_int,
    /// Whether `regMr` is not tied to a particular comm.
    pub reg_is_global: c_int,
    /// Port speed in Mbps.
    pub speed: c_int,
    /// Port number.
    pub port: c_int,
    /// Network latency (µs).
    pub latency: f32,
    /// Most comms the plugin can create.
    pub max_comms: c_int,
    /// Most receives of one grouped `irecv`.
    pub max_recvs: c_int,
    /// `ncclNetDeviceType`.
    pub net_device_type: c_int,
    /// Version of the device offload.
    pub net_device_version: c_int,
}

impl Default for NetPropertiesV8 {
    fn default() -> Self {
        NetPropertiesV8 {
            name: std::ptr::null_mut(),
            pci_path: std::ptr::null_mut(),
            guid: 0,
            ptr_support: 0,
            reg_is_global: 0,
            speed: 0,
            port: 0,
            latency: 0.0,
            max_comms: 0,
            max_recvs: 0,
            net_device_type: 0,
            net_device_version: 0,
        }
    }
}

/// `ncclNetVDeviceProps_v9_t` (also v10, v11: 4 slots) and `_v12_t`
/// (8 slots), by `N`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct NetVDeviceProps<const N: usize> {
    /// How many of `devs` are used.
    pub ndevs: c_int,
    /// The physical devices the virtual one merges.
    pub devs: [c_int; N],
}

/// `ncclNetProperties_v9_t` (`forceFlush`, `vProps`, transfer limits),
/// the same layout as `ncclNetProperties_v10_t`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct NetPropertiesV9 {
    /// Used mostly for logging.
    pub name: *mut c_char,
    /// Path to the PCI device in /sys.
    pub pci_path: *mut c_char,
    /// Unique identifier of the NIC.
    pub guid: u64,
    /// `NCCL_PTR_HOST | NCCL_PTR_CUDA | NCCL_PTR_DMABUF`.
    pub ptr_support: c_int,
    /// Whether `regMr` is not tied to a particular comm.
    pub reg_is_global: c_int,
    /// Force a flush on receives.
    pub force_flush: c_int,
    /// Port speed in Mbps.
    pub speed: c_int,
    /// Port number.
    pub port: c_int,
    /// Network latency (µs).
    pub latency: f32,
    /// Most comms the plugin can create.
    pub max_comms: c_int,
    /// Most receives of one grouped `irecv`.
    pub max_recvs: c_int,
    /// `ncclNetDeviceType`.
    pub net_device_type: c_int,
    /// Version of the device offload.
    pub net_device_version: c_int,
    /// The physical devices of a virtual one.
    pub v_props: NetVDeviceProps<NCCL_NET_MAX_DEVS_PER_NIC_V9>,
    /// Largest point-to-point transfer.
    pub max_p2p_bytes: usize,
    /// Largest collective transfer.
    pub max_coll_bytes: usize,
}

/// `ncclNetProperties_v11_t`: v9's fields and `maxMultiRequestSize`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct NetPropertiesV11 {
    /// The fields v9 has.
    pub v9: NetPropertiesV9,
    /// Most requests of one multi-request.
    pub max_multi_request_size: c_int,
}

/// `ncclNetProperties_v12_t`: 8 virtual-NIC slots, rail and plane ids.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct NetPropertiesV12 {
    /// Used mostly for logging.
    pub name: *mut c_char,
    /// Path to the PCI device in /sys.
    pub pci_path: *mut c_char,
    /// Unique identifier of the NIC.
    pub guid: u64,
    /// `NCCL_PTR_HOST | NCCL_PTR_CUDA | NCCL_PTR_DMABUF`.
    pub ptr_support: c_int,
    /// Whether `regMr` is not tied to a particular comm.
    pub reg_is_global: c_int,
    /// Force a flush on receives.
    pub force_flush: c_int,
    /// Port speed in Mbps.
    pub speed: c_int,
    /// Port number.
    pub port: c_int,
    /// Network latency (µs).
    pub latency: f32,
    /// Most comms the plugin can create.
    pub max_comms: c_int,
    /// Most receives of one grouped `irecv`.
    pub max_recvs: c_int,
    /// `ncclNetDeviceType`.
    pub net_device_type: c_int,
    /// Version of the device offload.
    pub net_device_version: c_int,
    /// The physical devices of a virtual one.
    pub v_props: NetVDeviceProps<NCCL_NET_MAX_DEVS_PER_NIC_V12>,
    /// Largest point-to-point transfer.
    pub max_p2p_bytes: usize,
    /// Largest collective transfer.
    pub max_coll_bytes: usize,
    /// Most requests of one multi-request.
    pub max_multi_request_size: c_int,
    /// Rail of the device (`NCCL_NET_ID_UNDEF`: -1).
    pub rail_id: i16,
    /// Plane of the device (`NCCL_NET_ID_UNDEF`: -1).
    pub plane_id: i16,
}

/// `ncclNetCommConfig_v10_t` … `_v12_t`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct NetCommConfig {
    /// Traffic class, or `NCCL_NET_TRAFFIC_CLASS_UNDEF` (-1).
    pub traffic_class: c_int,
}

/// `ncclNetCommAttr_v11_t`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct NetCommAttr {
    /// `maxConcurrentPeers`.
    pub max_concurrent_peers: i32,
    /// `minConcurrentPeers`.
    pub min_concurrent_peers: i32,
    /// `maxFlowsPerPeer`.
    pub max_flows_per_peer: i32,
    /// `minFlowsPerPeer`.
    pub min_flows_per_peer: i32,
}

/// `ncclNetAttr_v11_t` (and `_v12_t`): hints `setNetAttr` passes.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct NetAttr {
    /// Hints for send comms.
    pub send_comm_attr: NetCommAttr,
    /// Hints for receive comms.
    pub recv_comm_attr: NetCommAttr,
    /// Collective operation.
    pub op: u32,
    /// Algorithm.
    pub algo: u32,
    /// Protocol.
    pub proto: u32,
}

type Ptr = *mut c_void;
type PPtr = *mut *mut c_void;
type DevHandle = *mut *mut NetDeviceHandle;

/// The calls every version has with the same signature.
macro_rules! net_table {
    (
        $(#[$meta:meta])* $name:ident, props: $props:ty,
        init: ($($init:ty),*), listen: ($($listen:ty),*), connect: ($($connect:ty),*),
        size: $size:ty, sizes: $sizes:ty,
        isend_extra: ($($isx:ty),*), irecv_extra: ($($irx:ty),*),
        extra: { $($(#[$fm:meta])* $field:ident: $fty:ty,)* }
    ) => {
        $(#[$meta])*
        #[repr(C)]
        #[derive(Debug, Clone, Copy)]
        pub struct $name {
            /// Name of the network, for logs.
            pub name: *const c_char,
            /// Initializes the network.
            pub init: Option<unsafe extern "C" fn($($init),*) -> NcclResult>,
            /// Number of adapters.
            pub devices: Option<unsafe extern "C" fn(*mut c_int) -> NcclResult>,
            /// Properties of one adapter.
            pub get_properties: Option<unsafe extern "C" fn(c_int, *mut $props) -> NcclResult>,
            /// Creates a listen comm and fills the handle NCCL sends the peer.
            pub listen: Option<unsafe extern "C" fn($($listen),*) -> NcclResult>,
            /// Connects to a handle; leaves the send comm NULL until ready.
            pub connect: Option<unsafe extern "C" fn($($connect),*) -> NcclResult>,
            /// Accepts on a listen comm; leaves the recv comm NULL until ready.
            pub accept: Option<unsafe extern "C" fn(Ptr, PPtr, DevHandle) -> NcclResult>,
            /// Registers memory with a comm.
            pub reg_mr: Option<unsafe extern "C" fn(Ptr, Ptr, usize, c_int, PPtr) -> NcclResult>,
            /// Registers DMA-BUF memory (NULL: not offered).
            pub reg_mr_dma_buf:
                Option<unsafe extern "C" fn(Ptr, Ptr, usize, c_int, u64, c_int, PPtr) -> NcclResult>,
            /// Deregisters memory.
            pub dereg_mr: Option<unsafe extern "C" fn(Ptr, Ptr) -> NcclResult>,
            /// Starts a send; may leave the request NULL (try again).
            pub isend: Option<unsafe extern "C" fn(Ptr, Ptr, $size, c_int, Ptr, $($isx,)* PPtr) -> NcclResult>,
            /// Starts a (grouped) receive; may leave the request NULL.
            pub irecv: Option<
                unsafe extern "C" fn(Ptr, c_int, PPtr, $sizes, *mut c_int, PPtr, $($irx,)* PPtr) -> NcclResult,
            >,
            /// Flushes received GPU memory (a NULL request: nothing to do).
            pub iflush:
                Option<unsafe extern "C" fn(Ptr, c_int, PPtr, *mut c_int, PPtr, PPtr) -> NcclResult>,
            /// Polls a request: done and sizes.
            pub test: Option<unsafe extern "C" fn(Ptr, *mut c_int, *mut c_int) -> NcclResult>,
            /// Closes a send comm.
            pub close_send: Option<unsafe extern "C" fn(Ptr) -> NcclResult>,
            /// Closes a receive comm.
            pub close_recv: Option<unsafe extern "C" fn(Ptr) -> NcclResult>,
            /// Closes a listen comm.
            pub close_listen: Option<unsafe extern "C" fn(Ptr) -> NcclResult>,
            /// Device-offload memory handle (NULL: not offered).
            pub get_device_mr: Option<unsafe extern "C" fn(Ptr, Ptr, PPtr) -> NcclResult>,
            /// Device-offload receive consumed (NULL: not offered).
            pub irecv_consumed: Option<unsafe extern "C" fn(Ptr, c_int, Ptr) -> NcclResult>,
            $($(#[$fm])* pub $field: $fty,)*
        }

        // SAFETY: a table of function pointers and a pointer to a static,
        // immutable C string; nothing in it is ever written after
        // construction, so sharing it between threads is sound.
        unsafe impl Sync for $name {}
    };
}

net_table!(
    /// `ncclNet_v8_t`.
    NetV8, props: NetPropertiesV8,
    init: (NcclDebugLogger), listen: (c_int, Ptr, PPtr), connect: (c_int, Ptr, PPtr, DevHandle),
    size: c_int, sizes: *mut c_int, isend_extra: (), irecv_extra: (),
    extra: {}
);

net_table!(
    /// `ncclNet_v9_t`: sizes become `size_t`, virtual NICs.
    NetV9, props: NetPropertiesV9,
    init: (NcclDebugLogger), listen: (c_int, Ptr, PPtr), connect: (c_int, Ptr, PPtr, DevHandle),
    size: usize, sizes: *mut usize, isend_extra: (), irecv_extra: (),
    extra: {
        /// Creates a virtual NIC (NULL: not offered).
        make_vdevice: Option<unsafe extern "C" fn(*mut c_int, *mut NetVDeviceProps<NCCL_NET_MAX_DEVS_PER_NIC_V9>) -> NcclResult>,
    }
);

net_table!(
    /// `ncclNet_v10_t`: profiler callback, comm config, profiler handles.
    NetV10, props: NetPropertiesV9,
    init: (NcclDebugLogger, NcclProfilerCallback), listen: (c_int, Ptr, PPtr),
    connect: (c_int, *mut NetCommConfig, Ptr, PPtr, DevHandle),
    size: usize, sizes: *mut usize, isend_extra: (Ptr), irecv_extra: (PPtr),
    extra: {
        /// Creates a virtual NIC (NULL: not offered).
        make_vdevice: Option<unsafe extern "C" fn(*mut c_int, *mut NetVDeviceProps<NCCL_NET_MAX_DEVS_PER_NIC_V9>) -> NcclResult>,
    }
);

net_table!(
    /// `ncclNet_v11_t`: a context per NCCL communicator, `finalize`, `setNetAttr`.
    NetV11, props: NetPropertiesV11,
    init: (PPtr, u64, *mut NetCommConfig, NcclDebugLogger, NcclProfilerCallback),
    listen: (Ptr, c_int, Ptr, PPtr), connect: (Ptr, c_int, Ptr, PPtr, DevHandle),
    size: usize, sizes: *mut usize, isend_extra: (Ptr), irecv_extra: (PPtr),
    extra: {
        /// Creates a virtual NIC (NULL: not offered).
        make_vdevice: Option<unsafe extern "C" fn(*mut c_int, *mut NetVDeviceProps<NCCL_NET_MAX_DEVS_PER_NIC_V9>) -> NcclResult>,
        /// Ends the context `init` made.
        finalize: Option<unsafe extern "C" fn(Ptr) -> NcclResult>,
        /// Hints about the traffic to come (NULL: not used).
        set_net_attr: Option<unsafe extern "C" fn(Ptr, *mut NetAttr) -> NcclResult>,
    }
);

net_table!(
    /// `ncclNet_v12_t`: v11 with rail and plane ids in the properties.
    NetV12, props: NetPropertiesV12,
    init: (PPtr, u64, *mut NetCommConfig, NcclDebugLogger, NcclProfilerCallback),
    listen: (Ptr, c_int, Ptr, PPtr), connect: (Ptr, c_int, Ptr, PPtr, DevHandle),
    size: usize, sizes: *mut usize, isend_extra: (Ptr), irecv_extra: (PPtr),
    extra: {
        /// Creates a virtual NIC (NULL: not offered).
        make_vdevice: Option<unsafe extern "C" fn(*mut c_int, *mut NetVDeviceProps<NCCL_NET_MAX_DEVS_PER_NIC_V12>) -> NcclResult>,
        /// Ends the context `init` made.
        finalize: Option<unsafe extern "C" fn(Ptr) -> NcclResult>,
        /// Hints about the traffic to come (NULL: not used).
        set_net_attr: Option<unsafe extern "C" fn(Ptr, *mut NetAttr) -> NcclResult>,
    }
);

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::{offset_of, size_of};

    /// Offsets as a C compiler lays out NCCL's structs on LP64.
    #[test]
    fn layouts_match_c_on_lp64() {
        assert_eq!(offset_of!(NetPropertiesV8, guid), 16);
        assert_eq!(offset_of!(NetPropertiesV8, latency), 40);
        assert_eq!(size_of::<NetPropertiesV8>(), 64);
        assert_eq!(offset_of!(NetPropertiesV9, v_props), 64);
        assert_eq!(offset_of!(NetPropertiesV9, max_p2p_bytes), 88);
        assert_eq!(size_of::<NetPropertiesV9>(), 104);
        assert_eq!(offset_of!(NetPropertiesV11, max_multi_request_size), 104);
        assert_eq!(offset_of!(NetPropertiesV12, max_p2p_bytes), 104);
        assert_eq!(offset_of!(NetPropertiesV12, rail_id), 124);
        assert_eq!(size_of::<NetPropertiesV12>(), 128);
        assert_eq!(size_of::<NetV8>(), 19 * 8);
        assert_eq!(size_of::<NetV9>(), 20 * 8);
        assert_eq!(size_of::<NetV11>(), 22 * 8);
        assert_eq!(size_of::<NetDeviceHandle>(), 32);
    }
}
