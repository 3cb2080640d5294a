//! `wgsl/attention.wgsl`: the q/k norm, RoPE and KV-cache store, and
//! causal grouped-query attention over the cache: for a chunk of tokens
//! (`rope_store` then `attend`) or, all fused, for one token split over the
//! keys (`attend` built with DECODE, merged by `combine` when split).

use super::gemm::PrefillPrecision;
use crate::error::Result;
use crate::gpu::{Dispatch, Gpu, GpuTensor, ParamsBuffer};
use crate::kv_cache::Heads;
use crate::kv_cache::KvFormat;

/// Normalisation of q and k before RoPE.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QkNorm {
    /// q and k go to RoPE as projected.
    None,
    /// RMSNorm of each head with one `[head_dim]` weight shared by heads.
    PerHead,
    /// RMSNorm over the whole q (`[nh * hd]`) and k (`[nkv * hd]`) projections.
    WholeProjection,
}

crate::wgsl_struct! {
    pub struct AttentionParams {
        n_q_heads: u32,
        n_kv_heads: u32,
        /// Rotary dimensions / 2.
        half_rot: u32,
        qkv_stride: u32,
        out_stride: u32,
        window: u32,
        scale: f32,
        tokens_per_wg: u32,
        /// Of the q/k norm.
        eps: f32,
        /// Where token 0's value row starts in `value_rows`, and the
        /// elements per token there.
        v_offset: u32,
        v_stride: u32,
        /// Positions per cache block (PAGED).
        block_size: u32,
        /// A split row's keys per split, and its most splits (PAGED).
        split_keys: u32,
        max_splits: u32,
        /// 1: the decode rows run on `attend_lanes`, `attend` skips them
        /// (PAGED).
        decode_apart: u32,
    }
}

pub fn structs() -> Vec<&'static str> {
    use super::WgslStruct;
    vec![AttentionParams::WGSL]
}

/// Largest head width the kernels support.
pub const MAX_HEAD_DIM: usize = 256;
/// Invocations per workgroup of every entry point.
const WG: usize = 128;
/// The flag of the chunk attention in which every row sees every key (no
/// causal mask, no window).
pub const BIDIRECTIONAL: &str = "BIDIRECTIONAL";
/// The flag of the builds for a ragged batch's rows over a paged cache
/// ([`Attention::plan_paged`]).
pub const PAGED: &str = "PAGED";
/// The flag of the cooperative-matrix build (`attend_coop`).
pub const COOP: &str = "COOP";
/// `attend_coop` with its query rows in two f16 parts.
pub const Q_SPLIT: &str = "Q_SPLIT";
/// `attend_coop` writing its rows also as f16 (see [`AttentionBindings::out16`]).
pub const OUT_F16: &str = "OUT_F16";
/// How `attend_coop` is laid out: `subgroups` of 16 query rows each share
/// one K/V tile (the kernel's `C_SUBGROUPS`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CoopLayout {
    pub subgroups: usize,
}

impl CoopLayout {
    /// The layouts in order of preference: eight subgroups run chunk
    /// attention faster than four (they stage each K/V tile for twice the
    /// rows); four where workgroup memory is short (32 KiB).
    const PREFERRED: [CoopLayout; 2] = [CoopLayout { subgroups: 8 }, CoopLayout { subgroups: 4 }];

    /// Query rows of one workgroup.
    pub fn rows(&self) -> usize {
        16 * self.subgroups
    }

    /// Workgroup memory: the kernel's `kv_sh` (a tile of 32 keys, K and V,
    /// in rows of 136 f16s), and per subgroup `sc_sh` (16 rows of 36 f32s),
    /// `pc_sh` (16 rows of 40 f16s) and `alpha_sh` (16 f32s).
    pub fn workgroup_bytes(&self) -> usize {
        2176 * 8 + self.subgroups * (16 * 36 * 4 + 160 * 8 + 16 * 4)
    }

    /// The layouts whose memory and invocations `gpu` offers, preferred
    /// first.
    pub fn fitting(gpu: &Gpu) -> impl Iterator<Item = CoopLayout> + use<> {
        let limit = gpu.limits.max_compute_workgroup_storage_size as usize;
        let invocations = gpu.limits.max_compute_invocations_per_workgroup as usize;
        Self::PREFERRED
            .into_iter()
            .filter(move |l| l.workgroup_bytes() <= limit && 32 * l.subgroups <= invocations)
    }

    fn constants(&self) -> Vec<(&'static str, f64)> {
        vec![("C_SUBGROUPS", self.subgroups as f64)]
    }
}

