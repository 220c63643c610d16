//! The C ABI: `include/metaroce.h` matches `src/capi.rs`, and the C example
//! builds with the system compiler against the header and the shared
//! library, and runs.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

fn crate_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The functions `src/capi.rs` exports.
fn exported_functions() -> Vec<String> {
    let src = std::fs::read_to_string(crate_dir().join("src/capi.rs")).expect("capi.rs");
    let mut names = Vec::new();
    let mut no_mangle = false;
    for line in src.lines().map(str::trim) {
        if line == "#[no_mangle]" {
            no_mangle = true;
            continue;
        }
        if no_mangle {
            if let Some(rest) = line.split("extern \"C\" fn ").nth(1) {
                let name = rest.split('(').next().unwrap_or("").trim();
                names.push(name.to_string());
            }
            no_mangle = false;
        }
    }
    names
}

/// The functions the header declares (a name followed by `(`, starting a
/// declaration line after its return type).
fn declared_functions(header: &str) -> Vec<String> {
    let mut names = Vec::new();
    for line in header.lines() {
        if line.trim_start().starts_with("//") || line.trim_start().starts_with('#') {
            continue;
        }
        for (i, _) in line.match_indices("metaroce_") {
            let rest = &line[i..];
            let name: String = rest
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            if rest[name.len()..].starts_with('(') {
                names.push(name);
            }
        }
    }
    names
}

#[test]
fn header_declares_exactly_what_the_library_exports() {
    let header =
        std::fs::read_to_string(crate_dir().join("include/metaroce.h")).expect("metaroce.h");
    let mut exported = exported_functions();
    let mut declared = declared_functions(&header);
    exported.sort();
    declared.sort();
    assert!(exported.len() >= 20, "too few exports found: {exported:?}");
    assert_eq!(
        exported, declared,
        "header and src/capi.rs differ: regenerate with cbindgen"
    );
    // The plugin's NCCL tables are not part of the C API.
    assert!(!header.contains("ncclNetPlugin"));
}

/// With `cbindgen` installed (PATH or `CBINDGEN`), the committed header is
/// exactly what it generates.
#[test]
fn header_is_what_cbindgen_generates() {
    let tool = std::env::var("CBINDGEN").unwrap_or_else(|_| "cbindgen".into());
    let dir = crate_dir();
    let out = common::scratch("cbindgen").join("metaroce.h");
    let run = Command::new(&tool)
        .arg("--config")
        .arg(dir.join("cbindgen.toml"))
        .arg("--output")
        .arg(&out)
        .arg(&dir)
        .output();
    let run = match run {
        Ok(r) => r,
        Err(e) => {
            println!(
                "skipped: no cbindgen ({tool}: {e}); `cargo install --locked cbindgen` to check"
            );
            return;
        }
    };
    assert!(
        run.status.success(),
        "cbindgen failed: {}",
        String::from_utf8_lossy(&run.stderr)
    );
    let fresh = std::fs::read_to_string(&out).expect("generated header");
    let committed = std::fs::read_to_string(dir.join("include/metaroce.h")).expect("metaroce.h");
    assert_eq!(
        committed, fresh,
        "include/metaroce.h is stale: regenerate it (see cbindgen.toml)"
    );
}

fn compile(src: &Path, exe: &Path, lang: &str) -> std::process::Output {
    let lib_dir = common::cdylib().parent().expect("lib dir").to_path_buf();
    let compiler = if lang == "c++" { "c++" } else { "cc" };
    Command::new(compiler)
        .args(["-Wall", "-Wextra", "-Werror", "-x", lang])
        .arg(src)
        .arg("-I")
        .arg(crate_dir().join("include"))
        .arg("-L")
        .arg(&lib_dir)
        .arg("-lmetaroce_nccl")
        .arg(format!("-Wl,-rpath,{}", lib_dir.display()))
        .arg("-o")
        .arg(exe)
        .output()
        .expect("run the C compiler (cc)")
}

#[test]
fn c_example_builds_and_runs() {
    let dir = common::scratch("c-example");
    let exe = dir.join("hello");
    let cc = compile(&crate_dir().join("examples/c/hello.c"), &exe, "c");
    assert!(
        cc.status.success(),
        "cc failed:\n{}",
        String::from_utf8_lossy(&cc.stderr)
    );
    let run = Command::new(&exe).output().expect("run the example");
    let stdout = String::from_utf8_lossy(&run.stdout);
    assert!(
        run.status.success(),
        "example failed: {}\n{stdout}",
        String::from_utf8_lossy(&run.stderr)
    );
    assert_eq!(stdout.trim(), "hello from C over metaroce");
    // The header also compiles as C++ (`extern "C"` guards).
    if Command::new("c++").arg("--version").output().is_ok() {
        let cxx = compile(
            &crate_dir().join("examples/c/hello.c"),
            &dir.join("hello++"),
            "c++",
        );
        assert!(
            cxx.status.success(),
            "c++ failed:\n{}",
            String::from_utf8_lossy(&cxx.stderr)
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}
