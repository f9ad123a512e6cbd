//! The GPU runtime on whatever adapter this machine has (in CI: Mesa
//! lavapipe). Payloads are built by hand with WGSL written here. No adapter
//! is a failure, not a skip.

use std::collections::HashMap;
use std::sync::Arc;

use etmetal_core::{DType, Error, ErrorKind, Tensor, View, ViewMut};
use etmetal_metal::payload::{
    to_gpu, Access, Alternative, Buffer, Dispatch, Kernel, Location, Needs, Payload, Requirements,
    VERSION_MAJOR,
};
use etmetal_metal_runtime::{describe, select_adapter, DeviceChoice, GpuStats, MetalBackend};
use etmetal_pte::testing::one_delegate_call;
use etmetal_pte::Segment;
use etmetal_runtime::{Backend, DelegateArg, DelegateHandle, LoadOptions};

type Named = HashMap<String, Vec<u8>>;

/// Fails (with how to get a software GPU) when the machine has no adapter.
fn backend() -> MetalBackend {
    if let Err(e) = select_adapter(DeviceChoice::Auto) {
        panic!(
            "GPU tests need an adapter: {e}. On Debian/Ubuntu: \
             apt-get install mesa-vulkan-drivers libvulkan1 (Mesa lavapipe)"
        );
    }
    MetalBackend::new(DeviceChoice::Auto)
}

fn arena(name: &str, dtype: DType, shape: &[usize], arena: usize, offset: u64) -> Buffer {
    Buffer {
        name: name.into(),
        dtype,
        shape: shape.to_vec(),
        location: Location::Arena { arena, offset },
        dims: vec![],
    }
}

fn weight(name: &str, dtype: DType, shape: &[usize], key: &str) -> Buffer {
    Buffer {
        name: name.into(),
        dtype,
        shape: shape.to_vec(),
        location: Location::Weight { key: key.into() },
        dims: vec![],
    }
}

fn kernel(name: &str, wgsl: String, bindings: &[Access]) -> Kernel {
    Kernel {
        name: name.into(),
        ops: vec![name.into()],
        wgsl,
        msl: String::new(),
        entry_point: "main".into(),
        bindings: bindings.to_vec(),
        workgroup_size: [64, 1, 1],
        sizes: false,
    }
}

fn dispatch(kernel: usize, buffers: &[usize], workgroups: u32) -> Dispatch {
    Dispatch {
        kernel,
        nodes: vec![format!("node{kernel}")],
        buffers: buffers.to_vec(),
        workgroups: [workgroups, 1, 1],
        groups: None,
        alternatives: vec![],
    }
}

/// `y[i] = expr` over `n` elements of `ty` (`x` the input), with helper
/// functions in `prelude`.
fn elementwise(ty: &str, n: usize, expr: &str, prelude: &str) -> String {
    format!(
        "{prelude}\n\
         @group(0) @binding(0) var<storage, read_write> x: array<{ty}>;\n\
         @group(0) @binding(1) var<storage, read_write> y: array<{ty}>;\n\
         @compute @workgroup_size(64) fn main(@builtin(global_invocation_id) g: vec3<u32>) {{\n\
           let i = g.x;\n\
           if (i < {n}u) {{ y[i] = {expr}; }}\n\
         }}\n"
    )
}

/// One kernel `y = expr(x)` from input buffer 0 to output buffer 1 (both
/// in arena 0).
fn unary(
    dtype: DType,
    shape: &[usize],
    ty: &str,
    words: usize,
    expr: &str,
    prelude: &str,
) -> Payload {
    Payload {
        buffers: vec![
            arena("x", dtype, shape, 0, 0),
            arena("y", dtype, shape, 0, 256),
        ],
        kernels: vec![kernel(
            "k0_unary",
            elementwise(ty, words, expr, prelude),
            &[Access::ReadWrite, Access::ReadWrite],
        )],
        dispatches: vec![dispatch(0, &[0, 1], 1)],
        inputs: vec![0],
        outputs: vec![1],
        arenas: vec![512],
        requirements: Requirements::default(),
        state: vec![],
        checks: vec![],
        symbols: vec![],
    }
}

