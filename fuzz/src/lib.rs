//! What the fuzz targets share: a scratch directory per process to write the input into
//! (the loaders read paths, as strix does in use), and the checks every outcome must pass.
//! A violated check panics, which libFuzzer reports as a crash with the input saved.

use std::path::{Path, PathBuf};

use strix::backend::cpu::CpuBackend;
use strix::model::{Logits, Model};

/// A directory of this process's own under the temporary directory (tmpfs `/dev/shm` when
/// there is one, so writing each input costs no disk).
pub fn scratch_dir(name: &str) -> PathBuf {
    let base = if Path::new("/dev/shm").is_dir() { PathBuf::from("/dev/shm") } else { std::env::temp_dir() };
    let dir = base.join(format!("strix-fuzz-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("creating the scratch directory");
    dir
}

/// The fixtures of the repository, for the files a target keeps fixed around its input.
pub fn fixture(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/fixtures").join(rel)
}

/// Checks an error a loader returned for a file under `root`: it names the file, carries no
/// control character, and is short.
pub fn check_error(e: &strix::Error, root: &Path) {
    let msg = e.to_string();
    assert!(msg.contains(&root.display().to_string()), "the error does not name the file: {msg}");
    assert!(msg.len() <= 2048, "a {}-byte message: {msg}", msg.len());
    assert!(!msg.chars().any(char::is_control), "control characters in: {msg:?}");
}

/// Loads `path` (a model directory or GGUF file under `root`) on the CPU; a model that loads
/// runs three tokens (its weights may hold anything: the pass must not panic).
pub fn load_and_run(path: &Path, root: &Path) {
    match Model::load_path(path, CpuBackend::new(), None) {
        Ok(model) => {
            let vocab = model.config.vocab_size as u32;
            let ids: Vec<u32> = [1, 2, 3].iter().map(|i| i % vocab).collect();
            let mut session = model.new_session(8);
            let _ = model.forward(&mut session, &ids, Logits::Last);
        }
        Err(e) => check_error(&e, root),
    }
}
