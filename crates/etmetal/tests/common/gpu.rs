//! Harness of the GPU op tests: a graph (often one node) compiled with the
//! Metal backend in `whole` mode (so every node runs on the GPU), run from
//! the `.pte` through the etmetal runtime on this machine's adapter, and
//! compared with the CPU kernels on the same inputs.
#![allow(dead_code)] // each test file uses part of it

use std::sync::{Arc, OnceLock};

use etmetal::compile::{compile, CompileOptions, Compiled};
use etmetal_core::{DType, Op, Tensor};
use etmetal_graph::{Graph, InputKind, Node, OutputKind, ValueId};
use etmetal_metal::partitioner::{DeviceLimits, PartitionMode, PartitionOptions};
use etmetal_metal::payload::Requirements;
use etmetal_metal::preprocess::{CoopForm, PreprocessOptions, GEMM_COOP_VARIANTS};
use etmetal_metal_runtime::{select_adapter, DeviceChoice, MetalBackend};
use etmetal_runtime::{BackendRegistry, LoadOptions, Method, Program};

/// One backend (one device) for every test of the process. No adapter is a
/// failure with a hint, not a skip.
pub fn backend() -> Arc<MetalBackend> {
    static BACKEND: OnceLock<Arc<MetalBackend>> = OnceLock::new();
    BACKEND
        .get_or_init(|| {
            if let Err(e) = select_adapter(DeviceChoice::Auto) {
                panic!(
                    "GPU tests need an adapter: {e}. On Debian/Ubuntu: \
                     apt-get install mesa-vulkan-drivers libvulkan1 (Mesa lavapipe)"
                );
            }
            // (by default tensor-core alternatives are measured wherever the
            // adapter offers them)
            Arc::new(MetalBackend::new(DeviceChoice::Auto))
        })
        .clone()
}

/// The `.pte` of `graph` with every node delegated (`--partition whole`).
pub fn compile_whole(graph: &Graph) -> Vec<u8> {
    compile_whole_within(graph, &DeviceLimits::default()).pte
}

/// [`compile_whole`] for a device of `limits`.
pub fn compile_whole_within(graph: &Graph, limits: &DeviceLimits) -> Compiled {
    let options = CompileOptions {
        partition: PartitionOptions {
            mode: PartitionMode::Whole,
            limits: limits.clone(),
            ..PartitionOptions::default()
        },
        ..CompileOptions::default()
    };
    compile(graph, &options, &mut |_| {}).unwrap_or_else(|e| panic!("compile: {e}"))
}

/// The `.pte` of `graph` delegated whole, with the kernels of tensor-core
/// form `form` in place of the portable ones and their cooperative-matrix
/// primitives emulated (etmetal-metal's `PreprocessOptions::emulate_coop`,
/// a test mode): they run on any adapter. Panics unless some kernel of
/// that form is in it, so a case that never reaches the tensor-core
/// kernels cannot pass on the portable ones.
/// With the 16×16 form, a GEMM takes its tensor-core variant `variant`
/// (below [`GEMM_COOP_VARIANTS`]; the first where that one does not apply).
pub fn compile_emulating(graph: &Graph, form: CoopForm, variant: usize) -> Vec<u8> {
    compile_emulating_report(graph, form, variant).pte
}

/// [`compile_emulating`], with what went where.
pub fn compile_emulating_report(graph: &Graph, form: CoopForm, variant: usize) -> Compiled {
    let options = CompileOptions {
        partition: PartitionOptions {
            mode: PartitionMode::Whole,
            ..PartitionOptions::default()
        },
        preprocess: PreprocessOptions {
            emulate_coop: Some(form),
            emulate_variant: variant,
            ..PreprocessOptions::default()
        },
        ..CompileOptions::default()
    };
    let compiled = compile(graph, &options, &mut |_| {})
        .unwrap_or_else(|e| panic!("compile emulating {form:?} variant {variant}: {e}"));
    let tag = format!("_{}", form.emulated_tag());
    let emulated = compiled
        .methods
        .iter()
        .flat_map(|m| &m.partitions)
        .flat_map(|p| &p.payload.kernels)
        .any(|k| k.name.ends_with(&tag));
    assert!(
        emulated,
        "no {form:?} tensor-core kernel: the case misses them"
    );
    compiled
}

