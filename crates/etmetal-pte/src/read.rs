//! Read a `.pte` file: identifier, extended header, verified flatbuffer,
//! decoded into the owned [`Program`], then checked by [`crate::verify`].
//! Segment bytes stay in the file buffer (a memory map for [`PteFile::load`]).

use std::ops::Range;
use std::path::Path;
use std::sync::Arc;

use etmetal_core::{DType, Error, Result};
use flatbuffers::{Follow, ForwardsUOffset, Vector};

use crate::fb::{self, InstructionArgumentsView, KernelTypesView, View};
use crate::header::{ExtendedHeader, FILE_IDENTIFIER};
use crate::schema::*;
use crate::verify;
use crate::write::Segment;

/// Bytes shared with tensors that borrow from the file.
pub type SharedBytes = Arc<dyn AsRef<[u8]> + Send + Sync>;

/// A parsed and verified program with its file bytes.
pub struct PteFile {
    pub program: Program,
    pub header: Option<ExtendedHeader>,
    data: SharedBytes,
    /// The file mapping behind `data`, for [`PteFile::release`].
    map: Option<Arc<memmap2::Mmap>>,
}

impl std::fmt::Debug for PteFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PteFile")
            .field("bytes", &self.bytes().len())
            .field("header", &self.header)
            .finish_non_exhaustive()
    }
}

/// Parse and verify a `.pte` held in memory (the bytes are copied).
pub fn parse(bytes: &[u8]) -> Result<PteFile> {
    PteFile::from_shared(Arc::new(bytes.to_vec()))
}

