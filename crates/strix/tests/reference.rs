//! The CPU forward pass against the committed `transformers` goldens
//! (`tests/fixtures/models/*`, made by `scripts/make_fixtures.py`).
//!
//! Tolerance everywhere: max |strix − reference| / max |reference| ≤ 1e-4 (f32 arithmetic on
//! both sides; the errors reached are printed — about 1e-6).

mod common;
mod model_checks;

use common::{cases, fixtures, rel_err};
use model_checks::{
    batch_prompts, check_against_goldens, check_decode_batches_equal_alone, logits_in_pieces,
};
use strix::backend::cpu::CpuBackend;
use strix::model::{Logits, Model};

const TOLERANCE: f32 = 1e-4;

/// Every prompt position's logits from one forward pass, then ten greedy steps one token at a
/// time through the session (the recurrent GDN path and the growing KV cache).
#[test]
fn prompt_and_decode_logits_match_transformers() {
    for dir in fixtures() {
        let name = dir.file_name().unwrap().to_string_lossy().to_string();
        let model = Model::load(&dir, CpuBackend::new(), None).unwrap();
        check_against_goldens(&model, &dir, &name, 1024, TOLERANCE);
    }
}

/// prefill(A) followed by decoding B one token at a time gives the logits of prefill(A + B),
/// and so does prefill(A) followed by prefill(B) — in any split, across chunk boundaries.
#[test]
fn continuation_equals_one_long_prefill() {
    let dir = fixtures().into_iter().find(|d| d.ends_with("vlm-f32-gdn2x")).unwrap();
    let model = Model::load(&dir, CpuBackend::new(), None).unwrap();
    let vocab = model.config.vocab_size;
    let case = cases(&dir).into_iter().find(|c| c.len == 130).unwrap();
    let mut all_ids = case.ids.clone();
    all_ids.extend(&case.greedy);
    let mut whole = model.new_session(1024);
    let reference = model.forward(&mut whole, &all_ids, Logits::All).unwrap();

    for split in [&[1usize, 139][..], &[63, 1, 1, 75], &[64, 66, 10], &[65, 65, 1, 1, 8], &[100, 40]] {
        let got = logits_in_pieces(&model, 1024, &all_ids, split);
        let e = rel_err(&got, &reference);
        println!("split {split:?}: rel err {e:.2e}");
        assert!(e <= 1e-5, "split {split:?}: rel err {e:.2e}");
    }
    // Logits::Last of a prefill is the last row of Logits::All (the lm_head runs as a GEMV
    // instead of a GEMM, so only to rounding).
    let mut session = model.new_session(1024);
    let last = model.forward(&mut session, &all_ids, Logits::Last).unwrap();
    let e = rel_err(&last, &reference[(all_ids.len() - 1) * vocab..]);
    assert!(e <= 1e-6, "last row rel err {e:.2e}");
}

/// A shorter pass length splits one `forward` call into passes, which changes the logits only
/// in the last bits; a length that is not a multiple of the delta rule's chunk is refused.
#[test]
fn prompts_split_into_passes_of_the_pass_length() {
    let dir = fixtures().into_iter().find(|d| d.ends_with("vlm-f32-gdn2x")).unwrap();
    let mut model = Model::load(&dir, CpuBackend::new(), None).unwrap();
    assert_eq!(model.pass_tokens(), 512, "the CPU's preferred pass");
    let case = cases(&dir).into_iter().find(|c| c.len == 130).unwrap();
    let reference = model.forward(&mut model.new_session(256), &case.ids, Logits::All).unwrap();

    for bad in [0, 100, 65] {
        let e = model.set_pass_tokens(bad).unwrap_err().to_string();
        assert!(e.contains("multiple of 64"), "{bad}: {e}");
    }
    assert_eq!(model.pass_tokens(), 512, "a refused length changes nothing");
    model.set_pass_tokens(64).unwrap();
    let split = model.forward(&mut model.new_session(256), &case.ids, Logits::All).unwrap();
    let e = rel_err(&split, &reference);
    println!("passes of 64 vs one pass: rel err {e:.2e}");
    assert!(e <= 1e-5, "passes of 64: rel err {e:.2e}");
    // The same passes fed by hand (as the server feeds a prompt) are the same computation.
    let mut session = model.new_session(256);
    let mut by_hand = Vec::new();
    for piece in case.ids.chunks(64) {
        by_hand.extend(model.forward(&mut session, piece, Logits::All).unwrap());
    }
    assert_eq!(by_hand, split, "one call splits where the pieces end");
}

