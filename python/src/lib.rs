//! `etmetal._etmetal`: the Rust half of the `etmetal` Python package.
//!
//! The compiler half works on `.pt2` bytes (what `torch.export.save`
//! writes; the Python half first rewrites ExecuTorch's edge-dialect targets
//! to the ATen targets the importer reads), so the decisions are the ones
//! `etmetal compile` makes, through the one pipeline of `etmetal::compile`
//! and its `CompileOptions`: [`ops_taken`] for `ops_to_not_decompose`,
//! [`partition`] for the partitioner's tags, [`preprocess`] for the
//! delegate payload and its named data, [`compile_program`] for a whole `.pte`
//! (`etmetal.compile`, with `dtype` and quantization as the CLI's flags). The runtime half is [`Program`] /
//! [`Method`] over `etmetal-runtime` with the GPU backend chosen by the
//! rule `etmetal run --device` uses ([`etmetal::device::choose`]).

use std::collections::HashMap;
use std::ffi::CString;
use std::path::Path;
use std::sync::Mutex;

use etmetal::compile::{self, Backend, CompileOptions, Partitioned, Quantization};
use etmetal::device::{DevicePreference, TensorCores, Workload};
use etmetal_core::{DType, Error, ErrorKind, Tensor};
use etmetal_graph::quantize::{QuantizeOptions, Scheme};
use etmetal_graph::Graph;
use etmetal_metal::compile_spec;
use etmetal_metal::partitioner::{self, PartitionMode, PartitionOptions};
use etmetal_metal_runtime::BACKEND_ID;
use etmetal_pte::CompileSpec;
use etmetal_runtime::LoadOptions;
use pyo3::exceptions::{PyRuntimeError, PyUserWarning, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyBytes;

/// Wrong inputs and malformed files are `ValueError`; the rest (unsupported
/// ops, device failures, bugs) `RuntimeError`. The message names what failed.
fn py_err(e: Error) -> PyErr {
    match e.kind() {
        ErrorKind::InvalidInput | ErrorKind::Format => PyValueError::new_err(e.to_string()),
        _ => PyRuntimeError::new_err(e.to_string()),
    }
}

/// The source (FX) node a graph node comes from: importer and decompositions
/// name every node `<fx name>.<suffix>`, and FX names have no dots.
fn fx_name(node_name: &str) -> &str {
    node_name.split('.').next().unwrap_or(node_name)
}

fn import(pt2: &[u8], origin: &str) -> PyResult<Graph> {
    etmetal_graph::import_pt2(pt2, origin).map_err(py_err)
}

/// The compile options of a partition mode (`auto`, `whole`) and ops kept
/// off the GPU, as the CLI's `--partition` and `--skip-op` make them.
fn partition_options(mode: &str, skip_ops: Vec<String>) -> PyResult<CompileOptions> {
    let mode = match mode {
        "auto" => PartitionMode::Auto,
        "whole" => PartitionMode::Whole,
        other => {
            return Err(PyValueError::new_err(format!(
                "partition mode `{other}`: expected `auto` or `whole`"
            )))
        }
    };
    Ok(CompileOptions {
        partition: PartitionOptions {
            mode,
            skip_ops,
            ..PartitionOptions::default()
        },
        ..CompileOptions::default()
    })
}

/// For each source node of the (ATen-dialect) program: whether the backend
/// takes every node it imports to whole (`ops_to_not_decompose`) and would
/// delegate them (within the support table's limits, not in `skip_ops`).
#[pyfunction]
fn ops_taken(pt2: &[u8], skip_ops: Vec<String>) -> PyResult<Vec<(String, bool)>> {
    let g = import(pt2, "ops_to_not_decompose program")?;
    let options = partition_options("auto", skip_ops)?.partition;
    let mut out: Vec<(String, bool)> = vec![];
    let mut row: HashMap<&str, usize> = HashMap::new();
    for node in &g.nodes {
        let name = fx_name(&node.name);
        let keep = partitioner::ops_to_not_decompose(&node.op) && options.takes(&g, node).is_ok();
        let i = *row.entry(name).or_insert_with(|| {
            out.push((name.to_string(), true));
            out.len() - 1
        });
        out[i].1 &= keep;
    }
    Ok(out)
}

/// `(fx node name, partition id or None, op, reason it stays on the CPU)`.
type NodeDecision = (String, Option<usize>, String, String);

/// The partitioner's decision for every node of the graph as `etmetal
/// compile` partitions it (decomposed for the backend, input-free nodes
/// folded: a source node with no row joins its neighbours' partition).
#[pyfunction]
fn partition(pt2: &[u8], mode: &str, skip_ops: Vec<String>) -> PyResult<Vec<NodeDecision>> {
    let options = partition_options(mode, skip_ops)?;
    let g = import(pt2, "edge program")?;
    let Partitioned {
        graph: g,
        partitioning: parts,
        ..
    } = compile::partition_graph(&g, &options).map_err(py_err)?;
    let mut out: Vec<_> = g
        .nodes
        .iter()
        .zip(&parts.node_partition)
        .map(|(node, p)| {
            (
                fx_name(&node.name).to_string(),
                *p,
                node.op.name().to_string(),
                String::new(),
            )
        })
        .collect();
    for (i, reason) in parts.cpu_nodes {
        if let Some(row) = out.get_mut(i) {
            row.3 = reason;
        }
    }
    Ok(out)
}

/// One named-data entry: its key and bytes.
type NamedBytes<'py> = (String, Bound<'py, PyBytes>);

