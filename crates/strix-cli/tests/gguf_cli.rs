//! The `strix` binary on GGUF files: `--model FILE.gguf` (tokenizer and chat template from the
//! file's metadata), `strix quantize`, and their errors.

mod common;

use std::path::Path;

use common::{fixtures, stderr, strix, strix_json as json};
use serde_json::Value;

fn greedy(model: &str, extra: &[&str]) -> (Value, Value) {
    let mut args = vec!["run", "--model", model, "--temperature", "0", "--max-tokens", "12", "--json"];
    args.extend_from_slice(extra);
    args.push("Hello world, how are you?");
    let v = json(&args);
    (v["prompt_ids"].clone(), v["ids"].clone())
}

/// A GGUF copy of a model directory, alone in a folder (so no tokenizer.json is beside it).
fn alone(src: &Path, dir: &Path) -> String {
    let dst = dir.join(src.file_name().unwrap());
    std::fs::copy(src, &dst).unwrap();
    dst.to_string_lossy().into_owned()
}

/// The GGUF file `gguf` (under the fixtures), alone in a folder, gives the greedy tokens of the
/// model directory `dir` it was converted from, on a plain prompt and through the chat template
/// (the file's tokenizer and template come from its metadata).
fn assert_runs_like_its_directory(gguf: &str, dir: &str) {
    let tmp = tempfile::tempdir().unwrap();
    let file = alone(&fixtures().join(gguf), tmp.path());
    let dir = fixtures().join(dir).to_string_lossy().into_owned();
    assert_eq!(greedy(&file, &[]), greedy(&dir, &[]), "plain prompt");
    assert_eq!(greedy(&file, &["--chat"]), greedy(&dir, &["--chat"]), "chat template from metadata");
}

#[test]
fn gguf_models_run_with_the_tokenizer_and_template_of_their_metadata() {
    assert_runs_like_its_directory("gguf-models/causal-bf16-gdn3x.bf16.gguf", "models/causal-bf16-gdn3x");
}

/// `strix quantize` writes a file strix runs; for Q8_0 it holds what llama-quantize makes of
/// the same model (the committed file), so both give the same tokens.
#[test]
fn quantize_writes_a_runnable_gguf() {
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("q8.gguf");
    let dir = fixtures().join("models/causal-bf16-gdn3x");
    let run = strix(&[
        "quantize",
        "--model",
        dir.to_str().unwrap(),
        "--quant",
        "q8_0",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(run.status.success(), "{}", stderr(&run));
    assert!(stderr(&run).contains("Q8_0"));
    let theirs = fixtures().join("gguf-models/causal-bf16-gdn3x.q8_0.gguf");
    assert_eq!(greedy(out.to_str().unwrap(), &[]), greedy(theirs.to_str().unwrap(), &[]));
}

#[test]
fn bad_arguments_are_one_clean_error() {
    let tmp = tempfile::tempdir().unwrap();
    let model = fixtures().join("models/causal-bf16-gdn3x");
    let paths = [
        model.clone(),
        model.join("config.json"),
        model.join("tokenizer.json"),
        tmp.path().to_path_buf(),
        tmp.path().join("x.gguf"),
    ];
    let [dir, config, tokenizer, empty_dir, out] = paths.each_ref().map(|p| p.to_str().unwrap());
    for (args, needle) in [
        (vec!["quantize", "--model", dir, "--quant", "q5_1", "--out", out], "q5_1"),
        (vec!["quantize", "--model", empty_dir, "--quant", "q8_0", "--out", out], "config.json"),
        (vec!["run", "--model", config, "hi"], "give the directory that holds it"),
        (vec!["quantize", "--preset", "qwen3.5-1b", "--quant", "bf16", "--out", out], "known:"),
        (
            vec!["quantize", "--preset", "qwen3.5-0.8b", "--model", dir, "--quant", "bf16", "--out", out],
            "cannot be used with",
        ),
        (vec!["quantize", "--tokenizer", dir, "--quant", "bf16", "--out", out], "--preset"),
        (
            vec![
                "quantize",
                "--preset",
                "qwen3.5-0.8b",
                "--tokenizer",
                tokenizer,
                "--quant",
                "bf16",
                "--out",
                out,
            ],
            "not a directory",
        ),
    ] {
        let o = strix(&args);
        let err = stderr(&o);
        assert!(!o.status.success() && !err.contains("panicked"), "{args:?}: {err}");
        assert!(err.starts_with("error: ") && err.contains(needle), "{args:?}: {err}");
    }
}

/// A `qwen35moe` file from llama.cpp's converter runs like the MoE directory it came from
/// (tokenizer and template from its metadata). `strix quantize` writes MoE files too: at Q8_0
/// the converter's own (so the same tokens), and a Q4_K_M mixture that runs.
#[test]
fn moe_gguf_runs_like_its_directory_and_quantize_writes_one() {
    assert_runs_like_its_directory(
        "moe-gguf/moe-causal-bf16-sharded.bf16.gguf",
        "moe-models/moe-causal-bf16-sharded",
    );

    let tmp = tempfile::tempdir().unwrap();
    let src = fixtures().join("moe-models/moe-causal-f32-top1");
    let src = src.to_string_lossy();
    let q8 = tmp.path().join("moe-q8.gguf");
    let run = strix(&["quantize", "--model", &src, "--quant", "q8_0", "--out", &q8.to_string_lossy()]);
    assert!(run.status.success(), "{}", stderr(&run));
    let theirs = fixtures().join("moe-gguf/moe-causal-f32-top1.q8_0.gguf");
    assert_eq!(greedy(&q8.to_string_lossy(), &[]), greedy(&theirs.to_string_lossy(), &[]));

    let q4 = tmp.path().join("moe-q4k.gguf");
    let run = strix(&["quantize", "--model", &src, "--quant", "q4_k", "--out", &q4.to_string_lossy()]);
    assert!(run.status.success(), "{}", stderr(&run));
    let (_, ids) = greedy(&q4.to_string_lossy(), &[]);
    assert_eq!(ids.as_array().map(Vec::len), Some(12), "{ids}");
}
