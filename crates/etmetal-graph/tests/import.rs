//! Import of the committed `.pt2` fixtures (written by
//! `scripts/make_fixtures.py`) and of malformed archives made from them.

use std::collections::BTreeMap;
use std::io::{Cursor, Read, Write};
use std::path::PathBuf;

use etmetal_core::{
    npy, AvgPoolAttrs, BinaryOp, ConvAttrs, DType, ErrorKind, MaxPoolAttrs, Op, SymExpr, SymRange,
    Tensor,
};
use etmetal_graph::eval::run_graph;
use etmetal_graph::{
    decompose, eliminate_dead_code, import_pt2, infer, load_pt2, Graph, InputKind, OutputKind,
};
use serde_json::Value;

fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(name)
}

fn load(name: &str) -> Graph {
    load_pt2(&fixture(&format!("{name}.pt2"))).unwrap_or_else(|e| panic!("{name}: {e}"))
}

fn ops(g: &Graph) -> Vec<&'static str> {
    g.nodes.iter().map(|n| n.op.name()).collect()
}

fn constant(g: &Graph, fqn: &str) -> Tensor {
    let (id, _) = g
        .inputs
        .iter()
        .find(|(_, k)| matches!(k, InputKind::Parameter { fqn: f } | InputKind::Buffer { fqn: f, .. } if f == fqn))
        .unwrap_or_else(|| panic!("no input for {fqn}"));
    g.constants[id].clone()
}

/// Every node's outputs re-infer to what the graph records.
fn assert_consistent(g: &Graph) {
    let mut defined: Vec<bool> = vec![false; g.values.len()];
    for (v, k) in &g.inputs {
        defined[v.0] = true;
        if *k != InputKind::User {
            assert!(
                g.constants.contains_key(v),
                "input {} has no data",
                g.value(*v).name
            );
        }
    }
    for v in g.constants.keys() {
        defined[v.0] = true;
    }
    for n in &g.nodes {
        for i in n.inputs.iter().flatten() {
            assert!(
                defined[i.0],
                "node {} reads {} before it is defined",
                n.name,
                g.value(*i).name
            );
        }
        let got = infer(g, n).unwrap();
        let want: Vec<_> = n
            .outputs
            .iter()
            .map(|v| (g.value(*v).dtype, g.value(*v).shape.clone()))
            .collect();
        assert_eq!(got, want, "node {}", n.name);
        for o in &n.outputs {
            defined[o.0] = true;
        }
    }
    for (v, _) in &g.outputs {
        assert!(defined[v.0]);
    }
}

fn matmul_t(x: &[f32], w: &[f32], b: &[f32], n: usize, k: usize, m: usize) -> Vec<f32> {
    // x [n,k] @ w[m,k]^T + b
    (0..n)
        .flat_map(|i| {
            (0..m).map(move |j| b[j] + (0..k).map(|t| x[i * k + t] * w[j * k + t]).sum::<f32>())
        })
        .collect()
}

fn close(a: &[f32], b: &[f32], tol: f32) {
    assert_eq!(a.len(), b.len());
    for (x, y) in a.iter().zip(b) {
        assert!((x - y).abs() <= tol * (1.0 + y.abs()), "{a:?} vs {b:?}");
    }
}

#[test]
fn mlp_signature_constants_and_values() {
    let g = load("mlp");
    assert_eq!(ops(&g), ["linear", "relu", "linear"]);
    let kinds: Vec<_> = g.inputs.iter().map(|(_, k)| k.clone()).collect();
    assert_eq!(
        kinds[0],
        InputKind::Parameter {
            fqn: "fc1.weight".into()
        }
    );
    assert_eq!(kinds.last(), Some(&InputKind::User));
    assert_eq!(g.outputs.len(), 1);
    assert_eq!(g.outputs[0].1, OutputKind::User);
    assert_eq!(g.value(g.outputs[0].0).shape, vec![2, 4]);
    assert_consistent(&g);
    // the weights reproduce PyTorch's output
    let x = npy::read(&fixture("mlp.input_0.npy")).unwrap().to_f32_vec();
    let want = npy::read(&fixture("mlp.output_0.npy"))
        .unwrap()
        .to_f32_vec();
    let (w1, b1) = (
        constant(&g, "fc1.weight").to_f32_vec(),
        constant(&g, "fc1.bias").to_f32_vec(),
    );
    let (w2, b2) = (
        constant(&g, "fc2.weight").to_f32_vec(),
        constant(&g, "fc2.bias").to_f32_vec(),
    );
    let h: Vec<f32> = matmul_t(&x, &w1, &b1, 2, 8, 16)
        .into_iter()
        .map(|v| v.max(0.0))
        .collect();
    close(&matmul_t(&h, &w2, &b2, 2, 16, 4), &want, 1e-5);
}

#[test]
fn transposed_weight_is_materialised_from_its_storage() {
    let g = load("transposed_weight");
    assert_eq!(ops(&g), ["mat_mul", "mul"]);
    let w = constant(&g, "w");
    assert_eq!(w.shape(), &[3, 4]);
    assert_eq!(constant(&g, "scale").to_f32_vec(), vec![1.0, 2.0, 3.0, 4.0]);
    assert!(matches!(
        g.inputs[1].1,
        InputKind::Buffer {
            persistent: true,
            ..
        }
    ));
    let x = npy::read(&fixture("transposed_weight.input_0.npy"))
        .unwrap()
        .to_f32_vec();
    let want = npy::read(&fixture("transposed_weight.output_0.npy"))
        .unwrap()
        .to_f32_vec();
    let (x, w) = (&x, &w.to_f32_vec());
    let got: Vec<f32> = (0..2)
        .flat_map(|i| {
            (0..4).map(move |j| {
                (j + 1) as f32 * (0..3).map(|t| x[i * 3 + t] * w[t * 4 + j]).sum::<f32>()
            })
        })
        .collect();
    close(&got, &want, 1e-5);
}

#[test]
fn bf16_module_keeps_bf16() {
    let g = load("bf16_mlp");
    assert_eq!(ops(&g), ["linear", "silu", "mul"]);
    assert_eq!(constant(&g, "fc.weight").dtype(), DType::BF16);
    assert_eq!(g.value(g.outputs[0].0).dtype, DType::BF16);
    // `* 2.0` becomes a 0-d bf16 constant (float scalar with a float tensor)
    let mul = &g.nodes[2];
    let k = &g.constants[&mul.inputs[1].unwrap()];
    assert_eq!(
        (k.dtype(), k.shape().len(), k.to_f32_vec()),
        (DType::BF16, 0, vec![2.0])
    );
    assert_consistent(&g);
}

#[test]
fn resblock_default_and_decomposed_export_give_the_same_ops() {
    for name in ["resblock", "resblock_decomposed"] {
        let g = load(name);
        assert_eq!(
            ops(&g),
            [
                "convolution",
                "batch_norm",
                "relu",
                "convolution",
                "batch_norm",
                "add",
                "relu"
            ],
            "{name}"
        );
        let Op::Convolution(ConvAttrs {
            padding,
            stride,
            groups,
            ..
        }) = &g.nodes[0].op
        else {
            panic!()
        };
        assert_eq!(
            (padding.as_slice(), stride.as_slice(), *groups),
            (&[1, 1][..], &[1, 1][..], 1)
        );
        assert_eq!(g.nodes[0].inputs[2], None, "conv without bias");
        assert!(matches!(&g.nodes[1].op, Op::BatchNorm { eps } if (*eps - 1e-5).abs() < 1e-12));
        assert_eq!(constant(&g, "bn1.running_var").shape(), &[4]);
        assert_consistent(&g);
    }
}

#[test]
fn gpt_block_imports_both_exports() {
    let g = load("gpt_block");
    let names = ops(&g);
    assert_eq!(names.iter().filter(|n| **n == "sdpa").count(), 1);
    assert_eq!(
        names.iter().filter(|n| **n == "slice").count(),
        3,
        "split becomes three slices"
    );
    let sdpa = g
        .nodes
        .iter()
        .find(|n| matches!(n.op, Op::Sdpa { .. }))
        .unwrap();
    assert_eq!(
        sdpa.op,
        Op::Sdpa {
            is_causal: true,
            scale: None,
            enable_gqa: false
        }
    );
    assert!(g
        .nodes
        .iter()
        .any(|n| n.op == Op::Unary(etmetal_core::UnaryOp::Gelu { tanh: true })));
    assert_consistent(&g);

    let d = load("gpt_block_decomposed");
    let names = ops(&d);
    assert!(
        !names.contains(&"sdpa"),
        "decomposed attention is matmuls and softmax"
    );
    assert!(names.contains(&"addmm") && names.contains(&"softmax"));
    assert!(names.contains(&"where") && names.contains(&"arange"));
    assert_consistent(&d);
}

#[test]
fn decompose_fixtures_to_core_ops() {
    for name in [
        "mlp",
        "mlp_decomposed",
        "resblock",
        "gpt_block",
        "gpt_block_decomposed",
        "bf16_mlp",
        "llama_block",
        "bert_block",
        "mobile_block",
        "ops_misc",
    ] {
        let mut g = load(name);
        decompose(&mut g, &|_| false);
        eliminate_dead_code(&mut g);
        for n in &g.nodes {
            assert!(
                !matches!(n.op, Op::Linear | Op::Addmm { .. } | Op::BatchNorm { .. }),
                "{name}: {}",
                n.name
            );
        }
        assert_consistent(&g);
    }
    let mut g = load("mlp");
    decompose(&mut g, &|_| false);
    assert_eq!(ops(&g), ["mat_mul", "add", "relu", "mat_mul", "add"]);
    let mut g = load("mlp_decomposed");
    decompose(&mut g, &|_| false);
    eliminate_dead_code(&mut g);
    assert_eq!(
        ops(&g),
        ["permute", "mat_mul", "add", "relu", "permute", "mat_mul", "add"]
    );
    let mut g = load("resblock");
    decompose(&mut g, &|op| matches!(op, Op::Convolution(_)));
    assert_eq!(
        ops(&g),
        [
            "convolution",
            "mul",
            "add",
            "relu",
            "convolution",
            "mul",
            "add",
            "add",
            "relu"
        ]
    );
}

