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
    }
}

pub fn structs() -> Vec<&'static str> {
    use super::WgslStruct;
    vec![SplitSumParams::WGSL]
}

/// Invocations per workgroup (`wgsl/split_sum.wgsl`'s).
const WG: u32 = 256;

/// `out[t] = sum_j y[t, j]` (or with [`Epilogue::Swiglu`], the gate of
/// each interleaved gate/up pair of that sum: `n / 2` outputs), y packed
/// `[tokens, parts, n]`, out `[tokens, outputs]`, for the tokens encoded.
pub fn plan(
    gpu: &Gpu,
    n: usize,
    epilogue: Epilogue,
    (y, parts): (&wgpu::Buffer, usize),
    out: &wgpu::Buffer,
) -> Result<Dispatch> {
    let (flags, outputs): (&[&str], usize) = match epilogue {
        Epilogue::Plain => (&[], n),
        Epilogue::Swiglu => (&[SWIGLU], n / 2),
    };
    let pipeline = super::pipeline(gpu, "split_sum", "main", flags, &[])?;
    let params = ParamsBuffer::new(gpu, "split_sum.params", &SplitSumParams { n: n as u32, k: parts as u32 });
    Ok(Dispatch {
        label: "split_sum",
        bind_group: gpu.bind("split_sum", &pipeline, &[&params.0, y, out]),
        pipeline,
        workgroups: [(outputs as u32).div_ceil(WG), 1, 1],
        tokens_per_workgroup: 1,
    })
}

/// Every flag set of `wgsl/split_sum.wgsl`'s builds.
#[cfg(feature = "internals")]
pub fn flag_sets() -> Vec<Vec<&'static str>> {
    vec![vec![], vec![SWIGLU]]
}
