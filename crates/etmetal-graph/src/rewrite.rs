//! Building the replacement of one node, for the rewriting passes
//! (`decompose`, `to_portable`): new nodes get inferred values, the last
//! one writes the original node's outputs, checked against what they were
//! (symbolic sizes included, for dynamic shapes).

use etmetal_core::{BinaryOp, DType, Error, Op, Result, SymExpr, Tensor, UnaryOp};

use crate::infer::infer;
use crate::infer_sym::{assign_sym, infer_sym};
use crate::ir::{Graph, Node, ValueId};

/// The replacement of one node: intermediates get new values, the last
/// node writes the original outputs.
pub(crate) struct Rewrite<'g> {
    pub graph: &'g mut Graph,
    pub base: &'g Node,
    nodes: Vec<Node>,
}

impl<'g> Rewrite<'g> {
    pub fn new(graph: &'g mut Graph, base: &'g Node) -> Rewrite<'g> {
        Rewrite {
            graph,
            base,
            nodes: Vec::new(),
        }
    }

    fn name(&self) -> String {
        format!("{}.{}", self.base.name, self.nodes.len())
    }

    pub fn node(&mut self, op: Op, inputs: &[Option<ValueId>]) -> Result<ValueId> {
        let name = self.name();
        let mut node = Node {
            name,
            target: self.base.target.clone(),
            op,
            inputs: inputs.to_vec(),
            outputs: vec![],
        };
        let (dtype, shape) = infer(self.graph, &node)?
            .into_iter()
            .next()
            .ok_or_else(|| Error::internal("a rewrite node with no output"))?;
        let v = self
            .graph
            .add_value(format!("{}.out", node.name), dtype, shape);
        node.outputs.push(v);
        assign_sym(self.graph, &node)?;
        self.nodes.push(node);
        Ok(v)
    }

    /// A node whose output has the symbolic sizes `dims` (bounded by its
    /// inferred shape): what the inputs' sizes do not tell, as a slice of
    /// a constant made at the bound.
    pub fn sized(
        &mut self,
        op: Op,
        inputs: &[Option<ValueId>],
        dims: Vec<SymExpr>,
    ) -> Result<ValueId> {
        let v = self.node(op, inputs)?;
        self.graph.set_sym_dims(v, dims)?;
        Ok(v)
    }

    pub fn unary(&mut self, u: UnaryOp, x: ValueId) -> Result<ValueId> {
        self.node(Op::Unary(u), &[Some(x)])
    }

    pub fn binary(&mut self, b: BinaryOp, x: ValueId, y: ValueId) -> Result<ValueId> {
        self.node(Op::Binary(b), &[Some(x), Some(y)])
    }

    /// A new constant, named after the node and `what`.
    pub fn constant(&mut self, what: &str, t: Tensor) -> ValueId {
        let name = format!("{}.{what}{}", self.base.name, self.graph.values.len());
        self.graph.add_constant(name, t)
    }

    /// A 0-d constant of `dtype`.
    pub fn scalar(&mut self, v: f64, dtype: DType) -> Result<ValueId> {
        Ok(self.constant("c", Tensor::scalar_f64(dtype, v)?))
    }

    pub fn reshape(&mut self, x: ValueId, shape: Vec<usize>) -> Result<ValueId> {
        if self.graph.value(x).shape == shape {
            return Ok(x);
        }
        self.node(Op::Reshape { shape }, &[Some(x)])
    }

    pub fn expand(&mut self, x: ValueId, shape: Vec<usize>) -> Result<ValueId> {
        if self.graph.value(x).shape == shape {
            return Ok(x);
        }
        self.node(Op::Expand { shape }, &[Some(x)])
    }

    pub fn cast(&mut self, x: ValueId, dtype: DType) -> Result<ValueId> {
        if self.graph.value(x).dtype == dtype {
            return Ok(x);
        }
        self.node(Op::Cast { dtype }, &[Some(x)])
    }

    /// `v` in f32: constants converted here, other values by a `Cast` node.
    pub fn as_f32(&mut self, v: ValueId) -> Result<ValueId> {
        match self.graph.constants.get(&v) {
            Some(t) if t.dtype() != DType::F32 => {
                let t = t.cast(DType::F32)?;
                let name = format!("{}.f32", self.graph.value(v).name);
                Ok(self.graph.add_constant(name, t))
            }
            _ => self.cast(v, DType::F32),
        }
    }

    /// End with a node computing `op`, which writes the original outputs.
    pub fn finish_with(mut self, op: Op, inputs: &[Option<ValueId>]) -> Result<Vec<Node>> {
        let v = self.node(op, inputs)?;
        self.finish(v)
    }

    /// Make the last node write the original outputs (checked), or add a
    /// copy when `v` is a graph value already (a rewrite that became a no-op).
    pub fn finish(mut self, v: ValueId) -> Result<Vec<Node>> {
        let [want] = self.base.outputs.as_slice() else {
            return Err(Error::internal(
                "rewrites of multi-output nodes are not written",
            ));
        };
        let made_here = self.nodes.last().is_some_and(|n| n.outputs == [v]);
        if !made_here {
            let name = self.name();
            self.nodes.push(Node {
                name,
                target: self.base.target.clone(),
                op: Op::Reshape {
                    shape: self.graph.value(v).shape.clone(),
                },
                inputs: vec![Some(v)],
                outputs: vec![v],
            });
        }
        let last = self
            .nodes
            .last_mut()
            .ok_or_else(|| Error::internal("empty rewrite"))?;
        last.outputs = vec![*want];
        let got = infer(self.graph, last)?;
        let info = self.graph.value(*want);
        if got != [(info.dtype, info.shape.clone())] {
            return Err(Error::internal(format!(
                "rewrite infers {got:?}, the node had {:?} {:?}",
                info.dtype, info.shape
            )));
        }
        let want_dims = self.graph.sym_dims(*want);
        let got_dims = infer_sym(self.graph, last)?.and_then(|mut d| d.pop());
        if got_dims.unwrap_or_else(|| self.graph.sym_dims(v)) != want_dims {
            return Err(Error::unsupported(format!(
                "node `{}`: its rewrite changes the symbolic sizes of its output",
                self.base.name
            )));
        }
        Ok(self.nodes)
    }
}
