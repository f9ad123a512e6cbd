//! `include/etmetal.h` is what cbindgen makes of the crate now: a change
//! of the API that is not in the checked-in header fails here.
//! `ETMETAL_BLESS=1 cargo test -p etmetal-capi --test header` rewrites it.

use std::path::Path;

#[test]
fn the_checked_in_header_is_what_cbindgen_makes() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut config = cbindgen::Config::from_file(dir.join("cbindgen.toml")).unwrap();
    config.after_includes = Some(format!(
        "\n/* The version of the library this header was made with. */\n\
         #define ETMETAL_VERSION \"{}\"\n",
        env!("CARGO_PKG_VERSION")
    ));
    let bindings = cbindgen::Builder::new()
        .with_config(config)
        .with_src(dir.join("src/lib.rs"))
        .generate()
        .unwrap_or_else(|e| panic!("cbindgen: {e}"));
    let mut made = Vec::new();
    bindings.write(&mut made);
    let path = dir.join("include/etmetal.h");
    if std::env::var_os("ETMETAL_BLESS").is_some() {
        std::fs::write(&path, &made).unwrap();
        return;
    }
    let checked_in = std::fs::read(&path).unwrap_or_default();
    if checked_in != made {
        let (a, b) = (
            String::from_utf8_lossy(&checked_in),
            String::from_utf8_lossy(&made),
        );
        let line = a
            .lines()
            .zip(b.lines())
            .position(|(x, y)| x != y)
            .unwrap_or_else(|| a.lines().count().min(b.lines().count()));
        panic!(
            "{} differs from what cbindgen makes of the crate (first at line {}: {:?} vs {:?}); \
             ETMETAL_BLESS=1 cargo test -p etmetal-capi --test header rewrites it",
            path.display(),
            line + 1,
            a.lines().nth(line).unwrap_or("(end)"),
            b.lines().nth(line).unwrap_or("(end)"),
        );
    }
}
