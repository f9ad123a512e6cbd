//! Write a `.pte` the way ExecuTorch's `serialize_pte_binary` does: the
//! program flatbuffer (identifier ET12), the `eh00` header inserted after
//! byte 8 when there is segment data, then the segments at 128-byte
//! aligned offsets (FORMATS.md A.2, A.3).

use std::borrow::Cow;
use std::io::Write;
use std::path::Path;

use etmetal_core::{Error, Result};
use flatbuffers::{FlatBufferBuilder, Push, PushAlignment, TableFinishedWIPOffset, WIPOffset};

use crate::fb::slot;
use crate::header::{aligned_size, ExtendedHeader, HEADER_LENGTH, HEADER_OFFSET};
use crate::schema::*;
use crate::verify;

/// Alignment of every segment start (ExecuTorch's default `segment_alignment`).
pub const SEGMENT_ALIGNMENT: u64 = 128;
/// Padding between constant buffers and the `force_align` of inline buffers.
pub const TENSOR_ALIGNMENT: u64 = 16;

/// Bytes to place after the program; `alignment` is combined (lcm) with
/// [`SEGMENT_ALIGNMENT`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Segment<'a> {
    pub data: Cow<'a, [u8]>,
    pub alignment: u64,
}

impl<'a> Segment<'a> {
    pub fn new(data: impl Into<Cow<'a, [u8]>>) -> Segment<'a> {
        Segment {
            data: data.into(),
            alignment: 1,
        }
    }
}

/// Serialize `program` with `segments` as its data segments: the segment
/// table `program.segments` is replaced by the layout computed here, so
/// `segments[i]` becomes `Program.segments[i]`. The result is checked like
/// a file being read, so a program that points outside its data is an error.
pub fn serialize(program: &Program, segments: &[Segment]) -> Result<Vec<u8>> {
    let (program, layout) = checked_layout(program, segments)?;
    Ok(layout.into_bytes(&program, segments))
}

/// [`serialize`] into a file created at `path` once the program is laid
/// out and checked (an error before leaves no file), written a piece at a
/// time: the program, then each segment from its own bytes after the zeros
/// before it. The file is never whole in memory; its bytes are those
/// [`serialize`] returns. Returns their number.
pub fn serialize_to_file(program: &Program, segments: &[Segment], path: &Path) -> Result<u64> {
    let (program, layout) = checked_layout(program, segments)?;
    let io = |e| Error::io(path.display(), e);
    let mut file = std::fs::File::create(path).map_err(io)?;
    layout.write(&program, segments, &mut file).map_err(io)?;
    file.flush().map_err(io)?;
    Ok(layout.total as u64)
}

/// `program` with `segments` laid out ([`layout_segments`]), and its
/// layout, checked as a file being read.
fn checked_layout(program: &Program, segments: &[Segment]) -> Result<(Program, Layout)> {
    let mut program = program.clone();
    layout_segments(&mut program, segments)?;
    let layout = Layout::new(&program, segments)?;
    // the header the file will hold (without segment data the file is the
    // head, and its bytes tell)
    let header = match layout.header {
        Some(h) => Some(h),
        None => ExtendedHeader::parse(&layout.head)?,
    };
    verify::check(&program, header.as_ref(), layout.total).map_err(|e| e.context("serialize"))?;
    Ok((program, layout))
}

/// Set `program.segments` to ExecuTorch's layout of `segments`: back to
/// back, each start aligned to lcm(128, its alignment).
pub fn layout_segments(program: &mut Program, segments: &[Segment]) -> Result<()> {
    let mut end = 0u64;
    program.segments = Vec::with_capacity(segments.len());
    for (i, seg) in segments.iter().enumerate() {
        let too_big = || Error::limit(format!("segment {i}: segment data exceeds u64 offsets"));
        if seg.alignment == 0 {
            return Err(Error::invalid_input(format!("segment {i}: alignment is 0")));
        }
        let alignment = lcm(SEGMENT_ALIGNMENT, seg.alignment).ok_or_else(too_big)?;
        let offset = aligned_size(end, alignment).ok_or_else(too_big)?;
        let size = seg.data.len() as u64;
        program.segments.push(DataSegment { offset, size });
        end = offset.checked_add(size).ok_or_else(too_big)?;
    }
    Ok(())
}

/// Write `program` exactly as given, placing `segments[i]` at
/// `program.segments[i].offset`, without the semantic checks: for tools and
/// tests that must produce deliberately inconsistent files. The header's
/// `segment_data_size` covers the bytes actually placed.
pub fn serialize_as_is(program: &Program, segments: &[Segment]) -> Result<Vec<u8>> {
    Ok(Layout::new(program, segments)?.into_bytes(program, segments))
}

/// A `.pte` before its segments: the program (the flatbuffer with the
/// header inserted after byte 8 when there is segment data), where the
/// segments start and the file's length.
struct Layout {
    head: Vec<u8>,
    /// The inserted header, where there is segment data.
    header: Option<ExtendedHeader>,
    segment_base_offset: u64,
    total: usize,
}

impl Layout {
    fn new(program: &Program, segments: &[Segment]) -> Result<Layout> {
        if segments.len() != program.segments.len() {
            return Err(Error::invalid_input(format!(
                "{} segment buffers for {} entries in program.segments",
                segments.len(),
                program.segments.len()
            )));
        }
        let mut data_size = 0u64;
        for (seg, at) in segments.iter().zip(&program.segments) {
            let end = at.offset.checked_add(seg.data.len() as u64);
            data_size =
                data_size.max(end.ok_or_else(|| Error::limit("segment end overflows u64"))?);
        }
        let mut fbb = FlatBufferBuilder::new();
        let root = write_program(&mut fbb, program);
        fbb.finish(root, Some("ET12"));
        let flat = fbb.finished_data();
        if data_size == 0 {
            return Ok(Layout {
                head: flat.to_vec(),
                header: None,
                segment_base_offset: 0,
                total: flat.len(),
            });
        }

        // The header is padded to the flatbuffer's largest force_align (16) so
        // every offset after byte 8 keeps its alignment; 32 already is.
        let padded =
            aligned_size(u64::from(HEADER_LENGTH), TENSOR_ALIGNMENT).unwrap_or(u64::MAX) as usize;
        let program_size = (padded + flat.len()) as u64;
        let segment_base_offset = aligned_size(program_size, SEGMENT_ALIGNMENT)
            .ok_or_else(|| Error::limit("program too large for a segment base offset"))?;
        let header = ExtendedHeader {
            program_size,
            segment_base_offset,
            segment_data_size: data_size,
        };
        let total = segment_base_offset
            .checked_add(data_size)
            .and_then(|t| usize::try_from(t).ok())
            .ok_or_else(|| {
                Error::limit(format!(
                    "a .pte of {segment_base_offset} + {data_size} bytes"
                ))
            })?;

        let mut head = Vec::with_capacity(program_size as usize);
        let root = u32::from_le_bytes([flat[0], flat[1], flat[2], flat[3]]);
        let root = root
            .checked_add(padded as u32)
            .ok_or_else(|| Error::limit("flatbuffer root offset overflows with the header"))?;
        head.extend_from_slice(&root.to_le_bytes());
        head.extend_from_slice(&flat[4..HEADER_OFFSET]);
        head.extend_from_slice(&header.to_bytes());
        head.resize(HEADER_OFFSET + padded, 0);
        head.extend_from_slice(&flat[HEADER_OFFSET..]);
        Ok(Layout {
            head,
            header: Some(header),
            segment_base_offset,
            total,
        })
    }

