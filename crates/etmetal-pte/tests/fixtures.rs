//! Facts about the ExecuTorch-written fixtures (scripts/make_pte_fixtures.py)
//! and parse → serialize → parse round trips.

use std::path::PathBuf;

use etmetal_core::DType;
use etmetal_pte::*;

const FIXTURES: [&str; 5] = [
    "linear_relu",
    "mlp",
    "conv_block",
    "int_bool",
    "xnnpack_linear",
];

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(format!("{name}.pte"))
}

fn operators(file: &PteFile) -> Vec<String> {
    file.program.execution_plan[0]
        .operators
        .iter()
        .map(Operator::qualified_name)
        .collect()
}

#[test]
fn linear_relu_matches_the_verified_layout() {
    let file = PteFile::load(fixture("linear_relu")).unwrap();
    // The layout of FORMATS.md A.2/A.3 (its Linear(3,2) + relu example has
    // program_size 1864; this export's pytree strings make it 1880).
    assert_eq!(
        &file.bytes()[..40],
        &{
            let mut h = vec![0x3c, 0, 0, 0];
            h.extend_from_slice(b"ET12eh00");
            h.extend_from_slice(&32u32.to_le_bytes());
            h.extend_from_slice(&1880u64.to_le_bytes());
            h.extend_from_slice(&1920u64.to_le_bytes());
            h.extend_from_slice(&52u64.to_le_bytes());
            h
        }[..]
    );
    assert_eq!(
        file.header,
        Some(ExtendedHeader {
            program_size: 1880,
            segment_base_offset: 1920,
            segment_data_size: 52
        })
    );
    let p = &file.program;
    assert_eq!(p.version, 0);
    assert_eq!(
        p.segments,
        vec![DataSegment {
            offset: 0,
            size: 52
        }]
    );
    assert_eq!(
        p.constant_segment,
        Some(SubsegmentOffsets {
            segment_index: 0,
            offsets: vec![0, 0, 32, 48]
        })
    );
    let plan = &p.execution_plan[0];
    assert_eq!(plan.name, "forward");
    assert_eq!(
        operators(&file),
        [
            "aten::permute_copy.out",
            "aten::addmm.out",
            "aten::relu.out",
            "aten::add.out"
        ]
    );
    assert_eq!(plan.non_const_buffer_sizes, vec![0, 64]);
    assert_eq!(
        (plan.inputs.as_slice(), plan.outputs.as_slice()),
        (&[3][..], &[12][..])
    );
    // aten::add.out args [self, other, alpha, out, ret] (FORMATS.md A.5).
    let add = &plan.chains[0].instructions[3];
    assert_eq!(
        *add,
        Instruction::KernelCall(KernelCall {
            op_index: 3,
            args: vec![11, 2, 13, 12, 12]
        })
    );
    let EValue::Tensor(input) = &plan.values[3] else {
        panic!("values[3] is not a tensor")
    };
    assert_eq!(
        (input.scalar_type, input.sizes.as_slice()),
        (DType::F32, &[1, 3][..])
    );
    assert_eq!(
        input
            .allocation_info
            .map(|a| (a.memory_id, a.memory_offset())),
        Some((1, 48))
    );

    // Constants borrow the mapped file: weight [2,3], bias [2], scalar 1.0.
    let weight = file.constant_tensor(0, 0).unwrap();
    assert_eq!(weight.shape(), &[2, 3]);
    let bytes = file.segment(0).unwrap();
    assert_eq!(weight.bytes(), &bytes[..24]);
    assert_eq!(file.constant_tensor(0, 2).unwrap().to_f32_vec(), vec![1.0]);
    assert!(file
        .constant_tensor(0, 3)
        .unwrap_err()
        .to_string()
        .contains("not a constant tensor"));
}

