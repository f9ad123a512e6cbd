//! Programs with bounded dynamic shapes, written by ExecuTorch's own
//! `to_executorch()` (`scripts/make_dynamic_fixtures.py`): one loaded
//! method runs at the smallest, an odd and the largest size of its range
//! and matches eager PyTorch (whose outputs the generator stored beside
//! each file); inputs outside the bound and malformed dynamic programs give
//! typed errors.

use std::path::{Path, PathBuf};

use std::sync::Arc;

use etmetal_core::{npy, DType, ErrorKind, Result, Tensor};
use etmetal_pte::testing::one_delegate_call;
use etmetal_pte::{CompileSpec, EValue, Instruction, PteFile, Segment, TensorShapeDynamism};
use etmetal_runtime::{
    Backend, BackendRegistry, DelegateArg, DelegateHandle, LoadOptions, NamedData, Program,
};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

fn numbered(name: &str, size: usize, kind: &str) -> Vec<Tensor> {
    (0..)
        .map(|i| fixtures().join(format!("{name}.s{size}.{kind}_{i}.npy")))
        .take_while(|p| p.exists())
        .map(|p| npy::read(&p).unwrap())
        .collect()
}

/// The sizes the generator stored for `name`, ascending.
fn sizes(name: &str) -> Vec<usize> {
    let mut sizes: Vec<usize> = std::fs::read_dir(fixtures())
        .unwrap()
        .filter_map(|e| {
            let file = e.unwrap().file_name().into_string().unwrap();
            let rest = file.strip_prefix(&format!("{name}.s"))?;
            rest.strip_suffix(".input_0.npy")?.parse().ok()
        })
        .collect();
    sizes.sort();
    sizes
}

fn assert_close(what: &str, got: &[Tensor], want: &[Tensor]) {
    assert_eq!(got.len(), want.len(), "{what}: output count");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert_eq!(g.dtype(), w.dtype(), "{what} output {i} dtype");
        assert_eq!(g.shape(), w.shape(), "{what} output {i} shape");
        if w.dtype().is_float() {
            for (a, b) in g.to_f64_vec().iter().zip(w.to_f64_vec()) {
                assert!(
                    (a - b).abs() <= 1e-5 + 1e-5 * b.abs(),
                    "{what} output {i}: {a} vs {b}"
                );
            }
        } else {
            assert_eq!(g.to_i64_vec(), w.to_i64_vec(), "{what} output {i}");
        }
    }
}

const NAMES: [&str; 5] = [
    "dyn_mlp",
    "dyn_view_slice",
    "dyn_attention",
    "dyn_conv",
    "dyn_decoder",
];

#[test]
fn runs_at_every_size_and_matches_eager() {
    for name in NAMES {
        let program = Program::load(fixtures().join(format!("{name}.pte"))).unwrap();
        let mut method = program.method("forward").unwrap();
        let sizes = sizes(name);
        assert!(sizes.len() >= 3, "{name}: sizes {sizes:?}");
        // largest, smallest, odd, largest again: nothing of a larger run
        // leaks into a smaller one, nor back
        let order = [sizes[2], sizes[0], sizes[1], sizes[2], sizes[0]];
        for size in order {
            let got = method.execute(numbered(name, size, "input")).unwrap();
            assert_close(
                &format!("{name} at {size}"),
                &got,
                &numbered(name, size, "output"),
            );
        }
    }
}

/// `method.execute_borrowed` on `inputs`: the outputs it handed over, copied.
fn execute_borrowed(
    method: &mut etmetal_runtime::Method,
    inputs: &[Tensor],
) -> Result<Vec<Tensor>> {
    let views: Vec<_> = inputs.iter().map(etmetal_core::View::of).collect();
    let mut outputs = vec![];
    method.execute_borrowed(&views, &mut |i, v| {
        assert_eq!(i, outputs.len());
        outputs.push(Tensor::from_bytes(v.dtype, v.shape, v.bytes)?);
        Ok(())
    })?;
    Ok(outputs)
}