/// The delegate payload of one lowered partition (a whole edge program)
/// and its named data `(key, GPU bytes)` ([`compile::delegate_payload`]).
///
/// `int4_group_size` quantizes the partition's linears to int4 weights with
/// groups of that size (`etmetal compile --quantize int4`), except those
/// whose weight name contains one of `quantize_skip`.
#[pyfunction]
#[pyo3(signature = (pt2, int4_group_size=None, quantize_skip=Vec::new()))]
fn preprocess<'py>(
    py: Python<'py>,
    pt2: &[u8],
    int4_group_size: Option<usize>,
    quantize_skip: Vec<String>,
) -> PyResult<(Bound<'py, PyBytes>, Vec<NamedBytes<'py>>)> {
    let g = import(pt2, "partition program")?;
    let options = CompileOptions {
        quantize: int4_group_size.map(|group_size| Quantization {
            options: QuantizeOptions::int4(group_size, &quantize_skip),
            calibration: None,
        }),
        ..CompileOptions::default()
    };
    let pre = compile::delegate_payload(&g, &options)
        .map_err(|e| py_err(e.context(format!("{BACKEND_ID} preprocess"))))?;
    let named = pre
        .named_data
        .iter()
        .map(|(k, bytes)| (k.clone(), PyBytes::new(py, bytes)))
        .collect();
    Ok((PyBytes::new(py, &pre.payload.encode()), named))
}

