//! Semantic checks of a decoded program against its file: every index in
//! range, every byte range inside its segment or planned buffer, with
//! overflow-checked arithmetic. The flatbuffer verifier only proves the
//! tables are readable; this proves a runtime can follow them blindly.

use std::ops::Range;

use etmetal_core::{Error, Result};

use crate::header::ExtendedHeader;
use crate::schema::*;

fn fail<T>(path: &str, msg: impl std::fmt::Display) -> Result<T> {
    Err(Error::format(format!("{path}: {msg}")))
}

/// Byte size of a tensor's data: sizes must be non-negative and the product
/// (times the element size) must fit in u64.
pub fn tensor_nbytes(t: &Tensor, path: &str) -> Result<u64> {
    if t.sizes.iter().any(|&s| s < 0) {
        return fail(
            path,
            format!("tensor sizes {:?} have a negative size", t.sizes),
        );
    }
    t.sizes
        .iter()
        .try_fold(t.scalar_type.size() as u64, |acc, &s| {
            acc.checked_mul(s as u64)
        })
        .map_or_else(
            || {
                fail(
                    path,
                    format!("tensor sizes {:?} overflow u64 bytes", t.sizes),
                )
            },
            Ok,
        )
}

/// Absolute file range of `segments[index]`.
pub(crate) fn segment_range(
    program: &Program,
    base: u64,
    file_len: usize,
    index: usize,
) -> Result<Range<usize>> {
    let path = format!("segments[{index}]");
    let Some(seg) = program.segments.get(index) else {
        return fail(
            &path,
            format!("does not exist ({} segments)", program.segments.len()),
        );
    };
    let end = base
        .checked_add(seg.offset)
        .and_then(|s| Some((s, s.checked_add(seg.size)?)));
    match end {
        Some((start, end)) if end <= file_len as u64 => Ok(start as usize..end as usize),
        _ => fail(
            &path,
            format!(
                "offset {} size {} from base {base} runs past the end of the {file_len}-byte file",
                seg.offset, seg.size
            ),
        ),
    }
}

/// The schema versions this reader understands (`EXECUTORCH_SCHEMA_VERSION`).
pub const MAX_SCHEMA_VERSION: u32 = 0;

pub(crate) fn check_version(version: u32) -> Result<()> {
    if version > MAX_SCHEMA_VERSION {
        return Err(Error::format(format!(
            "program schema version {version} is newer than the supported version {MAX_SCHEMA_VERSION}"
        )));
    }
    Ok(())
}

/// Check everything [`crate::read::parse`] promises about a program.
pub(crate) fn check(
    program: &Program,
    header: Option<&ExtendedHeader>,
    file_len: usize,
) -> Result<()> {
    check_version(program.version)?;
    let seg_sizes = check_segments(program, header, file_len)?;
    let seg_size = |index: u32, path: &str| -> Result<u64> {
        match seg_sizes.get(index as usize) {
            Some(&s) => Ok(s),
            None => fail(
                path,
                format!(
                    "segment index {index} is out of range ({} segments)",
                    seg_sizes.len()
                ),
            ),
        }
    };
    let check_offsets = |s: &SubsegmentOffsets, path: &str| -> Result<()> {
        let size = seg_size(s.segment_index, path)?;
        match s.offsets.iter().position(|&o| o > size) {
            Some(i) => fail(
                path,
                format!(
                    "offsets[{i}] = {} is past the {size}-byte segment",
                    s.offsets[i]
                ),
            ),
            None => Ok(()),
        }
    };
    if let Some(cs) = &program.constant_segment {
        // Only offsets[0] (the placeholder) means "no constants": then the
        // segment index is not used and files without segments are fine.
        if cs.offsets.len() > 1 {
            if !program.constant_buffer.is_empty() {
                return fail(
                    "constant_segment",
                    "both constant_buffer and constant_segment.offsets are set",
                );
            }
            check_offsets(cs, "constant_segment")?;
        }
    }
    for (i, m) in program.mutable_data_segments.iter().enumerate() {
        check_offsets(m, &format!("mutable_data_segments[{i}]"))?;
    }
    let mut keys = std::collections::HashSet::new();
    for (i, n) in program.named_data.iter().enumerate() {
        let path = format!("named_data[{i}] `{}`", n.key);
        seg_size(n.segment_index, &path)?;
        // Keys are looked up by name: a second entry would be unreachable.
        if !keys.insert(n.key.as_str()) {
            return fail(&path, "key appears more than once");
        }
    }
    let data = DataChecker {
        program,
        seg_size: &seg_size,
    };
    for (p, plan) in program.execution_plan.iter().enumerate() {
        check_plan(plan, &format!("execution_plan[{p}]"), &data)?;
    }
    Ok(())
}