// ---- malformed archives -------------------------------------------------

fn entries(name: &str) -> Vec<(String, Vec<u8>)> {
    let bytes = std::fs::read(fixture(&format!("{name}.pt2"))).unwrap();
    let config = zip::read::Config {
        archive_offset: zip::read::ArchiveOffset::Known(0),
    };
    let mut z = zip::ZipArchive::with_config(config, Cursor::new(bytes)).unwrap();
    (0..z.len())
        .map(|i| {
            let mut f = z.by_index(i).unwrap();
            let mut data = vec![];
            f.read_to_end(&mut data).unwrap();
            (f.name().unwrap().to_string(), data)
        })
        .collect()
}

fn rezip(entries: &[(String, Vec<u8>)]) -> Vec<u8> {
    let mut w = zip::ZipWriter::new(Cursor::new(Vec::new()));
    let opts =
        zip::write::SimpleFileOptions::default().compression_method(zip::CompressionMethod::Stored);
    for (name, data) in entries {
        w.start_file(name.as_str(), opts).unwrap();
        w.write_all(data).unwrap();
    }
    w.finish().unwrap().into_inner()
}

/// The fixture with the JSON entry ending in `suffix` edited by `edit`.
fn edited_json(name: &str, suffix: &str, edit: impl Fn(&mut Value)) -> Vec<u8> {
    let mut es = entries(name);
    let (_, data) = es.iter_mut().find(|(n, _)| n.ends_with(suffix)).unwrap();
    let mut v: Value = serde_json::from_slice(data).unwrap();
    edit(&mut v);
    *data = serde_json::to_vec(&v).unwrap();
    rezip(&es)
}

fn err(bytes: &[u8]) -> etmetal_core::Error {
    import_pt2(bytes, "bad.pt2").expect_err("import should fail")
}

#[test]
fn rebuilt_archive_still_imports() {
    let g = import_pt2(&rezip(&entries("mlp")), "rebuilt.pt2").unwrap();
    assert_eq!(ops(&g), ["linear", "relu", "linear"]);
}

#[test]
fn non_zip_and_truncated_files_are_format_errors() {
    let e = err(b"definitely not a zip file");
    assert_eq!(e.kind(), ErrorKind::Format);
    assert!(
        e.to_string().contains("bad.pt2") && e.to_string().contains("zip"),
        "{e}"
    );
    let bytes = std::fs::read(fixture("mlp.pt2")).unwrap();
    let e = err(&bytes[..bytes.len() / 2]);
    assert_eq!(e.kind(), ErrorKind::Format, "{e}");
    let e = err(&bytes[..bytes.len() - 30]);
    assert_eq!(e.kind(), ErrorKind::Format, "{e}");
}

#[test]
fn a_corrupted_weight_is_refused_by_its_crc() {
    let es = entries("mlp");
    let (name, weight) = es
        .iter()
        .filter(|(n, _)| n.contains("/data/weights/"))
        .max_by_key(|(_, d)| d.len())
        .unwrap();
    let mut bytes = rezip(&es);
    // one bit of the weight's stored bytes flipped: the archive still
    // opens, the entry's CRC no longer matches
    let at = bytes
        .windows(weight.len())
        .position(|w| w == weight.as_slice())
        .unwrap();
    bytes[at + weight.len() / 2] ^= 1;
    let e = err(&bytes);
    assert_eq!(e.kind(), ErrorKind::Format, "{e}");
    assert!(
        e.to_string()
            .contains(&format!("reading zip entry `{name}`: Invalid checksum")),
        "{e}"
    );
}

#[test]
fn missing_program_is_reported() {
    let es: Vec<_> = entries("mlp")
        .into_iter()
        .filter(|(n, _)| !n.contains("/models/"))
        .collect();
    let e = err(&rezip(&es));
    assert_eq!(e.kind(), ErrorKind::Format);
    assert!(e.to_string().contains("models/*.json"), "{e}");
}

#[test]
fn wrong_schema_major_names_the_version() {
    let bytes = edited_json("mlp", "models/model.json", |v| {
        v["schema_version"]["major"] = 9.into()
    });
    let e = err(&bytes);
    assert_eq!(e.kind(), ErrorKind::Unsupported);
    assert!(e.to_string().contains("schema version 9.20"), "{e}");
}

#[test]
fn unknown_ops_are_all_listed() {
    let bytes = edited_json("gpt_block", "models/model.json", |v| {
        for n in v["graph_module"]["graph"]["nodes"].as_array_mut().unwrap() {
            if n["target"] == "torch.ops.aten.layer_norm.default" {
                n["target"] = "torch.ops.mylib.norm.default".into();
            }
        }
    });
    let e = err(&bytes);
    assert_eq!(e.kind(), ErrorKind::Unsupported);
    let msg = e.to_string();
    assert!(msg.contains("2 unsupported node(s)"), "{msg}");
    assert!(
        msg.contains("node `layer_norm` (torch.ops.mylib.norm.default)"),
        "{msg}"
    );
    assert!(
        msg.contains("node `layer_norm_1` (torch.ops.mylib.norm.default)"),
        "{msg}"
    );
    // the message says which documented rewrite would help
    assert!(
        msg.contains("a custom op")
            && msg.contains("ep.run_decompositions({torch.ops.mylib.norm: f})"),
        "{msg}"
    );
    assert!(
        !msg.contains("linear"),
        "nodes downstream of a failed one are not reported: {msg}"
    );
}

#[test]
fn short_weight_payload_is_rejected() {
    let mut es = entries("mlp");
    let (name, data) = es
        .iter_mut()
        .find(|(n, _)| n.ends_with("data/weights/weight_0"))
        .unwrap();
    let name = name.clone();
    data.truncate(data.len() / 2);
    let e = err(&rezip(&es));
    assert_eq!(e.kind(), ErrorKind::Format);
    let msg = e.to_string();
    assert!(
        msg.contains("fc1.weight") && msg.contains("outside the storage"),
        "{msg} ({name})"
    );
}

#[test]
fn empty_storage_is_a_fake_constant_of_zeros() {
    // what ExecuTorch's partitioner programs hold for lifted constants
    let mut es = entries("mlp");
    let (_, data) = es
        .iter_mut()
        .find(|(n, _)| n.ends_with("data/weights/weight_0"))
        .unwrap();
    data.clear();
    let g = import_pt2(&rezip(&es), "fake.pt2").unwrap();
    let fake: Vec<&str> = g
        .fake_constants
        .iter()
        .map(|&v| g.value(v).name.as_str())
        .collect();
    assert_eq!(fake.len(), 1, "{fake:?}");
    let t = &g.constants[g.fake_constants.first().unwrap()];
    assert!(t.to_f32_vec().iter().all(|&x| x == 0.0));
    assert!(load("mlp").fake_constants.is_empty());
}

#[test]
fn strides_outside_storage_are_rejected() {
    let bytes = edited_json("mlp", "model_weights_config.json", |v| {
        v["config"]["fc1.weight"]["tensor_meta"]["strides"][0] = serde_json::json!({"as_int": 9});
    });
    let e = err(&bytes);
    assert_eq!(e.kind(), ErrorKind::Format);
    assert!(
        e.to_string().contains("strides [9, 1]") && e.to_string().contains("fc1.weight"),
        "{e}"
    );
}

#[test]
fn metadata_that_disagrees_with_inference_is_rejected() {
    let bytes = edited_json("mlp", "models/model.json", |v| {
        v["graph_module"]["graph"]["tensor_values"]["relu"]["sizes"][1] =
            serde_json::json!({"as_int": 17});
    });
    let e = err(&bytes);
    assert_eq!(e.kind(), ErrorKind::Shape);
    let msg = e.to_string();
    assert!(
        msg.contains("node `relu`") && msg.contains("[2, 17]") && msg.contains("[2, 16]"),
        "{msg}"
    );
}

#[test]
fn a_symbol_without_an_upper_bound_is_refused_naming_it() {
    let sym = serde_json::json!({"as_expr": {"expr_str": "Symbol('s0', positive=True, integer=True)", "hint": {"as_int": 2}}});
    let bytes = edited_json("mlp", "models/model.json", |v| {
        v["graph_module"]["graph"]["tensor_values"]["x"]["sizes"][0] = sym.clone();
    });
    let e = err(&bytes);
    assert_eq!(e.kind(), ErrorKind::Unsupported);
    assert!(
        e.to_string()
            .contains("tensor `x`: symbol `s0` has no upper bound"),
        "{e}"
    );
    let bytes = edited_json("mlp", "models/model.json", |v| {
        v["graph_module"]["graph"]["tensor_values"]["x"]["sizes"][0] = sym.clone();
        v["range_constraints"] = serde_json::json!({"s0": {"min_val": 2, "max_val": null}});
    });
    let e = err(&bytes);
    assert_eq!(e.kind(), ErrorKind::Unsupported);
    assert!(
        e.to_string().contains("symbol `s0` has no upper bound"),
        "{e}"
    );
    // a symbol no size uses (torch.export leaves such ranges behind) is harmless
    let bytes = edited_json("mlp", "models/model.json", |v| {
        v["range_constraints"] = serde_json::json!({"s7": {"min_val": 2, "max_val": null}});
    });
    import_pt2(&bytes, "leftover.pt2").expect("an unused unbounded symbol imports");
}

