//! A small C ABI over [`metaroce_io`]'s verbs API, for embedding metaroce
//! from C or C++; `include/metaroce.h` declares it (generated from this file
//! by `cbindgen`, see `cbindgen.toml`; a test keeps the two in step).
//!
//! The objects are opaque pointers: a device (an endpoint on its own
//! thread), connections, protection domains, memory regions, completion
//! queues and queue pairs, each freed with its `_free`/`_close` call. The
//! set-up calls block until the endpoint answers; [`metaroce_post_send`] and
//! [`metaroce_post_recv`] post and return, and [`metaroce_poll_cq`] takes
//! the completions that are in, without waiting (`ibv_poll_cq`).
//!
//! A memory region's bytes belong to the endpoint (as with the Rust API's
//! `reg_mr`): the application fills them with [`metaroce_mr_write`] and
//! reads them with [`metaroce_mr_read`], in order with the requests it
//! posts. Calls return [`METAROCE_OK`] (0) or a negative error code;
//! [`metaroce_last_error`] describes the last error of the calling thread.
//!
//! ```
//! use metaroce_nccl::capi::*;
//! let mut dev = std::ptr::null_mut();
//! let rc = unsafe { metaroce_device_open(c"127.0.0.1:0".as_ptr(), &mut dev) };
//! assert_eq!(rc, METAROCE_OK);
//! unsafe { metaroce_device_close(dev) };
//! ```

use crate::memory::block_on;
use metaroce_io::{
    AccessFlags, ApiError, CompletionQueue, Connection, Device, DriverConfig, MemoryRegion,
    ProtectionDomain, QueuePair, RecvWr, RegionBuf, RemoteAddr, SendOp, SendWr, Sge, WcOpcode,
    WcStatus,
};
use std::cell::RefCell;
use std::ffi::{c_char, c_int, CStr, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};

/// Success.
pub const METAROCE_OK: c_int = 0;
/// An argument is NULL, malformed or out of range.
pub const METAROCE_EINVAL: c_int = -1;
/// The transport refused the call (bad key, wrong QP state, queue full…).
pub const METAROCE_EVERBS: c_int = -2;
/// The connection failed or the peer went away.
pub const METAROCE_ECONN: c_int = -3;
/// The driver could not be set up (socket, io_uring…).
pub const METAROCE_EIO: c_int = -4;
/// The device's endpoint thread has stopped.
pub const METAROCE_ECLOSED: c_int = -5;
/// A bug (a panic caught at the boundary).
pub const METAROCE_EINTERNAL: c_int = -6;

/// Local write access (receives and READs may land in the region).
pub const METAROCE_ACCESS_LOCAL_WRITE: u32 = 1;
/// The peer may WRITE to the region.
pub const METAROCE_ACCESS_REMOTE_WRITE: u32 = 2;
/// The peer may READ the region.
pub const METAROCE_ACCESS_REMOTE_READ: u32 = 4;

/// A SEND.
pub const METAROCE_OP_SEND: u32 = 0;
/// A SEND with immediate data.
pub const METAROCE_OP_SEND_IMM: u32 = 1;
/// An RDMA WRITE.
pub const METAROCE_OP_WRITE: u32 = 2;
/// An RDMA WRITE with immediate data.
pub const METAROCE_OP_WRITE_IMM: u32 = 3;
/// An RDMA READ.
pub const METAROCE_OP_READ: u32 = 4;

/// Completion of a SEND.
pub const METAROCE_WC_SEND: u32 = 0;
/// Completion of a WRITE.
pub const METAROCE_WC_WRITE: u32 = 1;
/// Completion of a READ.
pub const METAROCE_WC_READ: u32 = 2;
/// A receive consumed by a SEND.
pub const METAROCE_WC_RECV: u32 = 3;
/// A receive consumed by a WRITE with immediate.
pub const METAROCE_WC_RECV_RDMA_WITH_IMM: u32 = 4;

/// A device: an endpoint on its own thread.
#[derive(Debug)]
pub struct MetaroceDevice(Device);
/// A connection to a peer device.
#[derive(Debug)]
pub struct MetaroceConn(Connection);
/// A protection domain.
#[derive(Debug)]
pub struct MetarocePd(ProtectionDomain);
/// A registered memory region.
#[derive(Debug)]
pub struct MetaroceMr(MemoryRegion);
/// A completion queue.
#[derive(Debug)]
pub struct MetaroceCq(CompletionQueue);
/// An RC queue pair.
#[derive(Debug)]
pub struct MetaroceQp(QueuePair);

