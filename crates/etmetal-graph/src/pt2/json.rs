//! Reading the torch.export serde JSON (FORMATS.md B.4–B.5): union objects
//! with one key, `SymInt`s, tensor metadata, and a node's named arguments.

use std::cell::Cell;
use std::collections::HashMap;

use etmetal_core::{DType, Error, Result, Scalar, SymExpr, SymRanges};
use serde_json::Value;

pub(crate) fn field<'a>(v: &'a Value, key: &str) -> Result<&'a Value> {
    v.get(key)
        .ok_or_else(|| Error::format(format!("missing field `{key}`")))
}

/// The tag and payload of a serde union (`{"as_int": 3}` → `("as_int", 3)`).
pub(crate) fn union(v: &Value) -> Result<(&str, &Value)> {
    match v.as_object() {
        Some(o) if o.len() == 1 => o
            .iter()
            .next()
            .map(|(k, v)| (k.as_str(), v))
            .ok_or_else(|| Error::internal("empty")),
        _ => Err(Error::format(format!(
            "expected a union object with one key, got {}",
            short(v)
        ))),
    }
}

pub(crate) fn short(v: &Value) -> String {
    let s = v.to_string();
    if s.len() > 120 {
        format!(
            "{}…",
            &s[..s.char_indices().nth(120).map_or(s.len(), |(i, _)| i)]
        )
    } else {
        s
    }
}

/// A `SymInt` (`{"as_int": n}` or `{"as_expr": {"expr_str": …}}`).
pub(crate) fn sym_size(v: &Value) -> Result<SymExpr> {
    match union(v)? {
        ("as_int", n) => n
            .as_i64()
            .map(SymExpr::Const)
            .ok_or_else(|| Error::format(format!("`as_int` is not an integer: {n}"))),
        ("as_expr", e) => SymExpr::parse_srepr(
            field(e, "expr_str")?
                .as_str()
                .ok_or_else(|| Error::format("`expr_str` is not a string"))?,
        ),
        (tag, _) => Err(Error::format(format!("unexpected SymInt `{tag}`"))),
    }
}

/// A static `SymInt`; a symbolic one is rejected (weights and strides).
pub(crate) fn sym_int(v: &Value) -> Result<i64> {
    match union(v)? {
        ("as_int", n) => n
            .as_i64()
            .ok_or_else(|| Error::format(format!("`as_int` is not an integer: {n}"))),
        ("as_expr", e) => Err(Error::unsupported(format!(
            "dynamic shape `{}`: only static shapes are supported (export without dynamic_shapes)",
            e.get("expr_str").and_then(Value::as_str).unwrap_or("?")
        ))),
        (tag, _) => Err(Error::format(format!("unexpected SymInt `{tag}`"))),
    }
}

pub(crate) fn sym_ints(v: &Value) -> Result<Vec<i64>> {
    v.as_array()
        .ok_or_else(|| Error::format("expected a list of SymInts"))?
        .iter()
        .map(sym_int)
        .collect()
}

/// `(dtype, sizes)` of a `TensorMeta`.
/// The largest tensor a `.pt2` may declare (a weight, an input or an
/// intermediate): as large as the runtime's default arena limit.
pub const MAX_TENSOR_BYTES: u64 = 16 << 30;

/// A static tensor's `(dtype, sizes)`.
pub(crate) fn tensor_meta(meta: &Value) -> Result<(DType, Vec<usize>)> {
    let (dtype, sizes, sym) = sym_tensor_meta(meta, &SymRanges::new())?;
    match sym {
        None => Ok((dtype, sizes)),
        Some(_) => Err(Error::unsupported("a dynamic shape here (only static)")),
    }
}

