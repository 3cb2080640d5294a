//! SPIR-V for the cooperative-matrix kernels on Vulkan, made to follow the
//! memory model it declares.
//!
//! naga declares the Vulkan memory model for any shader with cooperative
//! matrices (it requires it) but still writes its loads, stores and
//! barriers as under GLSL450's: workgroup accesses are private and barriers
//! make nothing available or visible (gfx-rs/wgpu#8805). Under that model
//! a private store by one invocation need never be seen by another, and the
//! NVIDIA compiler does reorder them: the staged tiles of a GEMM come out
//! stale. So these kernels are translated here and the words fixed before
//! the module is handed to the driver as it is:
//! - every load and store through a workgroup pointer (plain and
//!   cooperative) is marked `NonPrivatePointer`;
//! - every barrier's semantics gain `MakeAvailable | MakeVisible`, and a
//!   subgroup barrier's (naga's `SubgroupMemory`, which no storage class
//!   answers to) `WorkgroupMemory`: the kernels order their subgroup's
//!   workgroup memory with it.
//!
//! The module's bindings are numbered as wgpu numbers a layout's (in
//! order, from 0), since nothing remaps a module passed through.

use crate::error::{Error, Result};

const OP_CONSTANT: u32 = 43;
const OP_FUNCTION: u32 = 54;
const OP_VARIABLE: u32 = 59;
const OP_LOAD: u32 = 61;
const OP_STORE: u32 = 62;
const OP_ACCESS_CHAIN: u32 = 65;
const OP_IN_BOUNDS_ACCESS_CHAIN: u32 = 66;
const OP_PTR_ACCESS_CHAIN: u32 = 67;
const OP_IN_BOUNDS_PTR_ACCESS_CHAIN: u32 = 70;
const OP_COPY_OBJECT: u32 = 83;
const OP_CONTROL_BARRIER: u32 = 224;
const OP_MEMORY_BARRIER: u32 = 225;
const OP_COOPERATIVE_MATRIX_LOAD: u32 = 4457;
const OP_COOPERATIVE_MATRIX_STORE: u32 = 4458;

const STORAGE_CLASS_WORKGROUP: u32 = 4;
const MEMORY_ACCESS_NON_PRIVATE_POINTER: u32 = 0x20;
const SEMANTICS_MAKE_AVAILABLE_VISIBLE: u32 = 0x2000 | 0x4000;
const SEMANTICS_SUBGROUP_MEMORY: u32 = 0x80;
const SEMANTICS_WORKGROUP_MEMORY: u32 = 0x100;
const HEADER_WORDS: usize = 5;

/// The SPIR-V of `entry` in `source` (WGSL), its override constants set,
/// with workgroup accesses and barriers made to follow the Vulkan memory
/// model, and the module (for its bindings).
pub fn spirv(source: &str, entry: &str, constants: &[(&str, f64)]) -> Result<(Vec<u32>, naga::Module)> {
    use naga::valid::{Capabilities, ValidationFlags, Validator};
    let module = naga::front::wgsl::parse_str(source).map_err(|e| Error::Gpu(e.emit_to_string(source)))?;
    let info = Validator::new(ValidationFlags::all(), Capabilities::all())
        .validate(&module)
        .map_err(|e| Error::Gpu(e.emit_to_string(source)))?;
    let constants: naga::back::PipelineConstants =
        constants.iter().map(|(k, v)| (k.to_string(), *v)).collect();
    let (resolved, info) = naga::back::pipeline_constants::process_overrides(
        &module,
        &info,
        Some((naga::ShaderStage::Compute, entry)),
        &constants,
    )
    .map_err(|e| Error::Gpu(format!("{entry}: {e}")))?;
    // wgpu's Vulkan backend numbers a layout's bindings 0, 1, ... in order
    // and remaps the shaders it translates; a passed-through module must
    // be numbered that way itself.
    let mut bindings: Vec<naga::ResourceBinding> =
        resolved.global_variables.iter().filter_map(|(_, v)| v.binding).collect();
    bindings.sort();
    let binding_map = bindings
        .iter()
        .enumerate()
        .map(|(i, b)| {
            let info = naga::back::spv::BindingInfo {
                descriptor_set: b.group,
                binding: i as u32,
                binding_array_size: None,
            };
            (*b, info)
        })
        .collect();
    let options = naga::back::spv::Options {
        lang_version: (1, 3),
        binding_map,
        bounds_check_policies: naga::proc::BoundsCheckPolicies {
            index: naga::proc::BoundsCheckPolicy::Restrict,
            buffer: naga::proc::BoundsCheckPolicy::Restrict,
            image_load: naga::proc::BoundsCheckPolicy::Restrict,
            binding_array: naga::proc::BoundsCheckPolicy::Unchecked,
        },
        zero_initialize_workgroup_memory: naga::back::spv::ZeroInitializeWorkgroupMemoryMode::None,
        force_loop_bounding: false,
        ..Default::default()
    };
    let pipeline = naga::back::spv::PipelineOptions {
        shader_stage: naga::ShaderStage::Compute,
        entry_point: entry.to_string(),
    };
    let words = naga::back::spv::write_vec(&resolved, &info, &options, Some(&pipeline))
        .map_err(|e| Error::Gpu(format!("{entry} -> SPIR-V: {e}")))?;
    Ok((follow_memory_model(&words)?, resolved.into_owned()))
}

