//! The grouped matmul of mixture-of-experts layers (`aten._grouped_mm`)
//! on the GPU against the CPU kernels, as the importer lowers it: with
//! fewer rows than experts (a decode step's routed rows) each row's
//! expert's weights are gathered, and the product reads them in place
//! (no dispatch copies the routed experts' weights first) and zeroes the
//! rows past every group in its store. A product of gathered matrices in
//! every kernel form reads them in place too.

mod common;

use std::io::{Cursor, Read, Write};

use common::gpu::{
    assert_close, check_graph, check_graph_emulating, compile_emulating_report,
    compile_whole_within, emulations, random, random_indices, run_pte,
};
use etmetal_core::{DType, Op, Tensor};
use etmetal_graph::{Graph, InputKind, Node, OutputKind, ValueId};
use etmetal_metal::partitioner::DeviceLimits;
use etmetal_metal::preprocess::CoopForm;
use serde_json::{json, Value};

/// The mlp fixture's archive with its program replaced by
/// `g = _grouped_mm(x, w, offs)` (`w` read through a transpose of its
/// last two dims where `transposed`, as transformers passes experts
/// stored `[E, n, k]`), every operand a user input: its graph.
fn grouped_mm(x: &Tensor, w: &Tensor, transposed: bool, e: usize) -> Graph {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../tests/fixtures/mlp.pt2");
    let config = zip::read::Config {
        archive_offset: zip::read::ArchiveOffset::Known(0),
    };
    let bytes = std::fs::read(path).unwrap();
    let mut z = zip::ZipArchive::with_config(config, Cursor::new(bytes)).unwrap();
    let mut entries: Vec<(String, Vec<u8>)> = (0..z.len())
        .map(|i| {
            let mut f = z.by_index(i).unwrap();
            let mut data = vec![];
            f.read_to_end(&mut data).unwrap();
            (f.name().unwrap().to_string(), data)
        })
        .collect();
    let code = |d: DType| (1..=13).find(|&c| DType::from_torch_serde(c).ok() == Some(d));
    let meta = |dtype: DType, shape: &[usize]| {
        let mut strides = vec![1usize; shape.len()];
        for i in (0..shape.len().saturating_sub(1)).rev() {
            strides[i] = strides[i + 1] * shape[i + 1];
        }
        let ints = |v: &[usize]| v.iter().map(|&n| json!({"as_int": n})).collect::<Vec<_>>();
        json!({
            "dtype": code(dtype), "sizes": ints(shape), "requires_grad": false,
            "device": {"type": "cpu", "index": null}, "strides": ints(&strides),
            "storage_offset": {"as_int": 0}, "layout": 7
        })
    };
    let t = |name: &str| json!({"as_tensor": {"name": name}});
    let arg = |name: &str, a: Value| json!({"name": name, "arg": a, "kind": 1});
    let node = |target: &str, args: Vec<Value>, out: &str| {
        json!({
            "target": format!("torch.ops.aten.{target}"), "name": out, "inputs": args,
            "outputs": [t(out)], "metadata": {},
        })
    };
    let mut nodes = vec![];
    let mut mat2 = "w";
    if transposed {
        let dims = json!({"as_ints": [0, 2, 1]});
        nodes.push(node(
            "permute.default",
            vec![arg("self", t("w")), arg("dims", dims)],
            "wt",
        ));
        mat2 = "wt";
    }
    let args = vec![
        arg("self", t("x")),
        arg("mat2", t(mat2)),
        arg("offs", t("offs")),
    ];
    nodes.push(node("_grouped_mm.default", args, "g"));
    let inputs = ["x", "w", "offs"];
    let values = json!({
        "x": meta(x.dtype(), x.shape()),
        "w": meta(w.dtype(), w.shape()),
        "offs": meta(DType::I32, &[e]),
    });
    let (_, model) = entries
        .iter_mut()
        .find(|(n, _)| n.ends_with("models/model.json"))
        .unwrap();
    let mut v: Value = serde_json::from_slice(model).unwrap();
    let gm = &mut v["graph_module"];
    gm["graph"] = json!({
        "inputs": inputs.map(t), "outputs": [t("g")], "nodes": nodes, "tensor_values": values,
    });
    gm["signature"] = json!({
        "input_specs": inputs.map(|n| json!({"user_input": {"arg": t(n)}})),
        "output_specs": [{"user_output": {"arg": t("g")}}],
    });
    *model = serde_json::to_vec(&v).unwrap();
    let mut out = zip::ZipWriter::new(Cursor::new(Vec::new()));
    let stored =
        zip::write::SimpleFileOptions::default().compression_method(zip::CompressionMethod::Stored);
    for (name, data) in &entries {
        out.start_file(name.as_str(), stored).unwrap();
        out.write_all(data).unwrap();
    }
    let bytes = out.finish().unwrap().into_inner();
    etmetal_graph::import_pt2(&bytes, "grouped_mm.pt2").unwrap_or_else(|e| panic!("{e}"))
}

