//! GPU faults on this machine's adapter (in CI: Mesa lavapipe): a device
//! with lowered limits, allocations beyond them, kernels the device rejects.
//! Each is a `Result` error naming what failed, never a panic, and the
//! device still runs good delegates afterwards.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use etmetal::compile::{compile, CompileOptions};
use etmetal_core::{npy, DType, Error, ErrorKind, Tensor, View, ViewMut};
use etmetal_metal::payload::{
    to_gpu, Access, Buffer, Dispatch, Kernel, Location, Payload, Requirements, ARENA_ALIGN,
};
use etmetal_metal_runtime::{select_adapter, DeviceChoice, MetalBackend};
use etmetal_runtime::{Backend, BackendRegistry, DelegateArg, LoadOptions, Program};

type Named = HashMap<String, Vec<u8>>;

/// A fresh backend (its own device), capped at `cap` when given.
fn backend(cap: Option<Requirements>) -> MetalBackend {
    if let Err(e) = select_adapter(DeviceChoice::Auto) {
        panic!(
            "GPU tests need an adapter: {e}. On Debian/Ubuntu: \
             apt-get install mesa-vulkan-drivers libvulkan1 (Mesa lavapipe)"
        );
    }
    let b = MetalBackend::new(DeviceChoice::Auto);
    match cap {
        Some(cap) => b.with_limit_cap(cap),
        None => b,
    }
}

/// `y = x * 2 + w` over `n` f32 elements: `x` (input) and `y` (output) in
/// arena 0, `w` a weight.
fn scale(n: usize) -> (Payload, Named) {
    let wgsl = format!(
        "@group(0) @binding(0) var<storage, read_write> x: array<f32>;\n\
         @group(0) @binding(1) var<storage, read> w: array<f32>;\n\
         @group(0) @binding(2) var<storage, read_write> y: array<f32>;\n\
         @compute @workgroup_size(64) fn main(@builtin(global_invocation_id) g: vec3<u32>) {{\n\
           let i = g.x + g.y * 64u * 1024u;\n\
           if (i < {n}u) {{ y[i] = x[i] * 2.0 + w[i]; }}\n\
         }}\n"
    );
    let bytes = 4 * n as u64;
    let y_at = bytes.next_multiple_of(ARENA_ALIGN);
    let groups = n.div_ceil(64) as u32;
    let buffer = |name: &str, location| Buffer {
        name: name.into(),
        dtype: DType::F32,
        shape: vec![n],
        location,
        dims: vec![],
    };
    let payload = Payload {
        buffers: vec![
            buffer(
                "x",
                Location::Arena {
                    arena: 0,
                    offset: 0,
                },
            ),
            buffer("w", Location::Weight { key: "p.w".into() }),
            buffer(
                "y",
                Location::Arena {
                    arena: 0,
                    offset: y_at,
                },
            ),
        ],
        kernels: vec![Kernel {
            name: "k0_mul_add".into(),
            ops: vec!["mul".into(), "add".into()],
            wgsl,
            msl: String::new(),
            entry_point: "main".into(),
            bindings: vec![Access::ReadWrite, Access::Read, Access::ReadWrite],
            workgroup_size: [64, 1, 1],
            sizes: false,
        }],
        dispatches: vec![Dispatch {
            kernel: 0,
            nodes: vec!["mul".into(), "add".into()],
            buffers: vec![0, 1, 2],
            workgroups: [groups.min(1024), groups.div_ceil(1024), 1],
            groups: None,
            alternatives: vec![],
        }],
        inputs: vec![0],
        outputs: vec![2],
        arenas: vec![y_at + bytes],
        requirements: Requirements {
            max_storage_buffer_binding_size: bytes,
            max_buffer_size: y_at + bytes,
            max_storage_buffers_per_shader_stage: 3,
            max_compute_workgroup_storage_size: 0,
            max_compute_invocations_per_workgroup: 64,
            ..Requirements::default()
        },
        state: vec![],
        checks: vec![],
        symbols: vec![],
    };
    let w: Vec<f32> = (0..n).map(|i| i as f32).collect();
    let w = to_gpu(&Tensor::from_f32(DType::F32, &[n], &w).unwrap(), "w")
        .unwrap()
        .into_owned();
    (payload, HashMap::from([("p.w".to_string(), w)]))
}

/// Load `payload` on `b` and run it once on `x`; the output or the first error.
fn run(b: &MetalBackend, payload: &Payload, named: &Named, x: &Tensor) -> Result<Tensor, Error> {
    let mut h = b.init(&payload.encode(), &[], named)?;
    let out = &payload.buffers[payload.outputs[0]];
    let mut y = Tensor::zeros(out.dtype, &out.shape)?;
    h.execute(&mut [
        DelegateArg::Tensor(View::of(x)),
        DelegateArg::Output(ViewMut::of(&mut y)),
    ])?;
    Ok(y)
}

