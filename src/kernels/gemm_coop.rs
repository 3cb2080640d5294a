//! `wgsl/gemm_coop.wgsl`: the chunk product of [`super::Gemm`] on
//! cooperative matrices, where the adapter offers the one configuration the
//! kernel is written for. [`super::Gemm`] plans it with the same parameters
//! and bindings as the f32 kernel.

use crate::gpu::cooperative_matrix::{SUBGROUP_SIZE, WORKGROUP_BYTES};

/// Staged activations as two f16s (high and low part) rather than one.
pub const X_SPLIT: &str = "X_SPLIT";
/// Staged weights as two f16s, for formats whose values f16 does not hold.
pub const W_SPLIT: &str = "W_SPLIT";
/// Activations read from their f16 copy (see [`Tile::reads_f16`]).
pub const X_F16: &str = "X_F16";
/// A SwiGLU product's outputs also written as f16, for the next to read.
pub const Y_F16: &str = "Y_F16";
/// A plain product as partial sums over ranges of k (see [`Tile::k_splits`]).
pub const K_SPLIT: &str = "K_SPLIT";
/// Weights bound as u32 words rather than 16-byte quads (see
/// `bind_as_words`).
pub const WEIGHT_WORDS: &str = "WEIGHT_WORDS";

/// Adds [`WEIGHT_WORDS`] to the flags of a decoded format whose staging
/// runs load words (all but Q4_K and Q5_K, whose runs load whole quads):
/// through a binding of quads, the word a computed index picks ran Q6_K
/// and Q8_0 products slower (twice the time over 16 tokens on an NVIDIA
/// H100).
fn bind_as_words(flags: &mut Vec<&'static str>) {
    let quad_runs = ["W_Q4_K", "W_Q5_K"];
    if flags.contains(&super::WEIGHT_FORMAT) && !flags.iter().any(|f| quad_runs.contains(f)) {
        flags.push(WEIGHT_WORDS);
    }
}

/// Most ranges of k a product is split into.
const MAX_K_SPLITS: usize = 4;

/// Most tokens of a product in the tiles of [`Tile::few_tokens`].
pub const FEW_TOKENS: usize = 64;

/// Fewest workgroups a product over few tokens should have: about one
/// and a half for each of a large GPU's multiprocessors (an NVIDIA H100
/// has 132), so that one's loads wait while another multiplies.
const FEW_TOKEN_WORKGROUPS: usize = 192;

/// Most ranges of k of a product over few tokens (see
/// [`Tile::few_tokens`]).
pub const MAX_FEW_TOKEN_K_SPLITS: usize = 8;

/// Columns in each range of k a split product sums: a multiple of every
/// weight format's block and of every tile's steps.
const K_SPLIT_COLUMNS: usize = 256;

/// The kernel stages bf16 weights eight k at a time with 16-byte loads:
/// their rows must hold a multiple of 8 values (other formats' rows are
/// whole blocks, read four values at a time at least, as [`super::Gemm`]
/// requires of them anyway). A matrix it does not
/// take runs on the f32 GEMM.
pub fn takes(format: crate::format::WeightFormat, cols: usize) -> bool {
    use crate::format::WeightFormat;
    match format {
        WeightFormat::Bf16 => cols.is_multiple_of(8),
        _ => cols.is_multiple_of(4),
    }
}

/// The flags of a build reading `format` (see [`super::weight_flags`]),
/// precise (`split`) or not.
pub fn flags(gpu: &crate::gpu::Gpu, format: crate::format::WeightFormat, split: bool) -> Vec<&'static str> {
    use crate::format::WeightFormat;
    let mut flags = super::weight_flags(gpu, format);
    bind_as_words(&mut flags);
    if split {
        flags.push(X_SPLIT);
        if !matches!(format, WeightFormat::Bf16 | WeightFormat::F16) {
            flags.push(W_SPLIT);
        }
    }
    flags
}

