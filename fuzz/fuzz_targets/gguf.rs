//! A GGUF file: the reader (`GgufFile::open`: header, metadata, tensor table, layout), the
//! tokenizer rebuilt from its metadata, and the whole `qwen35` model load with a short run.

#![no_main]

use std::sync::OnceLock;

use libfuzzer_sys::fuzz_target;
use strix::gguf::GgufFile;
use strix::tokenizer::Tokenizer;
use strix_fuzz::{check_error, load_and_run, scratch_dir};

fuzz_target!(|data: &[u8]| {
    static DIR: OnceLock<std::path::PathBuf> = OnceLock::new();
    let dir = DIR.get_or_init(|| scratch_dir("gguf"));
    let path = dir.join("input.gguf");
    std::fs::write(&path, data).expect("writing the input");
    match GgufFile::open(&path) {
        Ok(file) => {
            if let Err(e) = Tokenizer::from_gguf(&file) {
                check_error(&e, dir);
            }
            load_and_run(&path, dir);
        }
        Err(e) => check_error(&e, dir),
    }
});