/// Widest head `attend_coop` holds (its tiles' row stride).
const COOP_MAX_HEAD_DIM: usize = 128;
/// Most query rows (token, head) one workgroup holds.
const MAX_ROWS: usize = 32;
/// Largest number of query heads per KV head (one token's rows).
pub const MAX_GROUP: usize = MAX_ROWS;
/// Largest `rows * head_dim` (the workgroup's copy of its queries).
pub const MAX_GROUP_WIDTH: usize = 2048;
/// Most key splits of one token's attention.
pub const MAX_SPLITS: usize = 128;
/// Fewest keys worth a split of their own (a few passes of a workgroup).
const MIN_KEYS_PER_SPLIT: usize = 64;
/// Workgroups (KV heads x splits) that keep a large GPU busy with several
/// workgroups per multiprocessor.
const TARGET_WORKGROUPS: usize = 1024;
/// Workgroups of a step's decode rows (KV heads x row blocks per row)
/// from which `attend_lanes` walks each row's splits in one workgroup
/// rather than running a workgroup per split and then `combine`. A walk
/// takes about as long for one row as for 16 (its keys one after another),
/// and the split grid's time grows with the rows: on an NVIDIA H100
/// (`kernel_throughput paged`, 8 workgroups a row), at 512 keys 16 rows
/// take 0.066 ms split and 0.085 ms walked, 64 rows 0.244 and 0.197; at
/// 4096 keys 16 rows 0.30 and 0.48, 64 rows 1.18 and 1.07.
const WALK_WORKGROUPS: u32 = 256;

/// The family's q/k norm: mode, weights and epsilon.
#[derive(Debug, Clone, Copy)]
pub struct QkNormWeights<'a> {
    pub mode: QkNorm,
    pub q: &'a GpuTensor,
    pub k: &'a GpuTensor,
    pub eps: f32,
}

/// Everything one layer's attention reads and writes.
pub struct AttentionBindings<'a> {
    pub step: &'a wgpu::Buffer,
    pub qkv: &'a wgpu::Buffer,
    pub cos_sin: &'a wgpu::Buffer,
    /// The layer's caches.
    pub k_cache: &'a wgpu::Buffer,
    pub v_cache: &'a wgpu::Buffer,
    pub out: &'a wgpu::Buffer,
    /// The value rows, where the projection wrote them apart from `qkv`
    /// (`[tokens, kv heads x head_dim]`); `None`: in `qkv`, after the keys.
    pub values: Option<&'a wgpu::Buffer>,
    /// Where a chunk's attention on cooperative matrices in f16 also
    /// writes its rows as f16 (`kernels::gemm::HalfCopies`: the
    /// o-projection reads them), where given.
    pub out16: Option<&'a wgpu::Buffer>,
}

impl AttentionBindings<'_> {
    /// Bindings 1 to 6: the step, the q/k/v rows, the rotations, the
    /// caches and the output.
    fn rows_and_caches(&self) -> [(u32, &wgpu::Buffer); 6] {
        [
            (1, self.step),
            (2, self.qkv),
            (3, self.cos_sin),
            (4, self.k_cache),
            (5, self.v_cache),
            (6, self.out),
        ]
    }

    /// Those and the value rows (binding 11: `values`, else `qkv`), for the
    /// entry points that store the new keys and values.
    fn storing_values(&self) -> Vec<(u32, &wgpu::Buffer)> {
        let mut bound = self.rows_and_caches().to_vec();
        bound.push((11, self.values.unwrap_or(self.qkv)));
        bound
    }
}

/// Where the rows of a ragged batch find their sequences' keys
/// ([`Attention::plan_paged`]).
pub struct PagedRows<'a> {
    /// Per step row i, u32 (position, index in `block_table` of the first
    /// block of the row's sequence, partial slot or `u32::MAX`, `attend`'s
    /// tile i or 0: [`PagedTiling::tiles`]).
    pub rows: &'a wgpu::Buffer,
    /// Per sequence, the cache block of each block of its positions.
    pub block_table: &'a wgpu::Buffer,
    /// Positions per block.
    pub block_size: usize,
    /// Where decode rows (those given a partial slot) split their keys
    /// (`max_splits` 1: none does).
    pub splits: PagedSplits<'a>,
}

/// A row of a ragged batch as its attention sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PagedRow {
    /// Which sequence the row belongs to (any id the step's rows share).
    pub sequence: usize,
    pub position: usize,
    /// A decode row: given a partial slot, its keys split.
    pub decode: bool,
}

/// Bits of a tile's row count in its `rows` entry ([`PagedTiling::tiles`]).
const TILE_ROW_BITS: u32 = 8;

/// How a ragged batch's rows are cut into the tiles of the paged attention
/// ([`PagedAttention::tiling`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PagedTiling {
    /// Most rows of a tile.
    pub tile_rows: usize,
    /// Decode rows run on `attend_lanes`, in no tile.
    pub decode_apart: bool,
}

impl PagedTiling {
    /// A tiling every one of `tilings` can run (the layers of a model split
    /// across devices share the rows' entries): the smallest tiles, and
    /// decode rows in tiles of their own unless every device runs them
    /// apart (a device that does skips such tiles).
    pub fn common(tilings: impl IntoIterator<Item = PagedTiling>) -> Option<PagedTiling> {
        tilings.into_iter().reduce(|a, b| PagedTiling {
            tile_rows: a.tile_rows.min(b.tile_rows),
            decode_apart: a.decode_apart && b.decode_apart,
        })
    }

