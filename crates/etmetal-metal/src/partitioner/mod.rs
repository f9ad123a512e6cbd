//! The Metal partitioner: which nodes of a graph go to the GPU delegate.
//!
//! [`partition`] asks the support table ([`supports`]) about every node,
//! groups the supported ones into partitions and leaves the rest on the CPU.
//! Partitions are *convex*: no path leaves a partition and re-enters it, and
//! more strongly the graph of partitions and CPU nodes is acyclic, so one
//! delegate call per partition can be scheduled between CPU kernel calls
//! ([`Partitioning::schedule`]). Partitions grow along edges first (a node joins
//! the partitions of its producers when that keeps the graph of partitions
//! acyclic), then independent partitions are merged.
//!
//! Partition ids follow the schedule, nodes inside a partition keep graph
//! order, so the result depends on the graph alone.

mod dynamic;
mod support;

use std::cmp::Reverse;
use std::collections::{BTreeSet, BinaryHeap, HashMap};

use etmetal_core::{Error, Op, Result};
use etmetal_graph::{Graph, InputKind, Node, ValueId};

pub use support::{op_supported, supports, DeviceLimits};

/// `auto` delegates what it can; `whole` requires one partition of the
/// whole graph.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum PartitionMode {
    #[default]
    Auto,
    Whole,
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PartitionOptions {
    pub mode: PartitionMode,
    /// Ops kept off the GPU, by [`Op::name`] (`"sdpa"`, `"add"`).
    pub skip_ops: Vec<String>,
    pub limits: DeviceLimits,
    /// Buffers (by fully qualified name) that another method of the
    /// program writes: a method that only reads one takes it as a delegate
    /// input, never as a weight baked into the payload.
    pub state: Vec<String>,
}

impl PartitionOptions {
    /// Whether the partitioner gives `node` of `graph` to the GPU: its op
    /// is not in `skip_ops` and [`supports`] takes it within `limits`;
    /// `Err` holds the reason it stays on the CPU.
    pub fn takes(&self, graph: &Graph, node: &Node) -> Result<(), String> {
        let name = node.op.name();
        if self.skip_ops.iter().any(|s| s == name) {
            Err(format!("`{name}` is in skip_ops"))
        } else {
            supports(graph, node, &self.limits)
        }
    }
}

/// One delegated subgraph.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Partition {
    pub id: usize,
    /// Node indices in graph order.
    pub nodes: Vec<usize>,
    /// Values the partition reads from outside (graph inputs, CPU results,
    /// other partitions' outputs, constants also read on the CPU), in order
    /// of first use.
    pub inputs: Vec<ValueId>,
    /// Values it produces that are read outside or are graph outputs, in
    /// order of production.
    pub outputs: Vec<ValueId>,
    /// Constants (weights, buffers, lifted scalars) read only by delegated
    /// nodes: they go to the delegate's named data, not the CPU constant
    /// segment. A constant read by several partitions is listed in each.
    pub constants: Vec<ValueId>,
    /// Mutated buffers whose new value this partition computes:
    /// `(buffer input, new value)`.
    pub mutated_buffers: Vec<(ValueId, ValueId)>,
}

impl Partition {
    /// The delegation tag of the partition's nodes (`"tag0"`), as ExecuTorch
    /// names them.
    pub fn tag(&self) -> String {
        format!("tag{}", self.id)
    }
}

/// One item of the schedule: a delegate call or a CPU node.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum ScheduleItem {
    Delegate(usize),
    Cpu(usize),
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Partitioning {
    pub partitions: Vec<Partition>,
    /// Nodes left on the CPU with the reason, in graph order.
    pub cpu_nodes: Vec<(usize, String)>,
    /// Partitions and CPU nodes in an order that respects every data
    /// dependency.
    pub schedule: Vec<ScheduleItem>,
    /// For each node, the id of its partition (`None`: CPU).
    pub node_partition: Vec<Option<usize>>,
}

impl Partitioning {
    /// The delegation tag of node `node`, `None` on the CPU.
    pub fn tag(&self, node: usize) -> Option<String> {
        let id = (*self.node_partition.get(node)?)?;
        self.partitions.get(id).map(Partition::tag)
    }
}

/// The ops the backend wants whole from `etmetal_graph::decompose` (the
/// `keep` predicate): every op it takes, so linear, addmm, batch norm and
/// attention reach their fused kernels. `Identity` is the exception: its
/// removal saves a copy on any backend.
pub fn ops_to_not_decompose(op: &Op) -> bool {
    *op != Op::Identity && op_supported(op).is_ok()
}