#[test]
fn borrowed_inputs_and_outputs_run_at_every_size_as_owned_ones() {
    for name in NAMES {
        let program = Program::load(fixtures().join(format!("{name}.pte"))).unwrap();
        let mut method = program.method("forward").unwrap();
        let sizes = sizes(name);
        for size in [sizes[2], sizes[0], sizes[1]] {
            let inputs = numbered(name, size, "input");
            let got = execute_borrowed(&mut method, &inputs).unwrap();
            let what = format!("{name} at {size}, borrowed");
            assert_close(&what, &got, &numbered(name, size, "output"));
            assert_close(&what, &got, &method.execute(inputs).unwrap());
        }
    }
    // borrowed inputs are checked as owned ones, and their bytes too
    let program = Program::load(fixtures().join("dyn_mlp.pte")).unwrap();
    let mut method = program.method("forward").unwrap();
    let e =
        execute_borrowed(&mut method, &[Tensor::zeros(DType::F32, &[9, 4]).unwrap()]).unwrap_err();
    assert!(
        e.to_string()
            .contains("input 0: dim 0 is 9, above its upper bound 8"),
        "{e}"
    );
    let e =
        execute_borrowed(&mut method, &[Tensor::zeros(DType::F64, &[2, 4]).unwrap()]).unwrap_err();
    assert!(
        e.to_string()
            .contains("input 0: expected float32 [<=8, <=4], got float64 [2, 4]"),
        "{e}"
    );
    let short = etmetal_core::View {
        dtype: DType::F32,
        shape: &[2, 4],
        bytes: &[0; 31],
    };
    let e = method
        .execute_borrowed(&[short], &mut |_, _| Ok(()))
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::InvalidInput);
    assert!(
        e.to_string()
            .contains("input 0: 31 bytes given for float32 [2, 4], which needs 32"),
        "{e}"
    );
    // an error of the output's receiver ends the call with it
    let x = numbered("dyn_mlp", 5, "input");
    let e = method
        .execute_borrowed(&[etmetal_core::View::of(&x[0])], &mut |_, _| {
            Err(etmetal_core::Error::invalid_input("no room"))
        })
        .unwrap_err();
    assert_eq!(e.to_string(), "no room");
}

#[test]
fn input_specs_expose_the_bounds() {
    let program = Program::load(fixtures().join("dyn_attention.pte")).unwrap();
    let method = program.method("forward").unwrap();
    let specs = method.input_specs();
    assert_eq!(specs.len(), 1);
    assert_eq!(specs[0].dtype, DType::F32);
    assert_eq!(specs[0].shape, vec![1, 16, 8]);
    assert!(specs[0].is_dynamic());
    assert_eq!(specs[0].shape_text(), "[<=1, <=16, <=8]");
    // all-ones inputs at the bound run (what `etmetal run` does by default)
    let mut method = program.method("forward").unwrap();
    let out = method.execute(vec![specs[0].ones().unwrap()]).unwrap();
    assert_eq!(out[0].shape(), &[1, 16, 8]);
}

#[test]
fn inputs_outside_the_bound_are_refused_by_name() {
    let program = Program::load(fixtures().join("dyn_mlp.pte")).unwrap();
    let mut method = program.method("forward").unwrap();
    let mut err = |shape: &[usize]| {
        method
            .execute(vec![Tensor::zeros(DType::F32, shape).unwrap()])
            .unwrap_err()
    };
    let e = err(&[9, 4]);
    assert_eq!(e.kind(), ErrorKind::InvalidInput);
    let msg = e.to_string();
    assert!(
        msg.contains("method `forward`")
            && msg.contains("input 0: dim 0 is 9, above its upper bound 8"),
        "{msg}"
    );
    let e = err(&[2, 5]);
    assert!(
        e.to_string()
            .contains("dim 1 is 5, above its upper bound 4"),
        "{e}"
    );
    let e = err(&[2]);
    assert!(e.to_string().contains("rank 1"), "{e}");
    // and the method still runs afterwards
    let got = method.execute(numbered("dyn_mlp", 5, "input")).unwrap();
    assert_close(
        "dyn_mlp after errors",
        &got,
        &numbered("dyn_mlp", 5, "output"),
    );
}

