//! The graph IR: typed values, nodes in topological order, the signature.

use std::collections::{BTreeMap, BTreeSet};

use etmetal_core::{DType, Op, Tensor};

/// Index of a value in [`Graph::values`].
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ValueId(pub usize);

/// A tensor value: its name in the source program, dtype and static shape.
/// Values are always contiguous; strides in the source are only checked.
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
}
