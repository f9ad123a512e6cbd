//! The region wrappers of a pre-dispatch export (what `torch.export.export`
//! saves before `run_decompositions`): `wrap_with_set_grad_enabled` (a
//! `torch.no_grad()` block, as transformers' rotary embeddings have) and
//! `wrap_with_autocast` (a `torch.autocast` block) each call a subgraph.
//! Inference needs neither switch, so the subgraph's nodes are inlined in
//! place of the call, before lowering. An autocast region that is enabled
//! is refused: its casts are applied only by `run_decompositions()`.

use std::borrow::Cow;
use std::collections::HashMap;

use etmetal_core::{Error, Result};
use serde_json::{Map, Value};

use super::json::field;

const SET_GRAD: &str = "torch.ops.higher_order.wrap_with_set_grad_enabled";
const AUTOCAST: &str = "torch.ops.higher_order.wrap_with_autocast";

fn is_region(node: &Value) -> bool {
    matches!(
        node.get("target").and_then(Value::as_str),
        Some(SET_GRAD | AUTOCAST)
    )
}

/// `graph` with every region call replaced by its subgraph's nodes
/// (recursively); borrowed when it has none.
pub(super) fn inline_regions(graph: &Value) -> Result<Cow<'_, Value>> {
    let nodes = field(graph, "nodes")?
        .as_array()
        .ok_or_else(|| Error::format("`nodes` is not a list"))?;
    if !nodes.iter().any(is_region) {
        return Ok(Cow::Borrowed(graph));
    }
    let mut flat = graph.clone();
    let mut out_nodes = Vec::with_capacity(nodes.len());
    for (i, node) in nodes.iter().enumerate() {
        if is_region(node) {
            inline_one(node, i, &mut flat, &mut out_nodes)?;
        } else {
            out_nodes.push(node.clone());
        }
    }
    flat["nodes"] = Value::Array(out_nodes);
    Ok(Cow::Owned(flat))
}

/// Append the nodes of region call `node` (the `index`th node of the outer
/// graph `outer`) to `out`, renamed into the outer graph: the subgraph's
/// inputs become the call's operands, its outputs the call's outputs, and
/// every other name gets the call's name as a prefix. Their tensor and
/// SymInt metadata move into `outer`'s tables under the new names.
fn inline_one(node: &Value, index: usize, outer: &mut Value, out: &mut Vec<Value>) -> Result<()> {
    let target = node["target"].as_str().unwrap_or_default();
    let name = node
        .get("name")
        .and_then(Value::as_str)
        .map_or_else(|| format!("node{index}"), str::to_string);
    let where_ = || format!("node `{name}` ({target})");
    let inputs: Vec<&Value> = field(node, "inputs")?
        .as_array()
        .ok_or_else(|| Error::format(format!("{}: `inputs` is not a list", where_())))?
        .iter()
        .map(|i| i.get("arg").unwrap_or(i))
        .collect();
    let at = inputs
        .iter()
        .position(|a| a.get("as_graph").is_some())
        .ok_or_else(|| Error::format(format!("{}: no subgraph argument", where_())))?;
    // autocast's arguments: device_type, dtype, enabled, cache_enabled
    if target == AUTOCAST && inputs.get(2).and_then(|a| a["as_bool"].as_bool()) != Some(false) {
        return Err(Error::unsupported(format!(
            "{}: an enabled `torch.autocast` region: its casts are applied by \
             `ep.run_decompositions()`; save the program after it (or export \
             without autocast)",
            where_()
        )));
    }
    let sub = field(field(inputs[at], "as_graph")?, "graph")?;
    let sub = inline_regions(sub)?;

    let mut rename: HashMap<String, String> = HashMap::new();
    let sub_inputs = field(&sub, "inputs")?
        .as_array()
        .cloned()
        .unwrap_or_default();
    let operands = &inputs[at + 1..];
    if sub_inputs.len() != operands.len() {
        return Err(Error::format(format!(
            "{}: the subgraph takes {} input(s), the call passes {}",
            where_(),
            sub_inputs.len(),
            operands.len()
        )));
    }
    for (param, operand) in sub_inputs.iter().zip(operands) {
        let (Some(p), Some(o)) = (value_name(param), value_name(operand)) else {
            return Err(Error::unsupported(format!(
                "{}: a subgraph input that is not a tensor or SymInt name ({})",
                where_(),
                super::json::short(operand)
            )));
        };
        rename.insert(p.to_string(), o.to_string());
    }
    let results = super::node_outputs(node).map_err(|e| e.context(where_()))?;
    let sub_outputs = field(&sub, "outputs")?
        .as_array()
        .cloned()
        .unwrap_or_default();
    if sub_outputs.len() != results.len() {
        return Err(Error::format(format!(
            "{}: the subgraph returns {} value(s), the call {}",
            where_(),
            sub_outputs.len(),
            results.len()
        )));
    }
    for (ret, result) in sub_outputs.iter().zip(&results) {
        let (Some(r), Some(result)) = (value_name(ret), result) else {
            continue; // an output nobody reads
        };
        if rename.contains_key(r) {
            // passing an input straight through would need an alias node
            return Err(Error::unsupported(format!(
                "{}: the region returns its input `{r}` unchanged",
                where_()
            )));
        }
        rename.insert(r.to_string(), result.clone());
    }
    let prefixed = |n: &str| format!("{name}__{n}");

    // metadata of the subgraph's own values, under their outer names
    for table in ["tensor_values", "sym_int_values"] {
        let Some(Value::Object(inner)) = sub.get(table) else {
            continue;
        };
        let outer_table = outer
            .as_object_mut()
            .ok_or_else(|| Error::format("the graph is not an object"))?
            .entry(table)
            .or_insert_with(|| Value::Object(Map::new()));
        let Value::Object(outer_table) = outer_table else {
            return Err(Error::format(format!("`{table}` is not an object")));
        };
        for (n, meta) in inner {
            let new = rename.get(n).cloned().unwrap_or_else(|| prefixed(n));
            outer_table.entry(new).or_insert_with(|| meta.clone());
        }
    }
    for inner in field(&sub, "nodes")?.as_array().into_iter().flatten() {
        let mut n = inner.clone();
        rename_refs(&mut n, &|old: &str| {
            rename.get(old).cloned().unwrap_or_else(|| prefixed(old))
        });
        if let Some(Value::String(own)) = n.get_mut("name") {
            *own = prefixed(own);
        }
        out.push(n);
    }
    Ok(())
}