/// Segments inside the file and the header's segment area, not overlapping.
/// Returns each segment's size.
fn check_segments(
    program: &Program,
    header: Option<&ExtendedHeader>,
    file_len: usize,
) -> Result<Vec<u64>> {
    let base = header.map_or(0, |h| h.segment_base_offset);
    let data_size = header.map_or(0, |h| h.segment_data_size);
    // Without a base offset only empty segments make sense (the writer adds
    // no header when there is no segment data).
    if base == 0 {
        if let Some(i) = program.segments.iter().position(|s| s.size > 0) {
            return fail(
                &format!("segments[{i}]"),
                format!(
                    "{} bytes of data but no extended header gives a segment base offset",
                    program.segments[i].size
                ),
            );
        }
    }
    let mut spans = Vec::with_capacity(program.segments.len());
    for (i, seg) in program.segments.iter().enumerate() {
        let range = segment_range(program, base, file_len, i)?;
        if data_size != 0 && seg.offset.saturating_add(seg.size) > data_size {
            return fail(
                &format!("segments[{i}]"),
                format!(
                    "offset {} size {} exceeds the header's segment_data_size {}",
                    seg.offset, seg.size, data_size
                ),
            );
        }
        if !range.is_empty() {
            spans.push((range, i));
        }
    }
    spans.sort_by_key(|(r, _)| r.start);
    for pair in spans.windows(2) {
        let ((a, ia), (b, ib)) = (&pair[0], &pair[1]);
        if b.start < a.end {
            return fail(
                &format!("segments[{ib}]"),
                format!(
                    "bytes {}..{} overlap segments[{ia}] at {}..{}",
                    b.start, b.end, a.start, a.end
                ),
            );
        }
    }
    Ok(program.segments.iter().map(|s| s.size).collect())
}

struct DataChecker<'a> {
    program: &'a Program,
    seg_size: &'a dyn Fn(u32, &str) -> Result<u64>,
}

impl DataChecker<'_> {
    /// `offsets[idx] + nbytes` inside the segment that `s` describes.
    fn in_subsegment(
        &self,
        s: &SubsegmentOffsets,
        idx: u32,
        nbytes: u64,
        what: &str,
        path: &str,
    ) -> Result<()> {
        let Some(&offset) = s.offsets.get(idx as usize) else {
            return fail(
                path,
                format!(
                    "data_buffer_idx {idx} is out of range ({} {what} offsets)",
                    s.offsets.len()
                ),
            );
        };
        let size = (self.seg_size)(s.segment_index, path)?;
        if offset.checked_add(nbytes).is_none_or(|end| end > size) {
            return fail(
                path,
                format!(
                    "{nbytes} bytes at {what} offset {offset} run past the {size}-byte segment"
                ),
            );
        }
        Ok(())
    }

    /// The stored data of a tensor (constant or initial mutable state) is in range.
    fn tensor_data(&self, t: &Tensor, nbytes: u64, path: &str) -> Result<()> {
        let idx = t.data_buffer_idx;
        let external = t
            .extra_tensor_info
            .as_ref()
            .is_some_and(|e| e.location == TensorDataLocation::External);
        if idx == 0 || external {
            return Ok(());
        }
        let program = self.program;
        if t.allocation_info.is_some() {
            let m = t
                .extra_tensor_info
                .as_ref()
                .map_or(0, |e| e.mutable_data_segments_idx);
            let Some(s) = usize::try_from(m)
                .ok()
                .and_then(|m| program.mutable_data_segments.get(m))
            else {
                return fail(path, format!("mutable data segment {m} does not exist"));
            };
            return self.in_subsegment(s, idx, nbytes, "mutable data", path);
        }
        if !program.constant_buffer.is_empty() {
            return match program.constant_buffer.get(idx as usize) {
                Some(b) if b.storage.len() as u64 >= nbytes => Ok(()),
                Some(b) => fail(
                    path,
                    format!(
                        "constant_buffer[{idx}] has {} bytes, needs {nbytes}",
                        b.storage.len()
                    ),
                ),
                None => fail(
                    path,
                    format!(
                        "data_buffer_idx {idx} is out of range ({} constant buffers)",
                        program.constant_buffer.len()
                    ),
                ),
            };
        }
        match &program.constant_segment {
            Some(cs) => self.in_subsegment(cs, idx, nbytes, "constant", path),
            None => fail(
                path,
                format!("data_buffer_idx {idx} but the program has no constant data"),
            ),
        }
    }
}

fn index_in(index: i32, len: usize, what: &str, path: &str) -> Result<()> {
    if index < 0 || index as usize >= len {
        return fail(
            path,
            format!("{what} {index} is out of range ({len} entries)"),
        );
    }
    Ok(())
}

