//! The exported symbols: one table per ABI version NCCL may look up
//! (`ncclNetPlugin_v8` … `ncclNetPlugin_v12`), all calling the one
//! implementation in [`crate::net`]. Every entry catches panics and turns
//! errors into NCCL result codes, with a warning through NCCL's logger.

#![allow(non_upper_case_globals)]

use crate::abi::*;
use crate::error::NetError;
use crate::memory::AppRegion;
use crate::net::{self, ListenComm, RecvComm, Request, SendComm, MAX_MESSAGE, MAX_RECVS};
use std::ffi::{c_int, c_void};
use std::panic::{catch_unwind, AssertUnwindSafe};

const NAME: &std::ffi::CStr = c"metaroce";

/// Runs one plugin call: its result code, its error logged.
fn ffi(what: &str, f: impl FnOnce() -> Result<(), NetError>) -> NcclResult {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => NCCL_SUCCESS,
        Ok(Err(e)) => {
            crate::log::warn(line!(), &format!("{what}: {e}"));
            e.code()
        }
        Err(_) => {
            crate::log::warn(line!(), &format!("{what}: panicked"));
            NCCL_INTERNAL_ERROR
        }
    }
}

fn null_arg(what: &str) -> NetError {
    NetError::InvalidArgument(format!("{what} is NULL"))
}

/// Writes `v` through `out`, which must not be NULL.
///
/// # Safety
/// `out` is NULL or valid for a write of `T`.
unsafe fn put<T>(out: *mut T, v: T, what: &str) -> Result<(), NetError> {
    if out.is_null() {
        return Err(null_arg(what));
    }
    // SAFETY: not NULL, and valid for writes by the caller's contract.
    unsafe { out.write(v) };
    Ok(())
}

fn init(logger: NcclDebugLogger) -> NcclResult {
    crate::log::set_logger(logger);
    ffi("init", || net::init().map(|_| ()))
}

unsafe extern "C" fn devices(ndev: *mut c_int) -> NcclResult {
    ffi("devices", || {
        let n = net::plugin()?.cfg.devices.len() as c_int;
        // SAFETY: NCCL passes a pointer to an int.
        unsafe { put(ndev, n, "ndev") }
    })
}

/// What every version's properties say, for device `dev`.
struct Props {
    name: *mut std::ffi::c_char,
    speed: c_int,
    guid: u64,
}

fn props(dev: c_int) -> Result<Props, NetError> {
    let p = net::plugin()?;
    let i = usize::try_from(dev)
        .ok()
        .filter(|&i| i < p.names.len())
        .ok_or_else(|| NetError::InvalidArgument(format!("no device {dev}")))?;
    Ok(Props {
        name: p.names[i].as_ptr() as *mut _,
        speed: p.cfg.speed_mbps,
        guid: i as u64,
    })
}

fn props_v8(dev: c_int) -> Result<NetPropertiesV8, NetError> {
    let p = props(dev)?;
    Ok(NetPropertiesV8 {
        name: p.name,
        pci_path: std::ptr::null_mut(),
        guid: p.guid,
        ptr_support: NCCL_PTR_HOST,
        reg_is_global: 0,
        speed: p.speed,
        port: 0,
        latency: 0.0,
        max_comms: 65536,
        max_recvs: MAX_RECVS as c_int,
        net_device_type: NCCL_NET_DEVICE_HOST,
        net_device_version: NCCL_NET_DEVICE_INVALID_VERSION,
    })
}