/// `scale(n)` runs on `b` and computes `x * 2 + w`.
fn assert_scale_runs(b: &MetalBackend, n: usize) {
    let (payload, named) = scale(n);
    let x = Tensor::from_f32(DType::F32, &[n], &vec![1.5; n]).unwrap();
    let y = run(b, &payload, &named, &x).unwrap_or_else(|e| panic!("scale({n}): {e}"));
    let want: Vec<f32> = (0..n).map(|i| 3.0 + i as f32).collect();
    assert_eq!(y.to_f32_vec(), want);
}

fn load_error(b: &MetalBackend, payload: &Payload, named: &Named) -> Error {
    match b.init(&payload.encode(), &[], named) {
        Ok(_) => panic!("the payload loaded"),
        Err(e) => e,
    }
}

fn assert_names(e: &Error, kind: ErrorKind, parts: &[&str]) {
    let m = e.to_string();
    assert_eq!(e.kind(), kind, "{m}");
    for p in parts {
        assert!(m.contains(p), "`{p}` missing from: {m}");
    }
}

#[test]
fn a_device_capped_below_the_payload_fails_at_load_naming_limit_need_and_offer() {
    let (payload, named) = scale(1000);
    let need = payload.requirements.clone();
    type Lower = fn(&mut Requirements);
    let cases: [(&str, Lower, u64, u64); 5] = [
        (
            "max_storage_buffer_binding_size",
            |c| c.max_storage_buffer_binding_size = 2048,
            need.max_storage_buffer_binding_size,
            2048,
        ),
        (
            "max_buffer_size",
            |c| c.max_buffer_size = 4096,
            need.max_buffer_size,
            4096,
        ),
        (
            "max_storage_buffers_per_shader_stage",
            |c| c.max_storage_buffers_per_shader_stage = 2,
            3,
            2,
        ),
        (
            "max_compute_invocations_per_workgroup",
            |c| c.max_compute_invocations_per_workgroup = 32,
            64,
            32,
        ),
        (
            "max_compute_workgroups_per_dimension",
            |c| c.max_compute_workgroups_per_dimension = 1000,
            need.max_compute_workgroups_per_dimension.into(),
            1000,
        ),
    ];
    for (limit, lower, need, offer) in cases {
        let mut cap = Requirements::default();
        lower(&mut cap);
        let e = load_error(&backend(Some(cap)), &payload, &named);
        assert_names(
            &e,
            ErrorKind::Limit,
            &[
                &format!("offers {limit} = {offer}"),
                &format!("needs {need}"),
                "with capped limits",
            ],
        );
    }

    // Workgroup memory and shader-f16, which `scale` does not use.
    let mut shared = payload.clone();
    shared.requirements.max_compute_workgroup_storage_size = 8192;
    let cap = Requirements {
        max_compute_workgroup_storage_size: 4096,
        ..Requirements::default()
    };
    let e = load_error(&backend(Some(cap)), &shared, &named);
    assert_names(
        &e,
        ErrorKind::Limit,
        &["max_compute_workgroup_storage_size = 4096", "needs 8192"],
    );
    let mut f16 = payload.clone();
    f16.requirements.shader_f16 = true;
    let e = load_error(&backend(Some(Requirements::default())), &f16, &named);
    assert_names(&e, ErrorKind::Limit, &["lacks the shader-f16 feature"]);

    // Capped exactly at what it needs, it loads and runs.
    assert_scale_runs(&backend(Some(payload.requirements.clone())), 1000);
}

