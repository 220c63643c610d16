//! metaroce-sim
