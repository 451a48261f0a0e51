//! End-to-end tests of the `strix` binary on the tiny fixture models: outputs against the
//! reference goldens, sampling and stop flags, the chat session's incremental prefill, the
//! benchmark's JSON, device selection, and one clean error line (never a panic) for each kind
//! of bad input.
//!
//! The `device_*` tests also run on a CUDA machine without a Rust toolchain (scripts/gpu):
//! there `STRIX_BIN` names the prebuilt `strix` and the fixtures are found under the working
//! directory (or `$STRIX_FIXTURES`). Without a CUDA device they check the clean error of
//! `--device cuda` instead of running on the GPU.

mod common;
#[path = "../../strix/tests/mock_hub/mod.rs"]
mod mock_hub;

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use common::{cmd, json_of, stderr, stdout, strix, strix_bin, strix_json, strix_with_stdin};
use safetensors::SafeTensors;
use serde_json::Value;
use strix::chat::{ChatMessage, ChatOptions, ChatTemplate};
use strix::tokenizer::Tokenizer;

/// The fixture models: beside the sources, or (for a prebuilt test binary run on another
/// machine) `$STRIX_FIXTURES` or `tests/fixtures/models` under the working directory.
fn fixtures_root() -> PathBuf {
    let candidates = [
        std::env::var_os("STRIX_FIXTURES").map(PathBuf::from),
        Some(common::fixtures().join("models")),
        Some(PathBuf::from("tests/fixtures/models")),
    ];
    candidates
        .into_iter()
        .flatten()
        .find(|p| p.is_dir())
        .expect("the fixtures directory (set STRIX_FIXTURES)")
}

fn fixture(name: &str) -> PathBuf {
    fixtures_root().join(name)
}

fn fixture_arg(name: &str) -> String {
    fixture(name).display().to_string()
}

/// `strix run` greedy: `n` tokens after the prompt `ids` (comma-separated), at temperature 0
/// and past any end of sequence, with the flags `more`.
fn greedy(model: &str, ids: &str, n: usize, more: &str) -> Output {
    strix(&cmd(
        "run",
        model,
        &format!("--prompt-ids {ids} --max-tokens {n} --temperature 0 --ignore-eos {more}"),
    ))
}

fn ids_of(value: &Value) -> Vec<u32> {
    value.as_array().expect("an array of ids").iter().map(|v| v.as_u64().expect("an id") as u32).collect()
}

fn join_ids(ids: &[u32]) -> String {
    ids.iter().map(u32::to_string).collect::<Vec<_>>().join(",")
}

/// A failed run: non-zero exit, one `error: ...` line on stderr that contains `needle`, no panic.
#[track_caller]
fn assert_clean_error(out: &Output, needle: &str) {
    let err = stderr(out);
    assert!(!out.status.success(), "expected a failure, got success; stderr: {err}");
    assert!(!err.contains("panicked"), "strix panicked: {err}");
    let lines: Vec<&str> = err.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "expected one error line, got: {err}");
    assert!(lines[0].starts_with("error: "), "not an error line: {err}");
    assert!(lines[0].contains(needle), "error does not mention `{needle}`: {err}");
}

struct Golden {
    ids: Vec<u32>,
    logits: Vec<f32>,
    greedy: Vec<u32>,
    /// `[greedy.len(), vocab]`: the logits after feeding each greedy token.
    decode_logits: Vec<f32>,
}

/// The goldens of a fixture, by prompt length.
fn goldens(name: &str) -> Vec<(usize, Golden)> {
    let bytes = std::fs::read(fixture(name).join("goldens.safetensors")).expect("read goldens");
    let st = SafeTensors::deserialize(&bytes).expect("parse goldens");
    let ints = |key: &str| -> Vec<u32> {
        let t = st.tensor(key).expect(key);
        t.data().chunks_exact(8).map(|b| i64::from_le_bytes(b.try_into().unwrap()) as u32).collect()
    };
    let mut lengths: Vec<usize> =
        st.names().iter().filter_map(|n| n.strip_prefix('p')?.strip_suffix(".ids")?.parse().ok()).collect();
    lengths.sort();
    let floats = |key: &str| -> Vec<f32> {
        let t = st.tensor(key).expect(key);
        t.data().chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect()
    };
    lengths
        .into_iter()
        .map(|t| {
            let golden = Golden {
                ids: ints(&format!("p{t}.ids")),
                logits: floats(&format!("p{t}.logits")),
                greedy: ints(&format!("p{t}.greedy")),
                decode_logits: floats(&format!("p{t}.decode_logits")),
            };
            (t, golden)
        })
        .collect()
}

fn read_logits(path: &Path) -> (Vec<usize>, Vec<f32>) {
    let bytes = std::fs::read(path).expect("read logits file");
    let st = SafeTensors::deserialize(&bytes).expect("parse logits file");
    let t = st.tensor("logits").expect("a `logits` tensor");
    assert_eq!(t.dtype(), safetensors::Dtype::F32);
    let values = t.data().chunks_exact(4).map(|b| f32::from_le_bytes(b.try_into().unwrap())).collect();
    (t.shape().to_vec(), values)
}

/// Greedy `run` continues the prompt exactly as the reference did, and `logits` reproduces
/// the reference's logits at every position.
fn check_fixture_against_goldens(name: &str) {
    let model = fixture_arg(name);
    let dir = tempfile::tempdir().unwrap();
    for (t, golden) in goldens(name) {
        let ids = join_ids(&golden.ids);
        let out = json_of(format!("{name} p{t}"), &greedy(&model, &ids, 10, "--json"));
        assert_eq!(ids_of(&out["prompt_ids"]), golden.ids, "{name} p{t}: prompt ids");
        assert_eq!(ids_of(&out["ids"]), golden.greedy, "{name} p{t}: greedy continuation");
        assert_eq!(out["finish_reason"], "length");

        let path = dir.path().join(format!("p{t}.safetensors"));
        let path_arg = path.display().to_string();
        let out = strix(&["logits", "--model", &model, "--prompt-ids", &ids, "--out", &path_arg]);
        assert!(out.status.success(), "logits failed: {}", stderr(&out));
        let (shape, logits) = read_logits(&path);
        assert_eq!(shape, vec![t, golden.logits.len() / t], "{name} p{t}: logits shape");
        let max_ref = golden.logits.iter().fold(0f32, |m, x| m.max(x.abs()));
        let max_diff = logits.iter().zip(&golden.logits).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(max_diff / max_ref <= 1e-4, "{name} p{t}: max|Δ|/max|ref| = {:e}", max_diff / max_ref);
    }
}

#[test]
fn goldens_vlm_f32_gdn2x() {
    check_fixture_against_goldens("vlm-f32-gdn2x");
}

#[test]
fn goldens_causal_bf16_sharded() {
    check_fixture_against_goldens("causal-bf16-sharded");
}

#[test]
fn goldens_causal_f32_tied_gdn2x() {
    check_fixture_against_goldens("causal-f32-tied-gdn2x");
}

#[test]
fn goldens_causal_bf16_gdn3x() {
    check_fixture_against_goldens("causal-bf16-gdn3x");
}

