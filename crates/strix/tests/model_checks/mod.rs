//! Checks of whole models that several test files run the same way: the fixture directories
//! that hold goldens, a model's prompt and greedy decode against a fixture's `transformers`
//! goldens, a prompt fed in pieces, and decode batches against each sequence decoding alone.
//! The users declare `mod common;` beside `mod model_checks;` (the goldens and the error
//! measure come from there).

#![allow(dead_code)]

use std::path::{Path, PathBuf};

use strix::backend::Backend;
use strix::model::{Logits, Model};
use strix::session::Session;

use crate::common::{argmax, cases, rel_err};

/// The directories under `root` that hold a `goldens.safetensors`, in name order.
pub fn golden_dirs(root: &Path) -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    for entry in std::fs::read_dir(root).unwrap_or_else(|e| panic!("{}: {e}", root.display())) {
        let dir = entry.unwrap().path();
        if dir.join("goldens.safetensors").exists() {
            dirs.push(dir);
        }
    }
    dirs.sort();
    dirs
}

/// Every prompt position's logits in one forward pass, then one greedy step at a time through
/// the session (the recurrent delta rule and the growing KV cache), for each golden case of
/// `dir`: each greedy token is the golden one, and the prompt's logits and the worst decode
/// step's are within `tolerance` (max |Δ| / max |reference|; the errors reached are printed,
/// labelled `name`).
pub fn check_against_goldens<B: Backend>(
    model: &Model<B>,
    dir: &Path,
    name: &str,
    session_len: usize,
    tolerance: f32,
) {
    let vocab = model.config.vocab_size;
    for case in cases(dir) {
        let mut session = model.new_session(session_len);
        let logits = model.forward(&mut session, &case.ids, Logits::All).unwrap();
        let e = rel_err(&logits, &case.logits);
        println!("{name} T={}: prompt logits rel err {e:.2e}", case.len);
        assert!(e <= tolerance, "{name} T={}: prompt logits rel err {e:.2e} > {tolerance:e}", case.len);
        let mut next = argmax(&logits[(case.len - 1) * vocab..]);
        let mut worst = 0.0f32;
        for (step, &expected) in case.greedy.iter().enumerate() {
            assert_eq!(next, expected, "{name} T={}: greedy token {step}", case.len);
            let logits = model.forward(&mut session, &[next], Logits::Last).unwrap();
            worst = worst.max(rel_err(&logits, &case.decode_logits[step * vocab..(step + 1) * vocab]));
            next = argmax(&logits);
        }
        println!("{name} T={}: decode logits worst rel err {worst:.2e}", case.len);
        assert!(worst <= tolerance, "{name} T={}: decode rel err {worst:.2e}", case.len);
    }
}

/// The logits of every position of `ids` fed to one fresh session in pieces of the lengths
/// `pieces` (which must cover `ids` exactly).
pub fn logits_in_pieces<B: Backend>(
    model: &Model<B>,
    session_len: usize,
    ids: &[u32],
    pieces: &[usize],
) -> Vec<f32> {
    assert_eq!(pieces.iter().sum::<usize>(), ids.len(), "pieces {pieces:?} do not cover the ids");
    let mut session = model.new_session(session_len);
    let mut rest = ids;
    let mut logits = Vec::new();
    for &n in pieces {
        let (piece, tail) = rest.split_at(n);
        logits.extend(model.forward(&mut session, piece, Logits::All).unwrap());
        rest = tail;
    }
    logits
}

/// Each prompt prefilled in two sessions (bitwise the same last logits), then `steps` greedy
/// decode steps, each run once as one batch of the sequences `members(step)` and once for
/// each of them alone: every row of the batch must be bitwise the logits its sequence gets
/// decoding alone (`label` names the model in a failure).
pub fn check_decode_batches_equal_alone<B: Backend>(
    model: &Model<B>,
    prompts: &[Vec<u32>],
    session_len: usize,
    steps: usize,
    members: impl Fn(usize) -> Vec<usize>,
    label: &str,
) {
    let vocab = model.config.vocab_size;
    let (mut alone, mut batched, mut next) = (Vec::new(), Vec::new(), Vec::new());
    for prompt in prompts {
        let (mut a, mut b) = (model.new_session(session_len), model.new_session(session_len));
        let last = model.forward(&mut a, prompt, Logits::Last).unwrap();
        assert_eq!(last, model.forward(&mut b, prompt, Logits::Last).unwrap());
        next.push(argmax(&last));
        alone.push(a);
        batched.push(b);
    }
    for step in 0..steps {
        let members = members(step);
        let mut refs: Vec<&mut Session<B>> =
            batched.iter_mut().enumerate().filter(|(i, _)| members.contains(i)).map(|(_, s)| s).collect();
        let tokens: Vec<u32> = members.iter().map(|&i| next[i]).collect();
        let out = model.decode_batch(&mut refs, &tokens).unwrap();
        for (row, &i) in members.iter().enumerate() {
            let single = model.forward(&mut alone[i], &[next[i]], Logits::Last).unwrap();
            assert_eq!(&out[row * vocab..(row + 1) * vocab], &single[..], "{label} step {step} seq {i}");
            next[i] = argmax(&single);
        }
    }
}

/// The decode-batch tests' prompts: lengths 1, 5, 64, 70 and 3 (across the delta rule's
/// 64-token chunk), ids below 300.
pub fn batch_prompts() -> Vec<Vec<u32>> {
    [1usize, 5, 64, 70, 3]
        .iter()
        .map(|&n| (0..n as u32).map(|i| (i * 7 + n as u32) % 300).collect())
        .collect()
}
