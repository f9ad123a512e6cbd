//! Writes the malformed-file corpus `tests/malformed/{pte,pt2,payload}/`
//! and its `MANIFEST.tsv` (file, expected `ErrorKind`, a substring the
//! message must contain), from the valid fixture `tests/fixtures/mlp.pt2`
//! (compiled to `.pte` here) and a small valid delegate payload. The output
//! depends only on the fixtures and this code, so re-running it changes
//! nothing (`git diff --exit-code tests/malformed` checks that).
//!
//! `cargo run -p etmetal --example make_malformed`

use std::io::{Cursor, Read, Write};
use std::path::{Path, PathBuf};

use etmetal_core::DType;
use etmetal_metal::payload::{Access, Buffer, Dispatch, Kernel, Location, Payload, Requirements};
use etmetal_pte::{
    serialize_as_is, DataSegment, EValue, Instruction, JumpFalseCall, KernelCall, Program, Segment,
    Tensor,
};
use serde_json::{json, Value};

struct Case {
    file: String,
    bytes: Vec<u8>,
    kind: &'static str,
    want: String,
}

#[derive(Default)]
struct Corpus {
    cases: Vec<Case>,
}

impl Corpus {
    fn add(&mut self, file: &str, bytes: Vec<u8>, kind: &'static str, want: impl Into<String>) {
        self.cases.push(Case {
            file: file.to_string(),
            bytes,
            kind,
            want: want.into(),
        });
    }
}

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

// ---------------------------------------------------------------- .pte

/// The fixture program, and a way to write a mutated copy unchecked.
struct Pte {
    bytes: Vec<u8>,
    program: Program,
    segments: Vec<Vec<u8>>,
}

impl Pte {
    fn new(bytes: Vec<u8>) -> Pte {
        let file = etmetal_pte::parse(&bytes).expect("the fixture .pte parses");
        let segments = (0..file.program.segments.len())
            .map(|i| file.segment(i).expect("fixture segment").to_vec())
            .collect();
        Pte {
            program: file.program.clone(),
            bytes,
            segments,
        }
    }

    fn mutated(&self, mutate: impl FnOnce(&mut Program)) -> Vec<u8> {
        let mut p = self.program.clone();
        mutate(&mut p);
        // Segments a mutation adds hold zeros.
        let added: Vec<Vec<u8>> = p.segments[self.segments.len().min(p.segments.len())..]
            .iter()
            .map(|s| vec![0; s.size as usize])
            .collect();
        let segments: Vec<Segment> = self
            .segments
            .iter()
            .chain(&added)
            .map(|s| Segment::new(&s[..]))
            .collect();
        serialize_as_is(&p, &segments).expect("serialize_as_is writes any program")
    }

    /// The header field at `at` (u64) replaced.
    fn patched_u64(&self, at: usize, value: u64) -> Vec<u8> {
        let mut b = self.bytes.clone();
        b[at..at + 8].copy_from_slice(&value.to_le_bytes());
        b
    }
}

fn tensor(p: &mut Program, value: usize) -> &mut Tensor {
    match &mut p.execution_plan[0].values[value] {
        EValue::Tensor(t) => t,
        other => panic!("fixture value {value} is {other:?}, not a tensor"),
    }
}

/// A value index of the fixture that is a tensor with constant data.
fn first_constant(p: &Program) -> usize {
    p.execution_plan[0]
        .values
        .iter()
        .position(|v| matches!(v, EValue::Tensor(t) if t.data_buffer_idx > 0))
        .expect("the fixture has constants")
}

/// Bytes of a program whose one tensor's scalar type code is `code`: two
/// writes that differ only in the type locate the byte to patch.
fn with_scalar_type_code(pte: &Pte, code: u8) -> Vec<u8> {
    let v = first_constant(&pte.program);
    let write = |dtype| {
        pte.mutated(|p| {
            tensor(p, v).scalar_type = dtype;
            // same byte size, so nothing else in the file moves
        })
    };
    let (a, b) = (write(DType::F32), write(DType::I32));
    let diff: Vec<usize> = (0..a.len()).filter(|&i| a[i] != b[i]).collect();
    assert_eq!(a.len(), b.len());
    assert_eq!(diff.len(), 1, "scalar types differ in one byte");
    let mut out = a;
    out[diff[0]] = code;
    out
}

