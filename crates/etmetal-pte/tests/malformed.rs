//! Malformed files are rejected with a Format error that says what and
//! where, and never panic. Broken files are made from the fixtures: by
//! patching bytes, or by mutating the parsed program and writing it with
//! `serialize_as_is` (which skips the checks `serialize` runs).

use std::path::PathBuf;

use etmetal_core::ErrorKind;
use etmetal_pte::*;
use flatbuffers::FlatBufferBuilder;

fn fixture_bytes(name: &str) -> Vec<u8> {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(format!("{name}.pte"));
    std::fs::read(path).unwrap()
}

/// The Format error message `bytes` are rejected with.
fn rejected(bytes: &[u8]) -> String {
    match parse(bytes) {
        Ok(_) => panic!("malformed file was accepted"),
        Err(e) => {
            assert_eq!(e.kind(), ErrorKind::Format, "{e}");
            e.to_string()
        }
    }
}

fn assert_contains(msg: &str, want: &str) {
    assert!(
        msg.contains(want),
        "error `{msg}` does not contain `{want}`"
    );
}

/// Mutate the parsed fixture and write it back unchecked; return the error
/// the reader gives, after checking `serialize` refuses it with the same text.
fn mutated(name: &str, mutate: impl FnOnce(&mut Program)) -> String {
    let file = parse(&fixture_bytes(name)).unwrap();
    let segments = file.segments().unwrap();
    let mut program = file.program.clone();
    mutate(&mut program);
    let msg = rejected(&serialize_as_is(&program, &segments).unwrap());
    // serialize lays the segment table out itself, so it can only be asked
    // to refuse what does not depend on that table.
    if !msg.starts_with("segments") {
        match serialize(&program, &segments) {
            Ok(_) => panic!("serialize wrote a program the reader rejects with `{msg}`"),
            Err(e) => assert_eq!(e.to_string(), format!("serialize: {msg}")),
        }
    }
    msg
}

fn plan(p: &mut Program) -> &mut ExecutionPlan {
    &mut p.execution_plan[0]
}

fn tensor(p: &mut Program, value: usize) -> &mut Tensor {
    match &mut plan(p).values[value] {
        EValue::Tensor(t) => t,
        other => panic!("values[{value}] is {other:?}"),
    }
}

#[test]
fn every_truncation_is_rejected_without_panicking() {
    for name in ["linear_relu", "xnnpack_linear"] {
        let bytes = fixture_bytes(name);
        for len in 0..bytes.len() {
            rejected(&bytes[..len]);
        }
    }
}

#[test]
fn flipped_bytes_never_panic() {
    let bytes = fixture_bytes("linear_relu");
    for at in 0..bytes.len() {
        for flip in [0x01u8, 0x80, 0xff] {
            let mut b = bytes.clone();
            b[at] ^= flip;
            // Either outcome is fine as long as it is an outcome.
            if let Err(e) = parse(&b) {
                assert_eq!(e.kind(), ErrorKind::Format, "byte {at}: {e}");
            }
        }
    }
}

/// Random multi-byte corruption (a fixed xorshift sequence): never a panic,
/// and whatever the reader accepts, the writer writes back to an equal
/// program with identical segment bytes.
#[test]
fn random_corruptions_never_panic_and_accepted_files_round_trip() {
    let mut state = 0x1234_5678_9abc_def0u64;
    let mut next = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        state
    };
    let mut accepted = 0;
    for name in [
        "linear_relu",
        "mlp",
        "conv_block",
        "int_bool",
        "xnnpack_linear",
    ] {
        let bytes = fixture_bytes(name);
        for _ in 0..2000 {
            let mut b = bytes.clone();
            for _ in 0..1 + next() % 8 {
                let at = next() as usize % b.len();
                b[at] = next() as u8;
            }
            let Ok(file) = parse(&b) else { continue };
            accepted += 1;
            let again =
                parse(&serialize(&file.program, &file.segments().unwrap()).unwrap()).unwrap();
            let mut program = again.program.clone();
            program.segments = file.program.segments.clone();
            assert_eq!(program, file.program);
            for i in 0..file.program.segments.len() {
                assert_eq!(file.segment(i).unwrap(), again.segment(i).unwrap());
            }
        }
    }
    // Most corruptions land in data or padding the reader may accept.
    assert!(accepted > 0);
}

#[test]
fn wrong_identifier() {
    let mut b = fixture_bytes("linear_relu");
    b[4..8].copy_from_slice(b"ET13");
    assert_contains(
        &rejected(&b),
        "file identifier is \"ET13\", expected \"ET12\" (another ExecuTorch schema version)",
    );
    b[4..8].copy_from_slice(b"PK\x03\x04");
    assert_contains(&rejected(&b), "expected \"ET12\"");
    assert_contains(
        &rejected(b"ET12"),
        "shorter than the 8-byte flatbuffer prefix",
    );
}

