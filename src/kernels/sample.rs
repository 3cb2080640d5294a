//! `wgsl/sample.wgsl`: the next token chosen on the GPU from the logits
//! (greedy, or a seeded draw with temperature, top-k and top-p), written
//! where the next decode step reads its input.

use crate::error::Result;
use crate::gpu::{Dispatch, Gpu, ParamsBuffer};
use crate::sampling::Sampling;

crate::wgsl_struct! {
    pub struct SampleParams {
        vocab: u32,
        temperature: f32,
        /// 0: no top-k cut.
        top_k: u32,
        /// 1: no top-p cut.
        top_p: f32,
        seed_lo: u32,
        seed_hi: u32,
    }
}

crate::wgsl_struct! {
    /// How one row of a ragged batch's logits is chosen (the ROWS build).
    pub struct RowSampling {
        /// 0: greedy.
        pub temperature: f32,
        /// 0: no top-k cut.
        pub top_k: u32,
        /// 1: no top-p cut.
        pub top_p: f32,
        pub seed_lo: u32,
        pub seed_hi: u32,
        /// The position of the token drawn, which keys its noise.
        pub pos: u32,
        pub _pad0: u32,
        pub _pad1: u32,
    }
}

impl RowSampling {
    /// The row of a token drawn at `pos` by `sampling` with `seed`: what a
    /// lone session drawing at that position with them would choose.
    pub fn new(sampling: Sampling, seed: u64, pos: usize, vocab: usize) -> Self {
        let (temperature, top_k, top_p) = match sampling {
            Sampling::Greedy => (0.0, 0, 1.0),
            Sampling::Random { temperature, top_k, top_p } => (
                temperature,
                top_k.filter(|&k| k < vocab).unwrap_or(0) as u32,
                top_p.filter(|&p| p < 1.0).unwrap_or(1.0),
            ),
        };
        RowSampling {
            temperature,
            top_k,
            top_p,
            seed_lo: seed as u32,
            seed_hi: (seed >> 32) as u32,
            pos: pos as u32,
            _pad0: 0,
            _pad1: 0,
        }
    }
}

pub fn structs() -> Vec<&'static str> {
    use super::WgslStruct;
    vec![SampleParams::WGSL, RowSampling::WGSL]
}

/// Logits per `partial` workgroup (`PER_WG` in the shader).
const PER_WG: usize = 1024;

/// The id written in place of a token when a logit is NaN or infinite.
pub const NON_FINITE: u32 = 0xffff_fffe;

/// Scratch of a selection: the best of each block of logits, and the
/// candidates' smallest key.
#[derive(Debug)]
pub struct SampleScratch {
    pub partials: wgpu::Buffer,
    pub candidate_floor: wgpu::Buffer,
}

impl SampleScratch {
    pub fn new(gpu: &Gpu, vocab: usize) -> Result<Self> {
        Self::for_rows(gpu, vocab, 1)
    }

    /// Scratch of `rows` selections at once (the ROWS build).
    pub fn for_rows(gpu: &Gpu, vocab: usize, rows: usize) -> Result<Self> {
        Ok(SampleScratch {
            partials: gpu.storage_buffer("sample.partials", 2 * vocab.div_ceil(PER_WG) * rows)?,
            candidate_floor: gpu.storage_buffer("sample.candidate_floor", rows)?,
        })
    }
}

/// What a ragged batch's selection reads and writes: `logits` rows of the
/// vocabulary, one [`RowSampling`] per row in `rows`, the ids into
/// `tokens[row]`.
pub struct RowSampleBindings<'a> {
    pub logits: &'a wgpu::Buffer,
    pub rows: &'a wgpu::Buffer,
    pub tokens: &'a wgpu::Buffer,
    pub scratch: &'a SampleScratch,
}

pub struct SampleBindings<'a> {
    pub step: &'a wgpu::Buffer,
    pub logits: &'a wgpu::Buffer,
    /// The chosen id goes to element 0.
    pub tokens: &'a wgpu::Buffer,
    pub scratch: &'a SampleScratch,
}

#[derive(Debug, Default)]
pub struct Sample;

impl Sample {
    pub fn new(_gpu: &Gpu) -> Self {
        Sample
    }