/// `y = a * w + b` (a: input [2, 3], w: weight [2, 3], b: weight [3]).
fn affine() -> (Payload, Named) {
    let wgsl = "@group(0) @binding(0) var<storage, read_write> a: array<f32>;\n\
                @group(0) @binding(1) var<storage, read> w: array<f32>;\n\
                @group(0) @binding(2) var<storage, read> b: array<f32>;\n\
                @group(0) @binding(3) var<storage, read_write> y: array<f32>;\n\
                @compute @workgroup_size(64) fn main(@builtin(global_invocation_id) g: vec3<u32>) {\n\
                  let i = g.x;\n\
                  if (i < 6u) { y[i] = a[i] * w[i] + b[i % 3u]; }\n\
                }\n";
    let payload = Payload {
        buffers: vec![
            arena("a", DType::F32, &[2, 3], 0, 0),
            weight("w", DType::F32, &[2, 3], "p.w"),
            weight("b", DType::F32, &[3], "p.b"),
            arena("y", DType::F32, &[2, 3], 0, 256),
            // A second reference to `p.w`: the weight is still uploaded once.
            weight("w_again", DType::F32, &[2, 3], "p.w"),
        ],
        kernels: vec![kernel(
            "k0_mul_add",
            wgsl.into(),
            &[
                Access::ReadWrite,
                Access::Read,
                Access::Read,
                Access::ReadWrite,
            ],
        )],
        dispatches: vec![dispatch(0, &[0, 1, 2, 3], 1)],
        inputs: vec![0],
        outputs: vec![3],
        arenas: vec![512],
        requirements: Requirements::default(),
        state: vec![],
        checks: vec![],
        symbols: vec![],
    };
    let f32s = |v: &[f32]| {
        to_gpu(&Tensor::from_f32(DType::F32, &[v.len()], v).unwrap(), "w")
            .unwrap()
            .into_owned()
    };
    let named = HashMap::from([
        ("p.w".to_string(), f32s(&[1.0, 2.0, 3.0, 4.0, 5.0, 6.0])),
        ("p.b".to_string(), f32s(&[0.5, -1.0, 10.0])),
    ]);
    (payload, named)
}

/// Run `h` once on `inputs`; its outputs, written in place as a method's
/// memory would be.
fn exec(
    h: &mut dyn DelegateHandle,
    inputs: &[Tensor],
    payload: &Payload,
) -> Result<Vec<Tensor>, Error> {
    let mut outs: Vec<Tensor> = payload
        .outputs
        .iter()
        .map(|&id| {
            let b = &payload.buffers[id];
            Tensor::zeros(b.dtype, &b.shape).unwrap()
        })
        .collect();
    let mut a: Vec<DelegateArg> = inputs
        .iter()
        .map(|t| DelegateArg::Tensor(View::of(t)))
        .chain(outs.iter_mut().map(|t| DelegateArg::Output(ViewMut::of(t))))
        .collect();
    h.execute(&mut a)?;
    drop(a);
    Ok(outs)
}

/// Load `payload` and run it once on `inputs`; its (single) output.
fn run_once(payload: &Payload, named: &Named, inputs: &[Tensor]) -> Tensor {
    let b = backend();
    let mut h = b.init(&payload.encode(), &[], named).unwrap();
    exec(&mut *h, inputs, payload).unwrap().remove(0)
}

#[test]
fn adapter_is_found_and_offers_the_default_requirements() {
    let (_, adapter) = select_adapter(DeviceChoice::Auto)
        .unwrap_or_else(|e| panic!("{e}: install mesa-vulkan-drivers libvulkan1 (Mesa lavapipe)"));
    let info = adapter.get_info();
    let l = adapter.limits();
    eprintln!(
        "adapter: {}; driver {} {}; subgroups {}..{}; max_storage_buffer_binding_size {}, \
         max_buffer_size {}, max_compute_workgroup_storage_size {}, \
         max_storage_buffers_per_shader_stage {}, max_compute_invocations_per_workgroup {}, \
         shader-f16 {}",
        describe(&info),
        info.driver,
        info.driver_info,
        info.subgroup_min_size,
        info.subgroup_max_size,
        l.max_storage_buffer_binding_size,
        l.max_buffer_size,
        l.max_compute_workgroup_storage_size,
        l.max_storage_buffers_per_shader_stage,
        l.max_compute_invocations_per_workgroup,
        adapter.features().contains(wgpu::Features::SHADER_F16),
    );
    let d = Requirements::default();
    assert!(l.max_storage_buffer_binding_size >= d.max_storage_buffer_binding_size);
    assert!(l.max_storage_buffers_per_shader_stage >= d.max_storage_buffers_per_shader_stage);
}

