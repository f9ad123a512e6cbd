//! Every generated kernel is parsed and validated by naga at compile time,
//! and translated to MSL with a real binding map (binding i → buffer slot
//! i), so the Metal path never meets a kernel that was not checked here.
//!
//! Kernels of an alternative (see `payload::Alternative`) may also use
//! cooperative matrices and subgroup builtins. naga writes MSL for them too,
//! but its `coop_mat16x16` becomes `simdgroup_half16x16`, a type Metal does
//! not have (Apple GPUs have 8×8 simdgroup matrices): that MSL is stored
//! for inspection and is not valid Metal; such an alternative is never
//! chosen on an Apple GPU, which reports no 16×16 configuration.

use etmetal_core::{Error, Result};
use naga::back::msl;
use naga::valid::{Capabilities, ValidationFlags, Validator};

/// The MSL of `wgsl` (entry point `main`, `bindings` storage buffers), or
/// an error naming `kernel` with naga's diagnostic; `coop` allows
/// cooperative matrices and subgroup builtins.
pub(crate) fn validate_and_translate(
    kernel: &str,
    wgsl: &str,
    bindings: &[bool],
    coop: bool,
    sizes: bool,
) -> Result<String> {
    let module = naga::front::wgsl::parse_str(wgsl).map_err(|e| {
        Error::internal(format!(
            "kernel `{kernel}` is not valid WGSL: {}\n{wgsl}",
            e.emit_to_string(wgsl)
        ))
    })?;
    let mut capabilities = Capabilities::SHADER_FLOAT16;
    if coop {
        capabilities |= Capabilities::COOPERATIVE_MATRIX | Capabilities::SUBGROUP;
    }
    let info = Validator::new(ValidationFlags::all(), capabilities)
        .validate(&module)
        .map_err(|e| {
            Error::internal(format!(
                "kernel `{kernel}` fails naga validation: {}\n{wgsl}",
                e.emit_to_string(wgsl)
            ))
        })?;
    // the sizes uniform (payload 1.3) binds after the storage buffers
    let uniform = sizes.then_some(false);
    let resources = bindings
        .iter()
        .copied()
        .chain(uniform)
        .enumerate()
        .map(|(i, writable)| {
            (
                naga::ResourceBinding {
                    group: 0,
                    binding: i as u32,
                },
                msl::BindTarget {
                    buffer: Some(i as u8),
                    mutable: writable,
                    ..Default::default()
                },
            )
        })
        .collect();
    let slots = bindings.len() + usize::from(sizes);
    let options = msl::Options {
        lang_version: (2, 4),
        per_entry_point_map: [(
            "main".to_string(),
            msl::EntryPointResources {
                resources,
                // runtime-sized arrays need their lengths in a buffer after the bindings
                sizes_buffer: Some(slots as u8),
                ..Default::default()
            },
        )]
        .into_iter()
        .collect(),
        fake_missing_bindings: false,
        ..Default::default()
    };
    let (msl, _) = msl::write_string(&module, &info, &options, &msl::PipelineOptions::default())
        .map_err(|e| {
            Error::internal(format!(
                "kernel `{kernel}`: naga's MSL back end failed: {e}"
            ))
        })?;
    Ok(msl)
}