/// `case(n)`: a graph and its inputs with a dim of size `n`, the same
/// graph at every `n` but for that dim (constants alike). The graph at
/// `bound` with that dim, `at` (`(user input, dim)` pairs), made the
/// dynamic symbol `s` in `1..=bound`, compiled emulating `emulated` (a
/// form and its GEMMs' variant; `None`: as compiled, the alternatives where the adapter offers them), runs at
/// each of `sizes` in one loaded method and matches the CPU kernels on
/// `case(n)`; at each size some kernel of the form is among the dispatches
/// that run (the bucket of that size has them).
pub fn check_dynamic(
    case: impl Fn(usize) -> (Graph, Vec<Tensor>),
    at: &[(usize, usize)],
    bound: usize,
    sizes: &[usize],
    tol: f32,
    emulated: Option<Emulation>,
    what: &str,
) {
    use etmetal_core::sym::{SymExpr, SymRange};
    let (mut graph, _) = case(bound);
    graph.sym.ranges.insert(
        "s".into(),
        SymRange {
            min: 1,
            max: bound as i64,
        },
    );
    let users: Vec<ValueId> = graph.user_inputs().collect();
    for &(input, dim) in at {
        let v = users[input];
        let mut dims: Vec<SymExpr> = graph
            .value(v)
            .shape
            .iter()
            .map(|&n| SymExpr::Const(n as i64))
            .collect();
        dims[dim] = SymExpr::sym("s");
        graph.set_sym_dims(v, dims).unwrap();
    }
    for node in graph.nodes.clone() {
        etmetal_graph::infer_sym::assign_sym(&mut graph, &node).unwrap();
    }
    let compiled = match emulated {
        Some((form, variant)) => compile_emulating_report(&graph, form, variant),
        None => compile_whole_within(&graph, &DeviceLimits::default()),
    };
    let parts = &compiled.methods[0].partitions;
    assert_eq!(parts.len(), 1, "{what}: not delegated whole");
    let payload = &parts[0].payload;
    assert_eq!(payload.symbols.len(), 1, "{what}: symbols");
    let form = emulated.map(|(f, _)| f);
    let tag = form.map(|f| format!("_{}", f.emulated_tag()));
    let mut method = load_method(&compiled.pte);
    for &n in sizes {
        let running: Vec<&str> = payload
            .dispatches
            .iter()
            .filter(|d| {
                d.groups
                    .as_ref()
                    .is_none_or(|g| g.eval(&[n as i64]).unwrap() > 0)
            })
            .map(|d| payload.kernels[d.kernel].name.as_str())
            .collect();
        if let Some(tag) = &tag {
            assert!(
                running.iter().any(|k| k.ends_with(tag)),
                "{what} at {n}: no {form:?} kernel runs: {running:?}"
            );
        }
        let (reference, inputs) = case(n);
        let expected = etmetal::eval::run_graph(&reference, inputs.clone())
            .unwrap_or_else(|e| panic!("{what} at {n}: CPU reference: {e}"));
        let got = method
            .execute(inputs)
            .unwrap_or_else(|e| panic!("{what} at {n}: execute: {e}"));
        assert_eq!(got.len(), expected.len(), "{what}: output count");
        for (k, (g, e)) in got.iter().zip(&expected).enumerate() {
            assert_close(
                g,
                e,
                tol,
                &format!("{what} at {n} emulating {emulated:?} output {k}"),
            );
        }
    }
}