/// A workgroup's tile: tokens x weight rows, k per step (pipeline
/// constants `TILE_M`, `TILE_N` and `TILE_K`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Tile {
    /// 32, 64 or 128.
    pub tokens: u32,
    /// 128 or 256.
    pub rows: u32,
    /// 32 or 64.
    pub k: u32,
    /// Subgroups of 32: 8, or 16 where decoding weights (see
    /// [`Self::PREFERRED`]) or reading f16 copies of the activations (see
    /// [`Self::reads_f16`]); each computes 32 or 64 tokens x 16 to 64 rows.
    pub warps: u32,
}

impl Tile {
    /// Every tile the kernel is built in, the most work per staged value
    /// first (a tile's staging is shared by tokens x rows products), each
    /// in steps of 32 before 64.
    pub const ALL: [Tile; 20] = [
        Tile { tokens: 128, rows: 256, k: 32, warps: 8 },
        Tile { tokens: 128, rows: 256, k: 64, warps: 8 },
        Tile { tokens: 128, rows: 128, k: 32, warps: 8 },
        Tile { tokens: 128, rows: 128, k: 64, warps: 8 },
        Tile { tokens: 64, rows: 256, k: 32, warps: 8 },
        Tile { tokens: 64, rows: 256, k: 64, warps: 8 },
        Tile { tokens: 64, rows: 128, k: 32, warps: 8 },
        Tile { tokens: 64, rows: 128, k: 64, warps: 8 },
        Tile { tokens: 32, rows: 256, k: 32, warps: 8 },
        Tile { tokens: 32, rows: 256, k: 64, warps: 8 },
        Tile { tokens: 32, rows: 128, k: 32, warps: 8 },
        Tile { tokens: 32, rows: 128, k: 64, warps: 8 },
        Self::COPIES,
        Self::COPIES_NARROW,
        Tile { tokens: 64, rows: 128, k: 32, warps: 4 },
        Tile { tokens: 64, rows: 64, k: 32, warps: 4 },
        Tile { tokens: 64, rows: 64, k: 64, warps: 4 },
        Tile { tokens: 32, rows: 64, k: 32, warps: 4 },
        Tile { tokens: 32, rows: 64, k: 64, warps: 4 },
        Tile { tokens: 32, rows: 32, k: 32, warps: 2 },
    ];

    /// Workgroup memory of a build with `flags` in this tile: the staged
    /// tiles (a second of each split operand) in rows of k f16s and 16
    /// bytes of padding, and a 16 x 16 f32 accumulator per subgroup on its
    /// way out (as `wgsl/gemm_coop.wgsl` declares them).
    pub fn workgroup_bytes(self, flags: &[&str]) -> u32 {
        let parts = |split: &str| if flags.contains(&split) { 2 } else { 1 };
        let staged_rows = self.tokens * parts(X_SPLIT) + self.rows * parts(W_SPLIT);
        staged_rows * (2 * self.k + 16) + self.warps * 256 * 4
    }

    /// Whether a build with `flags` can use this tile: its workgroup
    /// memory fits.
    pub fn fits(self, flags: &[&str]) -> bool {
        self.workgroup_bytes(flags) <= WORKGROUP_BYTES
    }

    /// The tile of a product of `n_rows` weight rows over `max_tokens`
    /// tokens: the first of [`Self::PREFERRED`] that fits the build and
    /// still gives the product at least [`MIN_WORKGROUPS`] workgroups, else
    /// the smallest. Expert groups pass the tokens an expert has on average.
    pub fn choose(n_rows: usize, max_tokens: usize, flags: &[&str]) -> Tile {
        let workgroups = |t: Tile| n_rows.div_ceil(t.rows as usize) * max_tokens.div_ceil(t.tokens as usize);
        // Decoded weights take twice the registers in steps of 64; only
        // they gain from 16 subgroups.
        let decodes = flags.contains(&"WEIGHT_FORMAT");
        let suits = |t: &Tile| (t.k == 32 || !decodes) && (t.warps == 8 || decodes);
        let fitting = Self::PREFERRED.into_iter().filter(|t| t.fits(flags) && suits(t));
        fitting
            .clone()
            .find(|&t| max_tokens >= t.tokens as usize && workgroups(t) >= MIN_WORKGROUPS)
            .unwrap_or_else(|| fitting.clone().next_back().expect("a tile of 128 rows fits every build"))
    }

