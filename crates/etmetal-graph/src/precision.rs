//! `--dtype`: compile a float32 program in bfloat16 or float16. Every
//! float32 value (inputs, weights, intermediates, outputs) and every op that
//! names float32 (casts, `full`, `arange`) switches to the target dtype,
//! so the program computes as PyTorch would after `module.to(dtype)` with
//! inputs of that dtype.

use etmetal_core::{DType, Error, Op, Result};

use crate::ir::Graph;

pub fn convert_floats(graph: &mut Graph, to: DType) -> Result<()> {
    if !to.is_float() {
        return Err(Error::invalid_input(format!(
            "--dtype {}: only float dtypes (float32, bfloat16, float16)",
            to.name()
        )));
    }
    if to == DType::F32 {
        return Ok(());
    }
    for value in &mut graph.values {
        if value.dtype == DType::F32 {
            value.dtype = to;
        }
    }
    for tensor in graph.constants.values_mut() {
        if tensor.dtype() == DType::F32 {
            *tensor = tensor.cast(to)?;
        }
    }
    for node in &mut graph.nodes {
        match &mut node.op {
            Op::Cast { dtype } | Op::Full { dtype, .. } | Op::Arange { dtype, .. }
                if *dtype == DType::F32 =>
            {
                *dtype = to
            }
            _ => {}
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::{InputKind, Node, OutputKind};
    use etmetal_core::{Scalar, Tensor};

    #[test]
    fn float32_values_weights_and_ops_switch() {
        let mut g = Graph::default();
        let x = g.add_value("x", DType::F32, vec![2]);
        let idx = g.add_value("i", DType::I64, vec![2]);
        g.inputs.push((x, InputKind::User));
        g.inputs.push((idx, InputKind::User));
        let w = g.add_constant(
            "w",
            Tensor::from_f32(DType::F32, &[2], &[0.1, 2.0]).unwrap(),
        );
        let y = g.add_value("y", DType::F32, vec![2]);
        g.nodes.push(Node {
            name: "full".into(),
            target: "t".into(),
            op: Op::Full {
                shape: vec![2],
                value: Scalar::Float(1.0),
                dtype: DType::F32,
            },
            inputs: vec![],
            outputs: vec![y],
        });
        g.outputs.push((y, OutputKind::User));
        convert_floats(&mut g, DType::BF16).unwrap();
        assert_eq!(g.value(x).dtype, DType::BF16);
        assert_eq!(g.value(idx).dtype, DType::I64);
        assert_eq!(g.constants[&w].dtype(), DType::BF16);
        assert_eq!(g.constants[&w].to_f32_vec(), [0.100_097_656, 2.0]);
        assert!(matches!(
            g.nodes[0].op,
            Op::Full {
                dtype: DType::BF16,
                ..
            }
        ));
        assert!(convert_floats(&mut g, DType::I32).is_err());
    }
}