fn props_v9(dev: c_int) -> Result<NetPropertiesV9, NetError> {
    let p = props_v8(dev)?;
    let mut devs = [0; NCCL_NET_MAX_DEVS_PER_NIC_V9];
    devs[0] = dev;
    Ok(NetPropertiesV9 {
        name: p.name,
        pci_path: p.pci_path,
        guid: p.guid,
        ptr_support: p.ptr_support,
        reg_is_global: p.reg_is_global,
        force_flush: 0,
        speed: p.speed,
        port: p.port,
        latency: p.latency,
        max_comms: p.max_comms,
        max_recvs: p.max_recvs,
        net_device_type: p.net_device_type,
        net_device_version: p.net_device_version,
        v_props: NetVDeviceProps { ndevs: 1, devs },
        max_p2p_bytes: MAX_MESSAGE,
        max_coll_bytes: MAX_MESSAGE,
    })
}

fn props_v12(dev: c_int) -> Result<NetPropertiesV12, NetError> {
    let p = props_v9(dev)?;
    let mut devs = [0; NCCL_NET_MAX_DEVS_PER_NIC_V12];
    devs[0] = dev;
    Ok(NetPropertiesV12 {
        name: p.name,
        pci_path: p.pci_path,
        guid: p.guid,
        ptr_support: p.ptr_support,
        reg_is_global: p.reg_is_global,
        force_flush: p.force_flush,
        speed: p.speed,
        port: p.port,
        latency: p.latency,
        max_comms: p.max_comms,
        max_recvs: p.max_recvs,
        net_device_type: p.net_device_type,
        net_device_version: p.net_device_version,
        v_props: NetVDeviceProps { ndevs: 1, devs },
        max_p2p_bytes: p.max_p2p_bytes,
        max_coll_bytes: p.max_coll_bytes,
        max_multi_request_size: 1,
        rail_id: -1,
        plane_id: -1,
    })
}

/// # Safety
/// `handle` points to `NCCL_NET_HANDLE_MAXSIZE` writable bytes (or is NULL).
unsafe fn handle_mut<'a>(
    handle: *mut c_void,
) -> Result<&'a mut [u8; NCCL_NET_HANDLE_MAXSIZE], NetError> {
    if handle.is_null() {
        return Err(null_arg("handle"));
    }
    // SAFETY: by the caller's contract, NCCL's handle buffer.
    Ok(unsafe { &mut *(handle as *mut [u8; NCCL_NET_HANDLE_MAXSIZE]) })
}

unsafe fn listen(dev: c_int, handle: *mut c_void, listen_comm: *mut *mut c_void) -> NcclResult {
    ffi("listen", || {
        // SAFETY: NCCL's handle buffer.
        let h = unsafe { handle_mut(handle)? };
        let l = net::listen(dev, h)?;
        // SAFETY: NCCL passes where the comm goes.
        unsafe { put(listen_comm, Box::into_raw(l) as *mut c_void, "listenComm") }
    })
}

unsafe fn connect(
    dev: c_int,
    handle: *mut c_void,
    send_comm: *mut *mut c_void,
    dev_comm: *mut *mut NetDeviceHandle,
) -> NcclResult {
    ffi("connect", || {
        // SAFETY: NCCL's handle buffer.
        let h = unsafe { handle_mut(handle)? };
        let c = net::connect(dev, h)?;
        let ptr = c.map_or(std::ptr::null_mut(), |c| Box::into_raw(c) as *mut c_void);
        if !dev_comm.is_null() {
            // SAFETY: not NULL: where a device handle would go; none here.
            unsafe { dev_comm.write(std::ptr::null_mut()) };
        }
        // SAFETY: NCCL passes where the comm goes.
        unsafe { put(send_comm, ptr, "sendComm") }
    })
}

unsafe extern "C" fn accept(
    listen_comm: *mut c_void,
    recv_comm: *mut *mut c_void,
    dev_comm: *mut *mut NetDeviceHandle,
) -> NcclResult {
    ffi("accept", || {
        if listen_comm.is_null() {
            return Err(null_arg("listenComm"));
        }
        // SAFETY: a listen comm `listen` made and NCCL has not closed.
        let l = unsafe { &mut *(listen_comm as *mut ListenComm) };
        let c = net::accept(l)?;
        let ptr = c.map_or(std::ptr::null_mut(), |c| Box::into_raw(c) as *mut c_void);
        if !dev_comm.is_null() {
            // SAFETY: not NULL: where a device handle would go; none here.
            unsafe { dev_comm.write(std::ptr::null_mut()) };
        }
        // SAFETY: NCCL passes where the comm goes.
        unsafe { put(recv_comm, ptr, "recvComm") }
    })
}

