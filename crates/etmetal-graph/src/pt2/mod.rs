//! Import of the `.pt2` archive written by `torch.export.save` (torch 2.9 to
//! 2.15 layout, schema major 8) into a [`Graph`].

mod archive;
mod json;
pub use json::MAX_TENSOR_BYTES;
mod lower;
mod regions;

use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::sync::Arc;

use etmetal_core::error::ResultExt;
use etmetal_core::{DType, Error, Result, SymExpr, SymRange, SymRanges};
use serde_json::Value;

use crate::ir::{Graph, InputKind, OutputKind};
use archive::{Archive, Storage};
use json::{
    field, is_contiguous, is_dense, short, sym_size, sym_tensor_meta, union, Args, SymInts,
};
use lower::{functional_target, is_unsupported, Ctx, Lowerer};

/// The torch.export serde schema major version this importer reads.
pub const SCHEMA_MAJOR: i64 = 8;

/// Map and import a `.pt2` file. Its weights stay in the mapping (the
/// graph's constants borrow it), so the file must not change while the
/// graph is alive.
pub fn load_pt2(path: &Path) -> Result<Graph> {
    let file = std::fs::File::open(path).map_err(|e| Error::io(path.display(), e))?;
    // SAFETY: the map is only read; a file truncated or rewritten meanwhile
    // is outside what etmetal can guard against (as for `.pte` files).
    let map = unsafe { memmap2::Mmap::map(&file) }.map_err(|e| Error::io(path.display(), e))?;
    import_archive(Arc::new(map), &path.display().to_string())
}

/// Import a `.pt2` archive held in memory; `origin` names it in messages.
pub fn import_pt2(bytes: &[u8], origin: &str) -> Result<Graph> {
    import_archive(Arc::new(bytes.to_vec()), origin)
}

fn import_archive(bytes: archive::Shared, origin: &str) -> Result<Graph> {
    let archive = Archive::open(bytes, origin)?;
    archive.check_version()?;
    let (model_path, program) = archive.model_json()?;
    // the payload configs are named after the model: `models/<model>.json`
    let model = model_path
        .trim_start_matches("models/")
        .trim_end_matches(".json");
    import_program(&archive, model, &program).context(format!("{origin}: {model_path}"))
}

fn check_schema(program: &Value) -> Result<()> {
    let v = field(program, "schema_version")?;
    let major = v.get("major").and_then(Value::as_i64);
    let minor = v.get("minor").and_then(Value::as_i64);
    match (major, minor) {
        (Some(SCHEMA_MAJOR), _) | (Some(0), Some(0)) => Ok(()),
        _ => Err(Error::unsupported(format!(
            "schema version {}.{} is not supported (etmetal reads major version {SCHEMA_MAJOR}, torch 2.7 to 2.15)",
            major.map_or("?".into(), |m| m.to_string()),
            minor.map_or("?".into(), |m| m.to_string())
        ))),
    }
}

fn str_field<'a>(v: &'a Value, key: &str) -> Result<&'a str> {
    field(v, key)?
        .as_str()
        .ok_or_else(|| Error::format(format!("`{key}` is not a string")))
}

/// The value name an input/output `Argument` refers to (`as_tensor`).
fn arg_tensor_name(arg: &Value) -> Result<&str> {
    // buffer/parameter inputs and buffer mutations hold a bare `TensorArgument`
    if let Some(name) = arg.get("name").and_then(Value::as_str) {
        return Ok(name);
    }
    match union(arg)? {
        ("as_tensor", t) => str_field(t, "name"),
        (tag, _) => Err(Error::unsupported(format!(
            "non-tensor graph input/output `{tag}`"
        ))),
    }
}

/// Output names of a node: one per tensor (`as_tensors` flattened).
fn node_outputs(node: &Value) -> Result<Vec<Option<String>>> {
    let mut out = vec![];
    for o in field(node, "outputs")?
        .as_array()
        .ok_or_else(|| Error::format("node `outputs` is not a list"))?
    {
        match union(o)? {
            ("as_tensor", t) => out.push(Some(str_field(t, "name")?.to_string())),
            ("as_tensors", Value::Array(ts)) => {
                for t in ts {
                    out.push(Some(str_field(t, "name")?.to_string()));
                }
            }
            ("as_none", _) => out.push(None),
            (tag, _) => {
                return Err(Error::unsupported(format!(
                    "node output of kind `{tag}` beside tensors"
                )))
            }
        }
    }
    Ok(out)
}