/// `name`'s program changed by `edit`, written and read back (the writer
/// and the reader both verify).
fn edited(name: &str, edit: impl FnOnce(&mut etmetal_pte::Program)) -> Result<Program> {
    let file = PteFile::load(fixtures().join(format!("{name}.pte"))).unwrap();
    let segments: Vec<Vec<u8>> = (0..file.program.segments.len())
        .map(|i| file.segment(i).unwrap().to_vec())
        .collect();
    let mut program = file.program.clone();
    edit(&mut program);
    let segments: Vec<Segment> = segments.into_iter().map(Segment::new).collect();
    Program::from_bytes(&etmetal_pte::serialize(&program, &segments)?)
}

fn tensor_mut(p: &mut etmetal_pte::Program, v: usize) -> &mut etmetal_pte::Tensor {
    match &mut p.execution_plan[0].values[v] {
        EValue::Tensor(t) => t,
        other => panic!("value {v} is {other:?}"),
    }
}

/// Value indices of the planned dynamic tensors and the constants of the
/// first plan.
fn tensors(p: &etmetal_pte::Program) -> (Vec<usize>, Vec<usize>) {
    let (mut dynamic, mut constant) = (vec![], vec![]);
    for (v, e) in p.execution_plan[0].values.iter().enumerate() {
        if let EValue::Tensor(t) = e {
            if t.shape_dynamism == TensorShapeDynamism::DynamicBound {
                dynamic.push(v);
            } else if t.allocation_info.is_none() && t.data_buffer_idx > 0 {
                constant.push(v);
            }
        }
    }
    (dynamic, constant)
}

#[test]
fn unbounded_dynamic_shapes_are_refused_naming_the_value() {
    let mut marked = 0;
    let program = edited("dyn_mlp", |p| {
        marked = tensors(p).0[0];
        tensor_mut(p, marked).shape_dynamism = TensorShapeDynamism::DynamicUnbound;
    })
    .unwrap();
    let e = program.method("forward").err().unwrap();
    assert_eq!(e.kind(), ErrorKind::Unsupported);
    let msg = e.to_string();
    assert!(
        msg.contains(&format!("value {marked}: an unbounded dynamic shape")),
        "{msg}"
    );
}

#[test]
fn a_dynamic_constant_is_a_format_error() {
    let e = edited("dyn_mlp", |p| {
        let c = tensors(p).1[0];
        tensor_mut(p, c).shape_dynamism = TensorShapeDynamism::DynamicBound;
    })
    .err()
    .unwrap();
    assert_eq!(e.kind(), ErrorKind::Format);
    assert!(e.to_string().contains("a constant tensor"), "{e}");
}

#[test]
fn a_result_over_its_bound_is_a_shape_error() {
    // The output of the mlp's first addmm, planned for at most 2 rows.
    let program = edited("dyn_mlp", |p| {
        let plan = &p.execution_plan[0];
        let addmm = plan
            .operators
            .iter()
            .position(|o| o.name == "aten::addmm")
            .unwrap() as i32;
        let out = plan.chains[0]
            .instructions
            .iter()
            .find_map(|i| match i {
                Instruction::KernelCall(c) if c.op_index == addmm => Some(c.args[5] as usize),
                _ => None,
            })
            .unwrap();
        tensor_mut(p, out).sizes[0] = 2;
    })
    .unwrap();
    let mut method = program.method("forward").unwrap();
    // within the smaller bound it runs
    let got = method.execute(numbered("dyn_mlp", 1, "input")).unwrap();
    assert_close("dyn_mlp at 1", &got, &numbered("dyn_mlp", 1, "output"));
    let e = method.execute(numbered("dyn_mlp", 5, "input")).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Shape);
    let msg = e.to_string();
    assert!(
        msg.contains("aten::addmm.out")
            && msg.contains("dim 0 is 5, above its upper bound 2 (shape [5, 8]"),
        "{msg}"
    );
}

