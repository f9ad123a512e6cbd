//! Partitioner tests: the fixtures of scripts/make_partition_fixtures.py,
//! hand-built graphs, random DAGs, and every `.pt2` of the workspace.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use etmetal_core::{BinaryOp, ConvAttrs, DType, ErrorKind, Op, Tensor, UnaryOp};
use etmetal_graph::{decompose, load_pt2, Graph, InputKind, Node, OutputKind, ValueId};
use etmetal_metal::partitioner::{
    ops_to_not_decompose, partition, DeviceLimits, PartitionMode, PartitionOptions, Partitioning,
    ScheduleItem,
};
use etmetal_metal::preprocess::{preprocess, PreprocessOptions};

fn fixture(name: &str) -> Graph {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name);
    let mut graph = load_pt2(&path).unwrap();
    decompose(&mut graph, &ops_to_not_decompose);
    graph
}

fn auto() -> PartitionOptions {
    PartitionOptions::default()
}

fn skipping(ops: &[&str], mode: PartitionMode) -> PartitionOptions {
    PartitionOptions {
        mode,
        skip_ops: ops.iter().map(|s| s.to_string()).collect(),
        ..PartitionOptions::default()
    }
}

/// Checks what must hold of every partitioning of `graph`: each node placed
/// once, partitions convex, the schedule respects every edge, the boundary
/// lists are exact, and no two partitions could be merged without a cycle.
fn check(graph: &Graph, p: &Partitioning) {
    let n = graph.nodes.len();
    assert_eq!(p.node_partition.len(), n);
    let cpu: BTreeSet<usize> = p.cpu_nodes.iter().map(|(i, _)| *i).collect();
    for i in 0..n {
        assert_ne!(p.node_partition[i].is_some(), cpu.contains(&i), "node {i}");
    }
    for (id, part) in p.partitions.iter().enumerate() {
        assert_eq!(part.id, id);
        assert!(!part.nodes.is_empty());
        assert!(part.nodes.windows(2).all(|w| w[0] < w[1]));
        for &i in &part.nodes {
            assert_eq!(p.node_partition[i], Some(id));
        }
    }
    let producer = |v: ValueId| graph.nodes.iter().position(|n| n.outputs.contains(&v));
    let preds = |i: usize| -> Vec<usize> {
        graph.nodes[i]
            .inputs
            .iter()
            .flatten()
            .filter_map(|v| producer(*v))
            .collect()
    };
    // convexity: nothing reachable from a partition through outside nodes
    // is inside it
    for part in &p.partitions {
        let inside: BTreeSet<usize> = part.nodes.iter().copied().collect();
        let mut reached = vec![false; n];
        for j in 0..n {
            if inside.contains(&j) {
                continue;
            }
            reached[j] = preds(j).iter().any(|&q| inside.contains(&q) || reached[q]);
        }
        for &i in &part.nodes {
            assert!(
                !preds(i).iter().any(|&q| reached[q]),
                "partition {} is not convex at node {i}",
                part.id
            );
        }
    }
    // the schedule: every step once, producers first
    let mut step_of = vec![usize::MAX; n];
    let mut seen_steps = BTreeSet::new();
    for (k, step) in p.schedule.iter().enumerate() {
        assert!(seen_steps.insert(*step), "step {step:?} twice");
        match *step {
            ScheduleItem::Cpu(i) => step_of[i] = k,
            ScheduleItem::Delegate(id) => {
                for &i in &p.partitions[id].nodes {
                    step_of[i] = k;
                }
            }
        }
    }
    assert_eq!(p.schedule.len(), p.partitions.len() + p.cpu_nodes.len());
    for i in 0..n {
        for q in preds(i) {
            assert!(step_of[q] <= step_of[i], "node {q} after its user {i}");
            if step_of[q] == step_of[i] {
                assert!(p.node_partition[i].is_some());
            }
        }
    }
    // boundaries
    let graph_outputs: BTreeSet<ValueId> = graph.outputs.iter().map(|(v, _)| *v).collect();
    for part in &p.partitions {
        let mine = |i: usize| p.node_partition[i] == Some(part.id);
        let produced: BTreeSet<ValueId> = part
            .nodes
            .iter()
            .flat_map(|&i| graph.nodes[i].outputs.clone())
            .collect();
        let read: BTreeSet<ValueId> = part
            .nodes
            .iter()
            .flat_map(|&i| graph.nodes[i].inputs.iter().flatten().copied())
            .filter(|v| !produced.contains(v))
            .collect();
        let listed: BTreeSet<ValueId> =
            part.inputs.iter().chain(&part.constants).copied().collect();
        assert_eq!(listed, read, "partition {} reads", part.id);
        assert_eq!(listed.len(), part.inputs.len() + part.constants.len());
        for c in &part.constants {
            assert!(graph.constants.contains_key(c));
            for (j, node) in graph.nodes.iter().enumerate() {
                if node.inputs.contains(&Some(*c)) {
                    assert!(p.node_partition[j].is_some(), "constant read on the CPU");
                }
            }
        }
        let escaping: BTreeSet<ValueId> = produced
            .iter()
            .copied()
            .filter(|v| {
                graph_outputs.contains(v)
                    || graph
                        .nodes
                        .iter()
                        .enumerate()
                        .any(|(j, node)| !mine(j) && node.inputs.contains(&Some(*v)))
            })
            .collect();
        assert_eq!(
            part.outputs.iter().copied().collect::<BTreeSet<_>>(),
            escaping
        );
    }
    // maximal: merging any two partitions would make a cycle
    let vertex = |i: usize| p.node_partition[i].map_or(n + i, |id| id);
    assert!(!has_cycle(n, &preds, &vertex));
    for a in 0..p.partitions.len() {
        for b in a + 1..p.partitions.len() {
            let merged = |i: usize| match p.node_partition[i] {
                Some(id) if id == b => a,
                _ => vertex(i),
            };
            assert!(
                has_cycle(n, &preds, &merged),
                "partitions {a} and {b} could be merged"
            );
        }
    }
}