/// A local buffer of a work request: `len` bytes at `addr` of the region
/// `lkey` (fill with [`metaroce_mr_sge`]).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct MetaroceSge {
    /// The region's local key.
    pub lkey: u32,
    /// Length in bytes.
    pub len: u32,
    /// Address inside the region.
    pub addr: u64,
}

/// What a peer needs to WRITE to or READ from a region.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct MetaroceRemote {
    /// Remote key.
    pub rkey: u32,
    /// Reserved (zero).
    pub reserved: u32,
    /// Address of the first byte.
    pub addr: u64,
    /// Length in bytes.
    pub len: u64,
}

/// A work completion.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct MetaroceWc {
    /// The `wr_id` the request was posted with.
    pub wr_id: u64,
    /// 0 for success; otherwise the failure (`WcStatus` order: 1 local
    /// length, 2 local protection, 3 remote access, 4 remote invalid
    /// request, 5 remote operation, 6 retry exceeded, 7 RNR retry
    /// exceeded, 8 flushed).
    pub status: u32,
    /// `METAROCE_WC_*`.
    pub opcode: u32,
    /// Bytes received (receives).
    pub byte_len: u32,
    /// Whether `imm` holds immediate data.
    pub has_imm: u32,
    /// Immediate data.
    pub imm: u32,
    /// The QP.
    pub qpn: u32,
}

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

fn set_error(msg: String) {
    LAST_ERROR.with(|e| *e.borrow_mut() = CString::new(msg.replace('\0', " ")).unwrap_or_default());
}

fn api_code(e: &ApiError) -> c_int {
    match e {
        ApiError::Verbs(_) | ApiError::BatchRefused { .. } | ApiError::OutOfBounds { .. } => {
            METAROCE_EVERBS
        }
        ApiError::Driver(_) | ApiError::NoRuntime => METAROCE_EIO,
        ApiError::NotPolled => METAROCE_EINVAL,
        ApiError::Connection(_) | ApiError::Failed(_) => METAROCE_ECONN,
        ApiError::Closed => METAROCE_ECLOSED,
    }
}

/// An error of a C call: a code and a message.
struct Fail(c_int, String);

impl From<ApiError> for Fail {
    fn from(e: ApiError) -> Fail {
        Fail(api_code(&e), e.to_string())
    }
}

fn inval(msg: &str) -> Fail {
    Fail(METAROCE_EINVAL, msg.into())
}

fn run(f: impl FnOnce() -> Result<(), Fail>) -> c_int {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => METAROCE_OK,
        Ok(Err(Fail(code, msg))) => {
            set_error(msg);
            code
        }
        Err(_) => {
            set_error("panic inside metaroce".into());
            METAROCE_EINTERNAL
        }
    }
}

/// # Safety
/// `p` is NULL or points to a live object of type `T` made by this API.
unsafe fn obj<'a, T>(p: *const T, what: &str) -> Result<&'a T, Fail> {
    // SAFETY: by the caller's contract.
    unsafe { p.as_ref() }.ok_or_else(|| inval(&format!("{what} is NULL")))
}

/// # Safety
/// `out` is NULL or valid for a write of `T`.
unsafe fn out<T>(out: *mut T, v: T) -> Result<(), Fail> {
    if out.is_null() {
        return Err(inval("output pointer is NULL"));
    }
    // SAFETY: not NULL; valid by the caller's contract.
    unsafe { out.write(v) };
    Ok(())
}

/// The last error of the calling thread, as text (valid until its next
/// failing call); empty if none.
#[no_mangle]
pub extern "C" fn metaroce_last_error() -> *const c_char {
    LAST_ERROR.with(|e| e.borrow().as_ptr())
}

/// Opens a device listening on `listen` (`"IP:PORT"`, port 0 for any).
///
/// # Safety
/// `listen` is a NUL-terminated string; `dev` is valid for a write.
#[no_mangle]
pub unsafe extern "C" fn metaroce_device_open(
    listen: *const c_char,
    dev: *mut *mut MetaroceDevice,
) -> c_int {
    run(|| {
        if listen.is_null() {
            return Err(inval("listen is NULL"));
        }
        // SAFETY: a NUL-terminated string, by the contract.
        let s = unsafe { CStr::from_ptr(listen) }.to_string_lossy();
        let addr = s.parse().map_err(|e| inval(&format!("{s}: {e}")))?;
        let d = block_on(Device::open(DriverConfig::new(addr)))?;
        // SAFETY: valid for a write, by the contract.
        unsafe { out(dev, Box::into_raw(Box::new(MetaroceDevice(d)))) }
    })
}

