//! metaroce-io
