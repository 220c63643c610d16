//! The XDP program that steers the endpoint's datagrams to its AF_XDP
//! socket, and the `bpf(2)` calls that load and attach it.
//!
//! The program is 40 instructions, written here as instructions: it needs no
//! BPF toolchain (clang, bpf-linker, a nightly compiler) on any machine that
//! builds metaroce, and what is loaded is exactly what this file says. It
//! matches IPv4 (no options, not a fragment) UDP to the endpoint's address
//! and port, and redirects such a frame to the AF_XDP socket of the queue it
//! arrived on (`XSKMAP[rx_queue_index]`); everything else (ARP, ICMP, TCP,
//! other UDP) is passed to the kernel, and so is a matching frame on a queue
//! without a socket. A per-CPU array counts passed and redirected frames.
//!
//! The program is attached with a BPF link (`BPF_LINK_CREATE`): the kernel
//! detaches it when the link's last descriptor closes, so a process that
//! exits (or crashes) leaves no program behind. It is loaded with
//! `BPF_F_XDP_HAS_FRAGS`: it reads only the first buffer's headers, and a
//! veth whose peer has a jumbo MTU takes no other kind of program.

use std::io;
use std::net::Ipv4Addr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

const BPF_MAP_CREATE: libc::c_long = 0;
const BPF_MAP_LOOKUP_ELEM: libc::c_long = 1;
const BPF_MAP_UPDATE_ELEM: libc::c_long = 2;
const BPF_PROG_LOAD: libc::c_long = 5;
const BPF_LINK_CREATE: libc::c_long = 28;

const BPF_MAP_TYPE_PERCPU_ARRAY: u32 = 6;
const BPF_MAP_TYPE_XSKMAP: u32 = 17;
const BPF_PROG_TYPE_XDP: u32 = 6;
/// `enum bpf_attach_type`: `BPF_XDP`.
const BPF_XDP: u32 = 37;
const BPF_F_XDP_HAS_FRAGS: u32 = 1 << 5;
/// `XDP_FLAGS_SKB_MODE`: the generic (any driver) hook.
pub(crate) const XDP_FLAGS_SKB_MODE: u32 = 1 << 1;
/// `XDP_FLAGS_DRV_MODE`: the driver's own hook.
pub(crate) const XDP_FLAGS_DRV_MODE: u32 = 1 << 2;

/// Counter slots of the statistics map.
pub(crate) const COUNT_PASS: u32 = 0;
pub(crate) const COUNT_REDIRECT: u32 = 1;
const COUNTERS: u32 = 2;

/// One BPF instruction (`struct bpf_insn`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(C)]
pub(crate) struct Insn {
    code: u8,
    /// dst in the low nibble, src in the high one.
    regs: u8,
    off: i16,
    imm: i32,
}

impl Insn {
    const fn new(code: u8, dst: u8, src: u8, off: i16, imm: i32) -> Insn {
        Insn {
            code,
            regs: (src << 4) | (dst & 0x0f),
            off,
            imm,
        }
    }
    /// The instruction's 8 bytes as the kernel reads them.
    pub(crate) fn to_bytes(self) -> [u8; 8] {
        let o = self.off.to_le_bytes();
        let i = self.imm.to_le_bytes();
        [self.code, self.regs, o[0], o[1], i[0], i[1], i[2], i[3]]
    }
}

// Opcodes (class | size/op | mode/source).
const LDX_W: u8 = 0x61;
const LDX_H: u8 = 0x69;
const LDX_B: u8 = 0x71;
const LDX_DW: u8 = 0x79;
const STX_DW: u8 = 0x7b;
const ST_W: u8 = 0x62;
const MOV64_X: u8 = 0xbf;
const MOV64_K: u8 = 0xb7;
const ADD64_K: u8 = 0x07;
const AND64_K: u8 = 0x57;
const JGT_X: u8 = 0x2d;
const JNE_K: u8 = 0x55;
const JNE32_K: u8 = 0x56;
const JEQ_K: u8 = 0x15;
const CALL: u8 = 0x85;
const EXIT: u8 = 0x95;
const LD_IMM64: u8 = 0x18;
/// `src_reg` of a 64-bit immediate load that names a map by descriptor.
const PSEUDO_MAP_FD: u8 = 1;

