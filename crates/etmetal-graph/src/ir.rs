//! The graph IR: typed values, nodes in topological order, the signature.

use std::collections::{BTreeMap, BTreeSet};

use etmetal_core::{DType, Error, Op, Result, SymExpr, SymRanges, Tensor};

/// Index of a value in [`Graph::values`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ValueId(pub usize);

/// A tensor value: its name in the source program, dtype and static shape.
/// Values are always contiguous; strides in the source are only checked.
/// A value of dynamic shape (see [`SymShapes`]) holds its upper bounds.
#[derive(Clone, Debug, PartialEq)]
pub struct ValueInfo {
    pub name: String,
    pub dtype: DType,
    pub shape: Vec<usize>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Node {
    /// The node's name in the source program (`"add_1"`).
    pub name: String,
    /// Where it came from (`"torch.ops.aten.add.Tensor"`), for messages.
    pub target: String,
    pub op: Op,
    /// Input slots in the order documented on each [`Op`] variant.
    pub inputs: Vec<Option<ValueId>>,
    pub outputs: Vec<ValueId>,
}

/// What a graph input is, from the export signature.
#[derive(Clone, Debug, PartialEq)]
pub enum InputKind {
    /// A user input, in call order.
    User,
    /// A parameter (`fqn` as in the state dict: `"lin.weight"`).
    Parameter { fqn: String },
    /// A registered buffer.
    Buffer { fqn: String, persistent: bool },
    /// A lifted tensor constant.
    Constant { fqn: String },
}

/// What a graph output is, from the export signature.
#[derive(Clone, Debug, PartialEq)]
pub enum OutputKind {
    User,
    /// The new value of a mutated buffer.
    BufferMutation {
        fqn: String,
    },
    /// The new value of a mutated user input.
    UserInputMutation {
        input_name: String,
    },
}

/// The bounded dynamic shapes of a graph (`torch.export.Dim`): each
/// symbol's range, and the symbolic sizes of every value whose shape
/// depends on a symbol. Such a value's [`ValueInfo::shape`] holds the upper
/// bounds of its sizes, so memory planning and the passes that only need
/// sizes see a static graph at the bound. Empty for a static program.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SymShapes {
    pub ranges: SymRanges,
    /// Only values with at least one non-constant size are listed.
    pub dims: BTreeMap<ValueId, Vec<SymExpr>>,
    /// The int arguments of the node writing each value, as the program
    /// wrote them, where they count along a dynamic dim and the op's own
    /// (clamped at the bound) would be wrong at other sizes: a slice's
    /// `[start, end]`, a select's `[index]` (negative counts from the end,
    /// as the kernels read them).
    pub args: BTreeMap<ValueId, Vec<SymExpr>>,
}

#[derive(Clone, Debug, Default)]
pub struct Graph {
    pub values: Vec<ValueInfo>,
    /// Topologically ordered.
    pub nodes: Vec<Node>,
    /// Placeholders in signature order.
    pub inputs: Vec<(ValueId, InputKind)>,
    pub outputs: Vec<(ValueId, OutputKind)>,
    /// Data of parameters, buffers, lifted constants and constants created
    /// by import or passes (e.g. 0-d scalars of binary ops).
    pub constants: BTreeMap<ValueId, Tensor>,
    /// Constants whose archive held no data (fake tensors, as in the
    /// programs ExecuTorch hands a partitioner): zeros in `constants`, so
    /// nothing may depend on their values.
    pub fake_constants: BTreeSet<ValueId>,
    /// Symbolic sizes (bounded dynamic shapes); empty when all are static.
    pub sym: SymShapes,
}

impl Graph {
    pub fn value(&self, id: ValueId) -> &ValueInfo {
        &self.values[id.0]
    }

    /// Add a new value and return its id.
    pub fn add_value(
        &mut self,
        name: impl Into<String>,
        dtype: DType,
        shape: Vec<usize>,
    ) -> ValueId {
        self.values.push(ValueInfo {
            name: name.into(),
            dtype,
            shape,
        });
        ValueId(self.values.len() - 1)
    }

    /// Add a constant value holding `tensor`.
    pub fn add_constant(&mut self, name: impl Into<String>, tensor: Tensor) -> ValueId {
        let id = self.add_value(name, tensor.dtype(), tensor.shape().to_vec());
        self.constants.insert(id, tensor);
        id
    }

    /// Whether `v`'s shape depends on a symbol.
    pub fn is_dynamic(&self, v: ValueId) -> bool {
        self.sym.dims.contains_key(&v)
    }