    /// Where segment `i` starts in the file.
    fn start(&self, program: &Program, i: usize) -> usize {
        (self.segment_base_offset + program.segments[i].offset) as usize
    }

    /// The segments in the order of their offsets, where none overlaps
    /// another (as [`layout_segments`] places them).
    fn in_order(program: &Program, segments: &[Segment]) -> Option<Vec<usize>> {
        let mut order: Vec<usize> = (0..segments.len()).collect();
        order.sort_by_key(|&i| program.segments[i].offset);
        let end = |i: usize| program.segments[i].offset + segments[i].data.len() as u64;
        let disjoint = order
            .windows(2)
            .all(|p| end(p[0]) <= program.segments[p[1]].offset);
        disjoint.then_some(order)
    }

    /// The whole file in memory: segments that do not overlap written in
    /// order (no zeroing of the whole file first), overlapping ones (a
    /// deliberately inconsistent file) copied over zeros in their order.
    fn into_bytes(self, program: &Program, segments: &[Segment]) -> Vec<u8> {
        let mut out = Vec::with_capacity(self.total);
        out.extend_from_slice(&self.head);
        if self.total == self.head.len() {
            return out;
        }
        match Layout::in_order(program, segments) {
            Some(order) => {
                for i in order {
                    out.resize(self.start(program, i), 0);
                    out.extend_from_slice(&segments[i].data);
                }
                out.resize(self.total, 0);
            }
            None => {
                out.resize(self.total, 0);
                for (i, seg) in segments.iter().enumerate() {
                    let start = self.start(program, i);
                    out[start..start + seg.data.len()].copy_from_slice(&seg.data);
                }
            }
        }
        out
    }