const HELPER_MAP_LOOKUP: i32 = 1;
const HELPER_REDIRECT_MAP: i32 = 51;
const XDP_PASS: i32 = 2;
const XDP_REDIRECT: i32 = 4;

/// The program, for frames to `ip`:`port`, with the descriptors of the
/// socket map and the counter map.
pub(crate) fn program(ip: Ipv4Addr, port: u16, xsk_map: i32, counters: i32) -> Vec<Insn> {
    // Loads of packet bytes read them as little-endian integers: compare
    // with the wire bytes read the same way.
    let ip_k = u32::from_le_bytes(ip.octets()) as i32;
    let port_k = i32::from(u16::from_le_bytes(port.to_be_bytes()));
    let ethertype_ipv4 = i32::from(u16::from_le_bytes([0x08, 0x00]));
    // IPv4 flags/fragment offset with DF masked out: non-zero is a fragment.
    let frag_mask = i32::from(u16::from_le_bytes([0x3f, 0xff]));
    let i = Insn::new;
    let mut p = vec![
        // r6 = ctx; r2 = data; r3 = data_end
        i(MOV64_X, 6, 1, 0, 0),
        i(LDX_W, 2, 1, 0, 0),
        i(LDX_W, 3, 1, 4, 0),
        // 42 bytes of Ethernet, IPv4 and UDP headers, or pass.
        i(MOV64_X, 4, 2, 0, 0),
        i(ADD64_K, 4, 0, 0, 42),
        i(JGT_X, 4, 3, 0, 0), // -> pass (patched)
        i(LDX_H, 4, 2, 12, 0),
        i(JNE_K, 4, 0, 0, ethertype_ipv4), // -> pass
        i(LDX_B, 4, 2, 14, 0),
        i(JNE_K, 4, 0, 0, 0x45), // version 4, 20-byte header -> else pass
        i(LDX_B, 4, 2, 23, 0),
        i(JNE_K, 4, 0, 0, 17), // UDP -> else pass
        i(LDX_H, 4, 2, 20, 0),
        i(AND64_K, 4, 0, 0, frag_mask),
        i(JNE_K, 4, 0, 0, 0), // a fragment -> pass
        i(LDX_W, 4, 2, 30, 0),
        i(JNE32_K, 4, 0, 0, ip_k), // not our address -> pass
        i(LDX_H, 4, 2, 36, 0),
        i(JNE_K, 4, 0, 0, port_k), // not our port -> pass
        // redirect: r1 = xsk map, r2 = rx_queue_index, r3 = XDP_PASS
        // (what bpf_redirect_map returns when the queue has no socket).
        i(LD_IMM64, 1, PSEUDO_MAP_FD, 0, xsk_map),
        i(0, 0, 0, 0, 0),
        i(LDX_W, 2, 6, 16, 0),
        i(MOV64_K, 3, 0, 0, XDP_PASS),
        i(CALL, 0, 0, 0, HELPER_REDIRECT_MAP),
        // Count the verdict: slot 1 when redirected, else slot 0.
        i(MOV64_X, 7, 0, 0, 0),
        i(ST_W, 10, 0, -4, COUNT_REDIRECT as i32),
        i(JEQ_K, 7, 0, 0, XDP_REDIRECT), // -> count (patched)
    ];
    let pass = p.len();
    p.extend([
        i(MOV64_K, 7, 0, 0, XDP_PASS),
        i(ST_W, 10, 0, -4, COUNT_PASS as i32),
    ]);
    let count = p.len();
    p.extend([
        i(LD_IMM64, 1, PSEUDO_MAP_FD, 0, counters),
        i(0, 0, 0, 0, 0),
        i(MOV64_X, 2, 10, 0, 0),
        i(ADD64_K, 2, 0, 0, -4),
        i(CALL, 0, 0, 0, HELPER_MAP_LOOKUP),
        i(JEQ_K, 0, 0, 3, 0), // no slot: skip the increment
        i(LDX_DW, 1, 0, 0, 0),
        i(ADD64_K, 1, 0, 0, 1),
        i(STX_DW, 0, 1, 0, 0),
        i(MOV64_X, 0, 7, 0, 0),
        i(EXIT, 0, 0, 0, 0),
    ]);
    // Patch the jumps: every early "-> pass" and the "-> count".
    for (at, insn) in p.iter_mut().enumerate() {
        let to_pass = matches!(insn.code, JGT_X | JNE_K | JNE32_K) && at < pass;
        let to_count = insn.code == JEQ_K && at < pass;
        if to_pass {
            insn.off = (pass - at - 1) as i16;
        } else if to_count {
            insn.off = (count - at - 1) as i16;
        }
    }
    p
}