#[test]
fn allocations_beyond_the_device_are_limit_errors() {
    // A payload that understates what it needs gets a device with less than
    // it allocates; the delegate's own checks name each buffer.
    let n = 1 << 16; // 256 KiB a tensor
    let cap = Requirements {
        max_storage_buffer_binding_size: 64 << 10,
        max_buffer_size: 128 << 10,
        ..Requirements::default()
    };
    let b = backend(Some(cap.clone()));
    let (mut payload, named) = scale(n);
    payload.requirements = Requirements {
        max_compute_workgroup_storage_size: 0,
        ..cap.clone()
    };
    let e = load_error(&b, &payload, &named);
    assert_names(
        &e,
        ErrorKind::Limit,
        &[
            &format!("arena 0 of {} bytes", payload.arenas[0]),
            "max_buffer_size = 131072",
        ],
    );

    // Split into two arenas that fit, a binding is still too large.
    let (mut split, _) = scale(n);
    split.requirements = payload.requirements.clone();
    split.arenas = vec![4 * n as u64; 2];
    split.buffers[2].location = Location::Arena {
        arena: 1,
        offset: 0,
    };
    let e = load_error(
        &backend(Some(Requirements {
            max_buffer_size: 4 * n as u64,
            ..cap.clone()
        })),
        &split,
        &named,
    );
    assert_names(
        &e,
        ErrorKind::Limit,
        &[
            "dispatch 0 (kernel `k0_mul_add`) binds `x` of 262144 bytes",
            "max_storage_buffer_binding_size = 65536",
        ],
    );
    let e = load_error(&b, &split, &named);
    assert_names(
        &e,
        ErrorKind::Limit,
        &["arena 0 of 262144 bytes", "max_buffer_size = 131072"],
    );

    // Beyond what the adapter itself offers (no cap), before any allocation.
    let b = backend(None);
    let (mut huge, named) = scale(1000);
    let offered = select_adapter(DeviceChoice::Auto)
        .unwrap()
        .1
        .limits()
        .max_buffer_size;
    let beyond = offered.checked_add(1).expect("the adapter offers u64::MAX");
    huge.requirements.max_buffer_size = beyond;
    let e = load_error(&b, &huge, &named);
    assert_names(
        &e,
        ErrorKind::Limit,
        &[
            &format!("max_buffer_size = {offered}"),
            &format!("needs {beyond}"),
        ],
    );
    let (mut huge, named) = scale(1000);
    huge.arenas[0] = u64::MAX - 1;
    let e = load_error(&b, &huge, &named);
    assert_names(
        &e,
        ErrorKind::Limit,
        &[
            &format!("arena 0 of {} bytes", u64::MAX - 1),
            "max_buffer_size",
        ],
    );
    // The device is fine afterwards.
    assert_scale_runs(&b, 1000);
}

#[test]
fn kernels_the_device_rejects_fail_with_errors_naming_the_kernel() {
    let b = backend(None);
    let (good, named) = scale(1000);
    let x = Tensor::from_f32(DType::F32, &[1000], &[1.0; 1000]).unwrap();
    let with_wgsl = |edit: &dyn Fn(&str) -> String| {
        let mut p = good.clone();
        p.kernels[0].wgsl = edit(&p.kernels[0].wgsl);
        p
    };
    // more invocations than the device offers (the payload says 64; the
    // device is capped at wgpu's default of 256)
    let wide = with_wgsl(&|w| w.replace("@workgroup_size(64)", "@workgroup_size(1024)"));
    let capped = backend(Some(Requirements::default()));
    let Err(e) = run(&capped, &wide, &named, &x) else {
        panic!("a 1024-wide kernel ran on a device capped at 256 invocations");
    };
    assert_names(
        &e,
        ErrorKind::Internal,
        &[
            "building kernel `k0_mul_add`: ",
            "max_compute_invocations_per_workgroup",
        ],
    );
    // (kernel, what wgpu's message says)
    let rejected = [
        // the kernel writes a binding the payload binds read-only
        (
            with_wgsl(&|w| w.replace("var<storage, read> w", "var<storage, read_write> w")),
            "binding: 1 }",
        ),
        // a binding the payload does not have
        (
            with_wgsl(&|w| {
                format!("@group(0) @binding(3) var<storage, read_write> z: array<f32>;\n{w}")
                    .replace("y[i] = ", "z[0] = 1.0; y[i] = ")
            }),
            "binding: 3 }",
        ),
        // not WGSL
        (
            with_wgsl(&|w| w.replace("fn main", "fn main(")),
            "parsing error",
        ),
    ];
    for (k, (p, says)) in rejected.iter().enumerate() {
        let Err(e) = run(&b, p, &named, &x) else {
            panic!("rejected kernel {k} ran: {}", p.kernels[0].wgsl);
        };
        assert_names(
            &e,
            ErrorKind::Internal,
            &["building kernel `k0_mul_add`: ", says],
        );
    }
    // More workgroup memory than the device offers (wgpu does not check it
    // and lavapipe runs it; a GPU's driver would not).
    let shared = with_wgsl(&|w| {
        format!("var<workgroup> tile: array<f32, 8192>;\n{w}")
            .replace("y[i] = ", "tile[i] = 1.0; y[i] = tile[0] + ")
    });
    let limit = capped
        .device()
        .map(|d| d.limits.max_compute_workgroup_storage_size);
    assert_eq!(limit, Some(16384), "capped at wgpu's default");
    let e = run(&capped, &shared, &named, &x).expect_err("32 KiB of workgroup memory ran");
    assert_names(
        &e,
        ErrorKind::Limit,
        &[
            "kernel `k0_mul_add` uses 32768 bytes of workgroup memory",
            "max_compute_workgroup_storage_size = 16384",
        ],
    );
    // A fixed-size binding larger than the range bound: wgpu checks the
    // size when the dispatch is recorded.
    let fixed = with_wgsl(&|w| w.replace("y: array<f32>", "y: array<f32, 4096>"));
    let e = run(&b, &fixed, &named, &x).expect_err("a too-small binding ran");
    assert_names(
        &e,
        ErrorKind::Internal,
        &["running kernels [k0_mul_add]: ", "size 4000", "16384"],
    );
    assert_scale_runs(&b, 1000);
}

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(name)
}