    /// The tiles [`Self::choose`] picks from, in order (NVIDIA, Vulkan;
    /// `kernel_throughput -- gemm`): bf16 products at 4096 tokens run
    /// fastest in 128 x 256 tiles in steps of 32, then in 128 x 128 in
    /// steps of 64, then in steps of 32; at 512 tokens of the 4096 x 14336
    /// down projection, 128 x 128 in steps of 64 leads. Steps of 64 run the
    /// decoded formats slower, but the 1B shape's 2048 x 8192 down
    /// projection at 512 tokens faster in 64 x 128 tiles. Decoded formats
    /// run faster with 16 subgroups sharing the decoding, where bf16 runs
    /// slower. Tiles of 4 subgroups (two workgroups per multiprocessor) run
    /// 128 x 128 in steps of 32 faster than 8 do at 4096 tokens, but behind
    /// 128 x 256 in 8, and slower at 512 tokens.
    pub const PREFERRED: [Tile; 9] = [
        Tile { tokens: 128, rows: 256, k: 32, warps: 16 },
        Tile { tokens: 128, rows: 256, k: 32, warps: 8 },
        Tile { tokens: 128, rows: 128, k: 64, warps: 8 },
        Tile { tokens: 128, rows: 128, k: 32, warps: 8 },
        Tile { tokens: 64, rows: 256, k: 32, warps: 8 },
        Tile { tokens: 64, rows: 128, k: 64, warps: 8 },
        Tile { tokens: 64, rows: 128, k: 32, warps: 8 },
        Tile { tokens: 32, rows: 256, k: 32, warps: 8 },
        Tile { tokens: 32, rows: 128, k: 32, warps: 8 },
    ];

    /// The tile and the ranges of k (at most `max_splits`, each a multiple
    /// of 256 columns; 1: all of k) of a dense product of `n_rows` rows of
    /// `cols` over at most [`FEW_TOKENS`] tokens (a batch's decode steps),
    /// where the build fits a tile: 64 tokens x 128 rows where a product
    /// of more than 32 tokens gets [`FEW_TOKEN_WORKGROUPS`] of them in the
    /// fewest ranges, else 32 x 64 in steps of 64 in 4 subgroups, in the
    /// fewest ranges that give them (else the most). In the tiles
    /// [`Self::choose`] picks for prompts, few workgroups walk all of k a
    /// step at a time, each step waiting for its loads and barriers: on an
    /// NVIDIA H100 (Q4_K, `kernel_throughput -- gemm tokens=16,64`) these
    /// run the 8B shape's q/k/v in 60 % to 70 % of the time and its
    /// gate/up in 80 % to 95 %; in ranges of k, its down projection
    /// (summed by the residual add after it) in a fifth to a quarter.
    pub fn few_tokens(
        n_rows: usize,
        cols: usize,
        max_tokens: usize,
        flags: &[&str],
        max_splits: usize,
    ) -> Option<(Tile, usize)> {
        let wide = Tile { tokens: 64, rows: 128, k: 32, warps: 8 };
        let narrow = Tile { tokens: 32, rows: 64, k: 64, warps: 4 };
        let splits: Vec<usize> =
            (1..=max_splits).filter(|&n| cols.is_multiple_of(n * K_SPLIT_COLUMNS) || n == 1).collect();
        let workgroups = |t: Tile| n_rows.div_ceil(t.rows as usize) * max_tokens.div_ceil(t.tokens as usize);
        let filling = |t: Tile| splits.iter().copied().find(|&n| workgroups(t) * n >= FEW_TOKEN_WORKGROUPS);
        let wide = Some(wide).filter(|t| max_tokens > 32 && t.fits(flags));
        if let Some(n) = wide.and_then(filling) {
            return Some((wide?, n));
        }
        let narrow = Some(narrow).filter(|t| t.fits(flags))?;
        Some((narrow, filling(narrow).unwrap_or(*splits.last().unwrap_or(&1))))
    }

    /// Whether the build stages a step's activations in one round (each
    /// invocation one run of eight of one token).
    pub fn stages_x_in_one_round(self) -> bool {
        self.tokens <= self.warps * SUBGROUP_SIZE / (self.k / 8)
    }