/// Writes the device's `IP:PORT` (NUL-terminated) into `buf` of `len` bytes.
///
/// # Safety
/// `dev` is a live device; `buf` is valid for `len` bytes.
#[no_mangle]
pub unsafe extern "C" fn metaroce_device_local_addr(
    dev: *const MetaroceDevice,
    buf: *mut c_char,
    len: usize,
) -> c_int {
    run(|| {
        // SAFETY: by the contract.
        let d = unsafe { obj(dev, "dev")? };
        let s = d.0.local_addr().to_string();
        if buf.is_null() || len <= s.len() {
            return Err(inval("buffer too small"));
        }
        // SAFETY: `buf` holds `len` > s.len() bytes, by the contract.
        unsafe {
            std::ptr::copy_nonoverlapping(s.as_ptr(), buf as *mut u8, s.len());
            buf.add(s.len()).write(0);
        }
        Ok(())
    })
}

/// Closes the device handle (the endpoint stops once every object made
/// from it is freed too).
///
/// # Safety
/// `dev` is NULL or a live device, not used after.
#[no_mangle]
pub unsafe extern "C" fn metaroce_device_close(dev: *mut MetaroceDevice) {
    if !dev.is_null() {
        // SAFETY: by the contract: made by Box::into_raw, freed once.
        drop(unsafe { Box::from_raw(dev) });
    }
}

/// Connects to the device listening at `peer` (`"IP:PORT"`), waiting for
/// the handshake.
///
/// # Safety
/// `dev` is a live device, `peer` a NUL-terminated string, `conn` valid for a write.
#[no_mangle]
pub unsafe extern "C" fn metaroce_connect(
    dev: *const MetaroceDevice,
    peer: *const c_char,
    conn: *mut *mut MetaroceConn,
) -> c_int {
    run(|| {
        // SAFETY: by the contract.
        let d = unsafe { obj(dev, "dev")? };
        if peer.is_null() {
            return Err(inval("peer is NULL"));
        }
        // SAFETY: a NUL-terminated string, by the contract.
        let s = unsafe { CStr::from_ptr(peer) }.to_string_lossy();
        let addr = s.parse().map_err(|e| inval(&format!("{s}: {e}")))?;
        let c = block_on(d.0.connect(addr))?;
        // SAFETY: valid for a write, by the contract.
        unsafe { out(conn, Box::into_raw(Box::new(MetaroceConn(c)))) }
    })
}

/// Waits for the next connection a peer opens to `dev`.
///
/// # Safety
/// `dev` is a live device, `conn` valid for a write.
#[no_mangle]
pub unsafe extern "C" fn metaroce_accept(
    dev: *const MetaroceDevice,
    conn: *mut *mut MetaroceConn,
) -> c_int {
    run(|| {
        // SAFETY: by the contract.
        let d = unsafe { obj(dev, "dev")? };
        let c = block_on(d.0.accept())?;
        // SAFETY: valid for a write, by the contract.
        unsafe { out(conn, Box::into_raw(Box::new(MetaroceConn(c)))) }
    })
}

/// Frees a connection handle (the connection stays while QPs use it).
///
/// # Safety
/// `conn` is NULL or live, not used after.
#[no_mangle]
pub unsafe extern "C" fn metaroce_conn_free(conn: *mut MetaroceConn) {
    if !conn.is_null() {
        // SAFETY: made by Box::into_raw, freed once.
        drop(unsafe { Box::from_raw(conn) });
    }
}

/// Allocates a protection domain.
///
/// # Safety
/// `dev` is a live device, `pd` valid for a write.
#[no_mangle]
pub unsafe extern "C" fn metaroce_pd_alloc(
    dev: *const MetaroceDevice,
    pd: *mut *mut MetarocePd,
) -> c_int {
    run(|| {
        // SAFETY: by the contract.
        let d = unsafe { obj(dev, "dev")? };
        let p = block_on(d.0.alloc_pd())?;
        // SAFETY: valid for a write, by the contract.
        unsafe { out(pd, Box::into_raw(Box::new(MetarocePd(p)))) }
    })
}