#[test]
fn affine_over_weights_and_load_once() {
    let (payload, named) = affine();
    let b = backend();
    let mut h = b.init(&payload.encode(), &[], &named).unwrap();
    // 1 arena + 2 weights (p.w once) + 1 input and 1 read-back buffer; 1 pipeline.
    let loaded = b.stats();
    assert_eq!(
        loaded,
        GpuStats {
            pipelines_created: 1,
            buffers_allocated: 5,
            submits: 0,
            bytes_uploaded: 0,
            bytes_read_back: 0,
            alternatives_chosen: 0,
        }
    );
    assert!(b.device().is_some());
    let a = Tensor::from_f32(DType::F32, &[2, 3], &[1.0, 1.0, 1.0, 2.0, -1.0, 0.0]).unwrap();
    let first = exec(&mut *h, std::slice::from_ref(&a), &payload).unwrap();
    assert_eq!(first[0].to_f32_vec(), [1.5, 1.0, 13.0, 8.5, -6.0, 10.0]);
    let second = exec(&mut *h, &[a], &payload).unwrap();
    assert_eq!(first[0].bytes(), second[0].bytes());
    let after = b.stats();
    assert_eq!(after.pipelines_created, loaded.pipelines_created);
    assert_eq!(after.buffers_allocated, loaded.buffers_allocated);
    assert_eq!(after.submits, 2);
    // each execute writes the 2x3 f32 input and reads the 2x3 output back
    assert_eq!(after.bytes_uploaded, 2 * 24);
    assert_eq!(after.bytes_read_back, 2 * 24);
}

/// `y = 2x + 1` twice, through an intermediate ([`chain_of`]).
fn chain_payload(shape: [usize; 2]) -> Payload {
    chain_of(shape, 2, "k0_mul_add", "x[i] * 2.0 + 1.0")
}

/// `n` dispatches of kernel `name` (`expr` of `x[i]`) over the 15 floats of
/// `shape`, each reading what the one before wrote: the input, then
/// back and forth between two buffers in two arenas.
fn chain_of(shape: [usize; 2], n: usize, name: &str, expr: &str) -> Payload {
    let dispatches = (0..n)
        .map(|d| match d {
            0 => dispatch(0, &[0, 1], 1),
            _ if d % 2 == 1 => dispatch(0, &[1, 2], 1),
            _ => dispatch(0, &[2, 1], 1),
        })
        .collect();
    Payload {
        buffers: vec![
            arena("x", DType::F32, &shape, 0, 0),
            arena("t", DType::F32, &shape, 0, 256),
            arena("y", DType::F32, &shape, 1, 0),
        ],
        kernels: vec![kernel(
            name,
            elementwise("f32", 15, expr, ""),
            &[Access::ReadWrite, Access::ReadWrite],
        )],
        dispatches,
        inputs: vec![0],
        outputs: vec![if n % 2 == 1 { 1 } else { 2 }],
        arenas: vec![512, 60],
        requirements: Requirements::default(),
        state: vec![],
        checks: vec![],
        symbols: vec![],
    }
}

#[test]
fn two_dispatches_chain_through_an_intermediate_and_share_a_pipeline() {
    let shape = [3, 5];
    let payload = chain_payload(shape);
    let x: Vec<f32> = (0..15).map(|i| i as f32 - 7.0).collect();
    let b = backend();
    let mut h = b.init(&payload.encode(), &[], &Named::new()).unwrap();
    assert_eq!(b.stats().pipelines_created, 1);
    let x = Tensor::from_f32(DType::F32, &shape, &x).unwrap();
    let out = exec(&mut *h, std::slice::from_ref(&x), &payload).unwrap();
    let want: Vec<f32> = x
        .to_f32_vec()
        .iter()
        .map(|v| (v * 2.0 + 1.0) * 2.0 + 1.0)
        .collect();
    assert_eq!(out[0].to_f32_vec(), want);
    assert_eq!(out[0].shape(), shape);
}