#[test]
fn dynamic_sequence_imports_with_symbolic_sizes_at_their_bound() {
    let g = load("dynamic/gpt_block_seq");
    let s = SymExpr::sym(g.sym.ranges.keys().next().expect("one symbol").clone());
    assert_eq!(g.sym.ranges.len(), 1);
    assert_eq!(g.sym.ranges[&s.to_string()], SymRange { min: 1, max: 16 });
    let x = g.user_inputs().next().unwrap();
    assert_eq!(g.value(x).shape, [1, 16, 16]);
    assert_eq!(
        g.sym_dims(x),
        [SymExpr::Const(1), s.clone(), SymExpr::Const(16)]
    );
    let y = g.user_outputs().next().unwrap();
    assert_eq!(g.sym_dims(y), g.sym_dims(x));
    // weights stay static; every dynamic value is bounded by its shape
    for (v, kind) in &g.inputs {
        assert_eq!(g.is_dynamic(*v), *kind == InputKind::User);
    }
    for (v, dims) in &g.sym.dims {
        let ub: Vec<usize> = dims
            .iter()
            .map(|d| d.upper_bound(&g.sym.ranges).unwrap())
            .collect();
        assert_eq!(ub, g.value(*v).shape, "{}", g.value(*v).name);
    }
    // decompositions keep the symbolic sizes (a rewrite that would not is refused)
    let mut d = g.clone();
    decompose(&mut d, &|_| false);
    let y = d.user_outputs().next().unwrap();
    assert_eq!(d.sym_dims(y), g.sym_dims(x));
    assert!(d.nodes.iter().all(|n| n.op.name() != "linear"));
}

#[test]
fn dynamic_prefill_writes_its_static_kv_cache() {
    // transformers' recipe, `prefill` of 1..16 tokens (scripts/make_llm_fixture.py)
    let g = load("llm_dynamic/prefill");
    let (name, range) = g.sym.ranges.iter().next().expect("one symbol");
    assert_eq!(*range, SymRange { min: 1, max: 16 });
    let s = SymExpr::sym(name.clone());
    let producer = |v| g.nodes.iter().find(|n| n.outputs.contains(&v)).unwrap();
    // the portable kernels' form of each write
    let mut portable = g.clone();
    etmetal_graph::portable::to_portable(&mut portable).unwrap();
    for layer in ["", "_1", "_2", "_3"] {
        // the cache (32 positions) stays static; the index holds the
        // run-time length's positions
        let write = node(&g, &format!("index_copy_{layer}"));
        assert_eq!(write.op, Op::IndexCopy { dim: 2 });
        let out = write.outputs[0];
        assert_eq!(g.value(out).shape, [1, 2, 32, 8]);
        assert!(!g.is_dynamic(out));
        assert_eq!(
            g.sym_dims(write.inputs[1].unwrap()),
            std::slice::from_ref(&s)
        );
        // decomposed, the rows written are numbered by an arange of the
        // run-time length, not a table at the bound
        let helpers = portable
            .nodes
            .iter()
            .filter(|n| n.name.starts_with(&format!("{}.", write.name)));
        let arange = helpers
            .filter(|n| matches!(n.op, Op::Arange { .. }))
            .collect::<Vec<_>>();
        assert_eq!(arange.len(), 1, "{}", write.name);
        assert_eq!(
            portable.sym_dims(arange[0].outputs[0]),
            std::slice::from_ref(&s)
        );
    }
    for add in ["add_", "add__1"] {
        // the fill counter += seq_len: seq_len's lower bound (1) plus the
        // sum of a full of seq_len - 1 ones
        let n = node(&g, add);
        assert!(!g.is_dynamic(n.outputs[0]));
        let plus_lower = producer(n.inputs[1].unwrap());
        assert_eq!(plus_lower.op, Op::Binary(BinaryOp::Add));
        let lower = &g.constants[&plus_lower.inputs[1].unwrap()];
        assert_eq!(lower.to_i64_vec(), [1]);
        let sum = producer(plus_lower.inputs[0].unwrap());
        assert!(matches!(sum.op, Op::Reduce { .. }), "{:?}", sum.op);
        let ones = producer(sum.inputs[0].unwrap());
        assert!(matches!(ones.op, Op::Full { .. }), "{:?}", ones.op);
        assert_eq!(g.sym_dims(ones.outputs[0]), [s.clone() - SymExpr::Const(1)]);
    }
}

#[test]
fn reading_a_dropped_extra_output_is_an_error() {
    // make the graph return batch norm's saved mean, which etmetal drops
    let bytes = edited_json("resblock_decomposed", "models/model.json", |v| {
        let name = "_native_batch_norm_legit_no_training_unused_1";
        let nodes = v["graph_module"]["graph"]["nodes"].as_array().unwrap();
        assert!(nodes[1]["outputs"].to_string().contains(name));
        v["graph_module"]["signature"]["output_specs"][0]["user_output"]["arg"]["as_tensor"]
            ["name"] = name.into();
    });
    let e = err(&bytes);
    assert_eq!(e.kind(), ErrorKind::Unsupported);
    assert!(e.to_string().contains("extra output of node"), "{e}");
}

#[test]
fn fixture_entries_share_one_prefix_folder() {
    // all fixture entries are under one prefix folder named after the file
    let names: BTreeMap<String, usize> = entries("mlp")
        .into_iter()
        .map(|(n, d)| (n, d.len()))
        .collect();
    assert!(names.keys().all(|n| n.starts_with("mlp/")));
}

fn node<'g>(g: &'g Graph, name: &str) -> &'g etmetal_graph::Node {
    g.nodes
        .iter()
        .find(|n| n.name == name)
        .unwrap_or_else(|| panic!("no node {name}"))
}

fn const_of(g: &Graph, n: &etmetal_graph::Node, slot: usize) -> Tensor {
    g.constants[&n.inputs[slot].unwrap()].clone()
}

#[test]
fn llama_and_bert_blocks_import() {
    use etmetal_core::UnaryOp;
    let g = load("llama_block");
    let sdpa = g
        .nodes
        .iter()
        .find(|n| matches!(n.op, Op::Sdpa { .. }))
        .unwrap();
    assert_eq!(
        sdpa.op,
        Op::Sdpa {
            is_causal: true,
            scale: None,
            enable_gqa: true
        }
    );
    assert_eq!(
        g.value(sdpa.inputs[1].unwrap()).shape,
        vec![1, 2, 6, 4],
        "2 kv heads for 4 query heads"
    );
    assert!(g
        .nodes
        .iter()
        .any(|n| matches!(n.op, Op::RmsNorm { eps: Some(e), .. } if e == 1e-6)));
    assert!(g.nodes.iter().any(|n| n.op == Op::Unary(UnaryOp::Silu)));
    // rotary tables are non-persistent buffers: constants, not weights
    assert!(g
        .inputs
        .iter()
        .any(|(_, k)| matches!(k, InputKind::Buffer { fqn, persistent: false } if fqn == "cos")));
    assert_eq!(g.value(g.outputs[1].0).dtype, DType::I64, "argmax output");
    assert_consistent(&g);

    let g = load("bert_block");
    let sdpa = g
        .nodes
        .iter()
        .find(|n| matches!(n.op, Op::Sdpa { .. }))
        .unwrap();
    assert_eq!(
        sdpa.op,
        Op::Sdpa {
            is_causal: false,
            scale: Some(0.25),
            enable_gqa: false
        }
    );
    assert_eq!(
        g.value(sdpa.inputs[3].unwrap()).dtype,
        DType::F32,
        "additive float mask"
    );
    // rsub(1.0, m) is sub with the scalar first
    let rsub = node(&g, "rsub");
    assert_eq!(rsub.op, Op::Binary(BinaryOp::Sub));
    assert_eq!(const_of(&g, rsub, 0).to_f32_vec(), vec![1.0]);
    assert!(g
        .nodes
        .iter()
        .any(|n| n.op == Op::Unary(UnaryOp::Gelu { tanh: false })));
    assert_eq!(g.nodes.iter().filter(|n| n.op == Op::Embedding).count(), 3);
    assert_consistent(&g);
}

#[test]
fn mobile_block_convolutions_and_pooling() {
    for name in ["mobile_block", "mobile_block_decomposed"] {
        let g = load(name);
        let convs: Vec<_> = g
            .nodes
            .iter()
            .filter_map(|n| match &n.op {
                Op::Convolution(_) => Some(&n.op),
                _ => None,
            })
            .collect();
        assert_eq!(convs.len(), 4, "{name}");
        assert!(
            matches!(convs[1], Op::Convolution(ConvAttrs { groups: 8, padding, .. }) if padding == &[1, 1]),
            "padding='same' of a 3x3"
        );
        assert!(
            matches!(convs[2], Op::Convolution(ConvAttrs { transposed: true, stride, .. }) if stride == &[2, 2])
        );
        assert!(
            matches!(convs[3], Op::Convolution(ConvAttrs { dilation, padding, .. }) if dilation == &[2] && padding == &[2])
        );
        // the pooling indices are a graph output, so they are computed
        let pool = g
            .nodes
            .iter()
            .find(|n| matches!(n.op, Op::MaxPool(_)))
            .unwrap();
        assert!(matches!(
            pool.op,
            Op::MaxPool(MaxPoolAttrs {
                with_indices: true,
                ..
            })
        ));
        assert_eq!(g.value(g.outputs[1].0).dtype, DType::I64);
        assert!(g.nodes.iter().any(|n| matches!(
            n.op,
            Op::Unary(etmetal_core::UnaryOp::Clamp {
                min: Some(0.0),
                max: Some(6.0)
            })
        )));
        assert!(g.nodes.iter().any(|n| matches!(
            n.op,
            Op::AvgPool(AvgPoolAttrs {
                count_include_pad: false,
                ..
            })
        )));
        assert_consistent(&g);
    }
}

