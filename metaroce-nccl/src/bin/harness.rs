//! `metaroce-nccl-harness`: stands in for NCCL where there are no GPUs.
//!
//! One process is one rank. It `dlopen`s `libnccl-net-NAME.so` the way
//! NCCL does (by file name, through the loader's search path, so
//! `LD_LIBRARY_PATH` applies), looks up `ncclNetPlugin_vN` from the newest
//! version down, and drives the plugin as NCCL's proxy thread does:
//! `listen`, the handle exchanged out of band (a file in a rendezvous
//! directory), `connect` and `accept` called again and again until they
//! return a comm, `regMr` of its own buffers, `isend`/`irecv` with up to
//! `NCCL_NET_MAX_REQUESTS` outstanding, grouped receives, `test` polled.
//!
//! ```text
//! metaroce-nccl-harness --rank 0 --rendezvous /tmp/rv verify
//! metaroce-nccl-harness --rank 1 --rendezvous /tmp/rv verify
//! metaroce-nccl-harness --rank 0 --rendezvous /tmp/rv bench [--json]
//! ```
//!
//! `verify` sends messages of 0 B to 64 MiB both ways and checks every
//! byte and every reported size, then grouped receives whose messages come
//! in reverse tag order; `bench` prints what nccl-tests' `sendrecv_perf`
//! prints (size, time, algbw, busbw; each message cut into NCCL-sized
//! chunks, `--chunk`, with `--window` of them outstanding) and an 8 B
//! round-trip latency.

use metaroce_nccl::abi::*;
use metaroce_nccl::MAX_RECVS;
use std::ffi::{c_char, c_int, c_ulong, c_void, CStr};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

type Ptr = *mut c_void;

/// The plugin's table, whichever version was found.
#[derive(Clone, Copy)]
enum Table {
    V8(&'static NetV8),
    V9(&'static NetV9),
    V10(&'static NetV10),
    V11(&'static NetV11),
    V12(&'static NetV12),
}

static WARNINGS: AtomicUsize = AtomicUsize::new(0);
static RANK: AtomicUsize = AtomicUsize::new(0);

/// The logger handed to `init`. NCCL's is printf-like (`fmt, ...`); the
/// plugin always calls it with `"…%s"` and one string. Stable Rust cannot
/// define a C-variadic function, so this takes that one argument as a
/// sixth parameter: on the x86-64 System V and AArch64 Linux ABIs a
/// variadic call passes its first integer/pointer arguments in the same
/// registers as a fixed-argument call, so the two agree.
unsafe extern "C" fn logger(
    level: c_int,
    _flags: c_ulong,
    _file: *const c_char,
    _line: c_int,
    fmt: *const c_char,
    arg: *const c_char,
) {
    if level == NCCL_LOG_WARN {
        WARNINGS.fetch_add(1, Ordering::Relaxed);
    }
    // SAFETY: the plugin passes NUL-terminated strings for both.
    let (fmt, arg) = unsafe {
        (
            CStr::from_ptr(fmt).to_string_lossy(),
            if arg.is_null() {
                "".into()
            } else {
                CStr::from_ptr(arg).to_string_lossy()
            },
        )
    };
    let kind = if level == NCCL_LOG_WARN {
        "WARN"
    } else {
        "INFO"
    };
    eprintln!(
        "[rank {}] NCCL {kind} {}",
        RANK.load(Ordering::Relaxed),
        fmt.replace("%s", &arg)
    );
}

fn nccl_logger() -> NcclDebugLogger {
    #[cfg(all(
        target_os = "linux",
        any(target_arch = "x86_64", target_arch = "aarch64")
    ))]
    {
        type Fixed = unsafe extern "C" fn(
            c_int,
            c_ulong,
            *const c_char,
            c_int,
            *const c_char,
            *const c_char,
        );
        // SAFETY: see `logger`: on these targets a call through the
        // variadic type with one trailing pointer lands in `logger` with
        // every argument in place.
        Some(unsafe {
            std::mem::transmute::<
                Fixed,
                unsafe extern "C" fn(c_int, c_ulong, *const c_char, c_int, *const c_char, ...),
            >(logger)
        })
    }
    #[cfg(not(all(
        target_os = "linux",
        any(target_arch = "x86_64", target_arch = "aarch64")
    )))]
    {
        None
    }
}

fn check(what: &str, r: NcclResult) -> Result<(), String> {
    if r == NCCL_SUCCESS {
        Ok(())
    } else {
        Err(format!("{what} returned ncclResult {r}"))
    }
}

macro_rules! call {
    ($t:expr, $f:ident ( $($a:expr),* )) => {{
        let f = $t.$f.ok_or(concat!(stringify!($f), " is NULL"))?;
        // SAFETY: the plugin's own entry point, with arguments as NCCL
        // passes them (live pointers to the harness's memory).
        unsafe { f($($a),*) }
    }};
}

/// Version-independent calls.
impl Table {
    fn version(self) -> u32 {
        match self {
            Table::V8(_) => 8,
            Table::V9(_) => 9,
            Table::V10(_) => 10,
            Table::V11(_) => 11,
            Table::V12(_) => 12,
        }
    }

    fn init(self) -> Result<(), String> {
        let mut ctx: Ptr = std::ptr::null_mut();
        let r = match self {
            Table::V8(t) => call!(t, init(nccl_logger())),
            Table::V9(t) => call!(t, init(nccl_logger())),
            Table::V10(t) => call!(t, init(nccl_logger(), None)),
            Table::V11(t) => call!(
                t,
                init(&mut ctx, 1, std::ptr::null_mut(), nccl_logger(), None)
            ),
            Table::V12(t) => call!(
                t,
                init(&mut ctx, 1, std::ptr::null_mut(), nccl_logger(), None)
            ),
        };
        check("init", r)
    }

    fn devices(self) -> Result<c_int, String> {
        let mut n = 0;
        let r = match self {
            Table::V8(t) => call!(t, devices(&mut n)),
            Table::V9(t) => call!(t, devices(&mut n)),
            Table::V10(t) => call!(t, devices(&mut n)),
            Table::V11(t) => call!(t, devices(&mut n)),
            Table::V12(t) => call!(t, devices(&mut n)),
        };
        check("devices", r).map(|_| n)
    }