/// Partition `graph` for the Metal backend (see the module docs).
pub fn partition(graph: &Graph, options: &PartitionOptions) -> Result<Partitioning> {
    let dag = Dag::new(graph)?;
    let n = graph.nodes.len();
    let mut cpu_nodes = vec![];
    let mut groups = Groups::new(n);
    for (i, node) in graph.nodes.iter().enumerate() {
        match options.takes(graph, node) {
            Ok(()) => groups.add(i, &dag),
            Err(reason) => cpu_nodes.push((i, reason)),
        }
    }
    groups.merge_independent(&dag);

    if options.mode == PartitionMode::Whole {
        whole_check(graph, &cpu_nodes, &groups)?;
    }
    let (steps, node_partition) = schedule(&groups, &dag, n)?;
    let mut readers: HashMap<ValueId, Vec<usize>> = HashMap::new();
    for (i, node) in graph.nodes.iter().enumerate() {
        for v in node.inputs.iter().flatten() {
            readers.entry(*v).or_default().push(i);
        }
    }
    let mutations = graph.buffer_mutations()?;
    // buffers this method reads and another writes: state here too
    let written_elsewhere: Vec<ValueId> = (graph.inputs.iter())
        .filter_map(|(v, kind)| match kind {
            InputKind::Buffer { fqn, .. } if options.state.contains(fqn) => Some(*v),
            _ => None,
        })
        .collect();
    let count = groups.live().count();
    let mut nodes_of: Vec<Vec<usize>> = vec![vec![]; count];
    for (i, id) in node_partition.iter().enumerate() {
        if let Some(id) = id {
            nodes_of[*id].push(i);
        }
    }
    let partitions: Vec<Partition> = nodes_of
        .into_iter()
        .enumerate()
        .map(|(id, nodes)| {
            let state = (&mutations[..], &written_elsewhere[..]);
            describe(graph, id, nodes, &node_partition, &readers, state)
        })
        .collect();
    Ok(Partitioning {
        partitions,
        cpu_nodes,
        schedule: steps,
        node_partition,
    })
}

/// `whole` mode: one partition of every node, else an error naming every
/// node that stays off the GPU.
fn whole_check(graph: &Graph, cpu_nodes: &[(usize, String)], groups: &Groups) -> Result<()> {
    if !cpu_nodes.is_empty() {
        let list: Vec<String> = cpu_nodes
            .iter()
            .map(|(i, reason)| {
                let node = &graph.nodes[*i];
                format!("node `{}` ({}): {reason}", node.name, node.op.name())
            })
            .collect();
        return Err(Error::unsupported(format!(
            "--partition whole: {} node(s) cannot run on the Metal backend: {}",
            list.len(),
            list.join("; ")
        )));
    }
    match groups.live().count() {
        1 => Ok(()),
        0 => Err(Error::unsupported(
            "--partition whole: the graph has no nodes to delegate",
        )),
        k => Err(Error::internal(format!(
            "--partition whole: every node is supported but they form {k} partitions"
        ))),
    }
}

/// Node-level producer/consumer edges, checked against the graph.
struct Dag {
    succs: Vec<Vec<usize>>,
    preds: Vec<Vec<usize>>,
}

impl Dag {
    fn new(graph: &Graph) -> Result<Dag> {
        let n = graph.nodes.len();
        let mut producer: HashMap<ValueId, usize> = HashMap::new();
        for (i, node) in graph.nodes.iter().enumerate() {
            for v in &node.outputs {
                check_value(graph, *v, &node.name)?;
                if producer.insert(*v, i).is_some() {
                    return Err(Error::invalid_input(format!(
                        "value `{}` is produced twice (again by node `{}`)",
                        graph.value(*v).name,
                        node.name
                    )));
                }
            }
        }
        let mut preds = vec![vec![]; n];
        let mut succs = vec![vec![]; n];
        for (i, node) in graph.nodes.iter().enumerate() {
            let mut p = BTreeSet::new();
            for v in node.inputs.iter().flatten() {
                check_value(graph, *v, &node.name)?;
                match producer.get(v) {
                    Some(&j) if j < i => {
                        p.insert(j);
                    }
                    Some(_) => {
                        return Err(Error::invalid_input(format!(
                            "node `{}` reads `{}` before it is produced (nodes are not in topological order)",
                            node.name,
                            graph.value(*v).name
                        )))
                    }
                    None => {}
                }
            }
            for &j in &p {
                succs[j].push(i);
            }
            preds[i] = p.into_iter().collect();
        }
        Ok(Dag { succs, preds })
    }
}