#[test]
fn a_long_chain_is_submitted_in_growing_command_buffers_in_order() {
    // 8 + 32 + 1 dispatches: three submits an execute
    let n = 41;
    let payload = chain_of([3, 5], n, "k0_add", "x[i] + 1.0");
    let x = Tensor::from_f32(
        DType::F32,
        &[3, 5],
        &(0..15).map(|i| i as f32).collect::<Vec<_>>(),
    )
    .unwrap();
    let want: Vec<f32> = (0..15).map(|i| (i + n) as f32).collect();
    let b = backend();
    let mut h = b.init(&payload.encode(), &[], &Named::new()).unwrap();
    for profiled in [false, true, false] {
        b.set_profiling(profiled);
        let before = b.stats().submits;
        let out = exec(&mut *h, std::slice::from_ref(&x), &payload).unwrap();
        assert_eq!(out[0].to_f32_vec(), want, "profiled: {profiled}");
        assert_eq!(b.stats().submits - before, 3);
    }
    let times = b.take_dispatch_times();
    if b.can_profile() {
        assert_eq!(
            times.len(),
            n,
            "every dispatch of the profiled execute timed"
        );
    }
}

/// [`chain_payload`] whose second dispatch has two alternatives: one no
/// device meets (4 GiB of workgroup memory) with a kernel that is not even
/// WGSL, then one for 16×16×16 f16 matrices in subgroups of 32 computing
/// the same with other WGSL.
fn chain_with_alternatives() -> (Payload, Needs) {
    let mut p = chain_payload([3, 5]);
    let needs = Needs::f16_16x16x16(32, 0);
    let rw = [Access::ReadWrite, Access::ReadWrite];
    p.kernels
        .push(kernel("k1_never", "not WGSL at all".into(), &rw));
    let same = elementwise("f32", 15, "1.0 + 2.0 * x[i]", "");
    p.kernels.push(kernel("k2_coop", same, &rw));
    p.dispatches[1].alternatives = vec![
        Alternative {
            needs: Needs {
                workgroup_storage: u32::MAX,
                ..needs
            },
            dispatches: vec![dispatch(1, &[1, 2], 1)],
        },
        Alternative {
            needs,
            dispatches: vec![dispatch(2, &[1, 2], 1)],
        },
    ];
    (p, needs)
}

/// By default, the first alternative the device meets runs (where the
/// adapter has 16×16 f16 matrices in subgroups of 32: an NVIDIA GPU), else the
/// dispatch itself; kernels of alternatives that do not run are not built.
#[test]
fn alternatives_run_where_the_device_meets_them() {
    let (payload, needs) = chain_with_alternatives();
    let x: Vec<f32> = (0..15).map(|i| i as f32 - 7.0).collect();
    let x = Tensor::from_f32(DType::F32, &[3, 5], &x).unwrap();
    let b = backend();
    b.set_profiling(true);
    let mut h = b.init(&payload.encode(), &[], &Named::new()).unwrap();
    let meets = b
        .device()
        .unwrap()
        .coop
        .as_ref()
        .is_some_and(|o| o.meets(&needs));
    let stats = b.stats();
    assert_eq!(stats.alternatives_chosen, u64::from(meets));
    assert_eq!(stats.pipelines_created, 1 + u64::from(meets));
    let out = exec(&mut *h, std::slice::from_ref(&x), &payload).unwrap();
    let want: Vec<f32> = x
        .to_f32_vec()
        .iter()
        .map(|v| (v * 2.0 + 1.0) * 2.0 + 1.0)
        .collect();
    assert_eq!(out[0].to_f32_vec(), want);
    if b.can_profile() {
        let ran: Vec<(String, Option<String>)> = b
            .take_dispatch_times()
            .into_iter()
            .map(|t| (t.kernel, t.variant))
            .collect();
        let second = if meets {
            ("k2_coop".to_string(), Some(needs.describe()))
        } else {
            ("k0_mul_add".to_string(), None)
        };
        assert_eq!(ran, [("k0_mul_add".to_string(), None), second]);
    }
    // turned off, the payload's own dispatches run
    let plain = backend().with_cooperative_matrix(false);
    let mut h = plain.init(&payload.encode(), &[], &Named::new()).unwrap();
    assert_eq!(plain.stats().alternatives_chosen, 0);
    let out = exec(&mut *h, std::slice::from_ref(&x), &payload).unwrap();
    assert_eq!(out[0].to_f32_vec(), want);
}