    /// Name, speed, ptrSupport, maxRecvs of device `d`.
    fn properties(self, d: c_int) -> Result<(String, c_int, c_int, c_int), String> {
        fn name(p: *mut c_char) -> String {
            if p.is_null() {
                return String::new();
            }
            // SAFETY: the plugin's NUL-terminated device name.
            unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
        }
        macro_rules! get {
            ($t:expr, $ty:ty $(, $base:ident)?) => {{
                // SAFETY: all-zero is a valid value of these plain C structs.
                let mut p: $ty = unsafe { std::mem::zeroed() };
                check("getProperties", call!($t, get_properties(d, &mut p)))?;
                let b = &p$(.$base)?;
                (name(b.name), b.speed, b.ptr_support, b.max_recvs)
            }};
        }
        Ok(match self {
            Table::V8(t) => {
                let mut p = NetPropertiesV8::default();
                check("getProperties", call!(t, get_properties(d, &mut p)))?;
                (name(p.name), p.speed, p.ptr_support, p.max_recvs)
            }
            Table::V9(t) => get!(t, NetPropertiesV9),
            Table::V10(t) => get!(t, NetPropertiesV9),
            Table::V11(t) => get!(t, NetPropertiesV11, v9),
            Table::V12(t) => get!(t, NetPropertiesV12),
        })
    }

    fn listen(self, handle: &mut [u8; NCCL_NET_HANDLE_MAXSIZE]) -> Result<Ptr, String> {
        let mut l: Ptr = std::ptr::null_mut();
        let h = handle.as_mut_ptr() as Ptr;
        let ctx = std::ptr::null_mut();
        let r = match self {
            Table::V8(t) => call!(t, listen(0, h, &mut l)),
            Table::V9(t) => call!(t, listen(0, h, &mut l)),
            Table::V10(t) => call!(t, listen(0, h, &mut l)),
            Table::V11(t) => call!(t, listen(ctx, 0, h, &mut l)),
            Table::V12(t) => call!(t, listen(ctx, 0, h, &mut l)),
        };
        check("listen", r).map(|_| l)
    }

    fn connect(self, handle: &mut [u8; NCCL_NET_HANDLE_MAXSIZE]) -> Result<Ptr, String> {
        let mut s: Ptr = std::ptr::null_mut();
        let mut dev: *mut NetDeviceHandle = std::ptr::null_mut();
        let h = handle.as_mut_ptr() as Ptr;
        let ctx = std::ptr::null_mut();
        let mut cfg = NetCommConfig { traffic_class: -1 };
        let r = match self {
            Table::V8(t) => call!(t, connect(0, h, &mut s, &mut dev)),
            Table::V9(t) => call!(t, connect(0, h, &mut s, &mut dev)),
            Table::V10(t) => call!(t, connect(0, &mut cfg, h, &mut s, &mut dev)),
            Table::V11(t) => call!(t, connect(ctx, 0, h, &mut s, &mut dev)),
            Table::V12(t) => call!(t, connect(ctx, 0, h, &mut s, &mut dev)),
        };
        check("connect", r).map(|_| s)
    }

    fn accept(self, l: Ptr) -> Result<Ptr, String> {
        let mut c: Ptr = std::ptr::null_mut();
        let mut dev: *mut NetDeviceHandle = std::ptr::null_mut();
        let r = match self {
            Table::V8(t) => call!(t, accept(l, &mut c, &mut dev)),
            Table::V9(t) => call!(t, accept(l, &mut c, &mut dev)),
            Table::V10(t) => call!(t, accept(l, &mut c, &mut dev)),
            Table::V11(t) => call!(t, accept(l, &mut c, &mut dev)),
            Table::V12(t) => call!(t, accept(l, &mut c, &mut dev)),
        };
        check("accept", r).map(|_| c)
    }

    fn reg_mr_raw(self, comm: Ptr, data: &mut [u8], kind: c_int) -> (NcclResult, Ptr) {
        let mut mh: Ptr = std::ptr::null_mut();
        let (p, n) = (data.as_mut_ptr() as Ptr, data.len());
        let r = (|| -> Result<NcclResult, String> {
            Ok(match self {
                Table::V8(t) => call!(t, reg_mr(comm, p, n, kind, &mut mh)),
                Table::V9(t) => call!(t, reg_mr(comm, p, n, kind, &mut mh)),
                Table::V10(t) => call!(t, reg_mr(comm, p, n, kind, &mut mh)),
                Table::V11(t) => call!(t, reg_mr(comm, p, n, kind, &mut mh)),
                Table::V12(t) => call!(t, reg_mr(comm, p, n, kind, &mut mh)),
            })
        })()
        .unwrap_or(NCCL_INTERNAL_ERROR);
        (r, mh)
    }

    fn reg_mr(self, comm: Ptr, data: &mut [u8]) -> Result<Ptr, String> {
        let (r, mh) = self.reg_mr_raw(comm, data, NCCL_PTR_HOST);
        check("regMr", r).map(|_| mh)
    }

    fn dereg_mr(self, comm: Ptr, mh: Ptr) -> Result<(), String> {
        let r = match self {
            Table::V8(t) => call!(t, dereg_mr(comm, mh)),
            Table::V9(t) => call!(t, dereg_mr(comm, mh)),
            Table::V10(t) => call!(t, dereg_mr(comm, mh)),
            Table::V11(t) => call!(t, dereg_mr(comm, mh)),
            Table::V12(t) => call!(t, dereg_mr(comm, mh)),
        };
        check("deregMr", r)
    }

    /// `isend`; `None`: not now (try again).
    fn isend(
        self,
        comm: Ptr,
        data: *const u8,
        size: usize,
        tag: c_int,
        mh: Ptr,
    ) -> Result<Option<Ptr>, String> {
        let mut req: Ptr = std::ptr::null_mut();
        let d = data as Ptr;
        let ph = std::ptr::null_mut();
        let r = match self {
            Table::V8(t) => call!(t, isend(comm, d, size as c_int, tag, mh, &mut req)),
            Table::V9(t) => call!(t, isend(comm, d, size, tag, mh, &mut req)),
            Table::V10(t) => call!(t, isend(comm, d, size, tag, mh, ph, &mut req)),
            Table::V11(t) => call!(t, isend(comm, d, size, tag, mh, ph, &mut req)),
            Table::V12(t) => call!(t, isend(comm, d, size, tag, mh, ph, &mut req)),
        };
        check("isend", r).map(|_| (!req.is_null()).then_some(req))
    }