fn pte_cases(c: &mut Corpus) {
    let pt2 = root().join("tests/fixtures/mlp.pt2");
    let pte = Pte::new(etmetal::compile::compile_pt2_cpu(&pt2).expect("mlp.pt2 compiles"));
    for part in [
        truncated_or_foreign,
        header_fields,
        segment_table,
        indices_out_of_range,
        tensor_metadata,
        chain_instructions,
        resource_limits,
    ] {
        part(c, &pte);
    }
}

/// Cut short, or not an ExecuTorch program at all.
fn truncated_or_foreign(c: &mut Corpus, pte: &Pte) {
    let len = pte.bytes.len();
    let header = etmetal_pte::parse(&pte.bytes).unwrap().header.unwrap();
    let (program_size, base) = (
        header.program_size as usize,
        header.segment_base_offset as usize,
    );

    // Truncated: inside the prefix, the header, the flatbuffer, the segments.
    for (at, kind, want) in [
        (0, "Format", "not a .pt2 archive"), // too short to tell: read as a .pt2
        (6, "Format", "not a .pt2 archive"),
        (8, "Format", "flatbuffer does not verify"),
        (20, "Format", "ends inside the header"),
        (36, "Format", "ends inside the header"),
        (64, "Format", "program_size"),
        (len / 4, "Format", "program_size"),
        (program_size - 1, "Format", "program_size"),
        (program_size, "Format", "segments end at"),
        (base + 1, "Format", "segments end at"),
        (len - 100, "Format", "segments end at"),
        (len - 1, "Format", "segments end at"),
    ] {
        c.add(
            &format!("pte/truncated_at_{at}.pte"),
            pte.bytes[..at].to_vec(),
            kind,
            want,
        );
    }

    let mut wrong = pte.bytes.clone();
    wrong[4..8].copy_from_slice(b"ET13");
    c.add(
        "pte/identifier_et13.pte",
        wrong,
        "Format",
        "another ExecuTorch schema version",
    );
    // A file of another kind altogether is taken for a .pt2 and is not a zip.
    let mut wrong = pte.bytes.clone();
    wrong[4..8].copy_from_slice(b"PK\x03\x04");
    c.add(
        "pte/identifier_zip.pte",
        wrong,
        "Format",
        "not a .pt2 archive",
    );
}

/// Extended header fields (magic at 8, length at 12, then u64 fields at
/// 16/24/32).
fn header_fields(c: &mut Corpus, pte: &Pte) {
    let mut b = pte.bytes.clone();
    b[12..16].copy_from_slice(&16u32.to_le_bytes());
    c.add(
        "pte/header_length_16.pte",
        b,
        "Format",
        "length 16 is below the minimum 24",
    );
    c.add(
        "pte/header_program_size_huge.pte",
        pte.patched_u64(16, u64::MAX),
        "Format",
        "program_size 18446744073709551615",
    );
    c.add(
        "pte/header_program_size_small.pte",
        pte.patched_u64(16, 12),
        "Format",
        "program_size 12",
    );
    c.add(
        "pte/header_base_inside_program.pte",
        pte.patched_u64(24, 64),
        "Format",
        "lies inside the program",
    );
    c.add(
        "pte/header_data_size_overflow.pte",
        pte.patched_u64(32, u64::MAX - 8),
        "Format",
        "segments end at",
    );
    c.add(
        "pte/header_data_size_short.pte",
        pte.patched_u64(32, 16),
        "Format",
        "exceeds the header's segment_data_size 16",
    );
}

