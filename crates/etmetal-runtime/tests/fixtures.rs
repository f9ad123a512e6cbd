//! Every ExecuTorch-made fixture of etmetal-pte runs and matches the outputs
//! ExecuTorch's own runtime stored beside it; bad inputs and programs fail
//! with errors that say what is wrong.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use etmetal_core::{npy, DType, ErrorKind, Result, Tensor};
use etmetal_pte::CompileSpec;
use etmetal_runtime::{
    Backend, BackendRegistry, DelegateArg, DelegateHandle, LoadOptions, NamedData, Program,
};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../etmetal-pte/tests/fixtures")
}

fn numbered(name: &str, kind: &str) -> Vec<Tensor> {
    (0..)
        .map(|i| fixtures().join(format!("{name}.{kind}_{i}.npy")))
        .take_while(|p| p.exists())
        .map(|p| npy::read(&p).unwrap())
        .collect()
}

fn assert_close(name: &str, got: &[Tensor], want: &[Tensor]) {
    assert_eq!(got.len(), want.len(), "{name}: output count");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert_eq!(g.dtype(), w.dtype(), "{name} output {i} dtype");
        assert_eq!(g.shape(), w.shape(), "{name} output {i} shape");
        if w.dtype().is_float() {
            for (a, b) in g.to_f64_vec().iter().zip(w.to_f64_vec()) {
                assert!(
                    (a - b).abs() <= 1e-5 + 1e-5 * b.abs(),
                    "{name} output {i}: {a} vs {b}"
                );
            }
        } else {
            assert_eq!(g.to_i64_vec(), w.to_i64_vec(), "{name} output {i}");
        }
    }
}

#[test]
fn portable_fixtures_match_executorch() {
    for name in ["linear_relu", "mlp", "conv_block", "int_bool"] {
        let program = Program::load(fixtures().join(format!("{name}.pte"))).unwrap();
        let mut method = program.method("forward").unwrap();
        let inputs = numbered(name, "input");
        let specs = method.input_specs();
        assert_eq!(specs.len(), inputs.len(), "{name}");
        for (s, t) in specs.iter().zip(&inputs) {
            assert_eq!(
                (s.dtype, s.shape.as_slice()),
                (t.dtype(), t.shape()),
                "{name}"
            );
        }
        let want = numbered(name, "output");
        assert_eq!(method.output_specs().len(), want.len());
        // Twice: the second run must not see state left by the first.
        for _ in 0..2 {
            let got = method.execute(inputs.clone()).unwrap();
            assert_close(name, &got, &want);
        }
    }
}

#[test]
fn from_bytes_matches_load() {
    let path = fixtures().join("mlp.pte");
    let program = Program::from_bytes(&std::fs::read(path).unwrap()).unwrap();
    let got = program
        .method("forward")
        .unwrap()
        .execute(numbered("mlp", "input"))
        .unwrap();
    assert_close("mlp", &got, &numbered("mlp", "output"));
}

#[test]
fn unknown_method_lists_the_available_ones() {
    let program = Program::load(fixtures().join("mlp.pte")).unwrap();
    let e = program.method("backward").err().unwrap();
    assert_eq!(e.kind(), ErrorKind::InvalidInput);
    assert!(e.to_string().contains("methods: forward"), "{e}");
}

#[test]
fn wrong_inputs_are_named() {
    let program = Program::load(fixtures().join("mlp.pte")).unwrap();
    let mut m = program.method("forward").unwrap();
    let good = numbered("mlp", "input");
    let shape = good[0].shape().to_vec();

    let e = m.execute(vec![]).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidInput);
    assert!(e.to_string().contains("takes 1 input(s), 0 given"), "{e}");

    let e = m
        .execute(vec![
            Tensor::zeros(DType::F32, &[shape[0], shape[1] + 1]).unwrap()
        ])
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidInput);
    let msg = e.to_string();
    assert!(
        msg.contains("input 0") && msg.contains(&format!("{shape:?}")),
        "{msg}"
    );

    let e = m
        .execute(vec![Tensor::zeros(DType::I64, &shape).unwrap()])
        .unwrap_err();
    assert!(
        e.to_string().contains("expected float32") && e.to_string().contains("got int64"),
        "{e}"
    );
}

#[test]
fn unregistered_delegate_is_named_at_load() {
    let program = Program::load(fixtures().join("xnnpack_linear.pte")).unwrap();
    let e = program.method("forward").err().unwrap();
    assert_eq!(e.kind(), ErrorKind::Unsupported);
    let msg = e.to_string();
    assert!(
        msg.contains("`XnnpackBackend` is not registered (registered: none)"),
        "{msg}"
    );
}

/// A stand-in for XNNPACK's linear: reads its payload size, computes
/// nothing useful but writes a recognisable value into the output.
/// A backend taking ExecuTorch's XNNPACK delegates: it fills its last
/// output with the payload's length and claims `outputs` outputs.
struct Fill {
    outputs: usize,
}
struct FillHandle {
    value: f32,
    outputs: usize,
}

impl Backend for Fill {
    fn id(&self) -> &str {
        "XnnpackBackend"
    }
    fn init(
        &self,
        processed: &[u8],
        _specs: &[CompileSpec],
        _named: &dyn NamedData,
    ) -> Result<Box<dyn DelegateHandle>> {
        Ok(Box::new(FillHandle {
            value: processed.len() as f32,
            outputs: self.outputs,
        }))
    }
}