#[test]
fn generation_stops_at_an_end_of_sequence_token() {
    // The fixtures' greedy continuations hold no EOS, so a copy of one declares its fourth
    // greedy token an end-of-sequence token too (generation_config.json adds to config.json's).
    let (_, golden) = goldens("causal-bf16-gdn3x").remove(0);
    let eos = golden.greedy[3];
    let dir = fixture_copy("causal-bf16-gdn3x", &["goldens.safetensors"]);
    std::fs::write(
        dir.path().join("generation_config.json"),
        format!("{{\"eos_token_id\": [322, 320, {eos}]}}"),
    )
    .unwrap();
    let model = dir.path().display().to_string();
    let args = [
        "run",
        "--model",
        &model,
        "--prompt-ids",
        &join_ids(&golden.ids),
        "-n",
        "10",
        "--temperature",
        "0",
        "--json",
    ];
    let json = strix_json(&args);
    let first = golden.greedy.iter().position(|&id| id == eos).unwrap();
    assert_eq!(ids_of(&json["ids"]), golden.greedy[..=first]);
    assert_eq!(json["finish_reason"], "eos");
    let json = strix_json(&[&args[..], &["--ignore-eos"]].concat());
    assert_eq!(ids_of(&json["ids"]), golden.greedy);
}

/// `--logit-bias ID=BIAS` steers `run`: +100 forces a token at every step, -100 on the first
/// greedy token changes the continuation; an id outside the vocabulary or a malformed entry is
/// a clean error.
#[test]
fn logit_bias_steers_run() {
    let (_, golden) = goldens("causal-bf16-gdn3x").remove(0);
    let model = fixture_arg("causal-bf16-gdn3x");
    let ids = join_ids(&golden.ids);
    let run = |extra: &[&str]| {
        let args =
            ["run", "--model", &model, "--prompt-ids", &ids, "-n", "4", "--temperature", "0", "--json"];
        strix_json(&[&args[..], extra].concat())
    };
    assert_eq!(ids_of(&run(&[])["ids"]), golden.greedy[..4]);
    let forced = (golden.greedy[0] + 1).to_string();
    let json = run(&["--logit-bias", &format!("{forced}=100"), "--ignore-eos"]);
    assert!(ids_of(&json["ids"]).iter().all(|id| id.to_string() == forced), "{json}");
    let banned = format!("{}=-100", golden.greedy[0]);
    let json = run(&["--logit-bias", &banned, "--logit-bias", "0=0.5", "--ignore-eos"]);
    assert_ne!(ids_of(&json["ids"])[0], golden.greedy[0], "{json}");
    let out =
        strix(&["run", "--model", &model, "--prompt-ids", &ids, "-n", "2", "--logit-bias", "99999999=1"]);
    assert_clean_error(&out, "logit_bias names token 99999999, outside the vocabulary");
    let out = strix(&["run", "--model", &model, "--prompt-ids", &ids, "--logit-bias", "5=200"]);
    assert!(!out.status.success() && stderr(&out).contains("must be in [-100, 100]"), "{}", stderr(&out));
}

fn tokenizer(name: &str) -> Tokenizer {
    Tokenizer::from_model_dir(fixture(name)).unwrap().unwrap()
}

/// The text of `ids` as generation streams it: special tokens and ids the tokenizer lacks
/// (the embedding's padding rows) leave no text.
fn decode_known(tokenizer: &Tokenizer, ids: &[u32]) -> String {
    let known: Vec<u32> = ids.iter().copied().filter(|&id| tokenizer.id_to_token(id).is_some()).collect();
    tokenizer.decode(&known, true).unwrap()
}