/// Segments and the constant segment.
fn segment_table(c: &mut Corpus, pte: &Pte) {
    c.add(
        "pte/segment_past_end.pte",
        pte.mutated(|p| p.segments[0].size += 4096),
        "Format",
        "runs past the end",
    );
    c.add(
        "pte/segments_overlap.pte",
        pte.mutated(|p| {
            p.segments.push(DataSegment {
                offset: 16,
                size: 32,
            });
        }),
        "Format",
        "overlap segments[0]",
    );
    c.add(
        "pte/constant_segment_index.pte",
        pte.mutated(|p| p.constant_segment.as_mut().unwrap().segment_index = 7),
        "Format",
        "segment index 7 is out of range",
    );
    c.add(
        "pte/constant_offset_past_segment.pte",
        pte.mutated(|p| {
            let seg = p.constant_segment.as_mut().unwrap();
            *seg.offsets.last_mut().unwrap() = 1 << 40;
        }),
        "Format",
        "is past the",
    );
}

/// Value, operator, delegate, memory and constant indices out of range.
fn indices_out_of_range(c: &mut Corpus, pte: &Pte) {
    c.add(
        "pte/input_index.pte",
        pte.mutated(|p| p.execution_plan[0].inputs[0] = 999),
        "Format",
        "inputs[0]: value index 999 is out of range",
    );
    c.add(
        "pte/output_index_negative.pte",
        pte.mutated(|p| p.execution_plan[0].outputs[0] = -3),
        "Format",
        "value index -3 is out of range",
    );
    c.add(
        "pte/operator_index.pte",
        pte.mutated(|p| kernel(p).op_index = 42),
        "Format",
        "operator index 42 is out of range",
    );
    c.add(
        "pte/kernel_arg_index.pte",
        pte.mutated(|p| kernel(p).args[1] = 1000),
        "Format",
        "instructions[0]: value index 1000",
    );
    c.add(
        "pte/delegate_index.pte",
        pte.mutated(|p| {
            p.execution_plan[0].chains[0]
                .instructions
                .push(Instruction::DelegateCall(etmetal_pte::DelegateCall {
                    delegate_index: 3,
                    args: vec![0],
                }))
        }),
        "Format",
        "delegate index 3 is out of range",
    );
    c.add(
        "pte/delegate_data_index.pte",
        pte.mutated(|p| {
            p.execution_plan[0]
                .delegates
                .push(etmetal_pte::BackendDelegate {
                    id: "EtMetalBackend".into(),
                    processed: etmetal_pte::BackendDelegateDataReference {
                        location: etmetal_pte::DataLocation::Segment,
                        index: 9,
                    },
                    compile_specs: vec![],
                })
        }),
        "Format",
        "delegate segment index 9 is out of range",
    );
    c.add(
        "pte/memory_id_zero.pte",
        pte.mutated(|p| {
            let v = p.execution_plan[0].inputs[0] as usize;
            tensor(p, v).allocation_info.as_mut().unwrap().memory_id = 0;
        }),
        "Format",
        "memory_id 0 is out of range",
    );
    c.add(
        "pte/planned_tensor_past_arena.pte",
        pte.mutated(|p| {
            let v = p.execution_plan[0].inputs[0] as usize;
            tensor(p, v)
                .allocation_info
                .as_mut()
                .unwrap()
                .memory_offset_low = 250;
        }),
        "Format",
        "at offset 250 of memory 1 exceed",
    );
    c.add(
        "pte/constant_index.pte",
        pte.mutated(|p| {
            let v = first_constant(p);
            tensor(p, v).data_buffer_idx = 77;
        }),
        "Format",
        "data_buffer_idx 77 is out of range",
    );
    c.add(
        "pte/constant_bigger_than_segment.pte",
        pte.mutated(|p| {
            let v = first_constant(p);
            tensor(p, v).sizes[0] *= 100;
        }),
        "Format",
        "run past the",
    );
}