/// One instruction: its opcode and its operand words.
struct Instruction<'a> {
    op: u32,
    operands: &'a [u32],
}

fn instructions(words: &[u32]) -> Result<Vec<Instruction<'_>>> {
    let mut out = Vec::new();
    let mut at = HEADER_WORDS;
    while at < words.len() {
        let count = (words[at] >> 16) as usize;
        if count == 0 || at + count > words.len() {
            return Err(Error::Gpu(format!("malformed SPIR-V at word {at}")));
        }
        out.push(Instruction { op: words[at] & 0xffff, operands: &words[at + 1..at + count] });
        at += count;
    }
    Ok(out)
}

fn emit(out: &mut Vec<u32>, op: u32, operands: &[u32]) {
    out.push((((operands.len() + 1) as u32) << 16) | op);
    out.extend_from_slice(operands);
}

/// `operands` with NonPrivatePointer set in the memory-access mask at
/// `mask_at` (appended when there is none).
fn non_private(operands: &[u32], mask_at: usize) -> Vec<u32> {
    let mut out = operands.to_vec();
    match out.get_mut(mask_at) {
        Some(mask) => *mask |= MEMORY_ACCESS_NON_PRIVATE_POINTER,
        None => out.push(MEMORY_ACCESS_NON_PRIVATE_POINTER),
    }
    out
}

/// Rewrites naga's words (see the module documentation).
pub fn follow_memory_model(words: &[u32]) -> Result<Vec<u32>> {
    if words.len() < HEADER_WORDS {
        return Err(Error::Gpu("SPIR-V shorter than its header".into()));
    }
    let all = instructions(words)?;

    // Pointers into workgroup memory: the variables and every chain or
    // copy derived from them (definitions precede uses within a function,
    // and variables precede functions).
    let mut workgroup = std::collections::HashSet::new();
    // Semantics constants of barriers, by id: (type, value).
    let mut constants = std::collections::HashMap::new();
    let mut barrier_semantics = std::collections::BTreeSet::new();
    for i in &all {
        match (i.op, i.operands) {
            (OP_VARIABLE, [_, id, class, ..]) if *class == STORAGE_CLASS_WORKGROUP => {
                workgroup.insert(*id);
            }
            (
                OP_ACCESS_CHAIN
                | OP_IN_BOUNDS_ACCESS_CHAIN
                | OP_PTR_ACCESS_CHAIN
                | OP_IN_BOUNDS_PTR_ACCESS_CHAIN
                | OP_COPY_OBJECT,
                [_, id, base, ..],
            ) if workgroup.contains(base) => {
                workgroup.insert(*id);
            }
            (OP_CONSTANT, [ty, id, value]) => {
                constants.insert(*id, (*ty, *value));
            }
            (OP_CONTROL_BARRIER, [_, _, semantics]) | (OP_MEMORY_BARRIER, [_, semantics]) => {
                barrier_semantics.insert(*semantics);
            }
            _ => {}
        }
    }

    // A new constant for each barrier semantics, declared before the first
    // function.
    let mut bound = words[3];
    let mut replaced = std::collections::HashMap::new();
    let mut new_constants = Vec::new();
    for id in barrier_semantics {
        let (ty, value) = *constants
            .get(&id)
            .ok_or_else(|| Error::Gpu(format!("barrier semantics %{id} is not a 32-bit constant")))?;
        let workgroup = if value & SEMANTICS_SUBGROUP_MEMORY != 0 { SEMANTICS_WORKGROUP_MEMORY } else { 0 };
        emit(
            &mut new_constants,
            OP_CONSTANT,
            &[ty, bound, value | SEMANTICS_MAKE_AVAILABLE_VISIBLE | workgroup],
        );
        replaced.insert(id, bound);
        bound += 1;
    }

    let mut out = words[..HEADER_WORDS].to_vec();
    out[3] = bound;
    let mut declared = false;
    for i in &all {
        let operands: Vec<u32> = match (i.op, i.operands) {
            (OP_FUNCTION, _) if !declared => {
                declared = true;
                out.extend_from_slice(&new_constants);
                i.operands.to_vec()
            }
            (OP_LOAD, [_, _, pointer, ..]) if workgroup.contains(pointer) => non_private(i.operands, 3),
            (OP_STORE, [pointer, ..]) if workgroup.contains(pointer) => non_private(i.operands, 2),
            (OP_COOPERATIVE_MATRIX_LOAD, [_, _, pointer, ..]) if workgroup.contains(pointer) => {
                stride_present(i.operands.len(), 5)?;
                non_private(i.operands, 5)
            }
            (OP_COOPERATIVE_MATRIX_STORE, [pointer, ..]) if workgroup.contains(pointer) => {
                stride_present(i.operands.len(), 4)?;
                non_private(i.operands, 4)
            }
            (OP_CONTROL_BARRIER, [exec, scope, semantics]) => vec![*exec, *scope, replaced[semantics]],
            (OP_MEMORY_BARRIER, [scope, semantics]) => vec![*scope, replaced[semantics]],
            _ => i.operands.to_vec(),
        };
        emit(&mut out, i.op, &operands);
    }
    Ok(out)
}