#[test]
fn ops_misc_follows_the_lowering_conventions() {
    use etmetal_core::UnaryOp;
    let g = load("ops_misc");
    // chunk and unbind are views: one Slice/Select per output
    assert!(matches!(
        node(&g, "chunk.0").op,
        Op::Slice {
            dim: 1,
            start: 0,
            end: 3,
            step: 1
        }
    ));
    assert!(matches!(
        node(&g, "chunk").op,
        Op::Slice {
            dim: 1,
            start: 3,
            end: 6,
            step: 1
        }
    ));
    assert_eq!(
        g.nodes
            .iter()
            .filter(|n| n.name.starts_with("unbind"))
            .count(),
        4
    );
    // add(x, x, alpha=2): the alpha multiplies the second operand
    assert_eq!(node(&g, "add_23.0").op, Op::Binary(BinaryOp::Mul));
    assert_eq!(
        const_of(&g, node(&g, "add_23.0"), 1).to_f32_vec(),
        vec![2.0]
    );
    assert_eq!(node(&g, "add_23").op, Op::Binary(BinaryOp::Add));
    // masked_fill(x, m, v) is where(m, v, x) with v of x's dtype
    let mf = node(&g, "masked_fill");
    assert_eq!(mf.op, Op::Where);
    assert_eq!(const_of(&g, mf, 1).to_f32_vec(), vec![-1.0]);
    assert_eq!(g.value(mf.inputs[0].unwrap()).dtype, DType::Bool);
    // an int scalar with an int tensor stays int64; int / int is float
    assert_eq!(const_of(&g, node(&g, "mul_2"), 1).dtype(), DType::I64);
    assert_eq!(g.value(node(&g, "div_1").outputs[0]).dtype, DType::F32);
    // an int scalar with a float tensor takes the tensor's dtype
    assert_eq!(const_of(&g, node(&g, "mul"), 1).dtype(), DType::F32);
    assert_eq!(
        node(&g, "std.0").op,
        Op::Var {
            dims: vec![0],
            correction: 1.0,
            keepdim: false
        }
    );
    assert_eq!(node(&g, "std").op, Op::Unary(UnaryOp::Sqrt));
    assert_eq!(
        node(&g, "pad").op,
        Op::ConstantPad {
            pad: vec![1, 1, 0, 2],
            value: 1.0
        }
    );
    assert_eq!(
        node(&g, "argmin").op,
        Op::ArgReduce {
            max: false,
            dim: None,
            keepdim: false
        }
    );
    assert_eq!(node(&g, "topk").outputs.len(), 2);
    assert_consistent(&g);
    let d = load("ops_misc_decomposed");
    assert_consistent(&d);
    assert_eq!(d.outputs.len(), g.outputs.len());
    for ((a, _), (b, _)) in g.outputs.iter().zip(&d.outputs) {
        assert_eq!(
            (g.value(*a).dtype, &g.value(*a).shape),
            (d.value(*b).dtype, &d.value(*b).shape)
        );
    }
}

#[test]
fn every_fixture_has_reference_inputs_and_outputs() {
    let names = [
        "mlp",
        "mlp_decomposed",
        "resblock",
        "resblock_decomposed",
        "gpt_block",
        "gpt_block_decomposed",
        "bf16_mlp",
        "transposed_weight",
        "llama_block",
        "bert_block",
        "mobile_block",
        "mobile_block_decomposed",
        "ops_misc",
        "ops_misc_decomposed",
    ];
    for name in names {
        let g = load(name);
        for (i, v) in g.user_inputs().enumerate() {
            let t = npy::read(&fixture(&format!("{name}.input_{i}.npy"))).unwrap();
            let info = g.value(v);
            assert_eq!(t.shape(), info.shape.as_slice(), "{name} input {i}");
            // bf16 is stored as float32 in .npy
            let want = if info.dtype == DType::BF16 {
                DType::F32
            } else {
                info.dtype
            };
            assert_eq!(t.dtype(), want, "{name} input {i}");
        }
        for (i, v) in g.user_outputs().enumerate() {
            let t = npy::read(&fixture(&format!("{name}.output_{i}.npy"))).unwrap();
            assert_eq!(t.shape(), g.value(v).shape.as_slice(), "{name} output {i}");
        }
    }
}

#[test]
fn archives_without_payload_configs_are_unsupported() {
    let es: Vec<_> = entries("mlp")
        .into_iter()
        .filter(|(n, _)| !n.ends_with("_config.json"))
        .collect();
    let e = err(&rezip(&es));
    assert_eq!(e.kind(), ErrorKind::Unsupported);
    assert!(
        e.to_string().contains("fc1.weight") && e.to_string().contains("payload configs"),
        "{e}"
    );
}

// ---- hand-made programs: one node or a few, user inputs only ------------

mod handmade {
    use super::*;
    use serde_json::json;

    pub const F32: i64 = 7;
    pub const I64: i64 = 5;
    pub const I32: i64 = 4;

    fn meta(dtype: i64, shape: &[usize]) -> Value {
        // contiguous strides, as torch.export writes for a fresh tensor
        let mut strides = vec![0usize; shape.len()];
        let mut s = 1;
        for (k, &n) in shape.iter().enumerate().rev() {
            strides[k] = s;
            s *= n;
        }
        json!({
            "dtype": dtype,
            "sizes": shape.iter().map(|&n| json!({"as_int": n})).collect::<Vec<_>>(),
            "requires_grad": false,
            "device": {"type": "cpu", "index": null},
            "strides": strides.iter().map(|&n| json!({"as_int": n})).collect::<Vec<_>>(),
            "storage_offset": {"as_int": 0},
            "layout": 7
        })
    }

    pub fn t(name: &str) -> Value {
        json!({"as_tensor": {"name": name}})
    }
    pub fn ts(names: &[&str]) -> Value {
        json!({"as_tensors": names.iter().map(|n| json!({"name": n})).collect::<Vec<_>>()})
    }
    pub fn int(v: i64) -> Value {
        json!({"as_int": v})
    }
    pub fn ints(v: &[i64]) -> Value {
        json!({"as_ints": v})
    }
    pub fn float(v: f64) -> Value {
        json!({"as_float": v})
    }
    pub fn boolean(v: bool) -> Value {
        json!({"as_bool": v})
    }
    pub fn string(v: &str) -> Value {
        json!({"as_string": v})
    }
    pub fn dtype(code: i64) -> Value {
        json!({"as_scalar_type": code})
    }
    pub fn device(kind: &str) -> Value {
        json!({"as_device": {"type": kind, "index": null}})
    }

    /// A node calling `torch.ops.aten.<target>` with named `args`; its
    /// outputs are `outputs` (several: a tensor list).
    pub fn node(target: &str, name: &str, args: &[(&str, Value)], outputs: &[&str]) -> Value {
        let outs = if outputs.len() == 1 {
            vec![t(outputs[0])]
        } else {
            vec![ts(outputs)]
        };
        json!({
            "target": format!("torch.ops.aten.{target}"),
            "name": name,
            "inputs": args.iter().map(|(n, a)| json!({"name": n, "arg": a, "kind": 1})).collect::<Vec<_>>(),
            "outputs": outs,
            "metadata": {},
        })
    }

    /// A `.pt2` (the mlp fixture's archive with its program replaced) whose
    /// graph takes user inputs `inputs` (name, dtype code, shape), runs
    /// `nodes` and returns `outputs`; `metas` adds tensor_values entries.
    pub fn program(
        inputs: &[(&str, i64, &[usize])],
        nodes: Vec<Value>,
        outputs: &[&str],
        metas: &[(&str, Value)],
    ) -> Vec<u8> {
        let inputs: Vec<(String, i64, Vec<usize>)> = inputs
            .iter()
            .map(|(n, d, s)| (n.to_string(), *d, s.to_vec()))
            .collect();
        let outputs: Vec<String> = outputs.iter().map(|s| s.to_string()).collect();
        let metas: Vec<(String, Value)> = metas
            .iter()
            .map(|(n, v)| (n.to_string(), v.clone()))
            .collect();
        edited_json("mlp", "models/model.json", move |v| {
            let gm = &mut v["graph_module"];
            let mut tv = serde_json::Map::new();
            for (n, d, s) in &inputs {
                tv.insert(n.clone(), meta(*d, s));
            }
            for (n, m) in &metas {
                tv.insert(n.clone(), m.clone());
            }
            gm["graph"] = json!({
                "inputs": inputs.iter().map(|(n, _, _)| t(n)).collect::<Vec<_>>(),
                "outputs": outputs.iter().map(|n| t(n)).collect::<Vec<_>>(),
                "nodes": nodes.clone(),
                "tensor_values": tv,
            });
            gm["signature"] = json!({
                "input_specs": inputs.iter().map(|(n, _, _)| json!({"user_input": {"arg": t(n)}})).collect::<Vec<_>>(),
                "output_specs": outputs.iter().map(|n| json!({"user_output": {"arg": t(n)}})).collect::<Vec<_>>(),
            });
        })
    }

    /// A `TensorMeta` with explicit strides (a view's layout).
    pub fn strided(dtype: i64, shape: &[usize], strides: &[usize]) -> Value {
        let mut m = meta(dtype, shape);
        m["strides"] = json!(strides
            .iter()
            .map(|&n| json!({"as_int": n}))
            .collect::<Vec<_>>());
        m
    }

    pub fn import(bytes: &[u8]) -> Graph {
        let g = import_pt2(bytes, "handmade.pt2").unwrap_or_else(|e| panic!("{e}"));
        assert_consistent(&g);
        g
    }
}

use handmade::{
    boolean, device, dtype, float, import, int, ints, node as hnode, program, string, t, F32, I32,
    I64,
};

fn out_shape(g: &Graph, k: usize) -> (DType, Vec<usize>) {
    let v = g.value(g.outputs[k].0);
    (v.dtype, v.shape.clone())
}