/// Tensor sizes, dim orders, scalar types, and the schema version.
fn tensor_metadata(c: &mut Corpus, pte: &Pte) {
    c.add(
        "pte/sizes_overflow_u64.pte",
        pte.mutated(|p| {
            let v = p.execution_plan[0].inputs[0] as usize;
            let t = tensor(p, v);
            t.sizes = vec![i32::MAX; 3];
            t.dim_order = vec![0, 1, 2];
        }),
        "Format",
        "overflow u64 bytes",
    );
    c.add(
        "pte/sizes_negative.pte",
        pte.mutated(|p| {
            let v = p.execution_plan[0].inputs[0] as usize;
            tensor(p, v).sizes[1] = -8;
        }),
        "Format",
        "have a negative size",
    );
    c.add(
        "pte/dim_order_not_permutation.pte",
        pte.mutated(|p| {
            let v = p.execution_plan[0].inputs[0] as usize;
            tensor(p, v).dim_order = vec![1, 1];
        }),
        "Format",
        "is not a permutation",
    );
    c.add(
        "pte/scalar_type_99.pte",
        with_scalar_type_code(pte, 99),
        "Format",
        "unsupported ExecuTorch scalar type 99",
    );
    c.add(
        "pte/schema_version_1.pte",
        pte.mutated(|p| p.version = 1),
        "Format",
        "schema version 1 is newer",
    );
}

/// Chains: none, a jump out of range or round in a circle, an unknown
/// operator.
fn chain_instructions(c: &mut Corpus, pte: &Pte) {
    c.add(
        "pte/no_chain.pte",
        pte.mutated(|p| p.execution_plan[0].chains.clear()),
        "Format",
        "the method has no chain",
    );
    c.add(
        "pte/jump_past_end.pte",
        pte.mutated(|p| {
            let n = p.execution_plan[0].chains[0].instructions.len() as i32;
            jump(p, n + 5);
        }),
        "Format",
        "jump destination",
    );
    // A jump back to itself on a constant false condition never ends.
    c.add(
        "pte/jump_cycle.pte",
        pte.mutated(|p| {
            let n = p.execution_plan[0].chains[0].instructions.len() as i32;
            jump(p, n);
        }),
        "Unsupported",
        "jumps back to instruction",
    );
    c.add(
        "pte/unknown_operator.pte",
        pte.mutated(|p| p.execution_plan[0].operators[0].name = "aten::frobnicate".into()),
        "Unsupported",
        "aten::frobnicate",
    );
}

/// Resource limits: refused before allocating.
fn resource_limits(c: &mut Corpus, pte: &Pte) {
    c.add(
        "pte/huge_arena.pte",
        pte.mutated(|p| {
            let plan = &mut p.execution_plan[0];
            plan.non_const_buffer_sizes[1] = 1 << 50;
            let v = plan.inputs[0] as usize;
            tensor(p, v)
                .allocation_info
                .as_mut()
                .unwrap()
                .memory_offset_high = 1 << 17;
        }),
        "Limit",
        "exceeds the limit",
    );
    c.add(
        "pte/huge_unplanned_input.pte",
        pte.mutated(|p| {
            let v = p.execution_plan[0].inputs[0] as usize;
            let t = tensor(p, v);
            t.allocation_info = None;
            t.sizes = vec![1 << 20, 1 << 20, 1 << 10];
            t.dim_order = vec![0, 1, 2];
        }),
        "Limit",
        "exceeds the limit",
    );
}

fn kernel(p: &mut Program) -> &mut KernelCall {
    match &mut p.execution_plan[0].chains[0].instructions[0] {
        Instruction::KernelCall(k) => k,
        other => panic!("fixture instruction 0 is {other:?}"),
    }
}

/// Append `JumpFalseCall { cond: a new false Bool, dest }` to chain 0.
fn jump(p: &mut Program, dest: i32) {
    let plan = &mut p.execution_plan[0];
    plan.values.push(EValue::Bool(false));
    let cond = plan.values.len() as i32 - 1;
    plan.chains[0]
        .instructions
        .push(Instruction::JumpFalseCall(JumpFalseCall {
            cond_value_index: cond,
            destination_instruction: dest,
        }));
}

// ---------------------------------------------------------------- .pt2

/// The fixture archive's entries, to rewrite with changes.
struct Pt2 {
    bytes: Vec<u8>,
    entries: Vec<(String, Vec<u8>)>,
}