/// Every tensor name that a node input or a graph output reads.
fn used_names(graph: &Value) -> HashSet<String> {
    fn walk(v: &Value, out: &mut HashSet<String>) {
        match v {
            Value::Object(o) => {
                if let Some(Value::Object(t)) = o.get("as_tensor") {
                    if let Some(Value::String(n)) = t.get("name") {
                        out.insert(n.clone());
                    }
                }
                if let Some(Value::Array(ts)) = o.get("as_tensors") {
                    out.extend(
                        ts.iter()
                            .filter_map(|t| t.get("name")?.as_str().map(str::to_string)),
                    );
                }
                o.values().for_each(|v| walk(v, out));
            }
            Value::Array(a) => a.iter().for_each(|v| walk(v, out)),
            _ => {}
        }
    }
    let mut out = HashSet::new();
    if let Some(Value::Array(nodes)) = graph.get("nodes") {
        for n in nodes {
            if let Some(i) = n.get("inputs") {
                walk(i, &mut out);
            }
        }
    }
    if let Some(o) = graph.get("outputs") {
        walk(o, &mut out);
    }
    out
}

/// Whether every output of `node` is a symbolic value (`sym_size`,
/// `operator.add` of SymInts, `torch.sym_max`, …): the file states each
/// one's expression in `sym_int_values`, so the node itself is not lowered.
fn is_symbolic_node(node: &Value) -> bool {
    let outs = node.get("outputs").and_then(Value::as_array);
    outs.is_some_and(|o| {
        !o.is_empty()
            && o.iter()
                .all(|v| union(v).is_ok_and(|(tag, _)| tag.starts_with("as_sym_")))
    })
}

/// The symbols' ranges (`range_constraints`). A symbol without an upper
/// bound is left out: memory is planned at the bound, so a size that uses
/// it is refused where it is read ([`SymExpr::bounds`]), while one that no
/// size uses (torch.export may list such leftovers) is harmless.
fn ranges(program: &Value) -> Result<SymRanges> {
    let mut out = SymRanges::new();
    let Some(rc) = program.get("range_constraints").and_then(Value::as_object) else {
        return Ok(out);
    };
    for (name, r) in rc {
        let bound = |key: &str| r.get(key).and_then(Value::as_i64);
        if let Some(max) = bound("max_val") {
            let min = bound("min_val").unwrap_or(0);
            out.insert(name.clone(), SymRange { min, max });
        }
    }
    Ok(out)
}

/// The program's SymInt values (`sym_int_values`), with their upper bounds.
fn sym_ints(g: &Value, ranges: &SymRanges) -> Result<SymInts> {
    let mut out = SymInts::new();
    if let Some(values) = g.get("sym_int_values").and_then(Value::as_object) {
        for (name, v) in values {
            let e = sym_size(v).with_context(|| format!("symbolic int `{name}`"))?;
            let (_, hi) = e
                .bounds(ranges)
                .with_context(|| format!("symbolic int `{name}`"))?;
            out.insert(name.clone(), (e, hi));
        }
    }
    Ok(out)
}

struct Payloads {
    weights: Option<Value>,
    constants: Option<Value>,
}

impl Payloads {
    fn read(archive: &Archive, model: &str) -> Result<Payloads> {
        let find = |dir: &str| -> Result<Option<Value>> {
            let kind = dir.rsplit('/').next().unwrap_or(dir);
            archive
                .json(&format!("{dir}/{model}_{kind}_config.json"))
                .transpose()
        };
        Ok(Payloads {
            weights: find("data/weights")?,
            constants: find("data/constants")?,
        })
    }

    /// Where `fqn`'s data lies (see [`archive::Storage`]), `None` when no
    /// config lists it.
    fn storage(&self, archive: &Archive, fqn: &str) -> Result<Option<Storage>> {
        for (dir, config) in [
            ("data/weights", &self.weights),
            ("data/constants", &self.constants),
        ] {
            if let Some(config) = config {
                if let Some(s) = archive.payload_storage(dir, config, fqn)? {
                    return Ok(Some(s));
                }
            }
        }
        Ok(None)
    }