    /// The tiles over `rows` (a step's rows in order), each `first row << 8
    /// | row count`, for the fourth word of the rows' entries: runs of up to
    /// [`Self::tile_rows`] consecutive positions of one sequence share each
    /// K/V tile they load; a decode row is a tile alone, and none where
    /// `attend_lanes` runs it.
    pub fn tiles(self, rows: &[PagedRow]) -> Vec<u32> {
        let mut tiles: Vec<(usize, usize)> = Vec::new();
        for (t, row) in rows.iter().enumerate() {
            if row.decode && self.decode_apart {
                continue;
            }
            let extends = |&&mut (first, n): &&mut (usize, usize)| {
                let last = &rows[first + n - 1];
                !row.decode
                    && !rows[first].decode
                    && first + n == t
                    && n < self.tile_rows
                    && last.sequence == row.sequence
                    && last.position + 1 == row.position
            };
            match tiles.last_mut().filter(extends) {
                Some(tile) => tile.1 += 1,
                None => tiles.push((t, 1)),
            }
        }
        tiles.into_iter().map(|(first, n)| ((first as u32) << TILE_ROW_BITS) | n as u32).collect()
    }
}

/// A ragged batch's attention (see [`Attention::plan_paged`]), encoded as
/// [`Self::dispatches`] lists it.
#[derive(Debug)]
pub struct PagedAttention {
    /// `rope_store` over every row (but the decode rows, where `decode`
    /// runs and stores them).
    pub rope: Dispatch,
    /// `attend` (or `attend_coop`) over every row but the decode rows,
    /// where `decode` runs them.
    pub attend: Dispatch,
    /// `attend_lanes` over the step's first rows, its decode rows: a
    /// workgroup per key split.
    pub decode: Option<Dispatch>,
    /// `decode` over a grid of one split: a workgroup per row block walks
    /// its row's splits and merges them (the same partials, merged in the
    /// same order as by `combine`), where the rows fill the GPU without
    /// splitting them.
    pub decode_walk: Option<Dispatch>,
    /// The merge of the split rows' partials.
    pub combine: Option<Dispatch>,
    /// Most rows of one of `attend`'s (or `attend_coop`'s) tiles.
    pub tile_rows: usize,
}

impl PagedAttention {
    /// The tiling its kernels take: tiles of up to [`Self::tile_rows`]
    /// rows (`attend_coop`'s or `attend`'s), decode rows apart where
    /// `attend_lanes` runs them.
    pub fn tiling(&self) -> PagedTiling {
        PagedTiling { tile_rows: self.tile_rows, decode_apart: self.decode.is_some() }
    }

    /// The dispatches of `n_rows` rows, the first `decode_rows` of them
    /// decode rows, `attend` over `attend_tiles` [tiles](PagedTiling::tiles), each
    /// with the rows its grid covers: `rope_store` and
    /// `attend` are left out of a step of decode rows alone where
    /// `attend_lanes` runs them (and stores their keys and values), and
    /// `combine` covers the decode rows alone (only they split) and is
    /// left out of a step without any, or where `attend_lanes` walks the
    /// splits itself ([`Self::walks`]): every one of the workgroups left
    /// out would find nothing to do.
    pub fn dispatches(&self, n_rows: u32, decode_rows: u32, attend_tiles: u32) -> Vec<(&Dispatch, u32)> {
        self.dispatches_walking(n_rows, decode_rows, attend_tiles, self.walks(decode_rows))
    }

    /// [`Self::dispatches`] with the decode rows on [`Self::decode_walk`]
    /// or not (where there is one), whatever their number.
    pub fn dispatches_walking(
        &self,
        n_rows: u32,
        decode_rows: u32,
        attend_tiles: u32,
        walks: bool,
    ) -> Vec<(&Dispatch, u32)> {
        let walks = walks && self.decode_walk.is_some();
        let lanes = match walks {
            true => self.decode_walk.as_ref(),
            false => self.decode.as_ref(),
        };
        let lanes = lanes.filter(|_| decode_rows > 0);
        let others = lanes.is_none() || decode_rows < n_rows;
        let mut out = Vec::new();
        if others {
            out.extend([(&self.rope, n_rows), (&self.attend, attend_tiles)]);
        }
        out.extend(lanes.map(|d| (d, decode_rows)));
        let merging = decode_rows > 0 && !walks;
        out.extend(self.combine.as_ref().filter(|_| merging).map(|d| (d, decode_rows)));
        out
    }

    /// Whether `decode_rows` decode rows run on [`Self::decode_walk`]:
    /// where their row blocks alone make [`WALK_WORKGROUPS`] workgroups.
    pub fn walks(&self, decode_rows: u32) -> bool {
        self.decode_walk
            .as_ref()
            .is_some_and(|d| d.workgroups[0] * d.workgroups[1] * decode_rows >= WALK_WORKGROUPS)
    }
}

/// The split attention of a ragged batch's decode rows: per (slot, query
/// head, split) `head_dim` partial sums in `acc` and a (max, sum) pair in
/// `max_sum`; a row splits its keys into runs of `split_keys`, at most
/// `max_splits` of them.
pub struct PagedSplits<'a> {
    pub acc: &'a wgpu::Buffer,
    pub max_sum: &'a wgpu::Buffer,
    pub split_keys: usize,
    pub max_splits: usize,
}