    /// The file written to `out` a piece at a time (the whole file in
    /// memory where segments overlap).
    fn write(
        &self,
        program: &Program,
        segments: &[Segment],
        out: &mut dyn std::io::Write,
    ) -> std::io::Result<()> {
        let Some(order) = Layout::in_order(program, segments) else {
            let bytes = Layout {
                head: self.head.clone(),
                ..*self
            }
            .into_bytes(program, segments);
            return out.write_all(&bytes);
        };
        let zeros = [0u8; 4096];
        let pad = |out: &mut dyn std::io::Write, mut n: usize| -> std::io::Result<()> {
            while n > 0 {
                let step = n.min(zeros.len());
                out.write_all(&zeros[..step])?;
                n -= step;
            }
            Ok(())
        };
        out.write_all(&self.head)?;
        let mut at = self.head.len();
        if self.total == at {
            return Ok(());
        }
        for i in order {
            let start = self.start(program, i);
            pad(out, start - at)?;
            out.write_all(&segments[i].data)?;
            at = start + segments[i].data.len();
        }
        pad(out, self.total - at)
    }
}

fn gcd(a: u64, b: u64) -> u64 {
    if b == 0 {
        a
    } else {
        gcd(b, a % b)
    }
}

fn lcm(a: u64, b: u64) -> Option<u64> {
    (a / gcd(a, b)).checked_mul(b)
}

/// Constant segment bytes and `constant_segment.offsets` for `buffers`
/// (A.3 item 1): `offsets[0] = 0` is the placeholder that non-constant
/// tensors point at, each buffer but the last is padded to 16 bytes, so
/// constant `i` is `data_buffer_idx = i + 1`.
pub fn constant_segment(buffers: &[&[u8]]) -> (Vec<u8>, Vec<u64>) {
    let mut data = Vec::new();
    let mut offsets = vec![0u64];
    for (i, b) in buffers.iter().enumerate() {
        offsets.push(data.len() as u64);
        data.extend_from_slice(b);
        if i + 1 < buffers.len() {
            data.resize(data.len().next_multiple_of(TENSOR_ALIGNMENT as usize), 0);
        }
    }
    (data, offsets)
}

/// Add named data `key` (A.3 item 4): identical bytes share one segment.
/// Returns the segment index. A key already present is an error.
pub fn add_named_data<'a>(
    program: &mut Program,
    segments: &mut Vec<Segment<'a>>,
    key: &str,
    data: impl Into<Cow<'a, [u8]>>,
    alignment: u64,
) -> Result<u32> {
    if program.named_data.iter().any(|n| n.key == key) {
        return Err(Error::invalid_input(format!(
            "named data `{key}` is already in the program"
        )));
    }
    let data = data.into();
    let named: Vec<u32> = program.named_data.iter().map(|n| n.segment_index).collect();
    let existing = named
        .into_iter()
        .find(|&i| segments.get(i as usize).is_some_and(|s| s.data == data));
    let index = match existing {
        Some(i) => i,
        None => {
            let i = u32::try_from(segments.len())
                .map_err(|_| Error::limit("more than u32::MAX segments"))?;
            segments.push(Segment { data, alignment });
            i
        }
    };
    program.named_data.push(NamedData {
        key: key.to_owned(),
        segment_index: index,
    });
    Ok(index)
}

type Off = WIPOffset<TableFinishedWIPOffset>;

/// A byte with 16-byte vector alignment: the schema's `force_align: 16`.
struct Aligned16(u8);