/// `bpf(2)`.
fn bpf(cmd: libc::c_long, attr: &mut [u64], size: usize) -> io::Result<i64> {
    debug_assert!(size <= std::mem::size_of_val(attr));
    // SAFETY: `attr` is a zero-padded, 8-byte aligned buffer at least
    // `size` bytes long that outlives the call; the kernel reads (and for
    // some commands writes) only the first `size` bytes.
    let r = unsafe { libc::syscall(libc::SYS_bpf, cmd, attr.as_mut_ptr(), size) };
    if r < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(r)
    }
}

/// Writes `v` at byte offset `at` of an attribute buffer.
fn put32(attr: &mut [u64], at: usize, v: u32) {
    let word = &mut attr[at / 8];
    let shift = (at % 8) * 8;
    *word = (*word & !(0xffff_ffffu64 << shift)) | (u64::from(v) << shift);
}

fn take_fd(r: i64) -> OwnedFd {
    // SAFETY: a successful bpf() command that creates an object returns a
    // new descriptor that nothing else owns.
    unsafe { OwnedFd::from_raw_fd(r as i32) }
}

/// A BPF map.
#[derive(Debug)]
pub(crate) struct Map {
    fd: OwnedFd,
    value_size: usize,
}

impl Map {
    fn create(kind: u32, value_size: u32, entries: u32, name: &[u8]) -> io::Result<Map> {
        let mut attr = [0u64; 6];
        put32(&mut attr, 0, kind);
        put32(&mut attr, 4, 4); // key: u32
        put32(&mut attr, 8, value_size);
        put32(&mut attr, 12, entries);
        let mut n = [0u8; 16];
        n[..name.len().min(15)].copy_from_slice(&name[..name.len().min(15)]);
        // map_name at 28..44
        for (k, b) in n.iter().enumerate() {
            let at = 28 + k;
            attr[at / 8] |= u64::from(*b) << ((at % 8) * 8);
        }
        let fd = take_fd(bpf(BPF_MAP_CREATE, &mut attr, 44)?);
        Ok(Map {
            fd,
            value_size: value_size as usize,
        })
    }

    /// The socket map, one slot per receive queue.
    pub(crate) fn xsk(queues: u32) -> io::Result<Map> {
        Map::create(BPF_MAP_TYPE_XSKMAP, 4, queues.max(1), b"metaroce_xsk")
    }

    /// The per-CPU counters.
    pub(crate) fn counters() -> io::Result<Map> {
        Map::create(BPF_MAP_TYPE_PERCPU_ARRAY, 8, COUNTERS, b"metaroce_cnt")
    }

    pub(crate) fn fd(&self) -> i32 {
        self.fd.as_raw_fd()
    }

    fn elem(&self, cmd: libc::c_long, key: u32, value: *mut u8) -> io::Result<()> {
        let mut key = key;
        let mut attr = [0u64; 4];
        put32(&mut attr, 0, self.fd() as u32);
        attr[1] = std::ptr::addr_of_mut!(key) as u64;
        attr[2] = value as u64;
        bpf(cmd, &mut attr, 32).map(|_| ())
    }

    /// Puts socket `fd` in slot `queue` of a socket map.
    pub(crate) fn set_socket(&self, queue: u32, fd: i32) -> io::Result<()> {
        let mut v = fd;
        self.elem(BPF_MAP_UPDATE_ELEM, queue, std::ptr::addr_of_mut!(v).cast())
    }

    /// The sum over CPUs of counter `slot` (a per-CPU map of u64).
    pub(crate) fn sum(&self, slot: u32, cpus: usize) -> io::Result<u64> {
        // Per-CPU values come 8-byte aligned, one per possible CPU.
        let stride = self.value_size.div_ceil(8);
        let mut v = vec![0u64; stride * cpus.max(1)];
        self.elem(BPF_MAP_LOOKUP_ELEM, slot, v.as_mut_ptr().cast())?;
        Ok(v.iter().step_by(stride).sum())
    }
}