#[test]
fn bad_extended_header() {
    let mut b = fixture_bytes("linear_relu");
    b[12..16].copy_from_slice(&16u32.to_le_bytes());
    assert_contains(
        &rejected(&b),
        "extended header: length 16 is below the minimum 24",
    );

    let mut b = fixture_bytes("linear_relu");
    b[32..40].copy_from_slice(&53u64.to_le_bytes());
    assert_contains(
        &rejected(&b),
        "extended header: segments end at 1920 + 53 but the file has 1972 bytes",
    );

    let mut b = fixture_bytes("linear_relu");
    b[16..24].copy_from_slice(&u64::MAX.to_le_bytes());
    assert_contains(
        &rejected(&b),
        "extended header: program_size 18446744073709551615 is outside",
    );
}

#[test]
fn corrupt_flatbuffer_fails_the_verifier() {
    let mut b = fixture_bytes("linear_relu");
    b[0..4].copy_from_slice(&0xfff0u32.to_le_bytes());
    assert_contains(&rejected(&b), "program flatbuffer does not verify");
}

#[test]
fn segment_past_end_and_overlapping_segments() {
    let msg = mutated("linear_relu", |p| p.segments[0].size = 1000);
    assert_contains(
        &msg,
        "segments[0]: offset 0 size 1000 from base 1920 runs past the end of the 1972-byte file",
    );

    // Two segments over the same bytes.
    let file = parse(&fixture_bytes("xnnpack_linear")).unwrap();
    let segments = file.segments().unwrap();
    let mut p = file.program.clone();
    let last = p.segments.len() - 1;
    p.segments[last].offset = p.segments[last - 1].offset + 8;
    let msg = rejected(&serialize_as_is(&p, &segments).unwrap());
    assert_contains(&msg, &format!("segments[{last}]: bytes"));
    assert_contains(&msg, &format!("overlap segments[{}]", last - 1));

    // Segment data with no extended header to locate it.
    let mut p = file.program.clone();
    p.segments = vec![DataSegment { offset: 0, size: 4 }];
    let msg = rejected(&serialize_as_is(&p, &[Segment::new(&[][..])]).unwrap());
    assert_contains(&msg, "segments[0]: 4 bytes of data but no extended header");
}

#[test]
fn indices_out_of_range() {
    let msg = mutated("linear_relu", |p| plan(p).outputs[0] = 999);
    assert_eq!(
        msg,
        "execution_plan[0].outputs[0]: value index 999 is out of range (14 entries)"
    );

    let msg = mutated("linear_relu", |p| plan(p).inputs[0] = -1);
    assert_eq!(
        msg,
        "execution_plan[0].inputs[0]: value index -1 is out of range (14 entries)"
    );

    let msg = mutated("linear_relu", |p| {
        if let Instruction::KernelCall(k) = &mut plan(p).chains[0].instructions[1] {
            k.args[2] = 14;
        }
    });
    assert_eq!(
        msg,
        "execution_plan[0].chains[0].instructions[1]: value index 14 is out of range (14 entries)"
    );

    let msg = mutated("linear_relu", |p| {
        if let Instruction::KernelCall(k) = &mut plan(p).chains[0].instructions[2] {
            k.op_index = 4;
        }
    });
    assert_eq!(
        msg,
        "execution_plan[0].chains[0].instructions[2]: operator index 4 is out of range (4 entries)"
    );

    let msg = mutated("linear_relu", |p| {
        plan(p).values.push(EValue::TensorList(vec![0, 20]))
    });
    assert_eq!(
        msg,
        "execution_plan[0].values[14]: value index 20 is out of range (15 entries)"
    );
    // -1 is None in an optional tensor list, nothing else below 0 is.
    let file = parse(&fixture_bytes("linear_relu")).unwrap();
    let mut p = file.program.clone();
    plan(&mut p)
        .values
        .push(EValue::OptionalTensorList(vec![-1, 3]));
    serialize(&p, &file.segments().unwrap()).unwrap();
    let msg = mutated("linear_relu", |p| {
        plan(p).values.push(EValue::OptionalTensorList(vec![-2]))
    });
    assert_eq!(
        msg,
        "execution_plan[0].values[14]: value index -2 is out of range (15 entries)"
    );
}