#[test]
fn device_moves_and_dtype_conversions_are_copies_or_casts() {
    // what transformers emits for masks and rotary tables: `.to(device)`,
    // `.to(dtype=…, device=…)`, `_to_copy(device=…)`, `type_as`
    let nodes = vec![
        hnode(
            "to.device",
            "a",
            &[
                ("self", t("x")),
                ("device", device("cuda")),
                ("dtype", dtype(F32)),
            ],
            &["a"],
        ),
        hnode(
            "to.dtype_layout",
            "b",
            &[
                ("self", t("a")),
                ("dtype", dtype(I64)),
                ("device", device("mps")),
            ],
            &["b"],
        ),
        hnode(
            "_to_copy.default",
            "c",
            &[("self", t("b")), ("device", device("cpu"))],
            &["c"],
        ),
        hnode(
            "type_as.default",
            "d",
            &[("self", t("c")), ("other", t("x"))],
            &["d"],
        ),
    ];
    let g = import(&program(
        &[("x", F32, &[2, 3])],
        nodes,
        &["a", "b", "c", "d"],
        &[],
    ));
    assert_eq!(ops(&g), ["identity", "cast", "identity", "cast"]);
    assert_eq!(out_shape(&g, 1), (DType::I64, vec![2, 3]));
    assert_eq!(out_shape(&g, 3), (DType::F32, vec![2, 3]));

    // a strided layout (7) is what etmetal has; a sparse one is refused
    let layout = |code: i64| {
        vec![hnode(
            "to.dtype_layout",
            "l",
            &[
                ("self", t("x")),
                ("dtype", dtype(F32)),
                ("layout", serde_json::json!({"as_layout": code})),
            ],
            &["l"],
        )]
    };
    import(&program(&[("x", F32, &[2, 3])], layout(7), &["l"], &[]));
    let e = err(&program(&[("x", F32, &[2, 3])], layout(1), &["l"], &[]));
    assert_eq!(e.kind(), ErrorKind::Unsupported);
    assert!(
        e.to_string().contains("node `l`") && e.to_string().contains("layout 1"),
        "{e}"
    );
}

#[test]
fn expand_as_swapaxes_movedim_and_alias_are_layout_ops() {
    let nodes = vec![
        hnode(
            "expand_as.default",
            "e",
            &[("self", t("x")), ("other", t("y"))],
            &["e"],
        ),
        hnode(
            "swapaxes.default",
            "s",
            &[("self", t("y")), ("axis0", int(0)), ("axis1", int(-1))],
            &["s"],
        ),
        hnode(
            "swapdims.default",
            "w",
            &[("self", t("y")), ("dim0", int(1)), ("dim1", int(2))],
            &["w"],
        ),
        hnode(
            "movedim.int",
            "m",
            &[
                ("self", t("y")),
                ("source", int(0)),
                ("destination", int(-1)),
            ],
            &["m"],
        ),
        hnode("alias.default", "al", &[("self", t("y"))], &["al"]),
        hnode("numpy_T.default", "tt", &[("self", t("y"))], &["tt"]),
    ];
    let g = import(&program(
        &[("x", F32, &[3, 1]), ("y", F32, &[2, 3, 4])],
        nodes,
        &["e", "s", "w", "m", "al", "tt"],
        &[],
    ));
    assert_eq!(out_shape(&g, 0).1, [2, 3, 4]);
    assert_eq!(
        node(&g, "s").op,
        Op::Permute {
            dims: vec![2, 1, 0]
        }
    );
    assert_eq!(
        node(&g, "w").op,
        Op::Permute {
            dims: vec![0, 2, 1]
        }
    );
    assert_eq!(
        node(&g, "m").op,
        Op::Permute {
            dims: vec![1, 2, 0]
        }
    );
    assert_eq!(out_shape(&g, 3).1, [3, 4, 2]);
    assert_eq!(node(&g, "al").op, Op::Identity);
    assert_eq!(out_shape(&g, 5).1, [4, 3, 2], "x.T reverses every dim");
}

#[test]
fn eval_mode_dropouts_are_identities_and_training_dropout_is_refused() {
    let nodes = vec![
        hnode(
            "dropout.default",
            "a",
            &[
                ("input", t("x")),
                ("p", float(0.1)),
                ("train", boolean(false)),
            ],
            &["a"],
        ),
        // in place, as torchvision's `Dropout(inplace=True)` exports
        hnode(
            "dropout_.default",
            "b",
            &[
                ("self", t("a")),
                ("p", float(0.2)),
                ("train", boolean(false)),
            ],
            &["b"],
        ),
        hnode(
            "feature_dropout.default",
            "c",
            &[
                ("input", t("b")),
                ("p", float(0.5)),
                ("train", boolean(false)),
            ],
            &["c"],
        ),
        hnode(
            "native_dropout.default",
            "d",
            &[
                ("input", t("c")),
                ("p", float(0.5)),
                ("train", boolean(false)),
            ],
            &["d", "mask"],
        ),
    ];
    let g = import(&program(&[("x", F32, &[2, 3])], nodes, &["d", "mask"], &[]));
    assert!(
        ops(&g).iter().all(|o| *o == "identity" || *o == "full"),
        "{:?}",
        ops(&g)
    );
    // the eval-mode mask keeps every element
    assert_eq!(out_shape(&g, 1), (DType::Bool, vec![2, 3]));
    assert!(g.nodes.iter().any(|n| matches!(
        n.op,
        Op::Full {
            value: etmetal_core::Scalar::Bool(true),
            ..
        }
    )));

    let train = vec![hnode(
        "dropout.default",
        "drop",
        &[
            ("input", t("x")),
            ("p", float(0.5)),
            ("train", boolean(true)),
        ],
        &["drop"],
    )];
    let e = err(&program(&[("x", F32, &[2, 3])], train, &["drop"], &[]));
    assert_eq!(e.kind(), ErrorKind::Unsupported);
    let msg = e.to_string();
    assert!(
        msg.contains("node `drop`")
            && msg.contains("training mode")
            && msg.contains("model.eval()"),
        "{msg}"
    );
}

#[test]
fn diff_roll_and_binary_min_max_lower_to_slices_cats_and_binaries() {
    let nodes = vec![
        hnode(
            "diff.default",
            "d",
            &[
                ("self", t("x")),
                ("n", int(2)),
                ("dim", int(0)),
                ("prepend", t("p")),
            ],
            &["d"],
        ),
        hnode(
            "roll.default",
            "r",
            &[
                ("self", t("x")),
                ("shifts", ints(&[-1, 7])),
                ("dims", ints(&[0, 1])),
            ],
            &["r"],
        ),
        hnode(
            "roll.default",
            "rf",
            &[("self", t("x")), ("shifts", ints(&[2]))],
            &["rf"],
        ),
        hnode(
            "min.other",
            "mn",
            &[("self", t("x")), ("other", t("p"))],
            &["mn"],
        ),
        hnode(
            "max.other",
            "mx",
            &[("self", t("x")), ("other", t("p"))],
            &["mx"],
        ),
        hnode(
            "fmax.default",
            "fm",
            &[("self", t("x")), ("other", t("p"))],
            &["fm"],
        ),
    ];
    let g = import(&program(
        &[("x", F32, &[4, 3]), ("p", F32, &[1, 3])],
        nodes,
        &["d", "r", "rf", "mn", "mx", "fm"],
        &[],
    ));
    // (1 + 4) rows, differenced twice
    assert_eq!(out_shape(&g, 0).1, [3, 3]);
    assert_eq!(
        g.nodes
            .iter()
            .filter(|n| n.name.starts_with("d.") || n.name == "d")
            .filter(|n| n.op == Op::Binary(BinaryOp::Sub))
            .count(),
        2
    );
    // -1 of 4 rows and 7 = 1 of 3 columns: two cats of two slices
    let roll: Vec<&Op> = g
        .nodes
        .iter()
        .filter(|n| n.name.starts_with("r.") || n.name == "r")
        .map(|n| &n.op)
        .collect();
    assert_eq!(
        roll.iter().filter(|o| matches!(o, Op::Cat { .. })).count(),
        2
    );
    assert!(
        roll.contains(&&Op::Slice {
            dim: 0,
            start: 1,
            end: 4,
            step: 1
        }),
        "{roll:?}"
    );
    assert!(
        roll.contains(&&Op::Slice {
            dim: 1,
            start: 2,
            end: 3,
            step: 1
        }),
        "{roll:?}"
    );
    // no dims: the flattened tensor, shape kept
    assert_eq!(node(&g, "rf").op, Op::Reshape { shape: vec![4, 3] });
    assert_eq!(node(&g, "mn").op, Op::Binary(BinaryOp::Minimum));
    assert_eq!(node(&g, "mx").op, Op::Binary(BinaryOp::Maximum));
    assert_eq!(node(&g, "fm").op, Op::Where);
    assert_eq!(out_shape(&g, 5).1, [4, 3]);
}