impl PteFile {
    /// Memory-map and parse a `.pte`; segment data is borrowed from the map.
    pub fn load(path: impl AsRef<Path>) -> Result<PteFile> {
        let path = path.as_ref();
        let file = std::fs::File::open(path).map_err(|e| Error::io(path.display(), e))?;
        // SAFETY: the map is read-only; like every mmap reader we rely on the
        // file not being truncated or rewritten while it is loaded.
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| Error::io(path.display(), e))?;
        let map = Arc::new(map);
        let mut pte =
            PteFile::from_shared(map.clone()).map_err(|e| e.context(path.display().to_string()))?;
        pte.map = Some(map);
        Ok(pte)
    }

    /// Give the pages of `bytes` (a part of this file, e.g. named data a
    /// delegate has uploaded to its GPU) back to the system, so that they
    /// leave the process's resident memory; a later read maps them in again
    /// from the file. Only for a mapped file (else, and for bytes outside
    /// the file, nothing happens): a weight is then held once, on its
    /// device, not also in the page-cache pages of this process.
    #[cfg(unix)]
    pub fn release(&self, bytes: &[u8]) {
        let Some(map) = &self.map else { return };
        let base = map.as_ptr() as usize;
        let start = bytes.as_ptr() as usize;
        if start < base || start + bytes.len() > base + map.len() {
            return;
        }
        // Whole pages inside `bytes` only: 64 KiB is a multiple of every
        // page size in use (4 KiB, Apple's 16 KiB), and the map is page-aligned.
        const PAGE: usize = 64 << 10;
        let (from, to) = (
            (start - base).next_multiple_of(PAGE),
            start - base + bytes.len(),
        );
        let to = to - to % PAGE;
        if to > from {
            // SAFETY: the map is read-only, so dropped pages are read again
            // from the file: no content is lost and borrows of it stay valid.
            // (`DontNeed` is unchecked because on a written private map it
            // would lose the writes.)
            let _ = unsafe {
                map.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, from, to - from)
            };
        }
    }

    /// Elsewhere the pages stay (no `madvise`).
    #[cfg(not(unix))]
    pub fn release(&self, _bytes: &[u8]) {}

    /// Parse and verify bytes that tensors may go on sharing.
    pub fn from_shared(data: SharedBytes) -> Result<PteFile> {
        let (program, header) = parse_program((*data).as_ref())?;
        Ok(PteFile {
            program,
            header,
            data,
            map: None,
        })
    }

    /// The whole file.
    pub fn bytes(&self) -> &[u8] {
        (*self.data).as_ref()
    }

    /// The file bytes as a shareable handle (for `Tensor::from_shared`).
    pub fn shared_bytes(&self) -> SharedBytes {
        self.data.clone()
    }

    /// Absolute file range of `segments[index]` (checked at load).
    pub fn segment_range(&self, index: usize) -> Result<Range<usize>> {
        let base = self.header.map_or(0, |h| h.segment_base_offset);
        verify::segment_range(&self.program, base, self.bytes().len(), index)
    }

    /// Every segment's bytes, borrowed, at the default alignment: what
    /// [`crate::serialize`] takes to write this program again.
    pub fn segments(&self) -> Result<Vec<Segment<'_>>> {
        (0..self.program.segments.len())
            .map(|i| Ok(Segment::new(self.segment(i)?)))
            .collect()
    }

    pub fn segment(&self, index: usize) -> Result<&[u8]> {
        let range = self.segment_range(index)?;
        Ok(&self.bytes()[range])
    }

    /// The bytes of named data `key`.
    pub fn named_data(&self, key: &str) -> Result<&[u8]> {
        let entry = self
            .program
            .named_data
            .iter()
            .find(|n| n.key == key)
            .ok_or_else(|| {
                Error::invalid_input(format!("named data `{key}` is not in the program"))
            })?;
        self.segment(entry.segment_index as usize)
    }

    /// The processed payload of `execution_plan[plan].delegates[delegate]`.
    pub fn delegate_data(&self, plan: usize, delegate: usize) -> Result<&[u8]> {
        let d = self
            .program
            .execution_plan
            .get(plan)
            .and_then(|p| p.delegates.get(delegate))
            .ok_or_else(|| {
                Error::invalid_input(format!("no delegate {delegate} in execution plan {plan}"))
            })?;
        let index = d.processed.index as usize;
        match d.processed.location {
            DataLocation::Segment => self.segment(index),
            DataLocation::Inline => self
                .program
                .backend_delegate_data
                .get(index)
                .map(|b| b.data.as_slice())
                .ok_or_else(|| {
                    Error::format(format!("inline delegate data {index} does not exist"))
                }),
        }
    }

    /// The stored data of constant tensor `execution_plan[plan].values[value]`,
    /// borrowed from the file (or copied from the deprecated inline buffers).
    pub fn constant_tensor(&self, plan: usize, value: usize) -> Result<etmetal_core::Tensor> {
        let where_ = format!("execution_plan[{plan}].values[{value}]");
        let t = match self
            .program
            .execution_plan
            .get(plan)
            .and_then(|p| p.values.get(value))
        {
            Some(EValue::Tensor(t)) => t,
            _ => return Err(Error::invalid_input(format!("{where_} is not a tensor"))),
        };
        let shape: Vec<usize> = t.sizes.iter().map(|&s| s as usize).collect();
        let idx = t.data_buffer_idx as usize;
        if idx == 0 || t.allocation_info.is_some() {
            return Err(Error::invalid_input(format!(
                "{where_} is not a constant tensor"
            )));
        }
        if !self.program.constant_buffer.is_empty() {
            let storage = &self.program.constant_buffer.get(idx).ok_or_else(|| {
                Error::format(format!("{where_}: constant buffer {idx} does not exist"))
            })?;
            let len = verify::tensor_nbytes(t, &where_)? as usize;
            let bytes = storage.storage.get(..len).ok_or_else(|| {
                Error::format(format!(
                    "{where_}: constant buffer {idx} is shorter than {len} bytes"
                ))
            })?;
            return etmetal_core::Tensor::from_bytes(t.scalar_type, &shape, bytes);
        }
        let seg = self.program.constant_segment.as_ref().ok_or_else(|| {
            Error::format(format!(
                "{where_}: constant tensor but the program has no constant segment"
            ))
        })?;
        let offset = *seg.offsets.get(idx).ok_or_else(|| {
            Error::format(format!("{where_}: constant offset {idx} does not exist"))
        })?;
        let start = self.segment_range(seg.segment_index as usize)?.start;
        etmetal_core::Tensor::from_shared(
            t.scalar_type,
            &shape,
            self.shared_bytes(),
            start + offset as usize,
        )
        .map_err(|e| e.context(where_))
    }
}