    /// The dispatches that choose a token from `vocab` logits: the
    /// candidate threshold (top-k / top-p only), the best of each block,
    /// the best of all.
    pub fn plan(
        &self,
        gpu: &Gpu,
        vocab: usize,
        sampling: Sampling,
        seed: u64,
        b: &SampleBindings<'_>,
    ) -> Result<Vec<Dispatch>> {
        let mut params = SampleParams {
            vocab: vocab as u32,
            seed_lo: seed as u32,
            seed_hi: (seed >> 32) as u32,
            ..Default::default()
        };
        let mut flags = vec![];
        let mut filtered = false;
        if let Sampling::Random { temperature, top_k, top_p } = sampling {
            flags.push("RANDOM");
            params.temperature = temperature;
            params.top_k = top_k.filter(|&k| k < vocab).unwrap_or(0) as u32;
            params.top_p = top_p.filter(|&p| p < 1.0).unwrap_or(1.0);
            filtered = params.top_k > 0 || params.top_p < 1.0;
        }
        if filtered {
            flags.push("FILTER");
        }
        let params = ParamsBuffer::new(gpu, "sample.params", &params);
        let s = b.scratch;
        let dispatch = |entry, buffers: &[(u32, &wgpu::Buffer)], blocks| {
            dispatch(gpu, (entry, &flags), &params, buffers, [blocks, 0])
        };
        let mut dispatches = Vec::new();
        if filtered {
            dispatches.push(dispatch("threshold", &[(2, b.logits), (5, &s.candidate_floor)], 1)?);
        }
        let mut partial = vec![(1, b.step), (2, b.logits), (3, &s.partials)];
        if filtered {
            partial.push((5, &s.candidate_floor));
        }
        dispatches.push(dispatch("partial", &partial, vocab.div_ceil(PER_WG) as u32)?);
        dispatches.push(dispatch("finish", &[(3, &s.partials), (4, b.tokens)], 1)?);
        Ok(dispatches)
    }
}

impl Sample {
    /// The dispatches that choose one token per row of logits, each row as
    /// its [`RowSampling`] says, encoded with the number of rows: every
    /// row's threshold, the best of each block of every row, the best of
    /// each row.
    pub fn plan_rows(&self, gpu: &Gpu, vocab: usize, b: &RowSampleBindings<'_>) -> Result<Vec<Dispatch>> {
        let params = SampleParams { vocab: vocab as u32, ..Default::default() };
        let params = ParamsBuffer::new(gpu, "sample.params", &params);
        let s = b.scratch;
        let flags = ["ROWS", "RANDOM", "FILTER"];
        // One grid row per row of logits.
        let dispatch = |entry, buffers: &[(u32, &wgpu::Buffer)], blocks| {
            dispatch(gpu, (entry, &flags), &params, buffers, [blocks, 1])
        };
        Ok(vec![
            dispatch("threshold", &[(2, b.logits), (5, &s.candidate_floor), (6, b.rows)], 1)?,
            dispatch(
                "partial",
                &[(2, b.logits), (3, &s.partials), (5, &s.candidate_floor), (6, b.rows)],
                vocab.div_ceil(PER_WG) as u32,
            )?,
            dispatch("finish", &[(3, &s.partials), (4, b.tokens)], 1)?,
        ])
    }
}

/// `entry` of the build with `flags`, bound to the parameters and
/// `buffers`, over `blocks` workgroups (and `tokens_per_workgroup` as
/// [`Dispatch`] has it).
fn dispatch(
    gpu: &Gpu,
    (entry, flags): (&'static str, &[&str]),
    params: &ParamsBuffer,
    buffers: &[(u32, &wgpu::Buffer)],
    [blocks, tokens_per_workgroup]: [u32; 2],
) -> Result<Dispatch> {
    let pipeline = super::pipeline(gpu, "sample", entry, flags, &[])?;
    let mut bound = vec![(0, &params.0)];
    bound.extend_from_slice(buffers);
    Ok(Dispatch {
        label: entry,
        bind_group: gpu.bind_at(entry, &pipeline, &bound),
        pipeline,
        workgroups: [blocks, 1, 1],
        tokens_per_workgroup,
    })
}

/// The flag sets of every selection build.
#[cfg(feature = "internals")]
pub fn flag_sets() -> Vec<Vec<&'static str>> {
    vec![vec![], vec!["RANDOM"], vec!["RANDOM", "FILTER"], vec!["ROWS", "RANDOM", "FILTER"]]
}