/// Whether the graph of `vertex(node)` classes has a cycle (Kahn's count).
fn has_cycle(
    n: usize,
    preds: &dyn Fn(usize) -> Vec<usize>,
    vertex: &dyn Fn(usize) -> usize,
) -> bool {
    let mut succs: BTreeMap<usize, BTreeSet<usize>> =
        (0..n).map(|i| (vertex(i), BTreeSet::new())).collect();
    for i in 0..n {
        for q in preds(i) {
            if vertex(q) != vertex(i) {
                succs.entry(vertex(q)).or_default().insert(vertex(i));
            }
        }
    }
    let mut indegree: BTreeMap<usize, usize> = succs.keys().map(|v| (*v, 0)).collect();
    for to in succs.values().flatten() {
        *indegree.entry(*to).or_default() += 1;
    }
    let mut free: Vec<usize> = indegree
        .iter()
        .filter(|(_, d)| **d == 0)
        .map(|(v, _)| *v)
        .collect();
    let mut done = 0;
    while let Some(v) = free.pop() {
        done += 1;
        for to in &succs[&v] {
            let d = indegree.get_mut(to).unwrap();
            *d -= 1;
            if *d == 0 {
                free.push(*to);
            }
        }
    }
    done != succs.len()
}

#[test]
fn add_is_one_partition() {
    let graph = fixture("add.pt2");
    let p = partition(&graph, &auto()).unwrap();
    check(&graph, &p);
    assert_eq!(p.partitions.len(), 1);
    assert!(p.cpu_nodes.is_empty());
    assert!(!graph.nodes.is_empty());
    for i in 0..graph.nodes.len() {
        assert_eq!(p.tag(i).as_deref(), Some("tag0"));
    }
    let user_inputs: Vec<ValueId> = graph.user_inputs().collect();
    assert_eq!(p.partitions[0].inputs, user_inputs);
    assert_eq!(
        p.partitions[0].outputs,
        graph.user_outputs().collect::<Vec<_>>()
    );
    assert_eq!(p.schedule, vec![ScheduleItem::Delegate(0)]);
    let whole = PartitionOptions {
        mode: PartitionMode::Whole,
        ..auto()
    };
    assert_eq!(partition(&graph, &whole).unwrap(), p);
}

