//! `im2col` and `col2im` (`F.unfold` / `F.fold`, MobileViTV2's patches) as
//! pads, strided slices, concatenations and sums of existing ops.

use etmetal_core::{BinaryOp, Error, Op, Result};

use super::{Ctx, Lowerer};
use crate::ir::ValueId;

/// One spatial dim of a sliding window: kernel, dilation, padding, stride.
#[derive(Clone, Copy)]
struct Window {
    k: usize,
    d: usize,
    p: usize,
    s: usize,
}

impl Window {
    /// Windows along an input of `n`.
    fn count(&self, n: usize, what: &str) -> Result<usize> {
        let span = self.d * (self.k - 1) + 1;
        let padded = n + 2 * self.p;
        if self.k == 0 || self.d == 0 || self.s == 0 || padded < span {
            return Err(Error::shape(format!(
                "{what}: kernel {}, dilation {}, stride {} over {n} padded by {}",
                self.k, self.d, self.s, self.p
            )));
        }
        Ok((padded - span) / self.s + 1)
    }
}

impl Lowerer<'_> {
    fn windows(&self, c: &Ctx) -> Result<[Window; 2]> {
        let k = self.conv_attr(c, "kernel_size", 2, 1)?;
        let d = self.conv_attr(c, "dilation", 2, 1)?;
        let p = self.conv_attr(c, "padding", 2, 0)?;
        let s = self.conv_attr(c, "stride", 2, 1)?;
        if [&k, &d, &p, &s].iter().any(|v| v.len() != 2) {
            return Err(Error::format(format!(
                "a 2-D window of kernel {k:?}, dilation {d:?}, padding {p:?}, stride {s:?}"
            )));
        }
        Ok([0, 1].map(|i| Window {
            k: k[i],
            d: d[i],
            p: p[i],
            s: s[i],
        }))
    }

    fn strided(
        &mut self,
        c: &Ctx,
        x: ValueId,
        dim: usize,
        start: usize,
        count: usize,
        step: usize,
    ) -> Result<ValueId> {
        let end = start + step * (count - 1) + 1;
        self.emit1(
            c,
            Op::Slice {
                dim,
                start,
                end,
                step,
            },
            vec![Some(x)],
        )
    }

    /// `im2col` / `col2im`; `Ok(false)` for other names.
    pub(super) fn fold(&mut self, c: &Ctx, name: &str) -> Result<bool> {
        let unfold = match name {
            "im2col" => true,
            "col2im" => false,
            _ => return Ok(false),
        };
        let x = self.t(c, "self")?;
        let [wh, ww] = self.windows(c)?;
        let shape = self.shape(x);
        // batched: [N, C, H, W] (im2col) / [N, C*kh*kw, L] (col2im)
        let batched = shape.len() == if unfold { 4 } else { 3 };
        let x = if batched {
            x
        } else {
            self.reshaped(c, x, [&[1], &shape[..]].concat())?
        };
        let shape = self.shape(x);
        let taps = wh.k * ww.k;
        let out = if unfold {
            let &[n, ch, h, w] = &shape[..] else {
                return Err(Error::shape(format!("im2col of {shape:?}")));
            };
            let (oh, ow) = (wh.count(h, name)?, ww.count(w, name)?);
            let pad = vec![ww.p as i64, ww.p as i64, wh.p as i64, wh.p as i64];
            let padded = self.emit1(c, Op::ConstantPad { pad, value: 0.0 }, vec![Some(x)])?;
            let mut parts = Vec::with_capacity(taps);
            for i in 0..wh.k {
                for j in 0..ww.k {
                    let v = self.strided(c, padded, 2, i * wh.d, oh, wh.s)?;
                    let v = self.strided(c, v, 3, j * ww.d, ow, ww.s)?;
                    parts.push(Some(self.reshaped(c, v, vec![n, ch, 1, oh * ow])?));
                }
            }
            let v = self.emit1(c, Op::Cat { dim: 2 }, parts)?;
            self.reshaped(c, v, vec![n, ch * taps, oh * ow])?
        } else {
            let size = super::usizes(&self.req_ints(c, "output_size")?, "output_size")?;
            let (&[n, rows, l], &[h, w]) = (&shape[..], &size[..]) else {
                return Err(Error::shape(format!("col2im of {shape:?} to {size:?}")));
            };
            let (oh, ow) = (wh.count(h, name)?, ww.count(w, name)?);
            if rows % taps != 0 || l != oh * ow {
                return Err(Error::shape(format!(
                    "col2im of {shape:?} to {size:?}: want [N, C*{taps}, {}]",
                    oh * ow
                )));
            }
            let ch = rows / taps;
            let (hp, wp) = (h + 2 * wh.p, w + 2 * ww.p);
            let cols = self.reshaped(c, x, vec![n, ch, taps, oh, ow])?;
            let mut sum: Option<ValueId> = None;
            for i in 0..wh.k {
                for j in 0..ww.k {
                    let v = self.emit1(
                        c,
                        Op::Select {
                            dim: 2,
                            index: i * ww.k + j,
                        },
                        vec![Some(cols)],
                    )?;
                    // each window's value at (i*dh + a*sh, j*dw + b*sw) of the padded image
                    let v = self.reshaped(c, v, vec![n, ch, oh, 1, ow, 1])?;
                    let pad = vec![0, ww.s as i64 - 1, 0, 0, 0, wh.s as i64 - 1];
                    let v = self.emit1(c, Op::ConstantPad { pad, value: 0.0 }, vec![Some(v)])?;
                    let v = self.reshaped(c, v, vec![n, ch, oh * wh.s, ow * ww.s])?;
                    let (eh, ew) = ((oh - 1) * wh.s + 1, (ow - 1) * ww.s + 1);
                    let v = self.strided(c, v, 2, 0, eh, 1)?;
                    let v = self.strided(c, v, 3, 0, ew, 1)?;
                    let (top, left) = (i * wh.d, j * ww.d);
                    let pad = [left, wp - left - ew, top, hp - top - eh]
                        .map(|p| p as i64)
                        .to_vec();
                    let v = self.emit1(c, Op::ConstantPad { pad, value: 0.0 }, vec![Some(v)])?;
                    sum = Some(match sum {
                        None => v,
                        Some(acc) => {
                            self.emit1(c, Op::Binary(BinaryOp::Add), vec![Some(acc), Some(v)])?
                        }
                    });
                }
            }
            let v = sum.ok_or_else(|| Error::shape("col2im with an empty kernel"))?;
            let v = self.strided(c, v, 2, wh.p, h, 1)?;
            self.strided(c, v, 3, ww.p, w, 1)?
        };
        let out = if batched {
            out
        } else {
            let s = self.shape(out)[1..].to_vec();
            self.reshaped(c, out, s)?
        };
        self.bind(c, 0, out)?;
        Ok(true)
    }
}