#[test]
fn einsum_becomes_permutes_and_batched_matmuls() {
    // (equation, operand shapes, output shape)
    type Case<'a> = (&'a str, &'a [&'a [usize]], &'a [usize]);
    let cases: &[Case] = &[
        (
            "bhqd,bhkd->bhqk",
            &[&[2, 3, 4, 5], &[2, 3, 6, 5]],
            &[2, 3, 4, 6],
        ),
        ("ij,jk", &[&[2, 3], &[3, 4]], &[2, 4]),
        (
            "...ij,...jk->...ik",
            &[&[2, 1, 3, 4], &[5, 4, 6]],
            &[2, 5, 3, 6],
        ),
        ("ii->i", &[&[3, 3]], &[3]),
        ("bij->", &[&[2, 3, 4]], &[]),
        ("i,j->ij", &[&[3], &[4]], &[3, 4]),
        ("nchw,kc->nkhw", &[&[1, 3, 2, 2], &[5, 3]], &[1, 5, 2, 2]),
    ];
    for (eq, shapes, want) in cases {
        let names: Vec<String> = (0..shapes.len()).map(|i| format!("x{i}")).collect();
        let inputs: Vec<(&str, i64, &[usize])> = names
            .iter()
            .zip(shapes.iter())
            .map(|(n, s)| (n.as_str(), F32, *s))
            .collect();
        let refs: Vec<&str> = names.iter().map(String::as_str).collect();
        let nodes = vec![hnode(
            "einsum.default",
            "e",
            &[("equation", string(eq)), ("tensors", handmade::ts(&refs))],
            &["e"],
        )];
        let g = import(&program(&inputs, nodes, &["e"], &[]));
        assert_eq!(out_shape(&g, 0).1, *want, "{eq}");
        if shapes.len() > 1 {
            assert!(ops(&g).contains(&"mat_mul"), "{eq}: {:?}", ops(&g));
        }
    }
    let bad = vec![hnode(
        "einsum.default",
        "e",
        &[
            ("equation", string("ij,jk->il")),
            ("tensors", handmade::ts(&["x", "x"])),
        ],
        &["e"],
    )];
    let e = err(&program(&[("x", F32, &[2, 2])], bad, &["e"], &[]));
    assert!(
        e.to_string().contains("output label `l` is in no operand"),
        "{e}"
    );
}

#[test]
fn vector_norms_and_weight_norm_are_reductions() {
    let inf = json_float("Infinity");
    let nodes = vec![
        hnode(
            "linalg_vector_norm.default",
            "n2",
            &[
                ("self", t("x")),
                ("dim", ints(&[-1])),
                ("keepdim", boolean(true)),
            ],
            &["n2"],
        ),
        hnode(
            "linalg_vector_norm.default",
            "ninf",
            &[("self", t("x")), ("ord", inf)],
            &["ninf"],
        ),
        hnode(
            "linalg_vector_norm.default",
            "n3",
            &[("self", t("x")), ("ord", float(3.0)), ("dim", ints(&[0]))],
            &["n3"],
        ),
        hnode(
            "_weight_norm.default",
            "w",
            &[("v", t("x")), ("g", t("g")), ("dim", int(0))],
            &["w"],
        ),
    ];
    let g = import(&program(
        &[("x", F32, &[4, 3]), ("g", F32, &[4, 1])],
        nodes,
        &["n2", "ninf", "n3", "w"],
        &[],
    ));
    assert_eq!(out_shape(&g, 0).1, [4, 1]);
    assert_eq!(node(&g, "n2").op, Op::Unary(etmetal_core::UnaryOp::Sqrt));
    assert_eq!(out_shape(&g, 1).1, Vec::<usize>::new());
    assert!(matches!(
        node(&g, "ninf").op,
        Op::Reduce {
            op: etmetal_core::ReduceOp::Max,
            ..
        }
    ));
    assert_eq!(out_shape(&g, 2).1, [3]);
    assert_eq!(
        node(&g, "n3").op,
        Op::Unary(etmetal_core::UnaryOp::PowScalar {
            exponent: 1.0 / 3.0
        })
    );
    assert_eq!(out_shape(&g, 3).1, [4, 3]);
    // the norm over every dim but 0
    assert!(g
        .nodes
        .iter()
        .any(|n| matches!(&n.op, Op::Reduce { dims, keepdim: true, .. } if dims == &[1])));
}

fn json_float(s: &str) -> Value {
    serde_json::json!({"as_float": s})
}

#[test]
fn fills_write_their_tensor_in_place() {
    // zero_ and fill_ on a user input: later readers see the new value and
    // the input becomes a mutation output
    let nodes = vec![
        hnode("zero_.default", "z", &[("self", t("x"))], &["z"]),
        hnode(
            "add.Tensor",
            "a",
            &[("self", t("x")), ("other", t("y"))],
            &["a"],
        ),
        hnode(
            "fill_.Scalar",
            "f",
            &[("self", t("y")), ("value", float(2.5))],
            &["f"],
        ),
        hnode(
            "fill_.Tensor",
            "ft",
            &[("self", t("x")), ("value", t("s"))],
            &["ft"],
        ),
        hnode(
            "mul.Tensor",
            "m",
            &[("self", t("a")), ("other", t("y"))],
            &["m"],
        ),
    ];
    let g = import(&program(
        &[("x", F32, &[2, 3]), ("y", F32, &[2, 3]), ("s", F32, &[])],
        nodes,
        &["m"],
        &[],
    ));
    let add = node(&g, "a");
    let zero = node(&g, "z");
    assert_eq!(
        add.inputs[0],
        Some(zero.outputs[0]),
        "add reads the zeroed x"
    );
    assert!(matches!(
        zero.op,
        Op::Full {
            value: etmetal_core::Scalar::Int(0),
            ..
        }
    ));
    assert!(
        matches!(node(&g, "f").op, Op::Full { value: etmetal_core::Scalar::Float(v), .. } if v == 2.5)
    );
    assert_eq!(node(&g, "m").inputs[1], Some(node(&g, "f").outputs[0]));
    let mutated: Vec<_> = g
        .outputs
        .iter()
        .filter_map(|(_, k)| match k {
            OutputKind::UserInputMutation { input_name } => Some(input_name.as_str()),
            _ => None,
        })
        .collect();
    assert_eq!(mutated, ["x", "y"]);
}

#[test]
fn as_strided_gathers_the_flattened_tensor() {
    let nodes = vec![hnode(
        "as_strided.default",
        "v",
        &[
            ("self", t("x")),
            ("size", ints(&[3, 2])),
            ("stride", ints(&[4, 1])),
            ("storage_offset", int(1)),
        ],
        &["v"],
    )];
    let g = import(&program(&[("x", F32, &[4, 4])], nodes, &["v"], &[]));
    assert_eq!(ops(&g), ["reshape", "index_select", "reshape"]);
    let table = const_of(&g, node(&g, "v.1"), 1);
    assert_eq!(table.to_i64_vec(), [1, 2, 5, 6, 9, 10]);
    assert_eq!(out_shape(&g, 0).1, [3, 2]);
    // overlapping windows read fine
    let nodes = vec![hnode(
        "as_strided.default",
        "v",
        &[
            ("self", t("x")),
            ("size", ints(&[3, 4])),
            ("stride", ints(&[2, 1])),
        ],
        &["v"],
    )];
    let g = import(&program(&[("x", F32, &[8])], nodes, &["v"], &[]));
    assert_eq!(
        const_of(&g, node(&g, "v.1"), 1).to_i64_vec(),
        [0, 1, 2, 3, 2, 3, 4, 5, 4, 5, 6, 7]
    );

    // reading past the tensor, or a tensor whose layout is a view's
    let past = vec![hnode(
        "as_strided.default",
        "v",
        &[
            ("self", t("x")),
            ("size", ints(&[3])),
            ("stride", ints(&[4])),
        ],
        &["v"],
    )];
    let e = err(&program(&[("x", F32, &[8])], past, &["v"], &[]));
    assert_eq!(e.kind(), ErrorKind::Shape);
    assert!(
        e.to_string().contains("reads element 8 of a tensor of 8"),
        "{e}"
    );
    let view = vec![
        hnode(
            "permute.default",
            "p",
            &[("self", t("x")), ("dims", ints(&[1, 0]))],
            &["p"],
        ),
        hnode(
            "as_strided.default",
            "v",
            &[
                ("self", t("p")),
                ("size", ints(&[2])),
                ("stride", ints(&[1])),
            ],
            &["v"],
        ),
    ];
    let e = err(&program(
        &[("x", F32, &[2, 3])],
        view,
        &["v"],
        &[("p", handmade::strided(F32, &[3, 2], &[1, 3]))],
    ));
    assert_eq!(e.kind(), ErrorKind::Unsupported);
    assert!(
        e.to_string().contains("node `v`") && e.to_string().contains(".contiguous()"),
        "{e}"
    );
}

#[test]
fn writes_through_as_strided_views_reach_their_base_unless_strides_overlap() {
    // y = x.as_strided((2, 2), (4, 1), 1); y.zero_(); return x * 1
    let write = |stride: &[i64]| {
        vec![
            hnode(
                "as_strided.default",
                "v",
                &[
                    ("self", t("x")),
                    ("size", ints(&[2, 2])),
                    ("stride", ints(stride)),
                    ("storage_offset", int(1)),
                ],
                &["v"],
            ),
            hnode("zero_.default", "z", &[("self", t("v"))], &["z"]),
            hnode(
                "mul.Tensor",
                "m",
                &[("self", t("x")), ("other", float(1.0))],
                &["m"],
            ),
        ]
    };
    let g = import(&program(
        &[("x", F32, &[3, 4])],
        write(&[4, 1]),
        &["m"],
        &[],
    ));
    // the mul reads the scattered base, which is also the input's new value
    let m = node(&g, "m");
    let scattered = m.inputs[0].unwrap();
    assert_ne!(scattered, g.inputs[0].0);
    assert_eq!(g.value(scattered).shape, [3, 4]);
    let hit = g
        .nodes
        .iter()
        .find(|n| n.op == Op::Where && n.name.starts_with("z"))
        .map(|n| const_of(&g, n, 0).to_i64_vec())
        .expect("a where placing the view's elements");
    let want: Vec<i64> = (0..12).map(|i| [1, 2, 5, 6].contains(&i) as i64).collect();
    assert_eq!(hit, want);
    assert!(g
        .outputs
        .iter()
        .any(|(v, k)| *v == scattered && matches!(k, OutputKind::UserInputMutation { .. })));

    // (2, 2) with strides (1, 1) reads element 2 twice: a write there is ambiguous
    let e = err(&program(
        &[("x", F32, &[3, 4])],
        write(&[1, 1]),
        &["m"],
        &[],
    ));
    assert_eq!(e.kind(), ErrorKind::Unsupported);
    assert!(e.to_string().contains("whose strides overlap"), "{e}");
}