unsafe extern "C" fn reg_mr(
    comm: *mut c_void,
    data: *mut c_void,
    size: usize,
    kind: c_int,
    mhandle: *mut *mut c_void,
) -> NcclResult {
    ffi("regMr", || {
        if kind != NCCL_PTR_HOST {
            return Err(NetError::InvalidArgument(format!(
                "regMr of memory type {kind}: only host memory (NCCL_PTR_HOST)"
            )));
        }
        if comm.is_null() {
            return Err(null_arg("comm"));
        }
        // SAFETY: a send or receive comm NCCL has not closed.
        let head = unsafe { net::comm_head(comm) };
        // SAFETY: NCCL's buffer, registered under NCCL's contract: valid
        // until deregMr returned, untouched by NCCL while requests on it
        // are outstanding (see `memory`).
        let r = Box::new(unsafe { head.reg_mr(data as *mut u8, size)? });
        // SAFETY: NCCL passes where the handle goes.
        unsafe { put(mhandle, Box::into_raw(r) as *mut c_void, "mhandle") }
    })
}

unsafe extern "C" fn dereg_mr(_comm: *mut c_void, mhandle: *mut c_void) -> NcclResult {
    ffi("deregMr", || {
        if mhandle.is_null() {
            return Ok(());
        }
        // SAFETY: a handle regMr made, deregistered once.
        let r = unsafe { Box::from_raw(mhandle as *mut AppRegion) };
        // Returns once the endpoint no longer reaches the memory.
        r.dereg()
    })
}

/// The region of a transfer of `size` bytes (a zero-byte one may come
/// without a handle).
///
/// # Safety
/// `mhandle` is NULL or a handle `regMr` made and not yet deregistered.
unsafe fn region<'a>(mhandle: *mut c_void, size: usize) -> Result<&'a AppRegion, NetError> {
    if mhandle.is_null() {
        if size == 0 {
            return Ok(&AppRegion::EMPTY);
        }
        return Err(null_arg("mhandle"));
    }
    // SAFETY: by the caller's contract.
    Ok(unsafe { &*(mhandle as *const AppRegion) })
}

unsafe fn isend(
    send_comm: *mut c_void,
    data: *mut c_void,
    size: usize,
    tag: c_int,
    mhandle: *mut c_void,
    request: *mut *mut c_void,
) -> NcclResult {
    ffi("isend", || {
        if send_comm.is_null() {
            return Err(null_arg("sendComm"));
        }
        // SAFETY: a send comm `connect` made and NCCL has not closed.
        let c = unsafe { &mut *(send_comm as *mut SendComm) };
        // SAFETY: NCCL's registered handle.
        let mr = unsafe { region(mhandle, size)? };
        let r = c.isend(data as *const u8, size, tag, mr)?;
        let ptr = r.map_or(std::ptr::null_mut(), |r| Box::into_raw(r) as *mut c_void);
        // SAFETY: NCCL passes where the request goes.
        unsafe { put(request, ptr, "request") }
    })
}

