//! The C API from C and C++, against the libraries this build made,
//! installed with `install.sh` and found through its `etmetal.pc`:
//! `examples/c/run_pte.c` (shared library) runs programs on the CPU and
//! on the GPU adapter (Mesa's lavapipe in CI), and its printed outputs
//! match those ExecuTorch's runtime or eager PyTorch stored beside the
//! fixtures; `tests/c/error_paths.cpp` (static library, AddressSanitizer
//! and UndefinedBehaviorSanitizer) checks the error paths.
//!
//! Needs a C and a C++ compiler (`cc`, `c++`), `pkg-config` and, for the
//! GPU case, an adapter: a missing one fails with a hint, never a skip
//! (`scripts/test.sh` installs them).

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::{Mutex, OnceLock};

use etmetal::compile::{compile, CompileOptions};
use etmetal_core::{npy, DType, Tensor};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// `target/<profile>`, above this test's `deps/`.
fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    exe.parent().and_then(Path::parent).unwrap().to_path_buf()
}

/// This profile's scratch directory (another profile's run may go on
/// beside it).
fn scratch() -> PathBuf {
    let profile = profile_dir().file_name().unwrap().to_owned();
    Path::new(env!("CARGO_TARGET_TMPDIR"))
        .join("etmetal-capi")
        .join(profile)
}

/// `target/<profile>` of this test, with `libetmetal_capi.{so,a}` built
/// there now: for integration tests cargo builds the crate's rlib only, so
/// the test asks cargo for the shared and static library of its own profile
/// and target directory (quick: the rest is built already).
fn build_dir() -> PathBuf {
    let dir = profile_dir();
    let profile = match dir.file_name().and_then(|n| n.to_str()) {
        Some("debug") => "dev".to_string(),
        Some(other) => other.to_string(),
        None => panic!("no profile directory at {}", dir.display()),
    };
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    run(
        Command::new(cargo)
            .args([
                "build",
                "--quiet",
                "-p",
                "etmetal-capi",
                "--lib",
                "--profile",
            ])
            .arg(&profile)
            .arg("--target-dir")
            .arg(dir.parent().unwrap())
            .current_dir(repo()),
        "cargo build -p etmetal-capi (the shared and static library)",
    );
    for lib in ["libetmetal_capi.a", shared_library()] {
        assert!(
            dir.join(lib).exists(),
            "{} is missing",
            dir.join(lib).display()
        );
    }
    dir
}

fn shared_library() -> &'static str {
    if cfg!(target_os = "macos") {
        "libetmetal_capi.dylib"
    } else {
        "libetmetal_capi.so"
    }
}