#[test]
fn profiled_executes_time_every_dispatch_and_compute_the_same() {
    let shape = [3, 5];
    let payload = chain_payload(shape);
    let x = Tensor::from_f32(
        DType::F32,
        &shape,
        &(0..15).map(|i| i as f32).collect::<Vec<_>>(),
    )
    .unwrap();
    let plain = run_once(&payload, &Named::new(), std::slice::from_ref(&x));
    let b = backend();
    let mut h = b.init(&payload.encode(), &[], &Named::new()).unwrap();
    exec(&mut *h, std::slice::from_ref(&x), &payload).unwrap();
    assert!(b.take_dispatch_times().is_empty(), "not profiling yet");
    b.set_profiling(true);
    for _ in 0..3 {
        let out = exec(&mut *h, std::slice::from_ref(&x), &payload).unwrap();
        assert_eq!(out[0].to_f32_vec(), plain.to_f32_vec());
    }
    let times = b.take_dispatch_times();
    if b.can_profile() {
        assert_eq!(times.len(), 6, "two dispatches a run, three runs");
        for t in &times {
            assert_eq!(
                (t.kernel.as_str(), t.ops.as_slice()),
                ("k0_mul_add", &["k0_mul_add".to_string()][..])
            );
            assert!(t.seconds.is_finite() && t.seconds >= 0.0, "{t:?}");
        }
    } else {
        assert!(
            times.is_empty(),
            "no timestamp queries, no times: {times:?}"
        );
    }
    assert!(b.take_dispatch_times().is_empty(), "taken once");
    b.set_profiling(false);
    let out = exec(&mut *h, std::slice::from_ref(&x), &payload).unwrap();
    assert_eq!(out[0].to_f32_vec(), plain.to_f32_vec());
    assert!(b.take_dispatch_times().is_empty(), "profiling off again");
}

#[test]
fn bf16_packed_round_trip() {
    // Two bf16 a word; doubling is exact, so truncating back is too.
    let prelude = "fn twice(w: u32) -> u32 {\n\
                     let lo = bitcast<f32>(w << 16u) * 2.0;\n\
                     let hi = bitcast<f32>(w & 0xffff0000u) * 2.0;\n\
                     return (bitcast<u32>(lo) >> 16u) | (bitcast<u32>(hi) & 0xffff0000u);\n\
                   }";
    let payload = unary(DType::BF16, &[5], "u32", 3, "twice(x[i])", prelude);
    let x = [1.0, -2.5, 0.375, 96.0, -0.0078125];
    let out = run_once(
        &payload,
        &Named::new(),
        &[Tensor::from_f32(DType::BF16, &[5], &x).unwrap()],
    );
    assert_eq!(out.dtype(), DType::BF16);
    let want: Vec<f32> = x.iter().map(|v| v * 2.0).collect();
    assert_eq!(out.to_f32_vec(), want);
}

#[test]
fn int64_runs_as_i32_and_comes_back_int64() {
    let payload = unary(DType::I64, &[4], "i32", 4, "x[i] * 3 - 1", "");
    let x = Tensor::from_i64(DType::I64, &[4], &[-3, 0, 7, 1 << 29]).unwrap();
    let out = run_once(&payload, &Named::new(), &[x]);
    assert_eq!(out.dtype(), DType::I64);
    assert_eq!(out.to_i64_vec(), [-10, -1, 20, (1 << 29) * 3 - 1]);

    let big = Tensor::from_i64(DType::I64, &[4], &[0, 0, 1 << 40, 0]).unwrap();
    let b = backend();
    let mut h = b.init(&payload.encode(), &[], &Named::new()).unwrap();
    let e = exec(&mut *h, &[big], &payload).unwrap_err();
    assert!(e.to_string().contains("delegate input 0 (`x`)"), "{e}");
}