#[test]
fn linear_is_one_partition_and_owns_its_weights() {
    let graph = fixture("linear.pt2");
    assert!(
        graph.nodes.iter().any(|n| n.op == Op::Linear),
        "linear was decomposed: {:?}",
        graph.nodes.iter().map(|n| n.op.name()).collect::<Vec<_>>()
    );
    let p = partition(&graph, &auto()).unwrap();
    check(&graph, &p);
    assert_eq!(p.partitions.len(), 1);
    assert!(p.cpu_nodes.is_empty());
    let part = &p.partitions[0];
    assert_eq!(part.nodes.len(), graph.nodes.len());
    assert_eq!(part.inputs, graph.user_inputs().collect::<Vec<_>>());
    let params: BTreeSet<ValueId> = graph
        .inputs
        .iter()
        .filter(|(_, k)| matches!(k, InputKind::Parameter { .. }))
        .map(|(v, _)| *v)
        .collect();
    assert_eq!(params.len(), 2);
    assert_eq!(
        part.constants.iter().copied().collect::<BTreeSet<_>>(),
        params
    );
}

#[test]
fn not_decomposed_set_covers_every_op_of_add_relu() {
    let graph = fixture("add_relu.pt2");
    let names: BTreeSet<&str> = graph.nodes.iter().map(|n| n.op.name()).collect();
    assert!(names.contains("add") && names.contains("relu"), "{names:?}");
    for node in &graph.nodes {
        assert!(ops_to_not_decompose(&node.op), "{}", node.op.name());
    }
    let p = partition(&graph, &auto()).unwrap();
    check(&graph, &p);
    assert_eq!(p.partitions.len(), 1);
    // the lifted 1.0 goes to the delegate with the nodes
    assert_eq!(p.partitions[0].constants.len(), 1);
    assert!(graph.constants.contains_key(&p.partitions[0].constants[0]));
    // and what the backend does not take is decomposed
    assert!(!ops_to_not_decompose(&Op::Identity));
    assert!(!ops_to_not_decompose(&Op::Convolution(ConvAttrs {
        stride: vec![1],
        padding: vec![0],
        dilation: vec![1],
        transposed: true,
        output_padding: vec![0],
        groups: 1
    })));
    assert!(ops_to_not_decompose(&Op::Linear));
    assert!(ops_to_not_decompose(&Op::Sdpa {
        is_causal: true,
        scale: None,
        enable_gqa: false
    }));
}

/// A hand-built graph of f32 `[4]` values.
struct Builder {
    graph: Graph,
}

impl Builder {
    fn new() -> Builder {
        Builder {
            graph: Graph::default(),
        }
    }
    fn input(&mut self, name: &str) -> ValueId {
        let v = self.graph.add_value(name, DType::F32, vec![4]);
        self.graph.inputs.push((v, InputKind::User));
        v
    }
    fn node(&mut self, op: Op, inputs: &[ValueId]) -> ValueId {
        self.node_typed(op, inputs, DType::F32)
    }
    fn node_typed(&mut self, op: Op, inputs: &[ValueId], dtype: DType) -> ValueId {
        let name = format!("{}_{}", op.name(), self.graph.nodes.len());
        let out = self.graph.add_value(format!("{name}.out"), dtype, vec![4]);
        self.graph.nodes.push(Node {
            name,
            target: "test".into(),
            op,
            inputs: inputs.iter().map(|v| Some(*v)).collect(),
            outputs: vec![out],
        });
        out
    }
    fn output(&mut self, v: ValueId) {
        self.graph.outputs.push((v, OutputKind::User));
    }
}