/// Parse and verify a whole file image into its program and header.
pub fn parse_program(file: &[u8]) -> Result<(Program, Option<ExtendedHeader>)> {
    if file.len() < 8 {
        return Err(Error::format(format!(
            "file is {} bytes, shorter than the 8-byte flatbuffer prefix",
            file.len()
        )));
    }
    let ident = &file[4..8];
    if ident != FILE_IDENTIFIER {
        let hint = if ident.starts_with(b"ET") {
            " (another ExecuTorch schema version)"
        } else {
            ""
        };
        return Err(Error::format(format!(
            "file identifier is {:?}, expected \"ET12\"{hint}",
            String::from_utf8_lossy(ident)
        )));
    }
    let header = ExtendedHeader::parse(file)?;
    let program_bytes = match header {
        Some(h) => &file[..h.program_size as usize],
        None => file,
    };
    let root = fb::root(program_bytes)
        .map_err(|e| Error::format(format!("program flatbuffer does not verify: {e}")))?;
    // Before decoding: a newer schema may use tags this reader does not know.
    verify::check_version(root.version().unwrap_or(0))?;
    let program = decode_program(root)?;
    verify::check(&program, header.as_ref(), file.len())?;
    Ok((program, header))
}

fn string(s: Option<&str>) -> String {
    s.unwrap_or_default().to_owned()
}

fn scalars<'a, T: Follow<'a> + 'a>(v: Option<Vector<'a, T>>) -> Vec<T::Inner> {
    v.map(|v| v.iter().collect()).unwrap_or_default()
}

/// Decode every table of a vector, naming each one `path[i]` for errors.
fn tables<'a, M, R>(
    v: Option<Vector<'a, ForwardsUOffset<M>>>,
    path: &str,
    decode: impl Fn(View<'a, M>, &str) -> Result<R>,
) -> Result<Vec<R>>
where
    M: 'a + Follow<'a, Inner = View<'a, M>>,
{
    let Some(v) = v else { return Ok(Vec::new()) };
    v.iter()
        .enumerate()
        .map(|(i, t)| decode(t, &format!("{path}[{i}]")))
        .collect()
}

fn known_enum<T>(
    value: Option<i8>,
    parse: fn(i8) -> Option<T>,
    what: &str,
    path: &str,
) -> Result<T> {
    let value = value.unwrap_or(0);
    parse(value).ok_or_else(|| Error::format(format!("{path}: unknown {what} {value}")))
}

fn decode_program(p: View<'_, fb::ProgramT>) -> Result<Program> {
    Ok(Program {
        version: p.version().unwrap_or(0),
        execution_plan: tables(p.execution_plan(), "execution_plan", decode_plan)?,
        constant_buffer: tables(p.constant_buffer(), "constant_buffer", |b, _| {
            Ok(Buffer {
                storage: scalars(b.storage()),
            })
        })?,
        backend_delegate_data: tables(
            p.backend_delegate_data(),
            "backend_delegate_data",
            |b, _| {
                Ok(BackendDelegateInlineData {
                    data: scalars(b.data()),
                })
            },
        )?,
        segments: tables(p.segments(), "segments", |s, _| {
            Ok(DataSegment {
                offset: s.offset().unwrap_or(0),
                size: s.size().unwrap_or(0),
            })
        })?,
        constant_segment: p.constant_segment().map(decode_subsegment),
        mutable_data_segments: tables(
            p.mutable_data_segments(),
            "mutable_data_segments",
            |s, _| Ok(decode_subsegment(s)),
        )?,
        named_data: tables(p.named_data(), "named_data", |n, _| {
            Ok(NamedData {
                key: string(n.key()),
                segment_index: n.segment_index().unwrap_or(0),
            })
        })?,
    })
}

fn decode_subsegment(s: View<'_, fb::SubsegmentOffsetsT>) -> SubsegmentOffsets {
    SubsegmentOffsets {
        segment_index: s.segment_index().unwrap_or(0),
        offsets: scalars(s.offsets()),
    }
}