#[test]
fn logits_of_a_text_prompt_cover_each_of_its_tokens() {
    let name = "causal-bf16-sharded";
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("text.safetensors");
    let out = strix(&[
        "logits",
        "--model",
        &fixture_arg(name),
        "--prompt",
        "Hello world",
        "--out",
        path.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    let ids = tokenizer(name).encode("Hello world", true).unwrap();
    let (shape, logits) = read_logits(&path);
    assert_eq!(shape, vec![ids.len(), 384]);
    assert!(logits.iter().all(|x| x.is_finite()));
    let bytes = std::fs::read(&path).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let stored: Vec<u32> = st
        .tensor("ids")
        .unwrap()
        .data()
        .chunks_exact(8)
        .map(|b| i64::from_le_bytes(b.try_into().unwrap()) as u32)
        .collect();
    assert_eq!(stored, ids);
}

#[test]
fn a_text_prompt_streams_the_text_that_json_reports() {
    let model = fixture_arg("causal-bf16-gdn3x");
    let args = ["run", "--model", &model, "The quick brown fox", "--max-tokens", "5", "--temperature", "0"];
    let streamed = strix(&args);
    assert!(streamed.status.success(), "{}", stderr(&streamed));
    let json = strix_json(&[&args[..], &["--json"]].concat());
    let text = json["text"].as_str().unwrap();
    assert!(!text.is_empty(), "expected some text: {json}");
    assert_eq!(stdout(&streamed), text, "streamed text differs from --json text");

    let tok = tokenizer("causal-bf16-gdn3x");
    assert_eq!(ids_of(&json["prompt_ids"]), tok.encode("The quick brown fox", true).unwrap());
    let ids = ids_of(&json["ids"]);
    assert_eq!(ids.len(), 5);
    assert_eq!(text, decode_known(&tok, &ids));
    let timings = &json["timings"];
    assert_eq!(
        timings["prefill_tokens"].as_u64().unwrap() as usize,
        json["prompt_ids"].as_array().unwrap().len()
    );
    assert!(timings["decode_tok_s"].as_f64().unwrap() > 0.0);
}

#[test]
fn the_prompt_can_come_from_stdin() {
    let model = fixture_arg("causal-bf16-gdn3x");
    let out = strix_with_stdin(
        &["run", "--model", &model, "-n", "3", "--temperature", "0", "--json"],
        Some("The quick brown fox"),
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let json: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        ids_of(&json["prompt_ids"]),
        tokenizer("causal-bf16-gdn3x").encode("The quick brown fox", true).unwrap()
    );
}

#[test]
fn chat_flag_renders_the_template_with_system_message_and_thinking_switch() {
    let name = "causal-f32-tied-gdn2x";
    let model = fixture_arg(name);
    let template = ChatTemplate::from_model_dir(fixture(name)).unwrap().unwrap();
    let tok = tokenizer(name);
    let messages = [ChatMessage::system("Be brief."), ChatMessage::user("Hi there")];
    for (flag, enable_thinking) in
        [(None, None), (Some("--no-think"), Some(false)), (Some("--think"), Some(true))]
    {
        let mut args = vec![
            "run",
            "--model",
            &model,
            "--chat",
            "--system",
            "Be brief.",
            "Hi there",
            "-n",
            "4",
            "--json",
        ];
        args.extend(flag);
        let json = strix_json(&args);
        let options = ChatOptions { add_generation_prompt: true, enable_thinking, ..ChatOptions::default() };
        let rendered = template.render(&messages, &options).unwrap();
        assert!(rendered.starts_with("<|im_start|>system\nBe brief.<|im_end|>"));
        assert_eq!(ids_of(&json["prompt_ids"]), tok.encode(&rendered, false).unwrap(), "{flag:?}");
    }
}

#[test]
fn the_same_seed_samples_the_same_tokens() {
    let model = fixture_arg("vlm-f32-gdn2x");
    let sample = |seed: &str| {
        let json = strix_json(&[
            "run",
            "--model",
            &model,
            "--prompt-ids",
            "1,2,3,4",
            "-n",
            "24",
            "--ignore-eos",
            "--temperature",
            "0.8",
            "--seed",
            seed,
            "--json",
        ]);
        ids_of(&json["ids"])
    };
    let a = sample("7");
    assert_eq!(a.len(), 24);
    assert_eq!(a, sample("7"), "same seed, different tokens");
    assert_ne!(a, sample("8"), "different seeds gave the same 24 tokens");
}

#[test]
fn a_stop_string_ends_generation_before_it() {
    let model = fixture_arg("causal-bf16-gdn3x");
    let base =
        ["run", "--model", &model, "The quick brown fox", "-n", "30", "--temperature", "0", "--ignore-eos"];
    let full = strix_json(&[&base[..], &["--json"]].concat());
    let full_text = full["text"].as_str().unwrap().to_string();
    // A run of three ASCII letters past the first quarter of the text, so something precedes it.
    let chars: Vec<char> = full_text.chars().collect();
    let start = (chars.len() / 4..chars.len().saturating_sub(3))
        .find(|&i| chars[i..i + 3].iter().all(char::is_ascii_alphanumeric))
        .unwrap_or_else(|| panic!("no stop string candidate in {full_text:?}"));
    let stop: String = chars[start..start + 3].iter().collect();
    let expected = &full_text[..full_text.find(&stop).unwrap()];

    let stop_args = ["--stop", "never-appears", "--stop", &stop];
    let json = strix_json(&[&base[..], &stop_args, &["--json"]].concat());
    assert_eq!(json["finish_reason"], "stop");
    assert_eq!(json["text"].as_str().unwrap(), expected);
    assert!(ids_of(&json["ids"]).len() < 30);

    let streamed = strix(&[&base[..], &stop_args].concat());
    assert!(streamed.status.success(), "{}", stderr(&streamed));
    assert_eq!(stdout(&streamed), expected);
    assert!(!stdout(&streamed).contains(&stop));
}

/// The numbers of one `[turn N] prefilled P tokens at position Q ...; generated G tokens ...;
/// context C/...` line.
#[derive(Debug)]
struct TurnStats {
    prefilled: usize,
    position: usize,
    generated: usize,
    context: usize,
    fresh: bool,
}

fn turn_stats(stderr: &str) -> Vec<TurnStats> {
    let number_after = |line: &str, key: &str| -> usize {
        let rest = &line[line.find(key).unwrap_or_else(|| panic!("no `{key}` in {line}")) + key.len()..];
        rest.chars().take_while(char::is_ascii_digit).collect::<String>().parse().unwrap()
    };
    stderr
        .lines()
        .filter(|l| l.starts_with("[turn "))
        .map(|l| TurnStats {
            prefilled: number_after(l, "prefilled "),
            position: number_after(l, "at position "),
            generated: number_after(l, "generated "),
            context: number_after(l, "context "),
            fresh: l.contains("(full conversation)"),
        })
        .collect()
}

#[test]
fn chat_keeps_the_session_and_prefills_only_each_new_turn() {
    let name = "causal-bf16-gdn3x";
    let model = fixture_arg(name);
    let args = ["chat", "--model", &model, "--max-tokens", "8", "--temperature", "0", "--verbose"];
    let out = strix_with_stdin(&args, Some("Hello there\nHow are you?\n"));
    assert!(out.status.success(), "{}", stderr(&out));
    assert!(!stdout(&out).trim().is_empty());
    let turns = turn_stats(&stderr(&out));
    assert_eq!(turns.len(), 2, "{}", stderr(&out));
    let tok = tokenizer(name);
    let template = ChatTemplate::from_model_dir(fixture(name)).unwrap().unwrap();
    let first = template
        .render(
            &[ChatMessage::user("Hello there")],
            &ChatOptions { add_generation_prompt: true, ..Default::default() },
        )
        .unwrap();
    assert_eq!((turns[0].position, turns[0].prefilled), (0, tok.encode(&first, false).unwrap().len()));
    assert!(turns.iter().all(|t| t.generated == 8), "{turns:?}");

    // The second turn starts where the first ended and feeds only its own ChatML turn.
    let new_turn = "\n<|im_start|>user\nHow are you?<|im_end|>\n<|im_start|>assistant\n<think>\n";
    assert!(!turns[1].fresh);
    assert_eq!(turns[1].position, turns[0].context);
    assert_eq!(turns[1].prefilled, tok.encode(new_turn, false).unwrap().len());
    assert_eq!(turns[1].context, turns[0].context + turns[1].prefilled + 8 + 1);

    // --exact-history re-renders and re-prefills the whole conversation instead.
    let out =
        strix_with_stdin(&[&args[..], &["--exact-history"]].concat(), Some("Hello there\nHow are you?\n"));
    let exact = turn_stats(&stderr(&out));
    assert!(exact[1].fresh && exact[1].position == 0 && exact[1].prefilled > turns[1].prefilled, "{exact:?}");
}

#[test]
fn chat_reset_and_exit_commands() {
    let model = fixture_arg("causal-bf16-gdn3x");
    let out = strix_with_stdin(
        &["chat", "--model", &model, "-n", "4", "--temperature", "0", "--verbose", "--system", "Be brief."],
        Some("Hi\n/reset\nHi\n/exit\nnever read\n"),
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let turns = turn_stats(&stderr(&out));
    assert_eq!(turns.len(), 2, "{}", stderr(&out));
    // After /reset the same message starts a fresh conversation identical to the first.
    assert!(turns[1].fresh && turns[1].position == 0);
    assert_eq!(turns[0].prefilled, turns[1].prefilled);
}

#[test]
fn bench_prints_json_with_positive_speeds() {
    let model = fixture_arg("causal-bf16-sharded");
    let json = strix_json(&cmd(
        "bench",
        &model,
        "--prompt-len 64 --gen 4 --repeats 1 --bandwidth-mib 64 --threads 1",
    ));
    for key in ["prefill_tok_s", "decode_tok_s", "memory_bandwidth_gb_s", "roofline_pct"] {
        assert!(json[key].as_f64().is_some_and(|v| v > 0.0), "{key} in {json}");
    }
    assert_eq!(json["prompt_len"], 64);
    assert_eq!(json["context"], 68);
    assert_eq!(json["batch"], 1);
    assert_eq!(json["model"]["vocab"], 384);
    assert_eq!(json["model"]["dtype"], "bf16");
    assert!(json["weight_bytes_per_token"].as_u64().unwrap() > 0);
    assert_eq!(json["machine"]["threads"], 1);
    // The sweeps default to none off CUDA, so a CPU bench stays as small as asked.
    assert_eq!(json["device"]["kind"], "cpu");
    for sweep in ["prefill", "decode", "batched"] {
        assert_eq!(json[sweep], Value::Array(vec![]), "{sweep} in {json}");
    }
}

#[test]
fn help_covers_every_command() {
    let out = strix(&["--help"]);
    assert!(out.status.success());
    for command in ["run", "chat", "logits", "bench"] {
        assert!(stdout(&out).contains(command), "--help does not list {command}");
        let help = strix(&[command, "--help"]);
        assert!(help.status.success(), "{command} --help failed");
        assert!(stdout(&help).contains("--model"), "{command} --help has no --model");
    }
}

/// A copy of a fixture without the files named in `leave_out`.
fn fixture_copy(name: &str, leave_out: &[&str]) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    for entry in std::fs::read_dir(fixture(name)).unwrap() {
        let path = entry.unwrap().path();
        let file = path.file_name().unwrap().to_str().unwrap().to_string();
        if !leave_out.contains(&file.as_str()) {
            std::fs::copy(&path, dir.path().join(&file)).unwrap();
        }
    }
    dir
}

#[test]
fn a_model_without_tokenizer_takes_ids_and_prints_ids() {
    let dir = fixture_copy("causal-bf16-gdn3x", &["tokenizer.json", "goldens.safetensors"]);
    let model = dir.path().display().to_string();
    let (_, golden) = goldens("causal-bf16-gdn3x").remove(0);
    let ids = join_ids(&golden.ids);
    let json = json_of("greedy --json", &greedy(&model, &ids, 10, "--json"));
    assert_eq!(ids_of(&json["ids"]), golden.greedy);
    assert_eq!(json["text"], "");
    let out = greedy(&model, &ids, 10, "");
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(stdout(&out).trim(), join_ids(&golden.greedy));

    assert_clean_error(&strix(&cmd("run", &model, "Hello")), "tokenizer.json");
    assert_clean_error(&strix(&["chat", "--model", &model]), "tokenizer.json");
    assert_clean_error(
        &strix(&cmd("logits", &model, "--prompt Hello --out x.safetensors")),
        "tokenizer.json",
    );
}

#[test]
fn error_missing_model_dir() {
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("no-such-model").display().to_string();
    assert_clean_error(&strix(&cmd("run", &missing, "Hello")), "no-such-model");
    assert_clean_error(
        &strix(&cmd("logits", &missing, "--prompt-ids 1 --out x.safetensors")),
        "no such file or directory",
    );
    assert_clean_error(&strix(&["bench", "--model", &missing]), "no such file or directory");
}

#[test]
fn error_corrupt_config() {
    let dir = fixture_copy("causal-f32-tied-gdn2x", &["goldens.safetensors"]);
    std::fs::write(dir.path().join("config.json"), "{ \"model_type\": \"qwen3_5_text\", ").unwrap();
    let model = dir.path().display().to_string();
    assert_clean_error(&strix(&cmd("run", &model, "--prompt-ids 1,2")), "config.json");
    std::fs::write(dir.path().join("config.json"), "{\"model_type\": \"llama\"}").unwrap();
    assert_clean_error(&strix(&cmd("run", &model, "--prompt-ids 1,2")), "llama");
}

#[test]
fn error_token_id_outside_the_vocabulary() {
    let model = fixture_arg("causal-bf16-gdn3x");
    assert_clean_error(&strix(&cmd("run", &model, "--prompt-ids 99999")), "99999");
    assert_clean_error(&strix(&cmd("logits", &model, "--prompt-ids 1,384 --out x.st")), "384");
}

#[test]
fn error_malformed_prompt_ids() {
    let model = fixture_arg("causal-bf16-gdn3x");
    assert_clean_error(&strix(&cmd("run", &model, "--prompt-ids x,y")), "--prompt-ids");
    assert_clean_error(&strix(&cmd("run", &model, "--prompt-ids 1,-2")), "-2");
    assert_clean_error(&strix(&["run", "--model", &model, "--prompt-ids", ""]), "--prompt-ids");
}

#[test]
fn error_prompt_longer_than_the_context() {
    let model = fixture_arg("causal-bf16-gdn3x");
    assert_clean_error(&strix(&cmd("run", &model, "--prompt-ids 1,2,3,4,5 --ctx 4")), "context");
    assert_clean_error(&strix(&["run", "--model", &model, "The quick brown fox", "--ctx", "4"]), "context");
}

#[test]
fn error_bad_sampling_and_bench_parameters() {
    let model = fixture_arg("causal-bf16-gdn3x");
    assert_clean_error(&strix(&cmd("run", &model, "--prompt-ids 1 --temperature -1")), "temperature");
    assert_clean_error(&strix(&cmd("run", &model, "--prompt-ids 1 --top-p 0")), "top_p");
    assert_clean_error(&strix(&cmd("run", &model, "--prompt-ids 1 --threads 0")), "--threads");
    assert_clean_error(&strix(&["bench", "--preset", "gpt-2"]), "unknown preset");
    // ~790 GB of bf16 (~220 GB at 4.5 bits): refused before any weight is made.
    for quant in [&[][..], &["--quant", "q4_0"][..]] {
        let mut argv =
            vec!["bench", "--device", "cpu", "--preset", "qwen3.5-397b-a17b", "--bandwidth-mib", "0"];
        argv.extend_from_slice(quant);
        assert_clean_error(&strix(&argv), "does not fit");
    }
    assert_clean_error(&strix(&cmd("bench", &model, "--gen 0")), "--gen");
    // The fixture allows 1024 positions.
    assert_clean_error(
        &strix(&cmd("bench", &model, "--device cpu --contexts 2000")),
        "max_position_embeddings",
    );
}

// --- mistaken and hostile command lines ---------------------------------------------------------

#[test]
fn negative_numbers_reach_validation_and_name_the_flag() {
    let model = fixture_arg("causal-bf16-gdn3x");
    for (flag, value, needle) in [
        ("--max-tokens", "-1", "at least 1"),
        ("-n", "-5", "at least 1"),
        ("--ctx", "-5", "at least 1"),
        ("--top-k", "-1", "0 or more"),
        ("--seed", "-2", "-1 (a random seed)"),
        ("--threads", "-1", "at least 1"),
        ("--ubatch", "-64", "at least 1"),
    ] {
        let out = strix(&["run", "--model", &model, "--prompt-ids", "1,2", flag, value]);
        assert_clean_error(&out, needle);
        assert!(stderr(&out).contains(&format!("'{value}'")), "{flag} {value}: {}", stderr(&out));
    }
    // --seed -1 is llama.cpp's random seed: the run goes ahead and reports the seed it drew.
    let json = strix_json(&cmd("run", &model, "--prompt-ids 1,2 -n 2 --seed -1 --json"));
    assert!(json["seed"].as_u64().is_some(), "{json}");
    // Every subcommand's flags, `serve`'s too: the value reaches its parser.
    for (args, flag) in [
        (vec!["chat", "--model", &model, "-n", "-1"], "--max-tokens"),
        (vec!["bench", "--model", &model, "--repeats", "-3"], "--repeats"),
        (vec!["bench", "--model", &model, "--batches", "1,-4"], "--batches"),
        (vec!["perplexity", "--model", &model, "--file", "x", "--ctx", "-512"], "--ctx"),
        (vec!["logits", "--model", &model, "--prompt-ids", "1", "--out", "x", "-t", "-2"], "--threads"),
        (vec!["serve", "--model", &model, "--max-seqs", "-1"], "--max-seqs"),
    ] {
        let out = strix(&args);
        assert_clean_error(&out, flag);
        assert!(!stderr(&out).contains("unexpected argument"), "{args:?}: {}", stderr(&out));
    }
}

#[test]
fn empty_prompt_ids_are_refused() {
    let model = fixture_arg("causal-bf16-gdn3x");
    for ids in ["1,,2", "1,2,", ",1", " , "] {
        let out = strix(&["run", "--model", &model, "--prompt-ids", ids, "-n", "1"]);
        assert_clean_error(&out, "--prompt-ids");
        assert!(stderr(&out).contains("empty"), "{ids:?}: {}", stderr(&out));
    }
    assert_clean_error(&strix(&cmd("logits", &model, "--prompt-ids 3,,4 --out x.st")), "empty");
}

#[test]
fn absurd_sizes_are_refused_before_the_model_is_read() {
    // The model does not exist: an error naming the flag shows the value was checked first.
    let dir = tempfile::tempdir().unwrap();
    let missing = dir.path().join("no-such-model").display().to_string();
    let m = missing.as_str();
    for (args, flag, needle) in [
        (vec!["run", "--model", m, "--threads", "10000", "hi"], "--threads", "per logical CPU"),
        (vec!["run", "--model", m, "--max-tokens", "18446744073709551615", "hi"], "--max-tokens", "at most"),
        (vec!["run", "--model", m, "--ctx", "99999999999", "hi"], "--ctx", "at most"),
        (vec!["bench", "--model", m, "--batches", "100000"], "--batches", "at most 1024"),
        (vec!["bench", "--model", m, "--batches", "1,16,0"], "--batches", "at least 1"),
        (vec!["bench", "--model", m, "--prompt-lens", "512,99999999999"], "--prompt-lens", "at most"),
        (vec!["bench", "--model", m, "--contexts", "18446744073709551615"], "--contexts", "at most"),
        (vec!["bench", "--model", m, "--prompt-len", "0"], "--prompt-len", "at least 1"),
        (vec!["bench", "--model", m, "--gen", "100000000"], "--gen", "at most 16777216"),
        (vec!["bench", "--model", m, "--repeats", "100000"], "--repeats", "at most 1000"),
        (vec!["bench", "--model", m, "--batch-context", "x"], "--batch-context", "not a number"),
        (vec!["bench", "--model", m, "--bandwidth-mib", "99999999999"], "--bandwidth-mib", "at most"),
        (vec!["bench", "--model", m, "--threads", "0"], "--threads", "at least 1"),
        (vec!["perplexity", "--model", m, "--file", "x", "--chunks", "0"], "--chunks", "at least 1"),
        (vec!["perplexity", "--model", m, "--file", "x", "--batch", "1.5"], "--batch", "not a whole number"),
    ] {
        let out = strix(&args);
        assert_clean_error(&out, flag);
        assert!(stderr(&out).contains(needle), "{args:?}: {}", stderr(&out));
        assert!(
            !stderr(&out).contains("no-such-model"),
            "{args:?} looked at the model first: {}",
            stderr(&out)
        );
    }
}

#[test]
fn os_errors_are_printed_once() {
    let dir = tempfile::tempdir().unwrap();
    let model = fixture_arg("causal-bf16-gdn3x");
    let nowhere = |name: &str| dir.path().join("no-dir").join(name).display().to_string();
    for args in [
        vec![
            "logits".to_string(),
            "--model".into(),
            model.clone(),
            "--prompt-ids".into(),
            "1".into(),
            "--out".into(),
            nowhere("x.st"),
        ],
        vec![
            "quantize".into(),
            "--model".into(),
            model.clone(),
            "--quant".into(),
            "q8_0".into(),
            "--out".into(),
            nowhere("x.gguf"),
        ],
        vec!["perplexity".into(), "--model".into(), model.clone(), "--file".into(), nowhere("text.txt")],
    ] {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        let out = strix(&args);
        assert_clean_error(&out, "no-dir");
        let err = stderr(&out);
        assert_eq!(err.matches("os error").count(), 1, "{args:?}: {err}");
        assert_eq!(err.matches("no-dir").count(), 1, "{args:?}: {err}");
    }
}

#[test]
fn wrong_model_paths_get_the_right_diagnosis() {
    // A directory without config.json is said to be no model directory, before any other file
    // is looked for, by every command that takes a model.
    let empty = tempfile::tempdir().unwrap();
    let e = empty.path().display().to_string();
    for args in [
        vec!["run", "--model", &e, "hi"],
        vec!["chat", "--model", &e],
        vec!["logits", "--model", &e, "--prompt-ids", "1", "--out", "x.st"],
        vec!["bench", "--model", &e],
        vec!["perplexity", "--model", &e, "--file", "x"],
        vec!["quantize", "--model", &e, "--quant", "q8_0", "--out", "x.gguf"],
        vec!["serve", "--model", &e, "--port", "0"],
    ] {
        let out = strix(&args);
        assert_clean_error(&out, "is not a model directory: it has no config.json");
        assert!(!stderr(&out).contains("os error"), "{args:?}: {}", stderr(&out));
    }
    // One holding a GGUF file points at it; weights without their config are named.
    let gguf_dir = tempfile::tempdir().unwrap();
    // Only its name matters here: the directory is refused before any file is read.
    std::fs::write(gguf_dir.path().join("tiny.q8_0.gguf"), b"GGUF").unwrap();
    let out = strix(&["run", "--model", &gguf_dir.path().display().to_string(), "hi"]);
    assert_clean_error(&out, "it holds tiny.q8_0.gguf: give --model that file");
    let weights_only = fixture_copy("causal-bf16-gdn3x", &["config.json"]);
    let out = strix(&["run", "--model", &weights_only.path().display().to_string(), "hi"]);
    assert_clean_error(&out, "safetensors weights but not the config");
    // A file of a model directory: its folder is the model.
    let config = fixture("causal-bf16-gdn3x").join("config.json").display().to_string();
    assert_clean_error(&strix(&cmd("run", &config, "hi")), "give the directory that holds it");
    // A path that does not exist and is no repo id says both.
    for path in ["./no/such/model", "/no/such/model", "no-such-model"] {
        let out = strix(&cmd("run", path, "hi"));
        assert_clean_error(&out, "no such file or directory");
        assert!(stderr(&out).contains("repo id"), "{path}: {}", stderr(&out));
    }
}

#[test]
fn endless_input_is_refused_at_a_bound() {
    let model = fixture_arg("causal-bf16-gdn3x");
    let from_zero = |args: &[&str]| {
        let zero = std::fs::File::open("/dev/zero").expect("/dev/zero");
        Command::new(strix_bin())
            .args(args)
            .env("STRIX_DEVICE", "cpu")
            .stdin(zero)
            .output()
            .expect("run strix")
    };
    assert_clean_error(
        &from_zero(&["run", "--model", &model, "-n", "1"]),
        "the prompt on stdin is longer than 16 MiB",
    );
    assert_clean_error(&from_zero(&["chat", "--model", &model, "-n", "1"]), "longer than 16 MiB");
    assert_clean_error(&strix(&cmd("perplexity", &model, "--file /dev/zero")), "longer than 256 MiB");
    let out = strix_with_stdin(&["run", "--model", &model, "-n", "1"], Some("caf\u{e9}"));
    assert!(out.status.success(), "{}", stderr(&out));
    assert_clean_error(&strix(&["run", "--model", &model, "--stop", "", "hi"]), "--stop");
}

/// Runs `strix` with the Hugging Face variables (and proxies) of this process removed and
/// `env` set.
fn strix_env(args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut command = Command::new(strix_bin());
    command.args(args).env("STRIX_DEVICE", "cpu").stdin(Stdio::null());
    for name in [
        "HF_ENDPOINT",
        "HF_HOME",
        "HF_HUB_CACHE",
        "HUGGINGFACE_HUB_CACHE",
        "HF_TOKEN",
        "HUGGING_FACE_HUB_TOKEN",
        "HF_TOKEN_PATH",
        "HF_HUB_OFFLINE",
        "HF_HUB_DOWNLOAD_TIMEOUT",
        "HTTP_PROXY",
        "http_proxy",
        "HTTPS_PROXY",
        "https_proxy",
        "ALL_PROXY",
        "all_proxy",
    ] {
        command.env_remove(name);
    }
    command.envs(env.iter().copied()).output().expect("run strix")
}

#[test]
fn repo_ids_are_fetched_through_the_hub_settings() {
    let repo = mock_hub::HubRepo::from_dir("org/tiny", &fixture("causal-bf16-sharded"));
    let served = repo.clone();
    let hub = mock_hub::MockServer::start(move |r| mock_hub::hub_reply(&served, None, r));
    let home = tempfile::tempdir().unwrap();
    let home_dir = home.path().display().to_string();
    let endpoint = hub.url();
    let greedy = ["--prompt-ids", "1,2,3", "-n", "4", "--temperature", "0", "--ignore-eos", "--json"];
    fn with<'a>(model: &'a str, greedy: &[&'a str]) -> Vec<&'a str> {
        [&["run", "--model", model][..], greedy].concat()
    }

    let local = strix_json(&with(&fixture_arg("causal-bf16-sharded"), &greedy));
    let out = strix_env(&with("org/tiny", &greedy), &[("HF_ENDPOINT", &endpoint), ("HF_HOME", &home_dir)]);
    assert!(out.status.success(), "{}", stderr(&out));
    let fetched: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(fetched["ids"], local["ids"]);
    let snapshot = home.path().join("hub/models--org--tiny/snapshots").join(&repo.commit);
    assert!(snapshot.join("model-00002-of-00003.safetensors").is_file());

    // Offline and with the hub gone, the cache alone serves it.
    drop(hub);
    let offline = [("HF_ENDPOINT", endpoint.as_str()), ("HF_HOME", &home_dir), ("HF_HUB_OFFLINE", "1")];
    let out = strix_env(&with("org/tiny", &greedy), &offline);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(serde_json::from_slice::<Value>(&out.stdout).unwrap()["ids"], local["ids"]);

    // A repo the hub does not have, a hub that does not answer, an empty cache offline: each
    // says what it tried and why it failed.
    let served = repo.clone();
    let hub = mock_hub::MockServer::start(move |r| mock_hub::hub_reply(&served, None, r));
    let empty = tempfile::tempdir().unwrap();
    let empty_home = empty.path().display().to_string();
    let out =
        strix_env(&with("org/absent", &greedy), &[("HF_ENDPOINT", &hub.url()), ("HF_HOME", &empty_home)]);
    assert_clean_error(&out, "--model org/absent");
    assert!(stderr(&out).contains("HF_TOKEN"), "{}", stderr(&out));
    let closed = {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        format!("http://{}", listener.local_addr().unwrap())
    };
    let out = strix_env(&with("org/tiny", &greedy), &[("HF_ENDPOINT", &closed), ("HF_HOME", &empty_home)]);
    assert_clean_error(&out, "no answer from");
    let out = strix_env(&with("org/tiny", &greedy), &[("HF_HOME", &empty_home), ("HF_HUB_OFFLINE", "1")]);
    assert_clean_error(&out, "offline");
}

// --- devices ----------------------------------------------------------------------------------

/// Whether this machine has a CUDA device: then the `device_*` tests run on it, otherwise they
/// check that asking for it is a clean error.
fn has_cuda() -> bool {
    strix::backend::cuda::device_count() > 0
}

/// Whether a test that needs the GPU skips here (saying so): there is no CUDA device.
fn skipped_without_cuda() -> bool {
    if !has_cuda() {
        println!("skipped: no CUDA device");
    }
    !has_cuda()
}

/// The CUDA backend's default GEMM path rounds prefill activations to bf16, so its logits
/// differ from the f32 goldens by up to a few 1e-2 of max |logit| on these tiny random models
/// (9.2e-3 against an emulation of the same rounding, crates/strix/tests/cuda.rs). A greedy
/// pick is only held to the golden where the golden's top-2 margin exceeds this share of its
/// largest |logit|.
const CUDA_GREEDY_TOL: f32 = 3e-2;

/// A sanity bound on the CUDA logits against the goldens: the bf16 rounding of prefill
/// activations reached 4.5e-2 on causal-bf16-sharded (H200), while a wrong transpose or a
/// missed row is O(1). The kernels themselves are held to tight bounds in
/// crates/strix/tests/cuda.rs.
const CUDA_LOGITS_TOL: f32 = 1e-1;

/// `(top-1 − top-2) / max |x|`: how decisive a greedy pick from `logits` is.
fn relative_margin(logits: &[f32]) -> f32 {
    let mut sorted = logits.to_vec();
    sorted.sort_by(|a, b| b.total_cmp(a));
    let max = logits.iter().fold(0f32, |m, x| m.max(x.abs()));
    (sorted[0] - sorted[1]) / max
}

/// Compares greedy ids with a golden continuation: exactly when `tol` is zero; otherwise step
/// by step until the first step whose golden margin is within `tol` (a close call the reference
/// itself could have made either way) where the ids part — past it the inputs differ and
/// nothing more can be compared. Returns how many steps were compared.
#[track_caller]
fn check_greedy(what: &str, ours: &[u32], golden: &Golden, tol: f32) -> usize {
    assert_eq!(ours.len(), golden.greedy.len(), "{what}: number of generated ids");
    if tol == 0.0 {
        assert_eq!(ours, golden.greedy, "{what}: greedy continuation");
        return ours.len();
    }
    let vocab = golden.logits.len() / golden.ids.len();
    for (step, (&got, &want)) in ours.iter().zip(&golden.greedy).enumerate() {
        // Step 0 is picked from the prompt's last position, step i from the logits after
        // feeding greedy token i - 1.
        let row = if step == 0 {
            &golden.logits[golden.logits.len() - vocab..]
        } else {
            &golden.decode_logits[(step - 1) * vocab..step * vocab]
        };
        if got != want {
            let margin = relative_margin(row);
            assert!(
                margin <= tol,
                "{what}: step {step} picked {got}, the golden {want} by a margin of {margin:.3} of max |logit| \
                 (> {tol}): ours {ours:?}, golden {:?}",
                golden.greedy
            );
            println!("{what}: diverged at step {step} on a close call (margin {margin:.3})");
            return step;
        }
    }
    ours.len()
}

/// `strix run` greedy on a golden prompt with the flags `extra`; the JSON and stderr.
fn golden_run(model: &str, golden: &Golden, extra: &str) -> (Value, String) {
    let out = greedy(model, &join_ids(&golden.ids), golden.greedy.len(), &format!("{extra} --json"));
    (json_of(extra, &out), stderr(&out))
}

#[test]
fn device_cpu_runs_the_goldens() {
    let name = "causal-bf16-sharded";
    let model = fixture_arg(name);
    for (t, golden) in goldens(name) {
        let (json, err) = golden_run(&model, &golden, "--device cpu --verbose");
        check_greedy(&format!("{name} p{t} cpu"), &ids_of(&json["ids"]), &golden, 0.0);
        assert!(err.contains("strix: device: cpu"), "--verbose names no device: {err}");
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("cpu.safetensors");
    let out = strix(&[
        "logits",
        "--model",
        &model,
        "--prompt-ids",
        "1,2,3",
        "--device",
        "cpu",
        "--out",
        path.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", stderr(&out));
    assert_eq!(read_logits(&path).0, vec![3, 384]);
}

#[test]
fn device_auto_picks_cuda_when_present_else_the_cpu() {
    let name = "causal-bf16-sharded";
    let model = fixture_arg(name);
    let (t, golden) = goldens(name).remove(0);
    let (json, err) = golden_run(&model, &golden, "--device auto --verbose");
    let expected = if has_cuda() { "strix: device: cuda:0" } else { "strix: device: cpu" };
    assert!(err.contains(expected), "expected `{expected}` on stderr: {err}");
    let tol = if has_cuda() { CUDA_GREEDY_TOL } else { 0.0 };
    check_greedy(&format!("{name} p{t} auto"), &ids_of(&json["ids"]), &golden, tol);
}

/// `--kv-cache`: the CPU keeps an f32 cache only, so bf16 there is one clean error naming the
/// flag; f32 runs; a type that does not exist is a usage error, never a panic.
#[test]
fn kv_cache_types_the_cpu_does_not_keep_are_one_clean_error() {
    let model = fixture_arg("causal-bf16-gdn3x");
    let run =
        |kv: &str| strix(&cmd("run", &model, &format!("--prompt-ids 1,2 -n 1 --device cpu --kv-cache {kv}")));
    assert_clean_error(&run("bf16"), "--kv-cache bf16");
    let out = run("f32");
    assert!(out.status.success(), "{}", stderr(&out));
    let out = run("f16");
    assert!(!out.status.success() && !stderr(&out).contains("panicked"), "{}", stderr(&out));
    assert!(stderr(&out).contains("`f16` is not a KV cache type"), "{}", stderr(&out));
}

/// `--ubatch` sets the prefill pass: a prompt longer than one pass gives the same tokens in
/// passes of 64 as in one pass (the logits agree to rounding), and a length that is not a
/// multiple of 64 is one clean error naming the flag.
#[test]
fn ubatch_splits_the_prompt_into_passes() {
    let model = fixture_arg("causal-bf16-gdn3x");
    let ids: Vec<String> = (0..150).map(|i| ((i * 37 + 11) % 300).to_string()).collect();
    let ids = ids.join(",");
    let run = |ubatch: &str| greedy(&model, &ids, 4, &format!("--device cpu --json --ubatch {ubatch}"));
    let (one, split) = (run("512"), run("64"));
    assert!(one.status.success() && split.status.success(), "{}{}", stderr(&one), stderr(&split));
    let tokens = |out: &std::process::Output| {
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("run --json prints JSON");
        v["ids"].clone()
    };
    assert!(
        tokens(&one).as_array().is_some_and(|t| t.len() == 4),
        "{}",
        String::from_utf8_lossy(&one.stdout)
    );
    assert_eq!(tokens(&one), tokens(&split), "greedy tokens with one pass vs passes of 64");
    assert_clean_error(&run("100"), "--ubatch 100");
}

#[test]
fn device_cuda_without_a_gpu_is_one_clean_error() {
    let model = fixture_arg("causal-bf16-gdn3x");
    // A device that does not exist, on any machine.
    assert_clean_error(&strix(&cmd("run", &model, "--prompt-ids 1,2 --device cuda:99")), "--device cuda:99");
    // Not a device at all: clap's usage error, not a panic.
    let out = strix(&cmd("run", &model, "--prompt-ids 1,2 --device tpu"));
    assert!(!out.status.success() && !stderr(&out).contains("panicked"), "{}", stderr(&out));
    assert!(stderr(&out).contains("`tpu` is not a device"), "{}", stderr(&out));
    if has_cuda() {
        println!("skipped the no-GPU half: this machine has a CUDA device");
        return;
    }
    let cuda = ["--device", "cuda"];
    assert_clean_error(
        &strix(&[&["run", "--model", &model, "--prompt-ids", "1,2"][..], &cuda].concat()),
        "--device cuda:0",
    );
    assert_clean_error(
        &strix(&[&["logits", "--model", &model, "--prompt-ids", "1", "--out", "x.st"][..], &cuda].concat()),
        "--device cuda:0",
    );
    assert_clean_error(&strix(&[&["bench", "--model", &model][..], &cuda].concat()), "--device cuda:0");
    assert_clean_error(
        &strix_with_stdin(&[&["chat", "--model", &model][..], &cuda].concat(), Some("Hi\n")),
        "--device cuda:0",
    );
}

#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored there (scripts/gpu/run.sh does)"]
fn device_cuda_greedy_and_logits_match_the_goldens() {
    if skipped_without_cuda() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    for name in ["causal-bf16-sharded", "causal-bf16-gdn3x"] {
        let model = fixture_arg(name);
        for (t, golden) in goldens(name) {
            let (json, err) = golden_run(&model, &golden, "--device cuda --verbose");
            assert!(err.contains("strix: device: cuda:0"), "--verbose names no CUDA device: {err}");
            let ours = ids_of(&json["ids"]);
            let compared = check_greedy(&format!("{name} p{t} cuda"), &ours, &golden, CUDA_GREEDY_TOL);
            println!("{name} p{t}: cuda greedy {ours:?}, golden {:?}: {compared} steps agree", golden.greedy);

            let path = dir.path().join(format!("{name}-p{t}.safetensors"));
            let ids = join_ids(&golden.ids);
            let out = strix(&[
                "logits",
                "--model",
                &model,
                "--prompt-ids",
                &ids,
                "--device",
                "cuda",
                "--out",
                path.to_str().unwrap(),
            ]);
            assert!(out.status.success(), "logits --device cuda failed: {}", stderr(&out));
            let (shape, logits) = read_logits(&path);
            assert_eq!(shape, vec![t, golden.logits.len() / t]);
            let max_ref = golden.logits.iter().fold(0f32, |m, x| m.max(x.abs()));
            let max_diff = logits.iter().zip(&golden.logits).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
            println!("{name} p{t}: cuda logits max|Δ|/max|ref| = {:.2e}", max_diff / max_ref);
            assert!(max_diff / max_ref <= CUDA_LOGITS_TOL, "{name} p{t}: {:e}", max_diff / max_ref);
        }
    }
}

#[test]
#[ignore = "needs a CUDA GPU: run with --include-ignored there (scripts/gpu/run.sh does)"]
fn device_cuda_bench_reports_memory_bandwidth_and_paths() {
    if skipped_without_cuda() {
        return;
    }
    let model = fixture_arg("causal-bf16-sharded");
    let json = strix_json(&cmd("bench", &model, "--device cuda --prompt-len 16 --gen 4 --repeats 1 --prompt-lens 130 --contexts 16 --batches 1,4 --batch-context 8 --bandwidth-mib 256"));
    assert_eq!(json["device"]["kind"], "cuda");
    assert!(json["device"]["memory_used_bytes"].as_u64().is_some_and(|m| m > 0), "{json}");
    assert!(json["memory_bandwidth_gb_s"].as_f64().is_some_and(|b| b > 10.0), "{json}");
    assert!(json["roofline_pct"].as_f64().is_some_and(|p| p > 0.0), "{json}");
    let paths = |v: &Value, key: &str| v["paths"][key].as_u64().unwrap_or(0);
    let prefill = &json["prefill"][0];
    assert!(prefill["tok_s"].as_f64().unwrap() > 0.0);
    assert!(paths(prefill, "gemm_cublas") + paths(prefill, "gemm_fallback") > 0, "{prefill}");
    assert!(paths(prefill, "gdn_chunked") > 0, "{prefill}");
    let decode = &json["decode"][0];
    // Decode steps are recorded once and replayed as CUDA graphs.
    assert!(decode["tok_s"].as_f64().unwrap() > 0.0 && paths(decode, "graph_replays") > 0, "{decode}");
    // Only the timed decode steps are counted, not the untimed prefill before them.
    assert_eq!(paths(decode, "gdn_chunked") + paths(decode, "gemm_cublas"), 0, "{decode}");
    let batched = json["batched"].as_array().unwrap();
    assert_eq!(batched.len(), 2);
    for b in batched {
        assert!(paths(b, "graph_replays") > 0, "a batch's steps were not replayed: {b}");
    }
    assert!(json["path_counts"]["batch_rows"].as_u64().unwrap() > 0);
    assert!(json["path_counts"]["graph_captures"].as_u64().unwrap() > 0);
}

#[test]
fn bench_sweeps_on_the_cpu() {
    let model = fixture_arg("causal-bf16-sharded");
    let json = strix_json(&cmd("bench", &model, "--device cpu --prompt-len 8 --gen 2 --repeats 1 --threads 1 --bandwidth-mib 16 --prompt-lens 8,70 --contexts 8 --batches 1,3 --batch-context 4"));
    assert_eq!(json["device"]["kind"], "cpu");
    assert!(json["device"]["memory_used_bytes"].as_u64().is_some_and(|m| m > 0), "{json}");
    assert_eq!(json["path_counts"], Value::Null);
    let prefill = json["prefill"].as_array().unwrap();
    assert_eq!(prefill.iter().map(|p| p["prompt_len"].as_u64().unwrap()).collect::<Vec<_>>(), [8, 70]);
    assert!(prefill.iter().all(|p| p["tok_s"].as_f64().unwrap() > 0.0), "{json}");
    let decode = &json["decode"][0];
    assert_eq!(decode["context"], 8);
    assert!(decode["tok_s"].as_f64().unwrap() > 0.0 && decode["roofline_pct"].as_f64().unwrap() > 0.0);
    let batched = json["batched"].as_array().unwrap();
    assert_eq!(batched.iter().map(|b| b["batch"].as_u64().unwrap()).collect::<Vec<_>>(), [1, 3]);
    for b in batched {
        assert_eq!(b["context"], 4);
        let (tok_s, ms) = (b["tok_s"].as_f64().unwrap(), b["ms_per_step"].as_f64().unwrap());
        // Aggregate speed: batch tokens per step.
        let batch = b["batch"].as_f64().unwrap();
        assert!(tok_s > 0.0 && (tok_s * ms / 1e3 - batch).abs() < 1e-6 * batch, "{b}");
    }
    // The headline keeps its fields.
    assert_eq!(json["prompt_len"], 8);
    assert_eq!(json["context"], 10);
    assert!(json["decode_tok_s"].as_f64().unwrap() > 0.0);
}

// --- mixture-of-experts models ---------------------------------------------------------------

/// A MoE fixture (`tests/fixtures/moe-models/`, made by `scripts/make_moe_fixtures.py`), named
/// from the dense fixtures' directory.
const MOE_FIXTURES: [&str; 2] = ["../moe-models/moe-vlm-f32-fused", "../moe-models/moe-causal-bf16-sharded"];

/// `run` and `logits` on a MoE model directory, unchanged: the greedy continuation and every
/// position's logits of the transformers goldens (1e-4).
#[test]
fn goldens_moe_models() {
    for name in MOE_FIXTURES {
        check_fixture_against_goldens(name);
    }
}

/// `perplexity` on a MoE model: its PPL is the one the `logits` command's output gives by
/// llama-perplexity's definition (windows of --ctx from a fresh state, the second half
/// scored), computed here in f64. The two agree to the printed digits.
#[test]
fn perplexity_of_a_moe_model_is_what_its_logits_give() {
    let name = MOE_FIXTURES[0];
    let model = fixture_arg(name);
    let dir = tempfile::tempdir().unwrap();
    let text =
        "The quick brown fox jumps over the lazy dog, and a small model can still be useful. ".repeat(12);
    let file = dir.path().join("text.txt");
    std::fs::write(&file, &text).unwrap();
    let ids = tokenizer(name).encode(&text, false).unwrap();
    let ctx = 64;
    assert!(ids.len() >= 2 * ctx, "{} tokens", ids.len());
    let out = strix(&["perplexity", "--model", &model, "--file", &file.display().to_string(), "--ctx", "64"]);
    assert!(out.status.success(), "perplexity failed: {}", stderr(&out));
    let printed: f64 = stdout(&out)
        .lines()
        .find_map(|l| l.strip_prefix("Final estimate: PPL = "))
        .and_then(|rest| rest.split_whitespace().next())
        .expect("a Final estimate line")
        .parse()
        .unwrap();

    let (mut nll, mut count) = (0f64, 0usize);
    for (w, window) in ids.chunks_exact(ctx).take(ids.len() / ctx).enumerate() {
        let path = dir.path().join(format!("w{w}.safetensors"));
        let out = strix(&[
            "logits",
            "--model",
            &model,
            "--prompt-ids",
            &join_ids(window),
            "--out",
            &path.display().to_string(),
        ]);
        assert!(out.status.success(), "logits failed: {}", stderr(&out));
        let (shape, logits) = read_logits(&path);
        let vocab = shape[1];
        for j in ctx / 2..ctx - 1 {
            let row = &logits[j * vocab..(j + 1) * vocab];
            let max = row.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v)) as f64;
            let lse = max + row.iter().map(|&v| (v as f64 - max).exp()).sum::<f64>().ln();
            nll += lse - row[window[j + 1] as usize] as f64;
            count += 1;
        }
    }
    let ppl = (nll / count as f64).exp();
    println!("perplexity {printed} vs {ppl} from the logits");
    assert!((printed - ppl).abs() <= 1e-4 * ppl + 1e-4, "printed {printed}, from logits {ppl}");
}

/// `--json-schema FILE` and `--grammar FILE` constrain `run`'s output (the fixture's weights
/// are random, so only the constraint makes it valid), sampled or greedy, plain or with the
/// chat template; a schema llguidance cannot compile is one clean error naming it.
#[test]
fn json_schema_and_grammar_constrain_run() {
    let dir = tempfile::tempdir().unwrap();
    let schema = dir.path().join("schema.json");
    std::fs::write(
        &schema,
        r#"{"type": "object", "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99},
            "c": {"enum": ["a", "b"]}}, "required": ["n", "c"], "additionalProperties": false}"#,
    )
    .unwrap();
    let grammar = dir.path().join("g.lark");
    std::fs::write(&grammar, "start: \"<\" WORD (\",\" WORD)? \">\"\nWORD: /[a-z]{1,3}/\n").unwrap();
    let model = fixture_arg("vlm-f32-gdn2x");
    let schema_arg = schema.display().to_string();
    let grammar_arg = grammar.display().to_string();
    for sampling in [&["--temperature", "0"][..], &["--temperature", "1", "--seed", "4"]] {
        for chat in [false, true] {
            let mut args =
                vec!["run", "--model", &model, "-n", "200", "--json", "--json-schema", &schema_arg];
            args.extend_from_slice(sampling);
            if chat {
                args.push("--chat");
            }
            args.push("Give me a record");
            let json = strix_json(&args);
            let text = json["text"].as_str().unwrap();
            let text = text.strip_prefix("</think>").unwrap_or(text).trim_start();
            let v: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{args:?}: {e}: {json}"));
            assert!((0..=99).contains(&v["n"].as_i64().unwrap()), "{json}");
            assert!(["a", "b"].contains(&v["c"].as_str().unwrap()), "{json}");
            assert_eq!(json["finish_reason"], "eos", "{json}");
        }
        let mut args = vec!["run", "--model", &model, "-n", "50", "--json", "--grammar", &grammar_arg];
        args.extend_from_slice(sampling);
        args.push("x");
        let json = strix_json(&args);
        let text = json["text"].as_str().unwrap();
        assert!(text.starts_with('<') && text.ends_with('>') && text.len() <= 9, "{json}");
    }
    std::fs::write(&schema, r#"{"type": "objekt"}"#).unwrap();
    let out = strix(&["run", "--model", &model, "-n", "5", "--json-schema", &schema_arg, "x"]);
    assert_clean_error(&out, "cannot compile the JSON schema");
}