#[test]
fn upsampling_gathers_source_rows_by_tables_made_at_import() {
    let floats = |v: &[f64]| serde_json::json!({ "as_floats": v });
    let nodes = vec![
        hnode(
            "upsample_nearest2d.vec",
            "n",
            &[("input", t("x")), ("scale_factors", floats(&[2.0, 2.0]))],
            &["n"],
        ),
        hnode(
            "upsample_bilinear2d.vec",
            "b",
            &[
                ("input", t("x")),
                ("output_size", ints(&[3, 5])),
                ("align_corners", boolean(true)),
            ],
            &["b"],
        ),
    ];
    let g = import(&program(
        &[("x", F32, &[1, 1, 2, 3])],
        nodes,
        &["n", "b"],
        &[],
    ));
    assert_eq!(out_shape(&g, 0).1, [1, 1, 4, 6]);
    assert_eq!(out_shape(&g, 1).1, [1, 1, 3, 5]);
    let rows = const_of(&g, node(&g, "n.0"), 1).to_i64_vec();
    assert_eq!(rows, [0, 0, 1, 1]);
    // align_corners: output rows 0 and 2 of 3 are input rows 0 and 1, row 1
    // sits halfway (weights of the lower and the upper neighbour)
    let weights: Vec<Vec<f32>> = g
        .nodes
        .iter()
        .filter(|n| n.name.starts_with("b.") && n.op == Op::Binary(BinaryOp::Mul))
        .map(|n| const_of(&g, n, 1).to_f32_vec())
        .collect();
    assert_eq!(weights[..2], [vec![1.0, 0.5, 1.0], vec![0.0, 0.5, 0.0]]);
}

#[test]
fn sort_and_argsort_are_a_top_k_of_every_element() {
    let nodes = vec![
        hnode(
            "sort.default",
            "s",
            &[
                ("self", t("x")),
                ("dim", int(0)),
                ("descending", boolean(true)),
            ],
            &["v", "i"],
        ),
        hnode("argsort.default", "a", &[("self", t("x"))], &["a"]),
    ];
    let g = import(&program(
        &[("x", F32, &[4, 3])],
        nodes,
        &["v", "i", "a"],
        &[],
    ));
    assert_eq!(
        node(&g, "s").op,
        Op::TopK {
            k: 4,
            dim: 0,
            largest: true,
            sorted: true
        }
    );
    assert_eq!(
        node(&g, "a").op,
        Op::TopK {
            k: 3,
            dim: 1,
            largest: false,
            sorted: true
        }
    );
    assert_eq!(out_shape(&g, 1), (DType::I64, vec![4, 3]));
    assert_eq!(out_shape(&g, 2), (DType::I64, vec![4, 3]));
}

#[test]
fn constants_made_by_one_node_have_distinct_names() {
    // a fill through a slice of a slice (Swin's attention-mask build) makes
    // two scatters, each with its tables; weights are keyed by name
    let nodes = vec![
        hnode(
            "slice.Tensor",
            "s1",
            &[
                ("self", t("x")),
                ("dim", int(0)),
                ("start", int(1)),
                ("end", int(3)),
            ],
            &["s1"],
        ),
        hnode(
            "slice.Tensor",
            "s2",
            &[
                ("self", t("s1")),
                ("dim", int(1)),
                ("start", int(0)),
                ("end", int(2)),
            ],
            &["s2"],
        ),
        hnode(
            "fill_.Scalar",
            "f",
            &[("self", t("s2")), ("value", float(1.0))],
            &["f"],
        ),
        hnode(
            "mul.Tensor",
            "m",
            &[("self", t("x")), ("other", float(2.0))],
            &["m"],
        ),
    ];
    let g = import(&program(&[("x", F32, &[4, 4])], nodes, &["m"], &[]));
    let names: Vec<&str> = g
        .constants
        .keys()
        .map(|&v| g.value(v).name.as_str())
        .collect();
    let unique: std::collections::HashSet<&&str> = names.iter().collect();
    assert!(names.len() >= 4, "{names:?}");
    assert_eq!(unique.len(), names.len(), "{names:?}");
}

#[test]
fn unfold_gathers_windows_and_moves_the_window_dim_last() {
    let nodes = vec![hnode(
        "unfold.default",
        "u",
        &[
            ("self", t("x")),
            ("dimension", int(1)),
            ("size", int(3)),
            ("step", int(2)),
        ],
        &["u"],
    )];
    let g = import(&program(&[("x", F32, &[2, 7, 4])], nodes, &["u"], &[]));
    // windows at 0, 2, 4 of 7
    assert_eq!(out_shape(&g, 0).1, [2, 3, 4, 3]);
    let table = const_of(&g, node(&g, "u.0"), 1).to_i64_vec();
    assert_eq!(table, [0, 1, 2, 2, 3, 4, 4, 5, 6]);
    assert_eq!(
        node(&g, "u").op,
        Op::Permute {
            dims: vec![0, 1, 3, 2]
        }
    );
}

#[test]
fn scatter_and_one_hot_compare_positions_with_the_index() {
    let nodes = vec![
        hnode(
            "scatter.value",
            "s",
            &[
                ("self", t("x")),
                ("dim", int(1)),
                ("index", t("i")),
                ("value", float(1.5)),
            ],
            &["s"],
        ),
        hnode(
            "scatter_add.default",
            "a",
            &[
                ("self", t("x")),
                ("dim", int(1)),
                ("index", t("i")),
                ("src", t("x")),
            ],
            &["a"],
        ),
        hnode(
            "one_hot.default",
            "h",
            &[("self", t("i")), ("num_classes", int(6))],
            &["h"],
        ),
    ];
    let g = import(&program(
        &[("x", F32, &[2, 5]), ("i", I64, &[2, 3])],
        nodes,
        &["s", "a", "h"],
        &[],
    ));
    assert_eq!(out_shape(&g, 0), (DType::F32, vec![2, 5]));
    assert_eq!(node(&g, "s").op, Op::Where);
    assert_eq!(node(&g, "a").op, Op::Binary(BinaryOp::Add));
    assert_eq!(out_shape(&g, 2), (DType::I64, vec![2, 3, 6]));
    // an index narrower than self in another dim is refused, naming both shapes
    let bad = vec![hnode(
        "scatter.value",
        "s",
        &[
            ("self", t("x")),
            ("dim", int(1)),
            ("index", t("i")),
            ("value", float(1.5)),
        ],
        &["s"],
    )];
    let e = err(&program(
        &[("x", F32, &[2, 5]), ("i", I64, &[1, 3])],
        bad,
        &["s"],
        &[],
    ));
    assert_eq!(e.kind(), ErrorKind::Unsupported);
    assert!(e.to_string().contains("[1, 3] into [2, 5]"), "{e}");
}

#[test]
fn index_add_and_accumulating_index_put_sum_rows_by_a_matmul() {
    let nodes = vec![
        hnode(
            "index_add.default",
            "a",
            &[
                ("self", t("x")),
                ("dim", int(1)),
                ("index", t("i")),
                ("source", t("s")),
                ("alpha", float(2.0)),
            ],
            &["a"],
        ),
        hnode(
            "index_put.default",
            "p",
            &[
                ("self", t("x")),
                ("indices", handmade::ts(&["i"])),
                ("values", t("v")),
                ("accumulate", boolean(true)),
            ],
            &["p"],
        ),
    ];
    let g = import(&program(
        &[
            ("x", F32, &[4, 5]),
            ("i", I64, &[3]),
            ("s", F32, &[4, 3]),
            ("v", F32, &[5]),
        ],
        nodes,
        &["a", "p"],
        &[],
    ));
    assert_eq!(out_shape(&g, 0).1, [4, 5]);
    assert_eq!(node(&g, "a").op, Op::Binary(BinaryOp::Add));
    assert_eq!(node(&g, "p").op, Op::Binary(BinaryOp::Add));
    assert_eq!(ops(&g).iter().filter(|o| **o == "mat_mul").count(), 2);
}

/// The inputs of `g` other than parameters, as `(fqn or name, kind)`.
fn state_inputs(g: &Graph) -> Vec<(String, &'static str)> {
    g.inputs
        .iter()
        .filter_map(|(v, k)| match k {
            InputKind::Buffer { fqn, .. } => Some((fqn.clone(), "buffer")),
            InputKind::Constant { fqn } => Some((fqn.clone(), "constant")),
            InputKind::User => Some((g.value(*v).name.clone(), "user")),
            InputKind::Parameter { .. } => None,
        })
        .collect()
}

#[test]
fn lifted_constants_written_in_place_are_state() {
    // scripts/make_fixtures.py's LiftedState, exported non-strict: the
    // tensor the module also registers as buffer `state` is lifted as
    // `lifted_tensor_1` (one storage in the archive), written through a
    // `to` that returns it; `lifted_tensor_0` is registered nowhere
    let g = load("lifted_state");
    assert_consistent(&g);
    assert_eq!(
        state_inputs(&g),
        [
            ("state".to_string(), "buffer"),
            ("lifted_tensor_0".to_string(), "buffer"),
            ("x".to_string(), "user"),
        ]
    );
    let kinds: Vec<&OutputKind> = g.outputs.iter().map(|(_, k)| k).collect();
    assert_eq!(
        kinds,
        [
            &OutputKind::BufferMutation {
                fqn: "state".into()
            },
            &OutputKind::BufferMutation {
                fqn: "lifted_tensor_0".into()
            },
            &OutputKind::User
        ]
    );
    // tensor_split by indices and by sections are slices; eye compares
    // row and column indices
    assert!(!ops(&g).contains(&"tensor_split"));
    assert!(ops(&g).iter().filter(|o| **o == "slice").count() >= 4);
}