/// The name a subgraph input/output or call operand refers to: a tensor's
/// (`as_tensor`) or a SymInt's (`as_sym_int.as_name`).
fn value_name(v: &Value) -> Option<&str> {
    v.get("as_tensor")
        .and_then(|t| t.get("name"))
        .or_else(|| v.get("as_sym_int").and_then(|s| s.get("as_name")))
        .and_then(Value::as_str)
}

/// Rename every tensor and SymInt reference in `v` (inputs and outputs
/// alike) through `to`.
fn rename_refs(v: &mut Value, to: &dyn Fn(&str) -> String) {
    match v {
        Value::Object(o) => {
            for (key, inner) in o.iter_mut() {
                match (key.as_str(), inner) {
                    ("as_tensor", Value::Object(t)) => rename_field(t, "name", to),
                    ("as_sym_int", Value::Object(s)) => rename_field(s, "as_name", to),
                    ("as_tensors", Value::Array(ts)) => ts.iter_mut().for_each(|t| {
                        if let Value::Object(t) = t {
                            rename_field(t, "name", to)
                        }
                    }),
                    ("as_sym_ints", Value::Array(ss)) => ss.iter_mut().for_each(|s| {
                        if let Value::Object(s) = s {
                            rename_field(s, "as_name", to)
                        }
                    }),
                    // metadata strings and names are not references
                    ("metadata" | "name", _) => {}
                    (_, inner) => rename_refs(inner, to),
                }
            }
        }
        Value::Array(a) => a.iter_mut().for_each(|x| rename_refs(x, to)),
        _ => {}
    }
}