/// Scratch of split attention: `[nq, splits, head_dim]` partial sums and
/// `[nq, splits, 2]` (max, sum) pairs.
pub struct SplitScratch<'a> {
    pub acc: &'a wgpu::Buffer,
    pub max_sum: &'a wgpu::Buffer,
}

/// Tokens whose query rows `attend` holds at once (each K/V tile it loads
/// serves them all): as many as its row and width limits allow.
fn tile_tokens(h: Heads) -> usize {
    (MAX_ROWS / h.group()).min(MAX_GROUP_WIDTH / (h.group() * h.dim)).max(1)
}

/// Tokens per workgroup of a chunk's attention: `attend_coop`'s in the
/// cooperative `layout` where there is one, else `attend`'s.
fn chunk_tile_tokens(layout: Option<CoopLayout>, h: Heads) -> usize {
    layout.map_or_else(|| tile_tokens(h), |l| l.rows() / h.group())
}

/// `rope_store`'s workgroups per row: the K and V heads; ahead of
/// `attend_coop` (a cooperative `layout`), the query rows too (into `out`).
fn rope_groups(layout: Option<CoopLayout>, h: Heads) -> u32 {
    (if layout.is_some() { 3 * h.kv } else { 2 * h.kv }) as u32
}

/// The geometry of one layer's attention.
#[derive(Debug, Clone, Copy)]
pub struct AttentionShape<'a> {
    pub heads: Heads,
    pub rotary_dim: usize,
    pub scale: f32,
    /// Sliding window (0: none).
    pub window: usize,
    pub qk_norm: Option<QkNormWeights<'a>>,
    pub kv_format: KvFormat,
    /// How a chunk's attention on cooperative matrices rounds its query
    /// rows (the other entries keep them in f32).
    pub chunk_precision: PrefillPrecision,
}

/// The dispatches the wrapper builds from the file's entry points.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Entry {
    /// `rope_store`; `paged`: for the rows of a ragged batch (PAGED).
    RopeStore { paged: bool },
    /// `attend` over a chunk of tokens, causal (or with every key seen);
    /// `paged`: each row over its own sequence's keys (PAGED).
    ChunkAttend { bidirectional: bool, paged: bool },
    /// `attend` built with DECODE: one token, storing its own k and v.
    TokenAttend,
    /// `attend_lanes`: one token on subgroup lanes; `paged`: a ragged
    /// batch's decode rows (PAGED).
    LanesAttend { layout: LaneLayout, paged: bool },
    /// `attend_coop`: a chunk on cooperative matrices, with `f16_copy` its
    /// rows also as f16 (binding 12); `bidirectional`: every row over
    /// every key (BIDIRECTIONAL); `paged`: the prompt rows of a ragged
    /// batch, tile by tile (PAGED).
    CoopAttend { layout: CoopLayout, f16_copy: bool, bidirectional: bool, paged: bool },
    /// `combine`; `paged`: each split row's partials (PAGED).
    Combine { paged: bool },
}

impl Entry {
    fn function(self) -> &'static str {
        match self {
            Entry::RopeStore { .. } => "rope_store",
            Entry::ChunkAttend { .. } | Entry::TokenAttend => "attend",
            Entry::LanesAttend { .. } => "attend_lanes",
            Entry::CoopAttend { .. } => "attend_coop",
            Entry::Combine { .. } => "combine",
        }
    }
}

/// How `attend_lanes` spreads one token's attention: `lanes` invocations
/// of one subgroup per key, each holding one 16-byte quad of the key row
/// (the row's quads rounded up to a power of two), and `block_rows` query
/// rows per workgroup.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LaneLayout {
    pub lanes: usize,
    pub block_rows: usize,
}

impl LaneLayout {
    /// The most rows of a block (the kernel's register arrays hold four:
    /// blocks of eight run slower at short depths).
    const MAX_BLOCK_ROWS: usize = 4;
    /// The kernel's LANE_MERGE_FLOATS: the subgroups' partials, subgroups x
    /// block rows x head_dim floats.
    const MERGE_FLOATS: usize = 4096;
    /// The kernel's merge_ml: subgroups x block rows (max, sum) pairs.
    const MERGE_ROWS: usize = 256;

    /// The layout for `heads` with `rotary_dim` and a cache in `format`,
    /// where the adapter has subgroups at least as wide as a row's quads
    /// and the rotation pairs whole quads (`None`: the tiled `attend`
    /// serves). More than one quad per lane would hold a row in an indexed
    /// register array, which drivers spill (far slower); narrow
    /// subgroups take the tiled kernel instead.
    pub fn choose(gpu: &Gpu, heads: Heads, rotary_dim: usize, format: KvFormat) -> Option<LaneLayout> {
        let subgroup = gpu.caps.subgroup_min_size as usize;
        let widest = gpu.caps.subgroup_max_size as usize;
        let usable =
            gpu.caps.subgroups && subgroup.is_power_of_two() && widest.is_power_of_two() && widest <= WG;
        let per_quad = match format {
            KvFormat::F16 => 8,
            KvFormat::F32 => 4,
        };
        let lanes = (heads.dim / per_quad).next_power_of_two();
        let whole_quads = heads.dim.is_multiple_of(per_quad) && (rotary_dim / 2).is_multiple_of(per_quad);
        if !usable || !whole_quads || lanes > subgroup {
            return None;
        }
        // Rows per workgroup whose partials the merge holds for every subgroup.
        let subgroups = WG / subgroup;
        let most = Self::MAX_BLOCK_ROWS
            .min(Self::MERGE_FLOATS / (subgroups * heads.dim))
            .min(Self::MERGE_ROWS / subgroups);
        let blocks = heads.group().div_ceil(most);
        Some(LaneLayout { lanes, block_rows: heads.group().div_ceil(blocks) })
    }

