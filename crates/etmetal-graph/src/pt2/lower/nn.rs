//! Neural-network layers: norm layers, convolutions, pools and
//! scaled-dot-product attention.

use etmetal_core::{AvgPoolAttrs, Error, MaxPoolAttrs, Op, Result};

use super::{Ctx, Lowerer};

impl Lowerer<'_> {
    /// Lower `c` (ATen op `name`, overload `overload`) if it is a norm layer, convolution, pool or attention;
    /// `false` when it is not.
    pub(super) fn lower_nn(&mut self, c: &Ctx, name: &str, overload: &str) -> Result<bool> {
        let a = &c.args;
        let lowered = match (name, overload) {
            ("layer_norm" | "native_layer_norm", "default") => {
                let x = self.t(c, "input")?;
                let normalized_dims = self.req_ints(c, "normalized_shape")?.len();
                let (w, b) = (self.opt_t(c, "weight")?, self.opt_t(c, "bias")?);
                let eps = a.float("eps", 1e-5)?;
                self.finish(
                    c,
                    Op::LayerNorm {
                        normalized_dims,
                        eps,
                    },
                    vec![Some(x), w, b],
                )
            }
            ("rms_norm", "default") => {
                let x = self.t(c, "input")?;
                let normalized_dims = self.req_ints(c, "normalized_shape")?.len();
                let w = self.opt_t(c, "weight")?;
                self.finish(
                    c,
                    Op::RmsNorm {
                        normalized_dims,
                        eps: a.opt_float("eps")?,
                    },
                    vec![Some(x), w],
                )
            }
            ("batch_norm", "default") | ("_native_batch_norm_legit_no_training", "default") => {
                if a.bool("training", false)? {
                    return Err(Error::unsupported("batch norm in training mode"));
                }
                let x = self.t(c, "input")?;
                let (w, b) = (self.opt_t(c, "weight")?, self.opt_t(c, "bias")?);
                let mean = self.t(c, "running_mean")?;
                let var = self.t(c, "running_var")?;
                let eps = a.float("eps", 1e-5)?;
                self.finish(
                    c,
                    Op::BatchNorm { eps },
                    vec![Some(x), w, b, Some(mean), Some(var)],
                )
            }
            ("group_norm" | "native_group_norm", "default") => {
                let x = self.t(c, "input")?;
                let groups = a
                    .opt_int("num_groups")?
                    .or(a.opt_int("group")?)
                    .unwrap_or(1);
                let groups =
                    usize::try_from(groups).map_err(|_| Error::format("negative groups"))?;
                let (w, b) = (self.opt_t(c, "weight")?, self.opt_t(c, "bias")?);
                self.finish(
                    c,
                    Op::GroupNorm {
                        groups,
                        eps: a.float("eps", 1e-5)?,
                    },
                    vec![Some(x), w, b],
                )
            }
            ("conv1d" | "conv2d" | "conv3d" | "convolution", "default" | "padding") => {
                self.convolution(c, false)
            }
            ("conv_transpose1d" | "conv_transpose2d", "default" | "input") => {
                self.convolution(c, true)
            }
            ("max_pool1d" | "max_pool2d" | "max_pool2d_with_indices", "default") => {
                let x = self.t(c, "self")?;
                let n = self.req_ints(c, "kernel_size")?.len();
                let dilation = self.conv_attr(c, "dilation", n, 1)?;
                let (kernel, stride, padding) = self.pool_attrs(c, x, Some(&dilation))?;
                let with_indices = name.ends_with("with_indices") && self.is_used(c, 1);
                let op = Op::MaxPool(MaxPoolAttrs {
                    kernel,
                    stride,
                    padding,
                    dilation,
                    ceil_mode: a.bool("ceil_mode", false)?,
                    with_indices,
                });
                self.finish(c, op, vec![Some(x)])
            }
            ("avg_pool1d" | "avg_pool2d", "default") => {
                let x = self.t(c, "self")?;
                let (kernel, stride, padding) = self.pool_attrs(c, x, None)?;
                let op = Op::AvgPool(AvgPoolAttrs {
                    kernel,
                    stride,
                    padding,
                    ceil_mode: a.bool("ceil_mode", false)?,
                    count_include_pad: a.bool("count_include_pad", true)?,
                    divisor_override: a.opt_int("divisor_override")?,
                });
                self.finish(c, op, vec![Some(x)])
            }
            ("adaptive_avg_pool1d" | "adaptive_avg_pool2d" | "_adaptive_avg_pool2d", "default") => {
                let x = self.t(c, "self")?;
                let output_size = self.size_arg(c, "output_size")?;
                self.finish(c, Op::AdaptiveAvgPool { output_size }, vec![Some(x)])
            }
            ("scaled_dot_product_attention", "default") => {
                if a.float("dropout_p", 0.0)? != 0.0 {
                    return Err(Error::unsupported(
                        "scaled_dot_product_attention with dropout_p != 0",
                    ));
                }
                let (q, k, v) = (self.t(c, "query")?, self.t(c, "key")?, self.t(c, "value")?);
                let mask = self.opt_t(c, "attn_mask")?;
                let op = Op::Sdpa {
                    is_causal: a.bool("is_causal", false)?,
                    scale: a.opt_float("scale")?,
                    enable_gqa: a.bool("enable_gqa", false)?,
                };
                self.finish(c, op, vec![Some(q), Some(k), Some(v), mask])
            }
            _ => return Ok(false),
        };
        lowered.map(|()| true)
    }
}