#[test]
fn bool_widened_round_trip() {
    let payload = unary(DType::Bool, &[5], "u32", 5, "1u - x[i]", "");
    let x = Tensor::from_bytes(DType::Bool, &[5], &[1, 0, 0, 1, 1]).unwrap();
    let out = run_once(&payload, &Named::new(), &[x]);
    assert_eq!(out.dtype(), DType::Bool);
    assert_eq!(out.bytes(), [0, 1, 1, 0, 0]);
}

#[test]
fn wrong_arguments_are_named() {
    let (payload, named) = affine();
    let b = backend();
    let mut h = b.init(&payload.encode(), &[], &named).unwrap();
    let good = Tensor::zeros(DType::F32, &[2, 3]).unwrap();

    let e = exec(
        &mut *h,
        &[Tensor::zeros(DType::I32, &[2, 3]).unwrap()],
        &payload,
    )
    .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidInput);
    let m = e.to_string();
    assert!(
        m.contains("input 0 (`a`): expected float32 [2, 3], got int32 [2, 3]"),
        "{m}"
    );

    let e = exec(
        &mut *h,
        &[Tensor::zeros(DType::F32, &[3, 2]).unwrap()],
        &payload,
    )
    .unwrap_err();
    assert!(e.to_string().contains("got float32 [3, 2]"), "{e}");

    let mut too_few = vec![DelegateArg::Tensor(View::of(&good))];
    let e = h.execute(&mut too_few).unwrap_err();
    assert!(
        e.to_string()
            .contains("takes 1 inputs and 1 outputs, got 1 arguments"),
        "{e}"
    );

    let mut not_tensor = vec![DelegateArg::Int(3), DelegateArg::Tensor(View::of(&good))];
    let e = h.execute(&mut not_tensor).unwrap_err();
    assert!(
        e.to_string().contains("input 0 (`a`): expected a tensor"),
        "{e}"
    );

    let mut not_output = vec![
        DelegateArg::Tensor(View::of(&good)),
        DelegateArg::Tensor(View::of(&good)),
    ];
    let e = h.execute(&mut not_output).unwrap_err();
    assert!(
        e.to_string().contains("output 0 (`y`): expected an output"),
        "{e}"
    );

    let mut wrong = Tensor::zeros(DType::F32, &[6]).unwrap();
    let mut bad_out = vec![
        DelegateArg::Tensor(View::of(&good)),
        DelegateArg::Output(ViewMut::of(&mut wrong)),
    ];
    let e = h.execute(&mut bad_out).unwrap_err();
    assert!(
        e.to_string()
            .contains("output 0 (`y`): expected float32 [2, 3], got float32 [6]"),
        "{e}"
    );

    // The handle still works after refused calls.
    exec(&mut *h, &[good], &payload).unwrap();
}

#[test]
fn requirement_beyond_the_adapter_fails_at_load_naming_the_limit() {
    let (mut payload, named) = affine();
    payload.requirements.max_storage_buffer_binding_size = 1 << 50;
    let e = backend()
        .init(&payload.encode(), &[], &named)
        .err()
        .unwrap();
    assert_eq!(e.kind(), ErrorKind::Limit);
    let m = e.to_string();
    assert!(
        m.contains("max_storage_buffer_binding_size") && m.contains(&(1u64 << 50).to_string()),
        "{m}"
    );
}

#[test]
fn every_delegate_and_backend_shares_one_device_opened_with_all_the_adapter_offers() {
    let (payload, named) = affine();
    let b = backend();
    let first = b.init(&payload.encode(), &[], &named).unwrap();
    let d1 = b.device().unwrap();
    // opened with the adapter's limits: a later delegate needing more than
    // wgpu's defaults loads on the same device (no device is re-opened
    // beside work on the old one: see `GpuDevice::shared`)
    let mut bigger = payload.clone();
    let offered = d1.adapter.limits().max_buffer_size;
    assert!(
        offered > bigger.requirements.max_buffer_size,
        "this adapter offers no max_buffer_size beyond wgpu's default"
    );
    assert_eq!(d1.limits.max_buffer_size, offered);
    bigger.requirements.max_buffer_size = offered;
    let _second = b.init(&bigger.encode(), &[], &named).unwrap();
    assert!(Arc::ptr_eq(&d1, &b.device().unwrap()));
    // another backend of the same settings shares it; a capped one does not
    let other = backend();
    let _third = other.init(&payload.encode(), &[], &named).unwrap();
    assert!(Arc::ptr_eq(&d1, &other.device().unwrap()));
    let capped = backend().with_limit_cap(Requirements::default());
    let _fourth = capped.init(&payload.encode(), &[], &named).unwrap();
    let d2 = capped.device().unwrap();
    assert!(!Arc::ptr_eq(&d1, &d2));
    assert_eq!(
        d2.limits.max_buffer_size,
        Requirements::default().max_buffer_size
    );
    drop(first);
}