impl Pt2 {
    fn new(bytes: Vec<u8>) -> Pt2 {
        let mut zip = zip::ZipArchive::new(Cursor::new(&bytes[..])).expect("fixture zip");
        let entries = (0..zip.len())
            .map(|i| {
                let mut f = zip.by_index(i).expect("fixture entry");
                let name = f.name().expect("entry name").into_owned();
                let mut data = Vec::new();
                f.read_to_end(&mut data).expect("fixture entry data");
                (name, data)
            })
            .collect();
        Pt2 { bytes, entries }
    }

    fn write(entries: &[(String, Vec<u8>)]) -> Vec<u8> {
        let mut zip = zip::ZipWriter::new(Cursor::new(Vec::new()));
        let options = zip::write::SimpleFileOptions::default()
            .compression_method(zip::CompressionMethod::Stored);
        for (name, data) in entries {
            zip.start_file(name.as_str(), options).expect("zip entry");
            zip.write_all(data).expect("zip data");
        }
        zip.finish().expect("zip").into_inner()
    }

    /// The archive with entry `suffix` edited (None: removed).
    fn edited(&self, suffix: &str, edit: impl FnOnce(&[u8]) -> Option<Vec<u8>>) -> Vec<u8> {
        let mut entries = self.entries.clone();
        let i = entries
            .iter()
            .position(|(n, _)| n.ends_with(suffix))
            .unwrap_or_else(|| panic!("no entry `{suffix}` in the fixture"));
        match edit(&entries[i].1) {
            Some(data) => entries[i].1 = data,
            None => {
                entries.remove(i);
            }
        }
        Pt2::write(&entries)
    }

    /// The archive with JSON entry `suffix` edited.
    fn json(&self, suffix: &str, edit: impl FnOnce(&mut Value)) -> Vec<u8> {
        self.edited(suffix, |data| {
            let mut v: Value = serde_json::from_slice(data).expect("fixture JSON");
            edit(&mut v);
            Some(serde_json::to_vec(&v).expect("JSON"))
        })
    }

    fn model(&self, edit: impl FnOnce(&mut Value)) -> Vec<u8> {
        self.json("models/model.json", edit)
    }
}

fn graph(m: &mut Value) -> &mut Value {
    &mut m["graph_module"]["graph"]
}

