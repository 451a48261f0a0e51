//! A safetensors file as the weights of a model directory (the config of the
//! `causal-bf16-gdn3x` fixture beside it): the header check (`Checkpoint::open_files`), every
//! tensor it declares read back with its own shape, and the whole model load with a short run.

#![no_main]

use std::path::PathBuf;
use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use strix::checkpoint::Checkpoint;
use strix_fuzz::{check_error, fixture, load_and_run, scratch_dir};

fuzz_target!(|data: &[u8]| {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    let dir = DIR.get_or_init(|| {
        let dir = scratch_dir("safetensors");
        for f in ["config.json", "generation_config.json"] {
            std::fs::copy(fixture("models/causal-bf16-gdn3x").join(f), dir.join(f))
                .expect("copying the config");
        }
        dir
    });
    let path = dir.join("model.safetensors");
    std::fs::write(&path, data).expect("writing the input");
    match Checkpoint::open_files(std::slice::from_ref(&path)) {
        Ok(ckpt) => {
            let names: Vec<String> = ckpt.names().map(str::to_string).collect();
            for name in names.iter().take(64) {
                // Asked with a shape it does not have: an error naming the tensor and file.
                if let Err(e) = ckpt.tensor(name, &[3, 5]) {
                    check_error(&e, dir);
                }
            }
            load_and_run(dir, dir);
        }
        Err(e) => check_error(&e, dir),
    }
});