    /// The tile that reads f16 copies: 128 tokens x 256 rows in steps of 32,
    /// 16 subgroups.
    pub const COPIES: Tile = Tile { tokens: 128, rows: 256, k: 32, warps: 16 };

    /// The same in 192 rows (three 16-row fragments a subgroup rather than
    /// four), for products whose tiles of 256 leave their last wave of
    /// workgroups short (see [`Self::reads_f16`]).
    pub const COPIES_NARROW: Tile = Tile { rows: 192, ..Self::COPIES };

    /// The tile of a product of `n_rows` rows of `cols` over `max_tokens`
    /// tokens that reads its activations from their f16 copy ([`X_F16`],
    /// eight values a load: rows of a multiple of 8; `flags` without it),
    /// or `None` where it should read the f32 rows: 128 x 256 in 16
    /// subgroups, where it fits and gives [`MIN_WORKGROUPS`]. There f16
    /// copies run faster than f32 rows in the tiles chosen for those, bf16
    /// and Q8_0 alike. Smaller tiles read less well from f16 copies than
    /// from f32 rows in their own tiles, and a staging of two rounds (128
    /// tokens in 8 subgroups) runs far slower.
    /// Where the GPU's `multiprocessors` are known, the tile is the one of
    /// 192 rows ([`Self::COPIES_NARROW`]) where it takes them less time in
    /// all, counted in waves of workgroups: 512 tokens of bf16 6144 x 4096
    /// on an NVIDIA H200's 132, one wave of 128 tiles of 192 rather than of
    /// 96 of 256, run faster.
    pub fn reads_f16(
        n_rows: usize,
        cols: usize,
        max_tokens: usize,
        flags: &[&str],
        multiprocessors: Option<u32>,
    ) -> Option<Tile> {
        let (_, workgroups) = Self::copy_tile(n_rows, cols, max_tokens, flags)?;
        if workgroups < MIN_WORKGROUPS {
            return None;
        }
        let Some(multiprocessors) = multiprocessors else { return Some(Self::COPIES) };
        // A multiprocessor's time: its waves of workgroups, each a tile's
        // time, which shrinks with its rows only in part.
        let time = |t: Tile| {
            let workgroups = n_rows.div_ceil(t.rows as usize) * max_tokens.div_ceil(t.tokens as usize);
            workgroups.div_ceil(multiprocessors as usize) * (t.rows + COPY_TILE_FIXED_ROWS) as usize
        };
        [Self::COPIES, Self::COPIES_NARROW].into_iter().min_by_key(|&t| time(t))
    }

    /// The tile of [`Self::reads_f16`] and its workgroups for the product,
    /// where the build and the product suit it, however few the workgroups.
    fn copy_tile(n_rows: usize, cols: usize, max_tokens: usize, flags: &[&str]) -> Option<(Tile, usize)> {
        let tile = Self::COPIES;
        let workgroups = n_rows.div_ceil(tile.rows as usize) * max_tokens.div_ceil(tile.tokens as usize);
        let with_x16 = [flags, &[X_F16, Y_F16]].concat();
        let usable = tile.fits(&with_x16)
            && tile.stages_x_in_one_round()
            && !flags.contains(&X_SPLIT)
            && cols.is_multiple_of(8);
        (usable && max_tokens >= tile.tokens as usize).then_some((tile, workgroups))
    }

    /// The ranges of k ([`K_SPLIT`]) a plain product whose partial sums a
    /// residual add sums should run in: where the tile of
    /// [`Self::reads_f16`] gives the product too few workgroups, the fewest
    /// ranges (at most four, each a multiple of 256 columns) that give it
    /// [`MIN_WORKGROUPS`]; otherwise (or where none do) 1, the whole
    /// product in one. The down projections of 512 tokens (64 and 32 such
    /// tiles) run faster in partial sums than whole in the tile
    /// [`Self::choose`] gives them, in every weight format: Llama-3.1-8B's
    /// 4096 x 14336 in two ranges, Llama-3.2-1B's 2048 x 8192 in four.
    pub fn k_splits(n_rows: usize, cols: usize, max_tokens: usize, flags: &[&str]) -> usize {
        let Some((_, workgroups)) = Self::copy_tile(n_rows, cols, max_tokens, flags) else { return 1 };
        if workgroups >= MIN_WORKGROUPS {
            return 1;
        }
        (2..=MAX_K_SPLITS)
            .find(|&n| cols.is_multiple_of(n * K_SPLIT_COLUMNS) && workgroups * n >= MIN_WORKGROUPS)
            .unwrap_or(1)
    }