fn decode_plan(p: View<'_, fb::ExecutionPlanT>, path: &str) -> Result<ExecutionPlan> {
    Ok(ExecutionPlan {
        name: string(p.name()),
        container_meta_type: p.container_meta_type().map(|c| ContainerMetadata {
            encoded_inp_str: string(c.encoded_inp_str()),
            encoded_out_str: string(c.encoded_out_str()),
        }),
        values: tables(p.values(), &format!("{path}.values"), decode_value)?,
        inputs: scalars(p.inputs()),
        outputs: scalars(p.outputs()),
        chains: tables(p.chains(), &format!("{path}.chains"), decode_chain)?,
        operators: tables(p.operators(), &format!("{path}.operators"), |o, _| {
            Ok(Operator {
                name: string(o.name()),
                overload: string(o.overload()),
            })
        })?,
        delegates: tables(p.delegates(), &format!("{path}.delegates"), decode_delegate)?,
        non_const_buffer_sizes: scalars(p.non_const_buffer_sizes()),
        non_const_buffer_device: p
            .non_const_buffer_device()
            .map(|v| {
                tables(
                    Some(v),
                    &format!("{path}.non_const_buffer_device"),
                    |d, path| {
                        Ok(NonConstBufferDevice {
                            buffer_idx: d.buffer_idx().unwrap_or(0),
                            device_type: known_enum(
                                d.device_type(),
                                DeviceType::from_i8,
                                "device type",
                                path,
                            )?,
                            device_index: d.device_index().unwrap_or(0),
                        })
                    },
                )
            })
            .transpose()?,
    })
}

fn decode_value(v: View<'_, fb::EValueT>, path: &str) -> Result<EValue> {
    Ok(match v.value() {
        KernelTypesView::None => {
            return Err(Error::format(format!("{path}: value has no type (NONE)")))
        }
        KernelTypesView::Unknown(tag) => {
            return Err(Error::format(format!(
                "{path}: unknown KernelTypes tag {tag}"
            )))
        }
        KernelTypesView::Null(_) => EValue::Null,
        KernelTypesView::Int(i) => EValue::Int(i.int_val().unwrap_or(0)),
        KernelTypesView::Bool(b) => EValue::Bool(b.bool_val().unwrap_or(false)),
        KernelTypesView::Double(d) => EValue::Double(d.double_val().unwrap_or(0.0)),
        KernelTypesView::Tensor(t) => EValue::Tensor(decode_tensor(t, path)?),
        KernelTypesView::String(s) => EValue::String(string(s.string_val())),
        KernelTypesView::IntList(l) => EValue::IntList(scalars(l.items())),
        KernelTypesView::DoubleList(l) => EValue::DoubleList(scalars(l.items())),
        KernelTypesView::BoolList(l) => EValue::BoolList(scalars(l.items())),
        KernelTypesView::TensorList(l) => EValue::TensorList(scalars(l.items())),
        KernelTypesView::OptionalTensorList(l) => EValue::OptionalTensorList(scalars(l.items())),
    })
}

fn decode_tensor(t: View<'_, fb::TensorT>, path: &str) -> Result<Tensor> {
    let code = t.scalar_type().unwrap_or(0);
    let scalar_type =
        DType::from_executorch(code).map_err(|e| e.context(format!("{path}: tensor")))?;
    Ok(Tensor {
        scalar_type,
        storage_offset: t.storage_offset().unwrap_or(0),
        sizes: scalars(t.sizes()),
        dim_order: scalars(t.dim_order()),
        requires_grad: t.requires_grad().unwrap_or(false),
        data_buffer_idx: t.data_buffer_idx().unwrap_or(0),
        allocation_info: t.allocation_info().map(|a| AllocationDetails {
            memory_id: a.memory_id().unwrap_or(0),
            memory_offset_low: a.memory_offset_low().unwrap_or(0),
            memory_offset_high: a.memory_offset_high().unwrap_or(0),
        }),
        layout: t.layout().unwrap_or(0),
        shape_dynamism: known_enum(
            t.shape_dynamism(),
            TensorShapeDynamism::from_i8,
            "shape dynamism",
            path,
        )?,
        extra_tensor_info: t
            .extra_tensor_info()
            .map(|e| -> Result<ExtraTensorInfo> {
                Ok(ExtraTensorInfo {
                    mutable_data_segments_idx: e.mutable_data_segments_idx().unwrap_or(0),
                    fully_qualified_name: string(e.fully_qualified_name()),
                    location: known_enum(
                        e.location(),
                        TensorDataLocation::from_i8,
                        "tensor data location",
                        path,
                    )?,
                    device_type: known_enum(
                        e.device_type(),
                        DeviceType::from_i8,
                        "device type",
                        path,
                    )?,
                    device_index: e.device_index().unwrap_or(0),
                })
            })
            .transpose()?,
    })
}

