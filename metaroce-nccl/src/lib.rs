//! The NCCL/RCCL net plugin of metaroce, and a C ABI for embedding it.
//!
//! Built as a shared library (`cdylib`), this crate exports
//! `ncclNetPlugin_v8` … `ncclNetPlugin_v12`, the tables NCCL (and RCCL)
//! looks up in `libnccl-net-NAME.so` when `NCCL_NET_PLUGIN=NAME`: install
//! the library as `libnccl-net-metaroce.so` (see the README) and NCCL runs
//! its inter-node traffic over metaroce instead of its TCP sockets.
//! All versions call one implementation (the internal `net` module):
//!
//! - `init` reads the [`Config`] from `METAROCE_` environment variables
//!   (listed there) and keeps NCCL's logger: every error NCCL gets is also
//!   logged through it;
//! - `devices`/`getProperties`: one device per configured address (or
//!   interface), host memory only (`NCCL_PTR_HOST`);
//! - `listen`/`connect`/`accept`: one metaroce endpoint per device, shared
//!   by its comms (a QP each, on one connection per peer endpoint and
//!   direction), set up on a thread while NCCL keeps polling
//!   (`connect`/`accept` return a NULL comm until it is ready), the QP
//!   numbers exchanged over TCP as NCCL's IB transport does;
//! - `isend`/`irecv`/`test`: `irecv` announces its buffers to the peer
//!   (clear-to-send), `isend` WRITEs the message straight into the
//!   announced buffer of its tag, with the buffer's index as immediate
//!   data; grouped receives, the actual size of each message reported;
//!   `iflush` has nothing to do for host memory.
//!
//! # Memory
//!
//! NCCL registers its own buffers with `regMr`, and the plugin registers
//! them in place with the comm's protection domain (metaroce-io's
//! `reg_mr_raw`, as `ibv_reg_mr` does): a message goes from NCCL's send
//! buffer to NCCL's receive buffer with no copy on either side. The
//! internal `memory` module holds the one `unsafe` registration and why
//! NCCL's contract makes it sound (NCCL does not touch a buffer between
//! `isend`/`irecv` and the `test` that reports it done, and frees it only
//! after `deregMr`, which returns once the transport no longer reaches it).
//!
//! # The C ABI
//!
//! [`capi`] exports a small verbs API for C and C++ (device, PD, MR, CQ,
//! QP, post, poll), declared in `include/metaroce.h`.
//!
//! # Testing without GPUs
//!
//! The `metaroce-nccl-harness` binary loads the plugin with `dlopen` and
//! drives it as NCCL's proxy thread does, two ranks in two processes; the
//! crate's tests run it over loopback (and over `metaroce fabric` as root),
//! and its `--bench` mode prints what nccl-tests' `sendrecv_perf` prints.
//!
//! ```
//! // The tables are plain statics; NCCL finds them with dlsym.
//! let v8 = &metaroce_nccl::ncclNetPlugin_v8;
//! assert!(v8.init.is_some() && v8.reg_mr_dma_buf.is_none());
//! ```

pub mod abi;
pub mod capi;
mod config;
mod error;
mod export;
mod log;
mod memory;
mod net;

pub use config::{Config, ConfigError, DeviceSpec, Progress};
pub use error::NetError;
pub use export::{
    ncclNetPlugin_v10, ncclNetPlugin_v11, ncclNetPlugin_v12, ncclNetPlugin_v8, ncclNetPlugin_v9,
};
pub use net::{MAX_MESSAGE, MAX_RECVS};