    /// K steps a build with `flags` loads ahead of the one it multiplies:
    /// two for Q8_0 weights in tiles of 16 subgroups (a loop of their own),
    /// one otherwise. Two ahead runs Q8_0 faster in those tiles; Q4_K runs
    /// no faster in any tile and bf16 slower, and a loop unrolled by two
    /// for every build slows the builds loading one step ahead.
    pub fn ahead(self, flags: &[&str]) -> u32 {
        let q8_0 = crate::format::WeightFormat::Q8_0.flag().is_some_and(|f| flags.contains(&f));
        if q8_0 && !flags.contains(&X_SPLIT) && self.warps == 16 { 2 } else { 1 }
    }

    /// The pipeline constants of the tile in a build with `flags`.
    pub fn constants(self, flags: &[&str]) -> [(&'static str, f64); 5] {
        [
            ("TILE_M", self.tokens as f64),
            ("TILE_N", self.rows as f64),
            ("TILE_K", self.k as f64),
            ("WARPS", self.warps as f64),
            ("AHEAD", self.ahead(flags) as f64),
        ]
    }
}

/// The part of a copy tile's time that does not shrink with its rows
/// (staging the tokens' activations, the barriers of each step), in rows'
/// worth: fitted to a wave's time in tiles of 256 rows and in tiles of
/// 192 (4096 tokens of bf16 28672 x 4096).
const COPY_TILE_FIXED_ROWS: u32 = 300;

/// Fewest workgroups a product should have: about three quarters of the
/// multiprocessors of a large GPU (an NVIDIA H200 has 132); larger tiles
/// make up for the idle ones. 96 rather than 128 (with 64 x 128 tiles in
/// steps of 64 preferred to steps of 32) prefills 512 tokens of the 1B
/// shape faster and leaves the 8B shape's unchanged.
pub const MIN_WORKGROUPS: usize = 96;

/// Every flag set the flow may build: each weight format, with and
/// without splits, plain, with SwiGLU and with a bias; unsplit, also
/// reading f16 copies (plain, also split over k; with a bias; with SwiGLU
/// writing them).
#[cfg(feature = "internals")]
pub fn flag_sets() -> Vec<Vec<&'static str>> {
    let mut out = super::gemm::with_epilogues(precision_flag_sets());
    for mut flags in super::weight_flag_sets() {
        bind_as_words(&mut flags);
        out.push([flags.clone(), vec![X_F16]].concat());
        out.push([flags.clone(), vec![X_F16, K_SPLIT]].concat());
        out.push([flags.clone(), vec![X_F16, super::gemm::BIAS, "GELU_ERF"]].concat());
        out.push([flags.clone(), vec![X_F16, super::gemm::BIAS, super::gemm::BIAS_ADD]].concat());
        out.push([flags.clone(), vec![X_F16, super::gemm::SWIGLU, Y_F16]].concat());
        out.push([flags, vec![super::gemm::SWIGLU, Y_F16]].concat());
    }
    out
}

