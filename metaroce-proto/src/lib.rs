//! Sans-IO protocol core of metaroce.
#![forbid(unsafe_code)]
#![warn(missing_docs)]

pub mod consts;
pub mod wire;