    /// The data of `fqn`, from the weights config or else the constants
    /// one, and whether it is fake.
    fn tensor(&self, archive: &Archive, fqn: &str) -> Result<(etmetal_core::Tensor, bool)> {
        for (dir, config) in [
            ("data/weights", &self.weights),
            ("data/constants", &self.constants),
        ] {
            if let Some(config) = config {
                if let Some(t) = archive.payload_tensor(dir, config, fqn)? {
                    return Ok(t);
                }
            }
        }
        if self.weights.is_none() && self.constants.is_none() {
            return Err(Error::unsupported(format!(
                "no payload for `{fqn}`: the archive has no `*_config.json` payload configs \
                 (torch 2.8 and older pickle their weights, which etmetal does not read)"
            )));
        }
        Err(Error::format(format!(
            "no payload for `{fqn}` in the weights or constants configs"
        )))
    }
}

fn import_program(archive: &Archive, model: &str, program: &Value) -> Result<Graph> {
    check_schema(program)?;
    let module = field(program, "graph_module")?;
    // (`torch.no_grad()`/autocast blocks of a pre-dispatch export inlined)
    let g = regions::inline_regions(field(module, "graph")?)?;
    let g: &Value = &g;
    let signature = field(module, "signature")?;

    let ranges = ranges(program)?;
    let syms = sym_ints(g, &ranges)?;
    let mut meta: HashMap<String, (DType, Vec<usize>)> = HashMap::new();
    let mut sym_meta: HashMap<String, Vec<SymExpr>> = HashMap::new();
    let mut dense = HashSet::new();
    let mut contiguous = HashSet::new();
    if let Some(tv) = g.get("tensor_values").and_then(Value::as_object) {
        for (name, m) in tv {
            let (dtype, shape, sym) =
                sym_tensor_meta(m, &ranges).with_context(|| format!("tensor `{name}`"))?;
            if is_dense(m, &shape) {
                dense.insert(name.clone());
            }
            if is_contiguous(m, &shape) {
                contiguous.insert(name.clone());
            }
            meta.insert(name.clone(), (dtype, shape));
            if let Some(sym) = sym {
                sym_meta.insert(name.clone(), sym);
            }
        }
    }
    let payloads = Payloads::read(archive, model)?;
    let mut graph = Graph::default();
    graph.sym.ranges = ranges;
    let mut lowerer = Lowerer::new(graph, &meta, &sym_meta, used_names(g), dense, contiguous);

    // Placeholders: one per input spec, in signature order.
    // Where each buffer and constant lies, to find the names of one tensor.
    let mut storages: Vec<(String, Storage)> = vec![];
    let specs = field(signature, "input_specs")?
        .as_array()
        .ok_or_else(|| Error::format("`input_specs` is not a list"))?;
    for spec in specs {
        let (tag, body) = union(spec)?;
        let (name, kind) = match tag {
            "user_input" => (arg_tensor_name(field(body, "arg")?)?, InputKind::User),
            "parameter" => (
                str_field(field(body, "arg")?, "name")?,
                InputKind::Parameter {
                    fqn: str_field(body, "parameter_name")?.to_string(),
                },
            ),
            "buffer" => (
                str_field(field(body, "arg")?, "name")?,
                InputKind::Buffer {
                    fqn: str_field(body, "buffer_name")?.to_string(),
                    persistent: body
                        .get("persistent")
                        .and_then(Value::as_bool)
                        .unwrap_or(true),
                },
            ),
            "tensor_constant" => (
                str_field(field(body, "arg")?, "name")?,
                InputKind::Constant {
                    fqn: str_field(body, "tensor_constant_name")?.to_string(),
                },
            ),
            other => {
                return Err(Error::unsupported(format!(
                    "graph input of kind `{other}`: {}",
                    short(body)
                )))
            }
        };
        let (dtype, shape) = meta.get(name).cloned().ok_or_else(|| {
            Error::format(format!("input `{name}` has no entry in tensor_values"))
        })?;
        let fqn = match &kind {
            InputKind::User => None,
            InputKind::Parameter { fqn }
            | InputKind::Buffer { fqn, .. }
            | InputKind::Constant { fqn } => Some(fqn.clone()),
        };
        if let (InputKind::Buffer { fqn, .. } | InputKind::Constant { fqn }, false) =
            (&kind, sym_meta.contains_key(name))
        {
            let storage = payloads
                .storage(archive, fqn)
                .with_context(|| format!("input `{name}`"))?;
            if let Some(storage) = storage {
                let same = storages.iter().find(|(_, s)| *s == storage);
                if let (InputKind::Constant { .. }, Some((base, _))) = (&kind, same) {
                    // A lifted constant that is an earlier buffer's (or
                    // constant's) tensor in eager: a non-strict export
                    // lifts the tensors a module reaches other than through
                    // its attributes (transformers' static cache layers)
                    // although they are its registered buffers. One
                    // tensor, one value: what the graph writes through
                    // either name is the buffer's new state.
                    let base = base.clone();
                    lowerer.alias_input(name, &base)?;
                    continue;
                }
                for (other, s) in &storages {
                    if s.overlaps(&storage) {
                        lowerer.note_overlap(name, other);
                    }
                }
                storages.push((name.to_string(), storage));
            }
        }
        let id = lowerer.graph.add_value(name, dtype, shape.clone());
        if let Some(sym) = sym_meta.get(name) {
            if fqn.is_some() {
                return Err(Error::unsupported(format!(
                    "input `{name}`: a weight or buffer of dynamic shape"
                )));
            }
            lowerer.graph.set_sym_dims(id, sym.clone())?;
        }
        if let Some(fqn) = fqn {
            let (t, fake) = payloads
                .tensor(archive, &fqn)
                .with_context(|| format!("input `{name}`"))?;
            if t.dtype() != dtype || t.shape() != shape.as_slice() {
                return Err(Error::format(format!(
                    "input `{name}` (`{fqn}`): payload is {} {:?}, the graph says {dtype} {shape:?}",
                    t.dtype(),
                    t.shape()
                )));
            }
            lowerer.graph.constants.insert(id, t);
            if fake {
                lowerer.graph.fake_constants.insert(id);
            }
        }
        lowerer.graph.inputs.push((id, kind));
        lowerer.bind_input(name, id);
    }

    let nodes = field(g, "nodes")?
        .as_array()
        .ok_or_else(|| Error::format("`nodes` is not a list"))?;
    let mut unsupported = vec![];
    for (i, n) in nodes.iter().enumerate() {
        if is_symbolic_node(n) {
            continue;
        }
        let target = str_field(n, "target")?.to_string();
        let name = n
            .get("name")
            .and_then(Value::as_str)
            .map_or_else(|| format!("node{i}"), str::to_string);
        let where_ = format!("node `{name}` ({target})");
        let outputs = node_outputs(n).context(where_.clone());
        let args = Args::new(field(n, "inputs")?, &syms).context(where_.clone());
        let functional = functional_target(&target);
        let lowered = outputs
            .and_then(|o| args.map(|a| (o, a)))
            .and_then(|(outputs, args)| {
                let lowered_target = functional.clone().unwrap_or_else(|| target.clone());
                let c = Ctx::new(name.clone(), lowered_target, args, outputs);
                lowerer.lower(&c, functional.is_some())
            });
        match lowered {
            Ok(_) => {}
            Err(e) if is_unsupported(&e) => unsupported.push(format!("{where_}: {}", e.message())),
            Err(e) => return Err(e.context(where_)),
        }
    }
    if !unsupported.is_empty() {
        return Err(Error::unsupported(format!(
            "{} unsupported node(s): {}",
            unsupported.len(),
            unsupported.join("; ")
        )));
    }

    // inputs that in-place ops wrote come first, as in a functional export
    lowerer.graph.outputs = lowerer.mutation_outputs()?;
    let out_specs = field(signature, "output_specs")?
        .as_array()
        .ok_or_else(|| Error::format("`output_specs` is not a list"))?;
    for spec in out_specs {
        let (tag, body) = union(spec)?;
        let name = arg_tensor_name(field(body, "arg")?)?;
        let kind = match tag {
            "user_output" => OutputKind::User,
            "buffer_mutation" => OutputKind::BufferMutation {
                fqn: str_field(body, "buffer_name")?.to_string(),
            },
            "user_input_mutation" => OutputKind::UserInputMutation {
                input_name: str_field(body, "user_input_name")?.to_string(),
            },
            other => {
                return Err(Error::unsupported(format!(
                    "graph output of kind `{other}`"
                )))
            }
        };
        let id = lowerer
            .lookup(name)
            .with_context(|| format!("graph output `{name}`"))?;
        lowerer.graph.outputs.push((id, kind));
    }
    Ok(lowerer.graph)
}