#[cfg(feature = "internals")]
fn precision_flag_sets() -> Vec<Vec<&'static str>> {
    let mut out = Vec::new();
    for mut flags in super::weight_flag_sets() {
        bind_as_words(&mut flags);
        let exact = flags.is_empty() || flags.contains(&"W_F16");
        let mut split = flags.clone();
        split.push(X_SPLIT);
        if !exact {
            split.push(W_SPLIT);
        }
        out.push(flags);
        out.push(split);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gpu::cooperative_matrix::MAX_WARPS;

    #[test]
    fn builds_fit_the_workgroup_memory_the_kernel_asks_for() {
        let q4k_split: &[&str] = &["WEIGHT_FORMAT", "W_Q4_K", X_SPLIT, W_SPLIT];
        let t = |tokens, rows, k| Tile { tokens, rows, k, warps: 8 };
        // 128 tokens in two parts and 256 bf16 rows in steps of 32: 48 KiB.
        assert_eq!(t(128, 256, 32).workgroup_bytes(&[X_SPLIT]), WORKGROUP_BYTES);
        assert!(!t(128, 256, 32).fits(q4k_split) && t(128, 128, 32).fits(q4k_split));
        assert!(t(128, 128, 64).fits(&[]) && !t(128, 128, 64).fits(&[X_SPLIT]));
        assert!(!t(128, 256, 64).fits(&[]));
        // Every build has a tile to fall back on.
        for flags in flag_sets() {
            assert!(Tile::PREFERRED.iter().any(|t| t.k == 32 && t.fits(&flags)), "{flags:?}");
        }
    }

    /// The layout `wgsl/gemm_coop.wgsl` derives from a tile: subgroups of
    /// 32 or 64 tokens x 16 to 64 rows (whole 16-row fragments) covering
    /// it, and staging rounds (rows of the tile staged by all invocations
    /// at once, the last maybe in part) within the kernel's arrays of 4 for
    /// X and 8 for W.
    /// The 8B shape's projections over a batch's decode steps (Q4_K):
    /// q/k/v and gate/up whole, o and down in ranges of k.
    #[test]
    fn few_tokens_fill_the_gpu_in_their_own_tiles() {
        let q4k: &[&str] = &["WEIGHT_FORMAT", "W_Q4_K"];
        let wide = Tile { tokens: 64, rows: 128, k: 32, warps: 8 };
        let narrow = Tile { tokens: 32, rows: 64, k: 64, warps: 4 };
        let few = |rows, cols, tokens, splits| Tile::few_tokens(rows, cols, tokens, q4k, splits).unwrap();
        assert_eq!(few(6144, 4096, 16, 1), (narrow, 1));
        assert_eq!(few(6144, 4096, 64, 1), (narrow, 1));
        assert_eq!(few(28672, 4096, 16, 1), (narrow, 1));
        assert_eq!(few(28672, 4096, 64, 1), (wide, 1));
        assert_eq!(few(4096, 4096, 16, MAX_FEW_TOKEN_K_SPLITS), (narrow, 4));
        assert_eq!(few(4096, 4096, 64, MAX_FEW_TOKEN_K_SPLITS), (wide, 8));
        assert_eq!(few(4096, 14336, 16, MAX_FEW_TOKEN_K_SPLITS), (narrow, 4));
        assert_eq!(few(4096, 14336, 64, MAX_FEW_TOKEN_K_SPLITS), (wide, 7));
        // Ranges of k hold whole multiples of 256 columns.
        assert_eq!(few(4096, 4000, 16, MAX_FEW_TOKEN_K_SPLITS), (narrow, 1));
    }

    #[test]
    fn every_tile_has_a_layout_the_kernel_holds() {
        for t in Tile::ALL {
            let warp_m = 32.max(t.tokens * t.rows / (t.warps * 64));
            let warps_n = t.warps / (t.tokens / warp_m);
            let warp_n = t.rows / warps_n;
            assert!(matches!(warp_m, 32 | 64) && (16..=64).contains(&warp_n) && warp_n % 16 == 0, "{t:?}");
            assert_eq!((t.tokens / warp_m) * warps_n, t.warps, "{t:?}");
            assert_eq!(warps_n * warp_n, t.rows, "{t:?}");
            let round_rows = t.warps * SUBGROUP_SIZE / (t.k / 8);
            let x_rounds = t.tokens.div_ceil(round_rows);
            let w_rounds = t.rows.div_ceil(round_rows);
            assert!(x_rounds <= 4 && (1..=8).contains(&w_rounds), "{t:?}");
            assert!(t.warps <= MAX_WARPS);
        }
    }

    #[test]
    fn tiles_are_the_largest_that_keep_the_gpu_busy_and_fit_the_build() {
        let bf16: &[&str] = &[X_SPLIT];
        let bf16_f16: &[&str] = &[];
        let q4k: &[&str] = &["WEIGHT_FORMAT", "W_Q4_K", X_SPLIT, W_SPLIT];
        let q4k_f16: &[&str] = &["WEIGHT_FORMAT", "W_Q4_K"];
        let tile = |tokens, rows, k, warps| Tile { tokens, rows, k, warps };
        // A 512-token chunk of Llama-3.1-8B's projections.
        assert_eq!(Tile::choose(6144, 512, bf16), tile(128, 256, 32, 8));
        assert_eq!(Tile::choose(4096, 512, bf16), tile(128, 128, 32, 8));
        // Unsplit bf16 has room for steps of 64; decoded formats keep 32.
        assert_eq!(Tile::choose(4096, 512, bf16_f16), tile(128, 128, 64, 8));
        assert_eq!(Tile::choose(4096, 512, q4k_f16), tile(128, 128, 32, 8));
        assert_eq!(Tile::choose(28672, 4096, bf16_f16), tile(128, 256, 32, 8));
        assert_eq!(Tile::choose(6144, 4096, bf16), tile(128, 256, 32, 8));
        assert_eq!(Tile::choose(28672, 512, bf16), tile(128, 256, 32, 8));
        // Its second weight tile leaves a split format 128 rows.
        assert_eq!(Tile::choose(28672, 512, q4k), tile(128, 128, 32, 8));
        // Decoded formats share the decoding among 16 subgroups where
        // their accumulators' memory fits.
        assert_eq!(Tile::choose(28672, 4096, q4k_f16), tile(128, 256, 32, 16));
        assert_eq!(Tile::choose(28672, 4096, q4k), tile(128, 128, 32, 8));
        // Llama-3.2-1B's q/k/v and down projection at 513 tokens.
        assert_eq!(Tile::choose(3072, 513, bf16_f16), tile(128, 128, 64, 8));
        assert_eq!(Tile::choose(2048, 513, bf16_f16), tile(64, 128, 64, 8));
        // Experts of a few tokens each; products too small for any tile.
        assert_eq!(Tile::choose(1536 * 128, 32, bf16), tile(32, 256, 32, 8));
        assert_eq!(Tile::choose(200, 3, bf16), tile(32, 128, 32, 8));
        for rows in [1, 100, 4096, 1 << 20] {
            for tokens in [0, 1, 31, 64, 200, 4096] {
                for flags in [bf16, bf16_f16, q4k, q4k_f16] {
                    let t = Tile::choose(rows, tokens, flags);
                    assert!(t.fits(flags) && Tile::ALL.contains(&t), "{rows} x {tokens}: {t:?}");
                }
            }
        }
    }

    #[test]
    fn only_large_unsplit_products_read_f16_copies_in_tiles_staged_in_one_round() {
        let sixteen = Tile { tokens: 128, rows: 256, k: 32, warps: 16 };
        assert!(sixteen.stages_x_in_one_round());
        assert!(!Tile { warps: 8, ..sixteen }.stages_x_in_one_round());
        assert!(Tile { tokens: 64, rows: 128, k: 32, warps: 8 }.stages_x_in_one_round());
        assert!(!Tile { tokens: 64, rows: 128, k: 64, warps: 8 }.stages_x_in_one_round());
        for flags in [&[][..], &["WEIGHT_FORMAT", "W_Q8_0"], &["WEIGHT_FORMAT", "W_Q4_K", "SWIGLU"]] {
            // The 8B shape's projections at 4096 and 512 tokens.
            assert_eq!(Tile::reads_f16(28672, 4096, 4096, flags, None), Some(sixteen));
            assert_eq!(Tile::reads_f16(4096, 14336, 4096, flags, None), Some(sixteen));
            assert_eq!(Tile::reads_f16(6144, 4096, 512, flags, None), Some(sixteen));
            // Too few tiles of 128 x 256: the f32 rows in smaller tiles.
            assert_eq!(Tile::reads_f16(4096, 4096, 512, flags, None), None);
            assert_eq!(Tile::reads_f16(2048, 8192, 512, flags, None), None);
            assert_eq!(Tile::reads_f16(1 << 20, 4096, 100, flags, None), None);
        }
        assert_eq!(Tile::reads_f16(28672, 4096, 4096, &[X_SPLIT], None), None);
        // Rows that are not whole loads of eight f16s.
        assert_eq!(Tile::reads_f16(28672, 4100, 4096, &["WEIGHT_FORMAT", "W_F16"], None), None);
    }

    /// Where the GPU's multiprocessors are known, a product takes copy
    /// tiles of 192 rows where their waves of workgroups take less time:
    /// on an NVIDIA H200's 132, 512 tokens of the 8B shape's q/k/v in one
    /// wave of 128 tiles of 192 rather than of 96 of 256; its gate/up keeps
    /// four waves of 448 tiles of 256 (the last of 52) over five of 600 of
    /// 192, and 4096 tokens of either keep 256 (six waves of 768 tiles of
    /// the q/k/v against eight of 1024).
    #[test]
    fn copy_tiles_narrow_where_that_evens_the_last_wave() {
        let (wide, narrow) = (Tile::COPIES, Tile::COPIES_NARROW);
        let h200 = Some(132);
        assert_eq!(Tile::reads_f16(6144, 4096, 512, &[], h200), Some(narrow));
        assert_eq!(Tile::reads_f16(28672, 4096, 512, &[], h200), Some(wide));
        assert_eq!(Tile::reads_f16(28672, 4096, 4096, &[], h200), Some(wide));
        assert_eq!(Tile::reads_f16(6144, 4096, 4096, &[], h200), Some(wide));
        assert_eq!(Tile::reads_f16(6144, 4096, 512, &[], Some(96)), Some(wide));
        assert_eq!(Tile::reads_f16(6144, 4096, 512, &[], None), Some(wide));
        assert_eq!(Tile::reads_f16(4096, 4096, 512, &[], h200), None);
        assert!(narrow.fits(&[X_F16, "SWIGLU", Y_F16]) && narrow.stages_x_in_one_round());
    }

    #[test]
    fn products_of_too_few_copy_tiles_split_over_k_until_they_have_enough() {
        for flags in [&[][..], &["WEIGHT_FORMAT", "W_Q8_0"]] {
            // Down projections at 512 tokens: the 8B shape's 64 tiles in
            // two ranges of 7168 columns, the 1B shape's 32 in four of 2048
            // (three do not divide 8192 into whole 256s).
            assert_eq!(Tile::k_splits(4096, 14336, 512, flags), 2);
            assert_eq!(Tile::k_splits(2048, 8192, 512, flags), 4);
            assert_eq!(Tile::k_splits(2000, 1536, 500, flags), 3);
            // Enough tiles already, or whole.
            assert_eq!(Tile::k_splits(4096, 14336, 4096, flags), 1);
            assert_eq!(Tile::k_splits(6144, 4096, 512, flags), 1);
            // Too few even in four, no range of whole 256s, no copy tile.
            assert_eq!(Tile::k_splits(2048, 8192, 128, flags), 1);
            assert_eq!(Tile::k_splits(4096, 4000, 512, flags), 1);
            assert_eq!(Tile::k_splits(4096, 14336, 100, flags), 1);
        }
        assert_eq!(Tile::k_splits(4096, 14336, 512, &[X_SPLIT]), 1);
    }

    #[test]
    fn only_q8_0_in_sixteen_subgroups_loads_two_steps_ahead() {
        let q8_0: &[&str] = &["WEIGHT_FORMAT", "W_Q8_0", "F16_NATIVE"];
        let q8_0_split: &[&str] = &["WEIGHT_FORMAT", "W_Q8_0", X_SPLIT, W_SPLIT];
        let q4k: &[&str] = &["WEIGHT_FORMAT", "W_Q4_K"];
        let sixteen = Tile { tokens: 128, rows: 256, k: 32, warps: 16 };
        let eight = Tile { warps: 8, ..sixteen };
        assert_eq!(sixteen.ahead(q8_0), 2);
        assert_eq!(eight.ahead(q8_0), 1);
        for flags in [q8_0_split, q4k, &[], &[X_SPLIT]] {
            assert_eq!(sixteen.ahead(flags), 1, "{flags:?}");
            assert_eq!(eight.ahead(flags), 1, "{flags:?}");
        }
        assert!(sixteen.constants(q8_0).contains(&("AHEAD", 2.0)));
    }
}