#[test]
fn a_written_constant_that_overlaps_another_input_is_refused() {
    // `lifted_tensor_0` made a view of the first half of `state`'s storage:
    // a write to either would show in the other in eager
    let mut es = entries("lifted_state");
    let state_file = {
        let (_, data) = es
            .iter()
            .find(|(n, _)| n.ends_with("constants_config.json"))
            .unwrap();
        let v: Value = serde_json::from_slice(data).unwrap();
        v["config"]["state"]["path_name"].clone()
    };
    let (_, data) = es
        .iter_mut()
        .find(|(n, _)| n.ends_with("constants_config.json"))
        .unwrap();
    let mut v: Value = serde_json::from_slice(data).unwrap();
    let seen = &mut v["config"]["lifted_tensor_0"];
    seen["path_name"] = state_file;
    seen["tensor_meta"]["strides"] = serde_json::json!([{"as_int": 4}, {"as_int": 1}]);
    *data = serde_json::to_vec(&v).unwrap();
    let e = err(&rezip(&es));
    let msg = e.to_string();
    assert!(
        msg.contains("writes graph input") && msg.contains("overlaps") && msg.contains("b_state"),
        "{msg}"
    );
}

#[test]
fn a_written_parameter_is_refused_naming_it() {
    let bytes = edited_json("lifted_state", "models/model.json", |v| {
        // the graph's `copy_` into the unregistered constant copies fc.bias
        // into itself instead
        let graph = &mut v["graph_module"]["graph"];
        let bias = graph["tensor_values"]["p_fc_bias"].clone();
        graph["tensor_values"]["copy__1"] = bias;
        let nodes = graph["nodes"].as_array_mut().unwrap();
        let copy = nodes.iter_mut().find(|n| n["name"] == "copy__1").unwrap();
        for arg in copy["inputs"].as_array_mut().unwrap() {
            arg["arg"]["as_tensor"]["name"] = Value::from("p_fc_bias");
        }
    });
    let msg = err(&bytes).to_string();
    assert!(msg.contains("writes parameter `fc.bias`"), "{msg}");
}

/// The group ends `offs` of a grouped matmul as its int32 input.
fn group_ends(offs: &[i32]) -> Tensor {
    let ends: Vec<i64> = offs.iter().map(|&o| o.into()).collect();
    Tensor::from_i64(DType::I32, &[offs.len()], &ends).unwrap()
}

/// `aten._grouped_mm` of `x` `[S, K]` by `w` `[E, K, N]` with group ends
/// `offs`, as PyTorch defines it: row `s` times the weights of the group
/// holding it, a row past every group zero.
fn grouped_mm_reference(x: &[f32], w: &[f32], offs: &[i32], [s, k, n]: [usize; 3]) -> Vec<f32> {
    let mut out = vec![0.0; s * n];
    let mut start = 0;
    for (e, &end) in offs.iter().enumerate() {
        for r in start..end as usize {
            for c in 0..n {
                out[r * n + c] = (0..k).map(|i| x[r * k + i] * w[(e * k + i) * n + c]).sum();
            }
        }
        start = end as usize;
    }
    out
}

/// The grouped matmul of MoE layers: fewer rows than experts (a decode
/// step) gathers the routed experts' weights, more rows compute every
/// expert's product; both match PyTorch's definition on uneven groups,
/// empty ones among them, with the last rows past every group (zero).
#[test]
fn grouped_mm_gathers_the_routed_experts_of_few_rows() {
    let (k, n) = (3, 4);
    let cases: &[(usize, &[i32])] = &[
        // 4 rows, 5 experts: experts 0, 2 and 4 empty, row 3 past all
        (4, &[0, 1, 1, 3, 3]),
        // the last expert's rows, then one past it
        (4, &[0, 1, 1, 2, 3]),
        // every row routed, the first expert takes all
        (2, &[2, 2, 2]),
        // one row past every group: all zero
        (1, &[0, 0]),
        // 7 rows, 3 experts (dense): row 6 past all, expert 1 empty
        (7, &[2, 2, 6]),
    ];
    for (case, &(s, offs)) in cases.iter().enumerate() {
        let e = offs.len();
        let nodes = vec![hnode(
            "_grouped_mm.default",
            "g",
            &[("self", t("x")), ("mat2", t("w")), ("offs", t("offs"))],
            &["g"],
        )];
        let g = import(&program(
            &[
                ("x", F32, &[s, k]),
                ("w", F32, &[e, k, n]),
                ("offs", I32, &[e]),
            ],
            nodes,
            &["g"],
            &[],
        ));
        let ops = ops(&g);
        let sparse = s < e;
        assert_eq!(ops.contains(&"index_select"), sparse, "{case}: {ops:?}");
        let x: Vec<f32> = (0..s * k).map(|i| (i as f32 * 0.37).sin() + 1.5).collect();
        let w: Vec<f32> = (0..e * k * n)
            .map(|i| (i as f32 * 0.61).cos() + 1.0)
            .collect();
        let want = grouped_mm_reference(&x, &w, offs, [s, k, n]);
        let inputs = vec![
            Tensor::from_f32(DType::F32, &[s, k], &x).unwrap(),
            Tensor::from_f32(DType::F32, &[e, k, n], &w).unwrap(),
            group_ends(offs),
        ];
        let got = run_graph(&g, inputs).unwrap();
        assert_eq!(got[0].shape(), [s, n], "{case}");
        close(&got[0].to_f32_vec(), &want, 1e-5);
    }
}

/// `--quantize int4` of the grouped matmul's stacked expert weights (a
/// parameter `[E, K, N]`, or `[E, N, K]` read through a transpose, as
/// transformers stores them): the sparse form (fewer rows than experts)
/// and the dense one both become `gather_qmv` of the int4 `W [E, N, K]`,
/// no float copy of the weights left, and match PyTorch's definition of
/// the grouped matmul with the dequantized weights, rows past every group
/// zero.
#[test]
fn grouped_mm_experts_quantize_to_gather_qmv() {
    use etmetal_graph::quantize::{dequantize_weight, QuantWeight, QuantizeOptions, Quantizer};
    let (k, n) = (64, 8);
    let cases: &[(usize, &[i32])] = &[(4, &[0, 1, 1, 3, 3]), (7, &[2, 2, 6]), (3, &[1, 3, 3])];
    for (case, &(s, offs)) in cases.iter().enumerate() {
        let e = offs.len();
        for stored_nk in [false, true] {
            let what = format!("case {case} stored [E, N, K] {stored_nk}");
            let mut nodes = vec![];
            let mut mat2 = "w";
            if stored_nk {
                nodes.push(hnode(
                    "permute.default",
                    "wt",
                    &[("self", t("w")), ("dims", ints(&[0, 2, 1]))],
                    &["wt"],
                ));
                mat2 = "wt";
            }
            nodes.push(hnode(
                "_grouped_mm.default",
                "g",
                &[("self", t("x")), ("mat2", t(mat2)), ("offs", t("offs"))],
                &["g"],
            ));
            let w_shape = if stored_nk { [e, n, k] } else { [e, k, n] };
            let mut g = import(&program(
                &[
                    ("x", F32, &[s, k]),
                    ("w", F32, &w_shape),
                    ("offs", I32, &[e]),
                ],
                nodes,
                &["g"],
                &[],
            ));
            // the weights a parameter, as an export's are
            let w: Vec<f32> = (0..e * k * n).map(|i| (i as f32 * 0.61).cos()).collect();
            let (id, kind) = g
                .inputs
                .iter_mut()
                .find(|(v, _)| g.values[v.0].name == "w")
                .unwrap();
            *kind = InputKind::Parameter {
                fqn: "experts.w".into(),
            };
            let id = *id;
            g.constants
                .insert(id, Tensor::from_f32(DType::F32, &w_shape, &w).unwrap());
            let mut q = Quantizer::new(QuantizeOptions::int4(32, &[]), None);
            q.plan(&[&g], None).unwrap();
            let r = q.quantize(&mut g).unwrap();
            assert_eq!(
                r.expert_weights(),
                (1, 0),
                "{what}: {:?}",
                r.experts_skipped
            );
            let ops = ops(&g);
            assert!(ops.contains(&"gather_qmv"), "{what}: {ops:?}");
            assert!(
                !ops.contains(&"mat_mul") && !ops.contains(&"index_select"),
                "{what}: {ops:?}"
            );
            assert!(
                g.inputs.iter().all(|(_, k)| *k == InputKind::User),
                "{what}"
            );
            // the dequantized weights, as B [E, K, N]
            let gather = g
                .nodes
                .iter()
                .find(|n| n.op.name() == "gather_qmv")
                .unwrap();
            let c = |slot: usize| &g.constants[&gather.inputs[slot].unwrap()];
            let deq = dequantize_weight(
                &QuantWeight {
                    format: etmetal_core::quant::QuantFormat::int4(32),
                    packed: c(1).bytes().to_vec(),
                    scales: c(2).to_f32_vec(),
                    zeros: c(3).to_f32_vec(),
                },
                k,
            );
            let b: Vec<f32> = (0..e * k * n)
                .map(|i| deq[(i / (k * n) * n + i % n) * k + i / n % k])
                .collect();
            let x: Vec<f32> = (0..s * k).map(|i| (i as f32 * 0.37).sin() + 0.5).collect();
            let want = grouped_mm_reference(&x, &b, offs, [s, k, n]);
            let inputs = vec![
                Tensor::from_f32(DType::F32, &[s, k], &x).unwrap(),
                group_ends(offs),
            ];
            let got = run_graph(&g, inputs).unwrap();
            assert_eq!(got[0].shape(), [s, n], "{what}");
            close(&got[0].to_f32_vec(), &want, 1e-4);
        }
    }
}