impl DelegateHandle for FillHandle {
    fn execute(&mut self, args: &mut [DelegateArg]) -> Result<()> {
        if let Some(DelegateArg::Output(out)) = args.last_mut() {
            let fill = Tensor::from_f32(out.dtype, out.shape, &vec![self.value; out.numel()])?;
            out.bytes.copy_from_slice(fill.bytes());
        }
        Ok(())
    }

    fn output_count(&self) -> usize {
        self.outputs
    }
}

#[test]
fn registered_delegate_runs_and_writes_its_outputs() {
    let mut backends = BackendRegistry::new();
    backends.register(Arc::new(Fill { outputs: 1 })).unwrap();
    assert!(backends.register(Arc::new(Fill { outputs: 1 })).is_err());
    let program = Program::load(fixtures().join("xnnpack_linear.pte"))
        .unwrap()
        .with_options(LoadOptions {
            backends,
            ..LoadOptions::default()
        });
    let payload = program.file().delegate_data(0, 0).unwrap().len() as f32;
    let mut m = program.method("forward").unwrap();
    let out = m.execute(numbered("xnnpack_linear", "input")).unwrap();
    assert_eq!(out.len(), 1);
    assert!(
        out[0].to_f32_vec().iter().all(|&v| v == payload),
        "{:?}",
        out[0].to_f32_vec()
    );
}

/// A delegate claiming more outputs than its call passes arguments is
/// refused when the method loads.
#[test]
fn delegate_with_more_outputs_than_arguments_is_refused_at_load() {
    let mut backends = BackendRegistry::new();
    backends.register(Arc::new(Fill { outputs: 99 })).unwrap();
    let e = Program::load(fixtures().join("xnnpack_linear.pte"))
        .unwrap()
        .with_options(LoadOptions {
            backends,
            ..LoadOptions::default()
        })
        .method("forward")
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("has 99 outputs but the call passes"), "{e}");
}

/// A delegate writes its outputs where the plan put them; an output the
/// plan left unplanned is refused naming the delegate, not written nowhere.
#[test]
fn unplanned_delegate_output_is_refused() {
    let file = etmetal_pte::PteFile::load(fixtures().join("xnnpack_linear.pte")).unwrap();
    let mut program = file.program.clone();
    let plan = &mut program.execution_plan[0];
    let out = plan.chains[0]
        .instructions
        .iter()
        .find_map(|i| match i {
            etmetal_pte::Instruction::DelegateCall(c) => c.args.last().copied(),
            _ => None,
        })
        .unwrap() as usize;
    let etmetal_pte::EValue::Tensor(t) = &mut plan.values[out] else {
        panic!("delegate output {out} is not a tensor")
    };
    t.allocation_info = None;
    let bytes = etmetal_pte::serialize(&program, &file.segments().unwrap()).unwrap();
    let mut backends = BackendRegistry::new();
    backends.register(Arc::new(Fill { outputs: 1 })).unwrap();
    let options = LoadOptions {
        backends,
        ..LoadOptions::default()
    };
    let mut m = Program::from_bytes(&bytes)
        .unwrap()
        .with_options(options)
        .method("forward")
        .unwrap();
    let e = m
        .execute(numbered("xnnpack_linear", "input"))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("delegate `XnnpackBackend`") && e.contains("must lie in planned memory"),
        "{e}"
    );
}

#[test]
fn absurd_arena_is_refused_before_allocating() {
    let file = etmetal_pte::PteFile::load(fixtures().join("mlp.pte")).unwrap();
    let mut program = file.program.clone();
    program.execution_plan[0].non_const_buffer_sizes[1] = 1 << 50;
    let bytes = etmetal_pte::serialize(&program, &file.segments().unwrap()).unwrap();
    let e = Program::from_bytes(&bytes)
        .unwrap()
        .method("forward")
        .err()
        .unwrap();
    assert_eq!(e.kind(), ErrorKind::Limit);
    assert!(
        e.to_string()
            .contains("exceeds the limit of 17179869184 bytes"),
        "{e}"
    );

    // The cap is configurable: the real program fails under a tiny one.
    let tiny = LoadOptions {
        max_arena_bytes: 16,
        ..LoadOptions::default()
    };
    let e = Program::load(fixtures().join("mlp.pte"))
        .unwrap()
        .with_options(tiny)
        .method("forward")
        .err()
        .unwrap();
    assert_eq!(e.kind(), ErrorKind::Limit);
}

#[test]
fn program_and_method_are_send() {
    fn send<T: Send>() {}
    fn sync<T: Sync>() {}
    send::<Program>();
    sync::<Program>();
    send::<etmetal_runtime::Method>();
}

/// Found by the `pte_load` fuzz target: one byte makes conv_block declare a
/// 4 GiB arena its tensors never reach; only the reached bytes are allocated.
#[test]
fn declared_but_unused_arena_is_not_allocated() {
    let regression = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../fuzz/regressions/pte_load/oom-conv_block-buffer-size-byte251.pte");
    let program = Program::load(&regression).unwrap();
    let declared = &program.file().program.execution_plan[0].non_const_buffer_sizes;
    assert_eq!(declared[1], 0xfe00_0360);
    let mut method = program.method("forward").unwrap();
    assert!(
        method.arena_bytes() <= 864,
        "{} bytes allocated",
        method.arena_bytes()
    );
    let want = numbered("conv_block", "output");
    let got = method.execute(numbered("conv_block", "input")).unwrap();
    assert_close("conv_block (regression)", &got, &want);

    let honest = Program::load(fixtures().join("conv_block.pte")).unwrap();
    assert_eq!(honest.method("forward").unwrap().arena_bytes(), 864);
}