unsafe fn irecv(
    recv_comm: *mut c_void,
    n: c_int,
    data: *mut *mut c_void,
    size: impl Fn(usize) -> usize,
    tags: *mut c_int,
    mhandles: *mut *mut c_void,
    request: *mut *mut c_void,
) -> NcclResult {
    ffi("irecv", || {
        if recv_comm.is_null() || data.is_null() || tags.is_null() || mhandles.is_null() {
            return Err(null_arg("recvComm, data, tags or mhandles"));
        }
        let n = usize::try_from(n).unwrap_or(0).min(MAX_RECVS + 1);
        // SAFETY: a receive comm `accept` made and NCCL has not closed.
        let c = unsafe { &mut *(recv_comm as *mut RecvComm) };
        let mut bufs = smallvec::SmallVec::<[_; MAX_RECVS]>::new();
        for i in 0..n {
            // SAFETY: NCCL passes arrays of `n` entries.
            let (ptr, tag, mh) = unsafe { (*data.add(i), *tags.add(i), *mhandles.add(i)) };
            let len = size(i);
            // SAFETY: NCCL's registered handle.
            let mr = unsafe { region(mh, len)? };
            bufs.push((ptr as *mut u8, len, tag, mr));
        }
        let r = c.irecv(&bufs)?;
        let ptr = r.map_or(std::ptr::null_mut(), |r| Box::into_raw(r) as *mut c_void);
        // SAFETY: NCCL passes where the request goes.
        unsafe { put(request, ptr, "request") }
    })
}

unsafe extern "C" fn iflush(
    _recv_comm: *mut c_void,
    _n: c_int,
    _data: *mut *mut c_void,
    _sizes: *mut c_int,
    _mhandles: *mut *mut c_void,
    request: *mut *mut c_void,
) -> NcclResult {
    // Host memory only: a received message is in place once `test` says so,
    // so there is nothing to flush (a NULL request).
    ffi("iflush", || {
        // SAFETY: NCCL passes where the request goes.
        unsafe { put(request, std::ptr::null_mut(), "request") }
    })
}

unsafe extern "C" fn test(request: *mut c_void, done: *mut c_int, sizes: *mut c_int) -> NcclResult {
    ffi("test", || {
        if request.is_null() {
            return Err(null_arg("request"));
        }
        // SAFETY: a request isend/irecv made that has not completed yet.
        let r = unsafe { &mut *(request as *mut Request) };
        let result = r.test();
        let finished = match &result {
            Ok(Some(_)) | Err(_) => true,
            Ok(None) => false,
        };
        if let Ok(Some(got)) = &result {
            if !sizes.is_null() {
                for (i, &s) in got.iter().enumerate() {
                    // SAFETY: NCCL passes room for one size per buffer.
                    unsafe { sizes.add(i).write(s as c_int) };
                }
            }
        }
        if finished {
            // SAFETY: done (or failed): NCCL does not use it again.
            drop(unsafe { Box::from_raw(request as *mut Request) });
        }
        // SAFETY: NCCL passes where `done` goes.
        unsafe { put(done, c_int::from(finished && result.is_ok()), "done")? };
        result.map(|_| ())
    })
}

unsafe extern "C" fn close_send(comm: *mut c_void) -> NcclResult {
    ffi("closeSend", || {
        if !comm.is_null() {
            // SAFETY: a send comm `connect` made, closed once. Its QP goes;
            // the connection stays for the device's other comms.
            let c = unsafe { Box::from_raw(comm as *mut SendComm) };
            c.log_close();
            let dev = c.device();
            drop(c);
            // What the QP's end owes the peer (its last progress) goes now:
            // the process may exit before the endpoint thread would look.
            dev.progress();
        }
        Ok(())
    })
}

unsafe extern "C" fn close_recv(comm: *mut c_void) -> NcclResult {
    ffi("closeRecv", || {
        if !comm.is_null() {
            // SAFETY: a receive comm `accept` made, closed once.
            let c = unsafe { Box::from_raw(comm as *mut RecvComm) };
            let dev = c.device();
            drop(c);
            // As in `closeSend`.
            dev.progress();
        }
        Ok(())
    })
}

unsafe extern "C" fn close_listen(comm: *mut c_void) -> NcclResult {
    ffi("closeListen", || {
        if !comm.is_null() {
            // SAFETY: a listen comm `listen` made, closed once.
            drop(unsafe { Box::from_raw(comm as *mut ListenComm) });
        }
        Ok(())
    })
}