fn pt2_cases(c: &mut Corpus) {
    let pt2 = Pt2::new(std::fs::read(root().join("tests/fixtures/mlp.pt2")).expect("mlp.pt2"));

    c.add(
        "pt2/not_a_zip.pt2",
        b"this is a text file, not an archive\n".to_vec(),
        "Format",
        "not a .pt2 archive (zip)",
    );
    c.add("pt2/empty.pt2", Vec::new(), "Format", "not a .pt2 archive");
    c.add(
        "pt2/truncated_half.pt2",
        pt2.bytes[..pt2.bytes.len() / 2].to_vec(),
        "Format",
        "not a .pt2 archive",
    );
    c.add(
        "pt2/truncated_end.pt2",
        pt2.bytes[..pt2.bytes.len() - 10].to_vec(),
        "Format",
        "not a .pt2 archive",
    );
    c.add(
        "pt2/missing_model_json.pt2",
        pt2.edited("models/model.json", |_| None),
        "Format",
        "no `models/*.json` program",
    );
    c.add(
        "pt2/model_json_truncated.pt2",
        pt2.edited("models/model.json", |d| Some(d[..d.len() / 2].to_vec())),
        "Format",
        "invalid JSON",
    );
    c.add(
        "pt2/model_json_not_utf8.pt2",
        pt2.edited("models/model.json", |d| {
            let mut d = d.to_vec();
            d[10] = 0xff;
            Some(d)
        }),
        "Format",
        "is not UTF-8",
    );
    c.add(
        "pt2/schema_major_99.pt2",
        pt2.model(|m| m["schema_version"]["major"] = json!(99)),
        "Unsupported",
        "schema version 99.",
    );
    c.add(
        "pt2/archive_version_7.pt2",
        pt2.edited("archive_version", |_| Some(b"7".to_vec())),
        "Unsupported",
        "archive_version is `7`",
    );
    c.add(
        "pt2/weight_too_short.pt2",
        pt2.edited("data/weights/weight_0", |d| Some(d[..99].to_vec())),
        "Format",
        "whole number",
    );
    c.add(
        "pt2/weight_short_by_elements.pt2",
        pt2.edited("data/weights/weight_0", |d| Some(d[..96].to_vec())),
        "Format",
        "reach outside the storage",
    );
    c.add(
        "pt2/weight_missing.pt2",
        pt2.edited("data/weights/weight_2", |_| None),
        "Format",
        "is missing from the archive",
    );
    c.add(
        "pt2/strides_outside_storage.pt2",
        pt2.json("data/weights/model_weights_config.json", |w| {
            w["config"]["fc1.weight"]["tensor_meta"]["strides"] =
                json!([{"as_int": 16}, {"as_int": 1}]);
        }),
        "Format",
        "reach outside the storage",
    );
    c.add(
        "pt2/negative_stride.pt2",
        pt2.json("data/weights/model_weights_config.json", |w| {
            w["config"]["fc1.weight"]["tensor_meta"]["strides"] =
                json!([{"as_int": -8}, {"as_int": 1}]);
        }),
        "Format",
        "negative strides",
    );
    c.add(
        "pt2/huge_weight.pt2",
        pt2.json("data/weights/model_weights_config.json", |w| {
            let meta = &mut w["config"]["fc1.weight"]["tensor_meta"];
            meta["sizes"] = json!([{"as_int": 1i64 << 40}, {"as_int": 1i64 << 20}]);
            meta["strides"] = json!([{"as_int": 1i64 << 20}, {"as_int": 1}]);
        }),
        "Limit",
        "exceeds the limit",
    );
    c.add(
        "pt2/unknown_op.pt2",
        pt2.model(|m| graph(m)["nodes"][0]["target"] = json!("torch.ops.aten.frobnicate.default")),
        "Unsupported",
        "aten.frobnicate",
    );
    c.add(
        "pt2/undefined_tensor.pt2",
        pt2.model(|m| {
            graph(m)["nodes"][0]["inputs"][0]["arg"] = json!({"as_tensor": {"name": "nowhere"}})
        }),
        "Format",
        "nowhere",
    );
    c.add(
        "pt2/metadata_wrong_shape.pt2",
        pt2.model(|m| {
            graph(m)["tensor_values"]["linear"]["sizes"] = json!([{"as_int": 2}, {"as_int": 5}]);
        }),
        "Shape",
        "linear",
    );
    c.add(
        "pt2/metadata_negative_size.pt2",
        pt2.model(|m| {
            graph(m)["tensor_values"]["x"]["sizes"] = json!([{"as_int": -2}, {"as_int": 8}]);
        }),
        "Format",
        "-2",
    );
    c.add(
        "pt2/metadata_unknown_dtype.pt2",
        pt2.model(|m| graph(m)["tensor_values"]["x"]["dtype"] = json!(99)),
        "Unsupported",
        "99",
    );
    c.add(
        "pt2/metadata_missing_sizes.pt2",
        pt2.model(|m| {
            graph(m)["tensor_values"]["x"]
                .as_object_mut()
                .unwrap()
                .remove("sizes");
        }),
        "Format",
        "sizes",
    );
    c.add(
        "pt2/huge_input.pt2",
        pt2.model(|m| {
            graph(m)["tensor_values"]["x"]["sizes"] =
                json!([{"as_int": 1i64 << 40}, {"as_int": 1i64 << 30}]);
        }),
        "Limit",
        "exceeds the limit",
    );
}

// ---------------------------------------------------------------- payload

