//! The shared library's name as the loader knows it: an soname on Linux, an
//! install name under `@rpath` on Apple platforms (so that an app finds it in
//! its own Frameworks folder).

fn main() {
    match std::env::var("CARGO_CFG_TARGET_OS").as_deref() {
        Ok("linux" | "android") => {
            println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libetmetal_capi.so")
        }
        Ok("macos" | "ios") => {
            println!("cargo:rustc-cdylib-link-arg=-Wl,-install_name,@rpath/libetmetal_capi.dylib")
        }
        _ => {}
    }
}