/// A whole `.pt2` program compiled into the bytes of a `.pte`, as `etmetal
/// compile` writes it: the keywords are its flags (`dtype`: `f32`, `bf16`,
/// `f16` or a torch dtype name).
#[pyfunction]
#[pyo3(signature = (
    pt2, dtype="f32", backend="metal", partition="auto", skip_ops=Vec::new(),
    quantize=None, group_size=None, quantize_skip=Vec::new(), max_buffer=None,
))]
#[pyo3(name = "compile")]
#[allow(clippy::too_many_arguments)]
fn compile_program<'py>(
    py: Python<'py>,
    pt2: &[u8],
    dtype: &str,
    backend: &str,
    partition: &str,
    skip_ops: Vec<String>,
    quantize: Option<&str>,
    group_size: Option<usize>,
    quantize_skip: Vec<String>,
    max_buffer: Option<u64>,
) -> PyResult<Bound<'py, PyBytes>> {
    let mut options = partition_options(partition, skip_ops)?;
    options.backend = match backend {
        "metal" => Backend::Metal,
        "cpu" => Backend::Cpu,
        other => {
            return Err(PyValueError::new_err(format!(
                "backend `{other}`: expected `metal` or `cpu`"
            )))
        }
    };
    options.dtype = match dtype {
        "f32" => DType::F32,
        "bf16" => DType::BF16,
        "f16" => DType::F16,
        name => DType::from_name(name).ok_or_else(|| {
            PyValueError::new_err(format!("dtype `{name}`: expected f32, bf16 or f16"))
        })?,
    };
    if let Some(scheme) = quantize {
        let scheme = match scheme {
            "int4" => Scheme::Int4,
            "int8" => Scheme::Int8,
            "mixed" => Scheme::Mixed,
            other => {
                return Err(PyValueError::new_err(format!(
                    "quantize `{other}`: expected int4, int8 or mixed"
                )))
            }
        };
        options.quantize = Some(Quantization {
            options: QuantizeOptions {
                scheme,
                group_size,
                skip: quantize_skip,
            },
            calibration: None,
        });
    }
    if let Some(bytes) = max_buffer {
        options.partition.limits.max_buffer_bytes = bytes;
    }
    let graph = import(pt2, "program")?;
    let compiled = py
        .detach(|| compile::compile(&graph, &options, &mut |_| {}))
        .map_err(py_err)?;
    Ok(PyBytes::new(py, &compiled.pte))
}

/// `(key, value)` of the compile spec naming `method`.
#[pyfunction]
fn method_name_spec<'py>(py: Python<'py>, method: &str) -> (String, Bound<'py, PyBytes>) {
    let spec = compile_spec::method_name_spec(method);
    (spec.key, PyBytes::new(py, &spec.value))
}

/// The method name among `(key, value)` compile specs; a `RuntimeError`
/// ("Could not find method name …") when there is none, as ExecuTorch's
/// backends raise it.
#[pyfunction]
fn method_name(specs: Vec<(String, Vec<u8>)>) -> PyResult<String> {
    let specs: Vec<CompileSpec> = specs
        .into_iter()
        .map(|(key, value)| CompileSpec { key, value })
        .collect();
    compile_spec::method_name(&specs).map_err(|e| PyRuntimeError::new_err(e.to_string()))
}

/// A loaded `.pte`. Its `EtMetalBackend` delegates run on the GPU the device
/// choice finds; a file without them runs on the CPU kernels.
#[pyclass(module = "etmetal._etmetal", frozen)]
struct Program {
    program: etmetal_runtime::Program,
    device: String,
}

#[pymethods]
impl Program {
    /// `device`: `auto`, `metal`, `vulkan`, `dx12` or `cpu`, as
    /// `etmetal run --device`. A file with GPU delegates and no adapter (or
    /// `cpu`) is an error, as in the CLI. `coop`: the tensor-core setting,
    /// as `etmetal run --coop` takes it (`auto`, `all` or `off`); `None`,
    /// `ETMETAL_COOP`'s, else `auto`.
    #[new]
    #[pyo3(signature = (path, device = "auto", coop = None))]
    fn new(py: Python<'_>, path: &str, device: &str, coop: Option<&str>) -> PyResult<Program> {
        let preference = DevicePreference::parse(device).map_err(py_err)?;
        let tensor_cores = match coop {
            Some(name) => TensorCores::parse(name, "coop="),
            None => TensorCores::from_env(),
        }
        .map_err(py_err)?;
        let program = etmetal_runtime::Program::load(path).map_err(py_err)?;
        let workload = Workload::of_pte(program.file());
        let placement =
            etmetal::device::choose(preference, Path::new(path), workload).map_err(py_err)?;
        if let Some(warning) = &placement.warning {
            PyErr::warn(
                py,
                &py.get_type::<PyUserWarning>(),
                &CString::new(warning.as_str())?,
                1,
            )?;
        }
        let Some(backend) = placement.backend(tensor_cores) else {
            return Ok(Program {
                program,
                device: "cpu".into(),
            });
        };
        let mut options = LoadOptions::default();
        options.backends.register(backend).map_err(py_err)?;
        Ok(Program {
            program: program.with_options(options),
            device: placement.gpu.map_or_else(|| "cpu".into(), |g| g.adapter),
        })
    }