    /// The sizes of `v`: symbolic for a dynamic value, constants otherwise.
    pub fn sym_dims(&self, v: ValueId) -> Vec<SymExpr> {
        match self.sym.dims.get(&v) {
            Some(d) => d.clone(),
            None => self.values[v.0]
                .shape
                .iter()
                .map(|&n| SymExpr::Const(n as i64))
                .collect(),
        }
    }

    /// Give `v` the sizes `dims`, whose upper bounds must be its shape
    /// (the one check that inference of sizes and of bounds agree).
    pub fn set_sym_dims(&mut self, v: ValueId, dims: Vec<SymExpr>) -> Result<()> {
        let bounds = dims
            .iter()
            .map(|d| d.upper_bound(&self.sym.ranges))
            .collect::<Result<Vec<usize>>>()?;
        let info = &self.values[v.0];
        if bounds != info.shape {
            let shown: Vec<String> = dims.iter().map(ToString::to_string).collect();
            return Err(Error::shape(format!(
                "value `{}`: sizes [{}] are bounded by {bounds:?}, its shape is {:?}",
                info.name,
                shown.join(", "),
                info.shape
            )));
        }
        if dims.iter().all(|d| d.as_const().is_some()) {
            self.sym.dims.remove(&v);
        } else {
            self.sym.dims.insert(v, dims);
        }
        Ok(())
    }

    /// User inputs in call order.
    pub fn user_inputs(&self) -> impl Iterator<Item = ValueId> + '_ {
        self.inputs
            .iter()
            .filter(|(_, k)| *k == InputKind::User)
            .map(|(v, _)| *v)
    }

    /// User outputs in return order.
    pub fn user_outputs(&self) -> impl Iterator<Item = ValueId> + '_ {
        self.outputs
            .iter()
            .filter(|(_, k)| *k == OutputKind::User)
            .map(|(v, _)| *v)
    }

    /// `(buffer input, new value)` of each buffer mutation of the
    /// signature, in output order: the one pairing of a `BufferMutation`
    /// output with the `Buffer` input of the same fully qualified name.
    /// A mutation of no buffer input, or a new value of another dtype or
    /// shape than its buffer, is an error naming the buffer.
    pub fn buffer_mutations(&self) -> Result<Vec<(ValueId, ValueId)>> {
        let mut out = vec![];
        for (new, kind) in &self.outputs {
            let OutputKind::BufferMutation { fqn } = kind else {
                continue;
            };
            let buffer = self
                .inputs
                .iter()
                .find_map(|(v, k)| match k {
                    InputKind::Buffer { fqn: f, .. } if f == fqn => Some(*v),
                    _ => None,
                })
                .ok_or_else(|| {
                    Error::invalid_input(format!("buffer `{fqn}` is mutated but not an input"))
                })?;
            let (b, n) = (self.value(buffer), self.value(*new));
            if (b.dtype, &b.shape) != (n.dtype, &n.shape) {
                return Err(Error::shape(format!(
                    "buffer `{fqn}` is {} {:?}, its new value {} {:?}",
                    b.dtype, b.shape, n.dtype, n.shape
                )));
            }
            out.push((buffer, *new));
        }
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffer_mutations_pair_by_name_and_check_the_new_value() {
        let mut g = Graph::default();
        let x = g.add_value("x", DType::F32, vec![2]);
        let a = g.add_value("b_a", DType::F32, vec![2]);
        let b = g.add_value("b_b", DType::F32, vec![2]);
        let (new_a, new_b) = (
            g.add_value("new_a", DType::F32, vec![2]),
            g.add_value("new_b", DType::F32, vec![3]),
        );
        let buffer = |fqn: &str| InputKind::Buffer {
            fqn: fqn.into(),
            persistent: true,
        };
        g.inputs = vec![(x, InputKind::User), (a, buffer("a")), (b, buffer("b"))];
        let mutation = |fqn: &str| OutputKind::BufferMutation { fqn: fqn.into() };
        // outputs name the buffers in another order than the inputs
        g.outputs = vec![(new_a, mutation("a")), (x, OutputKind::User)];
        assert_eq!(g.buffer_mutations().unwrap(), [(a, new_a)]);
        g.outputs.insert(0, (new_b, mutation("b")));
        let e = g.buffer_mutations().unwrap_err().to_string();
        assert!(
            e.contains("buffer `b` is float32 [2], its new value float32 [3]"),
            "{e}"
        );
        g.outputs[0].1 = mutation("c");
        let e = g.buffer_mutations().unwrap_err().to_string();
        assert!(e.contains("buffer `c` is mutated but not an input"), "{e}");
    }
}
