//! Where a program runs: the one rule for "does this file need a GPU, and
//! is there one", shared by `etmetal run --device` and the Python
//! `Program(path, device)`.
//!
//! A `.pte` without `EtMetalBackend` delegates runs on the CPU kernels
//! whatever is asked. One with them needs an adapter: none (or `cpu`) is an
//! error. A `.pt2` runs on the GPU when there is one (compiled in memory
//! for it) and otherwise, with `auto`, on the CPU with a warning. An
//! adapter kind asked for by name and absent is an error, never a fallback.

use std::path::Path;
use std::sync::Arc;

use etmetal_core::{Error, Result};
use etmetal_metal_runtime::{describe, select_adapter, DeviceChoice, MetalBackend, BACKEND_ID};
use etmetal_pte::PteFile;

/// Which tensor-core (cooperative-matrix) forms of f16/bf16 matrix
/// products GPU delegates may run (README: Tensor cores). A form runs only
/// where it measured faster than the portable kernel on the device (at the
/// first load, then cached on disk), so the default takes them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum TensorCores {
    /// The forms that have run on a real GPU (16×16 f16 matrices in
    /// subgroups of 32: NVIDIA through Vulkan), where the GPU offers them.
    #[default]
    Auto,
    /// Also forms no real GPU has run yet (Apple's 8×8 f32 matrices).
    All,
    /// Never: every kernel runs its portable form.
    Off,
}

impl TensorCores {
    /// The setting `name` (as `etmetal run --coop` takes it: `auto`, `all`
    /// or `off`), `what` (`coop=`) naming it in the error.
    pub fn parse(name: &str, what: &str) -> Result<TensorCores> {
        <TensorCores as clap::ValueEnum>::from_str(name, false)
            .map_err(|_| Error::invalid_input(format!("{what}`{name}`: expected auto, all or off")))
    }

    /// The setting `ETMETAL_COOP` names, else the default: for the C API,
    /// which takes no flags, and Python's `load` without `coop`.
    pub fn from_env() -> Result<TensorCores> {
        match std::env::var("ETMETAL_COOP") {
            Err(_) => Ok(TensorCores::default()),
            Ok(name) => TensorCores::parse(&name, "ETMETAL_COOP="),
        }
    }
}

/// The device a user asks for.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum DevicePreference {
    /// Metal, then a discrete GPU, then any adapter; the CPU where there is
    /// none and the program allows it.
    #[default]
    Auto,
    Metal,
    Vulkan,
    Dx12,
    /// The CPU kernels only.
    Cpu,
}

impl DevicePreference {
    /// `auto`, `metal`, `vulkan`, `dx12` or `cpu`.
    pub fn parse(name: &str) -> Result<DevicePreference> {
        Ok(match name {
            "auto" => DevicePreference::Auto,
            "metal" => DevicePreference::Metal,
            "vulkan" => DevicePreference::Vulkan,
            "dx12" => DevicePreference::Dx12,
            "cpu" => DevicePreference::Cpu,
            other => {
                return Err(Error::invalid_input(format!(
                    "device `{other}`: expected auto, metal, vulkan, dx12 or cpu"
                )))
            }
        })
    }

    /// The GPU API asked for; `None` for `cpu`.
    fn gpu(self) -> Option<DeviceChoice> {
        match self {
            DevicePreference::Auto => Some(DeviceChoice::Auto),
            DevicePreference::Metal => Some(DeviceChoice::Metal),
            DevicePreference::Vulkan => Some(DeviceChoice::Vulkan),
            DevicePreference::Dx12 => Some(DeviceChoice::Dx12),
            DevicePreference::Cpu => None,
        }
    }
}

/// What is to run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Workload {
    /// A `.pt2`: compiled for the GPU in memory, or interpreted on the CPU.
    Pt2,
    /// A `.pte` with this many `EtMetalBackend` delegates.
    Pte { gpu_delegates: usize },
}

impl Workload {
    /// The workload of a loaded `.pte`.
    pub fn of_pte(file: &PteFile) -> Workload {
        let gpu_delegates = file
            .program
            .execution_plan
            .iter()
            .flat_map(|p| &p.delegates)
            .filter(|d| d.id == BACKEND_ID)
            .count();
        Workload::Pte { gpu_delegates }
    }
}

/// The GPU a run uses.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Gpu {
    pub choice: DeviceChoice,
    /// The adapter found, as `describe` names it.
    pub adapter: String,
}