/// `graph` on the GPU, with tensor-core form `form` emulated
/// ([`compile_emulating`], GEMMs in `variant`), matches the CPU kernels
/// on `inputs`.
pub fn check_graph_emulating(
    graph: &Graph,
    inputs: Vec<Tensor>,
    tol: f32,
    (form, variant): Emulation,
    what: &str,
) {
    let expected = etmetal::eval::run_graph(graph, inputs.clone())
        .unwrap_or_else(|e| panic!("{what}: CPU reference: {e}"));
    let got = run_pte(compile_emulating(graph, form, variant), inputs);
    assert_eq!(got.len(), expected.len(), "{what}: output count");
    for (k, (g, e)) in got.iter().zip(&expected).enumerate() {
        let what = format!("{what} emulating {form:?} variant {variant} output {k}");
        assert_close(g, e, tol, &what);
    }
}

/// A tensor-core form emulated, with the variant its GEMMs take.
pub type Emulation = (CoopForm, usize);

/// Each tensor-core form of `forms` with each of its GEMM variants (the
/// 16×16 form's several; the 8×8 form's one).
pub fn emulations(forms: &[CoopForm]) -> Vec<Emulation> {
    let variants = |f| match f {
        CoopForm::Half16 => GEMM_COOP_VARIANTS,
        CoopForm::Float8 => 1,
    };
    forms
        .iter()
        .flat_map(|&f| (0..variants(f)).map(move |v| (f, v)))
        .collect()
}

/// Whether this machine's adapter offers what the tensor-core kernels
/// need, read from the adapter itself (not through the runtime's choice).
pub fn adapter_offers_coop() -> bool {
    use etmetal_metal_runtime::wgpu;
    let (_, adapter) = select_adapter(DeviceChoice::Auto).unwrap();
    let info = adapter.get_info();
    let features = wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX
        | wgpu::Features::SHADER_F16
        | wgpu::Features::SUBGROUP;
    adapter.features().contains(features)
        && (info.subgroup_min_size, info.subgroup_max_size) == (32, 32)
        && adapter.limits().max_compute_workgroup_storage_size >= 32768
        && adapter.cooperative_matrix_properties().iter().any(|c| {
            (c.m_size, c.n_size, c.k_size) == (16, 16, 16)
                && c.ab_type == wgpu::CooperativeScalarType::F16
                && c.cr_type == wgpu::CooperativeScalarType::F32
        })
}

/// The `forward` method of a `.pte`, with the GPU backend registered.
pub fn load_method(pte: &[u8]) -> Method {
    load_method_on(backend(), pte)
}

/// The `forward` method of a `.pte`, with `gpu` registered.
pub fn load_method_on(gpu: Arc<MetalBackend>, pte: &[u8]) -> Method {
    let mut backends = BackendRegistry::new();
    backends.register(gpu).unwrap();
    let options = LoadOptions {
        backends,
        ..LoadOptions::default()
    };
    Program::from_bytes(pte)
        .unwrap_or_else(|e| panic!("load: {e}"))
        .with_options(options)
        .method("forward")
        .unwrap_or_else(|e| panic!("method: {e}"))
}

/// Run a `.pte` with the GPU backend registered.
pub fn run_pte(pte: Vec<u8>, inputs: Vec<Tensor>) -> Vec<Tensor> {
    load_method(&pte)
        .execute(inputs)
        .unwrap_or_else(|e| panic!("execute: {e}"))
}