    /// `irecv` of (pointer, size, tag); `None`: not now.
    fn irecv(
        self,
        comm: Ptr,
        bufs: &[(*mut u8, usize, c_int)],
        mh: Ptr,
    ) -> Result<Option<Ptr>, String> {
        let mut req: Ptr = std::ptr::null_mut();
        // On the stack, as NCCL's proxy passes its arrays: no allocation
        // per call on the way of a message.
        if bufs.len() > MAX_RECVS {
            return Err(format!("irecv of {} buffers", bufs.len()));
        }
        let n = bufs.len() as c_int;
        let mut data: [Ptr; MAX_RECVS] = [std::ptr::null_mut(); MAX_RECVS];
        let mut sizes = [0usize; MAX_RECVS];
        let mut sizes32: [c_int; MAX_RECVS] = [0; MAX_RECVS];
        let mut tags: [c_int; MAX_RECVS] = [0; MAX_RECVS];
        let mut mhs: [Ptr; MAX_RECVS] = [mh; MAX_RECVS];
        let mut phs: [Ptr; MAX_RECVS] = [std::ptr::null_mut(); MAX_RECVS];
        for (i, b) in bufs.iter().enumerate() {
            (data[i], sizes[i], sizes32[i], tags[i]) = (b.0 as Ptr, b.1, b.1 as c_int, b.2);
        }
        let (d, s, s32, tg, m, p) = (
            data.as_mut_ptr(),
            sizes.as_mut_ptr(),
            sizes32.as_mut_ptr(),
            tags.as_mut_ptr(),
            mhs.as_mut_ptr(),
            phs.as_mut_ptr(),
        );
        let r = match self {
            Table::V8(t) => call!(t, irecv(comm, n, d, s32, tg, m, &mut req)),
            Table::V9(t) => call!(t, irecv(comm, n, d, s, tg, m, &mut req)),
            Table::V10(t) => call!(t, irecv(comm, n, d, s, tg, m, p, &mut req)),
            Table::V11(t) => call!(t, irecv(comm, n, d, s, tg, m, p, &mut req)),
            Table::V12(t) => call!(t, irecv(comm, n, d, s, tg, m, p, &mut req)),
        };
        check("irecv", r).map(|_| (!req.is_null()).then_some(req))
    }

    /// `test`: `Some(sizes)` once done (one per buffer, the first `n`).
    fn test(self, req: Ptr, n: usize) -> Result<Option<[c_int; MAX_RECVS]>, String> {
        debug_assert!(n <= MAX_RECVS);
        let mut done = 0;
        let mut sizes = [-1 as c_int; MAX_RECVS];
        let s = sizes.as_mut_ptr();
        let r = match self {
            Table::V8(t) => call!(t, test(req, &mut done, s)),
            Table::V9(t) => call!(t, test(req, &mut done, s)),
            Table::V10(t) => call!(t, test(req, &mut done, s)),
            Table::V11(t) => call!(t, test(req, &mut done, s)),
            Table::V12(t) => call!(t, test(req, &mut done, s)),
        };
        check("test", r)?;
        Ok((done != 0).then_some(sizes))
    }

    fn close(self, send: Ptr, recv: Ptr, listen: Ptr) -> Result<(), String> {
        macro_rules! all {
            ($t:expr) => {{
                check("closeSend", call!($t, close_send(send)))?;
                check("closeRecv", call!($t, close_recv(recv)))?;
                check("closeListen", call!($t, close_listen(listen)))?;
            }};
        }
        match self {
            Table::V8(t) => all!(t),
            Table::V9(t) => all!(t),
            Table::V10(t) => all!(t),
            Table::V11(t) => all!(t),
            Table::V12(t) => all!(t),
        }
        Ok(())
    }
}

/// Loads the plugin as NCCL does and finds its newest table (or `want`).
fn load(name: &str, want: Option<u32>) -> Result<Table, String> {
    let file = format!("libnccl-net-{name}.so");
    // SAFETY: loading the plugin runs no initializers beyond Rust's own
    // (the crate has no constructors); it stays loaded for the process.
    let lib =
        unsafe { libloading::Library::new(&file) }.map_err(|e| format!("dlopen {file}: {e}"))?;
    let lib: &'static libloading::Library = Box::leak(Box::new(lib));
    for v in [12u32, 11, 10, 9, 8] {
        if want.is_some_and(|w| w != v) {
            continue;
        }
        let sym = format!("ncclNetPlugin_v{v}\0");
        // SAFETY: the symbol is a static table of the type its version
        // names; the library is never unloaded, so 'static holds.
        let t = unsafe {
            let Ok(s) = lib.get::<*const c_void>(sym.as_bytes()) else {
                continue;
            };
            let p: *const c_void = *s;
            match v {
                12 => Table::V12(&*(p as *const NetV12)),
                11 => Table::V11(&*(p as *const NetV11)),
                10 => Table::V10(&*(p as *const NetV10)),
                9 => Table::V9(&*(p as *const NetV9)),
                _ => Table::V8(&*(p as *const NetV8)),
            }
        };
        return Ok(t);
    }
    Err(format!("{file} exports no ncclNetPlugin_v8..v12"))
}

struct Args {
    rank: usize,
    rendezvous: PathBuf,
    plugin: String,
    version: Option<u32>,
    mode: String,
    json: bool,
    max_size: usize,
    chunk: usize,
    window: usize,
    iters: usize,
    budget: usize,
    pingpongs: usize,
}

fn parse_size(s: &str) -> Result<usize, String> {
    let (num, mul) = match s.char_indices().find(|(_, c)| c.is_alphabetic()) {
        Some((i, _)) => (
            &s[..i],
            match s[i..].to_ascii_uppercase().as_str() {
                "K" | "KB" | "KIB" => 1 << 10,
                "M" | "MB" | "MIB" => 1 << 20,
                "G" | "GB" | "GIB" => 1 << 30,
                "B" => 1,
                other => return Err(format!("unknown unit {other}")),
            },
        ),
        None => (s, 1),
    };
    num.parse::<usize>()
        .map(|n| n * mul)
        .map_err(|e| format!("{s}: {e}"))
}

fn parse_args() -> Result<Args, String> {
    let mut a = Args {
        rank: usize::MAX,
        rendezvous: PathBuf::new(),
        plugin: "metaroce".into(),
        version: None,
        mode: "verify".into(),
        json: false,
        max_size: 64 << 20,
        chunk: 512 << 10,
        window: 8,
        iters: 0,
        budget: 256 << 20,
        pingpongs: 2000,
    };
    let mut it = std::env::args().skip(1);
    while let Some(arg) = it.next() {
        let mut val = || it.next().ok_or(format!("{arg} needs a value"));
        match arg.as_str() {
            "--rank" => a.rank = val()?.parse().map_err(|e| format!("--rank: {e}"))?,
            "--rendezvous" => a.rendezvous = val()?.into(),
            "--plugin" => a.plugin = val()?,
            "--version" => a.version = Some(val()?.parse().map_err(|e| format!("--version: {e}"))?),
            "--max-size" => a.max_size = parse_size(&val()?)?,
            "--chunk" => a.chunk = parse_size(&val()?)?.max(1),
            "--window" => {
                a.window = val()?
                    .parse::<usize>()
                    .map_err(|e| e.to_string())?
                    .clamp(1, NCCL_NET_MAX_REQUESTS)
            }
            "--iters" => a.iters = val()?.parse().map_err(|e| format!("--iters: {e}"))?,
            "--pingpongs" => {
                a.pingpongs = val()?.parse::<usize>().map_err(|e| e.to_string())?.max(1)
            }
            "--budget" => a.budget = parse_size(&val()?)?,
            "--json" => a.json = true,
            "verify" | "bench" | "misuse" => a.mode = arg,
            "-h" | "--help" => {
                println!("usage: metaroce-nccl-harness --rank 0|1 --rendezvous DIR [--plugin NAME] [--version N] [--max-size SIZE] [--chunk SIZE] [--window N] [--iters N] [--budget SIZE] [--pingpongs N] [--json] verify|bench|misuse");
                std::process::exit(0);
            }
            other => return Err(format!("unknown argument {other}")),
        }
    }
    if a.rank > 1 || a.rendezvous.as_os_str().is_empty() {
        return Err("--rank 0|1 and --rendezvous DIR are required".into());
    }
    Ok(a)
}