/// `name.pt2` compiled with the Metal backend (default options) and the
/// union of its partitions' requirements.
fn compiled(name: &str) -> (Vec<u8>, Requirements) {
    let graph = etmetal_graph::load_pt2(&fixture(&format!("{name}.pt2"))).unwrap();
    let c = compile(&graph, &CompileOptions::default(), &mut |_| {}).unwrap();
    let parts = &c.methods[0].partitions;
    assert!(!parts.is_empty(), "{name}: nothing went to the GPU");
    let need = parts
        .iter()
        .fold(parts[0].payload.requirements.clone(), |a, p| {
            a.union(&p.payload.requirements)
        });
    (c.pte, need)
}

fn load(pte: &[u8], backend: MetalBackend) -> etmetal_core::Result<etmetal_runtime::Method> {
    let mut backends = BackendRegistry::new();
    backends.register(Arc::new(backend))?;
    Program::from_bytes(pte)?
        .with_options(LoadOptions {
            backends,
            ..LoadOptions::default()
        })
        .method("forward")
}

#[test]
fn a_compiled_model_on_a_device_with_less_than_it_needs_fails_at_load() {
    let (pte, need) = compiled("gpt_block");
    type Lower = fn(&mut Requirements) -> (&'static str, u64, u64);
    let lowerings: [Lower; 5] = [
        |c| {
            let n = c.max_storage_buffer_binding_size;
            c.max_storage_buffer_binding_size = n / 2;
            ("max_storage_buffer_binding_size", n, n / 2)
        },
        |c| {
            let n = c.max_buffer_size;
            c.max_buffer_size = n / 2;
            ("max_buffer_size", n, n / 2)
        },
        |c| {
            let n = c.max_storage_buffers_per_shader_stage;
            c.max_storage_buffers_per_shader_stage = n - 1;
            (
                "max_storage_buffers_per_shader_stage",
                n.into(),
                (n - 1).into(),
            )
        },
        |c| {
            let n = c.max_compute_workgroup_storage_size;
            c.max_compute_workgroup_storage_size = n / 2;
            (
                "max_compute_workgroup_storage_size",
                n.into(),
                (n / 2).into(),
            )
        },
        |c| {
            let n = c.max_compute_invocations_per_workgroup;
            c.max_compute_invocations_per_workgroup = n / 2;
            (
                "max_compute_invocations_per_workgroup",
                n.into(),
                (n / 2).into(),
            )
        },
    ];
    for lower in lowerings {
        let mut cap = need.clone();
        let (limit, n, offer) = lower(&mut cap);
        let e = match load(&pte, backend(Some(cap))) {
            Ok(_) => panic!("gpt_block loaded with {limit} = {offer} < {n}"),
            Err(e) => e,
        };
        assert_names(
            &e,
            ErrorKind::Limit,
            &[&format!("offers {limit} = {offer}"), &format!("needs {n}")],
        );
    }
}

/// Opened with exactly the limits a payload states, its kernels build and
/// run: the stated requirements are what the kernels use.
#[test]
fn compiled_models_run_on_a_device_capped_at_their_stated_requirements() {
    for name in ["gpt_block", "mlp", "llama_block", "mobile_block"] {
        let (pte, need) = compiled(name);
        let mut method = load(&pte, backend(Some(need)))
            .unwrap_or_else(|e| panic!("{name}: load at its stated requirements: {e}"));
        let inputs: Vec<Tensor> = (0..)
            .map(|k| fixture(&format!("{name}.input_{k}.npy")))
            .take_while(|p| p.exists())
            .map(|p| npy::read(&p).unwrap())
            .collect();
        let outputs = method
            .execute(inputs)
            .unwrap_or_else(|e| panic!("{name}: execute: {e}"));
        for (k, got) in outputs.iter().enumerate() {
            let want = npy::read(&fixture(&format!("{name}.output_{k}.npy"))).unwrap();
            assert_eq!(got.shape(), want.shape(), "{name} output {k}");
            for (i, (a, b)) in got.to_f64_vec().iter().zip(want.to_f64_vec()).enumerate() {
                assert!(
                    (a - b).abs() <= 1e-4 + 1e-4 * b.abs(),
                    "{name} output {k}[{i}]: GPU {a} vs expected {b}"
                );
            }
        }
    }
}