/// Frees a protection domain.
///
/// # Safety
/// `pd` is NULL or live, not used after.
#[no_mangle]
pub unsafe extern "C" fn metaroce_pd_free(pd: *mut MetarocePd) {
    if !pd.is_null() {
        // SAFETY: made by Box::into_raw, freed once.
        drop(unsafe { Box::from_raw(pd) });
    }
}

/// Creates a completion queue of `capacity` entries.
///
/// # Safety
/// `dev` is a live device, `cq` valid for a write.
#[no_mangle]
pub unsafe extern "C" fn metaroce_cq_create(
    dev: *const MetaroceDevice,
    capacity: u32,
    cq: *mut *mut MetaroceCq,
) -> c_int {
    run(|| {
        // SAFETY: by the contract.
        let d = unsafe { obj(dev, "dev")? };
        let q = block_on(d.0.create_cq(capacity as usize))?;
        // SAFETY: valid for a write, by the contract.
        unsafe { out(cq, Box::into_raw(Box::new(MetaroceCq(q)))) }
    })
}

/// Frees a completion queue.
///
/// # Safety
/// `cq` is NULL or live, not used after.
#[no_mangle]
pub unsafe extern "C" fn metaroce_cq_free(cq: *mut MetaroceCq) {
    if !cq.is_null() {
        // SAFETY: made by Box::into_raw, freed once.
        drop(unsafe { Box::from_raw(cq) });
    }
}

/// Takes up to `max` completions that are in, without waiting; returns how
/// many (≥ 0) or an error code.
///
/// # Safety
/// `cq` is live; `wcs` is valid for `max` entries.
#[no_mangle]
pub unsafe extern "C" fn metaroce_poll_cq(
    cq: *const MetaroceCq,
    wcs: *mut MetaroceWc,
    max: c_int,
) -> c_int {
    let mut n = 0;
    let rc = run(|| {
        // SAFETY: by the contract.
        let q = unsafe { obj(cq, "cq")? };
        if wcs.is_null() || max < 0 {
            return Err(inval("wcs is NULL or max negative"));
        }
        for (i, wc) in q.0.poll(max as usize).into_iter().enumerate() {
            let c = MetaroceWc {
                wr_id: wc.wr_id,
                status: match wc.status {
                    WcStatus::Success => 0,
                    WcStatus::LocalLengthError => 1,
                    WcStatus::LocalProtectionError => 2,
                    WcStatus::RemoteAccessError => 3,
                    WcStatus::RemoteInvalidRequest => 4,
                    WcStatus::RemoteOperationError => 5,
                    WcStatus::RetryExceeded => 6,
                    WcStatus::RnrRetryExceeded => 7,
                    _ => 8,
                },
                opcode: match wc.opcode {
                    WcOpcode::Send => METAROCE_WC_SEND,
                    WcOpcode::Write => METAROCE_WC_WRITE,
                    WcOpcode::Read => METAROCE_WC_READ,
                    WcOpcode::Recv => METAROCE_WC_RECV,
                    _ => METAROCE_WC_RECV_RDMA_WITH_IMM,
                },
                byte_len: wc.byte_len,
                has_imm: u32::from(wc.imm.is_some()),
                imm: wc.imm.unwrap_or(0),
                qpn: wc.qpn.0,
            };
            // SAFETY: i < max entries, by the contract.
            unsafe { wcs.add(i).write(c) };
            n += 1;
        }
        Ok(())
    });
    if rc == METAROCE_OK {
        n
    } else {
        rc
    }
}

/// Creates an RC queue pair (1024 send and 1024 receive requests).
///
/// # Safety
/// `pd`, `send_cq`, `recv_cq` are live and of one device; `qp` valid for a write.
#[no_mangle]
pub unsafe extern "C" fn metaroce_qp_create(
    pd: *const MetarocePd,
    send_cq: *const MetaroceCq,
    recv_cq: *const MetaroceCq,
    qp: *mut *mut MetaroceQp,
) -> c_int {
    run(|| {
        // SAFETY: by the contract.
        let (p, s, r) = unsafe {
            (
                obj(pd, "pd")?,
                obj(send_cq, "send_cq")?,
                obj(recv_cq, "recv_cq")?,
            )
        };
        let q = block_on(p.0.create_qp(&s.0, &r.0))?;
        // SAFETY: valid for a write, by the contract.
        unsafe { out(qp, Box::into_raw(Box::new(MetaroceQp(q)))) }
    })
}