const ADD: Op = Op::Binary(BinaryOp::Add);
const MUL: Op = Op::Binary(BinaryOp::Mul);
const RELU: Op = Op::Unary(UnaryOp::Relu);

/// `x + y -> relu -> + x`: relu forced to the CPU in the middle.
fn sandwich() -> Graph {
    let mut b = Builder::new();
    let x = b.input("x");
    let y = b.input("y");
    let s = b.node(ADD, &[x, y]);
    let r = b.node(RELU, &[s]);
    let t = b.node(ADD, &[r, x]);
    b.output(t);
    b.graph
}

#[test]
fn auto_puts_cpu_between_partitions() {
    let graph = sandwich();
    let p = partition(&graph, &skipping(&["relu"], PartitionMode::Auto)).unwrap();
    check(&graph, &p);
    assert_eq!(
        p.schedule,
        vec![
            ScheduleItem::Delegate(0),
            ScheduleItem::Cpu(1),
            ScheduleItem::Delegate(1)
        ]
    );
    assert_eq!(p.partitions[0].nodes, vec![0]);
    assert_eq!(p.partitions[1].nodes, vec![2]);
    assert_eq!(p.cpu_nodes.len(), 1);
    assert!(
        p.cpu_nodes[0].1.contains("skip_ops"),
        "{}",
        p.cpu_nodes[0].1
    );
    // partition 1 reads the CPU result and the graph input
    assert_eq!(
        p.partitions[1].inputs,
        vec![graph.nodes[1].outputs[0], graph.inputs[0].0]
    );
    assert_eq!(p.tag(1), None);
    assert_eq!(p.tag(2).as_deref(), Some("tag1"));
}

/// `isnan(x)` is `x != x`: a GPU compiler may fold it, so it stays on the
/// CPU; a comparison of two different values does not.
#[test]
fn nan_tests_stay_on_the_cpu() {
    let mut b = Builder::new();
    let x = b.input("x");
    let y = b.input("y");
    let nan = b.node_typed(Op::Binary(BinaryOp::Ne), &[x, x], DType::Bool);
    let ne = b.node_typed(Op::Binary(BinaryOp::Ne), &[x, y], DType::Bool);
    b.output(nan);
    b.output(ne);
    let graph = b.graph;
    let p = partition(&graph, &auto()).unwrap();
    check(&graph, &p);
    assert_eq!(p.cpu_nodes.len(), 1, "{:?}", p.cpu_nodes);
    assert_eq!(p.cpu_nodes[0].0, 0);
    assert!(p.cpu_nodes[0].1.contains("NaN"), "{}", p.cpu_nodes[0].1);
    assert_eq!(p.tag(1).as_deref(), Some("tag0"));
}

#[test]
fn whole_names_every_unsupported_node() {
    let mut graph = sandwich();
    let p = partition(&graph, &skipping(&["relu"], PartitionMode::Whole)).unwrap_err();
    assert_eq!(p.kind(), ErrorKind::Unsupported);
    let msg = p.to_string();
    assert!(msg.contains("relu_1") && msg.contains("(relu)"), "{msg}");
    assert!(!msg.contains('\n'), "{msg}");
    // a second reason: a float64 value
    graph.values[graph.nodes[2].outputs[0].0].dtype = DType::F64;
    let msg = partition(&graph, &skipping(&["relu"], PartitionMode::Whole))
        .unwrap_err()
        .to_string();
    assert!(msg.contains("2 node(s)"), "{msg}");
    assert!(msg.contains("add_2") && msg.contains("float64"), "{msg}");
    assert!(partition(&graph, &auto()).is_ok());
}