#[test]
fn load_errors_name_their_cause() {
    let (payload, named) = affine();
    let b = backend();

    let mut bytes = payload.encode();
    bytes[4..6].copy_from_slice(&(VERSION_MAJOR + 1).to_le_bytes());
    let e = b.init(&bytes, &[], &named).err().unwrap();
    assert!(
        e.to_string()
            .contains(&format!("version {}.2", VERSION_MAJOR + 1)),
        "{e}"
    );

    let mut missing = named.clone();
    missing.remove("p.b");
    let e = b.init(&payload.encode(), &[], &missing).err().unwrap();
    assert!(e.to_string().contains("`p.b`"), "{e}");

    let mut short = named.clone();
    short.insert("p.w".into(), vec![0; 20]);
    let e = b.init(&payload.encode(), &[], &short).err().unwrap();
    assert!(e.to_string().contains("named data `p.w`): 20 bytes"), "{e}");

    let mut alias = payload.clone();
    alias.buffers[4].shape = vec![5];
    let e = b.init(&alias.encode(), &[], &named).err().unwrap();
    assert!(
        e.to_string()
            .contains("`w_again` takes 20 bytes of named data `p.w`"),
        "{e}"
    );

    let mut weight_input = payload.clone();
    weight_input.inputs = vec![1];
    let e = b.init(&weight_input.encode(), &[], &named).err().unwrap();
    assert!(
        e.to_string()
            .contains("input 0 (`w`) is not an arena buffer"),
        "{e}"
    );

    let mut broken = payload.clone();
    broken.kernels[0].wgsl = broken.kernels[0].wgsl.replace("b[i % 3u]", "b[i % 3u] + q");
    let e = b.init(&broken.encode(), &[], &named).err().unwrap();
    assert!(e.to_string().contains("kernel `k0_mul_add`"), "{e}");
}

/// A `.pte` whose one instruction is the affine delegate, weights in its
/// named data, run through `etmetal_runtime::Program`.
#[test]
fn pte_with_a_delegate_runs_through_program() {
    let (payload, named) = affine();
    let tensor = |offset| etmetal_pte::Tensor::planned(DType::F32, &[2, 3], 1, offset);
    let mut program = one_delegate_call(
        etmetal_metal::BACKEND_ID,
        payload.encode(),
        tensor(0),
        tensor(32),
    );
    let mut segments: Vec<Segment> = Vec::new();
    for key in ["p.w", "p.b"] {
        etmetal_pte::add_named_data(&mut program, &mut segments, key, named[key].clone(), 16)
            .unwrap();
    }
    let bytes = etmetal_pte::serialize(&program, &segments).unwrap();

    let metal = Arc::new(backend());
    let mut options = LoadOptions::default();
    options.backends.register(metal.clone()).unwrap();
    let program = etmetal_runtime::Program::from_bytes(&bytes)
        .unwrap()
        .with_options(options);
    let mut method = program.method("forward").unwrap();
    let a = Tensor::from_f32(DType::F32, &[2, 3], &[1.0, 1.0, 1.0, 2.0, -1.0, 0.0]).unwrap();
    for _ in 0..2 {
        let out = method.execute(vec![a.clone()]).unwrap();
        assert_eq!(out[0].to_f32_vec(), [1.5, 1.0, 13.0, 8.5, -6.0, 10.0]);
    }
    assert_eq!(metal.stats().pipelines_created, 1);
    assert_eq!(metal.stats().submits, 2);
}