fn valid_payload() -> Payload {
    let arena = |offset| Location::Arena { arena: 0, offset };
    Payload {
        buffers: vec![
            Buffer {
                name: "x".into(),
                dtype: DType::F32,
                shape: vec![4],
                location: arena(0),
                dims: vec![],
            },
            Buffer {
                name: "w".into(),
                dtype: DType::F32,
                shape: vec![4],
                location: Location::Weight { key: "w".into() },
                dims: vec![],
            },
            Buffer {
                name: "y".into(),
                dtype: DType::F32,
                shape: vec![4],
                location: arena(256),
                dims: vec![],
            },
        ],
        kernels: vec![Kernel {
            name: "k0_mul".into(),
            ops: vec!["mul".into()],
            wgsl: "@group(0) @binding(0) var<storage, read_write> x: array<f32>;\n\
                   @group(0) @binding(1) var<storage, read> w: array<f32>;\n\
                   @group(0) @binding(2) var<storage, read_write> y: array<f32>;\n\
                   @compute @workgroup_size(4) fn main(@builtin(global_invocation_id) g: vec3<u32>) \
                   { y[g.x] = x[g.x] * w[g.x]; }"
                .into(),
            msl: String::new(),
            entry_point: "main".into(),
            bindings: vec![Access::ReadWrite, Access::Read, Access::ReadWrite],
            workgroup_size: [4, 1, 1],
            sizes: false,
        }],
        dispatches: vec![Dispatch {
            kernel: 0,
            nodes: vec!["mul".into()],
            buffers: vec![0, 1, 2],
            workgroups: [1, 1, 1],
            groups: None,
            alternatives: vec![],
        }],
        inputs: vec![0],
        outputs: vec![2],
        arenas: vec![512],
        requirements: Requirements::default(),
        state: vec![],
        checks: vec![],
        symbols: vec![],
    }
}