#[test]
fn independent_branches_share_one_partition() {
    // relu(x) and relu(y) are unconnected; a CPU mul of x feeds neither
    let mut b = Builder::new();
    let x = b.input("x");
    let y = b.input("y");
    let r1 = b.node(RELU, &[x]);
    let m = b.node(MUL, &[x, x]);
    let r2 = b.node(RELU, &[y]);
    for v in [r1, m, r2] {
        b.output(v);
    }
    let p = partition(&b.graph, &skipping(&["mul"], PartitionMode::Auto)).unwrap();
    check(&b.graph, &p);
    assert_eq!(p.partitions.len(), 1);
    assert_eq!(p.partitions[0].nodes, vec![0, 2]);
}

#[test]
fn no_merge_through_the_cpu() {
    // a = relu(x); c = cpu(a); d = relu(x) + c: {a, d} would wrap the CPU node
    let mut b = Builder::new();
    let x = b.input("x");
    let a = b.node(RELU, &[x]);
    let c = b.node(MUL, &[a, a]);
    let e = b.node(RELU, &[x]);
    let d = b.node(ADD, &[e, c]);
    b.output(d);
    let p = partition(&b.graph, &skipping(&["mul"], PartitionMode::Auto)).unwrap();
    check(&b.graph, &p);
    assert_eq!(p.partitions.len(), 2);
    // the add joins its producer relu(x); that pair waits for the CPU node
    assert_eq!(p.partitions[0].nodes, vec![0]);
    assert_eq!(p.partitions[1].nodes, vec![2, 3]);
    assert_eq!(
        p.schedule,
        vec![
            ScheduleItem::Delegate(0),
            ScheduleItem::Cpu(1),
            ScheduleItem::Delegate(1)
        ]
    );
}

#[test]
fn constants_read_on_the_cpu_stay_there() {
    let mut b = Builder::new();
    let x = b.input("x");
    let w = b
        .graph
        .add_constant("w", Tensor::from_f32(DType::F32, &[4], &[1.0; 4]).unwrap());
    let k = b
        .graph
        .add_constant("k", Tensor::from_f32(DType::F32, &[4], &[2.0; 4]).unwrap());
    let s = b.node(ADD, &[x, w]);
    let t = b.node(ADD, &[s, k]);
    let m = b.node(MUL, &[t, w]);
    b.output(m);
    let p = partition(&b.graph, &skipping(&["mul"], PartitionMode::Auto)).unwrap();
    check(&b.graph, &p);
    assert_eq!(p.partitions[0].constants, vec![k]);
    assert_eq!(p.partitions[0].inputs, vec![x, w]);
}

#[test]
fn mutated_buffers_are_tagged_with_their_partition() {
    let mut b = Builder::new();
    let x = b.input("x");
    let buf = b.graph.add_constant(
        "cache",
        Tensor::from_f32(DType::F32, &[4], &[0.0; 4]).unwrap(),
    );
    b.graph.inputs.insert(
        0,
        (
            buf,
            InputKind::Buffer {
                fqn: "cache".into(),
                persistent: true,
            },
        ),
    );
    let updated = b.node(ADD, &[buf, x]);
    let y = b.node(RELU, &[updated]);
    b.graph.outputs.push((
        updated,
        OutputKind::BufferMutation {
            fqn: "cache".into(),
        },
    ));
    b.output(y);
    let p = partition(&b.graph, &auto()).unwrap();
    check(&b.graph, &p);
    let part = &p.partitions[0];
    assert_eq!(part.mutated_buffers, vec![(buf, updated)]);
    // state, not read-only named data
    assert!(part.constants.is_empty());
    assert_eq!(part.inputs, vec![buf, x]);
    assert_eq!(part.outputs, vec![updated, y]);
}