/// The QP's number, for the peer's [`metaroce_qp_connect`] (0 for NULL).
///
/// # Safety
/// `qp` is NULL or live.
#[no_mangle]
pub unsafe extern "C" fn metaroce_qp_num(qp: *const MetaroceQp) -> u32 {
    // SAFETY: by the contract.
    unsafe { qp.as_ref() }.map_or(0, |q| q.0.qpn().0)
}

/// Binds the QP to `conn` and the peer's QP `remote_qpn` and brings it to RTS.
///
/// # Safety
/// `qp` and `conn` are live and of one device.
#[no_mangle]
pub unsafe extern "C" fn metaroce_qp_connect(
    qp: *const MetaroceQp,
    conn: *const MetaroceConn,
    remote_qpn: u32,
) -> c_int {
    run(|| {
        // SAFETY: by the contract.
        let (q, c) = unsafe { (obj(qp, "qp")?, obj(conn, "conn")?) };
        Ok(block_on(q.0.connect(&c.0, metaroce_io::Qpn(remote_qpn)))?)
    })
}

/// Destroys a queue pair.
///
/// # Safety
/// `qp` is NULL or live, not used after.
#[no_mangle]
pub unsafe extern "C" fn metaroce_qp_free(qp: *mut MetaroceQp) {
    if !qp.is_null() {
        // SAFETY: made by Box::into_raw, freed once.
        drop(unsafe { Box::from_raw(qp) });
    }
}

/// Registers a zeroed region of `len` bytes with `access`
/// (`METAROCE_ACCESS_*` bits).
///
/// # Safety
/// `pd` is live; `mr` valid for a write.
#[no_mangle]
pub unsafe extern "C" fn metaroce_mr_reg(
    pd: *const MetarocePd,
    len: usize,
    access: u32,
    mr: *mut *mut MetaroceMr,
) -> c_int {
    run(|| {
        // SAFETY: by the contract.
        let p = unsafe { obj(pd, "pd")? };
        if access & !7 != 0 {
            return Err(inval("unknown access bits"));
        }
        let mut flags = AccessFlags::NONE;
        for (bit, f) in [
            (METAROCE_ACCESS_LOCAL_WRITE, AccessFlags::LOCAL_WRITE),
            (METAROCE_ACCESS_REMOTE_WRITE, AccessFlags::REMOTE_WRITE),
            (METAROCE_ACCESS_REMOTE_READ, AccessFlags::REMOTE_READ),
        ] {
            if access & bit != 0 {
                flags = flags | f;
            }
        }
        let m = block_on(p.0.reg_mr(RegionBuf::zeroed(len), flags))?;
        // SAFETY: valid for a write, by the contract.
        unsafe { out(mr, Box::into_raw(Box::new(MetaroceMr(m)))) }
    })
}

/// Fills `sge` with `len` bytes at `offset` of the region.
///
/// # Safety
/// `mr` is live; `sge` valid for a write.
#[no_mangle]
pub unsafe extern "C" fn metaroce_mr_sge(
    mr: *const MetaroceMr,
    offset: u64,
    len: u32,
    sge: *mut MetaroceSge,
) -> c_int {
    run(|| {
        // SAFETY: by the contract.
        let m = unsafe { obj(mr, "mr")? };
        let s = m.0.sge(offset, len)?;
        // SAFETY: valid for a write, by the contract.
        unsafe {
            out(
                sge,
                MetaroceSge {
                    lkey: s.lkey,
                    len: s.len,
                    addr: s.addr,
                },
            )
        }
    })
}

/// What a peer needs to WRITE to or READ from the region.
///
/// # Safety
/// `mr` is live; `remote` valid for a write.
#[no_mangle]
pub unsafe extern "C" fn metaroce_mr_remote(
    mr: *const MetaroceMr,
    remote: *mut MetaroceRemote,
) -> c_int {
    run(|| {
        // SAFETY: by the contract.
        let m = unsafe { obj(mr, "mr")? };
        let r = m.0.remote();
        // SAFETY: valid for a write, by the contract.
        unsafe {
            out(
                remote,
                MetaroceRemote {
                    rkey: r.rkey,
                    reserved: 0,
                    addr: r.addr,
                    len: r.len,
                },
            )
        }
    })
}