/// `(dtype, sizes, symbolic sizes)` of a `TensorMeta`: the sizes at their
/// upper bounds over `ranges`, and the symbolic ones when any is not a
/// constant.
pub(crate) fn sym_tensor_meta(
    meta: &Value,
    ranges: &SymRanges,
) -> Result<(DType, Vec<usize>, Option<Vec<SymExpr>>)> {
    let code = field(meta, "dtype")?
        .as_i64()
        .ok_or_else(|| Error::format("`dtype` is not an integer"))?;
    let dtype = DType::from_torch_serde(code)?;
    let sym = field(meta, "sizes")?
        .as_array()
        .ok_or_else(|| Error::format("expected a list of SymInts"))?
        .iter()
        .map(sym_size)
        .collect::<Result<Vec<SymExpr>>>()?;
    let sizes = sym
        .iter()
        .map(|s| match s.as_const() {
            Some(n) if n < 0 => Err(Error::format(format!("negative size {n}"))),
            _ => s.upper_bound(ranges),
        })
        .collect::<Result<Vec<usize>>>()?;
    let sym = sym.iter().any(|s| s.as_const().is_none()).then_some(sym);
    // Refused here, before any tensor of this shape is allocated.
    let bytes = sizes
        .iter()
        .try_fold(dtype.size() as u64, |acc, &s| acc.checked_mul(s as u64));
    if bytes.is_none_or(|b| b > MAX_TENSOR_BYTES) {
        return Err(Error::limit(format!(
            "{dtype} tensor of sizes {sizes:?} exceeds the limit of {MAX_TENSOR_BYTES} bytes a tensor"
        )));
    }
    if let Some(layout) = meta.get("layout").and_then(Value::as_i64) {
        if layout != 7 {
            return Err(Error::unsupported(format!(
                "tensor layout {layout} (only strided tensors are supported)"
            )));
        }
    }
    Ok((dtype, sizes, sym))
}

/// Whether a `TensorMeta` describes a dense tensor: contiguous strides and
/// storage offset 0, so its storage holds exactly its elements in order.
pub(crate) fn is_dense(meta: &Value, sizes: &[usize]) -> bool {
    let offset = meta.get("storage_offset").map(sym_int);
    matches!(offset, Some(Ok(0))) && is_contiguous(meta, sizes)
}

/// Whether a `TensorMeta` has contiguous strides (at any storage offset):
/// what `Tensor.is_contiguous()` answers.
pub(crate) fn is_contiguous(meta: &Value, sizes: &[usize]) -> bool {
    let Some(Ok(strides)) = meta.get("strides").map(sym_ints) else {
        return false;
    };
    let mut want = 1i64;
    for (&s, &n) in strides.iter().zip(sizes).rev() {
        // the stride of a dim of size 1 is never used
        if n != 1 && s != want {
            return false;
        }
        want *= n as i64;
    }
    strides.len() == sizes.len()
}

/// A float as the serde writes it (non-finite values are strings).
pub(crate) fn float(v: &Value) -> Result<f64> {
    match v {
        Value::Number(n) => n
            .as_f64()
            .ok_or_else(|| Error::format(format!("bad number {n}"))),
        Value::String(s) => match s.as_str() {
            "Infinity" => Ok(f64::INFINITY),
            "-Infinity" => Ok(f64::NEG_INFINITY),
            "NaN" => Ok(f64::NAN),
            _ => Err(Error::format(format!("bad float `{s}`"))),
        },
        _ => Err(Error::format(format!("expected a float, got {}", short(v)))),
    }
}

/// The named arguments of one node; arguments left at their defaults are
/// absent, so every getter takes the schema default.
pub(crate) struct Args<'a> {
    map: HashMap<&'a str, &'a Value>,
    /// The program's SymInt values, by name, with their upper bounds.
    syms: &'a SymInts,
    /// Set when an argument named a SymInt (read at its upper bound).
    read_sym: Cell<bool>,
}

/// The SymInt values of a program (`sym_int_values`): name → (expression,
/// upper bound).
pub(crate) type SymInts = HashMap<String, (SymExpr, i64)>;