#[test]
fn other_fixtures_have_the_expected_facts() {
    let mlp = PteFile::load(fixture("mlp")).unwrap();
    assert!(operators(&mlp).contains(&"aten::addmm.out".to_owned()));
    assert_eq!(
        mlp.program.constant_segment.as_ref().unwrap().offsets.len(),
        5,
        "placeholder + 2 weights + 2 biases"
    );

    let conv = PteFile::load(fixture("conv_block")).unwrap();
    let ops = operators(&conv);
    assert!(
        ops.iter().any(|o| o.starts_with("aten::convolution")),
        "{ops:?}"
    );
    assert!(
        ops.iter().any(|o| o.starts_with("aten::max_pool2d")),
        "{ops:?}"
    );

    let ib = PteFile::load(fixture("int_bool")).unwrap();
    let plan = &ib.program.execution_plan[0];
    let dtype = |i: i32| match &plan.values[i as usize] {
        EValue::Tensor(t) => t.scalar_type,
        other => panic!("output {i} is {other:?}"),
    };
    let outs: Vec<DType> = plan.outputs.iter().map(|&i| dtype(i)).collect();
    assert_eq!(outs, [DType::F32, DType::I64, DType::Bool]);
    assert_eq!(dtype(plan.inputs[1]), DType::I64);

    let xnn = PteFile::load(fixture("xnnpack_linear")).unwrap();
    let plan = &xnn.program.execution_plan[0];
    assert!(plan.operators.is_empty());
    assert_eq!(plan.delegates.len(), 1);
    assert_eq!(plan.delegates[0].id, "XnnpackBackend");
    assert!(matches!(
        plan.chains[0].instructions[0],
        Instruction::DelegateCall(_)
    ));
    assert_eq!(plan.delegates[0].processed.location, DataLocation::Segment);
    let payload = xnn.delegate_data(0, 0).unwrap();
    assert!(!payload.is_empty());
    // Every named-data key resolves to its segment's bytes.
    for n in &xnn.program.named_data {
        assert_eq!(
            xnn.named_data(&n.key).unwrap(),
            xnn.segment(n.segment_index as usize).unwrap()
        );
    }
}

#[test]
fn round_trip_gives_the_same_program_and_segment_bytes() {
    for name in FIXTURES {
        let bytes = std::fs::read(fixture(name)).unwrap();
        let first = parse(&bytes).unwrap();
        let written = serialize(&first.program, &first.segments().unwrap()).unwrap();
        let second = parse(&written).unwrap_or_else(|e| panic!("{name}: re-read failed: {e}"));
        assert_eq!(first.program, second.program, "{name}");
        // Our flatbuffer encoding may differ in size from flatc's, the
        // segment layout may not.
        let (h1, h2) = (first.header.unwrap(), second.header.unwrap());
        assert_eq!(h1.segment_data_size, h2.segment_data_size, "{name}");
        assert_eq!(h2.segment_base_offset % 128, 0, "{name}");
        for i in 0..first.program.segments.len() {
            assert_eq!(
                first.segment(i).unwrap(),
                second.segment(i).unwrap(),
                "{name} segment {i}"
            );
        }
        // The whole segment area (data and gaps) is byte-identical.
        assert_eq!(
            &bytes[h1.segment_base_offset as usize..],
            &written[h2.segment_base_offset as usize..],
            "{name}"
        );
        // A second trip is a fixed point.
        let again = serialize(&second.program, &second.segments().unwrap()).unwrap();
        assert_eq!(written, again, "{name}");
    }
}