#[test]
fn malformed_graphs_are_errors() {
    let mut graph = sandwich();
    graph.nodes.swap(0, 1);
    let err = partition(&graph, &auto()).unwrap_err();
    assert_eq!(err.kind(), ErrorKind::InvalidInput);
    assert!(err.to_string().contains("topological"), "{err}");
    let mut graph = sandwich();
    graph.nodes[1].inputs[0] = Some(ValueId(999));
    let err = partition(&graph, &auto()).unwrap_err();
    assert!(err.to_string().contains("#999"), "{err}");
    let mut graph = sandwich();
    graph.nodes[2].outputs = graph.nodes[0].outputs.clone();
    let err = partition(&graph, &auto()).unwrap_err();
    assert!(err.to_string().contains("produced twice"), "{err}");
}

#[test]
fn long_alternating_chain_partitions_and_schedules() {
    // relu, mul, relu, mul, ...: every relu its own partition
    let mut b = Builder::new();
    let mut v = b.input("x");
    for i in 0..2000 {
        v = b.node(if i % 2 == 0 { RELU } else { MUL }, &[v, v][..1 + i % 2]);
    }
    b.output(v);
    let p = partition(&b.graph, &skipping(&["mul"], PartitionMode::Auto)).unwrap();
    assert_eq!(p.partitions.len(), 1000);
    for (k, step) in p.schedule.iter().enumerate() {
        let expected = if k % 2 == 0 {
            ScheduleItem::Delegate(k / 2)
        } else {
            ScheduleItem::Cpu(k)
        };
        assert_eq!(*step, expected);
    }
}

/// xorshift64*: deterministic, no dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

#[test]
fn random_dags_partition_convexly() {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let mut total_partitions = 0;
    let mut total_cpu = 0;
    for case in 0..300 {
        let mut b = Builder::new();
        let mut pool: Vec<ValueId> = (0..1 + rng.below(3))
            .map(|i| b.input(&format!("in{i}")))
            .collect();
        let nodes = 1 + rng.below(24);
        for _ in 0..nodes {
            // recent values more often, so chains and diamonds both occur
            let pick = |rng: &mut Rng| {
                let back = rng.below(pool.len().min(6));
                pool[if rng.below(3) == 0 {
                    rng.below(pool.len())
                } else {
                    pool.len() - 1 - back
                }]
            };
            let v = match rng.below(4) {
                0 => {
                    let a = pick(&mut rng);
                    b.node(RELU, &[a])
                }
                1 => {
                    let (a, c) = (pick(&mut rng), pick(&mut rng));
                    b.node(MUL, &[a, c])
                }
                _ => {
                    let (a, c) = (pick(&mut rng), pick(&mut rng));
                    b.node(ADD, &[a, c])
                }
            };
            pool.push(v);
        }
        let last = *pool.last().unwrap();
        b.output(last);
        if rng.below(2) == 0 {
            let extra = pool[rng.below(pool.len())];
            b.output(extra);
        }
        let options = skipping(&["mul"], PartitionMode::Auto);
        let p = partition(&b.graph, &options).unwrap();
        check(&b.graph, &p);
        assert_eq!(partition(&b.graph, &options).unwrap(), p, "case {case}");
        total_partitions += p.partitions.len();
        total_cpu += p.cpu_nodes.len();
    }
    // the generator does exercise fragmented graphs
    assert!(total_partitions > 300 && total_cpu > 300);
}

fn workspace_pt2s() -> Vec<PathBuf> {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let mut files = vec![];
    for dir in ["tests/fixtures", "crates/etmetal-metal/tests/fixtures"] {
        for entry in std::fs::read_dir(root.join(dir)).unwrap() {
            let path = entry.unwrap().path();
            if path.extension().is_some_and(|e| e == "pt2") {
                files.push(path);
            }
        }
    }
    files.sort();
    files
}