/// Deterministic values in [-1, 1) (xorshift), as `dtype`.
pub fn random(dtype: DType, shape: &[usize], seed: u64) -> Tensor {
    let n: usize = shape.iter().product();
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let values: Vec<f32> = (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect();
    Tensor::from_f32(DType::F32, shape, &values)
        .unwrap()
        .cast(dtype)
        .unwrap()
}

/// Integers in `0..high` as int64.
pub fn random_indices(shape: &[usize], high: i64, seed: u64) -> Tensor {
    let r = random(DType::F32, shape, seed);
    let v: Vec<i64> = r
        .to_f32_vec()
        .iter()
        .map(|x| (((x + 1.0) / 2.0) * high as f32) as i64 % high)
        .collect();
    Tensor::from_i64(DType::I64, shape, &v).unwrap()
}

/// A graph around one op; inputs are user inputs, weights constants, and
/// inputs may be read through a permute (a non-contiguous view).
pub struct OpCase {
    graph: Graph,
    slots: Vec<Option<ValueId>>,
    inputs: Vec<Tensor>,
    op: Op,
}

impl OpCase {
    pub fn new(op: Op) -> OpCase {
        OpCase {
            graph: Graph::default(),
            slots: vec![],
            inputs: vec![],
            op,
        }
    }

    pub fn input(mut self, t: Tensor) -> OpCase {
        let v = self.user_input(&t);
        self.slots.push(Some(v));
        self
    }

    /// The op reads `permute(t, dims)`: `t` is what the caller passes.
    pub fn input_permuted(self, t: Tensor, dims: &[usize]) -> OpCase {
        let dims = dims.to_vec();
        self.input_through(t, vec![Op::Permute { dims }])
    }

    /// The op reads `t` through the view ops `views`, in order (a
    /// permute, GQA's unsqueeze, expand and reshape of k and v, …).
    pub fn input_through(mut self, t: Tensor, views: Vec<Op>) -> OpCase {
        let mut v = self.user_input(&t);
        let slot = self.slots.len();
        for (k, op) in views.into_iter().enumerate() {
            let mut node = Node {
                name: format!("view{slot}_{k}"),
                target: "test".into(),
                op,
                inputs: vec![Some(v)],
                outputs: vec![],
            };
            let outs = etmetal_graph::infer::infer(&self.graph, &node)
                .unwrap_or_else(|e| panic!("infer: {e}"));
            let (dtype, shape) = outs.into_iter().next().unwrap();
            v = self.graph.add_value(format!("v{slot}_{k}"), dtype, shape);
            node.outputs.push(v);
            self.graph.nodes.push(node);
        }
        self.slots.push(Some(v));
        self
    }

    pub fn weight(mut self, t: Tensor) -> OpCase {
        let name = format!("w{}", self.slots.len());
        let v = self.graph.add_constant(name.clone(), t);
        self.graph
            .inputs
            .push((v, InputKind::Parameter { fqn: name }));
        self.slots.push(Some(v));
        self
    }

    pub fn absent(mut self) -> OpCase {
        self.slots.push(None);
        self
    }

    fn user_input(&mut self, t: &Tensor) -> ValueId {
        let v = self.graph.add_value(
            format!("x{}", self.inputs.len()),
            t.dtype(),
            t.shape().to_vec(),
        );
        self.graph.inputs.push((v, InputKind::User));
        self.inputs.push(t.clone());
        v
    }

    /// The graph and its user inputs.
    pub fn build(mut self) -> (Graph, Vec<Tensor>) {
        let mut node = Node {
            name: "op".into(),
            target: "test".into(),
            op: self.op.clone(),
            inputs: self.slots.clone(),
            outputs: vec![],
        };
        let outs = etmetal_graph::infer::infer(&self.graph, &node)
            .unwrap_or_else(|e| panic!("infer: {e}"));
        for (k, (dtype, shape)) in outs.into_iter().enumerate() {
            let v = self.graph.add_value(format!("y{k}"), dtype, shape);
            node.outputs.push(v);
            self.graph.outputs.push((v, OutputKind::User));
        }
        self.graph.nodes.push(node);
        (self.graph, self.inputs)
    }

    /// GPU and CPU agree within `tol` (absolute and relative).
    pub fn check(self, tol: f32) {
        let what = format!("{:?}", self.op);
        let (graph, inputs) = self.build();
        check_graph(&graph, inputs, tol, &what);
    }

    /// [`OpCase::check`] (the tensor-core alternatives where the adapter
    /// offers them), then again with each of `forms` emulated
    /// ([`check_graph_emulating`]; a GEMM in its first variant).
    pub fn check_coop(self, tol: f32, forms: &[CoopForm]) {
        let emulated: Vec<_> = forms.iter().map(|&f| (f, 0)).collect();
        self.check_coop_emulating(tol, &emulated);
    }

    /// [`OpCase::check_coop`] in every GEMM variant of each form
    /// ([`emulations`]).
    pub fn check_gemm_coop(self, tol: f32, forms: &[CoopForm]) {
        self.check_coop_emulating(tol, &emulations(forms));
    }

    /// [`OpCase::check`], then again emulating each of `emulated` (a form
    /// and its GEMMs' variant).
    pub fn check_coop_emulating(self, tol: f32, emulated: &[Emulation]) {
        let what = format!("{:?}", self.op);
        let (graph, inputs) = self.build();
        check_graph(&graph, inputs.clone(), tol, &what);
        for &e in emulated {
            check_graph_emulating(&graph, inputs.clone(), tol, e, &what);
        }
    }

    /// [`OpCase::check`] compiled for a `max_buffer_bytes` buffer limit
    /// and run on a device offering no larger binding: the payload needs
    /// no more than the limit the partitioner checked.
    pub fn check_within(self, tol: f32, max_buffer_bytes: u64) {
        let what = format!("{:?} within {max_buffer_bytes} bytes", self.op);
        let (graph, inputs) = self.build();
        let expected = etmetal::eval::run_graph(&graph, inputs.clone())
            .unwrap_or_else(|e| panic!("{what}: CPU reference: {e}"));
        let limits = DeviceLimits {
            max_buffer_bytes,
            ..DeviceLimits::default()
        };
        let compiled = compile_whole_within(&graph, &limits);
        let parts = &compiled.methods[0].partitions;
        assert_eq!(parts.len(), 1, "{what}: not delegated whole");
        let need = parts[0]
            .payload
            .requirements
            .max_storage_buffer_binding_size;
        assert!(need <= max_buffer_bytes, "{what}: needs {need} bytes");
        let cap = Requirements {
            max_storage_buffer_binding_size: max_buffer_bytes,
            ..Requirements::default()
        };
        check_capped(cap, &compiled.pte, inputs, &expected, tol, &what);
    }
}

/// `pte` run on the adapter with its limits capped at `cap` gives
/// `expected` within `tol`.
pub fn check_capped(
    cap: Requirements,
    pte: &[u8],
    inputs: Vec<Tensor>,
    expected: &[Tensor],
    tol: f32,
    what: &str,
) {
    let _ = backend(); // the adapter check
    let gpu = MetalBackend::new(DeviceChoice::Auto).with_limit_cap(cap);
    let got = load_method_on(Arc::new(gpu), pte)
        .execute(inputs)
        .unwrap_or_else(|e| panic!("{what}: execute: {e}"));
    assert_eq!(got.len(), expected.len(), "{what}: output count");
    for (k, (g, e)) in got.iter().zip(expected).enumerate() {
        assert_close(g, e, tol, &format!("{what} output {k}"));
    }
}

/// `graph` on the GPU matches the CPU kernels on `inputs`.
pub fn check_graph(graph: &Graph, inputs: Vec<Tensor>, tol: f32, what: &str) {
    let expected = etmetal::eval::run_graph(graph, inputs.clone())
        .unwrap_or_else(|e| panic!("{what}: CPU reference: {e}"));
    let got = run_pte(compile_whole(graph), inputs);
    assert_eq!(got.len(), expected.len(), "{what}: output count");
    for (k, (g, e)) in got.iter().zip(&expected).enumerate() {
        assert_close(g, e, tol, &format!("{what} output {k}"));
    }
}

pub fn assert_close(got: &Tensor, expected: &Tensor, tol: f32, what: &str) {
    assert_eq!(got.dtype(), expected.dtype(), "{what}: dtype");
    assert_eq!(got.shape(), expected.shape(), "{what}: shape");
    if !expected.dtype().is_float() {
        assert_eq!(got.to_i64_vec(), expected.to_i64_vec(), "{what}: values");
        return;
    }
    let (g, e) = (got.to_f32_vec(), expected.to_f32_vec());
    for (i, (a, b)) in g.iter().zip(&e).enumerate() {
        let ok = (a.is_nan() && b.is_nan()) || a == b || (a - b).abs() <= tol + tol * b.abs();
        assert!(ok, "{what}: element {i}: GPU {a} vs CPU {b} (tol {tol})");
    }
}