#[test]
fn writes_a_program_built_from_scratch() {
    let (data, offsets) = constant_segment(&[&[1u8; 24], &[2u8; 8], &[3u8; 4]]);
    // FORMATS.md A.3: 24 B padded to 32, 8 B padded to 16, last 4 B unpadded.
    assert_eq!(offsets, vec![0, 0, 32, 48]);
    assert_eq!(data.len(), 52);
    let tensor = |idx: u32, sizes: Vec<i32>| {
        EValue::Tensor(Tensor {
            scalar_type: DType::U8,
            storage_offset: 0,
            dim_order: (0..sizes.len() as u8).collect(),
            sizes,
            requires_grad: false,
            data_buffer_idx: idx,
            allocation_info: None,
            layout: 0,
            shape_dynamism: TensorShapeDynamism::Static,
            extra_tensor_info: None,
        })
    };
    let mut program = Program {
        execution_plan: vec![ExecutionPlan {
            name: "forward".into(),
            values: vec![
                tensor(1, vec![24]),
                tensor(3, vec![2, 2]),
                EValue::DoubleList(vec![0.5, -2.0]),
            ],
            outputs: vec![0],
            chains: vec![Chain::default()],
            non_const_buffer_sizes: vec![0],
            ..Default::default()
        }],
        constant_segment: Some(SubsegmentOffsets {
            segment_index: 0,
            offsets,
        }),
        ..Default::default()
    };
    let mut segments = vec![Segment::new(data)];
    let a = add_named_data(&mut program, &mut segments, "a", &[9u8; 5][..], 64).unwrap();
    let b = add_named_data(&mut program, &mut segments, "b", &[9u8; 5][..], 64).unwrap();
    assert_eq!((a, b), (1, 1), "identical bytes share one segment");
    assert!(add_named_data(&mut program, &mut segments, "a", &[1u8][..], 1).is_err());

    let bytes = serialize(&program, &segments).unwrap();
    let file = parse(&bytes).unwrap();
    let h = file.header.unwrap();
    assert_eq!(h.segment_base_offset % 128, 0);
    let gap = &bytes[h.program_size as usize..h.segment_base_offset as usize];
    assert!(
        gap.iter().all(|&b| b == 0),
        "zero padding up to the segment base"
    );
    assert_eq!(
        file.program.segments,
        vec![
            DataSegment {
                offset: 0,
                size: 52
            },
            DataSegment {
                offset: 128,
                size: 5
            }
        ]
    );
    assert_eq!(h.segment_data_size, 133);
    assert_eq!(file.named_data("b").unwrap(), &[9u8; 5]);
    assert_eq!(file.constant_tensor(0, 1).unwrap().bytes(), &[3u8; 4]);
    program.segments = file.program.segments.clone();
    assert_eq!(file.program, program);
}

#[test]
fn a_program_without_segment_data_has_no_header() {
    let program = Program {
        execution_plan: vec![ExecutionPlan::default()],
        ..Default::default()
    };
    let bytes = serialize(&program, &[]).unwrap();
    assert_eq!(&bytes[4..8], b"ET12");
    assert_ne!(&bytes[8..12], b"eh00");
    let file = parse(&bytes).unwrap();
    assert_eq!(file.header, None);
    assert_eq!(file.program, program);
}

#[test]
fn a_file_written_in_pieces_holds_the_serialized_bytes() {
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join("pte-write");
    std::fs::create_dir_all(&dir).unwrap();
    let empty = Program {
        execution_plan: vec![ExecutionPlan::default()],
        ..Default::default()
    };
    let mut programs = vec![("empty".to_string(), empty, vec![])];
    for name in FIXTURES {
        let file = parse(&std::fs::read(fixture(name)).unwrap()).unwrap();
        let segments: Vec<Segment<'static>> = (file.segments().unwrap().into_iter())
            .map(|s| Segment {
                data: s.data.into_owned().into(),
                alignment: s.alignment,
            })
            .collect();
        programs.push((name.to_string(), file.program.clone(), segments));
    }
    for (name, program, segments) in &programs {
        let path = dir.join(format!("{name}.pte"));
        let size = serialize_to_file(program, segments, &path).unwrap();
        let written = std::fs::read(&path).unwrap();
        assert_eq!(written, serialize(program, segments).unwrap(), "{name}");
        assert_eq!(size, written.len() as u64, "{name}");
    }
    // a program that fails its checks writes no file
    let (_, mut program, segments) = programs.pop().unwrap();
    program.named_data.push(NamedData {
        key: "nowhere".into(),
        segment_index: 99,
    });
    let path = dir.join("refused.pte");
    let _ = std::fs::remove_file(&path);
    assert!(serialize_to_file(&program, &segments, &path).is_err());
    assert!(!path.exists());
}