    /// `cpu`, or the GPU adapter the delegates run on.
    #[getter]
    fn device(&self) -> &str {
        &self.device
    }

    fn method_names(&self) -> Vec<String> {
        self.program
            .method_names()
            .into_iter()
            .map(String::from)
            .collect()
    }

    /// Prepare method `name` (its delegates load on the device now).
    fn method(&self, name: &str) -> PyResult<Method> {
        let method = self.program.method(name).map_err(py_err)?;
        Ok(Method {
            name: name.to_string(),
            method: Mutex::new(method),
        })
    }
}

/// A tensor crossing the boundary: `(dtype name, shape, bytes)`, C order.
type RawTensor<'py> = (String, Vec<usize>, Bound<'py, PyBytes>);

#[pyclass(module = "etmetal._etmetal", frozen)]
struct Method {
    name: String,
    method: Mutex<etmetal_runtime::Method>,
}

#[pymethods]
impl Method {
    #[getter]
    fn name(&self) -> &str {
        &self.name
    }

    /// `(dtype name, shape)` of each input; a dynamic input's shape is its
    /// upper bound.
    fn input_specs(&self) -> PyResult<Vec<(String, Vec<usize>)>> {
        let m = self.lock()?;
        Ok(m.input_specs()
            .into_iter()
            .map(|s| (s.dtype.name().to_string(), s.shape))
            .collect())
    }

    /// For each input, which dims are dynamic: any size up to the shape
    /// `input_specs` gives (ExecuTorch's bounded dynamic shapes).
    fn dynamic_inputs(&self) -> PyResult<Vec<Vec<bool>>> {
        let m = self.lock()?;
        Ok(m.input_specs()
            .into_iter()
            .map(|s| (0..s.shape.len()).map(|d| s.dim_is_dynamic(d)).collect())
            .collect())
    }

    /// Run on `(dtype name, shape, bytes)` inputs; outputs the same way.
    fn execute<'py>(
        &self,
        py: Python<'py>,
        inputs: Vec<(String, Vec<usize>, Vec<u8>)>,
    ) -> PyResult<Vec<RawTensor<'py>>> {
        let tensors = inputs
            .iter()
            .enumerate()
            .map(|(i, (dtype, shape, data))| {
                let dt = DType::from_name(dtype).ok_or_else(|| {
                    PyValueError::new_err(format!("input {i}: dtype `{dtype}` is not supported"))
                })?;
                Tensor::from_bytes(dt, shape, data)
                    .map_err(|e| py_err(e.context(format!("input {i}"))))
            })
            .collect::<PyResult<Vec<_>>>()?;
        let outputs = {
            let mut guard = self.lock()?;
            let m: &mut etmetal_runtime::Method = &mut guard;
            py.detach(|| m.execute(tensors)).map_err(py_err)?
        };
        Ok(outputs
            .iter()
            .map(|t| {
                (
                    t.dtype().name().to_string(),
                    t.shape().to_vec(),
                    PyBytes::new(py, t.bytes()),
                )
            })
            .collect())
    }
}

impl Method {
    fn lock(&self) -> PyResult<std::sync::MutexGuard<'_, etmetal_runtime::Method>> {
        self.method.lock().map_err(|_| {
            PyRuntimeError::new_err(format!(
                "method `{}` failed in another thread and is unusable",
                self.name
            ))
        })
    }
}

#[pymodule]
fn _etmetal(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add("BACKEND_ID", BACKEND_ID)?;
    m.add_function(wrap_pyfunction!(ops_taken, m)?)?;
    m.add_function(wrap_pyfunction!(partition, m)?)?;
    m.add_function(wrap_pyfunction!(preprocess, m)?)?;
    m.add_function(wrap_pyfunction!(compile_program, m)?)?;
    m.add_function(wrap_pyfunction!(method_name_spec, m)?)?;
    m.add_function(wrap_pyfunction!(method_name, m)?)?;
    m.add_class::<Program>()?;
    m.add_class::<Method>()?;
    Ok(())
}