fn check_value(graph: &Graph, v: ValueId, node: &str) -> Result<()> {
    if v.0 < graph.values.len() {
        Ok(())
    } else {
        Err(Error::invalid_input(format!(
            "node `{node}` refers to value #{} but the graph has {} values",
            v.0,
            graph.values.len()
        )))
    }
}

/// Budget of node visits for merging independent partitions: the search is
/// quadratic in the partition count, so huge fragmented graphs keep some
/// independent partitions apart rather than stall the compiler.
const MERGE_VISIT_BUDGET: usize = 20_000_000;

/// The growing partitions: `of[node]` is its group, `members[g]` its nodes
/// (empty once merged away).
struct Groups {
    of: Vec<Option<usize>>,
    members: Vec<Vec<usize>>,
    /// The last node placed: later nodes are in no group and only lead to
    /// later nodes, so no path back into a group passes them.
    horizon: usize,
    /// `seen[node] == stamp`: visited by the current [`Groups::can_merge`].
    seen: Vec<u32>,
    stamp: u32,
    visits: usize,
}

impl Groups {
    fn new(n: usize) -> Groups {
        Groups {
            of: vec![None; n],
            members: vec![],
            horizon: 0,
            seen: vec![0; n],
            stamp: 0,
            visits: 0,
        }
    }

    fn live(&self) -> impl Iterator<Item = usize> + '_ {
        (0..self.members.len()).filter(|&g| !self.members[g].is_empty())
    }

    /// Add supported node `i` (all its producers are already placed) and
    /// join it to its producers' groups where that stays acyclic.
    fn add(&mut self, i: usize, dag: &Dag) {
        self.horizon = i;
        let mut g = self.members.len();
        self.members.push(vec![i]);
        self.of[i] = Some(g);
        let candidates: BTreeSet<usize> = dag.preds[i].iter().filter_map(|&p| self.of[p]).collect();
        // ascending, and merges keep the lower id, so each candidate is live
        for c in candidates {
            if self.can_merge(c, g, dag) {
                g = self.merge(c, g);
            }
        }
    }

    /// Merge pairs of groups in id order while the budget lasts. A group
    /// that `a` reaches can never join it, so only the others are checked.
    fn merge_independent(&mut self, dag: &Dag) {
        self.horizon = self.of.len();
        for a in 0..self.members.len() {
            if self.members[a].is_empty() {
                continue;
            }
            let mut reached = self.reached_groups(&[a], dag);
            for b in a + 1..self.members.len() {
                if self.visits > MERGE_VISIT_BUDGET {
                    return;
                }
                if !self.members[b].is_empty() && !reached.contains(&b) && self.can_merge(a, b, dag)
                {
                    self.merge(a, b);
                    reached = self.reached_groups(&[a], dag);
                }
            }
        }
    }

    /// Whether groups `a` and `b` can become one without a cycle among
    /// groups and CPU nodes: no path from one to the other through anything
    /// else.
    fn can_merge(&mut self, a: usize, b: usize, dag: &Dag) -> bool {
        let reached = self.reached_groups(&[a, b], dag);
        !reached.contains(&a) && !reached.contains(&b)
    }

    /// The groups reached from `sources` by paths that leave them. A group
    /// is entered whole, since its call needs all its inputs; a source is
    /// recorded when a path comes back to it, and not walked again.
    fn reached_groups(&mut self, sources: &[usize], dag: &Dag) -> BTreeSet<usize> {
        let is_source = |g: Option<usize>| g.is_some_and(|g| sources.contains(&g));
        let horizon = self.horizon;
        self.stamp = self.stamp.wrapping_add(1);
        if self.stamp == 0 {
            self.seen.fill(0);
            self.stamp = 1;
        }
        let stamp = self.stamp;
        let mut stack: Vec<usize> = vec![];
        for &g in sources {
            for &m in &self.members[g] {
                stack.extend(
                    dag.succs[m]
                        .iter()
                        .copied()
                        .filter(|&s| s <= horizon && !is_source(self.of[s])),
                );
            }
        }
        let mut reached = BTreeSet::new();
        while let Some(x) = stack.pop() {
            if self.seen[x] == stamp {
                continue;
            }
            self.visits += 1;
            if let Some(g) = self.of[x] {
                reached.insert(g);
            }
            if is_source(self.of[x]) {
                self.seen[x] = stamp;
                continue;
            }
            let group = self.of[x].map_or(&[][..], |g| &self.members[g][..]);
            for &m in std::iter::once(&x).chain(group) {
                self.seen[m] = stamp;
                let seen = &self.seen;
                stack.extend(
                    dag.succs[m]
                        .iter()
                        .copied()
                        .filter(|&s| s <= horizon && seen[s] != stamp),
                );
            }
        }
        reached
    }

    /// Merge the higher-numbered group into the lower; returns the survivor.
    fn merge(&mut self, a: usize, b: usize) -> usize {
        let (keep, gone) = (a.min(b), a.max(b));
        let moved = std::mem::take(&mut self.members[gone]);
        for &m in &moved {
            self.of[m] = Some(keep);
        }
        self.members[keep].extend(moved);
        self.members[keep].sort_unstable();
        keep
    }
}

