//! `compile MODEL.pt2 -o MODEL.pte [--backend cpu]`: the `etmetal compile`
//! contract through the library, until the CLI calls `compile_pt2_cpu`.

use std::path::PathBuf;
use std::process::ExitCode;

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (mut input, mut output) = (None, None);
    let mut it = args.iter();
    while let Some(a) = it.next() {
        match a.as_str() {
            "compile" => {}
            "-o" => output = it.next().map(PathBuf::from),
            "--backend" => {
                if it.next().map(String::as_str) != Some("cpu") {
                    eprintln!("only --backend cpu is supported");
                    return ExitCode::from(2);
                }
            }
            path => input = Some(PathBuf::from(path)),
        }
    }
    let (Some(input), Some(output)) = (input, output) else {
        eprintln!("usage: compile MODEL.pt2 -o MODEL.pte [--backend cpu]");
        return ExitCode::from(2);
    };
    match etmetal::compile::compile_pt2_cpu(&input).and_then(|bytes| {
        std::fs::write(&output, bytes).map_err(|e| etmetal_core::Error::io(output.display(), e))
    }) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(1)
        }
    }
}