    fn constants(&self) -> Vec<(&'static str, f64)> {
        vec![("LANES", self.lanes as f64), ("BLOCK_ROWS", self.block_rows as f64)]
    }
}

/// One token's attention: `attend_lanes` (or `attend` built with DECODE),
/// then `combine` when it is split.
#[derive(Debug)]
pub struct DecodeAttention {
    pub attend: Dispatch,
    pub combine: Dispatch,
}

impl DecodeAttention {
    /// Encodes the token's attention over `splits` workgroups per KV head
    /// (the value written to the step's `attn_splits`); returns the
    /// dispatches encoded.
    pub fn encode(&self, pass: &mut wgpu::ComputePass<'_>, splits: u32) -> u32 {
        let [kv_heads, row_blocks, _] = self.attend.workgroups;
        self.attend.encode_grid(pass, [kv_heads, row_blocks, splits]);
        if splits > 1 {
            self.combine.encode(pass, 1);
            2
        } else {
            1
        }
    }
}

/// The attention kernels, with the layout of the chunk attention on
/// cooperative matrices where the device has them.
#[derive(Debug, Clone, Copy, Default)]
pub struct Attention {
    coop: Option<CoopLayout>,
    /// Query rows per `attend_lanes` workgroup where set (benchmarks);
    /// else [`LaneLayout::choose`]'s.
    lane_rows: Option<usize>,
}

impl Attention {
    pub fn new(gpu: &Gpu) -> Self {
        let coop = if gpu.caps.cooperative_matrix { CoopLayout::fitting(gpu).next() } else { None };
        Attention { coop, lane_rows: None }
    }

    /// These kernels with `rows` query rows per `attend_lanes` workgroup
    /// (1 to 4, fewer where the merge's memory holds fewer), for
    /// benchmarks: a workgroup of fewer rows holds fewer registers, and a
    /// step runs more of them.
    #[cfg(feature = "internals")]
    pub fn with_lane_rows(self, rows: usize) -> Self {
        Attention { lane_rows: Some(rows), ..self }
    }

    /// `attend_lanes`' layout for `shape`, if it runs.
    fn lane_layout(&self, gpu: &Gpu, shape: &AttentionShape<'_>) -> Option<LaneLayout> {
        let layout = LaneLayout::choose(gpu, shape.heads, shape.rotary_dim, shape.kv_format)?;
        Some(match self.lane_rows {
            Some(rows) => LaneLayout { block_rows: rows.clamp(1, layout.block_rows), ..layout },
            None => layout,
        })
    }

    /// The kernels with `attend_coop` laid out as `layout` (one of
    /// [`CoopLayout::fitting`]).
    #[cfg(feature = "internals")]
    pub fn with_coop_layout(gpu: &Gpu, layout: CoopLayout) -> Self {
        Attention { coop: Some(layout).filter(|_| gpu.caps.cooperative_matrix), lane_rows: None }
    }

    /// Key splits for one token with `n_keys` keys in view: enough
    /// workgroups to fill a large GPU, at least `MIN_KEYS_PER_SPLIT` keys
    /// each, at most `max_splits`.
    pub fn decode_splits(n_keys: usize, kv_heads: usize, max_splits: usize) -> usize {
        n_keys.div_ceil(MIN_KEYS_PER_SPLIT).min(TARGET_WORKGROUPS.div_ceil(kv_heads)).clamp(1, max_splits)
    }

    /// The most splits a cache of `context_len` positions uses.
    pub fn max_splits(context_len: usize, kv_heads: usize) -> usize {
        Self::decode_splits(context_len, kv_heads, MAX_SPLITS)
    }

    fn params(
        shape: &AttentionShape<'_>,
        b: &AttentionBindings<'_>,
        tokens_per_wg: usize,
        paged: Option<&PagedRows<'_>>,
    ) -> AttentionParams {
        let splits = paged.map(|p| &p.splits);
        let h = shape.heads;
        let (v_offset, v_stride) = match b.values {
            Some(_) => (0, h.kv * h.dim),
            None => ((h.q + h.kv) * h.dim, h.qkv_width()),
        };
        AttentionParams {
            n_q_heads: h.q as u32,
            n_kv_heads: h.kv as u32,
            half_rot: (shape.rotary_dim / 2) as u32,
            qkv_stride: h.qkv_width() as u32,
            out_stride: (h.q * h.dim) as u32,
            window: shape.window as u32,
            scale: shape.scale,
            tokens_per_wg: tokens_per_wg as u32,
            eps: shape.qk_norm.map_or(0.0, |n| n.eps),
            v_offset: v_offset as u32,
            v_stride: v_stride as u32,
            block_size: paged.map_or(0, |p| p.block_size as u32),
            split_keys: splits.map_or(0, |s| s.split_keys as u32),
            max_splits: splits.map_or(1, |s| s.max_splits as u32),
            decode_apart: 0,
        }
    }

