//! `wgsl/split_sum.wgsl`: a product over few tokens from its partial sums
//! over ranges of k ([`super::gemm::Gemm::plan_summed`]), plain or through
//! the SwiGLU gate, for the products no residual add sums (a layer's q/k/v
//! and gate/up).

use super::gemm::{Epilogue, SWIGLU};
use crate::error::Result;
use crate::gpu::{Dispatch, Gpu, ParamsBuffer};

crate::wgsl_struct! {
    pub struct SplitSumParams {
        /// Weight rows of the product (a row of each partial sum).
        n: u32,
        /// Partial sums per token.
        k: u32,
        /// With `APART`: the first row that goes to the tail buffer.
        apart_row: u32,
    }
}

/// Rows from a row on summed into a buffer of their own.
pub const APART: &str = "APART";

pub fn structs() -> Vec<&'static str> {
    use super::WgslStruct;
    vec![SplitSumParams::WGSL]
}

/// Invocations per workgroup (`wgsl/split_sum.wgsl`'s).
const WG: u32 = 256;

/// `out[t] = sum_j y[t, j]` (or with [`Epilogue::Swiglu`], the gate of
/// each interleaved gate/up pair of that sum: `n / 2` outputs), y packed
/// `[tokens, parts, n]`, out `[tokens, outputs]`, for the tokens encoded.
/// With `apart` = (row, tail) (plain only), the rows from `row` on go to
/// `tail`, `[tokens, n - row]`, as [`super::gemm::Gemm::plan_apart`]
/// writes them (out keeping its rows of `n`).
pub fn plan(
    gpu: &Gpu,
    n: usize,
    epilogue: Epilogue,
    (y, parts): (&wgpu::Buffer, usize),
    (out, apart): (&wgpu::Buffer, Option<(usize, &wgpu::Buffer)>),
) -> Result<Dispatch> {
    let (flags, outputs): (&[&str], usize) = match (epilogue, apart) {
        (Epilogue::Plain, None) => (&[], n),
        (Epilogue::Plain, Some(_)) => (&[APART], n),
        (Epilogue::Swiglu, None) => (&[SWIGLU], n / 2),
        (Epilogue::Swiglu, Some(_)) => {
            return Err(crate::Error::Unsupported {
                what: "gated sums written apart",
                value: format!("{n} rows"),
            });
        }
    };
    let pipeline = super::pipeline(gpu, "split_sum", "main", flags, &[])?;
    let apart_row = apart.map_or(n, |(row, _)| row) as u32;
    let params = SplitSumParams { n: n as u32, k: parts as u32, apart_row };
    let params = ParamsBuffer::new(gpu, "split_sum.params", &params);
    let mut buffers = vec![&params.0, y, out];
    buffers.extend(apart.map(|(_, tail)| tail));
    Ok(Dispatch {
        label: "split_sum",
        bind_group: gpu.bind("split_sum", &pipeline, &buffers),
        pipeline,
        workgroups: [(outputs as u32).div_ceil(WG), 1, 1],
        tokens_per_workgroup: 1,
    })
}

/// Every flag set of `wgsl/split_sum.wgsl`'s builds.
#[cfg(feature = "internals")]
pub fn flag_sets() -> Vec<Vec<&'static str>> {
    vec![vec![], vec![SWIGLU], vec![APART]]
}
