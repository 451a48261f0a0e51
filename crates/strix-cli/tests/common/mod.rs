//! What the tests of the `strix` binary share: the binary under test, the committed
//! fixtures, running the binary (on the CPU unless a test says otherwise) and reading what it
//! printed. Each test binary uses a different part of this module.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use serde_json::Value;

/// The committed fixtures beside the sources (`tests/fixtures`).
pub fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures")
}

/// The `strix` under test: `$STRIX_BIN` when set (a prebuilt binary), else the one cargo built.
pub fn strix_bin() -> PathBuf {
    std::env::var_os("STRIX_BIN").map_or_else(|| PathBuf::from(env!("CARGO_BIN_EXE_strix")), PathBuf::from)
}

/// Runs `strix` with `args` and `stdin` (empty when `None`). The device defaults to the CPU
/// (through `STRIX_DEVICE`, which a `--device` flag overrides): the goldens hold the CPU to
/// 1e-4, and on a machine with a GPU `auto` would pick the GPU; the `device_*` tests pass
/// `--device` themselves.
pub fn strix_with_stdin(args: &[&str], stdin: Option<&str>) -> Output {
    use std::io::Write;
    let mut child = Command::new(strix_bin())
        .args(args)
        .env("STRIX_DEVICE", "cpu")
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("start strix");
    let mut pipe = child.stdin.take().expect("stdin");
    if let Some(text) = stdin {
        pipe.write_all(text.as_bytes()).expect("write stdin");
    }
    drop(pipe);
    child.wait_with_output().expect("wait for strix")
}

/// Runs `strix` with `args` and nothing on stdin, on the CPU unless `args` say otherwise.
pub fn strix(args: &[&str]) -> Output {
    strix_with_stdin(args, None)
}

/// The command line `strix COMMAND --model MODEL FLAGS`, the flags written as one string (split
/// at white space: none of them holds a space).
pub fn cmd<'a>(command: &'a str, model: &'a str, flags: &'a str) -> Vec<&'a str> {
    [command, "--model", model].into_iter().chain(flags.split_whitespace()).collect()
}

/// What a run printed on stdout, as text.
pub fn stdout(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// What a run printed on stderr, as text.
pub fn stderr(out: &Output) -> String {
    String::from_utf8_lossy(&out.stderr).into_owned()
}

/// Runs `strix` and parses its stdout as one JSON object, failing with stderr on error.
pub fn strix_json(args: &[&str]) -> Value {
    json_of(args, &strix(args))
}

/// The stdout of a successful run (`what` names it) as one JSON object; a failure, or output
/// that is not JSON, fails the test with what it printed.
#[track_caller]
pub fn json_of(what: impl std::fmt::Debug, out: &Output) -> Value {
    assert!(out.status.success(), "strix {what:?} failed: {}", stderr(out));
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("stdout of {what:?} is not JSON ({e}): {}", stdout(out)))
}