fn payload_cases(c: &mut Corpus) {
    let valid = valid_payload().encode();
    Payload::decode(&valid).expect("the valid payload decodes");
    let json = |edit: &dyn Fn(&mut Value)| {
        let mut v: Value = serde_json::from_slice(&valid[8..]).unwrap();
        edit(&mut v);
        let mut out = valid[..8].to_vec();
        out.extend(serde_json::to_vec(&v).unwrap());
        out
    };
    let mut bad_magic = valid.clone();
    bad_magic[..4].copy_from_slice(b"MTLE");
    c.add(
        "payload/bad_magic.emtl",
        bad_magic,
        "Format",
        "`EMTL` magic",
    );
    c.add(
        "payload/too_short.emtl",
        valid[..6].to_vec(),
        "Format",
        "`EMTL` magic",
    );
    let mut newer = valid.clone();
    newer[4..8].copy_from_slice(&[2, 0, 0, 0]); // version 2.0
    c.add(
        "payload/major_version_2.emtl",
        newer,
        "Unsupported",
        "payload version 2.0",
    );
    for cut in [8, 40, valid.len() - 1] {
        c.add(
            &format!("payload/truncated_at_{cut}.emtl"),
            valid[..cut].to_vec(),
            "Format",
            "bad JSON",
        );
    }
    c.add(
        "payload/dispatch_buffer_index.emtl",
        json(&|v| v["dispatches"][0]["buffers"][2] = json!(17)),
        "Format",
        "refers to buffer 17",
    );
    c.add(
        "payload/input_buffer_index.emtl",
        json(&|v| v["inputs"][0] = json!(5)),
        "Format",
        "refers to buffer 5",
    );
    c.add(
        "payload/kernel_index.emtl",
        json(&|v| v["dispatches"][0]["kernel"] = json!(4)),
        "Format",
        "uses kernel 4",
    );
    c.add(
        "payload/arena_range_out_of_bounds.emtl",
        json(&|v| v["buffers"][2]["location"]["Arena"]["offset"] = json!(512)),
        "Format",
        "do not fit arena 0",
    );
    c.add(
        "payload/arena_offset_overflow.emtl",
        json(&|v| v["buffers"][2]["location"]["Arena"]["offset"] = json!(u64::MAX - 255)),
        "Format",
        "do not fit arena 0",
    );
    c.add(
        "payload/arena_index.emtl",
        json(&|v| v["buffers"][0]["location"]["Arena"]["arena"] = json!(3)),
        "Format",
        "arena 3 does not exist",
    );
    c.add(
        "payload/shape_overflow.emtl",
        json(&|v| v["buffers"][0]["shape"] = json!([u64::MAX, 4])),
        "Format",
        "shape overflows",
    );
    c.add(
        "payload/gpu_bytes_overflow.emtl",
        json(&|v| v["buffers"][0]["shape"] = json!([1u64 << 62])),
        "Limit",
        "more than u64::MAX bytes",
    );
    c.add(
        "payload/binding_count.emtl",
        json(&|v| v["dispatches"][0]["buffers"] = json!([0, 1])),
        "Format",
        "which has 3 bindings",
    );
    c.add(
        "payload/weight_bound_writable.emtl",
        json(&|v| v["kernels"][0]["bindings"][1] = json!("ReadWrite")),
        "Format",
        "binds `w` as ReadWrite",
    );
    c.add(
        "payload/zero_workgroups.emtl",
        json(&|v| v["dispatches"][0]["workgroups"] = json!([0, 1, 1])),
        "Format",
        "workgroup counts",
    );
    c.add(
        "payload/unknown_dtype.emtl",
        json(&|v| v["buffers"][0]["dtype"] = json!("float128")),
        "Format",
        "float128",
    );
    // payload 1.2: a dispatch with an alternative (edited after it is set)
    let alternative = |edit: &dyn Fn(&mut Value)| {
        json(&|v| {
            let mut inner = v["dispatches"][0].clone();
            inner["workgroups"] = json!([2, 1, 1]);
            v["dispatches"][0]["alternatives"] = json!([{
                "needs": {"m": 16, "n": 16, "k": 16, "ab": "F16", "cr": "F32",
                          "subgroup_size": 32, "workgroup_storage": 32768},
                "dispatches": [inner],
            }]);
            edit(v)
        })
    };
    let mut add = |name: &str, edit: &dyn Fn(&mut Value), want: &str| {
        c.add(
            &format!("payload/{name}.emtl"),
            alternative(edit),
            "Format",
            want,
        )
    };
    add(
        "alternative_kernel_index",
        &|v| v["dispatches"][0]["alternatives"][0]["dispatches"][0]["kernel"] = json!(9),
        "alternative 0 dispatch 0 uses kernel 9",
    );
    add(
        "alternative_buffer_index",
        &|v| v["dispatches"][0]["alternatives"][0]["dispatches"][0]["buffers"][0] = json!(23),
        "refers to buffer 23",
    );
    add(
        "alternative_nested",
        &|v| {
            let outer = v["dispatches"][0].clone();
            v["dispatches"][0]["alternatives"][0]["dispatches"][0] = outer;
        },
        "has alternatives of its own",
    );
    add(
        "alternative_matrix_size",
        &|v| v["dispatches"][0]["alternatives"][0]["needs"]["k"] = json!(12),
        "which no device offers",
    );
    add(
        "alternative_matrix_type",
        &|v| v["dispatches"][0]["alternatives"][0]["needs"]["ab"] = json!("F64"),
        "F64",
    );
    add(
        "alternative_empty",
        &|v| v["dispatches"][0]["alternatives"][0]["dispatches"] = json!([]),
        "with 0 dispatches",
    );
}

fn main() {
    let dir = root().join("tests/malformed");
    let mut corpus = Corpus::default();
    pte_cases(&mut corpus);
    pt2_cases(&mut corpus);
    payload_cases(&mut corpus);
    for sub in ["pte", "pt2", "payload"] {
        let sub = dir.join(sub);
        // Start clean so a renamed case leaves no stale file behind.
        let _ = std::fs::remove_dir_all(&sub);
        std::fs::create_dir_all(&sub).expect("create the corpus folder");
    }
    let mut manifest = String::from(
        "# Written by `cargo run -p etmetal --example make_malformed`; do not edit.\n\
         # file\texpected ErrorKind\tsubstring of the message\n",
    );
    for case in &corpus.cases {
        std::fs::write(dir.join(&case.file), &case.bytes).expect("write a corpus file");
        manifest.push_str(&format!("{}\t{}\t{}\n", case.file, case.kind, case.want));
    }
    std::fs::write(dir.join("MANIFEST.tsv"), manifest).expect("write MANIFEST.tsv");
    println!(
        "wrote {} files and MANIFEST.tsv to {}",
        corpus.cases.len(),
        dir.display()
    );
}