// ---- v8 ----

unsafe extern "C" fn v8_init(logger: NcclDebugLogger) -> NcclResult {
    init(logger)
}

unsafe extern "C" fn v8_get_properties(dev: c_int, out: *mut NetPropertiesV8) -> NcclResult {
    // SAFETY: NCCL passes a properties struct of this version.
    ffi("getProperties", || unsafe {
        put(out, props_v8(dev)?, "props")
    })
}

unsafe extern "C" fn v8_listen(dev: c_int, handle: *mut c_void, l: *mut *mut c_void) -> NcclResult {
    // SAFETY: NCCL's arguments, passed on.
    unsafe { listen(dev, handle, l) }
}

unsafe extern "C" fn v8_connect(
    dev: c_int,
    handle: *mut c_void,
    s: *mut *mut c_void,
    d: *mut *mut NetDeviceHandle,
) -> NcclResult {
    // SAFETY: NCCL's arguments, passed on.
    unsafe { connect(dev, handle, s, d) }
}

unsafe extern "C" fn v8_isend(
    c: *mut c_void,
    data: *mut c_void,
    size: c_int,
    tag: c_int,
    mh: *mut c_void,
    req: *mut *mut c_void,
) -> NcclResult {
    let size = usize::try_from(size).unwrap_or(usize::MAX);
    // SAFETY: NCCL's arguments, passed on.
    unsafe { isend(c, data, size, tag, mh, req) }
}

unsafe extern "C" fn v8_irecv(
    c: *mut c_void,
    n: c_int,
    data: *mut *mut c_void,
    sizes: *mut c_int,
    tags: *mut c_int,
    mh: *mut *mut c_void,
    req: *mut *mut c_void,
) -> NcclResult {
    if sizes.is_null() {
        return NCCL_INVALID_ARGUMENT;
    }
    // SAFETY: NCCL passes `n` sizes (irecv reads indices below n only).
    let size = |i: usize| usize::try_from(unsafe { *sizes.add(i) }).unwrap_or(usize::MAX);
    // SAFETY: NCCL's arguments, passed on.
    unsafe { irecv(c, n, data, size, tags, mh, req) }
}

/// The v8 table (`ncclNet_v8_t`).
#[no_mangle]
pub static ncclNetPlugin_v8: NetV8 = NetV8 {
    name: NAME.as_ptr(),
    init: Some(v8_init),
    devices: Some(devices),
    get_properties: Some(v8_get_properties),
    listen: Some(v8_listen),
    connect: Some(v8_connect),
    accept: Some(accept),
    reg_mr: Some(reg_mr),
    reg_mr_dma_buf: None,
    dereg_mr: Some(dereg_mr),
    isend: Some(v8_isend),
    irecv: Some(v8_irecv),
    iflush: Some(iflush),
    test: Some(test),
    close_send: Some(close_send),
    close_recv: Some(close_recv),
    close_listen: Some(close_listen),
    get_device_mr: None,
    irecv_consumed: None,
};

// ---- v9 (size_t sizes) ----

unsafe extern "C" fn v9_get_properties(dev: c_int, out: *mut NetPropertiesV9) -> NcclResult {
    // SAFETY: NCCL passes a properties struct of this version.
    ffi("getProperties", || unsafe {
        put(out, props_v9(dev)?, "props")
    })
}

unsafe extern "C" fn v9_isend(
    c: *mut c_void,
    data: *mut c_void,
    size: usize,
    tag: c_int,
    mh: *mut c_void,
    req: *mut *mut c_void,
) -> NcclResult {
    // SAFETY: NCCL's arguments, passed on.
    unsafe { isend(c, data, size, tag, mh, req) }
}

