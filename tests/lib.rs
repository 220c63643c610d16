//! Cross-crate and end-to-end tests of metaroce; the tests themselves are in
//! this directory's `*.rs` files (`cargo test -p metaroce-tests`).