#[test]
fn bad_input_is_an_error_not_a_panic() {
    let dir = fixtures().into_iter().next().unwrap();
    let model = Model::load(&dir, CpuBackend::new(), None).unwrap();
    let mut session = model.new_session(8);
    let vocab = model.config.vocab_size as u32;
    let e = model.forward(&mut session, &[vocab], Logits::Last).unwrap_err().to_string();
    assert!(e.contains("outside the vocabulary"), "{e}");
    let e = model.forward(&mut session, &[1; 9], Logits::Last).unwrap_err().to_string();
    assert!(e.contains("8-token context"), "{e}");
    let e = model.forward(&mut session, &[], Logits::Last).unwrap_err().to_string();
    assert!(e.contains("no tokens"), "{e}");
    // The failed calls left the session untouched.
    assert_eq!(session.position(), 0);
    model.forward(&mut session, &[1; 8], Logits::Last).unwrap();
    assert_eq!(session.remaining(), 0);
}

/// A decode batch of sequences at different positions gives each sequence bitwise the logits
/// it gets decoding alone: what else is in the batch never changes a token.
#[test]
fn decode_batch_rows_equal_decoding_alone() {
    for dir in fixtures() {
        let model = Model::load(&dir, CpuBackend::new(), None).unwrap();
        let prompts = batch_prompts();
        // Vary the batch: everyone, then a shrinking subset.
        let members = |step: usize| (0..prompts.len()).filter(|i| step < 3 || i % 2 == 0).collect();
        check_decode_batches_equal_alone(&model, &prompts, 256, 6, members, &format!("{dir:?}"));
    }
}

/// Prepared draws (`Model::decode_batch_prepared`, the backend finishing each row's sampling
/// next to its logits) pick what the host sampler picks from `decode_batch`'s logits, and
/// report the log-probabilities it reports, step after step, for rows with different sampling
/// settings in one batch (temperature alone among them); a mismatched number of draws is an
/// error.
#[test]
fn prepared_draws_equal_host_sampling() {
    use strix::sampling::{Draw, Sampler, SamplingParams};
    let dir = &fixtures()[0];
    let model = Model::load(dir, CpuBackend::new(), None).unwrap();
    let vocab = model.config.vocab_size;
    let settings = [
        SamplingParams {
            temperature: 0.8,
            top_k: 20,
            top_p: 0.9,
            seed: Some(1),
            ..SamplingParams::default()
        },
        SamplingParams {
            temperature: 0.0,
            repetition_penalty: 1.3,
            seed: Some(2),
            ..SamplingParams::default()
        },
        SamplingParams {
            temperature: 1.2,
            top_k: 40,
            min_p: 0.02,
            presence_penalty: 0.5,
            frequency_penalty: 0.3,
            seed: Some(3),
            ..SamplingParams::default()
        },
        SamplingParams { temperature: 0.7, seed: Some(4), ..SamplingParams::default() },
    ];
    let logprobs = [Some(3), None, Some(0), Some(5)];
    let prompt: Vec<u32> = (0..9).map(|i| (i * 13 + 5) % 300).collect();
    let mut host_sessions: Vec<_> = settings.iter().map(|_| model.new_session(64)).collect();
    let mut prep_sessions: Vec<_> = settings.iter().map(|_| model.new_session(64)).collect();
    let mut host_samplers: Vec<_> = settings.iter().map(|p| Sampler::new(p.clone()).unwrap()).collect();
    let mut prep_samplers: Vec<_> = settings.iter().map(|p| Sampler::new(p.clone()).unwrap()).collect();
    let mut generated: Vec<Vec<u32>> = vec![Vec::new(); settings.len()];
    for i in 0..settings.len() {
        let logits = model.forward(&mut host_sessions[i], &prompt, Logits::Last).unwrap();
        model.forward(&mut prep_sessions[i], &prompt, Logits::Last).unwrap();
        let first = host_samplers[i].sample(&mut logits.clone(), &prompt, &[]);
        assert_eq!(prep_samplers[i].sample(&mut logits.clone(), &prompt, &[]), first);
        generated[i].push(first);
    }
    for step in 0..8 {
        let tokens: Vec<u32> = generated.iter().map(|g| *g.last().unwrap()).collect();
        let rows: Vec<_> = (0..settings.len())
            .map(|i| prep_samplers[i].prepare(&prompt, &generated[i], logprobs[i]))
            .collect();
        let picked = model
            .decode_batch_prepared(&mut prep_sessions.iter_mut().collect::<Vec<_>>(), &tokens, rows)
            .unwrap();
        let logits = model.decode_batch(&mut host_sessions.iter_mut().collect::<Vec<_>>(), &tokens).unwrap();
        for i in 0..settings.len() {
            let mut row = logits[i * vocab..(i + 1) * vocab].to_vec();
            let want = match logprobs[i] {
                Some(n) => {
                    let (token, lp) =
                        host_samplers[i].sample_with_logprobs(&mut row, &prompt, &generated[i], n);
                    Draw { token, logprobs: Some(lp) }
                }
                None => {
                    Draw { token: host_samplers[i].sample(&mut row, &prompt, &generated[i]), logprobs: None }
                }
            };
            assert_eq!(picked[i], Ok(want.clone()), "step {step} row {i}");
            generated[i].push(want.token);
        }
    }
    let mut s = model.new_session(8);
    assert!(model.decode_batch_prepared(&mut [&mut s], &[1], Vec::new()).is_err());
}