    fn flags(gpu: &Gpu, shape: &AttentionShape<'_>, entry: Entry) -> Vec<&'static str> {
        let mut flags = vec![];
        match entry {
            Entry::TokenAttend => flags.push("DECODE"),
            Entry::LanesAttend { .. } => flags.push(super::SUBGROUPS),
            Entry::CoopAttend { f16_copy, bidirectional, .. } => {
                flags.push(COOP);
                if bidirectional {
                    flags.push(BIDIRECTIONAL);
                }
                if f16_copy {
                    flags.push(OUT_F16);
                }
                if shape.chunk_precision == PrefillPrecision::Split {
                    flags.push(Q_SPLIT);
                }
            }
            Entry::ChunkAttend { bidirectional: true, .. } => flags.push(BIDIRECTIONAL),
            _ => {}
        }
        if matches!(
            entry,
            Entry::RopeStore { paged: true }
                | Entry::ChunkAttend { paged: true, .. }
                | Entry::Combine { paged: true }
                | Entry::LanesAttend { paged: true, .. }
                | Entry::CoopAttend { paged: true, .. }
        ) {
            flags.push(PAGED);
        }
        if shape.kv_format == KvFormat::F16 {
            flags.push("KV_F16");
            if gpu.caps.f16_in_f32 {
                flags.push(super::F16_NATIVE);
            }
        }
        match shape.qk_norm.map(|n| n.mode).filter(|_| !matches!(entry, Entry::CoopAttend { .. })) {
            None | Some(QkNorm::None) => {}
            Some(QkNorm::PerHead) => flags.push("QK_NORM"),
            Some(QkNorm::WholeProjection) => flags.extend(["QK_NORM", "QK_NORM_WHOLE"]),
        }
        flags
    }

    /// Binds `entry` with the given bindings (plus the q/k norm weights
    /// where the entry reads them).
    #[allow(clippy::too_many_arguments)]
    fn dispatch(
        &self,
        gpu: &Gpu,
        shape: &AttentionShape<'_>,
        entry: Entry,
        params: &ParamsBuffer,
        buffers: &[(u32, &wgpu::Buffer)],
        workgroups: [u32; 3],
        tokens_per_workgroup: u32,
    ) -> Result<Dispatch> {
        let flags = Self::flags(gpu, shape, entry);
        let function = entry.function();
        let heads = vec![("HEAD_DIM", shape.heads.dim as f64), ("GROUP", shape.heads.group() as f64)];
        let layout = match entry {
            Entry::LanesAttend { layout, .. } => layout.constants(),
            Entry::CoopAttend { layout, .. } => layout.constants(),
            _ => vec![],
        };
        let constants = [heads, layout].concat();
        let pipeline = super::pipeline(gpu, "attention", function, &flags, &constants)?;
        // combine reads no parameters (its head width is a constant of the
        // build) but paged, where it reads the rows'.
        let mut bound: Vec<(u32, &wgpu::Buffer)> =
            if entry == (Entry::Combine { paged: false }) { vec![] } else { vec![(0, &params.0)] };
        bound.extend_from_slice(buffers);
        // attend_coop reads its rows already normalised and rotated.
        let rotates = !matches!(entry, Entry::Combine { .. } | Entry::CoopAttend { .. });
        if let (true, Some(n)) = (rotates, shape.qk_norm.filter(|n| n.mode != QkNorm::None)) {
            bound.extend([(9, &n.q.parts[0].buffer), (10, &n.k.parts[0].buffer)]);
        }
        Ok(Dispatch {
            label: function,
            bind_group: gpu.bind_at(function, &pipeline, &bound),
            pipeline,
            workgroups,
            tokens_per_workgroup,
        })
    }

    /// A chunk of tokens: k norm and RoPE, K/V stored, then, with q norm
    /// and RoPE, `out[t, h] = softmax(scale q k^T) v` for every query head
    /// of every token, keys limited to a trailing window when one is set.
    pub fn plan_chunk(
        &self,
        gpu: &Gpu,
        shape: &AttentionShape<'_>,
        b: &AttentionBindings<'_>,
    ) -> Result<Vec<Dispatch>> {
        self.plan_chunk_masked(gpu, shape, b, false)
    }

    /// As [`Self::plan_chunk`] with every row seeing every key up to the
    /// chunk's end (no causal mask, no window): the vision tower's
    /// attention over an image's patches.
    pub fn plan_bidirectional(
        &self,
        gpu: &Gpu,
        shape: &AttentionShape<'_>,
        b: &AttentionBindings<'_>,
    ) -> Result<Vec<Dispatch>> {
        self.plan_chunk_masked(gpu, shape, b, true)
    }

    fn plan_chunk_masked(
        &self,
        gpu: &Gpu,
        shape: &AttentionShape<'_>,
        b: &AttentionBindings<'_>,
        bidirectional: bool,
    ) -> Result<Vec<Dispatch>> {
        let h = shape.heads;
        let group = h.group();
        debug_assert!(h.dim <= MAX_HEAD_DIM && group <= MAX_GROUP && group * h.dim <= MAX_GROUP_WIDTH);
        let coop = self.coop.filter(|_| self.coop_fits(shape));
        // The chunk's tokens share each K/V tile among as many query rows as fit.
        let tokens_per_wg = chunk_tile_tokens(coop, h);
        let params = ParamsBuffer::new(gpu, "attention.params", &Self::params(shape, b, tokens_per_wg, None));
        let rope = self.dispatch(
            gpu,
            shape,
            Entry::RopeStore { paged: false },
            &params,
            &b.storing_values(),
            [rope_groups(coop, h), 1, 1],
            1,
        )?;
        let f16_copy = b.out16.is_some();
        if f16_copy && !(coop.is_some() && shape.chunk_precision == PrefillPrecision::F16) {
            return Err(crate::Error::Unsupported {
                what: "f16 copy of a chunk's attention rows (on cooperative matrices in f16)",
                value: format!("{:?} chunk attention, bidirectional {bidirectional}", shape.chunk_precision),
            });
        }
        let attend = if let Some(layout) = coop {
            // The rows come from `out`, already normalised and rotated.
            let mut bound = vec![(1, b.step), (4, b.k_cache), (5, b.v_cache), (6, b.out)];
            bound.extend(b.out16.map(|out16| (12, out16)));
            self.dispatch(
                gpu,
                shape,
                Entry::CoopAttend { layout, f16_copy, bidirectional, paged: false },
                &params,
                &bound,
                [h.kv as u32, 1, 1],
                tokens_per_wg as u32,
            )?
        } else {
            self.dispatch(
                gpu,
                shape,
                Entry::ChunkAttend { bidirectional, paged: false },
                &params,
                &b.rows_and_caches(),
                [h.kv as u32, 1, 1],
                tokens_per_wg as u32,
            )?
        };
        Ok(vec![rope, attend])
    }

    /// The rows of a ragged batch, each of its own sequence, over a cache
    /// that is a pool of blocks (`paged`): each row's k norm and RoPE (its
    /// angles in row t of `b.cos_sin`) and K/V store at its position, then
    /// each row's attention over its sequence's keys up to its position.
    /// Decode rows (the step's first, given partial slots) split their keys
    /// and run on `attend_lanes` where the adapter's subgroups take it.
    /// Every row's work is the same whatever else runs beside it.
    pub fn plan_paged(
        &self,
        gpu: &Gpu,
        shape: &AttentionShape<'_>,
        b: &AttentionBindings<'_>,
        paged: &PagedRows<'_>,
    ) -> Result<PagedAttention> {
        let h = shape.heads;
        debug_assert!(
            h.dim <= MAX_HEAD_DIM && h.group() <= MAX_GROUP && h.group() * h.dim <= MAX_GROUP_WIDTH
        );
        let splits = &paged.splits;
        let lanes = self.lane_layout(gpu, shape).filter(|_| splits.max_splits > 1);
        // Prompt rows on cooperative matrices where the chunk's attention
        // would run there, and the decode rows (which split) run apart.
        let coop = self.coop.filter(|_| self.coop_fits(shape) && lanes.is_some());
        let tile_rows = chunk_tile_tokens(coop, h);
        debug_assert!(tile_rows < 1 << TILE_ROW_BITS);
        let mut params = Self::params(shape, b, tile_rows, Some(paged));
        params.decode_apart = lanes.is_some() as u32;
        let params = ParamsBuffer::new(gpu, "attention.params", &params);
        let rows = [(13, paged.rows), (14, paged.block_table)];
        // Paged rows carry their own positions: the store reads no step.
        let mut storing: Vec<_> = b.storing_values().into_iter().filter(|&(i, _)| i != 1).collect();
        storing.extend(rows);
        let rope = self.dispatch(
            gpu,
            shape,
            Entry::RopeStore { paged: true },
            &params,
            &storing,
            [rope_groups(coop, h), 1, 1],
            1,
        )?;
        // Its tiles carry their rows too.
        let attend = match coop {
            Some(layout) => {
                let mut bound = vec![(4, b.k_cache), (5, b.v_cache), (6, b.out)];
                bound.extend(rows);
                let entry = Entry::CoopAttend { layout, f16_copy: false, bidirectional: false, paged: true };
                self.dispatch(gpu, shape, entry, &params, &bound, [h.kv as u32, 1, 1], 1)?
            }
            None => {
                let mut reading: Vec<_> = b.rows_and_caches().into_iter().filter(|&(i, _)| i != 1).collect();
                reading.extend(rows);
                reading.extend([(7, splits.acc), (8, splits.max_sum)]);
                let entry = Entry::ChunkAttend { bidirectional: false, paged: true };
                let grid = [h.kv as u32, 1, splits.max_splits as u32];
                self.dispatch(gpu, shape, entry, &params, &reading, grid, 1)?
            }
        };
        let decode = match lanes {
            Some(layout) => {
                let mut bound: Vec<_> = storing.into_iter().filter(|&(i, _)| i != 1).collect();
                bound.extend([(7, splits.acc), (8, splits.max_sum)]);
                let row_blocks = h.group().div_ceil(layout.block_rows) as u32;
                let grid = [h.kv as u32, row_blocks, splits.max_splits as u32];
                Some(self.dispatch(
                    gpu,
                    shape,
                    Entry::LanesAttend { layout, paged: true },
                    &params,
                    &bound,
                    grid,
                    1,
                )?)
            }
            None => None,
        };
        let decode_walk = decode.as_ref().map(|d| Dispatch {
            label: d.label,
            pipeline: d.pipeline.clone(),
            bind_group: d.bind_group.clone(),
            workgroups: [d.workgroups[0], d.workgroups[1], 1],
            tokens_per_workgroup: d.tokens_per_workgroup,
        });
        let combine = match splits.max_splits {
            1 => None,
            _ => {
                let merging = [(6, b.out), (7, splits.acc), (8, splits.max_sum), rows[0]];
                let grid = [h.q as u32, 1, 1];
                Some(self.dispatch(gpu, shape, Entry::Combine { paged: true }, &params, &merging, grid, 1)?)
            }
        };
        Ok(PagedAttention { rope, attend, decode, decode_walk, combine, tile_rows })
    }

    /// Whether a chunk's (causal) attention can write its rows as f16 too
    /// ([`AttentionBindings::out16`]): it runs on cooperative matrices in
    /// f16.
    pub fn chunk_writes_f16(&self, shape: &AttentionShape<'_>) -> bool {
        self.coop.is_some() && self.coop_fits(shape) && shape.chunk_precision == PrefillPrecision::F16
    }

    /// A chunk's attention runs on cooperative matrices: the device has
    /// them (and workgroup memory for a layout), the cache is f16 (an f32
    /// cache is asked for its precision, which f16 tiles would lose), heads
    /// are whole runs of 8 (the last 16-wide fragment may be half empty) of
    /// at most `COOP_MAX_HEAD_DIM`, and a group divides a subgroup's 16
    /// rows.
    pub fn coop_fits(&self, shape: &AttentionShape<'_>) -> bool {
        let h = shape.heads;
        self.coop.is_some()
            && shape.kv_format == KvFormat::F16
            && h.dim.is_multiple_of(8)
            && h.dim <= COOP_MAX_HEAD_DIM
            && 16usize.is_multiple_of(h.group())
    }

    /// One token: q/k norm, RoPE, the K/V store and the attention in one
    /// dispatch per split count, merged by a second when split.
    pub fn plan_decode(
        &self,
        gpu: &Gpu,
        shape: &AttentionShape<'_>,
        b: &AttentionBindings<'_>,
        scratch: &SplitScratch<'_>,
    ) -> Result<DecodeAttention> {
        let h = shape.heads;
        let params = ParamsBuffer::new(gpu, "attention.params", &Self::params(shape, b, 1, None));
        let (entry, row_blocks) = match self.lane_layout(gpu, shape) {
            Some(layout) => {
                (Entry::LanesAttend { layout, paged: false }, h.group().div_ceil(layout.block_rows))
            }
            None => (Entry::TokenAttend, 1),
        };
        let mut bound = b.storing_values();
        bound.extend([(7, scratch.acc), (8, scratch.max_sum)]);
        let attend =
            self.dispatch(gpu, shape, entry, &params, &bound, [h.kv as u32, row_blocks as u32, 1], 0)?;
        let combine = self.dispatch(
            gpu,
            shape,
            Entry::Combine { paged: false },
            &params,
            &[(1, b.step), (6, b.out), (7, scratch.acc), (8, scratch.max_sum)],
            [h.q as u32, 1, 1],
            0,
        )?;
        Ok(DecodeAttention { attend, combine })
    }
}

/// The flag sets of every attention build.
#[cfg(feature = "internals")]
pub fn flag_sets() -> Vec<Vec<&'static str>> {
    let mut out = Vec::new();
    for kv in [&[][..], &["KV_F16"], &["KV_F16", super::F16_NATIVE]] {
        for norm in [&[][..], &["QK_NORM"], &["QK_NORM", "QK_NORM_WHOLE"]] {
            for decode in [&[][..], &["DECODE"], &[super::SUBGROUPS], &[PAGED], &[super::SUBGROUPS, PAGED]] {
                out.push([norm, kv, decode].concat());
            }
            if !kv.is_empty() && norm.is_empty() {
                out.push([kv, &[COOP][..]].concat());
                out.push([kv, &[COOP, OUT_F16][..]].concat());
                out.push([kv, &[COOP, Q_SPLIT][..]].concat());
                out.push([kv, &[COOP, PAGED][..]].concat());
                out.push([kv, &[COOP, PAGED, Q_SPLIT][..]].concat());
                out.push([kv, &[COOP, BIDIRECTIONAL][..]].concat());
                out.push([kv, &[COOP, BIDIRECTIONAL, Q_SPLIT][..]].concat());
                out.push([kv, &[COOP, BIDIRECTIONAL, OUT_F16][..]].concat());
            }
            if norm.is_empty() {
                out.push([kv, &[BIDIRECTIONAL][..]].concat());
            }
        }
    }
    out
}