/// The stride operand of a cooperative load or store (which naga always
/// writes) precedes the memory-access mask.
fn stride_present(operands: usize, mask_at: usize) -> Result<()> {
    if operands + 1 < mask_at {
        return Err(Error::Gpu("cooperative matrix access without a stride".into()));
    }
    Ok(())
}

/// The bind group layout of `module`'s group 0: its uniform and storage
/// buffers as it declares them.
pub fn bind_group_layout(device: &wgpu::Device, label: &str, module: &naga::Module) -> wgpu::BindGroupLayout {
    let mut entries: Vec<wgpu::BindGroupLayoutEntry> = module
        .global_variables
        .iter()
        .filter_map(|(_, var)| {
            let binding = var.binding.as_ref().filter(|b| b.group == 0)?;
            let ty = match var.space {
                naga::AddressSpace::Uniform => wgpu::BufferBindingType::Uniform,
                naga::AddressSpace::Storage { access } => wgpu::BufferBindingType::Storage {
                    read_only: !access.contains(naga::StorageAccess::STORE),
                },
                _ => return None,
            };
            Some(wgpu::BindGroupLayoutEntry {
                binding: binding.binding,
                visibility: wgpu::ShaderStages::COMPUTE,
                ty: wgpu::BindingType::Buffer { ty, has_dynamic_offset: false, min_binding_size: None },
                count: None,
            })
        })
        .collect();
    entries.sort_by_key(|e| e.binding);
    device
        .create_bind_group_layout(&wgpu::BindGroupLayoutDescriptor { label: Some(label), entries: &entries })
}

#[cfg(test)]
mod tests {
    use super::*;

    const SHADER: &str = "
enable f16;
enable wgpu_cooperative_matrix;
@group(0) @binding(0) var<storage, read_write> out: array<f32>;
var<workgroup> tile: array<f16, 256>;
var<workgroup> result: array<f32, 256>;
@compute @workgroup_size(32)
fn main(@builtin(local_invocation_index) l: u32) {
    tile[l] = f16(l);
    workgroupBarrier();
    let a = coopLoadT<coop_mat16x16<f16, A>>(&tile[0], 16u);
    let b = coopLoad<coop_mat16x16<f16, B>>(&tile[0], 16u);
    let c = coopMultiplyAdd(a, b, coop_mat16x16<f32, C>());
    coopStoreT(c, &result[0], 16u);
    subgroupBarrier();
    out[l] = result[l] + f32(tile[l]);
}
";

    fn ops(words: &[u32]) -> Vec<(u32, Vec<u32>)> {
        instructions(words).unwrap().iter().map(|i| (i.op, i.operands.to_vec())).collect()
    }

    #[test]
    fn workgroup_accesses_become_non_private_and_barriers_make_them_visible() {
        let (words, _) = spirv(SHADER, "main", &[]).unwrap();
        let ops = ops(&words);
        let constant = |id: u32| ops.iter().find(|(op, o)| *op == OP_CONSTANT && o[1] == id).unwrap().1[2];
        let barriers: Vec<u32> =
            ops.iter().filter(|(op, _)| *op == OP_CONTROL_BARRIER).map(|(_, o)| constant(o[2])).collect();
        assert_eq!(barriers.len(), 2);
        assert!(
            barriers.iter().all(|s| s & SEMANTICS_MAKE_AVAILABLE_VISIBLE == SEMANTICS_MAKE_AVAILABLE_VISIBLE)
        );
        // Both order workgroup memory, the subgroup barrier too.
        assert!(barriers.iter().all(|s| s & SEMANTICS_WORKGROUP_MEMORY != 0), "{barriers:x?}");
        assert!(barriers.iter().any(|s| s & SEMANTICS_SUBGROUP_MEMORY != 0), "{barriers:x?}");
        // Stores: tile[l] and result (cooperative); loads: tile (plain and
        // two cooperative), result[l]; the storage buffer's store stays private.
        let marked = |op: u32, mask_at: usize| {
            ops.iter()
                .filter(|(o, operands)| *o == op && operands.get(mask_at).is_some_and(|m| m & 0x20 != 0))
                .count()
        };
        assert_eq!(marked(OP_STORE, 2), 1);
        assert_eq!(marked(OP_COOPERATIVE_MATRIX_STORE, 4), 1);
        assert_eq!(marked(OP_COOPERATIVE_MATRIX_LOAD, 5), 2);
        assert!(marked(OP_LOAD, 3) >= 2);
        let stores = ops.iter().filter(|(o, _)| *o == OP_STORE).count();
        assert!(stores > marked(OP_STORE, 2), "the storage buffer's store is left as it was");
        // The module still parses as SPIR-V with its new constants.
        assert!(words[3] as usize > ops.len() / 4);
    }
}
