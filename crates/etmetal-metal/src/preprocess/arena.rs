//! Arena planning: every non-weight buffer gets an aligned range of one
//! arena, reused by buffers whose lifetimes (first to last dispatch that
//! binds them) do not overlap. Delegate inputs are live from the start,
//! outputs to the end, status buffers throughout; what a dispatch's
//! alternatives bind is live at that dispatch.

use etmetal_core::{Error, Result};

use super::buffers::{Buffers, Place};
use crate::payload::{Dispatch, ARENA_ALIGN};

pub(crate) struct ArenaPlan {
    /// `(arena, offset)` of each buffer; `None` for weights.
    pub offsets: Vec<Option<(usize, u64)>>,
    pub sizes: Vec<u64>,
}

pub(crate) fn plan(buffers: &Buffers, dispatches: &[Dispatch]) -> Result<ArenaPlan> {
    let n = buffers.list.len();
    let end = dispatches.len();
    let mut first = vec![usize::MAX; n];
    let mut last = vec![0usize; n];
    for (d, dispatch) in dispatches.iter().enumerate() {
        let alternatives = dispatch.alternatives.iter().flat_map(|a| &a.dispatches);
        for &b in std::iter::once(dispatch)
            .chain(alternatives)
            .flat_map(|x| &x.buffers)
        {
            first[b] = first[b].min(d);
            last[b] = last[b].max(d);
        }
    }
    let mut live: Vec<(usize, usize, u64, u64)> = vec![]; // (buffer, last, offset, bytes)
    let mut order: Vec<usize> = (0..n)
        .filter(|&b| !matches!(buffers.list[b].place, Place::Weight(_)))
        .collect();
    for &b in &order {
        match buffers.list[b].place {
            Place::Input(_) => first[b] = 0,
            Place::Output(_) => {
                first[b] = first[b].min(end);
                last[b] = end;
            }
            // zeroed before the first dispatch, read after the last
            Place::Status => {
                first[b] = 0;
                last[b] = end;
            }
            _ => {}
        }
    }
    order.sort_by_key(|&b| (first[b], b));
    let mut offsets = vec![None; n];
    let mut size = 0u64;
    for b in order {
        let desc = &buffers.list[b];
        let bytes = desc.gpu_bytes()?.next_multiple_of(ARENA_ALIGN);
        if first[b] == usize::MAX {
            // an intermediate no kernel binds (a value a store substitutes,
            // `kernels/glu.rs`): nothing reads or writes its bytes, so it
            // shares the arena's start with whatever lives there
            size = size.max(bytes);
            offsets[b] = Some((0, 0));
            continue;
        }
        live.retain(|&(_, l, _, _)| l >= first[b]);
        live.sort_by_key(|&(_, _, o, _)| o);
        // lowest gap that fits between the live ranges
        let mut offset = 0u64;
        for &(_, _, o, s) in &live {
            if offset + bytes <= o {
                break;
            }
            offset = offset.max(o + s);
        }
        let top = offset
            .checked_add(bytes)
            .ok_or_else(|| Error::limit(format!("arena offset of `{}` overflows", desc.name)))?;
        size = size.max(top);
        live.push((b, last[b], offset, bytes));
        offsets[b] = Some((0, offset));
    }
    Ok(ArenaPlan {
        offsets,
        sizes: vec![size.max(ARENA_ALIGN)],
    })
}