/// A decode step's routed rows (fewer than the experts; uneven groups,
/// empty ones, rows past every group) in f32 and bf16, the experts `[E, k,
/// n]` (a tiled product) or read through a transpose of `[E, n, k]` (a
/// matrix-vector product): two dispatches, the expert index's sum and the
/// product storing the masked rows, and the GPU matches the CPU kernels.
#[test]
fn routed_rows_read_their_experts_weights_in_place() {
    // (rows, k, n, group ends)
    let cases: &[(usize, usize, usize, &[i32])] = &[
        // top-2 of 8 experts: experts 2 and 5
        (2, 64, 96, &[0, 0, 1, 1, 1, 2, 2, 2]),
        // experts 1 and 3 (2 rows), row 3 past every group
        (4, 37, 50, &[0, 1, 1, 3, 3]),
        // the last expert, then a row past it
        (4, 40, 9, &[0, 1, 1, 2, 3]),
    ];
    for (i, &(s, k, n, offs)) in cases.iter().enumerate() {
        let e = offs.len();
        for dtype in [DType::F32, DType::BF16] {
            for transposed in [false, true] {
                let what = format!("case {i} {dtype:?} transposed {transposed}");
                let seed = 10 * i as u64;
                let x = random(dtype, &[s, k], seed);
                let w_shape = if transposed { [e, n, k] } else { [e, k, n] };
                let w = random(dtype, &w_shape, seed + 1);
                let graph = grouped_mm(&x, &w, transposed, e);
                assert!(
                    graph.nodes.iter().any(|n| n.op.name() == "index_select"),
                    "{what}: not gathered"
                );
                let compiled = compile_whole_within(&graph, &DeviceLimits::default());
                let method = &compiled.methods[0];
                assert!(
                    method.cpu_nodes.is_empty(),
                    "{what}: {:?}",
                    method.cpu_nodes
                );
                let payload = &method.partitions[0].payload;
                // the expert index, the product (its mask in the store), the
                // partition output's copy (its reshape to [S, n]); no copy of
                // the routed experts' weights: the product binds `w` itself
                let nodes: Vec<&[String]> =
                    payload.dispatches.iter().map(|d| &d.nodes[..]).collect();
                assert_eq!(nodes, [["reduce_sum"], ["mat_mul"], ["output"]], "{what}");
                let product = &payload.dispatches[1];
                let reads = |name: &str| {
                    let at = payload.buffers.iter().position(|b| b.name == name);
                    at.is_some_and(|b| product.buffers.contains(&b))
                };
                assert!(reads("w") && reads("offs"), "{what}");
                let gemv = payload.kernels[product.kernel]
                    .wgsl
                    .contains("var<workgroup> red");
                assert_eq!(gemv, transposed, "{what}: matrix-vector kernel");
                if transposed && k % 4 == 0 {
                    // each 16-byte chunk of a routed expert's row is one
                    // load, its expert index read once for it
                    assert!(reads_gathered_chunks(payload, product), "{what}");
                }
                let ends: Vec<i64> = offs.iter().map(|&o| o as i64).collect();
                let inputs = vec![x, w, Tensor::from_i64(DType::I32, &[e], &ends).unwrap()];
                let expected = etmetal::eval::run_graph(&graph, inputs.clone()).unwrap();
                let got = run_pte(compiled.pte.clone(), inputs);
                let tol = if dtype == DType::BF16 { 2e-2 } else { 1e-5 };
                assert_close(&got[0], &expected[0], tol, &what);
                // the rows past every group are zero
                let past = offs[e - 1] as usize;
                let rows = &got[0].to_f32_vec()[past * n..];
                assert!(rows.iter().all(|&v| v == 0.0), "{what}");
            }
        }
    }
}

