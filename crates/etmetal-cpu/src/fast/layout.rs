//! Ops that move elements, for every dtype: reshape, identity and casts
//! to the same dtype (one copy), the view ops (a strided copy), `cat`
//! (blocks in turn), and `index_select`/`embedding` (rows by index).

use etmetal_core::{DType, Op};

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
        Op::Cast { dtype } => *dtype == x.dtype && x.shape == out.shape,
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

/// `index_select(x, dim, idx)`: for each outer index, the blocks of
/// `x[.., idx[j], ..]` in turn. Out-of-range or non-i64 indices are the
/// reference's (it reports them).
pub fn index_select(dim: usize, inputs: &[Option<View>], out: &mut ViewMut) -> bool {
    let [Some(x), Some(idx)] = inputs else {
        return false;
    };
    if x.dtype != out.dtype || dim >= x.shape.len() || idx.shape.len() > 1 {
        return false;
    }
    let mut shape = x.shape.to_vec();
    shape[dim] = idx.numel();
    if shape != out.shape {
        return false;
    }
    let block: usize = x.shape[dim + 1..].iter().product::<usize>() * x.dtype.size();
    let outer: usize = x.shape[..dim].iter().product();
    take_blocks(x.bytes, x.shape[dim], block, outer, idx, out.bytes)
}

/// `embedding(weight, ids)`: row `ids[i]` of the `[rows, dim]` weight for
/// each id, in the ids' shape.
pub fn embedding(inputs: &[Option<View>], out: &mut ViewMut) -> bool {
    let [Some(w), Some(ids)] = inputs else {
        return false;
    };
    let &[rows, d] = w.shape else {
        return false;
    };
    if w.dtype != out.dtype || out.shape != [ids.shape, &[d]].concat() {
        return false;
    }
    take_blocks(w.bytes, rows, d * w.dtype.size(), 1, ids, out.bytes)
}

/// For each of `outer` groups of `count` blocks of `block` bytes in `src`,
/// the blocks `idx` names, in turn, into `dst`; `false` (nothing written)
/// unless every index is an i64 in `0..count`.
fn take_blocks(
    src: &[u8],
    count: usize,
    block: usize,
    outer: usize,
    idx: &View,
    dst: &mut [u8],
) -> bool {
    if idx.dtype != DType::I64 {
        return false;
    }
    let Ok(ids) = bytemuck::try_cast_slice::<u8, i64>(idx.bytes) else {
        return false;
    };
    if ids.iter().any(|&i| i < 0 || i as usize >= count) {
        return false;
    }
    let mut at = 0;
    for o in 0..outer {
        for &i in ids {
            let from = (o * count + i as usize) * block;
            dst[at..at + block].copy_from_slice(&src[from..from + block]);
            at += block;
        }
    }
    true
}