impl<'a> Args<'a> {
    pub fn new(inputs: &'a Value, syms: &'a SymInts) -> Result<Args<'a>> {
        let list = inputs
            .as_array()
            .ok_or_else(|| Error::format("node `inputs` is not a list"))?;
        let mut map = HashMap::new();
        for a in list {
            let name = field(a, "name")?
                .as_str()
                .ok_or_else(|| Error::format("argument name is not a string"))?;
            map.insert(name, field(a, "arg")?);
        }
        Ok(Args {
            map,
            syms,
            read_sym: Cell::new(false),
        })
    }

    /// Whether an argument read so far named a SymInt.
    pub fn read_sym(&self) -> bool {
        self.read_sym.get()
    }

    /// Undo the mark of a SymInt read that the lowering handled at run time.
    pub fn set_read_sym(&self, read: bool) {
        self.read_sym.set(read);
    }

    /// An int or `SymIntArgument` (`{as_name}` reads the SymInt at its
    /// upper bound, the size the graph is planned at).
    fn int_value(&self, v: &Value) -> Result<i64> {
        if let Some(name) = v.get("as_name").and_then(Value::as_str) {
            let (_, ub) = self.syms.get(name).ok_or_else(|| {
                Error::format(format!("symbolic int `{name}` is not in sym_int_values"))
            })?;
            self.read_sym.set(true);
            return Ok(*ub);
        }
        unwrap_sym(v)
            .as_i64()
            .ok_or_else(|| Error::format(format!("expected an int, got {}", short(v))))
    }

    /// The argument's union, or `None` when absent or `as_none`.
    pub fn get(&self, name: &str) -> Result<Option<(&'a str, &'a Value)>> {
        match self.map.get(name) {
            None => Ok(None),
            Some(v) => {
                let (tag, payload) =
                    union(v).map_err(|e| e.context(format!("argument `{name}`")))?;
                Ok(if tag == "as_none" {
                    None
                } else {
                    Some((tag, payload))
                })
            }
        }
    }

    fn bad(name: &str, expected: &str, tag: &str) -> Error {
        Error::format(format!(
            "argument `{name}`: expected {expected}, got `{tag}`"
        ))
    }

    /// A tensor argument's value name.
    pub fn tensor_name(&self, name: &str) -> Result<Option<&'a str>> {
        match self.get(name)? {
            None => Ok(None),
            Some(("as_tensor" | "as_optional_tensor", v)) => tensor_ref(v).map(Some),
            Some((tag, _)) => Err(Self::bad(name, "a tensor", tag)),
        }
    }

    /// A list of optional tensors (`as_tensors` or `as_optional_tensors`).
    pub fn tensor_names(&self, name: &str) -> Result<Vec<Option<&'a str>>> {
        match self.get(name)? {
            None => Err(Error::format(format!("missing tensor list `{name}`"))),
            Some(("as_tensors" | "as_optional_tensors", Value::Array(items))) => items
                .iter()
                .map(|v| match v.get("as_none") {
                    Some(_) => Ok(None),
                    None => tensor_ref(v).map(Some),
                })
                .collect(),
            Some((tag, _)) => Err(Self::bad(name, "a tensor list", tag)),
        }
    }

    /// A Python scalar argument (`as_int`, `as_float`, `as_bool`).
    pub fn scalar(&self, name: &str) -> Result<Option<Scalar>> {
        match self.get(name)? {
            None => Ok(None),
            Some(("as_int" | "as_sym_int", v)) => Ok(Some(Scalar::Int(self.int_value(v)?))),
            Some(("as_sym_float", v)) if v.get("as_name").is_some() => Err(Error::unsupported(
                format!("argument `{name}`: a symbolic float"),
            )),
            Some(("as_float" | "as_sym_float", v)) => {
                Ok(Some(Scalar::Float(float(unwrap_sym(v))?)))
            }
            Some(("as_bool", v)) => Ok(Some(Scalar::Bool(
                v.as_bool().ok_or_else(|| Error::format("bad bool"))?,
            ))),
            Some((tag, _)) => Err(Self::bad(name, "a scalar", tag)),
        }
    }

    pub fn is_tensor(&self, name: &str) -> Result<bool> {
        Ok(matches!(
            self.get(name)?,
            Some(("as_tensor" | "as_optional_tensor", _))
        ))
    }

    pub fn int(&self, name: &str, default: i64) -> Result<i64> {
        Ok(self.opt_int(name)?.unwrap_or(default))
    }

    pub fn opt_int(&self, name: &str) -> Result<Option<i64>> {
        match self.scalar(name)? {
            None => Ok(None),
            Some(Scalar::Int(v)) => Ok(Some(v)),
            Some(Scalar::Bool(b)) => Ok(Some(b as i64)),
            Some(Scalar::Float(f)) => Err(Error::format(format!(
                "argument `{name}`: expected an int, got {f}"
            ))),
        }
    }

    pub fn float(&self, name: &str, default: f64) -> Result<f64> {
        Ok(self.opt_float(name)?.unwrap_or(default))
    }

    pub fn opt_float(&self, name: &str) -> Result<Option<f64>> {
        Ok(self.scalar(name)?.map(Scalar::to_f64))
    }

    pub fn bool(&self, name: &str, default: bool) -> Result<bool> {
        match self.scalar(name)? {
            None => Ok(default),
            Some(Scalar::Bool(b)) => Ok(b),
            Some(Scalar::Int(v)) => Ok(v != 0),
            Some(Scalar::Float(f)) => Err(Error::format(format!(
                "argument `{name}`: expected a bool, got {f}"
            ))),
        }
    }

    pub fn ints(&self, name: &str) -> Result<Option<Vec<i64>>> {
        match self.get(name)? {
            None => Ok(None),
            Some(("as_ints", Value::Array(items))) => items
                .iter()
                .map(|v| self.int_value(v))
                .collect::<Result<_>>()
                .map(Some),
            Some(("as_sym_ints", v)) => v
                .as_array()
                .ok_or_else(|| Error::format("bad as_sym_ints"))?
                .iter()
                .map(|v| self.int_value(v))
                .collect::<Result<_>>()
                .map(Some),
            Some(("as_int" | "as_sym_int", v)) => Ok(Some(vec![self.int_value(v)?])),
            Some((tag, _)) => Err(Self::bad(name, "a list of ints", tag)),
        }
        .map_err(|e: Error| e.context(format!("argument `{name}`")))
    }

    /// An int argument as a symbolic size (`None` when absent or `None`).
    pub fn sym_int(&self, name: &str) -> Result<Option<SymExpr>> {
        match self.get(name)? {
            None => Ok(None),
            Some(("as_sym_int", v)) if v.get("as_name").is_some() => {
                let n = v.get("as_name").and_then(Value::as_str).unwrap_or("");
                let (e, _) = self.syms.get(n).ok_or_else(|| {
                    Error::format(format!("symbolic int `{n}` is not in sym_int_values"))
                })?;
                self.read_sym.set(true);
                Ok(Some(e.clone()))
            }
            Some(_) => self.opt_int(name).map(|v| v.map(SymExpr::Const)),
        }
    }

    /// A list of ints as symbolic sizes (`None` when absent).
    pub fn sym_ints(&self, name: &str) -> Result<Option<Vec<SymExpr>>> {
        let items = match self.get(name)? {
            None => return Ok(None),
            Some(("as_ints" | "as_sym_ints", Value::Array(items))) => items,
            Some((tag, _)) => return Err(Self::bad(name, "a list of ints", tag)),
        };
        items
            .iter()
            .map(|v| match v.get("as_name").and_then(Value::as_str) {
                Some(n) => {
                    let (e, _) = self.syms.get(n).ok_or_else(|| {
                        Error::format(format!("symbolic int `{n}` is not in sym_int_values"))
                    })?;
                    self.read_sym.set(true);
                    Ok(e.clone())
                }
                None => self.int_value(v).map(SymExpr::Const),
            })
            .collect::<Result<_>>()
            .map(Some)
    }

    pub fn string(&self, name: &str) -> Result<Option<&'a str>> {
        match self.get(name)? {
            None => Ok(None),
            Some(("as_string", Value::String(s))) => Ok(Some(s.as_str())),
            Some((tag, _)) => Err(Self::bad(name, "a string", tag)),
        }
    }

    pub fn scalar_type(&self, name: &str) -> Result<Option<DType>> {
        match self.get(name)? {
            None => Ok(None),
            Some(("as_scalar_type", v)) => {
                DType::from_torch_serde(v.as_i64().ok_or_else(|| Error::format("bad scalar type"))?)
                    .map(Some)
            }
            Some((tag, _)) => Err(Self::bad(name, "a scalar type", tag)),
        }
    }
}

fn tensor_ref(v: &Value) -> Result<&str> {
    // `as_tensor {name}` inside optional-tensor unions, or a bare `{name}`
    let v = v.get("as_tensor").unwrap_or(v);
    field(v, "name")?
        .as_str()
        .ok_or_else(|| Error::format("tensor name is not a string"))
}

/// `SymIntArgument` / `SymFloatArgument` are `{as_int|as_float: …}` or `{as_name}`.
fn unwrap_sym(v: &Value) -> &Value {
    v.get("as_int").or_else(|| v.get("as_float")).unwrap_or(v)
}
