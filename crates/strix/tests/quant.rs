//! The GGML block formats against GGML's own references, bit for bit.
//!
//! `tests/fixtures/gguf/quant_vectors.safetensors` (written by
//! `scripts/make_gguf_fixtures.py`) holds, for Q8_0, Q4_0, Q4_K and Q6_K and a set of
//! inputs (random blocks of widely varying magnitude, all zeros, scales in and below f16's
//! subnormal range, one huge outlier, negative-only, positive-only, constant, large, a
//! ramp, exact rounding ties, zero sub-blocks among random ones), the bytes GGML's reference
//! quantizer makes of them and the floats its dequantizer makes of those bytes; plus blocks
//! of random bytes with their dequantization. strix must reproduce every byte and every
//! float bit.

use std::path::PathBuf;

use safetensors::tensor::Dtype;
use safetensors::SafeTensors;
use strix::quant::{self, blocks, QuantType};

fn vectors() -> Vec<u8> {
    let path =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/gguf/quant_vectors.safetensors");
    std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

fn f32s(st: &SafeTensors, name: &str) -> Option<Vec<f32>> {
    let t = st.tensor(name).ok()?;
    assert_eq!(t.dtype(), Dtype::F32, "{name}");
    Some(t.data().chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect())
}

fn u8s(st: &SafeTensors, name: &str) -> Vec<u8> {
    let t = st.tensor(name).unwrap_or_else(|_| panic!("{name} missing"));
    assert_eq!(t.dtype(), Dtype::U8, "{name}");
    t.data().to_vec()
}

const TYPES: [QuantType; 4] = [QuantType::Q8_0, QuantType::Q4_0, QuantType::Q4_K, QuantType::Q6_K];

/// (type, case) for every case in the file, so a case added to the script is tested too.
fn cases(st: &SafeTensors) -> Vec<(QuantType, String)> {
    let mut out: Vec<(QuantType, String)> = st
        .names()
        .into_iter()
        .filter_map(|n| n.strip_suffix(".q"))
        .map(|n| {
            let (ty, case) = n.split_once('.').unwrap();
            (QuantType::from_name(ty).unwrap(), case.to_string())
        })
        .collect();
    out.sort_by(|a, b| (a.0.id(), &a.1).cmp(&(b.0.id(), &b.1)));
    out
}

fn first_mismatch(a: &[f32], b: &[f32]) -> Option<(usize, f32, f32)> {
    a.iter().zip(b).enumerate().find(|(_, (x, y))| x.to_bits() != y.to_bits()).map(|(i, (x, y))| (i, *x, *y))
}

#[test]
fn fixture_covers_every_type_and_edge_case() {
    let bytes = vectors();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let all = cases(&st);
    for ty in TYPES {
        let names: Vec<&str> = all.iter().filter(|c| c.0 == ty).map(|c| c.1.as_str()).collect();
        for want in
            ["random", "zeros", "tiny", "tinier", "outlier", "negative", "positive", "constant", "randbytes"]
        {
            assert!(names.contains(&want), "{ty}: no `{want}` case in {names:?}");
        }
    }
}

#[test]
fn dequantization_is_bit_exact_with_ggml() {
    let bytes = vectors();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    for (ty, case) in cases(&st) {
        let name = format!("{}.{case}", ty.name().to_lowercase());
        let q = u8s(&st, &format!("{name}.q"));
        let want = f32s(&st, &format!("{name}.y")).unwrap();
        let mut got = vec![f32::NAN; want.len()];
        quant::dequantize_row(ty, &q, &mut got).unwrap();
        if let Some((i, g, w)) = first_mismatch(&got, &want) {
            panic!("{name}: weight {i} dequantizes to {g:e}, GGML gives {w:e}");
        }
        assert!(got.iter().all(|v| v.is_finite()), "{name}: non-finite output");
    }
}

#[test]
fn quantization_is_bit_exact_with_ggml_reference() {
    let bytes = vectors();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let mut checked = 0;
    for (ty, case) in cases(&st) {
        let name = format!("{}.{case}", ty.name().to_lowercase());
        let Some(x) = f32s(&st, &format!("{name}.x")) else { continue };
        let want = u8s(&st, &format!("{name}.q"));
        let mut got = vec![0u8; ty.row_size(x.len()).unwrap()];
        quant::quantize_row(ty, &x, &mut got).unwrap();
        if let Some(i) = got.iter().zip(&want).position(|(a, b)| a != b) {
            let block = i / ty.type_size();
            panic!(
                "{name}: byte {i} (block {block}, byte {} in it) is {:#04x}, GGML writes {:#04x}",
                i % ty.type_size(),
                got[i],
                want[i]
            );
        }
        checked += 1;
    }
    assert!(checked >= 40, "only {checked} cases");
}

/// Blocks are independent: quantizing one block at a time gives the same bytes as a row.
#[test]
fn blocks_are_independent() {
    let bytes = vectors();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    for ty in TYPES {
        let name = format!("{}.random", ty.name().to_lowercase());
        let x = f32s(&st, &format!("{name}.x")).unwrap();
        let want = u8s(&st, &format!("{name}.q"));
        let (bs, ts) = (ty.block_size(), ty.type_size());
        for (i, xb) in x.chunks(bs).enumerate() {
            let mut got = vec![0u8; ts];
            quant::quantize_row(ty, xb, &mut got).unwrap();
            assert_eq!(got, want[i * ts..(i + 1) * ts], "{name}: block {i}");
        }
    }
}

/// What the edge cases mean, checked directly rather than only through the references.
#[test]
fn edge_cases_behave() {
    let bytes = vectors();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    for ty in TYPES {
        let lower = ty.name().to_lowercase();
        let y = |case: &str| f32s(&st, &format!("{lower}.{case}.y")).unwrap();
        let x = |case: &str| f32s(&st, &format!("{lower}.{case}.x")).unwrap();

        assert!(y("zeros").iter().all(|&v| v == 0.0), "{ty}: zeros");
        // A scale below f16's range rounds to zero: everything dequantizes to zero.
        assert!(y("tinier").iter().all(|&v| v == 0.0), "{ty}: tinier");
        // The outlier survives (its block's scale is built around it).
        let (xo, yo) = (x("outlier"), y("outlier"));
        let i = xo.iter().position(|&v| v == 1000.0).unwrap();
        assert!((yo[i] - 1000.0).abs() < 10.0, "{ty}: outlier became {}", yo[i]);
        // Sign-only inputs stay (nearly) on their side of zero.
        let step = match ty {
            QuantType::Q8_0 => 0.03,
            QuantType::Q6_K => 0.1,
            _ => 0.4,
        };
        assert!(y("negative").iter().all(|&v| v <= step), "{ty}: negative");
        assert!(y("positive").iter().all(|&v| v >= -step), "{ty}: positive");
    }
}

#[test]
fn direct_block_functions_match_dispatch() {
    let bytes = vectors();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let q = u8s(&st, "q4_k.random.q");
    let mut a = vec![0f32; q.len() / blocks::Q4_K_BYTES * blocks::QK_K];
    let mut b = a.clone();
    blocks::dequantize_row_q4_k(&q, &mut a);
    quant::dequantize_row(QuantType::Q4_K, &q, &mut b).unwrap();
    assert_eq!(a, b);
}