/// Whether `dispatch`'s kernel reads `w` (the gathered matrices) in
/// 16-byte chunks through a gather's index read once a chunk (`gi0`):
/// `w` bound as chunks, and never read element by element.
fn reads_gathered_chunks(
    payload: &etmetal_metal::payload::Payload,
    dispatch: &etmetal_metal::payload::Dispatch,
) -> bool {
    let w = payload.buffers.iter().position(|b| b.name == "w").unwrap();
    let wgsl = &payload.kernels[dispatch.kernel].wgsl;
    let bound: Vec<&str> = dispatch
        .buffers
        .iter()
        .enumerate()
        .filter(|&(_, &b)| b == w)
        .filter_map(|(i, _)| {
            let decl = format!("b{i}: array<");
            let at = wgsl.find(&decl)? + decl.len();
            wgsl[at..].split('>').next()
        })
        .collect();
    wgsl.contains("let gi0 = ") && !bound.is_empty() && bound.iter().all(|t| t.starts_with("vec4"))
}

/// `x @ index_select(w, 0, idx)` (`x` `[b, m, k]`, `idx` `[b]` of `e`
/// matrices `w`: `[e, k, n]`, or `[e, n, k]` read through a transpose
/// where `transposed`; all user inputs, so that no transpose is folded
/// into a copy), its value `gathered` the gather's.
fn gathered_product(
    [b, m, k, n, e]: [usize; 5],
    transposed: bool,
    dtype: DType,
    seed: u64,
) -> (Graph, Vec<Tensor>) {
    let mut g = Graph::default();
    let push = |g: &mut Graph, name: &str, op: Op, inputs: &[ValueId]| {
        let mut node = Node {
            name: name.into(),
            target: "test".into(),
            op,
            inputs: inputs.iter().copied().map(Some).collect(),
            outputs: vec![],
        };
        let (dtype, shape) = etmetal_graph::infer::infer(g, &node).unwrap().remove(0);
        let v = g.add_value(name, dtype, shape);
        node.outputs.push(v);
        g.nodes.push(node);
        v
    };
    let x_t = random(dtype, &[b, m, k], seed);
    let idx_t = random_indices(&[b], e as i64, seed + 1);
    let shape = if transposed { [e, n, k] } else { [e, k, n] };
    let w_t = random(dtype, &shape, seed + 2);
    let x = g.add_value("x", dtype, vec![b, m, k]);
    let idx = g.add_value("idx", DType::I64, vec![b]);
    let mut w = g.add_value("w", dtype, shape.to_vec());
    for v in [x, idx, w] {
        g.inputs.push((v, InputKind::User));
    }
    if transposed {
        w = push(
            &mut g,
            "wt",
            Op::Permute {
                dims: vec![0, 2, 1],
            },
            &[w],
        );
    }
    let gathered = push(&mut g, "gathered", Op::IndexSelect { dim: 0 }, &[w, idx]);
    let y = push(&mut g, "y", Op::MatMul, &[x, gathered]);
    g.outputs.push((y, OutputKind::User));
    (g, vec![x_t, idx_t, w_t])
}