/// Where a run goes, and the one line to tell the user about it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Placement {
    /// `None`: the CPU kernels only.
    pub gpu: Option<Gpu>,
    /// A fallback or an ignored request worth a warning (no prefix).
    pub warning: Option<String>,
}

impl Placement {
    /// The backend for the GPU delegates, running the tensor-core forms
    /// `tensor_cores` allows.
    pub fn backend(&self, tensor_cores: TensorCores) -> Option<Arc<MetalBackend>> {
        self.gpu.as_ref().map(|g| {
            Arc::new(
                MetalBackend::new(g.choice)
                    .with_cooperative_matrix(tensor_cores != TensorCores::Off)
                    .with_untested_forms(tensor_cores == TensorCores::All),
            )
        })
    }
}

/// Where `workload` (the file at `path`, named in messages) runs when the
/// user asks for `preference`; an error when it cannot run there.
pub fn choose(preference: DevicePreference, path: &Path, workload: Workload) -> Result<Placement> {
    let Some(choice) = preference.gpu() else {
        return on_the_cpu(path, workload, None);
    };
    if workload == (Workload::Pte { gpu_delegates: 0 }) {
        let warning = (preference != DevicePreference::Auto).then(|| {
            format!(
                "{} has no GPU delegates and runs on the cpu (--device {} is not used)",
                path.display(),
                choice.name()
            )
        });
        return Ok(Placement { gpu: None, warning });
    }
    match select_adapter(choice) {
        Ok((_, adapter)) => Ok(Placement {
            gpu: Some(Gpu {
                choice,
                adapter: describe(&adapter.get_info()),
            }),
            warning: None,
        }),
        Err(e) if preference == DevicePreference::Auto => {
            on_the_cpu(path, workload, Some(e.message()))
        }
        Err(e) => Err(e),
    }
}

/// No GPU for this run (`no_adapter` says why, `None` when the user asked
/// for the CPU): fine for a `.pt2` (interpreted on the CPU) and a `.pte`
/// without GPU delegates, an error for one whose delegates need a GPU.
fn on_the_cpu(path: &Path, workload: Workload, no_adapter: Option<&str>) -> Result<Placement> {
    let delegated = match workload {
        Workload::Pte { gpu_delegates } => gpu_delegates,
        Workload::Pt2 => 0,
    };
    if delegated == 0 {
        let warning = match (workload, no_adapter) {
            (Workload::Pt2, Some(why)) => Some(format!("no GPU ({why}); running on the cpu")),
            _ => None,
        };
        return Ok(Placement { gpu: None, warning });
    }
    Err(Error::unsupported(format!(
        "{} delegates {delegated} partition(s) to {BACKEND_ID}, which needs a GPU ({}); \
         compile with --backend cpu to run on the CPU",
        path.display(),
        no_adapter.unwrap_or("--device cpu was given"),
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cpu_runs_what_has_no_gpu_delegates_and_refuses_what_has() {
        let path = Path::new("m.pte");
        for workload in [Workload::Pt2, Workload::Pte { gpu_delegates: 0 }] {
            let p = choose(DevicePreference::Cpu, path, workload).unwrap();
            assert_eq!(p.gpu, None, "{workload:?}");
            assert_eq!(p.warning, None, "{workload:?}");
        }
        let e = choose(
            DevicePreference::Cpu,
            path,
            Workload::Pte { gpu_delegates: 2 },
        )
        .unwrap_err();
        assert!(e.is_user_error());
        let e = e.to_string();
        assert!(
            e.contains("m.pte delegates 2 partition(s) to EtMetalBackend, which needs a GPU"),
            "{e}"
        );
    }

    #[test]
    fn a_gpu_asked_for_a_file_without_delegates_is_not_used() {
        let p = choose(
            DevicePreference::Vulkan,
            Path::new("m.pte"),
            Workload::Pte { gpu_delegates: 0 },
        )
        .unwrap();
        assert_eq!(p.gpu, None);
        let warning = p.warning.clone().unwrap();
        assert!(warning.contains("--device vulkan is not used"), "{warning}");
        assert!(p.backend(TensorCores::default()).is_none());
    }

    #[test]
    fn device_names_parse_and_others_are_refused() {
        assert_eq!(
            DevicePreference::parse("dx12").unwrap(),
            DevicePreference::Dx12
        );
        let e = DevicePreference::parse("tpu").unwrap_err().to_string();
        assert!(e.contains("device `tpu`"), "{e}");
    }
}