#[test]
fn a_view_to_a_wrong_size_is_a_shape_error() {
    // et_view's size list names the SymInt product; point it at a constant
    // 5 instead, which cannot view the tensor's elements.
    let program = edited("dyn_view_slice", |p| {
        let plan = &mut p.execution_plan[0];
        let view = plan
            .operators
            .iter()
            .position(|o| o.name == "executorch_prim::et_view")
            .unwrap() as i32;
        let list = plan.chains[0]
            .instructions
            .iter()
            .find_map(|i| match i {
                Instruction::KernelCall(c) if c.op_index == view => Some(c.args[1] as usize),
                _ => None,
            })
            .unwrap();
        plan.values.push(EValue::Int(5));
        let five = plan.values.len() as i64 - 1;
        match &mut plan.values[list] {
            EValue::IntList(items) => items[0] = five,
            other => panic!("{other:?}"),
        }
    })
    .unwrap();
    let e = program.method("forward").err().unwrap();
    assert_eq!(e.kind(), ErrorKind::Shape);
    assert!(
        e.to_string()
            .contains("cannot view a tensor of shape [8, 6] as [5, 3]"),
        "{e}"
    );
}

#[test]
fn a_symbolic_call_with_a_tensor_operand_is_a_format_error() {
    let e = edited("dyn_view_slice", |p| {
        let plan = &mut p.execution_plan[0];
        let mul = plan
            .operators
            .iter()
            .position(|o| o.name == "executorch_prim::mul")
            .unwrap() as i32;
        let input = plan.inputs[0];
        for i in &mut plan.chains[0].instructions {
            if let Instruction::KernelCall(c) = i {
                if c.op_index == mul {
                    c.args[1] = input;
                }
            }
        }
    })
    .unwrap()
    .method("forward")
    .err()
    .unwrap();
    assert_eq!(e.kind(), ErrorKind::Format);
    let msg = e.to_string();
    assert!(
        msg.contains("executorch_prim::mul.Scalar") && msg.contains("argument 1"),
        "{msg}"
    );
}

/// A delegate that computes nothing: what matters is whether it is called.
struct Static;
struct StaticHandle;

impl Backend for Static {
    fn id(&self) -> &str {
        "StaticTest"
    }
    fn init(
        &self,
        _processed: &[u8],
        _specs: &[CompileSpec],
        _named: &dyn NamedData,
    ) -> Result<Box<dyn DelegateHandle>> {
        Ok(Box::new(StaticHandle))
    }
}

impl DelegateHandle for StaticHandle {
    fn execute(&mut self, _args: &mut [DelegateArg]) -> Result<()> {
        Ok(())
    }
    fn output_count(&self) -> usize {
        1
    }
}

#[test]
fn a_delegate_refuses_a_dynamic_input_below_its_static_shape() {
    let mut input = etmetal_pte::Tensor::planned(DType::F32, &[4, 2], 1, 0);
    input.shape_dynamism = TensorShapeDynamism::DynamicBound;
    let output = etmetal_pte::Tensor::planned(DType::F32, &[4, 2], 1, 32);
    let program = one_delegate_call("StaticTest", vec![1; 16], input, output);
    let mut backends = BackendRegistry::new();
    backends.register(Arc::new(Static)).unwrap();
    let program = Program::from_bytes(&etmetal_pte::serialize(&program, &[]).unwrap())
        .unwrap()
        .with_options(LoadOptions {
            backends,
            ..LoadOptions::default()
        });
    let mut method = program.method("forward").unwrap();
    method
        .execute(vec![Tensor::zeros(DType::F32, &[4, 2]).unwrap()])
        .unwrap();
    let e = method
        .execute(vec![Tensor::zeros(DType::F32, &[2, 2]).unwrap()])
        .unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Unsupported);
    let msg = e.to_string();
    assert!(
        msg.contains(
            "delegate `StaticTest` was compiled for the static shape [4, 2] of its input 0"
        ) && msg.contains("which is [2, 2]"),
        "{msg}"
    );
}
