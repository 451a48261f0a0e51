//! The fused Gated DeltaNet decode kernel (`Backend::deltanet_decode_rows`: conv1d + SiLU, the
//! delta rule on the f32 state, the gated RMSNorm) alone, at the DeltaNet shapes of
//! qwen3.5-0.8b and qwen3.5-9b, for decode batches of 1, 16 and 64 sequences.
//!
//! `cargo run --release --example cuda_gdn_bench -- [--reps N] [--batches 1,16,64] [--cols auto,16]
//! [PRESET ...]`
//!
//! Each config launches the op `2 + reps` times (two warm-ups), cycling through enough state
//! sets (~256 MB, four times the L2) that no launch finds its state in L2, as in a real step
//! where ~1 GB of weights streams between two visits of a layer. It prints the host-timed time per call
//! (launches back to back, then a synchronize) and the state bandwidth it implies (read +
//! write, GB/s). At small batches that time is the host's cost to queue a launch (pointer
//! uploads included), not the kernel's: for the kernel's own time run it under
//! `ncu --clock-control none --metrics gpu__time_duration.sum -k regex:gdn_decode`; the
//! `config` lines say how many launches each config made, in order.
//! `--cols auto,16,32,64,128` runs every config once per column tiling of the kernel (a backend
//! made with `STRIX_GDN_DECODE_COLS` set; `auto`, the default, lets the launcher choose).

#[path = "common/bench.rs"]
mod bench;
#[path = "common/gpu.rs"]
mod gpu;

use std::time::Instant;

use bench::Random;

use strix::backend::cuda::{CudaBackend, CudaOptions};
use strix::backend::{Backend, DeltaNetLayer, DeltaNetProjections, DeltaNetState};
use strix::model::deltanet_shape;
use strix::synthetic::preset;

fn main() -> strix::Result<()> {
    let mut presets = Vec::new();
    let mut reps = 40usize;
    let mut batches = vec![1usize, 16, 64];
    let mut tilings = vec!["auto".to_string()];
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        match a.as_str() {
            "--reps" => reps = args.next().and_then(|s| s.parse().ok()).expect("--reps N"),
            "--batches" => {
                batches = args
                    .next()
                    .map(|s| s.split(',').map(|b| b.parse().expect("--batches 1,16,64")).collect())
                    .expect("--batches 1,16,64")
            }
            "--cols" => {
                tilings = args.next().expect("--cols auto,16,32").split(',').map(String::from).collect()
            }
            _ => presets.push(a),
        }
    }
    if presets.is_empty() {
        presets = vec!["qwen3.5-0.8b".into(), "qwen3.5-9b".into()];
    }
    for tiling in &tilings {
        // The tiling is chosen when the backend loads its kernels.
        let cols = match tiling.as_str() {
            "auto" => None,
            cols => {
                Some(cols.parse().map_err(|_| strix::Error::Input(format!("--cols {cols}: not a number")))?)
            }
        };
        let b = CudaBackend::with_options(0, &CudaOptions { gdn_decode_cols: cols, ..gpu::options()? })?;
        println!("device: {}, tiling {tiling}", b.device_name());
        for name in &presets {
            let sh = deltanet_shape(&preset(name)?);
            let (cd, vd, nv, dv) = (sh.conv_dim(), sh.value_dim(), sh.num_v_heads, sh.v_head_dim);
            let conv_w = b.upload(&Random::new(1).vec(cd * sh.conv_kernel, 0.5));
            let a_log = b.upload(&Random::new(2).vec(nv, 1.0));
            let dt_bias = b.upload(&Random::new(3).vec(nv, 1.0));
            let norm = b.upload(&Random::new(4).vec(dv, 1.0));
            for &n in &batches {
                let mut qkv = b.upload(&Random::new(5).vec(n * cd, 1.0));
                let z = b.upload(&Random::new(6).vec(n * vd, 1.0));
                let a = b.upload(&Random::new(7).vec(n * nv, 2.0));
                let bb = b.upload(&Random::new(8).vec(n * nv, 2.0));
                let mut out = b.zeros(n * vd);
                let set_bytes = n * sh.state_len() * 4;
                let sets = (256usize << 20).div_ceil(set_bytes).max(2);
                let state0 = Random::new(9).vec(n * sh.state_len(), 0.5);
                let conv0 = Random::new(10).vec(n * sh.conv_state_len(), 1.0);
                let mut states: Vec<Vec<_>> =
                    (0..sets).map(|_| state0.chunks(sh.state_len()).map(|s| b.upload(s)).collect()).collect();
                let mut convs: Vec<Vec<_>> = (0..sets)
                    .map(|_| conv0.chunks(sh.conv_state_len()).map(|s| b.upload(s)).collect())
                    .collect();
                let layer = DeltaNetLayer {
                    shape: sh,
                    conv1d: &conv_w,
                    a_log: &a_log,
                    dt_bias: &dt_bias,
                    norm: &norm,
                };
                let mut call = |i: usize| {
                    let set = i % sets;
                    let mut set_states: Vec<_> = convs[set]
                        .iter_mut()
                        .zip(states[set].iter_mut())
                        .map(|(conv, recurrent)| DeltaNetState { conv, recurrent })
                        .collect();
                    let projections = DeltaNetProjections { qkv: &mut qkv, z: &z, a: &a, b: &bb };
                    b.deltanet_decode_rows(layer, projections, &mut set_states, &mut out)
                };
                call(0);
                call(1);
                b.synchronize()?;
                let t = Instant::now();
                for i in 0..reps {
                    call(i + 2);
                }
                b.synchronize()?;
                let us = t.elapsed().as_secs_f64() / reps as f64 * 1e6;
                let gbs = 2.0 * set_bytes as f64 / (us * 1e-6) / 1e9;
                let launches = reps + 2;
                println!(
                    "config {name}/{tiling} batch {n} launches {launches} state_bytes {set_bytes} | \
                     host-timed {us:.1} us/call, {gbs:.0} GB/s of state read + written"
                );
            }
        }
        println!("{}", b.path_counts());
    }
    Ok(())
}