/// Order groups and CPU nodes by their dependencies, earliest first node
/// first; number partitions in that order.
fn schedule(
    groups: &Groups,
    dag: &Dag,
    n: usize,
) -> Result<(Vec<ScheduleItem>, Vec<Option<usize>>)> {
    // a vertex per group (its first node stands for it) and per CPU node
    let vertex = |i: usize| groups.of[i].map_or(i, |g| groups.members[g][0]);
    let mut indegree = vec![0usize; n];
    let mut edges: Vec<BTreeSet<usize>> = vec![BTreeSet::new(); n];
    for i in 0..n {
        for &s in &dag.succs[i] {
            let (u, v) = (vertex(i), vertex(s));
            if u != v && edges[u].insert(v) {
                indegree[v] += 1;
            }
        }
    }
    let mut ready: BinaryHeap<Reverse<usize>> = (0..n)
        .filter(|&i| vertex(i) == i && indegree[i] == 0)
        .map(Reverse)
        .collect();
    let mut steps = vec![];
    let mut node_partition = vec![None; n];
    let mut next_id = 0;
    while let Some(Reverse(u)) = ready.pop() {
        match groups.of[u] {
            Some(g) => {
                for &m in &groups.members[g] {
                    node_partition[m] = Some(next_id);
                }
                steps.push(ScheduleItem::Delegate(next_id));
                next_id += 1;
            }
            None => steps.push(ScheduleItem::Cpu(u)),
        }
        for &v in &edges[u] {
            indegree[v] -= 1;
            if indegree[v] == 0 {
                ready.push(Reverse(v));
            }
        }
    }
    let scheduled = steps.len();
    let vertices = (0..n).filter(|&i| vertex(i) == i).count();
    if scheduled != vertices {
        return Err(Error::internal(format!(
            "partitions form a cycle: {scheduled} of {vertices} steps scheduled"
        )));
    }
    Ok((steps, node_partition))
}

/// The boundary of partition `id`: inputs, outputs, owned constants and
/// mutated buffers.
fn describe(
    graph: &Graph,
    id: usize,
    nodes: Vec<usize>,
    node_partition: &[Option<usize>],
    readers: &HashMap<ValueId, Vec<usize>>,
    (mutations, written_elsewhere): (&[(ValueId, ValueId)], &[ValueId]),
) -> Partition {
    let readers = |v: ValueId| readers.get(&v).map_or(&[][..], Vec::as_slice);
    let graph_outputs: BTreeSet<ValueId> = graph.outputs.iter().map(|(v, _)| *v).collect();
    // a constant is delegated when every reader is delegated and it is not
    // also returned or mutated (here or by another method)
    let is_mutated_buffer =
        |v: ValueId| mutations.iter().any(|&(b, _)| b == v) || written_elsewhere.contains(&v);
    let read_only_by_delegates =
        |v: ValueId| readers(v).iter().all(|&i| node_partition[i].is_some());
    let produced: BTreeSet<ValueId> = nodes
        .iter()
        .flat_map(|&i| graph.nodes[i].outputs.iter().copied())
        .collect();
    let mut inputs = vec![];
    let mut constants = vec![];
    for &i in &nodes {
        for &v in graph.nodes[i].inputs.iter().flatten() {
            if produced.contains(&v) || inputs.contains(&v) || constants.contains(&v) {
                continue;
            }
            let owned = graph.constants.contains_key(&v)
                && !graph_outputs.contains(&v)
                && !is_mutated_buffer(v)
                && read_only_by_delegates(v);
            if owned {
                constants.push(v);
            } else {
                inputs.push(v);
            }
        }
    }
    let mut outputs = vec![];
    for &i in &nodes {
        for &v in &graph.nodes[i].outputs {
            let read_outside = readers(v).iter().any(|&j| node_partition[j] != Some(id));
            if read_outside || graph_outputs.contains(&v) {
                outputs.push(v);
            }
        }
    }
    let mutated_buffers = mutations
        .iter()
        .filter(|(_, new)| produced.contains(new))
        .copied()
        .collect();
    Partition {
        id,
        nodes,
        inputs,
        outputs,
        constants,
        mutated_buffers,
    }
}