/// A product's right operand gathered along its batch dim is read in place
/// (never written to a buffer of its own) by the matrix-vector kernel (few
/// rows of a transposed weight), the tiled one, and the tensor-core forms
/// (emulated: their pre-passes and f16 copies read it through the same
/// readers), and matches the CPU kernels.
#[test]
fn gathered_right_operands_are_read_in_place_in_every_form() {
    let cases = [
        ([2, 1, 40, 300, 6], true, DType::F32),
        ([3, 5, 37, 20, 4], false, DType::F32),
        ([2, 3, 64, 72, 5], true, DType::BF16),
        ([3, 40, 48, 64, 5], true, DType::BF16),
        ([3, 40, 48, 64, 5], false, DType::BF16),
    ];
    for (i, (dims, transposed, dtype)) in cases.into_iter().enumerate() {
        let what = format!("{dims:?} transposed {transposed} {dtype:?}");
        let (graph, inputs) = gathered_product(dims, transposed, dtype, 100 + 10 * i as u64);
        let compiled = compile_whole_within(&graph, &DeviceLimits::default());
        let payload = &compiled.methods[0].partitions[0].payload;
        assert!(
            payload.buffers.iter().all(|b| b.name != "gathered"),
            "{what}: the gathered matrices are written out"
        );
        // (few rows of a weight contiguous along k: the matrix-vector kernel)
        let gemv = payload.dispatches.iter().any(|d| {
            payload.kernels[d.kernel]
                .wgsl
                .contains("var<workgroup> red")
        });
        assert_eq!(gemv, transposed && dims[1] <= 8, "{what}");
        let tol = if dtype == DType::BF16 { 2e-2 } else { 1e-4 };
        check_graph(&graph, inputs.clone(), tol, &what);
        if dims[1] >= 32 {
            for em in emulations(&[CoopForm::Half16, CoopForm::Float8]) {
                check_graph_emulating(&graph, inputs.clone(), tol, em, &what);
            }
        }
    }
}

/// The chunk reader's gather clamps its index as the element reader does:
/// a negative index counts from the end and one out of range reads the
/// nearest matrix, so no load leaves `w`'s buffer. The GPU matches the
/// CPU kernels run at the indices so clamped (the CPU's `index_select`
/// refuses them), in the matrix-vector kernel (f32 and bf16 chunks) and
/// the tensor-core forms (emulated), whose staging reads chunks too.
#[test]
fn gathered_chunks_clamp_their_index_into_the_buffer() {
    let cases = [
        ([3, 1, 40, 300, 6], true, DType::F32),
        ([3, 1, 64, 72, 6], true, DType::BF16),
        ([3, 40, 48, 64, 6], false, DType::BF16),
    ];
    for (i, (dims, transposed, dtype)) in cases.into_iter().enumerate() {
        let what = format!("{dims:?} transposed {transposed} {dtype:?}");
        let (graph, mut inputs) = gathered_product(dims, transposed, dtype, 300 + 10 * i as u64);
        let e = dims[4] as i64;
        let wild = Tensor::from_i64(DType::I64, &[3], &[e + 3, -1, -100]).unwrap();
        let clamped = Tensor::from_i64(DType::I64, &[3], &[e - 1, e - 1, 0]).unwrap();
        inputs[1] = clamped;
        let expected = etmetal::eval::run_graph(&graph, inputs.clone()).unwrap();
        inputs[1] = wild;
        let tol = if dtype == DType::BF16 { 2e-2 } else { 1e-4 };
        let ptes = if transposed {
            let compiled = compile_whole_within(&graph, &DeviceLimits::default());
            let payload = &compiled.methods[0].partitions[0].payload;
            let product = payload
                .dispatches
                .iter()
                .find(|d| d.nodes.iter().any(|n| n == "mat_mul"))
                .expect("the product's dispatch");
            assert!(reads_gathered_chunks(payload, product), "{what}");
            vec![compiled.pte.clone()]
        } else {
            [(CoopForm::Half16, 0), (CoopForm::Float8, 0)]
                .into_iter()
                .map(|(form, variant)| {
                    let compiled = compile_emulating_report(&graph, form, variant);
                    let wgsl = compiled.methods[0].partitions[0].payload.kernels.iter();
                    let chunked = wgsl.clone().any(|k| k.wgsl.contains("let gi0 = "));
                    assert!(chunked, "{what} {form:?}: no gathered chunks");
                    compiled.pte.clone()
                })
                .collect()
        };
        for pte in ptes {
            let got = run_pte(pte, inputs.clone());
            assert_close(&got[0], &expected[0], tol, &what);
        }
    }
}
