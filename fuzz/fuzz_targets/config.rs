//! A `config.json`: parsed and validated (`ModelConfig::from_json_str`), and when it passes,
//! the whole load of a model directory holding it beside the `causal-bf16-gdn3x` fixture's
//! weights, with a short run.

#![no_main]

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use strix::config::ModelConfig;
use strix_fuzz::{fixture, load_and_run, scratch_dir};

fuzz_target!(|data: &[u8]| {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    let dir = DIR.get_or_init(|| {
        let dir = scratch_dir("config");
        std::fs::copy(fixture("models/causal-bf16-gdn3x/model.safetensors"), dir.join("model.safetensors"))
            .expect("copying the weights");
        dir
    });
    let Ok(text) = std::str::from_utf8(data) else { return };
    match ModelConfig::from_json_str(text, Path::new("config.json")) {
        Ok(_) => {
            std::fs::write(dir.join("config.json"), data).expect("writing the input");
            load_and_run(dir, dir);
        }
        Err(e) => {
            let msg = e.to_string();
            assert!(msg.starts_with("config.json: "), "the error does not name the file: {msg}");
            assert!(msg.len() <= 2048, "a {}-byte message: {msg}", msg.len());
            assert!(!msg.chars().any(char::is_control), "control characters in: {msg:?}");
        }
    }
});