impl Push for Aligned16 {
    type Output = u8;
    unsafe fn push(&self, dst: &mut [u8], _written_len: usize) {
        dst[0] = self.0;
    }
    fn alignment() -> PushAlignment {
        PushAlignment::new(TENSOR_ALIGNMENT as usize)
    }
}

fn aligned_bytes(
    fbb: &mut FlatBufferBuilder,
    bytes: &[u8],
) -> WIPOffset<flatbuffers::UnionWIPOffset> {
    let items: Vec<Aligned16> = bytes.iter().map(|&b| Aligned16(b)).collect();
    fbb.create_vector(&items).as_union_value()
}

/// Build a table from already-written children.
fn table(fbb: &mut FlatBufferBuilder, fields: impl FnOnce(&mut FlatBufferBuilder)) -> Off {
    let start = fbb.start_table();
    fields(fbb);
    fbb.end_table(start)
}

fn tables<T>(
    fbb: &mut FlatBufferBuilder,
    items: &[T],
    write: impl Fn(&mut FlatBufferBuilder, &T) -> Off,
) -> WIPOffset<flatbuffers::UnionWIPOffset> {
    let offs: Vec<Off> = items.iter().map(|i| write(fbb, i)).collect();
    fbb.create_vector(&offs).as_union_value()
}

fn string(fbb: &mut FlatBufferBuilder, s: &str) -> WIPOffset<flatbuffers::UnionWIPOffset> {
    fbb.create_string(s).as_union_value()
}

fn scalars<T: Push<Output = T> + Copy + 'static>(
    fbb: &mut FlatBufferBuilder,
    items: &[T],
) -> WIPOffset<flatbuffers::UnionWIPOffset> {
    fbb.create_vector(items).as_union_value()
}

fn write_program(fbb: &mut FlatBufferBuilder, p: &Program) -> Off {
    let plans = tables(fbb, &p.execution_plan, write_plan);
    let constant_buffer = tables(fbb, &p.constant_buffer, |fbb, b| {
        let v = aligned_bytes(fbb, &b.storage);
        table(fbb, |fbb| fbb.push_slot_always(slot(0), v))
    });
    let delegate_data = tables(fbb, &p.backend_delegate_data, |fbb, b| {
        let v = aligned_bytes(fbb, &b.data);
        table(fbb, |fbb| fbb.push_slot_always(slot(0), v))
    });
    let segments = tables(fbb, &p.segments, |fbb, s| {
        table(fbb, |fbb| {
            fbb.push_slot(slot(0), s.offset, 0);
            fbb.push_slot(slot(1), s.size, 0);
        })
    });
    let constant_segment = p
        .constant_segment
        .as_ref()
        .map(|s| write_subsegment(fbb, s));
    let mutable = tables(fbb, &p.mutable_data_segments, write_subsegment);
    let named = tables(fbb, &p.named_data, |fbb, n| {
        let key = string(fbb, &n.key);
        table(fbb, |fbb| {
            fbb.push_slot_always(slot(0), key);
            fbb.push_slot(slot(1), n.segment_index, 0);
        })
    });
    table(fbb, |fbb| {
        fbb.push_slot(slot(0), p.version, 0);
        fbb.push_slot_always(slot(1), plans);
        fbb.push_slot_always(slot(2), constant_buffer);
        fbb.push_slot_always(slot(3), delegate_data);
        fbb.push_slot_always(slot(4), segments);
        if let Some(c) = constant_segment {
            fbb.push_slot_always(slot(5), c);
        }
        fbb.push_slot_always(slot(6), mutable);
        fbb.push_slot_always(slot(7), named);
    })
}

fn write_subsegment(fbb: &mut FlatBufferBuilder, s: &SubsegmentOffsets) -> Off {
    let offsets = scalars(fbb, &s.offsets);
    table(fbb, |fbb| {
        fbb.push_slot(slot(0), s.segment_index, 0);
        fbb.push_slot_always(slot(1), offsets);
    })
}