#[test]
fn delegate_indices_out_of_range() {
    let msg = mutated("xnnpack_linear", |p| {
        if let Instruction::DelegateCall(d) = &mut plan(p).chains[0].instructions[0] {
            d.delegate_index = 1;
        }
    });
    assert_eq!(
        msg,
        "execution_plan[0].chains[0].instructions[0]: delegate index 1 is out of range (1 entries)"
    );

    let msg = mutated("xnnpack_linear", |p| {
        plan(p).delegates[0].processed.index = 9
    });
    assert_contains(
        &msg,
        "execution_plan[0].delegates[0] `XnnpackBackend`: delegate segment index 9 is out of range",
    );
    let msg = mutated("xnnpack_linear", |p| {
        plan(p).delegates[0].processed.location = DataLocation::Inline
    });
    assert_contains(
        &msg,
        "inline delegate data index 1 is out of range (0 entries)",
    );
}

#[test]
fn jump_destination_out_of_range() {
    let jump = |dest| {
        move |p: &mut Program| {
            let chain = &mut plan(p).chains[0];
            chain
                .instructions
                .push(Instruction::JumpFalseCall(JumpFalseCall {
                    cond_value_index: 5,
                    destination_instruction: dest,
                }));
        }
    };
    let msg = mutated("linear_relu", jump(5));
    assert_eq!(msg, "execution_plan[0].chains[0].instructions[4]: jump destination 5 is out of range (5 entries)");
    // The last instruction itself is a valid destination.
    let file = parse(&fixture_bytes("linear_relu")).unwrap();
    let mut p = file.program.clone();
    jump(4)(&mut p);
    let reread = parse(&serialize(&p, &file.segments().unwrap()).unwrap()).unwrap();
    assert_eq!(
        reread.program.execution_plan[0].chains[0]
            .instructions
            .len(),
        5
    );
}

#[test]
fn bad_tensor_shapes() {
    let msg = mutated("linear_relu", |p| tensor(p, 12).sizes = vec![-1, 3]);
    assert_eq!(
        msg,
        "execution_plan[0].values[12]: tensor sizes [-1, 3] have a negative size"
    );

    let msg = mutated("linear_relu", |p| {
        let t = tensor(p, 12);
        t.sizes = vec![i32::MAX; 3];
        t.dim_order = vec![0, 1, 2];
    });
    assert_eq!(msg, "execution_plan[0].values[12]: tensor sizes [2147483647, 2147483647, 2147483647] overflow u64 bytes");

    let msg = mutated("linear_relu", |p| tensor(p, 12).dim_order = vec![1, 1]);
    assert_eq!(
        msg,
        "execution_plan[0].values[12]: dim_order [1, 1] is not a permutation of 0..2"
    );
}

#[test]
fn data_outside_its_buffer() {
    // values[12] is a [1,2] f32 (8 bytes) planned in memory 1 of 64 bytes.
    let msg = mutated("linear_relu", |p| {
        tensor(p, 12)
            .allocation_info
            .as_mut()
            .unwrap()
            .memory_offset_low = 60
    });
    assert_eq!(
        msg,
        "execution_plan[0].values[12]: 8 bytes at offset 60 of memory 1 exceed its 64 bytes"
    );
    let msg = mutated("linear_relu", |p| {
        tensor(p, 12)
            .allocation_info
            .as_mut()
            .unwrap()
            .memory_offset_high = 1
    });
    assert_contains(&msg, "at offset 4294967296 of memory 1");
    let msg = mutated("linear_relu", |p| {
        tensor(p, 12).allocation_info.as_mut().unwrap().memory_id = 2
    });
    assert_eq!(
        msg,
        "execution_plan[0].values[12]: memory_id 2 is out of range 1..2 (non_const_buffer_sizes)"
    );
    // ExecuTorch subtracts 1 from memory_id and fails on 0 (checked with 1.5.1).
    let msg = mutated("linear_relu", |p| {
        tensor(p, 12).allocation_info.as_mut().unwrap().memory_id = 0
    });
    assert_eq!(
        msg,
        "execution_plan[0].values[12]: memory_id 0 is out of range 1..2 (non_const_buffer_sizes)"
    );
    let msg = mutated("linear_relu", |p| plan(p).non_const_buffer_sizes[1] = -64);
    assert_eq!(
        msg,
        "execution_plan[0].non_const_buffer_sizes[1]: size -64 is negative"
    );

    // values[2] is the 4-byte scalar constant at offset 48 of the 52-byte segment.
    let msg = mutated("linear_relu", |p| {
        p.constant_segment.as_mut().unwrap().offsets[3] = 50
    });
    assert_eq!(
        msg,
        "execution_plan[0].values[2]: 4 bytes at constant offset 50 run past the 52-byte segment"
    );
    let msg = mutated("linear_relu", |p| {
        p.constant_segment.as_mut().unwrap().offsets[3] = 53
    });
    assert_eq!(
        msg,
        "constant_segment: offsets[3] = 53 is past the 52-byte segment"
    );
    let msg = mutated("linear_relu", |p| tensor(p, 2).data_buffer_idx = 4);
    assert_eq!(
        msg,
        "execution_plan[0].values[2]: data_buffer_idx 4 is out of range (4 constant offsets)"
    );
    let msg = mutated("linear_relu", |p| {
        p.constant_segment.as_mut().unwrap().segment_index = 1
    });
    assert_eq!(
        msg,
        "constant_segment: segment index 1 is out of range (1 segments)"
    );
}