/// Run `cmd`; its output, or a panic with what it printed.
fn run(cmd: &mut Command, what: &str) -> Output {
    let out = cmd
        .output()
        .unwrap_or_else(|e| panic!("{what}: cannot start {cmd:?}: {e} (is it installed?)"));
    assert!(
        out.status.success(),
        "{what} failed ({}):\n{}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

fn pkg_config(prefix: &Path, args: &[&str]) -> Vec<String> {
    let out = run(
        Command::new("pkg-config")
            .args(args)
            .arg("etmetal")
            .env("PKG_CONFIG_PATH", prefix.join("lib/pkgconfig")),
        "pkg-config (apt-get install pkg-config)",
    );
    String::from_utf8(out.stdout)
        .unwrap()
        .split_whitespace()
        .map(String::from)
        .collect()
}

/// The installed prefix and the two programs, built once per process.
struct Built {
    prefix: PathBuf,
    run_pte: PathBuf,
    error_paths: PathBuf,
}

fn built() -> &'static Built {
    static BUILT: OnceLock<Built> = OnceLock::new();
    BUILT.get_or_init(|| {
        let dir = scratch();
        let prefix = dir.join("prefix");
        let _ = std::fs::remove_dir_all(&prefix);
        std::fs::create_dir_all(&dir).unwrap();
        run(
            Command::new("bash")
                .arg(repo().join("crates/etmetal-capi/install.sh"))
                .arg(&prefix)
                .arg(build_dir()),
            "install.sh",
        );
        // the example against the shared library, as pkg-config says
        let run_pte = dir.join("run_pte");
        let rpath = format!("-Wl,-rpath,{}", prefix.join("lib").display());
        run(
            Command::new("cc")
                .args(["-std=c11", "-Wall", "-Wextra", "-Werror", "-pedantic"])
                .arg(repo().join("examples/c/run_pte.c"))
                .args(pkg_config(&prefix, &["--cflags", "--libs"]))
                .arg(rpath)
                .arg("-o")
                .arg(&run_pte),
            "cc examples/c/run_pte.c",
        );
        // the error paths against the static library, under the sanitizers
        let error_paths = dir.join("error_paths");
        let static_lib = prefix.join("lib/libetmetal_capi.a");
        let libs = pkg_config(&prefix, &["--cflags", "--libs", "--static"])
            .into_iter()
            .map(|a| match a.as_str() {
                "-letmetal_capi" => static_lib.display().to_string(),
                _ => a,
            });
        run(
            Command::new("c++")
                .args(["-std=c++17", "-g", "-Wall", "-Wextra", "-Werror"])
                .args(["-fsanitize=address,undefined", "-fno-sanitize-recover=all"])
                .arg("-fno-omit-frame-pointer")
                .arg(repo().join("crates/etmetal-capi/tests/c/error_paths.cpp"))
                .args(libs)
                .arg("-o")
                .arg(&error_paths),
            "c++ tests/c/error_paths.cpp (with AddressSanitizer and UBSan)",
        );
        Built {
            prefix,
            run_pte,
            error_paths,
        }
    })
}

/// A `.pt2` fixture compiled for the GPU (`etmetal compile`'s defaults),
/// written under the scratch directory once per process (tests run in
/// parallel).
fn gpu_pte(name: &str) -> PathBuf {
    static MADE: Mutex<Vec<String>> = Mutex::new(Vec::new());
    let mut made = MADE.lock().unwrap();
    let path = scratch().join(format!("{name}.gpu.pte"));
    if !made.iter().any(|m| m == name) {
        let pt2 = repo().join(format!("tests/fixtures/{name}.pt2"));
        let graph = etmetal_graph::load_pt2(&pt2).unwrap();
        let compiled = compile(&graph, &CompileOptions::default(), &mut |_| {}).unwrap();
        assert!(
            compiled.methods[0].cpu_nodes.is_empty(),
            "{name}: all on the GPU"
        );
        std::fs::create_dir_all(scratch()).unwrap();
        std::fs::write(&path, compiled.pte).unwrap();
        made.push(name.to_string());
    }
    path
}

/// `run_pte`'s stdout for `args`.
fn run_pte(args: &[&Path], device: &str) -> String {
    let mut cmd = Command::new(&built().run_pte);
    cmd.args(args).args(["--device", device]);
    // (Mesa prints a line on stderr without one)
    cmd.env("XDG_RUNTIME_DIR", std::env::temp_dir());
    String::from_utf8(run(&mut cmd, "run_pte").stdout).unwrap()
}

/// The outputs `run_pte` printed: dtype name, shape, values.
fn printed_outputs(stdout: &str) -> Vec<(String, Vec<usize>, Vec<f64>)> {
    let mut lines = stdout.lines();
    let mut outputs = vec![];
    while let Some(line) = lines.next() {
        let Some(rest) = line.strip_prefix("output ") else {
            continue;
        };
        let (_, what) = rest.split_once(": ").unwrap();
        let (dtype, shape) = what.split_once(" [").unwrap();
        let shape = shape
            .trim_end_matches(']')
            .split(", ")
            .filter(|s| !s.is_empty())
            .map(|s| s.parse().unwrap())
            .collect();
        let values = lines
            .next()
            .unwrap()
            .split_whitespace()
            .map(|v| v.parse().unwrap())
            .collect();
        outputs.push((dtype.to_string(), shape, values));
    }
    outputs
}

/// `stdout`'s outputs are `want`, floats within `tol` (absolute and
/// relative), others exactly.
fn assert_outputs(stdout: &str, want: &[Tensor], tol: f64, what: &str) {
    let got = printed_outputs(stdout);
    assert_eq!(got.len(), want.len(), "{what}: outputs\n{stdout}");
    for (i, ((dtype, shape, values), w)) in got.iter().zip(want).enumerate() {
        assert_eq!(dtype, w.dtype().name(), "{what} output {i}");
        assert_eq!(shape.as_slice(), w.shape(), "{what} output {i}");
        let want = w.to_f64_vec();
        assert_eq!(values.len(), want.len(), "{what} output {i}");
        for (k, (a, b)) in values.iter().zip(&want).enumerate() {
            let close = match w.dtype().is_float() {
                true => (a - b).abs() <= tol + tol * b.abs(),
                false => a == b,
            };
            assert!(close, "{what} output {i}[{k}]: {a} vs {b}");
        }
    }
}

/// Files `dir/{stem}.{kind}_0.npy`, `_1`, ... that exist.
fn numbered(dir: &Path, stem: &str, kind: &str) -> Vec<PathBuf> {
    (0..)
        .map(|i| dir.join(format!("{stem}.{kind}_{i}.npy")))
        .take_while(|p| p.exists())
        .collect()
}

fn read_all(paths: &[PathBuf]) -> Vec<Tensor> {
    paths.iter().map(|p| npy::read(p).unwrap()).collect()
}

#[test]
fn the_c_example_runs_portable_programs_on_the_cpu_as_executorch_does() {
    // ExecuTorch-made programs, and the outputs ExecuTorch's runtime gave
    let pte = repo().join("crates/etmetal-pte/tests/fixtures");
    for name in ["mlp", "conv_block", "int_bool"] {
        let model = pte.join(format!("{name}.pte"));
        let inputs = numbered(&pte, name, "input");
        let mut args: Vec<&Path> = vec![&model];
        args.extend(inputs.iter().map(PathBuf::as_path));
        let stdout = run_pte(&args, "cpu");
        assert!(stdout.contains("device: cpu"), "{stdout}");
        assert!(stdout.contains(": 0 GPU partition(s)"), "{stdout}");
        let want = read_all(&numbered(&pte, name, "output"));
        assert_outputs(&stdout, &want, 1e-5, name);
    }
    // a dynamic program at 5 rows of up to 8: the outputs' shapes are 5's
    let dynamic = repo().join("crates/etmetal-runtime/tests/fixtures");
    let model = dynamic.join("dyn_mlp.pte");
    let input = dynamic.join("dyn_mlp.s5.input_0.npy");
    let stdout = run_pte(&[&model, &input], "auto");
    let want = read_all(&numbered(&dynamic, "dyn_mlp.s5", "output"));
    assert_eq!(want[0].shape()[0], 5);
    assert_outputs(&stdout, &want, 1e-5, "dyn_mlp at 5 rows");
}

#[test]
fn the_c_example_runs_gpu_delegates_on_the_adapter_as_eager_pytorch_does() {
    let fixtures = repo().join("tests/fixtures");
    for name in ["mlp", "gpt_block"] {
        let model = gpu_pte(name);
        let inputs = numbered(&fixtures, name, "input");
        let mut args: Vec<&Path> = vec![&model];
        args.extend(inputs.iter().map(PathBuf::as_path));
        // "vulkan": the test machines' adapter is Mesa's lavapipe
        let stdout = run_pte(&args, "vulkan");
        let device = stdout.lines().next().unwrap_or_default();
        assert!(device.contains("(vulkan"), "{name}: {device}");
        assert!(stdout.contains(": 1 GPU partition(s)"), "{stdout}");
        assert!(stdout.contains("; 0 CPU kernel call(s)"), "{stdout}");
        let want = read_all(&numbered(&fixtures, name, "output"));
        assert!(want.iter().all(|t| t.dtype() == DType::F32));
        assert_outputs(&stdout, &want, 1e-4, name);
    }
}

#[test]
fn the_c_example_fails_with_the_commands_exit_codes() {
    let built = built();
    let missing = Command::new(&built.run_pte)
        .arg(scratch().join("no-such.pte"))
        .output()
        .unwrap();
    assert_eq!(missing.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&missing.stderr);
    assert!(stderr.contains("run_pte: error (io): "), "{stderr}");
    assert!(stderr.contains("no-such.pte"), "{stderr}");
    // a GPU program on the CPU: refused, not run some other way
    let gpu = Command::new(&built.run_pte)
        .arg(gpu_pte("mlp"))
        .args(["--device", "cpu"])
        .output()
        .unwrap();
    assert_eq!(gpu.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&gpu.stderr);
    assert!(stderr.contains("(unsupported)"), "{stderr}");
    // a tensor-core setting the CLI would refuse is refused, named
    let coop = Command::new(&built.run_pte)
        .arg(gpu_pte("mlp"))
        .env("ETMETAL_COOP", "fast")
        .output()
        .unwrap();
    assert_eq!(coop.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&coop.stderr);
    assert!(stderr.contains("ETMETAL_COOP=`fast`"), "{stderr}");
}

#[test]
fn the_cpp_error_paths_pass_under_address_and_undefined_behavior_sanitizers() {
    let built = built();
    let fixture = |p: &str| repo().join(p);
    let mut cmd = Command::new(&built.error_paths);
    cmd.arg(fixture("crates/etmetal-pte/tests/fixtures/mlp.pte"))
        .arg(fixture("crates/etmetal-runtime/tests/fixtures/dyn_mlp.pte"))
        .arg(gpu_pte("mlp"))
        .arg(fixture("tests/malformed/pte/truncated_at_36.pte"))
        .arg(fixture("tests/fixtures/mlp.pt2"))
        // leaks of handles the test frees are errors too
        .env("ASAN_OPTIONS", "detect_leaks=1:abort_on_error=0")
        .env("UBSAN_OPTIONS", "print_stacktrace=1");
    let out = run(&mut cmd, "error_paths");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let last = stdout.lines().last().unwrap_or_default();
    assert!(last.ends_with(" passed, 0 failed"), "{stdout}");
    let passed: usize = last.split(' ').next().unwrap().parse().unwrap();
    assert!(passed > 100, "{last}");
}

#[test]
fn the_pkg_config_file_names_the_installed_header_and_libraries() {
    let prefix = &built().prefix;
    let flags = pkg_config(prefix, &["--cflags", "--libs"]);
    let lib = prefix.join("lib");
    assert_eq!(
        flags,
        [
            format!("-I{}", prefix.join("include").display()),
            format!("-L{}", lib.display()),
            "-letmetal_capi".to_string()
        ]
    );
    let version = pkg_config(prefix, &["--modversion"]);
    assert_eq!(version, [env!("CARGO_PKG_VERSION")]);
    for f in ["include/etmetal.h", "lib/libetmetal_capi.a"] {
        assert!(prefix.join(f).exists(), "{f}");
    }
    assert!(lib.join(shared_library()).exists());
}