fn write_plan(fbb: &mut FlatBufferBuilder, p: &ExecutionPlan) -> Off {
    let name = string(fbb, &p.name);
    let meta = p.container_meta_type.as_ref().map(|c| {
        let inp = string(fbb, &c.encoded_inp_str);
        let out = string(fbb, &c.encoded_out_str);
        table(fbb, |fbb| {
            fbb.push_slot_always(slot(0), inp);
            fbb.push_slot_always(slot(1), out);
        })
    });
    let values = tables(fbb, &p.values, write_value);
    let inputs = scalars(fbb, &p.inputs);
    let outputs = scalars(fbb, &p.outputs);
    let chains = tables(fbb, &p.chains, write_chain);
    let operators = tables(fbb, &p.operators, |fbb, o| {
        let name = string(fbb, &o.name);
        let overload = string(fbb, &o.overload);
        table(fbb, |fbb| {
            fbb.push_slot_always(slot(0), name);
            fbb.push_slot_always(slot(1), overload);
        })
    });
    let delegates = tables(fbb, &p.delegates, write_delegate);
    let sizes = scalars(fbb, &p.non_const_buffer_sizes);
    let devices = p.non_const_buffer_device.as_ref().map(|d| {
        tables(fbb, d, |fbb, d| {
            table(fbb, |fbb| {
                fbb.push_slot(slot(0), d.buffer_idx, 0);
                fbb.push_slot(slot(1), d.device_type as i8, 0);
                fbb.push_slot(slot(2), d.device_index, 0);
            })
        })
    });
    table(fbb, |fbb| {
        fbb.push_slot_always(slot(0), name);
        if let Some(m) = meta {
            fbb.push_slot_always(slot(1), m);
        }
        fbb.push_slot_always(slot(2), values);
        fbb.push_slot_always(slot(3), inputs);
        fbb.push_slot_always(slot(4), outputs);
        fbb.push_slot_always(slot(5), chains);
        fbb.push_slot_always(slot(6), operators);
        fbb.push_slot_always(slot(7), delegates);
        fbb.push_slot_always(slot(8), sizes);
        if let Some(d) = devices {
            fbb.push_slot_always(slot(9), d);
        }
    })
}

/// A table with one vector field in slot 0 (the list members of KernelTypes).
fn list<T: Push<Output = T> + Copy + 'static>(fbb: &mut FlatBufferBuilder, items: &[T]) -> Off {
    let v = scalars(fbb, items);
    table(fbb, |fbb| fbb.push_slot_always(slot(0), v))
}

fn write_value(fbb: &mut FlatBufferBuilder, v: &EValue) -> Off {
    let val = match v {
        EValue::Null => table(fbb, |_| {}),
        EValue::Int(i) => table(fbb, |fbb| fbb.push_slot(slot(0), *i, 0)),
        EValue::Bool(b) => table(fbb, |fbb| fbb.push_slot(slot(0), *b, false)),
        EValue::Double(d) => table(fbb, |fbb| fbb.push_slot_always(slot(0), *d)),
        EValue::Tensor(t) => write_tensor(fbb, t),
        EValue::String(s) => {
            let s = string(fbb, s);
            table(fbb, |fbb| fbb.push_slot_always(slot(0), s))
        }
        EValue::IntList(items) => list(fbb, items),
        EValue::DoubleList(items) => list(fbb, items),
        EValue::BoolList(items) => list(fbb, items),
        EValue::TensorList(items) | EValue::OptionalTensorList(items) => list(fbb, items),
    };
    table(fbb, |fbb| {
        fbb.push_slot(slot(0), v.kernel_type(), 0);
        fbb.push_slot_always(slot(1), val);
    })
}

fn write_tensor(fbb: &mut FlatBufferBuilder, t: &Tensor) -> Off {
    let sizes = scalars(fbb, &t.sizes);
    let dim_order = scalars(fbb, &t.dim_order);
    let alloc = t.allocation_info.map(|a| {
        table(fbb, |fbb| {
            fbb.push_slot(slot(0), a.memory_id, 0);
            fbb.push_slot(slot(1), a.memory_offset_low, 0);
            fbb.push_slot(slot(2), a.memory_offset_high, 0);
        })
    });
    let extra = t.extra_tensor_info.as_ref().map(|e| {
        let fqn = string(fbb, &e.fully_qualified_name);
        table(fbb, |fbb| {
            fbb.push_slot(slot(0), e.mutable_data_segments_idx, 0);
            fbb.push_slot_always(slot(1), fqn);
            fbb.push_slot(slot(2), e.location as i8, 0);
            fbb.push_slot(slot(3), e.device_type as i8, 0);
            fbb.push_slot(slot(4), e.device_index, 0);
        })
    });
    table(fbb, |fbb| {
        fbb.push_slot(slot(0), t.scalar_type.executorch_code(), 0);
        fbb.push_slot(slot(1), t.storage_offset, 0);
        fbb.push_slot_always(slot(2), sizes);
        fbb.push_slot_always(slot(3), dim_order);
        fbb.push_slot(slot(4), t.requires_grad, false);
        fbb.push_slot(slot(5), t.data_buffer_idx, 0);
        if let Some(a) = alloc {
            fbb.push_slot_always(slot(6), a);
        }
        fbb.push_slot(slot(7), t.layout, 0);
        fbb.push_slot(slot(8), t.shape_dynamism as i8, 0);
        if let Some(e) = extra {
            fbb.push_slot_always(slot(9), e);
        }
    })
}