#[test]
fn every_fixture_partitions_convexly() {
    let files = workspace_pt2s();
    assert!(files.len() >= 10, "{files:?}");
    for path in files {
        let mut graph = load_pt2(&path).unwrap();
        decompose(&mut graph, &ops_to_not_decompose);
        let p = partition(&graph, &auto()).unwrap();
        check(&graph, &p);
        assert!(!p.partitions.is_empty(), "{}", path.display());
        // forcing the most frequent op off the GPU fragments the graph and
        // must stay convex too
        let mut counts = BTreeMap::<String, usize>::new();
        for node in &graph.nodes {
            *counts.entry(node.op.name().to_string()).or_default() += 1;
        }
        let top = counts.iter().max_by_key(|(_, c)| **c).unwrap().0.clone();
        let p = partition(&graph, &skipping(&[&top], PartitionMode::Auto)).unwrap();
        check(&graph, &p);
        let err = partition(&graph, &skipping(&[&top], PartitionMode::Whole)).unwrap_err();
        assert!(err.to_string().contains(&format!("({top})")), "{err}");
    }
}

/// A chain `x → op(x, x) → op(a, a)` of `numel` elements of `dtype`; `a`,
/// read twice by the second node, is a buffer of its own in the delegate.
fn pair_chain(dtype: DType, op: BinaryOp, numel: usize) -> Graph {
    let mut g = Graph::default();
    let x = g.add_value("x", dtype, vec![numel]);
    g.inputs.push((x, InputKind::User));
    let a = g.add_value("a", dtype, vec![numel]);
    let b = g.add_value("b", dtype, vec![numel]);
    for (name, input, out) in [("first", x, a), ("second", a, b)] {
        g.nodes.push(Node {
            name: name.into(),
            target: format!("{op:?}"),
            op: Op::Binary(op),
            inputs: vec![Some(input), Some(input)],
            outputs: vec![out],
        });
    }
    g.outputs.push((b, OutputKind::User));
    g
}

/// The buffer limit counts a value as the delegate holds it — one 32-bit
/// word an element for every dtype (16-bit float intermediates are f32,
/// int64 is narrowed, bool widened) — not at its host size: a value of
/// exactly the limit goes to the GPU, one element more stays on the CPU,
/// and the compiled payload binds no buffer beyond the limit checked.
#[test]
fn buffer_limit_is_the_gpu_size_of_every_dtype() {
    const WORDS: usize = 96;
    let limits = DeviceLimits {
        max_buffer_bytes: 4 * WORDS as u64,
        ..DeviceLimits::default()
    };
    let options = PartitionOptions {
        limits: limits.clone(),
        ..PartitionOptions::default()
    };
    for (dtype, op) in [
        (DType::F32, BinaryOp::Maximum),
        (DType::BF16, BinaryOp::Maximum),
        (DType::F16, BinaryOp::Maximum),
        (DType::I64, BinaryOp::Maximum),
        (DType::Bool, BinaryOp::LogicalAnd),
    ] {
        let at = pair_chain(dtype, op, WORDS);
        let p = partition(&at, &options).unwrap();
        assert_eq!(p.cpu_nodes, vec![], "{dtype:?} at the limit");
        assert_eq!(p.partitions.len(), 1, "{dtype:?}");
        let compiled = preprocess(&at, &p.partitions[0], &PreprocessOptions::default()).unwrap();
        let need = compiled
            .payload
            .requirements
            .max_storage_buffer_binding_size;
        assert!(
            need <= limits.max_buffer_bytes,
            "{dtype:?}: the payload binds {need} bytes, the limit is {}",
            limits.max_buffer_bytes
        );

        let beyond = pair_chain(dtype, op, WORDS + 1);
        let p = partition(&beyond, &options).unwrap();
        assert!(p.partitions.is_empty(), "{dtype:?}: {:?}", p.partitions);
        for (node, reason) in &p.cpu_nodes {
            assert!(
                reason.contains("byte buffer limit"),
                "{dtype:?} node {node}: {reason}"
            );
        }
    }
}