fn rename_field(o: &mut Map<String, Value>, key: &str, to: &dyn Fn(&str) -> String) {
    if let Some(Value::String(n)) = o.get_mut(key) {
        *n = to(n);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn tensor(n: &str) -> Value {
        json!({"as_tensor": {"name": n}})
    }

    /// `y = x * 2; with no_grad: z = sin(y) + 1; return z * y`, as torch
    /// 2.15 saves it (names as it picks them: the inner `add` is also the
    /// call's FX name, the call's output is `getitem`).
    fn no_grad_graph() -> Value {
        let node = |target: &str, name: &str, inputs: Vec<Value>, out: &str| {
            json!({"target": target, "name": name, "outputs": [tensor(out)],
                   "inputs": inputs.into_iter().map(|a| json!({"name": "", "arg": a, "kind": 1}))
                       .collect::<Vec<_>>(), "metadata": {}})
        };
        let sub = json!({
            "inputs": [tensor("mul")], "outputs": [tensor("add")],
            "nodes": [node("torch.ops.aten.sin.default", "sin", vec![tensor("mul")], "sin"),
                      node("torch.ops.aten.add.Tensor", "add", vec![tensor("sin"), json!({"as_int": 1})], "add")],
            "tensor_values": {"mul": {"m": 0}, "sin": {"m": 1}, "add": {"m": 2}},
        });
        json!({
            "inputs": [tensor("x")], "outputs": [tensor("mul_1")],
            "nodes": [
                node("torch.ops.aten.mul.Tensor", "mul", vec![tensor("x"), json!({"as_int": 2})], "mul"),
                node(SET_GRAD, "add", vec![json!({"as_bool": false}),
                     json!({"as_graph": {"name": "submod_1", "graph": sub}}), tensor("mul")], "getitem"),
                node("torch.ops.aten.mul.Tensor", "mul_1", vec![tensor("getitem"), tensor("mul")], "mul_1"),
            ],
            "tensor_values": {"x": {}, "mul": {}, "getitem": {}, "mul_1": {}},
        })
    }

    fn refs(n: &Value) -> Vec<String> {
        n["inputs"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|i| value_name(&i["arg"]).map(str::to_string))
            .collect()
    }

    #[test]
    fn no_grad_region_is_inlined_under_outer_names() {
        let g = no_grad_graph();
        let flat = inline_regions(&g).unwrap();
        let nodes = flat["nodes"].as_array().unwrap();
        let targets: Vec<&str> = nodes
            .iter()
            .map(|n| n["target"].as_str().unwrap())
            .collect();
        assert_eq!(
            targets,
            [
                "torch.ops.aten.mul.Tensor",
                "torch.ops.aten.sin.default",
                "torch.ops.aten.add.Tensor",
                "torch.ops.aten.mul.Tensor"
            ]
        );
        // sin reads the call's operand; add writes the call's output
        assert_eq!(refs(&nodes[1]), ["mul"]);
        assert_eq!(value_name(&nodes[1]["outputs"][0]), Some("add__sin"));
        assert_eq!(refs(&nodes[2]), ["add__sin"]);
        assert_eq!(value_name(&nodes[2]["outputs"][0]), Some("getitem"));
        assert_eq!(refs(&nodes[3]), ["getitem", "mul"]);
        // the inner value's metadata moved out; outer entries are kept
        assert_eq!(flat["tensor_values"]["add__sin"], json!({"m": 1}));
        assert_eq!(flat["tensor_values"]["getitem"], json!({}));
    }

    #[test]
    fn graph_without_regions_is_borrowed() {
        let mut g = no_grad_graph();
        g["nodes"].as_array_mut().unwrap().remove(1);
        assert!(matches!(inline_regions(&g).unwrap(), Cow::Borrowed(_)));
    }

    #[test]
    fn enabled_autocast_is_refused_with_the_rewrite() {
        let mut g = no_grad_graph();
        let call = &mut g["nodes"][1];
        call["target"] = json!(AUTOCAST);
        let graph_arg = call["inputs"][1].clone();
        let operand = call["inputs"][2].clone();
        let arg = |a: Value| json!({"name": "", "arg": a, "kind": 1});
        call["inputs"] = json!([
            arg(json!({"as_string": "cpu"})),
            arg(json!({"as_none": true})),
            arg(json!({"as_bool": true})),
            arg(json!({"as_bool": false})),
            graph_arg,
            operand
        ]);
        let e = inline_regions(&g).unwrap_err().to_string();
        assert!(
            e.contains("node `add`") && e.contains("run_decompositions"),
            "{e}"
        );
        // disabled, it is inlined like a no_grad block
        g["nodes"][1]["inputs"][2]["arg"] = json!({"as_bool": false});
        assert_eq!(
            inline_regions(&g).unwrap()["nodes"]
                .as_array()
                .unwrap()
                .len(),
            4
        );
    }

    #[test]
    fn arity_mismatch_is_a_format_error() {
        let mut g = no_grad_graph();
        g["nodes"][1]["inputs"].as_array_mut().unwrap().pop();
        let e = inline_regions(&g).unwrap_err().to_string();
        assert!(e.contains("takes 1 input(s), the call passes 0"), "{e}");
    }
}
