//! Ops that move elements, for every dtype: reshape and identity (one
//! copy), the view ops (a strided copy) and `cat` (blocks in turn).

use etmetal_core::Op;

use crate::layout::strided_view;
use crate::strided::copy_view;
use crate::view::{View, ViewMut};

/// The only input, when it has the output's dtype.
fn single<'a>(inputs: &[Option<View<'a>>], out: &ViewMut) -> Option<View<'a>> {
    match inputs {
        [Some(x)] if x.dtype == out.dtype => Some(*x),
        _ => None,
    }
}

pub fn reshape(op: &Op, inputs: &[Option<View>], out: &mut ViewMut) -> bool {
    let Some(x) = single(inputs, out) else {
        return false;
    };
    let same = match op {
        Op::Reshape { shape } => shape.as_slice() == out.shape && x.numel() == out.numel(),
        _ => x.shape == out.shape,
    };
    if same {
        out.bytes.copy_from_slice(x.bytes);
    }
    same
}

pub fn view(op: &Op, inputs: &[Option<View>], out: &mut ViewMut) -> bool {
    let Some(x) = single(inputs, out) else {
        return false;
    };
    match strided_view(op, x.shape) {
        Some(Ok(v)) if v.shape == out.shape => {
            copy_view(
                x.bytes,
                out.bytes,
                x.dtype.size(),
                &v.shape,
                &v.strides,
                v.offset,
            );
            true
        }
        _ => false,
    }
}

pub fn cat(dim: usize, inputs: &[Option<View>], out: &mut ViewMut) -> bool {
    let fits = |x: &View| {
        x.dtype == out.dtype
            && x.shape.len() == out.shape.len()
            && (0..x.shape.len()).all(|d| d == dim || x.shape[d] == out.shape[d])
    };
    let Some(parts) = inputs
        .iter()
        .map(|x| x.filter(fits))
        .collect::<Option<Vec<_>>>()
    else {
        return false;
    };
    let total: usize = parts.iter().map(|x| x.shape[dim]).sum();
    if dim >= out.shape.len() || total != out.shape[dim] {
        return false;
    }
    let outer: usize = out.shape[..dim].iter().product();
    let mut at = 0;
    for o in 0..outer {
        for x in &parts {
            let chunk = x.bytes.len() / outer;
            out.bytes[at..at + chunk].copy_from_slice(&x.bytes[o * chunk..(o + 1) * chunk]);
            at += chunk;
        }
    }
    true
}