unsafe extern "C" fn v9_irecv(
    c: *mut c_void,
    n: c_int,
    data: *mut *mut c_void,
    sizes: *mut usize,
    tags: *mut c_int,
    mh: *mut *mut c_void,
    req: *mut *mut c_void,
) -> NcclResult {
    if sizes.is_null() {
        return NCCL_INVALID_ARGUMENT;
    }
    // SAFETY: NCCL passes `n` sizes (irecv reads indices below n only).
    let size = |i: usize| unsafe { *sizes.add(i) };
    // SAFETY: NCCL's arguments, passed on.
    unsafe { irecv(c, n, data, size, tags, mh, req) }
}

/// The v9 table (`ncclNet_v9_t`).
#[no_mangle]
pub static ncclNetPlugin_v9: NetV9 = NetV9 {
    name: NAME.as_ptr(),
    init: Some(v8_init),
    devices: Some(devices),
    get_properties: Some(v9_get_properties),
    listen: Some(v8_listen),
    connect: Some(v8_connect),
    accept: Some(accept),
    reg_mr: Some(reg_mr),
    reg_mr_dma_buf: None,
    dereg_mr: Some(dereg_mr),
    isend: Some(v9_isend),
    irecv: Some(v9_irecv),
    iflush: Some(iflush),
    test: Some(test),
    close_send: Some(close_send),
    close_recv: Some(close_recv),
    close_listen: Some(close_listen),
    get_device_mr: None,
    irecv_consumed: None,
    make_vdevice: None,
};

// ---- v10 (profiler, comm config) ----

unsafe extern "C" fn v10_init(logger: NcclDebugLogger, _prof: NcclProfilerCallback) -> NcclResult {
    init(logger)
}

unsafe extern "C" fn v10_connect(
    dev: c_int,
    _config: *mut NetCommConfig,
    handle: *mut c_void,
    s: *mut *mut c_void,
    d: *mut *mut NetDeviceHandle,
) -> NcclResult {
    // SAFETY: NCCL's arguments, passed on.
    unsafe { connect(dev, handle, s, d) }
}

unsafe extern "C" fn v10_isend(
    c: *mut c_void,
    data: *mut c_void,
    size: usize,
    tag: c_int,
    mh: *mut c_void,
    _phandle: *mut c_void,
    req: *mut *mut c_void,
) -> NcclResult {
    // SAFETY: NCCL's arguments, passed on.
    unsafe { isend(c, data, size, tag, mh, req) }
}

unsafe extern "C" fn v10_irecv(
    c: *mut c_void,
    n: c_int,
    data: *mut *mut c_void,
    sizes: *mut usize,
    tags: *mut c_int,
    mh: *mut *mut c_void,
    _phandles: *mut *mut c_void,
    req: *mut *mut c_void,
) -> NcclResult {
    // SAFETY: NCCL's arguments, passed on.
    unsafe { v9_irecv(c, n, data, sizes, tags, mh, req) }
}

/// The v10 table (`ncclNet_v10_t`).
#[no_mangle]
pub static ncclNetPlugin_v10: NetV10 = NetV10 {
    name: NAME.as_ptr(),
    init: Some(v10_init),
    devices: Some(devices),
    get_properties: Some(v9_get_properties),
    listen: Some(v8_listen),
    connect: Some(v10_connect),
    accept: Some(accept),
    reg_mr: Some(reg_mr),
    reg_mr_dma_buf: None,
    dereg_mr: Some(dereg_mr),
    isend: Some(v10_isend),
    irecv: Some(v10_irecv),
    iflush: Some(iflush),
    test: Some(test),
    close_send: Some(close_send),
    close_recv: Some(close_recv),
    close_listen: Some(close_listen),
    get_device_mr: None,
    irecv_consumed: None,
    make_vdevice: None,
};

// ---- v11 and v12 (a context per NCCL communicator) ----

/// What `init` hands back as the context: the plugin keeps no state per
/// communicator, so every context is this one.
static CONTEXT: u8 = 0;