/// The number of CPUs a per-CPU map has values for (`possible` CPUs).
pub(crate) fn possible_cpus() -> usize {
    let parse = |s: &str| -> Option<usize> {
        let mut n = 0;
        for part in s.trim().split(',') {
            let (a, b) = match part.split_once('-') {
                Some((a, b)) => (a.parse::<usize>().ok()?, b.parse::<usize>().ok()?),
                None => {
                    let a = part.parse::<usize>().ok()?;
                    (a, a)
                }
            };
            n = n.max(b + 1).max(a + 1);
        }
        Some(n)
    };
    std::fs::read_to_string("/sys/devices/system/cpu/possible")
        .ok()
        .and_then(|s| parse(&s))
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
}

/// A loaded program.
#[derive(Debug)]
pub(crate) struct Program {
    fd: OwnedFd,
}

impl Program {
    /// Loads `insns` as an XDP program; on refusal the error carries the
    /// verifier's log.
    pub(crate) fn load(insns: &[Insn]) -> Result<Program, (io::Error, String)> {
        let bytes: Vec<u8> = insns.iter().flat_map(|i| i.to_bytes()).collect();
        let license = b"Dual MIT/GPL\0";
        let mut log = vec![0u8; 64 << 10];
        let mut attr = [0u64; 10];
        put32(&mut attr, 0, BPF_PROG_TYPE_XDP);
        put32(&mut attr, 4, insns.len() as u32);
        attr[1] = bytes.as_ptr() as u64;
        attr[2] = license.as_ptr() as u64;
        put32(&mut attr, 24, 1); // log_level
        put32(&mut attr, 28, log.len() as u32);
        attr[4] = log.as_mut_ptr() as u64;
        put32(&mut attr, 44, BPF_F_XDP_HAS_FRAGS);
        let name = b"metaroce_xdp";
        for (k, b) in name.iter().enumerate() {
            let at = 48 + k;
            attr[at / 8] |= u64::from(*b) << ((at % 8) * 8);
        }
        put32(&mut attr, 68, BPF_XDP);
        match bpf(BPF_PROG_LOAD, &mut attr, 72) {
            Ok(fd) => Ok(Program { fd: take_fd(fd) }),
            Err(e) => {
                let end = log.iter().position(|&b| b == 0).unwrap_or(log.len());
                Err((e, String::from_utf8_lossy(&log[..end]).into_owned()))
            }
        }
    }

    /// Attaches to interface `ifindex` with a link (`flags`: the hook,
    /// [`XDP_FLAGS_DRV_MODE`] or [`XDP_FLAGS_SKB_MODE`]). Detached when the
    /// returned link is dropped.
    pub(crate) fn attach(&self, ifindex: u32, flags: u32) -> io::Result<OwnedFd> {
        let mut attr = [0u64; 4];
        put32(&mut attr, 0, self.fd.as_raw_fd() as u32);
        put32(&mut attr, 4, ifindex);
        put32(&mut attr, 8, BPF_XDP);
        put32(&mut attr, 12, flags);
        bpf(BPF_LINK_CREATE, &mut attr, 16).map(take_fd)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_jump_lands_inside_the_program_and_it_ends_in_exit() {
        let p = program(Ipv4Addr::new(10, 77, 2, 1), 18515, 3, 4);
        assert_eq!(p.last().unwrap().code, EXIT);
        for (at, insn) in p.iter().enumerate() {
            if matches!(insn.code, JGT_X | JNE_K | JNE32_K | JEQ_K) {
                let to = at as i64 + 1 + i64::from(insn.off);
                assert!(to > at as i64 && (to as usize) < p.len(), "jump at {at}");
            }
        }
        assert_eq!(p.len(), 40);
    }

    #[test]
    fn the_port_and_address_are_compared_as_the_wire_carries_them() {
        let p = program(Ipv4Addr::new(10, 77, 2, 1), 0x4853, 3, 4);
        let port = p.iter().find(|i| i.code == JNE_K && i.imm == 0x5348);
        assert!(port.is_some(), "port 0x4853 is the bytes 48 53 on the wire");
        let ip = p.iter().find(|i| i.code == JNE32_K).unwrap();
        assert_eq!(ip.imm.to_le_bytes(), [10, 77, 2, 1]);
    }

    #[test]
    fn the_cpu_list_is_parsed() {
        assert!(possible_cpus() >= 1);
    }
}