fn check_plan(plan: &ExecutionPlan, path: &str, data: &DataChecker) -> Result<()> {
    let n = plan.values.len();
    let value = |i: i32, p: &str| index_in(i, n, "value index", p);
    for (k, &i) in plan.inputs.iter().enumerate() {
        value(i, &format!("{path}.inputs[{k}]"))?;
    }
    for (k, &i) in plan.outputs.iter().enumerate() {
        value(i, &format!("{path}.outputs[{k}]"))?;
    }
    for (k, &s) in plan.non_const_buffer_sizes.iter().enumerate() {
        if s < 0 {
            return fail(
                &format!("{path}.non_const_buffer_sizes[{k}]"),
                format!("size {s} is negative"),
            );
        }
    }
    for (k, d) in plan.non_const_buffer_device.iter().flatten().enumerate() {
        let p = format!("{path}.non_const_buffer_device[{k}]");
        index_in(
            d.buffer_idx,
            plan.non_const_buffer_sizes.len(),
            "buffer_idx",
            &p,
        )?;
    }
    for (v, val) in plan.values.iter().enumerate() {
        let p = format!("{path}.values[{v}]");
        match val {
            EValue::TensorList(items) => {
                for &i in items {
                    value(i, &p)?;
                }
            }
            EValue::OptionalTensorList(items) => {
                for &i in items.iter().filter(|&&i| i != -1) {
                    value(i, &p)?;
                }
            }
            EValue::Tensor(t) => check_tensor(t, plan, &p, data)?,
            _ => {}
        }
    }
    for (d, del) in plan.delegates.iter().enumerate() {
        let p = format!("{path}.delegates[{d}] `{}`", del.id);
        let (len, list) = match del.processed.location {
            DataLocation::Inline => (
                data.program.backend_delegate_data.len(),
                "inline delegate data index",
            ),
            DataLocation::Segment => (data.program.segments.len(), "delegate segment index"),
        };
        if del.processed.index as usize >= len {
            return fail(
                &p,
                format!(
                    "{list} {} is out of range ({len} entries)",
                    del.processed.index
                ),
            );
        }
    }
    for (c, chain) in plan.chains.iter().enumerate() {
        check_chain(chain, plan, &format!("{path}.chains[{c}]"))?;
    }
    Ok(())
}

fn check_tensor(t: &Tensor, plan: &ExecutionPlan, path: &str, data: &DataChecker) -> Result<()> {
    let nbytes = tensor_nbytes(t, path)?;
    let rank = t.sizes.len();
    let mut seen = vec![false; rank];
    let permutation = t.dim_order.len() == rank
        && t.dim_order
            .iter()
            .all(|&d| (d as usize) < rank && !std::mem::replace(&mut seen[d as usize], true));
    if !permutation {
        return fail(
            path,
            format!(
                "dim_order {:?} is not a permutation of 0..{rank}",
                t.dim_order
            ),
        );
    }
    let constant = t.allocation_info.is_none()
        && (t.data_buffer_idx > 0
            || t.extra_tensor_info
                .as_ref()
                .is_some_and(|e| e.location == TensorDataLocation::External));
    if constant && t.shape_dynamism != TensorShapeDynamism::Static {
        // ExecuTorch's emitter writes constants static; their bytes are
        // sized for `sizes`, which a dynamic shape would change
        return fail(
            path,
            format!(
                "a constant tensor (sizes {:?}) marked {:?}",
                t.sizes, t.shape_dynamism
            ),
        );
    }
    if let Some(a) = &t.allocation_info {
        let sizes = &plan.non_const_buffer_sizes;
        // memory_id is 1-based (buffer 0 stands for constants): ExecuTorch
        // 1.5.1 subtracts 1 and fails on 0.
        if a.memory_id == 0 || a.memory_id as usize >= sizes.len() {
            return fail(
                path,
                format!(
                    "memory_id {} is out of range 1..{} (non_const_buffer_sizes)",
                    a.memory_id,
                    sizes.len()
                ),
            );
        }
        let size = sizes[a.memory_id as usize] as u64;
        let offset = a.memory_offset();
        if offset.checked_add(nbytes).is_none_or(|end| end > size) {
            return fail(
                path,
                format!(
                    "{nbytes} bytes at offset {offset} of memory {} exceed its {size} bytes",
                    a.memory_id
                ),
            );
        }
    }
    data.tensor_data(t, nbytes, path)
}

fn check_chain(chain: &Chain, plan: &ExecutionPlan, path: &str) -> Result<()> {
    let n = plan.values.len();
    let value = |i: i32, p: &str| index_in(i, n, "value index", p);
    for (k, &i) in chain.inputs.iter().enumerate() {
        value(i, &format!("{path}.inputs[{k}]"))?;
    }
    for (k, &i) in chain.outputs.iter().enumerate() {
        value(i, &format!("{path}.outputs[{k}]"))?;
    }
    for (k, ins) in chain.instructions.iter().enumerate() {
        let p = format!("{path}.instructions[{k}]");
        match ins {
            Instruction::KernelCall(c) => {
                index_in(c.op_index, plan.operators.len(), "operator index", &p)?;
                c.args.iter().try_for_each(|&a| value(a, &p))?;
            }
            Instruction::DelegateCall(c) => {
                index_in(c.delegate_index, plan.delegates.len(), "delegate index", &p)?;
                c.args.iter().try_for_each(|&a| value(a, &p))?;
            }
            Instruction::MoveCall(m) => {
                value(m.move_from, &p)?;
                value(m.move_to, &p)?;
            }
            Instruction::JumpFalseCall(j) => {
                value(j.cond_value_index, &p)?;
                index_in(
                    j.destination_instruction,
                    chain.instructions.len(),
                    "jump destination",
                    &p,
                )?;
            }
            Instruction::FreeCall(f) => value(f.value_index, &p)?,
        }
    }
    Ok(())
}