fn decode_chain(c: View<'_, fb::ChainT>, path: &str) -> Result<Chain> {
    Ok(Chain {
        inputs: scalars(c.inputs()),
        outputs: scalars(c.outputs()),
        instructions: tables(
            c.instructions(),
            &format!("{path}.instructions"),
            decode_instruction,
        )?,
        stacktrace: c
            .stacktrace()
            .map(|v| {
                tables(Some(v), &format!("{path}.stacktrace"), |l, path| {
                    Ok(FrameList {
                        items: tables(l.items(), &format!("{path}.items"), |f, _| {
                            Ok(Frame {
                                filename: string(f.filename()),
                                lineno: f.lineno().unwrap_or(0),
                                name: string(f.name()),
                                context: string(f.context()),
                            })
                        })?,
                    })
                })
            })
            .transpose()?,
    })
}

fn decode_instruction(i: View<'_, fb::InstructionT>, path: &str) -> Result<Instruction> {
    Ok(match i.value() {
        InstructionArgumentsView::None => {
            return Err(Error::format(format!(
                "{path}: instruction has no arguments (NONE)"
            )))
        }
        InstructionArgumentsView::Unknown(tag) => {
            return Err(Error::format(format!(
                "{path}: unknown InstructionArguments tag {tag}"
            )))
        }
        InstructionArgumentsView::KernelCall(k) => Instruction::KernelCall(KernelCall {
            op_index: k.op_index().unwrap_or(0),
            args: scalars(k.args()),
        }),
        InstructionArgumentsView::DelegateCall(d) => Instruction::DelegateCall(DelegateCall {
            delegate_index: d.delegate_index().unwrap_or(0),
            args: scalars(d.args()),
        }),
        InstructionArgumentsView::MoveCall(m) => Instruction::MoveCall(MoveCall {
            move_from: m.move_from().unwrap_or(0),
            move_to: m.move_to().unwrap_or(0),
        }),
        InstructionArgumentsView::JumpFalseCall(j) => Instruction::JumpFalseCall(JumpFalseCall {
            cond_value_index: j.cond_value_index().unwrap_or(0),
            destination_instruction: j.destination_instruction().unwrap_or(0),
        }),
        InstructionArgumentsView::FreeCall(f) => Instruction::FreeCall(FreeCall {
            value_index: f.value_index().unwrap_or(0),
        }),
    })
}

fn decode_delegate(d: View<'_, fb::BackendDelegateT>, path: &str) -> Result<BackendDelegate> {
    let processed = match d.processed() {
        Some(r) => BackendDelegateDataReference {
            location: known_enum(
                r.location(),
                DataLocation::from_i8,
                "delegate data location",
                path,
            )?,
            index: r.index().unwrap_or(0),
        },
        None => {
            return Err(Error::format(format!(
                "{path}: delegate has no processed data reference"
            )))
        }
    };
    Ok(BackendDelegate {
        id: string(d.id()),
        processed,
        compile_specs: tables(
            d.compile_specs(),
            &format!("{path}.compile_specs"),
            |c, _| {
                Ok(CompileSpec {
                    key: string(c.key()),
                    value: scalars(c.value()),
                })
            },
        )?,
    })
}
