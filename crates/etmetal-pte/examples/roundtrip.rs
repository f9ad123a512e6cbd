//! Read a `.pte`, write it again with etmetal's writer:
//! `cargo run -p etmetal-pte --example roundtrip IN.pte OUT.pte`.
//! Used to check that ExecuTorch's runtime loads what we write.

use etmetal_pte::{serialize, PteFile};

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let [input, output] = args.as_slice() else {
        eprintln!("usage: roundtrip IN.pte OUT.pte");
        std::process::exit(2);
    };
    let run = || -> etmetal_core::Result<usize> {
        let file = PteFile::load(input)?;
        let bytes = serialize(&file.program, &file.segments()?)?;
        std::fs::write(output, &bytes).map_err(|e| etmetal_core::Error::io(output, e))?;
        Ok(bytes.len())
    };
    match run() {
        Ok(n) => println!("{input} -> {output}: {n} bytes"),
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(if e.is_user_error() { 2 } else { 1 });
        }
    }
}
