//! The device layout of packed GGML weights (described in `quant.cu`'s header): each row's
//! quants of every block, then each row's scales, the blocks' own bytes regrouped so that
//! every lane's weight load is one aligned 16-byte load. Host code only, below the device
//! module that uploads weights and the kernels that read them.

use rayon::prelude::*;

use crate::tensor::DType;

/// Bytes of a row's quant plane and of its scale planes, in the device layout.
pub(super) fn planes(dtype: DType, cols: usize) -> (usize, usize, usize) {
    match dtype {
        DType::Q8_0 => (cols, cols / 32 * 2, 0),
        DType::Q4_0 => (cols / 2, cols / 32 * 2, 0),
        DType::Q4_K => (cols / 2, cols / 256 * 16, 0),
        DType::Q6_K => (cols / 4 * 3, cols / 64 * 4, cols / 256 * 2),
        _ => unreachable!("not a block format"),
    }
}

/// Regroups a `[rows, cols]` matrix of GGML blocks into the device layout (`quant.cu`): per
/// row the quants of every block, then per row the scales. Same bytes, same size.
pub(super) fn repack(dtype: DType, src: &[u8], rows: usize, cols: usize) -> Vec<u8> {
    let row_bytes = dtype.row_bytes(cols).expect("checked by check_matrix");
    assert_eq!(src.len(), rows * row_bytes);
    let (qrow, srow, s2row) = planes(dtype, cols);
    assert_eq!(qrow + srow + s2row, row_bytes);
    let mut out = vec![0u8; src.len()];
    let (q, rest) = out.split_at_mut(rows * qrow);
    let (s, s2) = rest.split_at_mut(rows * srow);
    let s2_chunks: Vec<&mut [u8]> =
        if s2row == 0 { (0..rows).map(|_| &mut [][..]).collect() } else { s2.chunks_mut(s2row).collect() };
    q.par_chunks_mut(qrow.max(1))
        .zip(s.par_chunks_mut(srow.max(1)))
        .zip(s2_chunks.into_par_iter())
        .zip(src.par_chunks(row_bytes.max(1)))
        .for_each(|(((q, s), s2), src)| repack_row(dtype, src, q, s, s2));
    out
}

fn repack_row(dtype: DType, src: &[u8], q: &mut [u8], s: &mut [u8], s2: &mut [u8]) {
    match dtype {
        DType::Q8_0 => {
            for (b, blk) in src.chunks_exact(34).enumerate() {
                s[2 * b..2 * b + 2].copy_from_slice(&blk[..2]);
                q[32 * b..32 * b + 32].copy_from_slice(&blk[2..]);
            }
        }
        DType::Q4_0 => {
            for (b, blk) in src.chunks_exact(18).enumerate() {
                s[2 * b..2 * b + 2].copy_from_slice(&blk[..2]);
                q[16 * b..16 * b + 16].copy_from_slice(&blk[2..]);
            }
        }
        DType::Q4_K => {
            for (b, blk) in src.chunks_exact(144).enumerate() {
                s[16 * b..16 * b + 16].copy_from_slice(&blk[..16]);
                q[128 * b..128 * b + 128].copy_from_slice(&blk[16..]);
            }
        }
        DType::Q6_K => {
            let plane = q.len() / 3;
            for (b, blk) in src.chunks_exact(210).enumerate() {
                let (ql, rest) = blk.split_at(128);
                let (qh, rest) = rest.split_at(64);
                let (sc, d) = rest.split_at(16);
                s2[2 * b..2 * b + 2].copy_from_slice(d);
                for n in 0..2 {
                    for j in 0..2 {
                        let u = 4 * b + 2 * n + j;
                        let at = 16 * u;
                        q[at..at + 16].copy_from_slice(&ql[64 * n + 16 * j..][..16]);
                        q[plane + at..plane + at + 16].copy_from_slice(&ql[64 * n + 32 + 16 * j..][..16]);
                        q[2 * plane + at..2 * plane + at + 16].copy_from_slice(&qh[32 * n + 16 * j..][..16]);
                        for k in 0..4 {
                            s[4 * u + k] = sc[8 * n + j + 2 * k];
                        }
                    }
                }
            }
        }
        _ => unreachable!("not a block format"),
    }
}