/// A connected pair of comms to the other rank.
struct Comms {
    t: Table,
    send: Ptr,
    recv: Ptr,
    listen: Ptr,
    retries: usize,
}

fn exchange(
    dir: &Path,
    rank: usize,
    mine: &[u8; NCCL_NET_HANDLE_MAXSIZE],
) -> Result<[u8; NCCL_NET_HANDLE_MAXSIZE], String> {
    let tmp = dir.join(format!("rank{rank}.handle.tmp"));
    std::fs::write(&tmp, mine).map_err(|e| e.to_string())?;
    std::fs::rename(&tmp, dir.join(format!("rank{rank}.handle"))).map_err(|e| e.to_string())?;
    let theirs = dir.join(format!("rank{}.handle", 1 - rank));
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if let Ok(b) = std::fs::read(&theirs) {
            if let Ok(h) = <[u8; NCCL_NET_HANDLE_MAXSIZE]>::try_from(b.as_slice()) {
                return Ok(h);
            }
        }
        if Instant::now() > deadline {
            return Err("the peer's handle never came".into());
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

/// Listen, exchange handles, then connect and accept, each called until
/// it returns a comm (as NCCL's proxy does).
fn connect(t: Table, a: &Args) -> Result<Comms, String> {
    let mut mine = [0u8; NCCL_NET_HANDLE_MAXSIZE];
    let listen = t.listen(&mut mine)?;
    let mut theirs = exchange(&a.rendezvous, a.rank, &mine)?;
    let (mut send, mut recv): (Ptr, Ptr) = (std::ptr::null_mut(), std::ptr::null_mut());
    let mut retries = 0;
    let deadline = Instant::now() + Duration::from_secs(60);
    while send.is_null() || recv.is_null() {
        if send.is_null() {
            send = t.connect(&mut theirs)?;
        }
        if recv.is_null() {
            recv = t.accept(listen)?;
        }
        retries += 1;
        if Instant::now() > deadline {
            return Err("connect/accept not ready after 60 s".into());
        }
        std::thread::sleep(Duration::from_micros(100));
    }
    Ok(Comms {
        t,
        send,
        recv,
        listen,
        retries,
    })
}

fn pattern(from: usize, size: usize, msg: usize, j: usize) -> u8 {
    (j.wrapping_mul(131) ^ msg.wrapping_mul(7919) ^ from.wrapping_mul(104_729) ^ size) as u8
}

fn fill(buf: &mut [u8], from: usize, size: usize, msg: usize) {
    for (j, b) in buf.iter_mut().enumerate() {
        *b = pattern(from, size, msg, j);
    }
}

fn verify_bytes(buf: &[u8], from: usize, size: usize, msg: usize) -> Result<(), String> {
    match buf
        .iter()
        .enumerate()
        .find(|&(j, &b)| b != pattern(from, size, msg, j))
    {
        None => Ok(()),
        Some((j, &b)) => Err(format!(
            "message {msg} of {size} bytes: byte {j} is {b:#04x}, expected {:#04x}",
            pattern(from, size, msg, j)
        )),
    }
}

/// The registered buffers of a rank.
struct Bufs {
    sbuf: Vec<u8>,
    rbuf: Vec<u8>,
    smh: Ptr,
    rmh: Ptr,
}

/// One outstanding request of the run loops.
struct Pending {
    req: Ptr,
    slot: usize,
    msg: usize,
    n: usize,
}

/// Sends and receives `count` messages of `size` bytes each way with up to
/// `window` outstanding, checking every byte when `check` is set.
fn run_size(
    c: &Comms,
    rank: usize,
    size: usize,
    (count, window): (usize, usize),
    b: &mut Bufs,
    check_bytes: bool,
) -> Result<(), String> {
    let t = c.t;
    let (sbuf, rbuf, smh, rmh) = (&mut b.sbuf, &mut b.rbuf, b.smh, b.rmh);
    let slot_len = size.max(1);
    let window = window
        .min(sbuf.len() / slot_len)
        .min(rbuf.len() / slot_len)
        .max(1);
    let (mut sent, mut recvd, mut posted_s, mut posted_r) = (0, 0, 0, 0);
    let mut sends: std::collections::VecDeque<Pending> = Default::default();
    let mut recvs: std::collections::VecDeque<Pending> = Default::default();
    let peer = 1 - rank;
    let deadline = Instant::now() + Duration::from_secs(300);
    while sent < count || recvd < count {
        while posted_r < count && recvs.len() < window {
            let slot = posted_r % window;
            let p = rbuf[slot * slot_len..].as_mut_ptr();
            match t.irecv(c.recv, &[(p, size, 1)], rmh)? {
                Some(req) => {
                    recvs.push_back(Pending {
                        req,
                        slot,
                        msg: posted_r,
                        n: 1,
                    });
                    posted_r += 1;
                }
                None => break,
            }
        }
        while posted_s < count && sends.len() < window {
            let slot = posted_s % window;
            let buf = &mut sbuf[slot * slot_len..slot * slot_len + size];
            if check_bytes {
                fill(buf, rank, size, posted_s);
            }
            match t.isend(c.send, buf.as_ptr(), size, 1, smh)? {
                Some(req) => {
                    sends.push_back(Pending {
                        req,
                        slot,
                        msg: posted_s,
                        n: 1,
                    });
                    posted_s += 1;
                }
                None => break,
            }
        }
        let mut progressed = false;
        if let Some(p) = sends.front() {
            if let Some(sz) = t.test(p.req, p.n)? {
                progressed = true;
                if sz[0] as usize != size {
                    return Err(format!("send of {size} bytes reported {}", sz[0]));
                }
                sends.pop_front();
                sent += 1;
            }
        }
        if let Some(p) = recvs.front() {
            if let Some(sz) = t.test(p.req, p.n)? {
                progressed = true;
                if sz[0] as usize != size {
                    return Err(format!("receive of {size} bytes reported {}", sz[0]));
                }
                if check_bytes {
                    verify_bytes(
                        &rbuf[p.slot * slot_len..p.slot * slot_len + size],
                        peer,
                        size,
                        p.msg,
                    )?;
                }
                recvs.pop_front();
                recvd += 1;
            }
        }
        if !progressed {
            // As NCCL's proxy thread does when a round made no progress.
            std::thread::yield_now();
        }
        if Instant::now() > deadline {
            return Err(format!(
                "{size} B: {sent}/{count} sent, {recvd}/{count} received after 300 s"
            ));
        }
    }
    Ok(())
}

/// Grouped receives: `groups` groups of `n` buffers with tags 0..n and
/// sizes that differ per tag; the sender sends each group's messages in
/// reverse tag order, shorter than the buffers, so the receiver must match
/// by tag and learn each size.
fn run_grouped(
    c: &Comms,
    rank: usize,
    n: usize,
    groups: usize,
    b: &mut Bufs,
) -> Result<(), String> {
    let t = c.t;
    let (sbuf, rbuf, smh, rmh) = (&mut b.sbuf, &mut b.rbuf, b.smh, b.rmh);
    let buf_len = |tag: usize| 1000 + 517 * tag;
    let msg_len = |tag: usize, g: usize| buf_len(tag) - (tag + g) % 300;
    let stride: usize = (0..n).map(buf_len).sum();
    let outstanding = 4.min(rbuf.len() / stride).min(sbuf.len() / stride).max(1);
    let peer = 1 - rank;
    let (mut posted_r, mut done_r, mut posted_s, mut done_s) = (0, 0, 0, 0);
    let mut recvs: std::collections::VecDeque<Pending> = Default::default();
    let mut sends: std::collections::VecDeque<Ptr> = Default::default();
    let deadline = Instant::now() + Duration::from_secs(120);
    while done_r < groups || done_s < groups * n {
        if posted_r < groups && recvs.len() < outstanding {
            let slot = posted_r % outstanding;
            let mut off = slot * stride;
            let mut bufs = Vec::new();
            for tag in 0..n {
                bufs.push((rbuf[off..].as_mut_ptr(), buf_len(tag), tag as c_int));
                off += buf_len(tag);
            }
            if let Some(req) = t.irecv(c.recv, &bufs, rmh)? {
                recvs.push_back(Pending {
                    req,
                    slot,
                    msg: posted_r,
                    n,
                });
                posted_r += 1;
            }
        }
        // Sends: message `posted_s` is group posted_s / n, tag n-1 - posted_s % n.
        while posted_s < groups * n && sends.len() < outstanding * n {
            let (g, tag) = (posted_s / n, n - 1 - posted_s % n);
            let slot = g % outstanding;
            let off = slot * stride + (0..tag).map(buf_len).sum::<usize>();
            let len = msg_len(tag, g);
            let buf = &mut sbuf[off..off + len];
            fill(buf, rank, len, g * n + tag);
            match t.isend(c.send, buf.as_ptr(), len, tag as c_int, smh)? {
                Some(req) => {
                    sends.push_back(req);
                    posted_s += 1;
                }
                None => break,
            }
        }
        if let Some(&req) = sends.front() {
            if t.test(req, 1)?.is_some() {
                sends.pop_front();
                done_s += 1;
            }
        }
        if let Some(p) = recvs.front() {
            if let Some(sizes) = t.test(p.req, p.n)? {
                let mut off = p.slot * stride;
                for (tag, &got) in sizes.iter().enumerate().take(n) {
                    let want = msg_len(tag, p.msg);
                    if got as usize != want {
                        return Err(format!(
                            "group {} tag {tag}: size {got}, expected {want}",
                            p.msg
                        ));
                    }
                    verify_bytes(&rbuf[off..off + want], peer, want, p.msg * n + tag)?;
                    off += buf_len(tag);
                }
                recvs.pop_front();
                done_r += 1;
            }
        }
        if Instant::now() > deadline {
            return Err(format!(
                "grouped: {done_r}/{groups} groups received after 120 s"
            ));
        }
    }
    Ok(())
}

/// The round trip of 8 B messages: rank 0 sends and waits for the echo.
fn pingpong(c: &Comms, rank: usize, iters: usize, b: &mut Bufs) -> Result<Vec<f64>, String> {
    let t = c.t;
    let (sp, rp, smh, rmh) = (b.sbuf.as_mut_ptr(), b.rbuf.as_mut_ptr(), b.smh, b.rmh);
    // Sends complete when the peer acknowledges them; as in NCCL's proxy,
    // they are tested along the way and never hold up a receive.
    let mut sends: std::collections::VecDeque<Ptr> = Default::default();
    let reap = |sends: &mut std::collections::VecDeque<Ptr>| -> Result<bool, String> {
        let mut any = false;
        while let Some(&s) = sends.front() {
            if t.test(s, 1)?.is_none() {
                break;
            }
            sends.pop_front();
            any = true;
        }
        Ok(any)
    };
    // Polled as NCCL's proxy thread polls, yielding when a round did nothing.
    let wait = |req: Ptr, sends: &mut std::collections::VecDeque<Ptr>| -> Result<(), String> {
        while t.test(req, 1)?.is_none() {
            if !reap(sends)? {
                std::thread::yield_now();
            }
        }
        Ok(())
    };
    // Two receive buffers in turn: the next receive is posted before the
    // current one is waited for, as NCCL's proxy posts the receives of the
    // steps ahead while their buffers are free.
    let post_recv = |k: usize| -> Result<Ptr, String> {
        loop {
            if let Some(r) = t.irecv(c.recv, &[(rp.wrapping_add(8 * (k & 1)), 8, 0)], rmh)? {
                return Ok(r);
            }
        }
    };
    let send = |sends: &mut std::collections::VecDeque<Ptr>| -> Result<(), String> {
        loop {
            if let Some(r) = t.isend(c.send, sp, 8, 0, smh)? {
                sends.push_back(r);
                return Ok(());
            }
            reap(sends)?;
        }
    };
    let mut rtts = Vec::with_capacity(iters);
    let mut rreq = post_recv(0)?;
    for i in 1..=iters {
        let next = post_recv(i)?;
        if rank == 0 {
            let t0 = Instant::now();
            send(&mut sends)?;
            wait(rreq, &mut sends)?;
            rtts.push(t0.elapsed().as_secs_f64() * 1e6);
        } else {
            wait(rreq, &mut sends)?;
            send(&mut sends)?;
        }
        rreq = next;
    }
    // The last receive posted is answered by nobody: send one more each way.
    send(&mut sends)?;
    wait(rreq, &mut sends)?;
    while !sends.is_empty() {
        if !reap(&mut sends)? {
            std::thread::yield_now();
        }
    }
    Ok(rtts)
}

fn run() -> Result<(), String> {
    let a = parse_args()?;
    RANK.store(a.rank, Ordering::Relaxed);
    let t = load(&a.plugin, a.version)?;
    t.init()?;
    let ndev = t.devices()?;
    if ndev < 1 {
        return Err("the plugin has no device".into());
    }
    let (name, speed, ptr, max_recvs) = t.properties(0)?;
    if ptr & NCCL_PTR_HOST == 0 || max_recvs < 1 || name.is_empty() {
        return Err(format!(
            "properties: name {name:?} ptrSupport {ptr} maxRecvs {max_recvs}"
        ));
    }
    eprintln!(
        "[rank {}] ncclNetPlugin_v{}: {ndev} device(s), {name}, {speed} Mbps, maxRecvs {max_recvs}",
        a.rank,
        t.version()
    );
    let c = connect(t, &a)?;
    eprintln!(
        "[rank {}] connected after {} connect/accept rounds",
        a.rank, c.retries
    );

    // An error goes back as a result code and a warning through the logger.
    let mut probe = vec![0u8; 64];
    let before = WARNINGS.load(Ordering::Relaxed);
    let (r, _) = t.reg_mr_raw(c.send, &mut probe, NCCL_PTR_CUDA);
    if r != NCCL_INVALID_ARGUMENT || WARNINGS.load(Ordering::Relaxed) != before + 1 {
        return Err(format!(
            "regMr of CUDA memory: result {r}, expected ncclInvalidArgument and one warning"
        ));
    }

    let region = a.max_size.max(1 << 20) * 2;
    let mut sbuf = vec![0u8; region];
    let mut rbuf = vec![0u8; region];
    let smh = t.reg_mr(c.send, &mut sbuf)?;
    let rmh = t.reg_mr(c.recv, &mut rbuf)?;
    let mut b = Bufs {
        sbuf,
        rbuf,
        smh,
        rmh,
    };

    if a.mode == "verify" {
        request_limit(&c, &mut b)?;
        eprintln!(
            "[rank {}] isend and irecv say \"not now\" beyond {NCCL_NET_MAX_REQUESTS} outstanding",
            a.rank
        );
        let mut sizes = vec![
            0usize,
            1,
            7,
            8,
            4095,
            4096,
            65535,
            65536,
            65537,
            1 << 20,
            3 << 20,
            8 << 20,
            64 << 20,
        ];
        sizes.retain(|&s| s <= a.max_size);
        for &size in &sizes {
            let count = if a.iters > 0 {
                a.iters
            } else {
                (a.budget / size.max(4096)).clamp(2, 200)
            };
            let window = NCCL_NET_MAX_REQUESTS.min(((32usize << 20) / size.max(1)).max(1));
            let t0 = Instant::now();
            run_size(&c, a.rank, size, (count, window), &mut b, true)?;
            eprintln!(
                "[rank {}] verified {count} x {size} B each way, window {window}, {:.1} ms",
                a.rank,
                t0.elapsed().as_secs_f64() * 1e3
            );
        }
        let n = (max_recvs as usize).min(MAX_GROUP);
        run_grouped(&c, a.rank, n, 64, &mut b)?;
        eprintln!("[rank {}] verified 64 grouped receives of {n} tags", a.rank);
        let (ahead, ahead_first) = run_late(&c, a.rank, LATE_COUNT, &mut b)?;
        eprintln!(
            "[rank {}] verified {LATE_COUNT} x {LATE_SIZE} B sent before their receives were posted ({ahead} before any receive was posted, {ahead_first} before more than {LATE_FIRST})",
            a.rank
        );
        println!("rank {} verify ok", a.rank);
    } else if a.mode == "misuse" {
        misuse(&c, a.rank, &mut b)?;
        println!("rank {} misuse ok", a.rank);
    } else {
        bench(&c, &a, &mut b)?;
    }
    t.dereg_mr(c.send, smh)?;
    t.dereg_mr(c.recv, rmh)?;
    t.close(c.send, c.recv, c.listen)?;
    Ok(())
}

/// NCCL keeps at most NCCL_NET_MAX_REQUESTS requests per comm; a plugin
/// may refuse more by returning a NULL request ("not now"). Posts that many
/// receives (the peer does the same) and checks that one more is refused;
/// then that many sends, each retried while it is refused (a send waits,
/// NULL, until the peer has announced a buffer for it, as NCCL retries),
/// and checks that one more is refused; then completes them all.
fn request_limit(c: &Comms, b: &mut Bufs) -> Result<(), String> {
    let t = c.t;
    let (sp, rp) = (b.sbuf.as_mut_ptr(), b.rbuf.as_mut_ptr());
    let mut reqs = Vec::new();
    for i in 0..NCCL_NET_MAX_REQUESTS {
        let p = rp.wrapping_add(i);
        reqs.push((
            t.irecv(c.recv, &[(p, 1, 9)], b.rmh)?
                .ok_or("irecv refused below the limit")?,
            1,
        ));
    }
    if t.irecv(c.recv, &[(rp, 1, 9)], b.rmh)?.is_some() {
        return Err(format!(
            "irecv accepted beyond {NCCL_NET_MAX_REQUESTS} outstanding"
        ));
    }
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(20);
    for _ in 0..NCCL_NET_MAX_REQUESTS {
        let r = loop {
            if let Some(r) = t.isend(c.send, sp, 0, 9, b.smh)? {
                break r;
            }
            if std::time::Instant::now() > deadline {
                return Err("isend refused below the limit for 20 s".into());
            }
            std::thread::yield_now();
        };
        reqs.push((r, 1));
    }
    if t.isend(c.send, sp, 0, 9, b.smh)?.is_some() {
        return Err(format!(
            "isend accepted beyond {NCCL_NET_MAX_REQUESTS} outstanding"
        ));
    }
    while !reqs.is_empty() {
        let mut left = Vec::new();
        for (r, n) in reqs {
            match t.test(r, n)? {
                Some(sizes) if sizes[0] != 0 => {
                    return Err(format!("0 B message reported as {}", sizes[0]))
                }
                Some(_) => {}
                None => left.push((r, n)),
            }
        }
        reqs = left;
        std::thread::yield_now();
    }
    Ok(())
}

/// Messages longer than the buffers they are for, one of each way a
/// message travels: rank 0 posts two 16-byte receives (tags 7 and 8, small
/// enough to take only eager messages, so not announced at once); rank 1
/// sends 64 KiB with tag 7, which waits for its buffer to be announced and
/// must then be refused by `isend`, and 100 B with tag 8, which goes
/// eagerly and must be refused by the receiver's `test`. Neither may hang,
/// and no byte may land past a buffer (the bytes after each are checked).
fn misuse(c: &Comms, rank: usize, b: &mut Bufs) -> Result<(), String> {
    let t = c.t;
    let deadline = Instant::now() + Duration::from_secs(30);
    if rank == 0 {
        b.rbuf[..256].fill(0xee);
        let p = b.rbuf.as_mut_ptr();
        let r7 = loop {
            if let Some(r) = t.irecv(c.recv, &[(p, 16, 7)], b.rmh)? {
                break r;
            }
        };
        let r8 = loop {
            if let Some(r) = t.irecv(c.recv, &[(p.wrapping_add(64), 16, 8)], b.rmh)? {
                break r;
            }
        };
        // The bad message fails the receive comm: whichever receive is
        // tested first reports it.
        loop {
            let r = match t.test(r7, 1) {
                Ok(Some(_)) => return Err("a receive of tag 7 completed: nothing fits it".into()),
                Ok(None) => t.test(r8, 1),
                Err(e) => Err(e),
            };
            match r {
                // ncclRemoteError; the reason went to the logger.
                Err(e) if e.ends_with(&format!("ncclResult {NCCL_REMOTE_ERROR}")) => {
                    eprintln!("[rank 0] a 100 B eager message for a 16 B buffer: {e}");
                    break;
                }
                Err(e) => return Err(format!("tag 8: unexpected error {e}")),
                Ok(Some(_)) => return Err("a 100 B message completed a 16 B receive".into()),
                Ok(None) => {}
            }
            if Instant::now() > deadline {
                return Err("the 100 B message was never refused".into());
            }
            std::thread::yield_now();
        }
        if b.rbuf[16..64]
            .iter()
            .chain(&b.rbuf[80..256])
            .any(|&x| x != 0xee)
        {
            return Err("bytes landed past a 16 B buffer".into());
        }
    } else {
        let p = b.sbuf.as_ptr();
        loop {
            match t.isend(c.send, p, 64 << 10, 7, b.smh) {
                // ncclInvalidArgument; the reason went to the logger.
                Err(e) if e.ends_with(&format!("ncclResult {NCCL_INVALID_ARGUMENT}")) => {
                    eprintln!("[rank 1] a 64 KiB message for a 16 B buffer: {e}");
                    break;
                }
                Err(e) => return Err(format!("tag 7: unexpected error {e}")),
                Ok(Some(_)) => return Err("a 64 KiB send to a 16 B buffer was taken".into()),
                Ok(None) => {}
            }
            if Instant::now() > deadline {
                return Err("the 64 KiB send was never refused".into());
            }
            std::thread::yield_now();
        }
        let r = loop {
            if let Some(r) = t.isend(c.send, p, 100, 8, b.smh)? {
                break r;
            }
            if Instant::now() > deadline {
                return Err("the 100 B send was never taken".into());
            }
        };
        // It goes eagerly: the transport delivers it (the receiver refuses
        // it above the transport), so the send completes.
        while t.test(r, 1)?.is_none() {
            if Instant::now() > deadline {
                return Err("the 100 B send never completed".into());
            }
            std::thread::yield_now();
        }
    }
    Ok(())
}

/// Messages of the late-receiver run, and their size.
const LATE_COUNT: usize = 150;
const LATE_SIZE: usize = 100;
/// Receives the late receiver posts first, 300 ms before the others.
const LATE_FIRST: usize = 16;

/// The sender runs ahead: for 300 ms each rank only sends (`count`
/// messages of `LATE_SIZE` bytes, tag 5) and tests its sends, with no
/// receive of tag 5 posted, only one of tag 6, which it tests all along;
/// then it posts its first `LATE_FIRST` tag-5 receives, 300 ms later the
/// others, and checks every message, in order; last it sends the peer a
/// tag-6 message for its first receive. A message small enough to go
/// eagerly is sent before its receive exists, and the receiving side keeps
/// it until then (its sender waits once that side holds as many as it
/// can); a larger one waits for its receive. Returns how many of this
/// rank's tag-5 messages were sent before it posted its own first tag-5
/// receives, and before the others. With eager messages on
/// (`METAROCE_EAGER_BYTES`, 8192 unless set, at least `LATE_SIZE`) the first
/// must be more than the receiving side copies aside (64); either way the
/// first receives must let `LATE_FIRST` more messages go than the receiving
/// side holds without receives (64 copied aside and 32 bounce buffers with
/// eager messages, none without).
fn run_late(c: &Comms, rank: usize, count: usize, b: &mut Bufs) -> Result<(usize, usize), String> {
    let t = c.t;
    let peer = 1 - rank;
    let eager = std::env::var("METAROCE_EAGER_BYTES")
        .ok()
        .and_then(|v| v.trim().parse::<usize>().ok())
        .unwrap_or(8192);
    let (sbuf, rbuf, smh, rmh) = (&mut b.sbuf, &mut b.rbuf, b.smh, b.rmh);
    if (count + 1) * LATE_SIZE > sbuf.len().min(rbuf.len()) {
        return Err("buffers too small for the late-receiver run".into());
    }
    for m in 0..=count {
        fill(
            &mut sbuf[m * LATE_SIZE..(m + 1) * LATE_SIZE],
            rank,
            LATE_SIZE,
            m,
        );
    }
    let (mut posted_s, mut sent) = (0, 0);
    let mut sends: std::collections::VecDeque<Ptr> = Default::default();
    let mut recvs: std::collections::VecDeque<(Ptr, usize)> = Default::default();
    let (mut posted_r, mut recvd) = (0, 0);
    let start = Instant::now();
    let deadline = start + Duration::from_secs(120);
    let (mut ahead, mut ahead_first) = (None, None);
    // The receive of tag 6, at the end of the buffer; and the send of the
    // peer's, once every tag-5 message is through.
    let other = rbuf[count * LATE_SIZE..].as_mut_ptr();
    let mut other_recv = Some(loop {
        if let Some(r) = t.irecv(c.recv, &[(other, LATE_SIZE, 6)], rmh)? {
            break r;
        }
    });
    let mut other_send: Option<Option<Ptr>> = None;
    while sent < count || recvd < count || other_recv.is_some() || other_send != Some(None) {
        let elapsed = start.elapsed();
        let receiving = elapsed >= Duration::from_millis(300);
        if receiving && ahead.is_none() {
            ahead = Some(sent);
        }
        let all = elapsed >= Duration::from_millis(600);
        if all && ahead_first.is_none() {
            ahead_first = Some(sent);
        }
        let may_post = if all { count } else { LATE_FIRST.min(count) };
        while posted_s < count && sends.len() < NCCL_NET_MAX_REQUESTS {
            let p = sbuf[posted_s * LATE_SIZE..].as_ptr();
            match t.isend(c.send, p, LATE_SIZE, 5, smh)? {
                Some(r) => {
                    sends.push_back(r);
                    posted_s += 1;
                }
                None => break,
            }
        }
        while receiving && posted_r < may_post && recvs.len() < NCCL_NET_MAX_REQUESTS {
            let p = rbuf[posted_r * LATE_SIZE..].as_mut_ptr();
            match t.irecv(c.recv, &[(p, LATE_SIZE, 5)], rmh)? {
                Some(r) => {
                    recvs.push_back((r, posted_r));
                    posted_r += 1;
                }
                None => break,
            }
        }
        let mut progressed = false;
        while let Some(&r) = sends.front() {
            if t.test(r, 1)?.is_none() {
                break;
            }
            sends.pop_front();
            sent += 1;
            progressed = true;
        }
        if sent == count && other_send.is_none() {
            let p = sbuf[count * LATE_SIZE..].as_ptr();
            if let Some(r) = t.isend(c.send, p, LATE_SIZE, 6, smh)? {
                other_send = Some(Some(r));
            }
        }
        if let Some(Some(r)) = other_send {
            if t.test(r, 1)?.is_some() {
                other_send = Some(None);
                progressed = true;
            }
        }
        if let Some(r) = other_recv {
            if let Some(sz) = t.test(r, 1)? {
                if sz[0] as usize != LATE_SIZE {
                    return Err(format!("tag-6 message: {} bytes", sz[0]));
                }
                verify_bytes(
                    &rbuf[count * LATE_SIZE..(count + 1) * LATE_SIZE],
                    peer,
                    LATE_SIZE,
                    count,
                )?;
                other_recv = None;
                progressed = true;
            }
        }
        while let Some(&(r, m)) = recvs.front() {
            let Some(sz) = t.test(r, 1)? else { break };
            if sz[0] as usize != LATE_SIZE {
                return Err(format!("late message {m}: {} bytes", sz[0]));
            }
            verify_bytes(
                &rbuf[m * LATE_SIZE..(m + 1) * LATE_SIZE],
                peer,
                LATE_SIZE,
                m,
            )?;
            recvs.pop_front();
            recvd += 1;
            progressed = true;
        }
        if !progressed {
            std::thread::yield_now();
        }
        if Instant::now() > deadline {
            return Err(format!(
                "late receiver: {sent}/{count} sent, {recvd}/{count} received after 120 s"
            ));
        }
    }
    let ahead = ahead.unwrap_or(sent);
    let ahead_first = ahead_first.unwrap_or(sent);
    if eager >= LATE_SIZE && ahead <= 64 {
        return Err(format!(
            "only {ahead} eager messages went before any receive was posted"
        ));
    }
    // The peer holds what it copies aside and its bounce buffers (the
    // plugin's 64 and 32) before any receive; each receive frees one more.
    // (The peer's clock runs a few ms apart: some of `ahead` may already
    // have gone on its first receives.)
    let holds = if eager >= LATE_SIZE { 64 + 32 } else { 0 };
    if ahead_first < (holds + LATE_FIRST).min(count) {
        return Err(format!(
            "{ahead} messages went before any receive was posted, only {ahead_first} \
             once {LATE_FIRST} were"
        ));
    }
    Ok((ahead, ahead_first))
}

/// Tags of a grouped receive the harness tests at most.
const MAX_GROUP: usize = 8;

fn bench(c: &Comms, a: &Args, b: &mut Bufs) -> Result<(), String> {
    let mut rows = Vec::new();
    if a.rank == 0 && !a.json {
        println!(
            "# sendrecv over ncclNetPlugin_v{}: chunk {} B, window {}",
            c.t.version(),
            a.chunk,
            a.window
        );
        println!(
            "#{:>12} {:>8} {:>10} {:>8} {:>8}",
            "size", "count", "time(us)", "algbw", "busbw"
        );
        println!(
            "#{:>12} {:>8} {:>10} {:>8} {:>8}",
            "(B)", "(iter)", "", "(GB/s)", "(GB/s)"
        );
    }
    let mut size = 8usize;
    while size <= a.max_size {
        let chunk = a.chunk.min(size).max(1);
        let chunks = size.div_ceil(chunk).max(1);
        let iters = if a.iters > 0 {
            a.iters
        } else {
            ((64usize << 20) / size).clamp(5, 200)
        };
        // Warm up (connections, first packets), then time.
        run_size(c, a.rank, chunk, (chunks * 2, a.window), b, false)?;
        let t0 = Instant::now();
        run_size(c, a.rank, chunk, (chunks * iters, a.window), b, false)?;
        let us = t0.elapsed().as_secs_f64() * 1e6 / iters as f64;
        let algbw = size as f64 / us / 1e3;
        if a.rank == 0 && !a.json {
            println!(" {size:>12} {iters:>8} {us:>10.1} {algbw:>8.3} {algbw:>8.3}");
        }
        rows.push(serde_json::json!({"size": size, "count": iters, "time_us": us, "algbw_gbps": algbw, "busbw_gbps": algbw}));
        size *= 2;
    }
    let mut rtts = pingpong(c, a.rank, a.pingpongs, b)?;
    rtts.sort_by(|x, y| x.total_cmp(y));
    let pct = |p: f64| {
        rtts.get(((rtts.len() as f64 * p) as usize).min(rtts.len().saturating_sub(1)))
            .copied()
            .unwrap_or(0.0)
    };
    if a.rank == 0 {
        if a.json {
            let out = serde_json::json!({
                "plugin_version": c.t.version(), "chunk": a.chunk, "window": a.window,
                "sendrecv": rows, "rtt_8b_us": {"p50": pct(0.5), "p99": pct(0.99), "samples": rtts.len()},
            });
            println!("{out}");
        } else {
            println!(
                "# 8 B round trip: p50 {:.1} us, p99 {:.1} us ({} samples)",
                pct(0.5),
                pct(0.99),
                rtts.len()
            );
        }
    }
    Ok(())
}

fn main() {
    if let Err(e) = run() {
        eprintln!(
            "[rank {}] harness failed: {e}",
            RANK.load(Ordering::Relaxed)
        );
        std::process::exit(1);
    }
}
