//! Log lines through the logger NCCL gives `init` (stderr before that).

use crate::abi::*;
use std::ffi::CString;
use std::sync::Mutex;

static LOGGER: Mutex<NcclDebugLogger> = Mutex::new(None);

/// Keeps `logger` for the lines to come.
pub(crate) fn set_logger(logger: NcclDebugLogger) {
    *LOGGER.lock().unwrap_or_else(|e| e.into_inner()) = logger;
}

fn emit(level: std::ffi::c_int, line: u32, msg: &str) {
    let logger = *LOGGER.lock().unwrap_or_else(|e| e.into_inner());
    match logger {
        Some(f) => {
            let text = CString::new(msg.replace('\0', " ")).unwrap_or_default();
            // SAFETY: NCCL's logger is printf-like; "%s" with one
            // NUL-terminated string argument is a well-formed call, and both
            // strings outlive it.
            unsafe {
                f(
                    level,
                    NCCL_NET,
                    c"metaroce-nccl".as_ptr(),
                    line as std::ffi::c_int,
                    c"NET/metaroce: %s".as_ptr(),
                    text.as_ptr(),
                )
            };
        }
        None if level == NCCL_LOG_WARN => eprintln!("NET/metaroce: {msg}"),
        None => {}
    }
}

/// A warning (an error NCCL will see).
pub(crate) fn warn(line: u32, msg: &str) {
    emit(NCCL_LOG_WARN, line, msg);
}

/// An informational line.
pub(crate) fn info(line: u32, msg: &str) {
    emit(NCCL_LOG_INFO, line, msg);
}