fn write_chain(fbb: &mut FlatBufferBuilder, c: &Chain) -> Off {
    let inputs = scalars(fbb, &c.inputs);
    let outputs = scalars(fbb, &c.outputs);
    let instructions = tables(fbb, &c.instructions, write_instruction);
    let stacktrace = c.stacktrace.as_ref().map(|s| {
        tables(fbb, s, |fbb, list| {
            let items = tables(fbb, &list.items, |fbb, f| {
                let filename = string(fbb, &f.filename);
                let name = string(fbb, &f.name);
                let context = string(fbb, &f.context);
                table(fbb, |fbb| {
                    fbb.push_slot_always(slot(0), filename);
                    fbb.push_slot(slot(1), f.lineno, 0);
                    fbb.push_slot_always(slot(2), name);
                    fbb.push_slot_always(slot(3), context);
                })
            });
            table(fbb, |fbb| fbb.push_slot_always(slot(0), items))
        })
    });
    table(fbb, |fbb| {
        fbb.push_slot_always(slot(0), inputs);
        fbb.push_slot_always(slot(1), outputs);
        fbb.push_slot_always(slot(2), instructions);
        if let Some(s) = stacktrace {
            fbb.push_slot_always(slot(3), s);
        }
    })
}

/// A call table: an index (slot 0) and value-index args (slot 1).
fn call(fbb: &mut FlatBufferBuilder, index: i32, args: &[i32]) -> Off {
    let args = scalars(fbb, args);
    table(fbb, |fbb| {
        fbb.push_slot(slot(0), index, 0);
        fbb.push_slot_always(slot(1), args);
    })
}

/// A table of two i32 fields (MoveCall, JumpFalseCall).
fn pair(fbb: &mut FlatBufferBuilder, a: i32, b: i32) -> Off {
    table(fbb, |fbb| {
        fbb.push_slot(slot(0), a, 0);
        fbb.push_slot(slot(1), b, 0);
    })
}

fn write_instruction(fbb: &mut FlatBufferBuilder, i: &Instruction) -> Off {
    let args = match i {
        Instruction::KernelCall(k) => call(fbb, k.op_index, &k.args),
        Instruction::DelegateCall(d) => call(fbb, d.delegate_index, &d.args),
        Instruction::MoveCall(m) => pair(fbb, m.move_from, m.move_to),
        Instruction::JumpFalseCall(j) => pair(fbb, j.cond_value_index, j.destination_instruction),
        Instruction::FreeCall(f) => table(fbb, |fbb| fbb.push_slot(slot(0), f.value_index, 0)),
    };
    table(fbb, |fbb| {
        fbb.push_slot(slot(0), i.arguments_type(), 0);
        fbb.push_slot_always(slot(1), args);
    })
}

fn write_delegate(fbb: &mut FlatBufferBuilder, d: &BackendDelegate) -> Off {
    let id = string(fbb, &d.id);
    let processed = table(fbb, |fbb| {
        fbb.push_slot(slot(0), d.processed.location as i8, 0);
        fbb.push_slot(slot(1), d.processed.index, 0);
    });
    let specs = tables(fbb, &d.compile_specs, |fbb, c| {
        let key = string(fbb, &c.key);
        let value = scalars(fbb, &c.value);
        table(fbb, |fbb| {
            fbb.push_slot_always(slot(0), key);
            fbb.push_slot_always(slot(1), value);
        })
    });
    table(fbb, |fbb| {
        fbb.push_slot_always(slot(0), id);
        fbb.push_slot_always(slot(1), processed);
        fbb.push_slot_always(slot(2), specs);
    })
}