/// A prompt's first token drawn next to its last logits (`Model::prefill_draw`, as the server
/// and `generate` draw it) is what the host sampler draws from `forward`'s `Logits::Last`,
/// with the same log-probabilities, at prompt lengths inside one pass, at a pass's end and
/// across passes, for a prompt fed whole or its head fed first (`Model::prefill`); the
/// session is left where `forward` leaves it.
#[test]
fn prefill_draws_equal_host_sampling() {
    use strix::sampling::{sample_prepared, Sampler};
    let dir = &fixtures()[0];
    let mut model = Model::load(dir, CpuBackend::new(), None).unwrap();
    model.set_pass_tokens(64).unwrap();
    let settings = common::first_draw_settings();
    for len in [1, 2, 9, 64, 65, 130] {
        let prompt: Vec<u32> = (0..len).map(|i| (i * 29 + 3) % 300).collect();
        for (params, logprobs) in &settings {
            let (mut host, mut drawn) =
                (Sampler::new(params.clone()).unwrap(), Sampler::new(params.clone()).unwrap());
            let mut host_session = model.new_session(256);
            let mut logits = model.forward(&mut host_session, &prompt, Logits::Last).unwrap();
            let want = sample_prepared(&mut logits, &host.prepare(&prompt, &[], *logprobs));
            let mut session = model.new_session(256);
            let got =
                model.prefill_draw(&mut session, &prompt, &drawn.prepare(&prompt, &[], *logprobs)).unwrap();
            assert_eq!(got, want, "len {len}, {params:?}");
            // Fed as the server feeds it: a pass-sized head without logits, then the rest.
            if len > 64 {
                let mut split = model.new_session(256);
                let mut again = Sampler::new(params.clone()).unwrap();
                model.prefill(&mut split, &prompt[..64]).unwrap();
                let row = again.prepare(&prompt, &[], *logprobs);
                assert_eq!(
                    model.prefill_draw(&mut split, &prompt[64..], &row).unwrap(),
                    want,
                    "len {len} split"
                );
            }
            let next = want.unwrap().token;
            let a = model.forward(&mut host_session, &[next], Logits::Last).unwrap();
            let b = model.forward(&mut session, &[next], Logits::Last).unwrap();
            assert_eq!(a, b, "len {len}: the sessions differ after the prefill");
        }
    }
    let mut s = model.new_session(8);
    assert!(model.prefill(&mut s, &[]).is_err());
    assert!(model.prefill(&mut s, &[1; 9]).unwrap_err().to_string().contains("do not fit"));
}