/// Copies `len` bytes of `data` into the region at `offset`, in order with
/// the requests posted after it.
///
/// # Safety
/// `mr` is live; `data` valid for `len` bytes.
#[no_mangle]
pub unsafe extern "C" fn metaroce_mr_write(
    mr: *const MetaroceMr,
    offset: u64,
    data: *const u8,
    len: usize,
) -> c_int {
    run(|| {
        // SAFETY: by the contract.
        let m = unsafe { obj(mr, "mr")? };
        if data.is_null() && len > 0 {
            return Err(inval("data is NULL"));
        }
        let bytes = if len == 0 {
            Vec::new()
        } else {
            // SAFETY: `len` readable bytes at `data`, by the contract.
            unsafe { std::slice::from_raw_parts(data, len) }.to_vec()
        };
        Ok(block_on(m.0.write(offset, bytes))?)
    })
}

/// Copies `len` bytes of the region at `offset` into `data`.
///
/// # Safety
/// `mr` is live; `data` valid for `len` bytes.
#[no_mangle]
pub unsafe extern "C" fn metaroce_mr_read(
    mr: *const MetaroceMr,
    offset: u64,
    data: *mut u8,
    len: usize,
) -> c_int {
    run(|| {
        // SAFETY: by the contract.
        let m = unsafe { obj(mr, "mr")? };
        if data.is_null() && len > 0 {
            return Err(inval("data is NULL"));
        }
        let bytes = block_on(m.0.read(offset, len))?;
        // SAFETY: `len` writable bytes at `data`, by the contract.
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), data, bytes.len().min(len)) };
        Ok(())
    })
}

/// Deregisters a region.
///
/// # Safety
/// `mr` is NULL or live, not used after.
#[no_mangle]
pub unsafe extern "C" fn metaroce_mr_free(mr: *mut MetaroceMr) {
    if !mr.is_null() {
        // SAFETY: made by Box::into_raw, freed once.
        drop(unsafe { Box::from_raw(mr) });
    }
}

/// Posts a send request (`METAROCE_OP_*`; `remote` for WRITE and READ, else
/// NULL; `imm` for the `_IMM` ops); it completes in the QP's send CQ.
///
/// # Safety
/// `qp` is live; `sge` valid; `remote` NULL or valid.
#[no_mangle]
pub unsafe extern "C" fn metaroce_post_send(
    qp: *const MetaroceQp,
    wr_id: u64,
    opcode: u32,
    sge: *const MetaroceSge,
    remote: *const MetaroceRemote,
    imm: u32,
) -> c_int {
    run(|| {
        // SAFETY: by the contract.
        let (q, s) = unsafe { (obj(qp, "qp")?, obj(sge, "sge")?) };
        // SAFETY: by the contract.
        let remote = unsafe { remote.as_ref() }.map(|r| RemoteAddr {
            rkey: r.rkey,
            addr: r.addr,
        });
        let need = || remote.ok_or_else(|| inval("this opcode needs a remote address"));
        let op = match opcode {
            METAROCE_OP_SEND => SendOp::Send,
            METAROCE_OP_SEND_IMM => SendOp::SendImm(imm),
            METAROCE_OP_WRITE => SendOp::Write(need()?),
            METAROCE_OP_WRITE_IMM => SendOp::WriteImm(need()?, imm),
            METAROCE_OP_READ => SendOp::Read(need()?),
            _ => return Err(inval("unknown opcode")),
        };
        let local = Sge {
            lkey: s.lkey,
            addr: s.addr,
            len: s.len,
        };
        Ok(block_on(q.0.post_send(SendWr::new(wr_id, op, local)))?)
    })
}

/// Posts a receive into `sge`; it completes in the QP's receive CQ.
///
/// # Safety
/// `qp` is live; `sge` valid.
#[no_mangle]
pub unsafe extern "C" fn metaroce_post_recv(
    qp: *const MetaroceQp,
    wr_id: u64,
    sge: *const MetaroceSge,
) -> c_int {
    run(|| {
        // SAFETY: by the contract.
        let (q, s) = unsafe { (obj(qp, "qp")?, obj(sge, "sge")?) };
        let sge = Sge {
            lkey: s.lkey,
            addr: s.addr,
            len: s.len,
        };
        Ok(block_on(q.0.post_recv(RecvWr::new(wr_id, sge)))?)
    })
}