#[test]
fn named_data_must_name_a_segment_once() {
    let msg = mutated("xnnpack_linear", |p| p.named_data[0].segment_index = 9);
    assert_contains(&msg, "named_data[0] `");
    assert_contains(&msg, "segment index 9 is out of range (4 segments)");
    let msg = mutated("xnnpack_linear", |p| {
        let first = p.named_data[0].clone();
        p.named_data.push(first);
    });
    assert_contains(&msg, "key appears more than once");
}

#[test]
fn missing_file_is_an_io_error() {
    let e = PteFile::load("/nonexistent/etmetal/m.pte").unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Io);
    assert_contains(&e.to_string(), "/nonexistent/etmetal/m.pte");
}

#[test]
fn version_above_zero() {
    let msg = mutated("linear_relu", |p| p.version = 1);
    assert_eq!(
        msg,
        "program schema version 1 is newer than the supported version 0"
    );
}

/// A minimal Program flatbuffer with one value table built by `value`
/// (slot 0: union tag, slot 1: member), to store what `Program` cannot hold.
fn program_with_value(
    version: u32,
    tag: u8,
    member: impl FnOnce(
        &mut FlatBufferBuilder,
    ) -> flatbuffers::WIPOffset<flatbuffers::TableFinishedWIPOffset>,
) -> Vec<u8> {
    let slot = |i: u16| 4 + 2 * i;
    let mut fbb = FlatBufferBuilder::new();
    let m = member(&mut fbb);
    let v = fbb.start_table();
    fbb.push_slot(slot(0), tag, 0);
    fbb.push_slot_always(slot(1), m);
    let v = fbb.end_table(v);
    let values = fbb.create_vector(&[v]);
    let plan = fbb.start_table();
    fbb.push_slot_always(slot(2), values);
    let plan = fbb.end_table(plan);
    let plans = fbb.create_vector(&[plan]);
    let root = fbb.start_table();
    fbb.push_slot(slot(0), version, 0);
    fbb.push_slot_always(slot(1), plans);
    let root = fbb.end_table(root);
    fbb.finish(root, Some("ET12"));
    fbb.finished_data().to_vec()
}

fn tensor_table(
    scalar_type: i8,
    dynamism: i8,
) -> impl FnOnce(&mut FlatBufferBuilder) -> flatbuffers::WIPOffset<flatbuffers::TableFinishedWIPOffset>
{
    move |fbb| {
        let sizes = fbb.create_vector::<i32>(&[]);
        let dims = fbb.create_vector::<u8>(&[]);
        let t = fbb.start_table();
        fbb.push_slot(4, scalar_type, 0);
        fbb.push_slot_always(8, sizes);
        fbb.push_slot_always(10, dims);
        fbb.push_slot(20, dynamism, 0);
        fbb.end_table(t)
    }
}

#[test]
fn values_the_schema_does_not_define() {
    // A well-formed scalar tensor parses: the builder above is right.
    let ok = parse(&program_with_value(0, 5, tensor_table(6, 0))).unwrap();
    assert!(
        matches!(&ok.program.execution_plan[0].values[0], EValue::Tensor(t) if t.sizes.is_empty())
    );

    let msg = rejected(&program_with_value(0, 5, tensor_table(99, 0)));
    assert_eq!(
        msg,
        "execution_plan[0].values[0]: tensor: unsupported ExecuTorch scalar type 99"
    );
    let msg = rejected(&program_with_value(0, 5, tensor_table(6, 7)));
    assert_eq!(msg, "execution_plan[0].values[0]: unknown shape dynamism 7");
    let msg = rejected(&program_with_value(0, 42, |fbb| {
        let t = fbb.start_table();
        fbb.end_table(t)
    }));
    assert_eq!(
        msg,
        "execution_plan[0].values[0]: unknown KernelTypes tag 42"
    );
    let msg = rejected(&program_with_value(3, 5, tensor_table(6, 0)));
    assert_eq!(
        msg,
        "program schema version 3 is newer than the supported version 0"
    );
}