unsafe extern "C" fn v11_init(
    ctx: *mut *mut c_void,
    _comm_id: u64,
    _config: *mut NetCommConfig,
    logger: NcclDebugLogger,
    _prof: NcclProfilerCallback,
) -> NcclResult {
    let r = init(logger);
    if r == NCCL_SUCCESS && !ctx.is_null() {
        // SAFETY: not NULL: where NCCL keeps the context.
        unsafe { ctx.write(&CONTEXT as *const u8 as *mut c_void) };
    }
    r
}

unsafe extern "C" fn v11_finalize(_ctx: *mut c_void) -> NcclResult {
    NCCL_SUCCESS
}

unsafe extern "C" fn v11_get_properties(dev: c_int, out: *mut NetPropertiesV11) -> NcclResult {
    ffi("getProperties", || {
        let v9 = props_v9(dev)?;
        // SAFETY: NCCL passes a properties struct of this version.
        unsafe {
            put(
                out,
                NetPropertiesV11 {
                    v9,
                    max_multi_request_size: 1,
                },
                "props",
            )
        }
    })
}

unsafe extern "C" fn v12_get_properties(dev: c_int, out: *mut NetPropertiesV12) -> NcclResult {
    // SAFETY: NCCL passes a properties struct of this version.
    ffi("getProperties", || unsafe {
        put(out, props_v12(dev)?, "props")
    })
}

unsafe extern "C" fn v11_listen(
    _ctx: *mut c_void,
    dev: c_int,
    handle: *mut c_void,
    l: *mut *mut c_void,
) -> NcclResult {
    // SAFETY: NCCL's arguments, passed on.
    unsafe { listen(dev, handle, l) }
}

unsafe extern "C" fn v11_connect(
    _ctx: *mut c_void,
    dev: c_int,
    handle: *mut c_void,
    s: *mut *mut c_void,
    d: *mut *mut NetDeviceHandle,
) -> NcclResult {
    // SAFETY: NCCL's arguments, passed on.
    unsafe { connect(dev, handle, s, d) }
}

/// The v11 table (`ncclNet_v11_t`).
#[no_mangle]
pub static ncclNetPlugin_v11: NetV11 = NetV11 {
    name: NAME.as_ptr(),
    init: Some(v11_init),
    devices: Some(devices),
    get_properties: Some(v11_get_properties),
    listen: Some(v11_listen),
    connect: Some(v11_connect),
    accept: Some(accept),
    reg_mr: Some(reg_mr),
    reg_mr_dma_buf: None,
    dereg_mr: Some(dereg_mr),
    isend: Some(v10_isend),
    irecv: Some(v10_irecv),
    iflush: Some(iflush),
    test: Some(test),
    close_send: Some(close_send),
    close_recv: Some(close_recv),
    close_listen: Some(close_listen),
    get_device_mr: None,
    irecv_consumed: None,
    make_vdevice: None,
    finalize: Some(v11_finalize),
    set_net_attr: None,
};

/// The v12 table (`ncclNet_v12_t`), the newest NCCL publishes.
#[no_mangle]
pub static ncclNetPlugin_v12: NetV12 = NetV12 {
    name: NAME.as_ptr(),
    init: Some(v11_init),
    devices: Some(devices),
    get_properties: Some(v12_get_properties),
    listen: Some(v11_listen),
    connect: Some(v11_connect),
    accept: Some(accept),
    reg_mr: Some(reg_mr),
    reg_mr_dma_buf: None,
    dereg_mr: Some(dereg_mr),
    isend: Some(v10_isend),
    irecv: Some(v10_irecv),
    iflush: Some(iflush),
    test: Some(test),
    close_send: Some(close_send),
    close_recv: Some(close_recv),
    close_listen: Some(close_listen),
    get_device_mr: None,
    irecv_consumed: None,
    make_vdevice: None,
    finalize: Some(v11_finalize),
    set_net_attr: None,
};
