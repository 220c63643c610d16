//! Errors of the plugin and how they map onto NCCL's result codes.

use crate::abi::*;
use metaroce_io::{ApiError, WcStatus};

/// Why a plugin call failed.
#[derive(Debug, thiserror::Error)]
pub enum NetError {
    /// NCCL passed something the plugin cannot use.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// The environment configures the plugin wrongly.
    #[error("configuration: {0}")]
    Config(#[from] crate::ConfigError),
    /// The plugin was used before `init`.
    #[error("the plugin is not initialized (init not called)")]
    NotInitialized,
    /// The transport refused or failed a call.
    #[error(transparent)]
    Api(#[from] ApiError),
    /// A socket of the connection set-up failed.
    #[error("connection set-up: {0}")]
    Io(#[from] std::io::Error),
    /// The peer broke the set-up protocol or sent a message this side
    /// cannot place.
    #[error("peer: {0}")]
    Remote(String),
}

impl NetError {
    /// The `ncclResult_t` NCCL gets for it.
    ///
    /// ```
    /// use metaroce_nccl::{abi, NetError};
    /// assert_eq!(NetError::NotInitialized.code(), abi::NCCL_INVALID_USAGE);
    /// ```
    pub fn code(&self) -> NcclResult {
        match self {
            NetError::InvalidArgument(_) => NCCL_INVALID_ARGUMENT,
            NetError::Config(_) | NetError::NotInitialized => NCCL_INVALID_USAGE,
            NetError::Io(_) => NCCL_SYSTEM_ERROR,
            NetError::Remote(_) => NCCL_REMOTE_ERROR,
            NetError::Api(e) => match e {
                ApiError::Connection(_) | ApiError::Closed => NCCL_REMOTE_ERROR,
                ApiError::Failed(wc) => match wc.status {
                    WcStatus::RetryExceeded
                    | WcStatus::RnrRetryExceeded
                    | WcStatus::RemoteAccessError
                    | WcStatus::RemoteInvalidRequest
                    | WcStatus::RemoteOperationError => NCCL_REMOTE_ERROR,
                    _ => NCCL_INTERNAL_ERROR,
                },
                ApiError::Driver(_) => NCCL_SYSTEM_ERROR,
                _ => NCCL_INTERNAL_ERROR,
            },
        }
    }
}
